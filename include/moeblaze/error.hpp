// moeblaze errors. Every public entry point validates its arguments before it touches any
// output and throws one of these with a message that names the argument and the rule it broke,
// e.g. "top_k (9) exceeds num_experts (8)".
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace moeblaze {

// Base class of everything moeblaze throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A caller-supplied argument breaks a documented rule (shape, dtype, range, NaN, ...).
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(what) {}
};

// The arguments are valid but the requested backend cannot take them (e.g. a GPU kernel needs
// d to be a multiple of 8). The message says which dimension and what it must be.
class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& what) : Error(what) {}
};

// A CUDA runtime / driver call failed, or a device-side check raised its flag.
class DeviceError : public Error {
 public:
  explicit DeviceError(const std::string& what) : Error(what) {}
};

namespace detail {
// Message pieces appended without iostreams, whose locale state a host process with another C++
// runtime can break. Integers in decimal, floating point as %g (an ostream's default), bools as
// 1 / 0, chars as characters.
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? '1' : '0'; }
inline void append(std::string& s, const void* v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", v);
  s += buf;
}
template <typename T>
std::enable_if_t<std::is_integral_v<T>> append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append(std::string& s, T v) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  s += buf;
}
template <typename T>
std::enable_if_t<std::is_enum_v<T>> append(std::string& s, T v) {
  s += std::to_string(static_cast<long long>(v));
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace moeblaze

// MOEBLAZE_REQUIRE(cond, "top_k (", k, ") exceeds num_experts (", e, ")")
#define MOEBLAZE_REQUIRE(cond, ...)                                              \
  do {                                                                           \
    if (!(cond)) throw ::moeblaze::InvalidArgument(::moeblaze::detail::concat(__VA_ARGS__)); \
  } while (0)

#define MOEBLAZE_UNSUPPORTED_IF(cond, ...)                                   \
  do {                                                                       \
    if (cond) throw ::moeblaze::Unsupported(::moeblaze::detail::concat(__VA_ARGS__)); \
  } while (0)
