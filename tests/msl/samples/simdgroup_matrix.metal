// A positive sample for the front-end check (tests/test_msl_frontend.py): the
// simdgroup_matrix API and function constants as a kernel would use them. Checked, never run.
#include <metal_stdlib>

using namespace metal;

constant bool use_bias [[function_constant(0)]];
constant int tile_k [[function_constant(1)]];
constant bool has_tile_k = is_function_constant_defined(tile_k);

// C[8 x 8] (+)= A[8 x K] * B[K x 8], A from device memory, B staged in threadgroup memory
// transposed, the accumulator float whatever the operand type.
template <typename T>
[[kernel]] [[max_total_threads_per_threadgroup(32)]] void tile_matmul(
    device const T* a [[buffer(0)]],
    device const T* b [[buffer(1)]],
    device float* c [[buffer(2)]],
    constant float& bias [[buffer(3)]],
    threadgroup T* b_tile [[threadgroup(0)]],
    ushort lane [[thread_index_in_simdgroup]],
    uint2 group [[threadgroup_position_in_grid]]) {
  const int k_total = has_tile_k ? tile_k : 64;
  for (int i = lane; i < 8 * k_total; i += 32) b_tile[i] = b[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);

  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(use_bias ? bias : 0.0f);
  simdgroup_matrix<T, 8, 8> a_frag;
  simdgroup_matrix<T, 8, 8> b_frag;
  for (int k = 0; k < k_total; k += 8) {
    simdgroup_load(a_frag, a, ulong(k_total), ulong2(k, 8 * group.y));
    simdgroup_load(b_frag, b_tile + k, ulong(k_total), ulong2(0), true);
    simdgroup_multiply_accumulate(acc, a_frag, b_frag, acc);
  }
  simdgroup_float8x8 scaled;
  const simdgroup_float8x8 twice = simdgroup_float8x8(2.0f);  // 2 on the diagonal
  simdgroup_multiply(scaled, acc, twice);
  thread vec<float, 2>& mine = scaled.thread_elements();
  mine[0] = precise::exp(mine[0]) + fast::exp(mine[1]) + simd_shuffle_down(mine[1], ushort(1));
  simdgroup_store(scaled, c + 64 * group.x, 8);
  simdgroup_barrier(mem_flags::mem_none);
}

template [[host_name("tile_matmul_f16")]] [[kernel]] void tile_matmul<half>(
    device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
    device float* c [[buffer(2)]], constant float& bias [[buffer(3)]],
    threadgroup half* b_tile [[threadgroup(0)]], ushort lane [[thread_index_in_simdgroup]],
    uint2 group [[threadgroup_position_in_grid]]);
template [[host_name("tile_matmul_bf16")]] [[kernel]] void tile_matmul<bfloat>(
    device const bfloat* a [[buffer(0)]], device const bfloat* b [[buffer(1)]],
    device float* c [[buffer(2)]], constant float& bias [[buffer(3)]],
    threadgroup bfloat* b_tile [[threadgroup(0)]], ushort lane [[thread_index_in_simdgroup]],
    uint2 group [[threadgroup_position_in_grid]]);
