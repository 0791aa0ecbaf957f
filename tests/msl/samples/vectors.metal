// A positive sample for the front-end check (tests/test_msl_frontend.py): vector
// constructors (conversion, splat, copy, composition), bool vectors and the relational
// functions on vectors. Checked, never run.
#include <metal_stdlib>

using namespace metal;

[[kernel]] void vector_conversions(device const half4* h [[buffer(0)]],
                                   device const int4* i [[buffer(1)]],
                                   device float4* out [[buffer(2)]],
                                   uint id [[thread_position_in_grid]]) {
  const float4 from_half = float4(h[id]);       // element-wise conversion
  const float4 from_int = float4(i[id]);
  const float4 copy = float4(from_half);        // same type
  const float4 splat = float4(1.0f);            // scalar to every element
  const float4 composed = float4(from_int.xy, 0.5f, float(h[id].w));
  const half4 narrowed = half4(composed);
  const int2 truncated = int2(copy.zw);
  const bool4 finite = isfinite(from_half);
  const bool2 nan2 = isnan(copy.xy);
  const bool4 truth = bool4(true);
  float4 r = select(splat, from_half, finite);
  r += select(float4(0.0f), float4(narrowed), truth);
  if (all(finite) && !any(nan2) && finite.x && finite[1]) r.xy += float2(truncated);
  out[id] = r + float4();
}
