// MemoryPlan (core/memory_plan.hpp): on random pipelines, no two buffers whose steps meet share a
// byte, every buffer in an output's bytes dies before the output is written and stays inside it,
// offsets keep each arena's alignment, and the plan is a pure function of its inputs; on a small
// pipeline, the placement the first-fit rule gives by hand.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/memory_plan.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {
namespace {

void expect_valid(const MemoryPlan& p) {
  const int workspace = int(p.arenas.size()) - 1;
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    const BufferSpec& b = p.buffers[i];
    if (b.bytes == 0) continue;
    const int a = p.at[i].arena;
    ASSERT_GE(a, 0) << b.name;
    const ArenaSpec& arena = p.arenas[size_t(a)];
    EXPECT_EQ(p.at[i].offset % arena.align, 0u) << b.name;
    if (a < workspace) {
      EXPECT_LT(b.last, arena.free_until) << b.name << " in " << arena.name;
      EXPECT_LE(p.at[i].offset + b.bytes, arena.bytes) << b.name << " in " << arena.name;
    } else {
      EXPECT_LE(p.at[i].offset + b.bytes, p.workspace_bytes) << b.name;
    }
    for (size_t j = 0; j < i; ++j) {
      const BufferSpec& c = p.buffers[j];
      if (c.bytes == 0 || p.at[j].arena != a) continue;
      const bool meet = b.first <= c.last && c.first <= b.last;
      const bool overlap = p.at[i].offset < p.at[j].offset + c.bytes &&
                           p.at[j].offset < p.at[i].offset + b.bytes;
      EXPECT_FALSE(meet && overlap) << b.name << " and " << c.name << " share bytes while live";
    }
  }
}

TEST(MemoryPlan, RandomPipelinesPackWithoutLiveOverlapInsideTheirArenas) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::string> names(40);
  for (size_t i = 0; i < names.size(); ++i) names[i] = "b" + std::to_string(i);
  for (int round = 0; round < 200; ++round) {
    const int steps = 2 + int(rng() % 10);
    std::vector<ArenaSpec> arenas;
    const int outputs = int(rng() % 4);
    for (int a = 0; a < outputs; ++a)
      arenas.push_back(
          {"out", size_t(rng() % 5000), 1 + int(rng() % steps), size_t(16) << (rng() % 3)});
    arenas.push_back({"workspace", 0, steps, 256});
    std::vector<BufferSpec> buffers;
    const size_t count = 1 + rng() % names.size();
    for (size_t i = 0; i < count; ++i) {
      const int first = int(rng() % steps), last = first + int(rng() % (steps - first));
      buffers.push_back({names[i].c_str(), size_t(rng() % 3000), first, last});
    }
    const MemoryPlan p = plan_memory(arenas, buffers);
    expect_valid(p);
    const MemoryPlan again = plan_memory(arenas, buffers);
    ASSERT_EQ(again.workspace_bytes, p.workspace_bytes);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(again.at[i].arena, p.at[i].arena);
      ASSERT_EQ(again.at[i].offset, p.at[i].offset);
    }
    // The workspace alone takes them all too.
    const MemoryPlan alone = plan_memory({arenas.back()}, buffers);
    expect_valid(alone);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(MemoryPlan, FirstFitByHand) {
  // An output of 1200 bytes written at step 3; the workspace.
  const MemoryPlan p = plan_memory({{"dw", 1200, 3, 16}, {"workspace", 0, 4, 256}},
                                   {{"a", 600, 0, 1},     // dw + 0
                                    {"b", 500, 1, 2},     // meets a: dw + 608
                                    {"c", 400, 2, 2},     // meets b: dw + 0 (a is dead)
                                    {"d", 300, 2, 3},     // live when dw is written: workspace
                                    {"e", 700, 3, 3},     // workspace + 512 (after d)
                                    {"f", 100, 0, 0},     // dw + 0 overlaps a: after a, dw + 608
                                    {"z", 0, 0, 3}});     // nothing to place
  EXPECT_EQ(p.address("a", {reinterpret_cast<void*>(4096), nullptr}),
            reinterpret_cast<void*>(4096));
  const std::vector<void*> bases = {reinterpret_cast<void*>(1 << 20),
                                    reinterpret_cast<void*>(2 << 20)};
  auto at = [&](const char* n) {
    return int64_t(reinterpret_cast<uintptr_t>(p.address(n, bases)));
  };
  EXPECT_EQ(at("b"), (1 << 20) + 608);
  EXPECT_EQ(at("c"), (1 << 20) + 0);
  EXPECT_EQ(at("d"), (2 << 20) + 0);
  EXPECT_EQ(at("e"), (2 << 20) + 512);
  EXPECT_EQ(at("f"), (1 << 20) + 608);
  EXPECT_EQ(p.address("z", bases), nullptr);
  EXPECT_EQ(p.workspace_bytes, 1280u);
  EXPECT_NE(p.describe().find("e: 700 bytes, steps 3..3, workspace + 512"), std::string::npos)
      << p.describe();
  EXPECT_THROW(p.address("nope", bases), InvalidArgument);
  EXPECT_THROW(plan_memory({{"w", 0, 1, 256}}, {{"x", 8, 2, 1}}), InvalidArgument);
  EXPECT_THROW(plan_memory({{"w", 0, 1, 24}}, {{"x", 8, 0, 1}}), InvalidArgument);
}

}  // namespace
}  // namespace moeblaze
