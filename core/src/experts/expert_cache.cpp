#include "moe/expert_cache.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>

#include "runtime/compute_util.h"
#include "moe/error.h"

namespace moe {

namespace {

std::string mib(size_t bytes) {
  std::ostringstream s;
  s.precision(1);
  s << std::fixed << static_cast<double>(bytes) / (1024.0 * 1024.0) << " MiB";
  return s.str();
}

std::string bytes_str(size_t bytes) { return std::to_string(bytes) + " bytes (" + mib(bytes) + ")"; }

std::string id_list(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ", ";
    if (i == 16) return s + "... (" + std::to_string(ids.size()) + " in all)";
    s += std::to_string(ids[i]);
  }
  return s;
}

}  // namespace

// The state a cache and its leases share. All members below `mu` are guarded by it.
struct BatchLease::Core {
  struct Entry {
    int slot = -1;                         // -1: not resident
    int pins = 0;                          // live leases that listed the expert
    uint64_t last_use = 0;                 // tick of the last admitted prefetch that listed it
    uint64_t uses = 0;                     // admitted prefetches that listed it
    std::shared_ptr<kernels::Event> copy;  // the copy that filled the slot
    bool copy_done = false;                // completion observed
    bool acquired = false;                 // the copy has had its first acquire
  };

  kernels::Backend& backend;
  const HostExpertStore& store;
  size_t budget = 0;
  size_t slot_bytes = 0;
  int slots = 0;
  unsigned char* memory = nullptr;
  std::chrono::milliseconds admission_wait{0};

  mutable std::mutex mu;
  std::condition_variable room;  // signalled when a lease is released
  std::vector<Entry> entries;    // per expert
  std::vector<int> slot_owner;   // per slot: expert or -1
  // Per slot: the latest copy into it. The copy queue runs copies in order, so once it completed
  // every earlier copy into the slot did too (an evicted expert's copy may still be running).
  std::vector<std::shared_ptr<kernels::Event>> slot_copy;
  std::vector<int> free_slots;  // LIFO
  // 4-bit experts: per slot, the descriptors of the arrays in it (the same whichever expert the
  // slot holds: every expert has one layout), which acquire()'s weights point to.
  std::vector<std::array<kernels::Q4Weight, 3>> slot_q4;
  uint64_t tick = 0;
  CacheStats st;  // counters; gauges are filled in by stats()
  uint64_t batches_in_flight = 0;
  uint64_t waiting = 0;

  Core(kernels::Backend& b, const HostExpertStore& s) : backend(b), store(s) {}

  ~Core() {
    // A copy may still be writing into a slot: wait for every one before freeing the memory.
    // When the wait itself fails (a CUDA fault), the slots are leaked rather than freed under a
    // copy that might still run.
    const bool copies_done = detail::try_release(backend.name() + ": expert cache: waiting for slot copies", [this] {
      for (auto& copy : slot_copy)
        if (copy)
          while (!backend.event_complete(*copy)) std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
    if (memory && copies_done) detail::deallocate_noexcept(backend, memory);
  }

  void* slot_ptr(int slot) const { return memory + slot_bytes * static_cast<size_t>(slot); }

  // Forgets the copies whose completion can be observed now; returns how many are still running
  // (lock held).
  uint64_t poll_copies() {
    uint64_t running = 0;
    for (size_t s = 0; s < slot_copy.size(); ++s) {
      if (!slot_copy[s]) continue;
      if (!backend.event_complete(*slot_copy[s])) {
        ++running;
        continue;
      }
      const int e = slot_owner[s];
      if (e >= 0 && entries[static_cast<size_t>(e)].copy == slot_copy[s])
        entries[static_cast<size_t>(e)].copy_done = true;
      slot_copy[s].reset();
    }
    return running;
  }

  // The unpinned resident to evict: least recently used, then least used, then lowest id.
  int pick_victim() const {
    int best = -1;
    for (int e = 0; e < static_cast<int>(entries.size()); ++e) {
      const Entry& en = entries[e];
      if (en.slot < 0 || en.pins > 0) continue;
      if (best < 0 || std::tie(en.last_use, en.uses) < std::tie(entries[best].last_use, entries[best].uses)) best = e;
    }
    return best;
  }

  std::string describe_budget() const {
    return "budget " + bytes_str(budget) + " = " + std::to_string(slots) + " slots of " + bytes_str(slot_bytes);
  }

  void release(const std::vector<int32_t>& experts) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (int32_t e : experts) --entries[static_cast<size_t>(e)].pins;
      --batches_in_flight;
    }
    room.notify_all();
  }
};

// ---------------------------------------------------------------------------------------------

BatchLease::BatchLease(std::shared_ptr<Core> core, std::vector<int32_t> experts)
    : core_(std::move(core)), experts_(std::move(experts)) {}

BatchLease::~BatchLease() { release(); }

void BatchLease::release() {
  if (released_) return;
  released_ = true;
  core_->release(experts_);
}

kernels::ExpertWeights BatchLease::acquire(int32_t expert) {
  if (released_) throw Error("expert cache: acquire(" + std::to_string(expert) + ") on a released batch lease");
  if (!std::binary_search(experts_.begin(), experts_.end(), expert))
    throw Error("expert cache: expert " + std::to_string(expert) +
                " was not prefetched for this batch (it pinned experts " + id_list(experts_) + ")");
  Core& c = *core_;
  std::shared_ptr<kernels::Event> copy;
  void* slot = nullptr;
  int slot_index = -1;
  bool first = false, done = false;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    Core::Entry& en = c.entries[static_cast<size_t>(expert)];
    // Pinned by this lease: resident, and its slot cannot change until the lease is dropped.
    slot_index = en.slot;
    slot = c.slot_ptr(en.slot);
    copy = en.copy;
    done = en.copy_done;
    first = !en.acquired;
    en.acquired = true;
  }
  if (!done && copy) done = c.backend.event_complete(*copy);
  uint64_t waited_ns = 0;
  if (!done) {
    const auto t0 = std::chrono::steady_clock::now();
    c.backend.wait_event(*copy);
    waited_ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  {
    std::lock_guard<std::mutex> lock(c.mu);
    ++c.st.acquires;
    if (first) ++(done ? c.st.copies_hidden : c.st.copies_exposed);
    c.st.exposed_wait_ns += waited_ns;
    Core::Entry& en = c.entries[static_cast<size_t>(expert)];
    if (done) en.copy_done = true;
  }
  return c.store.weights_at(slot, c.slot_q4.empty() ? nullptr : &c.slot_q4[static_cast<size_t>(slot_index)]);
}

// ---------------------------------------------------------------------------------------------

ExpertCache::ExpertCache(kernels::Backend& backend, const HostExpertStore& store, const ExpertCacheOptions& options)
    : core_(std::make_shared<BatchLease::Core>(backend, store)) {
  BatchLease::Core& c = *core_;
  if (&store.backend() != &backend && !backend.shares_staging_with(store.backend()))
    throw Error("expert cache on " + backend.name() + ": the expert store's staging memory belongs to " +
                store.backend().name() + ", which " + backend.name() +
                " cannot copy from asynchronously; build the store with the cache's backend");
  c.slot_bytes = store.max_expert_bytes();
  if (options.budget_bytes > 0) {
    c.budget = options.budget_bytes;
  } else {
    if (!(options.budget_fraction > 0.0 && options.budget_fraction <= 1.0))
      throw Error("expert cache on " + backend.name() + ": budget_fraction " + std::to_string(options.budget_fraction) +
                  " outside (0, 1]");
    const size_t free_bytes = backend.memory_info().free_bytes;
    c.budget = static_cast<size_t>(static_cast<double>(free_bytes) * options.budget_fraction);
  }
  const size_t fit = c.budget / c.slot_bytes;
  if (fit == 0)
    throw Error("expert cache on " + backend.name() + ": budget " + bytes_str(c.budget) +
                " holds no expert (one expert takes " + bytes_str(c.slot_bytes) + ")");
  c.slots = static_cast<int>(std::min<size_t>(fit, static_cast<size_t>(store.num_experts())));
  c.admission_wait = options.admission_wait;
  c.memory = static_cast<unsigned char*>(backend.allocate(c.slot_bytes * static_cast<size_t>(c.slots)));
  c.entries.resize(static_cast<size_t>(store.num_experts()));
  c.slot_owner.assign(static_cast<size_t>(c.slots), -1);
  c.slot_copy.resize(static_cast<size_t>(c.slots));
  for (int s = c.slots - 1; s >= 0; --s) c.free_slots.push_back(s);
  if (store.weight_type() == kernels::WeightType::Q4) {
    c.slot_q4.resize(static_cast<size_t>(c.slots));
    for (int s = 0; s < c.slots; ++s) store.weights_at(c.slot_ptr(s), &c.slot_q4[static_cast<size_t>(s)]);
  }
}

ExpertCache::~ExpertCache() = default;

std::shared_ptr<BatchLease> ExpertCache::prefetch(const std::vector<int32_t>& experts) {
  BatchLease::Core& c = *core_;
  const int E = static_cast<int>(c.entries.size());
  std::vector<int32_t> ids(experts);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  if (!ids.empty() && (ids.front() < 0 || ids.back() >= E))
    throw Error("expert cache: prefetch of expert " + std::to_string(ids.front() < 0 ? ids.front() : ids.back()) +
                " outside [0, " + std::to_string(E) + ")");

  std::unique_lock<std::mutex> lock(c.mu);
  if (static_cast<int>(ids.size()) > c.slots) {
    ++c.st.prefetch_failures;
    throw Error("expert cache on " + c.backend.name() + ": one batch needs " + std::to_string(ids.size()) +
                " distinct experts (" + bytes_str(ids.size() * c.slot_bytes) + ") but the " + c.describe_budget() +
                " holds only " + std::to_string(c.slots) + "; raise the budget or lower the batch size / top_k");
  }

  // Admission: the missing experts need free slots or unpinned residents outside this batch.
  const auto deadline = std::chrono::steady_clock::now() + c.admission_wait;
  bool counted_wait = false;
  for (;;) {
    size_t missing = 0, available = c.free_slots.size();
    for (int32_t e : ids)
      if (c.entries[static_cast<size_t>(e)].slot < 0) ++missing;
    for (int e = 0; e < E; ++e) {
      const auto& en = c.entries[static_cast<size_t>(e)];
      if (en.slot >= 0 && en.pins == 0 && !std::binary_search(ids.begin(), ids.end(), e)) ++available;
    }
    if (missing <= available) break;
    if (c.admission_wait.count() > 0 && std::chrono::steady_clock::now() < deadline) {
      if (!counted_wait) ++c.st.admission_waits;
      counted_wait = true;
      ++c.waiting;
      c.room.wait_until(lock, deadline);
      --c.waiting;
      continue;
    }
    ++c.st.prefetch_failures;
    uint64_t pinned = 0;
    for (const auto& en : c.entries)
      if (en.pins > 0) ++pinned;
    throw Error("expert cache on " + c.backend.name() + ": a batch needs " + std::to_string(ids.size()) + " experts, " +
                std::to_string(missing) + " of them not resident (" + bytes_str(missing * c.slot_bytes) +
                "), but only " + std::to_string(available) +
                " slots are free or evictable (batches in flight: " + std::to_string(c.batches_in_flight) +
                ", pinning " + std::to_string(pinned) + " experts; " + c.describe_budget() + ")" +
                (c.admission_wait.count() > 0
                     ? "; waited " + std::to_string(c.admission_wait.count()) + " ms for batches to finish"
                     : "") +
                "; raise the budget or keep fewer batches in flight");
  }

  // Admitted: pin first, so that evictions below never pick an expert of this batch.
  ++c.tick;
  for (int32_t e : ids) {
    auto& en = c.entries[static_cast<size_t>(e)];
    ++en.pins;
    en.last_use = c.tick;
    ++en.uses;
  }
  std::vector<int32_t> assigned;  // experts given a slot below
  try {
    for (int32_t e : ids) {
      auto& en = c.entries[static_cast<size_t>(e)];
      if (en.slot >= 0) {
        ++c.st.hits;
        continue;
      }
      int slot;
      if (!c.free_slots.empty()) {
        slot = c.free_slots.back();
        c.free_slots.pop_back();
      } else {
        const int victim = c.pick_victim();
        if (victim < 0) throw Error("expert cache: internal error: no evictable expert after admission");
        auto& v = c.entries[static_cast<size_t>(victim)];
        slot = v.slot;
        v.slot = -1;
        v.copy.reset();
        v.copy_done = false;
        v.acquired = false;
        ++c.st.evictions;
      }
      c.slot_owner[static_cast<size_t>(slot)] = e;
      en.slot = slot;
      assigned.push_back(e);
      // The copy queue runs copies in order, so this copy lands after any earlier one into the slot.
      en.copy = c.backend.copy_from_host_async(c.slot_ptr(slot), c.store.expert_data(e), c.slot_bytes);
      c.slot_copy[static_cast<size_t>(slot)] = en.copy;
      en.copy_done = false;
      en.acquired = false;
      ++c.st.misses;
      c.st.bytes_copied += c.slot_bytes;
    }
  } catch (...) {
    // The failed expert holds a slot without a copy: free it; copies already issued stay valid.
    for (int32_t e : assigned) {
      auto& en = c.entries[static_cast<size_t>(e)];
      if (!en.copy) {
        c.slot_owner[static_cast<size_t>(en.slot)] = -1;
        c.free_slots.push_back(en.slot);
        en.slot = -1;
      }
    }
    for (int32_t e : ids) --c.entries[static_cast<size_t>(e)].pins;
    lock.unlock();
    c.room.notify_all();
    throw;
  }
  ++c.st.prefetches;
  ++c.batches_in_flight;
  lock.unlock();
  return std::shared_ptr<BatchLease>(new BatchLease(core_, std::move(ids)));
}

CacheStats ExpertCache::stats() const {
  BatchLease::Core& c = *core_;
  std::lock_guard<std::mutex> lock(c.mu);
  CacheStats s = c.st;
  s.copies_in_flight = c.poll_copies();
  for (const auto& en : c.entries) {
    if (en.slot >= 0) ++s.resident;
    if (en.pins > 0) ++s.pinned;
  }
  s.resident_bytes = s.resident * c.slot_bytes;
  s.batches_in_flight = c.batches_in_flight;
  s.prefetches_waiting = c.waiting;
  return s;
}

size_t ExpertCache::budget_bytes() const { return core_->budget; }
size_t ExpertCache::slot_bytes() const { return core_->slot_bytes; }
int ExpertCache::num_slots() const { return core_->slots; }

bool ExpertCache::is_resident(int32_t expert) const {
  std::lock_guard<std::mutex> lock(core_->mu);
  return expert >= 0 && expert < static_cast<int32_t>(core_->entries.size()) &&
         core_->entries[static_cast<size_t>(expert)].slot >= 0;
}

int ExpertCache::pin_count(int32_t expert) const {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (expert < 0 || expert >= static_cast<int32_t>(core_->entries.size())) return 0;
  return core_->entries[static_cast<size_t>(expert)].pins;
}

void ExpertCache::check_invariants() const {
  const BatchLease::Core& c = *core_;
  std::lock_guard<std::mutex> lock(c.mu);
  auto fail = [](const std::string& what) { throw Error("expert cache invariant violated: " + what); };
  if (c.slot_bytes * static_cast<size_t>(c.slots) > c.budget) fail("slots exceed the budget");
  std::vector<int> seen(static_cast<size_t>(c.slots), 0);
  uint64_t resident = 0;
  for (size_t e = 0; e < c.entries.size(); ++e) {
    const auto& en = c.entries[e];
    if (en.pins < 0) fail("expert " + std::to_string(e) + " has a negative pin count");
    if (en.pins > 0 && en.slot < 0) fail("pinned expert " + std::to_string(e) + " is not resident");
    if (en.slot >= 0) {
      ++resident;
      if (en.slot >= c.slots) fail("expert " + std::to_string(e) + " has slot " + std::to_string(en.slot));
      if (++seen[static_cast<size_t>(en.slot)] > 1) fail("slot " + std::to_string(en.slot) + " holds two experts");
      if (c.slot_owner[static_cast<size_t>(en.slot)] != static_cast<int>(e))
        fail("slot map disagrees for expert " + std::to_string(e));
      if (!en.copy) fail("resident expert " + std::to_string(e) + " has no copy");
    }
  }
  for (int s = 0; s < c.slots; ++s)
    if (!seen[static_cast<size_t>(s)] && c.slot_owner[static_cast<size_t>(s)] != -1)
      fail("slot " + std::to_string(s) + " has an owner that does not hold it");
  if (resident + c.free_slots.size() != static_cast<uint64_t>(c.slots)) fail("free list and residents do not add up");
  if (resident != c.st.misses - c.st.evictions) fail("resident != misses - evictions");
  if (c.st.bytes_copied != c.st.misses * c.slot_bytes) fail("bytes_copied != misses x slot_bytes");
  if (c.st.copies_hidden + c.st.copies_exposed > c.st.misses) fail("more first acquires than copies");
}

}  // namespace moe
