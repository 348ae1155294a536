// FP8 compute on the GPU layer (src/cuda/layer/layer_fp8.cu) against the CPU emulation
// of the same recipe (src/cpu/layer_forward.cpp, layer_backward.cpp) and the float64 reference of
// the unquantized inputs: fresh random inputs (seed printed), routings with empty experts and
// skew, gated and plain activations, expert biases, both modes; keep_h and recompute bitwise
// equal, two runs bitwise equal, H kept as e4m3 codes at about half the bf16 bytes, and the
// shapes the GPU refuses with outputs untouched.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "gpu/gpu_layer_util.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze::test {
namespace {

// tests/cpu/test_layer_fp8.cpp's bounds against float64 (e4m3's 3 mantissa bits; relu's step
// derivative turns H's sign errors into whole dH errors).
constexpr double kFp8Tol = 0.1;
constexpr double kFp8ReluDhTol = 0.25;
// GPU against the CPU emulation: the GEMMs sum in other orders and the GPU rounds H and dA' to
// bf16 before its activation passes (the CPU keeps them fp32), so a few e4m3 codes land one step
// apart; measured far below the e4m3 bound, which a wrong scale or operand would exceed.
constexpr double kGpuVsCpuTol = 0.05;

LayerConfig fp8_config(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, Activation act) {
  LayerConfig cfg{T, d, n, E, K, act, DType::bf16};
  cfg.compute = Compute::fp8;
  return cfg;
}

// The device outputs of a step into t's host tensors (after the step's stream is done).
void download_outputs(const DevTensor& out, const DevTensor& dx, const DevTensor& dw1,
                      const DevTensor& dw2, const DevTensor& dpw, LayerTensors& t) {
  out.download_into(t.out);
  dx.download_into(t.dx);
  dw1.download_into(t.dw1);
  dw2.download_into(t.dw2);
  dpw.download_into(t.d_pair_weights);
}

struct Biases {
  HostTensor b1, b2, db1, db2;
};

// Forward and backward of `t` (inputs in, outputs written back) on the plan's device, with the
// biases when given; returns saved.bytes() after forward.
size_t run(const LayerConfig& cfg, const RoutingPlan& plan, LayerTensors& t, LayerMode mode,
           Biases* bias = nullptr) {
  LayerOptions opts;
  opts.mode = mode;
  SavedForBackward saved;
  if (plan.device() == Device::cpu) {
    LayerBiases b;
    LayerGrads g = t.grads();
    if (bias) {
      b.b1 = bias->b1.view(), b.b2 = bias->b2.view();
      g.db1 = bias->db1.view(), g.db2 = bias->db2.view();
    }
    layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), b, t.out.view(), saved, opts);
    const size_t kept = saved.bytes();
    layer_backward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), b, t.d_out.view(), saved, g,
                   opts);
    return kept;
  }
  DevTensor x(t.x), w1(t.w1), w2(t.w2), out(t.out), d_out(t.d_out), dx(t.dx), dw1(t.dw1),
      dw2(t.dw2), dpw(t.d_pair_weights);
  HostTensor none;
  DevTensor b1(bias ? bias->b1 : none), b2(bias ? bias->b2 : none), db1(bias ? bias->db1 : none),
      db2(bias ? bias->db2 : none);
  LayerBiases b;
  LayerGrads g;
  g.dx = dx.v, g.dw1 = dw1.v, g.dw2 = dw2.v, g.d_pair_weights = dpw.v;
  if (bias) b.b1 = b1.v, b.b2 = b2.v, g.db1 = db1.v, g.db2 = db2.v;
  layer_forward(cfg, plan, x.v, w1.v, w2.v, b, out.v, saved, opts);
  const size_t kept = saved.bytes();
  layer_backward(cfg, plan, x.v, w1.v, w2.v, b, d_out.v, saved, g, opts);
  MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  download_outputs(out, dx, dw1, dw2, dpw, t);
  if (bias) db1.download_into(bias->db1), db2.download_into(bias->db2);
  return kept;
}

// The small step the graph and C ABI tests share (256 tokens, d 256, n 128, E 8, K 2, a routing
// with skew and empty experts): fresh inputs in t, the eager keep_h step's results in eager.
struct SmallStep {
  RoutingPlan dev_plan;
  LayerConfig cfg = fp8_config(256, 256, 128, 8, 2, Activation::swiglu);
  LayerTensors t, eager;
  explicit SmallStep(uint64_t seed)
      : dev_plan(device_plan(make_plan(random_routing({256, 8, 2, 1, true}, seed)))),
        t(cfg, dev_plan.S()),
        eager(cfg, dev_plan.S()) {
    t.randomize(seed + 1);
    eager = t;
    run(cfg, dev_plan, eager, LayerMode::keep_h);
  }
};

void poison(LayerTensors& t) {
  for (HostTensor* h : {&t.out, &t.dx, &t.dw1, &t.dw2, &t.d_pair_weights}) h->fill_pattern();
}

struct Case {
  int64_t T, d, n, E, K;
  Activation act;
  bool skew;
};

TEST(Fp8LayerGpu, MatchesTheCpuEmulationAndFloat64InBothModes) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Case& c : {Case{300, 256, 128, 6, 2, Activation::swiglu, false},
                        Case{257, 128, 256, 9, 3, Activation::gelu, true},
                        Case{200, 256, 128, 4, 2, Activation::swiglu_oai, false},
                        Case{256, 128, 128, 5, 2, Activation::relu, true},
                        Case{64, 384, 384, 16, 4, Activation::geglu, true}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" +
                 std::to_string(c.n) + " E=" + std::to_string(c.E) + " " + activation_name(c.act));
    const HostRouting routing =
        random_routing({c.T, c.E, c.K, c.skew ? 2 : 0, c.skew}, rng());
    const RoutingPlan host_plan = make_plan(routing);
    const RoutingPlan dev_plan = device_plan(host_plan);
    const LayerConfig cfg = fp8_config(c.T, c.d, c.n, c.E, c.K, c.act);
    const int64_t S = host_plan.S();
    LayerTensors cpu(cfg, S);
    cpu.randomize(rng());
    LayerTensors keep = cpu, rec = cpu;
    poison(keep);
    poison(rec);
    run(cfg, host_plan, cpu, LayerMode::keep_h);
    const size_t kept = run(cfg, dev_plan, keep, LayerMode::keep_h);
    run(cfg, dev_plan, rec, LayerMode::recompute);
    // Recompute quantizes the recomputed H exactly as forward quantized the kept one.
    expect_same_results(keep, rec);
    EXPECT_EQ(kept, cfg.kept_h_bytes(S));
    EXPECT_LE(double(kept), 0.55 * double(S * cfg.w1_rows() * 2));

    const double dh_tol = c.act == Activation::relu ? kFp8ReluDhTol : kFp8Tol;
    expect_close("out vs cpu", keep.out, cpu.out.to_double(), kGpuVsCpuTol);
    expect_close("dx vs cpu", keep.dx, cpu.dx.to_double(), kGpuVsCpuTol);
    expect_close("dw1 vs cpu", keep.dw1, cpu.dw1.to_double(), kGpuVsCpuTol);
    expect_close("dw2 vs cpu", keep.dw2, cpu.dw2.to_double(), kGpuVsCpuTol);
    const reference::LayerReference ref = reference::reference_layer(
        cfg, routing.view(), cpu.x.view(), cpu.w1.view(), cpu.w2.view(), cpu.d_out.view());
    expect_close("out", keep.out, ref.out, kFp8Tol);
    expect_close("dx", keep.dx, ref.dx, dh_tol);
    expect_close("dw1", keep.dw1, ref.dw1, dh_tol);
    expect_close("dw2", keep.dw2, ref.dw2, kFp8Tol);
    EXPECT_LE(scaled_error(keep.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs),
              kFp8Tol);
    EXPECT_LE(scaled_error(keep.d_pair_weights, cpu.d_pair_weights.to_double(),
                           ref.d_pair_weights_abs),
              kGpuVsCpuTol);
  }
}

// compute fp8_wgrad: the data path is fp8's bit for bit; dW1 and dW2 follow their own CPU
// emulation (closer to it than to fp8's bf16 weight gradients, which they visibly leave), within
// the e4m3 bound of float64, both modes and two runs bitwise equal.
TEST(Fp8LayerGpu, WeightGradientsInFp8FollowTheirEmulation) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Experts with no slot, with fewer than 128 and with several 128-slot groups and a partial one.
  for (const Case& c : {Case{300, 256, 128, 6, 2, Activation::swiglu, true},
                        Case{700, 128, 256, 9, 3, Activation::gelu, true},
                        Case{64, 384, 128, 16, 4, Activation::geglu, true}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" +
                 std::to_string(c.n) + " E=" + std::to_string(c.E) + " " + activation_name(c.act));
    const HostRouting routing = random_routing({c.T, c.E, c.K, 2, c.skew}, rng());
    const RoutingPlan host_plan = make_plan(routing);
    const RoutingPlan dev_plan = device_plan(host_plan);
    LayerConfig wcfg = fp8_config(c.T, c.d, c.n, c.E, c.K, c.act);
    wcfg.compute = Compute::fp8_wgrad;
    const LayerConfig dcfg = fp8_config(c.T, c.d, c.n, c.E, c.K, c.act);
    LayerTensors cpu_w(wcfg, host_plan.S());
    cpu_w.randomize(rng());
    LayerTensors cpu_d = cpu_w, keep = cpu_w, rec = cpu_w, again = cpu_w, data = cpu_w;
    for (LayerTensors* t : {&keep, &rec, &again, &data}) poison(*t);
    run(wcfg, host_plan, cpu_w, LayerMode::keep_h);
    run(dcfg, host_plan, cpu_d, LayerMode::keep_h);
    run(wcfg, dev_plan, keep, LayerMode::keep_h);
    run(wcfg, dev_plan, rec, LayerMode::recompute);
    run(wcfg, dev_plan, again, LayerMode::keep_h);
    run(dcfg, dev_plan, data, LayerMode::keep_h);
    expect_same_results(keep, rec);
    expect_same_results(keep, again);
    EXPECT_TRUE(bitwise_equal(keep.out, data.out));
    EXPECT_TRUE(bitwise_equal(keep.dx, data.dx));
    EXPECT_TRUE(bitwise_equal(keep.d_pair_weights, data.d_pair_weights));
    const reference::LayerReference ref = reference::reference_layer(
        wcfg, routing.view(), cpu_w.x.view(), cpu_w.w1.view(), cpu_w.w2.view(),
        cpu_w.d_out.view());
    for (const auto& [name, gpu, own, other, gpu_data, exact] :
         {std::tuple<const char*, const HostTensor*, const HostTensor*, const HostTensor*,
                     const HostTensor*, const std::vector<double>*>{
              "dw1", &keep.dw1, &cpu_w.dw1, &cpu_d.dw1, &data.dw1, &ref.dw1},
          {"dw2", &keep.dw2, &cpu_w.dw2, &cpu_d.dw2, &data.dw2, &ref.dw2}}) {
      const double to_own = rel_error(*gpu, own->to_double());
      EXPECT_LE(to_own, kGpuVsCpuTol) << name;
      EXPECT_LT(to_own, rel_error(*gpu, other->to_double())) << name;
      EXPECT_GT(rel_error(*gpu, gpu_data->to_double()), 0.005) << name;
      expect_close(name, *gpu, *exact, kFp8Tol);
    }
  }
}

// Backward's transients live in dW2's, dx's and dW1's bytes until those are written: at a shape
// where dX̃ (S, d) is exactly dW1's size (sm-default's S = 2nE), the workspace holds dH (S, R)
// bf16 and its codes and small pieces, not A', dA', dO's codes or dX̃.
TEST(Fp8LayerGpu, BackwardWorkspaceHoldsOnlyWhatOutlivesTheOutputs) {
  MOEBLAZE_REQUIRE_GPU();
  const LayerConfig cfg = fp8_config(2048, 512, 256, 8, 2, Activation::swiglu);
  const int64_t S = cfg.T * cfg.K, R = cfg.w1_rows();
  const size_t ws = layer_workspace_bytes(cfg, S, LayerMode::keep_h, Device::cuda,
                                          LayerPass::backward, false, true);
  const size_t dh = size_t(S * R) * 2, dh_codes = size_t(S * R) + size_t(S * (R / 128)) * 4;
  EXPECT_LE(ws, dh + dh_codes + (size_t(2) << 20)) << "backward workspace " << ws << " bytes";
}

TEST(Fp8LayerGpu, BiasesMatchTheCpuEmulation) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = random_routing({220, 6, 2, 1, true}, seed);
  const RoutingPlan host_plan = make_plan(routing);
  const RoutingPlan dev_plan = device_plan(host_plan);
  const LayerConfig cfg = fp8_config(220, 256, 128, 6, 2, Activation::swiglu);
  LayerTensors cpu(cfg, host_plan.S());
  cpu.randomize(seed + 1);
  LayerTensors gpu = cpu;
  poison(gpu);
  Biases bc;
  bc.b1 = HostTensor(DType::bf16, {cfg.E, cfg.w1_rows()});
  bc.b2 = HostTensor(DType::bf16, {cfg.E, cfg.d});
  bc.b1.fill_random(seed + 2, 0.25f);
  bc.b2.fill_random(seed + 3, 0.25f);
  bc.db1 = HostTensor(DType::bf16, {cfg.E, cfg.w1_rows()});
  bc.db2 = HostTensor(DType::bf16, {cfg.E, cfg.d});
  Biases bg = bc;
  bg.db1.fill_pattern();
  bg.db2.fill_pattern();
  run(cfg, host_plan, cpu, LayerMode::keep_h, &bc);
  run(cfg, dev_plan, gpu, LayerMode::recompute, &bg);
  expect_close("out", gpu.out, cpu.out.to_double(), kGpuVsCpuTol);
  expect_close("dx", gpu.dx, cpu.dx.to_double(), kGpuVsCpuTol);
  expect_close("dw1", gpu.dw1, cpu.dw1.to_double(), kGpuVsCpuTol);
  expect_close("dw2", gpu.dw2, cpu.dw2.to_double(), kGpuVsCpuTol);
  expect_close("db1", bg.db1, bc.db1.to_double(), kGpuVsCpuTol);
  expect_close("db2", bg.db2, bc.db2.to_double(), kGpuVsCpuTol);
  expect_close("d_pair_weights", gpu.d_pair_weights, cpu.d_pair_weights.to_double(),
               2 * kGpuVsCpuTol);
}

TEST(Fp8LayerGpu, BitwiseDeterministicAcrossRuns) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = random_routing({777, 8, 3, 0, true}, seed);
  const RoutingPlan dev_plan = device_plan(make_plan(routing));
  const LayerConfig cfg = fp8_config(777, 256, 256, 8, 3, Activation::swiglu);
  LayerTensors first(cfg, dev_plan.S());
  first.randomize(seed + 1);
  LayerTensors again = first;
  run(cfg, dev_plan, first, LayerMode::keep_h);
  poison(again);
  run(cfg, dev_plan, again, LayerMode::keep_h);
  expect_same_results(first, again);
}

// The FP8 GEMMs on CTA pairs (fp8.cluster=2) compute every tile as single CTAs do, in both
// recipes and both modes: the same bits.
TEST(Fp8LayerGpu, ClustersOfTwoGiveTheBitsOfSingleCtas) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = random_routing({777, 8, 3, 0, true}, seed);
  const RoutingPlan dev_plan = device_plan(make_plan(routing));
  for (const Compute compute : {Compute::fp8, Compute::fp8_wgrad})
    for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
      SCOPED_TRACE(std::string(compute == Compute::fp8 ? "fp8 " : "fp8_wgrad ") +
                   layer_mode_name(mode));
      LayerConfig cfg = fp8_config(777, 384, 384, 8, 3, Activation::swiglu);
      cfg.compute = compute;
      LayerTensors single(cfg, dev_plan.S());
      single.randomize(seed + 1);
      LayerTensors pairs = single;
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides("fp8.cluster=1"));
      run(cfg, dev_plan, single, mode);
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides("fp8.cluster=2"));
      poison(pairs);
      run(cfg, dev_plan, pairs, mode);
      cuda::gemm::clear_kernel_overrides();
      expect_same_results(single, pairs);
    }
}

TEST(Fp8LayerGpu, RefusesDimsThatAreNotMultiplesOf128AndLeavesOutputsUntouched) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const auto& [d, n, name] : {std::tuple<int64_t, int64_t, const char*>{192, 128, "d (192)"},
                                   {128, 192, "n (192)"}}) {
    const HostRouting routing = random_routing({50, 4, 2, 0, false}, seed);
    const RoutingPlan dev_plan = device_plan(make_plan(routing));
    const LayerConfig cfg = fp8_config(50, d, n, 4, 2, Activation::swiglu);
    LayerTensors t(cfg, dev_plan.S());
    t.randomize(seed);
    poison(t);
    DevTensor x(t.x), w1(t.w1), w2(t.w2), out(t.out);
    const HostTensor before = t.out;
    SavedForBackward saved;
    try {
      layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, out.v, saved, LayerOptions{});
      ADD_FAILURE() << name << ": accepted";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("compute fp8 on the GPU: ") + name),
                std::string::npos)
          << e.what();
    }
    out.download_into(t.out);
    EXPECT_TRUE(bitwise_equal(t.out, before)) << name << ": out was written";
  }
}

// The weight cache: the same bits as quantizing in every call; one quantization serves forward
// and backward and every later step until weights_changed() (or other weight pointers).
TEST(Fp8LayerGpu, WeightCacheGivesTheSameBitsAndRequantizesOnlyWhenTold) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = random_routing({300, 6, 2, 1, true}, seed);
  const RoutingPlan dev_plan = device_plan(make_plan(routing));
  const LayerConfig cfg = fp8_config(300, 256, 128, 6, 2, Activation::swiglu);
  LayerTensors t(cfg, dev_plan.S());
  t.randomize(seed + 1);
  LayerTensors other = t;
  other.w1.fill_random(seed + 2, 0.06f);
  other.w2.fill_random(seed + 3, 0.09f);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE(layer_mode_name(mode));
    LayerTensors plain = t, plain_other = other;
    run(cfg, dev_plan, plain, mode);
    run(cfg, dev_plan, plain_other, mode);

    DevTensor x(t.x), w1(t.w1), w2(t.w2), out(t.out), d_out(t.d_out), dx(t.dx), dw1(t.dw1),
        dw2(t.dw2), dpw(t.d_pair_weights);
    LayerGrads g;
    g.dx = dx.v, g.dw1 = dw1.v, g.dw2 = dw2.v, g.d_pair_weights = dpw.v;
    Fp8WeightCache cache;
    LayerOptions opts;
    opts.mode = mode;
    opts.fp8_weights = &cache;
    LayerTensors got = t;
    const auto step = [&] {
      poison(got);
      for (DevTensor* o : {&out, &dx, &dw1, &dw2, &dpw}) o->mem.poison();
      SavedForBackward saved;
      layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, out.v, saved, opts);
      layer_backward(cfg, dev_plan, x.v, w1.v, w2.v, d_out.v, saved, g, opts);
      download_outputs(out, dx, dw1, dw2, dpw, got);
    };
    step();
    expect_same_results(got, plain);
    EXPECT_EQ(cache.quantizations(), 1) << "forward quantizes, backward reuses";
    EXPECT_GE(cache.bytes(), size_t(2 * cfg.E * (cfg.w1_rows() * cfg.d + cfg.d * cfg.n)));
    step();
    expect_same_results(got, plain);
    EXPECT_EQ(cache.quantizations(), 1) << "the next step reuses the codes";
    // New weights written in place: the caller says so, and the next call requantizes.
    w1.mem.upload(other.w1.bytes);
    w2.mem.upload(other.w2.bytes);
    cache.weights_changed();
    step();
    expect_same_results(got, plain_other);
    EXPECT_EQ(cache.quantizations(), 2);
    // Other weight pointers requantize by themselves.
    DevTensor w1b(t.w1), w2b(t.w2);
    SavedForBackward saved;
    layer_forward(cfg, dev_plan, x.v, w1b.v, w2b.v, out.v, saved, opts);
    out.download_into(got.out);
    EXPECT_TRUE(bitwise_equal(got.out, plain.out));
    EXPECT_EQ(cache.quantizations(), 3);
  }
}

// A CUDA graph of one FP8 step (no host sync), on caller memory as the PyTorch front end captures
// it (H and both workspaces given): replayed, it gives the eager step's bits, with the weights
// quantized inside the graph and with a warmed cache.
TEST(Fp8LayerGpu, GraphCapturedStepGivesTheEagerBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const SmallStep step(seed);
  const RoutingPlan& dev_plan = step.dev_plan;
  const LayerConfig& cfg = step.cfg;
  const LayerTensors &t = step.t, &eager = step.eager;

  DevTensor x(t.x), w1(t.w1), w2(t.w2), out(t.out), d_out(t.d_out), dx(t.dx), dw1(t.dw1),
      dw2(t.dw2), dpw(t.d_pair_weights);
  LayerGrads g;
  g.dx = dx.v, g.dw1 = dw1.v, g.dw2 = dw2.v, g.d_pair_weights = dpw.v;
  cudaStream_t s = nullptr;
  MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Fp8WeightCache cache;
  for (bool cached : {false, true}) {
    SCOPED_TRACE(cached ? "warmed cache" : "no cache");
    LayerOptions opts;
    opts.stream = s;
    if (cached) {
      opts.fp8_weights = &cache;
      SavedForBackward warm;  // the cache's codes made before the capture
      layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, out.v, warm, opts);
      MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    for (DevTensor* o : {&out, &dx, &dw1, &dw2, &dpw}) o->mem.poison();
    const int64_t S = dev_plan.S();
    // With a cache the workspaces hold no weight codes: forward's is at least half the codes'
    // 2 E (w1_rows d + d n) bytes smaller; backward's plan may put codes in dW1's and dW2's
    // bytes before those are written, so there the cache saves between nothing and all of them.
    const auto ws_bytes = [&](LayerPass pass, bool with_cache) {
      return layer_workspace_bytes(cfg, S, LayerMode::keep_h, Device::cuda, pass, false,
                                   with_cache);
    };
    const size_t codes = size_t(2 * cfg.E * (cfg.w1_rows() * cfg.d + cfg.d * cfg.n));
    EXPECT_LE(ws_bytes(LayerPass::forward, true) + codes / 2, ws_bytes(LayerPass::forward, false));
    EXPECT_LE(ws_bytes(LayerPass::backward, true), ws_bytes(LayerPass::backward, false));
    EXPECT_LE(ws_bytes(LayerPass::backward, false), ws_bytes(LayerPass::backward, true) + codes);
    DevMem h(cfg.kept_h_bytes(S)), fws(ws_bytes(LayerPass::forward, cached)),
        bws(ws_bytes(LayerPass::backward, cached));
    LayerOptions f = opts, b = opts;
    f.h_storage = h.p, f.workspace = fws.p, f.workspace_bytes = fws.bytes;
    b.workspace = bws.p, b.workspace_bytes = bws.bytes;
    cudaGraph_t graph = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    {
      SavedForBackward saved;
      layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, out.v, saved, f);
      layer_backward(cfg, dev_plan, x.v, w1.v, w2.v, d_out.v, saved, g, b);
    }
    MOEBLAZE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MOEBLAZE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
    LayerTensors got = t;
    download_outputs(out, dx, dw1, dw2, dpw, got);
    expect_same_results(got, eager);
    MOEBLAZE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEBLAZE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  EXPECT_EQ(cache.quantizations(), 1);
  MOEBLAZE_CUDA_CHECK(cudaStreamDestroy(s));
}

// The C ABI's caches (moeblaze_fp8_weight_cache_*, cfg.fp8_weights), as the PyTorch front end
// calls them: caller workspaces sized with the cache (smaller), the no-cache call's bits, one
// quantization for forward and backward and the next step, a second after weights_changed.
TEST(Fp8LayerGpu, CAbiCacheQuantizesOnceAndGivesTheBitsOfNoCache) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  SmallStep small(seed);
  RoutingPlan& dev_plan = small.dev_plan;
  const LayerConfig& cfg = small.cfg;
  const LayerTensors &t = small.t, &plain = small.eager;

  DevTensor x(t.x), w1(t.w1), w2(t.w2), out(t.out), d_out(t.d_out), dx(t.dx), dw1(t.dw1),
      dw2(t.dw2), dpw(t.d_pair_weights);
  RoutingPlan& p = dev_plan;
  const moeblaze_plan cp{p.T(), p.E(), p.S(), p.expert_token_offsets(),
                         p.expert_token_indices(), p.slot_weights(), p.token_pair_offsets(),
                         p.token_expert_indices(), p.token_index_map()};
  void* cache = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&cache), MOEBLAZE_OK);
  moeblaze_layer_cfg c{cfg.T, cfg.d, cfg.n, cfg.E, cfg.K, 0, 1, 2, 0, 1, cache};  // dH over h
  uint64_t h_bytes = 0, fwd = 0, bwd = 0, fwd_plain = 0;
  ASSERT_EQ(moeblaze_layer_kept_h_bytes(&c, cp.S, &h_bytes), MOEBLAZE_OK);
  ASSERT_EQ(moeblaze_layer_pass_workspace_bytes(&c, cp.S, 1, 0, &fwd), MOEBLAZE_OK);
  ASSERT_EQ(moeblaze_layer_pass_workspace_bytes(&c, cp.S, 1, 1, &bwd), MOEBLAZE_OK);
  c.fp8_weights = nullptr;
  ASSERT_EQ(moeblaze_layer_pass_workspace_bytes(&c, cp.S, 1, 0, &fwd_plain), MOEBLAZE_OK);
  c.fp8_weights = cache;
  EXPECT_LT(fwd, fwd_plain);
  DevMem h(h_bytes), fws(fwd), bws(bwd);
  LayerTensors got = t;
  int64_t quantizations = 0;
  uint64_t bytes = 0;
  const auto step = [&] {
    for (DevTensor* o : {&out, &dx, &dw1, &dw2, &dpw}) o->mem.poison();
    ASSERT_EQ(moeblaze_layer_forward(&c, &cp, 1, nullptr, x.mem.p, w1.mem.p, w2.mem.p, out.mem.p,
                                     h.p, fws.p, fws.bytes),
              MOEBLAZE_OK)
        << moeblaze_last_error();
    ASSERT_EQ(moeblaze_layer_backward(&c, &cp, 1, nullptr, x.mem.p, w1.mem.p, w2.mem.p,
                                      d_out.mem.p, h.p, dx.mem.p, dw1.mem.p, dw2.mem.p,
                                      static_cast<float*>(dpw.mem.p), bws.p, bws.bytes),
              MOEBLAZE_OK)
        << moeblaze_last_error();
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    download_outputs(out, dx, dw1, dw2, dpw, got);
    ASSERT_EQ(moeblaze_fp8_weight_cache_stats(cache, &bytes, &quantizations), MOEBLAZE_OK);
  };
  step();
  expect_same_results(got, plain);
  EXPECT_EQ(quantizations, 1);
  EXPECT_GE(bytes, uint64_t(2 * cfg.E * (cfg.w1_rows() * cfg.d + cfg.d * cfg.n)));
  step();
  expect_same_results(got, plain);
  EXPECT_EQ(quantizations, 1);
  ASSERT_EQ(moeblaze_fp8_weight_cache_weights_changed(cache), MOEBLAZE_OK);
  step();
  expect_same_results(got, plain);
  EXPECT_EQ(quantizations, 2);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(cache), MOEBLAZE_OK);
}

}  // namespace
}  // namespace moeblaze::test
