// current_device_sms (kernel_config.hpp): the one device query of the kernel choice, apart from
// the host-only rules so that their tests and `bench kernels` run where no GPU is.
#include <cuda_runtime.h>

#include <atomic>

#include "cuda/gemm/dispatch/kernel_config.hpp"

namespace moeblaze::cuda::gemm {
namespace {

constexpr int kMaxDevices = 64;
// Per device: 0 not read yet, else its SM count. choose_kernels runs per GEMM launch, so the
// attribute is read once and then only cudaGetDevice (host-side, no synchronisation) remains.
std::atomic<int> g_sms[kMaxDevices];
std::atomic<bool> g_no_gpu{false};  // cudaGetDevice failed once: no GPU for this process

// The attribute itself; 0 when it cannot be read.
int read_sms(int dev) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the caller's next check
    return 0;
  }
  return sms > 0 ? sms : 0;
}

}  // namespace

DeviceSms current_device_sms() {
  int dev = 0;
  if (g_no_gpu.load(std::memory_order_relaxed)) return {kFallbackSms, -1};
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();  // the error cudaGetDevice just set (not sticky)
    g_no_gpu.store(true, std::memory_order_relaxed);
    return {kFallbackSms, -1};
  }
  const bool cached = dev >= 0 && dev < kMaxDevices;
  int sms = cached ? g_sms[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    sms = read_sms(dev);
    if (sms == 0) return {kFallbackSms, -1};
    if (cached) g_sms[dev].store(sms, std::memory_order_relaxed);
  }
  return {sms, dev};
}

}  // namespace moeblaze::cuda::gemm
