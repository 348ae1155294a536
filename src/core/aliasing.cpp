#include "core/aliasing.hpp"

#include <cstdint>

#include "moeblaze/error.hpp"

namespace moeblaze {
namespace {

bool overlap(const ByteRange& a, const ByteRange& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.data),
                  b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

}  // namespace

void require_disjoint(const std::vector<ByteRange>& outputs, const std::vector<ByteRange>& inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const ByteRange& in : inputs)
      MOEBLAZE_REQUIRE(!overlap(*out, in), out->name, " overlaps ", in.name,
                       " in memory: an output must not share memory with an input");
    for (auto other = outputs.begin(); other != out; ++other)
      MOEBLAZE_REQUIRE(!overlap(*out, *other), out->name, " overlaps ", other->name,
                       " in memory: outputs must not share memory with each other");
  }
}

}  // namespace moeblaze
