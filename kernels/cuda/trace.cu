// Trace on the GPU: the online softmax of chosen query rows, recorded step by step.
//
// One warp per traced row. For each key tile: the lanes compute the tile's scores (ScoreOrHidden)
// into the record; lane 0 runs OnlineSoftmaxRow::VisitTile on them — the very function the CPU
// Tiled path and trace call — writing the weights and the running max, rescale and denominator
// into the record; every lane then rescales (OnlineSoftmaxRow::RescaleAccumulator) and
// accumulates its value columns and records the accumulator and the estimate. After the last
// tile the warp computes the row the Naive way (all scores, the full-row SoftmaxRow of
// online_softmax.h shared by the warp, weighted sum) as the reference.
// Inputs as in tiled.cu (rows padded to `pitch`); records as in launch.h (TraceRecords).
// Tracing is for inspection, not speed: one warp per row, scores one lane per key.
#include <cstdint>

#include "kernels/cuda/device_rows.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/portable.h"
#include "kernels/cuda/reduce.h"
#include "kernels/dtype.h"
#include "kernels/online_softmax.h"

namespace attn::cuda {
namespace {

constexpr int kMaxColumnsPerLane = kMaxHeadDim / 32;

struct TraceParams {
  DeviceProblem problem;
  TraceRecords records;
};

__global__ void TraceKernel(const TraceParams params) {
  const DeviceProblem& p = params.problem;
  const TraceRecords& rec = params.records;
  const Shape& s = p.shape;
  const int lane = threadIdx.x;
  const int r = blockIdx.x;
  const int64_t batch = rec.row_refs[3 * r];
  const int64_t head = rec.row_refs[3 * r + 1];
  const int64_t row = rec.row_refs[3 * r + 2];
  const int64_t query_offset = QueryRowOffset(p, batch, head, row);
  const int64_t kv_offset = KeyValueHeadOffset(p, batch, head);
  const KeyRange visible = p.geometry.Visible(row);
  const KeyRange tiles = p.geometry.VisitedTiles(row, row, rec.block_k);
  const ScoreTransform transform = p.transforms.ForHead(head);
  const int64_t distance = p.geometry.Distance(row, 0);  // p − t of key 0.

  OnlineSoftmaxRow state;  // Identical in every lane: lane 0 computes, the others copy.
  float acc[kMaxColumnsPerLane] = {};
  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    const int64_t step = rec.first_step[r] + (tile - tiles.begin);
    const int64_t key_begin = tile * rec.block_k;
    const int n = static_cast<int>(min(key_begin + rec.block_k, s.key_len) - key_begin);
    float* scores = rec.scores + step * rec.block_k;
    float* weights = rec.weights + step * rec.block_k;
    for (int j = lane; j < n; j += 32) {
      const int64_t key = key_begin + j;
      // What the score of the key is made of besides q·k, hidden keys too: the bias the
      // transform adds, and what hides the key.
      if (rec.biases != nullptr) {
        rec.biases[step * rec.block_k + j] = transform.Bias(static_cast<float>(distance - key));
      }
      if (rec.hidden != nullptr) rec.hidden[step * rec.block_k + j] = p.geometry.HiddenBy(row, key);
      const float scaled = p.scale * Dot(p, query_offset, kv_offset + key * p.pitch);
      // The scaled score before the transform, every key.
      if (rec.scaled_scores != nullptr) rec.scaled_scores[step * rec.block_k + j] = scaled;
      scores[j] = ScoreOrHidden(transform, visible, distance, key, scaled);
    }
    __syncwarp();
    float* scalars = rec.scalars + step * kTraceScalars;
    float rescale = 0.f;
    if (lane == 0) {
      scalars[0] = state.max;
      rescale = state.VisitTile(scores, n, weights);
      scalars[1] = state.max;
      scalars[2] = rescale;
      scalars[3] = state.denominator;
    }
    rescale = __shfl_sync(0xffffffffu, rescale, 0);
    state.max = __shfl_sync(0xffffffffu, state.max, 0);
    state.denominator = __shfl_sync(0xffffffffu, state.denominator, 0);
    __syncwarp();  // The weights lane 0 wrote are visible to every lane.
    OnlineSoftmaxRow::RescaleAccumulator(rescale, kMaxColumnsPerLane,
                                         [&](int m) -> float& { return acc[m]; });
#pragma unroll
    for (int m = 0; m < kMaxColumnsPerLane; ++m) {
      const int64_t column = lane + 32 * m;
      if (column >= s.value_dim) break;
      float a = acc[m];
      for (int j = 0; j < n; ++j) a += weights[j] * ValueAt(p, kv_offset, key_begin + j, column);
      acc[m] = a;
      rec.accumulator[step * s.value_dim + column] = a;
      rec.estimate[step * s.value_dim + column] = state.Normalize(a);
    }
  }
  const float sink = p.transforms.Sink(head);
  const float factor = state.AddSink(sink);  // As Tiled finishes a row.
#pragma unroll
  for (int m = 0; m < kMaxColumnsPerLane; ++m) {
    const int64_t column = lane + 32 * m;
    if (column < s.value_dim) {
      rec.output[r * s.value_dim + column] = state.Normalize(acc[m] * factor);
    }
  }
  if (lane == 0) rec.lse[r] = state.LogSumExp();

  // The reference: the whole score row, then its softmax, then the weighted sum.
  float* full = rec.reference_scores + r * s.key_len;
  for (int64_t j = lane; j < s.key_len; j += 32) {
    full[j] = ScoreOrHidden(transform, visible, distance, j,
                            p.scale * Dot(p, query_offset, kv_offset + j * p.pitch));
  }
  // SoftmaxRow's lanes take the visible scores from visible.begin on, not each its own: every
  // lane's scores must be visible to every lane (the SIMT emulator's first catch: without this
  // a lane read scores its neighbours had not written yet).
  __syncwarp();
  SoftmaxRow<WarpReduce>(full, full, s.key_len, visible, sink, lane, 32);
  __syncwarp();  // Every lane's weights are visible to every lane.
#pragma unroll
  for (int m = 0; m < kMaxColumnsPerLane; ++m) {
    const int64_t column = lane + 32 * m;
    if (column >= s.value_dim) break;
    float out = 0.f;
    for (int64_t j = visible.begin; j < visible.end; ++j) {
      out += full[j] * ValueAt(p, kv_offset, j, column);
    }
    rec.reference[r * s.value_dim + column] = out;
  }
}

}  // namespace

cudaError_t LaunchTrace(const DeviceProblem& problem, const TraceRecords& records,
                        cudaStream_t stream) {
  if (records.rows <= 0) return cudaSuccess;
  return LaunchKernel(TraceKernel, static_cast<unsigned>(records.rows), 32, 0, stream,
                      TraceParams{problem, records});
}

}  // namespace attn::cuda
