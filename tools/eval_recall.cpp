// Retrieval quality of a model (and adapter) measured through the real pipelines: builds an
// index of a catalog with the index-build pipeline, runs every held-out text query through the
// query pipeline, and reports R@1/5/10 (share of queries with a relevant item in the top k) and
// mAP over the full ranking — the definitions tools/train/evaluate.py uses. With an adapter it also
// reports the routing: experts per row, the expert load and its coefficient of variation (from
// moe-route's stats) and the MoE stage's (route + expert) latency per request, p50 and p99.
//
//   moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --queries FILE [--index FILE]
//                   [--route-props "temperature=2 balance=bias"] [--json]
//   moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --composed FILE
//                   [--fusion image,text,average,fixed:W,gate] [--tune-fixed] [--index FILE] [--json]
//
// --route-props: properties of the query pipeline's moe-route (the index is built with the
// adapter's own routing).
// queries.jsonl: one {"id": ..., "text": ..., "relevant": [catalog ids]} per line.
//
// Composed (hybrid) queries, --composed: one {"id", "image": PATH, "text": "in red", "relevant":
// [catalog ids], "split": "val" | "test"} per line (tools/catalog/generate_catalog.py's
// composed-queries.jsonl; a relative PATH is relative to the file's folder). Run through the engine
// the pipelines run (moe::ClipModel's two towers, the fusion, moe::MoeAdapter::apply, moe::AnnIndex
// over the same index), on the "test" lines (every line when none has a split), once per fusion:
// image (the image's embedding alone), text (the text's alone), average (both weighted 0.5),
// fixed:W (W · image + (1 - W) · text), gate (the adapter's cross-modal gate, MoeAdapter::fuse).
// --tune-fixed adds fixed:W with W chosen on the "val" lines (0 to 1 in steps of 0.05, best R@10,
// ties to the better mAP@10).
// Reported per fusion: R@1/5/10, mAP and mAP@10 (average precision over the top 10, divided by
// min(relevant, 10)); for the gate also its mean image weight. --queries and --composed may be
// given together: one index serves both, each prints its own line (--json: one object each).
#include <glib.h>
#include <glib/gstdio.h>
#include <gst/app/gstappsink.h>
#include <gst/app/gstappsrc.h>
#include <gst/gst.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moe/ann_index.h"
#include "moe/clip_model.h"
#include "moe/error.h"
#include "moe/image_decode.h"
#include "moe/moe_layer.h"

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

// Retrieval scores summed over queries: a relevant item in the top 1, 5 and 10; average precision
// over the full ranking and over its top 10 (divided by min(relevant, 10)).
struct RankingScores {
  static constexpr int kTop[3] = {1, 5, 10};
  double hits[3] = {0, 0, 0}, ap = 0, ap10 = 0;
  size_t queries = 0;

  // One query's ranking of `ranked` items; is_relevant(r) says whether rank r (0-based) is.
  template <typename IsRelevant>
  void add(size_t ranked, size_t relevant, IsRelevant&& is_relevant) {
    int found = 0;
    double precision_sum = 0, precision_sum10 = 0;
    for (size_t r = 0; r < ranked; ++r) {
      if (!is_relevant(r)) continue;
      ++found;
      precision_sum += static_cast<double>(found) / (r + 1);
      if (r < 10) precision_sum10 += static_cast<double>(found) / (r + 1);
      for (int j = 0; j < 3; ++j)
        if (static_cast<int>(r) < kTop[j] && found == 1) hits[j] += 1;
    }
    ap += relevant == 0 ? 0 : precision_sum / static_cast<double>(relevant);
    ap10 += relevant == 0 ? 0 : precision_sum10 / static_cast<double>(std::min<size_t>(relevant, 10));
    ++queries;
  }
  double mean(double sum) const { return queries == 0 ? 0.0 : sum / static_cast<double>(queries); }
};

// ---- text queries through the query pipeline ----------------------------------------------------

std::vector<HeldOutQuery> read_text_queries(const std::string& path) {
  std::vector<HeldOutQuery> queries;
  for (JsonNode* n : read_jsonl(path)) {
    JsonObject* o = json_node_get_object(n);
    HeldOutQuery q;
    q.id = json_object_get_string_member(o, "id");
    q.text = json_object_get_string_member(o, "text");
    JsonArray* rel = json_object_get_array_member(o, "relevant");
    for (guint i = 0; i < json_array_get_length(rel); ++i) q.relevant.insert(json_array_get_string_element(rel, i));
    queries.push_back(std::move(q));
    json_node_unref(n);
  }
  return queries;
}

// Runs every query through the query pipeline over `index` and prints the scores (and, with an
// adapter, the routing).
void evaluate_text_queries(const std::vector<HeldOutQuery>& queries, const std::string& model,
                           const std::string& adapter, const std::string& index, const std::string& route_props,
                           bool json) {
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

  RankingScores scores;
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
    scores.add(json_array_get_length(results), q.relevant.size(), [&](size_t r) {
      const auto item =
          json_object_get_int_member(json_array_get_object_element(results, static_cast<guint>(r)), "item");
      return q.relevant.count(item_ids.at(static_cast<size_t>(item))) != 0;
    });
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
  if (scores.queries != queries.size())
    fail("only " + std::to_string(scores.queries) + " of " + std::to_string(queries.size()) + " queries answered");
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
                queries.size(), item_ids.size(), scores.mean(scores.hits[0]), scores.mean(scores.hits[1]),
                scores.mean(scores.hits[2]), scores.mean(scores.ap), routing.c_str());
  else
    std::printf("queries %zu  items %zu  R@1 %.3f  R@5 %.3f  R@10 %.3f  mAP %.3f%s\n", queries.size(), item_ids.size(),
                scores.mean(scores.hits[0]), scores.mean(scores.hits[1]), scores.mean(scores.hits[2]),
                scores.mean(scores.ap), routing.c_str());
}

// ---- composed (image + text) queries through the engine -----------------------------------------

struct ComposedQuery {
  std::string id, image, text, split;  // image: a path, resolved against the queries file's folder
  std::set<std::string> relevant;
};

std::vector<ComposedQuery> read_composed_queries(const std::string& path) {
  gchar* folder = g_path_get_dirname(path.c_str());
  std::vector<ComposedQuery> queries;
  for (JsonNode* n : read_jsonl(path)) {
    const std::string where = path + ": query " + std::to_string(queries.size() + 1);
    JsonObject* o = JSON_NODE_HOLDS_OBJECT(n) ? json_node_get_object(n) : nullptr;
    const auto text_member = [&](const char* key) {
      const char* v = o && json_object_has_member(o, key) ? json_object_get_string_member(o, key) : nullptr;
      if (v == nullptr) fail(where + ": '" + key + "' must be a string");
      return std::string(v);
    };
    ComposedQuery q;
    q.id = text_member("id");
    q.image = text_member("image");
    if (!g_path_is_absolute(q.image.c_str())) {
      gchar* full = g_build_filename(folder, q.image.c_str(), nullptr);
      q.image = full;
      g_free(full);
    }
    q.text = text_member("text");
    if (json_object_has_member(o, "split")) q.split = text_member("split");
    JsonArray* rel = json_object_has_member(o, "relevant") ? json_object_get_array_member(o, "relevant") : nullptr;
    for (guint i = 0; rel != nullptr && i < json_array_get_length(rel); ++i) {
      const char* id = json_array_get_string_element(rel, i);
      if (id == nullptr)
        rel = nullptr;
      else
        q.relevant.insert(id);
    }
    if (rel == nullptr) fail(where + ": 'relevant' must be an array of catalog ids");
    queries.push_back(std::move(q));
    json_node_unref(n);
  }
  g_free(folder);
  return queries;
}

// How a query's two embeddings become one vector: the adapter's gate, or W · image + (1 - W) · text.
struct Fusion {
  std::string name;  // as reported: "image", "text", "average", "fixed:0.35", "gate"
  bool gate = false;
  double image_weight = 0.5;
  // "image" and "text": the query as a single-modality request (routed away from joint experts).
  bool single_modality = false;
};

Fusion fixed_fusion(double w) {
  char name[32];
  std::snprintf(name, sizeof name, "fixed:%g", w);
  return {name, false, w};
}

Fusion parse_fusion(const std::string& s) {
  if (s == "image") return {s, false, 1.0, true};
  if (s == "text") return {s, false, 0.0, true};
  if (s == "average") return {s, false, 0.5};
  if (s == "gate") return {s, true, 0.0};
  if (s.rfind("fixed:", 0) == 0) {
    const std::string w = s.substr(6);
    char* end = nullptr;
    const double v = g_ascii_strtod(w.c_str(), &end);
    if (!w.empty() && *end == '\0' && v >= 0.0 && v <= 1.0) return fixed_fusion(v);
  }
  fail("--fusion: '" + s + "' is not image, text, average, fixed:W (W in [0, 1]) or gate");
}

// A comma-separated list of fusions.
std::vector<Fusion> parse_fusions(const std::string& list) {
  std::vector<Fusion> out;
  size_t begin = 0;
  for (size_t comma; (comma = list.find(',', begin)) != std::string::npos; begin = comma + 1)
    out.push_back(parse_fusion(list.substr(begin, comma - begin)));
  out.push_back(parse_fusion(list.substr(begin)));
  return out;
}

// Both embeddings of every query, [n, D] each, as the encoder gives them.
struct QueryEmbeddings {
  moe::Tensor image, text;
};

QueryEmbeddings encode(const moe::ClipModel& clip, const std::vector<const ComposedQuery*>& queries) {
  constexpr size_t kBatch = 32;
  std::vector<float> image, text;
  int64_t dim = 0;
  for (size_t first = 0; first < queries.size(); first += kBatch) {
    const size_t end = std::min(queries.size(), first + kBatch);
    std::vector<moe::RgbImage> decoded;
    std::vector<moe::ImageView> views;
    std::vector<std::string> texts;
    for (size_t i = first; i < end; ++i) {
      decoded.push_back(moe::decode_image_file(queries[i]->image));
      texts.push_back(queries[i]->text);
    }
    for (const moe::RgbImage& d : decoded) views.push_back(d.view());
    const moe::Tensor image_rows = clip.encode_images(views).embeds, text_rows = clip.encode_texts(texts).embeds;
    image.insert(image.end(), image_rows.data<float>(), image_rows.data<float>() + image_rows.numel());
    text.insert(text.end(), text_rows.data<float>(), text_rows.data<float>() + text_rows.numel());
    dim = image_rows.dim(1);
  }
  const int64_t n = static_cast<int64_t>(queries.size());
  return {moe::Tensor::from_vector(image, {n, dim}), moe::Tensor::from_vector(text, {n, dim})};
}

struct FusionResult {
  RankingScores scores;
  double mean_image_weight = 0;  // the gate's, over the queries
};

// Fuses, adapts (with an adapter) and searches every query; scores the rankings.
FusionResult evaluate_fusion(const Fusion& fusion, const std::vector<const ComposedQuery*>& queries,
                             const QueryEmbeddings& embeddings, const moe::MoeAdapter* adapter,
                             const moe::AnnIndex& index) {
  FusionResult result;
  moe::Tensor fused;
  if (fusion.gate) {
    moe::Tensor weights;
    fused = adapter->fuse(embeddings.image, embeddings.text, &weights);
    for (int64_t r = 0; r < weights.dim(0); ++r) result.mean_image_weight += weights.data<float>()[r * 2];
    result.mean_image_weight /= std::max<double>(1.0, static_cast<double>(weights.dim(0)));
  } else {
    fused = moe::Tensor::zeros(moe::DType::F32, embeddings.image.shape());
    const float w = static_cast<float>(fusion.image_weight);
    for (int64_t i = 0; i < fused.numel(); ++i)
      fused.data<float>()[i] = w * embeddings.image.data<float>()[i] + (1.0f - w) * embeddings.text.data<float>()[i];
  }
  // Fused rows may route to the adapter's joint visual-text experts; an image or a text alone is
  // routed as the service routes a single-modality request.
  const moe::Tensor vectors =
      adapter != nullptr
          ? adapter->apply(fused, moe::MoeLayer::FusedRows(static_cast<size_t>(fused.dim(0)), !fusion.single_modality))
                .embeddings
          : fused;
  const int k = static_cast<int>(std::min<int64_t>(index.size(), 1024));  // the full ranking
  const auto hits = index.search(vectors.data<float>(), vectors.dim(0), k);
  for (size_t q = 0; q < queries.size(); ++q)
    result.scores.add(hits[q].size(), queries[q]->relevant.size(),
                      [&](size_t r) { return queries[q]->relevant.count(index.item(hits[q][r].item).id) != 0; });
  return result;
}

// The queries evaluated ("test"; all of them when none has a split) and those W is tuned on ("val").
struct ComposedSplits {
  std::vector<const ComposedQuery*> test, val;
  const char* name = "test";
};

ComposedSplits split_composed_queries(const std::vector<ComposedQuery>& all, bool tune_fixed) {
  ComposedSplits s;
  const bool has_splits = std::any_of(all.begin(), all.end(), [](const ComposedQuery& q) { return !q.split.empty(); });
  if (!has_splits) s.name = "all";
  for (const ComposedQuery& q : all) {
    if (!has_splits || q.split == "test") s.test.push_back(&q);
    if (q.split == "val") s.val.push_back(&q);
  }
  if (s.test.empty()) fail("--composed: no query has \"split\": \"test\"");
  if (tune_fixed && s.val.empty()) fail("--tune-fixed: no query has \"split\": \"val\"");
  return s;
}

// The fusions to evaluate: `listed`, or image, text, average (and gate when the adapter has one).
std::vector<Fusion> fusions_to_evaluate(std::vector<Fusion> listed, const moe::MoeAdapter* adapter,
                                        const std::string& adapter_dir) {
  const bool has_gate = adapter != nullptr && adapter->has_cross_modal_gate();
  if (listed.empty()) {
    listed = {parse_fusion("image"), parse_fusion("text"), parse_fusion("average")};
    if (has_gate) listed.push_back(parse_fusion("gate"));
  }
  for (const Fusion& f : listed)
    if (f.gate && !has_gate)
      fail("--fusion gate: " +
           (adapter ? "the adapter " + adapter_dir + " has no cross-modal gate" : "needs --adapter"));
  return listed;
}

// Evaluates `fusions` on the test queries and prints the scores; with `tune_fixed`, first picks
// fixed:W on the val queries.
void evaluate_composed_queries(const ComposedSplits& splits, std::vector<Fusion> fusions, bool tune_fixed,
                               const moe::ClipModel& clip, const moe::MoeAdapter* adapter, const moe::AnnIndex& index,
                               bool json) {
  const std::vector<const ComposedQuery*>& test = splits.test;
  const std::vector<const ComposedQuery*>& val = splits.val;
  std::string tuned;  // the tuning's line, or its JSON members
  if (tune_fixed) {
    const QueryEmbeddings val_embeddings = encode(clip, val);
    Fusion best;
    double best_r10 = -1, best_ap10 = -1;
    // W = 0, 0.05, ..., 1: the best R@10, ties to the better mAP@10, then to the lower W.
    for (int step = 0; step <= 20; ++step) {
      const Fusion f = fixed_fusion(step / 20.0);
      const RankingScores s = evaluate_fusion(f, val, val_embeddings, adapter, index).scores;
      const double r10 = s.mean(s.hits[2]), ap10 = s.mean(s.ap10);
      if (r10 > best_r10 || (r10 == best_r10 && ap10 > best_ap10)) {
        best_r10 = r10;
        best_ap10 = ap10;
        best = f;
      }
    }
    char buf[160];
    if (json)
      std::snprintf(buf, sizeof buf, ", \"tuned_on_val\": {\"fusion\": \"%s\", \"queries\": %zu, \"R@10\": %.4f}",
                    best.name.c_str(), val.size(), best_r10);
    else
      std::snprintf(buf, sizeof buf, "  %s tuned on val (%zu queries, R@10 %.3f)", best.name.c_str(), val.size(),
                    best_r10);
    tuned = buf;
    // Listed with the fixed fusions, before the gate.
    fusions.insert(std::find_if(fusions.begin(), fusions.end(), [](const Fusion& f) { return f.gate; }), best);
  }

  const QueryEmbeddings embeddings = encode(clip, test);
  std::string rows;
  for (const Fusion& f : fusions) {
    const FusionResult r = evaluate_fusion(f, test, embeddings, adapter, index);
    const RankingScores& s = r.scores;
    char buf[320];
    if (json) {
      std::snprintf(buf, sizeof buf,
                    "%s{\"fusion\": \"%s\", \"R@1\": %.4f, \"R@5\": %.4f, \"R@10\": %.4f, \"mAP\": %.4f, "
                    "\"mAP@10\": %.4f",
                    rows.empty() ? "" : ", ", f.name.c_str(), s.mean(s.hits[0]), s.mean(s.hits[1]), s.mean(s.hits[2]),
                    s.mean(s.ap), s.mean(s.ap10));
      rows += buf;
      if (f.gate) {
        std::snprintf(buf, sizeof buf, ", \"image_weight\": %.4f", r.mean_image_weight);
        rows += buf;
      }
      rows += "}";
    } else {
      std::snprintf(buf, sizeof buf, "  %-12s R@1 %.3f  R@5 %.3f  R@10 %.3f  mAP %.3f  mAP@10 %.3f", f.name.c_str(),
                    s.mean(s.hits[0]), s.mean(s.hits[1]), s.mean(s.hits[2]), s.mean(s.ap), s.mean(s.ap10));
      rows += buf;
      if (f.gate) {
        std::snprintf(buf, sizeof buf, "  image weight %.3f", r.mean_image_weight);
        rows += buf;
      }
      rows += "\n";
    }
  }
  if (json)
    std::printf("{\"composed_queries\": %zu, \"split\": \"%s\", \"items\": %lld%s, \"fusions\": [%s]}\n", test.size(),
                splits.name, static_cast<long long>(index.size()), tuned.c_str(), rows.c_str());
  else
    std::printf("composed queries %zu (%s)  items %lld%s\n%s", test.size(), splits.name,
                static_cast<long long>(index.size()), tuned.c_str(), rows.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  gst_init(&argc, &argv);
  std::string model, adapter, catalog, queries_path, composed_path, index, route_props;
  std::vector<Fusion> fusions;
  bool json = false, tune_fixed = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
      continue;
    }
    if (a == "--tune-fixed") {
      tune_fixed = true;
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
    else if (a == "--composed")
      composed_path = v;
    else if (a == "--fusion")
      fusions = parse_fusions(v);
    else if (a == "--index")
      index = v;
    else if (a == "--route-props")
      route_props = v;
    else
      fail("unknown option " + a);
  }
  if (model.empty() || catalog.empty() || (queries_path.empty() && composed_path.empty()))
    fail(
        "usage: moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --queries FILE [--index FILE] "
        "[--route-props PROPS] [--json]\n"
        "       moe-eval-recall --model DIR [--adapter DIR] --catalog DIR --composed FILE "
        "[--fusion image,text,average,fixed:W,gate] [--tune-fixed] [--index FILE] [--json]");
  if (!route_props.empty() && adapter.empty()) fail("--route-props needs --adapter");
  if ((!fusions.empty() || tune_fixed) && composed_path.empty()) fail("--fusion and --tune-fixed need --composed");
  std::string tmp_dir;
  if (index.empty()) {
    gchar* t = g_dir_make_tmp("moe-eval-XXXXXX", nullptr);
    tmp_dir = t;
    g_free(t);
    index = tmp_dir + "/catalog.faiss";
  }

  const std::vector<HeldOutQuery> queries =
      queries_path.empty() ? std::vector<HeldOutQuery>{} : read_text_queries(queries_path);
  const std::vector<ComposedQuery> composed =
      composed_path.empty() ? std::vector<ComposedQuery>{} : read_composed_queries(composed_path);
  // The composed queries' engine, loaded before the index build so that bad arguments fail early.
  ComposedSplits splits;
  std::optional<moe::ClipModel> clip;
  std::optional<moe::MoeAdapter> engine_adapter;
  if (!composed_path.empty()) {
    splits = split_composed_queries(composed, tune_fixed);
    try {
      clip.emplace(moe::ClipModel::load(model));
      if (!adapter.empty()) engine_adapter.emplace(moe::MoeAdapter::load(adapter));
    } catch (const moe::Error& e) {
      fail(e.what());
    }
    fusions = fusions_to_evaluate(fusions, engine_adapter ? &*engine_adapter : nullptr, adapter);
  }

  const std::string adapter_stages =
      adapter.empty() ? "" : " ! moe-route model=" + quote(adapter) + " ! moe-expert model=" + quote(adapter);
  run_to_eos("moe-catalog-src location=" + quote(catalog) + " ! moe-encode model=" + quote(model) + " max-batch=32" +
             adapter_stages + " ! ann-query mode=build index=" + quote(index) + " ! fakesink");

  if (!queries_path.empty()) evaluate_text_queries(queries, model, adapter, index, route_props, json);
  if (!composed_path.empty()) {
    try {
      evaluate_composed_queries(splits, fusions, tune_fixed, *clip, engine_adapter ? &*engine_adapter : nullptr,
                                moe::AnnIndex::load(index), json);
    } catch (const moe::Error& e) {
      fail(e.what());
    }
  }
  if (!tmp_dir.empty()) {
    g_unlink(index.c_str());
    g_unlink((index + ".items.jsonl").c_str());
    g_rmdir(tmp_dir.c_str());
  }
  return 0;
}
