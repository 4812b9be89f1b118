// Head sharding: one Naive or Tiled request split across several attnd servers; and KV caches
// kept on the server that created them (ShardedClient, below).
//
// Every (batch, query head) of attention is computed on its own, and under grouped-query
// attention the query heads h·G … h·G+G−1 (G = heads / kv_heads) all read key/value head h. A
// request [B, H, N, D] × [B, K, M, D] therefore splits into B·K independent units, one per
// (batch, kv head): that kv head's key and value rows with the G query heads that read them. In
// row-major order each unit is a contiguous run of elements of every tensor, so a part — a
// contiguous range of u units — is sent as query [u, G, N, D], key [u, 1, M, D] and value
// [u, 1, M, Dv] (byte slices of the original data, no re-encoding), and the parts' outputs
// (and lse) concatenate back into the original [.., H, N, Dv] in order. Since each server
// computes each head on its own, the reassembled answer equals a single server's bit for bit
// (with the same backend and options).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"

namespace attn::client {

// One part of a split request: units [first_unit, first_unit + units) of the request's
// B·kv_heads (batch, kv head) units.
struct ShardPart {
  int64_t first_unit = 0;
  int64_t units = 0;
  attention::v1::AttentionRequest request;
};

// Splits `request` into at most `max_parts` parts of whole (batch, kv head) units, as even as
// possible. A request that cannot be split — a single unit, shapes that do not agree, data of
// the wrong length — comes back as one part holding it unchanged (the server then answers it,
// or reports what is wrong with it).
std::vector<ShardPart> SplitRequest(const attention::v1::AttentionRequest& request, int max_parts);

// Reassembles the parts' responses (in the order SplitRequest gave the parts) into the response
// to `request`: output and lse concatenated and reshaped to the request's leading dimensions.
// Stats: backend, device and block_k from the first part; compute_ns and server_ns the largest
// part's (the parts run concurrently); flops, intermediate, scratch and peak bytes summed over
// the parts. INTERNAL when a part's output does not have the size its shape needs.
absl::StatusOr<attention::v1::AttentionResponse> MergeResponses(
    const attention::v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<attention::v1::AttentionResponse>& responses);

// What a sharded call did.
struct ShardReport {
  struct Part {
    int64_t first_unit = 0;
    int64_t units = 0;
    std::string endpoint;     // The endpoint that answered (or last failed).
    bool retried = false;     // Its first endpoint failed and it was sent again.
    std::string first_error;  // That first failure, when retried.
  };
  std::vector<Part> parts;
};

// Sends each part of a request to its own endpoint, concurrently, over one channel per endpoint
// (pick_first each). Part i goes to endpoint i mod E; a part that fails with a code another
// server might not give (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED,
// CANCELLED, INTERNAL, UNKNOWN) is sent once more, to endpoint (i + 1) mod E, before the call
// fails with that part's status.
//
// KV caches live on the endpoint that created them. CreateCache places each new cache on the
// next endpoint in turn (starting from a random one, so short-lived clients spread theirs too)
// (sent once more to the following endpoint on a failure listed above, e.g. a full --cache-bytes
// budget) and remembers cache_id → endpoint; every call naming a cache — AppendCache, GetCacheInfo,
// DeleteCache, Decode's items, and Naive, Tiled and Trace with AttentionRequest.cache_id — goes to
// that endpoint, whole and never retried elsewhere. An id this client did not create is looked up
// once by asking each endpoint in turn (GetCacheInfo); NOT_FOUND when none knows it. ListCaches
// concatenates every endpoint's list, in endpoint order. Decode splits a batch by endpoint, sends
// the parts concurrently and puts outputs, lse and caches back in item order (stats as
// MergeResponses'); it is atomic per endpoint only: when one endpoint's part fails the others'
// appends may have been kept, so the caller should re-read (GetCacheInfo) the lengths of the
// batch's caches before retrying.
//
// Thread-safe.
class ShardedClient {
 public:
  // `endpoints`: addresses or URIs ("127.0.0.1:50051", "dns:///name:port"), at least one.
  // options.load_balancing applies within each endpoint's channel.
  ShardedClient(std::vector<std::string> endpoints, ClientOptions options = {});

  absl::StatusOr<attention::v1::AttentionResponse> Naive(
      const attention::v1::AttentionRequest& request, ShardReport* report = nullptr);
  absl::StatusOr<attention::v1::AttentionResponse> Tiled(
      const attention::v1::AttentionRequest& request, ShardReport* report = nullptr);
  // A trace is one server's stream: a cache's on its endpoint, any other on the first endpoint.
  absl::Status Trace(const attention::v1::TraceRequest& request,
                     const std::function<bool(const attention::v1::TraceEvent&)>& on_event);

  absl::StatusOr<attention::v1::CacheInfo> CreateCache(
      const attention::v1::CreateCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> AppendCache(
      const attention::v1::AppendCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> GetCacheInfo(const std::string& cache_id);
  absl::Status DeleteCache(const std::string& cache_id);
  absl::StatusOr<attention::v1::ListCachesResponse> ListCaches();
  absl::StatusOr<attention::v1::DecodeResponse> Decode(const attention::v1::DecodeRequest& request);

  // The endpoint holding `cache_id` (looked up as above); NOT_FOUND when none does.
  absl::StatusOr<std::string> EndpointOf(const std::string& cache_id);
  // That endpoint's Client, e.g. to make a Cache of it; valid as long as this ShardedClient.
  absl::StatusOr<Client*> ClientFor(const std::string& cache_id);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  absl::StatusOr<attention::v1::AttentionResponse> Call(
      bool naive, const attention::v1::AttentionRequest& request, ShardReport* report);
  // The index of the endpoint holding `cache_id`, asking the endpoints when it is not known.
  absl::StatusOr<size_t> Owner(const std::string& cache_id);
  void Remember(const std::string& cache_id, size_t endpoint);
  void Forget(const std::string& cache_id);

  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::mutex mutex_;
  std::map<std::string, size_t> owners_;  // cache_id → endpoint index; guarded by mutex_.
  size_t next_endpoint_;  // Where CreateCache puts the next cache (mod E); guarded by mutex_.
};

}  // namespace attn::client
