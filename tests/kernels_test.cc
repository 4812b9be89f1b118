// The CPU backend's own checks, and the CPU backend for the suite every backend runs
// (tests/backend_suite.h: tests/backend_kernels_test.cc, tests/backend_trace_test.cc): Naive's
// row computation on the seed's example, outputs bit-identical for any thread count, Tiled's two
// ways of packing key tiles, Naive's kept matrices, and which vector path the environment picks
// (each ctest run of this binary — default, ATTN_CPU_AVX2=1, ATTN_CPU_BASELINE=1 — tests the
// kernels it says it tests).
//
// As in the shared suite: outputs poisoned with NaN, fresh uniform(-1, 1) inputs with a seed per
// case, odd sizes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/naive.h"
#include "kernels/problem.h"
#include "tests/backend_suite.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace attn::testing {

// kernels_test runs the shared suites over the CPU backend alone (gpu_test runs them over CUDA).
const std::vector<SuiteBackend>& SuiteBackends() {
  static const std::vector<SuiteBackend>* const backends = new std::vector<SuiteBackend>{{
      .name = "Cpu",
      .open = [](const SuiteOptions& options) -> absl::StatusOr<std::unique_ptr<Backend>> {
        return std::make_unique<CpuBackend>(
            options.threads, options.max_naive_bytes, CpuBackend::kDefaultMaxPackedHeadBytes,
            options.kv_page_tokens > 0 ? options.kv_page_tokens : CpuBackend::kDefaultKvPageTokens);
      },
      .must_open = [] { return true; },
      .traits = {.tiled_rounds_probabilities = false,
                 .trace_is_tiled_bit_for_bit = true,
                 .naive_bits_ignore_grouping = true},
  }};
  return *backends;
}

}  // namespace attn::testing

namespace {

using namespace attn;
using namespace attn::testing;

// ---------------------------------------------------------------------------------------------
// Naive's row computation on the seed's 8×4 example.

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
TEST(NaiveRowsTest, SeedExampleTiedKeysShareTheWeight) {
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

// With the queries × 1000 (scores in the thousands) Naive's row weights stay finite and the tied
// keys take half the weight each.
TEST(NaiveRowsTest, SeedExampleHugeScoresKeepTheTie) {
  const HostProblem host = SeedExample(1000.f);
  std::vector<float> scores, weights;
  NaiveRowZero(host, scores, weights, nullptr);
  for (float w : weights) ASSERT_TRUE(std::isfinite(w));
  EXPECT_EQ(weights[0], weights[7]);
  EXPECT_NEAR(weights[0], 0.5, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Threads.

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
// Naive's kept matrices.

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

// ---------------------------------------------------------------------------------------------
// The vector path.

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
