// AttentionService (service.h), its Trace handler: the stream writer that computes one event per
// completed write (its flow control), the --max-traces slots, and Trace over inline tensors or
// over a cache (whose tokens the stream copies, so it holds no lease while a reader is slow).
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/convert.h"
#include "server/response.h"
#include "server/security.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace attn {

namespace v1 = attention::v1;
using service_internal::Clock;
using service_internal::FillStats;
using service_internal::InflightBytes;
using service_internal::Interruption;

namespace {

// One of the --max-traces stream slots, released when the stream ends.
class TraceSlot {
 public:
  explicit TraceSlot(std::atomic<int64_t>& open) : open_(&open) {}
  // Counts this stream among the open ones: RESOURCE_EXHAUSTED when that makes more than
  // `max_streams` (the slot is released all the same when it goes).
  absl::Status Take(int64_t max_streams) {
    const int64_t open = open_->fetch_add(1);
    if (open < max_streams) return absl::OkStatus();
    return absl::ResourceExhaustedError(
        absl::StrCat("server busy: ", open, " trace streams open (--max-traces=", max_streams,
                     "); retry later"));
  }
  TraceSlot(TraceSlot&& other) : open_(std::exchange(other.open_, nullptr)) {}
  TraceSlot& operator=(TraceSlot&&) = delete;
  ~TraceSlot() {
    if (open_ != nullptr) open_->fetch_sub(1);
  }

 private:
  std::atomic<int64_t>* open_;
};

// Streams a trace: TraceStart, the cursor's events one write at a time, TraceEnd. Created
// before its cursor exists: Begin starts the stream once the cursor is open, Fail ends it
// before its first event; either may be called from any thread, once.
class TraceWriter final : public grpc::ServerWriteReactor<v1::TraceEvent> {
 public:
  TraceWriter(const Backend& backend, Clock::time_point start, TraceSlot slot, StreamWatch& watch,
              grpc::CallbackServerContext* context)
      : backend_(backend),
        start_(start),
        slot_(std::move(slot)),
        watch_(watch),
        watched_(watch.Add(context)) {}

  void Begin(const Problem& problem, std::unique_ptr<TraceCursor> cursor) {
    cursor_ = std::move(cursor);
    *event_.mutable_start() = EncodeTraceStart(problem);
    Write();
  }

  void Fail(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  // Memory the stream's problem may view and that lives as long as the stream: a copy of a
  // cache's tokens, so the trace holds no lease on the cache while a reader takes its time.
  std::vector<char>& snapshot() { return snapshot_; }
  // Counts `bytes` of snapshot against `open` (every open trace's snapshots) until the stream
  // ends; RESOURCE_EXHAUSTED when together they would pass `budget` (--max-naive-bytes).
  absl::Status ReserveSnapshot(std::atomic<int64_t>& open, int64_t bytes, int64_t budget) {
    const int64_t before = open.fetch_add(bytes);
    if (before + bytes > budget) {
      open.fetch_sub(bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("attention.cache_id: tracing copies the cache's ", bytes,
                       " bytes of tokens, and open traces already hold ", before,
                       " bytes of copies, over this server's --max-naive-bytes=", budget,
                       "; retry when a trace has ended"));
    }
    snapshot_budget_ = &open;
    snapshot_reserved_ = bytes;
    return absl::OkStatus();
  }
  ~TraceWriter() override {
    if (snapshot_budget_ != nullptr) snapshot_budget_->fetch_sub(snapshot_reserved_);
  }

  void OnWriteDone(bool ok) override {
    StreamWatch::WriteDone(watched_.get());
    if (!ok) {  // The client cancelled or went away, or stopped reading (StreamWatch).
      Finish(grpc::Status(
          grpc::StatusCode::CANCELLED,
          absl::StrCat("trace stream closed by the client, or cancelled after ",
                       watch_.idle_seconds(), " s without a read (--trace-idle-seconds)")));
      return;
    }
    if (event_.has_end()) {
      Finish(grpc::Status::OK);
      return;
    }
    // What computing or encoding the next event throws ends this stream, not the process.
    RunGuarded([this] { WriteNext(); }, [this](const absl::Status& status) { Fail(status); });
  }

  void OnDone() override {
    watch_.Done(watched_);
    delete this;
  }

 private:
  void Write() {
    StreamWatch::WriteStarted(watched_.get());
    StartWrite(&event_);
  }

  void WriteNext() {
    TraceItem item;
    event_.Clear();
    if (cursor_->Next(&item)) {
      if (std::holds_alternative<TraceStep>(item)) ++steps_;
      if (std::holds_alternative<TraceRowDone>(item)) ++rows_;
      EncodeTraceItem(item, &event_);
    } else {
      v1::TraceEnd* end = event_.mutable_end();
      end->set_rows(rows_);
      end->set_steps(steps_);
      FillStats(backend_, cursor_->stats(), start_, end->mutable_stats());
    }
    Write();
  }

  const Backend& backend_;
  std::unique_ptr<TraceCursor> cursor_;
  const Clock::time_point start_;
  v1::TraceEvent event_;
  int64_t rows_ = 0;
  int64_t steps_ = 0;
  TraceSlot slot_;
  StreamWatch& watch_;
  const std::shared_ptr<StreamWatch::Stream> watched_;
  std::vector<char> snapshot_;
  std::atomic<int64_t>* snapshot_budget_ = nullptr;
  int64_t snapshot_reserved_ = 0;
};

// A stream that fails before its first event.
class FailedWriter final : public grpc::ServerWriteReactor<v1::TraceEvent> {
 public:
  explicit FailedWriter(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// A TraceRequest's problem errors name their field inside `attention`.
absl::Status InAttention(const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("attention.", status.message()));
}

}  // namespace

grpc::ServerWriteReactor<v1::TraceEvent>* AttentionService::Trace(
    grpc::CallbackServerContext* context, const v1::TraceRequest* request) {
  const Clock::time_point start = Clock::now();
  auto fail = [](const absl::Status& status) { return new FailedWriter(ToGrpcStatus(status)); };
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return fail(accepting);
  if (!request->has_attention()) {
    return fail(absl::InvalidArgumentError("attention: is required"));
  }
  if (!request->attention().cache_id().empty()) return TraceOverCache(context, request, start);
  absl::StatusOr<Problem> problem =
      ParseAttentionShape(request->attention(), backend_.default_block_k());
  if (!problem.ok()) return fail(InAttention(problem.status()));
  absl::StatusOr<std::vector<RowRef>> rows = ParseTraceRows(*request, *problem, config_.trace);
  if (!rows.ok()) return fail(rows.status());
  TraceSlot slot(open_traces_);
  if (absl::Status room = slot.Take(config_.trace.max_streams); !room.ok()) return fail(room);
  auto* writer = new TraceWriter(backend_, start, std::move(slot), trace_watch_, context);
  // Opening the cursor checks every input element and, on a GPU, waits for a stream and
  // computes the whole trace: a compute queue's work, like Naive's and Tiled's.
  auto open = [this, writer, context, problem = *problem, rows = *std::move(rows)]() mutable {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      writer->Fail(interrupted);
      return;
    }
    if (absl::Status values = CheckAttentionValues(problem); !values.ok()) {
      writer->Fail(InAttention(values));
      return;
    }
    absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend_.Trace(problem, std::move(rows));
    if (!cursor.ok()) {
      writer->Fail(cursor.status());
      return;
    }
    writer->Begin(problem, *std::move(cursor));
  };
  ComputeJob job{.request_bytes = InflightBytes(*request, 0),
                 .work = std::move(open),
                 .refuse = [writer](const absl::Status& status) { writer->Fail(status); }};
  if (backend_.RunsInline(*problem)) {
    job.RunGuarded();
  } else if (absl::Status accepted = queue_.Submit(std::move(job)); !accepted.ok()) {
    writer->Fail(accepted);
  }
  return writer;
}

grpc::ServerWriteReactor<v1::TraceEvent>* AttentionService::TraceOverCache(
    grpc::CallbackServerContext* context, const v1::TraceRequest* request,
    Clock::time_point start) {
  auto fail = [](const absl::Status& status) { return new FailedWriter(ToGrpcStatus(status)); };
  const v1::AttentionRequest& attention = request->attention();
  if (absl::Status inline_keys = CheckNoInlineKeys(attention); !inline_keys.ok()) {
    return fail(InAttention(inline_keys));
  }
  if (absl::Status device = CheckDevice(); !device.ok()) return fail(device);
  const std::string owner = CallerIdentity(*context);
  const absl::StatusOr<KvLayout> layout =
      caches_.LayoutOf(owner, attention.cache_id(), "attention.cache_id");
  if (!layout.ok()) return fail(layout.status());
  if (absl::Status one = CheckOneSequence("attention.", attention); !one.ok()) return fail(one);
  absl::StatusOr<Problem> problem =
      ParseCacheQuery("attention.", TensorOrNull(attention.has_query(), attention.query()),
                      attention.options(), *layout, backend_.default_block_k());
  if (!problem.ok()) return fail(problem.status());
  TraceSlot slot(open_traces_);
  if (absl::Status room = slot.Take(config_.trace.max_streams); !room.ok()) return fail(room);
  auto* writer = new TraceWriter(backend_, start, std::move(slot), trace_watch_, context);
  auto open = [this, writer, context, request, owner, layout = *layout,
               problem = *problem]() mutable {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      writer->Fail(interrupted);
      return;
    }
    absl::StatusOr<std::vector<RowRef>> rows;
    {
      absl::StatusOr<CacheRegistry::Lease> lease =
          caches_.Acquire(owner, request->attention().cache_id(), "attention.cache_id");
      if (!lease.ok()) {
        writer->Fail(lease.status());
        return;
      }
      if (absl::Status bound = BindCache("attention.", lease->pages(), lease->length(),
                                         lease->max_abs_key(), lease->max_abs_value(), &problem);
          !bound.ok()) {
        writer->Fail(bound);
        return;
      }
      rows = ParseTraceRows(*request, problem, config_.trace);
      if (!rows.ok()) {
        writer->Fail(rows.status());
        return;
      }
      // The stream reads a copy of the tokens, taken now: the lease ends before the first
      // write, so appends to the cache never wait for a slow reader. An fp8 cache's copy is its
      // rows dequantized to fp32 (code · scale, the values every kernel reads), dense: a backend
      // reads dense tensors of any dtype, but only its own pages.
      const Shape& s = problem.shape;
      const bool fp8 = layout.dtype == DType::kFloat8E4M3;
      const int64_t key_bytes = KeyBytes(layout, s.key_len);
      const int64_t value_bytes =
          s.kv_heads * s.key_len * StoredRowBytes(layout.dtype, s.value_dim);
      const int64_t dequantized_bytes =
          fp8 ? s.kv_heads * s.key_len * (s.head_dim + s.value_dim) * 4 : 0;
      if (absl::Status room =
              writer->ReserveSnapshot(snapshot_bytes_, key_bytes + value_bytes + dequantized_bytes,
                                      backend_.max_naive_bytes());
          !room.ok()) {
        writer->Fail(room);
        return;
      }
      std::vector<char> stored(key_bytes + value_bytes);
      if (absl::Status copied =
              lease->CopyOut(0, lease->length(), stored.data(), stored.data() + key_bytes);
          !copied.ok()) {
        writer->Fail(copied);
        return;
      }
      std::vector<char>& snapshot = writer->snapshot();
      if (fp8) {
        snapshot.resize(dequantized_bytes);
        float* keys = reinterpret_cast<float*>(snapshot.data());
        float* values = keys + s.kv_heads * s.key_len * s.head_dim;
        const int64_t key_row = KeyRowBytes(layout);
        const int64_t value_row = StoredRowBytes(layout.dtype, s.value_dim);
        for (int64_t r = 0; r < s.kv_heads * s.key_len; ++r) {
          DequantizeFp8Row(stored.data() + r * key_row, s.head_dim, key_row, keys + r * s.head_dim);
          DequantizeFp8Row(stored.data() + key_bytes + r * value_row, s.value_dim, value_row,
                           values + r * s.value_dim);
        }
        problem.key = TensorView{keys, DType::kFloat32};
        problem.value = TensorView{values, DType::kFloat32};
      } else {
        snapshot = std::move(stored);
        problem.key = TensorView{snapshot.data(), layout.dtype};
        problem.value = TensorView{snapshot.data() + key_bytes, layout.dtype};
      }
      problem.pages = nullptr;
    }
    absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend_.Trace(problem, *std::move(rows));
    if (!cursor.ok()) {
      writer->Fail(cursor.status());
      return;
    }
    writer->Begin(problem, *std::move(cursor));
  };
  absl::Status accepted =
      queue_.Submit({.request_bytes = InflightBytes(*request, 0),
                     .work = std::move(open),
                     .refuse = [writer](const absl::Status& status) { writer->Fail(status); }});
  if (!accepted.ok()) writer->Fail(accepted);
  return writer;
}

}  // namespace attn
