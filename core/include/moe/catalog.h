// gst-moe: the two JSON Lines tables that describe catalog items, parsed from their text:
//   - an image catalog, catalog.jsonl, one {"path": ..., "caption": ..., "id": ..., ...} per line
//     (read by moe-catalog-src);
//   - an ANN index's item table, PATH.items.jsonl (format in moe/ann_index.h; read by
//     AnnIndex::load).
// Both come from files a user hands over, so both parse through the engine's bounded JSON reader
// (size and nesting depth checked before JSON-GLib runs). Neither needs FAISS or GStreamer: the
// fuzz targets in tests/fuzz build them alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/ann_index.h"

namespace moe {

// One catalog line. A malformed line gives an entry with `error` set ("<where>: ...") and
// whatever id and caption it had; a valid one has `path` absolute and `error` empty.
struct CatalogEntry {
  std::string id;
  std::string path;  // absolute
  std::string caption;
  std::string fields;  // the line's other members ("price", "sku", ...): a JSON object's compact text, "" for none
  std::string error;   // set for a malformed catalog line
};

// Parses one catalog.jsonl line: "path" (a non-empty string, relative to `folder` unless
// absolute), "caption" (a string, optional), "id" (a string or an integer, optional: the file name
// without its extension); every other member is kept, as it is, in `fields`. `where` ("catalog 'F' line N") prefixes
// every error. Never throws for bad input: the failure is in the entry.
CatalogEntry parse_catalog_line(std::string_view line, const std::string& folder, const std::string& where);

// The default id of an item at `path`: the file name without its extension.
std::string catalog_id_from_path(const std::string& path);

// The item table's format name and newest version (its header's "format" and "version"): 2 marks
// a table with deleted rows (which a version-1 reader would take for live ones), 1 any other.
constexpr const char* kAnnItemsFormat = "gst-moe-items";
constexpr int kAnnItemsVersion = 2;

struct AnnItemTable {
  std::vector<AnnItem> items;    // a deleted row's item is empty
  std::vector<int64_t> deleted;  // the rows marked {"deleted":true}, ascending
  std::optional<AnnProvenance> provenance;
  std::string factory;  // the header's "factory", "" when it has none
};

// What a save() seals an item table to (its header's "generation", "index_crc32" and
// "index_bytes"): the generation of the pair, and the CRC-32 and size of the FAISS file written
// with it. Tables written before these existed have generation 0 and no checksum.
struct AnnPairSeal {
  uint64_t generation = 0;
  std::optional<uint32_t> index_crc32;
  uint64_t index_bytes = 0;  // with index_crc32
};

// The seal in the header line of an item table's text; throws moe::Error naming `items_path` for
// a header that is not JSON or holds a member of the wrong type or range.
AnnPairSeal parse_ann_pair_seal(std::string_view text, const std::string& items_path);

// Parses the text of an item table (`items_path`, for messages) that must describe the index
// `index_path`: `count` items, vectors of dimension `dim`, of `type`. Lines split as
// std::getline splits them. Throws moe::Error with AnnIndex::load's messages.
AnnItemTable parse_ann_item_table(std::string_view text, const std::string& items_path, const std::string& index_path,
                                  int64_t count, int dim, AnnIndexType type);

// Throws moe::Error "<what>: no encoder fingerprint (...)" for a provenance that cannot be checked.
void check_ann_provenance(const AnnProvenance& provenance, const std::string& what);

}  // namespace moe
