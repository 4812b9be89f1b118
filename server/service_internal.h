// What AttentionService's handler files (service.cc, service_trace.cc, service_caches.cc) share
// and nothing else uses: the call's clock, its interruption, its admission bytes and its stats.
// Defined in service.cc.
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"

namespace attn::service_internal {

using Clock = std::chrono::steady_clock;

// A unary call answered at once: with a failure, or OK (the response filled).
grpc::ServerUnaryReactor* Failed(grpc::CallbackServerContext* context, const absl::Status& status);
grpc::ServerUnaryReactor* Finished(grpc::CallbackServerContext* context);

// Why a call must stop now, if it must: the client cancelled or its deadline passed.
absl::Status Interruption(grpc::CallbackServerContext* context);

// The bytes a call holds from admission until it answers, against --max-inflight-bytes: its
// request's and its answer's tensors (saturating at INT64_MAX).
int64_t InflightBytes(const google::protobuf::Message& request, int64_t reply_bytes);

// The moments of a call that its ExecutionStats.stages are made of.
struct Timeline {
  Clock::time_point start = Clock::now();  // The handler began.
  Clock::time_point handed_off;            // Its checks done: submitted (or run inline).
  Clock::time_point started;               // The work began on a worker (or inline).
  Clock::time_point computing;             // The kernels began.
  Clock::time_point computed;              // They ended.
};

// A computation's stats (EncodeStats) with the backend's name and device, the time since the
// call arrived as server_ns, and (given a whole timeline) its stages, the finish ending now.
void FillStats(const Backend& backend, const Stats& stats, Clock::time_point start,
               attention::v1::ExecutionStats* message);
void FillStats(const Backend& backend, const Stats& stats, const Timeline& timeline,
               attention::v1::ExecutionStats* message);

}  // namespace attn::service_internal
