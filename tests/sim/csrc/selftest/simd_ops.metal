// Self-test kernels for the simulator's simd-group functions and barriers.
// Each thread writes what the collectives returned to it; tests/test_simulator.py recomputes
// the expected lock-step results in Python.
#include <metal_stdlib>
using namespace metal;

constant uint kResultsPerLane = 12;

// out[tid * kResultsPerLane + k]: the k-th collective's result at thread tid.
kernel void selftest_simd_collectives(device const float* in [[buffer(0)]],
                                      device float* out [[buffer(1)]],
                                      uint tid [[thread_index_in_threadgroup]],
                                      uint3 group [[threadgroup_position_in_grid]],
                                      uint3 threads [[threads_per_threadgroup]],
                                      ushort lane [[thread_index_in_simdgroup]],
                                      ushort simd [[simdgroup_index_in_threadgroup]]) {
    const uint global = group.x * threads.x + tid;
    const float v = in[global];
    device float* mine = out + global * kResultsPerLane;
    mine[0] = simd_sum(v);
    mine[1] = simd_max(v);
    mine[2] = simd_min(v);
    mine[3] = simd_shuffle_xor(v, ushort(5));
    mine[4] = simd_broadcast(v, ushort(simd % 32));
    mine[5] = simd_prefix_exclusive_sum(v);
    mine[6] = simd_shuffle_down(v, ushort(3));
    mine[7] = simd_shuffle_up(v, ushort(2));
    mine[8] = simd_broadcast_first(v);
    mine[9] = float(simd_any(v > 0.9f));
    mine[10] = float(simd_all(v >= 0.0f));
    mine[11] = simd_shuffle(v, ushort((lane * 7) % 32));
}

// Reverses each threadgroup's block of `in` through threadgroup memory: thread t reads what
// thread (n - 1 - t) wrote, which is only defined after the barrier. Uses both a body array and
// a [[threadgroup(0)]] argument, and a 2-D array.
kernel void selftest_barrier_reverse(device const float* in [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     threadgroup float* scratch [[threadgroup(0)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint n [[threads_per_threadgroup]],
                                     uint group [[threadgroup_position_in_grid]]) {
    threadgroup float tile[1024];
    threadgroup float grid2d[4][256];
    const uint base = group * n;
    tile[tid] = in[base + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    scratch[tid] = tile[n - 1 - tid] * 2.0f;
    grid2d[tid / 256][tid % 256] = 1.0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[base + tid] = scratch[n - 1 - tid] + grid2d[(n - 1 - tid) / 256][(n - 1 - tid) % 256];
}

// Reads threadgroup memory nobody wrote: must see the poison (NaN), in float, half and uint.
kernel void selftest_poison(device float* out [[buffer(0)]],
                            uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float never_written[64];
    threadgroup half never_written_half[64];
    threadgroup uint never_written_uint[64];
    out[tid * 3 + 0] = never_written[tid % 64];
    out[tid * 3 + 1] = float(never_written_half[tid % 64]);
    out[tid * 3 + 2] = float(never_written_uint[tid % 64] == 0xFFFFFFFFu);
}

// Lanes 16-31 of each simdgroup return first: the remaining lanes' collectives are over them
// alone (simd_sum(1) = 16, the prefix sum counts only live lanes).
kernel void selftest_partial_simdgroup(device float* out [[buffer(0)]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       ushort lane [[thread_index_in_simdgroup]]) {
    if (lane >= 16) {
        return;
    }
    out[tid * 2 + 0] = simd_sum(1.0f);
    out[tid * 2 + 1] = simd_prefix_exclusive_sum(float(lane));
}
