// Compile-time checks of the MSL prelude: what msl.h must refuse to compile. Each assertion
// fails the simulator's build if the prelude starts accepting a construct MSL rejects (or
// that the simulator cannot model).
#include "msl.h"

namespace {
using namespace metal;

template <class D, class A, class B, class C>
constexpr bool can_multiply_accumulate = requires(simdgroup_matrix<D, 8, 8>& d, const simdgroup_matrix<A, 8, 8>& a,
                                                  const simdgroup_matrix<B, 8, 8>& b,
                                                  const simdgroup_matrix<C, 8, 8>& c) {
  simdgroup_multiply_accumulate(d, a, b, c);
};

// Float accumulators over half or bfloat operands, and one low-precision type throughout: fine.
static_assert(can_multiply_accumulate<float, float, float, float>);
static_assert(can_multiply_accumulate<float, half, half, float>);
static_assert(can_multiply_accumulate<float, half, float, float>);
static_assert(can_multiply_accumulate<float, bfloat, bfloat, float>);
static_assert(can_multiply_accumulate<half, half, half, half>);
static_assert(can_multiply_accumulate<bfloat, bfloat, bfloat, bfloat>);
// half and bfloat never meet in one operation.
static_assert(!can_multiply_accumulate<float, half, bfloat, float>);
static_assert(!can_multiply_accumulate<half, bfloat, bfloat, half>);

// Loads and stores take the matrix's own element type only (a requires-expression must depend
// on a template parameter to be a test rather than an error).
template <class M, class P>
constexpr bool can_load = requires(M& m, P p) { simdgroup_load(m, p); };
template <class M, class P>
constexpr bool can_store = requires(const M& m, P p) { simdgroup_store(m, p); };
static_assert(can_load<simdgroup_float8x8, device_ptr<const float>>);
static_assert(can_load<simdgroup_float8x8, device_ptr<float>>);
static_assert(can_load<simdgroup_half8x8, threadgroup_ptr<half>>);
static_assert(can_store<simdgroup_bfloat8x8, threadgroup_ptr<bfloat>>);
static_assert(!can_load<simdgroup_float8x8, device_ptr<const half>>);
static_assert(!can_store<simdgroup_half8x8, threadgroup_ptr<float>>);
// A store needs a writable pointer.
static_assert(!can_store<simdgroup_float8x8, device_ptr<const float>>);
}  // namespace
