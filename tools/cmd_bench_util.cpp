#include "cmd_bench_util.hpp"

#include "cuda/layer/layer_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

namespace moeblaze::tools {

Routing benchmark_routing(const LayerConfig& c, uint64_t seed, const std::string& rounding,
                          int m_tile) {
  std::vector<float> logits(size_t(c.T * c.E));  // (T, E)
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : logits) v = nd(rng);
  RouterConfig rc;
  rc.kind = RouterKind::softmax_topk;
  rc.top_k = int(c.K);
  Routing topk;
  route(rc, host_view(logits.data(), {c.T, c.E}), TensorView(), topk);
  if (rounding == "topk") return topk;
  TokenRoundingConfig trc;
  trc.m_tile = m_tile;
  trc.mode = parse_rounding(rounding);
  trc.seed = seed;
  Routing rounded;
  token_round(rc, trc, host_view(logits.data(), {c.T, c.E}), TensorView(), topk.view(), rounded);
  return rounded;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::string driver_version() {
  std::string s;
  if (FILE* f = popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null", "r")) {
    char buf[128];
    if (fgets(buf, sizeof buf, f)) s = buf;
    pclose(f);
  }
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  if (s.empty()) {
    int v = 0;
    cudaDriverGetVersion(&v);
    s = "cuda-driver-api " + std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  }
  return s;
}

GpuTimer::GpuTimer(cudaStream_t stream, void* flush) : stream_(stream), flush_(flush) {
  MOEBLAZE_CUDA_CHECK(cudaEventCreate(&start_));
  MOEBLAZE_CUDA_CHECK(cudaEventCreate(&stop_));
}

GpuTimer::~GpuTimer() {
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
}

void write_l2_flush(void* flush, int rep, cudaStream_t stream) {
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flush, (rep * 37 + 1) & 0xff, kL2FlushBytes, stream));
}

void GpuTimer::flush(int rep) { write_l2_flush(flush_, rep, stream_); }

}  // namespace moeblaze::tools

namespace moeblaze::tools {

LayerTensors::LayerTensors(const LayerConfig& c, int64_t experts, int64_t S, uint64_t seed,
                           cudaStream_t stream)
    : x(c.T * c.d * 2),
      w1(experts * c.w1_rows() * c.d * 2),
      w2(experts * c.d * c.n * 2),
      dout(c.T * c.d * 2),
      out(c.T * c.d * 2),
      dx(c.T * c.d * 2),
      dw1(experts * c.w1_rows() * c.d * 2),
      dw2(experts * c.d * c.n * 2),
      dpw(S * 4) {
  const int64_t R = c.w1_rows();
  cuda::fill_normal(x.p, DType::bf16, c.T * c.d, seed + 1, 1.0f, stream);
  cuda::fill_normal(w1.p, DType::bf16, experts * R * c.d, seed + 2, 1.0f / std::sqrt(float(c.d)),
                    stream);
  cuda::fill_normal(w2.p, DType::bf16, experts * c.d * c.n, seed + 3,
                    1.0f / std::sqrt(float(c.n)), stream);
  cuda::fill_normal(dout.p, DType::bf16, c.T * c.d, seed + 4, 1.0f, stream);
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  xv = TensorView(x.p, DType::bf16, Device::cuda, {c.T, c.d});                  // (T, d)
  w1v = TensorView(w1.p, DType::bf16, Device::cuda, {experts, R, c.d});        // (E, w1_rows, d)
  w2v = TensorView(w2.p, DType::bf16, Device::cuda, {experts, c.d, c.n});      // (E, d, n)
  outv = TensorView(out.p, DType::bf16, Device::cuda, {c.T, c.d});             // (T, d)
  doutv = TensorView(dout.p, DType::bf16, Device::cuda, {c.T, c.d});           // (T, d)
  grads.dx = TensorView(dx.p, DType::bf16, Device::cuda, {c.T, c.d});          // (T, d)
  grads.dw1 = TensorView(dw1.p, DType::bf16, Device::cuda, {experts, R, c.d});  // like w1
  grads.dw2 = TensorView(dw2.p, DType::bf16, Device::cuda, {experts, c.d, c.n});  // like w2
  grads.d_pair_weights = TensorView(dpw.p, DType::f32, Device::cuda, {S});     // (S,) fp32
}

}  // namespace moeblaze::tools
