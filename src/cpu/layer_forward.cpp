// CPU layer forward through the routing plan (docs/DESIGN.md's steps 1-3):
//   per (expert e, tile of its slots), in parallel:
//     Hf = X[expert_token_indices[tile]] · W1_eᵀ (+ b1_e)  gathered rows, fp32 accumulation
//     (keep_h) H[tile] = Hf stored in cfg.dtype        kept for backward
//     A  = act(Hf), rounded to cfg.dtype               from the fp32 Hf, as the GPU epilogue does
//     Y[tile] = A · W2_eᵀ (+ b2_e) stored in cfg.dtype  transient (S, d)
//   per token t, in parallel:  o_t = Σ_{pairs p of t, in pair order} s_p · Y[token_index_map[p]]
// With fp8 compute, X, W1, W2 and A enter their GEMMs fake-quantized (cpu/fp8_operands.hpp), A
// from the fp32 Hf (not bf16-rounded), and H is kept as e4m3 codes with 1x128 scales.
// No (S, d) copy of x is made: each task gathers its rows while packing the GEMM operand.
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

void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts) {
  const RoutingPlanView pv = plan.view();
  const int64_t T = cfg.T, d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows(), S = pv.S;
  const DType dt = cfg.dtype;
  const size_t es = dtype_size(dt);
  const Activation act = cfg.activation;
  const bool keep_h = opts.mode == LayerMode::keep_h;

  // Release the previous contents first, so that they never coexist with the new H.
  saved = SavedForBackward();
  const bool fp8 = is_fp8(cfg.compute);
  const size_t h_bytes = cfg.kept_h_bytes(S);  // (S, R) cfg.dtype, or e4m3 codes + scales
  if (keep_h)
    Saved::h(saved) = opts.h_storage ? Buffer::borrow(Device::cpu, opts.h_storage, h_bytes)
                                     : Buffer(Device::cpu, h_bytes);

  const int threads = max_threads();
  const layer::ForwardWorkspace sizes = layer::forward_workspace(cfg, S, threads, nullptr);
  // Caller workspace (checked by the API to be large enough) or our own.
  Buffer ws_buf = opts.workspace ? Buffer::borrow(Device::cpu, opts.workspace, opts.workspace_bytes)
                                 : Buffer(Device::cpu, sizes.bytes);
  const layer::ForwardWorkspace ws = layer::forward_workspace(cfg, S, threads, ws_buf.data());

  const int32_t* off = pv.expert_token_offsets;  // (E+1,)
  const int32_t* eti = pv.expert_token_indices;  // (S,) token of each slot
  const int64_t tasks = layer::build_tile_offsets(off, E, ws.tile_offsets);
  const char* w1p = static_cast<const char*>(w1.data);
  const char* w2p = static_cast<const char*>(w2.data);
  char* y = static_cast<char*>(ws.y);  // (S, d) cfg.dtype
  char* h_keep = Saved::h(saved).as<char>();  // (S, R) cfg.dtype or null (recompute)
  e4m3* h_codes = reinterpret_cast<e4m3*>(h_keep);  // fp8: (S, R) e4m3 ...
  float* h_scales = h_keep ? reinterpret_cast<float*>(h_keep + cfg.kept_h_scales_offset(S))
                           : nullptr;               // ... and (S, ceil(R/128)) fp32
  if (fp8) layer::prepare_fp8_operands(cfg, w1.data, w2.data, x.data, nullptr, ws.fp8);
  // The GEMM operands: the caller's, or their fake-quantized fp32 values.
  const gemm::MatRef x_op = fp8 ? mat(ws.fp8.x, DType::f32, d) : mat(x.data, dt, d);
  const DType wdt = fp8 ? DType::f32 : dt;
  const size_t wes = dtype_size(wdt);
  const char* w1op = fp8 ? reinterpret_cast<const char*>(ws.fp8.w1) : w1p;  // (E, R, d)
  const char* w2op = fp8 ? reinterpret_cast<const char*>(ws.fp8.w2) : w2p;  // (E, d, n)
  const char* b1p = biases.b1.rank ? biases.b1.as<const char>() : nullptr;  // (E, R) or null
  const char* b2p = biases.b2.rank ? biases.b2.as<const char>() : nullptr;  // (E, d) or null

  const double flops = forward_flops(cfg, S);
  layer::run_tasks(tasks, 1, flops, [&](int64_t task) {
    const int64_t e = layer::task_expert(ws.tile_offsets, E, task);
    const int64_t slot0 = off[e] + (task - ws.tile_offsets[e]) * layer::kTileM;
    const int64_t m = std::min<int64_t>(layer::kTileM, off[e + 1] - slot0);
    float* scratch = ws.thread_scratch + layer::thread_index() * ws.per_thread;
    float* pack = scratch;                      // gemm::kPackFloats
    float* hf = pack + gemm::kPackFloats;       // (m, R) fp32
    float* af = hf + layer::kTileM * R;         // (m, n) fp32 holding cfg.dtype-rounded values
    float* yf = af + layer::kTileM * n;         // (m, d) fp32

    gemm::gemm_nt(m, R, d, mat(x_op.data, x_op.dtype, d, eti + slot0),
                  mat(w1op + e * R * d * wes, wdt, d), hf, R, false, pack);
    for (int64_t i = 0; i < m; ++i) {
      float* hrow = hf + i * R;
      const int64_t slot = slot0 + i;
      if (b1p) layer::add_row(hrow, b1p + e * R * es, dt, R);
      if (h_keep && fp8)
        quantize_1x128(hrow, 1, R, R, h_codes + slot * R, h_scales + slot * fp8_groups(R));
      else if (h_keep)
        gemm::store_row(hrow, R, h_keep + slot * R * es, dt);
      float* arow = af + i * n;
      activation_row(act, hrow, n, arow);
      if (fp8)
        fp8::fake_quant_row(arow, n);
      else if (dt == DType::bf16)
        for (int64_t j = 0; j < n; ++j) arow[j] = round_to_bf16(arow[j]);
    }
    gemm::gemm_nt(m, d, n, mat(af, DType::f32, n), mat(w2op + e * d * n * wes, wdt, n), yf, d,
                  false, pack);
    for (int64_t i = 0; i < m; ++i) {
      if (b2p) layer::add_row(yf + i * d, b2p + e * d * es, dt, d);
      gemm::store_row(yf + i * d, d, y + (slot0 + i) * d * es, dt);
    }
  });

  // Aggregation: each output row is owned by one token, summed in its pair order.
  const int32_t* tpo = pv.token_pair_offsets;  // (T+1,)
  const int32_t* tim = pv.token_index_map;     // (S,) slot of each pair, token-major
  const float* sw = pv.slot_weights;           // (S,) fp32
  char* o = static_cast<char*>(out.data);      // (T, d) cfg.dtype
  layer::run_tasks(T, 64, 2.0 * double(S) * double(d), [&](int64_t t) {
    float* acc = ws.thread_scratch + layer::thread_index() * ws.per_thread;  // (d,) fp32
    std::memset(acc, 0, sizeof(float) * d);
    for (int64_t p = tpo[t]; p < tpo[t + 1]; ++p) {
      const int64_t slot = tim[p];
      const float s = sw[slot];
      layer::add_scaled_row(acc, s, y + slot * d * es, dt, d);
    }
    gemm::store_row(acc, d, o + t * d * es, dt);
  });

  Saved::mark_filled(saved, opts.mode, S);
}

}  // namespace moeblaze::cpu
