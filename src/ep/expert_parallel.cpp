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
// With EpOptions::chunks = C > 1 the tokens are cut into C fixed contiguous ranges; steps 1-3
// stay one pass each (the per-chunk counts travel in the metadata), and 4-6 run per chunk as a
// pipeline on the transport's stream-ordered exchanges (see the schedule in ep_forward), the
// combine once at the end over every chunk's returned rows.
//
// Everything that decides an order (dispatch lists, received layout, combine order) is a
// function of the routings only, never of timing: results are bitwise reproducible.
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "core/layer_checks.hpp"
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
  require_layer_mode(o.mode, "opts.layer.mode");
  require_thread_count(o.num_threads, "opts.layer.num_threads");
}

// Fields every rank must agree on, in the order they are gathered and reported.
// Fields every rank must agree on, in the order they are gathered and reported. opts.chunks is
// one of them: it decides the message layout and how many exchanges follow.
constexpr int kCfgFields = 6;
const char* const kCfgNames[kCfgFields] = {"cfg.d", "cfg.n", "cfg.E", "cfg.activation",
                                           "cfg.dtype", "opts.chunks"};
void cfg_fields(const LayerConfig& c, int chunks, int64_t* f) {
  f[0] = c.d;
  f[1] = c.n;
  f[2] = c.E;
  f[3] = static_cast<int64_t>(c.activation);
  f[4] = static_cast<int64_t>(c.dtype);
  f[5] = chunks;
}

void check_chunks(int chunks) {
  MOEBLAZE_REQUIRE(chunks >= 1 && chunks <= kEpMaxChunks, "EpOptions::chunks (", chunks,
                   ") must be in [1, ", kEpMaxChunks,
                   "]: the number of pipelined exchanges of this rank's tokens");
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

// First token of chunk c of C over T tokens: chunk c is [chunk_begin(c), chunk_begin(c+1)), a
// function of T and C only (sizes differ by at most one; some are empty when T < C).
int64_t chunk_begin(int64_t T, int C, int c) { return T * c / C; }

// Words of the per-chunk count header at the start of each metadata block (C > 1 only, so that
// one exchange keeps the layout it always had).
int64_t meta_header_words(int C) { return C > 1 ? 2 * static_cast<int64_t>(C) : 0; }

// Dispatch lists of one rank (host), see EpSaved. Entry k = c*W + r is (chunk c, destination r).
struct Dispatch {
  std::vector<int64_t> tok_count, pair_count;  // (C*W,) per (chunk, destination)
  std::vector<int64_t> tok_total, pair_total;  // (W,) per destination, all chunks
  Buffer tok_off, tokens, pair_off, pairs;     // as EpSaved's send_*
  // int32 words, one block per destination r, in rank order: with C > 1 a header of 2C words
  // (tokens, pairs of chunk c for r), then per chunk: pair count per token | local expert per
  // pair | weight bits per pair.
  Buffer meta;
  std::vector<int64_t> meta_off, meta_bytes;  // (W,) byte offset and size of each block
};

Dispatch build_dispatch(const RoutingView& rt, int64_t E_local, int W, int C) {
  Dispatch D;
  const int32_t* off = rt.pair_offsets;  // (T+1,)
  const int32_t* ex = rt.pair_experts;   // (P,) global expert ids
  const float* wt = rt.pair_weights;     // (P,)
  const size_t CW = static_cast<size_t>(C) * static_cast<size_t>(W);
  D.tok_count.assign(CW, 0);
  D.pair_count.assign(CW, 0);
  // last[r]: the last token counted for r, so a token goes to a rank once however many of the
  // rank's experts it chose (token ids are distinct across chunks: no reset between them).
  std::vector<int64_t> last(static_cast<size_t>(W), -1);
  for (int c = 0; c < C; ++c)
    for (int64_t t = chunk_begin(rt.T, C, c); t < chunk_begin(rt.T, C, c + 1); ++t)
      for (int32_t p = off[t]; p < off[t + 1]; ++p) {
        const int64_t r = ex[p] / E_local;
        const size_t k = static_cast<size_t>(c) * W + static_cast<size_t>(r);
        ++D.pair_count[k];
        if (last[r] != t) {
          last[r] = t;
          ++D.tok_count[k];
        }
      }
  int64_t* tok_off = host_array<int64_t>(D.tok_off, static_cast<int64_t>(CW) + 1);    // (CW+1,)
  int64_t* pair_off = host_array<int64_t>(D.pair_off, static_cast<int64_t>(CW) + 1);  // (CW+1,)
  tok_off[0] = pair_off[0] = 0;
  for (size_t k = 0; k < CW; ++k) {
    tok_off[k + 1] = tok_off[k] + D.tok_count[k];
    pair_off[k + 1] = pair_off[k] + D.pair_count[k];
  }
  D.tok_total.assign(static_cast<size_t>(W), 0);
  D.pair_total.assign(static_cast<size_t>(W), 0);
  for (size_t k = 0; k < CW; ++k) {
    D.tok_total[k % W] += D.tok_count[k];
    D.pair_total[k % W] += D.pair_count[k];
  }
  const int64_t N = tok_off[CW], M = pair_off[CW], H = meta_header_words(C);
  int32_t* tokens = host_array<int32_t>(D.tokens, N);  // (N,) by chunk, then destination
  int32_t* pairs = host_array<int32_t>(D.pairs, M);    // (M,) by chunk, then destination
  int32_t* meta = host_array<int32_t>(D.meta, W * H + N + 2 * M);
  D.meta_off.assign(static_cast<size_t>(W), 0);
  D.meta_bytes.assign(static_cast<size_t>(W), 0);
  // Word offset of the three parts of each (chunk, destination) sub-block, and write cursors.
  std::vector<int64_t> mc(CW), me(CW), mw(CW), tc(CW), pc(CW);
  int64_t words = 0;
  for (int r = 0; r < W; ++r) {
    D.meta_off[r] = words * 4;
    for (int c = 0; c < C && H > 0; ++c) {
      meta[words + 2 * c] = static_cast<int32_t>(D.tok_count[static_cast<size_t>(c) * W + r]);
      meta[words + 2 * c + 1] = static_cast<int32_t>(D.pair_count[static_cast<size_t>(c) * W + r]);
    }
    words += H;
    for (int c = 0; c < C; ++c) {
      const size_t k = static_cast<size_t>(c) * W + static_cast<size_t>(r);
      mc[k] = words;
      me[k] = mc[k] + D.tok_count[k];
      mw[k] = me[k] + D.pair_count[k];
      words = mw[k] + D.pair_count[k];
      tc[k] = tok_off[k];
      pc[k] = pair_off[k];
    }
    D.meta_bytes[r] = words * 4 - D.meta_off[r];
  }
  std::fill(last.begin(), last.end(), -1);
  for (int c = 0; c < C; ++c)
    for (int64_t t = chunk_begin(rt.T, C, c); t < chunk_begin(rt.T, C, c + 1); ++t)
      for (int32_t p = off[t]; p < off[t + 1]; ++p) {
        const int64_t r = ex[p] / E_local;
        const size_t k = static_cast<size_t>(c) * W + static_cast<size_t>(r);
        if (last[r] != t) {
          last[r] = t;
          tokens[tc[k]++] = static_cast<int32_t>(t);
          meta[mc[k]++] = 0;
        }
        ++meta[mc[k] - 1];  // pairs of this token for r
        pairs[pc[k]++] = p;
        meta[me[k]++] = static_cast<int32_t>(ex[p] - r * E_local);
        int32_t bits;
        std::memcpy(&bits, &wt[p], 4);
        meta[mw[k]++] = bits;
      }
  return D;
}

// Local routing over one chunk's received tokens from the gathered metadata: sources in rank
// order, each source's tokens and pairs in the order it sent them. blocks[s] is source s's
// sub-block of this chunk: pair counts (rn[s],) | local experts (rm[s],) | weight bits (rm[s],).
void build_local_routing(const std::vector<const int32_t*>& blocks,
                         const std::vector<int64_t>& rn, const std::vector<int64_t>& rm,
                         int64_t E_local, Routing& out) {
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
  for (size_t s = 0; s < W; ++s) {
    const int32_t* counts = blocks[s];         // (rn[s],)
    const int32_t* experts = counts + rn[s];   // (rm[s],)
    const int32_t* weights = experts + rm[s];  // (rm[s],) float bits
    for (int64_t i = 0; i < rn[s]; ++i, ++row) off[row + 1] = off[row] + counts[i];
    for (int64_t i = 0; i < rm[s]; ++i, ++pair) {
      ex[pair] = experts[i];
      std::memcpy(&wt[pair], &weights[i], 4);
    }
  }
}

// A host int32 array on the data device (a view of the same memory on the CPU).
const int32_t* on_device(Device dev, const Buffer& host, Buffer& dev_copy, void* stream) {
  if (dev == Device::cpu) return host.as<int32_t>();
  dev_copy = Buffer(dev, host.bytes());
  ep::copy_to_device(dev, dev_copy.data(), host.data(), host.bytes(), stream);
  return dev_copy.as<int32_t>();
}

// Byte counts/offsets of chunk c's row blocks: rank r's rows are [off[c*W+r], off[c*W+r+1]) of
// an array holding every chunk; the offsets count from row off[c*W] when `relative` (a buffer
// of this chunk only), else from row 0.
void chunk_row_bytes(const int64_t* off, int W, int c, size_t row_bytes, bool relative,
                     std::vector<int64_t>& counts, std::vector<int64_t>& offsets) {
  counts.resize(static_cast<size_t>(W));
  offsets.resize(static_cast<size_t>(W));
  const int64_t* o = off + static_cast<int64_t>(c) * W;
  const int64_t base = relative ? o[0] : 0;
  for (int r = 0; r < W; ++r) {
    offsets[r] = (o[r] - base) * static_cast<int64_t>(row_bytes);
    counts[r] = (o[r + 1] - o[r]) * static_cast<int64_t>(row_bytes);
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

// The pipeline's exchanges may still be running when an exception leaves it (a transport
// error): this waits for them, and for the layer's stream, before the buffers they use are
// freed. Declared after those buffers, so it runs first. Disarmed on the normal path, which
// waits explicitly.
class DrainOnUnwind {
 public:
  DrainOnUnwind(Transport& tr, Device dev, void* stream) : tr_(tr), dev_(dev), stream_(stream) {}
  ~DrainOnUnwind() {
    if (!armed_) return;
    try {
      tr_.synchronize_exchanges();
      ep::synchronize(dev_, stream_);
    } catch (...) {  // already unwinding from the first error; this one adds nothing
    }
  }
  void disarm() { armed_ = false; }

 private:
  Transport& tr_;
  Device dev_;
  void* stream_;
  bool armed_ = true;
};

// The chunk pipeline, issued in this order on every rank (one exchange queue):
//   out0 out1 | L0 back0 out2 | L1 back1 out3 | ... | L(C-1) back(C-1)
// so chunk c+1's rows travel while chunk c's layer runs, and chunk c's results return while
// chunk c+1's layer runs; each layer waits only for its own rows. A stream-ordered transport
// queues each exchange behind the kernels that produced its send buffer (events) and the host
// never waits per chunk; a blocking one moves the data at once, after the layer's stream was
// synchronised. Every rank takes part in every exchange even when its local layer failed, so
// none is left waiting: the failure (the first; later chunks skip the layer) is returned, for
// the caller to agree on before it touches any output.
//   send_out(c) -> ticket      starts chunk c's rows out (their send buffer is ready on stream)
//   layer(c)                   queues chunk c's local layer on stream, after its rows arrived
//   send_back(c, tickets)      starts chunk c's results back, appending their tickets
// On return every exchange has completed and the stream is synchronised.
template <typename Out, typename Layer, typename Back>
std::exception_ptr run_chunk_pipeline(Transport& tr, Device dev, void* stream, int C,
                                      EpTimings& tm, Out&& send_out, Layer&& layer,
                                      Back&& send_back) {
  const bool ordered = tr.stream_ordered();
  auto producer_done = [&] {
    if (!ordered) ep::synchronize(dev, stream);
  };
  DrainOnUnwind drain(tr, dev, stream);
  std::vector<uint64_t> out_ticket(static_cast<size_t>(C)), back_ticket;
  auto start_out = [&](int c) {
    ScopedTime st(&tm.exchange_s);
    out_ticket[c] = send_out(c);
  };
  producer_done();  // the caller gathered every chunk's rows
  start_out(0);
  if (C > 1) start_out(1);
  std::exception_ptr err;
  for (int c = 0; c < C; ++c) {
    {
      ScopedTime st(&tm.exchange_s);
      tr.all_to_all_v_wait(out_ticket[c], stream);
    }
    if (!err) {
      try {
        ScopedTime st(&tm.layer_s);
        layer(c);
      } catch (...) {
        err = std::current_exception();
      }
    }
    producer_done();
    {
      ScopedTime st(&tm.exchange_s);
      send_back(c, back_ticket);
    }
    if (c + 2 < C) start_out(c + 2);
  }
  {
    ScopedTime st(&tm.exchange_s);
    for (uint64_t t : back_ticket) tr.all_to_all_v_wait(t, stream);
  }
  {
    ScopedTime st(&tm.pipeline_s);
    ep::synchronize(dev, stream);
    tr.synchronize_exchanges();
  }
  drain.disarm();
  return err;
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

int64_t EpSaved::received_tokens() const {
  int64_t R = 0;
  for (const EpChunkSaved& c : chunks_) R += c.local_cfg.T;
  return R;
}

int64_t EpSaved::received_pairs() const {
  int64_t S = 0;
  for (const EpChunkSaved& c : chunks_) S += c.plan.S();
  return S;
}

int64_t EpSaved::sent_tokens() const {
  return send_tok_off.data() ? send_tok_off.as<int64_t>()[chunks() * world_] : 0;
}

size_t EpSaved::bytes() const {
  size_t b = 0;
  for (const EpChunkSaved& c : chunks_) b += c.plan.bytes() + c.layer.bytes() + c.x_recv.bytes();
  return b + send_tok_off.bytes() + send_tokens.bytes() + send_pair_off.bytes() +
         send_pairs.bytes() + recv_tok_off.bytes() + recv_pair_off.bytes() + comb_off.bytes() +
         comb_rows.bytes() + d_send_tokens.bytes() + d_comb_off.bytes() + d_comb_rows.bytes();
}

namespace {

// What every step of one ep_forward / ep_backward call shares.
struct EpCall {
  Transport& tr;
  Device dev;
  void* stream;
  int W, q;
  EpTimings tm;
};

EpCall start_call(Transport& tr, const EpOptions& opts) {
  check_transport(tr);
  return {tr, tr.device(), opts.layer.stream, tr.world_size(), tr.rank(), EpTimings{}};
}

// Byte counts and offsets of chunk c's exchange of one array of rows: s* on the side holding
// every chunk's rows (offsets from row 0), r* on the side holding this chunk's rows only.
struct ChunkBytes {
  std::vector<int64_t> sc, so, rc, ro;  // (W,) each

  void set(const int64_t* all_off, const int64_t* chunk_off, int W, int c, size_t row_bytes) {
    chunk_row_bytes(all_off, W, c, row_bytes, false, sc, so);
    chunk_row_bytes(chunk_off, W, c, row_bytes, true, rc, ro);
  }
  // Chunk c's token rows (send_tokens <-> x_recv and alike), and its pairs' fp32 gradients.
  void tokens_of(const EpSaved& s, int c, size_t row_bytes) {
    set(s.send_tok_off.as<int64_t>(), s.recv_tok_off.as<int64_t>(), s.world_, c, row_bytes);
  }
  void pairs_of(const EpSaved& s, int c) {
    set(s.send_pair_off.as<int64_t>(), s.recv_pair_off.as<int64_t>(), s.world_, c, sizeof(float));
  }
  // out: the array of every chunk -> this chunk's buffer; back: the reverse. Blocking, or started
  // on a stream-ordered transport.
  void out(Transport& tr, const void* all, void* chunk) const {
    tr.all_to_all_v(all, sc.data(), so.data(), chunk, rc.data(), ro.data());
  }
  void back(Transport& tr, const void* chunk, void* all) const {
    tr.all_to_all_v(chunk, rc.data(), ro.data(), all, sc.data(), so.data());
  }
  uint64_t start_out(Transport& tr, const void* all, void* chunk, void* stream) const {
    return tr.all_to_all_v_start(all, sc.data(), so.data(), chunk, rc.data(), ro.data(), stream);
  }
  uint64_t start_back(Transport& tr, const void* chunk, void* all, void* stream) const {
    return tr.all_to_all_v_start(chunk, rc.data(), ro.data(), all, sc.data(), so.data(), stream);
  }
};

// The token rows' index arrays on the data's device: which local tokens are sent (in the order
// of the exchange), and which returned rows make up each token's result.
struct RowLists {
  const int32_t* send_tokens;  // (N,)
  const int32_t* comb_off;     // (T+1,)
  const int32_t* comb_rows;    // (N,)
  int64_t N;                   // rows sent, all chunks
  size_t row_bytes;            // d * dtype size
};

// ---------------------------------------------------------------------------------------------
// ep_forward's steps

// 1. Local checks and this rank's dispatch lists. A failure is returned, for step 2 to agree on.
std::exception_ptr check_forward(const EpCall& call, const LayerConfig& cfg,
                                 const RoutingView& routing, const TensorView& x,
                                 const TensorView& w1, const TensorView& w2, const TensorView& out,
                                 const EpOptions& opts, EpShard& shard, Dispatch& D) {
  const int C = opts.chunks;
  try {
    cfg.validate();
    check_layer_options(opts.layer);
    check_chunks(C);
    shard = ep_shard(cfg.E, call.W, call.q);
    MOEBLAZE_REQUIRE(routing.device == Device::cpu, "routing is on ",
                     device_name(routing.device),
                     ", expected cpu: the dispatch lists are built on the host");
    MOEBLAZE_REQUIRE(routing.T == cfg.T, "routing has T = ", routing.T,
                     " tokens, expected cfg.T = ", cfg.T, " (this rank's tokens)");
    MOEBLAZE_REQUIRE(routing.E == cfg.E, "routing has E = ", routing.E,
                     " experts, expected cfg.E = ", cfg.E, " (global expert ids)");
    validate_routing(routing);
    check_tensor(x, "x", {cfg.T, cfg.d}, cfg.dtype, call.dev);
    check_tensor(w1, "w1", {shard.count, cfg.w1_rows(), cfg.d}, cfg.dtype, call.dev);
    check_tensor(w2, "w2", {shard.count, cfg.d, cfg.n}, cfg.dtype, call.dev);
    check_tensor(out, "out", {cfg.T, cfg.d}, cfg.dtype, call.dev);
    D = build_dispatch(routing, shard.count, call.W, C);
  } catch (const Error&) {
    return std::current_exception();
  }
  return nullptr;
}

// 2. Agreement on the verdicts, the cfg fields and the counts. Sets what this rank receives from
// each source s, all chunks: rn[s] tokens and rm[s] pairs.
void agree_forward(EpCall& call, const LayerConfig& cfg, int C, const Dispatch& D,
                   const std::exception_ptr& err, std::vector<int64_t>& rn,
                   std::vector<int64_t>& rm) {
  const int W = call.W;
  // Totals per destination only, so that the payload has the same length on every rank even
  // when the ranks disagree on chunks; the per-chunk counts travel with the metadata.
  std::vector<int64_t> payload(static_cast<size_t>(kCfgFields + 2 * W), 0);
  if (!err) {
    cfg_fields(cfg, C, payload.data());
    for (int r = 0; r < W; ++r) {
      payload[kCfgFields + 2 * r] = D.tok_total[r];
      payload[kCfgFields + 2 * r + 1] = D.pair_total[r];
    }
  }
  std::vector<int64_t> table;
  {
    ScopedTime st(&call.tm.exchange_s);
    table = agree(call.tr, err, payload, "ep_forward");
  }
  const int64_t stride = 1 + static_cast<int64_t>(payload.size());
  for (int s = 1; s < W; ++s)
    for (int f = 0; f < kCfgFields; ++f) {
      const int64_t v0 = table[1 + f], vs = table[s * stride + 1 + f];
      MOEBLAZE_REQUIRE(vs == v0, "ep_forward: ", kCfgNames[f], " (", vs, ") on rank ", s,
                       " differs from ", kCfgNames[f], " (", v0, ") on rank 0");
    }
  rn.assign(static_cast<size_t>(W), 0);
  rm.assign(static_cast<size_t>(W), 0);
  for (int s = 0; s < W; ++s) {
    rn[s] = table[s * stride + 1 + kCfgFields + 2 * call.q];
    rm[s] = table[s * stride + 1 + kCfgFields + 2 * call.q + 1];
  }
}

// A fresh `saved` (the old state never coexists with the new) holding the dispatch lists.
void start_saved(const EpCall& call, const LayerConfig& cfg, int64_t P, LayerMode mode, int C,
                 Dispatch& D, EpSaved& saved) {
  saved = EpSaved();
  saved.rank_ = call.q;
  saved.world_ = call.W;
  saved.device_ = call.dev;
  saved.mode_ = mode;
  saved.cfg_ = cfg;
  saved.P_ = P;
  saved.chunks_.resize(static_cast<size_t>(C));
  saved.send_tok_off = std::move(D.tok_off);
  saved.send_tokens = std::move(D.tokens);
  saved.send_pair_off = std::move(D.pair_off);
  saved.send_pairs = std::move(D.pairs);
}

// Combine lists: returned row i belongs to send_tokens[i]; a token lies in one chunk, and its
// rows in ascending i are in ascending rank order (each chunk's blocks return in rank order).
void build_combine_lists(int64_t T, int64_t N, EpSaved& saved) {
  const int32_t* tokens = saved.send_tokens.as<int32_t>();
  int32_t* coff = host_array<int32_t>(saved.comb_off, T + 1);  // (T+1,)
  int32_t* crow = host_array<int32_t>(saved.comb_rows, N);     // (N,)
  std::fill(coff, coff + T + 1, 0);
  for (int64_t i = 0; i < N; ++i) ++coff[tokens[i] + 1];
  for (int64_t t = 0; t < T; ++t) coff[t + 1] += coff[t];
  std::vector<int32_t> cur(coff, coff + T);
  for (int64_t i = 0; i < N; ++i) crow[cur[tokens[i]]++] = static_cast<int32_t>(i);
}

// 3a. The metadata of every chunk in one exchange. Returns the received words, (W*H + R +
// 2 P_recv,) int32: per source its header, then per chunk its sub-block; ro[s] is the byte offset
// of source s's block.
Buffer exchange_metadata(EpCall& call, const Dispatch& D, int C, const std::vector<int64_t>& rn,
                         const std::vector<int64_t>& rm, std::vector<int64_t>& ro) {
  const int W = call.W;
  const Device dev = call.dev;
  const int64_t H = meta_header_words(C);
  std::vector<int64_t> sc(W), so(W), rc(W);
  ro.assign(static_cast<size_t>(W), 0);
  int64_t recv_words = 0;
  for (int r = 0; r < W; ++r) {
    so[r] = D.meta_off[r];
    sc[r] = D.meta_bytes[r];
    ro[r] = recv_words * 4;
    rc[r] = 4 * (H + rn[r] + 2 * rm[r]);
    recv_words += H + rn[r] + 2 * rm[r];
  }
  Buffer recv_meta(Device::cpu, 4 * static_cast<size_t>(recv_words));
  ScopedTime st(&call.tm.exchange_s);
  if (dev == Device::cpu) {
    call.tr.all_to_all_v(D.meta.data(), sc.data(), so.data(), recv_meta.data(), rc.data(),
                         ro.data());
  } else {  // the transport moves device memory: stage through it
    Buffer dsend(dev, D.meta.bytes()), drecv(dev, recv_meta.bytes());
    ep::copy_to_device(dev, dsend.data(), D.meta.data(), D.meta.bytes(), call.stream);
    ep::synchronize(dev, call.stream);
    call.tr.all_to_all_v(dsend.data(), sc.data(), so.data(), drecv.data(), rc.data(), ro.data());
    ep::copy_to_host(dev, recv_meta.data(), drecv.data(), recv_meta.bytes(), call.stream);
  }
  return recv_meta;
}

// 3b. The local routing of every chunk from the received metadata, and saved's receive offsets.
std::vector<Routing> local_routings(const EpCall& call, const Buffer& recv_meta,
                                    const std::vector<int64_t>& ro, int C,
                                    const std::vector<int64_t>& rn,
                                    const std::vector<int64_t>& rm, int64_t E_local,
                                    EpSaved& saved) {
  const int W = call.W;
  const int64_t H = meta_header_words(C);
  const int64_t CW = static_cast<int64_t>(C) * W;
  int64_t* rtok_off = host_array<int64_t>(saved.recv_tok_off, CW + 1);    // (CW+1,)
  int64_t* rpair_off = host_array<int64_t>(saved.recv_pair_off, CW + 1);  // (CW+1,)
  // Per source s and chunk c: where its sub-block starts, and its token and pair counts.
  const int32_t* words = recv_meta.as<int32_t>();
  std::vector<std::vector<const int32_t*>> blocks(static_cast<size_t>(C),
                                                  std::vector<const int32_t*>(W));
  std::vector<std::vector<int64_t>> crn(static_cast<size_t>(C), std::vector<int64_t>(W)),
      crm(static_cast<size_t>(C), std::vector<int64_t>(W));
  for (int s = 0; s < W; ++s) {
    const int32_t* b = words + ro[s] / 4;
    const int32_t* p = b + H;
    int64_t tn = 0, tp = 0;
    for (int c = 0; c < C; ++c) {
      crn[c][s] = H > 0 ? b[2 * c] : rn[s];
      crm[c][s] = H > 0 ? b[2 * c + 1] : rm[s];
      blocks[c][s] = p;
      p += crn[c][s] + 2 * crm[c][s];
      tn += crn[c][s];
      tp += crm[c][s];
    }
    // The header must add up to the agreed totals, else the blocks above are misread.
    if (tn != rn[s] || tp != rm[s])
      throw Error(detail::concat("ep_forward: rank ", s, "'s per-chunk counts (", tn,
                                 " tokens, ", tp, " pairs) differ from its totals (", rn[s],
                                 ", ", rm[s], ")"));
  }
  rtok_off[0] = rpair_off[0] = 0;
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < W; ++s) {
      const int64_t k = static_cast<int64_t>(c) * W + s;
      rtok_off[k + 1] = rtok_off[k] + crn[c][s];
      rpair_off[k + 1] = rpair_off[k] + crm[c][s];
    }
  std::vector<Routing> local(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) build_local_routing(blocks[c], crn[c], crm[c], E_local, local[c]);
  return local;
}

// 3c. Every chunk's local plan, on the data's device.
void build_local_plans(const EpCall& call, const std::vector<Routing>& local, EpSaved& saved) {
  const int C = static_cast<int>(local.size());
  const Device dev = call.dev;
  if (dev == Device::cpu) {
    for (int c = 0; c < C; ++c)
      build_routing_plan(local[c].view(), PlanBuilder::atomic_free, saved.chunks_[c].plan);
    return;
  }
  // The plans are built where the layer runs: each routing's three arrays go to the device
  // (R_c + 1 + 2 P_c words) and the GPU builder makes the same bits as the CPU one (tested)
  // in a fraction of the host time, instead of a host build and six plan arrays copied
  // over. All of them before the pipeline starts: a build may wait for the device.
  std::vector<Routing> dev_local;
  for (int c = 0; c < C; ++c) {
    const Routing& l = local[c];
    dev_local.emplace_back(dev, l.T(), l.E(), l.P());
    ep::copy_to_device(dev, dev_local[c].pair_offsets(), l.pair_offsets(),
                       4 * static_cast<size_t>(l.T() + 1), call.stream);
    ep::copy_to_device(dev, dev_local[c].pair_experts(), l.pair_experts(),
                       4 * static_cast<size_t>(l.P()), call.stream);
    ep::copy_to_device(dev, dev_local[c].pair_weights(), l.pair_weights(),
                       4 * static_cast<size_t>(l.P()), call.stream);
  }
  ep::synchronize(dev, call.stream);  // the builder runs on the default stream
  for (int c = 0; c < C; ++c)
    build_routing_plan(dev_local[c].view(), PlanBuilder::atomic_free, saved.chunks_[c].plan);
}

// 3d. Each chunk's local layer: its received tokens over this rank's experts.
void set_local_configs(const LayerConfig& cfg, int W, int64_t E_local, EpSaved& saved) {
  const int64_t* rtok_off = saved.recv_tok_off.as<int64_t>();
  for (int c = 0; c < saved.chunks(); ++c) {
    LayerConfig& lc = saved.chunks_[c].local_cfg;
    lc = cfg;
    lc.T = rtok_off[static_cast<int64_t>(c + 1) * W] - rtok_off[static_cast<int64_t>(c) * W];
    lc.E = E_local;
    lc.K = std::min<int64_t>(cfg.K, E_local);  // K only bounds the layer's checks
  }
}

// 4-6 with one chunk: one exchange each way, every step blocking.
void forward_one_exchange(EpCall& call, const LayerConfig& cfg, const RowLists& rows,
                          const TensorView& x, const TensorView& w1, const TensorView& w2,
                          const TensorView& out, EpSaved& saved, const EpOptions& opts) {
  const Device dev = call.dev;
  void* stream = call.stream;
  const size_t row_bytes = rows.row_bytes;
  EpChunkSaved& ch = saved.chunks_[0];
  const int64_t R = ch.local_cfg.T;
  ChunkBytes b;
  b.tokens_of(saved, 0, row_bytes);

  // 4. token rows to their experts' ranks
  ch.x_recv = Buffer(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) cfg.dtype
  {
    Buffer send_rows(dev, static_cast<size_t>(rows.N) * row_bytes);  // (N, d) cfg.dtype
    ep::gather_rows(dev, x.data, rows.send_tokens, rows.N, row_bytes, send_rows.data(), stream);
    ep::synchronize(dev, stream);
    ScopedTime st(&call.tm.exchange_s);
    b.out(call.tr, send_rows.data(), ch.x_recv.data());
  }

  // 5. the local layer
  Buffer out_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) partial per (token, q)
  run_agreed(call.tr, "ep_forward (local layer)", &call.tm.exchange_s, [&] {
    ScopedTime st(&call.tm.layer_s);
    layer_forward(ch.local_cfg, ch.plan, ch.x_recv.view(cfg.dtype, {R, cfg.d}), w1, w2,
                  out_recv.view(cfg.dtype, {R, cfg.d}), ch.layer, opts.layer);
    ep::synchronize(dev, stream);
  });

  // 6. partials back, combined in rank order
  Buffer ret(dev, static_cast<size_t>(rows.N) * row_bytes);  // (N, d) cfg.dtype, as send_tokens
  {
    ScopedTime st(&call.tm.exchange_s);
    b.back(call.tr, out_recv.data(), ret.data());
  }
  ep::combine_rows(dev, ret.data(), rows.comb_off, rows.comb_rows, cfg.T, cfg.d, cfg.dtype,
                   out.data, stream);
  ep::synchronize(dev, stream);
}

// 4-6 as a pipeline over the chunks (run_chunk_pipeline): token rows out, the local layer,
// partials back; the combine once over every chunk's returned rows.
void forward_chunk_pipeline(EpCall& call, const LayerConfig& cfg, const RowLists& rows,
                            const TensorView& x, const TensorView& w1, const TensorView& w2,
                            const TensorView& out, EpSaved& saved, const EpOptions& opts) {
  const Device dev = call.dev;
  void* stream = call.stream;
  const int C = saved.chunks();
  const size_t row_bytes = rows.row_bytes;
  const int64_t N = rows.N;
  Buffer send_rows(dev, static_cast<size_t>(N) * row_bytes, stream);  // (N, d) as send_tokens
  Buffer ret(dev, static_cast<size_t>(N) * row_bytes, stream);  // (N, d) partials, as send_rows
  std::vector<Buffer> out_recv(static_cast<size_t>(C));  // (R_c, d) chunk c's partials
  for (int c = 0; c < C; ++c) {
    EpChunkSaved& ch = saved.chunks_[c];
    ch.x_recv = Buffer(dev, static_cast<size_t>(ch.local_cfg.T) * row_bytes, stream);  // (R_c, d)
    out_recv[c] = Buffer(dev, static_cast<size_t>(ch.local_cfg.T) * row_bytes, stream);
  }
  ep::gather_rows(dev, x.data, rows.send_tokens, N, row_bytes, send_rows.data(), stream);
  ChunkBytes b;
  const std::exception_ptr layer_err = run_chunk_pipeline(
      call.tr, dev, stream, C, call.tm,
      [&](int c) {
        b.tokens_of(saved, c, row_bytes);
        return b.start_out(call.tr, send_rows.data(), saved.chunks_[c].x_recv.data(), stream);
      },
      [&](int c) {
        EpChunkSaved& ch = saved.chunks_[c];
        const int64_t R = ch.local_cfg.T;
        layer_forward(ch.local_cfg, ch.plan, ch.x_recv.view(cfg.dtype, {R, cfg.d}), w1, w2,
                      out_recv[c].view(cfg.dtype, {R, cfg.d}), ch.layer, opts.layer);
      },
      [&](int c, std::vector<uint64_t>& tickets) {
        b.tokens_of(saved, c, row_bytes);
        tickets.push_back(b.start_back(call.tr, out_recv[c].data(), ret.data(), stream));
      });
  {
    ScopedTime st(&call.tm.exchange_s);
    agree(call.tr, layer_err, {}, "ep_forward (local layer)");
  }
  ep::combine_rows(dev, ret.data(), rows.comb_off, rows.comb_rows, cfg.T, cfg.d, cfg.dtype,
                   out.data, stream);
  ep::synchronize(dev, stream);
}

// ---------------------------------------------------------------------------------------------
// ep_backward's steps

// 1. Local checks, against the call and against what ep_forward saved.
std::exception_ptr check_backward(const EpCall& call, const LayerConfig& cfg,
                                  const TensorView& w1, const TensorView& w2,
                                  const TensorView& d_out, const EpSaved& saved,
                                  const EpGrads& grads, const EpOptions& opts, EpShard& shard) {
  const int W = call.W, q = call.q;
  const Device dev = call.dev;
  try {
    cfg.validate();
    check_layer_options(opts.layer);
    check_chunks(opts.chunks);
    shard = ep_shard(cfg.E, W, q);
    MOEBLAZE_REQUIRE(saved.valid(), "saved is not valid: run ep_forward first");
    MOEBLAZE_REQUIRE(saved.rank_ == q && saved.world_ == W, "saved comes from rank ", saved.rank_,
                     " of ", saved.world_, ", but the transport is rank ", q, " of ", W);
    MOEBLAZE_REQUIRE(saved.device_ == dev, "saved is on ", device_name(saved.device_),
                     ", but the transport moves ", device_name(dev), " memory");
    MOEBLAZE_REQUIRE(opts.chunks == saved.chunks(), "EpOptions::chunks (", opts.chunks,
                     ") differs from the chunks ep_forward ran with (", saved.chunks(),
                     "): backward runs forward's exchanges in reverse");
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
    return std::current_exception();
  }
  return nullptr;
}

// Received pairs of chunk c: the local layer's d_pair_weights has this many entries.
int64_t recv_pairs(const EpSaved& saved, int c) {
  const int64_t* rpair_off = saved.recv_pair_off.as<int64_t>();  // (CW+1,)
  const int64_t W = saved.world_;
  return rpair_off[(c + 1) * W] - rpair_off[c * W];
}

// The end of backward: dx partials combined in rank order; pair gradients scattered to their
// pairs. ret (N, d) and dpw_ret (M,) are laid out as send_tokens and send_pairs (chunk-major).
void combine_and_scatter(const EpCall& call, const LayerConfig& cfg, const RowLists& rows,
                         const EpSaved& saved, const EpGrads& grads, const Buffer& ret,
                         const Buffer& dpw_ret) {
  const Device dev = call.dev;
  void* stream = call.stream;
  const int64_t M = saved.send_pair_off.as<int64_t>()[static_cast<int64_t>(saved.chunks()) *
                                                     call.W];
  ep::combine_rows(dev, ret.data(), rows.comb_off, rows.comb_rows, cfg.T, cfg.d, cfg.dtype,
                   grads.dx.data, stream);
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

// Steps 2-4 with one chunk: one exchange each way, every step blocking.
void backward_one_exchange(EpCall& call, const LayerConfig& cfg, const RowLists& rows,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const EpSaved& saved, const EpGrads& grads, const EpOptions& opts) {
  const Device dev = call.dev;
  void* stream = call.stream;
  const size_t row_bytes = rows.row_bytes;
  const int64_t N = rows.N;
  const int64_t M = saved.send_pair_off.as<int64_t>()[call.W];
  const EpChunkSaved& ch = saved.chunks_[0];
  const int64_t R = ch.local_cfg.T, Pr = recv_pairs(saved, 0);
  ChunkBytes b;
  b.tokens_of(saved, 0, row_bytes);

  // 2. d_out rows to the ranks the tokens used
  Buffer dout_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) as x_recv
  {
    Buffer send_rows(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) as send_tokens
    ep::gather_rows(dev, d_out.data, rows.send_tokens, N, row_bytes, send_rows.data(), stream);
    ep::synchronize(dev, stream);
    ScopedTime st(&call.tm.exchange_s);
    b.out(call.tr, send_rows.data(), dout_recv.data());
  }

  // 3. local layer: dx partials, complete dw1/dw2 of the local experts, d pair weights
  Buffer dx_recv(dev, static_cast<size_t>(R) * row_bytes);  // (R, d) partial per (token, q)
  Buffer dpw_recv(dev, sizeof(float) * static_cast<size_t>(Pr));  // (P_recv,) local pair order
  run_agreed(call.tr, "ep_backward (local layer)", &call.tm.exchange_s, [&] {
    ScopedTime st(&call.tm.layer_s);
    LayerGrads g;
    g.dx = dx_recv.view(cfg.dtype, {R, cfg.d});
    g.dw1 = grads.dw1;
    g.dw2 = grads.dw2;
    g.d_pair_weights = dpw_recv.view(DType::f32, {Pr});
    layer_backward(ch.local_cfg, ch.plan, ch.x_recv.view(cfg.dtype, {R, cfg.d}), w1, w2,
                   dout_recv.view(cfg.dtype, {R, cfg.d}), ch.layer, g, opts.layer);
    ep::synchronize(dev, stream);
  });

  // 4. dx partials back, combined in rank order; pair gradients back to their pairs
  Buffer ret(dev, static_cast<size_t>(N) * row_bytes);  // (N, d) as send_tokens
  ChunkBytes pb;
  pb.pairs_of(saved, 0);
  Buffer dpw_ret(dev, sizeof(float) * static_cast<size_t>(M));  // (M,) as send_pairs
  {
    ScopedTime st(&call.tm.exchange_s);
    b.back(call.tr, dx_recv.data(), ret.data());
    pb.back(call.tr, dpw_recv.data(), dpw_ret.data());
  }
  combine_and_scatter(call, cfg, rows, saved, grads, ret, dpw_ret);
}

// dw1/dw2 over chunks: chunk c's layer_backward gives the gradient over chunk c's tokens only;
// the chunks are summed in chunk order in fp32 and stored once in the dtype (fp32: chunk 0 writes
// dw directly and the later chunks are added to it in place, the same sums; bf16: an fp32
// accumulator). Deterministic, no atomics; not the single-device summation order.
class ChunkWeightGrads {
 public:
  ChunkWeightGrads(const EpCall& call, const LayerConfig& cfg, int64_t E_local,
                   const EpGrads& grads)
      : dev_(call.dev),
        stream_(call.stream),
        cfg_(cfg),
        E_local_(E_local),
        grads_(grads),
        f32_(cfg.dtype == DType::f32),
        n1_(E_local * cfg.w1_rows() * cfg.d),
        n2_(E_local * cfg.d * cfg.n) {
    const size_t es = dtype_size(cfg.dtype);
    dw1_c_ = Buffer(dev_, es * static_cast<size_t>(n1_), stream_);  // (E_local, w1_rows, d)
    dw2_c_ = Buffer(dev_, es * static_cast<size_t>(n2_), stream_);  // (E_local, d, n)
    if (!f32_) {  // (n1,), (n2,) fp32 sums of the chunks so far
      acc1_ = Buffer(dev_, sizeof(float) * static_cast<size_t>(n1_), stream_);
      acc2_ = Buffer(dev_, sizeof(float) * static_cast<size_t>(n2_), stream_);
    }
    a1_ = f32_ ? grads.dw1.as<float>() : acc1_.as<float>();
    a2_ = f32_ ? grads.dw2.as<float>() : acc2_.as<float>();
  }

  // Where chunk c's layer_backward writes its weight gradients. fp32: chunk 0's are the sum's
  // first term, written in place.
  bool direct(int c) const { return f32_ && c == 0; }
  TensorView dw1(int c) {
    return direct(c) ? grads_.dw1 : dw1_c_.view(cfg_.dtype, {E_local_, cfg_.w1_rows(), cfg_.d});
  }
  TensorView dw2(int c) {
    return direct(c) ? grads_.dw2 : dw2_c_.view(cfg_.dtype, {E_local_, cfg_.d, cfg_.n});
  }
  // Adds chunk c's, on the layer's stream, so the next chunk's layer_backward finds dw*_c free
  // again.
  void add(int c) {
    if (direct(c)) return;
    ep::accumulate_f32(dev_, dw1_c_.data(), cfg_.dtype, a1_, n1_, c == 0, stream_);
    ep::accumulate_f32(dev_, dw2_c_.data(), cfg_.dtype, a2_, n2_, c == 0, stream_);
  }
  // After every chunk was added: the one rounding to bf16.
  void store() {
    if (f32_) return;
    ep::store_from_f32(dev_, a1_, cfg_.dtype, grads_.dw1.data, n1_, stream_);
    ep::store_from_f32(dev_, a2_, cfg_.dtype, grads_.dw2.data, n2_, stream_);
  }

 private:
  Device dev_;
  void* stream_;
  const LayerConfig& cfg_;
  int64_t E_local_;
  const EpGrads& grads_;
  bool f32_;
  int64_t n1_, n2_;
  Buffer dw1_c_, dw2_c_, acc1_, acc2_;
  float* a1_;
  float* a2_;
};

// Steps 2-4 as the chunk pipeline (run_chunk_pipeline): d_out rows out, layer_backward, dx
// partials and pair gradients back; combine and scatter once at the end.
void backward_chunk_pipeline(EpCall& call, const LayerConfig& cfg, const RowLists& rows,
                             int64_t E_local, const TensorView& w1, const TensorView& w2,
                             const TensorView& d_out, const EpSaved& saved, const EpGrads& grads,
                             const EpOptions& opts) {
  const Device dev = call.dev;
  void* stream = call.stream;
  const int C = saved.chunks();
  const size_t row_bytes = rows.row_bytes;
  const int64_t N = rows.N;
  const int64_t M = saved.send_pair_off.as<int64_t>()[static_cast<int64_t>(C) * call.W];
  Buffer send_rows(dev, static_cast<size_t>(N) * row_bytes, stream);  // (N, d) as send_tokens
  Buffer ret(dev, static_cast<size_t>(N) * row_bytes, stream);   // (N, d) dx partials, alike
  Buffer dpw_ret(dev, sizeof(float) * static_cast<size_t>(M), stream);  // (M,) as send_pairs
  ChunkWeightGrads dw(call, cfg, E_local, grads);
  // Per chunk: (R_c, d) d_out rows received, (R_c, d) dx partials, (P_c,) pair gradients.
  std::vector<Buffer> dout_recv(static_cast<size_t>(C)), dx_recv(static_cast<size_t>(C)),
      dpw_recv(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    const size_t R = static_cast<size_t>(saved.chunks_[c].local_cfg.T);
    dout_recv[c] = Buffer(dev, R * row_bytes, stream);
    dx_recv[c] = Buffer(dev, R * row_bytes, stream);
    dpw_recv[c] = Buffer(dev, sizeof(float) * static_cast<size_t>(recv_pairs(saved, c)), stream);
  }
  ep::gather_rows(dev, d_out.data, rows.send_tokens, N, row_bytes, send_rows.data(), stream);
  ChunkBytes b, pb;  // chunk c's rows, as in forward; chunk c's pair gradients
  const std::exception_ptr layer_err = run_chunk_pipeline(
      call.tr, dev, stream, C, call.tm,
      [&](int c) {
        b.tokens_of(saved, c, row_bytes);
        return b.start_out(call.tr, send_rows.data(), dout_recv[c].data(), stream);
      },
      [&](int c) {
        const EpChunkSaved& ch = saved.chunks_[c];
        const int64_t R = ch.local_cfg.T;
        LayerGrads g;
        g.dx = dx_recv[c].view(cfg.dtype, {R, cfg.d});
        g.dw1 = dw.dw1(c);
        g.dw2 = dw.dw2(c);
        g.d_pair_weights = dpw_recv[c].view(DType::f32, {recv_pairs(saved, c)});
        layer_backward(ch.local_cfg, ch.plan, ch.x_recv.view(cfg.dtype, {R, cfg.d}), w1, w2,
                       dout_recv[c].view(cfg.dtype, {R, cfg.d}), ch.layer, g, opts.layer);
        dw.add(c);
      },
      [&](int c, std::vector<uint64_t>& tickets) {
        b.tokens_of(saved, c, row_bytes);
        pb.pairs_of(saved, c);
        tickets.push_back(b.start_back(call.tr, dx_recv[c].data(), ret.data(), stream));
        tickets.push_back(pb.start_back(call.tr, dpw_recv[c].data(), dpw_ret.data(), stream));
      });
  {
    ScopedTime st(&call.tm.exchange_s);
    agree(call.tr, layer_err, {}, "ep_backward (local layer)");
  }
  dw.store();
  combine_and_scatter(call, cfg, rows, saved, grads, ret, dpw_ret);
}

void finish_call(EpCall& call, Clock::time_point t_start, const EpOptions& opts) {
  call.tm.total_s = seconds_since(t_start);
  if (opts.timings) *opts.timings = call.tm;
}

}  // namespace

void ep_forward(Transport& tr, const LayerConfig& cfg, const RoutingView& routing,
                const TensorView& x, const TensorView& w1, const TensorView& w2,
                const TensorView& out, EpSaved& saved, const EpOptions& opts) {
  const Clock::time_point t_start = Clock::now();
  EpCall call = start_call(tr, opts);
  const int C = opts.chunks;

  // 1. local checks and dispatch lists; 2. agreement
  Dispatch D;
  EpShard shard;
  const std::exception_ptr err = check_forward(call, cfg, routing, x, w1, w2, out, opts, shard, D);
  std::vector<int64_t> rn, rm;  // (W,) tokens and pairs this rank receives from each source
  agree_forward(call, cfg, C, D, err, rn, rm);

  // Every rank goes on from here.
  start_saved(call, cfg, routing.P, opts.layer.mode, C, D, saved);
  const int64_t N = saved.send_tok_off.as<int64_t>()[static_cast<int64_t>(C) * call.W];
  build_combine_lists(cfg.T, N, saved);
  ThreadCountScope threads(opts.layer.num_threads);

  // 3. metadata (all chunks in one exchange) → local routings → local plans
  {
    std::vector<int64_t> ro;
    const Buffer recv_meta = exchange_metadata(call, D, C, rn, rm, ro);
    const std::vector<Routing> local =
        local_routings(call, recv_meta, ro, C, rn, rm, shard.count, saved);
    build_local_plans(call, local, saved);
  }
  set_local_configs(cfg, call.W, shard.count, saved);

  // 4. token rows to their experts' ranks; 5. the local layer; 6. partials back, combined
  const RowLists rows{on_device(call.dev, saved.send_tokens, saved.d_send_tokens, call.stream),
                      on_device(call.dev, saved.comb_off, saved.d_comb_off, call.stream),
                      on_device(call.dev, saved.comb_rows, saved.d_comb_rows, call.stream), N,
                      static_cast<size_t>(cfg.d) * dtype_size(cfg.dtype)};
  if (C == 1)
    forward_one_exchange(call, cfg, rows, x, w1, w2, out, saved, opts);
  else
    forward_chunk_pipeline(call, cfg, rows, x, w1, w2, out, saved, opts);
  saved.valid_ = true;
  finish_call(call, t_start, opts);
}

void ep_backward(Transport& tr, const LayerConfig& cfg, const TensorView& w1,
                 const TensorView& w2, const TensorView& d_out, const EpSaved& saved,
                 const EpGrads& grads, const EpOptions& opts) {
  const Clock::time_point t_start = Clock::now();
  EpCall call = start_call(tr, opts);

  // 1. local checks and agreement
  EpShard shard;
  const std::exception_ptr err =
      check_backward(call, cfg, w1, w2, d_out, saved, grads, opts, shard);
  {
    ScopedTime st(&call.tm.exchange_s);
    agree(tr, err, {}, "ep_backward");
  }
  ThreadCountScope threads(opts.layer.num_threads);

  // 2. d_out rows to the ranks the tokens used; 3. the local layer_backward; 4. dx partials and
  // pair gradients back, combined in rank order and scattered to their pairs
  const bool on_cpu = call.dev == Device::cpu;
  const RowLists rows{
      on_cpu ? saved.send_tokens.as<int32_t>() : saved.d_send_tokens.as<int32_t>(),
      on_cpu ? saved.comb_off.as<int32_t>() : saved.d_comb_off.as<int32_t>(),
      on_cpu ? saved.comb_rows.as<int32_t>() : saved.d_comb_rows.as<int32_t>(),
      saved.send_tok_off.as<int64_t>()[static_cast<int64_t>(saved.chunks()) * call.W],
      static_cast<size_t>(cfg.d) * dtype_size(cfg.dtype)};
  if (saved.chunks() == 1)
    backward_one_exchange(call, cfg, rows, w1, w2, d_out, saved, grads, opts);
  else
    backward_chunk_pipeline(call, cfg, rows, shard.count, w1, w2, d_out, saved, grads, opts);
  finish_call(call, t_start, opts);
}

}  // namespace moeblaze
