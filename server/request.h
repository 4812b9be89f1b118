// Request: attention.v1 messages ⇄ kernel Problems. Every check of client input lives here, so
// the kernels can assume a Problem's invariants (kernels/problem.h) and every error names the
// field at fault.
//
// The Problems returned view the request's tensor bytes: the request must outlive them.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "kernels/backend.h"
#include "kernels/problem.h"

namespace attn {

struct TraceLimits {
  int64_t max_rows = 64;        // Rows one Trace may follow.
  int64_t max_steps = 1 << 16;  // TileStep events one Trace may send.
  int64_t max_streams = 16;     // Trace streams open at once (each computes on gRPC's threads).
};

// Validates an AttentionRequest and builds its Problem. default_block_k replaces a block_k of 0;
// block_k is capped at key_len (a longer tile would only hold padding).
// INVALID_ARGUMENT naming the field when anything is missing, malformed or inconsistent.
absl::StatusOr<Problem> ParseAttentionRequest(const attention::v1::AttentionRequest& request,
                                              int default_block_k);

// Validates a TraceRequest's rows against its (already parsed) problem and the limits; no rows
// means row 0 of batch 0, head 0. INVALID_ARGUMENT naming the row or the limit.
absl::StatusOr<std::vector<RowRef>> ParseTraceRows(const attention::v1::TraceRequest& request,
                                                   const Problem& problem,
                                                   const TraceLimits& limits);

// Sets the response's output (and lse) tensor shapes and dtypes, sizes their data, and returns
// Outputs that point into that data for a kernel to fill.
Outputs PrepareOutputs(const Problem& problem, const attention::v1::AttentionRequest& request,
                       attention::v1::AttentionResponse* response);

// Copies a backend's Stats into the message (backend, device and server_ns are the caller's).
void EncodeStats(const Stats& stats, attention::v1::ExecutionStats* message);

// The first event of a trace: the problem's shape and both methods' memory accounting.
attention::v1::TraceStart EncodeTraceStart(const Problem& problem);

// One cursor item as a TraceEvent (a TileStep or a RowDone).
void EncodeTraceItem(const TraceItem& item, attention::v1::TraceEvent* event);

}  // namespace attn
