// One-bit masks (rag_fast/ops/masks.py): a tensor of zeros and one value as bits, and back.
// Compiled once (no variant: the compiler vectorises the comparisons for the baseline ISA).
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace rag_fast {

namespace {

// Bit i % 8 of out[i / 8] = (src[i] == one); false if any element is neither 0 nor one. Eight
// elements per output byte, branch-free so that the compiler vectorises the comparisons; chunks
// of 64 Ki elements (whole bytes) per thread.
template <typename U>
bool bits_mask_impl(const U* src, int64_t n, U one, uint8_t* out) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  int bad = 0;
#ifdef RAG_FAST_WITH_OPENMP
#pragma omp parallel for schedule(static) reduction(| : bad) if (chunks > 1)
#endif
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    const int64_t whole = begin + (end - begin) / 8 * 8;
    int local = 0;
    for (int64_t i = begin; i < whole; i += 8) {
      unsigned byte = 0;
      for (int j = 0; j < 8; ++j) {
        const U v = src[i + j];
        byte |= static_cast<unsigned>(v == one) << j;
        local |= static_cast<int>((v != 0) & (v != one));
      }
      out[i / 8] = static_cast<uint8_t>(byte);
    }
    if (whole < end) {  // the last, partial byte (n % 8 elements)
      unsigned byte = 0;
      for (int64_t i = whole; i < end; ++i) {
        const U v = src[i];
        byte |= static_cast<unsigned>(v == one) << (i - whole);
        local |= static_cast<int>((v != 0) & (v != one));
      }
      out[whole / 8] = static_cast<uint8_t>(byte);
    }
    bad |= local;
  }
  return bad == 0;
}

// Walks n elements by the bytes of `bits` (bit i % 8 of bits[i / 8] for element i) in chunks of
// 64 Ki elements (whole bytes) per thread, with a 256-entry table of eight values per byte
// (`one` where the bit is set, else 0; 8 KiB for 4-byte elements): eight(i, row) for each full
// byte, from element i, and single(i, value) for each element of a last, partial byte.
template <typename U, typename Eight, typename Single>
void by_bit_table(const uint8_t* bits, int64_t n, U one, Eight eight, Single single) {
  U table[256][8];
  for (int b = 0; b < 256; ++b)
    for (int j = 0; j < 8; ++j) table[b][j] = ((b >> j) & 1) ? one : static_cast<U>(0);
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#ifdef RAG_FAST_WITH_OPENMP
#pragma omp parallel for schedule(static) if (chunks > 1)
#endif
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    const int64_t whole = begin + (end - begin) / 8 * 8;
    for (int64_t i = begin; i < whole; i += 8) eight(i, table[bits[i >> 3]]);
    for (int64_t i = whole; i < end; ++i) single(i, table[bits[i >> 3]][i & 7]);
  }
}

// out[i] = one where bit i % 8 of bits[i / 8] is set, else 0 (the inverse of bits_mask_impl).
template <typename U>
void bits_unmask_impl(const uint8_t* bits, int64_t n, U one, U* out) {
  by_bit_table(
      bits, n, one, [out](int64_t i, const U* row) { std::memcpy(out + i, row, 8 * sizeof(U)); },
      [out](int64_t i, U v) { out[i] = v; });
}

}  // namespace

bool bits_mask(const void* src, int elem_bytes, int64_t n, uint64_t one, uint8_t* out) {
  switch (elem_bytes) {
    case 2:
      return bits_mask_impl(static_cast<const uint16_t*>(src), n, static_cast<uint16_t>(one), out);
    case 4:
      return bits_mask_impl(static_cast<const uint32_t*>(src), n, static_cast<uint32_t>(one), out);
    case 8:
      return bits_mask_impl(static_cast<const uint64_t*>(src), n, one, out);
    default:
      return false;
  }
}

bool bits_unmask(const uint8_t* bits, int elem_bytes, int64_t n, uint64_t one, void* out) {
  switch (elem_bytes) {
    case 2:
      bits_unmask_impl(bits, n, static_cast<uint16_t>(one), static_cast<uint16_t*>(out));
      return true;
    case 4:
      bits_unmask_impl(bits, n, static_cast<uint32_t>(one), static_cast<uint32_t*>(out));
      return true;
    case 8:
      bits_unmask_impl(bits, n, one, static_cast<uint64_t*>(out));
      return true;
    default:
      return false;
  }
}

}  // namespace rag_fast
