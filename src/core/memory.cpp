// Accounted allocations. Host memory is 64-byte aligned (whole cache lines, and 16-byte vector
// loads are always legal); device memory comes from cudaMalloc when CUDA is built in.
#include "moeblaze/memory.hpp"

#include <atomic>
#include <cstdlib>
#include <unordered_map>
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

// Host blocks of 256 KiB and more are kept after release and handed out again for the same
// rounded size: a training step allocates the same H, Y and workspace sizes every call, and
// glibc would otherwise map each such block anew and fault its pages in again (measured: 10-13 %
// of the CPU step at cpu-default, bench/NOTES.md). Smaller blocks go straight to malloc. The
// pool holds at most kMaxCachedBytes; beyond that, released blocks are freed. Cached blocks are
// not counted as held bytes (memory_stats counts live Buffers only).
class HostPool {
 public:
  static constexpr size_t kMinPooledBytes = size_t(256) << 10;
  static constexpr size_t kMaxCachedBytes = size_t(2) << 30;

  // `bytes` is a multiple of 64.
  void* take(size_t bytes) {
    if (bytes >= kMinPooledBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= bytes;
        return p;
      }
    }
    return std::aligned_alloc(64, bytes);
  }
  void give(void* p, size_t bytes) {
    if (bytes >= kMinPooledBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + bytes <= kMaxCachedBytes) {
        free_.emplace(bytes, p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::unordered_multimap<size_t, void*> free_;  // rounded size -> released block
  size_t cached_ = 0;
};

// Never destroyed: Buffers in other static objects may be released after it would be.
HostPool& host_pool() {
  static HostPool* pool = new HostPool();
  return *pool;
}

size_t host_rounded(size_t bytes) { return (bytes + 63) / 64 * 64; }

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
// about 1 ms per layer call on sm-7B-n256 with cudaMalloc/cudaFree). Set once per device.
void keep_pool_cached() {
  static std::once_flag once;
  std::call_once(once, [] {
    int dev = 0;
    cudaMemPool_t pool;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
  });
}
}  // namespace
#endif

Buffer::Buffer(Device device, size_t bytes, void* stream)
    : bytes_(bytes), device_(device), stream_(stream) {
  if (bytes == 0) return;
  if (device == Device::cpu) {
    data_ = host_pool().take(host_rounded(bytes));
    if (!data_) throw std::bad_alloc();
  } else {
#ifdef MOEBLAZE_WITH_CUDA
    keep_pool_cached();
    cudaError_t err = cudaMallocAsync(&data_, bytes, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      data_ = nullptr;
      throw DeviceError(detail::concat("cudaMallocAsync of ", bytes, " bytes failed: ",
                                       cudaGetErrorString(err)));
    }
#else
    throw Unsupported("device memory requested but moeblaze was built without CUDA");
#endif
  }
  account_alloc(device, bytes);
}

Buffer::~Buffer() {
  if (!data_) return;
  if (device_ == Device::cpu) {
    host_pool().give(data_, host_rounded(bytes_));
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
