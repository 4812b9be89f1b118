// ScoreTransform: what becomes of a scaled score before the mask — the one host-and-device
// definition every kernel (CPU and CUDA), every trace and the test reference's contract follow.
//
// Order (FlashAttention's): the scale, then the softcap, then the mask (kernels/geometry.h).
// Softcap (Gemma 2, Grok): a scaled score s becomes softcap · tanh(s / softcap), so every score
// lies in [−softcap, softcap] however large q·k grows (tanh reaches ±1 in fp32); 0 turns it off.
// The transform is elementwise, so a key slice of a problem (positions, SplitKeys) transforms its
// scores exactly as the whole does and the slices' states still merge exactly.
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
#include "kernels/host_device.h"
#include "kernels/lanes.h"

namespace attn {

#if !defined(__CUDA_ARCH__)
namespace score_detail {

template <typename F>  // float, lanes::Floats or lanes::Floats16
ATTN_HOST_DEVICE F Tanh(F y) {
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

struct ScoreTransform {
  float softcap = 0.f;  // > 0, finite; 0: none (the request check's rule, server/request.cc).

  // Whether every score passes unchanged.
  ATTN_HOST_DEVICE bool Identity() const { return softcap == 0.f; }

  // The score a kernel uses for a scaled score.
  ATTN_HOST_DEVICE float operator()(float scaled) const {
    if (softcap == 0.f) return scaled;
#if defined(__CUDA_ARCH__)
    return softcap * tanhf(scaled / softcap);
#else
    return softcap * score_detail::Tanh(scaled * (1.f / softcap));
#endif
  }

#if !defined(__CUDA_ARCH__)
  // The transform of n scaled scores in place (a tile, a row), in lanes of V (lanes::Floats or
  // lanes::Floats16; the tail one float at a time, the same arithmetic).
  template <class V = lanes::Floats>
  ATTN_HOST_DEVICE void Apply(float* scores, int64_t n) const {
    if (Identity()) return;
    constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));
    const float inverse = 1.f / softcap;
    int64_t j = 0;
    for (; j + kWidth <= n; j += kWidth) {
      const V s = lanes::Load<V>(scores + j);
      lanes::Store(scores + j, softcap * score_detail::Tanh(s * inverse));
    }
    for (; j < n; ++j) scores[j] = softcap * score_detail::Tanh(scores[j] * inverse);
  }
#endif
};

}  // namespace attn
