// Seeded fuzzing of the layer: random valid layers must match the float64 reference
// (C++ API in every mode, and the C ABI over a borrowed plan bit for bit), and random corruptions
// of a valid plan or of one argument through the C ABI must fail cleanly: error code
// MOEBLAZE_ERR_INVALID_ARGUMENT with a message, every output untouched.
//
// Each test prints its counts: inputs tried, clean errors, unclean errors (another error code),
// silent wrong (an invalid input accepted, an output written on error, or a valid input off
// the reference); a crash would end the process, so a finished run has none.
// CI runs one round over the fixed seeds (a few seconds); MOEBLAZE_FUZZ_ITERS=N runs N rounds
// (round r uses seed + r * 1000003), as scripts/fuzz.sh does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "common/test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {
namespace {

using test::HostPlan;
using test::HostRouting;
using test::HostTensor;
using test::LayerTensors;

constexpr uint64_t kSeeds[] = {1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233};

int64_t fuzz_rounds() {
  const char* v = std::getenv("MOEBLAZE_FUZZ_ITERS");
  if (v == nullptr || *v == '\0') return 1;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (*end == '\0' && n >= 1) ? n : 1;
}

struct Counts {
  int64_t tried = 0, accepted = 0, clean_errors = 0, unclean_errors = 0, silent_wrong = 0;
  void print(const char* what) const {
    std::cout << "[fuzz] " << what << ": " << tried << " inputs tried, " << accepted
              << " valid and matching, " << clean_errors << " clean errors, " << unclean_errors
              << " unclean errors, 0 crashes, " << silent_wrong << " silent wrong\n";
  }
};

// A random valid layer: small shapes, every activation and dtype, empty experts, and (often)
// tokens that lost all their pairs, as token rounding leaves them.
struct RandomLayer {
  LayerConfig cfg;
  HostRouting routing;
  RoutingPlan plan;

  explicit RandomLayer(std::mt19937_64& rng) {
    const auto pick = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    const int64_t E = pick(1, 8), K = pick(1, E);
    // d, n >= 16: with fewer terms per dot product a bf16 result's relative error spreads past
    // test_util's bound on a handful of tokens (test_layer.cpp measures it).
    cfg = {pick(0, 64),
           pick(16, 48),
           pick(16, 48),
           E,
           K,
           static_cast<Activation>(pick(0, 5)),
           pick(0, 1) ? DType::bf16 : DType::f32};
    routing = test::random_routing({cfg.T, E, K, pick(0, E - K), pick(0, 1) == 1}, rng());
    if (pick(0, 2) == 0) test::drop_some_tokens(routing, rng);
    plan = test::make_plan(routing);
  }
};

bool matches_reference(const LayerConfig& cfg, const LayerTensors& t,
                       const reference::LayerReference& ref) {
  const double tol = test::rel_tolerance(cfg.dtype);
  return test::rel_error(t.out, ref.out) <= tol && test::rel_error(t.dx, ref.dx) <= tol &&
         test::rel_error(t.dw1, ref.dw1) <= tol && test::rel_error(t.dw2, ref.dw2) <= tol &&
         test::scaled_error(t.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs) <= tol;
}

// The C ABI forward + backward (keep_h) over a borrowed copy of the plan into `t`'s outputs.
int c_abi_layer(const LayerConfig& cfg, HostPlan& plan, LayerTensors& t) {
  const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 0, 1);
  const moeblaze_plan p = plan.c_plan();
  std::vector<unsigned char> h(size_t(plan.S * cfg.w1_rows()) * dtype_size(cfg.dtype) + 16);
  int rc = moeblaze_layer_forward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                  t.out.data(), h.data(), nullptr, 0);
  if (rc != MOEBLAZE_OK) return rc;
  return moeblaze_layer_backward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                 t.d_out.data(), h.data(), t.dx.data(), t.dw1.data(), t.dw2.data(),
                                 static_cast<float*>(t.d_pair_weights.data()), nullptr, 0);
}

// Calls fn(layer, rng) for `per_seed` random layers of every seed of every round, with the seed
// and the layer's shape in the failure trace.
template <typename Fn>
void for_each_random_layer(int per_seed, const Fn& fn) {
  for (int64_t round = 0; round < fuzz_rounds(); ++round) {
    for (uint64_t base : kSeeds) {
      const uint64_t seed = base + uint64_t(round) * 1000003u;
      SCOPED_TRACE("seed " + std::to_string(seed));
      std::mt19937_64 rng(seed);
      for (int i = 0; i < per_seed; ++i) {
        const RandomLayer L(rng);
        const LayerConfig& cfg = L.cfg;
        SCOPED_TRACE("T=" + std::to_string(cfg.T) + " d=" + std::to_string(cfg.d) +
                     " n=" + std::to_string(cfg.n) + " E=" + std::to_string(cfg.E) +
                     " K=" + std::to_string(cfg.K) + " " + activation_name(cfg.activation) + " " +
                     dtype_name(cfg.dtype));
        fn(L, rng);
      }
    }
  }
}

TEST(Fuzz, RandomValidLayersMatchFloat64) {
  Counts n;
  for_each_random_layer(6, [&](const RandomLayer& L, std::mt19937_64& rng) {
    const LayerConfig& cfg = L.cfg;
    LayerTensors base_t(cfg, L.plan.S());
    base_t.randomize(rng());
    const reference::LayerReference ref =
        reference::reference_layer(cfg, L.routing.view(), base_t.x.view(), base_t.w1.view(),
                                   base_t.w2.view(), base_t.d_out.view());
    LayerTensors keep = base_t;
    for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized}) {
      ++n.tried;
      LayerTensors t = base_t;
      test::run_layer(cfg, L.plan, t, {mode, int(rng() % 2) + 1});
      const bool ok = matches_reference(cfg, t, ref);
      EXPECT_TRUE(ok) << layer_mode_name(mode) << " is off the float64 reference";
      ok ? ++n.accepted : ++n.silent_wrong;
      if (mode == LayerMode::keep_h) keep = t;
    }
    // The C ABI over a borrowed (hence validated) copy of the plan: bit for bit keep_h.
    ++n.tried;
    HostPlan copy(L.plan);
    LayerTensors c = base_t;
    const int rc = c_abi_layer(cfg, copy, c);
    EXPECT_EQ(rc, MOEBLAZE_OK) << moeblaze_last_error();
    const bool same = rc == MOEBLAZE_OK && test::bitwise_equal(c.out, keep.out) &&
                      test::bitwise_equal(c.dx, keep.dx) && test::bitwise_equal(c.dw1, keep.dw1) &&
                      test::bitwise_equal(c.dw2, keep.dw2) &&
                      test::bitwise_equal(c.d_pair_weights, keep.d_pair_weights);
    EXPECT_TRUE(same) << "the C ABI differs from the C++ API";
    rc != MOEBLAZE_OK ? ++n.unclean_errors : same ? ++n.accepted : ++n.silent_wrong;
  });
  n.print("valid layers");
  EXPECT_EQ(n.silent_wrong + n.unclean_errors, 0);
}

// ---- invalid inputs through the C ABI ----

// One call's C arguments over test storage; a corruption edits them before the call.
struct CCall {
  moeblaze_layer_cfg cfg;
  moeblaze_plan plan;
  const void *x, *w1, *w2, *d_out;
  void *out, *h, *dx, *dw1, *dw2, *workspace;
  float* d_pair_weights;
  uint64_t workspace_bytes = 0;
  bool backward = false;
};

// A value different from `old` that breaks `plan`'s rules whatever the rest holds: outside
// [lo, hi), or inside it but inconsistent (the caller guarantees the latter when in_range).
int32_t different(std::mt19937_64& rng, int32_t old, int64_t lo, int64_t hi, bool in_range) {
  if (in_range && hi - lo >= 2) {
    int32_t v = old;
    while (v == old)
      v = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng));
    return v;
  }
  const int32_t far[] = {
      std::numeric_limits<int32_t>::min(), -1,      static_cast<int32_t>(hi),
      static_cast<int32_t>(hi + 1),        1000000, std::numeric_limits<int32_t>::max()};
  return far[rng() % 6];
}

// Corrupts the plan (its arrays in `p`, or the C struct `c` over them) so that it is certainly
// invalid; returns false when this plan has nothing to corrupt that way (S = 0 for a slot array).
bool corrupt_plan(std::mt19937_64& rng, HostPlan& p, moeblaze_plan& c) {
  const auto idx = [&](int64_t count) {
    return static_cast<size_t>(std::uniform_int_distribution<int64_t>(0, count - 1)(rng));
  };
  switch (rng() % 9) {
    case 0: {  // a token id: out of range, or another token (the pair view then disagrees)
      if (p.S == 0) return false;
      const size_t s = idx(p.S);
      p.expert_token_indices[s] = different(rng, p.expert_token_indices[s], 0, p.T, rng() % 2);
      return true;
    }
    case 1: {  // an expert id: out of range, or another expert (its slot is not in that range)
      if (p.S == 0) return false;
      const size_t q = idx(p.S);
      p.token_expert_indices[q] = different(rng, p.token_expert_indices[q], 0, p.E, rng() % 2);
      return true;
    }
    case 2: {  // a slot: out of range, or another slot (the map is then no permutation)
      if (p.S == 0) return false;
      const size_t q = idx(p.S);
      p.token_index_map[q] = different(rng, p.token_index_map[q], 0, p.S, rng() % 2);
      return true;
    }
    case 3: {  // two pairs of different experts swap slots (each lands in the wrong range)
      for (int tries = 0; tries < 8 && p.S >= 2; ++tries) {
        const size_t a = idx(p.S), b = idx(p.S);
        if (p.token_expert_indices[a] == p.token_expert_indices[b]) continue;
        std::swap(p.token_index_map[a], p.token_index_map[b]);
        return true;
      }
      return false;
    }
    case 4: {  // an expert offset: any change moves a slot (or breaks 0 / S / monotonicity)
      const size_t e = idx(p.E + 1);
      p.expert_token_offsets[e] = different(rng, p.expert_token_offsets[e], 0, p.S + 1,
                                            rng() % 2 && e > 0 && e < size_t(p.E));
      // Inside [0, S] a new interior value moves at least one slot to another expert, whose
      // pair still names the old one.
      return true;
    }
    case 5: {  // a token offset, likewise
      const size_t t = idx(p.T + 1);
      p.token_pair_offsets[t] = different(rng, p.token_pair_offsets[t], 0, p.S + 1,
                                          rng() % 2 && t > 0 && t < size_t(p.T));
      return true;
    }
    case 6: {  // a non-finite slot weight
      if (p.S == 0) return false;
      const float bad[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
      p.slot_weights[idx(p.S)] = bad[rng() % 3];
      return true;
    }
    case 7: {  // a null array
      if (p.S == 0) return false;
      int32_t** arrays[] = {&c.expert_token_indices, &c.token_expert_indices, &c.token_index_map,
                            &c.expert_token_offsets, &c.token_pair_offsets};
      *arrays[rng() % 5] = nullptr;
      return true;
    }
    default: {  // header sizes that do not match the layer or the int32 index range
      switch (rng() % 4) {
        case 0:
          c.T += 1;
          break;
        case 1:
          c.E += 1;
          break;
        case 2:
          c.S = -1;
          break;
        default:
          c.S = int64_t(1) << 40;
          break;
      }
      return true;
    }
  }
}

TEST(Fuzz, CorruptedPlansAndArgumentsFailCleanly) {
  Counts n;
  int64_t plan_cases = 0, arg_cases = 0;
  for_each_random_layer(4, [&](const RandomLayer& L, std::mt19937_64& rng) {
    const LayerConfig& cfg = L.cfg;
    LayerTensors t(cfg, L.plan.S());
    t.randomize(rng());
    for (int i = 0; i < 40; ++i) {
      HostPlan hp(L.plan);
      LayerTensors u = t;
      for (HostTensor* o : {&u.out, &u.dx, &u.dw1, &u.dw2, &u.d_pair_weights}) o->fill_pattern();
      std::vector<unsigned char> h(size_t(hp.S * cfg.w1_rows()) * dtype_size(cfg.dtype) + 16, 0xA5);
      alignas(64) static unsigned char ws[1 << 12];
      CCall c{test::c_layer_cfg(cfg, 0, 1),
              hp.c_plan(),
              u.x.data(),
              u.w1.data(),
              u.w2.data(),
              u.d_out.data(),
              u.out.data(),
              h.data(),
              u.dx.data(),
              u.dw1.data(),
              u.dw2.data(),
              nullptr,
              static_cast<float*>(u.d_pair_weights.data())};
      c.backward = rng() % 2;
      const bool on_plan = rng() % 2;
      bool applied = true;
      if (on_plan) {
        applied = corrupt_plan(rng, hp, c.plan);
      } else {
        switch (rng() % 14) {
          case 0:
            c.cfg.activation = 7 + int32_t(rng() % 250);
            break;
          case 1:
            c.cfg.dtype = 2 + int32_t(rng() % 5);
            break;
          case 2:
            c.cfg.mode = rng() % 2 ? -1 : 3;  // 0, 1, 2 are valid (capi.h)
            break;
          case 3:
            c.cfg.num_threads = rng() % 2 ? -1 : 1025 + int32_t(rng() % 100000);
            break;
          case 4:
            c.cfg.d = rng() % 2 ? 0 : int64_t(1) << 62;
            break;
          case 5:
            c.cfg.K = cfg.E + 1;
            break;
          case 6:
            c.cfg.T = cfg.T + 1;
            break;
          case 7:
            c.cfg.n = -int64_t(rng() % 100);
            break;
          case 8:  // a null tensor with elements
            if (cfg.T == 0) {
              applied = false;
              break;
            }
            c.x = nullptr;
            break;
          case 9:  // in place: out over x (forward) or dx over d_out / x (backward)
            if (cfg.T == 0) {
              applied = false;
              break;
            }
            c.out = const_cast<void*>(c.x);
            c.dx = rng() % 2 ? const_cast<void*>(c.d_out) : const_cast<void*>(c.x);
            break;
          case 10:  // a weight gradient over its weight; out over w2
            if (!c.backward && cfg.T == 0) {
              applied = false;
              break;
            }  // out has no bytes
            c.dw1 = const_cast<void*>(c.w1);
            c.dw2 = const_cast<void*>(c.w2);
            c.out = const_cast<void*>(c.w2);
            break;
          case 11:  // d_pair_weights / h over the plan's slot weights
            if (hp.S == 0) {
              applied = false;
              break;
            }
            c.d_pair_weights = hp.slot_weights.data();
            c.h = hp.slot_weights.data();
            break;
          case 12:  // a workspace too small (1 byte) or misaligned
            c.workspace = rng() % 2 ? ws : ws + 8;
            c.workspace_bytes = rng() % 2 ? 1 : sizeof(ws) - 8;
            if (c.workspace == ws && c.workspace_bytes > 1) c.workspace_bytes = 1;
            break;
          default:  // keep_h with no h storage
            if (hp.S == 0) {
              applied = false;
              break;
            }
            c.h = nullptr;
            break;
        }
      }
      if (!applied) continue;
      ++n.tried;
      ++(on_plan ? plan_cases : arg_cases);
      const std::vector<HostTensor> before{u.out, u.dx, u.dw1, u.dw2, u.d_pair_weights};
      const std::vector<unsigned char> h_before = h;
      const int rc = c.backward
                         ? moeblaze_layer_backward(&c.cfg, &c.plan, 0, nullptr, c.x, c.w1, c.w2,
                                                   c.d_out, c.h, c.dx, c.dw1, c.dw2,
                                                   c.d_pair_weights, c.workspace, c.workspace_bytes)
                         : moeblaze_layer_forward(&c.cfg, &c.plan, 0, nullptr, c.x, c.w1, c.w2,
                                                  c.out, c.h, c.workspace, c.workspace_bytes);
      const std::vector<HostTensor> after{u.out, u.dx, u.dw1, u.dw2, u.d_pair_weights};
      bool untouched = h == h_before;
      for (size_t k = 0; k < before.size(); ++k)
        untouched = untouched && test::bitwise_equal(before[k], after[k]);
      const std::string msg = moeblaze_last_error();
      if (rc == MOEBLAZE_ERR_INVALID_ARGUMENT && untouched && !msg.empty()) {
        ++n.clean_errors;
      } else if (rc == MOEBLAZE_OK || !untouched) {
        ++n.silent_wrong;
        ADD_FAILURE() << (on_plan ? "plan" : "argument") << " corruption "
                      << (rc == MOEBLAZE_OK ? "accepted" : "wrote an output") << " (rc " << rc
                      << ", " << (c.backward ? "backward" : "forward") << "): " << msg;
      } else {
        ++n.unclean_errors;
        ADD_FAILURE() << "error code " << rc << " instead of INVALID_ARGUMENT: " << msg;
      }
    }
  });
  n.print("corrupted plans and arguments (C ABI)");
  std::cout << "[fuzz]   of which " << plan_cases << " plan corruptions and " << arg_cases
            << " argument corruptions\n";
  EXPECT_EQ(n.silent_wrong + n.unclean_errors, 0);
}

}  // namespace
}  // namespace moeblaze
