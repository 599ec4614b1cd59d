// Internal: thin RAII helpers over JSON-GLib for reading model files (config.json, vocab.json,
// safetensors headers). Not part of the public API.
#pragma once

#include <json-glib/json-glib.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe/json_bounds.h"

namespace moe::json {

// A parsed JSON document. `what` names its origin (a file path, "header of x.safetensors") and
// prefixes every error message. Text beyond `bounds` (size, nesting depth) is refused before
// JSON-GLib sees it, so that no file can exhaust the parsing thread's stack.
class Document {
 public:
  Document(std::string_view text, std::string what, const JsonBounds& bounds = kFileJsonBounds);
  // Refuses a file larger than bounds.max_bytes before reading it.
  static Document from_file(const std::string& path, const JsonBounds& bounds = kFileJsonBounds);
  ~Document();
  Document(const Document&) = delete;
  Document& operator=(const Document&) = delete;
  Document(Document&& other) noexcept;

  JsonNode* root() const;
  // The root as an object; throws when it is not one.
  JsonObject* root_object() const;
  const std::string& what() const { return what_; }

 private:
  JsonParser* parser_ = nullptr;
  std::string what_;
};

// Typed member access. `what` names the object for error messages ("config.json text_config").
bool has_member(JsonObject* obj, const char* key);
int64_t get_int(JsonObject* obj, const char* key, const std::string& what);
int64_t get_int_or(JsonObject* obj, const char* key, int64_t fallback, const std::string& what);
double get_double_or(JsonObject* obj, const char* key, double fallback, const std::string& what);
bool get_bool_or(JsonObject* obj, const char* key, bool fallback, const std::string& what);
std::string get_string(JsonObject* obj, const char* key, const std::string& what);
std::string get_string_or(JsonObject* obj, const char* key, const std::string& fallback, const std::string& what);
// Returns nullptr when the member is absent or null; throws when present but not an object.
JsonObject* get_object_or_null(JsonObject* obj, const char* key, const std::string& what);
std::vector<double> get_double_array_or(JsonObject* obj, const char* key, const std::vector<double>& fallback,
                                        const std::string& what);

}  // namespace moe::json
