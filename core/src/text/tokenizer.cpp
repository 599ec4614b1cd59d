// gst-moe: CLIP tokenizer, a re-implementation of Hugging Face's slow CLIPTokenizer (+ ftfy).
//
// Text is handled as UTF-32 (std::u32string) between validation and BPE: every step below is
// defined per code point in the Python originals, so this keeps them one-to-one. Unicode
// properties, case mappings and normalisation come from GLib.
#include "moe/tokenizer.h"

#include <glib.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "io/json_util.h"
#include "moe/error.h"

namespace moe {
namespace {

using U32 = std::u32string;

constexpr std::string_view kBosToken = "<|startoftext|>";
constexpr std::string_view kEosToken = "<|endoftext|>";

// ---------------------------------------------------------------------------------------------
// UTF-8 <-> UTF-32

// Offset of the first invalid byte, or npos. NUL bytes are accepted (a Python str may hold
// U+0000; ftfy removes it), which g_utf8_validate alone would reject.
size_t find_invalid_utf8(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nul = s.find('\0', pos);
    size_t end = nul == std::string_view::npos ? s.size() : nul;
    const gchar* bad = nullptr;
    if (!g_utf8_validate(s.data() + pos, static_cast<gssize>(end - pos), &bad))
      return static_cast<size_t>(bad - s.data());
    pos = nul == std::string_view::npos ? end : end + 1;
  }
  return std::string_view::npos;
}

void require_utf8(std::string_view s, const char* who) {
  size_t bad = find_invalid_utf8(s);
  if (bad != std::string_view::npos)
    throw Error(std::string(who) + ": text is not valid UTF-8 (invalid byte sequence at byte offset " +
                std::to_string(bad) + ")");
}

// `s` must be valid UTF-8 (NUL bytes allowed).
U32 decode_utf8(std::string_view s) {
  U32 out;
  out.reserve(s.size());
  const char* p = s.data();
  const char* end = p + s.size();
  while (p < end) {
    out.push_back(static_cast<char32_t>(g_utf8_get_char(p)));
    p = g_utf8_next_char(p);
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  char buf[8];
  int n = g_unichar_to_utf8(static_cast<gunichar>(c), buf);
  out.append(buf, static_cast<size_t>(n));
}

std::string encode_utf8(const U32& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

// ---------------------------------------------------------------------------------------------
// ftfy.fix_text subset. Each function mirrors one ftfy fixer of the same name.

// Windows-1252 for 0x80..0x9F, with the five unassigned bytes kept as the C1 code point (this is
// ftfy's "sloppy-windows-1252", and also what Python's html.unescape uses for &#128;..&#159;).
// Tables keep their rows.
// clang-format off
constexpr char32_t kCp1252High[32] = {
    0x20AC, 0x0081, 0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021,
    0x02C6, 0x2030, 0x0160, 0x2039, 0x0152, 0x008D, 0x017D, 0x008F,
    0x0090, 0x2018, 0x2019, 0x201C, 0x201D, 0x2022, 0x2013, 0x2014,
    0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x009D, 0x017E, 0x0178,
};
// clang-format on

// ftfy's named entities (HTML5 names ending in ';' and ftfy's all-caps spellings), generated
// from ftfy itself by tools/gen_html_entities.py.
struct NamedEntity {
  std::string_view name;
  std::u32string_view text;
};
// clang-format off
constexpr NamedEntity kHtmlEntities[] = {
#include "html5_entities.inc"
};
// clang-format on

// A named entity as ftfy decodes it: `name` (between '&' and ';') exactly as in its table.
bool decode_named_entity(const std::string& name, U32& out) {
  const auto* end = std::end(kHtmlEntities);
  const auto* it = std::lower_bound(std::begin(kHtmlEntities), end, std::string_view(name),
                                    [](const NamedEntity& e, std::string_view key) { return e.name < key; });
  if (it == end || it->name != name) return false;
  out = U32(it->text);  // (assign() from a view trips GCC 12's -Wrestrict, a false positive)
  return true;
}

bool is_ascii_alnum(char32_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// "&#...;" as Python's html.unescape decodes it (the HTML5 rules), which ftfy uses. `body` is
// the text between "&#" and ";". Returns false when ftfy would leave the reference as is.
bool decode_numeric_entity(const std::string& body, U32& out) {
  bool hex = !body.empty() && (body[0] == 'x' || body[0] == 'X');
  size_t start = hex ? 1 : 0;
  if (body.size() <= start) return false;
  uint32_t value = 0;
  for (size_t i = start; i < body.size(); ++i) {
    char c = body[i];
    uint32_t d;
    if (c >= '0' && c <= '9')
      d = static_cast<uint32_t>(c - '0');
    else if (hex && c >= 'a' && c <= 'f')
      d = static_cast<uint32_t>(c - 'a' + 10);
    else if (hex && c >= 'A' && c <= 'F')
      d = static_cast<uint32_t>(c - 'A' + 10);
    // html.unescape would decode only a prefix, leaving text with the ';' in it: ftfy then
    // keeps the original reference.
    else
      return false;
    // Saturate: anything above U+10FFFF decodes to U+FFFD anyway.
    value = value > 0x110000 ? 0x110001 : value * (hex ? 16 : 10) + d;
  }
  out.clear();
  if (value == 0) {
    out.push_back(0xFFFD);
  } else if (value == 0x0D) {
    out.push_back('\r');
  } else if (value >= 0x80 && value <= 0x9F) {
    out.push_back(kCp1252High[value - 0x80]);
  } else if ((value >= 0xD800 && value <= 0xDFFF) || value > 0x10FFFF) {
    out.push_back(0xFFFD);
  } else if ((value >= 0x01 && value <= 0x08) || value == 0x0B || (value >= 0x0E && value <= 0x1F) || value == 0x7F ||
             (value >= 0xFDD0 && value <= 0xFDEF) || (value & 0xFFFE) == 0xFFFE) {
    // HTML5 "invalid code points" decode to nothing.
  } else if (value == ';') {
    return false;  // ftfy keeps a reference whose decoding still contains ';'
  } else {
    out.push_back(value);
  }
  return true;
}

// ftfy's unescape_html: entities matching &#?[0-9A-Za-z]{1,24}; are decoded when known.
U32 unescape_html(const U32& s) {
  U32 out;
  out.reserve(s.size());
  const size_t n = s.size();
  for (size_t i = 0; i < n; ++i) {
    if (s[i] != '&') {
      out.push_back(s[i]);
      continue;
    }
    size_t j = i + 1;
    bool numeric = j < n && s[j] == '#';
    if (numeric) ++j;
    size_t k = j;
    while (k < n && k - j < 25 && is_ascii_alnum(s[k])) ++k;
    size_t len = k - j;
    if (len < 1 || len > 24 || k >= n || s[k] != ';') {
      out.push_back('&');
      continue;
    }
    std::string name;
    for (size_t m = j; m < k; ++m) name.push_back(static_cast<char>(s[m]));
    U32 repl;
    bool ok = numeric ? decode_numeric_entity(name, repl) : decode_named_entity(name, repl);
    if (ok)
      out += repl;
    else
      out.append(s, i, k - i + 1);
    i = k;  // past the ';'
  }
  return out;
}

U32 fix_c1_controls(const U32& s) {
  U32 out(s);
  for (char32_t& c : out)
    if (c >= 0x80 && c <= 0x9F) c = kCp1252High[c - 0x80];
  return out;
}

// ftfy's list: Latin typographic ligatures and legacy digraphs, not intentional ones like æ.
U32 fix_latin_ligatures(const U32& s) {
  U32 out;
  out.reserve(s.size());
  for (char32_t c : s) {
    switch (c) {
      case 0x0132:
        out += U"IJ";
        break;
      case 0x0133:
        out += U"ij";
        break;
      case 0x0149:
        out += U"\u02BCn";
        break;
      case 0x01F1:
        out += U"DZ";
        break;
      case 0x01F2:
        out += U"Dz";
        break;
      case 0x01F3:
        out += U"dz";
        break;
      case 0x01C4:
        out += U"D\u017D";
        break;
      case 0x01C5:
        out += U"D\u017E";
        break;
      case 0x01C6:
        out += U"d\u017E";
        break;
      case 0x01C7:
        out += U"LJ";
        break;
      case 0x01C8:
        out += U"Lj";
        break;
      case 0x01C9:
        out += U"lj";
        break;
      case 0x01CA:
        out += U"NJ";
        break;
      case 0x01CB:
        out += U"Nj";
        break;
      case 0x01CC:
        out += U"nj";
        break;
      case 0xFB00:
        out += U"ff";
        break;
      case 0xFB01:
        out += U"fi";
        break;
      case 0xFB02:
        out += U"fl";
        break;
      case 0xFB03:
        out += U"ffi";
        break;
      case 0xFB04:
        out += U"ffl";
        break;
      case 0xFB05:
        out += U"\u017Ft";
        break;
      case 0xFB06:
        out += U"st";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ftfy maps every char of the Halfwidth and Fullwidth Forms block (U+FF01..U+FFEF) whose NFKC
// form differs to that form, plus U+3000 IDEOGRAPHIC SPACE to a plain space.
const std::unordered_map<char32_t, U32>& width_map() {
  static const std::unordered_map<char32_t, U32> map = [] {
    std::unordered_map<char32_t, U32> m;
    m.emplace(0x3000, U" ");
    for (char32_t c = 0xFF01; c < 0xFFF0; ++c) {
      std::string utf8;
      append_utf8(utf8, c);
      gchar* nfkc = g_utf8_normalize(utf8.data(), static_cast<gssize>(utf8.size()), G_NORMALIZE_NFKC);
      if (nfkc == nullptr) continue;
      std::string alt(nfkc);
      g_free(nfkc);
      if (alt != utf8) m.emplace(c, decode_utf8(alt));
    }
    return m;
  }();
  return map;
}

U32 fix_character_width(const U32& s) {
  const auto& map = width_map();
  U32 out;
  out.reserve(s.size());
  for (char32_t c : s) {
    if (c == 0x3000 || (c >= 0xFF01 && c < 0xFFF0)) {
      auto it = map.find(c);
      if (it != map.end()) {
        out += it->second;
        continue;
      }
    }
    out.push_back(c);
  }
  return out;
}

U32 uncurl_quotes(const U32& s) {
  U32 out(s);
  for (char32_t& c : out) {
    if (c == 0x02BC || (c >= 0x2018 && c <= 0x201B))
      c = '\'';
    else if (c >= 0x201C && c <= 0x201F)
      c = '"';
  }
  return out;
}

// CRLF, CR, LINE/PARAGRAPH SEPARATOR and NEXT LINE all become "\n".
U32 fix_line_breaks(const U32& s) {
  U32 out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char32_t c = s[i];
    if (c == '\r') {
      if (i + 1 < s.size() && s[i + 1] == '\n') continue;  // the '\n' follows
      out.push_back('\n');
    } else if (c == 0x2028 || c == 0x2029 || c == 0x85) {
      out.push_back('\n');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// ANSI escapes: ESC '[' (decimal digit | ';')* ASCII letter. Python's \d is any Unicode Nd.
U32 remove_terminal_escapes(const U32& s) {
  U32 out;
  out.reserve(s.size());
  const size_t n = s.size();
  for (size_t i = 0; i < n; ++i) {
    if (s[i] == 0x1B && i + 1 < n && s[i + 1] == '[') {
      size_t k = i + 2;
      while (k < n && (s[k] == ';' || g_unichar_isdigit(s[k]))) ++k;
      if (k < n && is_ascii_alpha(s[k])) {
        i = k;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

// Invisible controls ftfy drops: C0 except \t \n \f \r, DEL, deprecated Arabic format
// controls, BOM / zero-width no-break space, interlinear annotation and U+FFFC.
bool is_removed_control(char32_t c) {
  return c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F || (c >= 0x206A && c <= 0x206F) ||
         c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFC);
}

U32 remove_control_chars(const U32& s) {
  U32 out;
  out.reserve(s.size());
  for (char32_t c : s)
    if (!is_removed_control(c)) out.push_back(c);
  return out;
}

U32 normalize_nfc(const U32& s) {
  std::string utf8 = encode_utf8(s);
  // No NUL can be left here (remove_control_chars ran), so GLib sees the whole string.
  gchar* nfc = g_utf8_normalize(utf8.data(), static_cast<gssize>(utf8.size()), G_NORMALIZE_NFC);
  if (nfc == nullptr) return s;
  U32 out = decode_utf8(nfc);
  g_free(nfc);
  return out;
}

// ftfy's restore_byte_a0: mojibake whose byte A0 (in "Ã\xa0" for "à", say) was turned into an
// ASCII space. "Ã " starting a word becomes "à " (the A0 was lost with the space kept), then a
// space where a UTF-8 continuation byte belongs becomes A0 again, in ftfy's byte patterns.
bool is_cont_not_85_a0(unsigned char b) { return b >= 0x80 && b <= 0xBF && b != 0x85 && b != 0xA0; }
bool is_cont(unsigned char b) { return b >= 0x80 && b <= 0xBF; }

// Length of an altered UTF-8 sequence (a space for one continuation byte) starting at i, or 0.
size_t altered_utf8_at(const std::string& s, size_t i) {
  auto at = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0; };
  const unsigned char b = at(0);
  if ((b == 0xC2 || b == 0xC3 || b == 0xC5 || b == 0xCE || b == 0xD0 || b == 0xD9) && at(1) == ' ') return 2;
  if ((b == 0xE2 || b == 0xE3) && at(1) == ' ' && is_cont_not_85_a0(at(2))) return 3;
  if (b >= 0xE0 && b <= 0xE3 && is_cont_not_85_a0(at(1)) && at(2) == ' ') return 3;
  if (b == 0xF0) {
    const int spaces = (at(1) == ' ') + (at(2) == ' ') + (at(3) == ' ');
    const bool rest =
        (at(1) == ' ' || is_cont(at(1))) && (at(2) == ' ' || is_cont(at(2))) && (at(3) == ' ' || is_cont(at(3)));
    if (spaces == 1 && rest) return 4;
  }
  return 0;
}

std::string restore_byte_a0(const std::string& in) {
  bool altered = false;
  for (size_t i = 0; i < in.size() && !altered; ++i) altered = altered_utf8_at(in, i) > 0;
  if (!altered) return in;
  std::string s;
  for (size_t i = 0; i < in.size(); ++i) {  // "Ã " + a word (not "Ã  ", "Ã s ", "Ã quele"...) -> "à "
    s.push_back(in[i]);
    if (static_cast<unsigned char>(in[i]) != 0xC3 || i + 1 >= in.size() || in[i + 1] != ' ') continue;
    const std::string next = in.substr(i + 2, 5);
    if (next.rfind(" ", 0) == 0 || next.rfind("quele", 0) == 0 || next.rfind("quela", 0) == 0 ||
        next.rfind("quilo", 0) == 0 || next.rfind("s ", 0) == 0)
      continue;
    s.push_back(static_cast<char>(0xA0));
  }
  for (size_t i = 0; i < s.size();) {
    const size_t n = altered_utf8_at(s, i);
    if (n == 0) {
      ++i;
      continue;
    }
    for (size_t k = i; k < i + n; ++k)
      if (s[k] == ' ') s[k] = static_cast<char>(0xA0);
    i += n;
  }
  return s;
}

// The byte that shows as `c` in Latin-1 or ftfy's "sloppy" Windows-1252 (which keeps the C1
// controls for the bytes Windows-1252 leaves undefined), or -1 when none does.
int cp1252_byte(char32_t c) {
  if (c <= 0xFF) return static_cast<int>(c);
  for (int i = 0; i < 32; ++i)
    if (kCp1252High[i] == c) return 0x80 + i;
  return -1;
}

bool is_cp1252_continuation(char32_t c) {
  const int b = cp1252_byte(c);
  return b >= 0x80 && b <= 0xBF;
}

// Whether a line shows the signature of UTF-8 read as Windows-1252 (ftfy asks its "badness"
// heuristic; this is a narrower test of the same idea, so that clean text is left alone): the
// two-byte lead of a Latin-1 letter or sign (Â Ã) followed by a continuation byte ("Ã©", "Â£"),
// the lead of a three-byte punctuation or currency sign followed by two ("â€œ", "â‚¬"), or a word
// ending in "Ã " / "Â " (the A0 of "à" turned into a space). Accented capitals before
// punctuation ("CAFÉ’s", "weiß…") do not count: real text has those. Mojibake of Central
// European or Cyrillic letters (leads Å, Ð, Ñ...) is left as it is: with those leads real text
// and mojibake are too alike for a test this small.
bool looks_like_utf8_read_as_cp1252(const U32& s) {
  for (size_t i = 0; i + 1 < s.size(); ++i) {
    const char32_t c = s[i];
    if ((c == 0xC2 || c == 0xC3) && is_cp1252_continuation(s[i + 1])) return true;
    if (c == 0xE2 && i + 2 < s.size() && is_cp1252_continuation(s[i + 1]) && is_cp1252_continuation(s[i + 2]))
      return true;
    if ((c == 0xC2 || c == 0xC3) && s[i + 1] == U' ' && i > 0 && s[i - 1] >= U'a' && s[i - 1] <= U'z') return true;
  }
  return false;
}

// ftfy's fix_encoding, its main case: text that is UTF-8 decoded as Latin-1 or Windows-1252
// ("cafÃ©" for "café", "â€œ" for "“"). When the line looks like it
// (looks_like_utf8_read_as_cp1252), every character has a byte in those encodings
// (cp1252_byte) and those bytes, after restore_byte_a0, are valid UTF-8, the text is that UTF-8. Not covered: a
// line mixing mojibake with characters outside these encodings or with correctly encoded
// accented letters, or ending in a cut-off sequence (ftfy repairs such pieces one by one);
// ftfy's rarer encodings (Windows-1250/1251, MacRoman, cp437); sequences that lost bytes.
U32 fix_utf8_read_as_cp1252(const U32& s) {
  if (!looks_like_utf8_read_as_cp1252(s)) return s;
  std::string bytes;
  bytes.reserve(s.size());
  for (char32_t c : s) {
    const int b = cp1252_byte(c);
    if (b < 0) return s;
    bytes.push_back(static_cast<char>(b));
  }
  bytes = restore_byte_a0(bytes);
  if (!g_utf8_validate(bytes.data(), static_cast<gssize>(bytes.size()), nullptr)) return s;
  return decode_utf8(bytes);
}

// One ftfy segment (a line): all fixers in ftfy's order, repeated until nothing changes (so
// mojibake made twice is repaired twice).
U32 fix_segment(U32 text, bool unescape) {
  for (;;) {
    const U32 orig = text;
    if (unescape) text = unescape_html(text);
    // As ftfy, repeated before the other fixers: mojibake of mojibake is repaired before
    // uncurl_quotes could straighten the curly quotes its middle layer holds.
    for (U32 prev; prev != text;) {
      prev = text;
      text = fix_utf8_read_as_cp1252(text);
    }
    text = fix_c1_controls(text);
    text = fix_latin_ligatures(text);
    text = fix_character_width(text);
    text = uncurl_quotes(text);
    text = fix_line_breaks(text);
    // fix_surrogates has nothing to do: valid UTF-8 cannot hold surrogate code points.
    text = remove_terminal_escapes(text);
    text = remove_control_chars(text);
    text = normalize_nfc(text);
    if (text == orig) return text;
  }
}

// ftfy.fix_text: fixed line by line; in the default "auto" HTML mode, entity unescaping stops
// for good at the first line containing '<' (it is probably real HTML).
U32 fix_text(const U32& text) {
  U32 out;
  bool unescape = true;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find(U'\n', pos);
    size_t end = nl == U32::npos ? text.size() : nl + 1;
    U32 segment = text.substr(pos, end - pos);
    if (segment.find(U'<') != U32::npos) unescape = false;
    out += fix_segment(std::move(segment), unescape);
    pos = end;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// CLIP's whitespace_clean, Python's str.lower, and the pre-tokenizer regex.

// The `regex` module's \s: the Unicode White_Space property.
bool is_regex_space(char32_t c) {
  if ((c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85) return true;
  if (c < 0x80) return false;
  GUnicodeType t = g_unichar_type(c);
  return t == G_UNICODE_SPACE_SEPARATOR || t == G_UNICODE_LINE_SEPARATOR || t == G_UNICODE_PARAGRAPH_SEPARATOR;
}

// Python's str.isspace() (used by str.strip()) also counts the information separators.
bool is_python_space(char32_t c) { return is_regex_space(c) || (c >= 0x1C && c <= 0x1F); }

// re.sub(r"\s+", " ", text).strip()
U32 whitespace_clean(const U32& s) {
  U32 out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (is_regex_space(s[i])) {
      out.push_back(' ');
      while (i < s.size() && is_regex_space(s[i])) ++i;
    } else {
      out.push_back(s[i++]);
    }
  }
  size_t b = 0, e = out.size();
  while (b < e && is_python_space(out[b])) ++b;
  while (e > b && is_python_space(out[e - 1])) --e;
  return out.substr(b, e - b);
}

// Unicode's Case_Ignorable: Mn, Me, Cf, Lm, Sk, plus the Word_Break MidLetter / MidNumLet /
// Single_Quote characters, which GLib does not expose (hence the short list).
bool is_case_ignorable(char32_t c) {
  switch (g_unichar_type(c)) {
    case G_UNICODE_NON_SPACING_MARK:
    case G_UNICODE_ENCLOSING_MARK:
    case G_UNICODE_FORMAT:
    case G_UNICODE_MODIFIER_LETTER:
    case G_UNICODE_MODIFIER_SYMBOL:
      return true;
    default:
      break;
  }
  switch (c) {
    case 0x27:
    case 0x2E:
    case 0x3A:
    case 0xB7:
    case 0x387:
    case 0x55F:
    case 0x5F4:
    case 0x2018:
    case 0x2019:
    case 0x2024:
    case 0x2027:
    case 0xFE13:
    case 0xFE52:
    case 0xFE55:
    case 0xFF07:
    case 0xFF0E:
    case 0xFF1A:
      return true;
    default:
      return false;
  }
}

// Roman numerals (Nl) and circled letters (So) have case mappings, but GLib only maps letters.
bool is_other_uppercase_with_lower(char32_t c) { return (c >= 0x2160 && c <= 0x216F) || (c >= 0x24B6 && c <= 0x24CF); }
bool is_other_lowercase_with_upper(char32_t c) { return (c >= 0x2170 && c <= 0x217F) || (c >= 0x24D0 && c <= 0x24E9); }

// Unicode's Cased, approximated as "a cased letter, or has a case mapping" (covers Ⓐ, Ⅰ...).
bool is_cased(char32_t c) {
  GUnicodeType t = g_unichar_type(c);
  if (t == G_UNICODE_UPPERCASE_LETTER || t == G_UNICODE_LOWERCASE_LETTER || t == G_UNICODE_TITLECASE_LETTER)
    return true;
  // Other_Lowercase / Other_Uppercase characters that are neither letters nor case-ignorable.
  if (c == 0xAA || c == 0xBA || (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
      (c >= 0x1F170 && c <= 0x1F189))
    return true;
  return is_other_uppercase_with_lower(c) || is_other_lowercase_with_upper(c) || g_unichar_tolower(c) != c ||
         g_unichar_toupper(c) != c;
}

// CPython's Final_Sigma rule: Σ becomes ς after a cased letter (skipping case-ignorables) and
// when no cased letter follows (skipping case-ignorables); GLib only looks at the next char.
bool is_final_sigma(const U32& s, size_t i) {
  size_t j = i;
  char32_t c = 0;
  bool found = false;
  while (j > 0) {
    c = s[--j];
    if (!is_case_ignorable(c)) {
      found = true;
      break;
    }
  }
  if (!found || !is_cased(c)) return false;
  for (j = i + 1; j < s.size(); ++j) {
    if (!is_case_ignorable(s[j])) return !is_cased(s[j]);
  }
  return true;
}

// Python's str.lower(): simple lowercase mappings plus the two full mappings Python applies
// without a locale (İ -> i + combining dot above, final sigma).
U32 python_lower(const U32& s) {
  U32 out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char32_t c = s[i];
    if (c < 0x80) {
      out.push_back((c >= 'A' && c <= 'Z') ? c + 32 : c);
    } else if (c == 0x130) {
      out.push_back('i');
      out.push_back(0x307);
    } else if (c == 0x3A3) {
      out.push_back(is_final_sigma(s, i) ? 0x3C2 : 0x3C3);
    } else if (is_other_uppercase_with_lower(c)) {
      out.push_back(c + (c < 0x2170 ? 0x10 : 0x1A));
    } else {
      out.push_back(static_cast<char32_t>(g_unichar_tolower(c)));
    }
  }
  return out;
}

bool is_letter(char32_t c) {
  if (c < 0x80) return is_ascii_alpha(c);
  switch (g_unichar_type(c)) {
    case G_UNICODE_LOWERCASE_LETTER:
    case G_UNICODE_MODIFIER_LETTER:
    case G_UNICODE_OTHER_LETTER:
    case G_UNICODE_TITLECASE_LETTER:
    case G_UNICODE_UPPERCASE_LETTER:
      return true;
    default:
      return false;
  }
}

bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  switch (g_unichar_type(c)) {
    case G_UNICODE_DECIMAL_NUMBER:
    case G_UNICODE_LETTER_NUMBER:
    case G_UNICODE_OTHER_NUMBER:
      return true;
    default:
      return false;
  }
}

// [^\s\p{L}\p{N}] under IGNORECASE. U+0345 COMBINING GREEK YPOGEGRAMMENI is excluded: its
// case partner iota is a letter, so the `regex` module keeps it out of this negated class, yet
// [\p{L}] does not take it either; it matches no alternative and is dropped.
bool is_symbol(char32_t c) { return !is_regex_space(c) && !is_letter(c) && !is_number(c) && c != 0x345; }

// Case-insensitive (IGNORECASE, simple folding) match of an ASCII-lowercase literal at s[i].
// Only 's' has a non-ASCII simple case-fold partner among the letters used (ſ, U+017F).
bool match_literal_ci(const U32& s, size_t i, std::string_view lit) {
  if (s.size() - i < lit.size()) return false;
  for (size_t k = 0; k < lit.size(); ++k) {
    char32_t c = s[i + k];
    char32_t want = static_cast<unsigned char>(lit[k]);
    if (c >= 'A' && c <= 'Z') c += 32;
    if (c == want) continue;
    if (want == 's' && c == 0x17F) continue;
    return false;
  }
  return true;
}

// CLIP's pattern, alternatives tried in order at each position:
//   <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
std::vector<U32> pre_tokenize(const U32& s) {
  static constexpr std::string_view kLiterals[] = {
      "<|startoftext|>", "<|endoftext|>", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d"};
  std::vector<U32> out;
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    bool matched = false;
    if (s[i] == '<' || s[i] == '\'') {
      for (std::string_view lit : kLiterals) {
        if (match_literal_ci(s, i, lit)) {
          out.push_back(s.substr(i, lit.size()));
          i += lit.size();
          matched = true;
          break;
        }
      }
    }
    if (matched) continue;
    char32_t c = s[i];
    size_t j = i + 1;
    if (is_letter(c)) {
      while (j < n && is_letter(s[j])) ++j;
    } else if (is_number(c)) {
      // a single digit
    } else if (is_symbol(c)) {
      while (j < n && is_symbol(s[j])) ++j;
    } else {
      i = j;  // whitespace (or U+0345, see is_symbol) matches nothing and is dropped
      continue;
    }

    out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

// GPT-2's reversible byte -> printable code point map: printable Latin-1 bytes map to
// themselves, the others to U+0100 onwards in byte order. Stored as UTF-8 strings.
const std::array<std::string, 256>& byte_encoder() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      char32_t cp = printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      append_utf8(t[static_cast<size_t>(b)], cp);
    }
    return t;
  }();
  return table;
}

void strip_ascii_ws(std::string_view& s) {
  auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct ClipTokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;      // byte-encoded token -> id
  std::unordered_map<std::string, int32_t> bpe_ranks;  // "left right" -> merge rank
  int32_t bos = 0;
  int32_t eos = 0;

  // Pre-token (raw UTF-8 bytes) -> ids. Bounded so a long-running pipeline fed with
  // arbitrary text does not grow without limit.
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  int32_t lookup(const std::string& token) const {
    auto it = vocab.find(token);
    return it == vocab.end() ? eos : it->second;  // HF's unk token is <|endoftext|>
  }

  int32_t rank(const std::string& a, const std::string& b) const {
    std::string key;
    key.reserve(a.size() + b.size() + 1);
    key.append(a).push_back(' ');
    key.append(b);
    auto it = bpe_ranks.find(key);
    return it == bpe_ranks.end() ? std::numeric_limits<int32_t>::max() : it->second;
  }

  std::vector<int32_t> bpe(const std::string& word) const;
  void append_word_ids(const std::string& word, std::vector<int32_t>& ids) const;
};

// HF's CLIPTokenizer.bpe: repeatedly merge the lowest-ranked adjacent pair (every occurrence,
// left to right) until no ranked pair is left; "</w>" marks the end of the word.
std::vector<int32_t> ClipTokenizer::Impl::bpe(const std::string& word) const {
  const auto& enc = byte_encoder();
  std::vector<std::string> symbols;
  symbols.reserve(word.size());
  for (unsigned char b : word) symbols.push_back(enc[b]);
  symbols.back() += "</w>";

  while (symbols.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      int32_t r = rank(symbols[i], symbols[i + 1]);
      if (r < best) {
        best = r;
        best_at = i;
      }
    }
    if (best == std::numeric_limits<int32_t>::max()) break;
    const std::string first = symbols[best_at];
    const std::string second = symbols[best_at + 1];
    std::vector<std::string> merged;
    merged.reserve(symbols.size());
    for (size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == first && symbols[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(std::move(symbols[i]));
        i += 1;
      }
    }
    symbols = std::move(merged);
  }

  std::vector<int32_t> ids;
  ids.reserve(symbols.size());
  for (const auto& s : symbols) ids.push_back(lookup(s));
  return ids;
}

void ClipTokenizer::Impl::append_word_ids(const std::string& word, std::vector<int32_t>& ids) const {
  // HF's BPE cache is pre-seeded with the special tokens: they map to themselves (no "</w>").
  if (word == kBosToken || word == kEosToken) {
    ids.push_back(lookup(word));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(word);
    if (it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word_ids = bpe(word);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kMaxCacheEntries) cache.clear();
  cache.emplace(word, std::move(word_ids));
}

ClipTokenizer::ClipTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClipTokenizer::ClipTokenizer(ClipTokenizer&& other) noexcept = default;
ClipTokenizer& ClipTokenizer::operator=(ClipTokenizer&& other) noexcept = default;
ClipTokenizer::~ClipTokenizer() = default;

ClipTokenizer ClipTokenizer::from_directory(const std::string& dir) {
  return from_files(dir + "/vocab.json", dir + "/merges.txt");
}

namespace {

void load_vocab(const std::string& path, std::unordered_map<std::string, int32_t>& vocab) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* root = doc.root_object();
  JsonObjectIter iter;
  json_object_iter_init(&iter, root);
  const gchar* name = nullptr;
  JsonNode* node = nullptr;
  while (json_object_iter_next(&iter, &name, &node)) {
    if (!JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_INT64)
      throw Error(path + ": id of token '" + name + "' is not an integer");
    gint64 id = json_node_get_int(node);
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      throw Error(path + ": id of token '" + name + "' is out of range (" + std::to_string(id) + ")");
    vocab[name] = static_cast<int32_t>(id);
  }
  if (vocab.empty()) throw Error(path + ": vocabulary is empty");
  for (std::string_view special : {kBosToken, kEosToken})
    if (vocab.find(std::string(special)) == vocab.end())
      throw Error(path + ": missing special token '" + std::string(special) + "'");
}

void load_merges(const std::string& path, std::unordered_map<std::string, int32_t>& ranks) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(path + ": read error");
  const std::string content = ss.str();

  // As HF: strip the file, split on '\n', skip the "#version" line, and use only the first
  // 49152 - 256 - 2 merges (CLIP's vocabulary budget).
  std::string_view text(content);
  strip_ascii_ws(text);
  if (text.empty()) throw Error(path + ": file is empty (expected a '#version' line and merges)");
  constexpr size_t kMaxMerges = 49152 - 256 - 2;
  size_t line_no = 0;  // 0 = header
  size_t pos = 0;
  while (pos <= text.size() && line_no <= kMaxMerges) {
    size_t nl = text.find('\n', pos);
    size_t end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line_no == 0) {
      if (line.substr(0, 8) != "#version") throw Error(path + ": first line is not a '#version' header");
      ++line_no;
      continue;
    }
    strip_ascii_ws(line);
    if (!line.empty()) {
      size_t sp = line.find_first_of(" \t");
      std::string_view a = line.substr(0, sp == std::string_view::npos ? line.size() : sp);
      std::string_view b;
      if (sp != std::string_view::npos) {
        b = line.substr(sp);
        strip_ascii_ws(b);
      }
      if (b.empty() || b.find_first_of(" \t") != std::string_view::npos)
        throw Error(path + ": line " + std::to_string(line_no + 1) + ": expected two space-separated symbols, got '" +
                    std::string(line) + "'");
      std::string key;
      key.append(a).push_back(' ');
      key.append(b);
      // Python's dict(zip(...)): a repeated pair keeps its last rank.
      ranks[key] = static_cast<int32_t>(line_no - 1);
    }
    ++line_no;
    if (nl == std::string_view::npos) break;
  }
}

}  // namespace

ClipTokenizer ClipTokenizer::from_files(const std::string& vocab_json_path, const std::string& merges_txt_path) {
  auto impl = std::make_unique<Impl>();
  load_vocab(vocab_json_path, impl->vocab);
  load_merges(merges_txt_path, impl->bpe_ranks);
  impl->bos = impl->vocab.at(std::string(kBosToken));
  impl->eos = impl->vocab.at(std::string(kEosToken));
  return ClipTokenizer(std::move(impl));
}

int32_t ClipTokenizer::bos_id() const { return impl_->bos; }
int32_t ClipTokenizer::eos_id() const { return impl_->eos; }
size_t ClipTokenizer::vocab_size() const { return impl_->vocab.size(); }

namespace {

U32 normalize_piece(const U32& piece) { return python_lower(whitespace_clean(fix_text(piece))); }

}  // namespace

std::string ClipTokenizer::normalize_text(std::string_view utf8_text) {
  require_utf8(utf8_text, "ClipTokenizer::normalize_text");
  return encode_utf8(normalize_piece(decode_utf8(utf8_text)));
}

std::string ftfy_fix_text(std::string_view utf8_text) {
  require_utf8(utf8_text, "ftfy_fix_text");
  return encode_utf8(fix_text(decode_utf8(utf8_text)));
}

std::vector<int32_t> ClipTokenizer::encode(std::string_view utf8_text, size_t max_length) const {
  if (max_length < 2)
    throw Error("ClipTokenizer::encode: max_length " + std::to_string(max_length) +
                " leaves no room for the start and end tokens (need >= 2)");
  require_utf8(utf8_text, "ClipTokenizer::encode");

  std::vector<int32_t> ids;
  auto tokenize_piece = [&](std::string_view piece) {
    if (piece.empty()) return;
    for (const U32& word : pre_tokenize(normalize_piece(decode_utf8(piece))))
      impl_->append_word_ids(encode_utf8(word), ids);
  };

  // HF first splits the raw text on the special tokens, which bypass normalisation.
  size_t pos = 0;
  size_t piece_start = 0;
  while ((pos = utf8_text.find("<|", pos)) != std::string_view::npos) {
    std::string_view rest = utf8_text.substr(pos);
    int32_t special = -1;
    size_t len = 0;
    if (rest.substr(0, kBosToken.size()) == kBosToken) {
      special = impl_->bos;
      len = kBosToken.size();
    } else if (rest.substr(0, kEosToken.size()) == kEosToken) {
      special = impl_->eos;
      len = kEosToken.size();
    }
    if (special < 0) {
      pos += 2;
      continue;
    }
    tokenize_piece(utf8_text.substr(piece_start, pos - piece_start));
    ids.push_back(special);
    pos += len;
    piece_start = pos;
  }
  tokenize_piece(utf8_text.substr(piece_start));

  if (ids.size() > max_length - 2) ids.resize(max_length - 2);
  std::vector<int32_t> out;
  out.reserve(ids.size() + 2);
  out.push_back(impl_->bos);
  out.insert(out.end(), ids.begin(), ids.end());
  out.push_back(impl_->eos);
  return out;
}

std::vector<std::vector<int32_t>> ClipTokenizer::encode_batch(const std::vector<std::string>& texts,
                                                              size_t max_length) const {
  std::vector<std::vector<int32_t>> out;
  out.reserve(texts.size());
  for (const auto& t : texts) out.push_back(encode(t, max_length));
  return out;
}

}  // namespace moe
