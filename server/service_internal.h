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

// Why a call must stop now, if it must: the client cancelled or its deadline passed.
absl::Status Interruption(grpc::CallbackServerContext* context);

// The bytes a call holds from admission until it answers, against --max-inflight-bytes: its
// request's and its answer's tensors (saturating at INT64_MAX).
int64_t InflightBytes(const google::protobuf::Message& request, int64_t reply_bytes);

// A computation's stats (EncodeStats) with the backend's name and device, and the time since
// the call arrived at `start` as server_ns.
void FillStats(const Backend& backend, const Stats& stats, Clock::time_point start,
               attention::v1::ExecutionStats* message);

}  // namespace attn::service_internal
