// The client-side merge of partial attention states (client/merge.h) and the key split that
// feeds it (client/shard.h: SplitKeys, MergeKeySlices), on the CPU backend.
//
// A problem's keys are cut into slices; each slice runs as its own problem (key_position = its
// first key's position, the whole problem's query_position, fp32 output with lse), and the merged
// states must equal the unsplit Tiled answer to fp32 rounding (3e-6 relative; lse 1e-4) and the
// float64 reference (1e-5). Inputs are fresh uniform(-1, 1) values with odd sizes, one seed per
// case; outputs are poisoned with NaN before each kernel runs.
#include "client/merge.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"
#include "client/shard.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/problem.h"
#include "proto/dtype_mapping.h"
#include "proto/tensor_shape.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;
namespace v1 = attention::v1;
using client::AttentionState;

constexpr double kOutputRtol = 3e-6;  // Merged against the unsplit Tiled, fp32.
constexpr double kLseAtol = 1e-4;

// The whole problem's query_position: its own, or the bottom-right default.
int64_t QueryPosition(const HostProblem& p) {
  return p.query_position.value_or(p.key_position + p.shape.key_len - p.shape.query_len);
}

// Keys [begin, end) of `whole` as a problem of their own, as a client sends a slice: the whole
// query, key_position = the slice's first key's position and the whole problem's
// query_position (both shifted up when that is negative: only their difference matters), an fp32
// output with lse.
HostProblem KeySlice(const HostProblem& whole, int64_t begin, int64_t end) {
  HostProblem slice = whole;
  const Shape& s = whole.shape;
  const int64_t n = end - begin;
  slice.shape.key_len = n;
  slice.output_dtype = DType::kFloat32;
  slice.return_lse = true;
  const int64_t shift = std::max<int64_t>(0, -QueryPosition(whole));
  slice.key_position = whole.key_position + begin + shift;
  slice.query_position = QueryPosition(whole) + shift;
  const size_t element = ElementSize(whole.dtype);
  slice.key.clear();
  slice.value.clear();
  slice.key_bytes.clear();
  slice.value_bytes.clear();
  for (int64_t unit = 0; unit < s.batch * s.kv_heads; ++unit) {
    for (const auto& [from, from_bytes, to, to_bytes, width] :
         {std::tuple{&whole.key, &whole.key_bytes, &slice.key, &slice.key_bytes, s.head_dim},
          std::tuple{&whole.value, &whole.value_bytes, &slice.value, &slice.value_bytes,
                     s.value_dim}}) {
      const int64_t first = (unit * s.key_len + begin) * width;
      to->insert(to->end(), from->begin() + first, from->begin() + first + n * width);
      to_bytes->insert(to_bytes->end(), from_bytes->begin() + first * element,
                       from_bytes->begin() + (first + n * width) * element);
    }
  }
  return slice;
}

AttentionState StateOfRun(const KernelRun& run, const Shape& s) {
  AttentionState state;
  state.output.shape = {s.batch, s.heads, s.query_len, s.value_dim};
  state.output.values = run.output;
  state.lse.shape = {s.batch, s.heads, s.query_len};
  state.lse.values = run.lse;
  return state;
}

// Slices [bounds[i], bounds[i + 1]) of `whole`, each run on the CPU backend, merged.
AttentionState SplitAndMerge(CpuBackend& backend, const HostProblem& whole,
                             const std::vector<int64_t>& bounds) {
  std::vector<AttentionState> parts;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const HostProblem slice = KeySlice(whole, bounds[i], bounds[i + 1]);
    parts.push_back(StateOfRun(RunKernel(backend, Kernel::kTiled, slice), whole.shape));
  }
  absl::StatusOr<AttentionState> merged = client::MergeStates(parts);
  EXPECT_TRUE(merged.ok()) << merged.status();
  return merged.ok() ? *std::move(merged) : AttentionState{};
}

// max |a − b| / max |b|; infinity for a NaN or a size mismatch.
double RelativeError(const std::vector<float>& actual, const std::vector<float>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double error = 0, magnitude = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double difference = std::abs(double(actual[i]) - double(expected[i]));
    if (std::isnan(difference)) return std::numeric_limits<double>::infinity();
    error = std::max(error, difference);
    magnitude = std::max(magnitude, std::abs(double(expected[i])));
  }
  return magnitude > 0 ? error / magnitude : error;
}

// lse within kLseAtol, and −inf exactly where the expected row is −inf.
void ExpectLseNear(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  int reported = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const bool ok = std::isinf(expected[i])
                        ? actual[i] == expected[i]
                        : std::abs(double(actual[i]) - double(expected[i])) <= kLseAtol;
    if (!ok && reported++ < 5) {
      ADD_FAILURE() << "lse[" << i << "] = " << actual[i] << ", expected " << expected[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MergeStates on split problems.

struct SplitCase {
  std::string name;
  Shape shape;
  DType dtype = DType::kFloat32;
  bool causal = true;
  std::vector<int64_t> bounds;  // 0 = b₀ < b₁ < … < key_len.
  int64_t key_position = 0;
  std::optional<int64_t> query_position;
  std::optional<int64_t> window_left = std::nullopt, window_right = std::nullopt;
};

void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.name; }

class MergeSplitTest : public ::testing::TestWithParam<SplitCase> {};

TEST_P(MergeSplitTest, MergedSlicesEqualUnsplitTiledAndReference) {
  const SplitCase& c = GetParam();
  HostProblem whole =
      RandomProblem(c.shape, c.dtype, c.causal, 7, std::hash<std::string>{}(c.name));
  whole.output_dtype = DType::kFloat32;
  whole.key_position = c.key_position;
  whole.query_position = c.query_position;
  whole.window_left = c.window_left;
  whole.window_right = c.window_right;
  CpuBackend backend(2, 0);
  const KernelRun unsplit = RunKernel(backend, Kernel::kTiled, whole);
  const AttentionState merged = SplitAndMerge(backend, whole, c.bounds);

  EXPECT_EQ(merged.output.shape, (std::vector<int64_t>{c.shape.batch, c.shape.heads,
                                                       c.shape.query_len, c.shape.value_dim}));
  EXPECT_EQ(merged.lse.shape,
            (std::vector<int64_t>{c.shape.batch, c.shape.heads, c.shape.query_len}));
  const double error = RelativeError(merged.output.values, unsplit.output);
  EXPECT_LE(error, kOutputRtol);
  ExpectLseNear(merged.lse.values, unsplit.lse);
  KernelRun as_run{{}, merged.output.values, merged.lse.values, Stats{}};
  ExpectMatchesReference(as_run, ReferenceAttention(whole), 1e-5);
  std::printf("[ %s ] merged vs unsplit: %.3g relative\n", c.name.c_str(), error);

  // A row that sees no key at all is zeros with lse −inf, from every part.
  const Problem view = whole.View();
  for (int64_t i = 0; i < c.shape.query_len; ++i) {
    if (view.Visible(i).size() > 0) continue;
    for (int64_t bh = 0; bh < c.shape.batch * c.shape.heads; ++bh) {
      const int64_t row = bh * c.shape.query_len + i;
      ASSERT_EQ(merged.lse.values[row], -INFINITY) << "row " << i;
      for (int64_t d = 0; d < c.shape.value_dim; ++d) {
        ASSERT_EQ(merged.output.values[row * c.shape.value_dim + d], 0.f) << "row " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Slices, MergeSplitTest,
    ::testing::Values(SplitCase{"CausalFewerQueriesUnequalSlices",
                                MakeShape(2, 3, 3, 19, 53, 17, 17),
                                DType::kFloat32,
                                true,
                                {0, 11, 30, 53},
                                0,
                                std::nullopt},
                      // Rows 0 … 17 see no key at all; the first slice is seen by rows 18 on only.
                      SplitCase{"CausalMoreQueriesThanKeys",
                                MakeShape(1, 2, 2, 41, 23, 9, 9),
                                DType::kFloat32,
                                true,
                                {0, 7, 23},
                                0,
                                std::nullopt},
                      SplitCase{"GqaWithSliceOfOneKey",
                                MakeShape(1, 6, 2, 29, 37, 11, 11),
                                DType::kFloat32,
                                true,
                                {0, 13, 14, 37},
                                0,
                                std::nullopt},
                      SplitCase{"ValueDimDiffers",
                                MakeShape(1, 2, 2, 17, 31, 13, 7),
                                DType::kFloat32,
                                true,
                                {0, 10, 31},
                                0,
                                std::nullopt},
                      SplitCase{"NonCausal",
                                MakeShape(2, 4, 2, 21, 45, 15, 19),
                                DType::kFloat32,
                                false,
                                {0, 3, 27, 45},
                                0,
                                std::nullopt},
                      SplitCase{"Fp16Inputs",
                                MakeShape(1, 4, 2, 23, 45, 16, 12),
                                DType::kFloat16,
                                true,
                                {0, 20, 45},
                                0,
                                std::nullopt},
                      SplitCase{"Bf16InputsSlicesOfOneKey",
                                MakeShape(2, 2, 1, 31, 47, 8, 8),
                                DType::kBFloat16,
                                true,
                                {0, 1, 2, 30, 47},
                                0,
                                std::nullopt},
                      // Rows 0 … 9 see keys up to 29 at most: the last slice is hidden from them.
                      SplitCase{"SliceSomeRowsCannotSee",
                                MakeShape(1, 2, 2, 20, 40, 9, 9),
                                DType::kFloat32,
                                true,
                                {0, 30, 40},
                                0,
                                std::nullopt},
                      // Query row i is at position 5 + i and sees keys 0 … i: keys 13 … 28 are no
                      // row's, so the last slice is all −inf.
                      SplitCase{"SliceNoRowSees",
                                MakeShape(1, 2, 1, 13, 29, 7, 7),
                                DType::kFloat32,
                                true,
                                {0, 6, 13, 29},
                                5,
                                5},
                      SplitCase{"ExplicitPositions",
                                MakeShape(1, 3, 3, 15, 31, 10, 6),
                                DType::kFloat32,
                                true,
                                {0, 9, 20, 31},
                                100,
                                120},
                      SplitCase{"EveryKeyItsOwnSlice",
                                MakeShape(1, 1, 1, 5, 6, 3, 4),
                                DType::kFloat32,
                                true,
                                {0, 1, 2, 3, 4, 5, 6},
                                0,
                                std::nullopt},
                      // A causal left window: the early slices are hidden from the late rows
                      // and the late slices from the early rows.
                      SplitCase{"CausalWindow",
                                MakeShape(1, 4, 2, 47, 47, 12, 12),
                                DType::kFloat32,
                                true,
                                {0, 9, 30, 31, 47},
                                0,
                                std::nullopt,
                                8},
                      // A two-sided window without causal, at explicit positions.
                      SplitCase{"TwoSidedWindow",
                                MakeShape(1, 2, 2, 23, 41, 9, 9),
                                DType::kBFloat16,
                                false,
                                {0, 14, 27, 41},
                                50,
                                55,
                                5,
                                3}));

// ---------------------------------------------------------------------------------------------
// MergeStates' rule on states written by hand.

AttentionState State(std::vector<int64_t> rows_shape, int64_t width, std::vector<float> output,
                     std::vector<float> lse) {
  AttentionState state;
  state.output.shape = rows_shape;
  state.output.shape.push_back(width);
  state.output.values = std::move(output);
  state.lse.shape = std::move(rows_shape);
  state.lse.values = std::move(lse);
  return state;
}

TEST(MergeStatesTest, OnePartComesBackUnchanged) {
  const AttentionState part = State({2}, 3, {0.5f, -1.25f, 3.f, 7.f, 0.f, -2.f}, {1.5f, -0.75f});
  absl::StatusOr<AttentionState> merged = client::MergeStates({part});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output.values, part.output.values);
  EXPECT_EQ(merged->lse.values, part.lse.values);
}

TEST(MergeStatesTest, WeighsPartsByTheirSums) {
  // Σ exp over part 0's keys is 2, over part 1's 6: weights 1/4 and 3/4, lse log 8.
  absl::StatusOr<AttentionState> merged = client::MergeStates(
      {State({1}, 2, {1.f, -4.f}, {std::log(2.f)}), State({1}, 2, {5.f, 8.f}, {std::log(6.f)})});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_NEAR(merged->output.values[0], 0.25 * 1 + 0.75 * 5, 1e-6);
  EXPECT_NEAR(merged->output.values[1], 0.25 * -4 + 0.75 * 8, 1e-6);
  EXPECT_NEAR(merged->lse.values[0], std::log(8.0), 1e-6);
}

TEST(MergeStatesTest, FarApartSumsNeitherOverflowNorUnderflowToNaN) {
  absl::StatusOr<AttentionState> merged =
      client::MergeStates({State({1}, 1, {2.f}, {1000.f}), State({1}, 1, {-3.f}, {-1000.f})});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output.values[0], 2.f);
  EXPECT_EQ(merged->lse.values[0], 1000.f);
}

TEST(MergeStatesTest, PartsThatSawNoKeyAddNothing) {
  // Row 0: only part 1 saw keys (part 0's output there is NaN and must not leak). Row 1: no
  // part saw any key.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  absl::StatusOr<AttentionState> merged =
      client::MergeStates({State({2}, 2, {nan, nan, nan, 9.f}, {-INFINITY, -INFINITY}),
                           State({2}, 2, {0.5f, -0.5f, 4.f, nan}, {0.25f, -INFINITY}),
                           State({2}, 2, {0.f, 0.f, 0.f, 0.f}, {-INFINITY, -INFINITY})});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output.values, (std::vector<float>{0.5f, -0.5f, 0.f, 0.f}));
  EXPECT_EQ(merged->lse.values[0], 0.25f);
  EXPECT_EQ(merged->lse.values[1], -INFINITY);
}

TEST(MergeStatesTest, RefusesNoPartsAndDisagreeingShapes) {
  const AttentionState good = State({2, 3}, 4, std::vector<float>(24, 1.f), std::vector<float>(6));
  EXPECT_TRUE(client::MergeStates({good, good}).ok());
  EXPECT_EQ(client::MergeStates({}).status().code(), absl::StatusCode::kInvalidArgument);

  AttentionState wider = State({2, 3}, 5, std::vector<float>(30, 1.f), std::vector<float>(6));
  AttentionState more_rows = State({3, 3}, 4, std::vector<float>(36, 1.f), std::vector<float>(9));
  AttentionState short_values = good;
  short_values.output.values.pop_back();
  AttentionState wrong_lse = good;
  wrong_lse.lse.shape = {6};
  AttentionState short_lse = good;
  short_lse.lse.values.pop_back();
  AttentionState no_shape;
  for (const auto& [name, bad] :
       {std::pair{"value width", &wider}, std::pair{"rows", &more_rows},
        std::pair{"output values", &short_values}, std::pair{"lse shape", &wrong_lse},
        std::pair{"lse values", &short_lse}, std::pair{"no shape", &no_shape}}) {
    SCOPED_TRACE(name);
    const absl::Status status = client::MergeStates({good, *bad}).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("parts[1]"), absl::string_view::npos) << status;
  }
}

TEST(StateOfTest, DecodesAResponseWithLseAndRefusesOneWithout) {
  const AttentionState state = State({1, 2}, 3, {1, 2, 3, 4, 5, 6}, {0.5f, -INFINITY});
  v1::AttentionResponse response;
  *response.mutable_output() = client::ToTensor(state.output);
  *response.mutable_lse() = client::ToTensor(state.lse);
  absl::StatusOr<AttentionState> decoded = client::StateOf(response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->output.shape, state.output.shape);
  EXPECT_EQ(decoded->output.values, state.output.values);
  EXPECT_EQ(decoded->lse.values, state.lse.values);

  response.clear_lse();
  const absl::Status missing = client::StateOf(response).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("return_lse"), absl::string_view::npos) << missing;

  *response.mutable_lse() = client::ToTensor(State({2}, 3, {}, {0.f, 0.f}).lse);  // [2], not [1, 2]
  EXPECT_EQ(client::StateOf(response).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// SplitKeys: where the boundaries go, what each slice carries.

// An inline request of random values: query [.., heads, query_len, head_dim] and key/value
// [.., kv_heads, key_len, ·] of rank `rank` (leading dimensions 1 dropped).
v1::AttentionRequest RandomRequest(int rank, int64_t batch, int64_t heads, int64_t kv_heads,
                                   int64_t query_len, int64_t key_len, int64_t head_dim,
                                   int64_t value_dim, v1::DType dtype, uint64_t seed) {
  const HostProblem host =
      RandomProblem(MakeShape(batch, heads, kv_heads, query_len, key_len, head_dim, value_dim),
                    FromProtoDType(dtype).value(), false, 16, seed);
  const auto shape = [&](int64_t b, int64_t h, int64_t len, int64_t dim) {
    std::vector<int64_t> full{b, h, len, dim};
    return std::vector<int64_t>(full.end() - rank, full.end());
  };
  v1::AttentionRequest request;
  *request.mutable_query() =
      client::ToTensor({shape(batch, heads, query_len, head_dim), host.query}, dtype);
  *request.mutable_key() =
      client::ToTensor({shape(batch, kv_heads, key_len, head_dim), host.key}, dtype);
  *request.mutable_value() =
      client::ToTensor({shape(batch, kv_heads, key_len, value_dim), host.value}, dtype);
  return request;
}

// Visible (query row, key) pairs of one (batch, head) among keys [begin, end), by the contract's
// rule: the query at position p sees the key at position t iff t ≤ p when causal, and
// p − window_left ≤ t ≤ p + window_right for the sides set.
int64_t VisiblePairs(const v1::AttentionRequest& request, int64_t begin, int64_t end) {
  const TensorDims query = *NormalizedShape(request.query());
  const TensorDims key = *NormalizedShape(request.key());
  const v1::AttentionOptions& options = request.options();
  const int64_t query_position = options.has_query_position()
                                     ? options.query_position()
                                     : options.key_position() + key.len - query.len;
  int64_t pairs = 0;
  for (int64_t i = 0; i < query.len; ++i) {
    const int64_t p = query_position + i;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = options.key_position() + j;
      pairs += (!options.causal() || t <= p) &&
               (!options.has_window_left() || t >= p - options.window_left()) &&
               (!options.has_window_right() || t <= p + options.window_right());
    }
  }
  return pairs;
}

// The slices tile keys [first, covered) in order, each a key slice of all units asking for lse
// in fp32 with the whole problem's positions and window; returns `covered`.
int64_t ExpectSlicesTile(const v1::AttentionRequest& request,
                         const std::vector<client::ShardPart>& parts, int64_t first = 0) {
  const TensorDims query = *NormalizedShape(request.query());
  const TensorDims key = *NormalizedShape(request.key());
  const v1::AttentionOptions& options = request.options();
  const int64_t query_position = options.has_query_position()
                                     ? options.query_position()
                                     : options.key_position() + key.len - query.len;
  const int64_t shift = std::max<int64_t>(0, -query_position);
  int64_t next = first;
  for (const client::ShardPart& part : parts) {
    EXPECT_TRUE(part.key_slice);
    EXPECT_EQ(part.key_begin, next);
    EXPECT_LT(part.key_begin, part.key_end);
    EXPECT_EQ(part.first_unit, 0);
    EXPECT_EQ(part.units, key.batch * key.heads);
    next = part.key_end;
    const v1::AttentionOptions& sent = part.request.options();
    EXPECT_TRUE(sent.return_lse());
    EXPECT_EQ(sent.output_dtype(), v1::DTYPE_FLOAT32);
    EXPECT_EQ(sent.causal(), options.causal());
    EXPECT_EQ(sent.has_window_left(), options.has_window_left());
    EXPECT_EQ(sent.window_left(), options.window_left());
    EXPECT_EQ(sent.has_window_right(), options.has_window_right());
    EXPECT_EQ(sent.window_right(), options.window_right());
    EXPECT_EQ(sent.key_position(), options.key_position() + part.key_begin + shift);
    EXPECT_TRUE(sent.has_query_position());
    EXPECT_EQ(sent.query_position(), query_position + shift);
    EXPECT_GE(sent.query_position(), 0);
    EXPECT_EQ(part.request.query().data(), request.query().data());
    EXPECT_EQ(part.request.query().shape_size(), request.query().shape_size());
    const TensorDims sent_key = *NormalizedShape(part.request.key());
    EXPECT_EQ(sent_key.len, part.key_end - part.key_begin);
    EXPECT_EQ(part.request.key().shape_size(), request.key().shape_size());
  }
  return next;
}

TEST(SplitKeysTest, NonCausalSlicesHoldEqualKeyCounts) {
  for (int rank : {2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    v1::AttentionRequest request =
        RandomRequest(rank, rank == 4 ? 2 : 1, rank >= 3 ? 6 : 1, rank >= 3 ? 3 : 1, 9, 31, 5, 7,
                      v1::DTYPE_FLOAT32, 11 + rank);
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, 3);
    ASSERT_EQ(parts.size(), 3u);
    EXPECT_EQ(ExpectSlicesTile(request, parts), 31);
    for (const client::ShardPart& part : parts) {
      EXPECT_GE(part.key_end - part.key_begin, 10);
      EXPECT_LE(part.key_end - part.key_begin, 11);
    }
  }
}

TEST(SplitKeysTest, CausalSlicesHoldAboutEqualVisibleWork) {
  struct Case {
    int64_t query_len, key_len, key_position;
    std::optional<int64_t> query_position;
    int parts;
  };
  for (const Case& c :
       {Case{301, 301, 0, std::nullopt, 3}, Case{97, 500, 0, std::nullopt, 4},
        Case{64, 211, 40, std::nullopt, 5}, Case{150, 150, 7, 7, 3}, Case{37, 90, 0, 20, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.query_len << " queries, " << c.key_len << " keys, " << c.parts << " parts");
    v1::AttentionRequest request =
        RandomRequest(3, 1, 2, 1, c.query_len, c.key_len, 3, 3, v1::DTYPE_FLOAT32, 5);
    request.mutable_options()->set_causal(true);
    request.mutable_options()->set_key_position(c.key_position);
    if (c.query_position) request.mutable_options()->set_query_position(*c.query_position);
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, c.parts);
    ASSERT_EQ(parts.size(), static_cast<size_t>(c.parts));
    const int64_t covered = ExpectSlicesTile(request, parts);
    // Every key a row sees is sent; the keys past them (no row's) are not.
    EXPECT_EQ(VisiblePairs(request, 0, covered), VisiblePairs(request, 0, c.key_len));
    EXPECT_GT(VisiblePairs(request, covered - 1, covered), 0);
    // Each slice within one key column's pairs (≤ query_len) of an equal share.
    const double share = static_cast<double>(VisiblePairs(request, 0, c.key_len)) / c.parts;
    for (const client::ShardPart& part : parts) {
      const int64_t pairs = VisiblePairs(request, part.key_begin, part.key_end);
      EXPECT_NEAR(pairs, share, c.query_len + 1)
          << "keys [" << part.key_begin << ", " << part.key_end << ")";
    }
    // Bottom-right causal: the early keys are everyone's, so the first slice is the narrowest.
    if (!c.query_position && c.query_len == c.key_len) {
      EXPECT_LT(parts.front().key_end - parts.front().key_begin,
                parts.back().key_end - parts.back().key_begin);
    }
  }
}

// With a window, the slices cover the keys some row sees — from the first row's first key to the
// last row's last — in about equal visible work.
TEST(SplitKeysTest, WindowedSlicesHoldAboutEqualVisibleWork) {
  struct Case {
    int64_t query_len, key_len;
    bool causal;
    std::optional<int64_t> left, right;
    int parts;
  };
  for (const Case& c :
       {Case{301, 301, true, 40, std::nullopt, 3}, Case{64, 500, true, 100, std::nullopt, 4},
        Case{90, 90, false, 10, 20, 5}, Case{50, 200, false, std::nullopt, 0, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.query_len << " queries, " << c.key_len << " keys, " << c.parts << " parts");
    v1::AttentionRequest request =
        RandomRequest(3, 1, 2, 1, c.query_len, c.key_len, 3, 3, v1::DTYPE_FLOAT32, 7);
    request.mutable_options()->set_causal(c.causal);
    if (c.left) request.mutable_options()->set_window_left(*c.left);
    if (c.right) request.mutable_options()->set_window_right(*c.right);
    // The first key some row sees, by the contract's rule.
    int64_t first = 0;
    while (VisiblePairs(request, first, first + 1) == 0) ++first;
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, c.parts);
    ASSERT_EQ(parts.size(), static_cast<size_t>(c.parts));
    const int64_t covered = ExpectSlicesTile(request, parts, first);
    EXPECT_EQ(VisiblePairs(request, first, covered), VisiblePairs(request, 0, c.key_len));
    EXPECT_GT(VisiblePairs(request, covered - 1, covered), 0);
    const double share = static_cast<double>(VisiblePairs(request, 0, c.key_len)) / c.parts;
    for (const client::ShardPart& part : parts) {
      EXPECT_NEAR(VisiblePairs(request, part.key_begin, part.key_end), share, c.query_len + 1)
          << "keys [" << part.key_begin << ", " << part.key_end << ")";
    }
  }
}

TEST(SplitKeysTest, MoreQueryRowsThanKeysShiftsBothPositions) {
  // The default query_position is 10 − 25 = −15: the slices get query_position 0 and keys at
  // 15 + begin, the same differences.
  v1::AttentionRequest request = RandomRequest(3, 1, 2, 2, 25, 10, 4, 4, v1::DTYPE_FLOAT32, 3);
  request.mutable_options()->set_causal(true);
  const std::vector<client::ShardPart> parts = client::SplitKeys(request, 2);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(ExpectSlicesTile(request, parts), 10);
  EXPECT_EQ(parts[0].request.options().query_position(), 0);
  EXPECT_EQ(parts[0].request.options().key_position(), 15);
  EXPECT_EQ(parts[1].request.options().key_position(), 15 + parts[1].key_begin);
}

TEST(SplitKeysTest, MoreEndpointsThanKeysGivesOneKeySlices) {
  v1::AttentionRequest request = RandomRequest(2, 1, 1, 1, 3, 2, 4, 4, v1::DTYPE_FLOAT32, 4);
  const std::vector<client::ShardPart> parts = client::SplitKeys(request, 5);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(ExpectSlicesTile(request, parts), 2);
}

TEST(SplitKeysTest, SlicesAreTheRawBytesOfEveryBatchAndKvHead) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const int64_t batch = 2, kv_heads = 3, key_len = 23, head_dim = 5, value_dim = 3;
    v1::AttentionRequest request =
        RandomRequest(4, batch, 6, kv_heads, 7, key_len, head_dim, value_dim, dtype, 8);
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, 3);
    ASSERT_EQ(parts.size(), 3u);
    const size_t element = ElementSize(FromProtoDType(dtype).value());
    for (const bool keys : {true, false}) {
      const v1::Tensor& whole = keys ? request.key() : request.value();
      const int64_t width = keys ? head_dim : value_dim;
      // Each (batch, kv head)'s rows, put back together from the slices in order.
      std::string rebuilt;
      for (int64_t unit = 0; unit < batch * kv_heads; ++unit) {
        for (const client::ShardPart& part : parts) {
          const v1::Tensor& slice = keys ? part.request.key() : part.request.value();
          EXPECT_EQ(slice.dtype(), dtype);
          EXPECT_EQ(slice.shape(0), batch);
          EXPECT_EQ(slice.shape(1), kv_heads);
          EXPECT_EQ(slice.shape(3), width);
          const size_t run = (part.key_end - part.key_begin) * width * element;
          rebuilt += slice.data().substr(unit * run, run);
        }
      }
      EXPECT_EQ(rebuilt, whole.data());
    }
  }
}

TEST(SplitKeysTest, WhatCannotBeSplitGoesWhole) {
  const v1::AttentionRequest good = RandomRequest(3, 1, 2, 2, 8, 9, 4, 4, v1::DTYPE_FLOAT32, 9);
  ASSERT_EQ(client::SplitKeys(good, 3).size(), 3u);

  std::vector<std::pair<std::string, v1::AttentionRequest>> cases;
  cases.emplace_back("one key", RandomRequest(3, 1, 2, 2, 8, 1, 4, 4, v1::DTYPE_FLOAT32, 9));
  cases.emplace_back("key width differs", good);
  cases.back().second.mutable_key()->set_shape(2, 3);
  cases.emplace_back("data too short", good);
  cases.back().second.mutable_value()->mutable_data()->pop_back();
  cases.emplace_back("ranks differ", RandomRequest(4, 1, 2, 2, 8, 9, 4, 4, v1::DTYPE_FLOAT32, 9));
  *cases.back().second.mutable_query() = good.query();
  cases.emplace_back("negative key_position", good);
  cases.back().second.mutable_options()->set_key_position(-1);
  cases.emplace_back("negative query_position", good);
  cases.back().second.mutable_options()->set_query_position(-3);
  cases.emplace_back("no key visible", good);
  cases.back().second.mutable_options()->set_causal(true);
  cases.back().second.mutable_options()->set_key_position(50);
  cases.back().second.mutable_options()->set_query_position(0);
  cases.emplace_back("a cache", client::CacheRequest("0123", good.query()));
  cases.emplace_back("a ragged batch", good);
  for (auto* cu :
       {cases.back().second.mutable_cu_seqlens_q(), cases.back().second.mutable_cu_seqlens_k()}) {
    for (int64_t length : {0, 4, 8}) cu->Add(length);
  }
  for (const auto& [name, request] : cases) {
    SCOPED_TRACE(name);
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, 3);
    ASSERT_EQ(parts.size(), 1u);
    EXPECT_FALSE(parts[0].key_slice);
    EXPECT_EQ(parts[0].request.SerializeAsString(), request.SerializeAsString());
  }
  const std::vector<client::ShardPart> one = client::SplitKeys(good, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_FALSE(one[0].key_slice);
}

// ---------------------------------------------------------------------------------------------
// SplitKeys → each slice computed as a server would → MergeKeySlices, against the unsplit answer.

// The problem a request describes, as the server reads it (scale, causal, positions, dtypes).
HostProblem FromRequest(const v1::AttentionRequest& request) {
  const TensorDims q = *NormalizedShape(request.query());
  const TensorDims k = *NormalizedShape(request.key());
  const TensorDims v = *NormalizedShape(request.value());
  HostProblem p;
  p.shape = MakeShape(q.batch, q.heads, k.heads, q.len, k.len, q.dim, v.dim);
  p.dtype = FromProtoDType(request.query().dtype()).value();
  const v1::AttentionOptions& options = request.options();
  p.output_dtype = FromProtoDType(options.output_dtype()).value_or(p.dtype);
  p.scale = options.has_scale() ? options.scale() : 1.f / std::sqrt(static_cast<float>(q.dim));
  p.causal = options.causal();
  p.key_position = options.key_position();
  if (options.has_query_position()) p.query_position = options.query_position();
  if (options.has_window_left()) p.window_left = options.window_left();
  if (options.has_window_right()) p.window_right = options.window_right();
  p.softcap = options.softcap();
  p.alibi_slopes.assign(options.alibi_slopes().begin(), options.alibi_slopes().end());
  p.sinks.assign(options.sinks().begin(), options.sinks().end());
  p.block_k = 16;
  p.return_lse = true;
  for (const auto& [tensor, bytes, values] :
       {std::tuple{&request.query(), &p.query_bytes, &p.query},
        std::tuple{&request.key(), &p.key_bytes, &p.key},
        std::tuple{&request.value(), &p.value_bytes, &p.value}}) {
    bytes->assign(tensor->data().begin(), tensor->data().end());
    *values = client::FromTensor(*tensor).value().values;
  }
  return p;
}

v1::AttentionResponse Answer(CpuBackend& backend, const v1::AttentionRequest& request) {
  const HostProblem problem = FromRequest(request);
  const KernelRun run = RunKernel(backend, Kernel::kTiled, problem);
  std::vector<int64_t> shape(request.query().shape().begin(), request.query().shape().end());
  v1::AttentionResponse response;
  response.mutable_output()->mutable_shape()->Assign(shape.begin(), shape.end() - 1);
  response.mutable_output()->add_shape(problem.shape.value_dim);
  response.mutable_output()->set_dtype(ToProtoDType(problem.output_dtype));
  response.mutable_output()->set_data(
      std::string(run.output_bytes.begin(), run.output_bytes.end()));
  if (request.options().return_lse()) {
    *response.mutable_lse() = client::ToTensor(
        client::Array{std::vector<int64_t>(shape.begin(), shape.end() - 1), run.lse});
  }
  response.mutable_stats()->set_flops(run.stats.flops);
  response.mutable_stats()->set_compute_ns(1000);
  return response;
}

TEST(MergeKeySlicesTest, SlicedAnswerEqualsTheWholeInTheRequestsDtype) {
  struct Case {
    std::string name;
    int rank;
    int64_t heads, kv_heads, query_len, key_len, value_dim;
    v1::DType dtype, output_dtype;
    bool return_lse;
    std::optional<int64_t> query_position;
    bool alibi = false;  // Slopes 2^−(h+1): each slice biases its keys by their own positions.
    bool sinks = false;  // Sinks 0.7·h − 1: only the first slice may carry them.
  };
  CpuBackend backend(2, 0);
  for (const Case& c :
       {Case{"f32 rank 4 GQA", 4, 6, 2, 19, 61, 7, v1::DTYPE_FLOAT32, v1::DTYPE_UNSPECIFIED, true,
             std::nullopt},
        Case{"bf16 rank 3", 3, 4, 4, 33, 21, 9, v1::DTYPE_BFLOAT16, v1::DTYPE_UNSPECIFIED, true,
             std::nullopt},
        Case{"f16 in, f32 out, no lse", 3, 2, 1, 12, 40, 5, v1::DTYPE_FLOAT16, v1::DTYPE_FLOAT32,
             false, std::nullopt},
        Case{"rank 2, explicit query_position", 2, 1, 1, 9, 44, 6, v1::DTYPE_FLOAT32,
             v1::DTYPE_BFLOAT16, true, 11},
        Case{"f32 rank 4 GQA ALiBi", 4, 6, 2, 19, 61, 7, v1::DTYPE_FLOAT32, v1::DTYPE_UNSPECIFIED,
             true, std::nullopt, true},
        Case{"f32 rank 4 GQA sinks", 4, 6, 2, 19, 61, 7, v1::DTYPE_FLOAT32, v1::DTYPE_UNSPECIFIED,
             true, std::nullopt, false, true},
        Case{"bf16 rank 3 sinks, more rows than keys", 3, 4, 2, 30, 23, 9, v1::DTYPE_BFLOAT16,
             v1::DTYPE_UNSPECIFIED, true, std::nullopt, true, true}}) {
    SCOPED_TRACE(c.name);
    v1::AttentionRequest request =
        RandomRequest(c.rank, c.rank == 4 ? 2 : 1, c.heads, c.kv_heads, c.query_len, c.key_len, 8,
                      c.value_dim, c.dtype, std::hash<std::string>{}(c.name));
    request.mutable_options()->set_causal(true);
    request.mutable_options()->set_return_lse(c.return_lse);
    request.mutable_options()->set_output_dtype(c.output_dtype);
    if (c.query_position) request.mutable_options()->set_query_position(*c.query_position);
    for (int64_t h = 0; c.alibi && h < c.heads; ++h) {
      request.mutable_options()->add_alibi_slopes(std::ldexp(1.f, -static_cast<int>(h) - 1));
    }
    for (int64_t h = 0; c.sinks && h < c.heads; ++h) {
      request.mutable_options()->add_sinks(0.7f * static_cast<float>(h) - 1.f);
    }
    const std::vector<client::ShardPart> parts = client::SplitKeys(request, 3);
    ASSERT_EQ(parts.size(), 3u);
    for (size_t i = 0; i < parts.size(); ++i) {  // A row's sink counts once: the first slice's.
      EXPECT_EQ(parts[i].request.options().sinks_size(),
                i == 0 ? request.options().sinks_size() : 0)
          << "slice " << i;
    }
    std::vector<v1::AttentionResponse> responses;
    for (const client::ShardPart& part : parts) responses.push_back(Answer(backend, part.request));
    absl::StatusOr<v1::AttentionResponse> merged =
        client::MergeKeySlices(request, parts, responses);
    ASSERT_TRUE(merged.ok()) << merged.status();
    const v1::AttentionResponse whole = Answer(backend, request);

    EXPECT_EQ(
        std::vector<int64_t>(merged->output().shape().begin(), merged->output().shape().end()),
        std::vector<int64_t>(whole.output().shape().begin(), whole.output().shape().end()));
    EXPECT_EQ(merged->output().dtype(), whole.output().dtype());
    EXPECT_EQ(merged->has_lse(), c.return_lse);
    const std::vector<float> got = client::FromTensor(merged->output()).value().values;
    const std::vector<float> want = client::FromTensor(whole.output()).value().values;
    ASSERT_EQ(got.size(), want.size());
    if (whole.output().dtype() == v1::DTYPE_FLOAT32) {
      EXPECT_LE(RelativeError(got, want), kOutputRtol);
    } else {  // The fp32 values agree to a few ulps; rounded, they may differ by one step.
      const double step = whole.output().dtype() == v1::DTYPE_BFLOAT16 ? 0x1p-7 : 0x1p-10;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_LE(std::abs(got[i] - want[i]), step * std::abs(want[i]) + 1e-7)
            << "element " << i << ": " << got[i] << " vs " << want[i];
      }
    }
    if (c.return_lse) {
      ExpectLseNear(client::FromTensor(merged->lse()).value().values,
                    client::FromTensor(whole.lse()).value().values);
    }
    EXPECT_EQ(merged->stats().compute_ns(), 1000);  // The largest part's: they run at once.
    double flops = 0;
    for (const v1::AttentionResponse& response : responses) flops += response.stats().flops();
    EXPECT_EQ(merged->stats().flops(), flops);
    EXPECT_EQ(merged->stats().flops(), whole.stats().flops());  // Only visible pairs, each once.
  }
}

// SplitRequest with ALiBi slopes: each part carries its own query heads' slopes (a part that
// would cross batch entries is cut there), and the reassembled answer is the whole one's bit for
// bit.
TEST(SplitRequestTest, AlibiPartsCarryTheirHeadsSlopes) {
  CpuBackend backend(2, 0);
  v1::AttentionRequest request =
      RandomRequest(4, 2, 6, 3, 11, 17, 8, 5, v1::DTYPE_FLOAT32, 23);  // 2 batches × 3 kv heads
  request.mutable_options()->set_causal(true);
  for (int h = 0; h < 6; ++h) request.mutable_options()->add_alibi_slopes(0.1f * (h + 1));
  // Units 0–5 in 3 parts would be [0, 2) [2, 4) [4, 6); the second crosses the batch boundary
  // at 3 and is cut: [0, 2) [2, 3) [3, 4) [4, 6).
  const std::vector<client::ShardPart> parts = client::SplitRequest(request, 3);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[1].first_unit, 2);
  EXPECT_EQ(parts[2].first_unit, 3);
  std::vector<v1::AttentionResponse> responses;
  for (const client::ShardPart& part : parts) {
    const int64_t first_head = part.first_unit % 3 * 2;
    const auto& slopes = part.request.options().alibi_slopes();
    ASSERT_EQ(slopes.size(), part.units * 2);
    for (int i = 0; i < slopes.size(); ++i) {
      EXPECT_EQ(slopes[i], request.options().alibi_slopes(first_head + i));
    }
    responses.push_back(Answer(backend, part.request));
  }
  absl::StatusOr<v1::AttentionResponse> merged = client::MergeResponses(request, parts, responses);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output().data(), Answer(backend, request).output().data());
  EXPECT_EQ(client::SplitRequest(request, 2).size(), 2u);  // [0, 3) [3, 6): no cut needed.
  request.mutable_options()->add_alibi_slopes(1.f);        // 7 slopes for 6 heads: sent whole.
  EXPECT_EQ(client::SplitRequest(request, 4).size(), 1u);
}

// SplitRequest with sinks: each part carries its own query heads' sinks, cut at batch entries as
// for slopes, and the reassembled answer is the whole one's bit for bit.
TEST(SplitRequestTest, SinkPartsCarryTheirHeadsSinks) {
  CpuBackend backend(2, 0);
  v1::AttentionRequest request =
      RandomRequest(4, 2, 6, 3, 11, 17, 8, 5, v1::DTYPE_FLOAT32, 29);  // 2 batches × 3 kv heads
  request.mutable_options()->set_causal(true);
  for (int h = 0; h < 6; ++h) request.mutable_options()->add_sinks(0.5f * h - 1.f);
  const std::vector<client::ShardPart> parts = client::SplitRequest(request, 3);
  ASSERT_EQ(parts.size(), 4u);
  std::vector<v1::AttentionResponse> responses;
  for (const client::ShardPart& part : parts) {
    const int64_t first_head = part.first_unit % 3 * 2;
    const auto& sinks = part.request.options().sinks();
    ASSERT_EQ(sinks.size(), part.units * 2);
    for (int i = 0; i < sinks.size(); ++i) {
      EXPECT_EQ(sinks[i], request.options().sinks(first_head + i));
    }
    responses.push_back(Answer(backend, part.request));
  }
  absl::StatusOr<v1::AttentionResponse> merged = client::MergeResponses(request, parts, responses);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output().data(), Answer(backend, request).output().data());
  request.mutable_options()->add_sinks(1.f);  // 7 sinks for 6 heads: sent whole.
  EXPECT_EQ(client::SplitRequest(request, 4).size(), 1u);
}

// A ragged batch splits by kv heads into [1, u·G, N, D] parts, each with the whole cu_seqlens,
// and reassembles to one server's answer bit for bit.
TEST(SplitRequestTest, RaggedPartsCarryTheSequences) {
  CpuBackend backend(2, 0);
  v1::AttentionRequest request = RandomRequest(4, 1, 6, 3, 17, 20, 8, 5, v1::DTYPE_FLOAT32, 29);
  request.mutable_options()->set_causal(true);
  for (int64_t length : {0, 5, 6, 17}) request.add_cu_seqlens_q(length);
  for (int64_t length : {0, 7, 8, 20}) request.add_cu_seqlens_k(length);
  const std::vector<client::ShardPart> parts = client::SplitRequest(request, 2);
  ASSERT_EQ(parts.size(), 2u);
  std::vector<v1::AttentionResponse> responses;
  for (const client::ShardPart& part : parts) {
    EXPECT_EQ(part.request.query().shape(0), 1);
    EXPECT_EQ(part.request.query().shape(1), part.units * 2);
    EXPECT_EQ(part.request.cu_seqlens_q().size(), 4);
    EXPECT_EQ(part.request.cu_seqlens_k(3), 20);
    responses.push_back(Answer(backend, part.request));
  }
  absl::StatusOr<v1::AttentionResponse> merged = client::MergeResponses(request, parts, responses);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->output().data(), Answer(backend, request).output().data());
}

TEST(MergeKeySlicesTest, AWholePartIsItsOwnAnswerAndBadPartsAreInternal) {
  v1::AttentionRequest request = RandomRequest(3, 1, 2, 2, 5, 6, 4, 4, v1::DTYPE_FLOAT32, 2);
  CpuBackend backend(1, 0);
  const std::vector<client::ShardPart> whole = client::SplitKeys(request, 1);
  const v1::AttentionResponse answer = Answer(backend, request);
  absl::StatusOr<v1::AttentionResponse> same = client::MergeKeySlices(request, whole, {answer});
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->SerializeAsString(), answer.SerializeAsString());

  const std::vector<client::ShardPart> parts = client::SplitKeys(request, 2);
  ASSERT_EQ(parts.size(), 2u);
  std::vector<v1::AttentionResponse> responses{Answer(backend, parts[0].request),
                                               Answer(backend, parts[1].request)};
  responses[1].clear_lse();
  const absl::Status no_lse = client::MergeKeySlices(request, parts, responses).status();
  EXPECT_EQ(no_lse.code(), absl::StatusCode::kInternal);
  EXPECT_NE(no_lse.message().find("key slice 2 of 2"), absl::string_view::npos) << no_lse;
  EXPECT_EQ(client::MergeKeySlices(request, parts, {responses[0]}).status().code(),
            absl::StatusCode::kInternal);
}

}  // namespace
