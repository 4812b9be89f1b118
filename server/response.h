// Response: what attnd answers, as attention.v1 messages — a computation's output and lse
// tensors, its stats, a cache's info, and a trace's events. The request's checks (request.h) have
// run: these functions take a valid Problem and never fail.
//
// Outputs point into the response's own tensor data: the response must outlive them.
#pragma once

#include "attention/v1/attention.pb.h"
#include "kernels/backend.h"
#include "kernels/problem.h"
#include "server/caches.h"

namespace attn {

// Sets the response's output (and lse) tensor shapes and dtypes, sizes their data, and returns
// Outputs that point into that data for a kernel to fill.
Outputs PrepareOutputs(const Problem& problem, const attention::v1::AttentionRequest& request,
                       attention::v1::AttentionResponse* response);
// The same for any query tensor: output [.., heads, query_len, value_dim] in the query's rank,
// and lse [.., heads, query_len] when lse is not null and the problem asks for it.
Outputs PrepareOutputs(const Problem& problem, const attention::v1::Tensor& query,
                       attention::v1::Tensor* output, attention::v1::Tensor* lse);

// A cache as the client sees it.
void EncodeCacheInfo(const CacheDescription& cache, attention::v1::CacheInfo* message);

// Copies a backend's Stats into the message (backend, device and server_ns are the caller's).
void EncodeStats(const Stats& stats, attention::v1::ExecutionStats* message);

// The first event of a trace: the problem's shape and both methods' memory accounting.
attention::v1::TraceStart EncodeTraceStart(const Problem& problem);

// One cursor item of a trace as a TraceEvent (a TileStep or a RowDone), a copy of what the
// kernel computed and recorded (a step's biases and hidden reasons included).
void EncodeTraceItem(const TraceItem& item, attention::v1::TraceEvent* event);

}  // namespace attn
