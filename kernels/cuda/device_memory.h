// Device memory and its budget: every byte the CUDA backend allocates — a request's scratch and
// the pages of the KV caches alike — is charged to one MemoryBudget first, so that a request
// that would run the device out of memory gets RESOURCE_EXHAUSTED instead of a failed kernel.
//
//   MemoryBudget  bytes in use against a fixed limit (90% of the memory free at start-up).
//                 Thread-safe (one atomic counter).
//   Allocations   one request's device memory: stream-ordered allocations (cudaMallocAsync from
//                 the device's pool) charged to the budget, freed on the request's stream after
//                 the work queued before, and released from the budget, when it goes away. Not
//                 thread-safe: one request's thread.
//   DeviceBlock   one long-lived allocation (a KV cache page, a page table): charged to the
//                 budget and allocated on a stream like the above, freed by Free on the stream
//                 it is given. Movable, never copied; the owner frees it (the destructor does
//                 not, since it has no stream to order the free on).
// Errors: RESOURCE_EXHAUSTED when the budget or the device runs out (the budget is then
// unchanged), INTERNAL/UNAVAILABLE for other CUDA errors (cuda_status.h).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attn::cuda {

class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}

  // Charges `bytes`, or RESOURCE_EXHAUSTED (naming what is in use) when they do not fit.
  absl::Status Reserve(int64_t bytes);
  void Release(int64_t bytes) { used_ -= bytes; }
  int64_t limit() const { return limit_; }
  int64_t used() const { return used_.load(); }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

class Allocations {
 public:
  Allocations(MemoryBudget& budget, cudaStream_t stream) : budget_(budget), stream_(stream) {}
  Allocations(const Allocations&) = delete;
  Allocations& operator=(const Allocations&) = delete;
  ~Allocations();

  template <class T = void>
  absl::StatusOr<T*> Allocate(int64_t bytes) {
    absl::StatusOr<void*> pointer = AllocateBytes(bytes);
    if (!pointer.ok()) return pointer.status();
    return static_cast<T*>(*pointer);
  }
  int64_t bytes() const { return bytes_; }

 private:
  absl::StatusOr<void*> AllocateBytes(int64_t bytes);

  MemoryBudget& budget_;
  cudaStream_t stream_;
  std::vector<void*> pointers_;
  int64_t bytes_ = 0;
};

class DeviceBlock {
 public:
  DeviceBlock() = default;
  DeviceBlock(DeviceBlock&& other) noexcept { *this = static_cast<DeviceBlock&&>(other); }
  DeviceBlock& operator=(DeviceBlock&& other) noexcept {
    pointer_ = other.pointer_;
    bytes_ = other.bytes_;
    other.pointer_ = nullptr;
    other.bytes_ = 0;
    return *this;
  }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  // `bytes` of device memory charged to `budget`, allocated in `stream`'s order.
  static absl::StatusOr<DeviceBlock> Allocate(MemoryBudget& budget, int64_t bytes,
                                              cudaStream_t stream);
  // Frees the memory in `stream`'s order (after the work queued there) and releases it from
  // the budget; empty afterwards. Nothing for an empty block.
  void Free(MemoryBudget& budget, cudaStream_t stream);

  void* get() const { return pointer_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* pointer_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace attn::cuda
