// Fuzz target: a tokenizer's vocab.json and merges.txt, through ClipTokenizer::from_files (on two
// in-memory files). The input is the vocab.json text, a NUL byte, then the merges.txt text (no NUL:
// all of it is vocab.json and merges.txt is empty). A tokenizer that loads then encodes a few fixed
// texts, so that odd vocabularies and merge lists go through BPE as well.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "fuzz_util.h"
#include "moe/tokenizer.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe_fuzz::MemFile vocab("vocab.json");
  static moe_fuzz::MemFile merges("merges.txt");
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  vocab.write(all.substr(0, nul));
  merges.write(nul == std::string_view::npos ? std::string_view() : all.substr(nul + 1));
  try {
    const moe::ClipTokenizer tok = moe::ClipTokenizer::from_files(vocab.path(), merges.path());
    MOE_FUZZ_CHECK(tok.vocab_size() >= 2);
    for (const char* text :
         {"a photo of a cat", "<|startoftext|>Hello, World!<|endoftext|> 123", "l\xC3\xA4nger w\xC3\xB6rter", ""}) {
      const std::vector<int32_t> ids = tok.encode(text, 16);
      MOE_FUZZ_CHECK(ids.size() >= 2 && ids.size() <= 16);
      MOE_FUZZ_CHECK(ids.front() == tok.bos_id() && ids.back() == tok.eos_id());
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
