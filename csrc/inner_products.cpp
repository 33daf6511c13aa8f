// Exact inner products of queries and vectors for the exact index preset: every (query, vector)
// score is computed by the same sequence of operations (one vector accumulator over d, fused
// multiply-adds where the variant has them, the d tail through a zero-padded vector, lanes
// summed by one fixed halving tree), whatever the number of queries or vectors and wherever the
// pair falls in a tile. A BLAS matrix product does not promise that: its rounding may change
// with the shapes, so a question's scores could depend on the batch it came in or on how the
// corpus is cut into shards. Register tiles of MR queries x NR vectors give a matrix product's
// reuse of loads.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "registry.h"
#include "vec.h"

namespace rag_fast {

// out[b, n] = q[b] . x[n] (float32, rows of length d at strides ldq, ldx, ldo), each score by
// the same sequence of operations whatever B, N and the pair's place.
struct InnerProductsArgs {
  const float* q;
  int64_t B, ldq;
  const float* x;
  int64_t N, ldx;
  int64_t d;
  float* out;
  int64_t ldo;
};

namespace RAG_FAST_VARIANT {
namespace {

// a * b + c: one rounding where the variant has a fused multiply-add, two otherwise; never a
// mix chosen by the compiler (CMakeLists.txt builds this file with -ffp-contract=off, so no
// a * b + c here becomes a fused multiply-add unless written as one).
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)  // kLanes == 16
  return reinterpret_cast<vfloat>(_mm512_fmadd_ps(
      reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__AVX__) && defined(__FMA__)  // kLanes == 8
  return reinterpret_cast<vfloat>(_mm256_fmadd_ps(
      reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// Halving-tree sums of kLanes accumulators at once: lane i of the result is the sum of the
// lanes of v[i], by the same tree for every i (lane l plus lane l + kLanes/2, then the same on
// the halves, down to one lane), so a pair's score does not depend on the slot it had in a tile.
// One level: from a and b, each holding groups of G partial sums, the groups of G/2 sums
// (a's groups, then b's).
template <int G, size_t... J>
inline vfloat halve(vfloat a, vfloat b, std::index_sequence<J...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, static_cast<int>((J / (G / 2)) * G + J % (G / 2))...) +
         __builtin_shufflevector(a, b,
                                 static_cast<int>((J / (G / 2)) * G + J % (G / 2) + G / 2)...);
#else
  const vint lo = {static_cast<int32_t>((J / (G / 2)) * G + J % (G / 2))...};
  const vint hi = lo + G / 2;
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
#endif
}

// v[0..count): count vectors of groups of G partial sums -> v[0..count/2) of groups of G/2.
template <int G>
inline void tree_sums(vfloat* v, int count) {
  for (int m = 0; m < count / 2; ++m)
    v[m] = halve<G>(v[2 * m], v[2 * m + 1], std::make_index_sequence<kLanes>());
  if constexpr (G > 2) tree_sums<G / 2>(v, count / 2);
}

// Queries x vectors per register tile: accumulators, the queries' chunks and one vector's chunk
// stay in the 32 (AVX-512) or 16 vector registers.
constexpr int kMR = kLanes == 16 ? 4 : kLanes == 8 ? 3 : 2;
constexpr int kNR = kLanes == 16 ? 6 : 4;
constexpr int64_t kBlock = 16 * kNR;  // vectors per task: with the queries, within L2

// out[i][j] = q[i] . x[j] for MR query rows and NR vector rows of length d.
template <int MR>
inline void tile(const float* const* q, const float* const* x, int64_t d, float (*out)[kNR]) {
  vfloat acc[MR][kNR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kNR; ++j) acc[i][j] = vfloat{};
  const int64_t main = d - d % kLanes;
  for (int64_t c = 0; c < main; c += kLanes) {
    vfloat qv[MR];
    for (int i = 0; i < MR; ++i) qv[i] = vload(q[i] + c);
    for (int j = 0; j < kNR; ++j) {
      const vfloat xv = vload(x[j] + c);
      for (int i = 0; i < MR; ++i) acc[i][j] = vfma(qv[i], xv, acc[i][j]);
    }
  }
  if (main < d) {  // the tail, zero-padded to a whole vector
    const size_t bytes = static_cast<size_t>(d - main) * sizeof(float);
    vfloat qv[MR];
    for (int i = 0; i < MR; ++i) {
      qv[i] = vfloat{};
      std::memcpy(&qv[i], q[i] + main, bytes);
    }
    for (int j = 0; j < kNR; ++j) {
      vfloat xv{};
      std::memcpy(&xv, x[j] + main, bytes);
      for (int i = 0; i < MR; ++i) acc[i][j] = vfma(qv[i], xv, acc[i][j]);
    }
  }
  // the MR x kNR accumulators' sums, kLanes at a time (zero vectors fill the last batch)
  constexpr int kPairs = MR * kNR;
  for (int p0 = 0; p0 < kPairs; p0 += kLanes) {
    vfloat v[kLanes];
    for (int m = 0; m < kLanes; ++m)
      v[m] = p0 + m < kPairs ? acc[(p0 + m) / kNR][(p0 + m) % kNR] : vfloat{};
    tree_sums<kLanes>(v, kLanes);
    for (int m = 0; m < kLanes && p0 + m < kPairs; ++m)
      out[(p0 + m) / kNR][(p0 + m) % kNR] = v[0][m];
  }
}

void inner_products(const InnerProductsArgs& a) {
  const std::vector<float> zeros(static_cast<size_t>(a.d) + kLanes, 0.0f);  // a missing row
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
#if defined(__SSE__)
  // The caller's floating-point mode (flush-to-zero, denormals-are-zero, rounding) in every
  // thread, so that a score does not depend on which thread computed it.
  const unsigned mode = _mm_getcsr();
#endif
  [[maybe_unused]] const bool parallel =
      a.B * a.N * a.d >= kInnerProductsParallelWork && blocks > 1;
#pragma omp parallel if (parallel)
  {
#if defined(__SSE__)
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(mode);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * kBlock, n1 = std::min(a.N, n0 + kBlock);
      for (int64_t b0 = 0; b0 < a.B;) {
        const int mr = a.B - b0 >= kMR ? kMR : 1;  // whole tiles, then one query at a time
        const float* q[kMR];
        for (int i = 0; i < mr; ++i) q[i] = a.q + (b0 + i) * a.ldq;
        for (int64_t n = n0; n < n1; n += kNR) {
          const float* x[kNR];
          for (int j = 0; j < kNR; ++j) x[j] = n + j < n1 ? a.x + (n + j) * a.ldx : zeros.data();
          float s[kMR][kNR];
          if (mr == kMR) {
            tile<kMR>(q, x, a.d, s);
          } else {
            tile<1>(q, x, a.d, s);
          }
          const int nr = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
          for (int i = 0; i < mr; ++i)
            std::memcpy(a.out + (b0 + i) * a.ldo + n, s[i], static_cast<size_t>(nr) * sizeof(float));
        }
        b0 += mr;
      }
    }
#if defined(__SSE__)
    _mm_setcsr(saved);
#endif
  }
}

}  // namespace

RAG_FAST_KERNEL(inner_products, InnerProductsArgs, inner_products,
                "out[b, n] = q[b] . x[n], float32, each score by the same sequence of operations "
                "whatever the shapes.");

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
