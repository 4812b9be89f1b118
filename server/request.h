// Request: attention.v1 messages → kernel Problems, and every check of client input on the way,
// so the kernels can assume a Problem's invariants (kernels/problem.h) and every error names the
// field at fault (INVALID_ARGUMENT, unless a function says otherwise). What goes back to the
// client — outputs, stats, cache infos, trace events — is response.h's.
//
// The Problems returned view the request's tensor bytes: the request must outlive them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "kernels/backend.h"
#include "kernels/kv_store.h"
#include "kernels/problem.h"

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

// --- KV caches ----------------------------------------------------------------------------
// The same rules for a cache's queries and tokens; `prefix` starts every field name ("" or
// "items[2]."), and a null tensor is an absent one.

// A Naive, Tiled or Trace request over a cache (cache_id set): INVALID_ARGUMENT when it gives
// cu_seqlens, since a cache holds one sequence. prefix: the request's field path ("" or
// "attention.").
absl::Status CheckOneSequence(absl::string_view prefix,
                              const attention::v1::AttentionRequest& request);
// INVALID_ARGUMENT naming key or value when a request over a cache gives either: its keys and
// values are the cache's. Field names as the request's own (a TraceRequest's caller prefixes
// "attention.").
absl::Status CheckNoInlineKeys(const attention::v1::AttentionRequest& request);

// The tensor a message field holds, or null when `has` says it is absent.
inline const attention::v1::Tensor* TensorOrNull(bool has, const attention::v1::Tensor& tensor) {
  return has ? &tensor : nullptr;
}

// A call's expected_length against its cache's `length` (−1: not known yet, only the sign is
// checked): INVALID_ARGUMENT when negative, FAILED_PRECONDITION naming the actual length when
// stale — nothing of the call was applied, so a retried append is detected, never doubled.
absl::Status CheckExpectedLength(absl::string_view prefix, int64_t expected,
                                 absl::string_view cache_id, int64_t length);

// A cut of a cache to its first `length` tokens (TruncateCache's length, a Decode item's
// truncate_to; `field` names it, after `prefix`), against the cache's `length_now` (−1: not known
// yet, only the sign is checked): INVALID_ARGUMENT when negative, OUT_OF_RANGE naming the
// cache's length when past it.
absl::Status CheckCutLength(absl::string_view prefix, absl::string_view field, int64_t length,
                            int64_t length_now);
// The most tokens one Decode item's truncate_to may drop (it keeps a copy of them until the call
// succeeds): 64 MiB of them, INVALID_ARGUMENT naming the count allowed otherwise.
constexpr int64_t kMaxDecodeCutBytes = int64_t{64} << 20;
absl::Status CheckDecodeCut(absl::string_view prefix, int64_t truncate_to, int64_t length_now,
                            const KvLayout& layout);

// A cache's layout, wherever one arrives (CreateCache, an import's first chunk, a cache file's
// header): kv_heads, head_dim and value_dim (0 = head_dim) in [1, 65536], a known dtype (the
// wire's number); a latent cache (values_from_keys) with value_dim ≤ head_dim. Errors are
// INVALID_ARGUMENT naming the field.
absl::StatusOr<KvLayout> CheckCacheLayout(int64_t kv_heads, int64_t head_dim, int64_t value_dim,
                                          int dtype, bool values_from_keys);
// CheckCacheLayout of a CreateCacheRequest.
absl::StatusOr<KvLayout> ParseCreateCache(const attention::v1::CreateCacheRequest& request);

// Tokens to append to a cache of `layout`: key [kv_heads, n, head_dim] and value
// [kv_heads, n, value_dim] (rank 2 when kv_heads is 1, rank 4 with batch 1), in the cache's
// dtype. Both absent is n = 0 when `optional`, else INVALID_ARGUMENT. A latent cache takes the
// key alone (a value is INVALID_ARGUMENT naming it), and `value` is then unset (data null).
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
// (FAILED_PRECONDITION for an empty cache), block_k capped at length, a token tree's first new
// token at length − tree_count; then the value checks:
// the query's elements finite, and scores and sums within fp32 given the cache's largest |key|
// and |value|.
absl::Status BindCache(absl::string_view prefix, const PagedKv& pages, int64_t length,
                       double max_abs_key, double max_abs_value, Problem* problem);

// Validates a TraceRequest's rows against its (already parsed) problem and the limits; no rows
// means row 0 of batch 0, head 0. INVALID_ARGUMENT naming the row or the limit.
absl::StatusOr<std::vector<RowRef>> ParseTraceRows(const attention::v1::TraceRequest& request,
                                                   const Problem& problem,
                                                   const TraceLimits& limits);

// --- Decode ---------------------------------------------------------------------------------

// A Decode batch's size, checked before anything else: 1 to 4096 items, else INVALID_ARGUMENT
// naming items.
absl::Status CheckDecodeItemCount(const attention::v1::DecodeRequest& request);

// One item of a Decode batch, checked as far as its cache's contents are not needed: its problem
// is complete only after BindCache, its tokens' values are unread (CheckNewTokenValues).
struct DecodeItemProblem {
  std::string prefix;  // "items[i].": starts every field name of the item's errors.
  KvLayout layout;     // Its cache's.
  Problem problem;
  NewTokens tokens;                    // Absent tokens: n = 0.
  std::optional<int64_t> truncate_to;  // The cut before the append (checked for sign only).
  // tree_parents as the kernels read them (kernels/geometry.h): a bitmask of ancestors per new
  // token, (n + 63) / 64 words each; empty: no tree. problem.tree_count is set; BindCache sets
  // tree_first, and the caller points problem.tree_ancestors here once the item stays put.
  std::vector<uint64_t> tree;
};
// The most new tokens a token tree may have (tree_parents' entries): its masks take n² bits.
inline constexpr int64_t kMaxTreeTokens = 1024;
struct DecodeBatch {
  std::vector<DecodeItemProblem> items;  // In the request's order.
  int64_t reply_bytes = 0;               // Every item's output and lse: one reply carries all.
};
// The cache `id`'s layout, or the registry's NOT_FOUND naming `field` (CacheRegistry::LayoutOf).
using CacheLayoutLookup =
    absl::FunctionRef<absl::StatusOr<KvLayout>(const std::string& id, const std::string& field)>;
// Checks a Decode request as to shape, in time independent of its tensors' sizes: options carry
// no positions (each item has its own); each item names a cache (required, at most one item per
// cache), a non-negative expected_length, its query (ParseCacheQuery) and positions
// (ParsePositions), optional new tokens (ParseNewTokens), cut (CheckCutLength's sign) and token
// tree (one parent per new token, each −1 or earlier, one query row per new token, at most
// kMaxTreeTokens); its answer and the batch's fit
// `max_message_bytes` (CheckReplyBytes). Returns the first error found; item i's errors name
// its fields as items[i].<field>.
absl::StatusOr<DecodeBatch> ParseDecodeRequest(const attention::v1::DecodeRequest& request,
                                               CacheLayoutLookup layout_of, int default_block_k,
                                               int64_t max_message_bytes);

// --- Replies' sizes -------------------------------------------------------------------------
// The bytes of the tensors a problem's answer carries: its output in output_dtype, plus fp32
// lse when it asks for lse; saturates at INT64_MAX.
int64_t ReplyTensorBytes(const Problem& problem);
// Before any output is allocated: RESOURCE_EXHAUSTED when `bytes` of reply tensors (one
// problem's, or a Decode batch's sum, ReplyTensorBytes) pass `max_message_bytes`, since such
// an answer could never be sent. `field` is the one to blame ("query", "items[3].query",
// "items"); the message names it, the size and --max-message-bytes.
absl::Status CheckReplyBytes(absl::string_view field, int64_t bytes, int64_t max_message_bytes);

// The bytes a tensor's shape and dtype need, or nullopt when they are not valid (no dims, a
// dimension below 1, an unknown dtype, more than int64 counts): CheckTensor then says which.
std::optional<int64_t> TensorBytes(const attention::v1::Tensor& tensor);

}  // namespace attn
