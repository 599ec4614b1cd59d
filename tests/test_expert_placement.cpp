// Multi-GPU expert placement (pure arithmetic over measured numbers) and the device-list syntax.
#include <gtest/gtest.h>

#include <map>

#include "moe/error.h"
#include "moe/expert_placement.h"
#include "test_util.h"

using moe::DeviceKind;
using moe::DeviceMemory;
using moe::ExpertPlacement;
using moe::parse_device_list;
using moe::Placement;
using moe::PlacementOptions;
using moe::plan_expert_placement;
using moe::test::expect_error;

namespace {

constexpr size_t GiB = size_t{1} << 30;

PlacementOptions no_headroom() {
  PlacementOptions o;
  o.headroom = 0.0;
  return o;
}

size_t count_on(const ExpertPlacement& p, int device) {
  for (const auto& d : p.devices())
    if (d.index == device) return d.experts.size();
  return 0;
}

}  // namespace

TEST(ExpertPlacement, FillsTheRoomiestDeviceFirst) {
  // 10, 20 and 30 GiB free; twelve 1-GiB experts. The 30-GiB device takes experts until it has
  // as much left as the 20-GiB one (10 experts), then they alternate, ties to the one listed first.
  const ExpertPlacement p = plan_expert_placement({{0, 10 * GiB}, {1, 20 * GiB}, {2, 30 * GiB}},
                                                  std::vector<size_t>(12, GiB), {}, no_headroom());
  EXPECT_EQ(count_on(p, 0), 0u);
  EXPECT_EQ(count_on(p, 1), 1u);
  EXPECT_EQ(count_on(p, 2), 11u);
  for (int e = 0; e < 12; ++e) EXPECT_EQ(p.devices_of(e).size(), 1u) << e;
  for (const auto& d : p.devices()) EXPECT_LE(d.used, d.capacity);
  EXPECT_NE(p.describe().find("device 2: 11 experts"), std::string::npos) << p.describe();
}

TEST(ExpertPlacement, SpreadsEvenlyOverEqualDevicesAndHotExpertsComeFirst) {
  // Loads make expert 5 the first placed: it lands on the first-listed of equal devices.
  std::vector<int64_t> load = {1, 1, 1, 1, 1, 50, 1, 1};
  const ExpertPlacement p = plan_expert_placement({{0, 8 * GiB}, {1, 8 * GiB}, {3, 8 * GiB}, {7, 8 * GiB}},
                                                  std::vector<size_t>(8, GiB), load, no_headroom());
  for (int d : {0, 1, 3, 7}) EXPECT_EQ(count_on(p, d), 2u) << d;
  EXPECT_EQ(p.devices_of(5), std::vector<int>{0});
}

TEST(ExpertPlacement, HeadroomDecidesWhatFits) {
  PlacementOptions o;
  o.headroom = 0.1;  // 10 GiB free -> 9 GiB usable
  const ExpertPlacement p = plan_expert_placement({{0, 10 * GiB}}, std::vector<size_t>(9, GiB), {}, o);
  EXPECT_EQ(count_on(p, 0), 9u);
  expect_error(
      [&] {
        plan_expert_placement({{0, 10 * GiB}}, std::vector<size_t>(10, GiB), {}, o);
      },
      {"10 experts need 10737418240 bytes", "offer 9663676416 bytes", "10% headroom", "device 0"});
  // Enough in total but not in one piece: 6 + 6 GiB for three 4-GiB experts.
  expect_error(
      [&] {
        plan_expert_placement({{0, 6 * GiB}, {1, 6 * GiB}}, std::vector<size_t>(3, 4 * GiB), {}, no_headroom());
      },
      {"expert", "fits on no device", "left: device 0 2.00 GiB; device 1 2.00 GiB"});
}

TEST(ExpertPlacement, ReplicatesHotExpertsWhileMemoryAllows) {
  // Mean load 32.5: expert 0 (100) is hot at factor 2, the others are not.
  PlacementOptions o = no_headroom();
  o.max_replicas = 3;
  const std::vector<int64_t> load = {100, 10, 10, 10};
  const ExpertPlacement p =
      plan_expert_placement({{0, 4 * GiB}, {1, 4 * GiB}, {2, 4 * GiB}}, std::vector<size_t>(4, GiB), load, o);
  ASSERT_EQ(p.devices_of(0).size(), 3u);
  for (int e = 1; e < 4; ++e) EXPECT_EQ(p.devices_of(e).size(), 1u);
  // Rows of the hot expert spread over its replicas evenly.
  std::map<int, int> rows_on;
  for (int64_t row = 0; row < 300; ++row) ++rows_on[p.choose_replica(0, row)];
  ASSERT_EQ(rows_on.size(), 3u);
  for (const auto& kv : rows_on) EXPECT_EQ(kv.second, 100) << "device " << kv.first;
  EXPECT_EQ(p.choose_replica(2, 17), p.devices_of(2)[0]);

  // Memory for only one extra copy: the hottest expert gets it.
  const ExpertPlacement tight =
      plan_expert_placement({{0, 3 * GiB}, {1, 3 * GiB}}, std::vector<size_t>(5, GiB), {90, 80, 1, 1, 1}, o);
  EXPECT_EQ(tight.devices_of(0).size(), 2u);
  EXPECT_EQ(tight.devices_of(1).size(), 1u);
  for (const auto& d : tight.devices()) EXPECT_LE(d.used, d.capacity);

  // Unknown (all zero) load: nothing is hot.
  const ExpertPlacement cold =
      plan_expert_placement({{0, 8 * GiB}, {1, 8 * GiB}}, std::vector<size_t>(4, GiB), std::vector<int64_t>(4, 0), o);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(cold.devices_of(e).size(), 1u);
}

TEST(ExpertPlacement, GivenPrimariesStayAndOnlyReplicasFollowTheLoad) {
  PlacementOptions o = no_headroom();
  o.max_replicas = 2;
  o.primary = {1, 0, 1, 0};  // not what the load order would choose for the hot expert 3
  const ExpertPlacement p =
      plan_expert_placement({{0, 4 * GiB}, {1, 4 * GiB}}, std::vector<size_t>(4, GiB), {1, 1, 1, 100}, o);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(p.devices_of(e)[0], o.primary[static_cast<size_t>(e)]) << e;
  EXPECT_EQ(p.devices_of(3), (std::vector<int>{0, 1}));  // the hot one gains a replica
  for (int e = 0; e < 3; ++e) EXPECT_EQ(p.devices_of(e).size(), 1u) << e;
  o.primary = {0, 0, 0};
  expect_error(
      [&] {
        plan_expert_placement({{0, 4 * GiB}}, std::vector<size_t>(4, GiB), {}, o);
      },
      {"3 primaries for 4 experts"});
  o.primary = {0, 5};
  expect_error(
      [&] {
        plan_expert_placement({{0, 4 * GiB}}, std::vector<size_t>(2, GiB), {}, o);
      },
      {"primary of expert 1 is device 5", "not listed"});
  o.primary = {0, 0, 0};
  expect_error(
      [&] {
        plan_expert_placement({{0, 2 * GiB}, {1, 2 * GiB}}, std::vector<size_t>(3, GiB), {}, o);
      },
      {"primaries given for device 0 exceed"});
}

TEST(ExpertPlacement, RejectsBadInput) {
  expect_error([] { plan_expert_placement({}, {GiB}, {}); }, {"no devices"});
  expect_error([] { plan_expert_placement({{1, GiB}, {1, GiB}}, {1}, {}); }, {"device 1 is listed twice"});
  expect_error([] { plan_expert_placement({{0, GiB}}, {1, 0}, {}); }, {"expert 1 has 0 bytes"});
  expect_error([] { plan_expert_placement({{0, GiB}}, {1, 1}, {3}); }, {"1 load entries for 2 experts"});
  const ExpertPlacement p = plan_expert_placement({{0, GiB}}, {1, 1}, {});
  expect_error([&] { p.devices_of(2); }, {"expert 2"});
}

TEST(DeviceList, ParsesTheUserFacingForms) {
  EXPECT_EQ(parse_device_list("cpu", 0), (std::vector<Placement>{{DeviceKind::Host, 0}}));
  EXPECT_EQ(parse_device_list("cuda:0", 1), (std::vector<Placement>{{DeviceKind::Cuda, 0}}));
  EXPECT_EQ(parse_device_list("cuda", 2), (std::vector<Placement>{{DeviceKind::Cuda, 0}}));
  EXPECT_EQ(parse_device_list("cuda:0,cuda:1", 2),
            (std::vector<Placement>{{DeviceKind::Cuda, 0}, {DeviceKind::Cuda, 1}}));
  EXPECT_EQ(parse_device_list(" cuda:2 , cuda:0 ", 3),
            (std::vector<Placement>{{DeviceKind::Cuda, 2}, {DeviceKind::Cuda, 0}}));
  EXPECT_EQ(parse_device_list("all", 3),
            (std::vector<Placement>{{DeviceKind::Cuda, 0}, {DeviceKind::Cuda, 1}, {DeviceKind::Cuda, 2}}));
  EXPECT_EQ(parse_device_list("auto", 2), (std::vector<Placement>{{DeviceKind::Cuda, 0}, {DeviceKind::Cuda, 1}}));
  EXPECT_EQ(parse_device_list(" auto ", 0), (std::vector<Placement>{{DeviceKind::Host, 0}}));
}

TEST(DeviceList, ErrorsNameTheEntryAndTheReason) {
  expect_error([] { parse_device_list("gpu0", 2); }, {"unknown device 'gpu0'", "cpu, cuda:N"});
  expect_error([] { parse_device_list("cuda:0,cuda:x", 2); }, {"unknown device 'cuda:x'"});
  expect_error([] { parse_device_list("cuda:-1", 2); }, {"unknown device 'cuda:-1'"});
  expect_error([] { parse_device_list("cuda:0,cuda:0", 2); }, {"cuda:0 is listed twice"});
  expect_error([] { parse_device_list("cuda:2", 2); },
               {"cuda:2 is out of range", "2 CUDA devices available (cuda:0..cuda:1)"});
  expect_error([] { parse_device_list("cuda:0", 0); }, {"out of range", "no CUDA device available"});
  expect_error([] { parse_device_list("all", 0); }, {"'all'", "no CUDA device available"});
  expect_error([] { parse_device_list("", 1); }, {"empty"});
  expect_error([] { parse_device_list("cuda:0,,cuda:1", 2); }, {"empty entry"});
  expect_error([] { parse_device_list("cpu,cuda:0", 1); }, {"'cpu' cannot be combined"});
}
