// Row blocks: how the CPU kernels split a problem into tasks.
//
// A task is a block of up to kRowsPerBlock query rows of one (batch, head). Each kernel loads a
// task's inputs itself, as fp32 through Fp32Rows (fp32_rows.h): Naive its whole key/value head,
// packed once for all the head's blocks a worker runs (naive.cc), Tiled a tile at a time
// (tiled.cc).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/problem.h"

namespace attn {

// Query rows per task: tall enough for efficient GEMMs (measured: 128 beat 64 by a few percent,
// docs/perf.md), few enough that causal blocks balance across workers.
constexpr int64_t kRowsPerBlock = 128;

struct RowBlock {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t kv_head = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

inline int64_t BlocksPerHead(const Problem& problem) {
  return (problem.shape.query_len + kRowsPerBlock - 1) / kRowsPerBlock;
}

inline int64_t RowBlockCount(const Problem& problem) {
  return problem.shape.batch * problem.shape.heads * BlocksPerHead(problem);
}

inline RowBlock RowBlockAt(const Problem& problem, int64_t task) {
  const int64_t per_head = BlocksPerHead(problem);
  RowBlock block;
  block.batch = task / (problem.shape.heads * per_head);
  block.head = task / per_head % problem.shape.heads;
  block.kv_head = problem.KvHead(block.head);
  block.row_begin = task % per_head * kRowsPerBlock;
  block.row_end = std::min(block.row_begin + kRowsPerBlock, problem.shape.query_len);
  return block;
}

}  // namespace attn
