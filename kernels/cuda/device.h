// Device: what the CUDA backend and its KV stores share of one device — its index, the memory
// budget (device_memory.h), the stream slots (stream_slots.h) and whether it is still usable.
// Held by shared_ptr, so a store may outlive the backend that made it. Thread-safe.
//
// Check maps a CUDA result to a Status (cuda_status.h) and marks the device lost on an error
// after which the context is unusable; from then on Start answers UNAVAILABLE, so every call
// does, until the process restarts.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/stream_slots.h"

namespace attn::cuda {

class Device {
 public:
  Device(int index, int64_t budget_bytes, std::unique_ptr<SlotPool> slots)
      : index_(index), budget_(budget_bytes), slots_(std::move(slots)) {}
  ~Device() { cudaSetDevice(index_); }  // The slots' streams are destroyed on their device.

  int index() const { return index_; }
  MemoryBudget& budget() { return budget_; }
  SlotPool& slots() { return *slots_; }
  bool lost() const { return lost_.load(); }

  absl::Status Check(cudaError_t error, const char* what) {
    absl::Status status = CudaStatus(error, what);
    if (IsStickyError(error)) lost_ = true;
    return status;
  }
  // Makes the device current on the calling thread, or UNAVAILABLE once it is lost.
  absl::Status Start() {
    if (lost_) {
      return absl::UnavailableError(
          "the CUDA device failed earlier and cannot be used until attnd restarts");
    }
    return Check(cudaSetDevice(index_), "cudaSetDevice");
  }

 private:
  const int index_;
  MemoryBudget budget_;
  std::unique_ptr<SlotPool> slots_;
  std::atomic<bool> lost_{false};
};

}  // namespace attn::cuda
