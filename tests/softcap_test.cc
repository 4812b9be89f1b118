// Softcap (AttentionOptions.softcap, kernels/score_transform.h) on the CPU backend: Naive, Tiled,
// Decode and Trace against the float64 reference, which applies softcap · tanh(s / softcap) to
// each scaled score itself (tests/reference.cc). Queries multiplied by 32 (exact in every dtype)
// so that the scores reach far past the cap, alone and with a causal window, GQA, bf16, odd
// sizes, fresh random inputs, outputs poisoned with NaN.
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
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

struct SoftcapCase {
  std::string name;
  Shape shape;
  float softcap = 0.f;
  bool causal = false;
  std::optional<int64_t> window_left = std::nullopt;
  DType dtype = DType::kFloat32;
  int block_k = 7;
};

void PrintTo(const SoftcapCase& c, std::ostream* os) { *os << c.name; }

class SoftcapTest : public ::testing::TestWithParam<SoftcapCase> {};

// The case's problem, its queries × 32 (a power of two: exact in fp32, fp16 and bf16 alike).
HostProblem MakeHost(const SoftcapCase& c) {
  HostProblem host =
      RandomProblem(c.shape, c.dtype, c.causal, c.block_k, std::hash<std::string>{}(c.name));
  for (size_t i = 0; i < host.query.size(); ++i) {
    host.query[i] *= 32.f;
    StoreElement(host.query_bytes.data(), host.dtype, static_cast<int64_t>(i), host.query[i]);
  }
  host.softcap = c.softcap;
  host.window_left = c.window_left;
  return host;
}

TEST_P(SoftcapTest, NaiveTiledAndDecodeMatchTheReference) {
  CpuBackend backend(2, 0);
  ExpectNaiveTiledAndDecodeMatch(backend, MakeHost(GetParam()));
}

// The capped answer differs from the uncapped one: the test would notice a kernel ignoring it.
TEST_P(SoftcapTest, TheCapChangesTheAnswer) {
  HostProblem host = MakeHost(GetParam());
  const Reference capped = ReferenceAttention(host);
  host.softcap = 0.f;
  const Reference uncapped = ReferenceAttention(host);
  EXPECT_GT(LargestOutputDifference(capped, uncapped), 1e-2);
}

// A traced row: each step's scaled_scores are scale · q·k, its scores the cap of them (−inf where
// masked), and the row's output Tiled's bit for bit and the reference's within 1e-5.
TEST_P(SoftcapTest, TraceShowsTheScoreBeforeAndAfterTheCap) {
  const HostProblem host = MakeHost(GetParam());
  const Problem problem = host.View();
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  const Shape& s = host.shape;
  const RowRef row{0, s.heads - 1, s.query_len - 1};
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, {row});
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  const ScoreTransform cap{host.softcap};
  const int64_t kv_head = problem.KvHead(row.head);
  TraceItem item;
  int steps = 0;
  while ((*cursor)->Next(&item)) {
    if (const TraceStep* step = std::get_if<TraceStep>(&item)) {
      ++steps;
      ASSERT_EQ(step->scaled_scores.size(), step->scores.size());
      for (size_t j = 0; j < step->scores.size(); ++j) {
        const int64_t key = step->key_begin + static_cast<int64_t>(j);
        double dot = 0, magnitude = 0;
        for (int64_t c = 0; c < s.head_dim; ++c) {
          const double product = double(host.query[problem.QueryOffset(0, row.head, row.row) + c]) *
                                 double(host.key[problem.KeyOffset(0, kv_head, key) + c]);
          dot += product;
          magnitude += std::abs(product);
        }
        EXPECT_NEAR(step->scaled_scores[j], host.scale * dot, 1e-5 * host.scale * magnitude + 1e-30)
            << "key " << key;
        if (!ReferenceSees(host, row.row, key)) {
          EXPECT_EQ(step->scores[j], -INFINITY) << "key " << key;
        } else {
          EXPECT_EQ(step->scores[j], cap.Cap(step->scaled_scores[j])) << "key " << key;
          EXPECT_LE(std::abs(step->scores[j]), host.softcap) << "key " << key;
        }
      }
    } else {
      const TraceRowDone& done = std::get<TraceRowDone>(item);
      const int64_t offset = problem.OutputOffset(0, row.head, row.row);
      for (int64_t c = 0; c < s.value_dim; ++c) {
        EXPECT_NEAR(done.output[c], ref.output[offset + c], 1e-5) << "c=" << c;
        EXPECT_NEAR(done.reference[c], ref.output[offset + c], 1e-5) << "c=" << c;
      }
    }
  }
  const auto [first, end] = ReferenceTiles(host, row.row, problem.block_k);
  EXPECT_EQ(steps, end - first);
}

INSTANTIATE_TEST_SUITE_P(
    Softcaps, SoftcapTest,
    ::testing::Values(
        // Gemma 2's attention cap, 50, on scores up to ~100.
        SoftcapCase{"Gemma2Cap", MakeShape(1, 4, 2, 29, 37, 16, 16), 50.f},
        // A tight cap: every large score saturates near ±5.
        SoftcapCase{"TightCap", MakeShape(2, 2, 1, 17, 23, 9, 7), 5.f},
        // With a causal window (Gemma 2 alternates windowed and global layers).
        SoftcapCase{"CausalWindow", MakeShape(1, 2, 2, 41, 41, 12, 10), 30.f, true, 9},
        SoftcapCase{"Bf16", MakeShape(1, 4, 2, 19, 25, 32, 24), 20.f, true, std::nullopt,
                    DType::kBFloat16, 8}),
    [](const ::testing::TestParamInfo<SoftcapCase>& info) { return info.param.name; });

}  // namespace
