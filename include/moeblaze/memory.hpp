// Owning, accounted memory. Every buffer the library allocates for itself (saved activations,
// routing plans, workspaces, temporaries) is a Buffer, so the bytes kept for backward and the
// peak transient bytes of a call are read off real allocations, not computed by a formula.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "moeblaze/tensor.hpp"

namespace moeblaze {

// Process-wide byte counters, one set per device kind. Thread-safe.
struct MemoryStats {
  size_t current = 0;  // bytes held by live Buffers now
  size_t peak = 0;     // high-water mark of `current` since the last reset_peak()
};
MemoryStats memory_stats(Device device);
void reset_peak(Device device);  // peak := current

// Measures the peak bytes allocated above the level at construction, over its lifetime.
// Not reentrant across threads of the caller: measure one call at a time.
class PeakScope {
 public:
  explicit PeakScope(Device device);
  size_t peak_above_start() const;  // peak during the scope minus bytes held at its start
 private:
  Device device_;
  size_t start_;
};

class Buffer {
 public:
  Buffer() = default;
  // Zero bytes allocates nothing. Device memory is stream-ordered (cudaMallocAsync from the
  // device's default pool, kept cached by the pool): it is allocated and later freed in the order
  // of `stream` (a cudaStream_t; nullptr = the legacy default stream), so a buffer may be freed
  // as soon as its last user was enqueued on that stream, without waiting for the device. Work
  // that uses the buffer must run on that stream (or be ordered after it).
  Buffer(Device device, size_t bytes, void* stream = nullptr);
  // A non-owning Buffer over `bytes` of caller memory at `data` (on `device`): never freed and
  // not counted in memory_stats (the caller owns and accounts it). Lets a caller such as the
  // PyTorch front end keep H, the routing plan and workspaces in its own allocator's tensors.
  static Buffer borrow(Device device, void* data, size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) { Buffer tmp(std::move(o)); swap(tmp); }
    return *this;
  }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool owned() const { return owned_; }  // false for borrow()ed memory
  void reset() { Buffer tmp; swap(tmp); }

  // A view of the buffer as a tensor (shape must fit inside the allocation).
  TensorView view(DType dtype, std::initializer_list<int64_t> dims) const;

 private:
  void swap(Buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(device_, o.device_);
    std::swap(stream_, o.stream_);
    std::swap(owned_, o.owned_);
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::cpu;
  void* stream_ = nullptr;  // CUDA stream the device allocation is ordered on
  bool owned_ = true;       // false: borrowed caller memory (not freed, not accounted)
};

}  // namespace moeblaze
