// Retrieval quality of a model (and adapter) measured through the real pipelines: builds an
// index of a catalog with the index-build pipeline, runs every held-out text query through the
// query pipeline, and reports R@1/5/10 (share of queries with a relevant item in the top k) and
// mAP over the full ranking — the definitions tools/train/evaluate.py uses. With an adapter it also
// reports the routing: experts per row, the expert load and its coefficient of variation (from
// moe-route's stats) and the MoE stage's (route + expert) latency per request, p50 and p99.
//
//   moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --queries FILE [--index FILE]
//                   [--route-props "temperature=2 balance=bias"] [--json]
//
// --route-props: properties of the query pipeline's moe-route (the index is built with the
// adapter's own routing).
// queries.jsonl: one {"id": ..., "text": ..., "relevant": [catalog ids]} per line.
#include <glib.h>
#include <glib/gstdio.h>
#include <gst/app/gstappsink.h>
#include <gst/app/gstappsrc.h>
#include <gst/gst.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

struct HeldOutQuery {
  std::string id, text;
  std::set<std::string> relevant;
};

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stderr, "moe-eval-recall: %s\n", msg.c_str());
  std::exit(1);
}

std::vector<JsonNode*> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path + ": cannot open");
  std::vector<JsonNode*> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    GError* err = nullptr;
    JsonNode* node = json_from_string(line.c_str(), &err);
    if (!node) fail(path + ":" + std::to_string(n) + ": " + (err ? err->message : "invalid JSON"));
    out.push_back(node);
  }
  return out;
}

std::string quote(const std::string& s) {
  gchar* q = g_strescape(s.c_str(), nullptr);
  std::string out = std::string("\"") + q + "\"";
  g_free(q);
  return out;
}

// Runs a pipeline to EOS; fails with the first error message.
void run_to_eos(const std::string& description) {
  GError* err = nullptr;
  GstElement* p = gst_parse_launch(description.c_str(), &err);
  if (!p) fail(std::string("pipeline: ") + (err ? err->message : "?"));
  gst_element_set_state(p, GST_STATE_PLAYING);
  GstMessage* msg = gst_bus_timed_pop_filtered(GST_ELEMENT_BUS(p), GST_CLOCK_TIME_NONE,
                                               static_cast<GstMessageType>(GST_MESSAGE_EOS | GST_MESSAGE_ERROR));
  if (GST_MESSAGE_TYPE(msg) == GST_MESSAGE_ERROR) {
    GError* e = nullptr;
    gst_message_parse_error(msg, &e, nullptr);
    fail(std::string("index build failed: ") + e->message);
  }
  gst_message_unref(msg);
  gst_element_set_state(p, GST_STATE_NULL);
  gst_object_unref(p);
}

}  // namespace

int main(int argc, char** argv) {
  gst_init(&argc, &argv);
  std::string model, adapter, catalog, queries_path, index, route_props;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
      continue;
    }
    if (i + 1 >= argc) fail(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--model")
      model = v;
    else if (a == "--adapter")
      adapter = v;
    else if (a == "--catalog")
      catalog = v;
    else if (a == "--queries")
      queries_path = v;
    else if (a == "--index")
      index = v;
    else if (a == "--route-props")
      route_props = v;
    else
      fail("unknown option " + a);
  }
  if (model.empty() || catalog.empty() || queries_path.empty())
    fail(
        "usage: moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --queries FILE [--index FILE] "
        "[--route-props PROPS] [--json]");
  if (!route_props.empty() && adapter.empty()) fail("--route-props needs --adapter");
  std::string tmp_dir;
  if (index.empty()) {
    gchar* t = g_dir_make_tmp("moe-eval-XXXXXX", nullptr);
    tmp_dir = t;
    g_free(t);
    index = tmp_dir + "/catalog.faiss";
  }

  std::vector<HeldOutQuery> queries;
  for (JsonNode* n : read_jsonl(queries_path)) {
    JsonObject* o = json_node_get_object(n);
    HeldOutQuery q;
    q.id = json_object_get_string_member(o, "id");
    q.text = json_object_get_string_member(o, "text");
    JsonArray* rel = json_object_get_array_member(o, "relevant");
    for (guint i = 0; i < json_array_get_length(rel); ++i) q.relevant.insert(json_array_get_string_element(rel, i));
    queries.push_back(std::move(q));
    json_node_unref(n);
  }

  const std::string adapter_stages =
      adapter.empty() ? "" : " ! moe-route model=" + quote(adapter) + " ! moe-expert model=" + quote(adapter);
  run_to_eos("moe-catalog-src location=" + quote(catalog) + " ! moe-encode model=" + quote(model) + " max-batch=32" +
             adapter_stages + " ! ann-query mode=build index=" + quote(index) + " ! fakesink");

  // Item table: row i of the index is catalog item ids[i] (line 1 is the header).
  std::vector<std::string> item_ids;
  std::vector<JsonNode*> items = read_jsonl(index + ".items.jsonl");
  for (size_t i = 1; i < items.size(); ++i)
    item_ids.push_back(json_object_get_string_member(json_node_get_object(items[i]), "id"));
  for (JsonNode* n : items) json_node_unref(n);
  const int k = static_cast<int>(std::min<size_t>(item_ids.size(), 1024));  // the full ranking

  const std::string query_adapter_stages = adapter.empty() ? ""
                                                           : " ! moe-route name=route model=" + quote(adapter) + " " +
                                                                 route_props + " ! moe-expert model=" + quote(adapter);
  GError* err = nullptr;
  GstElement* p = gst_parse_launch(
      ("appsrc name=src format=time caps=\"text/x-raw,format=(string)utf8\" ! moe-encode model=" + quote(model) +
       " max-batch=32" + query_adapter_stages + " ! ann-query index=" + quote(index) + " k=" + std::to_string(k) +
       " ! appsink name=sink sync=false")
          .c_str(),
      &err);
  if (!p) fail(std::string("pipeline: ") + (err ? err->message : "?"));
  GstElement* src = gst_bin_get_by_name(GST_BIN(p), "src");
  GstElement* sink = gst_bin_get_by_name(GST_BIN(p), "sink");
  if (gst_element_set_state(p, GST_STATE_PLAYING) == GST_STATE_CHANGE_FAILURE) fail("query pipeline did not start");
  for (size_t i = 0; i < queries.size(); ++i) {
    GstBuffer* b = gst_buffer_new_memdup(queries[i].text.data(), queries[i].text.size());
    GST_BUFFER_OFFSET(b) = i;  // the request id moe-encode reports back
    gst_app_src_push_buffer(GST_APP_SRC(src), b);
  }
  gst_app_src_end_of_stream(GST_APP_SRC(src));

  const int ks[3] = {1, 5, 10};
  double hits[3] = {0, 0, 0}, ap_sum = 0;
  size_t answered = 0;
  std::vector<double> moe_ms;  // route + expert, per request
  while (GstSample* sample = gst_app_sink_pull_sample(GST_APP_SINK(sink))) {
    GstBuffer* buf = gst_sample_get_buffer(sample);
    GstMapInfo map;
    gst_buffer_map(buf, &map, GST_MAP_READ);
    JsonNode* doc = json_from_string(std::string(reinterpret_cast<const char*>(map.data), map.size).c_str(), nullptr);
    gst_buffer_unmap(buf, &map);
    gst_sample_unref(sample);
    JsonObject* o = json_node_get_object(doc);
    if (g_strcmp0(json_object_get_string_member(o, "type"), "result") != 0)
      fail(std::string("query failed: ") + json_to_string(doc, FALSE));
    const HeldOutQuery& q = queries.at(std::stoul(json_object_get_string_member(o, "id")));
    if (!adapter.empty()) {
      JsonObject* t = json_object_get_object_member(o, "timings_ms");
      moe_ms.push_back(json_object_get_double_member(t, "route") + json_object_get_double_member(t, "expert"));
    }
    JsonArray* results = json_object_get_array_member(o, "results");
    int found = 0;
    double precision_sum = 0;
    for (guint r = 0; r < json_array_get_length(results); ++r) {
      const auto item = json_object_get_int_member(json_array_get_object_element(results, r), "item");
      if (!q.relevant.count(item_ids.at(static_cast<size_t>(item)))) continue;
      ++found;
      precision_sum += static_cast<double>(found) / (r + 1);
      for (int j = 0; j < 3; ++j)
        if (static_cast<int>(r) < ks[j] && found == 1) hits[j] += 1;
    }
    ap_sum += q.relevant.empty() ? 0 : precision_sum / static_cast<double>(q.relevant.size());
    ++answered;
    json_node_unref(doc);
  }
  // The routing, from moe-route's stats (read before the pipeline stops).
  std::vector<guint64> load;
  guint64 routed_rows = 0;
  double load_cv = 0.0;
  if (GstElement* route = gst_bin_get_by_name(GST_BIN(p), "route")) {
    GstStructure* stats = nullptr;
    g_object_get(route, "stats", &stats, nullptr);
    gst_structure_get_uint64(stats, "rows", &routed_rows);
    gst_structure_get_double(stats, "load-cv", &load_cv);
    const GValue* per_expert = gst_structure_get_value(stats, "expert-load");
    for (guint i = 0; i < gst_value_array_get_size(per_expert); ++i)
      load.push_back(g_value_get_uint64(gst_value_array_get_value(per_expert, i)));
    gst_structure_free(stats);
    gst_object_unref(route);
  }
  gst_element_set_state(p, GST_STATE_NULL);
  gst_object_unref(src);
  gst_object_unref(sink);
  gst_object_unref(p);
  if (!tmp_dir.empty()) {
    g_unlink(index.c_str());
    g_unlink((index + ".items.jsonl").c_str());
    g_rmdir(tmp_dir.c_str());
  }
  if (answered != queries.size())
    fail("only " + std::to_string(answered) + " of " + std::to_string(queries.size()) + " queries answered");
  const double n = static_cast<double>(queries.size());
  std::string routing;  // ", ..." JSON members or "  ..." text
  if (!adapter.empty()) {
    guint64 slots = 0;
    std::string loads;
    for (guint64 l : load) {
      slots += l;
      loads += (loads.empty() ? "" : ", ") + std::to_string(l);
    }
    std::sort(moe_ms.begin(), moe_ms.end());
    const auto pct = [&](double q) {
      return moe_ms.empty() ? 0.0 : moe_ms[static_cast<size_t>(std::ceil(q * moe_ms.size())) - 1];
    };
    const double per_row = routed_rows ? static_cast<double>(slots) / static_cast<double>(routed_rows) : 0.0;
    char buf[512];
    if (json)
      std::snprintf(buf, sizeof buf,
                    ", \"experts_per_row\": %.4f, \"load_cv\": %.4f, \"expert_load\": [%s], \"moe_ms_p50\": %.4f, "
                    "\"moe_ms_p99\": %.4f",
                    per_row, load_cv, loads.c_str(), pct(0.5), pct(0.99));
    else
      std::snprintf(buf, sizeof buf, "  experts/row %.3f  load-cv %.3f  MoE p50 %.3f ms  p99 %.3f ms", per_row, load_cv,
                    pct(0.5), pct(0.99));
    routing = buf;
  }
  if (json)
    std::printf("{\"queries\": %zu, \"items\": %zu, \"R@1\": %.4f, \"R@5\": %.4f, \"R@10\": %.4f, \"mAP\": %.4f%s}\n",
                queries.size(), item_ids.size(), hits[0] / n, hits[1] / n, hits[2] / n, ap_sum / n, routing.c_str());
  else
    std::printf("queries %zu  items %zu  R@1 %.3f  R@5 %.3f  R@10 %.3f  mAP %.3f%s\n", queries.size(), item_ids.size(),
                hits[0] / n, hits[1] / n, hits[2] / n, ap_sum / n, routing.c_str());
  return 0;
}
