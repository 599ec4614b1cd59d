// ann-query: build an index from a tensor stream, search it, and the documents it sends.
#include <gst/check/gstharness.h>
#include <gst/gst.h>
#include <gst/video/video.h>
#include <gtest/gtest.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backend.h"
#include "gstannquery.h"
#include "gstmoecatalogsrc.h"
#include "gstmoeencode.h"
#include "gstmoeroute.h"
#include "gstmoemeta.h"
#include "gstmoeresult.h"
#include "moe/ann_index.h"
#include "test_util.h"

namespace {

using moe::test::random_unit_vectors;
using moe::test::TempDir;

constexpr int kWidth = 16;
constexpr int kItems = 50;

void init_once() {
  static const bool done = [] {
    gst_init(nullptr, nullptr);
    GST_ELEMENT_REGISTER(ann_query, nullptr);
    GST_ELEMENT_REGISTER(moe_catalog_src, nullptr);
    GST_ELEMENT_REGISTER(moe_encode, nullptr);
    GST_ELEMENT_REGISTER(moe_route, nullptr);
    return true;
  }();
  (void)done;
}

// The catalog record of item i, as moe-catalog-src would make it.
gstmoe::RequestRecord catalog_record(int i) {
  gstmoe::RequestRecord r;
  r.id = "item-" + std::to_string(i);
  r.modality = gstmoe::Modality::Image;
  r.uri = "file:///catalog/" + std::to_string(i) + ".png";
  r.text = i == 7 ? "tasse rayée — 縞模様のマグ" : "caption " + std::to_string(i);
  // Every third catalog line carries members of its own (a price, a SKU), the others none.
  if (i % 3 == 0) r.fields = R"({"price":)" + std::to_string(i) + R"(.5,"sku":"SKU-)" + std::to_string(i) + "\"}";
  r.arrival_wall_us = g_get_real_time();
  r.arrival_mono_us = g_get_monotonic_time();
  return r;
}

gstmoe::RequestRecord text_request(const std::string& id, int k = 0) {
  gstmoe::RequestRecord r;
  r.id = id;
  r.modality = gstmoe::Modality::Text;
  r.text = "query " + id;
  r.k = k;
  r.arrival_wall_us = g_get_real_time();
  r.arrival_mono_us = g_get_monotonic_time();
  r.experts = {3, 1};
  r.expert_weights = {0.625f, 0.375f};
  r.timings_ms = {{"queue", 0.5}, {"encode", 2.25}};
  return r;
}

gstmoe::FailedRequest failed_request(const std::string& id) {
  gstmoe::FailedRequest f;
  f.request.id = id;
  f.request.modality = gstmoe::Modality::Image;
  f.request.uri = "/nope.jpg";
  f.request.arrival_wall_us = g_get_real_time();
  f.stage = "zmq-query";
  f.reason = "image file '/nope.jpg' cannot be read: No such file or directory";
  f.code = moe::error_code::kImageUnavailable;
  return f;
}

// The models of a batch, as moe-encode and moe-expert write them into the meta.
struct Models {
  std::string encoder, encoder_fingerprint, adapter, adapter_fingerprint;
  void stamp(gstmoe::BatchRecords& batch) const {
    batch.encoder = encoder;
    batch.encoder_fingerprint = encoder_fingerprint;
    batch.adapter = adapter;
    batch.adapter_fingerprint = adapter_fingerprint;
  }
};
const Models kClipAndAdapter{"clip", "00000000000c11b0", "adapter", "00000000000adab7"};

// A tensor buffer holding rows [first, first + records.size()) of `vectors`, with its meta.
GstBuffer* tensor_buffer(const std::vector<float>& vectors, int first, const gstmoe::BatchRecords& records) {
  const size_t bytes = records.rows.size() * kWidth * sizeof(float);
  GstBuffer* buf = bytes ? gst_buffer_new_memdup(vectors.data() + static_cast<size_t>(first) * kWidth, bytes)
                         : gst_buffer_new();  // only failed requests
  gst_buffer_add_moe_batch_meta(buf, records);
  return buf;
}

// A parsed JSON document with typed accessors that fail the test on a missing field.
class Json {
 public:
  explicit Json(GstBuffer* buf) : parser_(json_parser_new()) {
    GstMapInfo map;
    EXPECT_TRUE(gst_buffer_map(buf, &map, GST_MAP_READ));
    text_.assign(reinterpret_cast<const char*>(map.data), map.size);
    gst_buffer_unmap(buf, &map);
    GError* err = nullptr;
    EXPECT_TRUE(json_parser_load_from_data(parser_, text_.c_str(), static_cast<gssize>(text_.size()), &err))
        << (err ? err->message : "") << "\n"
        << text_;
    g_clear_error(&err);
    JsonNode* root = json_parser_get_root(parser_);
    EXPECT_TRUE(root && JSON_NODE_HOLDS_OBJECT(root)) << text_;
    obj_ = root && JSON_NODE_HOLDS_OBJECT(root) ? json_object_ref(json_node_get_object(root)) : json_object_new();
  }
  ~Json() {
    json_object_unref(obj_);
    g_object_unref(parser_);
  }
  Json(const Json&) = delete;
  Json& operator=(const Json&) = delete;

  JsonObject* obj() const { return obj_; }
  const std::string& text() const { return text_; }

  static JsonNode* member(JsonObject* o, const char* key) {
    EXPECT_TRUE(json_object_has_member(o, key)) << "missing field " << key;
    return json_object_has_member(o, key) ? json_object_get_member(o, key) : nullptr;
  }
  static std::string str(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    EXPECT_TRUE(n && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING) << key;
    return n && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING ? json_node_get_string(n) : "";
  }
  static bool is_null(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    return n && JSON_NODE_HOLDS_NULL(n);
  }
  static int64_t integer(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    EXPECT_TRUE(n && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_INT64) << key;
    return n && JSON_NODE_HOLDS_VALUE(n) ? json_node_get_int(n) : -1;
  }
  static double number(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    EXPECT_TRUE(n && JSON_NODE_HOLDS_VALUE(n)) << key;
    return n && JSON_NODE_HOLDS_VALUE(n) ? json_node_get_double(n) : NAN;
  }
  static JsonObject* object(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    EXPECT_TRUE(n && JSON_NODE_HOLDS_OBJECT(n)) << key;
    return n && JSON_NODE_HOLDS_OBJECT(n) ? json_node_get_object(n) : nullptr;
  }
  static JsonArray* array(JsonObject* o, const char* key) {
    JsonNode* n = member(o, key);
    EXPECT_TRUE(n && JSON_NODE_HOLDS_ARRAY(n)) << key;
    return n && JSON_NODE_HOLDS_ARRAY(n) ? json_node_get_array(n) : nullptr;
  }

 private:
  JsonParser* parser_;
  JsonObject* obj_;
  std::string text_;
};

class AnnQueryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    init_once();
    bus_ = gst_bus_new();
  }
  void TearDown() override {
    for (GstHarness* h : harnesses_) gst_harness_teardown(h);
    // Queued messages hold their source element, which holds the bus: drop them first.
    gst_bus_set_flushing(bus_, TRUE);
    gst_object_unref(bus_);
  }

  // An ann-query element with `props` set ("index", path, ..., nullptr), posting to bus_.
  GstElement* make_element(const char* first_prop, ...) {
    GstElement* element = gst_element_factory_make("ann-query", nullptr);
    EXPECT_NE(element, nullptr);
    va_list args;
    va_start(args, first_prop);
    g_object_set_valist(G_OBJECT(element), first_prop, args);
    va_end(args);
    gst_element_set_bus(element, bus_);
    return element;
  }

  // A harness around `element` (started, i.e. PLAYING); torn down with the test.
  GstHarness* harness(GstElement* element) {
    GstHarness* h = gst_harness_new_with_element(element, "sink", "src");
    gst_object_unref(element);
    harnesses_.push_back(h);
    return h;
  }

  static void set_tensor_caps(GstHarness* h, int width) { gst_harness_set_src_caps(h, gstmoe::tensor_caps(width)); }

  // Every buffer the element has pushed so far.
  static std::vector<GstBuffer*> pull_all(GstHarness* h) {
    std::vector<GstBuffer*> out;
    while (GstBuffer* b = gst_harness_try_pull(h)) out.push_back(b);
    return out;
  }
  static void unref_all(std::vector<GstBuffer*>& bufs) {
    for (GstBuffer* b : bufs) gst_buffer_unref(b);
    bufs.clear();
  }

  // The message of the first error on the bus ("" if none).
  std::string bus_error() {
    GstMessage* msg = gst_bus_pop_filtered(bus_, GST_MESSAGE_ERROR);
    if (!msg) return "";
    GError* err = nullptr;
    gchar* debug = nullptr;
    gst_message_parse_error(msg, &err, &debug);
    std::string text = std::string(err->message) + " | " + (debug ? debug : "");
    g_error_free(err);
    g_free(debug);
    gst_message_unref(msg);
    return text;
  }

  // Builds an index of the kItems catalog vectors at `path` (one failed request among them),
  // from batches made by `models` (default: none known); returns the summary document's buffer.
  GstBuffer* build_index(const std::string& path, const char* index_type = "flat", const Models& models = {}) {
    GstElement* element = make_element("mode", 1, "index", path.c_str(), nullptr);
    gst_util_set_object_arg(G_OBJECT(element), "index-type", index_type);
    GstHarness* h = harness(element);
    set_tensor_caps(h, kWidth);
    for (int first = 0; first < kItems; first += 20) {
      gstmoe::BatchRecords batch;
      for (int i = first; i < std::min(first + 20, kItems); ++i) batch.rows.push_back(catalog_record(i));
      if (first == 20) batch.failed.push_back(failed_request("broken-image"));
      models.stamp(batch);
      EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, first, batch)), GST_FLOW_OK);
    }
    // The failed request is answered at EOS, before the summary (a build holds its error
    // documents back: a sink prerolled by one would stall gst-launch while progress is reported).
    EXPECT_EQ(gst_harness_buffers_received(h), 0u);
    EXPECT_TRUE(gst_harness_push_event(h, gst_event_new_eos()));
    std::vector<GstBuffer*> docs = pull_all(h);
    EXPECT_EQ(docs.size(), 2u);
    if (docs.size() != 2) {
      unref_all(docs);
      return nullptr;
    }
    {
      Json err(docs[0]);
      EXPECT_EQ(Json::str(err.obj(), "type"), "error");
      EXPECT_EQ(Json::str(err.obj(), "id"), "broken-image");
    }
    gst_buffer_unref(docs[0]);
    return docs[1];
  }

  // A harness searching the index at `path`, caps set.
  GstHarness* search_harness(const std::string& path, guint k = 5) {
    GstHarness* h = harness(make_element("index", path.c_str(), "k", k, nullptr));
    set_tensor_caps(h, kWidth);
    return h;
  }

  const std::vector<float> catalog_ = random_unit_vectors(kItems, kWidth, 42);
  TempDir dir_;
  GstBus* bus_ = nullptr;
  std::vector<GstHarness*> harnesses_;
};

TEST_F(AnnQueryTest, BuildWritesIndexAndSummary) {
  const std::string path = dir_.file("catalog.faiss");
  GstBuffer* summary_buf = build_index(path);
  ASSERT_NE(summary_buf, nullptr);
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::exists(path + ".items.jsonl"));

  Json summary(summary_buf);
  EXPECT_EQ(Json::integer(summary.obj(), "schema"), gstmoe::kResultSchema);
  EXPECT_EQ(Json::str(summary.obj(), "type"), "index-built");
  EXPECT_EQ(Json::str(summary.obj(), "index"), path);
  EXPECT_EQ(Json::integer(summary.obj(), "items"), kItems);
  EXPECT_EQ(Json::integer(summary.obj(), "dim"), kWidth);
  EXPECT_EQ(Json::str(summary.obj(), "index_type"), "flat");
  EXPECT_EQ(Json::integer(summary.obj(), "failed"), 1);
  gst_buffer_unref(summary_buf);

  // EOS went on after the summary; downstream saw application/json caps.
  GstHarness* h = harnesses_.back();
  bool eos = false;
  while (GstEvent* ev = gst_harness_try_pull_event(h)) {
    eos |= GST_EVENT_TYPE(ev) == GST_EVENT_EOS;
    gst_event_unref(ev);
  }
  EXPECT_TRUE(eos);
  GstCaps* caps = gst_pad_get_current_caps(h->sinkpad);
  ASSERT_NE(caps, nullptr);
  EXPECT_TRUE(gst_structure_has_name(gst_caps_get_structure(caps, 0), "application/json"));
  gst_caps_unref(caps);

  // The written index holds the catalog: the engine reads back every item.
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  ASSERT_EQ(index.size(), kItems);
  EXPECT_EQ(index.dim(), kWidth);
  for (int i = 0; i < kItems; ++i) {
    const gstmoe::RequestRecord r = catalog_record(i);
    EXPECT_EQ(index.item(i).id, r.id);
    EXPECT_EQ(index.item(i).uri, r.uri);
    EXPECT_EQ(index.item(i).caption, r.text);
    EXPECT_EQ(index.item(i).fields, r.fields);
  }
}

TEST_F(AnnQueryTest, SearchFindsStoredItemsWithFullDocuments) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path, 5);

  gstmoe::BatchRecords batch;
  batch.encoder = "clip_tiny_bpe";
  batch.adapter = "adapter_tiny";
  for (int i = 0; i < 10; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 10u);

  // The engine, called directly on the same vectors, gives the same hits.
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  const auto expected = index.search(catalog_.data(), 10, 5);

  for (int i = 0; i < 10; ++i) {
    // One request per buffer, in its meta too, with the search stage timed.
    GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(out[i]);
    ASSERT_NE(meta, nullptr);
    ASSERT_EQ(meta->records->rows.size(), 1u);
    EXPECT_TRUE(meta->records->failed.empty());
    EXPECT_EQ(meta->records->rows[0].id, "q" + std::to_string(i));
    ASSERT_FALSE(meta->records->rows[0].timings_ms.empty());
    EXPECT_EQ(meta->records->rows[0].timings_ms.back().first, "search");

    Json doc(out[i]);
    JsonObject* o = doc.obj();
    EXPECT_EQ(Json::integer(o, "schema"), gstmoe::kResultSchema);
    EXPECT_EQ(Json::str(o, "type"), "result");
    EXPECT_EQ(Json::str(o, "id"), "q" + std::to_string(i));
    EXPECT_EQ(Json::str(o, "modality"), "text");
    EXPECT_EQ(Json::str(o, "query"), "query q" + std::to_string(i));
    EXPECT_TRUE(Json::is_null(o, "uri"));
    EXPECT_EQ(Json::integer(o, "k"), 5);

    JsonArray* results = Json::array(o, "results");
    ASSERT_NE(results, nullptr);
    ASSERT_EQ(json_array_get_length(results), 5u) << doc.text();
    for (guint j = 0; j < 5; ++j) {
      JsonObject* hit = json_array_get_object_element(results, j);
      const int64_t item = Json::integer(hit, "item");
      EXPECT_EQ(Json::integer(hit, "rank"), static_cast<int64_t>(j) + 1);
      EXPECT_EQ(item, expected[i][j].item);
      EXPECT_NEAR(Json::number(hit, "score"), expected[i][j].score, 1e-5);
      EXPECT_EQ(Json::str(hit, "id"), catalog_record(static_cast<int>(item)).id);
      EXPECT_EQ(Json::str(hit, "uri"), catalog_record(static_cast<int>(item)).uri);
      EXPECT_EQ(Json::str(hit, "caption"), catalog_record(static_cast<int>(item)).text);
      // The catalog line's own members, as they were; {} for a line without any.
      JsonObject* fields = Json::object(hit, "fields");
      ASSERT_NE(fields, nullptr);
      if (item % 3 == 0) {
        EXPECT_DOUBLE_EQ(Json::number(fields, "price"), static_cast<double>(item) + 0.5);
        EXPECT_EQ(Json::str(fields, "sku"), "SKU-" + std::to_string(item));
      } else {
        EXPECT_EQ(json_object_get_size(fields), 0u) << doc.text();
      }
    }
    // The stored vector finds its own item first.
    JsonObject* first = json_array_get_object_element(results, 0);
    EXPECT_EQ(Json::integer(first, "item"), i);
    EXPECT_NEAR(Json::number(first, "score"), 1.0, 1e-5);

    JsonArray* experts = Json::array(o, "experts");
    ASSERT_NE(experts, nullptr);
    ASSERT_EQ(json_array_get_length(experts), 2u);
    EXPECT_EQ(Json::integer(json_array_get_object_element(experts, 0), "expert"), 3);
    EXPECT_DOUBLE_EQ(Json::number(json_array_get_object_element(experts, 0), "weight"), 0.625);
    EXPECT_EQ(Json::integer(json_array_get_object_element(experts, 1), "expert"), 1);

    JsonObject* model = Json::object(o, "model");
    ASSERT_NE(model, nullptr);
    EXPECT_EQ(Json::str(model, "encoder"), "clip_tiny_bpe");
    EXPECT_EQ(Json::str(model, "adapter"), "adapter_tiny");
    EXPECT_EQ(Json::str(model, "index"), "catalog.faiss");

    JsonObject* timings = Json::object(o, "timings_ms");
    ASSERT_NE(timings, nullptr);
    EXPECT_DOUBLE_EQ(Json::number(timings, "queue"), 0.5);
    EXPECT_DOUBLE_EQ(Json::number(timings, "encode"), 2.25);
    EXPECT_GE(Json::number(timings, "search"), 0.0);
    EXPECT_GE(Json::number(timings, "total"), 0.0);

    EXPECT_TRUE(g_regex_match_simple("^\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{6}Z$",
                                     Json::str(o, "arrival_time").c_str(), G_REGEX_DEFAULT, G_REGEX_MATCH_DEFAULT))
        << Json::str(o, "arrival_time");
    EXPECT_EQ(doc.text().find("00000000"), std::string::npos) << "numbers not rounded: " << doc.text();
  }
  unref_all(out);
}

TEST_F(AnnQueryTest, FailedRequestsBecomeErrorDocuments) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path);

  // Two rows and one request that failed upstream, then a zero-row buffer carrying only a failure.
  gstmoe::BatchRecords batch;
  batch.rows = {text_request("ok1"), text_request("ok2")};
  batch.failed.push_back(failed_request("bad1"));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  gstmoe::BatchRecords only_failed;
  gstmoe::FailedRequest no_id = failed_request("");
  no_id.stage = "moe-encode";
  no_id.reason = "image '/nope.jpg' cannot be decoded: not an image";
  no_id.code = moe::error_code::kImageUndecodable;
  only_failed.failed.push_back(no_id);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, only_failed)), GST_FLOW_OK);

  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 4u);
  int results = 0;
  std::vector<std::string> error_ids;
  for (GstBuffer* b : out) {
    Json doc(b);
    GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(b);
    ASSERT_NE(meta, nullptr);
    if (Json::str(doc.obj(), "type") == "result") {
      ++results;
      EXPECT_EQ(meta->records->rows.size(), 1u);
      continue;
    }
    ASSERT_EQ(Json::str(doc.obj(), "type"), "error") << doc.text();
    EXPECT_TRUE(meta->records->rows.empty());
    ASSERT_EQ(meta->records->failed.size(), 1u);
    EXPECT_EQ(Json::str(doc.obj(), "modality"), "image");
    EXPECT_TRUE(Json::is_null(doc.obj(), "query"));
    EXPECT_EQ(Json::str(doc.obj(), "uri"), "/nope.jpg");
    JsonObject* err = Json::object(doc.obj(), "error");
    ASSERT_NE(err, nullptr);
    EXPECT_EQ(Json::integer(doc.obj(), "schema"), gstmoe::kResultSchema);
    EXPECT_EQ(Json::str(err, "stage"), meta->records->failed[0].stage);
    EXPECT_EQ(Json::str(err, "code"), meta->records->failed[0].code);
    EXPECT_EQ(Json::str(err, "reason"), meta->records->failed[0].reason);
    EXPECT_FALSE(Json::str(doc.obj(), "arrival_time").empty());
    error_ids.push_back(Json::is_null(doc.obj(), "id") ? "<null>" : Json::str(doc.obj(), "id"));
    if (error_ids.back() == "bad1") {
      EXPECT_EQ(Json::str(err, "stage"), "zmq-query");
      EXPECT_EQ(Json::str(err, "reason"), "image file '/nope.jpg' cannot be read: No such file or directory");
      EXPECT_EQ(Json::str(err, "code"), "image_unavailable");
    } else {
      EXPECT_EQ(Json::str(err, "stage"), "moe-encode");
      EXPECT_EQ(Json::str(err, "code"), "image_undecodable");
    }
  }
  EXPECT_EQ(results, 2);
  EXPECT_EQ(error_ids, (std::vector<std::string>{"bad1", "<null>"}));
  unref_all(out);
}

// Two catalog files with one id (cat.jpg and cat.png both "cat"): the second is not indexed, and
// its error document names both files; the build goes on and counts it as failed.
TEST_F(AnnQueryTest, BuildRefusesDuplicateIdsNamingBothFiles) {
  const std::string path = dir_.file("dups.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  const auto item = [](const std::string& id, const std::string& file) {
    gstmoe::RequestRecord r = catalog_record(0);
    r.id = id;
    r.uri = "file:///catalog/" + file;
    return r;
  };
  gstmoe::BatchRecords first;
  first.rows = {item("cat", "cat.jpg"), item("dog", "dog.png"), item("cat", "cat.png")};  // within a batch
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, first)), GST_FLOW_OK);
  gstmoe::BatchRecords second;
  second.rows = {item("bird", "bird.png"), item("dog", "sub/dog.png")};  // against an earlier batch
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 3, second)), GST_FLOW_OK);

  EXPECT_TRUE(gst_harness_push_event(h, gst_event_new_eos()));
  std::vector<GstBuffer*> errors = pull_all(h);  // the two error documents, then the summary
  ASSERT_EQ(errors.size(), 3u);
  std::vector<GstBuffer*> summary = {errors.back()};
  errors.pop_back();
  const std::vector<std::pair<std::string, std::string>> expected = {{"cat.png", "cat.jpg"},
                                                                     {"sub/dog.png", "dog.png"}};
  for (size_t i = 0; i < errors.size(); ++i) {
    Json doc(errors[i]);
    JsonObject* err = Json::object(doc.obj(), "error");
    ASSERT_NE(err, nullptr);
    EXPECT_EQ(Json::str(err, "code"), "duplicate_id");
    const std::string reason = Json::str(err, "reason");
    EXPECT_NE(
        reason.find("file:///catalog/" + expected[i].first + " has the id of file:///catalog/" + expected[i].second),
        std::string::npos)
        << reason;
  }
  unref_all(errors);
  {
    Json doc(summary[0]);
    EXPECT_EQ(Json::integer(doc.obj(), "items"), 3);
    EXPECT_EQ(Json::integer(doc.obj(), "failed"), 2);
  }
  unref_all(summary);
  // The index holds the first of each id with its own vector: row 3 of the catalog is "bird".
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  ASSERT_EQ(index.size(), 3);
  EXPECT_EQ(index.item(0).uri, "file:///catalog/cat.jpg");
  EXPECT_EQ(index.item(1).uri, "file:///catalog/dog.png");
  EXPECT_EQ(index.item(2).id, "bird");
  const auto hits = index.search(catalog_.data() + 3 * kWidth, 1, 1);
  EXPECT_EQ(hits[0][0].item, 2);
  EXPECT_NEAR(hits[0][0].score, 1.0, 1e-5);
}

TEST_F(AnnQueryTest, UriBaseServesItemsFromAnotherPlace) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = harness(make_element("index", path.c_str(), "k", 3, "uri-base", "https://cdn.example/shop", nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords batch;
  batch.rows = {text_request("q")};
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 4, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 1u);
  {
    Json doc(out[0]);
    JsonArray* results = Json::array(doc.obj(), "results");
    ASSERT_NE(results, nullptr);
    ASSERT_EQ(json_array_get_length(results), 3u);
    for (guint j = 0; j < 3; ++j) {
      JsonObject* hit = json_array_get_object_element(results, j);
      // file:///catalog/N.png, under the items' shared folder file:///catalog/.
      EXPECT_EQ(Json::str(hit, "uri"),
                "https://cdn.example/shop/" + std::to_string(Json::integer(hit, "item")) + ".png");
    }
  }
  unref_all(out);
  gchar* base = nullptr;
  g_object_get(harnesses_.back()->element, "uri-base", &base, nullptr);
  EXPECT_STREQ(base, "https://cdn.example/shop");
  g_free(base);
}

TEST_F(AnnQueryTest, RequestsChooseTheirOwnK) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path, 7);

  gstmoe::BatchRecords batch;
  batch.rows = {text_request("three", 3), text_request("default"), text_request("more-than-catalog", 60)};
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 3u);
  const std::vector<std::pair<int, guint>> want = {{3, 3}, {7, 7}, {60, kItems}};  // "k", results
  for (size_t i = 0; i < out.size(); ++i) {
    Json doc(out[i]);
    EXPECT_EQ(Json::integer(doc.obj(), "k"), want[i].first) << doc.text();
    JsonArray* results = Json::array(doc.obj(), "results");
    ASSERT_NE(results, nullptr);
    EXPECT_EQ(json_array_get_length(results), want[i].second) << doc.text();
  }
  unref_all(out);
}

TEST_F(AnnQueryTest, WidthMismatchNamesBothWidths) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  while (GstMessage* m = gst_bus_pop(bus_)) gst_message_unref(m);

  GstHarness* h = harness(make_element("index", path.c_str(), nullptr));
  // A refused sticky event is kept by the pushing pad and retried with the next buffer, so the
  // refusal shows as not-negotiated on the data flow and as an error on the bus.
  GstCaps* narrow = gstmoe::tensor_caps(8);
  gst_harness_push_event(h, gst_event_new_caps(narrow));
  gst_caps_unref(narrow);
  GstSegment segment;
  gst_segment_init(&segment, GST_FORMAT_TIME);
  gst_harness_push_event(h, gst_event_new_segment(&segment));
  gstmoe::BatchRecords batch;
  batch.rows = {text_request("q")};
  EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_NOT_NEGOTIATED);
  const std::string error = bus_error();
  EXPECT_NE(error.find("width 8"), std::string::npos) << error;
  EXPECT_NE(error.find("dimension 16"), std::string::npos) << error;
  EXPECT_NE(error.find(path), std::string::npos) << error;
}

TEST_F(AnnQueryTest, MissingIndexFailsTheStateChange) {
  const std::string path = dir_.file("no-such-index.faiss");
  GstElement* element = make_element("index", path.c_str(), nullptr);
  EXPECT_EQ(gst_element_set_state(element, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE);
  const std::string error = bus_error();
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("No such file"), std::string::npos) << error;
  gst_element_set_state(element, GST_STATE_NULL);
  gst_object_unref(element);

  GstElement* unset = make_element("k", 3, nullptr);
  EXPECT_EQ(gst_element_set_state(unset, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE);
  EXPECT_NE(bus_error().find("No index file set"), std::string::npos);
  gst_element_set_state(unset, GST_STATE_NULL);
  gst_object_unref(unset);
}

TEST_F(AnnQueryTest, EmptyBuildIsAnError) {
  const std::string path = dir_.file("empty.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  EXPECT_FALSE(gst_harness_push_event(h, gst_event_new_eos()));
  const std::string error = bus_error();
  const std::string message = error.substr(0, error.find(" | "));  // what applications show
  EXPECT_NE(message.find("no items to index"), std::string::npos) << error;
  EXPECT_NE(message.find(path), std::string::npos) << error;
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(AnnQueryTest, BuildWriteFailuresNameThePath) {
  // The directory is checked when the element starts...
  const std::string missing_dir = dir_.file("no-such-dir/catalog.faiss");
  GstElement* element = make_element("mode", 1, "index", missing_dir.c_str(), nullptr);
  EXPECT_EQ(gst_element_set_state(element, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE);
  const std::string error = bus_error();
  const std::string message = error.substr(0, error.find(" | "));  // what applications show
  EXPECT_NE(message.find(missing_dir), std::string::npos) << error;
  EXPECT_NE(message.find("does not exist or is not writable"), std::string::npos) << error;
  gst_element_set_state(element, GST_STATE_NULL);
  gst_object_unref(element);

  // ...and a write that fails at EOS is an element error too (a directory holds the item
  // table's name), leaving no index behind.
  const std::string path = dir_.file("catalog.faiss");
  std::filesystem::create_directory(path + ".items.jsonl");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords batch;
  batch.rows = {catalog_record(0), catalog_record(1)};
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  EXPECT_FALSE(gst_harness_push_event(h, gst_event_new_eos()));
  GstMessage* msg = gst_bus_pop_filtered(bus_, GST_MESSAGE_ERROR);
  ASSERT_NE(msg, nullptr);
  GError* err = nullptr;
  gst_message_parse_error(msg, &err, nullptr);
  EXPECT_TRUE(g_error_matches(err, GST_RESOURCE_ERROR, GST_RESOURCE_ERROR_WRITE));
  EXPECT_NE(std::string(err->message).find(path + ".items.jsonl"), std::string::npos) << err->message;
  g_error_free(err);
  gst_message_unref(msg);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(AnnQueryTest, HnswBuildAndSearch) {
  const std::string path = dir_.file("catalog-hnsw.faiss");
  GstBuffer* summary_buf = build_index(path, "hnsw");
  ASSERT_NE(summary_buf, nullptr);
  {
    Json summary(summary_buf);
    EXPECT_EQ(Json::str(summary.obj(), "index_type"), "hnsw");
    EXPECT_EQ(Json::integer(summary.obj(), "items"), kItems);
  }
  gst_buffer_unref(summary_buf);
  EXPECT_EQ(moe::AnnIndex::load(path).type(), moe::AnnIndexType::Hnsw);

  GstHarness* h = search_harness(path, 4);
  gstmoe::BatchRecords batch;
  for (int i = 0; i < kItems; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), static_cast<size_t>(kItems));
  for (int i = 0; i < kItems; ++i) {
    Json doc(out[i]);
    EXPECT_EQ(Json::str(doc.obj(), "id"), "q" + std::to_string(i));
    JsonArray* results = Json::array(doc.obj(), "results");
    ASSERT_NE(results, nullptr);
    ASSERT_EQ(json_array_get_length(results), 4u);
    EXPECT_EQ(Json::integer(json_array_get_object_element(results, 0), "item"), i);
    EXPECT_NEAR(Json::number(json_array_get_object_element(results, 0), "score"), 1.0, 1e-5);
  }
  unref_all(out);
}

/* ----- index_factory types, search knobs and filters ----- */

// The item numbers of a result document's hits, best first.
std::vector<int64_t> hit_items(GstBuffer* buf, std::string* type = nullptr) {
  Json doc(buf);
  if (type) *type = Json::str(doc.obj(), "type");
  std::vector<int64_t> items;
  if (!json_object_has_member(doc.obj(), "results")) return items;
  JsonArray* results = Json::array(doc.obj(), "results");
  for (guint j = 0; j < json_array_get_length(results); ++j)
    items.push_back(Json::integer(json_array_get_object_element(results, j), "item"));
  return items;
}

// The exact top-k of `query` among catalog rows 0..n-1 that `keep` accepts.
std::vector<int64_t> brute_force(const std::vector<float>& catalog, const float* query, int k,
                                 const std::function<bool(int)>& keep) {
  std::vector<std::pair<double, int64_t>> scored;
  for (int i = 0; i < kItems; ++i) {
    if (!keep(i)) continue;
    double dot = 0;
    for (int j = 0; j < kWidth; ++j) dot += double(catalog[i * kWidth + j]) * query[j];
    scored.push_back({-dot, i});
  }
  std::sort(scored.begin(), scored.end());
  std::vector<int64_t> out;
  for (size_t j = 0; j < scored.size() && j < static_cast<size_t>(k); ++j) out.push_back(scored[j].second);
  return out;
}

TEST_F(AnnQueryTest, IndexFactoryStringsBuildAndSearch) {
  for (const char* type : {"Flat", "HNSW16", "IVF4,Flat", "IVF2,PQ4x4", "PCA16,IVF2,Flat"}) {
    SCOPED_TRACE(type);
    const std::string path = dir_.file(std::string("catalog-") + type + ".faiss");
    GstBuffer* summary_buf = build_index(path, type);
    ASSERT_NE(summary_buf, nullptr);
    const moe::AnnIndex loaded = moe::AnnIndex::load(path);
    {
      Json summary(summary_buf);
      EXPECT_EQ(Json::str(summary.obj(), "index_type"), moe::ann_index_type_name(loaded.type()));
    }
    gst_buffer_unref(summary_buf);
    EXPECT_EQ(loaded.factory(), type);
    EXPECT_EQ(loaded.size(), kItems);  // the 50 rows: the default sample (64 per list) is capped by them

    GstHarness* h = search_harness(path, 3);
    g_object_set(gst_harness_find_element(h, "ann-query"), "nprobe", 4, nullptr);
    gst_object_unref(gst_harness_find_element(h, "ann-query"));
    gstmoe::BatchRecords batch;
    for (int i = 0; i < 10; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
    ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
    std::vector<GstBuffer*> out = pull_all(h);
    ASSERT_EQ(out.size(), 10u);
    const bool exact = std::string(type).find("PQ") == std::string::npos;
    for (int i = 0; i < 10; ++i) {
      const auto items = hit_items(out[i]);
      ASSERT_EQ(items.size(), 3u);
      if (exact) {
        EXPECT_EQ(items[0], i);  // every list scanned: each vector finds itself
      }
    }
    unref_all(out);
  }
}

TEST_F(AnnQueryTest, IndexTypesFaissRefusesFailTheBuildSayingWhy) {
  GstElement* element = make_element("mode", 1, "index", dir_.file("bogus.faiss").c_str(), nullptr);
  gst_util_set_object_arg(G_OBJECT(element), "index-type", "Bogus7");
  GstHarness* h = harness(element);
  set_tensor_caps(h, kWidth);
  EXPECT_NE(bus_error().find("'Bogus7'"), std::string::npos);

  // Fewer rows than lists: nothing written, the error names a list count that fits.
  const std::string path = dir_.file("few.faiss");
  element = make_element("mode", 1, "index", path.c_str(), nullptr);
  gst_util_set_object_arg(G_OBJECT(element), "index-type", "IVF64,Flat");
  h = harness(element);
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords batch;
  for (int i = 0; i < kItems; ++i) batch.rows.push_back(catalog_record(i));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  gst_harness_push_event(h, gst_event_new_eos());
  const std::string error = bus_error();
  EXPECT_NE(error.find("64 lists but the build has only 50 vectors"), std::string::npos) << error;
  EXPECT_NE(error.find("use IVF1 lists"), std::string::npos) << error;
  EXPECT_FALSE(g_file_test(path.c_str(), G_FILE_TEST_EXISTS));
}

// nprobe changes while PLAYING, and a request's own "nprobe" overrides it: with one list of eight
// scanned, a query sees only that list's few items; with all eight, its 10 nearest.
TEST_F(AnnQueryTest, NprobeChangesWhilePlayingAndPerRequest) {
  const std::string path = dir_.file("ivf.faiss");
  gst_buffer_unref(build_index(path, "IVF8,Flat"));
  GstHarness* h = search_harness(path, 10);
  GstElement* element = gst_harness_find_element(h, "ann-query");
  const auto queries = random_unit_vectors(8, kWidth, 77);
  const auto search = [&](int request_nprobe) {
    gstmoe::BatchRecords batch;
    for (int i = 0; i < 8; ++i) {
      batch.rows.push_back(text_request("q" + std::to_string(i)));
      batch.rows.back().nprobe = request_nprobe;
    }
    EXPECT_EQ(gst_harness_push(h, tensor_buffer(queries, 0, batch)), GST_FLOW_OK);
    std::vector<GstBuffer*> out = pull_all(h);
    std::vector<std::vector<int64_t>> hits;
    for (GstBuffer* b : out) hits.push_back(hit_items(b));
    unref_all(out);
    return hits;
  };
  const auto exact = [&](int q) {
    return brute_force(catalog_, queries.data() + q * kWidth, 10, [](int) { return true; });
  };

  g_object_set(element, "nprobe", 1, nullptr);
  const auto one = search(0);
  ASSERT_EQ(one.size(), 8u);
  size_t seen = 0;
  for (const auto& hits : one) seen += hits.size();
  EXPECT_LT(seen, 80u);  // 50 items in 8 lists: one list holds fewer than 10 on average

  g_object_set(element, "nprobe", 8, nullptr);  // while PLAYING
  const auto all = search(0);
  for (int q = 0; q < 8; ++q) EXPECT_EQ(all[q], exact(q)) << q;

  g_object_set(element, "nprobe", 1, nullptr);
  const auto per_request = search(8);  // the request's own nprobe wins
  for (int q = 0; q < 8; ++q) EXPECT_EQ(per_request[q], exact(q)) << q;
  gst_object_unref(element);
}

// A request's filter: only the matching catalog items, the exact top-k among them (flat; IVF with
// one list scanned still finds k because it falls back to every list), none when nothing matches.
TEST_F(AnnQueryTest, RequestFiltersReturnTheBruteForceTopKOfTheMatchingItems) {
  for (const char* type : {"flat", "IVF8,Flat", "hnsw"}) {
    SCOPED_TRACE(type);
    const std::string path = dir_.file(std::string("filtered-") + type + ".faiss");
    gst_buffer_unref(build_index(path, type));
    GstHarness* h = search_harness(path, 5);
    GstElement* element = gst_harness_find_element(h, "ann-query");
    g_object_set(element, "nprobe", 1, nullptr);
    gst_object_unref(element);
    const auto queries = random_unit_vectors(4, kWidth, 78);

    // catalog_record: items i % 3 == 0 have {"price": i.5, "sku": "SKU-i"}.
    moe::AnnFilterCondition cheap{"price"};
    cheap.lt = 20;
    struct Case {
      moe::AnnFilter filter;
      std::function<bool(int)> keep;
    };
    const std::vector<Case> cases = {
        {{{cheap}}, [](int i) { return i % 3 == 0 && i < 20; }},
        {{{{"sku", {std::string("SKU-3"), std::string("SKU-30"), std::string("SKU-4")}}}},
         [](int i) { return i == 3 || i == 30; }},
        {{{{"sku", {std::string("SKU-9")}}, cheap}}, [](int i) { return i == 9; }},
        {{{{"sku", {std::string("no such sku")}}}}, [](int) { return false; }},
        {{{{"colour", {std::string("red")}}}}, [](int) { return false; }},
    };
    gstmoe::BatchRecords batch;
    for (size_t c = 0; c < cases.size(); ++c)
      for (int q = 0; q < 4; ++q) {
        batch.rows.push_back(text_request("c" + std::to_string(c) + "q" + std::to_string(q)));
        batch.rows.back().filter = cases[c].filter;
      }
    std::vector<float> vectors;
    for (size_t c = 0; c < cases.size(); ++c) vectors.insert(vectors.end(), queries.begin(), queries.end());
    ASSERT_EQ(gst_harness_push(h, tensor_buffer(vectors, 0, batch)), GST_FLOW_OK);
    std::vector<GstBuffer*> out = pull_all(h);
    ASSERT_EQ(out.size(), cases.size() * 4);
    for (size_t c = 0; c < cases.size(); ++c)
      for (int q = 0; q < 4; ++q) {
        std::string doc_type;
        const auto got = hit_items(out[c * 4 + q], &doc_type);
        EXPECT_EQ(doc_type, "result");  // a filter nothing matches is answered with no hits
        EXPECT_EQ(got, brute_force(catalog_, queries.data() + q * kWidth, 5, cases[c].keep)) << "case " << c;
      }
    unref_all(out);
  }
}

// device=cuda:0 searches a flat index on the GPU with the same hits as FAISS; without a usable
// GPU it fails the start saying why. An HNSW index cannot go to a GPU either way; "auto" always
// works (FAISS for HNSW and without a GPU).
TEST_F(AnnQueryTest, CudaDeviceSearchesLikeFaissOrFailsWithTheReason) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  const std::string hnsw_path = dir_.file("catalog-hnsw.faiss");
  gst_buffer_unref(build_index(hnsw_path, "hnsw"));
  gstmoe::BatchRecords batch;
  for (int i = 0; i < 6; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
  const auto top_items = [&](GstHarness* h) {
    EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
    std::vector<GstBuffer*> out = pull_all(h);
    std::vector<std::vector<int64_t>> items;
    for (GstBuffer* b : out) {
      Json doc(b);
      JsonArray* results = Json::array(doc.obj(), "results");
      items.emplace_back();
      for (guint j = 0; results && j < json_array_get_length(results); ++j)
        items.back().push_back(Json::integer(json_array_get_object_element(results, j), "item"));
    }
    unref_all(out);
    return items;
  };
  const auto on_cpu = top_items(search_harness(path, 4));
  ASSERT_EQ(on_cpu.size(), 6u);

  GstHarness* automatic = harness(make_element("index", path.c_str(), "k", 4u, "device", "auto", nullptr));
  set_tensor_caps(automatic, kWidth);
  EXPECT_EQ(top_items(automatic), on_cpu);
  GstHarness* hnsw_auto = harness(make_element("index", hnsw_path.c_str(), "k", 4u, "device", "auto", nullptr));
  set_tensor_caps(hnsw_auto, kWidth);
  EXPECT_EQ(top_items(hnsw_auto).size(), 6u);

  GstElement* hnsw_gpu = make_element("index", hnsw_path.c_str(), "device", "cuda:0", nullptr);
  EXPECT_EQ(gst_element_set_state(hnsw_gpu, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE);
  const std::string hnsw_error = bus_error();
  EXPECT_NE(hnsw_error.find("device 'cuda:0'"), std::string::npos) << hnsw_error;
  gst_element_set_state(hnsw_gpu, GST_STATE_NULL);
  gst_object_unref(hnsw_gpu);

  std::string why;
  if (moe::kernels::cuda_device_count(&why) > 0) {
    GstHarness* gpu = harness(make_element("index", path.c_str(), "k", 4u, "device", "cuda:0", nullptr));
    set_tensor_caps(gpu, kWidth);
    EXPECT_EQ(top_items(gpu), on_cpu);
  } else {
    GstElement* gpu = make_element("index", path.c_str(), "device", "cuda:0", nullptr);
    EXPECT_EQ(gst_element_set_state(gpu, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE);
    const std::string error = bus_error();
    EXPECT_NE(error.find("device 'cuda:0'"), std::string::npos) << error;
    EXPECT_NE(error.find(why), std::string::npos) << error;
    gst_element_set_state(gpu, GST_STATE_NULL);
    gst_object_unref(gpu);
  }
}

// ---- provenance ----------------------------------------------------------------------------

TEST_F(AnnQueryTest, BuildRecordsTheModelsOfItsRows) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  ASSERT_TRUE(index.provenance().has_value());
  EXPECT_EQ(index.provenance()->encoder, "clip");
  EXPECT_EQ(index.provenance()->encoder_fingerprint, kClipAndAdapter.encoder_fingerprint);
  EXPECT_EQ(index.provenance()->adapter, "adapter");
  EXPECT_EQ(index.provenance()->adapter_fingerprint, kClipAndAdapter.adapter_fingerprint);

  // Routed but not run through moe-expert: moe-route's adapter name, no adapter fingerprint, so
  // the index records no adapter.
  const std::string routed_only = dir_.file("routed.faiss");
  gst_buffer_unref(build_index(routed_only, "flat", {"clip", "00000000000c11b0", "adapter", ""}));
  ASSERT_TRUE(moe::AnnIndex::load(routed_only).provenance().has_value());
  EXPECT_EQ(moe::AnnIndex::load(routed_only).provenance()->adapter, "");
  EXPECT_EQ(moe::AnnIndex::load(routed_only).provenance()->adapter_fingerprint, "");

  // Rows of unknown origin (no encoder fingerprint): no provenance.
  const std::string unknown = dir_.file("unknown.faiss");
  gst_buffer_unref(build_index(unknown));
  EXPECT_FALSE(moe::AnnIndex::load(unknown).provenance().has_value());
}

TEST_F(AnnQueryTest, BuildRefusesRowsFromOtherModels) {
  const std::string path = dir_.file("catalog.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords first;
  first.rows = {catalog_record(0), catalog_record(1)};
  kClipAndAdapter.stamp(first);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, first)), GST_FLOW_OK);
  EXPECT_EQ(bus_error(), "");

  gstmoe::BatchRecords second;
  second.rows = {catalog_record(2), catalog_record(3)};
  Models{"clip", kClipAndAdapter.encoder_fingerprint, "adapter", "000000000000ffff"}.stamp(second);
  EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 2, second)), GST_FLOW_ERROR);
  const std::string error = bus_error();
  const std::string message = error.substr(0, error.find(" | "));  // what applications show
  EXPECT_NE(message.find(path), std::string::npos) << error;
  EXPECT_NE(message.find("encoded by encoder 'clip' (fp 00000000000c11b0) and adapter 'adapter' (fp 00000000000adab7)"),
            std::string::npos)
      << error;
  EXPECT_NE(message.find("request 'item-2' was encoded by encoder 'clip' (fp 00000000000c11b0) and adapter 'adapter' "
                         "(fp 000000000000ffff)"),
            std::string::npos)
      << error;

  // The refused rows are answered with error documents carrying their ids.
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 2u);
  for (size_t i = 0; i < out.size(); ++i) {
    Json doc(out[i]);
    EXPECT_EQ(Json::str(doc.obj(), "type"), "error");
    EXPECT_EQ(Json::str(doc.obj(), "id"), "item-" + std::to_string(2 + i));
    JsonObject* err = Json::object(doc.obj(), "error");
    ASSERT_NE(err, nullptr);
    EXPECT_EQ(Json::str(err, "stage"), "ann-query");
    EXPECT_EQ(Json::str(err, "reason"), message);
  }
  unref_all(out);

  // Nothing is written at EOS: an index of mixed models is worse than none.
  EXPECT_FALSE(gst_harness_push_event(h, gst_event_new_eos()));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(AnnQueryTest, BuildWithoutAdapterThenWithOneIsRefused) {
  const std::string path = dir_.file("catalog.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords first;
  first.rows = {catalog_record(0)};
  Models{"clip", kClipAndAdapter.encoder_fingerprint, "", ""}.stamp(first);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, first)), GST_FLOW_OK);
  gstmoe::BatchRecords second;
  second.rows = {catalog_record(1)};
  kClipAndAdapter.stamp(second);
  EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 1, second)), GST_FLOW_ERROR);
  const std::string error = bus_error();
  EXPECT_NE(error.find("encoded by encoder 'clip' (fp 00000000000c11b0) without an adapter"), std::string::npos)
      << error;
  EXPECT_NE(error.find("and adapter 'adapter' (fp 00000000000adab7)"), std::string::npos) << error;
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(Json::str(Json(out[0]).obj(), "id"), "item-1");
  unref_all(out);
}

// The documents of one pushed batch: ids of results, and id -> reason of errors.
struct Answers {
  std::vector<std::string> results;
  std::map<std::string, std::string> errors;
  std::map<std::string, std::string> codes;  // id -> error.code
};

class AnnQueryProvenanceTest : public AnnQueryTest {
 protected:
  // Pushes rows q0..q{n-1} (and one request failed upstream, "upstream-failure") made by
  // `models` into a search of the index at `path`.
  Answers search(const std::string& path, const Models& models, int n = 4) {
    GstHarness* h = search_harness(path);
    gstmoe::BatchRecords batch;
    for (int i = 0; i < n; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
    batch.failed.push_back(failed_request("upstream-failure"));
    models.stamp(batch);
    EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
    Answers a;
    std::vector<GstBuffer*> out = pull_all(h);
    for (GstBuffer* b : out) {
      Json doc(b);
      if (Json::str(doc.obj(), "type") == "result") {
        a.results.push_back(Json::str(doc.obj(), "id"));
        EXPECT_EQ(json_array_get_length(Json::array(doc.obj(), "results")), 5u) << doc.text();
        continue;
      }
      EXPECT_EQ(Json::str(doc.obj(), "type"), "error") << doc.text();
      JsonObject* err = Json::object(doc.obj(), "error");
      if (err == nullptr) continue;
      a.errors[Json::str(doc.obj(), "id")] = Json::str(err, "stage") + ": " + Json::str(err, "reason");
      a.codes[Json::str(doc.obj(), "id")] = Json::str(err, "code");
    }
    unref_all(out);
    return a;
  }
  const std::vector<std::string> all_ids_ = {"q0", "q1", "q2", "q3"};
};

TEST_F(AnnQueryProvenanceTest, MatchingModelsAreSearched) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  // Names only label the models: renamed directories with the same weights match.
  const Answers a = search(
      path, {"clip-copy", kClipAndAdapter.encoder_fingerprint, "adapter-v1", kClipAndAdapter.adapter_fingerprint});
  EXPECT_EQ(a.results, all_ids_);
  ASSERT_EQ(a.errors.size(), 1u);
  EXPECT_EQ(a.errors.begin()->first, "upstream-failure");
}

TEST_F(AnnQueryProvenanceTest, AnotherAdapterIsRefusedPerRequest) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  const Answers a = search(path, {"clip", kClipAndAdapter.encoder_fingerprint, "adapter", "000000000000ffff"});
  EXPECT_TRUE(a.results.empty());
  ASSERT_EQ(a.errors.size(), 5u);
  EXPECT_NE(a.errors.at("upstream-failure").find("zmq-query: "), std::string::npos) << "its own reason is kept";
  EXPECT_EQ(a.codes.at("upstream-failure"), "image_unavailable") << "and its own code";
  for (const std::string& id : all_ids_) {
    ASSERT_EQ(a.errors.count(id), 1u) << id;
    EXPECT_EQ(a.codes.at(id), "model_mismatch");
    EXPECT_EQ(a.errors.at(id), "ann-query: the index " + path +
                                   " was built from encoder 'clip' (fp 00000000000c11b0) and adapter 'adapter' (fp "
                                   "00000000000adab7), but this query was encoded by encoder 'clip' (fp "
                                   "00000000000c11b0) and adapter 'adapter' (fp 000000000000ffff): rebuild the index "
                                   "with this pipeline or search it with the pipeline that built it");
  }
}

TEST_F(AnnQueryProvenanceTest, AdapterPresentVersusAbsentIsRefused) {
  // Index with an adapter, queries without (moe-route alone names the adapter but adapts nothing).
  const std::string with = dir_.file("with.faiss");
  gst_buffer_unref(build_index(with, "flat", kClipAndAdapter));
  Answers a = search(with, {"clip", kClipAndAdapter.encoder_fingerprint, "adapter", ""});
  EXPECT_TRUE(a.results.empty());
  for (const std::string& id : all_ids_) {
    ASSERT_EQ(a.errors.count(id), 1u) << id;
    EXPECT_NE(a.errors.at(id).find("but this query was encoded by encoder 'clip' (fp 00000000000c11b0) without an "
                                   "adapter: rebuild"),
              std::string::npos)
        << a.errors.at(id);
  }

  // Index without an adapter, queries with one.
  const std::string without = dir_.file("without.faiss");
  gst_buffer_unref(build_index(without, "flat", {"clip", kClipAndAdapter.encoder_fingerprint, "", ""}));
  a = search(without, kClipAndAdapter);
  EXPECT_TRUE(a.results.empty());
  for (const std::string& id : all_ids_) {
    ASSERT_EQ(a.errors.count(id), 1u) << id;
    EXPECT_NE(a.errors.at(id).find("was built from encoder 'clip' (fp 00000000000c11b0) without an adapter, but this "
                                   "query was encoded by encoder 'clip' (fp 00000000000c11b0) and adapter 'adapter'"),
              std::string::npos)
        << a.errors.at(id);
  }
}

TEST_F(AnnQueryProvenanceTest, AnotherEncoderIsRefused) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  const Answers a = search(path, {"clip", "0000000000000bad", "adapter", kClipAndAdapter.adapter_fingerprint});
  EXPECT_TRUE(a.results.empty());
  for (const std::string& id : all_ids_) {
    ASSERT_EQ(a.errors.count(id), 1u) << id;
    EXPECT_NE(a.errors.at(id).find("encoded by encoder 'clip' (fp 0000000000000bad)"), std::string::npos);
  }
}

TEST_F(AnnQueryProvenanceTest, UncheckableSidesAreSearchedAsBefore) {
  // An index without provenance (as written before it existed) answers fingerprinted queries.
  const std::string old_index = dir_.file("old.faiss");
  gst_buffer_unref(build_index(old_index));
  ASSERT_FALSE(moe::AnnIndex::load(old_index).provenance().has_value());
  EXPECT_EQ(search(old_index, kClipAndAdapter).results, all_ids_);
  // Rows of unknown origin (not from moe-encode) are searched in an index with provenance.
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  EXPECT_EQ(search(path, {}).results, all_ids_);
}

TEST_F(AnnQueryTest, StateCyclesReloadTheIndex) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstElement* element = make_element("index", path.c_str(), nullptr);
  for (int cycle = 0; cycle < 3; ++cycle) {
    EXPECT_EQ(gst_element_set_state(element, GST_STATE_PLAYING), GST_STATE_CHANGE_SUCCESS);
    EXPECT_EQ(gst_element_set_state(element, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
  }
  gst_object_unref(element);
  EXPECT_EQ(bus_error(), "");
}

// The counters of an ann-query's `stats`, by field name; `search_ms` gets its search-ms.
std::map<std::string, guint64> read_stats(GstElement* element, double* search_ms = nullptr) {
  GstStructure* s = nullptr;
  g_object_get(element, "stats", &s, nullptr);
  EXPECT_NE(s, nullptr);
  std::map<std::string, guint64> counters;
  if (!s) return counters;
  EXPECT_STREQ(gst_structure_get_name(s), "ann-query-stats");
  for (const char* field : {"requests", "results", "errors", "refused", "added", "batches"})
    EXPECT_TRUE(gst_structure_get_uint64(s, field, &counters[field])) << field;
  double ms = -1;
  EXPECT_TRUE(gst_structure_get_double(s, "search-ms", &ms));
  if (search_ms) *search_ms = ms;
  gst_structure_free(s);
  return counters;
}

std::map<std::string, guint64> counters(guint64 requests, guint64 results, guint64 errors, guint64 refused,
                                        guint64 added, guint64 batches) {
  return {{"requests", requests}, {"results", results}, {"errors", errors},
          {"refused", refused},   {"added", added},     {"batches", batches}};
}

TEST_F(AnnQueryTest, StatsCountRequestsDocumentsAndSearchTime) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path, "flat", kClipAndAdapter));
  // The build: 50 rows in three batches, one request that failed upstream.
  double search_ms = -1;
  EXPECT_EQ(read_stats(harnesses_.back()->element, &search_ms), counters(51, 0, 1, 0, 50, 3));
  EXPECT_EQ(search_ms, 0.0);

  GstElement* element = make_element("index", path.c_str(), nullptr);
  EXPECT_EQ(read_stats(element), counters(0, 0, 0, 0, 0, 0));  // readable before the first start
  GstHarness* h = harness(element);
  set_tensor_caps(h, kWidth);
  // Four rows and a request that failed upstream, from the index's models; then two rows that
  // another adapter made, refused.
  gstmoe::BatchRecords matching;
  for (int i = 0; i < 4; ++i) matching.rows.push_back(text_request("q" + std::to_string(i)));
  matching.failed.push_back(failed_request("upstream-failure"));
  kClipAndAdapter.stamp(matching);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, matching)), GST_FLOW_OK);
  gstmoe::BatchRecords other;
  other.rows = {text_request("other0"), text_request("other1")};
  Models{"clip", kClipAndAdapter.encoder_fingerprint, "adapter", "000000000000ffff"}.stamp(other);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, other)), GST_FLOW_OK);

  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 7u);
  // One search ran (the refused rows are not searched): its time is in every result's timings.
  const gstmoe::RequestRecord& answered = gst_buffer_get_moe_batch_meta(out[0])->records->rows.at(0);
  ASSERT_EQ(answered.timings_ms.back().first, "search");
  EXPECT_EQ(read_stats(h->element, &search_ms), counters(7, 4, 3, 2, 0, 2));
  EXPECT_DOUBLE_EQ(search_ms, answered.timings_ms.back().second);
  unref_all(out);

  // Kept after stop, reset at the next start.
  ASSERT_EQ(gst_element_set_state(h->element, GST_STATE_READY), GST_STATE_CHANGE_SUCCESS);
  EXPECT_EQ(read_stats(h->element), counters(7, 4, 3, 2, 0, 2));
  ASSERT_EQ(gst_element_set_state(h->element, GST_STATE_PAUSED), GST_STATE_CHANGE_SUCCESS);
  EXPECT_EQ(read_stats(h->element, &search_ms), counters(0, 0, 0, 0, 0, 0));
  EXPECT_EQ(search_ms, 0.0);

  GParamSpec* spec = g_object_class_find_property(G_OBJECT_GET_CLASS(h->element), "stats");
  ASSERT_NE(spec, nullptr);
  EXPECT_EQ(spec->flags & G_PARAM_READWRITE, G_PARAM_READABLE);
}

TEST_F(AnnQueryTest, PropertiesDocumentTheirRanges) {
  GstElement* element = make_element("k", 1, nullptr);
  auto uint_spec = [&](const char* name) {
    return G_PARAM_SPEC_UINT(g_object_class_find_property(G_OBJECT_GET_CLASS(element), name));
  };
  EXPECT_EQ(uint_spec("k")->maximum, 1024u);
  EXPECT_EQ(uint_spec("k")->default_value, 10u);
  EXPECT_EQ(uint_spec("hnsw-m")->default_value, 32u);
  EXPECT_EQ(uint_spec("ef-construction")->default_value, 80u);
  EXPECT_EQ(uint_spec("ef-search")->default_value, 64u);
  gchar* device = nullptr;
  g_object_get(element, "device", &device, nullptr);
  EXPECT_STREQ(device, "cpu");
  g_free(device);
  EXPECT_STREQ(g_type_name(GST_TYPE_ANN_QUERY_MODE), "GstAnnQueryMode");
  EXPECT_EQ(uint_spec("nprobe")->default_value, 16u);
  EXPECT_EQ(uint_spec("nprobe")->maximum, 65536u);
  EXPECT_EQ(uint_spec("train-size")->default_value, 0u);
  EXPECT_TRUE(g_object_class_find_property(G_OBJECT_GET_CLASS(element), "nprobe")->flags & GST_PARAM_MUTABLE_PLAYING);
  // `index` may be set while searching (a hot swap); updates are off unless asked for.
  EXPECT_TRUE(g_object_class_find_property(G_OBJECT_GET_CLASS(element), "index")->flags & GST_PARAM_MUTABLE_PLAYING);
  GParamSpec* allow = g_object_class_find_property(G_OBJECT_GET_CLASS(element), "allow-updates");
  ASSERT_NE(allow, nullptr);
  EXPECT_FALSE(G_PARAM_SPEC_BOOLEAN(allow)->default_value);
  EXPECT_TRUE(allow->flags & GST_PARAM_MUTABLE_READY);
  EXPECT_EQ(uint_spec("snapshot-interval")->default_value, 0u);
  EXPECT_TRUE(G_PARAM_SPEC(uint_spec("snapshot-interval"))->flags & GST_PARAM_MUTABLE_PLAYING);
  gchar* index_type = nullptr;
  g_object_get(element, "index-type", &index_type, nullptr);
  EXPECT_STREQ(index_type, "flat");
  g_free(index_type);
  gst_util_set_object_arg(G_OBJECT(element), "mode", "build");
  gint mode = 0;
  g_object_get(element, "mode", &mode, nullptr);
  EXPECT_EQ(mode, GST_ANN_QUERY_MODE_BUILD);
  gst_object_unref(element);
}

/* ----- watching a build: progress, the summary, what the catalog skips ----- */

// The progress messages on `bus` so far.
std::vector<GstMessage*> progress_messages(GstBus* bus) {
  std::vector<GstMessage*> out;
  while (GstMessage* msg = gst_bus_pop_filtered(bus, GST_MESSAGE_PROGRESS)) out.push_back(msg);
  return out;
}

struct Progress {
  GstProgressType type;
  std::string code, text;
  guint64 done = 0, added = 0, failed = 0;
  gint64 total = 0;
  double rate = 0, eta_s = 0;
};

Progress parse_progress(GstMessage* msg) {
  Progress p;
  gchar *code = nullptr, *text = nullptr;
  gst_message_parse_progress(msg, &p.type, &code, &text);
  p.code = code;
  p.text = text;
  g_free(code);
  g_free(text);
  const GstStructure* st = gst_message_get_structure(msg);
  EXPECT_TRUE(gst_structure_get_uint64(st, "done", &p.done) && gst_structure_get_uint64(st, "added", &p.added) &&
              gst_structure_get_uint64(st, "failed", &p.failed) && gst_structure_get_int64(st, "total", &p.total) &&
              gst_structure_get_double(st, "rate", &p.rate) && gst_structure_get_double(st, "eta-s", &p.eta_s))
      << gst_structure_to_string(st);
  return p;
}

std::vector<Progress> take_progress(GstBus* bus) {
  std::vector<Progress> out;
  for (GstMessage* msg : progress_messages(bus)) {
    out.push_back(parse_progress(msg));
    gst_message_unref(msg);
  }
  return out;
}

// Every `progress-items` requests a progress message with the figures; at EOS a complete one whose
// text names each failed item and its reason; stats show the same.
TEST_F(AnnQueryTest, BuildReportsProgressAndNamesFailuresInItsSummary) {
  const std::string path = dir_.file("progress.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), "progress-items", 20u, nullptr));
  set_tensor_caps(h, kWidth);
  for (int first = 0; first < kItems; first += 10) {  // requests taken: 10, 20, 31, 41, 51
    gstmoe::BatchRecords batch;
    for (int i = first; i < first + 10; ++i) batch.rows.push_back(catalog_record(i));
    if (first == 20) batch.failed.push_back(failed_request("broken-image"));
    ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, first, batch)), GST_FLOW_OK);
  }
  std::vector<Progress> during = take_progress(bus_);
  ASSERT_EQ(during.size(), 2u);
  EXPECT_EQ(during[0].type, GST_PROGRESS_TYPE_START);
  EXPECT_EQ(during[1].type, GST_PROGRESS_TYPE_CONTINUE);
  EXPECT_EQ(during[0].done, 20u);
  EXPECT_EQ(during[0].failed, 0u);
  EXPECT_EQ(during[1].done, 41u);
  EXPECT_EQ(during[1].added, 40u);
  EXPECT_EQ(during[1].failed, 1u);
  for (const Progress& p : during) {
    EXPECT_EQ(p.code, "index-build");
    EXPECT_EQ(p.total, -1) << "the harness announces no duration";
    EXPECT_EQ(p.eta_s, -1.0);
    EXPECT_GT(p.rate, 0.0);
    EXPECT_NE(p.text.find(std::to_string(p.done) + " items, " + std::to_string(p.failed) + " failed, "),
              std::string::npos)
        << p.text;
  }

  GstStructure* stats = nullptr;
  g_object_get(h->element, "stats", &stats, nullptr);
  gint64 total = 0;
  double rate = 0;
  EXPECT_TRUE(gst_structure_get_int64(stats, "total", &total));
  EXPECT_TRUE(gst_structure_get_double(stats, "rate", &rate));
  EXPECT_EQ(total, -1);
  EXPECT_GT(rate, 0.0);
  gst_structure_free(stats);

  EXPECT_TRUE(gst_harness_push_event(h, gst_event_new_eos()));
  const std::vector<Progress> end = take_progress(bus_);
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].type, GST_PROGRESS_TYPE_COMPLETE);
  EXPECT_EQ(end[0].done, 51u);
  EXPECT_EQ(end[0].added, 50u);
  EXPECT_NE(end[0].text.find("indexed 50 of 51 items into " + path), std::string::npos) << end[0].text;
  EXPECT_NE(end[0].text.find("; 1 failed:\n  /nope.jpg: image file '/nope.jpg' cannot be read: No such file or "
                             "directory [image_unavailable]"),
            std::string::npos)
      << end[0].text;
  std::vector<GstBuffer*> docs = pull_all(h);
  EXPECT_EQ(docs.size(), 2u);  // the error document, then the index-built one
  unref_all(docs);
}

TEST_F(AnnQueryTest, BuildWithoutItemsSaysWhichFailedBeforeItsError) {
  const std::string path = dir_.file("none.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords batch;
  batch.failed.push_back(failed_request("broken-image"));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  EXPECT_FALSE(gst_harness_push_event(h, gst_event_new_eos()));
  // The summary comes first, then the error.
  GstMessage* summary = gst_bus_pop_filtered(bus_, GST_MESSAGE_PROGRESS);
  ASSERT_NE(summary, nullptr);
  const Progress end = parse_progress(summary);
  gst_message_unref(summary);
  EXPECT_EQ(end.type, GST_PROGRESS_TYPE_ERROR);
  EXPECT_NE(end.text.find("nothing indexed"), std::string::npos) << end.text;
  EXPECT_NE(end.text.find("/nope.jpg: "), std::string::npos) << end.text;
  EXPECT_NE(bus_error().find("no items to index"), std::string::npos);
  std::vector<GstBuffer*> docs = pull_all(h);
  EXPECT_EQ(docs.size(), 1u);  // the failed request's error document still goes out
  unref_all(docs);
}

// A folder with images, a text file, a bad image, a subfolder two levels deep and a symlink
// back to the top.
struct ImageFolder {
  TempDir dir;
  ImageFolder() {
    const std::vector<uint8_t> png = moe::test::make_png(std::vector<uint8_t>(6 * 4 * 3, 90), 6, 4, 3);
    std::filesystem::create_directories(dir.file("sub/deeper"));
    for (const char* name : {"a.png", "b.PNG", "sub/c.png", "sub/deeper/d.png"}) dir.write(name, png);
    dir.write("notes.txt", "not an image");
    std::filesystem::create_directory_symlink("..", dir.file("sub/loop"));
  }
};

// What moe-catalog-src sends for `location`: the ids of its requests, the folder entries it
// skipped (stats, and the warning naming them) and the duration it announces.
struct Listing {
  std::vector<std::string> ids;
  guint64 skipped = 0;
  std::string warning;
  gint64 duration = -1;
};

Listing list_catalog(GstBus* bus, const std::string& location, bool recursive) {
  GstElement* src = gst_element_factory_make("moe-catalog-src", nullptr);
  g_object_set(src, "location", location.c_str(), "recursive", recursive, nullptr);
  gst_element_set_bus(src, bus);
  GstHarness* h = gst_harness_new_with_element(src, nullptr, "src");
  gst_object_unref(src);
  gst_harness_play(h);
  Listing l;
  GstStructure* stats = nullptr;
  g_object_get(h->element, "stats", &stats, nullptr);
  guint64 items = 0;
  EXPECT_TRUE(gst_structure_get_uint64(stats, "items", &items) &&
              gst_structure_get_uint64(stats, "skipped", &l.skipped));
  gst_structure_free(stats);
  EXPECT_TRUE(gst_element_query_duration(h->element, GST_FORMAT_DEFAULT, &l.duration));
  for (guint64 i = 0; i < items; ++i) {
    GstBuffer* buf = gst_harness_pull(h);
    if (buf == nullptr) break;
    const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
    EXPECT_TRUE(meta && meta->records->rows.size() == 1) << "item " << i << " could not be read";
    if (meta && meta->records->rows.size() == 1) l.ids.push_back(meta->records->rows[0].id);
    EXPECT_GT(gst_buffer_get_size(buf), 0u);
    gst_buffer_unref(buf);
  }
  if (GstMessage* msg = gst_bus_pop_filtered(bus, GST_MESSAGE_WARNING)) {
    GError* err = nullptr;
    gst_message_parse_warning(msg, &err, nullptr);
    l.warning = err->message;
    g_error_free(err);
    gst_message_unref(msg);
  }
  gst_harness_teardown(h);
  return l;
}

TEST_F(AnnQueryTest, CatalogFolderSkipsSubfoldersAndOtherFilesSayingSo) {
  ImageFolder folder;
  const Listing l = list_catalog(bus_, folder.dir.path(), false);
  EXPECT_EQ(l.ids, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(l.duration, 2);
  EXPECT_EQ(l.skipped, 2u);
  EXPECT_NE(l.warning.find("Skipped 2 entries"), std::string::npos) << l.warning;
  EXPECT_NE(l.warning.find("notes.txt (not an image file by its extension)"), std::string::npos) << l.warning;
  EXPECT_NE(l.warning.find("sub/ (a subfolder: set recursive=true"), std::string::npos) << l.warning;
}

TEST_F(AnnQueryTest, RecursiveCatalogFolderTakesSubfoldersOnceEach) {
  ImageFolder folder;
  const Listing l = list_catalog(bus_, folder.dir.path(), true);
  // Below the top folder an id keeps its folders; the symlink back to the top is not followed twice.
  EXPECT_EQ(l.ids, (std::vector<std::string>{"a", "b", "sub/c", "sub/deeper/d"}));
  EXPECT_EQ(l.duration, 4);
  EXPECT_EQ(l.skipped, 2u);
  EXPECT_NE(l.warning.find("notes.txt"), std::string::npos) << l.warning;
  EXPECT_NE(l.warning.find("sub/loop/ (already listed"), std::string::npos) << l.warning;
}

TEST_F(AnnQueryTest, CatalogLocationMayBeOneImageFile) {
  ImageFolder folder;
  const Listing l = list_catalog(bus_, folder.dir.file("sub/c.png"), false);
  EXPECT_EQ(l.ids, (std::vector<std::string>{"c"}));
  EXPECT_EQ(l.duration, 1);
  EXPECT_EQ(l.skipped, 0u);
  EXPECT_EQ(l.warning, "");
}

// moe-catalog-src ! moe-encode ! ann-query: the build's progress counts against the catalog's
// size, which the source announces through moe-encode.
TEST_F(AnnQueryTest, CatalogBuildProgressKnowsItsTotal) {
  ImageFolder folder;
  folder.dir.write("broken.png", "not a png");
  const std::string index = dir_.file("folder.faiss");
  GError* err = nullptr;
  GstElement* pipeline =
      gst_parse_launch(("moe-catalog-src recursive=true location=" + folder.dir.path() +
                        " ! moe-encode max-batch=2 model=" + moe::test::fixture_path("clip_tiny_bpe") +
                        " ! ann-query mode=build progress-items=2 index=" + index + " ! fakesink")
                           .c_str(),
                       &err);
  ASSERT_EQ(err, nullptr) << err->message;
  ASSERT_EQ(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_ASYNC);
  GstBus* bus = gst_element_get_bus(pipeline);
  std::vector<Progress> seen;
  for (;;) {
    GstMessage* msg = gst_bus_timed_pop_filtered(
        bus, 120 * GST_SECOND, static_cast<GstMessageType>(GST_MESSAGE_PROGRESS | GST_MESSAGE_EOS | GST_MESSAGE_ERROR));
    ASSERT_NE(msg, nullptr) << "no EOS";
    const GstMessageType type = GST_MESSAGE_TYPE(msg);
    if (type == GST_MESSAGE_PROGRESS) seen.push_back(parse_progress(msg));
    std::string error;
    if (type == GST_MESSAGE_ERROR) {
      GError* e = nullptr;
      gst_message_parse_error(msg, &e, nullptr);
      error = e->message;
      g_error_free(e);
    }
    gst_message_unref(msg);
    ASSERT_EQ(error, "");
    if (type == GST_MESSAGE_EOS) break;
  }
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(bus);
  gst_object_unref(pipeline);

  ASSERT_GE(seen.size(), 2u);
  for (const Progress& p : seen) EXPECT_EQ(p.total, 5) << p.text;
  const Progress& last = seen.back();
  EXPECT_EQ(last.type, GST_PROGRESS_TYPE_COMPLETE);
  EXPECT_EQ(last.added, 4u);
  EXPECT_EQ(last.failed, 1u);
  EXPECT_NE(last.text.find(folder.dir.file("broken.png") + ": "), std::string::npos) << last.text;
  EXPECT_NE(last.text.find("[image_undecodable]"), std::string::npos) << last.text;
  EXPECT_EQ(moe::AnnIndex::load(index).size(), 4);
}

/* ----- frame times ----- */

// A document's text, parsed.
std::unique_ptr<Json> parse_document(const std::string& text) {
  GstBuffer* buf = gst_buffer_new_memdup(text.data(), text.size());
  auto doc = std::make_unique<Json>(buf);
  gst_buffer_unref(buf);
  return doc;
}

// Video frames that leave moe-encode in one batch keep their own PTS and stream time, and their
// result documents carry them.
TEST_F(AnnQueryTest, FramesOfOneBatchKeepTheirOwnTimes) {
  GstElement* encode = gst_element_factory_make("moe-encode", nullptr);
  g_object_set(encode, "model", moe::test::fixture_path("clip_tiny_bpe").c_str(), "max-batch", 4u, nullptr);
  GstHarness* h = gst_harness_new_with_element(encode, "sink", "src");
  gst_object_unref(encode);
  harnesses_.push_back(h);
  GstVideoInfo info;
  gst_video_info_set_format(&info, GST_VIDEO_FORMAT_RGB, 16, 12);
  GST_VIDEO_INFO_FPS_N(&info) = 25;
  GST_VIDEO_INFO_FPS_D(&info) = 1;
  gst_harness_set_src_caps(h, gst_video_info_to_caps(&info));
  GstSegment segment;  // the stream's time starts at 5 s
  gst_segment_init(&segment, GST_FORMAT_TIME);
  segment.time = 5 * GST_SECOND;
  ASSERT_TRUE(gst_harness_push_event(h, gst_event_new_segment(&segment)));

  // The first frame's batch is held on the way out, so the next two queue and leave together.
  struct Gate {
    std::atomic<bool> held{false};
  } gate;
  GstPad* src = gst_element_get_static_pad(h->element, "src");
  const gulong probe = gst_pad_add_probe(
      src, static_cast<GstPadProbeType>(GST_PAD_PROBE_TYPE_BLOCK | GST_PAD_PROBE_TYPE_BUFFER),
      [](GstPad*, GstPadProbeInfo*, gpointer data) {
        static_cast<Gate*>(data)->held = true;
        return GST_PAD_PROBE_OK;
      },
      &gate, nullptr);
  const GstClockTime frame = 40 * GST_MSECOND;
  auto push_frame = [&](int n) {
    GstBuffer* buf = gst_buffer_new_allocate(nullptr, info.size, nullptr);
    gst_buffer_memset(buf, 0, static_cast<guint8>(40 * n), info.size);
    GST_BUFFER_PTS(buf) = n * frame;
    return gst_harness_push(h, buf);
  };
  ASSERT_EQ(push_frame(0), GST_FLOW_OK);
  for (int i = 0; i < 6000 && !gate.held; ++i) g_usleep(10000);
  ASSERT_TRUE(gate.held) << "the first batch never left";
  ASSERT_EQ(push_frame(1), GST_FLOW_OK);
  ASSERT_EQ(push_frame(2), GST_FLOW_OK);
  gst_pad_remove_probe(src, probe);
  gst_object_unref(src);

  GstBuffer* first = gst_harness_pull(h);
  GstBuffer* rest = gst_harness_pull(h);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(rest, nullptr);
  const gstmoe::BatchRecords batch = *gst_buffer_get_moe_batch_meta(rest)->records;
  ASSERT_EQ(batch.rows.size(), 2u) << "the two queued frames left as one batch ("
                                   << (batch.failed.empty() ? std::string() : batch.failed[0].reason) << ")";
  EXPECT_EQ(GST_BUFFER_PTS(rest), frame);  // the batch buffer: its first frame's
  for (size_t r = 0; r < 2; ++r) {
    const GstClockTime pts = (r + 1) * frame;
    EXPECT_EQ(batch.rows[r].pts, pts);
    EXPECT_EQ(batch.rows[r].stream_time, 5 * GST_SECOND + pts);
    const auto doc = parse_document(gstmoe::result_document(batch.rows[r], 1, {}, {}, g_get_monotonic_time()));
    EXPECT_EQ(Json::integer(doc->obj(), "pts_ns"), static_cast<int64_t>(pts));
    EXPECT_EQ(Json::integer(doc->obj(), "stream_time_ns"), static_cast<int64_t>(5 * GST_SECOND + pts));
  }
  gst_buffer_unref(first);
  gst_buffer_unref(rest);

  // Requests that are not frames carry no times.
  const auto text_doc = parse_document(gstmoe::result_document(text_request("q"), 1, {}, {}, g_get_monotonic_time()));
  EXPECT_FALSE(json_object_has_member(text_doc->obj(), "pts_ns"));
  EXPECT_FALSE(json_object_has_member(text_doc->obj(), "stream_time_ns"));
}

// ann-query stamps each answer with its own frame's PTS, not the batch buffer's (its first frame's).
TEST_F(AnnQueryTest, AnswersToFramesCarryTheirOwnPts) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path, 1);
  gstmoe::BatchRecords batch;
  for (int i = 1; i <= 2; ++i) {
    gstmoe::RequestRecord frame = catalog_record(i);
    frame.pts = i * 40 * GST_MSECOND;
    frame.stream_time = frame.pts;
    batch.rows.push_back(frame);
  }
  GstBuffer* in = tensor_buffer(catalog_, 1, batch);
  GST_BUFFER_PTS(in) = 40 * GST_MSECOND;
  ASSERT_EQ(gst_harness_push(h, in), GST_FLOW_OK);
  std::vector<GstBuffer*> docs = pull_all(h);
  ASSERT_EQ(docs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const GstClockTime pts = (i + 1) * 40 * GST_MSECOND;
    EXPECT_EQ(GST_BUFFER_PTS(docs[i]), pts);
    Json doc(docs[i]);
    EXPECT_EQ(Json::integer(doc.obj(), "pts_ns"), static_cast<int64_t>(pts));
  }
  unref_all(docs);
}

/* ---- plain tensors: no request meta (NNStreamer, ONNX, applications) -------------------- */

// Rows [first, first + rows) of `vectors` in a buffer without a request meta, stamped `pts`.
GstBuffer* plain_buffer(const std::vector<float>& vectors, int first, int rows, GstClockTime pts) {
  GstBuffer* buf = gst_buffer_new_memdup(vectors.data() + static_cast<size_t>(first) * kWidth,
                                         static_cast<size_t>(rows) * kWidth * sizeof(float));
  GST_BUFFER_PTS(buf) = pts;
  return buf;
}

// The (item, score) hits of a result document, best first.
std::vector<std::pair<int64_t, double>> hits_of(const Json& doc) {
  std::vector<std::pair<int64_t, double>> hits;
  JsonArray* results = Json::array(doc.obj(), "results");
  for (guint j = 0; results && j < json_array_get_length(results); ++j) {
    JsonObject* hit = json_array_get_object_element(results, j);
    hits.emplace_back(Json::integer(hit, "item"), Json::number(hit, "score"));
  }
  return hits;
}

TEST_F(AnnQueryTest, PlainVectorsAreSearchedLikeRequestsWithAMeta) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path, 5);
  // Vectors off the catalog, so that the hits are not just the stored items themselves.
  const std::vector<float> queries = random_unit_vectors(4, kWidth, 7);

  gstmoe::BatchRecords batch;
  for (int i = 0; i < 4; ++i) batch.rows.push_back(text_request("q" + std::to_string(i)));
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(queries, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> with_meta = pull_all(h);
  ASSERT_EQ(with_meta.size(), 4u);

  // The same four vectors with no meta: one buffer of one row, one of three.
  ASSERT_EQ(gst_harness_push(h, plain_buffer(queries, 0, 1, 3 * GST_SECOND)), GST_FLOW_OK);
  ASSERT_EQ(gst_harness_push(h, plain_buffer(queries, 1, 3, 4 * GST_SECOND)), GST_FLOW_OK);
  std::vector<GstBuffer*> plain = pull_all(h);
  ASSERT_EQ(plain.size(), 4u);

  for (int i = 0; i < 4; ++i) {
    const GstClockTime pts = (i == 0 ? 3 : 4) * GST_SECOND;
    EXPECT_EQ(GST_BUFFER_PTS(plain[i]), pts);
    Json expected(with_meta[i]);
    Json doc(plain[i]);
    JsonObject* o = doc.obj();
    EXPECT_EQ(Json::str(o, "type"), "result");
    EXPECT_EQ(Json::str(o, "id"), std::to_string(i));  // rows counted since the element was made
    EXPECT_EQ(Json::str(o, "modality"), "tensor");
    EXPECT_TRUE(Json::is_null(o, "query"));
    EXPECT_TRUE(Json::is_null(o, "uri"));
    EXPECT_EQ(Json::integer(o, "k"), 5);
    EXPECT_EQ(Json::integer(o, "pts_ns"), static_cast<int64_t>(pts));
    EXPECT_EQ(json_array_get_length(Json::array(o, "experts")), 0u);
    const auto hits = hits_of(doc), expected_hits = hits_of(expected);
    ASSERT_EQ(hits.size(), 5u) << doc.text();
    ASSERT_EQ(hits.size(), expected_hits.size());
    for (size_t j = 0; j < hits.size(); ++j) {
      EXPECT_EQ(hits[j].first, expected_hits[j].first) << "row " << i << " rank " << j + 1;
      EXPECT_DOUBLE_EQ(hits[j].second, expected_hits[j].second);
    }
    // The answer carries the request made for the row, for elements downstream.
    const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(plain[i]);
    ASSERT_NE(meta, nullptr);
    ASSERT_EQ(meta->records->rows.size(), 1u);
    EXPECT_EQ(meta->records->rows[0].id, std::to_string(i));
  }
  unref_all(with_meta);
  unref_all(plain);

  // A buffer that is not whole vectors is an error naming its size and the width.
  EXPECT_EQ(gst_harness_push(h, gst_buffer_new_allocate(nullptr, kWidth * sizeof(float) + 2, nullptr)), GST_FLOW_ERROR);
  const std::string error = bus_error();
  EXPECT_NE(error.find("66 bytes"), std::string::npos) << error;
  EXPECT_NE(error.find("16-wide"), std::string::npos) << error;
}

TEST_F(AnnQueryTest, NnstreamerTensorsGiveOneDocumentPerRow) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  const auto expected = index.search(catalog_.data(), 6, 1);

  // NNStreamer's caps as tensor_converter writes them: the width first, then 2 rows per buffer.
  GstHarness* h = harness(make_element("index", path.c_str(), "k", 1u, nullptr));
  gst_harness_set_src_caps_str(
      h, "other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)16:2,framerate=(fraction)0/1");
  for (int b = 0; b < 3; ++b)
    ASSERT_EQ(gst_harness_push(h, plain_buffer(catalog_, 2 * b, 2, b * 100 * GST_MSECOND)), GST_FLOW_OK);
  std::vector<GstBuffer*> docs = pull_all(h);
  ASSERT_EQ(docs.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(GST_BUFFER_PTS(docs[i]), (i / 2) * 100 * GST_MSECOND);
    Json doc(docs[i]);
    EXPECT_EQ(Json::str(doc.obj(), "id"), std::to_string(i));
    const auto hits = hits_of(doc);
    ASSERT_EQ(hits.size(), 1u) << doc.text();
    EXPECT_EQ(hits[0].first, expected[i][0].item);
    EXPECT_EQ(hits[0].first, i);  // a stored vector finds its own item
  }
  unref_all(docs);

  // The older other/tensor caps, 4-D as NNStreamer 1.x wrote them.
  GstHarness* old = harness(make_element("index", path.c_str(), "k", 1u, nullptr));
  gst_harness_set_src_caps_str(old, "other/tensor,type=float32,dimension=(string)16:1:1:1");
  ASSERT_EQ(gst_harness_push(old, plain_buffer(catalog_, 9, 1, 0)), GST_FLOW_OK);
  docs = pull_all(old);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(hits_of(Json(docs[0])).at(0).first, 9);
  unref_all(docs);
}

// A build takes plain vectors too: each row is an item named by its row number.
TEST_F(AnnQueryTest, BuildFromPlainVectorsNamesItemsByRow) {
  const std::string path = dir_.file("plain.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  gst_harness_set_src_caps_str(h, "other/tensor,type=float32,dimension=(string)16:25");
  ASSERT_EQ(gst_harness_push(h, plain_buffer(catalog_, 0, 25, 0)), GST_FLOW_OK);
  ASSERT_EQ(gst_harness_push(h, plain_buffer(catalog_, 25, 25, GST_SECOND)), GST_FLOW_OK);
  ASSERT_TRUE(gst_harness_push_event(h, gst_event_new_eos()));
  std::vector<GstBuffer*> docs = pull_all(h);
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(Json::integer(Json(docs[0]).obj(), "items"), kItems);
  unref_all(docs);
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  ASSERT_EQ(index.size(), kItems);
  EXPECT_FALSE(index.provenance().has_value());  // nothing says which model made them
  for (int i = 0; i < kItems; ++i) EXPECT_EQ(index.item(i).id, std::to_string(i));
  EXPECT_EQ(index.search(catalog_.data() + 30 * kWidth, 1, 1)[0][0].item, 30);
}

// The error a search element posts when it is given `caps` (its index is kWidth wide).
class AnnQueryCapsTest : public AnnQueryTest {
 protected:
  void SetUp() override {
    AnnQueryTest::SetUp();
    path_ = dir_.file("catalog.faiss");
    gst_buffer_unref(build_index(path_));
    while (GstMessage* m = gst_bus_pop(bus_)) gst_message_unref(m);
  }
  std::string refusal(const std::string& caps) {
    GstHarness* h = harness(make_element("index", path_.c_str(), nullptr));
    GstCaps* c = gst_caps_from_string(caps.c_str());
    EXPECT_NE(c, nullptr) << caps;
    if (!c) return "";
    // Upstream retries a refused caps event before each buffer: it stays refused, with one error.
    GstPad* sink = gst_element_get_static_pad(h->element, "sink");
    EXPECT_FALSE(gst_pad_send_event(sink, gst_event_new_caps(c))) << caps << " was accepted";
    EXPECT_FALSE(gst_pad_send_event(sink, gst_event_new_caps(c))) << caps << " was accepted when retried";
    gst_object_unref(sink);
    gst_caps_unref(c);
    const std::string error = bus_error();
    EXPECT_EQ(bus_error(), "") << "the refusal of " << caps << " was posted twice";
    return error;
  }
  std::string path_;
};

TEST_F(AnnQueryCapsTest, OtherTypesFormatsAndWidthsAreRefusedNamingTheField) {
  struct Case {
    std::string caps;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"other/tensors,format=static,num_tensors=1,types=uint8,dimensions=(string)16:1",
       {"'types'", "\"uint8\"", "float32"}},
      {"other/tensor,type=float64,dimension=16", {"'type'", "\"float64\""}},
      {"other/tensors,format=static,num_tensors=1,dimensions=(string)16:1", {"'types' is missing"}},
      {"other/tensors,format=flexible,num_tensors=1,types=float32", {"'format'", "\"flexible\"", "static"}},
      {"other/tensors,format=static,num_tensors=2,types=float32.float32,dimensions=(string)16:1.16:1",
       {"'num_tensors'"}},
      {"other/tensors,format=static,num_tensors=1,types=float32", {"'dimensions' is missing"}},
      // The index's width is 16: 8-wide vectors are refused naming both.
      {"other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)8:2",
       {"width 8", "dimension 16", path_}},
  };
  for (const Case& c : cases) {
    const std::string error = refusal(c.caps);
    for (const std::string& part : c.says) EXPECT_NE(error.find(part), std::string::npos) << c.caps << "\n" << error;
  }
}

TEST_F(AnnQueryCapsTest, HostileDimensionStringsAreRefused) {
  const std::string head = "other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)";
  std::string rank17 = "16";
  for (int i = 0; i < 16; ++i) rank17 += ":1";
  const std::string long_digits(5000, '9');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\"\"", "must list 1 to 16 dimensions"},
      {"x", "dimension 1 must be a whole number from 1 to 65536 (the vector width)"},
      {"16:x", "dimension 2 must be a whole number from 1 to 1048576"},
      {"16::2", "dimension 2"},
      {"\"-16:1\"", "dimension 1"},
      {"\" 16:1\"", "dimension 1"},
      {"0:1", "dimension 1"},
      {"65537:1", "from 1 to 65536"},
      {"18446744073709551617:1", "dimension 1"},  // 2^64 + 1
      {"16:1024:1024:2", "more than 1048576 rows"},
      {"16:4294967295", "dimension 2"},
      {"\"16:1,16:1\"", "more than one tensor"},
      {rank17, "1 to 16 dimensions"},
      {long_digits, "dimension 1"},
  };
  for (const auto& [dims, says] : cases) {
    const std::string error = refusal(head + dims);
    EXPECT_NE(error.find("'dimensions'"), std::string::npos) << dims << "\n" << error;
    EXPECT_NE(error.find(says), std::string::npos) << dims << "\n" << error;
    EXPECT_LT(error.size(), 2000u) << "the hostile string is echoed whole";
  }
  // Within the bounds: 16 dimensions, 1048576 rows.
  std::string rank16 = "16:1024:1024";
  for (int i = 0; i < 13; ++i) rank16 += ":1";
  GstHarness* h = harness(make_element("index", path_.c_str(), nullptr));
  gst_harness_set_src_caps_str(h, (head + rank16).c_str());
  EXPECT_EQ(bus_error(), "");
}

// moe-route takes NNStreamer's tensors too: it makes their request meta (routed rows of modality
// tensor) and sends them on as application/x-moe-tensor for moe-expert and ann-query.
TEST_F(AnnQueryTest, MoeRouteTurnsNnstreamerTensorsIntoRoutedRequests) {
  GstElement* route = gst_element_factory_make("moe-route", nullptr);
  g_object_set(route, "model", moe::test::fixture_path("adapter_tiny").c_str(), nullptr);  // hidden 16
  gst_element_set_bus(route, bus_);
  GstHarness* h = harness(route);
  gst_harness_set_src_caps_str(h, "other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)16:2");
  ASSERT_EQ(gst_harness_push(h, plain_buffer(catalog_, 0, 2, 7 * GST_SECOND)), GST_FLOW_OK);
  GstBuffer* out = gst_harness_pull(h);
  ASSERT_NE(out, nullptr);
  GstCaps* caps = gst_pad_get_current_caps(h->sinkpad);
  ASSERT_NE(caps, nullptr);
  int width = 0;
  EXPECT_TRUE(gstmoe::parse_tensor_caps(caps, &width)) << gst_caps_to_string(caps);
  EXPECT_EQ(width, kWidth);
  gst_caps_unref(caps);
  const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(out);
  ASSERT_NE(meta, nullptr);
  ASSERT_EQ(meta->records->rows.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const gstmoe::RequestRecord& r = meta->records->rows[i];
    EXPECT_EQ(r.id, std::to_string(i));
    EXPECT_EQ(r.modality, gstmoe::Modality::Tensor);
    EXPECT_EQ(r.pts, 7 * GST_SECOND);
    EXPECT_EQ(r.experts.size(), 2u);  // adapter_tiny: top-2
  }

  // ann-query answers the routed rows with their experts.
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* search = search_harness(path, 1);
  ASSERT_EQ(gst_harness_push(search, out), GST_FLOW_OK);
  std::vector<GstBuffer*> docs = pull_all(search);
  ASSERT_EQ(docs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    Json doc(docs[i]);
    EXPECT_EQ(Json::str(doc.obj(), "modality"), "tensor");
    EXPECT_EQ(json_array_get_length(Json::array(doc.obj(), "experts")), 2u);
    EXPECT_EQ(hits_of(doc).at(0).first, static_cast<int64_t>(i));
  }
  unref_all(docs);

  // Other element types are refused naming the field.
  GstElement* refusing = gst_element_factory_make("moe-route", nullptr);
  g_object_set(refusing, "model", moe::test::fixture_path("adapter_tiny").c_str(), nullptr);
  gst_element_set_bus(refusing, bus_);
  GstHarness* uint8 = harness(refusing);
  GstCaps* bytes =
      gst_caps_from_string("other/tensors,format=static,num_tensors=1,types=uint8,dimensions=(string)16:2");
  gst_harness_push_event(uint8, gst_event_new_caps(bytes));
  gst_caps_unref(bytes);
  EXPECT_NE(gst_harness_push(uint8, plain_buffer(catalog_, 0, 2, 0)), GST_FLOW_OK);
  const std::string error = bus_error();
  EXPECT_NE(error.find("caps field 'types' is \"uint8\""), std::string::npos) << error;
}

/* ----- live updates, hot swap, hybrid rows ----- */

// An upsert of catalog item `item_id` (its vector is the row pushed with it).
gstmoe::RequestRecord upsert_request(const std::string& id, const std::string& item_id) {
  gstmoe::RequestRecord r = text_request(id);
  r.op = gstmoe::RequestOp::Upsert;
  r.item = {item_id, "file:///new/" + item_id + ".png", "new " + item_id, R"({"price":1.5})"};
  return r;
}

// A deletion of catalog items (it has no row: it travels in BatchRecords::controls).
gstmoe::RequestRecord delete_request(const std::string& id, std::vector<std::string> item_ids) {
  gstmoe::RequestRecord r;
  r.id = id;
  r.op = gstmoe::RequestOp::Delete;
  r.item_ids = std::move(item_ids);
  r.arrival_wall_us = g_get_real_time();
  r.arrival_mono_us = g_get_monotonic_time();
  return r;
}

// The catalog ids of a result document's hits, best first.
std::vector<std::string> hit_ids(const Json& doc) {
  std::vector<std::string> ids;
  JsonArray* results = Json::array(doc.obj(), "results");
  for (guint j = 0; results && j < json_array_get_length(results); ++j)
    ids.push_back(Json::str(json_array_get_object_element(results, j), "id"));
  return ids;
}

// The whole text of a file ("" when it does not exist).
std::string file_text(const std::string& path) {
  gchar* text = nullptr;
  gsize size = 0;
  if (!g_file_get_contents(path.c_str(), &text, &size, nullptr)) return "";
  std::string out(text, size);
  g_free(text);
  return out;
}

class AnnQueryUpdateTest : public AnnQueryTest {
 protected:
  // A search of an index of the catalog (made by kClipAndAdapter) with allow-updates set as given.
  GstHarness* updating_harness(bool allow, guint snapshot_interval = 0) {
    path_ = dir_.file("catalog.faiss");
    gst_buffer_unref(build_index(path_, "flat", kClipAndAdapter));
    GstHarness* h = harness(make_element("index", path_.c_str(), "k", 5, "allow-updates", allow, "snapshot-interval",
                                         snapshot_interval, nullptr));
    set_tensor_caps(h, kWidth);
    return h;
  }
  // Pushes `batch` (rows' vectors from `vectors`, models kClipAndAdapter) and returns its one document.
  std::unique_ptr<Json> push_one(GstHarness* h, gstmoe::BatchRecords batch, const std::vector<float>& vectors = {}) {
    if (batch.encoder.empty()) kClipAndAdapter.stamp(batch);
    EXPECT_EQ(gst_harness_push(h, tensor_buffer(vectors, 0, batch)), GST_FLOW_OK);
    std::vector<GstBuffer*> out = pull_all(h);
    EXPECT_EQ(out.size(), 1u);
    if (out.empty()) return nullptr;
    auto doc = std::make_unique<Json>(out[0]);
    unref_all(out);
    return doc;
  }
  std::unique_ptr<Json> search_for(GstHarness* h, const std::string& id, const float* vector) {
    gstmoe::BatchRecords batch;
    batch.rows = {text_request(id)};
    return push_one(h, batch, std::vector<float>(vector, vector + kWidth));
  }
  std::string path_;
  const std::vector<float> fresh_ = random_unit_vectors(3, kWidth, 99);
};

TEST_F(AnnQueryUpdateTest, UpdatesAreRefusedUnlessAllowed) {
  GstHarness* h = updating_harness(false);
  gstmoe::BatchRecords batch;
  batch.rows = {upsert_request("u1", "sku-new"), text_request("q0")};
  batch.controls = {delete_request("d1", {"item-3"})};
  kClipAndAdapter.stamp(batch);
  std::vector<float> vectors(fresh_.begin(), fresh_.begin() + kWidth);
  vectors.insert(vectors.end(), catalog_.begin(), catalog_.begin() + kWidth);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(vectors, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 3u);
  std::map<std::string, std::string> types, codes, reasons;
  for (GstBuffer* b : out) {
    Json doc(b);
    const std::string id = Json::str(doc.obj(), "id");
    types[id] = Json::str(doc.obj(), "type");
    if (types[id] != "error") continue;
    codes[id] = Json::str(Json::object(doc.obj(), "error"), "code");
    reasons[id] = Json::str(Json::object(doc.obj(), "error"), "reason");
  }
  unref_all(out);
  EXPECT_EQ(types["q0"], "result");  // searches go on
  for (const char* id : {"u1", "d1"}) {
    EXPECT_EQ(types[id], "error") << id;
    EXPECT_EQ(codes[id], "updates_disabled") << id;
    EXPECT_NE(reasons[id].find("allow-updates=true"), std::string::npos) << reasons[id];
  }
  // Nothing changed: item 3 is still found, the new item is not.
  EXPECT_EQ(hit_ids(*search_for(h, "q3", &catalog_[3 * kWidth])).at(0), "item-3");
  EXPECT_NE(hit_ids(*search_for(h, "q-new", fresh_.data())).at(0), "sku-new");
  GstStructure* st = nullptr;
  g_object_get(h->element, "stats", &st, nullptr);
  guint64 updates = 9, refused = 0;
  EXPECT_TRUE(gst_structure_get_uint64(st, "updates", &updates));
  EXPECT_TRUE(gst_structure_get_uint64(st, "updates-refused", &refused));
  gst_structure_free(st);
  EXPECT_EQ(updates, 0u);
  EXPECT_EQ(refused, 2u);
}

TEST_F(AnnQueryUpdateTest, UpsertsAndDeletesChangeWhatSearchesFindAndSurviveInTheJournal) {
  GstHarness* h = updating_harness(true);

  // A new item: appended as row 50, found by its vector, with its uri, caption and fields.
  gstmoe::BatchRecords add;
  add.rows = {upsert_request("u1", "sku-new")};
  std::unique_ptr<Json> doc = push_one(h, add, std::vector<float>(fresh_.begin(), fresh_.begin() + kWidth));
  ASSERT_NE(doc, nullptr);
  EXPECT_EQ(Json::str(doc->obj(), "type"), "update") << doc->text();
  EXPECT_EQ(Json::integer(doc->obj(), "schema"), gstmoe::kResultSchema);
  EXPECT_EQ(Json::str(doc->obj(), "id"), "u1");
  EXPECT_EQ(Json::str(doc->obj(), "op"), "upsert");
  EXPECT_EQ(Json::str(doc->obj(), "item"), "sku-new");
  EXPECT_EQ(Json::integer(doc->obj(), "row"), kItems);
  EXPECT_FALSE(json_object_get_boolean_member(doc->obj(), "replaced"));
  EXPECT_EQ(Json::integer(doc->obj(), "items"), kItems + 1);
  EXPECT_EQ(Json::str(doc->obj(), "index"), "catalog.faiss");
  EXPECT_GE(Json::number(Json::object(doc->obj(), "timings_ms"), "update"), 0.0);
  doc = search_for(h, "q-new", fresh_.data());
  JsonObject* top = json_array_get_object_element(Json::array(doc->obj(), "results"), 0);
  EXPECT_EQ(Json::str(top, "id"), "sku-new");
  EXPECT_EQ(Json::integer(top, "item"), kItems);
  EXPECT_EQ(Json::str(top, "uri"), "file:///new/sku-new.png");
  EXPECT_EQ(Json::str(top, "caption"), "new sku-new");
  EXPECT_DOUBLE_EQ(Json::number(Json::object(top, "fields"), "price"), 1.5);

  // An existing id: its row is replaced by a new one; the old vector no longer finds it.
  gstmoe::BatchRecords replace;
  replace.rows = {upsert_request("u2", "item-5")};
  doc = push_one(h, replace, std::vector<float>(fresh_.begin() + kWidth, fresh_.begin() + 2 * kWidth));
  EXPECT_TRUE(json_object_get_boolean_member(doc->obj(), "replaced")) << doc->text();
  EXPECT_EQ(Json::integer(doc->obj(), "row"), kItems + 1);
  EXPECT_EQ(Json::integer(doc->obj(), "items"), kItems + 1);
  EXPECT_EQ(hit_ids(*search_for(h, "q-5-new", &fresh_[kWidth])).at(0), "item-5");
  doc = search_for(h, "q-5-old", &catalog_[5 * kWidth]);
  for (const auto& [item, score] : hits_of(*doc)) EXPECT_NE(item, 5) << "deleted row returned";

  // A deletion: each id once; unknown ids are listed as missing.
  gstmoe::BatchRecords del;
  del.controls = {delete_request("d1", {"item-3", "nope", "item-3"})};
  doc = push_one(h, del);
  EXPECT_EQ(Json::str(doc->obj(), "type"), "update") << doc->text();
  EXPECT_EQ(Json::str(doc->obj(), "op"), "delete");
  EXPECT_EQ(Json::integer(doc->obj(), "deleted"), 1);
  JsonArray* missing = Json::array(doc->obj(), "missing");
  ASSERT_EQ(json_array_get_length(missing), 1u);
  EXPECT_STREQ(json_array_get_string_element(missing, 0), "nope");
  EXPECT_EQ(Json::integer(doc->obj(), "items"), kItems);
  for (const std::string& id : hit_ids(*search_for(h, "q3", &catalog_[3 * kWidth]))) EXPECT_NE(id, "item-3");

  // Each update was journaled before its answer: a load now (as after a crash) has all three.
  {
    const moe::AnnIndex reloaded = moe::AnnIndex::load(path_);
    EXPECT_EQ(reloaded.find("sku-new"), kItems);
    EXPECT_EQ(reloaded.find("item-5"), kItems + 1);
    EXPECT_EQ(reloaded.find("item-3"), -1);
    EXPECT_EQ(reloaded.live_size(), kItems);
  }
  EXPECT_EQ(file_text(path_ + ".items.jsonl").find("sku-new"), std::string::npos) << "not saved yet";
  const auto stats = read_stats(h->element);
  EXPECT_EQ(stats.at("results"), 4u);
  GstStructure* st = nullptr;
  g_object_get(h->element, "stats", &st, nullptr);
  guint64 updates = 0;
  EXPECT_TRUE(gst_structure_get_uint64(st, "updates", &updates));
  gst_structure_free(st);
  EXPECT_EQ(updates, 3u);

  // A clean stop writes the index with its updates.
  ASSERT_EQ(gst_element_set_state(h->element, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
  EXPECT_NE(file_text(path_ + ".items.jsonl").find("sku-new"), std::string::npos);
  const moe::AnnIndex saved = moe::AnnIndex::load(path_);
  EXPECT_EQ(saved.find("sku-new"), kItems);
  EXPECT_EQ(saved.find("item-3"), -1);
  EXPECT_EQ(bus_error(), "");
}

TEST_F(AnnQueryUpdateTest, SnapshotIntervalWritesTheIndexAfterThatManyUpdates) {
  GstHarness* h = updating_harness(true, 2);
  gstmoe::BatchRecords first;
  first.rows = {upsert_request("u1", "sku-a")};
  ASSERT_NE(push_one(h, first, std::vector<float>(fresh_.begin(), fresh_.begin() + kWidth)), nullptr);
  EXPECT_EQ(file_text(path_ + ".items.jsonl").find("sku-a"), std::string::npos);
  EXPECT_NE(file_text(path_ + ".journal"), "") << "the update is in the journal";
  gstmoe::BatchRecords second;
  second.rows = {upsert_request("u2", "sku-b")};
  ASSERT_NE(push_one(h, second, std::vector<float>(fresh_.begin() + kWidth, fresh_.begin() + 2 * kWidth)), nullptr);
  const std::string table = file_text(path_ + ".items.jsonl");
  EXPECT_NE(table.find("sku-a"), std::string::npos);
  EXPECT_NE(table.find("sku-b"), std::string::npos);
  EXPECT_EQ(moe::AnnIndex::load(path_).find("sku-b"), kItems + 1);
}

TEST_F(AnnQueryUpdateTest, UpsertsFromOtherModelsAreRefusedLikeQueries) {
  GstHarness* h = updating_harness(true);
  gstmoe::BatchRecords batch;
  batch.rows = {upsert_request("u1", "sku-new")};
  Models{"clip", kClipAndAdapter.encoder_fingerprint, "adapter", "000000000000ffff"}.stamp(batch);
  std::unique_ptr<Json> doc = push_one(h, batch, std::vector<float>(fresh_.begin(), fresh_.begin() + kWidth));
  ASSERT_NE(doc, nullptr);
  EXPECT_EQ(Json::str(doc->obj(), "type"), "error");
  EXPECT_EQ(Json::str(Json::object(doc->obj(), "error"), "code"), "model_mismatch");
  EXPECT_EQ(read_stats(h->element).at("refused"), 1u);
  EXPECT_EQ(moe::AnnIndex::load(path_).find("sku-new"), -1);
}

TEST_F(AnnQueryTest, BuildAnswersUpdatesWithAnError) {
  const std::string path = dir_.file("built.faiss");
  GstHarness* h = harness(make_element("mode", 1, "index", path.c_str(), nullptr));
  set_tensor_caps(h, kWidth);
  gstmoe::BatchRecords batch;
  batch.rows = {catalog_record(0), upsert_request("u1", "sku-new"), catalog_record(2)};
  batch.controls = {delete_request("d1", {"item-0"})};
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, batch)), GST_FLOW_OK);
  ASSERT_TRUE(gst_harness_push_event(h, gst_event_new_eos()));
  std::vector<GstBuffer*> docs = pull_all(h);
  ASSERT_EQ(docs.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    Json err(docs[i]);
    EXPECT_EQ(Json::str(Json::object(err.obj(), "error"), "code"), "updates_disabled") << err.text();
  }
  Json summary(docs[2]);
  EXPECT_EQ(Json::integer(summary.obj(), "items"), 2);
  unref_all(docs);
  // The catalog rows around the upsert kept their own vectors.
  const moe::AnnIndex index = moe::AnnIndex::load(path);
  EXPECT_EQ(index.search(&catalog_[2 * kWidth], 1, 1).at(0).at(0).item, 1);
  EXPECT_EQ(index.item(1).id, "item-2");
}

/* hybrid rows */

TEST_F(AnnQueryTest, UnfusedHybridRowsAreSearchedAsTheAverageOfTheirEmbeddings) {
  const std::string path = dir_.file("catalog.faiss");
  gst_buffer_unref(build_index(path));
  GstHarness* h = search_harness(path, 5);

  // The image's row and the text's embedding at other norms: each is normalised before the average.
  gstmoe::RequestRecord hybrid = text_request("h1");
  hybrid.modality = gstmoe::Modality::Hybrid;
  hybrid.text = "but red";
  hybrid.uri = "base64:10 bytes";
  hybrid.text_embedding.assign(catalog_.begin() + kWidth, catalog_.begin() + 2 * kWidth);
  for (float& x : hybrid.text_embedding) x *= 3;
  gstmoe::RequestRecord narrow = hybrid;
  narrow.id = "h2";
  narrow.text_embedding.resize(kWidth - 1);
  gstmoe::RequestRecord gated = text_request("h3");
  gated.modality = gstmoe::Modality::Hybrid;
  gated.text = "on a table";
  gated.fusion = gstmoe::Fusion{0.7f, 0.3f, "gate"};
  gstmoe::BatchRecords batch;
  batch.rows = {hybrid, narrow, gated};
  std::vector<float> vectors(catalog_.begin(), catalog_.begin() + kWidth);
  for (float& x : vectors) x *= 0.5f;
  vectors.insert(vectors.end(), vectors.begin(), vectors.end());
  vectors.insert(vectors.end(), catalog_.begin() + 2 * kWidth, catalog_.begin() + 3 * kWidth);
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(vectors, 0, batch)), GST_FLOW_OK);
  std::vector<GstBuffer*> out = pull_all(h);
  ASSERT_EQ(out.size(), 3u);

  std::vector<float> average(kWidth);
  for (int i = 0; i < kWidth; ++i) average[i] = (catalog_[i] + catalog_[kWidth + i]) / 2;
  const auto expected = moe::AnnIndex::load(path).search(average.data(), 1, 5).at(0);
  std::map<std::string, int> seen;
  for (GstBuffer* b : out) {
    Json doc(b);
    const std::string id = Json::str(doc.obj(), "id");
    seen[id] += 1;
    EXPECT_EQ(Json::str(doc.obj(), "modality"), "hybrid");
    if (id == "h2") {  // a text embedding of another width fails its request alone
      EXPECT_EQ(Json::str(doc.obj(), "type"), "error");
      EXPECT_NE(Json::str(Json::object(doc.obj(), "error"), "reason").find("text embedding has 15 values"),
                std::string::npos)
          << doc.text();
      continue;
    }
    JsonObject* fusion = Json::object(doc.obj(), "fusion");
    ASSERT_NE(fusion, nullptr) << doc.text();
    const auto hits = hits_of(doc);
    ASSERT_EQ(hits.size(), 5u);
    if (id == "h1") {
      EXPECT_EQ(Json::str(doc.obj(), "query"), "but red");
      EXPECT_EQ(Json::str(doc.obj(), "uri"), "base64:10 bytes");
      EXPECT_DOUBLE_EQ(Json::number(fusion, "image"), 0.5);
      EXPECT_DOUBLE_EQ(Json::number(fusion, "text"), 0.5);
      EXPECT_EQ(Json::str(fusion, "method"), "average");
      for (size_t j = 0; j < hits.size(); ++j) {
        EXPECT_EQ(hits[j].first, expected[j].item) << "rank " << j + 1;
        EXPECT_NEAR(hits[j].second, expected[j].score, 1e-5);
      }
      const gstmoe::RequestRecord& row = gst_buffer_get_moe_batch_meta(b)->records->rows.at(0);
      EXPECT_TRUE(row.text_embedding.empty());
      ASSERT_TRUE(row.fusion.has_value());
      EXPECT_EQ(row.fusion->method, "average");
    } else {  // fused upstream: searched as it came, its fusion reported
      EXPECT_DOUBLE_EQ(Json::number(fusion, "image"), 0.7);
      EXPECT_DOUBLE_EQ(Json::number(fusion, "text"), 0.3);
      EXPECT_EQ(Json::str(fusion, "method"), "gate");
      EXPECT_EQ(hits[0].first, 2);
    }
  }
  EXPECT_EQ(seen, (std::map<std::string, int>{{"h1", 1}, {"h2", 1}, {"h3", 1}}));
  unref_all(out);

  // Other modalities have no fusion member.
  gstmoe::BatchRecords text;
  text.rows = {text_request("t1")};
  ASSERT_EQ(gst_harness_push(h, tensor_buffer(catalog_, 0, text)), GST_FLOW_OK);
  GstBuffer* plain = gst_harness_pull(h);
  EXPECT_FALSE(json_object_has_member(Json(plain).obj(), "fusion"));
  gst_buffer_unref(plain);
}

/* hot swap */

class AnnQuerySwapTest : public AnnQueryTest {
 protected:
  // Writes an index of the catalog's vectors whose items are "<prefix>-i", made by `models`
  // (none: no provenance), with the engine.
  std::string write_index(const std::string& name, const std::string& prefix, const Models& models = {},
                          int width = kWidth) {
    const std::string path = dir_.file(name);
    moe::AnnIndex index = moe::AnnIndex::create(width, {});
    const std::vector<float> vectors = width == kWidth ? catalog_ : random_unit_vectors(kItems, width, 5);
    std::vector<moe::AnnItem> items;
    for (int i = 0; i < kItems; ++i) items.push_back({prefix + "-" + std::to_string(i), "", "", ""});
    index.add(vectors.data(), kItems, items);
    if (!models.encoder_fingerprint.empty())
      index.set_provenance({models.encoder, models.encoder_fingerprint, models.adapter, models.adapter_fingerprint});
    index.save(path);
    return path;
  }
  // The next "ann-query-index" element message (event, index), waiting up to 10 s.
  std::pair<std::string, std::string> next_index_message() {
    GstMessage* msg = gst_bus_timed_pop_filtered(bus_, 10 * GST_SECOND, GST_MESSAGE_ELEMENT);
    EXPECT_NE(msg, nullptr) << "no index message";
    if (!msg) return {};
    const GstStructure* st = gst_message_get_structure(msg);
    EXPECT_TRUE(gst_structure_has_name(st, "ann-query-index"));
    std::pair<std::string, std::string> out{gst_structure_get_string(st, "event"),
                                            gst_structure_get_string(st, "index")};
    gst_message_unref(msg);
    return out;
  }
  // The stats' index and previous-index ("" for NULL), and swaps.
  std::tuple<std::string, std::string, guint64> swap_stats(GstElement* element) {
    GstStructure* st = nullptr;
    g_object_get(element, "stats", &st, nullptr);
    const gchar* index = gst_structure_get_string(st, "index");
    const gchar* previous = gst_structure_get_string(st, "previous-index");
    guint64 swaps = 0;
    EXPECT_TRUE(gst_structure_get_uint64(st, "swaps", &swaps));
    std::tuple<std::string, std::string, guint64> out{index ? index : "", previous ? previous : "", swaps};
    gst_structure_free(st);
    return out;
  }
  // Pushes one row (catalog vector `i`, id `id`) made by `models`; returns its document.
  std::unique_ptr<Json> ask(GstHarness* h, const std::string& id, int i, const Models& models) {
    gstmoe::BatchRecords batch;
    batch.rows = {text_request(id)};
    models.stamp(batch);
    EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, i, batch)), GST_FLOW_OK);
    GstBuffer* out = gst_harness_pull(h);
    auto doc = std::make_unique<Json>(out);
    gst_buffer_unref(out);
    return doc;
  }
};

// Requests stream in while the index is swapped for one of other items: every request is answered
// exactly once, those before the switch from the old index and those after from the new one.
TEST_F(AnnQuerySwapTest, SwapUnderLoadAnswersEveryRequestOnceOldThenNew) {
  const std::string old_path = write_index("old.faiss", "old");
  const std::string new_path = write_index("new.faiss", "new");
  GstHarness* h = harness(make_element("index", old_path.c_str(), "k", 3, nullptr));
  set_tensor_caps(h, kWidth);

  std::atomic<int> pushed{0};
  std::atomic<bool> stop{false};
  std::thread pusher([&] {
    for (int n = 0; !stop; n += 2) {  // batches of two rows
      gstmoe::BatchRecords batch;
      batch.rows = {text_request("r" + std::to_string(n)), text_request("r" + std::to_string(n + 1))};
      EXPECT_EQ(gst_harness_push(h, tensor_buffer(catalog_, n % (kItems - 1), batch)), GST_FLOW_OK);
      pushed = n + 2;
      g_usleep(200);
    }
  });
  while (pushed < 40) g_usleep(100);
  g_object_set(h->element, "index", new_path.c_str(), nullptr);
  EXPECT_EQ(next_index_message(), std::make_pair(std::string("loaded"), new_path));
  const int at_load = pushed;
  while (pushed < at_load + 40) g_usleep(100);
  stop = true;
  pusher.join();
  EXPECT_EQ(next_index_message(), std::make_pair(std::string("retired"), old_path));

  std::vector<GstBuffer*> out = pull_all(h);
  const int total = pushed;
  ASSERT_EQ(out.size(), static_cast<size_t>(total));
  std::map<std::string, int> answered;
  int from_old = 0, from_new = 0;
  for (GstBuffer* b : out) {
    Json doc(b);
    ASSERT_EQ(Json::str(doc.obj(), "type"), "result") << doc.text();
    answered[Json::str(doc.obj(), "id")] += 1;
    const std::string top = hit_ids(doc).at(0);
    const bool is_new = top.rfind("new-", 0) == 0;
    EXPECT_TRUE(is_new || top.rfind("old-", 0) == 0) << top;
    if (is_new) {
      ++from_new;
    } else {
      EXPECT_EQ(from_new, 0) << "an answer from the old index after one from the new";
      ++from_old;
    }
    EXPECT_EQ(Json::str(Json::object(doc.obj(), "model"), "index"), is_new ? "new.faiss" : "old.faiss");
  }
  unref_all(out);
  EXPECT_EQ(answered.size(), static_cast<size_t>(total));
  for (const auto& [id, times] : answered) EXPECT_EQ(times, 1) << id;
  EXPECT_GE(from_old, 40);
  EXPECT_GE(from_new, 1);
  EXPECT_EQ(swap_stats(h->element), std::make_tuple(new_path, std::string(), guint64{1}));
}

// After a swap to an index of other models, each row is answered from the index of its own models
// until rows of the new one's come; then the old is dropped and its models' rows are refused.
TEST_F(AnnQuerySwapTest, RowsAreAnsweredFromTheIndexOfTheirModels) {
  const Models retrained{"clip", kClipAndAdapter.encoder_fingerprint, "adapter", "000000000000ffff"};
  const std::string old_path = write_index("old.faiss", "old", kClipAndAdapter);
  const std::string new_path = write_index("new.faiss", "new", retrained);
  GstHarness* h = harness(make_element("index", old_path.c_str(), "k", 3, nullptr));
  set_tensor_caps(h, kWidth);
  EXPECT_EQ(hit_ids(*ask(h, "a", 1, kClipAndAdapter)).at(0), "old-1");

  g_object_set(h->element, "index", new_path.c_str(), nullptr);
  EXPECT_EQ(next_index_message(), std::make_pair(std::string("loaded"), new_path));
  EXPECT_EQ(swap_stats(h->element), std::make_tuple(new_path, old_path, guint64{1}));
  // Rows of the old models still come (moe-route and moe-expert not swapped yet): the old index.
  EXPECT_EQ(hit_ids(*ask(h, "b", 2, kClipAndAdapter)).at(0), "old-2");
  EXPECT_EQ(hit_ids(*ask(h, "c", 3, kClipAndAdapter)).at(0), "old-3");
  // The first row of the new models: the new index, and the old one is dropped.
  EXPECT_EQ(hit_ids(*ask(h, "d", 4, retrained)).at(0), "new-4");
  EXPECT_EQ(next_index_message(), std::make_pair(std::string("retired"), old_path));
  EXPECT_EQ(swap_stats(h->element), std::make_tuple(new_path, std::string(), guint64{1}));
  std::unique_ptr<Json> late = ask(h, "e", 5, kClipAndAdapter);
  EXPECT_EQ(Json::str(Json::object(late->obj(), "error"), "code"), "model_mismatch") << late->text();
  EXPECT_NE(Json::str(Json::object(late->obj(), "error"), "reason").find(new_path), std::string::npos);
}

TEST_F(AnnQuerySwapTest, FailedSwapsWarnAndKeepTheIndexInUse) {
  const std::string old_path = write_index("old.faiss", "old");
  const std::string narrow = write_index("narrow.faiss", "narrow", {}, 8);
  GstHarness* h = harness(make_element("index", old_path.c_str(), "k", 3, nullptr));
  set_tensor_caps(h, kWidth);
  const std::string missing = dir_.file("missing.faiss");
  for (const std::string& path : {missing, narrow}) {
    g_object_set(h->element, "index", path.c_str(), nullptr);
    GstMessage* msg = gst_bus_timed_pop_filtered(bus_, 10 * GST_SECOND, GST_MESSAGE_WARNING);
    ASSERT_NE(msg, nullptr) << path;
    GError* err = nullptr;
    gst_message_parse_warning(msg, &err, nullptr);
    EXPECT_NE(std::string(err->message).find(path), std::string::npos) << err->message;
    if (path == narrow) {
      EXPECT_NE(std::string(err->message).find("8-wide"), std::string::npos) << err->message;
    }
    g_error_free(err);
    gst_message_unref(msg);
    gchar* index = nullptr;
    g_object_get(h->element, "index", &index, nullptr);
    EXPECT_EQ(index, old_path) << "index reads the one in use again";
    g_free(index);
    EXPECT_EQ(hit_ids(*ask(h, "q", 6, {})).at(0), "old-6");
  }
  EXPECT_EQ(swap_stats(h->element), std::make_tuple(old_path, std::string(), guint64{0}));
  GstStructure* st = nullptr;
  g_object_get(h->element, "stats", &st, nullptr);
  guint64 failures = 0;
  EXPECT_TRUE(gst_structure_get_uint64(st, "swap-failures", &failures));
  gst_structure_free(st);
  EXPECT_EQ(failures, 2u);
}

}  // namespace
