// ATTN_HOST_DEVICE marks small functions that both the CPU backend and CUDA kernels call, so
// the math has one source. They are always inlined: on the CPU into the vectorized callers
// compiled per instruction set (cpu/cpu_dispatch.h), which an out-of-line call would defeat.
// ATTN_ALWAYS_INLINE marks CPU-only code that needs the same inlining and is never compiled for
// a device: the lane helpers (lanes.h), the vector versions of Exp, tanh and the score
// transform, the key-tile and decode kernels (cpu/*.inc).
// ATTN_UNROLL asks nvcc to unroll the loop that follows (so that a register array it indexes
// stays in registers); on the CPU it is nothing.
#pragma once

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define ATTN_HOST_DEVICE inline __attribute__((always_inline))
#else
#define ATTN_HOST_DEVICE inline
#endif

#if defined(__GNUC__)
#define ATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ATTN_ALWAYS_INLINE inline
#endif

#if defined(__CUDA_ARCH__)
#define ATTN_UNROLL _Pragma("unroll")
#else
#define ATTN_UNROLL
#endif
