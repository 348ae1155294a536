// CUTLASS's persistent group tile scheduler (PersistentTileSchedulerSm90Group) with the CTAs split
// into bands, for the TMA path's pointer-array kernels (kernels/sm90_tma_grouped.cuh).
//
// Why: CUTLASS walks the tiles of all experts in one linear order and CTA c takes tiles c, c + G,
// c + 2G, ... (G CTAs). When an expert has fewer than G tiles, nearly every tile a CTA takes is in
// another expert than its last, and at each change the kernel rewrites its TMA descriptors (A, B,
// D) in global memory and fences them (docs/notes/tma-bands.md).
// How: with B bands, the tile order is cut into B contiguous ranges of equal work, and the
// clusters into B groups of consecutive clusters; group b walks range b with a stride of its own
// cluster count, so a CTA stays in one expert for about B times as many tiles. B = 1 is CUTLASS's
// order exactly. Every tile is still computed whole by one CTA, so the result is bitwise the same
// for every B; only the order of tiles (and the L2 reuse of weights) changes.
// The band count travels in the problem shape (BandedProblemShape), whose own type selects this
// scheduler through CUTLASS's TileSchedulerSelector (bottom of this file).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace moeblaze::cuda::gemm::tma {

// The experts' (M_e, N, K) on the device, as CUTLASS's GroupProblemShape, plus the band count.
struct BandedProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  int32_t bands = 1;  // >= 1; more than the kernel's clusters counts as one band per cluster
};

template <class ProblemShape, int Stages>
class BandScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ProblemShape, Stages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ProblemShape, Stages>;

 public:
  using typename Base::Params;
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  BandScheduler() = default;

  CUTLASS_DEVICE BandScheduler(Params const& p, SchedulerResponse* response) : Base(p, response) {
    // CUTLASS's linear CTA index (its constructor's), whose clusters are runs of `unit` CTAs.
    const bool along_n = p.raster_order_ == Base::RasterOrder::AlongN;
    const uint32_t linear = along_n ? blockIdx.x + blockIdx.y * gridDim.x
                                    : blockIdx.x * gridDim.y + blockIdx.y;
    const uint32_t grid = gridDim.x * gridDim.y * gridDim.z;
    const uint32_t unit = uint32_t(p.cluster_shape_.m() * p.cluster_shape_.n());
    const uint32_t clusters = grid / unit;
    const uint32_t bands = cute::min(uint32_t(cute::max(p.problem_shapes_.bands, 1)), clusters);
    if (bands == 1) {  // CUTLASS's order; its own end test (past the last expert) stops it
      next_ = linear;
      stride_ = grid;
      end_ = UINT32_MAX;
      return;
    }
    const uint64_t tiles = total_cluster_tiles(p, unit);
    const uint32_t cluster = linear / unit;
    const uint32_t band = uint32_t(uint64_t(cluster) * bands / clusters);  // clusters [c0, c1)
    const uint32_t c0 = uint32_t((uint64_t(band) * clusters + bands - 1) / bands);
    const uint32_t c1 = uint32_t((uint64_t(band + 1) * clusters + bands - 1) / bands);
    // Its tiles [t0, t1), in proportion to its clusters; this cluster takes t0 + (cluster - c0),
    // then every (c1 - c0)-th. Linear indices (tile * unit + place in the cluster) fit 32 bits:
    // the problem's tiles are far fewer than 2^32 / unit.
    next_ = uint32_t(tiles * c0 / clusters + (cluster - c0)) * unit + linear % unit;
    stride_ = (c1 - c0) * unit;
    end_ = uint32_t(tiles * c1 / clusters) * unit;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at(next_);
  }

  // Base's, with this scheduler's next tile (the work goes to the consumers through the same
  // shared-memory pipeline).
  template <class SchedulerPipeline, class SchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(SchedulerPipeline& pipeline,
                                           SchedulerPipelineState state,
                                           uint32_t advance_count = 1) {
    next_ += stride_ * advance_count;
    const WorkTileInfo work = work_at(next_);
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  // The tile at linear index l (ascending along a CTA's walk, as Base's search needs).
  CUTLASS_DEVICE WorkTileInfo work_at(uint32_t l) {
    if (l >= end_) return WorkTileInfo::invalid_work_tile();
    return this->get_current_work_for_linear_idx(l);
  }

  // Clusters' worth of tiles over all experts, each expert's grid rounded as Base rounds it (to
  // whole clusters and swizzle groups). One warp-wide sum per warp; called by full warps (the
  // kernel builds its scheduler in every thread before the warps take their roles).
  CUTLASS_DEVICE static uint64_t total_cluster_tiles(Params const& p, uint32_t unit) {
    const int lane = int(threadIdx.x % 32);
    const uint64_t round_m = uint64_t(1 << p.log_swizzle_size_) * p.cluster_shape_.m();
    const uint64_t round_n = uint64_t(1 << p.log_swizzle_size_) * p.cluster_shape_.n();
    uint64_t sum = 0;
    for (int g = lane; g < p.problem_shapes_.groups(); g += 32) {
      const auto s = p.problem_shapes_.get_problem_shape(g);
      const uint64_t m = (uint64_t(cute::get<0>(s)) + p.cta_shape_.m() - 1) / p.cta_shape_.m();
      const uint64_t n = (uint64_t(cute::get<1>(s)) + p.cta_shape_.n() - 1) / p.cta_shape_.n();
      sum += (m + round_m - 1) / round_m * round_m * ((n + round_n - 1) / round_n * round_n);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return sum / unit;
  }

  // Linear indices (CUTLASS's: cluster tile * CTAs per cluster + place in the cluster), 32 bits to
  // leave the producer warps (40 registers each) their room: this CTA's next, its step, the end.
  uint32_t next_ = 0, stride_ = 1, end_ = 0;
};

}  // namespace moeblaze::cuda::gemm::tma

namespace cutlass::gemm::kernel::detail {

// The pointer-array kernels take the scheduler of (GroupScheduler, Sm90, ..., problem shape):
// BandedProblemShape selects BandScheduler (more specialised than CUTLASS's own entry).
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages,
                             moeblaze::cuda::gemm::tma::BandedProblemShape> {
  using Scheduler =
      moeblaze::cuda::gemm::tma::BandScheduler<moeblaze::cuda::gemm::tma::BandedProblemShape,
                                               int(Stages)>;
};

}  // namespace cutlass::gemm::kernel::detail
