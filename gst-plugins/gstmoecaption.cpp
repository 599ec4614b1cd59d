/**
 * SECTION:element-moe-caption
 * @title: moe-caption
 * @see_also: ann-query, textoverlay, moe-encode
 *
 * moe-caption turns ann-query's result documents (application/json, docs/zmq-schema.md) into
 * text for textoverlay's text_sink: one Pango markup buffer per document, stamped with the PTS
 * of the video frame the result was computed from, so that a video plays with its best catalog
 * matches written on the frames they describe. The video goes to textoverlay on one branch of a
 * tee and to moe-encode on another (below): moe-encode consumes the frames it embeds, and each
 * result keeps its frame's PTS through the chain.
 *
 * Each of the top `hits` hits whose score reaches `min-score` becomes one line, written by the
 * `format` template: Pango markup in which `{caption}`, `{id}`, `{uri}`, `{item}`, `{rank}` and
 * `{score}` (6 decimals; `{score:.2f}`: 2) stand for the hit's members, escaped for markup and
 * cut to 512 bytes; `{{` and `}}` are braces; a null member is empty text. A document without
 * hits (an empty catalog, none above `min-score`) clears the caption. An error document shows
 * its reason (`errors=show`) or clears the caption (`errors=skip`); index-built documents are
 * ignored.
 *
 * Timing: with `duration=0` (the default) a caption lasts until the next document's frame, so
 * that the captions tile the video however many frames the search skips (a leaky queue, moe-encode
 * falling behind), and each caption is replaced as soon as a newer result covers the video; a
 * caption waits for the next document (or a GAP event) to learn its end; at the end of the stream
 * it lasts as long as the one before it, or 1 s. A fixed `duration` sends each caption at once;
 * textoverlay then keeps it for that long and holds later captions back meanwhile, so choose one
 * no longer than the time between results. Documents without a PTS (text queries) are sent at once, untimed
 * (textoverlay shows them on one frame); a document for a frame not after the caption waiting for
 * its end is dropped as late. With a live source (a camera) each frame reaches the sink after its
 * caption does, about one search and one result interval late: when that exceeds the latency the
 * pipeline reports, delay the display by it (the video sink's `ts-offset`, or
 * gst_pipeline_set_latency()), or the sink drops the frames as late.
 *
 * Every text buffer carries the document's result as a GstMoeResultMeta (gstmoeresultmeta.h;
 * GObject-Introspection namespace GstMoe): the request id, the frame's PTS, all hits, the experts,
 * or the error's code and reason, for applications in C or Python (an appsink after moe-caption).
 *
 * JSON is input from outside: a document over 16 MiB, nested deeper than 72 levels, not UTF-8 or
 * not JSON, or whose members have the wrong types, is refused (counted and logged, the first one
 * posted as a warning) and changes nothing; the stream goes on.
 *
 * The `stats` property counts, since the element started: documents in, captions out, results,
 * errors, ignored (other document types), refused and late documents, and the last refusal's
 * reason.
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 videotestsrc num-buffers=60 ! videoconvert ! tee name=t \
 *     t. ! queue ! textoverlay name=o valignment=top ! videoconvert ! autovideosink \
 *     t. ! queue leaky=downstream max-size-buffers=2 ! videoconvert \
 *     ! moe-encode model=models/default/clip max-batch=1 ! moe-route model=models/default/adapter \
 *     ! moe-expert model=models/default/adapter ! ann-query index=build/catalog.faiss k=1 \
 *     ! moe-caption ! o.text_sink
 * ]| The test pattern with its best catalog match written on each frame (pipelines/caption-video.sh
 * does this for a video file).
 * |[
 * gst-launch-1.0 filesrc location=result.json ! application/json \
 *     ! moe-caption format="<b>{caption}</b> {score:.3f}" hits=3 ! fakesink dump=true
 * ]| One saved result document as three lines of markup.
 */

/* Why hold a caption until the next document: textoverlay keeps one text buffer at a time and
 * blocks its text pad until the video has passed that buffer's end, so a caption that lasts longer
 * than the time to the next result delays every later one (and through them the search branch),
 * while a caption shorter than that leaves frames bare. The next document's PTS is the one end
 * that is right in both cases; the price is one result interval of latency on the text, which the
 * video branch's queue absorbs.
 *
 * Threads: documents are turned into captions on the streaming thread (generate_output); `stats`
 * is read from any thread under the object lock. The running state is the streaming thread's.
 */
#include "gstmoecaption.h"

#include <json-glib/json-glib.h>

#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gstmoemeta.h"
#include "gstmoeresultmeta.h"
#include "moe/error.h"
#include "moe/json_bounds.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_caption_debug);
#define GST_CAT_DEFAULT gst_moe_caption_debug

enum { PROP_0, PROP_FORMAT, PROP_HITS, PROP_MIN_SCORE, PROP_DURATION, PROP_ERRORS, PROP_STATS };

#define DEFAULT_FORMAT "{caption} ({score:.2f})"
#define DEFAULT_HITS 1
#define MAX_HITS 1024  // ann-query's largest k
#define DEFAULT_MIN_SCORE -1.0
#define DEFAULT_DURATION 0  // until the next document's frame
#define MAX_DURATION (3600 * GST_SECOND)
#define DEFAULT_ERRORS GST_MOE_CAPTION_ERRORS_SKIP

namespace {

// A result document holds at most 1024 hits, each with its catalog line's fields (nested up to the
// catalog's own bound, 64 levels, inside the document's few).
constexpr moe::JsonBounds kDocumentBounds{16u << 20, moe::kMaxFileJsonDepth + 8};
// What one substituted value may add to the text textoverlay lays out for every frame.
constexpr size_t kMaxValueBytes = 512;
// The last caption of a stream lasts as long as the one before it, or this when it is the only one.
constexpr GstClockTime kLoneCaptionDuration = GST_SECOND;

// One piece of the `format` template.
struct Piece {
  enum class Kind { Literal, Caption, Id, Uri, Item, Rank, Score } kind = Kind::Literal;
  std::string literal;  // Kind::Literal: markup, as written
  int decimals = 6;     // Kind::Score
};

struct Hit {
  gint64 item = 0;
  std::string id, caption, uri;  // "" with has_* false: null or absent
  bool has_id = false, has_caption = false, has_uri = false;
  double score = 0.0;
};

// What one document says, read and checked before anything is sent.
struct Document {
  enum class Type { Result, Error, Other } type = Type::Other;
  std::string request_id;
  bool has_request_id = false;
  GstClockTime pts = GST_CLOCK_TIME_NONE;
  GstClockTime stream_time = GST_CLOCK_TIME_NONE;
  std::vector<Hit> hits;
  std::vector<std::pair<gint, double>> experts;
  std::string error_code, error_reason;
};

// What one run works with: created by start(), destroyed by stop(). Streaming thread only.
struct CaptionState {
  std::vector<Piece> format;
  guint hits = DEFAULT_HITS;
  double min_score = DEFAULT_MIN_SCORE;
  GstClockTime duration = DEFAULT_DURATION;
  GstMoeCaptionErrors errors = DEFAULT_ERRORS;
  GstBuffer* held = nullptr;  // duration=0: the last caption, until the next document's PTS ends it
  GstClockTime last_duration = GST_CLOCK_TIME_NONE;  // the duration the last caption sent got
  std::deque<GstBuffer*> ready;                      // captions to send, oldest first

  CaptionState() = default;
  CaptionState(const CaptionState&) = delete;
  CaptionState& operator=(const CaptionState&) = delete;
  ~CaptionState() { drop(); }
  void drop() {
    if (held) gst_buffer_unref(held);
    held = nullptr;
    for (GstBuffer* b : ready) gst_buffer_unref(b);
    ready.clear();
    last_duration = GST_CLOCK_TIME_NONE;
  }
};

}  // namespace

struct _GstMoeCaption {
  GstBaseTransform parent;

  // Properties, under the object lock; read when the element starts.
  gchar* format;
  guint hits;
  gdouble min_score;
  guint64 duration;
  GstMoeCaptionErrors errors;

  // Behind `stats`: reset at start, kept after stop; under the object lock.
  guint64 documents, captions, results, failures, ignored, refused, late;
  std::string* last_refusal;

  // Between start() and stop(), nullptr otherwise; the streaming thread's.
  CaptionState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_JSON_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS("text/x-raw, format=pango-markup"));

#define gst_moe_caption_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeCaption, gst_moe_caption, GST_TYPE_BASE_TRANSFORM,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_caption_debug, "moe-caption", 0,
                                                "Search results as text for textoverlay"));
GST_ELEMENT_REGISTER_DEFINE(moe_caption, "moe-caption", GST_RANK_NONE, GST_TYPE_MOE_CAPTION);

GType gst_moe_caption_errors_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_CAPTION_ERRORS_SKIP, "No caption for the frame", "skip"},
      {GST_MOE_CAPTION_ERRORS_SHOW, "The error's reason as the caption", "show"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoeCaptionErrors", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

namespace {

// Parses `format` into pieces; throws moe::Error naming the position of what is wrong, and when
// the template is not well-formed markup once its placeholders are filled in.
std::vector<Piece> parse_format(const std::string& format) {
  std::vector<Piece> pieces;
  std::string literal, skeleton;  // skeleton: the template with every placeholder as "x"
  auto flush_literal = [&] {
    if (literal.empty()) return;
    pieces.push_back({Piece::Kind::Literal, literal, 0});
    skeleton += literal;
    literal.clear();
  };
  for (size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if ((c == '{' || c == '}') && i + 1 < format.size() && format[i + 1] == c) {
      literal += c;
      ++i;
      continue;
    }
    if (c == '}') throw moe::Error("a lone '}' at byte " + std::to_string(i) + " (write '}}' for a brace)");
    if (c != '{') {
      literal += c;
      continue;
    }
    const size_t close = format.find('}', i);
    if (close == std::string::npos) throw moe::Error("the '{' at byte " + std::to_string(i) + " is not closed");
    const std::string spec = format.substr(i + 1, close - i - 1);
    const std::string name = spec.substr(0, spec.find(':'));
    Piece p;
    if (name == "caption")
      p.kind = Piece::Kind::Caption;
    else if (name == "id")
      p.kind = Piece::Kind::Id;
    else if (name == "uri")
      p.kind = Piece::Kind::Uri;
    else if (name == "item")
      p.kind = Piece::Kind::Item;
    else if (name == "rank")
      p.kind = Piece::Kind::Rank;
    else if (name == "score")
      p.kind = Piece::Kind::Score;
    else
      throw moe::Error("unknown placeholder '{" + spec + "}' at byte " + std::to_string(i) +
                       " (caption, id, uri, item, rank, score)");
    if (spec.size() > name.size()) {
      const std::string conv = spec.substr(name.size() + 1);
      if (p.kind != Piece::Kind::Score || conv.size() != 3 || conv[0] != '.' || conv[2] != 'f' ||
          !g_ascii_isdigit(conv[1]) || conv[1] > '6')
        throw moe::Error("'{" + spec + "}' at byte " + std::to_string(i) +
                         ": only score takes a precision, as {score:.Nf} with N from 0 to 6");
      p.decimals = conv[1] - '0';
    }
    flush_literal();
    pieces.push_back(p);
    skeleton += "x";
    i = close;
  }
  flush_literal();

  // Pango markup is GMarkup inside a <markup> element: what GMarkup refuses, Pango does too.
  static const GMarkupParser no_callbacks = {};
  GMarkupParseContext* ctx =
      g_markup_parse_context_new(&no_callbacks, static_cast<GMarkupParseFlags>(0), nullptr, nullptr);
  const std::string doc = "<markup>" + skeleton + "</markup>";
  GError* err = nullptr;
  const bool ok = g_markup_parse_context_parse(ctx, doc.data(), static_cast<gssize>(doc.size()), &err) &&
                  g_markup_parse_context_end_parse(ctx, &err);
  g_markup_parse_context_free(ctx);
  if (!ok) {
    const std::string why = err ? err->message : "not well-formed";
    g_clear_error(&err);
    throw moe::Error("not Pango markup: " + why);
  }
  return pieces;
}

// `value` escaped for markup, cut at a character boundary to kMaxValueBytes ("..." appended).
std::string markup_value(const std::string& value) {
  std::string v = value;
  if (v.size() > kMaxValueBytes) {
    const gchar* end = g_utf8_find_prev_char(v.c_str(), v.c_str() + kMaxValueBytes + 1);
    v.resize(end ? static_cast<size_t>(end - v.c_str()) : 0);
    v += "...";
  }
  gchar* escaped = g_markup_escape_text(v.data(), static_cast<gssize>(v.size()));
  std::string out = escaped;
  g_free(escaped);
  return out;
}

std::string render_hit(const std::vector<Piece>& format, const Hit& hit, guint rank) {
  std::string line;
  for (const Piece& p : format) {
    switch (p.kind) {
      case Piece::Kind::Literal:
        line += p.literal;
        break;
      case Piece::Kind::Caption:
        line += markup_value(hit.caption);
        break;
      case Piece::Kind::Id:
        line += markup_value(hit.id);
        break;
      case Piece::Kind::Uri:
        line += markup_value(hit.uri);
        break;
      case Piece::Kind::Item:
        line += std::to_string(hit.item);
        break;
      case Piece::Kind::Rank:
        line += std::to_string(rank);
        break;
      case Piece::Kind::Score: {
        gchar fmt[8], buf[G_ASCII_DTOSTR_BUF_SIZE];
        g_snprintf(fmt, sizeof fmt, "%%.%df", p.decimals);
        line += g_ascii_formatd(buf, sizeof buf, fmt, hit.score);  // '.' whatever the locale
        break;
      }
    }
  }
  return line;
}

// Members, checked: absent and null are "none"; any other type than the one asked for throws,
// naming the member (`where` is its object's path, "results[2]").
JsonNode* member(JsonObject* obj, const char* key) {
  JsonNode* n = json_object_get_member(obj, key);
  return n && !JSON_NODE_HOLDS_NULL(n) ? n : nullptr;
}

bool read_string(JsonObject* obj, const char* key, const std::string& where, std::string* out) {
  JsonNode* n = member(obj, key);
  if (!n) return false;
  if (!JSON_NODE_HOLDS_VALUE(n) || json_node_get_value_type(n) != G_TYPE_STRING)
    throw moe::Error(where + key + " is not a string");
  *out = json_node_get_string(n);
  return true;
}

bool read_int(JsonObject* obj, const char* key, const std::string& where, gint64* out) {
  JsonNode* n = member(obj, key);
  if (!n) return false;
  if (!JSON_NODE_HOLDS_VALUE(n) || json_node_get_value_type(n) != G_TYPE_INT64)
    throw moe::Error(where + key + " is not an integer");
  *out = json_node_get_int(n);
  return true;
}

double read_number(JsonObject* obj, const char* key, const std::string& where) {
  JsonNode* n = member(obj, key);
  const GType t = n && JSON_NODE_HOLDS_VALUE(n) ? json_node_get_value_type(n) : G_TYPE_INVALID;
  if (t != G_TYPE_DOUBLE && t != G_TYPE_INT64) throw moe::Error(where + key + " is not a number");
  return json_node_get_double(n);
}

// The objects of array member `key` ([] when absent or null).
std::vector<JsonObject*> read_objects(JsonObject* obj, const char* key, const std::string& where) {
  std::vector<JsonObject*> out;
  JsonNode* n = member(obj, key);
  if (!n) return out;
  if (!JSON_NODE_HOLDS_ARRAY(n)) throw moe::Error(where + key + " is not an array");
  JsonArray* a = json_node_get_array(n);
  for (guint i = 0; i < json_array_get_length(a); ++i) {
    JsonNode* e = json_array_get_element(a, i);
    if (!JSON_NODE_HOLDS_OBJECT(e)) throw moe::Error(where + key + "[" + std::to_string(i) + "] is not an object");
    out.push_back(json_node_get_object(e));
  }
  return out;
}

GstClockTime read_time(JsonObject* obj, const char* key) {
  gint64 ns = 0;
  if (!read_int(obj, key, "", &ns)) return GST_CLOCK_TIME_NONE;
  if (ns < 0) throw moe::Error(std::string(key) + " is negative");
  return static_cast<GstClockTime>(ns);
}

// Reads one document; throws moe::Error saying why it is refused.
Document read_document(const char* text, size_t size) {
  const std::string_view view(text, size);
  const std::string bounds = moe::json_bounds_violation(view, kDocumentBounds);
  if (!bounds.empty()) throw moe::Error("beyond the JSON bounds: " + bounds);
  if (!g_utf8_validate(text, static_cast<gssize>(size), nullptr)) throw moe::Error("not UTF-8 (or a NUL byte)");
  JsonParser* parser = json_parser_new_immutable();
  GError* err = nullptr;
  if (!json_parser_load_from_data(parser, text, static_cast<gssize>(size), &err)) {
    const std::string why = err ? err->message : "unreadable";
    g_clear_error(&err);
    g_object_unref(parser);
    throw moe::Error("not JSON: " + why);
  }
  Document doc;
  try {
    JsonNode* root = json_parser_get_root(parser);
    if (!root || !JSON_NODE_HOLDS_OBJECT(root)) throw moe::Error("not a JSON object");
    JsonObject* obj = json_node_get_object(root);
    std::string type;
    if (!read_string(obj, "type", "", &type)) throw moe::Error("no type");
    doc.type = type == "result"  ? Document::Type::Result
               : type == "error" ? Document::Type::Error
                                 : Document::Type::Other;
    if (doc.type != Document::Type::Other) {
      doc.has_request_id = read_string(obj, "id", "", &doc.request_id);
      doc.pts = read_time(obj, "pts_ns");
      doc.stream_time = read_time(obj, "stream_time_ns");
    }
    if (doc.type == Document::Type::Result) {
      const std::vector<JsonObject*> results = read_objects(obj, "results", "");
      for (size_t i = 0; i < results.size(); ++i) {
        const std::string where = "results[" + std::to_string(i) + "].";
        Hit h;
        if (!read_int(results[i], "item", where, &h.item)) throw moe::Error(where + "item is missing");
        h.score = read_number(results[i], "score", where);
        h.has_id = read_string(results[i], "id", where, &h.id);
        h.has_caption = read_string(results[i], "caption", where, &h.caption);
        h.has_uri = read_string(results[i], "uri", where, &h.uri);
        doc.hits.push_back(std::move(h));
      }
      const std::vector<JsonObject*> experts = read_objects(obj, "experts", "");
      for (size_t i = 0; i < experts.size(); ++i) {
        const std::string where = "experts[" + std::to_string(i) + "].";
        gint64 e = 0;
        if (!read_int(experts[i], "expert", where, &e) || e < 0 || e > G_MAXINT)
          throw moe::Error(where + "expert is missing or out of range");
        doc.experts.emplace_back(static_cast<gint>(e), read_number(experts[i], "weight", where));
      }
    } else if (doc.type == Document::Type::Error) {
      JsonNode* e = member(obj, "error");
      if (!e || !JSON_NODE_HOLDS_OBJECT(e)) throw moe::Error("error is not an object");
      JsonObject* eo = json_node_get_object(e);
      if (!read_string(eo, "code", "error.", &doc.error_code)) throw moe::Error("error.code is missing");
      if (!read_string(eo, "reason", "error.", &doc.error_reason)) throw moe::Error("error.reason is missing");
    }
  } catch (...) {
    g_object_unref(parser);
    throw;
  }
  g_object_unref(parser);
  return doc;
}

// The caption's markup for `doc`.
std::string caption_text(const CaptionState& st, const Document& doc) {
  if (doc.type == Document::Type::Error)
    return st.errors == GST_MOE_CAPTION_ERRORS_SHOW ? markup_value(doc.error_reason) : std::string();
  std::string text;
  guint shown = 0;
  for (size_t i = 0; i < doc.hits.size() && shown < st.hits; ++i) {
    if (doc.hits[i].score < st.min_score) continue;
    if (shown++) text += '\n';
    text += render_hit(st.format, doc.hits[i], static_cast<guint>(i + 1));
  }
  return text;
}

GstBuffer* caption_buffer(const std::string& text, const Document& doc, GstClockTime pts) {
  GstBuffer* buf = text.empty() ? gst_buffer_new() : gst_buffer_new_memdup(text.data(), text.size());
  GST_BUFFER_PTS(buf) = pts;
  GstMoeResultMeta* meta =
      gst_buffer_add_moe_result_meta(buf, doc.has_request_id ? doc.request_id.c_str() : nullptr, pts, doc.stream_time);
  for (const Hit& h : doc.hits)
    gst_moe_result_meta_add_hit(meta, h.item, h.has_id ? h.id.c_str() : nullptr,
                                h.has_caption ? h.caption.c_str() : nullptr, h.has_uri ? h.uri.c_str() : nullptr,
                                h.score);
  for (const auto& [expert, weight] : doc.experts) gst_moe_result_meta_add_expert(meta, expert, weight);
  if (doc.type == Document::Type::Error)
    gst_moe_result_meta_set_error(meta, doc.error_code.c_str(), doc.error_reason.c_str());
  return buf;
}

// Queues the held caption, ending at `end`: the next document's PTS, or where a gap in the
// documents starts.
void end_held(CaptionState* st, GstClockTime end) {
  st->last_duration = end - GST_BUFFER_PTS(st->held);
  GST_BUFFER_DURATION(st->held) = st->last_duration;
  st->ready.push_back(st->held);
  st->held = nullptr;
}

// Queues the held caption with the duration a stream's end gives it.
void release_held(CaptionState* st) {
  if (!st->held) return;
  GST_BUFFER_DURATION(st->held) = GST_CLOCK_TIME_IS_VALID(st->last_duration) ? st->last_duration : kLoneCaptionDuration;
  st->ready.push_back(st->held);
  st->held = nullptr;
}

}  // namespace

static void gst_moe_caption_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeCaption* self = GST_MOE_CAPTION(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_FORMAT:
      g_free(self->format);
      self->format = g_value_dup_string(value);
      if (!self->format) self->format = g_strdup(DEFAULT_FORMAT);
      break;
    case PROP_HITS:
      self->hits = g_value_get_uint(value);
      break;
    case PROP_MIN_SCORE:
      self->min_score = g_value_get_double(value);
      break;
    case PROP_DURATION:
      self->duration = g_value_get_uint64(value);
      break;
    case PROP_ERRORS:
      self->errors = static_cast<GstMoeCaptionErrors>(g_value_get_enum(value));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_moe_caption_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeCaption* self = GST_MOE_CAPTION(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_FORMAT:
      g_value_set_string(value, self->format);
      break;
    case PROP_HITS:
      g_value_set_uint(value, self->hits);
      break;
    case PROP_MIN_SCORE:
      g_value_set_double(value, self->min_score);
      break;
    case PROP_DURATION:
      g_value_set_uint64(value, self->duration);
      break;
    case PROP_ERRORS:
      g_value_set_enum(value, self->errors);
      break;
    case PROP_STATS:
      g_value_take_boxed(
          value, gst_structure_new("moe-caption-stats", "documents", G_TYPE_UINT64, self->documents, "captions",
                                   G_TYPE_UINT64, self->captions, "results", G_TYPE_UINT64, self->results, "errors",
                                   G_TYPE_UINT64, self->failures, "ignored", G_TYPE_UINT64, self->ignored, "refused",
                                   G_TYPE_UINT64, self->refused, "late", G_TYPE_UINT64, self->late, "last-refusal",
                                   G_TYPE_STRING, self->last_refusal->c_str(), nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static gboolean gst_moe_caption_start(GstBaseTransform* trans) {
  GstMoeCaption* self = GST_MOE_CAPTION(trans);
  auto* state = new CaptionState();
  GST_OBJECT_LOCK(self);
  const std::string format = self->format;
  state->hits = self->hits;
  state->min_score = self->min_score;
  state->duration = self->duration;
  state->errors = self->errors;
  GST_OBJECT_UNLOCK(self);
  try {
    state->format = parse_format(format);
  } catch (const moe::Error& e) {
    delete state;
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("format '%s': %s", format.c_str(), e.what()), (nullptr));
    return FALSE;
  }
  GST_OBJECT_LOCK(self);
  self->state = state;
  self->documents = self->captions = self->results = self->failures = self->ignored = self->refused = self->late = 0;
  self->last_refusal->clear();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_moe_caption_stop(GstBaseTransform* trans) {
  GstMoeCaption* self = GST_MOE_CAPTION(trans);
  GST_OBJECT_LOCK(self);
  CaptionState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;
  return TRUE;
}

static GstCaps* gst_moe_caption_transform_caps(GstBaseTransform* trans, GstPadDirection direction, GstCaps*,
                                               GstCaps* filter) {
  GstPad* other = direction == GST_PAD_SINK ? trans->srcpad : trans->sinkpad;
  GstCaps* caps = gst_pad_get_pad_template_caps(other);
  if (filter) {
    GstCaps* both = gst_caps_intersect_full(filter, caps, GST_CAPS_INTERSECT_FIRST);
    gst_caps_unref(caps);
    caps = both;
  }
  return caps;
}

// Reads one document and queues what it becomes (nothing, when it is refused or ignored); false
// only when the buffer cannot be read at all.
static bool gst_moe_caption_take_document(GstMoeCaption* self, GstBuffer* in) {
  CaptionState* st = self->state;
  GstMapInfo map;
  if (!gst_buffer_map(in, &map, GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, ("cannot map a document buffer for reading"), (nullptr));
    return false;
  }
  Document doc;
  std::string refusal;
  try {
    doc = read_document(reinterpret_cast<const char*>(map.data), map.size);
  } catch (const moe::Error& e) {
    refusal = e.what();
  }
  gst_buffer_unmap(in, &map);

  GST_OBJECT_LOCK(self);
  ++self->documents;
  const bool first_refusal = !refusal.empty() && self->refused++ == 0;
  if (!refusal.empty()) *self->last_refusal = refusal;
  if (refusal.empty() && doc.type == Document::Type::Other) ++self->ignored;
  GST_OBJECT_UNLOCK(self);
  if (!refusal.empty()) {
    GST_WARNING_OBJECT(self, "document of %" G_GSIZE_FORMAT " bytes refused: %s", gst_buffer_get_size(in),
                       refusal.c_str());
    if (first_refusal)
      GST_ELEMENT_WARNING(self, STREAM, DECODE, ("a result document was refused: %s", refusal.c_str()),
                          ("later refusals are counted in stats, not posted"));
    return true;
  }
  if (doc.type == Document::Type::Other) return true;

  // The buffer's PTS is the frame's in this stream's segment; the document's pts_ns the same
  // number as moe-encode saw it (what a document from a file still has).
  const GstClockTime pts = GST_BUFFER_PTS_IS_VALID(in) ? GST_BUFFER_PTS(in) : doc.pts;
  if (GST_CLOCK_TIME_IS_VALID(pts) && st->held && pts <= GST_BUFFER_PTS(st->held)) {
    GST_OBJECT_LOCK(self);
    ++self->late;
    GST_OBJECT_UNLOCK(self);
    GST_DEBUG_OBJECT(self, "late document for %" GST_TIME_FORMAT " dropped", GST_TIME_ARGS(pts));
    return true;
  }
  const std::string text = caption_text(*st, doc);
  GstBuffer* caption = caption_buffer(text, doc, pts);
  GST_DEBUG_OBJECT(self, "caption at %" GST_TIME_FORMAT ": '%s'", GST_TIME_ARGS(pts), text.c_str());
  GST_OBJECT_LOCK(self);
  ++(doc.type == Document::Type::Result ? self->results : self->failures);
  GST_OBJECT_UNLOCK(self);

  if (!GST_CLOCK_TIME_IS_VALID(pts)) {  // untimed: textoverlay shows it on one frame
    release_held(st);
    st->ready.push_back(caption);
  } else if (st->duration > 0) {
    GST_BUFFER_DURATION(caption) = st->duration;
    st->ready.push_back(caption);
  } else {
    if (st->held) end_held(st, pts);
    st->held = caption;
  }
  return true;
}

static GstFlowReturn gst_moe_caption_generate_output(GstBaseTransform* trans, GstBuffer** outbuf) {
  GstMoeCaption* self = GST_MOE_CAPTION(trans);
  CaptionState* st = self->state;
  if (trans->queued_buf) {
    GstBuffer* in = trans->queued_buf;
    trans->queued_buf = nullptr;
    const bool read = gst_moe_caption_take_document(self, in);
    gst_buffer_unref(in);
    if (!read) return GST_FLOW_ERROR;
  }
  *outbuf = nullptr;
  if (!st->ready.empty()) {
    *outbuf = st->ready.front();
    st->ready.pop_front();
    GST_OBJECT_LOCK(self);
    ++self->captions;
    GST_OBJECT_UNLOCK(self);
  }
  return GST_FLOW_OK;
}

// Sends the queued captions, ahead of an event.
static GstFlowReturn gst_moe_caption_push_ready(GstMoeCaption* self) {
  CaptionState* st = self->state;
  GstFlowReturn ret = GST_FLOW_OK;
  while (!st->ready.empty()) {
    GstBuffer* b = st->ready.front();
    st->ready.pop_front();
    if (ret != GST_FLOW_OK) {
      gst_buffer_unref(b);
      continue;
    }
    GST_OBJECT_LOCK(self);
    ++self->captions;
    GST_OBJECT_UNLOCK(self);
    ret = gst_pad_push(GST_BASE_TRANSFORM_SRC_PAD(self), b);
  }
  return ret;
}

static gboolean gst_moe_caption_sink_event(GstBaseTransform* trans, GstEvent* event) {
  GstMoeCaption* self = GST_MOE_CAPTION(trans);
  CaptionState* st = self->state;
  if (st) {
    switch (GST_EVENT_TYPE(event)) {
      case GST_EVENT_EOS:
      case GST_EVENT_SEGMENT:
      case GST_EVENT_STREAM_START:
        // The held caption belongs to the stream or segment that ends here.
        release_held(st);
        if (gst_moe_caption_push_ready(self) != GST_FLOW_OK)
          GST_DEBUG_OBJECT(self, "captions ahead of an event not sent");
        st->last_duration = GST_CLOCK_TIME_NONE;
        break;
      case GST_EVENT_GAP: {
        // No document before the gap's start: the held caption ends there, and must reach
        // textoverlay before the gap moves its text position past it.
        GstClockTime start = GST_CLOCK_TIME_NONE;
        gst_event_parse_gap(event, &start, nullptr);
        if (st->held && GST_CLOCK_TIME_IS_VALID(start) && start > GST_BUFFER_PTS(st->held)) end_held(st, start);
        if (gst_moe_caption_push_ready(self) != GST_FLOW_OK) GST_DEBUG_OBJECT(self, "captions ahead of a gap not sent");
        break;
      }
      case GST_EVENT_FLUSH_STOP:
        st->drop();
        break;
      default:
        break;
    }
  }
  return GST_BASE_TRANSFORM_CLASS(parent_class)->sink_event(trans, event);
}

static void gst_moe_caption_finalize(GObject* object) {
  GstMoeCaption* self = GST_MOE_CAPTION(object);
  g_free(self->format);
  delete self->last_refusal;
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_caption_class_init(GstMoeCaptionClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseTransformClass* trans_class = GST_BASE_TRANSFORM_CLASS(klass);

  gobject_class->set_property = gst_moe_caption_set_property;
  gobject_class->get_property = gst_moe_caption_get_property;
  gobject_class->finalize = gst_moe_caption_finalize;

  g_object_class_install_property(
      gobject_class, PROP_FORMAT,
      g_param_spec_string("format", "Line template",
                          "Pango markup for each hit's line: {caption}, {id}, {uri}, {item}, {rank}, {score} "
                          "(6 decimals) or {score:.Nf} (N = 0..6) stand for the hit's members, escaped; {{ and }} "
                          "are braces",
                          DEFAULT_FORMAT, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_HITS,
      g_param_spec_uint("hits", "Hits shown", "How many of the best hits are written, one line each", 1, MAX_HITS,
                        DEFAULT_HITS, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_MIN_SCORE,
      g_param_spec_double("min-score", "Lowest score shown",
                          "Hits with a lower score are not written (a frame with none gets no caption)", -1.0, 1.0,
                          DEFAULT_MIN_SCORE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_DURATION,
      g_param_spec_uint64("duration", "Caption duration",
                          "How long each caption is shown, in nanoseconds; 0: until the next document's frame (each "
                          "caption waits for that document)",
                          0, MAX_DURATION, DEFAULT_DURATION, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_ERRORS,
      g_param_spec_enum("errors", "Error documents",
                        "skip: the frame gets no caption; show: the error's reason is the caption",
                        GST_TYPE_MOE_CAPTION_ERRORS, DEFAULT_ERRORS, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec("Since the element started: documents (in), captions (text buffers out), results and "
                               "errors (documents of each type captioned), ignored (other document types), refused "
                               "(not JSON, beyond the bounds, members of the wrong type), late (for a frame not after "
                               "the caption waiting for its end) and last-refusal (why the last one was refused)"));

  gst_element_class_set_static_metadata(
      element_class, "MoE result captions", "Filter/Text",
      "Turns ann-query's result documents into Pango markup text for textoverlay, one buffer per document with the "
      "PTS of the video frame it describes, and attaches the result as a GstMoeResultMeta. Example: ... ! ann-query "
      "index=catalog.faiss k=1 ! moe-caption format=\"{caption} ({score:.2f})\" ! textoverlay.text_sink",
      "gst-moe developers");
  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);

  trans_class->start = GST_DEBUG_FUNCPTR(gst_moe_caption_start);
  trans_class->stop = GST_DEBUG_FUNCPTR(gst_moe_caption_stop);
  trans_class->transform_caps = GST_DEBUG_FUNCPTR(gst_moe_caption_transform_caps);
  trans_class->generate_output = GST_DEBUG_FUNCPTR(gst_moe_caption_generate_output);
  trans_class->sink_event = GST_DEBUG_FUNCPTR(gst_moe_caption_sink_event);

  gst_type_mark_as_plugin_api(GST_TYPE_MOE_CAPTION_ERRORS, static_cast<GstPluginAPIFlags>(0));
}

static void gst_moe_caption_init(GstMoeCaption* self) {
  self->format = g_strdup(DEFAULT_FORMAT);
  self->hits = DEFAULT_HITS;
  self->min_score = DEFAULT_MIN_SCORE;
  self->duration = DEFAULT_DURATION;
  self->errors = DEFAULT_ERRORS;
  self->documents = self->captions = self->results = self->failures = self->ignored = self->refused = self->late = 0;
  self->last_refusal = new std::string();
  self->state = nullptr;
}
