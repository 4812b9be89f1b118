// ComputeQueue admission: the bounded queue, the shared memory budget, and that every accepted
// piece of work runs.
#include "server/compute_queue.h"

#include <atomic>
#include <chrono>
#include <mutex>
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

}  // namespace
}  // namespace attn
