// (4) dH with the activation backward, the gate-weight gradient and A' fused into the epilogue —
// varlen-M, A = d_out gathered through expert_token_indices, B = w2 read N-major (the reduction
// runs over d, w2's row index). The accumulators are da' = W2_eᵀ do (fp32); the epilogue reads
// the H tile of the same rows and columns, recomputes a, and writes dh, s·a and one ds partial
// per (slot, 128-column tile). Also the fixed-order reduction of those partials. One GEMM
// instantiation: varlen_m_kernel<N-major B, DhEpilogue>.
#include "cuda/gemm/epilogues/dh_epilogue.cuh"
#include "cuda/gemm/dispatch/gemm_checks.hpp"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_varlen_m.cuh"
#include "cuda/gemm/dispatch/ws_paths.hpp"
#include "cuda/pdl.cuh"

namespace moeblaze::cuda::gemm {
namespace sm90 {

struct DhEpilogue {
  // Loads two tiles ahead (waits for each step's WGMMAs): dH gains from the deeper look-ahead
  // more than it loses in WGMMA overlap (docs/notes/gathered-gemms.md).
  static constexpr int kMmaInFlight = 0;
  using Params = DhParams;
  // This thread's H values (gate g, up u; plain: h in g) and slot weights. With kPrefetch they
  // are loaded before the mainloop (64 registers live across it; the load latency hides behind
  // the MMAs); without, row by row in the epilogue, each row's 32 loads issued back to back
  // (two round trips per tile, which the other CTA on the SM covers when two are resident, and
  // no spills under the 128-register cap of two CTAs per SM).
  static constexpr bool kPrefetch = MOEBLAZE_GEMM_DH_PREFETCH;
  struct RowH {  // one accumulator row (v1) of this thread: 16 column pairs
    __nv_bfloat162 g[kFragColGroups];
    __nv_bfloat162 u[kFragColGroups];
    float s;
  };
  struct Prefetched {
    RowH row[2];
  };
  // Row v1's H: one 16-byte load per lane, quad and array (the quad's four lanes read a row's 64
  // contiguous bytes), then a quad transpose (quad_transpose.cuh) hands each lane its fragment's
  // words. Every lane of the warp runs it (the shuffles); rows past the expert's end and columns
  // past n read zeros.
  __device__ static void load_row(const Params& p, RowH& r, int v1, int m_begin, int m_end,
                                  int n_tile) {
    const int64_t w1_rows = p.gated ? 2 * int64_t(p.n) : p.n;
    const int n0 = n_tile * kBN;
    const int q = threadIdx.x & 3;
    const int slot = m_begin + frag_row(v1);
    const bool row_ok = slot < m_end;
    r.s = row_ok ? __ldg(p.slot_weights + slot) : 0.0f;
    const __nv_bfloat16* h_row = p.h + int64_t(row_ok ? slot : 0) * w1_rows;
    uint4 gv[kFragColGroups / 4], uv[kFragColGroups / 4];
#pragma unroll
    for (int t = 0; t < kFragColGroups / 4; ++t) {
      const int jv = n0 + 8 * (4 * t + q);  // n is a multiple of 64: groups never straddle it
      const bool ok = row_ok && jv < p.n;
      gv[t] = ok ? __ldg(reinterpret_cast<const uint4*>(h_row + jv)) : make_uint4(0, 0, 0, 0);
      uv[t] = ok && p.gated ? __ldg(reinterpret_cast<const uint4*>(h_row + p.n + jv))
                            : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int t = 0; t < kFragColGroups / 4; ++t) {
      uint32_t g[4] = {gv[t].x, gv[t].y, gv[t].z, gv[t].w};
      uint32_t u[4] = {uv[t].x, uv[t].y, uv[t].z, uv[t].w};
      quad_transpose(g);
      quad_transpose(u);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        r.g[4 * t + k] = *reinterpret_cast<const __nv_bfloat162*>(&g[k]);
        r.u[4 * t + k] = *reinterpret_cast<const __nv_bfloat162*>(&u[k]);
      }
    }
  }
  __device__ static void prefetch(const Params& p, Prefetched& pre, int m_begin, int m_end,
                                  int n_tile) {
    if constexpr (kPrefetch) {
      load_row(p, pre.row[0], 0, m_begin, m_end, n_tile);
      load_row(p, pre.row[1], 1, m_begin, m_end, n_tile);
    }
  }

  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, const Prefetched& pre, int m_begin,
                               int m_end, int n_tile, int /*expert*/) {
    dispatch(p, acc, pre, m_begin, m_end, n_tile);
  }

  // One straight-line epilogue body per activation: the switch runs once per tile, not per
  // element.
  template <class Acc>
  __device__ static void dispatch(const Params& p, Acc& acc, const Prefetched& pre, int m_begin,
                                  int m_end, int n_tile) {
    dispatch_activation(p.act, [&](auto a) {
      body<decltype(a)::value>(p, acc, pre, m_begin, m_end, n_tile);
    });
  }

  // Outputs go back the way H came: per quad of column groups the lanes' words are transposed
  // so that each lane stores one 16-byte group of dh (and of dh's up half) and of s·a.
  template <Activation A, class Acc>
  __device__ static void body(const Params& p, Acc& acc, const Prefetched& pre, int m_begin,
                              int m_end, int n_tile) {
    constexpr bool kGated = dev_is_gated(A);
    const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
    const int n0 = n_tile * kBN;
    const int q = threadIdx.x & 3;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int slot = m_begin + frag_row(v1);
      const bool row_ok = slot < m_end;
      float part = 0.0f;  // this thread's share of sum_j da'_j a_j over the tile's columns
      RowH loaded;
      if constexpr (!kPrefetch) load_row(p, loaded, v1, m_begin, m_end, n_tile);
      const RowH& rh = kPrefetch ? pre.row[v1] : loaded;
      const float s = rh.s;
      const int64_t row = row_ok ? slot : 0;
      __nv_bfloat16* dh_row = p.dh + row * w1_rows;
      __nv_bfloat16* as_row = p.a_scaled + row * p.n;
#pragma unroll
      for (int t = 0; t < kFragColGroups / 4; ++t) {
        uint32_t dg[4], du[4], as[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * t + k;
          // The partial takes columns < n of real rows, in column order: add into a copy.
          float pk = part;
          dh_pair_words<A>(acc(4 * i + 2 * v1), acc(4 * i + 2 * v1 + 1), s, rh.g[i], rh.u[i],
                           dg[k], du[k], as[k], pk);
          if (row_ok && n0 + frag_col(i) < p.n) part = pk;
        }
        quad_transpose(dg);
        quad_transpose(as);
        if constexpr (kGated) quad_transpose(du);
        const int jv = n0 + 8 * (4 * t + q);
        if (row_ok && jv < p.n) {
          *reinterpret_cast<uint4*>(dh_row + jv) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
          if constexpr (kGated)
            *reinterpret_cast<uint4*>(dh_row + p.n + jv) = make_uint4(du[0], du[1], du[2], du[3]);
          *reinterpret_cast<uint4*>(as_row + jv) = make_uint4(as[0], as[1], as[2], as[3]);
        }
      }
      // The 4 lanes sharing a row hold its 128 columns; a fixed butterfly keeps the order fixed.
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      if (row_ok && q == 0) p.ds_partials[int64_t(slot) * p.ds_cols + n_tile] = part;
    }
  }
};

// ds[r] = sum_j ds_partials[r, j], j ascending.
__global__ void reduce_ds_kernel(const float* __restrict__ partials, float* __restrict__ ds,
                                 int64_t S, int cols) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= S) return;
  const float* row = partials + r * cols;
  float acc = 0.0f;
  for (int j = 0; j < cols; ++j) acc += row[j];
  ds[r] = acc;
}

}  // namespace sm90

void dh_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
             float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n, Activation act,
             cudaStream_t stream, GatherKernel kernel, const LayerKernels* kernels) {
  constexpr const char* fn = "dh_proj";
  detail::check_plan(fn, plan, /*gathers=*/true, /*weights=*/true);
  detail::check_dims(fn, d, n);
  detail::check_gpu_activation(fn, act, plan.E);
  const bool need = plan.S > 0;
  detail::check_ptr(fn, d_out, "d_out", need);
  detail::check_ptr(fn, w2, "w2", need);
  detail::check_ptr(fn, h, "h", need);
  detail::check_ptr(fn, ds_partials, "ds_partials", need);
  detail::check_ptr(fn, dh, "dh", need);
  detail::check_ptr(fn, a_scaled, "a_scaled", need);
  using detail::GatherPath;
  const bool oai = act == Activation::swiglu_oai;
  const GemmKernel chosen =
      (kernels ? *kernels : choose_kernels({plan.S, plan.E, d, n, act})).dh;
  const GatherPath path =
      detail::resolve_gather_path(fn, kernel, plan.E, chosen, /*has_ping_pong=*/true);
  if (oai) {
    MOEBLAZE_UNSUPPORTED_IF(path != GatherPath::cooperative, fn, ": swiglu_oai runs on its own "
                            "warp-specialised cooperative kernel only (GatherKernel automatic or "
                            "warp_specialized)");
    return detail::dh_proj_oai(plan, d_out, w2, h, ds_partials, dh, a_scaled, d, n, stream);
  }
  const bool swiglu = act == Activation::swiglu;  // its own kernels (no activation switch)
  // Clusters of 2 (dh.cluster=2) where the chosen kernel is this one: an explicit GatherKernel
  // names a schedule, not a cluster, and keeps single CTAs.
  const bool cluster = kernel == GatherKernel::automatic && chosen.cluster == 2;
  if (path == GatherPath::cooperative && swiglu && plan.E <= kWsDhSwigluCoopMaxExperts)
    return (cluster ? detail::dh_proj_swiglu_mc : detail::dh_proj_swiglu_ws)(
        plan, d_out, w2, h, ds_partials, dh, a_scaled, d, n, stream);
  if (path == GatherPath::ping_pong && swiglu)
    return detail::dh_proj_swiglu_pp(plan, d_out, w2, h, ds_partials, dh, a_scaled, d, n, stream);
  if (path == GatherPath::cooperative)
    return detail::dh_proj_ws(plan, d_out, w2, h, ds_partials, dh, a_scaled, d, n, act, stream);
  if (path == GatherPath::ping_pong)
    return detail::dh_proj_pp(plan, d_out, w2, h, ds_partials, dh, a_scaled, d, n, act, stream);

  sm90::VarlenMArgs p{};
  p.a = reinterpret_cast<const __nv_bfloat16*>(d_out);  // (T, d), rows gathered per slot
  p.lda = d;
  p.a_gather = plan.expert_token_indices;
  p.b = reinterpret_cast<const __nv_bfloat16*>(w2);  // (E, d, n): K = d rows of N = n
  p.b_expert_stride = d * n;
  p.ldb = n;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(d);
  p.N = static_cast<int>(n);
  p.n_tiles = static_cast<int>(ds_partials_cols(n));
  p.gate_split = 0;
  const sm90::DhParams ep =
      sm90::make_dh_params(plan, h, ds_partials, ds_partials_cols(n), dh, a_scaled, n, act);
  sm90::launch_varlen_m<sm90::GMajor::MN, sm90::DhEpilogue>(p, ep, plan.S, sm90::raster_group(),
                                                            stream);
}

void reduce_ds(const float* ds_partials, float* ds, int64_t S, int64_t n, cudaStream_t stream) {
  constexpr const char* fn = "reduce_ds";
  MOEBLAZE_REQUIRE(S >= 0, fn, ": S (", S, ") must not be negative");
  MOEBLAZE_REQUIRE(n > 0, fn, ": n (", n, ") must be positive");
  detail::check_ptr(fn, ds_partials, "ds_partials", S > 0);
  detail::check_ptr(fn, ds, "ds", S > 0);
  if (S == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (S + kBlock - 1) / kBlock;
  launch_kernel(&sm90::reduce_ds_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kBlock), 0,
                stream, 1, ds_partials, ds, S, static_cast<int>(ds_partials_cols(n)));
}

}  // namespace moeblaze::cuda::gemm
