// NcclTransport: the expert-parallel Transport over an NCCL communicator, one rank per GPU.
// all_to_all_v is one NCCL group of ncclSend/ncclRecv per peer (the block to itself is a device
// copy); all_gather goes through a small device staging buffer. Every blocking call ends with a
// stream synchronisation: the Transport contract is blocking, which ep_forward/ep_backward rely
// on to read received counts on the host and to reuse send buffers.
//
// Stream-ordered exchanges (all_to_all_v_start / _wait, what EpOptions::chunks > 1 overlaps):
// the same NCCL group, queued on a communication stream of the transport's own, after an event
// recorded on the caller's producer stream; an event recorded after the group is the ticket, and
// _wait makes the consumer stream wait for it. Nothing blocks the host. One communicator must not
// have NCCL work running on two streams in different orders, so a blocking call first makes its
// stream wait for everything queued on the communication stream.
// NVLink SHARP / multicast is never requested here; launchers export NCCL_NVLS_ENABLE=0
// (scripts/ep_nccl_check.sh).
#ifdef MOEBLAZE_WITH_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <unordered_map>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/expert_parallel.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze {
namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  throw DeviceError(detail::concat(what, " failed: ", ncclGetErrorString(r)));
}
#define MOEBLAZE_NCCL_CHECK(call) nccl_check((call), #call)

class NcclTransport final : public Transport {
 public:
  NcclTransport(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    MOEBLAZE_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    MOEBLAZE_NCCL_CHECK(ncclCommCount(comm_, &world_));
    MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }
  ~NcclTransport() override {
    // No exchange may still use an event or the stream; errors cannot be reported from here.
    cudaStreamSynchronize(comm_stream_);
    for (auto& kv : pending_) cudaEventDestroy(kv.second);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    cudaStreamDestroy(comm_stream_);
  }
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return Device::cuda; }

  void all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
                    void* recv, const int64_t* recv_counts,
                    const int64_t* recv_offsets) override {
    after_comm_stream(stream_);
    enqueue(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, stream_);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void all_gather(const int64_t* send, int64_t count, int64_t* recv) override {
    if (count <= 0) return;
    after_comm_stream(stream_);
    const size_t bytes = sizeof(int64_t) * static_cast<size_t>(count);
    if (staging_.bytes() < bytes * static_cast<size_t>(world_))
      staging_ = Buffer(Device::cuda, bytes * static_cast<size_t>(world_));  // (W, count) int64
    int64_t* all = staging_.as<int64_t>();
    int64_t* mine = all + static_cast<int64_t>(rank_) * count;  // in place, as NCCL allows
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(mine, send, bytes, cudaMemcpyHostToDevice, stream_));
    MOEBLAZE_NCCL_CHECK(
        ncclAllGather(mine, all, static_cast<size_t>(count), ncclInt64, comm_, stream_));
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(recv, all, bytes * static_cast<size_t>(world_),
                                        cudaMemcpyDeviceToHost, stream_));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  bool stream_ordered() const override { return true; }

  uint64_t all_to_all_v_start(const void* send, const int64_t* send_counts,
                              const int64_t* send_offsets, void* recv, const int64_t* recv_counts,
                              const int64_t* recv_offsets, void* producer_stream) override {
    // The exchange reads `send` only after what is queued on the producer so far. The event can
    // be reused at once: a wait binds to the record that precedes it.
    cudaEvent_t ready = take_event();
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(ready, static_cast<cudaStream_t>(producer_stream)));
    MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready, 0));
    free_events_.push_back(ready);
    enqueue(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, comm_stream_);
    cudaEvent_t done = take_event();
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
    const uint64_t ticket = next_ticket_++;
    pending_.emplace(ticket, done);
    return ticket;
  }

  void all_to_all_v_wait(uint64_t ticket, void* consumer_stream) override {
    const auto it = pending_.find(ticket);
    MOEBLAZE_REQUIRE(it != pending_.end(), "all_to_all_v_wait: ticket ", ticket,
                     " was not started or was already waited for");
    MOEBLAZE_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer_stream), it->second, 0));
    free_events_.push_back(it->second);
    pending_.erase(it);
  }

  void synchronize_exchanges() override {
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(comm_stream_));
    for (auto& kv : pending_) free_events_.push_back(kv.second);  // complete: reusable
    pending_.clear();
  }

 private:
  // One exchange on `stream`: the self block as a device copy, the peers in one NCCL group.
  void enqueue(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
               void* recv, const int64_t* recv_counts, const int64_t* recv_offsets,
               cudaStream_t stream) {
    MOEBLAZE_REQUIRE(send_counts[rank_] == recv_counts[rank_], "all_to_all_v: rank ", rank_,
                     " sends ", send_counts[rank_], " bytes to itself but expects ",
                     recv_counts[rank_]);
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    if (send_counts[rank_] > 0)
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(r + recv_offsets[rank_], s + send_offsets[rank_],
                                          static_cast<size_t>(send_counts[rank_]),
                                          cudaMemcpyDeviceToDevice, stream));
    MOEBLAZE_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (send_counts[p] > 0)
        MOEBLAZE_NCCL_CHECK(ncclSend(s + send_offsets[p], static_cast<size_t>(send_counts[p]),
                                     ncclUint8, p, comm_, stream));
      if (recv_counts[p] > 0)
        MOEBLAZE_NCCL_CHECK(ncclRecv(r + recv_offsets[p], static_cast<size_t>(recv_counts[p]),
                                     ncclUint8, p, comm_, stream));
    }
    MOEBLAZE_NCCL_CHECK(ncclGroupEnd());
  }

  // Work queued on `stream` from here runs after everything queued on the communication stream
  // (the communicator's NCCL work stays in one order on the device).
  void after_comm_stream(cudaStream_t stream) {
    cudaEvent_t e = take_event();
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(e, comm_stream_));
    MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
    free_events_.push_back(e);
  }

  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    MOEBLAZE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  ncclComm_t comm_;
  cudaStream_t stream_;       // the caller's: blocking calls
  cudaStream_t comm_stream_;  // the transport's own: started exchanges, in start order
  int rank_ = 0, world_ = 1;
  Buffer staging_;  // (W, count) int64 on this rank's GPU, grown on demand
  std::vector<cudaEvent_t> free_events_;                // recorded-and-waited or never used
  std::unordered_map<uint64_t, cudaEvent_t> pending_;   // ticket -> its exchange's end
  uint64_t next_ticket_ = 1;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Transport> make_nccl_transport(void* nccl_comm, void* cuda_stream) {
  MOEBLAZE_REQUIRE(nccl_comm != nullptr, "nccl_comm is null");
  return std::make_unique<NcclTransport>(static_cast<ncclComm_t>(nccl_comm),
                                         static_cast<cudaStream_t>(cuda_stream));
}

}  // namespace moeblaze

#endif  // MOEBLAZE_WITH_NCCL
