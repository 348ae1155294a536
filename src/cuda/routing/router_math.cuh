// Device router arithmetic, written to reproduce the CPU reference (src/cpu/router_math.hpp)
// bit for bit: same formulas, same fp32 operation order, no contraction into FMA where the CPU
// rounds twice (explicit __fmul_rn / __fadd_rn), sums over a token's pairs in ascending expert
// order, and an exp that returns exactly what the CPU's expf (glibc) returns.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "moeblaze/config.hpp"

namespace moeblaze::cuda::detail {

// 2^(i/32) rounded to double, minus i << 47 (so that adding k << 47 scales by 2^(k/32)).
// Global (not __constant__) memory: lanes index it divergently, which the constant cache would
// serialise; through the read-only path the 256 bytes are two L1 lines.
__device__ static unsigned long long kExp2Tab[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull};

// exp(x) in fp32 exactly as the CPU reference computes it. The CPU calls glibc's expf (the
// ARM optimized-routines algorithm: x·32/ln2 = k + r, 2^(k/32) from a table, a cubic in r, in
// double, rounded once to float). This is that algorithm with its FMA placement (the variant
// x86-64 glibc selects on FMA hardware); checked equal to glibc's expf on all 2^32 inputs.
// Slower than __expf (double arithmetic), but the routers' weights and the sigmoid-bias
// selection must not depend on which machine computed them.
__device__ __forceinline__ float ref_expf(float x) {
  constexpr double kInvLn2N = 0x1.71547652b82fep+0 * 32;
  constexpr double kShift = 0x1.8p+52;
  constexpr double kC0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32;
  constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / 32 / 32;
  constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / 32;
  if (!(x <= 0x1.62e42ep6f)) return x != x ? x + x : __int_as_float(0x7f800000);  // NaN, +inf
  if (x < -0x1.9fe368p6f) return 0.0f;                                            // underflow
  const double xd = double(x);
  double kd = __fma_rn(kInvLn2N, xd, kShift);
  const unsigned long long ki = __double_as_longlong(kd);
  kd = __dsub_rn(kd, kShift);
  const double r = __fma_rn(kInvLn2N, xd, -kd);
  const unsigned long long t = __ldg(&kExp2Tab[ki & 31]) + (ki << 47);
  const double s = __longlong_as_double(static_cast<long long>(t));
  const double z = __fma_rn(kC0, r, kC1);
  const double r2 = __dmul_rn(r, r);
  double y = __fma_rn(kC2, r, 1.0);
  y = __fma_rn(z, r2, y);
  return __double2float_rn(__dmul_rn(y, s));
}

__device__ __forceinline__ float ref_sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, ref_expf(-x)));
}

// std::max(m, v) as the CPU writes it: (m < v) ? v : m.
__device__ __forceinline__ float ref_max(float m, float v) { return m < v ? v : m; }

__device__ __forceinline__ float load_logit(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_logit(const uint16_t* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p)))
                         << 16);
}

// The warp's tile of logits: 32 tokens (rows) × 32 experts, fp32, rows padded to 36 floats so
// that both the row-segment stores and each lane's float4 reads of its own row are free of bank
// conflicts.
constexpr int kTileStride = 36;
using LogitTile = float[32][kTileStride];

// Loads rows [row0, row0+32) × experts [e0, e0+32) of logits (T, E) into the tile (zeros outside
// the tensor). With `vec` (E·sizeof(InT) a multiple of 16 and a 16-byte aligned base) every lane
// moves 16 bytes per load; otherwise 4- or 2-byte loads.
template <typename InT>
__device__ __forceinline__ void load_tile(const InT* __restrict__ logits, int64_t T, int E,
                                          int64_t row0, int e0, bool vec, LogitTile& tile) {
  const int lane = threadIdx.x & 31;
  if (vec) {
    constexpr int kPer = 16 / sizeof(InT);  // elements per 16-byte load
    constexpr int kSlotsPerRow = 32 / kPer;
#pragma unroll
    for (int i = 0; i < 32 * kSlotsPerRow / 32; ++i) {
      const int slot = i * 32 + lane;
      const int r = slot / kSlotsPerRow, c = (slot % kSlotsPerRow) * kPer;
      const int64_t row = row0 + r;
      float v[kPer];
      if (row < T && e0 + c < E) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(logits + row * E + e0 + c));
        if (sizeof(InT) == 4) {
          v[0] = __uint_as_float(raw.x);
          v[1] = __uint_as_float(raw.y);
          v[2] = __uint_as_float(raw.z);
          v[3] = __uint_as_float(raw.w);
        } else {
          const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            v[2 * q] = __uint_as_float(w4[q] << 16);
            v[2 * q + 1] = __uint_as_float(w4[q] & 0xffff0000u);
          }
        }
      } else {
#pragma unroll
        for (int q = 0; q < kPer; ++q) v[q] = 0.0f;
      }
#pragma unroll
      for (int q = 0; q < kPer; q += 4)
        *reinterpret_cast<float4*>(&tile[r][c + q]) = make_float4(v[q], v[q + 1], v[q + 2], v[q + 3]);
    }
  } else {
    const int c = e0 + lane;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int64_t r = row0 + i;
      tile[i][lane] = (r < T && c < E) ? load_logit(logits + r * E + c) : 0.0f;
    }
  }
}

template <typename InT>
inline bool tile_vec_ok(const void* logits, int64_t E) {
  return (E * int64_t(sizeof(InT))) % 16 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
}

// Per-token constants of the router's weight rule over one token's pair set, so that the weight
// of any pair can be (re)computed from its logit alone, identically every time:
//  softmax_topk, no renorm:      w = exp(x - m) / z         (m, z over the whole row)
//  topk_softmax / renormalised:  w = exp(x - m) / z         (m, z over the pairs' logits)
//  sigmoid_bias, no renorm:      w = sigmoid(x)
//  sigmoid_bias, renormalised:   w = sigmoid(x) / z, or, when every sigmoid underflows
//                                (z < FLT_MIN), the log-domain softmax with y = x - log1p(e^x).
struct PairRule {
  int mode = 0;  // 0: exp(x - m) / z; 1: sigmoid(x); 2: sigmoid(x) / z; 3: log-domain softmax
  float m = 0.0f, z = 1.0f;
};

__device__ __forceinline__ float log_sigmoid_ref(float x) {
  // The CPU's underflow fallback: x - log1p(exp(x)). log1pf may differ from glibc's by an ulp:
  // this branch only runs when every logit of the token is below about -87.
  return __fsub_rn(x, log1pf(ref_expf(x)));
}

__device__ __forceinline__ float pair_weight(const PairRule& r, float x) {
  switch (r.mode) {
    case 0: return __fdiv_rn(ref_expf(__fsub_rn(x, r.m)), r.z);
    case 1: return ref_sigmoid(x);
    case 2: return __fdiv_rn(ref_sigmoid(x), r.z);
    default: return __fdiv_rn(ref_expf(__fsub_rn(log_sigmoid_ref(x), r.m)), r.z);
  }
}

// Visits the n pairs in ascending expert order (ids distinct): O(n^2) id reads, no arrays, so it
// works for any n. visit(i) is called with the pair's position.
template <typename IdAt, typename Visit>
__device__ __forceinline__ void for_each_by_expert(int n, IdAt id_at, Visit visit) {
  int prev = -1;
  for (int r = 0; r < n; ++r) {
    int best = 0x7fffffff, bi = 0;
    for (int i = 0; i < n; ++i) {
      const int e = id_at(i);
      if (e > prev && e < best) {
        best = e;
        bi = i;
      }
    }
    visit(bi);
    prev = best;
  }
}

// The rule of one token's pair set: x_at(i) is the logit of pair i, id_at(i) its expert.
// full_m, full_z: max and sum of exp(l - max) over the whole row (softmax_topk without renorm).
template <typename IdAt, typename XAt>
__device__ __forceinline__ PairRule make_pair_rule(RouterKind kind, bool renormalize, int n, IdAt id_at, XAt x_at,
                                   float full_m, float full_z) {
  PairRule r;
  if (kind == RouterKind::softmax_topk && !renormalize) {
    r.mode = 0;
    r.m = full_m;
    r.z = full_z;
    return r;
  }
  if (n == 0) return r;
  if (kind == RouterKind::sigmoid_bias) {
    if (!renormalize) {
      r.mode = 1;
      return r;
    }
    float z = 0.0f;
    for_each_by_expert(n, id_at, [&](int i) { z = __fadd_rn(z, ref_sigmoid(x_at(i))); });
    if (z >= FLT_MIN) {
      r.mode = 2;
      r.z = z;
      return r;
    }
    float m = log_sigmoid_ref(x_at(0));
    for (int i = 1; i < n; ++i) m = ref_max(m, log_sigmoid_ref(x_at(i)));
    float zz = 0.0f;
    for_each_by_expert(n, id_at, [&](int i) {
      zz = __fadd_rn(zz, ref_expf(__fsub_rn(log_sigmoid_ref(x_at(i)), m)));
    });
    r.mode = 3;
    r.m = m;
    r.z = zz;
    return r;
  }
  // topk_softmax, or softmax_topk renormalised: softmax over the pairs' logits.
  float m = x_at(0);
  for (int i = 1; i < n; ++i) m = ref_max(m, x_at(i));
  float z = 0.0f;
  for_each_by_expert(n, id_at, [&](int i) { z = __fadd_rn(z, ref_expf(__fsub_rn(x_at(i), m))); });
  r.mode = 0;
  r.m = m;
  r.z = z;
  return r;
}

}  // namespace moeblaze::cuda::detail
