// Backend: the interface every compute device implements (cpu/, cuda/).
//
// A backend is chosen once at start-up (make_backend.h) and then called concurrently from
// request handlers, so implementations are thread-safe. Kernels see only Problems (already
// validated, see problem.h), never protobuf or gRPC. Every method reports failure as a Status
// and never aborts the process.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/kv_store.h"
#include "kernels/problem.h"

namespace attn {

// How a result was computed and what it cost (the fields of attention.v1.ExecutionStats that
// the backend knows).
struct Stats {
  int block_k = 0;
  int64_t compute_ns = 0;
  double flops = 0;
  int64_t intermediate_bytes = 0;
  int64_t scratch_bytes = 0;
  int64_t peak_memory_bytes = 0;

  // Adds the stats of a piece of work run after this one's (a batch's items, one after
  // another): times, flops and traffic add up; memory is freed between pieces, so the largest
  // scratch and peak stand. block_k is not summed: which tile a combined call reports is its
  // caller's choice.
  void Add(const Stats& other) {
    compute_ns += other.compute_ns;
    flops += other.flops;
    intermediate_bytes += other.intermediate_bytes;
    scratch_bytes = std::max(scratch_bytes, other.scratch_bytes);
    peak_memory_bytes = std::max(peak_memory_bytes, other.peak_memory_bytes);
  }
};

// Where a kernel writes its results: output [batch, heads, query_len, value_dim] in the
// problem's output dtype, and lse [batch, heads, query_len] (fp32) when the problem asks for it.
// The caller allocates both.
struct Outputs {
  MutableTensorView output;
  float* lse = nullptr;
  // Asked between pieces of work (row blocks on the CPU, before each launch on a GPU): a non-OK
  // answer (e.g. CANCELLED when the client went away) abandons the call, which returns it and
  // leaves the outputs incomplete. Empty: never interrupted.
  std::function<absl::Status()> interrupt;

  absl::Status CheckInterrupt() const { return interrupt ? interrupt() : absl::OkStatus(); }
};

// The online-softmax state of one traced row after one key tile (see online_softmax.h).
struct TraceStep {
  RowRef row;
  int tile = 0;
  int64_t key_begin = 0;
  int64_t key_end = 0;
  std::vector<float> scores;         // Scaled and transformed (softcap); −inf where masked.
  std::vector<float> scaled_scores;  // Before the transform; empty when it is the identity.
  // Each key's ALiBi bias as the kernel added it (hidden keys too); empty without ALiBi slopes.
  std::vector<float> biases;
  // What hides each key from the row (Hidden::kNone where it sees it); empty when no mask
  // applies (Geometry::Masked).
  std::vector<Hidden> hidden;
  float max_before = 0;
  float max_after = 0;
  float rescale = 0;
  std::vector<float> weights;
  float denominator = 0;
  std::vector<float> accumulator;
  std::vector<float> estimate;
};

// The end of one traced row: the online result beside the full-matrix one.
struct TraceRowDone {
  RowRef row;
  std::vector<float> output;
  std::vector<float> reference;
  float max_abs_error = 0;
  float lse = 0;
  float sink_share = 0;  // The weight the head's sink took (0 without sinks).
};

using TraceItem = std::variant<TraceStep, TraceRowDone>;

// TraceRowDone::max_abs_error: max_c |output[c] − reference[c]| (0 for an empty row; NaN when
// any difference is NaN, so that a NaN never reads as agreement).
inline float MaxAbsError(const std::vector<float>& output, const std::vector<float>& reference) {
  float error = 0;
  for (size_t c = 0; c < output.size() && c < reference.size(); ++c) {
    const float difference = std::abs(output[c] - reference[c]);
    if (std::isnan(difference)) return difference;
    error = std::max(error, difference);
  }
  return error;
}

// Naive's budget rule, for every backend: OK when its fp32 score and weight matrices
// (Problem::NaiveStorageBytes) fit in max_naive_bytes, else RESOURCE_EXHAUSTED naming Tiled.
// `memory` names where they would live ("memory", "device memory").
inline absl::Status CheckNaiveBudget(const Problem& problem, int64_t max_naive_bytes,
                                     absl::string_view memory) {
  const int64_t storage_bytes = problem.NaiveStorageBytes();
  if (storage_bytes <= max_naive_bytes) return absl::OkStatus();
  const Shape& s = problem.shape;
  return absl::ResourceExhaustedError(absl::StrCat(
      "Naive needs ", storage_bytes, " bytes of ", memory,
      " for its fp32 score and weight matrices (2 × ", s.batch, "·", s.heads, "·", s.query_len, "·",
      s.key_len, " × 4), over this server's --max-naive-bytes=", max_naive_bytes,
      "; use Tiled, which never stores a query_len × key_len matrix"));
}

// Produces a trace one event at a time, so the caller can send each event before the next is
// computed (flow control) and stop at any point (cancellation). Not thread-safe; the Problem's
// tensors must outlive it.
class TraceCursor {
 public:
  virtual ~TraceCursor() = default;
  // Computes the next event into *item. Returns false once every row is done.
  virtual bool Next(TraceItem* item) = 0;
  // Cost so far (final after Next returned false).
  virtual Stats stats() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;      // "cpu" or "cuda".
  virtual std::string device() const = 0;    // Human-readable device description.
  virtual int64_t memory_bytes() const = 0;  // Memory of the device.
  virtual int default_block_k() const = 0;   // block_k for requests that ask for 0.
  virtual int64_t max_naive_bytes() const = 0;
  // False once the device failed in a way this process cannot recover from; every call then
  // answers UNAVAILABLE.
  virtual bool healthy() const { return true; }
  // Computations worth running at once: 1 for a backend that already spreads each call over the
  // whole device (the CPU), the number of streams for a GPU.
  virtual int concurrency() const { return 1; }
  // True when a call on `problem` is so small (microseconds, its inputs a few pages) that it may
  // run on the caller's thread at once: it then waits for no shared worker or device, and the
  // service skips its compute queue. Default: never.
  virtual bool RunsInline(const Problem& problem) const { return false; }

  // Full-matrix attention. RESOURCE_EXHAUSTED (naming Tiled) when the score and weight
  // matrices would pass max_naive_bytes().
  virtual absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) = 0;
  // Online-softmax attention over key tiles of problem.block_k keys.
  virtual absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) = 0;
  // A cursor over the trace of the given rows (validated: in range, at least one).
  virtual absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                             std::vector<RowRef> rows) = 0;

  // Server-resident KV caches (kv_store.h). A new, empty store in this backend's memory, its
  // pages of kv_page_tokens() tokens. Default: UNIMPLEMENTED (a backend without caches).
  virtual absl::StatusOr<std::unique_ptr<KvStore>> CreateKvStore(const KvLayout& layout) {
    return absl::UnimplementedError(
        absl::StrCat("the ", name(), " backend of this attnd keeps no KV caches"));
  }
  virtual int64_t kv_page_tokens() const { return 256; }
  // Whether CreateKvStore takes DType::kFloat8E4M3 (ServerInfo.cache_dtypes). Default: no.
  virtual bool keeps_fp8_caches() const { return false; }
  // One decode step of a batch: Tiled attention for each problem (usually over a store's pages,
  // with few query rows) into outputs[i], in one call so that the backend can spread the whole
  // batch's work over its device. problems.size() == outputs.size(). Default: Tiled on each in
  // turn, the stats added up.
  virtual absl::StatusOr<Stats> Decode(const std::vector<Problem>& problems,
                                       const std::vector<Outputs>& outputs) {
    Stats total;
    for (size_t i = 0; i < problems.size(); ++i) {
      absl::StatusOr<Stats> stats = Tiled(problems[i], outputs[i]);
      if (!stats.ok()) return stats.status();
      total.Add(*stats);
      total.block_k = stats->block_k;
    }
    return total;
  }
};

}  // namespace attn
