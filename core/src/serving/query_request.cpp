#include "moe/query_request.h"

#include <fcntl.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <memory>

#include "moe/json_bounds.h"

namespace moe {

namespace {

std::string quote(const std::string& s) { return "'" + s + "'"; }

const char* json_type_name(JsonNode* node) {
  switch (JSON_NODE_TYPE(node)) {
    case JSON_NODE_OBJECT:
      return "an object";
    case JSON_NODE_ARRAY:
      return "an array";
    case JSON_NODE_NULL:
      return "null";
    case JSON_NODE_VALUE:
      break;
  }
  const GType type = json_node_get_value_type(node);
  if (type == G_TYPE_STRING) return "a string";
  if (type == G_TYPE_BOOLEAN) return "a boolean";
  if (type == G_TYPE_DOUBLE) return "a fractional number";
  return "an integer";
}

// The JSON text of `node`, clipped: how an id of the wrong type is still echoed back, so that the
// client can tell which request was refused.
std::string json_text(JsonNode* node) {
  std::unique_ptr<gchar, decltype(&g_free)> text(json_to_string(node, FALSE), g_free);
  return clip_utf8(text.get(), kMaxQueryIdBytes);
}

class RequestParser {
 public:
  RequestParser(const QueryLimits& limits) : limits_(limits) {}

  QueryRequest parse(std::string_view message) {
    if (message.empty()) reject("request is empty");
    const gchar* bad = nullptr;
    if (!g_utf8_validate(message.data(), static_cast<gssize>(message.size()), &bad))
      reject("request is not valid UTF-8 (byte offset " + std::to_string(bad - message.data()) + ")");
    // Depth and size first: beyond them JSON-GLib must not run. Integers beyond 64 bits are
    // safe to parse (JSON-GLib wraps them), so they are refused once the id is known.
    const JsonBounds shape{SIZE_MAX, kMaxRequestJsonDepth, kMaxRequestJsonValues, false};
    std::string violation = json_bounds_violation(message, shape);
    if (!violation.empty()) reject("request is refused: " + violation);

    std::unique_ptr<JsonParser, decltype(&g_object_unref)> parser(json_parser_new(), g_object_unref);
    GError* error = nullptr;
    if (!json_parser_load_from_data(parser.get(), message.data(), static_cast<gssize>(message.size()), &error)) {
      const std::string reason = std::string("request is not valid JSON: ") + error->message;
      g_error_free(error);
      reject(reason);
    }
    JsonNode* root = json_parser_get_root(parser.get());
    if (!root || !JSON_NODE_HOLDS_OBJECT(root)) reject("request is not a JSON object");
    object_ = json_node_get_object(root);

    violation = json_bounds_violation(message, JsonBounds{SIZE_MAX, INT_MAX});
    if (!violation.empty()) {
      // A string id is still echoed (an integer one may be the wrapped number).
      JsonNode* id = json_object_get_member(object_, "id");
      if (id && JSON_NODE_HOLDS_VALUE(id) && json_node_get_value_type(id) == G_TYPE_STRING)
        request_.id = clip_utf8(json_node_get_string(id), kMaxQueryIdBytes);
      reject("request is refused: " + violation);
    }
    read_id();
    read_op();
    request_.k = bounded_int("k", kMinQueryK, kMaxQueryK);
    request_.nprobe = bounded_int("nprobe", 1, kMaxQueryNprobe);
    request_.ef_search = bounded_int("ef_search", 1, kMaxQueryEfSearch);
    read_filter();
    if (request_.op == QueryOp::Delete) {
      read_delete();
      return std::move(request_);
    }
    refuse_member("items", "names the ids of a delete: add \"op\": \"delete\"");
    if (request_.op == QueryOp::Search)
      refuse_member("item", "describes the item of an upsert: add \"op\": \"upsert\"");
    // The service embeds an item with its own models, so that the index's vectors keep one provenance.
    if (request_.op == QueryOp::Upsert)
      refuse_member("vector", "is not taken: an upsert sends its item's text or image, which the service embeds");
    read_modality();
    read_query();
    if (request_.op == QueryOp::Upsert) read_item();
    return std::move(request_);
  }

 private:
  [[noreturn]] void reject(std::string reason, const char* code = error_code::kInvalidRequest) {
    echo_query();
    throw QueryRejected(std::move(reason), std::move(request_), code);
  }

  // The query members: "text", and "image" or "image_base64", each within its bound. Sizes are
  // checked before a value is kept: a refused request's record is echoed back.
  void read_query() {
    if (json_object_has_member(object_, "text")) {
      std::string text = string_member("text", "a string");
      if (text.size() > limits_.max_text_bytes)
        reject("text is " + std::to_string(text.size()) + " bytes, more than max-text-bytes (" +
                   std::to_string(limits_.max_text_bytes) + ")",
               error_code::kTextTooLong);
      request_.text = std::move(text);
    }
    if (json_object_has_member(object_, "image")) {
      std::string image = string_member("image", "a string (a path or a file:// uri)");
      if (image.size() > kMaxQueryImagePathBytes)
        reject("image is " + std::to_string(image.size()) + " bytes, longer than a path may be (" +
               std::to_string(kMaxQueryImagePathBytes) + ")");
      request_.image = std::move(image);
    } else if (json_object_has_member(object_, "image_base64")) {
      request_.image_bytes = decode_base64(string_member("image_base64", "a string"));
    }
  }

  // A refused request still echoes its query (clipped), so that the client can tell which one it
  // was: its text and image string members, whichever check refused it. Its modality is what
  // read_modality found, else what the echoes show.
  void echo_query() {
    if (object_ == nullptr) return;
    for (const char* name : {"text", "image"}) {
      std::string& echo = g_str_equal(name, "text") ? request_.text : request_.image;
      JsonNode* node = json_object_get_member(object_, name);
      if (!echo.empty() || !node || !JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_STRING)
        continue;
      echo = clip_utf8(json_node_get_string(node), kMaxEchoedQueryBytes);
    }
    if (modality_known_) return;
    if (!request_.image.empty())
      request_.modality = request_.text.empty() ? QueryModality::Image : QueryModality::Hybrid;
  }

  // The value of member `name`, rejected unless it is a non-empty string.
  std::string string_member(const char* name, const char* expected) {
    JsonNode* node = json_object_get_member(object_, name);
    if (!JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_STRING)
      reject(std::string(name) + " must be " + expected + " (got " + json_type_name(node) + ")");
    std::string value = json_node_get_string(node);
    if (value.empty()) reject(std::string(name) + " is empty");
    return value;
  }

  void read_id() {
    JsonNode* id = json_object_get_member(object_, "id");
    if (!id) reject("id is missing");
    const bool string = JSON_NODE_HOLDS_VALUE(id) && json_node_get_value_type(id) == G_TYPE_STRING;
    const bool integer = JSON_NODE_HOLDS_VALUE(id) && json_node_get_value_type(id) == G_TYPE_INT64;
    if (!string && !integer) {
      // Echoed as its JSON text, so that the answer still names it.
      request_.id = json_text(id);
      reject(std::string("id must be a string or an integer (got ") + json_type_name(id) + ")");
    }
    if (integer) {
      request_.id = std::to_string(json_node_get_int(id));
      return;
    }
    const std::string value = json_node_get_string(id);
    request_.id = clip_utf8(value, kMaxQueryIdBytes);
    if (value.empty()) reject("id is empty");
    if (value.size() > kMaxQueryIdBytes)
      reject("id is " + std::to_string(value.size()) + " bytes, more than " + std::to_string(kMaxQueryIdBytes));
  }

  // "op": absent or "search" (a search), "upsert" or "delete".
  void read_op() {
    JsonNode* node = json_object_get_member(object_, "op");
    if (!node) return;
    if (!JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_STRING)
      reject(std::string("op must be a string: search, upsert or delete (got ") + json_type_name(node) + ")");
    const std::string op = json_node_get_string(node);
    if (op == "upsert")
      request_.op = QueryOp::Upsert;
    else if (op == "delete")
      request_.op = QueryOp::Delete;
    else if (op != "search")
      reject("op " + quote(clip_utf8(op, kMaxFilterNameBytes)) + " is not an operation of this service (search, " +
                 "upsert, delete)",
             error_code::kUnsupportedOp);
  }

  // Refuses member `name` when present: it belongs to another operation (most likely "op" is
  // missing or wrong), and ignoring it would do something else than the client meant.
  void refuse_member(const char* name, const std::string& why) {
    if (json_object_has_member(object_, name)) reject(std::string(name) + " " + why);
  }

  // A search has text, an image (path or bytes) or both (a hybrid); an upsert, text or an image.
  void read_modality() {
    const bool text = json_object_has_member(object_, "text");
    const bool image = json_object_has_member(object_, "image");
    const bool base64 = json_object_has_member(object_, "image_base64");
    if (image && base64) reject("request has both image and image_base64: send the image once");
    const bool upsert = request_.op == QueryOp::Upsert;
    if (!text && !image && !base64)
      reject(std::string("request needs text, image or image_base64") + (upsert ? "" : " (or text with an image)") +
             "; it has none");
    if (upsert && text && (image || base64))
      reject("an upsert's item is embedded from its text or its image, not both (a hybrid query is no catalog item)");
    request_.modality = !text ? QueryModality::Image : image || base64 ? QueryModality::Hybrid : QueryModality::Text;
    modality_known_ = true;
  }

  // A string within `max_bytes`, named `what` in the reasons; empty is refused unless `may_be_empty`.
  std::string bounded_string(JsonNode* node, const std::string& what, size_t max_bytes, bool may_be_empty = false) {
    if (!JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_STRING)
      reject(what + " must be a string (got " + json_type_name(node) + ")");
    std::string value = json_node_get_string(node);
    if (value.empty() && !may_be_empty) reject(what + " is empty");
    if (value.size() > max_bytes)
      reject(what + " is " + std::to_string(value.size()) + " bytes, more than " + std::to_string(max_bytes));
    return value;
  }

  // An upsert's "item": {"id": "sku-9", "caption": "...", "uri": "...", "fields": {...}}; only the id
  // is required. Other members are refused: catalog fields go in "fields", kept as its compact text.
  void read_item() {
    JsonNode* node = json_object_get_member(object_, "item");
    if (!node) reject("item is missing: an upsert describes its catalog item in \"item\": {\"id\": ...}");
    if (!JSON_NODE_HOLDS_OBJECT(node)) reject(std::string("item must be an object (got ") + json_type_name(node) + ")");
    JsonObject* item = json_node_get_object(node);
    std::unique_ptr<GList, decltype(&g_list_free)> names(json_object_get_members(item), g_list_free);
    for (GList* name = names.get(); name != nullptr; name = name->next) {
      const char* member = static_cast<const char*>(name->data);
      JsonNode* value = json_object_get_member(item, member);
      if (g_str_equal(member, "id")) {
        request_.item.id = bounded_string(value, "item.id", kMaxItemIdBytes);
      } else if (g_str_equal(member, "caption")) {
        request_.item.caption = bounded_string(value, "item.caption", kMaxItemCaptionBytes, true);
      } else if (g_str_equal(member, "uri")) {
        request_.item.uri = bounded_string(value, "item.uri", kMaxItemUriBytes, true);
      } else if (g_str_equal(member, "fields")) {
        if (!JSON_NODE_HOLDS_OBJECT(value))
          reject(std::string("item.fields must be an object (got ") + json_type_name(value) + ")");
        if (json_object_get_size(json_node_get_object(value)) == 0) continue;  // none, as in the item table
        std::unique_ptr<gchar, decltype(&g_free)> text(json_to_string(value, FALSE), g_free);
        request_.item.fields = text.get();
        if (request_.item.fields.size() > kMaxItemFieldsBytes)
          reject("item.fields is " + std::to_string(request_.item.fields.size()) + " bytes of JSON, more than " +
                 std::to_string(kMaxItemFieldsBytes));
      } else {
        reject("item." + clip_utf8(member, kMaxFilterNameBytes) +
               " is not a member of an item (id, caption, uri, fields): put catalog fields in item.fields");
      }
    }
    if (request_.item.id.empty()) reject("item.id is missing: an item needs its catalog id");
  }

  // A delete's "items": the catalog ids to delete, 1 to kMaxDeleteItems strings. It carries no query.
  void read_delete() {
    for (const char* name : {"text", "image", "image_base64", "item", "vector"})
      refuse_member(name, "is not part of a delete, which names the catalog ids to delete in \"items\"");
    JsonNode* node = json_object_get_member(object_, "items");
    if (!node) reject("items is missing: a delete names the catalog ids to delete in \"items\": [\"sku-9\", ...]");
    if (!JSON_NODE_HOLDS_ARRAY(node))
      reject(std::string("items must be an array of catalog ids (got ") + json_type_name(node) + ")");
    JsonArray* ids = json_node_get_array(node);
    const guint count = json_array_get_length(ids);
    if (count == 0) reject("items is empty: name at least one catalog id");
    if (count > kMaxDeleteItems)
      reject("items names " + std::to_string(count) + " ids, more than " + std::to_string(kMaxDeleteItems) +
                 " (send them in several deletes)",
             error_code::kTooManyItems);
    request_.item_ids.reserve(count);
    for (guint i = 0; i < count; ++i)
      request_.item_ids.push_back(
          bounded_string(json_array_get_element(ids, i), "items[" + std::to_string(i) + "]", kMaxItemIdBytes));
  }

  // Member `name`, an integer from `min` to `max`; 0 when it is absent.
  int bounded_int(const char* name, int min, int max) {
    JsonNode* node = json_object_get_member(object_, name);
    if (!node) return 0;
    const bool integer = JSON_NODE_HOLDS_VALUE(node) && json_node_get_value_type(node) == G_TYPE_INT64;
    const std::string range =
        std::string(name) + " must be an integer from " + std::to_string(min) + " to " + std::to_string(max);
    if (!integer) reject(range + " (got " + json_type_name(node) + ")");
    const gint64 value = json_node_get_int(node);
    if (value < min || value > max) reject(range + " (got " + std::to_string(value) + ")");
    return static_cast<int>(value);
  }

  // "filter": {"field": value, "field": {"in": [values]}, "field": {"gte": x, "lt": y}, ...}; every
  // condition must hold. Values are strings, numbers or booleans; bounds are numbers.
  void read_filter() {
    JsonNode* node = json_object_get_member(object_, "filter");
    if (!node) return;
    if (!JSON_NODE_HOLDS_OBJECT(node))
      reject(std::string("filter must be an object of field conditions (got ") + json_type_name(node) + ")");
    JsonObject* filter = json_node_get_object(node);
    if (json_object_get_size(filter) > kMaxFilterFields)
      reject("filter has " + std::to_string(json_object_get_size(filter)) + " fields, more than " +
             std::to_string(kMaxFilterFields));
    // In the request's order (json_object_get_members keeps it), so that messages name the first.
    std::unique_ptr<GList, decltype(&g_list_free)> names(json_object_get_members(filter), g_list_free);
    for (GList* name = names.get(); name != nullptr; name = name->next) {
      const char* field = static_cast<const char*>(name->data);
      request_.filter.all_of.push_back(read_condition(field, json_object_get_member(filter, field)));
    }
  }

  AnnFilterCondition read_condition(const std::string& name, JsonNode* node) {
    const std::string what = "filter." + clip_utf8(name, kMaxFilterNameBytes);
    if (name.empty()) reject("filter has a field with an empty name");
    if (name.size() > kMaxFilterNameBytes)
      reject(what + ": the field name is " + std::to_string(name.size()) + " bytes, more than " +
             std::to_string(kMaxFilterNameBytes));
    AnnFilterCondition condition{name};
    if (!JSON_NODE_HOLDS_OBJECT(node)) {
      condition.any_of.push_back(field_value(what, node));
      return condition;
    }
    JsonObject* ops = json_node_get_object(node);
    if (json_object_get_size(ops) == 0) reject(what + ": an empty condition (use in, gt, gte, lt or lte)");
    std::unique_ptr<GList, decltype(&g_list_free)> names(json_object_get_members(ops), g_list_free);
    for (GList* name = names.get(); name != nullptr; name = name->next) {
      const char* op = static_cast<const char*>(name->data);
      JsonNode* operand = json_object_get_member(ops, op);
      const std::string op_what = what + "." + clip_utf8(op, kMaxFilterNameBytes);
      if (g_str_equal(op, "in")) {
        if (!JSON_NODE_HOLDS_ARRAY(operand))
          reject(op_what + " must be an array of values (got " + json_type_name(operand) + ")");
        JsonArray* values = json_node_get_array(operand);
        if (json_array_get_length(values) > kMaxFilterSetValues)
          reject(op_what + " has " + std::to_string(json_array_get_length(values)) + " values, more than " +
                 std::to_string(kMaxFilterSetValues));
        for (guint i = 0; i < json_array_get_length(values); ++i)
          condition.any_of.push_back(
              field_value(op_what + "[" + std::to_string(i) + "]", json_array_get_element(values, i)));
        continue;
      }
      std::optional<double>* bound = g_str_equal(op, "gt")    ? &condition.gt
                                     : g_str_equal(op, "gte") ? &condition.gte
                                     : g_str_equal(op, "lt")  ? &condition.lt
                                     : g_str_equal(op, "lte") ? &condition.lte
                                                              : nullptr;
      if (!bound)
        reject(what + ": unknown operator " + quote(clip_utf8(op, kMaxFilterNameBytes)) +
               " (use in, gt, gte, lt, lte)");
      const AnnFieldValue number = field_value(op_what, operand);
      if (!std::holds_alternative<double>(number))
        reject(op_what + " must be a number (got " + json_type_name(operand) + ")");
      *bound = std::get<double>(number);
    }
    if (json_object_has_member(ops, "in") && condition.is_range())
      reject(what + ": \"in\" cannot be combined with a range (gt, gte, lt, lte)");
    return condition;
  }

  // A value a field is compared with: a string (up to kMaxFilterStringBytes), a number or a boolean.
  AnnFieldValue field_value(const std::string& what, JsonNode* node) {
    const GType type = JSON_NODE_HOLDS_VALUE(node) ? json_node_get_value_type(node) : G_TYPE_INVALID;
    if (type == G_TYPE_STRING) {
      std::string value = json_node_get_string(node);
      if (value.size() > kMaxFilterStringBytes)
        reject(what + " is " + std::to_string(value.size()) + " bytes, more than " +
               std::to_string(kMaxFilterStringBytes));
      return value;
    }
    if (type == G_TYPE_BOOLEAN) return static_cast<bool>(json_node_get_boolean(node));
    if (type == G_TYPE_INT64 || type == G_TYPE_DOUBLE) {
      const double value = json_node_get_double(node);
      if (!std::isfinite(value)) reject(what + " is not a finite number");
      return value;
    }
    reject(what + " must be a string, a number or a boolean (got " + json_type_name(node) + ")");
  }

  // Decodes base64 (standard alphabet, '=' padding; whitespace such as the line breaks of
  // base64(1) output is ignored). g_base64_decode skips invalid characters silently, so the
  // text is checked first.
  std::vector<uint8_t> decode_base64(const std::string& text) {
    const std::string what = "image_base64 is not valid base64: ";
    std::string compact;
    compact.reserve(text.size());
    size_t padding = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const char c = text[i];
      if (g_ascii_isspace(c)) continue;
      if (c == '=') {
        ++padding;
      } else if (g_ascii_isalnum(c) || c == '+' || c == '/') {
        if (padding > 0) reject(what + "'=' padding before the end (offset " + std::to_string(i) + ")");
      } else {
        reject(what + "unexpected character " + quote(std::string(1, c)) + " at offset " + std::to_string(i));
      }
      compact.push_back(c);
    }
    if (compact.empty()) reject("image_base64 is empty");
    if (compact.size() % 4 != 0 || padding > 2)
      reject(what + "its length without whitespace (" + std::to_string(compact.size()) +
             ") is not a multiple of 4 or it has more than two '=' at the end");
    const uint64_t decoded = compact.size() / 4 * 3 - padding;
    if (decoded > limits_.max_image_bytes)
      reject("image_base64 decodes to " + std::to_string(decoded) + " bytes, more than max-image-bytes (" +
                 std::to_string(limits_.max_image_bytes) + ")",
             error_code::kImageTooLarge);
    gsize size = 0;
    std::unique_ptr<guchar, decltype(&g_free)> data(g_base64_decode(compact.c_str(), &size), g_free);
    return std::vector<uint8_t>(data.get(), data.get() + size);
  }

  const QueryLimits& limits_;
  QueryRequest request_;
  JsonObject* object_ = nullptr;
  bool modality_known_ = false;  // read_modality ran
};

// An image file the service does not serve: outside image-root, missing, unreadable, not a file.
class Unavailable : public RequestRefused {
 public:
  explicit Unavailable(std::string reason) : RequestRefused(std::move(reason), error_code::kImageUnavailable) {}
};

// True if the canonical `path` is `root` (canonical) or lies under it.
bool is_within(const std::string& path, const std::string& root) {
  return path.compare(0, root.size(), root) == 0 &&
         (path.size() == root.size() || root.back() == '/' || path[root.size()] == '/');
}

// The local path an "image" value names: a path, or a file:// uri.
std::string image_path(const std::string& image) {
  if (image.find("://") == std::string::npos) return image;
  if (image.rfind("file://", 0) != 0)
    throw RequestRefused("image " + quote(image) + " is neither a local path nor a file:// uri",
                         error_code::kInvalidRequest);
  GError* error = nullptr;
  gchar* path = g_filename_from_uri(image.c_str(), nullptr, &error);
  if (!path) {
    const std::string reason = "image " + quote(image) + " is not a valid file:// uri: " + error->message;
    g_error_free(error);
    throw RequestRefused(reason, error_code::kInvalidRequest);
  }
  std::string result = path;
  g_free(path);
  return result;
}

// The canonical path of the file `path` names (the "image" value `image` as a local path),
// refused unless it lies inside `root`. Relative paths are taken from the root, and resolving
// ".." and symlinks before the check means neither can lead out of it.
std::string confine_to_root(const std::string& image, const std::string& path, const std::string& root) {
  const std::string outside = "image " + quote(image) + " is outside image-root";
  const std::string full = g_path_is_absolute(path.c_str()) ? path : root + G_DIR_SEPARATOR_S + path;
  if (char* real = realpath(full.c_str(), nullptr)) {
    const std::string resolved = real;
    free(real);
    if (!is_within(resolved, root)) throw Unavailable(outside);
    return resolved;
  }
  const int error = errno;
  // It does not resolve (a missing file or folder, a broken symlink, no permission): its nearest
  // ancestor that exists (a symlink counts as existing) tells whether the failure happened inside
  // the root. That ancestor must resolve inside the root for the real reason to be given; one that
  // does not resolve is a broken symlink whose target is unknown, so it counts as outside.
  std::string existing = full;
  GStatBuf st;
  while (g_lstat(existing.c_str(), &st) != 0) {
    gchar* parent = g_path_get_dirname(existing.c_str());
    existing = parent;
    g_free(parent);
  }
  char* real = realpath(existing.c_str(), nullptr);
  const bool inside = real && is_within(real, root);
  free(real);
  if (!inside) throw Unavailable(outside);
  throw Unavailable("image " + quote(image) + " cannot be read: " + g_strerror(error));
}

}  // namespace

std::string clip_utf8(const std::string& text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end) + "...";
}

QueryRequest parse_query_request(std::string_view message, const QueryLimits& limits) {
  return RequestParser(limits).parse(message);
}

std::vector<uint8_t> read_query_image_file(const std::string& image, const std::string& root, uint64_t max_bytes) {
  const std::string path = confine_to_root(image, image_path(image), root);
  const std::string what = "image " + quote(image);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) throw Unavailable(what + " cannot be read: " + g_strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  // What was opened must lie inside the root: a component swapped for a symlink after
  // confine_to_root would show here.
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  char* opened = realpath(link.c_str(), nullptr);
  const bool inside = opened && is_within(opened, root);
  free(opened);
  if (!inside) throw Unavailable(what + " is outside image-root");
  struct stat st;
  if (fstat(fd, &st) != 0) throw Unavailable(what + " cannot be read: " + g_strerror(errno));
  if (!S_ISREG(st.st_mode)) throw Unavailable(what + " is not a regular file");
  auto check_size = [&](uint64_t size) {
    if (size == 0) throw Unavailable(what + " is empty");
    if (size > max_bytes)
      throw RequestRefused(what + " is " + std::to_string(size) + " bytes, more than max-image-bytes (" +
                               std::to_string(max_bytes) + ")",
                           error_code::kImageTooLarge);
  };
  check_size(static_cast<uint64_t>(st.st_size));
  // Read to the end, but never past max_bytes + 1 (the file may grow while it is read).
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size) + 1);
  size_t got = 0;
  for (;;) {
    if (got == bytes.size()) {
      if (bytes.size() > max_bytes) break;
      bytes.resize(std::min<size_t>(bytes.size() * 2, static_cast<size_t>(max_bytes) + 1));
    }
    const ssize_t n = read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Unavailable(what + " cannot be read: " + g_strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  check_size(bytes.size());
  return bytes;
}

}  // namespace moe
