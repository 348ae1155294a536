// `moeblaze bench ep`: expert parallelism over NCCL. Tokens/s of one training step of the MoE
// layer (forward + backward) on W = 1, 2, 4, 8 GPUs of one host, and the share of the step spent
// in the exchanges, under weak and strong scaling, against the same layer on one GPU. bf16,
// SwiGLU, softmax top-K routing of N(0, 1) logits (as `bench layer`).
//
// What a row is:
//  - W = 1: the plain single-GPU layer, layer_forward + layer_backward on GPU 0 with the routing
//    plan built once before timing, as `bench layer` runs it, on the config's T tokens. It is the
//    baseline of both scalings (one measurement, printed in both groups).
//  - W >= 2: one process, one thread per GPU, a communicator over GPUs 0..W-1 (ncclCommInitAll,
//    NVLink multicast off), make_nccl_transport per rank. Rank r holds experts
//    [r*E/W, (r+1)*E/W) and its own tokens; one step = ep_forward + ep_backward. The EP API takes
//    a host routing with global expert ids, so every rank's routing is made on the host first:
//      weak    T tokens per rank (the config's T), W*T in all. Rank r's router logits come from
//              seed + r, so rank 0 routes exactly as the baseline.
//      strong  the config's T tokens in all: the baseline's routing cut into W contiguous blocks
//              (the same problem as W = 1, only spread).
//    E % W != 0 is skipped with the reason (every rank holds an equal block of experts).
//
// How it is timed: host wall clock (steady_clock) around each call after its stream is
// synchronised; the EP calls block until their data has moved, so wall time is what a step costs.
// Before every repetition each GPU's L2 is flushed (a 256 MiB write, as the protocol asks) and the
// rank threads meet at a barrier, so repetitions start together; the time of a repetition is the
// max over ranks (the step is over when the slowest rank is). --warmup repetitions first (the first
// also pays NCCL's lazy connection setup), then the median of --reps repetitions.
//
// Exchange share: EpTimings of both calls, exchange_s / total_s, mean over ranks. It is host wall
// time inside the blocking collectives, so waiting for a slower peer counts as exchange: load
// imbalance shows up there, not in the local-layer time. The EP step also builds the dispatch
// lists (on the host) and the local plan (on the GPU, from the received routing) each call (the
// baseline's plan is prebuilt): "other ms" is that remainder (total - exchange - local layer,
// with the row gathers, combines and host<->device staging).
//
// Chunks (--chunks LIST, default 1): every W >= 2 row is run once per entry with
// EpOptions::chunks = C. With C > 1 each rank's tokens travel in C exchanges pipelined with the
// local layer (NCCL on the transport's own stream, CUDA events between), so exchange and layer
// time overlap on the device and the host cannot split them: "pipeline ms" is the host's wait
// for that overlapped work at the end of each call (EpTimings::pipeline_s), the exchange share
// keeps only the host time inside exchange calls (agreements, metadata, queueing), and the
// local-layer column only the host time of queueing the layers. The step time is what tells
// whether the overlap paid: compare a config's rows across chunk counts.
//
// Failures: a rank that fails while setting up releases the others at the barrier before any NCCL
// call. Bad arguments and local-layer failures inside the EP calls are agreed by the library (every
// rank throws). Anything else can leave ranks blocked inside NCCL: the supervising main thread then
// stops the group (no rank starts another collective), calls ncclCommAbort on every communicator,
// and reports the row as failed; if ranks are still blocked a minute later it exits the process
// rather than hang. A row whose device memory runs out is reported "skipped: out of memory".
#ifdef MOEBLAZE_WITH_CUDA

#include <CLI/CLI.hpp>
#include <cuda_runtime.h>
#ifdef MOEBLAZE_WITH_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cmd_bench_util.hpp"
#include "commands.hpp"
#include "configs.hpp"
#include "flags.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/expert_parallel.hpp"
#include "moeblaze/moeblaze.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

// Configs that fit one H200 at every W and whose E divides by 2, 4 and 8: two SonicMoE shapes
// (fine-grained, E = 128), OLMoE (E = 64) and MoEBlaze's coarse conf7 (E = 8, d = 2048, n = 8192).
constexpr const char* kDefaultConfigs = "sm-7B-n256,sm-default,olmoe,mb-conf7";
// No rank finished a repetition for this long: the group is taken as hung.
constexpr int kStallSeconds = 120;
// After one rank failed, how long the others get to finish by themselves (failures the EP calls
// agree on end every rank at once) before the group is stopped and the communicators aborted.
constexpr int kGraceSeconds = 10;

struct Flags {
  std::string config = kDefaultConfigs;
  std::string gpus;  // empty: 1 and every power of two <= the visible GPUs
  std::string scaling = "both";
  std::string mode = "keep_h";
  std::string chunks = "1";  // EpOptions::chunks of the W >= 2 rows, a comma list
  int reps = 20;
  int warmup = 2;
  uint64_t seed = 1234;
  std::string out;  // append JSON lines here
  std::string md;   // write the table as Markdown here
  bool json = false;
};

// What run_bench works from, after every flag was checked.
struct Plan {
  std::vector<const NamedConfig*> configs;
  std::vector<int> gpus;                // ascending, distinct
  std::vector<std::string> scalings;    // "weak", "strong"
  std::vector<int> chunks;              // ascending, distinct: one W >= 2 row each
  LayerMode mode = LayerMode::keep_h;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- flags ------------------------------------------------------------------------------------

Plan parse_flags(const Flags& f) {
  Plan p;
  MOEBLAZE_REQUIRE(f.reps >= 20, "--reps (", f.reps,
                   ") must be >= 20 (the benchmark protocol: median of >= 20 runs)");
  MOEBLAZE_REQUIRE(f.warmup >= 1, "--warmup (", f.warmup, ") must be >= 1");
  MOEBLAZE_REQUIRE(f.mode == "keep_h" || f.mode == "recompute", "--mode '", f.mode,
                   "' is not one of: keep_h, recompute");
  p.mode = f.mode == "keep_h" ? LayerMode::keep_h : LayerMode::recompute;
  MOEBLAZE_REQUIRE(f.scaling == "weak" || f.scaling == "strong" || f.scaling == "both",
                   "--scaling '", f.scaling, "' is not one of: weak, strong, both");
  if (f.scaling != "strong") p.scalings.push_back("weak");
  if (f.scaling != "weak") p.scalings.push_back("strong");

  if (f.config == "all") {
    for (const NamedConfig& c : named_configs()) p.configs.push_back(&c);
  } else {
    for (const std::string& name : split_commas(f.config)) {
      MOEBLAZE_REQUIRE(!name.empty(), "--config '", f.config, "' has an empty entry");
      const NamedConfig* c = find_config(name);
      MOEBLAZE_REQUIRE(c != nullptr, "--config entry '", name, "' is not one of: ", config_names(),
                       " (or 'all', 'list')");
      MOEBLAZE_REQUIRE(std::find(p.configs.begin(), p.configs.end(), c) == p.configs.end(),
                       "--config lists '", name, "' twice");
      p.configs.push_back(c);
    }
  }
  MOEBLAZE_REQUIRE(!p.configs.empty(), "--config is empty");

  if (!f.gpus.empty()) {
    for (const std::string& tok : split_commas(f.gpus)) {
      const bool digits = !tok.empty() && tok.size() <= 4 &&
                          tok.find_first_not_of("0123456789") == std::string::npos;
      MOEBLAZE_REQUIRE(digits && std::stoi(tok) >= 1, "--gpus entry '", tok,
                       "' is not a GPU count (an integer from 1 to 9999)");
      const int W = std::stoi(tok);
      MOEBLAZE_REQUIRE(std::find(p.gpus.begin(), p.gpus.end(), W) == p.gpus.end(), "--gpus lists ",
                       W, " twice");
      p.gpus.push_back(W);
    }
    std::sort(p.gpus.begin(), p.gpus.end());
  }
  for (const std::string& tok : split_commas(f.chunks)) {
    const bool digits = !tok.empty() && tok.size() <= 4 &&
                        tok.find_first_not_of("0123456789") == std::string::npos;
    MOEBLAZE_REQUIRE(digits && std::stoi(tok) >= 1 && std::stoi(tok) <= kEpMaxChunks,
                     "--chunks entry '", tok, "' is not a chunk count (an integer from 1 to ",
                     kEpMaxChunks, ")");
    const int C = std::stoi(tok);
    MOEBLAZE_REQUIRE(std::find(p.chunks.begin(), p.chunks.end(), C) == p.chunks.end(),
                     "--chunks lists ", C, " twice");
    p.chunks.push_back(C);
  }
  std::sort(p.chunks.begin(), p.chunks.end());
  if (!f.out.empty()) {
    std::ofstream os(f.out, std::ios::app);
    MOEBLAZE_REQUIRE(os.good(), "--out '", f.out, "' cannot be opened for appending");
  }
  if (!f.md.empty()) {
    std::ofstream os(f.md, std::ios::app);
    MOEBLAZE_REQUIRE(os.good(), "--md '", f.md, "' cannot be opened for writing");
  }
  return p;
}

// ---- device memory the command owns (the caller's tensors), on the current device ------------

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// The library's buffers come from the device's default pool, which keeps freed memory cached;
// give it back after a row so that the next row's cudaMalloc sees the whole device.
void trim_pool(int device) {
  cudaSetDevice(device);
  cudaDeviceSynchronize();
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
  (void)cudaGetLastError();
}

// Writes the flush buffer on `stream` and waits: no operand of the next repetition is in L2.
void flush_l2(const DevBuf& flush, int rep, cudaStream_t stream) {
  write_l2_flush(flush.p, rep, stream);
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) return true;
  const std::string w = e.what();
  return w.find("out of memory") != std::string::npos;
}

// ---- routing ----------------------------------------------------------------------------------

// A token-major routing in host memory, the EP API's input: pairs of token t are
// [offsets[t], offsets[t+1]), expert ids global.
struct HostRouting {
  int64_t T = 0, E = 0;
  std::vector<int32_t> offsets;  // (T+1,) int32
  std::vector<int32_t> experts;  // (P,) int32, global expert ids
  std::vector<float> weights;    // (P,) fp32
  int64_t P() const { return int64_t(experts.size()); }
  RoutingView view() const {
    RoutingView v;
    v.T = T;
    v.E = E;
    v.P = P();
    v.pair_offsets = offsets.data();
    v.pair_experts = experts.data();
    v.pair_weights = weights.data();
    v.device = Device::cpu;
    return v;
  }
};

// Softmax top-K of N(0, 1) logits drawn from `seed`, on the host: the same draws and router as
// `bench layer`, so the W = 1 row routes exactly as its rows do.
HostRouting softmax_topk_routing(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  std::vector<float> logits(size_t(T * E));  // (T, E) fp32
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : logits) v = nd(rng);
  RouterConfig rc;
  rc.kind = RouterKind::softmax_topk;
  rc.top_k = int(K);
  Routing r;
  route(rc, host_view(logits.data(), {T, E}), TensorView(), r);
  HostRouting h;
  h.T = T;
  h.E = E;
  h.offsets.assign(r.pair_offsets(), r.pair_offsets() + T + 1);
  h.experts.assign(r.pair_experts(), r.pair_experts() + r.P());
  h.weights.assign(r.pair_weights(), r.pair_weights() + r.P());
  return h;
}

// Tokens [t0, t0 + T) of a routing, offsets rebased to 0.
HostRouting slice_tokens(const HostRouting& g, int64_t t0, int64_t T) {
  HostRouting h;
  h.T = T;
  h.E = g.E;
  const int32_t p0 = g.offsets[t0], p1 = g.offsets[t0 + T];
  for (int64_t t = 0; t <= T; ++t) h.offsets.push_back(g.offsets[t0 + t] - p0);
  h.experts.assign(g.experts.begin() + p0, g.experts.begin() + p1);
  h.weights.assign(g.weights.begin() + p0, g.weights.begin() + p1);
  return h;
}

// ---- results ----------------------------------------------------------------------------------

struct Result {
  double fwd_ms = NAN, bwd_ms = NAN, step_ms = NAN;  // medians over reps of the max over ranks
  double exchange_share = NAN;  // mean over ranks of exchange / total, fwd + bwd (median)
  double exchange_ms = NAN;     // mean over ranks (median)
  double layer_ms = NAN;        // local layer_forward + layer_backward, max over ranks (median)
  double pipeline_ms = NAN;     // chunks > 1: EpTimings::pipeline_s, fwd + bwd, mean over ranks
                                // (median): host wait for the overlapped layers and exchanges
  double other_ms = NAN;        // total - exchange - layer - pipeline, mean over ranks (median)
  int chunks = 0;               // EpOptions::chunks (0: the single-GPU row)
  int64_t pairs = 0;            // routing pairs of all ranks
  int64_t rows_sent = -1;       // deduplicated token rows sent, all ranks (-1: no exchange)
  int64_t max_recv_rows = -1;   // the most token rows one rank received
  int host_threads = 0;         // CPU threads per rank for the EP calls' host work
};

// ---- W = 1: the single-GPU layer ---------------------------------------------------------------

Result run_single_gpu(const Flags& f, const LayerConfig& c, const HostRouting& rt, LayerMode mode) {
  MOEBLAZE_CUDA_CHECK(cudaSetDevice(0));
  const cudaStream_t stream = nullptr;
  const int64_t R = c.w1_rows(), P = rt.P();
  Result res;
  {
    // Routing and plan on the device, built once before timing (as bench layer).
    Routing dr(Device::cuda, c.T, c.E, P);
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_offsets(), rt.offsets.data(), 4 * rt.offsets.size(),
                                   cudaMemcpyHostToDevice));
    if (P > 0) {
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_experts(), rt.experts.data(), 4 * size_t(P),
                                     cudaMemcpyHostToDevice));
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(dr.pair_weights(), rt.weights.data(), 4 * size_t(P),
                                     cudaMemcpyHostToDevice));
    }
    RoutingPlan plan;
    build_routing_plan(dr.view(), PlanBuilder::atomic_free, plan);
    const int64_t S = plan.S();

    const LayerTensors lt(c, c.E, S, f.seed, stream);  // the caller's tensors, E experts
    const TensorView &xv = lt.xv, &w1v = lt.w1v, &w2v = lt.w2v, &outv = lt.outv,
                     &doutv = lt.doutv;
    const LayerGrads& g = lt.grads;
    DevBuf flush(kL2FlushBytes);
    LayerOptions opts;
    opts.mode = mode;
    opts.stream = stream;

    std::vector<double> fwd, bwd, step;
    SavedForBackward saved;
    for (int i = 0; i < f.warmup + f.reps; ++i) {
      saved = SavedForBackward();  // the last H is freed outside the timing
      flush_l2(flush, i, stream);
      const Clock::time_point t0 = Clock::now();
      layer_forward(c, plan, xv, w1v, w2v, outv, saved, opts);
      MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double tf = seconds_since(t0);
      layer_backward(c, plan, xv, w1v, w2v, doutv, saved, g, opts);
      MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double ts = seconds_since(t0);
      if (i < f.warmup) continue;
      fwd.push_back(1e3 * tf);
      bwd.push_back(1e3 * (ts - tf));
      step.push_back(1e3 * ts);
    }
    res.fwd_ms = median(fwd);
    res.bwd_ms = median(bwd);
    res.step_ms = median(step);
    res.layer_ms = res.step_ms;
    res.pairs = P;
  }
  trim_pool(0);
  return res;
}

// ---- W >= 2: expert parallelism over NCCL -------------------------------------------------------

#ifdef MOEBLAZE_WITH_NCCL

// Thrown on the ranks that stop because another rank failed (never the error reported).
class GroupAborted : public std::runtime_error {
 public:
  GroupAborted() : std::runtime_error("stopped: another rank failed") {}
};

// The rank threads meet here between repetitions, so that repetitions start together (C++17 has
// no std::barrier). abort() releases every waiter, and every later wait, with GroupAborted: a
// rank that failed must not leave the others waiting.
class RankBarrier {
 public:
  explicit RankBarrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m_);
    if (aborted_) throw GroupAborted();
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return gen_ != gen || aborted_; });
    if (gen_ == gen) throw GroupAborted();
  }
  void abort() {
    std::lock_guard<std::mutex> lk(m_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  uint64_t gen_ = 0;
  bool aborted_ = false;
};

// NCCL's transport, refusing to start a collective once the group is stopping: after
// ncclCommAbort has released a blocked rank, that rank must not enter NCCL again with a freed
// communicator. (The supervisor sets `stopping` a second before it aborts.)
class GuardedTransport final : public Transport {
 public:
  GuardedTransport(Transport& inner, const std::atomic<bool>& stopping)
      : inner_(inner), stopping_(stopping) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Device device() const override { return inner_.device(); }
  void all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
                    void* recv, const int64_t* recv_counts, const int64_t* recv_offsets) override {
    if (stopping_.load()) throw GroupAborted();
    inner_.all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets);
  }
  void all_gather(const int64_t* send, int64_t count, int64_t* recv) override {
    if (stopping_.load()) throw GroupAborted();
    inner_.all_gather(send, count, recv);
  }
  // The stream-ordered exchanges of the chunk pipeline pass through, so that it overlaps here
  // as it would on the bare transport.
  bool stream_ordered() const override { return inner_.stream_ordered(); }
  uint64_t all_to_all_v_start(const void* send, const int64_t* send_counts,
                              const int64_t* send_offsets, void* recv, const int64_t* recv_counts,
                              const int64_t* recv_offsets, void* producer_stream) override {
    if (stopping_.load()) throw GroupAborted();
    return inner_.all_to_all_v_start(send, send_counts, send_offsets, recv, recv_counts,
                                     recv_offsets, producer_stream);
  }
  void all_to_all_v_wait(uint64_t ticket, void* consumer_stream) override {
    inner_.all_to_all_v_wait(ticket, consumer_stream);
  }
  void synchronize_exchanges() override { inner_.synchronize_exchanges(); }

 private:
  Transport& inner_;
  const std::atomic<bool>& stopping_;
};

// Communicators over GPUs 0..W-1, kept across the rows of one W (creating them is not free at 8
// GPUs); a group that had to be aborted is dropped and the next row makes a new one.
class Comms {
 public:
  explicit Comms(int W) : comms_(size_t(W)) {
    std::vector<int> devs(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) devs[r] = r;
    const ncclResult_t rc = ncclCommInitAll(comms_.data(), W, devs.data());
    if (rc != ncclSuccess)
      throw DeviceError(detail::concat("ncclCommInitAll over GPUs 0..", W - 1,
                                       " failed: ", ncclGetErrorString(rc)));
  }
  ~Comms() {
    if (aborted_) return;  // ncclCommAbort freed them
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }
  Comms(const Comms&) = delete;
  Comms& operator=(const Comms&) = delete;
  ncclComm_t operator[](int r) const { return comms_[size_t(r)]; }
  // Aborts every communicator: NCCL kernels in flight return, the communicators are freed.
  void abort() {
    for (size_t r = 0; r < comms_.size(); ++r) {
      cudaSetDevice(int(r));
      ncclCommAbort(comms_[r]);
    }
    aborted_ = true;
  }
  bool aborted() const { return aborted_; }

 private:
  std::vector<ncclComm_t> comms_;
  bool aborted_ = false;
};

// What the rank threads and the supervising main thread share.
struct Group {
  explicit Group(int W_) : W(W_), barrier(W_) {}
  const int W;
  RankBarrier barrier;
  std::atomic<bool> stopping{false};  // set by the supervisor: no new collective starts
  std::mutex m;
  std::condition_variable cv;
  int finished = 0;
  int64_t progress = 0;  // repetitions finished, all ranks
  bool failed = false;
  bool stalled = false;
  int error_rank = -1;
  bool error_is_remote = true;
  std::exception_ptr error;  // the first failure of a rank's own (else a RemoteRankError)

  void fail(int rank, std::exception_ptr e) {
    bool remote = false;
    try {
      std::rethrow_exception(e);
    } catch (const RemoteRankError&) {
      remote = true;
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> lk(m);
      if (!error || (error_is_remote && !remote)) {
        error = e;
        error_rank = rank;
        error_is_remote = remote;
      }
      failed = true;
    }
    barrier.abort();
    cv.notify_all();
  }
  void tick() {
    std::lock_guard<std::mutex> lk(m);
    ++progress;
    cv.notify_all();
  }
  void finish() {
    std::lock_guard<std::mutex> lk(m);
    ++finished;
    cv.notify_all();
  }
};

// Waits until every rank thread has finished. After a failure (or kStallSeconds without a
// finished repetition) the others get kGraceSeconds to end by themselves; then the group is
// stopping, and a second later every communicator is aborted, which releases the ranks blocked
// inside NCCL. If even that does not end them, the process exits: never hang.
void supervise(Group& g, Comms& comms) {
  std::unique_lock<std::mutex> lk(g.m);
  auto all_done = [&] { return g.finished == g.W; };
  while (!all_done() && !g.failed) {
    const int64_t seen = g.progress;
    if (!g.cv.wait_for(lk, std::chrono::seconds(kStallSeconds),
                       [&] { return all_done() || g.failed || g.progress != seen; })) {
      g.stalled = true;
      std::cerr << "bench ep: no rank finished a repetition in " << kStallSeconds
                << " s; stopping the group\n";
      break;
    }
  }
  if (all_done()) return;
  if (!g.stalled && g.cv.wait_for(lk, std::chrono::seconds(kGraceSeconds), all_done)) return;
  g.stopping = true;
  lk.unlock();
  g.barrier.abort();
  lk.lock();
  if (g.cv.wait_for(lk, std::chrono::seconds(1), all_done)) return;
  lk.unlock();
  std::cerr << "bench ep: " << g.W - g.finished
            << " rank(s) blocked in NCCL; aborting the communicators (ncclCommAbort)\n";
  comms.abort();
  lk.lock();
  if (!g.cv.wait_for(lk, std::chrono::seconds(60), all_done)) {
    std::cerr << "bench ep: rank(s) still blocked a minute after ncclCommAbort; exiting\n"
              << std::flush;
    std::_Exit(kExitFailure);
  }
}

// One rank's measurements.
struct RankReps {
  std::vector<double> fwd_s, bwd_s;       // (reps,) wall time of each call
  std::vector<EpTimings> fwd_t, bwd_t;    // (reps,) the calls' own split
  int64_t rows_sent = 0, pairs = 0, recv_rows = 0;
};

// The warm-up and timed repetitions of one rank, each started at the barrier with L2 flushed.
void run_reps(const Flags& f, Group& g, const LayerConfig& c, const RoutingView& rv,
              const TensorView& xv, const TensorView& w1v, const TensorView& w2v,
              const TensorView& outv, const TensorView& doutv, const EpGrads& grads,
              Transport& tr, EpOptions o, const DevBuf& flush, cudaStream_t stream,
              RankReps& out) {
  EpSaved saved;
  for (int i = 0; i < f.warmup + f.reps; ++i) {
    saved = EpSaved();  // the last step's state is freed outside the timing
    flush_l2(flush, i, stream);
    g.barrier.wait();
    EpTimings ft, bt;
    const Clock::time_point t0 = Clock::now();
    o.timings = &ft;
    ep_forward(tr, c, rv, xv, w1v, w2v, outv, saved, o);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double tf = seconds_since(t0);
    o.timings = &bt;
    ep_backward(tr, c, w1v, w2v, doutv, saved, grads, o);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double ts = seconds_since(t0);
    out.rows_sent = saved.sent_tokens();
    out.recv_rows = saved.received_tokens();
    if (i >= f.warmup) {
      out.fwd_s.push_back(tf);
      out.bwd_s.push_back(ts - tf);
      out.fwd_t.push_back(ft);
      out.bwd_t.push_back(bt);
    }
    g.tick();
  }
}

// Rank r of the group: its tokens (routing rt), experts [r*E/W, (r+1)*E/W), warm-up and timed
// repetitions, each started at the barrier.
void rank_main(int r, const Flags& f, const LayerConfig& global_cfg, const HostRouting& rt,
               LayerMode mode, int chunks, int host_threads, Group& g, Comms& comms,
               RankReps& out) {
  MOEBLAZE_CUDA_CHECK(cudaSetDevice(r));
  {
    Stream st;
    LayerConfig c = global_cfg;
    c.T = rt.T;  // this rank's tokens; E stays global
    const int64_t El = c.E / g.W, R = c.w1_rows(), T = c.T;
    const uint64_t seed = f.seed + 1000 * uint64_t(r + 1);
    // This rank's tokens (T_r, d) and experts [r*E/W, (r+1)*E/W) (E/W, ...); grads like them,
    // d_pair_weights (P_r,) fp32 in this rank's pair order.
    const LayerTensors lt(c, El, rt.P(), seed, st.s);
    DevBuf flush(kL2FlushBytes);
    const TensorView &xv = lt.xv, &w1v = lt.w1v, &w2v = lt.w2v, &outv = lt.outv,
                     &doutv = lt.doutv;
    EpGrads grads;
    grads.dx = lt.grads.dx;
    grads.dw1 = lt.grads.dw1;
    grads.dw2 = lt.grads.dw2;
    grads.d_pair_weights = lt.grads.d_pair_weights;
    std::unique_ptr<Transport> nccl = make_nccl_transport(comms[r], st.s);
    GuardedTransport tr(*nccl, g.stopping);
    EpOptions o;
    o.layer.mode = mode;
    o.layer.stream = st.s;
    o.layer.num_threads = host_threads;
    o.chunks = chunks;
    const RoutingView rv = rt.view();
    out.pairs = rt.P();

    // From here a failure may leave peers inside NCCL: report it before this rank's buffers are
    // freed (cudaFree waits for the device, which may wait for those peers until the abort).
    try {
      g.barrier.wait();  // every rank is set up (one that failed has released the others)
      run_reps(f, g, c, rv, xv, w1v, w2v, outv, doutv, grads, tr, o, flush, st.s, out);
    } catch (const GroupAborted&) {
      throw;
    } catch (...) {
      g.fail(r, std::current_exception());
      throw GroupAborted();
    }
  }
}

// One row at W >= 2: the rank threads, supervised; the first failure is rethrown here.
Result run_ep(const Flags& f, const LayerConfig& c, const std::vector<HostRouting>& rt,
              LayerMode mode, int chunks, std::map<int, std::unique_ptr<Comms>>& comm_cache) {
  const int W = int(rt.size());
  std::unique_ptr<Comms>& comms = comm_cache[W];
  if (!comms) comms.reset(new Comms(W));
  // Each rank's host work (dispatch lists, local plan) gets an equal share of the CPU, as
  // W processes pinned to W slices of the host would.
  const int host_threads = std::max(1, int(std::thread::hardware_concurrency()) / W);
  Group g(W);
  std::vector<RankReps> reps(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        rank_main(r, f, c, rt[size_t(r)], mode, chunks, host_threads, g, *comms,
                  reps[size_t(r)]);
      } catch (const GroupAborted&) {
      } catch (...) {  // a failure while setting up (no NCCL call made yet)
        g.fail(r, std::current_exception());
      }
      trim_pool(r);
      g.finish();
    });
  supervise(g, *comms);
  for (std::thread& t : threads) t.join();
  const bool aborted = comms->aborted();
  if (aborted) comms.reset();  // freed by ncclCommAbort; the next row of this W makes new ones
  if (g.error) std::rethrow_exception(g.error);
  if (g.stalled || aborted)
    throw DeviceError(detail::concat("the ranks stopped making progress (no repetition finished in ",
                                     kStallSeconds, " s); communicators aborted"));

  // Per repetition: max over ranks for times, mean over ranks for the exchange.
  Result res;
  std::vector<double> fwd, bwd, step, share, exch, layer, pipe, other;
  for (int i = 0; i < f.reps; ++i) {
    double mf = 0, mb = 0, ms = 0, ml = 0, sh = 0, ex = 0, pp = 0, ot = 0;
    for (const RankReps& rr : reps) {
      const EpTimings& a = rr.fwd_t[size_t(i)];
      const EpTimings& b = rr.bwd_t[size_t(i)];
      mf = std::max(mf, rr.fwd_s[size_t(i)]);
      mb = std::max(mb, rr.bwd_s[size_t(i)]);
      ms = std::max(ms, rr.fwd_s[size_t(i)] + rr.bwd_s[size_t(i)]);
      ml = std::max(ml, a.layer_s + b.layer_s);
      const double total = a.total_s + b.total_s;
      sh += (a.exchange_s + b.exchange_s) / std::max(total, 1e-12);
      ex += a.exchange_s + b.exchange_s;
      pp += a.pipeline_s + b.pipeline_s;
      ot += total - a.exchange_s - b.exchange_s - a.layer_s - b.layer_s - a.pipeline_s -
            b.pipeline_s;
    }
    fwd.push_back(1e3 * mf);
    bwd.push_back(1e3 * mb);
    step.push_back(1e3 * ms);
    layer.push_back(1e3 * ml);
    share.push_back(sh / W);
    exch.push_back(1e3 * ex / W);
    pipe.push_back(1e3 * pp / W);
    other.push_back(1e3 * ot / W);
  }
  res.fwd_ms = median(fwd);
  res.bwd_ms = median(bwd);
  res.step_ms = median(step);
  res.layer_ms = median(layer);
  res.exchange_share = median(share);
  res.exchange_ms = median(exch);
  res.pipeline_ms = median(pipe);
  res.other_ms = median(other);
  res.chunks = chunks;
  res.rows_sent = res.max_recv_rows = 0;
  for (const RankReps& rr : reps) {
    res.pairs += rr.pairs;
    res.rows_sent += rr.rows_sent;
    res.max_recv_rows = std::max(res.max_recv_rows, rr.recv_rows);
  }
  res.host_threads = host_threads;
  return res;
}

#else  // !MOEBLAZE_WITH_NCCL

struct Comms {};

#endif  // MOEBLAZE_WITH_NCCL

// ---- rows -------------------------------------------------------------------------------------

struct Meta {
  std::string gpu, driver, nccl, commit, date;
  int visible = 0;
};

std::string rate(double per_s) {
  if (!std::isfinite(per_s)) return "-";
  if (per_s >= 1e9) return fixed(per_s / 1e9, 2) + "G";
  if (per_s >= 1e6) return fixed(per_s / 1e6, 2) + "M";
  if (per_s >= 1e3) return fixed(per_s / 1e3, 1) + "k";
  return fixed(per_s, 0);
}

class Report {
 public:
  Report(const Flags& f, const Meta& m, LayerMode mode) : f_(f), meta_(m), mode_(mode) {}

  // One measured row. base_step_ms: the W = 1 step (NaN when it did not run).
  void row(const NamedConfig& nc, const LayerConfig& c, const std::string& scaling, int W,
           int64_t t_rank, int64_t t_global, const Result& r, double base_step_ms) {
    const double tps = double(t_global) / (r.step_ms / 1e3);
    // Throughput ratio: strong step_1 / step_W, weak W * step_1 / step_W.
    const double speedup = double(t_global) / double(c.T) * base_step_ms / r.step_ms;
    const double flops = forward_flops(c, r.pairs) + backward_flops(c, r.pairs);
    JsonLine j;
    j.add("bench", "ep").add("config", nc.name).add("scaling", scaling);
    j.add("impl", W == 1 ? "single-gpu" : "ep-nccl").add("W", W);
    if (r.chunks > 0) j.add("chunks", r.chunks); else j.add_null("chunks");
    j.add("T_rank", t_rank).add("T_global", t_global).add("d", c.d).add("n", c.n).add("E", c.E);
    j.add("E_local", c.E / W).add("K", c.K).add("S", r.pairs);
    j.add("activation", activation_name(c.activation)).add("routing", "softmax-topk");
    j.add("mode", mode_ == LayerMode::keep_h ? "keep_h" : "recompute");
    j.add("fwd_ms", r.fwd_ms).add("bwd_ms", r.bwd_ms).add("step_ms", r.step_ms);
    j.add("tokens_per_s", tps).add("speedup", speedup).add("efficiency", speedup / W);
    j.add("total_tflops", flops / r.step_ms / 1e9);  // all W GPUs together
    j.add("tflops_per_gpu", flops / r.step_ms / 1e9 / W);
    j.add("exchange_share", r.exchange_share).add("exchange_ms", r.exchange_ms);
    j.add("layer_ms", r.layer_ms).add("pipeline_ms", r.pipeline_ms).add("other_ms", r.other_ms);
    if (r.rows_sent >= 0) {
      j.add("rows_sent", r.rows_sent).add("pairs", r.pairs);
      j.add("rows_per_pair", double(r.rows_sent) / double(std::max<int64_t>(r.pairs, 1)));
      j.add("max_recv_rows", r.max_recv_rows);
    } else {
      j.add_null("rows_sent").add("pairs", r.pairs).add_null("rows_per_pair").add_null("max_recv_rows");
    }
    if (r.host_threads > 0) j.add("host_threads", r.host_threads); else j.add_null("host_threads");
    j.add("reps", f_.reps).add("warmup", f_.warmup);
    j.add("seed", f_.seed).add("gpu", meta_.gpu).add("driver", meta_.driver);
    j.add("nccl", meta_.nccl).add("commit", meta_.commit).add("date", meta_.date);
    const std::string line = j.str();
    if (f_.json) std::cout << line << "\n" << std::flush;
    if (!f_.out.empty()) std::ofstream(f_.out, std::ios::app) << line << "\n";
    add({nc.name, scaling, std::to_string(W), r.chunks > 0 ? std::to_string(r.chunks) : "-",
         std::to_string(t_rank), std::to_string(t_global),
         fixed(r.fwd_ms, 2), fixed(r.bwd_ms, 2), fixed(r.step_ms, 2), rate(tps),
         std::isfinite(speedup) ? fixed(speedup, 2) + "x" : "-",
         std::isfinite(r.exchange_share) ? fixed(100.0 * r.exchange_share, 1) + " %" : "-",
         fixed(r.layer_ms, 2), std::isfinite(r.pipeline_ms) ? fixed(r.pipeline_ms, 2) : "-",
         fixed(r.other_ms, 2),
         r.rows_sent >= 0 ? fixed(double(r.rows_sent) / double(std::max<int64_t>(r.pairs, 1)), 3)
                          : "-",
         ""});
  }

  // A row that did not run: a line on stderr, and the reason in the table's note column.
  // chunks: EpOptions::chunks of the row, 0 for the single-GPU row.
  void skipped(const NamedConfig& nc, const std::string& scaling, int W, int chunks,
               int64_t t_rank, int64_t t_global, const std::string& why) {
    std::cerr << "bench ep: " << nc.name << " " << scaling << " W=" << W;
    if (chunks > 0) std::cerr << " chunks=" << chunks;
    std::cerr << ": " << why << "\n";
    add({nc.name, scaling, std::to_string(W), chunks > 0 ? std::to_string(chunks) : "-",
         std::to_string(t_rank), std::to_string(t_global), "-", "-", "-", "-", "-", "-", "-",
         "-", "-", "-", why});
  }

  void print(std::ostream& os) const { table().print(os); }

  void write_md(const std::string& path) const {
    std::ofstream md(path);
    md << "# moeblaze bench ep\n\n"
       << meta_.gpu << " (" << meta_.visible << " visible), driver " << meta_.driver << ", NCCL "
       << meta_.nccl << ", commit " << meta_.commit << ", " << meta_.date
       << ". bf16, SwiGLU, softmax top-K of N(0, 1) logits, mode "
       << (mode_ == LayerMode::keep_h ? "keep_h" : "recompute") << "; median of " << f_.reps
       << " reps after " << f_.warmup
       << " warm-up, L2 flushed, step = max over ranks. W = 1 is the single-GPU layer; "
          "speed-up = tokens/s over W = 1's; exchange = share of the EP calls' wall time in "
          "the exchanges as far as the host waited in them (mean over ranks); chunks = "
          "EpOptions::chunks; pipeline = with chunks > 1, the host's wait at the end of each "
          "call for the overlapped local layers and exchanges (not split between them); other = "
          "the rest of the EP calls (host dispatch lists and local plan, row gathers and "
          "combines).\n\n";
    md << "|";
    for (const Column& col : columns()) md << " " << col.header << " |";
    md << "\n|";
    for (const Column& col : columns()) md << (col.align == Align::left ? "---|" : "---:|");
    md << "\n";
    for (const auto& cells : cells_) {
      md << "|";
      for (const std::string& s : cells) md << " " << s << " |";
      md << "\n";
    }
  }

 private:
  static std::vector<Column> columns() {
    return {{"config", Align::left}, {"scaling", Align::left}, {"W"}, {"chunks"},
            {"tokens/rank"}, {"global tokens"}, {"fwd ms"}, {"bwd ms"}, {"step ms"},
            {"tokens/s"}, {"speed-up"}, {"exchange"}, {"local layer ms"}, {"pipeline ms"},
            {"other ms"}, {"rows sent / pairs"}, {"note", Align::left}};
  }
  Table table() const {
    Table t(columns());
    for (const auto& cells : cells_) t.add_row(cells);
    return t;
  }
  void add(std::vector<std::string> cells) { cells_.push_back(std::move(cells)); }

  const Flags& f_;
  const Meta& meta_;
  LayerMode mode_;
  std::vector<std::vector<std::string>> cells_;
};

// Why a row cannot run, or "" when it can.
std::string skip_reason(const LayerConfig& c, int W, int visible) {
  if (W > visible)
    return detail::concat("skipped: needs ", W, " GPUs (", visible, " visible)");
  if (W >= 2 && !nccl_available())
    return "skipped: needs NCCL (moeblaze was built without it)";
  if (c.E % W != 0)
    return detail::concat("skipped: E (", c.E, ") is not divisible by W (", W,
                          "): every rank holds an equal block of experts");
  return "";
}

// The note of a row that threw: out of memory and Unsupported skip the row, anything else fails
// it (sets *failed: the exit status becomes 1).
std::string failure_note(const std::exception& e, bool* failed) {
  if (is_out_of_memory(e)) return std::string("skipped: out of memory (") + e.what() + ")";
  if (dynamic_cast<const Unsupported*>(&e)) return std::string("skipped: ") + e.what();
  *failed = true;
  return std::string("failed: ") + e.what();
}

// Every row of one config; returns whether a row failed.
bool bench_config(const Flags& f, const Plan& p, const Meta& meta, const NamedConfig& nc,
                  Report& rep, std::map<int, std::unique_ptr<Comms>>& comm_cache) {
  const LayerConfig c = layer_config(nc, Activation::swiglu, DType::bf16);
  bool failed = false;
  try {
    cuda::gemm::check_gemm_shape(c.d, c.n);  // Unsupported names the dimension
  } catch (const Unsupported& e) {
    for (const std::string& s : p.scalings)
      for (int W : p.gpus)
        for (int C : W == 1 ? std::vector<int>{0} : p.chunks)
          rep.skipped(nc, s, W, C, c.T, c.T, std::string("skipped: ") + e.what());
    return false;
  }
  std::cerr << "bench ep: " << nc.name << ": T=" << c.T << " d=" << c.d << " n=" << c.n
            << " E=" << c.E << " K=" << c.K << "\n";
  // Rank r's weak-scaling routing (logits from seed + r); [0] is the baseline's routing.
  std::vector<HostRouting> weak_rt;
  weak_rt.push_back(softmax_topk_routing(c.T, c.E, c.K, f.seed));

  // W = 1, once for both scalings.
  Result base;
  std::string base_skip;
  const bool want_base = std::find(p.gpus.begin(), p.gpus.end(), 1) != p.gpus.end();
  if (want_base) {
    base_skip = skip_reason(c, 1, meta.visible);
    if (base_skip.empty()) {
      try {
        base = run_single_gpu(f, c, weak_rt[0], p.mode);
        std::cerr << "bench ep: " << nc.name << " W=1: step " << fixed(base.step_ms, 2) << " ms\n";
      } catch (const std::exception& e) {
        (void)cudaGetLastError();
        trim_pool(0);
        base_skip = failure_note(e, &failed);
      }
    }
  }

  for (const std::string& scaling : p.scalings) {
    const bool weak = scaling == "weak";
    for (int W : p.gpus) {
      const int64_t t_rank = weak ? c.T : (c.T + W - 1) / W;  // the largest rank's tokens
      const int64_t t_global = weak ? c.T * W : c.T;
      if (W == 1) {
        if (base_skip.empty()) rep.row(nc, c, scaling, 1, c.T, c.T, base, base.step_ms);
        else rep.skipped(nc, scaling, 1, 0, c.T, c.T, base_skip);
        continue;
      }
      const std::string why = skip_reason(c, W, meta.visible);
      if (!why.empty()) {
        for (int C : p.chunks) rep.skipped(nc, scaling, W, C, t_rank, t_global, why);
        continue;
      }
#ifdef MOEBLAZE_WITH_NCCL
      std::vector<HostRouting> rt;
      if (weak) {
        while (int(weak_rt.size()) < W)
          weak_rt.push_back(softmax_topk_routing(c.T, c.E, c.K, f.seed + weak_rt.size()));
        rt.assign(weak_rt.begin(), weak_rt.begin() + W);
      } else {
        // Contiguous blocks; the first T % W ranks take one token more.
        int64_t t0 = 0;
        for (int r = 0; r < W; ++r) {
          const int64_t Tr = c.T / W + (r < c.T % W ? 1 : 0);
          rt.push_back(slice_tokens(weak_rt[0], t0, Tr));
          t0 += Tr;
        }
      }
      for (int C : p.chunks) {  // one row per chunk count, same routing and tensors
        try {
          const Result res = run_ep(f, c, rt, p.mode, C, comm_cache);
          const double base_ms = base_skip.empty() && want_base ? base.step_ms : NAN;
          rep.row(nc, c, scaling, W, t_rank, t_global, res, base_ms);
          std::cerr << "bench ep: " << nc.name << " " << scaling << " W=" << W << " chunks=" << C
                    << ": step " << fixed(res.step_ms, 2) << " ms, exchange "
                    << fixed(100 * res.exchange_share, 1) << " %, pipeline "
                    << fixed(res.pipeline_ms, 2) << " ms\n";
        } catch (const std::exception& e) {
          (void)cudaGetLastError();
          rep.skipped(nc, scaling, W, C, t_rank, t_global, failure_note(e, &failed));
        }
      }
#endif
    }
  }
#ifndef MOEBLAZE_WITH_NCCL
  (void)comm_cache;  // every W >= 2 row was skipped: nccl_available() is false
#endif
  return failed;
}

void run_bench(const Flags& f) {
  if (f.config == "list") {
    print_config_list(std::cout);
    return;
  }
  Plan p = parse_flags(f);  // every flag checked before any work
  Meta meta;
  const cudaError_t count_err = cudaGetDeviceCount(&meta.visible);
  if (count_err != cudaSuccess) {
    (void)cudaGetLastError();
    meta.visible = 0;
  }
  MOEBLAZE_UNSUPPORTED_IF(meta.visible == 0, "bench ep needs a GPU; none is visible (",
                          count_err == cudaSuccess ? "cudaGetDeviceCount: 0 devices"
                                                   : cudaGetErrorString(count_err),
                          ")");
  if (p.gpus.empty())
    for (int W = 1; W <= meta.visible; W *= 2) p.gpus.push_back(W);
  // Never NVLink multicast (the device README): forced off before the first communicator.
  setenv("NCCL_NVLS_ENABLE", "0", 1);

  cudaDeviceProp prop{};
  MOEBLAZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  meta.gpu = prop.name;
  meta.driver = driver_version();
  meta.commit = git_commit();
  meta.date = utc_date_iso();
  meta.nccl = "none";
#ifdef MOEBLAZE_WITH_NCCL
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess)
    meta.nccl = detail::concat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
#endif
  std::cerr << "bench ep: " << meta.gpu << " x" << meta.visible << " visible, driver "
            << meta.driver << ", NCCL " << meta.nccl << ", commit " << meta.commit << "; W in {";
  for (size_t i = 0; i < p.gpus.size(); ++i) std::cerr << (i ? "," : "") << p.gpus[i];
  std::cerr << "}\n";

  Report rep(f, meta, p.mode);
  bool failed = false;
  {
    std::map<int, std::unique_ptr<Comms>> comm_cache;  // per W, destroyed before the summary
    for (const NamedConfig* nc : p.configs) failed |= bench_config(f, p, meta, *nc, rep, comm_cache);
  }
  rep.print(f.json ? std::cerr : std::cout);
  if (!f.md.empty()) rep.write_md(f.md);
  if (failed) throw CLI::RuntimeError(kExitFailure);
}

}  // namespace

void add_bench_ep_command(CLI::App& bench) {
  auto flags = std::make_shared<Flags>();
  CLI::App* sub = bench.add_subcommand(
      "ep", "expert parallelism over NCCL: tokens/s and exchange share of forward+backward at "
            "W GPUs (weak and strong scaling) against the single-GPU layer");
  sub->add_option("--config", flags->config,
                  "a named config, a comma list, 'all', or 'list' (prints them)")
      ->capture_default_str();
  sub->add_option("--gpus", flags->gpus,
                  "comma list of GPU counts W (default: 1 and every power of two <= the visible "
                  "GPUs); W = 1 is the single-GPU baseline");
  sub->add_option("--scaling", flags->scaling, "weak, strong or both")->capture_default_str();
  sub->add_option("--mode", flags->mode, "the local layer's mode: keep_h or recompute")
      ->capture_default_str();
  sub->add_option("--chunks", flags->chunks,
                  "comma list of EpOptions::chunks for the W >= 2 rows (one row each; > 1 "
                  "pipelines the exchanges with the local layer)")
      ->capture_default_str();
  sub->add_option("--reps", flags->reps, "timed repetitions (median; >= 20)")->capture_default_str()
      ->check(integer_in(1, INT32_MAX));
  sub->add_option("--warmup", flags->warmup, "untimed repetitions first")->capture_default_str()
      ->check(integer_in(0, INT32_MAX));
  sub->add_option("--seed", flags->seed, "seed of inputs and routing")->capture_default_str()
      ->check(unsigned_integer());
  sub->add_option("--out", flags->out, "append the JSON lines to this file");
  sub->add_option("--md", flags->md, "also write the table as Markdown to this file");
  sub->add_flag("--json", flags->json, "JSON lines on stdout (the table goes to stderr)");
  sub->footer(
      "Rows (bf16, SwiGLU, softmax top-K of N(0, 1) logits), per config, scaling and W:\n"
      "  W = 1             the single-GPU layer (layer_forward + layer_backward on GPU 0, plan\n"
      "                    built before timing, as bench layer): the baseline of both scalings\n"
      "  W >= 2            ep_forward + ep_backward over NCCL, one thread per GPU 0..W-1, E/W\n"
      "                    experts per rank, host routing with global expert ids\n"
      "  weak              T tokens per rank (the config's T), W*T in all\n"
      "  strong            the config's T tokens in all, T/W per rank (the baseline's routing)\n"
      "  chunks            W >= 2: one row per --chunks entry (EpOptions::chunks: each rank's\n"
      "                    tokens cut into that many exchanges, pipelined with the local layer)\n"
      "Columns:\n"
      "  fwd/bwd/step ms   median over --reps of the max over ranks; host wall clock after a\n"
      "                    stream sync, L2 flushed and ranks lined up at a barrier before each\n"
      "  tokens/s          global tokens / step ms\n"
      "  speed-up          tokens/s over the W = 1 row's: strong step_1/step_W, weak\n"
      "                    W*step_1/step_W\n"
      "  exchange          EpTimings exchange_s / total_s of both calls, mean over ranks (host\n"
      "                    wall time in the collectives, waiting for peers included; with\n"
      "                    chunks > 1 the row exchanges are queued on NCCL's own stream and only\n"
      "                    the queueing and the agreements count here)\n"
      "  local layer ms    layer_forward + layer_backward inside the EP calls, max over ranks\n"
      "                    (chunks > 1: the host time of queueing them, not their device time)\n"
      "  pipeline ms       chunks > 1: EpTimings pipeline_s, mean over ranks: the host's wait at\n"
      "                    the end of each call for the overlapped local layers and row\n"
      "                    exchanges, which the host cannot split; '-' for W = 1, 0 for chunks 1\n"
      "  other ms          the rest of the EP calls, mean over ranks: dispatch lists and local\n"
      "                    plan built on the host, row gathers and combines\n"
      "  rows sent / pairs token rows sent to expert ranks (a token once per rank it uses) over\n"
      "                    the routing's pairs: the deduplication\n"
      "Rows that cannot run are listed with the reason (needs W GPUs, no NCCL, E not divisible\n"
      "by W, out of memory). NCCL_NVLS_ENABLE=0 is forced.\n"
      "Exit status: 0 ok, 1 a row failed, 2 bad flags or no GPU.");
  sub->callback([flags] { run_bench(*flags); });
}

}  // namespace moeblaze::tools

#endif  // MOEBLAZE_WITH_CUDA
