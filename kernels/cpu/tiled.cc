#include "kernels/cpu/tiled.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/aligned.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/fp32_rows.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/row_blocks.h"

namespace attn {

namespace {

// V: the lanes of the softmax's vector loops (lanes::Floats, or lanes::Floats16 under AVX-512).
template <class V>
ATTN_ALWAYS_INLINE void VisitKeyTileRowsBody(const Problem& problem, int64_t head,
                                             int64_t row_begin, int64_t rows, int64_t key_begin,
                                             int n, float* scores, float* acc, int acc_stride,
                                             OnlineSoftmaxRow* states, float* rescales) {
  const int64_t dv = problem.shape.value_dim;
  const ScoreTransform transform = problem.transform(head);
  const Geometry geometry = problem.geometry();
  // Each row's visible keys and distance found only where they matter (unmasked, a row sees
  // every key; untransformed, no score reads the distance): finding them copies the geometry,
  // which cost a few percent of an unmasked plain problem's softmax (docs/perf.md).
  const bool transformed = !transform.Identity(), masked = geometry.Masked();
  const KeyRange every_key{0, geometry.key_len};
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r;
    float* s = scores + r * n;
    ScoresOrHidden<V>(transform, masked ? geometry.Visible(row) : every_key,
                      transformed ? geometry.Distance(row, 0) : 0, key_begin, n, s);
    geometry.MaskTreeTile(row, key_begin, n, s);  // A Decode item's token tree, if any.
    const float rescale = states[r].template VisitTile<V>(s, n, s);
    if (rescales != nullptr) rescales[r] = rescale;
    float* a = acc + r * acc_stride;
    OnlineSoftmaxRow::RescaleAccumulator(rescale, static_cast<int>(dv),
                                         [a](int c) -> float& { return a[c]; });
  }
}

ATTN_CPU_FAST void VisitKeyTileRowsAvx2(const Problem& problem, int64_t head, int64_t row_begin,
                                        int64_t rows, int64_t key_begin, int n, float* scores,
                                        float* acc, int acc_stride, OnlineSoftmaxRow* states,
                                        float* rescales) {
  VisitKeyTileRowsBody<lanes::Floats>(problem, head, row_begin, rows, key_begin, n, scores, acc,
                                      acc_stride, states, rescales);
}

#if defined(ATTN_CPU_HAS_AVX512_BUILD)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))) void VisitKeyTileRowsAvx512(
    const Problem& problem, int64_t head, int64_t row_begin, int64_t rows, int64_t key_begin, int n,
    float* scores, float* acc, int acc_stride, OnlineSoftmaxRow* states, float* rescales) {
  VisitKeyTileRowsBody<lanes::Floats16>(problem, head, row_begin, rows, key_begin, n, scores, acc,
                                        acc_stride, states, rescales);
}
#endif

void VisitKeyTileRowsPortable(const Problem& problem, int64_t head, int64_t row_begin, int64_t rows,
                              int64_t key_begin, int n, float* scores, float* acc, int acc_stride,
                              OnlineSoftmaxRow* states, float* rescales) {
  VisitKeyTileRowsBody<lanes::Floats>(problem, head, row_begin, rows, key_begin, n, scores, acc,
                                      acc_stride, states, rescales);
}

}  // namespace

namespace {

ATTN_CPU_FAST void TransformTileAvx2(const ScoreTransform& transform, float* scores, int n,
                                     int64_t distance) {
  transform.Apply<lanes::Floats>(scores, n, distance);
}

#if defined(ATTN_CPU_HAS_AVX512_BUILD)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))) void TransformTileAvx512(
    const ScoreTransform& transform, float* scores, int n, int64_t distance) {
  transform.Apply<lanes::Floats16>(scores, n, distance);
}
#endif

void TransformTilePortable(const ScoreTransform& transform, float* scores, int n,
                           int64_t distance) {
  transform.Apply<lanes::Floats>(scores, n, distance);
}

}  // namespace

void TransformTile(const Problem& problem, int64_t head, int64_t row, int64_t key_begin,
                   float* scores, int n) {
  const ScoreTransform transform = problem.transform(head);
  if (transform.Identity()) return;
  const int64_t distance = problem.geometry().Distance(row, key_begin);
#if defined(ATTN_CPU_HAS_AVX512_BUILD)
  if (CpuHasAvx512()) return TransformTileAvx512(transform, scores, n, distance);
#endif
  (CpuHasAvx2Fma() ? TransformTileAvx2 : TransformTilePortable)(transform, scores, n, distance);
}

void VisitKeyTileRows(const Problem& problem, int64_t head, int64_t row_begin, int64_t rows,
                      int64_t key_begin, int n, float* scores, float* acc, int acc_stride,
                      OnlineSoftmaxRow* states, float* rescales) {
#if defined(ATTN_CPU_HAS_AVX512_BUILD)
  if (CpuHasAvx512()) {
    return VisitKeyTileRowsAvx512(problem, head, row_begin, rows, key_begin, n, scores, acc,
                                  acc_stride, states, rescales);
  }
#endif
  (CpuHasAvx2Fma() ? VisitKeyTileRowsAvx2 : VisitKeyTileRowsPortable)(
      problem, head, row_begin, rows, key_begin, n, scores, acc, acc_stride, states, rescales);
}

namespace {

struct Worker {
  Fp32Rows query, key, value;
  std::vector<KvTile> tiles;    // tiles[t]: tile t of head `packed_head` where packed[t].
  std::vector<uint8_t> packed;  // [tiles]
  int64_t packed_head = -1;     // batch · kv_heads + kv_head; −1: none.
  AlignedVector<float> scores;  // [rows, block_k]: scores, then weights in place.
  AlignedVector<float> acc;     // [rows, AccStride(value_dim)]: the running weighted sums.
  std::vector<float> lse;       // [rows]
  std::vector<OnlineSoftmaxRow> states;

  // Tile `tile` (n keys) of the block's head: packed now, or kept from an earlier block of the
  // same head. A head whose packed tiles would pass max_packed_head_bytes is packed again for
  // every block, one tile at a time.
  const KvTile& Tile(const Problem& problem, const RowBlock& block, int64_t tile, int n,
                     int64_t max_packed_head_bytes) {
    const Shape& s = problem.shape;
    const int d = static_cast<int>(s.head_dim);
    const int dv = static_cast<int>(s.value_dim);
    const bool keep =
        problem.TilesPerRow() * KvTile::PackedBytes(static_cast<int>(problem.block_k), d, dv) <=
        max_packed_head_bytes;
    const int64_t head = block.batch * s.kv_heads + block.kv_head;
    const size_t slot = keep ? static_cast<size_t>(tile) : 0;
    if (tiles.size() <= slot) tiles.resize(slot + 1);
    if (packed.size() < tiles.size()) packed.resize(tiles.size(), 0);
    if (!keep || head != packed_head) {
      packed_head = keep ? head : -1;
      std::fill(packed.begin(), packed.end(), 0);
    }
    if (!packed[slot]) {
      const int64_t key_begin = tile * problem.block_k;
      const float* k = key.LoadKeys(problem, block.batch, block.kv_head, key_begin, n);
      const float* v = value.LoadValues(problem, block.batch, block.kv_head, key_begin, n);
      tiles[slot].Load(k, v, n, d, dv, problem.scale);
      packed[slot] = keep ? 1 : 0;
    }
    return tiles[slot];
  }

  int64_t scratch_bytes() const {
    int64_t bytes = query.scratch_bytes() + key.scratch_bytes() + value.scratch_bytes();
    for (const KvTile& tile : tiles) bytes += tile.scratch_bytes();
    return bytes + static_cast<int64_t>((scores.capacity() + acc.capacity() + lse.capacity()) *
                                            sizeof(float) +
                                        states.capacity() * sizeof(OnlineSoftmaxRow));
  }
};

// One block of query rows of one (batch, head) over every key tile it can see.
void TiledBlock(const Problem& problem, const Outputs& outputs, const RowBlock& block,
                int64_t max_packed_head_bytes, Worker& worker) {
  const Shape& s = problem.shape;
  const int d = static_cast<int>(s.head_dim);
  const int dv = static_cast<int>(s.value_dim);
  const int acc_stride = AccStride(dv);
  const int64_t rows = block.row_end - block.row_begin;
  const int m = static_cast<int>(rows);
  const float* query = worker.query.Load(
      problem.query, problem.QueryOffset(block.batch, block.head, block.row_begin), rows * d);
  worker.scores.resize(rows * problem.block_k);
  worker.acc.assign(rows * acc_stride, 0.f);
  worker.states.assign(rows, OnlineSoftmaxRow{});
  // The tiles some row of the block sees: the others are hidden from every row.
  const KeyRange tiles = problem.VisitedTiles(block.row_begin, block.row_end - 1);
  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    const int64_t key_begin = tile * problem.block_k;
    const int n = static_cast<int>(std::min<int64_t>(problem.block_k, s.key_len - key_begin));
    const KvTile& kv_tile = worker.Tile(problem, block, tile, n, max_packed_head_bytes);
    kv_tile.Scores(query, m, worker.scores.data());
    VisitKeyTileRows(problem, block.head, block.row_begin, rows, key_begin, n, worker.scores.data(),
                     worker.acc.data(), acc_stride, worker.states.data());
    kv_tile.Accumulate(worker.scores.data(), m, worker.acc.data());
  }
  // Normalized rows (the head's sink added), packed to value_dim columns in place (row r moves
  // down to r · dv).
  worker.lse.resize(rows);
  const float sink = problem.transforms().Sink(block.head);
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = worker.acc.data() + r * acc_stride;
    float* out = worker.acc.data() + r * dv;
    const float factor = worker.states[r].AddSink(sink);
    for (int c = 0; c < dv; ++c) out[c] = worker.states[r].Normalize(a[c] * factor);
    worker.lse[r] = worker.states[r].LogSumExp();
  }
  StoreFloats(worker.acc.data(), rows * dv, outputs.output,
              problem.OutputOffset(block.batch, block.head, block.row_begin));
  if (outputs.lse != nullptr) {
    std::copy(worker.lse.begin(), worker.lse.end(),
              outputs.lse + problem.LseOffset(block.batch, block.head, block.row_begin));
  }
}

}  // namespace

absl::StatusOr<Stats> TiledAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_packed_head_bytes) {
  const RowBlocks blocks(problem);
  const int64_t tasks = blocks.size();
  std::vector<Worker> workers(pool.WorkersFor(tasks));
  const absl::Status run =
      RunInterruptible(pool, tasks, outputs.interrupt, [&](int64_t task, int worker) {
        TiledBlock(problem, outputs, blocks[task], max_packed_head_bytes, workers[worker]);
      });
  if (!run.ok()) return run;

  Stats stats;
  for (const Worker& worker : workers) stats.scratch_bytes += worker.scratch_bytes();
  return stats;
}

}  // namespace attn
