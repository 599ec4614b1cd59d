// The search demo's client: sends text and image queries to a running query service over
// ZeroMQ, matches the result documents to the queries by id, prints each query's top results as
// a table, and writes a self-contained HTML page (thumbnails embedded) that a person can open.
// Both show each query's latency (the documents' timings_ms), the experts that answered it, and
// the models and index that served it; --adapter and --index add what their files say (the
// adapter's experts and routing, the index's size and kind). Experts are named by the adapter
// config's optional "expert_names" list, else by number.
//
//   moe-search-demo [--requests EP] [--results EP] [--k N] [--html FILE] [--adapter DIR]
//                   [--index FILE] [--text QUERY]... [--image FILE]...
#include <glib.h>
#include <json-glib/json-glib.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

namespace {

struct Query {
  std::string id, text, image;  // exactly one of text / image
  JsonNode* result = nullptr;   // the document that answered it
};

std::string html_escape(const std::string& s) {
  gchar* e = g_markup_escape_text(s.c_str(), -1);
  std::string out(e);
  g_free(e);
  return out;
}

// A data: URI of an image file, so the page needs nothing beside it.
std::string data_uri(const std::string& path_or_uri) {
  std::string path = path_or_uri;
  if (path.rfind("file://", 0) == 0) {
    gchar* p = g_filename_from_uri(path.c_str(), nullptr, nullptr);
    if (p) path = p;
    g_free(p);
  }
  gchar* bytes = nullptr;
  gsize len = 0;
  if (!g_file_get_contents(path.c_str(), &bytes, &len, nullptr)) return "";
  gchar* mime = g_content_type_guess(path.c_str(), reinterpret_cast<const guchar*>(bytes), len, nullptr);
  gchar* b64 = g_base64_encode(reinterpret_cast<const guchar*>(bytes), len);
  gchar* mime_type = g_content_type_get_mime_type(mime);
  std::string out = std::string("data:") + (mime_type ? mime_type : "image/png") + ";base64," + b64;
  g_free(mime_type);
  g_free(b64);
  g_free(mime);
  g_free(bytes);
  return out;
}

const char* str_or(JsonObject* o, const char* key, const char* fallback) {
  JsonNode* n = o ? json_object_get_member(o, key) : nullptr;
  return n && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING ? json_node_get_string(n)
                                                                                       : fallback;
}

int64_t int_or(JsonObject* o, const char* key, int64_t fallback) {
  JsonNode* n = o ? json_object_get_member(o, key) : nullptr;
  return n && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_INT64 ? json_node_get_int(n) : fallback;
}

std::string printf_string(const char* format, ...) G_GNUC_PRINTF(1, 2);
std::string printf_string(const char* format, ...) {
  va_list args;
  va_start(args, format);
  gchar* text = g_strdup_vprintf(format, args);
  va_end(args);
  std::string out = text;
  g_free(text);
  return out;
}

// What the adapter's config says (--adapter DIR: DIR/adapter_config.json).
struct AdapterInfo {
  bool read = false;
  int64_t experts = 0, top_k = 0, hidden = 0;
  std::string routing;
  std::vector<std::string> names;  // "expert_names", when the config has them
};

AdapterInfo read_adapter(const std::string& dir) {
  AdapterInfo info;
  const std::string path = dir + "/adapter_config.json";
  JsonParser* parser = json_parser_new();
  if (json_parser_load_from_file(parser, path.c_str(), nullptr) &&
      JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser))) {
    JsonObject* o = json_node_get_object(json_parser_get_root(parser));
    info.read = true;
    info.experts = int_or(o, "num_experts", 0);
    info.top_k = int_or(o, "top_k", 0);
    info.hidden = int_or(o, "hidden_size", 0);
    info.routing = str_or(o, "routing", "");
    JsonNode* names = json_object_get_member(o, "expert_names");
    if (names && JSON_NODE_HOLDS_ARRAY(names)) {
      JsonArray* a = json_node_get_array(names);
      for (guint i = 0; i < json_array_get_length(a); ++i) {
        JsonNode* n = json_array_get_element(a, i);
        info.names.push_back(
            JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == G_TYPE_STRING ? json_node_get_string(n) : "");
      }
    }
  } else {
    std::fprintf(stderr, "cannot read the adapter config %s: experts are shown by number\n", path.c_str());
  }
  g_object_unref(parser);
  return info;
}

// What the index's item table header says (--index FILE: FILE.items.jsonl, first line).
struct IndexInfo {
  bool read = false;
  int64_t count = 0, dim = 0;
  std::string type;
};

IndexInfo read_index(const std::string& index) {
  IndexInfo info;
  std::ifstream items(index + ".items.jsonl");
  std::string header;
  JsonParser* parser = json_parser_new();
  if (std::getline(items, header) && json_parser_load_from_data(parser, header.c_str(), -1, nullptr) &&
      JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser))) {
    JsonObject* o = json_node_get_object(json_parser_get_root(parser));
    info.read = true;
    info.count = int_or(o, "count", 0);
    info.dim = int_or(o, "dim", 0);
    info.type = str_or(o, "index_type", "");
  } else {
    std::fprintf(stderr, "cannot read the item table of %s\n", index.c_str());
  }
  g_object_unref(parser);
  return info;
}

// An expert by its name in the adapter config, else by its number.
std::string expert_name(const AdapterInfo& adapter, int64_t expert) {
  if (expert >= 0 && static_cast<size_t>(expert) < adapter.names.size() && !adapter.names[expert].empty())
    return adapter.names[expert];
  return "expert " + std::to_string(expert);
}

// "fashion 0.62, home 0.38": the experts that answered, best first, with their weights.
std::string experts_text(JsonObject* doc, const AdapterInfo& adapter) {
  std::string out;
  JsonArray* ex = json_object_get_array_member(doc, "experts");
  for (guint i = 0; ex && i < json_array_get_length(ex); ++i) {
    JsonObject* e = json_array_get_object_element(ex, i);
    out += printf_string("%s%s %.2f", i ? ", " : "", expert_name(adapter, int_or(e, "expert", -1)).c_str(),
                         json_object_get_double_member(e, "weight"));
  }
  return out.empty() ? "none (no adapter in the pipeline)" : out;
}

// "12.3 ms (queue 0.1, encode 3.2, route 0.1, expert 0.2, search 0.3)": end to end, then per stage.
std::string latency_text(JsonObject* doc) {
  JsonNode* node = json_object_get_member(doc, "timings_ms");
  if (!node || !JSON_NODE_HOLDS_OBJECT(node)) return "not reported";
  JsonObject* timings = json_node_get_object(node);
  std::string stages;
  GList* names = json_object_get_members(timings);  // in the document's (pipeline) order
  for (GList* n = names; n; n = n->next) {
    const char* stage = static_cast<const char*>(n->data);
    if (g_strcmp0(stage, "total") == 0) continue;
    stages +=
        printf_string("%s%s %.1f", stages.empty() ? "" : ", ", stage, json_object_get_double_member(timings, stage));
  }
  g_list_free(names);
  const double total = json_object_has_member(timings, "total") ? json_object_get_double_member(timings, "total") : 0;
  return printf_string("%.1f ms", total) + (stages.empty() ? "" : " (" + stages + ")");
}

// The models and index that answered, from the first result document, and what --adapter and
// --index say of them.
struct Served {
  std::string encoder, adapter, index;
};

Served served_by(const std::vector<Query>& queries) {
  for (const Query& q : queries) {
    JsonObject* doc = q.result ? json_node_get_object(q.result) : nullptr;
    JsonNode* model = doc ? json_object_get_member(doc, "model") : nullptr;
    if (!model || !JSON_NODE_HOLDS_OBJECT(model)) continue;
    JsonObject* m = json_node_get_object(model);
    return {str_or(m, "encoder", "?"), str_or(m, "adapter", "none"), str_or(m, "index", "?")};
  }
  return {"?", "?", "?"};
}

std::string adapter_text(const Served& served, const AdapterInfo& adapter) {
  std::string out = served.adapter;
  if (adapter.read)
    out += printf_string(" (%lld experts, top-%lld, %s routing, hidden size %lld)",
                         static_cast<long long>(adapter.experts), static_cast<long long>(adapter.top_k),
                         adapter.routing.empty() ? "default" : adapter.routing.c_str(),
                         static_cast<long long>(adapter.hidden));
  return out;
}

std::string index_text(const Served& served, const IndexInfo& index) {
  std::string out = served.index;
  if (index.read)
    out += printf_string(" (%lld items, %s, %lld-d)", static_cast<long long>(index.count), index.type.c_str(),
                         static_cast<long long>(index.dim));
  return out;
}

// Why experts carry numbers rather than names, when they do.
std::string expert_names_note(const AdapterInfo& adapter) {
  if (!adapter.read) return "Experts are shown by number (no adapter config given: --adapter DIR).";
  if (adapter.names.empty())
    return "The adapter config names no experts (it has no \"expert_names\" list), so they are shown by number: "
           "each is one of the adapter's " +
           std::to_string(adapter.experts) + " learned experts, not a hand-made category.";
  return "Expert names come from the adapter config's \"expert_names\".";
}

void print_table(const std::vector<Query>& queries, const AdapterInfo& adapter, const IndexInfo& index) {
  const Served served = served_by(queries);
  std::printf("encoder %s, adapter %s, index %s\n%s\n", served.encoder.c_str(), adapter_text(served, adapter).c_str(),
              index_text(served, index).c_str(), expert_names_note(adapter).c_str());
  for (const Query& q : queries) {
    std::printf("\n%s  %s\n", q.text.empty() ? "image" : "text ",
                q.text.empty() ? q.image.c_str() : ("\"" + q.text + "\"").c_str());
    if (!q.result) {
      std::printf("  (no answer)\n");
      continue;
    }
    JsonObject* doc = json_node_get_object(q.result);
    if (g_strcmp0(str_or(doc, "type", ""), "error") == 0) {
      JsonObject* e = json_object_get_object_member(doc, "error");
      std::printf("  error in %s: %s [%s]\n", str_or(e, "stage", "?"), str_or(e, "reason", "?"),
                  str_or(e, "code", "?"));
      continue;
    }
    std::printf("  latency: %s\n  experts: %s\n  %-4s %-7s %s\n", latency_text(doc).c_str(),
                experts_text(doc, adapter).c_str(), "rank", "score", "caption");
    JsonArray* results = json_object_get_array_member(doc, "results");
    for (guint i = 0; i < json_array_get_length(results); ++i) {
      JsonObject* r = json_array_get_object_element(results, i);
      std::printf("  %-4lld %-7.3f %s\n", static_cast<long long>(json_object_get_int_member(r, "rank")),
                  json_object_get_double_member(r, "score"), str_or(r, "caption", str_or(r, "uri", "")));
    }
  }
}

void write_html(const std::vector<Query>& queries, const std::string& path, const AdapterInfo& adapter,
                const IndexInfo& index) {
  const Served served = served_by(queries);
  std::ofstream out(path);
  out << "<!doctype html><html><head><meta charset=\"utf-8\"><title>gst-moe search demo</title><style>"
         "body{font-family:sans-serif;margin:2em;background:#fafafa}h2{margin-top:1.6em;font-size:1.1em}"
         ".row{display:flex;gap:12px;flex-wrap:wrap}.hit{width:110px;font-size:11px;text-align:center}"
         ".hit img,.q img{width:96px;height:96px;object-fit:contain;image-rendering:pixelated;border:1px solid "
         "#ccc;background:#fff}"
         ".meta{color:#666;font-size:12px}table.served td{padding:2px 12px 2px 0}</style></head><body>"
         "<h1>gst-moe search demo</h1>"
         "<p class=\"meta\">Each query went through the query pipeline (zmq-query → moe-encode → moe-route → "
         "moe-expert → "
         "ann-query → zmq-publish); results are the catalog items nearest to the adapted embedding.</p>\n";
  out << "<table class=\"served\"><tr><td>Encoder</td><td>" << html_escape(served.encoder)
      << "</td></tr><tr><td>Adapter</td><td>" << html_escape(adapter_text(served, adapter))
      << "</td></tr><tr><td>Index</td><td>" << html_escape(index_text(served, index)) << "</td></tr></table>\n"
      << "<p class=\"meta\">" << html_escape(expert_names_note(adapter)) << "</p>\n";
  for (const Query& q : queries) {
    out << "<h2>";
    if (!q.text.empty())
      out << "“" << html_escape(q.text) << "”";
    else
      out << "image query <span class=\"q\"><img src=\"" << data_uri(q.image) << "\"></span>";
    out << "</h2>\n";
    if (!q.result) {
      out << "<p>(no answer)</p>\n";
      continue;
    }
    JsonObject* doc = json_node_get_object(q.result);
    if (g_strcmp0(str_or(doc, "type", ""), "error") == 0) {
      out << "<p>error: " << html_escape(str_or(json_object_get_object_member(doc, "error"), "reason", "?"))
          << "</p>\n";
      continue;
    }
    out << "<p class=\"meta\">latency " << html_escape(latency_text(doc)) << " · experts "
        << html_escape(experts_text(doc, adapter)) << "</p><div class=\"row\">";
    JsonArray* results = json_object_get_array_member(doc, "results");
    for (guint i = 0; i < json_array_get_length(results); ++i) {
      JsonObject* r = json_array_get_object_element(results, i);
      char score[32];
      std::snprintf(score, sizeof score, "%.3f", json_object_get_double_member(r, "score"));
      out << "<div class=\"hit\"><img src=\"" << data_uri(str_or(r, "uri", "")) << "\"><br>" << score << "<br>"
          << html_escape(str_or(r, "caption", "")) << "</div>";
    }
    out << "</div>\n";
  }
  out << "</body></html>\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::string requests = "tcp://127.0.0.1:5555", results = "tcp://127.0.0.1:5556", html, adapter_dir, index_path;
  int k = 5;
  std::vector<Query> queries;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--requests")
      requests = v;
    else if (a == "--results")
      results = v;
    else if (a == "--k")
      k = std::atoi(v.c_str());
    else if (a == "--html")
      html = v;
    else if (a == "--adapter")
      adapter_dir = v;
    else if (a == "--index")
      index_path = v;
    else if (a == "--text")
      queries.push_back({"q" + std::to_string(queries.size()), v, "", nullptr});
    else if (a == "--image")
      queries.push_back({"q" + std::to_string(queries.size()), "", v, nullptr});
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub), push(ctx, zmq::socket_type::push);
  sub.set(zmq::sockopt::subscribe, "");
  sub.connect(results);
  push.set(zmq::sockopt::linger, 1000);
  push.connect(requests);

  // PUB/SUB joins asynchronously: probe until the service answers, so no result is missed.
  JsonParser* parser = json_parser_new();
  bool connected = false;
  for (int attempt = 0; attempt < 120 && !connected; ++attempt) {
    const std::string probe = R"({"id": "probe-)" + std::to_string(attempt) + R"(", "text": "probe"})";
    push.send(zmq::buffer(probe), zmq::send_flags::none);
    zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(500)) > 0) {
      zmq::message_t m;
      connected = sub.recv(m, zmq::recv_flags::none).has_value();
    }
  }
  if (!connected) {
    std::fprintf(stderr, "no answer from the service at %s / %s\n", requests.c_str(), results.c_str());
    return 1;
  }

  std::map<std::string, Query*> by_id;
  for (Query& q : queries) {
    by_id[q.id] = &q;
    JsonBuilder* b = json_builder_new();
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "id");
    json_builder_add_string_value(b, q.id.c_str());
    json_builder_set_member_name(b, "k");
    json_builder_add_int_value(b, k);
    json_builder_set_member_name(b, q.text.empty() ? "image" : "text");
    json_builder_add_string_value(b, q.text.empty() ? q.image.c_str() : q.text.c_str());
    json_builder_end_object(b);
    JsonNode* root = json_builder_get_root(b);
    gchar* text = json_to_string(root, FALSE);
    push.send(zmq::buffer(std::string(text)), zmq::send_flags::none);
    g_free(text);
    json_node_unref(root);
    g_object_unref(b);
  }
  size_t answered = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (answered < queries.size() && std::chrono::steady_clock::now() < deadline) {
    zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(200)) <= 0) continue;
    zmq::message_t m;
    if (!sub.recv(m, zmq::recv_flags::none)) continue;
    if (!json_parser_load_from_data(parser, static_cast<const char*>(m.data()), static_cast<gssize>(m.size()), nullptr))
      continue;
    JsonNode* root = json_parser_get_root(parser);
    if (!JSON_NODE_HOLDS_OBJECT(root)) continue;
    auto it = by_id.find(str_or(json_node_get_object(root), "id", ""));
    if (it == by_id.end() || it->second->result) continue;
    it->second->result = json_node_copy(root);
    ++answered;
  }
  g_object_unref(parser);
  const AdapterInfo adapter = adapter_dir.empty() ? AdapterInfo() : read_adapter(adapter_dir);
  const IndexInfo index = index_path.empty() ? IndexInfo() : read_index(index_path);
  print_table(queries, adapter, index);
  if (!html.empty()) {
    write_html(queries, html, adapter, index);
    std::printf("\nHTML page with thumbnails: %s\n", html.c_str());
  }
  for (Query& q : queries)
    if (q.result) json_node_unref(q.result);
  return answered == queries.size() ? 0 : 1;
}
