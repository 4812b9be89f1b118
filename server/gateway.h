// Gateway: attention.v1 as JSON over attnd's HTTP port, and the trace viewer's page.
//
//   POST /v1/naive   AttentionRequest JSON → AttentionResponse JSON
//   POST /v1/tiled   AttentionRequest JSON → AttentionResponse JSON
//   POST /v1/trace   TraceRequest JSON → text/event-stream, one "data: <TraceEvent JSON>" event
//                    per TraceEvent, written as the server produces them
//   GET  /v1/info    ServerInfo JSON
//   KV caches (one route per cache RPC; ID is the cache_id, 32 hex digits):
//   POST   /v1/caches            CreateCacheRequest JSON → CacheInfo JSON
//   GET    /v1/caches            ListCachesResponse JSON (the caller's caches)
//   GET    /v1/caches/ID         CacheInfo JSON (GetCacheInfo)
//   DELETE /v1/caches/ID         DeleteCacheResponse JSON ({})
//   POST   /v1/caches/ID/append  AppendCacheRequest JSON (its cacheId may be left out; if given it
//                                must be ID) → CacheInfo JSON
//   POST   /v1/decode            DecodeRequest JSON → DecodeResponse JSON
//   (Naive, Tiled and Trace take AttentionRequest.cacheId like any other field.) Caches made
//   through the gateway belong to the server's token identity (CallerIdentity: the gateway's
//   in-process calls carry no client certificate), the same as a gRPC caller's without mTLS.
//   GET  /           the viewer's index.html; GET /<file> its other files (ViewerFiles())
//
// Bodies and answers use protobuf's JSON mapping (google::protobuf::util): lowerCamelCase field
// names (the parser also takes the proto names), bytes as base64, int64 as strings, ±inf/NaN as
// "Infinity"/"-Infinity"/"NaN", and every field printed, defaults included. Unknown fields are
// refused.
//
// Not a second implementation: every call goes to attnd's own gRPC server through its in-process
// channel, so validation, admission, limits, metrics and the request log are the gRPC path's
// (the log's peer is the in-process transport's). gRPC's in-process transport skips the
// listener's credentials and thus its token check, so the gateway applies the same check
// (CheckBearerToken) to the HTTP Authorization header itself; the token is never passed on.
//
// Errors: the gRPC status as {"code":"INVALID_ARGUMENT","message":"<gRPC's message>"} with an
// HTTP status by HttpStatusFor; a body that is not the message's JSON is 400 INVALID_ARGUMENT
// with the parser's message. A Trace that fails after its first event ends its stream with an
// "event: error" whose data is that JSON. An optional request header "X-Timeout-Ms: <ms>" sets
// the call's deadline (DEADLINE_EXCEEDED → 504).
//
// CORS: with a non-empty cors_origin every /v1 answer carries Access-Control-Allow-Origin:
// <cors_origin>, and OPTIONS preflights on /v1/... are answered (Authorization, Content-Type and
// X-Timeout-Ms allowed); with an empty one no CORS header is sent.
//
// Thread-safety: handlers run concurrently on the HTTP port's workers; SetChannel may be called
// at any time. The gateway must outlive the HTTP server's serving.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace attn {

struct GatewayConfig {
  std::string cors_origin{};  // Access-Control-Allow-Origin value; empty = no CORS headers.
  std::string auth_token{};   // Bearer token /v1 calls must send; empty = no check.
  // The gRPC message limit; JSON bodies may be 4/3 of it (base64) plus 1 MiB, larger is 413.
  int64_t max_message_bytes = int64_t{1} << 30;
};

// The HTTP status for a gRPC status code: INVALID_ARGUMENT, OUT_OF_RANGE and FAILED_PRECONDITION
// 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429,
// CANCELLED 499, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, OK 200, anything else 500.
int HttpStatusFor(grpc::StatusCode code);

// One file embedded in the binary at build time (cmake/embed_files.cmake over client/viewer/).
struct EmbeddedFile {
  absl::string_view name;  // File name, e.g. "viewer.js".
  absl::string_view contents;
};
// The viewer's files, in the generated source; empty when client/viewer/ held none.
absl::Span<const EmbeddedFile> ViewerFiles();

class Gateway {
 public:
  explicit Gateway(GatewayConfig config);
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  // Adds the routes above to `server` and raises its request body limit; call before it starts.
  void AddRoutes(httplib::Server& server);

  // The channel calls go through: the gRPC server's InProcessChannel once it is built. Until it
  // is set (and after it is reset to null) /v1 calls answer 503 UNAVAILABLE. Once
  // SetChannel(nullptr) returns no new call starts, while calls already started run on: reset it
  // (or Drain) before shutting the gRPC server down (gRPC 1.51 crashes starting an in-process
  // call on a server that has shut down).
  void SetChannel(std::shared_ptr<grpc::Channel> channel);

  // Shutdown: stops new calls as SetChannel(nullptr) does, then waits until the calls in flight
  // have finished (a trace stream when its client has read it) or `deadline` has passed. True
  // when none is left. gRPC's in-process transport ends its calls as soon as the server starts
  // shutting down, so main drains the gateway first to give its calls the same grace.
  bool Drain(std::chrono::system_clock::time_point deadline);

 private:
  using Stub = attention::v1::AttentionService::Stub;
  enum class Method { kNaive, kTiled };

  // Runs `start`, which must only start a call on the stub (never wait for it), while the gateway
  // has a channel; false, with 503 UNAVAILABLE written, when it has none. Calls start only under
  // mutex_, so none starts once SetChannel(nullptr) has returned.
  bool StartCall(const std::function<void(Stub&)>& start, httplib::Response& response) const;
  // Each call StartCall started must end with exactly one CallFinished.
  void CallFinished() const;
  // Adds the CORS header when configured.
  void AllowOrigin(httplib::Response& response) const;
  // Adds the CORS header and checks the bearer token for `method` ("Naive", …). True when the
  // call may proceed; otherwise the error is written to `response`.
  bool Admit(const httplib::Request& request, absl::string_view method,
             httplib::Response& response) const;

  // One unary call: admits `request` for `method`, sets its deadline, fills the call's request
  // with `parse` (false: it wrote the error), starts it with `start` (which calls the stub's
  // async method with the context, request, response and callback given) and answers the
  // response as JSON.
  template <typename CallRequest, typename CallResponse>
  void Unary(
      absl::string_view method, const httplib::Request& request, httplib::Response& response,
      const std::function<bool(CallRequest&, httplib::Response&)>& parse,
      const std::function<void(Stub&, grpc::ClientContext*, const CallRequest*, CallResponse*,
                               std::function<void(grpc::Status)>)>& start) const;

  void Compute(Method method, const httplib::Request& request, httplib::Response& response) const;
  void Trace(const httplib::Request& request, httplib::Response& response) const;

  const GatewayConfig config_;
  mutable std::mutex mutex_;
  std::unique_ptr<Stub> stub_;            // Guarded by mutex_.
  mutable int64_t calls_ = 0;             // Calls started, not finished; guarded by mutex_.
  mutable std::condition_variable idle_;  // Notified when calls_ drops to 0.
};

}  // namespace attn
