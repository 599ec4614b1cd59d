// Fuzz target: one request message as zmq-query receives it from a client, through
// moe::parse_query_request (the function the element calls), with the element's default limits.
// A request is either accepted, within every bound, or refused with moe::QueryRejected; any other
// exception breaks the element's contract and is a finding.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "moe/query_request.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moe::QueryLimits limits{};
  const std::string_view message(reinterpret_cast<const char*>(data), size);
  try {
    const moe::QueryRequest r = moe::parse_query_request(message, limits);
    MOE_FUZZ_CHECK(!r.id.empty() && r.id.size() <= moe::kMaxQueryIdBytes);
    MOE_FUZZ_CHECK(r.k == 0 || (r.k >= moe::kMinQueryK && r.k <= moe::kMaxQueryK));
    if (r.op == moe::QueryOp::Delete) {
      MOE_FUZZ_CHECK(!r.item_ids.empty() && r.item_ids.size() <= moe::kMaxDeleteItems);
      for (const std::string& id : r.item_ids) MOE_FUZZ_CHECK(!id.empty() && id.size() <= moe::kMaxItemIdBytes);
      MOE_FUZZ_CHECK(r.text.empty() && r.image.empty() && r.image_bytes.empty());
      return 0;
    }
    if (r.op == moe::QueryOp::Upsert) {
      MOE_FUZZ_CHECK(!r.item.id.empty() && r.item.id.size() <= moe::kMaxItemIdBytes);
      MOE_FUZZ_CHECK(r.item.fields.size() <= moe::kMaxItemFieldsBytes);
      MOE_FUZZ_CHECK(r.modality != moe::QueryModality::Hybrid);
    }
    // Text requests have text only, image requests an image only (a path or bytes), hybrids both.
    const bool has_text = r.modality != moe::QueryModality::Image;
    const bool has_image = r.modality != moe::QueryModality::Text;
    MOE_FUZZ_CHECK(r.text.empty() != has_text && r.text.size() <= limits.max_text_bytes);
    MOE_FUZZ_CHECK(has_image ? r.image.empty() != r.image_bytes.empty() : r.image.empty() && r.image_bytes.empty());
    MOE_FUZZ_CHECK(r.image_bytes.size() <= limits.max_image_bytes);
  } catch (const moe::QueryRejected& e) {
    MOE_FUZZ_CHECK(e.what()[0] != '\0');
    // What is echoed back of a refused request stays small (a clipped id ends in "...").
    MOE_FUZZ_CHECK(e.request.id.size() <= moe::kMaxQueryIdBytes + 3);
  }
  return 0;
}
