// Token rounding (SonicMoE §5): counts, deviation bounds, which pairs are dropped or added,
// seeded SR-f, recomputed weights, thread-count independence and argument validation.
//
// Bounds asserted: every expert's count n_e is a multiple of m_tile, or equals T when the
// rounded-up target exceeds T (the clamp to [0, T]); 0 <= n_e <= T; and |n_e - c_e| < m_tile in
// every mode (UP and DOWN move to the adjacent multiple, so by at most m_tile - 1; NR-f by at most
// m_tile / 2; SR-f picks one of the two adjacent multiples).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/parallel.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_router.hpp"

namespace moeblaze {
namespace {

constexpr RouterKind kKinds[] = {RouterKind::softmax_topk, RouterKind::topk_softmax,
                                 RouterKind::sigmoid_bias};
constexpr RoundingMode kModes[] = {RoundingMode::nearest_freq, RoundingMode::stochastic_freq,
                                   RoundingMode::up, RoundingMode::down};

struct Problem {
  int64_t T, E;
  RouterConfig router;
  std::vector<float> logits;  // (T, E)
  std::vector<float> bias;    // (E,) sigmoid_bias only
  std::vector<double> logits64, bias64;

  Problem(RouterKind kind, int64_t T_, int64_t E_, int K, bool renorm, uint64_t seed)
      : T(T_), E(E_) {
    router.kind = kind;
    router.top_k = K;
    router.renormalize = renorm;
    logits = test::random_normal(size_t(T * E), seed, 1.5f);
    if (kind == RouterKind::sigmoid_bias) bias = test::random_normal(size_t(E), seed + 1, 0.3f);
    widen();
  }
  void widen() {
    logits64.assign(logits.begin(), logits.end());
    bias64.assign(bias.begin(), bias.end());
  }
  TensorView logits_view() { return host_view(logits.data(), {T, E}); }
  TensorView bias_view() {
    return router.kind == RouterKind::sigmoid_bias ? host_view(bias.data(), {E}) : TensorView();
  }
  const double* bias_ptr() const {
    return router.kind == RouterKind::sigmoid_bias ? bias64.data() : nullptr;
  }
};

// An arbitrary token-choice routing given as each token's experts (CSR), weights all 1.
struct PairList {
  int64_t T, E;
  std::vector<int32_t> offsets{0}, experts;
  std::vector<float> weights;
  PairList(int64_t T_, int64_t E_, const std::vector<std::vector<int32_t>>& per_token)
      : T(T_), E(E_) {
    for (const auto& ex : per_token) {
      experts.insert(experts.end(), ex.begin(), ex.end());
      offsets.push_back(int32_t(experts.size()));
    }
    weights.assign(experts.size(), 1.0f);
  }
  RoutingView view() const {
    return RoutingView{T, E, int64_t(experts.size()), offsets.data(), experts.data(),
                       weights.data(), Device::cpu};
  }
};

std::vector<int64_t> expert_counts(const RoutingView& r) {
  std::vector<int64_t> c(r.E, 0);
  for (int64_t p = 0; p < r.P; ++p) ++c[r.pair_experts[p]];
  return c;
}

// Expected count by the definitions (written independently of the library).
int64_t expected_count(RoundingMode mode, int64_t c, int64_t m, int64_t T) {
  const int64_t lo = c / m * m, hi = (c + m - 1) / m * m;
  int64_t target = 0;
  switch (mode) {
    case RoundingMode::down: target = lo; break;
    case RoundingMode::up: target = hi; break;
    case RoundingMode::nearest_freq: {
      const double q = double(c) / double(m), fl = std::floor(q);
      if (q - fl > 0.5) target = hi;
      else if (q - fl < 0.5) target = lo;
      else target = (int64_t(fl) % 2 == 0) ? lo : hi;  // exactly half: the even tile count
      break;
    }
    case RoundingMode::stochastic_freq: return -1;  // either adjacent multiple
  }
  return std::min(target, T);
}

std::string case_str(const RouterConfig& r, const TokenRoundingConfig& c, int64_t T, int64_t E) {
  return detail::concat(router_name(r.kind), " renorm=", r.renormalize, " K=", r.top_k, " ",
                        rounding_name(c.mode), " m_tile=", c.m_tile, " T=", T, " E=", E);
}

// Every property of one rounding result against its top-K input.
void check_rounding(Problem& pb, const TokenRoundingConfig& cfg, const Routing& topk,
                    const Routing& out) {
  const int64_t T = pb.T, E = pb.E, m = cfg.m_tile;
  ASSERT_EQ(out.T(), T);
  ASSERT_EQ(out.E(), E);
  ASSERT_NO_THROW(validate_routing(out.view()));  // offsets, ids, no duplicate, finite weights
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = out.pair_offsets()[t] + 1; p < out.pair_offsets()[t + 1]; ++p)
      ASSERT_LT(out.pair_experts()[p - 1], out.pair_experts()[p]) << "token " << t;

  const auto c = expert_counts(topk.view());
  const auto n = expert_counts(out.view());
  // Membership by expert, as token sets.
  std::vector<std::set<int32_t>> tc(E), rounded(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t p = topk.pair_offsets()[t]; p < topk.pair_offsets()[t + 1]; ++p)
      tc[topk.pair_experts()[p]].insert(int32_t(t));
    for (int64_t p = out.pair_offsets()[t]; p < out.pair_offsets()[t + 1]; ++p)
      rounded[out.pair_experts()[p]].insert(int32_t(t));
  }
  const auto score = reference::router_scores(pb.router, pb.logits64.data(), pb.bias_ptr(), T, E);
  for (int64_t e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e) + " c=" + std::to_string(c[e]) + " n=" +
                 std::to_string(n[e]));
    const int64_t hi = (c[e] + m - 1) / m * m;
    EXPECT_TRUE(n[e] % m == 0 || (n[e] == T && hi > T));
    EXPECT_GE(n[e], 0);
    EXPECT_LE(n[e], T);
    EXPECT_LT(std::llabs(n[e] - c[e]), m);
    const int64_t want = expected_count(cfg.mode, c[e], m, T);
    if (want >= 0)
      EXPECT_EQ(n[e], want);
    else
      EXPECT_TRUE(n[e] == c[e] / m * m || n[e] == std::min(hi, T));

    auto sc = [&](int32_t t) { return score[t * E + e]; };
    if (n[e] <= c[e]) {
      // Dropped: a subset of the token-choice tokens, and the lowest-scoring ones.
      double kept_min = INFINITY, dropped_max = -INFINITY;
      for (int32_t t : rounded[e]) {
        EXPECT_TRUE(tc[e].count(t)) << "token " << t << " added while rounding down";
        kept_min = std::min(kept_min, sc(t));
      }
      for (int32_t t : tc[e])
        if (!rounded[e].count(t)) dropped_max = std::max(dropped_max, sc(t));
      EXPECT_GE(kept_min, dropped_max - 1e-6);
    }
    if (n[e] >= c[e]) {
      // Added: tokens that did not choose e, the highest-scoring of them.
      double added_min = INFINITY, rest_max = -INFINITY;
      for (int32_t t : tc[e]) EXPECT_TRUE(rounded[e].count(t)) << "token " << t << " dropped";
      for (int64_t t = 0; t < T; ++t) {
        if (tc[e].count(int32_t(t))) continue;
        if (rounded[e].count(int32_t(t)))
          added_min = std::min(added_min, sc(int32_t(t)));
        else
          rest_max = std::max(rest_max, sc(int32_t(t)));
      }
      EXPECT_GE(added_min, rest_max - 1e-6);
    }
  }

  // Weights: the router's rule over each token's new pair set.
  const auto ref_w = reference::router_pair_weights(pb.router, pb.logits64.data(), pb.bias_ptr(),
                                                    T, E, out.pair_offsets(), out.pair_experts());
  for (int64_t p = 0; p < out.P(); ++p)
    ASSERT_LE(std::fabs(out.pair_weights()[p] - ref_w[p]), 2e-6 + 1e-5 * std::fabs(ref_w[p]))
        << "pair " << p;
}

TEST(TokenRounding, EveryModeTileAndRouterKeepsItsInvariants) {
  struct Shape { int64_t T, E; int K; };
  const Shape shapes[] = {{0, 8, 2}, {3, 8, 2}, {50, 8, 2}, {300, 16, 4}, {70, 6, 6}};
  for (RouterKind kind : kKinds)
    for (RoundingMode mode : kModes)
      for (int m_tile : {1, 4, 16, 128})
        for (const Shape& sh : shapes) {
          const uint64_t seed = test::fresh_seed();
          const bool renorm = (seed & 1) != 0;
          Problem pb(kind, sh.T, sh.E, sh.K, renorm, seed);
          TokenRoundingConfig cfg;
          cfg.m_tile = m_tile;
          cfg.mode = mode;
          cfg.seed = seed >> 1;
          SCOPED_TRACE(case_str(pb.router, cfg, sh.T, sh.E) + " seed=" + std::to_string(seed));
          Routing topk, out;
          route(pb.router, pb.logits_view(), pb.bias_view(), topk);
          token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
          check_rounding(pb, cfg, topk, out);
          if (HasFatalFailure() || HasFailure()) return;

          if (m_tile == 1) {
            // Exactly the top-K assignment set, and bitwise the router's own weights (sums
            // run in ascending expert order whatever order the pairs are stored in).
            ASSERT_EQ(out.P(), topk.P());
            for (int64_t t = 0; t < sh.T; ++t) {
              std::vector<std::pair<int32_t, float>> a, b;
              for (int64_t p = topk.pair_offsets()[t]; p < topk.pair_offsets()[t + 1]; ++p)
                a.emplace_back(topk.pair_experts()[p], topk.pair_weights()[p]);
              for (int64_t p = out.pair_offsets()[t]; p < out.pair_offsets()[t + 1]; ++p)
                b.emplace_back(out.pair_experts()[p], out.pair_weights()[p]);
              std::sort(a.begin(), a.end());
              ASSERT_EQ(a.size(), b.size()) << "token " << t;
              for (size_t i = 0; i < a.size(); ++i) {
                ASSERT_EQ(a[i].first, b[i].first) << "token " << t;
                ASSERT_EQ(std::memcmp(&a[i].second, &b[i].second, 4), 0) << "token " << t;
              }
            }
          }
        }
}

TEST(TokenRounding, CountsFollowEachModeOnConstructedCounts) {
  // T = 64 tokens, K = 1, m_tile = 8. Counts 12 (1.5 tiles), 20 (2.5 tiles), 3, 29 (3.625 tiles).
  const int64_t T = 64, E = 4;
  std::vector<std::vector<int32_t>> per_token(T);
  const int64_t counts[E] = {12, 20, 3, 29};
  for (int64_t e = 0, t = 0; e < E; ++e)
    for (int64_t j = 0; j < counts[e]; ++j) per_token[t++].push_back(int32_t(e));
  const PairList topk(T, E, per_token);
  struct Case { RoundingMode mode; std::vector<int64_t> want; };
  const Case cases[] = {
      {RoundingMode::nearest_freq, {16, 16, 0, 32}},  // 1.5 → 2 tiles, 2.5 → 2 tiles (even)
      {RoundingMode::up, {16, 24, 8, 32}},
      {RoundingMode::down, {8, 16, 0, 24}},
  };
  for (RouterKind kind : kKinds) {
    const uint64_t seed = test::fresh_seed();
    Problem pb(kind, T, E, 1, false, seed);
    for (const Case& cs : cases) {
      TokenRoundingConfig cfg;
      cfg.m_tile = 8;
      cfg.mode = cs.mode;
      SCOPED_TRACE(case_str(pb.router, cfg, T, E) + " seed=" + std::to_string(seed));
      Routing out;
      token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
      EXPECT_EQ(expert_counts(out.view()), cs.want);
    }
  }
}

TEST(TokenRounding, CountsClampToTWhenRoundingUpOverflows) {
  // T = 10 < m_tile = 16: rounding up can only take every token.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const int64_t T = 10, E = 4;
  Problem pb(RouterKind::softmax_topk, T, E, 2, true, seed);
  Routing topk, out;
  route(pb.router, pb.logits_view(), pb.bias_view(), topk);
  TokenRoundingConfig cfg;
  cfg.m_tile = 16;
  cfg.mode = RoundingMode::up;
  token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
  const auto c = expert_counts(topk.view());
  const auto n = expert_counts(out.view());
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(n[e], c[e] == 0 ? 0 : T) << "expert " << e;
  cfg.mode = RoundingMode::down;
  token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
  EXPECT_EQ(out.P(), 0);
  for (int64_t t = 0; t <= T; ++t) EXPECT_EQ(out.pair_offsets()[t], 0);  // tokens may end empty
}

TEST(TokenRounding, ExactTiesGoToTheLowerTokenId) {
  // Every token has the same logits row, so an expert's scores are all equal: rounding down
  // keeps the lowest token ids, rounding up adds the lowest token ids that did not choose it.
  const int64_t T = 20, E = 4;
  std::vector<std::vector<int32_t>> per_token(T);
  for (int32_t t : {1, 3, 5, 7, 9, 11}) per_token[t] = {0};
  for (int32_t t : {0, 2, 4}) per_token[t] = {2};
  const PairList topk(T, E, per_token);
  for (RouterKind kind : kKinds) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(std::string(router_name(kind)) + " seed=" + std::to_string(seed));
    Problem pb(kind, T, E, 1, true, seed);
    for (int64_t t = 1; t < T; ++t)
      std::copy(pb.logits.begin(), pb.logits.begin() + E, pb.logits.begin() + t * E);
    pb.widen();
    TokenRoundingConfig cfg;
    cfg.m_tile = 4;
    auto tokens_of = [&](const Routing& r, int32_t e) {
      std::vector<int32_t> v;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t p = r.pair_offsets()[t]; p < r.pair_offsets()[t + 1]; ++p)
          if (r.pair_experts()[p] == e) v.push_back(int32_t(t));
      return v;
    };
    Routing out;
    cfg.mode = RoundingMode::down;
    token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
    EXPECT_EQ(tokens_of(out, 0), (std::vector<int32_t>{1, 3, 5, 7}));
    EXPECT_EQ(tokens_of(out, 2), (std::vector<int32_t>{}));
    cfg.mode = RoundingMode::up;
    token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
    EXPECT_EQ(tokens_of(out, 0), (std::vector<int32_t>{0, 1, 2, 3, 5, 7, 9, 11}));
    EXPECT_EQ(tokens_of(out, 2), (std::vector<int32_t>{0, 1, 2, 4}));
    EXPECT_EQ(tokens_of(out, 1), (std::vector<int32_t>{}));
  }
}

TEST(TokenRounding, StochasticRoundingIsSeededReproducibleAndUnbiased) {
  // 32 experts with 11 tokens each (11 mod 8 = 3): each rounds up with probability 3/8.
  const int64_t T = 256, E = 32, m = 8;
  std::vector<std::vector<int32_t>> per_token(T);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < 11; ++j) per_token[(e * 11 + j) % T].push_back(int32_t(e));
  for (auto& v : per_token) std::sort(v.begin(), v.end());
  const PairList topk(T, E, per_token);
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  Problem pb(RouterKind::softmax_topk, T, E, 2, false, seed);
  TokenRoundingConfig cfg;
  cfg.m_tile = m;
  cfg.mode = RoundingMode::stochastic_freq;

  std::mt19937_64 rng(seed);
  const int draws = 200;
  int64_t ups = 0;
  std::set<std::vector<int64_t>> distinct;
  for (int i = 0; i < draws; ++i) {
    cfg.seed = rng();
    Routing a, b;
    token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), a);
    token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), b);
    ASSERT_EQ(a.P(), b.P());  // same seed: the same routing, bit for bit
    ASSERT_EQ(std::memcmp(a.pair_offsets(), b.pair_offsets(), (T + 1) * 4), 0);
    ASSERT_EQ(std::memcmp(a.pair_experts(), b.pair_experts(), a.P() * 4), 0);
    ASSERT_EQ(std::memcmp(a.pair_weights(), b.pair_weights(), a.P() * 4), 0);
    const auto n = expert_counts(a.view());
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_TRUE(n[e] == 8 || n[e] == 16) << "expert " << e << " count " << n[e];
      ups += n[e] == 16;
    }
    distinct.insert(n);
  }
  EXPECT_GT(distinct.size(), 100u);  // the seed changes the outcome
  // 6400 Bernoulli(3/8) draws: standard deviation 0.006; 0.04 is more than six of them.
  EXPECT_NEAR(double(ups) / double(draws * E), 3.0 / 8.0, 0.04);
}

TEST(TokenRounding, BitwiseIndependentOfThreadCount) {
  for (RouterKind kind : kKinds)
    for (RoundingMode mode : kModes) {
      const uint64_t seed = test::fresh_seed();
      Problem pb(kind, 2000, 32, 4, true, seed);
      TokenRoundingConfig cfg;
      cfg.m_tile = 16;
      cfg.mode = mode;
      cfg.seed = seed;
      SCOPED_TRACE(case_str(pb.router, cfg, pb.T, pb.E) + " seed=" + std::to_string(seed));
      Routing topk, a, b;
      route(pb.router, pb.logits_view(), pb.bias_view(), topk);
      {
        ThreadCountScope one(1);
        token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), a);
      }
      {
        ThreadCountScope four(4);
        token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), b);
      }
      ASSERT_EQ(a.P(), b.P());
      EXPECT_EQ(std::memcmp(a.pair_offsets(), b.pair_offsets(), (pb.T + 1) * 4), 0);
      EXPECT_EQ(std::memcmp(a.pair_experts(), b.pair_experts(), a.P() * 4), 0);
      EXPECT_EQ(std::memcmp(a.pair_weights(), b.pair_weights(), a.P() * 4), 0);
    }
}

TEST(TokenRounding, RoutedBackwardWorksOnRoundedPairs) {
  // router_backward on a rounded routing differentiates the weights token_round produced.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  for (RouterKind kind : kKinds) {
    Problem pb(kind, 200, 8, 2, true, seed);
    pb.router.aux_loss_coef = 0.01f;
    Routing topk, out;
    route(pb.router, pb.logits_view(), pb.bias_view(), topk);
    TokenRoundingConfig cfg;
    cfg.m_tile = 16;
    token_round(pb.router, cfg, pb.logits_view(), pb.bias_view(), topk.view(), out);
    const auto gf = test::random_normal(size_t(out.P()), seed + 5);
    const std::vector<double> g(gf.begin(), gf.end());
    std::vector<float> d(pb.T * pb.E);
    router_backward(pb.router, pb.logits_view(), pb.bias_view(), out.view(),
                    host_view(gf.data(), {out.P()}), host_view(d.data(), {pb.T, pb.E}));
    const auto ref = reference::router_backward(pb.router, pb.logits64.data(), pb.bias_ptr(), pb.T,
                                                pb.E, out.pair_offsets(), out.pair_experts(),
                                                g.data());
    EXPECT_LE(test::rel_frobenius(d.data(), ref.data(), d.size()), test::rel_tolerance(DType::f32));
  }
}

template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& substring) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected InvalidArgument containing \"" << substring << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << substring << "\"";
  }
}

TEST(TokenRounding, RejectsBadArgumentsAndLeavesOutputAlone) {
  const uint64_t seed = test::fresh_seed();
  Problem pb(RouterKind::softmax_topk, 6, 8, 2, false, seed);
  Routing topk;
  route(pb.router, pb.logits_view(), pb.bias_view(), topk);
  // The output starts as a copy of the top-K routing; no failed call may change it.
  Routing out;
  route(pb.router, pb.logits_view(), pb.bias_view(), out);
  const std::vector<int32_t> experts0(out.pair_experts(), out.pair_experts() + out.P());
  const std::vector<float> weights0(out.pair_weights(), out.pair_weights() + out.P());
  TokenRoundingConfig cfg;
  cfg.m_tile = 4;

  TokenRoundingConfig bad = cfg;
  bad.m_tile = 0;
  expect_invalid([&] { token_round(pb.router, bad, pb.logits_view(), {}, topk.view(), out); },
                 "m_tile (0) must be >= 1");
  RouterConfig supplied = pb.router;
  supplied.kind = RouterKind::supplied;
  expect_invalid([&] { token_round(supplied, cfg, pb.logits_view(), {}, topk.view(), out); },
                 "token_round: the supplied router has no logits");
  RouterConfig sig = pb.router;
  sig.kind = RouterKind::sigmoid_bias;
  expect_invalid([&] { token_round(sig, cfg, pb.logits_view(), {}, topk.view(), out); },
                 "is required by the sigmoid-bias router");
  Problem other(RouterKind::softmax_topk, 7, 8, 2, false, seed + 1);
  expect_invalid([&] { token_round(pb.router, cfg, other.logits_view(), {}, topk.view(), out); },
                 "topk has T = 6 tokens but logits have 7");
  std::vector<int32_t> bad_experts(topk.pair_experts(), topk.pair_experts() + topk.P());
  bad_experts[5] = 8;
  RoutingView bad_view = topk.view();
  bad_view.pair_experts = bad_experts.data();
  expect_invalid([&] { token_round(pb.router, cfg, pb.logits_view(), {}, bad_view, out); },
                 "pair_experts: expert id 8 of token 2 is out of range [0, 8)");
  auto nan_logits = pb.logits;
  nan_logits[2 * 8 + 6] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(
      [&] { token_round(pb.router, cfg, host_view(nan_logits.data(), {6, 8}), {}, topk.view(), out); },
      "logits[2, 6] (token 2, expert 6) is nan");

  ASSERT_EQ(out.P(), int64_t(experts0.size()));
  EXPECT_EQ(std::vector<int32_t>(out.pair_experts(), out.pair_experts() + out.P()), experts0);
  EXPECT_EQ(std::vector<float>(out.pair_weights(), out.pair_weights() + out.P()), weights0);
}

}  // namespace
}  // namespace moeblaze
