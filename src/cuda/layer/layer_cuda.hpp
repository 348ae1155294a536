// Internals of the CUDA layer (layer_cuda.cu) shared with the GPU materialized baseline and the
// GPU tests: which grouped GEMM implementation runs, the one-buffer workspace layouts, and the
// argument checks only the GPU path needs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/carver.hpp"
#include "core/memory_plan.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/expert_ranges.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/memory.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda {

// The grouped GEMM entry points of src/cuda/gemm/grouped_gemm.hpp, as a table so the layer can
// run on the naive oracle (src/cuda/layer/naive_grouped_gemm.hpp) for cross-checks.
struct GemmOps {
  // The last argument: the expert biases b1 (E, w1_rows), or null.
  void (*up_proj)(const RoutingPlanView&, const bf16*, const bf16*, bf16*, bf16*, int64_t,
                  int64_t, Activation, cudaStream_t, const bf16*);
  void (*down_proj)(const RoutingPlanView&, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                    cudaStream_t, gemm::GemmScratch);
  void (*dh_proj)(const RoutingPlanView&, const bf16*, const bf16*, const bf16*, float*, bf16*,
                  bf16*, int64_t, int64_t, Activation, cudaStream_t);
  void (*reduce_ds)(const float*, float*, int64_t, int64_t, cudaStream_t);
  void (*dw2_proj)(const RoutingPlanView&, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                   cudaStream_t);
  void (*dx_proj)(const RoutingPlanView&, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                  Activation, cudaStream_t, gemm::GemmScratch);
  void (*dw1_proj)(const RoutingPlanView&, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                   Activation, cudaStream_t);
  int64_t (*ds_partials_cols)(int64_t);
  // Scratch of down_proj / dx_proj for S slots over E experts (0: they need none).
  size_t (*scratch_bytes)(int64_t S, int64_t E);
  const char* name;
};

enum class GemmImpl : uint8_t { sm90, naive };
// The table in use (process-wide): set_gemm_impl's choice, else the `impl` kernel override
// (kernel_config.hpp; sm90 unless it says naive). Tests switch it to cross-check the two.
const GemmOps& gemm_ops();
void set_gemm_impl(GemmImpl impl);

// Carver (core/carver.hpp) lays out the workspaces below.
using ::moeblaze::Carver;


// Workspace pieces of one forward / backward call (pointers null when only counting).
struct ForwardWorkspace {
  bf16* a = nullptr;  // (S, n)  activation output, input of the down-projection
  bf16* y = nullptr;  // (chunks.rows, d)  expert outputs of one token chunk (all S slots when
                      //                   one chunk), aggregated into out
  gemm::GemmScratch scratch;  // down_proj's (GemmOps::scratch_bytes; empty: none)
  ChunkMaps maps;             // the forward's chunk maps (count > 1 only)
  size_t bytes = 0;
};
// In expert ranges (ExpertRanges::on, recompute only) the S-row pieces h/dh, a_scaled,
// ds_partials and dx_slots hold one range's rows, R = ranges.capacity_rows; ds and dx_order stay
// whole-step, and dx's fp32 sums are carried from range to range in two halves (the high ones in
// dx itself, the low ones in dx_carry_lo). Nothing goes to dw1's bytes then (dW1 is written range
// by range).
struct BackwardWorkspace {
  bf16* dh = nullptr;           // (S, w1_rows)  dSwiGLU output, read by dX̃ and dW1 (null:
                                //               written over the saved H)
  bf16* h = nullptr;            // (S, w1_rows)  recompute mode only: H recomputed, then dH over it
  bf16* a_scaled = nullptr;     // (S, n)        A' = s·A, second operand of dW2
  bf16* dx_slots = nullptr;     // (chunks.rows, d) dX̃ of one token chunk (all S slots when one
                                //               chunk); reuses the bytes of A', ds_partials
                                //               and ds (all dead by then)
                                // A', ds_partials, ds and dx_slots: in dw1's bytes where they
                                //               fit (Dw1Reuse::shared), else in the workspace
  int32_t* dx_order = nullptr;  // (S,) each token's slots ascending: the order dx sums them in
  float* ds_partials = nullptr;  // (S, ds_partials_cols(n)) per-N-tile partial sums of ds
  float* ds = nullptr;          // (S,) fp32 gate gradient by slot, gathered to pair order
                                //               before dX̃
  uint16_t* dx_carry_lo = nullptr;  // (T, d) expert ranges only: the low halves of dx's fp32
                                    //   partial sums (the high halves sit in dx itself)
  int32_t* range_offsets = nullptr;  // (E+1,) expert ranges only: a range's rebased offsets
  gemm::GemmScratch scratch;    // dx_proj's (GemmOps::scratch_bytes; empty: none), in the
                                //               workspace or dw1's bytes (Dw1Reuse::scratch)
  ChunkMaps maps;               // the backward's chunk maps (count > 1 only)
  size_t bytes = 0;
};
// The chunking the layer runs for S slots in `mode`: choose_token_chunks, or one chunk on the
// naive oracle (it has no row-range GEMMs).
LayerChunks layer_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode);
// The backward's expert ranges for S slots in `mode`: choose_expert_ranges, or off on the naive
// oracle. When on, the backward runs no token chunks.
ExpertRanges layer_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode);
// `chunks`: layer_chunks(cfg, S, mode).forward, or TokenChunks::none(S) for an (S, d) Y.
ForwardWorkspace forward_workspace(const LayerConfig& cfg, int64_t S, const TokenChunks& chunks,
                                   void* base);
// What backward keeps in the bytes of the caller's dw1 (E, w1_rows, d) instead of its workspace:
// dW1, the last GEMM, writes dw1 only after every one of these pieces is dead.
//   shared: A', the ds partials, ds and dX̃ (their region, as the workspace would lay it out,
//           from dw1's first byte) when the region fits in dw1;
//   order: dx_order (S,) int32, from dw1's first byte, when the region does not go there (its
//          dX̃ is larger than dw1: a peak of dX̃, dw1, dw2 and dx, where S·4 bytes count);
//   scratch: dX̃'s TMA scratch, after the region or dx_order (or from dw1's start), at a 256-byte
//            boundary, when there is one and it fits there too.
// A function of the sizes alone, so the workspace size needs no pointer. set_backward_dw1_reuse
// switches the region's placement for the whole process (tests compare the two); it is on by
// default, and when off the scratch alone goes to dw1's start.
struct Dw1Reuse {
  bool shared = false;
  bool order = false;
  bool scratch = false;
  size_t scratch_at = 0;  // byte offset in dw1 the scratch starts at or after (then aligned)
};
Dw1Reuse backward_dw1_reuse(const LayerConfig& cfg, int64_t S, int64_t ds_cols,
                            const TokenChunks& chunks);
void set_backward_dw1_reuse(bool on);
// Its two host-only parts (testable without a GPU): the region's bytes as the workspace lays it
// out (each piece rounded to 256 bytes), and the placement given the sizes (order_bytes: dx_order's,
// rounded to 256; 0 keeps it in the workspace).
size_t backward_shared_bytes(const LayerConfig& cfg, int64_t S, int64_t ds_cols,
                             const TokenChunks& chunks);
Dw1Reuse dw1_reuse_rule(size_t shared_bytes, size_t scratch_bytes, size_t dw1_bytes,
                        size_t order_bytes = 0);
// dh_over_h (keep_h): no room for dH, which the caller writes over the saved H. In recompute mode
// dH always goes over the recomputed H. `chunks`: layer_chunks(...).backward or none(S).
// dw1: the caller's dw1 data (null while only counting bytes). ranges: layer_ranges(...) (null:
// off; when on, `chunks` is not read).
BackwardWorkspace backward_workspace(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                     int64_t ds_cols, const TokenChunks& chunks, void* base,
                                     bool dh_over_h = false, void* dw1 = nullptr,
                                     const ExpertRanges* ranges = nullptr);

// Checks what only the GPU path needs (storage dtype bf16, dims the GEMM kernels take, tensors
// and plan on the device, 16-byte aligned data) and throws Unsupported / InvalidArgument naming
// the argument. `tensors` / `names`: the caller's tensors to check for device and alignment.
void check_gpu_layer_args(const LayerConfig& cfg, const RoutingPlan& plan,
                          std::initializer_list<const TensorView*> tensors,
                          std::initializer_list<const char*> names);

// FP8 compute (cfg.compute == fp8; layer_fp8.cu): the recipe of docs/FP8.md on the FP8 grouped
// GEMMs. check_fp8_gpu_shape: d and n multiples of 128 (Unsupported naming the dimension).
// fp8_forward / fp8_backward run one pass on a workspace of fp8_workspace_bytes (S slots;
// weights: with room for the weights' codes, which a call without a cache needs);
// h_keep / h_saved: the kept H (cfg.kept_h_bytes(S): codes, then scales), null in recompute;
// cache: LayerOptions::fp8_weights or null. Backward is called with S > 0 only (the caller
// zero-fills the gradients of an empty plan).
void check_fp8_gpu_shape(const LayerConfig& cfg);
// Where fp8_backward keeps its transients for these shapes (core/memory_plan.hpp): in dW2's, dx's
// and dW1's bytes before they are written, else the workspace. A host computation; scratch_bytes
// is the FP8 GEMMs' scratch (its size depends on the device; 0 leaves it out of the plan).
MemoryPlan fp8_backward_plan(const LayerConfig& cfg, int64_t S, LayerMode mode, bool weights,
                             size_t scratch_bytes);
size_t fp8_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, bool forward,
                           bool weights = true);
void fp8_forward(const LayerConfig& cfg, const RoutingPlanView& pv, const bf16* x,
                 const bf16* w1, const bf16* w2, const bf16* b1, const bf16* b2, void* h_keep,
                 void* out, Fp8WeightCache* cache, void* workspace, cudaStream_t stream);
void fp8_backward(const LayerConfig& cfg, const RoutingPlanView& pv, LayerMode mode,
                  const bf16* x, const bf16* w1, const bf16* w2, const bf16* b1, const bf16* b2,
                  const bf16* d_out, const void* h_saved, const LayerGrads& grads, bf16* db1,
                  bf16* db2, Fp8WeightCache* cache, void* workspace, cudaStream_t stream);

// The GPU materialized baseline's per-call workspace (src/baselines/materialized_cuda.cu).
size_t materialized_workspace_bytes(const LayerConfig& cfg, int64_t S);

// data[i] = N(0, stddev) from a counter-based hash of (seed, i); never exactly zero.
// (src/cuda/layer/fill_random.cu; benchmark inputs.)
void fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, float stddev,
                 cudaStream_t stream);

// The dense upper bound (src/baselines/dense_bound_cuda.cu): cuBLAS strided-batched bf16 GEMMs
// over E experts with exactly m = S / E tokens each, contiguous, doing the layer's FLOPs:
// forward = up-proj GEMM, activation, down-proj GEMM; backward = dA, dW2, dX, dW1 GEMMs and the
// activation backward. No routing, gather or aggregation: the ceiling for any grouped GEMM.
class DenseBound {
 public:
  DenseBound(const LayerConfig& cfg, int64_t S, uint64_t seed, cudaStream_t stream);
  ~DenseBound();
  DenseBound(const DenseBound&) = delete;
  DenseBound& operator=(const DenseBound&) = delete;
  void forward();
  void backward();
  int64_t tokens_per_expert() const;
  size_t kept_bytes() const;       // H and A: what backward reads besides inputs
  size_t transient_bytes() const;  // every intermediate it allocates (H, A, Y, dA, dH, dX)

 private:
  struct Impl;
  Impl* impl_;
};

inline cudaStream_t stream_of(const LayerOptions& opts) {
  return static_cast<cudaStream_t>(opts.stream);
}

}  // namespace moeblaze::cuda
