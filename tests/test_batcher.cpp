// The continuous-batching policy (moe/batcher.h) on a made-up clock, and the one-at-a-time retry
// of a failed batch.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "moe/batcher.h"
#include "moe/error.h"
#include "test_util.h"

using moe::Batcher;
using moe::BatchLimits;
using moe::test::expect_error;
using std::chrono::milliseconds;

namespace {

const Batcher::Clock::time_point t0{};  // the fake clock's epoch

BatchLimits limits(size_t max_batch, milliseconds max_latency = milliseconds(10)) {
  BatchLimits l;
  l.max_batch = max_batch;
  l.max_latency = max_latency;
  return l;
}

}  // namespace

TEST(Batcher, LoneRequestLeavesAtOnceWhateverMaxLatency) {
  Batcher b(limits(16, milliseconds(3'600'000)));
  EXPECT_FALSE(b.ready());
  b.arrived(t0);
  ASSERT_TRUE(b.ready());
  EXPECT_EQ(b.take(t0), 1u);
  EXPECT_TRUE(b.busy());
  EXPECT_EQ(b.stats().wait_ms_max, 0.0);
}

TEST(Batcher, RequestsQueueWhileBusyAndLeaveTogetherWhenItFinishes) {
  Batcher b(limits(16));
  b.arrived(t0);
  ASSERT_EQ(b.take(t0), 1u);
  for (int i = 1; i <= 3; ++i) b.arrived(t0 + milliseconds(i));
  EXPECT_FALSE(b.ready()) << "the worker is busy";
  EXPECT_EQ(b.take(t0 + milliseconds(4)), 0u);
  b.finished();
  ASSERT_TRUE(b.ready());
  EXPECT_EQ(b.take(t0 + milliseconds(5)), 3u) << "everything that piled up, at once";
  EXPECT_EQ(b.queued(), 0u);
  // Waits of 4, 3 and 2 ms.
  EXPECT_DOUBLE_EQ(b.stats().wait_ms_total, 9.0);
  EXPECT_DOUBLE_EQ(b.stats().wait_ms_max, 4.0);
}

TEST(Batcher, TakesAtMostMaxBatchOldestFirst) {
  Batcher b(limits(4));
  for (int i = 0; i < 10; ++i) b.arrived(t0 + milliseconds(i));
  std::vector<size_t> sizes;
  for (size_t n; (n = b.take(t0 + milliseconds(10))) > 0; b.finished()) sizes.push_back(n);
  EXPECT_EQ(sizes, (std::vector<size_t>{4, 4, 2}));
  // Oldest first: the first batch held the requests that waited 10, 9, 8 and 7 ms.
  EXPECT_DOUBLE_EQ(b.stats().wait_ms_max, 10.0);
  EXPECT_DOUBLE_EQ(b.stats().wait_ms_total, 55.0);
}

TEST(Batcher, OneRequestAtATimeGetsBatchesOfOneWithoutWaiting) {
  // A client that sends its next request when the previous answer arrives.
  Batcher b(limits(16, milliseconds(5)));
  Batcher::Clock::time_point now = t0;
  for (int i = 0; i < 20; ++i) {
    b.arrived(now);
    ASSERT_EQ(b.take(now), 1u) << i;
    now += milliseconds(2);  // the batch runs
    b.finished();
  }
  EXPECT_EQ(b.stats().batches, 20u);
  EXPECT_EQ(b.stats().wait_ms_total, 0.0);
  EXPECT_EQ(b.stats().late, 0u);
}

TEST(Batcher, FullAsksTheProducerToWait) {
  Batcher b(limits(3));
  b.arrived(t0);
  ASSERT_EQ(b.take(t0), 1u);
  b.arrived(t0, 2);
  EXPECT_FALSE(b.full());
  b.arrived(t0);
  EXPECT_TRUE(b.full()) << "a whole batch waits for the busy worker";
  b.finished();
  ASSERT_EQ(b.take(t0), 3u);
  EXPECT_FALSE(b.full());
}

TEST(Batcher, LateCountsRequestsThatQueuedLongerThanMaxLatency) {
  Batcher b(limits(8, milliseconds(5)));
  b.arrived(t0);
  ASSERT_EQ(b.take(t0), 1u);
  b.arrived(t0);                    // will wait 6 ms: late
  b.arrived(t0 + milliseconds(1));  // 5 ms: exactly the bound, not late
  b.finished();
  ASSERT_EQ(b.take(t0 + milliseconds(6)), 2u);
  EXPECT_EQ(b.stats().late, 1u);
  EXPECT_EQ(b.stats().requests, 3u);
}

TEST(Batcher, BatchesBySizeUsePowerOfTwoBuckets) {
  Batcher b(limits(64));
  for (size_t n : {1, 2, 3, 4, 7, 8, 64}) {
    b.arrived(t0, n);
    ASSERT_EQ(b.take(t0), n);
    b.finished();
  }
  // 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32-63 | 64-127
  EXPECT_EQ(b.stats().batches_by_size, (std::vector<uint64_t>{1, 2, 2, 1, 0, 0, 1}));
  EXPECT_EQ(b.stats().batches, 7u);
  EXPECT_EQ(b.stats().requests, 89u);
}

TEST(Batcher, DropForgetsTheQueueButNotTheRunningBatch) {
  Batcher b(limits(8));
  b.arrived(t0);
  ASSERT_EQ(b.take(t0), 1u);
  b.arrived(t0, 2);
  EXPECT_EQ(b.drop(), 2u);
  EXPECT_TRUE(b.busy());
  b.finished();
  EXPECT_FALSE(b.ready());
  EXPECT_EQ(b.take(t0), 0u);
  EXPECT_EQ(b.stats().requests, 3u) << "dropped requests did arrive";
}

TEST(Batcher, NewLimitsApplyFromTheNextTake) {
  Batcher b(limits(8));
  b.arrived(t0, 6);
  b.set_limits(limits(4));
  EXPECT_EQ(b.limits().max_batch, 4u);
  EXPECT_TRUE(b.full());
  EXPECT_EQ(b.take(t0), 4u);
  expect_error([&] { b.set_limits(limits(0)); }, {"max_batch must be at least 1"});
  expect_error([] { Batcher bad(limits(0)); }, {"max_batch"});
  EXPECT_EQ(b.limits().max_batch, 4u) << "a refused change leaves the limits as they were";
}

/* ----- run_isolating_failures ----- */

namespace {

constexpr size_t kWidth = 2;

// A fake engine call: row i of the result is (x, -x) for input x; input 13 fails the whole call.
struct FakeEngine {
  int calls = 0;
  moe::Tensor operator()(const std::vector<int>& inputs) {
    ++calls;
    std::vector<float> values;
    for (int x : inputs) {
      if (x == 13) throw moe::Error("input 13 is unlucky");
      values.push_back(static_cast<float>(x));
      values.push_back(static_cast<float>(-x));
    }
    return moe::Tensor::from_vector(values, {static_cast<int64_t>(inputs.size()), static_cast<int64_t>(kWidth)});
  }
};

}  // namespace

TEST(RunIsolatingFailures, AGoodBatchIsOneCall) {
  FakeEngine engine;
  const moe::BatchRows out = moe::run_isolating_failures(std::vector<int>{1, 2, 3}, kWidth, std::ref(engine));
  EXPECT_EQ(engine.calls, 1);
  EXPECT_EQ(out.values, (std::vector<float>{1, -1, 2, -2, 3, -3}));
  EXPECT_EQ(out.errors, (std::vector<std::string>(3)));
}

TEST(RunIsolatingFailures, OnlyTheCulpritFailsAfterOneRetryEach) {
  FakeEngine engine;
  const moe::BatchRows out = moe::run_isolating_failures(std::vector<int>{1, 13, 3}, kWidth, std::ref(engine));
  EXPECT_EQ(engine.calls, 4) << "the batch, then each input alone";
  EXPECT_EQ(out.values, (std::vector<float>{1, -1, 0, 0, 3, -3})) << "the failed row stays zero";
  EXPECT_EQ(out.errors, (std::vector<std::string>{"", "input 13 is unlucky", ""}));
}

TEST(RunIsolatingFailures, ALoneFailingInputIsNotRetried) {
  FakeEngine engine;
  const moe::BatchRows out = moe::run_isolating_failures(std::vector<int>{13}, kWidth, std::ref(engine));
  EXPECT_EQ(engine.calls, 1);
  EXPECT_EQ(out.errors, (std::vector<std::string>{"input 13 is unlucky"}));
}

TEST(RunIsolatingFailures, AnEmptyBatchMakesNoCall) {
  FakeEngine engine;
  const moe::BatchRows out = moe::run_isolating_failures(std::vector<int>{}, kWidth, std::ref(engine));
  EXPECT_EQ(engine.calls, 0);
  EXPECT_TRUE(out.values.empty());
  EXPECT_TRUE(out.errors.empty());
}
