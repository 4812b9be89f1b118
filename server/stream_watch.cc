#include "server/stream_watch.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace attn {
namespace {

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace

class StreamWatch::Stream {
 public:
  explicit Stream(grpc::CallbackServerContext* context) : context_(context) {}

  // gRPC may run the stream's OnWriteDone and OnDone inline inside TryCancel, on the watch's
  // thread: a recursive mutex lets that OnDone's Done through while Cancel holds it.
  // Whether this call cancelled it.
  bool Cancel() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (done_ || cancelled_) return false;
    cancelled_ = true;
    context_->TryCancel();
    return true;
  }
  void MarkDone() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    done_ = true;
  }

  std::atomic<int64_t> write_started_ns{0};  // 0: no write pending.

 private:
  std::recursive_mutex mutex_;
  grpc::CallbackServerContext* const context_;  // Valid until done_.
  bool done_ = false;
  bool cancelled_ = false;
};

StreamWatch::StreamWatch(int64_t idle_seconds) : idle_seconds_(std::max<int64_t>(idle_seconds, 0)) {
  if (idle_seconds_ > 0) thread_ = std::thread([this] { Loop(); });
}

StreamWatch::~StreamWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<StreamWatch::Stream> StreamWatch::Add(grpc::CallbackServerContext* context) {
  if (idle_seconds_ == 0) return nullptr;
  auto stream = std::make_shared<Stream>(context);
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.insert(stream);
  return stream;
}

void StreamWatch::WriteStarted(Stream* stream) {
  if (stream != nullptr) stream->write_started_ns.store(NowNs());
}

void StreamWatch::WriteDone(Stream* stream) {
  if (stream != nullptr) stream->write_started_ns.store(0);
}

void StreamWatch::Done(const std::shared_ptr<Stream>& stream) {
  if (stream == nullptr) return;
  stream->MarkDone();
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.erase(stream);
}

void StreamWatch::Loop() {
  const auto period = std::chrono::milliseconds(std::min<int64_t>(1000, idle_seconds_ * 250));
  const int64_t idle_ns = std::min<int64_t>(idle_seconds_, int64_t{1} << 31) * 1'000'000'000;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period);
    if (stopping_) break;
    const int64_t now = NowNs();
    std::vector<std::shared_ptr<Stream>> idle;
    for (const std::shared_ptr<Stream>& stream : streams_) {
      const int64_t started = stream->write_started_ns.load();
      if (started != 0 && now - started >= idle_ns) idle.push_back(stream);
    }
    lock.unlock();  // TryCancel may end a stream inline, and its Done takes mutex_.
    for (const std::shared_ptr<Stream>& stream : idle) {
      if (stream->Cancel()) cancelled_.fetch_add(1);
    }
    idle.clear();
    lock.lock();
  }
}

}  // namespace attn
