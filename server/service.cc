#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using Clock = std::chrono::steady_clock;

int64_t NanosSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

void FillStats(const Backend& backend, const Stats& stats, Clock::time_point start,
               v1::ExecutionStats* message) {
  EncodeStats(stats, message);
  message->set_backend(std::string(backend.name()));
  message->set_device(backend.device());
  message->set_server_ns(NanosSince(start));
}

// One of the --max-traces stream slots, released when the stream ends.
class TraceSlot {
 public:
  explicit TraceSlot(std::atomic<int64_t>& open) : open_(&open) {}
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
  TraceWriter(const Backend& backend, Clock::time_point start, TraceSlot slot)
      : backend_(backend), start_(start), slot_(std::move(slot)) {}

  void Begin(const Problem& problem, std::unique_ptr<TraceCursor> cursor) {
    cursor_ = std::move(cursor);
    *event_.mutable_start() = EncodeTraceStart(problem);
    StartWrite(&event_);
  }

  void Fail(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  void OnWriteDone(bool ok) override {
    if (!ok) {  // The client cancelled or went away: stop computing.
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "trace stream closed by the client"));
      return;
    }
    if (event_.has_end()) {
      Finish(grpc::Status::OK);
      return;
    }
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
    StartWrite(&event_);
  }

  void OnDone() override { delete this; }

 private:
  const Backend& backend_;
  std::unique_ptr<TraceCursor> cursor_;
  const Clock::time_point start_;
  v1::TraceEvent event_;
  int64_t rows_ = 0;
  int64_t steps_ = 0;
  TraceSlot slot_;
};

// A stream that fails before its first event.
class FailedWriter final : public grpc::ServerWriteReactor<v1::TraceEvent> {
 public:
  explicit FailedWriter(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

AdmissionLimits ResolveLimits(const Backend& backend, AdmissionLimits limits) {
  if (limits.max_inflight <= 0) limits.max_inflight = backend.concurrency();
  if (limits.memory_bytes <= 0) limits.memory_bytes = backend.max_naive_bytes();
  return limits;
}

// Bytes a computation holds while it runs, for admission: Naive's fp32 score and weight
// matrices, so that concurrent ones stay within the budget together. Capped at the budget: the
// backend itself refuses a single Naive past it, with a message that names Tiled. Tiled's
// scratch is a few tiles per worker: not counted.
int64_t HeldBytes(bool naive, const Problem& problem, int64_t budget) {
  return naive ? std::min(problem.NaiveStorageBytes(), budget) : 0;
}

// Why a call must stop now, if it must: the client cancelled or its deadline passed.
absl::Status Interruption(grpc::CallbackServerContext* context) {
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed");
  }
  if (context->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  return absl::OkStatus();
}

}  // namespace

AttentionService::AttentionService(Backend& backend, ServiceConfig config)
    : backend_(backend),
      config_(std::move(config)),
      queue_(ResolveLimits(backend, config_.admission)) {}

absl::Status AttentionService::CheckAccepting() const {
  if (!draining_.load()) return absl::OkStatus();
  return absl::UnavailableError("attnd is shutting down and takes no new calls; retry elsewhere");
}

absl::Status AttentionService::CheckDevice() {
  if (backend_.healthy()) return absl::OkStatus();
  if (!loss_reported_.exchange(true) && config_.on_device_lost) config_.on_device_lost();
  return absl::UnavailableError(absl::StrCat("the ", backend_.name(),
                                             " device failed; this server cannot compute until "
                                             "it restarts"));
}

grpc::ServerUnaryReactor* AttentionService::Naive(grpc::CallbackServerContext* context,
                                                  const v1::AttentionRequest* request,
                                                  v1::AttentionResponse* response) {
  return Compute(Method::kNaive, context, request, response);
}

grpc::ServerUnaryReactor* AttentionService::Tiled(grpc::CallbackServerContext* context,
                                                  const v1::AttentionRequest* request,
                                                  v1::AttentionResponse* response) {
  return Compute(Method::kTiled, context, request, response);
}

grpc::ServerUnaryReactor* AttentionService::Compute(Method method,
                                                    grpc::CallbackServerContext* context,
                                                    const v1::AttentionRequest* request,
                                                    v1::AttentionResponse* response) {
  const Clock::time_point start = Clock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Failures are logged, with the rest of the call, by the request log (request_log.h).
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };

  // On gRPC's callback thread only what takes no time whatever the payload: the shape checks.
  absl::StatusOr<Problem> problem = ParseAttentionShape(*request, backend_.default_block_k());
  if (!problem.ok()) {
    fail(problem.status());
    return reactor;
  }
  if (absl::Status device = CheckDevice(); !device.ok()) {
    fail(device);
    return reactor;
  }
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) {
    fail(accepting);
    return reactor;
  }
  const bool naive = method == Method::kNaive;
  // The call's work: the values check (a pass over every input element), the kernel, the answer.
  auto run = [this, naive, context, request, response, problem = *problem, start, fail, reactor] {
    // A call whose client left, or whose deadline passed, while it waited never starts.
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    if (absl::Status values = CheckAttentionValues(problem); !values.ok()) {
      fail(values);
      return;
    }
    Outputs outputs = PrepareOutputs(problem, *request, response);
    outputs.interrupt = [context] { return Interruption(context); };
    absl::StatusOr<Stats> stats =
        naive ? backend_.Naive(problem, outputs) : backend_.Tiled(problem, outputs);
    if (!stats.ok()) {
      response->Clear();
      fail(stats.status());
      return;
    }
    FillStats(backend_, *stats, start, response->mutable_stats());
    reactor->Finish(grpc::Status::OK);
  };
  // A call too small to matter runs here: the hand-off to a worker and back would cost more.
  if (backend_.RunsInline(*problem)) {
    run();
    return reactor;
  }
  absl::Status accepted =
      queue_.Submit(HeldBytes(naive, *problem, queue_.limits().memory_bytes), std::move(run));
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

namespace {

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
  absl::StatusOr<Problem> problem =
      ParseAttentionShape(request->attention(), backend_.default_block_k());
  if (!problem.ok()) return fail(InAttention(problem.status()));
  absl::StatusOr<std::vector<RowRef>> rows = ParseTraceRows(*request, *problem, config_.trace);
  if (!rows.ok()) return fail(rows.status());
  TraceSlot slot(open_traces_);
  if (const int64_t open = open_traces_.fetch_add(1); open >= config_.trace.max_streams) {
    return fail(absl::ResourceExhaustedError(absl::StrCat(
        "server busy: ", open, " trace streams open (--max-traces=", config_.trace.max_streams,
        "); retry later")));
  }
  auto* writer = new TraceWriter(backend_, start, std::move(slot));
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
  if (backend_.RunsInline(*problem)) {
    open();
  } else if (absl::Status accepted = queue_.Submit(0, std::move(open)); !accepted.ok()) {
    writer->Fail(accepted);
  }
  return writer;
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest* request,
                                                          v1::ServerInfo* response) {
  response->set_version(ATTN_VERSION);
  response->set_backend(std::string(backend_.name()));
  response->set_device(backend_.device());
  response->set_device_memory_bytes(backend_.memory_bytes());
  response->add_dtypes(v1::DTYPE_FLOAT32);
  response->add_dtypes(v1::DTYPE_FLOAT16);
  response->add_dtypes(v1::DTYPE_BFLOAT16);
  response->set_max_message_bytes(config_.max_message_bytes);
  response->set_max_naive_bytes(backend_.max_naive_bytes());
  response->set_default_block_k(backend_.default_block_k());
  response->set_max_inflight(queue_.limits().max_inflight);
  response->set_max_queue(queue_.limits().max_queue);
  response->set_max_trace_rows(config_.trace.max_rows);
  response->set_max_trace_steps(config_.trace.max_steps);
  response->set_max_traces(config_.trace.max_streams);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attn
