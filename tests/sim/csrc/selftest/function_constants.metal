// Self-test kernel for function constants: out[i] = in[i] * scale (+ bias when use_bias and a
// bias is given) + offset, with `scale` a uint, `offset` a half, `bias` a float that may be left
// undefined (tested with is_function_constant_defined), and one constant nobody uses.
#include <metal_stdlib>
using namespace metal;

constant uint scale [[function_constant(0)]];
constant bool use_bias [[function_constant(1)]];
constant float bias [[function_constant(2)]];
constant half offset [[function_constant(3)]];
constant ushort never_used [[function_constant(7)]];
constant bool has_bias = is_function_constant_defined(bias);
constant bool add_bias = use_bias && has_bias;

kernel void selftest_function_constants(device const float* in [[buffer(0)]],
                                        device float* out [[buffer(1)]],
                                        uint i [[thread_position_in_grid]]) {
    float x = in[i] * float(scale);
    if (add_bias) {
        x += bias;
    }
    out[i] = x + float(offset);
}
