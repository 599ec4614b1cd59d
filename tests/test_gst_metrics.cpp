// The elements' Prometheus metrics (docs/metrics.md), read as Prometheus reads them: a query
// pipeline serves /metrics on a loopback port, requests go through it, and the scrape (a plain
// HTTP GET) counts them, by outcome and per stage; `promtool check metrics` accepts the scrape;
// a Prometheus server of our own (a temporary configuration and data folder, a free loopback port,
// stopped at the end) scrapes the service during a short load and answers a PromQL query with the
// number of requests sent, and every query of docs/grafana-gst-moe.json finds its series. An
// expert executor's cache counters are reported, and the memory each model holds on its device;
// every metric the dashboard names is in a scrape. Elements naming one address share its server; a
// port in use and an address without a port are element errors at start. The tests that need
// Debian's `prometheus` package (promtool, prometheus) are skipped, saying so, where it is not
// installed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gst/app/gstappsrc.h>
#include <gst/gst.h>
#include <gtest/gtest.h>
#include <json-glib/json-glib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "moe/ann_index.h"
#include "moe/clip_config.h"
#include "moe/model_cache.h"
#include "test_util.h"

namespace {

const std::string kModel = moe::test::fixture_path("clip_tiny_bpe");
const std::string kAdapter = moe::test::fixture_path("adapter_tiny");
// Generous liveness bound on a loaded 2-core CI machine (not a speed check).
constexpr auto kPatience = std::chrono::seconds(120);

// A loopback TCP port that nothing listens on now, and that this process has not been given
// before: a port is only bound some time after it is chosen (a pipeline takes two, the metrics
// server's and zmq-publish's), and the kernel may hand a just-closed port out again.
int free_port() {
  static std::set<int> given;
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      close(fd);
      return 0;
    }
    close(fd);
    const int port = ntohs(addr.sin_port);
    if (given.insert(port).second) return port;
  }
}

// GET http://127.0.0.1:PORT/TARGET with HTTP/1.0 (the server closes when done). False when the
// connection fails or the status is not 200; `body` gets the body.
bool http_get(int port, const std::string& target, std::string* body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return false;
  }
  const std::string request = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  bool ok = send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size());
  std::string response;
  char chunk[16384];
  for (ssize_t n; ok && (n = recv(fd, chunk, sizeof chunk, 0)) > 0;) response.append(chunk, static_cast<size_t>(n));
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  const bool status_ok = response.compare(0, 12, "HTTP/1.1 200") == 0 || response.compare(0, 12, "HTTP/1.0 200") == 0;
  if (!ok || header_end == std::string::npos || !status_ok) return false;
  *body = response.substr(header_end + 4);
  return true;
}

// A scrape in the text exposition format: sample ("name{labels}" as written) -> value.
using Samples = std::map<std::string, double>;

Samples parse_samples(const std::string& text) {
  Samples samples;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return samples;
}

bool scrape(int port, Samples* samples, std::string* text = nullptr) {
  std::string body;
  if (!http_get(port, "/metrics", &body)) return false;
  *samples = parse_samples(body);
  if (text) *text = body;
  return true;
}

// The value of `sample`, 0 when absent (a counter not yet incremented).
double value(const Samples& s, const std::string& sample) {
  const auto it = s.find(sample);
  return it == s.end() ? 0.0 : it->second;
}

// The sum over every sample of metric `name` (any labels, not its _bucket/_sum/_count series).
double sum_of(const Samples& s, const std::string& name) {
  double sum = 0;
  for (const auto& [sample, v] : s)
    if (sample == name || sample.rfind(name + "{", 0) == 0) sum += v;
  return sum;
}

// The metric families of a scrape (its "# TYPE name type" lines): name -> type.
std::map<std::string, std::string> families(const std::string& text) {
  std::map<std::string, std::string> found;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string hash, keyword, name, type;
    if (words >> hash >> keyword >> name >> type && hash == "#" && keyword == "TYPE") found[name] = type;
  }
  return found;
}

// Every PromQL expression of the Grafana dashboard (its panels' targets).
std::vector<std::string> dashboard_queries() {
  std::vector<std::string> queries;
  JsonParser* parser = json_parser_new();
  GError* error = nullptr;
  if (!json_parser_load_from_file(parser, moe::test::source_path("docs/grafana-gst-moe.json").c_str(), &error)) {
    ADD_FAILURE() << "docs/grafana-gst-moe.json: " << error->message;
    g_error_free(error);
  } else {
    JsonArray* panels = json_object_get_array_member(json_node_get_object(json_parser_get_root(parser)), "panels");
    for (guint p = 0; p < json_array_get_length(panels); ++p) {
      JsonArray* targets = json_object_get_array_member(json_array_get_object_element(panels, p), "targets");
      for (guint t = 0; t < json_array_get_length(targets); ++t)
        queries.push_back(json_object_get_string_member(json_array_get_object_element(targets, t), "expr"));
    }
  }
  g_object_unref(parser);
  return queries;
}

// The resident bytes of CLIP's weights in f32 that the engine keeps in backend memory, from the
// architecture of Hugging Face's CLIPModel: every parameter but the text token and position
// embeddings (host memory); the class embedding is folded into the vision positions.
double clip_f32_backend_bytes(const moe::ClipConfig& c) {
  const auto encoder = [](const moe::ClipEncoderConfig& e) {
    const double h = e.hidden_size, i = e.intermediate_size;
    const double layer = 4 * h /* two layer norms */ + 4 * (h * h + h) /* q, k, v, out */ + (i * h + i) + (h * i + h);
    return e.num_hidden_layers * layer;
  };
  const double p = c.projection_dim, ht = c.text.hidden_size, hv = c.vision.hidden_size;
  const double text = encoder(c.text) + 2 * ht /* final layer norm */ + p * ht;
  const double patch = hv * c.vision.num_channels * c.vision.patch_size * c.vision.patch_size;
  const double vision = patch + static_cast<double>(c.vision.num_positions()) * hv + 4 * hv /* pre, post norms */ +
                        encoder(c.vision) + p * hv;
  return 4 * (text + vision);
}

// The host's MemTotal in bytes (/proc/meminfo), 0 when unknown.
double host_memory_total() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  double kib = 0;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemTotal:") return kib * 1024;
  return 0;
}

// A flat index of random vectors of the adapter's width (searched unchecked: it records no models).
const std::string& index_path() {
  static const std::string path = [] {
    static moe::test::TempDir dir;
    const int width = moe::shared_moe_adapter(kAdapter)->layer().config().hidden_size;
    constexpr int kItems = 20;
    moe::AnnIndex index = moe::AnnIndex::create(width, {});
    std::vector<moe::AnnItem> items;
    for (int i = 0; i < kItems; ++i) items.push_back({"item" + std::to_string(i), "", "caption " + std::to_string(i)});
    index.add(moe::test::random_unit_vectors(kItems, width, 7).data(), kItems, items);
    index.save(dir.file("catalog.faiss"));
    return dir.file("catalog.faiss");
  }();
  return path;
}

// The query pipeline from appsrc (one text request per buffer) to zmq-publish, which serves the
// metrics on 127.0.0.1:metrics_port; `expert_settings` are moe-expert's; moe-encode, moe-expert and
// ann-query run on `device`.
class QueryPipeline {
 public:
  explicit QueryPipeline(int metrics_port, const std::string& expert_settings = "", const std::string& device = "cpu") {
    const std::string on = " device=" + device + " ";
    const std::string desc = "appsrc name=src caps=text/x-raw,format=utf8 format=bytes ! moe-encode model=\"" + kModel +
                             "\" max-batch=4" + on + "! moe-route model=\"" + kAdapter + "\" ! moe-expert model=\"" +
                             kAdapter + "\"" + on + expert_settings + " ! ann-query index=\"" + index_path() + "\"" +
                             on + "k=3 ! zmq-publish endpoint=tcp://127.0.0.1:" + std::to_string(free_port()) +
                             " metrics-address=127.0.0.1:" + std::to_string(metrics_port);
    GError* err = nullptr;
    pipeline_ = gst_parse_launch(desc.c_str(), &err);
    if (err) {
      ADD_FAILURE() << err->message;
      g_error_free(err);
    }
  }
  ~QueryPipeline() {
    if (!pipeline_) return;
    gst_element_set_state(pipeline_, GST_STATE_NULL);
    gst_object_unref(pipeline_);
  }
  QueryPipeline(const QueryPipeline&) = delete;
  QueryPipeline& operator=(const QueryPipeline&) = delete;

  // The models are loaded and the metrics served once this returns (the sink prerolls later, on
  // the first document).
  bool play() {
    if (!pipeline_) return false;
    if (gst_element_set_state(pipeline_, GST_STATE_PLAYING) != GST_STATE_CHANGE_FAILURE) return true;
    // Say why (a port taken, a model missing): the assertion alone shows only "false".
    GstBus* bus = gst_element_get_bus(pipeline_);
    while (GstMessage* m = gst_bus_pop_filtered(bus, GST_MESSAGE_ERROR)) {
      GError* e = nullptr;
      gst_message_parse_error(m, &e, nullptr);
      ADD_FAILURE() << GST_OBJECT_NAME(GST_MESSAGE_SRC(m)) << ": " << e->message;
      g_error_free(e);
      gst_message_unref(m);
    }
    gst_object_unref(bus);
    return false;
  }
  void push(const std::string& text) {
    GstElement* src = gst_bin_get_by_name(GST_BIN(pipeline_), "src");
    gst_app_src_push_buffer(GST_APP_SRC(src), gst_buffer_new_memdup(text.data(), text.size()));
    gst_object_unref(src);
  }
  // The element named `name` (a new reference).
  GstElement* element(const char* name) { return gst_bin_get_by_name(GST_BIN(pipeline_), name); }
  // Back to NULL, ready to play again (the elements keep what outlives runs, e.g. moe-encode's cache).
  void stop() { gst_element_set_state(pipeline_, GST_STATE_NULL); }
  // Ends the stream and waits until every request was answered (EOS at the sink); false on an error.
  bool finish() {
    GstElement* src = gst_bin_get_by_name(GST_BIN(pipeline_), "src");
    gst_app_src_end_of_stream(GST_APP_SRC(src));
    gst_object_unref(src);
    GstBus* bus = gst_element_get_bus(pipeline_);
    GstMessage* msg =
        gst_bus_timed_pop_filtered(bus, std::chrono::duration_cast<std::chrono::nanoseconds>(kPatience).count(),
                                   static_cast<GstMessageType>(GST_MESSAGE_EOS | GST_MESSAGE_ERROR));
    gst_object_unref(bus);
    const bool eos = msg && GST_MESSAGE_TYPE(msg) == GST_MESSAGE_EOS;
    if (msg) gst_message_unref(msg);
    return eos;
  }

 private:
  GstElement* pipeline_ = nullptr;
};

// The first error message posted on `pipeline`'s bus, or "" when none.
std::string bus_error(GstElement* pipeline) {
  GstBus* bus = gst_element_get_bus(pipeline);
  GstMessage* msg = gst_bus_pop_filtered(bus, GST_MESSAGE_ERROR);
  gst_object_unref(bus);
  if (!msg) return "";
  GError* err = nullptr;
  gst_message_parse_error(msg, &err, nullptr);
  const std::string text = err->message;
  g_error_free(err);
  gst_message_unref(msg);
  return text;
}

// The path of `program` on PATH, or "" when it is not installed.
std::string find_program(const char* program) {
  gchar* path = g_find_program_in_path(program);
  const std::string found = path ? path : "";
  g_free(path);
  return found;
}

class Metrics : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { gst_init(nullptr, nullptr); }
};

// Requests through the pipeline, then one that fails in moe-encode (not UTF-8): the scrape counts
// them by outcome, each stage's histogram counts every answered request once, and the batches,
// expert rows and published messages add up.
TEST_F(Metrics, ScrapeCountsRequestsAndStages) {
  const int port = free_port();
  QueryPipeline pipeline(port);
  ASSERT_TRUE(pipeline.play());
  Samples before;
  ASSERT_TRUE(scrape(port, &before)) << "no /metrics on 127.0.0.1:" << port;

  constexpr int kRequests = 9;
  for (int i = 0; i < kRequests; ++i) pipeline.push("query number " + std::to_string(i));
  pipeline.push("\xff\xfe not UTF-8");
  ASSERT_TRUE(pipeline.finish());
  Samples after;
  std::string text;
  ASSERT_TRUE(scrape(port, &after, &text));
  const auto delta = [&](const std::string& sample) { return value(after, sample) - value(before, sample); };

  EXPECT_EQ(delta(R"(gstmoe_requests_total{outcome="result"})"), kRequests) << text;
  EXPECT_EQ(delta(R"(gstmoe_requests_total{outcome="error"})"), 1);
  // Not UTF-8: refused by moe-encode as an invalid request (labels in Prometheus' order, by name).
  EXPECT_EQ(delta(R"(gstmoe_request_errors_total{code="invalid_request",stage="moe-encode"})"), 1) << text;
  EXPECT_EQ(delta("gstmoe_request_duration_seconds_count"), kRequests);
  EXPECT_EQ(delta(R"(gstmoe_request_duration_seconds_bucket{le="+Inf"})"), kRequests);
  EXPECT_GT(delta("gstmoe_request_duration_seconds_sum"), 0);
  for (const char* stage : {"queue", "encode", "route", "expert", "search"})
    EXPECT_EQ(delta(std::string("gstmoe_stage_duration_seconds_count{stage=\"") + stage + "\"}"), kRequests) << stage;
  // Every document, the error's too, is published.
  EXPECT_EQ(delta(R"(gstmoe_stage_duration_seconds_count{stage="publish"})"), kRequests + 1);
  EXPECT_EQ(delta("gstmoe_publish_messages_total"), kRequests + 1);
  EXPECT_GT(delta("gstmoe_publish_bytes_total"), 0);
  EXPECT_EQ(delta("gstmoe_publish_dropped_total"), 0);
  // Batches of at most max-batch=4 requests, the failed one among them.
  EXPECT_EQ(delta("gstmoe_batch_requests_sum"), kRequests + 1);
  EXPECT_GE(delta("gstmoe_batch_requests_count"), (kRequests + 1 + 3) / 4);
  EXPECT_EQ(delta(R"(gstmoe_batch_requests_bucket{le="4"})"), delta("gstmoe_batch_requests_count"));
  // adapter_tiny routes each row to its top 2 of 6 experts; the shares sum to 1.
  EXPECT_EQ(sum_of(after, "gstmoe_expert_rows_total") - sum_of(before, "gstmoe_expert_rows_total"), 2 * kRequests);
  EXPECT_NEAR(sum_of(after, "gstmoe_expert_load_share"), 1.0, 1e-9);
  double expert_rows = 0;  // only the adapter's experts are labels
  for (int e = 0; e < 6; ++e)
    expert_rows += value(after, "gstmoe_expert_rows_total{expert=\"" + std::to_string(e) + "\"}");
  EXPECT_EQ(expert_rows, sum_of(after, "gstmoe_expert_rows_total"));
  EXPECT_EQ(delta("gstmoe_route_dropped_total"), 0);
  for (const char* stage : {"encode", "route", "expert", "search"})
    EXPECT_GT(delta(std::string("gstmoe_stage_busy_seconds_total{stage=\"") + stage + "\"}"), 0) << stage;
  // Loaded when the pipeline started (before the first scrape).
  EXPECT_GE(value(after, R"(gstmoe_model_load_seconds_count{model="encoder"})"), 1);
  EXPECT_GE(value(after, R"(gstmoe_model_load_seconds_count{model="adapter"})"), 1);
  EXPECT_GT(value(after, "gstmoe_process_resident_memory_bytes"), 1e6);

  // The requests' cost shares add up to the stages' busy time (a batch's time split over its
  // rows; only the encoder's few microseconds on a batch of the failed request alone go to no
  // one), and the wait to the queue times; on the CPU path nothing is copied.
  double busy = 0;
  for (const char* stage : {"encode", "route", "expert", "search"})
    busy += delta(std::string("gstmoe_stage_busy_seconds_total{stage=\"") + stage + "\"}");
  const double compute = delta(R"(gstmoe_request_cost_seconds_total{kind="compute"})");
  EXPECT_NEAR(compute, busy, 1e-3 * busy + 1e-4) << text;
  EXPECT_NEAR(delta(R"(gstmoe_request_cost_seconds_total{kind="wait"})"),
              delta(R"(gstmoe_stage_duration_seconds_sum{stage="queue"})"), 1e-9);
  EXPECT_EQ(delta(R"(gstmoe_request_cost_seconds_total{kind="copy"})"), 0);
  EXPECT_EQ(delta("gstmoe_request_expert_loaded_bytes_total"), 0);
  // Nine different texts: nine misses (the failed request is not looked up).
  EXPECT_EQ(delta("gstmoe_query_cache_misses_total"), kRequests);
  EXPECT_EQ(delta("gstmoe_query_cache_hits_total"), 0);
  EXPECT_GT(delta("gstmoe_query_cache_bytes"), 0);
}

// moe-encode's query cache outlives a restart: the same texts hit the second time, and the
// evictions and bytes follow cache-bytes.
TEST_F(Metrics, QueryCacheCountsHitsMissesAndBytes) {
  const int port = free_port();
  QueryPipeline pipeline(port);
  Samples before, first, second;
  ASSERT_TRUE(pipeline.play());
  ASSERT_TRUE(scrape(port, &before));
  for (int i = 0; i < 3; ++i) pipeline.push("cached query " + std::to_string(i));
  ASSERT_TRUE(pipeline.finish());
  ASSERT_TRUE(scrape(port, &first));
  pipeline.stop();
  ASSERT_TRUE(pipeline.play());
  for (int i = 0; i < 3; ++i) pipeline.push("cached query " + std::to_string(i));
  ASSERT_TRUE(pipeline.finish());
  std::string text;
  ASSERT_TRUE(scrape(port, &second, &text));
  const auto delta = [](const Samples& a, const Samples& b, const char* sample) {
    return value(b, sample) - value(a, sample);
  };
  EXPECT_EQ(delta(before, first, "gstmoe_query_cache_misses_total"), 3) << text;
  EXPECT_EQ(delta(before, first, "gstmoe_query_cache_hits_total"), 0);
  EXPECT_EQ(delta(first, second, "gstmoe_query_cache_hits_total"), 3) << text;
  EXPECT_EQ(delta(first, second, "gstmoe_query_cache_misses_total"), 0);
  EXPECT_EQ(delta(first, second, "gstmoe_query_cache_bytes"), 0) << "hits add nothing";
  EXPECT_GT(delta(before, first, "gstmoe_query_cache_bytes"), 0);
  EXPECT_EQ(delta(before, second, "gstmoe_query_cache_evictions_total"), 0);
}

// With an expert executor (fp16 experts: the GPU code path on the CPU), the executor's cache counters
// and its build time are reported per device.
TEST_F(Metrics, ExpertCacheCountersComeFromTheExecutor) {
  const int port = free_port();
  QueryPipeline pipeline(port, "precision=fp16");
  ASSERT_TRUE(pipeline.play());
  Samples before;
  ASSERT_TRUE(scrape(port, &before));
  for (int i = 0; i < 6; ++i) pipeline.push("cached experts " + std::to_string(i));
  ASSERT_TRUE(pipeline.finish());
  Samples after;
  std::string text;
  ASSERT_TRUE(scrape(port, &after, &text));
  const auto delta = [&](const std::string& sample) { return value(after, sample) - value(before, sample); };
  const double misses = delta(R"(gstmoe_expert_cache_misses_total{device="cpu"})");
  const double hits = delta(R"(gstmoe_expert_cache_hits_total{device="cpu"})");
  EXPECT_GE(misses, 1) << text;  // a new executor starts empty
  EXPECT_GE(hits + misses, 2);   // every batch needs at least its rows' top-2 experts
  EXPECT_GT(delta(R"(gstmoe_expert_cache_copied_bytes_total{device="cpu"})"), 0);
  EXPECT_GT(value(after, R"(gstmoe_expert_cache_resident_bytes{device="cpu"})"), 0);
  EXPECT_GE(value(after, R"(gstmoe_model_load_seconds_count{model="experts"})"), 1);
  EXPECT_EQ(delta(R"(gstmoe_requests_total{outcome="result"})"), 6);
  // Every copied byte, and every second waited for a copy, is some request's cost.
  const double copied = delta(R"(gstmoe_expert_cache_copied_bytes_total{device="cpu"})");
  EXPECT_NEAR(delta("gstmoe_request_expert_loaded_bytes_total"), copied, 1e-6 * copied) << text;
  EXPECT_NEAR(delta(R"(gstmoe_request_cost_seconds_total{kind="copy"})"),
              delta(R"(gstmoe_expert_cache_wait_seconds_total{device="cpu"})"), 1e-9);
}

// While a pipeline runs on `device`, each model's memory is reported under that device and its
// holder: the encoder's weights as CLIP's architecture counts them (in f32), the expert executor's
// cache slots as moe-expert's `stats` reports them, and the index's vectors; with the device's free
// and total memory. The series go with the models.
void expect_device_memory_per_model(const std::string& device) {
  const int port = free_port();
  // Keeps the server up while the query pipeline comes and goes.
  GstElement* server =
      gst_parse_launch(("fakesrc num-buffers=0 ! zmq-publish endpoint=tcp://127.0.0.1:" + std::to_string(free_port()) +
                        " metrics-address=127.0.0.1:" + std::to_string(port))
                           .c_str(),
                       nullptr);
  ASSERT_NE(server, nullptr);
  ASSERT_NE(gst_element_set_state(server, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << bus_error(server);
  const auto held = [&](const char* holder) {
    return "gstmoe_device_memory_bytes{device=\"" + device + "\",holder=\"" + holder + "\"}";
  };
  {
    QueryPipeline pipeline(port, "name=experts precision=fp16", device);
    ASSERT_TRUE(pipeline.play());
    pipeline.push("what do you hold");  // the executor is built with the first caps
    ASSERT_TRUE(pipeline.finish());
    Samples samples;
    std::string text;
    ASSERT_TRUE(scrape(port, &samples, &text));

    const moe::ClipConfig config = moe::ClipConfig::from_file(kModel + "/config.json");
    EXPECT_EQ(value(samples, held("encoder")), clip_f32_backend_bytes(config)) << text;

    GstElement* element = pipeline.element("experts");
    GstStructure* stats = nullptr;
    g_object_get(element, "stats", &stats, nullptr);
    gst_object_unref(element);
    ASSERT_NE(stats, nullptr);
    const GValue* devices = gst_structure_get_value(stats, "devices");
    ASSERT_EQ(gst_value_array_get_size(devices), 1u);
    const GstStructure* experts = gst_value_get_structure(gst_value_array_get_value(devices, 0));
    gint slots = 0;
    guint64 slot_bytes = 0;
    ASSERT_TRUE(gst_structure_get_int(experts, "slots", &slots));
    ASSERT_TRUE(gst_structure_get_uint64(experts, "slot-bytes", &slot_bytes));
    gst_structure_free(stats);
    EXPECT_GT(slots, 0);
    EXPECT_EQ(value(samples, held("experts")), static_cast<double>(slots) * static_cast<double>(slot_bytes)) << text;

    const int width = moe::shared_moe_adapter(kAdapter)->layer().config().hidden_size;
    EXPECT_EQ(value(samples, held("index")), 20.0 * width * sizeof(float)) << text;

    const double total = value(samples, "gstmoe_device_memory_capacity_bytes{device=\"" + device + "\"}");
    const double free = value(samples, "gstmoe_device_memory_free_bytes{device=\"" + device + "\"}");
    if (device == "cpu") {
      EXPECT_EQ(total, host_memory_total()) << text;
    } else {
      EXPECT_GT(total, value(samples, held("encoder")) + value(samples, held("experts"))) << text;
    }
    EXPECT_GT(free, 0) << text;
    EXPECT_LE(free, total);
    EXPECT_EQ(families(text).count("gstmoe_device_memory_bytes"), 1u);
    EXPECT_EQ(sum_of(samples, "gstmoe_device_memory_bytes"),
              value(samples, held("encoder")) + value(samples, held("experts")) + value(samples, held("index")))
        << "only " << device << " holds models: " << text;
  }
  Samples after;
  std::string text;
  ASSERT_TRUE(scrape(port, &after, &text));
  EXPECT_EQ(families(text).count("gstmoe_device_memory_bytes"), 0u) << "the models are gone: " << text;
  EXPECT_EQ(families(text).count("gstmoe_device_memory_free_bytes"), 0u) << "no model, no device: " << text;
  gst_element_set_state(server, GST_STATE_NULL);
  gst_object_unref(server);
}

// On the CPU, device="cpu" is host memory; its free and total are the host's.
TEST_F(Metrics, DeviceMemoryIsReportedPerModel) { expect_device_memory_per_model("cpu"); }

TEST_F(Metrics, DeviceMemoryIsReportedPerModelOnCuda) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  expect_device_memory_per_model("cuda:0");
}

// Every metric a query of the Grafana dashboard names is one the service exports (a histogram's
// _bucket, _sum and _count series by their family), in a scrape of a running pipeline with every
// element reporting: the expert executor (fp16 experts), an error, a query cache hit.
TEST_F(Metrics, DashboardNamesOnlyExportedMetrics) {
  const int port = free_port();
  QueryPipeline pipeline(port, "precision=fp16");
  ASSERT_TRUE(pipeline.play());
  for (const char* request : {"a red bicycle", "a red bicycle", "\xff not UTF-8"}) pipeline.push(request);
  ASSERT_TRUE(pipeline.finish());
  std::string text;
  ASSERT_TRUE(http_get(port, "/metrics", &text));
  const std::map<std::string, std::string> exported = families(text);
  const std::regex metric_name("gstmoe_[a-z0-9_]+");
  std::set<std::string> named;
  for (const std::string& query : dashboard_queries())
    for (std::sregex_iterator it(query.begin(), query.end(), metric_name), end; it != end; ++it)
      named.insert(it->str());
  EXPECT_GE(named.size(), 20u) << "the dashboard's queries were not read";
  for (const std::string& name : named) {
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          exported.count(name.substr(0, name.size() - s.size())) != 0)
        family = name.substr(0, name.size() - s.size());
    }
    const auto it = exported.find(family);
    EXPECT_NE(it, exported.end()) << "the dashboard names " << name << ", which the scrape lacks:\n" << text;
    if (it != exported.end() && family != name) {
      EXPECT_EQ(it->second, "histogram") << name;
    }
  }
}

// Debian's promtool lints the scrape (names, units, types, help) after some traffic.
TEST_F(Metrics, PromtoolAcceptsTheScrape) {
  const std::string promtool = find_program("promtool");
  if (promtool.empty()) GTEST_SKIP() << "promtool not found (Debian package 'prometheus'): scrape not linted";
  const int port = free_port();
  QueryPipeline pipeline(port);
  ASSERT_TRUE(pipeline.play());
  for (int i = 0; i < 3; ++i) pipeline.push("lint me " + std::to_string(i));
  ASSERT_TRUE(pipeline.finish());
  std::string text;
  ASSERT_TRUE(http_get(port, "/metrics", &text));
  moe::test::TempDir dir;
  const std::string file = dir.write("scrape.txt", text);
  const std::vector<std::string> argv = {"/bin/sh", "-c", "exec \"$0\" check metrics < \"$1\"", promtool, file};
  std::vector<gchar*> args;
  for (const auto& a : argv) args.push_back(const_cast<gchar*>(a.c_str()));
  args.push_back(nullptr);
  gchar* out = nullptr;
  gchar* err = nullptr;
  gint status = -1;
  ASSERT_TRUE(
      g_spawn_sync(nullptr, args.data(), nullptr, G_SPAWN_DEFAULT, nullptr, nullptr, &out, &err, &status, nullptr));
  const std::string output = std::string(out ? out : "") + (err ? err : "");
  g_free(out);
  g_free(err);
  EXPECT_TRUE(g_spawn_check_wait_status(status, nullptr)) << "promtool check metrics:\n" << output << "\n" << text;
}

// A Prometheus server of our own, on a free loopback port, with a temporary configuration and data
// folder; terminated (and waited for) when destroyed, and by the kernel if this process dies first.
class PrometheusServer {
 public:
  PrometheusServer(const std::string& binary, int target_port) : port_(free_port()) {
    const std::string config = dir_.write("prometheus.yml",
                                          "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                                          "scrape_configs:\n  - job_name: gstmoe\n    static_configs:\n"
                                          "      - targets: ['127.0.0.1:" +
                                              std::to_string(target_port) + "']\n");
    const std::vector<std::string> argv = {
        binary, "--config.file=" + config, "--storage.tsdb.path=" + dir_.file("data"),
        "--web.listen-address=127.0.0.1:" + std::to_string(port_), "--log.level=warn"};
    std::vector<gchar*> args;
    for (const auto& a : argv) args.push_back(const_cast<gchar*>(a.c_str()));
    args.push_back(nullptr);
    const int log = open(dir_.file("prometheus.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    GError* error = nullptr;
    if (!g_spawn_async_with_fds(
            nullptr, args.data(), nullptr, G_SPAWN_DO_NOT_REAP_CHILD,
            [](gpointer) { prctl(PR_SET_PDEATHSIG, SIGTERM); }, nullptr, &pid_, -1, log, log, &error)) {
      ADD_FAILURE() << "cannot start " << binary << ": " << error->message;
      g_error_free(error);
      pid_ = 0;
    }
    close(log);
  }
  ~PrometheusServer() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (waitpid(pid_, nullptr, WNOHANG) == 0) {  // still running after 10 s
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  bool started() const { return pid_ > 0; }
  std::string log() const {
    std::ifstream in(dir_.file("prometheus.log"));
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // The value of the instant query `promql` when it returns exactly one sample; NAN otherwise.
  // The values of the instant query `promql`, one per sample; false when Prometheus refuses it
  // (HTTP 400 for a query that does not parse) or cannot be reached.
  bool query_samples(const std::string& promql, std::vector<double>* values) const {
    gchar* escaped = g_uri_escape_string(promql.c_str(), nullptr, FALSE);
    std::string body;
    const bool ok = http_get(port_, std::string("/api/v1/query?query=") + escaped, &body);
    g_free(escaped);
    if (!ok) return false;
    JsonParser* parser = json_parser_new();
    JsonArray* samples = nullptr;
    if (json_parser_load_from_data(parser, body.c_str(), static_cast<gssize>(body.size()), nullptr)) {
      JsonObject* data = json_object_get_object_member(json_node_get_object(json_parser_get_root(parser)), "data");
      samples = data ? json_object_get_array_member(data, "result") : nullptr;
    }
    values->clear();
    for (guint i = 0; samples && i < json_array_get_length(samples); ++i) {
      JsonArray* v = json_object_get_array_member(json_array_get_object_element(samples, i), "value");
      values->push_back(std::stod(json_array_get_string_element(v, 1)));
    }
    g_object_unref(parser);
    return samples != nullptr;
  }
  // The value of the instant query `promql` when it returns exactly one sample; NAN otherwise.
  double query(const std::string& promql) const {
    std::vector<double> values;
    return query_samples(promql, &values) && values.size() == 1 ? values[0] : NAN;
  }
  // Polls `promql` until it equals `expected` or `patience` passes; returns the last answer.
  double await(const std::string& promql, double expected, std::chrono::seconds patience) const {
    const auto deadline = std::chrono::steady_clock::now() + patience;
    double v = query(promql);
    while (v != expected && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      v = query(promql);
    }
    return v;
  }

 private:
  moe::test::TempDir dir_;
  int port_;
  GPid pid_ = 0;
};

// Prometheus scrapes the service before and during a short load; PromQL's increase of the request
// counter over the window equals the requests sent.
TEST_F(Metrics, PrometheusScrapesTheServiceDuringALoad) {
  const std::string binary = find_program("prometheus");
  if (binary.empty()) GTEST_SKIP() << "prometheus not found (Debian package 'prometheus'): no real scrape tested";
  const int port = free_port();
  QueryPipeline pipeline(port);
  ASSERT_TRUE(pipeline.play());
  PrometheusServer prometheus(binary, port);
  ASSERT_TRUE(prometheus.started());

  // Prometheus has scraped the service at least once before the load, so the load's increase is
  // seen whole; what other tests in this process counted before is in that first sample.
  Samples before;
  ASSERT_TRUE(scrape(port, &before));
  const double counted = value(before, R"(gstmoe_requests_total{outcome="result"})");
  const std::string results = R"(gstmoe_requests_total{job="gstmoe",outcome="result"})";
  ASSERT_EQ(prometheus.await(results, counted, std::chrono::seconds(60)), counted) << prometheus.log();

  constexpr int kRequests = 20;
  // An error first, so that its series, which appears with it, has several samples in the
  // dashboard's rate windows.
  pipeline.push("\xff not UTF-8");
  for (int i = 0; i < kRequests; ++i) {
    pipeline.push("load request " + std::to_string(i));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // spread over two scrape intervals
  }
  ASSERT_TRUE(pipeline.finish());
  // max - min over the window: exact, where increase() would extrapolate to the window's edges.
  const std::string window = "[10m]";
  EXPECT_EQ(prometheus.await("max_over_time(" + results + window + ") - min_over_time(" + results + window + ")",
                             kRequests, std::chrono::seconds(60)),
            kRequests)
      << prometheus.log();
  const std::string latencies = R"(gstmoe_request_duration_seconds_count{job="gstmoe"})";
  EXPECT_EQ(prometheus.await("max_over_time(" + latencies + window + ") - min_over_time(" + latencies + window + ")",
                             kRequests, std::chrono::seconds(30)),
            kRequests);
  EXPECT_EQ(prometheus.query(R"(up{job="gstmoe"})"), 1.0);

  // Every query of the Grafana dashboard parses and, but for the expert cache's (the experts run
  // on the engine's CPU path here, without a cache), finds the service's series.
  for (std::string expr : dashboard_queries()) {
    for (const auto& [variable, setting] : {std::pair<std::string, std::string>{"$__rate_interval", "1m"},
                                            std::pair<std::string, std::string>{"$instance", ".*"}})
      for (size_t at; (at = expr.find(variable)) != std::string::npos;) {
        expr.replace(at, variable.size(), setting);
      }
    std::vector<double> values;
    EXPECT_TRUE(prometheus.query_samples(expr, &values)) << "refused: " << expr;
    if (expr.find("expert_cache") == std::string::npos) {
      EXPECT_FALSE(values.empty()) << "no series: " << expr;
    }
  }
}

// zmq-query and zmq-publish naming one address share one server, which stops with the last of them.
TEST_F(Metrics, ElementsNamingOneAddressShareItsServer) {
  const int port = free_port();
  const std::string address = "metrics-address=127.0.0.1:" + std::to_string(port);
  GstElement* query = gst_parse_launch(
      ("zmq-query endpoint=tcp://127.0.0.1:" + std::to_string(free_port()) + " " + address + " ! fakesink").c_str(),
      nullptr);
  GstElement* publish = gst_parse_launch(
      ("fakesrc num-buffers=0 ! zmq-publish endpoint=tcp://127.0.0.1:" + std::to_string(free_port()) + " " + address)
          .c_str(),
      nullptr);
  ASSERT_NE(query, nullptr);
  ASSERT_NE(publish, nullptr);
  ASSERT_NE(gst_element_set_state(query, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << bus_error(query);
  ASSERT_NE(gst_element_set_state(publish, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << bus_error(publish);
  Samples samples;
  EXPECT_TRUE(scrape(port, &samples));
  gst_element_set_state(query, GST_STATE_NULL);
  EXPECT_TRUE(scrape(port, &samples)) << "the server stopped while zmq-publish still names it";
  gst_element_set_state(publish, GST_STATE_NULL);
  EXPECT_FALSE(scrape(port, &samples)) << "the server outlived the elements";
  gst_object_unref(query);
  gst_object_unref(publish);
}

// A port another program listens on, and an address without a port, fail the start with an
// element error that names the address.
TEST_F(Metrics, UnusableAddressIsAnErrorAtStart) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string busy = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));

  const std::vector<std::pair<std::string, std::string>> cases = {
      {busy, "Cannot serve metrics on metrics-address '" + busy + "': the address is in use"},
      {"9464", "metrics-address '9464' is not HOST:PORT"},
  };
  for (const auto& [address, message] : cases) {
    GstElement* pipeline = gst_parse_launch(("fakesrc num-buffers=0 ! zmq-publish endpoint=tcp://127.0.0.1:" +
                                             std::to_string(free_port()) + " metrics-address=" + address)
                                                .c_str(),
                                            nullptr);
    ASSERT_NE(pipeline, nullptr);
    EXPECT_EQ(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << address;
    const std::string error = bus_error(pipeline);
    EXPECT_NE(error.find(message), std::string::npos) << error;
    gst_element_set_state(pipeline, GST_STATE_NULL);
    gst_object_unref(pipeline);
  }
  close(fd);
}

}  // namespace
