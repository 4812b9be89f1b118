#include "kernels/cuda/stream_slots.h"

#include <memory>

#include "kernels/cuda/cuda_status.h"

namespace attn::cuda {

absl::Status Slot::ReserveStaging(int64_t bytes) {
  if (bytes <= staging_bytes) return absl::OkStatus();
  if (staging != nullptr) cudaFreeHost(staging);
  staging = nullptr;
  staging_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&staging, bytes, cudaHostAllocDefault));
  staging_bytes = bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotPool>> SlotPool::Create(int count) {
  std::unique_ptr<SlotPool> pool(new SlotPool());
  pool->slots_.resize(count);
  for (int i = 0; i < count; ++i) {
    Slot& slot = pool->slots_[i];
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&slot.stream, cudaStreamNonBlocking));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.start));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.stop));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&slot.blas));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(slot.blas, slot.stream));
    pool->free_.push_back(i);
  }
  return pool;
}

SlotPool::~SlotPool() {
  for (Slot& slot : slots_) {
    if (slot.stream != nullptr) cudaStreamSynchronize(slot.stream);
    if (slot.blas != nullptr) cublasDestroy(slot.blas);
    if (slot.start != nullptr) cudaEventDestroy(slot.start);
    if (slot.stop != nullptr) cudaEventDestroy(slot.stop);
    if (slot.stream != nullptr) cudaStreamDestroy(slot.stream);
    if (slot.staging != nullptr) cudaFreeHost(slot.staging);
  }
}

SlotPool::Lease::Lease(SlotPool& pool) : pool_(pool) {
  std::unique_lock<std::mutex> lock(pool_.mutex_);
  pool_.slot_freed_.wait(lock, [&] { return !pool_.free_.empty(); });
  index_ = pool_.free_.back();
  pool_.free_.pop_back();
}

SlotPool::Lease::~Lease() {
  // A request that failed half-way may have copies in flight from the staging memory.
  cudaStreamSynchronize(slot().stream);
  {
    std::lock_guard<std::mutex> lock(pool_.mutex_);
    pool_.free_.push_back(index_);
  }
  pool_.slot_freed_.notify_one();
}

}  // namespace attn::cuda
