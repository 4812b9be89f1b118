#include "server/request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "proto/dtype_mapping.h"
#include "proto/tensor_shape.h"
#include "server/value_scan.h"

namespace attn {
namespace {

namespace v1 = attention::v1;

absl::Status Invalid(absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

// A tensor's dtype field that is not one of the three storage types (a cache's may also be
// DTYPE_FLOAT8_E4M3: `cache`).
absl::Status UnknownDType(absl::string_view field, v1::DType dtype, bool cache = false) {
  if (dtype == v1::DTYPE_FLOAT8_E4M3 && !cache) {
    return Invalid(field,
                   "is DTYPE_FLOAT8_E4M3, a KV cache's dtype only (CreateCacheRequest.dtype); "
                   "send DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16 (an fp8 cache quantizes "
                   "the tokens it is sent)");
  }
  return Invalid(field, absl::StrCat(dtype == v1::DTYPE_UNSPECIFIED
                                         ? "is unspecified"
                                         : absl::StrCat("is ", dtype, ", not a known DType"),
                                     "; expected DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16",
                                     cache ? " (or DTYPE_FLOAT8_E4M3 for a cache)" : ""));
}

// At most the first 8 dimensions: a hostile rank must not make a message of megabytes (gRPC
// would refuse to send it as trailing metadata).
std::string ShapeString(const v1::Tensor& tensor) {
  constexpr int kShown = 8;
  const int rank = tensor.shape_size();
  if (rank <= kShown) return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
  return absl::StrCat("[",
                      absl::StrJoin(tensor.shape().begin(), tensor.shape().begin() + kShown, ", "),
                      ", … ", rank - kShown, " more]");
}

// The largest tile: a block_k above it means this (and above key_len, key_len). 128 rows ×
// 65536 fp32 scores are 32 MiB of a CPU worker's scratch.
constexpr int kMaxBlockK = 1 << 16;

// a·b, or nullopt when it overflows int64.
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// Checks one input tensor's form: present, rank 2..4, positive dims, a known dtype, data of
// exactly the right length (its values: CheckValues).
absl::StatusOr<TensorDims> CheckTensor(absl::string_view name, bool present,
                                       const v1::Tensor& tensor, DType* dtype) {
  if (!present) return Invalid(name, "is required");
  if (tensor.has_shared_memory()) {  // Resolved before parsing where a call takes it.
    return Invalid(absl::StrCat(name, ".shared_memory"),
                   "this call takes its tensors inline (shared memory: Naive, Tiled, AppendCache "
                   "and Decode)");
  }
  const int rank = tensor.shape_size();
  if (rank < 2 || rank > 4) {
    return Invalid(absl::StrCat(name, ".shape"),
                   absl::StrCat("has rank ", rank, " (", ShapeString(tensor),
                                "); expected 2 [seq, dim], 3 [heads, seq, dim] or 4 [batch, "
                                "heads, seq, dim]"));
  }
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t dim = tensor.shape(i);
    if (dim < 1) {
      return Invalid(absl::StrCat(name, ".shape[", i, "]"),
                     absl::StrCat("is ", dim, "; every dimension must be ≥ 1"));
    }
    const std::optional<int64_t> product = CheckedMul(elements, dim);
    if (!product) {
      return Invalid(absl::StrCat(name, ".shape"),
                     absl::StrCat(ShapeString(tensor), " has more elements than int64 can count"));
    }
    elements = *product;
  }
  const std::optional<DType> parsed = FromProtoDType(tensor.dtype());
  if (!parsed) return UnknownDType(absl::StrCat(name, ".dtype"), tensor.dtype());
  *dtype = *parsed;
  const std::optional<int64_t> bytes = CheckedMul(elements, ElementSize(*dtype));
  if (!bytes || static_cast<int64_t>(tensor.data().size()) != *bytes) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrCat("has ", tensor.data().size(), " bytes; shape ", ShapeString(tensor),
                                " of ", DTypeName(*dtype), " needs ",
                                bytes ? absl::StrCat(*bytes) : "more than int64 can count"));
  }
  return *NormalizedShape(tensor);  // The rank is 2, 3 or 4.
}

// Scans one input tensor's elements: all finite. Returns the largest |element|.
absl::StatusOr<double> CheckValues(absl::string_view name, const TensorView& tensor,
                                   int64_t elements) {
  const ValueScan scan = ScanValues(tensor.data, tensor.dtype, elements);
  if (scan.first_non_finite >= 0) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrCat("element ", scan.first_non_finite, " is ", scan.non_finite_value,
                                "; inputs must be finite"));
  }
  return scan.max_abs;
}

absl::Status Mismatch(absl::string_view field, absl::string_view what, int64_t got,
                      absl::string_view other, int64_t expected) {
  return Invalid(field, absl::StrCat(what, " is ", got, " but ", other, " is ", expected,
                                     "; they must match"));
}

float DefaultScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

// The options every attention call shares, into *problem: scale (when given; else the caller
// sets 1/sqrt(head_dim)), causal, positions, windows, softcap, ALiBi slopes and sinks (one per
// query head: `heads`, of the query named prefix + "query"; the problem points at the request's),
// block_k (the default for 0; the caller caps it at key_len), return_lse, output_dtype (the query's
// for DTYPE_UNSPECIFIED).
absl::Status ParseOptions(absl::string_view prefix, const v1::AttentionOptions& options,
                          DType query_dtype, int64_t heads, int default_block_k, Problem* problem) {
  if (options.has_scale() && !std::isfinite(options.scale())) {
    return Invalid(absl::StrCat(prefix, "options.scale"),
                   absl::StrCat("is ", options.scale(), "; it must be finite"));
  }
  if (options.block_k() < 0) {
    return Invalid(absl::StrCat(prefix, "options.block_k"),
                   absl::StrCat("is ", options.block_k(), "; expected ≥ 0 (0 = server default)"));
  }
  problem->output_dtype = query_dtype;
  if (options.output_dtype() != v1::DTYPE_UNSPECIFIED) {
    const std::optional<DType> parsed = FromProtoDType(options.output_dtype());
    if (!parsed) {
      return Invalid(absl::StrCat(prefix, "options.output_dtype"),
                     absl::StrCat("is ", options.output_dtype(),
                                  options.output_dtype() == v1::DTYPE_FLOAT8_E4M3
                                      ? " (DTYPE_FLOAT8_E4M3, a KV cache's dtype only)"
                                      : ", not a known DType",
                                  "; expected DTYPE_UNSPECIFIED (the query's "
                                  "dtype), DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"));
    }
    problem->output_dtype = *parsed;
  }
  if (absl::Status positions = ParsePositions(
          absl::StrCat(prefix, "options."), options.key_position(),
          options.has_query_position() ? std::optional<int64_t>(options.query_position())
                                       : std::nullopt,
          problem);
      !positions.ok()) {
    return positions;
  }
  for (const auto& [field, set, value, side] :
       {std::tuple{"window_left", options.has_window_left(), options.window_left(),
                   &problem->window_left},
        std::tuple{"window_right", options.has_window_right(), options.window_right(),
                   &problem->window_right}}) {
    if (!set) continue;  // Unbounded.
    if (value < 0 || value > kMaxPosition) {
      return Invalid(
          absl::StrCat(prefix, "options.", field),
          absl::StrCat("is ", value, "; a window must be in [0, 2^62] (absent = unbounded)"));
    }
    *side = value;
  }
  if (!std::isfinite(options.softcap()) || options.softcap() < 0.f) {
    return Invalid(
        absl::StrCat(prefix, "options.softcap"),
        absl::StrCat("is ", options.softcap(), "; a softcap must be finite and ≥ 0 (0 = off)"));
  }
  problem->softcap = options.softcap();
  // ALiBi slopes and sinks: empty, or one finite value per query head.
  for (const auto& [name, what, values, into] :
       {std::tuple{"alibi_slopes", "slope", &options.alibi_slopes(), &problem->alibi_slopes},
        std::tuple{"sinks", "sink", &options.sinks(), &problem->sinks}}) {
    if (values->empty()) continue;
    const std::string field = absl::StrCat(prefix, "options.", name);
    if (values->size() != heads) {
      return Invalid(
          field, absl::StrCat("has ", values->size(), " values but ", prefix, "query has ", heads,
                              " heads; give one ", what, " per query head (or none)"));
    }
    for (int h = 0; h < values->size(); ++h) {
      if (!std::isfinite(values->Get(h))) {
        return Invalid(absl::StrCat(field, "[", h, "]"),
                       absl::StrCat("is ", values->Get(h), "; a ", what, " must be finite"));
      }
    }
    *into = values->data();
  }
  if (options.has_scale()) problem->scale = options.scale();
  problem->causal = options.causal();
  // Capped: a tile's scratch is a block of rows × block_k scores per worker, which a huge
  // block_k over a long, narrow key would make many times the request's size.
  problem->block_k =
      std::min(options.block_k() > 0 ? options.block_k() : default_block_k, kMaxBlockK);
  problem->return_lse = options.return_lse();
  return absl::OkStatus();
}

// Every score and partial sum of q·k (scaled or not) is at most head_dim·max|q|·max|k|·
// max(1, |scale|), an ALiBi bias at most max|slope|·max|p − t|, and every weighted sum of values
// at most key_len·max|v|: all must stay within fp32, or the kernels would meet inf − inf and
// answer NaN. `query`, `key` and `value` name the fields whose elements are meant; `options` the
// options' prefix.
absl::Status CheckBounds(const Problem& problem, double max_q, double max_k, double max_v,
                         absl::string_view query, absl::string_view key, absl::string_view value,
                         absl::string_view options) {
  const Shape& s = problem.shape;
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  const double score_bound = static_cast<double>(s.head_dim) * max_q * max_k *
                             std::max(1.0, std::abs(static_cast<double>(problem.scale)));
  if (score_bound > kFloatMax) {
    return Invalid(
        absl::StrCat(query, "/", key),
        absl::StrCat("max |query| = ", max_q, " and max |key| = ", max_k, " with head_dim ",
                     s.head_dim, " and scale ", problem.scale, " allow scores up to ", score_bound,
                     ", past fp32's largest value ", kFloatMax, "; scale the inputs down"));
  }
  // Over an fp8 cache the decode kernel sums q · codes (each code at most 448, read as 2^-8 of
  // it: kernels/cpu/decode_kernels.inc) before a key's scale: that sum must stay finite too.
  if (problem.pages != nullptr && problem.pages->dtype == DType::kFloat8E4M3 &&
      static_cast<double>(s.head_dim) * max_q * 1.75 > kFloatMax) {
    return Invalid(query, absl::StrCat("max |query| = ", max_q, " with head_dim ", s.head_dim,
                                       " passes what a dot product with an fp8 cache's codes may "
                                       "reach in fp32 before the keys' scales; scale it down"));
  }
  if (problem.alibi_slopes != nullptr) {
    // |p − t| is largest at a corner of a sequence's (row, key) grid: it is linear in row − key.
    const Geometry g = problem.geometry();
    double distance = 0;
    for (int64_t sequence = 0; sequence < std::max<int64_t>(g.sequences, 1); ++sequence) {
      int64_t first_row, first_key;
      const Geometry own = g.Sequence(sequence, first_row, first_key);
      if (own.query_len == 0 || own.key_len == 0) continue;
      distance =
          std::max({distance, std::abs(static_cast<double>(own.Distance(0, own.key_len - 1))),
                    std::abs(static_cast<double>(own.Distance(own.query_len - 1, 0)))});
    }
    double slope = 0;
    for (int64_t h = 0; h < s.heads; ++h) {
      slope = std::max(slope, std::abs(static_cast<double>(problem.alibi_slopes[h])));
    }
    if (score_bound + slope * distance > kFloatMax) {
      return Invalid(
          absl::StrCat(options, "options.alibi_slopes"),
          absl::StrCat("max |slope| = ", slope, " over distances up to ", distance,
                       " allows biases up to ", slope * distance, ", which with scores up to ",
                       score_bound, " pass fp32's largest value ", kFloatMax));
    }
  }
  if (static_cast<double>(s.key_len) * max_v > kFloatMax) {
    return Invalid(value, absl::StrCat("max |value| = ", max_v, " over key_len ", s.key_len,
                                       " keys can sum past fp32's largest value ", kFloatMax,
                                       "; scale the values down"));
  }
  return absl::OkStatus();
}

// A ragged batch's cumulative lengths (AttentionRequest.cu_seqlens_q, cu_seqlens_k) into
// *problem, whose shape (batch 1, the packed query_len and key_len) and positions are parsed.
absl::Status ParseSequences(const v1::AttentionRequest& request, int rank, Problem* problem) {
  const auto& q = request.cu_seqlens_q();
  const auto& k = request.cu_seqlens_k();
  if (q.empty() && k.empty()) return absl::OkStatus();
  if (q.size() != k.size()) {
    return Invalid(q.empty() ? "cu_seqlens_q" : "cu_seqlens_k",
                   absl::StrCat("has ", q.empty() ? 0 : k.size(), " entries but ",
                                q.empty() ? "cu_seqlens_k" : "cu_seqlens_q", " has ",
                                q.empty() ? k.size() : q.size(),
                                "; a ragged batch of S sequences gives both, S + 1 each"));
  }
  if (q.size() < 2) {
    return Invalid("cu_seqlens_q",
                   "has 1 entry; a ragged batch of S ≥ 1 sequences gives S + 1 cumulative "
                   "lengths, from 0 to the packed length");
  }
  if (problem->shape.batch != 1) {
    return Invalid("query.shape[0]",
                   absl::StrCat("is batch ", problem->shape.batch,
                                "; a ragged batch (cu_seqlens_q) packs its sequences into one: "
                                "query [heads, total_q, head_dim]"));
  }
  for (const auto& [field, set] :
       {std::pair{"options.key_position", problem->key_position != 0},
        std::pair{"options.query_position", problem->query_position.has_value()}}) {
    if (set) {
      return Invalid(field,
                     "is set; in a ragged batch (cu_seqlens_q) each sequence has its own "
                     "positions: its keys at 0 …, its queries bottom-right");
    }
  }
  for (const auto& [field, values, total, what] :
       {std::tuple{"cu_seqlens_q", &q, problem->shape.query_len,
                   absl::StrCat("query has ", problem->shape.query_len, " rows (query.shape[",
                                rank - 2, "])")},
        std::tuple{"cu_seqlens_k", &k, problem->shape.key_len,
                   absl::StrCat("key has ", problem->shape.key_len, " keys (key.shape[", rank - 2,
                                "])")}}) {
    if ((*values)[0] != 0) {
      return Invalid(absl::StrCat(field, "[0]"),
                     absl::StrCat("is ", (*values)[0], "; cumulative lengths start at 0"));
    }
    for (int i = 1; i < values->size(); ++i) {
      if ((*values)[i] < (*values)[i - 1]) {
        return Invalid(absl::StrCat(field, "[", i, "]"),
                       absl::StrCat("is ", (*values)[i], ", less than ", field, "[", i - 1, "] = ",
                                    (*values)[i - 1], "; cumulative lengths never decrease"));
      }
    }
    const int last = values->size() - 1;
    if ((*values)[last] != total) {
      return Invalid(absl::StrCat(field, "[", last, "]"),
                     absl::StrCat("is ", (*values)[last], " but ", what,
                                  "; the last cumulative length is the packed length"));
    }
  }
  problem->cu_seqlens_q = q.data();
  problem->cu_seqlens_k = k.data();
  problem->sequences = q.size() - 1;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckOneSequence(absl::string_view prefix, const v1::AttentionRequest& request) {
  if (request.cu_seqlens_q().empty() && request.cu_seqlens_k().empty()) return absl::OkStatus();
  return Invalid(
      absl::StrCat(prefix, request.cu_seqlens_q().empty() ? "cu_seqlens_k" : "cu_seqlens_q"),
      "is set with cache_id; a cache holds one sequence (send a ragged batch's keys "
      "and values inline)");
}

absl::Status CheckNoInlineKeys(const v1::AttentionRequest& request) {
  if (request.has_key() || request.has_value()) {
    return Invalid(request.has_key() ? "key" : "value",
                   "must be absent when cache_id names a cache (its keys and values are the "
                   "cache's)");
  }
  return absl::OkStatus();
}

absl::Status ParsePositions(absl::string_view prefix, int64_t key_position,
                            std::optional<int64_t> query_position, Problem* problem) {
  const auto check = [&](absl::string_view field, int64_t position) {
    if (position >= 0 && position <= kMaxPosition) return absl::OkStatus();
    return Invalid(absl::StrCat(prefix, field),
                   absl::StrCat("is ", position, "; a position must be in [0, 2^62]"));
  };
  if (absl::Status key = check("key_position", key_position); !key.ok()) return key;
  if (query_position) {
    if (absl::Status query = check("query_position", *query_position); !query.ok()) return query;
  }
  problem->key_position = key_position;
  problem->query_position = query_position;
  return absl::OkStatus();
}

absl::StatusOr<Problem> ParseAttentionShape(const v1::AttentionRequest& request,
                                            int default_block_k) {
  Problem problem;
  DType query_dtype, key_dtype, value_dtype;
  const absl::StatusOr<TensorDims> q =
      CheckTensor("query", request.has_query(), request.query(), &query_dtype);
  if (!q.ok()) return q.status();
  const absl::StatusOr<TensorDims> k =
      CheckTensor("key", request.has_key(), request.key(), &key_dtype);
  if (!k.ok()) return k.status();
  const absl::StatusOr<TensorDims> v =
      CheckTensor("value", request.has_value(), request.value(), &value_dtype);
  if (!v.ok()) return v.status();

  const int rank = request.query().shape_size();
  if (request.key().shape_size() != rank || request.value().shape_size() != rank) {
    return Invalid("key.shape/value.shape",
                   absl::StrCat("ranks are ", request.key().shape_size(), " and ",
                                request.value().shape_size(), " but query.shape has rank ", rank,
                                "; all three tensors must have the same rank"));
  }
  if (k->batch != q->batch) return Mismatch("key.shape[0]", "batch", k->batch, "query's", q->batch);
  if (v->batch != q->batch) {
    return Mismatch("value.shape[0]", "batch", v->batch, "query's", q->batch);
  }
  const int heads_axis = rank - 3;
  if (v->heads != k->heads) {
    return Mismatch(absl::StrCat("value.shape[", heads_axis, "]"), "heads", v->heads, "key's",
                    k->heads);
  }
  if (q->heads % k->heads != 0) {
    return Invalid(
        absl::StrCat("key.shape[", heads_axis, "]"),
        absl::StrCat("has ", k->heads, " heads, which does not divide query's ", q->heads,
                     " heads (grouped-query attention needs query heads to "
                     "be a multiple of key/value heads)"));
  }
  if (v->len != k->len) {
    return Mismatch(absl::StrCat("value.shape[", rank - 2, "]"), "key_len", v->len, "key's",
                    k->len);
  }
  if (k->dim != q->dim) {
    return Mismatch(absl::StrCat("key.shape[", rank - 1, "]"), "head_dim", k->dim, "query's",
                    q->dim);
  }
  // Naive's accounting, 16·B·H·Nq·Nk, must be countable; so then is every smaller product.
  std::optional<int64_t> pairs = CheckedMul(q->batch * q->heads, q->len);
  if (pairs) pairs = CheckedMul(*pairs, k->len);
  if (pairs) pairs = CheckedMul(*pairs, 16);
  if (!pairs) {
    return Invalid("query.shape/key.shape",
                   "batch·heads·query_len·key_len is too large to account for in int64 bytes");
  }

  if (absl::Status options =
          ParseOptions("", request.options(), query_dtype, q->heads, default_block_k, &problem);
      !options.ok()) {
    return options;
  }
  problem.shape = Shape{.batch = q->batch,
                        .heads = q->heads,
                        .kv_heads = k->heads,
                        .query_len = q->len,
                        .key_len = k->len,
                        .head_dim = q->dim,
                        .value_dim = v->dim};
  if (absl::Status sequences = ParseSequences(request, rank, &problem); !sequences.ok()) {
    return sequences;
  }
  problem.query = TensorView{request.query().data().data(), query_dtype};
  problem.key = TensorView{request.key().data().data(), key_dtype};
  problem.value = TensorView{request.value().data().data(), value_dtype};
  if (!request.options().has_scale()) problem.scale = DefaultScale(q->dim);
  problem.block_k = static_cast<int>(std::min<int64_t>(problem.block_k, k->len));
  return problem;
}

absl::Status CheckAttentionValues(const Problem& problem) {
  const Shape& s = problem.shape;
  const absl::StatusOr<double> q =
      CheckValues("query", problem.query, s.batch * s.heads * s.query_len * s.head_dim);
  if (!q.ok()) return q.status();
  const absl::StatusOr<double> k =
      CheckValues("key", problem.key, s.batch * s.kv_heads * s.key_len * s.head_dim);
  if (!k.ok()) return k.status();
  const absl::StatusOr<double> v =
      CheckValues("value", problem.value, s.batch * s.kv_heads * s.key_len * s.value_dim);
  if (!v.ok()) return v.status();
  return CheckBounds(problem, *q, *k, *v, "query.data", "key.data", "value.data", "");
}

absl::StatusOr<Problem> ParseAttentionRequest(const v1::AttentionRequest& request,
                                              int default_block_k) {
  absl::StatusOr<Problem> problem = ParseAttentionShape(request, default_block_k);
  if (!problem.ok()) return problem;
  if (absl::Status values = CheckAttentionValues(*problem); !values.ok()) return values;
  return problem;
}

absl::Status CheckExpectedLength(absl::string_view prefix, int64_t expected,
                                 absl::string_view cache_id, int64_t length) {
  if (expected < 0) {
    return Invalid(absl::StrCat(prefix, "expected_length"),
                   absl::StrCat("is ", expected, "; expected the cache's length (≥ 0)"));
  }
  if (length < 0 || expected == length) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(prefix, "expected_length: is ", expected,
                                                    " but cache ", cache_id, " holds ", length,
                                                    " tokens; nothing of this call was applied"));
}

absl::Status CheckCutLength(absl::string_view prefix, absl::string_view field, int64_t length,
                            int64_t length_now) {
  if (length < 0) {
    return Invalid(absl::StrCat(prefix, field),
                   absl::StrCat("is ", length, "; expected the tokens to keep (≥ 0)"));
  }
  if (length_now < 0 || length <= length_now) return absl::OkStatus();
  return absl::OutOfRangeError(
      absl::StrCat(prefix, field, ": is ", length, " but the cache holds ", length_now,
                   " tokens; a cut or a fork keeps a prefix, at most all of them"));
}

absl::Status CheckDecodeCut(absl::string_view prefix, int64_t truncate_to, int64_t length_now,
                            const KvLayout& layout) {
  if (absl::Status cut = CheckCutLength(prefix, "truncate_to", truncate_to, length_now);
      !cut.ok()) {
    return cut;
  }
  const int64_t most = kMaxDecodeCutBytes / TokenBytes(layout);
  if (length_now - truncate_to <= most) return absl::OkStatus();
  return Invalid(
      absl::StrCat(prefix, "truncate_to"),
      absl::StrCat("is ", truncate_to, ", dropping ", length_now - truncate_to, " of the cache's ",
                   length_now, " tokens; a Decode item drops at most ", most, " (",
                   kMaxDecodeCutBytes >> 20, " MiB of them): cut more with TruncateCache"));
}

absl::StatusOr<KvLayout> CheckCacheLayout(int64_t kv_heads, int64_t head_dim, int64_t value_dim,
                                          int dtype_number, bool values_from_keys) {
  constexpr int64_t kMaxDim = 1 << 16;
  KvLayout layout;
  const std::pair<absl::string_view, int64_t> dims[] = {
      {"kv_heads", kv_heads}, {"head_dim", head_dim}, {"value_dim", value_dim}};
  for (const auto& [field, value] : dims) {
    const int64_t low = field == "value_dim" ? 0 : 1;
    if (value < low || value > kMaxDim) {
      return Invalid(field, absl::StrCat("is ", value, "; expected ", low, " ≤ ", field, " ≤ ",
                                         kMaxDim, field == "value_dim" ? " (0 = head_dim)" : ""));
    }
  }
  layout.kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.value_dim = value_dim > 0 ? value_dim : head_dim;
  layout.values_from_keys = values_from_keys;
  if (values_from_keys && layout.value_dim > head_dim) {
    return Invalid("value_dim",
                   absl::StrCat("is ", value_dim, " but head_dim is ", head_dim,
                                "; a latent cache (values_from_keys) takes each value from the "
                                "first value_dim columns of its key, so value_dim ≤ head_dim"));
  }
  const std::optional<DType> dtype = FromProtoCacheDType(dtype_number);
  if (!dtype) return UnknownDType("dtype", static_cast<v1::DType>(dtype_number), /*cache=*/true);
  layout.dtype = *dtype;
  return layout;
}

absl::StatusOr<KvLayout> ParseCreateCache(const v1::CreateCacheRequest& request) {
  return CheckCacheLayout(request.kv_heads(), request.head_dim(), request.value_dim(),
                          request.dtype(), request.values_from_keys());
}

namespace {

// A cache-side tensor (query or new tokens): one sequence, so batch 1.
absl::StatusOr<TensorDims> CheckCacheTensor(const std::string& name, const v1::Tensor* tensor,
                                            DType* dtype) {
  absl::StatusOr<TensorDims> dims =
      CheckTensor(name, tensor != nullptr, tensor != nullptr ? *tensor : v1::Tensor(), dtype);
  if (dims.ok() && dims->batch != 1) {
    return Invalid(absl::StrCat(name, ".shape[0]"),
                   absl::StrCat("is ", dims->batch, "; a cache holds one sequence: batch 1"));
  }
  return dims;
}

}  // namespace

absl::StatusOr<NewTokens> ParseNewTokens(absl::string_view prefix, const v1::Tensor* key,
                                         const v1::Tensor* value, const KvLayout& layout,
                                         bool optional) {
  NewTokens tokens;
  if (optional && key == nullptr && value == nullptr) return tokens;
  const std::string key_name = absl::StrCat(prefix, "key"),
                    value_name = absl::StrCat(prefix, "value");
  DType key_dtype, value_dtype;
  if (layout.values_from_keys && value != nullptr) {
    return Invalid(value_name,
                   "is set, but this cache is latent (values_from_keys): each value is the first "
                   "value_dim columns of its key; send the key alone");
  }
  const absl::StatusOr<TensorDims> k = CheckCacheTensor(key_name, key, &key_dtype);
  if (!k.ok()) return k.status();
  // A latent cache's values are views of its keys: checked as the keys, with the keys' width.
  const v1::Tensor* value_tensor = layout.values_from_keys ? key : value;
  const absl::StatusOr<TensorDims> v =
      layout.values_from_keys ? k : CheckCacheTensor(value_name, value, &value_dtype);
  if (!v.ok()) return v.status();
  if (layout.values_from_keys) value_dtype = key_dtype;
  const int key_rank = key->shape_size(), value_rank = value_tensor->shape_size();
  const int64_t value_width = layout.values_from_keys ? layout.head_dim : layout.value_dim;
  const struct {
    const std::string& name;
    int rank;
    const TensorDims& dims;
    int64_t width;
    const char* width_name;
  } checks[] = {{key_name, key_rank, *k, layout.head_dim, "head_dim"},
                {value_name, value_rank, *v, value_width, "value_dim"}};
  for (const auto& check : checks) {
    const DType dtype = &check.name == &key_name ? key_dtype : value_dtype;
    // An fp8 cache quantizes tokens of any dtype; the others store what they are sent.
    if (dtype != layout.dtype && layout.dtype != DType::kFloat8E4M3) {
      return Invalid(absl::StrCat(check.name, ".dtype"),
                     absl::StrCat("is ", DTypeName(dtype), " but the cache stores ",
                                  DTypeName(layout.dtype), "; send tokens in the cache's dtype"));
    }
    if (check.dims.heads != layout.kv_heads) {
      return Invalid(absl::StrCat(check.name, ".shape"),
                     absl::StrCat("has ", check.dims.heads, " heads but the cache has ",
                                  layout.kv_heads, " kv_heads; they must match"));
    }
    if (check.dims.dim != check.width) {
      return Mismatch(absl::StrCat(check.name, ".shape[", check.rank - 1, "]"), check.width_name,
                      check.dims.dim, "the cache's", check.width);
    }
  }
  if (v->len != k->len) {
    return Mismatch(absl::StrCat(value_name, ".shape[", value_rank - 2, "]"), "tokens", v->len,
                    absl::StrCat(key_name, "'s"), k->len);
  }
  tokens.key = TensorView{key->data().data(), key_dtype};
  tokens.value = layout.values_from_keys ? TensorView{nullptr, value_dtype}
                                         : TensorView{value->data().data(), value_dtype};
  tokens.n = k->len;
  return tokens;
}

absl::Status CheckNewTokenValues(absl::string_view prefix, const NewTokens& tokens,
                                 const KvLayout& layout, double* max_abs_key,
                                 double* max_abs_value) {
  *max_abs_key = *max_abs_value = 0;
  if (tokens.n == 0) return absl::OkStatus();
  const absl::StatusOr<double> k = CheckValues(absl::StrCat(prefix, "key"), tokens.key,
                                               layout.kv_heads * tokens.n * layout.head_dim);
  if (!k.ok()) return k.status();
  *max_abs_key = *max_abs_value = *k;  // A latent cache's values are within its keys.
  if (layout.values_from_keys) return absl::OkStatus();
  const absl::StatusOr<double> v = CheckValues(absl::StrCat(prefix, "value"), tokens.value,
                                               layout.kv_heads * tokens.n * layout.value_dim);
  if (!v.ok()) return v.status();
  *max_abs_value = *v;
  return absl::OkStatus();
}

absl::StatusOr<Problem> ParseCacheQuery(absl::string_view prefix, const v1::Tensor* query,
                                        const v1::AttentionOptions& options, const KvLayout& layout,
                                        int default_block_k) {
  const std::string name = absl::StrCat(prefix, "query");
  DType query_dtype;
  const absl::StatusOr<TensorDims> q = CheckCacheTensor(name, query, &query_dtype);
  if (!q.ok()) return q.status();
  const int rank = query->shape_size();
  if (q->heads % layout.kv_heads != 0) {
    return Invalid(absl::StrCat(name, ".shape"),
                   absl::StrCat("has ", q->heads, " heads, not a multiple of the cache's ",
                                layout.kv_heads, " kv_heads (grouped-query attention)"));
  }
  if (q->dim != layout.head_dim) {
    return Mismatch(absl::StrCat(name, ".shape[", rank - 1, "]"), "head_dim", q->dim, "the cache's",
                    layout.head_dim);
  }
  Problem problem;
  if (absl::Status parsed =
          ParseOptions(prefix, options, query_dtype, q->heads, default_block_k, &problem);
      !parsed.ok()) {
    return parsed;
  }
  problem.shape = Shape{.batch = 1,
                        .heads = q->heads,
                        .kv_heads = layout.kv_heads,
                        .query_len = q->len,
                        .key_len = 1,  // BindCache: the cache's length.
                        .head_dim = layout.head_dim,
                        .value_dim = layout.value_dim};
  problem.query = TensorView{query->data().data(), query_dtype};
  if (!options.has_scale()) problem.scale = DefaultScale(layout.head_dim);
  return problem;
}

absl::Status BindCache(absl::string_view prefix, const PagedKv& pages, int64_t length,
                       double max_abs_key, double max_abs_value, Problem* problem) {
  if (length < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        prefix, "cache_id: the cache holds no tokens yet; append some before attending"));
  }
  Shape& s = problem->shape;
  // Naive's accounting, 16·heads·query_len·key_len, must be countable.
  std::optional<int64_t> pairs = CheckedMul(s.heads * s.query_len, length);
  if (pairs) pairs = CheckedMul(*pairs, 16);
  if (!pairs) {
    return Invalid(absl::StrCat(prefix, "query.shape"),
                   "heads·query_len·cache length is too large to account for in int64 bytes");
  }
  s.key_len = length;
  problem->tree_first = length - problem->tree_count;  // A token tree's new tokens end the cache.
  problem->pages = &pages;
  problem->block_k = static_cast<int>(std::min<int64_t>(problem->block_k, length));
  const absl::StatusOr<double> q = CheckValues(absl::StrCat(prefix, "query"), problem->query,
                                               s.heads * s.query_len * s.head_dim);
  if (!q.ok()) return q.status();
  return CheckBounds(*problem, *q, max_abs_key, max_abs_value, absl::StrCat(prefix, "query.data"),
                     "the cache's keys", "the cache's values", prefix);
}

absl::StatusOr<std::vector<RowRef>> ParseTraceRows(const v1::TraceRequest& request,
                                                   const Problem& problem,
                                                   const TraceLimits& limits) {
  if (request.rows_size() > limits.max_rows) {
    return Invalid("rows", absl::StrCat("has ", request.rows_size(),
                                        " entries; this server traces at most --max-trace-rows=",
                                        limits.max_rows, " rows per call"));
  }
  std::vector<RowRef> rows;
  if (request.rows_size() == 0) rows.push_back(RowRef{});
  const Shape& s = problem.shape;
  for (int i = 0; i < request.rows_size(); ++i) {
    const v1::RowRef& row = request.rows(i);
    const std::pair<absl::string_view, std::pair<int64_t, int64_t>> checks[] = {
        {"batch", {row.batch(), s.batch}},
        {"head", {row.head(), s.heads}},
        {"row", {row.row(), s.query_len}}};
    for (const auto& [field, value_and_limit] : checks) {
      const auto [value, limit] = value_and_limit;
      if (value < 0 || value >= limit) {
        return Invalid(absl::StrCat("rows[", i, "].", field),
                       absl::StrCat("is ", value, "; expected 0 ≤ ", field, " < ", limit));
      }
    }
    rows.push_back(RowRef{row.batch(), row.head(), row.row()});
  }
  int64_t steps = 0;
  for (const RowRef& row : rows) steps += problem.VisitedTiles(row.row).size();
  if (steps > limits.max_steps) {
    return Invalid("rows", absl::StrCat("the trace would take ", steps, " steps (", rows.size(),
                                        " rows × tiles of block_k=", problem.block_k,
                                        " keys); this server allows --max-trace-steps=",
                                        limits.max_steps, ": raise block_k or trace fewer rows"));
  }
  return rows;
}

namespace {

constexpr int kMaxDecodeItems = 4096;

// Decode takes its positions per item, each cache having its own length: the options' key and
// query positions must be unset.
absl::Status CheckDecodeOptions(const v1::AttentionOptions& options) {
  for (const auto& [field, set] : {std::pair{"key_position", options.key_position() != 0},
                                   std::pair{"query_position", options.has_query_position()}}) {
    if (set) {
      return Invalid(absl::StrCat("options.", field),
                     absl::StrCat("is set; Decode takes positions per item (items[i].", field,
                                  "), since each item's cache has its own length"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDecodeItemCount(const v1::DecodeRequest& request) {
  if (request.items_size() == 0) {
    return Invalid("items", "is empty; a Decode call needs at least one DecodeItem");
  }
  if (request.items_size() > kMaxDecodeItems) {
    return Invalid("items", absl::StrCat("has ", request.items_size(), " entries; at most ",
                                         kMaxDecodeItems, " sequences per Decode call"));
  }
  return absl::OkStatus();
}

// A Decode item's tree_parents into parsed->tree (ancestor bitmasks) and problem.tree_count.
absl::Status ParseTokenTree(const v1::DecodeItem& item, DecodeItemProblem* parsed) {
  const int64_t n = item.tree_parents_size();
  if (n == 0) return absl::OkStatus();
  const std::string& prefix = parsed->prefix;
  const std::string field = absl::StrCat(prefix, "tree_parents");
  if (n > kMaxTreeTokens) {
    return Invalid(field, absl::StrCat("has ", n, " entries; a token tree has at most ",
                                       kMaxTreeTokens, " new tokens"));
  }
  if (n != parsed->tokens.n) {
    return Invalid(field, absl::StrCat("has ", n, " entries but the item appends ",
                                       parsed->tokens.n, " new tokens; one parent per new token"));
  }
  if (parsed->problem.shape.query_len != n) {
    return Invalid(
        absl::StrCat(prefix, "query"),
        absl::StrCat("has ", parsed->problem.shape.query_len, " rows but tree_parents has ", n,
                     " new tokens; a token tree takes one query row per new token"));
  }
  const int64_t words = (n + 63) / 64;
  parsed->tree.assign(n * words, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t parent = item.tree_parents(i);
    if (parent < -1 || parent >= i) {
      return Invalid(absl::StrCat(field, "[", i, "]"),
                     i == 0 ? absl::StrCat("is ", parent,
                                           "; expected −1: the first new token's parent is among "
                                           "the cached tokens")
                            : absl::StrCat("is ", parent,
                                           "; expected −1 (a child of the cached tokens) or an "
                                           "earlier new token, 0 … ",
                                           i - 1));
    }
    uint64_t* row = parsed->tree.data() + i * words;
    if (parent >= 0) std::copy_n(parsed->tree.data() + parent * words, words, row);
    row[i / 64] |= uint64_t{1} << (i % 64);
  }
  parsed->problem.tree_count = n;
  return absl::OkStatus();
}

absl::StatusOr<DecodeBatch> ParseDecodeRequest(const v1::DecodeRequest& request,
                                               CacheLayoutLookup layout_of, int default_block_k,
                                               int64_t max_message_bytes) {
  if (absl::Status options = CheckDecodeOptions(request.options()); !options.ok()) return options;
  DecodeBatch batch;
  std::map<std::string, int> item_of_cache;
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::DecodeItem& item = request.items(i);
    DecodeItemProblem parsed;
    parsed.prefix = absl::StrCat("items[", i, "].");
    const std::string& prefix = parsed.prefix;
    if (item.cache_id().empty()) return Invalid(absl::StrCat(prefix, "cache_id"), "is required");
    if (const auto [at, fresh] = item_of_cache.emplace(item.cache_id(), i); !fresh) {
      return Invalid(absl::StrCat(prefix, "cache_id"),
                     absl::StrCat("names the same cache as items[", at->second,
                                  "]; a Decode call takes at most one item per cache"));
    }
    if (absl::Status length = CheckExpectedLength(prefix, item.expected_length(), "", -1);
        !length.ok()) {
      return length;
    }
    absl::StatusOr<KvLayout> layout = layout_of(item.cache_id(), absl::StrCat(prefix, "cache_id"));
    if (!layout.ok()) return layout.status();
    parsed.layout = *layout;
    absl::StatusOr<Problem> problem =
        ParseCacheQuery(prefix, TensorOrNull(item.has_query(), item.query()), request.options(),
                        parsed.layout, default_block_k);
    if (!problem.ok()) return problem.status();
    parsed.problem = *problem;
    const int64_t item_reply = ReplyTensorBytes(parsed.problem);
    if (absl::Status reply =
            CheckReplyBytes(absl::StrCat(prefix, "query"), item_reply, max_message_bytes);
        !reply.ok()) {
      return reply;
    }
    batch.reply_bytes += item_reply;  // Each below 2^31: no overflow over kMaxDecodeItems.
    if (absl::Status reply = CheckReplyBytes("items", batch.reply_bytes, max_message_bytes);
        !reply.ok()) {
      return reply;
    }
    if (absl::Status positions =
            ParsePositions(prefix, item.key_position(),
                           item.has_query_position() ? std::optional<int64_t>(item.query_position())
                                                     : std::nullopt,
                           &parsed.problem);
        !positions.ok()) {
      return positions;
    }
    absl::StatusOr<NewTokens> tokens =
        ParseNewTokens(prefix, TensorOrNull(item.has_key(), item.key()),
                       TensorOrNull(item.has_value(), item.value()), parsed.layout, true);
    if (!tokens.ok()) return tokens.status();
    parsed.tokens = *tokens;
    if (item.has_truncate_to()) {
      if (absl::Status cut = CheckCutLength(prefix, "truncate_to", item.truncate_to(), -1);
          !cut.ok()) {
        return cut;
      }
      parsed.truncate_to = item.truncate_to();
    }
    if (absl::Status tree = ParseTokenTree(item, &parsed); !tree.ok()) return tree;
    batch.items.push_back(std::move(parsed));
  }
  return batch;
}

int64_t ReplyTensorBytes(const Problem& problem) {
  const std::optional<int64_t> output =
      CheckedMul(problem.OutputElements(), ElementSize(problem.output_dtype));
  const std::optional<int64_t> lse =
      problem.return_lse ? CheckedMul(problem.LseElements(), sizeof(float)) : 0;
  int64_t total;
  if (!output || !lse || __builtin_add_overflow(*output, *lse, &total)) {
    return std::numeric_limits<int64_t>::max();
  }
  return total;
}

absl::Status CheckReplyBytes(absl::string_view field, int64_t bytes, int64_t max_message_bytes) {
  if (bytes <= max_message_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      field, ": the answer's output (query rows × value_dim, and lse) would take ", bytes,
      " bytes, over this server's --max-message-bytes=", max_message_bytes,
      ", so it could never be sent; ask for fewer query rows, heads or items per call"));
}

std::optional<int64_t> TensorBytes(const v1::Tensor& tensor) {
  const std::optional<DType> dtype = FromProtoDType(tensor.dtype());
  if (!dtype || tensor.shape_size() == 0) return std::nullopt;
  std::optional<int64_t> bytes = ElementSize(*dtype);
  for (const int64_t dim : tensor.shape()) {
    if (dim < 1 || !bytes) return std::nullopt;
    bytes = CheckedMul(*bytes, dim);
  }
  return bytes;
}

}  // namespace attn
