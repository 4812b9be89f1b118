#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.h"

namespace attn::cuda {
namespace {

constexpr int kStreams = 4;  // Requests that can run on the device at once.

// Bytes of device memory that the requests in flight may hold together.
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}

  absl::Status Reserve(int64_t bytes) {
    int64_t used = used_.load();
    do {
      if (used + bytes > limit_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the request needs ", bytes, " more bytes of device memory; ", used,
                         " of the ", limit_, "-byte device budget are in use by other requests"));
      }
    } while (!used_.compare_exchange_weak(used, used + bytes));
    return absl::OkStatus();
  }
  void Release(int64_t bytes) { used_ -= bytes; }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// One request's device memory: stream-ordered allocations charged to the budget, freed on the
// stream (after the work queued before) when this object goes away.
class Allocations {
 public:
  Allocations(MemoryBudget& budget, cudaStream_t stream) : budget_(budget), stream_(stream) {}
  Allocations(const Allocations&) = delete;
  Allocations& operator=(const Allocations&) = delete;
  ~Allocations() {
    for (void* pointer : pointers_) cudaFreeAsync(pointer, stream_);
    budget_.Release(bytes_);
  }

  template <class T = void>
  absl::StatusOr<T*> Allocate(int64_t bytes) {
    if (absl::Status status = budget_.Reserve(bytes); !status.ok()) return status;
    void* pointer = nullptr;
    const cudaError_t error = cudaMallocAsync(&pointer, std::max<int64_t>(bytes, 1), stream_);
    if (error != cudaSuccess) {
      budget_.Release(bytes);
      return CudaStatus(error, "cudaMallocAsync");
    }
    pointers_.push_back(pointer);
    bytes_ += bytes;
    return static_cast<T*>(pointer);
  }
  int64_t bytes() const { return bytes_; }

 private:
  MemoryBudget& budget_;
  cudaStream_t stream_;
  std::vector<void*> pointers_;
  int64_t bytes_ = 0;
};

// A stream with its own cuBLAS handle, timing events and pinned staging buffer (so host↔device
// copies are truly asynchronous); one request at a time.
struct Slot {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  char* staging = nullptr;  // Pinned host memory, grown on demand.
  int64_t staging_bytes = 0;

  // Grows the staging memory to at least `bytes`. Only while the stream is idle: at the start
  // of a request, before its first copy.
  absl::Status ReserveStaging(int64_t bytes) {
    if (bytes <= staging_bytes) return absl::OkStatus();
    if (staging != nullptr) cudaFreeHost(staging);
    staging = nullptr;
    staging_bytes = 0;
    ATTN_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&staging, bytes, cudaHostAllocDefault));
    staging_bytes = bytes;
    return absl::OkStatus();
  }
};

// A device→host copy that lands in staging memory and is moved to its destination once the
// stream has finished.
struct StagedResult {
  void* host;
  const char* staged;
  int64_t bytes;
};

// Pinned staging one request needs: its inputs (dense, in the dtype they travel in) or its
// results, whichever is larger. Reserved before the first copy, so it never moves mid-request.
int64_t StagingBytes(const Problem& problem, bool lse) {
  const Shape& s = problem.shape;
  const bool same_dtype =
      problem.query.dtype == problem.key.dtype && problem.key.dtype == problem.value.dtype;
  const int64_t element = ElementSize(same_dtype ? problem.query.dtype : DType::kFloat32);
  const int64_t inputs = (s.batch * s.heads * s.query_len * s.head_dim +
                          s.batch * s.kv_heads * s.key_len * (s.head_dim + s.value_dim)) *
                         element;
  const int64_t results = problem.OutputElements() * ElementSize(problem.output_dtype) +
                          (lse ? problem.LseElements() * 4 : 0);
  return std::max(inputs, results);
}

// The request's inputs and results in their own dtypes, dense: what ExecutionStats counts
// neither as scratch nor (the inputs) as peak memory.
int64_t InputBytes(const Problem& problem) {
  const Shape& s = problem.shape;
  return s.batch * s.heads * s.query_len * s.head_dim * ElementSize(problem.query.dtype) +
         s.batch * s.kv_heads * s.key_len *
             (s.head_dim * ElementSize(problem.key.dtype) +
              s.value_dim * ElementSize(problem.value.dtype));
}
int64_t ResultBytes(const Problem& problem, bool lse) {
  return problem.OutputElements() * ElementSize(problem.output_dtype) +
         (lse ? problem.LseElements() * 4 : 0);
}

// ExecutionStats.scratch_bytes and peak_memory_bytes (attention.proto) of a call whose device
// allocations came to allocated_bytes: scratch is what it allocated beyond the inputs and the
// results (the row padding of the uploaded inputs, fp32 copies, matrices, records); peak is
// scratch plus the results.
void SetMemoryStats(const Problem& problem, bool lse, int64_t allocated_bytes, Stats* stats) {
  const int64_t results = ResultBytes(problem, lse);
  stats->scratch_bytes = std::max<int64_t>(allocated_bytes - InputBytes(problem) - results, 0);
  stats->peak_memory_bytes = stats->scratch_bytes + results;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int index, const cudaDeviceProp& properties, int64_t budget, int64_t max_naive_bytes,
              int max_shared_bytes, std::vector<Slot> slots)
      : index_(index),
        memory_bytes_(static_cast<int64_t>(properties.totalGlobalMem)),
        max_naive_bytes_(max_naive_bytes),
        max_shared_bytes_(max_shared_bytes),
        device_(absl::StrFormat("%s (cuda:%d, sm_%d%d, %.1f GiB, %d SMs)", properties.name, index,
                                properties.major, properties.minor,
                                static_cast<double>(properties.totalGlobalMem) / (1 << 30),
                                properties.multiProcessorCount)),
        budget_(budget),
        slots_(std::move(slots)) {
    for (size_t i = 0; i < slots_.size(); ++i) free_.push_back(static_cast<int>(i));
  }

  ~CudaBackend() override {
    cudaSetDevice(index_);
    for (Slot& slot : slots_) {
      cudaStreamSynchronize(slot.stream);
      cublasDestroy(slot.blas);
      cudaEventDestroy(slot.start);
      cudaEventDestroy(slot.stop);
      cudaStreamDestroy(slot.stream);
      if (slot.staging != nullptr) cudaFreeHost(slot.staging);
    }
  }

  const char* name() const override { return "cuda"; }
  std::string device() const override { return device_; }
  int64_t memory_bytes() const override { return memory_bytes_; }
  // The fused Tiled kernels' tile; any other block_k runs Tiled's slower row kernel.
  int default_block_k() const override { return kFusedBlockK; }
  int64_t max_naive_bytes() const override { return max_naive_bytes_; }
  bool healthy() const override { return !lost_.load(); }
  int concurrency() const override { return static_cast<int>(slots_.size()); }

  absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                     std::vector<RowRef> rows) override;

 private:
  // Holds a slot for one request; returns it on destruction.
  class Lease {
   public:
    explicit Lease(CudaBackend& backend) : backend_(backend) {
      std::unique_lock<std::mutex> lock(backend_.mutex_);
      backend_.slot_freed_.wait(lock, [&] { return !backend_.free_.empty(); });
      index_ = backend_.free_.back();
      backend_.free_.pop_back();
    }
    ~Lease() {
      // A request that failed half-way may have copies in flight from the staging memory.
      cudaStreamSynchronize(slot().stream);
      {
        std::lock_guard<std::mutex> lock(backend_.mutex_);
        backend_.free_.push_back(index_);
      }
      backend_.slot_freed_.notify_one();
    }
    Slot& slot() const { return backend_.slots_[index_]; }

   private:
    CudaBackend& backend_;
    int index_ = 0;
  };

  // Maps a CUDA error to a Status, marking the backend lost on an error the context cannot
  // survive.
  absl::Status Check(cudaError_t error, const char* what) {
    absl::Status status = CudaStatus(error, what);
    if (IsStickyError(error)) lost_ = true;
    return status;
  }
  absl::Status Start() {
    if (lost_) {
      return absl::UnavailableError(
          "the CUDA device failed earlier and cannot be used until attnd restarts");
    }
    return Check(cudaSetDevice(index_), "cudaSetDevice");
  }

  // Copies the problem's inputs to the device in one dtype, rows padded with zeros to `pitch`,
  // through the slot's staging memory, which it first grows to hold the inputs or the results
  // (with lse when `lse`; StagingBytes), whichever is larger.
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

  const int index_;
  const int64_t memory_bytes_;
  const int64_t max_naive_bytes_;
  const int max_shared_bytes_;  // Dynamic shared memory one block may opt in to, bytes.
  const std::string device_;
  MemoryBudget budget_;
  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable slot_freed_;
  std::vector<int> free_;
  std::atomic<bool> lost_{false};
};

absl::StatusOr<DeviceProblem> CudaBackend::Upload(const Problem& problem, int pitch, bool lse,
                                                  Allocations& memory, Slot& slot) {
  ATTN_RETURN_IF_ERROR(slot.ReserveStaging(StagingBytes(problem, lse)));
  const Shape& s = problem.shape;
  DeviceProblem device;
  device.shape = s;
  device.pitch = pitch;
  device.scale = problem.scale;
  device.causal = problem.causal;
  const bool same_dtype =
      problem.query.dtype == problem.key.dtype && problem.key.dtype == problem.value.dtype;
  device.dtype = same_dtype ? problem.query.dtype : DType::kFloat32;  // Mixed: all as fp32.
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
    const int64_t dense_bytes = input.rows * input.width * element;
    if (input.view.dtype == device.dtype) {
      std::memcpy(staged, input.view.data, dense_bytes);
    } else {
      float* converted = reinterpret_cast<float*>(staged);
      for (int64_t i = 0; i < input.rows * input.width; ++i) converted[i] = input.view[i];
    }
    ATTN_ASSIGN_OR_RETURN(void* buffer, memory.Allocate(input.rows * pitch * element));
    if (input.width != pitch) {  // Zero padding: it meets zeros in every dot product.
      ATTN_RETURN_IF_ERROR(
          Check(cudaMemsetAsync(buffer, 0, input.rows * pitch * element, slot.stream),
                "cudaMemsetAsync (input padding)"));
    }
    ATTN_RETURN_IF_ERROR(Check(
        cudaMemcpy2DAsync(buffer, pitch * element, staged, input.width * element,
                          input.width * element, input.rows, cudaMemcpyHostToDevice, slot.stream),
        "cudaMemcpy2DAsync (input)"));
    *input.target = buffer;
    staged += dense_bytes;
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

absl::StatusOr<Stats> CudaBackend::Naive(const Problem& problem, const Outputs& outputs) {
  if (absl::Status status = outputs.CheckInterrupt(); !status.ok()) return status;
  const Shape& s = problem.shape;
  const int64_t matrix_elements = s.batch * s.heads * s.query_len * s.key_len;
  if (absl::Status budget = CheckNaiveBudget(problem, max_naive_bytes_, "device memory");
      !budget.ok()) {
    return budget;
  }
  const int64_t group = s.heads / s.kv_heads;
  const int64_t rows_per_kv_head = group * s.query_len;  // The GEMMs' M.
  const int pitch =
      std::max<int>(PaddedDim(s), static_cast<int>(std::max(s.head_dim, s.value_dim)));
  if (rows_per_kv_head > INT32_MAX || s.key_len > INT32_MAX || s.batch * s.kv_heads > INT32_MAX) {
    return absl::InvalidArgumentError(
        "Naive on CUDA: heads/kv_heads·query_len, key_len and batch·kv_heads must each fit in "
        "int32 (cuBLAS); use Tiled");
  }
  ATTN_RETURN_IF_ERROR(Start());
  Lease lease(*this);
  Slot& slot = lease.slot();
  Allocations memory(budget_, slot.stream);
  ATTN_ASSIGN_OR_RETURN(const DeviceProblem device,
                        Upload(problem, pitch, outputs.lse != nullptr, memory, slot));
  ATTN_ASSIGN_OR_RETURN(float* scores, memory.Allocate<float>(matrix_elements * 4));
  ATTN_ASSIGN_OR_RETURN(float* weights, memory.Allocate<float>(matrix_elements * 4));
  ATTN_ASSIGN_OR_RETURN(float* out, memory.Allocate<float>(problem.OutputElements() * 4));
  float* lse = nullptr;
  if (outputs.lse != nullptr) {
    ATTN_ASSIGN_OR_RETURN(lse, memory.Allocate<float>(problem.LseElements() * 4));
  }
  const float* value = static_cast<const float*>(device.value);
  int64_t value_pitch = pitch;
  if (device.dtype != DType::kFloat32) {  // cuBLAS multiplies fp32 weights by fp32 values.
    const int64_t value_rows = s.batch * s.kv_heads * s.key_len;
    ATTN_ASSIGN_OR_RETURN(float* value32, memory.Allocate<float>(value_rows * s.value_dim * 4));
    ATTN_RETURN_IF_ERROR(Check(LaunchToFloat(device.value, device.dtype, pitch, value_rows,
                                             s.value_dim, value32, slot.stream),
                               "LaunchToFloat"));
    value = value32;
    value_pitch = s.value_dim;
  }
  const cudaDataType input_type = device.dtype == DType::kFloat32   ? CUDA_R_32F
                                  : device.dtype == DType::kFloat16 ? CUDA_R_16F
                                                                    : CUDA_R_16BF;
  const int m = static_cast<int>(rows_per_kv_head);
  const int n_keys = static_cast<int>(s.key_len);
  const int batches = static_cast<int>(s.batch * s.kv_heads);
  const float zero = 0.f, one = 1.f, scale = problem.scale;

  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.start, slot.stream), "cudaEventRecord"));
  // Row-major S[m, Nk] = scale · Q[m, d] · K[Nk, d]ᵀ is column-major Sᵀ = K · Qᵀ.
  ATTN_RETURN_IF_ERROR(CublasStatus(
      cublasGemmStridedBatchedEx(
          slot.blas, CUBLAS_OP_T, CUBLAS_OP_N, n_keys, m, static_cast<int>(s.head_dim), &scale,
          device.key, input_type, pitch, s.key_len * pitch, device.query, input_type, pitch,
          rows_per_kv_head * pitch, &zero, scores, CUDA_R_32F, n_keys, rows_per_kv_head * s.key_len,
          batches, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmStridedBatchedEx (scores)"));
  ATTN_RETURN_IF_ERROR(Check(LaunchSoftmax(scores, weights, lse, s.batch * s.heads * s.query_len,
                                           s.query_len, s.key_len, problem.causal, slot.stream),
                             "LaunchSoftmax"));
  // Row-major O[m, dv] = W[m, Nk] · V[Nk, dv] is column-major Oᵀ = Vᵀ · Wᵀ.
  ATTN_RETURN_IF_ERROR(CublasStatus(
      cublasGemmStridedBatchedEx(slot.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.value_dim),
                                 m, n_keys, &one, value, CUDA_R_32F, static_cast<int>(value_pitch),
                                 s.key_len * value_pitch, weights, CUDA_R_32F, n_keys,
                                 rows_per_kv_head * s.key_len, &zero, out, CUDA_R_32F,
                                 static_cast<int>(s.value_dim), rows_per_kv_head * s.value_dim,
                                 batches, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmStridedBatchedEx (output)"));
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.stop, slot.stream), "cudaEventRecord"));
  ATTN_RETURN_IF_ERROR(
      DeliverResults(problem, out, lse, outputs, memory, slot, "Naive on the device"));

  Stats stats;
  ATTN_ASSIGN_OR_RETURN(stats.compute_ns, ElapsedNs(slot));
  stats.flops = problem.Flops();
  stats.intermediate_bytes = problem.NaiveIntermediateBytes();
  SetMemoryStats(problem, lse != nullptr, memory.bytes(), &stats);
  return stats;
}

absl::StatusOr<Stats> CudaBackend::Tiled(const Problem& problem, const Outputs& outputs) {
  if (absl::Status status = outputs.CheckInterrupt(); !status.ok()) return status;
  const int pitch = PaddedDim(problem.shape);
  if (pitch == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", problem.shape.head_dim, " / value_dim ", problem.shape.value_dim,
                     ": the CUDA Tiled kernels support up to ", kMaxHeadDim));
  }
  ATTN_RETURN_IF_ERROR(Start());
  Lease lease(*this);
  Slot& slot = lease.slot();
  Allocations memory(budget_, slot.stream);
  ATTN_ASSIGN_OR_RETURN(const DeviceProblem device,
                        Upload(problem, pitch, outputs.lse != nullptr, memory, slot));
  ATTN_ASSIGN_OR_RETURN(float* out, memory.Allocate<float>(problem.OutputElements() * 4));
  float* lse = nullptr;
  if (outputs.lse != nullptr) {
    ATTN_ASSIGN_OR_RETURN(lse, memory.Allocate<float>(problem.LseElements() * 4));
  }
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.start, slot.stream), "cudaEventRecord"));
  const TiledPlan plan = PlanTiled(device, problem.block_k, max_shared_bytes_);
  if (const cudaError_t error = LaunchTiled(device, plan, out, lse, slot.stream);
      error == cudaErrorInvalidValue) {
    return absl::InternalError(absl::StrCat("CUDA Tiled: no kernel for ", DTypeName(device.dtype),
                                            " rows padded to ", device.pitch));
  } else {
    ATTN_RETURN_IF_ERROR(Check(error, "LaunchTiled"));
  }
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.stop, slot.stream), "cudaEventRecord"));
  ATTN_RETURN_IF_ERROR(
      DeliverResults(problem, out, lse, outputs, memory, slot, "Tiled on the device"));

  Stats stats;
  ATTN_ASSIGN_OR_RETURN(stats.compute_ns, ElapsedNs(slot));
  stats.block_k = static_cast<int>(plan.block_k);
  stats.flops = problem.Flops();
  SetMemoryStats(problem, lse != nullptr, memory.bytes(), &stats);
  return stats;
}

// Replays the records the trace kernel wrote, one event per Next().
class RecordedTraceCursor final : public TraceCursor {
 public:
  struct Records {
    std::vector<RowRef> rows;
    std::vector<int64_t> first_step, tiles;
    int block_k = 1;
    int64_t key_len = 0, value_dim = 0;
    std::vector<float> scores, weights, scalars, accumulator, estimate, output, reference, lse;
  };

  RecordedTraceCursor(Records records, Stats stats) : records_(std::move(records)), stats_(stats) {}

  bool Next(TraceItem* item) override {
    const Records& r = records_;
    if (row_ >= r.rows.size()) return false;
    const int64_t dv = r.value_dim;
    if (tile_ < r.tiles[row_]) {
      const int64_t step = r.first_step[row_] + tile_;
      TraceStep out;
      out.row = r.rows[row_];
      out.tile = static_cast<int>(tile_);
      out.key_begin = tile_ * r.block_k;
      out.key_end = std::min<int64_t>(out.key_begin + r.block_k, r.key_len);
      const int64_t n = out.key_end - out.key_begin;
      out.scores.assign(r.scores.begin() + step * r.block_k,
                        r.scores.begin() + step * r.block_k + n);
      out.weights.assign(r.weights.begin() + step * r.block_k,
                         r.weights.begin() + step * r.block_k + n);
      const float* scalars = &r.scalars[step * kTraceScalars];
      out.max_before = scalars[0];
      out.max_after = scalars[1];
      out.rescale = scalars[2];
      out.denominator = scalars[3];
      out.accumulator.assign(r.accumulator.begin() + step * dv,
                             r.accumulator.begin() + (step + 1) * dv);
      out.estimate.assign(r.estimate.begin() + step * dv, r.estimate.begin() + (step + 1) * dv);
      *item = std::move(out);
      ++tile_;
      return true;
    }
    TraceRowDone done;
    done.row = r.rows[row_];
    done.output.assign(r.output.begin() + row_ * dv, r.output.begin() + (row_ + 1) * dv);
    done.reference.assign(r.reference.begin() + row_ * dv, r.reference.begin() + (row_ + 1) * dv);
    done.max_abs_error = MaxAbsError(done.output, done.reference);
    done.lse = r.lse[row_];
    *item = std::move(done);
    ++row_;
    tile_ = 0;
    return true;
  }

  Stats stats() const override { return stats_; }

 private:
  const Records records_;
  const Stats stats_;
  size_t row_ = 0;
  int64_t tile_ = 0;
};

absl::StatusOr<std::unique_ptr<TraceCursor>> CudaBackend::Trace(const Problem& problem,
                                                                std::vector<RowRef> rows) {
  const Shape& s = problem.shape;
  if (s.value_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("value_dim ", s.value_dim, ": the CUDA trace supports up to ", kMaxHeadDim));
  }
  RecordedTraceCursor::Records records;
  records.block_k = problem.block_k;
  records.key_len = s.key_len;
  records.value_dim = s.value_dim;
  std::vector<int64_t> row_refs;
  int64_t steps = 0;
  for (const RowRef& row : rows) {
    row_refs.insert(row_refs.end(), {row.batch, row.head, row.row});
    records.first_step.push_back(steps);
    records.tiles.push_back(problem.VisitedTiles(row.row));
    steps += records.tiles.back();
  }
  records.rows = std::move(rows);
  const int64_t n_rows = static_cast<int64_t>(records.rows.size());

  ATTN_RETURN_IF_ERROR(Start());
  Lease lease(*this);
  Slot& slot = lease.slot();
  Allocations memory(budget_, slot.stream);
  const int pitch = static_cast<int>(std::max(s.head_dim, s.value_dim));
  ATTN_ASSIGN_OR_RETURN(const DeviceProblem device, Upload(problem, pitch, false, memory, slot));

  TraceRecords device_records;
  device_records.rows = static_cast<int>(n_rows);
  device_records.block_k = problem.block_k;
  ATTN_ASSIGN_OR_RETURN(int64_t * refs, memory.Allocate<int64_t>(n_rows * 3 * 8));
  ATTN_ASSIGN_OR_RETURN(int64_t * first, memory.Allocate<int64_t>(n_rows * 8));
  device_records.row_refs = refs;
  device_records.first_step = first;
  struct Buffer {
    std::vector<float>* host;
    int64_t count;
    float** device;
  } buffers[] = {
      {&records.scores, steps * problem.block_k, &device_records.scores},
      {&records.weights, steps * problem.block_k, &device_records.weights},
      {&records.scalars, steps * kTraceScalars, &device_records.scalars},
      {&records.accumulator, steps * s.value_dim, &device_records.accumulator},
      {&records.estimate, steps * s.value_dim, &device_records.estimate},
      {&records.output, n_rows * s.value_dim, &device_records.output},
      {&records.reference, n_rows * s.value_dim, &device_records.reference},
      {&records.lse, n_rows, &device_records.lse},
  };
  for (Buffer& buffer : buffers) {
    ATTN_ASSIGN_OR_RETURN(*buffer.device, memory.Allocate<float>(buffer.count * 4));
    buffer.host->resize(buffer.count);
  }
  ATTN_ASSIGN_OR_RETURN(device_records.reference_scores,
                        memory.Allocate<float>(n_rows * s.key_len * 4));
  ATTN_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(refs, row_refs.data(), n_rows * 3 * 8, cudaMemcpyHostToDevice, slot.stream),
      "cudaMemcpyAsync (trace rows)"));
  ATTN_RETURN_IF_ERROR(Check(cudaMemcpyAsync(first, records.first_step.data(), n_rows * 8,
                                             cudaMemcpyHostToDevice, slot.stream),
                             "cudaMemcpyAsync (trace steps)"));
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.start, slot.stream), "cudaEventRecord"));
  ATTN_RETURN_IF_ERROR(Check(LaunchTrace(device, device_records, slot.stream), "LaunchTrace"));
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.stop, slot.stream), "cudaEventRecord"));
  for (Buffer& buffer : buffers) {
    ATTN_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(buffer.host->data(), *buffer.device, buffer.count * 4,
                              cudaMemcpyDeviceToHost, slot.stream),
              "cudaMemcpyAsync (trace records)"));
  }
  ATTN_RETURN_IF_ERROR(Check(cudaStreamSynchronize(slot.stream), "Trace on the device"));

  Stats stats;
  ATTN_ASSIGN_OR_RETURN(stats.compute_ns, ElapsedNs(slot));
  stats.block_k = problem.block_k;
  for (const RowRef& row : records.rows) stats.flops += problem.TraceRowFlops(row.row);
  // A trace returns no output tensor: all it allocated beyond its inputs (the records included)
  // is scratch, and the peak (as on the CPU).
  stats.scratch_bytes = std::max<int64_t>(memory.bytes() - InputBytes(problem), 0);
  stats.peak_memory_bytes = stats.scratch_bytes;
  return std::make_unique<RecordedTraceCursor>(std::move(records), stats);
}

}  // namespace

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

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int index, int64_t max_naive_bytes,
                                                         int max_shared_bytes) {
  std::string error;
  const int count = DeviceCount(&error);
  if (count == 0) {
    return absl::UnavailableError(absl::StrCat("no CUDA device", error.empty() ? "" : ": ", error));
  }
  if (index < 0 || index >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=cuda:", index, ": this machine has ", count, " CUDA device(s)"));
  }
  cudaDeviceProp properties;
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, index));
  // What one block may opt in to: an sm_80 binary also runs on sm_86/89, whose limit (99 KB) is
  // far below the A100's 163 KB, so tile sizes follow the device, not the architecture.
  int optin_shared_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin_shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, index));
  if (max_shared_bytes <= 0 || max_shared_bytes > optin_shared_bytes) {
    max_shared_bytes = optin_shared_bytes;
  }
  size_t free_bytes = 0, total_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Keep freed memory in the stream-ordered pool instead of returning it to the driver.
  cudaMemPool_t pool;
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, index));
  uint64_t threshold = UINT64_MAX;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

  std::vector<Slot> slots(kStreams);
  for (Slot& slot : slots) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&slot.stream, cudaStreamNonBlocking));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.start));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.stop));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&slot.blas));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(slot.blas, slot.stream));
  }
  const int64_t budget = static_cast<int64_t>(static_cast<double>(free_bytes) * 0.9);
  if (max_naive_bytes <= 0) max_naive_bytes = static_cast<int64_t>(total_bytes / 4);
  return std::make_unique<CudaBackend>(index, properties, budget, max_naive_bytes, max_shared_bytes,
                                       std::move(slots));
}

}  // namespace attn::cuda
