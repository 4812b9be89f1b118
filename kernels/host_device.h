// ATTN_HOST_DEVICE marks small functions that both the CPU backend and CUDA kernels call, so
// the math has one source. They are always inlined: on the CPU into the vectorized callers
// compiled per instruction set (cpu/cpu_dispatch.h), which an out-of-line call would defeat.
#pragma once

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define ATTN_HOST_DEVICE inline __attribute__((always_inline))
#else
#define ATTN_HOST_DEVICE inline
#endif
