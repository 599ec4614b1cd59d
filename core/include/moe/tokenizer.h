// gst-moe: the CLIP byte-level BPE tokenizer.
//
// Produces the same ids as Hugging Face's slow `transformers.CLIPTokenizer` (with `ftfy`
// installed) called as `tok(text, truncation=True, max_length=N)["input_ids"]`:
//   1. the input is split on the literal special tokens "<|startoftext|>" / "<|endoftext|>",
//      which map straight to their ids;
//   2. every other piece is cleaned (a subset of ftfy.fix_text, see fix_text below), its
//      whitespace collapsed and stripped, and lower-cased like Python's str.lower();
//   3. CLIP's pre-tokenizer regex splits it into words, whose UTF-8 bytes go through GPT-2's
//      byte-to-unicode map and then BPE (with "</w>" on the last symbol);
//   4. [bos] + ids truncated to max_length - 2 + [eos].
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

class ClipTokenizer {
 public:
  // Reads vocab.json (token -> id) and merges.txt ("#version" line, then "a b" pairs, rank =
  // line order) from a Hugging Face CLIP model directory.
  static ClipTokenizer from_directory(const std::string& dir);
  static ClipTokenizer from_files(const std::string& vocab_json_path, const std::string& merges_txt_path);

  ClipTokenizer(ClipTokenizer&& other) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&& other) noexcept;
  ~ClipTokenizer();

  // [bos] + BPE ids (truncated so that the total <= max_length) + [eos]. Throws moe::Error if
  // the text is not valid UTF-8 (the message gives the byte offset) or max_length < 2.
  // Thread-safe: may be called concurrently on one tokenizer.
  std::vector<int32_t> encode(std::string_view utf8_text, size_t max_length = 77) const;
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string>& texts, size_t max_length = 77) const;

  int32_t bos_id() const;  // id of "<|startoftext|>"
  int32_t eos_id() const;  // id of "<|endoftext|>" (also the unknown-token id, as in HF)
  size_t vocab_size() const;

  // The text each non-special piece is turned into before pre-tokenization:
  // lower(whitespace_clean(fix_text(piece))). Input must be valid UTF-8 (throws otherwise).
  static std::string normalize_text(std::string_view utf8_text);

 private:
  struct Impl;
  explicit ClipTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The subset of ftfy.fix_text (ftfy 6.x default config) that matters for real queries:
// HTML entity unescaping (skipped from the first line containing '<' on, as ftfy's "auto"
// mode does), C1 controls as Windows-1252, Latin ligatures, full/halfwidth forms, curly quotes,
// line breaks, ANSI terminal escapes, invisible control characters (incl. BOM), NFC, and
// ftfy's fix_encoding for its main case (a whole line of Latin-1 letters and signs, or
// punctuation, in UTF-8 read as Latin-1/Windows-1252, with restore_byte_a0); repeated until
// nothing changes. Not covered: lines mixing mojibake with other characters, mojibake of
// Central European or Cyrillic letters, and other single-byte encodings.
// Throws moe::Error when the input is not valid UTF-8.
std::string ftfy_fix_text(std::string_view utf8_text);

}  // namespace moe
