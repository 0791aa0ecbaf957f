// Tree attention for speculative-decoding verification: a main pass over key splits and
// a reduce pass that merges the splits. The launch geometry, buffer bindings and the
// traffic model live in csrc/metal/plan.h and tests/sim/csrc/traffic.h; the parameter block in tree_attn_params.h.
//
// Written in the MSL subset the CPU simulator (tests/sim) executes: device loads and
// stores, simd_* collectives, simdgroup matrices, threadgroup barriers. Two main kernels:
// the vector kernel (tree_attn_main, v1) and the simdgroup-matrix kernel (tree_attn_mma, v2);
// csrc/metal/plan.cpp chooses. Scores use -INFINITY
// as "masked" and partials use NaN as "poisoned"; the host must compile this source with
// fast math off so the comparisons against -INFINITY and the isfinite/isnan tests below
// keep their meaning.
#include <metal_stdlib>
#include "tree_attn_params.h"
#include "tree_attn_kernels.h"

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
// Main pass, vector kernel (v1, kernels tree_attn_main_*).
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
    device const int* mask_offset [[buffer(5)]],
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
  const int off = p.has_mask_offset != 0 ? clamp(mask_offset[b], 0, p.S) : 0;
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
// Main pass, simdgroup-matrix kernel (v2, kernels tree_attn_mma_*). Same bindings, grid
// layout (split, row block, batch row * Hkv + kv head), partials and key splits as the
// vector kernel above; only the tiling and the arithmetic differ.
//
// Tiling plan. A threadgroup owns rows [64 rb, 64 rb + 64) of kv head h's G x T rows
// (row = g * T + t) and walks the keys of its split in chunks of 32. Its 8 row groups own
// 8 rows each. A row group is PARTS = TREE_ATTN_MMA_DIM_PARTS(D) simdgroups (1 at
// D <= 256, 2 at D = 512; simdgroup k is part k / 8 of row group k % 8), each holding the
// group's 8 rows in 1 / PARTS of the head dims as 8x8 float matrices of query (pre-scaled)
// and of output accumulator: D / (8 PARTS) of each, at most 32 + 32 matrices, i.e. 64 + 64
// floats per lane. Part p owns, of every staged head-dim slice, the p-th 1 / PARTS of it
// (at D = 512: dims [128 s + 64 p, 128 s + 64 p + 64) of slice s), so every slice feeds
// every simdgroup. Part 0 of a row group, its lead, also owns the rows' online softmax,
// where lane j owns key j of each chunk (as in the vector kernel): only the lead reads the
// mask. Per chunk:
//   1. K is staged as float in a padded tile [32 keys][SLICE_D + 4], in slices of at most
//      128 head dims: simdgroup k stages keys 32k / NSG.. of the 32, its lanes read
//      4-vectors of a key row side by side (contiguous device loads);
//   2. S = Q K^T, 8 x 32 per simdgroup in 4 accumulators over its own head dims, stored to
//      the row group's 8 rows of the score tile [64][32 + 4]. With two parts, part 1 stores
//      its partial scores first and the lead adds them to its own (S = S_0 + S_1, a fixed
//      order) before storing the sum;
//   3. the lead's softmax reads the score tile lane = key and writes P in its place; with
//      two parts it also hands each row's rescale factor to part 1 through threadgroup
//      memory; every simdgroup rescales its accumulators row by row through
//      thread_elements();
//   4. V is staged like K (non-finite elements as 0, flagged per key, see below) and
//      O += P V over each simdgroup's own head dims, 4 products per 8 dims.
// Simdgroup matrix products per visited chunk: 2 x (D / 8) x 4 per row group, 8 D per
// threadgroup (tests/sim/csrc/traffic.h, modelled_main_simdgroup_mmas).
// Traffic: each visible K and V byte is fetched from device memory once per threadgroup,
// i.e. ceil(G * T / 64) times per call where the least possible is once; a chunk that the
// window mask hides from every row of the block is never fetched. The query is read once
// per live split (each part reads its own dims), the mask once, partials written once, as
// by the vector kernel.
// Threadgroup memory: TREE_ATTN_MMA_TILE_FLOATS(D) floats, 25.6 KB at D = 128 and 256,
// 25.9 KB at D = 512 (64 floats more: the rows' exchange); rows padded by 16 bytes against
// bank conflicts. The float32 tile is the same for every K/V dtype. Threads: 256, or 512
// at D = 512 (the host checks the pipeline's limit).
//
// Precision: float32 products and accumulators. The MSL specification (3.1, section 6.7,
// SIMD-group matrix functions) declares simdgroup_multiply_accumulate(d, a, b, c) with one
// element type T for all four matrices, so half and bfloat K/V are not multiplied as
// half/bfloat matrices into float accumulators: they are converted to float (exactly) as
// they are staged. A float32 query stays float32.
//
// Non-finite values: the rules of the vector kernel's comment "Non-finite values", with
// one more hazard. A matrix product mixes keys: in P V a NaN or inf value of a key some
// row does not see would reach that row as 0 * NaN. So V staging replaces a non-finite
// element by 0 (selection) and flags its key; a row that sees a flagged key is poisoned.
// Q K^T mixes only head dims: entry (row, key) is the vector kernel's raw score (with two
// parts, a sum of two partial dots, non-finite when either is), so the same score test
// poisons exactly the rows that see a non-finite query or key element.
// P holds exactly 0 for keys a row does not see (and for zero-filled keys past the
// range). An accumulator can still overflow: any non-finite accumulator element poisons
// its row at the end, as in the vector kernel; with two parts, part 1 hands its rows'
// verdicts to the lead, which writes m and l.
// ---------------------------------------------------------------------------------------

// Where a lane's two elements sit in every 8x8 simdgroup matrix (the Apple GPU layout):
// thread_elements()[i] is element (row y, column x + i).
inline ushort2 mma_lane_position(ushort lane) {
  const ushort quad = lane / 4;
  return ushort2((quad & 2) * 2 + (lane % 2) * 2, (quad & 4) + (lane / 2) % 4);
}

// Stages keys [0, 32) of one head-dim slice of K or V, rows `stride` elements apart from
// `src`, as float into tile[32][LD]; keys at or past `chunk_len` are zero-filled, never
// read. With NSG simdgroups, simdgroup k stages keys k * KEYS.. (KEYS = 32 / NSG); lane l
// loads the 4-vectors l, l + 32, ... of a key's slice. SANITISE: a non-finite element is
// staged as 0, and bit i of the result (the same in every lane) is set when key
// k * KEYS + i had one.
template <typename KVT, int SLICE_D, int LD, int NSG, bool SANITISE>
inline uint mma_stage_slice(threadgroup float* tile, device const KVT* src, long stride, int chunk_len,
                            bool vector_loads, ushort simd_index, ushort lane) {
  constexpr int KEYS = TREE_ATTN_CHUNK_KEYS / NSG;
  constexpr int VECTORS = SLICE_D / 4;
  uint flagged = 0;
  for (int kk = 0; kk < KEYS; ++kk) {
    const int k = int(simd_index) * KEYS + kk;
    bool bad = false;
    for (int c = int(lane); c < VECTORS; c += TREE_ATTN_SIMD_WIDTH) {
      float4 v = float4(0.0f);
      if (k < chunk_len) {
        device const KVT* at = src + long(k) * stride + 4 * c;
        if (vector_loads) {
          v = float4(*((device const vec<KVT, 4>*)at));
        } else {
          v = float4(float(at[0]), float(at[1]), float(at[2]), float(at[3]));
        }
      }
      if (SANITISE) {
        const bool4 finite = isfinite(v);
        bad = bad || !all(finite);
        v = select(float4(0.0f), v, finite);
      }
      threadgroup float* dst = tile + k * LD + 4 * c;
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    }
    if (SANITISE && simd_any(bad)) flagged |= 1u << kk;
  }
  return flagged;
}

// The first of the 8 head dims that matrix n of a simdgroup's query and accumulator covers:
// the part's share of slice n / PART_DT, which starts at part_dim0 within the slice.
template <int SLICE_D, int PART_DT>
inline int mma_part_dim(int n, int part_dim0) {
  return (n / PART_DT) * SLICE_D + part_dim0 + (n % PART_DT) * 8;
}

template <typename QT, typename KVT, int D, typename MaskT>
[[kernel]] void tree_attn_mma(
    constant TreeAttnParams& p [[buffer(0)]],
    device const QT* query [[buffer(1)]],
    device const KVT* key [[buffer(2)]],
    device const KVT* value [[buffer(3)]],
    device const MaskT* mask [[buffer(4)]],
    device const int* mask_offset [[buffer(5)]],
    device float* partial_o [[buffer(6)]],  // [B, Hq, T, n_splits, D]
    device float* partial_m [[buffer(7)]],  // [B, Hq, T, n_splits]
    device float* partial_l [[buffer(8)]],  // [B, Hq, T, n_splits]
    threadgroup float* tile [[threadgroup(0)]],  // TREE_ATTN_MMA_TILE_FLOATS(D)
    uint3 group [[threadgroup_position_in_grid]],
    ushort simd_index [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int GROUPS = TREE_ATTN_MMA_ROW_GROUPS;
  constexpr int PARTS = TREE_ATTN_MMA_DIM_PARTS(D);  // simdgroups per row group
  constexpr int NSG = TREE_ATTN_MMA_SIMDGROUPS(D);
  constexpr int ROWS = 8;  // per row group: one row of 8x8 matrices
  constexpr int CHUNK = TREE_ATTN_CHUNK_KEYS;
  constexpr int SLICE_D = TREE_ATTN_MMA_SLICE_DIMS(D);
  constexpr int SLICES = D / SLICE_D;
  constexpr int LD_KV = SLICE_D + TREE_ATTN_MMA_PAD;  // K/V tile row, floats
  constexpr int LD_S = CHUNK + TREE_ATTN_MMA_PAD;     // score tile row, floats
  constexpr int PART_DT = SLICE_D / 8 / PARTS;        // 8-dim matrices of a slice a part owns
  constexpr int DT = SLICES * PART_DT;                // 8-dim matrices of query / output a simdgroup holds
  constexpr int KT = CHUNK / 8;                       // 8-key matrices of a chunk
  constexpr int KEYS_PER_SIMDGROUP = CHUNK / NSG;     // staged by each simdgroup
  static_assert(GROUPS * ROWS == TREE_ATTN_MMA_BLOCK_ROWS && NSG == GROUPS * PARTS, "tiling");
  static_assert(D % SLICE_D == 0 && SLICE_D % (8 * PARTS) == 0 && CHUNK % NSG == 0, "tiling");

  const int row_group = int(simd_index) % GROUPS;
  const int part = int(simd_index) / GROUPS;
  const bool lead = part == 0;  // owns the softmax, the mask reads and m, l

  threadgroup float* kv_tile = tile;                               // [32][LD_KV]: K, then V
  threadgroup float* score_tile = tile + CHUNK * LD_KV;            // [64][LD_S]: S, then P
  threadgroup float* key_flag = score_tile + GROUPS * ROWS * LD_S;  // [32]: V of key j non-finite
  // [64], PARTS > 1 only: per row, the lead's rescale factor in the chunk loop, then part
  // 1's poison verdict at the end.
  threadgroup float* row_exchange = key_flag + CHUNK;
  threadgroup float* my_scores = score_tile + row_group * ROWS * LD_S;
  threadgroup float* my_exchange = row_exchange + row_group * ROWS;

  const int split = int(group.x);
  const int b = int(group.z) / p.Hkv;
  const int h = int(group.z) % p.Hkv;
  const int rows_per_head = p.G * p.T;

  // Offsets clamped in the kernel, as in the vector kernel.
  const int off = p.has_mask_offset != 0 ? clamp(mask_offset[b], 0, p.S) : 0;
  const int visible_end = off + min(p.M, p.S - off);
  const int begin = split * p.split_keys;
  const int end = begin + clamp(visible_end - begin, 0, p.split_keys);

  // The row group's rows, for the softmax (lane = key) and the mask.
  const int row0 = int(group.y) * TREE_ATTN_MMA_BLOCK_ROWS + row_group * ROWS;
  bool row_valid[ROWS];
  int row_head[ROWS];
  int row_node[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const int row = row0 + r;
    row_valid[r] = row < rows_per_head;
    row_head[r] = h * p.G + (row_valid[r] ? row / p.T : 0);
    row_node[r] = row_valid[r] ? row % p.T : 0;
  }

  // This lane's elements of the simdgroup's matrices: row `mine.y`, columns mine.x, +1.
  const ushort2 mine = mma_lane_position(lane);
  const int my_row = row0 + int(mine.y);
  const bool my_row_valid = my_row < rows_per_head;
  // The part's head dims within each slice start at part_dim0 (see mma_part_dim).
  const int part_dim0 = part * PART_DT * 8;

  simdgroup_float8x8 q[DT];  // rows x 8 of the part's head dims, pre-scaled
  simdgroup_float8x8 o[DT];  // rows x 8 of the part's head dims
  {
    const int g = my_row_valid ? my_row / p.T : 0;
    const int t = my_row_valid ? my_row % p.T : 0;
    const long q_base = long(b) * p.q_stride_b + long(h * p.G + g) * p.q_stride_h + long(t) * p.q_stride_t;
    const bool load = my_row_valid && begin < end;
    for (int i = 0; i < DT; ++i) {
      o[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      const long at = q_base + mma_part_dim<SLICE_D, PART_DT>(i, part_dim0) + int(mine.x);
      for (int e = 0; e < 2; ++e) {
        q[i].thread_elements()[e] = load ? float(query[at + e]) * p.scale : 0.0f;
      }
    }
  }
  // The lead's softmax state; the other parts keep theirs at the initial values.
  float m[ROWS];      // running max of the scores (the same in every lane)
  float l[ROWS];      // running sum of exp(score - m)
  bool poison[ROWS];  // this lane's key of some chunk poisons the row
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    poison[r] = false;
  }

  const long k_base = long(b) * p.k_stride_b + long(h) * p.k_stride_h;
  const long v_base = long(b) * p.v_stride_b + long(h) * p.v_stride_h;
  const bool vector_loads = p.kv_aligned4 != 0;

  for (int chunk = begin; chunk < end; chunk += CHUNK) {
    const int chunk_len = min(CHUNK, end - chunk);
    const int key_index = chunk + int(lane);

    // The bias each of my rows gives key `key_index` (as in the vector kernel); the lead's
    // only, so each mask entry is read once.
    float bias[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      if (!lead || key_index >= end || !row_valid[r]) {
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

    // Chunk skipping, decided for the whole threadgroup from the leads' flags before K is
    // fetched; the flags borrow the score tile, free between chunks.
    if (chunk >= off) {
      if (lead) {
        bool seen = false;
        for (int r = 0; r < ROWS; ++r) seen = seen || !(bias[r] == -INFINITY);
        const bool simdgroup_sees = simd_any(seen);
        if (lane == 0) score_tile[row_group] = simdgroup_sees ? 1.0f : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      bool block_sees = false;
      for (int k = 0; k < GROUPS; ++k) block_sees = block_sees || score_tile[k] != 0.0f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (!block_sees) continue;
    }

    // S = Q K^T over the simdgroup's head dims, slice by slice.
    simdgroup_float8x8 s[KT];
    for (int j = 0; j < KT; ++j) s[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int slice = 0; slice < SLICES; ++slice) {
      if (slice > 0) threadgroup_barrier(mem_flags::mem_threadgroup);  // the last slice is read
      mma_stage_slice<KVT, SLICE_D, LD_KV, NSG, false>(kv_tile,
                                                       key + k_base + long(chunk) * p.k_stride_s + slice * SLICE_D,
                                                       p.k_stride_s, chunk_len, vector_loads, simd_index, lane);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = 0; i < PART_DT; ++i) {
        for (int j = 0; j < KT; ++j) {
          simdgroup_float8x8 k_t;  // K^T: head dims part_dim0 + 8i.. of the slice x keys 8j..
          simdgroup_load(k_t, kv_tile + j * 8 * LD_KV + part_dim0 + i * 8, LD_KV, ulong2(0, 0), true);
          simdgroup_multiply_accumulate(s[j], q[slice * PART_DT + i], k_t, s[j]);
        }
      }
    }
    if (PARTS > 1) {
      // The row group's scores: part 1's partial dots, then the lead's added to them.
      if (!lead) {
        for (int j = 0; j < KT; ++j) simdgroup_store(s[j], my_scores + j * 8, LD_S);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (lead) {
        for (int j = 0; j < KT; ++j) {
          simdgroup_float8x8 other;
          simdgroup_load(other, my_scores + j * 8, LD_S);
          s[j].thread_elements()[0] += other.thread_elements()[0];
          s[j].thread_elements()[1] += other.thread_elements()[1];
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
    if (lead) {
      for (int j = 0; j < KT; ++j) simdgroup_store(s[j], my_scores + j * 8, LD_S);
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Online softmax, row by row, lane = key (the vector kernel's rules); P replaces S.
    bool sees[ROWS];      // row r sees my key (false outside the lead)
    float rescale[ROWS];  // the same in every lane
    for (int r = 0; r < ROWS; ++r) {
      sees[r] = false;
      rescale[r] = 1.0f;
    }
    if (lead) {
      for (int r = 0; r < ROWS; ++r) {
        const float raw = my_scores[r * LD_S + lane];
        sees[r] = !(bias[r] == -INFINITY);
        const bool bad = sees[r] && !(isfinite(raw) && isfinite(bias[r]));
        poison[r] = poison[r] || bad;
        float score = raw;
        if (p.softcap > 0.0f) score = p.softcap * tanh(score / p.softcap);
        score = (sees[r] && !bad) ? score + bias[r] : -INFINITY;

        const float m_new = max(m[r], simd_max(score));
        const bool nothing_seen = m_new == -INFINITY;
        rescale[r] = nothing_seen ? 1.0f : exp(m[r] - m_new);
        const float prob = nothing_seen ? 0.0f : exp(score - m_new);
        l[r] = l[r] * rescale[r] + simd_sum(prob);
        m[r] = m_new;
        my_scores[r * LD_S + lane] = sees[r] ? prob : 0.0f;
      }
      if (PARTS > 1 && lane < ROWS) {
        float mine_rescale = 1.0f;
        for (int r = 0; r < ROWS; ++r) mine_rescale = int(lane) == r ? rescale[r] : mine_rescale;
        my_exchange[lane] = mine_rescale;
      }
    }
    // P (and the rescale factors) of the lead reach the row group's other parts.
    if (PARTS > 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
    float my_rescale = 1.0f;  // of the row my accumulator elements belong to
    if (lead) {
      for (int r = 0; r < ROWS; ++r) my_rescale = int(mine.y) == r ? rescale[r] : my_rescale;
    } else {
      my_rescale = my_exchange[mine.y];
    }
    for (int i = 0; i < DT; ++i) {
      o[i].thread_elements()[0] *= my_rescale;
      o[i].thread_elements()[1] *= my_rescale;
    }
    simdgroup_float8x8 prob[KT];  // rows x keys 8j..8j+7
    for (int j = 0; j < KT; ++j) simdgroup_load(prob[j], my_scores + j * 8, LD_S);

    // O += P V, slice by slice, V staged into the same tile, non-finite values as 0 with
    // their keys flagged.
    for (int slice = 0; slice < SLICES; ++slice) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // K (or the last V slice) is read
      const uint flagged = mma_stage_slice<KVT, SLICE_D, LD_KV, NSG, true>(
          kv_tile, value + v_base + long(chunk) * p.v_stride_s + slice * SLICE_D, p.v_stride_s, chunk_len,
          vector_loads, simd_index, lane);
      if (lane == 0) {
        for (int kk = 0; kk < KEYS_PER_SIMDGROUP; ++kk) {
          const int k = int(simd_index) * KEYS_PER_SIMDGROUP + kk;
          const bool before = slice > 0 && key_flag[k] != 0.0f;
          key_flag[k] = (before || (flagged & (1u << kk)) != 0) ? 1.0f : 0.0f;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = 0; i < PART_DT; ++i) {
        for (int j = 0; j < KT; ++j) {
          simdgroup_float8x8 v_tile;  // keys 8j.. x head dims part_dim0 + 8i.. of the slice
          simdgroup_load(v_tile, kv_tile + j * 8 * LD_KV + part_dim0 + i * 8, LD_KV);
          simdgroup_multiply_accumulate(o[slice * PART_DT + i], prob[j], v_tile, o[slice * PART_DT + i]);
        }
      }
    }
    // A row that sees a key with a non-finite value is poisoned (selection: the value
    // itself entered the products as 0).
    if (lead) {
      const bool my_key_flagged = key_flag[lane] != 0.0f;
      for (int r = 0; r < ROWS; ++r) poison[r] = poison[r] || (sees[r] && my_key_flagged);
    }
    // The next chunk overwrites the tiles.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Poisoned: a lane flagged the row, or one of the row's accumulator elements, in any
  // part, is not finite.
  bool my_elements_bad = false;
  for (int i = 0; i < DT; ++i) {
    my_elements_bad = my_elements_bad || !isfinite(o[i].thread_elements()[0]) || !isfinite(o[i].thread_elements()[1]);
  }
  if (PARTS > 1) {
    // Part 1's verdicts to the lead, through the exchange (free after the chunk loop).
    if (!lead) {
      for (int r = 0; r < ROWS; ++r) {
        const bool bad = simd_any(my_elements_bad && int(mine.y) == r);
        if (lane == 0) my_exchange[r] = bad ? 1.0f : 0.0f;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const long slot0 = (long(b) * p.Hq + long(h) * p.G) * p.T;  // slot of the head's row 0, split 0
  if (lead) {
    for (int r = 0; r < ROWS; ++r) {
      const bool other_part_bad = PARTS > 1 && my_exchange[r] != 0.0f;
      const bool poisoned = simd_any(poison[r] || (my_elements_bad && int(mine.y) == r)) || other_part_bad;
      if (row_valid[r] && lane == 0) {
        const long slot = (slot0 + row0 + r) * p.n_splits + split;
        partial_m[slot] = poisoned ? NAN : m[r];
        partial_l[slot] = poisoned ? NAN : l[r];
      }
    }
  }
  if (my_row_valid) {
    const long base = ((slot0 + my_row) * p.n_splits + split) * D + int(mine.x);
    for (int i = 0; i < DT; ++i) {
      const long at = base + mma_part_dim<SLICE_D, PART_DT>(i, part_dim0);
      partial_o[at] = o[i].thread_elements()[0];
      partial_o[at + 1] = o[i].thread_elements()[1];
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
// Instantiations, from the one table in tree_attn_kernels.h (csrc/metal/plan.cpp builds its
// kernel names from the same table): tree_attn_main_<types>_d<D>_<mask> (vector kernel,
// every D), tree_attn_mma_<types>_d<D>_<mask> (matrix kernel, every D) and
// tree_attn_reduce_<out>_d<D>; <types> is f32, f16, bf16 (query and K/V alike) or f32_f16,
// f32_bf16 (a float32 query over a half-precision cache), mask bool or float.
// ---------------------------------------------------------------------------------------
#define TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, MASKT, MTAG)                                               \
  template [[host_name(TREE_ATTN_MAIN_KERNEL_NAME(main, TAG, D, MTAG))]] [[kernel]] void                      \
  tree_attn_main<QT, KVT, D, MASKT>(                                                                     \
      constant TreeAttnParams& p [[buffer(0)]], device const QT* query [[buffer(1)]],                    \
      device const KVT* key [[buffer(2)]], device const KVT* value [[buffer(3)]],                        \
      device const MASKT* mask [[buffer(4)]], device const int* mask_offset [[buffer(5)]],                   \
      device float* partial_o [[buffer(6)]], device float* partial_m [[buffer(7)]],                      \
      device float* partial_l [[buffer(8)]], threadgroup KVT* kv_tile [[threadgroup(0)]],                \
      uint3 group [[threadgroup_position_in_grid]], uint thread_index [[thread_index_in_threadgroup]],   \
      ushort simd_index [[simdgroup_index_in_threadgroup]], ushort lane [[thread_index_in_simdgroup]]);

#define TREE_ATTN_MMA_KERNEL(QT, KVT, TAG, D, MASKT, MTAG)                                                \
  template [[host_name(TREE_ATTN_MAIN_KERNEL_NAME(mma, TAG, D, MTAG))]] [[kernel]] void                       \
  tree_attn_mma<QT, KVT, D, MASKT>(                                                                      \
      constant TreeAttnParams& p [[buffer(0)]], device const QT* query [[buffer(1)]],                    \
      device const KVT* key [[buffer(2)]], device const KVT* value [[buffer(3)]],                        \
      device const MASKT* mask [[buffer(4)]], device const int* mask_offset [[buffer(5)]],                   \
      device float* partial_o [[buffer(6)]], device float* partial_m [[buffer(7)]],                      \
      device float* partial_l [[buffer(8)]], threadgroup float* tile [[threadgroup(0)]],                 \
      uint3 group [[threadgroup_position_in_grid]], ushort simd_index [[simdgroup_index_in_threadgroup]], \
      ushort lane [[thread_index_in_simdgroup]]);

#define TREE_ATTN_REDUCE_KERNEL(T, TAG, D)                                                                \
  template [[host_name(TREE_ATTN_REDUCE_KERNEL_NAME(TAG, D))]] [[kernel]] void tree_attn_reduce<T, D>(       \
      constant TreeAttnParams& p [[buffer(0)]], device const float* partial_o [[buffer(1)]],             \
      device const float* partial_m [[buffer(2)]], device const float* partial_l [[buffer(3)]],          \
      device T* out [[buffer(4)]], device float* lse [[buffer(5)]], device const float* sinks [[buffer(6)]], \
      uint group [[threadgroup_position_in_grid]], ushort simd_index [[simdgroup_index_in_threadgroup]],  \
      ushort lane [[thread_index_in_simdgroup]]);

// The table's entries: a bool- and a float-mask kernel per (types, D).
#define TREE_ATTN_VEC_KERNELS(QT, KVT, TAG, D) \
  TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, uchar, bool) TREE_ATTN_MAIN_KERNEL(QT, KVT, TAG, D, float, float)
#define TREE_ATTN_MMA_KERNELS(QT, KVT, TAG, D) \
  TREE_ATTN_MMA_KERNEL(QT, KVT, TAG, D, uchar, bool) TREE_ATTN_MMA_KERNEL(QT, KVT, TAG, D, float, float)

TREE_ATTN_MAIN_TABLE(TREE_ATTN_VEC_KERNELS, TREE_ATTN_MMA_KERNELS)
TREE_ATTN_REDUCE_TABLE(TREE_ATTN_REDUCE_KERNEL)
