// The launch plan of the Metal tree-attention kernels: see plan.h.
#include "metal/plan.h"

#include "tree_attn_kernels.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace tree_attn {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint64_t checked_product(std::initializer_list<uint64_t> factors, const char* what) {
  uint64_t result = 1;
  for (uint64_t f : factors)
    TORCH_CHECK_VALUE(!c10::mul_overflows(result, f, &result), "tree attention: ", what,
                      " overflows 64-bit byte arithmetic");
  return result;
}

uint64_t align_up(uint64_t x, uint64_t a, const char* what) {
  uint64_t sum = 0;
  TORCH_CHECK_VALUE(!c10::add_overflows(x, a - 1, &sum), "tree attention: ", what, " overflows");
  return sum / a * a;
}

void check_fits_i32(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value >= 0 && value <= std::numeric_limits<int32_t>::max(), "tree attention: ", what,
                    " = ", value, " exceeds the Metal kernels' 32-bit range");
}

uint32_t grid_dim(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value > 0 && value <= std::numeric_limits<uint32_t>::max(), "tree attention: ", what,
                    " = ", value, " threadgroups is not a valid Metal grid dimension");
  return uint32_t(value);
}

const char* dtype_tag(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    default: TORCH_CHECK_TYPE(false, "tree attention: no Metal kernel for dtype ", t);
  }
}

// The kernels the shader instantiates (shaders/tree_attn_kernels.h): the plan takes its
// names from here and nowhere else.
struct MainKernels {
  KernelFamily family;
  const char* tag;  // (query, K/V) dtypes
  int64_t d;
  const char* bool_mask;
  const char* float_mask;
};
#define TREE_ATTN_PLAN_MAIN(FAMILY, ENUM, TAG, D) \
  {ENUM, #TAG, D, TREE_ATTN_MAIN_KERNEL_NAME(FAMILY, TAG, D, bool), TREE_ATTN_MAIN_KERNEL_NAME(FAMILY, TAG, D, float)},
#define TREE_ATTN_PLAN_VEC(QT, KVT, TAG, D) TREE_ATTN_PLAN_MAIN(main, KernelFamily::Vector, TAG, D)
#define TREE_ATTN_PLAN_MMA(QT, KVT, TAG, D) TREE_ATTN_PLAN_MAIN(mma, KernelFamily::Matrix, TAG, D)
constexpr MainKernels kMainKernels[] = {TREE_ATTN_MAIN_TABLE(TREE_ATTN_PLAN_VEC, TREE_ATTN_PLAN_MMA)};
#undef TREE_ATTN_PLAN_MMA
#undef TREE_ATTN_PLAN_VEC
#undef TREE_ATTN_PLAN_MAIN

struct ReduceKernel {
  const char* tag;  // output dtype
  int64_t d;
  const char* name;
};
#define TREE_ATTN_PLAN_REDUCE(T, TAG, D) {#TAG, D, TREE_ATTN_REDUCE_KERNEL_NAME(TAG, D)},
constexpr ReduceKernel kReduceKernels[] = {TREE_ATTN_REDUCE_TABLE(TREE_ATTN_PLAN_REDUCE)};
#undef TREE_ATTN_PLAN_REDUCE

const MainKernels* find_main(KernelFamily family, const std::string& tag, int64_t d) {
  for (const MainKernels& k : kMainKernels)
    if (k.family == family && tag == k.tag && k.d == d) return &k;
  return nullptr;
}

const ReduceKernel* find_reduce(const std::string& tag, int64_t d) {
  for (const ReduceKernel& k : kReduceKernels)
    if (tag == k.tag && k.d == d) return &k;
  return nullptr;
}

std::string types_tag(const Problem& p) {
  const std::string q = dtype_tag(p.q_dtype);
  return p.q_dtype == p.kv_dtype ? q : q + "_" + dtype_tag(p.kv_dtype);
}

// Element strides (batch, head, row, dim): every row of `t` starts at a multiple of 4
// elements from its storage.
bool aligned4(const at::Tensor& t, const int64_t (&strides)[4]) {
  return t.storage_offset() % 4 == 0 && strides[0] % 4 == 0 && strides[1] % 4 == 0 && strides[2] % 4 == 0;
}

uint64_t storage_byte_offset(const at::Tensor& t) { return uint64_t(t.storage_offset()) * t.element_size(); }

// Keys per split: see kTargetThreadgroups in plan.h.
void choose_splits(const Problem& p, int64_t tiles, int32_t& split_keys, int32_t& n_splits) {
  const int64_t chunks = std::max<int64_t>(1, ceil_div(p.S, TREE_ATTN_CHUNK_KEYS));
  const int64_t wanted = ceil_div(kTargetThreadgroups, tiles);
  const int64_t most = std::min<int64_t>(TREE_ATTN_MAX_SPLITS, std::max<int64_t>(1, chunks / kMinChunksPerSplit));
  const int64_t splits = std::clamp<int64_t>(wanted, 1, most);
  const int64_t chunks_per_split = ceil_div(chunks, splits);
  split_keys = int32_t(chunks_per_split * TREE_ATTN_CHUNK_KEYS);
  n_splits = int32_t(ceil_div(chunks, chunks_per_split));
}

}  // namespace

const char* family_name(KernelFamily family) {
  switch (family) {
    case KernelFamily::Auto: return "auto";
    case KernelFamily::Vector: return "vector";
    case KernelFamily::Matrix: return "matrix";
  }
  return "?";
}

KernelFamily choose_family(const Problem& p) {
  const bool instantiated = find_main(KernelFamily::Matrix, types_tag(p), p.D) != nullptr;
  return instantiated && p.G * p.T > 8 ? KernelFamily::Matrix : KernelFamily::Vector;
}

std::vector<std::string> plan_kernel_names() {
  std::vector<std::string> names;
  for (const MainKernels& k : kMainKernels) {
    names.emplace_back(k.bool_mask);
    names.emplace_back(k.float_mask);
  }
  for (const ReduceKernel& k : kReduceKernels) names.emplace_back(k.name);
  return names;
}

const char* role_name(BufferRole role) {
  switch (role) {
    case BufferRole::Params: return "params";
    case BufferRole::Query: return "query";
    case BufferRole::Key: return "key";
    case BufferRole::Value: return "value";
    case BufferRole::Mask: return "mask";
    case BufferRole::MaskOffset: return "mask_offset";
    case BufferRole::Sinks: return "sinks";
    case BufferRole::PartialO: return "partial_o";
    case BufferRole::PartialM: return "partial_m";
    case BufferRole::PartialL: return "partial_l";
    case BufferRole::Output: return "output";
    case BufferRole::Lse: return "lse";
  }
  return "?";
}

Plan make_plan(const Prepared& in, KernelFamily family) {
  const Problem& p = in.p;
  Plan plan;
  // validation.cpp admits exactly the (query, K/V) dtype pairs the kernels are
  // instantiated for: one dtype, or a float32 query over float16/bfloat16 K/V.
  TORCH_CHECK_TYPE(p.q_dtype == p.kv_dtype || (p.q_dtype == at::kFloat && (p.kv_dtype == at::kHalf ||
                                                                           p.kv_dtype == at::kBFloat16)),
                   "tree attention: no Metal kernel for a ", p.q_dtype, " query over ", p.kv_dtype, " key/value");
  plan.q_element_bytes = uint32_t(at::elementSize(p.q_dtype));
  plan.kv_element_bytes = uint32_t(at::elementSize(p.kv_dtype));
  plan.out_element_bytes = plan.q_element_bytes;
  plan.mask_element_bytes = p.mask_kind == MaskKind::Bool ? 1 : 4;
  TORCH_CHECK_TYPE(in.mask.scalar_type() == (p.mask_kind == MaskKind::Bool ? at::kBool : at::kFloat),
                   "tree attention: the Metal kernels take a bool or float32 mask, got ", in.mask.scalar_type());

  // The kernels count keys, rows and heads in int32; chunk arithmetic may run 2 chunks
  // past S.
  check_fits_i32(p.S + 2 * TREE_ATTN_CHUNK_KEYS, "key capacity S (+64)");
  check_fits_i32(p.B, "batch B");
  check_fits_i32(p.Hq, "query heads Hq");
  check_fits_i32(p.T, "tree nodes T");
  int64_t rows_per_head = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(p.G, p.T, &rows_per_head), "tree attention: G * T overflows");
  check_fits_i32(rows_per_head, "rows per kv head G * T");

  TreeAttnParams& params = plan.params;
  params.q_stride_b = p.q_stride[0];
  params.q_stride_h = p.q_stride[1];
  params.q_stride_t = p.q_stride[2];
  params.k_stride_b = p.k_stride[0];
  params.k_stride_h = p.k_stride[1];
  params.k_stride_s = p.k_stride[2];
  params.v_stride_b = p.v_stride[0];
  params.v_stride_h = p.v_stride[1];
  params.v_stride_s = p.v_stride[2];
  params.mask_stride_b = p.mask_stride[0];
  params.mask_stride_h = p.mask_stride[1];
  params.mask_stride_t = p.mask_stride[2];
  params.mask_stride_m = p.mask_stride[3];
  params.B = int32_t(p.B);
  params.Hq = int32_t(p.Hq);
  params.Hkv = int32_t(p.Hkv);
  params.G = int32_t(p.G);
  params.T = int32_t(p.T);
  params.S = int32_t(p.S);
  params.M = int32_t(p.M);
  params.D = int32_t(p.D);
  params.has_mask_offset = p.has_mask_offset ? 1 : 0;
  params.has_sinks = p.has_sinks ? 1 : 0;
  params.kv_aligned4 = 0;
  params.scale = p.scale;
  params.softcap = p.softcap;
  const std::string tag = types_tag(p);
  plan.family = family == KernelFamily::Auto ? choose_family(p) : family;
  const MainKernels* main_kernels = find_main(plan.family, tag, p.D);
  TORCH_CHECK_VALUE(main_kernels != nullptr, "tree attention: no ", family_name(plan.family),
                    " Metal kernel for ", tag, " at head dim ", p.D);
  const ReduceKernel* reduce_kernel = find_reduce(dtype_tag(p.q_dtype), p.D);
  TORCH_CHECK_VALUE(reduce_kernel != nullptr, "tree attention: no Metal reduce kernel for ", p.q_dtype,
                    " at head dim ", p.D);
  const bool matrix = plan.family == KernelFamily::Matrix;
  plan.block_rows = matrix ? TREE_ATTN_MMA_BLOCK_ROWS : TREE_ATTN_BLOCK_ROWS;
  params.n_row_blocks = int32_t(ceil_div(rows_per_head, plan.block_rows));
  // 4-vector loads of K/V rows need every row to start at a multiple of 4 elements (the
  // storage buffers themselves are aligned).
  params.kv_aligned4 = aligned4(in.key, p.k_stride) && aligned4(in.value, p.v_stride) ? 1 : 0;
  if (p.empty()) return plan;

  const int64_t tiles = p.B * p.Hkv * params.n_row_blocks;
  choose_splits(p, tiles, params.split_keys, params.n_splits);
  // The reduce kernel gives each split one lane of a simdgroup.
  TORCH_INTERNAL_ASSERT(params.n_splits >= 1 && params.n_splits <= TREE_ATTN_MAX_SPLITS);

  // Scratch: partial O, then m, then l.
  const uint64_t rows = checked_product({uint64_t(p.B), uint64_t(p.Hq), uint64_t(p.T)}, "B * Hq * T");
  const uint64_t slots = checked_product({rows, uint64_t(params.n_splits)}, "partial slots");
  const uint64_t o_bytes = checked_product({slots, uint64_t(p.D), 4}, "partial output bytes");
  const uint64_t ml_bytes = checked_product({slots, 4}, "partial max/sum bytes");
  plan.partial_o_offset = 0;
  plan.partial_m_offset = align_up(o_bytes, 256, "scratch size");
  plan.partial_l_offset = align_up(plan.partial_m_offset + ml_bytes, 256, "scratch size");
  plan.scratch_bytes = align_up(plan.partial_l_offset + ml_bytes, 256, "scratch size");

  Launch main;
  main.kernel = p.mask_kind == MaskKind::Bool ? main_kernels->bool_mask : main_kernels->float_mask;
  main.grid = {grid_dim(params.n_splits, "key splits"), grid_dim(params.n_row_blocks, "row blocks"),
               grid_dim(p.B * p.Hkv, "B * Hkv")};
  if (matrix) {
    // 8 row groups of 8 rows, each 1 or 2 simdgroups (2 at D = 512); tiles of floats
    // (tree_attn_params.h).
    main.threads = {uint32_t(TREE_ATTN_MMA_SIMDGROUPS(p.D) * TREE_ATTN_SIMD_WIDTH), 1, 1};
    TORCH_INTERNAL_ASSERT(p.D % TREE_ATTN_MMA_SLICE_DIMS(p.D) == 0 && p.D % 8 == 0);
    main.threadgroup_memory_bytes =
        uint32_t(align_up(uint64_t(TREE_ATTN_MMA_TILE_FLOATS(p.D)) * sizeof(float), 16, "tile"));
  } else {
    main.threads = {uint32_t(TREE_ATTN_SIMDGROUPS(p.D) * TREE_ATTN_SIMD_WIDTH), 1, 1};
    // The K/V tile: 32 keys x one slice of the head dim (tree_attn_params.h).
    const int64_t slice_dims = TREE_ATTN_SLICE_DIMS(p.D, int64_t(plan.kv_element_bytes));
    TORCH_INTERNAL_ASSERT(p.D % slice_dims == 0 && slice_dims % TREE_ATTN_SIMD_WIDTH == 0);
    main.threadgroup_memory_bytes =
        uint32_t(align_up(uint64_t(TREE_ATTN_CHUNK_KEYS) * slice_dims * plan.kv_element_bytes, 16, "tile"));
  }
  TORCH_CHECK(main.threadgroup_memory_bytes <= TREE_ATTN_TILE_BYTES, "tree attention: tile of ",
              main.threadgroup_memory_bytes, " bytes exceeds 32 KB of threadgroup memory");
  const bool has_offset = p.has_mask_offset;
  main.buffers = {
      {0, BufferRole::Params, 0, false},
      {1, BufferRole::Query, storage_byte_offset(in.query), false},
      {2, BufferRole::Key, storage_byte_offset(in.key), false},
      {3, BufferRole::Value, storage_byte_offset(in.value), false},
      {4, BufferRole::Mask, storage_byte_offset(in.mask), false},
      {5, has_offset ? BufferRole::MaskOffset : BufferRole::Query,
       has_offset ? storage_byte_offset(in.mask_offset) : storage_byte_offset(in.query), false},
      {6, BufferRole::PartialO, plan.partial_o_offset, true},
      {7, BufferRole::PartialM, plan.partial_m_offset, true},
      {8, BufferRole::PartialL, plan.partial_l_offset, true},
  };

  Launch reduce;
  reduce.kernel = reduce_kernel->name;
  reduce.grid = {grid_dim(ceil_div(int64_t(rows), TREE_ATTN_REDUCE_ROWS), "reduce rows"), 1, 1};
  reduce.threads = {uint32_t(TREE_ATTN_REDUCE_ROWS * TREE_ATTN_SIMD_WIDTH), 1, 1};
  reduce.buffers = {
      {0, BufferRole::Params, 0, false},
      {1, BufferRole::PartialO, plan.partial_o_offset, false},
      {2, BufferRole::PartialM, plan.partial_m_offset, false},
      {3, BufferRole::PartialL, plan.partial_l_offset, false},
      {4, BufferRole::Output, 0, true},  // fresh contiguous tensors
      {5, BufferRole::Lse, 0, true},
      // No sinks: a read-only region the kernel then never reads (Metal wants every
      // declared buffer bound).
      {6, p.has_sinks ? BufferRole::Sinks : BufferRole::PartialM,
       p.has_sinks ? storage_byte_offset(in.sinks) : plan.partial_m_offset, false},
  };
  plan.launches = {std::move(main), std::move(reduce)};
  return plan;
}

const at::Tensor& CallTensors::tensor_for(BufferRole role) const {
  switch (role) {
    case BufferRole::Query: return in.query;
    case BufferRole::Key: return in.key;
    case BufferRole::Value: return in.value;
    case BufferRole::Mask: return in.mask;
    case BufferRole::MaskOffset: return in.mask_offset;
    case BufferRole::Sinks: return in.sinks;
    case BufferRole::PartialO:
    case BufferRole::PartialM:
    case BufferRole::PartialL: return scratch;
    case BufferRole::Output: return output;
    case BufferRole::Lse: return lse;
    case BufferRole::Params: break;
  }
  TORCH_CHECK(false, "tree attention: buffer role ", role_name(role), " is bound as bytes, not a tensor");
}

}  // namespace tree_attn
