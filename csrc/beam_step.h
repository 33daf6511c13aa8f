// The fused RAG-Token beam step (see rag_fast/ops/rag_token_beam_step.py for the op).
//
// For question b, beam j, passage k and token v, with the row normaliser
// L[b,j,k] = logsumexp_v x[b,j,k,v]:
//   M[b,j,v] = logsumexp_k (a[b,k] + x[b,j,k,v] - L[b,j,k])      marginal log-probs
//   c[b,j,v] = (M[b,j,v] + bias[b*W+j, v]) + beam_score[b,j]     candidate score
// and the output is the n best (j, v) per question, sorted by score descending, ties broken by
// the lower flat index j*V + v first. Reads the logits twice (normalisers, then the marginal
// with a running top-n per beam), never materializes M or c.
//
// Like kernels.h, nothing is validated here: the Python op checked shapes, dtypes, strides
// (stride 1 along v), n <= W*V, and made log_prior, beam_scores, bias and outputs contiguous.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

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

using BeamStepFn = void (*)(const BeamStepArgs&);

struct BeamStepTable {
  const char* name;
  BeamStepFn beam_step;
};

#define RAG_FAST_DECLARE_BEAM_STEP_VARIANT(v) \
  namespace v {                               \
  const BeamStepTable& beam_step_table();     \
  }

RAG_FAST_DECLARE_BEAM_STEP_VARIANT(generic)
RAG_FAST_DECLARE_BEAM_STEP_VARIANT(avx2)
RAG_FAST_DECLARE_BEAM_STEP_VARIANT(avx512)

// The beam-step table of the variant kernels() chose. Compiled into the module itself (it
// needs the RAG_FAST_HAS_* definitions of the _C target), so include this header only there.
inline const BeamStepTable& beam_step_kernels() {
  const char* name = kernels().name;
#ifdef RAG_FAST_HAS_avx512
  if (std::strcmp(name, "avx512") == 0) return avx512::beam_step_table();
#endif
#ifdef RAG_FAST_HAS_avx2
  if (std::strcmp(name, "avx2") == 0) return avx2::beam_step_table();
#endif
  (void)name;
  return generic::beam_step_table();
}

}  // namespace rag_fast
