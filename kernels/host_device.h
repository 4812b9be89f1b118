// ATTN_HOST_DEVICE marks small functions that both the CPU backend and CUDA kernels call, so
// the math has one source. Outside nvcc it expands to nothing.
#pragma once

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif
