// The grpc::ServerBuilder settings attnd serves with, in one place: attnd (server/startup.cc) and
// the edge benchmark's bare echo server (tests/bench/echo_server.cc) both call ApplyBuilderOptions,
// so the benchmark's gRPC baseline is built exactly like attnd and cannot drift from it.
//
// Only transport settings belong here (message limits, channel arguments, resource quotas).
// What makes attnd attnd — its services, credentials, interceptors (request log, metrics) — stays
// in server/startup.cc: that is the edge the benchmark measures.
#pragma once

#include <cstdint>

#include "grpcpp/server_builder.h"

namespace attn {

struct BuilderOptions {
  // Largest request or response message, bytes (receive and send); attnd --max-message-bytes,
  // which main checks to be in [1024, INT32_MAX].
  int64_t max_message_bytes = int64_t{1} << 30;
};

void ApplyBuilderOptions(grpc::ServerBuilder& builder, const BuilderOptions& options);

}  // namespace attn
