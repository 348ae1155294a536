// The MoE layer: forward and backward through a routing plan (docs/DESIGN.md's eight steps).
//
// Tensors (all one dtype, cfg.dtype, on one device; gradients likewise):
//   x   (T, d)        input tokens                 out (T, d)   o_t = sum_p s_p W2_e a_p
//   w1  (E, 2n, d)    gated: rows [0,n) gate, [n,2n) up;  (E, n, d) non-gated
//   w2  (E, d, n)
//   b1  (E, w1_rows)  optional expert biases (LayerBiases): h = W1_e x + b1_e, y = W2_e a + b2_e
//   b2  (E, d)        (gpt-oss); keep_h and recompute, CPU and CUDA
// Backward additionally takes d_out (T, d) and writes dx (T, d), dw1, dw2 (weights' shapes) and
// d_pair_weights (P,) fp32: the gradient of each routing pair's gate weight s_p, token-major
// like the routing, to feed router_backward.
//
// Implementations (LayerMode):
//   keep_h       keep H (S, w1_rows) and the plan; A is recomputed in backward (the default)
//   recompute    keep only the plan; H is recomputed in backward (one more up-proj GEMM)
//   materialized the conventional pipeline kept as a baseline: copies x into (S, d), unfused
//                activation, keeps Xs (S,d), H, act(g) (S,n), A (S,n) and Y (S,d) for backward
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "moeblaze/config.hpp"
#include "moeblaze/memory.hpp"
#include "moeblaze/routing_plan.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze {

enum class LayerMode : uint8_t { keep_h, recompute, materialized };
const char* layer_mode_name(LayerMode m);  // "moeblaze", "moeblaze-recompute", "materialized"

// The largest thread count an entry point accepts (num_threads, the CLI's --threads).
constexpr int kMaxThreads = 1024;

// FP8 compute's weight codes kept between calls (LayerOptions::fp8_weights; the CUDA backend):
// W1 and W2 as e4m3 codes with 128x128-block scales, as stored and transposed (FP8 WGMMA reads
// both operands K-major, so dA' and dX~ need the transposes). The first call given the cache
// quantizes them; later calls reuse the codes until weights_changed(). The library cannot see an
// in-place update of the weights, so the caller says when it made one (after each optimizer
// step); a call with other weight pointers or shapes requantizes by itself. Device memory
// (accounted): about 2 E (w1_rows d + d n) bytes, allocated at the first call with a shape (a
// host sync; outside a CUDA graph capture, which it refuses by name) and freed, after a device
// sync, when the cache is destroyed; the caller's streams may end before it. Not thread-safe:
// calls sharing a cache run in stream order (one stream, or synchronised). The CPU backend,
// which emulates the recipe, quantizes on every call and ignores it.
class Fp8WeightCache {
 public:
  Fp8WeightCache();
  ~Fp8WeightCache();
  Fp8WeightCache(const Fp8WeightCache&) = delete;
  Fp8WeightCache& operator=(const Fp8WeightCache&) = delete;
  void weights_changed();
  size_t bytes() const;           // device bytes held
  int64_t quantizations() const;  // how many times a call (re)computed the codes
  struct State;                   // the CUDA backend's (src/core/fp8_weight_cache.hpp)
  State& state() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

struct LayerOptions {
  LayerMode mode = LayerMode::keep_h;
  // CPU backend: 0 = all hardware threads, else 1..kMaxThreads. Results do not depend on it.
  int num_threads = 0;
  void* stream = nullptr;  // CUDA backend: the cudaStream_t to run on (nullptr = default stream)

  // Caller-provided memory (keep_h / recompute only; nullptr = the library allocates its own,
  // accounted). Borrowed memory is not counted in memory_stats.
  //   workspace    this call's temporaries: workspace_bytes >= layer_workspace_bytes(cfg, S,
  //                mode, device) (CPU: for the thread count the call runs with), on the plan's
  //                device, 64-byte aligned; free again when the call's work is done (CUDA: in
  //                stream order)
  //   h_storage    forward, keep_h: cfg.kept_h_bytes(S) bytes for H ((S, w1_rows) cfg.dtype;
  //                e4m3 codes and scales with fp8 compute), 16-byte aligned;
  //                `saved` then borrows it and the caller keeps it alive until backward returns
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  void* h_storage = nullptr;

  // backward, keep_h, CUDA backend: write dH over the saved H (each element of H is read before
  // its dH is written, by the same thread) instead of into the workspace, so backward needs
  // S * w1_rows * dtype_size fewer workspace bytes (layer_workspace_bytes with LayerPass). H is
  // garbage afterwards: `saved` must not serve another backward. The CPU backend ignores it.
  bool dh_over_h = false;

  // CUDA backend: check the contents of a plan that is not library_built() on the device
  // (cuda::validate_plan: one kernel, one host sync) before any kernel reads it, throwing
  // InvalidArgument naming the broken rule with every output untouched. Off by default: the
  // CUDA path never synchronises, and an unchecked bad plan makes its kernels read out of bounds.
  // The CPU backend always checks such plans and ignores it.
  bool check_plan = false;

  // compute fp8 (CUDA backend): the weights' codes from this cache instead of quantizing them in
  // every call (see Fp8WeightCache); nullptr = quantize W1 and W2 in each forward and backward.
  // Given with storage compute: InvalidArgument.
  Fp8WeightCache* fp8_weights = nullptr;
};

namespace detail {
struct SavedAccess;  // the backends' access to SavedForBackward's state (src/core/saved_access.hpp)
}

// What forward keeps for backward. Owns its buffers (accounted); references the plan, which the
// caller keeps alive until backward returns.
class SavedForBackward {
 public:
  SavedForBackward() = default;
  SavedForBackward(SavedForBackward&&) = default;
  SavedForBackward& operator=(SavedForBackward&&) = default;

  LayerMode mode() const { return mode_; }
  bool valid() const { return valid_; }
  // Bytes owned by this object (H, or the materialized baseline's tensors). The plan's bytes are
  // reported by RoutingPlan::bytes(); kept-for-backward = bytes() + plan.bytes().
  size_t bytes() const;

  // What layer_forward would leave for layer_backward, over caller storage: mode keep_h with H
  // at `h` (h_bytes = cfg.kept_h_bytes(S) of it, borrowed), or recompute (h = nullptr, 0).
  // For callers that keep H themselves between forward and backward (the C ABI, PyTorch).
  static SavedForBackward borrow(LayerMode mode, int64_t S, Device device, void* h,
                                 size_t h_bytes);


 private:
  // Backend-defined state; the backends in other translation units fill and read it through
  // detail::SavedAccess, an internal header, so callers of the library cannot.
  friend struct detail::SavedAccess;
  LayerMode mode_ = LayerMode::keep_h;
  bool valid_ = false;
  int64_t S_ = 0;
  Buffer h_;       // (S, w1_rows) cfg.dtype — keep_h and materialized
  Buffer xs_;      // (S, d)  materialized only: gathered copy of x
  Buffer act_g_;   // (S, n)  materialized only: act(g) (gated) — saved by autograd of act
  Buffer a_;       // (S, n)  materialized only
  Buffer y_;       // (S, d)  materialized only: expert outputs, for the gate-weight gradient
};

// Optional expert biases, each alone or both: a rank-0 (default) view means no such bias.
// cfg.dtype, contiguous, on the data's device; inputs for the aliasing rule below.
struct LayerBiases {
  TensorView b1;  // (E, w1_rows)  added to H before the activation (H keeps it)
  TensorView b2;  // (E, d)        added to each expert's output before the weighted sum
};

struct LayerGrads {
  TensorView dx;              // (T, d)
  TensorView dw1;             // like w1
  TensorView dw2;             // like w2
  TensorView d_pair_weights;  // (P,) fp32, P = plan.S()
  // Given exactly when the matching bias is (like it; rank 0 otherwise). fp32 accumulation in
  // slot order: db1_e = Σ dH_p, db2_e = Σ s_p dO_t over the slots of e.
  TensorView db1 = {};
  TensorView db2 = {};
};

// Aliasing: no output may share a byte with an input or with another output (forward: out,
// opts.h_storage and opts.workspace against x, w1, w2, b1, b2 and the plan's arrays; backward:
// dx, dw1, dw2, d_pair_weights, db1, db2 and opts.workspace against x, w1, w2, b1, b2, d_out,
// saved H and the plan's arrays). Backward writes dx before it reads x and d_out for the weight gradients, so an
// in-place call would be wrong: it is rejected with InvalidArgument naming both arguments, in
// every mode and on every device.
//
// Runs forward; fills `saved` (replacing its contents). Validates everything first and leaves
// `out` untouched on error. T = 0 is valid (nothing to do).
void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const TensorView& out,
                   SavedForBackward& saved, const LayerOptions& opts = {});

// Runs backward from `saved` (which must come from layer_forward with the same arguments).
// On CUDA in keep_h / recompute mode the plan's token_expert_indices may be null (a RoutingPlan
// borrowed without it): backward never reads it, so the caller need not keep it after forward.
void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                    const SavedForBackward& saved, const LayerGrads& grads,
                    const LayerOptions& opts = {});

// The same with expert biases (the overloads above pass none). keep_h and recompute on both
// backends (CUDA: b1 in the up-projection's epilogue, b2 in the aggregation); the materialized
// baseline throws Unsupported for a bias.
void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts = {});
void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts = {});

// Bytes of the one workspace Buffer that a layer_forward or layer_backward call allocates for its
// temporaries on `device`, for a plan of S assignments: the larger of the two calls' needs.
// Reported before the call so a caller can budget memory; the
// kept-for-backward bytes (SavedForBackward::bytes()) are separate.
size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, Device device);

// What one pass alone needs (a caller that allocates per call, as the PyTorch front end does):
// forward's, or backward's with LayerOptions::dh_over_h as given. layer_workspace_bytes above is
// never less than either. fp8_weights_cached: the call passes LayerOptions::fp8_weights (compute
// fp8 on CUDA then needs no room for the weights' codes in the workspace).
enum class LayerPass : uint8_t { forward, backward };
size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, Device device,
                             LayerPass pass, bool dh_over_h = false,
                             bool fp8_weights_cached = false);

}  // namespace moeblaze
