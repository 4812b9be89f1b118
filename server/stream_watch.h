// StreamWatch: cancels server streams whose reader has stopped reading, so a client that opens a
// stream and never takes an event cannot hold its slot (and the memory behind it) forever.
//
// A stream registers once (Add) and reports each write it starts and completes. One thread looks
// every min(1 s, idle/4) for a stream whose write has been pending for `idle_seconds` and calls
// its context's TryCancel: gRPC then completes the write with ok = false, and the stream ends as
// on any client cancel. A stream must call Done from its OnDone before its context goes; after
// Done the watch never touches the context. Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "grpcpp/grpcpp.h"

namespace attn {

class StreamWatch {
 public:
  class Stream;

  // idle_seconds ≤ 0: never cancels (no thread).
  explicit StreamWatch(int64_t idle_seconds);
  ~StreamWatch();
  StreamWatch(const StreamWatch&) = delete;
  StreamWatch& operator=(const StreamWatch&) = delete;

  int64_t idle_seconds() const { return idle_seconds_; }

  // A stream's handle: WriteStarted before each StartWrite, WriteDone in OnWriteDone, Done in
  // OnDone. May be null (a watch that never cancels).
  std::shared_ptr<Stream> Add(grpc::CallbackServerContext* context);
  static void WriteStarted(Stream* stream);
  static void WriteDone(Stream* stream);
  void Done(const std::shared_ptr<Stream>& stream);

  // Streams cancelled for idleness so far (for metrics and tests).
  int64_t cancelled() const { return cancelled_.load(); }

 private:
  void Loop();

  const int64_t idle_seconds_;
  std::mutex mutex_;
  std::set<std::shared_ptr<Stream>> streams_;  // Guarded by mutex_.
  bool stopping_ = false;                      // Guarded by mutex_.
  std::condition_variable wake_;
  std::atomic<int64_t> cancelled_{0};
  std::thread thread_;
};

}  // namespace attn
