// The launch plan of the Metal tree-attention kernels: see plan.h.
#include "plan.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

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

const char* role_name(BufferRole role) {
  switch (role) {
    case BufferRole::Params: return "params";
    case BufferRole::Query: return "query";
    case BufferRole::Key: return "key";
    case BufferRole::Value: return "value";
    case BufferRole::Mask: return "mask";
    case BufferRole::Offsets: return "offsets";
    case BufferRole::PartialO: return "partial_o";
    case BufferRole::PartialM: return "partial_m";
    case BufferRole::PartialL: return "partial_l";
    case BufferRole::Output: return "output";
    case BufferRole::Lse: return "lse";
  }
  return "?";
}

Plan make_plan(const Prepared& in) {
  const Problem& p = in.p;
  Plan plan;
  plan.qkv_element_bytes = uint32_t(at::elementSize(p.dtype));
  plan.out_element_bytes = plan.qkv_element_bytes;
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
  params.has_offsets = p.has_offsets ? 1 : 0;
  params.scale = p.scale;
  params.softcap = p.softcap;
  params.n_row_blocks = int32_t(ceil_div(rows_per_head, TREE_ATTN_BLOCK_ROWS));
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

  const std::string tag = dtype_tag(p.dtype);
  const std::string d = std::to_string(p.D);
  const int64_t simdgroups = TREE_ATTN_SIMDGROUPS(p.D);

  Launch main;
  main.kernel = "tree_attn_main_" + tag + "_d" + d + (p.mask_kind == MaskKind::Bool ? "_bool" : "_float");
  main.grid = {grid_dim(params.n_splits, "key splits"), grid_dim(params.n_row_blocks, "row blocks"),
               grid_dim(p.B * p.Hkv, "B * Hkv")};
  main.threads = {uint32_t(simdgroups * TREE_ATTN_SIMD_WIDTH), 1, 1};
  main.threadgroup_memory_bytes =
      uint32_t(align_up(uint64_t(TREE_ATTN_CHUNK_KEYS) * p.D * plan.qkv_element_bytes, 16, "tile"));
  TORCH_CHECK(main.threadgroup_memory_bytes <= 32768, "tree attention: tile of ",
              main.threadgroup_memory_bytes, " bytes exceeds 32 KB of threadgroup memory");
  const bool offsets = p.has_offsets;
  main.buffers = {
      {0, BufferRole::Params, 0, false},
      {1, BufferRole::Query, storage_byte_offset(in.query), false},
      {2, BufferRole::Key, storage_byte_offset(in.key), false},
      {3, BufferRole::Value, storage_byte_offset(in.value), false},
      {4, BufferRole::Mask, storage_byte_offset(in.mask), false},
      {5, offsets ? BufferRole::Offsets : BufferRole::Query,
       offsets ? storage_byte_offset(in.offsets) : storage_byte_offset(in.query), false},
      {6, BufferRole::PartialO, plan.partial_o_offset, true},
      {7, BufferRole::PartialM, plan.partial_m_offset, true},
      {8, BufferRole::PartialL, plan.partial_l_offset, true},
  };

  Launch reduce;
  reduce.kernel = "tree_attn_reduce_" + tag + "_d" + d;
  reduce.grid = {grid_dim(ceil_div(int64_t(rows), TREE_ATTN_REDUCE_ROWS), "reduce rows"), 1, 1};
  reduce.threads = {uint32_t(TREE_ATTN_REDUCE_ROWS * TREE_ATTN_SIMD_WIDTH), 1, 1};
  reduce.buffers = {
      {0, BufferRole::Params, 0, false},
      {1, BufferRole::PartialO, plan.partial_o_offset, false},
      {2, BufferRole::PartialM, plan.partial_m_offset, false},
      {3, BufferRole::PartialL, plan.partial_l_offset, false},
      {4, BufferRole::Output, 0, true},  // fresh contiguous tensors
      {5, BufferRole::Lse, 0, true},
  };
  plan.launches = {std::move(main), std::move(reduce)};
  return plan;
}

std::vector<Visibility> visibility_from_offsets(const Problem& p, const std::vector<int64_t>& offsets) {
  std::vector<Visibility> vis(size_t(p.B));
  for (int64_t b = 0; b < p.B; ++b) {
    // The kernel reads int32 offsets (prepare() saturates int64 ones) and clamps to [0, S].
    const int64_t raw = offsets.empty() ? 0 : std::clamp<int64_t>(offsets[size_t(b)], INT32_MIN, INT32_MAX);
    vis[size_t(b)].offset = std::clamp<int64_t>(raw, 0, p.S);
    vis[size_t(b)].visible_end = std::min(vis[size_t(b)].offset + p.M, p.S);
  }
  return vis;
}

std::vector<Visibility> worst_case_visibility(const Problem& p) {
  return std::vector<Visibility>(size_t(p.B), Visibility{p.S - p.M, p.S});
}

ModelledBytes modelled_main_reads(const Plan& plan, const std::vector<Visibility>& vis, uint64_t skipped_keys) {
  const TreeAttnParams& p = plan.params;
  ModelledBytes bytes;
  if (plan.launches.empty()) return bytes;
  const Launch& main = plan.launches[0];
  const uint64_t threadgroups = uint64_t(main.grid[0]) * main.grid[1] * main.grid[2];
  const uint64_t row_bytes = uint64_t(p.D) * plan.qkv_element_bytes;
  // Every thread reads its batch row's offset once.
  if (p.has_offsets) bytes.offsets = threadgroups * main.threads[0] * sizeof(int32_t);
  uint64_t staged_keys = 0;
  for (const Visibility& v : vis) {
    // A split loads its queries only if it has a key to look at.
    const uint64_t live_splits = uint64_t(ceil_div(v.visible_end, p.split_keys));
    bytes.query += live_splits * uint64_t(p.Hq) * p.T * row_bytes;
    // Each mask entry of the visible window is read once, by the lane owning its key.
    bytes.mask += uint64_t(p.Hq) * p.T * uint64_t(v.visible_end - v.offset) * plan.mask_element_bytes;
    // Every row block of every kv head stages each visible key once.
    staged_keys += uint64_t(p.Hkv) * p.n_row_blocks * uint64_t(v.visible_end);
  }
  TORCH_CHECK(skipped_keys <= staged_keys, "tree attention: skipped keys ", skipped_keys, " > staged ", staged_keys);
  bytes.key_value = 2 * (staged_keys - skipped_keys) * row_bytes;
  return bytes;
}

ModelledBytes modelled_reduce_reads(const Plan& plan) {
  const TreeAttnParams& p = plan.params;
  ModelledBytes bytes;
  if (plan.launches.empty()) return bytes;
  const uint64_t slots = uint64_t(p.B) * p.Hq * p.T * p.n_splits;
  bytes.partials = slots * (uint64_t(p.D) + 2) * sizeof(float);
  return bytes;
}

uint64_t modelled_main_writes(const Plan& plan) {
  const TreeAttnParams& p = plan.params;
  if (plan.launches.empty()) return 0;
  return uint64_t(p.B) * p.Hq * p.T * p.n_splits * (uint64_t(p.D) + 2) * sizeof(float);
}

uint64_t modelled_reduce_writes(const Plan& plan) {
  const TreeAttnParams& p = plan.params;
  if (plan.launches.empty()) return 0;
  return uint64_t(p.B) * p.Hq * p.T * (uint64_t(p.D) * plan.out_element_bytes + sizeof(float));
}

uint64_t minimum_key_value_bytes(const Plan& plan, const std::vector<Visibility>& vis) {
  const TreeAttnParams& p = plan.params;
  uint64_t keys = 0;
  for (const Visibility& v : vis) keys += uint64_t(p.Hkv) * uint64_t(v.visible_end);
  return 2 * keys * uint64_t(p.D) * plan.qkv_element_bytes;
}

uint64_t count_skipped_keys(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis) {
  const Problem& p = in.p;
  if (plan.launches.empty() || p.M == 0) return 0;
  TORCH_CHECK(in.mask.device().is_cpu(), "count_skipped_keys needs a CPU mask");
  // seen[b][hq][t][col]: the entry does not hide its key (NaN biases count as seen, as
  // in the kernel).
  at::Tensor mask4 = in.mask.dim() == 3 ? in.mask.unsqueeze(1) : in.mask;
  mask4 = mask4.expand({p.B, p.Hq, p.T, p.M});
  const at::Tensor seen =
      (p.mask_kind == MaskKind::Bool ? mask4 : mask4.ne(-std::numeric_limits<float>::infinity()))
          .contiguous();
  const bool* seen_at = seen.data_ptr<bool>();
  const int64_t rows = p.G * p.T;
  const int64_t C = TREE_ATTN_CHUNK_KEYS;
  uint64_t skipped = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const Visibility& v = vis[size_t(b)];
    // Only chunks entirely inside the window are checked (the prefix is always seen).
    for (int64_t start = ceil_div(v.offset, C) * C; start < v.visible_end; start += C) {
      const int64_t stop = std::min(start + C, v.visible_end);
      for (int64_t h = 0; h < p.Hkv; ++h) {
        for (int64_t block = 0; block < plan.params.n_row_blocks; ++block) {
          bool any = false;
          for (int64_t row = block * TREE_ATTN_BLOCK_ROWS; row < std::min(rows, (block + 1) * TREE_ATTN_BLOCK_ROWS) && !any; ++row) {
            const int64_t hq = h * p.G + row / p.T, t = row % p.T;
            const bool* entries = seen_at + ((b * p.Hq + hq) * p.T + t) * p.M;
            for (int64_t key = start; key < stop && !any; ++key) any = entries[key - v.offset];
          }
          if (!any) skipped += uint64_t(stop - start);
        }
      }
    }
  }
  return skipped;
}

namespace {

void json_launch(std::ostringstream& s, const Launch& l) {
  s << "{\"kernel\": \"" << l.kernel << "\", \"grid\": [" << l.grid[0] << ", " << l.grid[1] << ", " << l.grid[2]
    << "], \"threads\": [" << l.threads[0] << ", " << l.threads[1] << ", " << l.threads[2]
    << "], \"threadgroup_memory_bytes\": " << l.threadgroup_memory_bytes << ", \"buffers\": [";
  for (size_t i = 0; i < l.buffers.size(); ++i) {
    const BufferBinding& b = l.buffers[i];
    s << (i ? ", " : "") << "{\"index\": " << b.index << ", \"role\": \"" << role_name(b.role)
      << "\", \"byte_offset\": " << b.byte_offset << ", \"writable\": " << (b.writable ? "true" : "false") << "}";
  }
  s << "]}";
}

void json_traffic(std::ostringstream& s, const Plan& plan, const std::vector<Visibility>& vis, uint64_t skipped) {
  const ModelledBytes main = modelled_main_reads(plan, vis, skipped);
  const ModelledBytes reduce = modelled_reduce_reads(plan);
  s << "{\"main_reads\": {\"query\": " << main.query << ", \"key_value\": " << main.key_value
    << ", \"mask\": " << main.mask << ", \"offsets\": " << main.offsets << ", \"total\": " << main.total()
    << "}, \"reduce_reads\": " << reduce.total() << ", \"main_writes\": " << modelled_main_writes(plan)
    << ", \"reduce_writes\": " << modelled_reduce_writes(plan)
    << ", \"minimum_key_value\": " << minimum_key_value_bytes(plan, vis) << ", \"skipped_keys\": " << skipped
    << ", \"visible_end\": [";
  for (size_t b = 0; b < vis.size(); ++b) s << (b ? ", " : "") << vis[b].visible_end;
  s << "]}";
}

}  // namespace

std::string plan_to_json(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis) {
  const TreeAttnParams& p = plan.params;
  std::ostringstream s;
  s << "{\"launches\": [";
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    if (i) s << ", ";
    json_launch(s, plan.launches[i]);
  }
  s << "], \"n_splits\": " << p.n_splits << ", \"split_keys\": " << p.split_keys
    << ", \"n_row_blocks\": " << p.n_row_blocks << ", \"block_rows\": " << int(TREE_ATTN_BLOCK_ROWS)
    << ", \"scratch_bytes\": " << plan.scratch_bytes << ", \"params_bytes\": " << sizeof(TreeAttnParams)
    << ", \"rows_per_kv_head\": " << int64_t(p.G) * p.T << ", \"worst_case\": ";
  json_traffic(s, plan, worst_case_visibility(in.p), 0);
  if (!vis.empty()) {
    s << ", \"actual\": ";
    json_traffic(s, plan, vis, in.mask.device().is_cpu() ? count_skipped_keys(in, plan, vis) : 0);
  }
  s << "}";
  return s.str();
}

}  // namespace tree_attn
