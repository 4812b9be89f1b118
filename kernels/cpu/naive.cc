#include "kernels/cpu/naive.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/row_blocks.h"
#include "kernels/online_softmax.h"

namespace attn {

namespace {

// Each score row: the causal mask, then the full-row stable softmax (SoftmaxRow,
// online_softmax.h: the row max, e^(s − max), the sum, the normalization) in eight lanes.
ATTN_HOST_DEVICE void SoftmaxRowsBody(const Problem& problem, int64_t row_begin, int64_t rows,
                                      float* scores, float* weights, float* lse) {
  const int64_t n = problem.shape.key_len;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    const int64_t visible = problem.VisibleKeys(row_begin + r);
    std::fill(s + visible, s + n, -INFINITY);
    const OnlineSoftmaxRow row = SoftmaxRow<SerialReduce>(s, weights + r * n, n, visible, 0, 1);
    if (lse != nullptr) lse[r] = row.LogSumExp();
  }
}

ATTN_CPU_FAST void SoftmaxRowsAvx2(const Problem& problem, int64_t row_begin, int64_t rows,
                                   float* scores, float* weights, float* lse) {
  SoftmaxRowsBody(problem, row_begin, rows, scores, weights, lse);
}

void SoftmaxRowsPortable(const Problem& problem, int64_t row_begin, int64_t rows, float* scores,
                         float* weights, float* lse) {
  SoftmaxRowsBody(problem, row_begin, rows, scores, weights, lse);
}

}  // namespace

void NaiveRows(const Problem& problem, const float* query, const float* key, const float* value,
               int64_t row_begin, int64_t rows, float* scores, float* weights, float* lse,
               float* out) {
  const Shape& s = problem.shape;
  const int m = static_cast<int>(rows);
  const int n = static_cast<int>(s.key_len);
  const int d = static_cast<int>(s.head_dim);
  const int dv = static_cast<int>(s.value_dim);
  // S = scale · Q Kᵀ, W = softmax(S), O = W V.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, d, problem.scale, query, d, key, d,
              0.f, scores, n);
  (CpuHasAvx2Fma() ? SoftmaxRowsAvx2 : SoftmaxRowsPortable)(problem, row_begin, rows, scores,
                                                            weights, lse);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, dv, n, 1.f, weights, n, value, dv, 0.f,
              out, dv);
}

namespace {

struct Worker {
  BlockLoader loader;
  std::vector<float> out, lse;
};

}  // namespace

absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_naive_bytes) {
  const Shape& s = problem.shape;
  const int64_t matrix_elements = s.batch * s.heads * s.query_len * s.key_len;
  const int64_t storage_bytes = problem.NaiveStorageBytes();
  if (absl::Status budget = CheckNaiveBudget(problem, max_naive_bytes, "memory"); !budget.ok()) {
    return budget;
  }
  std::unique_ptr<float[]> scores(new (std::nothrow) float[matrix_elements]);
  std::unique_ptr<float[]> weights(new (std::nothrow) float[matrix_elements]);
  if (!scores || !weights) {
    return absl::ResourceExhaustedError(absl::StrCat("Naive could not allocate ", storage_bytes,
                                                     " bytes for its score and weight matrices; "
                                                     "use Tiled, which needs no such storage"));
  }

  const int64_t tasks = RowBlockCount(problem);
  std::vector<Worker> workers(pool.WorkersFor(tasks));
  const absl::Status run =
      RunInterruptible(pool, tasks, outputs.interrupt, [&](int64_t task, int worker_index) {
        Worker& worker = workers[worker_index];
        const RowBlock block = RowBlockAt(problem, task);
        const auto [query, key, value] = worker.loader.Load(problem, block);
        const int64_t rows = block.row_end - block.row_begin;
        const int64_t offset =
            ((block.batch * s.heads + block.head) * s.query_len + block.row_begin) * s.key_len;
        worker.out.resize(rows * s.value_dim);
        worker.lse.resize(rows);
        NaiveRows(problem, query, key, value, block.row_begin, rows, scores.get() + offset,
                  weights.get() + offset, worker.lse.data(), worker.out.data());
        StoreFloats(worker.out.data(), rows * s.value_dim, outputs.output,
                    problem.OutputOffset(block.batch, block.head, block.row_begin));
        if (outputs.lse != nullptr) {
          std::copy(worker.lse.begin(), worker.lse.end(),
                    outputs.lse + problem.LseOffset(block.batch, block.head, block.row_begin));
        }
      });
  if (!run.ok()) return run;

  Stats stats;
  stats.intermediate_bytes = problem.NaiveIntermediateBytes();
  stats.scratch_bytes = storage_bytes;
  for (const Worker& worker : workers) {
    stats.scratch_bytes +=
        worker.loader.scratch_bytes() +
        static_cast<int64_t>((worker.out.capacity() + worker.lse.capacity()) * sizeof(float));
  }
  return stats;
}

}  // namespace attn
