// Marks between the CUDA layer's steps, so that a benchmark can time each step inside a real
// layer_forward / layer_backward call (its own workspaces, their placement, its order of kernels)
// instead of replaying the steps on buffers of its own, where some read slower than in the call
// (docs/notes/gathered-gemms.md, "Each GEMM inside the layer call").
//
// Off unless a recorder is installed: mark_step is then one atomic load. With one installed, the
// layer calls recorder->mark(stream, step) on its stream after enqueueing each step, and the
// recorder records a CUDA event there; the GPU time from one mark to the next is that step's.
// Process-wide, for benchmarks: not for concurrent layer calls.
#pragma once

#include <cuda_runtime.h>

namespace moeblaze::cuda {

// Step names (static strings, pipeline order; a step run once per token chunk marks each time).
namespace step {
inline constexpr const char* kUpProj = "1 up-proj";
inline constexpr const char* kDownProj = "2 down-proj";
inline constexpr const char* kAggregate = "3 aggregate";
inline constexpr const char* kUpProjAgain = "  up-proj (recompute)";
inline constexpr const char* kDh = "4 dH";
inline constexpr const char* kDsReduce = "  ds reduce";
inline constexpr const char* kDw2 = "5 dW2";
inline constexpr const char* kPairGrads = "  d_pair_weights, dx order";
inline constexpr const char* kDx = "6 dX~";
inline constexpr const char* kDxAggregate = "7 dX aggregate";
inline constexpr const char* kDw1 = "8 dW1";
inline constexpr const char* kRanges = "  backward in expert ranges";
}  // namespace step

class StepMarks {
 public:
  virtual ~StepMarks() = default;
  // `step` (one of step::*) has just been enqueued on `stream`.
  virtual void mark(cudaStream_t stream, const char* step) = 0;
};

void set_step_marks(StepMarks* marks);  // nullptr: off (the default)
void mark_step(cudaStream_t stream, const char* step);  // a no-op while off

}  // namespace moeblaze::cuda
