// Expert-parallel forward and backward (include/moeblaze/expert_parallel.hpp,
// docs/EXPERT_PARALLEL.md). Per call, on rank q of W, experts in blocks of E_local = E / W:
//
// forward
//   1. dispatch lists from the local routing (host): per destination rank r the local tokens
//      with >= 1 pair on r's experts (deduplicated, ascending) and those pairs (token-major)
//   2. agreement: all_gather of [verdict, cfg fields, per-destination token and pair counts];
//      every rank now knows what it receives, or every rank throws
//   3. metadata all_to_all (per token its pair count, per pair local expert and weight) →
//      the local routing over the R received tokens → the local plan
//   4. rows all_to_all: x rows gathered by the dispatch lists → x_recv (R, d)
//   5. the unchanged layer_forward on (x_recv, local plan, local weights) → partial rows
//   6. partials all_to_all back; out_t = sum of t's partials in rank order (fp32, fixed order)
// backward mirrors 4-6 with d_out rows, and sends back dx partials and d_pair_weights.
//
// Everything that decides an order (dispatch lists, received layout, combine order) is a
// function of the routings only, never of timing: results are bitwise reproducible.
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "core/parallel.hpp"
#include "ep/ep_rows.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/expert_parallel.hpp"

namespace moeblaze {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Adds the wall time of its scope to *acc (when acc is non-null).
class ScopedTime {
 public:
  explicit ScopedTime(double* acc) : acc_(acc), t0_(Clock::now()) {}
  ~ScopedTime() {
    if (acc_) *acc_ += seconds_since(t0_);
  }
 private:
  double* acc_;
  Clock::time_point t0_;
};

template <typename T>
T* host_array(Buffer& b, int64_t count) {
  b = Buffer(Device::cpu, sizeof(T) * static_cast<size_t>(count));
  return b.as<T>();
}

void check_tensor(const TensorView& t, const char* name, std::initializer_list<int64_t> dims,
                  DType dtype, Device device) {
  require_shape(t, name, dims);
  require_dtype(t, name, dtype);
  MOEBLAZE_REQUIRE(t.device == device, name, " is on ", device_name(t.device),
                   ", but the transport moves ", device_name(device), " memory");
  require_data(t, name);
}

void check_transport(const Transport& tr) {
  const int W = tr.world_size(), q = tr.rank();
  MOEBLAZE_REQUIRE(W >= 1, "transport: world_size (", W, ") must be >= 1");
  MOEBLAZE_REQUIRE(q >= 0 && q < W, "transport: rank (", q, ") must be in [0, world_size ", W,
                   ")");
}

void check_layer_options(const LayerOptions& o) {
  MOEBLAZE_REQUIRE(o.mode == LayerMode::keep_h || o.mode == LayerMode::recompute ||
                       o.mode == LayerMode::materialized,
                   "opts.layer.mode (", int(o.mode), ") is not a LayerMode");
  MOEBLAZE_REQUIRE(o.num_threads >= 0, "opts.layer.num_threads (", o.num_threads,
                   ") must be >= 0 (0 = all hardware threads)");
}

// Fields every rank must agree on, in the order they are gathered and reported.
constexpr int kCfgFields = 5;
const char* const kCfgNames[kCfgFields] = {"cfg.d", "cfg.n", "cfg.E", "cfg.activation",
                                           "cfg.dtype"};
void cfg_fields(const LayerConfig& c, int64_t* f) {
  f[0] = c.d;
  f[1] = c.n;
  f[2] = c.E;
  f[3] = static_cast<int64_t>(c.activation);
  f[4] = static_cast<int64_t>(c.dtype);
}

// The collective verdict. Every rank sends [ok, payload...] (the same length everywhere) and gets
// the table of all ranks, or — when any rank's checks failed — rethrows its own error, or throws
// RemoteRankError naming the failed ranks. Nothing else has moved yet, so no rank blocks.
std::vector<int64_t> agree(Transport& tr, const std::exception_ptr& local_error,
                           const std::vector<int64_t>& payload, const char* fn) {
  const int W = tr.world_size();
  const int64_t stride = 1 + static_cast<int64_t>(payload.size());
  std::vector<int64_t> mine(static_cast<size_t>(stride), 0);
  mine[0] = local_error ? 0 : 1;
  if (!local_error) std::copy(payload.begin(), payload.end(), mine.begin() + 1);
  std::vector<int64_t> table(static_cast<size_t>(stride * W));
  tr.all_gather(mine.data(), stride, table.data());
  std::string failed;
  for (int s = 0; s < W; ++s)
    if (table[static_cast<size_t>(s * stride)] == 0)
      failed += (failed.empty() ? "" : ", ") + std::to_string(s);
  if (local_error) std::rethrow_exception(local_error);
  if (!failed.empty())
    throw RemoteRankError(detail::concat(fn, ": rank(s) ", failed,
                                         " rejected their arguments; no rank ran"));
  return table;
}

// Dispatch lists of one rank (host), see EpSaved.
struct Dispatch {
  std::vector<int64_t> tok_count, pair_count;  // (W,) per destination
  Buffer tok_off, tokens, pair_off, pairs;     // as EpSaved's send_*
  Buffer meta;         // (N + 2M,) int32 words, per destination: pair count per token |
                       // local expert per pair | weight bits per pair
  std::vector<int64_t> meta_off;  // (W,) byte offsets of the blocks
};

Dispatch build_dispatch(const RoutingView& rt, int64_t E_local, int W) {
  Dispatch D;
  const int32_t* off = rt.pair_offsets;  // (T+1,)
  const int32_t* ex = rt.pair_experts;   // (P,) global expert ids
  const float* wt = rt.pair_weights;     // (P,)
  D.tok_count.assign(static_cast<size_t>(W), 0);
  D.pair_count.assign(static_cast<size_t>(W), 0);
  // last[r]: the last token counted for r, so a token goes to a rank once however many of the
  // rank's experts it chose.
  std::vector<int64_t> last(static_cast<size_t>(W), -1);
  for (int64_t t = 0; t < rt.T; ++t)
    for (int32_t p = off[t]; p < off[t + 1]; ++p) {
      const size_t r = static_cast<size_t>(ex[p] / E_local);
      ++D.pair_count[r];
      if (last[r] != t) {
        last[r] = t;
        ++D.tok_count[r];
      }
    }
  int64_t* tok_off = host_array<int64_t>(D.tok_off, W + 1);    // (W+1,)
  int64_t* pair_off = host_array<int64_t>(D.pair_off, W + 1);  // (W+1,)
  tok_off[0] = pair_off[0] = 0;
  for (int r = 0; r < W; ++r) {
    tok_off[r + 1] = tok_off[r] + D.tok_count[r];
    pair_off[r + 1] = pair_off[r] + D.pair_count[r];
  }
  const int64_t N = tok_off[W], M = pair_off[W];
  int32_t* tokens = host_array<int32_t>(D.tokens, N);  // (N,) grouped by destination
  int32_t* pairs = host_array<int32_t>(D.pairs, M);    // (M,) grouped by destination
  int32_t* meta = host_array<int32_t>(D.meta, N + 2 * M);
  D.meta_off.assign(static_cast<size_t>(W), 0);
  // Word offset of each destination's block and of its three parts.
  std::vector<int64_t> mc(static_cast<size_t>(W)), me(static_cast<size_t>(W)),
      mw(static_cast<size_t>(W)), tc(static_cast<size_t>(W)), pc(static_cast<size_t>(W));
  int64_t words = 0;
  for (int r = 0; r < W; ++r) {
    D.meta_off[r] = words * 4;
    mc[r] = words;
    me[r] = mc[r] + D.tok_count[r];
    mw[r] = me[r] + D.pair_count[r];
    words = mw[r] + D.pair_count[r];
    tc[r] = tok_off[r];
    pc[r] = pair_off[r];
  }
  std::fill(last.begin(), last.end(), -1);
  for (int64_t t = 0; t < rt.T; ++t)
    for (int32_t p = off[t]; p < off[t + 1]; ++p) {
      const int64_t r = ex[p] / E_local;
      if (last[r] != t) {
        last[r] = t;
        tokens[tc[r]++] = static_cast<int32_t>(t);
        meta[mc[r]++] = 0;
      }
      ++meta[mc[r] - 1];  // pairs of this token for r
      pairs[pc[r]++] = p;
      meta[me[r]++] = static_cast<int32_t>(ex[p] - r * E_local);
      int32_t bits;
      std::memcpy(&bits, &wt[p], 4);
      meta[mw[r]++] = bits;
    }
  return D;
}

// Local routing over the received tokens from the gathered metadata: sources in rank order,
// each source's tokens and pairs in the order it sent them.
void build_local_routing(const int32_t* meta, const std::vector<int64_t>& rn,
                         const std::vector<int64_t>& rm, int64_t E_local, Routing& out) {
  const size_t W = rn.size();
  int64_t R = 0, P = 0;
  for (size_t s = 0; s < W; ++s) {
    R += rn[s];
    P += rm[s];
  }
  out = Routing(Device::cpu, R, E_local, P);
  int32_t* off = out.pair_offsets();  // (R+1,)
  int32_t* ex = out.pair_experts();   // (P,)
  float* wt = out.pair_weights();     // (P,)
  int64_t row = 0, pair = 0;
  off[0] = 0;
  const int32_t* block = meta;
  for (size_t s = 0; s < W; ++s) {
    const int32_t* counts = block;             // (rn[s],)
    const int32_t* experts = counts + rn[s];   // (rm[s],)
    const int32_t* weights = experts + rm[s];  // (rm[s],) float bits
    for (int64_t i = 0; i < rn[s]; ++i, ++row) off[row + 1] = off[row] + counts[i];
    for (int64_t i = 0; i < rm[s]; ++i, ++pair) {
      ex[pair] = experts[i];
      std::memcpy(&wt[pair], &weights[i], 4);
    }
    block = weights + rm[s];
  }
}

// A host int32 array on the data device (a view of the same memory on the CPU).
const int32_t* on_device(Device dev, const Buffer& host, Buffer& dev_copy, void* stream) {
  if (dev == Device::cpu) return host.as<int32_t>();
  dev_copy = Buffer(dev, host.bytes());
  ep::copy_to_device(dev, dev_copy.data(), host.data(), host.bytes(), stream);
  return dev_copy.as<int32_t>();
}

// Byte counts/offsets of row blocks: count[r] rows of row_bytes each.
void row_bytes_of(const int64_t* row_off, int W, size_t row_bytes, std::vector<int64_t>& counts,
                  std::vector<int64_t>& offsets) {
  counts.resize(static_cast<size_t>(W));
  offsets.resize(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    offsets[r] = row_off[r] * static_cast<int64_t>(row_bytes);
    counts[r] = (row_off[r + 1] - row_off[r]) * static_cast<int64_t>(row_bytes);
  }
}

// Runs fn() and turns a failure on any rank into an exception on every rank.
template <typename Fn>
void run_agreed(Transport& tr, const char* what, double* exchange_s, Fn&& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  ScopedTime st(exchange_s);
  agree(tr, err, {}, what);
}

}  // namespace

EpShard ep_shard(int64_t num_experts, int world_size, int rank) {
  MOEBLAZE_REQUIRE(world_size >= 1, "world_size (", world_size, ") must be >= 1");
  MOEBLAZE_REQUIRE(rank >= 0 && rank < world_size, "rank (", rank, ") must be in [0, world_size ",
                   world_size, ")");
  MOEBLAZE_REQUIRE(num_experts >= 1, "num_experts E (", num_experts, ") must be >= 1");
  MOEBLAZE_REQUIRE(num_experts % world_size == 0, "num_experts E (", num_experts,
                   ") is not divisible by world_size (", world_size,
                   "): every rank holds an equal contiguous block of experts");
  const int64_t count = num_experts / world_size;
  return {rank * count, count};
}

int64_t EpSaved::sent_tokens() const {
  return send_tok_off.data() ? send_tok_off.as<int64_t>()[world_] : 0;
}

size_t EpSaved::bytes() const {
  return plan_.bytes() + layer_.bytes() + x_recv.bytes() + send_tok_off.bytes() +
         send_tokens.bytes() + send_pair_off.bytes() + send_pairs.bytes() + recv_tok_off.bytes() +
         recv_pair_off.bytes() + comb_off.bytes() + comb_rows.bytes() + d_send_tokens.bytes() +
         d_comb_off.bytes() + d_comb_rows.bytes();
}

void ep_forward(Transport& tr, const LayerConfig& cfg, const RoutingView& routing,
                const TensorView& x, const TensorView& w1, const TensorView& w2,
                const TensorView& out, EpSaved& saved, const EpOptions& opts) {
  const Clock::time_point t_start = Clock::now();
  EpTimings tm;
  check_transport(tr);
  const int W = tr.world_size(), q = tr.rank();
  const Device dev = tr.device();
  void* stream = opts.layer.stream;

  // ---- 1. local checks and dispatch lists; 2. agreement ----
  std::exception_ptr err;
  Dispatch D;
  EpShard shard;
  try {
    cfg.validate();
    check_layer_options(opts.layer);
    shard = ep_shard(cfg.E, W, q);
    MOEBLAZE_REQUIRE(routing.device == Device::cpu, "routing is on ",
                     device_name(routing.device),
                     ", expected cpu: the dispatch lists are built on the host");
    MOEBLAZE_REQUIRE(routing.T == cfg.T, "routing has T = ", routing.T,
                     " tokens, expected cfg.T = ", cfg.T, " (this rank's tokens)");
    MOEBLAZE_REQUIRE(routing.E == cfg.E, "routing has E = ", routing.E,
                     " experts, expected cfg.E = ", cfg.E, " (global expert ids)");
    validate_routing(routing);
    check_tensor(x, "x", {cfg.T, cfg.d}, cfg.dtype, dev);
    check_tensor(w1, "w1", {shard.count, cfg.w1_rows(), cfg.d}, cfg.dtype, dev);
    check_tensor(w2, "w2", {shard.count, cfg.d, cfg.n}, cfg.dtype, dev);
    check_tensor(out, "out", {cfg.T, cfg.d}, cfg.dtype, dev);
    D = build_dispatch(routing, shard.count, W);
  } catch (const Error&) {
    err = std::current_exception();
  }
  std::vector<int64_t> payload(static_cast<size_t>(kCfgFields + 2 * W), 0);
  if (!err) {
    cfg_fields(cfg, payload.data());
    for (int r = 0; r < W; ++r) {
      payload[kCfgFields + 2 * r] = D.tok_count[r];
      payload[kCfgFields + 2 * r + 1] = D.pair_count[r];
    }
  }
  std::vector<int64_t> table;
  {
    ScopedTime st(&tm.exchange_s);
    table = agree(tr, err, payload, "ep_forward");
  }
  const int64_t stride = 1 + static_cast<int64_t>(payload.size());
  for (int s = 1; s < W; ++s)
    for (int f = 0; f < kCfgFields; ++f) {
      const int64_t v0 = table[1 + f], vs = table[s * stride + 1 + f];
      MOEBLAZE_REQUIRE(vs == v0, "ep_forward: ", kCfgNames[f], " (", vs, ") on rank ", s,
                       " differs from ", kCfgNames[f], " (", v0, ") on rank 0");
    }

  // Every rank goes on from here. What this rank receives from each source s:
  std::vector<int64_t> rn(static_cast<size_t>(W)), rm(static_cast<size_t>(W));
  for (int s = 0; s < W; ++s) {
    rn[s] = table[s * stride + 1 + kCfgFields + 2 * q];
    rm[s] = table[s * stride + 1 + kCfgFields + 2 * q + 1];
  }
  saved = EpSaved();  // the old state never coexists with the new
  saved.rank_ = q;
  saved.world_ = W;
  saved.device_ = dev;
  saved.mode_ = opts.layer.mode;
  saved.cfg_ = cfg;
  saved.P_ = routing.P;
  saved.send_tok_off = std::move(D.tok_off);
  saved.send_tokens = std::move(D.tokens);
  saved.send_pair_off = std::move(D.pair_off);
  saved.send_pairs = std::move(D.pairs);
  const int64_t* tok_off = saved.send_tok_off.as<int64_t>();  // (W+1,)
  int64_t* rtok_off = host_array<int64_t>(saved.recv_tok_off, W + 1);    // (W+1,)
  int64_t* rpair_off = host_array<int64_t>(saved.recv_pair_off, W + 1);  // (W+1,)
  rtok_off[0] = rpair_off[0] = 0;
  for (int s = 0; s < W; ++s) {
    rtok_off[s + 1] = rtok_off[s] + rn[s];
    rpair_off[s + 1] = rpair_off[s] + rm[s];
  }
  const int64_t N = tok_off[W], R = rtok_off[W];

  // Combine lists: returned row i belongs to send_tokens[i]; a token's rows in ascending i are
  // in ascending rank order (the blocks return in rank order).
  {
    const int32_t* tokens = saved.send_tokens.as<int32_t>();
    int32_t* coff = host_array<int32_t>(saved.comb_off, cfg.T + 1);  // (T+1,)
    int32_t* crow = host_array<int32_t>(saved.comb_rows, N);         // (N,)
    std::fill(coff, coff + cfg.T + 1, 0);
    for (int64_t i = 0; i < N; ++i) ++coff[tokens[i] + 1];
    for (int64_t t = 0; t < cfg.T; ++t) coff[t + 1] += coff[t];
    std::vector<int32_t> cur(coff, coff + cfg.T);
    for (int64_t i = 0; i < N; ++i) crow[cur[tokens[i]]++] = static_cast<int32_t>(i);
  }
  ThreadCountScope threads(opts.layer.num_threads);

  // ---- 3. metadata → local routing → local plan ----
  {
    std::vector<int64_t> sc(W), so(W), rc(W), ro(W);
    int64_t recv_words = 0;
    for (int r = 0; r < W; ++r) {
      so[r] = D.meta_off[r];
      sc[r] = 4 * (D.tok_count[r] + 2 * D.pair_count[r]);
      ro[r] = recv_words * 4;
      rc[r] = 4 * (rn[r] + 2 * rm[r]);
      recv_words += rn[r] + 2 * rm[r];
    }
    Buffer recv_meta(Device::cpu, 4 * static_cast<size_t>(recv_words));  // (R + 2 P_recv,) int32
    {
      ScopedTime st(&tm.exchange_s);
      if (dev == Device::cpu) {
        tr.all_to_all_v(D.meta.data(), sc.data(), so.data(), recv_meta.data(), rc.data(),
                        ro.data());
      } else {  // the transport moves device memory: stage through it
        Buffer dsend(dev, D.meta.bytes()), drecv(dev, recv_meta.bytes());
        ep::copy_to_device(dev, dsend.data(), D.meta.data(), D.meta.bytes(), stream);
        ep::synchronize(dev, stream);
        tr.all_to_all_v(dsend.data(), sc.data(), so.data(), drecv.data(), rc.data(), ro.data());
        ep::copy_to_host(dev, recv_meta.data(), drecv.data(), recv_meta.bytes(), stream);
      }
    }
    Routing local;
    build_local_routing(recv_meta.as<int32_t>(), rn, rm, shard.count, local);
    if (dev == Device::cpu) {
      build_routing_plan(local.view(), PlanBuilder::atomic_free, saved.plan_);
    } else {
      // The plan is built where the layer runs: the routing's three arrays go to the device
      // (R + 1 + 2 P words) and the GPU builder makes the same bits as the CPU one (tested) in
      // a fraction of the host time, instead of a host build and six plan arrays copied over.
      Routing dev_local(dev, local.T(), local.E(), local.P());
      ep::copy_to_device(dev, dev_local.pair_offsets(), local.pair_offsets(),
                         4 * static_cast<size_t>(local.T() + 1), stream);
      ep::copy_to_device(dev, dev_local.pair_experts(), local.pair_experts(),
                         4 * static_cast<size_t>(local.P()), stream);
      ep::copy_to_device(dev, dev_local.pair_weights(), local.pair_weights(),
                         4 * static_cast<size_t>(local.P()), stream);
      ep::synchronize(dev, stream);  // the builder runs on the default stream
      build_routing_plan(dev_local.view(), PlanBuilder::atomic_free, saved.plan_);
    }
  }
  saved.local_cfg_ = cfg;
  saved.local_cfg_.T = R;
  saved.local_cfg_.E = shard.count;
  saved.local_cfg_.K = std::min<int64_t>(cfg.K, shard.count);  // K only bounds the layer's checks

  // ---- 4. token rows to their experts' ranks ----
  const size_t row_bytes = static_cast<size_t>(cfg.d) * dtype_size(cfg.dtype);
  const int32_t* send_tokens = on_device(dev, saved.send_tokens, saved.d_send_tokens, stream);
  std::vector<int64_t> sc, so, rc, ro;
  row_bytes_of(tok_off, W, row_bytes, sc, so);
  row_bytes_of(rtok_off, W, row_bytes, rc, ro);
  saved.x_recv = Buffer(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) cfg.dtype
  {
    Buffer send_rows(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) cfg.dtype
    ep::gather_rows(dev, x.data, send_tokens, N, row_bytes, send_rows.data(), stream);
    ep::synchronize(dev, stream);
    ScopedTime st(&tm.exchange_s);
    tr.all_to_all_v(send_rows.data(), sc.data(), so.data(), saved.x_recv.data(), rc.data(),
                    ro.data());
  }

  // ---- 5. the local layer ----
  Buffer out_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) partial sums per (token, q)
  run_agreed(tr, "ep_forward (local layer)", &tm.exchange_s, [&] {
    ScopedTime st(&tm.layer_s);
    layer_forward(saved.local_cfg_, saved.plan_, saved.x_recv.view(cfg.dtype, {R, cfg.d}), w1, w2,
                  out_recv.view(cfg.dtype, {R, cfg.d}), saved.layer_, opts.layer);
    ep::synchronize(dev, stream);
  });

  // ---- 6. partials back, combined in rank order ----
  {
    Buffer ret(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) cfg.dtype, as send_tokens
    {
      ScopedTime st(&tm.exchange_s);
      tr.all_to_all_v(out_recv.data(), rc.data(), ro.data(), ret.data(), sc.data(), so.data());
    }
    const int32_t* coff = on_device(dev, saved.comb_off, saved.d_comb_off, stream);
    const int32_t* crow = on_device(dev, saved.comb_rows, saved.d_comb_rows, stream);
    ep::combine_rows(dev, ret.data(), coff, crow, cfg.T, cfg.d, cfg.dtype, out.data, stream);
    ep::synchronize(dev, stream);
  }
  saved.valid_ = true;
  tm.total_s = seconds_since(t_start);
  if (opts.timings) *opts.timings = tm;
}

void ep_backward(Transport& tr, const LayerConfig& cfg, const TensorView& w1,
                 const TensorView& w2, const TensorView& d_out, const EpSaved& saved,
                 const EpGrads& grads, const EpOptions& opts) {
  const Clock::time_point t_start = Clock::now();
  EpTimings tm;
  check_transport(tr);
  const int W = tr.world_size(), q = tr.rank();
  const Device dev = tr.device();
  void* stream = opts.layer.stream;

  std::exception_ptr err;
  try {
    cfg.validate();
    check_layer_options(opts.layer);
    const EpShard shard = ep_shard(cfg.E, W, q);
    MOEBLAZE_REQUIRE(saved.valid(), "saved is not valid: run ep_forward first");
    MOEBLAZE_REQUIRE(saved.rank_ == q && saved.world_ == W, "saved comes from rank ", saved.rank_,
                     " of ", saved.world_, ", but the transport is rank ", q, " of ", W);
    MOEBLAZE_REQUIRE(saved.device_ == dev, "saved is on ", device_name(saved.device_),
                     ", but the transport moves ", device_name(dev), " memory");
    const LayerConfig& c0 = saved.cfg_;
    MOEBLAZE_REQUIRE(c0.T == cfg.T && c0.d == cfg.d && c0.n == cfg.n && c0.E == cfg.E &&
                         c0.activation == cfg.activation && c0.dtype == cfg.dtype,
                     "cfg differs from the one ep_forward ran with (T, d, n, E, activation, "
                     "dtype must match)");
    MOEBLAZE_REQUIRE(saved.mode_ == opts.layer.mode, "saved comes from mode ",
                     layer_mode_name(saved.mode_), ", but opts.layer.mode is ",
                     layer_mode_name(opts.layer.mode));
    check_tensor(w1, "w1", {shard.count, cfg.w1_rows(), cfg.d}, cfg.dtype, dev);
    check_tensor(w2, "w2", {shard.count, cfg.d, cfg.n}, cfg.dtype, dev);
    check_tensor(d_out, "d_out", {cfg.T, cfg.d}, cfg.dtype, dev);
    check_tensor(grads.dx, "dx", {cfg.T, cfg.d}, cfg.dtype, dev);
    check_tensor(grads.dw1, "dw1", {shard.count, cfg.w1_rows(), cfg.d}, cfg.dtype, dev);
    check_tensor(grads.dw2, "dw2", {shard.count, cfg.d, cfg.n}, cfg.dtype, dev);
    check_tensor(grads.d_pair_weights, "d_pair_weights", {saved.P_}, DType::f32, dev);
  } catch (const Error&) {
    err = std::current_exception();
  }
  {
    ScopedTime st(&tm.exchange_s);
    agree(tr, err, {}, "ep_backward");
  }
  ThreadCountScope threads(opts.layer.num_threads);

  const int64_t* tok_off = saved.send_tok_off.as<int64_t>();    // (W+1,)
  const int64_t* rtok_off = saved.recv_tok_off.as<int64_t>();   // (W+1,)
  const int64_t* pair_off = saved.send_pair_off.as<int64_t>();  // (W+1,)
  const int64_t* rpair_off = saved.recv_pair_off.as<int64_t>(); // (W+1,)
  const int64_t N = tok_off[W], R = rtok_off[W], M = pair_off[W], Pr = rpair_off[W];
  const size_t row_bytes = static_cast<size_t>(cfg.d) * dtype_size(cfg.dtype);
  std::vector<int64_t> sc, so, rc, ro;
  row_bytes_of(tok_off, W, row_bytes, sc, so);
  row_bytes_of(rtok_off, W, row_bytes, rc, ro);
  const int32_t* send_tokens =
      dev == Device::cpu ? saved.send_tokens.as<int32_t>() : saved.d_send_tokens.as<int32_t>();
  const int32_t* coff =
      dev == Device::cpu ? saved.comb_off.as<int32_t>() : saved.d_comb_off.as<int32_t>();
  const int32_t* crow =
      dev == Device::cpu ? saved.comb_rows.as<int32_t>() : saved.d_comb_rows.as<int32_t>();

  // ---- d_out rows to the ranks the tokens used ----
  Buffer dout_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) as x_recv
  {
    Buffer send_rows(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) as send_tokens
    ep::gather_rows(dev, d_out.data, send_tokens, N, row_bytes, send_rows.data(), stream);
    ep::synchronize(dev, stream);
    ScopedTime st(&tm.exchange_s);
    tr.all_to_all_v(send_rows.data(), sc.data(), so.data(), dout_recv.data(), rc.data(),
                    ro.data());
  }

  // ---- local layer: dx partials, complete dw1/dw2 of the local experts, d pair weights ----
  Buffer dx_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) partial per (token, q)
  Buffer dpw_recv(dev, sizeof(float) * static_cast<size_t>(Pr));  // (P_recv,) local pair order
  run_agreed(tr, "ep_backward (local layer)", &tm.exchange_s, [&] {
    ScopedTime st(&tm.layer_s);
    LayerGrads g;
    g.dx = dx_recv.view(cfg.dtype, {R, cfg.d});
    g.dw1 = grads.dw1;
    g.dw2 = grads.dw2;
    g.d_pair_weights = dpw_recv.view(DType::f32, {Pr});
    layer_backward(saved.local_cfg_, saved.plan_, saved.x_recv.view(cfg.dtype, {R, cfg.d}), w1,
                   w2, dout_recv.view(cfg.dtype, {R, cfg.d}), saved.layer_, g, opts.layer);
    ep::synchronize(dev, stream);
  });

  // ---- dx partials back, combined in rank order; pair gradients back to their pairs ----
  {
    Buffer ret(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) as send_tokens
    std::vector<int64_t> psc, pso, prc, pro;
    row_bytes_of(pair_off, W, sizeof(float), psc, pso);
    row_bytes_of(rpair_off, W, sizeof(float), prc, pro);
    Buffer dpw_ret(dev, sizeof(float) * static_cast<size_t>(M));  // (M,) as send_pairs
    {
      ScopedTime st(&tm.exchange_s);
      tr.all_to_all_v(dx_recv.data(), rc.data(), ro.data(), ret.data(), sc.data(), so.data());
      tr.all_to_all_v(dpw_recv.data(), prc.data(), pro.data(), dpw_ret.data(), psc.data(),
                      pso.data());
    }
    ep::combine_rows(dev, ret.data(), coff, crow, cfg.T, cfg.d, cfg.dtype, grads.dx.data, stream);
    // Every pair went to exactly one rank, so this scatter writes each entry once.
    const int32_t* pairs = saved.send_pairs.as<int32_t>();  // (M,) local pair ids
    Buffer host_ret, host_dpw;
    const float* from = dpw_ret.as<float>();
    float* to = grads.d_pair_weights.as<float>();
    if (dev != Device::cpu) {
      from = host_array<float>(host_ret, M);
      ep::copy_to_host(dev, host_ret.data(), dpw_ret.data(), host_ret.bytes(), stream);
      to = host_array<float>(host_dpw, saved.P_);
    }
    for (int64_t i = 0; i < M; ++i) to[pairs[i]] = from[i];
    if (dev != Device::cpu)
      ep::copy_to_device(dev, grads.d_pair_weights.data, host_dpw.data(), host_dpw.bytes(),
                         stream);
    ep::synchronize(dev, stream);
  }
  tm.total_s = seconds_since(t_start);
  if (opts.timings) *opts.timings = tm;
}

}  // namespace moeblaze
