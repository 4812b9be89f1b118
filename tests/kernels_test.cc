// Naive and Tiled on the CPU backend against the float64 reference (tests/reference.h).
//
// Every run writes into outputs poisoned with NaN, so an element a kernel forgets to write fails
// the comparison. Inputs are fresh uniform(-1, 1) values with odd sizes that are not multiples
// of any tile; each case has its own seed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/naive.h"
#include "kernels/problem.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

// ---------------------------------------------------------------------------------------------
// The seed's 8×4 example.

constexpr float kSeedRow0[] = {-0.593223f, 0.406777f, -1.332858f, -0.371937f};

TEST(SeedExampleTest, FirstRowMatchesExplainerForEveryKernelAndBlockK) {
  CpuBackend backend(2, 0);
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1.f, block_k);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(backend, kernel, host);
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kSeedRow0[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
    }
  }
}

// Row 0 of the example by Naive's own row computation (its head packed as one tile, as Naive
// packs it); its output checked against the float64 reference.
void NaiveRowZero(const HostProblem& host, std::vector<float>& scores, std::vector<float>& weights,
                  float* lse) {
  const Problem problem = host.View();
  const Shape& s = problem.shape;
  KvTile head;
  head.Load(host.key.data(), host.value.data(), static_cast<int>(s.key_len),
            static_cast<int>(s.head_dim), static_cast<int>(s.value_dim), problem.scale);
  scores.assign(s.key_len, NAN);
  weights.assign(s.key_len, NAN);
  std::vector<float> out(AccStride(static_cast<int>(s.value_dim)), NAN);
  NaiveRows(problem, host.query.data(), head, 0, 0, 1, scores.data(), weights.data(), lse,
            out.data());
  const Reference ref = ReferenceAttention(host);
  for (int64_t c = 0; c < s.value_dim; ++c) EXPECT_NEAR(out[c], ref.output[c], 1e-5) << "c=" << c;
}

// Keys 0 and 7 of the example are identical, so row 0 gives them the same score and weight
// (through Naive's own row computation).
TEST(SeedExampleTest, TiedKeysShareTheWeight) {
  const HostProblem host = SeedExample();
  std::vector<float> scores, weights;
  float lse = 0;
  NaiveRowZero(host, scores, weights, &lse);
  EXPECT_EQ(scores[0], 2.f);
  EXPECT_EQ(scores[7], 2.f);
  EXPECT_EQ(weights[0], weights[7]);
  EXPECT_NEAR(weights[0], 0.304404, 1e-6);
  EXPECT_NEAR(lse, ReferenceAttention(host).lse[0], 1e-6);
  double sum = 0;
  for (float w : weights) sum += w;
  EXPECT_NEAR(sum, 1.0, 1e-6);
}

// Multiplying the queries by 1000 makes scores in the thousands: exp would overflow without the
// running max. Keys 0 and 7 still tie and now take (almost) all the weight, so row 0 is the
// mean of value rows 0 and 7: [-0.5, 0.5, -3, -2].
TEST(SeedExampleTest, HugeScoresStayFiniteAndTied) {
  constexpr float kExpected[] = {-0.5f, 0.5f, -3.f, -2.f};
  CpuBackend backend(2, 0);
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1000.f, block_k);
    const Reference ref = ReferenceAttention(host);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(backend, kernel, host);
      for (float x : run.output) ASSERT_TRUE(std::isfinite(x));
      for (float x : run.lse) ASSERT_TRUE(std::isfinite(x));
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kExpected[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ref, 1e-5);
    }
  }

  const HostProblem host = SeedExample(1000.f);
  std::vector<float> scores, weights;
  NaiveRowZero(host, scores, weights, nullptr);
  for (float w : weights) ASSERT_TRUE(std::isfinite(w));
  EXPECT_EQ(weights[0], weights[7]);
  EXPECT_NEAR(weights[0], 0.5, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Random fp32 problems against the float64 reference.

struct RandomCase {
  std::string name;
  Shape shape;
  bool causal = false;
  int block_k = 16;  // Passed to the kernel as is, even when larger than key_len.
  int threads = 2;
};

void PrintTo(const RandomCase& c, std::ostream* os) { *os << c.name; }

class RandomFp32Test : public ::testing::TestWithParam<RandomCase> {};

TEST_P(RandomFp32Test, NaiveAndTiledMatchFloat64Reference) {
  const RandomCase& c = GetParam();
  const uint64_t seed = std::hash<std::string>{}(c.name);
  const HostProblem host = RandomProblem(c.shape, DType::kFloat32, c.causal, c.block_k, seed);
  Problem problem = host.View();
  problem.block_k = c.block_k;  // View() clamps to key_len; the kernels must not need that.
  const Reference ref = ReferenceAttention(host);
  CpuBackend backend(c.threads, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(backend, kernel, host, problem);
    ExpectMatchesReference(run, ref, 1e-5);
    if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(run, host);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RandomFp32Test,
    ::testing::Values(
        RandomCase{"FewerQueriesThanKeys", MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16, 2},
        RandomCase{"MoreQueriesThanKeys", MakeShape(1, 2, 2, 61, 29, 15, 15), false, 7, 3},
        RandomCase{"BlockK1", MakeShape(1, 1, 1, 13, 19, 9, 9), false, 1, 1},
        RandomCase{"BlockK7", MakeShape(1, 3, 3, 41, 47, 11, 11), false, 7, 2},
        RandomCase{"BlockK64", MakeShape(1, 2, 2, 71, 150, 13, 13), false, 64, 2},
        RandomCase{"BlockKLargerThanKeys", MakeShape(1, 2, 2, 23, 29, 7, 7), false, 100, 2},
        RandomCase{"HeadDim1", MakeShape(1, 2, 2, 31, 27, 1, 5), false, 8, 2},
        RandomCase{"HeadDim33", MakeShape(1, 2, 2, 29, 35, 33, 33), false, 16, 2},
        RandomCase{"ValueDimDiffers", MakeShape(1, 2, 2, 29, 35, 33, 20), false, 16, 2},
        RandomCase{"Gqa6Over2", MakeShape(1, 6, 2, 19, 23, 9, 11), false, 5, 3},
        RandomCase{"Gqa6Over3", MakeShape(1, 6, 3, 19, 23, 9, 7), false, 5, 2},
        RandomCase{"Gqa4Over1", MakeShape(1, 4, 1, 19, 23, 9, 9), false, 5, 2},
        RandomCase{"Batch2", MakeShape(2, 3, 3, 67, 43, 10, 12), false, 16, 2},
        RandomCase{"CausalSquare", MakeShape(1, 2, 2, 45, 45, 8, 8), true, 7, 2},
        RandomCase{"CausalFewerQueries", MakeShape(1, 2, 2, 37, 53, 17, 17), true, 16, 2},
        RandomCase{"CausalMoreQueries", MakeShape(1, 2, 2, 61, 29, 15, 15), true, 7, 3},
        RandomCase{"CausalMoreQueriesBlockK1", MakeShape(1, 1, 1, 20, 9, 3, 4), true, 1, 1},
        RandomCase{"CausalGqaBatch2", MakeShape(2, 6, 2, 70, 83, 12, 9), true, 16, 3},
        RandomCase{"CausalBlockKLargerThanKeys", MakeShape(1, 2, 1, 33, 21, 6, 6), true, 64, 2},
        RandomCase{"LongRows", MakeShape(1, 1, 1, 131, 293, 24, 16), false, 64, 2}),
    [](const ::testing::TestParamInfo<RandomCase>& info) { return info.param.name; });

// The thread pool hands row blocks to workers dynamically, but a row's arithmetic must not depend
// on which worker ran it or how many there were.
TEST(ThreadsTest, OutputsAreBitIdenticalForAnyThreadCount) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    // 150 rows = 3 row blocks per head, 12 heads in all: more tasks than workers.
    const HostProblem host = RandomProblem(MakeShape(2, 6, 2, 150, 97, 11, 13), dtype,
                                           /*causal=*/true, 16, 1000 + static_cast<int>(dtype));
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(dtype));
      CpuBackend one(1, 0);
      const KernelRun baseline = RunKernel(one, kernel, host);
      const Reference ref = ReferenceAttention(host);
      ExpectOutputMatches(baseline, ref, dtype == DType::kFloat32 ? 1e-5 : 1e-2);
      ExpectLseMatches(baseline, ref, 1e-5);
      for (int threads : {2, 3}) {
        CpuBackend backend(threads, 0);
        const KernelRun run = RunKernel(backend, kernel, host);
        ASSERT_EQ(run.output_bytes.size(), baseline.output_bytes.size());
        EXPECT_EQ(std::memcmp(run.output_bytes.data(), baseline.output_bytes.data(),
                              run.output_bytes.size()),
                  0)
            << "threads=" << threads;
        EXPECT_EQ(std::memcmp(run.lse.data(), baseline.lse.data(), run.lse.size() * sizeof(float)),
                  0)
            << "threads=" << threads;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tiled's packed key tiles: kept per head by each worker while they fit the backend's
// max_packed_head_bytes, packed again for every row block past it (kernels/cpu/tiled.cc). Both
// paths meet the float64 reference and give the same bits: KvTile's sums do not depend on
// which path packed the tile.

TEST(PackedTilesTest, PackingAgainForEveryBlockMatchesTheReferenceAndTheKeptTiles) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    for (bool causal : {false, true}) {
      // 301 rows: three row blocks per head, so blocks of one head follow each other on a worker.
      const Shape shape = MakeShape(2, 4, 2, 301, 157, 19, 13);
      const HostProblem host =
          RandomProblem(shape, dtype, causal, 23, 2000 + 2 * static_cast<int>(dtype) + causal);
      const Problem problem = host.View();
      const int64_t head_bytes =
          problem.TilesPerRow() * KvTile::PackedBytes(problem.block_k,
                                                      static_cast<int>(shape.head_dim),
                                                      static_cast<int>(shape.value_dim));
      const Reference ref = ReferenceAttention(host);
      CpuBackend kept(3, 0, head_bytes);  // Exactly fits: each head packed once per worker.
      const KernelRun baseline = RunKernel(kept, Kernel::kTiled, host);
      for (int64_t limit : {head_bytes - 1, int64_t{1}, int64_t{0}}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << (causal ? " causal" : "")
                                          << " max_packed_head_bytes=" << limit);
        CpuBackend repacking(3, 0, limit);
        const KernelRun run = RunKernel(repacking, Kernel::kTiled, host);
        ExpectOutputMatches(run, ref, dtype == DType::kFloat32 ? 1e-5 : 1e-2);
        ExpectLseMatches(run, ref, 1e-5);
        if (causal && shape.query_len > shape.key_len) ExpectUnseeingRowsZero(run, host);
        EXPECT_EQ(run.output_bytes, baseline.output_bytes);
        EXPECT_EQ(std::memcmp(run.lse.data(), baseline.lse.data(), run.lse.size() * sizeof(float)),
                  0);
      }
      ExpectOutputMatches(baseline, ref, dtype == DType::kFloat32 ? 1e-5 : 1e-2);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fp16 and bf16 storage.

struct LowPrecisionCase {
  std::string name;
  DType dtype;
  Shape shape;
  bool causal;
  int block_k;
};

void PrintTo(const LowPrecisionCase& c, std::ostream* os) { *os << c.name; }

class LowPrecisionTest : public ::testing::TestWithParam<LowPrecisionCase> {};

// The FlashAttention rule: error against float64 (on the same rounded inputs) at most twice the
// error of an eager same-precision implementation, plus a small atol. The atol is a couple of
// output ulps (fp16 ulp at 1 is 2^-10 ≈ 1e-3, bf16's 2^-7 ≈ 8e-3): the kernel's own output
// rounding alone costs half an ulp, and on a small problem the baseline can be lucky enough that
// 2× its error is below that.
TEST_P(LowPrecisionTest, ErrorWithinTwiceTheSamePrecisionBaseline) {
  const LowPrecisionCase& c = GetParam();
  const uint64_t seed = std::hash<std::string>{}(c.name);
  const HostProblem host = RandomProblem(c.shape, c.dtype, c.causal, c.block_k, seed);
  ASSERT_EQ(host.output_dtype, c.dtype);
  const Reference ref = ReferenceAttention(host);
  const double baseline_error = MaxAbsError(LowPrecisionBaseline(host, c.dtype), ref.output);
  ASSERT_TRUE(std::isfinite(baseline_error));
  const double atol = c.dtype == DType::kFloat16 ? 1e-3 : 1e-2;
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(backend, kernel, host);
    ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 2));
    const double error = MaxAbsError(run.output, ref.output);
    EXPECT_LE(error, 2 * baseline_error + atol) << "baseline error " << baseline_error;
    // Accumulation is fp32 and lse is stored as fp32, so lse meets the fp32 bound.
    ExpectLseMatches(run, ref, 1e-5);
    if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(run, host);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, LowPrecisionTest,
    ::testing::Values(
        LowPrecisionCase{"F16", DType::kFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
        LowPrecisionCase{"F16CausalGqa", DType::kFloat16, MakeShape(2, 6, 3, 61, 29, 33, 20), true,
                         7},
        LowPrecisionCase{"Bf16", DType::kBFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
        LowPrecisionCase{"Bf16CausalGqa", DType::kBFloat16, MakeShape(2, 4, 1, 45, 71, 9, 13), true,
                         3}),
    [](const ::testing::TestParamInfo<LowPrecisionCase>& info) { return info.param.name; });

// Low-precision inputs with an fp32 output: the only rounding left is the inputs', which the
// reference shares, so the fp32 bound applies.
TEST(MixedDtypeTest, LowPrecisionInputWithFp32OutputMeetsFp32Bound) {
  CpuBackend backend(2, 0);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    HostProblem host = RandomProblem(MakeShape(1, 4, 2, 43, 57, 19, 11), dtype, /*causal=*/true, 8,
                                     77 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    const Reference ref = ReferenceAttention(host);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(dtype));
      const KernelRun run = RunKernel(backend, kernel, host);
      ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 4));
      ExpectMatchesReference(run, ref, 1e-5);
    }
  }
}

// An fp32 problem with a bf16/fp16 output: the kernel computes exactly what it does for an fp32
// output and rounds only the store (to nearest even).
TEST(MixedDtypeTest, LowPrecisionOutputOnlyRoundsTheStore) {
  CpuBackend backend(2, 0);
  HostProblem host = RandomProblem(MakeShape(1, 3, 3, 29, 41, 13, 9), DType::kFloat32,
                                   /*causal=*/false, 8, 4242);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    host.output_dtype = DType::kFloat32;
    const KernelRun fp32 = RunKernel(backend, kernel, host);
    for (DType output_dtype : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(output_dtype));
      host.output_dtype = output_dtype;
      const KernelRun run = RunKernel(backend, kernel, host);
      ASSERT_EQ(run.output_bytes.size(), fp32.output.size() * 2);
      for (size_t i = 0; i < fp32.output.size(); ++i) {
        uint16_t stored;
        std::memcpy(&stored, run.output_bytes.data() + 2 * i, 2);
        const uint16_t expected = output_dtype == DType::kFloat16 ? FloatToHalf(fp32.output[i])
                                                                  : FloatToBFloat16(fp32.output[i]);
        ASSERT_EQ(stored, expected) << "element " << i;
      }
      EXPECT_EQ(std::memcmp(run.lse.data(), fp32.lse.data(), run.lse.size() * sizeof(float)), 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Reported costs.

TEST(StatsTest, NaiveReportsItsMatrices) {
  CpuBackend backend(2, 0);
  const Shape shape = MakeShape(2, 3, 1, 37, 53, 9, 7);
  const HostProblem host = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 16, 9);
  const KernelRun run = RunKernel(backend, Kernel::kNaive, host);
  const int64_t matrix = 2 * 3 * 37 * 53;
  EXPECT_EQ(run.stats.intermediate_bytes, 16 * matrix);
  EXPECT_GE(run.stats.scratch_bytes, 8 * matrix);
  EXPECT_EQ(run.stats.flops, host.View().Flops());
  EXPECT_EQ(run.stats.flops, double(matrix) * 2 * (9 + 7));
  EXPECT_GE(run.stats.peak_memory_bytes, run.stats.scratch_bytes);
  ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
}

TEST(StatsTest, TiledNeverAllocatesTheScoreMatrix) {
  CpuBackend backend(2, 0);
  constexpr int64_t n = 1024;
  const HostProblem host =
      RandomProblem(MakeShape(1, 1, 1, n, n, 16, 16), DType::kFloat32, /*causal=*/false, 64, 10);
  const KernelRun run = RunKernel(backend, Kernel::kTiled, host);
  EXPECT_EQ(run.stats.intermediate_bytes, 0);
  EXPECT_GT(run.stats.scratch_bytes, 0);
  EXPECT_LT(run.stats.scratch_bytes, 8 * n * n);
  EXPECT_EQ(run.stats.block_k, 64);
  EXPECT_EQ(run.stats.flops, host.View().Flops());
  EXPECT_EQ(run.stats.flops, double(n) * n * 2 * (16 + 16));
  ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
}

// FLOPs count only unmasked pairs: with Nq = Nk = n the causal mask leaves n(n+1)/2 of them.
TEST(StatsTest, CausalCountsOnlyVisiblePairs) {
  CpuBackend backend(2, 0);
  const Shape shape = MakeShape(1, 2, 2, 47, 47, 5, 3);
  const HostProblem full = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 8, 11);
  const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 8, 12);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun full_run = RunKernel(backend, kernel, full);
    const KernelRun causal_run = RunKernel(backend, kernel, causal);
    EXPECT_EQ(causal_run.stats.flops, causal.View().Flops());
    EXPECT_EQ(causal_run.stats.flops, 2.0 * (47 * 48 / 2) * 2 * (5 + 3));
    EXPECT_LT(causal_run.stats.flops, full_run.stats.flops);
  }
  // Bottom-right alignment with Nq < Nk: row i sees i + (Nk − Nq) + 1 keys.
  const HostProblem wide = RandomProblem(MakeShape(1, 1, 1, 5, 9, 2, 2), DType::kFloat32,
                                         /*causal=*/true, 4, 13);
  EXPECT_EQ(wide.View().Flops(), (5.0 + 6 + 7 + 8 + 9) * 2 * (2 + 2));
}

// ---------------------------------------------------------------------------------------------
// Layout rules checked without Problem's own helpers (which the reference shares, so a mistake
// there would cancel out in every comparison above).

// An fp32 HostProblem over explicit values.
HostProblem FromValues(const Shape& shape, std::vector<float> query, std::vector<float> key,
                       std::vector<float> value, float scale, bool causal, int block_k) {
  HostProblem p;
  p.shape = shape;
  p.scale = scale;
  p.causal = causal;
  p.block_k = block_k;
  auto bytes = [](const std::vector<float>& values) {
    std::vector<uint8_t> out(values.size() * sizeof(float));
    std::memcpy(out.data(), values.data(), out.size());
    return out;
  };
  p.query_bytes = bytes(query);
  p.key_bytes = bytes(key);
  p.value_bytes = bytes(value);
  p.query = std::move(query);
  p.key = std::move(key);
  p.value = std::move(value);
  return p;
}

// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads). The same
// problem with each key/value head copied out to its query heads must give the same bits.
TEST(LayoutTest, GqaHeadReadsItsGroupsKeyValueHead) {
  const Shape shape = MakeShape(2, 6, 2, 19, 23, 9, 11);
  const HostProblem gqa = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 5, 21);
  Shape expanded_shape = shape;
  expanded_shape.kv_heads = shape.heads;
  const int64_t group = shape.heads / shape.kv_heads;
  std::vector<float> key, value;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t source = b * shape.kv_heads + h / group;
      key.insert(key.end(), gqa.key.begin() + source * shape.key_len * shape.head_dim,
                 gqa.key.begin() + (source + 1) * shape.key_len * shape.head_dim);
      value.insert(value.end(), gqa.value.begin() + source * shape.key_len * shape.value_dim,
                   gqa.value.begin() + (source + 1) * shape.key_len * shape.value_dim);
    }
  }
  const HostProblem expanded =
      FromValues(expanded_shape, gqa.query, key, value, gqa.scale, gqa.causal, gqa.block_k);
  const Reference ref = ReferenceAttention(expanded);
  CpuBackend backend(2, 0);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun grouped_run = RunKernel(backend, kernel, gqa);
    const KernelRun expanded_run = RunKernel(backend, kernel, expanded);
    ExpectMatchesReference(grouped_run, ref, 1e-5);
    EXPECT_EQ(grouped_run.output_bytes, expanded_run.output_bytes);
  }
}

// Bottom-right causal alignment: query row i of Nq sees keys 0 … i + Nk − Nq, so its output
// is non-causal attention of that one row over that prefix of the keys.
TEST(LayoutTest, CausalMaskIsBottomRightAligned) {
  CpuBackend backend(2, 0);
  for (const auto& [query_len, key_len] : {std::pair<int64_t, int64_t>{5, 9}, {9, 5}, {7, 7}}) {
    const Shape shape = MakeShape(1, 1, 1, query_len, key_len, 6, 4);
    const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 3,
                                             static_cast<uint64_t>(query_len * 100 + key_len));
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message()
                   << KernelName(kernel) << " Nq=" << query_len << " Nk=" << key_len);
      const KernelRun run = RunKernel(backend, kernel, causal);
      for (int64_t i = 0; i < query_len; ++i) {
        const int64_t visible = i + key_len - query_len + 1;
        const float* row_out = &run.output[i * shape.value_dim];
        if (visible <= 0) {
          for (int64_t c = 0; c < shape.value_dim; ++c) EXPECT_EQ(row_out[c], 0.f) << "row " << i;
          EXPECT_EQ(run.lse[i], -INFINITY) << "row " << i;
          continue;
        }
        const HostProblem prefix = FromValues(
            MakeShape(1, 1, 1, 1, visible, shape.head_dim, shape.value_dim),
            std::vector<float>(causal.query.begin() + i * shape.head_dim,
                               causal.query.begin() + (i + 1) * shape.head_dim),
            std::vector<float>(causal.key.begin(), causal.key.begin() + visible * shape.head_dim),
            std::vector<float>(causal.value.begin(),
                               causal.value.begin() + visible * shape.value_dim),
            causal.scale, /*causal=*/false, 3);
        const Reference ref = ReferenceAttention(prefix);
        for (int64_t c = 0; c < shape.value_dim; ++c) {
          EXPECT_NEAR(row_out[c], ref.output[c], 1e-5 * std::max(1.0, MaxAbs(ref.output)))
              << "row " << i << " c=" << c;
        }
        EXPECT_NEAR(run.lse[i], ref.lse[0], 1e-5 * std::max(1.0, std::abs(ref.lse[0])));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Naive's memory budget.

TEST(BudgetTest, NaiveOverBudgetNamesTiledWhichSucceeds) {
  CpuBackend backend(2, /*max_naive_bytes=*/1000);
  const HostProblem host = RandomProblem(MakeShape(1, 1, 1, 64, 64, 8, 8), DType::kFloat32,
                                         /*causal=*/false, 16, 14);
  PoisonedOutputs outputs(host);
  const absl::StatusOr<Stats> naive = backend.Naive(host.View(), outputs.outputs());
  ASSERT_FALSE(naive.ok());
  EXPECT_EQ(naive.status().code(), absl::StatusCode::kResourceExhausted) << naive.status();
  EXPECT_NE(naive.status().message().find("Tiled"), std::string_view::npos) << naive.status();

  const KernelRun tiled = RunKernel(backend, Kernel::kTiled, host);
  ExpectMatchesReference(tiled, ReferenceAttention(host), 1e-5);
}

}  // namespace

namespace {

// The run-time dispatch takes the path the environment asks for, so each ctest run of this suite
// (default, ATTN_CPU_AVX2=1, ATTN_CPU_BASELINE=1) tests the kernels it says it tests.
TEST(CpuDispatchTest, TheEnvironmentPicksThePath) {
  const std::string path = ::CpuKernelPath();
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
#else
  const bool avx2 = false, avx512 = false;
#endif
  std::string expected = avx512 ? "avx512" : (avx2 ? "avx2" : "baseline");
  if (std::getenv("ATTN_CPU_AVX2") != nullptr && avx2) expected = "avx2";
  if (std::getenv("ATTN_CPU_BASELINE") != nullptr) expected = "baseline";
  EXPECT_EQ(path, expected);
  std::printf("CPU kernels: %s\n", path.c_str());
}

}  // namespace

namespace {

using namespace attn;
using namespace attn::testing;

// Naive keeps its matrices' memory from one call for the next (NaiveStorage): a smaller, causal
// problem after a larger one (whose scores are still in that memory) is still exact, rows that
// see no key included, and so is a larger one after it (a new block).
TEST(NaiveStorageTest, KeptMatricesNeverLeakIntoTheNextAnswer) {
  CpuBackend backend(2, 0);
  const HostProblem large =
      RandomProblem(MakeShape(1, 3, 3, 61, 67, 9, 9), DType::kFloat32, false, 16, 901);
  const HostProblem small =
      RandomProblem(MakeShape(1, 2, 1, 37, 21, 9, 5), DType::kFloat32, true, 16, 902);
  const HostProblem larger =
      RandomProblem(MakeShape(2, 2, 2, 70, 81, 7, 11), DType::kFloat32, true, 16, 903);
  for (const HostProblem* host : {&large, &small, &larger, &small}) {
    const KernelRun run = RunKernel(backend, Kernel::kNaive, *host);
    ExpectMatchesReference(run, ReferenceAttention(*host), 1e-5);
    if (host->causal && host->shape.query_len > host->shape.key_len) {
      ExpectUnseeingRowsZero(run, *host);
    }
  }
}

}  // namespace
