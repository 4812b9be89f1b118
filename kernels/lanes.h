// lanes: eight (or sixteen) floats at a time on the CPU, for the softmax's vector loops
// (online_softmax.h, exp.h) and KvTile's kernels (cpu/kv_tile_kernels.inc).
//
// GCC vector extensions: eight floats are SSE pairs in the portable build and one AVX register in
// the AVX2 clone; sixteen are one AVX-512 register in the AVX-512 clone (cpu/cpu_dispatch.h).
// Every operation here is one the scalar code also performs, in the same order, so a value is the
// same whether it went through a vector or a scalar tail. Host code only: the CUDA kernels never
// see these types.
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

// Sixteen lanes: the AVX-512 clone's softmax (VisitTile<Floats16>).
typedef float Floats16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));
typedef uint32_t UInts16 __attribute__((vector_size(64)));

template <class V = Floats>
ATTN_ALWAYS_INLINE V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
ATTN_ALWAYS_INLINE void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <class V = Floats>
ATTN_ALWAYS_INLINE V Splat(float x) {
  return V{} + x;
}

// op folded over the eight lanes as a tree (halves, then quarters, then pairs): three steps
// instead of a chain of seven, in a fixed order.
template <typename Op>
ATTN_ALWAYS_INLINE float Reduce(Floats v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}
// Sixteen lanes: the halves folded first, then as above.
template <typename Op>
ATTN_ALWAYS_INLINE float Reduce(Floats16 v, Op op) {
  const Floats low = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const Floats high = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return Reduce(op(low, high), op);
}

}  // namespace attn::lanes
#endif
