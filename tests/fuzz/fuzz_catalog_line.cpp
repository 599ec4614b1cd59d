// Fuzz target: the lines of a catalog.jsonl, through parse_catalog_line, the parser
// moe-catalog-src runs on each non-blank line of the file (split on '\n', as the element splits
// it). A line never throws: a malformed one becomes an entry with an error, which the element
// sends on as a failed request.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "moe/catalog.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  int line_no = 1;
  for (size_t start = 0; start < all.size(); ++line_no) {
    size_t end = all.find('\n', start);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view line = all.substr(start, end - start);
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank lines
    const std::string where = "catalog '/data/catalog.jsonl' line " + std::to_string(line_no);
    const moe::CatalogEntry e = moe::parse_catalog_line(line, "/data", where);
    if (e.error.empty()) {
      MOE_FUZZ_CHECK(!e.path.empty() && e.path[0] == '/');
    } else {
      MOE_FUZZ_CHECK(e.error.compare(0, where.size(), where) == 0);
    }
  }
  return 0;
}
