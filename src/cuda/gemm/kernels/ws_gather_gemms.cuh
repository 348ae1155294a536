// The two gathered GEMMs with fused epilogues on the warp-specialised kernel
// (sm90_ws_gather.cuh), for either schedule (Cooperative: 128 x 256 tiles shared by the two
// consumer warpgroups; PingPong: 128 x 128 tiles, one per warpgroup):
//   (1) up-projection: A = x gathered through expert_token_indices, B = w1 K-major by TMA, the
//       activation fused into the epilogue (act_epilogue.cuh). For gated activations a tile's
//       B rows are kTileN / 2 gate rows j and the kTileN / 2 up rows n + j of the same j
//       (Args::gate_split), so each consumer thread holds g and u of the same column j.
//   (4) dH: A = d_out gathered, B = w2 by TMA (N-major: the 2D view (E * d, n), boxes of 64
//       n-columns x 64 d-rows). The epilogue reads the tile's H (asked into L2 before the
//       mainloop), recomputes a, writes dh and s·a and one ds partial per (slot, 128 columns),
//       the columns the 2-CTA kernel gives each partial (so reduce_ds and ds_partials_cols are
//       shared).
// and the two contiguous-A GEMMs on the same kernel with A by TMA (kTmaA: slot r reads A's row r)
// and a plain store (store_epilogue.cuh): one descriptor per operand for all experts (the TMA
// path's CUTLASS pointer-array kernel rewrites its descriptors at each expert change):
//   (2) down-projection: A = a (S, n), B = w2 K-major (w2_e (d, n): N = d rows of K = n);
//   (6) dX̃: A = dh (S, w1_rows), B = w1 N-major (w1_e (w1_rows, d): K rows of N = d).
// Each .cu file that includes this instantiates one (GEMM, schedule) pair (up_proj_ws.cu,
// up_proj_pp.cu, up_proj_mc.cu, up_proj_oai.cu, dh_proj_ws.cu, dh_proj_pp.cu, dh_proj_swiglu_ws.cu,
// dh_proj_swiglu_pp.cu, dh_proj_swiglu_mc.cu, dh_proj_oai.cu, down_proj_ws.cu, down_proj_pp.cu, dx_proj_ws.cu,
// dx_proj_pp.cu).
#pragma once

#include "cuda/gemm/epilogues/act_epilogue.cuh"
#include "cuda/gemm/epilogues/dh_epilogue.cuh"
#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/epilogues/store_epilogue.cuh"
#include "cuda/gemm/grouped_gemm.hpp"  // ExpertRows
#include "cuda/gemm/kernels/sm90_ws_gather.cuh"

namespace moeblaze::cuda::gemm::sm90::ws {

// The up-projection's epilogue (act_epilogue.cuh) on fragment policy Frag. kOai: compiled for
// swiglu_oai alone (its own kernel: in the shared activation switch it raised the other
// activations' registers and spills; cuda/activation.cuh).
template <class Frag, bool kOai = false>
struct GatherActEpilogue {
  using Params = ActParams;
  static constexpr int kSmemBytes = 0;
  __device__ static void at_tile_start(const Params&, int, int, int, char*) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile,
                               int expert, char*) {
    if constexpr (kOai)
      act_epilogue_body<Activation::swiglu_oai, Frag>(p, acc, m_begin, m_end, n_tile, expert);
    else
      act_epilogue<Frag>(p, acc, m_begin, m_end, n_tile, expert);
  }
};

// The plain store (store_epilogue.cuh) on fragment policy Frag.
template <class Frag>
struct GatherStoreEpilogue {
  using Params = StoreParams;
  static constexpr int kSmemBytes = 0;
  __device__ static void at_tile_start(const Params&, int, int, int, char*) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile,
                               int /*expert*/, char*) {
    store_epilogue<Frag>(p, acc, m_begin, m_end, n_tile);
  }
};

// The activations a dH kernel is compiled for: kAnyActivation, the shared switch over the
// non-oai activations, or one Activation's value (its own kernel: in the switch the dH epilogue
// spilled 8 bytes per thread on both schedules, ptxas -v; swiglu alone and swiglu_oai alone
// do not).
inline constexpr int kAnyActivation = -1;

// The dH epilogue (dh_epilogue.cuh's dh_pair_words per column pair) on fragment policy Frag, for
// the activations kActs names. kStageH (the cooperative swiglu kernel): H reaches the epilogue
// through shared memory (body_staged), else by global loads (body).
template <class Frag, int kActs = kAnyActivation, bool kStageH = false>
struct GatherDhEpilogue {
  using Params = DhParams;
  static constexpr int kPartials = Frag::kTileN / 128;  // ds partials per tile row
  static constexpr int kPartialGroups = 128 / 8;         // column groups of one partial
  static constexpr int kQuads = kPartialGroups / 4;      // quads of column groups per partial
  // Staged H: a subtile is one (partial, quad, row r) of every consumer thread, i.e. its 16 bytes
  // of g and 16 of u; kStageBufs buffers of kConsumerThreads x 32 bytes, each thread reading only
  // what its own cp.async wrote (so no barrier); subtiles s + 1 and s + 2 are in flight while s is
  // computed. Thread t's 16 bytes of g (u) in buffer b: b * kStageBufBytes + (0 or 4096) + 16 t.
  static constexpr int kSubtiles = kPartials * kQuads * Frag::kRows;
  static constexpr int kStageBufs = 3;
  static constexpr int kStageBufBytes = kConsumerThreads * 32;
  static constexpr int kSmemBytes = kStageH ? kStageBufs * kStageBufBytes : 0;
  static_assert(!kStageH || kConsumerThreads * 16 == 4096, "a buffer's g half is 4 KiB");

  // Subtile sb's order: partial (half), quad pair, row r, quad in the pair. The two quads of a
  // pair are one 128-byte line of g (and of u) of row r, so they are consecutive subtiles and
  // body_staged can wait for both before it stores into the line (dh may be written over h).
  // The ds partial of a (row, partial) still adds its quads in ascending order, as body does.
  static_assert(kQuads % 2 == 0, "quads go in pairs (one 128-byte line)");
  __device__ static void subtile_coords(int sb, int& half, int& t, int& r) {
    r = (sb / 2) % Frag::kRows;
    t = 2 * ((sb / (2 * Frag::kRows)) % (kQuads / 2)) + sb % 2;
    half = sb / (Frag::kRows * kQuads);
  }

  // This thread's cp.async of subtile sb's g and u into buffer sb % kStageBufs (zeros past the
  // expert's rows and past n); one commit group per subtile, empty past the last.
  __device__ static void stage_subtile(const Params& p, char* smem, int m_begin, int m_end,
                                       int n_tile, int sb) {
    if (sb < kSubtiles) {
      int half, t, r;
      subtile_coords(sb, half, t, r);
      const int slot = m_begin + Frag::row(r);
      const int jv = n_tile * Frag::kTileN + 8 * (half * kPartialGroups + 4 * t + (threadIdx.x & 3));
      const bool ok = slot < m_end && jv < p.n;
      const __nv_bfloat16* src = p.h + (ok ? int64_t(slot) * 2 * p.n + jv : 0);
      const uint32_t dst = smem_u32(smem) + (sb % kStageBufs) * kStageBufBytes +
                           16 * (threadIdx.x - kProducerThreads);
      cp_async_16(dst, src, ok);
      cp_async_16(dst + 4096, ok ? src + p.n : p.h, ok);
    }
    cp_async_commit();
  }

  // The H lines this tile's epilogue reads, into L2 while the mainloop runs: a tile row needs
  // kTileN / 64 128-byte lines of g (and as many of u); the 4 lanes that share a row split them.
  // kStageH: the first two subtiles go to shared memory now (body_staged waits for them).
  __device__ static void at_tile_start(const Params& p, int m_begin, int m_end, int n_tile,
                                       char* smem) {
    constexpr int kLines = Frag::kTileN / 64;
    const int64_t w1_rows = p.gated ? 2 * int64_t(p.n) : p.n;
    for (int l = threadIdx.x & 3; l < (p.gated ? 2 : 1) * kLines; l += 4) {
      const int j = n_tile * Frag::kTileN + 64 * (l % kLines);
      if (j >= p.n) continue;
      const int64_t col = (l / kLines) * int64_t(p.n) + j;  // g, then u
#pragma unroll
      for (int r = 0; r < Frag::kRows; ++r) {
        const int slot = m_begin + Frag::row(r);
        if (slot < m_end)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p.h + int64_t(slot) * w1_rows + col));
      }
    }
    if constexpr (kStageH) {
      stage_subtile(p, smem, m_begin, m_end, n_tile, 0);
      stage_subtile(p, smem, m_begin, m_end, n_tile, 1);
    }
  }

  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile,
                               int /*expert*/, char* smem) {
    static_assert(!kStageH || (kActs == static_cast<int>(Activation::swiglu) && kPartials == 2),
                  "staged H: the cooperative swiglu kernel (gated rows of 2n)");
    if constexpr (kStageH)
      body_staged<Activation::swiglu>(p, acc, m_begin, m_end, n_tile, smem);
    else if constexpr (kActs != kAnyActivation)
      body<static_cast<Activation>(kActs)>(p, acc, m_begin, m_end, n_tile);
    else
      dispatch_activation(
          p.act, [&](auto a) { body<decltype(a)::value>(p, acc, m_begin, m_end, n_tile); });
  }

  // body with H from the shared-memory subtiles (stage_subtile): the same arithmetic, stores and
  // ds partials in the same order per (row, partial), so the same bits; the loop runs partial,
  // quad, row, so each of a thread's rows keeps its partial sum in part[r].
  template <Activation A, class Acc>
  __device__ static void body_staged(const Params& p, Acc& acc, int m_begin, int m_end,
                                     int n_tile, char* smem) {
    const int64_t w1_rows = 2 * int64_t(p.n);
    const int n0 = n_tile * Frag::kTileN;
    const int q = threadIdx.x & 3;
    const uint32_t base = smem_u32(smem) + 16 * (threadIdx.x - kProducerThreads);
    float part[Frag::kRows];  // this lane's share of sum_j da'_j a_j, per row, this partial
#pragma unroll
    for (int sb = 0; sb < kSubtiles; ++sb) {
      int half, t, r;
      subtile_coords(sb, half, t, r);
      if (t == 0) part[r] = 0.0f;
      // A line's first half: both halves have landed (no copy left in flight from a line this
      // thread is about to store into); its second half: sb's copies have landed.
      if (sb % 2 == 0)
        cp_async_wait<0>();
      else
        cp_async_wait<1>();
      uint4 gv, uv;
      const uint32_t buf = base + (sb % kStageBufs) * kStageBufBytes;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(gv.x), "=r"(gv.y), "=r"(gv.z), "=r"(gv.w) : "r"(buf) : "memory");
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(uv.x), "=r"(uv.y), "=r"(uv.z), "=r"(uv.w) : "r"(buf + 4096) : "memory");
      // Subtile sb + 2 goes to the buffer subtile sb - 1 used, which this thread has read.
      stage_subtile(p, smem, m_begin, m_end, n_tile, sb + 2);
      const int slot = m_begin + Frag::row(r);
      const bool row_ok = slot < m_end;
      const float s = row_ok ? __ldg(p.slot_weights + slot) : 0.0f;
      const int64_t row = row_ok ? slot : 0;
      const int i0 = half * kPartialGroups + 4 * t;
      const int jv = n0 + 8 * (i0 + q);  // this lane's group, as in body
      const bool v_ok = row_ok && jv < p.n;
      uint32_t lo[4], hi[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int idx = Frag::acc_index(r, i0 + k);
        lo[k] = __float_as_uint(acc(idx));
        hi[k] = __float_as_uint(acc(idx + 1));
      }
      quad_transpose(lo);
      quad_transpose(hi);
      const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w};
      const uint32_t u[4] = {uv.x, uv.y, uv.z, uv.w};
      uint32_t dg[4], du[4], as[4];
      float pk = part[r];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        dh_pair_words<A, true>(__uint_as_float(lo[k]), __uint_as_float(hi[k]), s,
                               *reinterpret_cast<const __nv_bfloat162*>(&g[k]),
                               *reinterpret_cast<const __nv_bfloat162*>(&u[k]), dg[k], du[k],
                               as[k], pk);
      if (v_ok) {
        part[r] = pk;
        __nv_bfloat16* dh_row = p.dh + row * w1_rows;
        *reinterpret_cast<uint4*>(dh_row + jv) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
        *reinterpret_cast<uint4*>(dh_row + p.n + jv) = make_uint4(du[0], du[1], du[2], du[3]);
        *reinterpret_cast<uint4*>(p.a_scaled + row * p.n + jv) = make_uint4(as[0], as[1], as[2], as[3]);
      }
      if (t == kQuads - 1) {  // the partial's last quad: the butterfly of body
        float pr = part[r];
        pr += __shfl_xor_sync(0xffffffffu, pr, 1);
        pr += __shfl_xor_sync(0xffffffffu, pr, 2);
        const int col = kPartials * n_tile + half;
        if (row_ok && col < p.ds_cols && q == 0) p.ds_partials[int64_t(slot) * p.ds_cols + col] = pr;
      }
    }
  }

  // Column groups go in quads (32 columns) and the arithmetic runs in group order: each lane
  // loads the 16 bytes of one group of g (and of u) with one vector load, and gets that group's
  // 8 accumulators (da') from the quad's four lanes by two quad transposes (quad_transpose.cuh)
  // of the fragment's words (the low and the high column of each pair), so that dh (g and u)
  // and a_scaled come out as whole groups, one 16-byte store per lane and array, with no
  // transpose back. (Transposing H in and the three outputs back instead took five transposes
  // per quad and row and left the epilogue instruction-bound; see
  // docs/notes/dh-epilogue.md.) A row's 64 bytes
  // per quad thus cost two 32-byte sector requests per array. Rows past the expert's end and columns
  // past n compute on zeros and store nothing: the shuffles need every lane. Each lane adds its
  // groups' columns to its ds partial in column order, quads in ascending order, and the quad's
  // four lane sums are added by a fixed butterfly: a fixed order, so the result is
  // deterministic (it is not the 2-CTA kernel's order, so the partials may differ from that
  // kernel's in the last bits).
  template <Activation A, class Acc>
  __device__ static void body(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    constexpr bool kGated = dev_is_gated(A);
    const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
    const int n0 = n_tile * Frag::kTileN;
    const int q = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
      const int slot = m_begin + Frag::row(r);
      const bool row_ok = slot < m_end;
      const float s = row_ok ? __ldg(p.slot_weights + slot) : 0.0f;
      const int64_t row = row_ok ? slot : 0;
      const __nv_bfloat16* h_row = p.h + row * w1_rows;
      __nv_bfloat16* dh_row = p.dh + row * w1_rows;
      __nv_bfloat16* as_row = p.a_scaled + row * p.n;
#pragma unroll
      for (int half = 0; half < kPartials; ++half) {
        float part = 0.0f;  // this lane's share of sum_j da'_j a_j over the partial's columns
        // All of the partial's H vectors first (kQuads loads of g and of u in flight per lane):
        // the epilogue waits on these loads, so one round trip per row and partial.
        constexpr int kQuads = kPartialGroups / 4;
        uint4 gvs[kQuads], uvs[kQuads];
#pragma unroll
        for (int t = 0; t < kQuads; ++t) {
          const int jv = n0 + 8 * (half * kPartialGroups + 4 * t + q);
          const bool v_ok = row_ok && jv < p.n;
          gvs[t] = v_ok ? __ldg(reinterpret_cast<const uint4*>(h_row + jv)) : make_uint4(0, 0, 0, 0);
          uvs[t] = v_ok && kGated ? __ldg(reinterpret_cast<const uint4*>(h_row + p.n + jv))
                                  : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int t = 0; t < kQuads; ++t) {
          const int i0 = half * kPartialGroups + 4 * t;
          // This lane's group: i0 + q, columns [jv, jv + 8) (n is a multiple of 64, so a group
          // is wholly inside or outside).
          const int jv = n0 + 8 * (i0 + q);
          const bool v_ok = row_ok && jv < p.n;
          // lo[k] / hi[k]: columns 2k and 2k + 1 of this lane's group, after the transposes.
          uint32_t lo[4], hi[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int idx = Frag::acc_index(r, i0 + k);
            lo[k] = __float_as_uint(acc(idx));
            hi[k] = __float_as_uint(acc(idx + 1));
          }
          quad_transpose(lo);
          quad_transpose(hi);
          const uint32_t g[4] = {gvs[t].x, gvs[t].y, gvs[t].z, gvs[t].w};
          const uint32_t u[4] = {uvs[t].x, uvs[t].y, uvs[t].z, uvs[t].w};
          uint32_t dg[4], du[4], as[4];
          float pk = part;
#pragma unroll
          for (int k = 0; k < 4; ++k)
            dh_pair_words<A>(__uint_as_float(lo[k]), __uint_as_float(hi[k]), s,
                             *reinterpret_cast<const __nv_bfloat162*>(&g[k]),
                             *reinterpret_cast<const __nv_bfloat162*>(&u[k]), dg[k], du[k], as[k],
                             pk);
          // The ds partial takes only columns < n of real rows.
          if (v_ok) {
            part = pk;
            *reinterpret_cast<uint4*>(dh_row + jv) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
            if constexpr (kGated)
              *reinterpret_cast<uint4*>(dh_row + p.n + jv) = make_uint4(du[0], du[1], du[2], du[3]);
            *reinterpret_cast<uint4*>(as_row + jv) = make_uint4(as[0], as[1], as[2], as[3]);
          }
        }
        // The 4 lanes sharing a row hold the partial's 128 columns; a fixed butterfly keeps the
        // order fixed.
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        const int col = kPartials * n_tile + half;
        if (row_ok && col < p.ds_cols && q == 0)
          p.ds_partials[int64_t(slot) * p.ds_cols + col] = part;
      }
    }
  }
};

// up_proj on the warp-specialised kernel with schedule Sched; same contract as up_proj (kOai:
// the swiglu_oai kernel, act must be swiglu_oai; b1 the expert biases or null). raster_group:
// the host's band height (dispatch/raster.hpp). kCluster: CTAs sharing each stage of w1 by
// multicast (gather_gemm_kernel).
template <class Sched, bool kOai = false, int kCluster = 1>
void up_proj_gather(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1,
                    bf16* h, bf16* a, int64_t d, int64_t n, Activation act, int raster_group,
                    cudaStream_t stream) {
  constexpr int kTileN = Sched::kTileN;
  const bool gated = is_gated(act);
  Args p = gather_args(plan, x, d);  // x (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>(gated ? (n + kTileN / 2 - 1) / (kTileN / 2)
                                     : (n + kTileN - 1) / kTileN);
  p.b_rows_per_expert = static_cast<int>(gated ? 2 * n : n);  // w1 (E, w1_rows, d): K-major
  p.b_cols = static_cast<int>(d);
  p.gate_split = gated ? static_cast<int>(n) : 0;
  ActParams ep{reinterpret_cast<__nv_bfloat16*>(h), reinterpret_cast<__nv_bfloat16*>(a),
               static_cast<int>(n), act, reinterpret_cast<const __nv_bfloat16*>(b1)};
  launch_gather_gemm<GMajor::K, GatherActEpilogue<typename Sched::Frag, kOai>, Sched,
                     /*kTmaA=*/false, kCluster>(p, w1, ep, plan.S, raster_group, stream);
}

// dh_proj on the warp-specialised kernel with schedule Sched; same contract as dh_proj, act one
// of the activations kActs names (GatherDhEpilogue; kStageH: H through shared memory). ds_cols:
// ds_partials' columns (ds_partials_cols(n)); raster_group as for up_proj_gather. kCluster: CTAs
// sharing each stage of w2 by multicast (gather_gemm_kernel).
template <class Sched, int kActs = kAnyActivation, bool kStageH = false, int kCluster = 1>
void dh_proj_gather(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                    float* ds_partials, int64_t ds_cols, bf16* dh, bf16* a_scaled, int64_t d,
                    int64_t n, Activation act, int raster_group, cudaStream_t stream) {
  Args p = gather_args(plan, d_out, d);  // d_out (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>((n + Sched::kTileN - 1) / Sched::kTileN);
  p.b_rows_per_expert = static_cast<int>(d);  // w2 (E, d, n): K = d rows of N = n columns
  p.b_cols = static_cast<int>(n);
  p.gate_split = 0;
  const DhParams ep = make_dh_params(plan, h, ds_partials, ds_cols, dh, a_scaled, n, act);
  launch_gather_gemm<GMajor::MN, GatherDhEpilogue<typename Sched::Frag, kActs, kStageH>, Sched,
                     /*kTmaA=*/false, kCluster>(p, w2, ep, plan.S, raster_group, stream);
}

// A contiguous-A GEMM on the warp-specialised kernel, over the rows `rows` names: per expert e,
// out[rows.out[e] + i, :] = A[rows.begin[e] + i, :] · B_e (the whole step: ExpertRows::whole).
// B as Args says (kMajorB: K-major w2 for down_proj, N-major w1 for dx_proj); raster_group as
// for up_proj_gather.
template <GMajor kMajorB, class Sched>
void contiguous_gemm(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                     int64_t K, const bf16* b, int64_t N, bf16* out, int raster_group,
                     cudaStream_t stream) {
  Args p = gather_args(plan, a, K);  // a (S, K), rows by TMA (the gather table goes unread)
  p.rows_begin = rows.begin;
  p.rows_end = rows.end;
  p.rows_out = rows.out;
  p.n_tiles = static_cast<int>((N + Sched::kTileN - 1) / Sched::kTileN);
  p.b_rows_per_expert = static_cast<int>(kMajorB == GMajor::K ? N : K);
  p.b_cols = static_cast<int>(kMajorB == GMajor::K ? K : N);
  p.gate_split = 0;
  const StoreParams ep{reinterpret_cast<__nv_bfloat16*>(out), static_cast<int>(N)};
  launch_gather_gemm<kMajorB, GatherStoreEpilogue<typename Sched::Frag>, Sched, /*kTmaA=*/true>(
      p, b, ep, plan.S, raster_group, stream);
}

// down_proj / down_proj_rows on the warp-specialised kernel with schedule Sched; same contract:
// y (rows, d) = a (S, n) · w2_eᵀ over `rows`, w2 (E, d, n).
template <class Sched>
void down_proj_contiguous(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                          const bf16* w2, bf16* y, int64_t d, int64_t n, int raster_group,
                          cudaStream_t stream) {
  contiguous_gemm<GMajor::K, Sched>(plan, rows, a, n, w2, d, y, raster_group, stream);
}

// dx_proj / dx_proj_rows on the warp-specialised kernel with schedule Sched; same contract:
// dx_slots (rows, d) = dh (S, w1_rows) · w1_e over `rows`, w1 (E, w1_rows, d).
template <class Sched>
void dx_proj_contiguous(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                        const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows,
                        int raster_group, cudaStream_t stream) {
  contiguous_gemm<GMajor::MN, Sched>(plan, rows, dh, w1_rows, w1, d, dx_slots, raster_group,
                                     stream);
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
