// What the GPU benchmark subcommands (tools/cmd_bench_*.cpp) share: docs/DESIGN.md's timing
// protocol (CUDA events around the region, L2 flushed before every repetition, median) and the
// driver version for result rows. Compiled only into CUDA builds.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze::tools {

// Written between repetitions so that no operand stays in the H200's 60 MB L2 (>= 2x L2).
constexpr size_t kL2FlushBytes = size_t(256) << 20;

double median(std::vector<double> v);
// The protocol's L2 flush: writes the kL2FlushBytes at `flush` on `stream`, a different byte for
// each repetition `rep` (so that the writes cannot be elided or compressed away).
void write_l2_flush(void* flush, int rep, cudaStream_t stream);
// "580.159.04" from nvidia-smi, else the CUDA driver API version.
std::string driver_version();

// Times a region on `stream`: for each of warmup + reps repetitions, before() (untimed), an
// untimed write of the flush buffer (kL2FlushBytes at `flush`), then events around fn(); returns
// the median of the timed repetitions.
class GpuTimer {
 public:
  GpuTimer(cudaStream_t stream, void* flush);
  ~GpuTimer();
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;

  template <typename Before, typename Fn>
  double median_ms(int warmup, int reps, Before&& before, Fn&& fn) {
    return median(samples_ms(warmup, reps, before, fn));
  }
  // Every timed repetition's ms (warm-up left out), for callers that pool several calls' samples.
  template <typename Before, typename Fn>
  std::vector<double> samples_ms(int warmup, int reps, Before&& before, Fn&& fn) {
    std::vector<double> t;
    for (int i = 0; i < warmup + reps; ++i) {
      before();
      flush(i);
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(start_, stream_));
      fn();
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      MOEBLAZE_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      MOEBLAZE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      if (i >= warmup) t.push_back(ms);
    }
    return t;
  }
  template <typename Fn>
  double median_ms(int warmup, int reps, Fn&& fn) {
    return median_ms(warmup, reps, [] {}, fn);
  }
  template <typename Fn>
  double median_us(int warmup, int reps, Fn&& fn) {
    return 1000.0 * median_ms(warmup, reps, fn);
  }

 private:
  void flush(int rep);
  cudaStream_t stream_;
  void* flush_;
  cudaEvent_t start_, stop_;
};

// The benchmark routing of a layer shape (docs/DESIGN.md), on the host: softmax top-K of N(0, 1)
// logits drawn from `seed`, then, unless `rounding` is "topk", that token rounding of it
// (SonicMoE's, tile m_tile; parse_rounding names the valid modes).
Routing benchmark_routing(const LayerConfig& c, uint64_t seed, const std::string& rounding = "topk",
                          int m_tile = 128);

// Device memory the command owns (the caller's tensors), on the current device; never counted by
// moeblaze's allocator statistics.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) {
    if (b) MOEBLAZE_CUDA_CHECK(cudaMalloc(&p, b));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// The inputs and outputs of one layer call in bf16 (the CUDA layer's dtype), allocated on the
// current device and filled from `seed` (x, d_out ~ N(0, 1), w1 ~ N(0, 1/d), w2 ~ N(0, 1/n)):
// T tokens and `experts` experts (E, or E / W on an expert-parallel rank), S slots for the pair
// gradient. The views are what layer_forward / layer_backward (and ep_*) take.
struct LayerTensors {
  DevBuf x, w1, w2, dout, out, dx, dw1, dw2, dpw;  // shapes as the views below
  TensorView xv, w1v, w2v, outv, doutv;
  LayerGrads grads;
  LayerTensors(const LayerConfig& c, int64_t experts, int64_t S, uint64_t seed,
               cudaStream_t stream);
};

}  // namespace moeblaze::tools
