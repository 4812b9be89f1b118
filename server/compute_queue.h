// ComputeQueue: runs computations off gRPC's callback threads, in arrival order.
//
// gRPC's callback handlers must not block, and a Naive or Tiled call can compute for seconds.
// Handlers Submit the work here; `workers` threads run it (the backend's concurrency(): one for
// the CPU, whose every call already spreads over all threads; one per stream for a GPU). The
// destructor runs everything already submitted, then joins: no accepted request is dropped.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attn {

class ComputeQueue {
 public:
  explicit ComputeQueue(int workers = 1);
  ~ComputeQueue();
  ComputeQueue(const ComputeQueue&) = delete;
  ComputeQueue& operator=(const ComputeQueue&) = delete;

  // Queues work to run on a worker thread. Thread-safe.
  void Submit(std::function<void()> work);

 private:
  void Run();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> pending_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace attn
