// Accounted allocations. Host memory is 64-byte aligned (whole cache lines, and 16-byte vector
// loads are always legal); device memory comes from cudaMalloc when CUDA is built in.
#include "moeblaze/memory.hpp"

#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <mutex>
#include <new>

#include "moeblaze/error.hpp"

#ifdef MOEBLAZE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moeblaze {
namespace {

struct Counters {
  std::mutex mu;
  size_t current = 0;
  size_t peak = 0;
};
Counters& counters(Device d) {
  static Counters cpu, cuda;
  return d == Device::cpu ? cpu : cuda;
}

void account_alloc(Device d, size_t bytes) {
  Counters& c = counters(d);
  std::lock_guard<std::mutex> lock(c.mu);
  c.current += bytes;
  if (c.current > c.peak) c.peak = c.current;
}
void account_free(Device d, size_t bytes) {
  Counters& c = counters(d);
  std::lock_guard<std::mutex> lock(c.mu);
  c.current -= bytes;
}

}  // namespace

MemoryStats memory_stats(Device device) {
  Counters& c = counters(device);
  std::lock_guard<std::mutex> lock(c.mu);
  return {c.current, c.peak};
}

void reset_peak(Device device) {
  Counters& c = counters(device);
  std::lock_guard<std::mutex> lock(c.mu);
  c.peak = c.current;
}

PeakScope::PeakScope(Device device) : device_(device) {
  Counters& c = counters(device);
  std::lock_guard<std::mutex> lock(c.mu);
  c.peak = c.current;
  start_ = c.current;
}

size_t PeakScope::peak_above_start() const {
  return memory_stats(device_).peak - start_;
}

#ifdef MOEBLAZE_WITH_CUDA
namespace {
// The default pool frees memory back to the driver at every synchronisation unless told to keep
// it; keeping it makes a per-call workspace cost an address lookup, not a cudaMalloc (measured:
// about 1 ms per layer call on sm-7B-n256 with cudaMalloc/cudaFree). Set once per DEVICE: a
// process driving several GPUs (expert parallelism, one thread per GPU) needs it on each; a
// once-per-process flag left every GPU but the first re-allocating at each call (the suspected
// cause of the EP benchmark's slow local layers on 2 H200s; docs/EXPERT_PARALLEL.md).
void keep_pool_cached() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return;
  if (dev >= 0 && dev < kMaxDevices && done[dev].load(std::memory_order_acquire)) return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);  // idempotent
  }
  if (dev >= 0 && dev < kMaxDevices) done[dev].store(true, std::memory_order_release);
}
}  // namespace
#endif

Buffer::Buffer(Device device, size_t bytes, void* stream)
    : bytes_(bytes), device_(device), stream_(stream) {
  if (bytes == 0) return;
  if (device == Device::cpu) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    if (!data_) throw std::bad_alloc();
  } else {
#ifdef MOEBLAZE_WITH_CUDA
    keep_pool_cached();
    cudaError_t err = cudaMallocAsync(&data_, bytes, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      data_ = nullptr;
      // The exception reports it: left as the runtime's last error, it would fail the next
      // launch check (cudaGetLastError) of a later, valid call.
      (void)cudaGetLastError();
      throw DeviceError(detail::concat("cudaMallocAsync of ", bytes, " bytes failed: ",
                                       cudaGetErrorString(err)));
    }
#else
    throw Unsupported("device memory requested but moeblaze was built without CUDA");
#endif
  }
  account_alloc(device, bytes);
}

Buffer Buffer::borrow(Device device, void* data, size_t bytes) {
  MOEBLAZE_REQUIRE(data != nullptr || bytes == 0, "Buffer::borrow: null data for ", bytes,
                   " bytes");
  Buffer b;
  b.data_ = bytes == 0 ? nullptr : data;
  b.bytes_ = bytes;
  b.device_ = device;
  b.owned_ = false;
  return b;
}

Buffer::~Buffer() {
  if (!data_ || !owned_) return;
  if (device_ == Device::cpu) {
    std::free(data_);
  } else {
#ifdef MOEBLAZE_WITH_CUDA
    cudaFreeAsync(data_, static_cast<cudaStream_t>(stream_));
#endif
  }
  account_free(device_, bytes_);
}

TensorView Buffer::view(DType dtype, std::initializer_list<int64_t> dims) const {
  TensorView v(data_, dtype, device_, dims);
  if (v.bytes() > bytes_)
    throw Error(detail::concat("Buffer::view: ", v.describe(), " does not fit in ", bytes_,
                               " bytes"));
  return v;
}

}  // namespace moeblaze
