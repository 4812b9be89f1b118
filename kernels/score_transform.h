// ScoreTransform: what becomes of a scaled score before the mask — the one host-and-device
// definition every kernel (CPU and CUDA), every trace and the test reference's contract follow.
//
// Order (FlashAttention's): the scale, then the softcap, then the ALiBi bias, then the mask
// (kernels/geometry.h). ScoreOrHidden (one key: the CUDA Tiled, Decode and Trace kernels) and
// ScoresOrHidden (a tile in place: CPU Tiled and Decode), at the end of this file, are that whole
// order for keys a row may not see; Naive and the CUDA row kernel transform only a row's visible
// keys and give the others weight 0 themselves.
// Softcap (Gemma 2, Grok): a scaled score s becomes softcap · tanh(s / softcap), so every score
// lies in [−softcap, softcap] however large q·k grows (tanh reaches ±1 in fp32); 0 turns it off.
// ALiBi (BLOOM, MPT): query head h adds −slope_h · |p − t| for a query at position p and a key at
// t (Geometry::Distance gives p − t); no slopes, no bias. The distance is converted to fp32
// (exact below 2^24; a tile's keys as float(p − t₀) − j, equal to it there).
// Both depend only on the score and on positions, so a key slice of a problem (positions,
// SplitKeys) transforms its scores exactly as the whole does and the slices' states still merge
// exactly; a slice of the heads (SplitRequest) takes its heads' slopes.
//
// tanh on the GPU is tanhf (libdevice). On the CPU a scalar tanhf per score made Tiled 6.7×
// slower (docs/perf.md), so it is a branch-free version the compiler vectorizes, one template for
// one float and for lanes (so lanes and scalar tails agree bit for bit): odd, and for
// a = |y| < 0.3 the Taylor series to y⁹ (its first omitted term is under 6e-8 of tanh there),
// else (1 − e^(−2a)) / (1 + e^(−2a)) with the softmax's Exp (kernels/exp.h; e^(−0.6) ≈ 0.55 at
// the switch, so the difference costs at most one bit).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/exp.h"
#include "kernels/geometry.h"
#include "kernels/host_device.h"
#include "kernels/lanes.h"

namespace attn {

#if !defined(__CUDA_ARCH__)
namespace score_detail {

template <typename F>  // float, lanes::Floats or lanes::Floats16
ATTN_ALWAYS_INLINE F Tanh(F y) {
  const F zero = F{};
  const F a = y < zero ? -y : y;
  const F e = exp_detail::Exp(zero - a - a);
  const F large = (1.f - e) / (1.f + e);
  const F a2 = a * a;
  const F small =
      a + a * a2 * (-0.33333334f + a2 * (0.13333334f + a2 * (-0.053968254f + a2 * 0.021869489f)));
  const F t = a < zero + 0.3f ? small : large;
  return y < zero ? -t : t;
}

}  // namespace score_detail
#endif

// One query head's transform.
struct ScoreTransform {
  float softcap = 0.f;      // > 0, finite; 0: none (the request check's rule, server/request.cc).
  float alibi_slope = 0.f;  // Finite; 0: no bias.

  // Whether every score passes unchanged.
  ATTN_HOST_DEVICE bool Identity() const { return softcap == 0.f && alibi_slope == 0.f; }

  // The softcapped score (the scaled one without a softcap).
  ATTN_HOST_DEVICE float Cap(float scaled) const {
    if (softcap == 0.f) return scaled;
#if defined(__CUDA_ARCH__)
    return softcap * tanhf(scaled / softcap);
#else
    return softcap * score_detail::Tanh(scaled * (1.f / softcap));
#endif
  }

  // The ALiBi bias of a key at distance p − t from the query.
  ATTN_HOST_DEVICE float Bias(float distance) const {
    return -alibi_slope * (distance < 0.f ? -distance : distance);
  }

  // The score a kernel uses for a scaled score of a key at distance p − t.
  ATTN_HOST_DEVICE float operator()(float scaled, int64_t distance) const {
    return Cap(scaled) + Bias(static_cast<float>(distance));
  }

#if !defined(__CUDA_ARCH__)
  // The transform in place of n scaled scores of consecutive keys (a tile, a row), the first at
  // distance p − t₀ (key j at p − t₀ − j), in lanes of V (lanes::Floats or lanes::Floats16; the
  // tail one float at a time, the same arithmetic).
  template <class V = lanes::Floats>
  ATTN_ALWAYS_INLINE void Apply(float* scores, int64_t n, int64_t distance) const {
    if (Identity()) return;
    constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));
    const float inverse = softcap == 0.f ? 0.f : 1.f / softcap;
    const float first = static_cast<float>(distance);
    V lane{};  // 0, 1, …, kWidth − 1.
    for (int i = 0; i < kWidth; ++i) lane[i] = static_cast<float>(i);
    int64_t j = 0;
    for (; j + kWidth <= n; j += kWidth) {
      V s = lanes::Load<V>(scores + j);
      if (softcap != 0.f) s = softcap * score_detail::Tanh(s * inverse);
      if (alibi_slope != 0.f) {
        const V d = first - (lane + static_cast<float>(j));
        s += -alibi_slope * (d < V{} ? -d : d);
      }
      lanes::Store(scores + j, s);
    }
    for (; j < n; ++j) {
      float s = scores[j];
      if (softcap != 0.f) s = softcap * score_detail::Tanh(s * inverse);
      if (alibi_slope != 0.f) s += Bias(first - static_cast<float>(j));
      scores[j] = s;
    }
  }
#endif
};

// A problem's transforms: one softcap, each query head's slope — and each head's attention sink,
// which transforms no score but rides along to every kernel with the slopes (one more logit of
// the row's softmax, OnlineSoftmax::AddSink).
struct ScoreTransforms {
  float softcap = 0.f;
  // [heads] ALiBi slopes, or null for none: host memory for the CPU kernels, device memory in a
  // CUDA kernel's parameters.
  const float* alibi_slopes = nullptr;
  // [heads] sinks, or null for none; the same memory as the slopes.
  const float* sinks = nullptr;

  // Whether every score passes unchanged (sinks do not change scores).
  ATTN_HOST_DEVICE bool Identity() const { return softcap == 0.f && alibi_slopes == nullptr; }
  ATTN_HOST_DEVICE ScoreTransform ForHead(int64_t head) const {
    return ScoreTransform{softcap, alibi_slopes != nullptr ? alibi_slopes[head] : 0.f};
  }
  // Query head h's sink logit; −inf (none) without sinks.
  ATTN_HOST_DEVICE float Sink(int64_t head) const {
    return sinks != nullptr ? sinks[head] : -INFINITY;
  }
};

// The score the softmax takes for key `key` of a query row that sees keys `visible` and whose key
// 0 lies at distance p − t = `distance` (Geometry::Distance(row, 0); key j at distance − j): the
// head's transform of the key's scaled score when the row sees the key, else −inf (weight 0).
ATTN_HOST_DEVICE float ScoreOrHidden(const ScoreTransform& transform, KeyRange visible,
                                     int64_t distance, int64_t key, float scaled) {
  return visible.Contains(key) ? transform(scaled, distance - key) : -INFINITY;
}

#if !defined(__CUDA_ARCH__)
// ScoreOrHidden in place for the n scaled scores of keys key_begin … of a row (a tile), in
// lanes of V: the transform of every score (ScoreTransform::Apply), then −inf for the keys the
// row does not see (MaskTile).
template <class V = lanes::Floats>
ATTN_ALWAYS_INLINE void ScoresOrHidden(const ScoreTransform& transform, KeyRange visible,
                                       int64_t distance, int64_t key_begin, int64_t n,
                                       float* scores) {
  transform.template Apply<V>(scores, n, distance - key_begin);
  MaskTile(visible, key_begin, n, scores);
}
#endif

}  // namespace attn
