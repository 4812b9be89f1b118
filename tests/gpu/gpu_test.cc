// The CUDA backend: the suite every backend runs (tests/backend_suite.h:
// tests/backend_kernels_test.cc, tests/backend_trace_test.cc) over it, and what only the device
// has: its head-size limit, the fallback under a device's shared-memory limit, the device it
// describes, its pool of streams serving concurrent requests, and Tiled's plan (TiledPlanTest:
// host code, which runs without a device). Its KV caches: tests/gpu/kv_cache_test.cc.
//
// Without a CUDA device every test that needs one reports SKIPPED with the reason; with a
// device that the backend cannot open, or with ATTN_REQUIRE_GPU=1 in the environment (for a run
// that must not skip), every such test fails instead. Never a silent pass.
//
// As on the CPU: outputs are poisoned with NaN before each run (the backend copies its results
// into those host buffers, so an element it never writes fails the comparison), inputs are fresh
// uniform(-1, 1) values with a seed per case, and sizes are odd, not multiples of the kernels'
// tiles (16 or 64 query rows, 32 keys) nor of their padded head sizes (32 … 256).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/problem.h"
#include "tests/backend_suite.h"
#include "tests/checks.h"
#include "tests/gpu/cuda_suite_backend.h"
#include "tests/reference.h"

namespace attn::testing {

// gpu_test runs the shared suites over the CUDA backend alone (kernels_test runs them over the
// CPU), so it links no CPU kernels.
const std::vector<SuiteBackend>& SuiteBackends() {
  static const std::vector<SuiteBackend>* const backends =
      new std::vector<SuiteBackend>{CudaSuiteBackend()};
  return *backends;
}

}  // namespace attn::testing

namespace {

using namespace attn;
using namespace attn::testing;

// ---------------------------------------------------------------------------------------------
// Limits: the fused kernels' head sizes, the device's shared memory.

class CudaLimitsTest : public CudaTest {};

// The fused Tiled kernels are compiled for head sizes up to 256: wider heads are the caller's
// error (INVALID_ARGUMENT), not a device failure. Naive (cuBLAS) has no such limit; the trace
// keeps at most 256 value columns in a warp's registers.
TEST_F(CudaLimitsTest, TiledRejectsHeadsWiderThan256) {
  for (const auto& [head_dim, value_dim] :
       {std::pair<int64_t, int64_t>{257, 8}, {8, 257}, {300, 300}}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " value_dim " << value_dim);
    const HostProblem host = RandomProblem(MakeShape(1, 1, 1, 5, 7, head_dim, value_dim),
                                           DType::kFloat32, /*causal=*/false, 16, 115);
    PoisonedOutputs outputs(host);
    const absl::StatusOr<Stats> tiled = gpu().Tiled(host.View(), outputs.outputs());
    ASSERT_FALSE(tiled.ok());
    EXPECT_EQ(tiled.status().code(), absl::StatusCode::kInvalidArgument) << tiled.status();
    EXPECT_NE(tiled.status().message().find("256"), std::string_view::npos) << tiled.status();
  }

  const HostProblem wide = RandomProblem(MakeShape(1, 2, 2, 9, 13, 300, 270), DType::kFloat32,
                                         /*causal=*/true, 16, 116);
  ExpectMatchesReference(RunKernel(gpu(), Kernel::kNaive, wide), ReferenceAttention(wide), 1e-5);

  const HostProblem wide_values = RandomProblem(MakeShape(1, 1, 1, 3, 5, 8, 257), DType::kFloat32,
                                                /*causal=*/false, 4, 117);
  const absl::StatusOr<std::unique_ptr<TraceCursor>> trace =
      gpu().Trace(wide_values.View(), {{0, 0, 1}});
  ASSERT_FALSE(trace.ok());
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument) << trace.status();
  EXPECT_TRUE(gpu().healthy());
}

// A device whose opt-in shared memory per block is below what a fused kernel needs (an sm_86
// has 99 KB; fp32 at head_dim 256 needs 147712 bytes) gets the row kernel instead, with the same
// block_k and results that meet the same bounds. The backend is opened with a limit below every
// fused kernel's footprint to stand in for such a device.
TEST_F(CudaLimitsTest, TiledFitsTheDevicesSharedMemoryLimit) {
  absl::StatusOr<std::unique_ptr<Backend>> small =
      cuda::MakeCudaBackend(0, 0, /*max_shared_bytes=*/1024);
  ASSERT_TRUE(small.ok()) << small.status();
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    for (int64_t head_dim : {int64_t{256}, int64_t{40}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " head_dim " << head_dim);
      HostProblem host = RandomProblem(MakeShape(1, 2, 1, 37, 75, head_dim, head_dim), dtype,
                                       /*causal=*/true, (*small)->default_block_k(),
                                       118 + head_dim + static_cast<int>(dtype));
      host.output_dtype = DType::kFloat32;
      const Reference ref = ReferenceAttention(host);
      for (Backend* backend : {small->get(), &gpu()}) {
        const KernelRun run = RunKernel(*backend, Kernel::kTiled, host);
        EXPECT_EQ(run.stats.block_k, (*small)->default_block_k());
        EXPECT_LE(MaxAbsError(run.output, ref.output),
                  1e-5 * std::max(1.0, MaxAbs(ref.output)) + ProbabilityRoundingBound(host));
        ExpectLseMatches(run, ref, 1e-5);
      }
    }
  }
  EXPECT_TRUE((*small)->healthy());
}

TEST_F(CudaLimitsTest, DescribesTheDevice) {
  EXPECT_STREQ(gpu().name(), "cuda");
  EXPECT_NE(gpu().device().find("cuda:0"), std::string::npos) << gpu().device();
  EXPECT_GT(gpu().memory_bytes(), 0);
  EXPECT_GT(gpu().default_block_k(), 0);
  EXPECT_GT(gpu().max_naive_bytes(), 0);
  EXPECT_LE(gpu().max_naive_bytes(), gpu().memory_bytes());
  EXPECT_TRUE(gpu().healthy());
}

// ---------------------------------------------------------------------------------------------
// Concurrent requests share the backend's pool of streams; each must compute exactly what it
// computes alone.

class CudaConcurrencyTest : public CudaTest {};

TEST_F(CudaConcurrencyTest, ConcurrentRequestsMatchRunsAlone) {
  struct Spec {
    Shape shape;
    DType dtype;
    DType output_dtype;
    bool causal;
  };
  const Spec specs[] = {
      {MakeShape(1, 4, 2, 200, 300, 64, 64), DType::kFloat32, DType::kFloat32, false},
      {MakeShape(2, 2, 1, 150, 90, 33, 20), DType::kFloat32, DType::kFloat32, true},
      {MakeShape(1, 4, 4, 256, 255, 128, 128), DType::kFloat16, DType::kFloat16, false},
      {MakeShape(2, 4, 2, 190, 250, 64, 48), DType::kBFloat16, DType::kBFloat16, true},
      {MakeShape(1, 2, 2, 100, 333, 100, 64), DType::kFloat16, DType::kFloat32, false},
      {MakeShape(1, 3, 3, 77, 120, 256, 256), DType::kFloat32, DType::kBFloat16, false},
      {MakeShape(1, 8, 2, 300, 180, 32, 32), DType::kBFloat16, DType::kBFloat16, false},
      {MakeShape(3, 2, 2, 61, 29, 15, 15), DType::kFloat32, DType::kFloat16, true},
  };
  std::vector<HostProblem> problems;
  for (size_t i = 0; i < std::size(specs); ++i) {
    problems.push_back(
        RandomProblem(specs[i].shape, specs[i].dtype, specs[i].causal, 64, 5000 + i));
    problems.back().output_dtype = specs[i].output_dtype;
  }

  struct Job {
    const HostProblem* host;
    Kernel kernel;
    KernelRun alone;
  };
  std::vector<Job> jobs;
  for (const HostProblem& host : problems) {
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << "job " << jobs.size() << " " << KernelName(kernel));
      Job job{&host, kernel, RunKernel(gpu(), kernel, host)};
      for (float x : job.alone.output) ASSERT_FALSE(std::isnan(x)) << "an output was not written";
      for (float x : job.alone.lse) ASSERT_FALSE(std::isnan(x)) << "an lse was not written";
      jobs.push_back(std::move(job));
    }
  }

  constexpr int kThreads = 4;
  // The SIMT emulator (tests/simt) runs one kernel at a time, slowly: there each thread runs half
  // the jobs once (still every job on two threads at once), not all of them three times.
#if defined(ATTN_SIMT)
  constexpr int kRepeats = 1;
  const size_t jobs_per_thread = jobs.size() / 2;
#else
  constexpr int kRepeats = 3;
  const size_t jobs_per_thread = jobs.size();
#endif
  std::vector<std::vector<std::string>> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < kRepeats; ++repeat) {
        for (size_t k = 0; k < jobs_per_thread; ++k) {
          // Each thread walks the jobs from its own offset, so different problems overlap.
          const size_t index = (k + t * jobs.size() / kThreads + repeat) % jobs.size();
          const Job& job = jobs[index];
          const std::string what = std::string("job ") + std::to_string(index) + " (" +
                                   KernelName(job.kernel) + ") on thread " + std::to_string(t);
          absl::StatusOr<KernelRun> run = TryKernel(gpu(), job.kernel, *job.host, job.host->View());
          if (!run.ok()) {
            failures[t].push_back(what + ": " + run.status().ToString());
          } else if (run->output_bytes != job.alone.output_bytes) {
            failures[t].push_back(what + ": output differs from the run alone");
          } else if (run->lse.size() != job.alone.lse.size() ||
                     std::memcmp(run->lse.data(), job.alone.lse.data(),
                                 run->lse.size() * sizeof(float)) != 0) {
            failures[t].push_back(what + ": lse differs from the run alone");
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::vector<std::string>& thread_failures : failures) {
    for (size_t i = 0; i < thread_failures.size() && i < 10; ++i)
      ADD_FAILURE() << thread_failures[i];
  }
  EXPECT_TRUE(gpu().healthy());
}

// ---------------------------------------------------------------------------------------------
// Tiled's plan (kernels/cuda/launch.h): pure host code, so these run without a device too.

cuda::DeviceProblem PlanProblem(DType dtype, int pitch, int64_t key_len) {
  cuda::DeviceProblem problem;
  problem.dtype = dtype;
  problem.pitch = pitch;
  problem.shape = MakeShape(1, 1, 1, 5, key_len, pitch, pitch);
  return problem;
}

TEST(TiledPlanTest, FusedOnlyForItsOwnTilesWithinTheSharedMemoryLimit) {
  constexpr int kLots = 1 << 30;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int pitch : cuda::kCompiledDims) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " pitch " << pitch);
      const cuda::TiledKernel fused =
          dtype == DType::kFloat32 ? cuda::TiledKernel::kFp32 : cuda::TiledKernel::kMma;
      const int bytes = cuda::FusedSharedBytes(dtype, pitch);
      ASSERT_GT(bytes, 0);
      const cuda::DeviceProblem problem = PlanProblem(dtype, pitch, 1000);
      cuda::TiledPlan plan = cuda::PlanTiled(problem, cuda::kFusedBlockK, kLots);
      EXPECT_EQ(plan.kernel, fused);
      EXPECT_EQ(plan.block_k, cuda::kFusedBlockK);
      EXPECT_EQ(plan.shared_bytes, bytes);
      EXPECT_EQ(cuda::PlanTiled(problem, cuda::kFusedBlockK, bytes).kernel, fused);
      // One byte short of the footprint: the row kernel, which needs none.
      plan = cuda::PlanTiled(problem, cuda::kFusedBlockK, bytes - 1);
      EXPECT_EQ(plan.kernel, cuda::TiledKernel::kRows);
      EXPECT_EQ(plan.shared_bytes, 0);
      EXPECT_EQ(plan.block_k, cuda::kFusedBlockK);
      // Another block_k: the row kernel, honouring it.
      for (int64_t block_k : {1, 16, 31, 33, 64, 999}) {
        plan = cuda::PlanTiled(problem, block_k, kLots);
        EXPECT_EQ(plan.kernel, cuda::TiledKernel::kRows) << "block_k " << block_k;
        EXPECT_EQ(plan.block_k, block_k);
      }
      // Unless one tile holds every key either way.
      const cuda::DeviceProblem short_keys = PlanProblem(dtype, pitch, 20);
      EXPECT_EQ(cuda::PlanTiled(short_keys, 20, kLots).kernel, fused);
      EXPECT_EQ(cuda::PlanTiled(short_keys, 100, kLots).kernel, fused);
      EXPECT_EQ(cuda::PlanTiled(short_keys, 19, kLots).kernel, cuda::TiledKernel::kRows);
    }
  }
  // The figure the issue named: fp32 at head_dim 256 does not fit an sm_86's 99 KB.
  EXPECT_GT(cuda::FusedSharedBytes(DType::kFloat32, 256), 101376);
}

// A pitch the kernels are not compiled for is an error, never silently another size.
TEST(TiledPlanTest, UnexpectedPitchIsAnError) {
  for (int pitch : {0, 16, 48, 96, 200, 512}) {
    SCOPED_TRACE(::testing::Message() << "pitch " << pitch);
    for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
      EXPECT_EQ(cuda::FusedSharedBytes(dtype, pitch), -1);
      const cuda::DeviceProblem problem = PlanProblem(dtype, pitch, 64);
      const cuda::TiledPlan plan = cuda::PlanTiled(problem, cuda::kFusedBlockK, 1 << 30);
      EXPECT_EQ(plan.kernel, cuda::TiledKernel::kRows);
      // Refused before anything reaches a device.
      EXPECT_EQ(cuda::LaunchTiled(problem, plan, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
    }
  }
}

}  // namespace
