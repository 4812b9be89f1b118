// Sliding windows (AttentionOptions.window_left/right, kernels/geometry.h) on the CPU backend:
// Naive, Tiled and Decode against the float64 reference, which applies the window key by key
// itself (tests/reference.cc, ReferenceSees). FlashAttention's cases — left only, left and
// right, left 0 with causal (each row sees one key), a window wider than the sequence — with
// GQA, positions, bf16 and fp16, odd sizes, fresh random inputs, outputs poisoned with NaN.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
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

struct WindowCase {
  std::string name;
  Shape shape;
  bool causal = true;
  std::optional<int64_t> window_left, window_right;
  DType dtype = DType::kFloat32;
  int block_k = 5;
  int64_t key_position = 0;
  std::optional<int64_t> query_position;
};

WindowCase Case(std::string name, Shape shape, bool causal, std::optional<int64_t> window_left,
                std::optional<int64_t> window_right, DType dtype = DType::kFloat32, int block_k = 5,
                int64_t key_position = 0, std::optional<int64_t> query_position = std::nullopt) {
  return WindowCase{std::move(name), shape,   causal,       window_left,   window_right,
                    dtype,           block_k, key_position, query_position};
}

void PrintTo(const WindowCase& c, std::ostream* os) { *os << c.name; }

class WindowTest : public ::testing::TestWithParam<WindowCase> {};

HostProblem MakeHost(const WindowCase& c) {
  HostProblem host =
      RandomProblem(c.shape, c.dtype, c.causal, c.block_k, std::hash<std::string>{}(c.name));
  host.window_left = c.window_left;
  host.window_right = c.window_right;
  host.key_position = c.key_position;
  host.query_position = c.query_position;
  return host;
}

TEST_P(WindowTest, NaiveAndTiledMatchTheReference) {
  const HostProblem host = MakeHost(GetParam());
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(backend, kernel, host);
    ExpectMatchesInItsDtype(run, host, ref);
    // FLOPs count the pairs the window leaves, as the reference sees them.
    double pairs = 0;
    for (int64_t i = 0; i < host.shape.query_len; ++i) {
      for (int64_t j = 0; j < host.shape.key_len; ++j) pairs += ReferenceSees(host, i, j);
    }
    EXPECT_EQ(run.stats.flops,
              pairs * host.shape.batch * host.shape.heads * host.View().FlopsPerPair());
  }
}

// Decode over a KV store's pages (batch 1), else over the contiguous tensors.
TEST_P(WindowTest, DecodeMatchesTheReference) {
  const WindowCase& c = GetParam();
  const HostProblem host = MakeHost(c);
  CpuBackend backend(2, 0);
  const KernelRun run = RunDecode(backend, host);
  ASSERT_FALSE(run.output.empty());
  ExpectMatchesInItsDtype(run, host, ReferenceAttention(host));
}

INSTANTIATE_TEST_SUITE_P(
    Windows, WindowTest,
    ::testing::Values(
        // Mistral's shape of window: causal, left only; several tiles hidden on both sides.
        Case("CausalLeft", MakeShape(1, 4, 2, 67, 67, 16, 16), true, 9, std::nullopt),
        // Left 0 with causal: each row sees only the key at its own position.
        Case("CausalLeftZero", MakeShape(2, 2, 1, 23, 23, 9, 7), true, 0, std::nullopt),
        // Left and right without causal.
        Case("TwoSided", MakeShape(1, 3, 3, 41, 53, 12, 10), false, 6, 3),
        // Right only, non-causal; more keys than queries (bottom-right).
        Case("RightOnly", MakeShape(1, 2, 2, 19, 37, 8, 8), false, std::nullopt, 4),
        // A window wider than the sequence: the plain causal answer.
        Case("WiderThanTheSequence", MakeShape(1, 2, 1, 17, 17, 11, 13), true, 1000, 1000),
        // More queries than keys: the first rows see no key at all.
        Case("MoreQueriesThanKeys", MakeShape(1, 2, 2, 31, 13, 7, 7), true, 3, std::nullopt),
        // A slice of the keys placed by positions, windowed: rows see part of it or nothing.
        Case("SliceOfTheKeys", MakeShape(1, 2, 2, 25, 19, 10, 10), true, 7, std::nullopt,
             DType::kFloat32, 4, 30, 26),
        // One-row decode shapes: the last query sees the window's last keys only.
        Case("OneQueryRow", MakeShape(1, 8, 2, 1, 301, 16, 16), true, 40, std::nullopt,
             DType::kFloat32, 32),
        Case("Bf16", MakeShape(1, 4, 2, 29, 33, 32, 24), true, 10, std::nullopt, DType::kBFloat16,
             8),
        Case("Fp16TwoSided", MakeShape(1, 2, 2, 21, 21, 20, 20), false, 5, 5, DType::kFloat16, 6)),
    [](const ::testing::TestParamInfo<WindowCase>& info) { return info.param.name; });

}  // namespace
