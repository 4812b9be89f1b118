#include "server/compute_queue.h"

#include <utility>

namespace attn {

ComputeQueue::ComputeQueue(int workers) {
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { Run(); });
}

ComputeQueue::~ComputeQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ComputeQueue::Submit(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(work));
  }
  ready_.notify_one();
}

void ComputeQueue::Run() {
  for (;;) {
    std::function<void()> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // Stopping, and everything submitted has run.
      work = std::move(pending_.front());
      pending_.pop_front();
    }
    work();
  }
}

}  // namespace attn
