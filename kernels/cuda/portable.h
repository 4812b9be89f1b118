// The few places where the CUDA kernels' source differs between nvcc and the SIMT emulator
// (tests/simt/README.md), which compiles the same .cu files with g++ (ATTN_SIMT defined) so that
// the backend runs, and its GPU suites pass, on a machine without a GPU:
//   LaunchKernel          a launch: <<<grid, block, shared, stream>>> under nvcc, then the
//                         launch's error; in the emulator, simt::Launch runs the grid there and
//                         then.
//   ATTN_SHARED_ARRAY     a static __shared__ array, and ATTN_DYNAMIC_SHARED the block's
//                         dynamic shared memory: under nvcc the declarations themselves; in the
//                         emulator a per-block allocation whose bounds ASan knows and whose
//                         accesses racecheck follows.
//   CopyAsync, CommitCopies, WaitCopies, Mma
//                         the inline PTX (cp.async, mma.sync): the asm statements under nvcc,
//                         the emulator's model of each instruction in its place.
//   LoadWord              a 4-byte load of any element type's storage: a uint32_t load under
//                         nvcc, a memcpy in the emulator (g++'s aliasing rules).
// Device code only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace attn::cuda {

template <class... Params, class... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                         cudaStream_t stream, Args&&... args) {
#if defined(ATTN_SIMT)
  return ::simt::Launch(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#else
  // A .h file is C++ to clang-format, which would split the launch's >>>.
  // clang-format off
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
  // clang-format on
  return cudaGetLastError();
#endif
}

}  // namespace attn::cuda

#if defined(ATTN_SIMT)
// A tag per declaration (the lambda's type is unique to each expansion, and to each template
// instantiation around it) names the array the block's threads share.
#define ATTN_SHARED_ARRAY(type, name, count)                  \
  type* const name = static_cast<type*>(::simt::StaticShared( \
      [] {                                                    \
        static const char tag = 0;                            \
        return static_cast<const void*>(&tag);                \
      }(),                                                    \
      #name, sizeof(type) * (count), alignof(type)))
#define ATTN_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::simt::DynamicShared())
#else
#define ATTN_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#define ATTN_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

namespace attn::cuda {

// The 4 bytes at `p` (4-byte aligned), whatever type they are stored as.
__device__ __forceinline__ uint32_t LoadWord(const void* p) {
#if defined(ATTN_SIMT)
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
#else
  return *static_cast<const uint32_t*>(p);
#endif
}

// Copies `kBytes` (4, 8 or 16) from global to shared memory, or writes zeros when !valid
// (cp.async, .cg for 16 bytes: L2 only; .ca otherwise). Lands at a WaitCopies that covers it.
template <int kBytes>
__device__ __forceinline__ void CopyAsync(void* shared, const void* global, bool valid) {
#if defined(ATTN_SIMT)
  ::simt::CopyAsync(shared, global, kBytes, valid ? kBytes : 0);
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
                 "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(address), "l"(global),
                 "n"(kBytes), "r"(valid ? kBytes : 0));
  }
#endif
}

// Closes this thread's group of copies (cp.async.commit_group).
__device__ __forceinline__ void CommitCopies() {
#if defined(ATTN_SIMT)
  ::simt::CommitCopies();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending of this thread's committed groups are in flight
// (cp.async.wait_group).
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
#if defined(ATTN_SIMT)
  ::simt::WaitCopies(kPending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// d += a · b for the warp: mma.sync.aligned.m16n8k16.row.col.f32 with T (__half or
// __nv_bfloat16) inputs; fragments as the PTX ISA lays them out (tiled.cu's MmaKernel).
template <class T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void Mma<__half>(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
#if defined(ATTN_SIMT)
  ::simt::MmaSync(::simt::MmaType::kF16, d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                   const uint32_t (&b)[2]) {
#if defined(ATTN_SIMT)
  ::simt::MmaSync(::simt::MmaType::kBF16, d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

}  // namespace attn::cuda
