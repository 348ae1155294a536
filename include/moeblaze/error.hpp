// moeblaze errors. Every public entry point validates its arguments before it touches any
// output and throws one of these with a message that names the argument and the rule it broke,
// e.g. "top_k (9) exceeds num_experts (8)".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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
