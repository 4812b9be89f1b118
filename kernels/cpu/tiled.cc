#include "kernels/cpu/tiled.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_blocks.h"

namespace attn {
namespace {

struct Worker {
  BlockLoader loader;
  std::vector<float> scores, weights, acc;
};

}  // namespace

float VisitKeyTile(const Problem& problem, const float* q_row, const float* key, const float* value,
                   int64_t row, int64_t tile, OnlineSoftmaxRow& state, float* scores,
                   float* weights, float* acc) {
  const int64_t d = problem.shape.head_dim;
  const int64_t dv = problem.shape.value_dim;
  const int64_t key_begin = tile * problem.block_k;
  const int64_t key_end = std::min<int64_t>(key_begin + problem.block_k, problem.shape.key_len);
  const int64_t visible = problem.VisibleKeys(row);
  const int n = static_cast<int>(key_end - key_begin);

  for (int j = 0; j < n; ++j) {
    const int64_t key_index = key_begin + j;
    if (key_index >= visible) {
      scores[j] = -INFINITY;
      continue;
    }
    const float* k_row = key + key_index * d;
    float dot = 0.f;
    for (int64_t c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
    scores[j] = problem.scale * dot;
  }
  const float rescale = state.VisitTile(scores, n, weights);
  for (int64_t c = 0; c < dv; ++c) acc[c] *= rescale;
  for (int j = 0; j < n; ++j) {
    if (weights[j] == 0.f) continue;
    const float* v_row = value + (key_begin + j) * dv;
    for (int64_t c = 0; c < dv; ++c) acc[c] += weights[j] * v_row[c];
  }
  return rescale;
}

absl::StatusOr<Stats> TiledAttention(const Problem& problem, const Outputs& outputs, int threads) {
  const Shape& s = problem.shape;
  const int64_t tasks = RowBlockCount(problem);
  std::vector<Worker> workers(WorkerCount(tasks, threads));
  ParallelFor(tasks, threads, [&](int64_t task, int worker_index) {
    Worker& worker = workers[worker_index];
    const RowBlock block = RowBlockAt(problem, task);
    const auto [batch, head, kv_head, row_begin, row_end] = block;
    const auto [query, key, value] = worker.loader.Load(problem, block);
    worker.scores.resize(problem.block_k);
    worker.weights.resize(problem.block_k);
    worker.acc.resize(s.value_dim);

    for (int64_t i = row_begin; i < row_end; ++i) {
      OnlineSoftmaxRow state;
      std::fill(worker.acc.begin(), worker.acc.end(), 0.f);
      const int64_t tiles = problem.VisitedTiles(i);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        VisitKeyTile(problem, query + (i - row_begin) * s.head_dim, key, value, i, tile, state,
                     worker.scores.data(), worker.weights.data(), worker.acc.data());
      }
      const int64_t out_offset = problem.OutputOffset(batch, head, i);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        outputs.output.Store(out_offset + c, state.Normalize(worker.acc[c]));
      }
      if (outputs.lse != nullptr)
        outputs.lse[problem.LseOffset(batch, head, i)] = state.LogSumExp();
    }
  });

  Stats stats;
  for (const Worker& worker : workers) {
    stats.scratch_bytes +=
        worker.loader.scratch_bytes() +
        static_cast<int64_t>(
            (worker.scores.capacity() + worker.weights.capacity() + worker.acc.capacity()) *
            sizeof(float));
  }
  return stats;
}

}  // namespace attn
