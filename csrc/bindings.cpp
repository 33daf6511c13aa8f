// The pybind11 module rag_fast._C. Bindings only: argument checking lives in rag_fast/ops, the
// kernels in the other files of csrc/, each registered where it is defined (csrc/registry.h).
//
// Every argument arrives as a Python int: pointers as addresses (torch.Tensor.data_ptr()).
// A registered kernel takes the fields of its Args struct in declaration order, nested structs
// flattened (the LogitsView first), and runs the variant dispatch.cpp chose for this CPU; a
// plain function (the one-bit masks) takes its own parameters. The GIL is released while a
// kernel runs.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "registry.h"

namespace py = pybind11;
using namespace rag_fast;

namespace {

std::vector<KernelEntry>& entries() {  // constructed on first use: variants register early
  static std::vector<KernelEntry> all;
  return all;
}

// Binds every kernel registered by the variant `chosen`, as a function of one int per field.
void bind_registered(py::module_& m, const char* chosen) {
  std::size_t count = 0;
  const KernelEntry* all = registered_kernels(&count);
  std::vector<std::string> names;
  for (std::size_t i = 0; i < count; ++i) {
    const KernelEntry& e = all[i];
    if (std::find(names.begin(), names.end(), e.name) == names.end()) names.push_back(e.name);
    if (std::strcmp(e.variant, chosen) != 0) continue;
    m.def(
        e.name,
        [e](const py::args& args) {
          constexpr int kMaxArgs = 64;
          if (static_cast<int>(args.size()) != e.nargs || e.nargs > kMaxArgs) {
            throw py::type_error(std::string("rag_fast._C.") + e.name + " takes " +
                                 std::to_string(e.nargs) + " int arguments, got " +
                                 std::to_string(args.size()));
          }
          int64_t slots[kMaxArgs];
          for (int i = 0; i < e.nargs; ++i) slots[i] = args[i].cast<int64_t>();
          py::gil_scoped_release release;
          e.thunk(slots);
        },
        e.doc);
  }
  for (const std::string& name : names) {  // every variant defines every kernel
    if (!py::hasattr(m, name.c_str())) {
      throw std::runtime_error("rag_fast._C: kernel " + name + " has no " + chosen + " variant");
    }
  }
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

int rag_fast::register_kernel(const KernelEntry& entry) {
  entries().push_back(entry);
  return 0;
}

const KernelEntry* rag_fast::registered_kernels(std::size_t* count) {
  *count = entries().size();
  return entries().data();
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "rag_fast CPU kernels (raw-buffer interface; use rag_fast.ops, not this module)";
  m.def("simd_level", []() { return std::string(kernels().name); },
        "Instruction-set variant chosen for this CPU: 'avx512', 'avx2' or 'generic'.");
  m.def("vector_bytes", []() { return kernels().vector_bytes; });
  m.def("num_threads", &num_threads, "Threads the kernels use (OpenMP).");
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.attr("INNER_PRODUCTS_PARALLEL_WORK") = kInnerProductsParallelWork;

  // ---- the kernels: every RAG_FAST_KERNEL of the op families' files (csrc/registry.h) ----
  bind_registered(m, kernels().name);
  // one-bit masks (csrc/masks.cpp)
  bind(m, "bits_mask", &bits_mask,
       "bit i % 8 of out[i / 8] = (src[i] == one) over n elements of elem_bytes bytes compared "
       "as bits; False if any element is neither 0 nor one.");
  bind(m, "bits_unmask", &bits_unmask,
       "out[i] = one (as bits) where bit i % 8 of bits[i / 8] is set, else 0.");
}
