// CudaBackend: serves Naive, Tiled, Trace and Decode from one CUDA device, and keeps KV caches
// in its memory.
//
// The backend owns the device for the process: one context, a pool of streams (each with its own
// cuBLAS handle) so concurrent requests overlap, and a byte budget over the stream-ordered
// allocations of every request in flight and every KV cache page, so that a request that would
// run the device out of memory gets RESOURCE_EXHAUSTED instead. Every CUDA call is checked; an
// error after which the context is unusable marks the backend unhealthy, and from then on every
// call answers UNAVAILABLE. Thread-safe. The pieces: device_memory.h (the budget),
// stream_slots.h (streams and staging), device.h (what the backend and its KV stores share),
// backend_impl.h (the class), kv_store.h (the caches).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace attn::cuda {

// Devices the CUDA runtime reports; 0 when there is no driver or device (the error, if any,
// goes to *error when it is not null).
int DeviceCount(std::string* error = nullptr);

struct CudaBackendOptions {
  // Naive's budget for its score and weight matrices (0 = a quarter of the device's memory).
  int64_t max_naive_bytes = 0;
  // The dynamic shared memory per block Tiled may plan with (0 = the device's opt-in limit,
  // cudaDevAttrMaxSharedMemoryPerBlockOptin, read once here; a larger value is cut to it;
  // tests pass less to reach the fallback): a fused kernel that needs more is replaced by the
  // row kernel (launch.h, PlanTiled).
  int max_shared_bytes = 0;
  // Tokens per KV cache page (0 = kDefaultPageTokens); tests pass odd sizes.
  int64_t kv_page_tokens = 0;
  // Keys per split of Decode's split-KV kernel (0 = chosen per batch to fill the device; else
  // rounded up to a whole number of the kernel's tiles); tests pass small ones to exercise the
  // merge.
  int64_t decode_chunk_keys = 0;
  // The device memory all requests and caches may hold together (0 = 90% of the memory free
  // at start-up; a larger value is cut to that); tests pass small ones to reach its limit.
  int64_t memory_budget_bytes = 0;
};

constexpr int64_t kDefaultPageTokens = 256;

// Opens device `index`. UNAVAILABLE when the device cannot be used.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index,
                                                         const CudaBackendOptions& options);
// The same with only the first two options.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index, int64_t max_naive_bytes,
                                                         int max_shared_bytes = 0);

}  // namespace attn::cuda
