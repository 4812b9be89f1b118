#include "server/service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/security.h"

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
    problem_ = problem;
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
  Problem problem_;  // Views the request's memory (or snapshot_), as the cursor does.
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

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

AdmissionLimits ResolveLimits(const Backend& backend, AdmissionLimits limits) {
  if (limits.max_inflight <= 0) limits.max_inflight = backend.concurrency();
  if (limits.memory_bytes <= 0) limits.memory_bytes = backend.max_naive_bytes();
  if (limits.max_inflight_bytes <= 0) {  // Requests live in host memory, whatever the device.
    limits.max_inflight_bytes = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGE_SIZE) / 4;
  }
  return limits;
}

CacheLimits ResolveCacheLimits(const Backend& backend, CacheLimits limits) {
  if (limits.budget_bytes <= 0) limits.budget_bytes = backend.memory_bytes() / 2;
  return limits;
}

// Bytes a computation holds while it runs, for admission: Naive's fp32 score and weight
// matrices, so that concurrent ones stay within the budget together. Capped at the budget: the
// backend itself refuses a single Naive past it, with a message that names Tiled. Tiled's
// scratch is a few tiles per worker: not counted.
int64_t HeldBytes(bool naive, const Problem& problem, int64_t budget) {
  return naive ? std::min(problem.NaiveStorageBytes(), budget) : 0;
}

// The bytes a call holds from admission until it answers, against --max-inflight-bytes: its
// request's and its answer's tensors.
int64_t InflightBytes(const google::protobuf::Message& request, int64_t reply_bytes) {
  const int64_t total = static_cast<int64_t>(request.ByteSizeLong()) + reply_bytes;
  return total < 0 ? std::numeric_limits<int64_t>::max() : total;
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
      caches_(backend, ResolveCacheLimits(backend, config_.caches)),
      trace_watch_(config_.trace.idle_seconds),
      queue_(ResolveLimits(backend, config_.admission)) {}

void AttentionService::CancelQueued() {
  queue_.CancelQueued(absl::UnavailableError(
      "attnd shut down before this call reached a compute worker; nothing of it was applied: "
      "retry elsewhere"));
}

absl::Status AttentionService::CheckAccepting() const {
  if (!draining_.load()) return absl::OkStatus();
  return absl::UnavailableError("attnd is shutting down and takes no new calls; retry elsewhere");
}

bool AttentionService::WaitUntilIdle(std::chrono::system_clock::time_point deadline) const {
  while (!Idle()) {
    if (std::chrono::system_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
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

void AttentionService::Answer(bool naive, const Problem& problem,
                              grpc::CallbackServerContext* context,
                              const v1::AttentionRequest* request, v1::AttentionResponse* response,
                              Clock::time_point start, grpc::ServerUnaryReactor* reactor) {
  Outputs outputs = PrepareOutputs(problem, *request, response);
  outputs.interrupt = [context] { return Interruption(context); };
  absl::StatusOr<Stats> stats =
      naive ? backend_.Naive(problem, outputs) : backend_.Tiled(problem, outputs);
  if (!stats.ok()) {
    response->Clear();
    reactor->Finish(ToGrpcStatus(stats.status()));
    return;
  }
  FillStats(backend_, *stats, start, response->mutable_stats());
  reactor->Finish(grpc::Status::OK);
}

grpc::ServerUnaryReactor* AttentionService::Compute(Method method,
                                                    grpc::CallbackServerContext* context,
                                                    const v1::AttentionRequest* request,
                                                    v1::AttentionResponse* response) {
  const Clock::time_point start = Clock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Failures are logged, with the rest of the call, by the request log (request_log.h).
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  if (!request->cache_id().empty()) return ComputeOverCache(method, context, request, response);

  // On gRPC's callback thread only what takes no time whatever the payload: the shape checks.
  absl::StatusOr<Problem> problem = ParseAttentionShape(*request, backend_.default_block_k());
  if (!problem.ok()) {
    fail(problem.status());
    return reactor;
  }
  const int64_t reply_bytes = ReplyTensorBytes(*problem);
  if (absl::Status reply = CheckReplyBytes("query", reply_bytes, config_.max_message_bytes);
      !reply.ok()) {
    fail(reply);
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
    Answer(naive, problem, context, request, response, start, reactor);
  };
  ComputeJob job{.memory_bytes = HeldBytes(naive, *problem, queue_.limits().memory_bytes),
                 .request_bytes = InflightBytes(*request, reply_bytes),
                 .work = std::move(run),
                 .refuse = fail};
  // A call too small to matter runs here: the hand-off to a worker and back would cost more.
  if (backend_.RunsInline(*problem)) {
    job.RunGuarded();
    return reactor;
  }
  if (absl::Status accepted = queue_.Submit(std::move(job)); !accepted.ok()) fail(accepted);
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
  response->set_cache_bytes(caches_.limits().budget_bytes);
  response->set_cache_page_tokens(backend_.kv_page_tokens());
  response->set_cache_idle_seconds(caches_.limits().idle_seconds);
  response->set_max_caches(caches_.limits().max_caches);
  response->set_max_inflight_bytes(queue_.limits().max_inflight_bytes);
  response->set_trace_idle_seconds(trace_watch_.idle_seconds());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

// A unary reactor's failure, as every handler below reports it.
grpc::ServerUnaryReactor* Failed(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* Finished(grpc::CallbackServerContext* context) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

const v1::Tensor* Present(bool has, const v1::Tensor& tensor) { return has ? &tensor : nullptr; }

// A call's expected_length against its cache's `length` (−1: not known yet, only the sign is
// checked): INVALID_ARGUMENT when negative, FAILED_PRECONDITION naming the actual length when
// stale — nothing of the call was applied, so a retried append is detected, never doubled.
absl::Status CheckExpectedLength(absl::string_view prefix, int64_t expected,
                                 absl::string_view cache_id, int64_t length) {
  if (expected < 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "expected_length: is ", expected,
                                                   "; expected the cache's length (≥ 0)"));
  }
  if (length < 0 || expected == length) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(prefix, "expected_length: is ", expected,
                                                    " but cache ", cache_id, " holds ", length,
                                                    " tokens; nothing of this call was applied"));
}

// A cache problem's key and value fields must be absent: its keys are the cache's.
absl::Status CheckNoInlineKeys(const v1::AttentionRequest& request) {
  if (request.has_key() || request.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.has_key() ? "key" : "value",
        ": must be absent when cache_id names a cache (its keys and values are the cache's)"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::ComputeOverCache(Method method,
                                                             grpc::CallbackServerContext* context,
                                                             const v1::AttentionRequest* request,
                                                             v1::AttentionResponse* response) {
  const Clock::time_point start = Clock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  if (absl::Status inline_keys = CheckNoInlineKeys(*request); !inline_keys.ok()) {
    fail(inline_keys);
    return reactor;
  }
  for (const absl::Status& status : {CheckDevice(), CheckAccepting()}) {
    if (!status.ok()) {
      fail(status);
      return reactor;
    }
  }
  const std::string owner = CallerIdentity(*context);
  const absl::StatusOr<KvLayout> layout = caches_.LayoutOf(owner, request->cache_id(), "cache_id");
  if (!layout.ok()) {
    fail(layout.status());
    return reactor;
  }
  if (absl::Status one = CheckOneSequence("", *request); !one.ok()) {
    fail(one);
    return reactor;
  }
  absl::StatusOr<Problem> problem =
      ParseCacheQuery("", Present(request->has_query(), request->query()), request->options(),
                      *layout, backend_.default_block_k());
  if (!problem.ok()) {
    fail(problem.status());
    return reactor;
  }
  const int64_t reply_bytes = ReplyTensorBytes(*problem);
  if (absl::Status reply = CheckReplyBytes("query", reply_bytes, config_.max_message_bytes);
      !reply.ok()) {
    fail(reply);
    return reactor;
  }
  const bool naive = method == Method::kNaive;
  // Admission counts Naive's matrices at the cache's length now (appends may still grow it).
  Problem estimate = *problem;
  if (absl::StatusOr<CacheDescription> now = caches_.Describe(owner, request->cache_id());
      now.ok()) {
    estimate.shape.key_len = std::max<int64_t>(now->length, 1);
  }
  auto run = [this, naive, context, request, response, owner, problem = *problem, start, fail,
              reactor]() mutable {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    absl::StatusOr<CacheRegistry::Lease> lease =
        caches_.Acquire(owner, request->cache_id(), "cache_id");
    if (!lease.ok()) {
      fail(lease.status());
      return;
    }
    if (absl::Status bound = BindCache("", lease->pages(), lease->length(), lease->max_abs_key(),
                                       lease->max_abs_value(), &problem);
        !bound.ok()) {
      fail(bound);
      return;
    }
    Answer(naive, problem, context, request, response, start, reactor);
  };
  absl::Status accepted =
      queue_.Submit({.memory_bytes = HeldBytes(naive, estimate, queue_.limits().memory_bytes),
                     .request_bytes = InflightBytes(*request, reply_bytes),
                     .work = std::move(run),
                     .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
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
      ParseCacheQuery("attention.", Present(attention.has_query(), attention.query()),
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
      // write, so appends to the cache never wait for a slow reader.
      const Shape& s = problem.shape;
      const int64_t element = ElementSize(layout.dtype);
      const int64_t key_bytes = s.kv_heads * s.key_len * s.head_dim * element;
      const int64_t value_bytes = s.kv_heads * s.key_len * s.value_dim * element;
      if (absl::Status room = writer->ReserveSnapshot(snapshot_bytes_, key_bytes + value_bytes,
                                                      backend_.max_naive_bytes());
          !room.ok()) {
        writer->Fail(room);
        return;
      }
      std::vector<char>& snapshot = writer->snapshot();
      snapshot.resize(key_bytes + value_bytes);
      if (absl::Status copied = lease->CopyOut(snapshot.data(), snapshot.data() + key_bytes);
          !copied.ok()) {
        writer->Fail(copied);
        return;
      }
      problem.pages = nullptr;
      problem.key = TensorView{snapshot.data(), layout.dtype};
      problem.value = TensorView{snapshot.data() + key_bytes, layout.dtype};
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

grpc::ServerUnaryReactor* AttentionService::CreateCache(grpc::CallbackServerContext* context,
                                                        const v1::CreateCacheRequest* request,
                                                        v1::CacheInfo* response) {
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return Failed(context, accepting);
  if (absl::Status device = CheckDevice(); !device.ok()) return Failed(context, device);
  const absl::StatusOr<KvLayout> layout = ParseCreateCache(*request);
  if (!layout.ok()) return Failed(context, layout.status());
  const absl::StatusOr<CacheDescription> cache = caches_.Create(CallerIdentity(*context), *layout);
  if (!cache.ok()) return Failed(context, cache.status());
  EncodeCacheInfo(*cache, response);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::AppendCache(grpc::CallbackServerContext* context,
                                                        const v1::AppendCacheRequest* request,
                                                        v1::CacheInfo* response) {
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return Failed(context, accepting);
  if (absl::Status device = CheckDevice(); !device.ok()) return Failed(context, device);
  const std::string owner = CallerIdentity(*context);
  const absl::StatusOr<KvLayout> layout = caches_.LayoutOf(owner, request->cache_id(), "cache_id");
  if (!layout.ok()) return Failed(context, layout.status());
  const absl::StatusOr<NewTokens> tokens =
      ParseNewTokens("", Present(request->has_key(), request->key()),
                     Present(request->has_value(), request->value()), *layout, false);
  if (!tokens.ok()) return Failed(context, tokens.status());
  if (absl::Status length = CheckExpectedLength("", request->expected_length(), "", -1);
      !length.ok()) {
    return Failed(context, length);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  // The copy into the cache's pages (and the pass over the tokens) is compute-queue work.
  auto run = [this, context, request, response, owner, layout = *layout, tokens = *tokens, fail,
              reactor] {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    double max_key, max_value;
    if (absl::Status values = CheckNewTokenValues("", tokens, layout, &max_key, &max_value);
        !values.ok()) {
      fail(values);
      return;
    }
    absl::StatusOr<CacheRegistry::Lease> lease =
        caches_.Acquire(owner, request->cache_id(), "cache_id");
    if (!lease.ok()) {
      fail(lease.status());
      return;
    }
    if (absl::Status length = CheckExpectedLength("", request->expected_length(),
                                                  request->cache_id(), lease->length());
        !length.ok()) {
      fail(length);
      return;
    }
    if (absl::Status appended =
            lease->Append(tokens.key, tokens.value, tokens.n, max_key, max_value);
        !appended.ok()) {
      fail(appended);
      return;
    }
    EncodeCacheInfo(lease->Describe(), response);
    lease->Commit();
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit(
      {.request_bytes = InflightBytes(*request, 0), .work = std::move(run), .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::GetCacheInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetCacheInfoRequest* request,
                                                         v1::CacheInfo* response) {
  const absl::StatusOr<CacheDescription> cache =
      caches_.Describe(CallerIdentity(*context), request->cache_id());
  if (!cache.ok()) return Failed(context, cache.status());
  EncodeCacheInfo(*cache, response);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::DeleteCache(grpc::CallbackServerContext* context,
                                                        const v1::DeleteCacheRequest* request,
                                                        v1::DeleteCacheResponse* /*response*/) {
  const absl::Status deleted = caches_.Delete(CallerIdentity(*context), request->cache_id());
  if (!deleted.ok()) return Failed(context, deleted);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::ListCaches(grpc::CallbackServerContext* context,
                                                       const v1::ListCachesRequest* /*request*/,
                                                       v1::ListCachesResponse* response) {
  for (const CacheDescription& cache : caches_.List(CallerIdentity(*context))) {
    EncodeCacheInfo(cache, response->add_caches());
  }
  return Finished(context);
}

namespace {

constexpr int kMaxDecodeItems = 4096;

// One item of a Decode batch, checked as to shape.
struct DecodeWork {
  std::string prefix;  // "items[i]."
  Problem problem;
  NewTokens tokens;
  KvLayout layout;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionService::Decode(grpc::CallbackServerContext* context,
                                                   const v1::DecodeRequest* request,
                                                   v1::DecodeResponse* response) {
  const Clock::time_point start = Clock::now();
  if (request->items_size() == 0) {
    return Failed(context, absl::InvalidArgumentError(
                               "items: is empty; a Decode call needs at least one DecodeItem"));
  }
  if (request->items_size() > kMaxDecodeItems) {
    return Failed(context, absl::InvalidArgumentError(absl::StrCat(
                               "items: has ", request->items_size(), " entries; at most ",
                               kMaxDecodeItems, " sequences per Decode call")));
  }
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return Failed(context, accepting);
  if (absl::Status device = CheckDevice(); !device.ok()) return Failed(context, device);
  if (absl::Status options = CheckDecodeOptions(request->options()); !options.ok()) {
    return Failed(context, options);
  }
  const std::string owner = CallerIdentity(*context);
  std::vector<DecodeWork> work;
  std::map<std::string, int> item_of_cache;
  int64_t reply_bytes = 0;  // Every item's output and lse: one reply carries them all.
  for (int i = 0; i < request->items_size(); ++i) {
    const v1::DecodeItem& item = request->items(i);
    DecodeWork w;
    w.prefix = absl::StrCat("items[", i, "].");
    if (item.cache_id().empty()) {
      return Failed(context,
                    absl::InvalidArgumentError(absl::StrCat(w.prefix, "cache_id: is required")));
    }
    if (const auto [at, fresh] = item_of_cache.emplace(item.cache_id(), i); !fresh) {
      return Failed(context, absl::InvalidArgumentError(absl::StrCat(
                                 w.prefix, "cache_id: names the same cache as items[", at->second,
                                 "]; a Decode call takes at most one item per cache")));
    }
    if (absl::Status length = CheckExpectedLength(w.prefix, item.expected_length(), "", -1);
        !length.ok()) {
      return Failed(context, length);
    }
    absl::StatusOr<KvLayout> layout =
        caches_.LayoutOf(owner, item.cache_id(), absl::StrCat(w.prefix, "cache_id"));
    if (!layout.ok()) return Failed(context, layout.status());
    w.layout = *layout;
    absl::StatusOr<Problem> problem =
        ParseCacheQuery(w.prefix, Present(item.has_query(), item.query()), request->options(),
                        w.layout, backend_.default_block_k());
    if (!problem.ok()) return Failed(context, problem.status());
    w.problem = *problem;
    const int64_t item_reply = ReplyTensorBytes(w.problem);
    if (absl::Status reply =
            CheckReplyBytes(absl::StrCat(w.prefix, "query"), item_reply, config_.max_message_bytes);
        !reply.ok()) {
      return Failed(context, reply);
    }
    reply_bytes += item_reply;  // Each below 2^31: no overflow over 4096 items.
    if (absl::Status reply = CheckReplyBytes("items", reply_bytes, config_.max_message_bytes);
        !reply.ok()) {
      return Failed(context, reply);
    }
    if (absl::Status positions =
            ParsePositions(w.prefix, item.key_position(),
                           item.has_query_position() ? std::optional<int64_t>(item.query_position())
                                                     : std::nullopt,
                           &w.problem);
        !positions.ok()) {
      return Failed(context, positions);
    }
    absl::StatusOr<NewTokens> tokens =
        ParseNewTokens(w.prefix, Present(item.has_key(), item.key()),
                       Present(item.has_value(), item.value()), w.layout, true);
    if (!tokens.ok()) return Failed(context, tokens.status());
    w.tokens = *tokens;
    work.push_back(std::move(w));
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor, response](const absl::Status& status) {
    response->Clear();
    reactor->Finish(ToGrpcStatus(status));
  };
  auto run = [this, context, request, response, owner, work = std::move(work), start, fail,
              reactor]() mutable {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    // Every input's elements before any cache is held or changed.
    std::vector<std::pair<double, double>> maxima(work.size());
    for (size_t i = 0; i < work.size(); ++i) {
      if (absl::Status values = CheckNewTokenValues(work[i].prefix, work[i].tokens, work[i].layout,
                                                    &maxima[i].first, &maxima[i].second);
          !values.ok()) {
        fail(values);
        return;
      }
    }
    // Hold the caches in id order, so batches naming the same caches cannot deadlock.
    std::vector<size_t> order(work.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return request->items(a).cache_id() < request->items(b).cache_id();
    });
    std::vector<std::optional<CacheRegistry::Lease>> leases(work.size());
    for (size_t i : order) {
      absl::StatusOr<CacheRegistry::Lease> lease = caches_.Acquire(
          owner, request->items(i).cache_id(), absl::StrCat(work[i].prefix, "cache_id"));
      if (!lease.ok()) {
        fail(lease.status());
        return;
      }
      leases[i].emplace(*std::move(lease));
    }
    for (size_t i = 0; i < work.size(); ++i) {
      if (absl::Status length =
              CheckExpectedLength(work[i].prefix, request->items(i).expected_length(),
                                  request->items(i).cache_id(), leases[i]->length());
          !length.ok()) {
        fail(length);
        return;
      }
    }
    // From here on a failure takes back every item's tokens: all items or none.
    auto undo = [&](const absl::Status& status) {
      for (std::optional<CacheRegistry::Lease>& lease : leases) lease->Rollback();
      fail(status);
    };
    std::vector<Problem> problems;
    std::vector<Outputs> outputs;
    for (size_t i = 0; i < work.size(); ++i) {
      DecodeWork& w = work[i];
      CacheRegistry::Lease& lease = *leases[i];
      if (w.tokens.n > 0) {
        if (absl::Status appended = lease.Append(w.tokens.key, w.tokens.value, w.tokens.n,
                                                 maxima[i].first, maxima[i].second);
            !appended.ok()) {
          undo(appended);
          return;
        }
      }
    }
    for (size_t i = 0; i < work.size(); ++i) {
      DecodeWork& w = work[i];
      CacheRegistry::Lease& lease = *leases[i];
      if (absl::Status bound = BindCache(w.prefix, lease.pages(), lease.length(),
                                         lease.max_abs_key(), lease.max_abs_value(), &w.problem);
          !bound.ok()) {
        undo(bound);
        return;
      }
      problems.push_back(w.problem);
      Outputs out = PrepareOutputs(w.problem, request->items(i).query(), response->add_outputs(),
                                   w.problem.return_lse ? response->add_lse() : nullptr);
      out.interrupt = [context] { return Interruption(context); };
      outputs.push_back(std::move(out));
    }
    absl::StatusOr<Stats> stats = backend_.Decode(problems, outputs);
    if (!stats.ok()) {
      undo(stats.status());
      return;
    }
    for (const std::optional<CacheRegistry::Lease>& lease : leases) {
      EncodeCacheInfo(lease->Describe(), response->add_caches());
    }
    FillStats(backend_, *stats, start, response->mutable_stats());
    for (std::optional<CacheRegistry::Lease>& lease : leases) lease->Commit();
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit({.request_bytes = InflightBytes(*request, reply_bytes),
                                         .work = std::move(run),
                                         .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

}  // namespace attn
