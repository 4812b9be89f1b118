// Fp32Rows: rows of an input tensor as contiguous fp32, for the CPU kernels.
//
// fp32 input is used in place; fp16/bf16 rows are converted into a buffer this object owns and
// reuses, so a kernel converts a head's keys once rather than per score. The returned pointer
// is valid until the next Load on the same object. Not thread-safe: one per worker.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/problem.h"

namespace attn {

class Fp32Rows {
 public:
  // The `count` elements of `tensor` starting at element `offset`, as fp32.
  const float* Load(const TensorView& tensor, int64_t offset, int64_t count) {
    if (tensor.dtype == DType::kFloat32) return static_cast<const float*>(tensor.data) + offset;
    if (static_cast<int64_t>(buffer_.size()) < count) buffer_.resize(count);
    for (int64_t i = 0; i < count; ++i) buffer_[i] = tensor[offset + i];
    return buffer_.data();
  }

  // Bytes this object allocated for conversions.
  int64_t scratch_bytes() const { return static_cast<int64_t>(buffer_.capacity() * sizeof(float)); }

 private:
  std::vector<float> buffer_;
};

}  // namespace attn
