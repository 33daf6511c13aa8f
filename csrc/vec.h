// Portable SIMD through GCC/Clang vector extensions: the same source is compiled once per
// instruction set (see CMakeLists.txt), and the compiler lowers these types to SSE, AVX2,
// AVX-512 or NEON registers. Includes our own exp (for arguments <= 0, about 2 ulp), log and reciprocal.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#ifndef RAG_FAST_VARIANT
#error "vec.h is compiled once per instruction-set variant: define RAG_FAST_VARIANT"
#endif

// Everything here lives in the variant's namespace: the vector width differs per variant, so
// one shared name (e.g. vsplat(float)) would otherwise have a different body in each object.
namespace rag_fast {
namespace RAG_FAST_VARIANT {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__) || defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));

inline vfloat vsplat(float x) { return vfloat{} + x; }

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// bf16 <-> fp32: bf16 is the upper half of an fp32.
inline vfloat vload_bf16(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  vuint u = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// Round to nearest even; NaN stays NaN (quiet bit forced).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void vstore_bf16(uint16_t* p, vfloat v) {
  vuint u;
  std::memcpy(&u, &v, sizeof(u));
  vint nan = (u & 0x7fffffffu) > 0x7f800000u;
  vuint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  vuint quiet = (u >> 16) | 0x40u;
  vuint out = nan ? quiet : rounded;
  vhalf h = __builtin_convertvector(out, vhalf);
  std::memcpy(p, &h, sizeof(h));
}

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

inline float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline float hsum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}


// exp(x) for x <= 0, the only arguments the kernels pass (x - max, x - lse, and sums like them
// that exceed 0 by a rounding error at most): x = n*ln2 + r, |r| <= ln2/2, a degree-6
// polynomial for exp(r) (about 2 ulp), and 2^n read from the low bits of the rounding constant,
// which carries the exponent bias. Inputs are clamped below at -88, where n = -127 makes the
// scale exactly 0: exp(-inf) == 0 and no subnormal intermediates (a microcode assist per
// vector on x86). NaN gives NaN. No overflow handling: x above ~88 is out of contract.
inline vfloat vexp_nonpos(vfloat x) {
  const vfloat lo = vsplat(-88.0f);
  const vfloat xc = x < lo ? lo : x;  // NaN stays NaN
  const vfloat magic = vsplat(12583039.0f);  // 1.5 * 2^23 + 127
  const vfloat t = xc * vsplat(1.44269504088896341f) + magic;
  const vfloat n = t - magic;  // round(x / ln 2), exactly
  vfloat r = xc - n * vsplat(0.693359375f);
  r = r - n * vsplat(-2.12194440e-4f);
  vfloat p = vsplat(1.3981999507e-3f);
  p = p * r + vsplat(8.3334519073e-3f);
  p = p * r + vsplat(4.1665795894e-2f);
  p = p * r + vsplat(1.6666665459e-1f);
  p = p * r + vsplat(5.0000001201e-1f);
  p = p * r * r + r + vsplat(1.0f);
  vint ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const vint scale_bits = ti << 23;  // (n + 127) << 23: the mantissa's high bit shifts out
  vfloat scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// True when any lane of the comparison mask is set.
inline bool any_lane(vint m) {
#if defined(__AVX__)
  if constexpr (kLanes == 8) {
    __m256i mi;
    std::memcpy(&mi, &m, sizeof(mi));
    return !_mm256_testz_si256(mi, mi);
  }
#endif
  int32_t acc = 0;
  for (int i = 0; i < kLanes; ++i) acc |= m[i];
  return acc != 0;
}

// Flushes subnormal results and operands to zero on this thread while in scope (x86 MXCSR
// FTZ|DAZ; restored on exit). The token kernels multiply many tiny probabilities; subnormals
// there cost a microcode assist per vector and carry no precision worth keeping (the marginal
// switches to a max-shifted sum long before).
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// 1 / x for positive normal x: the hardware estimate (12 or 14 bits) and one Newton step,
// within about 2 ulp; a division where there is no estimate instruction.
inline vfloat vrecip(vfloat x) {
  vfloat r;
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    r = reinterpret_cast<vfloat>(_mm512_rcp14_ps(reinterpret_cast<__m512>(x)));
  }
#elif defined(__AVX__)
  if constexpr (kLanes == 8) {
    r = reinterpret_cast<vfloat>(_mm256_rcp_ps(reinterpret_cast<__m256>(x)));
  }
#elif defined(__SSE__)
  if constexpr (kLanes == 4) {
    r = reinterpret_cast<vfloat>(_mm_rcp_ps(reinterpret_cast<__m128>(x)));
  }
#else
  return vsplat(1.0f) / x;
#endif
  return r + r * (vsplat(1.0f) - x * r);
}

// log(x): x = 2^e * f with f in [sqrt(1/2), sqrt(2)), then log(f) = 2 atanh(u), u = (f-1)/(f+1),
// |u| <= 0.1716, by its odd series up to u^9 (truncation below 1e-9). log(0) = -inf,
// log(x < 0) = NaN, log(inf) = inf, NaN gives NaN; subnormal inputs are rescaled first.
inline vfloat vlog(vfloat x) {
  const vfloat tiny = vsplat(std::numeric_limits<float>::min());
  vint sub = x < tiny;
  vfloat xs = sub ? x * vsplat(8388608.0f) : x;  // 2^23
  vint bits;
  std::memcpy(&bits, &xs, sizeof(bits));
  vint e = ((bits >> 23) & 0xff) - 127;
  e = sub ? e - 23 : e;
  vint fbits = (bits & 0x007fffff) | 0x3f800000;
  vfloat f;
  std::memcpy(&f, &fbits, sizeof(f));
  vint big = f > vsplat(1.41421356237f);
  f = big ? f * vsplat(0.5f) : f;
  e = e - big;  // a true comparison is -1
  vfloat u = (f - vsplat(1.0f)) * vrecip(f + vsplat(1.0f));
  vfloat u2 = u * u;
  vfloat p = vsplat(1.0f / 9.0f);
  p = p * u2 + vsplat(1.0f / 7.0f);
  p = p * u2 + vsplat(1.0f / 5.0f);
  p = p * u2 + vsplat(1.0f / 3.0f);
  p = p * u2 + vsplat(1.0f);
  vfloat ef = __builtin_convertvector(e, vfloat);
  vfloat y = ef * vsplat(0.693359375f) + (ef * vsplat(-2.12194440e-4f) + vsplat(2.0f) * u * p);
  const vfloat inf = vsplat(std::numeric_limits<float>::infinity());
  y = x == vfloat{} ? -inf : y;
  y = x < vfloat{} ? vsplat(std::numeric_limits<float>::quiet_NaN()) : y;
  y = x == inf ? inf : y;
  return x != x ? x : y;
}

// Loads of fp32 or bf16 logits (Elem = float or uint16_t), widened to fp32.
template <typename Elem>
inline vfloat load(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return vload(reinterpret_cast<const float*>(p));
  } else {
    return vload_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}
template <typename Elem>
inline float load1(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return *reinterpret_cast<const float*>(p);
  } else {
    return bf16_to_float(*reinterpret_cast<const uint16_t*>(p));
  }
}

}  // namespace RAG_FAST_VARIANT
}  // namespace rag_fast
