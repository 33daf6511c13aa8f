// Picks the kernel variant for this CPU once, and owns the thread count.
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels.h"

#ifdef RAG_FAST_WITH_OPENMP
#include <omp.h>
#endif

namespace rag_fast {
namespace {

bool cpu_has(const char* feature) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  const std::string f(feature);
  if (f == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("fma");
  }
  if (f == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  (void)feature;
#endif
  return false;
}

const KernelTable& select() {
  // RAG_FAST_SIMD=generic|avx2|avx512 caps the variant (for testing every variant on one CPU).
  const char* cap_env = std::getenv("RAG_FAST_SIMD");
  const std::string cap = cap_env ? cap_env : "avx512";
#ifdef RAG_FAST_HAS_avx512
  if (cap == "avx512" && cpu_has("avx512")) return avx512::table();
#endif
#ifdef RAG_FAST_HAS_avx2
  if ((cap == "avx512" || cap == "avx2") && cpu_has("avx2")) return avx2::table();
#endif
  return generic::table();
}

}  // namespace

const KernelTable& kernels() {
  static const KernelTable& t = select();
  return t;
}

int num_threads() {
#ifdef RAG_FAST_WITH_OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void prefer_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only whole 2 MiB pages inside the buffer; a hint, so failure is ignored.
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) &
                        ~(kHuge - 1);
  if (bytes > 0 && end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

void set_num_threads(int n) {
#ifdef RAG_FAST_WITH_OPENMP
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

}  // namespace rag_fast
