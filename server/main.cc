// attnd: the attention server. Flags → backend and service → a gRPC server on --listen.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "kernels/make_backend.h"
#include "server/builder_options.h"
#include "server/dashed_flags.h"
#include "server/gateway.h"
#include "server/health.h"
#include "server/http_port.h"
#include "server/metrics.h"
#include "server/request_log.h"
#include "server/security.h"
#include "server/service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "Address to serve gRPC on (host:port).");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:8080",
          "Address of the HTTP side port (/metrics, /healthz, /readyz, the JSON gateway /v1/... "
          "and the trace viewer /), host:port (:0 picks a free port); empty disables it. Plain "
          "HTTP: an address other than loopback needs --insecure.");
ABSL_FLAG(std::string, http_cors_origin, "",
          "CORS for the JSON gateway (/v1/...): the Access-Control-Allow-Origin to send, e.g. * "
          "or https://viewer.example; empty sends no CORS headers.");
ABSL_FLAG(std::string, log_level, "info",
          "Request log on stderr: error (failed calls only), info (also every attention.v1 "
          "call) or debug (also health checks and reflection).");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (the first CUDA device if there is one, else the CPU), cpu, "
          "cuda or cuda:N.");
ABSL_FLAG(int, threads, 0, "CPU worker threads per computation; 0 = every hardware thread.");
ABSL_FLAG(int64_t, max_message_bytes, attn::BuilderOptions{}.max_message_bytes,
          "Largest request or response message, bytes (receive and send).");
ABSL_FLAG(int64_t, max_naive_bytes, 0,
          "Largest score + weight storage Naive may allocate, bytes; 0 = 1/4 of physical memory.");
ABSL_FLAG(int64_t, max_trace_rows, attn::TraceLimits::kDefaultMaxRows,
          "Most query rows one Trace call may follow.");
ABSL_FLAG(int64_t, max_trace_steps, attn::TraceLimits::kDefaultMaxSteps,
          "Most tile steps one Trace call may stream.");
ABSL_FLAG(int64_t, max_traces, attn::TraceLimits::kDefaultMaxStreams,
          "Trace streams open at once; one more is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_inflight, attn::AdmissionLimits::kDefaultMaxInflight,
          "Naive/Tiled computations running at once; 0 = the backend's (1 on the CPU, whose "
          "every call uses all --threads; one per stream on a GPU).");
ABSL_FLAG(int, max_queue, attn::AdmissionLimits::kDefaultMaxQueue,
          "Accepted computations that may wait for a worker; one more is refused at once with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_inflight_bytes, 0,
          "Bytes of the requests (and their answers) accepted and not yet answered, together; "
          "one more is refused with RESOURCE_EXHAUSTED. 0 = a quarter of physical memory.");
ABSL_FLAG(int64_t, trace_idle_seconds, attn::TraceLimits::kDefaultIdleSeconds,
          "A Trace stream whose reader takes no event for this long is cancelled and frees its "
          "--max-traces slot; 0 = never.");
ABSL_FLAG(int64_t, max_health_watches, attn::HealthService::kDefaultMaxWatches,
          "grpc.health.v1 Watch streams open at once; one more is refused with "
          "RESOURCE_EXHAUSTED (Check is not limited). A Watch whose reader leaves an update "
          "unread for 60 s is cancelled.");
ABSL_FLAG(int64_t, max_caches, attn::CacheLimits::kDefaultMaxCaches,
          "KV caches alive at once; one more CreateCache is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, cache_bytes, 0,
          "Memory all KV caches' pages may take together, bytes; 0 = half the device's memory "
          "(physical memory on the CPU). An append past it is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, cache_idle_seconds, 3600,
          "A KV cache unused this long is dropped (later calls: NOT_FOUND, expired); 0 = never "
          "(as is anything past 2^31).");
ABSL_FLAG(int, shutdown_grace, 30,
          "Seconds in-flight calls get to finish after SIGTERM/SIGINT (a second signal exits at "
          "once).");
ABSL_FLAG(std::string, tls_cert, "", "TLS: PEM certificate chain to serve (with --tls-key).");
ABSL_FLAG(std::string, tls_key, "", "TLS: PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "Mutual TLS: PEM CA bundle; clients must present a certificate it signed.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token every RPC but grpc.health.v1 must send as metadata "
          "\"authorization: Bearer <token>\" (trailing whitespace ignored).");
ABSL_FLAG(bool, insecure, false,
          "Allow plaintext on a non-loopback --listen or --http-listen address (refused "
          "otherwise; the HTTP port has no TLS, so with TLS on gRPC it covers --http-listen).");

namespace {

int signal_pipe[2] = {-1, -1};

// Async-signal-safe: hands the signal number to WaitForSignal.
void ForwardSignal(int signal) {
  const unsigned char byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] const ssize_t written = write(signal_pipe[1], &byte, 1);
}

int WaitForSignal() {
  unsigned char byte = 0;
  while (read(signal_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

// Flags defined in server/ are attnd's own (--help shows them).
bool IsAttndFlagFile(absl::string_view file) { return absl::StrContains(file, "server/"); }

// Exits with a message on a configuration error; used only at start-up.
[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "attnd: %s\n", message.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  // SIGINT/SIGTERM go through a pipe to the thread that drains the server (below). A handler,
  // not sigwait: threads a library starts before main never blocked them.
  if (pipe(signal_pipe) != 0) Die("cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = ForwardSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  absl::SetProgramUsageMessage(
      "scaled dot-product attention over gRPC (attention.v1).\n\n  attnd [--flag=value ...]"
      "   (each flag may be spelled --max-message-bytes or --max_message_bytes)");
  // --help lists attnd's own flags (those of server/); --helpfull adds the libraries'.
  absl::FlagsUsageConfig usage;
  usage.contains_helpshort_flags = IsAttndFlagFile;
  usage.contains_help_flags = IsAttndFlagFile;
  usage.normalize_filename = [](absl::string_view file) {  // "server/main.cc", not a build path.
    const size_t at = file.rfind("server/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  absl::SetFlagsUsageConfig(usage);
  attn::DashedFlags flags(argc, argv);
  absl::ParseCommandLine(flags.argc(), flags.argv());

  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1024 || max_message_bytes > INT32_MAX) {
    Die(absl::StrCat("--max-message-bytes must be in [1024, ", INT32_MAX, "], got ",
                     max_message_bytes));
  }
  attn::ServiceConfig config;
  config.max_message_bytes = max_message_bytes;
  config.trace.max_rows = absl::GetFlag(FLAGS_max_trace_rows);
  config.trace.max_steps = absl::GetFlag(FLAGS_max_trace_steps);
  if (config.trace.max_rows < 1) Die("--max-trace-rows must be ≥ 1");
  if (config.trace.max_steps < 1) Die("--max-trace-steps must be ≥ 1");
  config.trace.max_streams = absl::GetFlag(FLAGS_max_traces);
  if (config.trace.max_streams < 1) Die("--max-traces must be ≥ 1");
  config.admission.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  config.admission.max_queue = absl::GetFlag(FLAGS_max_queue);
  if (config.admission.max_inflight < 0) Die("--max-inflight must be ≥ 0");
  if (config.admission.max_queue < 0) Die("--max-queue must be ≥ 0");
  config.admission.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  if (config.admission.max_inflight_bytes < 0) Die("--max-inflight-bytes must be ≥ 0");
  config.trace.idle_seconds = absl::GetFlag(FLAGS_trace_idle_seconds);
  if (config.trace.idle_seconds < 0) Die("--trace-idle-seconds must be ≥ 0");
  config.caches.max_caches = absl::GetFlag(FLAGS_max_caches);
  if (config.caches.max_caches < 1) Die("--max-caches must be ≥ 1");
  const int64_t max_health_watches = absl::GetFlag(FLAGS_max_health_watches);
  if (max_health_watches < 1) Die("--max-health-watches must be ≥ 1");
  config.caches.budget_bytes = absl::GetFlag(FLAGS_cache_bytes);
  config.caches.idle_seconds = absl::GetFlag(FLAGS_cache_idle_seconds);
  if (config.caches.budget_bytes < 0) Die("--cache-bytes must be ≥ 0");
  if (config.caches.idle_seconds < 0) Die("--cache-idle-seconds must be ≥ 0");
  const int shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  if (shutdown_grace < 0) Die("--shutdown-grace must be ≥ 0");
  absl::StatusOr<attn::ServerSecurity> security =
      attn::MakeServerSecurity({.tls_cert_file = absl::GetFlag(FLAGS_tls_cert),
                                .tls_key_file = absl::GetFlag(FLAGS_tls_key),
                                .tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca),
                                .auth_token_file = absl::GetFlag(FLAGS_auth_token_file),
                                .insecure = absl::GetFlag(FLAGS_insecure)},
                               absl::GetFlag(FLAGS_listen));
  if (!security.ok()) Die(std::string(security.status().message()));

  absl::StatusOr<std::unique_ptr<attn::Backend>> backend =
      attn::MakeBackend({.device = absl::GetFlag(FLAGS_device),
                         .threads = absl::GetFlag(FLAGS_threads),
                         .max_naive_bytes = absl::GetFlag(FLAGS_max_naive_bytes)});
  if (!backend.ok()) Die(std::string(backend.status().message()));
  const absl::StatusOr<attn::LogLevel> log_level =
      attn::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!log_level.ok()) Die(std::string(log_level.status().message()));

  // grpc.health.v1: attnd's own service (bounded Watch streams), not gRPC's default one.
  attn::HealthService health(max_health_watches);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // /readyz: set once serving, cleared on device loss or drain.
  attn::ReadyFlag ready;
  config.on_device_lost = [&health, &ready] {
    std::fprintf(stderr, "attnd: the device failed; health is now NOT_SERVING\n");
    ready.Set(false);
    health.SetServing(false);
  };
  attn::AttentionService service(**backend, config);
  // Per-RPC metrics and the request log (one interceptor), process gauges, and the HTTP port,
  // bound before gRPC so a port in use fails start-up before anything serves.
  attn::MetricsRegistry metrics;
  attn::RequestObserver observer(metrics, *log_level);
  attn::AddServerGauges(metrics, service, **backend);
  // The JSON gateway and viewer share the HTTP port; their calls reach gRPC once it is built,
  // through the in-process channel, which skips the listener's token check: the gateway applies
  // the same check to the HTTP Authorization header, and refuses /v1 when gRPC requires client
  // certificates (HTTP has none to check).
  attn::Gateway gateway(
      {.cors_origin = absl::GetFlag(FLAGS_http_cors_origin),
       .auth_token = security->auth_token,
       .max_message_bytes = max_message_bytes,
       .client_certificates_required = !absl::GetFlag(FLAGS_tls_client_ca).empty()});
  // 16 HTTP workers: each open viewer trace (server-sent events) holds one while it streams,
  // and /metrics and the probes must still answer; --max-traces bounds the streams.
  attn::HttpPort http(metrics, ready, 16);
  gateway.AddRoutes(http);
  const std::string http_listen = absl::GetFlag(FLAGS_http_listen);
  if (!http_listen.empty()) {
    // The HTTP port is plaintext whatever gRPC uses: off loopback it needs --insecure too.
    if (absl::Status status = http.Start(http_listen, absl::GetFlag(FLAGS_insecure));
        !status.ok()) {
      Die(absl::StrCat(status.message(), " (--http-listen)"));
    }
  }
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, security->credentials, &port);
  attn::ApplyBuilderOptions(builder, {.max_message_bytes = max_message_bytes});
  builder.RegisterService(&service);
  builder.RegisterService(&health);
  // Server interceptors, run in this order; each module appends its own factory.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(observer.InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) Die(absl::StrCat("cannot listen on ", listen));
  grpc::ChannelArguments gateway_channel;
  gateway_channel.SetMaxReceiveMessageSize(-1);  // The server's own limits apply.
  gateway_channel.SetMaxSendMessageSize(-1);
  gateway.SetChannel(server->InProcessChannel(gateway_channel));
  ready.Set(true);

  std::printf(
      "attnd %s serving attention.v1 on %s (port %d)\n  device: %s [%s]\n  limits: "
      "max-message-bytes=%lld max-naive-bytes=%lld max-trace-rows=%lld max-trace-steps=%lld "
      "default-block-k=%d max-inflight=%d max-queue=%d max-traces=%lld cache-bytes=%lld "
      "cache-idle-seconds=%lld max-caches=%lld max-inflight-bytes=%lld trace-idle-seconds=%lld "
      "max-health-watches=%lld shutdown-grace=%ds\n",
      ATTN_VERSION, listen.c_str(), port, (*backend)->device().c_str(),
      std::string((*backend)->name()).c_str(), static_cast<long long>(max_message_bytes),
      static_cast<long long>((*backend)->max_naive_bytes()),
      static_cast<long long>(config.trace.max_rows), static_cast<long long>(config.trace.max_steps),
      (*backend)->default_block_k(), service.admission().max_inflight,
      service.admission().max_queue, static_cast<long long>(config.trace.max_streams),
      static_cast<long long>(service.caches().limits().budget_bytes),
      static_cast<long long>(service.caches().limits().idle_seconds),
      static_cast<long long>(service.caches().limits().max_caches),
      static_cast<long long>(service.admission().max_inflight_bytes),
      static_cast<long long>(config.trace.idle_seconds),
      static_cast<long long>(health.max_watches()), shutdown_grace);
  std::printf("  security: %s\n", security->summary.c_str());
  const std::string http_banner =
      http.port() != 0 ? absl::StrCat("http://", http.address(),
                                      " (/metrics /healthz /readyz; JSON gateway /v1/naive "
                                      "/v1/tiled /v1/trace /v1/info; viewer /)")
                       : "off";
  std::printf("  http: %s  log-level: %s\n", http_banner.c_str(),
              absl::GetFlag(FLAGS_log_level).c_str());
  std::fflush(stdout);

  // Graceful drain: the first signal marks the server NOT_SERVING, refuses new calls
  // (UNAVAILABLE) and gives those in flight --shutdown-grace seconds, after which gRPC cancels
  // them (and the computations stop at their next row block). A second signal exits at once.
  // gRPC's own shutdown starts only once the calls in flight have answered, and a moment after:
  // it sends GOAWAY and closes each connection as its last stream ends, and a connection closed
  // with the client's frames unread is reset, which can lose an answer still on its way (an 8 MiB
  // Tiled output through docker's port proxy did, once).
  std::thread stopper([&] {
    const int signal = WaitForSignal();
    std::printf("attnd: signal %d, draining (in-flight calls get %d s; signal again to exit now)\n",
                signal, shutdown_grace);
    std::fflush(stdout);
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(shutdown_grace);
    service.StartDrain();
    ready.Set(false);
    health.SetServing(false);
    std::thread([] {
      const int again = WaitForSignal();
      std::fprintf(stderr, "attnd: signal %d again, exiting without waiting\n", again);
      std::_Exit(1);
    }).detach();
    // The JSON gateway first: /v1 answers 503 from now on, and its calls in flight get the grace
    // (shutting gRPC down would end its in-process calls at once).
    gateway.Drain(deadline);
    const bool answering = !service.Idle();
    if (service.WaitUntilIdle(deadline) && answering) {
      std::this_thread::sleep_until(
          std::min(deadline, std::chrono::system_clock::now() + std::chrono::seconds(1)));
    }
    // Calls that never reached a compute worker are answered now (UNAVAILABLE), before gRPC
    // cancels what is left; none may run once the server is gone.
    service.CancelQueued();
    // Health Watch streams end now (after sending NOT_SERVING), so gRPC need not wait for them.
    health.Shutdown();
    server->Shutdown(deadline);
    std::printf("attnd: drained, exiting\n");
    std::fflush(stdout);
  });
  server->Wait();
  stopper.join();
  http.Stop();
  return 0;
}
