// Fuzz target: one request message as zmq-query receives it from a client, through
// moe::parse_query_request (the function the element calls), with the element's default limits.
// A request is either accepted, within every bound, or refused with moe::QueryRejected; any other
// exception breaks the element's contract and is a finding.
#include <cstddef>
#include <cstdint>
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
    if (r.modality == moe::QueryModality::Text) {
      MOE_FUZZ_CHECK(!r.text.empty() && r.text.size() <= limits.max_text_bytes);
      MOE_FUZZ_CHECK(r.image.empty() && r.image_bytes.empty());
    } else {
      MOE_FUZZ_CHECK(r.text.empty());
      MOE_FUZZ_CHECK(r.image.empty() != r.image_bytes.empty());
      MOE_FUZZ_CHECK(r.image_bytes.size() <= limits.max_image_bytes);
    }
  } catch (const moe::QueryRejected& e) {
    MOE_FUZZ_CHECK(e.what()[0] != '\0');
    // What is echoed back of a refused request stays small (a clipped id ends in "...").
    MOE_FUZZ_CHECK(e.request.id.size() <= moe::kMaxQueryIdBytes + 3);
  }
  return 0;
}
