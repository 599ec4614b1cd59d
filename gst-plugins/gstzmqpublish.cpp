/* zmq-publish: the result stream of a gst-moe service.
 *
 * Every buffer becomes one message on a ZeroMQ PUB socket: one frame, or two frames
 * [topic, payload] when `topic` is set so that subscribers can filter. A search service must
 * keep answering whatever its subscribers do, so nothing here ever waits on a peer: sends are
 * non-blocking, a message that a full subscriber queue cannot take is dropped and counted,
 * closing discards what is still queued (except for a bounded drain after EOS), and the sink
 * does not sync on the clock.
 */
#include "gstzmqpublish.h"

#include <cerrno>
#include <string>

#include "gstmoezmq.h"

GST_DEBUG_CATEGORY_STATIC(gst_zmq_publish_debug);
#define GST_CAT_DEFAULT gst_zmq_publish_debug

struct _GstZmqPublish {
  GstBaseSink parent;

  // Properties (object lock). Socket settings take effect at the next start.
  gchar* endpoint;
  gboolean bind;
  gchar* topic;
  gint send_hwm;
  guint drain_timeout_ms;

  // Streaming state: used by start/stop and the streaming thread (render, event) only.
  gstmoe::ZmqSocket* zmq;
  gchar* active_topic;  // `topic` and `send-hwm` as they were at start
  gint active_send_hwm;
  gint64 last_drop_warning_us;
  guint64 drops_since_warning;

  // Statistics (object lock), reset at start.
  guint64 sent;
  guint64 dropped;
  guint64 bytes;
};

enum { PROP_0, PROP_ENDPOINT, PROP_BIND, PROP_TOPIC, PROP_SEND_HWM, PROP_DRAIN_TIMEOUT, PROP_STATS };

#define DEFAULT_ENDPOINT "tcp://127.0.0.1:5556"
#define DEFAULT_BIND TRUE
#define DEFAULT_TOPIC ""
#define DEFAULT_SEND_HWM 1000
#define MAX_SEND_HWM 10000000
#define DEFAULT_DRAIN_TIMEOUT_MS 1000
#define MAX_DRAIN_TIMEOUT_MS 3600000
// Drops are logged at most this often, with the count since the previous warning.
#define DROP_WARNING_INTERVAL_US G_USEC_PER_SEC

static GstStaticPadTemplate sink_template = GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS_ANY);

#define gst_zmq_publish_parent_class parent_class
G_DEFINE_TYPE(GstZmqPublish, gst_zmq_publish, GST_TYPE_BASE_SINK);
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
    case PROP_STATS:
      g_value_take_boxed(value, gst_structure_new("zmq-publish-stats", "sent", G_TYPE_UINT64, self->sent, "dropped",
                                                  G_TYPE_UINT64, self->dropped, "bytes", G_TYPE_UINT64, self->bytes,
                                                  nullptr));
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
  self->active_topic = g_strdup(self->topic ? self->topic : "");
  self->active_send_hwm = hwm;
  self->sent = self->dropped = self->bytes = 0;
  GST_OBJECT_UNLOCK(self);
  self->last_drop_warning_us = 0;
  self->drops_since_warning = 0;

  try {
    self->zmq = new gstmoe::ZmqSocket(zmq::socket_type::pub, endpoint, bind, [hwm](zmq::socket_t& s) {
      s.set(zmq::sockopt::sndhwm, hwm);
      // A full subscriber queue makes the send fail with EAGAIN instead of silently losing
      // the message inside libzmq, so drops can be counted.
      s.set(zmq::sockopt::xpub_nodrop, true);
    });
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, OPEN_WRITE, ("%s", e.what()), (nullptr));
    g_clear_pointer(&self->active_topic, g_free);
    return FALSE;
  }
  GST_INFO_OBJECT(self, "%s %s, topic '%s', send-hwm %d", bind ? "bound to" : "connected to", endpoint.c_str(),
                  self->active_topic, hwm);
  return TRUE;
}

static gboolean gst_zmq_publish_stop(GstBaseSink* sink) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  delete self->zmq;  // waits at most the linger time (0, or drain-timeout after EOS)
  self->zmq = nullptr;
  g_clear_pointer(&self->active_topic, g_free);
  return TRUE;
}

static gboolean gst_zmq_publish_event(GstBaseSink* sink, GstEvent* event) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  if (self->zmq && GST_EVENT_TYPE(event) == GST_EVENT_EOS) {
    // The stream is complete: give what is still queued (the last results) a bounded time to
    // reach the subscribers when the element stops.
    GST_OBJECT_LOCK(self);
    const int linger = static_cast<int>(self->drain_timeout_ms);
    GST_OBJECT_UNLOCK(self);
    if (!self->zmq->set_linger(linger)) GST_WARNING_OBJECT(self, "cannot set ZMQ_LINGER: %s", zmq_strerror(errno));
  } else if (self->zmq && GST_EVENT_TYPE(event) == GST_EVENT_FLUSH_STOP) {
    self->zmq->set_linger(0);  // no longer at EOS: stopping discards again
  }
  return GST_BASE_SINK_CLASS(parent_class)->event(sink, event);
}

// Counts a message that a full subscriber queue refused, and says so in the log at most once
// per DROP_WARNING_INTERVAL_US.
static void gst_zmq_publish_note_drop(GstZmqPublish* self) {
  ++self->drops_since_warning;
  const gint64 now = g_get_monotonic_time();
  if (self->last_drop_warning_us == 0 || now - self->last_drop_warning_us >= DROP_WARNING_INTERVAL_US) {
    GST_WARNING_OBJECT(self,
                       "a subscriber's queue is full (send-hwm %d): dropped %" G_GUINT64_FORMAT
                       " message(s) since the last warning",
                       self->active_send_hwm, self->drops_since_warning);
    self->last_drop_warning_us = now;
    self->drops_since_warning = 0;
  }
}

static GstFlowReturn gst_zmq_publish_render(GstBaseSink* sink, GstBuffer* buffer) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(sink);
  GstMapInfo map;
  if (!gst_buffer_map(buffer, &map, GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, ("Could not map the buffer to publish."), (nullptr));
    return GST_FLOW_ERROR;
  }
  zmq::socket_t& socket = self->zmq->socket();
  const zmq::send_flags dontwait = zmq::send_flags::dontwait;
  bool accepted = false;
  try {
    if (self->active_topic[0] != '\0') {
      // With XPUB_NODROP, libzmq decides for a whole message at its first frame: the
      // high-water mark counts complete messages, so once the topic frame is accepted the
      // payload frame is too, and a refused message leaves nothing half-sent.
      accepted = socket.send(zmq::buffer(self->active_topic, strlen(self->active_topic)),
                             dontwait | zmq::send_flags::sndmore)
                     .has_value();
      if (accepted) accepted = socket.send(zmq::const_buffer(map.data, map.size), dontwait).has_value();
    } else {
      accepted = socket.send(zmq::const_buffer(map.data, map.size), dontwait).has_value();
    }
  } catch (const zmq::error_t& e) {
    gst_buffer_unmap(buffer, &map);
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("Could not publish a message: %s", e.what()), (nullptr));
    return GST_FLOW_ERROR;
  }
  const gsize size = map.size;
  gst_buffer_unmap(buffer, &map);

  GST_OBJECT_LOCK(self);
  if (accepted) {
    ++self->sent;
    self->bytes += size;
  } else {
    ++self->dropped;
  }
  GST_OBJECT_UNLOCK(self);
  if (!accepted) gst_zmq_publish_note_drop(self);
  return GST_FLOW_OK;
}

static void gst_zmq_publish_finalize(GObject* object) {
  GstZmqPublish* self = GST_ZMQ_PUBLISH(object);
  g_free(self->endpoint);
  g_free(self->topic);
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_zmq_publish_class_init(GstZmqPublishClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseSinkClass* basesink_class = GST_BASE_SINK_CLASS(klass);

  GST_DEBUG_CATEGORY_INIT(gst_zmq_publish_debug, "zmq-publish", 0, "ZeroMQ PUB sink");

  gobject_class->set_property = gst_zmq_publish_set_property;
  gobject_class->get_property = gst_zmq_publish_get_property;
  gobject_class->finalize = gst_zmq_publish_finalize;

  const GParamFlags rw_ready =
      static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY);
  g_object_class_install_property(
      gobject_class, PROP_ENDPOINT,
      g_param_spec_string("endpoint", "Endpoint",
                          "ZeroMQ endpoint to bind or connect the PUB socket to (tcp://HOST:PORT, ipc:///PATH; "
                          "bind also takes tcp://*:PORT for all interfaces)",
                          DEFAULT_ENDPOINT, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_BIND,
      g_param_spec_boolean("bind", "Bind",
                           "Bind the endpoint (subscribers connect to it); FALSE: connect to a subscriber or proxy "
                           "that binds it (ZeroMQ connects in the background and retries)",
                           DEFAULT_BIND, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_TOPIC,
      g_param_spec_string("topic", "Topic",
                          "Empty: one-frame messages holding the payload. Otherwise two frames [topic, payload], so "
                          "that subscribers can filter by topic prefix",
                          DEFAULT_TOPIC, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_SEND_HWM,
      g_param_spec_int("send-hwm", "Send high-water mark",
                       "Messages queued per subscriber (ZMQ_SNDHWM) before further messages are dropped; "
                       "0: unlimited (memory grows while a subscriber lags)",
                       0, MAX_SEND_HWM, DEFAULT_SEND_HWM, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_DRAIN_TIMEOUT,
      g_param_spec_uint("drain-timeout", "Drain timeout",
                        "After EOS, how long stopping may wait (ms) for queued messages to reach the subscribers; "
                        "0: discard them. Stopping without EOS never waits",
                        0, MAX_DRAIN_TIMEOUT_MS, DEFAULT_DRAIN_TIMEOUT_MS,
                        static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS |
                                                 GST_PARAM_MUTABLE_PLAYING)));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      g_param_spec_boxed("stats", "Statistics",
                         "zmq-publish-stats: sent (messages accepted by the socket, including those no subscriber "
                         "wanted), dropped (refused because a subscriber's queue was full), bytes (payload bytes "
                         "sent); reset at start",
                         GST_TYPE_STRUCTURE, static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS)));

  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_set_static_metadata(
      element_class, "ZeroMQ publisher", "Sink/Network",
      "Publishes every buffer (usually a JSON result document from ann-query) as one message on a ZeroMQ PUB "
      "socket: one frame, or two frames [topic, payload] when topic is set.\n"
      "It never blocks the pipeline: sends are non-blocking, and the socket uses ZMQ_XPUB_NODROP, with which "
      "libzmq refuses a message (EAGAIN) while any subscriber it is meant for has send-hwm messages queued; such a "
      "message is dropped for every subscriber and counted in stats.dropped (rate-limited warning in the log). "
      "With no subscriber, or none subscribed to the topic, the PUB socket accepts and discards messages: they "
      "count as sent. Subscribers that connect late miss what was published before their subscription arrived "
      "(ZeroMQ's slow joiner). Buffers are published as they arrive (sync=false by default). Stopping discards "
      "what is still queued, except after EOS, when it waits up to drain-timeout for it to be delivered.\n"
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
  // A result stream is delivered as it is produced, never held back to the clock.
  gst_base_sink_set_sync(GST_BASE_SINK(self), FALSE);
}
