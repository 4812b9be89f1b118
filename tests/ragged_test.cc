// Ragged batches (AttentionRequest.cu_seqlens_q/k, kernels/geometry.h) on the CPU backend:
// which keys a row sees, and Naive, Tiled and Trace over packed sequences of unequal lengths
// (length 1, empty, more query rows than keys, across row blocks) against the float64 reference,
// which finds each row's sequence itself (tests/reference.cc), and against each sequence run
// alone as a problem of its own. Fresh random inputs, odd sizes, outputs poisoned with NaN.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/geometry.h"
#include "kernels/problem.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

// Geometry against the rule as stated, key by key, on random ragged batches (empty sequences
// included): a row sees only its own sequence's keys, by the causal mask and the window at the
// sequence's own positions; HiddenBy names the reason (another sequence first); ranges stay
// contiguous and never decrease with the row; Distance is the reference's and linear in the key.
TEST(RaggedGeometryTest, VisibleKeepsEachRowInItsSequence) {
  std::mt19937_64 rng(16);
  std::uniform_int_distribution<int64_t> count(1, 5), length(0, 9), window(0, 6);
  for (int trial = 0; trial < 1000; ++trial) {
    HostProblem host;
    std::vector<int64_t> q_lengths, k_lengths;
    for (int64_t s = count(rng); s > 0; --s) {
      q_lengths.push_back(length(rng));
      k_lengths.push_back(length(rng));
    }
    q_lengths.back() += 1;  // At least one row and one key in all.
    k_lengths.back() += 1;
    host.cu_seqlens_q = CumulativeLengths(q_lengths);
    host.cu_seqlens_k = CumulativeLengths(k_lengths);
    host.shape = MakeShape(1, 1, 1, host.cu_seqlens_q.back(), host.cu_seqlens_k.back(), 1, 1);
    host.causal = trial % 3 != 0;
    if (trial % 4 == 1) host.window_left = window(rng);
    if (trial % 5 == 2) host.window_right = window(rng);
    const Geometry g = host.View().geometry();
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    KeyRange previous{0, 0};
    for (int64_t row = 0; row < host.shape.query_len; ++row) {
      const KeyRange visible = g.Visible(row);
      int64_t seen = 0;
      for (int64_t key = 0; key < host.shape.key_len; ++key) {
        const bool sees = ReferenceSees(host, row, key);
        ASSERT_EQ(visible.Contains(key), sees) << "row " << row << " key " << key;
        seen += sees;
        const Hidden why = g.HiddenBy(row, key);
        ASSERT_EQ(why == Hidden::kNone, sees) << "row " << row << " key " << key;
        ASSERT_EQ(g.Distance(row, key), ReferenceDistance(host, row, key));
        ASSERT_EQ(g.Distance(row, key), g.Distance(row, 0) - key);
        if (why == Hidden::kSequence) {
          const int64_t s = g.SequenceOf(row);
          ASSERT_TRUE(key < host.cu_seqlens_k[s] || key >= host.cu_seqlens_k[s + 1]);
        }
      }
      ASSERT_EQ(visible.size(), seen) << "the keys a row sees must be contiguous";
      ASSERT_GE(visible.begin, previous.begin) << "row " << row;
      ASSERT_GE(visible.end, previous.end) << "row " << row;
      previous = visible;
    }
  }
}

struct RaggedCase {
  std::string name;
  int64_t heads = 4, kv_heads = 2, head_dim = 19, value_dim = 23;
  std::vector<int64_t> query_lengths, key_lengths;
  bool causal = false;
  std::optional<int64_t> window_left = std::nullopt;
  float softcap = 0.f;
  bool alibi = false;
  DType dtype = DType::kFloat32;
  int block_k = 7;
};

void PrintTo(const RaggedCase& c, std::ostream* os) { *os << c.name; }

HostProblem MakeHost(const RaggedCase& c) {
  const std::vector<int64_t> cu_q = CumulativeLengths(c.query_lengths);
  const std::vector<int64_t> cu_k = CumulativeLengths(c.key_lengths);
  HostProblem host = RandomProblem(
      MakeShape(1, c.heads, c.kv_heads, cu_q.back(), cu_k.back(), c.head_dim, c.value_dim), c.dtype,
      c.causal, c.block_k, std::hash<std::string>{}(c.name));
  host.cu_seqlens_q = cu_q;
  host.cu_seqlens_k = cu_k;
  host.window_left = c.window_left;
  host.softcap = c.softcap;
  float slope = 1.f;
  for (int64_t h = 0; c.alibi && h < c.heads; ++h) host.alibi_slopes.push_back(slope *= 0.6f);
  return host;
}

// Sequence s of a ragged host as a problem of its own: its query rows and keys of every head,
// the same options, no cu_seqlens.
HostProblem Alone(const HostProblem& ragged, size_t s) {
  const Shape& p = ragged.shape;
  const int64_t q0 = ragged.cu_seqlens_q[s], k0 = ragged.cu_seqlens_k[s];
  HostProblem alone = ragged;
  alone.cu_seqlens_q.clear();
  alone.cu_seqlens_k.clear();
  alone.shape.query_len = ragged.cu_seqlens_q[s + 1] - q0;
  alone.shape.key_len = ragged.cu_seqlens_k[s + 1] - k0;
  const int64_t element = ElementSize(ragged.dtype);
  const auto slice = [&](const std::vector<uint8_t>& bytes, const std::vector<float>& values,
                         int64_t heads, int64_t len, int64_t first, int64_t rows, int64_t width,
                         std::vector<uint8_t>& out_bytes, std::vector<float>& out_values) {
    out_bytes.clear();
    out_values.clear();
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t begin = (h * len + first) * width;
      out_values.insert(out_values.end(), values.begin() + begin,
                        values.begin() + begin + rows * width);
      out_bytes.insert(out_bytes.end(), bytes.begin() + begin * element,
                       bytes.begin() + (begin + rows * width) * element);
    }
  };
  slice(ragged.query_bytes, ragged.query, p.heads, p.query_len, q0, alone.shape.query_len,
        p.head_dim, alone.query_bytes, alone.query);
  slice(ragged.key_bytes, ragged.key, p.kv_heads, p.key_len, k0, alone.shape.key_len, p.head_dim,
        alone.key_bytes, alone.key);
  slice(ragged.value_bytes, ragged.value, p.kv_heads, p.key_len, k0, alone.shape.key_len,
        p.value_dim, alone.value_bytes, alone.value);
  return alone;
}

class RaggedTest : public ::testing::TestWithParam<RaggedCase> {};

TEST_P(RaggedTest, NaiveAndTiledMatchTheReference) {
  const HostProblem host = MakeHost(GetParam());
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    ExpectMatchesInItsDtype(RunKernel(backend, kernel, host), host, ref);
  }
}

// Each sequence's rows of the packed answer are that sequence's answer alone (its own positions,
// bottom-right), within fp32 rounding of the two tilings; the packed lse too.
TEST_P(RaggedTest, EachSequenceMatchesItsRunAlone) {
  const HostProblem host = MakeHost(GetParam());
  CpuBackend backend(2, 0);
  const KernelRun packed = RunKernel(backend, Kernel::kTiled, host);
  const Shape& p = host.shape;
  const double tolerance = host.dtype == DType::kFloat32 ? 1e-5 : 1e-2;
  int64_t compared = 0;
  for (size_t s = 0; s + 1 < host.cu_seqlens_q.size(); ++s) {
    const HostProblem alone = Alone(host, s);
    if (alone.shape.query_len == 0) continue;
    SCOPED_TRACE(::testing::Message() << "sequence " << s);
    // A sequence with no keys is no request of its own: its rows see nothing (zeros, lse −inf).
    const bool keys = alone.shape.key_len > 0;
    const KernelRun run = keys ? RunKernel(backend, Kernel::kTiled, alone) : KernelRun{};
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < alone.shape.query_len; ++i) {
        const int64_t row = host.cu_seqlens_q[s] + i;
        const float lse = packed.lse[h * p.query_len + row];
        if (!keys) {
          EXPECT_EQ(lse, -INFINITY) << "h=" << h << " i=" << i;
        } else {
          const float want = run.lse[h * alone.shape.query_len + i];
          if (std::isinf(want)) {
            EXPECT_EQ(lse, want) << "h=" << h << " i=" << i;
          } else {
            EXPECT_NEAR(lse, want, 1e-5 * (1 + std::abs(want))) << "h=" << h << " i=" << i;
          }
        }
        for (int64_t c = 0; c < p.value_dim; ++c) {
          const float got = packed.output[(h * p.query_len + row) * p.value_dim + c];
          const float want =
              keys ? run.output[(h * alone.shape.query_len + i) * p.value_dim + c] : 0.f;
          ASSERT_NEAR(got, want, tolerance) << "h=" << h << " i=" << i << " c=" << c;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// The sequences change the answer: a kernel ignoring cu_seqlens would fail the tests above.
TEST_P(RaggedTest, TheSequencesChangeTheAnswer) {
  HostProblem host = MakeHost(GetParam());
  const Reference ragged = ReferenceAttention(host);
  host.cu_seqlens_q.clear();
  host.cu_seqlens_k.clear();
  EXPECT_GT(LargestOutputDifference(ragged, ReferenceAttention(host)), 1e-2);
}

// A traced row of a middle sequence steps only through tiles holding its own sequence's keys,
// every key of another sequence in them scores −inf, and its output is the reference's.
TEST_P(RaggedTest, TraceStaysInTheRowsSequence) {
  const HostProblem host = MakeHost(GetParam());
  const Problem problem = host.View();
  const Reference ref = ReferenceAttention(host);
  const Shape& s = host.shape;
  std::vector<RowRef> rows;
  for (size_t q = 0; q + 1 < host.cu_seqlens_q.size(); ++q) {
    const int64_t first = host.cu_seqlens_q[q], end = host.cu_seqlens_q[q + 1];
    if (end > first) rows.push_back({0, static_cast<int64_t>(q) % s.heads, (first + end) / 2});
  }
  CpuBackend backend(2, 0);
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, rows);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  TraceItem item;
  int64_t done_rows = 0;
  while ((*cursor)->Next(&item)) {
    if (const TraceStep* step = std::get_if<TraceStep>(&item)) {
      bool any = false;
      for (size_t j = 0; j < step->scores.size(); ++j) {
        const int64_t key = step->key_begin + static_cast<int64_t>(j);
        if (!ReferenceSees(host, step->row.row, key)) {
          EXPECT_EQ(step->scores[j], -INFINITY) << "row " << step->row.row << " key " << key;
        } else {
          any = true;
        }
      }
      EXPECT_TRUE(any) << "a traced tile must hold a key the row sees; row " << step->row.row;
    } else {
      const TraceRowDone& done = std::get<TraceRowDone>(item);
      const int64_t offset = problem.OutputOffset(0, done.row.head, done.row.row);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        EXPECT_NEAR(done.output[c], ref.output[offset + c], 1e-5) << "c=" << c;
      }
      ++done_rows;
    }
  }
  EXPECT_EQ(done_rows, static_cast<int64_t>(rows.size()));
}

INSTANTIATE_TEST_SUITE_P(
    Batches, RaggedTest,
    ::testing::Values(
        // Unequal query and key lengths, a sequence of length 1, GQA, odd widths.
        RaggedCase{"Unequal", 4, 2, 19, 23, {5, 1, 40}, {7, 1, 33}},
        // Causal: more query rows than keys in the first (its first rows see none).
        RaggedCase{"Causal", 4, 2, 19, 23, {9, 1, 40}, {4, 1, 33}, true},
        // Empty sequences: keys without queries, queries without keys (zeros, lse −inf).
        RaggedCase{"Empty", 2, 1, 8, 8, {0, 6, 3, 0, 4}, {5, 0, 8, 2, 4}, true},
        // Sequences longer than a row block (128): blocks restart at each sequence.
        RaggedCase{"AcrossBlocks",
                   2,
                   2,
                   16,
                   16,
                   {200, 131, 3},
                   {250, 131, 1},
                   true,
                   std::nullopt,
                   0.f,
                   false,
                   DType::kFloat32,
                   64},
        // A causal window, a softcap and ALiBi, all per sequence.
        RaggedCase{"WindowSoftcapAlibi",
                   4,
                   2,
                   12,
                   10,
                   {17, 64, 3},
                   {17, 80, 3},
                   true,
                   5,
                   3.f,
                   true,
                   DType::kFloat32,
                   16},
        RaggedCase{"Bf16",
                   4,
                   1,
                   32,
                   24,
                   {130, 7},
                   {129, 200},
                   true,
                   std::nullopt,
                   0.f,
                   true,
                   DType::kBFloat16,
                   8}),
    [](const ::testing::TestParamInfo<RaggedCase>& info) { return info.param.name; });

// One sequence given as a ragged batch computes exactly what the plain problem does.
TEST(RaggedOneSequenceTest, IsThePlainProblemBitForBit) {
  HostProblem host = MakeHost(RaggedCase{"One", 3, 1, 24, 16, {37}, {45}, true});
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    HostProblem plain = host;
    plain.cu_seqlens_q.clear();
    plain.cu_seqlens_k.clear();
    const KernelRun ragged = RunKernel(backend, kernel, host);
    const KernelRun alone = RunKernel(backend, kernel, plain);
    EXPECT_EQ(ragged.output_bytes, alone.output_bytes);
    EXPECT_EQ(ragged.lse, alone.lse);
  }
}

}  // namespace
