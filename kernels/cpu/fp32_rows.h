// Fp32Rows: rows of an input tensor as contiguous fp32, for the CPU kernels.
//
// fp32 input is used in place; fp16/bf16 rows are converted into a buffer this object owns and
// reuses (a tile or a head at a time). The returned pointer is valid until the next Load on the
// same object. Not thread-safe: one per worker.
#pragma once

#include <cstdint>
#include <vector>

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
  }
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
  }
}

class Fp32Rows {
 public:
  // The `count` elements of `tensor` starting at element `offset`, as fp32.
  const float* Load(const TensorView& tensor, int64_t offset, int64_t count) {
    if (tensor.dtype == DType::kFloat32) return static_cast<const float*>(tensor.data) + offset;
    if (static_cast<int64_t>(buffer_.size()) < count) buffer_.resize(count);
    ConvertToFloat(static_cast<const char*>(tensor.data) + offset * ElementSize(tensor.dtype),
                   tensor.dtype, count, buffer_.data());
    return buffer_.data();
  }

  // Bytes this object allocated for conversions.
  int64_t scratch_bytes() const { return static_cast<int64_t>(buffer_.capacity() * sizeof(float)); }

 private:
  std::vector<float> buffer_;
};

}  // namespace attn
