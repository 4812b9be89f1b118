// Row blocks: how the CPU kernels split a problem into tasks, and load each task's inputs.
//
// A task is a block of up to kRowsPerBlock query rows of one (batch, head). BlockLoader gives
// Naive a block's query rows and its whole key/value head as fp32 (dense or paged, through
// Fp32Rows::LoadKeys/LoadValues): used in place when the input is fp32 and contiguous, converted
// or gathered once per block into buffers the loader owns otherwise. Tiled
// loads its keys and values a tile at a time instead (tiled.cc).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/fp32_rows.h"
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

// A block's inputs in fp32: query rows [row_begin, row_end), the whole key and value head.
struct BlockInputs {
  const float* query = nullptr;  // [row_end − row_begin, head_dim]
  const float* key = nullptr;    // [key_len, head_dim]
  const float* value = nullptr;  // [key_len, value_dim]
};

// Loads BlockInputs; pointers stay valid until the next Load. Not thread-safe: one per worker.
class BlockLoader {
 public:
  BlockInputs Load(const Problem& problem, const RowBlock& block) {
    const Shape& s = problem.shape;
    BlockInputs inputs;
    inputs.query =
        query_.Load(problem.query, problem.QueryOffset(block.batch, block.head, block.row_begin),
                    (block.row_end - block.row_begin) * s.head_dim);
    inputs.key = key_.LoadKeys(problem, block.batch, block.kv_head, 0, s.key_len);
    inputs.value = value_.LoadValues(problem, block.batch, block.kv_head, 0, s.key_len);
    return inputs;
  }

  int64_t scratch_bytes() const {
    return query_.scratch_bytes() + key_.scratch_bytes() + value_.scratch_bytes();
  }

 private:
  Fp32Rows query_, key_, value_;
};

}  // namespace attn
