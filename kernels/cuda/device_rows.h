// Device functions over a DeviceProblem's rows (launch.h), for the kernels that read their
// inputs element by element rather than through shared-memory tiles: Tiled's row kernel
// (tiled.cu) and Trace (trace.cu). Device code only; include from .cu files.
#pragma once

#include <cstdint>

#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

namespace attn::cuda {

// Element offsets of the first element of query row `row` of (batch, head), and of key/value
// row 0 of the key/value head that (batch, head) reads (rows padded to p.pitch).
__device__ __forceinline__ int64_t QueryRowOffset(const DeviceProblem& p, int64_t batch,
                                                  int64_t head, int64_t row) {
  return ((batch * p.shape.heads + head) * p.shape.query_len + row) * p.pitch;
}
__device__ __forceinline__ int64_t KeyValueHeadOffset(const DeviceProblem& p, int64_t batch,
                                                      int64_t head) {
  const int64_t kv_head = KvHeadOf(head, p.shape.heads, p.shape.kv_heads);
  return (batch * p.shape.kv_heads + kv_head) * p.shape.key_len * p.pitch;
}

// q · k over head_dim, one thread alone, in fp32.
__device__ __forceinline__ float Dot(const DeviceProblem& p, int64_t query_offset,
                                     int64_t key_offset) {
  float dot = 0.f;
  for (int64_t c = 0; c < p.shape.head_dim; ++c) {
    dot += LoadElement(p.query, p.dtype, query_offset + c) *
           LoadElement(p.key, p.dtype, key_offset + c);
  }
  return dot;
}

// Element `column` of value row `key` of the head at kv_offset, in fp32.
__device__ __forceinline__ float ValueAt(const DeviceProblem& p, int64_t kv_offset, int64_t key,
                                         int64_t column) {
  return LoadElement(p.value, p.dtype, kv_offset + key * p.pitch + column);
}

}  // namespace attn::cuda
