// current_device_props (kernel_config.hpp): the one device query of the kernel choice, apart from
// the host-only rules so that their tests and `bench kernels` run where no GPU is.
#include <cuda_runtime.h>

#include <atomic>

#include "cuda/gemm/dispatch/kernel_config.hpp"

namespace moeblaze::cuda::gemm {
namespace {

constexpr int kMaxDevices = 64;
// Per device: 0 not read yet, else its SM count, L2 bytes and FLOPs per DRAM byte. choose_kernels
// runs per GEMM launch, so the attributes are read once and then only cudaGetDevice (host-side,
// no synchronisation) remains. The others are stored before the SM count, which marks all read.
std::atomic<int> g_sms[kMaxDevices];
std::atomic<int> g_l2[kMaxDevices];
std::atomic<int64_t> g_fpb[kMaxDevices];
std::atomic<bool> g_no_gpu{false};  // cudaGetDevice failed once: no GPU for this process

// The attribute itself; 0 when it cannot be read.
int read_attr(cudaDeviceAttr attr, int dev) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the caller's next check
    return 0;
  }
  return v > 0 ? v : 0;
}

}  // namespace

DeviceProps current_device_props() {
  int dev = 0;
  if (g_no_gpu.load(std::memory_order_relaxed)) return {kFallbackSms, kFallbackL2Bytes, -1};
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();  // the error cudaGetDevice just set (not sticky)
    g_no_gpu.store(true, std::memory_order_relaxed);
    return {kFallbackSms, kFallbackL2Bytes, -1};
  }
  const bool cached = dev >= 0 && dev < kMaxDevices;
  int sms = cached ? g_sms[dev].load(std::memory_order_acquire) : 0;
  int l2 = sms > 0 ? g_l2[dev].load(std::memory_order_relaxed) : 0;
  int64_t fpb = sms > 0 ? g_fpb[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    sms = read_attr(cudaDevAttrMultiProcessorCount, dev);
    l2 = read_attr(cudaDevAttrL2CacheSize, dev);
    if (sms == 0 || l2 == 0) return {kFallbackSms, kFallbackL2Bytes, -1};
    fpb = flops_per_dram_byte(sms, read_attr(cudaDevAttrClockRate, dev),
                              read_attr(cudaDevAttrMemoryClockRate, dev),
                              read_attr(cudaDevAttrGlobalMemoryBusWidth, dev));
    if (fpb <= 0) fpb = kFallbackFlopsPerByte;  // a clock the driver does not report
    if (cached) {
      g_l2[dev].store(l2, std::memory_order_relaxed);
      g_fpb[dev].store(fpb, std::memory_order_relaxed);
      g_sms[dev].store(sms, std::memory_order_release);
    }
  }
  return {sms, l2, dev, fpb};
}

}  // namespace moeblaze::cuda::gemm
