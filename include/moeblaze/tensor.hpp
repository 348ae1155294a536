// Non-owning tensor views. moeblaze never allocates the caller's tensors: inputs and outputs are
// views over memory the caller owns (host memory for Device::cpu, device memory for
// Device::cuda), dense and row-major (the last dimension is contiguous).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "moeblaze/dtype.hpp"

namespace moeblaze {

enum class Device : uint8_t { cpu, cuda };
inline const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

struct TensorView {
  static constexpr int kMaxRank = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};

  TensorView() = default;
  TensorView(void* data_, DType dtype_, Device device_, std::initializer_list<int64_t> dims)
      : data(data_), dtype(dtype_), device(device_), rank(static_cast<int>(dims.size())) {
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
  }

  int64_t dim(int i) const { return shape[i]; }
  // Element count and bytes; InvalidArgument when the product of the shape overflows int64
  // (so a huge shape can never pass for an empty one).
  int64_t numel() const;
  size_t bytes() const;
  bool empty() const { return numel() == 0; }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }

  // "(2048, 256) bf16 cpu"
  std::string describe() const;
};

// Convenience constructors for host memory.
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }

template <typename T>
TensorView host_view(T* data, std::initializer_list<int64_t> dims) {
  return TensorView(static_cast<void*>(const_cast<std::remove_const_t<T>*>(data)),
                    dtype_of<std::remove_const_t<T>>(), Device::cpu, dims);
}

// Validation helpers used by every entry point. `name` is the argument's public name.
// Each throws InvalidArgument naming the argument and the expected shape/dtype/device.
void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims);
void require_dtype(const TensorView& t, const char* name, DType dtype);
void require_float_dtype(const TensorView& t, const char* name);  // fp32 or bf16
void require_device(const TensorView& t, const char* name, Device device);
void require_data(const TensorView& t, const char* name);  // non-null unless empty

}  // namespace moeblaze
