// Naive attention on the CPU: the explainer's ideas 1 and 2, as a framework's eager path does
// it. For every (batch, head) the full query_len × key_len score matrix is written by a matrix
// product, turned into a weight matrix by a stable (vectorized) softmax, and multiplied by the
// values with a second product. Both matrices live in memory at once, 8·B·H·Nq·Nk bytes.
//
// The two products are KvTile's (kv_tile.h) over the whole head as one tile, not BLAS GEMMs:
// at these skinny shapes (an inner dimension, or an output width, of head_dim) they ran faster
// than Debian's OpenBLAS at its best core type, with AVX-512 and with AVX2 forced (docs/perf.md),
// and they need no BLAS library that knows the CPU.
//
// NaiveRows is also the trace's full-matrix reference, so Trace compares the online softmax
// against exactly this computation.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/problem.h"

namespace attn {

// Full-matrix attention for query rows [row_begin, row_begin + rows) of query head `head`, all
// fp32: query [rows, head_dim]; `keys`: its kv head's key_len keys and values packed as one
// KvTile (with the problem's scale). Writes the scaled, transformed (softcap, ALiBi:
// score_transform.h) and masked scores [rows, key_len], the weights
// [rows, key_len], each row's log-sum-exp into lse (when not null; −inf for a row that sees no
// key) and the output [rows, value_dim] into `out`, which must hold rows · AccStride(value_dim)
// floats (the product's own row stride, packed to value_dim columns before NaiveRows returns).
void NaiveRows(const Problem& problem, const float* query, const KvTile& keys, int64_t head,
               int64_t row_begin, int64_t rows, float* scores, float* weights, float* lse,
               float* out);

// Memory for Naive's score and weight matrices, kept from one call for the next. A fresh
// gigabyte costs the operating system's zeroing of every page first (on the development VM a
// call of 2 GiB spent most of its time there, at a speed that varied fivefold: docs/perf.md),
// which no framework's naive path would pay twice for the same size. A block comes in
// transparent huge pages where offered (madvise mode: 512 faults a gigabyte, not 262 144); a
// returned block is kept (one at a time, the larger) and marked MADV_FREE, so the kernel may
// still take its pages back under memory pressure — Naive overwrites every element before
// reading it, so whatever it finds there does not matter. Thread-safe.
class NaiveStorage {
 public:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  using Block = std::unique_ptr<float[], Free>;

  // A block of at least `count` floats (the kept one when it is big enough), or null when the
  // memory is not there.
  Block Take(int64_t count);
  // Gives a block of `count` floats back for a later Take.
  void Give(Block block, int64_t count);

 private:
  std::mutex mutex_;
  Block kept_;              // Guarded by mutex_.
  int64_t kept_count_ = 0;  // Guarded by mutex_.
};

// Full-matrix attention on `pool`, its matrices from `storage`. RESOURCE_EXHAUSTED naming Tiled
// when the score and weight matrices would pass max_naive_bytes or cannot be allocated.
absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_naive_bytes,
                                     NaiveStorage& storage);

}  // namespace attn
