// Request: attention.v1 messages ⇄ kernel Problems. Every check of client input lives here, so
// the kernels can assume a Problem's invariants (kernels/problem.h) and every error names the
// field at fault.
//
// The Problems returned view the request's tensor bytes: the request must outlive them.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "kernels/backend.h"
#include "kernels/kv_store.h"
#include "kernels/problem.h"
#include "server/caches.h"

namespace attn {

// The defaults here are attnd's (its --max-trace-rows, --max-trace-steps, --max-traces and
// --trace-idle-seconds flags start from them).
struct TraceLimits {
  static constexpr int64_t kDefaultMaxRows = 64;
  static constexpr int64_t kDefaultMaxSteps = int64_t{1} << 16;
  static constexpr int64_t kDefaultMaxStreams = 16;
  static constexpr int64_t kDefaultIdleSeconds = 60;

  int64_t max_rows = kDefaultMaxRows;        // Rows one Trace may follow.
  int64_t max_steps = kDefaultMaxSteps;      // TileStep events one Trace may send.
  int64_t max_streams = kDefaultMaxStreams;  // Trace streams open at once.
  // A stream whose reader takes no event for this long is cancelled (0: never).
  int64_t idle_seconds = kDefaultIdleSeconds;
};

// Validates an AttentionRequest and builds its Problem. default_block_k replaces a block_k of 0;
// block_k is capped at key_len (a longer tile would only hold padding) and at 65536.
// INVALID_ARGUMENT naming the field when anything is missing, malformed or inconsistent.
//
// In two steps, so that a server can take the first at once and the second where its compute
// runs: ParseAttentionShape checks everything but the elements' values, in time independent of
// the tensors' sizes; CheckAttentionValues reads every element once (value_scan.h: finite, and
// scores and weighted sums that stay within fp32). A Problem is valid only after both;
// ParseAttentionRequest does both.
absl::StatusOr<Problem> ParseAttentionShape(const attention::v1::AttentionRequest& request,
                                            int default_block_k);
absl::Status CheckAttentionValues(const Problem& problem);
absl::StatusOr<Problem> ParseAttentionRequest(const attention::v1::AttentionRequest& request,
                                              int default_block_k);

// Positions (kernels/geometry.h) into *problem: each in [0, 2^62], else INVALID_ARGUMENT naming
// `prefix` + "key_position" or "query_position"; an absent query_position is bottom-right.
absl::Status ParsePositions(absl::string_view prefix, int64_t key_position,
                            std::optional<int64_t> query_position, Problem* problem);
// Decode's options: its positions come per item, so options.key_position and query_position
// must be unset (INVALID_ARGUMENT naming them).
// INVALID_ARGUMENT when a request over a cache (cache_id) gives cu_seqlens: a cache is one
// sequence. prefix: the request's field path ("" or "attention.").
absl::Status CheckOneSequence(absl::string_view prefix,
                              const attention::v1::AttentionRequest& request);

absl::Status CheckDecodeOptions(const attention::v1::AttentionOptions& options);

// --- KV caches ----------------------------------------------------------------------------
// The same rules for a cache's queries and tokens; `prefix` starts every field name ("" or
// "items[2]."), and a null tensor is an absent one.

// A new cache's layout: kv_heads, head_dim and value_dim (0 = head_dim) in [1, 65536], a known
// dtype.
absl::StatusOr<KvLayout> ParseCreateCache(const attention::v1::CreateCacheRequest& request);

// Tokens to append to a cache of `layout`: key [kv_heads, n, head_dim] and value
// [kv_heads, n, value_dim] (rank 2 when kv_heads is 1, rank 4 with batch 1), in the cache's
// dtype. Both
// absent is n = 0 when `optional`, else INVALID_ARGUMENT.
struct NewTokens {
  TensorView key, value;
  int64_t n = 0;
};
absl::StatusOr<NewTokens> ParseNewTokens(absl::string_view prefix, const attention::v1::Tensor* key,
                                         const attention::v1::Tensor* value, const KvLayout& layout,
                                         bool optional);
// Their elements, in one pass: finite. Sets their largest magnitudes.
absl::Status CheckNewTokenValues(absl::string_view prefix, const NewTokens& tokens,
                                 const KvLayout& layout, double* max_abs_key,
                                 double* max_abs_value);

// A query [heads, nq, head_dim] (rank 2 when heads is 1, rank 4 with batch 1) over a cache of
// `layout`, with the request's options: every check that needs none of the cache's contents.
// The Problem is complete only after BindCache.
absl::StatusOr<Problem> ParseCacheQuery(absl::string_view prefix,
                                        const attention::v1::Tensor* query,
                                        const attention::v1::AttentionOptions& options,
                                        const KvLayout& layout, int default_block_k);
// Completes it under the cache's lease: its keys are the cache's first `length` tokens
// (FAILED_PRECONDITION for an empty cache), block_k capped at length; then the value checks:
// the query's elements finite, and scores and sums within fp32 given the cache's largest |key|
// and |value|.
absl::Status BindCache(absl::string_view prefix, const PagedKv& pages, int64_t length,
                       double max_abs_key, double max_abs_value, Problem* problem);

// Validates a TraceRequest's rows against its (already parsed) problem and the limits; no rows
// means row 0 of batch 0, head 0. INVALID_ARGUMENT naming the row or the limit.
absl::StatusOr<std::vector<RowRef>> ParseTraceRows(const attention::v1::TraceRequest& request,
                                                   const Problem& problem,
                                                   const TraceLimits& limits);

// --- Replies ------------------------------------------------------------------------------
// The bytes of the tensors a problem's answer carries: its output in output_dtype, plus fp32
// lse when it asks for lse; saturates at INT64_MAX.
int64_t ReplyTensorBytes(const Problem& problem);
// Before any output is allocated: RESOURCE_EXHAUSTED when `bytes` of reply tensors (one
// problem's, or a Decode batch's sum, ReplyTensorBytes) pass `max_message_bytes`, since such
// an answer could never be sent. `field` is the one to blame ("query", "items[3].query",
// "items"); the message names it, the size and --max-message-bytes.
absl::Status CheckReplyBytes(absl::string_view field, int64_t bytes, int64_t max_message_bytes);

// Sets the response's output (and lse) tensor shapes and dtypes, sizes their data, and returns
// Outputs that point into that data for a kernel to fill.
Outputs PrepareOutputs(const Problem& problem, const attention::v1::AttentionRequest& request,
                       attention::v1::AttentionResponse* response);
// The same for any query tensor: output [.., heads, query_len, value_dim] in the query's rank,
// and lse [.., heads, query_len] when lse is not null and the problem asks for it.
Outputs PrepareOutputs(const Problem& problem, const attention::v1::Tensor& query,
                       attention::v1::Tensor* output, attention::v1::Tensor* lse);

// A cache as the client sees it.
void EncodeCacheInfo(const CacheDescription& cache, attention::v1::CacheInfo* message);

// Copies a backend's Stats into the message (backend, device and server_ns are the caller's).
void EncodeStats(const Stats& stats, attention::v1::ExecutionStats* message);

// The first event of a trace: the problem's shape and both methods' memory accounting.
attention::v1::TraceStart EncodeTraceStart(const Problem& problem);

// One cursor item of a trace as a TraceEvent (a TileStep or a RowDone), a copy of what the
// kernel computed and recorded (a step's biases and hidden reasons included).
void EncodeTraceItem(const TraceItem& item, attention::v1::TraceEvent* event);

}  // namespace attn
