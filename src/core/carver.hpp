// Carver: the layout of one device workspace (or scratch) carved into 256-byte-aligned pieces,
// shared by the CUDA layer's workspaces and the grouped GEMMs' per-expert argument arrays.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moeblaze {

// Carves 256-byte-aligned pieces out of one workspace allocation, or (base == nullptr) only
// counts the bytes, so the size reported before a call and the carving share one code path.
class Carver {
 public:
  explicit Carver(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(int64_t count) {
    const size_t at = offset_;
    offset_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  // Marks the current offset; rewind() returns to it, so later takes reuse the bytes of the
  // pieces taken since (for buffers whose lifetimes do not overlap). high_water() is the size.
  size_t mark() const { return offset_; }
  void rewind(size_t mark) {
    if (offset_ > high_) high_ = offset_;
    offset_ = mark;
  }
  size_t high_water() const { return offset_ > high_ ? offset_ : high_; }

 private:
  char* base_;
  size_t offset_ = 0;
  size_t high_ = 0;
};

}  // namespace moeblaze
