// Per-token router arithmetic shared by the CPU router (router.cpp) and token rounding
// (token_rounding.cpp). One definition of each formula, so a pair set gets bitwise the same
// weights whichever of them computes it, and router_backward differentiates exactly what the
// forward computed. All arithmetic is fp32; every sum over a token's pairs runs in ascending
// expert order (not storage order), so a token-rounded routing, whose pairs are stored by expert,
// and a top-K routing, stored by rank, give identical weights for identical sets.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/parallel.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze::cpu::router_math {

// Tokens per parallel work item. Fixed (not derived from the thread count) so that per-chunk
// partial sums, and hence every result, are bitwise independent of how many threads run.
constexpr int64_t kTokenChunk = 64;

inline int64_t num_chunks(int64_t T) { return (T + kTokenChunk - 1) / kTokenChunk; }

// Row t of (T, E) fp32 or bf16 logits, widened to fp32 (exact).
inline void load_row(const TensorView& logits, int64_t t, float* row) {
  const int64_t E = logits.dim(1);
  if (logits.dtype == DType::bf16) {
    const bf16* src = logits.as<const bf16>() + t * E;
    for (int64_t e = 0; e < E; ++e) row[e] = float(src[e]);
  } else {
    const float* src = logits.as<const float>() + t * E;
    std::copy(src, src + E, row);
  }
}

inline const char* nonfinite_name(float v) { return std::isnan(v) ? "nan" : "inf"; }

// Throws naming the first non-finite logit in row-major order, before any output is written.
inline void require_finite_logits(const TensorView& logits) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const int64_t chunks = num_chunks(T);
  std::vector<int64_t> first_bad(chunks, -1);  // (chunks,) flat index of the chunk's first bad logit
  parallel_for(0, chunks, 1, [&](int64_t c) {
    std::vector<float> row(E);
    const int64_t stop = std::min(T, (c + 1) * kTokenChunk);
    for (int64_t t = c * kTokenChunk; t < stop; ++t) {
      load_row(logits, t, row.data());
      for (int64_t e = 0; e < E; ++e)
        if (!std::isfinite(row[e])) {
          first_bad[c] = t * E + e;
          return;
        }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (first_bad[c] < 0) continue;
    const int64_t t = first_bad[c] / E, e = first_bad[c] % E;
    std::vector<float> row(E);
    load_row(logits, t, row.data());
    throw InvalidArgument(detail::concat("logits[", t, ", ", e, "] (token ", t, ", expert ", e,
                                         ") is ", nonfinite_name(row[e]),
                                         ": logits must be finite"));
  }
}

// bias (E,) fp32 of the sigmoid-bias router.
inline void require_finite_bias(const TensorView& bias) {
  const float* b = bias.as<const float>();
  for (int64_t e = 0; e < bias.dim(0); ++e)
    MOEBLAZE_REQUIRE(std::isfinite(b[e]), "bias[", e, "] (expert ", e, ") is ",
                     nonfinite_name(b[e]), ": bias must be finite");
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// p = softmax(l) over E entries (max-subtracted, summed in ascending order); returns logsumexp(l).
inline float softmax_row(const float* l, int64_t E, float* p) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  float z = 0.0f;
  for (int64_t e = 0; e < E; ++e) z += p[e] = std::exp(l[e] - m);
  for (int64_t e = 0; e < E; ++e) p[e] /= z;
  return m + std::log(z);
}

// w_i = exp(x_i) / sum_j exp(x_j) over n values given in `order` (ascending expert) for the sum.
inline void softmax_subset(const float* x, const int32_t* order, int64_t n, float* w) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  for (int64_t i = 0; i < n; ++i) w[i] = std::exp(x[i] - m);
  float z = 0.0f;
  for (int64_t j = 0; j < n; ++j) z += w[order[j]];
  for (int64_t i = 0; i < n; ++i) w[i] /= z;
}

// s_i / sum_j s_j for s = sigmoid(x), sum in `order`. When every s underflows (all logits below
// about -87) the same ratio is taken in the log domain, log s = x - log1p(exp(x)), instead of 0/0.
inline void normalized_sigmoid(const float* x, const int32_t* order, int64_t n, float* w) {
  float z = 0.0f;
  for (int64_t i = 0; i < n; ++i) w[i] = sigmoid(x[i]);
  for (int64_t j = 0; j < n; ++j) z += w[order[j]];
  if (z >= FLT_MIN) {
    for (int64_t i = 0; i < n; ++i) w[i] /= z;
    return;
  }
  for (int64_t i = 0; i < n; ++i) w[i] = x[i] - std::log1p(std::exp(x[i]));
  softmax_subset(w, order, n, w);
}

// order[0..n) = positions of experts[0..n) sorted by expert id (n <= E, ids distinct).
inline void sort_by_expert(const int32_t* experts, int64_t n, int32_t* order) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t j = i;
    while (j > 0 && experts[order[j - 1]] > experts[i]) {
      order[j] = order[j - 1];
      --j;
    }
    order[j] = static_cast<int32_t>(i);
  }
}

// Selection keys of one token. The softmax routers select by the logit: softmax is monotonic, so
// this is the top-K of the probabilities, decided on exact input values (no rounding can reorder
// two experts). sigmoid_bias selects by sigmoid(logit) + bias.
inline void selection_keys(RouterKind kind, const float* row, const float* bias, int64_t E,
                           float* key) {
  if (kind == RouterKind::sigmoid_bias) {
    for (int64_t e = 0; e < E; ++e) key[e] = sigmoid(row[e]) + bias[e];
  } else {
    std::copy(row, row + E, key);
  }
}

// The k largest keys, best first. A strict '>' keeps an earlier (lower) expert id ahead of a
// later one with an equal key, so ties break to the lower id.
inline void top_k(const float* key, int64_t E, int k, int32_t* ids) {
  int n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = key[e];
    if (n == k && !(v > key[ids[k - 1]])) continue;
    int j = n < k ? n++ : k - 1;
    while (j > 0 && v > key[ids[j - 1]]) {
      ids[j] = ids[j - 1];
      --j;
    }
    ids[j] = static_cast<int32_t>(e);
  }
}

// Scratch for one token: sized once per work item, reused for every token in it.
struct TokenScratch {
  std::vector<float> row, p, x, w;  // (E,) each
  std::vector<int32_t> order;       // (E,)
  explicit TokenScratch(int64_t E) : row(E), p(E), x(E), w(E), order(E) {}
};

// Gate weights w[0..n) of one token's pairs (experts[0..n), distinct, any order), by the router's
// rule (config.hpp). softmax_topk with renormalize is evaluated as the softmax over the pairs'
// logits, which equals p_e / sum_pairs p exactly in real arithmetic and cannot turn into 0/0 when
// the pairs' probabilities underflow. Uses s.p (softmax_topk without renormalize), s.x, s.order.
inline void pair_weights(const RouterConfig& cfg, const float* row, int64_t E,
                         const int32_t* experts, int64_t n, float* w, TokenScratch& s) {
  if (n == 0) return;
  if (cfg.kind == RouterKind::softmax_topk && !cfg.renormalize) {
    softmax_row(row, E, s.p.data());
    for (int64_t i = 0; i < n; ++i) w[i] = s.p[experts[i]];
    return;
  }
  for (int64_t i = 0; i < n; ++i) s.x[i] = row[experts[i]];
  sort_by_expert(experts, n, s.order.data());
  if (cfg.kind == RouterKind::sigmoid_bias) {
    if (cfg.renormalize) {
      normalized_sigmoid(s.x.data(), s.order.data(), n, w);
    } else {
      for (int64_t i = 0; i < n; ++i) w[i] = sigmoid(s.x[i]);
    }
  } else {  // topk_softmax, or softmax_topk renormalised
    softmax_subset(s.x.data(), s.order.data(), n, w);
  }
}

}  // namespace moeblaze::cpu::router_math
