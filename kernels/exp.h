// Exp: e^x for x ≤ 0, the softmax's e^(s − max), on one float or (on the CPU) on lanes of eight
// or sixteen (lanes::Floats, lanes::Floats16).
//
// Defined for x ≤ 0, which is all the softmax passes; −inf gives exactly 0. On the GPU it is
// expf, libdevice's (within 2 ulp; the build uses no fast-math, so never the __expf
// intrinsic). On the CPU, a branch-free version the compiler vectorizes (a scalar libm call per
// weight would halve Tiled's speed), where NaN gives 0 too:
//
// with n = round(x·log2 e) and r = x − n·ln 2 (ln 2 split in two so r is exact to fp32), e^x =
// 2^n·e^r, e^r from a degree-6 polynomial fitted for least maximum relative error on |r| ≤ ln2/2
// (3e-9), evaluated by Horner's rule (Estrin's scheme has the shorter dependency chain, but the
// softmax's loops are bound by the count of vector operations, not by latency: Horner's took 7 %
// less time per weight and its largest error measured 0.87 ulp against Estrin's 1.70 over x in
// [−87, 0], docs/perf.md). n is rounded by adding 1.5·2^23 + 127, which leaves n + 127 in the low
// bits of the sum; shifted into the exponent field they give 2^n, and an integer max with 0 makes
// 2^n exactly 0 once n + 127 ≤ 0. So below about −87.68 (−inf included: x is first clamped to
// −100) e^x is exactly 0. Positive x is right up to 88 but not clamped above: no caller passes
// one. Past the one clamp, only arithmetic and an integer max: the softmax runs this on every
// score, and each select cost a measurable share of it (docs/perf.md). One template serves the
// scalar, the eight-lane and the sixteen-lane versions, so lanes and scalar tails agree bit for
// bit.
#pragma once

#include <cmath>
#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "kernels/host_device.h"
#include "kernels/lanes.h"

namespace attn {

#if !defined(__CUDA_ARCH__)
namespace exp_detail {

constexpr float kLow = -100.f;
// Rounding constant: 1.5·2^23 rounds x·log2 e to an integer n, and the 127 added to it leaves
// n + 127, the biased exponent of 2^n, in the sum's low bits.
constexpr float kLog2e = 1.44269504f, kRound = 12582912.f + 127.f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kC2 = 0.49999994f, kC3 = 0.16666521f, kC4 = 0.041668389f, kC5 = 0.0083687101f,
                kC6 = 0.0013814613f;  // e^r ≈ 1 + r + kC2·r² + … + kC6·r⁶

// The bits of t shifted left into the exponent field, and bits read back as a float.
ATTN_ALWAYS_INLINE int32_t ShiftedBits(float t) {
  return static_cast<int32_t>(std::bit_cast<uint32_t>(t) << 23);
}
ATTN_ALWAYS_INLINE lanes::Ints ShiftedBits(lanes::Floats t) {
  return (lanes::Ints)((lanes::UInts)t << 23);
}
ATTN_ALWAYS_INLINE lanes::Ints16 ShiftedBits(lanes::Floats16 t) {
  return (lanes::Ints16)((lanes::UInts16)t << 23);
}
ATTN_ALWAYS_INLINE float AsFloat(int32_t bits) { return std::bit_cast<float>(bits); }
ATTN_ALWAYS_INLINE lanes::Floats AsFloat(lanes::Ints bits) { return (lanes::Floats)bits; }
ATTN_ALWAYS_INLINE lanes::Floats16 AsFloat(lanes::Ints16 bits) { return (lanes::Floats16)bits; }

template <typename F>  // float, lanes::Floats or lanes::Floats16
ATTN_ALWAYS_INLINE F Exp(F x) {
  const F low = F{} + kLow;
  const F clamped = x > low ? x : low;  // NaN gives kLow.
  const F t = clamped * kLog2e + kRound;
  const F n = t - kRound;
  F r = clamped - n * kLn2High;
  r = r - n * kLn2Low;
  const F p = (((((r * kC6 + kC5) * r + kC4) * r + kC3) * r + kC2) * r + 1.f) * r + 1.f;
  // The low bits of t hold n + 127 (two's complement); the shift drops the rest of t.
  const auto exponent = ShiftedBits(t);  // (n + 127) << 23
  const decltype(exponent) zero{};
  return p * AsFloat(exponent > zero ? exponent : zero);
}

}  // namespace exp_detail

namespace lanes {
// attn::Exp on each lane.
ATTN_ALWAYS_INLINE Floats Exp(Floats x) { return exp_detail::Exp(x); }
ATTN_ALWAYS_INLINE Floats16 Exp(Floats16 x) { return exp_detail::Exp(x); }
}  // namespace lanes
#endif

ATTN_HOST_DEVICE float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return exp_detail::Exp(x);
#endif
}

}  // namespace attn
