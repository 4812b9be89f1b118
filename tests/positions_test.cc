// Positions (kernels/geometry.h) on the CPU backend: which keys a row sees, and Naive, Tiled and
// Decode over slices of the keys and queries placed by key_position and query_position, against
// the float64 reference (which reads the positions itself, tests/reference.cc). Fresh random
// inputs, odd sizes, outputs poisoned with NaN.
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
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

// VisibleKeys against the rule as stated: a key at t is visible to a query at p iff t ≤ p.
TEST(GeometryTest, VisibleKeysFollowThePositions) {
  std::mt19937_64 rng(14);
  std::uniform_int_distribution<int64_t> length(1, 23), position(0, 40);
  for (int trial = 0; trial < 500; ++trial) {
    Geometry g;
    g.query_len = length(rng);
    g.key_len = length(rng);
    g.key_position = position(rng);
    g.query_position = trial % 3 == 0 ? g.key_position + g.key_len - g.query_len : position(rng);
    g.causal = trial % 5 != 0;
    const int64_t block_k = 1 + trial % 7;
    int64_t previous = 0;
    for (int64_t row = 0; row < g.query_len; ++row) {
      int64_t expected = 0;
      for (int64_t key = 0; key < g.key_len; ++key) {
        const bool sees = !g.causal || g.key_position + key <= g.query_position + row;
        if (sees) {
          ASSERT_EQ(key, expected) << "the keys a row sees must be a prefix";
          ++expected;
        }
      }
      ASSERT_EQ(g.VisibleKeys(row), expected) << "row " << row << " trial " << trial;
      ASSERT_GE(g.VisibleKeys(row), previous) << "VisibleKeys must not decrease with the row";
      previous = g.VisibleKeys(row);
      int64_t in_tiles = 0;
      for (int64_t begin = 0; begin < g.key_len; begin += block_k) {
        in_tiles += g.VisibleKeysIn(row, begin, block_k);
      }
      ASSERT_EQ(in_tiles, expected);
      ASSERT_EQ(g.VisitedTiles(row, block_k), (expected + block_k - 1) / block_k);
    }
  }
}

TEST(GeometryTest, DefaultsAreBottomRight) {
  const Geometry g = Geometry::BottomRight(/*query_len=*/5, /*key_len=*/3, /*causal=*/true);
  EXPECT_EQ(g.query_position, -2);  // The first two rows see no key.
  EXPECT_EQ(g.VisibleKeys(0), 0);
  EXPECT_EQ(g.VisibleKeys(1), 0);
  EXPECT_EQ(g.VisibleKeys(2), 1);
  EXPECT_EQ(g.VisibleKeys(4), 3);
  Problem problem;
  problem.shape = MakeShape(1, 1, 1, 5, 3, 4, 4);
  problem.causal = true;
  problem.key_position = 7;  // Moving the keys moves the default queries with them.
  EXPECT_EQ(problem.geometry().query_position, 5);
  EXPECT_EQ(problem.VisibleKeys(2), 1);
  problem.query_position = 7;  // Row i now sits at key i.
  EXPECT_EQ(problem.VisibleKeys(0), 1);
  EXPECT_EQ(problem.VisibleKeys(2), 3);
  EXPECT_EQ(problem.VisiblePairs(), 1 + 2 + 3 + 3 + 3);
}

struct PositionCase {
  std::string name;
  Shape shape;
  DType dtype = DType::kFloat32;
  int64_t key_position = 0;
  std::optional<int64_t> query_position;
  int block_k = 7;
};

void PrintTo(const PositionCase& c, std::ostream* os) { *os << c.name; }

class PositionsTest : public ::testing::TestWithParam<PositionCase> {};

HostProblem MakeHost(const PositionCase& c) {
  HostProblem host =
      RandomProblem(c.shape, c.dtype, /*causal=*/true, c.block_k, std::hash<std::string>{}(c.name));
  host.key_position = c.key_position;
  host.query_position = c.query_position;
  return host;
}

void ExpectMatches(const KernelRun& run, const HostProblem& host, const Reference& ref) {
  if (host.dtype == DType::kFloat32) {
    ExpectMatchesReference(run, ref, 1e-5);
  } else {
    ExpectLowPrecisionMatches(run, host, ref);
  }
  ExpectLseMatches(run, ref, 1e-5);
}

TEST_P(PositionsTest, NaiveAndTiledMatchTheReference) {
  const HostProblem host = MakeHost(GetParam());
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(backend, kernel, host);
    ExpectMatches(run, host, ref);
    EXPECT_EQ(run.stats.flops, host.View().Flops());
  }
}

// The same problem through Decode: over a KV store's pages (a cache holds one sequence, so for
// batch 1), else over the contiguous tensors.
TEST_P(PositionsTest, DecodeMatchesTheReference) {
  const PositionCase& c = GetParam();
  const HostProblem host = MakeHost(c);
  CpuBackend backend(2, 0);
  std::optional<PagedCopy> paged;
  if (c.shape.batch == 1) {
    absl::StatusOr<PagedCopy> copy = MakePaged(backend, host, {c.shape.key_len / 2});
    ASSERT_TRUE(copy.ok()) << copy.status();
    paged = *std::move(copy);
  }
  PoisonedOutputs poisoned(host);
  const std::vector<Problem> problems = {paged ? paged->problem : host.View()};
  const std::vector<Outputs> outputs = {poisoned.outputs()};
  const absl::StatusOr<Stats> stats = backend.Decode(problems, outputs);
  ASSERT_TRUE(stats.ok()) << stats.status();
  KernelRun run;
  run.output = poisoned.Output();
  run.output_bytes = poisoned.output_bytes;
  run.lse = poisoned.lse;
  ExpectMatches(run, host, ReferenceAttention(host));
}

INSTANTIATE_TEST_SUITE_P(
    Slices, PositionsTest,
    ::testing::Values(
        // Keys 23..41 of a 53-key sequence, the queries bottom-right against all 53: rows 0..5
        // see no key of this slice, the others part or all of it.
        PositionCase{"KeySliceOfCausal", MakeShape(1, 2, 2, 37, 19, 17, 17), DType::kFloat32, 23,
                     16, 5},
        // Queries 40..52 of a 61-key sequence (a slice of the queries).
        PositionCase{"QueriesMidSequence", MakeShape(1, 3, 3, 13, 61, 9, 12), DType::kFloat32, 0,
                     40, 8},
        // The first query sits before every key: GQA and value_dim ≠ head_dim.
        PositionCase{"GqaSomeRowsSeeNothing", MakeShape(2, 6, 2, 19, 23, 9, 11), DType::kFloat32, 5,
                     2, 5},
        PositionCase{"OneKey", MakeShape(1, 2, 1, 9, 1, 8, 5), DType::kFloat32, 30, 26, 1},
        // A slice every row sees whole (all its keys precede the first query).
        PositionCase{"SliceBeforeEveryQuery", MakeShape(1, 2, 2, 11, 29, 16, 16), DType::kFloat32,
                     3, 100, 16},
        // The default query position follows a moved key_position.
        PositionCase{"MovedKeysDefaultQueries", MakeShape(1, 2, 2, 21, 17, 12, 12), DType::kFloat32,
                     1000, std::nullopt, 4},
        PositionCase{"Bf16Slice", MakeShape(1, 4, 2, 17, 31, 32, 24), DType::kBFloat16, 10, 12, 16},
        PositionCase{"Fp16Slice", MakeShape(1, 2, 2, 15, 27, 20, 20), DType::kFloat16, 7, 9, 5}),
    [](const ::testing::TestParamInfo<PositionCase>& info) { return info.param.name; });

}  // namespace
