// The one way into SavedForBackward's private state (include/moeblaze/layer.hpp), for the code
// that fills and reads it: the CPU and CUDA backends, the baselines, the API's checks and tests.
// Internal: not installed, so callers of the library see only mode(), valid() and bytes().
#pragma once

#include <cstdint>

#include "moeblaze/layer.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze::detail {

struct SavedAccess {
  // Marks `s` filled by a forward in `mode` over S slots; its buffers are set before.
  static void mark_filled(SavedForBackward& s, LayerMode mode, int64_t S) {
    s.mode_ = mode;
    s.S_ = S;
    s.valid_ = true;
  }
  static int64_t S(const SavedForBackward& s) { return s.S_; }

  // H (S, w1_rows) cfg.dtype: keep_h and materialized (empty in recompute).
  static Buffer& h(SavedForBackward& s) { return s.h_; }
  static const Buffer& h(const SavedForBackward& s) { return s.h_; }
  // The materialized baseline's tensors: xs (S, d), act_g (S, n) gated only, a (S, n), y (S, d).
  static Buffer& xs(SavedForBackward& s) { return s.xs_; }
  static const Buffer& xs(const SavedForBackward& s) { return s.xs_; }
  static Buffer& act_g(SavedForBackward& s) { return s.act_g_; }
  static const Buffer& act_g(const SavedForBackward& s) { return s.act_g_; }
  static Buffer& a(SavedForBackward& s) { return s.a_; }
  static const Buffer& a(const SavedForBackward& s) { return s.a_; }
  static Buffer& y(SavedForBackward& s) { return s.y_; }
  static const Buffer& y(const SavedForBackward& s) { return s.y_; }
};

}  // namespace moeblaze::detail
