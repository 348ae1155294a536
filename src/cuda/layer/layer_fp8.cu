// The MoE layer with FP8 compute on the GPU (LayerConfig::compute == fp8; docs/FP8.md): the recipe
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
// The weight gradients stay bf16 with compute fp8, as in the CPU emulation (docs/FP8.md says why).
// With fp8_wgrad, 5 and 8 are FP8 varlen-K GEMMs: dO, A' (dW2) and dH, X (dW1) quantized in
// 128x1 tiles along each expert's slots, transposed and padded per expert
// (fp8/quantize_tokens.hpp). Backward's transients live in dW2's, dx's and dW1's bytes until
// those are written, the rest in the workspace (backward_plan, a core/memory_plan.hpp value).
// Not yet fused: X and dO are gathered into (S, d) code buffers (half the bytes of a bf16 copy)
// and the activation runs as its own pass over a bf16 H, because the FP8 GEMM (CUTLASS's
// blockwise-scaled pointer-array kernel) has a contiguous A and a plain epilogue. No token
// chunks or expert ranges (dX̃ (S, d) takes dW1's bytes where it fits). The weights are
// quantized in every call, or once per Fp8WeightCache (LayerOptions::fp8_weights) until the
// caller says they changed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/carver.hpp"
#include "core/memory_plan.hpp"
#include "core/fp8.hpp"
#include "core/fp8_weight_cache.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/act_quantize.hpp"
#include "cuda/fp8/quantize.hpp"
#include "cuda/fp8/quantize_tokens.hpp"
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

// Backward's transients, placed by core/memory_plan.hpp into the bytes of dW2, dx and dW1 before
// the steps that write them, the rest into the workspace. The steps of fp8_backward:
//   0 W1 → codes (w)                 1 recompute: X codes, up-proj (h16), H codes (h)
//   2 W1ᵀ codes (w1t), W2 → w, W2ᵀ (w2t)                  3 dO gathered → codes (dout)
//   4 dA' = dOq W2q (da)             5 dact_quantize: A', ds partials, ds, dH, dH codes
//   6 dW2 (fp8_wgrad: poff, dO and A' token tiles); db2 in A''s bytes; d_pair_weights
//   7 dx_order; dX̃ = dHq W1q (dx_slots)                   8 aggregate → dx
//   9 db1; fp8_wgrad: dH's token tiles (dh_t)             10 dW1 (fp8_wgrad: X's token tiles)
constexpr int kWritesDw2 = 6, kWritesDx = 8, kWritesDw1 = 10;

struct Fp8Backward {
  void* scratch = nullptr;  // the FP8 GEMMs' argument arrays and TMA descriptors (one at a time)
  size_t scratch_bytes = 0;
  Codes h;                  // (S, R), (S, R/128): recompute's H codes (keep_h: the saved ones)
  bf16* a_scaled = nullptr; // (S, n): A' = s·A, dW2's operand
  float* ds = nullptr;      // (S,)
  float* ds_partials = nullptr;  // (S, n/128): ds per 128 columns of a, summed in order
  bf16* dh = nullptr;       // (S, R): dW1's and db1's operand
  Codes dh_q;               // (S, R), (S, R/128): dX̃'s A
  int32_t* dx_order = nullptr;  // (S,) each token's slots ascending
  Codes x;                  // (S, d) recompute only: X by slot
  bf16* h16 = nullptr;      // (S, R) recompute only: the up-projection's output
  Codes dout;               // (S, d), (S, d/128): dO by slot
  bf16* da = nullptr;       // (S, n): dA'
  bf16* dx_slots = nullptr; // (S, d): dX̃
  // fp8_wgrad, S' = padded_tokens_bound(S, E) padded slots (quantize_tokens.hpp's layout):
  int32_t* poff = nullptr;  // (E+1,) each expert's first padded slot
  Codes dout_t, a_t;        // (d, S'), (n, S') and their (·, S'/128) scales: dW2's operands
  Codes dh_t, x_t;          // (R, S'), (d, S'): dW1's
  // Without a weight cache: W1ᵀ, W2ᵀ, and one weight's codes before their transpose (W1's
  // first, which recompute's up-projection reads as they are, then W2's).
  Codes w1t, w2t, w;
};

// Bytes of `elems` codes, then (16-byte aligned) `groups` fp32 scales.
size_t codes_bytes(int64_t elems, int64_t groups) {
  return (size_t(elems) + 15) / 16 * 16 + size_t(groups) * sizeof(float);
}
Codes codes_at(void* p, int64_t elems) {
  if (p == nullptr) return {};
  char* b = static_cast<char*>(p);
  return {reinterpret_cast<uint8_t*>(b), reinterpret_cast<float*>(b + (elems + 15) / 16 * 16)};
}

size_t backward_scratch_bytes(const LayerConfig& cfg) {
  size_t b = gemm::fp8::contiguous_scratch_bytes(cfg.E);
  if (cfg.compute == Compute::fp8_wgrad)
    b = std::max(b, gemm::fp8::varlen_k_scratch_bytes(cfg.E));
  return b;
}

// The placement of backward's transients (a pure function of the shapes, mode and whether the
// weights' codes need room). Arenas: dW2, dx, dW1 (16-byte aligned outputs), the workspace.
MemoryPlan backward_plan(const LayerConfig& cfg, int64_t S, LayerMode mode, bool weights,
                         size_t scratch_bytes) {
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows(), T = cfg.T;
  const bool recompute = mode == LayerMode::recompute;
  const bool wgrad = cfg.compute == Compute::fp8_wgrad;
  const int64_t Sp = wgrad ? fp8::padded_tokens_bound(S, E) : 0, gp = Sp / kFp8Group;
  const size_t es = sizeof(bf16);
  const std::vector<ArenaSpec> arenas = {
      {"dw2", size_t(E * d * n) * es, kWritesDw2, 16},
      {"dx", size_t(T * d) * es, kWritesDx, 16},
      {"dw1", size_t(E * R * d) * es, kWritesDw1, 16},
      {"workspace", 0, kWritesDw1 + 1, 256}};
  auto if_ = [](bool on, size_t bytes) { return on ? bytes : size_t(0); };
  // First fit in this order: the scratch; dX̃, so that it takes dW1's bytes before smaller
  // pieces scatter there; dW1's FP8 operands before dH, so that X's codes can reuse dH's bytes;
  // then the rest, largest first.
  const std::vector<BufferSpec> buffers = {
      {"scratch", scratch_bytes, 0, 10},
      {"dx_slots", size_t(S * d) * es, 7, 8},
      {"dh_t", if_(wgrad, codes_bytes(R * Sp, R * gp)), 9, 10},
      {"x_t", if_(wgrad, codes_bytes(d * Sp, d * gp)), 10, 10},
      // fp8_wgrad's dW1 reads dH's codes (dh_t, made at step 9), fp8's dH itself.
      {"dh", size_t(S * R) * es, 5, wgrad ? 9 : 10},
      {"dout", codes_bytes(S * d, S * g128(d)), 3, 4},
      {"x", if_(recompute, codes_bytes(S * d, S * g128(d))), 1, 1},
      {"h16", if_(recompute, size_t(S * R) * es), 1, 1},
      {"h", if_(recompute, codes_bytes(S * R, S * g128(R))), 1, 5},
      {"w", if_(weights, codes_bytes(E * std::max(R * d, d * n),
                                     E * std::max(g128(R) * g128(d), g128(d) * g128(n)))),
       0, 2},
      {"w1t", if_(weights, codes_bytes(E * d * R, E * g128(d) * g128(R))), 2, 7},
      {"w2t", if_(weights, codes_bytes(E * n * d, E * g128(n) * g128(d))), 2, 4},
      {"da", size_t(S * n) * es, 4, 5},
      {"a_scaled", size_t(S * n) * es, 5, 6},
      {"dh_q", codes_bytes(S * R, S * g128(R)), 5, 7},
      {"dout_t", if_(wgrad, codes_bytes(d * Sp, d * gp)), 6, 6},
      {"a_t", if_(wgrad, codes_bytes(n * Sp, n * gp)), 6, 6},
      {"ds", size_t(S) * sizeof(float), 5, 6},
      {"ds_partials", size_t(S * g128(n)) * sizeof(float), 5, 5},
      {"dx_order", size_t(S) * sizeof(int32_t), 7, 8},
      {"poff", if_(wgrad, size_t(E + 1) * sizeof(int32_t)), 6, 10}};
  return plan_memory(arenas, buffers);
}

Fp8Backward carve_backward(const MemoryPlan& plan, const LayerConfig& cfg, int64_t S,
                           size_t scratch_bytes, const std::vector<void*>& bases) {
  const int64_t d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const int64_t Sp = fp8::padded_tokens_bound(S, E);
  auto at = [&](const char* name) { return plan.address(name, bases); };
  Fp8Backward w;
  w.scratch = at("scratch");
  w.scratch_bytes = scratch_bytes;
  w.dh = static_cast<bf16*>(at("dh"));
  w.dx_slots = static_cast<bf16*>(at("dx_slots"));
  w.dout = codes_at(at("dout"), S * d);
  w.x = codes_at(at("x"), S * d);
  w.h16 = static_cast<bf16*>(at("h16"));
  w.h = codes_at(at("h"), S * R);
  w.w = codes_at(at("w"), E * std::max(R * d, d * n));
  w.w1t = codes_at(at("w1t"), E * d * R);
  w.w2t = codes_at(at("w2t"), E * n * d);
  w.da = static_cast<bf16*>(at("da"));
  w.a_scaled = static_cast<bf16*>(at("a_scaled"));
  w.dh_q = codes_at(at("dh_q"), S * R);
  w.dout_t = codes_at(at("dout_t"), d * Sp);
  w.a_t = codes_at(at("a_t"), n * Sp);
  w.dh_t = codes_at(at("dh_t"), R * Sp);
  w.x_t = codes_at(at("x_t"), d * Sp);
  w.ds = static_cast<float*>(at("ds"));
  w.ds_partials = static_cast<float*>(at("ds_partials"));
  w.dx_order = static_cast<int32_t*>(at("dx_order"));
  w.poff = static_cast<int32_t*>(at("poff"));
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
                        scratch_bytes, stream, gemm::choose_fp8_kernel());
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

MemoryPlan fp8_backward_plan(const LayerConfig& cfg, int64_t S, LayerMode mode, bool weights,
                             size_t scratch_bytes) {
  return backward_plan(cfg, S, mode, weights, scratch_bytes);
}

size_t fp8_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, bool forward,
                           bool weights) {
  return forward ? carve_forward(cfg, S, nullptr, weights).bytes
                 : backward_plan(cfg, S, mode, weights, backward_scratch_bytes(cfg))
                       .workspace_bytes;
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
  const size_t scratch_bytes = backward_scratch_bytes(cfg);
  const MemoryPlan plan = backward_plan(cfg, S, mode, cache == nullptr, scratch_bytes);
  const Fp8Backward w = carve_backward(plan, cfg, S, scratch_bytes,
                                       {grads.dw2.data, grads.dx.data, grads.dw1.data, workspace});
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

  const bool wgrad = cfg.compute == Compute::fp8_wgrad;
  const int32_t* eto = pv.expert_token_offsets;
  if (wgrad) {
    fp8::padded_token_offsets_async(eto, E, w.poff, stream);
    fp8::quantize_tokens_128x1_async(d_out, d, pv.expert_token_indices, eto, w.poff, E, S, d,
                                     w.dout_t.q, w.dout_t.s, stream);
    fp8::quantize_tokens_128x1_async(w.a_scaled, n, nullptr, eto, w.poff, E, S, n, w.a_t.q,
                                     w.a_t.s, stream);
    gemm::fp8::varlen_k(w.poff, E, d, n, w.dout_t.q, w.dout_t.s, w.a_t.q, w.a_t.s,
                        grads.dw2.as<bf16>(), w.scratch, w.scratch_bytes, stream,
                        gemm::choose_fp8_kernel());
  } else {
    g.dw2_proj(pv, d_out, w.a_scaled, grads.dw2.as<bf16>(), d, n, stream);
  }
  // b2's share: A' is dead now (dW2 read it last), so its bytes hold the pass's partials.
  if (b2)
    bias2_backward(pv, d_out, b2, reinterpret_cast<float*>(w.a_scaled), w.ds, db2, d, stream);
  gather_pair_grads(pv, w.ds, grads.d_pair_weights.as<float>(), stream);
  ascending_token_slots(pv, w.dx_order, stream);
  RoutingPlanView by_slot = pv;  // dx sums each token's slots in ascending order
  by_slot.token_index_map = w.dx_order;
  gemm_fp8(pv, cfg, w.dh_q, k.w1t, w.dx_slots, d, R, w.scratch, w.scratch_bytes, stream);
  aggregate_rows(by_slot, w.dx_slots, nullptr, grads.dx.data, d, DType::bf16, stream);
  // Step 9, then 10 (fp8_wgrad: X's codes take dH's bytes once dH's are made).
  if (db1) expert_column_sums(pv, w.dh, /*gathered=*/false, /*weighted=*/false, db1, R, stream);
  if (wgrad) {
    fp8::quantize_tokens_128x1_async(w.dh, R, nullptr, eto, w.poff, E, S, R, w.dh_t.q, w.dh_t.s,
                                     stream);
    fp8::quantize_tokens_128x1_async(x, d, pv.expert_token_indices, eto, w.poff, E, S, d,
                                     w.x_t.q, w.x_t.s, stream);
    gemm::fp8::varlen_k(w.poff, E, R, d, w.dh_t.q, w.dh_t.s, w.x_t.q, w.x_t.s,
                        grads.dw1.as<bf16>(), w.scratch, w.scratch_bytes, stream,
                        gemm::choose_fp8_kernel());
  } else {
    g.dw1_proj(pv, w.dh, x, grads.dw1.as<bf16>(), d, n, cfg.activation, stream);
  }
}

}  // namespace moeblaze::cuda
