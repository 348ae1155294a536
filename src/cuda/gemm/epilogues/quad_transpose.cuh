// 4 x 4 transpose of 32-bit words within each quad of lanes (lanes 4m .. 4m + 3), for the fused
// epilogues. A WGMMA accumulator fragment gives lane q of a quad columns 8 i + 2 q and 8 i + 2 q
// + 1 of column group i (one bf16x2 word per group), so a row's 16 contiguous bytes of a group are
// spread over the quad's four lanes. Loading or storing them as four 4-byte accesses per group
// costs a 32-byte sector request per 16 bytes; after a quad transpose each lane holds one whole
// group (16 bytes, one vector access) of four consecutive groups instead:
//   before: lane q holds w[k] = word q of group i0 + k      (k = 0..3, its fragment's words)
//   after:  lane q holds w[k] = word k of group i0 + q      (the 16 bytes of group i0 + q)
// The transpose is its own inverse (use it both after a vector load and before a vector store).
// Every lane of the warp must call it (full-warp shuffles).
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// w[k] <- w[(k + s) & 3] for a per-lane s in 0..3 (two select stages: by 1, then by 2).
__device__ __forceinline__ void quad_rotate(uint32_t (&w)[4], int s) {
  if (s & 1) {
    const uint32_t t = w[0];
    w[0] = w[1]; w[1] = w[2]; w[2] = w[3]; w[3] = t;
  }
  if (s & 2) {
    uint32_t t = w[0]; w[0] = w[2]; w[2] = t;
    t = w[1]; w[1] = w[3]; w[3] = t;
  }
}

__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int q = lane & 3;
  // Lane k's word k' is wanted by lane k'. Rotate so that the word lane q' wants from this lane
  // sits at index (q' - q) & 3, the same index for every lane of a shuffle round...
  quad_rotate(w, q);  // w[v] = word (v + q) & 3
  // ...round v: each lane sends w[v] (its word (v + q) & 3) and receives from lane (q - v) & 3
  // that lane's word ((v + q - v) & 3) = q, i.e. word q of group (q - v) & 3.
#pragma unroll
  for (int v = 1; v < 4; ++v)
    w[v] = __shfl_sync(0xffffffffu, w[v], (lane & ~3) | ((q - v) & 3));
  // Now w[v] = word q of group (q - v) & 3; wanted: out[k] = word q of group k = w[(q - k) & 3].
  // Reverse (r[m] = w[-m & 3]), then rotate by -q: out[k] = r[(k - q) & 3].
  uint32_t t = w[1]; w[1] = w[3]; w[3] = t;
  quad_rotate(w, (4 - q) & 3);
}

}  // namespace moeblaze::cuda::gemm::sm90
