// HostExpertStore and ExpertCache on the CPU backend whose asynchronous copies run on a worker
// thread (a host "device" with a real copy queue): counters on scripted sequences, eviction
// order, data integrity, in-flight pinning, admission, concurrency, errors.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <iostream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "moe/error.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"
#include "random_moe.h"
#include "test_util.h"

using moe::BatchLease;
using moe::CacheStats;
using moe::ExpertCache;
using moe::ExpertCacheOptions;
using moe::ExpertMatrix;
using moe::HostExpertStore;
using moe::Tensor;
using moe::kernels::WeightType;
using moe::test::expect_error;

namespace {

// Distinct values for every (expert, matrix, element), so a mixed-up slot is always noticed.
Tensor pattern(int e, ExpertMatrix which, int64_t rows, int64_t cols) {
  Tensor t = Tensor::zeros(moe::DType::F32, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] = std::sin(0.37f * static_cast<float>(i) + 7.1f * static_cast<float>(e) +
                                  3.3f * static_cast<float>(static_cast<int>(which))) *
                         (1.0f + static_cast<float>(e));
  return t;
}

struct Rig {
  std::unique_ptr<moe::kernels::Backend> backend;
  HostExpertStore store;
  // Default: the CPU backend whose asynchronous copies run on a worker thread.
  Rig(int experts, int64_t hidden, int64_t inter, WeightType type = WeightType::F32)
      : Rig(moe::kernels::make_cpu_backend({/*async_copies=*/true}), experts, hidden, inter, type) {}
  Rig(std::unique_ptr<moe::kernels::Backend> b, int experts, int64_t hidden, int64_t inter, WeightType type)
      : backend(std::move(b)), store(*backend, type, experts, hidden, inter, [hidden, inter](int e, ExpertMatrix w) {
          return w == ExpertMatrix::W2 ? pattern(e, w, hidden, inter) : pattern(e, w, inter, hidden);
        }) {}

  ExpertCacheOptions slots(int n) const {
    ExpertCacheOptions o;
    o.budget_bytes = store.max_expert_bytes() * static_cast<size_t>(n) + store.max_expert_bytes() / 2;
    return o;
  }

  // Acquires `e` through the lease and checks, by copying the slot back, that it holds exactly
  // the expert's bytes.
  ::testing::AssertionResult slot_intact(BatchLease& lease, int32_t e) {
    const moe::kernels::ExpertWeights w = lease.acquire(e);
    const size_t n = store.expert_bytes(e);
    std::vector<unsigned char> got(n);
    backend->copy_to_host(got.data(), w.w1.data, n);
    if (std::memcmp(got.data(), store.expert_data(e), n) != 0)
      return ::testing::AssertionFailure() << "slot of expert " << e << " does not hold its bytes";
    const auto* base = static_cast<const unsigned char*>(w.w1.data);
    if (static_cast<const unsigned char*>(w.w3.data) != base + store.matrix_offset(ExpertMatrix::W3) ||
        static_cast<const unsigned char*>(w.w2.data) != base + store.matrix_offset(ExpertMatrix::W2) ||
        w.w1.type != store.weight_type())
      return ::testing::AssertionFailure() << "weights of expert " << e << " do not point into its slot";
    return ::testing::AssertionSuccess();
  }

  // One batch the way moe-route and moe-expert use it: prefetch, acquire all, release.
  void run_batch(ExpertCache& cache, const std::vector<int32_t>& experts) {
    auto lease = cache.prefetch(experts);
    for (int32_t e : lease->experts()) EXPECT_TRUE(slot_intact(*lease, e));
    lease->release();
  }
};

void expect_counts(const CacheStats& s, uint64_t hits, uint64_t misses, uint64_t evictions) {
  EXPECT_EQ(s.hits, hits);
  EXPECT_EQ(s.misses, misses);
  EXPECT_EQ(s.evictions, evictions);
}

}  // namespace

// ---- HostExpertStore -----------------------------------------------------------------------

TEST(HostExpertStore, PacksEveryPrecisionWithAlignedMatrices) {
  for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    SCOPED_TRACE(moe::kernels::weight_type_name(type));
    const int64_t D = 3, I = 5;  // 15 elements: padding after every matrix
    Rig rig(4, D, I, type);
    const HostExpertStore& s = rig.store;
    const size_t elt = moe::kernels::weight_type_size(type);
    EXPECT_EQ(s.matrix_offset(ExpertMatrix::W1), 0u);
    EXPECT_EQ(s.matrix_offset(ExpertMatrix::W3) % HostExpertStore::kMatrixAlignment, 0u);
    EXPECT_EQ(s.matrix_offset(ExpertMatrix::W2) % HostExpertStore::kMatrixAlignment, 0u);
    EXPECT_GE(s.matrix_offset(ExpertMatrix::W3), D * I * elt);
    EXPECT_EQ(s.expert_bytes(2), s.max_expert_bytes());
    EXPECT_EQ(s.max_expert_bytes(), 3 * s.matrix_offset(ExpertMatrix::W3));
    for (int e = 0; e < 4; ++e)
      for (ExpertMatrix w : {ExpertMatrix::W1, ExpertMatrix::W3, ExpertMatrix::W2}) {
        const Tensor src = w == ExpertMatrix::W2 ? pattern(e, w, D, I) : pattern(e, w, I, D);
        const auto* p = static_cast<const unsigned char*>(s.expert_data(e)) + s.matrix_offset(w);
        for (int64_t i = 0; i < D * I; ++i) {
          const float v = src.data<float>()[i];
          if (type == WeightType::F32) {
            float got;
            std::memcpy(&got, p + i * 4, 4);
            ASSERT_EQ(got, v);
          } else {
            uint16_t got;
            std::memcpy(&got, p + i * 2, 2);
            ASSERT_EQ(got, type == WeightType::F16 ? moe::float_to_half(v) : moe::float_to_bf16(v));
          }
        }
        for (size_t b = static_cast<size_t>(D * I) * elt; b < s.matrix_offset(ExpertMatrix::W3); ++b)
          ASSERT_EQ(p[b], 0) << "padding byte " << b;
      }
    const auto w = s.host_weights(1);
    EXPECT_EQ(w.w1.data, s.expert_data(1));
    EXPECT_EQ(w.w2.type, type);
  }
}

TEST(HostExpertStore, FromLayerHoldsTheLayersExperts) {
  auto backend = moe::kernels::make_cpu_backend();
  const moe::MoeLayer layer = moe::test::random_moe_layer(5, 16, 24, 2, 3);
  const HostExpertStore s = HostExpertStore::from_layer(*backend, layer, WeightType::F32);
  ASSERT_EQ(s.num_experts(), 5);
  for (int e = 0; e < 5; ++e)
    for (ExpertMatrix w : {ExpertMatrix::W1, ExpertMatrix::W3, ExpertMatrix::W2}) {
      const Tensor& t = layer.expert_weight(e, w);
      EXPECT_EQ(std::memcmp(static_cast<const unsigned char*>(s.expert_data(e)) + s.matrix_offset(w), t.raw_data(),
                            t.nbytes()),
                0);
    }
  expect_error([&] { layer.expert_weight(5, ExpertMatrix::W1); }, {"expert 5", "[0, 5)"});
}

TEST(HostExpertStore, RejectsWrongShapesAndIds) {
  auto backend = moe::kernels::make_cpu_backend();
  expect_error(
      [&] {
        HostExpertStore(*backend, WeightType::F16, 2, 4, 6,
                        [](int e, ExpertMatrix w) { return pattern(e, w, 6, 4); });  // w2 should be [4, 6]
      },
      {"expert 0", "w2", "[4,6]"});
  Rig rig(3, 4, 8);
  expect_error([&] { rig.store.expert_data(3); }, {"expert 3", "[0, 3)"});
}

// ---- ExpertCache: counters and eviction order -------------------------------------------------

TEST(ExpertCache, ScriptedSequenceCountsAndEvictsLeastRecentlyUsed) {
  Rig rig(8, 8, 16);
  ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
  ASSERT_EQ(cache.num_slots(), 4);
  EXPECT_LE(cache.slot_bytes() * 4, cache.budget_bytes());

  rig.run_batch(cache, {0, 1});
  expect_counts(cache.stats(), 0, 2, 0);
  rig.run_batch(cache, {3, 2, 3});  // duplicates count once
  expect_counts(cache.stats(), 0, 4, 0);
  rig.run_batch(cache, {0});
  expect_counts(cache.stats(), 1, 4, 0);
  rig.run_batch(cache, {4});  // full: evicts 1, used least recently (0 was used again)
  expect_counts(cache.stats(), 1, 5, 1);
  EXPECT_FALSE(cache.is_resident(1));
  rig.run_batch(cache, {2});
  rig.run_batch(cache, {5, 6});  // evicts 3 (batch 2), then 0 (batch 3)
  const CacheStats s = cache.stats();
  expect_counts(s, 2, 7, 3);
  for (int e : {2, 4, 5, 6}) EXPECT_TRUE(cache.is_resident(e)) << e;
  for (int e : {0, 1, 3, 7}) EXPECT_FALSE(cache.is_resident(e)) << e;
  EXPECT_EQ(s.bytes_copied, 7 * cache.slot_bytes());
  EXPECT_EQ(s.resident, 4u);
  EXPECT_EQ(s.pinned, 0u);
  EXPECT_EQ(s.batches_in_flight, 0u);
  EXPECT_EQ(s.copies_in_flight, 0u);  // every copy was acquired, so it completed
  EXPECT_EQ(s.prefetches, 6u);
  EXPECT_EQ(s.acquires, 9u);
  EXPECT_EQ(s.copies_hidden + s.copies_exposed, 7u);
  cache.check_invariants();
}

TEST(ExpertCache, EqualRecencyEvictsTheLessFrequentlyUsedFirst) {
  Rig rig(8, 4, 8);
  ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
  rig.run_batch(cache, {0, 1});
  rig.run_batch(cache, {0});
  rig.run_batch(cache, {0, 1, 2, 3});  // same recency for all; uses 3, 2, 1, 1
  rig.run_batch(cache, {4});           // 2 and 3 tie on uses: the lower id goes
  EXPECT_FALSE(cache.is_resident(2));
  rig.run_batch(cache, {5});  // 3: least used among the oldest
  EXPECT_FALSE(cache.is_resident(3));
  rig.run_batch(cache, {6});  // oldest are 0 (3 uses) and 1 (2 uses): 1 goes
  EXPECT_FALSE(cache.is_resident(1));
  EXPECT_TRUE(cache.is_resident(0));
  expect_counts(cache.stats(), 3, 7, 3);
  cache.check_invariants();
}

TEST(ExpertCache, SlotsHoldExactBytesInEveryPrecision) {
  for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    SCOPED_TRACE(moe::kernels::weight_type_name(type));
    Rig rig(6, 24, 40, type);
    ExpertCache cache(*rig.backend, rig.store, rig.slots(3));
    std::mt19937 rng(5);
    for (int batch = 0; batch < 40; ++batch) {
      std::vector<int32_t> ids;
      for (int j = 0; j < 3; ++j) ids.push_back(static_cast<int32_t>(rng() % 6));
      rig.run_batch(cache, ids);
    }
    cache.check_invariants();
  }
}

TEST(ExpertCache, BatchListingAResidentExpertNeverEvictsIt) {
  Rig rig(8, 4, 8);
  ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
  rig.run_batch(cache, {0, 1, 2, 3});
  // 3 is the most recent but 0..2 are as old: the batch needs three slots and must not take 3's.
  auto lease = cache.prefetch({3, 4, 5, 6});
  for (int32_t e : {3, 4, 5, 6}) EXPECT_TRUE(rig.slot_intact(*lease, e)) << e;
  expect_counts(cache.stats(), 1, 7, 3);
}

// ---- skewed routing against a budget of half the experts --------------------------------------

namespace {

// Hit rate of `batches` batches of 4 rows × top-2 experts drawn with probabilities `p`.
double hit_rate(Rig& rig, ExpertCache& cache, const std::vector<double>& p, int batches, unsigned seed) {
  std::mt19937 rng(seed);
  uint64_t listed = 0;
  for (int b = 0; b < batches; ++b) {
    std::vector<int32_t> ids;
    for (int row = 0; row < 4; ++row) {
      std::vector<double> w(p);
      for (int j = 0; j < 2; ++j) {  // top-2: two distinct experts per row
        std::discrete_distribution<int> pick(w.begin(), w.end());
        const int e = pick(rng);
        ids.push_back(e);
        w[static_cast<size_t>(e)] = 0.0;
      }
    }
    listed += std::set<int32_t>(ids.begin(), ids.end()).size();
    rig.run_batch(cache, ids);
  }
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.hits + s.misses, listed);
  EXPECT_EQ(s.bytes_copied, s.misses * cache.slot_bytes());
  EXPECT_EQ(s.resident, s.misses - s.evictions);
  EXPECT_LE(s.resident * cache.slot_bytes(), cache.budget_bytes());
  cache.check_invariants();
  return static_cast<double>(s.hits) / static_cast<double>(listed);
}

}  // namespace

TEST(ExpertCache, HalfTheExpertsServeASkewedRoutingWell) {
  const int E = 16;
  std::vector<double> zipf(E), uniform(E, 1.0);
  for (int e = 0; e < E; ++e) zipf[static_cast<size_t>(e)] = 1.0 / std::pow(e + 1.0, 1.2);
  Rig rig(E, 16, 32);
  ExpertCache skewed(*rig.backend, rig.store, rig.slots(E / 2));
  ExpertCache flat(*rig.backend, rig.store, rig.slots(E / 2));
  const double skewed_rate = hit_rate(rig, skewed, zipf, 300, 11);
  const double flat_rate = hit_rate(rig, flat, uniform, 300, 11);
  std::cout << "[ hit rate ] budget 8 of 16 experts, batches of 4 rows x top-2: zipf(1.2) " << skewed_rate
            << ", uniform " << flat_rate << "\n";
  RecordProperty("hit_rate_zipf", std::to_string(skewed_rate));
  RecordProperty("hit_rate_uniform", std::to_string(flat_rate));
  // Deterministic inputs: the skewed workload must profit from the cache clearly more.
  EXPECT_GT(skewed_rate, flat_rate + 0.1);
  EXPECT_GT(skewed.stats().evictions, 0u);
}

// ---- batches in flight ---------------------------------------------------------------------------

TEST(ExpertCache, PinnedExpertsOfABatchInFlightAreNeverEvicted) {
  Rig rig(8, 8, 16);
  ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
  auto a = cache.prefetch({0, 1, 2});  // batch A routed, not yet run
  EXPECT_EQ(cache.pin_count(1), 1);
  // Batch B needs two new experts; one slot is free and A pins the rest: B fails, clearly.
  expect_error(
      [&] {
        cache.prefetch({3, 4});
      },
      {"needs 2 experts", "2 of them not resident", "only 1 slots are free or evictable", "batches in flight: 1",
       "pinning 3 experts", "budget", "4 slots"});
  CacheStats s = cache.stats();
  EXPECT_EQ(s.prefetch_failures, 1u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.pinned, 3u);
  for (int e : {0, 1, 2}) EXPECT_EQ(cache.pin_count(e), 1) << "a failed prefetch must not leave pins";
  for (int e : {3, 4}) EXPECT_EQ(cache.pin_count(e), 0);
  // A batch that shares experts with A fits beside it (the shared ones are hits).
  auto c = cache.prefetch({2, 3});
  EXPECT_EQ(cache.pin_count(2), 2);
  for (int32_t e : {0, 1, 2}) EXPECT_TRUE(rig.slot_intact(*a, e)) << e;
  EXPECT_TRUE(rig.slot_intact(*c, 3));
  a->release();
  a->release();  // idempotent
  EXPECT_EQ(cache.pin_count(2), 1);
  // Now 0 and 1 may go, but 2 and 3 are still pinned by C.
  auto b = cache.prefetch({4, 5});
  EXPECT_FALSE(cache.is_resident(0));
  EXPECT_FALSE(cache.is_resident(1));
  for (int32_t e : {2, 3}) EXPECT_TRUE(rig.slot_intact(*c, e)) << e;
  for (int32_t e : {4, 5}) EXPECT_TRUE(rig.slot_intact(*b, e)) << e;
  c.reset();  // the destructor releases too
  b.reset();
  s = cache.stats();
  EXPECT_EQ(s.pinned, 0u);
  EXPECT_EQ(s.batches_in_flight, 0u);
  EXPECT_EQ(s.evictions, 2u);
  cache.check_invariants();
}

TEST(ExpertCache, AdmissionWaitsForBatchesInFlightWhenAllowed) {
  Rig rig(8, 8, 16);
  ExpertCacheOptions o = rig.slots(4);
  o.admission_wait = std::chrono::milliseconds(120000);
  ExpertCache cache(*rig.backend, rig.store, o);
  auto a = cache.prefetch({0, 1, 2, 3});
  std::shared_ptr<BatchLease> b;
  std::thread route([&] { b = cache.prefetch({4, 5}); });  // moe-route, one batch ahead
  while (cache.stats().prefetches_waiting == 0) std::this_thread::yield();
  // While B waits, A's experts stay resident and intact.
  for (int32_t e : {0, 1, 2, 3}) EXPECT_TRUE(rig.slot_intact(*a, e)) << e;
  EXPECT_EQ(cache.stats().evictions, 0u);
  a->release();  // moe-expert finished A
  route.join();
  ASSERT_TRUE(b);
  for (int32_t e : {4, 5}) EXPECT_TRUE(rig.slot_intact(*b, e)) << e;
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.admission_waits, 1u);
  EXPECT_EQ(s.prefetch_failures, 0u);
  EXPECT_EQ(s.evictions, 2u);
  cache.check_invariants();
}

// ---- concurrency ---------------------------------------------------------------------------------

TEST(ExpertCache, ConcurrentBatchesKeepEveryInvariant) {
  const int E = 12, threads = 4, iterations = 150;
  Rig rig(E, 16, 24);
  ExpertCacheOptions o = rig.slots(8);
  o.admission_wait = std::chrono::milliseconds(60000);  // a thread waits only for others' leases
  ExpertCache cache(*rig.backend, rig.store, o);
  std::mutex compute;  // the one compute queue: acquire() runs there
  std::atomic<uint64_t> listed{0}, acquired{0}, failed{0}, corrupt{0}, over_budget{0};
  std::atomic<int> admitted{0};
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    for (int it = 0; it < iterations; ++it) {
      std::vector<int32_t> ids;
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int j = 0; j < n; ++j) ids.push_back(static_cast<int32_t>(rng() % E));
      std::shared_ptr<BatchLease> lease;
      try {
        lease = cache.prefetch(ids);
      } catch (const moe::Error&) {
        ++failed;
        continue;
      }
      ++admitted;
      listed += lease->experts().size();
      std::vector<const void*> slots;
      for (int32_t e : lease->experts()) {
        moe::kernels::ExpertWeights w;
        {
          std::lock_guard<std::mutex> lock(compute);
          w = lease->acquire(e);
        }
        ++acquired;
        slots.push_back(w.w1.data);
        if (std::memcmp(w.w1.data, rig.store.expert_data(e), rig.store.expert_bytes(e)) != 0) ++corrupt;
      }
      if (rng() % 4 == 0) std::this_thread::yield();  // let other batches run meanwhile
      // Still pinned: the slots must hold the same experts now.
      for (size_t i = 0; i < slots.size(); ++i)
        if (std::memcmp(slots[i], rig.store.expert_data(lease->experts()[i]), rig.store.max_expert_bytes()) != 0)
          ++corrupt;
      const CacheStats s = cache.stats();
      if (s.resident * cache.slot_bytes() > cache.budget_bytes()) ++over_budget;
      if (it % 25 == 0) cache.check_invariants();
      if (rng() % 2) lease->release();  // else the destructor releases
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, 100u + static_cast<unsigned>(t));
  for (auto& t : pool) t.join();

  EXPECT_EQ(corrupt.load(), 0u);
  EXPECT_EQ(over_budget.load(), 0u);
  const CacheStats s = cache.stats();
  std::cout << "[ stress ] " << s.prefetches << " batches: " << s.hits << " hits, " << s.misses << " misses, "
            << s.evictions << " evictions, " << s.admission_waits << " admission waits, " << s.prefetch_failures
            << " failures, copies hidden/exposed " << s.copies_hidden << "/" << s.copies_exposed << "\n";
  EXPECT_EQ(s.prefetches, static_cast<uint64_t>(admitted.load()));
  EXPECT_EQ(s.prefetch_failures, failed.load());
  EXPECT_EQ(s.hits + s.misses, listed.load());
  EXPECT_EQ(s.acquires, acquired.load());
  EXPECT_EQ(s.bytes_copied, s.misses * cache.slot_bytes());
  EXPECT_EQ(s.resident, s.misses - s.evictions);
  EXPECT_EQ(s.pinned, 0u);
  EXPECT_EQ(s.batches_in_flight, 0u);
  EXPECT_EQ(s.copies_in_flight, 0u);
  EXPECT_LE(s.copies_hidden + s.copies_exposed, s.misses);
  EXPECT_GT(s.evictions, 0u);
  cache.check_invariants();
}

// ---- errors and lifetime -------------------------------------------------------------------------

TEST(ExpertCache, BudgetsTooSmallFailClearly) {
  Rig rig(8, 8, 16);
  ExpertCacheOptions o;
  o.budget_bytes = rig.store.max_expert_bytes() - 1;
  expect_error([&] { ExpertCache(*rig.backend, rig.store, o); },
               {"budget " + std::to_string(o.budget_bytes) + " bytes", "holds no expert",
                std::to_string(rig.store.max_expert_bytes()) + " bytes"});
  ExpertCache cache(*rig.backend, rig.store, rig.slots(2));
  expect_error([&] { cache.prefetch({1, 2, 3}); }, {"one batch needs 3 distinct experts", "holds only 2", "budget"});
  EXPECT_EQ(cache.stats().prefetch_failures, 1u);
  expect_error([&] { cache.prefetch({8}); }, {"expert 8", "[0, 8)"});
}

// A cache on one CPU backend copies from a store staged by another (host memory serves both).
TEST(ExpertCache, CopiesFromAnotherBackendsStaging) {
  Rig rig(8, 8, 16);
  auto other = moe::kernels::make_cpu_backend();
  ExpertCache cache(*other, rig.store, rig.slots(2));
  auto lease = cache.prefetch({3, 5});
  const moe::kernels::ExpertWeights w = lease->acquire(5);
  EXPECT_EQ(std::memcmp(w.w1.data, rig.store.expert_data(5), rig.store.expert_bytes(5)), 0);
}

TEST(ExpertCache, LeaseMisuseFailsClearly) {
  Rig rig(8, 8, 16);
  ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
  auto lease = cache.prefetch({1, 2});
  expect_error([&] { lease->acquire(3); }, {"expert 3 was not prefetched", "1, 2"});
  lease->release();
  expect_error([&] { lease->acquire(1); }, {"released"});
}

TEST(ExpertCache, DefaultBudgetAndHiddenCopies) {
  Rig rig(6, 8, 16);
  ExpertCache cache(*rig.backend, rig.store);  // 85% of the backend's free memory
  EXPECT_GT(cache.budget_bytes(), 0u);
  EXPECT_EQ(cache.num_slots(), 6);  // capped at the number of experts
  auto lease = cache.prefetch({0, 1, 2});
  while (cache.stats().copies_in_flight > 0) std::this_thread::yield();  // the copy queue drains
  for (int32_t e : {0, 1, 2}) EXPECT_TRUE(rig.slot_intact(*lease, e));
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.copies_hidden, 3u);  // complete before acquire: fully overlapped
  EXPECT_EQ(s.copies_exposed, 0u);
  EXPECT_EQ(s.exposed_wait_ns, 0u);
}

TEST(ExpertCache, LeaseMayOutliveTheCacheObject) {
  Rig rig(4, 8, 16);
  auto cache = std::make_unique<ExpertCache>(*rig.backend, rig.store, rig.slots(2));
  auto lease = cache->prefetch({0, 3});
  cache.reset();
  EXPECT_TRUE(rig.slot_intact(*lease, 3));
  lease.reset();  // frees the slots now
}

// ---- the same on a GPU (skipped without one) ----------------------------------------------------

TEST(ExpertCacheOnCuda, CopiesLandIntactAndPinnedExpertsStay) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  for (WeightType type : {WeightType::F16, WeightType::F32}) {
    SCOPED_TRACE(moe::kernels::weight_type_name(type));
    Rig rig(moe::kernels::make_cuda_backend(0), 8, 256, 512, type);  // 0.75 / 1.5 MiB per expert
    ExpertCache cache(*rig.backend, rig.store, rig.slots(4));
    // The scripted LRU sequence of the CPU test: same counts, same residents.
    for (const std::vector<int32_t>& b : std::vector<std::vector<int32_t>>{{0, 1}, {3, 2, 3}, {0}, {4}, {2}, {5, 6}})
      rig.run_batch(cache, b);
    expect_counts(cache.stats(), 2, 7, 3);
    for (int e : {2, 4, 5, 6}) EXPECT_TRUE(cache.is_resident(e)) << e;
    // A batch in flight keeps its experts while another batch cannot be admitted.
    auto a = cache.prefetch({0, 1, 2});
    expect_error([&] { cache.prefetch({3, 7}); }, {"cuda:0", "batches in flight: 1"});
    for (int32_t e : {0, 1, 2}) EXPECT_TRUE(rig.slot_intact(*a, e)) << e;
    a->release();
    // Copies that completed before acquire count as hidden.
    auto c = cache.prefetch({3, 7});
    while (cache.stats().copies_in_flight > 0) std::this_thread::yield();
    for (int32_t e : {3, 7}) EXPECT_TRUE(rig.slot_intact(*c, e)) << e;
    c->release();
    const CacheStats s = cache.stats();
    EXPECT_GE(s.copies_hidden, 2u);
    EXPECT_EQ(s.copies_hidden + s.copies_exposed, s.misses);
    std::cout << "[ cuda ] " << moe::kernels::weight_type_name(type) << ": " << s.misses << " copies, hidden/exposed "
              << s.copies_hidden << "/" << s.copies_exposed << ", host wait " << s.exposed_wait_ns << " ns\n";
    cache.check_invariants();
  }
  // A CUDA cache cannot take host staging that is not page-locked (a CPU backend's).
  Rig host(8, 8, 16);
  auto gpu = moe::kernels::make_cuda_backend(0);
  expect_error([&] { ExpertCache(*gpu, host.store, host.slots(2)); }, {"cuda:0", "cannot copy from asynchronously"});
}
