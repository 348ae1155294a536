// CPU layer backward through the routing plan (docs/DESIGN.md's steps 4-8). Three phases, each over
// a fixed decomposition, so every result is bitwise independent of the thread count:
//
// 1. per (expert e, tile of its slots):
//      (recompute) Hf = X[tile] · W1_eᵀ + b1_e  else Hf = saved H[tile]; either way Hf holds the
//                                              cfg.dtype-rounded H, so both modes agree bitwise
//      dA' = dO[tokens of tile] · W2_e          dO gathered through the plan, fp32
//      a = act(Hf) (fp32)   ds_p = <dA'_p, a_p> (+ <dO_t, b2_e>)   da = s_p dA'   dH = act'(Hf, da)
//      A'_p = s_p a_p,  dH  → stored in cfg.dtype (S, ·) workspaces
//      dX~[tile] = dH[tile] · W1_e              stored in cfg.dtype (S, d) workspace
// 2. per token t:  dx_t = Σ_{pairs p of t, in pair order} dX~[token_index_map[p]];
//    per pair p:   d_pair_weights[p] = ds[token_index_map[p]]
// 3. per (expert e, block of output rows):
//      dW2_e = Σ_{slots of e, in slot order} dO_tᵀ A'_p     (d, n)
//      dW1_e = Σ_{slots of e, in slot order} dH_pᵀ x_t      (R, d)
//      db2_e = Σ_{slots of e, in slot order} s_p dO_t        (d,)  with dW2_e's row blocks
//      db1_e = Σ_{slots of e, in slot order} dH_p            (R,)  with dW1_e's row blocks
//    the slot sum of one output element is never split across threads.
// With fp8 compute, dO, W2 (dA'), dH and W1 (dX~) enter their GEMMs fake-quantized
// (cpu/fp8_operands.hpp), dH from its fp32 value; Hf is the dequantized e4m3 H (kept, or
// recomputed and fake-quantized: both modes agree bitwise); the weight gradients stay bf16, or
// with fp8_wgrad read dO, A', dH and x fake-quantized in 128x1 tiles along each expert's slots,
// from their cfg.dtype values (phase 3's operands, prepared per expert after phase 2).
#include <cstring>

#include "core/parallel.hpp"
#include "core/saved_access.hpp"
#include "cpu/activation.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/gemm_kernels.hpp"
#include "cpu/layer_common.hpp"

namespace moeblaze::cpu {

using Saved = moeblaze::detail::SavedAccess;

using gemm::mat;

void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts) {
  const RoutingPlanView pv = plan.view();
  const int64_t T = cfg.T, d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows(), S = pv.S;
  const DType dt = cfg.dtype;
  const size_t es = dtype_size(dt);
  const Activation act = cfg.activation;
  const bool recompute = opts.mode == LayerMode::recompute;

  const int threads = max_threads();
  const layer::BackwardWorkspace sizes = layer::backward_workspace(cfg, S, threads, nullptr);
  Buffer ws_buf = opts.workspace ? Buffer::borrow(Device::cpu, opts.workspace, opts.workspace_bytes)
                                 : Buffer(Device::cpu, sizes.bytes);
  const layer::BackwardWorkspace ws = layer::backward_workspace(cfg, S, threads, ws_buf.data());

  const int32_t* off = pv.expert_token_offsets;  // (E+1,)
  const int32_t* eti = pv.expert_token_indices;  // (S,) token of each slot
  const float* sw = pv.slot_weights;             // (S,) fp32
  const int64_t tasks = layer::build_tile_offsets(off, E, ws.tile_offsets);
  const char* w1p = static_cast<const char*>(w1.data);
  const char* w2p = static_cast<const char*>(w2.data);
  const char* h_saved = Saved::h(saved).as<const char>();  // (S, R) cfg.dtype, keep_h only
  const bool fp8 = is_fp8(cfg.compute);
  const e4m3* h_codes = reinterpret_cast<const e4m3*>(h_saved);  // fp8: (S, R) e4m3 ...
  const float* h_scales = h_saved ? reinterpret_cast<const float*>(
                                        h_saved + cfg.kept_h_scales_offset(S))
                                  : nullptr;  // ... and (S, ceil(R/128)) fp32
  if (fp8)  // X only for recompute's up-projection
    layer::prepare_fp8_operands(cfg, w1.data, w2.data, recompute ? x.data : nullptr, d_out.data,
                                ws.fp8);
  // The GEMM operands: the caller's, or their fake-quantized fp32 values.
  const gemm::MatRef x_op = fp8 ? mat(ws.fp8.x, DType::f32, d) : mat(x.data, dt, d);
  const gemm::MatRef do_op = fp8 ? mat(ws.fp8.d_out, DType::f32, d) : mat(d_out.data, dt, d);
  const DType wdt = fp8 ? DType::f32 : dt;
  const size_t wes = dtype_size(wdt);
  const char* w1op = fp8 ? reinterpret_cast<const char*>(ws.fp8.w1) : w1p;  // (E, R, d)
  const char* w2op = fp8 ? reinterpret_cast<const char*>(ws.fp8.w2) : w2p;  // (E, d, n)
  char* dh = static_cast<char*>(ws.dh);              // (S, R) cfg.dtype
  char* a_scaled = static_cast<char*>(ws.a_scaled);  // (S, n) cfg.dtype
  char* dx_slots = static_cast<char*>(ws.dx_slots);  // (S, d) cfg.dtype
  const char* b1p = biases.b1.rank ? biases.b1.as<const char>() : nullptr;  // (E, R) or null
  const char* b2p = biases.b2.rank ? biases.b2.as<const char>() : nullptr;  // (E, d) or null
  const char* dop = static_cast<const char*>(d_out.data);                  // (T, d) cfg.dtype

  // ---- phase 1: per (expert, tile) ----
  const double flops = backward_flops(cfg, S);
  layer::run_tasks(tasks, 1, flops, [&](int64_t task) {
    const int64_t e = layer::task_expert(ws.tile_offsets, E, task);
    const int64_t slot0 = off[e] + (task - ws.tile_offsets[e]) * layer::kTileM;
    const int64_t m = std::min<int64_t>(layer::kTileM, off[e + 1] - slot0);
    float* pack = ws.thread_scratch + layer::thread_index() * ws.per_thread;
    float* hf = pack + gemm::kPackFloats;   // (m, R) fp32 holding cfg.dtype-rounded H
    float* daf = hf + layer::kTileM * R;    // (m, n) fp32: dA', then da = s dA' in place
    float* dxf = daf + layer::kTileM * n;   // (m, d) fp32
    float* arow = dxf + layer::kTileM * d;  // (n,) fp32
    float* dhrow = arow + n;                // (R,) fp32
    float* dhq = dhrow + R;                 // fp8: (m, R) fp32 fake-quantized dH
    const char* w1e = w1p + e * R * d * es;
    const char* w1e_op = w1op + e * R * d * wes;

    if (recompute) {
      gemm::gemm_nt(m, R, d, mat(x_op.data, x_op.dtype, d, eti + slot0), mat(w1e_op, wdt, d), hf,
                    R, false, pack);
      if (b1p)
        for (int64_t i = 0; i < m; ++i) layer::add_row(hf + i * R, b1p + e * R * es, dt, R);
      if (fp8)
        for (int64_t i = 0; i < m; ++i) fp8::fake_quant_row(hf + i * R, R);
      else if (dt == DType::bf16)
        for (int64_t i = 0; i < m * R; ++i) hf[i] = round_to_bf16(hf[i]);
    } else if (fp8) {
      dequantize_1x128(h_codes + slot0 * R, h_scales + slot0 * fp8_groups(R), m, R, hf);
    } else {
      for (int64_t i = 0; i < m; ++i)
        gemm::load_row(h_saved + (slot0 + i) * R * es, dt, R, hf + i * R);
    }
    gemm::gemm_nn(m, n, d, mat(do_op.data, do_op.dtype, d, eti + slot0),
                  mat(w2op + e * d * n * wes, wdt, n), daf, n, false, pack);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t slot = slot0 + i;
      const float s = sw[slot];
      const float* hrow = hf + i * R;
      float* da = daf + i * n;
      activation_row(act, hrow, n, arow);
      float dsv = 0.0f;
      for (int64_t j = 0; j < n; ++j) dsv += da[j] * arow[j];
      // y_p = W2_e a_p + b2_e, so the bias adds <dO_t, b2_e> to the gate weight's gradient.
      if (b2p) dsv += layer::dot_rows(dop + eti[slot] * d * es, b2p + e * d * es, dt, d);
      ws.ds[slot] = dsv;
      for (int64_t j = 0; j < n; ++j) {
        da[j] *= s;
        arow[j] *= s;
      }
      gemm::store_row(arow, n, a_scaled + slot * n * es, dt);
      activation_backward_row(act, hrow, da, n, dhrow);
      gemm::store_row(dhrow, R, dh + slot * R * es, dt);
      if (fp8) {
        std::memcpy(dhq + i * R, dhrow, sizeof(float) * R);
        fp8::fake_quant_row(dhq + i * R, R);
      }
    }
    // dX~ reads dH back from its cfg.dtype store, as the GPU's kernel 6 does (fp8: quantized
    // from fp32, as the dH epilogue will).
    if (fp8)
      gemm::gemm_nn(m, d, R, mat(dhq, DType::f32, R), mat(w1e_op, wdt, d), dxf, d, false, pack);
    else
      gemm::gemm_nn(m, d, R, mat(dh + slot0 * R * es, dt, R), mat(w1e, dt, d), dxf, d, false,
                    pack);
    for (int64_t i = 0; i < m; ++i)
      gemm::store_row(dxf + i * d, d, dx_slots + (slot0 + i) * d * es, dt);
  });

  // ---- phase 2: per token ----
  const int32_t* tpo = pv.token_pair_offsets;  // (T+1,)
  const int32_t* tim = pv.token_index_map;     // (S,) slot of each pair, token-major
  char* dx = static_cast<char*>(grads.dx.data);  // (T, d) cfg.dtype
  float* dpw = grads.d_pair_weights.as<float>(); // (S,) fp32, token-major
  layer::run_tasks(T, 64, double(S) * double(d), [&](int64_t t) {
    float* acc = ws.thread_scratch + layer::thread_index() * ws.per_thread;  // (d,) fp32
    std::memset(acc, 0, sizeof(float) * d);
    for (int64_t p = tpo[t]; p < tpo[t + 1]; ++p) {
      const int64_t slot = tim[p];
      dpw[p] = ws.ds[slot];
      layer::add_row(acc, dx_slots + slot * d * es, dt, d);
    }
    gemm::store_row(acc, d, dx + t * d * es, dt);
  });

  // ---- fp8_wgrad: phase 3's operands, per (expert, operand) ----
  const layer::Fp8WgradOperands& wq = ws.wgrad;
  const bool fp8_wgrad = cfg.compute == Compute::fp8_wgrad;
  if (fp8_wgrad) {
    layer::run_tasks(4 * E, 1, 8.0 * double(S) * double(2 * d + n + R), [&](int64_t task) {
      const int64_t e = task / 4, which = task % 4;
      const int64_t s0 = off[e], cnt = off[e + 1] - off[e];
      const int64_t cols = which == 0 || which == 3 ? d : which == 1 ? n : R;
      float* dst = which == 0 ? wq.d_out : which == 1 ? wq.a : which == 2 ? wq.dh : wq.x;
      for (int64_t p = s0; p < s0 + cnt; ++p) {
        const char* row = which == 0   ? dop + eti[p] * d * es
                          : which == 1 ? a_scaled + p * n * es
                          : which == 2 ? dh + p * R * es
                                       : static_cast<const char*>(x.data) + eti[p] * d * es;
        gemm::load_row(row, dt, cols, dst + p * cols);
      }
      fp8::fake_quant_token_tiles(dst, cols, s0, cnt);
    });
  }

  // ---- phase 3: weight gradients, per (expert, output-row block) ----
  // Tasks [0, E*b2) are dW2 blocks (rows of d), then E*b1 dW1 blocks (rows of R).
  const int64_t b2 = (d + layer::kGradRows - 1) / layer::kGradRows;
  const int64_t b1 = (R + layer::kGradRows - 1) / layer::kGradRows;
  char* dw1 = static_cast<char*>(grads.dw1.data);  // (E, R, d) cfg.dtype
  char* dw2 = static_cast<char*>(grads.dw2.data);  // (E, d, n) cfg.dtype
  char* db1 = b1p ? static_cast<char*>(grads.db1.data) : nullptr;  // (E, R) cfg.dtype or null
  char* db2 = b2p ? static_cast<char*>(grads.db2.data) : nullptr;  // (E, d) cfg.dtype or null
  layer::run_tasks(E * (b1 + b2), 1, flops, [&](int64_t task) {
    float* pack = ws.thread_scratch + layer::thread_index() * ws.per_thread;
    float* c = pack + gemm::kPackFloats;  // (kGradRows, n or d) fp32
    const bool is_w2 = task < E * b2;
    const int64_t local = is_w2 ? task : task - E * b2;
    const int64_t blocks = is_w2 ? b2 : b1;
    const int64_t e = local / blocks;
    const int64_t r0 = (local % blocks) * layer::kGradRows;
    const int64_t rows = is_w2 ? d : R, cols = is_w2 ? n : d;
    const int64_t mb = std::min(layer::kGradRows, rows - r0);
    const int64_t s0 = off[e], cnt = off[e + 1] - off[e];
    if (fp8_wgrad && is_w2) {
      gemm::gemm_tn(mb, n, cnt, mat(wq.d_out + s0 * d + r0, DType::f32, d),
                    mat(wq.a + s0 * n, DType::f32, n), c, n, false, pack);
    } else if (fp8_wgrad) {
      gemm::gemm_tn(mb, d, cnt, mat(wq.dh + s0 * R + r0, DType::f32, R),
                    mat(wq.x + s0 * d, DType::f32, d), c, d, false, pack);
    } else if (is_w2) {
      // dW2_e[r, :] = Σ_p dO[t_p, r] A'_p: A is dO gathered by slot, columns r0.. of each row.
      gemm::gemm_tn(mb, n, cnt, mat(static_cast<const char*>(d_out.data) + r0 * es, dt, d, eti + s0),
                    mat(a_scaled + s0 * n * es, dt, n), c, n, false, pack);
    } else {
      gemm::gemm_tn(mb, d, cnt, mat(dh + (s0 * R + r0) * es, dt, R),
                    mat(x.data, dt, d, eti + s0), c, d, false, pack);
    }
    char* dst = (is_w2 ? dw2 : dw1) + (e * rows + r0) * cols * es;
    for (int64_t i = 0; i < mb; ++i) gemm::store_row(c + i * cols, cols, dst + i * cols * es, dt);
    // The bias gradient of the same rows: one fp32 sum per element, in slot order.
    char* db = is_w2 ? db2 : db1;
    if (db == nullptr) return;
    float bacc[layer::kGradRows] = {};  // (mb,) fp32
    for (int64_t p = s0; p < s0 + cnt; ++p) {
      if (is_w2) {
        layer::add_scaled_row(bacc, sw[p], dop + (eti[p] * d + r0) * es, dt, mb);
      } else {
        layer::add_row(bacc, dh + (p * R + r0) * es, dt, mb);
      }
    }
    gemm::store_row(bacc, mb, db + (e * rows + r0) * es, dt);
  });
}

namespace layer {

size_t workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode) {
  (void)mode;  // keep_h and recompute carve the same workspaces (recompute's H is per tile)
  const int threads = max_threads();
  const size_t fwd = forward_workspace(cfg, S, threads, nullptr).bytes;
  const size_t bwd = backward_workspace(cfg, S, threads, nullptr).bytes;
  return fwd > bwd ? fwd : bwd;
}

}  // namespace layer
}  // namespace moeblaze::cpu
