// Device-side check of a routing plan's contents (the GPU counterpart of validate_routing_plan):
// the same rules, in one launch over (E+1) + (T+1) + S + S items, raising
// d_flags[kFlagBadPlan]; the synchronous entry point names the broken rule with the CPU
// validator's message, run on a host copy (the error path only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/plan_validation.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze::cuda {
namespace {

using detail::raise_flag;

// The last i in [0, n) with off[i] <= v (0 if none): the CSR row holding entry v. Reads only
// off[0..n-1]; on non-monotone offsets (flagged elsewhere) it still returns a row in range.
__device__ __forceinline__ int64_t csr_row(const int32_t* __restrict__ off, int64_t n,
                                           int32_t v) {
  int64_t lo = 0, hi = n;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (off[mid] <= v) lo = mid; else hi = mid;
  }
  return lo;
}

// One CSR offsets entry i of (count+1,): starts at 0, non-decreasing, ends at total.
__device__ __forceinline__ bool offsets_ok(const int32_t* __restrict__ off, int64_t i,
                                           int64_t count, int64_t total) {
  const int32_t o = off[i];
  if (i == 0 && o != 0) return false;
  if (i == count) return o == total;
  return off[i + 1] >= o;
}

__global__ void validate_plan_kernel(const int32_t* __restrict__ eto,  // (E+1,) expert offsets
                                     const int32_t* __restrict__ eti,  // (S,) token of each slot
                                     const float* __restrict__ sw,     // (S,) slot weights
                                     const int32_t* __restrict__ tpo,  // (T+1,) token offsets
                                     const int32_t* __restrict__ tei,  // (S,) expert of each pair
                                     const int32_t* __restrict__ tim,  // (S,) slot of each pair
                                     int64_t T, int64_t E, int64_t S,
                                     uint32_t* __restrict__ taken,  // (ceil(S/32),) zeroed
                                     int32_t* __restrict__ flags) {
  const int64_t n_eto = E + 1, n_tpo = T + 1, n = n_eto + n_tpo + 2 * S;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    bool ok = true;
    if (i < n_eto) {
      ok = offsets_ok(eto, i, E, S);
    } else if (i < n_eto + n_tpo) {
      ok = offsets_ok(tpo, i - n_eto, T, S);
    } else if (i < n_eto + n_tpo + S) {
      // Slot s: token in [0, T), tokens strictly ascending inside its expert, weight finite.
      const int32_t s = int32_t(i - n_eto - n_tpo);
      const int64_t e = csr_row(eto, E, s);
      const int32_t t = eti[s];
      ok = t >= 0 && t < T && isfinite(sw[s]) && (s == eto[e] || s == 0 || t > eti[s - 1]);
    } else {
      // Pair q of token t: expert in range, slot in range, in that expert's slots, holding t,
      // and taken by no other pair (with S pairs and S slots: token_index_map a permutation).
      const int32_t q = int32_t(i - n_eto - n_tpo - S);
      const int32_t t = int32_t(csr_row(tpo, T, q));
      const int32_t e = tei[q], s = tim[q];
      if (e < 0 || e >= E || s < 0 || s >= S) {
        ok = false;
      } else {
        const uint32_t bit = 1u << (s & 31);
        ok = s >= eto[e] && s < eto[e + 1] && eti[s] == t &&
             (atomicOr(&taken[s >> 5], bit) & bit) == 0;
      }
    }
    if (!ok) raise_flag(flags, kFlagBadPlan);
  }
}

// A host copy of a device plan's six arrays, for the error path's message.
struct HostPlan {
  std::vector<int32_t> eto, eti, tpo, tei, tim;
  std::vector<float> sw;
  RoutingPlanView view;
};

template <typename T>
void download(std::vector<T>& dst, const T* src, int64_t count) {
  dst.resize(size_t(count));
  if (count > 0)
    MOEBLAZE_CUDA_CHECK(
        cudaMemcpy(dst.data(), src, sizeof(T) * size_t(count), cudaMemcpyDeviceToHost));
}

HostPlan to_host(const RoutingPlanView& p) {
  HostPlan h;
  download(h.eto, p.expert_token_offsets, p.E + 1);
  download(h.tpo, p.token_pair_offsets, p.T + 1);
  download(h.eti, p.expert_token_indices, p.S);
  download(h.sw, p.slot_weights, p.S);
  download(h.tei, p.token_expert_indices, p.S);
  download(h.tim, p.token_index_map, p.S);
  h.view = p;
  h.view.device = Device::cpu;
  h.view.expert_token_offsets = h.eto.data();
  h.view.expert_token_indices = h.eti.data();
  h.view.slot_weights = h.sw.data();
  h.view.token_pair_offsets = h.tpo.data();
  h.view.token_expert_indices = h.tei.data();
  h.view.token_index_map = h.tim.data();
  return h;
}

}  // namespace

size_t plan_check_workspace_bytes(int64_t S) {
  return sizeof(uint32_t) * size_t((std::max<int64_t>(S, 0) + 31) / 32);
}

void validate_plan_async(const RoutingPlanView& plan, void* workspace, size_t workspace_bytes,
                         int32_t* d_flags, cudaStream_t stream) {
  validate_routing_plan_header(plan);
  MOEBLAZE_REQUIRE(plan.device == Device::cuda, "plan is on ", device_name(plan.device),
                   ", expected cuda (validate_routing_plan checks a host plan)");
  const size_t need = plan_check_workspace_bytes(plan.S);
  MOEBLAZE_REQUIRE(workspace_bytes >= need, "workspace_bytes (", workspace_bytes,
                   ") is less than the plan check's ", need, " (plan_check_workspace_bytes)");
  MOEBLAZE_REQUIRE(need == 0 || workspace != nullptr, "workspace is NULL (the plan check needs ",
                   need, " bytes)");
  if (need > 0) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(workspace, 0, need, stream));
  const int64_t n = (plan.E + 1) + (plan.T + 1) + 2 * plan.S;
  const int threads = 256;
  const int grid = int(std::clamp<int64_t>((n + threads - 1) / threads, 1, 8192));
  validate_plan_kernel<<<grid, threads, 0, stream>>>(
      plan.expert_token_offsets, plan.expert_token_indices, plan.slot_weights,
      plan.token_pair_offsets, plan.token_expert_indices, plan.token_index_map, plan.T, plan.E,
      plan.S, static_cast<uint32_t*>(workspace), d_flags);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void throw_if_plan_flags(const int32_t* h_flags, const RoutingPlanView& plan) {
  if (h_flags[kFlagBadPlan] == 0) return;
  const HostPlan h = to_host(plan);
  validate_routing_plan(h.view);  // throws InvalidArgument naming the entry and the rule
  throw DeviceError(
      "device-side plan check raised flags[bad_plan] but the host validator found nothing");
}

void validate_plan(const RoutingPlanView& plan, cudaStream_t stream) {
  validate_routing_plan_header(plan);
  Buffer ws(Device::cuda, plan_check_workspace_bytes(plan.S), stream);
  Buffer flags(Device::cuda, sizeof(int32_t) * kPlanFlagCount, stream);  // (kPlanFlagCount,)
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flags.data(), 0, flags.bytes(), stream));
  validate_plan_async(plan, ws.data(), ws.bytes(), flags.as<int32_t>(), stream);
  int32_t h[kPlanFlagCount];
  MOEBLAZE_CUDA_CHECK(
      cudaMemcpyAsync(h, flags.data(), sizeof(h), cudaMemcpyDeviceToHost, stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  throw_if_plan_flags(h, plan);
}

}  // namespace moeblaze::cuda
