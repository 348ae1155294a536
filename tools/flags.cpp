#include "flags.hpp"

#include <charconv>
#include <string>

namespace moeblaze::tools {
namespace {

// from_chars over the whole text: leading '+', spaces, exponents and hex are not integers here.
template <typename T>
bool parse_whole(const std::string& s, T& v) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  return !s.empty() && ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string rule = "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, rule](std::string& s) -> std::string {
        int64_t v = 0;
        if (!parse_whole(s, v) || v < lo || v > hi) return "'" + s + "' is not " + rule;
        return {};
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        if (!parse_whole(s, v)) return "'" + s + "' is not an integer in [0, 18446744073709551615]";
        return {};
      },
      "UINT64");
}

}  // namespace moeblaze::tools
