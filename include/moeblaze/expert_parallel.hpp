// Expert parallelism: the E experts are split across world_size ranks (one process or thread per
// device), each rank holding a contiguous block of E / world_size experts and its own tokens.
// Tokens travel to the ranks of the experts they chose and their partial outputs travel back;
// the local layer (layer.hpp) runs unchanged on what a rank received. docs/EXPERT_PARALLEL.md
// has the algorithm, the message layout and the numerics.
//
// Per rank r (cfg.T = T_r, this rank's tokens; cfg.E = the global number of experts):
//   routing        T_r tokens, pairs with GLOBAL expert ids in [0, E), on the host
//   x, out, d_out  (T_r, d)                  cfg.dtype, on the transport's device
//   w1             (E_local, w1_rows, d)     experts [r*E_local, (r+1)*E_local) only
//   w2             (E_local, d, n)
//   dx             (T_r, d);  dw1, dw2 like w1, w2 (complete: every token that used a local
//                  expert arrived here);  d_pair_weights (P_r,) fp32 in this rank's pair order
//
// Every call is collective: all ranks of the transport call it together. Arguments are checked
// on every rank and the verdicts are exchanged before any data moves, so a bad argument on one
// rank raises InvalidArgument on all of them (the faulty rank with the rule it broke, the others
// naming that rank) and no rank blocks in a collective; outputs are untouched then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moeblaze/config.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/memory.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze {

// How ranks exchange bytes. Calls are collective and blocking: on return the received data is in
// place and the send buffers may be reused. Counts and offsets are host arrays of world_size()
// entries, in bytes.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Where all_to_all_v's buffers live: host memory (cpu) or the rank's GPU (cuda).
  virtual Device device() const = 0;

  // Rank q sends send[send_offsets[r], + send_counts[r]) to every rank r (itself included) and
  // receives rank s's block at recv[recv_offsets[s], + recv_counts[s]). recv_counts[s] on rank q
  // must equal send_counts[q] on rank s.
  virtual void all_to_all_v(const void* send, const int64_t* send_counts,
                            const int64_t* send_offsets, void* recv, const int64_t* recv_counts,
                            const int64_t* recv_offsets) = 0;

  // Every rank contributes `count` int64 values (host memory, the same count on every rank);
  // recv (world_size * count,) host receives rank s's values at [s * count, (s + 1) * count).
  virtual void all_gather(const int64_t* send, int64_t count, int64_t* recv) = 0;

  // ---- stream-ordered exchanges (optional) ----
  // What lets expert parallelism overlap an exchange with the local layer: the exchange is
  // queued on a stream of the transport's own and the host goes on. A transport that can do this
  // returns true from stream_ordered(); then
  //   all_to_all_v_start(..., producer) returns at once; the exchange runs after the work queued
  //     on `producer` (the caller's cudaStream_t) so far, e.g. the kernel that filled `send`;
  //   all_to_all_v_wait(ticket, consumer) makes the work queued on `consumer` afterwards wait
  //     until that exchange completed (received data in place, send buffer free); the host does
  //     not wait. Every ticket is waited for exactly once.
  //   synchronize_exchanges() blocks the host until every started exchange has completed (and
  //     forgets tickets not waited for, e.g. after an error).
  // Counts and offsets are read before start returns. `send` and `recv` must stay alive and
  // untouched until the exchange completed: after the consumer's wait has passed on the device,
  // or synchronize_exchanges() returned.
  // The defaults (stream_ordered() false) are the blocking all_to_all_v: start moves the data
  // before it returns (so the caller must have finished producing `send` on the host's side,
  // e.g. synchronised its stream), wait and synchronize_exchanges do nothing. Exchanges started
  // and blocking calls are issued in the same order on every rank.
  virtual bool stream_ordered() const { return false; }
  virtual uint64_t all_to_all_v_start(const void* send, const int64_t* send_counts,
                                      const int64_t* send_offsets, void* recv,
                                      const int64_t* recv_counts, const int64_t* recv_offsets,
                                      void* producer_stream) {
    (void)producer_stream;
    all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets);
    return 0;
  }
  virtual void all_to_all_v_wait(uint64_t ticket, void* consumer_stream) {
    (void)ticket;
    (void)consumer_stream;
  }
  virtual void synchronize_exchanges() {}
};

// Thrown by a collective call on the ranks whose own arguments were valid when another rank's
// were not (that rank throws the InvalidArgument naming the broken rule). The message names the
// failed ranks.
class RemoteRankError : public InvalidArgument {
 public:
  explicit RemoteRankError(const std::string& what) : InvalidArgument(what) {}
};

// world_size simulated ranks in one process, sharing host memory (Device::cpu). transports[r] is
// rank r; each must be driven by its own thread. Each collective is two barriers around plain
// copies (every rank writes only its own receive buffer), so results are deterministic.
std::vector<std::unique_ptr<Transport>> make_in_process_transports(int world_size);

// Runs fn(transport) on world_size threads, one per simulated rank, and joins them. If any rank
// throws, the group is aborted (ranks blocked in or later entering a collective throw Error
// instead of waiting forever) and one exception is rethrown here: that of the lowest rank that
// failed for its own reason (not a RemoteRankError, not the abort), else the lowest rank's.
void run_in_process(int world_size, const std::function<void(Transport&)>& fn);

// NCCL transport over a communicator and a CUDA stream (ncclComm_t and cudaStream_t, passed as
// void* so this header needs neither nccl.h nor cuda_runtime.h). Grouped ncclSend/ncclRecv for
// all_to_all_v, ncclAllGather for all_gather; each blocking call synchronises `cuda_stream`
// before returning. It is stream_ordered(): the started exchanges run on a communication stream
// the transport creates on the current device, ordered by CUDA events. The caller keeps the
// communicator alive and sets the rank's device on the calling thread (also when destroying the
// transport). Throws Unsupported when moeblaze was built without NCCL (nccl_available()).
std::unique_ptr<Transport> make_nccl_transport(void* nccl_comm, void* cuda_stream);
bool nccl_available();

// The experts rank `rank` holds: [first, first + count). Requires E % world_size == 0.
struct EpShard {
  int64_t first = 0;
  int64_t count = 0;
};
EpShard ep_shard(int64_t num_experts, int world_size, int rank);

// Host-side wall time of the last call, split into data exchange and local layer (optional).
// With chunks > 1 over a stream_ordered() transport the row exchanges and the local layers are
// queued without waiting and overlap on the device; the host cannot split that time, so it is
// pipeline_s (docs/EXPERT_PARALLEL.md, "Timings").
struct EpTimings {
  double exchange_s = 0;  // host time inside exchange calls: agreement, metadata, and the row
                          // exchanges as far as they block the host (all of them with chunks = 1
                          // or a blocking transport; only the queueing with a stream-ordered one)
  double layer_s = 0;     // host time inside layer_forward / layer_backward (with chunks > 1 on
                          // a GPU: queueing and whatever the layer synchronises itself)
  double pipeline_s = 0;  // chunks > 1: host time waiting at the end for the queued, overlapped
                          // device work (layers, row exchanges, accumulation); 0 with chunks = 1
  double total_s = 0;     // the whole call
};

struct EpOptions {
  LayerOptions layer;           // the local layer's mode, CPU threads and CUDA stream
  EpTimings* timings = nullptr;  // filled when non-null
  // Pipeline depth: this rank's tokens are cut into `chunks` fixed contiguous ranges of token
  // ids ([c*T/C, (c+1)*T/C), some empty when T < C), each an exchange of its own with its own
  // local layer call, so that one chunk's exchanges overlap another's local layer. 1 = one
  // exchange for all tokens. In [1, kEpMaxChunks]; all ranks must pass the same value, and
  // ep_backward the value ep_forward ran with.
  int chunks = 1;
};
constexpr int kEpMaxChunks = 4096;

// One chunk's exchange as the destination rank sees it (EpOptions::chunks): what it received
// and what its local layer kept.
struct EpChunkSaved {
  LayerConfig local_cfg;  // T = R_c tokens received for this chunk, E = E_local
  RoutingPlan plan;       // local plan over the R_c received tokens, on the data's device
  SavedForBackward layer;
  Buffer x_recv;  // (R_c, d) cfg.dtype, grouped by source rank, ascending token inside
};

// What ep_forward keeps for ep_backward on this rank: per chunk the received tokens (backward's
// x), the local plan over them and the local layer's saved state; and the exchange plan (who was
// sent what). Internal state is public so the translation units of src/ep can fill it; do not
// edit it. With C chunks the index arrays are chunk-major: entry (c, r) of an offset array is
// at c*W + r, and send_tokens / send_pairs / the returned rows are grouped by chunk, then by
// rank (C = 1: exactly the layout of one exchange).
class EpSaved {
 public:
  EpSaved() = default;
  EpSaved(EpSaved&&) = default;
  EpSaved& operator=(EpSaved&&) = default;

  bool valid() const { return valid_; }
  int chunks() const { return static_cast<int>(chunks_.size()); }
  int64_t received_tokens() const;  // R: rows received, all chunks
  int64_t received_pairs() const;   // pairs of the local routings, all chunks
  int64_t sent_tokens() const;  // rows sent: sum over chunks and destinations of the tokens
  // Bytes owned (x_recv, the local plans, the local layer's saved tensors, the index arrays).
  size_t bytes() const;

  bool valid_ = false;
  int rank_ = 0, world_ = 0;
  Device device_ = Device::cpu;
  LayerMode mode_ = LayerMode::keep_h;
  LayerConfig cfg_;  // as given to ep_forward (T = this rank's tokens, E global)
  int64_t P_ = 0;    // this rank's pairs
  std::vector<EpChunkSaved> chunks_;  // (C,) in chunk order

  // Host index arrays (Device::cpu Buffers), int64 offsets / int32 indices.
  Buffer send_tok_off;   // (C*W+1,) int64: tokens of chunk c for rank r are
                         // send_tokens[off[c*W+r], off[c*W+r+1])
  Buffer send_tokens;    // (N,) int32 local token ids, by chunk, then rank, ascending, deduplicated
  Buffer send_pair_off;  // (C*W+1,) int64
  Buffer send_pairs;     // (M,) int32 local pair ids, by chunk, then rank, token-major inside
  Buffer recv_tok_off;   // (C*W+1,) int64: rows of chunk c's x_recv from rank s are
                         // [off[c*W+s] - off[c*W], off[c*W+s+1] - off[c*W])
  Buffer recv_pair_off;  // (C*W+1,) int64: pairs of chunk c's local routing from rank s, alike
  Buffer comb_off;       // (T_r+1,) int32: returned rows of token t are comb_rows[off[t], off[t+1])
  Buffer comb_rows;      // (N,) int32 row of the returned (N, d) block, ascending rank order
  // Device copies of the arrays the row kernels read (Device::cuda only; empty on cpu).
  Buffer d_send_tokens, d_comb_off, d_comb_rows;
};

struct EpGrads {
  TensorView dx;              // (T_r, d)
  TensorView dw1;             // (E_local, w1_rows, d)
  TensorView dw2;             // (E_local, d, n)
  TensorView d_pair_weights;  // (P_r,) fp32, this rank's pair order
};

// Forward: out_t = sum over t's pairs of s_p W2_e act(W1_e x_t), the experts being wherever they
// live. Fills `saved` (replacing its contents).
void ep_forward(Transport& transport, const LayerConfig& cfg, const RoutingView& routing,
                const TensorView& x, const TensorView& w1, const TensorView& w2,
                const TensorView& out, EpSaved& saved, const EpOptions& opts = {});

// Backward from `saved` (ep_forward's, same transport, cfg and weights).
void ep_backward(Transport& transport, const LayerConfig& cfg, const TensorView& w1,
                 const TensorView& w2, const TensorView& d_out, const EpSaved& saved,
                 const EpGrads& grads, const EpOptions& opts = {});

}  // namespace moeblaze
