// Pieces shared by the CPU layer's forward and backward (src/cpu/layer_forward.cpp,
// src/cpu/layer_backward.cpp) and the public API (src/api/layer_api.cpp): the work
// decomposition and the one-workspace layouts.
//
// Work is decomposed into (expert, slot tile) tasks of kTileM slots. The decomposition depends
// only on the plan, never on the thread count, and each task writes only its own slots, so the
// results are bitwise independent of the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/parallel.hpp"
#include "cpu/fp8_operands.hpp"
#include "cpu/gemm_kernels.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/layer.hpp"

namespace moeblaze::cpu::layer {

// Slots per (expert, tile) task: large enough that packing a weight panel (once per task) is a
// few percent of the task's GEMM work, small enough that cpu-default gives ~64 tasks.
constexpr int64_t kTileM = 128;
// Output rows per weight-gradient task: dW_e rows [r0, r0 + kGradRows) summed over all slots of e.
constexpr int64_t kGradRows = 128;

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline size_t align64(size_t b) { return (b + 63) / 64 * 64; }

// tile_offsets[e] = number of tiles of experts < e; (E+1,) int64. Returns the total.
inline int64_t build_tile_offsets(const int32_t* expert_token_offsets, int64_t E,
                                  int64_t* tile_offsets) {
  int64_t t = 0;
  for (int64_t e = 0; e < E; ++e) {
    tile_offsets[e] = t;
    const int64_t cnt = expert_token_offsets[e + 1] - expert_token_offsets[e];
    t += (cnt + kTileM - 1) / kTileM;
  }
  tile_offsets[E] = t;
  return t;
}

// Expert of task `task` (binary search over the (E+1,) tile offsets; empty experts own no task).
inline int64_t task_expert(const int64_t* tile_offsets, int64_t E, int64_t task) {
  int64_t lo = 0, hi = E;  // answer in [lo, hi): tile_offsets[e] <= task < tile_offsets[e+1]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (tile_offsets[mid] <= task) lo = mid; else hi = mid;
  }
  return lo;
}

// acc[j] += src[j] for a cfg.dtype row src, in j order (bias adds, bias gradients, pair sums).
inline void add_row(float* acc, const char* src, DType dtype, int64_t count) {
  if (dtype == DType::bf16) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < count; ++j) acc[j] += bf16::to_float(b[j]);
  } else {
    const float* b = reinterpret_cast<const float*>(src);
    for (int64_t j = 0; j < count; ++j) acc[j] += b[j];
  }
}

// acc[j] += s * src[j] for a cfg.dtype row src, in j order (weighted pair sums).
inline void add_scaled_row(float* acc, float s, const char* src, DType dtype, int64_t count) {
  if (dtype == DType::bf16) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < count; ++j) acc[j] += s * bf16::to_float(b[j]);
  } else {
    const float* b = reinterpret_cast<const float*>(src);
    for (int64_t j = 0; j < count; ++j) acc[j] += s * b[j];
  }
}

// Σ_j a[j] b[j] in fp32, in j order, for two cfg.dtype rows.
inline float dot_rows(const char* a, const char* b, DType dtype, int64_t count) {
  float acc = 0.0f;
  if (dtype == DType::bf16) {
    const uint16_t* pa = reinterpret_cast<const uint16_t*>(a);
    const uint16_t* pb = reinterpret_cast<const uint16_t*>(b);
    for (int64_t j = 0; j < count; ++j) acc += bf16::to_float(pa[j]) * bf16::to_float(pb[j]);
  } else {
    const float* pa = reinterpret_cast<const float*>(a);
    const float* pb = reinterpret_cast<const float*>(b);
    for (int64_t j = 0; j < count; ++j) acc += pa[j] * pb[j];
  }
  return acc;
}

// parallel_for, except that work too small to pay for waking the thread team (a few
// microseconds, far more when the machine is oversubscribed) runs on the calling thread. Which
// thread runs a task never changes its result.
template <typename Fn>
void run_tasks(int64_t count, int64_t grain, double flops, const Fn& fn) {
  if (count <= grain || flops < 4.0e6) {
    for (int64_t i = 0; i < count; ++i) fn(i);
  } else {
    parallel_for(0, count, grain, fn);
  }
}

// Byte layout of a workspace carved from one Buffer. With base == nullptr only sizes are
// computed (used by layer_workspace_bytes).
struct Carver {
  char* base;
  size_t used = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += align64(sizeof(T) * count);
    return p;
  }
};

// Forward workspace: Y (S, d) expert outputs, consumed by the aggregation and freed on return,
// plus per-thread tile scratch. H (keep_h) is not here: it is kept in SavedForBackward.
// Fp8 compute's operands (cpu/fp8_operands.hpp), fp32 dequantized values; null otherwise.
struct Fp8Operands {
  float* x = nullptr;      // (T, d) 1x128 tiles (backward: for recompute's H)
  float* d_out = nullptr;  // (T, d) 1x128 tiles, backward only
  float* w1 = nullptr;     // (E, R, d) 128x128 blocks
  float* w2 = nullptr;     // (E, d, n) 128x128 blocks
};

inline Fp8Operands take_fp8_operands(Carver& c, const LayerConfig& cfg, bool backward) {
  Fp8Operands o;
  if (!is_fp8(cfg.compute)) return o;
  o.x = c.take<float>(static_cast<size_t>(cfg.T * cfg.d));
  if (backward) o.d_out = c.take<float>(static_cast<size_t>(cfg.T * cfg.d));
  o.w1 = c.take<float>(static_cast<size_t>(cfg.E * cfg.w1_rows() * cfg.d));
  o.w2 = c.take<float>(static_cast<size_t>(cfg.E * cfg.d * cfg.n));
  return o;
}

// Compute fp8_wgrad: the weight-gradient GEMMs' operands by slot as fp32 values fake-quantized in
// 128x1 tiles along each expert's slots (fp8::fake_quant_token_tiles); null otherwise.
struct Fp8WgradOperands {
  float* d_out = nullptr;  // (S, d) dO gathered by slot: dW2's A
  float* a = nullptr;      // (S, n) A' = s·a: dW2's B
  float* dh = nullptr;     // (S, R) dH: dW1's A
  float* x = nullptr;      // (S, d) x gathered by slot: dW1's B
};

inline Fp8WgradOperands take_fp8_wgrad_operands(Carver& c, const LayerConfig& cfg, int64_t S) {
  Fp8WgradOperands o;
  if (cfg.compute != Compute::fp8_wgrad) return o;
  o.d_out = c.take<float>(static_cast<size_t>(S * cfg.d));
  o.a = c.take<float>(static_cast<size_t>(S * cfg.n));
  o.dh = c.take<float>(static_cast<size_t>(S * cfg.w1_rows()));
  o.x = c.take<float>(static_cast<size_t>(S * cfg.d));
  return o;
}

struct ForwardWorkspace {
  int64_t* tile_offsets = nullptr;  // (E+1,) int64
  void* y = nullptr;                // (S, d) cfg.dtype, grouped by expert (slot order)
  Fp8Operands fp8;
  float* thread_scratch = nullptr;  // (threads, per_thread) fp32
  int64_t per_thread = 0;           // floats per thread: pack | Hf (M,R) | Af (M,n) | Yf (M,d)
  size_t bytes = 0;
};

inline ForwardWorkspace forward_workspace(const LayerConfig& cfg, int64_t S, int threads,
                                          void* base) {
  ForwardWorkspace w;
  Carver c{static_cast<char*>(base)};
  w.tile_offsets = c.take<int64_t>(static_cast<size_t>(cfg.E + 1));
  w.y = c.take<char>(static_cast<size_t>(S * cfg.d) * dtype_size(cfg.dtype));
  w.fp8 = take_fp8_operands(c, cfg, false);
  w.per_thread = static_cast<int64_t>(
      align64(sizeof(float) * (gemm::kPackFloats +
                               kTileM * (cfg.w1_rows() + cfg.n + cfg.d))) / sizeof(float));
  w.thread_scratch = c.take<float>(static_cast<size_t>(threads * w.per_thread));
  w.bytes = c.used;
  return w;
}

// Backward workspace, the whole transient peak of backward: S·(R + n + d)·dtype_size + 4·S plus
// ~1.3 MiB of tile scratch per thread. For bf16 cpu-default (S = 8192, R = 2n = 1024, d = 256):
//   dH 16 MiB + A' 8 MiB + dX~ 4 MiB + ds 32 KiB + 2 x 1.3 MiB = 30.5 MiB with 2 threads
// (measured: 32,026,816 bytes). H (keep_h) is held by SavedForBackward, not here.
struct BackwardWorkspace {
  int64_t* tile_offsets = nullptr;  // (E+1,) int64
  float* ds = nullptr;              // (S,) fp32, grouped by expert: <dA'_p, a_p>
  void* dh = nullptr;               // (S, R) cfg.dtype, grouped by expert
  void* a_scaled = nullptr;         // (S, n) cfg.dtype, grouped by expert: A'_p = s_p a_p
  void* dx_slots = nullptr;         // (S, d) cfg.dtype, grouped by expert: dX~ = dH W1_e
  Fp8Operands fp8;
  Fp8WgradOperands wgrad;
  float* thread_scratch = nullptr;  // (threads, per_thread) fp32
  // per thread: pack | Hf (M,R) | dAf (M,n) | dXf (M,d) | a row (n) | dh row (R) | fp8 only:
  // the tile's fake-quantized dH (M,R); the weight-gradient phase reuses everything after pack
  // as its (kGradRows, max(n, d)) tile.
  int64_t per_thread = 0;
  size_t bytes = 0;
};

inline BackwardWorkspace backward_workspace(const LayerConfig& cfg, int64_t S, int threads,
                                            void* base) {
  BackwardWorkspace w;
  Carver c{static_cast<char*>(base)};
  const size_t ds = dtype_size(cfg.dtype);
  const int64_t R = cfg.w1_rows();
  w.tile_offsets = c.take<int64_t>(static_cast<size_t>(cfg.E + 1));
  w.ds = c.take<float>(static_cast<size_t>(S));
  w.dh = c.take<char>(static_cast<size_t>(S * R) * ds);
  w.a_scaled = c.take<char>(static_cast<size_t>(S * cfg.n) * ds);
  w.dx_slots = c.take<char>(static_cast<size_t>(S * cfg.d) * ds);
  w.fp8 = take_fp8_operands(c, cfg, true);
  w.wgrad = take_fp8_wgrad_operands(c, cfg, S);
  const int64_t phase1 = kTileM * (R + cfg.n + cfg.d) + cfg.n + R +
                         (is_fp8(cfg.compute) ? kTileM * R : 0);
  const int64_t phase3 = kGradRows * (cfg.n > cfg.d ? cfg.n : cfg.d);
  w.per_thread = static_cast<int64_t>(
      align64(sizeof(float) * (gemm::kPackFloats + (phase1 > phase3 ? phase1 : phase3))) /
      sizeof(float));
  w.thread_scratch = c.take<float>(static_cast<size_t>(threads * w.per_thread));
  w.bytes = c.used;
  return w;
}

// Fp8 compute: the weights as fake-quantized 128x128 blocks (W1 (E, R, d), W2 (E, d, n)), and
// x and d_out (T, d; null: not needed, d_out in forward, x in keep_h's backward) as 1x128
// tiles, into o. Parallel over row bands and tokens; each writes only its own rows.
inline void prepare_fp8_operands(const LayerConfig& cfg, const void* w1, const void* w2,
                                 const void* x, const void* d_out, const Fp8Operands& o) {
  const int64_t R = cfg.w1_rows(), d = cfg.d, n = cfg.n, E = cfg.E, T = cfg.T;
  const DType dt = cfg.dtype;
  const size_t es = dtype_size(dt);
  const int64_t b1 = fp8_groups(R), b2 = fp8_groups(d);  // row bands per expert
  run_tasks(E * (b1 + b2), 1, 8.0 * double(E) * double(R + n) * double(d), [&](int64_t task) {
    const bool is_w1 = task < E * b1;
    const int64_t local = is_w1 ? task : task - E * b1, bands = is_w1 ? b1 : b2;
    const int64_t e = local / bands, r0 = (local % bands) * kFp8Group;
    if (is_w1)
      fp8::fake_quant_block_rows(static_cast<const char*>(w1) + e * R * d * es, dt, R, d, r0,
                                 o.w1 + e * R * d);
    else
      fp8::fake_quant_block_rows(static_cast<const char*>(w2) + e * d * n * es, dt, d, n, r0,
                                 o.w2 + e * d * n);
  });
  run_tasks(T, 64, 8.0 * double(T) * double(d), [&](int64_t t) {
    if (x) fp8::fake_quant_rows(static_cast<const char*>(x) + t * d * es, dt, 1, d, o.x + t * d);
    if (d_out)
      fp8::fake_quant_rows(static_cast<const char*>(d_out) + t * d * es, dt, 1, d,
                           o.d_out + t * d);
  });
}

// The workspace one CPU layer_forward / layer_backward call allocates for keep_h / recompute
// (the larger of the two; forward's is never more), for the thread count the calling scope runs
// with (max_threads(); the per-thread tile scratch is part of it).
size_t workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode);

}  // namespace moeblaze::cpu::layer
