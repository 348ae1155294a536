// FP8 backward's memory plan (cuda::fp8_backward_plan, src/cuda/layer/layer_fp8.cu) checked on the
// host: no GPU needed, so CI's CUDA build runs it. For both FP8 recipes, both modes and a grid of
// shapes (four named configs' among them): every transient sits inside its arena, dead before
// the arena's owner is written; no two buffers whose steps meet share a byte; the plan is a
// deterministic value; and at sm-default with fp8 the workspace is docs/FP8.md's: dH and its codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/fp8.hpp"
#include "core/memory_plan.hpp"
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/config.hpp"

namespace moeblaze::test {
namespace {

struct Shape {
  const char* name;
  int64_t T, d, n, E, K;
};

// Codes then 16-byte aligned fp32 scales, one per 128 codes (layer_fp8.cu's codes_bytes).
size_t codes_bytes(int64_t elems) {
  return (size_t(elems) + 15) / 16 * 16 + size_t(elems / kFp8Group) * sizeof(float);
}

void expect_sound(const MemoryPlan& p) {
  const size_t nb = p.buffers.size();
  ASSERT_EQ(p.at.size(), nb);
  for (size_t i = 0; i < nb; ++i) {
    const BufferSpec& b = p.buffers[i];
    const MemoryPlan::Placement& at = p.at[i];
    SCOPED_TRACE(b.name);
    if (b.bytes == 0) {  // not in this recipe or mode: no place
      EXPECT_EQ(at.arena, -1);
      continue;
    }
    ASSERT_GE(at.arena, 0);
    ASSERT_LT(size_t(at.arena), p.arenas.size());
    const ArenaSpec& a = p.arenas[size_t(at.arena)];
    const bool workspace = size_t(at.arena) + 1 == p.arenas.size();
    EXPECT_EQ(at.offset % a.align, 0u);
    if (workspace) {
      EXPECT_LE(at.offset + b.bytes, p.workspace_bytes);
    } else {
      EXPECT_LT(b.last, a.free_until) << "in " << a.name << " while its owner is written";
      EXPECT_LE(at.offset + b.bytes, a.bytes) << "past the end of " << a.name;
    }
    for (size_t j = i + 1; j < nb; ++j) {
      const BufferSpec& c = p.buffers[j];
      if (p.at[j].arena != at.arena || c.bytes == 0) continue;
      if (b.last < c.first || c.last < b.first) continue;  // never live together
      const size_t o = p.at[j].offset;
      EXPECT_TRUE(at.offset + b.bytes <= o || o + c.bytes <= at.offset)
          << b.name << " and " << c.name << " share bytes while both live";
    }
  }
}

TEST(Fp8BackwardPlan, TransientsFitTheirArenasAndTheWorkspaceHoldsOnlyWhatMust) {
  const Shape shapes[] = {{"sm-default", 32768, 4096, 1024, 128, 8},
                          {"olmoe", 16384, 2048, 1024, 64, 8},
                          {"sm-7B-n256", 24576, 1536, 256, 128, 8},
                          {"mb-conf4", 32768, 2048, 8192, 16, 4},
                          {"small", 300, 256, 128, 6, 2},
                          {"one expert", 1000, 512, 384, 1, 1},
                          {"many experts", 512, 128, 128, 256, 4}};
  for (const Shape& s : shapes) {
    for (const Compute compute : {Compute::fp8, Compute::fp8_wgrad}) {
      for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
        LayerConfig cfg{s.T, s.d, s.n, s.E, s.K, Activation::swiglu, DType::bf16};
        cfg.compute = compute;
        const int64_t S = s.T * s.K, R = cfg.w1_rows();
        SCOPED_TRACE(std::string(s.name) + " " + compute_name(compute) +
                     (mode == LayerMode::keep_h ? " keep_h" : " recompute"));
        const MemoryPlan p = cuda::fp8_backward_plan(cfg, S, mode, false, 0);
        expect_sound(p);
        EXPECT_EQ(p.describe(), cuda::fp8_backward_plan(cfg, S, mode, false, 0).describe());
        if (std::string(s.name) == "sm-default" && compute == Compute::fp8) {
          // docs/FP8.md's 1553 MiB: dH and its codes are all that stays outside the outputs'
          // bytes (dW1's 2 GiB hold dX̃'s slots, A' and the rest), plus the small (S,) arrays.
          const size_t dh_and_codes = size_t(S * R) * 2 + codes_bytes(S * R);
          EXPECT_GE(p.workspace_bytes, dh_and_codes);
          EXPECT_LE(p.workspace_bytes, dh_and_codes + (size_t(2) << 20)) << p.describe();
        }
      }
    }
  }
}

}  // namespace
}  // namespace moeblaze::test
