// Naive attention on the CPU: the explainer's ideas 1 and 2, as a framework's eager path does
// it. For every (batch, head) the full query_len × key_len score matrix is written by a BLAS
// GEMM, turned into a weight matrix by a stable (vectorized) softmax, and multiplied by the
// values with a second GEMM. Both matrices live in memory at once, 8·B·H·Nq·Nk bytes.
//
// NaiveRows is also the trace's full-matrix reference, so Trace compares the online softmax
// against exactly this computation.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/problem.h"

namespace attn {

// Full-matrix attention for query rows [row_begin, row_begin + rows) of one head, all fp32:
// query [rows, head_dim], key [key_len, head_dim], value [key_len, value_dim]. Writes the scaled
// and masked scores [rows, key_len], the weights [rows, key_len], each row's log-sum-exp into
// lse (when not null; −inf for a row that sees no key) and the output [rows, value_dim].
void NaiveRows(const Problem& problem, const float* query, const float* key, const float* value,
               int64_t row_begin, int64_t rows, float* scores, float* weights, float* lse,
               float* out);

// Full-matrix attention on `pool`. RESOURCE_EXHAUSTED naming Tiled when the score and weight
// matrices would pass max_naive_bytes or cannot be allocated.
absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_naive_bytes);

}  // namespace attn
