// attnd's start: from an AttndConfig (server/config.h) to a server answering gRPC on --listen
// and, unless --http-listen is empty, HTTP on the side port.
//
// StartServer builds, in order: the backend; the health service; the attention service (whose
// device loss clears /readyz and health), whose caches --cache-dir restores before anything
// serves; the metrics registry and the request log (one
// interceptor) with the process gauges; the JSON gateway and the HTTP port, bound before gRPC so
// that a port in use fails the start before anything serves; then gRPC's server with both
// services, the credentials and the interceptors. Once gRPC serves, the gateway gets its
// in-process channel and /readyz turns ready.
//
// The in-process channel skips the listener's token check: the gateway applies the same check
// to the HTTP Authorization header, and refuses /v1 when gRPC requires client certificates.
//
// Errors: the first step that failed (the backend's, the HTTP port's naming --http-listen,
// "cannot listen on ADDRESS"); what was built is torn down again. Nothing here exits.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/config.h"
#include "server/gateway.h"
#include "server/health.h"
#include "server/http_port.h"
#include "server/metrics.h"
#include "server/request_log.h"
#include "server/service.h"

namespace attn {

// A started attnd: its pieces, declared in the order StartServer builds them, so that they are
// destroyed in the reverse (the gRPC server first, the backend last). server/drain.h shuts
// them down in the order a drain needs. Neither copyable nor movable: the pieces hold
// references to one another.
struct RunningServer {
  RunningServer(const AttndConfig& config, std::unique_ptr<Backend> backend);
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;

  std::unique_ptr<Backend> backend;
  // grpc.health.v1: attnd's own service (bounded Watch streams), not gRPC's default one.
  HealthService health;
  ReadyFlag ready;  // /readyz: set once serving, cleared on device loss or drain.
  AttentionService service;
  MetricsRegistry metrics;
  RequestObserver observer;  // Per-RPC metrics and the request log.
  Gateway gateway;           // The JSON gateway (/v1) and the viewer, on the HTTP port.
  HttpPort http;
  std::unique_ptr<grpc::Server> grpc;
  int port = 0;                       // The gRPC port bound (--listen may ask for :0).
  std::vector<std::string> restored;  // With --cache-dir: what the restore found, for the log.
};

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const AttndConfig& config);

// The startup lines on stdout, flushed: version, address, port, device, every limit in force
// (the backend's and service's resolved values, not only the flags), security, HTTP port and
// log level. Tests and scripts read them, the port above all: their wording is an interface.
void PrintStartupLines(const RunningServer& server, const AttndConfig& config);

}  // namespace attn
