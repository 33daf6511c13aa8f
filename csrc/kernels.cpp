// rag_fast CPU kernels, compiled once per instruction set (RAG_FAST_VARIANT names the variant).
// Every kernel reads the logits row by row (one row = one (b, k, t) over the vocabulary),
// accumulates in fp32 registers and is multithreaded over rows with OpenMP.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "vec.h"

#ifndef RAG_FAST_VARIANT
#error "RAG_FAST_VARIANT must name the instruction-set variant"
#endif

namespace rag_fast {
namespace RAG_FAST_VARIANT {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows are processed in blocks of this many elements: block max first, then one exp each.
constexpr int64_t kBlock = 512;

inline const char* row_ptr(const LogitsView& x, int64_t b, int64_t k, int64_t t) {
  const int64_t elem = x.dtype == DType::kFloat32 ? 4 : 2;
  return static_cast<const char*>(x.data) + (b * x.sb + k * x.sk + t * x.st) * elem;
}

template <typename Elem>
inline vfloat load(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return vload(reinterpret_cast<const float*>(p));
  } else {
    return vload_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}
template <typename Elem>
inline float load1(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return *reinterpret_cast<const float*>(p);
  } else {
    return bf16_to_float(*reinterpret_cast<const uint16_t*>(p));
  }
}

struct RowStat {
  float lse, sum;
};

// One pass over a row: running (max, sum of exp) per lane, rescaled once per block.
template <typename Elem>
RowStat row_lse_sum(const Elem* row, int64_t V) {
  vfloat m = vsplat(kNegInf), s = vfloat{}, total = vfloat{};
  float ms = kNegInf, ss = 0.f, ts = 0.f;  // scalar tail
  const int64_t vec_end = V - V % kLanes;
  for (int64_t start = 0; start < vec_end; start += kBlock) {
    const int64_t stop = start + kBlock < vec_end ? start + kBlock : vec_end;
    vfloat bm = vsplat(kNegInf);
    for (int64_t i = start; i < stop; i += kLanes) {
      vfloat v = load(row + i);
      bm = vmax(bm, v);
      total += v;
    }
    vfloat nm = vmax(m, bm);
    // Lanes still at -inf keep a zero sum (avoid exp(-inf - -inf) = NaN).
    vfloat safe = nm == vsplat(kNegInf) ? vfloat{} : nm;
    s = s * vexp(m - safe);
    for (int64_t i = start; i < stop; i += kLanes) s += vexp(load(row + i) - safe);
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
  const float tot = ts + hsum(total);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float gm = ms;
  for (int i = 0; i < kLanes; ++i) gm = m[i] > gm ? m[i] : gm;
  if (gm == kNegInf) return {tot != tot ? nan : kNegInf, tot};
  float acc = ms == kNegInf ? 0.f : ss * std::exp(ms - gm);
  for (int i = 0; i < kLanes; ++i) {
    if (m[i] != kNegInf) acc += s[i] * std::exp(m[i] - gm);
  }
  return {tot != tot ? nan : gm + std::log(acc), tot};
}

template <typename Elem>
void row_stats_impl(const RowStatsArgs& a) {
  const LogitsView& x = a.x;
  const int64_t rows = x.B * x.K * x.T;
#pragma omp parallel for schedule(static)
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

template <typename Elem>
void row_grad_impl(const RowGradArgs& a) {
  const LogitsView& x = a.x;
  const int64_t rows = x.B * x.K * x.T;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % x.T, bk = r / x.T, k = bk % x.K, b = bk / x.K;
    const Elem* in = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
    Elem* out = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
    const float lse = a.lse[r], cp = a.c_p[r], c1 = a.c_1[r];
    const int64_t y = a.targets ? a.targets[b * x.T + t] : a.ignore_index;
    // The one-hot entry is read before the vector loop may overwrite it (out may alias x).
    const float x_y = y == a.ignore_index ? 0.f : load1(in + y);
    const vfloat vlse = vsplat(lse), vcp = vsplat(cp), vc1 = vsplat(c1);
    const int64_t vec_end = x.V - x.V % kLanes;
    for (int64_t i = 0; i < vec_end; i += kLanes) {
      store(out + i, vcp * vexp(load(in + i) - vlse) + vc1);
    }
    for (int64_t i = vec_end; i < x.V; ++i) store1(out + i, cp * std::exp(load1(in + i) - lse) + c1);
    if (y != a.ignore_index) {
      store1(out + y, cp * std::exp(x_y - lse) + a.c_y[r] + c1);
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
// Each (b, t) pair walks the vocabulary one vector at a time over all K rows (K vectors of
// scratch stay in L1), so the marginal needs one exp per element and one log per vocabulary
// entry. Sums over v are kept per tile in fp32 lanes and flushed to double once per tile.

constexpr int64_t kTile = 2048;

inline vint lane_index() {
  vint idx;
  for (int i = 0; i < kLanes; ++i) idx[i] = i;
  return idx;
}

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
template <bool Part, typename Elem>
inline vfloat load_n(const Elem* p, int64_t n, float fill) {
  if constexpr (Part) {
    return load_part(p, n, fill);
  } else {
    return load(p);
  }
}
template <bool Part, typename Elem>
inline void store_n(Elem* p, vfloat v, int64_t n) {
  if constexpr (Part) {
    store_part(p, v, n);
  } else {
    store(p, v);
  }
}

// The K rows of one (b, t): pointers, z-shifts a_k - lse_k, and per-thread scratch.
template <typename Elem>
struct PairRows {
  int64_t K;
  std::vector<const Elem*> row;
  std::vector<float> shift, lse;
  std::vector<vfloat> z, e;  // z_k = x_k + shift_k, then e_k = exp(z_k - max_k z_k)

  explicit PairRows(int64_t K_) : K(K_), row(K_), shift(K_), lse(K_), z(K_), e(K_) {}

  void bind(const LogitsView& x, const float* a, const float* lse_all, int64_t b, int64_t t) {
    for (int64_t k = 0; k < K; ++k) {
      row[k] = reinterpret_cast<const Elem*>(row_ptr(x, b, k, t));
      lse[k] = lse_all[(b * K + k) * x.T + t];
      // A missing passage (a = -inf) gets z = -inf, hence e = 0 and R = 0 exactly.
      shift[k] = a[b * K + k] - lse[k];
    }
  }

  // Vocabulary entries [i, i + n): fills e, sets inv = 1 / sum_k e_k (0 where every z is
  // -inf) and returns M = logsumexp_k z_k. NaN anywhere among the K entries gives NaN.
  template <bool Part>
  inline vfloat marginal(int64_t i, int64_t n, vfloat& inv) {
    vfloat mx = vsplat(kNegInf);
    for (int64_t k = 0; k < K; ++k) {
      z[k] = load_n<Part>(row[k] + i, n, kNegInf) + vsplat(shift[k]);
      mx = vmax(mx, z[k]);
    }
    const vfloat safe = mx == vsplat(kNegInf) ? vfloat{} : mx;
    vfloat s{};
    for (int64_t k = 0; k < K; ++k) {
      e[k] = vexp(z[k] - safe);
      s += e[k];
    }
    inv = s == vfloat{} ? vfloat{} : vsplat(1.f) / s;
    return safe + vlog(s);
  }
};

// Scalar marginal at one vocabulary entry from its K logits xs[k]: returns M, fills r[k] = R.
inline float marginal_at(const std::vector<float>& xs, const std::vector<float>& shift,
                         std::vector<float>& r) {
  const int64_t K = static_cast<int64_t>(xs.size());
  float mx = kNegInf;
  for (int64_t k = 0; k < K; ++k) {
    r[k] = xs[k] + shift[k];
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
    PairRows<Elem> p(K);
    std::vector<vfloat> rho_tile(K);
    std::vector<double> rho(K);
    const vint lanes = lane_index();
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      double sum_m = 0.0;
      std::fill(rho.begin(), rho.end(), 0.0);
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t stop = std::min(start + kTile, V);
        const int64_t vec_stop = stop - (stop - start) % kLanes;
        vfloat sm{}, inv;
        std::fill(rho_tile.begin(), rho_tile.end(), vfloat{});
        for (int64_t i = start; i < vec_stop; i += kLanes) {
          sm += p.template marginal<false>(i, kLanes, inv);
          for (int64_t k = 0; k < K; ++k) rho_tile[k] += p.e[k] * inv;
        }
        if (vec_stop < stop) {
          const int64_t n = stop - vec_stop;
          const vfloat m = p.template marginal<true>(vec_stop, n, inv);
          sm += lanes < static_cast<int32_t>(n) ? m : vfloat{};  // pad lanes hold M = -inf
          for (int64_t k = 0; k < K; ++k) rho_tile[k] += p.e[k] * inv;
        }
        sum_m += hsum(sm);
        for (int64_t k = 0; k < K; ++k) rho[k] += hsum(rho_tile[k]);
      }
      a.sum_m[q] = static_cast<float>(sum_m);
      for (int64_t k = 0; k < K; ++k) a.rho[(b * K + k) * T + t] = static_cast<float>(rho[k]);
    }
  }
}

template <typename Elem>
void token_smooth_grad_impl(const TokenSmoothGradArgs& a) {
  const LogitsView& x = a.x;
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
  const int64_t vec_end = V - V % kLanes;
#pragma omp parallel
  {
    PairRows<Elem> p(K);
    std::vector<Elem*> out(K);
    std::vector<vfloat> cp(K), c1(K), lse(K);
    std::vector<float> x_y(K), r_y(K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      const vfloat cr = vsplat(a.c_r[q]);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = (b * K + k) * T + t;
        out[k] = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
        cp[k] = vsplat(a.c_p[r]);
        c1[k] = vsplat(a.c_1[r]);
        lse[k] = vsplat(p.lse[k]);
      }
      const int64_t y = a.targets ? a.targets[q] : a.ignore_index;
      // The target entries are read before the vector loop may overwrite them (out may alias x).
      if (y != a.ignore_index) {
        for (int64_t k = 0; k < K; ++k) x_y[k] = load1(p.row[k] + y);
      }
      vfloat inv;
      for (int64_t i = 0; i < vec_end; i += kLanes) {
        p.template marginal<false>(i, kLanes, inv);
        const vfloat w = cr * inv;
        for (int64_t k = 0; k < K; ++k) {
          const vfloat P = vexp(load(p.row[k] + i) - lse[k]);
          store(out[k] + i, cp[k] * P + c1[k] + w * p.e[k]);
        }
      }
      if (vec_end < V) {
        const int64_t n = V - vec_end;
        p.template marginal<true>(vec_end, n, inv);
        const vfloat w = cr * inv;
        for (int64_t k = 0; k < K; ++k) {
          const vfloat P = vexp(load_part(p.row[k] + vec_end, n, kNegInf) - lse[k]);
          store_part(out[k] + vec_end, cp[k] * P + c1[k] + w * p.e[k], n);
        }
      }
      if (y != a.ignore_index) {
        marginal_at(x_y, p.shift, r_y);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = (b * K + k) * T + t;
          const float P = std::exp(x_y[k] - p.lse[k]);
          store1(out[k] + y, a.c_p[r] * P + a.c_y[r] + a.c_1[r] + a.c_r[q] * r_y[k]);
        }
      }
    }
  }
}

template <typename Elem>
void token_marginal_impl(const TokenMarginalArgs& a) {
  const LogitsView& x = a.x;
  const int64_t T = x.T, V = x.V, pairs = x.B * x.T;
  const int64_t vec_end = V - V % kLanes;
#pragma omp parallel
  {
    PairRows<Elem> p(x.K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      p.bind(x, a.a, a.lse, q / T, q % T);
      float* m = a.m + q * V;
      vfloat inv;
      for (int64_t i = 0; i < vec_end; i += kLanes) vstore(m + i, p.template marginal<false>(i, kLanes, inv));
      if (vec_end < V) store_part(m + vec_end, p.template marginal<true>(vec_end, V - vec_end, inv), V - vec_end);
    }
  }
}

// R_k at entries [i, i + n) from the saved marginal m: R = exp(x + shift - M).
template <bool Part, typename Elem>
inline vfloat posterior(const PairRows<Elem>& p, int64_t k, int64_t i, int64_t n, vfloat m) {
  return vexp(load_n<Part>(p.row[k] + i, n, kNegInf) + vsplat(p.shift[k]) - m);
}

template <typename Elem>
void token_marginal_grad_impl(const TokenMarginalGradArgs& a) {
  const LogitsView& x = a.x;
  const int64_t K = x.K, T = x.T, V = x.V, pairs = x.B * x.T;
  const int64_t vec_end = V - V % kLanes;
#pragma omp parallel
  {
    PairRows<Elem> p(K);
    std::vector<vfloat> acc(K);
    std::vector<double> c(K);
    std::vector<Elem*> out(K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t b = q / T, t = q % T;
      p.bind(x, a.a, a.lse, b, t);
      const float* m = a.m + q * V;
      const float* g = a.g + q * V;
      // Pass 1: c_k = sum_v R g (pad lanes: x = -inf, g = 0).
      std::fill(c.begin(), c.end(), 0.0);
      for (int64_t start = 0; start < V; start += kTile) {
        const int64_t stop = std::min(start + kTile, V);
        const int64_t vstop = stop - (stop - start) % kLanes;
        std::fill(acc.begin(), acc.end(), vfloat{});
        for (int64_t i = start; i < vstop; i += kLanes) {
          const vfloat mv = vload(m + i), gv = vload(g + i);
          for (int64_t k = 0; k < K; ++k) acc[k] += posterior<false>(p, k, i, kLanes, mv) * gv;
        }
        if (vstop < stop) {
          const int64_t n = stop - vstop;
          const vfloat mv = load_part(m + vstop, n, 0.f), gv = load_part(g + vstop, n, 0.f);
          for (int64_t k = 0; k < K; ++k) acc[k] += posterior<true>(p, k, vstop, n, mv) * gv;
        }
        for (int64_t k = 0; k < K; ++k) c[k] += hsum(acc[k]);
      }
      for (int64_t k = 0; k < K; ++k) {
        a.c[(b * K + k) * T + t] = static_cast<float>(c[k]);
        out[k] = static_cast<Elem*>(a.out) + b * a.ob + k * a.ok + t * a.ot;
      }
      // Pass 2 (the K rows are still in cache): out = R g - P c.
      for (int64_t k = 0; k < K; ++k) {
        const vfloat ck = vsplat(static_cast<float>(c[k])), lse = vsplat(p.lse[k]);
        for (int64_t i = 0; i < vec_end; i += kLanes) {
          const vfloat mv = vload(m + i), gv = vload(g + i);
          const vfloat P = vexp(load(p.row[k] + i) - lse);
          store(out[k] + i, posterior<false>(p, k, i, kLanes, mv) * gv - P * ck);
        }
        if (vec_end < V) {
          const int64_t n = V - vec_end;
          const vfloat mv = load_part(m + vec_end, n, 0.f), gv = load_part(g + vec_end, n, 0.f);
          const vfloat P = vexp(load_part(p.row[k] + vec_end, n, kNegInf) - lse);
          store_part(out[k] + vec_end, posterior<true>(p, k, vec_end, n, mv) * gv - P * ck, n);
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

#define RAG_FAST_STR2(x) #x
#define RAG_FAST_STR(x) RAG_FAST_STR2(x)

}  // namespace

const KernelTable& table() {
  static const KernelTable t{
      RAG_FAST_STR(RAG_FAST_VARIANT),
      kLanes * 4,
      &row_stats,
      &row_grad,
      &by_dtype<TokenSmoothStatsArgs, token_smooth_stats_impl<float>,
                token_smooth_stats_impl<uint16_t>>,
      &by_dtype<TokenSmoothGradArgs, token_smooth_grad_impl<float>,
                token_smooth_grad_impl<uint16_t>>,
      &by_dtype<TokenMarginalArgs, token_marginal_impl<float>, token_marginal_impl<uint16_t>>,
      &by_dtype<TokenMarginalGradArgs, token_marginal_grad_impl<float>,
                token_marginal_grad_impl<uint16_t>>,
  };
  return t;
}

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
