// The backend suite: kernel and trace checks written once and run over every backend a test
// binary links (tests/backend_kernels_test.cc, tests/backend_trace_test.cc).
//
// A binary says which backends it has by defining SuiteBackends(): kernels_test gives the CPU
// (tests/kernels_test.cc), gpu_test the CUDA backend (tests/gpu/gpu_test.cc), so gpu_test still
// links the CUDA kernels alone (tests/gpu/device_check.sh builds it on a GPU machine). Every
// shared test is value-parameterized by the SuiteBackend; its name ends in the backend's name
// (".../Cpu", ".../Cuda_FewerQueriesThanKeys").
//
// A backend that does not open is a skip, with the reason, only where it may be absent (no CUDA
// device, and ATTN_REQUIRE_GPU unset); otherwise every test of it fails. Never a silent pass.
//
// Backends are opened once per option set and kept until the end of the test suite (the fixture
// class), so a suite of many cases opens a device once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/reference.h"

namespace attn::testing {

// What a test may ask of the backend it runs on; each backend takes what it knows and ignores the
// rest. Zero is always that backend's default.
struct SuiteOptions {
  int threads = 2;              // CPU: workers per call.
  int64_t max_naive_bytes = 0;  // Naive's budget.
  int64_t kv_page_tokens = 0;   // Tokens per KV cache page.

  auto Key() const { return std::tie(threads, max_naive_bytes, kv_page_tokens); }
  bool operator<(const SuiteOptions& other) const { return Key() < other.Key(); }
};

// How a backend's arithmetic differs where the checks must know it: each flag names the one
// looser or stricter expectation it selects, and why it holds.
struct SuiteTraits {
  // CUDA's tensor-core Tiled multiplies P·V with the probabilities rounded to the input dtype
  // (fp16/bf16): its outputs may move by ProbabilityRoundingBound (tests/checks.h). The CPU's
  // Tiled keeps them in fp32.
  bool tiled_rounds_probabilities = false;
  // The CPU's Trace and Tiled share their products and online-softmax step, each summed in an
  // order that does not depend on how many rows run together: a trace's RowDone is Tiled's output
  // and lse, bit for bit. CUDA's Tiled kernels sum in another order.
  bool trace_is_tiled_bit_for_bit = false;
  // The CPU's Naive computes each row alone, so a GQA problem gives the bits of the same problem
  // with its kv heads copied out; CUDA's cuBLAS products see other shapes and may pick other
  // algorithms.
  bool naive_bits_ignore_grouping = false;
};

// One backend the shared suites run over.
struct SuiteBackend {
  std::string name;  // "Cpu", "Cuda": the end of every test name.
  std::function<absl::StatusOr<std::unique_ptr<Backend>>(const SuiteOptions&)> open;
  // True when a backend that does not open is a failure, not a skip.
  std::function<bool()> must_open;
  SuiteTraits traits;
};

void PrintTo(const SuiteBackend& backend, std::ostream* os);

// The backends this binary runs the shared suites over (defined once per test binary).
const std::vector<SuiteBackend>& SuiteBackends();

// `backend` opened with `options`, or the error it gave; opened once per option set until
// CloseSuiteBackends.
absl::StatusOr<Backend*> OpenSuiteBackend(const SuiteBackend& backend,
                                          const SuiteOptions& options = {});
void CloseSuiteBackends();

// ATTN_REQUIRE_GPU set to anything but "" or "0": a run that must not skip the GPU tests.
bool GpuRequired();

// The message a fixture fails or skips with when `backend` did not open: empty when it opened.
struct OpenOutcome {
  Backend* backend = nullptr;
  std::string failure;  // Set: the tests fail with it.
  std::string skip;     // Set: the tests skip with it.
};
OpenOutcome OpenOrExplain(const SuiteBackend& backend, const SuiteOptions& options = {});

// The SuiteBackend of a test's parameter: the parameter itself, or the first of a tuple.
inline const SuiteBackend& SuiteOf(const SuiteBackend& param) { return param; }
template <class Case>
const SuiteBackend& SuiteOf(const std::tuple<SuiteBackend, Case>& param) {
  return std::get<0>(param);
}

// The fixture of every shared test: Param is a SuiteBackend, or a (SuiteBackend, case) tuple.
template <class Param>
class BackendTestWithParam : public ::testing::TestWithParam<Param> {
 public:
  static void TearDownTestSuite() { CloseSuiteBackends(); }

 protected:
  void SetUp() override {
    const OpenOutcome outcome = OpenOrExplain(suite());
    if (!outcome.failure.empty()) FAIL() << outcome.failure;
    if (!outcome.skip.empty()) GTEST_SKIP() << outcome.skip;
    backend_ = outcome.backend;
  }

  const SuiteBackend& suite() const { return SuiteOf(this->GetParam()); }
  const SuiteTraits& traits() const { return suite().traits; }
  // The backend with the default options (opened in SetUp).
  Backend& backend() const { return *backend_; }
  // The backend with other options; a failure to open is the test's failure.
  absl::StatusOr<Backend*> backend(const SuiteOptions& options) const {
    return OpenSuiteBackend(suite(), options);
  }

 private:
  Backend* backend_ = nullptr;
};

using BackendTest = BackendTestWithParam<SuiteBackend>;
template <class Case>
using BackendCaseTest = BackendTestWithParam<std::tuple<SuiteBackend, Case>>;

// Test-name generators: the backend's name, or "<backend>_<case name>" (Case has `name`).
std::string BackendName(const ::testing::TestParamInfo<SuiteBackend>& info);
template <class Case>
std::string BackendCaseName(const ::testing::TestParamInfo<std::tuple<SuiteBackend, Case>>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

}  // namespace attn::testing

// Instantiates a shared suite over this binary's backends, alone or crossed with its cases.
#define ATTN_BACKEND_SUITE(Suite)                                                                  \
  INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::ValuesIn(::attn::testing::SuiteBackends()), \
                           ::attn::testing::BackendName)
#define ATTN_BACKEND_CASE_SUITE(Suite, Case, cases)                             \
  INSTANTIATE_TEST_SUITE_P(                                                     \
      Backends, Suite,                                                          \
      ::testing::Combine(::testing::ValuesIn(::attn::testing::SuiteBackends()), \
                         ::testing::ValuesIn(cases)),                           \
      ::attn::testing::BackendCaseName<Case>)
