#include "kernels/cpu/blas_core.h"

#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attn {
namespace {

constexpr const char* kKeepVariable = "ATTN_BLAS_CORE";          // "keep": no check.
constexpr const char* kSelectedVariable = "ATTN_BLAS_SELECTED";  // Set for the second run.

const char* LevelName(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx512:
      return "AVX-512";
    case IsaLevel::kAvx2:
      return "AVX2";
    case IsaLevel::kAvx:
      return "AVX";
    case IsaLevel::kSse:
      break;
  }
  return "SSE";
}

}  // namespace

std::optional<IsaLevel> LevelOfBlasCore(std::string_view core_name) {
  // OpenBLAS 0.3.21's x86-64 core names (driver/others/dynamic.c), by the widest vectors their
  // kernels use.
  static constexpr struct {
    const char* name;
    IsaLevel level;
  } kCores[] = {
      {"Prescott", IsaLevel::kSse},      {"Core2", IsaLevel::kSse},
      {"Penryn", IsaLevel::kSse},        {"Dunnington", IsaLevel::kSse},
      {"Nehalem", IsaLevel::kSse},       {"Atom", IsaLevel::kSse},
      {"Opteron", IsaLevel::kSse},       {"Opteron_SSE3", IsaLevel::kSse},
      {"Barcelona", IsaLevel::kSse},     {"Nano", IsaLevel::kSse},
      {"Katmai", IsaLevel::kSse},        {"Coppermine", IsaLevel::kSse},
      {"Northwood", IsaLevel::kSse},     {"Banias", IsaLevel::kSse},
      {"Athlon", IsaLevel::kSse},        {"Bobcat", IsaLevel::kSse},
      {"Sandybridge", IsaLevel::kAvx},   {"Bulldozer", IsaLevel::kAvx},
      {"Piledriver", IsaLevel::kAvx},    {"Steamroller", IsaLevel::kAvx},
      {"Excavator", IsaLevel::kAvx2},    {"Haswell", IsaLevel::kAvx2},
      {"Zen", IsaLevel::kAvx2},          {"SkylakeX", IsaLevel::kAvx512},
      {"Cooperlake", IsaLevel::kAvx512}, {"SapphireRapids", IsaLevel::kAvx512},
  };
  for (const auto& core : kCores) {
    if (core_name.size() == std::strlen(core.name) &&
        strncasecmp(core_name.data(), core.name, core_name.size()) == 0) {
      return core.level;
    }
  }
  return std::nullopt;
}

IsaLevel CpuIsaLevel() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return IsaLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return IsaLevel::kAvx2;
  if (__builtin_cpu_supports("avx")) return IsaLevel::kAvx;
#endif
  return IsaLevel::kSse;
}

std::optional<std::string> BlasCoreTypeFor(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx512:
      return "SKYLAKEX";
    case IsaLevel::kAvx2:
      return "HASWELL";
    case IsaLevel::kAvx:
      return "SANDYBRIDGE";
    case IsaLevel::kSse:
      break;
  }
  return std::nullopt;
}

std::string SelectBlasCore(char** argv) {
  const std::string core = openblas_get_corename();
  const std::string kernels = absl::StrCat("OpenBLAS ", core, " kernels");
  if (const char* selected = std::getenv(kSelectedVariable); selected != nullptr) {
    return absl::StrCat(kernels, " (OPENBLAS_CORETYPE=", std::getenv("OPENBLAS_CORETYPE"),
                        ", set by this program: OpenBLAS chose ", selected, ", below this CPU's ",
                        LevelName(CpuIsaLevel()), ")");
  }
  if (const char* keep = std::getenv(kKeepVariable);
      keep != nullptr && std::string(keep) == "keep") {
    return absl::StrCat(kernels, " (", kKeepVariable, "=keep: OpenBLAS's own choice)");
  }
  if (const char* set = std::getenv("OPENBLAS_CORETYPE"); set != nullptr) {
    return absl::StrCat(kernels, " (OPENBLAS_CORETYPE=", set, ", as given)");
  }
  const IsaLevel cpu = CpuIsaLevel();
  const std::optional<IsaLevel> chosen = LevelOfBlasCore(core);
  const std::optional<std::string> better = BlasCoreTypeFor(cpu);
  if (!chosen || *chosen >= cpu || !better) {
    return absl::StrCat(kernels, " (OpenBLAS's own choice)");
  }
  setenv("OPENBLAS_CORETYPE", better->c_str(), 1);
  setenv(kSelectedVariable, core.c_str(), 1);
  execv("/proc/self/exe", argv);
  // Still here: the execution failed. Carry on with the library as it is.
  const int error = errno;
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kSelectedVariable);
  return absl::StrCat(kernels, " (OpenBLAS's own choice, below this CPU's ", LevelName(cpu),
                      ": running again with OPENBLAS_CORETYPE=", *better,
                      " failed: ", std::strerror(error), ")");
}

}  // namespace attn
