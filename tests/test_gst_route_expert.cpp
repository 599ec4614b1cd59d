// moe-route and moe-expert: routing and expert outputs against the engine called directly on
// the same rows, the request meta (ids, failed requests, timings), statistics, and the errors a
// user meets (wrong width, missing adapter, bad top-k, CUDA device, no router, foreign adapter).
// The expert executor path (reduced precision on the CPU; CUDA devices when there are any): output
// against moe::ExpertExecutor called directly, moe-route's preload through the meta (also across a
// queue), and the per-device cache counters.
#include <gst/app/gstappsink.h>
#include <gst/app/gstappsrc.h>
#include <gst/check/gstharness.h>
#include <gst/gst.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gstmoeexpert.h"
#include "gstmoemeta.h"
#include "gstmoeroute.h"
#include "moe/expert_executor.h"
#include "moe/expert_store.h"
#include "moe/model_cache.h"
#include "moe/moe_layer.h"
#include "moe/routing_policy.h"
#include "moe_build_config.h"
#include "test_util.h"

namespace {

constexpr int kWidth = 16;  // adapter_tiny: hidden 16, 6 experts, top-2
constexpr int kExperts = 6;
constexpr int kTopK = 2;

const std::string& adapter_dir() {
  static const std::string dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/adapter_tiny";
  return dir;
}

// The reference: a private instance, not the shared cache entry the elements use, so that
// tests can observe the elements releasing theirs.
const moe::MoeAdapter& engine() {
  static const moe::MoeAdapter adapter = moe::MoeAdapter::load(adapter_dir());
  return adapter;
}

std::vector<float> random_rows(size_t rows, unsigned seed, int width = kWidth) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(rows * static_cast<size_t>(width));
  for (float& x : v) x = dist(gen);
  return v;
}

moe::Tensor as_tensor(const std::vector<float>& v, int width = kWidth) {
  return moe::Tensor::from_vector(v, {static_cast<int64_t>(v.size() / static_cast<size_t>(width)), width});
}

gstmoe::BatchRecords records_for(size_t rows, const std::string& prefix = "q") {
  gstmoe::BatchRecords records;
  for (size_t i = 0; i < rows; ++i) {
    gstmoe::RequestRecord r;
    r.id = prefix + std::to_string(i);
    r.text = "query " + std::to_string(i);
    r.arrival_wall_us = g_get_real_time();
    r.arrival_mono_us = g_get_monotonic_time();
    records.rows.push_back(r);
  }
  records.encoder = "clip_tiny_bpe";
  return records;
}

GstBuffer* tensor_buffer(const std::vector<float>& data, const gstmoe::BatchRecords* records) {
  GstBuffer* buf = data.empty() ? gst_buffer_new() : gst_buffer_new_memdup(data.data(), data.size() * sizeof(float));
  if (records) gst_buffer_add_moe_batch_meta(buf, *records);
  return buf;
}

std::vector<float> buffer_floats(GstBuffer* buf) {
  std::vector<float> v(gst_buffer_get_size(buf) / sizeof(float));
  gst_buffer_extract(buf, 0, v.data(), v.size() * sizeof(float));
  return v;
}

const gstmoe::BatchRecords& records_of(GstBuffer* buf) {
  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  EXPECT_NE(meta, nullptr);
  static const gstmoe::BatchRecords none;
  return meta ? *meta->records : none;
}

// Routing in the meta == the engine's routing of the same rows.
void expect_routing(const gstmoe::BatchRecords& records, const moe::Routing& want) {
  ASSERT_EQ(records.rows.size(), static_cast<size_t>(want.rows));
  for (size_t i = 0; i < records.rows.size(); ++i) {
    const gstmoe::RequestRecord& r = records.rows[i];
    ASSERT_EQ(r.experts.size(), static_cast<size_t>(want.top_k)) << "row " << i;
    ASSERT_EQ(r.expert_weights.size(), static_cast<size_t>(want.top_k)) << "row " << i;
    for (int j = 0; j < want.top_k; ++j) {
      EXPECT_EQ(r.experts[j], want.expert(static_cast<int64_t>(i), j)) << "row " << i << " slot " << j;
      EXPECT_NEAR(r.expert_weights[j], want.weight(static_cast<int64_t>(i), j), 1e-6) << "row " << i;
    }
  }
}

void expect_close(const std::vector<float>& got, const moe::Tensor& want, double tol = 1e-6) {
  ASSERT_EQ(got.size(), static_cast<size_t>(want.numel()));
  const float* w = want.data<float>();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], w[i], tol) << "element " << i;
}

bool has_timing(const gstmoe::RequestRecord& r, const std::string& stage) {
  for (const auto& t : r.timings_ms)
    if (t.first == stage) return t.second >= 0.0;
  return false;
}

// The first error on `bus` as "message", or "" when none came within 10 s.
std::string pop_error(GstBus* bus) {
  GstMessage* msg = gst_bus_timed_pop_filtered(bus, 10 * GST_SECOND, GST_MESSAGE_ERROR);
  if (!msg) return "";
  GError* err = nullptr;
  gst_message_parse_error(msg, &err, nullptr);
  std::string text = err->message;
  g_error_free(err);
  gst_message_unref(msg);
  return text;
}

// A harness over a parsed launch line, with a bus to collect element errors.
struct Harness {
  GstHarness* h;
  GstBus* bus;
  explicit Harness(const std::string& launch, int width = kWidth) : h(gst_harness_new_parse(launch.c_str())) {
    bus = gst_bus_new();
    gst_element_set_bus(h->element, bus);
    gst_harness_set_src_caps(h, gstmoe::tensor_caps(width));
  }
  ~Harness() {
    gst_bus_set_flushing(bus, TRUE);  // queued messages reference the elements, which reference the bus
    gst_harness_teardown(h);
    gst_object_unref(bus);
  }
  GstFlowReturn push(GstBuffer* buf) { return gst_harness_push(h, buf); }
  GstBuffer* pull() { return gst_harness_pull(h); }
  GstElement* element(const char* name) { return gst_bin_get_by_name(GST_BIN(h->element), name); }
};

// An element's 'stats': rows, batches and the per-expert counts in field `per_expert`.
struct Stats {
  std::string name;  // of the structure
  guint64 rows = 0;
  guint64 batches = 0;
  std::vector<guint64> per_expert;
};

Stats read_stats(Harness& h, const char* element, const char* per_expert) {
  GstElement* e = h.element(element);
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  gst_object_unref(e);
  Stats out;
  EXPECT_NE(s, nullptr);
  if (!s) return out;
  out.name = gst_structure_get_name(s);
  EXPECT_TRUE(gst_structure_get_uint64(s, "rows", &out.rows));
  EXPECT_TRUE(gst_structure_get_uint64(s, "batches", &out.batches));
  const GValue* array = gst_structure_get_value(s, per_expert);
  EXPECT_TRUE(array && GST_VALUE_HOLDS_ARRAY(array)) << per_expert;
  if (array && GST_VALUE_HOLDS_ARRAY(array))
    for (guint i = 0; i < gst_value_array_get_size(array); ++i)
      out.per_expert.push_back(g_value_get_uint64(gst_value_array_get_value(array, i)));
  gst_structure_free(s);
  return out;
}

// moe-expert's executor counters: 'batches-prefetched' and one entry of 'devices' per device.
struct DeviceCounters {
  std::string device;
  guint experts = 0;
  gint slots = 0;
  guint64 budget_bytes = 0, hits = 0, misses = 0, bytes_copied = 0, evictions = 0, copies_hidden = 0,
          copies_exposed = 0, resident = 0, pinned = 0, slot_bytes = 0, resident_bytes = 0;
  double exposed_wait_ms = -1;
};
struct ExecutorStats {
  guint64 batches_prefetched = 0;
  guint64 placement_changes = 0;
  std::vector<DeviceCounters> devices;
};

ExecutorStats read_executor_stats(Harness& h) {
  GstElement* e = h.element("expert");
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  gst_object_unref(e);
  ExecutorStats out;
  EXPECT_NE(s, nullptr);
  if (!s) return out;
  EXPECT_TRUE(gst_structure_get_uint64(s, "batches-prefetched", &out.batches_prefetched));
  EXPECT_TRUE(gst_structure_get_uint64(s, "placement-changes", &out.placement_changes));
  const GValue* devices = gst_structure_get_value(s, "devices");
  EXPECT_TRUE(devices && GST_VALUE_HOLDS_ARRAY(devices));
  for (guint i = 0; devices && GST_VALUE_HOLDS_ARRAY(devices) && i < gst_value_array_get_size(devices); ++i) {
    const GstStructure* d = gst_value_get_structure(gst_value_array_get_value(devices, i));
    DeviceCounters c;
    c.device = gst_structure_get_string(d, "device");
    EXPECT_TRUE(gst_structure_get_uint(d, "experts", &c.experts));
    EXPECT_TRUE(gst_structure_get_int(d, "slots", &c.slots));
    EXPECT_TRUE(gst_structure_get_double(d, "exposed-wait-ms", &c.exposed_wait_ms));
    for (auto field : std::vector<std::pair<const char*, guint64*>>{{"budget-bytes", &c.budget_bytes},
                                                                    {"hits", &c.hits},
                                                                    {"misses", &c.misses},
                                                                    {"bytes-copied", &c.bytes_copied},
                                                                    {"evictions", &c.evictions},
                                                                    {"copies-hidden", &c.copies_hidden},
                                                                    {"copies-exposed", &c.copies_exposed},
                                                                    {"resident", &c.resident},
                                                                    {"pinned", &c.pinned},
                                                                    {"slot-bytes", &c.slot_bytes},
                                                                    {"resident-bytes", &c.resident_bytes}})
      EXPECT_TRUE(gst_structure_get_uint64(d, field.first, field.second)) << field.first;
    out.devices.push_back(c);
  }
  gst_structure_free(s);
  return out;
}

size_t distinct_experts(const moe::Routing& r) {
  return std::set<int32_t>(r.expert_ids.begin(), r.expert_ids.end()).size();
}

std::string route_line(const std::string& extra = "") {
  return "moe-route name=route model=\"" + adapter_dir() + "\" " + extra;
}
std::string expert_line(const std::string& dir = adapter_dir(), const std::string& extra = "") {
  return "moe-expert name=expert model=\"" + dir + "\" " + extra;
}

// appsrc ! <middle> ! appsink, for caps problems and state cycles.
struct Pipeline {
  GstElement* pipeline = nullptr;
  GstElement* src = nullptr;
  GstElement* sink = nullptr;
  GstBus* bus = nullptr;
  Pipeline(const std::string& middle, int width) {
    const std::string launch =
        "appsrc name=src format=time caps=\"application/x-moe-tensor,dtype=(string)f32,width=(int)" +
        std::to_string(width) + "\" ! " + middle + " ! appsink name=sink sync=false";
    GError* err = nullptr;
    pipeline = gst_parse_launch(launch.c_str(), &err);
    EXPECT_EQ(err, nullptr) << (err ? err->message : "");
    if (err) g_error_free(err);
    src = gst_bin_get_by_name(GST_BIN(pipeline), "src");
    sink = gst_bin_get_by_name(GST_BIN(pipeline), "sink");
    bus = gst_element_get_bus(pipeline);
  }
  ~Pipeline() {
    gst_element_set_state(pipeline, GST_STATE_NULL);
    gst_object_unref(bus);
    gst_object_unref(src);
    gst_object_unref(sink);
    gst_object_unref(pipeline);
  }
};

// Puts one element (a launch description) in a pipeline and starts it; returns the error
// message when the start fails, "" when it succeeds.
std::string start_error(const std::string& description) {
  GError* err = nullptr;
  GstElement* element = gst_parse_launch(description.c_str(), &err);
  EXPECT_EQ(err, nullptr) << (err ? err->message : "");
  if (err) g_error_free(err);
  GstElement* pipeline = gst_pipeline_new(nullptr);
  gst_bin_add(GST_BIN(pipeline), element);
  GstBus* bus = gst_element_get_bus(pipeline);
  const GstStateChangeReturn ret = gst_element_set_state(pipeline, GST_STATE_PAUSED);
  std::string error = ret == GST_STATE_CHANGE_FAILURE ? pop_error(bus) : "";
  if (ret == GST_STATE_CHANGE_FAILURE && error.empty()) error = "(state change failed without an error message)";
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(bus);
  gst_object_unref(pipeline);
  return error;
}

void expect_contains(const std::string& text, const std::string& fragment) {
  EXPECT_NE(text.find(fragment), std::string::npos) << "message: " << text << "\nmissing: " << fragment;
}

// Another adapter (hidden 16, random weights), written to a temporary directory: with 4 experts a
// router whose experts do not match adapter_tiny's; with 6, the same shapes and other weights.
class TempAdapter {
 public:
  // `config_extra`: more members of adapter_config.json (",\"key\":value"); `cross_modal_gate`:
  // with the gate that fuses hybrid requests.
  explicit TempAdapter(int num_experts, const std::string& config_extra = "", bool cross_modal_gate = false) {
    const int D = kWidth, I = 24;
    std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {{"gate.weight", {num_experts, D}}};
    for (int e = 0; e < num_experts; ++e) {
      const std::string p = "experts." + std::to_string(e) + ".";
      tensors.push_back({p + "w1.weight", {I, D}});
      tensors.push_back({p + "w2.weight", {D, I}});
      tensors.push_back({p + "w3.weight", {I, D}});
    }
    if (cross_modal_gate) {
      tensors.push_back({"cross_modal_gate.weight", {2, 2 * D}});
      tensors.push_back({"cross_modal_gate.bias", {2}});
    }
    std::string header = "{";
    std::vector<float> data;
    std::mt19937 gen(7);
    std::normal_distribution<float> dist(0.0f, 0.2f);
    for (size_t t = 0; t < tensors.size(); ++t) {
      size_t n = 1;
      std::string shape;
      for (int64_t d : tensors[t].second) {
        n *= static_cast<size_t>(d);
        shape += (shape.empty() ? "" : ",") + std::to_string(d);
      }
      const size_t begin = data.size() * sizeof(float);
      for (size_t i = 0; i < n; ++i) data.push_back(dist(gen));
      header += (t ? "," : "") + std::string("\"") + tensors[t].first + "\":{\"dtype\":\"F32\",\"shape\":[" + shape +
                "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size() * sizeof(float)) +
                "]}";
    }
    header += "}";
    while (header.size() % 8) header += ' ';
    std::string file(8, '\0');
    uint64_t len = header.size();
    std::memcpy(&file[0], &len, 8);  // little-endian host
    file += header;
    file.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
    dir_.write("adapter.safetensors", file);
    dir_.write("adapter_config.json",
               "{\"format\":\"gst-moe-adapter\",\"version\":1,\"hidden_size\":16,\"num_experts\":" +
                   std::to_string(num_experts) + ",\"top_k\":2,\"intermediate_size\":24,\"routing\":\"mixtral\"" +
                   config_extra + "}");
  }
  const std::string& dir() const { return dir_.path(); }

 private:
  moe::test::TempDir dir_;
};

class RouteExpertTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    static const bool registered = [] {
      gst_init(nullptr, nullptr);
      return GST_ELEMENT_REGISTER(moe_route, nullptr) && GST_ELEMENT_REGISTER(moe_expert, nullptr);
    }();
    ASSERT_TRUE(registered);
  }
};

// ------------------------------------------------------------------------------------------

TEST_F(RouteExpertTest, RouteWritesTheEngineRoutingAndKeepsTheData) {
  Harness h(route_line());
  const std::vector<float> rows = random_rows(7, 1);
  const gstmoe::BatchRecords records = records_for(7);
  ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);

  EXPECT_EQ(buffer_floats(out), rows);  // bit-exact: the data passes through
  const gstmoe::BatchRecords& got = records_of(out);
  expect_routing(got, engine().route(as_tensor(rows)));
  for (size_t i = 0; i < got.rows.size(); ++i) {
    EXPECT_EQ(got.rows[i].id, records.rows[i].id);
    EXPECT_EQ(got.rows[i].text, records.rows[i].text);
    EXPECT_TRUE(has_timing(got.rows[i], "route"));
  }
  EXPECT_EQ(got.adapter, "adapter_tiny");
  EXPECT_EQ(got.encoder, "clip_tiny_bpe");
  EXPECT_TRUE(got.adapter_fingerprint.empty()) << "routing alone leaves the vectors unadapted";
  gst_buffer_unref(out);
}

TEST_F(RouteExpertTest, RouteStatsCountRowsBatchesAndExpertLoad) {
  Harness h(route_line());
  std::vector<guint64> want_load(kExperts, 0);
  for (unsigned b = 0; b < 2; ++b) {
    const std::vector<float> rows = random_rows(b ? 3 : 5, 10 + b);
    const gstmoe::BatchRecords records = records_for(b ? 3 : 5);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    gst_buffer_unref(h.pull());
    for (int32_t e : engine().route(as_tensor(rows)).expert_ids) ++want_load[static_cast<size_t>(e)];
  }
  const Stats stats = read_stats(h, "route", "expert-load");
  EXPECT_EQ(stats.name, "moe-route-stats");
  EXPECT_EQ(stats.rows, 8u);
  EXPECT_EQ(stats.batches, 2u);
  EXPECT_EQ(stats.per_expert, want_load);
  EXPECT_EQ(std::accumulate(stats.per_expert.begin(), stats.per_expert.end(), guint64{0}), 8u * kTopK);
  // Shares, rates and peaks beside the counts.
  GstElement* route = h.element("route");
  GstStructure* s = nullptr;
  g_object_get(route, "stats", &s, nullptr);
  gst_object_unref(route);
  for (const char* field : {"expert-share", "expert-rate", "expert-peak"}) {
    const GValue* v = gst_structure_get_value(s, field);
    ASSERT_TRUE(v && GST_VALUE_HOLDS_ARRAY(v)) << field;
    EXPECT_EQ(gst_value_array_get_size(v), static_cast<guint>(kExperts)) << field;
  }
  const GValue* share = gst_structure_get_value(s, "expert-share");
  const GValue* rate = gst_structure_get_value(s, "expert-rate");
  double share_sum = 0.0;
  for (guint e = 0; e < static_cast<guint>(kExperts); ++e) {
    const double sh = g_value_get_double(gst_value_array_get_value(share, e));
    EXPECT_NEAR(sh, static_cast<double>(want_load[e]) / (8.0 * kTopK), 1e-12);
    share_sum += sh;
    // Two batches just now: the rate is about the slots over the 10 s time constant.
    EXPECT_NEAR(g_value_get_double(gst_value_array_get_value(rate, e)), want_load[e] / 10.0, want_load[e] / 10.0 * 0.1);
  }
  EXPECT_NEAR(share_sum, 1.0, 1e-12);
  gst_structure_free(s);
}

TEST_F(RouteExpertTest, TopKOverride) {
  for (int k : {1, 3}) {
    Harness h(route_line("top-k=" + std::to_string(k)) + " ! " + expert_line());
    const std::vector<float> rows = random_rows(6, 20 + static_cast<unsigned>(k));
    const gstmoe::BatchRecords records = records_for(6);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    const moe::Routing routing = engine().route(as_tensor(rows), k);
    expect_routing(records_of(out), routing);
    expect_close(buffer_floats(out), engine().apply_experts(as_tensor(rows), routing));
    // The same adapter's space: routing is a serving choice, the provenance names the weights.
    EXPECT_EQ(records_of(out).adapter_fingerprint, engine().fingerprint());
    gst_buffer_unref(out);
  }
}

// The routing-policy properties route as moe::Router does on the adapter's logits.
TEST_F(RouteExpertTest, PolicyPropertiesRouteAsTheEnginesRouter) {
  moe::RoutingPolicy policy;
  policy.top_k = kTopK;
  policy.temperature = 2.5;
  policy.explore = 0.5;
  policy.seed = 3;
  moe::Router router(kExperts, policy);
  Harness h(route_line("temperature=2.5 explore=0.5 seed=3") + " ! " + expert_line());
  guint64 explored = 0;
  for (unsigned b = 0; b < 3; ++b) {
    const std::vector<float> rows = random_rows(9, 40 + b);
    const gstmoe::BatchRecords records = records_for(9);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    const moe::Tensor logits = engine().layer().router_logits(as_tensor(rows));
    const moe::Routing want = router.route(logits.data<float>(), 9);
    expect_routing(records_of(out), want);
    expect_close(buffer_floats(out), engine().apply_experts(as_tensor(rows), want));
    gst_buffer_unref(out);
  }
  for (int64_t n : router.load().explored) explored += static_cast<guint64>(n);
  EXPECT_GT(explored, 0u);
  GstElement* route = h.element("route");
  GstStructure* s = nullptr;
  g_object_get(route, "stats", &s, nullptr);
  gst_object_unref(route);
  ASSERT_NE(s, nullptr);
  const GValue* got = gst_structure_get_value(s, "expert-explored");
  ASSERT_TRUE(got && GST_VALUE_HOLDS_ARRAY(got));
  guint64 sum = 0;
  for (guint i = 0; i < gst_value_array_get_size(got); ++i)
    sum += g_value_get_uint64(gst_value_array_get_value(got, i));
  EXPECT_EQ(sum, explored);
  gst_structure_free(s);
}

// Dynamic k and capacity: rows end with different numbers of experts (unused slots -1), and
// moe-expert runs exactly those.
TEST_F(RouteExpertTest, TopPAndCapacityGiveRowsDifferentNumbersOfExperts) {
  for (const char* overflow : {"reroute", "drop"}) {
    moe::RoutingPolicy policy;
    policy.selection = moe::ExpertSelection::TopP;
    policy.top_p = 0.6;
    policy.max_k = 3;
    policy.capacity_factor = 1.0;
    policy.overflow = std::string(overflow) == "drop" ? moe::CapacityOverflow::Drop : moe::CapacityOverflow::Reroute;
    moe::Router router(kExperts, policy);
    Harness h(route_line(std::string("routing=top-p top-p=0.6 max-k=3 capacity-factor=1 overflow=") + overflow) +
              " ! " + expert_line());
    const std::vector<float> rows = random_rows(24, 70);
    const gstmoe::BatchRecords records = records_for(24);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    const moe::Tensor logits = engine().layer().router_logits(as_tensor(rows));
    const moe::Routing want = router.route(logits.data<float>(), 24);
    ASSERT_EQ(want.top_k, 3);
    const auto unused = std::count(want.expert_ids.begin(), want.expert_ids.end(), moe::Routing::kUnusedSlot);
    EXPECT_GT(unused, 0) << "every row used max-k experts: the case tests nothing";
    expect_routing(records_of(out), want);
    expect_close(buffer_floats(out), engine().apply_experts(as_tensor(rows), want));
    gst_buffer_unref(out);

    GstElement* route = h.element("route");
    GstStructure* s = nullptr;
    g_object_get(route, "stats", &s, nullptr);
    gst_object_unref(route);
    double per_row = 0.0;
    guint64 dropped = 0;
    EXPECT_TRUE(gst_structure_get_double(s, "experts-per-row", &per_row));
    EXPECT_TRUE(gst_structure_get_uint64(s, "dropped", &dropped));
    EXPECT_NEAR(per_row, static_cast<double>(want.expert_ids.size() - static_cast<size_t>(unused)) / 24, 1e-9);
    EXPECT_EQ(dropped, static_cast<guint64>(router.load().dropped));
    gst_structure_free(s);
  }
}

// The adapter's calibrated temperature (router_temperature) applies unless the property says
// otherwise; an adapter without one routes as before.
TEST_F(RouteExpertTest, AdapterRouterTemperatureIsTheDefault) {
  TempAdapter calibrated(4, ",\"router_temperature\":3.0");
  const moe::MoeAdapter adapter = moe::MoeAdapter::load(calibrated.dir());
  EXPECT_EQ(adapter.layer().config().router_temperature, 3.0);
  const std::vector<float> rows = random_rows(6, 80);
  const moe::Tensor logits = adapter.layer().router_logits(as_tensor(rows));
  for (const std::string& extra : {std::string(""), std::string("temperature=0.5")}) {
    moe::RoutingPolicy policy;
    policy.temperature = extra.empty() ? 3.0 : 0.5;
    moe::Router router(4, policy);
    Harness h("moe-route name=route model=\"" + calibrated.dir() + "\" " + extra);
    const gstmoe::BatchRecords records = records_for(6);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    expect_routing(records_of(out), router.route(logits.data<float>(), 6));
    gst_buffer_unref(out);
  }
}

// balance=bias on a stream that favours a few experts: the bias moves, the load evens out.
TEST_F(RouteExpertTest, BiasBalancingEvensOutASkewedLoad) {
  auto run = [&](const std::string& extra, std::vector<double>* bias) {
    Harness h(route_line(extra));
    for (unsigned b = 0; b < 40; ++b) {
      std::vector<float> rows = random_rows(8, 60 + b);
      for (size_t i = 0; i < rows.size(); i += kWidth) rows[i] += 3.0f;  // the same skew in every row
      const gstmoe::BatchRecords records = records_for(8);
      EXPECT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
      gst_buffer_unref(h.pull());
    }
    GstElement* route = h.element("route");
    GstStructure* s = nullptr;
    g_object_get(route, "stats", &s, nullptr);
    gst_object_unref(route);
    double cv = -1.0;
    EXPECT_TRUE(gst_structure_get_double(s, "load-cv", &cv));
    const GValue* b = gst_structure_get_value(s, "expert-bias");
    EXPECT_TRUE(b && GST_VALUE_HOLDS_ARRAY(b));
    for (guint i = 0; b && i < gst_value_array_get_size(b); ++i)
      bias->push_back(g_value_get_double(gst_value_array_get_value(b, i)));
    gst_structure_free(s);
    return cv;
  };
  std::vector<double> bias_none, bias;
  const double cv_none = run("", &bias_none);
  const double cv_bias = run("balance=bias balance-rate=0.02 balance-margin=1", &bias);
  EXPECT_EQ(bias_none, std::vector<double>(kExperts, 0.0));
  ASSERT_EQ(bias.size(), static_cast<size_t>(kExperts));
  EXPECT_NE(bias, std::vector<double>(kExperts, 0.0));
  EXPECT_LT(cv_bias, cv_none * 0.75) << "load-cv without balancing " << cv_none << ", with " << cv_bias;
}

TEST_F(RouteExpertTest, TopKAboveNumExpertsFailsAtStart) {
  const std::string error = start_error(route_line("top-k=7"));
  expect_contains(error, "top-k=7");
  expect_contains(error, "6 experts");
}

TEST_F(RouteExpertTest, RouteThenExpertEqualsAdapterApply) {
  Harness h(route_line() + " ! " + expert_line());
  const std::vector<float> rows = random_rows(9, 2);
  const gstmoe::BatchRecords records = records_for(9);
  ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);

  const moe::AdapterOutput want = engine().apply(as_tensor(rows));
  const std::vector<float> got = buffer_floats(out);
  expect_close(got, want.embeddings);
  for (size_t i = 0; i < 9; ++i) {
    double norm = 0;
    for (int d = 0; d < kWidth; ++d) norm += static_cast<double>(got[i * kWidth + d]) * got[i * kWidth + d];
    EXPECT_NEAR(std::sqrt(norm), 1.0, 1e-5) << "row " << i;
  }
  const gstmoe::BatchRecords& meta = records_of(out);
  expect_routing(meta, want.routing);
  for (const gstmoe::RequestRecord& r : meta.rows) {
    EXPECT_TRUE(has_timing(r, "route"));
    EXPECT_TRUE(has_timing(r, "expert"));
    ASSERT_EQ(r.timings_ms.size(), 2u);
    EXPECT_EQ(r.timings_ms[0].first, "route");  // in pipeline order
    EXPECT_EQ(r.timings_ms[1].first, "expert");
  }
  EXPECT_EQ(meta.adapter, "adapter_tiny");
  EXPECT_EQ(meta.adapter_fingerprint, engine().fingerprint());
  EXPECT_EQ(meta.adapter_fingerprint.size(), 16u);
  gst_buffer_unref(out);

  const Stats stats = read_stats(h, "expert", "expert-rows");
  EXPECT_EQ(stats.name, "moe-expert-stats");
  EXPECT_EQ(stats.rows, 9u);
  EXPECT_EQ(stats.batches, 1u);
  EXPECT_EQ(stats.per_expert.size(), static_cast<size_t>(kExperts));
  EXPECT_EQ(std::accumulate(stats.per_expert.begin(), stats.per_expert.end(), guint64{0}), 9u * kTopK);
}

TEST_F(RouteExpertTest, ZeroRowBufferKeepsItsFailures) {
  Harness h(route_line() + " ! " + expert_line());
  gstmoe::BatchRecords records;
  gstmoe::FailedRequest failed;
  failed.request.id = "q7";
  failed.request.modality = gstmoe::Modality::Image;
  failed.request.uri = "/nope.jpg";
  failed.stage = "zmq-query";
  failed.reason = "image file '/nope.jpg' cannot be read: No such file or directory";
  records.failed.push_back(failed);
  ASSERT_EQ(h.push(tensor_buffer({}, &records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(gst_buffer_get_size(out), 0u);
  const gstmoe::BatchRecords& got = records_of(out);
  EXPECT_TRUE(got.rows.empty());
  ASSERT_EQ(got.failed.size(), 1u);
  EXPECT_EQ(got.failed[0].request.id, "q7");
  EXPECT_EQ(got.failed[0].request.uri, "/nope.jpg");
  EXPECT_EQ(got.failed[0].stage, "zmq-query");
  EXPECT_EQ(got.failed[0].reason, failed.reason);
  gst_buffer_unref(out);
}

TEST_F(RouteExpertTest, BufferWithoutMetaGetsGeneratedIds) {
  Harness h(route_line() + " ! " + expert_line());
  std::set<std::string> ids;
  for (unsigned b = 0; b < 2; ++b) {
    const std::vector<float> rows = random_rows(3, 30 + b);
    ASSERT_EQ(h.push(tensor_buffer(rows, nullptr)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    const gstmoe::BatchRecords& got = records_of(out);
    ASSERT_EQ(got.rows.size(), 3u);
    for (const gstmoe::RequestRecord& r : got.rows) {
      EXPECT_FALSE(r.id.empty());
      EXPECT_GT(r.arrival_mono_us, 0);
      ids.insert(r.id);
    }
    expect_close(buffer_floats(out), engine().apply(as_tensor(rows)).embeddings);
    gst_buffer_unref(out);
  }
  EXPECT_EQ(ids.size(), 6u);  // unique across buffers
}

TEST_F(RouteExpertTest, MetaRowCountMismatchIsAnError) {
  Harness h(route_line());
  const gstmoe::BatchRecords records = records_for(2);
  EXPECT_EQ(h.push(tensor_buffer(random_rows(3, 4), &records)), GST_FLOW_ERROR);
  const std::string error = pop_error(h.bus);
  expect_contains(error, "3 rows");
  expect_contains(error, "describes 2");
}

TEST_F(RouteExpertTest, PartialRowIsAnError) {
  Harness h(route_line());
  std::vector<float> data = random_rows(2, 5);
  data.pop_back();
  EXPECT_EQ(h.push(tensor_buffer(data, nullptr)), GST_FLOW_ERROR);
  const std::string error = pop_error(h.bus);
  expect_contains(error, "124 bytes");
  expect_contains(error, "width 16");
}

TEST_F(RouteExpertTest, WidthMismatchIsNotNegotiated) {
  for (const std::string& element : {route_line(), expert_line()}) {
    Pipeline p(element, 8);
    ASSERT_NE(gst_element_set_state(p.pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
    gst_app_src_push_buffer(GST_APP_SRC(p.src), tensor_buffer(random_rows(1, 6, 8), nullptr));
    const std::string error = pop_error(p.bus);
    expect_contains(error, "width 8");
    expect_contains(error, "hidden_size 16");
    expect_contains(error, adapter_dir());
  }
}

TEST_F(RouteExpertTest, MissingModelFailsTheStateChange) {
  const std::string missing = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/no_such_adapter";
  for (const char* factory : {"moe-route", "moe-expert"}) {
    const std::string error = start_error(std::string(factory) + " model=\"" + missing + "\"");
    expect_contains(error, missing);
  }
  expect_contains(start_error("moe-route"), "set the 'model' property");
}

TEST_F(RouteExpertTest, CudaDeviceWithoutAGpuFailsWithTheReason) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  for (const char* device : {"cuda:0", "cuda:0,cuda:1", "all"}) {
    const std::string error = start_error(expert_line(adapter_dir(), std::string("device=\"") + device + "\""));
    expect_contains(error, std::string("device '") + device + "'");
    expect_contains(error, "no usable CUDA device");
    expect_contains(error, why);
  }
  expect_contains(start_error(expert_line(adapter_dir(), "device=gpu")), "unknown device 'gpu'");
  EXPECT_EQ(start_error(expert_line(adapter_dir(), "device=cpu")), "");
  EXPECT_EQ(start_error(expert_line(adapter_dir(), "device=cpu precision=bf16")), "");
}

TEST_F(RouteExpertTest, PropertiesHaveTheirDefaults) {
  GstElement* e = gst_element_factory_make("moe-expert", nullptr);
  ASSERT_NE(e, nullptr);
  gchar* device = nullptr;
  gint precision = -1;
  gdouble budget = 0;
  guint interval = 0;
  g_object_get(e, "device", &device, "precision", &precision, "cache-budget", &budget, "rebalance-interval", &interval,
               nullptr);
  EXPECT_STREQ(device, "cpu");
  EXPECT_EQ(precision, GST_MOE_PRECISION_FP32);
  EXPECT_DOUBLE_EQ(budget, 0.85);
  EXPECT_EQ(interval, 256u);
  g_free(device);
  GParamSpecDouble* spec = G_PARAM_SPEC_DOUBLE(g_object_class_find_property(G_OBJECT_GET_CLASS(e), "cache-budget"));
  EXPECT_DOUBLE_EQ(spec->minimum, 0.05);
  EXPECT_DOUBLE_EQ(spec->maximum, 1.0);
  GEnumClass* precisions = G_ENUM_CLASS(g_type_class_ref(GST_TYPE_MOE_PRECISION));
  for (const char* nick : {"fp32", "fp16", "bf16"})
    EXPECT_NE(g_enum_get_value_by_nick(precisions, nick), nullptr) << nick;
  g_type_class_unref(precisions);
  gst_object_unref(e);
}

TEST_F(RouteExpertTest, PlainCpuPathHasNoExecutor) {
  Harness h(route_line() + " ! " + expert_line());
  const std::vector<float> rows = random_rows(3, 50);
  const gstmoe::BatchRecords records = records_for(3);
  ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(records_of(out).expert_prefetch, nullptr);
  gst_buffer_unref(out);
  const ExecutorStats stats = read_executor_stats(h);
  EXPECT_EQ(stats.batches_prefetched, 0u);
  EXPECT_TRUE(stats.devices.empty());
}

// device=auto: every CUDA device when there is one, else the plain CPU path (no executor).
TEST_F(RouteExpertTest, AutoDeviceUsesEveryGpuOrThePlainCpuPath) {
  Harness h(route_line() + " ! " + expert_line(adapter_dir(), "device=auto"));
  const std::vector<float> rows = random_rows(3, 52);
  const gstmoe::BatchRecords records = records_for(3);
  ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);
  expect_close(buffer_floats(out), engine().apply(as_tensor(rows)).embeddings, 1e-4);
  gst_buffer_unref(out);
  std::string why;
  const int gpus = moe::kernels::cuda_device_count(&why);
  EXPECT_EQ(read_executor_stats(h).devices.size(), static_cast<size_t>(gpus)) << why;
}

// The executor's cache budget is a share of the memory the encoders upstream left free, so it is
// built when first needed (here: the caps), not when moe-expert starts - which is before the
// elements upstream of it start and load their models.
TEST_F(RouteExpertTest, ExecutorIsBuiltWhenFirstNeededNotAtStart) {
  GstHarness* h = gst_harness_new_parse(expert_line(adapter_dir(), "precision=fp16").c_str());
  gst_harness_play(h);
  GstElement* e = gst_bin_get_by_name(GST_BIN(h->element), "expert");
  ASSERT_NE(e, nullptr);
  auto devices = [&] {
    GstStructure* s = nullptr;
    g_object_get(e, "stats", &s, nullptr);
    const guint n = gst_value_array_get_size(gst_structure_get_value(s, "devices"));
    gst_structure_free(s);
    return n;
  };
  EXPECT_EQ(devices(), 0u);  // started, no caps yet
  gst_harness_set_src_caps(h, gstmoe::tensor_caps(kWidth));
  EXPECT_EQ(devices(), 1u);
  gst_object_unref(e);
  gst_harness_teardown(h);
}

// Reduced precision on the CPU runs through the expert executor, the GPU code path: moe-route
// preloads every batch through the meta, moe-expert computes with the handle and drops it.
TEST_F(RouteExpertTest, ReducedPrecisionRunsOnTheExecutorWithPreload) {
  for (const auto& p : std::vector<std::pair<const char*, moe::kernels::WeightType>>{
           {"fp16", moe::kernels::WeightType::F16}, {"bf16", moe::kernels::WeightType::BF16}}) {
    SCOPED_TRACE(p.first);
    Harness h(route_line() + " ! " + expert_line(adapter_dir(), std::string("precision=") + p.first));
    moe::ExpertExecutorOptions options;
    options.precision = p.second;
    moe::ExpertExecutor reference(engine().layer(), "cpu", options);
    size_t listed = 0;
    for (unsigned b = 0; b < 3; ++b) {
      const std::vector<float> rows = random_rows(5 + b, 60 + b);
      const gstmoe::BatchRecords records = records_for(5 + b);
      ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
      GstBuffer* out = h.pull();
      ASSERT_NE(out, nullptr);
      const moe::Routing routing = engine().route(as_tensor(rows));
      listed += distinct_experts(routing);
      const std::vector<float> got = buffer_floats(out);
      expect_close(got, reference.run(as_tensor(rows), routing, nullptr));
      expect_close(got, engine().apply_experts(as_tensor(rows), routing), 3e-2);  // only rounded weights
      const gstmoe::BatchRecords& meta = records_of(out);
      expect_routing(meta, routing);
      EXPECT_EQ(meta.expert_prefetch, nullptr);  // moe-expert dropped the handle: the batch is done
      for (const gstmoe::RequestRecord& r : meta.rows) EXPECT_TRUE(has_timing(r, "expert"));
      gst_buffer_unref(out);
    }
    const ExecutorStats stats = read_executor_stats(h);
    EXPECT_EQ(stats.batches_prefetched, 3u);  // every batch arrived preloaded by moe-route
    EXPECT_EQ(stats.placement_changes, 0u);   // one device: nothing to re-place
    ASSERT_EQ(stats.devices.size(), 1u);
    const DeviceCounters& d = stats.devices[0];
    EXPECT_EQ(d.device, "cpu");
    EXPECT_EQ(d.experts, static_cast<guint>(kExperts));
    EXPECT_EQ(d.slots, kExperts);  // 85% of the free host memory holds all of them
    EXPECT_GT(d.budget_bytes, 0u);
    EXPECT_EQ(d.hits + d.misses, listed);
    EXPECT_EQ(d.slot_bytes, moe::HostExpertStore::blob_bytes(p.second, kWidth, 24));
    EXPECT_EQ(d.bytes_copied, d.misses * d.slot_bytes);
    EXPECT_EQ(d.resident_bytes, d.resident * d.slot_bytes);
    EXPECT_EQ(d.evictions, 0u);
    EXPECT_EQ(d.resident, d.misses);
    EXPECT_LE(d.copies_hidden + d.copies_exposed, d.misses);
    EXPECT_GE(d.exposed_wait_ms, 0.0);
    EXPECT_EQ(d.pinned, 0u);  // no batch in flight
  }
}

// precision=int4: the shipped 4-bit adapter runs as stored, on the plain CPU path (the engine's
// own numbers, bit for bit); fp16 with that adapter runs the same (no widening); an adapter that is
// not 4-bit is refused, naming it and how to make one.
TEST_F(RouteExpertTest, Int4RunsAFourBitAdapterAsStoredAndRefusesOthers) {
  const std::string int4_dir = std::string(MOE_SOURCE_DIR) + "/models/default/adapter-int4";
  const moe::MoeAdapter int4 = moe::MoeAdapter::load(int4_dir);
  const int width = int4.layer().config().hidden_size;
  for (const char* precision : {"int4", "fp16"}) {
    SCOPED_TRACE(precision);
    Harness h("moe-route name=route model=\"" + int4_dir + "\" ! " +
                  expert_line(int4_dir, std::string("precision=") + precision),
              width);
    for (unsigned b = 0; b < 2; ++b) {
      const std::vector<float> rows = random_rows(6, 90 + b, width);
      const gstmoe::BatchRecords records = records_for(6);
      ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
      GstBuffer* out = h.pull();
      ASSERT_NE(out, nullptr);
      expect_close(buffer_floats(out), int4.apply(as_tensor(rows, width)).embeddings, 0.0);
      gst_buffer_unref(out);
    }
    EXPECT_TRUE(read_executor_stats(h).devices.empty());  // the plain CPU path
  }
  const std::string error = start_error(expert_line(adapter_dir(), "precision=int4"));
  expect_contains(error, adapter_dir());
  expect_contains(error, "f32");
  expect_contains(error, "tools/moe-quantize.py");
  // moe-encode's precision does not offer int4 (its encoder has no 4-bit weights).
  GEnumClass* encode = G_ENUM_CLASS(g_type_class_ref(GST_TYPE_MOE_PRECISION));
  EXPECT_EQ(g_enum_get_value_by_nick(encode, "int4"), nullptr);
  g_type_class_unref(encode);
}

// On a GPU the executor copies and caches the 4-bit experts packed: its slots are the packed bytes.
TEST_F(RouteExpertTest, Int4OnCudaCachesThePackedExperts) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  const std::string int4_dir = std::string(MOE_SOURCE_DIR) + "/models/default/adapter-int4";
  const moe::MoeAdapter int4 = moe::MoeAdapter::load(int4_dir);
  const int width = int4.layer().config().hidden_size;
  Harness h("moe-route name=route model=\"" + int4_dir + "\" ! queue ! " +
                expert_line(int4_dir, "device=cuda:0 precision=int4"),
            width);
  for (unsigned b = 0; b < 3; ++b) {
    const std::vector<float> rows = random_rows(16, 95 + b, width);
    const gstmoe::BatchRecords records = records_for(16);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    // CUDA rounds the activations to the scales' type beyond a few rows (backend.h).
    expect_close(buffer_floats(out), int4.apply(as_tensor(rows, width)).embeddings, 1e-2);
    gst_buffer_unref(out);
  }
  const ExecutorStats stats = read_executor_stats(h);
  ASSERT_EQ(stats.devices.size(), 1u);
  const DeviceCounters& d = stats.devices[0];
  EXPECT_EQ(d.slot_bytes * static_cast<guint64>(int4.layer().config().num_experts),
            static_cast<guint64>(int4.layer().expert_bytes()));
  EXPECT_EQ(d.bytes_copied, d.misses * d.slot_bytes);
  EXPECT_EQ(d.resident_bytes, d.resident * d.slot_bytes);
}

TEST_F(RouteExpertTest, PreloadCrossesAQueue) {
  Harness h(route_line() + " ! queue ! " + expert_line(adapter_dir(), "precision=fp16"));
  moe::ExpertExecutorOptions options;
  options.precision = moe::kernels::WeightType::F16;
  moe::ExpertExecutor reference(engine().layer(), "cpu", options);
  std::vector<std::vector<float>> batches;
  for (unsigned b = 0; b < 6; ++b) {
    batches.push_back(random_rows(4, 70 + b));
    const gstmoe::BatchRecords records = records_for(4, "b" + std::to_string(b) + "-");
    ASSERT_EQ(h.push(tensor_buffer(batches.back(), &records)), GST_FLOW_OK);
  }
  for (unsigned b = 0; b < 6; ++b) {
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    const moe::Tensor x = as_tensor(batches[b]);
    expect_close(buffer_floats(out), reference.run(x, engine().route(x), nullptr));
    EXPECT_EQ(records_of(out).rows[0].id, "b" + std::to_string(b) + "-0");
    gst_buffer_unref(out);
  }
  EXPECT_EQ(read_executor_stats(h).batches_prefetched, 6u);
}

TEST_F(RouteExpertTest, CudaDeviceRunsTheExpertsWithPreload) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  for (const char* precision : {"fp32", "fp16"}) {
    SCOPED_TRACE(precision);
    Harness h(route_line() + " ! queue ! " +
              expert_line(adapter_dir(), std::string("device=cuda:0 precision=") + precision));
    for (unsigned b = 0; b < 4; ++b) {
      const std::vector<float> rows = random_rows(16, 80 + b);
      const gstmoe::BatchRecords records = records_for(16);
      ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
      GstBuffer* out = h.pull();
      ASSERT_NE(out, nullptr);
      expect_close(buffer_floats(out), engine().apply(as_tensor(rows)).embeddings,
                   std::string(precision) == "fp32" ? 1e-4 : 5e-3);
      gst_buffer_unref(out);
    }
    const ExecutorStats stats = read_executor_stats(h);
    EXPECT_EQ(stats.batches_prefetched, 4u);
    ASSERT_EQ(stats.devices.size(), 1u);
    EXPECT_EQ(stats.devices[0].device, "cuda:0");
    EXPECT_GT(stats.devices[0].misses, 0u);
    EXPECT_EQ(stats.devices[0].pinned, 0u);
  }
}

TEST_F(RouteExpertTest, ExpertWithoutRouteIsAnError) {
  Harness h(expert_line());
  const gstmoe::BatchRecords records = records_for(2);
  EXPECT_EQ(h.push(tensor_buffer(random_rows(2, 8), &records)), GST_FLOW_ERROR);
  const std::string error = pop_error(h.bus);
  expect_contains(error, "no routing in the meta of row 0: place moe-route before moe-expert");
}

TEST_F(RouteExpertTest, ExpertOutsideTheAdapterIsAnError) {
  Harness h(expert_line());
  gstmoe::BatchRecords records = records_for(2);
  for (gstmoe::RequestRecord& r : records.rows) {
    r.experts = {1, 0};
    r.expert_weights = {0.6f, 0.4f};
  }
  records.rows[1].experts = {7, 1};
  records.adapter = "adapter_big";
  EXPECT_EQ(h.push(tensor_buffer(random_rows(2, 9), &records)), GST_FLOW_ERROR);
  const std::string error = pop_error(h.bus);
  expect_contains(error, "row 1");
  expect_contains(error, "expert 7");
  expect_contains(error, adapter_dir());
  expect_contains(error, "adapter_big");
}

TEST_F(RouteExpertTest, DifferentAdaptersMustMatch) {
  // Same configuration in another directory: allowed.
  {
    moe::test::TempDir copy;
    for (const char* f : {"adapter_config.json", "adapter.safetensors"})
      ASSERT_EQ(symlink((adapter_dir() + "/" + f).c_str(), copy.file(f).c_str()), 0);
    {
      Harness h(route_line() + " ! " + expert_line(copy.path()));
      const std::vector<float> rows = random_rows(4, 11);
      const gstmoe::BatchRecords records = records_for(4);
      ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
      GstBuffer* out = h.pull();
      ASSERT_NE(out, nullptr);
      expect_close(buffer_floats(out), engine().apply(as_tensor(rows)).embeddings);
      gst_buffer_unref(out);
    }
  }
  // Routing by another adapter's router (same shapes, other weights) also shapes the rows: the
  // meta's fingerprint names both, so an index built with one pair refuses the other.
  {
    TempAdapter router(kExperts);
    Harness h("moe-route model=\"" + router.dir() + "\" ! " + expert_line());
    const gstmoe::BatchRecords records = records_for(3);
    ASSERT_EQ(h.push(tensor_buffer(random_rows(3, 13), &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    EXPECT_EQ(records_of(out).adapter_fingerprint,
              engine().fingerprint() + "+" + moe::MoeAdapter::load(router.dir()).fingerprint());
    gst_buffer_unref(out);
  }
  // 4 experts upstream, 6 in moe-expert: refused before any buffer is processed.
  TempAdapter other(4);
  Pipeline p("moe-route model=\"" + other.dir() + "\" ! " + expert_line(), kWidth);
  ASSERT_NE(gst_element_set_state(p.pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  gst_app_src_push_buffer(GST_APP_SRC(p.src), tensor_buffer(random_rows(2, 12), nullptr));
  const std::string error = pop_error(p.bus);
  expect_contains(error, other.dir());
  expect_contains(error, adapter_dir());
  expect_contains(error, "4 experts");
  expect_contains(error, "6 experts");
}

TEST_F(RouteExpertTest, StateCyclesReleaseTheAdapter) {
  for (const char* extra : {"", "precision=fp16"}) {
    SCOPED_TRACE(extra);
    const double tol = *extra ? 5e-3 : 1e-6;
    Pipeline p(route_line() + " ! " + expert_line(adapter_dir(), extra), kWidth);
    for (unsigned cycle = 0; cycle < 3; ++cycle) {
      ASSERT_NE(gst_element_set_state(p.pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << "cycle " << cycle;
      const std::vector<float> rows = random_rows(2, 40 + cycle);
      const gstmoe::BatchRecords records = records_for(2);
      ASSERT_EQ(gst_app_src_push_buffer(GST_APP_SRC(p.src), tensor_buffer(rows, &records)), GST_FLOW_OK);
      GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(p.sink), 10 * GST_SECOND);
      ASSERT_NE(sample, nullptr) << "cycle " << cycle << ": " << pop_error(p.bus);
      expect_close(buffer_floats(gst_sample_get_buffer(sample)), engine().apply(as_tensor(rows)).embeddings, tol);
      gst_sample_unref(sample);

      // The elements hold the cached adapter while running and let go of it in NULL.
      std::weak_ptr<const moe::MoeAdapter> cached = moe::shared_moe_adapter(adapter_dir());
      ASSERT_EQ(gst_element_set_state(p.pipeline, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
      EXPECT_TRUE(cached.expired()) << "cycle " << cycle;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Hybrid requests (issue 18): moe-route fuses a hybrid row's image embedding (the row) with its
// text embedding (the record) before routing it.

// A batch of text, image, tensor and hybrid rows; the hybrid records carry their text embedding.
struct MixedBatch {
  std::vector<float> rows;
  gstmoe::BatchRecords records;
  std::vector<size_t> hybrid;      // row numbers
  std::vector<float> image, text;  // the hybrid rows' two embeddings, [hybrid.size(), kWidth]
};

// `offset`: added to every value of both embeddings.
MixedBatch mixed_batch(unsigned seed, float offset = 0.0f) {
  const std::vector<gstmoe::Modality> modalities = {gstmoe::Modality::Text,   gstmoe::Modality::Hybrid,
                                                    gstmoe::Modality::Image,  gstmoe::Modality::Hybrid,
                                                    gstmoe::Modality::Tensor, gstmoe::Modality::Hybrid};
  MixedBatch b;
  b.rows = random_rows(modalities.size(), seed);
  b.records = records_for(modalities.size());
  std::vector<float> texts = random_rows(modalities.size(), seed + 1000);
  for (std::vector<float>* v : {&b.rows, &texts})
    for (float& x : *v) x += offset;
  for (size_t i = 0; i < modalities.size(); ++i) {
    b.records.rows[i].modality = modalities[i];
    if (modalities[i] != gstmoe::Modality::Hybrid) continue;
    b.hybrid.push_back(i);
    const auto row = [&](const std::vector<float>& v) { return v.begin() + static_cast<std::ptrdiff_t>(i * kWidth); };
    b.records.rows[i].text_embedding.assign(row(texts), row(texts) + kWidth);
    b.image.insert(b.image.end(), row(b.rows), row(b.rows) + kWidth);
    b.text.insert(b.text.end(), row(texts), row(texts) + kWidth);
  }
  return b;
}

// Without a gate the fusion is the plain average (fuse()'s contract), with one the engine's gate;
// the other rows pass bit for bit; every row is routed as the engine routes the fused batch.
TEST_F(RouteExpertTest, RouteFusesHybridRowsOnly) {
  TempAdapter gated(kExperts, "", true);
  for (const std::string& dir : {adapter_dir(), gated.dir()}) {
    SCOPED_TRACE(dir);
    const moe::MoeAdapter adapter = moe::MoeAdapter::load(dir);
    const bool gate = dir != adapter_dir();
    ASSERT_EQ(adapter.has_cross_modal_gate(), gate);
    Harness h("moe-route name=route model=\"" + dir + "\"");
    const MixedBatch b = mixed_batch(gate ? 120 : 110);
    ASSERT_EQ(h.push(tensor_buffer(b.rows, &b.records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);

    moe::Tensor weights;
    const moe::Tensor fused = adapter.fuse(as_tensor(b.image), as_tensor(b.text), &weights);
    std::vector<float> want = b.rows;
    for (size_t j = 0; j < b.hybrid.size(); ++j) {
      for (int d = 0; d < kWidth; ++d) {
        const size_t k = j * kWidth + static_cast<size_t>(d);
        want[b.hybrid[j] * kWidth + static_cast<size_t>(d)] = fused.data<float>()[k];
        if (!gate) {
          EXPECT_NEAR(fused.data<float>()[k], 0.5f * (b.image[k] + b.text[k]), 1e-6);
        }
      }
    }
    const std::vector<float> got = buffer_floats(out);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const bool hybrid = std::count(b.hybrid.begin(), b.hybrid.end(), i / kWidth) > 0;
      if (hybrid) {
        EXPECT_NEAR(got[i], want[i], 1e-6) << "element " << i;
      } else {
        EXPECT_EQ(got[i], want[i]) << "element " << i;  // untouched
      }
    }
    const gstmoe::BatchRecords& meta = records_of(out);
    expect_routing(meta, adapter.route(as_tensor(want)));
    for (size_t i = 0, j = 0; i < meta.rows.size(); ++i) {
      const gstmoe::RequestRecord& r = meta.rows[i];
      EXPECT_TRUE(r.text_embedding.empty()) << "row " << i;
      if (r.modality != gstmoe::Modality::Hybrid) {
        EXPECT_FALSE(r.fusion) << "row " << i;
        continue;
      }
      ASSERT_TRUE(r.fusion) << "row " << i;
      EXPECT_EQ(r.fusion->method, gate ? "gate" : "average");
      EXPECT_NEAR(r.fusion->image, weights.data<float>()[2 * j], 1e-6);
      EXPECT_NEAR(r.fusion->text, weights.data<float>()[2 * j + 1], 1e-6);
      EXPECT_NEAR(r.fusion->image + r.fusion->text, 1.0f, 1e-6);
      if (!gate) {
        EXPECT_EQ(r.fusion->image, 0.5f);
      }
      ++j;
    }
    gst_buffer_unref(out);
  }
}

// The experts run on the fused rows: route + experts equal the adapter applied to them.
TEST_F(RouteExpertTest, HybridRowsReachTheExpertsFused) {
  TempAdapter gated(kExperts, "", true);
  const moe::MoeAdapter adapter = moe::MoeAdapter::load(gated.dir());
  Harness h("moe-route model=\"" + gated.dir() + "\" ! " + expert_line(gated.dir()));
  const MixedBatch b = mixed_batch(130);
  ASSERT_EQ(h.push(tensor_buffer(b.rows, &b.records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);
  const moe::Tensor fused = adapter.fuse(as_tensor(b.image), as_tensor(b.text), nullptr);
  std::vector<float> input = b.rows;
  for (size_t j = 0; j < b.hybrid.size(); ++j)
    std::copy(fused.data<float>() + j * kWidth, fused.data<float>() + (j + 1) * kWidth,
              input.begin() + static_cast<std::ptrdiff_t>(b.hybrid[j] * kWidth));
  expect_close(buffer_floats(out), adapter.apply(as_tensor(input)).embeddings, 1e-6);
  gst_buffer_unref(out);
}

// One batch of text, image, tensor and hybrid rows through an adapter with joint experts: the
// hybrid rows are routed among all experts (to the joint ones here) and adapted as the adapter
// adapts fused rows; the others never reach a joint expert and come out as from adapter_tiny.
TEST_F(RouteExpertTest, OnlyHybridRowsReachTheJointExperts) {
  const moe::test::TempDir joint_dir;
  const std::string joint = moe::test::write_joint_adapter(joint_dir, 2);
  const moe::MoeAdapter adapter = moe::MoeAdapter::load(joint);
  ASSERT_EQ(adapter.num_joint_experts(), 2);
  Harness h("moe-route model=\"" + joint + "\" ! " + expert_line(joint));
  const MixedBatch b = mixed_batch(150, 3.0f);
  ASSERT_EQ(h.push(tensor_buffer(b.rows, &b.records)), GST_FLOW_OK);
  GstBuffer* out = h.pull();
  ASSERT_NE(out, nullptr);
  const std::vector<float> got = buffer_floats(out);
  const gstmoe::BatchRecords& meta = records_of(out);

  const moe::Tensor fused = adapter.fuse(as_tensor(b.image), as_tensor(b.text), nullptr);
  const moe::AdapterOutput hybrid_want =
      adapter.apply(fused, moe::MoeLayer::FusedRows(static_cast<size_t>(fused.dim(0)), true));
  std::vector<float> single_rows;
  for (size_t i = 0; i < meta.rows.size(); ++i)
    if (std::count(b.hybrid.begin(), b.hybrid.end(), i) == 0)
      single_rows.insert(single_rows.end(), b.rows.begin() + static_cast<std::ptrdiff_t>(i * kWidth),
                         b.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * kWidth));
  const moe::AdapterOutput single_want = engine().apply(as_tensor(single_rows));

  for (size_t i = 0, hybrid = 0, single = 0; i < meta.rows.size(); ++i) {
    const gstmoe::RequestRecord& r = meta.rows[i];
    const bool is_hybrid = r.modality == gstmoe::Modality::Hybrid;
    const moe::AdapterOutput& want = is_hybrid ? hybrid_want : single_want;
    const int64_t row = static_cast<int64_t>(is_hybrid ? hybrid++ : single++);
    ASSERT_EQ(r.experts.size(), static_cast<size_t>(kTopK)) << "row " << i;
    for (int j = 0; j < kTopK; ++j) {
      EXPECT_EQ(r.experts[static_cast<size_t>(j)], want.routing.expert(row, j)) << "row " << i << " slot " << j;
      EXPECT_NEAR(r.expert_weights[static_cast<size_t>(j)], want.routing.weight(row, j), 1e-6) << "row " << i;
      EXPECT_EQ(r.experts[static_cast<size_t>(j)] >= kExperts, is_hybrid) << "row " << i << " slot " << j;
    }
    for (int d = 0; d < kWidth; ++d)
      EXPECT_NEAR(got[i * kWidth + static_cast<size_t>(d)], want.embeddings.data<float>()[row * kWidth + d], 1e-6)
          << "row " << i;
  }
  gst_buffer_unref(out);
}

// top-k must fit the experts every request may use: the joint ones are only for hybrid requests.
TEST_F(RouteExpertTest, TopKAboveTheNonJointExpertsFailsAtStart) {
  const moe::test::TempDir joint_dir;
  const std::string error =
      start_error("moe-route top-k=7 model=\"" + moe::test::write_joint_adapter(joint_dir, 2) + "\"");
  expect_contains(error, "top-k=7 exceeds the 6 experts of the MoE adapter");
  expect_contains(error, "that every request may use");
  expect_contains(error, "2 of its 8 are joint visual-text experts");
}

TEST_F(RouteExpertTest, HybridRowWithAWrongTextEmbeddingIsAnError) {
  Harness h(route_line());
  MixedBatch b = mixed_batch(140);
  b.records.rows[3].text_embedding.pop_back();
  EXPECT_EQ(h.push(tensor_buffer(b.rows, &b.records)), GST_FLOW_ERROR);
  const std::string error = pop_error(h.bus);
  expect_contains(error, "row 3 (hybrid request 'q3')");
  expect_contains(error, "15 values");
}

// ------------------------------------------------------------------------------------------
// Hot swap (issue 17): `model` set while playing.

// The next element message named `name` from the element named `element`; fails on an error or a
// warning, or after 10 s.
void wait_for_message(GstBus* bus, const std::string& element, const char* name) {
  for (;;) {
    GstMessage* msg = gst_bus_timed_pop_filtered(
        bus, 10 * GST_SECOND,
        static_cast<GstMessageType>(GST_MESSAGE_ELEMENT | GST_MESSAGE_ERROR | GST_MESSAGE_WARNING));
    ASSERT_NE(msg, nullptr) << "no " << name << " from " << element << " within 10 s";
    if (GST_MESSAGE_TYPE(msg) != GST_MESSAGE_ELEMENT) {
      GError* err = nullptr;
      gchar* debug = nullptr;
      if (GST_MESSAGE_TYPE(msg) == GST_MESSAGE_ERROR) {
        gst_message_parse_error(msg, &err, &debug);
      } else {
        gst_message_parse_warning(msg, &err, &debug);
      }
      const std::string text = err->message;
      g_error_free(err);
      g_free(debug);
      gst_message_unref(msg);
      FAIL() << "waiting for " << name << ": " << text;
    }
    const bool found = gst_structure_has_name(gst_message_get_structure(msg), name) &&
                       element == GST_OBJECT_NAME(GST_MESSAGE_SRC(msg));
    gst_message_unref(msg);
    if (found) return;
  }
}

// The first warning on `bus` within 10 s, "" when none came.
std::string pop_warning(GstBus* bus) {
  GstMessage* msg = gst_bus_timed_pop_filtered(bus, 10 * GST_SECOND, GST_MESSAGE_WARNING);
  if (!msg) return "";
  GError* err = nullptr;
  gst_message_parse_warning(msg, &err, nullptr);
  std::string text = err->message;
  g_error_free(err);
  gst_message_unref(msg);
  return text;
}

std::string stats_string(GstElement* e, const char* field) {
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  const gchar* v = gst_structure_get_string(s, field);
  std::string out = v ? v : "(none)";
  gst_structure_free(s);
  return out;
}

guint64 stats_uint64(GstElement* e, const char* field) {
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  guint64 v = G_MAXUINT64;
  EXPECT_TRUE(gst_structure_get_uint64(s, field, &v)) << field;
  gst_structure_free(s);
  return v;
}

guint stats_uint(GstElement* e, const char* field) {
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  guint v = G_MAXUINT;
  EXPECT_TRUE(gst_structure_get_uint(s, field, &v)) << field;
  gst_structure_free(s);
  return v;
}

std::string model_of(GstElement* e) {
  gchar* dir = nullptr;
  g_object_get(e, "model", &dir, nullptr);
  std::string out = dir ? dir : "";
  g_free(dir);
  return out;
}

// Batches flow from one thread into moe-route ! queue ! moe-expert and out to another while the
// documented swap runs (moe-expert's model, then moe-route's): every batch comes out once, in
// order, computed by exactly one adapter - the old one up to the switch point, the new one after -
// and says which in its fingerprint. moe-expert holds both adapters between the two settings and
// keeps running the old one's batches on the old experts; on the executor path every batch,
// before and after the switch, arrives preloaded on the executor that runs it.
TEST_F(RouteExpertTest, HotSwapUnderLoadAnswersEveryBatchWithOneAdapter) {
  TempAdapter next(kExperts);
  const moe::MoeAdapter& old_adapter = engine();
  const moe::MoeAdapter new_adapter = moe::MoeAdapter::load(next.dir());
  ASSERT_NE(old_adapter.fingerprint(), new_adapter.fingerprint());
  struct Variant {
    std::string extra;  // moe-expert's properties
    double tol;         // against the reference on the CPU
  };
  std::vector<Variant> variants = {{"", 1e-6}, {"precision=fp16", 1e-6}};
  std::string why;
  if (moe::kernels::cuda_device_count(&why) > 0) variants.push_back({"device=cuda:0 precision=fp16", 1e-2});
  for (const Variant& variant : variants) {
    const std::string& extra = variant.extra;
    SCOPED_TRACE(extra.empty() ? "fp32" : extra);
    const bool executor = !extra.empty();
    moe::ExpertExecutorOptions options;
    options.precision = moe::kernels::WeightType::F16;
    // The reference of each adapter: the engine, or an executor like moe-expert's.
    std::vector<std::unique_ptr<moe::ExpertExecutor>> references;
    if (executor)
      for (const moe::MoeAdapter* a : {&old_adapter, &new_adapter})
        references.push_back(std::make_unique<moe::ExpertExecutor>(a->layer(), "cpu", options));
    const auto reference = [&](size_t which, const std::vector<float>& rows) {
      const moe::MoeAdapter& a = which == 0 ? old_adapter : new_adapter;
      const moe::Tensor x = as_tensor(rows);
      return executor ? references[which]->run(x, a.route(x), nullptr) : a.apply(x).embeddings;
    };

    Pipeline p(route_line() + " ! queue ! " + expert_line(adapter_dir(), extra), kWidth);
    GstElement* route = gst_bin_get_by_name(GST_BIN(p.pipeline), "route");
    GstElement* expert = gst_bin_get_by_name(GST_BIN(p.pipeline), "expert");
    ASSERT_NE(gst_element_set_state(p.pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);

    constexpr size_t kRows = 4;
    const auto input = [](size_t n) { return random_rows(kRows, 1000 + static_cast<unsigned>(n)); };
    std::atomic<size_t> pushed{0}, pulled{0}, last{SIZE_MAX};
    std::thread pusher([&] {  // until told the last batch
      for (size_t n = 0; n < last.load(); ++n) {
        while (n > pulled.load() + 8) g_usleep(200);  // a few batches in flight, no more
        const gstmoe::BatchRecords records = records_for(kRows, "b" + std::to_string(n) + "-");
        if (gst_app_src_push_buffer(GST_APP_SRC(p.src), tensor_buffer(input(n), &records)) != GST_FLOW_OK) break;
        pushed = n + 1;
        g_usleep(500);
      }
      gst_app_src_end_of_stream(GST_APP_SRC(p.src));
    });
    struct Output {
      std::vector<float> data;
      std::string first_id, router, adapter;
    };
    std::vector<Output> outputs;
    std::thread puller([&] {
      while (GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(p.sink), 10 * GST_SECOND)) {
        GstBuffer* buf = gst_sample_get_buffer(sample);
        const gstmoe::BatchRecords& r = records_of(buf);
        outputs.push_back(
            {buffer_floats(buf), r.rows.empty() ? "" : r.rows[0].id, r.router_fingerprint, r.adapter_fingerprint});
        gst_sample_unref(sample);
        ++pulled;
      }
    });
    const auto wait_pulled = [&](size_t n) {
      for (int i = 0; i < 10000 && pulled.load() < n; ++i) g_usleep(1000);
      EXPECT_GE(pulled.load(), n);
    };

    wait_pulled(5);
    g_object_set(expert, "model", next.dir().c_str(), nullptr);
    EXPECT_EQ(model_of(expert), next.dir());
    wait_for_message(p.bus, "expert", "moe-adapter-loaded");
    wait_pulled(pulled.load() + 5);
    // Both held; the old router's batches still run on the old experts.
    EXPECT_EQ(stats_uint(expert, "adapters"), 2u);
    EXPECT_EQ(stats_string(expert, "fingerprint"), old_adapter.fingerprint());
    EXPECT_EQ(stats_uint64(expert, "swaps"), 0u);
    g_object_set(route, "model", next.dir().c_str(), nullptr);
    wait_for_message(p.bus, "route", "moe-adapter-loaded");
    wait_for_message(p.bus, "route", "moe-adapter-swap");
    wait_for_message(p.bus, "expert", "moe-adapter-swap");
    wait_pulled(pulled.load() + 10);
    last = pushed.load() + 10;  // batches pushed from now on are routed by the new adapter
    pusher.join();
    puller.join();
    ASSERT_TRUE(gst_app_sink_is_eos(GST_APP_SINK(p.sink))) << pop_error(p.bus);

    ASSERT_EQ(outputs.size(), pushed.load());  // none lost, none duplicated
    size_t switch_point = outputs.size();
    for (size_t n = 0; n < outputs.size(); ++n) {
      SCOPED_TRACE("batch " + std::to_string(n));
      const Output& o = outputs[n];
      EXPECT_EQ(o.first_id, "b" + std::to_string(n) + "-0");  // in order
      const size_t which = o.router == old_adapter.fingerprint() ? 0 : o.router == new_adapter.fingerprint() ? 1 : 2;
      ASSERT_LT(which, 2u) << "routed by an unknown adapter " << o.router;
      if (which == 1 && switch_point == outputs.size()) switch_point = n;
      EXPECT_EQ(which, n < switch_point ? 0u : 1u) << "an old batch after the switch point " << switch_point;
      EXPECT_EQ(o.adapter, o.router);  // the experts of the adapter that routed it
      expect_close(o.data, reference(which, input(n)), variant.tol);
    }
    EXPECT_GE(switch_point, 10u);
    EXPECT_LE(switch_point + 10, outputs.size());

    EXPECT_EQ(model_of(route), next.dir());
    EXPECT_EQ(model_of(expert), next.dir());
    for (GstElement* e : {route, expert}) {
      EXPECT_EQ(stats_string(e, "fingerprint"), new_adapter.fingerprint());
      EXPECT_EQ(stats_uint64(e, "swaps"), 1u);
    }
    EXPECT_EQ(stats_uint(expert, "adapters"), 1u);  // the old one went after the switch
    if (executor) {
      EXPECT_EQ(stats_uint64(expert, "batches-prefetched"), outputs.size());
    }
    gst_object_unref(route);
    gst_object_unref(expert);
    // Nothing of either adapter outlives the run.
    const std::weak_ptr<const moe::MoeAdapter> old_cached = moe::shared_moe_adapter(adapter_dir());
    const std::weak_ptr<const moe::MoeAdapter> new_cached = moe::shared_moe_adapter(next.dir());
    ASSERT_EQ(gst_element_set_state(p.pipeline, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
    EXPECT_TRUE(old_cached.expired());
    EXPECT_TRUE(new_cached.expired());
  }
}

// A model that cannot be loaded, or that does not fit the rows, leaves the adapter in use serving:
// a warning names both, and 'model' reads the one in use again.
TEST_F(RouteExpertTest, HotSwapToAnUnusableModelKeepsTheOldOne) {
  const std::string missing = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/no_such_adapter";
  const std::string wide = std::string(MOE_SOURCE_DIR) + "/models/default/adapter";
  const int wide_hidden = moe::MoeAdapter::load(wide).layer().config().hidden_size;
  ASSERT_NE(wide_hidden, kWidth);
  Harness h(route_line() + " ! " + expert_line());
  unsigned seed = 150;
  const auto expect_old = [&] {
    const std::vector<float> rows = random_rows(3, seed++);
    const gstmoe::BatchRecords records = records_for(3);
    ASSERT_EQ(h.push(tensor_buffer(rows, &records)), GST_FLOW_OK);
    GstBuffer* out = h.pull();
    ASSERT_NE(out, nullptr);
    expect_close(buffer_floats(out), engine().apply(as_tensor(rows)).embeddings);
    EXPECT_EQ(records_of(out).adapter_fingerprint, engine().fingerprint());
    gst_buffer_unref(out);
  };
  expect_old();
  for (const char* name : {"route", "expert"}) {
    GstElement* e = h.element(name);
    for (const std::string& dir : {missing, wide}) {
      SCOPED_TRACE(std::string(name) + ": " + dir);
      g_object_set(e, "model", dir.c_str(), nullptr);
      const std::string warning = pop_warning(h.bus);
      expect_contains(warning, "cannot swap to the MoE adapter '" + dir + "'");
      expect_contains(warning, "still serving '" + adapter_dir() + "'");
      if (dir == wide)
        expect_contains(warning, "hidden_size is " + std::to_string(wide_hidden) + " but the rows have width 16");
      EXPECT_EQ(model_of(e), adapter_dir());
      expect_old();
    }
    EXPECT_EQ(stats_uint64(e, "swaps"), 0u);
    gst_object_unref(e);
  }
}

}  // namespace
