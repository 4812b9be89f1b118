// Element types and their conversions to and from fp32.
//
// fp16 and bf16 are storage formats only: every kernel loads them into fp32, computes in fp32
// and rounds back to nearest-even when it stores. NaN stays NaN; overflow becomes ±inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace attn {

enum class DType { kFloat32, kFloat16, kBFloat16 };

constexpr int64_t ElementSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "?";
}

ATTN_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

ATTN_HOST_DEVICE float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

ATTN_HOST_DEVICE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // Zero or subnormal: mantissa × 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

ATTN_HOST_DEVICE uint16_t FloatToHalf(float f) {
  const uint32_t bits = FloatBits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 → inf
  if (magnitude < 0x38800000u) {
    // Below fp16's smallest normal (2^-14): count units of 2^-24, rounded to nearest even.
    // The product is exact in fp32, so rintf (ties to even) does the rounding.
    const float units = rintf(BitsToFloat(magnitude) * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));
  }
  // Normal: rebias the exponent (127 → 15) and round 23 mantissa bits to 10, ties to even.
  uint32_t rebiased = magnitude - (112u << 23);
  rebiased += 0xfffu + ((rebiased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rebiased >> 13));
}

ATTN_HOST_DEVICE float BFloat16ToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

ATTN_HOST_DEVICE uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Loads element i of a buffer of the given dtype as fp32.
ATTN_HOST_DEVICE float LoadElement(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.f;
}

// Stores value as element i of a buffer of the given dtype, rounding to nearest even.
ATTN_HOST_DEVICE void StoreElement(void* data, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(data)[i] = value;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToHalf(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToBFloat16(value);
      return;
  }
}

}  // namespace attn
