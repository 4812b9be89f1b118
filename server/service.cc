#include "server/service.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

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

// Streams a trace: TraceStart, the cursor's events one write at a time, TraceEnd.
class TraceWriter final : public grpc::ServerWriteReactor<v1::TraceEvent> {
 public:
  TraceWriter(const Backend& backend, const Problem& problem, std::unique_ptr<TraceCursor> cursor,
              Clock::time_point start)
      : backend_(backend), cursor_(std::move(cursor)), start_(start) {
    *event_.mutable_start() = EncodeTraceStart(problem);
    StartWrite(&event_);
  }

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

void LogFailedRequest(absl::string_view method, const std::string& peer,
                      const absl::Status& status) {
  const std::string line = absl::StrCat(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " attnd ", method,
      " from ", peer, " failed: ", absl::StatusCodeToString(status.code()), ": ", status.message(),
      "\n");
  std::fputs(line.c_str(), stderr);
}

AttentionService::AttentionService(Backend& backend, ServiceConfig config)
    : backend_(backend), config_(std::move(config)), queue_(backend.concurrency()) {}

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
  const absl::string_view name = method == Method::kNaive ? "Naive" : "Tiled";
  const std::string peer = context->peer();
  auto fail = [reactor, name, peer](const absl::Status& status) {
    LogFailedRequest(name, peer, status);
    reactor->Finish(ToGrpcStatus(status));
  };

  absl::StatusOr<Problem> problem = ParseAttentionRequest(*request, backend_.default_block_k());
  if (!problem.ok()) {
    fail(problem.status());
    return reactor;
  }
  if (absl::Status device = CheckDevice(); !device.ok()) {
    fail(device);
    return reactor;
  }
  queue_.Submit(
      [this, method, context, request, response, problem = *problem, start, fail, reactor] {
        if (context->IsCancelled()) {
          fail(absl::CancelledError("the client cancelled the call before it started"));
          return;
        }
        const Outputs outputs = PrepareOutputs(problem, *request, response);
        absl::StatusOr<Stats> stats = method == Method::kNaive ? backend_.Naive(problem, outputs)
                                                               : backend_.Tiled(problem, outputs);
        if (!stats.ok()) {
          response->Clear();
          fail(stats.status());
          return;
        }
        FillStats(backend_, *stats, start, response->mutable_stats());
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerWriteReactor<v1::TraceEvent>* AttentionService::Trace(
    grpc::CallbackServerContext* context, const v1::TraceRequest* request) {
  const Clock::time_point start = Clock::now();
  auto fail = [context](const absl::Status& status) {
    LogFailedRequest("Trace", context->peer(), status);
    return new FailedWriter(ToGrpcStatus(status));
  };
  if (!request->has_attention()) {
    return fail(absl::InvalidArgumentError("attention: is required"));
  }
  absl::StatusOr<Problem> problem =
      ParseAttentionRequest(request->attention(), backend_.default_block_k());
  if (!problem.ok()) {
    return fail(absl::InvalidArgumentError(absl::StrCat("attention.", problem.status().message())));
  }
  absl::StatusOr<std::vector<RowRef>> rows = ParseTraceRows(*request, *problem, config_.trace);
  if (!rows.ok()) return fail(rows.status());
  absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = backend_.Trace(*problem, *std::move(rows));
  if (!cursor.ok()) return fail(cursor.status());
  return new TraceWriter(backend_, *problem, *std::move(cursor), start);
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
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attn
