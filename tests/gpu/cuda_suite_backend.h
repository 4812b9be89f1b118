// The CUDA backend as the shared suites see it (tests/backend_suite.h), and the fixture of the
// tests only the device has (tests/gpu/gpu_test.cc, kv_cache_test.cc).
//
// Without a CUDA device the backend does not open and its tests skip with the reason; with a
// device the backend cannot open, or with ATTN_REQUIRE_GPU=1, they fail.
#pragma once

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/backend_suite.h"

namespace attn::testing {

// Device 0, opened with the suite's options (threads ignored); must open when the runtime
// reports a device or ATTN_REQUIRE_GPU is set.
SuiteBackend CudaSuiteBackend();

// The CUDA backend with the default options, opened once per test suite.
class CudaTest : public ::testing::Test {
 public:
  static void TearDownTestSuite() { CloseSuiteBackends(); }

 protected:
  void SetUp() override {
    const OpenOutcome outcome = OpenOrExplain(CudaSuiteBackend());
    if (!outcome.failure.empty()) FAIL() << outcome.failure;
    if (!outcome.skip.empty()) GTEST_SKIP() << outcome.skip;
    gpu_ = outcome.backend;
  }

  Backend& gpu() const { return *gpu_; }

 private:
  Backend* gpu_ = nullptr;
};

}  // namespace attn::testing
