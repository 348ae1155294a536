// Float64 reference routers (see reference_router.hpp). Clarity over speed: every derivative is
// an explicit Jacobian multiplied out by hand.
#include "reference/reference_router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moeblaze/error.hpp"

namespace moeblaze::reference {
namespace {

void require_logit_router(const RouterConfig& cfg, const double* bias) {
  MOEBLAZE_REQUIRE(cfg.kind != RouterKind::supplied,
                   "reference router: the supplied router has no logits");
  MOEBLAZE_REQUIRE(cfg.kind != RouterKind::sigmoid_bias || bias != nullptr,
                   "reference router: sigmoid-bias needs a bias");
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// softmax of one row (max-subtracted).
std::vector<double> softmax(const double* row, int64_t E) {
  const double m = *std::max_element(row, row + E);
  std::vector<double> p(E);
  double z = 0;
  for (int64_t e = 0; e < E; ++e) z += p[e] = std::exp(row[e] - m);
  for (int64_t e = 0; e < E; ++e) p[e] /= z;
  return p;
}

double logsumexp(const double* row, int64_t E) {
  const double m = *std::max_element(row, row + E);
  double z = 0;
  for (int64_t e = 0; e < E; ++e) z += std::exp(row[e] - m);
  return m + std::log(z);
}

// Weights of one token's pairs and their Jacobian J[i][j] = d w_i / d logit_j, (n, E).
void token_weights(const RouterConfig& cfg, const double* row, int64_t E, const int32_t* experts,
                   int64_t n, std::vector<double>& w, std::vector<std::vector<double>>& J) {
  w.assign(n, 0.0);
  J.assign(n, std::vector<double>(E, 0.0));
  if (n == 0) return;
  const bool softmax_over_pairs =
      cfg.kind == RouterKind::topk_softmax ||
      (cfg.kind == RouterKind::softmax_topk && cfg.renormalize);
  if (cfg.kind == RouterKind::softmax_topk && !cfg.renormalize) {
    const std::vector<double> p = softmax(row, E);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = experts[i];
      w[i] = p[e];
      for (int64_t j = 0; j < E; ++j) J[i][j] = p[e] * ((j == e ? 1.0 : 0.0) - p[j]);
    }
  } else if (softmax_over_pairs) {
    // p_e / sum_pairs p = exp(l_e) / sum_pairs exp(l): a softmax over the pairs' logits.
    double m = row[experts[0]];
    for (int64_t i = 0; i < n; ++i) m = std::max(m, row[experts[i]]);
    double z = 0;
    for (int64_t i = 0; i < n; ++i) z += std::exp(row[experts[i]] - m);
    for (int64_t i = 0; i < n; ++i) w[i] = std::exp(row[experts[i]] - m) / z;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < n; ++k)
        J[i][experts[k]] = w[i] * ((i == k ? 1.0 : 0.0) - w[k]);
  } else {  // sigmoid_bias
    std::vector<double> s(n), ds(n);
    double S = 0;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = sigmoid(row[experts[i]]);
      ds[i] = s[i] * (1.0 - s[i]);
      S += s[i];
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!cfg.renormalize) {
        w[i] = s[i];
        J[i][experts[i]] = ds[i];
      } else {
        w[i] = s[i] / S;
        // d(s_i / S)/d s_k = delta_ik / S - s_i / S^2, then times ds_k / d logit.
        for (int64_t k = 0; k < n; ++k)
          J[i][experts[k]] = ((i == k ? 1.0 : 0.0) / S - s[i] / (S * S)) * ds[k];
      }
    }
  }
}

// The per-token distribution the aux loss averages, and its Jacobian Q[e][j] = dq_e / dlogit_j.
void aux_distribution(const RouterConfig& cfg, const double* row, int64_t E,
                      std::vector<double>& q, std::vector<std::vector<double>>& Q) {
  Q.assign(E, std::vector<double>(E, 0.0));
  if (cfg.kind == RouterKind::sigmoid_bias) {
    // Normalised sigmoid scores s / sum(s): sigmoid_bias has no softmax of its own.
    std::vector<double> s(E);
    double S = 0;
    for (int64_t e = 0; e < E; ++e) S += s[e] = sigmoid(row[e]);
    q.resize(E);
    for (int64_t e = 0; e < E; ++e) q[e] = s[e] / S;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < E; ++j)
        Q[e][j] = ((e == j ? 1.0 : 0.0) / S - s[e] / (S * S)) * s[j] * (1.0 - s[j]);
  } else {
    q = softmax(row, E);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < E; ++j) Q[e][j] = q[e] * ((e == j ? 1.0 : 0.0) - q[j]);
  }
}

// f_e = (#pairs on e) / P, 0 when there are no pairs.
std::vector<double> expert_fractions(int64_t T, int64_t E, const int32_t* pair_offsets,
                                     const int32_t* pair_experts) {
  std::vector<double> f(E, 0.0);
  const int64_t P = T > 0 ? pair_offsets[T] : 0;
  for (int64_t p = 0; p < P; ++p) f[pair_experts[p]] += 1.0;
  if (P > 0)
    for (double& x : f) x /= double(P);
  return f;
}

}  // namespace

std::vector<double> router_scores(const RouterConfig& cfg, const double* logits,
                                  const double* bias, int64_t T, int64_t E) {
  require_logit_router(cfg, bias);
  std::vector<double> score(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits + t * E;
    if (cfg.kind == RouterKind::softmax_topk) {
      const std::vector<double> p = softmax(row, E);
      std::copy(p.begin(), p.end(), score.begin() + t * E);
    } else if (cfg.kind == RouterKind::topk_softmax) {
      std::copy(row, row + E, score.begin() + t * E);
    } else {
      for (int64_t e = 0; e < E; ++e) score[t * E + e] = sigmoid(row[e]) + bias[e];
    }
  }
  return score;
}

std::vector<int32_t> router_topk(const RouterConfig& cfg, const double* logits,
                                 const double* bias, int64_t T, int64_t E) {
  const int K = cfg.top_k;
  MOEBLAZE_REQUIRE(K >= 1 && K <= E, "reference router: top_k (", K, ") outside [1, ", E, "]");
  const std::vector<double> score = router_scores(cfg, logits, bias, T, E);
  std::vector<int32_t> ids(T * K);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const double* s = score.data() + t * E;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return s[a] > s[b] || (s[a] == s[b] && a < b);
    });
    std::copy(order.begin(), order.begin() + K, ids.begin() + t * K);
  }
  return ids;
}

std::vector<double> router_pair_weights(const RouterConfig& cfg, const double* logits,
                                        const double* bias, int64_t T, int64_t E,
                                        const int32_t* pair_offsets, const int32_t* pair_experts) {
  require_logit_router(cfg, bias);
  const int64_t P = T > 0 ? pair_offsets[T] : 0;
  std::vector<double> weights(P);
  std::vector<double> w;
  std::vector<std::vector<double>> J;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t begin = pair_offsets[t], n = pair_offsets[t + 1] - begin;
    token_weights(cfg, logits + t * E, E, pair_experts + begin, n, w, J);
    std::copy(w.begin(), w.end(), weights.begin() + begin);
  }
  return weights;
}

RouterLosses router_losses(const RouterConfig& cfg, const double* logits, int64_t T, int64_t E,
                           const int32_t* pair_offsets, const int32_t* pair_experts) {
  MOEBLAZE_REQUIRE(cfg.kind != RouterKind::supplied,
                   "reference router: the supplied router has no logits");
  RouterLosses losses;
  if (T == 0) return losses;
  if (cfg.aux_loss_coef > 0) {
    const std::vector<double> f = expert_fractions(T, E, pair_offsets, pair_experts);
    std::vector<double> P(E, 0.0), q;
    std::vector<std::vector<double>> Q;
    for (int64_t t = 0; t < T; ++t) {
      aux_distribution(cfg, logits + t * E, E, q, Q);
      for (int64_t e = 0; e < E; ++e) P[e] += q[e] / double(T);
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += f[e] * P[e];
    losses.aux_loss = double(cfg.aux_loss_coef) * double(E) * sum;
  }
  if (cfg.z_loss_coef > 0) {
    double sum = 0;
    for (int64_t t = 0; t < T; ++t) {
      const double lse = logsumexp(logits + t * E, E);
      sum += lse * lse;
    }
    losses.z_loss = double(cfg.z_loss_coef) * sum / double(T);
  }
  return losses;
}

std::vector<double> router_backward(const RouterConfig& cfg, const double* logits,
                                    const double* bias, int64_t T, int64_t E,
                                    const int32_t* pair_offsets, const int32_t* pair_experts,
                                    const double* d_pair_weights) {
  require_logit_router(cfg, bias);
  std::vector<double> d(T * E, 0.0);
  const std::vector<double> f = expert_fractions(T, E, pair_offsets, pair_experts);
  std::vector<double> w, q;
  std::vector<std::vector<double>> J, Q;
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits + t * E;
    double* drow = d.data() + t * E;
    const int64_t begin = pair_offsets[t], n = pair_offsets[t + 1] - begin;
    token_weights(cfg, row, E, pair_experts + begin, n, w, J);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < E; ++j) drow[j] += d_pair_weights[begin + i] * J[i][j];
    if (cfg.aux_loss_coef > 0) {
      // aux = coef * E * sum_e f_e * (1/T) sum_t q_{t,e}
      aux_distribution(cfg, row, E, q, Q);
      const double scale = double(cfg.aux_loss_coef) * double(E) / double(T);
      for (int64_t e = 0; e < E; ++e)
        for (int64_t j = 0; j < E; ++j) drow[j] += scale * f[e] * Q[e][j];
    }
    if (cfg.z_loss_coef > 0) {
      // z = coef * (1/T) sum_t lse_t^2;  d lse / d logit = softmax.
      const double lse = logsumexp(row, E);
      const std::vector<double> p = softmax(row, E);
      for (int64_t j = 0; j < E; ++j)
        drow[j] += double(cfg.z_loss_coef) * 2.0 * lse * p[j] / double(T);
    }
  }
  return d;
}

}  // namespace moeblaze::reference
