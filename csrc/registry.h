// The kernels the module binds, registered by the file that defines them: one line per kernel,
//
//   RAG_FAST_KERNEL(row_stats, RowStatsArgs, row_stats, "Per-row logsumexp, ...");
//
// in the file's variant namespace (the file is compiled once per instruction set, see
// CMakeLists.txt). csrc/bindings.cpp binds every registered name once, as a function of one
// Python int per field of its Args struct (pointers as addresses, nested structs flattened in
// declaration order), and calls the variant dispatch.cpp chose for this CPU. Adding a kernel
// to an op family therefore touches that family's file only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels.h"

namespace rag_fast {

// A kernel called with its arguments, one int64 per field of its Args struct.
using KernelThunk = void (*)(const int64_t* slots);

struct KernelEntry {
  const char* name;     // the Python name: rag_fast._C.<name>
  const char* variant;  // "generic", "avx2" or "avx512"
  const char* doc;
  int nargs;
  KernelThunk thunk;
};

// Records an entry (called while the module's objects are initialised); returns 0.
int register_kernel(const KernelEntry& entry);
// The entries recorded, in the order of registration; *count receives their number.
const KernelEntry* registered_kernels(std::size_t* count);

namespace registry_detail {

// One integer argument, converted to the field it initialises: a pointer (an address), an
// integer or the DType code. It converts to nothing else, so a nested struct (LogitsView)
// takes the next slots as its own fields (brace elision).
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

template <typename Args, void (*F)(const Args&), std::size_t... I>
void call(const int64_t* slots, std::index_sequence<I...>) {
  const Args args{Slot{slots[I]}...};
  F(args);
}

template <typename Args, void (*F)(const Args&)>
void thunk(const int64_t* slots) {
  constexpr std::size_t n = field_count<Args>();
  static_assert(n > 0, "an Args struct of pointers, integers and DType codes");
  call<Args, F>(slots, std::make_index_sequence<n>{});
}

}  // namespace registry_detail
}  // namespace rag_fast

#define RAG_FAST_REGISTRY_STR2(x) #x
#define RAG_FAST_REGISTRY_STR(x) RAG_FAST_REGISTRY_STR2(x)

// Registers kernel `fn` (void fn(const Args&)) of this variant as rag_fast._C.<name>.
#define RAG_FAST_KERNEL(name, Args, fn, doc)                                            \
  [[maybe_unused]] static const int rag_fast_registered_##name = ::rag_fast::register_kernel( \
      {#name, RAG_FAST_REGISTRY_STR(RAG_FAST_VARIANT), doc,                              \
       static_cast<int>(::rag_fast::registry_detail::field_count<Args>()),              \
       &::rag_fast::registry_detail::thunk<Args, fn>})
