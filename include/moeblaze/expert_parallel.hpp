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
// all_to_all_v, ncclAllGather for all_gather; each call synchronises `cuda_stream` before
// returning. The caller keeps the communicator alive and sets the rank's device on the calling
// thread. Throws Unsupported when moeblaze was built without NCCL (nccl_available()).
std::unique_ptr<Transport> make_nccl_transport(void* nccl_comm, void* cuda_stream);
bool nccl_available();

// The experts rank `rank` holds: [first, first + count). Requires E % world_size == 0.
struct EpShard {
  int64_t first = 0;
  int64_t count = 0;
};
EpShard ep_shard(int64_t num_experts, int world_size, int rank);

// Host-side wall time of the last call, split into data exchange and local layer (optional).
struct EpTimings {
  double exchange_s = 0;  // count agreement, metadata and row exchanges (blocking)
  double layer_s = 0;     // local layer_forward / layer_backward
  double total_s = 0;     // the whole call
};

struct EpOptions {
  LayerOptions layer;           // the local layer's mode, CPU threads and CUDA stream
  EpTimings* timings = nullptr;  // filled when non-null
};

// What ep_forward keeps for ep_backward on this rank: the received tokens (backward's x), the
// local plan over them, the local layer's saved state and the exchange plan (who was sent what).
// Internal state is public so the translation units of src/ep can fill it; do not edit it.
class EpSaved {
 public:
  EpSaved() = default;
  EpSaved(EpSaved&&) = default;
  EpSaved& operator=(EpSaved&&) = default;

  bool valid() const { return valid_; }
  int64_t received_tokens() const { return local_cfg_.T; }  // R: rows of x_recv
  int64_t received_pairs() const { return plan_.S(); }
  int64_t sent_tokens() const;  // rows sent: sum over destinations of the deduplicated tokens
  // Bytes owned (x_recv, the local plan, the local layer's saved tensors, the index arrays).
  size_t bytes() const;

  bool valid_ = false;
  int rank_ = 0, world_ = 0;
  Device device_ = Device::cpu;
  LayerMode mode_ = LayerMode::keep_h;
  LayerConfig cfg_;        // as given to ep_forward (T = this rank's tokens, E global)
  LayerConfig local_cfg_;  // T = R received tokens, E = E_local
  int64_t P_ = 0;          // this rank's pairs
  RoutingPlan plan_;       // local plan over the R received tokens, on device_
  SavedForBackward layer_;
  Buffer x_recv;  // (R, d) cfg.dtype on device_, grouped by source rank, ascending token inside

  // Host index arrays (Device::cpu Buffers), int64 offsets / int32 indices.
  Buffer send_tok_off;   // (W+1,) int64: tokens for rank r are send_tokens[off[r], off[r+1])
  Buffer send_tokens;    // (N,) int32 local token ids, grouped by rank, ascending, deduplicated
  Buffer send_pair_off;  // (W+1,) int64
  Buffer send_pairs;     // (M,) int32 local pair ids, grouped by rank, token-major inside
  Buffer recv_tok_off;   // (W+1,) int64: rows of x_recv from rank s
  Buffer recv_pair_off;  // (W+1,) int64: pairs of the local routing from rank s
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
