// The traffic model of the Metal launch plan: see traffic.h.
#include "traffic.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>

namespace tree_attn {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

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
  const uint64_t q_row_bytes = uint64_t(p.D) * plan.q_element_bytes;
  const uint64_t kv_row_bytes = uint64_t(p.D) * plan.kv_element_bytes;
  // Every thread reads its batch row's offset once.
  if (p.has_mask_offset) bytes.offsets = threadgroups * main.threads[0] * sizeof(int32_t);
  uint64_t staged_keys = 0;
  for (const Visibility& v : vis) {
    // A split loads its queries only if it has a key to look at.
    const uint64_t live_splits = uint64_t(ceil_div(v.visible_end, p.split_keys));
    bytes.query += live_splits * uint64_t(p.Hq) * p.T * q_row_bytes;
    // Each mask entry of the visible window is read once, by the lane owning its key.
    bytes.mask += uint64_t(p.Hq) * p.T * uint64_t(v.visible_end - v.offset) * plan.mask_element_bytes;
    // Every row block of every kv head stages each visible key once.
    staged_keys += uint64_t(p.Hkv) * p.n_row_blocks * uint64_t(v.visible_end);
  }
  TORCH_CHECK(skipped_keys <= staged_keys, "tree attention: skipped keys ", skipped_keys, " > staged ", staged_keys);
  bytes.key_value = 2 * (staged_keys - skipped_keys) * kv_row_bytes;
  return bytes;
}

ModelledBytes modelled_reduce_reads(const Plan& plan) {
  const TreeAttnParams& p = plan.params;
  ModelledBytes bytes;
  if (plan.launches.empty()) return bytes;
  const uint64_t slots = uint64_t(p.B) * p.Hq * p.T * p.n_splits;
  bytes.partials = slots * (uint64_t(p.D) + 2) * sizeof(float);
  // Lane 0 of each row's simdgroup reads the row's sink.
  if (p.has_sinks) bytes.sinks = uint64_t(p.B) * p.Hq * p.T * sizeof(float);
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
  return 2 * keys * uint64_t(p.D) * plan.kv_element_bytes;
}

uint64_t modelled_main_chunks(const Plan& plan, const std::vector<Visibility>& vis, uint64_t skipped_chunks) {
  const TreeAttnParams& p = plan.params;
  if (plan.launches.empty()) return 0;
  uint64_t chunks = 0;
  // Splits are whole chunks (split_keys % 32 == 0), so the splits of a row block together
  // visit ceil(visible_end / 32) chunks.
  for (const Visibility& v : vis) {
    chunks += uint64_t(p.Hkv) * p.n_row_blocks * uint64_t(ceil_div(v.visible_end, TREE_ATTN_CHUNK_KEYS));
  }
  TORCH_CHECK(skipped_chunks <= chunks, "tree attention: skipped chunks ", skipped_chunks, " > ", chunks);
  return chunks - skipped_chunks;
}

uint64_t modelled_main_simdgroup_mmas(const Plan& plan, const std::vector<Visibility>& vis,
                                      uint64_t skipped_chunks) {
  if (plan.launches.empty() || plan.family != KernelFamily::Matrix) return 0;
  const uint64_t D = uint64_t(plan.params.D);
  const uint64_t key_tiles = TREE_ATTN_CHUNK_KEYS / 8;
  const uint64_t per_row_group = 2 * (D / 8) * key_tiles;  // Q K^T and P V, all parts together
  return modelled_main_chunks(plan, vis, skipped_chunks) * per_row_group * TREE_ATTN_MMA_ROW_GROUPS;
}

namespace {

struct Skipped {
  uint64_t keys = 0, chunks = 0;
};

Skipped count_skipped(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis) {
  const Problem& p = in.p;
  if (plan.launches.empty() || p.M == 0) return {};
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
  Skipped skipped;
  for (int64_t b = 0; b < p.B; ++b) {
    const Visibility& v = vis[size_t(b)];
    // Only chunks entirely inside the window are checked (the prefix is always seen).
    for (int64_t start = ceil_div(v.offset, C) * C; start < v.visible_end; start += C) {
      const int64_t stop = std::min(start + C, v.visible_end);
      for (int64_t h = 0; h < p.Hkv; ++h) {
        for (int64_t block = 0; block < plan.params.n_row_blocks; ++block) {
          bool any = false;
          const int64_t first = block * plan.block_rows, last = std::min(rows, first + plan.block_rows);
          for (int64_t row = first; row < last && !any; ++row) {
            const int64_t hq = h * p.G + row / p.T, t = row % p.T;
            const bool* entries = seen_at + ((b * p.Hq + hq) * p.T + t) * p.M;
            for (int64_t key = start; key < stop && !any; ++key) any = entries[key - v.offset];
          }
          if (!any) {
            skipped.keys += uint64_t(stop - start);
            ++skipped.chunks;
          }
        }
      }
    }
  }
  return skipped;
}

}  // namespace

uint64_t count_skipped_keys(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis) {
  return count_skipped(in, plan, vis).keys;
}

uint64_t count_skipped_chunks(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis) {
  return count_skipped(in, plan, vis).chunks;
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

void json_traffic(std::ostringstream& s, const Plan& plan, const std::vector<Visibility>& vis, Skipped skipped_at) {
  const uint64_t skipped = skipped_at.keys;
  const ModelledBytes main = modelled_main_reads(plan, vis, skipped);
  const ModelledBytes reduce = modelled_reduce_reads(plan);
  s << "{\"main_reads\": {\"query\": " << main.query << ", \"key_value\": " << main.key_value
    << ", \"mask\": " << main.mask << ", \"offsets\": " << main.offsets << ", \"total\": " << main.total()
    << "}, \"reduce_reads\": " << reduce.total() << ", \"main_writes\": " << modelled_main_writes(plan)
    << ", \"reduce_writes\": " << modelled_reduce_writes(plan)
    << ", \"minimum_key_value\": " << minimum_key_value_bytes(plan, vis) << ", \"skipped_keys\": " << skipped << ", \"skipped_chunks\": " << skipped_at.chunks
    << ", \"main_chunks\": " << modelled_main_chunks(plan, vis, skipped_at.chunks)
    << ", \"main_simdgroup_mmas\": " << modelled_main_simdgroup_mmas(plan, vis, skipped_at.chunks)
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
    << ", \"n_row_blocks\": " << p.n_row_blocks << ", \"block_rows\": " << plan.block_rows
    << ", \"family\": \"" << family_name(plan.family) << "\", \"kv_aligned4\": " << p.kv_aligned4
    << ", \"scratch_bytes\": " << plan.scratch_bytes << ", \"params_bytes\": " << sizeof(TreeAttnParams)
    << ", \"rows_per_kv_head\": " << int64_t(p.G) * p.T << ", \"worst_case\": ";
  json_traffic(s, plan, worst_case_visibility(in.p), Skipped{});
  if (!vis.empty()) {
    s << ", \"actual\": ";
    json_traffic(s, plan, vis, in.mask.device().is_cpu() ? count_skipped(in, plan, vis) : Skipped{});
  }
  s << "}";
  return s.str();
}

}  // namespace tree_attn
