// Deliberately broken kernels: the simulator must report each of these, never run them quietly.
#include <metal_stdlib>
using namespace metal;

// Copies in[i + 1] to out[i] for every thread of the grid: the last thread reads one element
// past the end of `in`.
kernel void selftest_oob_read(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
    out[i] = in[i + 1];
}

// A plain copy, for exact byte counting: reads and writes 4 bytes per thread.
kernel void selftest_copy(device const float* in [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
    out[i] = in[i];
}

// Lanes 0-15 and 16-31 call different simd-group functions.
kernel void selftest_divergent_simd(device float* out [[buffer(0)]],
                                    ushort lane [[thread_index_in_simdgroup]],
                                    uint i [[thread_position_in_grid]]) {
    float v = float(lane);
    if (lane < 16) {
        v = simd_sum(v);
    } else {
        v = simd_max(v);
    }
    out[i] = v;
}

// Only the first simdgroup reaches the barrier; the others return.
kernel void selftest_divergent_barrier(device float* out [[buffer(0)]],
                                       uint tid [[thread_index_in_threadgroup]]) {
    if (tid >= 32) {
        return;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
}

// Simdgroup 0 waits at a barrier while simdgroup 1 waits at a simd op whose other lanes went to
// the barrier: nobody can proceed.
kernel void selftest_deadlock(device float* out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
    float v = 1.0f;
    if (tid == 40) {
        v = simd_sum(v);
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = v;
}

// Threadgroup array subscript one past its end.
kernel void selftest_threadgroup_oob(device float* out [[buffer(0)]],
                                     uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float tile[32];
    tile[tid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = tile[tid];
}

// Writes through a pointer into a binding the launch made read-only.
kernel void selftest_write(device float* out [[buffer(0)]],
                           uint i [[thread_position_in_grid]]) {
    out[i] = 2.0f;
}

// Every thread publishes a value and reads its neighbour's, in another simdgroup, without a
// threadgroup_barrier in between: a data race on the GPU, whatever order the simulator runs in.
kernel void selftest_race_missing_barrier(device float* out [[buffer(0)]],
                                          uint tid [[thread_index_in_threadgroup]],
                                          uint n [[threads_per_threadgroup]]) {
    threadgroup float exchange[1024];
    exchange[tid] = float(tid);
    out[tid] = exchange[(tid + 32) % n];
}

// The same exchange done right: within a simdgroup a simdgroup_barrier orders it, across
// simdgroups a threadgroup_barrier does; then the buffer is reused after another barrier.
kernel void selftest_ordered_exchange(device float* out [[buffer(0)]],
                                      uint tid [[thread_index_in_threadgroup]],
                                      uint n [[threads_per_threadgroup]],
                                      ushort lane [[thread_index_in_simdgroup]]) {
    threadgroup float exchange[1024];
    threadgroup int counter;
    exchange[tid] = float(tid);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    float neighbour = exchange[tid ^ 1u];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    neighbour += exchange[(tid + 32) % n];
    if (tid == 0) {
        counter = 7;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    exchange[tid] = neighbour + float(counter);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = exchange[n - 1 - tid] + float(lane) * 0.0f;
}

// Two threadgroups store to the same output element: the result depends on their order.
kernel void selftest_store_race(device float* out [[buffer(0)]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint group [[threadgroup_position_in_grid]]) {
    out[tid] = float(group);
}

// Stores to the same element ordered by a barrier (and a thread overwriting its own store) are
// fine.
kernel void selftest_ordered_stores(device float* out [[buffer(0)]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint group [[threadgroup_position_in_grid]],
                                    uint n [[threads_per_threadgroup]]) {
    const uint base = group * n;
    out[base + tid] = 1.0f;
    out[base + tid] = 2.0f;
    threadgroup_barrier(mem_flags::mem_device);
    out[base + (tid + 1) % n] += 1.0f;
}

// Each threadgroup reads the block of the next one and writes its own: a race exactly when
// `in` and `out` are the same memory (the next threadgroup may have stored to it already).
kernel void selftest_load_race(device const float* in [[buffer(0)]],
                               device float* out [[buffer(1)]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint group [[threadgroup_position_in_grid]],
                               uint n [[threads_per_threadgroup]],
                               uint groups [[threadgroups_per_grid]]) {
    out[group * n + tid] = in[((group + 1) % groups) * n + tid] + 1.0f;
}

// After lanes 16-31 return, the other lanes shuffle from them: undefined on the GPU.
kernel void selftest_shuffle_from_returned_lane(device float* out [[buffer(0)]],
                                                uint tid [[thread_index_in_threadgroup]],
                                                ushort lane [[thread_index_in_simdgroup]]) {
    if (lane >= 16) {
        return;
    }
    out[tid] = simd_shuffle_xor(float(lane), ushort(16));
}
