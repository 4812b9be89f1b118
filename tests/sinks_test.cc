// Attention sinks (AttentionOptions.sinks, OnlineSoftmax::AddSink) on the CPU backend: Naive,
// Tiled, Decode and Trace against the float64 reference, which adds e^sink to each row's sum and
// nothing to its values from the contract's formula (tests/reference.cc): gpt-oss's shape in
// small (GQA, causal, a sliding window, a sink per head), sinks far below and far above every
// score (the row's max moves to the sink), more query rows than keys (rows that see no key:
// output 0, lse = sink), a key slice with its own positions, with ALiBi and a softcap, a ragged
// batch, bf16, odd sizes, fresh random inputs, outputs poisoned with NaN.
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/problem.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

struct SinkCase {
  std::string name;
  Shape shape;
  bool causal = true;
  float sink_base = 0.f;   // Head h's sink: sink_base + sink_step · h.
  float sink_step = 0.5f;  //
  std::optional<int64_t> window_left = std::nullopt;
  float softcap = 0.f;
  bool alibi = false;  // Slopes 2^−(h+1).
  int64_t key_position = 0;
  std::optional<int64_t> query_position = std::nullopt;
  std::vector<int64_t> sequence_lengths = {};  // A ragged batch: (query, key) lengths alike.
  DType dtype = DType::kFloat32;
  int block_k = 7;
};

void PrintTo(const SinkCase& c, std::ostream* os) { *os << c.name; }

class SinkTest : public ::testing::TestWithParam<SinkCase> {};

HostProblem MakeHost(const SinkCase& c) {
  HostProblem host =
      RandomProblem(c.shape, c.dtype, c.causal, c.block_k, std::hash<std::string>{}(c.name));
  for (int64_t h = 0; h < c.shape.heads; ++h) {
    host.sinks.push_back(c.sink_base + c.sink_step * static_cast<float>(h));
    if (c.alibi) host.alibi_slopes.push_back(std::ldexp(1.f, -static_cast<int>(h) - 1));
  }
  host.window_left = c.window_left;
  host.softcap = c.softcap;
  host.key_position = c.key_position;
  host.query_position = c.query_position;
  if (!c.sequence_lengths.empty()) {
    host.cu_seqlens_q = host.cu_seqlens_k = CumulativeLengths(c.sequence_lengths);
  }
  return host;
}

// Decode too, except for a ragged batch (a cache holds one sequence).
TEST_P(SinkTest, NaiveTiledAndDecodeMatchTheReference) {
  CpuBackend backend(2, 0);
  const HostProblem host = MakeHost(GetParam());
  if (!host.cu_seqlens_q.empty()) {
    const Reference ref = ReferenceAttention(host);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(KernelName(kernel));
      ExpectMatchesInItsDtype(RunKernel(backend, kernel, host), host, ref);
    }
    return;
  }
  ExpectNaiveTiledAndDecodeMatch(backend, host);
}

// The sink changes the answer (a kernel ignoring it would be caught) — except sinks far below
// every score, which take next to nothing.
TEST_P(SinkTest, TheSinkChangesTheAnswer) {
  HostProblem host = MakeHost(GetParam());
  const Reference sunk = ReferenceAttention(host);
  host.sinks.clear();
  const Reference plain = ReferenceAttention(host);
  if (GetParam().sink_base < -10.f) {
    EXPECT_LT(LargestOutputDifference(sunk, plain), 1e-6);
  } else {
    EXPECT_GT(LargestOutputDifference(sunk, plain), 1e-3);
  }
}

// Traced rows of the first and last heads: RowDone's output, reference and lse are the
// reference's (the sink included), sink_share is e^(sink − lse) by the reference, the keys'
// final weights plus the share sum to 1, and no step's estimate includes the sink (the last
// step's is the keys-only softmax: acc / denominator).
TEST_P(SinkTest, TraceShowsTheSinksShare) {
  const HostProblem host = MakeHost(GetParam());
  const Problem problem = host.View();
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  const Shape& s = host.shape;
  const std::vector<RowRef> rows = {
      {0, 0, s.query_len / 2}, {s.batch - 1, s.heads - 1, 0}, {0, s.heads - 1, s.query_len - 1}};
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, rows);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  TraceItem item;
  std::vector<float> row_scores;  // The current row's scores over every visited tile.
  int done_rows = 0;
  while ((*cursor)->Next(&item)) {
    if (const TraceStep* step = std::get_if<TraceStep>(&item)) {
      row_scores.insert(row_scores.end(), step->scores.begin(), step->scores.end());
      for (size_t c = 0; c < step->estimate.size(); ++c) {
        EXPECT_FLOAT_EQ(step->estimate[c], step->accumulator[c] / step->denominator);
      }
      continue;
    }
    const TraceRowDone& done = std::get<TraceRowDone>(item);
    ++done_rows;
    const int64_t h = done.row.head;
    const int64_t offset = problem.OutputOffset(done.row.batch, h, done.row.row);
    const double lse = ref.lse[problem.LseOffset(done.row.batch, h, done.row.row)];
    for (int64_t c = 0; c < s.value_dim; ++c) {
      EXPECT_NEAR(done.output[c], ref.output[offset + c], 1e-5) << "c=" << c;
      EXPECT_NEAR(done.reference[c], ref.output[offset + c], 1e-5) << "c=" << c;
    }
    EXPECT_NEAR(done.lse, lse, 1e-5 * std::max(1.0, std::abs(lse)));
    const double share = std::exp(double(host.sinks[h]) - lse);
    EXPECT_NEAR(done.sink_share, share, 1e-5);
    double weights = done.sink_share;
    for (float score : row_scores) {
      if (!std::isinf(score)) weights += std::exp(double(score) - double(done.lse));
    }
    EXPECT_NEAR(weights, 1.0, 1e-4);
    row_scores.clear();
  }
  EXPECT_EQ(done_rows, 3);
}

const std::vector<SinkCase> kSinkCases = {
    // gpt-oss in small: GQA (6 query heads on 2 kv heads), causal, a sliding window.
    SinkCase{"GptOssLike", MakeShape(1, 6, 2, 37, 37, 16, 16), true, -0.5f, 0.5f, 11},
    // Sinks far above every score: the row's max is the sink; outputs shrink towards 0.
    SinkCase{"FarAbove", MakeShape(2, 3, 1, 17, 23, 9, 7), false, 40.f, 1.f},
    // Far below: a sink that takes almost nothing.
    SinkCase{"FarBelow", MakeShape(1, 2, 2, 13, 29, 12, 10), true, -30.f, -2.f},
    // More query rows than keys: the first rows see no key (output 0, lse = sink).
    SinkCase{"MoreQueriesThanKeys", MakeShape(1, 2, 1, 30, 11, 8, 8), true, 0.25f},
    // A key slice [40, 71) of a longer sequence with the whole problem's query positions
    // (30 …): rows 0–9 see none of it.
    SinkCase{"KeySlice", MakeShape(1, 2, 2, 13, 31, 12, 10), true, 0.f, 0.5f, std::nullopt, 0.f,
             false, 40, 30},
    // With a softcap and ALiBi: the sink itself is neither capped nor biased.
    SinkCase{"SoftcapAlibi", MakeShape(1, 4, 2, 41, 41, 12, 10), true, 1.5f, 0.25f, 9, 2.f, true},
    // A ragged batch of three sequences: the head's sink in every sequence's rows.
    SinkCase{"Ragged",
             MakeShape(1, 4, 2, 29, 29, 8, 8),
             true,
             0.5f,
             0.5f,
             std::nullopt,
             0.f,
             false,
             0,
             std::nullopt,
             {5, 1, 23}},
    SinkCase{"Bf16",
             MakeShape(1, 4, 2, 19, 25, 32, 24),
             true,
             0.5f,
             0.5f,
             std::nullopt,
             0.f,
             false,
             0,
             std::nullopt,
             {},
             DType::kBFloat16,
             8}};

INSTANTIATE_TEST_SUITE_P(Sinks, SinkTest, ::testing::ValuesIn(kSinkCases),
                         [](const ::testing::TestParamInfo<SinkCase>& info) {
                           return info.param.name;
                         });

// Rows that see no key output zeros with lse = the head's sink, on Naive and Tiled, in every
// case that has such rows (at least two do).
TEST(SinkRowsTest, RowsThatSeeNoKeyGiveZerosAndTheSink) {
  int cases = 0;
  for (const SinkCase& c : kSinkCases) {
    SCOPED_TRACE(c.name);
    const HostProblem host = MakeHost(c);
    const Shape& s = host.shape;
    std::vector<int64_t> unseeing;
    for (int64_t i = 0; i < s.query_len; ++i) {
      bool sees = false;
      for (int64_t j = 0; j < s.key_len && !sees; ++j) sees = ReferenceSees(host, i, j);
      if (!sees) unseeing.push_back(i);
    }
    if (unseeing.empty() || !host.cu_seqlens_q.empty()) continue;
    ++cases;
    CpuBackend backend(2, 0);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(KernelName(kernel));
      const KernelRun run = RunKernel(backend, kernel, host);
      ExpectUnseeingRowsZero(run, host);
      const Problem view = host.View();
      for (int64_t b = 0; b < s.batch; ++b) {
        for (int64_t h = 0; h < s.heads; ++h) {
          for (int64_t i : unseeing) EXPECT_EQ(run.lse[view.LseOffset(b, h, i)], host.sinks[h]);
        }
      }
    }
  }
  EXPECT_GE(cases, 2);
}

}  // namespace
