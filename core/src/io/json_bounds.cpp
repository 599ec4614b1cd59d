#include "moe/json_bounds.h"

#include <algorithm>

namespace moe {

namespace {

// True if the integer literal `digits` (an optional '-' and decimal digits) is within int64_t.
bool fits_int64(std::string_view digits) {
  const bool negative = !digits.empty() && digits[0] == '-';
  if (negative) digits.remove_prefix(1);
  while (digits.size() > 1 && digits[0] == '0') digits.remove_prefix(1);
  const std::string_view limit = negative ? "9223372036854775808" : "9223372036854775807";
  return digits.size() < limit.size() || (digits.size() == limit.size() && digits <= limit);
}

}  // namespace

std::string json_bounds_violation(std::string_view text, const JsonBounds& bounds) {
  if (text.size() > bounds.max_bytes)
    return std::to_string(text.size()) + " bytes (at most " + std::to_string(bounds.max_bytes) + ")";
  // Brackets inside strings do not nest; a backslash escapes the next character of a string.
  // Unbalanced or otherwise invalid text is left to the parser.
  int depth = 0;
  size_t values = 1;
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{' || c == ',') {
      if (++values > bounds.max_values)
        return "more than " + std::to_string(bounds.max_values) + " values (at byte " + std::to_string(i) + ")";
      if (c != ',' && ++depth > bounds.max_depth)
        return "nested more than " + std::to_string(bounds.max_depth) + " levels deep (at byte " + std::to_string(i) +
               ")";
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      // JSON-GLib reads an integer beyond 64 bits as a wrapped or saturated value (2^70 as -1):
      // refuse it rather than let a wrong number through.
      const size_t start = i;
      size_t end = i + (c == '-' ? 1 : 0);
      while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
      const bool fraction = end < text.size() && (text[end] == '.' || text[end] == 'e' || text[end] == 'E');
      if (bounds.refuse_wide_integers && !fraction && !fits_int64(text.substr(start, end - start)))
        return "the integer " + std::string(text.substr(start, std::min<size_t>(end - start, 40))) +
               (end - start > 40 ? "..." : "") + " at byte " + std::to_string(start) + " does not fit in 64 bits";
      // Skip the whole number, its fraction and exponent included.
      while (end < text.size() && std::string_view("0123456789.eE+-").find(text[end]) != std::string_view::npos) ++end;
      i = std::max(end, start + 1) - 1;
    }
  }
  return {};
}

}  // namespace moe
