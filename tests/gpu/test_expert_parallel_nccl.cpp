// Expert parallelism over NCCL: one process, one thread per GPU, ncclCommInitAll over the first W
// visible GPUs (W = 2, 4, 8 as available), against the single-GPU layer on the concatenated
// problem (bf16, the CUDA layer's dtype). Skips with "skipped: needs >= 2 GPUs" otherwise.
// Run through scripts/ep_nccl_check.sh (exports NCCL_NVLS_ENABLE=0, sets a timeout).
//
// Asserted: every output and gradient within bf16 rounding of the single-GPU layer (relative
// Frobenius <= 1e-2, test_util's bf16 bound; out/dx of tokens spread over ranks add per-rank bf16
// partials), unwritten elements caught by a NaN poison; a bad argument on one rank fails every
// rank (no hang). Printed: which results are bitwise equal and each rank's exchange share.
// The chunked case (EpOptions::chunks = 2, 4: the stream-ordered pipeline) is checked against
// the single-GPU layer the same way and compared with chunks = 1 (printed).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "cuda/cuda_backend.hpp"
#include "moeblaze/expert_parallel.hpp"
#include "moeblaze/moeblaze.hpp"

#ifdef MOEBLAZE_WITH_NCCL
#include <nccl.h>
#endif

namespace moeblaze::test {
namespace {

#ifdef MOEBLAZE_WITH_NCCL

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Device memory owned by the test (the caller's tensors), on the current device.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t b) : bytes(b) {
    if (b) MOEBLAZE_CUDA_CHECK(cudaMalloc(&p, b));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  static DevBuf from(const HostTensor& t) {
    DevBuf b(t.bytes.size());
    if (b.bytes) MOEBLAZE_CUDA_CHECK(cudaMemcpy(b.p, t.bytes.data(), b.bytes, cudaMemcpyHostToDevice));
    return b;
  }
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  void poison() {  // 0xFF: NaN in bf16 and fp32
    if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemset(p, 0xFF, bytes));
  }
  void download(HostTensor& t) const {
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemcpy(t.bytes.data(), p, bytes, cudaMemcpyDeviceToHost));
  }
  TensorView view(const HostTensor& like) const {
    TensorView v = like.view();
    v.data = p;
    v.device = Device::cuda;
    return v;
  }
};

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

// K distinct experts per token, weights in [0.05, 1); one_rank: all inside one rank's block.
HostRouting make_routing(int64_t T, int64_t E, int64_t K, int W, bool one_rank,
                         std::mt19937_64& rng) {
  const int64_t El = E / W;
  HostRouting r;
  r.T = T;
  r.E = E;
  r.offsets.assign(static_cast<size_t>(T + 1), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[t] = static_cast<int32_t>(r.experts.size());
    int64_t lo = 0, hi = E;
    if (one_rank) {
      lo = std::uniform_int_distribution<int64_t>(0, W - 1)(rng) * El;
      hi = lo + El;
    }
    std::vector<int32_t> chosen;
    while (static_cast<int64_t>(chosen.size()) < K) {
      const int32_t e = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng));
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int32_t e : chosen) {
      r.experts.push_back(e);
      r.weights.push_back(wdist(rng));
    }
  }
  r.offsets[T] = static_cast<int32_t>(r.experts.size());
  return r;
}

// The single-GPU layer (device 0) on the whole problem.
void single_gpu(const LayerConfig& cfg, const HostRouting& routing, LayerTensors& t) {
  MOEBLAZE_CUDA_CHECK(cudaSetDevice(0));
  Routing dr(Device::cuda, routing.T, routing.E, routing.P());
  MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_offsets(), routing.offsets.data(),
                                 4 * routing.offsets.size(), cudaMemcpyHostToDevice));
  if (routing.P() > 0) {
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_experts(), routing.experts.data(),
                                   4 * routing.experts.size(), cudaMemcpyHostToDevice));
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_weights(), routing.weights.data(),
                                   4 * routing.weights.size(), cudaMemcpyHostToDevice));
  }
  RoutingPlan plan;
  build_routing_plan(dr.view(), PlanBuilder::atomic_free, plan);
  DevBuf x = DevBuf::from(t.x), w1 = DevBuf::from(t.w1), w2 = DevBuf::from(t.w2),
         d_out = DevBuf::from(t.d_out), out(t.out.bytes.size()), dx(t.dx.bytes.size()),
         dw1(t.dw1.bytes.size()), dw2(t.dw2.bytes.size()), dpw(t.d_pair_weights.bytes.size());
  SavedForBackward saved;
  layer_forward(cfg, plan, x.view(t.x), w1.view(t.w1), w2.view(t.w2), out.view(t.out), saved);
  LayerGrads g{dx.view(t.dx), dw1.view(t.dw1), dw2.view(t.dw2), dpw.view(t.d_pair_weights)};
  layer_backward(cfg, plan, x.view(t.x), w1.view(t.w1), w2.view(t.w2), d_out.view(t.d_out), saved,
                 g);
  out.download(t.out);
  dx.download(t.dx);
  dw1.download(t.dw1);
  dw2.download(t.dw2);
  dpw.download(t.d_pair_weights);
}

struct RankResult {
  HostTensor out, dx, dw1, dw2, dpw;
  std::string error;
  bool remote_error = false;
  EpTimings fwd, bwd;
};

// Runs ep_forward + ep_backward on W GPUs, one thread each. `bad_w1_rank` >= 0 gives that rank a
// w1 of the wrong shape (the collective argument check).
std::vector<RankResult> run_ep(int W, const LayerConfig& cfg, const std::vector<HostRouting>& rt,
                               const std::vector<int64_t>& t_off, const LayerTensors& global,
                               int bad_w1_rank = -1, int chunks = 1) {
  const int64_t El = cfg.E / W;
  std::vector<ncclComm_t> comms(static_cast<size_t>(W));
  std::vector<int> devs(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) devs[r] = r;
  if (ncclCommInitAll(comms.data(), W, devs.data()) != ncclSuccess)
    throw DeviceError("ncclCommInitAll failed");
  std::vector<RankResult> res(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      RankResult& rr = res[r];
      try {
        MOEBLAZE_CUDA_CHECK(cudaSetDevice(r));
        cudaStream_t stream;
        MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        {
          std::unique_ptr<Transport> tr = make_nccl_transport(comms[r], stream);
          LayerConfig c = cfg;
          c.T = rt[r].T;
          const HostTensor hx = slice_rows(global.x, t_off[r], c.T);
          const HostTensor hdo = slice_rows(global.d_out, t_off[r], c.T);
          // The bad rank's w1 holds one expert too many (rows from 0, so it stays inside E).
          const HostTensor hw1 = r == bad_w1_rank ? slice_rows(global.w1, 0, El + 1)
                                                  : slice_rows(global.w1, r * El, El);
          const HostTensor hw2 = slice_rows(global.w2, r * El, El);
          rr.out = HostTensor(cfg.dtype, {c.T, cfg.d});
          rr.dx = HostTensor(cfg.dtype, {c.T, cfg.d});
          rr.dw1 = HostTensor(cfg.dtype, {El, cfg.w1_rows(), cfg.d});
          rr.dw2 = HostTensor(cfg.dtype, hw2.shape);
          rr.dpw = HostTensor(DType::f32, {rt[r].P()});
          DevBuf x = DevBuf::from(hx), d_out = DevBuf::from(hdo), w1 = DevBuf::from(hw1),
                 w2 = DevBuf::from(hw2), out(rr.out.bytes.size()), dx(rr.dx.bytes.size()),
                 dw1(rr.dw1.bytes.size()), dw2(rr.dw2.bytes.size()), dpw(rr.dpw.bytes.size());
          for (DevBuf* b : {&out, &dx, &dw1, &dw2, &dpw}) b->poison();
          EpOptions o;
          o.layer.stream = stream;
          o.chunks = chunks;
          EpSaved saved;
          // Twice: the second call's timings are the ones kept (the first pays for NCCL setup).
          for (int rep = 0; rep < 2; ++rep) {
            o.timings = &rr.fwd;
            ep_forward(*tr, c, rt[r].view(), x.view(hx), w1.view(hw1), w2.view(hw2),
                       out.view(rr.out), saved, o);
            o.timings = &rr.bwd;
            EpGrads g{dx.view(rr.dx), dw1.view(rr.dw1), dw2.view(rr.dw2), dpw.view(rr.dpw)};
            ep_backward(*tr, c, w1.view(hw1), w2.view(hw2), d_out.view(hdo), saved, g, o);
          }
          out.download(rr.out);
          dx.download(rr.dx);
          dw1.download(rr.dw1);
          dw2.download(rr.dw2);
          dpw.download(rr.dpw);
        }
        MOEBLAZE_CUDA_CHECK(cudaStreamDestroy(stream));
      } catch (const RemoteRankError& e) {
        rr.error = e.what();
        rr.remote_error = true;
      } catch (const std::exception& e) {
        rr.error = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  return res;
}

// A problem over W ranks and its single-GPU results. Rank sizes in [200, 700]; in the spread
// case the last rank has no tokens, and rank 0 has `small_rank0` tokens when that is >= 0.
struct Case {
  LayerConfig cfg;
  std::vector<HostRouting> rt;
  std::vector<int64_t> t_off = {0};
  std::unique_ptr<LayerTensors> ref;
};

Case make_case(int W, bool one_rank, uint64_t seed, int64_t small_rank0 = -1) {
  Case k;
  std::mt19937_64 rng(seed);
  LayerConfig& cfg = k.cfg;
  cfg.d = 256;
  cfg.n = 128;
  cfg.E = 4 * W;
  cfg.K = one_rank ? 2 : 3;
  cfg.activation = Activation::swiglu;
  cfg.dtype = DType::bf16;
  HostRouting global;
  global.E = cfg.E;
  global.offsets = {0};
  for (int r = 0; r < W; ++r) {
    // The last rank has no tokens in the spread case.
    int64_t T = (!one_rank && r == W - 1) ? 0 : std::uniform_int_distribution<int64_t>(200, 700)(rng);
    if (r == 0 && small_rank0 >= 0) T = small_rank0;
    k.rt.push_back(make_routing(T, cfg.E, cfg.K, W, one_rank, rng));
    for (int64_t t = 0; t < T; ++t)
      global.offsets.push_back(static_cast<int32_t>(global.experts.size()) + k.rt[r].offsets[t + 1]);
    global.experts.insert(global.experts.end(), k.rt[r].experts.begin(), k.rt[r].experts.end());
    global.weights.insert(global.weights.end(), k.rt[r].weights.begin(), k.rt[r].weights.end());
    k.t_off.push_back(k.t_off.back() + T);
  }
  global.T = k.t_off.back();
  cfg.T = global.T;
  k.ref = std::make_unique<LayerTensors>(cfg, global.P());
  k.ref->randomize(seed ^ 0x5bd1e995u);
  single_gpu(cfg, global, *k.ref);
  return k;
}

void run_case(int W, bool one_rank, uint64_t seed) {
  SCOPED_TRACE(std::string("W ") + std::to_string(W) + (one_rank ? " one-rank" : " spread") +
               " seed " + std::to_string(seed));
  const Case k = make_case(W, one_rank, seed);
  const LayerConfig& cfg = k.cfg;
  const std::vector<HostRouting>& rt = k.rt;
  const std::vector<int64_t>& t_off = k.t_off;
  const LayerTensors& ref = *k.ref;
  const std::vector<RankResult> res = run_ep(W, cfg, rt, t_off, ref);
  const int64_t El = cfg.E / W;
  int64_t pair_off = 0;
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult& rr = res[r];
    ASSERT_EQ(rr.error, "");
    const HostTensor out = slice_rows(ref.out, t_off[r], rt[r].T);
    const HostTensor dx = slice_rows(ref.dx, t_off[r], rt[r].T);
    const HostTensor dw1 = slice_rows(ref.dw1, r * El, El);
    const HostTensor dw2 = slice_rows(ref.dw2, r * El, El);
    const HostTensor dpw = slice_rows(ref.d_pair_weights, pair_off, rt[r].P());
    pair_off += rt[r].P();
    const double tol = rel_tolerance(DType::bf16);
    const double e_out = rel_error(rr.out, out.to_double()), e_dx = rel_error(rr.dx, dx.to_double()),
                 e_dw1 = rel_error(rr.dw1, dw1.to_double()),
                 e_dw2 = rel_error(rr.dw2, dw2.to_double()),
                 e_dpw = rel_error(rr.dpw, dpw.to_double());
    EXPECT_LE(e_out, tol);
    EXPECT_LE(e_dx, tol);
    EXPECT_LE(e_dw1, tol);
    EXPECT_LE(e_dw2, tol);
    EXPECT_LE(e_dpw, tol);
    std::printf(
        "EP W=%d %-8s rank %d T=%-4lld | rel err out %.2e dx %.2e dw1 %.2e dw2 %.2e dpw %.2e | "
        "bitwise out %d dx %d dw1 %d dw2 %d dpw %d | fwd %.3f ms (exchange %.0f%%) bwd %.3f ms "
        "(exchange %.0f%%)\n",
        W, one_rank ? "one-rank" : "spread", r, static_cast<long long>(rt[r].T), e_out, e_dx,
        e_dw1, e_dw2, e_dpw, bitwise_equal(rr.out, out), bitwise_equal(rr.dx, dx),
        bitwise_equal(rr.dw1, dw1), bitwise_equal(rr.dw2, dw2), bitwise_equal(rr.dpw, dpw),
        1e3 * rr.fwd.total_s, 100.0 * rr.fwd.exchange_s / std::max(rr.fwd.total_s, 1e-12),
        1e3 * rr.bwd.total_s, 100.0 * rr.bwd.exchange_s / std::max(rr.bwd.total_s, 1e-12));
  }
}

TEST(EpNccl, MatchesSingleGpuLayer) {
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 GPUs (found " << n << ")";
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (KINDS.md)
  const uint64_t seed = fresh_seed();
  for (int W = 2; W <= std::min(n, 8); W *= 2) {
    run_case(W, /*one_rank=*/true, seed + W);
    run_case(W, /*one_rank=*/false, seed + 100 + W);
  }
}

// EpOptions::chunks = C over NCCL: the stream-ordered pipeline. Every result within bf16
// rounding of the single-GPU layer (dw1/dw2 sum C per-chunk bf16 gradients: the CPU test's
// bound (C + 1) * 2^-9 is below test_util's 1e-2 for C <= 4); out, dx, d_pair_weights compared
// with chunks = 1 and printed (bitwise equal on the CPU; on the GPU that depends on the GEMMs
// computing each row independently of the others, so it is reported, not asserted, until run).
// Rank 0 has fewer tokens than chunks (empty chunks), the last rank none.
void run_chunked_case(int W, int C, uint64_t seed) {
  SCOPED_TRACE("W " + std::to_string(W) + " chunks " + std::to_string(C) + " seed " +
               std::to_string(seed));
  const Case k = make_case(W, /*one_rank=*/false, seed, /*small_rank0=*/C - 1);
  const std::vector<RankResult> one = run_ep(W, k.cfg, k.rt, k.t_off, *k.ref, -1, 1);
  const std::vector<RankResult> res = run_ep(W, k.cfg, k.rt, k.t_off, *k.ref, -1, C);
  const int64_t El = k.cfg.E / W;
  int64_t pair_off = 0;
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult &rr = res[r], &r1 = one[r];
    ASSERT_EQ(rr.error, "");
    ASSERT_EQ(r1.error, "");
    const int64_t T = k.rt[r].T;
    const HostTensor out = slice_rows(k.ref->out, k.t_off[r], T);
    const HostTensor dx = slice_rows(k.ref->dx, k.t_off[r], T);
    const HostTensor dw1 = slice_rows(k.ref->dw1, r * El, El);
    const HostTensor dw2 = slice_rows(k.ref->dw2, r * El, El);
    const HostTensor dpw = slice_rows(k.ref->d_pair_weights, pair_off, k.rt[r].P());
    pair_off += k.rt[r].P();
    const double tol = rel_tolerance(DType::bf16);
    const double e_out = rel_error(rr.out, out.to_double()), e_dx = rel_error(rr.dx, dx.to_double()),
                 e_dw1 = rel_error(rr.dw1, dw1.to_double()),
                 e_dw2 = rel_error(rr.dw2, dw2.to_double()),
                 e_dpw = rel_error(rr.dpw, dpw.to_double());
    EXPECT_LE(e_out, tol);
    EXPECT_LE(e_dx, tol);
    EXPECT_LE(e_dw1, std::max(tol, (C + 1) * 0x1p-9));
    EXPECT_LE(e_dw2, std::max(tol, (C + 1) * 0x1p-9));
    EXPECT_LE(e_dpw, tol);
    auto share = [](const EpTimings& t, double part) {
      return 100.0 * part / std::max(t.total_s, 1e-12);
    };
    std::printf(
        "EP W=%d chunks=%d rank %d T=%-4lld | rel err out %.2e dx %.2e dw1 %.2e dw2 %.2e dpw "
        "%.2e | bitwise vs chunks=1: out %d dx %d dpw %d | fwd %.3f ms (exchange %.0f%%, "
        "pipeline %.0f%%) bwd %.3f ms (exchange %.0f%%, pipeline %.0f%%)\n",
        W, C, r, static_cast<long long>(T), e_out, e_dx, e_dw1, e_dw2, e_dpw,
        bitwise_equal(rr.out, r1.out), bitwise_equal(rr.dx, r1.dx), bitwise_equal(rr.dpw, r1.dpw),
        1e3 * rr.fwd.total_s, share(rr.fwd, rr.fwd.exchange_s), share(rr.fwd, rr.fwd.pipeline_s),
        1e3 * rr.bwd.total_s, share(rr.bwd, rr.bwd.exchange_s), share(rr.bwd, rr.bwd.pipeline_s));
  }
}

TEST(EpNccl, ChunkedPipelineMatchesSingleGpuLayer) {
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 GPUs (found " << n << ")";
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (KINDS.md)
  const uint64_t seed = fresh_seed();
  for (int W = 2; W <= std::min(n, 8); W *= 2)
    for (int C : {2, 4}) run_chunked_case(W, C, seed + 1000 * W + C);
}

TEST(EpNccl, ABadArgumentOnOneRankFailsEveryRank) {
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 GPUs (found " << n << ")";
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  LayerConfig cfg;
  cfg.d = 64;
  cfg.n = 64;
  cfg.E = 4;
  cfg.K = 2;
  cfg.dtype = DType::bf16;
  std::vector<HostRouting> rt = {make_routing(32, 4, 2, 2, false, rng),
                                 make_routing(16, 4, 2, 2, false, rng)};
  cfg.T = 48;
  LayerTensors global(cfg, 96);
  global.randomize(seed);
  const std::vector<RankResult> res = run_ep(2, cfg, rt, {0, 32, 48}, global, /*bad_w1_rank=*/1);
  EXPECT_NE(res[1].error.find("w1 has shape (3, 128, 64), expected (2, 128, 64)"),
            std::string::npos)
      << res[1].error;
  EXPECT_TRUE(res[0].remote_error) << res[0].error;
}

#else  // !MOEBLAZE_WITH_NCCL

TEST(EpNccl, MatchesSingleGpuLayer) { GTEST_SKIP() << "skipped: moeblaze was built without NCCL"; }
TEST(EpNccl, ChunkedPipelineMatchesSingleGpuLayer) {
  GTEST_SKIP() << "skipped: moeblaze was built without NCCL";
}

#endif

}  // namespace
}  // namespace moeblaze::test
