// MakeBackend: the one place that chooses a compute device and builds its Backend (backend.h),
// the CPU's (cpu/) or a CUDA device's (cuda/, when this build has it), from the server's flags.
// Called once at start-up; the caller owns the backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace attn {

struct BackendConfig {
  std::string device = "auto";  // "auto", "cpu", "cuda" or "cuda:N".
  int threads = 0;              // CPU worker threads; 0 = hardware concurrency.
  int64_t max_naive_bytes = 0;  // 0 = a quarter of physical memory.
};

// Creates the backend config.device names; "auto" is the first CUDA device when this build has
// the CUDA backend and the machine a usable device, else the CPU (then *notice, when not null,
// says why). INVALID_ARGUMENT for an unknown device, UNAVAILABLE for one this build or machine
// cannot provide.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendConfig& config,
                                                     std::string* notice = nullptr);

}  // namespace attn
