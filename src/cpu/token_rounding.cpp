// Tile-aware token rounding (SonicMoE §5) on the CPU.
//
// 1. c_e = pairs of the given (token-choice, top-K) routing on expert e.
// 2. target_e, a multiple of m_tile chosen by the mode, then clamped to [0, T]:
//      NR-f  nearest multiple; a count exactly half-way between two multiples goes to the one
//            with an even number of tiles (round-half-to-even, as torch.round in SonicMoE's
//            reference implementation does);
//      SR-f  up with probability (c_e mod m) / m, else down; the draw is a counter-based hash of
//            (seed, expert) (sr_draw below), so it is reproducible and thread-count independent;
//      UP    ceil;  DOWN  floor.
//    The clamp only bites when the rounded-up target exceeds T: the expert then takes every
//    token (count T, not a multiple of m_tile; no multiple above T exists to pad to).
//    |target_e - c_e| < m_tile in every mode: floor and ceil of c/m are within m - 1 of c.
// 3. target < c: keep the expert's target best token-choice tokens (drop its lowest scores).
//    target > c: add its target - c best tokens that did not choose it (expert choice).
//    "Best" = higher selection score (softmax probability / logit / sigmoid + bias by router),
//    equal scores → lower token id. In SonicMoE every token-choice pair outranks every
//    expert-choice one, which is what this two-case rule implements.
// 4. Pairs regrouped by token, ascending expert id, and weights recomputed by the router's own
//    rule over each token's new pair set (router_math::pair_weights), as routing.hpp specifies.
//
// Scores are fp32 and computed by the same code as the router's, per token in parallel; each
// expert's selection is independent of the others, and the regrouping is a sequential O(S) pass,
// so the result is bitwise independent of the thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/router_math.hpp"

namespace moeblaze::cpu {
namespace rm = router_math;
namespace {

uint64_t splitmix64_finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// SR-f's uniform draw in [0, m) for one expert: a function of (seed, expert) only.
//   h = F(seed ^ F(expert + 0x9E3779B97F4A7C15)),  F = splitmix64's finaliser
//   u = floor(h * m / 2^64)   (the high 64 bits of the 128-bit product)
// The count rounds up iff u < (c mod m), i.e. with probability (c mod m) / m.
uint64_t sr_draw(uint64_t seed, int64_t expert, int64_t m) {
  const uint64_t h =
      splitmix64_finalize(seed ^ splitmix64_finalize(uint64_t(expert) + 0x9E3779B97F4A7C15ull));
  return uint64_t((static_cast<unsigned __int128>(h) * uint64_t(m)) >> 64);
}

int64_t rounded_count(const TokenRoundingConfig& cfg, int64_t c, int64_t T, int64_t expert) {
  const int64_t m = cfg.m_tile, tiles = c / m, rem = c % m;
  int64_t up = 0;  // 1: round up to (tiles + 1) * m
  if (rem != 0) {
    switch (cfg.mode) {
      case RoundingMode::nearest_freq:
        up = 2 * rem > m || (2 * rem == m && (tiles % 2) == 1);
        break;
      case RoundingMode::stochastic_freq:
        up = sr_draw(cfg.seed, expert, m) < uint64_t(rem);
        break;
      case RoundingMode::up: up = 1; break;
      case RoundingMode::down: up = 0; break;
    }
  }
  return std::min((tiles + up) * m, T);
}

}  // namespace

void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  rm::require_finite_logits(logits);
  const float* b = nullptr;  // (E,) fp32, sigmoid_bias only
  if (router.kind == RouterKind::sigmoid_bias) {
    rm::require_finite_bias(bias);
    b = bias.as<const float>();
  }

  // (E, T) fp32 selection scores, expert-major so that each expert's pass reads one contiguous
  // column. softmax_topk ranks tokens by probability (across tokens logits are not comparable).
  std::vector<float> score(E * T);
  parallel_for(0, rm::num_chunks(T), 1, [&](int64_t c) {
    rm::TokenScratch s(E);
    const int64_t stop = std::min(T, (c + 1) * rm::kTokenChunk);
    for (int64_t t = c * rm::kTokenChunk; t < stop; ++t) {
      rm::load_row(logits, t, s.row.data());
      if (router.kind == RouterKind::softmax_topk)
        rm::softmax_row(s.row.data(), E, s.p.data());
      else
        rm::selection_keys(router.kind, s.row.data(), b, E, s.p.data());
      for (int64_t e = 0; e < E; ++e) score[e * T + t] = s.p[e];
    }
  });

  // Token-choice tokens of each expert, ascending token id: a counting pass and a fill pass.
  std::vector<int64_t> tc_offsets(E + 1, 0);  // (E+1,)
  for (int64_t p = 0; p < topk.P; ++p) ++tc_offsets[topk.pair_experts[p] + 1];
  for (int64_t e = 0; e < E; ++e) tc_offsets[e + 1] += tc_offsets[e];
  std::vector<int32_t> tc_tokens(topk.P);  // (P,) token ids grouped by expert
  {
    std::vector<int64_t> cursor(tc_offsets.begin(), tc_offsets.end() - 1);  // (E,)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t p = topk.pair_offsets[t]; p < topk.pair_offsets[t + 1]; ++p)
        tc_tokens[cursor[topk.pair_experts[p]]++] = static_cast<int32_t>(t);
  }

  std::vector<std::vector<int32_t>> kept(E);  // kept[e]: tokens of expert e, ascending
  parallel_for(0, E, 1, [&](int64_t e) {
    const float* sc = score.data() + e * T;  // (T,)
    // A strict total order (distinct token ids), so the chosen set is unique whatever the
    // selection algorithm visits first.
    auto better = [sc](int32_t a, int32_t b2) {
      return sc[a] > sc[b2] || (sc[a] == sc[b2] && a < b2);
    };
    const int32_t* tc = tc_tokens.data() + tc_offsets[e];
    const int64_t c = tc_offsets[e + 1] - tc_offsets[e];
    const int64_t target = rounded_count(cfg, c, T, e);
    std::vector<int32_t>& keep = kept[e];
    keep.assign(tc, tc + c);
    if (target < c) {
      std::nth_element(keep.begin(), keep.begin() + target, keep.end(), better);
      keep.resize(target);
      std::sort(keep.begin(), keep.end());
    } else if (target > c) {
      std::vector<int32_t> candidates;  // tokens that did not choose e, ascending
      candidates.reserve(T - c);
      for (int64_t t = 0, j = 0; t < T; ++t) {
        if (j < c && tc[j] == t)
          ++j;
        else
          candidates.push_back(static_cast<int32_t>(t));
      }
      const int64_t need = target - c;  // <= T - c = candidates.size()
      std::nth_element(candidates.begin(), candidates.begin() + need, candidates.end(), better);
      keep.insert(keep.end(), candidates.begin(), candidates.begin() + need);
      std::sort(keep.begin(), keep.end());
    }
  });

  int64_t S = 0;
  for (int64_t e = 0; e < E; ++e) S += int64_t(kept[e].size());
  MOEBLAZE_REQUIRE(S < (int64_t(1) << 31), "token rounding would produce ", S,
                   " pairs, beyond the int32 index range of a routing");

  Routing r(Device::cpu, T, E, S);
  int32_t* offsets = r.pair_offsets();  // (T+1,)
  int32_t* experts = r.pair_experts();  // (S,) ascending expert id within a token
  float* weights = r.pair_weights();    // (S,)
  std::vector<int32_t> cursor(T + 1, 0);  // (T+1,) per-token count, then write position
  for (int64_t e = 0; e < E; ++e)
    for (int32_t t : kept[e]) ++cursor[t + 1];
  offsets[0] = 0;
  for (int64_t t = 0; t < T; ++t) cursor[t + 1] += cursor[t];
  std::copy(cursor.begin(), cursor.end(), offsets);
  for (int64_t e = 0; e < E; ++e)
    for (int32_t t : kept[e]) experts[cursor[t]++] = static_cast<int32_t>(e);

  parallel_for(0, rm::num_chunks(T), 1, [&](int64_t c) {
    rm::TokenScratch s(E);
    const int64_t stop = std::min(T, (c + 1) * rm::kTokenChunk);
    for (int64_t t = c * rm::kTokenChunk; t < stop; ++t) {
      rm::load_row(logits, t, s.row.data());
      const int64_t begin = offsets[t];
      rm::pair_weights(router, s.row.data(), E, experts + begin, offsets[t + 1] - begin,
                       weights + begin, s);
    }
  });
  out = std::move(r);
}

}  // namespace moeblaze::cpu
