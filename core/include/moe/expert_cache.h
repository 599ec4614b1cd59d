// gst-moe: a device-side cache of MoE experts with asynchronous prefetch (docs/expert-cache.md).
//
// The cache owns a budget of device memory cut into fixed-size slots, one expert each, and maps
// experts to slots. A slot holds an expert as the store stages it: 4-bit experts stay packed
// (codes, scales, zero points), so a budget holds ~7x as many of them as of f32 experts. moe-route calls prefetch() as
// soon as it has routed a batch: every expert the batch needs is pinned for that batch and the missing ones are copied
// from the HostExpertStore on the backend's copy queue, while earlier batches still compute. moe-expert calls
// BatchLease::acquire(e) just before it runs expert e: the compute queue waits for that expert's copy only. Dropping
// the lease unpins the batch's experts.
//
// Guarantees:
//  - An expert pinned by a batch in flight (a live lease) is never evicted, so a slot never
//    changes under a batch that still needs it (the "newly loaded expert evicted while the same
//    pass still needs it" bug of other offload systems).
//  - Bytes of slots never exceed the budget; prefetch() never blocks on copies.
//  - When the experts pinned by batches in flight plus a new batch's experts do not fit,
//    prefetch() waits up to ExpertCacheOptions::admission_wait for leases to be dropped, then
//    throws moe::Error naming the budget and the need; a batch that alone needs more slots than
//    the budget holds throws at once.
// Eviction among unpinned residents: least recently used (the last prefetch that listed the
// expert), ties - every expert of one batch has the same time - broken by fewer uses (prefetches
// that listed it), then by the lower expert id. Another policy "or better if measured better" is
// future work: nothing here measures alternatives.
//
// Threads: prefetch(), stats() and the other const members may be called from any thread,
// concurrently with leases being acquired and released from other threads (one mutex guards the
// map). acquire() queues a wait on the backend's compute queue, so it belongs to the thread that
// runs the backend's operations (or must be serialised with them by the caller).
// Contract of release: drop a lease only after the work that reads its experts' weights has
// finished (CUDA: after the synchronize / copy_to_host that ends the batch); the next copy into
// a freed slot is not ordered after that work. Copies into one slot are ordered by the copy
// queue (a queue runs its copies in order).
// Lifetime: backend and store outlive the cache; leases may outlive the ExpertCache object (they
// share its state), and the slots are freed, after every copy completed, when the last is gone.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend.h"
#include "moe/expert_store.h"

namespace moe {

struct ExpertCacheOptions {
  // Device memory for slots in bytes; 0: budget_fraction of the backend's free memory
  // (memory_info().free_bytes) at construction.
  size_t budget_bytes = 0;
  double budget_fraction = 0.85;
  // How long prefetch() waits for batches in flight to drop their leases when the new batch does
  // not fit beside their pinned experts; zero: throw at once. A wait only ends early through
  // leases released by other threads, so a thread must never wait for its own leases.
  std::chrono::milliseconds admission_wait{0};
};

// Counters since construction (monotonic) and gauges (now). "Copy" is one expert copied into a
// slot by a prefetch.
struct CacheStats {
  uint64_t prefetches = 0;         // successful prefetch() calls (batches admitted)
  uint64_t hits = 0;               // distinct experts of admitted batches that already had a slot
                                   // (loaded, or still loading for an earlier batch): no copy
  uint64_t misses = 0;             // distinct experts of admitted batches without a slot: one copy each
  uint64_t bytes_copied = 0;       // bytes of those copies (misses × slot_bytes)
  uint64_t evictions = 0;          // unpinned residents dropped to make room for misses
  uint64_t prefetch_failures = 0;  // prefetch() calls that threw because the batch did not fit
  uint64_t admission_waits = 0;    // prefetch() calls that had to wait for leases to be dropped
  uint64_t acquires = 0;           // BatchLease::acquire() calls that returned weights
  // Hidden vs exposed copies, decided at the first acquire() of each copy:
  uint64_t copies_hidden = 0;   // the copy had completed: its whole transfer overlapped other work
  uint64_t copies_exposed = 0;  // the copy was still running: the compute queue had to wait
  // Host time acquire() spent in Backend::wait_event on copies still running (every acquire,
  // not only the first). On the CPU backend this is the full stall; on CUDA wait_event does not
  // block the host (the compute stream waits), so it is ~0 and the stall is not measured: that
  // needs per-copy timing, which Backend does not offer (docs/expert-cache.md).
  uint64_t exposed_wait_ns = 0;
  // Gauges:
  uint64_t copies_in_flight = 0;    // slots whose latest copy is still running (polled by stats())
  uint64_t resident = 0;            // experts holding a slot (loaded or loading)
  uint64_t resident_bytes = 0;      // their bytes (resident × slot_bytes; 4-bit experts packed)
  uint64_t pinned = 0;              // experts pinned by at least one lease
  uint64_t batches_in_flight = 0;   // live, unreleased leases
  uint64_t prefetches_waiting = 0;  // prefetch() calls waiting for room right now
};

class ExpertCache;

// One batch's hold on its experts: returned by ExpertCache::prefetch(), unpins on release() or
// destruction. acquire() and release() may be called from a thread other than the one that
// called prefetch(), but one lease is used by one thread at a time.
class BatchLease {
 public:
  ~BatchLease();
  BatchLease(const BatchLease&) = delete;
  BatchLease& operator=(const BatchLease&) = delete;

  // Makes the backend's compute queue wait for `expert`'s copy (not for any other copy) and
  // returns its weights in the slot. Throws moe::Error when the expert is not part of this
  // batch or the lease was released.
  kernels::ExpertWeights acquire(int32_t expert);
  // Unpins the batch's experts; idempotent.
  void release();
  bool released() const { return released_; }
  // The batch's distinct experts, ascending.
  const std::vector<int32_t>& experts() const { return experts_; }

 private:
  friend class ExpertCache;
  struct Core;
  BatchLease(std::shared_ptr<Core> core, std::vector<int32_t> experts);
  std::shared_ptr<Core> core_;
  std::vector<int32_t> experts_;
  bool released_ = false;
};

class ExpertCache {
 public:
  // Allocates min(budget / slot size, num_experts) slots on `backend` (slot size =
  // store.max_expert_bytes()). Throws moe::Error when the budget holds no expert, or when the
  // store's staging memory belongs to a backend this one cannot copy from
  // (Backend::shares_staging_with). The store, and the backend that staged it, outlive the cache.
  ExpertCache(kernels::Backend& backend, const HostExpertStore& store, const ExpertCacheOptions& options = {});
  ~ExpertCache();
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // Pins every listed expert (ids in [0, num_experts); duplicates count once) for a new batch
  // and starts the copies of those without a slot. See the class comment for when it throws.
  std::shared_ptr<BatchLease> prefetch(const std::vector<int32_t>& experts);

  CacheStats stats() const;
  size_t budget_bytes() const;
  size_t slot_bytes() const;
  int num_slots() const;
  bool is_resident(int32_t expert) const;
  int pin_count(int32_t expert) const;
  // Checks the internal invariants (slot map is a bijection, pinned experts are resident, slots
  // within budget, counters agree); throws moe::Error describing the first violation. For tests.
  void check_invariants() const;

 private:
  std::shared_ptr<BatchLease::Core> core_;
};

}  // namespace moe
