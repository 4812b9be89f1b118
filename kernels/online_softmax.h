// The online-softmax update step: the one piece of math that Tiled, Trace and (later) the CUDA
// kernels share, so that what a trace shows is exactly what Tiled computes.
//
// State of one query row: a running max m, a running denominator l and an accumulator
// acc[value_dim] (owned by the caller, whose memory layout varies). Visiting a tile of scores
// s (already scaled; −inf where masked):
//
//   m'      = max(m, max(s))
//   rescale = exp(m − m')          0 when m is −inf (the first tile): never −inf − (−inf)
//   w_j     = exp(s_j − m')        0 when s_j is −inf
//   l'      = l · rescale + Σ w_j
//   acc'    = acc · rescale + Σ w_j · V_j      (the caller's part, with Rescale's return value)
//
// At the end: output = acc / l (0 when l is 0: the row saw no key), lse = m + log(l) (−inf
// when l is 0). Because every weight is taken relative to the running max, no exp ever sees
// a positive argument and nothing overflows however large the scores grow.
#pragma once

#include <cmath>
#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cstring>
#endif

#include "kernels/host_device.h"

namespace attn {

#if !defined(__CUDA_ARCH__)
// Eight floats at a time on the CPU (GCC vector extensions: SSE pairs in the portable build,
// one AVX register in the AVX2 clone). Each lane performs exactly the scalar code's operations
// (one template serves both), so a value is the same whether it went through a vector or the
// scalar tail.
namespace lanes {

constexpr int kWidth = 8;
typedef float Floats __attribute__((vector_size(32)));
typedef int32_t Ints __attribute__((vector_size(32)));
typedef uint32_t UInts __attribute__((vector_size(32)));

}  // namespace lanes

// e^x for x ≤ 0, the softmax's e^(s − max), on one float or on eight lanes. A branch-free
// version the compiler vectorizes (a scalar libm call per weight would halve Tiled's speed):
// with n = round(x·log2 e) and r = x − n·ln 2 (ln 2 split in two so r is exact to fp32),
// e^x = 2^n · e^r, e^r from a degree-6 polynomial fitted for least maximum relative error on
// |r| ≤ ln2/2 (3e-9; under 2 ulp in all), evaluated by Estrin's scheme (a shorter dependency
// chain than Horner's). n is rounded by adding 1.5·2^23, which leaves n in the low bits of the
// sum; shifted into the exponent field they give 2^n, and an integer max with 0 makes 2^n
// exactly 0 once n + 127 ≤ 0. So below about −87.68 (−inf included: x is first clamped to
// −100) e^x is exactly 0. Positive x is right up to 88 but not clamped above: no caller passes
// one. Past the one clamp, only arithmetic and an integer max: the softmax runs this on every
// score, and each select cost a measurable share of it (docs/perf.md).
namespace exp_detail {

constexpr float kLow = -100.f;
constexpr float kLog2e = 1.44269504f, kRound = 12582912.f;  // 1.5·2^23
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kC2 = 0.49999994f, kC3 = 0.16666521f, kC4 = 0.041668389f, kC5 = 0.0083687101f,
                kC6 = 0.0013814613f;  // e^r ≈ 1 + r + kC2·r² + … + kC6·r⁶
constexpr int32_t kBias = 127 << 23;

// The bits of t shifted left into the exponent field, and bits read back as a float.
ATTN_HOST_DEVICE int32_t ShiftedBits(float t) {
  return static_cast<int32_t>(std::bit_cast<uint32_t>(t) << 23);
}
ATTN_HOST_DEVICE lanes::Ints ShiftedBits(lanes::Floats t) {
  return (lanes::Ints)((lanes::UInts)t << 23);
}
ATTN_HOST_DEVICE float AsFloat(int32_t bits) { return std::bit_cast<float>(bits); }
ATTN_HOST_DEVICE lanes::Floats AsFloat(lanes::Ints bits) { return (lanes::Floats)bits; }

template <typename F>  // float or lanes::Floats
ATTN_HOST_DEVICE F Exp(F x) {
  const F low = F{} + kLow;
  const F clamped = x > low ? x : low;  // NaN gives kLow.
  const F t = clamped * kLog2e + kRound;
  const F n = t - kRound;
  F r = clamped - n * kLn2High;
  r = r - n * kLn2Low;
  const F r2 = r * r;
  const F p = (r2 * (r * kC3 + kC2) + (r + 1.f)) + (r2 * r2) * (r2 * kC6 + (r * kC5 + kC4));
  // The low bits of t hold n (two's complement); the shift drops the rest of t.
  const auto exponent = ShiftedBits(t) + kBias;  // (n + 127) << 23
  const decltype(exponent) zero{};
  return p * AsFloat(exponent > zero ? exponent : zero);
}

}  // namespace exp_detail
#endif

// e^x for x ≤ 0 (exp_detail above). On the GPU, the hardware's expf.
ATTN_HOST_DEVICE float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return exp_detail::Exp(x);
#endif
}

#if !defined(__CUDA_ARCH__)
namespace lanes {

ATTN_HOST_DEVICE Floats Load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ATTN_HOST_DEVICE void Store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }
ATTN_HOST_DEVICE Floats Splat(float x) { return Floats{} + x; }

// attn::Exp on each lane.
ATTN_HOST_DEVICE Floats Exp(Floats x) { return exp_detail::Exp(x); }

// op folded over the eight lanes as a tree (halves, then quarters, then pairs): three steps
// instead of a chain of seven, in a fixed order.
template <typename Op>
ATTN_HOST_DEVICE float Reduce(Floats v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}

}  // namespace lanes
#endif

struct OnlineSoftmaxRow {
  float max = -INFINITY;
  float denominator = 0.f;

  // Moves the running max to cover a tile whose largest score is tile_max and rescales the
  // denominator. Returns the factor the caller must apply to its accumulator.
  ATTN_HOST_DEVICE float Rescale(float tile_max) {
    const float new_max = max > tile_max ? max : tile_max;
    const float rescale = (max == -INFINITY) ? 0.f : Exp(max - new_max);
    denominator *= rescale;
    max = new_max;
    return rescale;
  }

  // The weight of one score of the current tile (0 for a masked score).
  ATTN_HOST_DEVICE float Weight(float score) const {
    return score == -INFINITY ? 0.f : Exp(score - max);
  }

  // Visits a tile of n scores: writes their weights (weights may alias scores) and returns the
  // rescale factor for the accumulator. The caller then sets acc = acc · rescale + Σ w_j · V_j.
  // On the CPU the max and the sum run in eight lanes (combined in a fixed order), so the loops
  // run on vector registers; on the GPU one thread walks the tile.
  ATTN_HOST_DEVICE float VisitTile(const float* scores, int n, float* weights) {
#if defined(__CUDA_ARCH__)
    float tile_max = -INFINITY;
    for (int j = 0; j < n; ++j) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
    const float rescale = Rescale(tile_max);
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      weights[j] = Weight(scores[j]);
      sum += weights[j];
    }
#else
    using lanes::Floats;
    constexpr int kWidth = lanes::kWidth;
    // The max in two chains of lanes (the loop is short, so the compare chain's latency shows).
    Floats lane_max = lanes::Splat(-INFINITY), lane_max_odd = lane_max;
    int j = 0;
    for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
      const Floats s = lanes::Load(scores + j), s_odd = lanes::Load(scores + j + kWidth);
      lane_max = s > lane_max ? s : lane_max;
      lane_max_odd = s_odd > lane_max_odd ? s_odd : lane_max_odd;
    }
    for (; j + kWidth <= n; j += kWidth) {
      const Floats s = lanes::Load(scores + j);
      lane_max = s > lane_max ? s : lane_max;
    }
    lane_max = lane_max_odd > lane_max ? lane_max_odd : lane_max;
    float tile_max = lanes::Reduce(lane_max, [](Floats a, Floats b) { return a > b ? a : b; });
    for (; j < n; ++j) tile_max = scores[j] > tile_max ? scores[j] : tile_max;

    const float rescale = Rescale(tile_max);
    if (max == -INFINITY) {  // Every score so far is masked: no weight, and s − max is NaN.
      for (j = 0; j < n; ++j) weights[j] = 0.f;
      return rescale;
    }
    // With a finite max a masked score's s − max is −inf, whose Exp is exactly 0.
    const Floats max_lanes = lanes::Splat(max);
    Floats lane_sum = lanes::Splat(0.f);
    for (j = 0; j + kWidth <= n; j += kWidth) {
      const Floats s = lanes::Load(scores + j);
      const Floats w = lanes::Exp(s - max_lanes);
      lanes::Store(weights + j, w);
      lane_sum += w;
    }
    float sum = lanes::Reduce(lane_sum, [](Floats a, Floats b) { return a + b; });
    for (; j < n; ++j) {
      weights[j] = Weight(scores[j]);
      sum += weights[j];
    }
#endif
    denominator += sum;
    return rescale;
  }

  // One component of the current estimate (or of the final output): acc / l, 0 when l is 0.
  ATTN_HOST_DEVICE float Normalize(float accumulator) const {
    return denominator > 0.f ? accumulator / denominator : 0.f;
  }

  // Natural log of Σ exp(s) over every score visited; −inf when none was visible.
  ATTN_HOST_DEVICE float LogSumExp() const {
    return denominator > 0.f ? max + logf(denominator) : -INFINITY;
  }
};

}  // namespace attn
