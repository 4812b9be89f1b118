// AttentionService: the attention.v1 RPC handlers. Transport only: decode the request
// (request.h), call the backend or the cache registry (caches.h), encode the answer
// (response.h), map absl::Status to grpc::Status. One class in three files, by role: service.cc
// (Naive, Tiled, GetServerInfo and what the handlers share), service_trace.cc (Trace's stream)
// and service_caches.cc (the cache RPCs and Decode).
//
// On gRPC's callback threads a call does only what costs the same whatever its payload: the
// shape checks (ParseAttentionShape and the like), the drain and device checks, admission. The
// rest — the pass over every input element (CheckAttentionValues), the kernel, opening a trace's
// cursor, a cache's appends — runs on a ComputeQueue worker, so those threads never block; only
// a Naive, Tiled or Trace call the backend says is too small to matter (Backend::RunsInline)
// runs there directly, saving the hand-off. A trace then computes one event per completed write
// (flow control), so a slow reader holds at most one event and a cancelled stream stops at its
// next write; a stream whose reader takes nothing for --trace-idle-seconds is cancelled
// (StreamWatch).
//
// What a request sizes is bounded before it is allocated: its answer's tensors against
// --max-message-bytes (CheckReplyBytes; a Decode batch's summed), its bytes and its answer's
// against --max-inflight-bytes while it is queued or running. What a call's code throws fails
// that call (RunGuarded, the trace writer), never the process. Thread-safe. The backend must
// outlive the service; destroying the service waits for queued computations to finish.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/builder_options.h"
#include "server/caches.h"
#include "server/compute_queue.h"
#include "server/request.h"
#include "server/shared_memory.h"
#include "server/stream_watch.h"

namespace attn {

namespace service_internal {
struct Timeline;  // service_internal.h
}  // namespace service_internal

struct ServiceConfig {
  TraceLimits trace;
  // budget_bytes 0 = half the backend's memory_bytes().
  CacheLimits caches{.budget_bytes = 0, .idle_seconds = 0};
  // max_inflight 0 = the backend's concurrency(); memory_bytes 0 = its max_naive_bytes(): the
  // Naive score and weight matrices of every running computation share that budget;
  // max_inflight_bytes 0 = a quarter of physical memory.
  AdmissionLimits admission{.memory_bytes = 0, .max_inflight_bytes = 0};
  int64_t max_message_bytes = BuilderOptions{}.max_message_bytes;  // For ServerInfo.
  // Called (once) when the backend reports that its device is lost, e.g. to mark the health
  // service NOT_SERVING. May be empty.
  std::function<void()> on_device_lost;
  // attnd --allow-shared-memory: serve RegisterSharedMemory and tensors in shared memory
  // (shared_memory.h).
  bool allow_shared_memory = false;
};

// The one mapping from internal errors to gRPC's: the codes are numerically identical.
grpc::Status ToGrpcStatus(const absl::Status& status);

class AttentionService final : public attention::v1::AttentionService::CallbackService {
 public:
  AttentionService(Backend& backend, ServiceConfig config);

  grpc::ServerUnaryReactor* Naive(grpc::CallbackServerContext* context,
                                  const attention::v1::AttentionRequest* request,
                                  attention::v1::AttentionResponse* response) override;
  grpc::ServerUnaryReactor* Tiled(grpc::CallbackServerContext* context,
                                  const attention::v1::AttentionRequest* request,
                                  attention::v1::AttentionResponse* response) override;
  grpc::ServerWriteReactor<attention::v1::TraceEvent>* Trace(
      grpc::CallbackServerContext* context, const attention::v1::TraceRequest* request) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const attention::v1::GetServerInfoRequest* request,
                                          attention::v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* CreateCache(grpc::CallbackServerContext* context,
                                        const attention::v1::CreateCacheRequest* request,
                                        attention::v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* AppendCache(grpc::CallbackServerContext* context,
                                        const attention::v1::AppendCacheRequest* request,
                                        attention::v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* TruncateCache(grpc::CallbackServerContext* context,
                                          const attention::v1::TruncateCacheRequest* request,
                                          attention::v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* ForkCache(grpc::CallbackServerContext* context,
                                      const attention::v1::ForkCacheRequest* request,
                                      attention::v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* GetCacheInfo(grpc::CallbackServerContext* context,
                                         const attention::v1::GetCacheInfoRequest* request,
                                         attention::v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* DeleteCache(grpc::CallbackServerContext* context,
                                        const attention::v1::DeleteCacheRequest* request,
                                        attention::v1::DeleteCacheResponse* response) override;
  grpc::ServerUnaryReactor* ListCaches(grpc::CallbackServerContext* context,
                                       const attention::v1::ListCachesRequest* request,
                                       attention::v1::ListCachesResponse* response) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const attention::v1::DecodeRequest* request,
                                   attention::v1::DecodeResponse* response) override;
  grpc::ServerWriteReactor<attention::v1::CacheChunk>* ExportCache(
      grpc::CallbackServerContext* context,
      const attention::v1::ExportCacheRequest* request) override;
  grpc::ServerReadReactor<attention::v1::CacheChunk>* ImportCache(
      grpc::CallbackServerContext* context, attention::v1::CacheInfo* response) override;
  // Shared memory (service_shared_memory.cc, shared_memory.h).
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context,
      const attention::v1::RegisterSharedMemoryRequest* request,
      attention::v1::SharedMemoryRegion* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context,
      const attention::v1::UnregisterSharedMemoryRequest* request,
      attention::v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* SharedMemoryStatus(
      grpc::CallbackServerContext* context, const attention::v1::SharedMemoryStatusRequest* request,
      attention::v1::SharedMemoryStatusResponse* response) override;

  // From now on every new call that computes or makes or grows a cache (Naive, Tiled, Trace,
  // CreateCache, AppendCache, Decode) is refused with UNAVAILABLE (the server is shutting down);
  // calls already accepted run to the end, and GetServerInfo, GetCacheInfo, DeleteCache and
  // ListCaches are still answered. Thread-safe.
  void StartDrain() { draining_.store(true); }
  // Shutdown, once the grace has passed: every call still waiting in the compute queue is
  // answered UNAVAILABLE and none starts from now on. Thread-safe.
  void CancelQueued();
  // Waits until no call is queued or computing on the compute queue (Naive, Tiled, a Trace's
  // opening, AppendCache, Decode) and no Trace stream is open (their answers handed to gRPC), or
  // until `deadline`; whether it got there. Thread-safe.
  bool WaitUntilIdle(std::chrono::system_clock::time_point deadline) const;
  bool Idle() const {
    return queue_.queued() + queue_.running() + open_traces_.load() + open_transfers_.load() == 0;
  }
  const AdmissionLimits& admission() const { return queue_.limits(); }

  // Calls waiting for a compute worker, and computing on one now: Naive, Tiled, a Trace's
  // opening, AppendCache and Decode; a call run inline (Backend::RunsInline) counts in neither
  // (for metrics).
  int64_t queued() const { return queue_.queued(); }
  int64_t computing() const { return queue_.running(); }
  // Bytes of the requests and answers of the calls queued and computing (for metrics).
  int64_t inflight_bytes() const { return queue_.inflight_bytes(); }
  // Trace streams cancelled because their reader stopped reading (for metrics).
  int64_t idle_traces_cancelled() const { return trace_watch_.cancelled(); }
  const CacheRegistry& caches() const { return caches_; }
  CacheRegistry& caches() { return caches_; }

 private:
  enum class Method { kNaive, kTiled };
  grpc::ServerUnaryReactor* Compute(Method method, grpc::CallbackServerContext* context,
                                    const attention::v1::AttentionRequest* request,
                                    attention::v1::AttentionResponse* response);
  // Runs a valid problem through Naive or Tiled and finishes the call with its answer.
  void Answer(bool naive, const Problem& problem, grpc::CallbackServerContext* context,
              const attention::v1::AttentionRequest* request,
              attention::v1::AttentionResponse* response, service_internal::Timeline& timeline,
              grpc::ServerUnaryReactor* reactor);
  // Naive or Tiled over a cache (request->cache_id set).
  // `resolved` holds the request's shared-memory bytes, when it named any (else null).
  grpc::ServerUnaryReactor* ComputeOverCache(
      Method method, grpc::CallbackServerContext* context,
      const attention::v1::AttentionRequest* request,
      std::shared_ptr<const attention::v1::AttentionRequest> resolved,
      attention::v1::AttentionResponse* response);

  // Trace over a cache (request->attention().cache_id set); service_trace.cc.
  grpc::ServerWriteReactor<attention::v1::TraceEvent>* TraceOverCache(
      grpc::CallbackServerContext* context, const attention::v1::TraceRequest* request,
      std::chrono::steady_clock::time_point start);

  // A request naming shared memory is replaced by a copy holding those bytes (read from the
  // regions on this, gRPC's, thread, as gRPC reads an inline request's bytes there), which
  // `holder` keeps alive for the call's work; any other request is left as it is.
  template <class Request>
  absl::Status ResolveSharedMemory(const std::string& owner, const Request*& request,
                                   std::shared_ptr<const Request>& holder) const {
    if (!SharedMemoryRegistry::NamesSharedMemory(*request)) return absl::OkStatus();
    absl::StatusOr<std::shared_ptr<const Request>> resolved =
        shared_memory_.Resolve(owner, *request);
    if (!resolved.ok()) return resolved.status();
    holder = *std::move(resolved);
    request = holder.get();
    return absl::OkStatus();
  }

  // UNAVAILABLE once the backend's device is lost (reporting the loss the first time).
  absl::Status CheckDevice();
  // UNAVAILABLE while draining.
  absl::Status CheckAccepting() const;
  // A call that changes cache `id`: its layout (NOT_FOUND first, so a cache a draining server
  // handed over answers where it went), then CheckAccepting and CheckDevice.
  absl::StatusOr<KvLayout> AdmitCacheChange(const std::string& owner, const std::string& id);

  Backend& backend_;
  const ServiceConfig config_;

  std::atomic<bool> loss_reported_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> open_traces_{0};
  std::atomic<int64_t> open_transfers_{0};  // ExportCache and ImportCache streams.
  std::atomic<int64_t> snapshot_bytes_{0};  // Cache copies held by open traces.
  SharedMemoryRegistry shared_memory_;
  CacheRegistry caches_;     // Before queue_: queued work holds leases on its caches.
  StreamWatch trace_watch_;  // Before queue_: queued work opens trace streams.
  ComputeQueue queue_;       // Last: destroyed first, finishing queued work while the rest lives.
};

}  // namespace attn
