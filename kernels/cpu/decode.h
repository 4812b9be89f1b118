// Decode on the CPU: attention for few query rows over a long (usually paged) cache, as a
// decode step asks it — flash-decoding.
//
// Work: for every problem of the batch, every batch entry and kv head, the rows of its GQA group
// (query_len · heads / kv_heads rows, consecutive in the query and output tensors) against that
// kv head's keys, split into chunks of kDecodeChunkTokens keys. A task for the pool is a run of
// consecutive chunks of one (problem, batch, kv head); it reads their keys and values once for
// all the group's rows, in place in the stored dtype (fp16/bf16/fp8 converted in vector
// registers, never copied to fp32; an fp8 row's scale applied to its key's scores and its value's
// weights), a tile of kDecodeTile keys at a time through the online-softmax step of
// online_softmax.h, as one stream (the prefetching runs on across chunk boundaries), and leaves
// each chunk's state {max, denominator, accumulator} for each row. A second pass
// merges each row's chunk states in chunk order with OnlineSoftmax::MergeInto — exact: the same
// rule as a tile's — and writes output and lse as Tiled does. Rows see the keys their mask
// leaves them (causal, window: kernels/geometry.h); chunks no row sees are never read.
//
// Cascades: problems of the batch whose caches share their first pages (forks of one prompt,
// ForkCache) run the chunks every one of their rows sees whole, in pages all of them hold, as
// one run per kv head for all their rows stacked (FlashInfer's cascade attention): each key and
// value of the shared pages is read once per call, not once per problem. A row's arithmetic does
// not depend on the rows beside it, so each row's bits are those of its problem decoded alone.
// Problems with a token tree, a window hiding key 0, a GEMM group or a ragged batch take no part.
//
// Chunking depends only on the problem, and a chunk's arithmetic not on its run or worker, so
// results do not depend on the thread count (runs do). Cost: keys and values are read once per kv
// head, so the step is bound by memory bandwidth (docs/perf.md, "Decode").
//
// Measured (tests/bench/attention_bench --methods=decode): see docs/perf.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/problem.h"

namespace attn {

// Keys per chunk, the unit of the merge: long enough that a chunk's fixed costs (its partial
// state, its share of the merge) are small beside reading 512 · (d + dv) elements, short enough
// that a single sequence splits across every worker (32768 keys × 8 kv heads = 512 chunks).
inline constexpr int64_t kDecodeChunkTokens = 512;
// Tasks per worker the chunks are grouped into (runs of a head's chunks, as long as that allows):
// enough to balance uneven runs (masked rows), few enough that the prefetching rarely restarts —
// at each run's start its first tiles are fetched in one burst. Runs of one 512-key chunk read
// the cache about 1.3× slower than runs of 4096 keys (docs/perf.md).
inline constexpr int64_t kDecodeTasksPerWorker = 4;
// Chunks a run holds at most (32768 keys): interrupts (deadlines, cancellation) are asked between
// tasks, so a task stays a few milliseconds even on one thread over a long cache.
inline constexpr int64_t kDecodeMaxRunChunks = 64;
// Keys per online-softmax step inside a chunk: the tile's keys and values stay in L1 between
// the scores and the accumulation.
inline constexpr int kDecodeTile = 64;
// Tiles ahead of the one computing whose rows are prefetched (decode_kernels.inc).
inline constexpr int kDecodePrefetchTiles = 2;
// The same for an fp8 cache, whose rows are half a bf16 row: as many bytes in flight.
inline constexpr int kDecodeFp8PrefetchTiles = 4;
constexpr int DecodePrefetchTilesOf(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? kDecodeFp8PrefetchTiles : kDecodePrefetchTiles;
}
// Rows of a GQA group (query_len · heads / kv_heads) up to which a chunk runs the vector loops
// above (each key and value read in place, once for the group's rows: bound by memory). A larger
// group (MLA's 128 query heads over one latent head; a wide verify step) is bound by compute
// instead: its chunks run on KvTile's register-blocked GEMM kernels (kv_tile.h), a tile of
// kDecodeGemmTile keys converted and packed once for all the rows, up to kDecodeGemmMaxRows rows;
// CpuBackend::Decode gives larger groups to Tiled.
inline constexpr int64_t kDecodeMaxRows = 64;
inline constexpr int64_t kDecodeGemmMaxRows = 256;
inline constexpr int kDecodeGemmTile = 128;
// A GEMM group's chunks are longer (each holds rows · (value_dim + 2) floats of partial state):
// key_len / kDecodeGemmChunks keys, within [kDecodeChunkTokens, 8 · kDecodeChunkTokens].
inline constexpr int64_t kDecodeGemmChunks = 64;

// Keys per chunk of a problem: kDecodeChunkTokens, or longer for a GEMM group (a multiple of it;
// from the problem alone, so that results do not depend on the thread count).
inline int64_t DecodeChunkTokensOf(int64_t rows, int64_t key_len) {
  if (rows <= kDecodeMaxRows) return kDecodeChunkTokens;
  const int64_t chunks_of_base =
      (key_len / kDecodeGemmChunks + kDecodeChunkTokens - 1) / kDecodeChunkTokens;
  return kDecodeChunkTokens * std::clamp<int64_t>(chunks_of_base, 1, 8);
}

// Rows one kv head's task computes: query_len · heads / kv_heads.
inline int64_t DecodeRowsOf(const Problem& problem) {
  return problem.shape.query_len * QueryHeadsPerKvHead(problem.shape.heads, problem.shape.kv_heads);
}

// The decode kernel over problems[i] into outputs[i] (every problem decode-shaped:
// DecodeRowsOf ≤ kDecodeGemmMaxRows; dense or paged). Asks every outputs[i].interrupt between
// tasks. Never fails otherwise. Its Stats: block_k, flops and scratch_bytes (the caller times the
// call).
absl::StatusOr<Stats> DecodeAttention(const std::vector<const Problem*>& problems,
                                      const std::vector<const Outputs*>& outputs, ThreadPool& pool);

}  // namespace attn
