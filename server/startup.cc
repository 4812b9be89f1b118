#include "server/startup.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "kernels/make_backend.h"
#include "server/builder_options.h"

namespace attn {
namespace {

// The service's limits, with a device loss that marks the server not ready and NOT_SERVING.
ServiceConfig WithDeviceLoss(ServiceConfig config, HealthService& health, ReadyFlag& ready) {
  config.on_device_lost = [&health, &ready] {
    std::fprintf(stderr, "attnd: the device failed; health is now NOT_SERVING\n");
    ready.Set(false);
    health.SetServing(false);
  };
  return config;
}

}  // namespace

RunningServer::RunningServer(const AttndConfig& config, std::unique_ptr<Backend> backend_in)
    : backend(std::move(backend_in)),
      health(config.max_health_watches),
      service(*backend, WithDeviceLoss(config.service, health, ready)),
      observer(metrics, config.log_level),
      gateway(config.gateway),
      // 16 HTTP workers: each open viewer trace (server-sent events) holds one while it
      // streams, and /metrics and the probes must still answer; --max-traces bounds the streams.
      http(metrics, ready, 16) {
  AddServerGauges(metrics, service, *backend);
  gateway.AddRoutes(http);
}

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const AttndConfig& config) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(config.backend);
  if (!backend.ok()) return backend.status();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  auto server = std::make_unique<RunningServer>(config, *std::move(backend));
  absl::StatusOr<std::vector<std::string>> restored = server->service.caches().Restore();
  if (!restored.ok()) return restored.status();
  server->restored = *std::move(restored);
  if (!config.http_listen.empty()) {
    // The HTTP port is plaintext whatever gRPC uses: off loopback it needs --insecure too.
    if (absl::Status status = server->http.Start(config.http_listen, config.insecure);
        !status.ok()) {
      return absl::Status(status.code(), absl::StrCat(status.message(), " (--http-listen)"));
    }
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, config.security.credentials, &server->port);
  ApplyBuilderOptions(builder, {.max_message_bytes = config.service.max_message_bytes});
  builder.RegisterService(&server->service);
  builder.RegisterService(&server->health);
  // Server interceptors, run in this order; each module appends its own factory.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(server->observer.InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server->grpc = builder.BuildAndStart();
  if (!server->grpc || server->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen));
  }
  grpc::ChannelArguments gateway_channel;
  gateway_channel.SetMaxReceiveMessageSize(-1);  // The server's own limits apply.
  gateway_channel.SetMaxSendMessageSize(-1);
  server->gateway.SetChannel(server->grpc->InProcessChannel(gateway_channel));
  server->ready.Set(true);
  return server;
}

void PrintStartupLines(const RunningServer& server, const AttndConfig& config) {
  const Backend& backend = *server.backend;
  const AdmissionLimits& admission = server.service.admission();
  const CacheLimits& caches = server.service.caches().limits();
  // gRPC reports a Unix socket's "port" as 1: name the kind of address instead.
  const std::string where = absl::StartsWith(config.listen, "unix")
                                ? std::string("unix socket")
                                : absl::StrCat("port ", server.port);
  std::printf(
      "attnd %s serving attention.v1 on %s (%s)\n  device: %s [%s]\n  limits: "
      "max-message-bytes=%lld max-naive-bytes=%lld max-trace-rows=%lld max-trace-steps=%lld "
      "default-block-k=%d max-inflight=%d max-queue=%d max-traces=%lld cache-bytes=%lld "
      "cache-idle-seconds=%lld max-caches=%lld max-inflight-bytes=%lld trace-idle-seconds=%lld "
      "max-health-watches=%lld shutdown-grace=%ds\n",
      ATTN_VERSION, config.listen.c_str(), where.c_str(), backend.device().c_str(),
      std::string(backend.name()).c_str(), static_cast<long long>(config.service.max_message_bytes),
      static_cast<long long>(backend.max_naive_bytes()),
      static_cast<long long>(config.service.trace.max_rows),
      static_cast<long long>(config.service.trace.max_steps), backend.default_block_k(),
      admission.max_inflight, admission.max_queue,
      static_cast<long long>(config.service.trace.max_streams),
      static_cast<long long>(caches.budget_bytes), static_cast<long long>(caches.idle_seconds),
      static_cast<long long>(caches.max_caches),
      static_cast<long long>(admission.max_inflight_bytes),
      static_cast<long long>(config.service.trace.idle_seconds),
      static_cast<long long>(server.health.max_watches()), config.shutdown_grace_seconds);
  std::printf("  security: %s\n", config.security.summary.c_str());
  if (config.service.allow_shared_memory) {
    std::printf("  shared memory: on (--allow-shared-memory): regions in /dev/shm, per caller\n");
  }
  if (caches.dir.empty()) {
    std::printf("  caches: in memory only (no --cache-dir: a restart loses them)\n");
  } else {
    std::printf("  caches: persistent in --cache-dir=%s (cache-sync-seconds=%lld)\n",
                caches.dir.c_str(), static_cast<long long>(caches.sync_seconds));
  }
  if (!config.drain_to.empty()) std::printf("  drain-to: %s\n", config.drain_to.c_str());
  for (const std::string& line : server.restored) std::printf("  %s\n", line.c_str());
  const std::string http_banner =
      server.http.port() != 0 ? absl::StrCat("http://", server.http.address(),
                                             " (/metrics /healthz /readyz; JSON gateway /v1/naive "
                                             "/v1/tiled /v1/trace /v1/info; viewer /)")
                              : "off";
  std::printf("  http: %s  log-level: %s\n", http_banner.c_str(), config.log_level_name.c_str());
  std::fflush(stdout);
}

}  // namespace attn
