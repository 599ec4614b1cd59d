// Fits the router's softmax temperature of a MoE adapter on held-out queries (docs/routing.md).
//
//   moe-calibrate-temperature --model DIR --adapter DIR --index FILE --queries FILE [--write]
//
// The target is the routing that retrieves best: for every held-out query, each expert alone
// (top-1, weight 1) makes the query's vector, and the expert whose vector ranks the query's
// relevant catalog items best (average precision over the index, ties to the router's
// preference) is the query's best expert. The temperature T minimises the negative
// log-likelihood of those best experts under softmax(router logits / T): the router's
// probabilities then say how likely each expert is to be the right one. Prints the NLL at T = 1
// and at the fit; --write stores the fit as "router_temperature" in the adapter's
// adapter_config.json, which moe-route uses when its temperature property is left at 0.
//
// queries.jsonl: one {"id": ..., "text": ..., "relevant": [catalog ids]} per line. FILE: an index
// built from the catalog with the adapter's own routing (pipelines/build-index.sh).
#include <json-glib/json-glib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "moe/ann_index.h"
#include "moe/clip_model.h"
#include "moe/error.h"
#include "moe/moe_layer.h"

namespace {

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stderr, "moe-calibrate-temperature: %s\n", msg.c_str());
  std::exit(1);
}

struct HeldOutQuery {
  std::string text;
  std::set<std::string> relevant;
};

std::vector<HeldOutQuery> read_queries(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path + ": cannot open");
  std::vector<HeldOutQuery> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    JsonNode* node = json_from_string(line.c_str(), nullptr);
    if (!node || !JSON_NODE_HOLDS_OBJECT(node)) fail(path + ":" + std::to_string(n) + ": not a JSON object");
    JsonObject* o = json_node_get_object(node);
    HeldOutQuery q;
    q.text = json_object_get_string_member_with_default(o, "text", "");
    if (JsonArray* rel = json_object_get_array_member(o, "relevant"))
      for (guint i = 0; i < json_array_get_length(rel); ++i) q.relevant.insert(json_array_get_string_element(rel, i));
    json_node_unref(node);
    if (!q.text.empty() && !q.relevant.empty()) out.push_back(std::move(q));
  }
  return out;
}

// Average precision of `hits` (the whole ranking) for the relevant ids.
double average_precision(const moe::AnnIndex& index, const std::vector<moe::AnnHit>& hits,
                         const std::set<std::string>& relevant) {
  int found = 0;
  double sum = 0.0;
  for (size_t r = 0; r < hits.size(); ++r)
    if (relevant.count(index.item(hits[r].item).id)) sum += static_cast<double>(++found) / static_cast<double>(r + 1);
  return sum / static_cast<double>(relevant.size());
}

// Mean negative log-likelihood of the best experts under softmax(logits / t).
double nll(const std::vector<float>& logits, const std::vector<int>& best, int experts, double t) {
  double total = 0.0;
  for (size_t q = 0; q < best.size(); ++q) {
    const float* l = logits.data() + q * static_cast<size_t>(experts);
    const double top = *std::max_element(l, l + experts) / t;
    double sum = 0.0;
    for (int e = 0; e < experts; ++e) sum += std::exp(l[e] / t - top);
    total -= l[best[q]] / t - top - std::log(sum);
  }
  return total / static_cast<double>(best.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, adapter_dir, index_path, queries_path;
  bool write = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--write") {
      write = true;
      continue;
    }
    if (i + 1 >= argc) fail(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--model")
      model_dir = v;
    else if (a == "--adapter")
      adapter_dir = v;
    else if (a == "--index")
      index_path = v;
    else if (a == "--queries")
      queries_path = v;
    else
      fail("unknown option " + a);
  }
  if (model_dir.empty() || adapter_dir.empty() || index_path.empty() || queries_path.empty())
    fail("usage: moe-calibrate-temperature --model DIR --adapter DIR --index FILE --queries FILE [--write]");
  try {
    const std::vector<HeldOutQuery> queries = read_queries(queries_path);
    if (queries.empty()) fail(queries_path + ": no query with a text and relevant items");
    const moe::ClipModel clip = moe::ClipModel::load(model_dir);
    const moe::MoeAdapter adapter = moe::MoeAdapter::load(adapter_dir);
    const moe::AnnIndex index = moe::AnnIndex::load(index_path);
    const int experts = adapter.layer().config().num_experts;
    // Text queries are never routed to joint visual-text experts (their logits are -inf here).
    const int eligible = experts - adapter.num_joint_experts();
    const auto n = static_cast<int64_t>(queries.size());

    std::vector<std::string> texts;
    for (const HeldOutQuery& q : queries) texts.push_back(q.text);
    const moe::Tensor x = clip.encode_texts(texts).embeds;
    const moe::Tensor logits_tensor = adapter.layer().router_logits(x);
    const std::vector<float> logits(logits_tensor.data<float>(), logits_tensor.data<float>() + n * experts);

    // Each expert alone, for every query: the best one by average precision.
    std::vector<std::vector<double>> ap(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(experts)));
    for (int e = 0; e < eligible; ++e) {
      moe::Routing only;
      only.rows = n;
      only.top_k = 1;
      only.expert_ids.assign(static_cast<size_t>(n), e);
      only.weights.assign(static_cast<size_t>(n), 1.0f);
      const moe::Tensor y = adapter.apply_experts(x, only);
      const auto hits = index.search(y.data<float>(), n, static_cast<int>(index.size()));
      for (int64_t q = 0; q < n; ++q)
        ap[static_cast<size_t>(q)][static_cast<size_t>(e)] =
            average_precision(index, hits[static_cast<size_t>(q)], queries[static_cast<size_t>(q)].relevant);
    }
    std::vector<int> best(static_cast<size_t>(n));
    int agree = 0;
    for (int64_t q = 0; q < n; ++q) {
      const float* l = logits.data() + q * experts;
      const auto& a = ap[static_cast<size_t>(q)];
      int b = 0;
      for (int e = 1; e < eligible; ++e)
        if (a[static_cast<size_t>(e)] > a[static_cast<size_t>(b)] ||
            (a[static_cast<size_t>(e)] == a[static_cast<size_t>(b)] && l[e] > l[b]))
          b = e;
      best[static_cast<size_t>(q)] = b;
      agree += std::max_element(l, l + experts) - l == b;
    }

    // NLL(T) is smooth and, over log T, has one minimum here: golden-section search on [1/50, 50].
    double lo = std::log(0.02), hi = std::log(50.0);
    const double phi = (std::sqrt(5.0) - 1.0) / 2.0;
    for (int i = 0; i < 100; ++i) {
      const double a = hi - phi * (hi - lo), b = lo + phi * (hi - lo);
      if (nll(logits, best, experts, std::exp(a)) < nll(logits, best, experts, std::exp(b)))
        hi = b;
      else
        lo = a;
    }
    const double t = std::exp((lo + hi) / 2.0);
    std::printf(
        "queries %lld  experts %d  router's top-1 is the best expert for %.1f%%\n"
        "NLL at T=1: %.4f   fitted T=%.4f: NLL %.4f\n",
        static_cast<long long>(n), experts, 100.0 * agree / static_cast<double>(n), nll(logits, best, experts, 1.0), t,
        nll(logits, best, experts, t));

    if (write) {
      const std::string path = adapter_dir + "/adapter_config.json";
      JsonParser* parser = json_parser_new();
      GError* err = nullptr;
      if (!json_parser_load_from_file(parser, path.c_str(), &err)) fail(path + ": " + err->message);
      JsonObject* o = json_node_get_object(json_parser_get_root(parser));
      json_object_set_double_member(o, "router_temperature", std::round(t * 1e4) / 1e4);
      JsonGenerator* gen = json_generator_new();
      json_generator_set_pretty(gen, TRUE);
      json_generator_set_indent(gen, 2);
      json_generator_set_root(gen, json_parser_get_root(parser));
      if (!json_generator_to_file(gen, path.c_str(), &err)) fail(path + ": " + err->message);
      g_object_unref(gen);
      g_object_unref(parser);
      std::printf("wrote router_temperature %.4f into %s\n", std::round(t * 1e4) / 1e4, path.c_str());
    }
  } catch (const moe::Error& e) {
    fail(e.what());
  }
  return 0;
}
