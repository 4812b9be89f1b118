// The SIMT emulator's stand-in for the CUDA Toolkit's cuda_bf16.h: the __nv_bfloat16 and
// __nv_bfloat162 types and the conversions the CUDA backend's kernels call, as plain C++ with
// CUDA's bit layouts and results.
//
// Layout: __nv_bfloat16 is the top 16 bits of an fp32 pattern; __nv_bfloat162 is {x, y} with x
// in the low 16 bits of the 32-bit word, 4-byte aligned, as mma.sync reads it.
// Conversions: float → bf16 rounds to nearest even (_rn; __float2bfloat16 and the constructor
// too), overflowing to ±inf, keeping subnormals; bf16 → float is exact and keeps a NaN's payload
// (CUDA just shifts the bits). The rounding is kernels/dtype.h's FloatToBFloat16 (one rule for
// the project, tested in tests/dtype_test.cc); only a NaN input is handled here, because CUDA
// returns its canonical 0x7fff where dtype.h keeps sign and payload.
// Not here: bf16 arithmetic and comparison operators, conversions other than through float.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__)
// dtype.h's device branch calls __float_as_uint, declared by the runtime that nvcc includes
// before every source (see cuda_fp16.h).
#include <cuda_runtime.h>
#endif
#include "kernels/dtype.h"

static_assert(std::endian::native == std::endian::little,
              "__nv_bfloat162's x must be the low half of the 32-bit register");

struct __nv_bfloat16_raw {
  unsigned short x;
};

struct __nv_bfloat162_raw {
  unsigned short x;
  unsigned short y;
};

namespace simt::bf16 {

inline unsigned short FloatToBits(float f) {
  if (f != f) return 0x7fffu;  // CUDA's canonical NaN; every other value: dtype.h's rule.
  return attn::FloatToBFloat16(f);
}

}  // namespace simt::bf16

struct __nv_bfloat16 {
  __nv_bfloat16() = default;  // Uninitialized, as CUDA's: keeps the type trivial.
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& raw) : __x(raw.x) {}
  __nv_bfloat16(float f) : __x(simt::bf16::FloatToBits(f)) {}
  operator float() const { return attn::BFloat16ToFloat(__x); }
  constexpr operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }

 protected:
  unsigned short __x;
};

struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x;
  __nv_bfloat16 y;
  __nv_bfloat162() = default;
  constexpr __nv_bfloat162(const __nv_bfloat16& low, const __nv_bfloat16& high) : x(low), y(high) {}
  constexpr __nv_bfloat162(const __nv_bfloat162_raw& raw)
      : x(__nv_bfloat16_raw{raw.x}), y(__nv_bfloat16_raw{raw.y}) {}
  constexpr operator __nv_bfloat162_raw() const {
    return __nv_bfloat162_raw{static_cast<__nv_bfloat16_raw>(x).x,
                              static_cast<__nv_bfloat16_raw>(y).x};
  }
};

static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2);
static_assert(sizeof(__nv_bfloat162) == 4 && alignof(__nv_bfloat162) == 4);
static_assert(std::is_trivially_copyable_v<__nv_bfloat16> &&
              std::is_trivially_copyable_v<__nv_bfloat162>);
static_assert(std::is_standard_layout_v<__nv_bfloat162>);

using nv_bfloat16 = __nv_bfloat16;
using nv_bfloat162 = __nv_bfloat162;

inline __nv_bfloat16 __float2bfloat16(float a) { return __nv_bfloat16(a); }
inline __nv_bfloat16 __float2bfloat16_rn(float a) { return __nv_bfloat16(a); }
inline float __bfloat162float(__nv_bfloat16 a) { return static_cast<float>(a); }

inline __nv_bfloat162 __float2bfloat162_rn(float a) {
  return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(a));
}
inline __nv_bfloat162 __floats2bfloat162_rn(float low, float high) {
  return __nv_bfloat162(__nv_bfloat16(low), __nv_bfloat16(high));
}
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 low, __nv_bfloat16 high) {
  return __nv_bfloat162(low, high);
}
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 a) { return a.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 a) { return a.y; }
inline float __low2float(__nv_bfloat162 a) { return static_cast<float>(a.x); }
inline float __high2float(__nv_bfloat162 a) { return static_cast<float>(a.y); }

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) {
  return static_cast<__nv_bfloat16_raw>(h).x;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
  return __nv_bfloat16(__nv_bfloat16_raw{bits});
}
inline short __bfloat16_as_short(__nv_bfloat16 h) {
  return std::bit_cast<short>(__bfloat16_as_ushort(h));
}
inline __nv_bfloat16 __short_as_bfloat16(short bits) {
  return __ushort_as_bfloat16(std::bit_cast<unsigned short>(bits));
}
