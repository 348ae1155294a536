// Checked int64 size arithmetic for validators and workspace sizes: a product or sum of sizes
// that overflows int64 is an invalid argument (naming the expression), never a wrapped value.
#pragma once

#include <cstdint>

namespace moeblaze {

// Token ids, expert ids, pairs and slots are int32: counts of them must stay below this.
constexpr int64_t kInt32Limit = int64_t(1) << 31;

// a*b, or InvalidArgument "T*K (a * b) overflows int64" with `what` = "T*K".
int64_t checked_mul(int64_t a, int64_t b, const char* what);

struct LayerConfig;
// The slot-dependent sizes of a validated layer (cfg.validate() bounds the rest): S in
// [0, 2^31) and S*(w1_rows+n+d)*8 bytes within int64, so that no workspace size can wrap.
void check_slot_extents(const LayerConfig& cfg, int64_t S);

}  // namespace moeblaze
