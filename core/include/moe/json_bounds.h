// gst-moe: bounds on JSON text from outside, checked before any parser sees it.
//
// Why: JSON-GLib 1.6 (Debian 12) parses recursively with no depth limit of its own (one was added
// in 1.10), so a request or a model file of some 100,000 '[' overflows the stack of whatever
// thread parses it. Every JSON text that arrives over a socket or from a file passes
// json_bounds_violation first: one linear pass, no allocation, that measures size and nesting
// depth, and refuses integers beyond 64 bits (JSON-GLib reads 2^70 as -1, silently). Text that
// passes may still be invalid JSON; the parser says so afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

struct JsonBounds {
  size_t max_bytes;  // the whole text
  int max_depth;     // arrays and objects open at once; 1 for {"a": 1}
  // Values (scalars, arrays, objects) the text may hold, counted as the commas and opening
  // brackets outside strings, plus one: each value costs the parser about 100 bytes, so a
  // megabyte of "[0,0,0,..." would otherwise cost a hundred.
  size_t max_values = SIZE_MAX;
  // Refuse integers beyond 64 bits. A parser that wants to read some members (a request's id)
  // before refusing such a number checks the rest first with this off, and it alone afterwards.
  bool refuse_wide_integers = true;
};

// Model and catalog files: configs nest 3-4 levels, tokenizer.json about 5. 64 levels is far
// beyond any real file and far below what exhausts a thread's stack.
constexpr int kMaxFileJsonDepth = 64;
// config.json, preprocessor_config.json, adapter_config.json, a safetensors header (its format
// caps that at 100 MB), vocab.json (about 1 MB for CLIP), one JSON Lines line.
constexpr JsonBounds kFileJsonBounds{256u << 20, kMaxFileJsonDepth};

// Empty when `text` is within `bounds` and its integers fit in 64 bits; otherwise why not, e.g.
// "nested more than 64 levels deep (at byte 1234)", "300000000 bytes (at most 268435456)",
// "more than 64 values (at byte 300)" or
// "the integer 1180591620717411303424 at byte 6 does not fit in 64 bits".
std::string json_bounds_violation(std::string_view text, const JsonBounds& bounds);

}  // namespace moe
