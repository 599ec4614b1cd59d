// Expert parallelism: the in-process transport (N threads = N ranks) and ExpertParallelMoe on
// CPU backends against the single-process MoeLayer::run_experts; the NCCL transport where built.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <thread>

#include "moe/error.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"
#include "moe/expert_transport.h"
#include "moe_build_config.h"
#include "random_moe.h"
#include "test_util.h"

using moe::ExpertParallelMoe;
using moe::ExpertTransport;
using moe::HostExpertStore;
using moe::MoeLayer;
using moe::Tensor;
using moe::kernels::WeightType;
using moe::test::expect_error;
using moe::test::max_abs_error;

namespace {

// Runs fn(rank) on one thread per rank; failures inside are reported by gtest per thread.
void on_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Rows [begin, end) of a routing.
moe::Routing slice(const moe::Routing& r, int64_t begin, int64_t end) {
  moe::Routing s;
  s.rows = end - begin;
  s.top_k = r.top_k;
  s.expert_ids.assign(r.expert_ids.begin() + begin * r.top_k, r.expert_ids.begin() + end * r.top_k);
  s.weights.assign(r.weights.begin() + begin * r.top_k, r.weights.begin() + end * r.top_k);
  return s;
}

// Every rank holds `rows[r]` rows of one batch; each runs ExpertParallelMoe with `owner` and
// must reproduce run_experts on its rows.
// unused_stride > 0: every unused_stride-th slot is unused (-1, weight 0), as routing policies
// leave them.
void check_expert_parallel(const MoeLayer& layer, const std::vector<int>& owner, const std::vector<int64_t>& rows,
                           unsigned seed, size_t unused_stride = 0) {
  const int world = static_cast<int>(rows.size());
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  const Tensor x = moe::test::random_tensor(total, layer.config().hidden_size, seed);
  moe::Routing routing = layer.route(x);
  for (size_t i = 0; unused_stride > 0 && i < routing.expert_ids.size(); i += unused_stride) {
    routing.expert_ids[i] = moe::Routing::kUnusedSlot;
    routing.weights[i] = 0.0f;
  }
  const Tensor expected = layer.run_experts(x, routing);
  auto transports = moe::make_in_process_transports(world);
  on_ranks(world, [&](int r) {
    const int64_t begin = std::accumulate(rows.begin(), rows.begin() + r, int64_t{0});
    const int64_t end = begin + rows[static_cast<size_t>(r)];
    auto backend = moe::kernels::make_cpu_backend();
    const HostExpertStore store = HostExpertStore::from_layer(*backend, layer, WeightType::F32);
    ExpertParallelMoe ep(*transports[static_cast<size_t>(r)], *backend, layer.config(), owner);
    int calls = 0;
    const Tensor y = ep.forward_host(x.slice_rows(begin, end), slice(routing, begin, end), [&](int32_t e) {
      ++calls;
      EXPECT_EQ(owner[static_cast<size_t>(e)], r) << "rank " << r << " asked for expert " << e;
      return store.host_weights(e);
    });
    EXPECT_LE(calls, static_cast<int>(ep.local_experts().size()));
    EXPECT_LT(max_abs_error(y, expected.slice_rows(begin, end)), 1e-5) << "rank " << r << " of " << world;
  });
}

}  // namespace

TEST(InProcessTransport, ExchangesCountsAndRows) {
  const int world = 3;
  auto transports = moe::make_in_process_transports(world);
  on_ranks(world, [&](int r) {
    ExpertTransport& t = *transports[static_cast<size_t>(r)];
    EXPECT_EQ(t.rank(), r);
    EXPECT_EQ(t.world_size(), world);
    // Rank r sends (r + p) rows to rank p, two counts per destination: (r + p, 10·r + p).
    std::vector<int64_t> counts;
    for (int p = 0; p < world; ++p) {
      counts.push_back(r + p);
      counts.push_back(10 * r + p);
    }
    const std::vector<int64_t> got = t.exchange_counts(counts, 2);
    for (int p = 0; p < world; ++p) {
      EXPECT_EQ(got[static_cast<size_t>(2 * p)], p + r);
      EXPECT_EQ(got[static_cast<size_t>(2 * p + 1)], 10 * p + r);
    }
    const int64_t cols = 3;
    std::vector<int64_t> send_counts, recv_counts;
    std::vector<float> send;
    for (int p = 0; p < world; ++p) {
      send_counts.push_back(r + p);
      recv_counts.push_back(p + r);
      for (int i = 0; i < r + p; ++i)
        for (int c = 0; c < cols; ++c) send.push_back(static_cast<float>(1000 * r + 100 * p + 10 * i + c));
    }
    std::vector<float> recv(
        static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) * cols));
    t.all_to_all(send.data(), send_counts, recv.data(), recv_counts, cols);
    size_t k = 0;
    for (int p = 0; p < world; ++p)
      for (int i = 0; i < p + r; ++i)
        for (int c = 0; c < cols; ++c) EXPECT_EQ(recv[k++], static_cast<float>(1000 * p + 100 * r + 10 * i + c));
  });
}

TEST(InProcessTransport, AFailingRankFailsTheOthersInsteadOfHanging) {
  auto transports = moe::make_in_process_transports(2);
  on_ranks(2, [&](int r) {
    ExpertTransport& t = *transports[static_cast<size_t>(r)];
    float buf[4] = {0, 0, 0, 0};
    // Rank 1 expects 2 rows from rank 0, which sends 1.
    const std::vector<int64_t> send = r == 0 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{0, 0};
    const std::vector<int64_t> recv = r == 1 ? std::vector<int64_t>{2, 0} : std::vector<int64_t>{0, 0};
    EXPECT_THROW(t.all_to_all(buf, send, buf, recv, 1), moe::Error) << "rank " << r;
    // The group stays failed.
    EXPECT_THROW(t.exchange_counts({0, 0}), moe::Error) << "rank " << r;
  });
}

TEST(CollectiveWait, ReturnsOnCompletionPropagatesFailuresAndTimesOut) {
  moe::CollectiveWait wait;
  wait.timeout = std::chrono::milliseconds(50);
  wait.poll_interval = std::chrono::microseconds(10);
  int polls = 0;
  moe::wait_for_collective(wait, "done on the third poll", [&] { return ++polls == 3; });
  EXPECT_EQ(polls, 3);
  expect_error([&] { moe::wait_for_collective(wait, "fails", [&]() -> bool { throw moe::Error("peer error"); }); },
               {"peer error"});
  expect_error([&] { moe::wait_for_collective(wait, "all_to_all", [] { return false; }); },
               {"all_to_all: not complete after 50 ms", "a peer rank failed, hung"});
}

TEST(InProcessTransport, ARankThatNeverComesTimesOutAndFailsTheGroup) {
  moe::CollectiveWait wait;
  wait.timeout = std::chrono::milliseconds(100);
  auto transports = moe::make_in_process_transports(2, wait);
  // Rank 1 hangs before the collective: rank 0 gives up after the timeout and aborts the group.
  expect_error(
      [&] {
        transports[0]->exchange_counts({1, 2});
      },
      {"in-process transport (rank 0): barrier: not complete after 100 ms"});
  // When rank 1 comes, it learns why instead of waiting for rank 0.
  expect_error(
      [&] {
        transports[1]->exchange_counts({3, 4});
      },
      {"the group failed", "rank 0", "not complete after 100 ms"});
}

TEST(ExpertParallelMoe, MatchesRunExpertsOnTwoToFourRanks) {
  const MoeLayer layer = moe::test::random_moe_layer(8, 32, 48, 2, 21);
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<int64_t> rows;
    for (int r = 0; r < world; ++r) rows.push_back(r == 1 ? 0 : 5 + 7 * r);  // rank 1 brings no rows
    check_expert_parallel(layer, ExpertParallelMoe::block_owners(8, world), rows, 40u + static_cast<unsigned>(world));
    // Experts scattered over the ranks instead of in blocks.
    std::vector<int> scattered;
    for (int e = 0; e < 8; ++e) scattered.push_back((e * 3 + 1) % world);
    check_expert_parallel(layer, scattered, rows, 50u + static_cast<unsigned>(world));
  }
}

TEST(ExpertParallelMoe, UnusedSlotsTravelNowhere) {
  const MoeLayer layer = moe::test::random_moe_layer(8, 32, 48, 2, 23);
  check_expert_parallel(layer, ExpertParallelMoe::block_owners(8, 3), {6, 0, 9}, 61, 3);
  check_expert_parallel(layer, ExpertParallelMoe::block_owners(8, 2), {4, 5}, 62, 1);  // no slot used at all
}

TEST(ExpertParallelMoe, RanksWithoutExpertsAndTopKOfAll) {
  // 3 experts on 4 ranks: rank 3 owns none; top_k = 3 sends every row to every owner.
  const MoeLayer layer = moe::test::random_moe_layer(3, 16, 24, 3, 8);
  check_expert_parallel(layer, ExpertParallelMoe::block_owners(3, 4), {4, 9, 1, 6}, 9);
  const MoeLayer mixtral =
      MoeLayer::load_hf_layer(moe::test::fixture_path("mixtral_tiny"), "model.layers.1.block_sparse_moe.");
  check_expert_parallel(mixtral, ExpertParallelMoe::block_owners(6, 2), {17, 11}, 10);
}

TEST(ExpertParallelMoe, LocalExpertsCanComeFromAnExpertCache) {
  // Each rank keeps its experts in an ExpertCache on an asynchronous CPU backend.
  const MoeLayer layer = moe::test::random_moe_layer(8, 32, 48, 2, 77);
  const int world = 2;
  const std::vector<int> owner = ExpertParallelMoe::block_owners(8, world);
  const Tensor x = moe::test::random_tensor(24, 32, 78);
  const moe::Routing routing = layer.route(x);
  const Tensor expected = layer.run_experts(x, routing);
  auto transports = moe::make_in_process_transports(world);
  on_ranks(world, [&](int r) {
    auto backend = moe::kernels::make_cpu_backend({/*async_copies=*/true});
    const HostExpertStore store = HostExpertStore::from_layer(*backend, layer, WeightType::F32);
    moe::ExpertCacheOptions o;
    o.budget_bytes = 4 * store.max_expert_bytes();
    moe::ExpertCache cache(*backend, store, o);
    ExpertParallelMoe ep(*transports[static_cast<size_t>(r)], *backend, layer.config(), owner);
    auto lease = cache.prefetch(ep.local_experts());
    const Tensor y = ep.forward_host(x.slice_rows(12 * r, 12 * r + 12), slice(routing, 12 * r, 12 * r + 12),
                                     [&](int32_t e) { return lease->acquire(e); });
    lease->release();
    EXPECT_LT(max_abs_error(y, expected.slice_rows(12 * r, 12 * r + 12)), 1e-5) << "rank " << r;
    EXPECT_EQ(cache.stats().misses, 4u);
  });
}

TEST(ExpertParallelMoe, AFailureOnOneRankFailsEveryRank) {
  // Rank 0 fails between the two all-to-alls (its weights are missing); rank 1 waits for its
  // results in the second one and must get an error, not hang.
  const MoeLayer layer = moe::test::random_moe_layer(4, 8, 8, 2, 5);
  const Tensor x = moe::test::random_tensor(6, 8, 6);
  const moe::Routing routing = layer.route(x);
  auto transports = moe::make_in_process_transports(2);
  on_ranks(2, [&](int r) {
    auto backend = moe::kernels::make_cpu_backend();
    const HostExpertStore store = HostExpertStore::from_layer(*backend, layer, WeightType::F32);
    ExpertParallelMoe ep(*transports[static_cast<size_t>(r)], *backend, layer.config(),
                         ExpertParallelMoe::block_owners(4, 2));
    try {
      ep.forward_host(x.slice_rows(3 * r, 3 * r + 3), slice(routing, 3 * r, 3 * r + 3), [&](int32_t e) {
        if (r == 0) throw moe::Error("weights of expert " + std::to_string(e) + " are missing");
        return store.host_weights(e);
      });
      ADD_FAILURE() << "rank " << r << " finished";
    } catch (const moe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("are missing"), std::string::npos) << "rank " << r << ": " << e.what();
    }
  });
}

TEST(ExpertParallelMoe, RejectsBadOwners) {
  const MoeLayer layer = moe::test::random_moe_layer(4, 8, 8, 2, 1);
  auto transports = moe::make_in_process_transports(2);
  auto backend = moe::kernels::make_cpu_backend();
  expect_error(
      [&] {
        ExpertParallelMoe(*transports[0], *backend, layer.config(), {0, 1, 2, 0});
      },
      {"expert 2 owned by rank 2", "[0, 2)"});
  expect_error(
      [&] {
        ExpertParallelMoe(*transports[0], *backend, layer.config(), {0, 1});
      },
      {"2 owners for 4 experts"});
}

TEST(NcclTransport, SingleRankRoundTripOnTheGpu) {
#if !MOE_HAVE_NCCL
  expect_error([] { moe::make_nccl_transport(0, 1, moe::NcclUniqueId{}, 0); }, {"built without CUDA/NCCL"});
  GTEST_SKIP() << "built without NCCL: only the error path is tested";
#else
  std::string why;
  if (moe::kernels::cuda_device_count(&why) < 1) GTEST_SKIP() << "no CUDA device: " << why;
  auto backend = moe::kernels::make_cuda_backend(0);
  auto t = moe::make_nccl_transport(0, 1, moe::nccl_unique_id(), 0);
  EXPECT_EQ(t->world_size(), 1);
  EXPECT_EQ(t->exchange_counts({7, 3}, 2), (std::vector<int64_t>{7, 3}));
  std::vector<float> host(5 * 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  void* send = backend->allocate(host.size() * sizeof(float));
  void* recv = backend->allocate(host.size() * sizeof(float));
  backend->copy_from_host(send, host.data(), host.size() * sizeof(float));
  backend->synchronize();
  t->all_to_all(static_cast<float*>(send), {5}, static_cast<float*>(recv), {5}, 4);
  std::vector<float> back(host.size());
  backend->copy_to_host(back.data(), recv, back.size() * sizeof(float));
  EXPECT_EQ(back, host);
  backend->deallocate(send);
  backend->deallocate(recv);
  // After an abort the transport refuses collectives, and is destroyed by abort, not destroy
  // (which can hang after a failure).
  t->abort("a peer failed");
  expect_error([&] { t->exchange_counts({1}); }, {"NCCL transport (rank 0)", "aborted: a peer failed"});
#endif
}

TEST(ExpertParallelMoeOnCuda, SingleRankOverNcclWithACacheMatchesRunExperts) {
#if !MOE_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  std::string why;
  if (moe::kernels::cuda_device_count(&why) < 1) GTEST_SKIP() << "no CUDA device: " << why;
  const MoeLayer layer = moe::test::random_moe_layer(8, 64, 96, 2, 31);
  const Tensor x = moe::test::random_tensor(40, 64, 32);
  const moe::Routing routing = layer.route(x);
  const Tensor expected = layer.run_experts(x, routing);
  auto backend = moe::kernels::make_cuda_backend(0);
  const HostExpertStore store = HostExpertStore::from_layer(*backend, layer, WeightType::F32);
  moe::ExpertCache cache(*backend, store);
  auto transport = moe::make_nccl_transport(0, 1, moe::nccl_unique_id(), 0);
  ExpertParallelMoe ep(*transport, *backend, layer.config(), ExpertParallelMoe::block_owners(8, 1));
  auto lease = cache.prefetch(ep.local_experts());
  const Tensor y = ep.forward_host(x, routing, [&](int32_t e) { return lease->acquire(e); });
  lease->release();  // forward_host copied y to the host: the GPU is done with the weights
  EXPECT_LT(moe::test::max_rel_error(y, expected), 1e-4);  // fp32 on the GPU, other summation order
#endif
}
