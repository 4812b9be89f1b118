// Element types and their conversions to and from fp32.
//
// fp16 and bf16 are storage formats only: every kernel loads them into fp32, computes in fp32
// and rounds back to nearest-even when it stores. NaN stays NaN; overflow becomes ±inf.
//
// fp8 (E4M3, the OCP "e4m3fn" format vLLM and FlashInfer use: 4 exponent bits of bias 7, 3
// mantissa bits, no infinities, largest finite ±448) is a KV cache's dtype only, never a
// request's tensor's. Each stored row (one token of one kv head: a key, or a value) carries its
// own scale: the row's codes, zero bytes up to a multiple of 4, then the row's fp32 scale, so an
// element is code · scale (Fp8RowBytes). The server quantizes (QuantizeFp8Row): the scale is
// max |x| / 448 over the row, each code x / scale rounded to nearest even.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace attn {

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };

ATTN_HOST_DEVICE constexpr int64_t ElementSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : (dtype == DType::kFloat8E4M3 ? 1 : 2);
}

// Bytes of one stored row of `width` elements: width elements, and for fp8 the padding and the
// row's scale after them (dtype.h's header).
constexpr int64_t kFp8ScaleBytes = 4;
ATTN_HOST_DEVICE constexpr int64_t Fp8RowBytes(int64_t width) {
  return (width + 3) / 4 * 4 + kFp8ScaleBytes;
}
ATTN_HOST_DEVICE constexpr int64_t StoredRowBytes(DType dtype, int64_t width) {
  return dtype == DType::kFloat8E4M3 ? Fp8RowBytes(width) : width * ElementSize(dtype);
}
// The same in elements of the dtype: a stored row's stride (PagedKv's key_width, value_width).
ATTN_HOST_DEVICE constexpr int64_t StoredRowWidth(DType dtype, int64_t width) {
  return StoredRowBytes(dtype, width) / ElementSize(dtype);
}

constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
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

// fp8 E4M3 code → fp32, exactly (the code's own value, before its row's scale). The NaN codes
// (0x7f, 0xff) are never stored (QuantizeFp8Row saturates) and read as NaN.
ATTN_HOST_DEVICE float Fp8E4M3ToFloat(uint8_t code) {
  const uint32_t magnitude = code & 0x7fu;
  float value;
  if (magnitude == 0x7fu) {
    value = BitsToFloat(0x7fc00000u);
  } else if (magnitude < 8) {  // Subnormal: mantissa × 2^-9.
    value = static_cast<float>(magnitude) * 0.001953125f;
  } else {  // Rebias the exponent (7 → 127), 3 mantissa bits to the top of fp32's 23.
    value = BitsToFloat((magnitude << 20) + (120u << 23));
  }
  return (code & 0x80u) ? -value : value;
}

// fp8 E4M3 code → the fp16 bits of its value times 2^-8, exactly: the code sign-extended to 16
// bits and shifted left by 7 puts its 4 exponent bits in fp16's 5 with bias 15 for 7 (2^-8) and
// its 3 mantissa bits at the top of fp16's 10, subnormals included; the mask drops the sign's
// copy in bit 14. One conversion of fp16 (F16C, cvt.f32.f16) then gives the value / 256 without
// Fp8E4M3ToFloat's cases. The NaN codes are never stored; they give ±480 / 256.
ATTN_HOST_DEVICE uint16_t Fp8E4M3HalfBits(uint8_t code) {
  return static_cast<uint16_t>((static_cast<int8_t>(code) * 128) & 0xbfff);
}

// fp32 → fp8 E4M3 code, rounded to nearest even; magnitudes past 448 saturate to ±448 (the
// format has no infinity), NaN becomes the NaN code.
ATTN_HOST_DEVICE uint8_t FloatToFp8E4M3(float f) {
  const uint32_t bits = FloatBits(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (magnitude >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // ≥ 448
  if (magnitude < 0x3c800000u) {
    // Below the smallest normal (2^-6): units of 2^-9, rounded to nearest even (exact product;
    // 8 units is the smallest normal's code).
    const float units = rintf(BitsToFloat(magnitude) * 512.0f);
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(units));
  }
  // Normal: rebias (127 → 7) and round 23 mantissa bits to 3, ties to even.
  uint32_t rebiased = magnitude - (120u << 23);
  rebiased += 0x7ffffu + ((rebiased >> 20) & 1u);
  return static_cast<uint8_t>(sign | (rebiased >> 20));
}

// The scale of a stored fp8 row of `row_bytes` bytes (Fp8RowBytes): its last 4 bytes.
ATTN_HOST_DEVICE float Fp8RowScale(const void* row, int64_t row_bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(row) + row_bytes - kFp8ScaleBytes;
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const float*>(p);  // 4-byte aligned: rows and pages are.
#else
  float scale;
  std::memcpy(&scale, p, sizeof scale);
  return scale;
#endif
}

// Quantizes `width` fp32 values into one stored fp8 row (Fp8RowBytes(width) bytes at `row`):
// scale = max |x| / 448 (0 for a row of zeros), code = x / scale to nearest even. The values
// must be finite (the server checks them first). Returns max |x|.
ATTN_HOST_DEVICE float QuantizeFp8Row(const float* x, int64_t width, void* row) {
  float max_abs = 0.f;
  for (int64_t i = 0; i < width; ++i) max_abs = fmaxf(max_abs, fabsf(x[i]));
  // 0 when it underflows too: every code 0 then (and the row reads as zeros).
  const float scale = max_abs / 448.f;
  unsigned char* codes = static_cast<unsigned char*>(row);
  for (int64_t i = 0; i < width; ++i) {
    codes[i] = scale > 0.f ? FloatToFp8E4M3(x[i] / scale) : 0;
  }
  const int64_t bytes = Fp8RowBytes(width);
  for (int64_t i = width; i < bytes - kFp8ScaleBytes; ++i) codes[i] = 0;
  const float stored = scale > 0.f ? scale : 0.f;
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float*>(codes + bytes - kFp8ScaleBytes) = stored;
#else
  std::memcpy(codes + bytes - kFp8ScaleBytes, &stored, sizeof stored);
#endif
  return max_abs;
}

// Loads element i of a buffer of the given dtype as fp32 (fp8: the code's value, unscaled).
ATTN_HOST_DEVICE float LoadElement(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat8E4M3:
      return Fp8E4M3ToFloat(static_cast<const uint8_t*>(data)[i]);
  }
  return 0.f;
}

// Stores value as element i of a buffer of the given dtype, rounding to nearest even (fp8: as a
// code, unscaled).
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
    case DType::kFloat8E4M3:
      static_cast<uint8_t*>(data)[i] = FloatToFp8E4M3(value);
      return;
  }
}

}  // namespace attn
