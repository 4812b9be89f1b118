// The CudaBackend class (cuda_backend.h makes one): the Backend methods over a Device
// (device.h). Internal to kernels/cuda; its methods live by role:
//   cuda_backend.cc        opening the device, uploads and downloads through a slot's staging
//                          memory (including the gather of a KV cache's pages), KV stores;
//   attention_methods.cc   Naive, Tiled and Trace;
//   decode_method.cc       Decode: the split-KV kernels (decode.cu) over a batch of caches.
// Thread-safe: every request leases its own stream slot; the members are immutable or
// thread-safe themselves.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/launch.h"

namespace attn::cuda {

// The request's inputs from the host and its results, in their own dtypes, dense: what
// ExecutionStats counts neither as scratch nor (the inputs) as peak memory. A cache's keys and
// values are not inputs of the request (they are already on the device).
int64_t InputBytes(const Problem& problem);
int64_t ResultBytes(const Problem& problem, bool lse);

// ExecutionStats.scratch_bytes and peak_memory_bytes (attention.proto) of a call whose device
// allocations came to allocated_bytes: scratch is what it allocated beyond the inputs and the
// results (the row padding of the uploaded inputs, gathered pages, fp32 copies, matrices,
// records); peak is scratch plus the results.
void SetMemoryStats(const Problem& problem, bool lse, int64_t allocated_bytes, Stats* stats);

class CudaBackend final : public Backend {
 public:
  CudaBackend(const cudaDeviceProp& properties, const CudaBackendOptions& options,
              std::shared_ptr<Device> device);

  const char* name() const override { return "cuda"; }
  std::string device() const override { return description_; }
  int64_t memory_bytes() const override { return memory_bytes_; }
  // The fused Tiled kernels' tile; any other block_k runs Tiled's slower row kernel.
  int default_block_k() const override { return kFusedBlockK; }
  int64_t max_naive_bytes() const override { return options_.max_naive_bytes; }
  bool healthy() const override { return !device_->lost(); }
  int concurrency() const override { return device_->slots().size(); }

  absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                     std::vector<RowRef> rows) override;

  absl::StatusOr<std::unique_ptr<KvStore>> CreateKvStore(const KvLayout& layout) override;
  int64_t kv_page_tokens() const override { return options_.kv_page_tokens; }
  bool keeps_fp8_caches() const override { return true; }
  absl::StatusOr<Stats> Decode(const std::vector<Problem>& problems,
                               const std::vector<Outputs>& outputs) override;

 private:
  absl::Status Check(cudaError_t error, const char* what) { return device_->Check(error, what); }

  // Copies the problem's inputs to the device in one dtype, rows padded with zeros to `pitch`,
  // through the slot's staging memory, which it first grows to hold the inputs or the results
  // (with lse when `lse`; StagingBytes), whichever is larger. A problem over a cache uploads its
  // query only; its keys and values are gathered from the pages on the device (LaunchGather)
  // into the same dense padded layout.
  absl::StatusOr<DeviceProblem> Upload(const Problem& problem, int pitch, bool lse,
                                       Allocations& memory, Slot& slot);
  // Queues the copy of fp32 `result` [count] to the host in `host.dtype` (converted on the
  // device if needed) into staging memory at *staging_offset; Finish moves it to `host`.
  absl::Status Download(const float* result, int64_t count, const MutableTensorView& host,
                        Allocations& memory, Slot& slot, int64_t* staging_offset,
                        std::vector<StagedResult>* results);
  // Waits for the slot's stream, then moves the staged results to their destinations.
  absl::Status Finish(const Slot& slot, const std::vector<StagedResult>& results, const char* what);
  // Copies the fp32 output (and lse, when not null) of a Naive or Tiled run into `outputs`,
  // waiting for the stream; `what` names the computation in an error.
  absl::Status DeliverResults(const Problem& problem, const float* out, const float* lse,
                              const Outputs& outputs, Allocations& memory, Slot& slot,
                              const char* what);
  absl::StatusOr<int64_t> ElapsedNs(const Slot& slot);

  // Decode of problems that all read pages of one dtype at one padded width (decode_method.cc).
  absl::StatusOr<Stats> DecodeGroup(const std::vector<const Problem*>& problems,
                                    const std::vector<const Outputs*>& outputs, int pitch);

  const int64_t memory_bytes_;
  const int multiprocessors_;
  const std::string description_;
  CudaBackendOptions options_;  // Defaults resolved (no zeros) by the constructor's caller.
  std::shared_ptr<Device> device_;
};

}  // namespace attn::cuda
