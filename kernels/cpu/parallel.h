// ParallelFor: runs independent tasks on a few threads, for the CPU kernels.
//
// Tasks are handed out dynamically (an atomic counter), so uneven tasks such as causal row
// blocks balance. Each task runs exactly once; the call returns when all have finished.
// Results never depend on the number of workers: a task's arithmetic is the same on any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace attn {

// Workers ParallelFor will use for `tasks` tasks with at most `threads` threads (≥ 1).
inline int WorkerCount(int64_t tasks, int threads) {
  return static_cast<int>(std::clamp<int64_t>(tasks, 1, std::max(threads, 1)));
}

// Calls fn(task, worker) for every task in [0, tasks), worker in [0, WorkerCount(...)).
template <class Fn>
void ParallelFor(int64_t tasks, int threads, Fn&& fn) {
  const int workers = WorkerCount(tasks, threads);
  std::atomic<int64_t> next{0};
  auto run = [&](int worker) {
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      fn(task, worker);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int worker = 1; worker < workers; ++worker) pool.emplace_back(run, worker);
  run(0);
  for (std::thread& thread : pool) thread.join();
}

}  // namespace attn
