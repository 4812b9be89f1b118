// Row blocks: how the CPU kernels split a problem into tasks.
//
// A task is a block of up to kRowsPerBlock query rows of one (batch, head), within one sequence
// of a ragged batch (a block never spans two, so Tiled visits only its sequence's key tiles).
// Each kernel loads a task's inputs itself, as fp32 through Fp32Rows (fp32_rows.h): Naive its
// whole key/value head, packed once for all the head's blocks a worker runs (naive.cc), Tiled a
// tile at a time (tiled.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

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

// A problem's tasks: every (batch, head) split the same way, each sequence (the one sequence
// unless ragged) into blocks of kRowsPerBlock rows from its first row, the last one shorter.
class RowBlocks {
 public:
  explicit RowBlocks(const Problem& problem) : problem_(problem) {
    const int64_t sequences = std::max<int64_t>(problem.sequences, 1);
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t begin = problem.sequences > 0 ? problem.cu_seqlens_q[s] : 0;
      const int64_t end =
          problem.sequences > 0 ? problem.cu_seqlens_q[s + 1] : problem.shape.query_len;
      for (int64_t row = begin; row < end; row += kRowsPerBlock) starts_.push_back(row);
    }
  }

  int64_t size() const {
    return problem_.shape.batch * problem_.shape.heads * static_cast<int64_t>(starts_.size());
  }

  RowBlock operator[](int64_t task) const {
    const int64_t per_head = static_cast<int64_t>(starts_.size());
    const size_t index = static_cast<size_t>(task % per_head);
    RowBlock block;
    block.batch = task / (problem_.shape.heads * per_head);
    block.head = task / per_head % problem_.shape.heads;
    block.kv_head = problem_.KvHead(block.head);
    block.row_begin = starts_[index];
    const int64_t next = index + 1 < starts_.size() ? starts_[index + 1] : problem_.shape.query_len;
    block.row_end = std::min(block.row_begin + kRowsPerBlock, next);
    return block;
  }

 private:
  const Problem& problem_;
  std::vector<int64_t> starts_;  // First row of each block of a (batch, head), in order.
};

}  // namespace attn
