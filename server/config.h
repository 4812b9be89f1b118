// attnd's configuration: its command-line flags (defined in config.cc, the only place they are)
// and the one plain struct they become. ParseAttndFlags reads argv; ConfigFromFlags checks every
// flag and builds an AttndConfig, so the start (server/startup.h) works from values already known
// to be in range and never reads a flag itself.
//
// Errors: ConfigFromFlags returns the first bad flag's message ("--max-traces must be ≥ 1"), for
// main to print and exit 2 on; nothing here exits, except Abseil's own --help and bad-flag
// handling inside ParseAttndFlags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/make_backend.h"
#include "server/gateway.h"
#include "server/request_log.h"
#include "server/security.h"
#include "server/service.h"

namespace attn {

struct AttndConfig {
  std::string listen;       // --listen: the gRPC address.
  std::string http_listen;  // --http-listen: the HTTP side port; empty = none.
  bool insecure = false;    // --insecure: the HTTP port is plaintext, so off loopback it needs it.
  LogLevel log_level = LogLevel::kInfo;
  std::string log_level_name;  // --log-level as given, for the startup line.
  BackendConfig backend;       // --device, --threads, --max-naive-bytes.
  // The limits (--max-message-bytes, the trace, admission and cache flags); on_device_lost is
  // left empty for the start to set.
  ServiceConfig service;
  int64_t max_health_watches = 0;  // --max-health-watches, ≥ 1.
  int shutdown_grace_seconds = 0;  // --shutdown-grace, ≥ 0.
  std::string drain_to;            // --drain-to: the peer a drain hands the caches to; "" = none.
  ServerSecurity security;         // From the TLS, token and --insecure flags, for --listen.
  GatewayConfig gateway;           // --http-cors-origin, with security's token and message limit.
};

// Parses argv into attnd's flags, each spelled with dashes or underscores. --help lists attnd's
// own flags (those defined under server/), --helpfull the libraries' too; both exit, as does a
// flag Abseil does not know or cannot parse.
void ParseAttndFlags(int argc, char** argv);

// The parsed flags as an AttndConfig. Errors: INVALID_ARGUMENT naming the first flag out of range,
// then MakeServerSecurity's and ParseLogLevel's (server/security.h, server/request_log.h).
absl::StatusOr<AttndConfig> ConfigFromFlags();

}  // namespace attn
