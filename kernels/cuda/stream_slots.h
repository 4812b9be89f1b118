// Stream slots and staging: the CUDA backend's streams, each a Slot that serves one request at
// a time, and the pinned host memory its copies go through.
//
//   Slot      a stream with its own cuBLAS handle, timing events and pinned staging buffer (so
//             host↔device copies are truly asynchronous). Owned by a SlotPool; used only by
//             the request that leased it.
//   SlotPool  the slots of one device: Lease blocks until a slot is free and holds it until it
//             goes away, first waiting for the slot's stream (a request that failed half-way
//             may still have copies in flight from the staging memory). Thread-safe.
//   StagedResult  a device→host copy that lands in staging memory and is moved to its
//             destination once the stream has finished.
// Errors: CUDA failures as Status (cuda_status.h); creating the slots fails as a whole.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attn::cuda {

struct Slot {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  char* staging = nullptr;  // Pinned host memory, grown on demand.
  int64_t staging_bytes = 0;

  // Grows the staging memory to at least `bytes`. Only while the stream is idle: at the start
  // of a request, before its first copy.
  absl::Status ReserveStaging(int64_t bytes);
};

struct StagedResult {
  void* host;
  const char* staged;
  int64_t bytes;
};

class SlotPool {
 public:
  // `count` slots on the current device, each a non-blocking stream with a cuBLAS handle.
  static absl::StatusOr<std::unique_ptr<SlotPool>> Create(int count);
  ~SlotPool();  // Waits for every stream, then destroys the slots.

  class Lease {
   public:
    explicit Lease(SlotPool& pool);
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Slot& slot() const { return pool_.slots_[index_]; }

   private:
    SlotPool& pool_;
    int index_ = 0;
  };

  int size() const { return static_cast<int>(slots_.size()); }

 private:
  SlotPool() = default;

  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable slot_freed_;
  std::vector<int> free_;
};

}  // namespace attn::cuda
