#include "server/value_scan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace attn {
namespace {

// The largest magnitude bits (bits & mask) of n elements of Bits: four 32-byte vector maxes per
// step (one AVX2 register each: a wider vector type would live on the stack), then the lanes,
// then the tail.
template <class Bits>
[[gnu::always_inline]] inline Bits MaxMagnitudeBody(const unsigned char* data, int64_t n,
                                                    Bits mask) {
  typedef Bits Lanes __attribute__((vector_size(32)));
  constexpr int64_t kLanes = sizeof(Lanes) / sizeof(Bits);
  Lanes max0{}, max1{}, max2{}, max3{}, bits0, bits1, bits2, bits3;
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    std::memcpy(&bits0, data + i * sizeof(Bits), sizeof(Lanes));
    std::memcpy(&bits1, data + (i + kLanes) * sizeof(Bits), sizeof(Lanes));
    std::memcpy(&bits2, data + (i + 2 * kLanes) * sizeof(Bits), sizeof(Lanes));
    std::memcpy(&bits3, data + (i + 3 * kLanes) * sizeof(Bits), sizeof(Lanes));
    bits0 &= mask;
    bits1 &= mask;
    bits2 &= mask;
    bits3 &= mask;
    max0 = bits0 > max0 ? bits0 : max0;
    max1 = bits1 > max1 ? bits1 : max1;
    max2 = bits2 > max2 ? bits2 : max2;
    max3 = bits3 > max3 ? bits3 : max3;
  }
  max0 = max1 > max0 ? max1 : max0;
  max2 = max3 > max2 ? max3 : max2;
  const Lanes max = max2 > max0 ? max2 : max0;
  Bits result = 0;
  for (int64_t l = 0; l < kLanes; ++l) result = max[l] > result ? max[l] : result;
  for (; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, data + i * sizeof(Bits), sizeof bits);
    bits &= mask;
    result = bits > result ? bits : result;
  }
  return result;
}

#if defined(__x86_64__) && defined(__GNUC__)
template <class Bits>
__attribute__((target("avx2"))) Bits MaxMagnitudeAvx2(const unsigned char* data, int64_t n,
                                                      Bits mask) {
  return MaxMagnitudeBody(data, n, mask);
}
bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

template <class Bits>
Bits MaxMagnitudePortable(const unsigned char* data, int64_t n, Bits mask) {
  return MaxMagnitudeBody(data, n, mask);
}

template <class Bits>
Bits MaxMagnitudeOnOneThread(const unsigned char* bytes, int64_t n, Bits mask) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (HasAvx2()) return MaxMagnitudeAvx2(bytes, n, mask);
#endif
  return MaxMagnitudePortable(bytes, n, mask);
}

// One core reads at a fraction of the machine's memory bandwidth: a tensor this large is split
// over up to kMaxScanThreads threads (started for the call: tens of microseconds beside the
// milliseconds one pass over it takes), each taking an equal slice.
constexpr int64_t kParallelScanBytes = 8 << 20;
constexpr unsigned kMaxScanThreads = 4;

template <class Bits>
Bits MaxMagnitude(const void* data, int64_t n, Bits mask) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (n * static_cast<int64_t>(sizeof(Bits)) < kParallelScanBytes) {
    return MaxMagnitudeOnOneThread(bytes, n, mask);
  }
  // Asked once: glibc reads /sys for it, a file's open, read and close on every call.
  static const unsigned threads =
      std::min(kMaxScanThreads, std::max(1u, std::thread::hardware_concurrency()));
  if (threads < 2) return MaxMagnitudeOnOneThread(bytes, n, mask);
  std::vector<Bits> largest(threads, 0);
  std::vector<std::thread> helpers;
  auto slice = [&](unsigned t) {
    const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
    largest[t] = MaxMagnitudeOnOneThread(bytes + begin * sizeof(Bits), end - begin, mask);
  };
  for (unsigned t = 1; t < threads; ++t) helpers.emplace_back(slice, t);
  slice(0);
  for (std::thread& helper : helpers) helper.join();
  return *std::max_element(largest.begin(), largest.end());
}

// The index of the first element whose magnitude bits reach `infinity`'s (one exists).
template <class Bits>
int64_t FirstNonFinite(const void* data, int64_t n, Bits mask, Bits infinity) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, bytes + i * sizeof(Bits), sizeof bits);
    if ((bits & mask) >= infinity) return i;
  }
  return -1;
}

template <class Bits>
ValueScan Scan(const void* data, DType dtype, int64_t n, Bits mask, Bits infinity) {
  ValueScan scan;
  const Bits largest = MaxMagnitude<Bits>(data, n, mask);
  scan.max_abs = LoadElement(&largest, dtype, 0);
  if (largest >= infinity) {
    scan.first_non_finite = FirstNonFinite<Bits>(data, n, mask, infinity);
    Bits bits;  // Copied out: the data need not be aligned.
    std::memcpy(&bits,
                static_cast<const unsigned char*>(data) + scan.first_non_finite * sizeof(Bits),
                sizeof bits);
    scan.non_finite_value = LoadElement(&bits, dtype, 0);
  }
  return scan;
}

}  // namespace

ValueScan ScanValues(const void* data, DType dtype, int64_t elements) {
  switch (dtype) {
    case DType::kFloat32:
      return Scan<uint32_t>(data, dtype, elements, 0x7fffffffu, 0x7f800000u);
    case DType::kFloat16:
      return Scan<uint16_t>(data, dtype, elements, 0x7fffu, 0x7c00u);
    case DType::kBFloat16:
      return Scan<uint16_t>(data, dtype, elements, 0x7fffu, 0x7f80u);
    case DType::kFloat8E4M3:  // Rows with scales: ScanFp8Rows.
      break;
  }
  return ValueScan{};
}

ValueScan ScanFp8Rows(const void* data, int64_t rows, int64_t width) {
  ValueScan scan;
  const int64_t row_bytes = Fp8RowBytes(width);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* codes = static_cast<const uint8_t*>(data) + r * row_bytes;
    const float scale = Fp8RowScale(codes, row_bytes);
    if (!std::isfinite(scale) || scale < 0) {
      scan.first_non_finite = r * width;
      scan.non_finite_value = std::isfinite(scale) ? std::nanf("") : scale;
      return scan;
    }
    uint8_t largest = 0;
    for (int64_t i = 0; i < width; ++i) {
      const uint8_t magnitude = codes[i] & 0x7fu;
      if (magnitude == 0x7fu) {
        scan.first_non_finite = r * width + i;
        scan.non_finite_value = Fp8E4M3ToFloat(codes[i]);
        return scan;
      }
      largest = std::max(largest, magnitude);
    }
    scan.max_abs = std::max<double>(scan.max_abs, Fp8E4M3ToFloat(largest) * scale);
  }
  return scan;
}

}  // namespace attn
