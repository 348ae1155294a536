// make_nccl_transport when moeblaze was built without NCCL (CPU-only builds, or CUDA builds where
// CMake found no nccl.h / libnccl). The real one is src/cuda/ep/nccl_transport.cpp.
#ifndef MOEBLAZE_WITH_NCCL

#include "moeblaze/error.hpp"
#include "moeblaze/expert_parallel.hpp"

namespace moeblaze {

bool nccl_available() { return false; }

std::unique_ptr<Transport> make_nccl_transport(void* nccl_comm, void* cuda_stream) {
  (void)nccl_comm;
  (void)cuda_stream;
  throw Unsupported(
      "make_nccl_transport: moeblaze was built without NCCL (configure with CUDA where nccl.h "
      "and libnccl are found)");
}

}  // namespace moeblaze

#endif  // MOEBLAZE_WITH_NCCL
