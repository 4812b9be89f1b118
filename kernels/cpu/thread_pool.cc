#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <utility>

namespace attn {

ThreadPool::ThreadPool(int threads) {
  for (int worker = 1; worker < std::max(threads, 1); ++worker) {
    helpers_.emplace_back([this, worker] { Help(worker); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& helper : helpers_) helper.join();
}

int ThreadPool::WorkersFor(int64_t tasks) const {
  return static_cast<int>(std::clamp<int64_t>(tasks, 1, threads()));
}

void ThreadPool::Work(int worker) {
  for (int64_t task = next_.fetch_add(1); task < tasks_; task = next_.fetch_add(1)) {
    (*job_)(task, worker);
  }
}

void ThreadPool::Help(int worker) {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (worker >= helpers_wanted_ + 1) continue;  // Not needed for this job.
    }
    Work(worker);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_helpers_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::Run(int64_t tasks, const std::function<void(int64_t, int)>& fn) {
  if (helpers_.empty()) {  // Nothing shared to guard: callers on several threads run at once.
    for (int64_t task = 0; task < tasks; ++task) fn(task, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  const int helpers = WorkersFor(tasks) - 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    helpers_wanted_ = helpers;
    active_helpers_ = helpers;
    ++generation_;
  }
  if (helpers > 0) wake_.notify_all();
  Work(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return active_helpers_ == 0; });
  job_ = nullptr;
}

absl::Status RunInterruptible(ThreadPool& pool, int64_t tasks,
                              const std::function<absl::Status()>& interrupt,
                              const std::function<void(int64_t, int)>& fn) {
  if (!interrupt) {
    pool.Run(tasks, fn);
    return absl::OkStatus();
  }
  std::atomic<bool> stopped{false};
  std::mutex mutex;
  absl::Status why;
  pool.Run(tasks, [&](int64_t task, int worker) {
    if (stopped.load(std::memory_order_relaxed)) return;
    if (absl::Status status = interrupt(); !status.ok()) {
      std::lock_guard<std::mutex> lock(mutex);
      if (why.ok()) why = std::move(status);
      stopped.store(true, std::memory_order_relaxed);
      return;
    }
    fn(task, worker);
  });
  return why;
}

}  // namespace attn
