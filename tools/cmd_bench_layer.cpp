// `moeblaze bench layer`: forward and backward of the MoE layer on the GPU, per named config and
// implementation (moeblaze, moeblaze-recompute, materialized, dense-bound; moeblaze-fp8 and
// moeblaze-recompute-fp8 on request: the same layer with FP8 compute), by docs/DESIGN.md's
// protocol: CUDA events around the region, warm-up first, median of --reps (>= 20) repetitions,
// L2 flushed between repetitions by writing a 256 MiB buffer,
// backward = median(fwd+bwd) - median(fwd).
// Rows carry kept-for-backward bytes (SavedForBackward::bytes() + RoutingPlan::bytes(), read off
// the allocator's buffers), peak device bytes above the inputs (PeakScope over forward+backward)
// and the max relative error against a float64 host reference on a random subsample of tokens
// (out and dx rows, and the d_pair_weights of those tokens; the weight gradients would need the
// whole layer in float64, so they are tested by the GPU tests instead).
//
// Also measures the aggregation kernel (step 3) against the device-to-device copy ceiling
// measured in the same run: rows with bench "aggregate".
//
// --steps: each step's GPU time inside the real call (rows "layer-call-step"), from CUDA events at
// the layer's step marks (cuda/layer/step_marks.hpp). --search: instead of the impls, every legal
// kernel of each GEMM timed inside the real keep_h call against the automatic choice (rows
// "layer-search"; search_in_call below).
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cmd_bench_util.hpp"
#include "commands.hpp"
#include "configs.hpp"
#include "flags.hpp"
#include "layer_impls.hpp"
#include "core/parallel.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_cuda.hpp"
#include "cuda/layer/step_marks.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {


struct BenchFlags {
  std::string config = "all";
  std::string impl = "moeblaze,moeblaze-recompute,materialized,dense-bound";
  std::string activation;  // "" = the config's own (swiglu; the grid's gpt-oss: swiglu-oai)
  int reps = 20;
  int warmup = 2;
  int sample_tokens = 16;
  uint64_t seed = 1234;
  std::string out;  // append JSON lines here
  bool json = false;
  bool no_aggregate = false;
  bool breakdown = false;
  // --steps: each step's ms inside the real forward + backward call (the layer's step marks).
  bool steps = false;
  // --search: every legal kernel of each GEMM in turn, timed inside the real call (below).
  bool search = false;
  int rounds = 5;  // --search: rotated rounds, reps spread over them
  std::string search_gemms;  // --search: these GEMMs only (comma list; "" = all six)
  std::string slice;  // "i/k": every k-th of --config's shapes from the i-th (split runs)
  // Routing of the plan timed: "topk" (softmax top-K, the benchmark routing) or a token
  // rounding mode ("nr-f", "sr-f", "up", "down") applied to that top-K with tile m_tile.
  std::string routing = "topk";
  int m_tile = 128;
  std::string shape;  // "T,d,n,E,K": one unnamed shape instead of --config
  std::string kernels;  // kernel overrides (kernel_config.hpp); "" = MOEBLAZE_KERNELS or none
  bool show_kernels = false;
  // Expert biases b1, b2 (and db1, db2) on the moeblaze impls: rows "<impl>+bias", no error
  // column (the sampled reference has no biases).
  bool bias = false;
  // Exit 1 after the tables when a moeblaze row's sampled error exceeds `run --check`'s bound
  // (check_tolerance) or is missing (NaN output): a timing run that is also a correctness run.
  bool check = false;
};

// The routing field of the rows: "softmax-topk" or, e.g., "softmax-topk+nr-f/128".
std::string routing_label(const BenchFlags& f) {
  return f.routing == "topk" ? std::string("softmax-topk")
                             : "softmax-topk+" + f.routing + "/" + std::to_string(f.m_tile);
}

// --activation, else the config's own activation (the grid's gpt-oss rows: swiglu-oai).
std::string activation_of(const BenchFlags& f, const NamedConfig& nc) {
  if (!f.activation.empty()) return f.activation;
  return nc.activation ? nc.activation : "swiglu";
}

// ---- float64 reference on sampled tokens --------------------------------------------------------

template <typename T>
std::vector<T> download(const void* src, size_t count) {
  std::vector<T> v(count);
  if (count) MOEBLAZE_CUDA_CHECK(cudaMemcpy(v.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// out and dx rows of the sampled tokens, and d_pair_weights of their pairs, in float64.
struct SampleRef {
  std::vector<int64_t> tokens;
  std::vector<double> out, dx, dpw;  // (tokens, d), (tokens, d), (pairs of the tokens,)
};

SampleRef reference_on_sample(const LayerConfig& c, const RoutingPlan& host_plan, const bf16* x,
                              const bf16* w1, const bf16* w2, const bf16* dout, int count,
                              uint64_t seed) {
  SampleRef ref;
  std::mt19937_64 rng(seed ^ 0x5eed);
  std::vector<int64_t> all(c.T);
  for (int64_t t = 0; t < c.T; ++t) all[t] = t;
  std::shuffle(all.begin(), all.end(), rng);
  ref.tokens.assign(all.begin(), all.begin() + std::min<int64_t>(count, c.T));
  std::sort(ref.tokens.begin(), ref.tokens.end());
  const RoutingPlanView pv = host_plan.view();
  const int64_t d = c.d, n = c.n, R = c.w1_rows();
  const bool gated = is_gated(c.activation);

  // Host copies of the sampled rows and of the experts they use.
  std::map<int, std::pair<std::vector<bf16>, std::vector<bf16>>> experts;
  std::vector<std::vector<bf16>> xs, dos;
  for (int64_t t : ref.tokens) {
    xs.push_back(download<bf16>(x + t * d, d));
    dos.push_back(download<bf16>(dout + t * d, d));
    for (int32_t p = pv.token_pair_offsets[t]; p < pv.token_pair_offsets[t + 1]; ++p) {
      const int e = pv.token_expert_indices[p];
      if (!experts.count(e))
        experts[e] = {download<bf16>(w1 + int64_t(e) * R * d, R * d),
                      download<bf16>(w2 + int64_t(e) * d * n, d * n)};
    }
  }
  const int64_t ns = int64_t(ref.tokens.size());
  ref.out.assign(ns * d, 0.0);
  ref.dx.assign(ns * d, 0.0);
  std::vector<int64_t> pair_base(ns + 1, 0);
  for (int64_t i = 0; i < ns; ++i) {
    const int64_t t = ref.tokens[i];
    pair_base[i + 1] = pair_base[i] + pv.token_pair_offsets[t + 1] - pv.token_pair_offsets[t];
  }
  ref.dpw.assign(pair_base[ns], 0.0);
  parallel_for(0, ns, 1, [&](int64_t i) {
    const int64_t t = ref.tokens[i];
    std::vector<double> h(R), a(n), dap(n), dh(R);
    for (int32_t p = pv.token_pair_offsets[t]; p < pv.token_pair_offsets[t + 1]; ++p) {
      const int64_t r = pv.token_index_map[p];
      const double s = pv.slot_weights[r];
      const auto& W = experts.at(pv.token_expert_indices[p]);
      const bf16* W1 = W.first.data();
      const bf16* W2 = W.second.data();
      for (int64_t j = 0; j < R; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < d; ++k) acc += double(float(W1[j * d + k])) * double(float(xs[i][k]));
        h[j] = acc;
      }
      for (int64_t j = 0; j < n; ++j)
        a[j] = gated ? reference::activation_f(c.activation, h[j]) *
                           reference::activation_up(c.activation, h[n + j])
                     : reference::activation_f(c.activation, h[j]);
      std::fill(dap.begin(), dap.end(), 0.0);
      for (int64_t k = 0; k < d; ++k) {
        double y = 0;
        const double g = float(dos[i][k]);
        for (int64_t j = 0; j < n; ++j) {
          const double w = float(W2[k * n + j]);
          y += w * a[j];
          dap[j] += w * g;
        }
        ref.out[i * d + k] += s * y;
      }
      double ds = 0;
      for (int64_t j = 0; j < n; ++j) {
        ds += dap[j] * a[j];
        const double da = s * dap[j];
        if (gated) {
          dh[j] = da * reference::activation_up(c.activation, h[n + j]) *
                  reference::activation_df(c.activation, h[j]);
          dh[n + j] = da * reference::activation_f(c.activation, h[j]) *
                      reference::activation_dup(c.activation, h[n + j]);
        } else {
          dh[j] = da * reference::activation_df(c.activation, h[j]);
        }
      }
      ref.dpw[pair_base[i] + (p - pv.token_pair_offsets[t])] = ds;
      for (int64_t j = 0; j < R; ++j)
        for (int64_t k = 0; k < d; ++k) ref.dx[i * d + k] += dh[j] * double(float(W1[j * d + k]));
    }
  });
  return ref;
}

template <typename A>
double rel_frob(const std::vector<A>& a, const std::vector<double>& r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double x = double(float(a[i]));
    if (std::isnan(x)) return INFINITY;
    num += (x - r[i]) * (x - r[i]);
    den += r[i] * r[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

double sample_error(const SampleRef& ref, const RoutingPlan& host_plan, const LayerConfig& c,
                    const void* out, const void* dx, const float* dpw) {
  const int64_t d = c.d, ns = int64_t(ref.tokens.size());
  std::vector<bf16> o(ns * d), g(ns * d);
  std::vector<float> p;
  const RoutingPlanView pv = host_plan.view();
  for (int64_t i = 0; i < ns; ++i) {
    const int64_t t = ref.tokens[i];
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(o.data() + i * d, static_cast<const bf16*>(out) + t * d, d * 2, cudaMemcpyDeviceToHost));
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(g.data() + i * d, static_cast<const bf16*>(dx) + t * d, d * 2, cudaMemcpyDeviceToHost));
    const int32_t p0 = pv.token_pair_offsets[t], p1 = pv.token_pair_offsets[t + 1];
    const std::vector<float> part = download<float>(dpw + p0, size_t(p1 - p0));
    p.insert(p.end(), part.begin(), part.end());
  }
  return std::max({rel_frob(o, ref.out), rel_frob(g, ref.dx), rel_frob(p, ref.dpw)});
}

// ---- each step inside the real call --------------------------------------------------------------

// The GPU time of each step of one real layer_forward + layer_backward call: a CUDA event at each
// of the layer's step marks (cuda/layer/step_marks.hpp), so the steps run on the call's own
// workspaces, in its order, on its values, where `--breakdown` replays them on buffers of its own
// (docs/notes/gathered-gemms.md, "Each GEMM inside the layer call"). A step's ms runs from the
// mark before it (the call's start for the first) to its own; a step marked more than once (token
// chunks) is summed; "  rest of the call" is the last mark to the call's end.
class StepTimer final : public cuda::StepMarks {
 public:
  using Sample = std::vector<std::pair<std::string, double>>;  // (step, ms) in mark order

  StepTimer(cudaStream_t stream, void* flush) : stream_(stream), flush_(flush) {
    MOEBLAZE_CUDA_CHECK(cudaEventCreate(&start_));
    MOEBLAZE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~StepTimer() override {
    cuda::set_step_marks(nullptr);
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  void mark(cudaStream_t stream, const char* step) override {
    if (used_ == pool_.size()) {
      cudaEvent_t e;
      MOEBLAZE_CUDA_CHECK(cudaEventCreate(&e));
      pool_.push_back(e);
    }
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(pool_[used_++], stream));
    names_.push_back(step);
  }

  // warmup + reps repetitions of: before() (untimed), the L2 flush, then fn() between the marks;
  // per timed repetition, each step's ms and, last, "call": the whole region's.
  template <typename Before, typename Fn>
  std::vector<Sample> samples(int warmup, int reps, Before&& before, Fn&& fn) {
    std::vector<Sample> out;
    for (int i = 0; i < warmup + reps; ++i) {
      before();
      write_l2_flush(flush_, i, stream_);
      used_ = 0;
      names_.clear();
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(start_, stream_));
      cuda::set_step_marks(this);
      try {
        fn();
      } catch (...) {
        cuda::set_step_marks(nullptr);
        throw;
      }
      cuda::set_step_marks(nullptr);
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      MOEBLAZE_CUDA_CHECK(cudaEventSynchronize(stop_));
      if (i < warmup) continue;
      Sample s;
      cudaEvent_t prev = start_;
      for (size_t m = 0; m < used_; ++m) {
        add(s, names_[m], elapsed(prev, pool_[m]));
        prev = pool_[m];
      }
      add(s, "  rest of the call", elapsed(prev, stop_));
      s.emplace_back("call", elapsed(start_, stop_));
      out.push_back(std::move(s));
    }
    return out;
  }

 private:
  static double elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    MOEBLAZE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
  static void add(Sample& s, const std::string& step, double ms) {
    for (auto& [name, v] : s)
      if (name == step) {
        v += ms;
        return;
      }
    s.emplace_back(step, ms);
  }
  cudaStream_t stream_;
  void* flush_;
  cudaEvent_t start_, stop_;
  std::vector<cudaEvent_t> pool_;
  std::vector<const char*> names_;
  size_t used_ = 0;
};

// Per step (in first-seen order), every sample's ms pooled.
using PooledSteps = std::vector<std::pair<std::string, std::vector<double>>>;
PooledSteps pool_steps(const std::vector<StepTimer::Sample>& samples) {
  PooledSteps out;
  for (const StepTimer::Sample& s : samples)
    for (const auto& [name, ms] : s) {
      auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == name; });
      if (it == out.end()) {
        out.emplace_back(name, std::vector<double>{});
        it = out.end() - 1;
      }
      it->second.push_back(ms);
    }
  return out;
}

// One step's median over the pooled samples; NaN where the step was not marked.
double step_median(const PooledSteps& pooled, const std::string& step) {
  for (const auto& [name, v] : pooled)
    if (name == step) return median(v);
  return NAN;
}

// The step each GEMM (a LayerKernels index) is timed as.
const char* gemm_step(int gemm) {
  using LK = cuda::gemm::LayerKernels;
  switch (gemm) {
    case LK::kUp: return cuda::step::kUpProj;
    case LK::kDown: return cuda::step::kDownProj;
    case LK::kDh: return cuda::step::kDh;
    case LK::kDw2: return cuda::step::kDw2;
    case LK::kDx: return cuda::step::kDx;
    default: return cuda::step::kDw1;
  }
}

// The checked call's outputs (out, dx, the pair weights' gradient) set to 0xFF bytes, NaN in bf16
// and fp32: an element the call leaves unwritten fails the sampled error.
void poison_outputs(const LayerTensors& lt) {
  for (const DevBuf* b : {&lt.out, &lt.dx, &lt.dpw})
    MOEBLAZE_CUDA_CHECK(cudaMemset(b->p, 0xFF, b->bytes));
}

// ---- one config -------------------------------------------------------------------------------

struct Row {
  std::string impl;
  double fwd = 0, bwd = 0, total = 0;
  size_t kept = 0, peak = 0;
  double err = NAN;
};

struct Meta {
  std::string gpu, driver, commit, date;
};

void emit(const BenchFlags& f, const Meta& m, const NamedConfig& nc, const LayerConfig& c,
          int64_t S, const Row& r, int ns, Table& table, std::ofstream* out) {
  const double ff = forward_flops(c, S), fb = backward_flops(c, S);
  JsonLine j;
  j.add("bench", "layer").add("config", nc.name).add("impl", r.impl);
  if (nc.model) j.add("model", nc.model);  // grid rows: the public model of the shape
  j.add("T", c.T).add("d", c.d).add("n", c.n).add("E", c.E).add("K", c.K).add("S", S);
  j.add("activation", activation_name(c.activation)).add("routing", routing_label(f));
  j.add("fwd_ms", r.fwd).add("bwd_ms", r.bwd).add("total_ms", r.total);
  j.add("fwd_tflops", ff / r.fwd / 1e9).add("bwd_tflops", fb / r.bwd / 1e9);
  j.add("total_tflops", (ff + fb) / r.total / 1e9);
  j.add("kept_bytes", uint64_t(r.kept)).add("peak_bytes", uint64_t(r.peak));
  if (std::isnan(r.err)) j.add_null("max_rel_err"); else j.add("max_rel_err", r.err);
  j.add("err_tokens", std::isnan(r.err) ? 0 : ns).add("reps", f.reps);
  j.add("kernels", cuda::gemm::kernel_overrides().spec);  // the overrides in force ("" = none)
  j.add("gpu", m.gpu).add("driver", m.driver).add("commit", m.commit).add("date", m.date);
  const std::string line = j.str();
  if (f.json) std::cout << line << "\n" << std::flush;
  if (out) *out << line << "\n" << std::flush;
  table.add_row({f.routing == "topk" ? std::string(nc.name) : nc.name + (" " + f.routing), r.impl, fixed(r.fwd, 3), fixed(r.bwd, 3), fixed(r.total, 3),
                 fixed(ff / r.fwd / 1e9, 1), fixed(fb / r.bwd / 1e9, 1),
                 fixed((ff + fb) / r.total / 1e9, 1), human_bytes(r.kept), human_bytes(r.peak),
                 std::isnan(r.err) ? "-" : scientific(r.err, 2)});
}

// --steps rows and table lines: each step's median ms inside the call, and its share of the call.
void emit_call_steps(const BenchFlags& f, const Meta& meta, const NamedConfig& nc, int64_t S,
                     const std::string& impl, const PooledSteps& pooled, Table& table,
                     std::ofstream* out) {
  const double call = step_median(pooled, "call");
  for (const auto& [name, v] : pooled) {
    const double ms = median(v);
    JsonLine j;
    j.add("bench", "layer-call-step").add("config", nc.name);
    if (nc.model) j.add("model", nc.model);
    j.add("impl", impl).add("step", name).add("S", S).add("ms", ms);
    j.add("share_of_call", call > 0 ? ms / call : 0.0).add("reps", int64_t(v.size()));
    j.add("gpu", meta.gpu).add("driver", meta.driver).add("commit", meta.commit);
    j.add("date", meta.date);
    if (f.json) std::cout << j.str() << "\n";
    if (out) *out << j.str() << "\n" << std::flush;
    table.add_row({nc.name, impl, name, fixed(ms, 3),
                   name == "call" ? "-" : fixed(100.0 * ms / call, 1)});
  }
}

// One kernel choice timed by --search: the automatic one (gemm < 0) or one candidate of one GEMM.
struct SearchEntry {
  int gemm = -1;              // LayerKernels index; -1: every GEMM on its automatic kernel
  std::string spec;           // the candidate's override spec ("" for the automatic choice)
  std::string kernel;         // describe() of the candidate
  cuda::gemm::KernelOverrides overrides;
  std::string skipped;        // why it did not run ("" if it ran)
  double err = NAN;           // sampled max rel err of its checked call
  std::vector<StepTimer::Sample> samples;     // every timed call's steps, all rounds
  PooledSteps pooled;                         // the same pooled per step, after the rounds
  std::vector<std::vector<double>> round_ms;  // per round: each GEMM's step median, then call's
};

// --search-gemms as a mask over LayerKernels' GEMMs (all for ""); throws naming a bad entry.
std::vector<bool> search_gemm_mask(const std::string& list) {
  using LK = cuda::gemm::LayerKernels;
  std::vector<bool> wanted(LK::kCount, list.empty());
  for (const std::string& g : split_commas(list)) {
    bool known = false;
    for (int i = 0; i < LK::kCount; ++i)
      if (g == LK::name(i) || g + "_proj" == LK::name(i)) wanted[i] = known = true;
    MOEBLAZE_REQUIRE(known, "search-gemms: '", g, "' is not one of up, down, dh, dw2, dx, dw1");
  }
  return wanted;
}

// --search: every legal kernel of each GEMM (kernel_candidates: the set the rule picks from) timed
// inside the real keep_h forward + backward call, one GEMM off its automatic choice at a time.
// Each choice first runs once, untimed, checked against the float64 sample; then --rounds rounds
// of warm-up + ceil(reps / rounds) timed calls per choice, their order rotated each round so that
// clock and temperature drift fall on all alike. The verdict per GEMM compares that GEMM's own
// step (the events at its marks) under each candidate with the automatic choice's, pooled medians:
// the search's question asked where the kernel runs, on the call's values, between its neighbours.
void search_in_call(const BenchFlags& f, const Meta& meta, const NamedConfig& nc,
                    const LayerConfig& c, int64_t S, const RoutingPlan& plan,
                    const RoutingPlan& host_plan, const LayerTensors& lt, const SampleRef& ref,
                    StepTimer& st, Table& table, std::ofstream* jsonl,
                    std::vector<std::string>& failures) {
  namespace gg = cuda::gemm;
  using LK = gg::LayerKernels;
  const gg::KernelOverrides base = gg::kernel_overrides();
  const gg::KernelShape shape{S, c.E, c.d, c.n, c.activation};
  const LK chosen = gg::choose_kernels(shape, base);
  const std::vector<bool> wanted = search_gemm_mask(f.search_gemms);
  std::vector<SearchEntry> entries(1);
  entries[0].overrides = base;
  for (int g = 0; g < LK::kCount; ++g) {
    if (!wanted[g]) continue;
    for (const gg::KernelCandidate& k : gg::kernel_candidates(g, shape)) {
      if (k.kernel == chosen.at(g)) continue;  // the automatic entry times it
      SearchEntry e;
      e.gemm = g;
      e.spec = k.spec;
      e.kernel = gg::describe(k.kernel);
      e.overrides = gg::layer_kernel_overrides(base, gg::parse_kernel_overrides(k.spec));
      entries.push_back(std::move(e));
    }
  }
  // The overrides in force again on every way out (a device error ends the config's search).
  struct Restore {
    bool had_flag;
    gg::KernelOverrides base;
    ~Restore() {
      if (had_flag) gg::set_kernel_overrides(base); else gg::clear_kernel_overrides();
    }
  } restore{!f.kernels.empty(), base};
  const DevBuf &out = lt.out, &dx = lt.dx, &dpw = lt.dpw;
  SavedForBackward saved;
  LayerOptions opts;
  opts.mode = LayerMode::keep_h;
  opts.dh_over_h = true;
  auto call = [&] {
    layer_forward(c, plan, lt.xv, lt.w1v, lt.w2v, LayerBiases{}, lt.outv, saved, opts);
    layer_backward(c, plan, lt.xv, lt.w1v, lt.w2v, LayerBiases{}, lt.doutv, saved, lt.grads, opts);
  };
  auto reset = [&] { saved = SavedForBackward(); };
  const double tol = check_tolerance(parse_impl("moeblaze"), DType::bf16);
  // Each choice once, untimed and checked (outputs poisoned first: NaN fails the error).
  for (SearchEntry& e : entries) {
    gg::set_kernel_overrides(e.overrides);
    try {
      poison_outputs(lt);
      reset();
      call();
      MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
      e.err = sample_error(ref, host_plan, c, out.p, dx.p, dpw.as<float>());
      if (!(e.err <= tol))
        failures.push_back(std::string(nc.name) + " search " +
                           (e.gemm < 0 ? std::string("automatic") : e.spec) + ": max rel err " +
                           scientific(e.err, 2) + " > " + scientific(tol, 2));
    } catch (const Unsupported& x) {
      e.skipped = x.what();
    } catch (const DeviceError& x) {
      e.skipped = std::string("device error: ") + x.what();
      (void)cudaGetLastError();
    }
  }
  if (!entries[0].skipped.empty()) {
    std::cerr << "bench layer: " << nc.name << ": search skipped: the automatic choice did not run: "
              << entries[0].skipped << "\n";
    return;
  }
  const int rounds = std::max(1, f.rounds);
  const int per_round = std::max(1, (f.reps + rounds - 1) / rounds);
  const size_t count = entries.size();
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < count; ++k) {
      SearchEntry& e = entries[(k + size_t(r)) % count];
      if (!e.skipped.empty()) continue;
      gg::set_kernel_overrides(e.overrides);
      std::vector<StepTimer::Sample> t = st.samples(r == 0 ? f.warmup : 1, per_round, reset, call);
      std::vector<double> per;  // each GEMM's step median this round, then the call's
      const PooledSteps pooled = pool_steps(t);
      for (int g = 0; g < LK::kCount; ++g) per.push_back(step_median(pooled, gemm_step(g)));
      per.push_back(step_median(pooled, "call"));
      e.round_ms.push_back(per);
      e.samples.insert(e.samples.end(), t.begin(), t.end());
    }
    std::cerr << "bench layer: " << nc.name << " search round " << r + 1 << " of " << rounds
              << " done\n";
  }

  for (SearchEntry& e : entries) e.pooled = pool_steps(e.samples);
  // A choice's pooled median of one step (NaN where it did not run or has no such step).
  auto ms_of = [](const SearchEntry& e, const char* step) { return step_median(e.pooled, step); };
  const SearchEntry& aut = entries[0];
  for (const SearchEntry& e : entries) {
    for (int g = 0; g < LK::kCount; ++g) {
      if (e.gemm >= 0 ? g != e.gemm : !wanted[g]) continue;
      JsonLine j;
      j.add("bench", "layer-search").add("config", nc.name);
      if (nc.model) j.add("model", nc.model);
      j.add("T", c.T).add("d", c.d).add("n", c.n).add("E", c.E).add("K", c.K).add("S", S);
      j.add("activation", activation_name(c.activation)).add("gemm", LK::name(g));
      j.add("kernel", e.gemm < 0 ? gg::describe(chosen.at(g)) : e.kernel);
      j.add("spec", e.spec).add("auto", e.gemm < 0);
      if (!e.skipped.empty()) {
        j.add("skipped", e.skipped);
      } else {
        j.add("ms", ms_of(e, gemm_step(g))).add("call_ms", ms_of(e, "call"));
        std::vector<double> gr, cr;
        for (const auto& per : e.round_ms) {
          gr.push_back(per[size_t(g)]);
          cr.push_back(per.back());
        }
        j.add("round_ms", gr).add("call_round_ms", cr);
        if (std::isnan(e.err)) j.add_null("max_rel_err"); else j.add("max_rel_err", e.err);
      }
      j.add("base_kernels", base.spec).add("rounds", rounds).add("reps", rounds * per_round);
      j.add("gpu", meta.gpu).add("driver", meta.driver).add("commit", meta.commit);
      j.add("date", meta.date);
      if (f.json) std::cout << j.str() << "\n";
      if (jsonl) *jsonl << j.str() << "\n" << std::flush;
    }
  }
  // The verdict per GEMM: the automatic kernel's step against the fastest that ran.
  for (int g = 0; g < LK::kCount; ++g) {
    if (!wanted[g]) continue;
    const double auto_ms = ms_of(aut, gemm_step(g));
    const SearchEntry* best = &aut;
    double best_ms = auto_ms;
    for (const SearchEntry& e : entries)
      if (e.gemm == g && e.skipped.empty() && ms_of(e, gemm_step(g)) < best_ms) {
        best = &e;
        best_ms = ms_of(e, gemm_step(g));
      }
    // Whether the fastest beat the automatic choice in every round's medians, too.
    std::string every = "-";
    if (best != &aut) {
      bool all = true;
      for (size_t r = 0; r < best->round_ms.size() && r < aut.round_ms.size(); ++r)
        all = all && best->round_ms[r][size_t(g)] < aut.round_ms[r][size_t(g)];
      every = all ? "yes" : "no";
    }
    int ran = 0;
    for (const SearchEntry& e : entries) ran += e.gemm == g && e.skipped.empty();
    table.add_row({nc.name, LK::name(g), gg::describe(chosen.at(g)), fixed(auto_ms, 3),
                   best == &aut ? std::string("(the automatic)") : best->kernel, fixed(best_ms, 3),
                   fixed(auto_ms / best_ms, 3),
                   best == &aut ? "-" : fixed(ms_of(aut, "call") / ms_of(*best, "call"), 3), every,
                   std::to_string(ran + 1)});
  }
}

// The command's tables, filled config by config and printed at the end.
struct Tables {
  Table main{{{"config", Align::left}, {"impl", Align::left}, {"fwd ms"}, {"bwd ms"},
              {"total ms"}, {"fwd TFLOPS"}, {"bwd TFLOPS"}, {"total TFLOPS"}, {"kept"},
              {"peak"}, {"max rel err"}}};
  Table agg{{{"config", Align::left}, {"S"}, {"aggregate us"}, {"GB/s"}, {"copy GB/s"},
             {"% of copy"}}};
  Table step{{{"config", Align::left}, {"step", Align::left}, {"ms"}, {"TFLOPS"}, {"GB/s"}}};
  Table call{{{"config", Align::left}, {"impl", Align::left}, {"step in the call", Align::left},
              {"ms"}, {"% of call"}}};
  Table search{{{"config", Align::left}, {"GEMM", Align::left}, {"automatic", Align::left},
                {"ms"}, {"fastest", Align::left}, {"ms"}, {"auto / fastest"},
                {"call: auto / fastest's"}, {"every round"}, {"kernels"}}};
};

void bench_config(const BenchFlags& f, const Meta& meta, const NamedConfig& nc,
                  const std::vector<std::string>& impls, void* flush, Tables& tables,
                  std::ofstream* jsonl, std::vector<std::string>& failures) {
  Table& table = tables.main;
  Table& agg_table = tables.agg;
  Table& step_table = tables.step;
  const LayerConfig c = layer_config(nc, parse_activation(activation_of(f, nc)), DType::bf16);
  cuda::gemm::check_gemm_shape(c.d, c.n);  // Unsupported naming the dimension: skip the config
  const cudaStream_t stream = nullptr;
  const int64_t R = c.w1_rows();

  // Routing: the benchmark's (top-K, or a token rounding of it), on the host; the plan is copied to
  // the device.
  const Routing routing = benchmark_routing(c, f.seed, f.routing, f.m_tile);
  RoutingPlan host_plan;
  build_routing_plan(routing.view(), PlanBuilder::atomic_free, host_plan);
  const int64_t S = host_plan.S();
  if (f.show_kernels) {
    const cuda::gemm::LayerKernels k = cuda::gemm::choose_kernels(
        {S, c.E, c.d, c.n, c.activation});
    for (int i = 0; i < cuda::gemm::LayerKernels::kCount; ++i)
      std::cerr << "bench layer: " << nc.name << " " << cuda::gemm::LayerKernels::name(i) << ": "
                << cuda::gemm::describe(k.at(i)) << " [" << k.at(i).rule << "]\n";
  }
  RoutingPlan plan(Device::cuda, c.T, c.E, S);
  auto up = [](void* dst, const void* src, size_t b) {
    if (b) MOEBLAZE_CUDA_CHECK(cudaMemcpy(dst, src, b, cudaMemcpyHostToDevice));
  };
  up(plan.expert_token_offsets(), host_plan.expert_token_offsets(), 4 * (c.E + 1));
  up(plan.expert_token_indices(), host_plan.expert_token_indices(), 4 * S);
  up(plan.slot_weights(), host_plan.slot_weights(), 4 * S);
  up(plan.token_pair_offsets(), host_plan.token_pair_offsets(), 4 * (c.T + 1));
  up(plan.token_expert_indices(), host_plan.token_expert_indices(), 4 * S);
  up(plan.token_index_map(), host_plan.token_index_map(), 4 * S);

  // Inputs and outputs (the caller's memory).
  const LayerTensors lt(c, c.E, S, f.seed, stream);
  const DevBuf &x = lt.x, &w1 = lt.w1, &w2 = lt.w2, &dout = lt.dout, &out = lt.out, &dx = lt.dx,
               &dw1 = lt.dw1, &dw2 = lt.dw2, &dpw = lt.dpw;
  const TensorView &xv = lt.xv, &w1v = lt.w1v, &w2v = lt.w2v, &outv = lt.outv,
                   &doutv = lt.doutv;
  const LayerGrads& g = lt.grads;

  const SampleRef ref = reference_on_sample(c, host_plan, x.as<bf16>(), w1.as<bf16>(),
                                            w2.as<bf16>(), dout.as<bf16>(), f.sample_tokens, f.seed);
  GpuTimer timer(stream, flush);
  StepTimer step_timer(stream, flush);
  // With --bias: b1 (E, w1_rows), b2 (E, d) N(0, 0.5), their gradients beside the others.
  const int64_t Rb = f.bias ? R : 0, db = f.bias ? c.d : 0;
  DevBuf b1(c.E * Rb * 2), b2(c.E * db * 2), db1(c.E * Rb * 2), db2(c.E * db * 2);
  LayerBiases biases;
  LayerGrads gb = g;
  if (f.bias) {
    cuda::fill_normal(b1.p, DType::bf16, c.E * R, f.seed + 5, 0.5f, stream);
    cuda::fill_normal(b2.p, DType::bf16, c.E * c.d, f.seed + 6, 0.5f, stream);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
    biases = {TensorView(b1.p, DType::bf16, Device::cuda, {c.E, R}),    // (E, w1_rows)
              TensorView(b2.p, DType::bf16, Device::cuda, {c.E, c.d})};  // (E, d)
    gb.db1 = TensorView(db1.p, DType::bf16, Device::cuda, {c.E, R});
    gb.db2 = TensorView(db2.p, DType::bf16, Device::cuda, {c.E, c.d});
  }

  for (const std::string& impl : impls) {
    if (f.search) break;  // --search times its own choices (below) instead of the impls
    Row r;
    r.impl = impl;
    const bool biased = f.bias && impl != "dense-bound" && impl != "materialized";
    if (f.bias && !biased) {  // no biases there: nothing to compare
      std::cerr << "bench layer: " << nc.name << " " << impl << ": skipped (--bias: no expert "
                << "biases there)\n";
      continue;
    }
    if (biased) r.impl += "+bias";
    try {
      if (impl == "dense-bound") {
        cuda::DenseBound db(c, S, f.seed + 9, stream);
        r.fwd = timer.median_ms(f.warmup, f.reps, [] {}, [&] { db.forward(); });
        r.total = timer.median_ms(f.warmup, f.reps, [] {}, [&] {
          db.forward();
          db.backward();
        });
        r.kept = db.kept_bytes();
        r.peak = db.transient_bytes();
      } else {
        const Impl& im = parse_impl(impl);
        LayerOptions opts;
        opts.mode = im.mode;
        LayerConfig lc = c;
        lc.compute = im.compute;
        // FP8 rows: the weights' codes in a cache told before each step that the weights
        // changed (an optimizer step per fwd+bwd): forward quantizes, backward reuses.
        Fp8WeightCache fp8_cache;
        if (is_fp8(im.compute)) opts.fp8_weights = &fp8_cache;
        opts.stream = stream;
        opts.dh_over_h = true;  // every step runs backward once from a fresh forward
        SavedForBackward saved;
        {
          // Memory and error on one untimed run (outputs poisoned first: NaN fails the error).
          poison_outputs(lt);
          PeakScope peak(Device::cuda);
          layer_forward(lc, plan, xv, w1v, w2v, biases, outv, saved, opts);
          MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
          r.kept = saved.bytes() + plan.bytes();
          layer_backward(lc, plan, xv, w1v, w2v, biases, doutv, saved, gb, opts);
          MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
          r.peak = peak.peak_above_start();
          if (!biased) r.err = sample_error(ref, host_plan, lc, out.p, dx.p, dpw.as<float>());
        }
        auto reset = [&] {  // free the last H outside the timing
          saved = SavedForBackward();
          fp8_cache.weights_changed();
        };
        r.fwd = timer.median_ms(f.warmup, f.reps, reset, [&] {
          layer_forward(lc, plan, xv, w1v, w2v, biases, outv, saved, opts);
        });
        auto step = [&] {
          layer_forward(lc, plan, xv, w1v, w2v, biases, outv, saved, opts);
          layer_backward(lc, plan, xv, w1v, w2v, biases, doutv, saved, gb, opts);
        };
        r.total = timer.median_ms(f.warmup, f.reps, reset, step);
        // The FP8 path has no step marks: its whole call would read as one step.
        if (f.steps && !is_fp8(im.compute))
          emit_call_steps(f, meta, nc, S, r.impl,
                          pool_steps(step_timer.samples(f.warmup, f.reps, reset, step)),
                          tables.call, jsonl);
      }
    } catch (const DeviceError& e) {  // e.g. out of device memory: the other impls still run
      std::cerr << "bench layer: " << nc.name << " " << impl << ": device error: " << e.what() << "\n";
      (void)cudaGetLastError();
      continue;
    }
    r.bwd = r.total - r.fwd;
    emit(f, meta, nc, c, S, r, int(ref.tokens.size()), table, jsonl);
    if (f.check && impl != "dense-bound" && !f.bias) {  // the rows with an error column
      const double tol = check_tolerance(parse_impl(impl), DType::bf16);
      if (!(r.err <= tol))
        failures.push_back(std::string(nc.name) + " " + impl + ": max rel err " +
                           scientific(r.err, 2) + " > " + scientific(tol, 2));
    }
    std::cerr << "bench layer: " << nc.name << " " << impl << " done\n";
  }

  if (f.search && S > 0)
    search_in_call(f, meta, nc, c, S, plan, host_plan, lt, ref, step_timer, tables.search, jsonl,
                   failures);

  if (f.breakdown && S > 0) {
    // Each of the eight steps alone (keep_h), on preallocated buffers, by the same protocol:
    // where the layer's time goes, and what the API adds (allocation, launch gaps) on top.
    const cuda::GemmOps& gm = cuda::gemm_ops();
    const int64_t cols = gm.ds_partials_cols(c.n);
    Buffer h(Device::cuda, size_t(S * R) * 2);
    // Whole-step (S, d) Y and dX̃: each GEMM once over every slot (the layer may chunk them).
    const cuda::TokenChunks whole = cuda::TokenChunks::none(S);
    Buffer fws(Device::cuda, cuda::forward_workspace(c, S, whole, nullptr).bytes);
    // The layer's placement: A', the ds partials and ds in dW1's bytes where they fit.
    void* dw1_bytes = dw1.as<bf16>();
    Buffer bws(Device::cuda,
               cuda::backward_workspace(c, S, LayerMode::keep_h, cols, whole, nullptr, false, dw1_bytes).bytes);
    const cuda::ForwardWorkspace fw = cuda::forward_workspace(c, S, whole, fws.data());
    const cuda::BackwardWorkspace bw =
        cuda::backward_workspace(c, S, LayerMode::keep_h, cols, whole, bws.data(), false, dw1_bytes);
    const RoutingPlanView pv = plan.view();
    const bf16* X = x.as<bf16>();
    const bf16* W1 = w1.as<bf16>();
    const bf16* W2 = w2.as<bf16>();
    const bf16* DO = dout.as<bf16>();
    const double snd = double(S) * c.n * c.d;
    const double up_f = 2.0 * double(S) * R * c.d;
    struct Step {
      const char* name;
      double flops, bytes;
      std::function<void()> fn;
    };
    const double agg_bytes = double(S) * c.d * 2 + double(c.T) * c.d * 2 + 4.0 * (c.T + 1) + 8.0 * S;
    const std::vector<Step> steps = {
        {"1 up-proj", up_f, 0, [&] { gm.up_proj(pv, X, W1, h.as<bf16>(), fw.a, c.d, c.n, c.activation, stream, nullptr); }},
        {"2 down-proj", 2 * snd, 0, [&] { gm.down_proj(pv, fw.a, W2, fw.y, c.d, c.n, stream, fw.scratch); }},
        {"3 aggregate", 0, agg_bytes, [&] { cuda::aggregate_rows(pv, fw.y, pv.slot_weights, out.p, c.d, DType::bf16, stream); }},
        {"4 dH", 2 * snd, 0, [&] { gm.dh_proj(pv, DO, W2, h.as<bf16>(), bw.ds_partials, bw.dh, bw.a_scaled, c.d, c.n, c.activation, stream); }},
        {"  ds reduce", 0, 4.0 * S * (cols + 1), [&] { gm.reduce_ds(bw.ds_partials, bw.ds, S, c.n, stream); }},
        {"5 dW2", 2 * snd, 0, [&] { gm.dw2_proj(pv, DO, bw.a_scaled, dw2.as<bf16>(), c.d, c.n, stream); }},
        {"6 dX~", up_f, 0, [&] { gm.dx_proj(pv, bw.dh, W1, bw.dx_slots, c.d, c.n, c.activation, stream, bw.scratch); }},
        {"7 dX aggregate", 0, agg_bytes - 4.0 * S, [&] { cuda::aggregate_rows(pv, bw.dx_slots, nullptr, dx.p, c.d, DType::bf16, stream); }},
        {"8 dW1", up_f, 0, [&] { gm.dw1_proj(pv, bw.dh, X, dw1.as<bf16>(), c.d, c.n, c.activation, stream); }},
        {"  d_pair_weights", 0, 12.0 * S, [&] { cuda::gather_pair_grads(pv, bw.ds, dpw.as<float>(), stream); }},
    };
    for (const Step& st : steps) {
      const double ms = timer.median_ms(f.warmup, f.reps, [] {}, st.fn);
      JsonLine j;
      j.add("bench", "layer-step").add("config", nc.name);
      if (nc.model) j.add("model", nc.model);
      j.add("step", st.name).add("S", S);
      j.add("ms", ms);
      if (st.flops > 0) j.add("tflops", st.flops / ms / 1e9); else j.add("gbps", st.bytes / ms / 1e6);
      j.add("gpu", meta.gpu).add("commit", meta.commit).add("date", meta.date);
      if (f.json) std::cout << j.str() << "\n";
      if (jsonl) *jsonl << j.str() << "\n" << std::flush;
      step_table.add_row({nc.name, st.name, fixed(ms, 3),
                          st.flops > 0 ? fixed(st.flops / ms / 1e9, 1) : "-",
                          st.flops > 0 ? "-" : fixed(st.bytes / ms / 1e6, 0)});
    }
  }

  if (!f.no_aggregate && S > 0) {
    // Aggregation alone (step 3) against the copy ceiling, on this config's plan.
    DevBuf y(size_t(S) * c.d * 2);
    cuda::fill_normal(y.p, DType::bf16, S * c.d, f.seed + 5, 1.0f, stream);
    const RoutingPlanView pv = plan.view();
    const double agg_ms = timer.median_ms(f.warmup, f.reps, [] {}, [&] {
      cuda::aggregate_rows(pv, y.p, pv.slot_weights, out.p, c.d, DType::bf16, stream);
    });
    // Minimum bytes: read every row of Y once, write out once, read the token view and weights.
    const double bytes = double(S) * c.d * 2 + double(c.T) * c.d * 2 + 4.0 * (c.T + 1) + 8.0 * S;
    const size_t copy_bytes = std::min<size_t>(y.bytes, size_t(1) << 30);
    DevBuf dst(copy_bytes);
    const double copy_ms = timer.median_ms(f.warmup, f.reps, [] {}, [&] {
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(dst.p, y.p, copy_bytes, cudaMemcpyDeviceToDevice, stream));
    });
    const double gbps = bytes / agg_ms / 1e6, copy_gbps = 2.0 * copy_bytes / copy_ms / 1e6;
    JsonLine j;
    j.add("bench", "aggregate").add("config", nc.name);
    if (nc.model) j.add("model", nc.model);
    j.add("T", c.T).add("d", c.d).add("S", S);
    j.add("us", agg_ms * 1e3).add("gbps", gbps).add("copy_gbps", copy_gbps);
    j.add("pct_of_copy", 100.0 * gbps / copy_gbps).add("copy_bytes", uint64_t(copy_bytes));
    j.add("gpu", meta.gpu).add("driver", meta.driver).add("commit", meta.commit).add("date", meta.date);
    if (f.json) std::cout << j.str() << "\n";
    if (jsonl) *jsonl << j.str() << "\n" << std::flush;
    agg_table.add_row({nc.name, std::to_string(S), fixed(agg_ms * 1e3, 1), fixed(gbps, 0),
                       fixed(copy_gbps, 0), fixed(100.0 * gbps / copy_gbps, 1)});
  }
}

void run_bench(const BenchFlags& f) {
  // Validate every flag before any work.
  MOEBLAZE_REQUIRE(f.reps >= 20, "reps (", f.reps, ") must be >= 20 (the benchmark protocol)");
  MOEBLAZE_REQUIRE(f.warmup >= 1, "warmup (", f.warmup, ") must be >= 1");
  MOEBLAZE_REQUIRE(f.sample_tokens >= 1, "sample-tokens (", f.sample_tokens, ") must be >= 1");
  MOEBLAZE_REQUIRE(f.m_tile >= 1, "m-tile (", f.m_tile, ") must be >= 1");
  MOEBLAZE_REQUIRE(f.rounds >= 1, "rounds (", f.rounds, ") must be >= 1");
  MOEBLAZE_REQUIRE(!f.search || !f.bias, "search: runs without expert biases (drop --bias)");
  MOEBLAZE_REQUIRE(!f.search || f.routing == "topk",
                   "search: runs the top-K benchmark routing (drop --routing)");
  MOEBLAZE_REQUIRE(f.search || f.search_gemms.empty(), "search-gemms: needs --search");
  search_gemm_mask(f.search_gemms);
  if (f.routing != "topk") parse_rounding(f.routing);  // throws naming the valid modes
  if (!f.activation.empty()) parse_activation(f.activation);
  if (!f.kernels.empty()) cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(f.kernels));
  std::vector<const NamedConfig*> configs;
  // --shape: one unnamed config, named after its shape in the rows (both live until the end of
  // this function, as long as `configs` points at them).
  std::string shape_name;
  NamedConfig shape_config{};
  if (!f.shape.empty()) {
    const std::vector<std::string> v = split_commas(f.shape);
    MOEBLAZE_REQUIRE(v.size() == 5, "shape '", f.shape, "' must be T,d,n,E,K (5 integers)");
    int64_t x[5];
    for (int i = 0; i < 5; ++i) {
      char* end = nullptr;
      x[i] = std::strtoll(v[i].c_str(), &end, 10);
      MOEBLAZE_REQUIRE(end && *end == '\0' && x[i] > 0, "shape '", f.shape, "': '", v[i],
                       "' is not a positive integer");
    }
    shape_name = "T" + v[0] + "-d" + v[1] + "-n" + v[2] + "-E" + v[3] + "-K" + v[4];
    shape_config = NamedConfig{shape_name.c_str(), x[0], x[1], x[2], x[3], x[4], "--shape"};
    configs.push_back(&shape_config);
  } else {
    configs = select_configs(f.config);
  }
  if (!f.slice.empty()) {
    const std::vector<const NamedConfig*> part = parse_slice(f.slice).of(configs);
    MOEBLAZE_REQUIRE(!part.empty(), "--slice ", f.slice, " leaves none of the ", configs.size(),
                     " configs");
    configs = part;
  }
  const std::vector<std::string> impls = split_commas(f.impl);
  MOEBLAZE_REQUIRE(!impls.empty(), "impl list '", f.impl, "' is empty");
  for (const std::string& i : impls)
    MOEBLAZE_REQUIRE(i == "dense-bound" ||
                         std::any_of(std::begin(kImpls), std::end(kImpls),
                                     [&](const Impl& k) { return i == k.name; }),
                     "impl '", i, "' is not one of: ", impl_names(), ", dense-bound");
  int devices = 0;
  MOEBLAZE_UNSUPPORTED_IF(cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0,
                          "bench layer needs a GPU; none is visible");
  std::unique_ptr<std::ofstream> out;
  if (!f.out.empty()) {
    out.reset(new std::ofstream(f.out, std::ios::app));
    MOEBLAZE_REQUIRE(out->good(), "out: cannot open '", f.out, "' for appending");
  }

  cudaDeviceProp prop{};
  MOEBLAZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const Meta meta{prop.name, driver_version(), git_commit(), utc_date_iso()};
  std::cerr << "bench layer: " << meta.gpu << ", driver " << meta.driver << ", commit "
            << meta.commit << ", grouped GEMM " << cuda::gemm_ops().name << "\n";
  DevBuf flush(kL2FlushBytes);

  Tables tables;
  Table& table = tables.main;
  Table& agg_table = tables.agg;
  Table& step_table = tables.step;
  std::vector<std::string> failures;  // --check
  for (const NamedConfig* nc : configs) {
    try {
      bench_config(f, meta, *nc, impls, flush.p, tables, out.get(), failures);
    } catch (const Unsupported& e) {
      std::cerr << "bench layer: " << nc->name << ": skipped: " << e.what() << "\n";
    } catch (const DeviceError& e) {
      std::cerr << "bench layer: " << nc->name << ": device error: " << e.what() << "\n";
      (void)cudaGetLastError();
    }
  }
  std::ostream& os = f.json ? std::cerr : std::cout;
  if (table.rows()) table.print(os);
  if (tables.call.rows()) {
    os << "\n";
    tables.call.print(os);
    os << "(each step's GPU time inside the real forward + backward call, from the layer's step "
          "marks; median of " << f.reps << ")\n";
  }
  if (tables.search.rows()) {
    os << "\n";
    tables.search.print(os);
    os << "(each GEMM's step inside the real keep_h call, pooled median of " << f.rounds
       << " rotated rounds; auto / fastest > 1.03: the rule misses by more than 3 %; call: the "
          "whole call's ratio under the two choices; kernels: how many were timed)\n";
  }
  if (step_table.rows()) {
    os << "\n";
    step_table.print(os);
    // Steps alone read slower than in the step at some shapes (docs/notes/sonicmoe-and-quack.md).
    os << "(each step alone, back to back on buffers of its own: some read slower than inside the "
          "step; bench/step_kernels.py times them in the step)\n";
  }
  if (agg_table.rows()) {
    os << "\n";
    agg_table.print(os);
  }
  for (const std::string& m : failures) std::cerr << "bench layer: check failed: " << m << "\n";
  if (!failures.empty()) throw CLI::RuntimeError(kExitFailure);
}

}  // namespace

void add_bench_layer_command(CLI::App& bench) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* sub = bench.add_subcommand(
      "layer", "MoE layer forward/backward on the GPU: moeblaze, recompute, materialized and "
               "dense-bound, by docs/DESIGN.md's protocol");
  sub->add_option("--config", flags->config,
                  "a named config, a comma list, 'all' (the named configs) or 'grid' (the "
                  "public-model grid; `moeblaze run --config list` prints both)")
      ->capture_default_str();
  sub->add_option("--impl", flags->impl, "comma list of implementations")->capture_default_str();
  sub->add_option("--activation", flags->activation,
                  "expert activation (default: the config's own: swiglu, swiglu-oai for the "
                  "grid's gpt-oss rows)");
  sub->add_option("--reps", flags->reps, "timed repetitions (median; >= 20)")->capture_default_str()
      ->check(integer_in(1, INT32_MAX));
  sub->add_option("--warmup", flags->warmup, "untimed repetitions first")->capture_default_str()
      ->check(integer_in(0, INT32_MAX));
  sub->add_option("--sample-tokens", flags->sample_tokens,
                  "tokens checked against the float64 reference")->capture_default_str();
  sub->add_option("--seed", flags->seed, "seed of inputs and routing")->capture_default_str()
      ->check(unsigned_integer());
  sub->add_option("--out", flags->out, "append the JSON lines to this file");
  sub->add_flag("--json", flags->json, "JSON lines on stdout (the table goes to stderr)");
  sub->add_flag("--no-aggregate", flags->no_aggregate, "skip the aggregation-kernel rows");
  sub->add_option("--routing", flags->routing,
                  "topk, or a token rounding of it: nr-f, sr-f, up, down")->capture_default_str();
  sub->add_option("--m-tile", flags->m_tile, "token rounding's tile (the GEMMs' M tile: 128)")
      ->capture_default_str();
  sub->add_option("--shape", flags->shape, "T,d,n,E,K: time this shape instead of --config");
  sub->add_option("--kernels", flags->kernels,
                  "kernel overrides, e.g. dw1.cluster=1,dh.family=two_cta (default: "
                  "MOEBLAZE_KERNELS)");
  sub->add_flag("--bias", flags->bias,
                "expert biases b1, b2 on the moeblaze impls (rows '<impl>+bias', no error column)");
  sub->add_flag("--check", flags->check,
                "exit 1 when a row's max rel err against the float64 sample exceeds `run "
                "--check`'s bound (bf16 2e-2, FP8 0.1); --bias rows have no error to check");
  sub->add_flag("--show-kernels", flags->show_kernels,
                "print each config's kernel choice (as `bench kernels`) before its rows");
  sub->add_flag("--steps", flags->steps,
                "also time each step inside the real forward + backward call (bf16 moeblaze "
                "impls; the layer's step marks): where the call's time goes");
  sub->add_flag("--search", flags->search,
                "instead of the impls: every legal kernel of each GEMM timed inside the real "
                "keep_h call against the automatic choice, rotated rounds, each choice checked "
                "against the float64 sample first");
  sub->add_option("--rounds", flags->rounds, "--search: rotated rounds (reps spread over them)")
      ->capture_default_str()->check(integer_in(1, 1000));
  sub->add_option("--slice", flags->slice,
                  "i/k: every k-th of --config's shapes from the i-th (a long run split over calls)");
  sub->add_option("--search-gemms", flags->search_gemms,
                  "--search: these GEMMs only, a comma list of up, down, dh, dw2, dx, dw1");
  sub->add_flag("--breakdown", flags->breakdown,
                "also time each of the eight steps alone (keep_h, preallocated buffers; "
                "alone some read slower than in the step: bench/step_kernels.py times them "
                "there)");
  sub->callback([flags] { run_bench(*flags); });
}

}  // namespace moeblaze::tools
