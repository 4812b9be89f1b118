#include "server/compute_queue.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <new>
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

absl::Status ComputeQueue::Submit(Job job) {
  if (job.memory_bytes > limits_.memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the computation needs ", job.memory_bytes, " bytes, over this server's budget of ",
        limits_.memory_bytes, " bytes for concurrent computations"));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!cancelled_.ok()) return cancelled_;
    if (static_cast<int64_t>(pending_.size()) >= limits_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("server busy: ", running_.load(), " computations running and ",
                       pending_.size(), " waiting (--max-inflight=", limits_.max_inflight,
                       ", --max-queue=", limits_.max_queue, "); retry later"));
    }
    const int64_t inflight = inflight_bytes_.load(std::memory_order_relaxed);
    if (job.request_bytes > limits_.max_inflight_bytes - inflight) {
      return absl::ResourceExhaustedError(
          absl::StrCat("server busy: this call's request and answer take ", job.request_bytes,
                       " bytes and the calls accepted before it hold ", inflight,
                       ", over this server's --max-inflight-bytes=", limits_.max_inflight_bytes,
                       "; retry later or send smaller calls"));
    }
    inflight_bytes_.store(inflight + job.request_bytes, std::memory_order_relaxed);
    pending_.push_back(std::move(job));
    queued_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
  }
  ready_.notify_one();
  return absl::OkStatus();
}

void ComputeQueue::CancelQueued(const absl::Status& status) {
  std::deque<Job> refused;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = status;
    std::deque<Job> kept;
    for (Job& job : pending_) (job.refuse ? refused : kept).push_back(std::move(job));
    pending_.swap(kept);
    queued_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
  }
  for (Job& job : refused) {
    job.refuse(status);
    std::lock_guard<std::mutex> lock(mutex_);
    inflight_bytes_.fetch_sub(job.request_bytes, std::memory_order_relaxed);
  }
  ready_.notify_all();
}

bool ComputeQueue::HeadFits() const {
  return !pending_.empty() &&
         pending_.front().memory_bytes <= limits_.memory_bytes - reserved_bytes_;
}

void ComputeJob::RunGuarded() { attn::RunGuarded(work, refuse); }

void RunGuarded(const std::function<void()>& work,
                const std::function<void(const absl::Status&)>& refuse) {
  absl::Status failure;
  try {
    work();
    return;
  } catch (const std::bad_alloc&) {
    failure = absl::ResourceExhaustedError(
        "the server ran out of memory computing this call; it was not applied, and other calls "
        "and caches are unaffected: retry later or send a smaller call");
  } catch (const std::exception& error) {
    failure = absl::InternalError(absl::StrCat("the computation failed: ", error.what()));
  } catch (...) {
    failure = absl::InternalError("the computation failed with an unknown exception");
  }
  std::fprintf(stderr, "attnd: a computation threw; the call fails with %s\n",
               failure.ToString().c_str());
  if (!refuse) return;
  try {
    refuse(failure);
  } catch (...) {
    std::fprintf(stderr, "attnd: answering a failed computation threw as well\n");
  }
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
      reserved_bytes_ += job.memory_bytes;
    }
    job.RunGuarded();
    bool waiting;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_.fetch_sub(1, std::memory_order_relaxed);
      reserved_bytes_ -= job.memory_bytes;
      inflight_bytes_.fetch_sub(job.request_bytes, std::memory_order_relaxed);
      waiting = !pending_.empty() || stopping_;
    }
    // Memory freed: a waiting head may fit now. With nothing waiting the idle workers sleep on
    // (waking them all after every call costs a small server the CPU its answers need).
    if (waiting) ready_.notify_all();
  }
}

}  // namespace attn
