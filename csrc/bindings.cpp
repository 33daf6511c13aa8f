// The pybind11 module rag_fast._C. Bindings only: argument checking lives in rag_fast/ops,
// the kernels in kernels.cpp. Pointers arrive as integers (torch.Tensor.data_ptr()).
#include <pybind11/pybind11.h>

#include "beam_step.h"
#include "kernels.h"

namespace py = pybind11;
using namespace rag_fast;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

LogitsView logits_view(uintptr_t data, int dtype, int64_t B, int64_t K, int64_t T, int64_t V,
                       int64_t sb, int64_t sk, int64_t st) {
  return LogitsView{ptr<const void>(data), static_cast<DType>(dtype), B, K, T, V, sb, sk, st};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rag_fast CPU kernels (raw-buffer interface; use rag_fast.ops, not this module)";
  m.def("simd_level", []() { return std::string(kernels().name); },
        "Instruction-set variant chosen for this CPU: 'avx512', 'avx2' or 'generic'.");
  m.def("vector_bytes", []() { return kernels().vector_bytes; });
  m.def("num_threads", &num_threads, "Threads the kernels use (OpenMP).");
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def(
      "bits_mask",
      [](uintptr_t src, int elem_bytes, int64_t n, uint64_t one, uintptr_t out) {
        py::gil_scoped_release release;
        return bits_mask(ptr<const void>(src), elem_bytes, n, one, ptr<uint8_t>(out));
      },
      "bit i % 8 of out[i / 8] = (src[i] == one) over n elements of elem_bytes bytes compared as "
      "bits; False if any element is neither 0 nor one (see csrc/kernels.h).");
  m.def(
      "bits_unmask",
      [](uintptr_t bits, int elem_bytes, int64_t n, uint64_t one, uintptr_t out) {
        py::gil_scoped_release release;
        return bits_unmask(ptr<const uint8_t>(bits), elem_bytes, n, one, ptr<void>(out));
      },
      "out[i] = one (as bits) where bit i % 8 of bits[i / 8] is set, else 0 (see csrc/kernels.h).");
  m.def(
      "dropout_keep_bits",
      [](uintptr_t state, int64_t state_bytes, int64_t n, uint64_t threshold, uintptr_t bits) {
        py::gil_scoped_release release;
        return dropout_keep_bits(ptr<uint8_t>(state), state_bytes, n, threshold,
                                 ptr<uint8_t>(bits));
      },
      "torch's CPU dropout mask as bits, drawn from and advancing a generator state (see "
      "csrc/kernels.h).");
  m.def(
      "masked_scale",
      [](uintptr_t src, uintptr_t bits, int64_t n, float scale, uintptr_t out) {
        py::gil_scoped_release release;
        masked_scale(ptr<const float>(src), ptr<const uint8_t>(bits), n, scale, ptr<float>(out));
      },
      "out[i] = src[i] * (bit i set ? scale : 0), float32 (see csrc/kernels.h).");
  m.def(
      "inner_products",
      [](uintptr_t q, int64_t B, int64_t ldq, uintptr_t x, int64_t N, int64_t ldx, int64_t d,
         uintptr_t out, int64_t ldo) {
        InnerProductsArgs a{ptr<const float>(q), B, ldq, ptr<const float>(x), N, ldx, d,
                            ptr<float>(out), ldo};
        py::gil_scoped_release release;
        kernels().inner_products(a);
      },
      "out[b, n] = q[b] . x[n], float32, each score by the same sequence of operations whatever "
      "the shapes (see csrc/kernels.h).");
  m.attr("INNER_PRODUCTS_PARALLEL_WORK") = kInnerProductsParallelWork;
  m.def(
      "row_stats",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t targets, int64_t ignore_index, uintptr_t lse,
         uintptr_t x_tgt, uintptr_t x_sum) {
        RowStatsArgs a{logits_view(x, dtype, B, K, T, V, sb, sk, st), ptr<const int64_t>(targets),
                       ignore_index, ptr<double>(lse), ptr<float>(x_tgt), ptr<float>(x_sum)};
        py::gil_scoped_release release;
        kernels().row_stats(a);
      },
      "Per-row logsumexp, target logit and sum of logits (see csrc/kernels.h).");
  m.def(
      "row_grad",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t targets, int64_t ignore_index, uintptr_t lse,
         uintptr_t c_p, uintptr_t c_y, uintptr_t c_1, uintptr_t out, int64_t ob, int64_t ok,
         int64_t ot) {
        RowGradArgs a{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                      ptr<const int64_t>(targets),
                      ignore_index,
                      ptr<const double>(lse),
                      ptr<const float>(c_p),
                      ptr<const float>(c_y),
                      ptr<const float>(c_1),
                      ptr<void>(out),
                      ob,
                      ok,
                      ot};
        py::gil_scoped_release release;
        kernels().row_grad(a);
      },
      "out = c_p * softmax(x) + c_y * onehot(y) + c_1, per row (see csrc/kernels.h).");
  m.def(
      "token_smooth_forward",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t targets, int64_t ignore_index, uintptr_t a,
         uintptr_t lse, uintptr_t x_tgt, uintptr_t x_sum, uintptr_t sum_m, uintptr_t rho) {
        TokenSmoothForwardArgs args{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                                    ptr<const int64_t>(targets),
                                    ignore_index,
                                    ptr<const float>(a),
                                    ptr<double>(lse),
                                    ptr<float>(x_tgt),
                                    ptr<float>(x_sum),
                                    ptr<float>(sum_m),
                                    ptr<float>(rho)};
        py::gil_scoped_release release;
        kernels().token_smooth_forward(args);
      },
      "row_stats and token_smooth_stats in one read of the logits (see csrc/kernels.h).");
  m.def(
      "token_smooth_stats",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t a, uintptr_t lse, uintptr_t sum_m, uintptr_t rho) {
        TokenSmoothStatsArgs args{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                                  ptr<const float>(a), ptr<const double>(lse), ptr<float>(sum_m),
                                  ptr<float>(rho)};
        py::gil_scoped_release release;
        kernels().token_smooth_stats(args);
      },
      "sum_v of the RAG-Token marginal M per (b, t), and rho = sum_v R per row.");
  m.def(
      "token_smooth_grad",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t targets, int64_t ignore_index, uintptr_t a,
         uintptr_t lse, uintptr_t c_p, uintptr_t c_y, uintptr_t c_1, uintptr_t c_r,
         uintptr_t out, int64_t ob, int64_t ok, int64_t ot) {
        TokenSmoothGradArgs args{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                                 ptr<const int64_t>(targets),
                                 ignore_index,
                                 ptr<const float>(a),
                                 ptr<const double>(lse),
                                 ptr<const float>(c_p),
                                 ptr<const float>(c_y),
                                 ptr<const float>(c_1),
                                 ptr<const float>(c_r),
                                 ptr<void>(out),
                                 ob,
                                 ok,
                                 ot};
        py::gil_scoped_release release;
        kernels().token_smooth_grad(args);
      },
      "out = c_p * P + c_y * onehot(y) + c_1 + c_r * R (see csrc/kernels.h).");
  m.def(
      "token_marginal",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t a, uintptr_t lse, uintptr_t marginal) {
        TokenMarginalArgs args{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                               ptr<const float>(a), ptr<const double>(lse),
                               ptr<float>(marginal)};
        py::gil_scoped_release release;
        kernels().token_marginal(args);
      },
      "RAG-Token marginal log-probs M [B, T, V] (see csrc/kernels.h).");
  m.def(
      "token_marginal_grad",
      [](uintptr_t x, int dtype, int64_t B, int64_t K, int64_t T, int64_t V, int64_t sb,
         int64_t sk, int64_t st, uintptr_t a, uintptr_t lse, uintptr_t marginal,
         uintptr_t grad_marginal, uintptr_t c, uintptr_t out, int64_t ob, int64_t ok,
         int64_t ot) {
        TokenMarginalGradArgs args{logits_view(x, dtype, B, K, T, V, sb, sk, st),
                                   ptr<const float>(a),
                                   ptr<const double>(lse),
                                   ptr<const float>(marginal),
                                   ptr<const float>(grad_marginal),
                                   ptr<float>(c),
                                   ptr<void>(out),
                                   ob,
                                   ok,
                                   ot};
        py::gil_scoped_release release;
        kernels().token_marginal_grad(args);
      },
      "c = sum_v R * g and out = R * g - P * c, the marginal's backward (see csrc/kernels.h).");
  m.def(
      "rag_token_beam_step",
      [](uintptr_t x, int dtype, int64_t B, int64_t W, int64_t K, int64_t V, int64_t sb,
         int64_t sw, int64_t sk, uintptr_t log_prior, uintptr_t beam_scores, uintptr_t bias,
         int64_t n, uintptr_t out_scores, uintptr_t out_beams, uintptr_t out_tokens) {
        BeamStepArgs a{ptr<const void>(x),         static_cast<DType>(dtype),
                       B, W, K, V, sb, sw, sk,
                       ptr<const float>(log_prior), ptr<const float>(beam_scores),
                       ptr<const float>(bias),      n,
                       ptr<float>(out_scores),      ptr<int64_t>(out_beams),
                       ptr<int64_t>(out_tokens)};
        py::gil_scoped_release release;
        beam_step_kernels().beam_step(a);
      },
      "Fused RAG-Token beam step: top-n (score, beam, token) per question (see csrc/beam_step.h).");
}
