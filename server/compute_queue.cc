#include "server/compute_queue.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attn {

namespace {

AdmissionLimits Applied(AdmissionLimits limits) {
  limits.max_inflight = std::max(limits.max_inflight, 1);
  return limits;
}

}  // namespace

ComputeQueue::ComputeQueue(AdmissionLimits limits) : limits_(Applied(limits)) {
  for (int i = 0; i < limits_.max_inflight; ++i) {
    workers_.emplace_back([this] { Run(); });
  }
}

ComputeQueue::~ComputeQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

absl::Status ComputeQueue::Submit(int64_t bytes, std::function<void()> work) {
  if (bytes > limits_.memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the computation needs ", bytes, " bytes, over this server's budget of ",
                     limits_.memory_bytes, " bytes for concurrent computations"));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<int64_t>(pending_.size()) >= limits_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("server busy: ", running_.load(), " computations running and ",
                       pending_.size(), " waiting (--max-inflight=", limits_.max_inflight,
                       ", --max-queue=", limits_.max_queue, "); retry later"));
    }
    pending_.push_back({bytes, std::move(work)});
    queued_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
  }
  ready_.notify_one();
  return absl::OkStatus();
}

bool ComputeQueue::HeadFits() const {
  return !pending_.empty() && pending_.front().bytes <= limits_.memory_bytes - reserved_bytes_;
}

void ComputeQueue::Run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return HeadFits() || (stopping_ && pending_.empty()); });
      if (pending_.empty()) return;  // Stopping, and everything accepted has run.
      job = std::move(pending_.front());
      pending_.pop_front();
      queued_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
      running_.fetch_add(1, std::memory_order_relaxed);
      reserved_bytes_ += job.bytes;
    }
    job.work();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_.fetch_sub(1, std::memory_order_relaxed);
      reserved_bytes_ -= job.bytes;
    }
    ready_.notify_all();  // Memory freed: the head may fit now.
  }
}

}  // namespace attn
