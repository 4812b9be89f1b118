// ComputeQueue: admission and scheduling of Naive and Tiled computations, off gRPC's callback
// threads (whose handlers must not block, while a computation can run for seconds).
//
// `max_inflight` worker threads run the accepted work in arrival order. At most `max_queue`
// requests wait for a worker; one more is refused at once with RESOURCE_EXHAUSTED, so a busy
// server answers quickly instead of growing an unbounded backlog. Each piece of work declares
// the bytes it will hold while it runs (Naive's score and weight matrices); work starts only
// while its bytes and those of the work already running fit in `memory_bytes`, so concurrent
// requests cannot together pass the budget (the head of the queue waits for memory to free;
// a request that needs more than the whole budget is refused at Submit). The destructor runs
// everything already accepted, then joins: no accepted request is dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace attn {

// The defaults here are attnd's (its --max-inflight and --max-queue flags start from them).
struct AdmissionLimits {
  // 0: chosen by the queue's owner (attnd: the backend's concurrency); the queue itself runs
  // one worker for any value below 1.
  static constexpr int kDefaultMaxInflight = 0;
  static constexpr int kDefaultMaxQueue = 64;

  int max_inflight = kDefaultMaxInflight;  // Computations running at once (worker threads).
  int max_queue = kDefaultMaxQueue;        // Accepted computations waiting for a worker.
  int64_t memory_bytes = std::numeric_limits<int64_t>::max();  // Shared by running work.
};

class ComputeQueue {
 public:
  explicit ComputeQueue(AdmissionLimits limits);
  ~ComputeQueue();
  ComputeQueue(const ComputeQueue&) = delete;
  ComputeQueue& operator=(const ComputeQueue&) = delete;

  // Accepts work that will hold `bytes` while it runs, or refuses it (RESOURCE_EXHAUSTED, the
  // work is not run) when the queue is full or `bytes` exceeds the whole budget. Thread-safe.
  absl::Status Submit(int64_t bytes, std::function<void()> work);

  // The limits as applied: max_inflight is the number of workers (at least 1).
  const AdmissionLimits& limits() const { return limits_; }
  // Work accepted and not yet started, and work running now. Thread-safe.
  int64_t queued() const { return queued_.load(std::memory_order_relaxed); }
  int64_t running() const { return running_.load(std::memory_order_relaxed); }

 private:
  struct Job {
    int64_t bytes;
    std::function<void()> work;
  };
  void Run();
  bool HeadFits() const;  // Needs mutex_.

  const AdmissionLimits limits_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> pending_;
  bool stopping_ = false;
  std::atomic<int64_t> queued_{0};
  std::atomic<int64_t> running_{0};
  int64_t reserved_bytes_ = 0;  // Held by the work running now. Needs mutex_.
  std::vector<std::thread> workers_;
};

}  // namespace attn
