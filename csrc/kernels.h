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

// Multiply-adds (B * N * d) below which inner_products (csrc/inner_products.cpp) runs on one
// thread: starting and joining the thread team costs more than such a product takes on one core
// (131 072 multiply-adds: one query against 341 vectors of 384). Above it even one query gains from the threads: the
// vectors stream through every core's cache (the measurement: docs/tuning.md). The scores are
// the same with any number of threads.
constexpr int64_t kInnerProductsParallelWork = int64_t{1} << 17;

// What identifies a kernel variant (one per instruction set; csrc/dispatch.cpp picks one). The
// kernels themselves are registered by the files that define them (csrc/registry.h).
struct KernelTable {
  const char* name;
  int vector_bytes;
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
