// Argument checks shared by the layer API (src/api/layer_api.cpp) and the expert-parallel
// layer (src/ep/expert_parallel.cpp).
#pragma once

#include "moeblaze/layer.hpp"

namespace moeblaze {

// `mode` is keep_h, recompute or materialized; InvalidArgument naming `name` otherwise.
void require_layer_mode(LayerMode mode, const char* name);

}  // namespace moeblaze
