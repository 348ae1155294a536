// The sm_90a grouped GEMMs (src/cuda/gemm/grouped_gemm.hpp) against float64 references computed
// here from the same bf16 inputs: every GEMM kind and epilogue, random expert counts with empty
// experts, all slots on one expert, M tails (counts not multiples of 128), N tails (dims that are
// multiples of 64 but not 128), E in {1, 4, 8, 64}. Outputs are poisoned (0xFF bytes = NaN) before
// each run, so an unwritten element fails; each kernel runs twice and must be bitwise equal.
//
// Observed errors (relative Frobenius, float64 reference) are printed per case; the bound
// asserted for bf16 outputs is rel_tolerance(bf16) = 1e-2, for the fp32 ds 1e-4. Seen on the H200
// (2026-11-29, all cases): at most 1.7e-3 for every bf16 output (bf16 rounding of the result
// alone) and 1.6e-6 for ds.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/error.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze::test {
namespace {

namespace gg = moeblaze::cuda::gemm;

const char* gather_kernel_name(gg::GatherKernel k) {
  switch (k) {
    case gg::GatherKernel::two_cta: return "2-CTA";
    case gg::GatherKernel::warp_specialized: return "warp-specialised";
    case gg::GatherKernel::ping_pong: return "ping-pong";
    case gg::GatherKernel::automatic: break;
  }
  return "automatic";
}

// ---- host-side helpers ------------------------------------------------------------------------

enum class Pattern { random, one_expert };

// A routing plan drawn at random: per-expert slot counts (random ones with ~25% empty experts,
// or every slot on one expert), each expert's tokens distinct and ascending.
struct HostPlan {
  int64_t T = 0, E = 0, S = 0;
  std::vector<int32_t> offsets;  // (E+1,)
  std::vector<int32_t> tokens;   // (S,) token of each slot
  std::vector<float> weights;    // (S,)
  std::vector<int32_t> expert_of_slot;  // (S,) for the references
};

HostPlan make_plan(int64_t T, int64_t E, Pattern pattern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostPlan p;
  p.T = T;
  p.E = E;
  std::vector<int64_t> counts(E, 0);
  if (pattern == Pattern::one_expert) {
    counts[std::uniform_int_distribution<int64_t>(0, E - 1)(rng)] = T;
  } else {
    std::uniform_int_distribution<int64_t> cnt(1, T);
    std::uniform_real_distribution<double> u(0, 1);
    for (auto& c : counts) c = (E > 1 && u(rng) < 0.25) ? 0 : cnt(rng);
  }
  p.offsets.assign(E + 1, 0);
  std::vector<int32_t> all(T);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t e = 0; e < E; ++e) {
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> pick(all.begin(), all.begin() + counts[e]);
    std::sort(pick.begin(), pick.end());
    for (int32_t t : pick) {
      p.tokens.push_back(t);
      p.expert_of_slot.push_back(static_cast<int32_t>(e));
    }
    p.offsets[e + 1] = static_cast<int32_t>(p.tokens.size());
  }
  p.S = static_cast<int64_t>(p.tokens.size());
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  p.weights.resize(p.S);
  for (auto& x : p.weights) x = w(rng);
  return p;
}

// ---- device buffers ---------------------------------------------------------------------------

struct DevBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t b) { alloc(b); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
  void alloc(size_t b) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = b;
    if (b > 0 && cudaMalloc(&ptr, b) != cudaSuccess) {
      ptr = nullptr;
      bytes = 0;
      ADD_FAILURE() << "cudaMalloc(" << b << ") failed";
    }
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
  void poison() const {
    if (bytes) EXPECT_EQ(cudaMemset(ptr, 0xFF, bytes), cudaSuccess);
  }
};

template <typename T>
void upload(DevBuf& buf, const std::vector<T>& v) {
  buf.alloc(v.size() * sizeof(T));
  if (!v.empty()) EXPECT_EQ(cudaMemcpy(buf.ptr, v.data(), buf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
}
template <typename T>
std::vector<T> download(const DevBuf& buf) {
  std::vector<T> v(buf.bytes / sizeof(T));
  if (!v.empty()) EXPECT_EQ(cudaMemcpy(v.data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}
bool bytes_equal(const DevBuf& a, const std::vector<uint8_t>& b) {
  const auto v = download<uint8_t>(a);
  return v.size() == b.size() && std::memcmp(v.data(), b.data(), v.size()) == 0;
}

struct DevPlan {
  DevBuf offsets, tokens, weights;
  RoutingPlanView view;
  explicit DevPlan(const HostPlan& h) {
    upload(offsets, h.offsets);
    upload(tokens, h.tokens);
    upload(weights, h.weights);
    view.T = h.T;
    view.E = h.E;
    view.S = h.S;
    view.expert_token_offsets = offsets.as<int32_t>();
    view.expert_token_indices = tokens.as<int32_t>();
    view.slot_weights = weights.as<float>();
    view.device = Device::cuda;
  }
};

std::vector<bf16> rand_bf16(size_t count, uint64_t seed, float stddev) {
  return to_bf16(random_normal(count, seed, stddev));
}
const bf16* cb(const DevBuf& b) { return b.as<const bf16>(); }
bf16* mb(const DevBuf& b) { return b.as<bf16>(); }

// Runs `launch` twice on poisoned outputs; checks both runs wrote identical bytes. Returns the
// outputs of the second run.
template <typename F>
void run_twice(const std::vector<const DevBuf*>& outs, F launch) {
  std::vector<std::vector<uint8_t>> first;
  for (int rep = 0; rep < 2; ++rep) {
    for (auto* o : outs) o->poison();
    launch();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (rep == 0)
      for (auto* o : outs) first.push_back(download<uint8_t>(*o));
  }
  for (size_t i = 0; i < outs.size(); ++i)
    EXPECT_TRUE(bytes_equal(*outs[i], first[i])) << "output " << i << " differs between two runs";
}

// Device scratch for the TMA path of down_proj / dx_proj (tma_gemm_scratch_bytes(E) bytes).
struct TmaScratch {
  DevBuf buf;
  explicit TmaScratch(int64_t E) : buf(gg::tma_gemm_scratch_bytes(E)) {}
  gg::GemmScratch get() const { return {buf.ptr, buf.bytes}; }
};

template <typename A>
double check_rel(const char* what, const std::vector<A>& got, const std::vector<double>& ref,
                 double tol) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  const double err = rel_frobenius(got.data(), ref.data(), std::min(got.size(), ref.size()));
  EXPECT_LE(err, tol) << what << ": relative Frobenius error " << err << " > " << tol;
  return err;
}

struct Case {
  int64_t E, d, n, T;
  Pattern pattern;
  Activation act;
};
std::string case_name(const Case& c) {
  std::string act = activation_name(c.act);
  std::replace(act.begin(), act.end(), '-', '_');  // gtest names: letters, digits, '_' only
  return "E" + std::to_string(c.E) + "_d" + std::to_string(c.d) + "_n" + std::to_string(c.n) +
         "_T" + std::to_string(c.T) + (c.pattern == Pattern::one_expert ? "_one" : "_rand") +
         "_" + act;
}

std::vector<Case> all_cases() {
  const Activation all_acts[] = {Activation::swiglu, Activation::geglu, Activation::relu,
                                 Activation::silu,   Activation::gelu,  Activation::relu2,
                                 Activation::swiglu_oai};
  std::vector<Case> cs;
  for (Activation a : all_acts) {
    cs.push_back({8, 256, 768, 300, Pattern::random, a});
    cs.push_back({4, 320, 192, 250, Pattern::random, a});  // N tails: 320, 192, 384 = k * 64
  }
  for (Activation a : {Activation::swiglu, Activation::relu2}) {
    cs.push_back({1, 128, 128, 333, Pattern::random, a});
    cs.push_back({8, 768, 256, 300, Pattern::one_expert, a});
    cs.push_back({64, 128, 256, 200, Pattern::random, a});
    cs.push_back({8, 1536, 1536, 160, Pattern::random, a});
    cs.push_back({8, 1536, 128, 260, Pattern::random, a});
  }
  return cs;
}

class GroupedGemm : public ::testing::TestWithParam<Case> {};

// Back to no kernel overrides when a scope ends, also when an assertion leaves a test early.
struct ClearOverridesOnExit {
  ~ClearOverridesOnExit() { gg::clear_kernel_overrides(); }
};

// Bands (tma.bands) change which CTA computes a tile, never how: at every built TMA variant of
// `gemm` (down or dx), what `launch` writes to `out` is bitwise the same at 2, 3, 7 and 64 bands
// as at one.
template <class F>
void expect_bitwise_across_bands(const std::string& gemm, const DevBuf& out, F launch) {
  const ClearOverridesOnExit clear_on_exit;
  for (const std::string variant : {"", "cluster=1", "tile=256x128", "tile=192x128"}) {
    const std::string spec =
        gemm + ".family=tma" + (variant.empty() ? "" : "," + gemm + "." + variant);
    std::vector<uint8_t> one_band;
    for (const int bands : {1, 2, 3, 7, 64}) {
      gg::set_kernel_overrides(
          gg::parse_kernel_overrides(spec + ",tma.bands=" + std::to_string(bands)));
      run_twice({&out}, launch);
      if (bands == 1)
        one_band = download<uint8_t>(out);
      else
        EXPECT_TRUE(bytes_equal(out, one_band)) << spec << ", tma.bands=" << bands;
    }
  }
}

// Inputs shared by the tests of one case.
struct Inputs {
  Case c;
  uint64_t seed;
  HostPlan plan;
  int64_t w1_rows;
  std::vector<bf16> x, w1, w2;
  Inputs(const Case& c_, uint64_t seed_) : c(c_), seed(seed_) {
    plan = make_plan(c.T, c.E, c.pattern, seed);
    w1_rows = is_gated(c.act) ? 2 * c.n : c.n;
    x = rand_bf16(size_t(c.T * c.d), seed + 1, 1.0f);
    w1 = rand_bf16(size_t(c.E * w1_rows * c.d), seed + 2, 1.0f / std::sqrt(float(c.d)));
    w2 = rand_bf16(size_t(c.E * c.d * c.n), seed + 3, 1.0f / std::sqrt(float(c.n)));
  }
};

// ---- (1) up-projection ----------------------------------------------------------------------
TEST_P(GroupedGemm, UpProjGatheredWithActivationEpilogue) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + case_name(c));
  Inputs in(c, seed);
  const auto& P = in.plan;
  const int64_t S = P.S, n = c.n, d = c.d, R = in.w1_rows;

  // float64 reference: h = W1_e x_t, a = act(g) * u (gated) or act(h), from the unrounded h.
  std::vector<double> h_ref(size_t(S * R)), a_ref(size_t(S * n));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < S; ++r) {
    const bf16* xr = &in.x[size_t(P.tokens[r]) * d];
    const bf16* w = &in.w1[size_t(P.expert_of_slot[r]) * R * d];
    for (int64_t o = 0; o < R; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < d; ++k) acc += double(float(xr[k])) * double(float(w[o * d + k]));
      h_ref[size_t(r * R + o)] = acc;
    }
    for (int64_t j = 0; j < n; ++j) {
      const double* hr = &h_ref[size_t(r * R)];
      a_ref[size_t(r * n + j)] = is_gated(c.act) ? reference::activation_f(c.act, hr[j]) *
                                                       reference::activation_up(c.act, hr[n + j])
                                                 : reference::activation_f(c.act, hr[j]);
    }
  }

  DevPlan dp(P);
  DevBuf x, w1;
  upload(x, in.x);
  upload(w1, in.w1);
  DevBuf h(size_t(S * R) * 2), a(size_t(S * n) * 2);
  // Both kernels of the gathered GEMMs, each against the reference (their roundings differ).
  for (gg::GatherKernel k : {gg::GatherKernel::two_cta, gg::GatherKernel::warp_specialized,
                             gg::GatherKernel::ping_pong}) {
    const char* kname = gather_kernel_name(k);
    SCOPED_TRACE(kname);
    if (c.act == Activation::swiglu_oai && k != gg::GatherKernel::warp_specialized) {
      // Its own cooperative kernel only: the others refuse it, outputs untouched.
      EXPECT_THROW(gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), d, n, c.act, nullptr, k),
                   Unsupported);
      continue;
    }
    run_twice({&h, &a}, [&] {
      gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), d, n, c.act, nullptr, k);
    });
    const double eh = check_rel("h", download<bf16>(h), h_ref, rel_tolerance(DType::bf16));
    const double ea = check_rel("a", download<bf16>(a), a_ref, rel_tolerance(DType::bf16));
    std::printf("[up  %s %s] S=%lld err h %.2e a %.2e\n", case_name(c).c_str(), kname,
                (long long)S, eh, ea);

    // Either store can be skipped; the other output must be bitwise the same as before.
    const auto h_full = download<uint8_t>(h);
    const auto a_full = download<uint8_t>(a);
    h.poison();
    a.poison();
    gg::up_proj(dp.view, cb(x), cb(w1), mb(h), nullptr, d, n, c.act, nullptr, k);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bytes_equal(h, h_full)) << "h differs when a is not stored";
    gg::up_proj(dp.view, cb(x), cb(w1), nullptr, mb(a), d, n, c.act, nullptr, k);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bytes_equal(a, a_full)) << "a differs when h is not stored";
  }
  // The cooperative kernel on clusters of 2 sharing w1's stages (up.cluster=2): the single-CTA
  // kernel's bits, also where an expert's odd m-tile count leaves a cluster's second CTA idle.
  if (c.act != Activation::swiglu_oai) {
    gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), d, n, c.act, nullptr,
                gg::GatherKernel::warp_specialized);
    const auto h_one = download<uint8_t>(h), a_one = download<uint8_t>(a);
    const ClearOverridesOnExit clear_on_exit;
    gg::set_kernel_overrides(gg::parse_kernel_overrides("up.family=ws,up.cluster=2"));
    ASSERT_EQ(gg::choose_kernels({S, c.E, d, n, c.act}).up.cluster, 2);
    run_twice({&h, &a}, [&] {
      gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), d, n, c.act, nullptr);
    });
    EXPECT_TRUE(bytes_equal(h, h_one)) << "h on clusters of 2";
    EXPECT_TRUE(bytes_equal(a, a_one)) << "a on clusters of 2";
  }
}

// ---- (2) down-projection --------------------------------------------------------------------
TEST_P(GroupedGemm, DownProjContiguous) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  if (c.act != Activation::swiglu && c.act != Activation::relu2) GTEST_SKIP() << "activation-independent";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + case_name(c));
  Inputs in(c, seed);
  const auto& P = in.plan;
  const int64_t S = P.S, n = c.n, d = c.d;
  const auto a_in = rand_bf16(size_t(S * n), seed + 4, 1.0f);

  std::vector<double> y_ref(size_t(S * d));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < S; ++r) {
    const bf16* w = &in.w2[size_t(P.expert_of_slot[r]) * d * n];
    for (int64_t o = 0; o < d; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k)
        acc += double(float(a_in[size_t(r * n + k)])) * double(float(w[o * n + k]));
      y_ref[size_t(r * d + o)] = acc;
    }
  }
  DevPlan dp(P);
  DevBuf a, w2;
  upload(a, a_in);
  upload(w2, in.w2);
  DevBuf y(size_t(S * d) * 2);
  run_twice({&y}, [&] { gg::down_proj(dp.view, cb(a), cb(w2), mb(y), d, n, nullptr); });
  const double ey = check_rel("y", download<bf16>(y), y_ref, rel_tolerance(DType::bf16));
  // The TMA path (CUTLASS pointer-array grouped GEMM), same contract and reference.
  const TmaScratch ts(c.E);
  run_twice({&y}, [&] { gg::down_proj(dp.view, cb(a), cb(w2), mb(y), d, n, nullptr, ts.get()); });
  const double ey_tma = check_rel("y (TMA path)", download<bf16>(y), y_ref, rel_tolerance(DType::bf16));
  // The TMA path's other built kernels (kTmaVariants), same scratch.
  {
    const ClearOverridesOnExit clear_on_exit;
    for (const char* spec : {"down.family=tma", "down.family=tma,down.cluster=1",
                             "down.family=tma,down.tile=256x128",
                             "down.family=tma,down.tile=192x128"}) {
      gg::set_kernel_overrides(gg::parse_kernel_overrides(spec));
      run_twice({&y}, [&] { gg::down_proj(dp.view, cb(a), cb(w2), mb(y), d, n, nullptr, ts.get()); });
      check_rel((std::string("y (TMA path, ") + spec + ")").c_str(), download<bf16>(y), y_ref,
                rel_tolerance(DType::bf16));
    }
  }
  expect_bitwise_across_bands("down", y, [&] {
    gg::down_proj(dp.view, cb(a), cb(w2), mb(y), d, n, nullptr, ts.get());
  });
  // The warp-specialised kernel with A read by slot, both schedules (the down.family=ws choice).
  double ey_ws[2];
  {
    const ClearOverridesOnExit clear_on_exit;
    for (int pp = 0; pp < 2; ++pp) {
      gg::set_kernel_overrides(gg::parse_kernel_overrides(
          pp ? "down.family=ws,down.schedule=pingpong" : "down.family=ws"));
      run_twice({&y}, [&] { gg::down_proj(dp.view, cb(a), cb(w2), mb(y), d, n, nullptr); });
      ey_ws[pp] = check_rel(pp ? "y (ws ping-pong)" : "y (ws cooperative)", download<bf16>(y),
                            y_ref, rel_tolerance(DType::bf16));
    }
  }
  std::printf("[down %s] S=%lld err y %.2e, TMA path %.2e, ws %.2e, ws-pp %.2e\n",
              case_name(c).c_str(), (long long)S, ey, ey_tma, ey_ws[0], ey_ws[1]);
}

// ---- (4) dH with the dActivation / ds / A' epilogue, + reduce_ds ---------------------------
TEST_P(GroupedGemm, DhProjGatheredWithBackwardEpilogue) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + case_name(c));
  Inputs in(c, seed);
  const auto& P = in.plan;
  const int64_t S = P.S, n = c.n, d = c.d, R = in.w1_rows;
  const auto d_out = rand_bf16(size_t(c.T * d), seed + 5, 1.0f);
  const auto h_in = rand_bf16(size_t(S * R), seed + 6, 1.0f);
  const int64_t cols = gg::ds_partials_cols(n);
  ASSERT_EQ(cols, (n + 127) / 128);

  std::vector<double> ds_ref(S), dh_ref(size_t(S * R)), as_ref(size_t(S * n));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < S; ++r) {
    const bf16* dor = &d_out[size_t(P.tokens[r]) * d];
    const bf16* w = &in.w2[size_t(P.expert_of_slot[r]) * d * n];
    const bf16* hr = &h_in[size_t(r * R)];
    const double s = P.weights[r];
    double ds = 0;
    for (int64_t j = 0; j < n; ++j) {
      double dap = 0;
      for (int64_t k = 0; k < d; ++k) dap += double(float(dor[k])) * double(float(w[k * n + j]));
      const double da = s * dap;
      double a;
      if (is_gated(c.act)) {
        const double g = float(hr[j]), u = float(hr[n + j]);
        a = reference::activation_f(c.act, g) * reference::activation_up(c.act, u);
        dh_ref[size_t(r * R + j)] =
            da * reference::activation_up(c.act, u) * reference::activation_df(c.act, g);
        dh_ref[size_t(r * R + n + j)] =
            da * reference::activation_f(c.act, g) * reference::activation_dup(c.act, u);
      } else {
        const double hv = float(hr[j]);
        a = reference::activation_f(c.act, hv);
        dh_ref[size_t(r * R + j)] = da * reference::activation_df(c.act, hv);
      }
      ds += dap * a;
      as_ref[size_t(r * n + j)] = s * a;
    }
    ds_ref[r] = ds;
  }

  DevPlan dp(P);
  DevBuf dO, w2, h;
  upload(dO, d_out);
  upload(w2, in.w2);
  upload(h, h_in);
  DevBuf partials(size_t(S * cols) * 4), ds(size_t(S) * 4), dh(size_t(S * R) * 2),
      as(size_t(S * n) * 2);
  for (gg::GatherKernel k : {gg::GatherKernel::two_cta, gg::GatherKernel::warp_specialized,
                             gg::GatherKernel::ping_pong}) {
    const char* kname = gather_kernel_name(k);
    SCOPED_TRACE(kname);
    if (c.act == Activation::swiglu_oai && k != gg::GatherKernel::warp_specialized) {
      EXPECT_THROW(gg::dh_proj(dp.view, cb(dO), cb(w2), cb(h), partials.as<float>(), mb(dh),
                               mb(as), d, n, c.act, nullptr, k),
                   Unsupported);
      continue;
    }
    run_twice({&partials, &ds, &dh, &as}, [&] {
      gg::dh_proj(dp.view, cb(dO), cb(w2), cb(h), partials.as<float>(), mb(dh), mb(as), d, n,
                  c.act, nullptr, k);
      gg::reduce_ds(partials.as<float>(), ds.as<float>(), S, n, nullptr);
    });
    const double edh = check_rel("dh", download<bf16>(dh), dh_ref, rel_tolerance(DType::bf16));
    const double eas =
        check_rel("a_scaled", download<bf16>(as), as_ref, rel_tolerance(DType::bf16));
    const double eds = check_rel("ds", download<float>(ds), ds_ref, 1e-4);
    // The reduction is the plain in-order sum of the partials.
    const auto part = download<float>(partials);
    const auto dsv = download<float>(ds);
    for (int64_t r = 0; r < S; ++r) {
      float acc = 0.0f;
      for (int64_t j = 0; j < cols; ++j) acc += part[size_t(r * cols + j)];
      ASSERT_EQ(acc, dsv[r]) << "ds[" << r << "] is not the in-order sum of its partials";
    }
    std::printf("[dH  %s %s] S=%lld err dh %.2e a' %.2e ds %.2e\n", case_name(c).c_str(), kname,
                (long long)S, edh, eas, eds);
  }
  // swiglu's kernel on clusters of 2 sharing w2's stages (dh.cluster=2): the same bits as on
  // single CTAs, also where an expert's odd m-tile count leaves its last cluster's second CTA
  // without rows.
  if (c.act == Activation::swiglu) {
    gg::dh_proj(dp.view, cb(dO), cb(w2), cb(h), partials.as<float>(), mb(dh), mb(as), d, n,
                c.act, nullptr, gg::GatherKernel::warp_specialized);
    const auto dh_one = download<uint8_t>(dh), as_one = download<uint8_t>(as);
    const auto part_one = download<uint8_t>(partials);
    const ClearOverridesOnExit clear_on_exit;
    gg::set_kernel_overrides(gg::parse_kernel_overrides("dh.cluster=2"));
    ASSERT_EQ(gg::choose_kernels({S, c.E, d, n, c.act}).dh.cluster, 2);
    run_twice({&partials, &dh, &as}, [&] {
      gg::dh_proj(dp.view, cb(dO), cb(w2), cb(h), partials.as<float>(), mb(dh), mb(as), d, n,
                  c.act, nullptr);
    });
    EXPECT_TRUE(bytes_equal(dh, dh_one)) << "dh on clusters of 2";
    EXPECT_TRUE(bytes_equal(as, as_one)) << "a_scaled on clusters of 2";
    EXPECT_TRUE(bytes_equal(partials, part_one)) << "ds partials on clusters of 2";
  }
}

// ---- (5) dW2 and (8) dW1: varlen-K -----------------------------------------------------------
TEST_P(GroupedGemm, WeightGradsVarlenK) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  if (c.act != Activation::swiglu && c.act != Activation::relu2) GTEST_SKIP() << "covered";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + case_name(c));
  Inputs in(c, seed);
  const auto& P = in.plan;
  const int64_t S = P.S, n = c.n, d = c.d, R = in.w1_rows, E = c.E;
  const auto d_out = rand_bf16(size_t(c.T * d), seed + 7, 1.0f);
  const auto as_in = rand_bf16(size_t(S * n), seed + 8, 1.0f);
  const auto dh_in = rand_bf16(size_t(S * R), seed + 9, 1.0f);

  std::vector<double> dw2_ref(size_t(E * d * n), 0.0), dw1_ref(size_t(E * R * d), 0.0);
#pragma omp parallel for collapse(2) schedule(dynamic, 8)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < std::max(d, R); ++i) {
      if (i < d)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int32_t r = P.offsets[e]; r < P.offsets[e + 1]; ++r)
            acc += double(float(d_out[size_t(P.tokens[r]) * d + i])) *
                   double(float(as_in[size_t(r * n + j)]));
          dw2_ref[size_t((e * d + i) * n + j)] = acc;
        }
      if (i < R)
        for (int64_t j = 0; j < d; ++j) {
          double acc = 0;
          for (int32_t r = P.offsets[e]; r < P.offsets[e + 1]; ++r)
            acc += double(float(dh_in[size_t(r * R + i)])) *
                   double(float(in.x[size_t(P.tokens[r]) * d + j]));
          dw1_ref[size_t((e * R + i) * d + j)] = acc;
        }
    }

  DevPlan dp(P);
  DevBuf dO, as, dh, x;
  upload(dO, d_out);
  upload(as, as_in);
  upload(dh, dh_in);
  upload(x, in.x);
  DevBuf dw2(size_t(E * d * n) * 2), dw1(size_t(E * R * d) * 2);
  // The warp-specialised kernel three times: dW1 with 2-CTA clusters sharing dh (dw1.cluster=2;
  // odd m-tile counts, d = 128 and 320, leave a cluster's second CTA without a tile), one CTA per
  // tile (dw1.cluster=1), and both with the TMA-store epilogue (store_tma=1), through the kernel
  // overrides.
  struct Variant {
    gg::GatherKernel kernel;
    bool clusters;
    bool store_tma = false;
  };
  std::vector<uint8_t> ws_dw2, ws_dw1;  // the clusters' outputs
  const ClearOverridesOnExit clear_on_exit;
  for (const Variant v : {Variant{gg::GatherKernel::two_cta, false},
                          Variant{gg::GatherKernel::warp_specialized, true},
                          Variant{gg::GatherKernel::warp_specialized, false},
                          Variant{gg::GatherKernel::warp_specialized, false, true}}) {
    const gg::GatherKernel k = v.kernel;
    const std::string kname = std::string(gather_kernel_name(k)) +
                              (k == gg::GatherKernel::warp_specialized
                                   ? (v.clusters    ? "/dw1.cluster=2"
                                      : v.store_tma ? "/dw1.cluster=1,store_tma=1"
                                                    : "/dw1.cluster=1")
                                   : "");
    SCOPED_TRACE(kname);
    gg::set_kernel_overrides(gg::parse_kernel_overrides(
        v.clusters    ? "dw1.cluster=2"
        : v.store_tma ? "dw1.cluster=1,dw1.store_tma=1,dw2.store_tma=1"
                      : "dw1.cluster=1"));
    run_twice({&dw2, &dw1}, [&] {
      gg::dw2_proj(dp.view, cb(dO), cb(as), mb(dw2), d, n, nullptr, k);
      gg::dw1_proj(dp.view, cb(dh), cb(x), mb(dw1), d, n, c.act, nullptr, k);
    });
    const auto g2 = download<bf16>(dw2);
    const auto g1 = download<bf16>(dw1);
    // Clusters change who loads the operands, and the TMA-store epilogue how the tile leaves,
    // not the order of any element's sums: the warp-specialised variants agree bit for bit.
    if (k == gg::GatherKernel::warp_specialized) {
      if (v.clusters) {
        ws_dw2 = download<uint8_t>(dw2);
        ws_dw1 = download<uint8_t>(dw1);
      } else {
        EXPECT_TRUE(bytes_equal(dw2, ws_dw2)) << "dw2: " << kname << " and clusters differ";
        EXPECT_TRUE(bytes_equal(dw1, ws_dw1)) << "dw1: " << kname << " and clusters differ";
      }
    }
    const double e2 = check_rel("dw2", g2, dw2_ref, rel_tolerance(DType::bf16));
    const double e1 = check_rel("dw1", g1, dw1_ref, rel_tolerance(DType::bf16));
    // Experts without slots get exact zeros (not left unwritten).
    for (int64_t e = 0; e < E; ++e) {
      if (P.offsets[e + 1] != P.offsets[e]) continue;
      for (int64_t i = 0; i < d * n; ++i)
        ASSERT_EQ(g2[size_t(e * d * n + i)].bits, 0) << "dw2 of empty expert " << e;
      for (int64_t i = 0; i < R * d; ++i)
        ASSERT_EQ(g1[size_t(e * R * d + i)].bits, 0) << "dw1 of empty expert " << e;
    }
    std::printf("[dW  %s %s] S=%lld err dw2 %.2e dw1 %.2e\n", case_name(c).c_str(),
                kname.c_str(), (long long)S, e2, e1);
  }
}

// ---- (6) dX̃ ----------------------------------------------------------------------------------
TEST_P(GroupedGemm, DxProjWeightNMajor) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  if (c.act != Activation::swiglu && c.act != Activation::relu2) GTEST_SKIP() << "covered";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + case_name(c));
  Inputs in(c, seed);
  const auto& P = in.plan;
  const int64_t S = P.S, d = c.d, R = in.w1_rows;
  const auto dh_in = rand_bf16(size_t(S * R), seed + 10, 1.0f);

  std::vector<double> dx_ref(size_t(S * d));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t r = 0; r < S; ++r) {
    const bf16* w = &in.w1[size_t(P.expert_of_slot[r]) * R * d];
    for (int64_t o = 0; o < d; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < R; ++k)
        acc += double(float(dh_in[size_t(r * R + k)])) * double(float(w[k * d + o]));
      dx_ref[size_t(r * d + o)] = acc;
    }
  }
  DevPlan dp(P);
  DevBuf dh, w1;
  upload(dh, dh_in);
  upload(w1, in.w1);
  DevBuf dx(size_t(S * d) * 2);
  run_twice({&dx}, [&] { gg::dx_proj(dp.view, cb(dh), cb(w1), mb(dx), d, c.n, c.act, nullptr); });
  const double ex = check_rel("dx_slots", download<bf16>(dx), dx_ref, rel_tolerance(DType::bf16));
  const TmaScratch ts(c.E);
  run_twice({&dx}, [&] {
    gg::dx_proj(dp.view, cb(dh), cb(w1), mb(dx), d, c.n, c.act, nullptr, ts.get());
  });
  const double ex_tma =
      check_rel("dx_slots (TMA path)", download<bf16>(dx), dx_ref, rel_tolerance(DType::bf16));
  {
    const ClearOverridesOnExit clear_on_exit;
    for (const char* spec : {"dx.family=tma", "dx.family=tma,dx.cluster=1",
                             "dx.family=tma,dx.tile=256x128", "dx.family=tma,dx.tile=192x128"}) {
      gg::set_kernel_overrides(gg::parse_kernel_overrides(spec));
      run_twice({&dx}, [&] {
        gg::dx_proj(dp.view, cb(dh), cb(w1), mb(dx), d, c.n, c.act, nullptr, ts.get());
      });
      check_rel((std::string("dx_slots (TMA path, ") + spec + ")").c_str(), download<bf16>(dx),
                dx_ref, rel_tolerance(DType::bf16));
    }
  }
  expect_bitwise_across_bands("dx", dx, [&] {
    gg::dx_proj(dp.view, cb(dh), cb(w1), mb(dx), d, c.n, c.act, nullptr, ts.get());
  });
  double ex_ws[2];
  {
    const ClearOverridesOnExit clear_on_exit;
    for (int pp = 0; pp < 2; ++pp) {
      gg::set_kernel_overrides(gg::parse_kernel_overrides(
          pp ? "dx.family=ws,dx.schedule=pingpong" : "dx.family=ws"));
      run_twice({&dx}, [&] {
        gg::dx_proj(dp.view, cb(dh), cb(w1), mb(dx), d, c.n, c.act, nullptr);
      });
      ex_ws[pp] = check_rel(pp ? "dx_slots (ws ping-pong)" : "dx_slots (ws cooperative)",
                            download<bf16>(dx), dx_ref, rel_tolerance(DType::bf16));
    }
  }
  std::printf("[dX  %s] S=%lld err dx %.2e, TMA path %.2e, ws %.2e, ws-pp %.2e\n",
              case_name(c).c_str(), (long long)S, ex, ex_tma, ex_ws[0], ex_ws[1]);
}

INSTANTIATE_TEST_SUITE_P(Cases, GroupedGemm, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return case_name(i.param); });

// ---- edge cases and argument checks -------------------------------------------------------------

// S = 0: varlen-M GEMMs do nothing (outputs untouched); varlen-K ones write zero gradients.
TEST(GroupedGemmEdge, EmptyPlan) {
  MOEBLAZE_REQUIRE_GPU();
  const int64_t E = 3, d = 128, n = 64, T = 0;
  HostPlan P;
  P.T = T;
  P.E = E;
  P.offsets.assign(E + 1, 0);
  DevPlan dp(P);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  DevBuf w1, w2, guard(64);
  upload(w1, rand_bf16(size_t(E * 2 * n * d), seed, 0.1f));
  upload(w2, rand_bf16(size_t(E * d * n), seed + 1, 0.1f));
  guard.poison();
  const auto before = download<uint8_t>(guard);
  // Empty operands may be null when S = 0; `guard` stands in for outputs that must stay as is.
  for (auto k : {gg::GatherKernel::two_cta, gg::GatherKernel::warp_specialized,
                 gg::GatherKernel::ping_pong})
    gg::up_proj(dp.view, nullptr, cb(w1), mb(guard), mb(guard), d, n, Activation::swiglu, nullptr,
                k);
  gg::down_proj(dp.view, nullptr, cb(w2), mb(guard), d, n, nullptr);
  for (auto k : {gg::GatherKernel::two_cta, gg::GatherKernel::warp_specialized,
                 gg::GatherKernel::ping_pong})
    gg::dh_proj(dp.view, nullptr, cb(w2), nullptr, guard.as<float>(), mb(guard), mb(guard), d, n,
                Activation::swiglu, nullptr, k);
  gg::reduce_ds(nullptr, guard.as<float>(), 0, n, nullptr);
  gg::dx_proj(dp.view, nullptr, cb(w1), mb(guard), d, n, Activation::swiglu, nullptr);
  const TmaScratch ts(E);  // the TMA path: nothing to do either
  gg::down_proj(dp.view, nullptr, cb(w2), mb(guard), d, n, nullptr, ts.get());
  gg::dx_proj(dp.view, nullptr, cb(w1), mb(guard), d, n, Activation::swiglu, nullptr, ts.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(bytes_equal(guard, before));

  DevBuf dw2(size_t(E * d * n) * 2), dw1(size_t(E * 2 * n * d) * 2);
  for (auto k : {gg::GatherKernel::two_cta, gg::GatherKernel::warp_specialized}) {
    dw2.poison();
    dw1.poison();
    gg::dw2_proj(dp.view, nullptr, nullptr, mb(dw2), d, n, nullptr, k);
    gg::dw1_proj(dp.view, nullptr, nullptr, mb(dw1), d, n, Activation::swiglu, nullptr, k);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (auto v : download<uint16_t>(dw2)) ASSERT_EQ(v, 0);
    for (auto v : download<uint16_t>(dw1)) ASSERT_EQ(v, 0);
  }
}

// The shape rule needs no GPU.
TEST(GroupedGemmChecks, ShapeRule) {
  EXPECT_NO_THROW(gg::check_gemm_shape(128, 64));
  try {
    gg::check_gemm_shape(100, 128);
    ADD_FAILURE() << "d = 100 accepted";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("d (100) must be a multiple of 64 for the CUDA backend"),
              std::string::npos)
        << e.what();
  }
  try {
    gg::check_gemm_shape(128, 96);
    ADD_FAILURE() << "n = 96 accepted";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("n (96) must be a multiple of 64"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(gg::ds_partials_cols(64), 1);
  EXPECT_EQ(gg::ds_partials_cols(128), 1);
  EXPECT_EQ(gg::ds_partials_cols(192), 2);
}

// The automatic kernel choice follows the rules measured on the H200 (kernel_config.hpp), field
// by field, for its 132 SMs whatever GPU runs the test. Host-only: runs without a GPU.
TEST(GroupedGemmChecks, KernelChoiceFollowsTheMeasuredRules) {
  using gg::KernelFamily;
  using gg::KernelSchedule;
  const gg::KernelOverrides none;
  auto choose = [&](int64_t S, int64_t E, int64_t d, int64_t n,
                    Activation act = Activation::swiglu) {
    return gg::choose_kernels(
        {S, E, d, n, act, 132, gg::kFallbackL2Bytes, gg::kFallbackFlopsPerByte}, none);
  };
  // sm-default: every gathered GEMM warp-specialised, dH cooperative (d = 4096), TMA down/dX.
  const gg::LayerKernels sm = choose(262144, 128, 4096, 1024);
  EXPECT_EQ(sm.up.family, KernelFamily::ws_gather);
  EXPECT_EQ(sm.up.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(sm.up.tile_n, 256);
  EXPECT_EQ(sm.up.stages, gg::kWsCooperativeStages);
  EXPECT_EQ(sm.dh.family, KernelFamily::ws_gather);
  EXPECT_EQ(sm.dh.schedule, KernelSchedule::cooperative);
  // TMA down / dX̃: 192x128 ping-pong on clusters of 2.
  EXPECT_EQ(sm.down.family, KernelFamily::tma_grouped);
  EXPECT_EQ(gg::tma_variant(sm.down), gg::kTmaPingPong);
  EXPECT_EQ(sm.down.cluster, 2);
  EXPECT_EQ(sm.dx, sm.down);
  EXPECT_EQ(sm.down.tma_bands, 1);  // 11 x 32 tiles per expert: CUTLASS's order
  EXPECT_EQ(gg::tma_variant(choose(131072, 64, 2048, 1024).dx), gg::kTmaPingPong);  // olmoe
  EXPECT_EQ(sm.dw2.family, KernelFamily::ws_varlen_k);
  EXPECT_EQ(sm.dw1.family, KernelFamily::ws_varlen_k);
  EXPECT_EQ(sm.dw1.cluster, 1);  // 2048 rows per expert: no clusters
  // Below 4096 rows per expert both weight gradients leave by TMA store (3 ring stages); from
  // there (olmoe: 4096) dW1 runs on clusters and both store plainly (4 stages).
  EXPECT_TRUE(sm.dw2.store_by_tma);
  EXPECT_TRUE(sm.dw1.store_by_tma);
  EXPECT_EQ(sm.dw1.stages, gg::kWsVarlenKTmaStoreStages);
  const gg::LayerKernels olmoe = choose(262144, 64, 2048, 1024);
  EXPECT_EQ(olmoe.dw1.cluster, 2);
  EXPECT_FALSE(olmoe.dw1.store_by_tma);
  EXPECT_FALSE(olmoe.dw2.store_by_tma);
  EXPECT_EQ(olmoe.dw2.stages, gg::kWsVarlenKStages);
  // A cluster override drops the TMA-store epilogue (one CTA a tile's) with its ring depth.
  const gg::GemmKernel c2 =
      gg::choose_kernels({262144, 128, 4096, 1024, Activation::swiglu, 132, gg::kFallbackL2Bytes},
                         gg::parse_kernel_overrides("dw1.cluster=2"))
          .dw1;
  EXPECT_EQ(c2.cluster, 2);
  EXPECT_FALSE(c2.store_by_tma);
  EXPECT_EQ(c2.stages, gg::kWsVarlenKStages);
  EXPECT_EQ(sm.up.raster_group, gg::kDefaultRasterGroup);
  // swiglu's dH: its own ws kernels, cooperative, at every d (sm-7B-n256: d = 1536).
  const gg::LayerKernels s7 = choose(196608, 128, 1536, 256);
  // Bands on the TMA path where an expert has fewer tiles than SMs and K <= 512: sm-7B-n256
  // 8 x 12 = 96 tiles, ceil(8 * 132 / 96) = 11 bands (w2_e 0.75 MiB, w1_e 1.5 MiB: 24 MiB holds
  // 11 of each); sm-1.4B-n256 14 x 6 = 84 tiles: 13; sm-7B-n1024 (K = 1024, 2048) and olmoe
  // (176 tiles per expert): none.
  EXPECT_EQ(s7.down.tma_bands, 11);
  EXPECT_EQ(s7.dx.tma_bands, 11);
  EXPECT_EQ(choose(327680, 128, 768, 256).down.tma_bands, 13);
  EXPECT_EQ(choose(327680, 128, 768, 256).dx.tma_bands, 13);
  EXPECT_EQ(choose(49152, 32, 1536, 1024).down.tma_bands, 1);
  EXPECT_EQ(choose(131072, 64, 2048, 1024).dx.tma_bands, 1);
  const int64_t kL2 = gg::kFallbackL2Bytes;  // 50 MiB, the H100 SXM's: 24 MiB of weights
  EXPECT_EQ(gg::tma_bands_rule(24576, 128, 12288, 512, 192, 128, 132, kL2), 2);  // 12 MiB weights
  EXPECT_EQ(gg::tma_bands_rule(196608, 128, 1536, 513, 192, 128, 132, kL2), 1);  // K > 512
  EXPECT_EQ(gg::tma_bands_rule(196608, 4, 1536, 256, 192, 128, 132, kL2), 1);  // 24576 rows per expert
  EXPECT_EQ(gg::tma_bands_rule(1000, 1, 1536, 256, 192, 128, 132, kL2), 1);    // one expert
  EXPECT_EQ(gg::tma_bands_rule(96, 64, 128, 64, 192, 128, 132, kL2), 64);      // one tile each: E's cap
  EXPECT_EQ(gg::tma_bands_rule(0, 64, 128, 64, 192, 128, 132, kL2), 1);
  EXPECT_EQ(s7.dh.family, KernelFamily::ws_gather);
  EXPECT_EQ(s7.dh.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(choose(131072, 64, 2048, 1024).dh, sm.dh);  // olmoe
  // The other activations' dH (the shared activation switch) by d: the 2-CTA kernel below
  // 2048, ping-pong below 4096 (128-wide tiles, 6 stages), cooperative from there.
  const Activation geglu = Activation::geglu;
  EXPECT_EQ(choose(196608, 128, 1536, 256, geglu).dh.family, KernelFamily::two_cta);
  const gg::LayerKernels ol = choose(131072, 64, 2048, 1024, geglu);
  EXPECT_EQ(ol.dh.schedule, KernelSchedule::ping_pong);
  EXPECT_EQ(ol.dh.tile_n, 128);
  EXPECT_EQ(ol.dh.stages, gg::kWsPingPongStages);
  EXPECT_EQ(ol.up.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(choose(262144, 128, 4096, 1024, geglu).dh, sm.dh);
  // dW1's clusters where experts have >= 4096 rows on average (mb-conf3).
  EXPECT_EQ(choose(262144, 16, 1024, 4096).dw1.cluster, 2);
  // E beyond the gather kernel's expert table: the 2-CTA kernels (up-proj's w1 by TMA).
  const gg::LayerKernels big = choose(1 << 20, 5000, 4096, 1024);
  EXPECT_EQ(big.up.family, KernelFamily::two_cta);
  EXPECT_TRUE(big.up.b_by_tma);
  EXPECT_EQ(big.dh.family, KernelFamily::two_cta);
  EXPECT_EQ(big.dw1.family, KernelFamily::two_cta);
  // Few rows per expert (docs/notes/weight-bound-down-dx.md). Below 128 an expert: one 128x256
  // tile on single CTAs (the 2-CTA kernel where E > 4096 or S = 0). From 128 to 178 rows (an
  // expert's rows fit one 192-row tile, r + sqrt(r) <= 192, and the GEMM is weight-bound, r below
  // the device's FLOPs per DRAM byte): 192x128 ping-pong; then the ws kernel (A by TMA,
  // cooperative) below 1024 rows, the TMA path from there.
  EXPECT_EQ(gg::flops_per_dram_byte(132, 1980000, 3201000, 6144), 217);  // the H200's
  EXPECT_EQ(gg::flops_per_dram_byte(132, 1980000, 0, 6144), 0);          // unknown clock
  EXPECT_EQ(gg::one_tile_rows(192), 178);  // 178 + 13.3 <= 192 < 179 + 13.4
  EXPECT_EQ(gg::weight_bound_max_rows(gg::kFallbackFlopsPerByte), 178);
  EXPECT_EQ(gg::weight_bound_max_rows(217), 178);
  EXPECT_EQ(gg::weight_bound_max_rows(150), 149);  // memory fast enough to stop short of 178
  const gg::LayerKernels few = choose(1000, 8, 512, 256);  // 125 rows per expert
  EXPECT_EQ(few.down.family, KernelFamily::tma_grouped);
  EXPECT_EQ(gg::tma_variant(few.down), gg::kTmaSingle);
  EXPECT_EQ(few.dx, few.down);
  EXPECT_EQ(choose(0, 8, 512, 256).down.family, KernelFamily::two_cta);  // S = 0: no scratch
  EXPECT_EQ(gg::tma_variant(choose(32767, 256, 2048, 1024).dx), gg::kTmaSingle);
  // ... also where the TMA path's wide-dX̃ rule (2n >= 3072, d >= 2560) would apply: that rule is
  // the TMA path's, from 128 rows an expert (68 rows here: T 5832, d 3712, n 1984, E 256, K 3).
  EXPECT_EQ(gg::tma_variant(choose(17496, 256, 3712, 1984).dx), gg::kTmaSingle);
  EXPECT_EQ(choose(17496, 256, 3712, 1984).dx, choose(17496, 256, 3712, 1984).down);
  const gg::LayerKernels fine = choose(32768, 256, 2048, 1024);  // 128 rows per expert
  EXPECT_EQ(fine.down.family, KernelFamily::tma_grouped);
  EXPECT_EQ(gg::tma_variant(fine.down), gg::kTmaPingPong);
  EXPECT_EQ(fine.dx, fine.down);  // no wide dX̃ tile where weight-bound
  auto on = [&](int64_t fpb, int64_t S, int64_t E) {
    return gg::choose_kernels({S, E, 7168, 2048, Activation::swiglu, 132,
                               gg::kFallbackL2Bytes, fpb}, none);
  };
  const int64_t h100 = gg::kFallbackFlopsPerByte, h200 = 217;
  for (const int64_t fpb : {h100, h200}) {
    EXPECT_EQ(gg::tma_variant(on(fpb, 178 * 160, 160).down), gg::kTmaPingPong);
    EXPECT_EQ(gg::tma_variant(on(fpb, 178 * 160, 160).dx), gg::kTmaPingPong);
    EXPECT_EQ(on(fpb, 178 * 160 + 1, 160).down.family, KernelFamily::ws_gather);
    EXPECT_EQ(on(fpb, 178 * 160 + 1, 160).dx.schedule, KernelSchedule::cooperative);
  }
  EXPECT_EQ(gg::tma_variant(on(150, 149 * 160, 160).down), gg::kTmaPingPong);
  EXPECT_EQ(on(150, 149 * 160 + 1, 160).down.family, KernelFamily::ws_gather);
  EXPECT_EQ(on(100, 128 * 160, 160).down.family, KernelFamily::ws_gather);  // not weight-bound
  EXPECT_EQ(on(h200, 178 * 160, 160).sms, 132);
  EXPECT_EQ(on(h200, 178 * 160, 160).flops_per_byte, h200);  // the ratio it was made for
  // Above 178 rows: two M tiles of either size, the ws kernel (A by TMA, cooperative for both).
  EXPECT_EQ(on(h100, 98304, 160).down.family, KernelFamily::ws_gather);  // DeepSeek-V2: 614 rows
  const gg::LayerKernels oss = choose(65536, 128, 2880, 2880);  // gpt-oss-120b: 512 rows, n 2880
  EXPECT_EQ(oss.down.family, KernelFamily::ws_gather);
  EXPECT_EQ(oss.down.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(oss.dx.family, KernelFamily::ws_gather);
  EXPECT_EQ(oss.dx.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(choose(163840, 512, 2048, 320).down.family, KernelFamily::ws_gather);  // 320 rows
  EXPECT_EQ(choose(130944, 256, 4096, 1024).down.family, KernelFamily::ws_gather);
  EXPECT_EQ(on(h200, 1023 * 160, 160).down.family, KernelFamily::ws_gather);
  EXPECT_EQ(on(h200, 1024 * 160, 160).down.family, KernelFamily::tma_grouped);
  EXPECT_EQ(choose(262144, 256, 2048, 1024).dx.family, KernelFamily::tma_grouped);  // 1024 rows
  EXPECT_EQ(choose(130944, 5000, 4096, 1024).dx.family, KernelFamily::two_cta);  // E > 4096
  // dX̃ on the TMA path: 128x256 cooperative on clusters of 2 where it reduces over >= 3072 rows
  // of w1 and d >= 2560 (Mixtral-8x7B, ERNIE-4.5-21B), else 192x128 ping-pong (d = 2048 or
  // 2n = 2816 just below); down-proj the same where n >= 3072 (its reduction) and d >= 2560.
  const gg::LayerKernels mixtral = choose(32768, 8, 4096, 14336);
  EXPECT_EQ(gg::tma_variant(mixtral.dx), gg::kTmaWide);
  EXPECT_EQ(mixtral.dx.schedule, KernelSchedule::cooperative);
  EXPECT_EQ(mixtral.dx.cluster, 2);
  EXPECT_EQ(gg::tma_variant(mixtral.down), gg::kTmaWide);
  EXPECT_EQ(mixtral.down.cluster, 2);
  const gg::LayerKernels ernie = choose(72000, 64, 2560, 1536);  // n 1536: down stays
  EXPECT_EQ(gg::tma_variant(ernie.down), gg::kTmaPingPong);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2560, 3072).down), gg::kTmaWide);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2560, 3071).down), gg::kTmaPingPong);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2048, 8192).down), gg::kTmaPingPong);  // d < 2560
  // 178 E < S < 1024 E keeps the ws kernel whatever n is (512 rows, Llama-4's expert sizes).
  EXPECT_EQ(choose(65536, 128, 5120, 8192).down.family, KernelFamily::ws_gather);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2560, 1536).dx), gg::kTmaWide);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2048, 1536).dx), gg::kTmaPingPong);
  EXPECT_EQ(gg::tma_variant(choose(196608, 128, 4096, 1408).dx), gg::kTmaPingPong);
  // Ungated activations reduce over n rows of w1.
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2560, 3072, Activation::relu).dx), gg::kTmaWide);
  EXPECT_EQ(gg::tma_variant(choose(72000, 64, 2560, 2048, Activation::relu).dx),
            gg::kTmaPingPong);
  EXPECT_EQ(gg::describe(sm.up), "ws_gather cooperative 128x256x64 stages=4 cluster=1 raster=16");
  EXPECT_EQ(sm.sms, 132);  // the count the choice was made for
}

// The bands read the GPU's SM count (KernelShape::sms): 132 (H200, H100 SXM) gives the choices
// above; on fewer SMs (114: H100 PCIe) an expert needs fewer tiles to be banded, the bands are
// as many or fewer, and nothing but the bands changes. Host-only: runs without a GPU.
// kernel_candidates: per GEMM and shape, distinct kernels, each reproduced by its own spec, the
// automatic choice among them, and nothing an override refuses (E > 4096 leaves no ws kernel on
// the gathered GEMMs, swiglu_oai one kernel for up and dH).
TEST(GroupedGemmChecks, CandidatesHoldTheAutomaticChoiceOnce) {
  using gg::KernelFamily;
  const gg::KernelShape shapes[] = {
      {262144, 128, 4096, 1024, Activation::swiglu, 132},  // sm-default: TMA down / dX
      {131072, 64, 2048, 1024, Activation::swiglu, 114},   // olmoe on 114 SMs
      {327680, 512, 2048, 320, Activation::swiglu, 132},   // 640 rows per expert: ws down / dX
      {4000, 64, 512, 128, Activation::gelu, 132},         // < 128 rows per expert: 128x256 TMA
      {65536, 5000, 512, 256, Activation::swiglu, 132},    // E > 4096
      {65536, 32, 2880, 2880, Activation::swiglu_oai, 132},
      {131072, 16, 1024, 512, Activation::swiglu, 132}};   // 8192 rows per expert: dW1 clusters
  for (const gg::KernelShape& sh : shapes)
    for (int g = 0; g < gg::LayerKernels::kCount; ++g) {
      SCOPED_TRACE(std::string(gg::LayerKernels::name(g)) + " at S=" + std::to_string(sh.S) +
                   " E=" + std::to_string(sh.E));
      const std::vector<gg::KernelCandidate> c = gg::kernel_candidates(g, sh);
      ASSERT_FALSE(c.empty());
      const gg::GemmKernel chosen = gg::choose_kernels(sh, gg::KernelOverrides{}).at(g);
      int hits = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        EXPECT_EQ(gg::choose_kernels(sh, gg::parse_kernel_overrides(c[i].spec)).at(g),
                  c[i].kernel) << c[i].spec;
        for (size_t j = 0; j < i; ++j) EXPECT_NE(c[i].kernel, c[j].kernel) << c[i].spec;
        hits += c[i].kernel == chosen;
        if (sh.E > gg::kWsMaxExperts && g != gg::LayerKernels::kDw2 &&
            g != gg::LayerKernels::kDw1)
          EXPECT_NE(c[i].kernel.family, KernelFamily::ws_gather) << c[i].spec;
      }
      EXPECT_EQ(hits, 1) << gg::describe(chosen);
      const bool oai_own = sh.act == Activation::swiglu_oai &&
                           (g == gg::LayerKernels::kUp || g == gg::LayerKernels::kDh);
      if (oai_own) EXPECT_EQ(c.size(), 1u);
    }
  // Both schedules and every built TMA tile for dX at sm-default; dW1 on 1 and 2 CTAs, on 1 with
  // the TMA-store epilogue, and on two_cta.
  EXPECT_EQ(gg::kernel_candidates(gg::LayerKernels::kDx, shapes[0]).size(),
            size_t(gg::kTmaVariantCount) + 3);
  EXPECT_EQ(gg::kernel_candidates(gg::LayerKernels::kDw1, shapes[0]).size(), 4u);
  // The TMA-store epilogue: dW1 and dW2 on ws_varlen_k, one CTA a tile (shapes[6] puts dW1 on
  // clusters), 3 ring stages, and named in describe().
  const gg::GemmKernel ts = gg::choose_kernels(shapes[6], gg::parse_kernel_overrides(
                                                              "dw1.cluster=1,dw1.store_tma=1")).dw1;
  EXPECT_TRUE(ts.store_by_tma);
  EXPECT_EQ(ts.stages, gg::kWsVarlenKTmaStoreStages);
  EXPECT_NE(gg::describe(ts).find("store=tma"), std::string::npos) << gg::describe(ts);
  EXPECT_THROW(gg::choose_kernels(shapes[6], gg::parse_kernel_overrides("dw1.store_tma=1")),
               Unsupported);
  EXPECT_THROW(gg::choose_kernels(shapes[0], gg::parse_kernel_overrides("up.store_tma=1")),
               Unsupported);
  EXPECT_THROW(gg::parse_kernel_overrides("dw2.store_tma=2"), InvalidArgument);
  EXPECT_THROW(gg::kernel_candidates(6, shapes[0]), InvalidArgument);
}

// dh.cluster=2 / up.cluster=2: the cooperative gather kernels on clusters of 2, the rule's where
// an expert's rows fill two 128-row tiles and the GEMM is weight-bound, an override elsewhere;
// refused where that kernel does not run (dH: other activations, E > 2000; ping-pong; swiglu_oai's
// up-projection). Host-only.
TEST(GroupedGemmChecks, GatherClusterOverrides) {
  const gg::KernelShape oss{65536, 128, 2880, 2880};  // gpt-oss-120b's sizes, swiglu
  EXPECT_EQ(gg::choose_kernels(oss, gg::KernelOverrides{}).dh.cluster, 1);
  const gg::GemmKernel mc = gg::choose_kernels(oss, gg::parse_kernel_overrides("dh.cluster=2")).dh;
  EXPECT_EQ(mc.family, gg::KernelFamily::ws_gather);
  EXPECT_EQ(mc.schedule, gg::KernelSchedule::cooperative);
  EXPECT_EQ(mc.cluster, 2);
  EXPECT_NE(gg::describe(mc).find("cluster=2"), std::string::npos) << gg::describe(mc);
  gg::KernelShape relu = oss;
  relu.act = Activation::relu;
  relu.d = 4096;  // cooperative dH for the switch kernel
  EXPECT_THROW(gg::choose_kernels(relu, gg::parse_kernel_overrides("dh.cluster=2")), Unsupported);
  EXPECT_THROW(gg::choose_kernels(gg::KernelShape{65536, 2048, 2880, 2880},
                                  gg::parse_kernel_overrides("dh.cluster=2")),
               Unsupported);  // E > 2000: the ping-pong kernel
  EXPECT_THROW(gg::choose_kernels(oss, gg::parse_kernel_overrides(
                                           "dh.schedule=pingpong,dh.cluster=2")),
               Unsupported);
  const auto cands = gg::kernel_candidates(gg::LayerKernels::kDh, oss);
  EXPECT_TRUE(std::any_of(cands.begin(), cands.end(),
                          [](const gg::KernelCandidate& c) { return c.kernel.cluster == 2; }));
  // The up-projection's cooperative kernel too, for every activation but swiglu_oai.
  EXPECT_EQ(gg::choose_kernels(oss, gg::parse_kernel_overrides("up.cluster=2")).up.cluster, 2);
  EXPECT_EQ(gg::choose_kernels(relu, gg::parse_kernel_overrides("up.cluster=2")).up.cluster, 2);
  gg::KernelShape oai = oss;
  oai.act = Activation::swiglu_oai;
  EXPECT_THROW(gg::choose_kernels(oai, gg::parse_kernel_overrides("up.cluster=2")), Unsupported);
  EXPECT_THROW(gg::choose_kernels(oss, gg::parse_kernel_overrides(
                                           "up.schedule=pingpong,up.cluster=2")),
               Unsupported);

  // The rule: d >= 4096 and S / E in [118, min(240, FLOPs per DRAM byte - 1)] for dH (swiglu), the
  // up-projection to 150 rows an expert (Kimi-K2's W2, 29 MB, is below the 50 MiB L2 assumed
  // without a GPU, so the big-expert case below does not apply).
  auto at = [](int64_t rows, int64_t fpb, Activation act) {
    gg::KernelShape s{rows * 384, 384, 7168, 2048};  // Kimi-K2's sizes
    s.act = act;
    s.flops_per_byte = fpb;
    return gg::choose_kernels(s, gg::KernelOverrides{});
  };
  for (const int64_t rows : {118, 150}) {
    const gg::LayerKernels k = at(rows, 319, Activation::swiglu);
    EXPECT_EQ(k.up.cluster, 2) << rows;
    EXPECT_EQ(k.dh.cluster, 2) << rows;
    EXPECT_EQ(k.dh.schedule, gg::KernelSchedule::cooperative) << rows;
  }
  for (const int64_t rows : {151, 170, 240}) {
    const gg::LayerKernels k = at(rows, 319, Activation::swiglu);
    EXPECT_EQ(k.up.cluster, 1) << rows;
    EXPECT_EQ(k.dh.cluster, 2) << rows;
  }
  for (const int64_t rows : {117, 241, 512}) {
    const gg::LayerKernels k = at(rows, 319, Activation::swiglu);
    EXPECT_EQ(k.up.cluster, 1) << rows;
    EXPECT_EQ(k.dh.cluster, 1) << rows;
  }
  EXPECT_EQ(at(216, 217, Activation::swiglu).dh.cluster, 2);  // an H200: memory faster per FLOP
  EXPECT_EQ(at(217, 217, Activation::swiglu).dh.cluster, 1);
  EXPECT_EQ(at(140, 141, Activation::swiglu).up.cluster, 2);  // the window's edge under 150
  EXPECT_EQ(at(141, 141, Activation::swiglu).up.cluster, 1);
  EXPECT_EQ(at(141, 141, Activation::swiglu).dh.cluster, 1);
  EXPECT_EQ(at(140, 319, Activation::relu).up.cluster, 2);  // the shared kernel
  EXPECT_EQ(at(140, 319, Activation::relu).dh.cluster, 1);  // dH's switch kernel: single CTAs
  EXPECT_EQ(at(140, 319, Activation::swiglu_oai).up.cluster, 1);
  EXPECT_EQ(at(140, 319, Activation::swiglu_oai).dh.cluster, 1);
  gg::KernelShape short_k{140 * 384, 384, 4095, 2048};  // d < 4096: single CTAs share through L2
  short_k.flops_per_byte = 319;
  EXPECT_EQ(gg::choose_kernels(short_k, gg::KernelOverrides{}).up.cluster, 1);
  EXPECT_EQ(gg::choose_kernels(short_k, gg::KernelOverrides{}).dh.cluster, 1);
  short_k.d = 4096;
  EXPECT_EQ(gg::choose_kernels(short_k, gg::KernelOverrides{}).up.cluster, 2);
  // dH's pair at any rows from 118 an expert up where one expert's W2 (n x d bf16) is at least
  // the L2 (DBRX's sizes, 4096 rows an expert: 132 MB against 50 MiB); not the up-projection.
  gg::KernelShape dbrx{65536, 16, 6144, 10752};
  dbrx.flops_per_byte = 319;
  dbrx.l2_bytes = int64_t(50) << 20;
  EXPECT_EQ(gg::choose_kernels(dbrx, gg::KernelOverrides{}).dh.cluster, 2);
  EXPECT_EQ(gg::choose_kernels(dbrx, gg::KernelOverrides{}).up.cluster, 1);
  EXPECT_NE(std::string(gg::choose_kernels(dbrx, gg::KernelOverrides{}).dh.rule).find("L2"),
            std::string::npos);
  gg::KernelShape edge = dbrx;
  edge.l2_bytes = dbrx.n * dbrx.d * 2;  // W2 exactly the L2: pairs
  EXPECT_EQ(gg::choose_kernels(edge, gg::KernelOverrides{}).dh.cluster, 2);
  edge.l2_bytes += 1;  // W2 below the L2: single CTAs share it through L2
  EXPECT_EQ(gg::choose_kernels(edge, gg::KernelOverrides{}).dh.cluster, 1);
  gg::KernelShape few = dbrx;
  few.S = 117 * few.E;  // one 128-row tile an expert: nothing to pair
  EXPECT_EQ(gg::choose_kernels(few, gg::KernelOverrides{}).dh.cluster, 1);
  gg::KernelShape narrow = dbrx;
  narrow.d = 3968;  // d < 4096, outside what was measured
  narrow.n = 16384;
  EXPECT_EQ(gg::choose_kernels(narrow, gg::KernelOverrides{}).dh.cluster, 1);
  gg::KernelShape relu_big = dbrx;
  relu_big.act = Activation::relu;  // dH's switch kernel has no pair
  EXPECT_EQ(gg::choose_kernels(relu_big, gg::KernelOverrides{}).dh.cluster, 1);
  gg::KernelShape kimi{170 * 384, 384, 7168, 2048};
  kimi.flops_per_byte = 319;
  EXPECT_EQ(gg::choose_kernels(kimi, gg::parse_kernel_overrides("up.cluster=1,dh.cluster=1")).up.cluster, 1);
  EXPECT_EQ(gg::choose_kernels(kimi, gg::parse_kernel_overrides("dh.schedule=pingpong")).dh.cluster, 1);
  EXPECT_EQ(gg::choose_kernels(kimi, gg::parse_kernel_overrides("up.family=two_cta")).up.cluster, 1);
}

// A benchmark row's own spec over --kernels (layer_kernel_overrides): the GEMMs the row names take
// its fields alone, so --kernels cannot combine with a row into a kernel nobody asked for (and
// that an override refuses); every other GEMM and the global keys keep --kernels'. Host-only.
TEST(GroupedGemmChecks, RowSpecReplacesTheBaseForTheGemmsItNames) {
  using LK = gg::LayerKernels;
  const gg::KernelOverrides base =
      gg::parse_kernel_overrides("dw1.schedule=pingpong,dw2.store_tma=0,raster=8,tma.bands=4");
  const gg::KernelOverrides row = gg::parse_kernel_overrides("dw1.family=ws,dw1.cluster=2,tma.bands=2");
  const gg::KernelOverrides o = gg::layer_kernel_overrides(base, row);
  EXPECT_FALSE(o.gemm[LK::kDw1].schedule.has_value());
  EXPECT_EQ(o.gemm[LK::kDw1].cluster, 2);
  EXPECT_EQ(o.gemm[LK::kDw1].family, gg::KernelFamily::ws_varlen_k);
  EXPECT_EQ(o.gemm[LK::kDw2].store_tma, false);  // a GEMM the row leaves alone keeps the base's
  EXPECT_EQ(o.raster_group, 8);
  EXPECT_EQ(o.tma_bands, 2);  // a global key the row sets wins
  // Its spec says what is in force: the base's dw1 item gone.
  EXPECT_EQ(o.spec, "dw2.store_tma=0,raster=8,tma.bands=4," + row.spec);
  EXPECT_EQ(gg::parse_kernel_overrides(o.spec).gemm[LK::kDw1].schedule, std::nullopt);
  const gg::KernelShape olmoe{262144, 64, 2048, 1024};
  // Concatenated, the two specs ask for a varlen-K ping-pong dW1, which no kernel runs.
  EXPECT_THROW(gg::choose_kernels(olmoe, gg::parse_kernel_overrides(base.spec + "," + row.spec)),
               Unsupported);
  const gg::LayerKernels k = gg::choose_kernels(olmoe, o);
  EXPECT_EQ(k.dw1.cluster, 2);
  EXPECT_EQ(k.dw1.schedule, gg::KernelSchedule::cooperative);
  EXPECT_FALSE(k.dw2.store_by_tma);
  // Either side empty: the other as it is.
  EXPECT_EQ(gg::layer_kernel_overrides(base, {}).spec, base.spec);
  EXPECT_EQ(gg::layer_kernel_overrides({}, row).gemm[LK::kDw1].cluster, 2);
}

TEST(GroupedGemmChecks, TmaBandsFollowTheSmCount) {
  const gg::KernelOverrides none;
  auto choose = [&](int64_t S, int64_t E, int64_t d, int64_t n, int64_t sms,
                    Activation act = Activation::swiglu) {
    return gg::choose_kernels({S, E, d, n, act, sms, gg::kFallbackL2Bytes}, none);
  };
  // sm-7B-n256 (96 tiles per expert): ceil(8 * 114 / 96) = 10 bands on 114 SMs, 11 on 132.
  EXPECT_EQ(choose(196608, 128, 1536, 256, 114).down.tma_bands, 10);
  EXPECT_EQ(choose(196608, 128, 1536, 256, 114).dx.tma_bands, 10);
  EXPECT_EQ(choose(196608, 128, 1536, 256, 132).down.tma_bands, 11);
  // sm-1.4B-n256 (84 tiles): ceil(8 * 114 / 84) = 11; 13 on 132.
  EXPECT_EQ(choose(327680, 128, 768, 256, 114).down.tma_bands, 11);
  // 120 tiles per expert (10 x 12 at 192 x 128, K = 256): banded on 132 SMs (ceil(1056 / 120)
  // = 9), not on 114 (as many tiles as SMs or more: CUTLASS's order).
  const int64_t kL2 = gg::kFallbackL2Bytes;  // 50 MiB, the H100 SXM's
  EXPECT_EQ(gg::tma_bands_rule(122880, 64, 1536, 256, 192, 128, 132, kL2), 9);
  EXPECT_EQ(gg::tma_bands_rule(122880, 64, 1536, 256, 192, 128, 114, kL2), 1);
  EXPECT_EQ(gg::tma_bands_rule(122880, 64, 1536, 256, 192, 128, 0, kL2), 1);  // no SMs: no bands
  // The bands' weights fit in 24 MiB, or 12/25 of a smaller L2: 12 MiB of weights per band
  // (N 12288 x K 512, bf16) take 2 bands with 50 MiB of L2 (and with 60: the 24 MiB cap), 1 with
  // 40 MiB (19.2 MiB for them); no L2 read: no bands.
  EXPECT_EQ(gg::tma_bands_rule(24576, 128, 12288, 512, 192, 128, 132, int64_t(60) << 20), 2);
  EXPECT_EQ(gg::tma_bands_rule(24576, 128, 12288, 512, 192, 128, 132, int64_t(40) << 20), 1);
  EXPECT_EQ(gg::tma_bands_rule(24576, 128, 12288, 512, 192, 128, 132, 0), 1);
  EXPECT_EQ(gg::band_weight_bytes(int64_t(50) << 20), gg::kBandWeightBytes);
  EXPECT_EQ(gg::band_weight_bytes(int64_t(25) << 20), int64_t(12) << 20);
  // Over the named configs' and the public-model grid's kinds of shapes: only the bands differ
  // between 114 and 132 SMs, never more of them on fewer SMs; sms = 0 takes the current device's
  // count (kFallbackSms where no GPU is visible) and says which.
  for (const int64_t d : {768, 1536, 2048, 2880, 4096, 7168})
    for (const int64_t n : {256, 512, 768, 1408, 2048})
      for (const int64_t E : {8, 16, 64, 128, 160, 256, 384})
        for (const int64_t rows : {128, 256, 512, 1024, 2048, 4096}) {
          const int64_t S = E * rows;
          const gg::LayerKernels a = choose(S, E, d, n, 114), b = choose(S, E, d, n, 132);
          EXPECT_EQ(a.sms, 114);
          for (int i = 0; i < gg::LayerKernels::kCount; ++i) {
            gg::GemmKernel x = a.at(i), y = b.at(i);
            EXPECT_LE(x.tma_bands, y.tma_bands) << gg::LayerKernels::name(i) << " S " << S;
            x.tma_bands = y.tma_bands;
            EXPECT_TRUE(x == y) << gg::LayerKernels::name(i) << " S " << S;
          }
        }
  const gg::DeviceProps dev = gg::current_device_props();
  EXPECT_GE(dev.sms, 1);
  EXPECT_GE(dev.l2_bytes, 1);
  EXPECT_TRUE(dev.device >= 0 || (dev.sms == gg::kFallbackSms &&
                                   dev.l2_bytes == gg::kFallbackL2Bytes));
  EXPECT_EQ(choose(196608, 128, 1536, 256, 0).sms, dev.sms);
  EXPECT_EQ(gg::choose_kernels({196608, 128, 1536, 256, Activation::swiglu, 132}, none).l2_bytes,
            dev.l2_bytes);
}

// The choice is total and deterministic over a grid of shapes (real models' sizes: d up to 8192,
// n from 64 to 8192 incl. multiples of 64 that are not of 128, E up to 5000, S from 0), and every
// field is in its kernel's range.
TEST(GroupedGemmChecks, KernelChoiceIsTotalAndDeterministic) {
  using gg::KernelFamily;
  const gg::KernelOverrides none;
  int shapes = 0;
  for (const Activation act : {Activation::swiglu, Activation::gelu, Activation::swiglu_oai})
    for (const int64_t d : {64, 512, 1536, 2048, 3072, 4096, 5120, 7168, 8192})
      for (const int64_t n : {64, 192, 256, 320, 704, 1024, 1536, 2048, 8192})
        for (const int64_t E : {1, 4, 64, 128, 160, 256, 512, 4096, 5000})
          for (const int64_t S : {int64_t(0), int64_t(1), E * 127, E * 128, E * 4096, E * 8192}) {
            if (act == Activation::swiglu_oai && E > gg::kWsMaxExperts) continue;  // refused
            const gg::KernelShape shape{S, E, d, n, act};
            const gg::LayerKernels a = gg::choose_kernels(shape, none);
            const gg::LayerKernels b = gg::choose_kernels(shape, none);
            ASSERT_TRUE(a == b) << "act " << int(act) << " d " << d << " n " << n << " E " << E
                                << " S " << S;
            for (int i = 0; i < gg::LayerKernels::kCount; ++i) {
              const gg::GemmKernel& k = a.at(i);
              SCOPED_TRACE(std::string(gg::LayerKernels::name(i)) + " " + gg::describe(k));
              const bool gathered = i == 0 || i == 2 || i == 3 || i == 5;
              EXPECT_TRUE((k.family == KernelFamily::tma_grouped ||
                           (k.tile_m == 128 && (k.tile_n == 128 || k.tile_n == 256))) &&
                          k.tile_k == 64);
              EXPECT_TRUE(k.cluster == 1 || k.cluster == 2);
              EXPECT_TRUE(k.stages >= 0 && k.stages <= 8);
              EXPECT_FALSE(gathered && k.family == KernelFamily::tma_grouped);
              // down / dX (contiguous A) may run on ws_gather (A by TMA), never on varlen-K.
              EXPECT_FALSE(!gathered && k.family == KernelFamily::ws_varlen_k);
              EXPECT_FALSE(k.family == KernelFamily::ws_gather && E > gg::kWsMaxExperts);
              EXPECT_FALSE(k.cluster == 2 && k.family == KernelFamily::two_cta);
              // a TMA-path choice is one of the built kernels
              EXPECT_TRUE(k.family != KernelFamily::tma_grouped || gg::tma_variant(k) >= 0);
              EXPECT_TRUE(k.tma_bands >= 1 && k.tma_bands <= gg::kMaxTmaBands);
              EXPECT_TRUE(k.tma_bands == 1 || (k.family == KernelFamily::tma_grouped &&
                                               k.tma_bands <= std::max<int64_t>(E, 1)));
              EXPECT_STRNE(k.rule, "");
            }
            ++shapes;
          }
  EXPECT_EQ(shapes, (9 + 9 + 8) * 9 * 9 * 6);  // E values per activation (swiglu_oai: E <= 4096)
}

// The token-chunk rule (cuda/layer/token_chunks.hpp) on the named configs and over the choice
// grid: one chunk in keep_h, on the cp.async kernel and for d < 2n; in recompute min(ceil(d / n),
// S / (512 E)) chunks of ceil(S / count) + E rows; total, deterministic, and the override
// replaces the count in both modes.
TEST(GroupedGemmChecks, TokenChunksFollowTheRule) {
  const gg::KernelOverrides none;
  auto chunks = [&](int64_t S, int64_t E, int64_t d, int64_t n, std::optional<int> o = {},
                    LayerMode mode = LayerMode::recompute) {
    LayerConfig c;
    c.d = d, c.n = n, c.E = E, c.T = S, c.K = 1;
    return cuda::choose_token_chunks(c, S, mode, gg::choose_kernels({S, E, d, n}, none), {o, o});
  };
  // sm-default: d / n = 4 and 2048 rows per expert: 4 chunks of dX̃; the forward's A and Y
  // (S (n + d) elements) stay under backward's H/dH, A' and weight gradients: no forward chunks.
  const cuda::LayerChunks sm = chunks(262144, 128, 4096, 1024);
  EXPECT_EQ(sm.backward, (cuda::TokenChunks{4, 65536 + 128}));
  EXPECT_EQ(sm.forward, cuda::TokenChunks::none(262144));
  // Eight times the tokens: the forward's transients outgrow backward's, so Y is chunked too,
  // and 8 chunks (2048 rows per expert each) instead of ceil(d / n) = 4.
  EXPECT_EQ(chunks(262144 * 8, 128, 4096, 1024).forward.count, 8);
  // keep_h runs the whole step.
  const cuda::LayerChunks keep = chunks(262144, 128, 4096, 1024, {}, LayerMode::keep_h);
  EXPECT_EQ(keep.forward, cuda::TokenChunks::none(262144));
  EXPECT_EQ(keep.backward, cuda::TokenChunks::none(262144));
  // sm-7B-n256: d / n = 6, but 1536 rows per expert allow 3 chunks of >= 512.
  EXPECT_EQ(chunks(196608, 128, 1536, 256).backward.count, 3);
  EXPECT_EQ(chunks(131072, 64, 2048, 1024).backward.count, 2);  // olmoe: d / n = 2
  EXPECT_EQ(chunks(262144, 16, 1024, 4096).backward.count, 1);  // mb-conf3: d < n
  EXPECT_EQ(chunks(49152, 32, 1536, 1024).backward.count, 1);   // sm-7B-n1024: d < 2n
  EXPECT_EQ(chunks(49152, 32, 2048, 1024).backward.count, 2);   // d = 2n
  EXPECT_EQ(chunks(20000, 5000, 512, 256).backward.count, 1);   // the cp.async kernel (E > 4096)
  EXPECT_EQ(chunks(1000, 8, 512, 256).backward.count, 1);       // 125 rows per expert
  EXPECT_EQ(chunks(0, 8, 512, 128).forward, cuda::TokenChunks::none(0));
  // The override: any count on the TMA path (also for d < 2n and in keep_h), still one chunk
  // on the cp.async kernel.
  EXPECT_EQ(chunks(4096, 8, 256, 512, 5).backward, (cuda::TokenChunks{5, 820 + 8}));
  EXPECT_EQ(chunks(4096, 8, 256, 512, 5).forward, (cuda::TokenChunks{5, 820 + 8}));
  EXPECT_EQ(chunks(4096, 8, 256, 512, 5, LayerMode::keep_h).forward.count, 5);
  EXPECT_EQ(chunks(20000, 5000, 512, 256, 5).backward.count, 1);
  EXPECT_EQ(chunks(1000, 8, 512, 256, 5).backward.count, 5);  // 128x256 TMA tiles: chunks
  EXPECT_EQ(chunks(4096, 8, 256, 128, 1).backward.count, 1);
  EXPECT_EQ(gg::parse_kernel_overrides("chunks=7").token_chunks.forward, 7);
  EXPECT_EQ(gg::parse_kernel_overrides("chunks=7").token_chunks.backward, 7);
  const gg::KernelOverrides bwd_only = gg::parse_kernel_overrides("chunks.bwd=3");
  EXPECT_FALSE(bwd_only.token_chunks.forward.has_value());
  EXPECT_EQ(bwd_only.token_chunks.backward, 3);
  LayerConfig sm_cfg;
  sm_cfg.d = 4096, sm_cfg.n = 1024, sm_cfg.E = 128, sm_cfg.T = 32768, sm_cfg.K = 8;
  const cuda::LayerChunks keep_bwd = cuda::choose_token_chunks(
      sm_cfg, 262144, LayerMode::keep_h, gg::choose_kernels({262144, 128, 4096, 1024}, none),
      bwd_only.token_chunks);
  EXPECT_EQ(keep_bwd.forward.count, 1);
  EXPECT_EQ(keep_bwd.backward.count, 3);
  // The warp-specialised kernel takes row ranges too (down/dx.family=ws), also at a shape whose
  // automatic choice is another (125 rows an expert: the single-CTA TMA tile).
  const gg::KernelOverrides on_ws =
      gg::parse_kernel_overrides("down.family=ws,dx.family=ws,chunks=5");
  LayerConfig small = sm_cfg;
  small.d = 512, small.n = 256, small.E = 8, small.T = 1000, small.K = 1;
  const cuda::LayerChunks ws_chunks =
      cuda::choose_token_chunks(small, 1000, LayerMode::keep_h,
                                gg::choose_kernels({1000, 8, 512, 256}, on_ws), on_ws.token_chunks);
  EXPECT_EQ(ws_chunks.forward, (cuda::TokenChunks{5, 200 + 8}));
  EXPECT_EQ(ws_chunks.backward, (cuda::TokenChunks{5, 200 + 8}));
  EXPECT_EQ(cuda::describe(sm.backward),
            "4 chunks of <= 65664 rows (ceil(d / n): a chunk buffer no larger than A's (S, n))");
  // At the largest T (sm-default, T = 1,310,720: S = 10,485,760) chunks of ~2048 rows per expert:
  // the chunk buffer stops growing with T.
  const cuda::LayerChunks big = chunks(10485760, 128, 4096, 1024);
  EXPECT_EQ(big.backward.count, 40);
  EXPECT_EQ(big.forward.count, 40);
  EXPECT_STREQ(big.backward.rule, "S / (2048 E): the chunk buffer stops growing with T");
  EXPECT_EQ(chunks(128 * 8192, 128, 1536, 512).backward.count, 4);  // 4 > ceil(d / n) = 3
  int shapes = 0;
  for (const int64_t d : {64, 512, 1536, 4096, 7168})
    for (const int64_t n : {64, 192, 320, 1024, 8192})
      for (const int64_t E : {1, 8, 128, 512, 5000})
        for (const int64_t S : {int64_t(0), int64_t(1), E * 127, E * 128, E * 1000, E * 8192}) {
          const cuda::LayerChunks a = chunks(S, E, d, n), b = chunks(S, E, d, n);
          ASSERT_TRUE(a.forward == b.forward && a.backward == b.backward)
              << "d " << d << " n " << n << " E " << E << " S " << S;
          EXPECT_TRUE(a.forward.count == 1 || a.forward == a.backward);
          const cuda::LayerChunks k = chunks(S, E, d, n, {}, LayerMode::keep_h);
          EXPECT_TRUE(k.forward.count == 1 && k.backward.count == 1);
          for (const cuda::TokenChunks& c : {a.forward, a.backward}) {
            EXPECT_GE(c.count, 1);
            EXPECT_STRNE(c.rule, "");
            if (c.count == 1) {
              EXPECT_EQ(c.rows, S);
            } else {
              EXPECT_GE(d, 2 * n);
              EXPECT_LE(c.count, std::max((d + n - 1) / n,
                                          S / (E * cuda::kChunkRowsPerExpertAtScale)));
              EXPECT_GE(S / (E * c.count), cuda::kChunkMinRowsPerExpert);
              EXPECT_EQ(c.rows, (S + c.count - 1) / c.count + E);
              EXPECT_LT(c.rows, S);
            }
          }
          ++shapes;
        }
  EXPECT_EQ(shapes, 5 * 5 * 5 * 6);
}

// The layer's GEMM scratch is sized from down / dX̃'s choice at placeholder d and n: the other
// GEMMs' overrides must not enter it (a dh override that cannot apply at d = 64 once made every
// layer call with it fail). The choice is host-only; the bytes ask the device.
TEST(GroupedGemmChecks, ContiguousChoiceReadsOnlyDownAndDxOverrides) {
  const int64_t S = 262144, E = 128;  // 2048 rows per expert: down / dX̃ on the TMA path
  const gg::LayerKernels automatic = gg::contiguous_kernels(S, E, gg::KernelOverrides{});
  EXPECT_EQ(automatic.down.family, gg::KernelFamily::tma_grouped);
  // Refused by choose_kernels at any shape (a schedule on the 2-CTA kernel), ignored here.
  const gg::LayerKernels other = gg::contiguous_kernels(
      S, E, gg::parse_kernel_overrides("dh.family=two_cta,dh.schedule=pingpong"));
  EXPECT_EQ(other.down, automatic.down);
  EXPECT_EQ(other.dx, automatic.dx);
  const gg::LayerKernels two_cta =
      gg::contiguous_kernels(S, E, gg::parse_kernel_overrides("down.family=two_cta,dx.cluster=1"));
  EXPECT_EQ(two_cta.down.family, gg::KernelFamily::two_cta);
  EXPECT_EQ(two_cta.dx.cluster, 1);
}

TEST(GroupedGemmChecks, ScratchSizeReadsOnlyDownAndDxOverrides) {
  MOEBLAZE_REQUIRE_GPU();
  struct Restore {
    ~Restore() { gg::clear_kernel_overrides(); }
  } restore;
  const int64_t S = 262144, E = 128;
  const size_t automatic = gg::layer_gemm_scratch_bytes(S, E);
  EXPECT_GT(automatic, 0u);
  gg::set_kernel_overrides(gg::parse_kernel_overrides("dh.family=two_cta,dh.schedule=pingpong"));
  EXPECT_EQ(gg::layer_gemm_scratch_bytes(S, E), automatic);
  gg::set_kernel_overrides(gg::parse_kernel_overrides("down.family=two_cta,dx.family=two_cta"));
  EXPECT_EQ(gg::layer_gemm_scratch_bytes(S, E), 0u);
}

// One override hook: parsed field by field, applied by choose_kernels, refused with a message
// naming the item where a kernel cannot take it.
TEST(GroupedGemmChecks, KernelOverridesParseApplyAndRefuse) {
  using gg::KernelFamily;
  const gg::KernelShape sm{262144, 128, 4096, 1024};
  const gg::LayerKernels k = gg::choose_kernels(
      sm, gg::parse_kernel_overrides("dw1.cluster=2,dh.schedule=pingpong,down.family=two_cta,"
                                     "up.family=two_cta,raster=8,tma.order=m,tma.swizzle=4"));
  EXPECT_EQ(k.dw1.cluster, 2);
  EXPECT_EQ(k.dh.schedule, gg::KernelSchedule::ping_pong);
  EXPECT_EQ(k.down.family, KernelFamily::two_cta);
  EXPECT_EQ(k.dx.family, KernelFamily::tma_grouped);
  EXPECT_FALSE(k.dx.tma_along_n);
  EXPECT_EQ(k.dx.tma_swizzle, 4);
  EXPECT_EQ(k.up.family, KernelFamily::two_cta);
  EXPECT_EQ(k.up.raster_group, 8);
  EXPECT_TRUE(gg::parse_kernel_overrides("impl=naive").naive);
  EXPECT_FALSE(gg::parse_kernel_overrides("").pdl.has_value());
  EXPECT_EQ(gg::parse_kernel_overrides("pdl=1").pdl, std::optional<bool>(true));
  EXPECT_EQ(gg::parse_kernel_overrides("raster=4,pdl=0").pdl, std::optional<bool>(false));
  // tma.bands: both TMA-path GEMMs, nothing else.
  const gg::LayerKernels banded =
      gg::choose_kernels(sm, gg::parse_kernel_overrides("tma.bands=5,dw2.family=ws"));
  EXPECT_EQ(banded.down.tma_bands, 5);
  EXPECT_EQ(banded.dx.tma_bands, 5);
  EXPECT_EQ(banded.dw2.tma_bands, 1);
  EXPECT_NE(gg::describe(banded.dx).find(" bands=5"), std::string::npos) << gg::describe(banded.dx);
  auto refused = [&](const std::string& spec, const char* what) {
    try {
      gg::choose_kernels(sm, gg::parse_kernel_overrides(spec));
      ADD_FAILURE() << spec << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused("up.family=tma", "gathered operand cannot come by TMA");
  const gg::LayerKernels ws = gg::choose_kernels(
      sm, gg::parse_kernel_overrides("down.family=ws,dx.family=ws,dx.schedule=pingpong"));
  EXPECT_EQ(ws.down.family, KernelFamily::ws_gather);
  EXPECT_EQ(ws.down.schedule, gg::KernelSchedule::cooperative);
  EXPECT_EQ(ws.dx.schedule, gg::KernelSchedule::ping_pong);
  // On tma the fields not given come from the first built variant with the given ones.
  const gg::LayerKernels co = gg::choose_kernels(sm, gg::parse_kernel_overrides("dx.schedule=cooperative"));
  EXPECT_EQ(gg::tma_variant(co.dx), 0);  // 192x128 cooperative is not built: the first cooperative
  const gg::LayerKernels pp = gg::choose_kernels(
      sm, gg::parse_kernel_overrides("dx.family=tma,dx.schedule=pingpong"));
  EXPECT_EQ(pp.dx.family, KernelFamily::tma_grouped);
  EXPECT_EQ(pp.dx.tile_m, 192);
  EXPECT_EQ(pp.dx.tile_n, 128);
  EXPECT_EQ(pp.dx.cluster, 2);
  EXPECT_EQ(gg::tma_variant(pp.dx), 3);
  const gg::LayerKernels wide = gg::choose_kernels(sm, gg::parse_kernel_overrides("down.tile=256x128"));
  EXPECT_EQ(gg::tma_variant(wide.down), 2);
  EXPECT_EQ(wide.down.schedule, gg::KernelSchedule::cooperative);
  EXPECT_EQ(gg::tma_variant(wide.dx), gg::kTmaPingPong);  // the automatic choice, untouched
  EXPECT_EQ(gg::tma_variant(gg::choose_kernels(sm, gg::parse_kernel_overrides("dx.cluster=1")).dx), 1);
  refused("dx.tile=192x128,dx.cluster=1", "no built kernel has tile 192x128 cluster 1");
  refused("down.tile=256x256", "(built: 128x256 cooperative cluster 2,");
  refused("dx.tile=12", "the tile must be MxN");
  refused("up.tile=128x128", "only down_proj and dx_proj on tma_grouped have a tile choice");
  refused("down.family=ws,down.tile=256x128", "only down_proj and dx_proj on tma_grouped");
  refused("dw2.schedule=pingpong", "only the ws_gather family");
  refused("dh.schedule=pingpong,dh.cluster=2", "up_proj and dh_proj on ws_gather cooperative");
  refused("down.family=two_cta,down.cluster=1", "run on clusters");
  EXPECT_EQ(gg::choose_kernels(sm, gg::parse_kernel_overrides("dx.cluster=1")).dx.cluster, 1);
  refused("dw1.cluster=3", "[1, 2]");
  refused("raster=0", "[1, 65536]");
  refused("up.colour=red", "unknown field 'colour'");
  refused("wx.family=ws", "unknown key 'wx.family'");
  refused("dh", "expected key=value");
  refused("chunks=0", "[1, 1024]");
  refused("tma.bands=0", "[1, 64]");
  refused("tma.bands=65", "[1, 64]");
  refused("pdl=2", "[0, 1]");
  // swiglu_oai: up and dh on its own ws cooperative kernels; nothing else takes it.
  const gg::KernelShape oai_shape{196608, 128, 1536, 256, Activation::swiglu_oai};
  const gg::LayerKernels oai = gg::choose_kernels(oai_shape, gg::KernelOverrides{});
  EXPECT_EQ(oai.dh.family, KernelFamily::ws_gather);
  EXPECT_EQ(oai.dh.schedule, gg::KernelSchedule::cooperative);
  EXPECT_EQ(oai.up.schedule, gg::KernelSchedule::cooperative);
  for (const char* spec : {"dh.schedule=pingpong", "up.family=two_cta"}) {
    try {
      gg::choose_kernels(oai_shape, gg::parse_kernel_overrides(spec));
      ADD_FAILURE() << spec << " was accepted for swiglu_oai";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("swiglu_oai runs on its own"), std::string::npos)
          << e.what();
    }
  }
  for (const char* spec : {"dh.family=ws", "down.family=ws"}) {
    try {
      gg::choose_kernels({1 << 20, 5000, 4096, 1024}, gg::parse_kernel_overrides(spec));
      ADD_FAILURE() << spec << " with E = 5000 was accepted";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find("E <= 4096"), std::string::npos) << e.what();
    }
  }
}

// The FP8 GEMMs' kernel value: the default, each built override, and what is not built.
TEST(GroupedGemmChecks, Fp8KernelIsAValueWithOverrides) {
  const gg::Fp8Kernel def = gg::choose_fp8_kernel(gg::KernelOverrides{});
  EXPECT_EQ(def, gg::kFp8Default);
  EXPECT_EQ(gg::fp8_variant(def), 1);
  EXPECT_EQ(gg::describe(def), "fp8 cooperative 128x128x128 cluster=2");
  const gg::Fp8Kernel c1 = gg::choose_fp8_kernel(gg::parse_kernel_overrides("fp8.cluster=1"));
  EXPECT_EQ(c1.cluster, 1);
  EXPECT_EQ(c1.schedule, gg::KernelSchedule::cooperative);
  EXPECT_EQ(gg::fp8_variant(c1), 0);
  EXPECT_STREQ(c1.rule, "override");
  // A schedule alone keeps the default's cluster where built; ping-pong runs on single CTAs.
  EXPECT_EQ(gg::choose_fp8_kernel(gg::parse_kernel_overrides("fp8.schedule=cooperative")).cluster,
            gg::kFp8Default.cluster);
  const gg::Fp8Kernel pp = gg::choose_fp8_kernel(gg::parse_kernel_overrides("fp8.schedule=pingpong"));
  EXPECT_EQ(gg::fp8_variant(pp), 2);
  EXPECT_EQ(gg::describe(pp), "fp8 ping_pong 64x128x128 cluster=1");
  // Every built kernel has its own index; the overrides leave the bf16 GEMMs' choice alone.
  for (int v = 0; v < 3; ++v) EXPECT_EQ(gg::fp8_variant(gg::kFp8Kernels[v]), v);
  const gg::KernelShape sm{262144, 128, 4096, 1024};
  EXPECT_EQ(gg::choose_kernels(sm, gg::parse_kernel_overrides("fp8.cluster=2,fp8.schedule=cooperative")),
            gg::choose_kernels(sm, gg::KernelOverrides{}));
  auto refused = [](const std::string& spec, const char* what) {
    try {
      gg::choose_fp8_kernel(gg::parse_kernel_overrides(spec));
      ADD_FAILURE() << spec << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused("fp8.schedule=pingpong,fp8.cluster=2", "ping_pong on clusters of 2 is not built");
  refused("fp8.cluster=3", "[1, 2]");
  refused("fp8.schedule=fast", "cooperative or pingpong");
  refused("fp8.tile=256x128", "unknown key 'fp8.tile'");
}

// Invalid arguments throw before anything runs and leave the outputs untouched.
TEST(GroupedGemmChecks, InvalidArgumentsLeaveOutputsUntouched) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t E = 2, d = 128, n = 128, T = 40;
  HostPlan P = make_plan(T, E, Pattern::one_expert, seed);  // S = T > 0
  DevPlan dp(P);
  DevBuf x, w1, w2;
  upload(x, rand_bf16(size_t(T * d), seed + 1, 1.0f));
  upload(w1, rand_bf16(size_t(E * 2 * n * d), seed + 2, 0.1f));
  upload(w2, rand_bf16(size_t(E * d * n), seed + 3, 0.1f));
  DevBuf h(size_t(std::max<int64_t>(P.S, 1) * 2 * n) * 2), a(size_t(std::max<int64_t>(P.S, 1) * n) * 2);
  h.poison();
  a.poison();
  const auto h0 = download<uint8_t>(h), a0 = download<uint8_t>(a);

  auto expect_msg = [](auto&& fn, const char* needle, bool unsupported) {
    try {
      fn();
      ADD_FAILURE() << "no exception; expected '" << needle << "'";
    } catch (const Unsupported& e) {
      EXPECT_TRUE(unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    } catch (const InvalidArgument& e) {
      EXPECT_FALSE(unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const auto act = Activation::swiglu;
  expect_msg([&] { gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), 100, n, act, nullptr); },
             "d (100) must be a multiple of 64", true);
  expect_msg([&] { gg::up_proj(dp.view, cb(x), cb(w1), mb(h), mb(a), d, 0, act, nullptr); },
             "up_proj: n (0) must be positive", false);
  expect_msg([&] { gg::up_proj(dp.view, nullptr, cb(w1), mb(h), mb(a), d, n, act, nullptr); },
             "up_proj: x must not be null", false);
  expect_msg([&] { gg::up_proj(dp.view, cb(x), cb(w1), nullptr, nullptr, d, n, act, nullptr); },
             "up_proj: h and a must not both be null", false);
  RoutingPlanView cpu = dp.view;
  cpu.device = Device::cpu;
  expect_msg([&] { gg::up_proj(cpu, cb(x), cb(w1), mb(h), mb(a), d, n, act, nullptr); },
             "up_proj: plan must be on cuda (got cpu)", false);
  RoutingPlanView many_e = dp.view;  // only E is read before the refusal
  many_e.E = 4097;
  expect_msg([&] {
    gg::up_proj(many_e, cb(x), cb(w1), mb(h), mb(a), d, n, act, nullptr,
                gg::GatherKernel::warp_specialized);
  }, "up_proj: the warp-specialised kernel takes E <= 4096 experts (got 4097)", true);
  expect_msg([&] {
    gg::dh_proj(many_e, cb(x), cb(w2), cb(h), reinterpret_cast<float*>(mb(a)), mb(h), mb(a), d,
                n, act, nullptr, gg::GatherKernel::warp_specialized);
  }, "dh_proj: the warp-specialised kernel takes E <= 4096 experts (got 4097)", true);
  expect_msg([&] {
    gg::dh_proj(many_e, cb(x), cb(w2), cb(h), reinterpret_cast<float*>(mb(a)), mb(h), mb(a), d,
                n, act, nullptr, gg::GatherKernel::ping_pong);
  }, "dh_proj: the warp-specialised kernel takes E <= 4096 experts (got 4097)", true);
  expect_msg([&] { gg::dw2_proj(dp.view, cb(x), cb(a), mb(h), d, n, nullptr, gg::GatherKernel::ping_pong); },
             "dw2_proj: GatherKernel::ping_pong is implemented for up_proj and dh_proj only", true);
  expect_msg([&] {
    gg::dw1_proj(dp.view, cb(h), cb(x), mb(w1), d, n, act, nullptr, gg::GatherKernel::ping_pong);
  }, "dw1_proj: GatherKernel::ping_pong is implemented for up_proj and dh_proj only", true);
  RoutingPlanView no_w = dp.view;
  no_w.slot_weights = nullptr;
  expect_msg([&] {
    gg::dh_proj(no_w, cb(x), cb(w2), cb(h), reinterpret_cast<float*>(mb(a)), mb(h), mb(a), d, n,
                act, nullptr);
  }, "dh_proj: plan.slot_weights must not be null", false);
  RoutingPlanView no_e = dp.view;
  no_e.E = 0;
  expect_msg([&] { gg::dw2_proj(no_e, cb(x), cb(a), mb(h), d, n, nullptr); },
             "dw2_proj: plan.E (0) must be at least 1", false);
  expect_msg([&] { gg::dx_proj(dp.view, cb(h), cb(w1), mb(a), d, 160, act, nullptr); },
             "n (160) must be a multiple of 64", true);
  expect_msg([&] { gg::reduce_ds(nullptr, reinterpret_cast<float*>(mb(a)), 5, n, nullptr); },
             "reduce_ds: ds_partials must not be null", false);
  // The TMA path with a scratch smaller than tma_gemm_scratch_bytes(E): refused before launch.
  DevBuf small(256);
  const gg::GemmScratch too_small{small.ptr, small.bytes};
  expect_msg([&] { gg::down_proj(dp.view, cb(a), cb(w2), mb(h), d, n, nullptr, too_small); },
             "down_proj: scratch of 256 bytes is smaller than", false);
  expect_msg([&] { gg::dx_proj(dp.view, cb(h), cb(w1), mb(a), d, n, act, nullptr, too_small); },
             "dx_proj: scratch of 256 bytes is smaller than", false);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(bytes_equal(h, h0));
  EXPECT_TRUE(bytes_equal(a, a0));
}

}  // namespace
}  // namespace moeblaze::test
