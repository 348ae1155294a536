// Token-axis (128x1) FP8 quantization of the weight-gradient GEMM operands, per expert, K-major
// and padded (quantize_tokens.hpp). Why: dW = Σ over an expert's tokens, so the FP8 GEMM's K is
// the token axis; its operands need one scale per 128 tokens of a column and tokens contiguous,
// which neither the row-major activations nor the 1x128 (along-columns) quantizers give.
// Codes and scales are bit-identical to src/core/fp8.cpp (rules: src/core/fp8.hpp; device steps:
// fp8_device.cuh, whose inline-PTX divisions keep this file independent of fast-math flags).
//
// padded_token_offsets_async: one 1024-thread CTA; thread t sums P_e over its contiguous run of
// ceil(E/1024) experts, a block-wide exclusive scan (warp shuffles, then the 32 warp totals)
// gives each run its start, and the thread writes its run's poff entries in order. Integer sums:
// the result does not depend on the launch shape.
//
// quantize_tokens_128x1_async: one 256-thread CTA per (global 128-token group G, 128-column block
// cb), flattened with the column block fastest (consecutive CTAs read neighbouring segments of
// the same gathered rows). A CTA
//   1. finds its expert e by binary search over poff (the largest e with poff[e] <= 128 G; every
//      P_e >= 128, so poff is strictly increasing) and exits if 128 G >= poff[E];
//   2. loads the group's 128 slots x 128 columns of bf16 into shared memory (32 KB), rows
//      gathered through rows_of: sixteen threads per row, one 16-byte chunk each (coalesced 256
//      bytes per row), padding slots stored as +0 (never read from src);
//   3. thread (p, r) = (threadIdx % 64, threadIdx / 64) reads the 32-bit word of columns (2p,
//      2p+1) for its quarter r of the slots (32 slots; a warp reads 32 consecutive words: no
//      bank conflicts), keeps the 32 words in registers and reduces both columns' amax (integer
//      max over |x| bit patterns: exact, NaN-keeping); the four quarters' partial amaxes meet in
//      shared memory and every thread merges them in quarter order;
//   4. converts its 2 x 32 values (codes2: x / scale by div.rn.f32, cvt.rn.satfinite) into a
//      (128 columns, 128 slots) code tile in shared memory (over the bf16 tile, no longer read);
//      padding slots give 0x00 (from +0 under a finite scale, explicitly under a NaN scale);
//   5. writes each column's 128 codes as eight 16-byte stores by eight consecutive threads (one
//      full 128-byte segment), and thread r == 0 the two columns' scales.
// Output offsets C * poff[e] + c * P_e + 128 g are multiples of 128, so q 16-byte aligned makes
// every code store 16-byte aligned.
#include "cuda/fp8/quantize_tokens.hpp"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/fp8_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::fp8 {
namespace {

constexpr int kGroup = 128;  // slots per group (the 128 of 128x1)
static_assert(kGroup == kFp8Group, "a token group is one fp8 group");

// ---- padded offsets ----------------------------------------------------------------------

constexpr int kOffThreads = 1024;
static_assert(kOffThreads / 32 == 32, "the warp totals are scanned by one warp");

// P_e of an expert with k slots: max(128, roundup(k, 128)); k <= 0 (empty) gives one group.
__device__ __forceinline__ int32_t padded_len(int32_t k) {
  return k <= kGroup ? kGroup : (k + kGroup - 1) / kGroup * kGroup;
}

__global__ void __launch_bounds__(kOffThreads)
    padded_offsets_kernel(const int32_t* __restrict__ off,  // (E+1,) expert token offsets
                          int64_t E,
                          int32_t* __restrict__ poff) {     // (E+1,) padded offsets
  __shared__ int32_t warp_total[kOffThreads / 32];  // (32,) inclusive scan of the warps' sums
  const int64_t per = (E + kOffThreads - 1) / kOffThreads;
  const int64_t e0 = min(E, int64_t(threadIdx.x) * per), e1 = min(E, e0 + per);
  int32_t sum = 0;
  for (int64_t e = e0; e < e1; ++e) sum += padded_len(__ldg(off + e + 1) - __ldg(off + e));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t incl = sum;  // inclusive scan over the warp's threads
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t t = warp_total[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, t, d);
      if (lane >= d) t += v;
    }
    warp_total[lane] = t;
  }
  __syncthreads();
  int32_t run = incl - sum + (warp > 0 ? warp_total[warp - 1] : 0);  // exclusive start
  if (threadIdx.x == 0) poff[0] = 0;
  for (int64_t e = e0; e < e1; ++e) {
    run += padded_len(__ldg(off + e + 1) - __ldg(off + e));
    poff[e + 1] = run;
  }
}

// ---- token-axis quantization -------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int kCols = 128;                           // columns per CTA
constexpr int kWords = kCols / 2;                    // 32-bit words (bf16 pairs) per tile row
constexpr int kChunksPerRow = kCols * 2 / 16;        // 16-byte chunks per tile row: 16
constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // tile rows loaded per pass: 16
constexpr int kQuarters = kThreads / kWords;         // slot quarters: 4
constexpr int kSlotsPerThread = kGroup / kQuarters;  // 32 slots of 2 columns per thread
constexpr int kCodeStride = kGroup + 16;             // code tile row (bytes): + 16 spreads banks
constexpr int kStoresPerCol = kGroup / 16;           // 16-byte code stores per column: 8
static_assert(kWords * kQuarters == kThreads && kSlotsPerThread % 16 == 0, "compute mapping");
static_assert(kRowsPerPass * kChunksPerRow == kThreads && kGroup % kRowsPerPass == 0, "loads");
static_assert(kCols * kStoresPerCol % kThreads == 0, "stores");
constexpr int kTileBytes = kGroup * kCols * 2;  // the bf16 tile: 32 KB
static_assert(kCols * kCodeStride <= kTileBytes, "the code tile fits over the bf16 tile");

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__global__ void __launch_bounds__(kThreads) quantize_tokens_kernel(
    const uint16_t* __restrict__ src,   // (rows, ld) bf16 bits, C columns used
    int64_t ld,
    const int32_t* __restrict__ rows_of,  // (S,) source row of each slot, or null (row = slot)
    const int32_t* __restrict__ off,    // (E+1,) expert token offsets
    const int32_t* __restrict__ poff,   // (E+1,) padded token offsets
    int64_t E, int64_t C,
    uint8_t* __restrict__ q,            // per expert e: (C, P_e) e4m3 codes at C * poff[e]
    float* __restrict__ sc,             // per expert e: (C, P_e/128) scales at C * poff[e]/128
    bool vec_load) {
  // The bf16 tile (128 slots, 64 words) in steps 2-3, then the code tile (128 columns,
  // kCodeStride bytes) in steps 4-5.
  __shared__ __align__(16) unsigned char smem[kTileBytes];
  __shared__ __align__(16) uint32_t part_amax[kQuarters][kCols];  // (4, 128) per-quarter amax
  uint32_t(*tile)[kWords] = reinterpret_cast<uint32_t(*)[kWords]>(smem);
  uint8_t(*codes)[kCodeStride] = reinterpret_cast<uint8_t(*)[kCodeStride]>(smem);

  const int64_t col_blocks = C / kCols;
  const int64_t G = int64_t(blockIdx.x) / col_blocks;
  const int64_t c0 = (int64_t(blockIdx.x) % col_blocks) * kCols;
  const int64_t t0 = G * kGroup;  // the group's first padded slot
  if (t0 >= __ldg(poff + E)) return;  // past the padded total (uniform over the CTA)

  // 1. Expert: the largest e with poff[e] <= t0 (poff[0] = 0 <= t0 < poff[E]).
  int64_t lo = 0, hi = E - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (__ldg(poff + mid) <= t0) lo = mid; else hi = mid - 1;
  }
  const int64_t e = lo, pe = __ldg(poff + e), P = __ldg(poff + e + 1) - pe;
  const int64_t g = (t0 - pe) / kGroup;
  const int64_t s0 = int64_t(__ldg(off + e)) + g * kGroup;  // the group's first slot
  const int64_t real = int64_t(__ldg(off + e + 1)) - s0;
  const int n = real <= 0 ? 0 : (real >= kGroup ? kGroup : int(real));  // real slots, 0..128

  // 2. The (128 slots, 128 columns) bf16 tile; padding slots are +0.
  {
    const int chunk = threadIdx.x % kChunksPerRow;
#pragma unroll
    for (int it = 0; it < kGroup / kRowsPerPass; ++it) {
      const int i = threadIdx.x / kChunksPerRow + it * kRowsPerPass;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (i < n) {
        const int64_t row = rows_of != nullptr ? int64_t(__ldg(rows_of + s0 + i)) : s0 + i;
        const uint16_t* p = src + row * ld + c0 + chunk * 8;
        if (vec_load) {
          v = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            w[k] = uint32_t(__ldg(p + 2 * k)) | (uint32_t(__ldg(p + 2 * k + 1)) << 16);
          v = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
      *reinterpret_cast<uint4*>(&tile[i][chunk * 4]) = v;
    }
  }
  __syncthreads();

  // 3. Columns 2p and 2p+1 over slots [32 r, 32 r + 32): values and partial amaxes.
  const int p = threadIdx.x % kWords, r = threadIdx.x / kWords;
  uint32_t w[kSlotsPerThread];  // (32,) bf16 pairs: low half column 2p, high half 2p+1
  uint32_t a0 = 0, a1 = 0;
#pragma unroll
  for (int k = 0; k < kSlotsPerThread; ++k) {
    w[k] = tile[r * kSlotsPerThread + k][p];
    a0 = amax_merge(a0, abs_bits(lo_bf16(w[k])));
    a1 = amax_merge(a1, abs_bits(hi_bf16(w[k])));
  }
  *reinterpret_cast<uint2*>(&part_amax[r][2 * p]) = make_uint2(a0, a1);
  __syncthreads();  // after this the bf16 tile is dead: the code tile may overwrite it
  a0 = part_amax[0][2 * p];
  a1 = part_amax[0][2 * p + 1];
#pragma unroll
  for (int k = 1; k < kQuarters; ++k) {
    a0 = amax_merge(a0, part_amax[k][2 * p]);
    a1 = amax_merge(a1, part_amax[k][2 * p + 1]);
  }
  const float scale0 = scale_from_amax_bits(a0), scale1 = scale_from_amax_bits(a1);
  const int64_t gpe = P / kGroup;  // groups of expert e
  if (r == 0) {
    float* s = sc + C * (pe / kGroup) + (c0 + 2 * p) * gpe + g;
    s[0] = scale0;
    s[gpe] = scale1;
  }

  // 4. Codes into the (128 columns, 128 slots) code tile.
  const int m = n - r * kSlotsPerThread;  // real slots among this thread's 32 (may be <= 0)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float scale = j == 0 ? scale0 : scale1;
    uint32_t out[kSlotsPerThread / 4];  // (8,) four codes each, slot order
    if (is_nan_scale(scale)) {  // NaN / Inf group: real codes 0x7F, padding 0x00
#pragma unroll
      for (int k = 0; k < kSlotsPerThread / 4; ++k) {
        uint32_t v = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b)
          if (4 * k + b < m) v |= uint32_t(kE4m3NaN) << (8 * b);
        out[k] = v;
      }
    } else {  // padding values are +0: code 0x00
#pragma unroll
      for (int k = 0; k < kSlotsPerThread / 4; ++k) {
        float x[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) x[b] = j == 0 ? lo_bf16(w[4 * k + b]) : hi_bf16(w[4 * k + b]);
        out[k] = uint32_t(codes2(x[0], x[1], scale)) | (uint32_t(codes2(x[2], x[3], scale)) << 16);
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(&codes[2 * p + j][r * kSlotsPerThread]);
#pragma unroll
    for (int k = 0; k < kSlotsPerThread / 16; ++k)
      dst[k] = make_uint4(out[4 * k], out[4 * k + 1], out[4 * k + 2], out[4 * k + 3]);
  }
  __syncthreads();

  // 5. Each column's 128 codes: eight consecutive threads, one 128-byte segment.
  uint8_t* qe = q + C * pe + g * kGroup;  // expert e's (C, P_e) block, at the group's slots
#pragma unroll
  for (int it = 0; it < kCols * kStoresPerCol / kThreads; ++it) {
    const int c = threadIdx.x / kStoresPerCol + it * (kThreads / kStoresPerCol);
    const int k = threadIdx.x % kStoresPerCol;
    *reinterpret_cast<uint4*>(qe + (c0 + c) * P + k * 16) =
        *reinterpret_cast<const uint4*>(&codes[c][k * 16]);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void padded_token_offsets_async(const int32_t* expert_token_offsets, int64_t E, int32_t* poff,
                                cudaStream_t stream) {
  constexpr const char* fn = "fp8::padded_token_offsets_async";
  MOEBLAZE_REQUIRE(E >= 1, fn, ": E (", E, ") must be >= 1");
  MOEBLAZE_REQUIRE(padded_tokens_bound(0, E) <= INT32_MAX, fn, ": E (", E,
                   ") too large: 128 * E must fit in int32");
  MOEBLAZE_REQUIRE(expert_token_offsets != nullptr && poff != nullptr, fn,
                   ": expert_token_offsets and poff must be device pointers");
  padded_offsets_kernel<<<1, kOffThreads, 0, stream>>>(expert_token_offsets, E, poff);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void quantize_tokens_128x1_async(const bf16* src, int64_t ld, const int32_t* rows_of,
                                 const int32_t* expert_token_offsets, const int32_t* poff,
                                 int64_t E, int64_t S, int64_t C, uint8_t* q, float* sc,
                                 cudaStream_t stream) {
  constexpr const char* fn = "fp8::quantize_tokens_128x1_async";
  MOEBLAZE_REQUIRE(E >= 1, fn, ": E (", E, ") must be >= 1");
  MOEBLAZE_REQUIRE(S >= 0 && C >= 0, fn, ": S (", S, ") and C (", C, ") must be >= 0");
  MOEBLAZE_UNSUPPORTED_IF(C % kCols != 0, fn, ": C (", C,
                          ") must be a multiple of 128 (whole 128-column blocks)");
  MOEBLAZE_REQUIRE(ld >= C, fn, ": ld (", ld, ") must be >= C (", C, ")");
  const int64_t bound = padded_tokens_bound(S, E);
  MOEBLAZE_REQUIRE(bound <= INT32_MAX, fn, ": S + 128 * E (", bound,
                   ") must fit in int32 (the padded offsets)");
  if (C == 0) return;
  MOEBLAZE_REQUIRE(expert_token_offsets != nullptr && poff != nullptr && q != nullptr &&
                       sc != nullptr && (S == 0 || src != nullptr),
                   fn, ": src, expert_token_offsets, poff, q and sc must be device pointers");
  MOEBLAZE_REQUIRE(aligned16(q), fn, ": q must be 16-byte aligned");
  const int64_t groups = (bound + kGroup - 1) / kGroup, col_blocks = C / kCols;
  const int64_t ctas = groups * col_blocks;
  MOEBLAZE_REQUIRE(ctas <= int64_t(INT32_MAX), fn, ": ", ctas,
                   " CTAs ((S + 128 E) / 128 groups x C / 128) exceed one grid (2^31 - 1)");
  const bool vec_load = aligned16(src) && (ld * int64_t(sizeof(bf16))) % 16 == 0;
  quantize_tokens_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      reinterpret_cast<const uint16_t*>(src), ld, rows_of, expert_token_offsets, poff, E, C, q,
      sc, vec_load);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::fp8
