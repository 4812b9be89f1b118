// Sharding: one Naive or Tiled request split across several attnd servers, by heads, by keys or
// both; and KV caches kept on the server that created them (ShardedClient, below).
//
// By heads (SplitRequest). Every (batch, query head) of attention is computed on its own, and
// under grouped-query attention the query heads h·G … h·G+G−1 (G = heads / kv_heads) all read
// key/value head h. A request [B, H, N, D] × [B, K, M, D] therefore splits into B·K independent
// units, one per (batch, kv head): that kv head's key and value rows with the G query heads that
// read them. In row-major order each unit is a contiguous run of elements of every tensor, so a
// part — a contiguous range of u units — is sent as query [u, G, N, D], key [u, 1, M, D] and
// value [u, 1, M, Dv] (byte slices of the original data, no re-encoding), and the parts' outputs
// (and lse) concatenate back into the original [.., H, N, Dv] in order. Since each server
// computes each head on its own, the reassembled answer equals a single server's bit for bit
// (with the same backend and options).
//
// By keys (SplitKeys). The keys and values split along the sequence into slices [a, b), each
// sent with the whole query, key_position = the slice's first key's position (the request's
// key_position + a) and the whole problem's query_position (the request's, or its bottom-right
// default computed from the whole key_len), so each server's causal mask is its share of the
// whole one (attention.proto, AttentionOptions positions). Each slice asks for return_lse and an
// fp32 output; the finished states merge exactly (client/merge.h) and are then written in the
// request's output dtype, with lse only when it asked. The answer equals one server's to within
// fp32 rounding (a few ulps: the sum runs in another order), not bit for bit. Slices are
// balanced by visible work: every slice holds about the same number of (query row, key) pairs
// the causal mask lets through (without the mask: the same number of keys), and keys no query
// row sees are not sent. A key slice of a rank-4 key [B, K, M, D] is B·K runs of rows, one per
// (batch, kv head), again byte slices of the original data.
//
// By both (Sharding::kHeadsAndKeys): each head part's keys split as above — a grid of parts.
//
// A ragged batch (cu_seqlens) splits by heads only, each part [1, u·G, N, D] with the whole
// cu_seqlens; its keys are never split (each sequence's positions are its own, which one
// key_position per slice cannot give), so SplitKeys sends it whole.
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

// How ShardedClient::Naive and Tiled split a request over the endpoints.
enum class Sharding {
  kHeads,         // SplitRequest: bit-identical to one server.
  kKeys,          // SplitKeys, merged by MergeKeySlices.
  kHeadsAndKeys,  // SplitRequest, then SplitKeys of each head part: a grid of parts.
};

// One part of a split request: units [first_unit, first_unit + units) of the request's
// B·kv_heads (batch, kv head) units, and keys [key_begin, key_end) of its key_len.
struct ShardPart {
  int64_t first_unit = 0;
  int64_t units = 0;
  int64_t key_begin = 0;
  int64_t key_end = 0;
  // True for a key slice of SplitKeys: `request` then carries positions, return_lse and an fp32
  // output, and its response is a partial state for MergeKeySlices. False: `request` is answered
  // as the original would be.
  bool key_slice = false;
  attention::v1::AttentionRequest request;
};

// Splits `request` into at most `max_parts` parts of whole (batch, kv head) units, as even as
// possible (with ALiBi slopes, a part crossing from one batch entry to the next is cut in two
// there, and each piece carries its query heads' slopes). A request that cannot be split — a single
// unit, shapes that do not agree, data of the wrong length — comes back as one part holding it
// unchanged (the server then answers it, or reports what is wrong with it). Each part holds all the
// keys (key_end = key_len; 0 for a request whose shapes do not agree).
std::vector<ShardPart> SplitRequest(const attention::v1::AttentionRequest& request, int max_parts);

// Reassembles the parts' responses (in the order SplitRequest gave the parts) into the response
// to `request`: output and lse concatenated and reshaped to the request's leading dimensions.
// Stats: backend and device from the first part; block_k, compute_ns and server_ns the largest
// part's (the parts run concurrently); flops, intermediate, scratch and peak bytes summed over
// the parts. INTERNAL when a part's output does not have the size its shape needs.
absl::StatusOr<attention::v1::AttentionResponse> MergeResponses(
    const attention::v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<attention::v1::AttentionResponse>& responses);

// Splits `request`'s keys into at most `max_parts` key slices (key_slice true, all units each),
// balanced by visible work as above. Slice boundaries: with W(x) the visible (query row, key)
// pairs of one (batch, head) among keys [0, x) (Σᵢ |Visible(i) ∩ [0, x)|, the ranges
// kernels/geometry.h's Geometry::Visible defines for the causal mask and the window; N·x without
// either), the keys some row sees [F, S) (the rest are not sent) and P = min(max_parts, S − F),
// the s-th boundary is the smallest x with W(x) ≥ ⌈s·W(S)/P⌉; empty slices are dropped. When the
// default query_position (key_position + key_len − query_len) is negative (more query rows than
// keys), both positions are shifted up by as much: only their difference matters to the mask. A
// request that cannot be split — one key, max_parts < 2, a cache_id, shapes that do not agree or
// data of the wrong length, positions or windows outside [0, 2^62], no key any row sees — comes
// back as one part holding it unchanged (key_slice false; the server then answers it, or reports
// what is wrong with it).
std::vector<ShardPart> SplitKeys(const attention::v1::AttentionRequest& request, int max_parts);

// The response to `request` from the responses to its SplitKeys parts (in their order): a
// single part that is not a key slice answered it already; key slices' states (StateOf) are
// merged (MergeStates), the output written in the request's output dtype (unspecified: the
// query's; rounded to nearest even), lse only with return_lse. Stats as MergeResponses'.
// INTERNAL when a response is not a state of the request's rows (a server's fault).
absl::StatusOr<attention::v1::AttentionResponse> MergeKeySlices(
    const attention::v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<attention::v1::AttentionResponse>& responses);

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
  // That endpoint's Client, e.g. to make a Cache of it; valid as long as this ShardedClient.
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
