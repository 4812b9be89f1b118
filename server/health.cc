#include "server/health.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.grpc.pb.h"

namespace attn {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// The names Check and Watch know: the server as a whole, and its one service.
bool IsKnown(absl::string_view service) {
  return service.empty() || service == attention::v1::AttentionService::service_full_name();
}

// A client-chosen name, quoted for an error message: escaped, and cut short.
std::string Quoted(absl::string_view service) {
  constexpr size_t kShown = 64;
  std::string quoted = absl::StrCat("\"", absl::CHexEscape(service.substr(0, kShown)), "\"");
  if (service.size() > kShown) absl::StrAppend(&quoted, "...");
  return quoted;
}

// A Watch refused before it starts.
class RefusedWatch final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  explicit RefusedWatch(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

// One open Watch stream. Its state is guarded by mutex_, but no gRPC operation (StartWrite,
// Finish) is started while mutex_ is held: gRPC may run OnWriteDone, OnCancel or OnDone inline
// inside one, and those take mutex_ too (OnDone may even destroy the watcher, which the service
// keeps alive through a shared_ptr until then).
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService& service, grpc::CallbackServerContext* context, bool known)
      : service_(service), known_(known), watched_(service.stream_watch_.Add(context)) {}

  // Starts the write of the status this stream owes, or ends the stream when it was cancelled or
  // (after Shutdown) owes nothing; nothing while a write is in flight, whose OnWriteDone comes
  // back here. Lock order: mutex_, then the service's.
  void Update() {
    const Action action = Decide();
    if (action == Action::kWrite) {
      StreamWatch::WriteStarted(watched_.get());
      StartWrite(&response_);
    } else if (action == Action::kFinish) {
      Finish(finish_status_);
    }
  }

  void OnWriteDone(bool ok) override {
    StreamWatch::WriteDone(watched_.get());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      writing_ = false;
      if (!ok) closed_ = true;  // The client cancelled or went away, or StreamWatch cancelled.
    }
    Update();
  }

  // A client cancel, a StreamWatch cancel, or Server::Shutdown's deadline passing.
  void OnCancel() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
    }
    Update();
  }

  void OnDone() override {
    service_.stream_watch_.Done(watched_);
    service_.Remove(this);  // May destroy this watcher.
  }

 private:
  enum class Action { kNone, kWrite, kFinish };

  Action Decide() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || writing_) return Action::kNone;
    if (closed_) {
      finished_ = true;
      finish_status_ = grpc::Status(
          grpc::StatusCode::CANCELLED,
          absl::StrCat("health Watch stream cancelled: by the client, by the server's shutdown, "
                       "or after ",
                       service_.stream_watch_.idle_seconds(), " s with a write unread"));
      return Action::kFinish;
    }
    bool serving = true;
    bool shutting_down = false;
    {
      std::lock_guard<std::mutex> service_lock(service_.mutex_);
      serving = service_.serving_;
      shutting_down = service_.shutting_down_;
    }
    const HealthCheckResponse::ServingStatus wanted = !known_ ? HealthCheckResponse::SERVICE_UNKNOWN
                                                      : serving ? HealthCheckResponse::SERVING
                                                                : HealthCheckResponse::NOT_SERVING;
    if (wanted != sent_) {
      sent_ = wanted;
      response_.set_status(wanted);
      writing_ = true;
      return Action::kWrite;
    }
    if (shutting_down) {
      finished_ = true;
      finish_status_ =
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "health Watch: the server is shutting down");
      return Action::kFinish;
    }
    return Action::kNone;
  }

  HealthService& service_;
  const bool known_;  // Else every status is SERVICE_UNKNOWN.
  const std::shared_ptr<StreamWatch::Stream> watched_;
  std::mutex mutex_;
  // Written only while no write is in flight (writing_ false), under mutex_.
  HealthCheckResponse response_;
  // The last status written; UNKNOWN (never sent) before the first. Guarded by mutex_.
  HealthCheckResponse::ServingStatus sent_ = HealthCheckResponse::UNKNOWN;
  bool writing_ = false;        // A write is in flight; guarded by mutex_.
  bool closed_ = false;         // Cancelled or a write failed; guarded by mutex_.
  bool finished_ = false;       // Finish started; guarded by mutex_.
  grpc::Status finish_status_;  // Set with finished_.
};

HealthService::HealthService(int64_t max_watches, int64_t idle_seconds)
    : max_watches_(std::max<int64_t>(max_watches, 1)), stream_watch_(idle_seconds) {}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!IsKnown(request->service())) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND,
                     absl::StrCat("health Check: unknown service ", Quoted(request->service()),
                                  " (this server knows \"\" and \"",
                                  attention::v1::AttentionService::service_full_name(), "\")")));
    return reactor;
  }
  response->set_status(serving() ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* context, const HealthCheckRequest* request) {
  std::shared_ptr<Watcher> watcher;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shutting_down_) {
      return new RefusedWatch(
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "health Watch: the server is shutting down"));
    }
    if (static_cast<int64_t>(watchers_.size()) >= max_watches_) {
      return new RefusedWatch(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("health Watch: ", watchers_.size(),
                       " Watch streams are open, this server's --max-health-watches=", max_watches_,
                       "; use Check, or retry once one has ended")));
    }
    watcher = std::make_shared<Watcher>(*this, context, IsKnown(request->service()));
    watchers_.emplace(watcher.get(), watcher);
  }
  watcher->Update();  // The current status, at once.
  return watcher.get();
}

void HealthService::SetServing(bool serving) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    serving_ = serving;
  }
  WakeWatchers();
}

bool HealthService::serving() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return serving_;
}

void HealthService::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shutting_down_ = true;
  }
  WakeWatchers();
}

int64_t HealthService::open_watches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(watchers_.size());
}

void HealthService::WakeWatchers() {
  std::vector<std::shared_ptr<Watcher>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open.reserve(watchers_.size());
    for (const auto& [key, watcher] : watchers_) open.push_back(watcher);
  }
  // Outside mutex_: Update takes the watcher's lock first, and may run its OnDone inline (which
  // takes mutex_ in Remove); the copies keep every watcher alive meanwhile.
  for (const std::shared_ptr<Watcher>& watcher : open) watcher->Update();
}

void HealthService::Remove(Watcher* watcher) {
  std::shared_ptr<Watcher> removed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = watchers_.find(watcher);
    if (it == watchers_.end()) return;
    removed = std::move(it->second);
    watchers_.erase(it);
  }
  // `removed` destroys the watcher here, outside mutex_, unless WakeWatchers still holds it.
}

}  // namespace attn
