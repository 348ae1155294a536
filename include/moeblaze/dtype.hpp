// Element types and the bf16 storage type (round-to-nearest-even conversion, as the GPU does).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace moeblaze {

enum class DType : uint8_t { f32, bf16, i32, f64 };

inline constexpr size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : t == DType::bf16 ? 2 : t == DType::i32 ? 4 : 8;
}
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::i32: return "int32";
    case DType::f64: return "fp64";
  }
  return "?";
}
// "fp32"/"float32"/"f32", "bf16"/"bfloat16"; throws InvalidArgument otherwise.
DType parse_dtype(const std::string& s);

// bfloat16 storage: the upper 16 bits of an IEEE float. Arithmetic is always done in float.
struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))  // NaN: keep it a (quiet) NaN
      return static_cast<uint16_t>((u >> 16) | 0x0040u);
    const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
  }
  static float to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bf16) == 2, "bf16 must be two bytes");

// Round a float to the nearest bf16 and back (what storing in bf16 does to a value).
inline float round_to_bf16(float f) { return bf16::to_float(bf16::from_float(f)); }

}  // namespace moeblaze
