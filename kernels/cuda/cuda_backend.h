// CudaBackend: serves Naive, Tiled and Trace from one CUDA device.
//
// The backend owns the device for the process: one context, a pool of streams (each with its own
// cuBLAS handle) so concurrent requests overlap, and a byte budget over the stream-ordered
// allocations of every request in flight, so that a request that would run the device out of
// memory gets RESOURCE_EXHAUSTED instead. Every CUDA call is checked; an error after which the
// context is unusable marks the backend unhealthy, and from then on every call answers
// UNAVAILABLE. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace attn::cuda {

// Devices the CUDA runtime reports; 0 when there is no driver or device (the error, if any,
// goes to *error when it is not null).
int DeviceCount(std::string* error = nullptr);

// Opens device `index`. max_naive_bytes: Naive's budget for its score and weight matrices (0 =
// a quarter of the device's memory); the budget for all requests together is 90% of the
// memory free at start-up. max_shared_bytes: the dynamic shared memory per block Tiled may
// plan with (0 = the device's opt-in limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, read
// once here; a larger value is cut to it; tests pass less to reach the fallback): a fused
// kernel that needs more is replaced by the row kernel (launch.h, PlanTiled). UNAVAILABLE
// when the device cannot be used.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index, int64_t max_naive_bytes,
                                                         int max_shared_bytes = 0);

}  // namespace attn::cuda
