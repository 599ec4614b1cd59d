#include "moe/catalog.h"

#include <glib.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <utility>

#include "io/json_util.h"
#include "moe/error.h"

namespace moe {

namespace {

std::string take_string(gchar* s) {
  std::string out = s != nullptr ? s : "";
  g_free(s);
  return out;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// A catalog line's JSON error, worded as moe-catalog-src always worded it: "<where>: invalid JSON
// (<parser message>)", "<where>: not a JSON object" for an empty document; a refusal by the
// bounds check ("<where>: JSON refused: ...") as json::Document gives it.
std::string catalog_json_error(const std::string& message, const std::string& where) {
  const std::string invalid = where + ": invalid JSON: ";
  if (starts_with(message, invalid)) return where + ": invalid JSON (" + message.substr(invalid.size()) + ")";
  if (message == where + ": empty JSON document") return where + ": not a JSON object";
  return message;
}

// The compact JSON text of `node` (an object).
std::string json_text(JsonNode* node) { return take_string(json_to_string(node, FALSE)); }

// The members of `obj` other than path, id and caption, as a JSON object's compact text, in the
// order of the line; "" when there are none.
std::string extra_members(JsonObject* obj) {
  JsonObject* rest = json_object_new();
  json_object_foreach_member(
      obj,
      [](JsonObject*, const gchar* name, JsonNode* node, gpointer data) {
        if (!g_str_equal(name, "path") && !g_str_equal(name, "id") && !g_str_equal(name, "caption"))
          json_object_set_member(static_cast<JsonObject*>(data), name, json_node_copy(node));
      },
      rest);
  std::string out;
  if (json_object_get_size(rest) > 0) {
    JsonNode* node = json_node_init_object(json_node_alloc(), rest);
    out = json_text(node);
    json_node_unref(node);
  }
  json_object_unref(rest);
  return out;
}

}  // namespace

const char* ann_index_type_name(AnnIndexType type) {
  switch (type) {
    case AnnIndexType::Hnsw:
      return "hnsw";
    case AnnIndexType::Ivf:
      return "ivf";
    case AnnIndexType::Flat:
      break;
  }
  return "flat";
}

std::string catalog_id_from_path(const std::string& path) {
  std::string name = take_string(g_path_get_basename(path.c_str()));
  const size_t dot = name.rfind('.');
  if (dot != std::string::npos && dot > 0) name.erase(dot);
  return name;
}

CatalogEntry parse_catalog_line(std::string_view line, const std::string& folder, const std::string& where) {
  CatalogEntry item;
  std::optional<json::Document> doc;
  try {
    doc.emplace(line, where);
  } catch (const Error& e) {
    item.error = catalog_json_error(e.what(), where);
    return item;
  }
  JsonNode* root = doc->root();
  if (root == nullptr || !JSON_NODE_HOLDS_OBJECT(root)) {
    item.error = where + ": not a JSON object";
    return item;
  }
  JsonObject* obj = json_node_get_object(root);
  auto member = [&](const char* key) { return json_object_get_member(obj, key); };
  auto is_type = [](JsonNode* n, GType t) {
    return n != nullptr && JSON_NODE_HOLDS_VALUE(n) && json_node_get_value_type(n) == t;
  };

  if (JsonNode* id = member("id")) {
    if (is_type(id, G_TYPE_STRING))
      item.id = json_node_get_string(id);
    else if (is_type(id, G_TYPE_INT64))
      item.id = std::to_string(json_node_get_int(id));
    else
      item.error = where + ": \"id\" must be a string or an integer";
  }
  if (JsonNode* caption = member("caption")) {
    if (is_type(caption, G_TYPE_STRING))
      item.caption = json_node_get_string(caption);
    else if (item.error.empty())
      item.error = where + ": \"caption\" must be a string";
  }
  JsonNode* path = member("path");
  if (!is_type(path, G_TYPE_STRING) || *json_node_get_string(path) == '\0') {
    if (item.error.empty()) item.error = where + ": \"path\" (a non-empty string) is missing";
    return item;
  }
  item.path = take_string(g_canonicalize_filename(json_node_get_string(path), folder.c_str()));
  if (item.id.empty() && item.error.empty()) item.id = catalog_id_from_path(item.path);
  item.fields = extra_members(obj);
  return item;
}

AnnPairSeal parse_ann_pair_seal(std::string_view text, const std::string& items_path) {
  if (text.empty()) throw Error("ANN item table '" + items_path + "': empty file (no header line)");
  const size_t nl = text.find('\n');
  const std::string what = "ANN item table '" + items_path + "' line 1 (header)";
  json::Document doc(text.substr(0, nl), what);
  JsonObject* h = doc.root_object();
  AnnPairSeal seal;
  const int64_t generation = json::get_int_or(h, "generation", 0, what);
  if (generation < 0) throw Error(what + ": negative generation " + std::to_string(generation));
  seal.generation = static_cast<uint64_t>(generation);
  if (json_object_has_member(h, "index_crc32")) {
    const int64_t crc = json::get_int(h, "index_crc32", what);
    const int64_t bytes = json::get_int(h, "index_bytes", what);
    if (crc < 0 || crc > 0xffffffffLL) throw Error(what + ": index_crc32 " + std::to_string(crc) + " is not a CRC-32");
    if (bytes < 0) throw Error(what + ": negative index_bytes " + std::to_string(bytes));
    seal.index_crc32 = static_cast<uint32_t>(crc);
    seal.index_bytes = static_cast<uint64_t>(bytes);
  }
  return seal;
}

void check_ann_provenance(const AnnProvenance& p, const std::string& what) {
  if (p.encoder_fingerprint.empty()) throw Error(what + ": no encoder fingerprint (encoder '" + p.encoder + "')");
}

AnnItemTable parse_ann_item_table(std::string_view text, const std::string& items_path, const std::string& index_path,
                                  int64_t count, int dim, AnnIndexType type) {
  // std::getline's lines: split on '\n', a last line without one still counts, nothing after a
  // final '\n'.
  size_t pos = 0;
  auto next_line = [&](std::string_view* line) {
    if (pos >= text.size()) return false;
    const size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string_view::npos ? text.size() : nl;
    *line = text.substr(pos, end - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    return true;
  };

  AnnItemTable out;
  std::string_view line;
  if (!next_line(&line)) throw Error("ANN item table '" + items_path + "': empty file (no header line)");
  {
    const std::string what = "ANN item table '" + items_path + "' line 1 (header)";
    json::Document doc(line, what);
    JsonObject* h = doc.root_object();
    if (json::get_string(h, "format", what) != kAnnItemsFormat)
      throw Error(what + ": format is not '" + kAnnItemsFormat + "'");
    const int64_t version = json::get_int(h, "version", what);
    if (version < 1 || version > kAnnItemsVersion)
      throw Error(what + ": unsupported version " + std::to_string(version));
    const int64_t header_count = json::get_int(h, "count", what);
    const int64_t header_dim = json::get_int(h, "dim", what);
    const std::string header_type = json::get_string(h, "index_type", what);
    if (header_count != count)
      throw Error(what + ": count " + std::to_string(header_count) + " but the index '" + index_path + "' holds " +
                  std::to_string(count) + " vectors");
    if (header_dim != dim)
      throw Error(what + ": dim " + std::to_string(header_dim) + " but the index '" + index_path + "' has dimension " +
                  std::to_string(dim));
    if (header_type != ann_index_type_name(type))
      throw Error(what + ": index_type '" + header_type + "' but the index '" + index_path + "' is " +
                  ann_index_type_name(type));
    out.factory = json::get_string_or(h, "factory", "", what);
    if (JsonObject* p = json::get_object_or_null(h, "provenance", what)) {
      const std::string pwhat = what + " provenance";
      AnnProvenance prov{json::get_string(p, "encoder", pwhat), json::get_string(p, "encoder_fingerprint", pwhat),
                         json::get_string(p, "adapter", pwhat), json::get_string(p, "adapter_fingerprint", pwhat)};
      check_ann_provenance(prov, pwhat);
      out.provenance = std::move(prov);
    }
  }
  // No more items than lines: a count from a corrupt index reserves nothing absurd.
  const int64_t lines_left = static_cast<int64_t>(std::count(text.begin() + pos, text.end(), '\n')) + 1;
  out.items.reserve(static_cast<size_t>(std::max<int64_t>(0, std::min(count, lines_left))));
  int64_t line_no = 1;
  while (next_line(&line)) {
    ++line_no;
    const std::string what = "ANN item table '" + items_path + "' line " + std::to_string(line_no);
    const int64_t i = static_cast<int64_t>(out.items.size());
    if (i == count) throw Error(what + ": more items than the " + std::to_string(count) + " in the header");
    json::Document doc(line, what);
    JsonObject* obj = doc.root_object();
    if (json::get_int(obj, "item", what) != i)
      throw Error(what + ": item " + std::to_string(json::get_int(obj, "item", what)) + " where " + std::to_string(i) +
                  " was expected (items must be in index order)");
    if (json::get_bool_or(obj, "deleted", false, what)) {
      out.deleted.push_back(i);
      out.items.emplace_back();
      continue;
    }
    // "fields" is absent from tables written before it existed, and when an item has none.
    JsonObject* fields = json::get_object_or_null(obj, "fields", what);
    out.items.push_back({json::get_string_or(obj, "id", "", what), json::get_string_or(obj, "uri", "", what),
                         json::get_string_or(obj, "caption", "", what),
                         fields != nullptr && json_object_get_size(fields) > 0
                             ? json_text(json_object_get_member(obj, "fields"))
                             : std::string()});
  }
  if (static_cast<int64_t>(out.items.size()) != count)
    throw Error("ANN item table '" + items_path + "' has " + std::to_string(out.items.size()) +
                " items but the header and the index '" + index_path + "' say " + std::to_string(count));
  return out;
}

}  // namespace moe
