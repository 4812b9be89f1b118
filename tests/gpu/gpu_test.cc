// The CUDA backend against the float64 reference (tests/reference.h): every case of the CPU
// suites (tests/kernels_test.cc, tests/trace_test.cc) ported to the device, plus what only the
// device has: its fused Tiled kernels (fp16/bf16 tensor cores, fp32) at their own block_k beside
// the row kernel at any other, the fallback under a device's shared-memory limit, its head-size
// limit and its pool of streams serving concurrent requests. Tiled's plan (TiledPlanTest) is host
// code and runs without a device.
//
// Each suite opens the backend once (cuda::MakeCudaBackend(0, 0)). Without a CUDA device every
// test reports SKIPPED with the reason; with a device that the backend cannot open, or with
// ATTN_REQUIRE_GPU=1 in the environment (for a run that must not skip), every test fails
// instead. Never a silent pass.
//
// As on the CPU: outputs are poisoned with NaN before each run (the backend copies its results
// into those host buffers, so an element it never writes fails the comparison), inputs are fresh
// uniform(-1, 1) values with a seed per case, and sizes are odd, not multiples of the kernels'
// tiles (16 or 64 query rows, 32 keys) nor of their padded head sizes (32 … 256).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/problem.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

constexpr double kEps = FLT_EPSILON;

// ATTN_REQUIRE_GPU set to anything but "" or "0": a missing device fails the tests.
bool GpuRequired() {
  const char* value = std::getenv("ATTN_REQUIRE_GPU");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

// A fixture that opens the CUDA backend once per test suite and closes it after the suite.
template <class Base>
class CudaFixture : public Base {
 public:
  static void SetUpTestSuite() {
    backend_ = new absl::StatusOr<std::unique_ptr<Backend>>(cuda::MakeCudaBackend(0, 0));
  }
  static void TearDownTestSuite() {
    delete backend_;
    backend_ = nullptr;
  }

 protected:
  void SetUp() override {
    ASSERT_NE(backend_, nullptr);
    if (backend_->ok()) return;
    std::string error;
    const int devices = cuda::DeviceCount(&error);
    if (devices > 0 || GpuRequired()) {
      FAIL() << "the CUDA backend did not open (" << devices
             << " device(s), ATTN_REQUIRE_GPU=" << GpuRequired() << "): " << backend_->status();
    }
    GTEST_SKIP() << "no CUDA device: " << backend_->status();
  }

  static Backend& gpu() { return ***backend_; }

 private:
  static inline absl::StatusOr<std::unique_ptr<Backend>>* backend_ = nullptr;
};

using CudaTest = CudaFixture<::testing::Test>;

// ---------------------------------------------------------------------------------------------
// Running a kernel and comparing with the reference (as in tests/kernels_test.cc).

// Unit roundoff u of a storage dtype: round-to-nearest moves a normal x by at most u·|x|.
double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return std::ldexp(1.0, -24);
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
  }
  return 1;
}

// How far the fp16/bf16 Tiled kernel may move an output element by rounding probabilities.
//
// Its P·V product is a tensor-core mma on operands of the input dtype, so it rounds the
// unnormalized weights w_j = exp(s_j − m) ∈ (0, 1] to that dtype, while the denominator sums
// the fp32 w_j. The output then moves by Σ_j (round(w_j) − w_j)·v_j / Σ_j w_j, and since
// |round(w) − w| ≤ u·w that is at most u·max|v|. fp16 has a second, absolute, term: weights
// below its smallest normal 2^-14 round to a multiple of 2^-24 (error ≤ 2^-25), at most
// key_len·2^-25·max|v| over a denominator ≥ 1 (the max's weight is 1). Everything else in that
// kernel is fp32 (products of fp16/bf16 inputs are exact in fp32).
double ProbabilityRoundingBound(const HostProblem& host) {
  if (host.dtype == DType::kFloat32) return 0;
  double max_value = 0;
  for (float v : host.value) max_value = std::max(max_value, double(std::abs(v)));
  const double subnormal = host.dtype == DType::kFloat16
                               ? double(host.shape.key_len) * std::ldexp(1.0, -25) * max_value
                               : 0;
  return UnitRoundoff(host.dtype) * max_value + subnormal;
}

// ---------------------------------------------------------------------------------------------
// Trace (as in tests/trace_test.cc, without its bit-for-bit comparison with the CPU Tiled: the
// CUDA Tiled kernels sum in another order, so the trace's output is held to the reference).

std::vector<TraceItem> CollectTrace(Backend& backend, const Problem& problem,
                                    const std::vector<RowRef>& rows) {
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(problem, rows);
  EXPECT_TRUE(cursor.ok()) << cursor.status();
  std::vector<TraceItem> items;
  if (!cursor.ok()) return items;
  TraceItem item;
  while ((*cursor)->Next(&item)) {
    items.push_back(item);
    if (items.size() > 100000) {
      ADD_FAILURE() << "trace does not end";
      break;
    }
  }
  EXPECT_FALSE((*cursor)->Next(&item)) << "Next after the end must keep returning false";
  EXPECT_EQ((*cursor)->stats().block_k, problem.block_k);
  return items;
}

void ExpectWithin(double actual, double expected, double tolerance, const char* what, int tile,
                  int64_t index) {
  EXPECT_LE(std::abs(actual - expected), tolerance)
      << what << " at tile " << tile << " index " << index << ": " << actual << " vs " << expected;
}

// Checks one traced row (its slice of the trace, RowDone last) against the recurrence of
// DESIGN.md ("One update step"), recomputed in double from each step's own inputs, and its end
// against the float64 reference.
void CheckTraceRow(const HostProblem& host, const Problem& problem, const RowRef& ref,
                   const std::vector<TraceItem>& items, const Reference& reference) {
  SCOPED_TRACE(::testing::Message()
               << "row b=" << ref.batch << " h=" << ref.head << " i=" << ref.row);
  const Shape& s = host.shape;
  const int64_t block_k = problem.block_k;
  const auto [first_tile, end_tile] = ReferenceTiles(host, ref.row, block_k);
  const int64_t expected_tiles = end_tile - first_tile;
  ASSERT_EQ(static_cast<int64_t>(items.size()), expected_tiles + 1);

  const int64_t kv_head = ref.head / (s.heads / s.kv_heads);
  const float* q =
      &host.query[((ref.batch * s.heads + ref.head) * s.query_len + ref.row) * s.head_dim];
  const float* k = &host.key[(ref.batch * s.kv_heads + kv_head) * s.key_len * s.head_dim];
  const float* v = &host.value[(ref.batch * s.kv_heads + kv_head) * s.key_len * s.value_dim];

  // The device sums a score's head_dim products one by one in fp32: at most (d + 1)·eps of
  // scale · Σ|q_c k_c|; never looser than the CPU suite's 1e-5.
  const double score_rtol = std::max(1e-5, double(s.head_dim + 2) * kEps);
  // exp of a float argument x ≤ 0: the device's expf is good to 2 ulp; the argument (a
  // difference of two floats) carries up to half an ulp of |x|, a relative |x|·eps in the result.
  auto exp_tolerance = [](double x, double expected) {
    return 4 * kEps * (1 + std::abs(x)) * expected + 1e-38;
  };

  float prev_max = -INFINITY;
  float prev_denominator = 0.f;
  std::vector<float> prev_acc(s.value_dim, 0.f);
  for (int64_t t = 0; t < expected_tiles; ++t) {
    ASSERT_TRUE(std::holds_alternative<TraceStep>(items[t])) << "item " << t;
    const TraceStep& step = std::get<TraceStep>(items[t]);
    const int tile = static_cast<int>(first_tile + t);
    EXPECT_EQ(step.row.batch, ref.batch);
    EXPECT_EQ(step.row.head, ref.head);
    EXPECT_EQ(step.row.row, ref.row);
    EXPECT_EQ(step.tile, tile);
    EXPECT_EQ(step.key_begin, tile * block_k);
    EXPECT_EQ(step.key_end, std::min(tile * block_k + block_k, s.key_len));
    const int64_t n = step.key_end - step.key_begin;
    ASSERT_GT(n, 0);
    ASSERT_EQ(static_cast<int64_t>(step.scores.size()), n);
    ASSERT_EQ(static_cast<int64_t>(step.weights.size()), n);
    ASSERT_EQ(static_cast<int64_t>(step.accumulator.size()), s.value_dim);
    ASSERT_EQ(static_cast<int64_t>(step.estimate.size()), s.value_dim);

    // Scores: scale · q·k in double where visible, −inf where masked.
    int64_t tile_visible = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = step.key_begin + j;
      if (!ReferenceSees(host, ref.row, key)) {
        EXPECT_EQ(step.scores[j], -INFINITY) << "masked key " << key;
        continue;
      }
      ++tile_visible;
      double dot = 0, magnitude = 0;
      for (int64_t c = 0; c < s.head_dim; ++c) {
        dot += double(q[c]) * double(k[key * s.head_dim + c]);
        magnitude += std::abs(double(q[c]) * double(k[key * s.head_dim + c]));
      }
      const double scale = host.scale;
      ExpectWithin(step.scores[j], scale * dot, score_rtol * scale * magnitude + 1e-30, "score",
                   tile, j);
    }
    EXPECT_GT(tile_visible, 0) << "a tile the mask hides entirely was emitted";

    // Running max: exact, since max involves no rounding.
    EXPECT_EQ(step.max_before, prev_max);
    float tile_max = -INFINITY;
    for (float score : step.scores) tile_max = std::max(tile_max, score);
    EXPECT_EQ(step.max_after, std::max(step.max_before, tile_max));
    ASSERT_TRUE(std::isfinite(step.max_after));

    if (step.max_before == -INFINITY) {
      EXPECT_EQ(step.rescale, 0.f) << "tile " << t;
    } else {
      const double x = double(step.max_before) - double(step.max_after);
      ExpectWithin(step.rescale, std::exp(x), exp_tolerance(x, std::exp(x)), "rescale", tile, 0);
    }
    double weight_sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (step.scores[j] == -INFINITY) {
        EXPECT_EQ(step.weights[j], 0.f) << "masked weight " << j;
      } else {
        const double x = double(step.scores[j]) - double(step.max_after);
        ExpectWithin(step.weights[j], std::exp(x), exp_tolerance(x, std::exp(x)), "weight", tile,
                     j);
      }
      weight_sum += step.weights[j];
    }

    // Denominator and accumulator from the recorded weights and rescale: the only error left is
    // fp32 summation of n + 1 terms, at most (n + 2)·eps times the sum of their magnitudes.
    const double sum_tolerance = double(n + 2) * kEps;
    const double denominator = double(prev_denominator) * step.rescale + weight_sum;
    ExpectWithin(step.denominator, denominator, sum_tolerance * denominator, "denominator", tile,
                 0);
    for (int64_t c = 0; c < s.value_dim; ++c) {
      double acc = double(prev_acc[c]) * step.rescale;
      double magnitude = std::abs(acc);
      for (int64_t j = 0; j < n; ++j) {
        const double term = double(step.weights[j]) * v[(step.key_begin + j) * s.value_dim + c];
        acc += term;
        magnitude += std::abs(term);
      }
      ExpectWithin(step.accumulator[c], acc, sum_tolerance * magnitude + 1e-30, "accumulator", tile,
                   c);
      const double estimate = double(step.accumulator[c]) / double(step.denominator);
      ExpectWithin(step.estimate[c], estimate, kEps * std::abs(estimate), "estimate", tile, c);
    }

    prev_max = step.max_after;
    prev_denominator = step.denominator;
    prev_acc = step.accumulator;
  }

  ASSERT_TRUE(std::holds_alternative<TraceRowDone>(items.back()));
  const TraceRowDone& done = std::get<TraceRowDone>(items.back());
  EXPECT_EQ(done.row.batch, ref.batch);
  EXPECT_EQ(done.row.head, ref.head);
  EXPECT_EQ(done.row.row, ref.row);
  ASSERT_EQ(static_cast<int64_t>(done.output.size()), s.value_dim);
  ASSERT_EQ(static_cast<int64_t>(done.reference.size()), s.value_dim);

  // The output is the last estimate, bit for bit.
  if (expected_tiles > 0) {
    const TraceStep& last = std::get<TraceStep>(items[expected_tiles - 1]);
    EXPECT_EQ(std::memcmp(done.output.data(), last.estimate.data(), s.value_dim * sizeof(float)), 0)
        << "RowDone.output differs from the last estimate";
  }
  const int64_t lse_offset = (ref.batch * s.heads + ref.head) * s.query_len + ref.row;
  const double reference_lse = reference.lse[lse_offset];
  if (std::isinf(reference_lse)) {
    EXPECT_EQ(done.lse, -INFINITY);
  } else {
    EXPECT_NEAR(done.lse, reference_lse, 1e-5 * std::max(1.0, std::abs(reference_lse)));
  }

  // Output and the full-matrix reference row are both fp32 computations on the (rounded)
  // inputs, whatever their dtype: within 1e-5 of float64. The reported error is exactly the
  // distance between the two fp32 rows.
  const int64_t out_offset =
      ((ref.batch * s.heads + ref.head) * s.query_len + ref.row) * s.value_dim;
  double reference_magnitude = 1;
  for (int64_t c = 0; c < s.value_dim; ++c) {
    reference_magnitude = std::max(reference_magnitude, std::abs(reference.output[out_offset + c]));
  }
  float max_abs_error = 0;
  for (int64_t c = 0; c < s.value_dim; ++c) {
    EXPECT_NEAR(done.reference[c], reference.output[out_offset + c], 1e-5 * reference_magnitude)
        << "reference c=" << c;
    EXPECT_NEAR(done.output[c], reference.output[out_offset + c], 1e-5 * reference_magnitude)
        << "output c=" << c;
    max_abs_error = std::max(max_abs_error, std::abs(done.output[c] - done.reference[c]));
  }
  EXPECT_EQ(done.max_abs_error, max_abs_error);

  if (expected_tiles == 0) {  // The row sees no key.
    for (int64_t c = 0; c < s.value_dim; ++c) {
      EXPECT_EQ(done.output[c], 0.f);
      EXPECT_EQ(done.reference[c], 0.f);
    }
    EXPECT_EQ(done.lse, -INFINITY);
    EXPECT_EQ(done.max_abs_error, 0.f);
  }
}

// Traces `rows` of `host` on the device (with `block_k` passed to the kernel as is) and checks
// every row; the CPU trace of the same rows must have the same events (rows, tiles, key ranges,
// masked scores).
void CheckTrace(Backend& backend, const HostProblem& host, int block_k,
                const std::vector<RowRef>& rows) {
  SCOPED_TRACE(::testing::Message() << "block_k=" << block_k);
  Problem problem = host.View();
  problem.block_k = block_k;
  const std::vector<TraceItem> items = CollectTrace(backend, problem, rows);
  const Reference reference = ReferenceAttention(host);

  size_t begin = 0;
  size_t row_index = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!std::holds_alternative<TraceRowDone>(items[i])) continue;
    ASSERT_LT(row_index, rows.size()) << "more rows than requested";
    const std::vector<TraceItem> row_items(items.begin() + begin, items.begin() + i + 1);
    CheckTraceRow(host, problem, rows[row_index], row_items, reference);
    begin = i + 1;
    ++row_index;
  }
  EXPECT_EQ(row_index, rows.size());
  EXPECT_EQ(begin, items.size()) << "steps after the last RowDone";
}

// ---------------------------------------------------------------------------------------------
// The seed's 8×4 example.

class CudaSeedExampleTest : public CudaTest {};

constexpr float kSeedRow0[] = {-0.593223f, 0.406777f, -1.332858f, -0.371937f};

TEST_F(CudaSeedExampleTest, FirstRowMatchesExplainerForEveryKernelAndBlockK) {
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1.f, block_k);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(gpu(), kernel, host);
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kSeedRow0[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ReferenceAttention(host), 1e-5);
    }
  }
}

// Keys 0 and 7 of the example are identical, so row 0 gives them the same score and weight
// (read from a one-tile trace, which records both).
TEST_F(CudaSeedExampleTest, TiedKeysShareTheWeight) {
  const HostProblem host = SeedExample(1.f, 8);
  const std::vector<TraceItem> items = CollectTrace(gpu(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 2u);
  const TraceStep& step = std::get<TraceStep>(items[0]);
  ASSERT_EQ(step.scores.size(), 8u);
  EXPECT_EQ(step.scores[0], 2.f);
  EXPECT_EQ(step.scores[7], 2.f);
  EXPECT_EQ(step.weights[0], step.weights[7]);
  EXPECT_NEAR(step.weights[0] / step.denominator, 0.304404, 1e-6);
  double sum = 0;
  for (float w : step.weights) sum += w / step.denominator;
  EXPECT_NEAR(sum, 1.0, 1e-6);
  const Reference ref = ReferenceAttention(host);
  EXPECT_NEAR(std::get<TraceRowDone>(items[1]).lse, ref.lse[0], 1e-6);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    EXPECT_NEAR(RunKernel(gpu(), kernel, host).lse[0], ref.lse[0], 1e-6);
  }
}

// Multiplying the queries by 1000 makes scores in the thousands: exp would overflow without the
// running max. Keys 0 and 7 still tie and now take (almost) all the weight, so row 0 is the
// mean of value rows 0 and 7: [-0.5, 0.5, -3, -2].
TEST_F(CudaSeedExampleTest, HugeScoresStayFiniteAndTied) {
  constexpr float kExpected[] = {-0.5f, 0.5f, -3.f, -2.f};
  for (int block_k : {1, 2, 3, 4, 8}) {
    const HostProblem host = SeedExample(1000.f, block_k);
    const Reference ref = ReferenceAttention(host);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " block_k=" << block_k);
      const KernelRun run = RunKernel(gpu(), kernel, host);
      for (float x : run.output) ASSERT_TRUE(std::isfinite(x));
      for (float x : run.lse) ASSERT_TRUE(std::isfinite(x));
      for (int c = 0; c < 4; ++c) EXPECT_NEAR(run.output[c], kExpected[c], 1e-6) << "c=" << c;
      ExpectMatchesReference(run, ref, 1e-5);
    }
  }

  const HostProblem host = SeedExample(1000.f, 8);
  const std::vector<TraceItem> items = CollectTrace(gpu(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 2u);
  const TraceStep& step = std::get<TraceStep>(items[0]);
  for (float w : step.weights) ASSERT_TRUE(std::isfinite(w));
  EXPECT_EQ(step.weights[0], step.weights[7]);
  EXPECT_NEAR(step.weights[0] / step.denominator, 0.5, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Random fp32 problems against the float64 reference.

struct RandomCase {
  std::string name;
  Shape shape;
  bool causal = false;
  int block_k = 16;          // Passed to the kernels as is: Tiled's row kernel unless it is 32.
  int64_t key_position = 0;  // Positions (kernels/geometry.h); query_position −1 = unset.
  int64_t query_position = -1;
  int64_t window_left = -1;  // AttentionOptions.window_left/right; −1 = unbounded.
  int64_t window_right = -1;
  float softcap = 0.f;     // AttentionOptions.softcap (the queries × 32 when set, past the cap).
  float alibi_base = 0.f;  // ALiBi: head h's slope alibi_base^(h + 1); 0 = none.
  // A ragged batch (cu_seqlens): its sequences' query and key lengths, summing to the shape's
  // query_len and key_len (batch 1); empty = one sequence.
  std::vector<int64_t> query_lengths = {}, key_lengths = {};
};

// ALiBi slopes base^(h + 1) for the problem's heads (none for base 0).
void SetAlibi(HostProblem& host, float base) {
  float slope = 1.f;
  for (int64_t h = 0; base > 0 && h < host.shape.heads; ++h) {
    host.alibi_slopes.push_back(slope *= base);
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

void PrintTo(const RandomCase& c, std::ostream* os) { *os << c.name; }

// A case as a ragged batch of these query and key lengths.
template <class Case>
Case Ragged(Case c, std::vector<int64_t> query_lengths, std::vector<int64_t> key_lengths) {
  c.query_lengths = std::move(query_lengths);
  c.key_lengths = std::move(key_lengths);
  return c;
}

class CudaRandomFp32Test : public CudaFixture<::testing::TestWithParam<RandomCase>> {};

TEST_P(CudaRandomFp32Test, NaiveAndTiledMatchFloat64Reference) {
  const RandomCase& c = GetParam();
  const uint64_t seed = std::hash<std::string>{}("cuda fp32 " + c.name);
  HostProblem host = RandomProblem(c.shape, DType::kFloat32, c.causal, c.block_k, seed);
  host.key_position = c.key_position;
  if (c.query_position >= 0) host.query_position = c.query_position;
  if (c.window_left >= 0) host.window_left = c.window_left;
  if (c.window_right >= 0) host.window_right = c.window_right;
  SetAlibi(host, c.alibi_base);
  ASSERT_NO_FATAL_FAILURE(SetSequences(host, c.query_lengths, c.key_lengths));
  if (c.softcap > 0) {
    host.softcap = c.softcap;
    for (size_t i = 0; i < host.query.size(); ++i) {
      host.query[i] *= 32.f;  // Exact: a power of two.
      StoreElement(host.query_bytes.data(), host.dtype, static_cast<int64_t>(i), host.query[i]);
    }
  }
  Problem problem = host.View();
  problem.block_k = c.block_k;
  const Reference ref = ReferenceAttention(host);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun run = RunKernel(gpu(), kernel, host, problem);
    ExpectMatchesReference(run, ref, 1e-5);
    if (kernel == Kernel::kTiled) {
      EXPECT_EQ(run.stats.block_k, c.block_k);
    }
    if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(run, host);
  }
  // Tiled again at the fused kernels' own tiles (the backend's default block_k).
  problem.block_k = gpu().default_block_k();
  const KernelRun fused = RunKernel(gpu(), Kernel::kTiled, host, problem);
  ExpectMatchesReference(fused, ref, 1e-5);
  EXPECT_EQ(fused.stats.block_k, problem.block_k);
  if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(fused, host);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRandomFp32Test,
    ::testing::Values(
        // The CPU suite's cases.
        RandomCase{"FewerQueriesThanKeys", MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
        RandomCase{"MoreQueriesThanKeys", MakeShape(1, 2, 2, 61, 29, 15, 15), false, 7},
        RandomCase{"BlockK1", MakeShape(1, 1, 1, 13, 19, 9, 9), false, 1},
        RandomCase{"BlockK7", MakeShape(1, 3, 3, 41, 47, 11, 11), false, 7},
        RandomCase{"BlockK64", MakeShape(1, 2, 2, 71, 150, 13, 13), false, 64},
        RandomCase{"BlockKLargerThanKeys", MakeShape(1, 2, 2, 23, 29, 7, 7), false, 100},
        RandomCase{"HeadDim1", MakeShape(1, 2, 2, 31, 27, 1, 5), false, 8},
        RandomCase{"HeadDim33", MakeShape(1, 2, 2, 29, 35, 33, 33), false, 16},
        RandomCase{"ValueDimDiffers", MakeShape(1, 2, 2, 29, 35, 33, 20), false, 16},
        RandomCase{"Gqa6Over2", MakeShape(1, 6, 2, 19, 23, 9, 11), false, 5},
        RandomCase{"Gqa6Over3", MakeShape(1, 6, 3, 19, 23, 9, 7), false, 5},
        RandomCase{"Gqa4Over1", MakeShape(1, 4, 1, 19, 23, 9, 9), false, 5},
        RandomCase{"Batch2", MakeShape(2, 3, 3, 67, 43, 10, 12), false, 16},
        RandomCase{"CausalSquare", MakeShape(1, 2, 2, 45, 45, 8, 8), true, 7},
        RandomCase{"CausalFewerQueries", MakeShape(1, 2, 2, 37, 53, 17, 17), true, 16},
        RandomCase{"CausalMoreQueries", MakeShape(1, 2, 2, 61, 29, 15, 15), true, 7},
        RandomCase{"CausalMoreQueriesBlockK1", MakeShape(1, 1, 1, 20, 9, 3, 4), true, 1},
        RandomCase{"CausalGqaBatch2", MakeShape(2, 6, 2, 70, 83, 12, 9), true, 16},
        RandomCase{"CausalBlockKLargerThanKeys", MakeShape(1, 2, 1, 33, 21, 6, 6), true, 64},
        RandomCase{"LongRows", MakeShape(1, 1, 1, 131, 293, 24, 16), false, 64},
        // The device's padded head sizes (32, 64, 128, 256) and tiles (16 rows, 32 keys).
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
        RandomCase{"PositionsQueriesMidSequence", MakeShape(1, 6, 2, 45, 130, 64, 64), true, 32, 0,
                   60},
        RandomCase{"PositionsMovedKeys", MakeShape(2, 2, 1, 70, 53, 32, 24), true, 16, 1000},
        // Sliding windows (the fused kernels skip the tiles a window hides on both sides of a
        // 64-row block) and softcaps past the scores, alone and together.
        RandomCase{"WindowCausalLeft", MakeShape(1, 2, 1, 203, 203, 64, 64), true, 16, 0, -1, 40},
        RandomCase{"WindowTwoSided", MakeShape(1, 2, 2, 97, 131, 32, 32), false, 7, 0, -1, 9, 5},
        RandomCase{"WindowCausalLeftZero", MakeShape(1, 2, 2, 45, 45, 17, 17), true, 16, 0, -1, 0},
        RandomCase{"Softcap", MakeShape(1, 2, 2, 70, 97, 64, 64), false, 16, 0, -1, -1, -1, 30.f},
        RandomCase{"SoftcapCausalWindow", MakeShape(1, 4, 2, 150, 150, 48, 40), true, 16, 0, -1, 33,
                   -1, 5.f},
        // ALiBi: the fused fp32 kernel (block_k 32) with GQA and causal, the row kernel on a key
        // slice, and all three with a window and a softcap.
        RandomCase{"AlibiCausalGqa", MakeShape(1, 4, 2, 97, 131, 64, 64), true, 32, 0, -1, -1, -1,
                   0.f, 0.5f},
        RandomCase{"AlibiKeySlice", MakeShape(1, 2, 2, 37, 19, 17, 17), false, 5, 23, 16, -1, -1,
                   0.f, 0.7f},
        RandomCase{"AlibiSoftcapWindow", MakeShape(1, 4, 2, 150, 150, 48, 40), true, 32, 0, -1, 33,
                   -1, 5.f, 0.6f},
        // Ragged batches: unequal lengths, a sequence of length 1 and an empty one, sequences
        // that start mid-tile and mid-block (the fused kernels' 64-row blocks span them), with
        // causal, a window and ALiBi.
        Ragged(RandomCase{"RaggedUnequal", MakeShape(1, 4, 2, 46, 41, 19, 23), false, 7},
               {5, 1, 40}, {7, 1, 33}),
        Ragged(RandomCase{"RaggedCausalEmpty", MakeShape(1, 2, 1, 13, 19, 17, 17), true, 16},
               {0, 6, 3, 4}, {5, 0, 8, 6}),
        Ragged(RandomCase{"RaggedFusedCausalAlibi", MakeShape(1, 4, 2, 330, 340, 64, 64), true, 32,
                          0, -1, -1, -1, 0.f, 0.5f},
               {100, 29, 201}, {120, 19, 201}),
        Ragged(RandomCase{"RaggedWindowSoftcap", MakeShape(1, 2, 2, 203, 203, 48, 40), true, 16, 0,
                          -1, 9, -1, 5.f},
               {70, 133}, {70, 133})),
    [](const ::testing::TestParamInfo<RandomCase>& info) { return info.param.name; });

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
};

void PrintTo(const LowPrecisionCase& c, std::ostream* os) { *os << c.name; }

class CudaLowPrecisionTest : public CudaFixture<::testing::TestWithParam<LowPrecisionCase>> {};

// The FlashAttention rule: error against float64 (on the same rounded inputs) at most twice the
// error of an eager same-precision implementation, plus an atol for the two roundings the
// kernels do that the reference does not:
//   - the output store, half an ulp: ≤ u·|out| (u = 2^-11 fp16, 2^-8 bf16), u·max|out| in all;
//   - Tiled's tensor-core P·V, on probabilities rounded to the input dtype:
//     ProbabilityRoundingBound (≤ u·max|v|). Naive multiplies fp32 weights by fp32 values and
//     has only the first.
// Each kernel's error alone is within that atol plus 1e-5 of fp32 arithmetic, however lucky
// the baseline: with |v| < 1 and |out| < 1, at most ≈ 2u (≈ 1e-3 fp16, 8e-3 bf16).
TEST_P(CudaLowPrecisionTest, ErrorWithinTwiceTheSamePrecisionBaseline) {
  const LowPrecisionCase& c = GetParam();
  const uint64_t seed = std::hash<std::string>{}("cuda low precision " + c.name);
  HostProblem host = RandomProblem(c.shape, c.dtype, c.causal, c.block_k, seed);
  if (c.window_left >= 0) host.window_left = c.window_left;
  SetAlibi(host, c.alibi_base);
  ASSERT_NO_FATAL_FAILURE(SetSequences(host, c.query_lengths, c.key_lengths));
  if (c.softcap > 0) {
    host.softcap = c.softcap;
    for (size_t i = 0; i < host.query.size(); ++i) {
      host.query[i] *= 32.f;  // Exact in fp16 and bf16: a power of two.
      StoreElement(host.query_bytes.data(), host.dtype, static_cast<int64_t>(i), host.query[i]);
    }
  }
  ASSERT_EQ(host.output_dtype, c.dtype);
  const Reference ref = ReferenceAttention(host);
  const double baseline_error = MaxAbsError(LowPrecisionBaseline(host, c.dtype), ref.output);
  ASSERT_TRUE(std::isfinite(baseline_error));
  const double store_rounding = UnitRoundoff(c.dtype) * MaxAbs(ref.output);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const double atol =
        store_rounding + (kernel == Kernel::kTiled ? ProbabilityRoundingBound(host) : 0.0) + 1e-5;
    const KernelRun run = RunKernel(gpu(), kernel, host);
    ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 2));
    const double error = MaxAbsError(run.output, ref.output);
    EXPECT_LE(error, 2 * baseline_error + atol)
        << "baseline error " << baseline_error << ", atol " << atol;
    // Accumulation is fp32 and lse is stored as fp32 from fp32 weights, so lse meets the fp32
    // bound.
    ExpectLseMatches(run, ref, 1e-5);
    if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(run, host);
  }
  // Tiled at the tensor-core kernel's own tiles too (above: c.block_k, the row kernel unless
  // it is 32); the row kernel rounds no probability, so one bound serves both.
  Problem fused_problem = host.View();
  fused_problem.block_k = gpu().default_block_k();
  const KernelRun fused = RunKernel(gpu(), Kernel::kTiled, host, fused_problem);
  const double fused_error = MaxAbsError(fused.output, ref.output);
  EXPECT_LE(fused_error,
            2 * baseline_error + store_rounding + ProbabilityRoundingBound(host) + 1e-5)
      << "fused kernel; baseline error " << baseline_error;
  ExpectLseMatches(fused, ref, 1e-5);
  if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(fused, host);
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, CudaLowPrecisionTest,
    ::testing::Values(
        // The CPU suite's cases.
        LowPrecisionCase{"F16", DType::kFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
        LowPrecisionCase{"F16CausalGqa", DType::kFloat16, MakeShape(2, 6, 3, 61, 29, 33, 20), true,
                         7},
        LowPrecisionCase{"Bf16", DType::kBFloat16, MakeShape(1, 2, 2, 37, 53, 17, 17), false, 16},
        LowPrecisionCase{"Bf16CausalGqa", DType::kBFloat16, MakeShape(2, 4, 1, 45, 71, 9, 13), true,
                         3},
        // The tensor-core kernel: 64-row blocks, 64-key tiles (32 for head size 256), every
        // padded head size; a causal case whose first 64-row block sees no key at all.
        LowPrecisionCase{"F16HeadDim32Exact", DType::kFloat16, MakeShape(1, 2, 2, 33, 65, 32, 32),
                         false, 64},
        LowPrecisionCase{"F16HeadDim64Causal", DType::kFloat16, MakeShape(1, 2, 1, 150, 40, 64, 64),
                         true, 64},
        LowPrecisionCase{"Bf16HeadDim100Causal", DType::kBFloat16,
                         MakeShape(1, 3, 1, 90, 130, 100, 72), true, 64},
        LowPrecisionCase{"F16HeadDim256", DType::kFloat16, MakeShape(1, 2, 2, 70, 100, 256, 256),
                         false, 64},
        LowPrecisionCase{"Bf16HeadDim256Causal", DType::kBFloat16,
                         MakeShape(1, 2, 2, 67, 99, 200, 256), true, 64},
        LowPrecisionCase{"Bf16ManyTilesBatch2", DType::kBFloat16,
                         MakeShape(2, 2, 2, 200, 333, 64, 48), false, 64},
        LowPrecisionCase{"F16ValueDimWider", DType::kFloat16, MakeShape(1, 4, 2, 77, 131, 20, 40),
                         true, 64},
        // The tensor-core kernel with a causal window and with a softcap.
        LowPrecisionCase{"Bf16CausalWindow", DType::kBFloat16, MakeShape(1, 2, 2, 200, 200, 64, 64),
                         true, 64, 45},
        LowPrecisionCase{"F16SoftcapWindow", DType::kFloat16, MakeShape(1, 4, 2, 130, 150, 32, 32),
                         true, 64, 60, 10.f},
        // The tensor-core kernel with ALiBi (GQA, causal), and with a window and a softcap.
        LowPrecisionCase{"Bf16AlibiCausalGqa", DType::kBFloat16,
                         MakeShape(1, 4, 2, 200, 200, 64, 64), true, 64, -1, 0.f, 0.5f},
        LowPrecisionCase{"F16AlibiSoftcapWindow", DType::kFloat16,
                         MakeShape(1, 4, 2, 130, 150, 32, 32), true, 64, 60, 10.f, 0.7f},
        // The tensor-core kernel over a ragged batch whose sequences start mid-block and
        // mid-tile, causal with ALiBi.
        Ragged(LowPrecisionCase{"Bf16RaggedCausalAlibi", DType::kBFloat16,
                                MakeShape(1, 4, 2, 231, 260, 64, 64), true, 64, -1, 0.f, 0.5f},
               {1, 100, 130}, {30, 100, 130})),
    [](const ::testing::TestParamInfo<LowPrecisionCase>& info) { return info.param.name; });

class CudaMixedDtypeTest : public CudaTest {};

// Low-precision inputs with an fp32 output: the only rounding left in Naive is the inputs',
// which the reference shares, so the fp32 bound applies. Tiled's fp16/bf16 inputs go to the
// tensor-core kernel, which also rounds its probabilities (ProbabilityRoundingBound); that, and
// nothing else, is added to the fp32 bound for it.
TEST_F(CudaMixedDtypeTest, LowPrecisionInputWithFp32OutputMeetsFp32Bound) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    HostProblem host = RandomProblem(MakeShape(1, 4, 2, 43, 57, 19, 11), dtype, /*causal=*/true, 8,
                                     1077 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    const Reference ref = ReferenceAttention(host);
    const double magnitude = MaxAbs(ref.output);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(dtype));
      const KernelRun run = RunKernel(gpu(), kernel, host);
      ASSERT_EQ(run.output_bytes.size(), static_cast<size_t>(host.View().OutputElements() * 4));
      const double bound =
          1e-5 * magnitude + (kernel == Kernel::kTiled ? ProbabilityRoundingBound(host) : 0.0);
      EXPECT_LE(MaxAbsError(run.output, ref.output), bound) << "max |ref| " << magnitude;
      ExpectLseMatches(run, ref, 1e-5);
    }
  }
}

// An fp32 problem with a bf16/fp16 output: the device computes exactly what it does for an fp32
// output and rounds only the store (to nearest even).
TEST_F(CudaMixedDtypeTest, LowPrecisionOutputOnlyRoundsTheStore) {
  HostProblem host = RandomProblem(MakeShape(1, 3, 3, 29, 41, 13, 9), DType::kFloat32,
                                   /*causal=*/false, 8, 14242);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    host.output_dtype = DType::kFloat32;
    const KernelRun fp32 = RunKernel(gpu(), kernel, host);
    ExpectMatchesReference(fp32, ReferenceAttention(host), 1e-5);
    for (DType output_dtype : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " " << DTypeName(output_dtype));
      host.output_dtype = output_dtype;
      const KernelRun run = RunKernel(gpu(), kernel, host);
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

class CudaStatsTest : public CudaTest {};

TEST_F(CudaStatsTest, NaiveReportsItsMatrices) {
  const Shape shape = MakeShape(2, 3, 1, 37, 53, 9, 7);
  const HostProblem host = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 16, 109);
  const KernelRun run = RunKernel(gpu(), Kernel::kNaive, host);
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

TEST_F(CudaStatsTest, TiledNeverAllocatesTheScoreMatrix) {
  constexpr int64_t n = 1024;
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostProblem host = RandomProblem(MakeShape(1, 1, 1, n, n, 16, 16), dtype, /*causal=*/false, 64,
                                     110 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    const KernelRun run = RunKernel(gpu(), Kernel::kTiled, host);
    EXPECT_EQ(run.stats.intermediate_bytes, 0);
    EXPECT_GT(run.stats.scratch_bytes, 0);
    EXPECT_LT(run.stats.scratch_bytes, 8 * n * n);
    // Inputs, output and lse only: far below one n × n fp32 matrix.
    EXPECT_GT(run.stats.peak_memory_bytes, 0);
    EXPECT_LT(run.stats.peak_memory_bytes, 4 * n * n);
    EXPECT_GT(run.stats.block_k, 0);
    EXPECT_EQ(run.stats.flops, host.View().Flops());
    EXPECT_EQ(run.stats.flops, double(n) * n * 2 * (16 + 16));
    EXPECT_GE(run.stats.compute_ns, 0);
    const Reference ref = ReferenceAttention(host);
    if (dtype == DType::kFloat32) {
      ExpectMatchesReference(run, ref, 1e-5);
    } else {
      EXPECT_LE(MaxAbsError(run.output, ref.output),
                1e-5 * MaxAbs(ref.output) + ProbabilityRoundingBound(host));
      ExpectLseMatches(run, ref, 1e-5);
    }
  }
}

// FLOPs count only unmasked pairs: with Nq = Nk = n the causal mask leaves n(n+1)/2 of them.
TEST_F(CudaStatsTest, CausalCountsOnlyVisiblePairs) {
  const Shape shape = MakeShape(1, 2, 2, 47, 47, 5, 3);
  const HostProblem full = RandomProblem(shape, DType::kFloat32, /*causal=*/false, 8, 111);
  const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 8, 112);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    const KernelRun full_run = RunKernel(gpu(), kernel, full);
    const KernelRun causal_run = RunKernel(gpu(), kernel, causal);
    EXPECT_EQ(full_run.stats.flops, full.View().Flops());
    EXPECT_EQ(causal_run.stats.flops, causal.View().Flops());
    EXPECT_EQ(causal_run.stats.flops, 2.0 * (47 * 48 / 2) * 2 * (5 + 3));
    EXPECT_LT(causal_run.stats.flops, full_run.stats.flops);
    ExpectMatchesReference(causal_run, ReferenceAttention(causal), 1e-5);
  }
}

// ---------------------------------------------------------------------------------------------
// Layout rules checked without Problem's own helpers (which the reference shares).

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

class CudaLayoutTest : public CudaTest {};

// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads). The same
// problem with each key/value head copied out to its query heads must give the same result:
// the same bits from Tiled, whose per-row arithmetic does not depend on the grouping. (Naive's
// cuBLAS products see other shapes — batch·kv_heads GEMMs of group·Nq rows — and may pick other
// algorithms, so it is held to the reference only.)
TEST_F(CudaLayoutTest, GqaHeadReadsItsGroupsKeyValueHead) {
  const Shape shape = MakeShape(2, 6, 2, 19, 23, 9, 11);
  const HostProblem gqa = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 5, 121);
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
    const KernelRun grouped_run = RunKernel(gpu(), kernel, gqa);
    const KernelRun expanded_run = RunKernel(gpu(), kernel, expanded);
    ExpectMatchesReference(grouped_run, ref, 1e-5);
    ExpectMatchesReference(expanded_run, ref, 1e-5);
    if (kernel == Kernel::kTiled) {
      EXPECT_EQ(grouped_run.output_bytes, expanded_run.output_bytes);
    }
  }
}

// Bottom-right causal alignment: query row i of Nq sees keys 0 … i + Nk − Nq, so its output
// is non-causal attention of that one row over that prefix of the keys.
TEST_F(CudaLayoutTest, CausalMaskIsBottomRightAligned) {
  for (const auto& [query_len, key_len] : {std::pair<int64_t, int64_t>{5, 9}, {9, 5}, {7, 7}}) {
    const Shape shape = MakeShape(1, 1, 1, query_len, key_len, 6, 4);
    const HostProblem causal = RandomProblem(shape, DType::kFloat32, /*causal=*/true, 3,
                                             static_cast<uint64_t>(query_len * 1000 + key_len));
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message()
                   << KernelName(kernel) << " Nq=" << query_len << " Nk=" << key_len);
      const KernelRun run = RunKernel(gpu(), kernel, causal);
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
// Limits: Naive's memory budget, the fused kernels' head sizes.

class CudaLimitsTest : public CudaTest {};

TEST_F(CudaLimitsTest, NaiveOverBudgetNamesTiledWhichSucceeds) {
  absl::StatusOr<std::unique_ptr<Backend>> small =
      cuda::MakeCudaBackend(0, /*max_naive_bytes=*/1000);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->max_naive_bytes(), 1000);
  const HostProblem host = RandomProblem(MakeShape(1, 1, 1, 64, 64, 8, 8), DType::kFloat32,
                                         /*causal=*/false, 16, 114);
  PoisonedOutputs outputs(host);
  const absl::StatusOr<Stats> naive = (*small)->Naive(host.View(), outputs.outputs());
  ASSERT_FALSE(naive.ok());
  EXPECT_EQ(naive.status().code(), absl::StatusCode::kResourceExhausted) << naive.status();
  EXPECT_NE(naive.status().message().find("Tiled"), std::string_view::npos) << naive.status();

  const KernelRun tiled = RunKernel(**small, Kernel::kTiled, host);
  ExpectMatchesReference(tiled, ReferenceAttention(host), 1e-5);
  EXPECT_TRUE((*small)->healthy());
}

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
  constexpr int kRepeats = 3;
  std::vector<std::vector<std::string>> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < kRepeats; ++repeat) {
        for (size_t k = 0; k < jobs.size(); ++k) {
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
// Trace.

class CudaTraceTest : public CudaTest {};

TEST_F(CudaTraceTest, ShortLastTileWithGqaAndBatches) {
  // key_len 11 with block_k 3: tiles of 3, 3, 3 and 2 keys.
  const HostProblem host = RandomProblem(MakeShape(2, 6, 2, 13, 11, 7, 5), DType::kFloat32,
                                         /*causal=*/false, 3, 201);
  CheckTrace(gpu(), host, 3, {{0, 0, 0}, {1, 5, 12}, {0, 3, 7}, {1, 2, 4}, {0, 1, 12}});
}

TEST_F(CudaTraceTest, CausalWithMoreQueriesThanKeys) {
  // Nq 17, Nk 11: rows 0..5 see no key (zero steps); row 6 sees key 0 only; row 16 sees all.
  const HostProblem host = RandomProblem(MakeShape(1, 2, 1, 17, 11, 9, 6), DType::kFloat32,
                                         /*causal=*/true, 3, 202);
  CheckTrace(gpu(), host, 3,
             {{0, 0, 0}, {0, 1, 5}, {0, 0, 6}, {0, 1, 8}, {0, 0, 10}, {0, 1, 13}, {0, 0, 16}});
}

TEST_F(CudaTraceTest, CausalWithFewerQueriesThanKeys) {
  // Nq 7, Nk 20, block_k 4: row i sees i + 14 keys, so the last tiles are partly masked or
  // (for row 0, 14 keys: tiles 0..3) skipped entirely.
  const HostProblem host = RandomProblem(MakeShape(1, 4, 1, 7, 20, 5, 8), DType::kFloat32,
                                         /*causal=*/true, 4, 203);
  CheckTrace(gpu(), host, 4, {{0, 0, 0}, {0, 3, 1}, {0, 2, 5}, {0, 1, 6}});
}

TEST_F(CudaTraceTest, BlockKLargerThanKeysAndOddDims) {
  const HostProblem host = RandomProblem(MakeShape(1, 3, 3, 9, 13, 33, 20), DType::kFloat32,
                                         /*causal=*/false, 64, 204);
  CheckTrace(gpu(), host, 64, {{0, 0, 0}, {0, 2, 8}});
  CheckTrace(gpu(), host, 1, {{0, 1, 4}});
}

TEST_F(CudaTraceTest, BlockK7CausalGqaWideRows) {
  // value_dim 72: three columns for some lanes; causal Nq 40 < Nk 75, so the last tile of each
  // row is partly masked.
  const HostProblem host = RandomProblem(MakeShape(2, 4, 2, 40, 75, 70, 72), DType::kFloat32,
                                         /*causal=*/true, 7, 205);
  CheckTrace(gpu(), host, 7, {{0, 0, 0}, {1, 3, 39}, {0, 2, 20}, {1, 1, 11}});
}

TEST_F(CudaTraceTest, TilesWiderThanAWarpAndValueDim256) {
  // Tiles of 64 and of 150 (> key_len) keys: more keys per tile than lanes; value_dim 256, the
  // trace's widest: eight columns per lane.
  const HostProblem host = RandomProblem(MakeShape(1, 2, 1, 5, 100, 48, 256), DType::kFloat32,
                                         /*causal=*/false, 64, 206);
  CheckTrace(gpu(), host, 64, {{0, 0, 0}, {0, 1, 4}});
  CheckTrace(gpu(), host, 150, {{0, 1, 2}});
}

TEST_F(CudaTraceTest, LowPrecisionInputs) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostProblem host = RandomProblem(MakeShape(1, 4, 2, 15, 23, 10, 7), dtype, /*causal=*/true, 5,
                                     207 + static_cast<int>(dtype));
    host.output_dtype = DType::kFloat32;
    CheckTrace(gpu(), host, 5, {{0, 0, 14}, {0, 3, 2}});
  }
}

TEST_F(CudaTraceTest, SeedExampleRowZero) {
  const HostProblem host = SeedExample(1.f, 2);
  CheckTrace(gpu(), host, 2, {{0, 0, 0}});

  const std::vector<TraceItem> items = CollectTrace(gpu(), host.View(), {{0, 0, 0}});
  ASSERT_EQ(items.size(), 5u);
  const TraceStep& last = std::get<TraceStep>(items[3]);
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(last.estimate[c], kSeedRow0[c], 1e-6) << "c=" << c;
  // After the first tile (keys 0 and 1, scores 2 and 1) the estimate is their softmax mix.
  const TraceStep& first = std::get<TraceStep>(items[0]);
  EXPECT_EQ(first.scores, (std::vector<float>{2.f, 1.f}));
  EXPECT_EQ(first.max_after, 2.f);
  const double w1 = std::exp(-1.0) / (1 + std::exp(-1.0));
  EXPECT_NEAR(first.estimate[0], -4 * (1 - w1) - 3 * w1, 1e-6);
}

TEST_F(CudaTraceTest, SeedExampleHugeScores) {
  const HostProblem host = SeedExample(1000.f, 3);
  CheckTrace(gpu(), host, 3, {{0, 0, 0}, {0, 0, 5}});
  const std::vector<TraceItem> items = CollectTrace(gpu(), host.View(), {{0, 0, 0}});
  ASSERT_FALSE(items.empty());
  const TraceRowDone& done = std::get<TraceRowDone>(items.back());
  constexpr float kExpected[] = {-0.5f, 0.5f, -3.f, -2.f};
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(done.output[c], kExpected[c], 1e-6) << "c=" << c;
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
