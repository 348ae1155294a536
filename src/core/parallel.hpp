// Thread-parallel loops for the CPU backend. Work is split into fixed chunks that do not depend
// on the thread count, and every output element is produced by exactly one chunk in a fixed
// order, so results are bitwise independent of how many threads run.
#pragma once

#include <cstdint>

#include "moeblaze/error.hpp"
#include "moeblaze/layer.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace moeblaze {

// A caller's thread count (`name` as the caller spells it): 0 = all hardware threads, or
// 1..kMaxThreads. Checked before any ThreadCountScope takes it.
inline void require_thread_count(int64_t n, const char* name) {
  MOEBLAZE_REQUIRE(n >= 0 && n <= kMaxThreads, name, " (", n, ") must be in [0, ", kMaxThreads,
                   "] (0 = all hardware threads)");
}

// Threads used by parallel_for in the calling thread's scope (0 = all hardware threads).
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int n) {
#ifdef _OPENMP
    saved_ = omp_get_max_threads();
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~ThreadCountScope() {
#ifdef _OPENMP
    omp_set_num_threads(saved_);
#endif
  }
 private:
  int saved_ = 1;
};

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Calls fn(i) for i in [begin, end), dynamically scheduled in chunks of `grain`.
template <typename Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  if (end <= begin) return;
  if (grain < 1) grain = 1;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = begin; c < end; c += grain) {
    const int64_t stop = c + grain < end ? c + grain : end;
    for (int64_t i = c; i < stop; ++i) fn(i);
  }
#else
  for (int64_t i = begin; i < end; ++i) fn(i);
#endif
}

}  // namespace moeblaze
