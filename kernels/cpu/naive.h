// Naive attention on the CPU: the explainer's ideas 1 and 2. For every (batch, head) the full
// query_len × key_len score matrix is written, turned into a weight matrix by a stable softmax,
// and multiplied by the values. Both matrices live in memory at once, 8·B·H·Nq·Nk bytes.
//
// The row functions are also the trace's full-matrix reference, so Trace compares the online
// softmax against exactly this computation.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/problem.h"

namespace attn {

// Scores of query row `row` (fp32 q_row[head_dim]) against every key of one head (fp32
// key[key_len, head_dim]): scale · q·k_j, −inf where the causal mask hides key j.
void ScoreRow(const Problem& problem, const float* q_row, const float* key, int64_t row,
              float* scores);

// Stable softmax of one score row of n entries into weights (may alias scores). Returns the
// row's log-sum-exp; a row with every score −inf gets zero weights and returns −inf.
float SoftmaxRow(const float* scores, int64_t n, float* weights);

// out[value_dim] = Σ_j weights[j] · value[j, :] over key_len keys.
void WeightedSumRow(const float* weights, const float* value, int64_t key_len, int64_t value_dim,
                    float* out);

// Full-matrix attention with `threads` workers. RESOURCE_EXHAUSTED naming Tiled when the score
// and weight matrices would pass max_naive_bytes or cannot be allocated.
absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs, int threads,
                                     int64_t max_naive_bytes);

}  // namespace attn
