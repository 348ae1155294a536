// FP8 compute on the CPU layer (LayerConfig::compute = fp8, cpu/fp8_operands.hpp): accuracy
// against the float64 reference of the unquantized inputs, both modes bitwise equal, thread
// count invariance, H kept as the rule's e4m3 codes and scales, and the checks of the option.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "core/fp8.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {
namespace {

using test::HostRouting;
using test::HostTensor;
using test::LayerTensors;

LayerConfig fp8_config(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, Activation act) {
  LayerConfig cfg{T, d, n, E, K, act, DType::bf16};
  cfg.compute = Compute::fp8;
  return cfg;
}

// e4m3 keeps 3 mantissa bits: one quantized operand adds a relative error of about
// 2^-4 / sqrt(3) = 0.036 (uniform rounding over half an ulp of 2^-3), measured 0.037 for one GEMM
// (docs/notes/fp8.md). out and dx pass two quantized GEMMs in series
// (~0.036 sqrt(2)), the weight gradients inherit one from dA' and H: 0.1 bounds all of them with
// margin, and stays far below a broken path (a wrong scale or a missed operand is O(1)).
constexpr double kFp8Tol = 0.1;
// relu's step derivative turns every h whose sign the FP8 up-projection gets wrong (~1 % of H at
// cpu-default) into a whole error of dH, so dx and dw1 reach ~0.16
// (docs/notes/fp8.md); the other outputs keep kFp8Tol.
constexpr double kFp8ReluDhTol = 0.25;

TEST(Fp8Layer, MatchesFloat64WithinTheE4m3BoundInBothModes) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t T, d, n, E, K;
    Activation act;
  };
  auto dh_tol = [](Activation a) { return a == Activation::relu ? kFp8ReluDhTol : kFp8Tol; };
  // Whole 128-tiles, and partial ones at the edges of d, n and 2n.
  for (const Case& c : {Case{300, 256, 128, 6, 2, Activation::swiglu},
                        Case{257, 160, 96, 5, 3, Activation::gelu},
                        Case{200, 128, 200, 4, 2, Activation::swiglu_oai},
                        Case{256, 128, 128, 4, 2, Activation::relu}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" +
                 std::to_string(c.n) + " " + activation_name(c.act));
    const HostRouting routing = test::random_routing({c.T, c.E, c.K, 1, false}, rng());
    const RoutingPlan plan = test::make_plan(routing);
    const LayerConfig cfg = fp8_config(c.T, c.d, c.n, c.E, c.K, c.act);
    LayerTensors keep(cfg, plan.S());
    keep.randomize(rng());
    LayerTensors rec = keep;
    test::run_layer(cfg, plan, keep, {LayerMode::keep_h, 0});
    test::run_layer(cfg, plan, rec, {LayerMode::recompute, 0});
    // Recompute fake-quantizes its H as keep_h quantizes the kept one: the same bits.
    test::expect_same_results(keep, rec);

    const reference::LayerReference ref = reference::reference_layer(
        cfg, routing.view(), keep.x.view(), keep.w1.view(), keep.w2.view(), keep.d_out.view());
    test::expect_close("out", keep.out, ref.out, kFp8Tol);
    test::expect_close("dx", keep.dx, ref.dx, dh_tol(c.act));
    test::expect_close("dw1", keep.dw1, ref.dw1, dh_tol(c.act));
    test::expect_close("dw2", keep.dw2, ref.dw2, kFp8Tol);
    EXPECT_LE(test::scaled_error(keep.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs),
              kFp8Tol);
    // And it is the fp8 path: the storage path is an order of magnitude closer.
    LayerConfig bf16_cfg = cfg;
    bf16_cfg.compute = Compute::storage;
    LayerTensors plain = keep;
    test::run_layer(bf16_cfg, plan, plain, {LayerMode::keep_h, 0});
    EXPECT_GT(test::rel_error(keep.out, ref.out), 3 * test::rel_error(plain.out, ref.out));
  }
}

// Both FP8 recipes (fp8_wgrad's token tiles included), with an empty expert.
TEST(Fp8Layer, BitwiseIndependentOfTheThreadCount) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = test::random_routing({700, 8, 2, 1, true}, seed);
  const RoutingPlan plan = test::make_plan(routing);
  for (Compute compute : {Compute::fp8, Compute::fp8_wgrad}) {
    SCOPED_TRACE(compute_name(compute));
    LayerConfig cfg = fp8_config(700, 192, 160, 8, 2, Activation::swiglu);
    cfg.compute = compute;
    LayerTensors first(cfg, plan.S());
    first.randomize(seed);
    test::run_layer(cfg, plan, first, {LayerMode::keep_h, 2});
    for (int threads : {1, 3}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      LayerTensors again = first;
      again.pattern_outputs();
      test::run_layer(cfg, plan, again, {LayerMode::keep_h, threads});
      test::expect_same_results(first, again);
    }
  }
}

// Kept H: e4m3 codes and 1x128 scales of the up-projection's fp32 output, H = Xq W1qᵀ (the
// CPU GEMM's plain ascending fp32 sum over k of products of the dequantized operands), about
// half the bf16 bytes.
TEST(Fp8Layer, KeptHIsTheRulesCodesAndScalesAtHalfTheBytes) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 40, d = 160, n = 100, E = 3, K = 2, R = 2 * n;
  const HostRouting routing = test::random_routing({T, E, K, 0, false}, seed);
  const RoutingPlan plan = test::make_plan(routing);
  const LayerConfig cfg = fp8_config(T, d, n, E, K, Activation::swiglu);
  const int64_t S = plan.S();
  LayerTensors t(cfg, S);
  t.randomize(seed);
  const size_t bytes = cfg.kept_h_bytes(S);
  EXPECT_EQ(cfg.kept_h_scales_offset(S), size_t(S * R + 15) / 16 * 16);
  EXPECT_EQ(bytes, cfg.kept_h_scales_offset(S) + size_t(S * fp8_groups(R)) * 4);
  LayerConfig bf16_cfg = cfg;
  bf16_cfg.compute = Compute::storage;
  EXPECT_LE(double(bytes), 0.55 * double(bf16_cfg.kept_h_bytes(S)));

  std::vector<unsigned char> h(bytes + 64, 0);
  unsigned char* h16 = h.data() + (16 - reinterpret_cast<uintptr_t>(h.data()) % 16) % 16;
  LayerOptions opts{LayerMode::keep_h, 1};
  opts.h_storage = h16;
  SavedForBackward saved;
  layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved, opts);
  EXPECT_EQ(saved.bytes(), bytes);

  // The operands as the rule quantizes them, dequantized.
  std::vector<float> xq(size_t(T * d)), w1q(size_t(E * R * d));
  {
    std::vector<e4m3> codes(size_t(E * R * d));
    std::vector<float> sx(size_t(T * fp8_groups(d))), sw(size_t(fp8_groups(R) * fp8_groups(d)));
    quantize_1x128(static_cast<const bf16*>(t.x.view().data), T, d, d, codes.data(), sx.data());
    dequantize_1x128(codes.data(), sx.data(), T, d, xq.data());
    for (int64_t e = 0; e < E; ++e) {
      const bf16* w = static_cast<const bf16*>(t.w1.view().data) + e * R * d;
      quantize_128x128(w, R, d, d, codes.data(), sw.data());
      dequantize_128x128(codes.data(), sw.data(), R, d, w1q.data() + e * R * d);
    }
  }
  const RoutingPlanView pv = plan.view();
  const e4m3* codes = reinterpret_cast<const e4m3*>(h16);
  const float* scales = reinterpret_cast<const float*>(h16 + cfg.kept_h_scales_offset(S));
  std::vector<float> hrow(static_cast<size_t>(R));
  std::vector<e4m3> want(static_cast<size_t>(R));
  std::vector<float> want_scales(static_cast<size_t>(fp8_groups(R)));
  int64_t code_mismatches = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t s = pv.expert_token_offsets[e]; s < pv.expert_token_offsets[e + 1]; ++s) {
      const int64_t tok = pv.expert_token_indices[s];
      for (int64_t j = 0; j < R; ++j) {
        float acc = 0.0f;
        for (int64_t k = 0; k < d; ++k) {
          const float p = xq[size_t(tok * d + k)] * w1q[size_t((e * R + j) * d + k)];
          acc = acc + p;
        }
        hrow[size_t(j)] = acc;
      }
      quantize_1x128(hrow.data(), 1, R, R, want.data(), want_scales.data());
      for (int64_t g = 0; g < fp8_groups(R); ++g)
        EXPECT_EQ(scales[s * fp8_groups(R) + g], want_scales[size_t(g)]) << "slot " << s;
      for (int64_t j = 0; j < R; ++j)
        code_mismatches += codes[s * R + j].bits != want[size_t(j)].bits;
    }
  }
  EXPECT_EQ(code_mismatches, 0);
}

TEST(Fp8Layer, TheOptionIsCheckedWhereItCannotRun) {
  const HostRouting routing = test::random_routing({16, 4, 2, 0, false}, 7);
  const RoutingPlan plan = test::make_plan(routing);
  LayerConfig cfg = fp8_config(16, 32, 16, 4, 2, Activation::swiglu);
  cfg.dtype = DType::f32;
  try {
    cfg.validate();
    ADD_FAILURE() << "fp8 with fp32 storage was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("compute fp8 needs bf16 storage"), std::string::npos)
        << e.what();
  }
  cfg.dtype = DType::bf16;
  cfg.compute = static_cast<Compute>(7);
  EXPECT_THROW(cfg.validate(), InvalidArgument);
  cfg.compute = Compute::fp8;
  LayerTensors t(cfg, plan.S());
  t.randomize(3);
  t.out.fill_pattern();
  const HostTensor before = t.out;
  SavedForBackward saved;
  try {
    layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved,
                  {LayerMode::materialized, 1});
    ADD_FAILURE() << "fp8 in the materialized baseline was accepted";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("compute fp8"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::bitwise_equal(t.out, before));
  // A weight cache with storage compute is refused by name; with fp8 on the CPU (which quantizes
  // every call) it changes nothing.
  Fp8WeightCache cache;
  LayerOptions with_cache{LayerMode::keep_h, 1};
  with_cache.fp8_weights = &cache;
  LayerConfig storage = cfg;
  storage.compute = Compute::storage;
  try {
    layer_forward(storage, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved,
                  with_cache);
    ADD_FAILURE() << "a weight cache with storage compute was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("opts.fp8_weights"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::bitwise_equal(t.out, before));
  LayerTensors plain = t, cached = t;
  test::run_layer(cfg, plan, plain, {LayerMode::keep_h, 1});
  test::run_layer(cfg, plan, cached, with_cache);
  test::expect_same_results(plain, cached);
  EXPECT_EQ(cache.quantizations(), 0);
  EXPECT_EQ(cache.bytes(), 0u);
  EXPECT_EQ(parse_compute("fp8"), Compute::fp8);
  EXPECT_EQ(parse_compute("bf16"), Compute::storage);
  EXPECT_THROW(parse_compute("fp4"), InvalidArgument);
}

}  // namespace
}  // namespace moeblaze
