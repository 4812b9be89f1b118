// fp16, bf16 and fp8 E4M3 conversions (kernels/dtype.h) against a slow reference written here:
// decode by the format's definition, encode by searching the table of every representable value for
// the nearest one, ties to the even bit pattern, overflow to ±inf past the largest finite value
// plus half an ulp.
#include "kernels/dtype.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace {

using namespace attn;

// A 16-bit format with 1 sign bit, `exponent_bits` and the rest mantissa.
struct Format {
  int exponent_bits;
  int mantissa_bits;
  int bias;
};

constexpr Format kHalf{5, 10, 15};
constexpr Format kBFloat16{8, 7, 127};

uint16_t InfBits(const Format& f) {
  return static_cast<uint16_t>(((1u << f.exponent_bits) - 1) << f.mantissa_bits);
}

bool IsNanBits(const Format& f, uint16_t bits) {
  const uint16_t magnitude = bits & 0x7fffu;
  return magnitude > InfBits(f);
}

// The value of a non-NaN bit pattern, by definition.
double ReferenceDecode(const Format& f, uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent = (bits >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int mantissa = bits & ((1 << f.mantissa_bits) - 1);
  double magnitude;
  if (exponent == (1 << f.exponent_bits) - 1) {
    magnitude = std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, 1 - f.bias - f.mantissa_bits);
  } else {
    magnitude = std::ldexp((1 << f.mantissa_bits) + mantissa, exponent - f.bias - f.mantissa_bits);
  }
  return sign ? -magnitude : magnitude;
}

// Rounds floats to a format the slow way: binary search in the sorted table of all finite
// non-negative values (indexed by bit pattern, which orders them), nearest wins, ties go to the
// even pattern.
class ReferenceEncoder {
 public:
  explicit ReferenceEncoder(const Format& f) : format_(f) {
    for (uint32_t bits = 0; bits < InfBits(f); ++bits) {
      values_.push_back(ReferenceDecode(f, static_cast<uint16_t>(bits)));
    }
    // The largest finite value plus half the gap below it; a tie there goes to the (even)
    // infinity.
    const double max = values_.back();
    overflow_ = max + (max - values_[values_.size() - 2]) / 2;
  }

  uint16_t Encode(float x) const {
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double magnitude = std::abs(double(x));
    if (magnitude >= overflow_) return sign | InfBits(format_);
    // Above the largest finite value but below the overflow threshold: the largest finite.
    if (magnitude >= values_.back()) return sign | static_cast<uint16_t>(values_.size() - 1);
    // values_[hi] is the first value ≥ magnitude.
    size_t lo = 0, hi = values_.size() - 1;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (values_[mid] < magnitude) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    if (values_[hi] == magnitude || hi == 0) return sign | static_cast<uint16_t>(hi);
    const size_t below = hi - 1;
    // Both differences are exact in double: the neighbours bracket a float closely.
    const double down = magnitude - values_[below];
    const double up = values_[hi] - magnitude;
    size_t nearest;
    if (down < up) {
      nearest = below;
    } else if (up < down) {
      nearest = hi;
    } else {
      nearest = (below % 2 == 0) ? below : hi;
    }
    return sign | static_cast<uint16_t>(nearest);
  }

  // Midpoint between the finite non-negative patterns `bits` and `bits + 1`.
  double Midpoint(uint16_t bits) const { return (values_[bits] + values_[bits + 1]) / 2; }
  size_t finite_count() const { return values_.size(); }

 private:
  Format format_;
  std::vector<double> values_;
  double overflow_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Exhaustive round trips.

TEST(HalfTest, EveryBitPatternDecodesAndRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t bits = static_cast<uint16_t>(i);
    const float value = HalfToFloat(bits);
    if (IsNanBits(kHalf, bits)) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << bits;
      ASSERT_TRUE(IsNanBits(kHalf, FloatToHalf(value))) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(double(value), ReferenceDecode(kHalf, bits)) << std::hex << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000) != 0) << std::hex << bits;
    ASSERT_EQ(FloatToHalf(value), bits) << std::hex << bits;
  }
}

TEST(BFloat16Test, EveryBitPatternDecodesAndRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t bits = static_cast<uint16_t>(i);
    const float value = BFloat16ToFloat(bits);
    if (IsNanBits(kBFloat16, bits)) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << bits;
      ASSERT_TRUE(IsNanBits(kBFloat16, FloatToBFloat16(value))) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(double(value), ReferenceDecode(kBFloat16, bits)) << std::hex << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000) != 0) << std::hex << bits;
    ASSERT_EQ(FloatToBFloat16(value), bits) << std::hex << bits;
  }
}

// ---------------------------------------------------------------------------------------------
// Chosen cases.

float Pow2(int e) { return std::ldexp(1.f, e); }

TEST(HalfTest, TiesRoundToEven) {
  EXPECT_EQ(FloatToHalf(1.f + Pow2(-11)), 0x3c00);                  // 1 + ulp/2 → 1
  EXPECT_EQ(FloatToHalf(1.f + 3 * Pow2(-11)), 0x3c02);              // 1 + 3ulp/2 → 1 + 2ulp
  EXPECT_EQ(FloatToHalf(1.f + Pow2(-11) + Pow2(-23)), 0x3c01);      // just above the tie
  EXPECT_EQ(FloatToHalf(1.f + 3 * Pow2(-11) - Pow2(-23)), 0x3c01);  // just below the tie
  EXPECT_EQ(FloatToHalf(-(1.f + 3 * Pow2(-11))), 0xbc02);
  EXPECT_EQ(FloatToHalf(2049.f), 0x6800);  // 2048 + 1: tie between 2048 and 2050 → 2048
  EXPECT_EQ(FloatToHalf(2051.f), 0x6802);  // tie between 2050 and 2052 → 2052
}

TEST(HalfTest, OverflowBecomesInfinity) {
  EXPECT_EQ(FloatToHalf(65504.f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-65520.f), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::nextafter(65520.f, 0.f)), 0x7bff);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(FLT_MAX), 0x7c00);
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7c00);
  EXPECT_EQ(FloatToHalf(-INFINITY), 0xfc00);
  EXPECT_EQ(HalfToFloat(0x7c00), INFINITY);
  EXPECT_EQ(HalfToFloat(0xfc00), -INFINITY);
}

TEST(HalfTest, Subnormals) {
  EXPECT_EQ(FloatToHalf(Pow2(-24)), 0x0001);
  EXPECT_EQ(FloatToHalf(Pow2(-25)), 0x0000);  // tie between 0 and 2^-24 → 0 (even)
  EXPECT_EQ(FloatToHalf(std::nextafter(Pow2(-25), 1.f)), 0x0001);
  EXPECT_EQ(FloatToHalf(3 * Pow2(-25)), 0x0002);  // tie between 1 and 2 units → 2
  EXPECT_EQ(FloatToHalf(5 * Pow2(-25)), 0x0002);  // tie between 2 and 3 units → 2
  EXPECT_EQ(FloatToHalf(-Pow2(-24)), 0x8001);
  EXPECT_EQ(FloatToHalf(1023 * Pow2(-24)), 0x03ff);       // largest subnormal
  EXPECT_EQ(FloatToHalf(Pow2(-14) - Pow2(-25)), 0x0400);  // tie → smallest normal
  EXPECT_EQ(FloatToHalf(Pow2(-14)), 0x0400);
  EXPECT_EQ(FloatToHalf(Pow2(-14) + Pow2(-25)), 0x0400);  // tie → even
  EXPECT_EQ(FloatToHalf(Pow2(-14) + 3 * Pow2(-25)), 0x0402);
  EXPECT_EQ(FloatToHalf(FLT_TRUE_MIN), 0x0000);  // fp32 subnormal → 0
  EXPECT_EQ(HalfToFloat(0x0001), Pow2(-24));
  EXPECT_EQ(HalfToFloat(0x03ff), 1023 * Pow2(-24));
}

TEST(HalfTest, SignOfZeroAndNaN) {
  EXPECT_EQ(FloatToHalf(0.f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.f), 0x8000);
  EXPECT_EQ(FloatToHalf(-Pow2(-26)), 0x8000);  // underflows to −0
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(HalfToFloat(0x8000), 0.f);
  for (uint32_t nan_bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa00000u, 0xff800001u}) {
    EXPECT_TRUE(IsNanBits(kHalf, FloatToHalf(BitsToFloat(nan_bits)))) << std::hex << nan_bits;
  }
}

TEST(BFloat16Test, TiesRoundToEven) {
  EXPECT_EQ(FloatToBFloat16(1.f + Pow2(-8)), 0x3f80);  // 1 + ulp/2 → 1
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.f + 3 * Pow2(-8))), 1.f + Pow2(-6));
  EXPECT_EQ(FloatToBFloat16(1.f + 3 * Pow2(-8)), 0x3f82);  // 1 + 3ulp/2 → 1 + 2ulp = 1 + 2^-6
  EXPECT_EQ(FloatToBFloat16(1.f + Pow2(-8) + Pow2(-23)), 0x3f81);  // just above → 1 + 2^-7
  EXPECT_EQ(FloatToBFloat16(1.f + Pow2(-7)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(-(1.f + 3 * Pow2(-8))), 0xbf82);
}

TEST(BFloat16Test, OverflowSubnormalsZeroAndNaN) {
  EXPECT_EQ(FloatToBFloat16(FLT_MAX), 0x7f80);  // past the largest bf16 plus half an ulp
  EXPECT_EQ(FloatToBFloat16(-FLT_MAX), 0xff80);
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x7f7f7fffu)), 0x7f7f);  // just below that midpoint
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x7f7f8000u)), 0x7f80);  // the midpoint: tie → inf
  EXPECT_EQ(FloatToBFloat16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBFloat16(Pow2(-133)), 0x0001);  // smallest bf16 subnormal
  EXPECT_EQ(FloatToBFloat16(Pow2(-134)), 0x0000);  // tie → 0
  EXPECT_EQ(FloatToBFloat16(3 * Pow2(-134)), 0x0002);
  EXPECT_EQ(FloatToBFloat16(0.f), 0x0000);
  EXPECT_EQ(FloatToBFloat16(-0.f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(-Pow2(-140)), 0x8000);
  EXPECT_TRUE(std::signbit(BFloat16ToFloat(0x8000)));
  for (uint32_t nan_bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0xff800001u}) {
    EXPECT_TRUE(IsNanBits(kBFloat16, FloatToBFloat16(BitsToFloat(nan_bits))))
        << std::hex << nan_bits;
  }
}

// LoadElement/StoreElement dispatch on the dtype and round like the conversions.
TEST(ElementTest, StoreThenLoadRoundsOnce) {
  const float x = 1.f + 3 * Pow2(-11) + Pow2(-20);
  uint8_t buffer[8];
  StoreElement(buffer, DType::kFloat32, 1, x);
  EXPECT_EQ(LoadElement(buffer, DType::kFloat32, 1), x);
  StoreElement(buffer, DType::kFloat16, 2, x);
  EXPECT_EQ(LoadElement(buffer, DType::kFloat16, 2), HalfToFloat(FloatToHalf(x)));
  StoreElement(buffer, DType::kBFloat16, 3, x);
  EXPECT_EQ(LoadElement(buffer, DType::kBFloat16, 3), BFloat16ToFloat(FloatToBFloat16(x)));
  EXPECT_EQ(ElementSize(DType::kFloat32), 4);
  EXPECT_EQ(ElementSize(DType::kFloat16), 2);
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2);
}

// ---------------------------------------------------------------------------------------------
// A million floats against the slow reference.

// Floats drawn three ways: any bit pattern (NaN, inf, fp32 subnormals, far out of range); a
// random sign and mantissa with an exponent around the format's range; and exact midpoints
// between neighbouring representable values, nudged by −1, 0 or +1 fp32 ulp.
std::vector<float> SweepInputs(const Format& f, const ReferenceEncoder& encoder, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> inputs;
  inputs.reserve(1000000);
  const int min_exponent = 1 - f.bias - f.mantissa_bits - 2;
  const int max_exponent = (1 << f.exponent_bits) - 1 - f.bias + 1;
  std::uniform_int_distribution<int> exponent(std::max(min_exponent, -149),
                                              std::min(max_exponent, 127));
  std::uniform_int_distribution<uint32_t> bits32;
  std::uniform_int_distribution<size_t> pattern(0, encoder.finite_count() - 2);
  for (int i = 0; i < 1000000; ++i) {
    float x = 0;
    switch (i % 3) {
      case 0:
        x = BitsToFloat(bits32(rng));
        break;
      case 1: {
        const float mantissa = 1.f + static_cast<float>(bits32(rng) >> 9) * Pow2(-23);
        x = std::ldexp(mantissa, exponent(rng));
        break;
      }
      case 2: {
        const double midpoint = encoder.Midpoint(static_cast<uint16_t>(pattern(rng)));
        x = static_cast<float>(midpoint);  // Exact: a midpoint needs one bit more than the format.
        const int nudge = static_cast<int>(bits32(rng) % 3) - 1;
        if (nudge != 0) x = std::nextafter(x, nudge > 0 ? INFINITY : 0.f);
        break;
      }
    }
    if (bits32(rng) & 1) x = -x;
    inputs.push_back(x);
  }
  return inputs;
}

template <class Convert>
void Sweep(const Format& f, uint64_t seed, Convert convert) {
  const ReferenceEncoder encoder(f);
  int failures = 0;
  for (float x : SweepInputs(f, encoder, seed)) {
    const uint16_t actual = convert(x);
    if (std::isnan(x)) {
      if (!IsNanBits(f, actual)) {
        ADD_FAILURE() << "NaN " << std::hex << FloatBits(x) << " → " << actual;
        ++failures;
      }
      continue;
    }
    const uint16_t expected = encoder.Encode(x);
    if (actual != expected) {
      ADD_FAILURE() << std::hexfloat << x << " (bits " << std::hex << FloatBits(x) << ") → "
                    << actual << ", expected " << expected;
      ++failures;
    }
    ASSERT_LT(failures, 10) << "stopping after 10 failures";
  }
}

// The slow reference itself, on the cases the chosen tests spell out.
TEST(ReferenceEncoderTest, AgreesWithHandCheckedCases) {
  const ReferenceEncoder half(kHalf);
  EXPECT_EQ(half.Encode(65519.f), 0x7bff);
  EXPECT_EQ(half.Encode(65520.f), 0x7c00);
  EXPECT_EQ(half.Encode(1.f + Pow2(-11)), 0x3c00);
  EXPECT_EQ(half.Encode(1.f + 3 * Pow2(-11)), 0x3c02);
  EXPECT_EQ(half.Encode(Pow2(-25)), 0x0000);
  EXPECT_EQ(half.Encode(3 * Pow2(-25)), 0x0002);
  EXPECT_EQ(half.Encode(-0.f), 0x8000);
  const ReferenceEncoder bfloat16(kBFloat16);
  EXPECT_EQ(bfloat16.Encode(1.f + 3 * Pow2(-8)), 0x3f82);
  EXPECT_EQ(bfloat16.Encode(BitsToFloat(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(bfloat16.Encode(BitsToFloat(0x7f7f8000u)), 0x7f80);
  EXPECT_EQ(bfloat16.Encode(Pow2(-134)), 0x0000);
}

TEST(HalfTest, MillionRandomFloatsMatchSlowReference) { Sweep(kHalf, 1, FloatToHalf); }

TEST(BFloat16Test, MillionRandomFloatsMatchSlowReference) { Sweep(kBFloat16, 2, FloatToBFloat16); }

// --- fp8 E4M3 (OCP e4m3fn): bias 7, 3 mantissa bits, no infinities, 0x7f/0xff NaN --------------

// A code's value by the format's definition (NaN codes excluded).
double Fp8ReferenceDecode(uint8_t code) {
  const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
  const double magnitude =
      exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 7 - 3);
  return (code & 0x80) ? -magnitude : magnitude;
}

TEST(Fp8Test, EveryCodeDecodesByDefinitionAndRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const float value = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(value));
      continue;
    }
    EXPECT_EQ(double(value), Fp8ReferenceDecode(static_cast<uint8_t>(code)));
    EXPECT_EQ(FloatToFp8E4M3(value), code);
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);  // 2^-9, the smallest subnormal.
}

// The decode kernels' route (CPU vector paths, CUDA tiles): fp16 bits of the value · 2^-8.
TEST(Fp8Test, EveryCodeIsItsHalfTimes256) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN: never stored.
    SCOPED_TRACE(code);
    const double half = HalfToFloat(Fp8E4M3HalfBits(static_cast<uint8_t>(code)));
    EXPECT_EQ(half * 256, Fp8ReferenceDecode(static_cast<uint8_t>(code)));
    EXPECT_EQ(std::signbit(half), (code & 0x80) != 0);  // −0 for 0x80.
  }
}

// Between every two neighbouring codes: just below the midpoint rounds down, just above rounds
// up, the midpoint itself to the even code; past 448 saturates (no infinity); NaN stays NaN.
TEST(Fp8Test, RoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 0x7e; ++code) {
    SCOPED_TRACE(code);
    const float low = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float high = Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1));
    const float middle = (low + high) / 2;  // Exact in fp32.
    EXPECT_EQ(FloatToFp8E4M3(middle), code % 2 == 0 ? code : code + 1);
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(middle, 0.f)), code);
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(middle, 1e9f)), code + 1);
    EXPECT_EQ(FloatToFp8E4M3(-middle), (code % 2 == 0 ? code : code + 1) | 0x80);
  }
  for (float big : {448.f, 463.99f, 464.f, 1e6f, 3e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToFp8E4M3(big), 0x7e) << big;
    EXPECT_EQ(FloatToFp8E4M3(-big), 0xfe) << big;
  }
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.f, -11)), 0);  // A quarter unit: zero.
  EXPECT_EQ(FloatToFp8E4M3(-0.f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(std::nanf("")) & 0x7f, 0x7f);
}

// A stored row (Fp8RowBytes: codes, zero padding to 4 bytes, the fp32 scale): scale = max |x| /
// 448, the largest element at code ±448, each code the nearest of x / scale; a row of zeros has
// scale 0 and reads as zeros.
TEST(Fp8Test, AQuantizedRowCarriesItsScaleAndEachCodeIsTheNearest) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t width : {1, 3, 4, 17, 128}) {
    SCOPED_TRACE(width);
    std::vector<float> x(width);
    for (float& v : x) v = normal(rng);
    x[width / 2] = 9.5f;  // The largest magnitude.
    std::vector<uint8_t> row(Fp8RowBytes(width), 0xcd);
    EXPECT_EQ(QuantizeFp8Row(x.data(), width, row.data()), 9.5f);
    ASSERT_EQ(row.size() % 4, 0u);
    const float scale = Fp8RowScale(row.data(), row.size());
    EXPECT_EQ(scale, 9.5f / 448.f);
    EXPECT_EQ(row[width / 2], 0x7e);
    for (int64_t i = 0; i < width; ++i) {
      EXPECT_EQ(row[i], FloatToFp8E4M3(x[i] / scale)) << i;
      EXPECT_LE(std::abs(Fp8E4M3ToFloat(row[i]) * scale - x[i]), 9.5f / 16) << i;
    }
    for (size_t i = width; i < row.size() - 4; ++i) EXPECT_EQ(row[i], 0) << "padding " << i;
  }
  const std::vector<float> zeros(5, 0.f);
  std::vector<uint8_t> row(Fp8RowBytes(5), 0xcd);
  EXPECT_EQ(QuantizeFp8Row(zeros.data(), 5, row.data()), 0.f);
  EXPECT_EQ(Fp8RowScale(row.data(), row.size()), 0.f);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(row[i], 0);
  EXPECT_EQ(StoredRowBytes(DType::kFloat8E4M3, 128), 132);
  EXPECT_EQ(StoredRowBytes(DType::kFloat8E4M3, 5), 12);
  EXPECT_EQ(StoredRowBytes(DType::kBFloat16, 128), 256);
}

}  // namespace
