// MultiServerClient: one client over several attnd servers. Stateless calls (Naive, Tiled) are
// split across them by heads, keys or both (client/shard.h) and merged; each KV cache is placed
// whole on one server, and every call naming it goes there. (client/sharded_cache.h is the other
// shape: one logical cache whose tokens are spread over several servers.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"
#include "client/shard.h"

namespace attn::client {

// How MultiServerClient::Naive and Tiled split a request over the endpoints.
enum class Sharding {
  kHeads,         // SplitRequest: bit-identical to one server.
  kKeys,          // SplitKeys, merged by MergeKeySlices.
  kHeadsAndKeys,  // SplitRequest, then SplitKeys of each head part: a grid of parts.
};

// What a sharded call did.
struct ShardReport {
  struct Part {
    int64_t first_unit = 0;
    int64_t units = 0;
    int64_t key_begin = 0;  // Keys [key_begin, key_end) of the request's.
    int64_t key_end = 0;
    bool key_slice = false;   // A SplitKeys slice (ShardPart::key_slice).
    std::string endpoint;     // The endpoint that answered (or last failed).
    bool retried = false;     // Its first endpoint failed and it was sent again.
    std::string first_error;  // That first failure, when retried.
  };
  std::vector<Part> parts;
};

// Naive and Tiled split a request over the E endpoints as their Sharding says (by heads unless
// told otherwise): kHeads into min(E, B·kv_heads) head parts, kKeys into at most E key slices,
// kHeadsAndKeys into at most E key slices of each of the head parts (up to E² parts, E per
// endpoint). Parts are numbered in (head part, key slice) order and sent concurrently, over one
// channel per endpoint (pick_first each): part i goes to endpoint i mod E; a part that fails with
// a code another server might not give (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
// ABORTED, CANCELLED, INTERNAL, UNKNOWN) is sent once more, to endpoint (i + 1) mod E, before the
// call fails with that part's status (its message naming the part and its endpoint). Never a
// partial answer: every part is in the sum or the call fails.
//
// KV caches live on the endpoint that created them. CreateCache places each new cache on the
// next endpoint in turn (starting from a random one, so short-lived clients spread theirs too)
// (sent once more to the following endpoint on a failure listed above, e.g. a full --cache-bytes
// budget) and remembers cache_id → endpoint; every call naming a cache — AppendCache, GetCacheInfo,
// DeleteCache, Decode's items, and Naive, Tiled and Trace with AttentionRequest.cache_id — goes to
// that endpoint, whole and never retried elsewhere. An id this client did not create is looked up
// once by asking each endpoint in turn (GetCacheInfo); NOT_FOUND when none knows it. ListCaches
// concatenates every endpoint's list, in endpoint order. Decode splits a batch by endpoint, sends
// the parts concurrently and puts outputs, lse and caches back in item order (stats added by
// AddPartStats); it is atomic per endpoint only: when one endpoint's part fails the others'
// appends may have been kept, so the caller should re-read (GetCacheInfo) the lengths of the
// batch's caches before retrying.
//
// Thread-safe.
class MultiServerClient {
 public:
  // `endpoints`: addresses or URIs ("127.0.0.1:50051", "dns:///name:port"), at least one.
  // options.load_balancing applies within each endpoint's channel.
  MultiServerClient(std::vector<std::string> endpoints, ClientOptions options = {});

  absl::StatusOr<attention::v1::AttentionResponse> Naive(
      const attention::v1::AttentionRequest& request, ShardReport* report = nullptr,
      Sharding sharding = Sharding::kHeads);
  absl::StatusOr<attention::v1::AttentionResponse> Tiled(
      const attention::v1::AttentionRequest& request, ShardReport* report = nullptr,
      Sharding sharding = Sharding::kHeads);
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
  // That endpoint's Client, e.g. to make a Cache of it; valid as long as this MultiServerClient.
  absl::StatusOr<Client*> ClientFor(const std::string& cache_id);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  absl::StatusOr<attention::v1::AttentionResponse> Call(
      bool naive, const attention::v1::AttentionRequest& request, Sharding sharding,
      ShardReport* report);
  // Sends requests[i] to endpoint i mod E, all concurrently, each retried once on endpoint
  // (i + 1) mod E after a failure another server might not give (above); fills parts[i]'s
  // endpoint, retried and first_error. The one send-and-retry path of Naive and Tiled.
  std::vector<absl::StatusOr<attention::v1::AttentionResponse>> Send(
      bool naive, const std::vector<const attention::v1::AttentionRequest*>& requests,
      std::vector<ShardReport::Part>& parts);
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
