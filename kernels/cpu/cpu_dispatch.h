// Runtime dispatch for the CPU kernels' vector loops. The binary is portable (no -march=native:
// baseline x86-64, SSE2), so each hot loop is compiled twice — for the baseline and for
// AVX2 + FMA — and the second runs when the CPU has both (checked once). Use:
//
//   ATTN_CPU_FAST void LoopAvx2(args) { Loop(args); }   // Loop: an always-inline body
//   void LoopPortable(args) { Loop(args); }
//   ... CpuHasAvx2Fma() ? LoopAvx2(args) : LoopPortable(args);
//
// (GCC's target_clones("arch=haswell") would dispatch on the CPU model and miss AMD parts.)
// The two versions may differ in the last bits (FMA contraction); a machine always uses the
// same one, so results never depend on the thread count.
#pragma once

#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define ATTN_CPU_FAST __attribute__((target("avx2,fma")))
// ATTN_CPU_BASELINE=1 in the environment forces the baseline versions, so that a machine with
// AVX2 can test them (tests/CMakeLists.txt runs the kernel tests both ways).
inline bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          std::getenv("ATTN_CPU_BASELINE") == nullptr;
  return has;
}
#else
#define ATTN_CPU_FAST
inline bool CpuHasAvx2Fma() { return false; }
#endif
