#include "server/config.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dashed_flags.h"
#include "server/builder_options.h"
#include "server/caches.h"
#include "server/compute_queue.h"
#include "server/health.h"
#include "server/request.h"

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
ABSL_FLAG(std::string, cache_dir, "",
          "Keep every KV cache on disk in this directory too (created if missing): appends are "
          "written behind, at most --cache-sync-seconds late, and fsynced; a SIGTERM flushes "
          "everything; a start restores every cache before serving. Empty = memory only (a "
          "restart loses the caches).");
ABSL_FLAG(int64_t, cache_sync_seconds, 1,
          "With --cache-dir: how far the disk may lag the memory, seconds (≥ 1); a crash loses at "
          "most the appends of the last this many seconds, which clients re-send.");
ABSL_FLAG(bool, allow_shared_memory, false,
          "Serve shared memory to callers on this machine: RegisterSharedMemory, and tensors "
          "and outputs in registered /dev/shm regions instead of in the messages (for a caller "
          "on a Unix socket or loopback). Off: those calls are FAILED_PRECONDITION.");
ABSL_FLAG(std::string, drain_to, "",
          "On SIGTERM, once the calls in flight have answered, move every KV cache to the attnd "
          "at this host:port (plaintext gRPC, this server's bearer token) before exiting; calls "
          "naming a moved cache get NOT_FOUND ending moved_to=host:port. Empty = none.");
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

namespace attn {
namespace {

// Flags defined in server/ are attnd's own (--help shows them).
bool IsAttndFlagFile(absl::string_view file) { return absl::StrContains(file, "server/"); }

}  // namespace

void ParseAttndFlags(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "scaled dot-product attention over gRPC (attention.v1).\n\n  attnd [--flag=value ...]"
      "   (each flag may be spelled --max-message-bytes or --max_message_bytes)");
  // --help lists attnd's own flags (those of server/); --helpfull adds the libraries'.
  absl::FlagsUsageConfig usage;
  usage.contains_helpshort_flags = IsAttndFlagFile;
  usage.contains_help_flags = IsAttndFlagFile;
  usage.normalize_filename = [](absl::string_view file) {  // "server/config.cc", not a build path.
    const size_t at = file.rfind("server/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  absl::SetFlagsUsageConfig(usage);
  DashedFlags flags(argc, argv);
  absl::ParseCommandLine(flags.argc(), flags.argv());
}

absl::StatusOr<AttndConfig> ConfigFromFlags() {
  const auto bad = [](absl::string_view message) { return absl::InvalidArgumentError(message); };
  AttndConfig config;
  ServiceConfig& service = config.service;
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1024 || max_message_bytes > INT32_MAX) {
    return bad(absl::StrCat("--max-message-bytes must be in [1024, ", INT32_MAX, "], got ",
                            max_message_bytes));
  }
  service.max_message_bytes = max_message_bytes;
  service.trace.max_rows = absl::GetFlag(FLAGS_max_trace_rows);
  service.trace.max_steps = absl::GetFlag(FLAGS_max_trace_steps);
  if (service.trace.max_rows < 1) return bad("--max-trace-rows must be ≥ 1");
  if (service.trace.max_steps < 1) return bad("--max-trace-steps must be ≥ 1");
  service.trace.max_streams = absl::GetFlag(FLAGS_max_traces);
  if (service.trace.max_streams < 1) return bad("--max-traces must be ≥ 1");
  service.admission.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  service.admission.max_queue = absl::GetFlag(FLAGS_max_queue);
  if (service.admission.max_inflight < 0) return bad("--max-inflight must be ≥ 0");
  if (service.admission.max_queue < 0) return bad("--max-queue must be ≥ 0");
  service.admission.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  if (service.admission.max_inflight_bytes < 0) return bad("--max-inflight-bytes must be ≥ 0");
  service.trace.idle_seconds = absl::GetFlag(FLAGS_trace_idle_seconds);
  if (service.trace.idle_seconds < 0) return bad("--trace-idle-seconds must be ≥ 0");
  service.caches.max_caches = absl::GetFlag(FLAGS_max_caches);
  if (service.caches.max_caches < 1) return bad("--max-caches must be ≥ 1");
  config.max_health_watches = absl::GetFlag(FLAGS_max_health_watches);
  if (config.max_health_watches < 1) return bad("--max-health-watches must be ≥ 1");
  service.caches.budget_bytes = absl::GetFlag(FLAGS_cache_bytes);
  service.caches.idle_seconds = absl::GetFlag(FLAGS_cache_idle_seconds);
  if (service.caches.budget_bytes < 0) return bad("--cache-bytes must be ≥ 0");
  if (service.caches.idle_seconds < 0) return bad("--cache-idle-seconds must be ≥ 0");
  service.caches.dir = absl::GetFlag(FLAGS_cache_dir);
  while (service.caches.dir.size() > 1 && service.caches.dir.back() == '/') {
    service.caches.dir.pop_back();
  }
  service.allow_shared_memory = absl::GetFlag(FLAGS_allow_shared_memory);
  service.caches.sync_seconds = absl::GetFlag(FLAGS_cache_sync_seconds);
  if (service.caches.sync_seconds < 1 || service.caches.sync_seconds > 86400) {
    return bad("--cache-sync-seconds must be in [1, 86400]");
  }
  config.drain_to = absl::GetFlag(FLAGS_drain_to);
  config.shutdown_grace_seconds = absl::GetFlag(FLAGS_shutdown_grace);
  if (config.shutdown_grace_seconds < 0) return bad("--shutdown-grace must be ≥ 0");

  config.listen = absl::GetFlag(FLAGS_listen);
  config.insecure = absl::GetFlag(FLAGS_insecure);
  absl::StatusOr<ServerSecurity> security =
      MakeServerSecurity({.tls_cert_file = absl::GetFlag(FLAGS_tls_cert),
                          .tls_key_file = absl::GetFlag(FLAGS_tls_key),
                          .tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca),
                          .auth_token_file = absl::GetFlag(FLAGS_auth_token_file),
                          .insecure = config.insecure},
                         config.listen);
  if (!security.ok()) return security.status();
  config.security = *std::move(security);
  // A moved cache belongs to whoever imports it: under mutual TLS that would be this server's
  // certificate, not the cache's owner. Until a peer can vouch for owners, refuse the pair.
  if (!config.drain_to.empty() && !absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    return bad("--drain-to cannot be used with --tls-client-ca (a moved cache would change owner)");
  }
  if (!config.drain_to.empty() && !absl::GetFlag(FLAGS_tls_cert).empty()) {
    return bad("--drain-to speaks plaintext gRPC to its peer; it cannot be used with --tls-cert");
  }

  config.backend = {.device = absl::GetFlag(FLAGS_device),
                    .threads = absl::GetFlag(FLAGS_threads),
                    .max_naive_bytes = absl::GetFlag(FLAGS_max_naive_bytes)};
  config.log_level_name = absl::GetFlag(FLAGS_log_level);
  absl::StatusOr<LogLevel> log_level = ParseLogLevel(config.log_level_name);
  if (!log_level.ok()) return log_level.status();
  config.log_level = *log_level;

  config.http_listen = absl::GetFlag(FLAGS_http_listen);
  // The JSON gateway refuses /v1 when gRPC requires client certificates: HTTP has none to check.
  config.gateway = {.cors_origin = absl::GetFlag(FLAGS_http_cors_origin),
                    .auth_token = config.security.auth_token,
                    .max_message_bytes = max_message_bytes,
                    .client_certificates_required = !absl::GetFlag(FLAGS_tls_client_ca).empty()};
  return config;
}

}  // namespace attn
