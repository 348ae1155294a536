#include "core/checked_math.hpp"

#include "moeblaze/config.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  MOEBLAZE_REQUIRE(!__builtin_mul_overflow(a, b, &r), what, " (", a, " * ", b, ") overflows int64");
  return r;
}

void check_slot_extents(const LayerConfig& cfg, int64_t S) {
  MOEBLAZE_REQUIRE(S >= 0 && S < kInt32Limit, "S (", S, ") must be in [0, 2^31)");
  // Every workspace of either backend is a few (S, w1_rows | n | d) arrays of at most 4-byte
  // elements plus O(E + threads * tile) scratch: 8 bytes per (slot, column) bounds their sum.
  checked_mul(checked_mul(S, cfg.w1_rows() + cfg.n + cfg.d, "S*(w1_rows+n+d)"), 8,
              "S*(w1_rows+n+d)*8 bytes of layer workspace");
}

}  // namespace moeblaze
