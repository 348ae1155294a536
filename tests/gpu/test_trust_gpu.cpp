// Trust on the GPU beyond the shapes: device memory running out, streams, concurrency and
// non-finite values.
//  - Out of memory (most of the free memory held by the test, the pool trimmed): a forward whose
//    H or workspace allocation fails and a backward whose workspace allocation fails throw
//    DeviceError naming the failed allocation, leave every output untouched, hold no library
//    bytes beyond what they held before, and the next call (smaller, or the same once memory is
//    back) gives the bits of the same step run alone.
//  - Streams: a step on a non-blocking stream waiting on a slow producer of x (a host function
//    sleeping on the producer's stream before x is copied) gives the eager bits; a step captured
//    in a CUDA graph on a side stream with library-owned workspaces replays to the eager bits.
//  - Concurrency: two host threads running steps of different shapes on their own streams, and
//    two layers interleaved on one stream, give the bits of each step run alone.
//  - Non-finite values (the policy: tests/cpu/test_nonfinite.cpp's header): NaN / inf / -inf in
//    x, w1, w2 or d_out give the CPU backend's non-finite elements and its finite ones within
//    tolerance, with no hang, and a clean step afterwards gives the clean bits; NaN / inf router
//    logits raise the non-finite flag, keep every expert id in range, and a plan built from the
//    routing is valid wherever the build raised no flag.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/nonfinite_fixtures.hpp"
#include "common/test_util.hpp"
#include "gpu/gpu_layer_util.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze::test {
namespace {

// ---- a step's tensors on the device ---------------------------------------------------------------

// One layer problem: config, routing, plans on both devices, host inputs.
struct Problem {
  LayerConfig cfg;
  HostRouting routing;
  RoutingPlan host_plan, dev_plan;
  LayerTensors t;
  Problem(const LayerConfig& c, uint64_t seed)
      : cfg(c),
        routing(random_routing({c.T, c.E, c.K, c.E > c.K ? 1 : 0, true}, seed)),
        host_plan(make_plan(routing)),
        dev_plan(device_plan(host_plan)),
        t(c, host_plan.S()) {
    t.randomize(seed + 1);
  }
};

LayerConfig config(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, Activation act) {
  return LayerConfig{T, d, n, E, K, act, DType::bf16};
}

// The inputs and outputs of a step in device memory (outputs poisoned: NaN bytes).
struct DeviceStep {
  DevTensor x, w1, w2, d_out, out, dx, dw1, dw2, dpw;
  explicit DeviceStep(const LayerTensors& t)
      : x(t.x), w1(t.w1), w2(t.w2), d_out(t.d_out), out(t.out), dx(t.dx), dw1(t.dw1),
        dw2(t.dw2), dpw(t.d_pair_weights) {
    for (DevTensor* o : {&out, &dx, &dw1, &dw2, &dpw}) o->mem.poison();
    // The poison runs on the legacy stream, which a non-blocking stream does not wait for.
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  LayerGrads grads() const {
    LayerGrads g;
    g.dx = dx.v, g.dw1 = dw1.v, g.dw2 = dw2.v, g.d_pair_weights = dpw.v;
    return g;
  }
  void forward(const Problem& p, SavedForBackward& saved, const LayerOptions& o) const {
    layer_forward(p.cfg, p.dev_plan, x.v, w1.v, w2.v, out.v, saved, o);
  }
  void backward(const Problem& p, const SavedForBackward& saved, const LayerOptions& o) const {
    layer_backward(p.cfg, p.dev_plan, x.v, w1.v, w2.v, d_out.v, saved, grads(), o);
  }
  // The outputs on the host, after the device is done.
  LayerTensors results(const Problem& p) const {
    LayerTensors r = p.t;
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    out.download_into(r.out);
    dx.download_into(r.dx);
    dw1.download_into(r.dw1);
    dw2.download_into(r.dw2);
    dpw.download_into(r.d_pair_weights);
    return r;
  }
  // True when no byte of any output was written (all still 0xFF).
  bool untouched() const {
    for (const DevTensor* o : {&out, &dx, &dw1, &dw2, &dpw})
      for (uint8_t b : o->mem.download<uint8_t>())
        if (b != 0xFF) return false;
    return true;
  }
  bool grads_untouched() const {
    for (const DevTensor* o : {&dx, &dw1, &dw2, &dpw})
      for (uint8_t b : o->mem.download<uint8_t>())
        if (b != 0xFF) return false;
    return true;
  }
};

LayerOptions on(cudaStream_t s, LayerMode mode) {
  LayerOptions o;
  o.mode = mode;
  o.stream = s;
  return o;
}

// The step alone on the legacy default stream, library memory.
LayerTensors alone(const Problem& p, LayerMode mode) {
  DeviceStep dev(p.t);
  SavedForBackward saved;
  dev.forward(p, saved, on(nullptr, mode));
  dev.backward(p, saved, on(nullptr, mode));
  return dev.results(p);
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// ---- out of memory ------------------------------------------------------------------------------

// Holds all but `leave` bytes of the device's free memory (after returning the pool's cached
// memory to the driver, so the library's next allocation must come from what is left).
struct MemoryHog {
  std::vector<void*> blocks;
  explicit MemoryHog(size_t leave) {
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    trim_pool();
    size_t free_b = 0, total = 0;
    MOEBLAZE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    // In 256 MiB blocks, then smaller: one huge cudaMalloc can fail on fragmentation.
    for (size_t chunk = size_t(256) << 20; chunk >= (size_t(1) << 20); chunk /= 2) {
      while (true) {
        MOEBLAZE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
        if (free_b < leave + chunk) break;
        void* p = nullptr;
        if (cudaMalloc(&p, chunk) != cudaSuccess) {
          (void)cudaGetLastError();
          break;
        }
        blocks.push_back(p);
      }
    }
  }
  ~MemoryHog() {
    for (void* p : blocks) cudaFree(p);
    cudaDeviceSynchronize();
    trim_pool();
  }
  static void trim_pool() {
    int dev = 0;
    MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
    cudaMemPool_t pool;
    MOEBLAZE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    MOEBLAZE_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  }
};

void expect_out_of_memory(const std::function<void()>& fn) {
  try {
    fn();
    ADD_FAILURE() << "the call succeeded with the device memory held";
  } catch (const DeviceError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cudaMallocAsync of "), std::string::npos) << m;
    EXPECT_NE(m.find("failed"), std::string::npos) << m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected DeviceError, got: " << e.what();
  }
}

TEST(TrustGpu, OutOfMemoryThrowsLeavesOutputsUntouchedLeaksNothingAndTheNextCallWorks) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // H of the big step is 64 MiB, its workspaces more: neither fits in the 8 MiB left.
  const Problem big(config(8192, 1024, 512, 16, 4, Activation::swiglu), seed);
  const Problem small(config(33, 128, 128, 4, 2, Activation::swiglu), seed + 7);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE(layer_mode_name(mode));
    const LayerTensors big_alone = alone(big, mode), small_alone = alone(small, mode);
    const size_t library_before = memory_stats(Device::cuda).current;

    // Forward: keep_h's H allocation fails, recompute's workspace.
    {
      DeviceStep dev(big.t), dev_small(small.t);
      SavedForBackward saved;
      {
        const MemoryHog hog(size_t(8) << 20);
        expect_out_of_memory([&] { dev.forward(big, saved, on(nullptr, mode)); });
        EXPECT_FALSE(saved.valid());
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(memory_stats(Device::cuda).current, library_before) << "forward leaked";
      }
      EXPECT_TRUE(dev.untouched()) << "an output was written by the failed forward";
      // The next call, smaller, works and gives the bits of that step alone.
      SavedForBackward s2;
      dev_small.forward(small, s2, on(nullptr, mode));
      dev_small.backward(small, s2, on(nullptr, mode));
      expect_same_results(dev_small.results(small), small_alone);
    }
    // Backward: forward succeeds, then backward's workspace allocation fails; once the memory
    // is back the same backward (same saved) gives the step's bits.
    {
      DeviceStep dev(big.t);
      SavedForBackward saved;
      dev.forward(big, saved, on(nullptr, mode));
      MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
      const size_t after_forward = memory_stats(Device::cuda).current;
      {
        const MemoryHog hog(size_t(8) << 20);
        expect_out_of_memory([&] { dev.backward(big, saved, on(nullptr, mode)); });
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(memory_stats(Device::cuda).current, after_forward) << "backward leaked";
      }
      EXPECT_TRUE(dev.grads_untouched()) << "a gradient was written by the failed backward";
      dev.backward(big, saved, on(nullptr, mode));
      expect_same_results(dev.results(big), big_alone);
    }
    EXPECT_EQ(memory_stats(Device::cuda).current, library_before);
  }
}

// ---- streams --------------------------------------------------------------------------------------

void sleep_200ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

TEST(TrustGpu, StepWaitingOnASlowProducerOfXGivesTheEagerBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem p(config(1000, 256, 256, 16, 4, Activation::swiglu), seed);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE(layer_mode_name(mode));
    const LayerTensors eager = alone(p, mode);
    DeviceStep dev(p.t);
    MOEBLAZE_CUDA_CHECK(cudaMemset(dev.x.mem.p, 0, dev.x.mem.bytes));  // a race reads zeros
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    void* pinned = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaMallocHost(&pinned, p.t.x.bytes.size()));
    std::memcpy(pinned, p.t.x.bytes.data(), p.t.x.bytes.size());
    {
      const Stream producer, consumer;
      cudaEvent_t ready;
      MOEBLAZE_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      MOEBLAZE_CUDA_CHECK(cudaLaunchHostFunc(producer.s, sleep_200ms, nullptr));
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(dev.x.mem.p, pinned, p.t.x.bytes.size(),
                                          cudaMemcpyHostToDevice, producer.s));
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(ready, producer.s));
      MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(consumer.s, ready, 0));
      SavedForBackward saved;
      dev.forward(p, saved, on(consumer.s, mode));
      dev.backward(p, saved, on(consumer.s, mode));
      MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(consumer.s));
      MOEBLAZE_CUDA_CHECK(cudaEventDestroy(ready));
    }
    MOEBLAZE_CUDA_CHECK(cudaFreeHost(pinned));
    expect_same_results(dev.results(p), eager);
  }
}

TEST(TrustGpu, GraphCapturedOnASideStreamWithLibraryWorkspacesReplaysTheEagerBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem p(config(700, 256, 128, 8, 2, Activation::gelu), seed);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE(layer_mode_name(mode));
    const LayerTensors eager = alone(p, mode);
    DeviceStep dev(p.t);
    DevMem h(mode == LayerMode::keep_h ? p.cfg.kept_h_bytes(p.host_plan.S()) : 0);
    const Stream side;
    LayerOptions o = on(side.s, mode);
    o.h_storage = h.p;  // H outlives the capture; the workspaces are the library's, in-graph
    cudaGraph_t graph = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaStreamBeginCapture(side.s, cudaStreamCaptureModeThreadLocal));
    {
      SavedForBackward saved;
      dev.forward(p, saved, o);
      LayerOptions b = o;
      b.h_storage = nullptr;
      dev.backward(p, saved, b);
    }
    MOEBLAZE_CUDA_CHECK(cudaStreamEndCapture(side.s, &graph));
    cudaGraphExec_t exec = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) MOEBLAZE_CUDA_CHECK(cudaGraphLaunch(exec, side.s));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(side.s));
    MOEBLAZE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEBLAZE_CUDA_CHECK(cudaGraphDestroy(graph));
    expect_same_results(dev.results(p), eager);
  }
}

// ---- concurrency ----------------------------------------------------------------------------------

TEST(TrustGpu, TwoThreadsOnTheirOwnStreamsGiveTheBitsOfEachStepAlone) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem a(config(3001, 512, 256, 32, 4, Activation::swiglu), seed);
  const Problem b(config(777, 256, 512, 8, 2, Activation::gelu), seed + 11);
  const LayerTensors a_alone = alone(a, LayerMode::keep_h);
  const LayerTensors b_alone = alone(b, LayerMode::recompute);
  std::atomic<int> mismatches{0}, errors{0};
  std::string first_error;
  std::atomic<bool> error_taken{false};
  const auto worker = [&](const Problem& p, LayerMode mode, const LayerTensors& ref) {
    try {
      const Stream s;
      for (int rep = 0; rep < 4; ++rep) {
        DeviceStep dev(p.t);
        SavedForBackward saved;
        dev.forward(p, saved, on(s.s, mode));
        dev.backward(p, saved, on(s.s, mode));
        MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s.s));
        const LayerTensors got = dev.results(p);
        if (!(bitwise_equal(got.out, ref.out) && bitwise_equal(got.dx, ref.dx) &&
              bitwise_equal(got.dw1, ref.dw1) && bitwise_equal(got.dw2, ref.dw2) &&
              bitwise_equal(got.d_pair_weights, ref.d_pair_weights)))
          ++mismatches;
      }
    } catch (const std::exception& e) {
      ++errors;
      if (!error_taken.exchange(true)) first_error = e.what();
    }
  };
  std::thread ta(worker, std::cref(a), LayerMode::keep_h, std::cref(a_alone));
  std::thread tb(worker, std::cref(b), LayerMode::recompute, std::cref(b_alone));
  ta.join();
  tb.join();
  EXPECT_EQ(errors.load(), 0) << first_error;
  EXPECT_EQ(mismatches.load(), 0) << "steps on two threads differ from the same steps alone";
}

TEST(TrustGpu, TwoLayersInterleavedOnOneStreamGiveTheBitsOfEachAlone) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem a(config(2049, 256, 256, 16, 2, Activation::swiglu), seed);
  const Problem b(config(513, 384, 128, 64, 8, Activation::relu), seed + 5);
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE(layer_mode_name(mode));
    const LayerTensors a_alone = alone(a, mode), b_alone = alone(b, mode);
    DeviceStep da(a.t), db(b.t);
    const Stream s;
    SavedForBackward sa, sb;
    da.forward(a, sa, on(s.s, mode));
    db.forward(b, sb, on(s.s, mode));
    da.backward(a, sa, on(s.s, mode));
    db.backward(b, sb, on(s.s, mode));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s.s));
    expect_same_results(da.results(a), a_alone);
    expect_same_results(db.results(b), b_alone);
  }
}

// ---- non-finite values -----------------------------------------------------------------------------

// Planted non-finite inputs on the GPU against the CPU backend (for FP8, its emulation): the same
// non-finite elements, the finite ones within tolerance, and afterwards a clean step's bits.
void nonfinite_round(Compute compute, double tolerance) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (Activation act : {Activation::swiglu, Activation::gelu, Activation::relu,
                         Activation::relu2, Activation::swiglu_oai})
    for (PlantIn where : {PlantIn::x, PlantIn::w1, PlantIn::w2, PlantIn::d_out})
      for (float value : nonfinite_values()) {
        LayerConfig cfg = config(200, 128, 128, 8, 2, act);
        cfg.compute = compute;
        const Problem clean(cfg, rng());
        const LayerTensors clean_bits = alone(clean, LayerMode::keep_h);
        LayerTensors planted = clean.t;
        const int64_t count = where == PlantIn::x    ? planted.x.numel()
                              : where == PlantIn::w1 ? planted.w1.numel()
                              : where == PlantIn::w2 ? planted.w2.numel()
                                                     : planted.d_out.numel();
        const Plant pl{where, int64_t(rng() % uint64_t(count)), value};
        plant(planted, pl);
        SCOPED_TRACE(std::string(activation_name(act)) + " " + pl.describe());
        for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
          SCOPED_TRACE(layer_mode_name(mode));
          DeviceStep dev(planted);
          SavedForBackward saved;
          dev.forward(clean, saved, on(nullptr, mode));
          dev.backward(clean, saved, on(nullptr, mode));
          const LayerTensors gpu = dev.results(clean);
          LayerTensors cpu = planted;
          run_layer(cfg, clean.host_plan, cpu, {mode, 0});
          const reference::LayerReference ref = reference::reference_layer(
              cfg, clean.routing.view(), planted.x.view(), planted.w1.view(), planted.w2.view(),
              planted.d_out.view());
          expect_nonfinite_like(gpu, cpu.out.to_double(), cpu.dx.to_double(),
                                cpu.dw1.to_double(), cpu.dw2.to_double(),
                                cpu.d_pair_weights.to_double(), ref.d_pair_weights_abs,
                                tolerance);
        }
        // Nothing left behind: the clean step afterwards gives the clean bits.
        expect_same_results(alone(clean, LayerMode::keep_h), clean_bits);
      }
}

TEST(TrustGpu, NonFiniteInputsGiveTheCpuBackendsNonFiniteElements) {
  MOEBLAZE_REQUIRE_GPU();
  // GPU against the CPU backend, both bf16, each within rel_tolerance of float64: their
  // difference is bounded by twice that.
  nonfinite_round(Compute::storage, 2 * rel_tolerance(DType::bf16));
}

TEST(TrustGpu, NonFiniteInputsUnderFp8GiveTheCpuEmulationsNonFiniteElements) {
  MOEBLAZE_REQUIRE_GPU();
  // The GPU against the CPU emulation of the recipe: tests/gpu/test_layer_fp8_gpu.cpp's bound.
  nonfinite_round(Compute::fp8, 0.05);
}

// NaN / inf logits on the GPU router (C ABI): the non-finite flag, expert ids in [0, E) (so a
// plan build reads nothing out of bounds), and a plan that validates wherever its build raised
// no flag. Single entries, whole rows and every logit.
TEST(TrustGpu, NonFiniteLogitsRaiseTheFlagAndKeepExpertIdsInRange) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 300, E = 16, K = 4, P = T * K;
  const std::vector<float> base = random_normal(T * E, seed);
  for (int kind = 0; kind < 3; ++kind)  // router kinds 0, 1, 2 (2: sigmoid_bias)
    for (float bad : nonfinite_values())
      for (int spread = 0; spread < 3; ++spread) {  // one logit, a whole row, all
        SCOPED_TRACE("router " + std::to_string(kind) + " value " + std::to_string(bad) +
                     " spread " + std::to_string(spread));
        std::vector<float> logits = base;
        if (spread == 0) logits[17 * E + 3] = bad;
        if (spread == 1)
          for (int64_t e = 0; e < E; ++e) logits[40 * E + e] = bad;
        if (spread == 2) std::fill(logits.begin(), logits.end(), bad);
        DevMem d_logits(logits), bias(std::vector<float>(E, 0.1f)), flags(4 * 4),
            offsets(4 * (T + 1)), experts(4 * P), weights(4 * P);
        MOEBLAZE_TEST_CUDA(cudaMemset(flags.p, 0, flags.bytes));
        const moeblaze_router_cfg rc{kind, int32_t(K), 0};
        const moeblaze_routing out{T, E, P, offsets.as<int32_t>(), experts.as<int32_t>(),
                                   weights.as<float>()};
        ASSERT_EQ(moeblaze_route(&rc, d_logits.p, 0, T, E, kind == 2 ? bias.as<float>() : nullptr,
                                 1, nullptr, &out, flags.as<int32_t>()),
                  MOEBLAZE_OK)
            << moeblaze_last_error();
        const std::vector<int32_t> f = flags.download<int32_t>();
        EXPECT_EQ(f[2], 1) << "the non-finite flag";
        for (int32_t e : experts.download<int32_t>()) ASSERT_TRUE(e >= 0 && e < E) << e;
        EXPECT_EQ(moeblaze_routing_flags_error(f.data(), nullptr, 1),
                  MOEBLAZE_ERR_INVALID_ARGUMENT);
        // A plan from this routing: no hang, and valid wherever its build raised no flag.
        DevMem pe(4 * (E + 1)), pi(4 * P), pw(4 * P), pt(4 * (T + 1)), px(4 * P), pm(4 * P),
            bflags(4 * 4);
        MOEBLAZE_TEST_CUDA(cudaMemset(bflags.p, 0, bflags.bytes));
        uint64_t ws_bytes = 0;
        ASSERT_EQ(moeblaze_plan_workspace_bytes(T, E, P, 1, &ws_bytes), MOEBLAZE_OK);
        DevMem ws(ws_bytes);
        const moeblaze_plan plan{T, E, P, pe.as<int32_t>(), pi.as<int32_t>(), pw.as<float>(),
                                 pt.as<int32_t>(), px.as<int32_t>(), pm.as<int32_t>()};
        ASSERT_EQ(moeblaze_build_plan(&out, 1, nullptr, &plan, ws.p, ws_bytes,
                                      bflags.as<int32_t>()),
                  MOEBLAZE_OK)
            << moeblaze_last_error();
        const std::vector<int32_t> bf = bflags.download<int32_t>();
        if (bf[0] == 0 && bf[1] == 0 && bf[2] == 0 && bf[3] == 0)
          EXPECT_EQ(moeblaze_validate_plan_sync(&plan, 1, nullptr), MOEBLAZE_OK)
              << moeblaze_last_error();
        MOEBLAZE_TEST_CUDA(cudaDeviceSynchronize());
      }
}

}  // namespace
}  // namespace moeblaze::test
