// One KV cache spread over several attnd servers: a part (an ordinary cache, CreateCache) per
// endpoint, each holding some of the sequence's tokens, and a Decode that asks every part for
// its (output, lse) state and merges them exactly (client/merge.h: lse = log Σ exp(lseᵢ),
// O = Σ exp(lseᵢ − lse)·Oᵢ), so a sequence may be longer than any one server's --cache-bytes
// and each step reads every server's share in parallel. (client/multi_server_client.h is the
// other shape: a client over several servers that keeps each cache whole on one of them.)
//
// Placement. The sequence's tokens have global positions 0 … length() − 1, in the order they
// were appended. Append(key, value) splits its n tokens into contiguous chunks placed by
// water-filling: the shortest parts are raised to one common level (± 1 token; the extra tokens
// go to the lower part indices), parts above that level get nothing, so an append large enough
// leaves the lengths within one token of each other. Chunks are sent in part order, so within
// one append a lower-indexed part holds earlier tokens. Decode's new tokens (a step's k and v) go
// whole to the shortest part (the lowest index on a tie). Each part therefore holds a few
// contiguous runs of global positions — its segments (Info()) — and its local token j is the j-th
// token of its segments in order.
//
// Positions (causal only; a non-causal Decode sends none, since they change nothing). The
// queries of a Decode are the sequence's last nq positions, G − nq … G − 1 (G = length after the
// step's append). Each part's DecodeItem gets key_position = the global start of its LAST
// segment − that segment's local start, and query_position = G − nq: its last segment's keys
// then sit at their true positions, and its earlier keys at positions below that segment's
// start, where (if every query sees them) the causal mask treats them as it would at their true
// positions. That is exact when the part has one segment or its last segment's start − 1 ≤
// G − nq; when it is not (a causal Decode with nq > the step's new tokens + 1 whose last nq
// positions are spread over several parts), Decode returns FAILED_PRECONDITION naming the part
// and sends nothing, rather than a wrong answer. When G − nq < 0 (queries before the first
// key, which see nothing) both positions are shifted up by nq − G: only their difference
// matters to the mask.
//
// Latent caches (CreateCacheRequest.values_from_keys: MLA, as DeepSeek-V3 decodes): the request
// goes to every part as it is, so each part stores keys only, a token's value being the first
// value_dim columns of its key. Append(key) and Decode(query, &key) then send keys alone; a value
// given for such a cache is INVALID_ARGUMENT naming "value" before anything is sent.
//
// Errors. Every part is an ordinary cache with an expected_length, so a retried or duplicated
// append is refused (FAILED_PRECONDITION) rather than stored twice, and the lengths this object
// keeps are always the servers' answers. A failed call names the part ("part 2 of 3 (cache …
// on 127.0.0.1:50052)") and its endpoint, with the server's code; a part lost with its server
// (UNAVAILABLE while it is down, NOT_FOUND after a restart, which forgets caches) fails the
// whole Decode — a part is never left out of the sum. After a failure:
//  - Append: the chunks before the failed one were kept (the message says which global tokens
//    [start, start + kept) are stored); append the rest again (with the tokens after them).
//  - Decode: the new tokens, if any, were kept when the part that got them answered (the message
//    says so, and length() includes them); retry with key = value = nullptr. If that part failed,
//    they were not stored, and the Decode may be retried whole.
//  - When the outcome of a part's call is unknown (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
//    ABORTED, UNKNOWN, INTERNAL: the server may have stored the tokens before the reply was
//    lost), the chunk is held as pending and every Append and Decode fails FAILED_PRECONDITION
//    until Refresh() re-reads that part's length and either adopts the chunk (the server kept it)
//    or drops it (it did not), so global positions never skip or repeat.
//  - A part whose server lost it (NOT_FOUND) cannot be recovered here: its tokens are gone, and
//    the sequence is only whole again after Delete() and a new cache filled from the start.
//
// Ownership and threads. The Clients are borrowed and must outlive this object. It does not
// delete its parts when destroyed (the server's idle expiry does, or Delete()). Not thread-safe:
// one sequence, one writer, like client::Cache; Decode sends its parts concurrently, one thread
// each. Move-only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"
#include "client/multi_server_client.h"

namespace attn::client {

// A server to hold one part: its name (for messages) and its Client.
struct CacheEndpoint {
  std::string name;
  Client* client = nullptr;
};

// A run of consecutive global positions a part holds: global tokens [global_start,
// global_start + length) are the part's local tokens [local_start, local_start + length).
struct CacheSegment {
  int64_t global_start = 0;
  int64_t local_start = 0;
  int64_t length = 0;
};

struct ShardedCacheInfo {
  struct Part {
    std::string endpoint;
    std::string cache_id;
    int64_t length = 0;  // The server's last answer.
    int64_t bytes = 0;   // Memory its pages take there (CacheInfo.bytes).
    std::vector<CacheSegment> segments;
  };
  int64_t length = 0;  // Tokens of the whole sequence: Σ parts' lengths.
  std::vector<Part> parts;
};

// What one sharded Decode answered.
struct ShardedDecodeResult {
  // [heads, nq, value_dim] (the query's rank) in options.output_dtype (unspecified: the query's).
  attention::v1::Tensor output;
  // [heads, nq] fp32, only when options.return_lse.
  std::optional<attention::v1::Tensor> lse;
  // backend, device, block_k from the first part; compute_ns and server_ns the largest part's
  // (they run concurrently); flops and byte counts summed.
  attention::v1::ExecutionStats stats;
  std::vector<attention::v1::ExecutionStats> part_stats;  // Per part asked, in part order.
  int64_t request_bytes = 0;  // Serialized size of the DecodeRequests sent, summed.
};

class ShardedCache {
 public:
  // One new, empty part on each endpoint (at least one), each made by `request` as it is (a
  // latent cache's values_from_keys included). On a failure the parts already made are deleted
  // and the error names the endpoint that refused.
  static absl::StatusOr<ShardedCache> Create(std::vector<CacheEndpoint> endpoints,
                                             const attention::v1::CreateCacheRequest& request);
  // One part per endpoint of `client`, each made by its CreateCache (which places successive
  // caches on successive endpoints; after a retry two parts may share a server, which changes
  // nothing but balance). `client` must outlive the cache.
  static absl::StatusOr<ShardedCache> Create(MultiServerClient& client,
                                             const attention::v1::CreateCacheRequest& request);

  ShardedCache(ShardedCache&&) = default;
  ShardedCache& operator=(ShardedCache&&) = default;
  ShardedCache(const ShardedCache&) = delete;
  ShardedCache& operator=(const ShardedCache&) = delete;

  int64_t length() const;
  int parts() const { return static_cast<int>(parts_.size()); }
  // kv_heads, head_dim, value_dim, dtype and values_from_keys of every part (the first part's
  // CacheInfo, length 0).
  const attention::v1::CacheInfo& shape() const { return shape_; }
  ShardedCacheInfo Info() const;

  // Appends key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] (n ≥ 1) at
  // length(), water-filled over the parts (above), one AppendCache per receiving part, in part
  // order. INVALID_ARGUMENT for tensors that do not fit the cache (checked before anything is
  // sent); otherwise the first failing part's status, naming it and what was kept.
  absl::Status Append(const attention::v1::Tensor& key, const attention::v1::Tensor& value);
  // A latent cache's append (values_from_keys): key [kv_heads, n, head_dim] alone, placed as
  // above. INVALID_ARGUMENT naming "value", before anything is sent, for a cache that stores
  // values.
  absl::Status Append(const attention::v1::Tensor& key);

  // Appends key/value [kv_heads, n, ·] when given (both or neither, nullptr: none; for a latent
  // cache the key alone, a value being INVALID_ARGUMENT naming "value") to the shortest part, then
  // attends `query` [heads, nq, head_dim] (rank 2 or 3, heads a multiple of kv_heads) over the
  // whole sequence, every part concurrently, and merges. `options` as for Client::Decode (scale,
  // causal, output_dtype, return_lse; key_position and query_position must be unset: the positions
  // are the sequence's). Errors as above.
  absl::StatusOr<ShardedDecodeResult> Decode(const attention::v1::Tensor& query,
                                             const attention::v1::Tensor* key = nullptr,
                                             const attention::v1::Tensor* value = nullptr,
                                             const attention::v1::AttentionOptions& options = {});

  // Re-reads every part's length; resolves a pending chunk (above). FAILED_PRECONDITION naming
  // the part when a length is neither what this object believes nor that plus the pending chunk
  // (someone else wrote to it), or a part's status (NOT_FOUND: lost).
  absl::Status Refresh();

  // Deletes every part (all are tried); the first failure, naming its part. A part already gone
  // (NOT_FOUND) counts as deleted.
  absl::Status Delete();

 private:
  struct Part {
    std::string endpoint;
    Client* client = nullptr;
    attention::v1::CacheInfo info;  // The server's last answer; info.length() is the truth.
    std::vector<CacheSegment> segments;
    bool deleted = false;
  };
  // A chunk whose outcome is unknown: maybe stored at part's local length, global `start`.
  struct Pending {
    size_t part = 0;
    int64_t global_start = 0;
    int64_t length = 0;
  };

  explicit ShardedCache(std::vector<Part> parts);
  // "part i of P (cache ID on ENDPOINT)".
  std::string Name(size_t part) const;
  // Records tokens [global_start, global_start + n) as the last ones of `part`, stored at its
  // local length before `info` (the server's answer, which becomes the part's info).
  void Record(size_t part, int64_t global_start, int64_t n, const attention::v1::CacheInfo& info);
  absl::Status CheckNoPending() const;
  // Checks key [kv_heads, n, head_dim] and, but for a latent cache, value (null: none given)
  // [kv_heads, n, value_dim] → n; INVALID_ARGUMENT naming the tensor otherwise.
  absl::StatusOr<int64_t> NewTokens(const attention::v1::Tensor& key,
                                    const attention::v1::Tensor* value) const;
  // Key and value (null: a latent cache's keys alone) of `n` tokens → the parts' appends.
  absl::Status AppendTokens(const attention::v1::Tensor& key, const attention::v1::Tensor* value,
                            int64_t n);

  std::vector<Part> parts_;
  attention::v1::CacheInfo shape_;
  std::optional<Pending> pending_;
};

}  // namespace attn::client
