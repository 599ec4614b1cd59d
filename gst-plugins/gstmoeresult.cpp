#include "gstmoeresult.h"

#include <json-glib/json-glib.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <utility>

#include "moe/moe_layer.h"
#include "moe/query_request.h"

namespace gstmoe {

namespace {

// Rounds to `decimals` places: scores and weights keep 6 (well below float noise in cosine
// similarities), milliseconds keep 3 (microseconds).
double rounded(double v, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

// JSON text must be UTF-8: invalid bytes (a caption from a file name in another encoding)
// become U+FFFD rather than making the whole document unreadable.
void add_string(JsonBuilder* b, const std::string& value) {
  if (g_utf8_validate(value.data(), static_cast<gssize>(value.size()), nullptr)) {
    json_builder_add_string_value(b, value.c_str());
  } else {
    gchar* valid = g_utf8_make_valid(value.data(), static_cast<gssize>(value.size()));
    json_builder_add_string_value(b, valid);
    g_free(valid);
  }
}

void member_string(JsonBuilder* b, const char* key, const std::string& value) {
  json_builder_set_member_name(b, key);
  add_string(b, value);
}

void member_string_or_null(JsonBuilder* b, const char* key, const std::string& value) {
  json_builder_set_member_name(b, key);
  if (value.empty())
    json_builder_add_null_value(b);
  else
    add_string(b, value);
}

void member_number(JsonBuilder* b, const char* key, double value, int decimals) {
  json_builder_set_member_name(b, key);
  if (std::isfinite(value))
    json_builder_add_double_value(b, rounded(value, decimals));
  else
    json_builder_add_null_value(b);  // JSON has no NaN/Inf
}

void member_int(JsonBuilder* b, const char* key, int64_t value) {
  json_builder_set_member_name(b, key);
  json_builder_add_int_value(b, value);
}

bool is_number_char(char c) {
  return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
}

// JSON-GLib 1.6 writes every double with 17 significant digits ("0.83120000000000005"). This
// rewrites each non-integer number token outside strings in the shortest form that reads back
// as the same double ("0.8312"), so the rounding above shows on the wire.
std::string shortest_numbers(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  bool in_string = false;
  for (size_t i = 0; i < json.size();) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\' && i + 1 < json.size()) {
        out.append(json, i, 2);
        i += 2;
        continue;
      }
      in_string = c != '"';
      out += c;
      ++i;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t end = i;
      while (end < json.size() && is_number_char(json[end])) ++end;
      const std::string token = json.substr(i, end - i);
      if (token.find_first_of(".eE") == std::string::npos) {
        out += token;
      } else {
        char buf[32];
        const auto res = std::to_chars(buf, buf + sizeof buf, g_ascii_strtod(token.c_str(), nullptr));
        out.append(buf, res.ptr);
      }
      i = end;
    } else {
      in_string = c == '"';
      out += c;
      ++i;
    }
  }
  return out;
}

// Finishes the builder's document and returns it as compact text.
std::string generate(JsonBuilder* b) {
  JsonNode* root = json_builder_get_root(b);
  JsonGenerator* gen = json_generator_new();
  json_generator_set_root(gen, root);
  gchar* text = json_generator_to_data(gen, nullptr);
  std::string out = shortest_numbers(text);
  g_free(text);
  g_object_unref(gen);
  json_node_unref(root);
  g_object_unref(b);
  return out;
}

// The members every document starts with: schema, type.
void document_members(JsonBuilder* b, const char* type) {
  member_int(b, "schema", kResultSchema);
  member_string(b, "type", type);
}

// A catalog item's fields as an object member: {} when it has none (or they do not parse, which
// the item table's reader rules out).
void member_fields(JsonBuilder* b, const std::string& fields) {
  json_builder_set_member_name(b, "fields");
  JsonNode* node = fields.empty() ? nullptr : json_from_string(fields.c_str(), nullptr);
  if (node && JSON_NODE_HOLDS_OBJECT(node)) {
    json_builder_add_value(b, node);
    return;
  }
  if (node) json_node_unref(node);
  json_builder_begin_object(b);
  json_builder_end_object(b);
}

// The members every request document starts with: schema, type, id, modality, query, uri.
void request_members(JsonBuilder* b, const char* type, const RequestRecord& r) {
  document_members(b, type);
  member_string_or_null(b, "id", r.id);
  member_string(b, "modality", modality_name(r.modality));
  // Echoes are clipped: an answer goes to every subscriber, whatever a request carried.
  // A hybrid request carries both: its text and its image.
  const bool has_text = r.modality == Modality::Text || r.modality == Modality::Hybrid;
  const bool has_image = r.modality == Modality::Image || r.modality == Modality::Hybrid;
  member_string_or_null(b, "query", has_text ? moe::clip_utf8(r.text, moe::kMaxEchoedQueryBytes) : std::string());
  member_string_or_null(b, "uri", has_image ? moe::clip_utf8(r.uri, moe::kMaxEchoedQueryBytes) : std::string());
}

// Hybrid requests: how the image and the text embeddings were weighed into the query vector.
void fusion_member(JsonBuilder* b, const Fusion& fusion) {
  json_builder_set_member_name(b, "fusion");
  json_builder_begin_object(b);
  member_number(b, "image", fusion.image, 6);
  member_number(b, "text", fusion.text, 6);
  member_string(b, "method", fusion.method);
  json_builder_end_object(b);
}

void arrival_member(JsonBuilder* b, const RequestRecord& r) {
  member_string_or_null(b, "arrival_time", r.arrival_wall_us > 0 ? rfc3339_utc(r.arrival_wall_us) : std::string());
  // Video frames only: each frame's own time, not its batch's.
  if (GST_CLOCK_TIME_IS_VALID(r.pts)) member_int(b, "pts_ns", static_cast<int64_t>(r.pts));
  if (GST_CLOCK_TIME_IS_VALID(r.stream_time)) member_int(b, "stream_time_ns", static_cast<int64_t>(r.stream_time));
}

// "timings_ms": each stage's milliseconds, then "total" = arrival to `now_mono_us`. A stage recorded
// twice (e.g. two moe-expert elements) is summed: object keys must be unique.
void timings_member(JsonBuilder* b, const RequestRecord& r, int64_t now_mono_us) {
  std::vector<std::pair<std::string, double>> stages;
  for (const auto& [stage, ms] : r.timings_ms) {
    auto it = std::find_if(stages.begin(), stages.end(), [&](const auto& s) { return s.first == stage; });
    if (it == stages.end())
      stages.emplace_back(stage, ms);
    else
      it->second += ms;
  }
  json_builder_set_member_name(b, "timings_ms");
  json_builder_begin_object(b);
  for (const auto& [stage, ms] : stages)
    if (stage != "total") member_number(b, stage.c_str(), ms, 3);
  member_number(b, "total", elapsed_ms(r.arrival_mono_us, now_mono_us), 3);
  json_builder_end_object(b);
}

}  // namespace

std::string rfc3339_utc(int64_t wall_us) {
  const int64_t secs = wall_us / G_USEC_PER_SEC - (wall_us % G_USEC_PER_SEC < 0 ? 1 : 0);
  GDateTime* whole = g_date_time_new_from_unix_utc(secs);
  if (!whole) return std::string();
  GDateTime* dt = g_date_time_add(whole, wall_us - secs * G_USEC_PER_SEC);
  g_date_time_unref(whole);
  gchar* text = g_date_time_format(dt, "%Y-%m-%dT%H:%M:%S.%fZ");
  g_date_time_unref(dt);
  std::string out = text ? text : "";
  g_free(text);
  return out;
}

bool request_cost(const RequestRecord& r, RequestCost* cost) {
  if (r.batch_rows == 0) return false;
  const double rows = static_cast<double>(r.batch_rows);
  RequestCost c;
  double batch_ms = 0;
  for (const auto& [stage, ms] : r.timings_ms) {
    if (stage == "queue")
      c.wait_ms += ms;
    else
      batch_ms += ms;
  }
  c.copy_ms = r.batch_copy_wait_ms / rows;
  c.compute_ms = std::max(0.0, batch_ms / rows - c.copy_ms);
  c.expert_bytes = static_cast<double>(r.batch_expert_bytes) / rows;
  *cost = c;
  return true;
}

std::string result_document(const RequestRecord& r, int k, const std::vector<ResultHit>& hits, const ModelIds& model,
                            int64_t now_mono_us) {
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  request_members(b, "result", r);
  member_int(b, "k", k);

  json_builder_set_member_name(b, "results");
  json_builder_begin_array(b);
  for (size_t i = 0; i < hits.size(); ++i) {
    json_builder_begin_object(b);
    member_int(b, "rank", static_cast<int64_t>(i) + 1);
    member_int(b, "item", hits[i].item);
    member_string_or_null(b, "id", hits[i].id);
    member_string_or_null(b, "uri", hits[i].uri);
    member_string_or_null(b, "caption", hits[i].caption);
    member_number(b, "score", hits[i].score, 6);
    member_fields(b, hits[i].fields);
    json_builder_end_object(b);
  }
  json_builder_end_array(b);

  json_builder_set_member_name(b, "experts");
  json_builder_begin_array(b);
  for (size_t i = 0; i < r.experts.size(); ++i) {
    if (r.experts[i] == moe::Routing::kUnusedSlot) continue;  // a row routed to fewer experts
    json_builder_begin_object(b);
    member_int(b, "expert", r.experts[i]);
    member_number(b, "weight", i < r.expert_weights.size() ? r.expert_weights[i] : NAN, 6);
    json_builder_end_object(b);
  }
  json_builder_end_array(b);
  if (r.fusion) fusion_member(b, *r.fusion);

  json_builder_set_member_name(b, "model");
  json_builder_begin_object(b);
  member_string_or_null(b, "encoder", model.encoder);
  member_string_or_null(b, "adapter", model.adapter);
  member_string_or_null(b, "index", model.index);
  json_builder_end_object(b);

  timings_member(b, r, now_mono_us);

  json_builder_set_member_name(b, "cost");
  RequestCost cost;
  if (request_cost(r, &cost)) {
    json_builder_begin_object(b);
    member_number(b, "compute_ms", cost.compute_ms, 3);
    member_number(b, "copy_ms", cost.copy_ms, 3);
    member_number(b, "wait_ms", cost.wait_ms, 3);
    member_int(b, "expert_bytes_loaded", std::llround(cost.expert_bytes));
    member_int(b, "batch_rows", static_cast<int64_t>(r.batch_rows));
    json_builder_end_object(b);
  } else {
    json_builder_add_null_value(b);
  }

  arrival_member(b, r);
  json_builder_end_object(b);
  return generate(b);
}

std::string error_document(const FailedRequest& failed) {
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  request_members(b, "error", failed.request);
  json_builder_set_member_name(b, "error");
  json_builder_begin_object(b);
  member_string(b, "stage", failed.stage);
  member_string(b, "code", failed.code != nullptr ? failed.code : moe::error_code::kInternal);
  member_string(b, "reason", failed.reason);
  json_builder_end_object(b);
  arrival_member(b, failed.request);
  json_builder_end_object(b);
  return generate(b);
}

std::string update_document(const RequestRecord& r, const UpdateOutcome& outcome, int64_t now_mono_us) {
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  document_members(b, "update");
  member_string_or_null(b, "id", r.id);
  if (r.op == RequestOp::Upsert) {
    member_string(b, "op", "upsert");
    member_string(b, "item", r.item.id);
    member_int(b, "row", outcome.row);
    json_builder_set_member_name(b, "replaced");
    json_builder_add_boolean_value(b, outcome.replaced);
  } else {
    member_string(b, "op", "delete");
    member_int(b, "deleted", outcome.deleted);
    json_builder_set_member_name(b, "missing");
    json_builder_begin_array(b);
    for (const std::string& id : outcome.missing) add_string(b, id);
    json_builder_end_array(b);
  }
  member_string_or_null(b, "index", outcome.index);
  member_int(b, "items", outcome.items);
  timings_member(b, r, now_mono_us);
  arrival_member(b, r);
  json_builder_end_object(b);
  return generate(b);
}

std::string index_built_document(const std::string& index_path, int64_t items, int dim, const char* index_type,
                                 int64_t failed) {
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  document_members(b, "index-built");
  member_string(b, "index", index_path);
  member_int(b, "items", items);
  member_int(b, "dim", dim);
  member_string(b, "index_type", index_type);
  member_int(b, "failed", failed);
  json_builder_end_object(b);
  return generate(b);
}

}  // namespace gstmoe
