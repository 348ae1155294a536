// The TMA path's dispatch (tma_paths.hpp): a chosen kernel's variant to its instantiation, and the
// scratch every variant fits in. Host-only; the instantiations are the *_tma*.cu files.
#include "cuda/gemm/dispatch/tma_paths.hpp"

#include <algorithm>

#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::detail {
namespace {

using ScratchFn = size_t (*)(int, TmaTileOrder);
using RunFn = void (*)(const TmaCall&);
// In kTmaVariants order.
constexpr ScratchFn kDownScratch[] = {down_tma_scratch_bytes<0>, down_tma_scratch_bytes<1>,
                                      down_tma_scratch_bytes<2>, down_tma_scratch_bytes<3>};
constexpr RunFn kDownRun[] = {down_tma_run<0>, down_tma_run<1>, down_tma_run<2>, down_tma_run<3>};
constexpr ScratchFn kDxScratch[] = {dx_tma_scratch_bytes<0>, dx_tma_scratch_bytes<1>,
                                    dx_tma_scratch_bytes<2>, dx_tma_scratch_bytes<3>};
constexpr RunFn kDxRun[] = {dx_tma_run<0>, dx_tma_run<1>, dx_tma_run<2>, dx_tma_run<3>};
static_assert(sizeof(kDownRun) / sizeof(kDownRun[0]) == kTmaVariantCount);

size_t largest(const ScratchFn (&fns)[kTmaVariantCount], int E) {
  const TmaTileOrder o = tma_tile_order();
  size_t bytes = 0;
  for (ScratchFn f : fns) bytes = std::max(bytes, f(E, o));
  return bytes;
}

// k's variant; the overrides and the automatic rule only make built ones (kernel_config.cpp).
// A caller that gives a scratch where the rule chose another family (few rows per expert) gets
// the single-CTA kernel, whose 128-row tiles waste least on short experts.
int variant_of(const char* fn, const GemmKernel& k) {
  if (k.family != KernelFamily::tma_grouped) return 1;
  const int v = tma_variant(k);
  MOEBLAZE_UNSUPPORTED_IF(v < 0, fn, ": no TMA-path kernel is built for ", describe(k));
  return v;
}

}  // namespace

size_t down_proj_tma_scratch_bytes(int E) { return largest(kDownScratch, E); }
size_t dx_proj_tma_scratch_bytes(int E) { return largest(kDxScratch, E); }

void down_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                   const bf16* w2, bf16* y, int64_t d, int64_t n, const GemmKernel& k,
                   GemmScratch scratch, cudaStream_t stream) {
  if (plan.S == 0) return;
  // a (S, n): lda = n; w2 (E, d, n): d * n per expert, ldb = n; y (rows, d): ldd = d.
  kDownRun[variant_of("down_proj", k)]({"down_proj", rows, static_cast<int>(plan.E), a, n, w2,
                                        d * n, n, y, d, static_cast<int>(d), static_cast<int>(n),
                                        scratch, {k.tma_along_n, k.tma_swizzle, k.tma_bands}, stream});
}

void dx_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                 const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, const GemmKernel& k,
                 GemmScratch scratch, cudaStream_t stream) {
  if (plan.S == 0) return;
  // dh (S, w1_rows): lda = w1_rows; w1 (E, w1_rows, d): ldb = d; dx_slots (rows, d): ldd = d.
  kDxRun[variant_of("dx_proj", k)]({"dx_proj", rows, static_cast<int>(plan.E), dh, w1_rows, w1,
                                    w1_rows * d, d, dx_slots, d, static_cast<int>(d),
                                    static_cast<int>(w1_rows), scratch,
                                    {k.tma_along_n, k.tma_swizzle, k.tma_bands}, stream});
}

}  // namespace moeblaze::cuda::gemm::detail
