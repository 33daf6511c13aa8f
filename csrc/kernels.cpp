// rag_fast CPU kernels, compiled once per instruction set (RAG_FAST_VARIANT names the variant).
// Every kernel reads the logits row by row (one row = one (b, k, t) over the vocabulary),
// accumulates in fp32 registers and is multithreaded over rows with OpenMP.
#include <cmath>
#include <limits>

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

#define RAG_FAST_STR2(x) #x
#define RAG_FAST_STR(x) RAG_FAST_STR2(x)

}  // namespace

const KernelTable& table() {
  static const KernelTable t{RAG_FAST_STR(RAG_FAST_VARIANT), kLanes * 4, &row_stats, &row_grad};
  return t;
}

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
