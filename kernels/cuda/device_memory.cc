#include "kernels/cuda/device_memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace attn::cuda {

absl::Status MemoryBudget::Reserve(int64_t bytes) {
  int64_t used = used_.load();
  do {
    if (used + bytes > limit_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the request needs ", bytes, " more bytes of device memory; ", used,
                       " of the ", limit_, "-byte device budget are in use"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return absl::OkStatus();
}

Allocations::~Allocations() {
  for (void* pointer : pointers_) cudaFreeAsync(pointer, stream_);
  budget_.Release(bytes_);
}

absl::StatusOr<void*> Allocations::AllocateBytes(int64_t bytes) {
  if (absl::Status status = budget_.Reserve(bytes); !status.ok()) return status;
  void* pointer = nullptr;
  const cudaError_t error = cudaMallocAsync(&pointer, std::max<int64_t>(bytes, 1), stream_);
  if (error != cudaSuccess) {
    budget_.Release(bytes);
    return CudaStatus(error, "cudaMallocAsync");
  }
  pointers_.push_back(pointer);
  bytes_ += bytes;
  return pointer;
}

absl::StatusOr<DeviceBlock> DeviceBlock::Allocate(MemoryBudget& budget, int64_t bytes,
                                                  cudaStream_t stream) {
  if (absl::Status status = budget.Reserve(bytes); !status.ok()) return status;
  DeviceBlock block;
  const cudaError_t error = cudaMallocAsync(&block.pointer_, std::max<int64_t>(bytes, 1), stream);
  if (error != cudaSuccess) {
    budget.Release(bytes);
    return CudaStatus(error, "cudaMallocAsync");
  }
  block.bytes_ = bytes;
  return block;
}

void DeviceBlock::Free(MemoryBudget& budget, cudaStream_t stream) {
  if (pointer_ == nullptr) return;
  cudaFreeAsync(pointer_, stream);
  budget.Release(bytes_);
  pointer_ = nullptr;
  bytes_ = 0;
}

}  // namespace attn::cuda
