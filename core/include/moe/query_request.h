// gst-moe: the request a client sends over the wire, parsed and bounded.
//
// One JSON object per message. Searches: {"id": "q1", "text": "red mug"}, {"id": 2, "image": "mug.jpg"},
// {"id": "q3", "image_base64": "iVBORw0..."} or a hybrid, an image with a text ({"id": "q4",
// "image_base64": "...", "text": "but red"}), with optional "k", "nprobe", "ef_search" and "filter"
// ({"category": "mug", "price": {"gte": 10, "lt": 20}}). Catalog updates: {"id": "u1", "op": "upsert",
// "item": {"id": "sku-9", ...}, "text" or "image" or "image_base64": ...} and {"id": "d1", "op":
// "delete", "items": ["sku-9"]} (docs/zmq-schema.md, "Requests" and "Live updates"). Every
// byte of it comes from a client the service does not trust, so parsing is bounded before the
// JSON parser runs (size, nesting depth, integer range), every field's type and size is checked,
// and a refusal says which field and why. The zmq-query element and the request fuzzer both go
// through parse_query_request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe/ann_index.h"
#include "moe/error.h"

namespace moe {

// Hybrid: an image and a text in one request; the text modifies the image ("like this photo, but red").
enum class QueryModality { Text, Image, Hybrid };
// What a request asks: a search, or a change to the catalog (an item added or replaced, items deleted).
enum class QueryOp { Search, Upsert, Delete };

// Requests nest two levels at most ({"id": ...}); 32 leaves room for what clients add and for an
// upsert's item fields.
constexpr int kMaxRequestJsonDepth = 32;
// Values in a request: a delete's ids, a filter's sets or an upsert's item fields, and the rest.
constexpr size_t kMaxRequestJsonValues = 2048;
constexpr int kMinQueryK = 1;
constexpr int kMaxQueryK = 1024;
// A request's own search knobs: IVF lists scanned (capped at the index's list count), HNSW's
// candidate list (as ann-query's ef-search property).
constexpr int kMaxQueryNprobe = 65536;
constexpr int kMaxQueryEfSearch = 4096;
// A filter: conditions (fields), values in one "in" set, bytes of a field name or string value.
constexpr size_t kMaxFilterFields = 16;
constexpr size_t kMaxFilterSetValues = 256;
constexpr size_t kMaxFilterNameBytes = 128;
constexpr size_t kMaxFilterStringBytes = 256;
// Ids are echoed in every answer: longer ones are refused.
constexpr size_t kMaxQueryIdBytes = 256;
// Paths longer than PATH_MAX cannot name a file.
constexpr size_t kMaxQueryImagePathBytes = 4096;
// How much of a query text or image value an answer echoes back.
constexpr size_t kMaxEchoedQueryBytes = 1024;
// Catalog updates: the ids one delete may name (a request of kMaxRequestJsonValues values holds them
// all), the bytes of a catalog id (as of a request id), and of an upsert's caption, uri and fields
// (the compact JSON text of item.fields): each item's are kept in the item table and shown in results.
constexpr size_t kMaxDeleteItems = 1024;
constexpr size_t kMaxItemIdBytes = 256;
constexpr size_t kMaxItemCaptionBytes = 4096;
constexpr size_t kMaxItemUriBytes = 4096;
constexpr size_t kMaxItemFieldsBytes = 64 * 1024;
// CLIP reads 77 tokens, a few hundred bytes of text; the default bound leaves ample room and
// keeps a request's tokenising cost and its echo small.
constexpr size_t kDefaultMaxQueryTextBytes = 4096;

// The machine-readable codes of failed requests: an error document's `error.code`, decided where
// the request fails. A closed set (docs/zmq-schema.md, "Error codes"): clients may switch on it.
namespace error_code {
constexpr const char* kInvalidRequest = "invalid_request";      // not a request by the rules (JSON, id, fields, k)
constexpr const char* kUnsupportedOp = "unsupported_op";        // "op" names no operation this service knows
constexpr const char* kTooManyItems = "too_many_items";         // a delete naming more than kMaxDeleteItems ids
constexpr const char* kUpdatesDisabled = "updates_disabled";    // an update sent to a service that takes none
constexpr const char* kTextTooLong = "text_too_long";           // text over max-text-bytes
constexpr const char* kImageTooLarge = "image_too_large";       // image over max-image-bytes
constexpr const char* kImageUnavailable = "image_unavailable";  // image file not served or not readable
constexpr const char* kImageUndecodable = "image_undecodable";  // image bytes no decoder reads
constexpr const char* kModelMismatch = "model_mismatch";        // encoded by other models than the index's
constexpr const char* kDuplicateId = "duplicate_id";            // index build: an id already in the index
constexpr const char* kInternal = "internal";                   // the service failed: not the request's fault
}  // namespace error_code

struct QueryLimits {
  size_t max_text_bytes = kDefaultMaxQueryTextBytes;
  uint64_t max_image_bytes = 32u << 20;  // a decoded image_base64, or an image file
};

struct QueryRequest {
  std::string id;  // as a string ("3" for 3); for a refused request, as far as it could be read
  QueryOp op = QueryOp::Search;
  QueryModality modality = QueryModality::Text;  // searches and upserts (an upsert is never Hybrid)
  int k = 0;                                     // results wanted; 0: the service's default
  int nprobe = 0;                                // IVF lists to scan; 0: the service's default
  int ef_search = 0;                             // HNSW candidate list size; 0: the service's default
  AnnFilter filter;                              // only items whose catalog fields match; empty: all
  std::string text;                              // text and hybrid requests
  std::string image;                             // "image" requests: the client's path or file:// uri
  std::vector<uint8_t> image_bytes;              // image_base64 requests: the decoded bytes
  AnnItem item;                                  // upserts: the item its text or image is the vector of
  std::vector<std::string> item_ids;             // deletes: the catalog ids, 1 to kMaxDeleteItems
};

// A request the service refuses, with the error_code its error document carries.
class RequestRefused : public Error {
 public:
  RequestRefused(std::string reason, const char* code) : Error(std::move(reason)), code(code) {}
  const char* code;
};

// A request parse_query_request refuses. `request` holds what was read before the refusal (the id
// and modality when they could be read, and the text or image value clipped to
// kMaxEchoedQueryBytes), so that the answer can still name them.
class QueryRejected : public RequestRefused {
 public:
  QueryRejected(std::string reason, QueryRequest request, const char* code = error_code::kInvalidRequest)
      : RequestRefused(std::move(reason), code), request(std::move(request)) {}
  QueryRequest request;
};

// Parses one request message. Throws QueryRejected naming the field and the cause ("request is
// not valid JSON: ...", "k must be an integer from 1 to 1024 (got 2000)", "filter.price: unknown
// operator 'between' (use in, gt, gte, lt, lte)", "text is 10485760 bytes,
// more than max-text-bytes (4096)", "items[2] must be a string (got an integer)", ...). An "image"
// value is not read here: see read_query_image_file.
QueryRequest parse_query_request(std::string_view message, const QueryLimits& limits);

// The bytes of the image file an "image" request names (`image`: the client's value, a path
// relative to `root`, an absolute path or a file:// uri), served only when it lies inside `root`
// (a canonical folder path) after resolving ".." and symlinks, is a regular file and has
// 1..max_bytes bytes. A value that leads outside is refused as "image '<value>' is outside
// image-root" whether or not the file exists, and reasons quote the client's value, never the
// resolved path. The file is opened once and checked through its descriptor, so a path swapped
// after the check cannot lead out and a FIFO cannot block. Throws RequestRefused
// (image_too_large for a file over max_bytes, image_unavailable otherwise).
std::vector<uint8_t> read_query_image_file(const std::string& image, const std::string& root, uint64_t max_bytes);

// `text` cut to at most `max_bytes` bytes at a UTF-8 character boundary, "..." appended when cut.
std::string clip_utf8(const std::string& text, size_t max_bytes);

// The size of the largest image_base64 request for an image of `image_bytes` bytes: 4 characters
// per 3 bytes, a line break after every 76 characters (as base64(1) writes them) that JSON
// escapes as the two characters \n, and 1 KiB for the rest of the JSON (id, k, member names).
// Saturates at UINT64_MAX.
constexpr uint64_t base64_request_bytes(uint64_t image_bytes) {
  const uint64_t groups = image_bytes / 3 + (image_bytes % 3 ? 1 : 0);
  if (groups > (UINT64_MAX - 1024) / 5) return UINT64_MAX;
  const uint64_t chars = 4 * groups;
  return chars + 2 * ((chars + 75) / 76) + 1024;
}

}  // namespace moe
