// Routing plan: both CPU builders against a straightforward reference written here (bit-exact,
// all six arrays), plan invariants, thread-count independence, memory, and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/parallel.hpp"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

constexpr PlanBuilder kBuilders[] = {PlanBuilder::atomic_free, PlanBuilder::sort};

// A routing held in std::vectors (the test's own memory), viewable as a RoutingView.
struct HostRouting {
  int64_t T = 0, E = 0;
  std::vector<int32_t> offsets;  // (T+1,) int32
  std::vector<int32_t> experts;  // (P,) int32, token-major
  std::vector<float> weights;    // (P,) fp32, token-major

  int64_t P() const { return static_cast<int64_t>(experts.size()); }
  RoutingView view() const {
    RoutingView v;
    v.T = T;
    v.E = E;
    v.P = P();
    v.pair_offsets = offsets.data();
    v.pair_experts = experts.empty() ? nullptr : experts.data();
    v.pair_weights = weights.empty() ? nullptr : weights.data();
    v.device = Device::cpu;
    return v;
  }
};

void fill_weights(HostRouting& r, uint64_t seed) {
  r.weights = test::random_normal(r.experts.size(), seed ^ 0x9e3779b97f4a7c15ull);
}

// Plain top-K: K distinct experts per token in random (rank-like) order, uniform over experts.
// With `skew`, a random 20% of the experts ("hot") receive about 80% of the pairs.
HostRouting random_topk(int64_t T, int64_t E, int64_t K, uint64_t seed, bool skew = false) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = T;
  r.E = E;
  r.offsets.resize(T + 1);
  r.experts.reserve(static_cast<size_t>(T * K));
  std::vector<int32_t> perm(E);
  for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t hot = std::max<int64_t>(1, E / 5);  // perm[0, hot) are the hot experts
  std::bernoulli_distribution pick_hot(0.8);
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[t] = static_cast<int32_t>(r.experts.size());
    if (!skew || hot == E) {
      // Partial Fisher-Yates on a persistent permutation: K distinct, uniform, O(K) per token.
      for (int64_t i = 0; i < K; ++i) {
        std::uniform_int_distribution<int64_t> j(i, E - 1);
        std::swap(perm[i], perm[j(rng)]);
        r.experts.push_back(perm[i]);
      }
      continue;
    }
    const size_t first = r.experts.size();
    while (static_cast<int64_t>(r.experts.size() - first) < K) {
      const bool h = pick_hot(rng);
      std::uniform_int_distribution<int64_t> j(h ? 0 : hot, h ? hot - 1 : E - 1);
      const int32_t e = perm[j(rng)];
      if (std::find(r.experts.begin() + first, r.experts.end(), e) == r.experts.end())
        r.experts.push_back(e);
    }
  }
  r.offsets[T] = static_cast<int32_t>(r.experts.size());
  fill_weights(r, seed);
  return r;
}

// A general CSR routing: each token has 0..max_pairs distinct experts (what token rounding
// produces), with runs of empty tokens at both ends and scattered inside.
HostRouting random_csr(int64_t T, int64_t E, int64_t max_pairs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = T;
  r.E = E;
  r.offsets.resize(T + 1);
  std::vector<int32_t> perm(E);
  for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
  std::uniform_int_distribution<int64_t> count(0, std::min(E, max_pairs));
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[t] = static_cast<int32_t>(r.experts.size());
    const bool edge = t < 3 || t >= T - 3;
    const int64_t n = edge ? 0 : count(rng);
    for (int64_t i = 0; i < n; ++i) {
      std::uniform_int_distribution<int64_t> j(i, E - 1);
      std::swap(perm[i], perm[j(rng)]);
      r.experts.push_back(perm[i]);
    }
  }
  r.offsets[T] = static_cast<int32_t>(r.experts.size());
  fill_weights(r, seed);
  return r;
}

// The reference: for each expert, its tokens in ascending order; slots numbered as they come.
struct RefPlan {
  std::vector<int32_t> expert_token_offsets, expert_token_indices, token_pair_offsets,
      token_expert_indices, token_index_map;
  std::vector<float> slot_weights;
};

RefPlan reference_plan(const HostRouting& r) {
  struct Pair { int32_t token, pair; };
  std::vector<std::vector<Pair>> of_expert(r.E);  // pairs of each expert, ascending token
  for (int64_t t = 0; t < r.T; ++t)
    for (int32_t p = r.offsets[t]; p < r.offsets[t + 1]; ++p)
      of_expert[r.experts[p]].push_back({static_cast<int32_t>(t), p});
  RefPlan ref;
  ref.expert_token_offsets.push_back(0);
  ref.token_index_map.assign(r.experts.size(), -1);
  for (int64_t e = 0; e < r.E; ++e) {
    for (const Pair& q : of_expert[e]) {
      ref.token_index_map[q.pair] = static_cast<int32_t>(ref.expert_token_indices.size());
      ref.expert_token_indices.push_back(q.token);
      ref.slot_weights.push_back(r.weights[q.pair]);
    }
    ref.expert_token_offsets.push_back(static_cast<int32_t>(ref.expert_token_indices.size()));
  }
  ref.token_pair_offsets = r.offsets;
  ref.token_expert_indices = r.experts;
  return ref;
}

// Bit-exact comparison of n elements; names the first differing index.
template <typename A>
::testing::AssertionResult same_bits(const char* name, const A* got, const std::vector<A>& want,
                                     int64_t n) {
  if (static_cast<int64_t>(want.size()) != n)
    return ::testing::AssertionFailure()
           << name << ": plan has " << n << " entries, reference " << want.size();
  if (n == 0 || std::memcmp(got, want.data(), sizeof(A) * n) == 0)
    return ::testing::AssertionSuccess();
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(A)) != 0)
      return ::testing::AssertionFailure()
             << name << "[" << i << "] = " << got[i] << ", reference " << want[i];
  return ::testing::AssertionFailure() << name << ": memcmp differs";
}

void expect_matches_reference(const RoutingPlan& plan, const HostRouting& r) {
  const RefPlan ref = reference_plan(r);
  const RoutingPlanView v = plan.view();
  EXPECT_EQ(v.T, r.T);
  EXPECT_EQ(v.E, r.E);
  EXPECT_EQ(v.S, r.P());
  EXPECT_EQ(v.device, Device::cpu);
  EXPECT_TRUE(same_bits("expert_token_offsets", v.expert_token_offsets,
                        ref.expert_token_offsets, v.E + 1));
  EXPECT_TRUE(same_bits("expert_token_indices", v.expert_token_indices,
                        ref.expert_token_indices, v.S));
  EXPECT_TRUE(same_bits("slot_weights", v.slot_weights, ref.slot_weights, v.S));
  EXPECT_TRUE(same_bits("token_pair_offsets", v.token_pair_offsets, ref.token_pair_offsets,
                        v.T + 1));
  EXPECT_TRUE(same_bits("token_expert_indices", v.token_expert_indices,
                        ref.token_expert_indices, v.S));
  EXPECT_TRUE(same_bits("token_index_map", v.token_index_map, ref.token_index_map, v.S));
}

// Properties every plan has, checked without the reference.
void expect_invariants(const RoutingPlan& plan, const HostRouting& r) {
  const RoutingPlanView v = plan.view();
  ASSERT_EQ(v.S, r.P());
  ASSERT_EQ(v.expert_token_offsets[0], 0);
  for (int64_t e = 0; e < v.E; ++e)
    ASSERT_LE(v.expert_token_offsets[e], v.expert_token_offsets[e + 1]) << "expert " << e;
  ASSERT_EQ(v.expert_token_offsets[v.E], v.S);
  for (int64_t e = 0; e < v.E; ++e)  // strictly ascending tokens inside an expert
    for (int32_t s = v.expert_token_offsets[e] + 1; s < v.expert_token_offsets[e + 1]; ++s)
      ASSERT_LT(v.expert_token_indices[s - 1], v.expert_token_indices[s]) << "slot " << s;
  std::vector<char> slot_used(static_cast<size_t>(v.S), 0);
  for (int64_t t = 0; t < v.T; ++t) {
    ASSERT_EQ(v.token_pair_offsets[t], r.offsets[t]);
    for (int32_t p = v.token_pair_offsets[t]; p < v.token_pair_offsets[t + 1]; ++p) {
      const int32_t e = v.token_expert_indices[p];
      const int32_t s = v.token_index_map[p];
      ASSERT_EQ(e, r.experts[p]);
      ASSERT_GE(s, v.expert_token_offsets[e]) << "pair " << p;
      ASSERT_LT(s, v.expert_token_offsets[e + 1]) << "pair " << p;
      ASSERT_EQ(v.expert_token_indices[s], t) << "pair " << p;
      ASSERT_EQ(std::memcmp(&v.slot_weights[s], &r.weights[p], 4), 0) << "pair " << p;
      ASSERT_FALSE(slot_used[s]) << "slot " << s << " taken twice";
      slot_used[s] = 1;
    }
  }
  ASSERT_EQ(v.token_pair_offsets[v.T], v.S);
}

void expect_plans_identical(const RoutingPlan& a, const RoutingPlan& b) {
  const RoutingPlanView x = a.view(), y = b.view();
  ASSERT_EQ(x.T, y.T);
  ASSERT_EQ(x.E, y.E);
  ASSERT_EQ(x.S, y.S);
  auto same = [](const void* p, const void* q, size_t bytes) {
    return bytes == 0 || std::memcmp(p, q, bytes) == 0;
  };
  EXPECT_TRUE(same(x.expert_token_offsets, y.expert_token_offsets, 4 * (x.E + 1)));
  EXPECT_TRUE(same(x.expert_token_indices, y.expert_token_indices, 4 * x.S));
  EXPECT_TRUE(same(x.slot_weights, y.slot_weights, 4 * x.S));
  EXPECT_TRUE(same(x.token_pair_offsets, y.token_pair_offsets, 4 * (x.T + 1)));
  EXPECT_TRUE(same(x.token_expert_indices, y.token_expert_indices, 4 * x.S));
  EXPECT_TRUE(same(x.token_index_map, y.token_index_map, 4 * x.S));
}

size_t plan_bytes_formula(int64_t T, int64_t E, int64_t S) {
  return static_cast<size_t>(16 * S + 4 * (E + 1) + 4 * (T + 1));
}

void check_both_builders(const HostRouting& r) {
  for (PlanBuilder b : kBuilders) {
    SCOPED_TRACE(plan_builder_name(b));
    RoutingPlan plan;
    build_routing_plan(r.view(), b, plan);
    expect_matches_reference(plan, r);
    expect_invariants(plan, r);
    EXPECT_EQ(plan.bytes(), plan_bytes_formula(r.T, r.E, r.P()));
  }
}

struct Shape { int64_t T, E, K; };

TEST(RoutingPlan, MatchesReferenceOnRandomTopK) {
  std::vector<Shape> shapes = {{1, 1, 1},        {5, 2, 1},        {33, 2, 2},
                               {1000, 8, 2},     {4097, 8, 4},     {10000, 64, 8},
                               {20000, 256, 4},  {3000, 512, 8},   {100000, 64, 2},
                               {100000, 512, 8}, {65536, 1, 1},    {50000, 256, 1},
                               {513, 2, 2},      {1024, 8, 8}};
  // Plus a few shapes drawn afresh every run.
  const uint64_t shape_seed = test::fresh_seed();
  std::mt19937_64 rng(shape_seed);
  const int64_t Es[] = {1, 2, 8, 64, 256, 512}, Ks[] = {1, 2, 4, 8};
  for (int i = 0; i < 6; ++i) {
    const int64_t E = Es[rng() % 6];
    int64_t K = Ks[rng() % 4];
    K = std::min(K, E);
    shapes.push_back({static_cast<int64_t>(1 + rng() % 30000), E, K});
  }
  for (const Shape& s : shapes) {
    for (bool skew : {false, true}) {
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " shape seed " << shape_seed
                                        << " T=" << s.T << " E=" << s.E << " K=" << s.K
                                        << (skew ? " skewed" : " uniform"));
      check_both_builders(random_topk(s.T, s.E, s.K, seed, skew));
      if (HasFailure()) return;
    }
  }
}

TEST(RoutingPlan, SkewedRoutingIsSkewed) {
  // The generator the skewed cases rely on: about 80% of pairs land on 20% of the experts.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t E = 64, K = 2;
  const HostRouting r = random_topk(20000, E, K, seed, /*skew=*/true);
  RoutingPlan plan;
  build_routing_plan(r.view(), PlanBuilder::atomic_free, plan);
  std::vector<int64_t> counts(E);
  for (int64_t e = 0; e < E; ++e)
    counts[e] = plan.view().expert_token_offsets[e + 1] - plan.view().expert_token_offsets[e];
  std::sort(counts.rbegin(), counts.rend());
  int64_t top = 0;
  for (int64_t e = 0; e < E / 5; ++e) top += counts[e];
  const double share = double(top) / double(r.P());
  EXPECT_GT(share, 0.7);
  EXPECT_LT(share, 0.9);
}

TEST(RoutingPlan, EmptyExperts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  HostRouting r = random_topk(3000, 32, 2, seed);
  for (int32_t& e : r.experts) e *= 2;  // experts 0, 2, ..., 62 of 64: every odd one empty
  r.E = 64;
  check_both_builders(r);
  RoutingPlan plan;
  build_routing_plan(r.view(), PlanBuilder::atomic_free, plan);
  for (int64_t e = 1; e < 64; e += 2)
    EXPECT_EQ(plan.view().expert_token_offsets[e], plan.view().expert_token_offsets[e + 1]);
}

TEST(RoutingPlan, EveryTokenOnOneExpert) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t T = 5000, E = 8;
  HostRouting r = random_topk(T, E, 1, seed);
  for (int32_t& e : r.experts) e = 5;
  check_both_builders(r);
  for (PlanBuilder b : kBuilders) {
    RoutingPlan plan;
    build_routing_plan(r.view(), b, plan);
    const RoutingPlanView v = plan.view();
    for (int64_t e = 0; e <= E; ++e) EXPECT_EQ(v.expert_token_offsets[e], e <= 5 ? 0 : T);
    for (int64_t t = 0; t < T; ++t) ASSERT_EQ(v.expert_token_indices[t], t);
  }
}

TEST(RoutingPlan, KEqualsE) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (int64_t E : {1, 2, 8, 64}) {
    const int64_t T = 1500;
    const HostRouting r = random_topk(T, E, E, seed + E);
    check_both_builders(r);
    RoutingPlan plan;
    build_routing_plan(r.view(), PlanBuilder::atomic_free, plan);
    const RoutingPlanView v = plan.view();
    for (int64_t e = 0; e < E; ++e) {  // every expert holds every token, in order
      ASSERT_EQ(v.expert_token_offsets[e], e * T);
      for (int64_t t = 0; t < T; ++t) ASSERT_EQ(v.expert_token_indices[e * T + t], t);
    }
  }
}

TEST(RoutingPlan, SingleToken) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (int64_t K : {1, 2, 4, 8}) check_both_builders(random_topk(1, 256, K, seed + K));
}

TEST(RoutingPlan, EmptyBatch) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const HostRouting filled = random_topk(100, 8, 2, seed);
  HostRouting r;
  r.T = 0;
  r.E = 8;
  r.offsets = {0};  // experts and weights empty: their pointers are null
  for (PlanBuilder b : kBuilders) {
    SCOPED_TRACE(plan_builder_name(b));
    RoutingPlan plan;
    build_routing_plan(filled.view(), b, plan);  // a plan that held something before
    build_routing_plan(r.view(), b, plan);
    EXPECT_EQ(plan.T(), 0);
    EXPECT_EQ(plan.E(), 8);
    EXPECT_EQ(plan.S(), 0);
    for (int64_t e = 0; e <= 8; ++e) EXPECT_EQ(plan.view().expert_token_offsets[e], 0);
    EXPECT_EQ(plan.view().token_pair_offsets[0], 0);
    EXPECT_EQ(plan.bytes(), plan_bytes_formula(0, 8, 0));
    expect_matches_reference(plan, r);
  }
}

TEST(RoutingPlan, GeneralCsrWithEmptyTokens) {
  struct Case { int64_t T, E, max_pairs; };
  // max_pairs 100 > 32 also takes the validator's long-token duplicate check.
  for (const Case& c : {Case{5000, 64, 12}, Case{3000, 256, 100}, Case{20, 4, 4},
                        Case{7, 1, 1}, Case{40000, 16, 6}}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " T=" << c.T << " E=" << c.E
                                      << " max_pairs=" << c.max_pairs);
    const HostRouting r = random_csr(c.T, c.E, c.max_pairs, seed);
    ASSERT_EQ(r.offsets[1], 0);  // token 0 has no pair
    check_both_builders(r);
  }
  // Every token empty: S = 0 with T > 0.
  HostRouting r;
  r.T = 600;
  r.E = 4;
  r.offsets.assign(601, 0);
  check_both_builders(r);
}

TEST(RoutingPlan, BitIdenticalAcrossThreadCounts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const HostRouting routings[] = {random_topk(60000, 64, 4, seed, /*skew=*/true),
                                  random_topk(20000, 512, 8, seed + 1),
                                  random_csr(30000, 128, 20, seed + 2)};
  const int many = std::max(4, max_threads());
  for (const HostRouting& r : routings) {
    RoutingPlan one[2], more[2];
    for (int i = 0; i < 2; ++i) {
      {
        ThreadCountScope threads(1);
        build_routing_plan(r.view(), kBuilders[i], one[i]);
      }
      {
        ThreadCountScope threads(many);
        build_routing_plan(r.view(), kBuilders[i], more[i]);
      }
      expect_plans_identical(one[i], more[i]);
    }
    expect_plans_identical(one[0], one[1]);  // atomic-free and sort agree bit for bit
  }
}

TEST(RoutingPlan, RoutingContainerAndPlanReuse) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const HostRouting a = random_topk(7000, 64, 4, seed), b = random_csr(3000, 8, 5, seed + 1);
  // Through the library's own Routing container.
  Routing owned(Device::cpu, a.T, a.E, a.P());
  std::copy(a.offsets.begin(), a.offsets.end(), owned.pair_offsets());
  std::copy(a.experts.begin(), a.experts.end(), owned.pair_experts());
  std::copy(a.weights.begin(), a.weights.end(), owned.pair_weights());
  for (PlanBuilder builder : kBuilders) {
    SCOPED_TRACE(plan_builder_name(builder));
    RoutingPlan plan;
    build_routing_plan(owned.view(), builder, plan);
    expect_matches_reference(plan, a);
    build_routing_plan(b.view(), builder, plan);  // other shape: reallocated
    expect_matches_reference(plan, b);
    const HostRouting a2 = random_topk(a.T, a.E, 4, seed + 2);
    build_routing_plan(a.view(), builder, plan);
    build_routing_plan(a2.view(), builder, plan);  // same shape: arrays reused, all rewritten
    expect_matches_reference(plan, a2);
  }
}

TEST(RoutingPlan, MemoryIsThePlanPlusSmallWorkspace) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t T = 65536, E = 256, K = 8;
  const HostRouting r = random_topk(T, E, K, seed);
  for (PlanBuilder b : kBuilders) {
    SCOPED_TRACE(plan_builder_name(b));
    const size_t before = memory_stats(Device::cpu).current;
    RoutingPlan plan;
    size_t peak = 0;
    {
      PeakScope scope(Device::cpu);
      build_routing_plan(r.view(), b, plan);
      peak = scope.peak_above_start();
    }
    // What stays allocated is exactly the six plan arrays.
    EXPECT_EQ(plan.bytes(), plan_bytes_formula(T, E, T * K));
    EXPECT_EQ(memory_stats(Device::cpu).current - before, plan.bytes());
    const size_t workspace = peak - plan.bytes();
    if (b == PlanBuilder::atomic_free) {
      // O(E * tiles) with tiles of at least 256 tokens: nothing like the 4·T·E-byte dense map.
      EXPECT_LE(workspace, size_t(4) * E * ((T + 255) / 256));
      EXPECT_LT(workspace, size_t(4) * T * E / 64);
      EXPECT_GT(workspace, 0u);  // the per-tile counts are accounted
    } else {
      EXPECT_LE(workspace, size_t(12) * T * K);  // sort keys and the token of each pair
    }
  }
}

// ---- argument checks ----

struct PlanSnapshot {
  int64_t T, E, S;
  RoutingPlanView view;
  size_t bytes;
  std::vector<int32_t> eto, eti, tpo, tei, tim;
  std::vector<float> sw;

  explicit PlanSnapshot(const RoutingPlan& p)
      : T(p.T()), E(p.E()), S(p.S()), view(p.view()), bytes(p.bytes()) {
    eto.assign(view.expert_token_offsets, view.expert_token_offsets + E + 1);
    eti.assign(view.expert_token_indices, view.expert_token_indices + S);
    sw.assign(view.slot_weights, view.slot_weights + S);
    tpo.assign(view.token_pair_offsets, view.token_pair_offsets + T + 1);
    tei.assign(view.token_expert_indices, view.token_expert_indices + S);
    tim.assign(view.token_index_map, view.token_index_map + S);
  }
  void expect_unchanged(const RoutingPlan& p) const {
    ASSERT_EQ(p.T(), T);
    ASSERT_EQ(p.E(), E);
    ASSERT_EQ(p.S(), S);
    ASSERT_EQ(p.bytes(), bytes);
    const RoutingPlanView v = p.view();
    ASSERT_EQ(v.expert_token_offsets, view.expert_token_offsets);  // not reallocated
    ASSERT_EQ(v.token_index_map, view.token_index_map);
    EXPECT_TRUE(same_bits("expert_token_offsets", v.expert_token_offsets, eto, E + 1));
    EXPECT_TRUE(same_bits("expert_token_indices", v.expert_token_indices, eti, S));
    EXPECT_TRUE(same_bits("slot_weights", v.slot_weights, sw, S));
    EXPECT_TRUE(same_bits("token_pair_offsets", v.token_pair_offsets, tpo, T + 1));
    EXPECT_TRUE(same_bits("token_expert_indices", v.token_expert_indices, tei, S));
    EXPECT_TRUE(same_bits("token_index_map", v.token_index_map, tim, S));
  }
};

class RoutingPlanErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = test::fresh_seed();
    // T = 6, E = 8, K = 2: pair p belongs to token p / 2.
    good_ = random_topk(6, 8, 2, seed_);
    build_routing_plan(random_topk(50, 16, 3, seed_ + 1).view(), PlanBuilder::sort, plan_);
  }

  // Expects InvalidArgument whose message contains `expected`, from both builders, with the
  // plan left exactly as it was.
  void expect_rejected(const RoutingView& v, const std::string& expected,
                       PlanBuilder only = PlanBuilder(255)) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed_ << " expecting: " << expected);
    const PlanSnapshot before(plan_);
    for (PlanBuilder b : kBuilders) {
      const PlanBuilder used = only == PlanBuilder(255) ? b : only;
      try {
        build_routing_plan(v, used, plan_);
        ADD_FAILURE() << "no throw";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
            << "message: " << e.what();
      }
      before.expect_unchanged(plan_);
    }
  }

  uint64_t seed_ = 0;
  HostRouting good_;
  RoutingPlan plan_;
};

TEST_F(RoutingPlanErrors, Sizes) {
  RoutingView v = good_.view();
  v.T = -1;
  expect_rejected(v, "routing: T (-1) must be >= 0");
  v = good_.view();
  v.E = 0;
  expect_rejected(v, "routing: E (0) must be >= 1");
  v = good_.view();
  v.P = -3;
  expect_rejected(v, "routing: P (-3) must be >= 0");
  v = good_.view();
  v.P = int64_t(1) << 31;
  expect_rejected(v, "routing: P (2147483648) exceeds the int32 index range of the routing plan");
  v = good_.view();
  v.T = int64_t(1) << 31;
  expect_rejected(v, "routing: T (2147483648) exceeds the int32 index range of the routing plan");
  v = good_.view();
  v.E = int64_t(1) << 32;
  expect_rejected(v, "routing: E (4294967296) exceeds the int32 index range of the routing plan");
}

TEST_F(RoutingPlanErrors, NullPointers) {
  RoutingView v = good_.view();
  v.pair_offsets = nullptr;
  expect_rejected(v, "pair_offsets has no data (null pointer)");
  v = good_.view();
  v.pair_experts = nullptr;
  expect_rejected(v, "pair_experts has no data (null pointer)");
  v = good_.view();
  v.pair_weights = nullptr;
  expect_rejected(v, "pair_weights has no data (null pointer)");
  // T = 0 still has one offset.
  v = RoutingView{};
  v.E = 4;
  expect_rejected(v, "pair_offsets has no data (null pointer)");
}

TEST_F(RoutingPlanErrors, Offsets) {
  HostRouting r = good_;
  r.offsets[0] = 1;
  expect_rejected(r.view(), "pair_offsets[0] (1) must be 0");
  r = good_;
  r.offsets[3] = 3;  // token 2 would end before it starts
  expect_rejected(r.view(), "pair_offsets must be non-decreasing: token 2 has pair_offsets[3] (3) "
                            "< pair_offsets[2] (4)");
  r = good_;
  RoutingView v = r.view();
  v.P = 11;  // pair_offsets[6] = 12
  expect_rejected(v, "pair_offsets[T=6] (12) must equal the number of pairs P (11)");
}

TEST_F(RoutingPlanErrors, ExpertIds) {
  HostRouting r = good_;
  r.experts[7] = 9;  // second pair of token 3
  expect_rejected(r.view(), "pair_experts: expert id 9 of token 3 is out of range [0, 8)");
  r = good_;
  r.experts[0] = -1;
  expect_rejected(r.view(), "pair_experts: expert id -1 of token 0 is out of range [0, 8)");
  r = good_;
  r.experts[5] = r.experts[4];
  expect_rejected(r.view(), "pair_experts: expert id " + std::to_string(r.experts[4]) +
                                " is repeated in token 2 (pairs 4 and 5)");
}

TEST_F(RoutingPlanErrors, RepeatedExpertInLongToken) {
  // A token with 40 pairs takes the stamp-based duplicate check instead of pairwise compares.
  HostRouting r;
  r.E = 64;
  std::vector<int32_t> experts;
  std::vector<int32_t> offsets = {0};
  for (int t = 0; t < 3; ++t) {
    for (int i = 0; i < 40; ++i) experts.push_back((i * 7 + t) % 64);
    offsets.push_back(static_cast<int32_t>(experts.size()));
  }
  r.T = 3;
  r.offsets = offsets;
  r.experts = experts;
  fill_weights(r, seed_);
  for (PlanBuilder b : kBuilders) {  // valid as built (7 is coprime to 64)
    RoutingPlan p;
    EXPECT_NO_THROW(build_routing_plan(r.view(), b, p));
  }
  r.experts[80 + 33] = r.experts[80 + 2];  // token 2: pairs 82 and 113
  expect_rejected(r.view(), "pair_experts: expert id " + std::to_string(r.experts[82]) +
                                " is repeated in token 2 (pairs 82 and 113)");
}

TEST_F(RoutingPlanErrors, NonFiniteWeights) {
  HostRouting r = good_;
  r.weights[9] = std::numeric_limits<float>::quiet_NaN();
  expect_rejected(r.view(), "pair_weights: weight nan of token 4 (pair 9) is not finite");
  r = good_;
  r.weights[2] = std::numeric_limits<float>::infinity();
  expect_rejected(r.view(), "pair_weights: weight inf of token 1 (pair 2) is not finite");
}

TEST_F(RoutingPlanErrors, ReportsTheFirstErrorWhateverTheThreadCount) {
  // Two errors in different validation chunks: the lower token is reported.
  HostRouting r = random_topk(20000, 64, 4, seed_);
  r.experts[4 * 15000 + 1] = 64;
  r.experts[4 * 5000 + 3] = r.experts[4 * 5000];
  const std::string expected = "pair_experts: expert id " + std::to_string(r.experts[20000]) +
                               " is repeated in token 5000 (pairs 20000 and 20003)";
  for (int threads : {1, std::max(4, max_threads())}) {
    ThreadCountScope scope(threads);
    expect_rejected(r.view(), expected);
  }
}

TEST_F(RoutingPlanErrors, UnknownBuilder) {
  expect_rejected(good_.view(), "builder (7) is not atomic_free or sort", PlanBuilder(7));
}

#ifndef MOEBLAZE_WITH_CUDA
TEST_F(RoutingPlanErrors, DeviceRoutingWithoutCuda) {
  RoutingView v = good_.view();
  v.device = Device::cuda;
  const PlanSnapshot before(plan_);
  try {
    build_routing_plan(v, PlanBuilder::atomic_free, plan_);
    ADD_FAILURE() << "no throw";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("routing on cuda"), std::string::npos) << e.what();
  }
  before.expect_unchanged(plan_);
}
#endif

}  // namespace
}  // namespace moeblaze
