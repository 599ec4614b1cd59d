// gst-moe: continuous batching, the policy that decides when queued requests leave for the
// worker that runs them (moe-encode's encoder; docs/architecture.md, "Threads").
//
// The policy, for one worker:
//  1. An idle worker takes what is queued at once, up to max_batch, in arrival order. A request
//     that finds the worker idle leaves alone, without waiting for company.
//  2. While the worker runs a batch, requests queue. When it finishes, rule 1 applies at once:
//     it takes what piled up meanwhile. So batches grow with the load only: one client sending
//     one request at a time gets batches of one and no added wait; a burst gets full batches.
//  3. Nothing is held back on a timer, so a caller never needs a timed wake-up: the only events
//     that can let a batch leave are an arrival and the worker finishing.
//  4. max_latency holds nothing back either. It is the wait the owner declares (moe-encode adds it
//     to the pipeline latency): the longest a request is expected to queue behind a running
//     batch. Requests that queued longer are counted (BatcherStats::late), so the declaration
//     can be checked against the load.
//  5. full() asks the producer to wait (backpressure): a whole batch is already queued, so more
//     requests would only wait here instead of upstream.
// Times are the caller's (steady clock), so tests drive the policy with made-up time points.
//
// run_isolating_failures() is the other half of running a batch: an engine call that fails
// for one bad input is retried one input at a time, so that only the culprits fail.
//
// Threads: a Batcher has no thread and no lock of its own; its owner serialises every call
// (moe-encode calls it under its state lock from the streaming thread, its worker and queries).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <string>
#include <vector>

#include "moe/tensor.h"

namespace moe {

struct BatchLimits {
  size_t max_batch = 8;                              // most requests in a batch, >= 1
  std::chrono::nanoseconds max_latency{10'000'000};  // the declared queueing wait (rule 4)
};

// Since the Batcher was made.
struct BatcherStats {
  uint64_t requests = 0;  // arrived
  uint64_t batches = 0;   // taken
  // batches_by_size[i]: batches of 2^i to 2^(i+1) - 1 requests (1, 2-3, 4-7, ...); as long as
  // the largest batch taken needs.
  std::vector<uint64_t> batches_by_size;
  // Queueing: from arrival to the take that let a request leave.
  double wait_ms_total = 0.0;
  double wait_ms_max = 0.0;
  uint64_t late = 0;  // requests that queued longer than max_latency
};

class Batcher {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Batcher(const BatchLimits& limits = {});

  const BatchLimits& limits() const { return limits_; }
  // New limits apply from the next take() on; requests already queued stay queued.
  void set_limits(const BatchLimits& limits);

  // `n` requests arrived at `t` (t never earlier than a previous arrival).
  void arrived(Clock::time_point t, size_t n = 1);
  // Rule 1: whether take() would let a batch leave now.
  bool ready() const { return !busy_ && !queued_.empty(); }
  // How many of the queued requests (the oldest) leave now as one batch: 0 when !ready();
  // otherwise min(queued, max_batch), and the worker is busy until finished().
  size_t take(Clock::time_point now);
  // The worker finished the batch take() gave it.
  void finished() { busy_ = false; }
  bool busy() const { return busy_; }
  // Rule 5.
  bool full() const { return queued_.size() >= limits_.max_batch; }
  size_t queued() const { return queued_.size(); }
  // Forgets the queued requests (a flush); returns how many there were. A running batch is the
  // worker's: finished() still ends it.
  size_t drop();

  const BatcherStats& stats() const { return stats_; }

 private:
  BatchLimits limits_;
  std::deque<Clock::time_point> queued_;  // arrival times, oldest first
  bool busy_ = false;
  BatcherStats stats_;
};

// The rows of a batch, from run_isolating_failures().
struct BatchRows {
  std::vector<float> values;        // inputs.size() rows of `width` f32, row-major; zero where errors[i] is set
  std::vector<std::string> errors;  // per input: empty, or why it failed
};

// Runs `inputs` through `run` in one call; `run` takes a std::vector<Input> and returns a host
// f32 Tensor of [inputs, width]. An engine call fails as a whole for one bad input (a text the
// tokenizer refuses, an image it cannot take), so when the call throws, every input is run
// alone and only those that fail by themselves fail, with the message of their own call. An
// empty batch makes no call.
template <typename Input, typename Run>
BatchRows run_isolating_failures(const std::vector<Input>& inputs, size_t width, Run&& run) {
  BatchRows out;
  out.values.assign(inputs.size() * width, 0.0f);
  out.errors.assign(inputs.size(), std::string());
  if (inputs.empty()) return out;
  try {
    const Tensor rows = run(inputs);
    std::copy(rows.data<float>(), rows.data<float>() + out.values.size(), out.values.begin());
    return out;
  } catch (const std::exception& e) {
    if (inputs.size() == 1) {
      out.errors[0] = e.what();
      return out;
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    try {
      const Tensor row = run(std::vector<Input>{inputs[i]});
      std::copy(row.data<float>(), row.data<float>() + width,
                out.values.begin() + static_cast<std::ptrdiff_t>(i * width));
    } catch (const std::exception& e) {
      out.errors[i] = e.what();
    }
  }
  return out;
}

}  // namespace moe
