#include "moeblaze/tensor.hpp"

#include <string>

#include "core/checked_math.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {

static std::string shape_str(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  if (t.rank == 1) s += ",";
  return s + ")";
}

// Product of the shape; InvalidArgument "<name> element count (a * b) overflows int64".
static int64_t element_count(const TensorView& t, const char* name) {
  const std::string what = std::string(name) + " element count";
  int64_t n = 1;
  for (int i = 0; i < t.rank; ++i) n = checked_mul(n, t.shape[i], what.c_str());
  return n;
}

int64_t TensorView::numel() const { return element_count(*this, "tensor"); }

size_t TensorView::bytes() const {
  return static_cast<size_t>(
      checked_mul(numel(), static_cast<int64_t>(dtype_size(dtype)), "tensor bytes"));
}

std::string TensorView::describe() const {
  return shape_str(*this) + " " + dtype_name(dtype) + " " + device_name(device);
}

void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims) {
  bool ok = t.rank == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && t.shape[i] != d) ok = false;
    ++i;
  }
  if (!ok) {
    TensorView want;
    want.rank = static_cast<int>(dims.size());
    i = 0;
    for (int64_t d : dims) want.shape[i++] = d;
    throw InvalidArgument(std::string(name) + " has shape " + shape_str(t) + ", expected " +
                          shape_str(want));
  }
}

void require_dtype(const TensorView& t, const char* name, DType dtype) {
  MOEBLAZE_REQUIRE(t.dtype == dtype, name, " has dtype ", dtype_name(t.dtype), ", expected ",
                   dtype_name(dtype));
}

void require_float_dtype(const TensorView& t, const char* name) {
  MOEBLAZE_REQUIRE(t.dtype == DType::f32 || t.dtype == DType::bf16, name, " has dtype ",
                   dtype_name(t.dtype), ", expected fp32 or bf16");
}

void require_device(const TensorView& t, const char* name, Device device) {
  MOEBLAZE_REQUIRE(t.device == device, name, " is on ", device_name(t.device), ", expected ",
                   device_name(device));
}

void require_data(const TensorView& t, const char* name) {
  MOEBLAZE_REQUIRE(t.data != nullptr || element_count(t, name) == 0, name,
                   " has no data (null pointer)");
}

}  // namespace moeblaze
