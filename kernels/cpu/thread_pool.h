// ThreadPool: the CPU backend's workers, started once and reused by every computation.
//
// Run(tasks, fn) calls fn(task, worker) once for every task in [0, tasks) on up to `threads`
// workers (the calling thread is worker 0) and returns when all have finished. Tasks are handed
// out dynamically (an atomic counter), so uneven tasks such as causal row blocks balance; a
// task's arithmetic never depends on which worker runs it, so results do not depend on the
// thread count. Calls to Run from several threads are serialized, except in a pool of one
// thread, which runs each call on its caller at once. fn must not throw.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace attn {

class ThreadPool {
 public:
  // `threads` workers in all, including the caller of Run (≥ 1).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // Workers Run uses for `tasks` tasks: min(tasks, threads()), at least 1.
  int WorkersFor(int64_t tasks) const;

  void Run(int64_t tasks, const std::function<void(int64_t task, int worker)>& fn);

 private:
  void Help(int worker);
  void Work(int worker);

  std::mutex run_mutex_;  // One Run at a time.
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t generation_ = 0;
  int active_helpers_ = 0;  // Helpers still working on the current job.
  int helpers_wanted_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> helpers_;
};

// pool.Run(tasks, fn), asking `interrupt` (when set) before each task: once it answers non-OK
// the tasks not yet started are skipped and that answer is returned (a running task finishes).
absl::Status RunInterruptible(ThreadPool& pool, int64_t tasks,
                              const std::function<absl::Status()>& interrupt,
                              const std::function<void(int64_t task, int worker)>& fn);

}  // namespace attn
