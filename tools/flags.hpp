// Strict number flags: CLI11 checks run on the flag's text before it is converted, so a value
// that would otherwise be wrapped or truncated ('-1' or '2^64' for a uint64 seed, '1e23', '3.5',
// '0x10') is rejected with the rule instead.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

namespace moeblaze::tools {

// Decimal digits with an optional leading '-', nothing else, in [lo, hi].
CLI::Validator integer_in(int64_t lo, int64_t hi);
// Decimal digits only, in [0, 2^64 - 1] (seeds).
CLI::Validator unsigned_integer();

}  // namespace moeblaze::tools
