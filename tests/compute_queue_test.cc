// ComputeQueue admission: the bounded queue, the shared memory budget, and that every accepted
// piece of work runs.
#include "server/compute_queue.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attn {
namespace {

using std::chrono::milliseconds;

TEST(ComputeQueueTest, WorkThatDoesNotFitTogetherNeverOverlaps) {
  std::atomic<int> running{0}, most{0}, done{0};
  auto work = [&] {
    const int now = ++running;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(milliseconds(20));
    --running;
    ++done;
  };
  {
    ComputeQueue queue({.max_inflight = 4, .max_queue = 16, .memory_bytes = 100});
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(queue.Submit(60, work).ok());
  }  // The destructor runs everything accepted.
  EXPECT_EQ(done.load(), 6);
  EXPECT_EQ(most.load(), 1) << "two 60-byte jobs ran at once under a 100-byte budget";
}

TEST(ComputeQueueTest, WorkThatFitsRunsConcurrently) {
  std::atomic<int> running{0}, most{0};
  auto work = [&] {
    const int now = ++running;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    // Hold until a second job has started (or give up after a while).
    for (int i = 0; i < 200 && most.load() < 2; ++i) std::this_thread::sleep_for(milliseconds(5));
    --running;
  };
  {
    ComputeQueue queue({.max_inflight = 2, .max_queue = 16, .memory_bytes = 100});
    ASSERT_TRUE(queue.Submit(40, work).ok());
    ASSERT_TRUE(queue.Submit(40, work).ok());
  }
  EXPECT_EQ(most.load(), 2);
}

TEST(ComputeQueueTest, MoreThanTheWholeBudgetIsRefused) {
  ComputeQueue queue({.max_inflight = 1, .max_queue = 4, .memory_bytes = 100});
  const absl::Status status = queue.Submit(101, [] { ADD_FAILURE() << "refused work ran"; });
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("101 bytes"), std::string::npos) << status;
}

TEST(ComputeQueueTest, AFullQueueRefusesAndKeepsWhatItAccepted) {
  std::mutex gate;
  std::atomic<int> done{0};
  {
    std::unique_lock<std::mutex> hold(gate);  // Keeps the one worker busy.
    ComputeQueue queue({.max_inflight = 1, .max_queue = 2, .memory_bytes = 100});
    ASSERT_TRUE(queue
                    .Submit(0,
                            [&] {
                              std::lock_guard<std::mutex> wait(gate);
                              ++done;
                            })
                    .ok());
    while (queue.running() == 0) std::this_thread::sleep_for(milliseconds(1));
    ASSERT_TRUE(queue.Submit(0, [&] { ++done; }).ok());
    ASSERT_TRUE(queue.Submit(0, [&] { ++done; }).ok());
    EXPECT_EQ(queue.queued(), 2);
    const absl::Status full = queue.Submit(0, [] { ADD_FAILURE() << "refused work ran"; });
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(full.message().find("--max-queue=2"), std::string::npos) << full;
    hold.unlock();
  }
  EXPECT_EQ(done.load(), 3);
}

// A job's work and what the queue answered for it.
struct Answered {
  std::mutex mutex;
  std::vector<absl::Status> refusals;
  std::atomic<int> ran{0};
  ComputeJob Job(int64_t request_bytes, std::function<void()> work = nullptr) {
    return ComputeJob{.request_bytes = request_bytes,
                      .work = work ? std::move(work) : std::function<void()>([this] { ++ran; }),
                      .refuse = [this](const absl::Status& status) {
                        std::lock_guard<std::mutex> lock(mutex);
                        refusals.push_back(status);
                      }};
  }
};

TEST(ComputeQueueTest, WhatAJobThrowsGoesToItsRefuseAndTheWorkerGoesOn) {
  Answered answered;
  {
    ComputeQueue queue({.max_inflight = 1, .max_queue = 8});
    ASSERT_TRUE(queue.Submit(answered.Job(0, [] { throw std::bad_alloc(); })).ok());
    ASSERT_TRUE(queue.Submit(answered.Job(0, [] { throw std::runtime_error("broken"); })).ok());
    ASSERT_TRUE(queue.Submit(answered.Job(0, [] { throw 7; })).ok());
    ASSERT_TRUE(queue.Submit(answered.Job(0)).ok());
  }
  EXPECT_EQ(answered.ran.load(), 1);  // The worker survived three throws.
  ASSERT_EQ(answered.refusals.size(), 3u);
  EXPECT_EQ(answered.refusals[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(answered.refusals[1].code(), absl::StatusCode::kInternal);
  EXPECT_NE(answered.refusals[1].message().find("broken"), std::string::npos);
  EXPECT_EQ(answered.refusals[2].code(), absl::StatusCode::kInternal);
}

TEST(ComputeQueueTest, TheBytesOfQueuedRequestsStayWithinMaxInflightBytes) {
  std::mutex gate;
  Answered answered;
  {
    std::unique_lock<std::mutex> hold(gate);
    ComputeQueue queue({.max_inflight = 1, .max_queue = 8, .max_inflight_bytes = 100});
    ASSERT_TRUE(
        queue.Submit(answered.Job(60, [&] { std::lock_guard<std::mutex> wait(gate); })).ok());
    ASSERT_TRUE(queue.Submit(answered.Job(40)).ok());
    EXPECT_EQ(queue.inflight_bytes(), 100);
    const absl::Status over = queue.Submit(answered.Job(1));
    EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(over.message().find("--max-inflight-bytes=100"), std::string::npos) << over;
    hold.unlock();
    while (queue.inflight_bytes() > 0) std::this_thread::sleep_for(milliseconds(1));
    EXPECT_TRUE(queue.Submit(answered.Job(100)).ok());  // Freed as the work finished.
  }
  EXPECT_EQ(answered.ran.load(), 2);
  EXPECT_TRUE(answered.refusals.empty());
}

TEST(ComputeQueueTest, CancelQueuedAnswersEveryWaitingJobAndRefusesLaterOnes) {
  std::mutex gate;
  Answered answered;
  std::atomic<bool> first_ran{false};
  {
    std::unique_lock<std::mutex> hold(gate);
    ComputeQueue queue({.max_inflight = 1, .max_queue = 8, .max_inflight_bytes = 1000});
    ASSERT_TRUE(queue
                    .Submit(answered.Job(10,
                                         [&] {
                                           std::lock_guard<std::mutex> wait(gate);
                                           first_ran = true;
                                         }))
                    .ok());
    while (queue.running() == 0) std::this_thread::sleep_for(milliseconds(1));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(queue.Submit(answered.Job(10)).ok());
    queue.CancelQueued(absl::UnavailableError("shutting down"));
    EXPECT_EQ(queue.queued(), 0);
    EXPECT_EQ(queue.inflight_bytes(), 10);  // Only the running job's.
    EXPECT_EQ(queue.Submit(answered.Job(10)).code(), absl::StatusCode::kUnavailable);
    hold.unlock();
  }
  EXPECT_TRUE(first_ran.load());
  EXPECT_EQ(answered.ran.load(), 0);
  ASSERT_EQ(answered.refusals.size(), 3u);
  for (const absl::Status& status : answered.refusals) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  }
}

}  // namespace
}  // namespace attn
