// Maps the Metal Shading Language subset that metalserve's kernels use onto C++20, so the exact
// source that mx.fast.metal_kernel compiles also builds with g++ and runs on the CPU (see emulator.py).
// Written for metalserve. Address spaces are no-ops; simdgroup ops and barriers meet in msl_runtime.h.
#pragma once

#include <bit>
#include <cstdint>

#include "msl_runtime.h"
#include "msl_device_ptr.h"

namespace metal {

using half = _Float16;

// bfloat: storage as the top 16 bits of a float, arithmetic in float, round-to-nearest-even on store.
struct bfloat {
  uint16_t bits = 0;
  bfloat() = default;
  bfloat(float f) {  // NOLINT: implicit like Metal's
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40);  // keep NaN a NaN
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  bfloat(double d) : bfloat(static_cast<float>(d)) {}
  bfloat(int i) : bfloat(static_cast<float>(i)) {}
  bfloat(half h) : bfloat(static_cast<float>(h)) {}
  operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
};

template <typename T, int N>
struct vec;

#define MSL_VEC_COMMON(N)                                                          \
  T& operator[](int i) { return (&x)[i]; }                                       \
  const T& operator[](int i) const { return (&x)[i]; }                           \
  template <typename U>                                                          \
  explicit vec(const vec<U, N>& o) {                                             \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);               \
  }

template <typename T>
struct vec<T, 2> {
  T x{}, y{};
  vec() = default;
  vec(T s) : x(s), y(s) {}  // NOLINT
  vec(T a, T b) : x(a), y(b) {}
  MSL_VEC_COMMON(2)
};

template <typename T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}  // NOLINT
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  vec(const msl_rt::uint3v& u) : x(T(u.x)), y(T(u.y)), z(T(u.z)) {}  // NOLINT: attribute values
  MSL_VEC_COMMON(3)
};

template <typename T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}  // NOLINT
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  MSL_VEC_COMMON(4)
};

#define MSL_VEC_BINOP(OP)                                                   \
  template <typename T, int N>                                              \
  vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {           \
    vec<T, N> r;                                                            \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                        \
    return r;                                                               \
  }                                                                         \
  template <typename T, int N>                                              \
  vec<T, N> operator OP(const vec<T, N>& a, T b) { return a OP vec<T, N>(b); } \
  template <typename T, int N>                                              \
  vec<T, N> operator OP(T a, const vec<T, N>& b) { return vec<T, N>(a) OP b; } \
  template <typename T, int N>                                              \
  vec<T, N>& operator OP##=(vec<T, N>& a, const vec<T, N>& b) { return a = a OP b; }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)

template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr half infinity() { return half(std::numeric_limits<float>::infinity()); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half quiet_NaN() { return half(std::numeric_limits<float>::quiet_NaN()); }
};
template <>
struct numeric_limits<bfloat> {
  static bfloat infinity() { return bfloat(std::numeric_limits<float>::infinity()); }
  static bfloat max() { return bfloat(3.38953139e38f); }
  static bfloat lowest() { return bfloat(-3.38953139e38f); }
  static bfloat min() { return bfloat(1.17549435e-38f); }
  static bfloat quiet_NaN() { return bfloat(std::numeric_limits<float>::quiet_NaN()); }
};

// Math: half and bfloat are computed in float and rounded back, as they are on the GPU.
#define MSL_UNARY(NAME, EXPR)                     \
  inline float NAME(float x) { return EXPR; }     \
  inline half NAME(half x) {                      \
    float y = static_cast<float>(x);              \
    (void)y;                                      \
    return half(NAME(y));                         \
  }                                               \
  inline bfloat NAME(bfloat x) { return bfloat(NAME(static_cast<float>(x))); }
MSL_UNARY(exp, std::exp(x))
MSL_UNARY(exp2, std::exp2(x))
MSL_UNARY(log, std::log(x))
MSL_UNARY(log2, std::log2(x))
MSL_UNARY(sqrt, std::sqrt(x))
MSL_UNARY(rsqrt, 1.0f / std::sqrt(x))
MSL_UNARY(tanh, std::tanh(x))
MSL_UNARY(fabs, std::fabs(x))
MSL_UNARY(floor, std::floor(x))
MSL_UNARY(ceil, std::ceil(x))
MSL_UNARY(round, std::round(x))
MSL_UNARY(sin, std::sin(x))
MSL_UNARY(cos, std::cos(x))
inline float abs(float x) { return std::fabs(x); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }

template <typename T>
T max(T a, T b) { return a > b ? a : b; }
template <typename T>
T min(T a, T b) { return a < b ? a : b; }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
T select(T a, T b, bool c) { return c ? b : a; }

namespace fast {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
using metal::tanh;
}  // namespace fast
namespace precise {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
using metal::tanh;
}  // namespace precise

template <typename To, typename From>
To as_type(const From& f) {
  return std::bit_cast<To>(f);
}

// Barriers and simdgroup functions. The caller's line tells the runtime which call site is which.
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
inline void threadgroup_barrier(mem_flags, std::source_location s = std::source_location::current()) {
  msl_rt::barrier(s.line());
}
inline void simdgroup_barrier(mem_flags, std::source_location s = std::source_location::current()) {
  msl_rt::simd_collective(0, 0, s.line(), [](auto, int, int, const int*) { return 0; });
}

template <typename T, typename F>
T msl_simd_reduce(T x, uint32_t line, F f) {
  return msl_rt::simd_collective(x, 0, line, [f](auto get, int n, int, const int*) {
    T acc = get(0);
    for (int l = 1; l < n; ++l) acc = f(acc, get(l));
    return acc;
  });
}
template <typename T>
T simd_sum(T x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](T a, T b) { return T(a + b); });
}
template <typename T>
T simd_max(T x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](T a, T b) { return a > b ? a : b; });
}
template <typename T>
T simd_min(T x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](T a, T b) { return a < b ? a : b; });
}
template <typename T>
T simd_prod(T x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](T a, T b) { return T(a * b); });
}
inline bool simd_all(bool x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x, std::source_location s = std::source_location::current()) {
  return msl_simd_reduce(x, s.line(), [](bool a, bool b) { return a || b; });
}

// Lane-to-lane moves: `source(lane, arg, n)` gives the lane to read, or -1 to keep one's own value.
template <typename T, typename Src>
T msl_simd_move(T x, int arg, uint32_t line, Src source) {
  return msl_rt::simd_collective(x, arg, line, [source](auto get, int n, int lane, const int* args) {
    int from = source(lane, args[lane], n);
    return (from < 0 || from >= n) ? get(lane) : get(from);
  });
}
template <typename T>
T simd_shuffle(T x, uint16_t lane, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, lane, s.line(), [](int, int a, int) { return a; });
}
template <typename T>
T simd_broadcast(T x, uint16_t lane, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, lane, s.line(), [](int, int a, int) { return a; });
}
template <typename T>
T simd_broadcast_first(T x, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, 0, s.line(), [](int, int, int) { return 0; });
}
template <typename T>
T simd_shuffle_xor(T x, uint16_t mask, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, mask, s.line(), [](int l, int a, int) { return l ^ a; });
}
template <typename T>
T simd_shuffle_down(T x, uint16_t delta, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, delta, s.line(), [](int l, int a, int) { return l + a; });
}
template <typename T>
T simd_shuffle_up(T x, uint16_t delta, std::source_location s = std::source_location::current()) {
  return msl_simd_move(x, delta, s.line(), [](int l, int a, int) { return l - a; });
}
template <typename T>
T simd_prefix_inclusive_sum(T x, std::source_location s = std::source_location::current()) {
  return msl_rt::simd_collective(x, 0, s.line(), [](auto get, int, int lane, const int*) {
    T acc = get(0);
    for (int l = 1; l <= lane; ++l) acc = T(acc + get(l));
    return acc;
  });
}
template <typename T>
T simd_prefix_exclusive_sum(T x, std::source_location s = std::source_location::current()) {
  return msl_rt::simd_collective(x, 0, s.line(), [](auto get, int, int lane, const int*) {
    T acc = T(0);
    for (int l = 0; l < lane; ++l) acc = T(acc + get(l));
    return acc;
  });
}

// Atomics: a plain value reached through std::atomic_ref, since threadgroups run on several OS threads.
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
template <typename T>
struct atomic {
  T value;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_float = atomic<float>;

template <typename T>
void atomic_store_explicit(atomic<T>* a, T v, memory_order) {
  std::atomic_ref<T>(a->value).store(v);
}
template <typename T>
T atomic_load_explicit(atomic<T>* a, memory_order) {
  return std::atomic_ref<T>(a->value).load();
}
template <typename T>
T atomic_exchange_explicit(atomic<T>* a, T v, memory_order) {
  return std::atomic_ref<T>(a->value).exchange(v);
}
template <typename T>
T atomic_fetch_add_explicit(atomic<T>* a, T v, memory_order) {
  return std::atomic_ref<T>(a->value).fetch_add(v);
}
template <typename T>
T atomic_fetch_sub_explicit(atomic<T>* a, T v, memory_order) {
  return std::atomic_ref<T>(a->value).fetch_sub(v);
}
template <typename T>
bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, T desired, memory_order,
                                           memory_order) {
  return std::atomic_ref<T>(a->value).compare_exchange_weak(*expected, desired);
}
template <typename T>
T atomic_fetch_max_explicit(atomic<T>* a, T v, memory_order) {
  std::atomic_ref<T> r(a->value);
  T old = r.load();
  while (old < v && !r.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomic_fetch_min_explicit(atomic<T>* a, T v, memory_order) {
  std::atomic_ref<T> r(a->value);
  T old = r.load();
  while (old > v && !r.compare_exchange_weak(old, v)) {
  }
  return old;
}

}  // namespace metal

using namespace metal;  // as MLX's prepended utils do

using half = metal::half;
using bfloat = metal::bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;
typedef unsigned char uchar;
#define MSL_VEC_TYPES(T, NAME)      \
  using NAME##2 = metal::vec<T, 2>; \
  using NAME##3 = metal::vec<T, 3>; \
  using NAME##4 = metal::vec<T, 4>;
MSL_VEC_TYPES(float, float)
MSL_VEC_TYPES(half, half)
MSL_VEC_TYPES(signed char, char)
MSL_VEC_TYPES(unsigned char, uchar)
MSL_VEC_TYPES(int, int)
MSL_VEC_TYPES(unsigned int, uint)
MSL_VEC_TYPES(unsigned short, ushort)
MSL_VEC_TYPES(unsigned long, ulong)
MSL_VEC_TYPES(bool, bool)

#include "msl_simdgroup_matrix.h"

// Address-space qualifiers carry no meaning on the CPU. Kernel-scope `threadgroup` declarations are
// rewritten by the emulator into msl_rt::tg_var; any other `threadgroup` (a pointer's) is dropped here.
#define device
#define constant
#define threadgroup
#define thread
