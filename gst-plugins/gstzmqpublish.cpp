/**
 * SECTION:element-zmq-publish
 * @title: zmq-publish
 * @see_also: zmq-query, ann-query
 *
 * zmq-publish is the result stream of a gst-moe service: it publishes every buffer (usually a
 * JSON result document from ann-query) as one message on a ZeroMQ PUB socket: one frame, or two
 * frames [topic, payload] when `topic` is set so that subscribers can filter. A JSON object
 * document gets "seq" (counting these documents from 1 at every start) and "stream" (an id drawn
 * at every start) as its first members, by which subscribers see the messages they lost.
 *
 * It never blocks the pipeline: sends are non-blocking, a subscriber whose queue holds `send-hwm`
 * messages loses the next ones until it catches up while every other subscriber still gets them,
 * and buffers are published as they arrive (sync=false). Stopping discards what is still queued,
 * except after EOS, when it waits up to `drain-timeout` for it to be delivered.
 * `curve-secret-key-file` and `curve-allowed-keys` admit only the listed CURVE subscribers.
 *
 * The `stats` property counts the messages and bytes sent since the element started, and gives
 * the last sequence number and the stream id. `metrics-address` serves the plugin's Prometheus
 * metrics while it runs (docs/metrics.md).
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! queue \
 *     ! moe-encode model=models/default/clip ! moe-route model=models/default/adapter \
 *     ! moe-expert model=models/default/adapter \
 *     ! ann-query index=build/demo/catalog.faiss \
 *     ! zmq-publish endpoint=tcp://127.0.0.1:5556 topic=results
 * ]| The search service, its results published under the topic "results".
 * |[
 * gst-launch-1.0 videotestsrc num-buffers=8 ! jpegenc \
 *     ! zmq-publish endpoint=ipc:///tmp/frames bind=false
 * ]| Any payload works: JPEG frames, unnumbered, sent to a subscriber that binds ipc:///tmp/frames.
 */

/* A search service must keep answering whatever its subscribers do, so nothing here ever waits on
 * a peer: sends are non-blocking, a subscriber whose queue is full loses that message alone (the
 * others still get it), closing discards what is still queued (except for a bounded drain after
 * EOS), and the sink does not sync on the clock. libzmq reports no such loss to the publisher, so
 * every JSON object document carries a sequence number and a stream id by which subscribers see
 * their gaps.
 */
#include "gstzmqpublish.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "gstmoemeta.h"
#include "gstmoemetrics.h"
#include "gstmoezmq.h"

GST_DEBUG_CATEGORY_STATIC(gst_zmq_publish_debug);
#define GST_CAT_DEFAULT gst_zmq_publish_debug

enum {
  PROP_0,
  PROP_ENDPOINT,
  PROP_BIND,
  PROP_TOPIC,
  PROP_SEND_HWM,
  PROP_DRAIN_TIMEOUT,
  PROP_CURVE_SECRET_KEY_FILE,
  PROP_CURVE_ALLOWED_KEYS,
  PROP_METRICS_ADDRESS,
  PROP_STATS
};

#define DEFAULT_ENDPOINT "tcp://127.0.0.1:5556"
#define DEFAULT_BIND TRUE
#define DEFAULT_TOPIC ""
#define DEFAULT_SEND_HWM 1000
#define MAX_SEND_HWM 10000000
#define DEFAULT_DRAIN_TIMEOUT_MS 1000
#define MAX_DRAIN_TIMEOUT_MS 3600000

// Hex digits of the random id that tells one start's stream from another's.
#define STREAM_ID_LENGTH 16

namespace {

// What one run works with: created by start(), destroyed by stop(); the streaming thread (render,
// event) uses it without a lock.
struct ZmqPublishState {
  gstmoe::ZmqSocket zmq;
  std::string topic;                                 // `topic` as it was at start
  std::shared_ptr<gstmoe::metrics::Server> metrics;  // while metrics-address is set
};

}  // namespace

struct _GstZmqPublish {
  GstBaseSink parent;

  // Properties, under the object lock. Socket settings take effect at the next start.
  gchar* endpoint;
  gboolean bind;
  gchar* topic;
  gint send_hwm;
  guint drain_timeout_ms;
  gchar* curve_secret_key_file;
  gchar* curve_allowed_keys;
  gchar* metrics_address;

  // Behind `stats`, under the object lock: reset at start, kept after stop. `stream` is written
  // at start only.
  guint64 sent;
  guint64 bytes;
  guint64 seq;  // the last sequence number given; 0 before the first JSON object document
  gchar stream[STREAM_ID_LENGTH + 1];

  // Between start() and stop(), nullptr otherwise.
  ZmqPublishState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS_ANY);

#define gst_zmq_publish_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstZmqPublish, gst_zmq_publish, GST_TYPE_BASE_SINK,
                        GST_DEBUG_CATEGORY_INIT(gst_zmq_publish_debug, "zmq-publish", 0, "ZeroMQ PUB sink"));
GST_ELEMENT_REGISTER_DEFINE(zmq_publish, "zmq-publish", GST_RANK_NONE, GST_TYPE_ZMQ_PUBLISH);

static void gst_zmq_publish_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_ENDPOINT:
      g_free(self->endpoint);
      self->endpoint = g_value_dup_string(value);
      break;
    case PROP_BIND:
      self->bind = g_value_get_boolean(value);
      break;
    case PROP_TOPIC:
      g_free(self->topic);
      self->topic = g_value_dup_string(value);
      break;
    case PROP_SEND_HWM:
      self->send_hwm = g_value_get_int(value);
      break;
    case PROP_DRAIN_TIMEOUT:
      self->drain_timeout_ms = g_value_get_uint(value);
      break;
    case PROP_CURVE_SECRET_KEY_FILE:
      g_free(self->curve_secret_key_file);
      self->curve_secret_key_file = g_value_dup_string(value);
      break;
    case PROP_CURVE_ALLOWED_KEYS:
      g_free(self->curve_allowed_keys);
      self->curve_allowed_keys = g_value_dup_string(value);
      break;
    case PROP_METRICS_ADDRESS:
      g_free(self->metrics_address);
      self->metrics_address = g_value_dup_string(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_zmq_publish_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_ENDPOINT:
      g_value_set_string(value, self->endpoint);
      break;
    case PROP_BIND:
      g_value_set_boolean(value, self->bind);
      break;
    case PROP_TOPIC:
      g_value_set_string(value, self->topic);
      break;
    case PROP_SEND_HWM:
      g_value_set_int(value, self->send_hwm);
      break;
    case PROP_DRAIN_TIMEOUT:
      g_value_set_uint(value, self->drain_timeout_ms);
      break;
    case PROP_CURVE_SECRET_KEY_FILE:
      g_value_set_string(value, self->curve_secret_key_file);
      break;
    case PROP_CURVE_ALLOWED_KEYS:
      g_value_set_string(value, self->curve_allowed_keys);
      break;
    case PROP_METRICS_ADDRESS:
      g_value_set_string(value, self->metrics_address);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, gst_structure_new("zmq-publish-stats", "sent", G_TYPE_UINT64, self->sent, "bytes",
                                                  G_TYPE_UINT64, self->bytes, "seq", G_TYPE_UINT64, self->seq, "stream",
                                                  G_TYPE_STRING, self->stream, nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static gboolean gst_zmq_publish_start(GstBaseSink* sink) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  GST_OBJECT_LOCK(self);
  const std::string endpoint = self->endpoint ? self->endpoint : "";
  const bool bind = self->bind;
  const int hwm = self->send_hwm;
  const std::string curve_secret_key_file = self->curve_secret_key_file ? self->curve_secret_key_file : "";
  const std::string curve_allowed_keys = self->curve_allowed_keys ? self->curve_allowed_keys : "";
  const std::string topic = self->topic ? self->topic : "";
  const std::string metrics_address = self->metrics_address ? self->metrics_address : "";
  self->sent = self->bytes = self->seq = 0;
  g_snprintf(self->stream, sizeof self->stream, "%08x%08x", g_random_int(), g_random_int());
  GST_OBJECT_UNLOCK(self);

  std::optional<gstmoe::CurveServer> curve;
  try {
    curve = gstmoe::load_curve_server(curve_secret_key_file, curve_allowed_keys);
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  std::shared_ptr<gstmoe::metrics::Server> metrics;
  if (!gstmoe::metrics::serve(GST_ELEMENT(self), metrics_address, &metrics)) return FALSE;
  // Lossy PUB (no ZMQ_XPUB_NODROP): a message that a subscriber's full queue cannot take is lost
  // for that subscriber alone. With NODROP, libzmq refuses the message for every subscriber while
  // any one queue is full, so one subscriber that stops reading would silence them all.
  ZmqPublishState* state = nullptr;
  try {
    state = new ZmqPublishState{gstmoe::ZmqSocket(zmq::socket_type::pub, endpoint, bind, curve,
                                                  [hwm](zmq::socket_t& s) { s.set(zmq::sockopt::sndhwm, hwm); }),
                                topic, std::move(metrics)};
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, OPEN_WRITE, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  GST_INFO_OBJECT(self, "%s %s%s, topic '%s', send-hwm %d, stream %s", bind ? "bound to" : "connected to",
                  endpoint.c_str(), curve ? " (CURVE)" : "", topic.c_str(), hwm, self->stream);
  GST_OBJECT_LOCK(self);
  self->state = state;
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_zmq_publish_stop(GstBaseSink* sink) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  GST_OBJECT_LOCK(self);
  ZmqPublishState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;  // waits at most the linger time (0, or drain-timeout after EOS)
  return TRUE;
}

static gboolean gst_zmq_publish_event(GstBaseSink* sink, GstEvent* event) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  ZmqPublishState* st = self->state;
  if (st && GST_EVENT_TYPE(event) == GST_EVENT_EOS) {
    // The stream is complete: give what is still queued (the last results) a bounded time to
    // reach the subscribers when the element stops.
    GST_OBJECT_LOCK(self);
    const int linger = static_cast<int>(self->drain_timeout_ms);
    GST_OBJECT_UNLOCK(self);
    if (!st->zmq.set_linger(linger)) GST_WARNING_OBJECT(self, "cannot set ZMQ_LINGER: %s", zmq_strerror(errno));
  } else if (st && GST_EVENT_TYPE(event) == GST_EVENT_FLUSH_STOP) {
    st->zmq.set_linger(0);  // no longer at EOS: stopping discards again
  }
  return GST_BASE_SINK_CLASS(parent_class)->event(sink, event);
}

static bool is_json_space(guint8 c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// The message for `payload`: a payload whose first byte other than JSON whitespace is '{' (a JSON
// object document) gets "seq":SEQ,"stream":"STREAM" spliced in as its first members; any other
// payload is copied as it is. Returns whether it was spliced.
static bool build_message(const guint8* payload, gsize size, guint64 seq, const char* stream, zmq::message_t& message) {
  gsize brace = 0;
  while (brace < size && is_json_space(payload[brace])) ++brace;
  if (brace == size || payload[brace] != '{') {
    message.rebuild(payload, size);
    return false;
  }
  gsize after = brace + 1;
  while (after < size && is_json_space(payload[after])) ++after;
  const bool empty_object = after < size && payload[after] == '}';
  const std::string members =
      "\"seq\":" + std::to_string(seq) + ",\"stream\":\"" + stream + "\"" + (empty_object ? "" : ",");
  message.rebuild(size + members.size());
  guint8* out = message.data<guint8>();
  memcpy(out, payload, brace + 1);
  memcpy(out + brace + 1, members.data(), members.size());
  memcpy(out + brace + 1 + members.size(), payload + brace + 1, size - brace - 1);
  return true;
}

static GstFlowReturn gst_zmq_publish_render(GstBaseSink* sink, GstBuffer* buffer) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  ZmqPublishState* st = self->state;
  const int64_t start = g_get_monotonic_time();
  GstMapInfo map;
  if (!gst_buffer_map(buffer, &map, GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, ("Could not map the buffer to publish."), (nullptr));
    return GST_FLOW_ERROR;
  }
  // The number is taken whether or not the message then leaves: a message lost here shows as a
  // gap, as one lost on the way does.
  GST_OBJECT_LOCK(self);
  const guint64 seq = self->seq + 1;
  GST_OBJECT_UNLOCK(self);
  zmq::message_t message;
  const bool numbered = build_message(map.data, map.size, seq, self->stream, message);
  gst_buffer_unmap(buffer, &map);
  const gsize size = message.size();

  // Never waits: a PUB socket takes every message, writing it whole (the high-water mark counts
  // complete messages) to each subscriber queue that has room and to no other.
  zmq::socket_t& socket = st->zmq.socket();
  const zmq::send_flags dontwait = zmq::send_flags::dontwait;
  bool accepted = false;
  try {
    // libzmq learns how far a subscriber has read (the room in its queue) only when the socket
    // processes its commands, which a send does at most about once a millisecond. Reading
    // ZMQ_EVENTS processes them now: otherwise a burst of more than send-hwm messages would be lost
    // even by subscribers that keep up.
    static_cast<void>(socket.get(zmq::sockopt::events));
    if (!st->topic.empty()) {
      accepted = socket.send(zmq::buffer(st->topic), dontwait | zmq::send_flags::sndmore).has_value();
      if (accepted) accepted = socket.send(message, dontwait).has_value();
    } else {
      accepted = socket.send(message, dontwait).has_value();
    }
  } catch (const zmq::error_t& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("Could not publish a message: %s", e.what()), (nullptr));
    return GST_FLOW_ERROR;
  }

  gstmoe::metrics::count_publish(accepted, size, gstmoe::elapsed_ms(start, g_get_monotonic_time()));
  GST_OBJECT_LOCK(self);
  if (numbered) self->seq = seq;
  if (accepted) {
    ++self->sent;
    self->bytes += size;
  }
  GST_OBJECT_UNLOCK(self);
  return GST_FLOW_OK;
}

static void gst_zmq_publish_finalize(GObject* object) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(object);
  g_free(self->endpoint);
  g_free(self->topic);
  g_free(self->curve_secret_key_file);
  g_free(self->curve_allowed_keys);
  g_free(self->metrics_address);
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_zmq_publish_class_init(GstZmqPublishClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseSinkClass* basesink_class = GST_BASE_SINK_CLASS(klass);

  gobject_class->set_property = gst_zmq_publish_set_property;
  gobject_class->get_property = gst_zmq_publish_get_property;
  gobject_class->finalize = gst_zmq_publish_finalize;

  g_object_class_install_property(
      gobject_class, PROP_ENDPOINT,
      g_param_spec_string("endpoint", "Endpoint",
                          "ZeroMQ endpoint to bind or connect the PUB socket to (tcp://HOST:PORT, ipc:///PATH; "
                          "bind also takes tcp://*:PORT for all interfaces)",
                          DEFAULT_ENDPOINT, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_BIND,
      g_param_spec_boolean("bind", "Bind",
                           "Bind the endpoint (subscribers connect to it); FALSE: connect to a subscriber or proxy "
                           "that binds it (ZeroMQ connects in the background and retries)",
                           DEFAULT_BIND, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_TOPIC,
      g_param_spec_string("topic", "Topic",
                          "Empty: one-frame messages holding the payload. Otherwise two frames [topic, payload], so "
                          "that subscribers can filter by topic prefix",
                          DEFAULT_TOPIC, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_SEND_HWM,
      g_param_spec_int("send-hwm", "Send high-water mark",
                       "Messages queued per subscriber (ZMQ_SNDHWM); a subscriber with this many queued loses "
                       "the next messages until it catches up, the others still get them. 0: unlimited (memory "
                       "grows while a subscriber lags)",
                       0, MAX_SEND_HWM, DEFAULT_SEND_HWM, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_DRAIN_TIMEOUT,
      g_param_spec_uint("drain-timeout", "Drain timeout",
                        "After EOS, how long stopping may wait (ms) for queued messages to reach the subscribers; "
                        "0: discard them. Stopping without EOS never waits",
                        0, MAX_DRAIN_TIMEOUT_MS, DEFAULT_DRAIN_TIMEOUT_MS, gstmoe::kPropertyMutablePlaying));
  gstmoe::install_curve_properties(gobject_class, PROP_CURVE_SECRET_KEY_FILE, PROP_CURVE_ALLOWED_KEYS);
  gstmoe::metrics::install_address_property(gobject_class, PROP_METRICS_ADDRESS);
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "zmq-publish-stats: sent (messages handed to the socket, including those no subscriber "
          "wanted; a subscriber whose queue was full lost its copy, which the publisher cannot see: "
          "subscribers see it as a seq gap), bytes (bytes of those payloads as sent, seq and stream "
          "included, topic frames not), seq (the last sequence number given: JSON object documents "
          "published), stream (this start's stream id); reset at start"));

  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_set_static_metadata(
      element_class, "ZeroMQ publisher", "Sink/Network",
      "Publishes every buffer (usually a JSON result document from ann-query) as one message on a ZeroMQ PUB "
      "socket: one frame, or two frames [topic, payload] when topic is set.\n"
      "A payload that is a JSON object document (its first byte other than whitespace is '{') gets two first "
      "members, \"seq\":N,\"stream\":\"ID\": N counts these documents from 1 at every start, ID (16 hex digits) "
      "is drawn at every start; other payloads go out unchanged, unnumbered.\n"
      "It never blocks the pipeline: sends are non-blocking, and a subscriber that has send-hwm messages queued "
      "loses the next ones until it catches up, while every other subscriber still gets them. libzmq reports no "
      "such loss to the publisher; the subscriber sees it as a gap in seq. With no subscriber, or none subscribed "
      "to the topic, the PUB socket accepts and discards messages: they count as sent. Subscribers that connect "
      "late miss what was published before their subscription arrived (ZeroMQ's slow joiner). Buffers are "
      "published as they arrive (sync=false by default). Stopping discards what is still queued, except after "
      "EOS, when it waits up to drain-timeout for it to be delivered.\n"
      "Example: gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! queue ! moe-encode model=clip ! "
      "moe-route model=adapter ! moe-expert model=adapter ! ann-query index=catalog.faiss ! "
      "zmq-publish endpoint=tcp://127.0.0.1:5556 topic=results",
      "gst-moe");

  basesink_class->start = GST_DEBUG_FUNCPTR(gst_zmq_publish_start);
  basesink_class->stop = GST_DEBUG_FUNCPTR(gst_zmq_publish_stop);
  basesink_class->event = GST_DEBUG_FUNCPTR(gst_zmq_publish_event);
  basesink_class->render = GST_DEBUG_FUNCPTR(gst_zmq_publish_render);
}

static void gst_zmq_publish_init(GstZmqPublish* self) {
  self->endpoint = g_strdup(DEFAULT_ENDPOINT);
  self->bind = DEFAULT_BIND;
  self->topic = g_strdup(DEFAULT_TOPIC);
  self->send_hwm = DEFAULT_SEND_HWM;
  self->drain_timeout_ms = DEFAULT_DRAIN_TIMEOUT_MS;
  self->metrics_address = g_strdup("");
  // A result stream is delivered as it is produced, never held back to the clock.
  gst_base_sink_set_sync(GST_BASE_SINK(self), FALSE);
}
