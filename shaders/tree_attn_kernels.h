// The table of every kernel shaders/tree_attention.metal instantiates, as X-macros: the
// shader expands it into its template instantiations, csrc/metal/plan.cpp into the list of
// names it may launch, so the plan can only name a kernel the shader has (and the
// simulator's translator, tests/sim/csrc/msl2cpp.py, expands it like the shader's own
// instantiation macros).
//
// Main kernels, one X-macro per family, invoked as X(QT, KVT, TAG, D) for each (query,
// K/V) type pair and head dim; the shader instantiates a bool- and a float-mask kernel of
// each, named tree_attn_<family>_<TAG>_d<D>_<bool|float>:
//   VEC (family "main"): the vector kernel (v1): 32 rows per threadgroup, scalar dot
//                         products, every D;
//   MMA (family "mma"):  the simdgroup-matrix kernel (v2): 64 rows per threadgroup, 8x8
//                         matrix products, every D (at D = 512 two simdgroups share each
//                         8 rows, tree_attention.metal says how).
// Reduce kernels: REDUCE(T, TAG, D) for each output type, named tree_attn_reduce_<TAG>_d<D>.
//
// TAG is the query's dtype (f32, f16, bf16), then the K/V dtype when it differs
// (f32_f16, f32_bf16: a float32 query over a half-precision cache).
#pragma once

// The kernel names (string literals), built by the shader's [[host_name]] attributes and by
// the plan alike.
#define TREE_ATTN_MAIN_KERNEL_NAME(FAMILY, TAG, D, MASK) "tree_attn_" #FAMILY "_" #TAG "_d" #D "_" #MASK
#define TREE_ATTN_REDUCE_KERNEL_NAME(TAG, D) "tree_attn_reduce_" #TAG "_d" #D

#define TREE_ATTN_TYPE_PAIRS(X, D)                                                            \
  X(float, float, f32, D) X(half, half, f16, D) X(bfloat, bfloat, bf16, D)                   \
  X(float, half, f32_f16, D) X(float, bfloat, f32_bf16, D)

#define TREE_ATTN_MAIN_TABLE(VEC, MMA)                                                        \
  TREE_ATTN_TYPE_PAIRS(VEC, 64) TREE_ATTN_TYPE_PAIRS(VEC, 96) TREE_ATTN_TYPE_PAIRS(VEC, 128)  \
  TREE_ATTN_TYPE_PAIRS(VEC, 256) TREE_ATTN_TYPE_PAIRS(VEC, 512)                               \
  TREE_ATTN_TYPE_PAIRS(MMA, 64) TREE_ATTN_TYPE_PAIRS(MMA, 96) TREE_ATTN_TYPE_PAIRS(MMA, 128)  \
  TREE_ATTN_TYPE_PAIRS(MMA, 256) TREE_ATTN_TYPE_PAIRS(MMA, 512)

#define TREE_ATTN_OUTPUT_TYPES(X, D) X(float, f32, D) X(half, f16, D) X(bfloat, bf16, D)

#define TREE_ATTN_REDUCE_TABLE(REDUCE)                                                        \
  TREE_ATTN_OUTPUT_TYPES(REDUCE, 64) TREE_ATTN_OUTPUT_TYPES(REDUCE, 96)                       \
  TREE_ATTN_OUTPUT_TYPES(REDUCE, 128) TREE_ATTN_OUTPUT_TYPES(REDUCE, 256)                     \
  TREE_ATTN_OUTPUT_TYPES(REDUCE, 512)
