// Host conversions of rows between dtypes (kernels/dtype.h), a run of elements at a time: to
// fp32 (ConvertToFloat, DequantizeFp8Row), from fp32 (StoreFloats), and tokens into the rows a KV
// store keeps (ToStoredRows), which both backends' stores stage their appends through. One loop
// per dtype, so that each vectorizes. Host code only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/problem.h"

namespace attn {

// dst[i] = src[i] as fp32 for i < count: one loop per dtype, so each vectorizes.
inline void ConvertToFloat(const void* src, DType dtype, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* f = static_cast<const float*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = f[i];
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* b = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = BFloat16ToFloat(b[i]);
      return;
    }
    case DType::kFloat16: {
      const uint16_t* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = HalfToFloat(h[i]);
      return;
    }
    case DType::kFloat8E4M3: {  // The codes' values: the caller applies the row's scale.
      const uint8_t* b = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = Fp8E4M3ToFloat(b[i]);
      return;
    }
  }
}

// dst[i] = element i of one stored fp8 row (row_bytes bytes: Fp8RowBytes) as fp32, i < width:
// code · the row's scale.
inline void DequantizeFp8Row(const void* row, int64_t width, int64_t row_bytes, float* dst) {
  const float scale = Fp8RowScale(row, row_bytes);
  const uint8_t* codes = static_cast<const uint8_t*>(row);
  for (int64_t i = 0; i < width; ++i) dst[i] = Fp8E4M3ToFloat(codes[i]) * scale;
}

// dst[offset + i] = src[i] rounded to dst's dtype, for i < count.
inline void StoreFloats(const float* src, int64_t count, const MutableTensorView& dst,
                        int64_t offset) {
  switch (dst.dtype) {
    case DType::kFloat32: {
      float* f = static_cast<float*>(dst.data) + offset;
      for (int64_t i = 0; i < count; ++i) f[i] = src[i];
      return;
    }
    case DType::kBFloat16: {
      uint16_t* b = static_cast<uint16_t*>(dst.data) + offset;
      for (int64_t i = 0; i < count; ++i) b[i] = FloatToBFloat16(src[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* h = static_cast<uint16_t*>(dst.data) + offset;
      for (int64_t i = 0; i < count; ++i) h[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kFloat8E4M3: {  // Codes, unscaled (no output is fp8; scales are the caller's).
      uint8_t* b = static_cast<uint8_t*>(dst.data) + offset;
      for (int64_t i = 0; i < count; ++i) b[i] = FloatToFp8E4M3(src[i]);
      return;
    }
  }
}

// `rows` rows of `width` elements from src (dense rows in dtype `from`) to dst as the store keeps
// them (StoredRowBytes(to, width) each): copied when the dtypes match (an fp8 source holds
// stored rows: a file's, an export's), quantized into fp8 rows, else converted through fp32 in
// chunks of `scratch`.
inline void ToStoredRows(const void* src, DType from, int64_t rows, int64_t width, void* dst,
                         DType to, std::vector<float>& scratch) {
  if (from == to) {
    std::copy_n(static_cast<const char*>(src), rows * StoredRowBytes(from, width),
                static_cast<char*>(dst));
    return;
  }
  if (to == DType::kFloat8E4M3) {
    scratch.resize(width);
    const int64_t row_bytes = Fp8RowBytes(width);
    for (int64_t r = 0; r < rows; ++r) {
      ConvertToFloat(static_cast<const char*>(src) + r * width * ElementSize(from), from, width,
                     scratch.data());
      QuantizeFp8Row(scratch.data(), width, static_cast<char*>(dst) + r * row_bytes);
    }
    return;
  }
  const int64_t count = rows * width;
  constexpr int64_t kChunk = 4096;
  scratch.resize(kChunk);
  for (int64_t done = 0; done < count; done += kChunk) {
    const int64_t n = std::min(kChunk, count - done);
    ConvertToFloat(static_cast<const char*>(src) + done * ElementSize(from), from, n,
                   scratch.data());
    StoreFloats(scratch.data(), n, MutableTensorView{dst, to}, done);
  }
}

}  // namespace attn
