// Device helpers shared by the routing kernels (src/cuda/routing/*.cu): the bad-input flags and
// the pair → token lookup of a CSR routing. Internal to the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"

namespace moeblaze::cuda::detail {

constexpr unsigned kFullMask = 0xffffffffu;

// Raise a bad-input flag: a plain store of 1. Every thread that sees a violation stores the
// same value, so the race is benign and needs no atomic read-modify-write.
__device__ __forceinline__ void raise_flag(int32_t* flags, int which) {
  if (flags != nullptr) flags[which] = 1;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Lanes of the warp holding the same key as this lane, for keys in [0, 2^bits) and -1 for "no
// key" (lanes with -1 match only each other). One ballot per key bit, as CUB's MatchAny does;
// __match_any_sync is one instruction but slower than these ballots from E = 64 on, faster at
// E <= 8 (the plan build picks by E; docs/notes/plan-build.md).
// All 32 lanes must call it with the same `bits`.
__device__ __forceinline__ unsigned match_peers(int key, int bits) {
  const bool valid = key >= 0;
  const unsigned vmask = __ballot_sync(kFullMask, valid);
  unsigned peers = valid ? vmask : ~vmask;
  for (int b = 0; b < bits; ++b) {
    const bool set = (key >> b) & 1;
    const unsigned m = __ballot_sync(kFullMask, set);
    peers &= set ? m : ~m;
  }
  return peers;
}

// Bits needed for expert ids in [0, E).
inline int expert_bits(int64_t E) {
  int bits = 1;
  while ((int64_t(1) << bits) < E) ++bits;
  return bits;
}

// Token of pair p in a CSR routing: the largest t in [lo, hi] with pair_offsets[t] <= p (empty
// tokens are skipped because the next non-empty token has the same offset). Clamped into
// [lo, hi], so invalid offsets (already flagged) can never send a thread out of bounds.
__device__ __forceinline__ int32_t token_of_pair_search(const int32_t* __restrict__ pair_offsets,
                                                        int32_t p, int32_t lo, int32_t hi) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (__ldg(pair_offsets + mid) <= p)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace moeblaze::cuda::detail
