#include "kernels/cpu/naive.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/fp32_rows.h"
#include "kernels/cpu/row_blocks.h"
#include "kernels/online_softmax.h"

namespace attn {

namespace {

// Each score row: the transform (score_transform.h) and the mask (geometry.h), then the full-row
// stable softmax (SoftmaxRow, online_softmax.h: the row max, e^(s − max), the sum, the head's
// sink, the normalization) in lanes of Lanes (void: eight; lanes::Floats16 in the AVX-512 clone).
template <class Lanes>
ATTN_ALWAYS_INLINE void SoftmaxRowsBody(const Problem& problem, int64_t head, int64_t row_begin,
                                        int64_t rows, float* scores, float* weights, float* lse) {
  const int64_t n = problem.shape.key_len;
  const ScoreTransform transform = problem.transform(head);
  const float sink = problem.transforms().Sink(head);
  const Geometry geometry = problem.geometry();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    const KeyRange visible = geometry.Visible(row_begin + r);
    transform.template Apply<std::conditional_t<std::is_void_v<Lanes>, lanes::Floats, Lanes>>(
        s + visible.begin, visible.size(), geometry.Distance(row_begin + r, visible.begin));
    std::fill(s, s + visible.begin, -INFINITY);
    std::fill(s + visible.end, s + n, -INFINITY);
    const OnlineSoftmaxRow row =
        SoftmaxRow<SerialReduce, Lanes>(s, weights + r * n, n, visible, sink, 0, 1);
    if (lse != nullptr) lse[r] = row.LogSumExp();
  }
}

ATTN_CPU_FAST void SoftmaxRowsAvx2(const Problem& problem, int64_t head, int64_t row_begin,
                                   int64_t rows, float* scores, float* weights, float* lse) {
  SoftmaxRowsBody<void>(problem, head, row_begin, rows, scores, weights, lse);
}

#if defined(ATTN_CPU_HAS_AVX512_BUILD)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))) void SoftmaxRowsAvx512(
    const Problem& problem, int64_t head, int64_t row_begin, int64_t rows, float* scores,
    float* weights, float* lse) {
  SoftmaxRowsBody<lanes::Floats16>(problem, head, row_begin, rows, scores, weights, lse);
}
#endif

void SoftmaxRowsPortable(const Problem& problem, int64_t head, int64_t row_begin, int64_t rows,
                         float* scores, float* weights, float* lse) {
  SoftmaxRowsBody<void>(problem, head, row_begin, rows, scores, weights, lse);
}

}  // namespace

NaiveStorage::Block NaiveStorage::Take(int64_t count) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (kept_ && kept_count_ >= count) {
      kept_count_ = 0;
      return std::move(kept_);
    }
  }
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t bytes =
      (static_cast<size_t>(count) * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage;
  void* memory = nullptr;
  if (posix_memalign(&memory, kHugePage, bytes) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
  madvise(memory, bytes, MADV_HUGEPAGE);  // Advice only: without it, ordinary pages.
#endif
  return Block(static_cast<float*>(memory));
}

void NaiveStorage::Give(Block block, int64_t count) {
  if (!block) return;
#if defined(MADV_FREE)
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t bytes =
      (static_cast<size_t>(count) * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage;
  madvise(block.get(), bytes, MADV_FREE);
#endif
  std::lock_guard<std::mutex> lock(mutex_);
  if (count > kept_count_) {  // Keep the larger; the other is freed as `block` goes.
    std::swap(kept_, block);
    kept_count_ = count;
  }
}

void NaiveRows(const Problem& problem, const float* query, const KvTile& keys, int64_t head,
               int64_t row_begin, int64_t rows, float* scores, float* weights, float* lse,
               float* out) {
  const int m = static_cast<int>(rows);
  const int dv = static_cast<int>(problem.shape.value_dim);
  const int stride = AccStride(dv);
  // S = scale · Q Kᵀ, W = softmax(S), O = W V.
  keys.Scores(query, m, scores);
#if defined(ATTN_CPU_HAS_AVX512_BUILD)
  if (CpuHasAvx512()) {
    SoftmaxRowsAvx512(problem, head, row_begin, rows, scores, weights, lse);
  } else
#endif
  {
    (CpuHasAvx2Fma() ? SoftmaxRowsAvx2 : SoftmaxRowsPortable)(problem, head, row_begin, rows,
                                                              scores, weights, lse);
  }
  std::fill(out, out + rows * stride, 0.f);
  keys.Accumulate(weights, m, out);
  // Row r moves down to r · value_dim (in order: a row never overwrites one not yet moved).
  if (stride != dv) {
    for (int64_t r = 1; r < rows; ++r) {
      std::copy(out + r * stride, out + r * stride + dv, out + r * dv);
    }
  }
}

namespace {

struct Worker {
  Fp32Rows query, key, value;
  KvTile head;               // The keys and values of head `packed_head`, packed as one tile.
  int64_t packed_head = -1;  // batch · kv_heads + kv_head; −1: none yet.
  std::vector<float> out, lse;

  // The block's head, packed now or kept from the worker's previous block of the same head.
  const KvTile& Head(const Problem& problem, const RowBlock& block) {
    const Shape& s = problem.shape;
    const int64_t id = block.batch * s.kv_heads + block.kv_head;
    if (id != packed_head) {
      const float* k = key.LoadKeys(problem, block.batch, block.kv_head, 0, s.key_len);
      const float* v = value.LoadValues(problem, block.batch, block.kv_head, 0, s.key_len);
      head.Load(k, v, static_cast<int>(s.key_len), static_cast<int>(s.head_dim),
                static_cast<int>(s.value_dim), problem.scale);
      packed_head = id;
    }
    return head;
  }

  int64_t scratch_bytes() const {
    return query.scratch_bytes() + key.scratch_bytes() + value.scratch_bytes() +
           head.scratch_bytes() +
           static_cast<int64_t>((out.capacity() + lse.capacity()) * sizeof(float));
  }
};

}  // namespace

absl::StatusOr<Stats> NaiveAttention(const Problem& problem, const Outputs& outputs,
                                     ThreadPool& pool, int64_t max_naive_bytes,
                                     NaiveStorage& storage) {
  const Shape& s = problem.shape;
  const int64_t matrix_elements = s.batch * s.heads * s.query_len * s.key_len;
  const int64_t storage_bytes = problem.NaiveStorageBytes();
  if (absl::Status budget = CheckNaiveBudget(problem, max_naive_bytes, "memory"); !budget.ok()) {
    return budget;
  }
  // The two matrices as one block: scores, then weights.
  NaiveStorage::Block matrices = storage.Take(2 * matrix_elements);
  struct GiveBack {
    NaiveStorage& storage;
    NaiveStorage::Block& block;
    int64_t count;
    ~GiveBack() { storage.Give(std::move(block), count); }
  } give_back{storage, matrices, 2 * matrix_elements};
  float* const scores = matrices.get();
  float* const weights = matrices ? scores + matrix_elements : nullptr;
  if (!scores || !weights) {
    return absl::ResourceExhaustedError(absl::StrCat("Naive could not allocate ", storage_bytes,
                                                     " bytes for its score and weight matrices; "
                                                     "use Tiled, which needs no such storage"));
  }

  const RowBlocks blocks(problem);
  const int64_t tasks = blocks.size();
  std::vector<Worker> workers(pool.WorkersFor(tasks));
  const absl::Status run =
      RunInterruptible(pool, tasks, outputs.interrupt, [&](int64_t task, int worker_index) {
        Worker& worker = workers[worker_index];
        const RowBlock block = blocks[task];
        const int64_t rows = block.row_end - block.row_begin;
        const float* query = worker.query.Load(
            problem.query, problem.QueryOffset(block.batch, block.head, block.row_begin),
            rows * s.head_dim);
        const KvTile& head = worker.Head(problem, block);
        const int64_t offset =
            ((block.batch * s.heads + block.head) * s.query_len + block.row_begin) * s.key_len;
        worker.out.resize(rows * AccStride(static_cast<int>(s.value_dim)));
        worker.lse.resize(rows);
        NaiveRows(problem, query, head, block.head, block.row_begin, rows, scores + offset,
                  weights + offset, worker.lse.data(), worker.out.data());
        StoreFloats(worker.out.data(), rows * s.value_dim, outputs.output,
                    problem.OutputOffset(block.batch, block.head, block.row_begin));
        if (outputs.lse != nullptr) {
          std::copy(worker.lse.begin(), worker.lse.end(),
                    outputs.lse + problem.LseOffset(block.batch, block.head, block.row_begin));
        }
      });
  if (!run.ok()) return run;

  Stats stats;
  stats.intermediate_bytes = problem.NaiveIntermediateBytes();
  stats.scratch_bytes = storage_bytes;
  for (const Worker& worker : workers) stats.scratch_bytes += worker.scratch_bytes();
  return stats;
}

}  // namespace attn
