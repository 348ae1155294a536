// Expert parallelism on the CPU through the in-process transport (simulated ranks on threads):
// ep_forward / ep_backward against the single-device layer on the concatenated problem, for 1, 2
// and 4 ranks, fp32 and bf16, every output and gradient; the transport itself; the collective
// argument checks.
//
// What must be bitwise equal to the single-device layer, and why (docs/EXPERT_PARALLEL.md):
//  - dw1, dw2: each expert's slots arrive on its rank in global token order (sources in rank
//    order, ascending tokens inside), so every slot sum runs over the same terms in the same
//    order, and the CPU GEMMs do not depend on blocking;
//  - d_pair_weights: one dot product per slot, from the same rows;
//  - out, dx: when all of a token's experts live on one rank, its single partial is the
//    single-device sum in the same pair order; 0 + partial and a second store in the same dtype
//    change nothing.
// When a token's experts span ranks, out and dx are sums of per-rank partials (stored in the
// dtype) taken in rank order: equal within rounding, with tolerances below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "moeblaze/expert_parallel.hpp"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

using test::HostRouting;
using test::HostTensor;

// Relative Frobenius tolerance of EP vs single device where a token's partials are added across
// ranks. fp32: the same products summed in another grouping differ by a few rounding units of
// 2^-24 (measured: <= 4e-8 relative); 4 units (2^-22) leave room for cancelling sums. bf16: each
// per-rank partial is rounded to bf16 before the cross-rank sum (<= 2^-9 relative each) and the
// result once more: 4 bf16 half-units (2^-7); measured <= 3.2e-3.
double cross_rank_tol(DType dt) { return dt == DType::bf16 ? 0x1p-7 : 0x1p-22; }

enum class Placement {
  any,        // K distinct experts anywhere
  one_rank,   // all K experts of a token inside one rank's block
  skip_last,  // never the last rank's experts (that rank receives no token)
};

struct Spec {
  int W = 2;
  int64_t E = 8, K = 2, d = 32, n = 24;
  std::vector<int64_t> T;  // tokens per rank
  Placement placement = Placement::any;
  double skew = 0.0;       // probability that a pair is forced into rank 0's experts
  double no_pairs = 0.0;   // probability that a token has no pair (a token-rounding routing)
  Activation act = Activation::swiglu;
  DType dtype = DType::f32;
  LayerMode mode = LayerMode::keep_h;
};

// A routing of T tokens with global expert ids; weights in [0.05, 1); pair order within a token
// random (it decides the summation order, which EP must keep).
HostRouting make_routing(const Spec& s, int64_t T, std::mt19937_64& rng) {
  const int64_t El = s.E / s.W;
  HostRouting r;
  r.T = T;
  r.E = s.E;
  r.offsets.assign(static_cast<size_t>(T + 1), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[t] = static_cast<int32_t>(r.experts.size());
    if (u01(rng) >= s.no_pairs) {
      int64_t lo = 0, hi = s.E;  // experts drawn from [lo, hi)
      if (s.placement == Placement::one_rank) {
        const int64_t rank = u01(rng) < s.skew ? 0 : std::uniform_int_distribution<int64_t>(0, s.W - 1)(rng);
        lo = rank * El;
        hi = lo + El;
      } else if (s.placement == Placement::skip_last) {
        hi = s.E - El;
      }
      std::vector<int32_t> chosen;
      while (static_cast<int64_t>(chosen.size()) < s.K) {
        int64_t e;
        if (s.placement != Placement::one_rank && u01(rng) < s.skew && El >= s.K)
          e = std::uniform_int_distribution<int64_t>(0, El - 1)(rng);
        else
          e = std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end())
          chosen.push_back(static_cast<int32_t>(e));
      }
      for (int32_t e : chosen) {
        r.experts.push_back(e);
        r.weights.push_back(wdist(rng));
      }
    }
  }
  r.offsets[T] = static_cast<int32_t>(r.experts.size());
  return r;
}

// Rows [r0, r0 + rows) of a tensor whose first dimension is rows, as a new tensor.
HostTensor slice_rows(const HostTensor& t, int64_t r0, int64_t rows) {
  std::vector<int64_t> shape = t.shape;
  shape[0] = rows;
  HostTensor out(t.dtype, shape);
  const size_t row_bytes = t.bytes.size() / static_cast<size_t>(std::max<int64_t>(t.shape[0], 1));
  if (rows > 0)
    std::memcpy(out.bytes.data(), t.bytes.data() + static_cast<size_t>(r0) * row_bytes,
                static_cast<size_t>(rows) * row_bytes);
  return out;
}

struct RankData {
  LayerConfig cfg;
  HostRouting routing;
  HostTensor x, w1, w2, out, d_out, dx, dw1, dw2, dpw;
  EpSaved saved;
  int64_t received = -1, sent = -1;
  EpTimings fwd_t, bwd_t;
};

// The single-device problem and its per-rank shards.
struct Problem {
  Spec spec;
  LayerConfig cfg;  // global: T = sum of the ranks' tokens
  HostRouting global;
  std::unique_ptr<test::LayerTensors> ref;  // single-device inputs and results
  std::vector<RankData> ranks;
  std::vector<int64_t> t_off, p_off;  // (W+1,) token and pair offsets of each rank
};

Problem make_problem(const Spec& s, uint64_t seed) {
  Problem p;
  p.spec = s;
  std::mt19937_64 rng(seed);
  const int64_t El = s.E / s.W;
  p.cfg.d = s.d;
  p.cfg.n = s.n;
  p.cfg.E = s.E;
  p.cfg.K = s.K;
  p.cfg.activation = s.act;
  p.cfg.dtype = s.dtype;
  p.ranks.resize(static_cast<size_t>(s.W));
  p.t_off.assign(static_cast<size_t>(s.W + 1), 0);
  p.p_off.assign(static_cast<size_t>(s.W + 1), 0);
  p.global.E = s.E;
  p.global.offsets = {0};
  for (int r = 0; r < s.W; ++r) {
    RankData& rd = p.ranks[r];
    rd.routing = make_routing(s, s.T[r], rng);
    for (int64_t t = 0; t < rd.routing.T; ++t)
      p.global.offsets.push_back(static_cast<int32_t>(p.global.experts.size()) +
                                 rd.routing.offsets[t + 1]);
    p.global.experts.insert(p.global.experts.end(), rd.routing.experts.begin(),
                            rd.routing.experts.end());
    p.global.weights.insert(p.global.weights.end(), rd.routing.weights.begin(),
                            rd.routing.weights.end());
    p.t_off[r + 1] = p.t_off[r] + s.T[r];
    p.p_off[r + 1] = p.p_off[r] + rd.routing.P();
  }
  p.global.T = p.t_off[s.W];
  p.cfg.T = p.global.T;

  p.ref = std::make_unique<test::LayerTensors>(p.cfg, p.global.P());
  p.ref->randomize(seed ^ 0x9e3779b97f4a7c15ull);
  for (int r = 0; r < s.W; ++r) {
    RankData& rd = p.ranks[r];
    rd.cfg = p.cfg;
    rd.cfg.T = s.T[r];
    rd.x = slice_rows(p.ref->x, p.t_off[r], s.T[r]);
    rd.d_out = slice_rows(p.ref->d_out, p.t_off[r], s.T[r]);
    rd.w1 = slice_rows(p.ref->w1, r * El, El);
    rd.w2 = slice_rows(p.ref->w2, r * El, El);
    rd.out = HostTensor(s.dtype, {s.T[r], s.d});
    rd.dx = HostTensor(s.dtype, {s.T[r], s.d});
    rd.dw1 = HostTensor(s.dtype, rd.w1.shape);
    rd.dw2 = HostTensor(s.dtype, rd.w2.shape);
    rd.dpw = HostTensor(DType::f32, {rd.routing.P()});
    for (HostTensor* t : {&rd.out, &rd.dx, &rd.dw1, &rd.dw2, &rd.dpw}) t->fill_pattern();
  }
  return p;
}

void run_single_device(Problem& p) {
  LayerOptions o;
  o.mode = p.spec.mode;
  test::run_layer(p.cfg, test::make_plan(p.global), *p.ref, o);
}

void run_ep(Problem& p, int num_threads = 1, int chunks = 1) {
  run_in_process(p.spec.W, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    EpOptions o;
    o.layer.mode = p.spec.mode;
    o.layer.num_threads = num_threads;
    o.chunks = chunks;
    o.timings = &rd.fwd_t;
    ep_forward(tr, rd.cfg, rd.routing.view(), rd.x.view(), rd.w1.view(), rd.w2.view(),
               rd.out.view(), rd.saved, o);
    rd.received = rd.saved.received_tokens();
    rd.sent = rd.saved.sent_tokens();
    EpGrads g{rd.dx.view(), rd.dw1.view(), rd.dw2.view(), rd.dpw.view()};
    o.timings = &rd.bwd_t;
    ep_backward(tr, rd.cfg, rd.w1.view(), rd.w2.view(), rd.d_out.view(), rd.saved, g, o);
  });
}

double rel_frobenius(const HostTensor& a, const HostTensor& ref) {
  return test::rel_error(a, ref.to_double());
}

// Compares every rank's results with the single-device slices. `out_dx_bitwise`: whether out and
// dx must be bitwise equal (one rank per token) or within cross_rank_tol.
void expect_matches(const Problem& p, bool out_dx_bitwise) {
  const int64_t El = p.spec.E / p.spec.W;
  for (int r = 0; r < p.spec.W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(p.spec.W));
    const RankData& rd = p.ranks[r];
    const int64_t T = p.spec.T[r];
    const HostTensor out = slice_rows(p.ref->out, p.t_off[r], T);
    const HostTensor dx = slice_rows(p.ref->dx, p.t_off[r], T);
    const HostTensor dw1 = slice_rows(p.ref->dw1, r * El, El);
    const HostTensor dw2 = slice_rows(p.ref->dw2, r * El, El);
    const HostTensor dpw = slice_rows(p.ref->d_pair_weights, p.p_off[r], rd.routing.P());
    EXPECT_TRUE(test::bitwise_equal(rd.dw1, dw1)) << "dw1 rel err " << rel_frobenius(rd.dw1, dw1);
    EXPECT_TRUE(test::bitwise_equal(rd.dw2, dw2)) << "dw2 rel err " << rel_frobenius(rd.dw2, dw2);
    EXPECT_TRUE(test::bitwise_equal(rd.dpw, dpw))
        << "d_pair_weights rel err " << rel_frobenius(rd.dpw, dpw);
    if (out_dx_bitwise) {
      EXPECT_TRUE(test::bitwise_equal(rd.out, out)) << "out rel err " << rel_frobenius(rd.out, out);
      EXPECT_TRUE(test::bitwise_equal(rd.dx, dx)) << "dx rel err " << rel_frobenius(rd.dx, dx);
    } else {
      EXPECT_LE(rel_frobenius(rd.out, out), cross_rank_tol(p.spec.dtype));
      EXPECT_LE(rel_frobenius(rd.dx, dx), cross_rank_tol(p.spec.dtype));
    }
  }
}

std::vector<int64_t> random_tokens(int W, int64_t lo, int64_t hi, std::mt19937_64& rng) {
  std::vector<int64_t> T(static_cast<size_t>(W));
  for (auto& t : T) t = std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  return T;
}

const char* dname(DType d) { return dtype_name(d); }

TEST(ExpertParallel, TokensOnOneRankAreBitwiseEqualToSingleDevice) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int W : {1, 2, 4})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string("W ") + std::to_string(W) + " " + dname(dt));
      Spec s;
      s.W = W;
      s.E = 8;
      s.K = 2;
      s.T = random_tokens(W, 20, 70, rng);
      s.placement = Placement::one_rank;
      s.dtype = dt;
      Problem p = make_problem(s, rng());
      run_single_device(p);
      run_ep(p);
      expect_matches(p, /*out_dx_bitwise=*/true);
    }
}

TEST(ExpertParallel, TokensSpreadOverRanksMatchWithinRounding) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int W : {2, 4})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string("W ") + std::to_string(W) + " " + dname(dt));
      Spec s;
      s.W = W;
      s.E = 8;
      s.K = 3;
      s.T = random_tokens(W, 30, 90, rng);
      s.placement = Placement::any;
      s.dtype = dt;
      Problem p = make_problem(s, rng());
      run_single_device(p);
      run_ep(p);
      expect_matches(p, /*out_dx_bitwise=*/false);
    }
}

TEST(ExpertParallel, OneRankIsBitwiseEqualForAnyRouting) {
  // W = 1: every token's experts are on the one rank, whatever the routing.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::f32, DType::bf16}) {
    Spec s;
    s.W = 1;
    s.E = 6;
    s.K = 3;
    s.T = {97};
    s.no_pairs = 0.1;
    s.dtype = dt;
    Problem p = make_problem(s, rng());
    run_single_device(p);
    run_ep(p);
    expect_matches(p, true);
  }
}

TEST(ExpertParallel, UnevenRanksEmptyRanksAndEmptyTokens) {
  // 4 ranks: rank 2 has no tokens, the last rank's experts are never chosen (it receives nothing
  // and its weight gradients are zeros), pairs skewed to rank 0, and some tokens have no pair.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dname(dt));
    Spec s;
    s.W = 4;
    s.E = 8;
    s.K = 2;
    s.T = {61, 5, 0, 44};
    s.placement = Placement::skip_last;
    s.skew = 0.6;
    s.no_pairs = 0.15;
    s.dtype = dt;
    Problem p = make_problem(s, rng());
    run_single_device(p);
    run_ep(p);
    expect_matches(p, false);
    EXPECT_EQ(p.ranks[3].received, 0);
    EXPECT_EQ(p.ranks[2].sent, 0);
    for (int64_t i = 0; i < p.ranks[3].dw1.numel(); ++i) ASSERT_EQ(p.ranks[3].dw1.at(i), 0.0);
    for (int64_t i = 0; i < p.ranks[3].dw2.numel(); ++i) ASSERT_EQ(p.ranks[3].dw2.at(i), 0.0);
    // A token without pairs has a zero output and a zero gradient.
    for (int r = 0; r < s.W; ++r)
      for (int64_t t = 0; t < s.T[r]; ++t)
        if (p.ranks[r].routing.offsets[t] == p.ranks[r].routing.offsets[t + 1])
          for (int64_t j = 0; j < s.d; ++j) {
            ASSERT_EQ(p.ranks[r].out.at(t * s.d + j), 0.0);
            ASSERT_EQ(p.ranks[r].dx.at(t * s.d + j), 0.0);
          }
  }
}

TEST(ExpertParallel, EveryActivationAndMode) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (Activation act : {Activation::swiglu, Activation::geglu, Activation::relu,
                         Activation::silu, Activation::gelu, Activation::relu2,
                         Activation::swiglu_oai})
    for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized}) {
      SCOPED_TRACE(std::string(activation_name(act)) + " " + layer_mode_name(mode));
      Spec s;
      s.W = 2;
      s.E = 4;
      s.K = 2;
      s.d = 24;
      s.n = 20;
      s.T = random_tokens(2, 10, 30, rng);
      s.placement = Placement::one_rank;
      s.act = act;
      s.mode = mode;
      s.dtype = (rng() & 1) ? DType::bf16 : DType::f32;
      Problem p = make_problem(s, rng());
      run_single_device(p);
      run_ep(p);
      expect_matches(p, true);
    }
}

TEST(ExpertParallel, SendsEachTokenOncePerDestinationRank) {
  // K = 4 of E = 8 on 2 ranks: most tokens choose several experts of one rank; each still
  // travels there once.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Spec s;
  s.W = 2;
  s.E = 8;
  s.K = 4;
  s.T = random_tokens(2, 40, 80, rng);
  Problem p = make_problem(s, rng());
  run_ep(p);
  int64_t total_pairs = 0, total_sent = 0, total_received = 0;
  for (int r = 0; r < s.W; ++r) {
    const HostRouting& rt = p.ranks[r].routing;
    std::set<std::pair<int64_t, int64_t>> token_rank;  // distinct (token, destination)
    for (int64_t t = 0; t < rt.T; ++t)
      for (int32_t q = rt.offsets[t]; q < rt.offsets[t + 1]; ++q)
        token_rank.insert({t, rt.experts[q] / (s.E / s.W)});
    EXPECT_EQ(p.ranks[r].sent, static_cast<int64_t>(token_rank.size()));
    total_pairs += rt.P();
    total_sent += p.ranks[r].sent;
    total_received += p.ranks[r].received;
  }
  EXPECT_EQ(total_sent, total_received);
  EXPECT_LT(total_sent, total_pairs);  // deduplication happened (K = 4 > E_local / 2)
}

TEST(ExpertParallel, ReproducibleAcrossRunsAndThreadCounts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Spec s;
  s.W = 4;
  s.E = 8;
  s.K = 3;
  s.T = random_tokens(4, 20, 60, rng);
  s.dtype = DType::bf16;
  const uint64_t pseed = rng();
  Problem a = make_problem(s, pseed), b = make_problem(s, pseed);
  run_ep(a, 1);
  run_ep(b, 2);
  for (int r = 0; r < s.W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankData &x = a.ranks[r], &y = b.ranks[r];
    EXPECT_TRUE(test::bitwise_equal(x.out, y.out));
    EXPECT_TRUE(test::bitwise_equal(x.dx, y.dx));
    EXPECT_TRUE(test::bitwise_equal(x.dw1, y.dw1));
    EXPECT_TRUE(test::bitwise_equal(x.dw2, y.dw2));
    EXPECT_TRUE(test::bitwise_equal(x.dpw, y.dpw));
    EXPECT_GE(x.fwd_t.total_s, x.fwd_t.layer_s);
    EXPECT_GT(x.fwd_t.exchange_s, 0.0);
    EXPECT_GE(x.bwd_t.total_s, x.bwd_t.layer_s);
  }
}

TEST(ExpertParallel, ZeroTokensEverywhereIsValid) {
  Spec s;
  s.W = 2;
  s.T = {0, 0};
  Problem p = make_problem(s, test::fresh_seed());
  run_ep(p);
  for (const RankData& rd : p.ranks) {
    EXPECT_EQ(rd.received, 0);
    for (int64_t i = 0; i < rd.dw1.numel(); ++i) ASSERT_EQ(rd.dw1.at(i), 0.0);
    for (int64_t i = 0; i < rd.dw2.numel(); ++i) ASSERT_EQ(rd.dw2.at(i), 0.0);
  }
}

// ---- argument checks: agreed by all ranks before any data moves ----

// Runs ep_forward on every rank with a per-rank tweak; returns each rank's exception message
// ("" = no exception) and whether it was a RemoteRankError.
struct Outcome {
  std::string message;
  bool remote = false;
  bool invalid_argument = false;
};

template <typename Tweak>
std::vector<Outcome> forward_outcomes(Problem& p, const Tweak& tweak) {
  std::vector<Outcome> res(static_cast<size_t>(p.spec.W));
  run_in_process(p.spec.W, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    LayerConfig cfg = rd.cfg;
    RoutingView rt = rd.routing.view();
    TensorView x = rd.x.view(), w1 = rd.w1.view(), w2 = rd.w2.view(), out = rd.out.view();
    tweak(tr.rank(), cfg, rt, x, w1, w2, out);
    Outcome& o = res[tr.rank()];
    try {
      ep_forward(tr, cfg, rt, x, w1, w2, out, rd.saved);
    } catch (const RemoteRankError& e) {
      o.message = e.what();
      o.remote = true;
      o.invalid_argument = true;
    } catch (const InvalidArgument& e) {
      o.message = e.what();
      o.invalid_argument = true;
    }
  });
  return res;
}

void expect_outputs_untouched(const Problem& p) {
  for (const RankData& rd : p.ranks) {
    HostTensor pattern(rd.out.dtype, rd.out.shape);
    pattern.fill_pattern();
    EXPECT_TRUE(test::bitwise_equal(rd.out, pattern));
    EXPECT_FALSE(rd.saved.valid());
  }
}

Spec small_spec() {
  Spec s;
  s.W = 2;
  s.E = 8;
  s.K = 2;
  s.T = {12, 9};
  return s;
}

TEST(ExpertParallel, RejectsExpertsNotDivisibleByWorldSize) {
  Spec s = small_spec();
  s.E = 6;  // the shards below are built for 3 experts each, but W = 4
  s.W = 2;
  Problem p = make_problem(s, test::fresh_seed());
  // Re-run the same tensors as a 4-rank group: 6 % 4 != 0 on every rank.
  std::vector<Outcome> res(4);
  run_in_process(4, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank() % 2];
    try {
      EpSaved saved;
      HostTensor out = rd.out;
      ep_forward(tr, rd.cfg, rd.routing.view(), rd.x.view(), rd.w1.view(), rd.w2.view(),
                 out.view(), saved);
    } catch (const InvalidArgument& e) {
      res[tr.rank()].message = e.what();
    }
  });
  for (const Outcome& o : res)
    EXPECT_NE(o.message.find("num_experts E (6) is not divisible by world_size (4)"),
              std::string::npos)
        << o.message;
}

TEST(ExpertParallel, ABadArgumentOnOneRankFailsEveryRankWithoutTouchingOutputs) {
  Problem p = make_problem(small_spec(), test::fresh_seed());
  // Rank 1 passes all 8 experts' w1 (the single-device shape) instead of its 4.
  HostTensor full_w1(p.cfg.dtype, p.ref->w1.shape);
  std::vector<Outcome> res = forward_outcomes(
      p, [&](int rank, LayerConfig&, RoutingView&, TensorView&, TensorView& w1, TensorView&,
             TensorView&) {
        if (rank == 1) w1 = full_w1.view();
      });
  EXPECT_FALSE(res[1].remote);
  EXPECT_NE(res[1].message.find("w1 has shape (8, 48, 32), expected (4, 48, 32)"),
            std::string::npos)
      << res[1].message;
  EXPECT_TRUE(res[0].remote);
  EXPECT_NE(res[0].message.find("ep_forward: rank(s) 1 rejected their arguments"),
            std::string::npos)
      << res[0].message;
  expect_outputs_untouched(p);
}

TEST(ExpertParallel, RejectsBadRoutingsAndDevices) {
  Problem p = make_problem(small_spec(), test::fresh_seed());
  // An expert id out of range on rank 0.
  std::vector<int32_t> bad = p.ranks[0].routing.experts;
  bad[0] = 8;
  auto res = forward_outcomes(p, [&](int rank, LayerConfig&, RoutingView& rt, TensorView&,
                                     TensorView&, TensorView&, TensorView&) {
    if (rank == 0) rt.pair_experts = bad.data();
  });
  EXPECT_NE(res[0].message.find("pair_experts: expert id 8 of token 0 is out of range [0, 8)"),
            std::string::npos)
      << res[0].message;
  EXPECT_TRUE(res[1].remote);
  // A routing on the GPU, and x on the GPU, for a transport that moves host memory.
  res = forward_outcomes(p, [&](int rank, LayerConfig&, RoutingView& rt, TensorView& x,
                                TensorView&, TensorView&, TensorView&) {
    if (rank == 0) rt.device = Device::cuda;
    if (rank == 1) x.device = Device::cuda;
  });
  EXPECT_NE(res[0].message.find("routing is on cuda, expected cpu"), std::string::npos)
      << res[0].message;
  EXPECT_NE(res[1].message.find("x is on cuda, but the transport moves cpu memory"),
            std::string::npos)
      << res[1].message;
  // routing.T must be this rank's cfg.T.
  res = forward_outcomes(p, [&](int rank, LayerConfig& cfg, RoutingView&, TensorView&,
                                TensorView&, TensorView&, TensorView&) {
    if (rank == 1) cfg.T += 1;
  });
  EXPECT_NE(res[1].message.find("routing has T = 9 tokens, expected cfg.T = 10"),
            std::string::npos)
      << res[1].message;
  expect_outputs_untouched(p);
}

TEST(ExpertParallel, RejectsConfigsThatDifferBetweenRanks) {
  Problem p = make_problem(small_spec(), test::fresh_seed());
  // Rank 1 runs a consistent problem of its own with n = 16: every rank rejects the group.
  HostTensor w1(p.cfg.dtype, {4, 32, 32}), w2(p.cfg.dtype, {4, 32, 16});
  w1.fill_random(1, 0.1f);
  w2.fill_random(2, 0.1f);
  auto res = forward_outcomes(p, [&](int rank, LayerConfig& cfg, RoutingView&, TensorView&,
                                     TensorView& w1v, TensorView& w2v, TensorView&) {
    if (rank == 1) {
      cfg.n = 16;
      w1v = w1.view();
      w2v = w2.view();
    }
  });
  for (const Outcome& o : res)
    EXPECT_NE(o.message.find("ep_forward: cfg.n (16) on rank 1 differs from cfg.n (24) on rank 0"),
              std::string::npos)
        << o.message;
  expect_outputs_untouched(p);
}

TEST(ExpertParallel, BackwardChecksItsArguments) {
  Problem p = make_problem(small_spec(), test::fresh_seed());
  std::vector<std::string> msg(2);
  run_in_process(2, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    EpGrads g{rd.dx.view(), rd.dw1.view(), rd.dw2.view(), rd.dpw.view()};
    try {  // before any forward
      ep_backward(tr, rd.cfg, rd.w1.view(), rd.w2.view(), rd.d_out.view(), rd.saved, g);
    } catch (const InvalidArgument& e) {
      msg[tr.rank()] = e.what();
    }
  });
  for (const std::string& m : msg)
    EXPECT_NE(m.find("saved is not valid: run ep_forward first"), std::string::npos) << m;

  run_ep(p);  // fills saved
  for (RankData& rd : p.ranks) {
    rd.dx.fill_pattern();
    rd.dpw.fill_pattern();
  }
  HostTensor short_dpw(DType::f32, {3});
  run_in_process(2, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    EpGrads g{rd.dx.view(), rd.dw1.view(), rd.dw2.view(), rd.dpw.view()};
    if (tr.rank() == 0) g.d_pair_weights = short_dpw.view();
    EpOptions o;
    if (tr.rank() == 1) o.layer.mode = LayerMode::recompute;
    try {
      ep_backward(tr, rd.cfg, rd.w1.view(), rd.w2.view(), rd.d_out.view(), rd.saved, g, o);
      msg[tr.rank()] = "";
    } catch (const InvalidArgument& e) {
      msg[tr.rank()] = e.what();
    }
  });
  const std::string want0 = "d_pair_weights has shape (3,), expected (" +
                            std::to_string(p.ranks[0].routing.P()) + ",)";
  EXPECT_NE(msg[0].find(want0), std::string::npos) << msg[0];
  EXPECT_NE(msg[1].find("saved comes from mode moeblaze, but opts.layer.mode is "
                        "moeblaze-recompute"),
            std::string::npos)
      << msg[1];
  for (const RankData& rd : p.ranks) {
    HostTensor pattern(rd.dx.dtype, rd.dx.shape);
    pattern.fill_pattern();
    EXPECT_TRUE(test::bitwise_equal(rd.dx, pattern));
  }
}

// ---- chunks: the pipelined exchange (EpOptions::chunks > 1) ----
//
// What holds against chunks = 1, and why (docs/EXPERT_PARALLEL.md, "Numerics"):
//  - out, dx, d_pair_weights: bitwise equal. A token lies in one chunk and travels to the same
//    ranks; on each, its partial is computed from its own row only (the CPU GEMMs compute each
//    output row from that row and the weights, independently of the other rows, and a token's
//    slots are summed in its pair order), and the combine adds its partials in rank order.
//  - dw1, dw2: the sum over an expert's slots is split into per-chunk sums (each stored in the
//    dtype by the local layer), added in chunk order in fp32 and stored once: another grouping,
//    bounded below.

// Relative Frobenius bound of the chunked dw1/dw2 against the single-device layer.
// fp32: the slot sum regrouped into C partial sums, each a few rounding units of 2^-24 off;
// 2^-20 leaves room for cancellation (measured: <= 1.6e-7 for C in {2, 3, 5}).
// bf16: each chunk's sum is rounded to bf16 (a relative 2^-8 at most, mostly far less and of
// random sign) before the fp32 sum, plus one final rounding: (C + 1) units of 2^-8 in the worst
// case; the Frobenius norm of independent roundings grows like sqrt(C + 1), so (C + 1) * 2^-9
// bounds it with room (measured: <= 3.7e-3 for C in {2, 3, 5}; the bound is 5.9e-3 at C = 2).
double chunk_sum_tol(DType dt, int C) {
  return dt == DType::bf16 ? (C + 1) * 0x1p-9 : 0x1p-20;
}

// Chunked EP against the same problem with chunks = 1 (out, dx, d_pair_weights bitwise, the same
// rows sent and received) and against the single-device layer (dw1, dw2 within the bound).
void expect_chunked_matches(const Problem& one, const Problem& chunked, int C) {
  const int64_t El = one.spec.E / one.spec.W;
  for (int r = 0; r < one.spec.W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(one.spec.W) +
                 ", T = " + std::to_string(one.spec.T[r]) + ", chunks " + std::to_string(C));
    const RankData &a = one.ranks[r], &b = chunked.ranks[r];
    EXPECT_TRUE(test::bitwise_equal(b.out, a.out)) << "out rel err " << rel_frobenius(b.out, a.out);
    EXPECT_TRUE(test::bitwise_equal(b.dx, a.dx)) << "dx rel err " << rel_frobenius(b.dx, a.dx);
    EXPECT_TRUE(test::bitwise_equal(b.dpw, a.dpw))
        << "d_pair_weights rel err " << rel_frobenius(b.dpw, a.dpw);
    EXPECT_EQ(b.sent, a.sent);
    EXPECT_EQ(b.received, a.received);
    EXPECT_EQ(b.saved.chunks(), C);
    const HostTensor dw1 = slice_rows(chunked.ref->dw1, r * El, El);
    const HostTensor dw2 = slice_rows(chunked.ref->dw2, r * El, El);
    const double tol = chunk_sum_tol(one.spec.dtype, C);
    EXPECT_LE(rel_frobenius(b.dw1, dw1), tol);
    EXPECT_LE(rel_frobenius(b.dw2, dw2), tol);
  }
}

TEST(ExpertParallelChunks, OutDxPairGradsBitwiseEqualToOneChunkWeightsWithinBound) {
  // Uneven token counts; with W >= 2 one rank has fewer tokens than chunks (empty chunks) and
  // one has none. Spread routing (tokens on several ranks), some tokens without pairs.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int W : {1, 2, 4})
    for (DType dt : {DType::f32, DType::bf16})
      for (int C : {2, 3, 5}) {
        SCOPED_TRACE(std::string("W ") + std::to_string(W) + " " + dname(dt));
        Spec s;
        s.W = W;
        s.E = 8;
        s.K = 3;
        s.T = random_tokens(W, 20, 80, rng);
        if (W >= 2) s.T[1] = std::uniform_int_distribution<int64_t>(1, C - 1)(rng);  // T < C
        if (W >= 4) s.T[2] = 0;
        s.no_pairs = 0.05;
        s.dtype = dt;
        const uint64_t pseed = rng();
        Problem one = make_problem(s, pseed), chunked = make_problem(s, pseed);
        run_single_device(chunked);
        run_ep(one, 1, 1);
        run_ep(chunked, 1, C);
        expect_chunked_matches(one, chunked, C);
      }
}

TEST(ExpertParallelChunks, MoreChunksThanTokensEverywhereAndEveryMode) {
  // T < C on every rank (most chunks empty on every rank), and T = 0 everywhere; the layer
  // modes keep their own saved state per chunk.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized})
    for (const std::vector<int64_t>& T : {std::vector<int64_t>{3, 1}, std::vector<int64_t>{0, 0}}) {
      SCOPED_TRACE(std::string(layer_mode_name(mode)) + " T0 = " + std::to_string(T[0]));
      Spec s;
      s.W = 2;
      s.E = 4;
      s.K = 2;
      s.T = T;
      s.mode = mode;
      s.dtype = (rng() & 1) ? DType::bf16 : DType::f32;
      const uint64_t pseed = rng();
      Problem one = make_problem(s, pseed), chunked = make_problem(s, pseed);
      run_single_device(chunked);
      run_ep(one, 1, 1);
      run_ep(chunked, 1, 5);
      expect_chunked_matches(one, chunked, 5);
    }
}

TEST(ExpertParallelChunks, ReproducibleAcrossRunsAndThreadCounts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::f32, DType::bf16}) {
    Spec s;
    s.W = 4;
    s.E = 8;
    s.K = 3;
    s.T = random_tokens(4, 20, 60, rng);
    s.dtype = dt;
    const uint64_t pseed = rng();
    Problem a = make_problem(s, pseed), b = make_problem(s, pseed);
    run_ep(a, 1, 3);
    run_ep(b, 2, 3);
    for (int r = 0; r < s.W; ++r) {
      SCOPED_TRACE(std::string(dname(dt)) + " rank " + std::to_string(r));
      const RankData &x = a.ranks[r], &y = b.ranks[r];
      EXPECT_TRUE(test::bitwise_equal(x.out, y.out));
      EXPECT_TRUE(test::bitwise_equal(x.dx, y.dx));
      EXPECT_TRUE(test::bitwise_equal(x.dw1, y.dw1));
      EXPECT_TRUE(test::bitwise_equal(x.dw2, y.dw2));
      EXPECT_TRUE(test::bitwise_equal(x.dpw, y.dpw));
      // The in-process transport blocks: all exchange time is exchange_s, none is pipeline_s
      // beyond the final (no-op) CPU synchronisation.
      EXPECT_GT(x.fwd_t.exchange_s, 0.0);
      EXPECT_GE(x.fwd_t.total_s, x.fwd_t.layer_s + x.fwd_t.exchange_s);
      EXPECT_GE(x.bwd_t.total_s, x.bwd_t.layer_s + x.bwd_t.exchange_s);
    }
  }
}

// ep_forward on every rank with its own chunks; each rank's outcome.
std::vector<Outcome> forward_with_chunks(Problem& p, const std::vector<int>& chunks) {
  std::vector<Outcome> res(static_cast<size_t>(p.spec.W));
  run_in_process(p.spec.W, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    EpOptions o;
    o.chunks = chunks[tr.rank()];
    Outcome& out = res[tr.rank()];
    try {
      ep_forward(tr, rd.cfg, rd.routing.view(), rd.x.view(), rd.w1.view(), rd.w2.view(),
                 rd.out.view(), rd.saved, o);
    } catch (const RemoteRankError& e) {
      out.message = e.what();
      out.remote = true;
    } catch (const InvalidArgument& e) {
      out.message = e.what();
    }
  });
  return res;
}

TEST(ExpertParallelChunks, ABadChunkCountFailsEveryRankWithoutTouchingOutputs) {
  for (int bad : {0, -3, kEpMaxChunks + 1}) {
    SCOPED_TRACE("chunks " + std::to_string(bad));
    Problem p = make_problem(small_spec(), test::fresh_seed());
    const std::vector<Outcome> res = forward_with_chunks(p, {2, bad});
    const std::string want = "EpOptions::chunks (" + std::to_string(bad) + ") must be in [1, " +
                             std::to_string(kEpMaxChunks) + "]";
    EXPECT_FALSE(res[1].remote);
    EXPECT_NE(res[1].message.find(want), std::string::npos) << res[1].message;
    EXPECT_TRUE(res[0].remote);
    EXPECT_NE(res[0].message.find("ep_forward: rank(s) 1 rejected their arguments"),
              std::string::npos)
        << res[0].message;
    expect_outputs_untouched(p);
  }
}

TEST(ExpertParallelChunks, RanksMustAgreeOnChunks) {
  Spec s = small_spec();
  s.W = 4;
  s.T = {12, 9, 0, 5};
  Problem p = make_problem(s, test::fresh_seed());
  const std::vector<Outcome> res = forward_with_chunks(p, {2, 2, 3, 2});
  for (const Outcome& o : res)
    EXPECT_NE(o.message.find("ep_forward: opts.chunks (3) on rank 2 differs from opts.chunks (2) "
                             "on rank 0"),
              std::string::npos)
        << o.message;
  expect_outputs_untouched(p);
}

TEST(ExpertParallelChunks, BackwardRunsForwardsChunks) {
  Problem p = make_problem(small_spec(), test::fresh_seed());
  run_ep(p, 1, 3);
  std::vector<std::string> msg(2);
  for (RankData& rd : p.ranks) rd.dx.fill_pattern();
  run_in_process(2, [&](Transport& tr) {
    RankData& rd = p.ranks[tr.rank()];
    EpGrads g{rd.dx.view(), rd.dw1.view(), rd.dw2.view(), rd.dpw.view()};
    EpOptions o;
    o.chunks = tr.rank() == 0 ? 3 : 2;
    try {
      ep_backward(tr, rd.cfg, rd.w1.view(), rd.w2.view(), rd.d_out.view(), rd.saved, g, o);
    } catch (const InvalidArgument& e) {
      msg[tr.rank()] = e.what();
    }
  });
  EXPECT_NE(msg[1].find("EpOptions::chunks (2) differs from the chunks ep_forward ran with (3)"),
            std::string::npos)
      << msg[1];
  EXPECT_NE(msg[0].find("ep_backward: rank(s) 1 rejected their arguments"), std::string::npos)
      << msg[0];
  for (const RankData& rd : p.ranks) {
    HostTensor pattern(rd.dx.dtype, rd.dx.shape);
    pattern.fill_pattern();
    EXPECT_TRUE(test::bitwise_equal(rd.dx, pattern));
  }
}

// ---- the in-process transport ----

TEST(InProcessTransport, AllToAllVAndAllGatherMoveEveryBlock) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int W : {1, 3, 4}) {
    std::mt19937_64 rng(seed + W);
    // bytes[s][r]: what rank s sends to rank r (some blocks empty).
    std::vector<std::vector<int64_t>> bytes(W, std::vector<int64_t>(W));
    for (auto& row : bytes)
      for (auto& b : row) b = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 50);
    auto value = [](int s, int r, int64_t i) {
      return static_cast<unsigned char>(s * 37 + r * 11 + i * 3 + 1);
    };
    std::vector<int> failures(W, 0);
    run_in_process(W, [&](Transport& tr) {
      const int q = tr.rank();
      ASSERT_EQ(tr.world_size(), W);
      ASSERT_EQ(tr.device(), Device::cpu);
      std::vector<int64_t> sc(W), so(W), rc(W), ro(W);
      int64_t st = 0, rt = 0;
      for (int r = 0; r < W; ++r) {
        // Blocks in reverse rank order with a gap, so offsets are really used.
        so[W - 1 - r] = st;
        sc[W - 1 - r] = bytes[q][W - 1 - r];
        st += sc[W - 1 - r] + 3;
        ro[r] = rt;
        rc[r] = bytes[r][q];
        rt += rc[r] + 5;
      }
      std::vector<unsigned char> send(static_cast<size_t>(st), 0xee), recv(static_cast<size_t>(rt), 0xdd);
      for (int r = 0; r < W; ++r)
        for (int64_t i = 0; i < sc[r]; ++i) send[so[r] + i] = value(q, r, i);
      tr.all_to_all_v(send.data(), sc.data(), so.data(), recv.data(), rc.data(), ro.data());
      for (int s = 0; s < W; ++s) {
        for (int64_t i = 0; i < rc[s]; ++i)
          if (recv[ro[s] + i] != value(s, q, i)) ++failures[q];
        for (int64_t i = rc[s]; i < rc[s] + 5; ++i)  // the gap stays untouched
          if (recv[ro[s] + i] != 0xdd) ++failures[q];
      }
      std::vector<int64_t> mine = {q * 100 + 1, -q, int64_t(1) << 40};
      std::vector<int64_t> all(3 * static_cast<size_t>(W));
      tr.all_gather(mine.data(), 3, all.data());
      for (int s = 0; s < W; ++s)
        if (all[3 * s] != s * 100 + 1 || all[3 * s + 1] != -s || all[3 * s + 2] != int64_t(1) << 40)
          ++failures[q];
    });
    for (int q = 0; q < W; ++q) EXPECT_EQ(failures[q], 0) << "W " << W << " rank " << q;
  }
}

TEST(InProcessTransport, MismatchedCountsAbortTheGroup) {
  try {
    run_in_process(3, [&](Transport& tr) {
      const int q = tr.rank();
      std::vector<int64_t> sc(3, 4), so = {0, 4, 8}, rc(3, 4), ro = {0, 4, 8};
      if (q == 2) rc[0] = 5;  // rank 0 sends 4 bytes
      std::vector<char> send(12, 1), recv(13, 0);
      tr.all_to_all_v(send.data(), sc.data(), so.data(), recv.data(), rc.data(), ro.data());
      tr.all_gather(sc.data(), 1, rc.data());  // the others wait here, then see the abort
    });
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_to_all_v: rank 2 expects 5 bytes from rank 0, "
                                         "which sends 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(InProcessTransport, AFailingRankDoesNotHangTheOthers) {
  try {
    run_in_process(4, [&](Transport& tr) {
      if (tr.rank() == 2) throw std::runtime_error("rank 2 failed on its own");
      int64_t v = tr.rank(), all[4];
      tr.all_gather(&v, 1, all);
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 2 failed on its own");
  }
  EXPECT_THROW(make_in_process_transports(0), InvalidArgument);
}

TEST(ExpertParallel, NcclTransportNeedsNcclInTheBuild) {
  if (nccl_available()) GTEST_SKIP() << "built with NCCL (tested by the GPU tests)";
  try {
    make_nccl_transport(nullptr, nullptr);
    FAIL() << "no exception";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("built without NCCL"), std::string::npos);
  }
}

}  // namespace
}  // namespace moeblaze
