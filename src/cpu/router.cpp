// CPU routers: logits → top-K routing with gate weights and auxiliary losses, and the router's
// backward (d logits from d pair weights, plus the auxiliary losses' gradients).
//
// Threads split the tokens into fixed chunks (router_math::kTokenChunk); each token is computed
// by one thread from its own row, and loss partial sums are per chunk, combined in chunk order,
// so every output is bitwise independent of the thread count. No atomics.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/router_math.hpp"

namespace moeblaze::cpu {
namespace rm = router_math;
namespace {

float logsumexp_row(const float* l, int64_t E) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  float z = 0.0f;
  for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
  return m + std::log(z);
}

// q (E,): the per-token distribution the load-balancing loss averages into P_e. softmax(logits)
// for the softmax routers; for sigmoid_bias, which has no softmax, the normalised sigmoid scores
// s / sum_e s. `identity` is (E,) = 0, 1, ..., E-1 (the summation order). Returns logsumexp(row)
// when q is the softmax (bitwise what logsumexp_row gives: same operations, same order), so the
// z-loss can reuse it; NaN otherwise.
float aux_distribution(RouterKind kind, const float* row, int64_t E, const int32_t* identity,
                       float* q) {
  if (kind != RouterKind::sigmoid_bias) return rm::softmax_row(row, E, q);
  rm::normalized_sigmoid(row, identity, E, q);
  return NAN;
}

}  // namespace

RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const int K = cfg.top_k;
  rm::require_finite_logits(logits);
  const float* b = nullptr;  // (E,) fp32, sigmoid_bias only
  if (cfg.kind == RouterKind::sigmoid_bias) {
    rm::require_finite_bias(bias);
    b = bias.as<const float>();
  }

  Routing r(Device::cpu, T, E, T * K);
  int32_t* offsets = r.pair_offsets();  // (T+1,) = t*K
  int32_t* experts = r.pair_experts();  // (T*K,) rank order within a token
  float* weights = r.pair_weights();    // (T*K,)
  offsets[0] = 0;

  parallel_for(0, rm::num_chunks(T), 1, [&](int64_t c) {
    rm::TokenScratch s(E);
    std::vector<float> key(E);  // (E,)
    const int64_t stop = std::min(T, (c + 1) * rm::kTokenChunk);
    for (int64_t t = c * rm::kTokenChunk; t < stop; ++t) {
      rm::load_row(logits, t, s.row.data());
      rm::selection_keys(cfg.kind, s.row.data(), b, E, key.data());
      int32_t* ids = experts + t * K;
      rm::top_k(key.data(), E, K, ids);
      rm::pair_weights(cfg, s.row.data(), E, ids, K, weights + t * K, s);
      offsets[t + 1] = static_cast<int32_t>((t + 1) * K);
    }
  });

  const RouterLosses losses = router_losses(cfg, logits, experts, T * K, nullptr);
  out = std::move(r);
  return losses;
}

RouterLossScales router_loss_scales(const RouterConfig& cfg, int64_t T, int64_t E) {
  if (T <= 0) return {0.0f, 0.0f};
  return {float(double(cfg.aux_loss_coef) * double(E) / double(T)),
          float(2.0 * double(cfg.z_loss_coef) / double(T))};
}

RouterLosses router_losses(const RouterConfig& cfg, const TensorView& logits,
                           const int32_t* pair_experts, int64_t P, float* f) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const bool want_aux = cfg.aux_loss_coef > 0.0f, want_z = cfg.z_loss_coef > 0.0f;
  const int64_t chunks = rm::num_chunks(T);
  std::vector<float> q_partial(want_aux ? chunks * E : 0);  // (chunks, E) sum of q over chunk
  std::vector<float> lse2_partial(want_z ? chunks : 0);     // (chunks,) sum of lse^2 over chunk
  if (want_aux || want_z) {
    parallel_for(0, chunks, 1, [&](int64_t c) {
      std::vector<float> row(E), q(E);   // (E,) each
      std::vector<int32_t> identity(E);  // (E,) 0..E-1
      std::iota(identity.begin(), identity.end(), 0);
      const int64_t stop = std::min(T, (c + 1) * rm::kTokenChunk);
      for (int64_t t = c * rm::kTokenChunk; t < stop; ++t) {
        rm::load_row(logits, t, row.data());
        float lse = NAN;
        if (want_aux) {
          lse = aux_distribution(cfg.kind, row.data(), E, identity.data(), q.data());
          float* acc = q_partial.data() + c * E;
          for (int64_t e = 0; e < E; ++e) acc[e] += q[e];
        }
        if (want_z) {
          if (std::isnan(lse)) lse = logsumexp_row(row.data(), E);
          lse2_partial[c] += lse * lse;
        }
      }
    });
  }

  // Pairs per expert: integers, so order-free; f_e = count / P rounded once (the backward's f).
  std::vector<int64_t> count(E, 0);  // (E,)
  if (want_aux || f != nullptr)
    for (int64_t p = 0; p < P; ++p) ++count[pair_experts[p]];
  if (f != nullptr)
    for (int64_t e = 0; e < E; ++e) f[e] = P > 0 ? float(double(count[e]) / double(P)) : 0.0f;
  RouterLosses losses;
  if (T > 0 && P > 0 && want_aux) {  // no pairs (a rounding may drop them all): f = 0, aux = 0
    std::vector<float> Pe(E, 0.0f);  // (E,) sum_t q_{t,e}, chunk partials added in chunk order
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t e = 0; e < E; ++e) Pe[e] += q_partial[c * E + e];
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e)
      sum += (double(count[e]) / double(P)) * (double(Pe[e]) / double(T));
    losses.aux_loss = double(cfg.aux_loss_coef) * double(E) * sum;
  }
  if (T > 0 && want_z) {
    float sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) sum += lse2_partial[c];
    losses.z_loss = double(cfg.z_loss_coef) * double(sum) / double(T);
  }
  return losses;
}

void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits, const float* loss_grads) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  rm::require_finite_logits(logits);
  if (cfg.kind == RouterKind::sigmoid_bias) rm::require_finite_bias(bias);
  const int32_t* offsets = routing.pair_offsets;  // (T+1,)
  const int32_t* experts = routing.pair_experts;  // (P,)
  const float* g_all = d_pair_weights.as<const float>();  // (P,)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = offsets[t]; p < offsets[t + 1]; ++p)
      MOEBLAZE_REQUIRE(std::isfinite(g_all[p]), "d_pair_weights[", p, "] (token ", t,
                       ", expert ", experts[p], ") is ", rm::nonfinite_name(g_all[p]),
                       ": gradients must be finite");

  const bool want_aux = cfg.aux_loss_coef > 0.0f, want_z = cfg.z_loss_coef > 0.0f;
  // f_e = (#pairs on e) / P over the routing given (top-K or token-rounded); it is a count, so
  // only P_e carries gradient.
  std::vector<float> f(E, 0.0f);  // (E,)
  if (want_aux && routing.P > 0) {
    std::vector<int64_t> count(E, 0);
    for (int64_t p = 0; p < routing.P; ++p) ++count[experts[p]];
    for (int64_t e = 0; e < E; ++e) f[e] = float(double(count[e]) / double(routing.P));
  }
  const RouterLossScales scales = router_loss_scales(cfg, T, E);
  float aux_scale = scales.aux, z_scale = scales.z;
  if (loss_grads != nullptr) {  // the losses' upstream gradients (autograd's), one rounding each
    aux_scale *= loss_grads[0];
    z_scale *= loss_grads[1];
  }
  float* d_all = d_logits.as<float>();  // (T, E)

  parallel_for(0, rm::num_chunks(T), 1, [&](int64_t c) {
    rm::TokenScratch s(E);
    std::vector<float> q(E);           // (E,)
    std::vector<int32_t> identity(E);  // (E,) 0..E-1
    std::iota(identity.begin(), identity.end(), 0);
    const int64_t stop = std::min(T, (c + 1) * rm::kTokenChunk);
    for (int64_t t = c * rm::kTokenChunk; t < stop; ++t) {
      const float* row = s.row.data();
      rm::load_row(logits, t, s.row.data());
      const int64_t begin = offsets[t], n = offsets[t + 1] - begin;
      const int32_t* ids = experts + begin;
      const float* g = g_all + begin;
      float* d = d_all + t * E;
      // Weights recomputed from the logits over this token's pair set: exact for any pair set.
      rm::pair_weights(cfg, row, E, ids, n, s.w.data(), s);
      rm::sort_by_expert(ids, n, s.order.data());
      float dot = 0.0f;  // sum_i g_i w_i, in ascending expert order
      for (int64_t j = 0; j < n; ++j) dot += g[s.order[j]] * s.w[s.order[j]];

      if (cfg.kind == RouterKind::softmax_topk && !cfg.renormalize) {
        // w_i = p_{e_i}:  d l_j = p_j (G_j - dot), G_j = g of the pair on j (0 if none).
        const float* p = s.p.data();  // softmax left by pair_weights (n > 0)
        if (n == 0) {
          std::fill(d, d + E, 0.0f);
        } else {
          for (int64_t e = 0; e < E; ++e) d[e] = -p[e] * dot;
          for (int64_t i = 0; i < n; ++i) d[ids[i]] = p[ids[i]] * (g[i] - dot);
        }
      } else {
        std::fill(d, d + E, 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const float x = row[ids[i]];
          if (cfg.kind == RouterKind::sigmoid_bias) {
            // sigma' = sigma(x) sigma(-x) (no cancellation in 1 - sigma for large x).
            const float sneg = rm::sigmoid(-x);
            d[ids[i]] = cfg.renormalize ? s.w[i] * sneg * (g[i] - dot)
                                        : g[i] * s.w[i] * sneg;
          } else {  // softmax over the pairs' logits
            d[ids[i]] = s.w[i] * (g[i] - dot);
          }
        }
      }

      if (want_aux) {
        // d/dl_j [coef E/T sum_e f_e q_e] = coef E/T * q_j (f_j - sum_e f_e q_e)
        // (times sigma(-l_j) for the normalised sigmoid).
        const float lse = aux_distribution(cfg.kind, row, E, identity.data(), q.data());
        float fq = 0.0f;
        for (int64_t e = 0; e < E; ++e) fq += f[e] * q[e];
        for (int64_t e = 0; e < E; ++e) {
          float term = aux_scale * q[e] * (f[e] - fq);
          if (cfg.kind == RouterKind::sigmoid_bias) term *= rm::sigmoid(-row[e]);
          d[e] += term;
        }
        if (want_z && !std::isnan(lse)) {  // q is already the softmax
          for (int64_t e = 0; e < E; ++e) d[e] += z_scale * lse * q[e];
        }
      }
      if (want_z && (!want_aux || cfg.kind == RouterKind::sigmoid_bias)) {
        // d/dl_j [coef/T lse^2] = 2 coef/T * lse * softmax_j
        const float lse = rm::softmax_row(row, E, q.data());
        for (int64_t e = 0; e < E; ++e) d[e] += z_scale * lse * q[e];
      }
    }
  });
}

}  // namespace moeblaze::cpu
