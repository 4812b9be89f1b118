// The emulator's checks, each shown catching a kernel broken on purpose (and staying quiet on
// its correct twin): racecheck and initcheck on shared memory (the release build, whose device
// code is instrumented), synccheck on barriers and warp collectives, bounds of shared and global
// memory (ASan in the asan build; the emulator's own shared-memory bounds in the release build),
// and asynchronous copies that land only at their wait.
//
// The kernels here are device code compiled like kernels/cuda/*.cu (CMakeLists.txt:
// simt_device_sources) and launched through the same LaunchKernel.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/portable.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace {

using attn::cuda::LaunchKernel;

constexpr int kThreads = 64;

// --- Kernels --------------------------------------------------------------------------------

// Each thread writes its slot, then reads its neighbour's: with the barrier, or without (a race).
__global__ void NeighbourKernel(float* out, bool barrier) {
  ATTN_SHARED_ARRAY(float, slots, kThreads);
  const int i = static_cast<int>(threadIdx.x);
  slots[i] = static_cast<float>(i);
  if (barrier) __syncthreads();
  out[i] = slots[(i + 1) % kThreads];
}

// Reads back a slot overwritten after the barrier by another thread: a write-after-read hazard
// when the second barrier is missing.
__global__ void ReuseKernel(float* out, bool second_barrier) {
  ATTN_SHARED_ARRAY(float, slots, kThreads);
  const int i = static_cast<int>(threadIdx.x);
  slots[i] = 1.f;
  __syncthreads();
  const float seen = slots[(i + 1) % kThreads];
  if (second_barrier) __syncthreads();
  slots[i] = seen + 1.f;
  out[i] = seen;
}

// Reads every slot, having written only the even ones.
__global__ void HalfWrittenKernel(float* out, bool write_all) {
  ATTN_SHARED_ARRAY(float, slots, kThreads);
  const int i = static_cast<int>(threadIdx.x);
  if (write_all || i % 2 == 0) slots[i] = static_cast<float>(i);
  __syncthreads();
  out[i] = slots[kThreads - 1 - i];
}

// A barrier only some threads reach (the others exit), or one the whole block reaches.
__global__ void PartialBarrierKernel(float* out, bool everyone) {
  const int i = static_cast<int>(threadIdx.x);
  if (everyone || i < 16) __syncthreads();
  out[i] = 1.f;
}

// Two halves of the block wait at two different barriers.
__global__ void DivergentBarrierKernel(float* out) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kThreads / 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[i] = 1.f;
}

// A full-mask shuffle that only half the warp executes, or all of it.
__global__ void HalfWarpShuffleKernel(float* out, bool whole_warp) {
  const int i = static_cast<int>(threadIdx.x);
  float x = static_cast<float>(i);
  if (whole_warp || i % 32 < 16) x = __shfl_sync(0xffffffffu, x, 0);
  out[i] = x;
}

// The two halves of each warp at two different full-mask shuffles (undefined), or at two different
// __syncwarp calls (allowed since sm_70).
__global__ void TwoSitesKernel(float* out, bool shuffle) {
  const int i = static_cast<int>(threadIdx.x);
  float x = static_cast<float>(i);
  if (i % 32 < 16) {
    if (shuffle) x = __shfl_sync(0xffffffffu, x, 0);
    if (!shuffle) __syncwarp();
  } else {
    if (shuffle) x = __shfl_sync(0xffffffffu, x, 0);
    if (!shuffle) __syncwarp();
  }
  out[i] = x;
}

// A warp whose lanes wait in a full-mask shuffle while its lane 0 waits at the block barrier: no
// thread can go on.
__global__ void DeadlockKernel(float* out) {
  const int i = static_cast<int>(threadIdx.x);
  float x = static_cast<float>(i);
  if (i == 0) {
    __syncthreads();
  } else if (i < 32) {
    x = __shfl_sync(0xffffffffu, x, 1);
  }
  if (i >= 32) __syncthreads();
  out[i] = x;
}

// Writes one float past the end of a static shared array (`past` = 1), or within it.
__global__ void SharedOverflowKernel(float* out, int past) {
  ATTN_SHARED_ARRAY(float, slots, kThreads);
  const int i = static_cast<int>(threadIdx.x);
  slots[i + (i == kThreads - 1 ? past : 0)] = 1.f;
  __syncthreads();
  out[i] = slots[i % kThreads];
}

// Reads one float past the end of a global buffer (`past` = 1), or not.
__global__ void GlobalOverflowKernel(const float* in, float* out, int past) {
  const int i = static_cast<int>(threadIdx.x);
  out[i] = in[i + (i == kThreads - 1 ? past : 0)];
}

// Reads in[i]: given device memory, or (broken) a host array the launch forgot to copy over.
__global__ void ReadKernel(const float* in, float* out) {
  const int i = static_cast<int>(threadIdx.x);
  out[i] = in[i];
}

// Thread i copies in[i * 4 .. i * 4 + 3] into shared memory with cp.async and reads it back,
// after waiting for its group or (broken) before.
__global__ void CopyKernel(const float* in, float* out, bool wait) {
  ATTN_DYNAMIC_SHARED(float, tile);
  const int i = static_cast<int>(threadIdx.x);
  attn::cuda::CopyAsync<16>(tile + 4 * i, in + 4 * i, true);
  attn::cuda::CommitCopies();
  if (wait) attn::cuda::WaitCopies<0>();
  for (int k = 0; k < 4; ++k) out[4 * i + k] = tile[4 * i + k];
  attn::cuda::WaitCopies<0>();
}

// Two groups in flight: waiting with a count of 1 lands only the first.
__global__ void TwoGroupsKernel(const float* in, float* out) {
  ATTN_DYNAMIC_SHARED(float, tile);
  const int i = static_cast<int>(threadIdx.x);
  attn::cuda::CopyAsync<16>(tile + 4 * i, in + 4 * i, true);
  attn::cuda::CommitCopies();
  attn::cuda::CopyAsync<16>(tile + 4 * (kThreads + i), in + 4 * (kThreads + i), true);
  attn::cuda::CommitCopies();
  attn::cuda::WaitCopies<1>();
  out[i] = tile[4 * i];
  out[kThreads + i] = tile[4 * (kThreads + i)];
  attn::cuda::WaitCopies<0>();
}

// --- Fixture --------------------------------------------------------------------------------

class ChecksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    simt::ResetDevice();
    ASSERT_EQ(cudaMalloc(&in_, 8 * kThreads * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&out_, 8 * kThreads * sizeof(float)), cudaSuccess);
    std::vector<float> values(8 * kThreads);
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f + static_cast<float>(i);
    ASSERT_EQ(cudaMemcpy(in_, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  void TearDown() override {
    simt::ResetDevice();
    cudaFree(in_);
    cudaFree(out_);
  }

  // The reports of the launch `run` makes; the launch must have been accepted, and fails (at the
  // next synchronizing call) exactly when there are reports.
  template <class Run>
  std::vector<std::string> ReportsOf(Run&& run) {
    simt::TakeReports();
    EXPECT_EQ(run(), cudaSuccess);
    std::vector<std::string> reports = simt::TakeReports();
    const cudaError_t sync = cudaDeviceSynchronize();
    EXPECT_EQ(sync, reports.empty() ? cudaSuccess : cudaErrorLaunchFailure);
    simt::ResetDevice();
    return reports;
  }

  static bool Mentions(const std::vector<std::string>& reports, const std::string& what) {
    for (const std::string& r : reports) {
      if (r.find(what) != std::string::npos) return true;
    }
    return false;
  }

  std::vector<float> Out(int n) {
    std::vector<float> out(static_cast<size_t>(n));
    EXPECT_EQ(cudaMemcpy(out.data(), out_, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  float* in_ = nullptr;
  float* out_ = nullptr;
};

#define SKIP_WITHOUT_RACECHECK()                                                               \
  if (!simt::SharedAccessesChecked())                                                          \
  GTEST_SKIP() << "this build's device code is not instrumented (GCC refuses "                 \
                  "-fsanitize=thread beside -fsanitize=address): racecheck and initcheck run " \
                  "in the release stage"

// --- racecheck ------------------------------------------------------------------------------

TEST_F(ChecksTest, RacecheckCatchesAReadOfAnotherThreadsWriteWithoutABarrier) {
  SKIP_WITHOUT_RACECHECK();
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(NeighbourKernel, 1, kThreads, 0, nullptr, out_, false); });
  ASSERT_FALSE(broken.empty());
  // Which hazard depends on the order the fibers run in: here each thread runs to its end, so
  // thread 0 reads slot 1 before thread 1 writes it.
  EXPECT_TRUE(Mentions(broken, "racecheck: write after read")) << broken[0];
  EXPECT_TRUE(Mentions(broken, "`slots`")) << broken[0];
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(NeighbourKernel, 1, kThreads, 0, nullptr, out_, true);
              }).empty());
  const std::vector<float> out = Out(kThreads);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(out[i], static_cast<float>((i + 1) % kThreads));
}

TEST_F(ChecksTest, RacecheckCatchesAnOverwriteOfWhatAnotherThreadStillReads) {
  SKIP_WITHOUT_RACECHECK();
  const auto broken =
      ReportsOf([&] { return LaunchKernel(ReuseKernel, 1, kThreads, 0, nullptr, out_, false); });
  EXPECT_TRUE(Mentions(broken, "racecheck: write after read")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(ReuseKernel, 1, kThreads, 0, nullptr, out_, true);
              }).empty());
}

// --- initcheck ------------------------------------------------------------------------------

TEST_F(ChecksTest, InitcheckCatchesAReadOfSharedMemoryNeverWritten) {
  SKIP_WITHOUT_RACECHECK();
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(HalfWrittenKernel, 1, kThreads, 0, nullptr, out_, false); });
  EXPECT_TRUE(Mentions(broken, "initcheck:")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(HalfWrittenKernel, 1, kThreads, 0, nullptr, out_, true);
              }).empty());
}

// Without instrumentation the same kernel still reads garbage, not zeros: shared memory starts
// each block poisoned (NaN), as a device's starts with whatever was there.
TEST_F(ChecksTest, SharedMemoryStartsAsGarbage) {
  ASSERT_EQ(LaunchKernel(HalfWrittenKernel, 1, kThreads, 0, nullptr, out_, false), cudaSuccess);
  simt::TakeReports();
  simt::ResetDevice();
  const std::vector<float> out = Out(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    const int slot = kThreads - 1 - i;
    if (slot % 2 == 0) {
      EXPECT_EQ(out[i], static_cast<float>(slot));
    } else {
      EXPECT_TRUE(std::isnan(out[i])) << i;
    }
  }
}

// --- synccheck ------------------------------------------------------------------------------

TEST_F(ChecksTest, SynccheckCatchesABarrierSomeThreadsNeverReach) {
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(PartialBarrierKernel, 1, kThreads, 0, nullptr, out_, false); });
  EXPECT_TRUE(Mentions(broken, "synccheck:")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(PartialBarrierKernel, 1, kThreads, 0, nullptr, out_, true);
              }).empty());
}

TEST_F(ChecksTest, SynccheckCatchesThreadsAtDifferentBarriers) {
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(DivergentBarrierKernel, 1, kThreads, 0, nullptr, out_); });
  EXPECT_TRUE(Mentions(broken, "synccheck: divergent __syncthreads"))
      << (broken.empty() ? "" : broken[0]);
}

TEST_F(ChecksTest, SynccheckCatchesAShuffleNotEveryLaneOfItsMaskReaches) {
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(HalfWarpShuffleKernel, 1, kThreads, 0, nullptr, out_, false); });
  EXPECT_TRUE(Mentions(broken, "synccheck:")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(HalfWarpShuffleKernel, 1, kThreads, 0, nullptr, out_, true);
              }).empty());
  const std::vector<float> out = Out(kThreads);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(out[i], static_cast<float>(i / 32 * 32));
}

TEST_F(ChecksTest, SynccheckCatchesAShuffleSplitOverTwoCallSites) {
  const auto broken =
      ReportsOf([&] { return LaunchKernel(TwoSitesKernel, 1, kThreads, 0, nullptr, out_, true); });
  EXPECT_TRUE(Mentions(broken, "synccheck: divergent warp collective"))
      << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(TwoSitesKernel, 1, kThreads, 0, nullptr, out_, false);
              }).empty());
}

TEST_F(ChecksTest, SynccheckCatchesADeadlockAndAbandonsTheBlock) {
  const auto broken =
      ReportsOf([&] { return LaunchKernel(DeadlockKernel, 2, kThreads, 0, nullptr, out_); });
  EXPECT_TRUE(Mentions(broken, "cannot go on")) << (broken.empty() ? "" : broken[0]);
}

// --- Bounds ---------------------------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__)
// ASan stops the process at the first error: a death test, its report on the child's stderr
// rather than in the stage's report files.
void RunWithAsanReportOnStderr(void (*run)(float*, float*), float* in, float* out) {
  __sanitizer_set_report_path("stderr");
  run(in, out);
}
#endif

TEST_F(ChecksTest, SharedMemoryBoundsAreChecked) {
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(SharedOverflowKernel, 1, kThreads, 0, nullptr, out_, 0);
              }).empty());
#if defined(__SANITIZE_ADDRESS__)
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(RunWithAsanReportOnStderr(
                   [](float*, float* out) {
                     LaunchKernel(SharedOverflowKernel, 1, kThreads, 0, nullptr, out, 1);
                   },
                   in_, out_),
               "heap-buffer-overflow");
#else
  ASSERT_TRUE(simt::SharedAccessesChecked()) << "no ASan and no instrumentation: unchecked";
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(SharedOverflowKernel, 1, kThreads, 0, nullptr, out_, 1); });
  EXPECT_TRUE(Mentions(broken, "memcheck:")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(Mentions(broken, "past its end")) << (broken.empty() ? "" : broken[0]);
#endif
}

TEST_F(ChecksTest, GlobalMemoryBoundsAreAsansToCheck) {
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(GlobalOverflowKernel, 1, kThreads, 0, nullptr, in_, out_, 0);
              }).empty());
#if defined(__SANITIZE_ADDRESS__)
  // A buffer of exactly kThreads floats, so one more is past its end.
  float* exact = nullptr;
  ASSERT_EQ(cudaMalloc(&exact, kThreads * sizeof(float)), cudaSuccess);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(RunWithAsanReportOnStderr(
                   [](float* in, float* out) {
                     LaunchKernel(GlobalOverflowKernel, 1, kThreads, 0, nullptr,
                                  static_cast<const float*>(in), out, 1);
                   },
                   exact, out_),
               "heap-buffer-overflow");
  cudaFree(exact);
#else
  GTEST_SKIP() << "global memory's bounds are ASan's (device memory is host memory from "
                  "aligned_alloc): this check runs in the asan stage";
#endif
}

// compute-sanitizer's "invalid __global__ read": to ASan a host pointer is valid memory, so only
// the instrumented build, which knows every device allocation, can tell.
TEST_F(ChecksTest, MemcheckCatchesAHostPointerHandedToAKernel) {
  SKIP_WITHOUT_RACECHECK();
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(ReadKernel, 1, kThreads, 0, nullptr,
                                    static_cast<const float*>(in_), out_);
              }).empty());
  const std::vector<float> host(kThreads, 1.f);
  const auto broken = ReportsOf(
      [&] { return LaunchKernel(ReadKernel, 1, kThreads, 0, nullptr, host.data(), out_); });
  EXPECT_TRUE(Mentions(broken, "memcheck:")) << (broken.empty() ? "" : broken[0]);
  EXPECT_TRUE(Mentions(broken, "neither device memory")) << (broken.empty() ? "" : broken[0]);
}

// --- Asynchronous copies --------------------------------------------------------------------

TEST_F(ChecksTest, CopiesLandOnlyAtTheirWait) {
  const size_t shared = 4 * kThreads * sizeof(float);
  EXPECT_TRUE(ReportsOf([&] {
                return LaunchKernel(CopyKernel, 1, kThreads, shared, nullptr,
                                    static_cast<const float*>(in_), out_, true);
              }).empty());
  std::vector<float> out = Out(4 * kThreads);
  for (int i = 0; i < 4 * kThreads; ++i) EXPECT_EQ(out[i], 0.5f + static_cast<float>(i));

  // Read before the wait: the copy has not landed, the tile still holds the block's garbage.
  const auto broken = ReportsOf([&] {
    return LaunchKernel(CopyKernel, 1, kThreads, shared, nullptr, static_cast<const float*>(in_),
                        out_, false);
  });
  out = Out(4 * kThreads);
  for (int i = 0; i < 4 * kThreads; ++i) EXPECT_TRUE(std::isnan(out[i])) << i;
  if (simt::SharedAccessesChecked()) {
    EXPECT_TRUE(Mentions(broken, "initcheck:")) << (broken.empty() ? "" : broken[0]);
  }
}

TEST_F(ChecksTest, WaitGroupCountsCommittedGroupsFromTheNewest) {
  const size_t shared = 8 * kThreads * sizeof(float);
  const auto reports = ReportsOf([&] {
    return LaunchKernel(TwoGroupsKernel, 1, kThreads, shared, nullptr,
                        static_cast<const float*>(in_), out_);
  });
  const std::vector<float> out = Out(2 * kThreads);
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(out[i], 0.5f + static_cast<float>(4 * i)) << i;  // The older group landed.
    EXPECT_TRUE(std::isnan(out[kThreads + i])) << i;           // The newer one had not.
  }
  if (simt::SharedAccessesChecked()) {
    EXPECT_TRUE(Mentions(reports, "initcheck:"));
  }
}

// --- Launch configuration -------------------------------------------------------------------

TEST_F(ChecksTest, LaunchesAreCheckedAsTheDeviceChecksThem) {
  // More than 1024 threads per block, an empty grid: invalid configurations, not run.
  EXPECT_EQ(LaunchKernel(NeighbourKernel, 1, 1025, 0, nullptr, out_, true),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(LaunchKernel(NeighbourKernel, 0, kThreads, 0, nullptr, out_, true),
            cudaErrorInvalidConfiguration);
  simt::ResetDevice();
  // Over 48 KiB of dynamic shared memory needs the kernel's attribute raised first.
  const size_t big = 64 * 1024;
  EXPECT_EQ(LaunchKernel(CopyKernel, 1, kThreads, big, nullptr, static_cast<const float*>(in_),
                         out_, true),
            cudaErrorInvalidValue);
  simt::ResetDevice();
  ASSERT_EQ(cudaFuncSetAttribute(CopyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(big)),
            cudaSuccess);
  EXPECT_EQ(LaunchKernel(CopyKernel, 1, kThreads, big, nullptr, static_cast<const float*>(in_),
                         out_, true),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
