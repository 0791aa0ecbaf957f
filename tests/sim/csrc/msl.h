// The Metal Shading Language prelude of the CPU simulator.
//
// msl2cpp.py translates shaders/*.metal into C++ that includes this header instead of
// <metal_stdlib>. It provides, in namespace metal, the part of the MSL standard library the
// project's kernels use (tests/sim/csrc/SUBSET.md lists it): half and bfloat with per-operation
// rounding, vector types, math, simd-group functions with lock-step semantics, barriers, and
// checked pointer types for the device and threadgroup address spaces.
//
// Anything not provided here fails to compile, which is the point: a construct the simulator
// cannot model faithfully must never compile into something that merely looks right.
//
// __METAL_VERSION__ is deliberately left undefined: shared project headers use it to choose
// between MSL and C++ spellings, and the simulator is C++.
#pragma once

// One rounding per floating-point operation: no contraction of a * b + c into an FMA. The
// simulator's results must not depend on whether the build machine has FMA (-march=native).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>

#include "exec.h"
#include "metal/function_constant.h"

namespace metal {

using uint = uint32_t;
using ushort = uint16_t;
using uchar = uint8_t;
using ulong = uint64_t;
using std::ptrdiff_t;
using std::size_t;

// ---------------------------------------------------------------------------------------------
// half (IEEE binary16) and bfloat (bfloat16): stored as bits, converted from float with
// round-to-nearest-even, and every arithmetic operation is rounded to the type, as on the GPU.
// Computing an operation in float and rounding once is exact for +, -, *, /, sqrt: float has
// more than 2p + 2 significand bits for both types, so the double rounding is innocuous.
// ---------------------------------------------------------------------------------------------
namespace detail {

constexpr uint16_t float_to_half_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x47800000u) return uint16_t(sign | 0x7c00u);  // >= 2^16 (and inf): infinity
  if (a >= 0x38800000u) {                                  // normal half: rebias, round
    const uint32_t r = a - 0x38000000u;
    uint32_t h = r >> 13;
    const uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into infinity: correct
    return uint16_t(sign | h);
  }
  if (a < 0x33000000u) return uint16_t(sign);  // below half the smallest subnormal: zero
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // in units of 2^-24
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

constexpr float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    const float mag = float(m) * 0x1p-24f;  // exact
    return sign ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

constexpr uint16_t float_to_bfloat_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

constexpr float bfloat_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

struct from_bits_t {};

}  // namespace detail

struct bfloat;

struct half {
  uint16_t bits;

  half() = default;
  constexpr half(detail::from_bits_t, uint16_t b) : bits(b) {}
  constexpr half(float f) : bits(detail::float_to_half_bits(f)) {}
  constexpr half(double d) : half(float(d)) {}
  template <class I>
    requires std::is_integral_v<I>
  constexpr half(I i) : half(float(i)) {}
  explicit constexpr half(bfloat b);
  constexpr operator float() const { return detail::half_bits_to_float(bits); }

  template <class U> half& operator+=(U u);
  template <class U> half& operator-=(U u);
  template <class U> half& operator*=(U u);
  template <class U> half& operator/=(U u);
  half& operator++() { return *this += 1; }
  half& operator--() { return *this -= 1; }
  half operator++(int) { half old = *this; *this += 1; return old; }
  half operator--(int) { half old = *this; *this -= 1; return old; }
};

struct bfloat {
  uint16_t bits;

  bfloat() = default;
  constexpr bfloat(detail::from_bits_t, uint16_t b) : bits(b) {}
  constexpr bfloat(float f) : bits(detail::float_to_bfloat_bits(f)) {}
  constexpr bfloat(double d) : bfloat(float(d)) {}
  template <class I>
    requires std::is_integral_v<I>
  constexpr bfloat(I i) : bfloat(float(i)) {}
  explicit constexpr bfloat(half h) : bfloat(float(h)) {}
  constexpr operator float() const { return detail::bfloat_bits_to_float(bits); }

  template <class U> bfloat& operator+=(U u);
  template <class U> bfloat& operator-=(U u);
  template <class U> bfloat& operator*=(U u);
  template <class U> bfloat& operator/=(U u);
  bfloat& operator++() { return *this += 1; }
  bfloat& operator--() { return *this -= 1; }
  bfloat operator++(int) { bfloat old = *this; *this += 1; return old; }
  bfloat operator--(int) { bfloat old = *this; *this -= 1; return old; }
};

constexpr half::half(bfloat b) : half(float(b)) {}

using bfloat16_t = bfloat;
using half_t = half;

template <class T>
inline constexpr bool is_lowp_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <class T>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<T> || is_lowp_v<T>;

namespace detail {
// Result type of a binary operation with at least one half/bfloat operand (MSL rules: an integer
// converts to the low-precision type, float wins over it, half and bfloat do not mix).
template <class A, class B> struct lowp_result {};
template <class L>
  requires is_lowp_v<L>
struct lowp_result<L, L> { using type = L; };
template <class L, class I>
  requires(is_lowp_v<L> && std::is_integral_v<I>)
struct lowp_result<L, I> { using type = L; };
template <class I, class L>
  requires(is_lowp_v<L> && std::is_integral_v<I>)
struct lowp_result<I, L> { using type = L; };
template <class L, class F>
  requires(is_lowp_v<L> && std::is_floating_point_v<F>)
struct lowp_result<L, F> { using type = float; };
template <class F, class L>
  requires(is_lowp_v<L> && std::is_floating_point_v<F>)
struct lowp_result<F, L> { using type = float; };
template <class A, class B>
using lowp_result_t = typename lowp_result<std::remove_cvref_t<A>, std::remove_cvref_t<B>>::type;
template <class A, class B>
concept lowp_operands = requires { typename lowp_result_t<A, B>; };

// Both operands as float after converting each to the result type first.
template <class R, class X> constexpr float as_operand(X x) {
  if constexpr (is_lowp_v<R>) return float(R(x));
  else return float(x);
}
}  // namespace detail

#define TREE_ATTN_SIM_LOWP_ARITH(OP)                                                    \
  template <class A, class B>                                                           \
    requires detail::lowp_operands<A, B>                                                \
  constexpr detail::lowp_result_t<A, B> operator OP(A a, B b) {                         \
    using R = detail::lowp_result_t<A, B>;                                              \
    return R(detail::as_operand<R>(a) OP detail::as_operand<R>(b));                     \
  }
TREE_ATTN_SIM_LOWP_ARITH(+)
TREE_ATTN_SIM_LOWP_ARITH(-)
TREE_ATTN_SIM_LOWP_ARITH(*)
TREE_ATTN_SIM_LOWP_ARITH(/)
#undef TREE_ATTN_SIM_LOWP_ARITH

#define TREE_ATTN_SIM_LOWP_COMPARE(OP)                                                  \
  template <class A, class B>                                                           \
    requires detail::lowp_operands<A, B>                                                \
  constexpr bool operator OP(A a, B b) {                                                \
    using R = detail::lowp_result_t<A, B>;                                              \
    return detail::as_operand<R>(a) OP detail::as_operand<R>(b);                        \
  }
TREE_ATTN_SIM_LOWP_COMPARE(==)
TREE_ATTN_SIM_LOWP_COMPARE(!=)
TREE_ATTN_SIM_LOWP_COMPARE(<)
TREE_ATTN_SIM_LOWP_COMPARE(>)
TREE_ATTN_SIM_LOWP_COMPARE(<=)
TREE_ATTN_SIM_LOWP_COMPARE(>=)
#undef TREE_ATTN_SIM_LOWP_COMPARE

constexpr half operator-(half h) { return half(detail::from_bits_t{}, uint16_t(h.bits ^ 0x8000u)); }
constexpr half operator+(half h) { return h; }
constexpr bfloat operator-(bfloat b) { return bfloat(detail::from_bits_t{}, uint16_t(b.bits ^ 0x8000u)); }
constexpr bfloat operator+(bfloat b) { return b; }

template <class U> half& half::operator+=(U u) { return *this = half(*this + u); }
template <class U> half& half::operator-=(U u) { return *this = half(*this - u); }
template <class U> half& half::operator*=(U u) { return *this = half(*this * u); }
template <class U> half& half::operator/=(U u) { return *this = half(*this / u); }
template <class U> bfloat& bfloat::operator+=(U u) { return *this = bfloat(*this + u); }
template <class U> bfloat& bfloat::operator-=(U u) { return *this = bfloat(*this - u); }
template <class U> bfloat& bfloat::operator*=(U u) { return *this = bfloat(*this * u); }
template <class U> bfloat& bfloat::operator/=(U u) { return *this = bfloat(*this / u); }

// ---------------------------------------------------------------------------------------------
// Vector types. Sizes and alignments follow MSL (a 3-vector occupies the space of a 4-vector).
// ---------------------------------------------------------------------------------------------
template <class T, int N> struct vec_storage;
template <class T> struct alignas(2 * sizeof(T)) vec_storage<T, 2> { T x, y; };
template <class T> struct alignas(4 * sizeof(T)) vec_storage<T, 3> { T x, y, z; };
template <class T> struct alignas(4 * sizeof(T)) vec_storage<T, 4> { T x, y, z, w; };

template <class T, int N> struct vec;

namespace detail {
template <class T> struct components : std::integral_constant<int, 1> {};
template <class T, int N> struct components<vec<T, N>> : std::integral_constant<int, N> {};
template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};
}  // namespace detail
template <class T>
inline constexpr bool is_vec_v = detail::is_vec<std::remove_cvref_t<T>>::value;

template <class T, int N> struct vec : vec_storage<T, N> {
  using element_type = T;
  static constexpr int size = N;

  vec() = default;  // uninitialised, like an MSL local
  // A scalar converts to a vector by broadcasting it.
  template <class U>
    requires is_scalar_v<U>
  constexpr vec(U s) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);
  }
  template <class... A>
    requires(sizeof...(A) >= 2 && (detail::components<A>::value + ...) == N)
  constexpr vec(A... parts) {
    int k = 0;
    (fill(k, parts), ...);
  }
  template <class U>
    requires(!std::is_same_v<U, T>)
  explicit constexpr vec(const vec<U, N>& other) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(other[i]);
  }

  constexpr T& operator[](int i) { return (&this->x)[i]; }
  constexpr const T& operator[](int i) const { return (&this->x)[i]; }

  template <class U> vec& operator+=(const U& u) { return *this = *this + u; }
  template <class U> vec& operator-=(const U& u) { return *this = *this - u; }
  template <class U> vec& operator*=(const U& u) { return *this = *this * u; }
  template <class U> vec& operator/=(const U& u) { return *this = *this / u; }

 private:
  template <class U> constexpr void fill(int& k, const U& part) {
    if constexpr (detail::is_vec<U>::value) {
      for (int j = 0; j < U::size; ++j) (*this)[k++] = T(part[j]);
    } else {
      (*this)[k++] = T(part);
    }
  }
};

#define TREE_ATTN_SIM_VEC_TYPES(T)  \
  using T##2 = vec<T, 2>;           \
  using T##3 = vec<T, 3>;           \
  using T##4 = vec<T, 4>;
TREE_ATTN_SIM_VEC_TYPES(float)
TREE_ATTN_SIM_VEC_TYPES(half)
TREE_ATTN_SIM_VEC_TYPES(bfloat)
TREE_ATTN_SIM_VEC_TYPES(int)
TREE_ATTN_SIM_VEC_TYPES(uint)
TREE_ATTN_SIM_VEC_TYPES(short)
TREE_ATTN_SIM_VEC_TYPES(ushort)
TREE_ATTN_SIM_VEC_TYPES(char)
TREE_ATTN_SIM_VEC_TYPES(uchar)
TREE_ATTN_SIM_VEC_TYPES(bool)
TREE_ATTN_SIM_VEC_TYPES(long)
TREE_ATTN_SIM_VEC_TYPES(ulong)
#undef TREE_ATTN_SIM_VEC_TYPES

#define TREE_ATTN_SIM_VEC_ARITH(OP)                                                           \
  template <class T, int N>                                                                   \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                   \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                       \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N, class U>                                                          \
    requires is_scalar_v<U>                                                                   \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, U b) {                                  \
    return a OP vec<T, N>(b);                                                                 \
  }                                                                                           \
  template <class T, int N, class U>                                                          \
    requires is_scalar_v<U>                                                                   \
  constexpr vec<T, N> operator OP(U a, const vec<T, N>& b) {                                  \
    return vec<T, N>(a) OP b;                                                                 \
  }
TREE_ATTN_SIM_VEC_ARITH(+)
TREE_ATTN_SIM_VEC_ARITH(-)
TREE_ATTN_SIM_VEC_ARITH(*)
TREE_ATTN_SIM_VEC_ARITH(/)
TREE_ATTN_SIM_VEC_ARITH(%)
TREE_ATTN_SIM_VEC_ARITH(&)
TREE_ATTN_SIM_VEC_ARITH(|)
TREE_ATTN_SIM_VEC_ARITH(^)
TREE_ATTN_SIM_VEC_ARITH(<<)
TREE_ATTN_SIM_VEC_ARITH(>>)
#undef TREE_ATTN_SIM_VEC_ARITH

#define TREE_ATTN_SIM_VEC_COMPARE(OP)                                                         \
  template <class T, int N>                                                                   \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                \
    vec<bool, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                          \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N, class U>                                                          \
    requires is_scalar_v<U>                                                                   \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, U b) {                               \
    return a OP vec<T, N>(b);                                                                 \
  }                                                                                           \
  template <class T, int N, class U>                                                          \
    requires is_scalar_v<U>                                                                   \
  constexpr vec<bool, N> operator OP(U a, const vec<T, N>& b) {                               \
    return vec<T, N>(a) OP b;                                                                 \
  }
TREE_ATTN_SIM_VEC_COMPARE(==)
TREE_ATTN_SIM_VEC_COMPARE(!=)
TREE_ATTN_SIM_VEC_COMPARE(<)
TREE_ATTN_SIM_VEC_COMPARE(>)
TREE_ATTN_SIM_VEC_COMPARE(<=)
TREE_ATTN_SIM_VEC_COMPARE(>=)
TREE_ATTN_SIM_VEC_COMPARE(&&)
TREE_ATTN_SIM_VEC_COMPARE(||)
#undef TREE_ATTN_SIM_VEC_COMPARE

template <class T, int N> constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}
template <class T, int N> constexpr vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <int N> constexpr vec<bool, N> operator!(const vec<bool, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}
template <int N> constexpr bool all(const vec<bool, N>& a) {
  for (int i = 0; i < N; ++i)
    if (!a[i]) return false;
  return true;
}
template <int N> constexpr bool any(const vec<bool, N>& a) {
  for (int i = 0; i < N; ++i)
    if (a[i]) return true;
  return false;
}
constexpr bool all(bool b) { return b; }
constexpr bool any(bool b) { return b; }

// ---------------------------------------------------------------------------------------------
// numeric_limits, as_type
// ---------------------------------------------------------------------------------------------
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(detail::from_bits_t{}, 0x0400); }
  static constexpr half max() { return half(detail::from_bits_t{}, 0x7bff); }
  static constexpr half lowest() { return half(detail::from_bits_t{}, 0xfbff); }
  static constexpr half epsilon() { return half(detail::from_bits_t{}, 0x1400); }
  static constexpr half infinity() { return half(detail::from_bits_t{}, 0x7c00); }
  static constexpr half quiet_NaN() { return half(detail::from_bits_t{}, 0x7e00); }
  static constexpr half denorm_min() { return half(detail::from_bits_t{}, 0x0001); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return bfloat(detail::from_bits_t{}, 0x0080); }
  static constexpr bfloat max() { return bfloat(detail::from_bits_t{}, 0x7f7f); }
  static constexpr bfloat lowest() { return bfloat(detail::from_bits_t{}, 0xff7f); }
  static constexpr bfloat epsilon() { return bfloat(detail::from_bits_t{}, 0x3c00); }
  static constexpr bfloat infinity() { return bfloat(detail::from_bits_t{}, 0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat(detail::from_bits_t{}, 0x7fc0); }
  static constexpr bfloat denorm_min() { return bfloat(detail::from_bits_t{}, 0x0001); }
};

template <class To, class From> constexpr To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the two types must have the same size");
  return std::bit_cast<To>(from);
}

// ---------------------------------------------------------------------------------------------
// Math. Transcendentals use the C library in float (the GPU's are not correctly rounded either;
// tests compare with tolerances); half/bfloat variants round the float result to the type.
// ---------------------------------------------------------------------------------------------
#define TREE_ATTN_SIM_MATH1(NAME, EXPR)                                                       \
  inline float NAME(float x) { return EXPR; }                                                 \
  inline half NAME(half x) { return half(NAME(float(x))); }                                   \
  inline bfloat NAME(bfloat x) { return bfloat(NAME(float(x))); }                             \
  template <class T, int N> inline vec<T, N> NAME(const vec<T, N>& v) {                       \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                            \
    return r;                                                                                 \
  }
TREE_ATTN_SIM_MATH1(exp, std::exp(x))
TREE_ATTN_SIM_MATH1(exp2, std::exp2(x))
TREE_ATTN_SIM_MATH1(exp10, std::pow(10.0f, x))
TREE_ATTN_SIM_MATH1(log, std::log(x))
TREE_ATTN_SIM_MATH1(log2, std::log2(x))
TREE_ATTN_SIM_MATH1(log10, std::log10(x))
TREE_ATTN_SIM_MATH1(sqrt, std::sqrt(x))
TREE_ATTN_SIM_MATH1(rsqrt, 1.0f / std::sqrt(x))
TREE_ATTN_SIM_MATH1(tanh, std::tanh(x))
TREE_ATTN_SIM_MATH1(sin, std::sin(x))
TREE_ATTN_SIM_MATH1(cos, std::cos(x))
TREE_ATTN_SIM_MATH1(tan, std::tan(x))
TREE_ATTN_SIM_MATH1(fabs, std::fabs(x))
TREE_ATTN_SIM_MATH1(floor, std::floor(x))
TREE_ATTN_SIM_MATH1(ceil, std::ceil(x))
TREE_ATTN_SIM_MATH1(round, std::round(x))
TREE_ATTN_SIM_MATH1(trunc, std::trunc(x))
TREE_ATTN_SIM_MATH1(rint, std::nearbyint(x))
TREE_ATTN_SIM_MATH1(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
TREE_ATTN_SIM_MATH1(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
TREE_ATTN_SIM_MATH1(sign, (x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : std::isnan(x) ? 0.0f : x))
#undef TREE_ATTN_SIM_MATH1

#define TREE_ATTN_SIM_MATH2(NAME, EXPR)                                                       \
  inline float NAME(float x, float y) { return EXPR; }                                        \
  inline half NAME(half x, half y) { return half(NAME(float(x), float(y))); }                 \
  inline bfloat NAME(bfloat x, bfloat y) { return bfloat(NAME(float(x), float(y))); }         \
  template <class T, int N> inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {   \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i]);                                      \
    return r;                                                                                 \
  }
TREE_ATTN_SIM_MATH2(fmax, std::fmax(x, y))
TREE_ATTN_SIM_MATH2(fmin, std::fmin(x, y))
TREE_ATTN_SIM_MATH2(pow, std::pow(x, y))
TREE_ATTN_SIM_MATH2(powr, std::pow(x, y))
TREE_ATTN_SIM_MATH2(fmod, std::fmod(x, y))
TREE_ATTN_SIM_MATH2(copysign, std::copysign(x, y))
TREE_ATTN_SIM_MATH2(divide, x / y)
#undef TREE_ATTN_SIM_MATH2

// max/min/clamp/abs for floating types follow fmax/fmin (a NaN operand yields the other one).
#define TREE_ATTN_SIM_MINMAX_FLOAT(T)                                                         \
  inline T max(T x, T y) { return fmax(x, y); }                                               \
  inline T min(T x, T y) { return fmin(x, y); }                                               \
  inline T clamp(T x, T lo, T hi) { return fmin(fmax(x, lo), hi); }                           \
  inline T abs(T x) { return fabs(x); }
TREE_ATTN_SIM_MINMAX_FLOAT(float)
TREE_ATTN_SIM_MINMAX_FLOAT(half)
TREE_ATTN_SIM_MINMAX_FLOAT(bfloat)
#undef TREE_ATTN_SIM_MINMAX_FLOAT

#define TREE_ATTN_SIM_MINMAX_INT(T)                                                           \
  constexpr T max(T x, T y) { return x > y ? x : y; }                                         \
  constexpr T min(T x, T y) { return x < y ? x : y; }                                         \
  constexpr T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
TREE_ATTN_SIM_MINMAX_INT(int8_t)
TREE_ATTN_SIM_MINMAX_INT(uint8_t)
TREE_ATTN_SIM_MINMAX_INT(int16_t)
TREE_ATTN_SIM_MINMAX_INT(uint16_t)
TREE_ATTN_SIM_MINMAX_INT(int32_t)
TREE_ATTN_SIM_MINMAX_INT(uint32_t)
TREE_ATTN_SIM_MINMAX_INT(int64_t)
TREE_ATTN_SIM_MINMAX_INT(uint64_t)
#undef TREE_ATTN_SIM_MINMAX_INT
constexpr int8_t abs(int8_t x) { return x < 0 ? int8_t(-x) : x; }
constexpr int16_t abs(int16_t x) { return x < 0 ? int16_t(-x) : x; }
constexpr int32_t abs(int32_t x) { return x < 0 ? -x : x; }
constexpr int64_t abs(int64_t x) { return x < 0 ? -x : x; }

template <class T, int N> inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N> inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N> inline vec<T, N> abs(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(a[i]);
  return r;
}
template <class T, int N> inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <class T, int N> inline vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}

namespace detail {
inline void count_fma() {
  if (auto* t = tree_attn::sim::detail::current_thread()) ++t->counters->scalar_fmas;
}
}  // namespace detail
// Each scalar fma is counted (LaunchStats::scalar_fmas).
inline float fma(float a, float b, float c) {
  detail::count_fma();
  return std::fma(a, b, c);
}
inline half fma(half a, half b, half c) {
  detail::count_fma();
  return half(float(double(a) * double(b) + double(c)));
}
inline bfloat fma(bfloat a, bfloat b, bfloat c) {
  detail::count_fma();
  return bfloat(float(double(a) * double(b) + double(c)));
}
template <class T, int N> inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline half mix(half x, half y, half a) { return x + (y - x) * a; }
template <class T, int N> inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, const vec<T, N>& a) {
  return x + (y - x) * a;
}

template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T r = T(a[0] * b[0]);
  for (int i = 1; i < N; ++i) r = T(r + T(a[i] * b[i]));
  return r;
}

#define TREE_ATTN_SIM_CLASSIFY(NAME, EXPR)                                                    \
  inline bool NAME(float x) { return EXPR; }                                                  \
  inline bool NAME(half x) { return NAME(float(x)); }                                         \
  inline bool NAME(bfloat x) { return NAME(float(x)); }                                       \
  template <class T, int N> inline vec<bool, N> NAME(const vec<T, N>& v) {                    \
    vec<bool, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                            \
    return r;                                                                                 \
  }
TREE_ATTN_SIM_CLASSIFY(isnan, std::isnan(x))
TREE_ATTN_SIM_CLASSIFY(isinf, std::isinf(x))
TREE_ATTN_SIM_CLASSIFY(isfinite, std::isfinite(x))
TREE_ATTN_SIM_CLASSIFY(signbit, std::signbit(x))
#undef TREE_ATTN_SIM_CLASSIFY

// select(a, b, c): c ? b : a, element-wise for vectors.
template <class T>
  requires is_scalar_v<T>
constexpr T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> constexpr vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }
template <class T, int N> constexpr vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

constexpr uint32_t popcount(uint32_t x) { return uint32_t(std::popcount(x)); }
constexpr uint64_t popcount(uint64_t x) { return uint64_t(std::popcount(x)); }
constexpr uint32_t clz(uint32_t x) { return uint32_t(std::countl_zero(x)); }
constexpr uint32_t ctz(uint32_t x) { return uint32_t(std::countr_zero(x)); }

// fast:: and precise:: select accuracy modes on the GPU; the simulator has one implementation.
namespace fast {
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace fast
namespace precise {
using namespace fast;
}

// ---------------------------------------------------------------------------------------------
// Barriers and simd-group functions: lock-step collectives over the live lanes of a simdgroup.
// Each call site is recorded (std::source_location) so lanes arriving at different ops fault.
// ---------------------------------------------------------------------------------------------
enum class mem_flags : uint32_t {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint32_t(a) | uint32_t(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint32_t(a) & uint32_t(b)); }

// Every synchronisation point reorders nothing: fibers run sequentially, so memory is always
// coherent and the flags only document intent.
inline void threadgroup_barrier(mem_flags, std::source_location site = std::source_location::current()) {
  tree_attn::sim::detail::threadgroup_barrier_wait(site);
}
inline void simdgroup_barrier(mem_flags, std::source_location site = std::source_location::current()) {
  tree_attn::sim::detail::simd_arrive("simdgroup_barrier", site, nullptr, 0, 0);
}

namespace detail {
using tree_attn::sim::detail::SimdGroup;

template <class T>
concept simd_value = std::is_trivially_copyable_v<T> && sizeof(T) <= tree_attn::sim::detail::kSimdSlotBytes &&
                     (is_scalar_v<T> || is_vec_v<T>);

template <class T> T slot_get(const unsigned char* s) {
  T v;
  std::memcpy(&v, s, sizeof(T));
  return v;
}
template <class T> void slot_put(unsigned char* s, const T& v) { std::memcpy(s, &v, sizeof(T)); }

// Gather one value per live lane, run `compute(sg)` once for the whole simdgroup (whichever lane
// resumes first), hand each lane its result.
// (Each lane's result is a T, or an R when given.)
template <class R = void, class T, class Compute>
inline std::conditional_t<std::is_void_v<R>, T, R> simd_collective(const char* name, const std::source_location& site,
                                                                   const T& value, uint32_t arg, Compute&& compute) {
  using Result = std::conditional_t<std::is_void_v<R>, T, R>;
  static_assert(sizeof(Result) <= tree_attn::sim::detail::kSimdSlotBytes);
  const uint32_t lane = tree_attn::sim::detail::current_thread()->lane;
  SimdGroup& sg = tree_attn::sim::detail::simd_arrive(name, site, &value, sizeof(T), arg);
  if (sg.computed != sg.completed) {
    ++tree_attn::sim::detail::current_thread()->counters->shuffles;
    compute(sg);
    sg.computed = sg.completed;
  }
  return slot_get<Result>(sg.results[lane]);
}

// A fixed pairwise tree over lanes 0..31 (absent lanes skipped), the same for every lane.
template <class T, class Op> void simd_reduce_compute(SimdGroup& sg, Op op) {
  T acc[32];
  uint32_t have = sg.op_mask;
  for (int l = 0; l < 32; ++l)
    if (have >> l & 1u) acc[l] = slot_get<T>(sg.values[l]);
  for (int stride = 1; stride < 32; stride *= 2) {
    for (int i = 0; i + stride < 32; i += 2 * stride) {
      const int j = i + stride;
      if (!(have >> j & 1u)) continue;
      if (have >> i & 1u) {
        acc[i] = op(acc[i], acc[j]);
      } else {
        acc[i] = acc[j];
        have |= 1u << i;
      }
    }
  }
  for (int l = 0; l < 32; ++l)
    if (sg.op_mask >> l & 1u) slot_put(sg.results[l], acc[0]);
}

template <class T, class Op> T simd_reduce(const char* name, const std::source_location& site, const T& v, Op op) {
  return simd_collective(name, site, v, 0, [&](SimdGroup& sg) { simd_reduce_compute<T>(sg, op); });
}

// Lanes read the value of lane source(lane, arg); a source outside the live lanes is a fault
// (the GPU returns an undefined value there), except where MSL defines the result as the
// lane's own value (shuffle_up/down past the edge).
template <class T, class Source>
T simd_permute(const char* name, const std::source_location& site, const T& v, uint32_t arg, Source source) {
  return simd_collective(name, site, v, arg, [&](SimdGroup& sg) {
    for (uint32_t l = 0; l < 32; ++l) {
      if (!(sg.op_mask >> l & 1u)) continue;
      const uint32_t src = source(l, sg.args[l]);
      if (src >= 32 || !(sg.op_mask >> src & 1u)) {
        char msg[200];
        std::snprintf(msg, sizeof msg, "%s: lane %u reads lane %u, which is %s", name, l, src,
                      src >= 32 ? "outside the simdgroup" : "not active (returned)");
        tree_attn::sim::detail::simd_fault(msg);
      }
      std::memcpy(sg.results[l], sg.values[src], sizeof(T));
    }
  });
}

template <class T> T add(T a, T b) {
  if constexpr (is_vec_v<T>) return a + b;
  else return T(a + b);
}
template <class T> T mul(T a, T b) {
  if constexpr (is_vec_v<T>) return a * b;
  else return T(a * b);
}
}  // namespace detail

#define TREE_ATTN_SIM_SITE std::source_location site = std::source_location::current()

template <detail::simd_value T> T simd_sum(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_sum", site, v, [](T a, T b) { return detail::add(a, b); });
}
template <detail::simd_value T> T simd_product(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_product", site, v, [](T a, T b) { return detail::mul(a, b); });
}
template <detail::simd_value T> T simd_max(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_max", site, v, [](T a, T b) { return max(a, b); });
}
template <detail::simd_value T> T simd_min(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_min", site, v, [](T a, T b) { return min(a, b); });
}
template <detail::simd_value T>
  requires std::is_integral_v<T>
T simd_and(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_and", site, v, [](T a, T b) { return T(a & b); });
}
template <detail::simd_value T>
  requires std::is_integral_v<T>
T simd_or(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_or", site, v, [](T a, T b) { return T(a | b); });
}
template <detail::simd_value T>
  requires std::is_integral_v<T>
T simd_xor(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_xor", site, v, [](T a, T b) { return T(a ^ b); });
}

namespace detail {
// Prefix ops run in lane order over the live lanes; `inclusive` selects the variant.
template <class T, class Op>
T simd_scan(const char* name, const std::source_location& site, const T& v, T identity, bool inclusive, Op op) {
  return simd_collective(name, site, v, 0, [&](SimdGroup& sg) {
    T running = identity;
    for (int l = 0; l < 32; ++l) {
      if (!(sg.op_mask >> l & 1u)) continue;
      const T mine = slot_get<T>(sg.values[l]);
      if (inclusive) running = op(running, mine);
      slot_put(sg.results[l], running);
      if (!inclusive) running = op(running, mine);
    }
  });
}
}  // namespace detail

template <detail::simd_value T> T simd_prefix_exclusive_sum(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_scan("simd_prefix_exclusive_sum", site, v, T(0), false, [](T a, T b) { return detail::add(a, b); });
}
template <detail::simd_value T> T simd_prefix_inclusive_sum(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_scan("simd_prefix_inclusive_sum", site, v, T(0), true, [](T a, T b) { return detail::add(a, b); });
}
template <detail::simd_value T> T simd_prefix_exclusive_product(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_scan("simd_prefix_exclusive_product", site, v, T(1), false, [](T a, T b) { return detail::mul(a, b); });
}
template <detail::simd_value T> T simd_prefix_inclusive_product(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_scan("simd_prefix_inclusive_product", site, v, T(1), true, [](T a, T b) { return detail::mul(a, b); });
}

template <detail::simd_value T> T simd_shuffle(T v, ushort lane, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle", site, v, lane, [](uint32_t, uint32_t a) { return a; });
}
template <detail::simd_value T> T simd_broadcast(T v, ushort lane, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_broadcast", site, v, lane, [](uint32_t, uint32_t a) { return a; });
}
template <detail::simd_value T> T simd_shuffle_xor(T v, ushort mask, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle_xor", site, v, mask, [](uint32_t l, uint32_t a) { return l ^ a; });
}
template <detail::simd_value T> T simd_shuffle_down(T v, ushort delta, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle_down", site, v, delta,
                              [](uint32_t l, uint32_t a) { return l + a < 32 ? l + a : l; });
}
template <detail::simd_value T> T simd_shuffle_up(T v, ushort delta, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle_up", site, v, delta,
                              [](uint32_t l, uint32_t a) { return a <= l ? l - a : l; });
}
template <detail::simd_value T> T simd_shuffle_rotate_down(T v, ushort delta, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle_rotate_down", site, v, delta,
                              [](uint32_t l, uint32_t a) { return (l + a) % 32; });
}
template <detail::simd_value T> T simd_shuffle_rotate_up(T v, ushort delta, TREE_ATTN_SIM_SITE) {
  return detail::simd_permute("simd_shuffle_rotate_up", site, v, delta,
                              [](uint32_t l, uint32_t a) { return (l + 32 - a % 32) % 32; });
}
template <detail::simd_value T> T simd_broadcast_first(T v, TREE_ATTN_SIM_SITE) {
  return detail::simd_collective("simd_broadcast_first", site, v, 0, [](detail::SimdGroup& sg) {
    const int first = std::countr_zero(sg.op_mask);
    for (int l = 0; l < 32; ++l)
      if (sg.op_mask >> l & 1u) std::memcpy(sg.results[l], sg.values[first], sizeof(T));
  });
}

// simd_vote: the ballot of the live lanes, as in MSL.
class simd_vote {
 public:
  using vote_t = uint64_t;
  constexpr explicit simd_vote(vote_t v = 0) : v_(v) {}
  constexpr explicit operator vote_t() const { return v_; }
  constexpr bool all() const { return v_ == active_; }
  constexpr bool any() const { return v_ != 0; }
  constexpr simd_vote with_active(vote_t active) const {
    simd_vote r(v_);
    r.active_ = active;
    return r;
  }

 private:
  vote_t v_;
  vote_t active_ = 0xffffffffu;
};

inline simd_vote simd_ballot(bool b, TREE_ATTN_SIM_SITE) {
  // One collective: the ballot of the participating lanes, and which lanes participated.
  const uint64_t r = detail::simd_collective<uint64_t>("simd_ballot", site, b, 0, [](detail::SimdGroup& sg) {
    uint32_t votes = 0;
    for (int l = 0; l < 32; ++l)
      if ((sg.op_mask >> l & 1u) && detail::slot_get<bool>(sg.values[l])) votes |= 1u << l;
    const uint64_t packed = uint64_t(sg.op_mask) << 32 | votes;
    for (int l = 0; l < 32; ++l)
      if (sg.op_mask >> l & 1u) detail::slot_put(sg.results[l], packed);
  });
  return simd_vote(r & 0xffffffffu).with_active(r >> 32);
}
inline bool simd_any(bool b, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_any", site, b, [](bool a, bool c) { return a || c; });
}
inline bool simd_all(bool b, TREE_ATTN_SIM_SITE) {
  return detail::simd_reduce("simd_all", site, b, [](bool a, bool c) { return a && c; });
}
inline bool simd_is_first(TREE_ATTN_SIM_SITE) {
  const uint32_t lane = tree_attn::sim::detail::current_thread()->lane;
  const uint32_t first = detail::simd_reduce("simd_is_first", site, lane, [](uint32_t a, uint32_t c) { return a < c ? a : c; });
  return lane == first;
}
#undef TREE_ATTN_SIM_SITE

// ---------------------------------------------------------------------------------------------
// Address spaces. `device`/`constant` pointers become device_ptr: every element access is
// bounds-checked against the whole allocation, alignment-checked, and counted. `threadgroup`
// pointers become threadgroup_ptr, checked against the region they point into.
// ---------------------------------------------------------------------------------------------
using tree_attn::sim::detail::BufferState;

template <class T> class device_ptr;

// What MSL lets a kernel do with an element lvalue, expressed through the proxy's own
// load() and store(): one definition for device and threadgroup memory, so the two
// address spaces cannot drift apart in what they accept.
#define TREE_ATTN_SIM_LVALUE_OPERATORS(Self)                                                                      \
  operator T() const { return load(); }                                                             \
  template <class U = T>                                                                            \
    requires is_lowp_v<U>                                                                           \
  operator float() const {                                                                          \
    return float(load());                                                                           \
  }                                                                                                 \
  const Self& operator=(const Self& other) const {                                                  \
    store(other.load());                                                                            \
    return *this;                                                                                   \
  }                                                                                                 \
  template <class U>                                                                                \
    requires std::is_convertible_v<const U&, T>                                                     \
  const Self& operator=(const U& v) const {                                                         \
    store(T(v));                                                                                    \
    return *this;                                                                                   \
  }                                                                                                 \
  template <class U> const Self& operator+=(const U& v) const { return *this = T(load() + v); }     \
  template <class U> const Self& operator-=(const U& v) const { return *this = T(load() - v); }     \
  template <class U> const Self& operator*=(const U& v) const { return *this = T(load() * v); }     \
  template <class U> const Self& operator/=(const U& v) const { return *this = T(load() / v); }     \
  template <class U> const Self& operator|=(const U& v) const { return *this = T(load() | v); }     \
  template <class U> const Self& operator&=(const U& v) const { return *this = T(load() & v); }     \
  const Self& operator++() const { return *this += 1; }                                             \
  const Self& operator--() const { return *this -= 1; }

// The lvalue `p[i]` of a writable device pointer. It lives in a per-thread ring and is handed
// out by reference, so `auto x = p[i];` (a copy) does not compile: a copy would otherwise be a
// live alias of device memory instead of the value MSL gives.
template <class T> class device_lvalue {
 public:
  using value_type = T;
  device_lvalue(BufferState* buf, uintptr_t addr) : buf_(buf), addr_(addr) {}
  device_lvalue(const device_lvalue&) = delete;

  T load() const {
    check("read");
    buf_->bytes_read += sizeof(T);
    if (buf_->track_loads) tree_attn::sim::detail::device_load_track(addr_, sizeof(T));
    T v;
    std::memcpy(&v, reinterpret_cast<const void*>(addr_), sizeof(T));
    return v;
  }
  void store(const T& v) const {
    check("write");
    if (!buf_->writable) tree_attn::sim::detail::device_fault(buf_, addr_, sizeof(T), "write to read-only binding");
    buf_->bytes_written += sizeof(T);
    tree_attn::sim::detail::device_store_track(addr_, sizeof(T));
    std::memcpy(reinterpret_cast<void*>(addr_), &v, sizeof(T));
  }

  TREE_ATTN_SIM_LVALUE_OPERATORS(device_lvalue)
  device_ptr<T> operator&() const { return device_ptr<T>(buf_, addr_); }

 private:
  void check(const char* access) const {
    if (addr_ < buf_->alloc_begin || addr_ > buf_->alloc_end || buf_->alloc_end - addr_ < sizeof(T) ||
        addr_ % alignof(T) != 0)
      tree_attn::sim::detail::device_fault(buf_, addr_, sizeof(T), access);
  }
  BufferState* buf_;
  uintptr_t addr_;
};

template <class T> class threadgroup_lvalue;
template <class T> struct is_lvalue_proxy : std::false_type {};
template <class T> struct is_lvalue_proxy<device_lvalue<T>> : std::true_type {};
template <class T> struct is_lvalue_proxy<threadgroup_lvalue<T>> : std::true_type {};
template <class T> inline constexpr bool is_lvalue_proxy_v = is_lvalue_proxy<std::remove_cvref_t<T>>::value;

// Arithmetic and comparisons on a proxy operate on the value it loads.
#define TREE_ATTN_SIM_PROXY_BINARY(PROXY, OP)                                                 \
  template <class T, class U>                                                                 \
  auto operator OP(const PROXY<T>& a, const U& b) -> decltype(std::declval<T>() OP b) {       \
    return a.load() OP b;                                                                     \
  }                                                                                           \
  template <class U, class T>                                                                 \
    requires(!is_lvalue_proxy_v<U>)                                                           \
  auto operator OP(const U& a, const PROXY<T>& b) -> decltype(a OP std::declval<T>()) {       \
    return a OP b.load();                                                                     \
  }
#define TREE_ATTN_SIM_LVALUE_BINARY(OP)              \
  TREE_ATTN_SIM_PROXY_BINARY(device_lvalue, OP)      \
  TREE_ATTN_SIM_PROXY_BINARY(threadgroup_lvalue, OP)
TREE_ATTN_SIM_LVALUE_BINARY(+)
TREE_ATTN_SIM_LVALUE_BINARY(-)
TREE_ATTN_SIM_LVALUE_BINARY(*)
TREE_ATTN_SIM_LVALUE_BINARY(/)
TREE_ATTN_SIM_LVALUE_BINARY(%)
TREE_ATTN_SIM_LVALUE_BINARY(&)
TREE_ATTN_SIM_LVALUE_BINARY(|)
TREE_ATTN_SIM_LVALUE_BINARY(^)
TREE_ATTN_SIM_LVALUE_BINARY(<<)
TREE_ATTN_SIM_LVALUE_BINARY(>>)
TREE_ATTN_SIM_LVALUE_BINARY(==)
TREE_ATTN_SIM_LVALUE_BINARY(!=)
TREE_ATTN_SIM_LVALUE_BINARY(<)
TREE_ATTN_SIM_LVALUE_BINARY(>)
TREE_ATTN_SIM_LVALUE_BINARY(<=)
TREE_ATTN_SIM_LVALUE_BINARY(>=)
#undef TREE_ATTN_SIM_LVALUE_BINARY
#undef TREE_ATTN_SIM_PROXY_BINARY

template <class T> class device_ptr {
 public:
  using element_type = T;
  using value_type = std::remove_const_t<T>;

  device_ptr() = default;
  device_ptr(std::nullptr_t) {}
  device_ptr(BufferState* buf, uintptr_t addr) : buf_(buf), addr_(addr) {}
  // T* -> const T*.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  device_ptr(const device_ptr<U>& other) : buf_(other.buffer()), addr_(other.address()) {}
  // An explicit cast (device const half4*)p reinterprets, as in MSL.
  template <class U>
    requires(!std::is_same_v<std::remove_const_t<U>, value_type>)
  explicit device_ptr(const device_ptr<U>& other) : buf_(other.buffer()), addr_(other.address()) {}

  // Reads through a const pointer yield the value (counted once, at the access).
  decltype(auto) operator[](ptrdiff_t i) const { return access(addr_ + uintptr_t(i * ptrdiff_t(sizeof(T)))); }
  decltype(auto) operator*() const { return access(addr_); }

  device_ptr operator+(ptrdiff_t n) const { return device_ptr(buf_, addr_ + uintptr_t(n * ptrdiff_t(sizeof(T)))); }
  device_ptr operator-(ptrdiff_t n) const { return device_ptr(buf_, addr_ - uintptr_t(n * ptrdiff_t(sizeof(T)))); }
  friend device_ptr operator+(ptrdiff_t n, const device_ptr& p) { return p + n; }
  device_ptr& operator+=(ptrdiff_t n) { return *this = *this + n; }
  device_ptr& operator-=(ptrdiff_t n) { return *this = *this - n; }
  device_ptr& operator++() { return *this += 1; }
  device_ptr& operator--() { return *this -= 1; }
  device_ptr operator++(int) { device_ptr old = *this; *this += 1; return old; }
  device_ptr operator--(int) { device_ptr old = *this; *this -= 1; return old; }
  friend ptrdiff_t operator-(const device_ptr& a, const device_ptr& b) {
    return (ptrdiff_t(a.addr_) - ptrdiff_t(b.addr_)) / ptrdiff_t(sizeof(T));
  }
  friend bool operator==(const device_ptr& a, const device_ptr& b) { return a.addr_ == b.addr_; }
  friend auto operator<=>(const device_ptr& a, const device_ptr& b) { return a.addr_ <=> b.addr_; }
  explicit operator bool() const { return addr_ != 0; }

  BufferState* buffer() const { return buf_; }
  uintptr_t address() const { return addr_; }

 private:
  decltype(auto) access(uintptr_t a) const {
    if constexpr (std::is_const_v<T>) {
      if (a < buf_->alloc_begin || a > buf_->alloc_end || buf_->alloc_end - a < sizeof(T) || a % alignof(T) != 0)
        tree_attn::sim::detail::device_fault(buf_, a, sizeof(T), "read");
      buf_->bytes_read += sizeof(T);
      if (buf_->track_loads) tree_attn::sim::detail::device_load_track(a, sizeof(T));
      value_type v;
      std::memcpy(&v, reinterpret_cast<const void*>(a), sizeof(T));
      return v;
    } else {
      auto* t = tree_attn::sim::detail::current_thread();
      void* slot = t->lvalue_ring[t->lvalue_next++ % tree_attn::sim::detail::kLvalueRing];
      static_assert(sizeof(device_lvalue<T>) <= sizeof(t->lvalue_ring[0]));
      return static_cast<const device_lvalue<T>&>(*new (slot) device_lvalue<T>(buf_, a));
    }
  }
  BufferState* buf_ = nullptr;
  uintptr_t addr_ = 0;
};

template <class T> class threadgroup_ptr;

// A scalar element of threadgroup memory: loads and stores are recorded so that two threads
// touching the same bytes between barriers without ordering (a data race on the GPU, hidden by
// the simulator's sequential execution) are reported. Like device_lvalue it lives in the
// per-thread ring, so `auto x = tile[i];` does not compile.
namespace detail {
// The common case of a load inline: bytes nobody stored to since the last barrier (or only this
// thread did), already marked as read by several simdgroups. Everything else, and every store,
// goes to the runtime, which records the access and judges it.
inline void threadgroup_track_load(const tree_attn::sim::detail::ThreadCtx* t, uintptr_t addr, size_t size) {
  using tree_attn::sim::detail::TgShadow;
  const uint32_t epoch = *t->tg_epoch;
  const size_t first = (addr - t->tg_arena) / 2, last = (addr + size - 1 - t->tg_arena) / 2;
  for (size_t g = first; g <= last; ++g) {
    const TgShadow& s = t->tg_shadow[g];
    const bool foreign_store = s.write_epoch == epoch && s.write_thread != t->index;
    const bool nothing_to_record =
        s.read_epoch == epoch && s.read_thread == TgShadow::kSeveral && s.read_simd == TgShadow::kSeveralSimd;
    if (foreign_store || !nothing_to_record) {
      tree_attn::sim::detail::threadgroup_track(addr, size, false);
      return;
    }
  }
}
}  // namespace detail

template <class T> class threadgroup_lvalue {
 public:
  using value_type = T;
  threadgroup_lvalue(const tree_attn::sim::detail::ThreadCtx* thread, uintptr_t addr) : thread_(thread), addr_(addr) {}
  threadgroup_lvalue(const threadgroup_lvalue&) = delete;

  T load() const {
    detail::threadgroup_track_load(thread_, addr_, sizeof(T));
    thread_->counters->threadgroup_bytes_read += sizeof(T);
    T v;
    std::memcpy(&v, reinterpret_cast<const void*>(addr_), sizeof(T));
    return v;
  }
  void store(const T& v) const {
    tree_attn::sim::detail::threadgroup_track(addr_, sizeof(T), true);
    thread_->counters->threadgroup_bytes_written += sizeof(T);
    std::memcpy(reinterpret_cast<void*>(addr_), &v, sizeof(T));
  }

  TREE_ATTN_SIM_LVALUE_OPERATORS(threadgroup_lvalue)
  threadgroup_ptr<T> operator&() const;

 private:
  const tree_attn::sim::detail::ThreadCtx* thread_;
  uintptr_t addr_;
};
#undef TREE_ATTN_SIM_LVALUE_OPERATORS

namespace detail {
// What `tile[i]` yields for an element already bounds-checked at address a: scalars (of 2 bytes
// or more: the race detector's granule) go through the tracked proxy or a tracked load; vectors
// and structs are plain references (their races are not tracked).
template <class T>
inline constexpr bool tg_tracked_v = is_scalar_v<std::remove_const_t<T>> && sizeof(T) >= 2;

template <class T> decltype(auto) threadgroup_element(uintptr_t a) {
  if constexpr (!tg_tracked_v<T>) {
    return *reinterpret_cast<T*>(a);
  } else if constexpr (std::is_const_v<T>) {
    auto* t = tree_attn::sim::detail::current_thread();
    detail::threadgroup_track_load(t, a, sizeof(T));
    t->counters->threadgroup_bytes_read += sizeof(T);
    std::remove_const_t<T> v;
    std::memcpy(&v, reinterpret_cast<const void*>(a), sizeof(T));
    return v;
  } else {
    auto* t = tree_attn::sim::detail::current_thread();
    void* slot = t->lvalue_ring[t->lvalue_next++ % tree_attn::sim::detail::kLvalueRing];
    static_assert(sizeof(threadgroup_lvalue<T>) <= sizeof(t->lvalue_ring[0]));
    return static_cast<const threadgroup_lvalue<T>&>(*new (slot) threadgroup_lvalue<T>(t, a));
  }
}
}  // namespace detail

template <class T> class threadgroup_ptr {
 public:
  using element_type = T;
  using Region = tree_attn::sim::detail::TgRegion;

  threadgroup_ptr() = default;
  threadgroup_ptr(std::nullptr_t) {}
  threadgroup_ptr(const Region& region, uintptr_t addr) : region_(region), addr_(addr) {}
  // &tile[i]: find the region the raw address belongs to.
  threadgroup_ptr(T* raw)
      : region_(tree_attn::sim::detail::threadgroup_region_of(raw)), addr_(reinterpret_cast<uintptr_t>(raw)) {}
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  threadgroup_ptr(const threadgroup_ptr<U>& other) : region_(other.region()), addr_(other.address()) {}
  template <class U>
    requires(!std::is_same_v<std::remove_const_t<U>, std::remove_const_t<T>>)
  explicit threadgroup_ptr(const threadgroup_ptr<U>& other) : region_(other.region()), addr_(other.address()) {}

  decltype(auto) operator[](ptrdiff_t i) const {
    return detail::threadgroup_element<T>(at(addr_ + uintptr_t(i * ptrdiff_t(sizeof(T)))));
  }
  decltype(auto) operator*() const { return detail::threadgroup_element<T>(at(addr_)); }
  T* operator->() const
    requires(!detail::tg_tracked_v<T>)
  {
    return reinterpret_cast<T*>(at(addr_));
  }

  threadgroup_ptr operator+(ptrdiff_t n) const { return threadgroup_ptr(region_, addr_ + uintptr_t(n * ptrdiff_t(sizeof(T)))); }
  threadgroup_ptr operator-(ptrdiff_t n) const { return threadgroup_ptr(region_, addr_ - uintptr_t(n * ptrdiff_t(sizeof(T)))); }
  friend threadgroup_ptr operator+(ptrdiff_t n, const threadgroup_ptr& p) { return p + n; }
  threadgroup_ptr& operator+=(ptrdiff_t n) { return *this = *this + n; }
  threadgroup_ptr& operator-=(ptrdiff_t n) { return *this = *this - n; }
  threadgroup_ptr& operator++() { return *this += 1; }
  threadgroup_ptr& operator--() { return *this -= 1; }
  threadgroup_ptr operator++(int) { threadgroup_ptr old = *this; *this += 1; return old; }
  threadgroup_ptr operator--(int) { threadgroup_ptr old = *this; *this -= 1; return old; }
  friend ptrdiff_t operator-(const threadgroup_ptr& a, const threadgroup_ptr& b) {
    return (ptrdiff_t(a.addr_) - ptrdiff_t(b.addr_)) / ptrdiff_t(sizeof(T));
  }
  friend bool operator==(const threadgroup_ptr& a, const threadgroup_ptr& b) { return a.addr_ == b.addr_; }
  friend auto operator<=>(const threadgroup_ptr& a, const threadgroup_ptr& b) { return a.addr_ <=> b.addr_; }

  const Region& region() const { return region_; }
  uintptr_t address() const { return addr_; }

 private:
  uintptr_t at(uintptr_t a) const {
    if (a < region_.begin || a > region_.end || region_.end - a < sizeof(T) || a % alignof(T) != 0)
      tree_attn::sim::detail::threadgroup_fault(region_, a, sizeof(T), "access");
    return a;
  }
  Region region_;
  uintptr_t addr_ = 0;
};

template <class T> threadgroup_ptr<T> threadgroup_lvalue<T>::operator&() const {
  return threadgroup_ptr<T>(reinterpret_cast<T*>(addr_));
}

// `threadgroup T name[N0][N1]...;` in a kernel body: every thread of the threadgroup gets the
// same storage; each subscript is checked against its own dimension.
template <class T, size_t... Dims> class threadgroup_array;
template <class T, size_t N, size_t... Rest> class threadgroup_array<T, N, Rest...> {
 public:
  using Region = tree_attn::sim::detail::TgRegion;
  static constexpr size_t inner = (Rest * ... * size_t(1));

  threadgroup_array(const Region& region, uintptr_t base) : region_(region), base_(base) {}

  decltype(auto) operator[](ptrdiff_t i) const {
    if (i < 0 || size_t(i) >= N)
      tree_attn::sim::detail::threadgroup_fault(region_, base_ + uintptr_t(i * ptrdiff_t(inner * sizeof(T))),
                                                sizeof(T), "array subscript out of its dimension");
    const uintptr_t a = base_ + uintptr_t(i) * inner * sizeof(T);
    if constexpr (sizeof...(Rest) == 0) {
      return detail::threadgroup_element<T>(a);
    } else {
      return threadgroup_array<T, Rest...>(region_, a);
    }
  }
  // Arrays decay to pointers (one-dimensional arrays only).
  operator threadgroup_ptr<T>() const
    requires(sizeof...(Rest) == 0)
  {
    return threadgroup_ptr<T>(region_, base_);
  }
  operator threadgroup_ptr<const T>() const
    requires(sizeof...(Rest) == 0)
  {
    return threadgroup_ptr<const T>(region_, base_);
  }
  // (threadgroup float4*)tile reinterprets, as in MSL.
  template <class U>
    requires(sizeof...(Rest) == 0 && !std::is_same_v<std::remove_const_t<U>, T>)
  explicit operator threadgroup_ptr<U>() const {
    return threadgroup_ptr<U>(threadgroup_ptr<T>(region_, base_));
  }
  threadgroup_ptr<T> operator+(ptrdiff_t n) const
    requires(sizeof...(Rest) == 0)
  {
    return threadgroup_ptr<T>(region_, base_) + n;
  }

 private:
  Region region_;
  uintptr_t base_;
};

namespace detail {
template <class T, size_t... Dims>
threadgroup_array<T, Dims...> threadgroup_declare_array(const tree_attn::sim::detail::TgSite* site) {
  constexpr size_t bytes = (Dims * ... * sizeof(T));
  unsigned char* p = tree_attn::sim::detail::threadgroup_declare(site, bytes, alignof(T));
  return threadgroup_array<T, Dims...>(tree_attn::sim::detail::threadgroup_region_of(p), reinterpret_cast<uintptr_t>(p));
}
// A tracked scalar is a threadgroup_lvalue held by the variable itself (not in the ring).
template <class T> decltype(auto) threadgroup_declare_scalar(const tree_attn::sim::detail::TgSite* site) {
  unsigned char* p = tree_attn::sim::detail::threadgroup_declare(site, sizeof(T), alignof(T));
  if constexpr (tg_tracked_v<T>) {
    return threadgroup_lvalue<T>(tree_attn::sim::detail::current_thread(), reinterpret_cast<uintptr_t>(p));
  } else {
    return *reinterpret_cast<T*>(p);
  }
}
}  // namespace detail


// ---------------------------------------------------------------------------------------------
// SIMD-group matrices (MSL 3.1 §6.7, <metal_simdgroup_matrix>): 8x8 matrices of float, half or
// bfloat spread over the 32 lanes of a simdgroup, two elements per lane.
//
// simdgroup_load, simdgroup_store, simdgroup_multiply and simdgroup_multiply_accumulate are
// collectives: every lane of the simdgroup must call them together, at the same call site, with
// the same pointer, elements_per_row, origin and transpose flag. Anything else is undefined
// behaviour in MSL and a fault here (a lane that returned early, lanes at different sites, or
// non-uniform arguments). The data moves in the op's compute step, once for the whole
// simdgroup, after every lane has arrived: each element is accessed through the ordinary checked
// pointers *as the lane that owns it* (detail::simdgroup_matrix_slot), so bounds and alignment
// checks, device byte counts (64 elements per load or store), threadgroup race records and
// fault messages are exactly those of that lane's scalar accesses.
// ---------------------------------------------------------------------------------------------
namespace detail {
// THE lane layout of a simdgroup matrix, the only place that knows it. MSL leaves the mapping
// unspecified; this is the one Apple GPUs use and MLX relies on (steel/attn/mma.h): lane l holds
// row `row`, columns `col` and `col + 1`, with q = l / 4, row = (q & 4) + (l / 2) % 4,
// col = (q & 2) * 2 + (l % 2) * 2. Lanes 0-7 hold rows 0-3 x columns 0-3, lanes 8-15 rows 0-3 x
// columns 4-7, lanes 16-23 rows 4-7 x columns 0-3, lanes 24-31 rows 4-7 x columns 4-7.
// thread_elements(), the diagonal constructor, loads, stores and multiplies all go through it.
struct matrix_slot {
  uint32_t row, col;  // of the lane's first element; its second is (row, col + 1)
};
constexpr matrix_slot simdgroup_matrix_slot(uint32_t lane) {
  const uint32_t q = lane / 4;
  return matrix_slot{(q & 4u) + (lane / 2) % 4, (q & 2u) * 2 + (lane % 2) * 2};
}

template <class T>
inline constexpr bool matrix_element_v = std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
}  // namespace detail

template <class T, int Cols, int Rows = Cols> struct simdgroup_matrix {
  static_assert(detail::matrix_element_v<T>, "simdgroup_matrix elements are float, half or bfloat");
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix is 8x8 (MSL 3.1)");
  using element_type = T;

  // Uninitialised in MSL: poisoned here (all-ones bits, NaN), like threadgroup memory.
  simdgroup_matrix() { std::memset(static_cast<void*>(&e_), 0xFF, sizeof(e_)); }
  // A diagonal matrix with `dval` on the diagonal (MSL's simdgroup_matrix(T dval)).
  simdgroup_matrix(T dval) {
    const auto s = detail::simdgroup_matrix_slot(tree_attn::sim::detail::current_thread()->lane);
    e_[0] = s.row == s.col ? dval : T(0);
    e_[1] = s.row == s.col + 1 ? dval : T(0);
  }

  // This lane's two elements: (row, col) and (row, col + 1) of detail::simdgroup_matrix_slot.
  vec<T, 2>& thread_elements() { return e_; }
  const vec<T, 2>& thread_elements() const { return e_; }

 private:
  vec<T, 2> e_;
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, int Cols, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const std::type_identity_t<T> value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.thread_elements() = vec<T, 2>(value, value);
  return m;
}

namespace detail {
// One lane's arguments of a simdgroup_load/store; the op's compute step reads every lane's.
template <class Ptr, class T> struct matrix_transfer {
  const Ptr* ptr;
  ulong elements_per_row, origin_col, origin_row;
  bool transpose;
  vec<T, 2>* elements;  // the lane's two elements (load: written, store: read)
};

template <class Ptr> uintptr_t space_of(const Ptr& p) {
  if constexpr (requires { p.buffer(); }) return reinterpret_cast<uintptr_t>(p.buffer());
  else return p.region().begin;
}

// Waits for every lane of the simdgroup at this op, then (in whichever lane resumes first) runs
// compute(args) with each lane's argument struct. Every lane must take part.
template <class Args, class Compute>
void simdgroup_matrix_collective(const char* name, const std::source_location& site, const Args& mine,
                                 Compute&& compute) {
  const Args* mine_ptr = &mine;
  SimdGroup& sg = tree_attn::sim::detail::simd_arrive(name, site, &mine_ptr, sizeof(mine_ptr), 0);
  if (sg.computed == sg.completed) return;
  sg.computed = sg.completed;
  if (sg.op_mask != 0xffffffffu) {
    char msg[240];
    std::snprintf(msg, sizeof msg,
                  "%s (%s:%u) outside uniform simd-group control flow: only lanes with mask 0x%08x reached it, "
                  "the others returned (every lane of the simdgroup must call it together)",
                  name, site.file_name(), unsigned(site.line()), sg.op_mask);
    tree_attn::sim::detail::simd_fault(msg);
  }
  const Args* args[32];
  for (int l = 0; l < 32; ++l) args[l] = slot_get<const Args*>(sg.values[l]);
  compute(args);
}

// Faults, as lane `lane`, when its arguments differ from lane 0's.
template <class Ptr, class T>
void check_uniform_transfer(const char* name, const std::source_location& site, const matrix_transfer<Ptr, T>* const* a) {
  for (uint32_t l = 1; l < 32; ++l) {
    const char* what = nullptr;
    if (a[l]->ptr->address() != a[0]->ptr->address() || space_of(*a[l]->ptr) != space_of(*a[0]->ptr)) what = "pointer";
    else if (a[l]->elements_per_row != a[0]->elements_per_row) what = "elements_per_row";
    else if (a[l]->origin_col != a[0]->origin_col || a[l]->origin_row != a[0]->origin_row) what = "matrix_origin";
    else if (a[l]->transpose != a[0]->transpose) what = "transpose_matrix";
    if (what) {
      char msg[320];
      std::snprintf(msg, sizeof msg,
                    "%s (%s:%u) with a non-uniform %s: lane %u passes a different value from lane 0 (it must be "
                    "the same in every lane of the simdgroup)",
                    name, site.file_name(), unsigned(site.line()), what, l);
      const tree_attn::sim::detail::LaneScope as_lane(l);
      tree_attn::sim::detail::simd_fault(msg);
    }
  }
}

// Element index in the source/destination of matrix element (r, c). matrix_origin is
// (column, row) in the source, as in MSL; with transpose_matrix the matrix's rows are the
// source's columns.
template <class Ptr, class T>
ptrdiff_t transfer_index(const matrix_transfer<Ptr, T>& a, uint32_t r, uint32_t c) {
  const ulong src_row = a.origin_row + (a.transpose ? c : r);
  const ulong src_col = a.origin_col + (a.transpose ? r : c);
  return ptrdiff_t(src_row * a.elements_per_row + src_col);
}

template <class T, class Ptr>
void simdgroup_load_impl(const char* name, vec<T, 2>& d, const Ptr& src, ulong elements_per_row, ulong2 origin,
                         bool transpose, const std::source_location& site) {
  const matrix_transfer<Ptr, T> mine{&src, elements_per_row, origin.x, origin.y, transpose, &d};
  simdgroup_matrix_collective(name, site, mine, [&](const matrix_transfer<Ptr, T>* const* a) {
    check_uniform_transfer(name, site, a);
    for (uint32_t l = 0; l < 32; ++l) {
      const tree_attn::sim::detail::LaneScope as_lane(l);
      const matrix_slot s = simdgroup_matrix_slot(l);
      for (uint32_t k = 0; k < 2; ++k) (*a[l]->elements)[int(k)] = T((*a[0]->ptr)[transfer_index(*a[0], s.row, s.col + k)]);
    }
  });
}

template <class T, class Ptr>
void simdgroup_store_impl(const char* name, const vec<T, 2>& e, const Ptr& dst, ulong elements_per_row, ulong2 origin,
                          bool transpose, const std::source_location& site) {
  const matrix_transfer<Ptr, T> mine{&dst, elements_per_row, origin.x, origin.y, transpose, const_cast<vec<T, 2>*>(&e)};
  simdgroup_matrix_collective(name, site, mine, [&](const matrix_transfer<Ptr, T>* const* a) {
    check_uniform_transfer(name, site, a);
    for (uint32_t l = 0; l < 32; ++l) {
      const tree_attn::sim::detail::LaneScope as_lane(l);
      const matrix_slot s = simdgroup_matrix_slot(l);
      for (uint32_t k = 0; k < 2; ++k) (*a[0]->ptr)[transfer_index(*a[0], s.row, s.col + k)] = (*a[l]->elements)[int(k)];
    }
  });
}

// The element types simdgroup_multiply(_accumulate) accepts: each matrix float, half or bfloat,
// with half and bfloat never mixed in one call (as for scalar arithmetic).
template <class... T>
inline constexpr bool mma_types_v = (matrix_element_v<T> && ...) &&
                                    !((std::is_same_v<T, half> || ...) && (std::is_same_v<T, bfloat> || ...));

template <class TD, class TA, class TB, class TC> struct mma_args {
  vec<TD, 2>* d;
  const vec<TA, 2>* a;
  const vec<TB, 2>* b;
  const vec<TC, 2>* c;  // null: simdgroup_multiply
};

// D = A * B (+ C), every product and sum in float: d(i, j) = ((c(i, j) + a(i, 0) b(0, j)) +
// a(i, 1) b(1, j)) + ... + a(i, 7) b(7, j), each operation rounded to float (no FMA), then
// rounded once to D's element type. The GPU's summation order and fusing are unspecified:
// compare with tolerances. D may be any of A, B, C (everything is read before D is written).
template <class TD, class TA, class TB, class TC>
void simdgroup_mma_impl(const char* name, const mma_args<TD, TA, TB, TC>& mine, const std::source_location& site) {
  simdgroup_matrix_collective(name, site, mine, [&](const mma_args<TD, TA, TB, TC>* const* args) {
    float a[8][8], b[8][8], acc[8][8];
    for (uint32_t l = 0; l < 32; ++l) {
      const matrix_slot s = simdgroup_matrix_slot(l);
      for (uint32_t k = 0; k < 2; ++k) {
        a[s.row][s.col + k] = float((*args[l]->a)[int(k)]);
        b[s.row][s.col + k] = float((*args[l]->b)[int(k)]);
        acc[s.row][s.col + k] = args[l]->c ? float((*args[l]->c)[int(k)]) : 0.0f;
      }
    }
    ++tree_attn::sim::detail::current_thread()->counters->simdgroup_mmas;
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 8; ++k) {
          const float p = a[i][k] * b[k][j];
          acc[i][j] = (args[0]->c || k > 0) ? acc[i][j] + p : p;
        }
    for (uint32_t l = 0; l < 32; ++l) {
      const matrix_slot s = simdgroup_matrix_slot(l);
      for (uint32_t k = 0; k < 2; ++k) (*args[l]->d)[int(k)] = TD(acc[s.row][s.col + k]);
    }
  });
}
}  // namespace detail

#define TREE_ATTN_SIM_SITE std::source_location site = std::source_location::current()
template <class T, int C, int R>
void simdgroup_load(simdgroup_matrix<T, C, R>& d, std::type_identity_t<device_ptr<const T>> src, ulong elements_per_row = C,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, TREE_ATTN_SIM_SITE) {
  detail::simdgroup_load_impl<T>("simdgroup_load", d.thread_elements(), src, elements_per_row, matrix_origin,
                                 transpose_matrix, site);
}
template <class T, int C, int R>
void simdgroup_load(simdgroup_matrix<T, C, R>& d, std::type_identity_t<threadgroup_ptr<const T>> src,
                    ulong elements_per_row = C, ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                    TREE_ATTN_SIM_SITE) {
  detail::simdgroup_load_impl<T>("simdgroup_load", d.thread_elements(), src, elements_per_row, matrix_origin,
                                 transpose_matrix, site);
}
template <class T, int C, int R>
void simdgroup_store(const simdgroup_matrix<T, C, R>& a, std::type_identity_t<device_ptr<T>> dst, ulong elements_per_row = C,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, TREE_ATTN_SIM_SITE) {
  detail::simdgroup_store_impl<T>("simdgroup_store", a.thread_elements(), dst, elements_per_row, matrix_origin,
                                  transpose_matrix, site);
}
template <class T, int C, int R>
void simdgroup_store(const simdgroup_matrix<T, C, R>& a, std::type_identity_t<threadgroup_ptr<T>> dst,
                     ulong elements_per_row = C, ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                     TREE_ATTN_SIM_SITE) {
  detail::simdgroup_store_impl<T>("simdgroup_store", a.thread_elements(), dst, elements_per_row, matrix_origin,
                                  transpose_matrix, site);
}
template <class TD, class TA, class TB, class TC>
  requires detail::mma_types_v<TD, TA, TB, TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                   TREE_ATTN_SIM_SITE) {
  detail::simdgroup_mma_impl("simdgroup_multiply_accumulate",
                             detail::mma_args<TD, TA, TB, TC>{&d.thread_elements(), &a.thread_elements(),
                                                              &b.thread_elements(), &c.thread_elements()},
                             site);
}
template <class TD, class TA, class TB>
  requires detail::mma_types_v<TD, TA, TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b, TREE_ATTN_SIM_SITE) {
  detail::simdgroup_mma_impl("simdgroup_multiply",
                             detail::mma_args<TD, TA, TB, TD>{&d.thread_elements(), &a.thread_elements(),
                                                              &b.thread_elements(), nullptr},
                             site);
}
#undef TREE_ATTN_SIM_SITE


// ---------------------------------------------------------------------------------------------
// Function constants (MSL §5.8.1): `constant T name [[function_constant(i)]];` becomes a
// function_constant<T> that reads the launch's value at each use (the simulator has one
// compiled kernel for every specialisation, so the value is not a compile-time constant: a use
// where C++ needs one, such as an array size or a template argument, does not compile). Using
// one the launch gave no value is a fault naming it; is_function_constant_defined() tests it.
// A program-scope constant computed from function constants is a function_constant_expr<T>,
// recomputed at each use.
// ---------------------------------------------------------------------------------------------
namespace detail {
template <class T> constexpr tree_attn::FunctionConstantType function_constant_type() {
  using tree_attn::FunctionConstantType;
  if constexpr (std::is_same_v<T, bool>) return FunctionConstantType::Bool;
  else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, signed char>) return FunctionConstantType::Char;
  else if constexpr (std::is_same_v<T, uchar>) return FunctionConstantType::UChar;
  else if constexpr (std::is_same_v<T, short>) return FunctionConstantType::Short;
  else if constexpr (std::is_same_v<T, ushort>) return FunctionConstantType::UShort;
  else if constexpr (std::is_same_v<T, int>) return FunctionConstantType::Int;
  else if constexpr (std::is_same_v<T, uint>) return FunctionConstantType::UInt;
  else if constexpr (std::is_same_v<T, half>) return FunctionConstantType::Half;
  else if constexpr (std::is_same_v<T, float>) return FunctionConstantType::Float;
  else static_assert(sizeof(T) == 0, "function constants are bool, char, uchar, short, ushort, int, uint, half or float");
}

template <class T> class function_constant {
 public:
  static_assert(sizeof(T) <= sizeof(tree_attn::sim::detail::ConstantSlot::bytes));
  constexpr function_constant(uint32_t slot, uint32_t index, const char* name) : slot_(slot), index_(index), name_(name) {}
  function_constant(const function_constant&) = delete;

  operator T() const {
    const tree_attn::sim::detail::ConstantSlot& s = slot();
    if (!s.defined) tree_attn::sim::detail::function_constant_undefined(name_, index_);
    T v;
    std::memcpy(&v, s.bytes, sizeof(T));
    return v;
  }
  // half and bfloat reach float in one conversion, as a half variable does.
  template <class U = T>
    requires is_lowp_v<U>
  operator float() const {
    return float(T(*this));
  }
  bool defined() const { return slot().defined; }

 private:
  const tree_attn::sim::detail::ConstantSlot& slot() const {
    return tree_attn::sim::detail::current_thread()->constants[slot_];
  }
  uint32_t slot_, index_;
  const char* name_;
};

template <class T> class function_constant_expr {
 public:
  using Fn = T (*)();
  explicit constexpr function_constant_expr(Fn f) : f_(f) {}
  function_constant_expr(const function_constant_expr&) = delete;
  operator T() const { return f_(); }

 private:
  Fn f_;
};
}  // namespace detail

template <class T> bool is_function_constant_defined(const detail::function_constant<T>& c) { return c.defined(); }
}  // namespace metal

// MSL spellings of constants and qualifiers the C++ headers do not provide.
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-5f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_SQRT2_F 1.41421356237309504880f
#define METAL_FUNC static inline

// The names a translated file takes from namespace metal in preference to the C library's
// global declarations (::abs, ::exp, ::select, ::uint, ...), which `using namespace metal`
// alone would leave ambiguous.
#define TREE_ATTN_SIM_USING_METAL                                                              \
  using ::metal::uint;                                                                         \
  using ::metal::ushort;                                                                       \
  using ::metal::uchar;                                                                        \
  using ::metal::ulong;                                                                        \
  using ::metal::abs;                                                                          \
  using ::metal::all;                                                                          \
  using ::metal::any;                                                                          \
  using ::metal::ceil;                                                                         \
  using ::metal::clamp;                                                                        \
  using ::metal::copysign;                                                                     \
  using ::metal::cos;                                                                          \
  using ::metal::exp;                                                                          \
  using ::metal::exp10;                                                                        \
  using ::metal::exp2;                                                                         \
  using ::metal::fabs;                                                                         \
  using ::metal::floor;                                                                        \
  using ::metal::fma;                                                                          \
  using ::metal::fmax;                                                                         \
  using ::metal::fmin;                                                                         \
  using ::metal::fmod;                                                                         \
  using ::metal::isfinite;                                                                     \
  using ::metal::isinf;                                                                        \
  using ::metal::isnan;                                                                        \
  using ::metal::log;                                                                          \
  using ::metal::log10;                                                                        \
  using ::metal::log2;                                                                         \
  using ::metal::max;                                                                          \
  using ::metal::min;                                                                          \
  using ::metal::pow;                                                                          \
  using ::metal::rint;                                                                         \
  using ::metal::round;                                                                        \
  using ::metal::rsqrt;                                                                        \
  using ::metal::select;                                                                       \
  using ::metal::signbit;                                                                      \
  using ::metal::sin;                                                                          \
  using ::metal::sqrt;                                                                         \
  using ::metal::tan;                                                                          \
  using ::metal::tanh;                                                                         \
  using ::metal::trunc;
