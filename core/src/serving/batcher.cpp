#include "moe/batcher.h"

#include "moe/error.h"

namespace moe {

namespace {

void check(const BatchLimits& limits) {
  if (limits.max_batch == 0) throw Error("batch limits: max_batch must be at least 1");
  if (limits.max_latency.count() < 0) throw Error("batch limits: max_latency must not be negative");
}

// The batches_by_size bucket of a batch of n >= 1 requests: floor(log2(n)).
size_t size_bucket(size_t n) {
  size_t bucket = 0;
  while (n >>= 1) ++bucket;
  return bucket;
}

}  // namespace

Batcher::Batcher(const BatchLimits& limits) : limits_(limits) { check(limits); }

void Batcher::set_limits(const BatchLimits& limits) {
  check(limits);
  limits_ = limits;
}

void Batcher::arrived(Clock::time_point t, size_t n) {
  queued_.insert(queued_.end(), n, t);
  stats_.requests += n;
}

size_t Batcher::take(Clock::time_point now) {
  if (!ready()) return 0;
  const size_t n = std::min(queued_.size(), limits_.max_batch);
  for (size_t i = 0; i < n; ++i) {
    const Clock::duration wait = now - queued_.front();
    queued_.pop_front();
    const double ms = std::chrono::duration<double, std::milli>(wait).count();
    stats_.wait_ms_total += ms;
    stats_.wait_ms_max = std::max(stats_.wait_ms_max, ms);
    if (wait > limits_.max_latency) ++stats_.late;
  }
  const size_t bucket = size_bucket(n);
  if (stats_.batches_by_size.size() <= bucket) stats_.batches_by_size.resize(bucket + 1, 0);
  ++stats_.batches_by_size[bucket];
  ++stats_.batches;
  busy_ = true;
  return n;
}

size_t Batcher::drop() {
  const size_t n = queued_.size();
  queued_.clear();
  return n;
}

}  // namespace moe
