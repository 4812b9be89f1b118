// attn client library: a thin, typed wrapper over the attention.v1 stub.
//
// Converts between host arrays (fp32 values with a shape) and wire Tensors, raises gRPC's
// message limits to the server's default, and reports every failure as an absl::Status whose
// code is the RPC's and whose message is the server's. A Client is thread-safe (the channel
// and stub are); each call may carry a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
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

}  // namespace attn::client
