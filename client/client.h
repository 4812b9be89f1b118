// attn client library: a thin, typed wrapper over the attention.v1 stub.
//
// Converts between host arrays (fp32 values with a shape) and wire Tensors, raises gRPC's
// message limits to the server's default, and reports every failure as an absl::Status whose
// code is the RPC's and whose message is the server's. A Client is thread-safe (the channel
// and stub are); each call may carry a deadline.
//
// Server-resident KV caches: Client has one method per cache RPC (CreateCache, AppendCache,
// GetCacheInfo, DeleteCache, ListCaches, Decode); Naive, Tiled and Trace attend over a cache
// when their request names one (AttentionRequest.cache_id, see CacheRequest). `Cache` keeps a
// cache's id and the length the client believes it has, sending it as expected_length on every
// append and decode and taking the server's answer as the new length.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attn::client {

// A dense host tensor: row-major fp32 values and their shape.
struct Array {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Encodes an array as a wire Tensor in `dtype` (fp16/bf16 rounded to nearest even; an
// unspecified or unknown dtype encodes as fp32).
attention::v1::Tensor ToTensor(const Array& array,
                               attention::v1::DType dtype = attention::v1::DTYPE_FLOAT32);

// Decodes a wire Tensor to fp32. INVALID_ARGUMENT when its dtype is unknown or its data
// length does not match its shape.
absl::StatusOr<Array> FromTensor(const attention::v1::Tensor& tensor);

// gRPC's load-balancing policy for a channel with several addresses: pick_first sends every call
// to one server (the first that connects), round_robin spreads calls over all ready servers.
enum class LoadBalancing { kPickFirst, kRoundRobin };

// "pick_first" / "round_robin" (also "pick-first", "round-robin"); INVALID_ARGUMENT otherwise.
absl::StatusOr<LoadBalancing> ParseLoadBalancing(absl::string_view name);

// Splits a target into its endpoints: "h1:p1,h2:p2" gives both; one address or a URI
// ("dns:///name:port", "ipv4:...") gives itself. Empty parts are dropped.
std::vector<std::string> SplitEndpoints(const std::string& target);

// The gRPC channel target for `target`: a single address or URI as is; a comma-separated list of
// numeric endpoints as "ipv4:h1:p1,h2:p2" (or "ipv6:[h1]:p1,..."; "localhost" counts as
// 127.0.0.1). INVALID_ARGUMENT for a list with a host name in it (use dns:/// for names).
absl::StatusOr<std::string> ChannelTarget(const std::string& target);

struct ClientOptions {
  int max_message_bytes = 1 << 30;  // Matches attnd's default --max-message-bytes.
  // Applied through the channel's service config; matters when the target names several servers
  // (a list, or a dns:/// name with several addresses, e.g. a Kubernetes headless Service).
  LoadBalancing load_balancing = LoadBalancing::kPickFirst;
  std::optional<std::chrono::milliseconds> timeout;  // Per-call deadline; none by default.
  // TLS, with PEM *contents* (not paths): tls_ca, the CA bundle the server's certificate must
  // chain to (empty = plaintext); tls_cert and tls_key, both or neither, a client certificate
  // for servers that require one (attnd --tls-client-ca).
  std::string tls_ca{};
  std::string tls_cert{};
  std::string tls_key{};
  // Sent as "authorization: Bearer <token>" on every call (empty = none); attnd started with
  // --auth-token-file requires it on every call but Health. Over plaintext anyone on the path
  // can read it: use TLS beyond loopback.
  std::string token{};
};

class Client {
 public:
  // Connects lazily: the first call dials `target` (e.g. "127.0.0.1:50051", a list
  // "127.0.0.1:50051,127.0.0.1:50052" or "dns:///attnd-headless:50051"; see ChannelTarget: a
  // list it refuses is dialled as given, and calls then fail UNAVAILABLE).
  explicit Client(const std::string& target, ClientOptions options = {});

  absl::StatusOr<attention::v1::AttentionResponse> Naive(
      const attention::v1::AttentionRequest& request);
  absl::StatusOr<attention::v1::AttentionResponse> Tiled(
      const attention::v1::AttentionRequest& request);
  absl::StatusOr<attention::v1::ServerInfo> Info();

  // Streams a trace, calling on_event for each event in order; on_event returning false
  // cancels the stream (the call then returns OK). Returns the stream's final status.
  absl::Status Trace(const attention::v1::TraceRequest& request,
                     const std::function<bool(const attention::v1::TraceEvent&)>& on_event);

  // grpc.health.v1 Check for `service` ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  // KV caches (attention.proto documents each RPC's errors: NOT_FOUND for an unknown, deleted
  // or expired cache, FAILED_PRECONDITION for a stale expected_length, RESOURCE_EXHAUSTED over
  // the server's --cache-bytes).
  absl::StatusOr<attention::v1::CacheInfo> CreateCache(
      const attention::v1::CreateCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> AppendCache(
      const attention::v1::AppendCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> GetCacheInfo(const std::string& cache_id);
  absl::Status DeleteCache(const std::string& cache_id);
  absl::StatusOr<attention::v1::ListCachesResponse> ListCaches();
  absl::StatusOr<attention::v1::DecodeResponse> Decode(const attention::v1::DecodeRequest& request);

 private:
  void Prepare(grpc::ClientContext* context) const;
  // One unary call of `method` on `stub`, prepared as above (deadline, token).
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Unary(Stub& stub,
                                 grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                              Response*),
                                 const Request& request) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<attention::v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// The standard ALiBi slopes for `heads` query heads (Press et al.; BLOOM's): for a power of two
// n, head h's slope is 2^(−8(h+1)/n); otherwise the n = 2^⌊log₂ heads⌋ slopes, then every other
// one of the 2n slopes (2^(−4(2i+1)/n), i = 0, 1, …) for the heads past n.
std::vector<float> StandardAlibiSlopes(int64_t heads);

// A Naive/Tiled request (or a TraceRequest's attention) over a cache's keys: `query`
// [heads, query_len, head_dim] (rank 2 or 3), no inline key or value.
attention::v1::AttentionRequest CacheRequest(const std::string& cache_id,
                                             const attention::v1::Tensor& query,
                                             const attention::v1::AttentionOptions& options = {});

// One cache as this client sees it: its id and the length it believes the cache has. Append and
// Decode send that length as expected_length and take the length of the server's answer, so a
// retried call is refused (FAILED_PRECONDITION) rather than storing tokens twice; after such a
// refusal, Refresh() re-reads the length. Not thread-safe (one sequence, one writer); the Client
// must outlive it. Copyable: copies share nothing but the Client.
class Cache {
 public:
  // A new, empty cache on `client`.
  static absl::StatusOr<Cache> Create(Client& client,
                                      const attention::v1::CreateCacheRequest& request);
  // An existing cache (e.g. from ListCaches or GetCacheInfo), believed to have info.length().
  Cache(Client& client, attention::v1::CacheInfo info) : client_(&client), info_(std::move(info)) {}

  const std::string& id() const { return info_.cache_id(); }
  int64_t length() const { return info_.length(); }
  // The last CacheInfo the server sent for this cache.
  const attention::v1::CacheInfo& info() const { return info_; }

  // Appends key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] at length().
  absl::StatusOr<attention::v1::CacheInfo> Append(const attention::v1::Tensor& key,
                                                  const attention::v1::Tensor& value);
  // One Decode of this cache alone: appends key/value when given (nullptr: none), then attends
  // `query` [heads, nq, head_dim] over the whole cache.
  absl::StatusOr<attention::v1::DecodeResponse> Decode(
      const attention::v1::Tensor& query, const attention::v1::Tensor* key = nullptr,
      const attention::v1::Tensor* value = nullptr,
      const attention::v1::AttentionOptions& options = {});
  // The DecodeItem for this cache in a batched Client::Decode, with expected_length = length().
  // After the call succeeds, pass Update the response's caches[i] for this item.
  attention::v1::DecodeItem Item(const attention::v1::Tensor& query,
                                 const attention::v1::Tensor* key = nullptr,
                                 const attention::v1::Tensor* value = nullptr) const;
  // Takes `info` (the server's answer naming this cache) as what the cache now holds.
  void Update(const attention::v1::CacheInfo& info) { info_ = info; }
  // Re-reads the cache's info (and so its length) from the server.
  absl::StatusOr<attention::v1::CacheInfo> Refresh();
  // Deletes the cache on the server.
  absl::Status Delete();

 private:
  Client* client_;
  attention::v1::CacheInfo info_;
};

}  // namespace attn::client
