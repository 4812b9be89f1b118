#include "kernels/cpu/naive.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_blocks.h"

namespace attn {
namespace {

struct Worker {
  BlockLoader loader;
  std::vector<float> out_row;
};

}  // namespace

void ScoreRow(const Problem& problem, const float* q_row, const float* key, int64_t row,
              float* scores) {
  const int64_t d = problem.shape.head_dim;
  const int64_t visible = problem.VisibleKeys(row);
  for (int64_t j = 0; j < visible; ++j) {
    const float* k_row = key + j * d;
    float dot = 0.f;
    for (int64_t c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
    scores[j] = problem.scale * dot;
  }
  std::fill(scores + visible, scores + problem.shape.key_len, -INFINITY);
}

float SoftmaxRow(const float* scores, int64_t n, float* weights) {
  float max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) max = std::max(max, scores[j]);
  if (max == -INFINITY) {
    std::fill(weights, weights + n, 0.f);
    return -INFINITY;
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    weights[j] = std::exp(scores[j] - max);
    sum += weights[j];
  }
  for (int64_t j = 0; j < n; ++j) weights[j] /= sum;
  return max + std::log(sum);
}

void WeightedSumRow(const float* weights, const float* value, int64_t key_len, int64_t value_dim,
                    float* out) {
  std::fill(out, out + value_dim, 0.f);
  for (int64_t j = 0; j < key_len; ++j) {
    const float w = weights[j];
    if (w == 0.f) continue;
    const float* v_row = value + j * value_dim;
    for (int64_t c = 0; c < value_dim; ++c) out[c] += w * v_row[c];
  }
}

absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs, int threads,
                                     int64_t max_naive_bytes) {
  const Shape& s = problem.shape;
  const int64_t matrix_elements = s.batch * s.heads * s.query_len * s.key_len;
  const int64_t storage_bytes = 2 * matrix_elements * static_cast<int64_t>(sizeof(float));
  if (storage_bytes > max_naive_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Naive needs ", storage_bytes, " bytes for its fp32 score and weight matrices (2 × ",
        s.batch, "·", s.heads, "·", s.query_len, "·", s.key_len,
        " × 4), over this server's --max-naive-bytes=", max_naive_bytes,
        "; use Tiled, which never stores a query_len × key_len matrix"));
  }
  std::unique_ptr<float[]> scores(new (std::nothrow) float[matrix_elements]);
  std::unique_ptr<float[]> weights(new (std::nothrow) float[matrix_elements]);
  if (!scores || !weights) {
    return absl::ResourceExhaustedError(absl::StrCat("Naive could not allocate ", storage_bytes,
                                                     " bytes for its score and weight matrices; "
                                                     "use Tiled, which needs no such storage"));
  }

  const int64_t tasks = RowBlockCount(problem);
  std::vector<Worker> workers(WorkerCount(tasks, threads));
  ParallelFor(tasks, threads, [&](int64_t task, int worker_index) {
    Worker& worker = workers[worker_index];
    const RowBlock block = RowBlockAt(problem, task);
    const auto [batch, head, kv_head, row_begin, row_end] = block;
    const auto [query, key, value] = worker.loader.Load(problem, block);
    const int64_t matrix_offset = (batch * s.heads + head) * s.query_len * s.key_len;
    float* head_scores = scores.get() + matrix_offset;
    float* head_weights = weights.get() + matrix_offset;

    // The three passes of the eager formulation, each over the whole block of rows.
    for (int64_t i = row_begin; i < row_end; ++i) {
      ScoreRow(problem, query + (i - row_begin) * s.head_dim, key, i, head_scores + i * s.key_len);
    }
    for (int64_t i = row_begin; i < row_end; ++i) {
      const float lse =
          SoftmaxRow(head_scores + i * s.key_len, s.key_len, head_weights + i * s.key_len);
      if (outputs.lse != nullptr) outputs.lse[problem.LseOffset(batch, head, i)] = lse;
    }
    worker.out_row.resize(s.value_dim);
    for (int64_t i = row_begin; i < row_end; ++i) {
      WeightedSumRow(head_weights + i * s.key_len, value, s.key_len, s.value_dim,
                     worker.out_row.data());
      const int64_t out_offset = problem.OutputOffset(batch, head, i);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        outputs.output.Store(out_offset + c, worker.out_row[c]);
      }
    }
  });

  Stats stats;
  stats.intermediate_bytes = problem.NaiveIntermediateBytes();
  stats.scratch_bytes = storage_bytes;
  for (const Worker& worker : workers) {
    stats.scratch_bytes += worker.loader.scratch_bytes() +
                           static_cast<int64_t>(worker.out_row.capacity() * sizeof(float));
  }
  return stats;
}

}  // namespace attn
