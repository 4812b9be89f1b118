// RequestObserver: one gRPC server interceptor that sees every call (method, request shape and
// dtype, status, time, bytes, peer) and turns it into the per-RPC metrics and one log line, so
// the RPC handlers stay free of both.
//
// Metrics (in the MetricsRegistry given; labels service, method, code):
//   attnd_rpc_requests_total          counter    calls finished
//   attnd_rpc_duration_seconds        histogram  call start to status sent (LatencyBuckets)
//   attnd_rpc_received_bytes_total    counter    request message bytes of attention.v1 calls
//                                                (health checks and reflection count 0)
//   attnd_rpc_sent_bytes_total        counter    response message bytes, every message of a stream
//   attnd_rpc_inflight{service,method} gauge     calls started and not yet finished
// A method this server does not know (neither gRPC's health or reflection service nor in the
// generated protobuf descriptor pool, which holds attention.v1) is counted as service="unknown",
// method="unknown", so hostile method names cannot grow the label set.
//
// Log lines (logfmt, one per call, on the sink, stderr in attnd):
//   2025-01-31T12:00:00.123Z attnd level=info method=/attention.v1.AttentionService/Naive
//     code=OK ms=12.345 shape=1,8,2048,2048,64 dtype=f32 bytes_in=… bytes_out=… peer=ipv4:…
// (one line; shape is B,H,Nq,Nk,d; a failed call adds message="…"). Which calls are written
// depends on the LogLevel: failed calls (any code but OK) always, at level=error; attention.v1
// calls at info; every other call (health checks, reflection) at debug.
//
// Thread-safe. The observer must outlive the server whose interceptor factory it made.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/support/status.h"
#include "server/metrics.h"

namespace attn {

enum class LogLevel { kError, kInfo, kDebug };

// "error", "info" or "debug"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);

// One finished call.
struct RequestRecord {
  std::string path;     // As called: "/attention.v1.AttentionService/Naive".
  std::string service;  // "attention.v1.AttentionService"; "unknown" for an unknown method.
  std::string method;   // "Naive"; "unknown" for an unknown method.
  std::string peer;     // "ipv4:127.0.0.1:41234".
  std::string shape;    // "B,H,Nq,Nk,d" for attention.v1 computations; "?" when malformed.
  std::string dtype;    // The query's: "f32", "f16", "bf16", "?".
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;  // The status message (failed calls).
  double seconds = 0;
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
};

// The log line for a record, without the trailing newline.
std::string FormatRequestLine(const RequestRecord& record, absl::Time now);

class RequestObserver {
 public:
  using Sink = std::function<void(absl::string_view line)>;  // Gets whole lines, "\n" ended.

  // Registers the per-RPC metrics in `registry` (which must outlive the observer). `sink`
  // defaults to writing stderr.
  RequestObserver(MetricsRegistry& registry, LogLevel level, Sink sink = nullptr);
  RequestObserver(const RequestObserver&) = delete;
  RequestObserver& operator=(const RequestObserver&) = delete;

  // A factory for grpc::ServerBuilder::experimental().SetInterceptorCreators.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // Counts a call as started (attnd_rpc_inflight); Finished counts it done.
  void Started(absl::string_view service, absl::string_view method);
  // Records a finished call: the metrics, and the log line when the level says so.
  void Finished(const RequestRecord& record);

 private:
  const LogLevel level_;
  const Sink sink_;
  Family<Counter>& requests_;
  Family<Histogram>& duration_;
  Family<Counter>& received_;
  Family<Counter>& sent_;
  Family<Gauge>& inflight_;
};

}  // namespace attn
