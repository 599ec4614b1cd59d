// ExpertExecutor on CPU backends whose asynchronous copies run on a worker thread (the GPU code
// path on host memory): output against MoeAdapter::apply_experts, a budget of half the experts
// under skewed routing, prefetch of batch N+1 on another thread while batch N runs, placement
// over two "devices" with different budgets (replicas, oversubscription), errors, and the same on
// CUDA devices when there are any.
#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "moe/error.h"
#include "moe/expert_executor.h"
#include "moe/expert_store.h"
#include "random_moe.h"
#include "test_util.h"

using moe::CacheStats;
using moe::ExpertDeviceStats;
using moe::ExpertExecutor;
using moe::ExpertExecutorOptions;
using moe::MoeAdapter;
using moe::Routing;
using moe::Tensor;
using moe::kernels::WeightType;
using moe::test::expect_error;

namespace {

const MoeAdapter& tiny() {  // hidden 16, 6 experts, top-2, Mixtral routing
  static const MoeAdapter adapter = MoeAdapter::load(moe::test::fixture_path("adapter_tiny"));
  return adapter;
}

std::unique_ptr<moe::kernels::Backend> async_cpu() { return moe::kernels::make_cpu_backend({/*async_copies=*/true}); }

std::vector<std::unique_ptr<moe::kernels::Backend>> cpu_devices(int n) {
  std::vector<std::unique_ptr<moe::kernels::Backend>> v;
  for (int i = 0; i < n; ++i) v.push_back(async_cpu());
  return v;
}

size_t slot_bytes(const moe::MoeConfig& c, WeightType type = WeightType::F32) {
  return moe::HostExpertStore::blob_bytes(type, c.hidden_size, c.intermediate_size);
}

// Explicit budgets of `slots[d]` experts per device (plus half a slot, to show rounding down).
ExpertExecutorOptions budgets(const moe::MoeConfig& c, std::vector<size_t> slots) {
  ExpertExecutorOptions o;
  for (size_t s : slots) o.budget_bytes.push_back(s * slot_bytes(c) + slot_bytes(c) / 2);
  o.admission_wait = std::chrono::milliseconds(120000);  // only ever ends early
  return o;
}

Tensor rows(int64_t n, int64_t d, unsigned seed) { return moe::test::random_tensor(n, d, seed); }

// Routing of `n` rows over `experts` with top-k distinct experts per row drawn from `p`.
Routing skewed_routing(int64_t n, int top_k, const std::vector<double>& p, std::mt19937& rng) {
  Routing r;
  r.rows = n;
  r.top_k = top_k;
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> w(p);
    float sum = 0;
    std::vector<float> ws;
    for (int j = 0; j < top_k; ++j) {
      std::discrete_distribution<int> pick(w.begin(), w.end());
      const int e = pick(rng);
      w[static_cast<size_t>(e)] = 0.0;
      r.expert_ids.push_back(e);
      ws.push_back(u(rng));
      sum += ws.back();
    }
    for (float x : ws) r.weights.push_back(x / sum);
  }
  return r;
}

size_t distinct(const Routing& r) { return std::set<int32_t>(r.expert_ids.begin(), r.expert_ids.end()).size(); }

::testing::AssertionResult close(const Tensor& got, const Tensor& want, double tol) {
  const double err = moe::test::max_abs_error(got, want);
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs error " << err << " > " << tol;
}

// Every identity the cache counters promise, per device; with no batch in flight.
void expect_consistent_and_idle(const ExpertExecutor& ex) {
  for (const ExpertDeviceStats& s : ex.stats()) {
    SCOPED_TRACE(s.device);
    EXPECT_EQ(s.cache.bytes_copied, s.cache.misses * s.slot_bytes);
    EXPECT_EQ(s.cache.resident, s.cache.misses - s.cache.evictions);
    EXPECT_LE(s.cache.resident, static_cast<uint64_t>(s.slots));
    EXPECT_LE(static_cast<size_t>(s.slots) * s.slot_bytes, s.budget_bytes);
    EXPECT_LE(s.cache.copies_hidden + s.cache.copies_exposed, s.cache.misses);
    EXPECT_EQ(s.cache.pinned, 0u);
    EXPECT_EQ(s.cache.batches_in_flight, 0u);
    EXPECT_EQ(s.cache.prefetch_failures, 0u);
  }
}

uint64_t sum(const std::vector<ExpertDeviceStats>& stats, uint64_t CacheStats::*field) {
  uint64_t t = 0;
  for (const ExpertDeviceStats& s : stats) t += s.cache.*field;
  return t;
}

}  // namespace

// ---- one CPU device ----------------------------------------------------------------------------

TEST(ExpertExecutor, EqualsAdapterApplyOnRandomRows) {
  ExpertExecutor ex(tiny().layer(), "cpu");
  ASSERT_EQ(ex.device_names(), std::vector<std::string>{"cpu"});
  unsigned seed = 1;
  for (int64_t n : {1, 5, 17, 64}) {
    for (int k : {1, 2, 3, 6}) {  // the adapter's top-2 and top-k overrides
      SCOPED_TRACE("rows " + std::to_string(n) + ", top-" + std::to_string(k));
      const Tensor x = rows(n, 16, seed++);
      const Routing r = tiny().route(x, k);
      const Tensor want = tiny().apply_experts(x, r);
      EXPECT_TRUE(close(ex.run(x, r, ex.prefetch(r)), want, 1e-5));
      EXPECT_TRUE(close(ex.run(x, r, nullptr), want, 1e-5));  // run() prefetches itself
    }
  }
  const Tensor none = ex.run(Tensor::zeros(moe::DType::F32, {0, 16}), tiny().route(rows(0, 16, 3)), nullptr);
  EXPECT_EQ(none.shape(), (moe::Shape{0, 16}));
  const std::vector<ExpertDeviceStats> st = ex.stats();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].experts, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(st[0].slots, 6);          // the default budget holds every expert
  EXPECT_EQ(st[0].cache.misses, 6u);  // each copied once, then always a hit
  EXPECT_EQ(st[0].cache.evictions, 0u);
  expect_consistent_and_idle(ex);
}

TEST(ExpertExecutor, ReducedPrecisionsStayCloseToF32) {
  const Tensor x = rows(9, 16, 40);
  const Routing r = tiny().route(x);
  const Tensor want = tiny().apply_experts(x, r);
  for (WeightType type : {WeightType::F16, WeightType::BF16}) {
    SCOPED_TRACE(moe::kernels::weight_type_name(type));
    ExpertExecutorOptions o;
    o.precision = type;
    ExpertExecutor ex(tiny().layer(), "cpu", o);
    EXPECT_EQ(ex.precision(), type);
    const Tensor got = ex.run(x, r, ex.prefetch(r));
    EXPECT_TRUE(close(got, want, type == WeightType::F16 ? 5e-3 : 3e-2));
    EXPECT_FALSE(close(got, want, 1e-7));  // the weights really are rounded
  }
}

TEST(ExpertExecutor, CopiesThatCompleteBeforeRunAreHidden) {
  ExpertExecutor ex(tiny().layer(), "cpu");
  const Tensor x = rows(8, 16, 41);
  const Routing r = tiny().route(x);
  std::shared_ptr<void> handle = ex.prefetch(r);
  while (ex.stats()[0].cache.copies_in_flight > 0) std::this_thread::yield();  // the copy queue drains
  EXPECT_TRUE(close(ex.run(x, r, handle), tiny().apply_experts(x, r), 1e-5));
  const CacheStats s = ex.stats()[0].cache;
  EXPECT_EQ(s.misses, distinct(r));
  EXPECT_EQ(s.copies_hidden, s.misses);
  EXPECT_EQ(s.copies_exposed, 0u);
  EXPECT_EQ(s.pinned, 0u);  // run() released the handle's pins
}

// ---- a budget of half the experts -------------------------------------------------------------

TEST(ExpertExecutor, HalfTheExpertsServeSkewedRoutingOverManyBatches) {
  const int E = 16;
  const MoeAdapter adapter(moe::test::random_moe_layer(E, 16, 32, 2, 5));
  ExpertExecutor ex(adapter.layer(), cpu_devices(1), budgets(adapter.layer().config(), {E / 2}));
  ASSERT_EQ(ex.stats()[0].slots, E / 2);
  std::vector<double> zipf(E);
  for (int e = 0; e < E; ++e) zipf[static_cast<size_t>(e)] = 1.0 / std::pow(e + 1.0, 1.2);
  std::mt19937 rng(17);
  uint64_t listed = 0;
  const int batches = 200;
  for (int b = 0; b < batches; ++b) {
    const Routing r = skewed_routing(4, 2, zipf, rng);  // at most 8 distinct experts: fits
    const Tensor x = rows(4, 16, 1000u + static_cast<unsigned>(b));
    listed += distinct(r);
    ASSERT_TRUE(close(ex.run(x, r, ex.prefetch(r)), adapter.apply_experts(x, r), 1e-5)) << "batch " << b;
  }
  const CacheStats s = ex.stats()[0].cache;
  EXPECT_EQ(s.prefetches, static_cast<uint64_t>(batches));
  EXPECT_EQ(s.hits + s.misses, listed);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.hits, s.misses);  // skewed: the hot experts stay
  expect_consistent_and_idle(ex);
}

// ---- prefetch of batch N+1 on the router's thread while batch N runs -------------------------------

TEST(ExpertExecutor, PrefetchAheadOnAnotherThreadWhileBatchesRun) {
  const int E = 16, batches = 120;
  const MoeAdapter adapter(moe::test::random_moe_layer(E, 16, 32, 2, 6));
  // 8 slots; a batch needs at most 6: two batches in flight often do not fit beside each other,
  // so the router has to wait for the expert thread to release (back-pressure, no deadlock).
  ExpertExecutor ex(adapter.layer(), cpu_devices(1), budgets(adapter.layer().config(), {E / 2}));
  std::vector<double> zipf(E);
  for (int e = 0; e < E; ++e) zipf[static_cast<size_t>(e)] = 1.0 / std::pow(e + 1.0, 0.8);

  struct Batch {
    Tensor x;
    Routing r;
    std::shared_ptr<void> handle;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Batch> queue;  // moe-route -> moe-expert, at most 2 batches
  int routed = 0;           // batches prefetched by the router so far
  std::thread router([&] {
    std::mt19937 rng(23);
    for (int b = 0; b < batches; ++b) {
      Batch batch;
      batch.x = rows(3, 16, 2000u + static_cast<unsigned>(b));
      batch.r = skewed_routing(3, 2, zipf, rng);
      batch.handle = ex.prefetch(batch.r);  // may wait for the expert thread to release
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return queue.size() < 2; });
      queue.push_back(std::move(batch));
      ++routed;
      cv.notify_all();
    }
  });
  int overlapped = 0, failures = 0;
  for (int b = 0; b < batches; ++b) {
    Batch batch;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !queue.empty(); });
      batch = std::move(queue.front());
      queue.pop_front();
      cv.notify_all();
    }
    // Run batch b only once the router has prefetched b+1 or is waiting for room: the prefetch of
    // the next batch always overlaps this one.
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (routed > b + 1 || routed == batches) break;
      }
      if (ex.stats()[0].cache.prefetches_waiting > 0) break;
      std::this_thread::yield();
    }
    if (ex.stats()[0].cache.batches_in_flight >= 2) ++overlapped;
    if (!close(ex.run(batch.x, batch.r, batch.handle), adapter.apply_experts(batch.x, batch.r), 1e-5)) ++failures;
  }
  router.join();
  EXPECT_EQ(failures, 0);
  EXPECT_GT(overlapped, 0);
  const CacheStats s = ex.stats()[0].cache;
  EXPECT_EQ(s.prefetches, static_cast<uint64_t>(batches));
  EXPECT_GT(s.evictions, 0u);
  std::cout << "[ prefetch ahead ] " << batches << " batches: " << overlapped << " with the next batch pinned, "
            << s.admission_waits << " router waits, hits/misses " << s.hits << "/" << s.misses
            << ", copies hidden/exposed " << s.copies_hidden << "/" << s.copies_exposed << "\n";
  expect_consistent_and_idle(ex);
}

// ---- placement over two devices ------------------------------------------------------------------

TEST(ExpertExecutor, TwoDevicesWithDifferentBudgetsGiveTheSameOutput) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutor one(tiny().layer(), cpu_devices(1), budgets(c, {6}));
  ExpertExecutor two(tiny().layer(), cpu_devices(2), budgets(c, {4, 2}));
  EXPECT_EQ(two.device_names(), (std::vector<std::string>{"cpu#0", "cpu#1"}));
  // The roomier device serves more experts; every expert is served exactly once.
  const moe::ExpertPlacement placement = two.placement();
  const auto& devs = placement.devices();
  ASSERT_EQ(devs.size(), 2u);
  EXPECT_EQ(devs[0].experts.size(), 4u);
  EXPECT_EQ(devs[1].experts.size(), 2u);
  for (int e = 0; e < 6; ++e) EXPECT_EQ(two.placement().devices_of(e).size(), 1u) << e;
  for (unsigned b = 0; b < 6; ++b) {
    const Tensor x = rows(11, 16, 60 + b);
    const Routing r = tiny().route(x);
    const Tensor got = two.run(x, r, two.prefetch(r));
    EXPECT_TRUE(close(got, tiny().apply_experts(x, r), 1e-5)) << "batch " << b;
    EXPECT_TRUE(close(got, one.run(x, r, nullptr), 1e-6)) << "batch " << b;
  }
  const std::vector<ExpertDeviceStats> st = two.stats();
  EXPECT_EQ(st[0].experts, devs[0].experts);
  EXPECT_GT(st[0].cache.acquires, 0u);  // rows really travelled to both devices
  EXPECT_GT(st[1].cache.acquires, 0u);
  EXPECT_EQ(sum(st, &CacheStats::evictions), 0u);  // both budgets hold their share
  expect_consistent_and_idle(two);

  // A batch whose experts all live on the second device runs there alone (it is the batch's home).
  const std::vector<int>& second = devs[1].experts;
  const Tensor x = rows(5, 16, 90);
  Routing r;
  r.rows = 5;
  r.top_k = 2;
  for (int64_t i = 0; i < 5; ++i) {
    r.expert_ids.insert(r.expert_ids.end(), {second[0], second[1]});
    r.weights.insert(r.weights.end(), {0.6f, 0.4f});
  }
  const uint64_t first_acquires = two.stats()[0].cache.acquires;
  EXPECT_TRUE(close(two.run(x, r, two.prefetch(r)), tiny().apply_experts(x, r), 1e-5));
  EXPECT_EQ(two.stats()[0].cache.acquires, first_acquires);
  expect_consistent_and_idle(two);
}

// Rows routed to fewer experts (unused slots -1, as routing policies leave them) on one and on
// two devices (split batches), and a batch in which no row has an expert.
TEST(ExpertExecutor, UnusedSlotsRunNoExpertOnOneOrTwoDevices) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutor one(tiny().layer(), "cpu");
  ExpertExecutor two(tiny().layer(), cpu_devices(2), budgets(c, {4, 2}));
  for (unsigned b = 0; b < 4; ++b) {
    const Tensor x = rows(13, 16, 110 + b);
    Routing r = tiny().route(x, 3);
    for (size_t i = b; i < r.expert_ids.size(); i += 4) {
      r.expert_ids[i] = Routing::kUnusedSlot;
      r.weights[i] = 0.0f;
    }
    const Tensor want = tiny().apply_experts(x, r);
    EXPECT_TRUE(close(one.run(x, r, one.prefetch(r)), want, 1e-5)) << "batch " << b;
    EXPECT_TRUE(close(two.run(x, r, two.prefetch(r)), want, 1e-5)) << "batch " << b;
  }
  const Tensor x = rows(3, 16, 120);
  Routing none = tiny().route(x, 2);
  std::fill(none.expert_ids.begin(), none.expert_ids.end(), Routing::kUnusedSlot);
  std::fill(none.weights.begin(), none.weights.end(), 0.0f);
  const Tensor want = tiny().apply_experts(x, none);  // the residual alone, normalised
  EXPECT_TRUE(close(one.run(x, none, nullptr), want, 1e-6));
  EXPECT_TRUE(close(two.run(x, none, nullptr), want, 1e-6));
  expect_consistent_and_idle(one);
  expect_consistent_and_idle(two);
}

TEST(ExpertExecutor, HotExpertsAreReplicatedAndShareTheRows) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutorOptions o = budgets(c, {6, 6});
  o.expert_load = {10, 10, 400, 10, 10, 10};  // expert 2 is hot
  ExpertExecutor ex(tiny().layer(), cpu_devices(2), o);
  ASSERT_EQ(ex.placement().devices_of(2).size(), 2u);
  for (int e : {0, 1, 3, 4, 5}) EXPECT_EQ(ex.placement().devices_of(e).size(), 1u) << e;
  // Every row uses expert 2: rows alternate between its two copies.
  const int64_t n = 10;
  const Tensor x = rows(n, 16, 70);
  Routing r;
  r.rows = n;
  r.top_k = 2;
  for (int64_t i = 0; i < n; ++i) {
    r.expert_ids.insert(r.expert_ids.end(), {2, static_cast<int32_t>(i % 6 == 2 ? 3 : i % 6)});
    r.weights.insert(r.weights.end(), {0.7f, 0.3f});
  }
  EXPECT_TRUE(close(ex.run(x, r, ex.prefetch(r)), tiny().apply_experts(x, r), 1e-5));
  const std::vector<ExpertDeviceStats> st = ex.stats();
  for (const ExpertDeviceStats& s : st) EXPECT_GE(s.cache.misses, 1u) << s.device;  // each loaded its copy of 2
  expect_consistent_and_idle(ex);
}

// Load measured while running replicates the hot expert; a batch prefetched before the change
// still runs where its experts were pinned.
TEST(ExpertExecutor, RebalanceReplicatesAHotExpertAtRunTime) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutor ex(tiny().layer(), cpu_devices(2), budgets(c, {6, 6}));
  for (int e = 0; e < 6; ++e) ASSERT_EQ(ex.placement().devices_of(e).size(), 1u) << e;  // no load known yet
  const int64_t n = 12;
  const Tensor x = rows(n, 16, 80);
  Routing r;  // every row uses expert 2
  r.rows = n;
  r.top_k = 2;
  std::vector<int64_t> load(6, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t other = static_cast<int32_t>(i % 6 == 2 ? 3 : i % 6);
    r.expert_ids.insert(r.expert_ids.end(), {2, other});
    r.weights.insert(r.weights.end(), {0.8f, 0.2f});
    ++load[2];
    ++load[static_cast<size_t>(other)];
  }
  std::shared_ptr<void> before = ex.prefetch(r);  // every slot of expert 2 on its one device

  EXPECT_TRUE(ex.rebalance(load));
  EXPECT_EQ(ex.placement_changes(), 1u);
  const moe::ExpertPlacement after = ex.placement();
  ASSERT_EQ(after.devices_of(2).size(), 2u);
  EXPECT_EQ(ex.stats()[0].experts, after.devices()[0].experts);
  EXPECT_FALSE(ex.rebalance(load));  // the same load: nothing to change
  EXPECT_EQ(ex.placement_changes(), 1u);

  const Tensor want = tiny().apply_experts(x, r);
  // Run with the new placement, this batch would look for expert 2 on a device it did not pin.
  EXPECT_TRUE(close(ex.run(x, r, before), want, 1e-5));
  EXPECT_TRUE(close(ex.run(x, r, ex.prefetch(r)), want, 1e-5));  // the new placement: 2 on both devices
  for (const ExpertDeviceStats& s : ex.stats()) EXPECT_GE(s.cache.acquires, 1u) << s.device;
  expect_consistent_and_idle(ex);
  expect_error([&] { ex.rebalance({1, 2}); }, {"2 expert loads", "6 experts"});
}

TEST(ExpertExecutor, RunRebalancesEveryIntervalFromTheRowsItRan) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutorOptions o = budgets(c, {6, 6});
  o.rebalance_interval = 3;
  ExpertExecutor ex(tiny().layer(), cpu_devices(2), o);
  Routing hot;  // expert 4 in every row
  hot.rows = 8;
  hot.top_k = 2;
  for (int64_t i = 0; i < hot.rows; ++i) {
    hot.expert_ids.insert(hot.expert_ids.end(), {4, static_cast<int32_t>(i % 4)});
    hot.weights.insert(hot.weights.end(), {0.5f, 0.5f});
  }
  const Tensor x = rows(hot.rows, 16, 81);
  for (int b = 0; b < 2; ++b) ex.run(x, hot, nullptr);
  EXPECT_EQ(ex.placement_changes(), 0u);  // two batches: the window is not full yet
  EXPECT_EQ(ex.placement().devices_of(4).size(), 1u);
  ex.run(x, hot, nullptr);
  EXPECT_EQ(ex.placement_changes(), 1u);
  EXPECT_EQ(ex.placement().devices_of(4).size(), 2u);
  EXPECT_TRUE(close(ex.run(x, hot, nullptr), tiny().apply_experts(x, hot), 1e-5));
  expect_consistent_and_idle(ex);
  o.rebalance_interval = -1;
  expect_error([&] { ExpertExecutor(tiny().layer(), cpu_devices(2), o); }, {"rebalance interval -1"});
}

TEST(ExpertExecutor, OversubscribedDevicesShareTheExpertsByBudget) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutor ex(tiny().layer(), cpu_devices(2), budgets(c, {3, 2}));  // 5 slots for 6 experts
  const moe::ExpertPlacement placement = ex.placement();
  const auto& devs = placement.devices();
  EXPECT_EQ(devs[0].experts.size() + devs[1].experts.size(), 6u);  // no replicas
  EXPECT_GT(devs[0].experts.size(), devs[1].experts.size());
  std::mt19937 rng(3);
  const std::vector<double> flat(6, 1.0);
  for (unsigned b = 0; b < 60; ++b) {
    const Routing r = skewed_routing(1, 2, flat, rng);  // one row: at most 2 experts per device
    const Tensor x = rows(1, 16, 300 + b);
    ASSERT_TRUE(close(ex.run(x, r, ex.prefetch(r)), tiny().apply_experts(x, r), 1e-5)) << "batch " << b;
  }
  EXPECT_GT(sum(ex.stats(), &CacheStats::evictions), 0u);
  expect_consistent_and_idle(ex);
}

// ---- errors and lifetime -------------------------------------------------------------------------

// Qwen2-MoE's gated shared expert runs on each batch's home device, beside the routed experts.
TEST(ExpertExecutor, QwenSharedExpertEqualsAdapterApply) {
  const MoeAdapter qwen(moe::MoeLayer::load_hf_layer(moe::test::fixture_path("qwen2_moe_tiny"), "model.layers.1.mlp."));
  const moe::MoeConfig& c = qwen.layer().config();
  ASSERT_GT(c.shared_expert_intermediate_size, 0);
  ExpertExecutor one(qwen.layer(), "cpu");
  // The shared expert's copy on each device comes out of that device's budget.
  ExpertExecutorOptions o = budgets(c, {static_cast<size_t>(c.num_experts) - 1, 2});
  const size_t shared_bytes =
      moe::HostExpertStore::blob_bytes(WeightType::F32, c.hidden_size, c.shared_expert_intermediate_size);
  for (size_t& b : o.budget_bytes) b += shared_bytes;
  ExpertExecutor two(qwen.layer(), cpu_devices(2), o);
  EXPECT_EQ(two.stats()[1].slots, 2);
  EXPECT_EQ(two.stats()[1].budget_bytes, o.budget_bytes[1] - shared_bytes);
  for (unsigned b = 0; b < 4; ++b) {
    const Tensor x = rows(9, c.hidden_size, 700 + b);
    const Routing r = qwen.route(x);
    const Tensor want = qwen.apply_experts(x, r);
    EXPECT_TRUE(close(one.run(x, r, one.prefetch(r)), want, 1e-5)) << "batch " << b;
    EXPECT_TRUE(close(two.run(x, r, two.prefetch(r)), want, 1e-5)) << "batch " << b;
  }
  EXPECT_EQ(one.run(Tensor::zeros(moe::DType::F32, {0, c.hidden_size}), qwen.route(rows(0, c.hidden_size, 1)), nullptr)
                .shape(),
            (moe::Shape{0, c.hidden_size}));
  expect_consistent_and_idle(two);
}

TEST(ExpertExecutor, ErrorsNameTheCause) {
  const moe::MoeConfig& c = tiny().layer().config();
  ExpertExecutorOptions tiny_budget;
  tiny_budget.budget_bytes = {slot_bytes(c) - 1};
  expect_error([&] { ExpertExecutor(tiny().layer(), cpu_devices(1), tiny_budget); },
               {"cpu", "holds no expert", std::to_string(slot_bytes(c)) + " bytes"});
  expect_error([&] { ExpertExecutor(tiny().layer(), cpu_devices(2), budgets(c, {6})); },
               {"1 cache budgets for 2 devices"});
  expect_error([&] { ExpertExecutor(tiny().layer(), "gpu"); }, {"device 'gpu'", "unknown device"});
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0)
    for (const char* spec : {"cuda:0", "cuda:0,cuda:1", "all"})
      expect_error([&] { ExpertExecutor(tiny().layer(), spec); },
                   {std::string("'") + spec + "'", "no usable CUDA device", why});

  ExpertExecutor ex(tiny().layer(), cpu_devices(1), budgets(c, {2}));
  ExpertExecutor other(tiny().layer(), "cpu");
  const Tensor x = rows(3, 16, 80);
  const Routing r = tiny().route(x);
  Routing bad = r;
  bad.expert_ids[3] = 9;
  expect_error([&] { ex.prefetch(bad); }, {"row 1", "expert 9", "[0, 6)"});
  expect_error([&] { ex.run(rows(3, 8, 1), r, nullptr); }, {"expected f32[3,16]"});
  expect_error([&] { ex.run(x, r, other.prefetch(r)); }, {"another executor"});
  EXPECT_FALSE(ex.owns(other.prefetch(r)));
  EXPECT_FALSE(ex.owns(std::make_shared<int>(1)));
  // A batch needing more distinct experts than the budget's 2 slots.
  Routing wide = r;
  wide.expert_ids = {0, 1, 2, 3, 4, 5};
  expect_error([&] { ex.prefetch(wide); }, {"needs", "distinct experts", "holds only 2"});
  // A handle serves the routing it was made for, once.
  Routing one_row;
  one_row.rows = 3;
  one_row.top_k = 2;
  one_row.expert_ids = {0, 1, 0, 1, 0, 1};
  one_row.weights = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  std::shared_ptr<void> h = ex.prefetch(one_row);
  Routing other_experts = one_row;
  other_experts.expert_ids[5] = 2;
  expect_error([&] { ex.run(x, other_experts, h); }, {"does not pin expert 2", "another routing"});
  EXPECT_EQ(ex.stats()[0].cache.pinned, 0u);  // a failed run releases the pins too
  std::shared_ptr<void> h2 = ex.prefetch(one_row);
  EXPECT_TRUE(close(ex.run(x, one_row, h2), tiny().apply_experts(x, one_row), 1e-5));
  expect_error([&] { ex.run(x, one_row, h2); }, {"already used"});
}

TEST(ExpertExecutor, HandlesMayOutliveTheExecutor) {
  auto ex = std::make_unique<ExpertExecutor>(tiny().layer(), "cpu");
  const Tensor x = rows(5, 16, 90);
  std::shared_ptr<void> handle = ex->prefetch(tiny().route(x));
  ex.reset();      // e.g. the element stopped while a buffer with a handle was still queued
  handle.reset();  // unpins, then frees the caches, stores and backends
}

// ---- the same on CUDA devices (skipped without one) ----------------------------------------------

TEST(ExpertExecutorOnCuda, EqualsAdapterApplyOnEveryDevice) {
  std::string why;
  const int n = moe::kernels::cuda_device_count(&why);
  if (n == 0) GTEST_SKIP() << why;
  std::vector<std::string> specs = {"cuda:0"};
  if (n > 1) specs.push_back("all");
  for (const std::string& spec : specs)
    for (WeightType type : {WeightType::F32, WeightType::F16}) {
      SCOPED_TRACE(spec + " " + moe::kernels::weight_type_name(type));
      ExpertExecutorOptions o;
      o.precision = type;
      ExpertExecutor ex(tiny().layer(), spec, o);
      for (unsigned b = 0; b < 4; ++b) {
        const Tensor x = rows(33, 16, 100 + b);
        const Routing r = tiny().route(x);
        EXPECT_TRUE(
            close(ex.run(x, r, ex.prefetch(r)), tiny().apply_experts(x, r), type == WeightType::F32 ? 1e-4 : 5e-3));
      }
      expect_consistent_and_idle(ex);
    }
}

TEST(ExpertExecutorOnCuda, QwenSharedExpertEqualsAdapterApply) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  const MoeAdapter qwen(moe::MoeLayer::load_hf_layer(moe::test::fixture_path("qwen2_moe_tiny"), "model.layers.1.mlp."));
  ExpertExecutor ex(qwen.layer(), "cuda:0");
  for (unsigned b = 0; b < 3; ++b) {
    const Tensor x = rows(21, qwen.layer().config().hidden_size, 710 + b);
    const Routing r = qwen.route(x);
    EXPECT_TRUE(close(ex.run(x, r, ex.prefetch(r)), qwen.apply_experts(x, r), 1e-4)) << "batch " << b;
  }
}

// Experts over two CUDA backends (cuda:0 and cuda:1, or two on cuda:0): batches split over both
// travel by peer copies.
TEST(ExpertExecutorOnCuda, TwoDevicesSplitBatchesByPeerCopies) {
  std::string why;
  const int n = moe::kernels::cuda_device_count(&why);
  if (n == 0) GTEST_SKIP() << why;
  const moe::MoeConfig& c = tiny().layer().config();
  std::vector<std::unique_ptr<moe::kernels::Backend>> gpus;
  gpus.push_back(moe::kernels::make_cuda_backend(0));
  gpus.push_back(moe::kernels::make_cuda_backend(n > 1 ? 1 : 0));
  ExpertExecutor ex(tiny().layer(), std::move(gpus), budgets(c, {4, 2}));
  for (unsigned b = 0; b < 6; ++b) {
    const Tensor x = rows(37, 16, 600 + b);
    const Routing r = tiny().route(x);
    EXPECT_TRUE(close(ex.run(x, r, ex.prefetch(r)), tiny().apply_experts(x, r), 1e-4)) << "batch " << b;
  }
  const std::vector<ExpertDeviceStats> st = ex.stats();
  EXPECT_GT(st[0].cache.acquires, 0u);
  EXPECT_GT(st[1].cache.acquires, 0u);
  expect_consistent_and_idle(ex);

  std::vector<std::unique_ptr<moe::kernels::Backend>> mixed;
  mixed.push_back(moe::kernels::make_cuda_backend(0));
  mixed.push_back(async_cpu());
  expect_error(
      [&] {
        ExpertExecutor(tiny().layer(), std::move(mixed), budgets(c, {4, 2}));
      },
      {"cuda:0 and cpu cannot exchange rows"});
}

TEST(ExpertExecutorOnCuda, HalfBudgetWithPrefetchAhead) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  const int E = 16;
  const MoeAdapter adapter(moe::test::random_moe_layer(E, 64, 128, 2, 8));
  ExpertExecutorOptions o = budgets(adapter.layer().config(), {E / 2});
  std::vector<std::unique_ptr<moe::kernels::Backend>> gpu;
  gpu.push_back(moe::kernels::make_cuda_backend(0));
  ExpertExecutor ex(adapter.layer(), std::move(gpu), o);
  std::vector<double> zipf(E);
  for (int e = 0; e < E; ++e) zipf[static_cast<size_t>(e)] = 1.0 / std::pow(e + 1.0, 1.2);
  std::mt19937 rng(29);
  Routing r = skewed_routing(4, 2, zipf, rng);
  Tensor x = rows(4, 64, 500);
  std::shared_ptr<void> h = ex.prefetch(r);
  for (unsigned b = 0; b < 100; ++b) {
    const Routing next_r = skewed_routing(4, 2, zipf, rng);
    const Tensor next_x = rows(4, 64, 501 + b);
    std::shared_ptr<void> next_h;
    if (distinct(r) + distinct(next_r) <= static_cast<size_t>(E / 2)) next_h = ex.prefetch(next_r);  // fits beside
    ASSERT_TRUE(close(ex.run(x, r, h), adapter.apply_experts(x, r), 1e-4)) << "batch " << b;
    r = next_r;
    x = next_x;
    h = next_h;
  }
  const CacheStats s = ex.stats()[0].cache;
  std::cout << "[ cuda ] hits/misses " << s.hits << "/" << s.misses << ", evictions " << s.evictions
            << ", copies hidden/exposed " << s.copies_hidden << "/" << s.copies_exposed << "\n";
  EXPECT_GT(s.evictions, 0u);
}
