#include "server/request_log.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/interceptor.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"
#include "proto/tensor_shape.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using grpc::experimental::InterceptionHookPoints;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxLoggedPathBytes = 128;  // A hostile method name is cut here in the log.
constexpr char kUnknown[] = "unknown";

// The code's name as gRPC and absl spell it ("INVALID_ARGUMENT"); "UNKNOWN" for a number
// outside the enum, so a metric label or log field is never empty. absl::StatusCode has
// grpc::StatusCode's numbers.
std::string CodeName(grpc::StatusCode code) {
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

// A logfmt value: bare when it is plain, else double-quoted with \" \\ and control characters
// escaped, so a message or a peer can never break the line or forge a field.
std::string LogValue(absl::string_view value) {
  bool plain = !value.empty();
  for (const unsigned char c : value) {
    if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f) plain = false;
  }
  if (plain) return std::string(value);
  std::string out = "\"";
  for (const unsigned char c : value) {
    if (c == '"' || c == '\\') {
      absl::StrAppend(&out, "\\", std::string(1, static_cast<char>(c)));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < ' ' || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  return out;
}

// "B,H,Nq,Nk,d" when the query and key have one rank in [2, 4] (NormalizedShape), else "?": the
// line still says what the client sent when it is valid, and the status message says what is
// wrong when it is not.
std::string DescribeShape(const v1::AttentionRequest& request) {
  const std::optional<TensorDims> q = NormalizedShape(request.query());
  const std::optional<TensorDims> k = NormalizedShape(request.key());
  if (!q || !k || request.key().shape_size() != request.query().shape_size()) return "?";
  return absl::StrCat(q->batch, ",", q->heads, ",", q->len, ",", k->len, ",", q->dim);
}

void Describe(const v1::AttentionRequest& request, RequestRecord* record) {
  record->shape = DescribeShape(request);
  const std::optional<DType> dtype = FromProtoDType(request.query().dtype());
  record->dtype = dtype.has_value() ? DTypeName(*dtype) : "?";
}

// How to read the request of the attention.v1 methods (the only ones whose message type is
// known for certain here; another service's message is left alone).
enum class RequestKind { kOther, kAttention, kTrace, kServerInfo };

RequestKind KindOf(absl::string_view path) {
  static const std::string prefix =
      absl::StrCat("/", v1::AttentionService::service_full_name(), "/");
  if (path.substr(0, prefix.size()) != prefix) return RequestKind::kOther;
  const absl::string_view method = path.substr(prefix.size());
  if (method == "Naive" || method == "Tiled") return RequestKind::kAttention;
  if (method == "Trace") return RequestKind::kTrace;
  if (method == "GetServerInfo") return RequestKind::kServerInfo;
  return RequestKind::kOther;
}

// Services whose methods are named without the generated descriptor pool: gRPC's reflection
// (on raw ByteBuffers) and grpc.health.v1 (attnd's own, server/health.h).
constexpr absl::string_view kBuiltInMethods[] = {
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
};

// Splits "/service/method" into its parts when it is one of gRPC's built-in methods or the
// generated descriptor pool has it (attention.v1), else "unknown" for both.
void NameMethod(absl::string_view path, RequestRecord* record) {
  record->service = kUnknown;
  record->method = kUnknown;
  if (path.size() < 4 || path[0] != '/') return;
  const size_t slash = path.rfind('/');
  if (slash == 0 || slash + 1 == path.size()) return;
  const absl::string_view service = path.substr(1, slash - 1);
  const absl::string_view method = path.substr(slash + 1);
  const bool built_in = std::find(std::begin(kBuiltInMethods), std::end(kBuiltInMethods), path) !=
                        std::end(kBuiltInMethods);
  if (!built_in && google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
                       absl::StrCat(service, ".", method)) == nullptr) {
    return;
  }
  record->service = std::string(service);
  record->method = std::string(method);
}

// One per call: gathers the call's record from the hooks and hands it to the observer when the
// server sends the status (or, should the call end without one, when it is destroyed).
class ObservingInterceptor final : public grpc::experimental::Interceptor {
 public:
  ObservingInterceptor(RequestObserver& observer, grpc::experimental::ServerRpcInfo* info)
      : observer_(observer), info_(info), start_(Clock::now()) {
    const char* path = info->method();
    record_.path = path != nullptr ? path : "";
    if (record_.path.size() > kMaxLoggedPathBytes) record_.path.resize(kMaxLoggedPathBytes);
    kind_ = KindOf(record_.path);
    NameMethod(record_.path, &record_);
    observer_.Started(record_.service, record_.method);
  }

  ~ObservingInterceptor() override {
    // The context is being torn down by now: leave the peer unread.
    if (!finished_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call ended without a status"),
             /*read_peer=*/false);
    }
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      ReadRequest(methods->GetRecvMessage());
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      const grpc::ByteBuffer* message = methods->GetSerializedSendMessage();
      if (message != nullptr) {
        bytes_sent_.fetch_add(static_cast<int64_t>(message->Length()), std::memory_order_relaxed);
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Finish(methods->GetSendStatus(), /*read_peer=*/true);
    }
    methods->Proceed();
  }

 private:
  // `message` is the generated type of an attention.v1 method (gRPC hands it over as void*).
  void ReadRequest(const void* message) {
    if (message == nullptr) return;
    switch (kind_) {
      case RequestKind::kAttention: {
        const auto* request = static_cast<const v1::AttentionRequest*>(message);
        Describe(*request, &record_);
        bytes_received_ += static_cast<int64_t>(request->ByteSizeLong());
        break;
      }
      case RequestKind::kTrace: {
        const auto* request = static_cast<const v1::TraceRequest*>(message);
        Describe(request->attention(), &record_);
        bytes_received_ += static_cast<int64_t>(request->ByteSizeLong());
        break;
      }
      case RequestKind::kServerInfo:
        bytes_received_ += static_cast<int64_t>(
            static_cast<const v1::GetServerInfoRequest*>(message)->ByteSizeLong());
        break;
      case RequestKind::kOther:
        break;
    }
  }

  void Finish(const grpc::Status& status, bool read_peer) {
    finished_ = true;
    record_.code = status.error_code();
    record_.message = status.error_message();
    record_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    record_.bytes_received = bytes_received_;
    record_.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    grpc::ServerContextBase* context = read_peer ? info_->server_context() : nullptr;
    if (context != nullptr) record_.peer = context->peer();
    observer_.Finished(record_);
  }

  RequestObserver& observer_;
  grpc::experimental::ServerRpcInfo* const info_;
  const Clock::time_point start_;
  RequestKind kind_ = RequestKind::kOther;
  RequestRecord record_;
  int64_t bytes_received_ = 0;          // Requests: only the one of a unary/server-stream call.
  std::atomic<int64_t> bytes_sent_{0};  // Responses: may be written beside a read (bidi).
  bool finished_ = false;
};

class ObserverFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ObserverFactory(RequestObserver& observer) : observer_(observer) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ObservingInterceptor(observer_, info);
  }

 private:
  RequestObserver& observer_;
};

// Failed calls are errors; attention.v1 calls info; the rest (health, reflection) debug. A health
// Watch has no successful end: its client leaving (CANCELLED) or the server's shutdown
// (UNAVAILABLE) is how it always ends, so those are debug too.
LogLevel LevelOf(const RequestRecord& record) {
  const bool watch_ended =
      record.path == "/grpc.health.v1.Health/Watch" &&
      (record.code == grpc::StatusCode::CANCELLED || record.code == grpc::StatusCode::UNAVAILABLE);
  if (record.code != grpc::StatusCode::OK && !watch_ended) return LogLevel::kError;
  if (record.service == v1::AttentionService::service_full_name()) return LogLevel::kInfo;
  return LogLevel::kDebug;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "?";
}

void WriteToStderr(absl::string_view line) { std::fwrite(line.data(), 1, line.size(), stderr); }

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (name == "error") return LogLevel::kError;
  if (name == "info") return LogLevel::kInfo;
  if (name == "debug") return LogLevel::kDebug;
  return absl::InvalidArgumentError(
      absl::StrCat("--log-level must be error, info or debug, got \"", name, "\""));
}

std::string FormatRequestLine(const RequestRecord& record, absl::Time now) {
  const bool failed = record.code != grpc::StatusCode::OK;
  std::string line = absl::StrCat(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone()),
      " attnd level=", LevelName(LevelOf(record)), " method=", LogValue(record.path),
      " code=", CodeName(record.code), " ms=", absl::StrFormat("%.3f", record.seconds * 1e3));
  if (!record.shape.empty()) absl::StrAppend(&line, " shape=", LogValue(record.shape));
  if (!record.dtype.empty()) absl::StrAppend(&line, " dtype=", LogValue(record.dtype));
  absl::StrAppend(&line, " bytes_in=", record.bytes_received, " bytes_out=", record.bytes_sent,
                  " peer=", LogValue(record.peer));
  if (failed) absl::StrAppend(&line, " message=", LogValue(record.message));
  return line;
}

RequestObserver::RequestObserver(MetricsRegistry& registry, LogLevel level, Sink sink)
    : level_(level),
      sink_(sink ? std::move(sink) : Sink(WriteToStderr)),
      requests_(registry.AddCounter("attnd_rpc_requests_total",
                                    "RPCs finished, by service, method and status code.",
                                    {"service", "method", "code"})),
      duration_(registry.AddHistogram(
          "attnd_rpc_duration_seconds",
          "Time from the start of an RPC to its status, seconds, by service, method and code.",
          LatencyBuckets(), {"service", "method", "code"})),
      received_(registry.AddCounter(
          "attnd_rpc_received_bytes_total",
          "Request message bytes received (attention.v1 RPCs), by service, method and code.",
          {"service", "method", "code"})),
      sent_(registry.AddCounter("attnd_rpc_sent_bytes_total",
                                "Response message bytes sent, by service, method and code.",
                                {"service", "method", "code"})),
      inflight_(registry.AddGauge("attnd_rpc_inflight",
                                  "RPCs started and not yet finished, by service and method.",
                                  {"service", "method"})) {}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
RequestObserver::InterceptorFactory() {
  return std::make_unique<ObserverFactory>(*this);
}

void RequestObserver::Started(absl::string_view service, absl::string_view method) {
  inflight_.WithLabels({std::string(service), std::string(method)}).Add(1);
}

void RequestObserver::Finished(const RequestRecord& record) {
  inflight_.WithLabels({record.service, record.method}).Add(-1);
  const std::vector<std::string> labels = {record.service, record.method, CodeName(record.code)};
  requests_.WithLabels(labels).Increment();
  duration_.WithLabels(labels).Observe(record.seconds);
  received_.WithLabels(labels).Increment(record.bytes_received);
  sent_.WithLabels(labels).Increment(record.bytes_sent);

  if (static_cast<int>(LevelOf(record)) > static_cast<int>(level_)) return;
  sink_(absl::StrCat(FormatRequestLine(record, absl::Now()), "\n"));
}

}  // namespace attn
