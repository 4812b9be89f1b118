#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"

namespace attn {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendConfig& config) {
  if (config.threads < 0) return absl::InvalidArgumentError("--threads must be ≥ 0");
  if (config.max_naive_bytes < 0) {
    return absl::InvalidArgumentError("--max-naive-bytes must be ≥ 0");
  }
  if (config.device == "auto" || config.device == "cpu") {
    return std::make_unique<CpuBackend>(config.threads, config.max_naive_bytes);
  }
  if (config.device == "cuda") {
    return absl::UnavailableError("--device=cuda: this build has no CUDA backend yet");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be auto, cpu or cuda, not \"", config.device, "\""));
}

}  // namespace attn
