// rag_fast CPU kernels: declarations shared by every instruction-set variant.
//
// The extension does not link libtorch. Each kernel takes raw pointers and element strides
// that the Python op layer (rag_fast/ops) has validated: shapes agree, the vocabulary axis is
// contiguous, targets are in [0, V) or equal to ignore_index, outputs are contiguous fp32.
// Nothing is validated twice here.
#pragma once

#include <cstdint>

namespace rag_fast {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

// Logits viewed as x[b, k, t, v] with element strides (sb, sk, st) and stride 1 along v.
struct LogitsView {
  const void* data;
  DType dtype;
  int64_t B, K, T, V;
  int64_t sb, sk, st;
};

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

// out[b, n] = q[b] . x[n] (float32, rows of length d at strides ldq, ldx, ldo), each score by
// the same sequence of operations whatever B, N and the pair's place (csrc/inner_products.cpp).
// Multiply-adds (B * N * d) below which inner_products runs on one thread: starting and joining
// the thread team costs more than such a product takes on one core (131 072 multiply-adds: one
// query against 341 vectors of 384). Above it even one query gains from the threads: the
// vectors stream through every core's cache (the measurement: docs/tuning.md). The scores are
// the same with any number of threads.
constexpr int64_t kInnerProductsParallelWork = int64_t{1} << 17;

struct InnerProductsArgs {
  const float* q;
  int64_t B, ldq;
  const float* x;
  int64_t N, ldx;
  int64_t d;
  float* out;
  int64_t ldo;
};

using RowStatsFn = void (*)(const RowStatsArgs&);
using RowGradFn = void (*)(const RowGradArgs&);
using TokenSmoothForwardFn = void (*)(const TokenSmoothForwardArgs&);
using TokenSmoothStatsFn = void (*)(const TokenSmoothStatsArgs&);
using TokenSmoothGradFn = void (*)(const TokenSmoothGradArgs&);
using TokenMarginalFn = void (*)(const TokenMarginalArgs&);
using TokenMarginalGradFn = void (*)(const TokenMarginalGradArgs&);
using InnerProductsFn = void (*)(const InnerProductsArgs&);

// One table of kernels per instruction-set variant (csrc/dispatch.cpp picks one).
struct KernelTable {
  const char* name;
  int vector_bytes;
  RowStatsFn row_stats;
  RowGradFn row_grad;
  TokenSmoothForwardFn token_smooth_forward;
  TokenSmoothStatsFn token_smooth_stats;
  TokenSmoothGradFn token_smooth_grad;
  TokenMarginalFn token_marginal;
  TokenMarginalGradFn token_marginal_grad;
  InnerProductsFn inner_products;
};

#define RAG_FAST_DECLARE_VARIANT(v)      \
  namespace v {                          \
  const KernelTable& table();            \
  InnerProductsFn inner_products_fn();   \
  }

RAG_FAST_DECLARE_VARIANT(generic)
RAG_FAST_DECLARE_VARIANT(avx2)
RAG_FAST_DECLARE_VARIANT(avx512)

// The table for the best variant this CPU supports (chosen once).
const KernelTable& kernels();
int num_threads();
void set_num_threads(int n);
// Asks the OS to back a large output buffer with 2 MiB pages before it is first written: a
// fresh gradient buffer otherwise costs one page fault per 4 KiB, which on some machines takes
// longer than computing the gradient. No effect on buffers already touched.
void prefer_huge_pages(void* data, int64_t bytes);
// The bit mask of a buffer whose elements (elem_bytes = 2, 4 or 8 bytes each, compared as
// bits) are all 0 or `one`: bit i % 8 of out[i / 8] is set where src[i] == one (out holds
// (n + 7) / 8 bytes). Returns false (out then partly written) if any element is neither. Used to
// store dropout masks saved for the backward in one bit per element (rag_fast/models/_lean.py).
bool bits_mask(const void* src, int elem_bytes, int64_t n, uint64_t one, uint8_t* out);
// The inverse: out[i] = one (as bits) where bit i % 8 of bits[i / 8] is set, else 0. False for
// an elem_bytes other than 2, 4 or 8.
bool bits_unmask(const uint8_t* bits, int elem_bytes, int64_t n, uint64_t one, void* out);

}  // namespace rag_fast
