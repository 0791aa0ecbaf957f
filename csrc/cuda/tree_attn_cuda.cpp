// The CUDA backend: Triton- and Gluon-compiled kernels launched from C++ with the driver API
// on the current stream. No Python runs per call: prepare() validates, plan_launch() picks
// the main kernel (Hopper on sm_90 where it covers the call, else Triton), tiles, splits and
// kernel specs, the registry hands back the loaded function (a prebuilt cubin, or one
// compiled once per process), and cuLaunchKernel queues the main pass and, when the keys are
// split, the reduce pass. Offsets are never read on the host (the kernels clamp them), so a
// call never syncs and is capturable in a CUDA graph.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <sstream>

#include "backend.h"
#include "cuda/driver.h"
#include "cuda/launch.h"

namespace tree_attn::cuda {
namespace {

int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return int32_t(DtypeCode::F32);
    case at::kHalf: return int32_t(DtypeCode::F16);
    case at::kBFloat16: return int32_t(DtypeCode::BF16);
    default: TORCH_CHECK(false, "tree_attn: no CUDA kernel for dtype ", t);
  }
}

// Element strides as the kernels take them: 0 along a dimension of size 1.
std::array<int64_t, 4> kernel_strides(const at::Tensor& t) {
  std::array<int64_t, 4> s{};
  for (int i = 0; i < 4; ++i) s[i] = t.size(i) == 1 ? 0 : t.stride(i);
  s[3] = 1;
  return s;
}

bool fits_i32(int64_t v) { return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(); }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The kernels' arguments in the kernels' order: one 8-byte slot each (the driver reads each
// parameter's own size from its slot), tensor maps (128 bytes) in their own storage.
class Args {
 public:
  void ptr(const void* p) { put(uint64_t(reinterpret_cast<uintptr_t>(p))); }
  void integer(int64_t v, bool wide) {
    if (wide) put(v);
    else put(int32_t(v));
  }
  void i32(int32_t v) { put(v); }
  void i64(int64_t v) { put(v); }
  void f32(float v) { put(v); }
  void null_ptrs(int n) {
    for (int i = 0; i < n; ++i) put(uint64_t(0));
  }
  cuda_driver::CUtensorMap* tensor_map() {
    TORCH_INTERNAL_ASSERT(n_ < kMax && n_maps_ < kMaxMaps);
    ptrs_[n_++] = &maps_[n_maps_];
    return &maps_[n_maps_++];
  }
  void** params() { return ptrs_.data(); }
  int size() const { return n_; }

 private:
  template <class T>
  void put(T v) {
    TORCH_INTERNAL_ASSERT(n_ < kMax);
    slots_[n_] = 0;
    std::memcpy(&slots_[n_], &v, sizeof(T));
    ptrs_[n_] = &slots_[n_];
    ++n_;
  }
  static constexpr int kMax = 64, kMaxMaps = 2;
  std::array<cuda_driver::CUtensorMap, kMaxMaps> maps_{};
  std::array<uint64_t, kMax> slots_{};
  std::array<void*, kMax> ptrs_{};
  int n_ = 0, n_maps_ = 0;
};

// Element strides of a [B, H, S, D] K/V for a tensor map: a size-1 dimension's stride does
// not address anything but must still be a valid (16-byte multiple) stride, so it takes
// another dimension's (hopper_kernels._tma_strides).
std::array<int64_t, 4> tma_strides(const at::Tensor& t) {
  int64_t fallback = t.size(3);
  for (int i : {2, 1, 0})
    if (t.size(i) > 1) {
      fallback = t.stride(i);
      break;
    }
  std::array<int64_t, 4> s{};
  for (int i = 0; i < 3; ++i) s[i] = t.size(i) > 1 ? t.stride(i) : fallback;
  s[3] = 1;
  return s;
}

// One tensor-descriptor parameter: the CUtensorMap of t (Triton's host-side encoding: dims
// and box innermost first, byte strides of the outer dims, 128-byte L2 promotion, no OOB
// fill: reads past S give zeros), then its shape (4 x int32) and element strides (4 x int64).
void push_tensor_map(Args& a, const at::Tensor& t, const TmaMeta& meta) {
  const auto& drv = cuda_driver::driver();
  TORCH_CHECK(drv.cuTensorMapEncodeTiled != nullptr, "tree_attn: the CUDA driver lacks cuTensorMapEncodeTiled");
  TORCH_INTERNAL_ASSERT(meta.block.size() == 4 && t.dim() == 4);
  const auto st = tma_strides(t);
  std::array<uint64_t, 4> dims{};
  std::array<uint64_t, 3> byte_strides{};
  std::array<uint32_t, 4> box{}, elem_strides{1, 1, 1, 1};
  for (int i = 0; i < 4; ++i) {
    dims[i] = uint64_t(t.size(3 - i));
    box[i] = meta.block[3 - i];
  }
  for (int i = 0; i < 3; ++i) byte_strides[i] = uint64_t(st[2 - i]) * uint64_t(meta.elem_size);
  cuda_driver::CUtensorMap* map = a.tensor_map();
  cuda_driver::check(drv.cuTensorMapEncodeTiled(map, meta.data_type, 4, const_cast<void*>(t.const_data_ptr()),
                                                dims.data(), byte_strides.data(), box.data(), elem_strides.data(),
                                                cuda_driver::CU_TENSOR_MAP_INTERLEAVE_NONE, meta.swizzle,
                                                cuda_driver::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                                cuda_driver::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                     "cuTensorMapEncodeTiled");
  for (int i = 0; i < 4; ++i) a.i32(int32_t(t.size(i)));
  for (int i = 0; i < 4; ++i) a.i64(st[i]);
}

// The process default (README, "The CUDA kernels"): the Hopper kernel where it covers a call.
// torch_tree_attn.backends.cuda.register() sets it from TORCH_TREE_ATTN_CUDA_KERNEL, and to Triton where the
// install can neither load nor compile the Hopper kernel.
std::atomic<int> g_default_choice{int(KernelChoice::Auto)};

void launch(const LoadedKernel& k, int64_t gx, int64_t gy, int64_t gz, Args& args, void* stream) {
  TORCH_CHECK(gx > 0 && gx <= std::numeric_limits<int32_t>::max() && gy > 0 && gy <= 65535 && gz > 0 && gz <= 65535,
              "tree_attn: CUDA grid (", gx, ", ", gy, ", ", gz, ") is out of range (B * Hkv must be <= 65535)");
  args.null_ptrs(k.scratch_args);
  cuda_driver::check(cuda_driver::driver().cuLaunchKernel(
                         k.function, unsigned(gx), unsigned(gy), unsigned(gz), unsigned(k.threads), 1, 1,
                         unsigned(k.shared), static_cast<cuda_driver::CUstream>(stream), args.params(), nullptr),
                     "cuLaunchKernel");
}

}  // namespace

void set_default_choice(KernelChoice choice) { g_default_choice.store(int(choice)); }
KernelChoice default_choice() { return KernelChoice(g_default_choice.load()); }

std::string hopper_why_not(const Prepared& in, int arch) {
  const Problem& p = in.p;
  std::ostringstream why;
  if (arch != 90) {
    why << "compute capability " << arch / 10 << "." << arch % 10 << " (the Hopper kernel is sm_90)";
  } else if ((p.q_dtype != at::kHalf && p.q_dtype != at::kBFloat16) || p.kv_dtype != p.q_dtype) {
    why << "query " << p.q_dtype << " over key/value " << p.kv_dtype << " (covered: float16 or bfloat16, one dtype)";
  } else if (!triton::hopper_config(p.D)) {
    why << "head dim " << p.D << " (covered:";
    const char* sep = " ";
    for (int64_t d : triton::hopper_head_dims()) why << sep << d, sep = ", ";
    why << ")";
  } else if (p.S < 1 || p.S >= (int64_t(1) << 31)) {
    why << "S=" << p.S << " (covered: 1 <= S < 2^31)";
  } else if (p.B * p.Hkv > 65535) {
    why << "B * Hkv = " << p.B * p.Hkv << " > 65535";
  } else {
    const int64_t elem = int64_t(c10::elementSize(p.kv_dtype));
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &in.key}, {"value", &in.value}}) {
      const auto st = tma_strides(*t);
      if (!aligned16(t->const_data_ptr())) {
        why << name << "'s data pointer is not 16-byte aligned (TMA)";
        break;
      }
      bool bad = t->stride(3) != 1 && t->size(3) > 1;
      for (int i = 0; i < 3 && !bad; ++i) bad = (st[i] * elem) % 16 != 0 || st[i] * elem >= (int64_t(1) << 40);
      if (bad) {
        why << name << "'s strides (" << t->stride(0) << ", " << t->stride(1) << ", " << t->stride(2) << ", "
            << t->stride(3) << ") are not 16-byte multiples below 2^40 bytes with a unit last stride (TMA)";
        break;
      }
    }
  }
  return why.str();
}

Launch plan_launch(const Prepared& in, int arch, int num_sms, std::optional<int> num_splits,
                   std::optional<triton::TileConfig> config, std::optional<KernelChoice> choice) {
  const Problem& p = in.p;
  Launch L;
  L.query = p.scale < 0 ? at::neg(in.query) : in.query;  // the kernels take |scale|
  L.key = in.key;
  L.value = in.value;
  const bool half_dot = p.q_dtype != at::kFloat;
  const int64_t R = p.G * p.T;
  const KernelChoice want = config ? KernelChoice::Triton : choice.value_or(default_choice());
  bool hopper = false;
  if (want != KernelChoice::Triton) {
    const std::string why = hopper_why_not(in, arch);
    TORCH_CHECK_VALUE(why.empty() || want != KernelChoice::Hopper, "the Hopper kernel does not cover this call: ", why);
    hopper = why.empty();
  }
  L.plan = hopper ? triton::choose_hopper(p.D, R, p.B * p.Hkv, p.S, p.M, num_sms, num_splits)
                  : triton::choose(p.D, half_dot, p.T, R, p.B * p.Hkv, p.S, p.M, num_sms, num_splits, config);
  const auto& plan = L.plan;
  // A Triton key tile is addressed with int32 offsets (n * key-row stride + d): a cache whose
  // key rows lie too far apart for that is read from a contiguous copy (TMA needs none).
  if (!hopper &&
      int64_t(plan.block_n - 1) * std::max(p.k_stride[2], p.v_stride[2]) + plan.block_d >= (int64_t(1) << 31)) {
    L.key = L.key.contiguous();
    L.value = L.value.contiguous();
  }
  const auto sq = kernel_strides(L.query), sk = kernel_strides(L.key), sv = kernel_strides(L.value);
  const int64_t total_rows = p.B * p.Hq * p.T;
  bool wide = !fits_i32(total_rows) || !fits_i32(p.S);
  // aligned: the pointers (and for Triton the Q/K/V row strides) divisible by 16
  // (compiler.py's / hopper_kernels.py's specialisation; the mask is not specialised);
  // wide: some size or stride needs int64. The Hopper kernel reads K/V through tensor maps,
  // so only Q's and the mask's strides are its integer strides.
  bool aligned = true;
  for (const auto* s : {sq.data(), static_cast<const int64_t*>(p.mask_stride)})
    for (int i = 0; i < 4; ++i) wide = wide || !fits_i32(s[i]);
  if (!hopper) {
    for (const auto* s : {sk.data(), sv.data()})
      for (int i = 0; i < 4; ++i) wide = wide || !fits_i32(s[i]);
    for (const auto* s : {sq.data(), sk.data(), sv.data()})
      for (int i = 0; i < 3; ++i) aligned = aligned && s[i] % 16 == 0;
    const std::array<const at::Tensor*, 3> loaded{&L.query, &L.key, &L.value};
    for (const at::Tensor* t : loaded)
      if (t->numel() > 0) aligned = aligned && aligned16(t->data_ptr());
  } else {
    aligned = L.query.numel() == 0 || aligned16(L.query.data_ptr());
  }

  KernelSpec& m = L.main;
  m.kind = int32_t(hopper ? KernelKind::HopperMain : KernelKind::Main);
  m.arch = arch;
  m.q_dtype = dtype_code(p.q_dtype);
  m.kv_dtype = dtype_code(p.kv_dtype);
  m.head_dim = int32_t(p.D);
  m.block_m = plan.block_m;
  m.block_n = plan.block_n;
  m.block_d = plan.block_d;
  m.window_n = plan.window_n;
  m.num_warps = plan.num_warps;
  m.num_stages = plan.num_stages;
  m.mask_float = p.mask_kind == MaskKind::Additive;
  m.softcap = p.softcap > 0.0f;
  m.skip_unseen = plan.skip_unseen;
  m.aligned = aligned;
  m.wide = wide;

  KernelSpec& r = L.reduce;
  r.kind = int32_t(KernelKind::Reduce);
  r.arch = arch;
  r.q_dtype = m.q_dtype;
  r.head_dim = m.head_dim;
  r.block_d = plan.block_d;
  r.block_r = plan.reduce_block_r;
  r.chunk = triton::kReduceChunk;
  r.num_warps = triton::kReduceWarps;
  r.num_stages = 1;
  r.aligned = 1;  // its pointers are the partials (fresh allocations) and the outputs
  r.wide = wide;
  return L;
}

void run(const Prepared& in, at::Tensor& out, at::Tensor& lse, std::optional<int> num_splits,
         std::optional<triton::TileConfig> config, std::optional<KernelChoice> choice) {
  const Problem& p = in.p;
  const c10::Device device = in.query.device();
  const int dev = device.index();
  c10::DeviceGuard guard(device);
  const auto& info = cuda_driver::device_info(dev);
  // A driver without tensor maps (CUDA < 12) runs everything on the Triton kernel.
  if (cuda_driver::driver().cuTensorMapEncodeTiled == nullptr && choice.value_or(default_choice()) == KernelChoice::Auto)
    choice = KernelChoice::Triton;
  Launch L = plan_launch(in, info.arch, info.num_sms, num_splits, config, choice);
  const auto& plan = L.plan;
  const bool hopper = plan.kernel == triton::MainKernel::Hopper;
  auto& registry = KernelRegistry::instance();
  const LoadedKernel& main_k = registry.get(L.main, dev);
  const LoadedKernel* reduce_k = L.split() ? &registry.get(L.reduce, dev) : nullptr;
  TORCH_CHECK(!hopper || main_k.tma.size() == 2, "tree_attn: the Hopper kernel ", describe(L.main),
              " was registered without its two tensor-map descriptions");

  const int64_t total_rows = p.B * p.Hq * p.T;
  // The split partials, one allocation: O [splits, rows, D], then m and l [splits, rows].
  at::Tensor partials;
  const float *po = nullptr, *pm = nullptr, *pl = nullptr;
  if (L.split()) {
    // Each part starts 16-byte aligned (the kernels' pointer specialisation).
    const int64_t rows = int64_t(plan.num_splits) * total_rows, rows16 = (rows + 3) / 4 * 4;
    partials = at::empty({rows * p.D + 2 * rows16}, in.query.options().dtype(at::kFloat));
    po = partials.const_data_ptr<float>();
    pm = po + rows * p.D;
    pl = pm + rows16;
  }
  // Empty tensors may have no valid address; they are never dereferenced.
  const void* dummy = out.data_ptr();
  auto addr = [dummy](const at::Tensor& t) -> const void* {
    return t.defined() && t.numel() > 0 ? t.const_data_ptr() : dummy;
  };
  const void* partial_o = L.split() ? static_cast<const void*>(po) : lse.const_data_ptr();
  const void* partial_m = L.split() ? static_cast<const void*>(pm) : lse.const_data_ptr();
  const void* partial_l = L.split() ? static_cast<const void*>(pl) : lse.const_data_ptr();
  const int32_t off_kind = !p.has_mask_offset ? 0 : in.mask_offset.scalar_type() == at::kLong ? 2 : 1;
  const bool wide = L.main.wide;

  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
  cuda_driver::ensure_context(dev);

  // The main kernels' parameters: Triton: Q, K, V pointers, ..., then Q/K/V strides;
  // Hopper: Q, then K and V as tensor maps (each with its shape and strides), ..., then Q's
  // strides only. The rest is common.
  Args a;
  a.ptr(addr(L.query));
  if (hopper) {
    push_tensor_map(a, L.key, main_k.tma[0]);
    push_tensor_map(a, L.value, main_k.tma[1]);
  } else {
    a.ptr(addr(L.key));
    a.ptr(addr(L.value));
  }
  for (const void* ptr : {addr(in.mask), addr(in.mask_offset), addr(in.sinks), static_cast<const void*>(out.data_ptr()),
                          static_cast<const void*>(lse.data_ptr()), partial_o, partial_m, partial_l})
    a.ptr(ptr);
  const auto sq = kernel_strides(L.query), sk = kernel_strides(L.key), sv = kernel_strides(L.value);
  for (int i = 0; i < 3; ++i) a.integer(sq[i], wide);
  if (!hopper) {
    for (int i = 0; i < 3; ++i) a.integer(sk[i], wide);
    for (int i = 0; i < 3; ++i) a.integer(sv[i], wide);
  }
  for (int i = 0; i < 4; ++i) a.integer(p.mask_stride[i], wide);
  for (int64_t v : {p.Hkv, p.G, p.T, p.S, p.M, p.G * p.T, total_rows, int64_t(plan.num_splits),
                    int64_t(plan.window_units), int64_t(off_kind), int64_t(p.has_sinks)})
    a.integer(v, wide);
  a.f32(std::abs(p.scale));
  a.f32(p.softcap > 0.0f ? p.softcap : 1.0f);
  launch(main_k, plan.row_blocks, p.B * p.Hkv, plan.num_splits, a, stream);

  if (reduce_k != nullptr) {
    Args r;
    for (const void* ptr : {partial_o, partial_m, partial_l, addr(in.sinks),
                            static_cast<const void*>(out.data_ptr()), static_cast<const void*>(lse.data_ptr())})
      r.ptr(ptr);
    for (int64_t v : {total_rows, p.T, p.Hq, int64_t(plan.num_splits), int64_t(p.has_sinks)}) r.integer(v, wide);
    launch(*reduce_k, (total_rows + plan.reduce_block_r - 1) / plan.reduce_block_r, 1, 1, r, stream);
  }
}

namespace {

struct CudaBackend {
  static constexpr OffsetCheck kOffsetCheck = OffsetCheck::ClampInKernelAnyInt;
  static void run(const Prepared& in, at::Tensor& out, at::Tensor& lse) { ::tree_attn::cuda::run(in, out, lse); }
};

}  // namespace
}  // namespace tree_attn::cuda

TREE_ATTN_REGISTER_BACKEND(tree_attn, CUDA, ::tree_attn::cuda::CudaBackend)
