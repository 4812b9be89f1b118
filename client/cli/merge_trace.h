// attn trace --shard-keys: the online softmax's merge of key ranges, shown at the scale of a
// cluster — the explainer's idea 3 with servers in place of tiles.
//
// The request's keys split into slices (client/shard.h SplitKeys, at most one per endpoint), each
// sent with its positions so that its causal mask is its share of the whole. Slice i is traced on
// endpoint i, all concurrently, for the same rows. For each traced row a slice's final state is
// its last TileStep's {max_after, denominator, accumulator} (a row that sees no key of the slice
// has no step: max −inf, denominator 0, accumulator zeros) with its RowDone's lse. The states then
// merge one server at a time into a running state that starts empty, with the one merge rule,
// OnlineSoftmax::MergeInto (kernels/online_softmax.h): m_new = max(m_running, m_part), the running
// state rescaled by exp(m_running − m_new), the part's by exp(m_part − m_new), denominators and
// accumulators added; after each step the estimate is accumulator / denominator. The final
// estimate is compared with a float64 reference computed here from the request's own query, key
// and value bytes over all keys (positions and the causal rule as attention.proto states them,
// GQA's query head h reading kv head h / (heads / kv_heads)), and with the merge of the parts'
// finished RowDone (output, lse) states (client/merge.h MergeStates — what attn tiled
// --shard-keys returns).
//
// When one server traces all of it (one endpoint, or SplitKeys returned one part) there is
// nothing to merge, and the output says so.
//
// Thread-safe: MergeTraces and the printers are pure; TraceAndMerge makes its own Clients.
//
// Text output follows attn trace's (render.h). JSON output (--json): one object per line,
//   {"problem": {...}}                                  once, first
//   then for each traced row, in the request's order:
//   {"part": {...}}        one per part, in key order
//   {"merge_step": {...}}  one per part: step k merges part k into the running state
//   {"merged": {...}}      the row's result
// Field names are lowerCamelCase as in protobuf's JSON mapping (which attn trace --json and the
// gateway use); a non-finite float is the string "Infinity", "-Infinity" or "NaN"; integers are
// JSON numbers; float32 values are printed to round-trip (9 significant digits), float64 ones
// to 17. Fields:
//   problem:    batch, heads, kvHeads, queryLen, keyLen, headDim, valueDim, scale, causal,
//               keyPosition, queryPosition (the whole request's, resolved), blockK (0 = each
//               server's default), endpoints (those given; part i went to endpoints[i]), parts
//               (count), singleServer (bool: one server traced all of it), keysFirst and
//               keysSent (keys [keysFirst, keysSent) went to some server; no row sees the
//               rest), windowLeft and windowRight (AttentionOptions; absent when unbounded)
//   part:       row {batch, head, row}, index (0-based), parts, endpoint, keyBegin, keyEnd (of
//               the whole request's keys), keyPosition, queryPosition (the slice's, as its
//               TraceStart resolved them), blockK, steps (its TileSteps for this row), max,
//               denominator, accumulator [valueDim], lse (its RowDone's), estimate
//               (accumulator / denominator over its keys alone; zeros when it saw none), output
//               and maxAbsError (its RowDone's: its online output and its error against its own
//               full-matrix reference over its slice)
//   merge_step: row, index (0-based step = the part merged), part, endpoint, keyBegin, keyEnd,
//               maxBefore (the running max), partMax, maxAfter, runningRescale
//               (exp(maxBefore − maxAfter), 0 while the running state is empty), partRescale
//               (exp(partMax − maxAfter), 0 for a part that saw no key), partDenominator,
//               denominatorBefore, denominator (= denominatorBefore · runningRescale +
//               partDenominator · partRescale), accumulator, estimate (accumulator /
//               denominator), maxAbsError (max |estimate − reference|)
//   merged:     row, parts, singleServer, output (the last step's estimate), lse (max +
//               log denominator), reference (float64), referenceLse, maxAbsError (max |output −
//               reference|), relativeError (maxAbsError / max |reference|, or maxAbsError when the
//               reference is all zeros), rowDoneOutput (MergeStates of the parts' RowDone
//               (output, lse)), rowDoneMaxAbsDiff (max |output − rowDoneOutput|)
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"
#include "client/shard.h"

namespace attn::cli {

// One part of the split as it was traced.
struct TracedPart {
  std::string endpoint;
  int64_t key_begin = 0, key_end = 0;  // Of the whole request's keys.
  bool key_slice = false;              // ShardPart::key_slice: false for the whole request.
  // The slice's positions and tiling as its TraceStart resolved them.
  int64_t key_position = 0, query_position = 0;
  int32_t block_k = 0;
  int32_t tiles_per_row = 0;
};

// One part's final online-softmax state of one row.
struct PartState {
  int64_t steps = 0;  // TileSteps of this row (0: the row sees no key of the slice).
  float max = 0, denominator = 0, lse = 0;
  std::vector<float> accumulator, estimate;  // estimate = accumulator / denominator (or zeros).
  std::vector<float> output;                 // RowDone.output: the part's own normalized answer.
  float max_abs_error = 0;  // RowDone.max_abs_error, against its slice's full matrix.
};

// Merging part `part` into the running state.
struct MergeStep {
  int part = 0;
  float max_before = 0, part_max = 0, max_after = 0;
  float running_rescale = 0, part_rescale = 0;
  float denominator_before = 0, part_denominator = 0, denominator = 0;
  std::vector<float> accumulator, estimate;
  double max_abs_error = 0;  // max |estimate − reference|.
};

struct RowMerge {
  attention::v1::RowRef row;
  std::vector<PartState> parts;   // parts[i]: MergeTrace::parts[i]'s state of this row.
  std::vector<MergeStep> steps;   // One per part, in part order.
  std::vector<float> output;      // The last step's estimate (the sink added, with sinks).
  float lse = 0;                  // max + log(denominator) of the merged state (and sink).
  float sink_share = 0;           // The weight the row's sink took (0 without sinks).
  std::vector<double> reference;  // float64, over every key the row sees.
  double reference_lse = 0;
  double max_abs_error = 0, relative_error = 0;
  std::vector<float> row_done_output;  // MergeStates of the parts' RowDone (output, lse).
  double row_done_max_abs_diff = 0;
};

struct MergeTrace {
  int64_t batch = 0, heads = 0, kv_heads = 0, query_len = 0, key_len = 0, head_dim = 0,
          value_dim = 0;
  float scale = 0;
  bool causal = false;
  int64_t key_position = 0, query_position = 0;      // The whole request's, resolved.
  std::optional<int64_t> window_left, window_right;  // Unset: unbounded.
  // The request's sinks, one per query head (empty: none): added once, after the parts' merge
  // (the first slice's RowDone carries them, the others' none).
  std::vector<float> sinks;
  int32_t block_k = 0;                 // As requested (0 = each server's default).
  std::vector<std::string> endpoints;  // Those given: part i went to endpoints[i].
  bool single_server = false;          // One part: nothing to merge.
  // Keys [keys_first, keys_sent) went to a server; no row sees the rest.
  int64_t keys_first = 0, keys_sent = 0;
  std::vector<TracedPart> parts;
  std::vector<RowMerge> rows;
};

// Merges the parts' traces: `parts` as SplitKeys gave them for request.attention(), events[i]
// the whole stream part i's trace returned (TraceStart … TraceEnd) from endpoints[i]. INTERNAL
// when a stream is not a trace of the request's rows (a server's fault, naming its endpoint);
// INVALID_ARGUMENT when the request's tensors do not decode or agree in shape.
absl::StatusOr<MergeTrace> MergeTraces(
    const attention::v1::TraceRequest& request, const std::vector<client::ShardPart>& parts,
    const std::vector<std::string>& endpoints,
    const std::vector<std::vector<attention::v1::TraceEvent>>& events);

// Splits request.attention() over the endpoints (SplitKeys with max_parts = endpoints.size()),
// traces part i on endpoints[i] (a Client per endpoint with `options`), all concurrently, and
// merges them (MergeTraces). A failed part fails the call with its status, the message naming
// the part, its keys and its endpoint: never a partial merge. INVALID_ARGUMENT for no endpoints
// or a request over a cache (its keys are not the client's to split).
absl::StatusOr<MergeTrace> TraceAndMerge(const std::vector<std::string>& endpoints,
                                         const client::ClientOptions& options,
                                         const attention::v1::TraceRequest& request);

// The merge trace as text (in the style of attn trace) or as the JSON lines above.
void PrintMergeTrace(const MergeTrace& trace, std::FILE* out);
void PrintMergeTraceJson(const MergeTrace& trace, std::FILE* out);

// attn trace --shard-keys: TraceAndMerge, then printed as text or (json) JSON lines.
absl::Status RunShardedTrace(const std::vector<std::string>& endpoints,
                             const client::ClientOptions& options,
                             const attention::v1::TraceRequest& request, bool json, std::FILE* out);

}  // namespace attn::cli
