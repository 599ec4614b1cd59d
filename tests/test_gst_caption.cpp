// moe-caption through GstHarness: result documents in, Pango markup text buffers out, timed by
// their frames and carrying the result as a GstMoeResultMeta; error documents, the template and
// its checks, and hostile JSON (each refused, counted, and the stream going on).
#include <gst/check/gstharness.h>
#include <gst/gst.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gstmoecaption.h"
#include "gstmoeresultmeta.h"

namespace {

constexpr GstClockTime kMs = GST_MSECOND;

// A result document as ann-query writes it for a video frame (docs/zmq-schema.md).
std::string result_doc(const std::string& id, GstClockTime pts, const std::string& results,
                       const std::string& experts = R"([{"expert":3,"weight":0.61},{"expert":1,"weight":0.39}])") {
  return R"({"schema":1,"type":"result","id":")" + id + R"(","modality":"image","query":null,"uri":null,"k":3,)" +
         R"("results":)" + results + R"(,"experts":)" + experts + R"(,"pts_ns":)" + std::to_string(pts) +
         R"(,"stream_time_ns":)" + std::to_string(pts) + "}";
}

const std::string kThreeHits =
    R"([{"rank":1,"item":4,"id":"SKU-4","uri":null,"caption":"red <mug> & co","score":0.8312,"fields":{}},)"
    R"({"rank":2,"item":7,"id":"SKU-7","uri":"file:///c/7.png","caption":"striped cup","score":0.79,"fields":{}},)"
    R"({"rank":3,"item":1,"id":"SKU-1","uri":null,"caption":null,"score":0.5,"fields":{"price":2}}])";

std::string error_doc(const std::string& id, GstClockTime pts) {
  return R"({"schema":1,"type":"error","id":")" + id + R"(","modality":"image","query":null,"uri":null,)" +
         R"("error":{"stage":"moe-encode","code":"image_undecodable","reason":"frame <3> unreadable"},"pts_ns":)" +
         std::to_string(pts) + "}";
}

GstBuffer* doc_buffer(const std::string& text, GstClockTime pts) {
  GstBuffer* b = gst_buffer_new_memdup(text.data(), text.size());
  GST_BUFFER_PTS(b) = pts;
  return b;
}

std::string text_of(GstBuffer* b) {
  GstMapInfo map;
  EXPECT_TRUE(gst_buffer_map(b, &map, GST_MAP_READ));
  std::string s(reinterpret_cast<const char*>(map.data), map.size);
  gst_buffer_unmap(b, &map);
  return s;
}

GstStructure* stats_of(GstElement* e) {
  GstStructure* s = nullptr;
  g_object_get(e, "stats", &s, nullptr);
  return s;
}

guint64 stat(GstElement* e, const char* field) {
  GstStructure* s = stats_of(e);
  guint64 v = 0;
  EXPECT_TRUE(gst_structure_get_uint64(s, field, &v)) << field;
  gst_structure_free(s);
  return v;
}

// A harness around a moe-caption made with `props` ("name", value, ..., nullptr), started with
// application/json caps.
class Caption {
 public:
  template <typename... Props>
  explicit Caption(Props... props) {
    element_ = gst_element_factory_make("moe-caption", nullptr);
    if constexpr (sizeof...(props) > 0) g_object_set(element_, props...);
    h_ = gst_harness_new_with_element(element_, "sink", "src");
    gst_harness_set_src_caps_str(h_, "application/json");
  }
  ~Caption() {
    gst_harness_teardown(h_);
    gst_object_unref(element_);
  }
  GstHarness* h() { return h_; }
  GstElement* element() { return element_; }
  GstFlowReturn push(const std::string& doc, GstClockTime pts) { return gst_harness_push(h_, doc_buffer(doc, pts)); }
  // The text buffers out so far (owned by the caller).
  std::vector<GstBuffer*> pull_all() {
    std::vector<GstBuffer*> out;
    while (GstBuffer* b = gst_harness_try_pull(h_)) out.push_back(b);
    return out;
  }

 private:
  GstElement* element_;
  GstHarness* h_;
};

void unref_all(std::vector<GstBuffer*>& bufs) {
  for (GstBuffer* b : bufs) gst_buffer_unref(b);
  bufs.clear();
}

class CaptionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    static const bool registered = [] {
      gst_init(nullptr, nullptr);
      return GST_ELEMENT_REGISTER(moe_caption, nullptr);
    }();
    ASSERT_TRUE(registered);
  }
};

}  // namespace

// Each caption waits for the next document's frame, which gives its duration: the captions tile
// the video. The last one, at EOS, lasts as long as the one before it.
TEST_F(CaptionTest, CaptionsLastUntilTheNextFrameWithAResult) {
  Caption c;
  ASSERT_EQ(c.push(result_doc("f0", 0, kThreeHits), 0), GST_FLOW_OK);
  EXPECT_EQ(gst_harness_buffers_in_queue(c.h()), 0u) << "the first caption waits for its end";
  ASSERT_EQ(c.push(result_doc("f3", 100 * kMs, kThreeHits), 100 * kMs), GST_FLOW_OK);
  ASSERT_EQ(c.push(result_doc("f7", 250 * kMs, kThreeHits), 250 * kMs), GST_FLOW_OK);
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_eos()));
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 3u);
  const GstClockTime pts[] = {0, 100 * kMs, 250 * kMs}, duration[] = {100 * kMs, 150 * kMs, 150 * kMs};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(GST_BUFFER_PTS(out[i]), pts[i]) << i;
    EXPECT_EQ(GST_BUFFER_DURATION(out[i]), duration[i]) << i;
    EXPECT_EQ(text_of(out[i]), "red &lt;mug&gt; &amp; co (0.83)") << i;  // escaped for Pango markup
  }
  GstCaps* caps = gst_pad_get_current_caps(c.h()->sinkpad);
  ASSERT_NE(caps, nullptr);
  EXPECT_TRUE(gst_caps_is_equal(caps, gst_caps_from_string("text/x-raw, format=(string)pango-markup")))
      << gst_caps_to_string(caps);
  gst_caps_unref(caps);
  unref_all(out);
  EXPECT_EQ(stat(c.element(), "documents"), 3u);
  EXPECT_EQ(stat(c.element(), "captions"), 3u);
  EXPECT_EQ(stat(c.element(), "results"), 3u);
}

// A gap in the documents ends the waiting caption where it starts, and the caption goes out ahead
// of it (textoverlay stops waiting for text before a gap's end).
TEST_F(CaptionTest, AGapEndsTheWaitingCaption) {
  Caption c;
  ASSERT_EQ(c.push(result_doc("f0", 0, kThreeHits), 0), GST_FLOW_OK);
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_gap(120 * kMs, 500 * kMs)));
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(GST_BUFFER_PTS(out[0]), 0u);
  EXPECT_EQ(GST_BUFFER_DURATION(out[0]), 120 * kMs);
  unref_all(out);
  // The gap reached downstream after the caption.
  bool gap = false;
  while (GstEvent* e = gst_harness_try_pull_event(c.h())) {
    gap |= GST_EVENT_TYPE(e) == GST_EVENT_GAP;
    gst_event_unref(e);
  }
  EXPECT_TRUE(gap);
}

// The meta holds the whole result, not only what the caption shows, and survives a buffer copy.
TEST_F(CaptionTest, TheMetaCarriesTheResult) {
  Caption c("duration", static_cast<guint64>(40 * kMs), nullptr);
  ASSERT_EQ(c.push(result_doc("frame-9", 360 * kMs, kThreeHits), 360 * kMs), GST_FLOW_OK);
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 1u) << "a fixed duration sends each caption at once";
  EXPECT_EQ(GST_BUFFER_PTS(out[0]), 360 * kMs);
  EXPECT_EQ(GST_BUFFER_DURATION(out[0]), 40 * kMs);
  GstBuffer* copy = gst_buffer_copy(out[0]);
  for (GstBuffer* b : {out[0], copy}) {
    const GstMoeResultMeta* m = gst_buffer_get_moe_result_meta(b);
    ASSERT_NE(m, nullptr);
    EXPECT_STREQ(gst_moe_result_meta_get_request_id(m), "frame-9");
    EXPECT_EQ(gst_moe_result_meta_get_pts(m), 360 * kMs);
    EXPECT_EQ(gst_moe_result_meta_get_stream_time(m), 360 * kMs);
    EXPECT_EQ(gst_moe_result_meta_get_error_code(m), nullptr);
    ASSERT_EQ(gst_moe_result_meta_get_n_hits(m), 3u);
    EXPECT_EQ(gst_moe_result_meta_get_hit_item(m, 1), 7);
    EXPECT_STREQ(gst_moe_result_meta_get_hit_id(m, 1), "SKU-7");
    EXPECT_STREQ(gst_moe_result_meta_get_hit_caption(m, 0), "red <mug> & co");  // as in the document
    EXPECT_STREQ(gst_moe_result_meta_get_hit_uri(m, 1), "file:///c/7.png");
    EXPECT_EQ(gst_moe_result_meta_get_hit_uri(m, 0), nullptr);
    EXPECT_EQ(gst_moe_result_meta_get_hit_caption(m, 2), nullptr);
    EXPECT_DOUBLE_EQ(gst_moe_result_meta_get_hit_score(m, 2), 0.5);
    EXPECT_EQ(gst_moe_result_meta_get_hit_item(m, 3), -1);
    EXPECT_TRUE(std::isnan(gst_moe_result_meta_get_hit_score(m, 3)));
    ASSERT_EQ(gst_moe_result_meta_get_n_experts(m), 2u);
    EXPECT_EQ(gst_moe_result_meta_get_expert(m, 0), 3);
    EXPECT_DOUBLE_EQ(gst_moe_result_meta_get_expert_weight(m, 1), 0.39);
  }
  gst_buffer_unref(copy);
  unref_all(out);
}

TEST_F(CaptionTest, TheTemplateWritesTheTopHitsAboveMinScore) {
  Caption c("format", "{rank}. <i>{id}</i> {caption} {score} {{{item}}}", "hits", 3u, "min-score", 0.6, "duration",
            static_cast<guint64>(GST_SECOND), nullptr);
  ASSERT_EQ(c.push(result_doc("a", 0, kThreeHits), 0), GST_FLOW_OK);
  // No hit reaches min-score: the caption is cleared (an empty text buffer).
  ASSERT_EQ(c.push(result_doc("b", GST_SECOND, R"([{"rank":1,"item":0,"score":0.1}])"), GST_SECOND), GST_FLOW_OK);
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(text_of(out[0]),
            "1. <i>SKU-4</i> red &lt;mug&gt; &amp; co 0.831200 {4}\n2. <i>SKU-7</i> striped cup 0.790000 {7}");
  EXPECT_EQ(gst_buffer_get_size(out[1]), 0u);
  unref_all(out);
}

// Values are cut for the overlay (at a character boundary); the meta keeps them whole.
TEST_F(CaptionTest, LongValuesAreCutAtACharacterBoundary) {
  std::string caption;
  while (caption.size() < 2000) caption += "é";  // 2 bytes each
  Caption c("format", "{caption}", "duration", static_cast<guint64>(GST_SECOND), nullptr);
  ASSERT_EQ(c.push(result_doc("a", 0, R"([{"item":0,"score":0.9,"caption":")" + caption + "\"}]"), 0), GST_FLOW_OK);
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 1u);
  const std::string text = text_of(out[0]);
  EXPECT_EQ(text, caption.substr(0, 512) + "...");
  EXPECT_TRUE(g_utf8_validate(text.data(), static_cast<gssize>(text.size()), nullptr));
  EXPECT_EQ(std::string(gst_moe_result_meta_get_hit_caption(gst_buffer_get_moe_result_meta(out[0]), 0)), caption);
  unref_all(out);
}

TEST_F(CaptionTest, ErrorDocumentsClearTheCaptionOrShowTheirReason) {
  for (const bool show : {false, true}) {
    Caption c("errors", show ? GST_MOE_CAPTION_ERRORS_SHOW : GST_MOE_CAPTION_ERRORS_SKIP, nullptr);
    ASSERT_EQ(c.push(result_doc("a", 0, kThreeHits), 0), GST_FLOW_OK);
    ASSERT_EQ(c.push(error_doc("b", 200 * kMs), 200 * kMs), GST_FLOW_OK);
    ASSERT_EQ(c.push(result_doc("c", 300 * kMs, kThreeHits), 300 * kMs), GST_FLOW_OK);
    std::vector<GstBuffer*> out = c.pull_all();
    ASSERT_EQ(out.size(), 2u) << show;
    EXPECT_EQ(GST_BUFFER_DURATION(out[0]), 200 * kMs) << "the error ends the caption before it";
    EXPECT_EQ(GST_BUFFER_PTS(out[1]), 200 * kMs);
    EXPECT_EQ(GST_BUFFER_DURATION(out[1]), 100 * kMs);
    EXPECT_EQ(text_of(out[1]), show ? "frame &lt;3&gt; unreadable" : "");
    const GstMoeResultMeta* m = gst_buffer_get_moe_result_meta(out[1]);
    ASSERT_NE(m, nullptr);
    EXPECT_STREQ(gst_moe_result_meta_get_error_code(m), "image_undecodable");
    EXPECT_STREQ(gst_moe_result_meta_get_error_reason(m), "frame <3> unreadable");
    EXPECT_EQ(gst_moe_result_meta_get_n_hits(m), 0u);
    unref_all(out);
    EXPECT_EQ(stat(c.element(), "errors"), 1u);
  }
}

// Documents from a file carry no buffer PTS: pts_ns times them. Documents of other requests
// (text queries) have neither and go out at once, untimed; index-built summaries are ignored.
TEST_F(CaptionTest, TimingFallsBackToPtsNsAndUntimedDocumentsGoOutAtOnce) {
  Caption c;
  ASSERT_EQ(c.push(result_doc("a", 40 * kMs, kThreeHits), GST_CLOCK_TIME_NONE), GST_FLOW_OK);
  ASSERT_EQ(
      c.push(R"({"type":"result","id":"q1","results":[{"item":2,"score":0.4,"caption":"mug"}]})", GST_CLOCK_TIME_NONE),
      GST_FLOW_OK);
  ASSERT_EQ(c.push(R"({"type":"index-built","items":3})", GST_CLOCK_TIME_NONE), GST_FLOW_OK);
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(GST_BUFFER_PTS(out[0]), 40 * kMs);
  EXPECT_EQ(GST_BUFFER_DURATION(out[0]), GST_SECOND) << "a lone timed caption lasts 1 s";
  EXPECT_FALSE(GST_BUFFER_PTS_IS_VALID(out[1]));
  EXPECT_FALSE(GST_BUFFER_DURATION_IS_VALID(out[1]));
  EXPECT_EQ(text_of(out[1]), "mug (0.40)");
  unref_all(out);
  EXPECT_EQ(stat(c.element(), "ignored"), 1u);
}

TEST_F(CaptionTest, LateDocumentsAreDroppedAndFlushesDropTheWaitingCaption) {
  Caption c;
  ASSERT_EQ(c.push(result_doc("a", 100 * kMs, kThreeHits), 100 * kMs), GST_FLOW_OK);
  ASSERT_EQ(c.push(result_doc("b", 100 * kMs, kThreeHits), 100 * kMs), GST_FLOW_OK);
  ASSERT_EQ(c.push(result_doc("c", 50 * kMs, kThreeHits), 50 * kMs), GST_FLOW_OK);
  EXPECT_EQ(stat(c.element(), "late"), 2u);
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_flush_start()));
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_flush_stop(TRUE)));
  GstSegment segment;
  gst_segment_init(&segment, GST_FORMAT_TIME);
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_segment(&segment)));
  ASSERT_EQ(c.push(result_doc("d", 10 * kMs, kThreeHits), 10 * kMs), GST_FLOW_OK);
  EXPECT_TRUE(gst_harness_push_event(c.h(), gst_event_new_eos()));
  std::vector<GstBuffer*> out = c.pull_all();
  ASSERT_EQ(out.size(), 1u) << "the caption held at the flush is gone";
  EXPECT_STREQ(gst_moe_result_meta_get_request_id(gst_buffer_get_moe_result_meta(out[0])), "d");
  unref_all(out);
}

// Hostile documents: each is refused, counted with its reason, and the stream goes on.
TEST_F(CaptionTest, HostileDocumentsAreRefusedAndTheStreamGoesOn) {
  struct Case {
    std::string doc, reason;
  };
  static const char kNulInString[] = "{\"type\":\"result\",\"id\":\"a\0b\"}";
  std::vector<Case> cases = {
      {"not json", "not JSON"},
      {std::string(100000, '['), "nested more than"},
      {"{\"type\":\"result\",\"results\":[],\"pad\":\"" + std::string(17u << 20, 'x') + "\"}", "bytes (at most"},
      {std::string("{\"type\":\"result\",\"id\":\"\xff\xfe\"}"), "not UTF-8"},
      {std::string(kNulInString, sizeof kNulInString - 1), "not UTF-8"},
      {"[1,2]", "not a JSON object"},
      {R"({"id":"x"})", "no type"},
      {R"({"type":7})", "type is not a string"},
      {R"({"type":"result","results":{}})", "results is not an array"},
      {R"({"type":"result","results":[3]})", "results[0] is not an object"},
      {R"({"type":"result","results":[{"score":0.5}]})", "results[0].item is missing"},
      {R"({"type":"result","results":[{"item":1,"score":"high"}]})", "results[0].score is not a number"},
      {R"({"type":"result","results":[{"item":1,"score":0.5,"caption":["a"]}]})", "results[0].caption is not a string"},
      {R"({"type":"result","results":[{"item":1180591620717411303424,"score":0.5}]})", "does not fit in 64 bits"},
      {R"({"type":"result","results":[],"pts_ns":-5})", "pts_ns is negative"},
      {R"({"type":"result","results":[],"experts":[{"expert":-1,"weight":1}]})", "experts[0].expert"},
      {R"({"type":"error","error":"bad"})", "error is not an object"},
      {R"({"type":"error","error":{"code":"internal"}})", "error.reason is missing"},
  };
  Caption c("duration", static_cast<guint64>(GST_SECOND), nullptr);
  GstBus* bus = gst_bus_new();
  gst_element_set_bus(c.element(), bus);
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_EQ(c.push(cases[i].doc, i * kMs), GST_FLOW_OK) << i;
    GstStructure* s = stats_of(c.element());
    const std::string why = gst_structure_get_string(s, "last-refusal");
    gst_structure_free(s);
    EXPECT_NE(why.find(cases[i].reason), std::string::npos) << "case " << i << ": " << why;
  }
  EXPECT_EQ(gst_harness_buffers_in_queue(c.h()), 0u);
  EXPECT_EQ(stat(c.element(), "refused"), cases.size());
  // One warning on the bus for all of them, no error.
  int warnings = 0;
  while (GstMessage* m = gst_bus_pop(bus)) {
    EXPECT_NE(GST_MESSAGE_TYPE(m), GST_MESSAGE_ERROR);
    warnings += GST_MESSAGE_TYPE(m) == GST_MESSAGE_WARNING;
    gst_message_unref(m);
  }
  EXPECT_EQ(warnings, 1);
  ASSERT_EQ(c.push(result_doc("ok", GST_SECOND, kThreeHits), GST_SECOND), GST_FLOW_OK);
  std::vector<GstBuffer*> out = c.pull_all();
  EXPECT_EQ(out.size(), 1u);
  unref_all(out);
  gst_element_set_bus(c.element(), nullptr);
  gst_object_unref(bus);
}

// A template that cannot work stops the element at start, naming what is wrong.
TEST_F(CaptionTest, BadTemplatesAreRefusedAtStart) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{nope}", "unknown placeholder '{nope}'"},
      {"{caption", "is not closed"},
      {"a } b", "a lone '}'"},
      {"{score:.9f}", "{score:.Nf} with N from 0 to 6"},
      {"{caption:.2f}", "only score takes a precision"},
      {"<b>{caption}", "not Pango markup"},
      {"{caption} & co", "not Pango markup"},
  };
  for (const auto& [format, reason] : cases) {
    GstElement* e = gst_element_factory_make("moe-caption", nullptr);
    g_object_set(e, "format", format.c_str(), nullptr);
    GstBus* bus = gst_bus_new();
    gst_element_set_bus(e, bus);
    EXPECT_EQ(gst_element_set_state(e, GST_STATE_PAUSED), GST_STATE_CHANGE_FAILURE) << format;
    GstMessage* m = gst_bus_pop_filtered(bus, GST_MESSAGE_ERROR);
    ASSERT_NE(m, nullptr) << format;
    GError* err = nullptr;
    gst_message_parse_error(m, &err, nullptr);
    EXPECT_NE(std::string(err->message).find(reason), std::string::npos) << format << ": " << err->message;
    g_error_free(err);
    gst_message_unref(m);
    gst_element_set_state(e, GST_STATE_NULL);
    gst_element_set_bus(e, nullptr);
    gst_object_unref(bus);
    gst_object_unref(e);
  }
}
