// The MoE layer on the GPU: docs/DESIGN.md's eight steps wired into forward and backward.
//
// forward   1 up-proj (x gathered)  → H (kept, keep_h only) and A        [workspace: A]
//           2 down-proj             → Y                                 [workspace: Y]
//           3 aggregate             → out_t = Σ s_p Y[slot]
// backward  (recompute: up-proj again, H only, into the workspace)
//           4 dH (dO gathered)      → dH, A' = s·A, ds partials        [workspace]
//             ds reduction (fixed order)
//           5 dW2 (varlen-K)        ← dO gathered, A'
//             d_pair_weights[p] = ds[token_index_map[p]]
//           6 dX̃                    → dX̃ (over the dead A', ds partials and ds)
//           7 aggregate             → dx_t = Σ dX̃[slot], a token's slots in ascending order
//           8 dW1 (varlen-K)        ← dH, x gathered
// Expert biases (optional): b1 in the up-projection's epilogue (H keeps it), b2 in the
// aggregation; backward adds <dO_t, b2_e> to ds and sums db1 / db2 per expert (expert_bias.cu).
// Y and dX̃ run in token chunks where token_chunks.hpp's rule says (recompute mode: bitwise the
// same outputs, a chunk-sized buffer instead of (S, d)); recompute's backward runs in expert
// ranges where expert_ranges.hpp's rule says (bitwise the same outputs, range-sized H/dH, A' and
// dX̃ instead of (S, ·)).
// Each step ends with mark_step (step_marks.hpp): a no-op unless a benchmark times the steps
// inside the call.
// Kept for backward: H (keep_h) and the plan, nothing else; every temporary comes from one
// workspace Buffer per call, sized by layer_workspace_bytes. All work is stream-ordered on
// opts.stream, so a piece of the workspace is reused as soon as its last reader was enqueued.
#include "cuda/layer/layer_cuda.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/saved_access.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/gemm_checks.hpp"  // check_gpu_activation
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/naive_grouped_gemm.hpp"
#include "cuda/layer/step_marks.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {

using Saved = moeblaze::detail::SavedAccess;

namespace {

// The sm90 GEMMs with their kernel choice left automatic (grouped_gemm.hpp, GatherKernel).
void sm90_up_proj(const RoutingPlanView& p, const bf16* x, const bf16* w1, bf16* h, bf16* a,
                  int64_t d, int64_t n, Activation act, cudaStream_t s, const bf16* b1) {
  gemm::up_proj(p, x, w1, h, a, d, n, act, s, gemm::GatherKernel::automatic, b1);
}
void sm90_dh_proj(const RoutingPlanView& p, const bf16* d_out, const bf16* w2, const bf16* h,
                  float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                  Activation act, cudaStream_t s) {
  gemm::dh_proj(p, d_out, w2, h, ds_partials, dh, a_scaled, d, n, act, s);
}
void sm90_dw2_proj(const RoutingPlanView& p, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
                   int64_t d, int64_t n, cudaStream_t s) {
  gemm::dw2_proj(p, d_out, a_scaled, dw2, d, n, s);
}
void sm90_dw1_proj(const RoutingPlanView& p, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
                   int64_t n, Activation act, cudaStream_t s) {
  gemm::dw1_proj(p, dh, x, dw1, d, n, act, s);
}
const GemmOps kSm90Ops = {sm90_up_proj,           gemm::down_proj, sm90_dh_proj,
                          gemm::reduce_ds,        sm90_dw2_proj,   gemm::dx_proj,
                          sm90_dw1_proj,          gemm::ds_partials_cols,
                          gemm::layer_gemm_scratch_bytes, "sm90"};
// The naive oracle takes no scratch: thin adapters to the table's signatures.
void naive_down_proj(const RoutingPlanView& p, const bf16* a, const bf16* w2, bf16* y, int64_t d,
                     int64_t n, cudaStream_t s, gemm::GemmScratch) {
  naive::down_proj(p, a, w2, y, d, n, s);
}
void naive_dx_proj(const RoutingPlanView& p, const bf16* dh, const bf16* w1, bf16* dx, int64_t d,
                   int64_t n, Activation act, cudaStream_t s, gemm::GemmScratch) {
  naive::dx_proj(p, dh, w1, dx, d, n, act, s);
}
size_t no_scratch(int64_t, int64_t) { return 0; }
const GemmOps kNaiveOps = {naive::up_proj,  naive_down_proj, naive::dh_proj,
                           naive::reduce_ds, naive::dw2_proj, naive_dx_proj,
                           naive::dw1_proj, naive::ds_partials_cols, no_scratch, "naive"};

// A Carver piece of `bytes` (gemm_ops().scratch_bytes); empty when that is 0.
gemm::GemmScratch take_scratch(Carver& c, size_t bytes) {
  if (bytes == 0) return {};
  return {c.take<char>(static_cast<int64_t>(bytes)), bytes};
}

// The scratch to hand a contiguous-A GEMM: the workspace's TMA scratch where its chosen kernel is
// the TMA path (a given scratch selects it), else none.
gemm::GemmScratch tma_scratch(gemm::GemmScratch s, const gemm::GemmKernel& k) {
  return k.family == gemm::KernelFamily::tma_grouped ? s : gemm::GemmScratch{};
}

// -1: not set: the `impl` kernel override decides (kernel_config.hpp).
std::atomic<int> g_gemm_impl{-1};

int64_t w1_rows(const LayerConfig& cfg) { return cfg.w1_rows(); }

}  // namespace

const GemmOps& gemm_ops() {
  const int impl = g_gemm_impl.load();
  if (impl < 0) return gemm::kernel_overrides().naive ? kNaiveOps : kSm90Ops;
  return impl == int(GemmImpl::naive) ? kNaiveOps : kSm90Ops;
}

void set_gemm_impl(GemmImpl impl) { g_gemm_impl.store(int(impl)); }

namespace {

// The four maps of `chunks` (none for one chunk), as ChunkMaps lays them out.
ChunkMaps take_maps(Carver& c, const TokenChunks& chunks, int64_t S, int64_t E) {
  if (chunks.count <= 1) return {};
  ChunkMaps m;
  m.token_bounds = c.take<int32_t>(chunks.count + 1);
  m.expert_rows = c.take<int32_t>((chunks.count + 1) * E);
  m.packed_base = c.take<int32_t>(chunks.count * E);
  m.pair_rows = c.take<int32_t>(S);
  return m;
}

}  // namespace

LayerChunks layer_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode) {
  if (&gemm_ops() == &kNaiveOps) return {TokenChunks::none(S, "naive GEMMs"),
                                         TokenChunks::none(S, "naive GEMMs")};
  return choose_token_chunks(cfg, S, mode);
}

ExpertRanges layer_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode) {
  if (&gemm_ops() == &kNaiveOps) return ExpertRanges::off("naive GEMMs");
  return choose_expert_ranges(cfg, S, mode);
}

ForwardWorkspace forward_workspace(const LayerConfig& cfg, int64_t S, const TokenChunks& chunks,
                                   void* base) {
  Carver c(base);
  ForwardWorkspace w;
  w.a = c.take<bf16>(S * cfg.n);
  w.y = c.take<bf16>(chunks.rows * cfg.d);
  w.scratch = take_scratch(c, gemm_ops().scratch_bytes(S, cfg.E));
  w.maps = take_maps(c, chunks, S, cfg.E);
  w.bytes = c.high_water();
  return w;
}

namespace {

// The region's placement in dw1: on by default (it takes S·(n + 4 ds_cols + 4) bytes off the peak);
// tests switch it off to compare the two placements bit for bit.
std::atomic<bool> g_dw1_reuse{true};

// Carves A', the ds partials, ds and dx_slots into `c` from its current offset. A', the ds
// partials and ds die before dX̃ is written (ds once gathered to pair order): dX̃ takes their
// bytes, so where d > n + 2 ds_cols + 2 they cost no peak.
void take_shared(Carver& c, BackwardWorkspace& w, const LayerConfig& cfg, int64_t S,
                 int64_t ds_cols, const TokenChunks& chunks) {
  const size_t shared = c.mark();
  w.a_scaled = c.take<bf16>(S * cfg.n);
  w.ds_partials = c.take<float>(S * ds_cols);
  w.ds = c.take<float>(S);
  c.rewind(shared);
  w.dx_slots = c.take<bf16>(chunks.rows * cfg.d);
}

// The expert ranges' layout (no dw1 reuse: dW1 is written range by range). R rows per range.
BackwardWorkspace range_workspace(const LayerConfig& cfg, int64_t S, int64_t ds_cols,
                                  const ExpertRanges& ranges, void* base, size_t scratch_bytes) {
  const int64_t R = ranges.capacity_rows;
  Carver c(base);
  BackwardWorkspace w;
  w.h = w.dh = c.take<bf16>(R * cfg.w1_rows());
  w.scratch = take_scratch(c, scratch_bytes);
  w.ds = c.take<float>(S);
  w.dx_order = c.take<int32_t>(S);
  w.dx_carry_lo = c.take<uint16_t>(cfg.T * cfg.d);
  w.range_offsets = c.take<int32_t>(cfg.E + 1);
  const size_t shared = c.mark();  // A' and the ds partials die before dX̃ is written
  w.a_scaled = c.take<bf16>(R * cfg.n);
  w.ds_partials = c.take<float>(R * ds_cols);
  c.rewind(shared);
  w.dx_slots = c.take<bf16>(R * cfg.d);
  w.bytes = c.high_water();
  return w;
}

}  // namespace

void set_backward_dw1_reuse(bool on) { g_dw1_reuse.store(on); }

size_t backward_shared_bytes(const LayerConfig& cfg, int64_t S, int64_t ds_cols,
                             const TokenChunks& chunks) {
  Carver count;
  BackwardWorkspace unused;
  take_shared(count, unused, cfg, S, ds_cols, chunks);
  return count.high_water();
}

Dw1Reuse dw1_reuse_rule(size_t shared_bytes, size_t scratch_bytes, size_t dw1_bytes,
                        size_t order_bytes) {
  Dw1Reuse r;
  r.shared = shared_bytes <= dw1_bytes;
  r.order = !r.shared && order_bytes > 0 && order_bytes <= dw1_bytes;
  r.scratch_at = r.shared ? shared_bytes : r.order ? order_bytes : 0;
  // + 256: the scratch starts at the next 256-byte boundary of dw1 (only 16-byte aligned).
  r.scratch = scratch_bytes > 0 && r.scratch_at + 256 + scratch_bytes <= dw1_bytes;
  return r;
}

namespace {
// backward_dw1_reuse for a known scratch size. With the switch off the region never fits, so
// only the scratch goes to dw1, from its start.
Dw1Reuse dw1_reuse(const LayerConfig& cfg, int64_t S, int64_t ds_cols, const TokenChunks& chunks,
                   size_t scratch_bytes) {
  const size_t region =
      g_dw1_reuse.load() ? backward_shared_bytes(cfg, S, ds_cols, chunks) : SIZE_MAX;
  // dx_order's bytes as the Carver takes it; with the switch off nothing but the scratch goes to dw1.
  const size_t order = g_dw1_reuse.load() ? (size_t(S) * 4 + 255) / 256 * 256 : 0;
  return dw1_reuse_rule(region, scratch_bytes, size_t(cfg.E * w1_rows(cfg) * cfg.d) * 2, order);
}
}  // namespace

Dw1Reuse backward_dw1_reuse(const LayerConfig& cfg, int64_t S, int64_t ds_cols,
                            const TokenChunks& chunks) {
  return dw1_reuse(cfg, S, ds_cols, chunks, gemm_ops().scratch_bytes(S, cfg.E));
}

BackwardWorkspace backward_workspace(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                     int64_t ds_cols, const TokenChunks& chunks, void* base,
                                     bool dh_over_h, void* dw1, const ExpertRanges* ranges) {
  const size_t scratch_bytes = gemm_ops().scratch_bytes(S, cfg.E);
  if (ranges && ranges->on) {
    MOEBLAZE_REQUIRE(mode == LayerMode::recompute,
                     "backward_workspace: expert ranges are recompute mode's");
    return range_workspace(cfg, S, ds_cols, *ranges, base, scratch_bytes);
  }
  const Dw1Reuse reuse = dw1_reuse(cfg, S, ds_cols, chunks, scratch_bytes);
  // A carved workspace (base given) with the region in dw1 needs dw1's bytes, else its pieces are null.
  MOEBLAZE_REQUIRE(base == nullptr || !reuse.shared || dw1 != nullptr,
                   "backward_workspace: dw1 must not be null when the ds region is placed in it");
  MOEBLAZE_REQUIRE(base == nullptr || !reuse.order || dw1 != nullptr,
                   "backward_workspace: dw1 must not be null when dx_order is placed in it");
  Carver c(base);
  BackwardWorkspace w;
  // dH is written over H when H is the workspace's own (recompute) or the caller allows it.
  if (mode == LayerMode::recompute) w.h = w.dh = c.take<bf16>(S * w1_rows(cfg));
  else if (!dh_over_h) w.dh = c.take<bf16>(S * w1_rows(cfg));
  if (!reuse.scratch) w.scratch = take_scratch(c, scratch_bytes);
  w.maps = take_maps(c, chunks, S, cfg.E);
  // Not in the shared region: where dX̃ is exactly dw1's size (olmoe, sm-default) it would push
  // the region out of dw1. Where the region is not in dw1, dw1's first bytes take it.
  if (!reuse.order) w.dx_order = c.take<int32_t>(S);
  // dw1 is only 16-byte aligned (check_gpu_layer_args), which is all these pieces need.
  Carver in_dw1(dw1);
  if (reuse.order) w.dx_order = in_dw1.take<int32_t>(S);
  take_shared(reuse.shared ? in_dw1 : c, w, cfg, S, ds_cols, chunks);
  if (reuse.scratch && dw1 != nullptr) {
    // dX̃'s TMA scratch (CUtensorMaps want 64-byte alignment) at the next 256-byte boundary.
    const uintptr_t at = (reinterpret_cast<uintptr_t>(dw1) + reuse.scratch_at + 255) / 256 * 256;
    w.scratch = {reinterpret_cast<void*>(at), scratch_bytes};
  }
  w.bytes = c.high_water();
  return w;
}

void check_gpu_layer_args(const LayerConfig& cfg, const RoutingPlan& plan,
                          std::initializer_list<const TensorView*> tensors,
                          std::initializer_list<const char*> names) {
  MOEBLAZE_UNSUPPORTED_IF(cfg.dtype != DType::bf16, "dtype ", dtype_name(cfg.dtype),
                          ": the CUDA backend stores bf16; use the CPU backend for fp32");
  gemm::check_gemm_shape(cfg.d, cfg.n);
  gemm::detail::check_gpu_activation("layer", cfg.activation, cfg.E);
  if (is_fp8(cfg.compute)) check_fp8_gpu_shape(cfg);
  MOEBLAZE_REQUIRE(plan.device() == Device::cuda, "plan is on ", device_name(plan.device()),
                   ", expected cuda");
  MOEBLAZE_REQUIRE(plan.T() == cfg.T, "plan has T = ", plan.T(), ", the layer has T = ", cfg.T);
  MOEBLAZE_REQUIRE(plan.E() == cfg.E, "plan has E = ", plan.E(), ", the layer has E = ", cfg.E);
  auto name = names.begin();
  for (const TensorView* t : tensors) {
    require_device(*t, *name, Device::cuda);
    MOEBLAZE_UNSUPPORTED_IF(reinterpret_cast<uintptr_t>(t->data) % 16 != 0, *name,
                            ": the CUDA backend needs 16-byte aligned data");
    ++name;
  }
}

namespace {
// The data of an optional tensor (a bias or its gradient): null when not given.
template <typename T>
T* data_or_null(const TensorView& t) {
  return t.rank != 0 ? static_cast<T*>(t.data) : nullptr;
}
// The biases and their gradients need the 16-byte alignment of every GPU operand.
void check_bias_alignment(std::initializer_list<std::pair<const TensorView*, const char*>> ts) {
  for (const auto& [t, name] : ts)
    MOEBLAZE_UNSUPPORTED_IF(t->rank != 0 && reinterpret_cast<uintptr_t>(t->data) % 16 != 0, name,
                            ": the CUDA backend needs 16-byte aligned data");
}
}  // namespace

size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, bool forward,
                             bool dh_over_h, bool fp8_weights_cached) {
  MOEBLAZE_REQUIRE(S >= 0, "S (", S, ") must be >= 0");
  if (mode == LayerMode::materialized) return materialized_workspace_bytes(cfg, S);
  if (is_fp8(cfg.compute))
    return fp8_workspace_bytes(cfg, S, mode, forward, !fp8_weights_cached);
  const LayerChunks chunks = layer_chunks(cfg, S, mode);
  if (forward) return forward_workspace(cfg, S, chunks.forward, nullptr).bytes;
  const ExpertRanges ranges = layer_ranges(cfg, S, mode);
  return backward_workspace(cfg, S, mode, gemm_ops().ds_partials_cols(cfg.n), chunks.backward,
                            nullptr, dh_over_h, nullptr, &ranges)
      .bytes;
}

void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts) {
  MOEBLAZE_REQUIRE(opts.mode == LayerMode::keep_h || opts.mode == LayerMode::recompute,
                   "cuda::layer_forward: mode ", layer_mode_name(opts.mode),
                   " is the materialized baseline's");
  check_gpu_layer_args(cfg, plan, {&x, &w1, &w2, &out}, {"x", "w1", "w2", "out"});
  check_bias_alignment({{&biases.b1, "b1"}, {&biases.b2, "b2"}});
  const bf16* b1 = data_or_null<const bf16>(biases.b1);  // (E, w1_rows): in the up epilogue
  const bf16* b2 = data_or_null<const bf16>(biases.b2);  // (E, d): in the aggregation
  const GemmOps& g = gemm_ops();
  const cudaStream_t stream = stream_of(opts);
  const int64_t S = plan.S();
  const RoutingPlanView pv = plan.view();

  SavedForBackward next;
  // (S, w1_rows) bf16 (fp8 compute: e4m3 codes and 1x128 scales), slot order: the only
  // activation kept for backward. Caller memory (LayerOptions::h_storage / workspace, checked by
  // the API) is borrowed.
  const size_t h_bytes = cfg.kept_h_bytes(S);
  if (opts.mode == LayerMode::keep_h)
    Saved::h(next) = opts.h_storage ? Buffer::borrow(Device::cuda, opts.h_storage, h_bytes)
                                    : Buffer(Device::cuda, h_bytes, opts.stream);

  if (cfg.T > 0 && is_fp8(cfg.compute)) {
    Buffer ws = opts.workspace
                    ? Buffer::borrow(Device::cuda, opts.workspace, opts.workspace_bytes)
                    : Buffer(Device::cuda,
                             fp8_workspace_bytes(cfg, S, opts.mode, true, !opts.fp8_weights),
                             opts.stream);
    fp8_forward(cfg, pv, x.as<bf16>(), w1.as<bf16>(), w2.as<bf16>(), b1, b2,
                Saved::h(next).data(), out.data, opts.fp8_weights, ws.data(), stream);
  } else if (cfg.T > 0) {
    const TokenChunks chunks = layer_chunks(cfg, S, opts.mode).forward;
    Buffer ws = opts.workspace
                    ? Buffer::borrow(Device::cuda, opts.workspace, opts.workspace_bytes)
                    : Buffer(Device::cuda, forward_workspace(cfg, S, chunks, nullptr).bytes,
                             opts.stream);
    const ForwardWorkspace w = forward_workspace(cfg, S, chunks, ws.data());
    if (S > 0)
      g.up_proj(pv, x.as<bf16>(), w1.as<bf16>(), Saved::h(next).as<bf16>(), w.a, cfg.d, cfg.n,
                cfg.activation, stream, b1);
    mark_step(stream, step::kUpProj);
    if (chunks.count > 1) {
      // Y one token chunk at a time into w.y, each chunk's tokens aggregated before the next.
      build_chunk_maps(pv, chunks, w.maps, stream);
      for (int64_t c = 0; c < chunks.count; ++c) {
        gemm::down_proj_rows(pv, chunk_rows(w.maps, cfg.E, c), w.a, w2.as<bf16>(), w.y, cfg.d,
                             cfg.n, stream, w.scratch);
        mark_step(stream, step::kDownProj);
        aggregate_chunk(pv, chunks, w.maps, c, w.y, pv.slot_weights, out.data, cfg.d, stream,
                        b2);
        mark_step(stream, step::kAggregate);
      }
    } else {
      if (S > 0)
        g.down_proj(pv, w.a, w2.as<bf16>(), w.y, cfg.d, cfg.n, stream,
                    tma_scratch(w.scratch, gemm::choose_kernels({S, cfg.E, cfg.d, cfg.n}).down));
      mark_step(stream, step::kDownProj);
      aggregate_rows(pv, w.y, pv.slot_weights, out.data, cfg.d, DType::bf16, stream, b2);
      mark_step(stream, step::kAggregate);
    }
    // The workspace is freed when `ws` goes out of scope, in stream order after the kernels
    // above (Buffer is stream-ordered on opts.stream).
  }
  Saved::mark_filled(next, opts.mode, S);
  saved = std::move(next);
}

namespace {

// Recompute's backward over the expert ranges of `ranges` (expert_ranges.hpp): per range, the
// whole step's GEMMs with the whole step's kernel choice over a sub-plan of the range's experts,
// dW1 / dW2 (and db1 / db2) of those experts complete, dX̃ summed into dx through an fp32 carry
// (high halves in dx, low halves in w.dx_carry_lo).
void backward_in_ranges(const LayerConfig& cfg, const RoutingPlanView& pv,
                        const ExpertRanges& ranges, const BackwardWorkspace& w, const bf16* x,
                        const bf16* w1, const bf16* w2, const bf16* b1, const bf16* b2,
                        const bf16* d_out, const LayerGrads& grads, bf16* db1, bf16* db2,
                        cudaStream_t stream) {
  // The ranges are cut from the expert counts: the one host sync of this backward.
  std::vector<int32_t> off(size_t(cfg.E) + 1);
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(off.data(), pv.expert_token_offsets,
                                      off.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                      stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<ExpertRange> list = split_expert_ranges(off, ranges);
  // The whole step's kernels, for the bits: a range's own shape could choose others.
  const gemm::LayerKernels k =
      gemm::choose_kernels({pv.S, cfg.E, cfg.d, cfg.n, cfg.activation});
  const int64_t d = cfg.d, n = cfg.n, W = cfg.w1_rows();
  const gemm::GatherKernel automatic = gemm::GatherKernel::automatic;
  bf16* dx = grads.dx.as<bf16>();
  bf16* dw1 = grads.dw1.as<bf16>();
  bf16* dw2 = grads.dw2.as<bf16>();
  ascending_token_slots(pv, w.dx_order, stream);
  for (size_t i = 0; i < list.size(); ++i) {
    const ExpertRange& r = list[i];
    RoutingPlanView sub = pv;  // the range's experts; the token view stays the step's
    sub.E = r.e1 - r.e0;
    sub.S = r.hi - r.lo;
    sub.expert_token_offsets = w.range_offsets;
    sub.expert_token_indices = pv.expert_token_indices + r.lo;
    sub.slot_weights = pv.slot_weights + r.lo;
    rebase_offsets(pv.expert_token_offsets, r.e0, sub.E, w.range_offsets, stream);
    const bf16* w1_r = w1 + r.e0 * W * d;  // (E_r, W, d)
    const bf16* w2_r = w2 + r.e0 * d * n;  // (E_r, d, n)
    if (sub.S > 0) {
      gemm::up_proj(sub, x, w1_r, w.h, nullptr, d, n, cfg.activation, stream, automatic,
                    b1 ? b1 + r.e0 * W : nullptr, &k);
      gemm::dh_proj(sub, d_out, w2_r, w.h, w.ds_partials, w.dh, w.a_scaled, d, n,
                    cfg.activation, stream, automatic, &k);
      gemm::reduce_ds(w.ds_partials, w.ds + r.lo, sub.S, n, stream);
    }
    gemm::dw2_proj(sub, d_out, w.a_scaled, dw2 + r.e0 * d * n, d, n, stream, automatic, &k);
    if (b2)  // A'_r is dead (dW2 read it last): its bytes hold the bias pass's partials
      bias2_backward(sub, d_out, b2 + r.e0 * d, reinterpret_cast<float*>(w.a_scaled),
                     w.ds + r.lo, db2 + r.e0 * d, d, stream);
    if (sub.S > 0)
      gemm::dx_proj_rows(sub, gemm::ExpertRows::whole(sub), w.dh, w1_r, w.dx_slots, d, n,
                         cfg.activation, stream, tma_scratch(w.scratch, k.dx), &k);
    accumulate_range(pv, w.dx_order, r.lo, r.hi, w.dx_slots, w.dx_carry_lo, dx, d, i == 0,
                     i + 1 == list.size(), stream);
    gemm::dw1_proj(sub, w.dh, x, dw1 + r.e0 * W * d, d, n, cfg.activation, stream, automatic,
                   &k);
    if (db1) expert_column_sums(sub, w.dh, /*gathered=*/false, /*weighted=*/false,
                                db1 + r.e0 * W, W, stream);
  }
  gather_pair_grads(pv, w.ds, grads.d_pair_weights.as<float>(), stream);
}

}  // namespace

void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts) {
  MOEBLAZE_REQUIRE(opts.mode == LayerMode::keep_h || opts.mode == LayerMode::recompute,
                   "cuda::layer_backward: mode ", layer_mode_name(opts.mode),
                   " is the materialized baseline's");
  check_gpu_layer_args(cfg, plan, {&x, &w1, &w2, &d_out, &grads.dx, &grads.dw1, &grads.dw2},
                       {"x", "w1", "w2", "d_out", "dx", "dw1", "dw2"});
  require_device(grads.d_pair_weights, "d_pair_weights", Device::cuda);
  check_bias_alignment(
      {{&biases.b1, "b1"}, {&biases.b2, "b2"}, {&grads.db1, "db1"}, {&grads.db2, "db2"}});
  const bf16* b1 = data_or_null<const bf16>(biases.b1);  // (E, w1_rows): recompute's up-proj
  const bf16* b2 = data_or_null<const bf16>(biases.b2);  // (E, d): its share of ds
  bf16* db1 = data_or_null<bf16>(grads.db1);             // (E, w1_rows) or null
  bf16* db2 = data_or_null<bf16>(grads.db2);             // (E, d) or null
  MOEBLAZE_UNSUPPORTED_IF(b2 && bias2_scratch_floats(1, cfg.d) * 4 > cfg.n * 2, "b2: d (",
                          cfg.d, ") > 256 n (n = ", cfg.n, "): backward's bias pass keeps its "
                          "partials in A' (S, n), too small for this shape");
  MOEBLAZE_REQUIRE(saved.valid(), "saved: not filled by layer_forward");
  MOEBLAZE_REQUIRE(saved.mode() == opts.mode, "saved was made in mode ",
                   layer_mode_name(saved.mode()), ", backward asked for ",
                   layer_mode_name(opts.mode));
  MOEBLAZE_REQUIRE(Saved::S(saved) == plan.S(), "saved holds S = ", Saved::S(saved),
                   " assignments, the plan has ", plan.S());
  MOEBLAZE_REQUIRE(opts.mode != LayerMode::keep_h ||
                       Saved::h(saved).bytes() == cfg.kept_h_bytes(plan.S()),
                   "saved.h has ", Saved::h(saved).bytes(), " bytes, expected cfg.kept_h_bytes(S) = ",
                   cfg.kept_h_bytes(plan.S()));

  const GemmOps& g = gemm_ops();
  const cudaStream_t stream = stream_of(opts);
  const int64_t S = plan.S();
  const RoutingPlanView pv = plan.view();
  if (S == 0) {
    // Nothing routed: every gradient is zero (bf16 and fp32 zero are all-zero bits).
    if (cfg.T > 0) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dx.data, 0, grads.dx.bytes(), stream));
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dw1.data, 0, grads.dw1.bytes(), stream));
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dw2.data, 0, grads.dw2.bytes(), stream));
    if (db1) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(db1, 0, grads.db1.bytes(), stream));
    if (db2) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(db2, 0, grads.db2.bytes(), stream));
    return;
  }

  if (is_fp8(cfg.compute)) {
    Buffer ws = opts.workspace
                    ? Buffer::borrow(Device::cuda, opts.workspace, opts.workspace_bytes)
                    : Buffer(Device::cuda,
                             fp8_workspace_bytes(cfg, S, opts.mode, false, !opts.fp8_weights),
                             opts.stream);
    fp8_backward(cfg, pv, opts.mode, x.as<bf16>(), w1.as<bf16>(), w2.as<bf16>(), b1, b2,
                 d_out.as<bf16>(), opts.mode == LayerMode::keep_h ? Saved::h(saved).data()
                                                                 : nullptr,
                 grads, db1, db2, opts.fp8_weights, ws.data(), stream);
    return;
  }
  const int64_t ds_cols = g.ds_partials_cols(cfg.n);
  const bool dh_over_h = opts.mode == LayerMode::keep_h && opts.dh_over_h;
  const TokenChunks chunks = layer_chunks(cfg, S, opts.mode).backward;
  const ExpertRanges ranges = layer_ranges(cfg, S, opts.mode);
  if (ranges.on) {  // before any allocation or write: outputs untouched when refused
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOEBLAZE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    MOEBLAZE_UNSUPPORTED_IF(capture != cudaStreamCaptureStatusNone,
                            "layer_backward: recompute in expert ranges (", describe(ranges),
                            ") reads the expert counts on the host, which a CUDA graph capture "
                            "cannot; capture with the kernel override ranges=1 "
                            "(MOEBLAZE_KERNELS=ranges=1) or a smaller T");
  }
  Buffer ws = opts.workspace
                  ? Buffer::borrow(Device::cuda, opts.workspace, opts.workspace_bytes)
                  : Buffer(Device::cuda,
                           backward_workspace(cfg, S, opts.mode, ds_cols, chunks, nullptr,
                                              dh_over_h, nullptr, &ranges)
                               .bytes,
                           opts.stream);
  // A', ds and dX̃ (and the TMA scratch) in dw1's bytes where they fit: dW1 writes it last.
  const BackwardWorkspace w = backward_workspace(cfg, S, opts.mode, ds_cols, chunks, ws.data(),
                                                 dh_over_h, grads.dw1.data, &ranges);
  if (ranges.on) {
    backward_in_ranges(cfg, pv, ranges, w, x.as<bf16>(), w1.as<bf16>(), w2.as<bf16>(), b1, b2,
                       d_out.as<bf16>(), grads, db1, db2, stream);
    mark_step(stream, step::kRanges);
    return;
  }
  const bf16* h = Saved::h(saved).as<bf16>();
  // (S, w1_rows): dH, over H where backward_workspace put no room for it.
  bf16* dh = dh_over_h ? const_cast<bf16*>(h) : w.dh;
  if (opts.mode == LayerMode::recompute) {
    g.up_proj(pv, x.as<bf16>(), w1.as<bf16>(), w.h, nullptr, cfg.d, cfg.n, cfg.activation,
              stream, b1);
    mark_step(stream, step::kUpProjAgain);
    h = w.h;
  }
  g.dh_proj(pv, d_out.as<bf16>(), w2.as<bf16>(), h, w.ds_partials, dh, w.a_scaled, cfg.d,
            cfg.n, cfg.activation, stream);
  mark_step(stream, step::kDh);
  g.reduce_ds(w.ds_partials, w.ds, S, cfg.n, stream);
  mark_step(stream, step::kDsReduce);
  g.dw2_proj(pv, d_out.as<bf16>(), w.a_scaled, grads.dw2.as<bf16>(), cfg.d, cfg.n, stream);
  mark_step(stream, step::kDw2);
  // b2's share: A' (S, n) bf16 is dead now (dW2 read it last), so its bytes hold the pass's
  // (S, d / 512) fp32 partials until dX̃ writes there.
  if (b2)
    bias2_backward(pv, d_out.data, b2, reinterpret_cast<float*>(w.a_scaled), w.ds, db2, cfg.d,
                   stream);
  // ds is final: into pair order now, as dX̃ and dx_order are about to write over it.
  gather_pair_grads(pv, w.ds, grads.d_pair_weights.as<float>(), stream);
  // dx sums each token's slots in ascending order, the order expert ranges can keep too.
  ascending_token_slots(pv, w.dx_order, stream);
  mark_step(stream, step::kPairGrads);
  RoutingPlanView by_slot = pv;  // the token view walked in that order (unweighted sums only)
  by_slot.token_index_map = w.dx_order;
  if (chunks.count > 1) {
    // dX̃ one token chunk at a time into w.dx_slots, each chunk's tokens summed into dx.
    build_chunk_maps(by_slot, chunks, w.maps, stream);
    for (int64_t c = 0; c < chunks.count; ++c) {
      gemm::dx_proj_rows(pv, chunk_rows(w.maps, cfg.E, c), dh, w1.as<bf16>(), w.dx_slots, cfg.d,
                         cfg.n, cfg.activation, stream, w.scratch);
      mark_step(stream, step::kDx);
      aggregate_chunk(by_slot, chunks, w.maps, c, w.dx_slots, nullptr, grads.dx.data, cfg.d,
                      stream);
      mark_step(stream, step::kDxAggregate);
    }
  } else {
    g.dx_proj(pv, dh, w1.as<bf16>(), w.dx_slots, cfg.d, cfg.n, cfg.activation, stream,
              tma_scratch(w.scratch, gemm::choose_kernels({S, cfg.E, cfg.d, cfg.n}).dx));
    mark_step(stream, step::kDx);
    aggregate_rows(by_slot, w.dx_slots, nullptr, grads.dx.data, cfg.d, DType::bf16, stream);
    mark_step(stream, step::kDxAggregate);
  }
  g.dw1_proj(pv, dh, x.as<bf16>(), grads.dw1.as<bf16>(), cfg.d, cfg.n, cfg.activation, stream);
  mark_step(stream, step::kDw1);
  if (db1) expert_column_sums(pv, dh, /*gathered=*/false, /*weighted=*/false, db1,
                              cfg.w1_rows(), stream);
}

}  // namespace moeblaze::cuda
