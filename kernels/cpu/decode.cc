#include "kernels/cpu/decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cascade.h"
#include "kernels/cpu/aligned.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/fp32_rows.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/lanes.h"
#include "kernels/online_softmax.h"

namespace attn {
namespace {

// Rows of one merge task (the second pass).
constexpr int64_t kMergeRows = 16;

// One row of a task's GQA group: the keys it sees, its head's score transform, its distance
// p − t to key 0 (Geometry::Distance), and its query row (for a token tree's mask).
struct DecodeRow {
  KeyRange visible;
  ScoreTransform transform;
  int64_t distance = 0;
  int64_t query_row = 0;
};

// A run's rows in segments, each with its own partial states [chunks, rows, 2 + value_dim]
// (max, denominator, accumulator; chunk_stride floats from one chunk's to the next): one segment
// in a problem's run, one per problem in a cascade's.
struct DecodeSegment {
  int64_t first_row = 0, rows = 0;
  float* partial = nullptr;
  int64_t chunk_stride = 0;
};

// One task: a run of consecutive chunks of one kv head's keys for the rows of its GQA group (or,
// in a cascade, of the groups of every problem sharing those keys).
struct DecodeRun {
  const Problem* problem = nullptr;
  const Geometry* geometry = nullptr;  // The problem's.
  int64_t batch = 0, kv_head = 0;
  int64_t rows = 0, head_dim = 0, value_dim = 0;
  const float* queries = nullptr;             // [rows, head_dim], fp32, scale folded in.
  const DecodeRow* row = nullptr;             // [rows]
  int64_t chunk_tokens = kDecodeChunkTokens;  // DecodeChunkTokensOf the problem.
  int64_t first_chunk = 0, chunks = 0;
  KeyRange seen;  // The keys some row sees.
  const DecodeSegment* segments = nullptr;
  int64_t segment_count = 0;
  bool gemm = false;  // A GEMM group (decode.h): one segment.

  // The keys chunk `c` of the run reads (empty: a chunk no row sees).
  KeyRange ChunkKeys(int64_t c) const {
    const int64_t chunk = first_chunk + c;
    return KeyRange{std::max(chunk * chunk_tokens, seen.begin),
                    std::min((chunk + 1) * chunk_tokens, seen.end)};
  }
};

// A tile of a run: keys [begin, begin + n) of the run's chunk `chunk`.
struct DecodeTileKeys {
  int64_t begin = 0;
  int n = 0;
  int64_t chunk = 0;
};

// A worker's buffers, reused across its tasks.
struct DecodeScratch {
  AlignedVector<float> queries, arranged, scores, acc;
  std::vector<DecodeRow> row;
  std::vector<DecodeTileKeys> tiles;
  std::vector<OnlineSoftmaxRow> states;
  std::vector<const void*> key_rows, value_rows;
  // A GEMM group's (decode.h): its tile's rows as fp32, packed.
  Fp32Rows tile_keys, tile_values;
  KvTile tile;

  int64_t bytes() const {
    return static_cast<int64_t>(
        (queries.capacity() + arranged.capacity() + scores.capacity() + acc.capacity()) *
            sizeof(float) +
        tile_keys.scratch_bytes() + tile_values.scratch_bytes() + tile.scratch_bytes() +
        row.capacity() * sizeof(DecodeRow) + tiles.capacity() * sizeof(DecodeTileKeys) +
        states.capacity() * sizeof(OnlineSoftmaxRow) +
        (key_rows.capacity() + value_rows.capacity()) * sizeof(void*));
  }
};

// Where keys and values [begin, begin + n) of a kv head start, in either layout: the one place
// the decode kernel learns the layout (a page's rows are consecutive, so each page segment is
// walked without a division per key).
void KvRowPointers(const Problem& problem, int64_t batch, int64_t kv_head, int64_t begin, int n,
                   const void** keys, const void** values) {
  const Shape& s = problem.shape;
  if (problem.pages == nullptr) {
    const char* k = static_cast<const char*>(problem.key.data) +
                    problem.KeyOffset(batch, kv_head, begin) * ElementSize(problem.key.dtype);
    const char* v = static_cast<const char*>(problem.value.data) +
                    problem.ValueOffset(batch, kv_head, begin) * ElementSize(problem.value.dtype);
    const int64_t key_row = s.head_dim * ElementSize(problem.key.dtype);
    const int64_t value_row = s.value_dim * ElementSize(problem.value.dtype);
    for (int j = 0; j < n; ++j) {
      keys[j] = k + j * key_row;
      values[j] = v + j * value_row;
    }
    return;
  }
  const PagedKv& pages = *problem.pages;
  const int64_t element = ElementSize(pages.dtype);
  const int64_t key_row = pages.key_width * element, value_row = pages.value_width * element;
  for (int j = 0; j < n;) {
    const int64_t token = begin + j;
    const int segment =
        static_cast<int>(std::min<int64_t>(pages.page_tokens - token % pages.page_tokens, n - j));
    const char* k = static_cast<const char*>(pages.KeyPage(token)) +
                    pages.KeyOffsetInPage(kv_head, token) * element;
    const char* v = static_cast<const char*>(pages.ValuePage(token)) +
                    pages.ValueOffsetInPage(kv_head, token) * element;
    for (int i = 0; i < segment; ++i) {
      keys[j + i] = k + i * key_row;
      values[j + i] = v + i * value_row;
    }
    j += segment;
  }
}

// The loops three times: for the portable baseline, AVX2 + FMA and AVX-512 (16 lanes), the
// last two inside pragma regions as kv_tile.cc's are (the same reason: broadcasts from memory).
namespace portable {
using Floats = lanes::Floats;
using UInts = lanes::UInts;
constexpr int kLanes = 8;
#define ATTN_DECODE_ISA 0
#include "kernels/cpu/decode_kernels.inc"
#undef ATTN_DECODE_ISA
}  // namespace portable

#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
namespace avx2 {
using Floats = lanes::Floats;
using UInts = lanes::UInts;
constexpr int kLanes = 8;
#define ATTN_DECODE_ISA 1
#include "kernels/cpu/decode_kernels.inc"
#undef ATTN_DECODE_ISA
}  // namespace avx2
#pragma clang attribute pop
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
    apply_to = function)
namespace avx512 {
using Floats = lanes::Floats16;
using UInts = lanes::UInts16;
constexpr int kLanes = 16;
#define ATTN_DECODE_ISA 2
#include "kernels/cpu/decode_kernels.inc"
#undef ATTN_DECODE_ISA
}  // namespace avx512
#pragma clang attribute pop
#define ATTN_DECODE_X86 1
#elif defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using Floats = lanes::Floats;
using UInts = lanes::UInts;
constexpr int kLanes = 8;
#define ATTN_DECODE_ISA 1
#include "kernels/cpu/decode_kernels.inc"
#undef ATTN_DECODE_ISA
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace avx512 {
using Floats = lanes::Floats16;
using UInts = lanes::UInts16;
constexpr int kLanes = 16;
#define ATTN_DECODE_ISA 2
#include "kernels/cpu/decode_kernels.inc"
#undef ATTN_DECODE_ISA
}  // namespace avx512
#pragma GCC pop_options
#define ATTN_DECODE_X86 1
#endif

template <DType kDtype>
void RunDispatched(const DecodeRun& run, DecodeScratch& scratch) {
#if defined(ATTN_DECODE_X86)
  if (CpuHasAvx512()) return avx512::RunChunks<kDtype>(run, scratch);
  if (CpuHasAvx2Fma()) return avx2::RunChunks<kDtype>(run, scratch);
#endif
  portable::RunChunks<kDtype>(run, scratch);
}

void RunChunks(DType dtype, const DecodeRun& run, DecodeScratch& scratch) {
  if (run.gemm) {  // A GEMM group: any dtype, converted a tile at a time.
#if defined(ATTN_DECODE_X86)
    if (CpuHasAvx512()) return avx512::RunGemmChunks(run, scratch);
    if (CpuHasAvx2Fma()) return avx2::RunGemmChunks(run, scratch);
#endif
    return portable::RunGemmChunks(run, scratch);
  }
  switch (dtype) {
    case DType::kFloat32:
      return RunDispatched<DType::kFloat32>(run, scratch);
    case DType::kFloat16:
      return RunDispatched<DType::kFloat16>(run, scratch);
    case DType::kBFloat16:
      return RunDispatched<DType::kBFloat16>(run, scratch);
    case DType::kFloat8E4M3:
      return RunDispatched<DType::kFloat8E4M3>(run, scratch);
  }
}

// One problem's place in the batch's task list and partial states.
struct Item {
  const Problem* problem = nullptr;
  const Outputs* outputs = nullptr;
  int64_t rows = 0, chunks = 0, heads = 0;  // heads: batch · kv_heads; chunks: per head.
  int64_t chunk_tokens = kDecodeChunkTokens;
  int64_t shared_chunks = 0;  // Its first chunks, run by its cascade's tasks.
  int64_t runs = 0;           // Tasks per head (of its other chunks).
  int64_t first_task = 0, first_merge = 0, partial_offset = 0;
  int64_t merge_blocks = 0;  // Per head: its rows in blocks of kMergeRows.
};

// Problems of the batch whose caches share their first pages (forks of one prompt: ForkCache),
// whose first `chunks` chunks run as one task list for all their rows (cascade attention, as
// FlashInfer calls it): each key of those pages read once per step, not once per problem.
struct Cascade : CascadeGroup {  // Its members are items.
  int64_t kv_heads = 0;
  int64_t runs = 0, first_task = 0;
};

// Rows a cascade stacks at most (its scratch grows with them).
constexpr int64_t kCascadeMaxRows = 1024;

// The rows of one (problem, batch, kv head): the query rows of its GQA group (scaled, fp32) into
// queries and their DecodeRows into rows, from index `at` on; their union of visible keys widens
// *seen.
void GroupRows(const Problem& p, const Geometry& geometry, int64_t batch, int64_t kv_head,
               int64_t rows, int64_t at, AlignedVector<float>& queries, std::vector<DecodeRow>& row,
               KeyRange* seen) {
  const Shape& s = p.shape;
  const int64_t group = QueryHeadsPerKvHead(s.heads, s.kv_heads);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = r % s.query_len;
    row[at + r] = DecodeRow{geometry.Visible(q), p.transform(kv_head * group + r / s.query_len),
                            geometry.Distance(q, 0), q};
    const KeyRange& visible = row[at + r].visible;
    if (visible.size() == 0) continue;
    seen->begin = std::min(seen->begin, visible.begin);
    seen->end = std::max(seen->end, visible.end);
  }
  float* to = queries.data() + at * s.head_dim;
  ConvertToFloat(static_cast<const char*>(p.query.data) +
                     p.QueryOffset(batch, kv_head * group, 0) * ElementSize(p.query.dtype),
                 p.query.dtype, rows * s.head_dim, to);
  for (int64_t i = 0; i < rows * s.head_dim; ++i) to[i] *= p.scale;
}

// The chunks a problem may run in a cascade: those every row sees whole, from key 0
// (KeysEveryRowSees: so that its tiles there are the ones its own run would take), on the vector
// path; 0 when it may not.
int64_t CascadableChunks(const Item& item) {
  if (item.rows > kDecodeMaxRows) return 0;
  return KeysEveryRowSees(*item.problem) / item.chunk_tokens;
}

// The batch's cascades (PlanCascades, kernels/cascade.h), at most kCascadeMaxRows rows each.
// Sets their items' shared_chunks.
std::vector<Cascade> CascadesOf(std::vector<Item>& items) {
  std::vector<const Problem*> problems;
  std::vector<int64_t> cascadable, chunk_tokens, rows;
  for (const Item& item : items) {
    problems.push_back(item.problem);
    cascadable.push_back(CascadableChunks(item));
    chunk_tokens.push_back(item.chunk_tokens);
    rows.push_back(item.rows);
  }
  std::vector<Cascade> cascades;
  for (CascadeGroup& group :
       PlanCascades(problems, cascadable, chunk_tokens, rows, kCascadeMaxRows)) {
    Cascade cascade;
    static_cast<CascadeGroup&>(cascade) = std::move(group);
    cascade.kv_heads = items[cascade.members[0]].problem->shape.kv_heads;
    for (size_t i : cascade.members) items[i].shared_chunks = cascade.chunks;
    cascades.push_back(std::move(cascade));
  }
  return cascades;
}

}  // namespace

absl::StatusOr<Stats> DecodeAttention(const std::vector<const Problem*>& problems,
                                      const std::vector<const Outputs*>& outputs,
                                      ThreadPool& pool) {
  std::vector<Item> items;
  int64_t merges = 0, partial_floats = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = *problems[i];
    Item item;
    item.problem = &p;
    item.outputs = outputs[i];
    item.rows = DecodeRowsOf(p);
    item.chunk_tokens = DecodeChunkTokensOf(item.rows, p.shape.key_len);
    item.chunks =
        std::max<int64_t>(1, (p.shape.key_len + item.chunk_tokens - 1) / item.chunk_tokens);
    item.heads = p.shape.batch * p.shape.kv_heads;
    item.merge_blocks = (item.rows + kMergeRows - 1) / kMergeRows;
    item.first_merge = merges;
    item.partial_offset = partial_floats;
    merges += item.heads * item.merge_blocks;
    partial_floats += item.heads * item.chunks * item.rows * (p.shape.value_dim + 2);
    items.push_back(item);
  }
  std::vector<Cascade> cascades = CascadesOf(items);
  // Chunks per task: as many as leave every worker kDecodeTasksPerWorker tasks, at most
  // kDecodeMaxRunChunks (a run never spans two heads). Runs only group the chunks, so they may
  // depend on the thread count.
  int64_t all_chunks = 0;
  for (const Item& item : items) all_chunks += item.heads * (item.chunks - item.shared_chunks);
  for (const Cascade& cascade : cascades) all_chunks += cascade.kv_heads * cascade.chunks;
  const int64_t run_chunks = std::clamp<int64_t>(
      all_chunks / (kDecodeTasksPerWorker * pool.threads()), 1, kDecodeMaxRunChunks);
  int64_t tasks = 0;
  for (Item& item : items) {
    item.runs = (item.chunks - item.shared_chunks + run_chunks - 1) / run_chunks;
    item.first_task = tasks;
    tasks += item.heads * item.runs;
  }
  const int64_t first_cascade_task = tasks;
  for (Cascade& cascade : cascades) {
    cascade.runs = (cascade.chunks + run_chunks - 1) / run_chunks;
    cascade.first_task = tasks;
    tasks += cascade.kv_heads * cascade.runs;
  }
  std::vector<float> partials(partial_floats);
  // Every item's interrupt, asked between tasks.
  auto interrupt = [&]() -> absl::Status {
    for (const Outputs* o : outputs) {
      if (absl::Status status = o->CheckInterrupt(); !status.ok()) return status;
    }
    return absl::OkStatus();
  };
  const bool any_interrupt = std::any_of(outputs.begin(), outputs.end(),
                                         [](const Outputs* o) { return bool(o->interrupt); });
  const std::function<absl::Status()> interrupt_fn =
      any_interrupt ? std::function<absl::Status()>(interrupt) : nullptr;

  // The item (or cascade) holding task (or merge task) `index`: the last whose first one is ≤
  // index.
  auto item_of = [&](int64_t index, int64_t Item::*first) -> const Item& {
    const auto it =
        std::upper_bound(items.begin(), items.end(), index,
                         [first](int64_t x, const Item& item) { return x < item.*first; });
    return *(it - 1);
  };
  auto cascade_of = [&](int64_t index) -> const Cascade& {
    const auto it =
        std::upper_bound(cascades.begin(), cascades.end(), index,
                         [](int64_t x, const Cascade& cascade) { return x < cascade.first_task; });
    return *(it - 1);
  };
  // Item i's partial states of head `head` from chunk `chunk` on: its segment of a run.
  auto segment_of = [&](const Item& item, int64_t head, int64_t chunk, int64_t first_row) {
    const int64_t stride = item.rows * (item.problem->shape.value_dim + 2);
    return DecodeSegment{
        first_row, item.rows,
        partials.data() + item.partial_offset + (head * item.chunks + chunk) * stride, stride};
  };

  std::vector<DecodeScratch> workers(pool.WorkersFor(tasks));
  std::vector<std::vector<DecodeSegment>> worker_segments(workers.size());
  absl::Status status = RunInterruptible(pool, tasks, interrupt_fn, [&](int64_t task, int worker) {
    DecodeScratch& scratch = workers[worker];
    std::vector<DecodeSegment>& segments = worker_segments[worker];
    segments.clear();
    DecodeRun run;
    Geometry geometry;
    KeyRange& seen = run.seen;
    seen = KeyRange{std::numeric_limits<int64_t>::max(), 0};
    if (task < first_cascade_task) {
      const Item& item = item_of(task, &Item::first_task);
      const Problem& p = *item.problem;
      const Shape& s = p.shape;
      const int64_t local = task - item.first_task;
      const int64_t head = local / item.runs, run_index = local % item.runs;
      run.problem = &p;
      run.batch = head / s.kv_heads;
      run.kv_head = head % s.kv_heads;
      run.rows = item.rows;
      run.head_dim = s.head_dim;
      run.value_dim = s.value_dim;
      run.chunk_tokens = item.chunk_tokens;
      run.first_chunk = item.shared_chunks + run_index * run_chunks;
      run.chunks = std::min(run_chunks, item.chunks - run.first_chunk);
      run.gemm = item.rows > kDecodeMaxRows;
      segments.push_back(segment_of(item, head, run.first_chunk, 0));
      geometry = p.geometry();
      scratch.row.resize(item.rows);
      scratch.queries.resize(item.rows * s.head_dim);
      GroupRows(p, geometry, run.batch, run.kv_head, item.rows, 0, scratch.queries, scratch.row,
                &seen);
    } else {
      // A cascade's run: every member's rows of one kv head over the shared chunks, a segment
      // each, the keys read through the first member's pages (the same pages there).
      const Cascade& cascade = cascade_of(task);
      const int64_t local = task - cascade.first_task;
      const Item& first = items[cascade.members[0]];
      const Shape& s = first.problem->shape;
      run.problem = first.problem;
      run.kv_head = local / cascade.runs;
      run.rows = cascade.rows;
      run.head_dim = s.head_dim;
      run.value_dim = s.value_dim;
      run.first_chunk = local % cascade.runs * run_chunks;
      run.chunks = std::min(run_chunks, cascade.chunks - run.first_chunk);
      geometry = first.problem->geometry();  // Its rows' masks are in their DecodeRows.
      scratch.row.resize(cascade.rows);
      scratch.queries.resize(cascade.rows * s.head_dim);
      int64_t at = 0;
      for (size_t i : cascade.members) {
        const Item& item = items[i];
        segments.push_back(segment_of(item, run.kv_head, run.first_chunk, at));
        GroupRows(*item.problem, item.problem->geometry(), 0, run.kv_head, item.rows, at,
                  scratch.queries, scratch.row, &seen);
        at += item.rows;
      }
    }
    if (seen.begin > seen.end) seen = KeyRange{0, 0};
    run.row = scratch.row.data();
    run.geometry = &geometry;
    run.queries = scratch.queries.data();
    run.segments = segments.data();
    run.segment_count = static_cast<int64_t>(segments.size());
    const int64_t rows = run.rows;
    if (!run.gemm) scratch.arranged.resize(rows * run.head_dim);
    scratch.scores.resize(rows * std::max(kDecodeTile, kDecodeGemmTile));
    scratch.acc.resize(rows * AccStride(static_cast<int>(run.value_dim)));
    scratch.states.resize(rows);
    if (!run.gemm) {  // A ring of tiles' row pointers.
      constexpr int kMostAhead = std::max(kDecodePrefetchTiles, kDecodeFp8PrefetchTiles);
      scratch.key_rows.resize((kMostAhead + 1) * kDecodeTile);
      scratch.value_rows.resize((kMostAhead + 1) * kDecodeTile);
    }
    // The kernel reads keys and values of one dtype: the keys' (both layouts the server builds
    // give the values the same).
    RunChunks(run.problem->key_dtype(), run, scratch);
  });
  if (!status.ok()) return status;

  // Each row's chunk states merged in chunk order, its head's sink added, normalized and stored as
  // Tiled stores them: a task per block of kMergeRows rows of a head (a GEMM group's many rows
  // merge in parallel).
  std::vector<std::vector<float>> merged(pool.WorkersFor(merges));
  status = RunInterruptible(pool, merges, interrupt_fn, [&](int64_t index, int worker) {
    const Item& item = item_of(index, &Item::first_merge);
    const Problem& p = *item.problem;
    const Shape& s = p.shape;
    const int64_t head = (index - item.first_merge) / item.merge_blocks;
    const int64_t row_begin = (index - item.first_merge) % item.merge_blocks * kMergeRows;
    const int64_t rows = std::min(kMergeRows, item.rows - row_begin);
    const int64_t batch = head / s.kv_heads, kv_head = head % s.kv_heads;
    const int64_t dv = s.value_dim, stride = item.rows * (dv + 2);
    const float* first = partials.data() + item.partial_offset + head * item.chunks * stride;
    std::vector<float>& out = merged[worker];
    out.resize(rows * dv + rows);
    float* lse = out.data() + rows * dv;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = row_begin + i;
      float* acc = out.data() + i * dv;
      const float* own = first + r * (dv + 2);
      OnlineSoftmaxRow state;
      state.max = own[0];
      state.denominator = own[1];
      std::copy(own + 2, own + 2 + dv, acc);
      for (int64_t c = 1; c < item.chunks; ++c) {
        const float* other_state = first + c * stride + r * (dv + 2);
        OnlineSoftmaxRow other;
        other.max = other_state[0];
        other.denominator = other_state[1];
        state.MergeInto(other, other_state + 2, acc, dv);
      }
      const int64_t group = QueryHeadsPerKvHead(s.heads, s.kv_heads);
      const float factor = state.AddSink(p.transforms().Sink(kv_head * group + r / s.query_len));
      for (int64_t c = 0; c < dv; ++c) acc[c] = state.Normalize(acc[c] * factor);
      lse[i] = state.LogSumExp();
    }
    // The group's rows are consecutive in the output and lse, from its first head's row 0.
    const int64_t group = QueryHeadsPerKvHead(s.heads, s.kv_heads);
    StoreFloats(out.data(), rows * dv, item.outputs->output,
                p.OutputOffset(batch, kv_head * group, 0) + row_begin * dv);
    if (item.outputs->lse != nullptr) {
      std::copy(lse, lse + rows,
                item.outputs->lse + p.LseOffset(batch, kv_head * group, 0) + row_begin);
    }
  });
  if (!status.ok()) return status;

  Stats stats;
  stats.block_k = kDecodeTile;
  for (const Item& item : items) stats.flops += item.problem->Flops();
  stats.scratch_bytes = static_cast<int64_t>(partials.capacity() * sizeof(float));
  for (const DecodeScratch& worker : workers) stats.scratch_bytes += worker.bytes();
  for (const std::vector<float>& out : merged) {
    stats.scratch_bytes += static_cast<int64_t>(out.capacity() * sizeof(float));
  }
  return stats;
}

}  // namespace attn
