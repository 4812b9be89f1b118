// Runtime dispatch for the CPU kernels' vector loops. The binary is portable (no -march=native:
// baseline x86-64, SSE2), so each hot loop is compiled more than once — for the baseline, for
// AVX2 + FMA and, for the KvTile kernels, the softmax step and the decode kernel (kv_tile.cc,
// tiled.cc, naive.cc, decode.cc), for AVX-512 — and the widest the CPU has runs (checked once).
// Use:
//
//   ATTN_CPU_FAST void LoopAvx2(args) { Loop(args); }   // Loop: an always-inline body
//   void LoopPortable(args) { Loop(args); }
//   ... CpuHasAvx2Fma() ? LoopAvx2(args) : LoopPortable(args);
//
// (GCC's target_clones("arch=haswell") would dispatch on the CPU model and miss AMD parts.)
// The versions may differ in the last bits (FMA contraction, lane counts); a machine always uses
// the same one, so results never depend on the thread count.
//
// Environment, so that one machine can test every path (tests/CMakeLists.txt runs the kernel
// suite each way): ATTN_CPU_BASELINE=1 forces the baseline versions; ATTN_CPU_AVX2=1 forces
// AVX2 + FMA on a CPU that has AVX-512.
#pragma once

#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <cpuid.h>

#define ATTN_CPU_FAST __attribute__((target("avx2,fma")))
#define ATTN_CPU_HAS_AVX512_BUILD 1
// AVX2 + FMA, with F16C (every such CPU has it; the decode kernel's fp8 loop converts through
// fp16). F16C by CPUID: clang 14's __builtin_cpu_supports does not know the name.
inline bool CpuHasAvx2Fma() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
           std::getenv("ATTN_CPU_BASELINE") == nullptr;
  }();
  return has;
}
// AVX-512 F, BW, DQ and VL (Intel since Skylake-SP, AMD since Zen 4), with AVX2 + FMA.
inline bool CpuHasAvx512() {
  static const bool has =
      CpuHasAvx2Fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      std::getenv("ATTN_CPU_AVX2") == nullptr;
  return has;
}
#else
#define ATTN_CPU_FAST
inline bool CpuHasAvx2Fma() { return false; }
inline bool CpuHasAvx512() { return false; }
#endif

// The path the CPU kernels take on this machine, for messages and benchmarks.
inline const char* CpuKernelPath() {
  return CpuHasAvx512() ? "avx512" : (CpuHasAvx2Fma() ? "avx2" : "baseline");
}
