// The materialized MoE baseline on the CPU: what a framework writes with autograd (MegaBlocks
// style). It exists only to be measured against moeblaze's index-based layer, so it does the
// conventional thing on purpose:
//   forward : Xs = gather(x) (S, d) copy; per-expert dense GEMM H = Xs_e W1_e^T; a separate
//             activation pass writing act(g) and A; Y = A W2_e^T kept (S, d); scatter-sum.
//   backward: dO gathered to (S, d); ds = <dO_t, Y_p>; dA = s (dO W2_e); activation backward from
//             the saved act(g) / H; dW2 = (s dOs)^T A; dW1 = dH^T Xs; dXs = dH W1_e; scatter-sum.
//
// Kept for backward (what autograd saves): Xs (S, d) for dW1, H (S, w1_rows) (the activation's
// input), act(g) (S, n) for gated activations only (the gate multiply's other input), A (S, n) for
// dW2, and Y (S, d) for the gate-weight gradient. For non-gated activations autograd of act(h)
// saves its input H, which is already kept, so act_g stays empty:
//   gated     saved bytes = (S*d + S*2n + S*n + S*n + S*d) * dtype_size
//   non-gated saved bytes = (S*d + S*n       + S*n + S*d) * dtype_size
//
// Numerics match the moeblaze layer to rounding: the same GEMM micro-kernels (cpu/gemm_kernels.hpp,
// fp32 accumulation, sequential k) and activations (cpu/activation.hpp); tensors that are stored
// (Xs, H, act(g), A, Y, dO gathered and s dO, dA, dH, dXs) are stored in cfg.dtype. The
// differences are the unfused ones: A is computed from the stored H (moeblaze: from the fp32
// tile), dA and s dO are rounded to cfg.dtype, and ds = <dO, Y> uses the rounded Y (moeblaze:
// <dA', a>). Every output element is produced by exactly one task in a fixed order, so results
// are bitwise independent of the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/parallel.hpp"
#include "core/saved_access.hpp"
#include "cpu/activation.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/gemm_kernels.hpp"
#include "cpu/layer_common.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cpu {

using Saved = moeblaze::detail::SavedAccess;

namespace {

// ---------------------------------------------------------------------------------------------
// Storage conversions
// ---------------------------------------------------------------------------------------------
inline float ld(const float* p) { return *p; }
inline float ld(const bf16* p) { return float(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(bf16* p, float v) { *p = bf16(v); }

// ---------------------------------------------------------------------------------------------
// Grouped GEMMs on the project's CPU micro-kernels (cpu/gemm_kernels.hpp), one problem per
// expert. Two decompositions, both fixed by the plan alone:
//  - varlen-M (H, Y, dA, dXs): tasks of kTileRows slots of one expert, full N;
//  - varlen-K (dW1, dW2): tasks of kTileRows output rows of one expert, summing over all of the
//    expert's slots in slot order.
// Each task writes its own rows through an fp32 tile, so no sum is ever split across threads.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kTileRows = 128;

// Per-thread scratch: the GEMM's packing buffer and one (kTileRows, max_cols) fp32 tile.
struct Scratch {
  Buffer buf;
  int64_t per_thread = 0;  // floats
  explicit Scratch(int64_t max_cols) {
    per_thread = (gemm::kPackFloats + kTileRows * max_cols + 15) / 16 * 16;  // 64-byte rows
    buf = Buffer(Device::cpu, sizeof(float) * size_t(per_thread * max_threads()));
  }
  float* pack() const { return buf.as<float>() + layer::thread_index() * per_thread; }
  float* tile() const { return pack() + gemm::kPackFloats; }
};

// Tasks (expert, first row) over per-expert row counts rows(e). Varlen-M: rows are the expert's
// slots, so an empty expert owns no task. Varlen-K: rows are weight rows, so an empty expert
// still owns tasks and writes its zero gradient (a K = 0 GEMM stores zeros).
struct TileTask {
  int32_t e;
  int64_t r0;
};
template <typename RowsOf>
std::vector<TileTask> tile_tasks(int64_t E, const RowsOf& rows) {
  std::vector<TileTask> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r0 = 0; r0 < rows(e); r0 += kTileRows) tasks.push_back({int32_t(e), r0});
  return tasks;
}

// Stores an fp32 tile (m, cols) into storage rows of `ld` elements, optionally scaling row i
// by row_scale[i].
template <typename T>
void store_tile(const float* tile, int64_t m, int64_t cols, T* dst, int64_t ld,
                const float* row_scale = nullptr) {
  for (int64_t i = 0; i < m; ++i) {
    const float s = row_scale ? row_scale[i] : 1.0f;
    const float* src = tile + i * cols;
    T* out = dst + i * ld;
    if (row_scale) {
      for (int64_t j = 0; j < cols; ++j) st(out + j, src[j] * s);
    } else {
      for (int64_t j = 0; j < cols; ++j) st(out + j, src[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward / backward, templated on the storage type.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kRowGrain = 16;   // slots or tokens per parallel chunk (pointwise passes)
constexpr int64_t kColChunk = 256;  // columns of one fp32 accumulator block in the scatter-sums

template <typename T>
void forward_impl(const LayerConfig& cfg, const RoutingPlanView& pv, const T* x, const T* w1,
                  const T* w2, T* out, SavedForBackward& saved) {
  const int64_t S = pv.S, T_ = pv.T, E = pv.E, d = cfg.d, n = cfg.n, R = cfg.w1_rows();
  const DType dt = cfg.dtype;
  const int32_t* off = pv.expert_token_offsets;  // (E+1,) slot ranges per expert
  const int32_t* tok = pv.expert_token_indices;  // (S,) token of each slot, grouped by expert

  // Release the previous contents first, so that they never coexist with the new ones.
  saved = SavedForBackward();
  Buffer xs(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) gathered copy of x
  Buffer h(Device::cpu, sizeof(T) * size_t(S * R));   // (S, R) fc1 output
  // (S, n) act(g), gated only
  Buffer act_g(Device::cpu, is_gated(cfg.activation) ? sizeof(T) * size_t(S * n) : 0);
  Buffer a(Device::cpu, sizeof(T) * size_t(S * n));  // (S, n) activation output
  Buffer y(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) expert outputs
  T* Xs = xs.as<T>();
  T* H = h.as<T>();
  T* G = act_g.as<T>();
  T* A = a.as<T>();
  T* Y = y.as<T>();
  const Scratch scratch(std::max({R, d, n}));
  const auto slot_tasks = tile_tasks(E, [&](int64_t e) { return int64_t(off[e + 1] - off[e]); });
  const int64_t ntasks = int64_t(slot_tasks.size());

  // 1. dispatch: copy every assigned token row into expert-grouped order
  layer::run_tasks(S, kRowGrain * 4, double(S) * d, [&](int64_t s) {
    std::memcpy(Xs + s * d, x + int64_t(tok[s]) * d, sizeof(T) * size_t(d));
  });

  // 2. fc1 per expert: H_e = Xs_e W1_e^T
  layer::run_tasks(ntasks, 1, 2.0 * S * R * d, [&](int64_t i) {
    const int64_t e = slot_tasks[i].e, s0 = off[e] + slot_tasks[i].r0;
    const int64_t m = std::min(kTileRows, off[e + 1] - s0);
    gemm::gemm_nt(m, R, d, gemm::mat(Xs + s0 * d, dt, d), gemm::mat(w1 + e * R * d, dt, d),
                  scratch.tile(), R, false, scratch.pack());
    store_tile(scratch.tile(), m, R, H + s0 * R, R);
  });

  // 3. activation as its own pass over the stored H (no fusion into the GEMM epilogue); the
  // activation is a compile-time constant inside the loop
  dispatch_activation(cfg.activation, [&](auto tag) {
    constexpr Activation act = decltype(tag)::value;
    layer::run_tasks(S, kRowGrain, 10.0 * S * n, [&](int64_t s) {
      const T* hr = H + s * R;
      T* ar = A + s * n;
      if constexpr (gated(act)) {
        T* gr = G + s * n;
        for (int64_t j = 0; j < n; ++j) {
          const float g = act_fn(act, ld(hr + j));
          st(gr + j, g);
          st(ar + j, g * up_fn(act, ld(hr + n + j)));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) st(ar + j, act_fn(act, ld(hr + j)));
      }
    });
  });

  // 4. fc2 per expert: Y_e = A_e W2_e^T
  layer::run_tasks(ntasks, 1, 2.0 * S * d * n, [&](int64_t i) {
    const int64_t e = slot_tasks[i].e, s0 = off[e] + slot_tasks[i].r0;
    const int64_t m = std::min(kTileRows, off[e + 1] - s0);
    gemm::gemm_nt(m, d, n, gemm::mat(A + s0 * n, dt, n), gemm::mat(w2 + e * d * n, dt, n),
                  scratch.tile(), d, false, scratch.pack());
    store_tile(scratch.tile(), m, d, Y + s0 * d, d);
  });

  // 5. combine: o_t = sum over the token's pairs, in pair order, of s_p * Y[slot]
  const int32_t* tpo = pv.token_pair_offsets;  // (T+1,) pair ranges per token
  const int32_t* slot_of = pv.token_index_map;  // (S,) slot of each pair, token-major
  const float* sw = pv.slot_weights;             // (S,) gate weight of each slot
  layer::run_tasks(T_, kRowGrain, 2.0 * S * d, [&](int64_t t) {
    for (int64_t j0 = 0; j0 < d; j0 += kColChunk) {
      const int64_t nj = std::min(kColChunk, d - j0);
      float acc[kColChunk] = {};
      for (int32_t p = tpo[t]; p < tpo[t + 1]; ++p) {
        const int64_t s = slot_of[p];
        const float w = sw[s];
        const T* yr = Y + s * d + j0;
        for (int64_t j = 0; j < nj; ++j) acc[j] += w * ld(yr + j);
      }
      for (int64_t j = 0; j < nj; ++j) st(out + t * d + j0 + j, acc[j]);
    }
  });

  Saved::h(saved) = std::move(h);
  Saved::xs(saved) = std::move(xs);
  Saved::act_g(saved) = std::move(act_g);
  Saved::a(saved) = std::move(a);
  Saved::y(saved) = std::move(y);
  Saved::mark_filled(saved, LayerMode::materialized, S);
}

template <typename T>
void backward_impl(const LayerConfig& cfg, const RoutingPlanView& pv, const T* w1, const T* w2,
                   const T* dout, const SavedForBackward& saved, T* dx, T* dw1, T* dw2,
                   float* d_pair_weights) {
  const int64_t S = pv.S, T_ = pv.T, E = pv.E, d = cfg.d, n = cfg.n, R = cfg.w1_rows();
  const DType dt = cfg.dtype;
  const int32_t* off = pv.expert_token_offsets;  // (E+1,)
  const int32_t* tok = pv.expert_token_indices;  // (S,)
  const float* sw = pv.slot_weights;             // (S,)
  const T* Xs = Saved::xs(saved).as<T>();        // (S, d)
  const T* H = Saved::h(saved).as<T>();          // (S, R)
  const T* G = Saved::act_g(saved).as<T>();      // (S, n) gated only
  const T* A = Saved::a(saved).as<T>();          // (S, n)
  const T* Y = Saved::y(saved).as<T>();          // (S, d)
  const Scratch scratch(std::max({R, d, n}));
  const auto slot_tasks = tile_tasks(E, [&](int64_t e) { return int64_t(off[e + 1] - off[e]); });
  const int64_t ntasks = int64_t(slot_tasks.size());

  // 1. gather dO into expert-grouped order (the materialized way: an (S, d) copy)
  Buffer dos_buf(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) dO per slot
  T* dOs = dos_buf.as<T>();
  layer::run_tasks(S, kRowGrain * 4, double(S) * d, [&](int64_t s) {
    std::memcpy(dOs + s * d, dout + int64_t(tok[s]) * d, sizeof(T) * size_t(d));
  });

  // 2. gate-weight gradient from the kept expert outputs: ds_p = <dO_t, Y_p>
  Buffer ds_buf(Device::cpu, sizeof(float) * size_t(S));  // (S,) fp32 per slot
  float* ds = ds_buf.as<float>();
  layer::run_tasks(S, kRowGrain * 4, 2.0 * S * d, [&](int64_t s) {
    float acc = 0.0f;
    for (int64_t j = 0; j < d; ++j) acc += ld(dOs + s * d + j) * ld(Y + s * d + j);
    ds[s] = acc;
  });

  // 3. dA = s * (dO W2_e)
  Buffer da_buf(Device::cpu, sizeof(T) * size_t(S * n));  // (S, n) grouped by expert
  T* dA = da_buf.as<T>();
  layer::run_tasks(ntasks, 1, 2.0 * S * n * d, [&](int64_t i) {
    const int64_t e = slot_tasks[i].e, s0 = off[e] + slot_tasks[i].r0;
    const int64_t m = std::min(kTileRows, off[e + 1] - s0);
    gemm::gemm_nn(m, n, d, gemm::mat(dOs + s0 * d, dt, d), gemm::mat(w2 + e * d * n, dt, n),
                  scratch.tile(), n, false, scratch.pack());
    store_tile(scratch.tile(), m, n, dA + s0 * n, n, sw + s0);
  });

  // 4. dW2_e = sum over the expert's slots of dO_t (s_p A_p)^T. The slot weight varies per slot,
  // so it goes into an operand: dO is scaled in place to dY = s dO (the gradient autograd of
  // s * Y hands to the fc2 GEMM), stored in cfg.dtype like every materialized tensor.
  layer::run_tasks(S, kRowGrain * 4, double(S) * d, [&](int64_t s) {
    const float w = sw[s];
    T* r = dOs + s * d;
    for (int64_t j = 0; j < d; ++j) st(r + j, w * ld(r + j));
  });
  const T* dYs = dOs;  // (S, d) s * dO per slot
  const auto w2_tasks = tile_tasks(E, [&](int64_t) { return d; });
  layer::run_tasks(int64_t(w2_tasks.size()), 1, 2.0 * S * d * n, [&](int64_t i) {
    const int64_t e = w2_tasks[i].e, r0 = w2_tasks[i].r0, s0 = off[e];
    const int64_t m = std::min(kTileRows, d - r0);
    gemm::gemm_tn(m, n, off[e + 1] - s0, gemm::mat(dYs + s0 * d + r0, dt, d),
                  gemm::mat(A + s0 * n, dt, n), scratch.tile(), n, false, scratch.pack());
    store_tile(scratch.tile(), m, n, dw2 + (e * d + r0) * n, n);
  });
  dos_buf.reset();

  // 5. activation backward (its own pass) from the saved H and act(g)
  Buffer dh_buf(Device::cpu, sizeof(T) * size_t(S * R));  // (S, R) grouped by expert
  T* dH = dh_buf.as<T>();
  dispatch_activation(cfg.activation, [&](auto tag) {
    constexpr Activation act = decltype(tag)::value;
    layer::run_tasks(S, kRowGrain, 10.0 * S * n, [&](int64_t s) {
      const T* hr = H + s * R;
      const T* dar = dA + s * n;
      T* dhr = dH + s * R;
      if constexpr (gated(act)) {
        const T* gr = G + s * n;
        for (int64_t j = 0; j < n; ++j) {
          const float da = ld(dar + j);
          const float u = ld(hr + n + j);
          st(dhr + j, da * up_fn(act, u) * act_grad(act, ld(hr + j)));
          st(dhr + n + j, up_grad_times(act, da * ld(gr + j), u));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) st(dhr + j, ld(dar + j) * act_grad(act, ld(hr + j)));
      }
    });
  });
  da_buf.reset();

  // 6. dW1_e = dH_e^T Xs_e
  const auto w1_tasks = tile_tasks(E, [&](int64_t) { return R; });
  layer::run_tasks(int64_t(w1_tasks.size()), 1, 2.0 * S * R * d, [&](int64_t i) {
    const int64_t e = w1_tasks[i].e, r0 = w1_tasks[i].r0, s0 = off[e];
    const int64_t m = std::min(kTileRows, R - r0);
    gemm::gemm_tn(m, d, off[e + 1] - s0, gemm::mat(dH + s0 * R + r0, dt, R),
                  gemm::mat(Xs + s0 * d, dt, d), scratch.tile(), d, false, scratch.pack());
    store_tile(scratch.tile(), m, d, dw1 + (e * R + r0) * d, d);
  });

  // 7. dXs_e = dH_e W1_e
  Buffer dxs_buf(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) grouped by expert
  T* dXs = dxs_buf.as<T>();
  layer::run_tasks(ntasks, 1, 2.0 * S * R * d, [&](int64_t i) {
    const int64_t e = slot_tasks[i].e, s0 = off[e] + slot_tasks[i].r0;
    const int64_t m = std::min(kTileRows, off[e + 1] - s0);
    gemm::gemm_nn(m, d, R, gemm::mat(dH + s0 * R, dt, R), gemm::mat(w1 + e * R * d, dt, d),
                  scratch.tile(), d, false, scratch.pack());
    store_tile(scratch.tile(), m, d, dXs + s0 * d, d);
  });
  dh_buf.reset();

  // 8. scatter-sum dx_t over the token's pairs in pair order; d_pair_weights token-major
  const int32_t* tpo = pv.token_pair_offsets;   // (T+1,)
  const int32_t* slot_of = pv.token_index_map;  // (S,)
  layer::run_tasks(T_, kRowGrain, double(S) * d, [&](int64_t t) {
    for (int64_t j0 = 0; j0 < d; j0 += kColChunk) {
      const int64_t nj = std::min(kColChunk, d - j0);
      float acc[kColChunk] = {};
      for (int32_t p = tpo[t]; p < tpo[t + 1]; ++p) {
        const T* r = dXs + int64_t(slot_of[p]) * d + j0;
        for (int64_t j = 0; j < nj; ++j) acc[j] += ld(r + j);
      }
      for (int64_t j = 0; j < nj; ++j) st(dx + t * d + j0 + j, acc[j]);
    }
    for (int32_t p = tpo[t]; p < tpo[t + 1]; ++p) d_pair_weights[p] = ds[slot_of[p]];
  });
}

}  // namespace

void materialized_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                          const TensorView& w1, const TensorView& w2, const TensorView& out,
                          SavedForBackward& saved, const LayerOptions& opts) {
  ThreadCountScope threads(opts.num_threads);
  const RoutingPlanView pv = plan.view();
  if (cfg.dtype == DType::bf16)
    forward_impl<bf16>(cfg, pv, x.as<const bf16>(), w1.as<const bf16>(), w2.as<const bf16>(),
                       out.as<bf16>(), saved);
  else
    forward_impl<float>(cfg, pv, x.as<const float>(), w1.as<const float>(),
                        w2.as<const float>(), out.as<float>(), saved);
}

void materialized_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const SavedForBackward& saved, const LayerGrads& grads,
                           const LayerOptions& opts) {
  (void)x;  // the baseline reads its own gathered copy Xs instead
  const int64_t S = plan.S();
  const size_t es = dtype_size(cfg.dtype);
  const size_t want_g = is_gated(cfg.activation) ? size_t(S * cfg.n) * es : 0;
  MOEBLAZE_REQUIRE(saved.valid() && saved.mode() == LayerMode::materialized,
                   "saved was not filled by a materialized-mode forward");
  MOEBLAZE_REQUIRE(Saved::S(saved) == S, "saved holds S (", Saved::S(saved),
                   ") assignments but the plan has S (", S, ")");
  MOEBLAZE_REQUIRE(Saved::xs(saved).bytes() == size_t(S * cfg.d) * es &&
                       Saved::h(saved).bytes() == size_t(S * cfg.w1_rows()) * es &&
                       Saved::act_g(saved).bytes() == want_g &&
                       Saved::a(saved).bytes() == size_t(S * cfg.n) * es &&
                       Saved::y(saved).bytes() == size_t(S * cfg.d) * es,
                   "saved's buffers do not match the config (forward ran with other arguments)");
  ThreadCountScope threads(opts.num_threads);
  const RoutingPlanView pv = plan.view();
  if (cfg.dtype == DType::bf16)
    backward_impl<bf16>(cfg, pv, w1.as<const bf16>(), w2.as<const bf16>(),
                        d_out.as<const bf16>(), saved, grads.dx.as<bf16>(), grads.dw1.as<bf16>(),
                        grads.dw2.as<bf16>(), grads.d_pair_weights.as<float>());
  else
    backward_impl<float>(cfg, pv, w1.as<const float>(), w2.as<const float>(),
                         d_out.as<const float>(), saved, grads.dx.as<float>(),
                         grads.dw1.as<float>(), grads.dw2.as<float>(),
                         grads.d_pair_weights.as<float>());
}

}  // namespace moeblaze::cpu
