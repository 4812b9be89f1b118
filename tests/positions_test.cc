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

// Visible against the rule as stated: a key at t is visible to a query at p iff t ≤ p when
// causal, t ≥ p − window_left and t ≤ p + window_right when set — key by key, on random
// geometries, with the properties the kernels rely on: one contiguous range per row, both ends
// never decreasing with the row, and VisitedTiles covering exactly the tiles holding a key some
// row of a block sees.
TEST(GeometryTest, VisibleFollowsThePositionsAndTheWindow) {
  std::mt19937_64 rng(14);
  std::uniform_int_distribution<int64_t> length(1, 23), position(0, 40), window(0, 9);
  for (int trial = 0; trial < 2000; ++trial) {
    Geometry g;
    g.query_len = length(rng);
    g.key_len = length(rng);
    g.key_position = position(rng);
    g.query_position = trial % 3 == 0 ? g.key_position + g.key_len - g.query_len : position(rng);
    g.causal = trial % 5 != 0;
    g.window_left = trial % 4 == 0 ? kUnbounded : window(rng);
    g.window_right = trial % 7 < 4 ? kUnbounded : window(rng);
    const int64_t block_k = 1 + trial % 7;
    KeyRange previous{0, 0};
    for (int64_t row = 0; row < g.query_len; ++row) {
      const int64_t p = g.query_position + row;
      KeyRange expected{-1, -1};
      for (int64_t key = 0; key < g.key_len; ++key) {
        const int64_t t = g.key_position + key;
        const bool sees = (!g.causal || t <= p) &&
                          (g.window_left == kUnbounded || t >= p - g.window_left) &&
                          (g.window_right == kUnbounded || t <= p + g.window_right);
        const Hidden why = g.HiddenBy(row, key);
        ASSERT_EQ(why == Hidden::kNone, sees) << "row " << row << " key " << key;
        if (!sees) {
          ASSERT_EQ(why == Hidden::kCausal, g.causal && t > p);
          continue;
        }
        if (expected.begin < 0) expected = {key, key};
        ASSERT_EQ(key, expected.end) << "the keys a row sees must be contiguous";
        expected.end = key + 1;
      }
      const KeyRange visible = g.Visible(row);
      SCOPED_TRACE(::testing::Message() << "row " << row << " trial " << trial);
      ASSERT_EQ(visible.size(), expected.begin < 0 ? 0 : expected.size());
      if (expected.begin >= 0) {
        ASSERT_EQ(visible.begin, expected.begin);
        ASSERT_EQ(visible.end, expected.end);
      }
      ASSERT_GE(visible.begin, previous.begin) << "the range's start must not decrease";
      ASSERT_GE(visible.end, previous.end) << "the range's end must not decrease";
      previous = visible;
      int64_t in_tiles = 0;
      for (int64_t begin = 0; begin < g.key_len; begin += block_k) {
        in_tiles += g.VisibleKeysIn(row, begin, block_k);
      }
      ASSERT_EQ(in_tiles, visible.size());
      // VisitedTiles for the block of rows [first, row]: every tile some row sees, and the
      // first and last of them hold a key a row sees.
      const int64_t first = row / 3 * 3;
      const KeyRange tiles = g.VisitedTiles(first, row, block_k);
      bool any = false;
      for (int64_t r = first; r <= row; ++r) {
        const KeyRange v = g.Visible(r);
        if (v.size() == 0) continue;
        any = true;
        ASSERT_GE(v.begin / block_k, tiles.begin);
        ASSERT_LE((v.end + block_k - 1) / block_k, tiles.end);
      }
      ASSERT_EQ(tiles.size() > 0, any);
    }
  }
}

TEST(GeometryTest, DefaultsAreBottomRight) {
  const Geometry g = Geometry::BottomRight(/*query_len=*/5, /*key_len=*/3, /*causal=*/true);
  EXPECT_EQ(g.query_position, -2);  // The first two rows see no key.
  EXPECT_EQ(g.Visible(0).size(), 0);
  EXPECT_EQ(g.Visible(1).size(), 0);
  EXPECT_EQ(g.Visible(2).end, 1);
  EXPECT_EQ(g.Visible(4).end, 3);
  Problem problem;
  problem.shape = MakeShape(1, 1, 1, 5, 3, 4, 4);
  problem.causal = true;
  problem.key_position = 7;  // Moving the keys moves the default queries with them.
  EXPECT_EQ(problem.geometry().query_position, 5);
  EXPECT_EQ(problem.Visible(2).end, 1);
  problem.query_position = 7;  // Row i now sits at key i.
  EXPECT_EQ(problem.Visible(0).end, 1);
  EXPECT_EQ(problem.Visible(2).end, 3);
  EXPECT_EQ(problem.VisiblePairs(), 1 + 2 + 3 + 3 + 3);
  problem.window_left = 1;  // Row i now sees keys i − 1 and i only.
  EXPECT_EQ(problem.Visible(2).begin, 1);
  EXPECT_EQ(problem.VisiblePairs(), 1 + 2 + 2 + 1 + 0);
}

// Windows at the ends of the position range: no bound overflows.
TEST(GeometryTest, WindowsAtTheLimitsDoNotOverflow) {
  Geometry g = Geometry::BottomRight(3, 5, /*causal=*/false, /*key_position=*/kMaxPosition);
  g.window_left = kMaxPosition;
  g.window_right = kMaxPosition;
  EXPECT_EQ(g.Visible(0).begin, 0);
  EXPECT_EQ(g.Visible(0).end, 5);
  g.key_position = 0;
  g.query_position = kMaxPosition;
  g.window_left = 0;
  g.window_right = kMaxPosition;
  EXPECT_EQ(g.Visible(2).size(), 0);  // Every key lies far left of the query.
  g.query_position = 0;
  g.key_position = kMaxPosition;
  g.window_left = kMaxPosition;
  g.window_right = 0;
  EXPECT_EQ(g.Visible(2).size(), 0);  // Every key lies far right of the query.
  g.window_right = kMaxPosition;      // Now keys at t ≤ 2 + 2^62: keys 0, 1 and 2.
  EXPECT_EQ(g.Visible(2).begin, 0);
  EXPECT_EQ(g.Visible(2).end, 3);
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

TEST_P(PositionsTest, NaiveAndTiledMatchTheReference) {
  const HostProblem host = MakeHost(GetParam());
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(backend, kernel, host);
    ExpectMatchesInItsDtype(run, host, ref);
    EXPECT_EQ(run.stats.flops, host.View().Flops());
  }
}

// The same problem through Decode: over a KV store's pages (a cache holds one sequence, so for
// batch 1), else over the contiguous tensors.
TEST_P(PositionsTest, DecodeMatchesTheReference) {
  const PositionCase& c = GetParam();
  const HostProblem host = MakeHost(c);
  CpuBackend backend(2, 0);
  const KernelRun run = RunDecode(backend, host);
  ASSERT_FALSE(run.output.empty());
  ExpectMatchesInItsDtype(run, host, ReferenceAttention(host));
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
