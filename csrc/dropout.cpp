// torch's CPU dropout masks, drawn as torch draws them (see kernels.h, DropoutBitsFn):
// compiled once per instruction set.
//
// torch's CPU dropout draws its mask with bernoulli_(keep) on a float tensor. Its kernel runs
// serially over the elements and, per element, takes a double u from the generator's mt19937
// (two 32-bit words: the first word's low 21 bits above the second word, times 2^-53) and
// keeps the element iff u < keep. That serial loop costs about 6 ns per element; this file
// draws the same words in blocks (the mt19937 state update and its output tempering are loops
// the compiler vectorises), compares them as integers (u < keep exactly when the 53-bit
// integer is below ceil(keep * 2^53)) and writes one bit per element.
#include <cstdint>

#include "kernels.h"

#ifndef RAG_FAST_VARIANT
#error "RAG_FAST_VARIANT must name the instruction-set variant"
#endif

namespace rag_fast {
namespace RAG_FAST_VARIANT {
namespace {

#if defined(__GNUC__)
#define RAG_FAST_INLINE inline __attribute__((always_inline))
#else
#define RAG_FAST_INLINE inline
#endif

constexpr int kStateWords = kMtStateWords;
constexpr int kShift = 397;

RAG_FAST_INLINE uint32_t twist(uint32_t u, uint32_t v) {
  const uint32_t mixed = (u & 0x80000000u) | (v & 0x7fffffffu);
  return (mixed >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

// The next 624 state words, in place (the generator's own order of updates).
RAG_FAST_INLINE void next_state(uint32_t* s) {
  for (int i = 0; i < kStateWords - kShift; ++i) s[i] = s[i + kShift] ^ twist(s[i], s[i + 1]);
  for (int i = kStateWords - kShift; i < kStateWords - 1; ++i)
    s[i] = s[i + kShift - kStateWords] ^ twist(s[i], s[i + 1]);
  s[kStateWords - 1] = s[kShift - 1] ^ twist(s[kStateWords - 1], s[0]);
}

RAG_FAST_INLINE uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

// The next `count` output words of the generator into `out`. As torch keeps it, `left - 1`
// words of the state from `next` on are still to be output; when none is left, the next word
// first renews the whole state.
RAG_FAST_INLINE void words(MtState& e, uint32_t* out, int64_t count) {
  while (count > 0) {
    if (e.left <= 1) {
      next_state(e.words);
      e.left = kStateWords + 1;
      e.next = 0;
    }
    int64_t take = e.left - 1;
    if (take > count) take = count;
    const uint32_t* src = e.words + e.next;
    for (int64_t i = 0; i < take; ++i) out[i] = temper(src[i]);
    out += take;
    count -= take;
    e.next += take;
    e.left -= take;
  }
}

void dropout_bits(MtState& e, int64_t n, uint64_t threshold, uint8_t* bits) {
  // k < threshold for k = (hi << 32) | lo (hi < 2^21), in 32-bit halves
  const uint32_t t_hi = static_cast<uint32_t>(threshold >> 32);
  const uint32_t t_lo = static_cast<uint32_t>(threshold);
  constexpr int64_t kBatch = 512;  // elements per batch: 1024 words, 64 bytes of bits
  uint32_t w[2 * kBatch];
  uint8_t keep[kBatch];
  for (int64_t begin = 0; begin < n; begin += kBatch) {
    const int64_t m = n - begin < kBatch ? n - begin : kBatch;
    words(e, w, 2 * m);
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t hi = w[2 * i] & 0x1fffffu, lo = w[2 * i + 1];
      keep[i] = static_cast<uint8_t>((hi < t_hi) | ((hi == t_hi) & (lo < t_lo)));
    }
    for (int64_t i = 0; i < m; i += 8) {
      unsigned byte = 0;
      const int64_t stop = m - i < 8 ? m - i : 8;  // 8 but in the last byte of the tensor
      for (int64_t j = 0; j < stop; ++j) byte |= static_cast<unsigned>(keep[i + j]) << j;
      bits[(begin + i) / 8] = static_cast<uint8_t>(byte);
    }
  }
}

}  // namespace

DropoutBitsFn dropout_bits_fn() { return &dropout_bits; }

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
