// Token chunks of the layer's two (S, d) transients: Y (forward, down_proj's output) and dX̃
// (backward, dx_proj's output). With C chunks the GEMM runs over the slots of one run of
// consecutive tokens at a time, into a chunk-sized buffer that is aggregated into those tokens'
// rows of out / dx before the next chunk. Every slot's row is computed by the same kernel with
// the same K order as in the whole step, and every token sums the same rows in the same pair
// order, so the outputs are bitwise those of the unchunked step, for about S/C + E rows of
// workspace instead of S.
//
// Chunk c holds tokens [t_c, t_{c+1}): t_0 = 0, t_C = T, and t_c (0 < c < C) is the first token
// whose pairs start at or after c·B, B = ceil(S / C), so a chunk has fewer than B + E slots (a
// token has at most E pairs). Expert e's slots of chunk c are [lo[c][e], lo[c+1][e]), lo[c][e]
// = its first slot whose token is >= t_c (slots ascend by token inside an expert: the plan's
// contract); they are packed in the chunk buffer from base[c][e] = the chunk's slots of the
// experts before e. Everything is computed on the device from the plan: no host sync.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/gemm/grouped_gemm.hpp"  // ExpertRows
#include "cuda/layer/expert_ranges.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda {

// A pass's chunking, as a value (printed by `moeblaze bench kernels`, compared in tests).
struct TokenChunks {
  int64_t count = 1;      // chunks; 1: the whole step at once (no maps, an (S, d) buffer)
  int64_t rows = 0;       // rows of the chunk buffer: S when count == 1, else ceil(S/count) + E
  const char* rule = "";  // why this count (printed; not part of the value)
  bool operator==(const TokenChunks& o) const { return count == o.count && rows == o.rows; }
  bool operator!=(const TokenChunks& o) const { return !(*this == o); }
  static TokenChunks none(int64_t S, const char* rule = "one chunk") { return {1, S, rule}; }
};
struct LayerChunks {
  TokenChunks forward;   // Y, down_proj's output
  TokenChunks backward;  // dX̃, dx_proj's output
};

// Fewest rows per expert a chunk is cut to by the automatic rule: each expert's range ends in a
// partly filled tile at every chunk edge, a smaller share of its work the longer the range.
constexpr int64_t kChunkMinRowsPerExpert = 512;
// Rows per expert per chunk from which the rule adds chunks as S grows (recompute mode), so the
// dX̃ / Y chunk stays ~2048 E rows instead of S / ceil(d / n) at the largest T; the partial
// tiles at the chunk edges are then a few per cent of each chunk's rows.
constexpr int64_t kChunkRowsPerExpertAtScale = 2048;

// The chunking of S slots over E experts of cfg in `mode`, given the kernels chosen for the shape
// and the `chunks` kernel overrides (KernelOverrides::token_chunks). Total and deterministic for
// S >= 0. Rules: one chunk unless the pass's GEMM runs on the TMA path or the warp-specialised
// kernel (only they take row ranges);
// keep_h, the speed-first mode, runs one chunk (each expert's rows end in a partial tile at every
// chunk edge, which costs time; docs/notes/memory-and-recompute.md); recompute, the
// memory-first mode, runs ceil(d / n) chunks where d >= 2n (a chunk buffer no larger than A's
// (S, n), which the pass holds anyway; below 2n a chunk would save under a third of dX̃'s
// bytes), or S / (kChunkRowsPerExpertAtScale E) where that is more (large T, where memory is
// the limit), fewer where an expert would get under kChunkMinRowsPerExpert rows per chunk; the
// forward takes the same count only
// where its whole-step A (S, n) and Y (S, d) would outgrow what backward holds at its peak anyway
// (H/dH, A' or the dX̃ chunk, dW1 and dW2; with `ranges` on, the expert ranges' range-sized
// pieces, dx's carry and dW1 and dW2): elsewhere forward chunks cost time and save no peak
// bytes. The override replaces the count in either mode (still one chunk on the cp.async kernel).
// ranges: the backward's expert ranges (null: off).
LayerChunks choose_token_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                const gemm::LayerKernels& kernels,
                                const gemm::KernelOverrides::TokenChunkOverride& override,
                                const ExpertRanges* ranges = nullptr);
// With choose_kernels for the shape, the overrides in force and choose_expert_ranges.
LayerChunks choose_token_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode);
// e.g. "4 chunks of <= 65664 rows (ceil(d / n): ...)", "1 chunk (keep_h: ...)".
std::string describe(const TokenChunks& c);

// The device maps of one pass's chunks (pieces of the layer's workspace).
struct ChunkMaps {
  int32_t* token_bounds = nullptr;  // (count + 1,)    t_c
  int32_t* expert_rows = nullptr;   // (count + 1, E)  lo[c][e]
  int32_t* packed_base = nullptr;   // (count, E)      base[c][e]
  int32_t* pair_rows = nullptr;     // (S,) by pair: its slot's row in its chunk's buffer
};

// Fills `maps` from the plan for `chunks` (count > 1) on `stream`: three small kernels.
void build_chunk_maps(const RoutingPlanView& plan, const TokenChunks& chunks,
                      const ChunkMaps& maps, cudaStream_t stream);

// Chunk c's rows for down_proj_rows / dx_proj_rows: expert e's A rows [lo[c][e], lo[c+1][e]),
// written from base[c][e].
inline gemm::ExpertRows chunk_rows(const ChunkMaps& maps, int64_t E, int64_t c) {
  return {maps.expert_rows + c * E, maps.expert_rows + (c + 1) * E, maps.packed_base + c * E};
}

// out[t, :] for the tokens of chunk c = sum over pairs p of t, in pair order, of
// w_p * rows[pair_rows[p], :] (w_p = slot_weights[token_index_map[p]], or 1 when null): the
// unchunked aggregate_rows' sum, read from the chunk buffer rows (chunks.rows, d) bf16.
// out (T, d) bf16; d a multiple of 8, rows and out 16-byte aligned (the GPU layer's shapes).
// b2 (E, d) bf16 or null: as for aggregate_rows (weighted only).
void aggregate_chunk(const RoutingPlanView& plan, const TokenChunks& chunks, const ChunkMaps& maps,
                     int64_t c, const void* rows, const float* slot_weights, void* out, int64_t d,
                     cudaStream_t stream, const void* b2 = nullptr);

}  // namespace moeblaze::cuda
