// Naive and Tiled on every backend of the binary (tests/backend_suite.h) against the float64
// reference (tests/reference.h): the seed's example, random fp32 and fp16/bf16 problems (odd
// sizes, GQA, causal, positions, windows, softcaps, ALiBi, sinks, ragged batches), mixed dtypes,
// the reported costs, layout rules and Naive's budget.
//
// Every run writes into outputs poisoned with NaN, so an element a kernel forgets to write fails
// the comparison. Inputs are fresh uniform(-1, 1) values with a seed per case, and sizes are odd:
// not multiples of any backend's tiles (the CPU's row blocks and key tiles; CUDA's 16 or 64 query
// rows, 32 keys) nor of CUDA's padded head sizes (32 … 256), except the cases named for them.
// Where a backend's arithmetic allows another bound, SuiteTraits says which and why.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/problem.h"
#include "tests/backend_suite.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

// ---------------------------------------------------------------------------------------------
// The seed's 8×4 example.

class SeedExampleTest : public BackendTest {};

TEST_P(SeedExampleTest, FirstRowMatchesExplainerForEveryKernelAndBlockK) {
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1.f, block_k);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(backend(), kernel, host);
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kSeedRow0[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
    }
  }
}

// Multiplying the queries by 1000 makes scores in the thousands: exp would overflow without the
// running max. Keys 0 and 7 still tie and now take (almost) all the weight, so row 0 is the
// mean of value rows 0 and 7 (kSeedHugeRow0). The tie itself is read from a trace
// (tests/backend_trace_test.cc).
TEST_P(SeedExampleTest, HugeScoresStayFiniteAndTied) {
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1000.f, block_k);
    const Reference ref = ReferenceAttention(host);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(backend(), kernel, host);
      for (float x : run.output) ASSERT_TRUE(std::isfinite(x));
      for (float x : run.lse) ASSERT_TRUE(std::isfinite(x));
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kSeedHugeRow0[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ref, 1e-5);
    }
  }
}

ATTN_BACKEND_SUITE(SeedExampleTest);

// ---------------------------------------------------------------------------------------------
// Random fp32 problems against the float64 reference.

struct RandomCase {
  std::string name;
  Shape shape;
  bool causal = false;
  int block_k = 16;          // Passed to the kernels as is, even when larger than key_len.
  int64_t key_position = 0;  // Positions (kernels/geometry.h); query_position −1 = unset.
  int64_t query_position = -1;
  int64_t window_left = -1;  // AttentionOptions.window_left/right; −1 = unbounded.
  int64_t window_right = -1;
  float softcap = 0.f;     // AttentionOptions.softcap (the queries × 32 when set, past the cap).
  float alibi_base = 0.f;  // ALiBi: head h's slope alibi_base^(h + 1); 0 = none.
  // A ragged batch (cu_seqlens): its sequences' query and key lengths, summing to the shape's
  // query_len and key_len (batch 1); empty = one sequence.
  std::vector<int64_t> query_lengths = {}, key_lengths = {};
  int threads = 2;  // The CPU's workers per call.
  // Attention sinks: head h's sink sink_base + 0.5 · h; NaN = none.
  float sink_base = std::numeric_limits<float>::quiet_NaN();
};

void PrintTo(const RandomCase& c, std::ostream* os) { *os << c.name; }

// ALiBi slopes base^(h + 1) for the problem's heads (none for base 0).
void SetAlibi(HostProblem& host, float base) {
  float slope = 1.f;
  for (int64_t h = 0; base > 0 && h < host.shape.heads; ++h) {
    host.alibi_slopes.push_back(slope *= base);
  }
}

// Sinks base + 0.5 · h for the problem's heads (none for NaN).
void SetSinks(HostProblem& host, float base) {
  for (int64_t h = 0; !std::isnan(base) && h < host.shape.heads; ++h) {
    host.sinks.push_back(base + 0.5f * static_cast<float>(h));
  }
}

// A ragged batch of these query and key lengths (none when empty), which must sum to the
// problem's query_len and key_len.
void SetSequences(HostProblem& host, const std::vector<int64_t>& query_lengths,
                  const std::vector<int64_t>& key_lengths) {
  if (query_lengths.empty()) return;
  host.cu_seqlens_q = CumulativeLengths(query_lengths);
  host.cu_seqlens_k = CumulativeLengths(key_lengths);
  ASSERT_EQ(host.cu_seqlens_q.back(), host.shape.query_len);
  ASSERT_EQ(host.cu_seqlens_k.back(), host.shape.key_len);
}

// The softcap, with the queries × 32 so that scores pass it (exact in every dtype: a power of two).
void SetSoftcap(HostProblem& host, float softcap) {
  if (softcap <= 0) return;
  host.softcap = softcap;
  for (size_t i = 0; i < host.query.size(); ++i) {
    host.query[i] *= 32.f;
    StoreElement(host.query_bytes.data(), host.dtype, static_cast<int64_t>(i), host.query[i]);
  }
}

// A case as a ragged batch of these query and key lengths.
template <class Case>
Case Ragged(Case c, std::vector<int64_t> query_lengths, std::vector<int64_t> key_lengths) {
  c.query_lengths = std::move(query_lengths);
  c.key_lengths = std::move(key_lengths);
  return c;
}

// A case run with this many CPU workers.
RandomCase Threads(RandomCase c, int threads) {
  c.threads = threads;
  return c;
}

// A case with sinks base + 0.5 · h.
template <class Case>
Case Sinks(Case c, float base) {
  c.sink_base = base;
  return c;
}

class RandomFp32Test : public BackendCaseTest<RandomCase> {};

TEST_P(RandomFp32Test, NaiveAndTiledMatchFloat64Reference) {
  const RandomCase& c = std::get<1>(GetParam());
  const uint64_t seed = std::hash<std::string>{}(c.name);
  HostProblem host = RandomProblem(c.shape, DType::kFloat32, c.causal, c.block_k, seed);
  host.key_position = c.key_position;
  if (c.query_position >= 0) host.query_position = c.query_position;
  if (c.window_left >= 0) host.window_left = c.window_left;
  if (c.window_right >= 0) host.window_right = c.window_right;
  SetAlibi(host, c.alibi_base);
  SetSinks(host, c.sink_base);
  ASSERT_NO_FATAL_FAILURE(SetSequences(host, c.query_lengths, c.key_lengths));
  SetSoftcap(host, c.softcap);
  absl::StatusOr<Backend*> backend = this->backend({.threads = c.threads});
  ASSERT_TRUE(backend.ok()) << backend.status();
  Problem problem = host.View();
  problem.block_k = c.block_k;  // View() clamps to key_len; the kernels must not need that.
  const Reference ref = ReferenceAttention(host);
  const bool unseeing_rows = c.causal && c.shape.query_len > c.shape.key_len;
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(**backend, kernel, host, problem);
    ExpectMatchesReference(run, ref, 1e-5);
    if (kernel == Kernel::kTiled) {
      EXPECT_EQ(run.stats.block_k, c.block_k);
    }
    if (unseeing_rows) ExpectUnseeingRowsZero(run, host);
  }
  // Tiled again at the backend's own tiles (its default block_k: CUDA's fused kernels).
  problem.block_k = (*backend)->default_block_k();
  SCOPED_TRACE("Tiled at the default block_k");
  const KernelRun fused = RunKernel(**backend, Kernel::kTiled, host, problem);
  ExpectMatchesReference(fused, ref, 1e-5);
  EXPECT_EQ(fused.stats.block_k, problem.block_k);
  if (unseeing_rows) ExpectUnseeingRowsZero(fused, host);
}

const std::vector<RandomCase> kRandomCases = {
    RandomCase{"FewerQueriesThanKeys", MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
    Threads({"MoreQueriesThanKeys", MakeShape(1, 2, 2, 61, 29, 15, 15), false, 7}, 3),
    Threads({"BlockK1", MakeShape(1, 1, 1, 13, 19, 9, 9), false, 1}, 1),
    RandomCase{"BlockK7", MakeShape(1, 3, 3, 41, 47, 11, 11), false, 7},
    RandomCase{"BlockK64", MakeShape(1, 2, 2, 71, 150, 13, 13), false, 64},
    RandomCase{"BlockKLargerThanKeys", MakeShape(1, 2, 2, 23, 29, 7, 7), false, 100},
    RandomCase{"HeadDim1", MakeShape(1, 2, 2, 31, 27, 1, 5), false, 8},
    RandomCase{"HeadDim33", MakeShape(1, 2, 2, 29, 35, 33, 33), false, 16},
    RandomCase{"ValueDimDiffers", MakeShape(1, 2, 2, 29, 35, 33, 20), false, 16},
    Threads({"Gqa6Over2", MakeShape(1, 6, 2, 19, 23, 9, 11), false, 5}, 3),
    RandomCase{"Gqa6Over3", MakeShape(1, 6, 3, 19, 23, 9, 7), false, 5},
    RandomCase{"Gqa4Over1", MakeShape(1, 4, 1, 19, 23, 9, 9), false, 5},
    RandomCase{"Batch2", MakeShape(2, 3, 3, 67, 43, 10, 12), false, 16},
    RandomCase{"CausalSquare", MakeShape(1, 2, 2, 45, 45, 8, 8), true, 7},
    RandomCase{"CausalFewerQueries", MakeShape(1, 2, 2, 37, 53, 17, 17), true, 16},
    Threads({"CausalMoreQueries", MakeShape(1, 2, 2, 61, 29, 15, 15), true, 7}, 3),
    Threads({"CausalMoreQueriesBlockK1", MakeShape(1, 1, 1, 20, 9, 3, 4), true, 1}, 1),
    Threads({"CausalGqaBatch2", MakeShape(2, 6, 2, 70, 83, 12, 9), true, 16}, 3),
    RandomCase{"CausalBlockKLargerThanKeys", MakeShape(1, 2, 1, 33, 21, 6, 6), true, 64},
    RandomCase{"LongRows", MakeShape(1, 1, 1, 131, 293, 24, 16), false, 64},
    // CUDA's padded head sizes (32, 64, 128, 256) and tiles (16 rows, 32 keys).
    RandomCase{"HeadDim32Exact", MakeShape(1, 2, 2, 33, 65, 32, 32), false, 64},
    RandomCase{"HeadDim64Exact", MakeShape(1, 2, 1, 70, 97, 64, 64), true, 64},
    RandomCase{"HeadDim65", MakeShape(1, 2, 2, 29, 71, 65, 65), false, 64},
    RandomCase{"HeadDim100", MakeShape(1, 2, 2, 45, 77, 100, 100), false, 64},
    RandomCase{"ValueDimWider", MakeShape(1, 2, 2, 29, 35, 20, 40), false, 16},
    RandomCase{"HeadDim256", MakeShape(1, 2, 1, 37, 70, 256, 256), false, 64},
    RandomCase{"HeadDim256CausalMoreQueries", MakeShape(1, 2, 2, 50, 19, 256, 200), true, 64},
    RandomCase{"ManyRowBlocksCausalGqa", MakeShape(2, 4, 2, 203, 333, 48, 40), true, 64},
    // Positions: a slice of a causal problem's keys (rows 0..5 see none of it), queries
    // mid-sequence over a GQA group, and moved keys with bottom-right queries.
    RandomCase{"PositionsKeySlice", MakeShape(1, 2, 2, 37, 19, 17, 17), true, 5, 23, 16},
    RandomCase{"PositionsQueriesMidSequence", MakeShape(1, 6, 2, 45, 130, 64, 64), true, 32, 0, 60},
    RandomCase{"PositionsMovedKeys", MakeShape(2, 2, 1, 70, 53, 32, 24), true, 16, 1000},
    // Sliding windows (CUDA's fused kernels skip the tiles a window hides on both sides of a
    // 64-row block) and softcaps past the scores, alone and together.
    RandomCase{"WindowCausalLeft", MakeShape(1, 2, 1, 203, 203, 64, 64), true, 16, 0, -1, 40},
    RandomCase{"WindowTwoSided", MakeShape(1, 2, 2, 97, 131, 32, 32), false, 7, 0, -1, 9, 5},
    RandomCase{"WindowCausalLeftZero", MakeShape(1, 2, 2, 45, 45, 17, 17), true, 16, 0, -1, 0},
    RandomCase{"Softcap", MakeShape(1, 2, 2, 70, 97, 64, 64), false, 16, 0, -1, -1, -1, 30.f},
    RandomCase{"SoftcapCausalWindow", MakeShape(1, 4, 2, 150, 150, 48, 40), true, 16, 0, -1, 33, -1,
               5.f},
    // ALiBi: CUDA's fused fp32 kernel (block_k 32) with GQA and causal, the row kernel on a key
    // slice, and all three with a window and a softcap.
    RandomCase{"AlibiCausalGqa", MakeShape(1, 4, 2, 97, 131, 64, 64), true, 32, 0, -1, -1, -1, 0.f,
               0.5f},
    RandomCase{"AlibiKeySlice", MakeShape(1, 2, 2, 37, 19, 17, 17), false, 5, 23, 16, -1, -1, 0.f,
               0.7f},
    RandomCase{"AlibiSoftcapWindow", MakeShape(1, 4, 2, 150, 150, 48, 40), true, 32, 0, -1, 33, -1,
               5.f, 0.6f},
    // Ragged batches: unequal lengths, a sequence of length 1 and an empty one, sequences that
    // start mid-tile and mid-block (CUDA's fused kernels' 64-row blocks span them), with causal,
    // a window and ALiBi.
    Ragged(RandomCase{"RaggedUnequal", MakeShape(1, 4, 2, 46, 41, 19, 23), false, 7}, {5, 1, 40},
           {7, 1, 33}),
    Ragged(RandomCase{"RaggedCausalEmpty", MakeShape(1, 2, 1, 13, 19, 17, 17), true, 16},
           {0, 6, 3, 4}, {5, 0, 8, 6}),
    Ragged(RandomCase{"RaggedFusedCausalAlibi", MakeShape(1, 4, 2, 330, 340, 64, 64), true, 32, 0,
                      -1, -1, -1, 0.f, 0.5f},
           {100, 29, 201}, {120, 19, 201}),
    Ragged(RandomCase{"RaggedWindowSoftcap", MakeShape(1, 2, 2, 203, 203, 48, 40), true, 16, 0, -1,
                      9, -1, 5.f},
           {70, 133}, {70, 133}),
    // Attention sinks: CUDA's fused fp32 kernel with GQA, causal and a window (gpt-oss); the
    // row kernel on a key slice whose first rows see no key (output 0, lse = sink); sinks far
    // above every score with ALiBi; a ragged batch.
    Sinks(RandomCase{"SinksCausalWindowGqa", MakeShape(1, 4, 2, 97, 131, 64, 64), true, 32, 0, -1,
                     40},
          0.5f),
    Sinks(RandomCase{"SinksKeySlice", MakeShape(1, 2, 2, 37, 19, 17, 17), true, 5, 23, 16}, -0.25f),
    Sinks(RandomCase{"SinksFarAboveAlibi", MakeShape(1, 2, 1, 70, 53, 32, 24), false, 16, 0, -1, -1,
                     -1, 0.f, 0.5f},
          30.f),
    Sinks(Ragged(RandomCase{"SinksRagged", MakeShape(1, 4, 2, 46, 41, 19, 23), true, 7}, {5, 1, 40},
                 {7, 1, 33}),
          1.f),
};

ATTN_BACKEND_CASE_SUITE(RandomFp32Test, RandomCase, kRandomCases);

// ---------------------------------------------------------------------------------------------
// fp16 and bf16 storage.

struct LowPrecisionCase {
  std::string name;
  DType dtype;
  Shape shape;
  bool causal;
  int block_k;
  int64_t window_left = -1;  // AttentionOptions.window_left; −1 = unbounded.
  float softcap = 0.f;       // AttentionOptions.softcap (the queries × 32 when set).
  float alibi_base = 0.f;    // ALiBi: head h's slope alibi_base^(h + 1); 0 = none.
  std::vector<int64_t> query_lengths = {}, key_lengths = {};  // A ragged batch (as RandomCase).
  float sink_base = std::numeric_limits<float>::quiet_NaN();  // Sinks (as RandomCase).
};

void PrintTo(const LowPrecisionCase& c, std::ostream* os) { *os << c.name; }

class LowPrecisionTest : public BackendCaseTest<LowPrecisionCase> {
 protected:
  // ProbabilityRoundingBound where this backend's Tiled rounds its probabilities, else 0.
  double TiledRounding(Kernel kernel, const HostProblem& host) const {
    return kernel == Kernel::kTiled && traits().tiled_rounds_probabilities
               ? ProbabilityRoundingBound(host)
               : 0.0;
  }
};

// The FlashAttention rule: error against float64 (on the same rounded inputs) at most twice the
// error of an eager same-precision implementation, plus an atol for the roundings the kernels do
// that the reference does not (LowPrecisionAtol: the output store's half ulp, 1e-5 of fp32
// arithmetic; and CUDA Tiled's tensor-core P·V on probabilities rounded to the input dtype,
// ProbabilityRoundingBound). Each kernel's error alone is within that atol, however lucky the
// baseline: with |v| < 1 and |out| < 1, at most ≈ 2u (≈ 1e-3 fp16, 8e-3 bf16).
TEST_P(LowPrecisionTest, ErrorWithinTwiceTheSamePrecisionBaseline) {
  const LowPrecisionCase& c = std::get<1>(GetParam());
  const uint64_t seed = std::hash<std::string>{}(c.name);
  HostProblem host = RandomProblem(c.shape, c.dtype, c.causal, c.block_k, seed);
  if (c.window_left >= 0) host.window_left = c.window_left;
  SetAlibi(host, c.alibi_base);
  SetSinks(host, c.sink_base);
  ASSERT_NO_FATAL_FAILURE(SetSequences(host, c.query_lengths, c.key_lengths));
  SetSoftcap(host, c.softcap);
  ASSERT_EQ(host.output_dtype, c.dtype);
  const Reference ref = ReferenceAttention(host);
  const double baseline_error = MaxAbsError(LowPrecisionBaseline(host, c.dtype), ref.output);
  ASSERT_TRUE(std::isfinite(baseline_error));
  const bool unseeing_rows = c.causal && c.shape.query_len > c.shape.key_len;
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const double atol = LowPrecisionAtol(host, ref) + TiledRounding(kernel, host);
    const KernelRun run = RunKernel(backend(), kernel, host);
    ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 2));
    const double error = MaxAbsError(run.output, ref.output);
    EXPECT_LE(error, 2 * baseline_error + atol)
        << "baseline error " << baseline_error << ", atol " << atol;
    // Accumulation is fp32 and lse is stored as fp32 from fp32 weights, so lse meets the fp32
    // bound.
    ExpectLseMatches(run, ref, 1e-5);
    if (unseeing_rows) ExpectUnseeingRowsZero(run, host);
  }
  // Tiled at the backend's own tiles too (above: c.block_k; on CUDA the row kernel unless it is
  // 32, which rounds no probability, so one bound serves both).
  SCOPED_TRACE("Tiled at the default block_k");
  Problem own_tiles = host.View();
  own_tiles.block_k = backend().default_block_k();
  const KernelRun fused = RunKernel(backend(), Kernel::kTiled, host, own_tiles);
  EXPECT_LE(MaxAbsError(fused.output, ref.output),
            2 * baseline_error + LowPrecisionAtol(host, ref) + TiledRounding(Kernel::kTiled, host))
      << "baseline error " << baseline_error;
  ExpectLseMatches(fused, ref, 1e-5);
  if (unseeing_rows) ExpectUnseeingRowsZero(fused, host);
}

const std::vector<LowPrecisionCase> kLowPrecisionCases = {
    LowPrecisionCase{"F16", DType::kFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
    LowPrecisionCase{"F16CausalGqa", DType::kFloat16, MakeShape(2, 6, 3, 61, 29, 33, 20), true, 7},
    LowPrecisionCase{"Bf16", DType::kBFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
    LowPrecisionCase{"Bf16CausalGqa", DType::kBFloat16, MakeShape(2, 4, 1, 45, 71, 9, 13), true, 3},
    // CUDA's tensor-core kernel: 64-row blocks, 64-key tiles (32 for head size 256), every padded
    // head size; a causal case whose first 64-row block sees no key at all.
    LowPrecisionCase{"F16HeadDim32Exact", DType::kFloat16, MakeShape(1, 2, 2, 33, 65, 32, 32),
                     false, 64},
    LowPrecisionCase{"F16HeadDim64Causal", DType::kFloat16, MakeShape(1, 2, 1, 150, 40, 64, 64),
                     true, 64},
    LowPrecisionCase{"Bf16HeadDim100Causal", DType::kBFloat16, MakeShape(1, 3, 1, 90, 130, 100, 72),
                     true, 64},
    LowPrecisionCase{"F16HeadDim256", DType::kFloat16, MakeShape(1, 2, 2, 70, 100, 256, 256), false,
                     64},
    LowPrecisionCase{"Bf16HeadDim256Causal", DType::kBFloat16, MakeShape(1, 2, 2, 67, 99, 200, 256),
                     true, 64},
    LowPrecisionCase{"Bf16ManyTilesBatch2", DType::kBFloat16, MakeShape(2, 2, 2, 200, 333, 64, 48),
                     false, 64},
    LowPrecisionCase{"F16ValueDimWider", DType::kFloat16, MakeShape(1, 4, 2, 77, 131, 20, 40), true,
                     64},
    // A causal window and a softcap.
    LowPrecisionCase{"Bf16CausalWindow", DType::kBFloat16, MakeShape(1, 2, 2, 200, 200, 64, 64),
                     true, 64, 45},
    LowPrecisionCase{"F16SoftcapWindow", DType::kFloat16, MakeShape(1, 4, 2, 130, 150, 32, 32),
                     true, 64, 60, 10.f},
    // ALiBi (GQA, causal), and with a window and a softcap.
    LowPrecisionCase{"Bf16AlibiCausalGqa", DType::kBFloat16, MakeShape(1, 4, 2, 200, 200, 64, 64),
                     true, 64, -1, 0.f, 0.5f},
    LowPrecisionCase{"F16AlibiSoftcapWindow", DType::kFloat16, MakeShape(1, 4, 2, 130, 150, 32, 32),
                     true, 64, 60, 10.f, 0.7f},
    // A ragged batch whose sequences start mid-block and mid-tile, causal with ALiBi.
    Ragged(LowPrecisionCase{"Bf16RaggedCausalAlibi", DType::kBFloat16,
                            MakeShape(1, 4, 2, 231, 260, 64, 64), true, 64, -1, 0.f, 0.5f},
           {1, 100, 130}, {30, 100, 130}),
    // Sinks on the tensor-core kernel: GQA, causal with a window (gpt-oss), the first block of
    // rows seeing no key; and with a softcap and ALiBi.
    Sinks(LowPrecisionCase{"Bf16SinksCausalWindowGqa", DType::kBFloat16,
                           MakeShape(1, 4, 2, 150, 90, 64, 64), true, 64, 45},
          0.5f),
    Sinks(LowPrecisionCase{"F16SinksSoftcapAlibi", DType::kFloat16,
                           MakeShape(1, 4, 2, 130, 150, 32, 32), true, 64, 60, 10.f, 0.7f},
          2.f),
};

ATTN_BACKEND_CASE_SUITE(LowPrecisionTest, LowPrecisionCase, kLowPrecisionCases);

class MixedDtypeTest : public BackendTest {};

// Low-precision inputs with an fp32 output: the only rounding left is the inputs', which the
// reference shares, so the fp32 bound applies — plus, for a Tiled that rounds its probabilities
// (SuiteTraits), ProbabilityRoundingBound and nothing else.
TEST_P(MixedDtypeTest, LowPrecisionInputWithFp32OutputMeetsFp32Bound) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    HostProblem host = RandomProblem(MakeShape(1, 4, 2, 43, 57, 19, 11), dtype, /*causal=*/true, 8,
                                     77 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    const Reference ref = ReferenceAttention(host);
    const double magnitude = MaxAbs(ref.output);
    ASSERT_GT(magnitude, 0.0);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(dtype));
      const KernelRun run = RunKernel(backend(), kernel, host);
      ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 4));
      const double rounding = kernel == Kernel::kTiled && traits().tiled_rounds_probabilities
                                  ? ProbabilityRoundingBound(host)
                                  : 0.0;
      EXPECT_LE(MaxAbsError(run.output, ref.output), 1e-5 * magnitude + rounding)
          << "max |ref| " << magnitude;
      ExpectLseMatches(run, ref, 1e-5);
    }
  }
}

// An fp32 problem with a bf16/fp16 output: the kernel computes exactly what it does for an fp32
// output and rounds only the store (to nearest even).
TEST_P(MixedDtypeTest, LowPrecisionOutputOnlyRoundsTheStore) {
  HostProblem host = RandomProblem(MakeShape(1, 3, 3, 29, 41, 13, 9), DType::kFloat32,
                                   /*causal=*/false, 8, 4242);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    host.output_dtype = DType::kFloat32;
    const KernelRun fp32 = RunKernel(backend(), kernel, host);
    ExpectMatchesReference(fp32, ReferenceAttention(host), 1e-5);
    for (DType output_dtype : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(output_dtype));
      host.output_dtype = output_dtype;
      const KernelRun run = RunKernel(backend(), kernel, host);
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

ATTN_BACKEND_SUITE(MixedDtypeTest);

// ---------------------------------------------------------------------------------------------
// Reported costs.

class StatsTest : public BackendTest {};

TEST_P(StatsTest, NaiveReportsItsMatrices) {
  const Shape shape = MakeShape(2, 3, 1, 37, 53, 9, 7);
  const HostProblem host = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 16, 9);
  const KernelRun run = RunKernel(backend(), Kernel::kNaive, host);
  const int64_t matrix = 2 * 3 * 37 * 53;
  EXPECT_EQ(run.stats.intermediate_bytes, 16 * matrix);
  EXPECT_EQ(run.stats.intermediate_bytes, host.View().NaiveIntermediateBytes());
  EXPECT_GE(run.stats.scratch_bytes, 8 * matrix);  // The fp32 score and weight matrices.
  EXPECT_EQ(run.stats.flops, host.View().Flops());
  EXPECT_EQ(run.stats.flops, double(matrix) * 2 * (9 + 7));
  EXPECT_GE(run.stats.peak_memory_bytes, run.stats.scratch_bytes);
  EXPECT_GE(run.stats.compute_ns, 0);
  ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
}

TEST_P(StatsTest, TiledNeverAllocatesTheScoreMatrix) {
  constexpr int64_t n = 1024;
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostProblem host = RandomProblem(MakeShape(1, 1, 1, n, n, 16, 16), dtype, /*causal=*/false, 64,
                                     10 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    const KernelRun run = RunKernel(backend(), Kernel::kTiled, host);
    EXPECT_EQ(run.stats.intermediate_bytes, 0);
    EXPECT_GT(run.stats.scratch_bytes, 0);
    EXPECT_LT(run.stats.scratch_bytes, 8 * n * n);
    // Inputs, output and lse only: far below one n × n fp32 matrix.
    EXPECT_GT(run.stats.peak_memory_bytes, 0);
    EXPECT_LT(run.stats.peak_memory_bytes, 4 * n * n);
    EXPECT_EQ(run.stats.block_k, 64);
    EXPECT_EQ(run.stats.flops, host.View().Flops());
    EXPECT_EQ(run.stats.flops, double(n) * n * 2 * (16 + 16));
    EXPECT_GE(run.stats.compute_ns, 0);
    const Reference ref = ReferenceAttention(host);
    if (dtype == DType::kFloat32) {
      ExpectMatchesReference(run, ref, 1e-5);
    } else {
      const double rounding =
          traits().tiled_rounds_probabilities ? ProbabilityRoundingBound(host) : 0.0;
      EXPECT_LE(MaxAbsError(run.output, ref.output), 1e-5 * MaxAbs(ref.output) + rounding);
      ExpectLseMatches(run, ref, 1e-5);
    }
  }
}

// FLOPs count only unmasked pairs: with Nq = Nk = n the causal mask leaves n(n+1)/2 of them.
TEST_P(StatsTest, CausalCountsOnlyVisiblePairs) {
  const Shape shape = MakeShape(1, 2, 2, 47, 47, 5, 3);
  const HostProblem full = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 8, 11);
  const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 8, 12);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun full_run = RunKernel(backend(), kernel, full);
    const KernelRun causal_run = RunKernel(backend(), kernel, causal);
    EXPECT_EQ(full_run.stats.flops, full.View().Flops());
    EXPECT_EQ(causal_run.stats.flops, causal.View().Flops());
    EXPECT_EQ(causal_run.stats.flops, 2.0 * (47 * 48 / 2) * 2 * (5 + 3));
    EXPECT_LT(causal_run.stats.flops, full_run.stats.flops);
    ExpectMatchesReference(causal_run, ReferenceAttention(causal), 1e-5);
  }
  // Bottom-right alignment with Nq < Nk: row i sees i + (Nk − Nq) + 1 keys.
  const HostProblem wide = RandomProblem(MakeShape(1, 1, 1, 5, 9, 2, 2), DType::kFloat32,
                                         /*causal=*/true, 4, 13);
  EXPECT_EQ(wide.View().Flops(), (5.0 + 6 + 7 + 8 + 9) * 2 * (2 + 2));
}

ATTN_BACKEND_SUITE(StatsTest);

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

class LayoutTest : public BackendTest {};

// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads). The same
// problem with each key/value head copied out to its query heads must give the same result: the
// same bits from Tiled, whose per-row arithmetic does not depend on the grouping, and from Naive
// where its products do not either (SuiteTraits::naive_bits_ignore_grouping).
TEST_P(LayoutTest, GqaHeadReadsItsGroupsKeyValueHead) {
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
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun grouped_run = RunKernel(backend(), kernel, gqa);
    const KernelRun expanded_run = RunKernel(backend(), kernel, expanded);
    ExpectMatchesReference(grouped_run, ref, 1e-5);
    ExpectMatchesReference(expanded_run, ref, 1e-5);
    if (kernel == Kernel::kTiled || traits().naive_bits_ignore_grouping) {
      EXPECT_EQ(grouped_run.output_bytes, expanded_run.output_bytes);
    }
  }
}

// Bottom-right causal alignment: query row i of Nq sees keys 0 … i + Nk − Nq, so its output
// is non-causal attention of that one row over that prefix of the keys.
TEST_P(LayoutTest, CausalMaskIsBottomRightAligned) {
  for (const auto& [query_len, key_len] : {std::pair<int64_t, int64_t>{5, 9}, {9, 5}, {7, 7}}) {
    const Shape shape = MakeShape(1, 1, 1, query_len, key_len, 6, 4);
    const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 3,
                                             static_cast<uint64_t>(query_len * 100 + key_len));
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message()
                   << KernelName(kernel) << " Nq=" << query_len << " Nk=" << key_len);
      const KernelRun run = RunKernel(backend(), kernel, causal);
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

ATTN_BACKEND_SUITE(LayoutTest);

// ---------------------------------------------------------------------------------------------
// Naive's memory budget.

class BudgetTest : public BackendTest {};

TEST_P(BudgetTest, NaiveOverBudgetNamesTiledWhichSucceeds) {
  absl::StatusOr<Backend*> small = backend({.max_naive_bytes = 1000});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->max_naive_bytes(), 1000);
  const HostProblem host = RandomProblem(MakeShape(1, 1, 1, 64, 64, 8, 8), DType::kFloat32,
                                         /*causal=*/false, 16, 14);
  PoisonedOutputs outputs(host);
  const absl::StatusOr<Stats> naive = (*small)->Naive(host.View(), outputs.outputs());
  ASSERT_FALSE(naive.ok());
  EXPECT_EQ(naive.status().code(), absl::StatusCode::kResourceExhausted) << naive.status();
  EXPECT_NE(naive.status().message().find("Tiled"), std::string_view::npos) << naive.status();

  const KernelRun tiled = RunKernel(**small, Kernel::kTiled, host);
  ExpectMatchesReference(tiled, ReferenceAttention(host), 1e-5);
  EXPECT_TRUE((*small)->healthy());
}

ATTN_BACKEND_SUITE(BudgetTest);

}  // namespace
