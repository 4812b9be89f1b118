// AttentionService (service.h), its common part: construction, drain and device checks, the
// Naive and Tiled handlers (inline tensors or over a cache), GetServerInfo, and the plumbing all
// its handler files share (service_internal.h). Trace: service_trace.cc; the cache RPCs and
// Decode: service_caches.cc.
#include "server/service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/response.h"
#include "server/security.h"
#include "server/service_internal.h"

namespace attn {

namespace v1 = attention::v1;

namespace service_internal {

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

absl::Status Interruption(grpc::CallbackServerContext* context) {
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed");
  }
  if (context->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  return absl::OkStatus();
}

int64_t InflightBytes(const google::protobuf::Message& request, int64_t reply_bytes) {
  const int64_t total = static_cast<int64_t>(request.ByteSizeLong()) + reply_bytes;
  return total < 0 ? std::numeric_limits<int64_t>::max() : total;
}

namespace {

int64_t Nanoseconds(Clock::duration duration) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count();
}

// The stats with server_ns from `start` to `now`.
void FillStatsAt(const Backend& backend, const Stats& stats, Clock::time_point start,
                 Clock::time_point now, v1::ExecutionStats* message) {
  EncodeStats(stats, message);
  message->set_backend(std::string(backend.name()));
  message->set_device(backend.device());
  message->set_server_ns(Nanoseconds(now - start));
}

}  // namespace

void FillStats(const Backend& backend, const Stats& stats, Clock::time_point start,
               v1::ExecutionStats* message) {
  FillStatsAt(backend, stats, start, Clock::now(), message);
}

void FillStats(const Backend& backend, const Stats& stats, const Timeline& timeline,
               v1::ExecutionStats* message) {
  const Clock::time_point now = Clock::now();  // The end of both server_ns and the finish.
  FillStatsAt(backend, stats, timeline.start, now, message);
  v1::ServerStages* stages = message->mutable_stages();
  stages->set_handler_ns(Nanoseconds(timeline.handed_off - timeline.start));
  stages->set_queue_ns(Nanoseconds(timeline.started - timeline.handed_off));
  stages->set_prepare_ns(Nanoseconds(timeline.computing - timeline.started));
  stages->set_finish_ns(Nanoseconds(now - timeline.computed));
}

}  // namespace service_internal

using service_internal::Clock;
using service_internal::FillStats;
using service_internal::InflightBytes;
using service_internal::Interruption;
using service_internal::Timeline;

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

}  // namespace

AttentionService::AttentionService(Backend& backend, ServiceConfig config)
    : backend_(backend),
      config_(std::move(config)),
      shared_memory_(config_.allow_shared_memory, config_.max_message_bytes),
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
                              Timeline& timeline, grpc::ServerUnaryReactor* reactor) {
  Outputs outputs = PrepareOutputs(problem, *request, response);
  outputs.interrupt = [context] { return Interruption(context); };
  timeline.computing = Clock::now();
  absl::StatusOr<Stats> stats =
      naive ? backend_.Naive(problem, outputs) : backend_.Tiled(problem, outputs);
  timeline.computed = Clock::now();
  if (stats.ok() && request->has_output_to()) {
    if (absl::Status written =
            shared_memory_.WriteOutput(CallerIdentity(*context), request->output_to(), "output_to",
                                       response->mutable_output());
        !written.ok()) {
      stats = written;
    }
  }
  if (!stats.ok()) {
    response->Clear();
    reactor->Finish(ToGrpcStatus(stats.status()));
    return;
  }
  FillStats(backend_, *stats, timeline, response->mutable_stats());
  reactor->Finish(grpc::Status::OK);
}

grpc::ServerUnaryReactor* AttentionService::Compute(Method method,
                                                    grpc::CallbackServerContext* context,
                                                    const v1::AttentionRequest* request,
                                                    v1::AttentionResponse* response) {
  Timeline timeline;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Failures are logged, with the rest of the call, by the request log (request_log.h).
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  std::shared_ptr<const v1::AttentionRequest> resolved;  // Its shared-memory tensors' bytes.
  if (absl::Status shared = ResolveSharedMemory(CallerIdentity(*context), request, resolved);
      !shared.ok()) {
    fail(shared);
    return reactor;
  }
  if (!request->cache_id().empty()) {
    return ComputeOverCache(method, context, request, std::move(resolved), response);
  }

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
  timeline.handed_off = Clock::now();
  auto run = [this, naive, context, request, resolved, response, problem = *problem, timeline, fail,
              reactor]() mutable {
    timeline.started = Clock::now();
    // A call whose client left, or whose deadline passed, while it waited never starts.
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    if (absl::Status values = CheckAttentionValues(problem); !values.ok()) {
      fail(values);
      return;
    }
    Answer(naive, problem, context, request, response, timeline, reactor);
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

grpc::ServerUnaryReactor* AttentionService::ComputeOverCache(
    Method method, grpc::CallbackServerContext* context, const v1::AttentionRequest* request,
    std::shared_ptr<const v1::AttentionRequest> resolved, v1::AttentionResponse* response) {
  Timeline timeline;
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
      ParseCacheQuery("", TensorOrNull(request->has_query(), request->query()), request->options(),
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
  timeline.handed_off = Clock::now();
  auto run = [this, naive, context, request, resolved, response, owner, problem = *problem,
              timeline, fail, reactor]() mutable {
    timeline.started = Clock::now();
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
    Answer(naive, problem, context, request, response, timeline, reactor);
  };
  absl::Status accepted =
      queue_.Submit({.memory_bytes = HeldBytes(naive, estimate, queue_.limits().memory_bytes),
                     .request_bytes = InflightBytes(*request, reply_bytes),
                     .work = std::move(run),
                     .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
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
  *response->mutable_cache_dtypes() = response->dtypes();
  if (backend_.keeps_fp8_caches()) response->add_cache_dtypes(v1::DTYPE_FLOAT8_E4M3);
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
  response->set_cache_persistent(caches_.persistent());
  response->set_shared_memory(shared_memory_.allowed());
  if (caches_.persistent()) response->set_cache_sync_seconds(caches_.limits().sync_seconds);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attn
