// NcclTransport: the expert-parallel Transport over an NCCL communicator, one rank per GPU.
// all_to_all_v is one NCCL group of ncclSend/ncclRecv per peer (the block to itself is a device
// copy); all_gather goes through a small device staging buffer. Every call ends with a stream
// synchronisation: the Transport contract is blocking, which ep_forward/ep_backward rely on to
// read received counts on the host and to reuse send buffers. NVLink SHARP / multicast is never
// requested here; launchers export NCCL_NVLS_ENABLE=0 (scripts/ep_nccl_check.sh).
#ifdef MOEBLAZE_WITH_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

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
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return Device::cuda; }

  void all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
                    void* recv, const int64_t* recv_counts,
                    const int64_t* recv_offsets) override {
    MOEBLAZE_REQUIRE(send_counts[rank_] == recv_counts[rank_], "all_to_all_v: rank ", rank_,
                     " sends ", send_counts[rank_], " bytes to itself but expects ",
                     recv_counts[rank_]);
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    if (send_counts[rank_] > 0)
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(r + recv_offsets[rank_], s + send_offsets[rank_],
                                          static_cast<size_t>(send_counts[rank_]),
                                          cudaMemcpyDeviceToDevice, stream_));
    MOEBLAZE_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (send_counts[p] > 0)
        MOEBLAZE_NCCL_CHECK(ncclSend(s + send_offsets[p], static_cast<size_t>(send_counts[p]),
                                     ncclUint8, p, comm_, stream_));
      if (recv_counts[p] > 0)
        MOEBLAZE_NCCL_CHECK(ncclRecv(r + recv_offsets[p], static_cast<size_t>(recv_counts[p]),
                                     ncclUint8, p, comm_, stream_));
    }
    MOEBLAZE_NCCL_CHECK(ncclGroupEnd());
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void all_gather(const int64_t* send, int64_t count, int64_t* recv) override {
    if (count <= 0) return;
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

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, world_ = 1;
  Buffer staging_;  // (W, count) int64 on this rank's GPU, grown on demand
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
