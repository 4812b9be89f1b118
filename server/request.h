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

// The defaults here are attnd's (its --max-trace-rows, --max-trace-steps and --max-traces flags
// start from them).
struct TraceLimits {
  static constexpr int64_t kDefaultMaxRows = 64;
  static constexpr int64_t kDefaultMaxSteps = int64_t{1} << 16;
  static constexpr int64_t kDefaultMaxStreams = 16;

  int64_t max_rows = kDefaultMaxRows;        // Rows one Trace may follow.
  int64_t max_steps = kDefaultMaxSteps;      // TileStep events one Trace may send.
  int64_t max_streams = kDefaultMaxStreams;  // Trace streams open at once.
};

// Validates an AttentionRequest and builds its Problem. default_block_k replaces a block_k of 0;
// block_k is capped at key_len (a longer tile would only hold padding).
// INVALID_ARGUMENT naming the field when anything is missing, malformed or inconsistent.
//
// In two steps, so that a server can take the first at once and the second where its compute
// runs: ParseAttentionShape checks everything but the elements' values, in time independent of
// the tensors' sizes; CheckAttentionValues reads every element once (value_scan.h: finite, and
// scores and weighted sums that stay within fp32). A Problem is valid only after both;
// ParseAttentionRequest does both.
absl::StatusOr<Problem> ParseAttentionShape(const attention::v1::AttentionRequest& request,
                                            int default_block_k);
absl::Status CheckAttentionValues(const Problem& problem);
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
