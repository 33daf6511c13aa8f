// The fused RAG-Token beam step, compiled once per instruction set like rag_losses.cpp.
//
// Work is split over rows (b, j): pass 1 computes the K row normalisers; pass 2 walks the
// vocabulary once more, computing the marginal over the K passages lane by lane and keeping a
// running top-n of (score, flat index). A vector of tokens whose upper bound
// max_k (a + x - L) + log K + bias + beam_score cannot beat the current n-th best is skipped
// after the K loads and maxima, without any exp; once the list fills (after a few hundred
// tokens) almost every vector is skipped. The W per-beam lists of a question are then merged.
//
// For question b, beam j, passage k and token v, with the row normaliser
// L[b,j,k] = logsumexp_v x[b,j,k,v]:
//   M[b,j,v] = logsumexp_k (a[b,k] + x[b,j,k,v] - L[b,j,k])      marginal log-probs
//   c[b,j,v] = (M[b,j,v] + bias[b*W+j, v]) + beam_score[b,j]     candidate score
// and the output is the n best (j, v) per question, sorted by score descending, ties broken by
// the lower flat index j*V + v first. Reads the logits twice (normalisers, then the marginal
// with a running top-n per beam), never materializes M or c.
//
// Nothing is validated here: the Python op checked shapes, dtypes, strides (stride 1 along v),
// n <= W*V, and made log_prior, beam_scores, bias and outputs contiguous.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "registry.h"
#include "vec.h"

#ifndef RAG_FAST_VARIANT
#error "RAG_FAST_VARIANT must name the instruction-set variant"
#endif

namespace rag_fast {

struct BeamStepArgs {
  const void* logits;  // x[b, j, k, v], element strides (sb, sw, sk), stride 1 along v
  DType dtype;
  int64_t B, W, K, V;
  int64_t sb, sw, sk;
  const float* log_prior;    // a [B, K]; -inf marks a missing passage
  const float* beam_scores;  // [B, W]
  const float* bias;         // [B*W, V] or null
  int64_t n;                 // candidates per question, 1 <= n <= W*V
  float* out_scores;         // [B, n]
  int64_t* out_beams;        // [B, n]
  int64_t* out_tokens;       // [B, n]
};

namespace RAG_FAST_VARIANT {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 512;

// logsumexp of one row: block maxima, then one exp per element against the running max.
template <typename Elem>
float row_lse(const Elem* row, int64_t V) {
  vfloat m = vsplat(kNegInf), s = vfloat{};
  const int64_t vec_end = V - V % kLanes;
  for (int64_t start = 0; start < vec_end; start += kBlock) {
    const int64_t stop = std::min(start + kBlock, vec_end);
    vfloat bm = vsplat(kNegInf);
    for (int64_t i = start; i < stop; i += kLanes) bm = vmax(bm, load(row + i));
    const vfloat nm = vmax(m, bm);
    const vfloat safe = nm == vsplat(kNegInf) ? vfloat{} : nm;  // all -inf so far: keep sum 0
    s = s * vexp_nonpos(m - safe);
    for (int64_t i = start; i < stop; i += kLanes) s += vexp_nonpos(load(row + i) - safe);
    m = nm;
  }
  float gm = kNegInf;
  for (int i = 0; i < kLanes; ++i) gm = std::max(gm, m[i]);
  for (int64_t i = vec_end; i < V; ++i) gm = std::max(gm, load1(row + i));
  if (gm == kNegInf) return kNegInf;
  if (std::isnan(gm)) return gm;
  double acc = 0.0;
  for (int i = 0; i < kLanes; ++i) {
    if (m[i] != kNegInf) acc += static_cast<double>(s[i]) * std::exp(double(m[i]) - gm);
  }
  for (int64_t i = vec_end; i < V; ++i) acc += std::exp(double(load1(row + i)) - gm);
  return gm + static_cast<float>(std::log(acc));
}

struct Candidate {
  float score;
  int64_t index;  // j * V + v
};

// Higher score first; equal scores: lower flat index first.
inline bool better(const Candidate& x, const Candidate& y) {
  return x.score > y.score || (x.score == y.score && x.index < y.index);
}

// A sorted list of at most `cap` candidates. Tokens arrive in increasing index order, so a
// new candidate that ties the last entry never displaces it.
struct TopList {
  Candidate* items;
  int64_t size, cap;
  bool full() const { return size == cap; }
  float threshold() const { return items[cap - 1].score; }
  void offer(float score, int64_t index) {
    if (score != score) return;  // NaN never enters
    if (size == cap) {
      if (!(score > items[cap - 1].score)) return;
      --size;
    }
    int64_t pos = size;
    while (pos > 0 && score > items[pos - 1].score) {
      items[pos] = items[pos - 1];
      --pos;
    }
    items[pos] = Candidate{score, index};
    ++size;
  }
};

template <typename Elem>
void beam_row(const BeamStepArgs& a, int64_t b, int64_t j, TopList& top) {
  const int64_t K = a.K, V = a.V;
  const char* base_ptr = static_cast<const char*>(a.logits);
  const int64_t elem = sizeof(Elem);
  // Active passages: finite prior and finite normaliser. c_k = a_k - L_k.
  std::vector<const Elem*> rows;
  std::vector<float> shift;
  rows.reserve(K);
  shift.reserve(K);
  for (int64_t k = 0; k < K; ++k) {
    const float prior = a.log_prior[b * K + k];
    if (!(prior > kNegInf)) continue;
    const Elem* row =
        reinterpret_cast<const Elem*>(base_ptr + (b * a.sb + j * a.sw + k * a.sk) * elem);
    const float lse = row_lse(row, V);
    if (!std::isfinite(lse)) continue;
    rows.push_back(row);
    shift.push_back(prior - lse);
  }
  const int64_t n_active = static_cast<int64_t>(rows.size());
  const float beam = a.beam_scores[b * a.W + j];
  const float* bias = a.bias ? a.bias + (b * a.W + j) * V : nullptr;
  const int64_t offset = j * V;
  // M <= max_k (c_k + x) + log(n_active); the slack covers the rounding of vexp and of the sums.
  const float log_k = n_active > 0 ? std::log(static_cast<float>(n_active)) + 1e-3f : 0.f;

  auto exact = [&](float mx, float sum, float bias_v) {
    const float m = mx == kNegInf ? kNegInf : mx + std::log(sum);
    return (m + bias_v) + beam;
  };
  auto margin = [&](float thr) { return 1e-5f * (std::fabs(thr) + std::fabs(beam)) + 1e-5f; };

  const int64_t vec_end = n_active > 0 ? V - V % kLanes : 0;
  for (int64_t v = 0; v < vec_end; v += kLanes) {
    vfloat mx = vsplat(kNegInf);
    for (int64_t k = 0; k < n_active; ++k) mx = vmax(mx, load(rows[k] + v) + vsplat(shift[k]));
    const vfloat bv = bias ? vload(bias + v) : vfloat{};
    if (top.full()) {
      const float thr = top.threshold();
      const vfloat ub = (mx + vsplat(log_k) + bv) + vsplat(beam + margin(thr));
      bool any = false;
      for (int i = 0; i < kLanes; ++i) any |= !(ub[i] < thr);
      if (!any) continue;
    }
    const vfloat safe = mx == vsplat(kNegInf) ? vfloat{} : mx;
    vfloat s = vfloat{};
    for (int64_t k = 0; k < n_active; ++k) {
      s += vexp_nonpos(load(rows[k] + v) + vsplat(shift[k]) - safe);
    }
    for (int i = 0; i < kLanes; ++i) top.offer(exact(mx[i], s[i], bv[i]), offset + v + i);
  }
  for (int64_t v = vec_end; v < V; ++v) {
    float mx = kNegInf;
    for (int64_t k = 0; k < n_active; ++k) mx = std::max(mx, load1(rows[k] + v) + shift[k]);
    const float bias_v = bias ? bias[v] : 0.f;
    if (top.full() && (mx + log_k + bias_v) + beam + margin(top.threshold()) < top.threshold()) {
      continue;
    }
    float s = 0.f;
    if (mx != kNegInf) {
      for (int64_t k = 0; k < n_active; ++k) s += std::exp(load1(rows[k] + v) + shift[k] - mx);
    }
    top.offer(exact(mx, s, bias_v), offset + v);
  }
}

template <typename Elem>
void beam_step_impl(const BeamStepArgs& a) {
  const int64_t rows = a.B * a.W;
  const int64_t cap = std::min(a.n, a.V);
  std::vector<Candidate> lists(static_cast<size_t>(rows * cap));
  std::vector<int64_t> sizes(static_cast<size_t>(rows));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < rows; ++r) {
    TopList top{lists.data() + r * cap, 0, cap};
    beam_row<Elem>(a, r / a.W, r % a.W, top);
    sizes[r] = top.size;
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < a.B; ++b) {
    std::vector<Candidate> merged;
    merged.reserve(static_cast<size_t>(a.W * cap));
    for (int64_t j = 0; j < a.W; ++j) {
      const Candidate* items = lists.data() + (b * a.W + j) * cap;
      merged.insert(merged.end(), items, items + sizes[b * a.W + j]);
    }
    const int64_t n = std::min<int64_t>(a.n, static_cast<int64_t>(merged.size()));
    std::partial_sort(merged.begin(), merged.begin() + n, merged.end(), better);
    for (int64_t i = 0; i < a.n; ++i) {
      // Fewer candidates than n only when every score was NaN: report those as NaN, in order.
      const Candidate c = i < n ? merged[i] : Candidate{std::numeric_limits<float>::quiet_NaN(), i};
      a.out_scores[b * a.n + i] = c.score;
      a.out_beams[b * a.n + i] = c.index / a.V;
      a.out_tokens[b * a.n + i] = c.index % a.V;
    }
  }
}

void beam_step(const BeamStepArgs& a) {
  if (a.dtype == DType::kFloat32) {
    beam_step_impl<float>(a);
  } else {
    beam_step_impl<uint16_t>(a);
  }
}

}  // namespace

RAG_FAST_KERNEL(rag_token_beam_step, BeamStepArgs, beam_step,
                "Fused RAG-Token beam step: top-n (score, beam, token) per question.");

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
