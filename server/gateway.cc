#include "server/gateway.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <future>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/util/json_util.h"
#include "httplib.h"
#include "server/security.h"

namespace attn {
namespace {

using attention::v1::AppendCacheRequest;
using attention::v1::AttentionRequest;
using attention::v1::AttentionResponse;
using attention::v1::CacheInfo;
using attention::v1::CreateCacheRequest;
using attention::v1::DecodeRequest;
using attention::v1::DecodeResponse;
using attention::v1::DeleteCacheRequest;
using attention::v1::DeleteCacheResponse;
using attention::v1::ForkCacheRequest;
using attention::v1::GetCacheInfoRequest;
using attention::v1::GetServerInfoRequest;
using attention::v1::ListCachesRequest;
using attention::v1::ListCachesResponse;
using attention::v1::ServerInfo;
using attention::v1::TraceEvent;
using attention::v1::TraceRequest;
using attention::v1::TruncateCacheRequest;

constexpr char kJsonType[] = "application/json";
constexpr char kServicePath[] = "/attention.v1.AttentionService/";

// Every field printed (zeros and empty lists too), so a page need not know proto3's defaults;
// one line per message (an SSE data line must not break).
google::protobuf::util::JsonPrintOptions PrintOptions() {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = false;
  return options;
}

// A JSON string literal for `text` (quotes, backslashes and control characters escaped).
std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned char>(c));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

// {"code":"INVALID_ARGUMENT","message":"…"}: the body of every error answer and error event.
std::string ErrorJson(grpc::StatusCode code, absl::string_view message) {
  return absl::StrCat("{\"code\":\"", absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                      "\",\"message\":", JsonString(message), "}");
}

// The answer for a failed call or a refused request: HttpStatusFor(code), or `http_status` where
// the refusal has an HTTP status of its own (413, 415, …).
void WriteError(httplib::Response& response, grpc::StatusCode code, absl::string_view message,
                int http_status = 0) {
  response.status = http_status != 0 ? http_status : HttpStatusFor(code);
  if (code == grpc::StatusCode::UNAUTHENTICATED) {
    response.set_header("WWW-Authenticate", "Bearer");
  }
  response.set_content(ErrorJson(code, message) + "\n", kJsonType);
}

void WriteError(httplib::Response& response, const grpc::Status& status) {
  WriteError(response, status.error_code(), status.error_message());
}

void WriteJson(httplib::Response& response, const google::protobuf::Message& message) {
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, PrintOptions());
  if (!status.ok()) {
    WriteError(response, grpc::StatusCode::INTERNAL,
               absl::StrCat("cannot encode the answer as JSON: ",
                            absl::string_view(status.message().data(), status.message().size())));
    return;
  }
  json += '\n';
  response.set_content(json, kJsonType);
}

// Parses `body` as `message`'s JSON; false (with a 400 written) when it is not.
bool ParseBody(const std::string& body, google::protobuf::Message& message,
               httplib::Response& response) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(body, &message, options);
  if (status.ok()) return true;
  WriteError(response, grpc::StatusCode::INVALID_ARGUMENT,
             absl::StrCat("the body is not a ", message.GetDescriptor()->name(), " in JSON: ",
                          absl::string_view(status.message().data(), status.message().size())));
  return false;
}

// A parse step for Gateway::Unary: the request body as `Message`'s JSON.
template <typename Message>
std::function<bool(Message&, httplib::Response&)> JsonBody(const std::string& body) {
  return [&body](Message& message, httplib::Response& response) {
    return ParseBody(body, message, response);
  };
}

// A parse step for a cache's route (/v1/caches/ID/...): the body as `Message`'s JSON, its
// cache_id the path's (a body may leave it out; one that names another cache is refused).
template <typename Message>
std::function<bool(Message&, httplib::Response&)> BodyForPathCache(const httplib::Request& request,
                                                                   const std::string& body) {
  return [&request, &body](Message& message, httplib::Response& response) {
    if (!ParseBody(body, message, response)) return false;
    const std::string id = request.matches[1];
    if (!message.cache_id().empty() && message.cache_id() != id) {
      WriteError(
          response, grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("cacheId \"", message.cache_id(), "\" in the body is not the path's \"", id,
                       "\" (it may be left out)"));
      return false;
    }
    message.set_cache_id(id);
    return true;
  };
}

// A parse step for a route whose request message is empty (GET): the body is ignored.
template <typename Message>
bool NoBody(Message&, httplib::Response&) {
  return true;
}

// The call's timeout from an optional "X-Timeout-Ms" header, 0 when it has none; false (400
// written) when it is not an integer number of milliseconds in [1, kMaxTimeoutMs].
bool TimeoutOf(const httplib::Request& request, int64_t& milliseconds,
               httplib::Response& response) {
  milliseconds = 0;
  if (!request.has_header("X-Timeout-Ms")) return true;
  const std::string value = request.get_header_value("X-Timeout-Ms");
  if (!absl::SimpleAtoi(value, &milliseconds) || milliseconds < 1 || milliseconds > kMaxTimeoutMs) {
    milliseconds = 0;
    WriteError(response, grpc::StatusCode::INVALID_ARGUMENT,
               absl::StrCat("X-Timeout-Ms must be an integer number of milliseconds in [1, ",
                            kMaxTimeoutMs, "] (24 h), got \"", value, "\""));
    return false;
  }
  return true;
}

// The call's deadline from the X-Timeout-Ms header (checked already by the admission).
bool SetDeadline(const httplib::Request& request, grpc::ClientContext& context,
                 httplib::Response& response) {
  int64_t milliseconds = 0;
  if (!TimeoutOf(request, milliseconds, response)) return false;
  if (milliseconds > 0) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(milliseconds));
  }
  return true;
}

// Whether a Content-Type is JSON: "application/json", optionally with "; charset=utf-8" (any
// case, the charset possibly quoted). Nothing else, so a form or text/plain, which a page on
// another origin may send without a CORS preflight, never reaches a call.
bool IsJsonContentType(absl::string_view type) {
  const size_t semicolon = type.find(';');
  if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(type.substr(0, semicolon)),
                              "application/json")) {
    return false;
  }
  if (semicolon == absl::string_view::npos) return true;
  const absl::string_view parameter = absl::StripAsciiWhitespace(type.substr(semicolon + 1));
  const size_t equals = parameter.find('=');
  if (equals == absl::string_view::npos) return false;
  absl::string_view value = absl::StripAsciiWhitespace(parameter.substr(equals + 1));
  if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
    value = value.substr(1, value.size() - 2);
  }
  return absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(parameter.substr(0, equals)),
                                "charset") &&
         absl::EqualsIgnoreCase(value, "utf-8");
}

// Whether the call's deadline passed already (parsing a large body can take it all). Such a call
// is answered here, as a gRPC client fails it without sending: in-process, gRPC would hand the
// server a call without a method, which the request log would count as unknown.
bool Expired(const grpc::ClientContext& context, httplib::Response& response) {
  if (context.deadline() > std::chrono::system_clock::now()) return false;
  WriteError(response, grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded");
  return true;
}

// One server-sent event: "data: <json>\n\n" (the JSON mapping never holds a raw newline).
std::string SseEvent(absl::string_view json, absl::string_view event = "") {
  if (event.empty()) return absl::StrCat("data: ", json, "\n\n");
  return absl::StrCat("event: ", event, "\ndata: ", json, "\n\n");
}

// A Trace call being relayed to one HTTP response. Destroying it before the stream finished
// (the client went away) cancels the call, which stops the computation at its next event.
struct TraceRelay {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<TraceEvent>> reader;
  TraceEvent next;
  bool has_next = false;
  bool finished = false;
  std::function<void()> on_finish;  // Called once the call has finished.

  grpc::Status Finish() {
    const grpc::Status status = reader->Finish();
    finished = true;
    if (on_finish) on_finish();
    return status;
  }

  ~TraceRelay() {
    if (finished || reader == nullptr) return;
    context.TryCancel();
    while (reader->Read(&next)) {
    }
    Finish();
  }
};

// Escapes the regex metacharacters of a file name for httplib's route patterns.
std::string ExactPattern(absl::string_view path) {
  std::string pattern;
  for (const char c : path) {
    if (absl::string_view(".^$|()[]{}*+?\\").find(c) != absl::string_view::npos) pattern += '\\';
    pattern += c;
  }
  return pattern;
}

std::string ContentTypeFor(absl::string_view name) {
  const size_t dot = name.rfind('.');
  const absl::string_view extension =
      dot == absl::string_view::npos ? absl::string_view() : name.substr(dot + 1);
  if (extension == "html") return "text/html; charset=utf-8";
  if (extension == "js" || extension == "mjs") return "text/javascript; charset=utf-8";
  if (extension == "css") return "text/css; charset=utf-8";
  if (extension == "json") return "application/json";
  if (extension == "svg") return "image/svg+xml";
  if (extension == "png") return "image/png";
  if (extension == "ico") return "image/x-icon";
  return "application/octet-stream";
}

}  // namespace

int HttpStatusFor(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:
      return 400;
    case grpc::StatusCode::UNAUTHENTICATED:
      return 401;
    case grpc::StatusCode::PERMISSION_DENIED:
      return 403;
    case grpc::StatusCode::NOT_FOUND:
      return 404;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return 429;
    case grpc::StatusCode::CANCELLED:
      return 499;
    case grpc::StatusCode::UNAVAILABLE:
      return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return 504;
    default:
      return 500;
  }
}

Gateway::Gateway(GatewayConfig config)
    : config_(std::move(config)),
      body_limit_(static_cast<size_t>(config_.max_message_bytes / 3 * 4 + (int64_t{1} << 20))) {}

void Gateway::SetChannel(std::shared_ptr<grpc::Channel> channel) {
  std::unique_ptr<Stub> stub =
      channel != nullptr ? std::make_unique<Stub>(std::move(channel)) : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  stub_ = std::move(stub);
}

bool Gateway::StartCall(const std::function<void(Stub&)>& start,
                        httplib::Response& response) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stub_ == nullptr) {
    WriteError(response, grpc::StatusCode::UNAVAILABLE,
               "attnd is not serving gRPC (starting up or shutting down)");
    return false;
  }
  start(*stub_);
  ++calls_;
  return true;
}

void Gateway::CallFinished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--calls_ == 0) idle_.notify_all();
}

bool Gateway::Drain(std::chrono::system_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  stub_ = nullptr;
  return idle_.wait_until(lock, deadline, [this] { return calls_ == 0; });
}

void Gateway::AllowOrigin(httplib::Response& response) const {
  if (config_.cors_origin.empty()) return;
  response.set_header("Access-Control-Allow-Origin", config_.cors_origin);
  if (config_.cors_origin != "*") response.set_header("Vary", "Origin");
}

HeaderVerdict Gateway::CheckHeaders(const httplib::Request& request,
                                    httplib::Response& response) const {
  if (request.path != "/v1" && !absl::StartsWith(request.path, "/v1/")) {
    return HeaderVerdict::kPass;
  }
  AllowOrigin(response);
  const auto refuse = [&response](grpc::StatusCode code, int http_status,
                                  absl::string_view message) {
    WriteError(response, code, message, http_status);
    return HeaderVerdict::kAnswered;
  };
  const BodyFraming framing = BodyFramingOf(request);
  const auto no_body = [&]() -> HeaderVerdict {
    switch (framing.kind) {
      case BodyFraming::Kind::kNone:
        return HeaderVerdict::kAccept;
      case BodyFraming::Kind::kInvalid:
        return refuse(grpc::StatusCode::INVALID_ARGUMENT, 400, framing.problem);
      default:
        return refuse(grpc::StatusCode::RESOURCE_EXHAUSTED, 413,
                      absl::StrCat(request.method, " ", request.path, " takes no request body"));
    }
  };

  // The preflight carries no credentials (browsers never send them on one).
  if (request.method == "OPTIONS" && !config_.cors_origin.empty()) return no_body();
  if (config_.client_certificates_required) {
    return refuse(grpc::StatusCode::PERMISSION_DENIED, 0,
                  "the JSON gateway is off: gRPC requires client certificates "
                  "(--tls-client-ca), which the HTTP port cannot check; call attention.v1 over "
                  "gRPC");
  }

  const std::string method = request.method == "HEAD" ? "GET" : request.method;
  const Route* route = nullptr;
  std::string allowed;  // The path's other methods, for a 405.
  for (const Route& candidate : routes_) {
    if (!std::regex_match(request.path, candidate.pattern)) continue;
    if (candidate.method == method) {
      route = &candidate;
    } else {
      absl::StrAppend(&allowed, allowed.empty() ? "" : ", ", candidate.method);
    }
  }

  if (!config_.auth_token.empty()) {
    std::vector<std::string> values;
    const size_t count = request.get_header_value_count("Authorization");
    for (size_t i = 0; i < count; ++i) {
      values.push_back(request.get_header_value("Authorization", i));
    }
    const std::vector<absl::string_view> views(values.begin(), values.end());
    const absl::Status status = CheckBearerToken(
        config_.auth_token, absl::StrCat(kServicePath, route != nullptr ? route->rpc : "Unknown"),
        views);
    if (!status.ok()) return refuse(grpc::StatusCode::UNAUTHENTICATED, 0, status.message());
  }

  if (route == nullptr) {
    if (allowed.empty()) {
      return refuse(grpc::StatusCode::NOT_FOUND, 404,
                    absl::StrCat("no JSON gateway route ", request.path));
    }
    response.set_header("Allow", allowed);
    return refuse(grpc::StatusCode::UNIMPLEMENTED, 405,
                  absl::StrCat(request.path, " takes ", allowed, ", not ", request.method));
  }

  if (route->method != "POST") {
    if (const HeaderVerdict verdict = no_body(); verdict != HeaderVerdict::kAccept) {
      return verdict;
    }
  } else {
    const std::string type = request.get_header_value("Content-Type");
    if (request.get_header_value_count("Content-Type") != 1 || !IsJsonContentType(type)) {
      return refuse(grpc::StatusCode::INVALID_ARGUMENT, 415,
                    absl::StrCat("Content-Type must be application/json (optionally \"; "
                                 "charset=utf-8\"), got \"",
                                 type, "\""));
    }
    const std::string encoding = request.get_header_value("Content-Encoding");
    if (request.has_header("Content-Encoding") && !absl::EqualsIgnoreCase(encoding, "identity")) {
      return refuse(grpc::StatusCode::INVALID_ARGUMENT, 415,
                    absl::StrCat("Content-Encoding \"", encoding,
                                 "\" is not accepted: send the JSON uncompressed"));
    }
    switch (framing.kind) {
      case BodyFraming::Kind::kInvalid:
        return refuse(grpc::StatusCode::INVALID_ARGUMENT, 400, framing.problem);
      case BodyFraming::Kind::kUntilClose:
        return refuse(grpc::StatusCode::INVALID_ARGUMENT, 411,
                      absl::StrCat("POST ", request.path,
                                   " needs a Content-Length or Transfer-Encoding: chunked"));
      case BodyFraming::Kind::kLength:
        if (framing.length > body_limit_) {
          return refuse(
              grpc::StatusCode::RESOURCE_EXHAUSTED, 413,
              absl::StrCat("Content-Length ", framing.length, " is over the limit of ", body_limit_,
                           " bytes for a JSON body (4/3 of --max-message-bytes, plus "
                           "1 MiB)"));
        }
        break;
      default:
        break;  // No body (the parser says what is missing) or chunked (read up to the limit).
    }
  }

  int64_t milliseconds = 0;
  if (!TimeoutOf(request, milliseconds, response)) return HeaderVerdict::kAnswered;
  return HeaderVerdict::kAccept;
}

void Gateway::Guard(httplib::Response& response, const std::function<void()>& handle) const {
  grpc::StatusCode code = grpc::StatusCode::INTERNAL;
  std::string message;
  try {
    handle();
    return;
  } catch (const std::bad_alloc&) {
    code = grpc::StatusCode::RESOURCE_EXHAUSTED;
    message = "attnd ran out of memory answering this request; retry later or send less";
  } catch (const std::exception& e) {
    message = absl::StrCat("the JSON gateway failed: ", e.what());
  } catch (...) {
    message = "the JSON gateway failed";
  }
  response = httplib::Response();
  AllowOrigin(response);
  WriteError(response, code, message);
  CloseAfterAnswer(response);  // The handler may have left the body half read.
}

void Gateway::AddRoute(httplib::Server& server, const std::string& method,
                       const std::string& pattern, const std::string& rpc, Handler handler) {
  routes_.push_back({method, std::regex(pattern), rpc});
  const auto guarded = [this, handler = std::move(handler)](const httplib::Request& request,
                                                            httplib::Response& response) {
    Guard(response, [&] { handler(request, response); });
  };
  if (method == "DELETE") {
    server.Delete(pattern, guarded);
  } else {
    server.Get(pattern, guarded);
  }
}

void Gateway::AddPostRoute(httplib::Server& server, const std::string& pattern,
                           const std::string& rpc, BodyHandler handler) {
  routes_.push_back({"POST", std::regex(pattern), rpc});
  // A content-reader route: httplib leaves the body to the handler, which reads it within the
  // limit (a chunked body too, which httplib 0.11 would read without one) and the minimum rate.
  server.Post(pattern, [this, handler = std::move(handler)](const httplib::Request& request,
                                                            httplib::Response& response,
                                                            const httplib::ContentReader& reader) {
    Guard(response, [&] {
      std::string body;
      switch (ReadRequestBody(request, reader, body_limit_, body)) {
        case BodyRead::kComplete:
          handler(request, body, response);
          return;
        case BodyRead::kTooLarge:
          WriteError(response, grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat("the request body is over the limit of ", body_limit_,
                                  " bytes for a JSON body (4/3 of --max-message-bytes, plus 1 "
                                  "MiB)"),
                     413);
          break;
        case BodyRead::kTooSlow:
          WriteError(
              response, grpc::StatusCode::DEADLINE_EXCEEDED,
              absl::StrCat("the request body stalled for ", kReadTimeout.count(),
                           " s or came slower than ", kMinBodyBytesPerSecond >> 10, " KiB/s"),
              408);
          break;
        case BodyRead::kFailed:
          WriteError(response, grpc::StatusCode::INVALID_ARGUMENT,
                     "the request body ended early or its chunked framing is bad", 400);
          break;
      }
      CloseAfterAnswer(response);
    });
  });
}

void Gateway::AddRoutes(HttpPort& port) {
  httplib::Server& server = port.server();
  // A second line behind the admission, which refuses a larger Content-Length unread.
  server.set_payload_max_length(body_limit_);
  port.AddHeaderCheck([this](const httplib::Request& request, httplib::Response& response) {
    return CheckHeaders(request, response);
  });

  AddPostRoute(
      server, "/v1/naive", "Naive",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) { Compute(Method::kNaive, request, body, response); });
  AddPostRoute(
      server, "/v1/tiled", "Tiled",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) { Compute(Method::kTiled, request, body, response); });
  AddPostRoute(server, "/v1/trace", "Trace",
               [this](const httplib::Request& request, const std::string& body,
                      httplib::Response& response) { Trace(request, body, response); });
  AddRoute(server, "GET", "/v1/info", "GetServerInfo",
           [this](const httplib::Request& request, httplib::Response& response) {
             Unary<GetServerInfoRequest, ServerInfo>(
                 request, response, NoBody<GetServerInfoRequest>,
                 [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
                   stub.async()->GetServerInfo(context, call_request, call_response,
                                               std::move(done));
                 });
           });

  // KV caches. The id in a path is passed as it is: the service answers NOT_FOUND for any id it
  // does not hold.
  constexpr char kCachePath[] = R"(/v1/caches/([^/]+))";
  AddPostRoute(
      server, "/v1/caches", "CreateCache",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) {
        Unary<CreateCacheRequest, CacheInfo>(
            request, response, JsonBody<CreateCacheRequest>(body),
            [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
              stub.async()->CreateCache(context, call_request, call_response, std::move(done));
            });
      });
  AddRoute(server, "GET", "/v1/caches", "ListCaches",
           [this](const httplib::Request& request, httplib::Response& response) {
             Unary<ListCachesRequest, ListCachesResponse>(
                 request, response, NoBody<ListCachesRequest>,
                 [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
                   stub.async()->ListCaches(context, call_request, call_response, std::move(done));
                 });
           });
  AddRoute(server, "GET", kCachePath, "GetCacheInfo",
           [this](const httplib::Request& request, httplib::Response& response) {
             Unary<GetCacheInfoRequest, CacheInfo>(
                 request, response,
                 [&request](GetCacheInfoRequest& call_request, httplib::Response&) {
                   call_request.set_cache_id(request.matches[1]);
                   return true;
                 },
                 [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
                   stub.async()->GetCacheInfo(context, call_request, call_response,
                                              std::move(done));
                 });
           });
  AddRoute(server, "DELETE", kCachePath, "DeleteCache",
           [this](const httplib::Request& request, httplib::Response& response) {
             Unary<DeleteCacheRequest, DeleteCacheResponse>(
                 request, response,
                 [&request](DeleteCacheRequest& call_request, httplib::Response&) {
                   call_request.set_cache_id(request.matches[1]);
                   return true;
                 },
                 [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
                   stub.async()->DeleteCache(context, call_request, call_response, std::move(done));
                 });
           });
  AddPostRoute(
      server, absl::StrCat(kCachePath, "/append"), "AppendCache",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) {
        Unary<AppendCacheRequest, CacheInfo>(
            request, response, BodyForPathCache<AppendCacheRequest>(request, body),
            [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
              stub.async()->AppendCache(context, call_request, call_response, std::move(done));
            });
      });
  AddPostRoute(
      server, absl::StrCat(kCachePath, "/truncate"), "TruncateCache",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) {
        Unary<TruncateCacheRequest, CacheInfo>(
            request, response, BodyForPathCache<TruncateCacheRequest>(request, body),
            [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
              stub.async()->TruncateCache(context, call_request, call_response, std::move(done));
            });
      });
  AddPostRoute(
      server, absl::StrCat(kCachePath, "/fork"), "ForkCache",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) {
        Unary<ForkCacheRequest, CacheInfo>(
            request, response, BodyForPathCache<ForkCacheRequest>(request, body),
            [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
              stub.async()->ForkCache(context, call_request, call_response, std::move(done));
            });
      });
  AddPostRoute(
      server, "/v1/decode", "Decode",
      [this](const httplib::Request& request, const std::string& body,
             httplib::Response& response) {
        Unary<DecodeRequest, DecodeResponse>(
            request, response, JsonBody<DecodeRequest>(body),
            [](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
              stub.async()->Decode(context, call_request, call_response, std::move(done));
            });
      });
  if (!config_.cors_origin.empty()) {
    server.Options(R"(/v1/.*)", [this](const httplib::Request&, httplib::Response& response) {
      AllowOrigin(response);
      response.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
      response.set_header("Access-Control-Allow-Headers",
                          "Authorization, Content-Type, X-Timeout-Ms");
      response.set_header("Access-Control-Max-Age", "600");
      response.status = 204;
    });
  }

  // The viewer: served without a token (the page asks for it), never cached stale.
  for (const EmbeddedFile& file : ViewerFiles()) {
    const std::string type = ContentTypeFor(file.name);
    const auto serve = [file, type](const httplib::Request&, httplib::Response& response) {
      response.set_header("Cache-Control", "no-cache");
      response.set_content(file.contents.data(), file.contents.size(), type.c_str());
    };
    server.Get(absl::StrCat("/", ExactPattern(file.name)), serve);
    if (file.name == "index.html") server.Get("/", serve);
  }
}

template <typename CallRequest, typename CallResponse>
void Gateway::Unary(
    const httplib::Request& request, httplib::Response& response,
    const std::function<bool(CallRequest&, httplib::Response&)>& parse,
    const std::function<void(Stub&, grpc::ClientContext*, const CallRequest*, CallResponse*,
                             std::function<void(grpc::Status)>)>& start) const {
  grpc::ClientContext context;  // The deadline counts from here, parsing included.
  if (!SetDeadline(request, context, response)) return;
  CallRequest call_request;
  if (!parse(call_request, response) || Expired(context, response)) return;
  CallResponse call_response;
  std::promise<grpc::Status> finished;
  const auto done = [&finished](grpc::Status status) { finished.set_value(std::move(status)); };
  const bool started = StartCall(
      [&](Stub& stub) { start(stub, &context, &call_request, &call_response, done); }, response);
  if (!started) return;
  // Nothing here throws while the call runs: it refers to the locals above until `done`.
  const grpc::Status status = finished.get_future().get();
  CallFinished();
  if (!status.ok()) return WriteError(response, status);
  WriteJson(response, call_response);
}

void Gateway::Compute(Method method, const httplib::Request& request, const std::string& body,
                      httplib::Response& response) const {
  Unary<AttentionRequest, AttentionResponse>(
      request, response, JsonBody<AttentionRequest>(body),
      [method](Stub& stub, auto* context, auto* call_request, auto* call_response, auto done) {
        if (method == Method::kNaive) {
          stub.async()->Naive(context, call_request, call_response, std::move(done));
        } else {
          stub.async()->Tiled(context, call_request, call_response, std::move(done));
        }
      });
}

void Gateway::Trace(const httplib::Request& request, const std::string& body,
                    httplib::Response& response) const {
  auto relay = std::make_shared<TraceRelay>();
  if (!SetDeadline(request, relay->context, response)) return;
  TraceRequest call_request;
  if (!ParseBody(body, call_request, response) || Expired(relay->context, response)) return;
  // Set before the call starts, so nothing that could throw comes between the two.
  relay->on_finish = [this] { CallFinished(); };
  const bool started = StartCall(
      [&](Stub& stub) { relay->reader = stub.Trace(&relay->context, call_request); }, response);
  if (!started) return;
  // The first event decides the HTTP status: a request the service refuses fails before it.
  relay->has_next = relay->reader->Read(&relay->next);
  if (!relay->has_next) {
    const grpc::Status status = relay->Finish();
    if (!status.ok()) return WriteError(response, status);
  }
  response.set_header("Cache-Control", "no-cache");
  response.set_header("X-Accel-Buffering", "no");  // Proxies: do not hold events back.
  // httplib calls this until it signals done or a write fails (the client went away, or stopped
  // reading for kWriteTimeout, and the relay's destructor cancels the call). Each call writes one
  // event and reads the next, so the computation advances only as fast as the client reads.
  // httplib calls it outside its exception handling: an exception ends the stream here.
  response.set_chunked_content_provider(
      "text/event-stream", [relay](size_t /*offset*/, httplib::DataSink& sink) {
        try {
          if (relay->has_next) {
            std::string json;
            const auto status =
                google::protobuf::util::MessageToJsonString(relay->next, &json, PrintOptions());
            if (!status.ok()) {
              json = ErrorJson(grpc::StatusCode::INTERNAL, "cannot encode a TraceEvent as JSON");
            }
            const std::string event = SseEvent(json, status.ok() ? "" : "error");
            if (!sink.write(event.data(), event.size())) return false;
            if (!status.ok()) {  // Ends the stream; the relay's destructor cancels the call.
              sink.done();
              return true;
            }
            relay->has_next = relay->reader->Read(&relay->next);
            return true;
          }
          if (!relay->finished) {
            const grpc::Status status = relay->Finish();
            if (!status.ok()) {
              const std::string event =
                  SseEvent(ErrorJson(status.error_code(), status.error_message()), "error");
              if (!sink.write(event.data(), event.size())) return false;
            }
          }
          sink.done();
          return true;
        } catch (...) {
          return false;  // Drops the connection; the relay's destructor cancels the call.
        }
      });
}

}  // namespace attn
