#include "cmd_bench_util.hpp"

#include <algorithm>
#include <cstdio>

namespace moeblaze::tools {

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

void GpuTimer::flush(int rep) {
  // A different byte each time, so the writes cannot be elided or compressed away.
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flush_, (rep * 37 + 1) & 0xff, kL2FlushBytes, stream_));
}

}  // namespace moeblaze::tools
