// lanes: eight floats at a time on the CPU, for the softmax's vector loops (online_softmax.h,
// exp.h) and KeyTile's kernels (cpu/key_tile_kernels.inc).
//
// GCC vector extensions: SSE pairs in the portable build, one AVX register in the AVX2 clone
// (cpu/cpu_dispatch.h). Every operation here is one the scalar code also performs, in the same
// order, so a value is the same whether it went through a vector or a scalar tail. Host code
// only: the CUDA kernels never see these types.
#pragma once

#if !defined(__CUDA_ARCH__)
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace attn::lanes {

constexpr int kWidth = 8;
typedef float Floats __attribute__((vector_size(32)));
typedef int32_t Ints __attribute__((vector_size(32)));
typedef uint32_t UInts __attribute__((vector_size(32)));

ATTN_HOST_DEVICE Floats Load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ATTN_HOST_DEVICE void Store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }
ATTN_HOST_DEVICE Floats Splat(float x) { return Floats{} + x; }

// op folded over the eight lanes as a tree (halves, then quarters, then pairs): three steps
// instead of a chain of seven, in a fixed order.
template <typename Op>
ATTN_HOST_DEVICE float Reduce(Floats v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}

}  // namespace attn::lanes
#endif
