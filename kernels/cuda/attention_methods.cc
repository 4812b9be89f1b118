// Naive, Tiled and Trace on the device (backend_impl.h): each uploads its inputs (a cache's
// pages gathered into the contiguous padded layout), launches its kernels (naive.cu and cuBLAS,
// tiled.cu, trace.cu) and delivers the results.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/backend_impl.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.h"
#include "kernels/online_softmax.h"

namespace attn::cuda {

absl::StatusOr<Stats> CudaBackend::Naive(const Problem& problem, const Outputs& outputs) {
  if (absl::Status status = outputs.CheckInterrupt(); !status.ok()) return status;
  const Shape& s = problem.shape;
  const int64_t matrix_elements = s.batch * s.heads * s.query_len * s.key_len;
  if (absl::Status budget = CheckNaiveBudget(problem, options_.max_naive_bytes, "device memory");
      !budget.ok()) {
    return budget;
  }
  const int64_t group = QueryHeadsPerKvHead(s.heads, s.kv_heads);
  const int64_t rows_per_kv_head = group * s.query_len;  // The GEMMs' M.
  const int pitch =
      std::max<int>(PaddedDim(s), static_cast<int>(std::max(s.head_dim, s.value_dim)));
  if (rows_per_kv_head > INT32_MAX || s.key_len > INT32_MAX || s.batch * s.kv_heads > INT32_MAX) {
    return absl::InvalidArgumentError(
        "Naive on CUDA: heads/kv_heads·query_len, key_len and batch·kv_heads must each fit in "
        "int32 (cuBLAS); use Tiled");
  }
  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  Allocations memory(device_->budget(), slot.stream);
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
  ATTN_RETURN_IF_ERROR(
      Check(LaunchSoftmax(scores, weights, lse, s.batch * s.heads * s.query_len, s.heads,
                          device.geometry, device.transforms, slot.stream),
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
  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  Allocations memory(device_->budget(), slot.stream);
  ATTN_ASSIGN_OR_RETURN(const DeviceProblem device,
                        Upload(problem, pitch, outputs.lse != nullptr, memory, slot));
  ATTN_ASSIGN_OR_RETURN(float* out, memory.Allocate<float>(problem.OutputElements() * 4));
  float* lse = nullptr;
  if (outputs.lse != nullptr) {
    ATTN_ASSIGN_OR_RETURN(lse, memory.Allocate<float>(problem.LseElements() * 4));
  }
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.start, slot.stream), "cudaEventRecord"));
  const TiledPlan plan = PlanTiled(device, problem.block_k, options_.max_shared_bytes);
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

namespace {

// Replays the records the trace kernel wrote, one event per Next().
class RecordedTraceCursor final : public TraceCursor {
 public:
  struct Records {
    std::vector<RowRef> rows;
    std::vector<int64_t> first_step;
    std::vector<KeyRange> tiles;  // [rows]: the tiles each row's steps visit.
    int block_k = 1;
    int64_t key_len = 0, value_dim = 0;
    std::vector<float> scores, weights, scalars, accumulator, estimate, output, reference, lse;
    std::vector<float> scaled_scores;  // Empty when the transform is the identity.
    std::vector<float> biases;         // Empty without ALiBi slopes.
    std::vector<Hidden> hidden;        // Empty when no mask applies.
    std::vector<float> sinks;          // [heads] the problem's sinks; empty without.
  };

  RecordedTraceCursor(Records records, Stats stats) : records_(std::move(records)), stats_(stats) {}

  bool Next(TraceItem* item) override {
    const Records& r = records_;
    if (row_ >= r.rows.size()) return false;
    const int64_t dv = r.value_dim;
    if (tile_ < r.tiles[row_].size()) {  // tile_: the row's steps so far.
      const int64_t step = r.first_step[row_] + tile_;
      const int64_t tile = r.tiles[row_].begin + tile_;
      TraceStep out;
      out.row = r.rows[row_];
      out.tile = static_cast<int>(tile);
      out.key_begin = tile * r.block_k;
      out.key_end = std::min<int64_t>(out.key_begin + r.block_k, r.key_len);
      const int64_t n = out.key_end - out.key_begin;
      out.scores.assign(r.scores.begin() + step * r.block_k,
                        r.scores.begin() + step * r.block_k + n);
      out.weights.assign(r.weights.begin() + step * r.block_k,
                         r.weights.begin() + step * r.block_k + n);
      if (!r.scaled_scores.empty()) {
        out.scaled_scores.assign(r.scaled_scores.begin() + step * r.block_k,
                                 r.scaled_scores.begin() + step * r.block_k + n);
      }
      if (!r.biases.empty()) {
        out.biases.assign(r.biases.begin() + step * r.block_k,
                          r.biases.begin() + step * r.block_k + n);
      }
      if (!r.hidden.empty()) {
        out.hidden.assign(r.hidden.begin() + step * r.block_k,
                          r.hidden.begin() + step * r.block_k + n);
      }
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
    if (!r.sinks.empty()) {
      done.sink_share = OnlineSoftmaxRow::SinkShare(r.sinks[done.row.head], done.lse);
    }
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

}  // namespace

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
  if (problem.sinks != nullptr) records.sinks.assign(problem.sinks, problem.sinks + s.heads);
  records.value_dim = s.value_dim;
  std::vector<int64_t> row_refs;
  int64_t steps = 0;
  for (const RowRef& row : rows) {
    row_refs.insert(row_refs.end(), {row.batch, row.head, row.row});
    records.first_step.push_back(steps);
    records.tiles.push_back(problem.VisitedTiles(row.row));
    steps += records.tiles.back().size();
  }
  records.rows = std::move(rows);
  const int64_t n_rows = static_cast<int64_t>(records.rows.size());

  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  Allocations memory(device_->budget(), slot.stream);
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
  };
  std::vector<Buffer> buffers = {
      {&records.scores, steps * problem.block_k, &device_records.scores},
      {&records.weights, steps * problem.block_k, &device_records.weights},
      {&records.scalars, steps * kTraceScalars, &device_records.scalars},
      {&records.accumulator, steps * s.value_dim, &device_records.accumulator},
      {&records.estimate, steps * s.value_dim, &device_records.estimate},
      {&records.output, n_rows * s.value_dim, &device_records.output},
      {&records.reference, n_rows * s.value_dim, &device_records.reference},
      {&records.lse, n_rows, &device_records.lse},
  };
  if (!problem.transforms().Identity()) {  // The scores before the transform, for TileStep.
    buffers.push_back(
        {&records.scaled_scores, steps * problem.block_k, &device_records.scaled_scores});
  }
  if (problem.alibi_slopes != nullptr) {  // Each key's bias, for TileStep.
    buffers.push_back({&records.biases, steps * problem.block_k, &device_records.biases});
  }
  for (Buffer& buffer : buffers) {
    ATTN_ASSIGN_OR_RETURN(*buffer.device, memory.Allocate<float>(buffer.count * 4));
    buffer.host->resize(buffer.count);
  }
  if (problem.geometry().Masked()) {  // What hides each key, for TileStep.
    records.hidden.resize(steps * problem.block_k);
    ATTN_ASSIGN_OR_RETURN(device_records.hidden,
                          memory.Allocate<Hidden>(steps * problem.block_k * sizeof(Hidden)));
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
  if (device_records.hidden != nullptr) {
    ATTN_RETURN_IF_ERROR(Check(cudaMemcpyAsync(records.hidden.data(), device_records.hidden,
                                               records.hidden.size() * sizeof(Hidden),
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

}  // namespace attn::cuda
