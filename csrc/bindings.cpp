// The pybind11 module rag_fast._C, from one table (the end of this file): a kernel is bound by
// one line naming it, where it lives and its documentation. Bindings only: argument checking
// lives in rag_fast/ops, the kernels in the other files of csrc/.
//
// Every argument arrives as a Python int: pointers as addresses (torch.Tensor.data_ptr()).
// A kernel that takes an Args struct (csrc/kernels.h, csrc/beam_step.h) takes its fields in
// declaration order, nested structs flattened (the LogitsView first); a plain function takes
// its own parameters. The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "beam_step.h"
#include "kernels.h"

namespace py = pybind11;
using namespace rag_fast;

namespace {

// One integer argument, converted to the field it initialises: a pointer (an address), an
// integer or the DType code. It converts to nothing else, so a nested struct (LogitsView) takes
// the next slots as its own fields (brace elision).
struct Slot {
  int64_t v;
  template <typename T>
  operator T*() const {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
  }
  operator int64_t() const { return v; }
  operator DType() const { return static_cast<DType>(v); }
};

// Whether Args can be initialised from N slots; its field count is the largest such N (more
// slots than fields do not compile), so every field gets an argument.
template <typename Args, typename Seq, typename = void>
struct Takes : std::false_type {};
template <typename Args, std::size_t... I>
struct Takes<Args, std::index_sequence<I...>,
             std::void_t<decltype(Args{(static_cast<void>(I), Slot{})...})>> : std::true_type {};

template <typename Args, std::size_t N = 1>
constexpr std::size_t field_count() {
  if constexpr (Takes<Args, std::make_index_sequence<N>>::value) {
    return field_count<Args, N + 1>();
  } else {
    return N - 1;
  }
}

template <std::size_t>
using Int = int64_t;

// A kernel of a variant table (KernelTable, BeamStepTable): void (*Table::*member)(const Args&),
// called on the table `table()` returns, with Args built from one argument per field.
template <typename Table, typename Args, std::size_t... I>
void bind_kernel(py::module_& m, const char* name, const Table& (*table)(),
                 void (*Table::*member)(const Args&), const char* doc,
                 std::index_sequence<I...>) {
  m.def(
      name,
      [table, member](Int<I>... v) {
        const Args args{Slot{v}...};
        py::gil_scoped_release release;
        (table().*member)(args);
      },
      doc);
}

template <typename Table, typename Args>
void bind(py::module_& m, const char* name, const Table& (*table)(),
          void (*Table::*member)(const Args&), const char* doc) {
  constexpr std::size_t n = field_count<Args>();
  static_assert(n > 0, "an Args struct of pointers, integers and DType codes");
  bind_kernel(m, name, table, member, doc, std::make_index_sequence<n>{});
}

// A plain function: pointer parameters arrive as addresses, the others as they are.
template <typename T>
struct FromPython {
  using type = T;
  static T get(T v) { return v; }
};
template <typename T>
struct FromPython<T*> {
  using type = uintptr_t;
  static T* get(uintptr_t v) { return reinterpret_cast<T*>(v); }
};

template <typename R, typename... P>
void bind(py::module_& m, const char* name, R (*fn)(P...), const char* doc) {
  m.def(
      name,
      [fn](typename FromPython<P>::type... v) -> R {
        py::gil_scoped_release release;
        return fn(FromPython<P>::get(v)...);
      },
      doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rag_fast CPU kernels (raw-buffer interface; use rag_fast.ops, not this module)";
  m.def("simd_level", []() { return std::string(kernels().name); },
        "Instruction-set variant chosen for this CPU: 'avx512', 'avx2' or 'generic'.");
  m.def("vector_bytes", []() { return kernels().vector_bytes; });
  m.def("num_threads", &num_threads, "Threads the kernels use (OpenMP).");
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.attr("INNER_PRODUCTS_PARALLEL_WORK") = kInnerProductsParallelWork;

  // ---- the kernels (see csrc/kernels.h and csrc/beam_step.h for what each computes) --------
  // RAG losses (csrc/rag_losses.cpp)
  bind(m, "row_stats", kernels, &KernelTable::row_stats,
       "Per-row logsumexp, target logit and sum of logits.");
  bind(m, "row_grad", kernels, &KernelTable::row_grad,
       "out = c_p * softmax(x) + c_y * onehot(y) + c_1, per row.");
  bind(m, "token_smooth_forward", kernels, &KernelTable::token_smooth_forward,
       "row_stats and token_smooth_stats in one read of the logits.");
  bind(m, "token_smooth_stats", kernels, &KernelTable::token_smooth_stats,
       "sum_v of the RAG-Token marginal M per (b, t), and rho = sum_v R per row.");
  bind(m, "token_smooth_grad", kernels, &KernelTable::token_smooth_grad,
       "out = c_p * P + c_y * onehot(y) + c_1 + c_r * R.");
  bind(m, "token_marginal", kernels, &KernelTable::token_marginal,
       "RAG-Token marginal log-probs M [B, T, V].");
  bind(m, "token_marginal_grad", kernels, &KernelTable::token_marginal_grad,
       "c = sum_v R * g and out = R * g - P * c, the marginal's backward.");
  // the RAG-Token beam step (csrc/beam_step.cpp)
  bind(m, "rag_token_beam_step", beam_step_kernels, &BeamStepTable::beam_step,
       "Fused RAG-Token beam step: top-n (score, beam, token) per question.");
  // inner products (csrc/inner_products.cpp)
  bind(m, "inner_products", kernels, &KernelTable::inner_products,
       "out[b, n] = q[b] . x[n], float32, each score by the same sequence of operations "
       "whatever the shapes.");
  // one-bit masks (csrc/masks.cpp)
  bind(m, "bits_mask", &bits_mask,
       "bit i % 8 of out[i / 8] = (src[i] == one) over n elements of elem_bytes bytes compared "
       "as bits; False if any element is neither 0 nor one.");
  bind(m, "bits_unmask", &bits_unmask,
       "out[i] = one (as bits) where bit i % 8 of bits[i / 8] is set, else 0.");
}
