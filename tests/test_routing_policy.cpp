// Routing policies (moe/routing_policy.h): each definition pinned on small hand-computed cases,
// and the plain top-k against the layer's own routing on the backend.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "moe/error.h"
#include "moe/routing_policy.h"
#include "random_moe.h"
#include "test_util.h"

using moe::CapacityOverflow;
using moe::ExpertSelection;
using moe::LoadBalance;
using moe::Router;
using moe::Routing;
using moe::RoutingPolicy;

namespace {

// Logits whose softmax is proportional to `weights` (log of each).
std::vector<float> logits_for(std::initializer_list<std::initializer_list<float>> rows) {
  std::vector<float> out;
  for (const auto& row : rows)
    for (float w : row) out.push_back(std::log(w));
  return out;
}

std::vector<int32_t> ids(const Routing& r, int64_t row) {
  return {r.expert_ids.begin() + row * r.top_k, r.expert_ids.begin() + (row + 1) * r.top_k};
}

std::vector<float> weights(const Routing& r, int64_t row) {
  return {r.weights.begin() + row * r.top_k, r.weights.begin() + (row + 1) * r.top_k};
}

void expect_weights(const Routing& r, int64_t row, std::vector<float> expected) {
  const auto got = weights(r, row);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t j = 0; j < got.size(); ++j) EXPECT_NEAR(got[j], expected[j], 1e-6) << "row " << row << " slot " << j;
}

}  // namespace

TEST(RoutingPolicy, TopKRenormalisesOverTheChosenExperts) {
  RoutingPolicy policy;  // top-2, renormalised (Mixtral)
  Router router(3, policy);
  const auto logits = logits_for({{1, 2, 4}});
  const Routing r = router.route(logits.data(), 1);
  EXPECT_EQ(r.top_k, 2);
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{2, 1}));
  expect_weights(r, 0, {4.0f / 6, 2.0f / 6});

  policy.renormalize = false;  // Qwen2-MoE without norm_topk_prob
  Router qwen(3, policy);
  expect_weights(qwen.route(logits.data(), 1), 0, {4.0f / 7, 2.0f / 7});
}

TEST(RoutingPolicy, TemperatureDividesTheLogits) {
  RoutingPolicy policy;
  policy.temperature = 2.0;
  policy.renormalize = false;
  Router router(3, policy);
  // softmax([0, ln 4, ln 16] / 2) = [1, 2, 4] / 7
  const std::vector<float> logits = {0.0f, std::log(4.0f), std::log(16.0f)};
  const Routing r = router.route(logits.data(), 1);
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{2, 1}));
  expect_weights(r, 0, {4.0f / 7, 2.0f / 7});
}

TEST(RoutingPolicy, TopPTakesTheSmallestSetReachingPWithinMinKAndMaxK) {
  RoutingPolicy policy;
  policy.selection = ExpertSelection::TopP;
  policy.min_k = 1;
  policy.max_k = 3;
  const auto logits = logits_for({{4, 2, 1, 0.5}, {1, 1, 1, 1}});
  auto route = [&](double p) {
    policy.top_p = p;
    return Router(4, policy).route(logits.data(), 2);
  };
  // Row 0: probabilities 8/15, 4/15, 2/15, 1/15.
  Routing r = route(0.5);
  EXPECT_EQ(r.top_k, 3);  // max-k slots per row
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{0, -1, -1}));
  expect_weights(r, 0, {1.0f, 0.0f, 0.0f});
  EXPECT_EQ(ids(r, 1), (std::vector<int32_t>{0, 1, -1}));  // 1/4 + 1/4 reaches 0.5; ties to the lower id
  r = route(0.8);
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{0, 1, -1}));  // 12/15 = 0.8
  expect_weights(r, 0, {2.0f / 3, 1.0f / 3, 0.0f});
  EXPECT_EQ(ids(r, 1), (std::vector<int32_t>{0, 1, 2}));  // needs 4, clamped to max-k 3
  policy.min_k = 2;
  r = route(0.1);
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{0, 1, -1}));  // 1 would do; min-k 2
}

TEST(RoutingPolicy, CapacityKeepsTheMostProbableRowsAndReroutesOrDropsTheRest) {
  RoutingPolicy policy;
  policy.top_k = 1;
  policy.capacity_factor = 1.0;  // 4 rows x 1 slot over 2 experts: 2 slots per expert
  policy.renormalize = false;
  // Every row prefers expert 0; by probability the rows rank 2, 0, 3, 1.
  const auto logits = logits_for({{0.8f, 0.2f}, {0.6f, 0.4f}, {0.9f, 0.1f}, {0.7f, 0.3f}});
  Router reroute(2, policy);
  Routing r = reroute.route(logits.data(), 4);
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, 1, 0, 1}));
  expect_weights(r, 1, {0.4f});  // its true probability for expert 1
  expect_weights(r, 3, {0.3f});
  EXPECT_EQ(reroute.load().overflowed, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(reroute.load().slots, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(reroute.load().dropped, 0);

  policy.overflow = CapacityOverflow::Drop;
  Router drop(2, policy);
  r = drop.route(logits.data(), 4);
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, -1, 0, -1}));
  expect_weights(r, 1, {0.0f});
  EXPECT_EQ(drop.load().dropped, 2);
  EXPECT_EQ(drop.load().overflowed, (std::vector<int64_t>{2, 0}));
}

TEST(RoutingPolicy, CapacityPlacesEveryFirstChoiceBeforeAnySecondChoice) {
  RoutingPolicy policy;  // top-2 over 2 experts, C 0.5: ceil(0.5 * 4 / 2) = 1 slot per expert
  policy.capacity_factor = 0.5;
  policy.overflow = CapacityOverflow::Drop;
  const auto logits = logits_for({{0.9f, 0.1f}, {0.3f, 0.7f}});
  Router router(2, policy);
  const Routing r = router.route(logits.data(), 2);
  // Row 0's second choice (expert 1) would have come before row 1's first choice (expert 1) by
  // arrival order; by rank, row 1's first choice wins.
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(ids(r, 1), (std::vector<int32_t>{1, -1}));
  expect_weights(r, 0, {1.0f, 0.0f});  // renormalised over what was kept
}

TEST(RoutingPolicy, BiasSteersSelectionButNotTheWeights) {
  RoutingPolicy policy;
  policy.top_k = 1;
  policy.balance = LoadBalance::Bias;
  policy.balance_rate = 0.25;
  policy.balance_margin = 1.0;  // DeepSeek-V3's rule: the bias may reorder any expert
  policy.renormalize = false;
  Router router(2, policy);
  const auto logits = logits_for({{0.6f, 0.4f}});
  Routing r = router.route(logits.data(), 1);
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0}));
  EXPECT_EQ(router.bias(), (std::vector<float>{-0.25f, 0.25f}));  // expert 0 above the mean load
  r = router.route(logits.data(), 1);                             // scores 0.35 vs 0.65: expert 1 selected
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{1}));
  expect_weights(r, 0, {0.4f});  // its unbiased probability
  EXPECT_EQ(router.bias(), (std::vector<float>{0.0f, 0.0f}));
  router.reset();
  EXPECT_EQ(router.bias(), (std::vector<float>{0.0f, 0.0f}));
  EXPECT_EQ(router.load().batches, 0);
}

// balance-margin: the bias reorders only experts within the margin of the row's k-th probability.
TEST(RoutingPolicy, BiasReordersOnlyExpertsWithinTheMargin) {
  RoutingPolicy policy;
  policy.top_k = 1;
  policy.balance = LoadBalance::Bias;
  policy.balance_rate = 0.25;
  const auto logits = logits_for({{0.6f, 0.4f}});
  for (double margin : {0.1, 0.25}) {
    policy.balance_margin = margin;
    Router router(2, policy);
    router.route(logits.data(), 1);              // bias -0.25 / +0.25: expert 1 scores higher from now on
    const int32_t want = margin >= 0.2 ? 1 : 0;  // 0.4 is within 0.25 of 0.6, not within 0.1
    EXPECT_EQ(router.route(logits.data(), 1).expert_ids, (std::vector<int32_t>{want})) << "margin " << margin;
  }
  policy.balance_margin = 1.5;
  moe::test::expect_error([&] { Router router(2, policy); }, {"balance-margin", "outside [0, 1]"});
}

TEST(RoutingPolicy, ExplorationGivesTheLastSlotToTheLeastUsedExpert) {
  RoutingPolicy policy;  // top-2 over 4 experts
  policy.explore = 1.0;
  policy.renormalize = false;
  Router router(4, policy);
  const auto logits = logits_for({{0.4f, 0.3f, 0.2f, 0.1f}, {0.4f, 0.3f, 0.2f, 0.1f}});
  const Routing r = router.route(logits.data(), 2);
  // Nothing used yet: row 0's last slot goes to expert 2 (lowest id not in {0, 1}); row 1's to
  // expert 3, which is then less used than 2.
  EXPECT_EQ(ids(r, 0), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(ids(r, 1), (std::vector<int32_t>{0, 3}));
  expect_weights(r, 0, {0.4f, 0.2f});
  EXPECT_EQ(router.load().explored, (std::vector<int64_t>{0, 0, 1, 1}));

  policy.top_k = 1;  // one slot and no room for a second: never explored
  Router single(4, policy);
  EXPECT_EQ(single.route(logits.data(), 2).expert_ids, (std::vector<int32_t>{0, 0}));
}

TEST(RoutingPolicy, ExplorationIsDeterministicForASeedAndRestartsOnReset) {
  RoutingPolicy policy;
  policy.explore = 0.3;
  policy.seed = 7;
  std::vector<float> logits(64 * 8);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 0.37f);
  Router a(8, policy), b(8, policy);
  const Routing first = a.route(logits.data(), 64);
  EXPECT_EQ(first.expert_ids, b.route(logits.data(), 64).expert_ids);
  EXPECT_GT(std::accumulate(a.load().explored.begin(), a.load().explored.end(), int64_t{0}), 0);
  a.route(logits.data(), 64);
  a.reset();
  EXPECT_EQ(a.route(logits.data(), 64).expert_ids, first.expert_ids);
}

TEST(RoutingPolicy, PlainTopKMatchesTheLayersRouting) {
  const auto layer = moe::test::random_moe_layer(4, 16, 32, 2, 5);
  const moe::Tensor x = moe::test::random_tensor(32, 16, 9);
  const moe::Tensor logits = layer.router_logits(x);
  RoutingPolicy policy;
  policy.top_k = 2;
  ASSERT_TRUE(policy.is_plain_top_k());
  Router router(4, policy);
  const Routing mine = router.route(logits.data<float>(), 32);
  const Routing theirs = layer.route(x);
  EXPECT_EQ(mine.expert_ids, theirs.expert_ids);
  for (size_t i = 0; i < mine.weights.size(); ++i) EXPECT_NEAR(mine.weights[i], theirs.weights[i], 1e-6);
  policy.temperature = 0.5;
  EXPECT_FALSE(policy.is_plain_top_k());
}

TEST(RoutingPolicy, RefusesValuesOutOfRangeNamingThem) {
  auto refused = [](const RoutingPolicy& p, const std::string& what) {
    moe::test::expect_error([&] { Router router(4, p); }, {"routing policy", what});
  };
  RoutingPolicy p;
  p.top_k = 5;
  refused(p, "top-k 5 outside [1, 4]");
  p = {};
  p.selection = ExpertSelection::TopP;
  p.top_p = 0.0;
  refused(p, "top-p");
  p.top_p = 0.5;
  p.max_k = 5;
  refused(p, "max-k 5");
  p = {};
  p.temperature = 0.0;
  refused(p, "temperature");
  p = {};
  p.capacity_factor = -1;
  refused(p, "capacity-factor");
  p = {};
  p.explore = 1.5;
  refused(p, "explore");
  moe::test::expect_error([] { moe::parse_expert_selection("top-q"); }, {"top-q", "top-k or top-p"});
}

TEST(RoutingPolicy, LoadCoefficientOfVariation) {
  moe::ExpertLoad load;
  EXPECT_EQ(load.coefficient_of_variation(), 0.0);
  load.slots = {10, 10, 10, 10};
  EXPECT_EQ(load.coefficient_of_variation(), 0.0);
  load.slots = {30, 10, 10, 10};  // mean 15, sd sqrt((225 + 3 * 25) / 4) = sqrt(75)
  EXPECT_NEAR(load.coefficient_of_variation(), std::sqrt(75.0) / 15.0, 1e-12);
}

// Unused slots (-1) run no expert: the same output as those slots given any expert with weight 0,
// and as the per-row reference.
TEST(RoutingPolicy, UnusedSlotsRunNoExpert) {
  const auto layer = moe::test::random_moe_layer(4, 16, 24, 2, 21);
  const moe::Tensor x = moe::test::random_tensor(6, 16, 22);
  Routing r;
  r.rows = 6;
  r.top_k = 3;
  r.expert_ids = {0, 2, -1, 1, -1, -1, 3, 0, 1, -1, -1, -1, 2, 3, -1, 1, 0, 2};
  r.weights = {0.6f, 0.4f, 0, 1, 0, 0, 0.5f, 0.3f, 0.2f, 0, 0, 0, 0.7f, 0.3f, 0, 0.2f, 0.3f, 0.5f};
  Routing padded = r;
  for (size_t i = 0; i < padded.expert_ids.size(); ++i)
    if (padded.expert_ids[i] == Routing::kUnusedSlot) padded.expert_ids[i] = 1;  // weight 0 there
  const moe::Tensor got = layer.run_experts(x, r);
  EXPECT_LT(moe::test::max_abs_error(got, layer.run_experts(x, padded)), 1e-6);
  EXPECT_LT(moe::test::max_abs_error(got, layer.run_experts_reference(x, r)), 1e-5);
  for (int64_t d = 0; d < 16; ++d) EXPECT_EQ(got.data<float>()[3 * 16 + d], 0.0f) << "row 3 has no expert";
  r.expert_ids[2] = -2;
  moe::test::expect_error([&] { layer.run_experts(x, r); }, {"expert id -2"});
}

// The meter's rate is an exponentially decaying count: a batch adds slots / tau, then it decays
// with time constant tau; shares and peaks count every slot routed.
TEST(ExpertLoadMeter, RatesDecayAndSharesAndPeaksCount) {
  moe::ExpertLoadMeter meter(3, 10.0);
  Routing r;
  r.rows = 2;
  r.top_k = 2;
  r.expert_ids = {0, 1, 0, -1};
  r.weights = {0.5f, 0.5f, 1, 0};
  meter.add(r, 100.0);
  std::vector<double> rates = meter.rates(100.0);
  EXPECT_NEAR(rates[0], 0.2, 1e-12);  // 2 slots / 10 s
  EXPECT_NEAR(rates[1], 0.1, 1e-12);
  EXPECT_EQ(rates[2], 0.0);
  rates = meter.rates(110.0);  // one time constant later
  EXPECT_NEAR(rates[0], 0.2 * std::exp(-1.0), 1e-12);
  r.expert_ids = {2, 2, 2, 2};
  meter.add(r, 110.0);
  rates = meter.rates(110.0);
  EXPECT_NEAR(rates[0], 0.2 * std::exp(-1.0), 1e-12);
  EXPECT_NEAR(rates[2], 0.4, 1e-12);
  EXPECT_EQ(meter.peak(), (std::vector<int64_t>{2, 1, 4}));
  const std::vector<double> shares = meter.shares();
  EXPECT_NEAR(shares[0], 2.0 / 7, 1e-12);
  EXPECT_NEAR(shares[2], 4.0 / 7, 1e-12);
}

// A -inf logit marks an expert the row may not use (MoeLayer's masked joint experts): rows whose
// logits end in -inf route exactly, bit for bit, as the same rows without those experts, under
// every policy, batch after batch (the balancing bias and the load of the others included), and
// the masked experts are never selected, explored or rerouted to.
TEST(RoutingPolicy, MinusInfinityExpertsAreIneligible) {
  constexpr int kExperts = 5, kMasked = 2, kRows = 40;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const auto policy_with = [](const std::function<void(RoutingPolicy&)>& edit) {
    RoutingPolicy p;
    edit(p);
    return p;
  };
  const std::vector<std::pair<const char*, RoutingPolicy>> policies = {
      {"top-k", policy_with([](RoutingPolicy&) {})},
      {"top-k unnormalised", policy_with([](RoutingPolicy& p) { p.renormalize = false; })},
      {"temperature", policy_with([](RoutingPolicy& p) { p.temperature = 2.5; })},
      {"top-p", policy_with([](RoutingPolicy& p) {
         p.selection = ExpertSelection::TopP;
         p.top_p = 0.999;
         p.min_k = 1;
         p.max_k = 5;
       })},
      {"capacity reroute", policy_with([](RoutingPolicy& p) { p.capacity_factor = 1.0; })},
      {"capacity drop", policy_with([](RoutingPolicy& p) {
         p.capacity_factor = 0.6;
         p.overflow = CapacityOverflow::Drop;
       })},
      {"bias", policy_with([](RoutingPolicy& p) {
         p.balance = LoadBalance::Bias;
         p.balance_rate = 0.05;
       })},
      {"bias, no margin", policy_with([](RoutingPolicy& p) {
         p.balance = LoadBalance::Bias;
         p.balance_rate = 0.05;
         p.balance_margin = 1.0;
       })},
      {"explore", policy_with([](RoutingPolicy& p) {
         p.explore = 0.7;
         p.seed = 3;
       })},
  };
  for (const auto& [name, policy] : policies) {
    Router plain(kExperts, policy);
    Router masked(kExperts + kMasked, policy);
    for (int batch = 0; batch < 4; ++batch) {
      std::vector<float> logits(kRows * kExperts), with_masked;
      for (float& l : logits) l = nd(rng);
      for (int r = 0; r < kRows; ++r) {
        with_masked.insert(with_masked.end(), logits.begin() + r * kExperts, logits.begin() + (r + 1) * kExperts);
        with_masked.insert(with_masked.end(), kMasked, -INFINITY);
      }
      const Routing want = plain.route(logits.data(), kRows);
      const Routing got = masked.route(with_masked.data(), kRows);
      ASSERT_EQ(got.top_k, want.top_k) << name;
      EXPECT_EQ(got.expert_ids, want.expert_ids) << name << " batch " << batch;
      EXPECT_EQ(got.weights, want.weights) << name << " batch " << batch;  // bit for bit
      EXPECT_EQ(std::vector<float>(masked.bias().begin(), masked.bias().begin() + kExperts), plain.bias()) << name;
      EXPECT_EQ(std::vector<int64_t>(masked.load().slots.begin(), masked.load().slots.begin() + kExperts),
                plain.load().slots)
          << name;
      EXPECT_EQ(masked.load().dropped, plain.load().dropped) << name;
      for (int e = kExperts; e < kExperts + kMasked; ++e) {
        EXPECT_EQ(masked.load().slots[static_cast<size_t>(e)], 0) << name;
        EXPECT_EQ(masked.bias()[static_cast<size_t>(e)], 0.0f) << name;
      }
    }
  }
}
