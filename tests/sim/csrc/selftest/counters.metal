// Self-test kernel for the per-launch counters (runtime.h LaunchStats): every counted operation
// appears a known number of times per thread or per simdgroup, next to operations the counters
// must not see (a written-out a * b + c, a threadgroup vector element, a simdgroup_barrier).
#include <metal_stdlib>
using namespace metal;

// Per thread: 2 device loads of 4 bytes, 1 device store of 4 bytes, threadgroup stores of 4 + 2
// bytes and loads of 4 + 2 bytes, 3 fma (one scalar, one float2). Per simdgroup: 4 shuffles
// (simd_sum, simd_shuffle_xor, simd_prefix_inclusive_sum, simd_ballot), 2 MMAs, one
// simdgroup_store to threadgroup and one simdgroup_load from it (256 bytes each), one
// simdgroup_store to device (256 bytes).
kernel void selftest_counters(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              device float* out_matrix [[buffer(2)]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint n [[threads_per_threadgroup]],
                              uint group [[threadgroup_position_in_grid]],
                              ushort simd [[simdgroup_index_in_threadgroup]],
                              ushort simds [[simdgroups_per_threadgroup]]) {
    threadgroup float tile[2048];  // also 64 elements per simdgroup
    threadgroup half half_tile[1024];
    threadgroup float4 vector_tile[1];
    const uint global = group * n + tid;
    tile[tid] = in[global];
    half_tile[tid] = half(in[global]);
    if (tid == 0) {
        vector_tile[0] = float4(1.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float x = tile[(tid + 1) % n] + float(half_tile[tid]) + vector_tile[0].y;
    x = fma(x, 2.0f, 1.0f);
    const float2 y = fma(float2(x), float2(3.0f), float2(0.5f));
    x = x * 2.0f + 1.0f;
    simdgroup_barrier(mem_flags::mem_none);
    x = simd_sum(x) + simd_shuffle_xor(x, ushort(1)) + simd_prefix_inclusive_sum(x);
    if (simd_ballot(x > 0.0f).any()) {
        x += 1.0f;
    }
    out[global] = x + y.x + y.y;

    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8>(1.0f);
    simdgroup_multiply_accumulate(m, m, m, m);  // 8 + 1 = 9 everywhere
    simdgroup_multiply(m, m, m);                // 8 * 81 = 648
    simdgroup_store(m, tile + simd * 64);
    simdgroup_load(m, tile + simd * 64);
    simdgroup_store(m, out_matrix + (group * simds + simd) * 64);
}
