// attn bench --decode: what server-resident KV caches buy, measured end to end.
//
// For each (batch B, cache length L) row it creates B caches, fills each with L random tokens
// (appends under kFillChunkBytes), runs one untimed warm-up step, then times `steps` decode steps:
// one Decode call per step carrying all B items, each item one new token's q [heads, 1, head_dim]
// and k, v [kv_heads, 1, ·], appended before the attention. Then it deletes the caches and, when
// the request fits under the server's max message size, times the same step as a stateless Tiled
// call (q [B, heads, 1, head_dim] plus every sequence's whole K and V, L + 1 tokens each).
//
// Per row: wall p50 (this process's round trip), compute p50 (the server's
// ExecutionStats.compute_ns for the whole batch), wall − compute, the serialized request bytes
// per step beside the stateless call's (computed exactly from the shapes; checked against the
// real request where one is built), and the cache bytes the compute reads (every item's whole
// K and V after the append) per second of compute, against a memory-read bandwidth measured in
// this process at the start of the run (a 1 GiB buffer summed by every hardware thread, best of
// five). The server is expected on the same machine over loopback, so that ceiling is its
// memory's too; the table says so. A second table says where each row's wall − compute goes:
// the server's stages (ExecutionStats.stages: handler, queue, prepare, finish), the time outside
// its handler (wall − server_ns), the floor under any call on the channel (a GetServerInfo round
// trip, p50 of 200 at the start) and this client's codec work (timed apart). It ends with the
// targets of issues 13 and 32 evaluated.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"

namespace attn::cli {

struct DecodeBenchConfig {
  std::vector<int64_t> lengths = {1024, 2048, 4096, 8192, 16384, 32768};  // Tokens cached.
  std::vector<int64_t> batches = {1, 16};  // Sequences per Decode call.
  int64_t heads = 32;
  int64_t kv_heads = 8;
  int64_t head_dim = 128;
  int64_t value_dim = 128;
  attention::v1::DType dtype = attention::v1::DTYPE_BFLOAT16;
  int64_t steps = 16;         // Timed decode steps per row.
  int stateless_repeats = 3;  // Timed stateless Tiled calls per row (0 = none).
  uint64_t seed = 1;
  attention::v1::AttentionOptions options;  // block_k, …
  std::string target;  // The server's address, for the table (and whether it is loopback).
  // --shm: each step's q, k, v and outputs through a registered /dev/shm region instead of the
  // messages (attnd --allow-shared-memory; a server on this machine).
  bool shm = false;
};

// "1024,2k,4K": positive integers, a k suffix meaning ×1024; sorted, without duplicates.
// INVALID_ARGUMENT naming `flag` otherwise.
absl::StatusOr<std::vector<int64_t>> ParseCounts(const std::string& flag, const std::string& spec);

// Runs every (batch, length) row, batches outer, writing progress to `progress` and the table
// to `out`. Any failed call stops the run (after deleting that row's caches) and is returned,
// naming the row.
absl::Status RunDecodeBench(client::Client& client, const DecodeBenchConfig& config, std::FILE* out,
                            std::FILE* progress);

}  // namespace attn::cli
