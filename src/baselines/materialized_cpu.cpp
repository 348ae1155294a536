// The materialized MoE baseline on the CPU: what a framework writes with autograd (MegaBlocks
// style). It exists only to be measured against moeblaze's index-based layer, so it does the
// conventional thing on purpose:
//   forward : Xs = gather(x) (S, d) copy; per-expert dense GEMM H = Xs_e W1_e^T; a separate
//             activation pass writing act(g) and A; Y = A W2_e^T kept (S, d); scatter-sum.
//   backward: dO gathered to (S, d); ds = <dO_t, Y_p>; dA = s (dO W2_e); activation backward from
//             the saved act(g) / H; dW2 = dOs^T (s A); dW1 = dH^T Xs; dXs = dH W1_e; scatter-sum.
//
// Kept for backward (what autograd saves): Xs (S, d) for dW1, H (S, w1_rows) (the activation's
// input), act(g) (S, n) for gated activations only (the gate multiply's other input), A (S, n) for
// dW2, and Y (S, d) for the gate-weight gradient. For non-gated activations autograd of act(h)
// saves its input H, which is already kept, so act_g stays empty:
//   gated     saved bytes = (S*d + S*2n + S*n + S*n + S*d) * dtype_size
//   non-gated saved bytes = (S*d + S*n       + S*n + S*d) * dtype_size
//
// Numerics match the moeblaze layer: every product is accumulated in fp32 in a fixed sequential
// order; tensors that are stored (Xs, H, act(g), A, Y, dO gathered, dA, dH, dXs) are stored in
// cfg.dtype. Every output element is produced by exactly one task, so results are bitwise
// independent of the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/activation.hpp"
#include "cpu/cpu_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Storage conversions
// ---------------------------------------------------------------------------------------------
inline float ld(const float* p) { return *p; }
inline float ld(const bf16* p) { return float(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(bf16* p, float v) { *p = bf16(v); }

// ---------------------------------------------------------------------------------------------
// Grouped GEMM: C (M x N) = A (M x K) * B (K x N), one problem per expert, fp32 accumulation in
// sequential k order. Operands are strided views so transposes cost nothing:
// element (i, k) of A is a[i*rs + k*cs]. Both operands are packed to fp32 panels per task.
// ---------------------------------------------------------------------------------------------
typedef float v4 __attribute__((vector_size(16), aligned(16), may_alias));

constexpr int64_t MR = 4;    // micro-tile rows
constexpr int64_t NR = 8;    // micro-tile columns (two 4-wide vectors)
constexpr int64_t MB = 128;  // task rows
constexpr int64_t NB = 64;   // task columns
constexpr int64_t KC = 512;  // k block: bounds the packed panels regardless of tokens per expert

template <typename T>
struct Operand {
  const T* p = nullptr;
  int64_t rs = 0, cs = 0;  // element (r, c) at p[r*rs + c*cs]
  float at(int64_t r, int64_t c) const { return ld(p + r * rs + c * cs); }
};

template <typename T>
struct Problem {
  int64_t M = 0, N = 0, K = 0;
  Operand<T> a;                     // (M, K)
  Operand<T> b;                     // (K, N)
  const float* b_row_scale = nullptr;  // (K,) optional: B(k, :) is multiplied by it
  T* c = nullptr;                   // (M, N) row-major, leading dimension ldc
  int64_t ldc = 0;
  const float* c_row_scale = nullptr;  // (M,) optional: C(i, :) is multiplied by it on store
};

// acc (MR x NR, row stride ldt) += Ap (kc x MR) * Bp (kc x NR); both packed k-major.
inline void micro_kernel(int64_t kc, const float* Ap, const float* Bp, float* acc, int64_t ldt) {
  v4 c[MR][2];
  for (int64_t i = 0; i < MR; ++i) {
    c[i][0] = *reinterpret_cast<const v4*>(acc + i * ldt);
    c[i][1] = *reinterpret_cast<const v4*>(acc + i * ldt + 4);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const v4 b0 = *reinterpret_cast<const v4*>(Bp + k * NR);
    const v4 b1 = *reinterpret_cast<const v4*>(Bp + k * NR + 4);
    for (int64_t i = 0; i < MR; ++i) {
      const float a = Ap[k * MR + i];
      const v4 av = {a, a, a, a};
      c[i][0] += av * b0;
      c[i][1] += av * b1;
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    *reinterpret_cast<v4*>(acc + i * ldt) = c[i][0];
    *reinterpret_cast<v4*>(acc + i * ldt + 4) = c[i][1];
  }
}

template <typename T>
void run_tile(const Problem<T>& pb, int64_t r0, int64_t c0) {
  const int64_t mb = std::min(MB, pb.M - r0), nb = std::min(NB, pb.N - c0);
  const int64_t mbp = (mb + MR - 1) / MR * MR, nbp = (nb + NR - 1) / NR * NR;
  const int64_t kcmax = std::min(KC, std::max<int64_t>(pb.K, 1));
  // Per-task scratch: accumulator tile (mbp, nbp) fp32, B panels (nbp/NR, kc, NR) fp32 and one
  // A micro-panel (kc, MR) fp32.
  Buffer scratch(Device::cpu, sizeof(float) * size_t(mbp * nbp + nbp * kcmax + MR * kcmax));
  float* tile = scratch.as<float>();
  float* Bp = tile + mbp * nbp;
  float* Ap = Bp + nbp * kcmax;
  std::fill(tile, tile + mbp * nbp, 0.0f);

  for (int64_t k0 = 0; k0 < pb.K; k0 += KC) {
    const int64_t kc = std::min(KC, pb.K - k0);
    for (int64_t jp = 0; jp < nbp / NR; ++jp) {
      float* dst = Bp + jp * kc * NR;
      for (int64_t k = 0; k < kc; ++k) {
        const float s = pb.b_row_scale ? pb.b_row_scale[k0 + k] : 1.0f;
        for (int64_t jj = 0; jj < NR; ++jj) {
          const int64_t j = c0 + jp * NR + jj;
          dst[k * NR + jj] = j < c0 + nb ? pb.b.at(k0 + k, j) * s : 0.0f;
        }
      }
    }
    for (int64_t ip = 0; ip < mbp / MR; ++ip) {
      for (int64_t ii = 0; ii < MR; ++ii) {
        const int64_t i = r0 + ip * MR + ii;
        if (i < r0 + mb) {
          for (int64_t k = 0; k < kc; ++k) Ap[k * MR + ii] = pb.a.at(i, k0 + k);
        } else {
          for (int64_t k = 0; k < kc; ++k) Ap[k * MR + ii] = 0.0f;
        }
      }
      for (int64_t jp = 0; jp < nbp / NR; ++jp)
        micro_kernel(kc, Ap, Bp + jp * kc * NR, tile + ip * MR * nbp + jp * NR, nbp);
    }
  }
  for (int64_t i = 0; i < mb; ++i) {
    const float s = pb.c_row_scale ? pb.c_row_scale[r0 + i] : 1.0f;
    T* crow = pb.c + (r0 + i) * pb.ldc + c0;
    for (int64_t j = 0; j < nb; ++j) st(crow + j, tile[i * nbp + j] * s);
  }
}

// Runs every problem; tasks are (problem, MB rows, NB columns) tiles, each owned by one thread.
// A problem with K = 0 still writes its (zero) output; M = 0 or N = 0 has nothing to write.
template <typename T>
void grouped_gemm(const std::vector<Problem<T>>& problems) {
  struct Task { int32_t p; int64_t r0, c0; };
  std::vector<Task> tasks;
  for (size_t p = 0; p < problems.size(); ++p)
    for (int64_t r0 = 0; r0 < problems[p].M; r0 += MB)
      for (int64_t c0 = 0; c0 < problems[p].N; c0 += NB) tasks.push_back({int32_t(p), r0, c0});
  parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t t) {
    run_tile(problems[tasks[t].p], tasks[t].r0, tasks[t].c0);
  });
}

// ---------------------------------------------------------------------------------------------
// Forward / backward, templated on the storage type.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kRowGrain = 16;   // slots or tokens per parallel chunk (pointwise passes)
constexpr int64_t kColChunk = 256;  // columns of one fp32 accumulator block in the scatter-sums

template <typename T>
void forward_impl(const LayerConfig& cfg, const RoutingPlanView& pv, const T* x, const T* w1,
                  const T* w2, T* out, SavedForBackward& saved) {
  const int64_t S = pv.S, T_ = pv.T, E = pv.E, d = cfg.d, n = cfg.n, w1r = cfg.w1_rows();
  const int32_t* off = pv.expert_token_offsets;  // (E+1,) slot ranges per expert
  const int32_t* tok = pv.expert_token_indices;  // (S,) token of each slot, grouped by expert

  Buffer xs(Device::cpu, sizeof(T) * size_t(S * d));               // (S, d) gathered copy of x
  Buffer h(Device::cpu, sizeof(T) * size_t(S * w1r));              // (S, w1_rows) fc1 output
  // (S, n) act(g), gated only
  Buffer act_g(Device::cpu, is_gated(cfg.activation) ? sizeof(T) * size_t(S * n) : 0);
  Buffer a(Device::cpu, sizeof(T) * size_t(S * n));                // (S, n) activation output
  Buffer y(Device::cpu, sizeof(T) * size_t(S * d));                // (S, d) expert outputs
  T* Xs = xs.as<T>();
  T* H = h.as<T>();
  T* G = act_g.as<T>();
  T* A = a.as<T>();
  T* Y = y.as<T>();

  // 1. dispatch: copy every assigned token row into expert-grouped order
  parallel_for(0, S, kRowGrain * 4, [&](int64_t s) {
    std::memcpy(Xs + s * d, x + int64_t(tok[s]) * d, sizeof(T) * size_t(d));
  });

  // 2. fc1 per expert: H_e = Xs_e W1_e^T
  std::vector<Problem<T>> probs;
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = off[e + 1] - off[e];
    pb.N = w1r;
    pb.K = d;
    pb.a = {Xs + int64_t(off[e]) * d, d, 1};
    pb.b = {w1 + e * w1r * d, 1, d};
    pb.c = H + int64_t(off[e]) * w1r;
    pb.ldc = w1r;
    if (pb.M > 0) probs.push_back(pb);
  }
  grouped_gemm(probs);

  // 3. activation as its own pass (no fusion into the GEMM epilogue); the activation is a
  // compile-time constant inside the loop
  dispatch_activation(cfg.activation, [&](auto tag) {
    constexpr Activation act = decltype(tag)::value;
    parallel_for(0, S, kRowGrain, [&](int64_t s) {
      const T* hr = H + s * w1r;
      T* ar = A + s * n;
      if constexpr (gated(act)) {
        T* gr = G + s * n;
        for (int64_t j = 0; j < n; ++j) {
          const float g = act_fn(act, ld(hr + j));
          st(gr + j, g);
          st(ar + j, g * ld(hr + n + j));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) st(ar + j, act_fn(act, ld(hr + j)));
      }
    });
  });

  // 4. fc2 per expert: Y_e = A_e W2_e^T
  probs.clear();
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = off[e + 1] - off[e];
    pb.N = d;
    pb.K = n;
    pb.a = {A + int64_t(off[e]) * n, n, 1};
    pb.b = {w2 + e * d * n, 1, n};
    pb.c = Y + int64_t(off[e]) * d;
    pb.ldc = d;
    if (pb.M > 0) probs.push_back(pb);
  }
  grouped_gemm(probs);

  // 5. combine: o_t = sum over the token's pairs, in pair order, of s_p * Y[slot]
  const int32_t* tpo = pv.token_pair_offsets;  // (T+1,) pair ranges per token
  const int32_t* slot_of = pv.token_index_map;  // (S,) slot of each pair, token-major
  const float* sw = pv.slot_weights;             // (S,) gate weight of each slot
  parallel_for(0, T_, kRowGrain, [&](int64_t t) {
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

  saved.h = std::move(h);
  saved.xs = std::move(xs);
  saved.act_g = std::move(act_g);
  saved.a = std::move(a);
  saved.y = std::move(y);
  saved.mode_ = LayerMode::materialized;
  saved.S_ = S;
  saved.valid_ = true;
}

template <typename T>
void backward_impl(const LayerConfig& cfg, const RoutingPlanView& pv, const T* w1, const T* w2,
                   const T* dout, const SavedForBackward& saved, T* dx, T* dw1, T* dw2,
                   float* d_pair_weights) {
  const int64_t S = pv.S, T_ = pv.T, E = pv.E, d = cfg.d, n = cfg.n, w1r = cfg.w1_rows();
  const int32_t* off = pv.expert_token_offsets;  // (E+1,)
  const int32_t* tok = pv.expert_token_indices;  // (S,)
  const float* sw = pv.slot_weights;             // (S,)
  const T* Xs = saved.xs.as<T>();                // (S, d)
  const T* H = saved.h.as<T>();                  // (S, w1_rows)
  const T* G = saved.act_g.as<T>();              // (S, n) gated only
  const T* A = saved.a.as<T>();                  // (S, n)
  const T* Y = saved.y.as<T>();                  // (S, d)

  // 1. gather dO into expert-grouped order (the materialized way: an (S, d) copy)
  Buffer dos_buf(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) dO per slot
  T* dOs = dos_buf.as<T>();
  parallel_for(0, S, kRowGrain * 4, [&](int64_t s) {
    std::memcpy(dOs + s * d, dout + int64_t(tok[s]) * d, sizeof(T) * size_t(d));
  });

  // 2. gate-weight gradient from the kept expert outputs: ds_p = <dO_t, Y_p>
  Buffer ds_buf(Device::cpu, sizeof(float) * size_t(S));  // (S,) fp32 per slot
  float* ds = ds_buf.as<float>();
  parallel_for(0, S, kRowGrain * 4, [&](int64_t s) {
    float acc = 0.0f;
    for (int64_t j = 0; j < d; ++j) acc += ld(dOs + s * d + j) * ld(Y + s * d + j);
    ds[s] = acc;
  });

  // 3. dA = s * (dO W2_e)
  Buffer da_buf(Device::cpu, sizeof(T) * size_t(S * n));  // (S, n) grouped by expert
  T* dA = da_buf.as<T>();
  std::vector<Problem<T>> probs;
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = off[e + 1] - off[e];
    pb.N = n;
    pb.K = d;
    pb.a = {dOs + int64_t(off[e]) * d, d, 1};
    pb.b = {w2 + e * d * n, n, 1};
    pb.c = dA + int64_t(off[e]) * n;
    pb.ldc = n;
    pb.c_row_scale = sw + off[e];
    if (pb.M > 0) probs.push_back(pb);
  }
  grouped_gemm(probs);

  // 4. dW2_e = sum over the expert's slots of dO_t (s A_p)^T, i.e. dOs_e^T (s A_e)
  probs.clear();
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = d;
    pb.N = n;
    pb.K = off[e + 1] - off[e];
    pb.a = {dOs + int64_t(off[e]) * d, 1, d};
    pb.b = {A + int64_t(off[e]) * n, n, 1};
    pb.b_row_scale = sw + off[e];
    pb.c = dw2 + e * d * n;
    pb.ldc = n;
    probs.push_back(pb);
  }
  grouped_gemm(probs);
  dos_buf.reset();

  // 5. activation backward (its own pass) from the saved H and act(g)
  Buffer dh_buf(Device::cpu, sizeof(T) * size_t(S * w1r));  // (S, w1_rows) grouped by expert
  T* dH = dh_buf.as<T>();
  dispatch_activation(cfg.activation, [&](auto tag) {
    constexpr Activation act = decltype(tag)::value;
    parallel_for(0, S, kRowGrain, [&](int64_t s) {
      const T* hr = H + s * w1r;
      const T* dar = dA + s * n;
      T* dhr = dH + s * w1r;
      if constexpr (gated(act)) {
        const T* gr = G + s * n;
        for (int64_t j = 0; j < n; ++j) {
          const float da = ld(dar + j);
          st(dhr + j, da * ld(hr + n + j) * act_grad(act, ld(hr + j)));
          st(dhr + n + j, da * ld(gr + j));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) st(dhr + j, ld(dar + j) * act_grad(act, ld(hr + j)));
      }
    });
  });
  da_buf.reset();

  // 6. dW1_e = dH_e^T Xs_e
  probs.clear();
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = w1r;
    pb.N = d;
    pb.K = off[e + 1] - off[e];
    pb.a = {dH + int64_t(off[e]) * w1r, 1, w1r};
    pb.b = {Xs + int64_t(off[e]) * d, d, 1};
    pb.c = dw1 + e * w1r * d;
    pb.ldc = d;
    probs.push_back(pb);
  }
  grouped_gemm(probs);

  // 7. dXs_e = dH_e W1_e
  Buffer dxs_buf(Device::cpu, sizeof(T) * size_t(S * d));  // (S, d) grouped by expert
  T* dXs = dxs_buf.as<T>();
  probs.clear();
  for (int64_t e = 0; e < E; ++e) {
    Problem<T> pb;
    pb.M = off[e + 1] - off[e];
    pb.N = d;
    pb.K = w1r;
    pb.a = {dH + int64_t(off[e]) * w1r, w1r, 1};
    pb.b = {w1 + e * w1r * d, d, 1};
    pb.c = dXs + int64_t(off[e]) * d;
    pb.ldc = d;
    if (pb.M > 0) probs.push_back(pb);
  }
  grouped_gemm(probs);
  dh_buf.reset();

  // 8. scatter-sum dx_t over the token's pairs in pair order; d_pair_weights token-major
  const int32_t* tpo = pv.token_pair_offsets;   // (T+1,)
  const int32_t* slot_of = pv.token_index_map;  // (S,)
  parallel_for(0, T_, kRowGrain, [&](int64_t t) {
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
  MOEBLAZE_REQUIRE(saved.S_ == S, "saved holds S (", saved.S_, ") assignments but the plan has S (",
                   S, ")");
  MOEBLAZE_REQUIRE(saved.xs.bytes() == size_t(S * cfg.d) * es &&
                       saved.h.bytes() == size_t(S * cfg.w1_rows()) * es &&
                       saved.act_g.bytes() == want_g && saved.a.bytes() == size_t(S * cfg.n) * es &&
                       saved.y.bytes() == size_t(S * cfg.d) * es,
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
