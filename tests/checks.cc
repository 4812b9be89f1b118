#include "tests/checks.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "gtest/gtest.h"

namespace attn::testing {

const char* KernelName(Kernel kernel) { return kernel == Kernel::kNaive ? "Naive" : "Tiled"; }

// Runs one kernel on `problem` (a view of `host`, possibly adjusted) into poisoned outputs.
// Uses no gtest assertions, so threads may call it.
absl::StatusOr<KernelRun> TryKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                                    const Problem& problem) {
  PoisonedOutputs outputs(host);
  absl::StatusOr<Stats> stats = kernel == Kernel::kNaive
                                    ? backend.Naive(problem, outputs.outputs())
                                    : backend.Tiled(problem, outputs.outputs());
  if (!stats.ok()) return stats.status();
  KernelRun run;
  run.stats = *stats;
  run.output = outputs.Output();
  run.output_bytes = std::move(outputs.output_bytes);
  run.lse = std::move(outputs.lse);
  return run;
}

KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                    const Problem& problem) {
  absl::StatusOr<KernelRun> run = TryKernel(backend, kernel, host, problem);
  EXPECT_TRUE(run.ok()) << KernelName(kernel) << ": " << run.status();
  if (run.ok()) return *std::move(run);
  // A failed run compares as all-NaN (the poison), so every later check fails too.
  const PoisonedOutputs poisoned(host);
  return KernelRun{poisoned.output_bytes, poisoned.Output(), poisoned.lse, Stats{}};
}

KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host) {
  return RunKernel(backend, kernel, host, host.View());
}

// Output relative error max|out − ref| / max|ref| ≤ rtol. NaN never passes.
void ExpectOutputMatches(const KernelRun& run, const Reference& ref, double rtol) {
  const double error = MaxAbsError(run.output, ref.output);
  const double magnitude = MaxAbs(ref.output);
  ASSERT_GT(magnitude, 0.0);
  EXPECT_LE(error / magnitude, rtol) << "max abs error " << error << ", max |ref| " << magnitude;
}

// lse within rtol · max(1, |lse|), exactly −inf where the reference row saw no key.
void ExpectLseMatches(const KernelRun& run, const Reference& ref, double rtol) {
  ASSERT_EQ(run.lse.size(), ref.lse.size());
  int reported = 0;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    bool ok;
    if (std::isinf(ref.lse[i])) {
      ok = std::isinf(run.lse[i]) && run.lse[i] < 0;
    } else {
      ok = std::abs(double(run.lse[i]) - ref.lse[i]) <= rtol * std::max(1.0, std::abs(ref.lse[i]));
    }
    if (!ok && reported++ < 5) {
      ADD_FAILURE() << "lse[" << i << "] = " << run.lse[i] << ", reference " << ref.lse[i];
    }
  }
}

void ExpectMatchesReference(const KernelRun& run, const Reference& ref, double rtol) {
  ExpectOutputMatches(run, ref, rtol);
  ExpectLseMatches(run, ref, rtol);
}

// Output rows of query rows that see no key must be exactly zero (and their lse −inf, which
// ExpectLseMatches checks).
void ExpectUnseeingRowsZero(const KernelRun& run, const HostProblem& host) {
  const Shape& s = host.shape;
  const int64_t hidden_rows = std::max<int64_t>(0, s.query_len - s.key_len);
  int64_t checked = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < hidden_rows; ++i) {
        const int64_t offset = ((b * s.heads + h) * s.query_len + i) * s.value_dim;
        for (int64_t c = 0; c < s.value_dim; ++c) {
          EXPECT_EQ(run.output[offset + c], 0.f) << "b=" << b << " h=" << h << " row=" << i;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 0) << "the case was meant to have rows that see no key";
}

}  // namespace attn::testing
