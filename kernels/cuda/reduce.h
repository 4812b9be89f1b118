// Reduce policies of OnlineSoftmax (kernels/online_softmax.h) for threads of a CUDA block that
// share a query row: Max and Sum of one float per thread, every thread getting the result.
// Device code only; include from .cu files.
//
//   ShuffleReduce<kLanes>  kLanes adjacent lanes of a warp (a power of two ≤ 32), by xor
//                          shuffles at distance 1, 2, …: QuadReduce (the four lanes of an
//                          mma.sync fragment row), WarpReduce (a warp per row). Every lane of
//                          the warp must call it (full-warp shuffles).
//   BlockReduce<kThreads>  the whole block (kThreads threads, a multiple of 32): the warps'
//                          results through shared memory, combined in warp order. Every thread
//                          of the block must call it (it synchronizes the block).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/portable.h"

namespace attn::cuda {

template <int kLanes>
struct ShuffleReduce {
  static_assert(kLanes > 0 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);

  template <class Op>
  __device__ __forceinline__ static float Combine(float value, Op op) {
#pragma unroll
    for (int distance = 1; distance < kLanes; distance *= 2) {
      value = op(value, __shfl_xor_sync(0xffffffffu, value, distance));
    }
    return value;
  }
  __device__ __forceinline__ static float Max(float x) {
    return Combine(x, [](float a, float b) { return fmaxf(a, b); });
  }
  __device__ __forceinline__ static float Sum(float x) {
    return Combine(x, [](float a, float b) { return a + b; });
  }
};

using QuadReduce = ShuffleReduce<4>;
using WarpReduce = ShuffleReduce<32>;

template <int kThreads>
struct BlockReduce {
  static_assert(kThreads % 32 == 0);

  template <class Op>
  __device__ __forceinline__ static float Combine(float value, Op op) {
    ATTN_SHARED_ARRAY(float, partial, kThreads / 32);
    value = WarpReduce::Combine(value, op);
    __syncthreads();  // `partial` may still be read by a previous reduction.
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
    __syncthreads();
    value = partial[0];
    for (int w = 1; w < kThreads / 32; ++w) value = op(value, partial[w]);
    return value;
  }
  __device__ __forceinline__ static float Max(float x) {
    return Combine(x, [](float a, float b) { return fmaxf(a, b); });
  }
  __device__ __forceinline__ static float Sum(float x) {
    return Combine(x, [](float a, float b) { return a + b; });
  }
};

}  // namespace attn::cuda
