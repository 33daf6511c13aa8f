// The RAG losses' CPU kernels (rag_fast/ops/rag_losses.py), compiled once per instruction set
// (RAG_FAST_VARIANT names the variant): their argument structs, the kernels, and one
// RAG_FAST_KERNEL line each that makes it rag_fast._C.<name> (csrc/registry.h).
// Row kernels read the logits row by row (one row = one (b, k, t) over the vocabulary); the
// RAG-Token kernels hold the K rows of one (b, t) together, tile by tile over the vocabulary.
// All accumulate in fp32 registers (long sums flushed to double) and are multithreaded with
// OpenMP over rows or (b, t) pairs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "registry.h"
#include "vec.h"

#ifndef RAG_FAST_VARIANT
#error "RAG_FAST_VARIANT must name the instruction-set variant"
#endif

namespace rag_fast {

// Per-row statistics, one read of the logits. Row r = (b*K + k)*T + t.
//   lse[r]   = logsumexp_v x[b,k,t,v], in double: row max + log(sum of exp) without the fp32
//              rounding of a number of the logits' size, so that x - lse keeps fp32's
//              precision (1 - P near P = 1 then carries only the rounding of P itself)
//   x_tgt[r] = x[b,k,t,y[b,t]]   (0 where y[b,t] == ignore_index)
//   x_sum[r] = sum_v x[b,k,t,v]
// targets: int64 [B, T] contiguous, or null (then x_tgt is all 0). Outputs: [B*K*T], lse
// float64, the others float32. Every kernel that takes lse takes it as float64 [B, K, T].
struct RowStatsArgs {
  LogitsView x;
  const int64_t* targets;
  int64_t ignore_index;
  double* lse;
  float* x_tgt;
  float* x_sum;
};

// Per-row gradient, one read and one write:
//   out[b,k,t,v] = c_p[r] * exp(x - lse[r]) + c_y[r] * (v == y[b,t]) + c_1[r]
// out has the logits' dtype and element strides (ob, ok, ot), stride 1 along v; it may alias x.
struct RowGradArgs {
  LogitsView x;
  const int64_t* targets;  // may be null: no one-hot term
  int64_t ignore_index;
  const double* lse;
  const float* c_p;
  const float* c_y;
  const float* c_1;
  void* out;
  int64_t ob, ok, ot;
};

// RAG-Token kernels hold the K rows of one (b, t) together, tile by tile over v. With the
// passage log-prior a (float32 [B, K] contiguous, -inf for a missing passage) and lse from
// row_stats (float64 [B, K, T] contiguous):
//   M[b,t,v]   = logsumexp_k (a[b,k] + x[b,k,t,v] - lse[b,k,t])     marginal log-probs
//   R[b,k,t,v] = exp(a + x - lse - M)                               passage posterior
//   P[b,k,t,v] = exp(x - lse)                                       token distribution
// Outputs indexed [B, T] are contiguous float32; `out` has the logits' dtype and element
// strides (ob, ok, ot), stride 1 along v, and may alias x.

// sum_m[b,t] = sum_v M,  rho[b,k,t] = sum_v R.
struct TokenSmoothStatsArgs {
  LogitsView x;
  const float* a;
  const double* lse;
  float* sum_m;
  float* rho;
};

// row_stats and token_smooth_stats in one read of the logits: the K rows of each (b, t) are
// read from memory once and kept, as exp(x - block max), in a K x V fp32 buffer per thread
// while all threads' buffers fit in a fixed budget (16 MiB), else recomputed block by block
// (see rag_losses.cpp):
//   lse, x_tgt, x_sum as RowStatsArgs; sum_m[b,t] = sum_v M; rho[b,k,t] = sum_v R.
// a: float32 [B, K] log-prior; targets: int64 [B, T] contiguous or null; rho may be null (not
// computed: only the backward needs it).
struct TokenSmoothForwardArgs {
  LogitsView x;
  const int64_t* targets;
  int64_t ignore_index;
  const float* a;
  double* lse;
  float* x_tgt;
  float* x_sum;
  float* sum_m;
  float* rho;
};

// out = c_p * P + c_y * onehot(y) + c_1 + c_r[b,t] * R   (c_p, c_y, c_1: [B, K, T]).
struct TokenSmoothGradArgs {
  LogitsView x;
  const int64_t* targets;  // int64 [B, T] contiguous, or null: no one-hot term
  int64_t ignore_index;
  const float* a;
  const double* lse;
  const float* c_p;
  const float* c_y;
  const float* c_1;
  const float* c_r;
  void* out;
  int64_t ob, ok, ot;
};

// m[b,t,v] = M, float32 [B, T, V] contiguous.
struct TokenMarginalArgs {
  LogitsView x;
  const float* a;
  const double* lse;
  float* m;
};

// With m = M and g = dloss/dM (both float32 [B, T, V] contiguous):
//   c[b,k,t] = sum_v R * g,  out = R * g - P * c.
struct TokenMarginalGradArgs {
  LogitsView x;
  const float* a;
  const double* lse;
  const float* m;
  const float* g;
  float* c;
  void* out;
  int64_t ob, ok, ot;
};

namespace RAG_FAST_VARIANT {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows are processed in blocks of this many elements: block max first, then one exp each.
constexpr int64_t kBlock = 512;
// The block loop prefetches this many elements ahead, so that DRAM reads overlap the exps.
constexpr int64_t kPrefetch = 1024;

inline const char* row_ptr(const LogitsView& x, int64_t b, int64_t k, int64_t t) {
  const int64_t elem = x.dtype == DType::kFloat32 ? 4 : 2;
  return static_cast<const char*>(x.data) + (b * x.sb + k * x.sk + t * x.st) * elem;
}

// A gradient output with the logits' shape and element strides (ob, ok, ot): see
// prefer_huge_pages. In place (out == x) it is already resident.
inline void prepare_out(const LogitsView& x, void* out, int64_t ob, int64_t ok, int64_t ot) {
  if (out == x.data || x.B * x.K * x.T * x.V == 0) return;
  const int64_t elem = x.dtype == DType::kFloat32 ? 4 : 2;
  prefer_huge_pages(out, ((x.B - 1) * ob + (x.K - 1) * ok + (x.T - 1) * ot + x.V) * elem);
}

// Rows per scheduling chunk: dynamic scheduling keeps both cores busy when another process
// takes one for a while; chunks of at least ~16K elements keep its overhead negligible.
inline int64_t row_chunk(int64_t V) { return V >= 16384 ? 1 : 16384 / (V > 0 ? V : 1); }

// A row's log-sum-exp is kept in double (csrc/kernels.h): max + log(sum) with the log in double,
// never rounded to fp32 at the size of the logits. The kernels that read it split it into two
// floats, hi + lo: x - lse = (x - hi) - lo, whose first step is exact for the entries near the
// top of the row (Sterbenz), so P = exp(x - lse) keeps fp32's relative precision instead of an
// error of up to 2^-24 |lse| (1 - P near P = 1 then carries only the rounding of P itself).
struct SplitLse {
  float hi, lo;
};
// A row whose lse is not finite (all -inf, NaN) gets hi = 0 and lo = lse: the formulas then
// give what they give with x - lse itself (P = 0 or NaN; a missing passage stays -inf).
inline SplitLse split_lse(double lse) {
  const float hi = static_cast<float>(lse);
  if (!std::isfinite(hi)) return {0.f, hi};
  return {hi, static_cast<float>(lse - static_cast<double>(hi))};
}
// a - lse for the posterior's exponent a + x - lse = (x - hi) + (a - lo): its second term as
// one float (-inf for a missing passage).
inline float shift_lo(float a, const SplitLse& l) {
  return static_cast<float>(static_cast<double>(a) - static_cast<double>(l.lo));
}
// log(sum) for a row whose largest entry is m and whose sum of exp(x - m) is s, in double.
inline double lse_of(float m, float s) {
  return static_cast<double>(m) + std::log(static_cast<double>(s));
}

struct RowStat {
  double lse;
  float sum;
};

// One pass over a row: running (max, sum of exp) per lane, rescaled once per block.
template <typename Elem>
RowStat row_lse_sum(const Elem* row, int64_t V) {
  vfloat m = vsplat(kNegInf), s = vfloat{};
  double total = 0.0;  // sum of x, flushed from fp32 lanes once per block
  float ms = kNegInf, ss = 0.f, ts = 0.f;  // scalar tail
  const int64_t vec_end = V - V % kLanes;
  for (int64_t start = 0; start < vec_end; start += kBlock) {
    const int64_t stop = start + kBlock < vec_end ? start + kBlock : vec_end;
    vfloat bm = vsplat(kNegInf), bt{};
    for (int64_t i = start; i < stop; i += kLanes) {
      vfloat v = load(row + i);
      bm = vmax(bm, v);
      bt += v;
    }
    total += hsum(bt);
    vfloat nm = vmax(m, bm);
    // Lanes still at -inf keep a zero sum (avoid exp(-inf - -inf) = NaN).
    vfloat safe = nm == vsplat(kNegInf) ? vfloat{} : nm;
    s = s * vexp_nonpos(m - safe);
    for (int64_t i = start; i < stop; i += kLanes) {
      __builtin_prefetch(row + i + kPrefetch);
      s += vexp_nonpos(load(row + i) - safe);
    }
    m = nm;
  }
  for (int64_t i = vec_end; i < V; ++i) {
    const float v = load1(row + i);
    ts += v;
    if (v > ms) {
      ss = ss * std::exp(ms - v) + 1.f;
      ms = v;
    } else if (ms != kNegInf) {
      ss += std::exp(v - ms);
    }
  }
  // Combine lanes and tail. A NaN anywhere makes the sum NaN, and then the lse too.
  const float tot = static_cast<float>(total + ts);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  float gm = ms;
  for (int i = 0; i < kLanes; ++i) gm = m[i] > gm ? m[i] : gm;
  if (gm == kNegInf) return {tot != tot ? nan : -std::numeric_limits<double>::infinity(), tot};
  float acc = ms == kNegInf ? 0.f : ss * std::exp(ms - gm);
  for (int i = 0; i < kLanes; ++i) {
    if (m[i] != kNegInf) acc += s[i] * std::exp(m[i] - gm);
  }
  return {tot != tot ? nan : lse_of(gm, acc), tot};
}

template <typename Elem>
void row_stats_impl(const RowStatsArgs& a) {
  const LogitsView& x = a.x;
  const int64_t rows = x.B * x.K * x.T;
#pragma omp parallel for schedule(dynamic, row_chunk(x.V))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % x.T, bk = r / x.T, k = bk % x.K, b = bk / x.K;
    const Elem* row = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
    RowStat st = row_lse_sum(row, x.V);
    const int64_t y = a.targets ? a.targets[b * x.T + t] : a.ignore_index;
    a.lse[r] = st.lse;
    a.x_sum[r] = st.sum;
    a.x_tgt[r] = y == a.ignore_index ? 0.f : load1(row + y);
  }
}

void row_stats(const RowStatsArgs& a) {
  if (a.x.dtype == DType::kFloat32) {
    row_stats_impl<float>(a);
  } else {
    row_stats_impl<uint16_t>(a);
  }
}

template <typename Elem>
inline void store(Elem* p, vfloat v) {
  if constexpr (sizeof(Elem) == 4) {
    vstore(reinterpret_cast<float*>(p), v);
  } else {
    vstore_bf16(reinterpret_cast<uint16_t*>(p), v);
  }
}
template <typename Elem>
inline void store1(Elem* p, float v) {
  if constexpr (sizeof(Elem) == 4) {
    *reinterpret_cast<float*>(p) = v;
  } else {
    *reinterpret_cast<uint16_t*>(p) = float_to_bf16(v);
  }
}

// Mask of lanes [0, n).
inline vint lanes_below(int64_t n) {
  vint idx;
  for (int i = 0; i < kLanes; ++i) idx[i] = i;
  return idx < static_cast<int32_t>(n);
}

// Lanes [0, n) of v; the others 0.
inline vfloat first_lanes(vfloat v, int64_t n) { return lanes_below(n) ? v : vfloat{}; }

template <typename Elem>
void row_grad_impl(const RowGradArgs& a) {
  const LogitsView& x = a.x;
  prepare_out(x, a.out, a.ob, a.ok, a.ot);
  const int64_t rows = x.B * x.K * x.T;
#pragma omp parallel for schedule(dynamic, row_chunk(x.V))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % x.T, bk = r / x.T, k = bk % x.K, b = bk / x.K;
    const Elem* in = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
    Elem* out = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
    const SplitLse l = split_lse(a.lse[r]);
    const float cp = a.c_p[r], c1 = a.c_1[r];
    const int64_t y = a.targets ? a.targets[b * x.T + t] : a.ignore_index;
    // The one-hot entry is read before the vector loop may overwrite it (out may alias x).
    const float x_y = y == a.ignore_index ? 0.f : load1(in + y);
    const vfloat vhi = vsplat(l.hi), vlo = vsplat(l.lo), vcp = vsplat(cp), vc1 = vsplat(c1);
    const int64_t vec_end = x.V - x.V % kLanes;
    for (int64_t i = 0; i < vec_end; i += kLanes) {
      store(out + i, vcp * vexp_nonpos(load(in + i) - vhi - vlo) + vc1);
    }
    for (int64_t i = vec_end; i < x.V; ++i) {
      store1(out + i, cp * std::exp(load1(in + i) - l.hi - l.lo) + c1);
    }
    if (y != a.ignore_index) {
      store1(out + y, cp * std::exp(x_y - l.hi - l.lo) + a.c_y[r] + c1);
    }
  }
}

void row_grad(const RowGradArgs& a) {
  if (a.x.dtype == DType::kFloat32) {
    row_grad_impl<float>(a);
  } else {
    row_grad_impl<uint16_t>(a);
  }
}

// ---- RAG-Token kernels: the K rows of one (b, t) together ---------------------------------
// Each (b, t) pair walks the vocabulary tile by tile. A tile of kTile entries is read once from
// each of the K rows; P and e (below) for the K x kTile block stay in per-thread scratch (L1),
// so every inner loop streams one row with per-row constants in registers. One exp per
// element, one log and one division per vocabulary entry. Sums over v are kept in fp32 lanes
// per tile and flushed to double once per tile.

constexpr int64_t kTile = 256;
constexpr int64_t kTileVecs = kTile / kLanes;

// A row's last n < kLanes elements; the other lanes get `fill`.
template <typename Elem>
inline vfloat load_part(const Elem* p, int64_t n, float fill) {
  float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) tmp[i] = i < n ? load1(p + i) : fill;
  return vload(tmp);
}
template <typename Elem>
inline void store_part(Elem* p, vfloat v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store1(p + i, v[i]);
}


// One (b, t) pair: the K rows, their constants, and the scratch of one tile. For entries
// v = start + j*kLanes + lane of the current tile:
//   P[k][j] = exp(x_k - lse_k),  e[k][j] = R_k / inv[j],  M[j] = logsumexp_k (a_k + x_k - lse_k)
// Lanes past the row's end read x = -inf: P = e = inv = 0 and M = -inf there. x - lse is
// (x - hi) - lo and a + x - lse is (x - hi) + shift (SplitLse, shift_lo).
template <typename Elem>
struct PairTile {
  int64_t K;
  std::vector<const Elem*> row;
  std::vector<float> hi, lo, shift, prior;  // lse = hi + lo, shift = a - lo, prior = exp(a)
  std::vector<vfloat> P, e;                 // [K, kTileVecs]
  std::vector<vfloat> s, inv, M;            // [kTileVecs]

  explicit PairTile(int64_t K_)
      : K(K_), row(K_), hi(K_), lo(K_), shift(K_), prior(K_), P(K_ * kTileVecs),
        e(K_ * kTileVecs), s(kTileVecs), inv(kTileVecs), M(kTileVecs) {}

  void bind(const LogitsView& x, const float* a, const double* lse_all, int64_t b, int64_t t) {
    for (int64_t k = 0; k < K; ++k) {
      row[k] = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
      const SplitLse l = split_lse(lse_all[(b * K + k) * x.T + t]);
      hi[k] = l.hi;
      lo[k] = l.lo;
      shift[k] = shift_lo(a[b * K + k], l);
      prior[k] = std::exp(a[b * K + k]);
    }
  }

  // Vectors [0, ceil(len / kLanes)) of the tile at `start` (len <= kTile). e = p_k P_k and
  // M = log sum_k e (only if need_m; the shifted vectors always get M), unless a lane's sum is below 2^-100 (every a + x - lse below about -69),
  // where precision was lost: that vector is redone with a max shift. NaN in gives NaN out.
  void marginal(int64_t start, int64_t len, bool need_m = true) {
    const int64_t full = len / kLanes, rem = len % kLanes, nv = full + (rem ? 1 : 0);
    std::fill(s.begin(), s.begin() + nv, vfloat{});
    for (int64_t k = 0; k < K; ++k) {
      const Elem* xr = row[k] + start;
      vfloat* Pk = &P[k * kTileVecs];
      vfloat* ek = &e[k * kTileVecs];
      const vfloat h = vsplat(hi[k]), l = vsplat(lo[k]), pr = vsplat(prior[k]);
      for (int64_t j = 0; j < full; ++j) {
        __builtin_prefetch(xr + j * kLanes + kTile);
        Pk[j] = vexp_nonpos(load(xr + j * kLanes) - h - l);
        ek[j] = Pk[j] * pr;
        s[j] += ek[j];
      }
      if (rem) {
        Pk[full] = vexp_nonpos(load_part(xr + full * kLanes, rem, kNegInf) - h - l);
        ek[full] = Pk[full] * pr;
        s[full] += ek[full];
      }
    }
    for (int64_t j = 0; j < nv; ++j) {
      if (__builtin_expect(any_lane(s[j] < vsplat(0x1p-100f)), 0)) {
        shifted(start, j, j < full ? kLanes : rem);
      } else {
        inv[j] = vsplat(1.f) / s[j];
        if (need_m) M[j] = vlog(s[j]);
      }
    }
  }

  // Vector j with e_k = exp(z_k - max_k z_k), z_k = (x_k - hi_k) + shift_k (z = -inf for a
  // missing passage, so e = 0 exactly); inv = 0 and M = -inf where every z is -inf.
  void shifted(int64_t start, int64_t j, int64_t n) {
    vfloat mx = vsplat(kNegInf);
    for (int64_t k = 0; k < K; ++k) {
      const Elem* xv = row[k] + start + j * kLanes;
      vfloat z = (n == kLanes ? load(xv) : load_part(xv, n, kNegInf)) - vsplat(hi[k]) +
                 vsplat(shift[k]);
      e[k * kTileVecs + j] = z;
      mx = vmax(mx, z);
    }
    const vfloat safe = mx == vsplat(kNegInf) ? vfloat{} : mx;
    vfloat sum{};
    for (int64_t k = 0; k < K; ++k) {
      vfloat& ek = e[k * kTileVecs + j];
      ek = vexp_nonpos(ek - safe);
      sum += ek;
    }
    inv[j] = sum == vfloat{} ? vfloat{} : vsplat(1.f) / sum;
    M[j] = safe + vlog(sum);
  }
};

// Scalar marginal at one vocabulary entry from its K logits xs[k]: returns M, fills r[k] = R.
inline float marginal_at(const std::vector<float>& xs, const std::vector<float>& hi,
                         const std::vector<float>& shift, std::vector<float>& r) {
  const int64_t K = static_cast<int64_t>(xs.size());
  float mx = kNegInf;
  for (int64_t k = 0; k < K; ++k) {
    r[k] = (xs[k] - hi[k]) + shift[k];
    mx = r[k] > mx ? r[k] : mx;
  }
  const float safe = mx == kNegInf ? 0.f : mx;
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    r[k] = std::exp(r[k] - safe);
    s += r[k];
  }
  const float inv = s == 0.f ? 0.f : 1.f / s;
  for (int64_t k = 0; k < K; ++k) r[k] *= inv;
  return safe + std::log(s);
}

template <typename Elem>
void token_smooth_stats_impl(const TokenSmoothStatsArgs& a) {
  const LogitsView& x = a.x;
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
#pragma omp parallel
  {
    FlushDenormals ftz;
    PairTile<Elem> p(K);
    std::vector<double> rho(K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      double sum_m = 0.0;
      std::fill(rho.begin(), rho.end(), 0.0);
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t len = std::min(kTile, V - start);
        const int64_t full = len / kLanes, rem = len % kLanes;
        p.marginal(start, len);
        vfloat sm{};
        for (int64_t j = 0; j < full; ++j) sm += p.M[j];
        if (rem) sm += first_lanes(p.M[full], rem);
        sum_m += hsum(sm);
        const int64_t nv = full + (rem ? 1 : 0);
        for (int64_t k = 0; k < K; ++k) {
          const vfloat* ek = &p.e[k * kTileVecs];
          vfloat acc{};
          for (int64_t j = 0; j < nv; ++j) acc += ek[j] * p.inv[j];
          rho[k] += hsum(acc);
        }
      }
      a.sum_m[q] = static_cast<float>(sum_m);
      for (int64_t k = 0; k < K; ++k) a.rho[(b * K + k) * T + t] = static_cast<float>(rho[k]);
    }
  }
}

// ---- Fused RAG-Token forward with label smoothing: one read of the K rows of each (b, t) ----
// Pass 1 streams each row once from memory in blocks of kBlock entries: block max, then
// e = exp(x - block max) into a buffer [K, V] (K*V*4 bytes, cache resident) while the row's
// lse, sum and target logit accumulate. Pass 2 walks the buffer block by block: with
// c_k = a_k - lse_k + blockmax_k and G = max_k c_k, the marginal is
//   M_v = G + log s_v,   s_v = sum_k exp(c_k - G) e_kv,   R_kv = exp(c_k - G) e_kv / s_v,
// so no exp is recomputed: per entry one fma for s and one for rho, per v one log and one
// division. A vector where some s_v < 2^-100 (every passage puts v more than ~69 below G) has
// lost precision and is redone from the logits with the exact max over k (max_shifted_at).
//
// Scratch: the [K, V] buffers of all threads together stay within kScratchBytes, whatever the
// thread count: threads 0 .. n-1 get one each (n = kScratchBytes / (K*V*4 bytes + maxima)), the
// others (and every thread when one buffer alone is larger) keep only one [K, kBlock] block and
// recompute its maxima and exps in pass 2 from the logits (from cache while K * V elements fit
// there). Both compute the same bits, so which thread takes a pair never changes a result.
constexpr int64_t kScratchBytes = int64_t{16} << 20;

struct TokenForwardArgs {
  const int64_t* targets;
  int64_t ignore_index;
  const float* a;
  double* lse;
  float *x_tgt, *x_sum, *sum_m, *rho;
};

// Vector j of the block at `start` from the K rows: e_k = exp(z_k - max_k z_k) with
// z_k = (x_k - hi_k) + shift_k (lanes past n read x = -inf). Returns M; inv = 1 / sum_k e_k (0
// where every z is -inf, M = -inf there). e must hold K vectors.
template <typename Elem>
inline vfloat max_shifted_at(const std::vector<const Elem*>& rows, const float* hi,
                             const float* shift, int64_t at, int64_t n, vfloat* e, vfloat& inv) {
  const int64_t K = static_cast<int64_t>(rows.size());
  vfloat mx = vsplat(kNegInf);
  for (int64_t k = 0; k < K; ++k) {
    const Elem* xv = rows[k] + at;
    e[k] = (n == kLanes ? load(xv) : load_part(xv, n, kNegInf)) - vsplat(hi[k]) +
           vsplat(shift[k]);
    mx = vmax(mx, e[k]);
  }
  const vfloat safe = mx == vsplat(kNegInf) ? vfloat{} : mx;
  vfloat sum{};
  for (int64_t k = 0; k < K; ++k) {
    e[k] = vexp_nonpos(e[k] - safe);
    sum += e[k];
  }
  inv = sum == vfloat{} ? vfloat{} : vsplat(1.f) / sum;
  return safe + vlog(sum);
}

// Block blk of a row: e = exp(x - block max) into eb (lanes past the row's end get 0), with
// acc += e and vt += x (lanes past the end add 0); returns the block max (-inf: all -inf).
template <typename Elem>
inline float exps_of_block(const Elem* row, int64_t blk, int64_t V, float* eb, vfloat& acc,
                           vfloat& vt) {
  const int64_t start = blk * kBlock, len = std::min(kBlock, V - start);
  const int64_t full = len / kLanes, rem = len % kLanes;
  const Elem* xb = row + start;
  // The max sweep streams from memory; the exp sweep re-reads the block from L1 and also sums
  // x (off the max sweep's short dependency chain).
  vfloat vm = vsplat(kNegInf);
  for (int64_t j = 0; j < full; ++j) {
    __builtin_prefetch(xb + j * kLanes + kPrefetch);
    vm = vmax(vm, load(xb + j * kLanes));
  }
  if (rem) vm = vmax(vm, load_part(xb + full * kLanes, rem, kNegInf));
  const float bm = hmax(vm);
  const vfloat safe = vsplat(bm == kNegInf ? 0.f : bm);
  for (int64_t j = 0; j < full; ++j) {
    const vfloat v = load(xb + j * kLanes);
    const vfloat ev = vexp_nonpos(v - safe);
    vstore(eb + j * kLanes, ev);
    acc += ev;
    vt += v;
  }
  if (rem) {
    const vfloat v = load_part(xb + full * kLanes, rem, kNegInf);
    const vfloat ev = vexp_nonpos(v - safe);
    vstore(eb + full * kLanes, ev);
    acc += ev;
    vt += first_lanes(v, rem);
  }
  return bm;
}

template <typename Elem>
void token_smooth_forward_impl(const LogitsView& x, const TokenForwardArgs& a) {
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  // A thread's buffer: exp(x - block max), block-major (block j of row k at (j * K + k) *
  // kBlock, so that pass 2 reads one contiguous K * kBlock run per block), then the K * blocks
  // block maxima. Not zeroed: pass 1 writes every entry pass 2 reads.
  const int64_t buffer_floats = blocks * K * kBlock + K * blocks;
  const int64_t buffers = std::min<int64_t>(num_threads(), kScratchBytes / (buffer_floats * 4));
  std::unique_ptr<float[]> pool(buffers > 0 ? new float[buffers * buffer_floats] : nullptr);
#pragma omp parallel
  {
    FlushDenormals ftz;
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num();
#else
    const int64_t thread = 0;
#endif
    float* const buffer = thread < buffers ? pool.get() + thread * buffer_floats : nullptr;
    std::vector<float> block(buffer ? 0 : K * kBlock), block_max(buffer ? 0 : K);
    // Block blk of row k: its exps and its max (in the buffer, or the one block's scratch).
    auto block_exps = [&](int64_t blk, int64_t k) {
      return buffer ? buffer + (blk * K + k) * kBlock : block.data() + k * kBlock;
    };
    auto block_max_of = [&](int64_t blk, int64_t k) -> float& {
      return buffer ? buffer[blocks * K * kBlock + k * blocks + blk] : block_max[k];
    };
    std::vector<float> hi(K), shift(K), w(K);  // lse = hi + lo, shift = a - lo (SplitLse)
    std::vector<double> rho(K), prior_shift(K), wd(K);  // a - lse, and + block max, in double
    std::vector<const Elem*> rows(K);
    std::vector<vfloat> slow(K), slow_rho(K), racc(K), wv(K);
    const bool want_rho = a.rho != nullptr;
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      const int64_t y = a.targets ? a.targets[q] : a.ignore_index;
      // Pass 1: each row once from memory.
      for (int64_t k = 0; k < K; ++k) {
        const Elem* row = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
        rows[k] = row;
        float m = kNegInf, sum = 0.f;
        double total = 0.0;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          vfloat acc{}, vt{};
          const float bm = exps_of_block(row, blk, V, block_exps(blk, k), acc, vt);
          block_max_of(blk, k) = bm;
          total += hsum(vt);
          if (bm == kNegInf) continue;
          const float bs = hsum(acc);
          if (bm > m) {
            sum = (m == kNegInf ? 0.f : sum * std::exp(m - bm)) + bs;
            m = bm;
          } else {
            sum += bs * std::exp(bm - m);
          }
        }
        // A NaN anywhere makes the sum NaN, and then lse (and everything after) too.
        const float tot = static_cast<float>(total);
        const int64_t r = (b * K + k) * T + t;
        const double lse = tot != tot ? static_cast<double>(tot)
                           : (m == kNegInf ? -std::numeric_limits<double>::infinity()
                                           : lse_of(m, sum));
        a.lse[r] = lse;
        a.x_sum[r] = tot;
        a.x_tgt[r] = y == a.ignore_index ? 0.f : load1(row + y);
        const SplitLse l = split_lse(lse);
        hi[k] = l.hi;
        shift[k] = shift_lo(a.a[b * K + k], l);
        prior_shift[k] = static_cast<double>(a.a[b * K + k]) - lse;
        rho[k] = 0.0;
      }
      // Pass 2: the marginal from the buffer (or the block recomputed), block by block.
      double sum_m = 0.0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t start = blk * kBlock, len = std::min(kBlock, V - start);
        const int64_t full = len / kLanes, rem = len % kLanes, nv = full + (rem ? 1 : 0);
        if (!buffer) {
          for (int64_t k = 0; k < K; ++k) {
            vfloat acc{}, vt{};
            block_max[k] = exps_of_block(rows[k], blk, V, block_exps(blk, k), acc, vt);
          }
        }
        // c_k = a_k - lse_k + block max, in double; -inf (missing passage, empty block) gives
        // weight 0.
        double G = -std::numeric_limits<double>::infinity();
        for (int64_t k = 0; k < K; ++k) {
          wd[k] = prior_shift[k] + static_cast<double>(block_max_of(blk, k));
          G = wd[k] > G ? wd[k] : G;
        }
        const double safe_g = std::isinf(G) && G < 0 ? 0.0 : G;
        for (int64_t k = 0; k < K; ++k) w[k] = static_cast<float>(std::exp(wd[k] - safe_g));
        std::fill(slow_rho.begin(), slow_rho.end(), vfloat{});
        std::fill(racc.begin(), racc.end(), vfloat{});
        for (int64_t k = 0; k < K; ++k) wv[k] = vsplat(w[k]);
        const float* eb = block_exps(blk, 0);
        // One sweep over the block: per vector the K buffer entries (L1) give s and, when rho is
        // wanted, R summed into K independent accumulators. sum_v M = sum_v (G + log s) needs
        // no log per vector: s = 2^ex * m with m in [1, 2), so the exponents add as integers
        // and the mantissas multiply, one log per kLogGroup vectors (a product of 8 mantissas
        // stays below 2^8). A NaN s decomposes to finite bits: nan_acc carries it instead.
        constexpr int kLogGroup = 8;
        vfloat slow_m{}, log_acc{}, nan_acc{}, prod = vsplat(1.f);
        vint ex_acc{};
        int in_prod = 0;
        int64_t fast_lanes = 0;  // entries whose M is G + log s (the others are in slow_m)
        for (int64_t j = 0; j < nv; ++j) {
          const float* ej = eb + j * kLanes;
          vfloat sj{};
          for (int64_t k = 0; k < K; ++k) sj += wv[k] * vload(ej + k * kBlock);
          if (j == full) sj = lanes_below(rem) ? sj : vsplat(1.f);  // past the end: log s = 0
          const int64_t n = j < full ? kLanes : rem;
          if (__builtin_expect(any_lane(sj < vsplat(0x1p-100f)), 0)) {
            vfloat inv;
            const vfloat Mj =
                max_shifted_at(rows, hi.data(), shift.data(), start + j * kLanes, n, slow.data(),
                               inv);
            slow_m += j < full ? Mj : first_lanes(Mj, rem);
            if (want_rho) {
              for (int64_t k = 0; k < K; ++k) slow_rho[k] += slow[k] * inv;
            }
            continue;
          }
          vint bits;
          std::memcpy(&bits, &sj, sizeof(bits));
          ex_acc += (bits >> 23) - 127;  // s is normal and positive here
          const vint mbits = (bits & 0x007fffff) | 0x3f800000;
          vfloat m;
          std::memcpy(&m, &mbits, sizeof(m));
          prod *= m;
          nan_acc += sj - sj;
          if (++in_prod == kLogGroup) {
            log_acc += vlog(prod);
            prod = vsplat(1.f);
            in_prod = 0;
          }
          fast_lanes += n;
          if (want_rho) {
            const vfloat inv = vrecip(sj);
            for (int64_t k = 0; k < K; ++k) racc[k] += vload(ej + k * kBlock) * inv;
          }
        }
        if (in_prod) log_acc += vlog(prod);
        int64_t ex_sum = 0;
        for (int i = 0; i < kLanes; ++i) ex_sum += ex_acc[i];
        sum_m += safe_g * static_cast<double>(fast_lanes) +
                 0.69314718055994531 * static_cast<double>(ex_sum) + hsum(log_acc) +
                 hsum(slow_m) + hsum(nan_acc);
        if (!want_rho) continue;
        for (int64_t k = 0; k < K; ++k) {
          rho[k] += hsum(slow_rho[k]);
          // w == 0 exactly for a missing passage: its entries carry no weight (even NaN ones)
          if (w[k] != 0.f) rho[k] += static_cast<double>(w[k]) * hsum(racc[k]);
        }
      }
      a.sum_m[q] = static_cast<float>(sum_m);
      if (!want_rho) continue;
      for (int64_t k = 0; k < K; ++k) a.rho[(b * K + k) * T + t] = static_cast<float>(rho[k]);
    }
  }
}

void token_smooth_forward(const TokenSmoothForwardArgs& a) {
  const TokenForwardArgs f{a.targets, a.ignore_index, a.a, a.lse, a.x_tgt, a.x_sum, a.sum_m,
                           a.rho};
  if (a.x.dtype == DType::kFloat32) {
    token_smooth_forward_impl<float>(a.x, f);
  } else {
    token_smooth_forward_impl<uint16_t>(a.x, f);
  }
}

template <typename Elem>
void token_smooth_grad_impl(const TokenSmoothGradArgs& a) {
  const LogitsView& x = a.x;
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
  prepare_out(x, a.out, a.ob, a.ok, a.ot);
#pragma omp parallel
  {
    FlushDenormals ftz;
    PairTile<Elem> p(K);
    std::vector<vfloat> w(kTileVecs);
    std::vector<float> x_y(K), r_y(K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      const float cr = a.c_r[q];
      const int64_t y = a.targets ? a.targets[q] : a.ignore_index;
      // The target entries are read before the tiles may overwrite them (out may alias x).
      if (y != a.ignore_index) {
        for (int64_t k = 0; k < K; ++k) x_y[k] = load1(p.row[k] + y);
      }
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t len = std::min(kTile, V - start);
        const int64_t full = len / kLanes, rem = len % kLanes;
        p.marginal(start, len, false);  // reads the whole K x tile block before any write
        for (int64_t j = 0; j < full + (rem ? 1 : 0); ++j) w[j] = vsplat(cr) * p.inv[j];
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = (b * K + k) * T + t;
          Elem* out = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot + start;
          const vfloat* Pk = &p.P[k * kTileVecs];
          const vfloat* ek = &p.e[k * kTileVecs];
          const vfloat cp = vsplat(a.c_p[r]), c1 = vsplat(a.c_1[r]);
          for (int64_t j = 0; j < full; ++j) store(out + j * kLanes, cp * Pk[j] + c1 + w[j] * ek[j]);
          if (rem) store_part(out + full * kLanes, cp * Pk[full] + c1 + w[full] * ek[full], rem);
        }
      }
      if (y != a.ignore_index) {
        marginal_at(x_y, p.hi, p.shift, r_y);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = (b * K + k) * T + t;
          Elem* out = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
          const float P = std::exp(x_y[k] - p.hi[k] - p.lo[k]);
          store1(out + y, a.c_p[r] * P + a.c_y[r] + a.c_1[r] + cr * r_y[k]);
        }
      }
    }
  }
}

template <typename Elem>
void token_marginal_impl(const TokenMarginalArgs& a) {
  const LogitsView& x = a.x;
  const int64_t T = x.T, V = x.V, pairs = x.B * x.T;
  prefer_huge_pages(a.m, pairs * V * 4);
#pragma omp parallel
  {
    FlushDenormals ftz;
    PairTile<Elem> p(x.K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      p.bind(x, a.a, a.lse, q / T, q % T);
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t len = std::min(kTile, V - start);
        const int64_t full = len / kLanes, rem = len % kLanes;
        float* m = a.m + q * V + start;
        p.marginal(start, len);
        for (int64_t j = 0; j < full; ++j) vstore(m + j * kLanes, p.M[j]);
        if (rem) store_part(m + full * kLanes, p.M[full], rem);
      }
    }
  }
}

template <typename Elem>
void token_marginal_grad_impl(const TokenMarginalGradArgs& a) {
  const LogitsView& x = a.x;
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
  prepare_out(x, a.out, a.ob, a.ok, a.ot);
#pragma omp parallel
  {
    FlushDenormals ftz;
    PairTile<Elem> p(K);
    std::vector<double> c(K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      const float* m = a.m + q * V;
      const float* g = a.g + q * V;
      // Pass 1: c_k = sum_v R g with R = exp(x + shift - M) from the saved M.
      std::fill(c.begin(), c.end(), 0.0);
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t len = std::min(kTile, V - start);
        const int64_t full = len / kLanes, rem = len % kLanes;
        for (int64_t k = 0; k < K; ++k) {
          const Elem* xr = p.row[k] + start;
          const vfloat h = vsplat(p.hi[k]), sh = vsplat(p.shift[k]);
          vfloat acc{};
          for (int64_t j = 0; j < full; ++j) {
            const int64_t i = start + j * kLanes;
            acc += vexp_nonpos(load(xr + j * kLanes) - h + sh - vload(m + i)) * vload(g + i);
          }
          if (rem) {
            const int64_t i = start + full * kLanes;
            const vfloat z = load_part(xr + full * kLanes, rem, kNegInf) - h + sh;
            acc += vexp_nonpos(z - load_part(m + i, rem, 0.f)) * load_part(g + i, rem, 0.f);
          }
          c[k] += hsum(acc);
        }
      }
      // Pass 2 (the K rows are still in cache): out = R g - P c.
      for (int64_t k = 0; k < K; ++k) {
        a.c[(b * K + k) * T + t] = static_cast<float>(c[k]);
        Elem* out = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
        const vfloat ck = vsplat(static_cast<float>(c[k])), sh = vsplat(p.shift[k]);
        const vfloat h = vsplat(p.hi[k]), l = vsplat(p.lo[k]);
        const int64_t vec_end = V - V % kLanes;
        for (int64_t i = 0; i < vec_end; i += kLanes) {
          const vfloat xh = load(p.row[k] + i) - h;
          store(out + i, vexp_nonpos(xh + sh - vload(m + i)) * vload(g + i) - vexp_nonpos(xh - l) * ck);
        }
        if (vec_end < V) {
          const int64_t n = V - vec_end;
          const vfloat xh = load_part(p.row[k] + vec_end, n, kNegInf) - h;
          const vfloat R = vexp_nonpos(xh + sh - load_part(m + vec_end, n, 0.f));
          store_part(out + vec_end, R * load_part(g + vec_end, n, 0.f) - vexp_nonpos(xh - l) * ck, n);
        }
      }
    }
  }
}

template <typename Args, void (*F32)(const Args&), void (*BF16)(const Args&)>
void by_dtype(const Args& a) {
  if (a.x.dtype == DType::kFloat32) {
    F32(a);
  } else {
    BF16(a);
  }
}

void token_smooth_stats(const TokenSmoothStatsArgs& a) {
  by_dtype<TokenSmoothStatsArgs, token_smooth_stats_impl<float>,
           token_smooth_stats_impl<uint16_t>>(a);
}
void token_smooth_grad(const TokenSmoothGradArgs& a) {
  by_dtype<TokenSmoothGradArgs, token_smooth_grad_impl<float>, token_smooth_grad_impl<uint16_t>>(
      a);
}
void token_marginal(const TokenMarginalArgs& a) {
  by_dtype<TokenMarginalArgs, token_marginal_impl<float>, token_marginal_impl<uint16_t>>(a);
}
void token_marginal_grad(const TokenMarginalGradArgs& a) {
  by_dtype<TokenMarginalGradArgs, token_marginal_grad_impl<float>,
           token_marginal_grad_impl<uint16_t>>(a);
}

}  // namespace

RAG_FAST_KERNEL(row_stats, RowStatsArgs, row_stats,
                "Per-row logsumexp, target logit and sum of logits.");
RAG_FAST_KERNEL(row_grad, RowGradArgs, row_grad,
                "out = c_p * softmax(x) + c_y * onehot(y) + c_1, per row.");
RAG_FAST_KERNEL(token_smooth_forward, TokenSmoothForwardArgs, token_smooth_forward,
                "row_stats and token_smooth_stats in one read of the logits.");
RAG_FAST_KERNEL(token_smooth_stats, TokenSmoothStatsArgs, token_smooth_stats,
                "sum_v of the RAG-Token marginal M per (b, t), and rho = sum_v R per row.");
RAG_FAST_KERNEL(token_smooth_grad, TokenSmoothGradArgs, token_smooth_grad,
                "out = c_p * P + c_y * onehot(y) + c_1 + c_r * R.");
RAG_FAST_KERNEL(token_marginal, TokenMarginalArgs, token_marginal,
                "RAG-Token marginal log-probs M [B, T, V].");
RAG_FAST_KERNEL(token_marginal_grad, TokenMarginalGradArgs, token_marginal_grad,
                "c = sum_v R * g and out = R * g - P * c, the marginal's backward.");

// The variant's identity (dispatch.cpp picks one variant for every kernel).
const KernelTable& table() {
  static const KernelTable t{RAG_FAST_REGISTRY_STR(RAG_FAST_VARIANT), kLanes * 4};
  return t;
}

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
