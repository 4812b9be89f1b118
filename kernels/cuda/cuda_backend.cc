// Opening the device, and what every method of the CUDA backend shares: uploads and downloads
// through a slot's staging memory (the gather of a cache's pages among them), the memory
// statistics, and the KV stores (backend_impl.h).
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/backend_impl.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kv_store.h"
#include "kernels/cuda/launch.h"

namespace attn::cuda {
namespace {

constexpr int kStreams = 4;  // Requests that can run on the device at once.

// The dtype the device copy of a problem's query, key and value share: theirs when they agree,
// else fp32 (the host converts the query, the gather or the host the keys and values).
DType DeviceDType(const Problem& problem) {
  const bool same =
      problem.query.dtype == problem.key_dtype() && problem.key_dtype() == problem.value_dtype();
  return same ? problem.query.dtype : DType::kFloat32;
}

// Pinned staging one request needs: its inputs from the host (dense, in the dtype they travel
// in) or its results, whichever is larger. Reserved before the first copy, so it never moves
// mid-request.
int64_t StagingBytes(const Problem& problem, bool lse) {
  const Shape& s = problem.shape;
  const int64_t element = ElementSize(DeviceDType(problem));
  int64_t inputs = s.batch * s.heads * s.query_len * s.head_dim;
  if (problem.pages == nullptr)
    inputs += s.batch * s.kv_heads * s.key_len * (s.head_dim + s.value_dim);
  const int64_t slopes = ((problem.alibi_slopes != nullptr ? s.heads * 4 : 0) +
                          (problem.sinks != nullptr ? s.heads * 4 : 0));
  const int64_t sequences = problem.sequences > 0 ? 2 * (problem.sequences + 1) * 8 : 0;
  return std::max(inputs * element + slopes + sequences, ResultBytes(problem, lse));
}

}  // namespace

int64_t InputBytes(const Problem& problem) {
  const Shape& s = problem.shape;
  int64_t bytes = s.batch * s.heads * s.query_len * s.head_dim * ElementSize(problem.query.dtype);
  if (problem.pages == nullptr) {
    bytes += s.batch * s.kv_heads * s.key_len *
             (s.head_dim * ElementSize(problem.key.dtype) +
              s.value_dim * ElementSize(problem.value.dtype));
  }
  return bytes;
}

int64_t ResultBytes(const Problem& problem, bool lse) {
  return problem.OutputElements() * ElementSize(problem.output_dtype) +
         (lse ? problem.LseElements() * 4 : 0);
}

void SetMemoryStats(const Problem& problem, bool lse, int64_t allocated_bytes, Stats* stats) {
  const int64_t results = ResultBytes(problem, lse);
  stats->scratch_bytes = std::max<int64_t>(allocated_bytes - InputBytes(problem) - results, 0);
  stats->peak_memory_bytes = stats->scratch_bytes + results;
}

CudaBackend::CudaBackend(const cudaDeviceProp& properties, const CudaBackendOptions& options,
                         std::shared_ptr<Device> device)
    : memory_bytes_(static_cast<int64_t>(properties.totalGlobalMem)),
      multiprocessors_(properties.multiProcessorCount),
      description_(absl::StrFormat("%s (cuda:%d, sm_%d%d, %.1f GiB, %d SMs)", properties.name,
                                   device->index(), properties.major, properties.minor,
                                   static_cast<double>(properties.totalGlobalMem) / (1 << 30),
                                   properties.multiProcessorCount)),
      options_(options),
      device_(std::move(device)) {}

absl::StatusOr<DeviceProblem> CudaBackend::Upload(const Problem& problem, int pitch, bool lse,
                                                  Allocations& memory, Slot& slot) {
  ATTN_RETURN_IF_ERROR(slot.ReserveStaging(StagingBytes(problem, lse)));
  const Shape& s = problem.shape;
  DeviceProblem device;
  device.shape = s;
  device.pitch = pitch;
  device.scale = problem.scale;
  device.transforms = problem.transforms();  // Its slopes and sinks, if any, copied below.
  device.geometry = problem.geometry();
  device.dtype = DeviceDType(problem);  // Mixed: all as fp32.
  const int64_t element = ElementSize(device.dtype);

  struct Input {
    const TensorView& view;
    int64_t rows, width;
    const void** target;
  } inputs[] = {{problem.query, s.batch * s.heads * s.query_len, s.head_dim, &device.query},
                {problem.key, s.batch * s.kv_heads * s.key_len, s.head_dim, &device.key},
                {problem.value, s.batch * s.kv_heads * s.key_len, s.value_dim, &device.value}};
  char* staged = slot.staging;
  for (const Input& input : inputs) {
    ATTN_ASSIGN_OR_RETURN(void* buffer, memory.Allocate(input.rows * pitch * element));
    *input.target = buffer;
    if (problem.pages != nullptr && input.target != &device.query) {
      // A cache's keys or values: already on the device, gathered out of the pages (batch 1).
      const bool keys = input.target == &device.key;
      ATTN_RETURN_IF_ERROR(
          Check(LaunchGather(*problem.pages, keys, s.kv_heads, s.key_len, input.width, buffer,
                             device.dtype, pitch, slot.stream),
                "LaunchGather"));
      continue;
    }
    const int64_t dense_bytes = input.rows * input.width * element;
    if (input.view.dtype == device.dtype) {
      std::memcpy(staged, input.view.data, dense_bytes);
    } else {
      float* converted = reinterpret_cast<float*>(staged);
      for (int64_t i = 0; i < input.rows * input.width; ++i) converted[i] = input.view[i];
    }
    if (input.width != pitch) {  // Zero padding: it meets zeros in every dot product.
      ATTN_RETURN_IF_ERROR(
          Check(cudaMemsetAsync(buffer, 0, input.rows * pitch * element, slot.stream),
                "cudaMemsetAsync (input padding)"));
    }
    ATTN_RETURN_IF_ERROR(Check(
        cudaMemcpy2DAsync(buffer, pitch * element, staged, input.width * element,
                          input.width * element, input.rows, cudaMemcpyHostToDevice, slot.stream),
        "cudaMemcpy2DAsync (input)"));
    staged += dense_bytes;
  }
  // Per-head values: the ALiBi slopes and the sinks.
  for (const float** per_head : {&device.transforms.alibi_slopes, &device.transforms.sinks}) {
    if (*per_head == nullptr) continue;
    const int64_t bytes = s.heads * 4;
    ATTN_ASSIGN_OR_RETURN(float* copy, memory.Allocate<float>(bytes));
    std::memcpy(staged, *per_head, bytes);
    ATTN_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(copy, staged, bytes, cudaMemcpyHostToDevice, slot.stream),
              "cudaMemcpyAsync (ALiBi slopes or sinks)"));
    *per_head = copy;
    staged += bytes;
  }
  if (problem.sequences > 0) {  // A ragged batch's cumulative lengths, for the geometry.
    for (const int64_t** lengths : {&device.geometry.cu_seqlens_q, &device.geometry.cu_seqlens_k}) {
      const int64_t bytes = (problem.sequences + 1) * 8;
      ATTN_ASSIGN_OR_RETURN(int64_t * copy, memory.Allocate<int64_t>(bytes));
      std::memcpy(staged, *lengths, bytes);
      ATTN_RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(copy, staged, bytes, cudaMemcpyHostToDevice, slot.stream),
                "cudaMemcpyAsync (cu_seqlens)"));
      *lengths = copy;
      staged += bytes;
    }
  }
  return device;
}

absl::Status CudaBackend::Download(const float* result, int64_t count,
                                   const MutableTensorView& host, Allocations& memory, Slot& slot,
                                   int64_t* staging_offset, std::vector<StagedResult>* results) {
  const void* source = result;
  const int64_t bytes = count * ElementSize(host.dtype);
  if (host.dtype != DType::kFloat32) {
    ATTN_ASSIGN_OR_RETURN(void* converted, memory.Allocate(bytes));
    ATTN_RETURN_IF_ERROR(
        Check(LaunchStore(result, count, host.dtype, converted, slot.stream), "LaunchStore"));
    source = converted;
  }
  // The staging memory may still be feeding this stream's uploads; the copy below is queued
  // after them, so overwriting it is ordered. The caller reserved room for every result.
  if (*staging_offset + bytes > slot.staging_bytes) {
    return absl::InternalError("results exceed the staging memory reserved for them");
  }
  char* staged = slot.staging + *staging_offset;
  ATTN_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(staged, source, bytes, cudaMemcpyDeviceToHost, slot.stream),
            "cudaMemcpyAsync (output)"));
  results->push_back(StagedResult{host.data, staged, bytes});
  *staging_offset += bytes;
  return absl::OkStatus();
}

absl::Status CudaBackend::Finish(const Slot& slot, const std::vector<StagedResult>& results,
                                 const char* what) {
  ATTN_RETURN_IF_ERROR(Check(cudaStreamSynchronize(slot.stream), what));
  for (const StagedResult& result : results) {
    std::memcpy(result.host, result.staged, result.bytes);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::DeliverResults(const Problem& problem, const float* out, const float* lse,
                                         const Outputs& outputs, Allocations& memory, Slot& slot,
                                         const char* what) {
  std::vector<StagedResult> results;
  int64_t staging_offset = 0;
  ATTN_RETURN_IF_ERROR(Download(out, problem.OutputElements(), outputs.output, memory, slot,
                                &staging_offset, &results));
  if (lse != nullptr) {
    ATTN_RETURN_IF_ERROR(Download(lse, problem.LseElements(),
                                  MutableTensorView{outputs.lse, DType::kFloat32}, memory, slot,
                                  &staging_offset, &results));
  }
  return Finish(slot, results, what);
}

absl::StatusOr<int64_t> CudaBackend::ElapsedNs(const Slot& slot) {
  float ms = 0.f;
  ATTN_RETURN_IF_ERROR(
      Check(cudaEventElapsedTime(&ms, slot.start, slot.stop), "cudaEventElapsedTime"));
  return static_cast<int64_t>(static_cast<double>(ms) * 1e6);
}

absl::StatusOr<std::unique_ptr<KvStore>> CudaBackend::CreateKvStore(const KvLayout& layout) {
  ATTN_RETURN_IF_ERROR(device_->Start());
  return std::unique_ptr<KvStore>(
      std::make_unique<CudaKvStore>(device_, layout, options_.kv_page_tokens));
}

int DeviceCount(std::string* error) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (error != nullptr) *error = CudaStatus(status, "cudaGetDeviceCount").ToString();
    cudaGetLastError();  // Clear it: the process may go on without a device.
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index,
                                                         const CudaBackendOptions& options) {
  std::string error;
  const int count = DeviceCount(&error);
  if (count == 0) {
    return absl::UnavailableError(absl::StrCat("no CUDA device", error.empty() ? "" : ": ", error));
  }
  if (index < 0 || index >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=cuda:", index, ": this machine has ", count, " CUDA device(s)"));
  }
  CudaBackendOptions resolved = options;
  cudaDeviceProp properties;
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, index));
  // What one block may opt in to: an sm_80 binary also runs on sm_86/89, whose limit (99 KB) is
  // far below the A100's 163 KB, so tile sizes follow the device, not the architecture.
  int optin_shared_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin_shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, index));
  if (resolved.max_shared_bytes <= 0 || resolved.max_shared_bytes > optin_shared_bytes) {
    resolved.max_shared_bytes = optin_shared_bytes;
  }
  size_t free_bytes = 0, total_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Keep freed memory in the stream-ordered pool instead of returning it to the driver.
  cudaMemPool_t pool;
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, index));
  uint64_t threshold = UINT64_MAX;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SlotPool> slots, SlotPool::Create(kStreams));
  int64_t budget = static_cast<int64_t>(static_cast<double>(free_bytes) * 0.9);
  if (resolved.memory_budget_bytes > 0 && resolved.memory_budget_bytes < budget) {
    budget = resolved.memory_budget_bytes;
  }
  resolved.memory_budget_bytes = budget;
  if (resolved.max_naive_bytes <= 0)
    resolved.max_naive_bytes = static_cast<int64_t>(total_bytes / 4);
  if (resolved.kv_page_tokens <= 0) resolved.kv_page_tokens = kDefaultPageTokens;
  if (resolved.decode_chunk_keys < 0) resolved.decode_chunk_keys = 0;
  return std::make_unique<CudaBackend>(properties, resolved,
                                       std::make_shared<Device>(index, budget, std::move(slots)));
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index, int64_t max_naive_bytes,
                                                         int max_shared_bytes) {
  CudaBackendOptions options;
  options.max_naive_bytes = max_naive_bytes;
  options.max_shared_bytes = max_shared_bytes;
  return MakeCudaBackend(index, options);
}

}  // namespace attn::cuda
