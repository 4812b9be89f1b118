// Trace on every backend of the binary (tests/backend_suite.h): every recorded step must obey
// the online-softmax recurrence of DESIGN.md ("One update step"), recomputed here in double from
// the step's own inputs, and every row must end with its last estimate beside the full-matrix
// reference, both within 1e-5 of float64 — and, where the backend's Trace and Tiled share their
// arithmetic (SuiteTraits::trace_is_tiled_bit_for_bit), with exactly Tiled's output and lse.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <variant>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/online_softmax.h"
#include "kernels/problem.h"
#include "tests/backend_suite.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

constexpr double kEps = FLT_EPSILON;

std::vector<TraceItem> CollectTrace(Backend& backend, const Problem& problem,
                                    const std::vector<RowRef>& rows) {
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, rows);
  EXPECT_TRUE(cursor.ok()) << cursor.status();
  std::vector<TraceItem> items;
  if (!cursor.ok()) return items;
  TraceItem item;
  while ((*cursor)->Next(&item)) {
    items.push_back(item);
    if (items.size() > 100000) {
      ADD_FAILURE() << "trace does not end";
      break;
    }
  }
  EXPECT_FALSE((*cursor)->Next(&item)) << "Next after the end must keep returning false";
  EXPECT_EQ((*cursor)->stats().block_k, problem.block_k);
  return items;
}

void ExpectWithin(double actual, double expected, double tolerance, const char* what, int tile,
                  int64_t index) {
  EXPECT_LE(std::abs(actual - expected), tolerance)
      << what << " at tile " << tile << " index " << index << ": " << actual << " vs " << expected;
}

// Checks the steps and the RowDone of one traced row against the recurrence and the reference,
// and, when `tiled` is not null, against Tiled's output and lse bit for bit. `items` is the row's
// slice of the trace.
void CheckRow(const HostProblem& host, const Problem& problem, const RowRef& ref,
              const std::vector<TraceItem>& items, const Reference& reference,
              const KernelRun* tiled) {
  SCOPED_TRACE(::testing::Message()
               << "row b=" << ref.batch << " h=" << ref.head << " i=" << ref.row);
  const Shape& s = host.shape;
  const int64_t block_k = problem.block_k;
  const auto [first_tile, end_tile] = ReferenceTiles(host, ref.row, block_k);
  const int64_t expected_tiles = end_tile - first_tile;
  ASSERT_EQ(static_cast<int64_t>(items.size()), expected_tiles + 1);

  const int64_t kv_head = ref.head / (s.heads / s.kv_heads);
  ASSERT_EQ(problem.KvHead(ref.head), kv_head);
  const float* q =
      &host.query[((ref.batch * s.heads + ref.head) * s.query_len + ref.row) * s.head_dim];
  const float* k = &host.key[(ref.batch * s.kv_heads + kv_head) * s.key_len * s.head_dim];
  const float* v = &host.value[(ref.batch * s.kv_heads + kv_head) * s.key_len * s.value_dim];

  // A score's head_dim products summed one by one in fp32 err by at most (d + 1)·eps of
  // scale · Σ|q_c k_c|, the magnitude the rounding scales with; never looser than 1e-5 (which
  // the bound passes only from head_dim 83 on).
  const double score_rtol = std::max(1e-5, double(s.head_dim + 2) * kEps);
  // exp of a float argument x ≤ 0: expf is good to an ulp or two; the argument itself (a
  // difference of two floats) carries up to half an ulp of |x|, a relative |x|·eps in the result.
  auto exp_tolerance = [](double x, double expected) {
    return 4 * kEps * (1 + std::abs(x)) * expected + 1e-38;
  };

  float prev_max = -INFINITY;
  float prev_denominator = 0.f;
  std::vector<float> prev_acc(s.value_dim, 0.f);
  for (int64_t t = 0; t < expected_tiles; ++t) {
    ASSERT_TRUE(std::holds_alternative<TraceStep>(items[t])) << "item " << t;
    const TraceStep& step = std::get<TraceStep>(items[t]);
    const int tile = static_cast<int>(first_tile + t);
    EXPECT_EQ(step.row.batch, ref.batch);
    EXPECT_EQ(step.row.head, ref.head);
    EXPECT_EQ(step.row.row, ref.row);
    EXPECT_EQ(step.tile, tile);
    EXPECT_EQ(step.key_begin, tile * block_k);
    EXPECT_EQ(step.key_end, std::min(tile * block_k + block_k, s.key_len));
    const int64_t n = step.key_end - step.key_begin;
    ASSERT_GT(n, 0);
    ASSERT_EQ(static_cast<int64_t>(step.scores.size()), n);
    ASSERT_EQ(static_cast<int64_t>(step.weights.size()), n);
    ASSERT_EQ(static_cast<int64_t>(step.accumulator.size()), s.value_dim);
    ASSERT_EQ(static_cast<int64_t>(step.estimate.size()), s.value_dim);

    // Scores: scale · q·k in double where visible, −inf where masked.
    int64_t tile_visible = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = step.key_begin + j;
      if (!ReferenceSees(host, ref.row, key)) {
        EXPECT_EQ(step.scores[j], -INFINITY) << "masked key " << key;
        continue;
      }
      ++tile_visible;
      double dot = 0, magnitude = 0;
      for (int64_t c = 0; c < s.head_dim; ++c) {
        dot += double(q[c]) * double(k[key * s.head_dim + c]);
        magnitude += std::abs(double(q[c]) * double(k[key * s.head_dim + c]));
      }
      const double scale = host.scale;
      ExpectWithin(step.scores[j], scale * dot, score_rtol * scale * magnitude + 1e-30, "score",
                   tile, j);
    }
    EXPECT_GT(tile_visible, 0) << "a tile the mask hides entirely was emitted";

    // Running max: exact, since max involves no rounding; −inf before the first tile.
    EXPECT_EQ(step.max_before, prev_max);
    float tile_max = -INFINITY;
    for (float score : step.scores) tile_max = std::max(tile_max, score);
    EXPECT_EQ(step.max_after, std::max(step.max_before, tile_max));
    ASSERT_TRUE(std::isfinite(step.max_after));

    if (step.max_before == -INFINITY) {
      EXPECT_EQ(step.rescale, 0.f) << "tile " << t;
    } else {
      const double x = double(step.max_before) - double(step.max_after);
      ExpectWithin(step.rescale, std::exp(x), exp_tolerance(x, std::exp(x)), "rescale", tile, 0);
    }
    double weight_sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (step.scores[j] == -INFINITY) {
        EXPECT_EQ(step.weights[j], 0.f) << "masked weight " << j;
      } else {
        const double x = double(step.scores[j]) - double(step.max_after);
        ExpectWithin(step.weights[j], std::exp(x), exp_tolerance(x, std::exp(x)), "weight", tile,
                     j);
      }
      weight_sum += step.weights[j];
    }

    // Denominator and accumulator from the recorded weights and rescale: the only error left is
    // fp32 summation of n + 1 terms, at most (n + 2)·eps times the sum of their magnitudes.
    const double sum_tolerance = double(n + 2) * kEps;
    const double denominator = double(prev_denominator) * step.rescale + weight_sum;
    ExpectWithin(step.denominator, denominator, sum_tolerance * denominator, "denominator", tile,
                 0);
    for (int64_t c = 0; c < s.value_dim; ++c) {
      double acc = double(prev_acc[c]) * step.rescale;
      double magnitude = std::abs(acc);
      for (int64_t j = 0; j < n; ++j) {
        const double term = double(step.weights[j]) * v[(step.key_begin + j) * s.value_dim + c];
        acc += term;
        magnitude += std::abs(term);
      }
      ExpectWithin(step.accumulator[c], acc, sum_tolerance * magnitude + 1e-30, "accumulator", tile,
                   c);
      const double estimate = double(step.accumulator[c]) / double(step.denominator);
      ExpectWithin(step.estimate[c], estimate, kEps * std::abs(estimate), "estimate", tile, c);
    }

    prev_max = step.max_after;
    prev_denominator = step.denominator;
    prev_acc = step.accumulator;
  }

  ASSERT_TRUE(std::holds_alternative<TraceRowDone>(items.back()));
  const TraceRowDone& done = std::get<TraceRowDone>(items.back());
  EXPECT_EQ(done.row.batch, ref.batch);
  EXPECT_EQ(done.row.head, ref.head);
  EXPECT_EQ(done.row.row, ref.row);
  ASSERT_EQ(static_cast<int64_t>(done.output.size()), s.value_dim);
  ASSERT_EQ(static_cast<int64_t>(done.reference.size()), s.value_dim);

  // The output is the last estimate, bit for bit; with a sink, the last state with the sink
  // added once (OnlineSoftmax::AddSink), which no step includes.
  const int64_t out_offset = problem.OutputOffset(ref.batch, ref.head, ref.row);
  const bool has_sink = !host.sinks.empty();
  const float sink = has_sink ? host.sinks[ref.head] : -INFINITY;
  if (expected_tiles > 0) {
    const TraceStep& last = std::get<TraceStep>(items[expected_tiles - 1]);
    std::vector<float> expected = last.estimate;
    if (has_sink) {
      OnlineSoftmaxRow state;
      state.max = last.max_after;
      state.denominator = last.denominator;
      const float factor = state.AddSink(sink);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        expected[c] = state.Normalize(last.accumulator[c] * factor);
      }
    }
    EXPECT_EQ(std::memcmp(done.output.data(), expected.data(), s.value_dim * sizeof(float)), 0)
        << "RowDone.output differs from the last estimate" << (has_sink ? " with the sink" : "");
  }
  const int64_t lse_offset = problem.LseOffset(ref.batch, ref.head, ref.row);
  if (tiled != nullptr) {
    for (int64_t c = 0; c < s.value_dim; ++c) {
      EXPECT_EQ(done.output[c], tiled->output[out_offset + c])
          << "RowDone.output differs from Tiled's output row at c=" << c;
    }
    EXPECT_EQ(done.lse, tiled->lse[lse_offset])
        << done.lse << " vs Tiled's " << tiled->lse[lse_offset];
  }
  const double reference_lse = reference.lse[lse_offset];
  if (std::isinf(reference_lse)) {
    EXPECT_EQ(done.lse, -INFINITY);
  } else {
    EXPECT_NEAR(done.lse, reference_lse, 1e-5 * std::max(1.0, std::abs(reference_lse)));
  }
  // The sink's share of the row: e^(sink − lse) by the reference; 0 without a sink.
  if (has_sink) {
    EXPECT_NEAR(done.sink_share, std::exp(double(sink) - reference_lse), 1e-5);
  } else {
    EXPECT_EQ(done.sink_share, 0.f);
  }

  // Output and the full-matrix reference row are both fp32 computations on the (rounded)
  // inputs, whatever their dtype: within 1e-5 of float64. The reported error is exactly the
  // distance between the two fp32 rows.
  double reference_magnitude = 1;
  for (int64_t c = 0; c < s.value_dim; ++c) {
    reference_magnitude = std::max(reference_magnitude, std::abs(reference.output[out_offset + c]));
  }
  float max_abs_error = 0;
  for (int64_t c = 0; c < s.value_dim; ++c) {
    EXPECT_NEAR(done.reference[c], reference.output[out_offset + c], 1e-5 * reference_magnitude)
        << "reference c=" << c;
    EXPECT_NEAR(done.output[c], reference.output[out_offset + c], 1e-5 * reference_magnitude)
        << "output c=" << c;
    max_abs_error = std::max(max_abs_error, std::abs(done.output[c] - done.reference[c]));
  }
  EXPECT_EQ(done.max_abs_error, max_abs_error);

  if (expected_tiles == 0) {  // The row sees no key.
    for (int64_t c = 0; c < s.value_dim; ++c) {
      EXPECT_EQ(done.output[c], 0.f);
      EXPECT_EQ(done.reference[c], 0.f);
    }
    EXPECT_EQ(done.lse, sink);  // −inf without a sink.
    EXPECT_EQ(done.max_abs_error, 0.f);
  }
}

class TraceTest : public BackendTest {
 protected:
  // Traces `rows` of `host` (with `block_k` passed to the kernel as is) and checks every row.
  void CheckTrace(const HostProblem& host, int block_k, const std::vector<RowRef>& rows) {
    SCOPED_TRACE(::testing::Message() << "block_k=" << block_k);
    Problem problem = host.View();
    problem.block_k = block_k;
    const std::vector<TraceItem> items = CollectTrace(backend(), problem, rows);
    const Reference reference = ReferenceAttention(host);
    std::optional<KernelRun> tiled;
    if (traits().trace_is_tiled_bit_for_bit) {
      ASSERT_EQ(host.output_dtype, DType::kFloat32);
      tiled = RunKernel(backend(), Kernel::kTiled, host, problem);
    }

    // Split the trace at each RowDone: rows arrive in the order requested, each complete.
    size_t begin = 0;
    size_t row_index = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!std::holds_alternative<TraceRowDone>(items[i])) continue;
      ASSERT_LT(row_index, rows.size()) << "more rows than requested";
      const std::vector<TraceItem> row_items(items.begin() + begin, items.begin() + i + 1);
      CheckRow(host, problem, rows[row_index], row_items, reference, tiled ? &*tiled : nullptr);
      begin = i + 1;
      ++row_index;
    }
    EXPECT_EQ(row_index, rows.size());
    EXPECT_EQ(begin, items.size()) << "steps after the last RowDone";
  }
};

TEST_P(TraceTest, ShortLastTileWithGqaAndBatches) {
  // key_len 11 with block_k 3: tiles of 3, 3, 3 and 2 keys.
  const HostProblem host = RandomProblem(MakeShape(2, 6, 2, 13, 11, 7, 5), DType::kFloat32,
                                         /*causal=*/false, 3, 101);
  CheckTrace(host, 3, {{0, 0, 0}, {1, 5, 12}, {0, 3, 7}, {1, 2, 4}, {0, 1, 12}});
}

TEST_P(TraceTest, CausalWithMoreQueriesThanKeys) {
  // Nq 17, Nk 11: rows 0..5 see no key (zero steps); row 6 sees key 0 only; row 16 sees all.
  const HostProblem host = RandomProblem(MakeShape(1, 2, 1, 17, 11, 9, 6), DType::kFloat32,
                                         /*causal=*/true, 3, 102);
  CheckTrace(host, 3,
             {{0, 0, 0}, {0, 1, 5}, {0, 0, 6}, {0, 1, 8}, {0, 0, 10}, {0, 1, 13}, {0, 0, 16}});
}

TEST_P(TraceTest, SinksJoinEachRowOnceAfterItsLastTile) {
  // gpt-oss-like: GQA, causal with a left window, a sink per head (one far above the scores);
  // more query rows than keys, so rows 0..2 see no key (output 0, lse = sink, share 1).
  HostProblem host = RandomProblem(MakeShape(1, 4, 2, 20, 17, 9, 6), DType::kFloat32,
                                   /*causal=*/true, 3, 109);
  host.window_left = 6;
  host.sinks = {0.5f, -1.f, 2.f, 30.f};
  CheckTrace(host, 3, {{0, 0, 0}, {0, 1, 2}, {0, 2, 3}, {0, 3, 9}, {0, 0, 19}, {0, 3, 19}});
}

TEST_P(TraceTest, CausalWithFewerQueriesThanKeys) {
  // Nq 7, Nk 20, block_k 4: row i sees i + 14 keys, so the last tiles are partly masked or
  // (for row 0, 14 keys: tiles 0..3) skipped entirely.
  const HostProblem host = RandomProblem(MakeShape(1, 4, 1, 7, 20, 5, 8), DType::kFloat32,
                                         /*causal=*/true, 4, 103);
  CheckTrace(host, 4, {{0, 0, 0}, {0, 3, 1}, {0, 2, 5}, {0, 1, 6}});
}

TEST_P(TraceTest, PositionsPlaceASliceOfTheKeys) {
  // Keys 9..21 of a longer sequence, queries at 7..17: rows 0 and 1 see no key of the slice,
  // row 2 sees one, rows from 12 on all 13; block_k 4 leaves partly masked and skipped tiles.
  HostProblem host = RandomProblem(MakeShape(1, 4, 2, 11, 13, 6, 9), DType::kFloat32,
                                   /*causal=*/true, 4, 105);
  host.key_position = 9;
  host.query_position = 7;
  CheckTrace(host, 4, {{0, 0, 0}, {0, 1, 1}, {0, 2, 2}, {0, 3, 6}, {0, 0, 10}});
}

TEST_P(TraceTest, CausalLeftWindowSkipsTilesOnBothSides) {
  // Nq = Nk = 29, causal, window_left 5, block_k 3: row i sees keys [i − 5, i], so its first
  // step is tile (i − 5) / 3 and its last tile i / 3; every tile before and after is skipped.
  HostProblem host = RandomProblem(MakeShape(1, 4, 2, 29, 29, 7, 9), DType::kFloat32,
                                   /*causal=*/true, 3, 106);
  host.window_left = 5;
  CheckTrace(host, 3, {{0, 0, 0}, {0, 1, 4}, {0, 2, 5}, {0, 3, 17}, {0, 0, 28}});
}

TEST_P(TraceTest, TwoSidedWindowWithoutCausal) {
  // Non-causal, window (4, 2) on a slice of keys: some rows see nothing of the slice.
  HostProblem host = RandomProblem(MakeShape(1, 2, 1, 13, 17, 5, 6), DType::kFloat32,
                                   /*causal=*/false, 4, 107);
  host.key_position = 20;
  host.query_position = 12;  // Rows 0..5 (positions 12..17) see no key: the keys start at 20.
  host.window_left = 4;
  host.window_right = 2;
  CheckTrace(host, 4, {{0, 0, 0}, {0, 1, 5}, {0, 0, 6}, {0, 1, 12}});
}

TEST_P(TraceTest, BlockKLargerThanKeysAndOddDims) {
  const HostProblem host = RandomProblem(MakeShape(1, 3, 3, 9, 13, 33, 20), DType::kFloat32,
                                         /*causal=*/false, 64, 104);
  CheckTrace(host, 64, {{0, 0, 0}, {0, 2, 8}});
  CheckTrace(host, 1, {{0, 1, 4}});
}

TEST_P(TraceTest, BlockK7CausalGqaWideRows) {
  // value_dim 72: three columns for some of a warp's lanes; causal Nq 40 < Nk 75, so the last
  // tile of each row is partly masked.
  const HostProblem host = RandomProblem(MakeShape(2, 4, 2, 40, 75, 70, 72), DType::kFloat32,
                                         /*causal=*/true, 7, 205);
  CheckTrace(host, 7, {{0, 0, 0}, {1, 3, 39}, {0, 2, 20}, {1, 1, 11}});
}

TEST_P(TraceTest, TilesWiderThanAWarpAndValueDim256) {
  // Tiles of 64 and of 150 (> key_len) keys: more keys per tile than a warp's lanes; value_dim
  // 256, CUDA's trace's widest: eight columns per lane.
  const HostProblem host = RandomProblem(MakeShape(1, 2, 1, 5, 100, 48, 256), DType::kFloat32,
                                         /*causal=*/false, 64, 206);
  CheckTrace(host, 64, {{0, 0, 0}, {0, 1, 4}});
  CheckTrace(host, 150, {{0, 1, 2}});
}

TEST_P(TraceTest, LowPrecisionInputs) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostProblem host = RandomProblem(MakeShape(1, 4, 2, 15, 23, 10, 7), dtype, /*causal=*/true, 5,
                                     105 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    CheckTrace(host, 5, {{0, 0, 14}, {0, 3, 2}});
  }
}

// A trace over a KV store's pages records exactly what the same trace over contiguous keys does
// (every step's scores, weights, state and estimate; the row's output and reference), for odd
// page sizes and a block_k that is not a multiple of the page, in every dtype.
TEST_P(TraceTest, PagedKeysGiveTheContiguousTraceBitForBit) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t page_tokens : {1, 5, 7}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " page " << page_tokens);
      HostProblem host = RandomProblem(MakeShape(1, 6, 2, 9, 31, 11, 7), dtype, /*causal=*/true, 4,
                                       110 + page_tokens + 10 * static_cast<int>(dtype));
      host.output_dtype = DType::kFloat32;
      absl::StatusOr<Backend*> paged_backend = backend({.kv_page_tokens = page_tokens});
      ASSERT_TRUE(paged_backend.ok()) << paged_backend.status();
      absl::StatusOr<PagedCopy> paged = MakePaged(**paged_backend, host, {3, 8});
      ASSERT_TRUE(paged.ok()) << paged.status();
      const std::vector<RowRef> rows = {{0, 0, 0}, {0, 5, 8}, {0, 3, 4}};
      const std::vector<TraceItem> contiguous = CollectTrace(**paged_backend, host.View(), rows);
      const std::vector<TraceItem> items = CollectTrace(**paged_backend, paged->problem, rows);
      ASSERT_EQ(items.size(), contiguous.size());
      for (size_t i = 0; i < items.size(); ++i) {
        ASSERT_EQ(items[i].index(), contiguous[i].index()) << "item " << i;
        if (const auto* step = std::get_if<TraceStep>(&items[i])) {
          const auto& expected = std::get<TraceStep>(contiguous[i]);
          EXPECT_EQ(step->scores, expected.scores) << "item " << i;
          EXPECT_EQ(step->weights, expected.weights) << "item " << i;
          EXPECT_EQ(step->max_after, expected.max_after) << "item " << i;
          EXPECT_EQ(step->rescale, expected.rescale) << "item " << i;
          EXPECT_EQ(step->denominator, expected.denominator) << "item " << i;
          EXPECT_EQ(step->accumulator, expected.accumulator) << "item " << i;
          EXPECT_EQ(step->estimate, expected.estimate) << "item " << i;
        } else {
          const auto& done = std::get<TraceRowDone>(items[i]);
          const auto& expected = std::get<TraceRowDone>(contiguous[i]);
          EXPECT_EQ(done.output, expected.output) << "item " << i;
          EXPECT_EQ(done.reference, expected.reference) << "item " << i;
          EXPECT_EQ(done.lse, expected.lse) << "item " << i;
        }
      }
      // And it is a correct trace: the recurrence, the reference (and Tiled where it is the
      // trace's bits).
      if (dtype == DType::kFloat32) {
        CheckTrace(host, 4, rows);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The seed's 8×4 example.

TEST_P(TraceTest, SeedExampleRowZero) {
  const HostProblem host = SeedExample(1.f, 2);
  CheckTrace(host, 2, {{0, 0, 0}});

  const std::vector<TraceItem> items = CollectTrace(backend(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 5u);
  const TraceStep& last = std::get<TraceStep>(items[3]);
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(last.estimate[c], kSeedRow0[c], 1e-6) << "c=" << c;
  // After the first tile (keys 0 and 1, scores 2 and 1) the estimate is their softmax mix.
  const TraceStep& first = std::get<TraceStep>(items[0]);
  EXPECT_EQ(first.scores, (std::vector<float>{2.f, 1.f}));
  EXPECT_EQ(first.max_after, 2.f);
  const double w1 = std::exp(-1.0) / (1 + std::exp(-1.0));
  EXPECT_NEAR(first.estimate[0], -4 * (1 - w1) - 3 * w1, 1e-6);
}

TEST_P(TraceTest, SeedExampleHugeScores) {
  const HostProblem host = SeedExample(1000.f, 3);
  CheckTrace(host, 3, {{0, 0, 0}, {0, 0, 5}});
  const std::vector<TraceItem> items = CollectTrace(backend(), host.View(), {{0, 0, 0}});
  ASSERT_FALSE(items.empty());
  const TraceRowDone& done = std::get<TraceRowDone>(items.back());
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(done.output[c], kSeedHugeRow0[c], 1e-6) << "c=" << c;
}

// Keys 0 and 7 of the example are identical, so row 0 gives them the same score and weight
// (read from a one-tile trace, which records both).
TEST_P(TraceTest, SeedExampleTiedKeysShareTheWeight) {
  const HostProblem host = SeedExample(1.f, 8);
  const std::vector<TraceItem> items = CollectTrace(backend(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 2u);
  const TraceStep& step = std::get<TraceStep>(items[0]);
  ASSERT_EQ(step.scores.size(), 8u);
  EXPECT_EQ(step.scores[0], 2.f);
  EXPECT_EQ(step.scores[7], 2.f);
  EXPECT_EQ(step.weights[0], step.weights[7]);
  EXPECT_NEAR(step.weights[0] / step.denominator, 0.304404, 1e-6);
  double sum = 0;
  for (float w : step.weights) sum += w / step.denominator;
  EXPECT_NEAR(sum, 1.0, 1e-6);
  const Reference ref = ReferenceAttention(host);
  EXPECT_NEAR(std::get<TraceRowDone>(items[1]).lse, ref.lse[0], 1e-6);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    EXPECT_NEAR(RunKernel(backend(), kernel, host).lse[0], ref.lse[0], 1e-6);
  }
}

// With the queries × 1000 the tied keys take (almost) all the weight, half each, and every
// weight stays finite.
TEST_P(TraceTest, SeedExampleHugeScoresKeepTheTie) {
  const HostProblem host = SeedExample(1000.f, 8);
  const std::vector<TraceItem> items = CollectTrace(backend(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 2u);
  const TraceStep& step = std::get<TraceStep>(items[0]);
  for (float w : step.weights) ASSERT_TRUE(std::isfinite(w));
  EXPECT_EQ(step.weights[0], step.weights[7]);
  EXPECT_NEAR(step.weights[0] / step.denominator, 0.5, 1e-6);
}

ATTN_BACKEND_SUITE(TraceTest);

}  // namespace
