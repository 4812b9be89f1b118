// Tiled attention on the CPU: the explainer's idea 3 (FlashAttention's forward pass). Each
// query row visits block_k keys at a time, keeping only a running max, a running denominator
// and a running weighted sum (online_softmax.h); nothing query_len × key_len is ever stored,
// and tiles the causal mask hides entirely are never visited.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/online_softmax.h"
#include "kernels/problem.h"

namespace attn {

// Visits key tile `tile` of query row `row` of one head (fp32 q_row[head_dim],
// key[key_len, head_dim], value[key_len, value_dim]): writes the tile's scaled, masked scores
// and their weights (block_k floats each; the tile may be shorter at the end), advances `state`
// and the accumulator acc[value_dim]. Returns the rescale factor it applied to acc.
// Tiled and Trace both call this, so a trace shows exactly Tiled's arithmetic.
float VisitKeyTile(const Problem& problem, const float* q_row, const float* key, const float* value,
                   int64_t row, int64_t tile, OnlineSoftmaxRow& state, float* scores,
                   float* weights, float* acc);

// Online-softmax attention with `threads` workers. Never fails for a valid Problem.
absl::StatusOr<Stats> TiledAttention(const Problem& problem, const Outputs& outputs, int threads);

}  // namespace attn
