// attention_fuzz: a libFuzzer target over the server's request validation and the CPU kernels.
//
// Input (fuzz_input.h): one byte choosing the message (odd: TraceRequest; 0 mod 4:
// AttentionRequest; 2 mod 4: a cache step, a CreateCacheRequest and a DecodeRequest), then the
// message(s) in protobuf's binary format. Each input goes the way attnd's handlers take it
// (server/service.cc, service_caches.cc), and the target aborts, which libFuzzer reports as a
// crash and saves, when
//   - validation (server/request.h) refuses with anything but INVALID_ARGUMENT naming a field
//     (or, for a cache step, the few other refusals Decode's contract names), or accepts a
//     Problem that breaks kernels/problem.h's invariants;
//   - the answer's size is not refused exactly when it passes the reply limit (CheckReplyBytes,
//     before anything is allocated, so shapes asking for gigabytes are safe to fuzz);
//   - an accepted problem that is small (kMaxWork) fails on the CPU backend, except Naive's one
//     documented refusal: RESOURCE_EXHAUSTED exactly when its matrices pass its budget;
//   - an output row of Naive, Tiled, Trace or Decode is farther from a float64 reference than
//     the error bound below allows (so Naive and Tiled agree with each other within twice that
//     bound), a row that sees no key is not exactly 0 with lse −inf, or a trace's events do not
//     follow the contract (attention.proto: one TileStep per visited tile, then a RowDone, per
//     row).
// A cache step (FuzzCacheStep) creates the cache, fills it with the Decode item's new tokens
// once (as an AppendCache of them would), then runs the item as Decode does: its cut
// (truncate_to; with an odd expected_length, a fork at that length instead), the tokens appended
// again, the query attending over the cache, token tree
// included. Its reference reads the tokens as sent (a latent cache's values: the first
// value_dim columns of each key), not the cache's pages.
// The "fuzz" preset builds it with ASan and UBSan, which catch memory errors and undefined
// behavior on the way, and structure_mutator.cc's mutations keep shapes and data in step.
// tests/run.sh runs it on a copy of corpus/; see tests/fuzz/CMakeLists.txt.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/fp32_rows.h"
#include "kernels/make_backend.h"
#include "kernels/problem.h"
#include "server/request.h"
#include "server/response.h"
#include "tests/fuzz/fuzz_input.h"

namespace attn {
namespace {

namespace v1 = attention::v1;

// Multiply-adds one input may cost, B·H·Nq·Nk·(d + dv) (Naive, Tiled and the reference each
// make about one such pass): a few milliseconds at most under ASan. Larger problems are only
// validated.
constexpr double kMaxWork = 1 << 20;
// Naive's budget for its fp32 score and weight matrices (8 bytes per query-key pair): small
// enough that fuzzed problems reach the refusal.
constexpr int64_t kMaxNaiveBytes = 1 << 20;
// More than one worker, so row blocks are split between threads.
constexpr int kThreads = 2;
// A row is compared with its reference only when every input, dot product and sum stays under
// this: far enough below fp32's 3.4e38 that no intermediate overflows, in any order of
// operations. Larger values may legitimately overflow to inf and NaN.
constexpr double kMaxTame = 1e30;
constexpr double kUnitRoundoff = 0x1p-24;  // fp32
constexpr double kFloatTiny = 0x1p-149;    // fp32's smallest subnormal

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "attention_fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string Describe(const Problem& p) {
  const Shape& s = p.shape;
  return absl::StrFormat(
      "problem [B=%d H=%d Hkv=%d Nq=%d Nk=%d d=%d dv=%d], q/k/v %s/%s/%s → %s, scale %g, "
      "block_k %d%s%s, window (%d, %d), softcap %g%s%s",
      s.batch, s.heads, s.kv_heads, s.query_len, s.key_len, s.head_dim, s.value_dim,
      DTypeName(p.query.dtype), DTypeName(p.key.dtype), DTypeName(p.value.dtype),
      DTypeName(p.output_dtype), p.scale, p.block_k, p.causal ? ", causal" : "",
      p.return_lse ? ", lse" : "", p.window_left, p.window_right, p.softcap,
      p.alibi_slopes != nullptr ? absl::StrFormat(", ALiBi (slope 0: %g)", p.alibi_slopes[0])
                                : std::string(),
      p.sinks != nullptr ? absl::StrFormat(", sinks (sink 0: %g)", p.sinks[0]) : std::string());
}

Backend& Cpu() {
  static Backend* const backend = [] {
    absl::StatusOr<std::unique_ptr<Backend>> made = MakeBackend(
        BackendConfig{.device = "cpu", .threads = kThreads, .max_naive_bytes = kMaxNaiveBytes});
    if (!made.ok()) Fail(absl::StrCat("MakeBackend(cpu): ", made.status().ToString()));
    return made->release();  // Lives as long as the process.
  }();
  return *backend;
}

// Validation's only way to refuse: INVALID_ARGUMENT with "field: what is wrong".
void ExpectRefusal(absl::string_view where, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument ||
      !absl::StrContains(status.message(), ": ")) {
    Fail(absl::StrCat(where, " refused with ", status.ToString(),
                      "; expected INVALID_ARGUMENT naming the field"));
  }
}

// kernels/problem.h's invariants, which the kernels assume without checking.
void ExpectInvariants(const Problem& p) {
  const Shape& s = p.shape;
  const bool ok =
      s.batch >= 1 && s.heads >= 1 && s.kv_heads >= 1 && s.query_len >= 1 && s.key_len >= 1 &&
      s.head_dim >= 1 && s.value_dim >= 1 && s.heads % s.kv_heads == 0 && p.block_k >= 1 &&
      p.block_k <= s.key_len && std::isfinite(p.scale) && p.query.data != nullptr &&
      (p.pages != nullptr || (p.key.data != nullptr && p.value.data != nullptr)) &&
      std::isfinite(p.softcap) && p.softcap >= 0.f &&
      (p.alibi_slopes == nullptr ||
       std::all_of(p.alibi_slopes, p.alibi_slopes + s.heads,
                   [](float slope) { return std::isfinite(slope); })) &&
      (p.sinks == nullptr ||
       std::all_of(p.sinks, p.sinks + s.heads, [](float sink) { return std::isfinite(sink); })) &&
      (p.window_left == kUnbounded || (p.window_left >= 0 && p.window_left <= kMaxPosition)) &&
      (p.window_right == kUnbounded || (p.window_right >= 0 && p.window_right <= kMaxPosition));
  if (!ok) Fail(absl::StrCat("validation accepted an invalid ", Describe(p)));
}

// B·H·Nq·Nk·(d + dv), in double so it cannot overflow.
double Work(const Problem& p, double rows) {
  const Shape& s = p.shape;
  return rows * static_cast<double>(s.key_len) * static_cast<double>(s.head_dim + s.value_dim);
}

// One query row in float64 on the problem's (stored) inputs, and how far an fp32 computation of
// it may be off.
//
// The bound. The unit tests' fixed tolerances (tests/checks.h: 1e-5 of max|ref| in fp32) assume
// well-scaled random inputs; fuzzed inputs span fp32's range, so the bound follows the row's
// conditioning instead. With u = 2^-24, P = max_j Σ_c |q_c·k_jc| over the visible keys and
// V = max |v| over them:
//   a score              off by at most ε = (d + 2)·u·|scale|·P + 8u·softcap + 4u·A   (fp32 dot
//                                                   product in any order, then the scale; the
//                                                   softcap's tanh, of slope ≤ 1, adds its own;
//                                                   A = the largest |ALiBi bias|, rounded in
//                                                   fp32 and added)
//   a normalized weight  off by a factor within e^(±δ), δ = 2ε + 3η, with η = 128u for exp's own
//                        error and the rounding of (s − max) when the weight is not negligible
//   the output           |out − ref| ≤ V·(w + (4·Nk + 8)·u·(1 + w)) + subnormal rounding, with
//                        w = min(expm1(δ), 2); the sums: weighted values, the denominator, each
//                        tile's rescale
//   the lse              |lse − ref| ≤ ε + η + (4·Nk + 8)·u + 2u·|lse|   (log-sum-exp moves by
//                                                                         at most ε)
// each doubled for slack. A kernel that mishandles a tile, a mask or a head is off by O(V).
struct RowReference {
  KeyRange visible;             // The range of keys the row sees (Problem::Visible).
  int64_t seen = 0;             // Keys in it the row sees: all but a token tree's hidden ones.
  std::vector<double> output;   // value_dim values.
  double lse = -INFINITY;       // −inf when the row sees no key.
  bool tame = false;            // Whether the bounds apply (nothing can overflow in fp32).
  double max_abs_value = 0;     // V
  double output_tolerance = 0;  // In fp32, before the output dtype's rounding.
  double lse_tolerance = 0;
};

// tree_parents: a Decode item's token tree (attention.proto's DecodeItem.tree_parents), whose
// new tokens end the keys and are the query rows: of them, row i sees only token i and its
// ancestors. Empty: no tree. The problem's own tree (tree_ancestors) is not read.
RowReference ReferenceRow(const Problem& p, const RowRef& row,
                          absl::Span<const int32_t> tree_parents = {}) {
  const Shape& s = p.shape;
  RowReference ref;
  ref.visible = p.Visible(row.row);
  ref.output.assign(s.value_dim, 0.0);
  const int64_t tree_first = s.key_len - static_cast<int64_t>(tree_parents.size());
  std::vector<char> in_tree(tree_parents.size(), 0);  // The row's ancestors, and itself.
  for (int64_t t = tree_parents.empty() ? -1 : row.row; t >= 0; t = tree_parents[t]) {
    if (t >= static_cast<int64_t>(tree_parents.size()) || tree_parents[t] >= t) {
      Fail(absl::StrCat("validation accepted a token tree with token ", t, "'s parent ",
                        t < static_cast<int64_t>(tree_parents.size()) ? tree_parents[t] : -2,
                        " for ", Describe(p)));
    }
    in_tree[t] = 1;
  }
  auto sees = [&](int64_t j) { return j < tree_first || in_tree[j - tree_first] != 0; };
  for (int64_t j = ref.visible.begin; j < ref.visible.end; ++j) ref.seen += sees(j);
  // The sink: one more logit of the row, e^sink in its sum and no value.
  const bool has_sink = p.sinks != nullptr;
  const double sink = has_sink ? double{p.sinks[row.head]} : -INFINITY;
  if (ref.seen == 0) {
    ref.lse = sink;  // −inf without a sink.
    ref.tame = true;
    return ref;
  }
  const int64_t kv_head = p.KvHead(row.head);
  const int64_t q0 = p.QueryOffset(row.batch, row.head, row.row);
  double max_abs_query = 0, max_abs_key = 0, products = 0;
  for (int64_t c = 0; c < s.head_dim; ++c) {
    max_abs_query = std::max(max_abs_query, std::abs(double{p.query[q0 + c]}));
  }
  std::vector<double> scores(s.key_len);
  double max_score = -INFINITY, max_bias = 0;
  const double slope = p.alibi_slopes != nullptr ? double{p.alibi_slopes[row.head]} : 0.0;
  const Geometry geometry = p.geometry();
  for (int64_t j = ref.visible.begin; j < ref.visible.end; ++j) {
    if (!sees(j)) continue;
    const int64_t k0 = p.KeyOffset(row.batch, kv_head, j);
    double dot = 0, abs_dot = 0;
    for (int64_t c = 0; c < s.head_dim; ++c) {
      const double q = p.query[q0 + c], k = p.key[k0 + c];
      dot += q * k;
      abs_dot += std::abs(q * k);
      max_abs_key = std::max(max_abs_key, std::abs(k));
    }
    scores[j] = double{p.scale} * dot;
    if (p.softcap > 0.f) scores[j] = p.softcap * std::tanh(scores[j] / p.softcap);
    const double bias = -slope * std::abs(static_cast<double>(geometry.Distance(row.row, j)));
    scores[j] += bias;
    max_bias = std::max(max_bias, std::abs(bias));
    products = std::max(products, abs_dot);
    max_score = std::max(max_score, scores[j]);
  }
  max_score = std::max(max_score, sink);
  double denominator = has_sink ? std::exp(sink - max_score) : 0.0;
  for (int64_t j = ref.visible.begin; j < ref.visible.end; ++j) {
    if (!sees(j)) continue;
    const double weight = std::exp(scores[j] - max_score);
    denominator += weight;
    const int64_t v0 = p.ValueOffset(row.batch, kv_head, j);
    for (int64_t c = 0; c < s.value_dim; ++c) {
      const double v = p.value[v0 + c];
      ref.output[c] += weight * v;
      ref.max_abs_value = std::max(ref.max_abs_value, std::abs(v));
    }
  }
  for (double& out : ref.output) out /= denominator;
  ref.lse = max_score + std::log(denominator);

  const double scale = std::abs(double{p.scale});
  const double visible = static_cast<double>(ref.visible.size());
  ref.tame = std::max({max_abs_query, max_abs_key, scale * max_abs_query, products,
                       scale * products, ref.max_abs_value * visible, max_bias,
                       has_sink ? std::abs(sink) : 0.0}) <= kMaxTame;
  const double u = kUnitRoundoff;
  // The softcap's tanh has slope ≤ 1, so it passes the product's error on unchanged and adds
  // its own (tanhf's few ulps of a result within ±softcap).
  const double score_error = static_cast<double>(s.head_dim + 2) * u * scale * products +
                             8 * u * static_cast<double>(p.softcap) + 4 * u * max_bias;
  // Past 2 the weights may be anything: out and ref are both averages of values within ±V.
  const double weight_error = std::min(std::expm1(2 * score_error + 3 * 128 * u), 2.0);
  const double sums = (4 * visible + 8) * u;
  ref.output_tolerance = 2 * (ref.max_abs_value * (weight_error + sums * (1 + weight_error)) +
                              (4 * visible + 8) * kFloatTiny);
  ref.lse_tolerance = 2 * (score_error + 128 * u + sums + 2 * u * std::abs(ref.lse));
  return ref;
}

// Half an ulp relative, and half the smallest subnormal: what storing in `dtype` may add.
double HalfUlp(DType dtype) {
  return dtype == DType::kFloat32 ? 0x1p-24 : dtype == DType::kFloat16 ? 0x1p-11 : 0x1p-8;
}
double HalfTiniest(DType dtype) {
  return dtype == DType::kFloat32 ? 0x1p-150 : dtype == DType::kFloat16 ? 0x1p-25 : 0x1p-134;
}

// Checks one computed row against its reference. `output(c)` reads component c as stored in
// `dtype`; lse is null when the method returned none.
template <class Output>
void ExpectRowMatches(absl::string_view where, const Problem& p, const RowRef& row,
                      const RowReference& ref, DType dtype, Output output, const float* lse) {
  auto fail = [&](const std::string& what) {
    Fail(absl::StrFormat("%s: row (batch %d, head %d, row %d) of %s, %d of %d keys visible: %s",
                         where, row.batch, row.head, row.row, Describe(p), ref.seen,
                         p.shape.key_len, what));
  };
  if (ref.seen == 0) {  // Zeros and −inf (the sink with one), whatever the inputs.
    for (int64_t c = 0; c < p.shape.value_dim; ++c) {
      if (output(c) != 0.f) fail(absl::StrCat("out[", c, "] = ", output(c), "; expected 0"));
    }
    if (lse != nullptr && !(double{*lse} == ref.lse)) {
      fail(absl::StrCat("lse = ", *lse, "; expected ", ref.lse));
    }
    return;
  }
  if (!ref.tame) return;
  // An fp16 output may round to ±inf only when the values come near its largest finite 65504.
  if (dtype == DType::kFloat16 && ref.max_abs_value > 6e4) return;
  for (int64_t c = 0; c < p.shape.value_dim; ++c) {
    const double out = output(c);
    const double tolerance = ref.output_tolerance +
                             HalfUlp(dtype) * (std::abs(ref.output[c]) + ref.output_tolerance) +
                             HalfTiniest(dtype);
    if (!(std::abs(out - ref.output[c]) <= tolerance)) {
      fail(absl::StrFormat(
          "out[%d] = %.9g, float64 reference %.9g: off by %.3g, over the bound "
          "%.3g (max |v| %.9g)",
          c, out, ref.output[c], std::abs(out - ref.output[c]), tolerance, ref.max_abs_value));
    }
  }
  if (lse != nullptr && !(std::abs(double{*lse} - ref.lse) <= ref.lse_tolerance)) {
    fail(absl::StrFormat("lse = %.9g, float64 reference %.9g: off by %.3g, over the bound %.3g",
                         *lse, ref.lse, std::abs(*lse - ref.lse), ref.lse_tolerance));
  }
}

std::vector<RowRef> AllRows(const Shape& s) {
  std::vector<RowRef> rows;
  rows.reserve(s.batch * s.heads * s.query_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.query_len; ++i) rows.push_back(RowRef{b, h, i});
    }
  }
  return rows;
}

// The reply limit attnd would apply (--max-message-bytes): small, so that fuzzed shapes reach
// the refusal of answers too large to send.
constexpr int64_t kMaxMessageBytes = 1 << 20;

// The service's check before any output is allocated (server/service.cc): refused exactly when
// the answer's output and lse, counted here in double precision, pass the limit, and then with
// RESOURCE_EXHAUSTED naming the query and the flag. True when the answer may be computed.
bool ReplyFits(const Problem& p) {
  const Shape& s = p.shape;
  const double rows = static_cast<double>(s.batch) * s.heads * s.query_len;
  const double bytes = rows * s.value_dim * ElementSize(p.output_dtype) +
                       (p.return_lse ? rows * sizeof(float) : 0.0);
  const int64_t counted = ReplyTensorBytes(p);
  if (static_cast<double>(counted) != bytes) {
    Fail(absl::StrCat("ReplyTensorBytes is ", counted, " for ", Describe(p), "; expected ", bytes));
  }
  const absl::Status status = CheckReplyBytes("query", counted, kMaxMessageBytes);
  const bool fits = bytes <= kMaxMessageBytes;
  if (status.ok() != fits ||
      (!fits && (status.code() != absl::StatusCode::kResourceExhausted ||
                 !absl::StrContains(status.message(), "query: ") ||
                 !absl::StrContains(status.message(), "--max-message-bytes")))) {
    Fail(absl::StrCat("CheckReplyBytes answered ", status.ToString(), " for ", bytes,
                      " bytes of answer to ", Describe(p)));
  }
  return fits;
}

// Runs Naive or Tiled the way the service does (PrepareOutputs into a response) and checks
// every row against `refs` (AllRows order).
void RunAndCheck(bool naive, const Problem& p, const v1::AttentionRequest& request,
                 const std::vector<RowReference>& refs) {
  const char* method = naive ? "Naive" : "Tiled";
  const Shape& s = p.shape;
  v1::AttentionResponse response;
  const Outputs outputs = PrepareOutputs(p, request, &response);
  // All-ones bytes are NaN in every dtype, so an element left unwritten fails its row's check.
  std::string* data = response.mutable_output()->mutable_data();
  if (static_cast<int64_t>(data->size()) != p.OutputElements() * ElementSize(p.output_dtype) ||
      outputs.output.data != data->data() || (outputs.lse != nullptr) != p.return_lse ||
      static_cast<int64_t>(data->size() + response.lse().data().size()) != ReplyTensorBytes(p)) {
    Fail(absl::StrCat("PrepareOutputs sized the outputs wrongly for ", Describe(p)));
  }
  std::memset(data->data(), 0xff, data->size());
  if (p.return_lse) {
    std::string* lse = response.mutable_lse()->mutable_data();
    std::memset(lse->data(), 0xff, lse->size());
  }

  Backend& backend = Cpu();
  const absl::StatusOr<Stats> stats = naive ? backend.Naive(p, outputs) : backend.Tiled(p, outputs);
  const bool over_budget =
      naive && 8 * s.batch * s.heads * s.query_len * s.key_len > backend.max_naive_bytes();
  if (over_budget) {
    if (stats.status().code() != absl::StatusCode::kResourceExhausted ||
        !absl::StrContains(stats.status().message(), "Tiled")) {
      Fail(absl::StrCat("Naive over its budget answered ", stats.status().ToString(),
                        "; expected RESOURCE_EXHAUSTED pointing to Tiled, for ", Describe(p)));
    }
    return;
  }
  if (!stats.ok()) {
    Fail(absl::StrCat(method, " failed with ", stats.status().ToString(), " on ", Describe(p)));
  }
  EncodeStats(*stats, response.mutable_stats());

  const std::vector<RowRef> rows = AllRows(s);
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t offset = p.OutputOffset(rows[r].batch, rows[r].head, rows[r].row);
    const float* lse = p.return_lse ? outputs.lse + r : nullptr;
    ExpectRowMatches(
        method, p, rows[r], refs[r], p.output_dtype,
        [&](int64_t c) { return LoadElement(data->data(), p.output_dtype, offset + c); }, lse);
  }
}

// The backend of the KV cache checks: pages of 7 tokens, so most caches span several and end
// inside one.
CpuBackend& PagedCpu() {
  static CpuBackend* const backend =
      new CpuBackend(kThreads, kMaxNaiveBytes, CpuBackend::kDefaultMaxPackedHeadBytes,
                     /*kv_page_tokens=*/7);  // Lives as long as the process.
  return *backend;
}

// The same problem with its keys and values in a KV cache: Naive and Tiled over the pages must
// give the same rows. A cache holds one sequence in one dtype, so only such problems qualify.
void FuzzOverCache(const Problem& p, const v1::AttentionRequest& request,
                   const std::vector<RowReference>& refs) {
  const Shape& s = p.shape;
  if (s.batch != 1 || p.key.dtype != p.value.dtype) return;
  absl::StatusOr<std::unique_ptr<KvStore>> store =
      PagedCpu().CreateKvStore({.kv_heads = s.kv_heads,
                                .head_dim = s.head_dim,
                                .value_dim = s.value_dim,
                                .dtype = p.key.dtype});
  if (!store.ok()) Fail(absl::StrCat("CreateKvStore: ", store.status().ToString()));
  if (absl::Status appended = (*store)->Append(p.key, p.value, s.key_len); !appended.ok()) {
    Fail(absl::StrCat("KvStore::Append: ", appended.ToString(), " for ", Describe(p)));
  }
  Problem paged = p;
  paged.key = TensorView{};
  paged.value = TensorView{};
  paged.pages = &(*store)->pages();
  RunAndCheck(/*naive=*/true, paged, request, refs);
  RunAndCheck(/*naive=*/false, paged, request, refs);
}

void FuzzAttention(const v1::AttentionRequest& request) {
  const absl::StatusOr<Problem> problem = ParseAttentionRequest(request, Cpu().default_block_k());
  if (!problem.ok()) {
    ExpectRefusal("ParseAttentionRequest", problem.status());
    return;
  }
  ExpectInvariants(*problem);
  if (!ReplyFits(*problem)) return;  // Refused before any output exists, as attnd does.
  const Shape& s = problem->shape;
  if (Work(*problem, static_cast<double>(s.batch * s.heads * s.query_len)) > kMaxWork) return;

  std::vector<RowReference> refs;
  for (const RowRef& row : AllRows(s)) refs.push_back(ReferenceRow(*problem, row));
  RunAndCheck(/*naive=*/true, *problem, request, refs);
  RunAndCheck(/*naive=*/false, *problem, request, refs);
  FuzzOverCache(*problem, request, refs);
}

// A refusal on a cache step's way: INVALID_ARGUMENT naming a field, or `code` naming `field`
// (the one other refusal the contract names at that point; kOk: none).
void ExpectCacheRefusal(absl::string_view where, const absl::Status& status,
                        absl::StatusCode code = absl::StatusCode::kOk,
                        absl::string_view field = "") {
  if (code != absl::StatusCode::kOk && status.code() == code &&
      absl::StrContains(status.message(), field)) {
    return;
  }
  ExpectRefusal(where, status);
}

// A cache step (the top of this file): CreateCache, then one Decode item over the cache holding
// the item's new tokens once. The work is bounded before the store or the reference is filled.
void FuzzCacheStep(const v1::CreateCacheRequest& create, const v1::DecodeRequest& decode) {
  const absl::StatusOr<KvLayout> layout = ParseCreateCache(create);
  if (!layout.ok()) {
    ExpectRefusal("ParseCreateCache", layout.status());
    return;
  }
  const int64_t value_dim = create.value_dim() > 0 ? create.value_dim() : create.head_dim();
  if (layout->kv_heads != create.kv_heads() || layout->head_dim != create.head_dim() ||
      layout->value_dim != value_dim || layout->values_from_keys != create.values_from_keys() ||
      (layout->values_from_keys && layout->value_dim > layout->head_dim)) {
    Fail(absl::StrCat("ParseCreateCache accepted ", create.ShortDebugString(), " as kv_heads ",
                      layout->kv_heads, ", head_dim ", layout->head_dim, ", value_dim ",
                      layout->value_dim, layout->values_from_keys ? ", latent" : ""));
  }
  if (absl::Status count = CheckDecodeItemCount(decode); !count.ok()) {
    ExpectRefusal("CheckDecodeItemCount", count);
    return;
  }
  // Every named cache has this layout (several items name several caches, so only one item runs).
  absl::StatusOr<DecodeBatch> batch = ParseDecodeRequest(
      decode,
      [&](const std::string&, const std::string&) -> absl::StatusOr<KvLayout> { return *layout; },
      PagedCpu().default_block_k(), kMaxMessageBytes);
  if (!batch.ok()) {  // The reply check's refusal, as for Naive and Tiled (ReplyFits).
    ExpectCacheRefusal("ParseDecodeRequest", batch.status(), absl::StatusCode::kResourceExhausted,
                       "--max-message-bytes");
    return;
  }
  if (batch->items.size() != 1) return;
  DecodeItemProblem& item = batch->items[0];
  const v1::DecodeItem& sent = decode.items(0);
  const NewTokens& tokens = item.tokens;
  const KvLayout& l = item.layout;
  double max_abs_key, max_abs_value;
  if (absl::Status values =
          CheckNewTokenValues(item.prefix, tokens, l, &max_abs_key, &max_abs_value);
      !values.ok()) {
    ExpectRefusal("CheckNewTokenValues", values);
    return;
  }
  // The cut, against the cache's n tokens; past them is OUT_OF_RANGE.
  const int64_t n = tokens.n;
  int64_t kept = n;
  if (item.truncate_to) {
    const absl::Status cut = CheckDecodeCut(item.prefix, *item.truncate_to, n, l);
    if (!cut.ok()) {
      ExpectCacheRefusal(
          "CheckDecodeCut", cut,
          *item.truncate_to > n ? absl::StatusCode::kOutOfRange : absl::StatusCode::kOk,
          "truncate_to");
      return;
    }
    if (*item.truncate_to < 0 || *item.truncate_to > n) {
      Fail(absl::StrCat("CheckDecodeCut accepted truncate_to ", *item.truncate_to, " of ", n,
                        " tokens"));
    }
    kept = *item.truncate_to;
  }
  const int64_t length = kept + n;
  Problem& p = item.problem;
  const Shape& s = p.shape;
  // Work(p) with the cache's length as key_len; it also bounds the store and the reference's
  // copies of the tokens (kv_heads ≤ heads, query_len ≥ 1).
  if (static_cast<double>(s.heads) * static_cast<double>(s.query_len) *
          static_cast<double>(length) * static_cast<double>(s.head_dim + s.value_dim) >
      kMaxWork) {
    return;
  }

  absl::StatusOr<std::unique_ptr<KvStore>> store = PagedCpu().CreateKvStore(l);
  if (!store.ok()) Fail(absl::StrCat("CreateKvStore: ", store.status().ToString()));
  // The tokens once, then the item's cut and append: on the store itself, or (an odd
  // expected_length) on a fork of it at the cut (ForkCache), which must copy a shared partly
  // filled last page before writing into it and leave the source's tokens as they were.
  const bool forked = sent.expected_length() % 2 != 0;
  KvStore* cache = store->get();
  std::unique_ptr<KvStore> fork;
  std::vector<char> source_tokens, source_after;
  const int64_t stored_bytes = KeyBytes(l, n) + StoredValueBytes(l, n);
  // Where CopyOut puts the values in such a buffer (none of a latent store's: its keys only).
  auto stored_value = [&](std::vector<char>& buffer) -> void* {
    return l.values_from_keys ? nullptr : buffer.data() + KeyBytes(l, n);
  };
  for (int pass = 0; pass < 2 && n > 0; ++pass) {
    if (pass == 1 && forked) {
      absl::StatusOr<std::unique_ptr<KvStore>> made = (*store)->Fork(kept);
      if (!made.ok()) Fail(absl::StrCat("KvStore::Fork(", kept, "): ", made.status().ToString()));
      fork = *std::move(made);
      cache = fork.get();
      source_tokens.resize(stored_bytes);
      if (!(*store)->CopyOut(0, n, source_tokens.data(), stored_value(source_tokens)).ok()) {
        Fail("KvStore::CopyOut of the source failed");
      }
    } else if (pass == 1) {
      cache->Truncate(kept);
    }
    if (absl::Status appended = cache->Append(tokens.key, tokens.value, n); !appended.ok()) {
      Fail(absl::StrCat("KvStore::Append: ", appended.ToString(), " for ", n, " tokens of ",
                        create.ShortDebugString()));
    }
  }
  if (fork != nullptr) {
    source_after.resize(stored_bytes);
    if ((*store)->length() != n ||
        !(*store)->CopyOut(0, n, source_after.data(), stored_value(source_after)).ok() ||
        source_after != source_tokens) {
      Fail(absl::StrCat("the source of a fork at ", kept, " changed when the fork appended ", n,
                        " tokens"));
    }
  }
  if (cache->length() != length) {
    Fail(absl::StrCat("the cache holds ", cache->length(), " tokens; expected ", length));
  }
  if (absl::Status bound =
          BindCache(item.prefix, cache->pages(), length, max_abs_key, max_abs_value, &p);
      !bound.ok()) {
    ExpectCacheRefusal("BindCache", bound,
                       length == 0 ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kOk,
                       "cache_id");
    return;
  }
  if (length == 0) Fail("BindCache accepted an empty cache");
  if (!item.tree.empty()) p.tree_ancestors = item.tree.data();
  ExpectInvariants(p);
  if (s.key_len != length || p.tree_count != sent.tree_parents_size() ||
      (p.tree_count > 0 && (p.tree_first != kept || s.query_len != n))) {
    Fail(absl::StrCat("BindCache made ", Describe(p), " with tree_count ", p.tree_count,
                      ", tree_first ", p.tree_first, " of a cache of ", length, " tokens (", kept,
                      " kept, ", n, " new) and ", sent.tree_parents_size(), " tree_parents"));
  }

  // The reference's keys and values: the tokens as sent, dense [kv_heads, length, ·] in fp32
  // (exact), the kept ones then the new ones; a latent cache's value is its key's first
  // value_dim columns.
  const int64_t d = l.head_dim, dv = l.value_dim;
  std::vector<float> keys(l.kv_heads * length * d), values(l.kv_heads * length * dv);
  for (int64_t h = 0; h < l.kv_heads; ++h) {
    for (int64_t j = 0; j < length; ++j) {
      const int64_t token = h * n + (j < kept ? j : j - kept);
      const int64_t at = h * length + j;
      for (int64_t c = 0; c < d; ++c) keys[at * d + c] = tokens.key[token * d + c];
      for (int64_t c = 0; c < dv; ++c) {
        values[at * dv + c] =
            l.values_from_keys ? tokens.key[token * d + c] : tokens.value[token * dv + c];
      }
    }
  }
  if (l.dtype == DType::kFloat8E4M3) {
    // An fp8 cache holds its tokens quantized: the reference reads what it stores, code · scale
    // (the kernels' exactness; the quantization's own error is tests/decode_test.cc's).
    const int64_t key_row = KeyRowBytes(l), value_row = StoredRowBytes(l.dtype, dv);
    std::vector<char> stored(KeyBytes(l, length) + l.kv_heads * length * value_row);
    if (!cache->CopyOut(0, length, stored.data(), stored.data() + KeyBytes(l, length)).ok()) {
      Fail("KvStore::CopyOut of an fp8 cache failed");
    }
    const char* stored_values = stored.data() + KeyBytes(l, length);
    for (int64_t row = 0; row < l.kv_heads * length; ++row) {
      DequantizeFp8Row(stored.data() + row * key_row, d, key_row, keys.data() + row * d);
      DequantizeFp8Row(stored_values + row * value_row, dv, value_row, values.data() + row * dv);
    }
  }
  Problem dense = p;
  dense.pages = nullptr;
  dense.key = TensorView{keys.data(), DType::kFloat32};
  dense.value = TensorView{values.data(), DType::kFloat32};
  dense.tree_first = dense.tree_count = 0;
  dense.tree_ancestors = nullptr;
  const absl::Span<const int32_t> parents(sent.tree_parents().data(), sent.tree_parents_size());
  const std::vector<RowRef> rows = AllRows(s);
  std::vector<RowReference> refs;
  for (const RowRef& row : rows) refs.push_back(ReferenceRow(dense, row, parents));

  // Decode, and Tiled on the same problem: what Decode runs past kDecodeGemmMaxRows rows.
  for (const bool decode_kernel : {true, false}) {
    const std::string where =
        absl::StrFormat("%s over a %scache of %d tokens (%d kept, %d new)%s",
                        decode_kernel ? "Decode" : "Tiled", l.values_from_keys ? "latent " : "",
                        length, kept, n, p.tree_count > 0 ? " with a token tree" : "");
    v1::Tensor output, lse;
    const Outputs outputs = PrepareOutputs(p, sent.query(), &output, p.return_lse ? &lse : nullptr);
    // All-ones bytes are NaN in every dtype, so an element left unwritten fails its row's check.
    std::memset(output.mutable_data()->data(), 0xff, output.data().size());
    if (p.return_lse) std::memset(lse.mutable_data()->data(), 0xff, lse.data().size());
    const absl::StatusOr<Stats> stats =
        decode_kernel ? PagedCpu().Decode({p}, {outputs}) : PagedCpu().Tiled(p, outputs);
    if (!stats.ok()) {
      Fail(absl::StrCat(where, " failed with ", stats.status().ToString(), " on ", Describe(p)));
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      const int64_t offset = p.OutputOffset(rows[r].batch, rows[r].head, rows[r].row);
      ExpectRowMatches(
          where, dense, rows[r], refs[r], p.output_dtype,
          [&](int64_t c) { return LoadElement(output.data().data(), p.output_dtype, offset + c); },
          p.return_lse ? outputs.lse + r : nullptr);
    }
  }
}

// Checks one TileStep of a row against the contract in attention.proto.
void ExpectStepMatches(const Problem& p, const RowRef& row, const RowReference& ref, int64_t tile,
                       const TraceStep& step) {
  auto fail = [&](const std::string& what) {
    Fail(absl::StrFormat("Trace: row (batch %d, head %d, row %d) of %s, tile %d: %s", row.batch,
                         row.head, row.row, Describe(p), tile, what));
  };
  const int64_t key_begin = tile * p.block_k;
  const int64_t key_end = std::min<int64_t>(key_begin + p.block_k, p.shape.key_len);
  const size_t n = static_cast<size_t>(key_end - key_begin);
  const size_t dv = static_cast<size_t>(p.shape.value_dim);
  if (step.row.batch != row.batch || step.row.head != row.head || step.row.row != row.row ||
      step.tile != tile || step.key_begin != key_begin || step.key_end != key_end) {
    fail(absl::StrFormat(
        "step for row (%d, %d, %d), tile %d, keys [%d, %d); expected keys [%d, %d)", step.row.batch,
        step.row.head, step.row.row, step.tile, step.key_begin, step.key_end, key_begin, key_end));
  }
  if (step.scores.size() != n || step.weights.size() != n || step.accumulator.size() != dv ||
      step.estimate.size() != dv) {
    fail(
        absl::StrFormat("%d scores, %d weights, %d accumulators, %d estimates; expected %d, %d, "
                        "%d, %d",
                        step.scores.size(), step.weights.size(), step.accumulator.size(),
                        step.estimate.size(), n, n, dv, dv));
  }
  for (size_t j = 0; j < n; ++j) {
    if (!ref.visible.Contains(key_begin + static_cast<int64_t>(j)) &&
        !(std::isinf(step.scores[j]) && step.scores[j] < 0 && step.weights[j] == 0.f)) {
      fail(absl::StrCat("masked key ", key_begin + j, " has score ", step.scores[j], " and weight ",
                        step.weights[j], "; expected -inf and 0"));
    }
  }
  if (!ref.tame) return;
  if (tile == p.VisitedTiles(row.row).begin &&
      !(std::isinf(step.max_before) && step.max_before < 0 && step.rescale == 0.f)) {
    fail(absl::StrCat("first tile: max_before ", step.max_before, ", rescale ", step.rescale,
                      "; expected -inf and 0"));
  }
  float max_after = step.max_before;
  for (float score : step.scores) max_after = std::max(max_after, score);
  if (step.max_after != max_after) {
    fail(absl::StrCat("max_after ", step.max_after,
                      "; expected max(max_before, scores) = ", max_after));
  }
}

void FuzzTrace(const v1::TraceRequest& request) {
  if (!request.has_attention()) return;  // The service refuses it before validation.
  Backend& backend = Cpu();
  const absl::StatusOr<Problem> problem =
      ParseAttentionRequest(request.attention(), backend.default_block_k());
  if (!problem.ok()) {
    ExpectRefusal("ParseAttentionRequest", problem.status());
    return;
  }
  ExpectInvariants(*problem);
  const Problem& p = *problem;
  absl::StatusOr<std::vector<RowRef>> rows = ParseTraceRows(request, p, TraceLimits{});
  if (!rows.ok()) {
    ExpectRefusal("ParseTraceRows", rows.status());
    return;
  }
  if (rows->empty()) Fail(absl::StrCat("ParseTraceRows accepted no rows for ", Describe(p)));
  if (Work(p, static_cast<double>(rows->size())) > kMaxWork) return;

  const v1::TraceStart start = EncodeTraceStart(p);
  if (start.tiles_per_row() != p.TilesPerRow() ||
      start.tiled_scratch_floats_per_row() != p.block_k + p.shape.value_dim + 2 ||
      start.naive_intermediate_bytes() != p.NaiveIntermediateBytes()) {
    Fail(absl::StrCat("TraceStart ", start.ShortDebugString(), " disagrees with ", Describe(p)));
  }
  const std::vector<RowRef> traced = *rows;
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend.Trace(p, *std::move(rows));
  if (!cursor.ok()) {
    Fail(absl::StrCat("Trace failed with ", cursor.status().ToString(), " on ", Describe(p)));
  }

  // Drain the cursor as the service's writer does, following each row's expected events.
  v1::TraceEvent event;
  for (const RowRef& row : traced) {
    const RowReference ref = ReferenceRow(p, row);
    const KeyRange visited = p.VisitedTiles(row.row);
    const int64_t tiles = visited.size();
    TraceItem item;
    std::vector<float> estimate;
    for (int64_t tile = 0; tile <= tiles; ++tile) {
      if (!(*cursor)->Next(&item)) {
        Fail(absl::StrFormat("Trace ended early: row (%d, %d, %d) has %d of %d steps, %s",
                             row.batch, row.head, row.row, tile, tiles, Describe(p)));
      }
      EncodeTraceItem(item, &event);
      const bool is_step = std::holds_alternative<TraceStep>(item);
      if (is_step != (tile < tiles)) {
        Fail(absl::StrFormat(
            "Trace: row (%d, %d, %d) has a %s after %d steps; it visits %d tiles, "
            "%s",
            row.batch, row.head, row.row, is_step ? "step" : "RowDone", tile, tiles, Describe(p)));
      }
      if (is_step) {
        const TraceStep& step = std::get<TraceStep>(item);
        ExpectStepMatches(p, row, ref, visited.begin + tile, step);
        estimate = step.estimate;
      }
    }
    const TraceRowDone& done = std::get<TraceRowDone>(item);
    const size_t dv = static_cast<size_t>(p.shape.value_dim);
    if (done.row.batch != row.batch || done.row.head != row.head || done.row.row != row.row ||
        done.output.size() != dv || done.reference.size() != dv) {
      Fail(
          absl::StrFormat("Trace: RowDone for row (%d, %d, %d) with %d outputs and %d reference "
                          "values; expected row (%d, %d, %d) and %d, %s",
                          done.row.batch, done.row.head, done.row.row, done.output.size(),
                          done.reference.size(), row.batch, row.head, row.row, dv, Describe(p)));
    }
    ExpectRowMatches(
        "Trace output", p, row, ref, DType::kFloat32, [&](int64_t c) { return done.output[c]; },
        &done.lse);
    ExpectRowMatches(
        "Trace reference", p, row, ref, DType::kFloat32,
        [&](int64_t c) { return done.reference[c]; }, nullptr);
    if (tiles > 0) {  // Steps never include the sink: the last estimate is the keys' alone.
      Problem keys_only = p;
      keys_only.sinks = nullptr;
      ExpectRowMatches(
          "Trace last estimate", keys_only, row,
          p.sinks == nullptr ? ref : ReferenceRow(keys_only, row), DType::kFloat32,
          [&](int64_t c) { return estimate[c]; }, nullptr);
    }
    if (ref.tame) {
      float max_abs_error = 0;
      for (size_t c = 0; c < dv; ++c) {
        max_abs_error = std::max(max_abs_error, std::abs(done.output[c] - done.reference[c]));
      }
      if (!(std::abs(done.max_abs_error - max_abs_error) <= 1e-6f * max_abs_error)) {
        Fail(absl::StrCat("Trace: RowDone.max_abs_error ", done.max_abs_error,
                          "; max |output − reference| is ", max_abs_error, ", ", Describe(p)));
      }
    }
  }
  TraceItem extra;
  if ((*cursor)->Next(&extra)) Fail(absl::StrCat("Trace went on past its last row, ", Describe(p)));
}

}  // namespace
}  // namespace attn

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (attn::KindOf(data[0])) {
    case attn::InputKind::kAttention: {
      attention::v1::AttentionRequest request;
      if (request.ParseFromArray(data + 1, static_cast<int>(size - 1))) {
        attn::FuzzAttention(request);
      }
      break;
    }
    case attn::InputKind::kTrace: {
      attention::v1::TraceRequest request;
      if (request.ParseFromArray(data + 1, static_cast<int>(size - 1))) attn::FuzzTrace(request);
      break;
    }
    case attn::InputKind::kCacheStep: {
      attention::v1::CreateCacheRequest create;
      attention::v1::DecodeRequest decode;
      if (attn::ParseCacheStep(data + 1, size - 1, &create, &decode)) {
        attn::FuzzCacheStep(create, decode);
      }
      break;
    }
  }
  return 0;
}
