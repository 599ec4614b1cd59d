// Fuzz target: the text of a query, through the tokenizer a model uses (CLIP's real vocab.json and
// merges.txt, models/clip-tokenizer): the special-token split, the ftfy-like repairs (HTML
// entities, mojibake, ligatures, NFC...), lower-casing, the pre-tokenizer and BPE. Client text
// reaches this from every text request. Invalid UTF-8 must be refused with moe::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "moe/tokenizer.h"

#ifndef MOE_FUZZ_TOKENIZER_DIR
#define MOE_FUZZ_TOKENIZER_DIR "models/clip-tokenizer"
#endif

namespace {

std::unique_ptr<moe::ClipTokenizer> tokenizer;

// Valid UTF-8 as GLib defines it, NUL characters allowed (the tokenizer takes them).
bool valid_utf8(std::string_view s) {
  for (size_t start = 0; start <= s.size();) {
    size_t nul = s.find('\0', start);
    if (nul == std::string_view::npos) nul = s.size();
    if (!g_utf8_validate(s.data() + start, static_cast<gssize>(nul - start), nullptr)) return false;
    start = nul + 1;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  // MOE_FUZZ_TOKENIZER_DIR in the environment overrides the source tree's folder.
  const char* dir = std::getenv("MOE_FUZZ_TOKENIZER_DIR");
  tokenizer = std::make_unique<moe::ClipTokenizer>(
      moe::ClipTokenizer::from_directory(dir != nullptr ? dir : MOE_FUZZ_TOKENIZER_DIR));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool utf8 = valid_utf8(text);
  try {
    const std::vector<int32_t> ids = tokenizer->encode(text, 77);
    MOE_FUZZ_CHECK(utf8);
    MOE_FUZZ_CHECK(ids.size() >= 2 && ids.size() <= 77);
    MOE_FUZZ_CHECK(ids.front() == tokenizer->bos_id() && ids.back() == tokenizer->eos_id());
    for (const int32_t id : ids) MOE_FUZZ_CHECK(id >= 0);
    const std::string fixed = moe::ftfy_fix_text(text);
    MOE_FUZZ_CHECK(valid_utf8(fixed));
    const std::string normal = moe::ClipTokenizer::normalize_text(text);
    MOE_FUZZ_CHECK(valid_utf8(normal));
  } catch (const moe::Error&) {
    MOE_FUZZ_CHECK(!utf8);  // only invalid UTF-8 is refused
  }
  return 0;
}
