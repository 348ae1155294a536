// `moeblaze run`: forward+backward of one MoE layer on the CPU backend, for each implementation
// (moeblaze keep-H, moeblaze recompute, the materialized baseline, and the two moeblaze modes with
// FP8 compute), with time, memory kept for backward, peak memory and the error against the
// float64 reference. With no flags it runs the embedded default config (cpu-default) and prints
// the table the README shows.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "configs.hpp"
#include "flags.hpp"
#include "layer_impls.hpp"
#include "core/parallel.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"
#include "reference/reference_router.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

using Clock = std::chrono::steady_clock;

// The float64 reference is a plain loop nest on one thread: about 18·S·n·d flops at ~2 GFLOP/s
// (measured: cpu-default, S·n·d = 1.1e9, ~9 s of CPU time). At this S·n·d it needs about half a
// minute; above, it is skipped with a notice (--no-reference skips it always).
constexpr double kReferenceMaxSnd = 4.0e9;

// ---- flags -----------------------------------------------------------------------------------

struct RunFlags {
  std::string config = "cpu-default";
  int64_t T = 0, d = 0, n = 0, E = 0, K = 0;  // used only when the flag is given
  CLI::Option *oT = nullptr, *od = nullptr, *on = nullptr, *oE = nullptr, *oK = nullptr,
              *om_tile = nullptr;
  std::string activation = "swiglu";
  std::string router = "softmax-topk";
  bool renormalize = false;
  std::string dtype = "bf16";
  int threads = 0;
  int reps = 5;
  uint64_t seed = 1234;
  std::string token_rounding = "none";
  int m_tile = 128;
  std::string impl = "moeblaze,moeblaze-recompute,materialized";
  bool no_reference = false;
  bool json = false;
  bool check = false;
};

// Everything a run needs, resolved from the flags and validated.
struct RunSetup {
  std::string config_name;  // the named config, or "custom" when a shape flag changed it
  LayerConfig cfg;
  RouterConfig router;
  bool token_rounding = false;
  TokenRoundingConfig rounding;
  std::vector<const Impl*> impls;
  int threads = 0;
  int reps = 5;
  uint64_t seed = 0;
  bool reference = true;
  bool reference_auto_skipped = false;
  bool json = false;
  bool check = false;
};

// Bytes of memory the system can still give us (MemAvailable), or 0 when unknown.
size_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// Flags → setup; throws InvalidArgument naming the flag and the rule before anything runs.
RunSetup resolve(const RunFlags& f) {
  RunSetup s;
  const NamedConfig& named = require_config(f.config);
  s.cfg = layer_config(named, parse_activation(f.activation), parse_dtype(f.dtype));
  s.config_name = named.name;
  bool custom = false;
  auto override_dim = [&](CLI::Option* o, int64_t v, int64_t& field) {
    if (o->count() == 0 || v == field) return;
    field = v;
    custom = true;
  };
  override_dim(f.oT, f.T, s.cfg.T);
  override_dim(f.od, f.d, s.cfg.d);
  override_dim(f.on, f.n, s.cfg.n);
  override_dim(f.oE, f.E, s.cfg.E);
  override_dim(f.oK, f.K, s.cfg.K);
  if (custom) s.config_name = "custom";
  s.cfg.validate();  // "top_k K (9) exceeds num_experts E (8)", ...

  s.router.kind = parse_router(f.router);
  MOEBLAZE_REQUIRE(s.router.kind != RouterKind::supplied,
                   "router 'supplied' needs caller-given expert ids; `moeblaze run` draws "
                   "logits, so use softmax-topk, topk-softmax or sigmoid-bias");
  s.router.top_k = static_cast<int>(s.cfg.K);
  s.router.renormalize = f.renormalize;

  if (f.token_rounding != "none") {
    s.token_rounding = true;
    s.rounding.mode = parse_rounding(f.token_rounding);  // lists the valid names
    s.rounding.seed = f.seed;
  }
  MOEBLAZE_REQUIRE(f.m_tile >= 1, "m_tile (", f.m_tile, ") must be >= 1");
  MOEBLAZE_REQUIRE(s.token_rounding || f.om_tile->count() == 0,
                   "m_tile is used only with --token-rounding (which is 'none')");
  s.rounding.m_tile = f.m_tile;

  MOEBLAZE_REQUIRE(f.reps >= 1, "reps (", f.reps, ") must be >= 1");
  require_thread_count(f.threads, "--threads");
  s.reps = f.reps;
  s.threads = f.threads;
  s.seed = f.seed;

  for (const std::string& name : split_commas(f.impl)) {
    MOEBLAZE_REQUIRE(!name.empty(), "impl list '", f.impl, "' has an empty entry");
    const Impl* impl = &parse_impl(name);
    MOEBLAZE_REQUIRE(std::find(s.impls.begin(), s.impls.end(), impl) == s.impls.end(), "impl '",
                     name, "' is listed twice");
    // The library's rules for this impl's compute (fp8: bf16 storage only), before anything runs.
    LayerConfig ic = s.cfg;
    ic.compute = impl->compute;
    try {
      ic.validate();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("impl '" + name + "': " + e.what());
    }
    s.impls.push_back(impl);
  }
  MOEBLAZE_REQUIRE(!s.impls.empty(), "--impl '", f.impl,
                   "' names no implementation: give one or more of ", impl_names());

  // Inputs, outputs and gradients the command holds (x, out, dx, d_out; w1, w2 and their
  // gradients) plus what keep-H saves (H): a lower bound of the run's memory. Refuse up front
  // rather than be killed by the kernel half-way.
  const double ds = static_cast<double>(dtype_size(s.cfg.dtype));
  const double S = double(s.cfg.T) * double(s.cfg.K);
  const double need = ds * (4.0 * s.cfg.T * s.cfg.d + 2.0 * s.cfg.E * s.cfg.w1_rows() * s.cfg.d +
                            2.0 * s.cfg.E * s.cfg.d * s.cfg.n + S * s.cfg.w1_rows());
  const size_t avail = available_memory_bytes();
  MOEBLAZE_UNSUPPORTED_IF(avail > 0 && need > double(avail),
                          "config ", s.config_name, " needs at least ",
                          human_bytes(need), " of host memory but only ",
                          human_bytes(avail), " is available; pick a smaller --config or --T");

  s.reference = !f.no_reference;
  const double snd = S * double(s.cfg.n) * double(s.cfg.d);
  if (s.reference && snd > kReferenceMaxSnd) {
    s.reference = false;
    s.reference_auto_skipped = true;
  }
  s.json = f.json;
  s.check = f.check;
  MOEBLAZE_REQUIRE(!(s.check && !s.reference),
                   "--check needs the float64 reference, which is off (--no-reference, or S*n*d "
                   "above ", kReferenceMaxSnd, ")");
  return s;
}

// ---- inputs ----------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fills dst[i] = N(0, stddev) for i < count. Values depend only on (seed, stream, i): each fixed
// chunk of 4096 draws from its own generator, so the inputs do not depend on the thread count.
template <typename T>
void fill_normal(T* dst, int64_t count, uint64_t seed, uint64_t stream, double stddev) {
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  parallel_for(0, chunks, 1, [&](int64_t c) {
    uint64_t state = seed * 0x2545F4914F6CDD1Dull ^ (stream << 48) ^ static_cast<uint64_t>(c);
    splitmix64(state);
    const int64_t end = std::min(count, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; i += 2) {
      // Box–Muller; u1 in (0, 1] keeps log finite.
      const double u1 = (double(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
      const double u2 = double(splitmix64(state) >> 11) * 0x1.0p-53;
      const double r = std::sqrt(-2.0 * std::log(u1)) * stddev;
      double z[2] = {r * std::cos(2.0 * M_PI * u2), r * std::sin(2.0 * M_PI * u2)};
      for (int j = 0; j < 2 && i + j < end; ++j) {
        T v = static_cast<T>(static_cast<float>(z[j]));
        // Never zero (a zero input hides indexing errors); the chance is ~2^-53 anyway.
        if (static_cast<float>(v) == 0.0f) v = static_cast<T>(static_cast<float>(stddev * 1e-3));
        dst[i + j] = v;
      }
    }
  });
}

// A dense host tensor the command owns (caller memory: not counted by the library's accounting,
// which is what "peak above the inputs" means).
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::unique_ptr<uint8_t[]> data;

  HostTensor() = default;
  HostTensor(DType dt, std::initializer_list<int64_t> dims) : dtype(dt), shape(dims) {
    data.reset(new uint8_t[std::max<size_t>(bytes(), 1)]);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  TensorView view() const {
    TensorView v;
    v.data = data.get();
    v.dtype = dtype;
    v.device = Device::cpu;
    v.rank = static_cast<int>(shape.size());
    for (int i = 0; i < v.rank; ++i) v.shape[i] = shape[i];
    return v;
  }
  double at(int64_t i) const {
    switch (dtype) {
      case DType::bf16: return static_cast<float>(reinterpret_cast<const bf16*>(data.get())[i]);
      case DType::f32: return reinterpret_cast<const float*>(data.get())[i];
      case DType::f64: return reinterpret_cast<const double*>(data.get())[i];
      default: return reinterpret_cast<const int32_t*>(data.get())[i];
    }
  }
  void fill_normal(uint64_t seed, uint64_t stream, double stddev) {
    if (dtype == DType::bf16)
      tools::fill_normal(reinterpret_cast<bf16*>(data.get()), numel(), seed, stream, stddev);
    else
      tools::fill_normal(reinterpret_cast<float*>(data.get()), numel(), seed, stream, stddev);
  }
  // Poisons outputs so that a kernel that skips an element cannot pass by leaving a plausible
  // value behind.
  void fill_nan() {
    if (dtype == DType::bf16) {
      const bf16 nan(NAN);
      std::fill_n(reinterpret_cast<bf16*>(data.get()), numel(), nan);
    } else if (dtype == DType::f32) {
      std::fill_n(reinterpret_cast<float*>(data.get()), numel(), NAN);
    }
  }
};

struct Inputs {
  HostTensor x;       // (T, d) cfg.dtype, N(0, 1)
  HostTensor w1;      // (E, w1_rows, d) cfg.dtype, N(0, 1/sqrt(d))
  HostTensor w2;      // (E, d, n) cfg.dtype, N(0, 1/sqrt(n))
  HostTensor logits;  // (T, E) fp32, N(0, 1): the benchmark routing (near balanced)
  HostTensor bias;    // (E,) fp32, N(0, 0.1), sigmoid-bias only; empty otherwise
  HostTensor d_out;   // (T, d) cfg.dtype, N(0, 1)
};

Inputs make_inputs(const RunSetup& s) {
  const LayerConfig& c = s.cfg;
  Inputs in;
  in.x = HostTensor(c.dtype, {c.T, c.d});
  in.w1 = HostTensor(c.dtype, {c.E, c.w1_rows(), c.d});
  in.w2 = HostTensor(c.dtype, {c.E, c.d, c.n});
  in.logits = HostTensor(DType::f32, {c.T, c.E});
  in.d_out = HostTensor(c.dtype, {c.T, c.d});
  in.x.fill_normal(s.seed, 1, 1.0);
  in.w1.fill_normal(s.seed, 2, 1.0 / std::sqrt(double(c.d)));
  in.w2.fill_normal(s.seed, 3, 1.0 / std::sqrt(double(c.n)));
  in.logits.fill_normal(s.seed, 4, 1.0);
  in.d_out.fill_normal(s.seed, 5, 1.0);
  if (s.router.kind == RouterKind::sigmoid_bias) {
    in.bias = HostTensor(DType::f32, {c.E});
    in.bias.fill_normal(s.seed, 6, 0.1);
  } else {
    in.bias = HostTensor(DType::f32, {0});
  }
  return in;
}

// route (+ token_round): the routing every implementation consumes.
void make_routing(const RunSetup& s, const Inputs& in, Routing& out) {
  if (!s.token_rounding) {
    route(s.router, in.logits.view(), in.bias.view(), out);
    return;
  }
  Routing topk;
  route(s.router, in.logits.view(), in.bias.view(), topk);
  token_round(s.router, s.rounding, in.logits.view(), in.bias.view(), topk.view(), out);
}

// ---- progress --------------------------------------------------------------------------------

// A progress line on stderr, shown only once the command has run for a few seconds (short runs
// stay quiet). On a terminal it rewrites one line with \r; otherwise one line per step.
class Progress {
 public:
  // `from_start`: show every step at once (the caller expects a long run); otherwise only steps
  // that begin after the command has run for a few seconds.
  explicit Progress(bool from_start)
      : from_start_(from_start), tty_(isatty(STDERR_FILENO) == 1) {}
  void step(const std::string& msg) {
    if (!from_start_ && Clock::now() - start_ < std::chrono::seconds(3)) return;
    const double s = std::chrono::duration<double>(Clock::now() - start_).count();
    std::ostringstream line;
    line << "[moeblaze] " << fixed(s, 0) << " s: " << msg;
    if (tty_) {
      std::cerr << "\r" << line.str() << "\x1b[K" << std::flush;
      open_ = true;
    } else {
      std::cerr << line.str() << "\n" << std::flush;
    }
  }
  void clear() {
    if (open_) std::cerr << "\r\x1b[K" << std::flush;
    open_ = false;
  }

 private:
  bool from_start_, tty_;
  bool open_ = false;
  Clock::time_point start_ = Clock::now();
};

// ---- error against the reference -------------------------------------------------------------

double rel_frobenius(const HostTensor& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  const int64_t count = a.numel();
  for (int64_t i = 0; i < count; ++i) {
    const double x = a.at(i), r = ref[static_cast<size_t>(i)];
    if (!std::isfinite(x)) return INFINITY;
    num += (x - r) * (x - r);
    den += r * r;
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

struct Reference {
  std::vector<double> out, dx, dw1, dw2, d_pair_weights, d_logits;
  bool has_d_logits = false;
};

std::vector<double> widen(const HostTensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.at(i);
  return v;
}

Reference compute_reference(const RunSetup& s, const Inputs& in, const Routing& routing) {
  Reference r;
  reference::LayerReference lr =
      reference::reference_layer(s.cfg, routing.view(), in.x.view(), in.w1.view(), in.w2.view(),
                           in.d_out.view());
  r.out = std::move(lr.out);
  r.dx = std::move(lr.dx);
  r.dw1 = std::move(lr.dw1);
  r.dw2 = std::move(lr.dw2);
  r.d_pair_weights = std::move(lr.d_pair_weights);
  // The router's d logits from the reference's own d pair_weights: checks the chain
  // layer backward → router backward end to end.
  const std::vector<double> logits = widen(in.logits), bias = widen(in.bias);
  r.d_logits = reference::router_backward(
      s.router, logits.data(), bias.empty() ? nullptr : bias.data(), s.cfg.T, s.cfg.E,
      routing.pair_offsets(), routing.pair_experts(), r.d_pair_weights.data());
  r.has_d_logits = true;
  return r;
}

// ---- one implementation ----------------------------------------------------------------------

struct Outputs {
  HostTensor out;             // (T, d) cfg.dtype
  HostTensor dx;              // (T, d) cfg.dtype
  HostTensor dw1;             // like w1
  HostTensor dw2;             // like w2
  HostTensor d_pair_weights;  // (P,) fp32, token-major like the routing
  HostTensor d_logits;        // (T, E) fp32
};

// The tensors compared with the float64 reference, in the order of ImplResult::rel_err.
constexpr const char* kErrTensors[6] = {"out", "dx", "dw1", "dw2", "d_pair_weights", "d_logits"};

struct ImplResult {
  const Impl* impl = nullptr;
  int64_t S = 0;
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0;
  size_t kept_bytes = 0, peak_bytes = 0;
  double max_rel_err = NAN;  // NaN when the reference was skipped
  std::string worst;         // which tensor gave max_rel_err
  double rel_err[6] = {NAN, NAN, NAN, NAN, NAN, NAN};  // per tensor, as kErrTensors
  bool deterministic = true;  // repetitions reproduced the warm-up bit for bit
};

PlanBuilder builder_of(LayerMode m) {
  // The materialized baseline dispatches the conventional way (a sort); both builders give the
  // same plan, so only the time differs.
  return m == LayerMode::materialized ? PlanBuilder::sort : PlanBuilder::atomic_free;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double ms_since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

// Bitwise copy of a tensor's bytes, to check that repetitions reproduce the warm-up exactly.
std::vector<uint8_t> snapshot(const HostTensor& t) {
  return std::vector<uint8_t>(t.data.get(), t.data.get() + t.bytes());
}
bool same_bits(const HostTensor& t, const std::vector<uint8_t>& snap) {
  // std::equal, not memcmp: an empty tensor (T = 0) has no data pointer, which memcmp forbids.
  return snap.size() == t.bytes() && std::equal(snap.begin(), snap.end(), t.data.get());
}

ImplResult run_impl(const RunSetup& s, const Impl& impl, const Inputs& in,
                    const Routing& routing, const Reference* ref, Progress& progress) {
  LayerConfig c = s.cfg;
  c.compute = impl.compute;
  const LayerMode mode = impl.mode;
  const std::string name = impl.name;
  ImplResult r;
  r.impl = &impl;
  LayerOptions opts;
  opts.mode = mode;
  opts.num_threads = s.threads;

  Outputs o;
  o.out = HostTensor(c.dtype, {c.T, c.d});
  o.dx = HostTensor(c.dtype, {c.T, c.d});
  o.dw1 = HostTensor(c.dtype, {c.E, c.w1_rows(), c.d});
  o.dw2 = HostTensor(c.dtype, {c.E, c.d, c.n});
  o.d_pair_weights = HostTensor(DType::f32, {routing.P()});
  o.d_logits = HostTensor(DType::f32, {c.T, c.E});
  for (HostTensor* t : {&o.out, &o.dx, &o.dw1, &o.dw2, &o.d_pair_weights, &o.d_logits})
    t->fill_nan();
  const LayerGrads grads{o.dx.view(), o.dw1.view(), o.dw2.view(), o.d_pair_weights.view()};

  // Warm-up, measured for peak memory: every library allocation of one training step of the
  // layer, from routing through router backward. The inputs, outputs and gradients are this
  // command's own memory, outside the accounting, hence "above the inputs".
  progress.step(name + ": warm-up (peak memory)");
  {
    PeakScope scope(Device::cpu);
    {
      Routing step_routing;
      make_routing(s, in, step_routing);
      RoutingPlan plan;
      build_routing_plan(step_routing.view(), builder_of(mode), plan);
      SavedForBackward saved;
      layer_forward(c, plan, in.x.view(), in.w1.view(), in.w2.view(), o.out.view(), saved, opts);
      r.kept_bytes = saved.bytes() + plan.bytes();
      r.S = plan.S();
      layer_backward(c, plan, in.x.view(), in.w1.view(), in.w2.view(), in.d_out.view(), saved,
                     grads, opts);
      router_backward(s.router, in.logits.view(), in.bias.view(), step_routing.view(),
                      o.d_pair_weights.view(), o.d_logits.view());
    }
    r.peak_bytes = scope.peak_above_start();
  }
  const std::vector<uint8_t> out0 = snapshot(o.out), dx0 = snapshot(o.dx),
                             dw10 = snapshot(o.dw1);

  // Timed repetitions: plan build + forward, then backward. The router is outside the clock
  // (the same for every implementation and outside docs/DESIGN.md's FLOP count).
  std::vector<double> fwd(static_cast<size_t>(s.reps)), tot(static_cast<size_t>(s.reps));
  for (int i = 0; i < s.reps; ++i) {
    std::ostringstream msg;
    msg << name << ": rep " << i + 1 << "/" << s.reps;
    if (i > 0) msg << " (last total " << fixed(tot[static_cast<size_t>(i - 1)], 1) << " ms)";
    progress.step(msg.str());
    RoutingPlan plan;
    SavedForBackward saved;
    const Clock::time_point t0 = Clock::now();
    build_routing_plan(routing.view(), builder_of(mode), plan);
    layer_forward(c, plan, in.x.view(), in.w1.view(), in.w2.view(), o.out.view(), saved, opts);
    const Clock::time_point t1 = Clock::now();
    layer_backward(c, plan, in.x.view(), in.w1.view(), in.w2.view(), in.d_out.view(), saved,
                   grads, opts);
    const Clock::time_point t2 = Clock::now();
    fwd[static_cast<size_t>(i)] = ms_since(t0, t1);
    tot[static_cast<size_t>(i)] = ms_since(t0, t2);
  }
  r.fwd_ms = median(fwd);
  r.total_ms = median(tot);
  r.bwd_ms = r.total_ms - r.fwd_ms;
  r.deterministic = same_bits(o.out, out0) && same_bits(o.dx, dx0) && same_bits(o.dw1, dw10);

  if (ref) {
    progress.step(name + ": error against the float64 reference");
    const double errs[6] = {
        rel_frobenius(o.out, ref->out),
        rel_frobenius(o.dx, ref->dx),
        rel_frobenius(o.dw1, ref->dw1),
        rel_frobenius(o.dw2, ref->dw2),
        rel_frobenius(o.d_pair_weights, ref->d_pair_weights),
        ref->has_d_logits ? rel_frobenius(o.d_logits, ref->d_logits) : 0.0,
    };
    r.max_rel_err = -1;
    for (int i = 0; i < 6; ++i) {
      r.rel_err[i] = errs[i];
      if (!(errs[i] <= r.max_rel_err)) {  // NaN/inf wins, so a broken tensor is never hidden
        r.max_rel_err = errs[i];
        r.worst = kErrTensors[i];
      }
    }
  }
  return r;
}

std::string routing_name(const RunSetup& s) {
  std::string r = router_name(s.router.kind);
  if (s.router.renormalize) r += "+renorm";
  if (s.token_rounding)
    r += std::string("+") + rounding_name(s.rounding.mode) + "/" +
         std::to_string(s.rounding.m_tile);
  return r;
}

void run_command(const RunFlags& f) {
  if (f.config == "list") {
    print_config_list(std::cout);
    return;
  }
  const RunSetup s = resolve(f);
  ThreadCountScope thread_scope(s.threads);
  const int threads = s.threads > 0 ? s.threads : max_threads();
  const LayerConfig& c = s.cfg;
  // Expected work: docs/DESIGN.md's FLOPs per step, times warm-up + reps, per implementation, plus
  // the reference; above ~3e11 (half a minute at ~10 GFLOP/s) the progress shows from the start.
  const double step_flops = 3.0 * forward_flops(c, c.T * c.K);
  const double work =
      step_flops * (double(s.reps) + 1.0) * double(s.impls.size()) + (s.reference ? step_flops : 0);
  Progress progress(work > 3e11);

  std::ostringstream cfg_line;
  cfg_line << "config " << s.config_name << ": T=" << c.T << " d=" << c.d << " n=" << c.n
           << " E=" << c.E << " K=" << c.K << " " << activation_name(c.activation) << " "
           << dtype_name(c.dtype) << ", routing " << routing_name(s) << " (N(0,1) logits, seed "
           << s.seed << "), CPU backend, " << threads << " thread" << (threads == 1 ? "" : "s")
           << " (" << cpu_model() << "), median of " << s.reps << " rep"
           << (s.reps == 1 ? "" : "s");
  (s.json ? std::cerr : std::cout) << cfg_line.str() << "\n" << std::flush;
  if (s.reference_auto_skipped)
    std::cerr << "[moeblaze] notice: float64 reference skipped: S*n*d = "
              << scientific(double(c.T) * c.K * c.n * c.d, 2) << " exceeds "
              << scientific(kReferenceMaxSnd, 1)
              << " (it would take minutes on one core); max rel err is not measured\n";

  progress.step("drawing inputs");
  const Inputs in = make_inputs(s);
  Routing routing;  // shared by the timed repetitions of every implementation
  make_routing(s, in, routing);

  Reference ref;
  if (s.reference) {
    progress.step("float64 reference (S*n*d = " +
                  scientific(double(routing.P()) * c.n * c.d, 2) + ")");
    ref = compute_reference(s, in, routing);
  }

  std::vector<ImplResult> results;
  for (const Impl* impl : s.impls)
    results.push_back(run_impl(s, *impl, in, routing, s.reference ? &ref : nullptr, progress));
  progress.clear();

  size_t materialized_kept = 0;
  for (const ImplResult& r : results)
    if (r.impl->mode == LayerMode::materialized) materialized_kept = r.kept_bytes;

  if (s.json) {
    const std::string gpu = "cpu: " + cpu_model();
    const std::string commit = git_commit();
    const std::string date = utc_date_iso();
    for (const ImplResult& r : results) {
      const double ff = forward_flops(c, r.S), bf = backward_flops(c, r.S);
      JsonLine j;
      j.add("bench", "layer").add("config", s.config_name).add("impl", r.impl->name);
      j.add("T", c.T).add("d", c.d).add("n", c.n).add("E", c.E).add("K", c.K);
      j.add("activation", activation_name(c.activation)).add("routing", routing_name(s));
      j.add("fwd_ms", r.fwd_ms).add("bwd_ms", r.bwd_ms).add("total_ms", r.total_ms);
      j.add("fwd_tflops", ff / (r.fwd_ms * 1e9)).add("bwd_tflops", bf / (r.bwd_ms * 1e9));
      j.add("total_tflops", (ff + bf) / (r.total_ms * 1e9));
      j.add("kept_bytes", static_cast<uint64_t>(r.kept_bytes));
      j.add("peak_bytes", static_cast<uint64_t>(r.peak_bytes));
      if (std::isnan(r.max_rel_err)) j.add_null("max_rel_err");
      else j.add("max_rel_err", r.max_rel_err);
      j.add("gpu", gpu).add("commit", commit).add("date", date);
      // Beyond docs/DESIGN.md's common fields: what else fixes the result.
      j.add("dtype", dtype_name(c.dtype)).add("compute", compute_name(r.impl->compute));
      j.add("S", r.S).add("threads", threads);
      j.add("reps", s.reps).add("seed", s.seed).add("deterministic", r.deterministic);
      for (int i = 0; i < 6; ++i) {  // null when the reference was skipped
        const std::string key = std::string("rel_err_") + kErrTensors[i];
        if (std::isnan(r.rel_err[i])) j.add_null(key);
        else j.add(key, r.rel_err[i]);
      }
      std::cout << j.str() << "\n";
    }
  } else {
    Table t({{"impl", Align::left},
             {"fwd ms", Align::right},
             {"bwd ms", Align::right},
             {"total ms", Align::right},
             {"GFLOP/s", Align::right},
             {"kept for bwd (vs materialized)", Align::right},
             {"peak above inputs", Align::right},
             {"max rel err", Align::right}});
    for (const ImplResult& r : results) {
      const double flops = forward_flops(c, r.S) + backward_flops(c, r.S);
      std::string kept = human_bytes(r.kept_bytes);
      if (materialized_kept > 0) {
        const double ratio = double(r.kept_bytes) / double(materialized_kept);
        char buf[32];
        std::snprintf(buf, sizeof buf, ratio >= 0.1 ? "%.2f" : "%.2g", ratio);
        kept += std::string(" (") + buf + "x)";
      }
      std::string err = "-";
      if (!std::isnan(r.max_rel_err)) err = scientific(r.max_rel_err, 1) + " (" + r.worst + ")";
      t.add_row({r.impl->name, fixed(r.fwd_ms, 2), fixed(r.bwd_ms, 2),
                 fixed(r.total_ms, 2), fixed(flops / (r.total_ms * 1e6), 1), kept,
                 human_bytes(r.peak_bytes), err});
    }
    t.print(std::cout);
  }
  std::cout << std::flush;

  bool failed = false;
  for (const ImplResult& r : results) {
    if (!r.deterministic) {
      std::cerr << "[moeblaze] warning: " << r.impl->name
                << ": repetitions did not reproduce the warm-up's out/dx/dw1 bit for bit\n";
      failed = true;
    }
    const double tol = check_tolerance(*r.impl, c.dtype);
    if (s.check && !(r.max_rel_err <= tol)) {
      std::cerr << "[moeblaze] check failed: " << r.impl->name << ": max rel err "
                << scientific(r.max_rel_err, 2) << " (" << r.worst << ") exceeds "
                << scientific(tol, 0) << " for "
                << (is_fp8(r.impl->compute) ? "fp8 compute" : dtype_name(c.dtype))
                << "\n";
      failed = true;
    }
  }
  if (failed && s.check) throw CLI::RuntimeError(kExitFailure);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto f = std::make_shared<RunFlags>();
  CLI::App* run = app.add_subcommand(
      "run",
      "Forward+backward of one MoE layer on the CPU backend for each implementation, with time, "
      "memory and error against a float64 reference. No flags: the embedded default config "
      "cpu-default (T=2048 d=256 n=512 E=16 K=4, swiglu, softmax-topk router, bf16).");
  run->add_option("--config", f->config,
                  "named layer shape (the benchmark configs); 'list' prints them all: " +
                      config_names())
      ->capture_default_str();
  // Shapes: any int64 parses; LayerConfig::validate then names the rule a value breaks.
  const CLI::Validator any_int64 = integer_in(INT64_MIN, INT64_MAX);
  f->oT = run->add_option("--T", f->T, "tokens T (overrides the config's)")->check(any_int64);
  f->od = run->add_option("--d", f->d, "hidden size d (overrides the config's)")->check(any_int64);
  f->on = run->add_option("--n", f->n, "expert intermediate size n (overrides the config's)")
              ->check(any_int64);
  f->oE = run->add_option("--E", f->E, "number of experts E (overrides the config's)")
              ->check(any_int64);
  f->oK = run->add_option("--K", f->K, "experts per token, top-K (overrides the config's)")
              ->check(any_int64);
  run->add_option("--activation", f->activation,
                  "expert activation: swiglu, geglu, swiglu-oai (gated, w1 has 2n rows; "
                  "swiglu-oai: gpt-oss's clamped SwiGLU), relu, silu, gelu, relu2")
      ->capture_default_str();
  run->add_option("--router", f->router,
                  "router: softmax-topk (softmax, keep the K largest), topk-softmax (K largest "
                  "logits, softmax over them), sigmoid-bias (sigmoid scores, selection by "
                  "score + a random N(0,0.1) bias)")
      ->capture_default_str();
  run->add_flag("--renormalize", f->renormalize,
                "softmax-topk / sigmoid-bias: divide each token's K weights by their sum");
  run->add_option("--dtype", f->dtype,
                  "storage dtype of x, weights, outputs and gradients: bf16 or fp32 "
                  "(accumulation is always fp32)")
      ->capture_default_str();
  run->add_option("--threads", f->threads,
                  "CPU threads, 0 = all hardware threads (results are bitwise the same for any "
                  "count)")
      ->capture_default_str()
      ->check(integer_in(0, kMaxThreads));
  run->add_option("--reps", f->reps,
                  "timed repetitions after one warm-up; the table shows their median")
      ->capture_default_str()
      ->check(integer_in(1, INT32_MAX));
  run->add_option("--seed", f->seed,
                  "seed of the random inputs (x, w1, w2, router logits, d_out; same seed, same "
                  "inputs on any thread count)")
      ->capture_default_str()
      ->check(unsigned_integer());
  run->add_option("--token-rounding", f->token_rounding,
                  "token rounding after top-K (SonicMoE): none, nr-f (nearest), sr-f "
                  "(stochastic, seeded by --seed), up (pad), down (drop)")
      ->capture_default_str();
  f->om_tile = run->add_option("--m-tile", f->m_tile,
                               "token rounding: each expert's token count becomes a multiple "
                               "of this")
                   ->capture_default_str()
                   ->check(integer_in(1, INT32_MAX));
  std::string impl_help = "comma-separated implementations to run:";
  for (const Impl& i : kImpls)
    impl_help += std::string(&i == kImpls ? " " : ", ") + i.name + " (" + i.help + ")";
  run->add_option("--impl", f->impl, impl_help)->capture_default_str();
  run->add_flag("--no-reference", f->no_reference,
                "skip the float64 reference (max rel err shows '-'); skipped automatically, with "
                "a notice, when S*n*d exceeds 4e9");
  run->add_flag("--json", f->json,
                "print one JSON line per implementation (docs/DESIGN.md's layer-row fields: "
                "bench, config, impl, T, d, n, E, K, activation, routing, fwd_ms, bwd_ms, "
                "total_ms, fwd_tflops, bwd_tflops, total_tflops, kept_bytes, peak_bytes, "
                "max_rel_err, "
                "gpu, commit, date; plus dtype, compute (storage or fp8), S, threads, reps, seed, "
                "deterministic, and rel_err_out, rel_err_dx, rel_err_dw1, rel_err_dw2, "
                "rel_err_d_pair_weights, rel_err_d_logits: each tensor's error behind max_rel_err) "
                "instead of the table; the config line goes to stderr");
  run->add_flag("--check", f->check,
                "exit with status 1 if an implementation's max rel err exceeds 2e-2 (bf16), "
                "1e-4 (fp32) or 0.1 (the -fp8 impls: e4m3 operands, ~0.036 relative error per "
                "quantized operand, two in series for out and dx; relu's dx and dw1 exceed it), or if "
                "repetitions are not bitwise reproducible");
  run->footer(
      "What is measured:\n"
      "  fwd ms      routing-plan build (atomic-free; sort for materialized) + layer_forward;\n"
      "              median over --reps after one warm-up (std::chrono::steady_clock)\n"
      "  bwd ms      median(plan build + forward + layer_backward) - median(fwd ms)\n"
      "              The router (route, router_backward) is not timed: it is the same for\n"
      "              every implementation and outside the FLOP count.\n"
      "  GFLOP/s     the FLOP count, 18*S*n*d (gated) or 12*S*n*d per forward+backward, over\n"
      "              total ms (recompute's extra up-projection is not counted)\n"
      "  kept        bytes kept from forward to backward: SavedForBackward + routing plan\n"
      "              (the -fp8 impls keep H as e4m3 codes + fp32 scales per 128 values)\n"
      "  peak        highest library-allocated bytes above the inputs during one whole step:\n"
      "              routing (route, token rounding), plan build, forward, backward and\n"
      "              router backward; the inputs, outputs and gradients are the caller's\n"
      "  max rel err max over out, dx, dw1, dw2, d_pair_weights and the router's d logits of\n"
      "              ||a - ref||_F / ||ref||_F against the float64 reference, computed once\n"
      "Exit status: 0 ok, 1 run failed (or --check failed), 2 bad flags.");
  run->callback([f] { run_command(*f); });
}

}  // namespace moeblaze::tools
