#include "io/json_util.h"

#include <cmath>
#include <fstream>

#include "moe/error.h"

namespace moe::json {

Document::Document(std::string_view text, std::string what, const JsonBounds& bounds) : what_(std::move(what)) {
  const std::string violation = json_bounds_violation(text, bounds);
  if (!violation.empty()) throw Error(what_ + ": JSON refused: " + violation);
  parser_ = json_parser_new();
  GError* err = nullptr;
  if (!json_parser_load_from_data(parser_, text.data(), static_cast<gssize>(text.size()), &err)) {
    std::string msg = what_ + ": invalid JSON: " + (err ? err->message : "unknown error");
    if (err) g_error_free(err);
    g_object_unref(parser_);
    parser_ = nullptr;
    throw Error(msg);
  }
  if (json_parser_get_root(parser_) == nullptr) {
    g_object_unref(parser_);
    parser_ = nullptr;
    throw Error(what_ + ": empty JSON document");
  }
}

Document Document::from_file(const std::string& path, const JsonBounds& bounds) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(path + ": cannot open file");
  // The size first, so that a huge file is refused without being read.
  const std::streamoff size = in.tellg();
  if (size < 0) throw Error(path + ": cannot tell its size");
  if (static_cast<uint64_t>(size) > bounds.max_bytes)
    throw Error(path + ": JSON refused: " + std::to_string(size) + " bytes (at most " +
                std::to_string(bounds.max_bytes) + ")");
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  in.read(text.data(), size);
  if (in.gcount() != size) throw Error(path + ": read error");
  return Document(text, path, bounds);
}

Document::~Document() {
  if (parser_) g_object_unref(parser_);
}

Document::Document(Document&& other) noexcept : parser_(other.parser_), what_(std::move(other.what_)) {
  other.parser_ = nullptr;
}

JsonNode* Document::root() const { return json_parser_get_root(parser_); }

JsonObject* Document::root_object() const {
  JsonNode* node = root();
  if (!JSON_NODE_HOLDS_OBJECT(node)) throw Error(what_ + ": top level is not a JSON object");
  return json_node_get_object(node);
}

bool has_member(JsonObject* obj, const char* key) {
  return json_object_has_member(obj, key) && !JSON_NODE_HOLDS_NULL(json_object_get_member(obj, key));
}

static JsonNode* value_node(JsonObject* obj, const char* key, const std::string& what) {
  JsonNode* node = json_object_get_member(obj, key);
  if (!JSON_NODE_HOLDS_VALUE(node)) throw Error(what + ": field '" + key + "' is not a JSON scalar");
  return node;
}

int64_t get_int(JsonObject* obj, const char* key, const std::string& what) {
  if (!has_member(obj, key)) throw Error(what + ": missing field '" + key + "'");
  JsonNode* node = value_node(obj, key, what);
  GType t = json_node_get_value_type(node);
  if (t == G_TYPE_INT64) return json_node_get_int(node);
  if (t == G_TYPE_DOUBLE) {
    double d = json_node_get_double(node);
    if (std::floor(d) == d && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
  }
  throw Error(what + ": field '" + key + "' is not an integer");
}

int64_t get_int_or(JsonObject* obj, const char* key, int64_t fallback, const std::string& what) {
  return has_member(obj, key) ? get_int(obj, key, what) : fallback;
}

double get_double_or(JsonObject* obj, const char* key, double fallback, const std::string& what) {
  if (!has_member(obj, key)) return fallback;
  JsonNode* node = value_node(obj, key, what);
  GType t = json_node_get_value_type(node);
  if (t == G_TYPE_DOUBLE) return json_node_get_double(node);
  if (t == G_TYPE_INT64) return static_cast<double>(json_node_get_int(node));
  throw Error(what + ": field '" + key + "' is not a number");
}

bool get_bool_or(JsonObject* obj, const char* key, bool fallback, const std::string& what) {
  if (!has_member(obj, key)) return fallback;
  JsonNode* node = value_node(obj, key, what);
  if (json_node_get_value_type(node) != G_TYPE_BOOLEAN) throw Error(what + ": field '" + key + "' is not a boolean");
  return json_node_get_boolean(node);
}

std::string get_string(JsonObject* obj, const char* key, const std::string& what) {
  if (!has_member(obj, key)) throw Error(what + ": missing field '" + key + "'");
  JsonNode* node = value_node(obj, key, what);
  if (json_node_get_value_type(node) != G_TYPE_STRING) throw Error(what + ": field '" + key + "' is not a string");
  return json_node_get_string(node);
}

std::string get_string_or(JsonObject* obj, const char* key, const std::string& fallback, const std::string& what) {
  return has_member(obj, key) ? get_string(obj, key, what) : fallback;
}

JsonObject* get_object_or_null(JsonObject* obj, const char* key, const std::string& what) {
  if (!has_member(obj, key)) return nullptr;
  JsonNode* node = json_object_get_member(obj, key);
  if (!JSON_NODE_HOLDS_OBJECT(node)) throw Error(what + ": field '" + key + "' is not an object");
  return json_node_get_object(node);
}

std::vector<double> get_double_array_or(JsonObject* obj, const char* key, const std::vector<double>& fallback,
                                        const std::string& what) {
  if (!has_member(obj, key)) return fallback;
  JsonNode* node = json_object_get_member(obj, key);
  if (!JSON_NODE_HOLDS_ARRAY(node)) throw Error(what + ": field '" + key + "' is not an array");
  JsonArray* arr = json_node_get_array(node);
  std::vector<double> out;
  for (guint i = 0; i < json_array_get_length(arr); ++i) {
    JsonNode* el = json_array_get_element(arr, i);
    if (!JSON_NODE_HOLDS_VALUE(el)) throw Error(what + ": field '" + key + "' has a non-number");
    GType t = json_node_get_value_type(el);
    if (t == G_TYPE_DOUBLE)
      out.push_back(json_node_get_double(el));
    else if (t == G_TYPE_INT64)
      out.push_back(static_cast<double>(json_node_get_int(el)));
    else
      throw Error(what + ": field '" + key + "' has a non-number");
  }
  return out;
}

}  // namespace moe::json
