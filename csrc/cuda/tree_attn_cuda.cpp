// The CUDA backend: Triton-compiled kernels launched from C++ with the driver API on the
// current stream. No Python runs per call: prepare() validates, plan_launch() picks tiles,
// splits and kernel specs, the registry hands back the loaded function (a prebuilt cubin,
// or one compiled once per process), and cuLaunchKernel queues the main pass and, when
// the keys are split, the reduce pass. Offsets are never read on the host (the kernels
// clamp them), so a call never syncs and is capturable in a CUDA graph.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <cstring>
#include <limits>

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

// The kernels' arguments: one 8-byte slot each (the driver reads each parameter's own
// size from its slot), pointers then ints then floats in the kernels' order.
class Args {
 public:
  void ptr(const void* p) { put(uint64_t(reinterpret_cast<uintptr_t>(p))); }
  void integer(int64_t v, bool wide) {
    if (wide) put(v);
    else put(int32_t(v));
  }
  void f32(float v) { put(v); }
  void null_ptrs(int n) {
    for (int i = 0; i < n; ++i) put(uint64_t(0));
  }
  void** params() {
    for (int i = 0; i < n_; ++i) ptrs_[i] = &slots_[i];
    return ptrs_.data();
  }

 private:
  template <class T>
  void put(T v) {
    TORCH_INTERNAL_ASSERT(n_ < kMax);
    slots_[n_] = 0;
    std::memcpy(&slots_[n_++], &v, sizeof(T));
  }
  static constexpr int kMax = 48;
  std::array<uint64_t, kMax> slots_{};
  std::array<void*, kMax> ptrs_{};
  int n_ = 0;
};

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

Launch plan_launch(const Prepared& in, int arch, int num_sms, std::optional<int> num_splits,
                   std::optional<triton::TileConfig> config) {
  const Problem& p = in.p;
  Launch L;
  L.query = p.scale < 0 ? at::neg(in.query) : in.query;  // the kernels take |scale|
  L.key = in.key;
  L.value = in.value;
  const bool half_dot = p.q_dtype != at::kFloat;
  const int64_t R = p.G * p.T;
  L.plan = triton::choose(p.D, half_dot, p.T, R, p.B * p.Hkv, p.S, p.M, num_sms, num_splits, config);
  const auto& plan = L.plan;
  // A key tile is addressed with int32 offsets (n * key-row stride + d): a cache whose key
  // rows lie too far apart for that is read from a contiguous copy.
  if (int64_t(plan.block_n - 1) * std::max(p.k_stride[2], p.v_stride[2]) + plan.block_d >= (int64_t(1) << 31)) {
    L.key = L.key.contiguous();
    L.value = L.value.contiguous();
  }
  const auto sq = kernel_strides(L.query), sk = kernel_strides(L.key), sv = kernel_strides(L.value);
  const int64_t total_rows = p.B * p.Hq * p.T;
  bool wide = !fits_i32(total_rows) || !fits_i32(p.S);
  // aligned: Q/K/V row strides and pointers divisible by 16 (triton_compile.py's
  // specialisation; the mask is not specialised); wide: some size or stride needs int64.
  bool aligned = true;
  for (const auto* s : {sq.data(), sk.data(), sv.data(), static_cast<const int64_t*>(p.mask_stride)}) {
    for (int i = 0; i < 4; ++i) wide = wide || !fits_i32(s[i]);
  }
  for (const auto* s : {sq.data(), sk.data(), sv.data()})
    for (int i = 0; i < 3; ++i) aligned = aligned && s[i] % 16 == 0;
  const std::array<const at::Tensor*, 3> loaded{&L.query, &L.key, &L.value};
  for (const at::Tensor* t : loaded)
    if (t->numel() > 0) aligned = aligned && aligned16(t->data_ptr());

  KernelSpec& m = L.main;
  m.kind = 0;
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
  r.kind = 1;
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
         std::optional<triton::TileConfig> config) {
  const Problem& p = in.p;
  const c10::Device device = in.query.device();
  const int dev = device.index();
  c10::DeviceGuard guard(device);
  const auto& info = cuda_driver::device_info(dev);
  Launch L = plan_launch(in, info.arch, info.num_sms, num_splits, config);
  const auto& plan = L.plan;
  auto& registry = KernelRegistry::instance();
  const LoadedKernel& main_k = registry.get(L.main, dev);
  const LoadedKernel* reduce_k = L.split() ? &registry.get(L.reduce, dev) : nullptr;

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
  const int32_t off_kind = !p.has_offsets ? 0 : in.offsets.scalar_type() == at::kLong ? 2 : 1;
  const bool wide = L.main.wide;

  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
  cuda_driver::ensure_context(dev);

  Args a;
  for (const void* ptr : {addr(L.query), addr(L.key), addr(L.value), addr(in.mask), addr(in.offsets), addr(in.sinks),
                          static_cast<const void*>(out.data_ptr()), static_cast<const void*>(lse.data_ptr()),
                          partial_o, partial_m, partial_l})
    a.ptr(ptr);
  const auto sq = kernel_strides(L.query), sk = kernel_strides(L.key), sv = kernel_strides(L.value);
  for (int i = 0; i < 3; ++i) a.integer(sq[i], wide);
  for (int i = 0; i < 3; ++i) a.integer(sk[i], wide);
  for (int i = 0; i < 3; ++i) a.integer(sv[i], wide);
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
