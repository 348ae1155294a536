// MemoryPlan: where each transient buffer of a pipeline lives, packed by lifetime into the bytes
// of outputs not yet written (an output is free memory until the step that writes it) and, for
// what does not fit there, into one workspace. The placement is a value: computed on the host
// from sizes and step numbers only (so the workspace size reported before a call and the
// carving at the call are one computation), printable, and testable without a GPU.
//
// Rule (first fit, deterministic): buffers are placed in the order given; each goes to the first
// arena in order where it is dead before the arena's owner is written (last < free_until) and
// where some offset (a multiple of the arena's alignment) keeps it clear of every buffer already
// in that arena whose steps [first, last] meet its own; the lowest such offset wins. The last
// arena is the workspace: unbounded, so every buffer is placed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moeblaze {

struct ArenaSpec {
  const char* name = "";
  size_t bytes = 0;    // usable bytes; ignored for the workspace (the last arena)
  int free_until = 0;  // the step that writes the owner: buffers must have last < free_until
  size_t align = 16;   // offsets are multiples of this (the base must be aligned as much)
};

struct BufferSpec {
  const char* name = "";
  size_t bytes = 0;
  int first = 0, last = 0;  // the pipeline steps that write it first and read it last
};

struct MemoryPlan {
  struct Placement {
    int arena = 0;
    size_t offset = 0;
  };
  std::vector<ArenaSpec> arenas;       // as given; the last is the workspace
  std::vector<BufferSpec> buffers;     // as given
  std::vector<Placement> at;           // (buffers,) where each lives
  size_t workspace_bytes = 0;          // the workspace arena's high-water mark
  // The buffer named `name`'s address given each arena's base (bases[i] for arenas[i]).
  void* address(const char* name, const std::vector<void*>& bases) const;
  std::string describe() const;  // one line per buffer: name, bytes, steps, arena, offset
};

// The plan for `buffers` over `arenas` (at least one: the workspace last). InvalidArgument for a
// buffer with last < first or an alignment that is not a power of two.
MemoryPlan plan_memory(std::vector<ArenaSpec> arenas, std::vector<BufferSpec> buffers);

}  // namespace moeblaze
