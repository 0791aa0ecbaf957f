// Self-test kernels for half / bfloat conversion and per-operation rounding.
#include <metal_stdlib>
using namespace metal;

// For each input x: the bits of half(x), bfloat(x), and of a*b, a+b, a/b computed in half and
// in bfloat (a = x, b = in[(i + 1) % n]).
kernel void selftest_lowp_numerics(device const float* in [[buffer(0)]],
                                   device ushort* out [[buffer(1)]],
                                   constant uint& n [[buffer(2)]],
                                   uint i [[thread_position_in_grid]]) {
    if (i >= n) {
        return;
    }
    const float x = in[i];
    const float y = in[(i + 1) % n];
    const half hx = half(x);
    const half hy = static_cast<half>(y);
    const bfloat bx = bfloat(x);
    const bfloat by = bfloat(y);
    device ushort* o = out + i * 8;
    o[0] = as_type<ushort>(hx);
    o[1] = as_type<ushort>(bx);
    o[2] = as_type<ushort>(half(hx * hy));
    o[3] = as_type<ushort>(half(hx + hy));
    o[4] = as_type<ushort>(half(hx / hy));
    o[5] = as_type<ushort>(bfloat(bx * by));
    o[6] = as_type<ushort>(bfloat(bx + by));
    o[7] = as_type<ushort>(half(hx * 2.0h - 1.0h));
}

// A template kernel instantiated per type: y = x * scale + bias, computed in T.
struct ScaleParams {
    float scale;
    float bias;
    uint n;
};

template <typename T>
kernel void selftest_scale(device const T* x [[buffer(0)]],
                           device T* y [[buffer(1)]],
                           constant ScaleParams& params [[buffer(2)]],
                           uint2 pos [[thread_position_in_grid]]) {
    if (pos.x < params.n) {
        y[pos.x] = T(x[pos.x] * T(params.scale) + T(params.bias));
    }
}

template [[host_name("selftest_scale_float")]] [[kernel]] void selftest_scale<float>(
    device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
    constant ScaleParams& params [[buffer(2)]], uint2 pos [[thread_position_in_grid]]);
template [[host_name("selftest_scale_half")]] [[kernel]] void selftest_scale<half>(
    device const half* x [[buffer(0)]], device half* y [[buffer(1)]],
    constant ScaleParams& params [[buffer(2)]], uint2 pos [[thread_position_in_grid]]);
template [[host_name("selftest_scale_bfloat")]] [[kernel]] void selftest_scale<bfloat>(
    device const bfloat* x [[buffer(0)]], device bfloat* y [[buffer(1)]],
    constant ScaleParams& params [[buffer(2)]], uint2 pos [[thread_position_in_grid]]);

// Vector types, constructors, conversions and math functions; out holds 4 float4 per input.
kernel void selftest_vector_math(device const float4* in [[buffer(0)]],
                                 device float4* out [[buffer(1)]],
                                 uint i [[thread_position_in_grid]]) {
    const float4 v = in[i];
    const half4 h = half4(v);
    float4 r = float4(h) * 2.0f + float4(v.x, v.y, 0.5f, 1.0f);
    const float2 xw = float2(v.x, v.w);
    r += float4(xw, xw);
    out[i * 4 + 0] = r;
    out[i * 4 + 1] = float4(fast::exp(v.x), precise::exp2(v.y), max(v.z, v.w), clamp(v.x, -0.5f, 0.5f));
    out[i * 4 + 2] = select(v, float4(0.0f), v < 0.0f);
    const int2 n = int2(int(v.x * 10.0f), 3);
    out[i * 4 + 3] = float4(metal::numeric_limits<float>::infinity(), metal::numeric_limits<float>::lowest(),
                            float(abs(n.x) + n.y), rsqrt(fabs(v.w) + 1.0f));
}
