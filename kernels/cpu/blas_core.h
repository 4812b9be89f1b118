// SelectBlasCore: makes OpenBLAS run the kernels this CPU can run.
//
// Debian's OpenBLAS 0.3.21 is built for every x86 core (DYNAMIC_ARCH) and picks one when it
// loads, by the CPU's model number. A CPU newer than the library — the development machine's
// Intel Xeon model 207, with AVX-512 — is not in its table, and it falls back to its Prescott
// (SSE3) kernels: sgemm at 66 GFLOP/s where its SkylakeX kernels reach 322 on the same machine
// (docs/perf.md). Naive's two products are sgemm calls, so Naive would run at a fifth of the
// machine's speed for no reason of its own.
//
// The library reads its override, OPENBLAS_CORETYPE, once, as it loads — before main — so the
// only way to change its choice is to run the program again with the variable set. A program
// calls SelectBlasCore(argv) first thing in main: when OpenBLAS chose a core whose instruction
// set is below what the CPU supports (by __builtin_cpu_supports: AVX-512 F/BW/DQ/VL → SKYLAKEX,
// AVX2 + FMA → HASWELL, AVX → SANDYBRIDGE), it sets OPENBLAS_CORETYPE to the best of those and
// executes /proc/self/exe again with the same arguments (the process keeps its PID, open file
// descriptors and environment). It never overrides a choice the user made: an OPENBLAS_CORETYPE
// already set is kept, and ATTN_BLAS_CORE=keep disables the whole check. The second run knows it
// is one (ATTN_BLAS_SELECTED holds what the library first chose) and does not execute again.
// Only the main thread may call it, before starting any thread.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace attn {

// Instruction-set levels, as OpenBLAS's x86 core kernels use them.
enum class IsaLevel { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };

// The level of an OpenBLAS core name (openblas_get_corename(): "Prescott", "Haswell",
// "SkylakeX", "Zen", …; case-insensitive); nullopt for a name this table does not know.
std::optional<IsaLevel> LevelOfBlasCore(std::string_view core_name);

// The best level this CPU supports (SSE when it is not an x86-64 GCC build).
IsaLevel CpuIsaLevel();

// The OPENBLAS_CORETYPE value for a level: "SKYLAKEX", "HASWELL", "SANDYBRIDGE"; nullopt for SSE.
std::optional<std::string> BlasCoreTypeFor(IsaLevel level);

// As above; returns (when it does not execute the program again) a line saying which kernels
// OpenBLAS runs and why, e.g. "OpenBLAS SkylakeX kernels (OPENBLAS_CORETYPE=SKYLAKEX, set by
// attnd: OpenBLAS chose Prescott, below this CPU's AVX-512)". If the new execution fails, the
// program goes on with the library's own choice and the line says so.
std::string SelectBlasCore(char** argv);

}  // namespace attn
