// Tiled attention on the CPU: the explainer's idea 3 (FlashAttention's forward pass). A block
// of query rows visits block_k keys at a time, keeping only a running max, denominator and
// weighted sum per row (online_softmax.h); nothing query_len × key_len is ever stored, and
// tiles the mask (causal, window: kernels/geometry.h) hides entirely are never visited. Per tile:
// the scores come from KvTile::Scores, the online-softmax step runs vectorized over the tile, and
// the weighted values accumulate with KvTile::Accumulate. fp16/bf16 keys and values are converted
// a tile at a time, as they are packed; a worker packs each tile of a head once for all the head's
// row blocks it runs.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/online_softmax.h"
#include "kernels/problem.h"

namespace attn {

// The online-softmax step for rows [row_begin, row_begin + rows) of query head `head` of a block
// over the key tile starting at key_begin with n keys: turns scores [rows, n] (scaled) into the
// softmax's scores in place (ScoresOrHidden: the head's transform, −inf for a key the row does
// not see), then into weights in place via OnlineSoftmaxRow::VisitTile, and rescales each row of
// acc [rows, value_dim] (row stride acc_stride) with OnlineSoftmaxRow::RescaleAccumulator,
// recording the factors in rescales when not null. The caller then adds weights · V_tile to acc
// (KvTile::Accumulate).
void VisitKeyTileRows(const Problem& problem, int64_t head, int64_t row_begin, int64_t rows,
                      int64_t key_begin, int n, float* scores, float* acc, int acc_stride,
                      OnlineSoftmaxRow* states, float* rescales = nullptr);

// Query head `head`'s ScoreTransform on the n scaled scores of row `row` for keys key_begin … in
// place, with the vector code VisitKeyTileRows runs (the same dispatch), so a trace shows
// exactly the scores Tiled used.
void TransformTile(const Problem& problem, int64_t head, int64_t row, int64_t key_begin,
                   float* scores, int n);

// Online-softmax attention on `pool`. Never fails for a valid Problem.
//
// Each worker keeps the packed key tiles of the head it works on when they take at most
// max_packed_head_bytes (CpuBackend's default: 16 MiB, N·(d + dv)·4 bytes, so N = 32768 with
// d = dv = 64 fits): a head's row blocks are consecutive tasks, so a worker then packs a head's
// tiles once instead of once per block (the packing cost about a tenth of Tiled's time). Past
// the limit, tiles are packed again for every block.
absl::StatusOr<Stats> TiledAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_packed_head_bytes);

}  // namespace attn
