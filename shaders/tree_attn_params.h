// The parameter block of the tree-attention kernels, shared word for word by the Metal
// shaders (shaders/tree_attention.metal) and the C++ launch plan (csrc/metal/plan.h).
//
// It is passed with setBytes, so its layout is the contract between host and GPU: only
// fixed-width fields, 64-bit ones first, no implicit padding (the C++ side asserts the
// size). The constants below fix the tiling both sides must agree on.
#pragma once

#ifdef __METAL_VERSION__
typedef long tree_attn_i64;
typedef int tree_attn_i32;
#else
#include <cstdint>
typedef int64_t tree_attn_i64;
typedef int32_t tree_attn_i32;
#endif

// Tiling. An enum, because it is a compile-time constant in both languages without an
// address-space qualifier.
enum TreeAttnTiling {
  // Query rows (query head, tree node pairs of one kv head) per main-kernel threadgroup:
  // every K/V byte a threadgroup fetches serves this many rows.
  TREE_ATTN_BLOCK_ROWS = 32,
  // Keys per staged chunk (one per SIMD lane).
  TREE_ATTN_CHUNK_KEYS = 32,
  TREE_ATTN_SIMD_WIDTH = 32,
  // Query rows per reduce threadgroup: one simdgroup per row.
  TREE_ATTN_REDUCE_ROWS = 4,
  // Upper bound on key splits: the reduce kernel gives each split one lane.
  TREE_ATTN_MAX_SPLITS = 32,
  // The simdgroup-matrix main kernel (tree_attn_mma, v2): query rows per threadgroup and
  // row groups per threadgroup (each owns 8 rows, one row of 8x8 matrices; see
  // TREE_ATTN_MMA_DIM_PARTS for the simdgroups of a row group).
  TREE_ATTN_MMA_BLOCK_ROWS = 64,
  TREE_ATTN_MMA_ROW_GROUPS = 8,
  // Largest head-dim slice of K/V it stages at once, and the padding of every row of its
  // threadgroup tiles, in floats (16 bytes, against bank conflicts).
  TREE_ATTN_MMA_MAX_SLICE_DIMS = 128,
  TREE_ATTN_MMA_PAD = 4,
};

// Simdgroups per main-kernel threadgroup for head dim D: wider heads get more simdgroups
// so each lane keeps at most 8 x D/32 query and 8 x D/32 accumulator values in registers
// (at most 64 floats: 4 rows at D = 256, 2 at D = 512). At most 16, i.e. 512 threads:
// Apple pipelines may allow fewer than 1024 threads per threadgroup.
#define TREE_ATTN_SIMDGROUPS(D) ((D) <= 128 ? 4 : (D) <= 256 ? 8 : 16)

// Threadgroup memory of the main kernel's K/V tile, and the head dims staged at once: a
// chunk (32 keys) of K or V is staged in D / TREE_ATTN_SLICE_DIMS slices of the head dim,
// D, or D / 2 where 32 keys x D elements exceed 32 KB (only float32 at D = 512; the plan
// checks the tile fits).
#define TREE_ATTN_TILE_BYTES 32768
#define TREE_ATTN_SLICE_DIMS(D, ELEMENT_BYTES) \
  ((D) * (ELEMENT_BYTES) * 32 <= TREE_ATTN_TILE_BYTES ? (D) : (D) / 2)

// The simdgroup-matrix kernel's split of the head dim: each of its 8 row groups is
// TREE_ATTN_MMA_DIM_PARTS(D) simdgroups, each holding the query and accumulator of the
// group's 8 rows in 1 / parts of the head dims, so a lane keeps at most 64 + 64 floats (D/4
// each at D <= 256 with one part; 512 / 8 at D = 512 with two). Its simdgroups per
// threadgroup: 8 x parts (8 or 16, at most 512 threads).
#define TREE_ATTN_MMA_DIM_PARTS(D) ((D) <= 256 ? 1 : 2)
#define TREE_ATTN_MMA_SIMDGROUPS(D) (TREE_ATTN_MMA_ROW_GROUPS * TREE_ATTN_MMA_DIM_PARTS(D))

// The simdgroup-matrix kernel's head-dim slice and its threadgroup memory, in floats: the
// K/V tile [32 keys][slice + pad], the score tile [64 rows][32 + pad], 32 key flags and,
// with more than one part, one float per row exchanged between a row group's simdgroups.
#define TREE_ATTN_MMA_SLICE_DIMS(D) ((D) < TREE_ATTN_MMA_MAX_SLICE_DIMS ? (D) : TREE_ATTN_MMA_MAX_SLICE_DIMS)
#define TREE_ATTN_MMA_TILE_FLOATS(D)                                                     \
  (TREE_ATTN_CHUNK_KEYS * (TREE_ATTN_MMA_SLICE_DIMS(D) + TREE_ATTN_MMA_PAD) +            \
   TREE_ATTN_MMA_BLOCK_ROWS * (TREE_ATTN_CHUNK_KEYS + TREE_ATTN_MMA_PAD) + TREE_ATTN_CHUNK_KEYS + \
   (TREE_ATTN_MMA_DIM_PARTS(D) > 1 ? TREE_ATTN_MMA_BLOCK_ROWS : 0))

struct TreeAttnParams {
  // Element strides; the head dim always has stride 1. A broadcast dim has stride 0.
  tree_attn_i64 q_stride_b, q_stride_h, q_stride_t;
  tree_attn_i64 k_stride_b, k_stride_h, k_stride_s;
  tree_attn_i64 v_stride_b, v_stride_h, v_stride_s;
  // Mask [B|1, Hq|1, T, M] with its (possibly broadcast) strides, window column last.
  tree_attn_i64 mask_stride_b, mask_stride_h, mask_stride_t, mask_stride_m;

  tree_attn_i32 B, Hq, Hkv, G, T, S, M, D;
  // Keys [split * split_keys, (split + 1) * split_keys) belong to split `split`;
  // split_keys is a multiple of TREE_ATTN_CHUNK_KEYS.
  tree_attn_i32 split_keys, n_splits;
  tree_attn_i32 n_row_blocks;  // ceil(G * T / rows per threadgroup): 32 (vector), 64 (matrix kernel)
  tree_attn_i32 has_mask_offset;   // 0: every offset is 0 and the mask_offset buffer is not read
  tree_attn_i32 has_sinks;     // 0: no sinks; the reduce pass does not read its sinks buffer
  // 1: every K and V row starts at a multiple of 4 elements (storage offsets and strides),
  // so the matrix kernel loads them as 4-vectors; 0: scalar loads. The vector kernel
  // ignores it. Also keeps the size a multiple of 8 (no tail padding).
  tree_attn_i32 kv_aligned4;
  float scale;
  float softcap;               // 0: off
};

#ifndef __METAL_VERSION__
static_assert(sizeof(TreeAttnParams) == 13 * 8 + 14 * 4 + 2 * 4,
              "TreeAttnParams must have no padding: it is copied byte for byte to the GPU");
#endif
