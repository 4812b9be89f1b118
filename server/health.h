// HealthService: attnd's grpc.health.v1.Health (Check and Watch), in place of gRPC's default
// health service, whose Watch streams nobody bounds.
//
// Two names are known: "" (the server as a whole) and "attention.v1.AttentionService"; both
// share one status, SERVING until SetServing(false) (device lost, drain). Check answers that
// status for a known name and NOT_FOUND for any other. Watch sends the status at once and then
// each change, SERVICE_UNKNOWN (once; the stream stays open) for an unknown name. Each stream
// has at most one write in flight; changes made meanwhile are coalesced, so a watcher always
// ends up with the latest status but may never see a short-lived one.
//
// Bounds (attnd must hold nothing forever on a client's behalf): at most `max_watches` Watch
// streams are open at once, and one more is refused with RESOURCE_EXHAUSTED naming
// --max-health-watches. A stream whose write has been pending for `idle_seconds` (the reader
// stopped reading) is cancelled by a StreamWatch; attnd uses a fixed kDefaultIdleSeconds (60 s),
// not --trace-idle-seconds. A quiet stream (no change to send) is not idle: the count bounds
// those. Once Shutdown is called, every stream sends the latest status it still owes and then
// ends with UNAVAILABLE, and new ones are refused with UNAVAILABLE, so Server::Shutdown waits for
// no Watch; a stream cancelled (by its client, or by Server::Shutdown at its deadline) ends at
// once too.
//
// Ownership: the service must outlive the grpc::Server it is registered on (its streams call
// back into it until they are done). Thread-safety: every method may be called from any thread.
// Errors are gRPC statuses on the calls; no method here fails.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/stream_watch.h"

namespace attn {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  static constexpr int64_t kDefaultMaxWatches = 64;  // attnd's --max-health-watches.
  static constexpr int64_t kDefaultIdleSeconds = 60;

  // max_watches < 1 means 1. idle_seconds ≤ 0: a stalled stream is never cancelled.
  explicit HealthService(int64_t max_watches, int64_t idle_seconds = kDefaultIdleSeconds);
  HealthService(const HealthService&) = delete;
  HealthService& operator=(const HealthService&) = delete;

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

  // SERVING (true) or NOT_SERVING (false) for both names; wakes every open Watch stream.
  void SetServing(bool serving);
  bool serving() const;
  // Ends every open Watch stream once it has sent the latest status, and refuses new ones: call
  // before grpc::Server::Shutdown so that it does not wait out its deadline for the watchers.
  void Shutdown();

  int64_t max_watches() const { return max_watches_; }
  // Watch streams open now, and those cancelled because their reader stopped reading (for
  // metrics and tests).
  int64_t open_watches() const;
  int64_t idle_watches_cancelled() const { return stream_watch_.cancelled(); }

 private:
  class Watcher;
  // Wakes every open stream to send what it owes (or to end, after Shutdown).
  void WakeWatchers();
  // From a stream's OnDone: frees its slot.
  void Remove(Watcher* watcher);

  const int64_t max_watches_;
  mutable std::mutex mutex_;
  bool serving_ = true;         // Guarded by mutex_.
  bool shutting_down_ = false;  // Guarded by mutex_.
  // The open streams, owned here from Watch until their OnDone. Guarded by mutex_.
  std::map<Watcher*, std::shared_ptr<Watcher>> watchers_;
  StreamWatch stream_watch_;
};

}  // namespace attn
