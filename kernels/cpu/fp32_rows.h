// Fp32Rows: rows of an input tensor as contiguous fp32, for the CPU kernels.
//
// fp32 input is used in place; fp16/bf16 rows are converted into a buffer this object owns and
// reuses (a tile or a head at a time). The returned pointer is valid until the next Load on the
// same object. Not thread-safe: one per worker.
//
// LoadKeys/LoadValues are the one view of a problem's keys and values for the kernels that work
// in fp32 (Naive, Tiled, Trace): rows [begin, begin + count) of one kv head, from dense tensors
// or from a cache's pages (Problem::pages). Paged rows in one page of an fp32 cache are used in
// place; otherwise the page segments are gathered (and converted; fp8 rows dequantized, code ·
// the row's scale) into the buffer. The values are the same floats either way, so a kernel
// computes the same bits on both layouts.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/convert.h"
#include "kernels/cpu/aligned.h"
#include "kernels/problem.h"

namespace attn {

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

  // Keys [begin, begin + count) of kv head `kv_head` of batch `batch`, [count, head_dim] fp32.
  const float* LoadKeys(const Problem& problem, int64_t batch, int64_t kv_head, int64_t begin,
                        int64_t count) {
    if (problem.pages == nullptr) {
      return Load(problem.key, problem.KeyOffset(batch, kv_head, begin),
                  count * problem.shape.head_dim);
    }
    return LoadPaged(*problem.pages, /*keys=*/true, kv_head, begin, count, problem.shape.head_dim);
  }
  // Values [begin, begin + count) of kv head `kv_head` of batch `batch`, [count, value_dim] fp32.
  const float* LoadValues(const Problem& problem, int64_t batch, int64_t kv_head, int64_t begin,
                          int64_t count) {
    if (problem.pages == nullptr) {
      return Load(problem.value, problem.ValueOffset(batch, kv_head, begin),
                  count * problem.shape.value_dim);
    }
    return LoadPaged(*problem.pages, /*keys=*/false, kv_head, begin, count,
                     problem.shape.value_dim);
  }

  // Bytes this object allocated for conversions.
  int64_t scratch_bytes() const { return static_cast<int64_t>(buffer_.capacity() * sizeof(float)); }

 private:
  // The first `width` elements of rows [begin, begin + count) of the key or value blocks
  // (PagedKv's layout; rows of key_width or value_width elements, which a latent cache's values
  // do not fill).
  const float* LoadPaged(const PagedKv& pages, bool keys, int64_t kv_head, int64_t begin,
                         int64_t count, int64_t width) {
    const void* const* table = keys ? pages.key_pages : pages.value_pages;
    const int64_t row = keys ? pages.key_width : pages.value_width;
    const int64_t element = ElementSize(pages.dtype);
    const int64_t in_page = pages.page_tokens - begin % pages.page_tokens;
    auto offset = [&](int64_t token) {
      return keys ? pages.KeyOffsetInPage(kv_head, token) : pages.ValueOffsetInPage(kv_head, token);
    };
    if (pages.dtype == DType::kFloat32 && count <= in_page && (row == width || count == 1)) {
      return static_cast<const float*>(table[begin / pages.page_tokens]) + offset(begin);
    }
    if (static_cast<int64_t>(buffer_.size()) < count * width) buffer_.resize(count * width);
    for (int64_t token = begin; token < begin + count;) {
      const int64_t rows =
          std::min(pages.page_tokens - token % pages.page_tokens, begin + count - token);
      const char* page = static_cast<const char*>(table[token / pages.page_tokens]);
      if (pages.dtype == DType::kFloat8E4M3) {  // Each row with its own scale.
        for (int64_t i = 0; i < rows; ++i) {
          DequantizeFp8Row(page + offset(token + i), width, row,
                           buffer_.data() + (token + i - begin) * width);
        }
      } else if (row == width) {  // A segment of whole rows: one conversion.
        ConvertToFloat(page + offset(token) * element, pages.dtype, rows * width,
                       buffer_.data() + (token - begin) * width);
      } else {
        for (int64_t i = 0; i < rows; ++i) {
          ConvertToFloat(page + offset(token + i) * element, pages.dtype, width,
                         buffer_.data() + (token + i - begin) * width);
        }
      }
      token += rows;
    }
    return buffer_.data();
  }

  AlignedVector<float> buffer_;
};

}  // namespace attn
