// The pages of a KV cache on the device (kernels/cuda/kv_store.h owns them; PagedKv in
// kernels/problem.h is the layout): page p holds tokens [p·page_tokens, (p+1)·page_tokens) of
// every kv head, a key block [kv_heads, page_tokens] of stored key rows and a value block
// [kv_heads, page_tokens] of stored value rows (StoredRowBytes, kernels/dtype.h).
//   ScatterKernel  an append: dense new stored rows [kv_heads, n] into their pages, 4 (or 2)
//                  bytes per thread (grid-stride), copied as bits (the host made the rows:
//                  converted, or quantized into fp8 rows with their scales).
//   GatherKernel   the first key_len tokens out of the pages into the dense [kv_heads, key_len,
//                  pitch] rows (zero-padded; fp8 codes times their rows' scales) that Naive,
//                  Tiled and Trace read: the first version of attention over a cache for those
//                  three — a copy of the cache per call, simple and exact; Decode (decode.cu)
//                  reads the pages in place.
// Measured: not yet on a GPU (see docs/perf.md). Both move bytes only; neither is on the decode
// path's critical loop.
#include <cstdint>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/portable.h"
#include "kernels/dtype.h"

namespace attn::cuda {
namespace {

constexpr int kThreads = 256;

// Rows of `units` Elements each (a stored row's bytes in the widest Element that divides them).
template <class Element>
__global__ void ScatterKernel(const Element* tokens, int64_t kv_heads, int64_t n, int64_t units,
                              void* const* table, int64_t page_tokens, int64_t first) {
  const int64_t per_head = n * units;
  const int64_t total = kv_heads * per_head;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t kv_head = i / per_head;
    const int64_t token = first + (i % per_head) / units;
    const int64_t unit = i % units;
    Element* page = static_cast<Element*>(table[token / page_tokens]);
    page[(kv_head * page_tokens + token % page_tokens) * units + unit] = tokens[i];
  }
}

__global__ void GatherKernel(const PagedKv pages, bool keys, int64_t kv_heads, int64_t key_len,
                             int64_t width, void* out, DType out_dtype, int64_t pitch) {
  const void* const* table = keys ? pages.key_pages : pages.value_pages;
  const int64_t per_head = key_len * pitch;
  const int64_t total = kv_heads * per_head;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t kv_head = i / per_head;
    const int64_t token = (i % per_head) / pitch;
    const int64_t column = i % pitch;
    float value = 0.f;
    if (column < width) {
      const int64_t row =
          keys ? pages.KeyOffsetInPage(kv_head, token) : pages.ValueOffsetInPage(kv_head, token);
      const void* page = table[token / pages.page_tokens];
      value = LoadElement(page, pages.dtype, row + column);
      if (pages.dtype == DType::kFloat8E4M3) {  // The code times its row's scale (dtype.h).
        value *= Fp8RowScale(static_cast<const char*>(page) + row,
                             keys ? pages.key_width : pages.value_width);
      }
    }
    StoreElement(out, out_dtype, i, value);
  }
}

unsigned GridFor(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

cudaError_t LaunchGather(const PagedKv& pages, bool keys, int64_t kv_heads, int64_t key_len,
                         int64_t width, void* out, DType out_dtype, int64_t pitch,
                         cudaStream_t stream) {
  return LaunchKernel(GatherKernel, GridFor(kv_heads * key_len * pitch), kThreads, 0, stream, pages,
                      keys, kv_heads, key_len, width, out, out_dtype, pitch);
}

cudaError_t LaunchScatter(const void* tokens, int64_t kv_heads, int64_t n, int64_t row_bytes,
                          void* const* table, int64_t page_tokens, int64_t first,
                          cudaStream_t stream) {
  if (row_bytes % 4 == 0) {
    const int64_t units = row_bytes / 4;
    return LaunchKernel(ScatterKernel<uint32_t>, GridFor(kv_heads * n * units), kThreads, 0, stream,
                        static_cast<const uint32_t*>(tokens), kv_heads, n, units, table,
                        page_tokens, first);
  }
  if (row_bytes % 2 == 0) {
    const int64_t units = row_bytes / 2;
    return LaunchKernel(ScatterKernel<uint16_t>, GridFor(kv_heads * n * units), kThreads, 0, stream,
                        static_cast<const uint16_t*>(tokens), kv_heads, n, units, table,
                        page_tokens, first);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attn::cuda
