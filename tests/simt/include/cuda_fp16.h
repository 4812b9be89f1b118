// The SIMT emulator's stand-in for the CUDA Toolkit's cuda_fp16.h: the __half and __half2 types
// and the conversions the CUDA backend's kernels call, as plain C++ with CUDA's bit layouts and
// results.
//
// Layout: __half is the 16-bit IEEE binary16 pattern; __half2 is {x, y} with x in the low 16
// bits of the 32-bit word (the first element at the lower address on this little-endian host),
// 4-byte aligned, so a kernel's *reinterpret_cast<const uint32_t*>(&pair) reads the same
// register the GPU's mma.sync takes.
// Conversions: float → half rounds to nearest even (CUDA's _rn; __float2half and the float
// constructor are _rn too), overflowing to ±inf, keeping subnormals; half → float is exact. The
// rounding is kernels/dtype.h's (FloatToHalf, HalfToFloat: one rule for the whole project, tested
// in tests/dtype_test.cc); only NaN is handled here, because CUDA returns its canonical NaN
// (0x7fff as half, 0x7fffffff as float, no sign) where dtype.h keeps sign and payload.
// Not here: half arithmetic and comparison operators (the kernels compute in fp32), conversions
// from double or integers other than through float.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__)
// dtype.h's device branch calls __float_as_uint; nvcc always includes the runtime before any
// source line, which the emulated .cu files would otherwise not get if they include this header
// first (tiled.cu does).
#include <cuda_runtime.h>
#endif
#include "kernels/dtype.h"

static_assert(std::endian::native == std::endian::little,
              "__half2's x must be the low half of the 32-bit register");

struct __half_raw {
  unsigned short x;
};

struct __half2_raw {
  unsigned short x;
  unsigned short y;
};

namespace simt::fp16 {

// CUDA's results for NaN inputs; every other value goes through dtype.h's one rounding rule.
inline unsigned short FloatToBits(float f) {
  if (f != f) return 0x7fffu;
  return attn::FloatToHalf(f);
}

inline float BitsToFloat(unsigned short bits) {
  if ((bits & 0x7fffu) > 0x7c00u) return attn::BitsToFloat(0x7fffffffu);
  return attn::HalfToFloat(bits);
}

}  // namespace simt::fp16

struct __half {
  __half() = default;  // Uninitialized, as CUDA's: keeps the type trivial.
  constexpr __half(const __half_raw& raw) : __x(raw.x) {}
  __half(float f) : __x(simt::fp16::FloatToBits(f)) {}
  operator float() const { return simt::fp16::BitsToFloat(__x); }
  constexpr operator __half_raw() const { return __half_raw{__x}; }

 protected:
  unsigned short __x;
};

struct alignas(4) __half2 {
  __half x;
  __half y;
  __half2() = default;
  constexpr __half2(const __half& low, const __half& high) : x(low), y(high) {}
  constexpr __half2(const __half2_raw& raw) : x(__half_raw{raw.x}), y(__half_raw{raw.y}) {}
  constexpr operator __half2_raw() const {
    return __half2_raw{static_cast<__half_raw>(x).x, static_cast<__half_raw>(y).x};
  }
};

static_assert(sizeof(__half) == 2 && alignof(__half) == 2);
static_assert(sizeof(__half2) == 4 && alignof(__half2) == 4);
static_assert(std::is_trivially_copyable_v<__half> && std::is_trivially_copyable_v<__half2>);
static_assert(std::is_standard_layout_v<__half2>);

using half = __half;
using half2 = __half2;

inline __half __float2half(float a) { return __half(a); }
inline __half __float2half_rn(float a) { return __half(a); }
inline float __half2float(__half a) { return static_cast<float>(a); }

inline __half2 __float2half2_rn(float a) { return __half2(__half(a), __half(a)); }
inline __half2 __floats2half2_rn(float low, float high) {
  return __half2(__half(low), __half(high));
}
inline __half2 __halves2half2(__half low, __half high) { return __half2(low, high); }
inline __half __low2half(__half2 a) { return a.x; }
inline __half __high2half(__half2 a) { return a.y; }
inline float __low2float(__half2 a) { return static_cast<float>(a.x); }
inline float __high2float(__half2 a) { return static_cast<float>(a.y); }

inline unsigned short __half_as_ushort(__half h) { return static_cast<__half_raw>(h).x; }
inline __half __ushort_as_half(unsigned short bits) { return __half(__half_raw{bits}); }
inline short __half_as_short(__half h) { return std::bit_cast<short>(__half_as_ushort(h)); }
inline __half __short_as_half(short bits) {
  return __ushort_as_half(std::bit_cast<unsigned short>(bits));
}
