// ScanValues (server/value_scan.h) against a scalar reference: the largest |element| and the
// first non-finite one, for every dtype, odd lengths that end in the vector body or its tail,
// and data at odd byte offsets.
#include "server/value_scan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace attn {
namespace {

constexpr DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// n random elements of dtype (normal, times a random power of two), at byte offset `offset` of
// the returned buffer (made aligned, then copied there: LoadElement and StoreElement need
// alignment, ScanValues does not).
std::vector<unsigned char> RandomElements(DType dtype, int64_t n, int offset, std::mt19937& rng) {
  std::vector<float> aligned(n);  // Room for n elements of any dtype.
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> power(-8, 8);
  for (int64_t i = 0; i < n; ++i) {
    StoreElement(aligned.data(), dtype, i, std::ldexp(normal(rng), power(rng)));
  }
  std::vector<unsigned char> bytes(offset + n * ElementSize(dtype) + 1, 0xAB);
  std::memcpy(bytes.data() + offset, aligned.data(), n * ElementSize(dtype));
  return bytes;
}

// Element i of a buffer at any alignment.
float ElementAt(const void* data, DType dtype, int64_t i) {
  uint32_t bits = 0;
  std::memcpy(&bits, static_cast<const unsigned char*>(data) + i * ElementSize(dtype),
              ElementSize(dtype));
  return LoadElement(&bits, dtype, 0);
}

void SetElementBits(void* data, DType dtype, int64_t i, uint32_t bits) {
  if (dtype == DType::kFloat32) {
    std::memcpy(static_cast<unsigned char*>(data) + 4 * i, &bits, 4);
  } else {
    const uint16_t half = static_cast<uint16_t>(bits);
    std::memcpy(static_cast<unsigned char*>(data) + 2 * i, &half, 2);
  }
}

TEST(ValueScanTest, LargestMagnitudeMatchesAScalarScan) {
  std::mt19937 rng(20261201);
  for (DType dtype : kDtypes) {
    for (int64_t n : {1, 2, 7, 15, 16, 17, 31, 33, 63, 65, 127, 1001, 65537}) {
      for (int offset : {0, 1, 3}) {
        std::vector<unsigned char> bytes = RandomElements(dtype, n, offset, rng);
        const void* data = bytes.data() + offset;
        double expected = 0;
        for (int64_t i = 0; i < n; ++i) {
          expected = std::max(expected, std::abs(double{ElementAt(data, dtype, i)}));
        }
        const ValueScan scan = ScanValues(data, dtype, n);
        EXPECT_EQ(scan.max_abs, expected) << DTypeName(dtype) << " n=" << n << " offset=" << offset;
        EXPECT_EQ(scan.first_non_finite, -1) << DTypeName(dtype) << " n=" << n;
      }
    }
  }
}

TEST(ValueScanTest, FindsTheFirstInfOrNanAnywhere) {
  std::mt19937 rng(7);
  // inf, −inf, a quiet NaN and a NaN with the sign bit, in each format's bits.
  const std::vector<uint32_t> fp32 = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u};
  const std::vector<uint32_t> fp16 = {0x7c00u, 0xfc00u, 0x7e00u, 0xfe01u};
  const std::vector<uint32_t> bf16 = {0x7f80u, 0xff80u, 0x7fc0u, 0xffc1u};
  for (DType dtype : kDtypes) {
    const std::vector<uint32_t>& specials =
        dtype == DType::kFloat32 ? fp32 : (dtype == DType::kFloat16 ? fp16 : bf16);
    for (int64_t n : {1, 33, 257, 4099}) {
      for (uint32_t special : specials) {
        for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
          std::vector<unsigned char> bytes = RandomElements(dtype, n, 1, rng);
          void* data = bytes.data() + 1;
          SetElementBits(data, dtype, at, special);
          if (at + 1 < n) SetElementBits(data, dtype, n - 1, specials[0]);  // A later one too.
          const ValueScan scan = ScanValues(data, dtype, n);
          EXPECT_EQ(scan.first_non_finite, at) << DTypeName(dtype) << " n=" << n;
          const float value = ElementAt(data, dtype, at);
          if (std::isnan(value)) {
            EXPECT_TRUE(std::isnan(scan.non_finite_value));
          } else {
            EXPECT_EQ(scan.non_finite_value, value);
          }
        }
      }
    }
  }
}

// Past 8 MiB the scan runs in slices on several threads: the answer must not depend on where the
// largest element or the first non-finite one falls, slice boundaries included.
TEST(ValueScanTest, ALargeTensorScannedInSlicesGivesTheSameAnswers) {
  std::mt19937 rng(12);
  for (DType dtype : kDtypes) {
    const int64_t n = (int64_t{12} << 20) / ElementSize(dtype) + 7;
    std::vector<unsigned char> bytes = RandomElements(dtype, n, 1, rng);
    void* data = bytes.data() + 1;
    double baseline = 0;
    for (int64_t i = 0; i < n; ++i) {
      baseline = std::max(baseline, std::abs(double{ElementAt(data, dtype, i)}));
    }
    const ValueScan plain = ScanValues(data, dtype, n);
    EXPECT_EQ(plain.max_abs, baseline) << DTypeName(dtype);
    // Larger than any random element (|x| < 2^13): 2^20, or fp16's largest finite value.
    const uint32_t big = dtype == DType::kFloat32   ? 0x49800000u
                         : dtype == DType::kFloat16 ? 0x7bffu
                                                    : 0x4980u;
    for (int64_t at : {int64_t{0}, n / 4 - 1, n / 4, n / 2, 3 * n / 4 + 1, n - 1}) {
      std::vector<unsigned char> copy = bytes;
      void* poked = copy.data() + 1;
      SetElementBits(poked, dtype, at, big);
      const ValueScan scan = ScanValues(poked, dtype, n);
      EXPECT_EQ(scan.max_abs, ElementAt(poked, dtype, at)) << DTypeName(dtype) << " at " << at;
      EXPECT_EQ(scan.first_non_finite, -1);
      SetElementBits(poked, dtype, n - 1, dtype == DType::kFloat32 ? 0x7f800000u : 0xfc00u);
      if (dtype == DType::kBFloat16) SetElementBits(poked, dtype, n - 1, 0xff80u);
      if (at != n - 1)
        SetElementBits(poked, dtype, at + 1,
                       dtype == DType::kFloat32   ? 0x7fc00000u
                       : dtype == DType::kFloat16 ? 0x7e00u
                                                  : 0x7fc0u);
      EXPECT_EQ(ScanValues(poked, dtype, n).first_non_finite, at == n - 1 ? n - 1 : at + 1)
          << DTypeName(dtype) << " at " << at;
    }
  }
}

TEST(ValueScanTest, TheLargestFiniteValuesAreFinite) {
  for (DType dtype : kDtypes) {
    const float largest = dtype == DType::kFloat32   ? std::numeric_limits<float>::max()
                          : dtype == DType::kFloat16 ? 65504.f
                                                     : BFloat16ToFloat(0x7f7fu);
    std::vector<unsigned char> bytes(3 * ElementSize(dtype));
    StoreElement(bytes.data(), dtype, 0, 1.f);
    StoreElement(bytes.data(), dtype, 1, -largest);
    StoreElement(bytes.data(), dtype, 2, 0.f);
    const ValueScan scan = ScanValues(bytes.data(), dtype, 3);
    EXPECT_EQ(scan.first_non_finite, -1) << DTypeName(dtype);
    EXPECT_EQ(scan.max_abs, largest) << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace attn
