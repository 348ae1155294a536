// The FP8 layer's activation passes (act_quantize.hpp). Work layout, both kernels: a task is one
// (slot row, 128-column group of a) — its group of a and the matching groups of H / dH (gate and
// up halves when gated); a warp takes kUnroll consecutive tasks and issues all their loads before
// computing any (one task's loads alone leave the pass waiting on memory between its
// quantizations), grid-stride over S · n/128. A lane owns 4 consecutive columns of a task
// (8-byte bf16 loads, 4-byte code stores, so a warp moves whole 128-byte lines). A
// group's amax is a max over |x| bit patterns (exact, order-free) by five
// xor-shuffles; ds: each warp's group sum by a fixed xor-shuffle tree into ds_partials, then
// one thread per slot sums its row of partials in column order: the same bits for any grid.
#include "cuda/fp8/act_quantize.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/activation.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/fp8_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // consecutive tasks per warp and pass, loaded together
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ void load4(const uint16_t* p, float (&v)[4]) {  // 4 bf16, 8-byte aligned
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(raw.x << 16);
  v[1] = __uint_as_float(raw.x & 0xffff0000u);
  v[2] = __uint_as_float(raw.y << 16);
  v[3] = __uint_as_float(raw.y & 0xffff0000u);
}
__device__ __forceinline__ void add4(const uint16_t* p, float (&v)[4]) {
  float b[4];
  load4(p, b);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] += b[i];
}
__device__ __forceinline__ uint32_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ void store4(uint16_t* p, const float (&v)[4]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(bf16_bits(v[0]) | (bf16_bits(v[1]) << 16),
                                            bf16_bits(v[2]) | (bf16_bits(v[3]) << 16));
}
// 4 codes (one 4-byte word) times one scale.
__device__ __forceinline__ void dequant4(uint32_t w, float scale, float (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = e4m3_to_float(uint8_t(w >> (8 * i))) * scale;
}
__device__ __forceinline__ uint32_t load_word(const uint8_t* q) {  // 4 codes, 4-byte aligned
  return *reinterpret_cast<const uint32_t*>(q);
}

// One 1x128 group held by a warp (lane l: columns 4l .. 4l+3): its codes at q (the group's
// first code) and its scale at *scale_out. Every lane of the warp must call it.
__device__ __forceinline__ void quantize_group(const float (&v)[4], uint8_t* q, float* scale_out,
                                               int lane) {
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) a = amax_merge(a, abs_bits(v[i]));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) a = amax_merge(a, __shfl_xor_sync(kFull, a, off));
  const float scale = scale_from_amax_bits(a);
  const uint32_t w = is_nan_scale(scale)
                         ? 0x01010101u * kE4m3NaN
                         : uint32_t(codes2(v[0], v[1], scale)) |
                               (uint32_t(codes2(v[2], v[3], scale)) << 16);
  reinterpret_cast<uint32_t*>(q)[lane] = w;
  if (lane == 0) *scale_out = scale;
}

// The expert of slot s: the last e with off[e] <= s (off (E+1,) ascending, off[0] = 0).
__device__ __forceinline__ int expert_of(const int32_t* off, int E, int64_t s) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (int64_t(__ldg(off + mid)) <= s) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <Activation A>
__global__ void __launch_bounds__(kThreads)
    act_quantize_kernel(const uint16_t* __restrict__ h,     // (S, R) bf16
                        int64_t S, int64_t n,
                        const uint16_t* __restrict__ b1,    // (E, R) bf16 or null
                        const int32_t* __restrict__ off, int E,  // (E+1,)
                        uint8_t* __restrict__ a_q, float* __restrict__ a_s,  // (S, n), (S, n/128)
                        uint8_t* __restrict__ h_q, float* __restrict__ h_s) {  // (S, R), (S, R/128)
  constexpr bool kGated = dev_is_gated(A);
  const int lane = threadIdx.x % 32;
  const int64_t R = kGated ? 2 * n : n, gn = n / kFp8Group, gr = R / kFp8Group, tasks = S * gn;
  for (int64_t first = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kUnroll; first < tasks;
       first += int64_t(gridDim.x) * kWarps * kUnroll) {
    float g[kUnroll][4], u[kUnroll][4];  // h's gate / up values of each task, bias added
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {  // loads of every task first
      const int64_t task = first + k;
      if (task >= tasks) continue;  // warp-uniform
      const int64_t s = task / gn, j = (task - s * gn) * kFp8Group + 4 * lane;
      load4(h + s * R + j, g[k]);
      if (kGated) load4(h + s * R + n + j, u[k]);
      if (b1) {
        const uint16_t* brow = b1 + int64_t(expert_of(off, E, s)) * R;
        add4(brow + j, g[k]);
        if (kGated) add4(brow + n + j, u[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t task = first + k;
      if (task >= tasks) continue;
      const int64_t s = task / gn, t = task - s * gn;
      if (h_q) {
        quantize_group(g[k], h_q + s * R + t * kFp8Group, h_s + s * gr + t, lane);
        if (kGated)
          quantize_group(u[k], h_q + s * R + n + t * kFp8Group, h_s + s * gr + gn + t, lane);
      }
      if (a_q) {
        float a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          a[i] = kGated ? dev_act(A, g[k][i]) * dev_up(A, u[k][i]) : dev_act(A, g[k][i]);
        quantize_group(a, a_q + s * n + t * kFp8Group, a_s + s * gn + t, lane);
      }
    }
  }
}

template <Activation A>
__global__ void __launch_bounds__(kThreads)
    dact_quantize_kernel(const uint8_t* __restrict__ h_q, const float* __restrict__ h_s,  // (S, R)
                         const uint16_t* __restrict__ da,   // (S, n) bf16
                         const float* __restrict__ sw,      // (S,)
                         int64_t S, int64_t n,
                         uint16_t* __restrict__ a_scaled,   // (S, n) bf16
                         float* __restrict__ ds_part,       // (S, n/128)
                         uint16_t* __restrict__ dh,         // (S, R) bf16
                         uint8_t* __restrict__ dh_q, float* __restrict__ dh_s) {  // (S, R)
  constexpr bool kGated = dev_is_gated(A);
  const int lane = threadIdx.x % 32;
  const int64_t R = kGated ? 2 * n : n, gn = n / kFp8Group, gr = R / kFp8Group, tasks = S * gn;
  for (int64_t first = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kUnroll; first < tasks;
       first += int64_t(gridDim.x) * kWarps * kUnroll) {
    // Each task's raw operands, loaded for every task before any is computed.
    uint32_t gq[kUnroll], uq[kUnroll] = {};  // 4 codes of H's gate / up group
    float gs[kUnroll], us[kUnroll] = {}, w[kUnroll], dav[kUnroll][4];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t task = first + k;
      if (task >= tasks) continue;  // warp-uniform
      const int64_t s = task / gn, t = task - s * gn, j = t * kFp8Group + 4 * lane;
      w[k] = __ldg(sw + s);
      gq[k] = load_word(h_q + s * R + j);
      gs[k] = __ldg(h_s + s * gr + t);
      if (kGated) {
        uq[k] = load_word(h_q + s * R + n + j);
        us[k] = __ldg(h_s + s * gr + gn + t);
      }
      load4(da + s * n + j, dav[k]);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t task = first + k;
      if (task >= tasks) continue;
      const int64_t s = task / gn, t = task - s * gn, j = t * kFp8Group + 4 * lane;
      float g[4], u[4] = {0.f, 0.f, 0.f, 0.f};
      dequant4(gq[k], gs[k], g);
      if (kGated) dequant4(uq[k], us[k], u);
      float a[4], dg[4], du[4], part = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float f = dev_act(A, g[i]);
        a[i] = kGated ? f * dev_up(A, u[i]) : f;
        part += dav[k][i] * a[i];
        const float d = dav[k][i] * w[k];  // the CPU's da *= s, then act' of it
        if (kGated) {
          dg[i] = d * dev_up(A, u[i]) * dev_act_grad(A, g[i]);
          du[i] = dev_up_grad_times(A, d * f, u[i]);
        } else {
          dg[i] = d * dev_act_grad(A, g[i]);
        }
        a[i] *= w[k];
      }
      store4(a_scaled + s * n + j, a);
      store4(dh + s * R + j, dg);
      quantize_group(dg, dh_q + s * R + t * kFp8Group, dh_s + s * gr + t, lane);
      if (kGated) {
        store4(dh + s * R + n + j, du);
        quantize_group(du, dh_q + s * R + n + t * kFp8Group, dh_s + s * gr + gn + t, lane);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) part += __shfl_xor_sync(kFull, part, off);
      if (lane == 0) ds_part[task] = part;  // (S, gn) row-major: index = task
    }
  }
}

// ds[s] = Σ_t ds_part[s, t] in column order.
__global__ void __launch_bounds__(kThreads)
    sum_rows_kernel(const float* __restrict__ part, int64_t S, int64_t cols,
                    float* __restrict__ ds) {
  for (int64_t s = int64_t(blockIdx.x) * kThreads + threadIdx.x; s < S;
       s += int64_t(gridDim.x) * kThreads) {
    float acc = 0.0f;
    for (int64_t t = 0; t < cols; ++t) acc += __ldg(part + s * cols + t);
    ds[s] = acc;
  }
}

template <class Launch>
void dispatch(Activation act, Launch&& launch) {
  using A = Activation;
  switch (act) {
    case A::swiglu: return launch(std::integral_constant<A, A::swiglu>{});
    case A::geglu: return launch(std::integral_constant<A, A::geglu>{});
    case A::swiglu_oai: return launch(std::integral_constant<A, A::swiglu_oai>{});
    case A::relu: return launch(std::integral_constant<A, A::relu>{});
    case A::silu: return launch(std::integral_constant<A, A::silu>{});
    case A::gelu: return launch(std::integral_constant<A, A::gelu>{});
    case A::relu2: return launch(std::integral_constant<A, A::relu2>{});
  }
  MOEBLAZE_REQUIRE(false, "activation ", int(act), " is not an Activation");
}

void check_common(const char* fn, int64_t S, int64_t n) {
  MOEBLAZE_REQUIRE(S >= 0, fn, ": S (", S, ") must be >= 0");
  MOEBLAZE_UNSUPPORTED_IF(n <= 0 || n % kFp8Group != 0, fn, ": n (", n,
                          ") must be a positive multiple of 128: a 1x128 group of H must lie in "
                          "one of its halves");
}
void require_aligned(const char* fn, const void* p, const char* name) {
  MOEBLAZE_REQUIRE(p != nullptr, fn, ": ", name, " is null");
  MOEBLAZE_UNSUPPORTED_IF(reinterpret_cast<uintptr_t>(p) % 16 != 0, fn, ": ", name,
                          " must be 16-byte aligned");
}
unsigned grid_for(int64_t tasks, int64_t per_cta) {
  return static_cast<unsigned>(
      std::min<int64_t>((tasks + per_cta - 1) / per_cta, int64_t(1) << 20));
}
const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }

}  // namespace

void act_quantize_async(const bf16* h, int64_t S, int64_t n, Activation act, const bf16* b1,
                        const int32_t* expert_offsets, int64_t E, uint8_t* a_q, float* a_s,
                        uint8_t* h_q, float* h_s, cudaStream_t stream) {
  constexpr const char* fn = "act_quantize_async";
  check_common(fn, S, n);
  MOEBLAZE_REQUIRE((a_q == nullptr) == (a_s == nullptr) && (h_q == nullptr) == (h_s == nullptr),
                   fn, ": codes and scales come in pairs (a_q / a_s, h_q / h_s)");
  MOEBLAZE_REQUIRE(b1 == nullptr || (expert_offsets != nullptr && E >= 1 && E <= INT32_MAX), fn,
                   ": b1 needs expert_offsets and E in [1, 2^31)");
  if (S == 0 || (a_q == nullptr && h_q == nullptr)) return;
  require_aligned(fn, h, "h");
  if (b1) require_aligned(fn, b1, "b1");
  for (const void* p : {static_cast<const void*>(a_q), static_cast<const void*>(h_q)})
    if (p) require_aligned(fn, p, "a_q / h_q");
  dispatch(act, [&](auto tag) {
    constexpr Activation kAct = decltype(tag)::value;
    act_quantize_kernel<kAct><<<grid_for(S * (n / kFp8Group), kWarps * kUnroll), kThreads, 0,
                                   stream>>>(
        bits(h), S, n, b1 ? bits(b1) : nullptr, expert_offsets, int(E), a_q, a_s, h_q, h_s);
  });
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void dact_quantize_async(const uint8_t* h_q, const float* h_s, const bf16* da,
                         const float* slot_weights, int64_t S, int64_t n, Activation act,
                         bf16* a_scaled, float* ds_partials, float* ds, bf16* dh, uint8_t* dh_q,
                         float* dh_s, cudaStream_t stream) {
  constexpr const char* fn = "dact_quantize_async";
  check_common(fn, S, n);
  if (S == 0) return;
  for (const auto& [p, name] : {std::pair<const void*, const char*>{h_q, "h_q"}, {da, "da"},
                                {a_scaled, "a_scaled"}, {dh, "dh"}, {dh_q, "dh_q"}})
    require_aligned(fn, p, name);
  for (const auto& [p, name] : {std::pair<const void*, const char*>{h_s, "h_s"},
                                {slot_weights, "slot_weights"}, {ds, "ds"},
                                {ds_partials, "ds_partials"}, {dh_s, "dh_s"}})
    MOEBLAZE_REQUIRE(p != nullptr, fn, ": ", name, " is null");
  dispatch(act, [&](auto tag) {
    constexpr Activation kAct = decltype(tag)::value;
    dact_quantize_kernel<kAct><<<grid_for(S * (n / kFp8Group), kWarps * kUnroll), kThreads, 0,
                                   stream>>>(
        h_q, h_s, bits(da), slot_weights, S, n, bits(a_scaled), ds_partials, bits(dh), dh_q,
        dh_s);
  });
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  sum_rows_kernel<<<grid_for(S, kThreads), kThreads, 0, stream>>>(ds_partials, S, n / kFp8Group,
                                                                  ds);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::fp8
