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
// Admission, from the headers alone, before any body is read (an HttpPort header check, see
// http_port.h; a refused request that announced a body has its connection closed unread), in
// this order, every answer JSON as below:
//   - OPTIONS: the CORS preflight (below) when cors_origin is set; it needs no token.
//   - client_certificates_required (gRPC's --tls-client-ca): 403 PERMISSION_DENIED for every
//     other /v1 request; HTTP has no client certificate to check, so the gateway is off.
//   - the bearer token: 401 UNAUTHENTICATED (with WWW-Authenticate: Bearer), gRPC's message.
//   - the route: an unknown /v1 path is 404 NOT_FOUND; a known one with another method 405
//     UNIMPLEMENTED (with Allow).
//   - the body: GET, HEAD and DELETE take none (a Content-Length > 0 or a Transfer-Encoding is
//     413 RESOURCE_EXHAUSTED). A POST must say Content-Type: application/json (optionally
//     "; charset=utf-8"), without a Content-Encoding, else 415 INVALID_ARGUMENT, so no
//     cross-origin "simple request" (text/plain, a form) reaches a call; its body is
//     Content-Length or chunked (neither: 411), at most body_limit() bytes (a larger
//     Content-Length is 413 before any of it is read; a chunked body is read up to the limit,
//     then 413). Malformed framing (two lengths, a length and chunked, another encoding) is 400.
//   - X-Timeout-Ms, when sent: an integer in [1, kMaxTimeoutMs], else 400 INVALID_ARGUMENT.
// A body that stalls for kReadTimeout or trickles below kMinBodyBytesPerSecond (http_port.h) is
// 408 DEADLINE_EXCEEDED, one that ends early 400; either closes the connection.
//
// Errors: the gRPC status as {"code":"INVALID_ARGUMENT","message":"<gRPC's message>"} with an
// HTTP status by HttpStatusFor (the admission answers above use the HTTP status named there);
// a body that is not the message's JSON is 400 INVALID_ARGUMENT with the parser's message. A
// Trace that fails after its first event ends its stream with an "event: error" whose data is
// that JSON. An optional request header "X-Timeout-Ms: <ms>" sets the call's deadline
// (DEADLINE_EXCEEDED → 504). A handler that throws answers 429 RESOURCE_EXHAUSTED for
// std::bad_alloc, 500 INTERNAL for anything else, and the process goes on.
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
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/http_port.h"

namespace httplib {
class Server;
class ContentReader;
struct Request;
struct Response;
}  // namespace httplib

namespace attn {

struct GatewayConfig {
  std::string cors_origin{};  // Access-Control-Allow-Origin value; empty = no CORS headers.
  std::string auth_token{};   // Bearer token /v1 calls must send; empty = no check.
  // The gRPC message limit; JSON bodies may be 4/3 of it (base64) plus 1 MiB, larger is 413.
  int64_t max_message_bytes = int64_t{1} << 30;
  // gRPC requires client certificates (--tls-client-ca): /v1 calls are refused (403).
  bool client_certificates_required = false;
};

// The largest X-Timeout-Ms accepted: 24 hours.
inline constexpr int64_t kMaxTimeoutMs = int64_t{24} * 60 * 60 * 1000;

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

  // Adds the routes above to `port`'s server, their admission as a header check of `port`, and
  // raises the server's request body limit to body_limit(); call once, before the port starts.
  void AddRoutes(HttpPort& port);

  // The largest POST body: 4/3 of max_message_bytes (base64) plus 1 MiB for the other fields.
  size_t body_limit() const { return body_limit_; }

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
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  // A POST route's handler, given the body ReadRequestBody read.
  using BodyHandler =
      std::function<void(const httplib::Request&, const std::string& body, httplib::Response&)>;

  // One /v1 route as AddRoutes registered it; the header check looks requests up here.
  struct Route {
    std::string method;  // "GET" (HEAD too), "POST" or "DELETE".
    std::regex pattern;  // The path, as httplib matches it.
    std::string rpc;     // The attention.v1 method it calls ("Naive", …), for the token check.
  };

  // Registers a GET or DELETE route (no body) or a POST route (its body read within
  // body_limit()), each handler run under Guard.
  void AddRoute(httplib::Server& server, const std::string& method, const std::string& pattern,
                const std::string& rpc, Handler handler);
  void AddPostRoute(httplib::Server& server, const std::string& pattern, const std::string& rpc,
                    BodyHandler handler);
  // The admission above, for the HttpPort; kPass for paths outside /v1.
  HeaderVerdict CheckHeaders(const httplib::Request& request, httplib::Response& response) const;
  // Runs `handle`; an exception it lets out becomes the answer (429 RESOURCE_EXHAUSTED for
  // std::bad_alloc, 500 INTERNAL otherwise) and the connection is closed after it.
  void Guard(httplib::Response& response, const std::function<void()>& handle) const;

  // Runs `start`, which must only start a call on the stub (never wait for it), while the gateway
  // has a channel; false, with 503 UNAVAILABLE written, when it has none. Calls start only under
  // mutex_, so none starts once SetChannel(nullptr) has returned.
  bool StartCall(const std::function<void(Stub&)>& start, httplib::Response& response) const;
  // Each call StartCall started must end with exactly one CallFinished.
  void CallFinished() const;
  // Adds the CORS header when configured.
  void AllowOrigin(httplib::Response& response) const;

  // One unary call (admitted already by CheckHeaders): sets its deadline, fills the call's
  // request with `parse` (false: it wrote the error), starts it with `start` (which calls the
  // stub's async method with the context, request, response and callback given) and answers
  // the response as JSON.
  template <typename CallRequest, typename CallResponse>
  void Unary(
      const httplib::Request& request, httplib::Response& response,
      const std::function<bool(CallRequest&, httplib::Response&)>& parse,
      const std::function<void(Stub&, grpc::ClientContext*, const CallRequest*, CallResponse*,
                               std::function<void(grpc::Status)>)>& start) const;

  void Compute(Method method, const httplib::Request& request, const std::string& body,
               httplib::Response& response) const;
  void Trace(const httplib::Request& request, const std::string& body,
             httplib::Response& response) const;

  const GatewayConfig config_;
  const size_t body_limit_;
  std::vector<Route> routes_;  // Filled by AddRoutes before serving, read-only after.
  mutable std::mutex mutex_;
  std::unique_ptr<Stub> stub_;            // Guarded by mutex_.
  mutable int64_t calls_ = 0;             // Calls started, not finished; guarded by mutex_.
  mutable std::condition_variable idle_;  // Notified when calls_ drops to 0.
};

}  // namespace attn
