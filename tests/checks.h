// Test support: run a kernel into poisoned outputs and compare it with the float64 reference,
// for every backend (the shared suite, tests/backend_suite.h, and each backend's own tests).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "tests/reference.h"

namespace attn::testing {

enum class Kernel { kNaive, kTiled };

// Row 0 of the seed's example (SeedExample()) as the explainer prints it, and with the queries
// × 1000 (SeedExample(1000)): keys 0 and 7 tie and take almost all the weight, so it is the mean
// of value rows 0 and 7.
inline constexpr float kSeedRow0[] = {-0.593223f, 0.406777f, -1.332858f, -0.371937f};
inline constexpr float kSeedHugeRow0[] = {-0.5f, 0.5f, -3.f, -2.f};

const char* KernelName(Kernel kernel);

struct KernelRun {
  std::vector<uint8_t> output_bytes;
  std::vector<float> output;  // Decoded to fp32.
  std::vector<float> lse;
  Stats stats;
};

// Runs one kernel on `problem` (a view of `host`, possibly adjusted) into NaN-poisoned
// outputs. Uses no gtest assertions, so threads may call it.
absl::StatusOr<KernelRun> TryKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                                    const Problem& problem);

// TryKernel that records a failure; a failed run comes back all NaN (the poison), so every
// later comparison fails too.
KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                    const Problem& problem);
KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host);

// Output relative error max|out − ref| / max|ref| ≤ rtol. NaN never passes.
void ExpectOutputMatches(const KernelRun& run, const Reference& ref, double rtol);

// lse within rtol · max(1, |lse|), exactly −inf where the reference row saw no key.
void ExpectLseMatches(const KernelRun& run, const Reference& ref, double rtol);

void ExpectMatchesReference(const KernelRun& run, const Reference& ref, double rtol);

// Output rows of query rows that see no key (by ReferenceSees) must be exactly zero (and their
// lse −inf, which ExpectLseMatches checks); the case must have such rows.
void ExpectUnseeingRowsZero(const KernelRun& run, const HostProblem& host);

// A problem's keys and values in a KV store of `backend` (server-resident, paged), and the
// problem over its pages.
struct PagedCopy {
  std::unique_ptr<KvStore> store;
  Problem problem;  // host.View() with key/value unset and pages = &store->pages().
};

// Appends host's keys and values (batch 1) to a new store of the backend in appends of the
// given token counts (the rest in a last one), in `input_dtype` (the host's dtype: default),
// stored in `store_dtype` (the host's dtype: default).
absl::StatusOr<PagedCopy> MakePaged(Backend& backend, const HostProblem& host,
                                    const std::vector<int64_t>& pieces = {},
                                    const DType* input_dtype = nullptr,
                                    const DType* store_dtype = nullptr);

// `host` (fp32) with its keys and values replaced by what an fp8 store of them holds, code ·
// scale (read back through CopyOut): the exact inputs of a kernel reading the store.
HostProblem DequantizedFrom(const KvStore& store, const HostProblem& host);

// `host` through Backend::Decode, outputs poisoned first: over a KV store's pages (MakePaged, in
// two appends) when batch is 1, else over the contiguous tensors. A failed Decode is a test
// failure and an empty run.
KernelRun RunDecode(Backend& backend, const HostProblem& host);

// The run against the reference by its dtype's rule: fp32 within 1e-5 (ExpectMatchesReference),
// fp16/bf16 by ExpectLowPrecisionMatches; its lse within 1e-5 either way.
void ExpectMatchesInItsDtype(const KernelRun& run, const HostProblem& host, const Reference& ref);

// Naive and Tiled (RunKernel) and Decode (RunDecode) on `backend`, each against the float64
// reference by ExpectMatchesInItsDtype.
void ExpectNaiveTiledAndDecodeMatch(Backend& backend, const HostProblem& host);

// The largest |a − b| over two references' outputs (the same shape): how much an option changes
// the answer, so a test can show that a kernel ignoring it would be caught.
double LargestOutputDifference(const Reference& a, const Reference& b);

// The rule for low-precision outputs (the FlashAttention rule, as LowPrecisionTest states it):
// error against float64 at most twice a same-precision naive baseline's, plus LowPrecisionAtol
// (at most a couple of output ulps at 1); lse within 1e-5.
void ExpectLowPrecisionMatches(const KernelRun& run, const HostProblem& host, const Reference& ref);

// Unit roundoff u of a storage dtype: round-to-nearest moves a normal x by at most u·|x|.
double UnitRoundoff(DType dtype);

// The atol of a low-precision output against float64 for a kernel that rounds nothing but its
// output store: half an ulp of the largest output, u·max|ref| (in the host's output dtype), plus
// 1e-5 for fp32 arithmetic. Added to twice a same-precision baseline's error (the FlashAttention
// rule, LowPrecisionTest).
double LowPrecisionAtol(const HostProblem& host, const Reference& ref);

// How far a Tiled that multiplies P·V on probabilities rounded to the input dtype (CUDA's
// tensor-core kernel; SuiteTraits::tiled_rounds_probabilities) may move an output element.
//
// The unnormalized weights w_j = exp(s_j − m) ∈ (0, 1] are rounded to that dtype, while the
// denominator sums the fp32 w_j. The output then moves by Σ_j (round(w_j) − w_j)·v_j / Σ_j w_j,
// and since |round(w) − w| ≤ u·w that is at most u·max|v|. fp16 has a second, absolute, term:
// weights below its smallest normal 2^-14 round to a multiple of 2^-24 (error ≤ 2^-25), at most
// key_len·2^-25·max|v| over a denominator ≥ 1 (the max's weight is 1). 0 for fp32 inputs.
double ProbabilityRoundingBound(const HostProblem& host);

}  // namespace attn::testing
