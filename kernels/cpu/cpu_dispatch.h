// ATTN_CPU_CLONES: compiles a hot CPU function for several instruction sets and picks one at
// run time by the CPU's features (GCC function multi-versioning; "arch=" clones would dispatch
// on the CPU model instead and miss e.g. AMD parts), so the portable binary (no -march=native)
// still runs its vectorized loops on AVX2 and AVX-512 machines. The clones run the same IEEE
// operations in the same order (the kernels build with -ffp-contract=off), so results do not
// depend on the machine's vector width.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define ATTN_CPU_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define ATTN_CPU_CLONES
#endif
