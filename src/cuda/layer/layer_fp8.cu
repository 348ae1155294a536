// The MoE layer with FP8 compute on the GPU (LayerConfig::compute == fp8, issue 20): the recipe
// of docs/FP8.md, the CPU emulation's (src/cpu/layer_forward.cpp, layer_backward.cpp) values up
// to rounding, built from the FP8 pieces that exist so far:
//
// forward   W1, W2 → 128x128-block codes                                [workspace]
//           X gathered by slot and quantized in 1x128 tiles             [workspace, (S, d) codes]
//           1 up-proj  H = Xq W1qᵀ  (FP8 GEMM, contiguous A)            → H (S, R) bf16
//             act_quantize: a = act(H + b1) → A codes; H codes kept (keep_h)
//           2 down-proj Y = Aq W2qᵀ (FP8 GEMM)                          → Y (S, d) bf16
//           3 aggregate out_t = Σ s_p Y[slot] (+ b2)                    (the bf16 path's kernel)
// backward  W1ᵀ, W2ᵀ as codes (quantize, then transpose_blocks)
//           (recompute: X quantized and gathered, up-proj, H quantized as forward keeps it)
//           dO gathered by slot and quantized; 4 dA' = dOq W2q (FP8 GEMM) → (S, n) bf16
//             dact_quantize: ds, A' = s·a, dH (bf16 and 1x128 codes)
//           5 dW2 (bf16 varlen-K GEMM, as the bf16 path)   d_pair_weights; b2's share
//           6 dX̃ = dHq W1q (FP8 GEMM) → (S, d) bf16; 7 aggregate dx (ascending slots)
//           8 dW1 (bf16 varlen-K GEMM); db1
// The weight gradients stay bf16, as in the CPU emulation (docs/FP8.md says why and what next).
// Not yet fused: X and dO are gathered into (S, d) code buffers (half the bytes of a bf16 copy)
// and the activation runs as its own pass over a bf16 H, because the FP8 GEMM (CUTLASS's
// blockwise-scaled pointer-array kernel) has a contiguous A and a plain epilogue. No token
// chunks or expert ranges. The weights are quantized in every call, or once per Fp8WeightCache
// (LayerOptions::fp8_weights) until the caller says they changed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/carver.hpp"
#include "core/fp8.hpp"
#include "core/fp8_weight_cache.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/act_quantize.hpp"
#include "cuda/fp8/quantize.hpp"
#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/layer/expert_ranges.hpp"  // ascending_token_slots
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

// e4m3 codes and their fp32 scales, one buffer pair.
struct Codes {
  uint8_t* q = nullptr;
  float* s = nullptr;
};
// `elems` codes and their `groups` scales (1x128 tiles or 128x128 blocks, as the caller counts).
Codes take_codes(Carver& c, int64_t elems, int64_t groups) {
  Codes k;
  k.q = c.take<uint8_t>(elems);
  k.s = c.take<float>(groups);
  return k;
}
int64_t g128(int64_t x) { return fp8_groups(x); }

// The weights' codes: W1 (E, R, d), W1ᵀ (E, d, R), W2 (E, d, n), W2ᵀ (E, n, d), each with its
// (E, rows/128, cols/128) scales.
struct WeightCodes {
  Codes w1, w1t, w2, w2t;
  size_t bytes = 0;
};
WeightCodes carve_weights(const LayerConfig& cfg, void* base) {
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  Carver c(base);
  WeightCodes k;
  k.w1 = take_codes(c, E * R * d, E * g128(R) * g128(d));
  k.w1t = take_codes(c, E * d * R, E * g128(d) * g128(R));
  k.w2 = take_codes(c, E * d * n, E * g128(d) * g128(n));
  k.w2t = take_codes(c, E * n * d, E * g128(n) * g128(d));
  k.bytes = c.high_water();
  return k;
}

// Continues a carve past the high-water mark of everything taken so far (after a rewind).
void skip_to_high_water(Carver& c) { c.rewind(c.high_water()); }

struct Fp8Forward {
  void* scratch = nullptr;  // the FP8 GEMMs' argument arrays and TMA descriptors (one at a time)
  size_t scratch_bytes = 0;
  Codes a;                  // (S, n), (S, n/128): the down-projection's A
  Codes x;                  // (S, d), (S, d/128): X by slot; dead after the up-projection
  bf16* h = nullptr;        // (S, R): the up-projection's output; dead after act_quantize
  bf16* y = nullptr;        // (S, d): expert outputs, over x and h
  Codes w1, w2;             // without a weight cache: W1 (E, R, d), W2 (E, d, n) codes
  size_t bytes = 0;
};

Fp8Forward carve_forward(const LayerConfig& cfg, int64_t S, void* base, bool weights) {
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  Carver c(base);
  Fp8Forward w;
  w.scratch_bytes = gemm::fp8::contiguous_scratch_bytes(E);
  w.scratch = c.take<char>(int64_t(w.scratch_bytes));
  w.a = take_codes(c, S * n, S * g128(n));
  const size_t transient = c.mark();
  w.x = take_codes(c, S * d, S * g128(d));
  w.h = c.take<bf16>(S * R);
  c.rewind(transient);
  w.y = c.take<bf16>(S * d);
  if (weights) {
    skip_to_high_water(c);
    w.w1 = take_codes(c, E * R * d, E * g128(R) * g128(d));
    w.w2 = take_codes(c, E * d * n, E * g128(d) * g128(n));
  }
  w.bytes = c.high_water();
  return w;
}

struct Fp8Backward {
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  Codes h;                  // (S, R), (S, R/128): recompute's H codes (keep_h: the saved ones)
  bf16* a_scaled = nullptr; // (S, n): A' = s·A, dW2's operand
  float* ds = nullptr;      // (S,)
  float* ds_partials = nullptr;  // (S, n/128): ds per 128 columns of a, summed in order
  bf16* dh = nullptr;       // (S, R): dW1's and db1's operand
  Codes dh_q;               // (S, R), (S, R/128): dX̃'s A
  int32_t* dx_order = nullptr;  // (S,) each token's slots ascending
  // Dead once dact_quantize has run; dX̃ takes their bytes:
  Codes x;                  // (S, d) recompute only: X by slot
  bf16* h16 = nullptr;      // (S, R) recompute only: the up-projection's output
  Codes dout;               // (S, d), (S, d/128): dO by slot
  bf16* da = nullptr;       // (S, n): dA'
  bf16* dx_slots = nullptr; // (S, d): dX̃, over the pieces above
  // Without a weight cache: W1ᵀ, W2ᵀ, and one weight's codes before their transpose (W1's
  // first, which recompute's up-projection reads as they are, then W2's).
  Codes w1t, w2t, w;
  size_t bytes = 0;
};

Fp8Backward carve_backward(const LayerConfig& cfg, int64_t S, LayerMode mode, void* base,
                           bool weights) {
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const bool recompute = mode == LayerMode::recompute;
  Carver c(base);
  Fp8Backward w;
  w.scratch_bytes = gemm::fp8::contiguous_scratch_bytes(E);
  w.scratch = c.take<char>(int64_t(w.scratch_bytes));
  if (recompute) w.h = take_codes(c, S * R, S * g128(R));
  w.a_scaled = c.take<bf16>(S * n);
  w.ds = c.take<float>(S);
  w.ds_partials = c.take<float>(S * g128(n));
  w.dh = c.take<bf16>(S * R);
  w.dh_q = take_codes(c, S * R, S * g128(R));
  w.dx_order = c.take<int32_t>(S);
  const size_t transient = c.mark();
  if (recompute) {
    w.x = take_codes(c, S * d, S * g128(d));
    w.h16 = c.take<bf16>(S * R);
  }
  w.dout = take_codes(c, S * d, S * g128(d));
  w.da = c.take<bf16>(S * n);
  c.rewind(transient);
  w.dx_slots = c.take<bf16>(S * d);
  if (weights) {
    skip_to_high_water(c);
    w.w1t = take_codes(c, E * d * R, E * g128(d) * g128(R));
    w.w2t = take_codes(c, E * n * d, E * g128(n) * g128(d));
    w.w = take_codes(c, E * std::max(R * d, d * n),
                     E * std::max(g128(R) * g128(d), g128(d) * g128(n)));
  }
  w.bytes = c.high_water();
  return w;
}

// W (E, rows, cols) bf16 as 128x128-block codes.
void quantize_weights(const bf16* w, int64_t E, int64_t rows, int64_t cols, Codes out,
                      cudaStream_t stream) {
  fp8::quantize_128x128_async(w, E, rows * cols, rows, cols, cols, out.q, out.s, stream);
}

// The cache's codes for these weights, (re)computed when it holds none or others.
WeightCodes cached_weights(const LayerConfig& cfg, const bf16* w1, const bf16* w2,
                           Fp8WeightCache& cache, cudaStream_t stream) {
  Fp8WeightCache::State& st = cache.state();
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const size_t bytes = carve_weights(cfg, nullptr).bytes;
  if (st.codes.bytes() != bytes || st.codes.device() != Device::cuda) {
    // The cache outlives the caller's streams, so its codes live on the legacy default stream,
    // with a host sync at each (re)allocation (its first call, or a new shape) and at its end.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOEBLAZE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    MOEBLAZE_UNSUPPORTED_IF(capture != cudaStreamCaptureStatusNone,
                            "opts.fp8_weights: the cache allocates its codes (a host sync) at its "
                            "first call with a shape; make that call before capturing a CUDA "
                            "graph");
    st.valid = false;
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old codes' last readers
    st.codes = Buffer();
    st.codes = Buffer(Device::cuda, bytes, nullptr);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // allocated before `stream` uses it
  }
  const WeightCodes k = carve_weights(cfg, st.codes.data());
  const bool same = st.valid && st.w1 == w1 && st.w2 == w2 && st.E == E && st.w1_rows == R &&
                    st.d == d && st.n == n;
  if (!same) {
    quantize_weights(w1, E, R, d, k.w1, stream);
    fp8::transpose_blocks_async(k.w1.q, k.w1.s, E, R, d, k.w1t.q, k.w1t.s, stream);
    quantize_weights(w2, E, d, n, k.w2, stream);
    fp8::transpose_blocks_async(k.w2.q, k.w2.s, E, d, n, k.w2t.q, k.w2t.s, stream);
    st.w1 = w1, st.w2 = w2, st.E = E, st.w1_rows = R, st.d = d, st.n = n;
    st.valid = true;
    ++st.quantizations;
  }
  return k;
}

// The FP8 grouped GEMM over the plan's experts: D (S, N) = A (S, K) · B_e (N, K)ᵀ per expert.
void gemm_fp8(const RoutingPlanView& pv, const LayerConfig& cfg, Codes a, Codes b, bf16* d,
              int64_t N, int64_t K, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  gemm::fp8::contiguous(gemm::ExpertRows::whole(pv), cfg.E, a.q, a.s, b.q, b.s, d, N, K, scratch,
                        scratch_bytes, stream);
}

// The kept H's two pieces in its one buffer (LayerConfig::kept_h_bytes).
Codes kept_h(const LayerConfig& cfg, int64_t S, const void* h) {
  char* base = static_cast<char*>(const_cast<void*>(h));
  return {reinterpret_cast<uint8_t*>(base),
          reinterpret_cast<float*>(base + cfg.kept_h_scales_offset(S))};
}

}  // namespace

void check_fp8_gpu_shape(const LayerConfig& cfg) {
  MOEBLAZE_UNSUPPORTED_IF(cfg.d % kFp8Group != 0, "compute fp8 on the GPU: d (", cfg.d,
                          ") must be a multiple of 128: every FP8 GEMM reads d in 128-wide "
                          "scaled blocks (the CPU backend takes any d)");
  MOEBLAZE_UNSUPPORTED_IF(cfg.n % kFp8Group != 0, "compute fp8 on the GPU: n (", cfg.n,
                          ") must be a multiple of 128: every FP8 GEMM reads n in 128-wide "
                          "scaled blocks (the CPU backend takes any n)");
}

size_t fp8_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, bool forward,
                           bool weights) {
  return forward ? carve_forward(cfg, S, nullptr, weights).bytes
                 : carve_backward(cfg, S, mode, nullptr, weights).bytes;
}

void fp8_forward(const LayerConfig& cfg, const RoutingPlanView& pv, const bf16* x,
                 const bf16* w1, const bf16* w2, const bf16* b1, const bf16* b2, void* h_keep,
                 void* out, Fp8WeightCache* cache, void* workspace, cudaStream_t stream) {
  const int64_t S = pv.S, d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const Fp8Forward w = carve_forward(cfg, S, workspace, cache == nullptr);
  if (S > 0) {
    Codes w1q = w.w1, w2q = w.w2;
    if (cache) {
      const WeightCodes k = cached_weights(cfg, w1, w2, *cache, stream);
      w1q = k.w1, w2q = k.w2;
    } else {
      quantize_weights(w1, E, R, d, w1q, stream);
      quantize_weights(w2, E, d, n, w2q, stream);
    }
    fp8::gather_quantize_1x128_async(x, pv.expert_token_indices, S, d, d, w.x.q, w.x.s, stream);
    gemm_fp8(pv, cfg, w.x, w1q, w.h, R, d, w.scratch, w.scratch_bytes, stream);
    const Codes kept = h_keep ? kept_h(cfg, S, h_keep) : Codes{};
    fp8::act_quantize_async(w.h, S, n, cfg.activation, b1, pv.expert_token_offsets, E, w.a.q,
                            w.a.s, kept.q, kept.s, stream);
    gemm_fp8(pv, cfg, w.a, w2q, w.y, d, n, w.scratch, w.scratch_bytes, stream);
  }
  aggregate_rows(pv, w.y, pv.slot_weights, out, d, DType::bf16, stream, b2);
}

void fp8_backward(const LayerConfig& cfg, const RoutingPlanView& pv, LayerMode mode,
                  const bf16* x, const bf16* w1, const bf16* w2, const bf16* b1, const bf16* b2,
                  const bf16* d_out, const void* h_saved, const LayerGrads& grads, bf16* db1,
                  bf16* db2, Fp8WeightCache* cache, void* workspace, cudaStream_t stream) {
  const int64_t S = pv.S, d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const Fp8Backward w = carve_backward(cfg, S, mode, workspace, cache == nullptr);
  const GemmOps& g = gemm_ops();

  // The weights' codes: the cache's, or W1's quantized here (recompute's up-projection reads
  // them as they are) and both transposes made from a quantization in w.w.
  WeightCodes k;
  if (cache) {
    k = cached_weights(cfg, w1, w2, *cache, stream);
  } else {
    quantize_weights(w1, E, R, d, w.w, stream);
    k.w1 = w.w, k.w1t = w.w1t, k.w2t = w.w2t;
  }
  Codes h = h_saved ? kept_h(cfg, S, h_saved) : w.h;
  if (mode == LayerMode::recompute) {
    fp8::gather_quantize_1x128_async(x, pv.expert_token_indices, S, d, d, w.x.q, w.x.s, stream);
    gemm_fp8(pv, cfg, w.x, k.w1, w.h16, R, d, w.scratch, w.scratch_bytes, stream);
    fp8::act_quantize_async(w.h16, S, n, cfg.activation, b1, pv.expert_token_offsets, E,
                            nullptr, nullptr, h.q, h.s, stream);
  }
  if (!cache) {
    fp8::transpose_blocks_async(w.w.q, w.w.s, E, R, d, w.w1t.q, w.w1t.s, stream);
    quantize_weights(w2, E, d, n, w.w, stream);
    fp8::transpose_blocks_async(w.w.q, w.w.s, E, d, n, w.w2t.q, w.w2t.s, stream);
  }

  fp8::gather_quantize_1x128_async(d_out, pv.expert_token_indices, S, d, d, w.dout.q, w.dout.s,
                                   stream);
  gemm_fp8(pv, cfg, w.dout, k.w2t, w.da, n, d, w.scratch, w.scratch_bytes, stream);
  fp8::dact_quantize_async(h.q, h.s, w.da, pv.slot_weights, S, n, cfg.activation, w.a_scaled,
                           w.ds_partials, w.ds, w.dh, w.dh_q.q, w.dh_q.s, stream);

  g.dw2_proj(pv, d_out, w.a_scaled, grads.dw2.as<bf16>(), d, n, stream);
  // b2's share: A' is dead now (dW2 read it last), so its bytes hold the pass's partials.
  if (b2)
    bias2_backward(pv, d_out, b2, reinterpret_cast<float*>(w.a_scaled), w.ds, db2, d, stream);
  gather_pair_grads(pv, w.ds, grads.d_pair_weights.as<float>(), stream);
  ascending_token_slots(pv, w.dx_order, stream);
  RoutingPlanView by_slot = pv;  // dx sums each token's slots in ascending order
  by_slot.token_index_map = w.dx_order;
  gemm_fp8(pv, cfg, w.dh_q, k.w1t, w.dx_slots, d, R, w.scratch, w.scratch_bytes, stream);
  aggregate_rows(by_slot, w.dx_slots, nullptr, grads.dx.data, d, DType::bf16, stream);
  g.dw1_proj(pv, w.dh, x, grads.dw1.as<bf16>(), d, n, cfg.activation, stream);
  if (db1) expert_column_sums(pv, w.dh, /*gathered=*/false, /*weighted=*/false, db1, R, stream);
}

}  // namespace moeblaze::cuda
