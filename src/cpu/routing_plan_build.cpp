// CPU routing-plan builders. Both produce the same plan bit for bit: slots grouped by expert,
// ascending token order inside an expert (the contract of routing_plan.hpp).
//
//  atomic-free (MoEBlaze §4.2, without the paper's dense (T, E) map): tokens are cut into fixed
//    tiles; each tile counts its pairs per expert; one exclusive scan in (expert, tile) order gives
//    every (expert, tile) its first slot; each tile then walks its tokens in order and hands out
//    consecutive slots per expert. Every slot is computed by exactly one tile from integers only,
//    so the plan cannot depend on the thread count or on timing.
//  sort (the MegaBlocks/ScatterMoE way, kept as the baseline): sort the keys (expert, pair index),
//    read the expert segments off the sorted keys, scatter the same arrays.
//
// Both assume a validated routing (build_routing_plan checks it) and a plan allocated with
// (T, E, S = P) on the CPU.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/cpu_backend.hpp"
#include "core/parallel.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze::cpu {
namespace {

// Tokens per tile. A compile-time constant, never derived from the thread count, so the tiling
// (and with it every intermediate) is the same however many threads run. 512 keeps the
// (tiles, E) workspace at 8·E bytes per 1K tokens — well under the plan itself for any K — while
// still giving 8 tiles to share out at T = 4K.
constexpr int64_t kTileTokens = 512;

// Experts handled together in the scan: 16 int32 = one 64-byte line of a workspace row, so the
// expert-major walk down the tiles reads whole cache lines.
constexpr int64_t kScanExperts = 16;

void check_plan_matches(const RoutingView& r, const RoutingPlan& plan, const char* who) {
  MOEBLAZE_REQUIRE(plan.device() == Device::cpu && plan.T() == r.T && plan.E() == r.E &&
                       plan.S() == r.P,
                   who, ": plan (T=", plan.T(), ", E=", plan.E(), ", S=", plan.S(), ", ",
                   device_name(plan.device()), ") does not match the routing (T=", r.T,
                   ", E=", r.E, ", P=", r.P, ", cpu)");
}

}  // namespace

void build_plan_atomic_free(const RoutingView& r, RoutingPlan& plan) {
  check_plan_matches(r, plan, "build_plan_atomic_free");
  const int64_t T = r.T, E = r.E;
  const int64_t tiles = (T + kTileTokens - 1) / kTileTokens;

  const int32_t* pair_offsets = r.pair_offsets;  // (T+1,) int32, CSR over tokens
  const int32_t* pair_experts = r.pair_experts;  // (P,) int32, token-major
  const float* pair_weights = r.pair_weights;    // (P,) fp32, token-major
  int32_t* expert_offsets = plan.expert_token_offsets();  // (E+1,) int32
  int32_t* expert_tokens = plan.expert_token_indices();   // (S,) int32, grouped by expert
  float* slot_weights = plan.slot_weights();              // (S,) fp32, grouped by expert
  int32_t* token_pair_offsets = plan.token_pair_offsets();  // (T+1,) int32
  int32_t* token_experts = plan.token_expert_indices();   // (S,) int32, token-major
  int32_t* token_slots = plan.token_index_map();          // (S,) int32, token-major

  // The only workspace: (tiles, E) int32, tile-major so that each tile owns one contiguous row
  // (no false sharing between tiles counting in parallel). 4·E·ceil(T/512) bytes — O(E·tiles),
  // against the 4·T·E bytes of the paper's dense (T, E) map. It holds, in turn, the tile's
  // per-expert count, the tile's first slot inside each expert, and the tile's running cursor.
  Buffer workspace(Device::cpu, sizeof(int32_t) * static_cast<size_t>(tiles * E));
  int32_t* cursor = workspace.as<int32_t>();  // (tiles, E) int32

  // (1) Per tile, per expert counts. A tile's pairs are one contiguous range of the CSR.
  parallel_for(0, tiles, 1, [&](int64_t tile) {
    int32_t* row = cursor + tile * E;
    std::fill(row, row + E, 0);
    const int64_t t0 = tile * kTileTokens, t1 = std::min(T, t0 + kTileTokens);
    for (int32_t p = pair_offsets[t0]; p < pair_offsets[t1]; ++p) ++row[pair_experts[p]];
  });

  // (2a) Exclusive scan down the tiles of each expert: row[tile][e] becomes the number of pairs
  // of expert e in tiles before `tile`; the expert's total lands in expert_offsets[e + 1].
  const int64_t expert_blocks = (E + kScanExperts - 1) / kScanExperts;
  parallel_for(0, expert_blocks, 1, [&](int64_t block) {
    const int64_t e0 = block * kScanExperts, e1 = std::min(E, e0 + kScanExperts);
    int32_t running[kScanExperts] = {};
    for (int64_t tile = 0; tile < tiles; ++tile) {
      int32_t* row = cursor + tile * E;
      for (int64_t e = e0; e < e1; ++e) {
        const int32_t count = row[e];
        row[e] = running[e - e0];
        running[e - e0] += count;
      }
    }
    for (int64_t e = e0; e < e1; ++e) expert_offsets[e + 1] = running[e - e0];
  });
  // (2b) Exclusive scan over experts: E additions, not worth threads.
  expert_offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) expert_offsets[e + 1] += expert_offsets[e];

  // (3) Each tile walks its tokens in ascending order; the k-th pair of expert e met in the tile
  // takes slot off[e] + (pairs of e in earlier tiles) + k, so slots within an expert ascend by
  // token with no coordination between tiles.
  parallel_for(0, tiles, 1, [&](int64_t tile) {
    int32_t* row = cursor + tile * E;
    const int64_t t0 = tile * kTileTokens, t1 = std::min(T, t0 + kTileTokens);
    for (int64_t t = t0; t < t1; ++t) {
      token_pair_offsets[t] = pair_offsets[t];
      for (int32_t p = pair_offsets[t]; p < pair_offsets[t + 1]; ++p) {
        const int32_t e = pair_experts[p];
        const int32_t slot = expert_offsets[e] + row[e]++;
        expert_tokens[slot] = static_cast<int32_t>(t);
        slot_weights[slot] = pair_weights[p];
        token_experts[p] = e;
        token_slots[p] = slot;
      }
    }
  });
  token_pair_offsets[T] = pair_offsets[T];
}

void build_plan_sort(const RoutingView& r, RoutingPlan& plan) {
  check_plan_matches(r, plan, "build_plan_sort");
  const int64_t T = r.T, E = r.E, P = r.P;

  const int32_t* pair_offsets = r.pair_offsets;  // (T+1,) int32, CSR over tokens
  const int32_t* pair_experts = r.pair_experts;  // (P,) int32, token-major
  const float* pair_weights = r.pair_weights;    // (P,) fp32, token-major
  int32_t* expert_offsets = plan.expert_token_offsets();  // (E+1,) int32
  int32_t* expert_tokens = plan.expert_token_indices();   // (S,) int32, grouped by expert
  float* slot_weights = plan.slot_weights();              // (S,) fp32, grouped by expert
  int32_t* token_pair_offsets = plan.token_pair_offsets();  // (T+1,) int32
  int32_t* token_experts = plan.token_expert_indices();   // (S,) int32, token-major
  int32_t* token_slots = plan.token_index_map();          // (S,) int32, token-major

  // Workspace 12·P bytes: the sort keys and the token of each pair (a sort only sees pairs; the
  // token of a pair has to be looked up afterwards).
  Buffer keys_buf(Device::cpu, sizeof(uint64_t) * static_cast<size_t>(P));
  Buffer pair_token_buf(Device::cpu, sizeof(int32_t) * static_cast<size_t>(P));
  uint64_t* keys = keys_buf.as<uint64_t>();            // (P,) uint64, expert << 32 | pair
  int32_t* pair_token = pair_token_buf.as<int32_t>();  // (P,) int32, token of each pair

  constexpr int64_t kGrain = 1024;  // tokens per parallel chunk
  parallel_for(0, T, kGrain, [&](int64_t t) {
    token_pair_offsets[t] = pair_offsets[t];
    for (int32_t p = pair_offsets[t]; p < pair_offsets[t + 1]; ++p) {
      keys[p] = (static_cast<uint64_t>(pair_experts[p]) << 32) | static_cast<uint32_t>(p);
      pair_token[p] = static_cast<int32_t>(t);
      token_experts[p] = pair_experts[p];
    }
  });
  token_pair_offsets[T] = pair_offsets[T];

  // Keys are unique, so the sorted order is unique: the same as a stable sort of pairs by
  // expert, and independent of the sort's algorithm and thread count.
  std::sort(keys, keys + P);

  // Expert e's segment starts at its first key: E+1 binary searches over the sorted keys.
  parallel_for(0, E + 1, 64, [&](int64_t e) {
    const uint64_t first = static_cast<uint64_t>(e) << 32;
    expert_offsets[e] = static_cast<int32_t>(std::lower_bound(keys, keys + P, first) - keys);
  });

  parallel_for(0, P, 4096, [&](int64_t slot) {
    const int32_t p = static_cast<int32_t>(keys[slot] & 0xffffffffu);
    expert_tokens[slot] = pair_token[p];
    slot_weights[slot] = pair_weights[p];
    token_slots[p] = static_cast<int32_t>(slot);
  });
}

}  // namespace moeblaze::cpu
