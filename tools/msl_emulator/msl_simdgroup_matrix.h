// simdgroup_matrix for the emulator: 8x8 matrices spread over the 32 lanes of a simdgroup, each lane
// holding two elements in Apple's layout (the one MLX's steel kernels index with thread_elements()).
// Loads, stores, fills and multiply-accumulates are simdgroup collectives: every lane must reach the
// same call, and a load's or store's pointer, stride, origin and transpose must be the same in every
// lane. Written for metalserve; included at the end of msl.h.
#pragma once

#include <cstring>
#include <string>

namespace metal {

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator models 8x8 simdgroup matrices only");
  vec<T, 2> elems{};
  vec<T, 2>& thread_elements() { return elems; }
  const vec<T, 2>& thread_elements() const { return elems; }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

namespace sgm {
// Lane l holds row ((l >> 2) & 4) + ((l >> 1) & 3) and columns col(l), col(l) + 1.
inline int row_of(int l) { return ((l >> 2) & 4) + ((l >> 1) & 3); }
inline int col_of(int l) { return (((l >> 3) & 1) << 2) + ((l & 1) << 1); }
inline int my_lane() { return static_cast<int>(msl_rt::worker().me().ctx.thread_index_in_simdgroup); }

struct Access {
  const void* base;
  uint64_t stride, ox, oy, transpose;
  bool operator==(const Access& o) const {
    return base == o.base && stride == o.stride && ox == o.ox && oy == o.oy && transpose == o.transpose;
  }
};

// The meeting of a load/store/fill: all 32 lanes, with the same arguments.
inline void meet(const Access& a, const char* what, uint32_t line) {
  msl_rt::simd_collective(a, 0, line, [what, line](auto get, int n, int lane, const int*) {
    if (n != msl_rt::kSimdWidth) {
      msl_rt::worker().fail(std::string(what) + " at line " + std::to_string(line) +
                            " in a simdgroup of " + std::to_string(n) + " lanes (needs 32)");
    }
    for (int l = 1; l < n && lane == 0; ++l) {  // one lane checks for all
      if (!(get(l) == get(0))) {
        msl_rt::worker().fail(std::string(what) + " at line " + std::to_string(line) +
                              ": lanes pass different pointers, strides, origins or transposes");
      }
    }
    return get(0);
  });
}

// Offset in the source/destination of element e (0 or 1) of this lane's part of the matrix.
inline uint64_t offset(const Access& a, int lane, int e) {
  uint64_t r = row_of(lane), c = col_of(lane) + e;
  if (a.transpose) std::swap(r, c);
  return (a.oy + r) * a.stride + a.ox + c;
}

struct Operands {
  float a[2], b[2], c[2];
};
}  // namespace sgm

template <typename T>
simdgroup_matrix<T, 8, 8> make_filled_simdgroup_matrix(
    T value, std::source_location s = std::source_location::current()) {
  sgm::meet({nullptr, 0, 0, 0, 0}, "make_filled_simdgroup_matrix", s.line());
  simdgroup_matrix<T, 8, 8> m;
  m.elems = vec<T, 2>(value, value);
  return m;
}
template <typename T, int C, int R>
simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(
    T value, std::source_location s = std::source_location::current()) {
  return make_filled_simdgroup_matrix<T>(value, s);
}

// simdgroup_load from threadgroup (or thread) memory: `origin` is (column, row) in the source, and
// with `transpose` the matrix gets the transpose of the 8x8 block there.
template <typename T>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src, unsigned long elements_per_row = 8,
                    vec<unsigned long, 2> origin = vec<unsigned long, 2>(0), bool transpose = false,
                    std::source_location s = std::source_location::current()) {
  sgm::Access a{src, elements_per_row, origin.x, origin.y, transpose};
  sgm::meet(a, "simdgroup_load", s.line());
  int lane = sgm::my_lane();
  for (int e = 0; e < 2; ++e) d.elems[e] = src[sgm::offset(a, lane, e)];
}
// From device memory: the reads count against the buffer.
template <typename T>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, msl_rt::dev_ptr<const T> src,
                    unsigned long elements_per_row = 8,
                    vec<unsigned long, 2> origin = vec<unsigned long, 2>(0), bool transpose = false,
                    std::source_location s = std::source_location::current()) {
  sgm::Access a{src.p, elements_per_row, origin.x, origin.y, transpose};
  sgm::meet(a, "simdgroup_load", s.line());
  int lane = sgm::my_lane();
  for (int e = 0; e < 2; ++e) d.elems[e] = src[sgm::offset(a, lane, e)];
}

template <typename T>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, T* dst, unsigned long elements_per_row = 8,
                     vec<unsigned long, 2> origin = vec<unsigned long, 2>(0), bool transpose = false,
                     std::source_location s = std::source_location::current()) {
  sgm::Access a{dst, elements_per_row, origin.x, origin.y, transpose};
  sgm::meet(a, "simdgroup_store", s.line());
  int lane = sgm::my_lane();
  for (int e = 0; e < 2; ++e) dst[sgm::offset(a, lane, e)] = m.elems[e];
}

// d = a * b + c, accumulated in float in k order; d and c may be the same matrix.
template <typename T, typename U>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                                   const simdgroup_matrix<U, 8, 8>& b, const simdgroup_matrix<T, 8, 8>& c,
                                   std::source_location s = std::source_location::current()) {
  sgm::Operands mine{{float(a.elems[0]), float(a.elems[1])}, {float(b.elems[0]), float(b.elems[1])},
                     {float(c.elems[0]), float(c.elems[1])}};
  uint32_t line = s.line();
  msl_rt::Fiber& me = msl_rt::worker().me();
  msl_rt::SimdGroup* group = &msl_rt::worker().simds[me.ctx.simdgroup_index_in_threadgroup];
  uint64_t gen = me.simd_gen;
  auto out = msl_rt::simd_collective(mine, 0, line, [line, group, gen](auto get, int n, int lane, const int*) {
    if (n != msl_rt::kSimdWidth) {
      msl_rt::worker().fail("simdgroup_multiply_accumulate at line " + std::to_string(line) +
                            " in a partial simdgroup");
    }
    if (group->product_gen != gen) {  // the first lane back computes the whole 8x8 result
      float a[64], b[64], c[64];
      for (int l = 0; l < 32; ++l) {
        sgm::Operands o = get(l);
        for (int e = 0; e < 2; ++e) {
          int at = sgm::row_of(l) * 8 + sgm::col_of(l) + e;
          a[at] = o.a[e], b[at] = o.b[e], c[at] = o.c[e];
        }
      }
      for (int r = 0; r < 8; ++r) {
        for (int col = 0; col < 8; ++col) {
          float acc = c[r * 8 + col];
          for (int k = 0; k < 8; ++k) acc += a[r * 8 + k] * b[k * 8 + col];
          group->product[r * 8 + col] = acc;
        }
      }
      group->product_gen = gen;
    }
    sgm::Operands res{};
    int at = sgm::row_of(lane) * 8 + sgm::col_of(lane);
    res.c[0] = group->product[at], res.c[1] = group->product[at + 1];
    return res;  // this lane's two elements of d, in .c
  });
  if (sgm::my_lane() == 0) ++msl_rt::worker().counts[msl_rt::kSimdMma];
  d.elems = vec<T, 2>(T(out.c[0]), T(out.c[1]));
}

template <typename T, typename U>
void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                        const simdgroup_matrix<U, 8, 8>& b,
                        std::source_location s = std::source_location::current()) {
  simdgroup_matrix<T, 8, 8> zero;
  simdgroup_multiply_accumulate(d, a, b, zero, s);
}

}  // namespace metal
