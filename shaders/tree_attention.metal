// Tree attention for speculative-decoding verification: a main pass over key splits and
// a reduce pass that merges the splits. The launch geometry, buffer bindings and the
// traffic model live in csrc/plan.h; the parameter block in tree_attn_params.h.
//
// Written in the conservative MSL subset the CPU simulator (tests/sim) executes: scalar
// device loads and stores, simd_* collectives, threadgroup barriers. Scores use -INFINITY
// as "masked" and partials use NaN as "poisoned"; the host must compile this source with
// fast math off so the comparisons against -INFINITY and the isfinite/isnan tests below
// keep their meaning.
#include <metal_stdlib>
#include "tree_attn_params.h"

using namespace metal;

// Lane j of the result holds sum over all 32 lanes of x[j]: a transpose-reduce in five
// butterfly stages. At the stage of width w a lane keeps the half of its live values
// whose key index has bit w equal to its own lane bit w, sends the other half to lane
// (lane ^ w) and adds what it receives, so the live set halves every stage:
// 16 + 8 + 4 + 2 + 1 = 31 shuffles, against 32 x 5 for one simd_sum per key.
// Destroys x.
inline float simd_transpose_sum(thread float* x, ushort lane) {
  for (ushort w = 16; w >= 1; w >>= 1) {
    const bool upper = (lane & w) != 0;
    for (ushort i = 0; i < w; ++i) {
      const float keep = upper ? x[i + w] : x[i];
      const float give = upper ? x[i] : x[i + w];
      x[i] = keep + simd_shuffle_xor(give, w);
    }
  }
  return x[0];
}

// The additive bias a mask entry stands for.
inline float mask_bias(uchar attend) { return attend != 0 ? 0.0f : -INFINITY; }
inline float mask_bias(float bias) { return bias; }

// ---------------------------------------------------------------------------------------
// Main pass.
//
// Threadgroup (split s, row block rb, batch row b * Hkv + kv head h): the rows of kv head
// h are its G x T (query head, tree node) pairs, row = g * T + t; the block is rows
// [32 rb, 32 rb + 32), the last block may be partial. The threadgroup walks the keys of
// split s that batch row b may see, [s * split_keys, (s + 1) * split_keys) cut to
// [0, min(off_b + M, S)), in chunks of 32, and writes for every row an unnormalised
// partial output with its running max and sum (flash-decoding style).
// Simdgroup k owns rows [k * 32 / NSG, (k + 1) * 32 / NSG) of the block (NSG = 4, 8, 16
// for D <= 128, 256, 512: at most 2 x 4 x D/32 <= 64 float registers of query and
// accumulator per lane, at most 512 threads); lane l owns head dims l, l + 32, ... of
// those rows' query (pre-scaled, float) and accumulator, and key l of every chunk for the
// softmax. The query (type QT) may be wider than K/V (type KVT): it is converted to float
// once, K and V are staged and read as KVT.
// Staging: a chunk's K (then V) is staged in threadgroup memory as 32 keys x SLICE_D dims,
// in D / SLICE_D slices of the head dim, SLICE_D the widest that fits 32 KB (D, except
// float32 at D = 512: two slices of 256). Scores sum per-slice partial dots (the
// transpose-reduce is linear); P.V accumulates each slice's dims.
// Traffic: each K and V byte in the visible range is fetched from device memory once per
// threadgroup (staged in threadgroup memory, each byte in exactly one slice) and serves
// all 32 rows of the block, i.e. ceil(G * T / 32) times per call, not G * T times. A
// chunk whose window mask hides it from every row of the block is never fetched.
//
// Non-finite values (README, "Non-finite values"). A row sees key j when its bias is not
// -inf (prefix keys: 0; window keys: the mask, a NaN bias counts as seen; keys at or past
// the range: never). What a row does not see is excluded by selection, never by
// arithmetic, so NaN or inf there cannot reach it (NaN + -inf and 0 * NaN are NaN):
//  - scores: an entry the row does not see is -inf whatever its raw score; a seen entry
//    whose raw score (scale * q.k, float32, before softcap) is not finite, or whose bias is
//    NaN or +inf, sets the row's poison flag and counts as -inf in the softmax. A
//    non-finite query element or key element makes every raw score it enters non-finite,
//    so this one test covers the query, the keys and the biases;
//  - values: in P.V a row accumulates only the keys it sees (the weight of an unseen key
//    is the sentinel -1 and the key is skipped), seen keys with their weight even when it
//    is 0. A non-finite value of a seen key therefore makes the row's accumulator
//    non-finite, and a non-finite accumulator stays non-finite (rescaling multiplies by a
//    finite factor, additions cannot cancel inf or NaN), so at the end the row is poisoned
//    if its flag is set or any of its accumulator elements is not finite. This needs no
//    per-key flag in threadgroup memory (the tile may take the whole 32 KB) and no read or barrier beyond the unpoisoned kernel's;
//  - a poisoned row writes its partial with m = l = NaN; the reduce pass gives NaN output
//    and NaN lse to a row with any poisoned split. A row that sees nothing in a split
//    writes m = -inf, l = 0, o = 0 there, whatever its query holds.
// ---------------------------------------------------------------------------------------
template <typename QT, typename KVT, int D, typename MaskT>
[[kernel]] void tree_attn_main(
    constant TreeAttnParams& p [[buffer(0)]],
    device const QT* query [[buffer(1)]],
    device const KVT* key [[buffer(2)]],
    device const KVT* value [[buffer(3)]],
    device const MaskT* mask [[buffer(4)]],
    device const int* offsets [[buffer(5)]],
    device float* partial_o [[buffer(6)]],  // [B, Hq, T, n_splits, D]
    device float* partial_m [[buffer(7)]],  // [B, Hq, T, n_splits]
    device float* partial_l [[buffer(8)]],  // [B, Hq, T, n_splits]
    threadgroup KVT* kv_tile [[threadgroup(0)]],  // [32 keys][SLICE_D]: K, then V, slice by slice
    uint3 group [[threadgroup_position_in_grid]],
    uint thread_index [[thread_index_in_threadgroup]],
    ushort simd_index [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = TREE_ATTN_SIMDGROUPS(D);
  constexpr int ROWS = TREE_ATTN_BLOCK_ROWS / NSG;  // rows per simdgroup
  constexpr int DPL = D / TREE_ATTN_SIMD_WIDTH;     // head dims per lane
  constexpr int CHUNK = TREE_ATTN_CHUNK_KEYS;
  constexpr int THREADS = NSG * TREE_ATTN_SIMD_WIDTH;
  constexpr int SLICE_D = TREE_ATTN_SLICE_DIMS(D, sizeof(KVT));  // head dims per staged slice
  constexpr int SLICES = D / SLICE_D;
  constexpr int DPS = SLICE_D / TREE_ATTN_SIMD_WIDTH;             // dims per lane per slice

  const int split = int(group.x);
  const int b = int(group.z) / p.Hkv;
  const int h = int(group.z) % p.Hkv;
  const int rows_per_head = p.G * p.T;

  // Offsets are clamped here, not checked on the host (that would sync the GPU): keys
  // outside [0, S) are never read whatever the offset.
  const int off = p.has_offsets != 0 ? clamp(offsets[b], 0, p.S) : 0;
  const int visible_end = off + min(p.M, p.S - off);  // min(off + M, S) without overflow
  const int begin = split * p.split_keys;
  // begin == end: nothing to see. (begin + split_keys may exceed int range for huge S.)
  const int end = begin + clamp(visible_end - begin, 0, p.split_keys);

  // The rows of this simdgroup.
  bool row_valid[ROWS];
  int row_head[ROWS];  // query head
  int row_node[ROWS];  // tree node
  for (int r = 0; r < ROWS; ++r) {
    const int row = int(group.y) * TREE_ATTN_BLOCK_ROWS + int(simd_index) * ROWS + r;
    row_valid[r] = row < rows_per_head;
    const int g = row_valid[r] ? row / p.T : 0;
    row_head[r] = h * p.G + g;
    row_node[r] = row_valid[r] ? row % p.T : 0;
  }

  float q[ROWS][DPL];
  float o[ROWS][DPL];
  float m[ROWS];       // running max of the scores
  float l[ROWS];       // running sum of exp(score - m)
  bool poison[ROWS];   // this lane's key of some chunk poisons the row (score or bias)
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    poison[r] = false;
    const long q_base = long(b) * p.q_stride_b + long(row_head[r]) * p.q_stride_h +
                        long(row_node[r]) * p.q_stride_t;
    for (int i = 0; i < DPL; ++i) {
      o[r][i] = 0.0f;
      q[r][i] = (row_valid[r] && begin < end) ? float(query[q_base + lane + i * 32]) * p.scale : 0.0f;
    }
  }

  const long k_base = long(b) * p.k_stride_b + long(h) * p.k_stride_h;
  const long v_base = long(b) * p.v_stride_b + long(h) * p.v_stride_h;

  for (int chunk = begin; chunk < end; chunk += CHUNK) {
    const int chunk_len = min(CHUNK, end - chunk);
    const int key_index = chunk + int(lane);

    // The bias each of my rows gives key `key_index`: the prefix is always attended,
    // keys past the range are never seen, window keys follow the mask. Each mask entry
    // of the block is read once, by the lane that owns its key.
    float bias[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      if (key_index >= end || !row_valid[r]) {
        bias[r] = -INFINITY;
      } else if (key_index < off) {
        bias[r] = 0.0f;
      } else {
        const long mask_index = long(b) * p.mask_stride_b + long(row_head[r]) * p.mask_stride_h +
                                long(row_node[r]) * p.mask_stride_t +
                                long(key_index - off) * p.mask_stride_m;
        bias[r] = mask_bias(mask[mask_index]);
      }
    }

    // Only a chunk inside the window can be hidden from every row. Decide for the whole
    // threadgroup before fetching K. The flags borrow the tile: it is free between chunks
    // and it may take all 32 KB.
    if (chunk >= off) {
      bool seen = false;
      for (int r = 0; r < ROWS; ++r) seen = seen || !(bias[r] == -INFINITY);
      const bool simdgroup_sees = simd_any(seen);
      if (lane == 0) kv_tile[simd_index] = KVT(simdgroup_sees ? 1.0f : 0.0f);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      bool block_sees = false;
      for (int k = 0; k < NSG; ++k) block_sees = block_sees || float(kv_tile[k]) != 0.0f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (!block_sees) continue;
    }

    // Raw scores (scale * q.k), slice by slice: lane j ends with raw[r] of key j. K rows
    // past the range are zero-filled, never read.
    float raw[ROWS];
    for (int r = 0; r < ROWS; ++r) raw[r] = 0.0f;
    for (int s = 0; s < SLICES; ++s) {
      if (s > 0) threadgroup_barrier(mem_flags::mem_threadgroup);  // the last slice is read
      for (int e = int(thread_index); e < CHUNK * SLICE_D; e += THREADS) {
        const int k = e / SLICE_D;
        const int d = s * SLICE_D + e % SLICE_D;
        kv_tile[e] = k < chunk_len ? key[k_base + long(chunk + k) * p.k_stride_s + d] : KVT(0.0f);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int r = 0; r < ROWS; ++r) {
        float partial[CHUNK];
        for (int k = 0; k < CHUNK; ++k) {
          float dot = 0.0f;
          for (int i = 0; i < DPS; ++i) dot += q[r][s * DPS + i] * float(kv_tile[k * SLICE_D + lane + i * 32]);
          partial[k] = dot;
        }
        raw[r] += simd_transpose_sum(partial, lane);
      }
    }

    // Online softmax, one row at a time; afterwards lane j holds in weight[r] the
    // unnormalised probability of key j for row r if the row sees the key (0 when it is
    // poisoned), and -1 if it does not.
    float weight[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      // Selection, not arithmetic: an unseen entry is -inf whatever raw holds.
      const bool seen = !(bias[r] == -INFINITY);
      const bool bad = seen && !(isfinite(raw[r]) && isfinite(bias[r]));
      poison[r] = poison[r] || bad;
      float score = raw[r];
      if (p.softcap > 0.0f) score = p.softcap * tanh(score / p.softcap);
      score = (seen && !bad) ? score + bias[r] : -INFINITY;

      const float m_new = max(m[r], simd_max(score));
      // A row that has seen only masked keys keeps m = -inf; never form (-inf) - (-inf).
      const bool nothing_seen = m_new == -INFINITY;
      const float rescale = nothing_seen ? 1.0f : exp(m[r] - m_new);
      const float prob = nothing_seen ? 0.0f : exp(score - m_new);
      l[r] = l[r] * rescale + simd_sum(prob);
      m[r] = m_new;
      weight[r] = seen ? prob : -1.0f;
      for (int i = 0; i < DPL; ++i) o[r][i] *= rescale;
    }

    // P.V, slice by slice, V staged into the same tile. Only the keys a row sees enter
    // its accumulator (w = -1: unseen; w is the same in every lane, so the branch does
    // not diverge). A seen key's non-finite value makes the accumulator non-finite even
    // at weight 0: that is how it poisons the row.
    for (int s = 0; s < SLICES; ++s) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // K (or the last V slice) is read
      for (int e = int(thread_index); e < CHUNK * SLICE_D; e += THREADS) {
        const int k = e / SLICE_D;
        const int d = s * SLICE_D + e % SLICE_D;
        kv_tile[e] = k < chunk_len ? value[v_base + long(chunk + k) * p.v_stride_s + d] : KVT(0.0f);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int k = 0; k < chunk_len; ++k) {
        float v[DPS];
        for (int i = 0; i < DPS; ++i) v[i] = float(kv_tile[k * SLICE_D + lane + i * 32]);
        for (int r = 0; r < ROWS; ++r) {
          const float w = simd_broadcast(weight[r], ushort(k));
          if (w >= 0.0f) {
            for (int i = 0; i < DPS; ++i) o[r][s * DPS + i] += w * v[i];
          }
        }
      }
    }
    // The next chunk overwrites the tile.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int r = 0; r < ROWS; ++r) {
    // Poisoned: a lane flagged a seen key, or a seen value left the accumulator
    // non-finite. Every lane takes part (uniform), before the row_valid test.
    bool lane_poison = poison[r];
    for (int i = 0; i < DPL; ++i) lane_poison = lane_poison || !isfinite(o[r][i]);
    const bool poisoned = simd_any(lane_poison);
    if (!row_valid[r]) continue;
    const long slot = ((long(b) * p.Hq + row_head[r]) * p.T + row_node[r]) * p.n_splits + split;
    for (int i = 0; i < DPL; ++i) partial_o[slot * D + lane + i * 32] = o[r][i];
    if (lane == 0) {
      partial_m[slot] = poisoned ? NAN : m[r];
      partial_l[slot] = poisoned ? NAN : l[r];
    }
  }
}

// ---------------------------------------------------------------------------------------
// Reduce pass.
//
// Threadgroup: TREE_ATTN_REDUCE_ROWS consecutive query rows of the flattened
// [B, Hq, T]; simdgroup k owns one row, lane s owns split s (for the max and the sum)
// and head dims s, s + 32, ... (for the output).
// Traffic: every partial is read once; out and lse are written once. Splits are merged
// in a fixed order, so results are deterministic. A split whose m is NaN is poisoned
// (see the main pass): the row's output is NaN in every element and its lse NaN, whatever
// the other splits hold.
// Sinks join here, once per row (lane 0 reads the head's sink when the call has sinks):
// lse = logaddexp(keys' lse, sink), out = O e^(m - lse); a row that sees no key gets
// out 0 and lse = sink; a sink of -inf is none, a NaN or +inf sink poisons the row.
// ---------------------------------------------------------------------------------------
template <typename T, int D>
[[kernel]] void tree_attn_reduce(
    constant TreeAttnParams& p [[buffer(0)]],
    device const float* partial_o [[buffer(1)]],
    device const float* partial_m [[buffer(2)]],
    device const float* partial_l [[buffer(3)]],
    device T* out [[buffer(4)]],      // [B, Hq, T, D] contiguous
    device float* lse [[buffer(5)]],  // [B, Hq, T] contiguous
    device const float* sinks [[buffer(6)]],  // [Hq]; read only if p.has_sinks
    uint group [[threadgroup_position_in_grid]],
    ushort simd_index [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int DPL = D / TREE_ATTN_SIMD_WIDTH;
  const long rows = long(p.B) * p.Hq * p.T;
  const long row = long(group) * TREE_ATTN_REDUCE_ROWS + simd_index;
  if (row >= rows) return;  // uniform per simdgroup; this kernel has no barriers

  const int n_splits = p.n_splits;
  const bool my_split = int(lane) < n_splits;
  const float m_split = my_split ? partial_m[row * n_splits + lane] : -INFINITY;
  const float l_split = my_split ? partial_l[row * n_splits + lane] : 0.0f;
  float sink = -INFINITY;
  if (p.has_sinks != 0) {
    const float mine = lane == 0 ? sinks[(row / p.T) % p.Hq] : 0.0f;
    sink = simd_broadcast(mine, ushort(0));
  }
  const bool poisoned = simd_any(isnan(m_split)) || isnan(sink) || sink == INFINITY;
  const float m_all = simd_max(m_split);
  // Splits that saw nothing (m = -inf) weigh 0; if no split saw anything, all weigh 0.
  const float w_split = m_split == -INFINITY ? 0.0f : exp(m_split - m_all);
  const float l_all = simd_sum(l_split * w_split);

  float acc[DPL];
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float w = simd_broadcast(w_split, ushort(s));
    const long base = (row * n_splits + s) * D;
    for (int i = 0; i < DPL; ++i) acc[i] += w * partial_o[base + lane + i * 32];
  }
  // A poisoned row reads its partials like any other (the traffic model counts them all)
  // and discards them.
  // out = acc * weight. Without a sink weight = 1 / l; with one, e^(m - lse).
  float row_lse = sink;
  float weight = 0.0f;
  if (l_all > 0.0f) {
    const float keys_lse = m_all + log(l_all);
    if (sink == -INFINITY) {
      row_lse = keys_lse;
      weight = 1.0f / l_all;
    } else {
      row_lse = max(keys_lse, sink) + log(1.0f + exp(-fabs(keys_lse - sink)));
      weight = exp(m_all - row_lse);
    }
  }
  for (int i = 0; i < DPL; ++i) out[row * D + lane + i * 32] = T(poisoned ? NAN : acc[i] * weight);
  if (lane == 0) lse[row] = poisoned ? NAN : row_lse;
}

// ---------------------------------------------------------------------------------------
// Instantiations, from one table: tree_attn_main_<types>_d<D>_<mask> and
// tree_attn_reduce_<out>_d<D>; <types> is f32, f16, bf16 (query and K/V alike) or
// f32_f16, f32_bf16 (a float32 query over a half-precision cache), mask bool or float,
// D in {64, 96, 128, 256, 512}: 50 main and 15 reduce kernels. csrc/metal/plan.cpp builds
// the same names.
// ---------------------------------------------------------------------------------------
#define TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, MASKT, MTAG)                                               \
  template [[host_name("tree_attn_main_" #TAG "_d" #D "_" #MTAG)]] [[kernel]] void                      \
  tree_attn_main<QT, KVT, D, MASKT>(                                                                     \
      constant TreeAttnParams& p [[buffer(0)]], device const QT* query [[buffer(1)]],                    \
      device const KVT* key [[buffer(2)]], device const KVT* value [[buffer(3)]],                        \
      device const MASKT* mask [[buffer(4)]], device const int* offsets [[buffer(5)]],                   \
      device float* partial_o [[buffer(6)]], device float* partial_m [[buffer(7)]],                      \
      device float* partial_l [[buffer(8)]], threadgroup KVT* kv_tile [[threadgroup(0)]],                \
      uint3 group [[threadgroup_position_in_grid]], uint thread_index [[thread_index_in_threadgroup]],   \
      ushort simd_index [[simdgroup_index_in_threadgroup]], ushort lane [[thread_index_in_simdgroup]]);

#define TREE_ATTN_REDUCE_KERNEL(T, TAG, D)                                                                \
  template [[host_name("tree_attn_reduce_" #TAG "_d" #D)]] [[kernel]] void tree_attn_reduce<T, D>(       \
      constant TreeAttnParams& p [[buffer(0)]], device const float* partial_o [[buffer(1)]],             \
      device const float* partial_m [[buffer(2)]], device const float* partial_l [[buffer(3)]],          \
      device T* out [[buffer(4)]], device float* lse [[buffer(5)]], device const float* sinks [[buffer(6)]], \
      uint group [[threadgroup_position_in_grid]], ushort simd_index [[simdgroup_index_in_threadgroup]],  \
      ushort lane [[thread_index_in_simdgroup]]);

#define TREE_ATTN_MAIN_KERNELS(QT, KVT, TAG, D) \
  TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, uchar, bool) TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, float, float)

// The table: every (query type, K/V type) pair and every output type, per head dim.
#define TREE_ATTN_KERNELS(D)                     \
  TREE_ATTN_MAIN_KERNELS(float, float, f32, D)   \
  TREE_ATTN_MAIN_KERNELS(half, half, f16, D)     \
  TREE_ATTN_MAIN_KERNELS(bfloat, bfloat, bf16, D) \
  TREE_ATTN_MAIN_KERNELS(float, half, f32_f16, D) \
  TREE_ATTN_MAIN_KERNELS(float, bfloat, f32_bf16, D) \
  TREE_ATTN_REDUCE_KERNEL(float, f32, D)         \
  TREE_ATTN_REDUCE_KERNEL(half, f16, D)          \
  TREE_ATTN_REDUCE_KERNEL(bfloat, bf16, D)

TREE_ATTN_KERNELS(64)
TREE_ATTN_KERNELS(96)
TREE_ATTN_KERNELS(128)
TREE_ATTN_KERNELS(256)
TREE_ATTN_KERNELS(512)
