// MemoryPlan's first-fit packing (memory_plan.hpp states the rule).
#include "core/memory_plan.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "moeblaze/error.hpp"

namespace moeblaze {
namespace {

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

bool meet(const BufferSpec& a, const BufferSpec& b) {
  return a.first <= b.last && b.first <= a.last;
}

}  // namespace

MemoryPlan plan_memory(std::vector<ArenaSpec> arenas, std::vector<BufferSpec> buffers) {
  MOEBLAZE_REQUIRE(!arenas.empty(), "plan_memory: at least one arena (the workspace) is needed");
  for (const ArenaSpec& a : arenas)
    MOEBLAZE_REQUIRE(a.align > 0 && (a.align & (a.align - 1)) == 0, "plan_memory: arena ", a.name,
                     "'s alignment (", a.align, ") must be a power of two");
  for (const BufferSpec& b : buffers)
    MOEBLAZE_REQUIRE(b.first <= b.last, "plan_memory: buffer ", b.name, " has last step (",
                     b.last, ") before its first (", b.first, ")");
  MemoryPlan plan;
  plan.arenas = std::move(arenas);
  plan.buffers = std::move(buffers);
  plan.at.assign(plan.buffers.size(), {});
  const int workspace = int(plan.arenas.size()) - 1;
  std::vector<std::vector<size_t>> in(plan.arenas.size());  // (arenas,) indices placed there
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const BufferSpec& b = plan.buffers[i];
    if (b.bytes == 0) {
      plan.at[i] = {-1, 0};  // nothing to place
      continue;
    }
    for (int a = 0; a <= workspace; ++a) {
      const ArenaSpec& arena = plan.arenas[size_t(a)];
      if (a < workspace && (b.last >= arena.free_until || b.bytes > arena.bytes)) continue;
      // Candidate offsets: 0 and the aligned end of each buffer whose lifetime meets b's.
      std::vector<size_t> cand = {0};
      for (size_t j : in[size_t(a)])
        if (meet(b, plan.buffers[j]))
          cand.push_back(round_up(plan.at[j].offset + plan.buffers[j].bytes, arena.align));
      std::sort(cand.begin(), cand.end());
      bool placed = false;
      for (size_t off : cand) {
        if (a < workspace && off + b.bytes > arena.bytes) break;
        bool clear = true;
        for (size_t j : in[size_t(a)]) {
          const size_t o = plan.at[j].offset, e = o + plan.buffers[j].bytes;
          if (meet(b, plan.buffers[j]) && off < e && o < off + b.bytes) {
            clear = false;
            break;
          }
        }
        if (clear) {
          plan.at[i] = {a, off};
          placed = true;
          break;
        }
      }
      if (placed) {
        in[size_t(a)].push_back(i);
        if (a == workspace)
          plan.workspace_bytes =
              std::max(plan.workspace_bytes, round_up(plan.at[i].offset + b.bytes, arena.align));
        break;
      }
    }
  }
  return plan;
}

void* MemoryPlan::address(const char* name, const std::vector<void*>& bases) const {
  MOEBLAZE_REQUIRE(bases.size() == arenas.size(), "MemoryPlan::address: ", bases.size(),
                   " bases for ", arenas.size(), " arenas");
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (std::strcmp(buffers[i].name, name) != 0) continue;
    if (at[i].arena < 0) return nullptr;
    char* base = static_cast<char*>(bases[size_t(at[i].arena)]);
    return base ? base + at[i].offset : nullptr;
  }
  MOEBLAZE_REQUIRE(false, "MemoryPlan::address: no buffer named ", name);
  return nullptr;
}

std::string MemoryPlan::describe() const {
  std::ostringstream s;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const BufferSpec& b = buffers[i];
    s << b.name << ": " << b.bytes << " bytes, steps " << b.first << ".." << b.last << ", ";
    if (at[i].arena < 0)
      s << "none\n";
    else
      s << arenas[size_t(at[i].arena)].name << " + " << at[i].offset << "\n";
  }
  s << "workspace: " << workspace_bytes << " bytes\n";
  return s.str();
}

}  // namespace moeblaze
