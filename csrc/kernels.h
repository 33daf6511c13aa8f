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
//   lse[r]   = logsumexp_v x[b,k,t,v]
//   x_tgt[r] = x[b,k,t,y[b,t]]   (0 where y[b,t] == ignore_index)
//   x_sum[r] = sum_v x[b,k,t,v]
// targets: int64 [B, T] contiguous, or null (then x_tgt is all 0). Outputs: float32 [B*K*T].
struct RowStatsArgs {
  LogitsView x;
  const int64_t* targets;
  int64_t ignore_index;
  float* lse;
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
  const float* lse;
  const float* c_p;
  const float* c_y;
  const float* c_1;
  void* out;
  int64_t ob, ok, ot;
};

using RowStatsFn = void (*)(const RowStatsArgs&);
using RowGradFn = void (*)(const RowGradArgs&);

// One table of kernels per instruction-set variant (csrc/dispatch.cpp picks one).
struct KernelTable {
  const char* name;
  int vector_bytes;
  RowStatsFn row_stats;
  RowGradFn row_grad;
};

#define RAG_FAST_DECLARE_VARIANT(v) \
  namespace v {                     \
  const KernelTable& table();       \
  }

RAG_FAST_DECLARE_VARIANT(generic)
RAG_FAST_DECLARE_VARIANT(avx2)
RAG_FAST_DECLARE_VARIANT(avx512)

// The table for the best variant this CPU supports (chosen once).
const KernelTable& kernels();
int num_threads();
void set_num_threads(int n);

}  // namespace rag_fast
