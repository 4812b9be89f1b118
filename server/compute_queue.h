// ComputeQueue: admission and scheduling of the service's computations (Naive, Tiled, a Trace's
// opening, AppendCache, Decode), off gRPC's callback threads (whose handlers must not block,
// while a computation can run for seconds).
//
// `max_inflight` worker threads run the accepted work in arrival order. At most `max_queue`
// requests wait for a worker; one more is refused at once with RESOURCE_EXHAUSTED, so a busy
// server answers quickly instead of growing an unbounded backlog. Each piece of work declares
// the bytes it will hold while it runs (Naive's score and weight matrices); work starts only
// while its bytes and those of the work already running fit in `memory_bytes`, so concurrent
// requests cannot together pass the budget (the head of the queue waits for memory to free;
// a request that needs more than the whole budget is refused at Submit). Each job also declares
// the bytes of its request and answer, held from Submit until it ends: together they stay within
// `max_inflight_bytes`, so a queue full of large requests cannot exhaust memory.
//
// Nothing a job throws ends a worker: the job's `refuse` gets RESOURCE_EXHAUSTED (an allocation
// failure) or INTERNAL instead, and the worker goes on. CancelQueued answers every job not yet
// started through its `refuse` (the server is shutting down) and refuses later ones. The
// destructor runs everything still accepted, then joins: no accepted request is dropped.
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
  // Requests' and answers' bytes of the work accepted and not finished (--max-inflight-bytes).
  int64_t max_inflight_bytes = std::numeric_limits<int64_t>::max();
};

// One piece of work for the queue.
struct ComputeJob {
  int64_t memory_bytes = 0;   // Held while it runs (Naive's matrices), against memory_bytes.
  int64_t request_bytes = 0;  // Its request and answer, against max_inflight_bytes.
  std::function<void()> work{};
  // Called instead of `work`, or when `work` throws, with the reason; must answer the call. May
  // be empty for work that cannot fail that way (tests).
  std::function<void(const absl::Status&)> refuse{};

  // RunGuarded(work, refuse): for the queue's workers and for work run inline.
  void RunGuarded();
};

// Runs `work`; what it throws goes to `refuse` (RESOURCE_EXHAUSTED for std::bad_alloc, INTERNAL
// otherwise; may be empty) and to stderr, never further. Work must answer its call as its last
// act, so a throw always comes before the answer.
void RunGuarded(const std::function<void()>& work,
                const std::function<void(const absl::Status&)>& refuse);

class ComputeQueue {
 public:
  explicit ComputeQueue(AdmissionLimits limits);
  ~ComputeQueue();
  ComputeQueue(const ComputeQueue&) = delete;
  ComputeQueue& operator=(const ComputeQueue&) = delete;

  // Accepts a job, or refuses it (RESOURCE_EXHAUSTED, the work is not run, refuse is not
  // called) when the queue is full, its memory_bytes exceed the whole budget or its
  // request_bytes do not fit max_inflight_bytes now; after CancelQueued, the status it was given.
  // Thread-safe.
  absl::Status Submit(ComputeJob job);
  // A job that holds `bytes` while it runs and nothing else (tests).
  absl::Status Submit(int64_t bytes, std::function<void()> work) {
    return Submit(ComputeJob{.memory_bytes = bytes, .work = std::move(work)});
  }

  // Shutdown: every job accepted and not started is answered with `status` through its refuse
  // (jobs without one still run), and later Submits get `status`. Thread-safe.
  void CancelQueued(const absl::Status& status);

  // The limits as applied: max_inflight is the number of workers (at least 1).
  const AdmissionLimits& limits() const { return limits_; }
  // Work accepted and not yet started, and work running now. Thread-safe.
  int64_t queued() const { return queued_.load(std::memory_order_relaxed); }
  int64_t running() const { return running_.load(std::memory_order_relaxed); }
  // Request bytes of the work accepted and not finished. Thread-safe.
  int64_t inflight_bytes() const { return inflight_bytes_.load(std::memory_order_relaxed); }

 private:
  using Job = ComputeJob;
  void Run();
  bool HeadFits() const;  // Needs mutex_.

  const AdmissionLimits limits_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> pending_;
  bool stopping_ = false;
  absl::Status cancelled_;  // Set by CancelQueued. Needs mutex_.
  std::atomic<int64_t> queued_{0};
  std::atomic<int64_t> inflight_bytes_{0};  // Written under mutex_.
  std::atomic<int64_t> running_{0};
  int64_t reserved_bytes_ = 0;  // Held by the work running now. Needs mutex_.
  std::vector<std::thread> workers_;
};

}  // namespace attn
