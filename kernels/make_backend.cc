#include "kernels/make_backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#if ATTN_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace attn {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendConfig& config,
                                                     std::string* notice) {
  if (config.threads < 0) return absl::InvalidArgumentError("--threads must be ≥ 0");
  if (config.max_naive_bytes < 0) {
    return absl::InvalidArgumentError("--max-naive-bytes must be ≥ 0");
  }
  auto cpu = [&]() -> std::unique_ptr<Backend> {
    return std::make_unique<CpuBackend>(config.threads, config.max_naive_bytes);
  };
  if (config.device == "cpu") return cpu();

  int index = 0;
  const bool cuda =
      config.device == "cuda" || (absl::StartsWith(config.device, "cuda:") &&
                                  absl::SimpleAtoi(config.device.substr(5), &index) && index >= 0);
  if (!cuda && config.device != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be auto, cpu, cuda or cuda:N, not \"", config.device, "\""));
  }
#if ATTN_HAVE_CUDA
  if (cuda) return cuda::MakeCudaBackend(index, config.max_naive_bytes);
  std::string error;
  if (cuda::DeviceCount(&error) > 0) {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = cuda::MakeCudaBackend(0, config.max_naive_bytes);
    if (gpu.ok()) return gpu;
    error = gpu.status().ToString();
  }
  if (notice != nullptr) {
    *notice = absl::StrCat("no usable CUDA device (", error.empty() ? "none found" : error,
                           "); serving from the CPU");
  }
  return cpu();
#else
  if (cuda) {
    return absl::UnavailableError(
        absl::StrCat("--device=", config.device, ": this attnd was built without CUDA"));
  }
  if (notice != nullptr) *notice = "this attnd was built without CUDA; serving from the CPU";
  return cpu();
#endif
}

}  // namespace attn
