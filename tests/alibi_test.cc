// ALiBi (AttentionOptions.alibi_slopes, kernels/score_transform.h) on the CPU backend: Naive,
// Tiled, Decode and Trace against the float64 reference, which adds −slope_h · |p − t| to each
// score from the positions itself (tests/reference.cc): GQA with causal, both sides of the query
// (non-causal), a key slice with its own positions, more query rows than keys, with a window and
// a softcap together, bf16, odd sizes, fresh random inputs, outputs poisoned with NaN.
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
#include "kernels/score_transform.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

struct AlibiCase {
  std::string name;
  Shape shape;
  bool causal = false;
  float slope_base = 0.5f;  // Head h's slope: slope_base^(h + 1) (BLOOM's geometric slopes).
  std::optional<int64_t> window_left = std::nullopt;
  float softcap = 0.f;
  int64_t key_position = 0;
  std::optional<int64_t> query_position = std::nullopt;
  DType dtype = DType::kFloat32;
  int block_k = 7;
};

void PrintTo(const AlibiCase& c, std::ostream* os) { *os << c.name; }

class AlibiTest : public ::testing::TestWithParam<AlibiCase> {};

HostProblem MakeHost(const AlibiCase& c) {
  HostProblem host =
      RandomProblem(c.shape, c.dtype, c.causal, c.block_k, std::hash<std::string>{}(c.name));
  float slope = 1.f;
  for (int64_t h = 0; h < c.shape.heads; ++h) host.alibi_slopes.push_back(slope *= c.slope_base);
  host.window_left = c.window_left;
  host.softcap = c.softcap;
  host.key_position = c.key_position;
  host.query_position = c.query_position;
  return host;
}

TEST_P(AlibiTest, NaiveTiledAndDecodeMatchTheReference) {
  CpuBackend backend(2, 0);
  ExpectNaiveTiledAndDecodeMatch(backend, MakeHost(GetParam()));
}

// The biased answer differs from the unbiased one: the test would notice a kernel ignoring it.
TEST_P(AlibiTest, TheBiasChangesTheAnswer) {
  HostProblem host = MakeHost(GetParam());
  const Reference biased = ReferenceAttention(host);
  host.alibi_slopes.clear();
  const Reference plain = ReferenceAttention(host);
  EXPECT_GT(LargestOutputDifference(biased, plain), 1e-2);
}

// Traced rows of the first and last heads (two slopes): each step's scores are the head's
// transform of its scaled_scores at the key's distance (−inf where masked; to an ulp or two),
// that bias is the reference's, and each row's output the reference's within 1e-5.
TEST_P(AlibiTest, TraceScoresCarryTheBias) {
  const HostProblem host = MakeHost(GetParam());
  const Problem problem = host.View();
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  const Shape& s = host.shape;
  const std::vector<RowRef> rows = {{0, 0, s.query_len / 2}, {s.batch - 1, s.heads - 1, 0}};
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, rows);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  TraceItem item;
  while ((*cursor)->Next(&item)) {
    if (const TraceStep* step = std::get_if<TraceStep>(&item)) {
      const ScoreTransform transform = problem.transform(step->row.head);
      ASSERT_EQ(step->scaled_scores.size(), step->scores.size());
      for (size_t j = 0; j < step->scores.size(); ++j) {
        const int64_t key = step->key_begin + static_cast<int64_t>(j);
        const int64_t distance = ReferenceDistance(host, step->row.row, key);
        EXPECT_NEAR(transform.Bias(static_cast<float>(distance)),
                    ReferenceBias(host, step->row.head, step->row.row, key), 1e-6)
            << "key " << key;
        if (!ReferenceSees(host, step->row.row, key)) {
          EXPECT_EQ(step->scores[j], -INFINITY) << "key " << key;
        } else {
          // Within an ulp or two: the kernels' vector clones may fuse the bias's multiply-add.
          const float want = transform(step->scaled_scores[j], distance);
          EXPECT_NEAR(step->scores[j], want, 2e-7f * std::abs(want) + 1e-30f) << "key " << key;
        }
      }
    } else {
      const TraceRowDone& done = std::get<TraceRowDone>(item);
      const int64_t offset = problem.OutputOffset(done.row.batch, done.row.head, done.row.row);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        EXPECT_NEAR(done.output[c], ref.output[offset + c], 1e-5) << "c=" << c;
        EXPECT_NEAR(done.reference[c], ref.output[offset + c], 1e-5) << "c=" << c;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Slopes, AlibiTest,
    ::testing::Values(
        // BLOOM-like: causal, GQA (4 query heads on 2 kv heads), odd sizes.
        AlibiCase{"CausalGqa", MakeShape(1, 4, 2, 29, 37, 16, 16), true},
        // Non-causal: keys on both sides of each query, biased by |p − t|.
        AlibiCase{"BothSides", MakeShape(2, 3, 1, 17, 23, 9, 7), false, 0.7f},
        // A key slice [40, 71) of a longer sequence with the whole problem's query positions.
        AlibiCase{"KeySlice", MakeShape(1, 2, 2, 13, 31, 12, 10), true, 0.6f, std::nullopt, 0.f, 40,
                  60},
        // More query rows than keys (the first rows see none when causal).
        AlibiCase{"MoreQueriesThanKeys", MakeShape(1, 2, 1, 30, 11, 8, 8), true, 0.8f},
        // All three: a causal window, a softcap and the bias.
        AlibiCase{"WindowSoftcapAlibi", MakeShape(1, 4, 2, 41, 41, 12, 10), true, 0.5f, 9, 5.f},
        AlibiCase{"Bf16", MakeShape(1, 4, 2, 19, 25, 32, 24), true, 0.5f, std::nullopt, 0.f, 0,
                  std::nullopt, DType::kBFloat16, 8}),
    [](const ::testing::TestParamInfo<AlibiCase>& info) { return info.param.name; });

// The vector and scalar paths of ScoreTransform::Apply agree with operator() key by key, for
// distances on both sides of zero.
TEST(ScoreTransformTest, ApplyMatchesTheScalarRule) {
  const ScoreTransform transform{3.f, 0.37f};
  std::vector<float> scores(37);
  for (size_t j = 0; j < scores.size(); ++j) scores[j] = std::sin(static_cast<float>(j)) * 9.f;
  std::vector<float> applied = scores;
  const int64_t distance = 11;  // Key j at 11 − j: from 11 down to −25.
  transform.Apply(applied.data(), static_cast<int64_t>(applied.size()), distance);
  for (size_t j = 0; j < scores.size(); ++j) {
    const int64_t d = distance - static_cast<int64_t>(j);
    EXPECT_EQ(applied[j], transform(scores[j], d)) << "j=" << j;
    EXPECT_NEAR(applied[j], 3.0 * std::tanh(scores[j] / 3.0) - 0.37 * std::abs(double(d)), 1e-5);
  }
}

}  // namespace
