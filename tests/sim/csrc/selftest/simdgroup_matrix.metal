// Self-test kernels for simdgroup_matrix (MSL 3.1 §6.7): multiplies, loads and stores with
// strides, origins and transposition from device and threadgroup memory, the lane layout of
// thread_elements(), and the misuses the simulator must report. tests/test_simulator.py computes
// every expected value independently (float64).
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

// Simdgroup m of the grid (one 8x8 problem each, row-major 64 elements) computes
// d = a * b + c and p = a * b.
template <typename T, typename Acc>
kernel void selftest_mma(device const T* a [[buffer(0)]],
                         device const T* b [[buffer(1)]],
                         device const Acc* c [[buffer(2)]],
                         device Acc* d [[buffer(3)]],
                         device Acc* p [[buffer(4)]],
                         uint group [[threadgroup_position_in_grid]],
                         ushort simd [[simdgroup_index_in_threadgroup]],
                         ushort simds [[simdgroups_per_threadgroup]]) {
    const uint m = (group * simds + simd) * 64;
    simdgroup_matrix<T, 8, 8> ma;
    simdgroup_matrix<T, 8, 8> mb;
    simdgroup_matrix<Acc, 8, 8> mc;
    simdgroup_matrix<Acc, 8, 8> md;
    simdgroup_load(ma, a + m);
    simdgroup_load(mb, b + m);
    simdgroup_load(mc, c + m);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_store(md, d + m);
    simdgroup_multiply(md, ma, mb);
    simdgroup_store(md, p + m);
}
template [[host_name("selftest_mma_float")]] [[kernel]] void selftest_mma<float, float>(
    device const float* a [[buffer(0)]], device const float* b [[buffer(1)]], device const float* c [[buffer(2)]],
    device float* d [[buffer(3)]], device float* p [[buffer(4)]], uint group [[threadgroup_position_in_grid]],
    ushort simd [[simdgroup_index_in_threadgroup]], ushort simds [[simdgroups_per_threadgroup]]);
template [[host_name("selftest_mma_half")]] [[kernel]] void selftest_mma<half, half>(
    device const half* a [[buffer(0)]], device const half* b [[buffer(1)]], device const half* c [[buffer(2)]],
    device half* d [[buffer(3)]], device half* p [[buffer(4)]], uint group [[threadgroup_position_in_grid]],
    ushort simd [[simdgroup_index_in_threadgroup]], ushort simds [[simdgroups_per_threadgroup]]);
template [[host_name("selftest_mma_half_float")]] [[kernel]] void selftest_mma<half, float>(
    device const half* a [[buffer(0)]], device const half* b [[buffer(1)]], device const float* c [[buffer(2)]],
    device float* d [[buffer(3)]], device float* p [[buffer(4)]], uint group [[threadgroup_position_in_grid]],
    ushort simd [[simdgroup_index_in_threadgroup]], ushort simds [[simdgroups_per_threadgroup]]);
template [[host_name("selftest_mma_bfloat_float")]] [[kernel]] void selftest_mma<bfloat, float>(
    device const bfloat* a [[buffer(0)]], device const bfloat* b [[buffer(1)]], device const float* c [[buffer(2)]],
    device float* d [[buffer(3)]], device float* p [[buffer(4)]], uint group [[threadgroup_position_in_grid]],
    ushort simd [[simdgroup_index_in_threadgroup]], ushort simds [[simdgroups_per_threadgroup]]);

// A half operand times a float operand into a float accumulator (as llama.cpp's mul_mm does).
kernel void selftest_mma_mixed(device const half* a [[buffer(0)]],
                               device const float* b [[buffer(1)]],
                               device float* d [[buffer(2)]]) {
    simdgroup_half8x8 ma;
    simdgroup_float8x8 mb;
    simdgroup_float8x8 md = make_filled_simdgroup_matrix<float, 8>(0.5h);
    simdgroup_load(ma, a);
    simdgroup_load(mb, b);
    simdgroup_multiply_accumulate(md, ma, mb, md);
    simdgroup_store(md, d);
}

struct TransferArgs {
    uint load_row_elements, load_col, load_row, load_transpose;
    uint store_row_elements, store_col, store_row, store_transpose;
    uint through_threadgroup;  // 0: device -> device; 1: threadgroup -> threadgroup
    uint elements;             // of src and dst (at most 1024)
};

// Loads one matrix from `src` (load_* parameters) and stores it into `dst` (store_*). Through
// threadgroup memory, the threads first copy src into one tile and afterwards the other tile
// out to dst, element by element.
kernel void selftest_matrix_transfer(device const float* src [[buffer(0)]],
                                     device float* dst [[buffer(1)]],
                                     constant TransferArgs& args [[buffer(2)]],
                                     uint tid [[thread_index_in_threadgroup]]) {
    const ulong2 load_origin = ulong2(args.load_col, args.load_row);
    const ulong2 store_origin = ulong2(args.store_col, args.store_row);
    simdgroup_float8x8 m;
    if (args.through_threadgroup == 0) {
        simdgroup_load(m, src, args.load_row_elements, load_origin, args.load_transpose != 0);
        simdgroup_store(m, dst, args.store_row_elements, store_origin, args.store_transpose != 0);
        return;
    }
    threadgroup float in_tile[1024];
    threadgroup float out_tile[1024];
    for (uint i = tid; i < args.elements; i += 32) {
        in_tile[i] = src[i];
        out_tile[i] = dst[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_load(m, in_tile, args.load_row_elements, load_origin, args.load_transpose != 0);
    simdgroup_store(m, out_tile, args.store_row_elements, store_origin, args.store_transpose != 0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < args.elements; i += 32) {
        dst[i] = out_tile[i];
    }
}

// The lane layout: out[0..63] is a matrix whose lane l set its elements to (l, l + 0.5) through
// thread_elements(); out[64 + 2l + k] is element k of lane l after loading the matrix
// r * 8 + c; out[128..191] the diagonal matrix simdgroup_float8x8(3); out[192..255]
// make_filled_simdgroup_matrix(-2).
kernel void selftest_matrix_layout(device float* out [[buffer(0)]],
                                   ushort lane [[thread_index_in_simdgroup]]) {
    threadgroup float iota[64];
    for (uint i = lane; i < 64; i += 32) {
        iota[i] = float(i);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 m;
    m.thread_elements() = float2(float(lane), float(lane) + 0.5f);
    simdgroup_store(m, out);
    simdgroup_load(m, iota);
    out[64 + 2 * lane] = m.thread_elements()[0];
    out[64 + 2 * lane + 1] = m.thread_elements()[1];
    simdgroup_float8x8 diagonal(3.0f);
    simdgroup_store(diagonal, out + 128);
    simdgroup_store(make_filled_simdgroup_matrix<float, 8, 8>(-2.0f), out + 192);
}

// Misuses, one per mode; each must be reported, never run.
kernel void selftest_matrix_misuse(device float* buf [[buffer(0)]],
                                   constant uint& mode [[buffer(1)]],
                                   ushort lane [[thread_index_in_simdgroup]]) {
    simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8>(1.0f);
    if (mode == 0) {  // the two halves of the simdgroup at different call sites
        if (lane < 16) {
            simdgroup_store(m, buf);
        } else {
            simdgroup_store(m, buf);
        }
    } else if (mode == 1) {  // lanes 16-31 returned: the rest call it alone
        if (lane >= 16) {
            return;
        }
        simdgroup_store(m, buf);
    } else if (mode == 2) {  // a pointer that differs between lanes
        simdgroup_load(m, buf + (lane / 16) * 64);
    } else if (mode == 3) {  // elements_per_row that differs between lanes
        simdgroup_load(m, buf, 8 + lane % 2);
    } else if (mode == 4) {  // transpose flag that differs between lanes
        simdgroup_store(m, buf, 8, 0, lane == 7);
    } else if (mode == 5) {  // origin that differs between lanes
        simdgroup_load(m, buf, 8, ulong2(0, lane == 31 ? 1 : 0));
    }
}
