/**
 * SECTION:element-zmq-query
 * @title: zmq-query
 * @see_also: zmq-publish, moe-encode
 *
 * zmq-query is the request entrance of a gst-moe service: a live source that receives search
 * requests, one JSON object per ZeroMQ message, on a PULL socket (PUSH clients, no reply) or a
 * ROUTER socket (REQ or DEALER clients, each request answered at once with an accepted or
 * rejected reply):
 * {"id": "q1", "text": "red mug"}, {"id": "q2", "image": "/photos/mug.jpg"} (the file is read
 * here, only under `image-root`), {"id": "q3", "image_base64": "iVBORw0..."}, or a hybrid of an
 * image and a text ({"id": "q4", "image_base64": "...", "text": "but red"}), with an optional "k".
 * Each message becomes one application/x-moe-request buffer (the query text, or the image file
 * bytes, a hybrid's text then being in the record) with a GstMoeBatchMeta row describing the
 * request. Catalog updates come the same way: an upsert ({"op": "upsert", "item": {"id": ...},
 * with "text", "image" or "image_base64"}) is a request buffer like a query's whose row carries the
 * item; a delete ({"op": "delete", "items": [ids]}) has nothing to encode and becomes an empty
 * buffer whose meta carries it as a control, for ann-query (which applies updates only with
 * allow-updates). A request that cannot be served is not an element error: it becomes an empty
 * buffer whose meta carries it as a failed request, so that it is answered with an error document
 * at the end of the pipeline like every other request. docs/zmq-schema.md specifies the requests;
 * `curve-secret-key-file` and `curve-allowed-keys` admit only the listed CURVE clients.
 *
 * The `stats` property counts the requests received and rejected since the element started.
 * `metrics-address` serves the plugin's Prometheus metrics while it runs (docs/metrics.md).
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! queue \
 *     ! moe-encode model=models/default/clip ! moe-route model=models/default/adapter \
 *     ! moe-expert model=models/default/adapter \
 *     ! ann-query index=build/demo/catalog.faiss ! zmq-publish endpoint=tcp://127.0.0.1:5556
 * ]| The search service: requests from PUSH clients, results on the PUB socket of zmq-publish.
 * |[
 * gst-launch-1.0 zmq-query socket-type=router image-root=models/default/catalog num-requests=100 \
 *     ! fakesink dump=true
 * ]| Acknowledges 100 requests from REQ clients, serving "image" requests for files under
 * models/default/catalog, and dumps the request buffers.
 */

/* Parsing and its bounds live in the engine (moe::parse_query_request, where the request fuzzer
 * reaches them too): depth, values and integers are bounded before JSON-GLib runs, the text by
 * max-text-bytes, images by max-image-bytes. The service reads image files only under image-root,
 * so that a client cannot make it read any file of the machine or learn which files exist outside
 * that folder; and ZeroMQ itself drops messages larger than max-message-bytes, so that a huge
 * message is never received in full.
 */
#include "gstzmqquery.h"

#include <json-glib/json-glib.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "gstmoemeta.h"
#include "gstmoemetrics.h"
#include "gstmoezmq.h"
#include "moe/error.h"
#include "moe/query_request.h"

GST_DEBUG_CATEGORY_STATIC(gst_zmq_query_debug);
#define GST_CAT_DEFAULT gst_zmq_query_debug

enum {
  PROP_0,
  PROP_ENDPOINT,
  PROP_BIND,
  PROP_SOCKET_TYPE,
  PROP_RECV_HWM,
  PROP_MAX_MESSAGE_BYTES,
  PROP_MAX_IMAGE_BYTES,
  PROP_MAX_TEXT_BYTES,
  PROP_IMAGE_ROOT,
  PROP_NUM_REQUESTS,
  PROP_CURVE_SECRET_KEY_FILE,
  PROP_CURVE_ALLOWED_KEYS,
  PROP_METRICS_ADDRESS,
  PROP_STATS
};

#define DEFAULT_ENDPOINT "tcp://127.0.0.1:5555"
#define DEFAULT_BIND TRUE
#define DEFAULT_SOCKET_TYPE GST_ZMQ_QUERY_SOCKET_PULL
#define DEFAULT_RECV_HWM 1000
#define MAX_RECV_HWM 10000000
#define DEFAULT_MAX_IMAGE_BYTES (G_GUINT64_CONSTANT(32) * 1024 * 1024)
// Fits an image_base64 request of DEFAULT_MAX_IMAGE_BYTES (45917618 bytes, base64_request_bytes)
// with room to spare.
#define DEFAULT_MAX_MESSAGE_BYTES (G_GUINT64_CONSTANT(48) * 1024 * 1024)
// ZMQ_MAXMSGSIZE is an int64_t.
#define MAX_MAX_MESSAGE_BYTES static_cast<guint64>(G_MAXINT64)
static_assert(moe::base64_request_bytes(DEFAULT_MAX_IMAGE_BYTES) == 45917618 &&
                  DEFAULT_MAX_MESSAGE_BYTES >= moe::base64_request_bytes(DEFAULT_MAX_IMAGE_BYTES),
              "the defaults of max-message-bytes, max-image-bytes and their blurbs agree");
#define DEFAULT_MAX_TEXT_BYTES moe::kDefaultMaxQueryTextBytes
// The text is held, tokenised and echoed in every answer: 1 MiB is far beyond any real query.
#define MAX_MAX_TEXT_BYTES (1024 * 1024)
#define DEFAULT_IMAGE_ROOT nullptr
#define DEFAULT_NUM_REQUESTS (-1)
// create() waits for messages in slices this long, so that unlock() is noticed promptly.
static constexpr std::chrono::milliseconds kPollInterval{100};
// After the last of num-requests requests, how long stopping may wait for its reply to leave.
static constexpr int kReplyDrainMs = 1000;
static const char* const kStage = "zmq-query";

namespace {

// What one run works with: created by start(), destroyed by stop(); the streaming thread (create)
// uses it without a lock.
struct ZmqQueryState {
  gstmoe::ZmqSocket zmq;
  bool router;             // socket-type at start
  std::string image_root;  // image-root at start, canonical (realpath); empty: image paths are refused
  std::shared_ptr<gstmoe::metrics::Server> metrics;  // while metrics-address is set
};

}  // namespace

struct _GstZmqQuery {
  GstPushSrc parent;

  // Properties, under the object lock. Socket settings take effect at the next start.
  gchar* endpoint;
  gboolean bind;
  GstZmqQuerySocketType socket_type;
  gint recv_hwm;
  guint64 max_message_bytes;
  guint64 max_image_bytes;
  guint max_text_bytes;
  gchar* image_root;
  gint64 num_requests;
  gchar* curve_secret_key_file;
  gchar* curve_allowed_keys;
  gchar* metrics_address;

  // Behind `stats`, under the object lock: reset at start, kept after stop.
  guint64 received;
  guint64 rejected;

  gint flushing;  // atomic: set by unlock() from any thread to interrupt create()

  // Between start() and stop(), nullptr otherwise.
  ZmqQueryState* state;
};

static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_REQUEST_CAPS));

GType gst_zmq_query_socket_type_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_ZMQ_QUERY_SOCKET_PULL, "PULL: requests from PUSH clients, no reply", "pull"},
      {GST_ZMQ_QUERY_SOCKET_ROUTER, "ROUTER: requests from REQ or DEALER clients, each one acknowledged", "router"},
      {0, nullptr, nullptr}};
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstZmqQuerySocketType", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

#define gst_zmq_query_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstZmqQuery, gst_zmq_query, GST_TYPE_PUSH_SRC,
                        GST_DEBUG_CATEGORY_INIT(gst_zmq_query_debug, "zmq-query", 0, "ZeroMQ request source"));
GST_ELEMENT_REGISTER_DEFINE(zmq_query, "zmq-query", GST_RANK_NONE, GST_TYPE_ZMQ_QUERY);

// ---------------------------------------------------------------------------------------------
// Request parsing

namespace {

gstmoe::Modality modality(moe::QueryModality m) {
  switch (m) {
    case moe::QueryModality::Image:
      return gstmoe::Modality::Image;
    case moe::QueryModality::Hybrid:
      return gstmoe::Modality::Hybrid;
    case moe::QueryModality::Text:
      break;
  }
  return gstmoe::Modality::Text;
}

gstmoe::RequestOp op(moe::QueryOp o) {
  switch (o) {
    case moe::QueryOp::Upsert:
      return gstmoe::RequestOp::Upsert;
    case moe::QueryOp::Delete:
      return gstmoe::RequestOp::Delete;
    case moe::QueryOp::Search:
      break;
  }
  return gstmoe::RequestOp::Search;
}

// The request meta's record of a parsed (or partly parsed) request.
void fill_record(const moe::QueryRequest& request, gstmoe::RequestRecord& record) {
  record.id = request.id;
  record.op = op(request.op);
  record.modality = modality(request.modality);
  record.k = request.k;
  record.nprobe = request.nprobe;
  record.ef_search = request.ef_search;
  record.filter = request.filter;
  record.text = request.text;
  record.uri = request.image;
  record.item = request.item;
  record.item_ids = request.item_ids;
}

// Parses one request message into `record` (filled as far as parsing got, so that a rejection
// can still report the id and modality) and returns its payload: the text (text requests), the
// image bytes (image and hybrid requests; a hybrid's text is in the record), or nothing (deletes).
// `image_root` is the canonical image-root, nullptr if none. Throws moe::Error naming the cause.
GstBuffer* parse_request(const zmq::message_t& message, const moe::QueryLimits& limits, const char* image_root,
                         gstmoe::RequestRecord& record) {
  moe::QueryRequest request;
  try {
    request = moe::parse_query_request(std::string_view(message.data<char>(), message.size()), limits);
  } catch (const moe::QueryRejected& rejected) {
    fill_record(rejected.request, record);
    throw;
  }
  fill_record(request, record);
  if (request.op == moe::QueryOp::Delete) return gst_buffer_new();
  if (request.modality == moe::QueryModality::Text)
    return gst_buffer_new_memdup(request.text.data(), request.text.size());
  if (!request.image.empty()) {
    if (!image_root)
      throw moe::RequestRefused(
          "image paths are not served: zmq-query has no image-root (the operator sets image-root=DIR to serve "
          "the image files under DIR); send the image itself as image_base64",
          moe::error_code::kImageUnavailable);
    return gstmoe::bytes_buffer(moe::read_query_image_file(request.image, image_root, limits.max_image_bytes));
  }
  record.uri = "base64:" + std::to_string(request.image_bytes.size()) + " bytes";
  return gstmoe::bytes_buffer(std::move(request.image_bytes));
}

// The reply a ROUTER client gets: {"id": ..., "status": "accepted"} or
// {"id": ..., "status": "rejected", "error": "...", "code": "..."}; id is null when the request had none.
std::string reply_json(const std::string& id, const gstmoe::FailedRequest* rejected) {
  JsonBuilder* builder = json_builder_new();
  json_builder_begin_object(builder);
  json_builder_set_member_name(builder, "id");
  if (id.empty())
    json_builder_add_null_value(builder);
  else
    json_builder_add_string_value(builder, id.c_str());
  json_builder_set_member_name(builder, "status");
  json_builder_add_string_value(builder, rejected ? "rejected" : "accepted");
  if (rejected) {
    json_builder_set_member_name(builder, "error");
    json_builder_add_string_value(builder, rejected->reason.c_str());
    json_builder_set_member_name(builder, "code");
    json_builder_add_string_value(builder, rejected->code);
  }
  json_builder_end_object(builder);
  JsonNode* root = json_builder_get_root(builder);
  gchar* text = json_to_string(root, FALSE);
  std::string result = text;
  g_free(text);
  json_node_unref(root);
  g_object_unref(builder);
  return result;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Element

static void gst_zmq_query_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstZmqQuery* self = GST_ZMQ_QUERY(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_ENDPOINT:
      g_free(self->endpoint);
      self->endpoint = g_value_dup_string(value);
      break;
    case PROP_BIND:
      self->bind = g_value_get_boolean(value);
      break;
    case PROP_SOCKET_TYPE:
      self->socket_type = static_cast<GstZmqQuerySocketType>(g_value_get_enum(value));
      break;
    case PROP_RECV_HWM:
      self->recv_hwm = g_value_get_int(value);
      break;
    case PROP_MAX_MESSAGE_BYTES:
      self->max_message_bytes = g_value_get_uint64(value);
      break;
    case PROP_MAX_IMAGE_BYTES:
      self->max_image_bytes = g_value_get_uint64(value);
      break;
    case PROP_MAX_TEXT_BYTES:
      self->max_text_bytes = g_value_get_uint(value);
      break;
    case PROP_IMAGE_ROOT:
      g_free(self->image_root);
      self->image_root = g_value_dup_string(value);
      break;
    case PROP_NUM_REQUESTS:
      self->num_requests = g_value_get_int64(value);
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

static void gst_zmq_query_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstZmqQuery* self = GST_ZMQ_QUERY(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_ENDPOINT:
      g_value_set_string(value, self->endpoint);
      break;
    case PROP_BIND:
      g_value_set_boolean(value, self->bind);
      break;
    case PROP_SOCKET_TYPE:
      g_value_set_enum(value, self->socket_type);
      break;
    case PROP_RECV_HWM:
      g_value_set_int(value, self->recv_hwm);
      break;
    case PROP_MAX_MESSAGE_BYTES:
      g_value_set_uint64(value, self->max_message_bytes);
      break;
    case PROP_MAX_IMAGE_BYTES:
      g_value_set_uint64(value, self->max_image_bytes);
      break;
    case PROP_MAX_TEXT_BYTES:
      g_value_set_uint(value, self->max_text_bytes);
      break;
    case PROP_IMAGE_ROOT:
      g_value_set_string(value, self->image_root);
      break;
    case PROP_NUM_REQUESTS:
      g_value_set_int64(value, self->num_requests);
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
      g_value_take_boxed(value, gst_structure_new("zmq-query-stats", "received", G_TYPE_UINT64, self->received,
                                                  "rejected", G_TYPE_UINT64, self->rejected, nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static gboolean gst_zmq_query_start(GstBaseSrc* src) {
  GstZmqQuery* self = GST_ZMQ_QUERY(src);
  GST_OBJECT_LOCK(self);
  const std::string endpoint = self->endpoint ? self->endpoint : "";
  const bool bind = self->bind;
  const int hwm = self->recv_hwm;
  const guint64 max_message = self->max_message_bytes;
  const guint64 max_image = self->max_image_bytes;
  const std::string root = self->image_root ? self->image_root : "";
  const std::string curve_secret_key_file = self->curve_secret_key_file ? self->curve_secret_key_file : "";
  const std::string curve_allowed_keys = self->curve_allowed_keys ? self->curve_allowed_keys : "";
  const bool router = self->socket_type == GST_ZMQ_QUERY_SOCKET_ROUTER;
  const std::string metrics_address = self->metrics_address ? self->metrics_address : "";
  self->received = self->rejected = 0;
  GST_OBJECT_UNLOCK(self);
  g_atomic_int_set(&self->flushing, 0);

  // Canonical once, so that each request's canonical path can be compared with it.
  std::string root_path;
  if (!root.empty()) {
    char* real = realpath(root.c_str(), nullptr);
    if (!real || !g_file_test(real, G_FILE_TEST_IS_DIR)) {
      const std::string reason = real ? "not a folder" : g_strerror(errno);
      free(real);
      GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("image-root '%s' cannot be used: %s", root.c_str(), reason.c_str()),
                        (nullptr));
      return FALSE;
    }
    root_path = real;
    free(real);
  }
  if (max_message != 0 && max_message < moe::base64_request_bytes(max_image))
    GST_ELEMENT_WARNING(self, RESOURCE, SETTINGS,
                        ("max-message-bytes (%" G_GUINT64_FORMAT ") is smaller than the largest image_base64 "
                         "request that max-image-bytes (%" G_GUINT64_FORMAT ") allows (%" G_GUINT64_FORMAT
                         " bytes): ZeroMQ drops larger messages unanswered",
                         max_message, max_image, moe::base64_request_bytes(max_image)),
                        (nullptr));

  std::optional<gstmoe::CurveServer> curve;
  try {
    curve = gstmoe::load_curve_server(curve_secret_key_file, curve_allowed_keys);
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  std::shared_ptr<gstmoe::metrics::Server> metrics;
  if (!gstmoe::metrics::serve(GST_ELEMENT(self), metrics_address, &metrics)) return FALSE;
  // ZeroMQ's "no limit" is -1.
  const int64_t max_msgsize = max_message == 0 ? -1 : static_cast<int64_t>(max_message);
  ZmqQueryState* state = nullptr;
  try {
    state = new ZmqQueryState{
        gstmoe::ZmqSocket(router ? zmq::socket_type::router : zmq::socket_type::pull, endpoint, bind, curve,
                          [hwm, max_msgsize](zmq::socket_t& s) {
                            s.set(zmq::sockopt::rcvhwm, hwm);
                            s.set(zmq::sockopt::maxmsgsize, max_msgsize);
                          }),
        router, root_path, std::move(metrics)};
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, OPEN_READ, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  GST_INFO_OBJECT(self, "%s %s (%s), image-root %s", bind ? "bound to" : "connected to", endpoint.c_str(),
                  router ? "router" : "pull", root_path.empty() ? "none" : root_path.c_str());
  GST_OBJECT_LOCK(self);
  self->state = state;
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_zmq_query_stop(GstBaseSrc* src) {
  GstZmqQuery* self = GST_ZMQ_QUERY(src);
  GST_OBJECT_LOCK(self);
  ZmqQueryState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;
  return TRUE;
}

static gboolean gst_zmq_query_unlock(GstBaseSrc* src) {
  g_atomic_int_set(&GST_ZMQ_QUERY(src)->flushing, 1);
  return TRUE;
}

static gboolean gst_zmq_query_unlock_stop(GstBaseSrc* src) {
  g_atomic_int_set(&GST_ZMQ_QUERY(src)->flushing, 0);
  return TRUE;
}

static gboolean gst_zmq_query_query(GstBaseSrc* src, GstQuery* query) {
  if (GST_QUERY_TYPE(query) == GST_QUERY_LATENCY) {
    // Requests are pushed the moment they arrive: live, no latency added, none held.
    gst_query_set_latency(query, TRUE, 0, GST_CLOCK_TIME_NONE);
    return TRUE;
  }
  return GST_BASE_SRC_CLASS(parent_class)->query(src, query);
}

// Waits for the next message, polling in short slices so that unlock() is noticed.
static GstFlowReturn gst_zmq_query_receive(GstZmqQuery* self, std::vector<zmq::message_t>& frames) {
  zmq::socket_t& socket = self->state->zmq.socket();
  while (!g_atomic_int_get(&self->flushing)) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, kPollInterval) > 0 &&
          zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait).has_value())
        return GST_FLOW_OK;
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      GST_ELEMENT_ERROR(self, RESOURCE, READ, ("Could not receive a request: %s", e.what()), (nullptr));
      return GST_FLOW_ERROR;
    }
  }
  return GST_FLOW_FLUSHING;
}

// Sends `body` back to the ROUTER client that sent `frames`, behind the same routing envelope
// (its identity, and the empty delimiter REQ clients add). Best effort: a client that is gone
// or not reading does not hold up the pipeline.
static void gst_zmq_query_reply(GstZmqQuery* self, const std::vector<zmq::message_t>& frames, size_t envelope,
                                const std::string& body) {
  std::vector<zmq::const_buffer> parts;
  for (size_t i = 0; i < envelope; ++i) parts.push_back(zmq::buffer(frames[i].data(), frames[i].size()));
  parts.push_back(zmq::buffer(body));
  try {
    if (!zmq::send_multipart(self->state->zmq.socket(), parts, zmq::send_flags::dontwait))
      GST_WARNING_OBJECT(self, "could not send the reply %s: client queue full", body.c_str());
  } catch (const zmq::error_t& e) {
    GST_WARNING_OBJECT(self, "could not send the reply %s: %s", body.c_str(), e.what());
  }
}

static GstFlowReturn gst_zmq_query_create(GstPushSrc* src, GstBuffer** out) {
  GstZmqQuery* self = GST_ZMQ_QUERY(src);
  ZmqQueryState* st = self->state;
  GST_OBJECT_LOCK(self);
  const bool done = self->num_requests >= 0 && self->received >= static_cast<guint64>(self->num_requests);
  moe::QueryLimits limits;
  limits.max_image_bytes = self->max_image_bytes;
  limits.max_text_bytes = self->max_text_bytes;
  GST_OBJECT_UNLOCK(self);
  if (done) {
    GST_INFO_OBJECT(self, "num-requests requests received: end of stream");
    // The last reply was just queued: let stopping give it a moment to reach its client.
    if (st->router) st->zmq.set_linger(kReplyDrainMs);
    return GST_FLOW_EOS;
  }

  std::vector<zmq::message_t> frames;
  const GstFlowReturn ret = gst_zmq_query_receive(self, frames);
  if (ret != GST_FLOW_OK) return ret;

  gstmoe::RequestRecord record;
  record.arrival_wall_us = g_get_real_time();
  record.arrival_mono_us = g_get_monotonic_time();
  // ROUTER prefixes the client's identity; REQ clients add an empty delimiter frame.
  size_t envelope = 0;
  if (st->router) envelope = frames.size() >= 3 && frames[1].size() == 0 ? 2 : 1;

  gstmoe::BatchRecords records;
  GstBuffer* buffer = nullptr;
  std::string reason;
  try {
    if (frames.size() != envelope + 1)
      throw moe::RequestRefused("request has " + std::to_string(frames.size() - envelope) +
                                    " frames; expected one frame holding the JSON request",
                                moe::error_code::kInvalidRequest);
    buffer = parse_request(frames[envelope], limits, st->image_root.empty() ? nullptr : st->image_root.c_str(), record);
    // A delete has nothing to encode: it travels row-less, as a control, to ann-query.
    (record.op == gstmoe::RequestOp::Delete ? records.controls : records.rows).push_back(record);
  } catch (const moe::Error& e) {
    reason = e.what();
    buffer = gst_buffer_new();
    const auto* refused = dynamic_cast<const moe::RequestRefused*>(&e);
    records.failed.push_back(
        gstmoe::FailedRequest{record, kStage, reason, refused ? refused->code : moe::error_code::kInternal});
  }
  gst_buffer_add_moe_batch_meta(buffer, records);

  GST_OBJECT_LOCK(self);
  ++self->received;
  if (!reason.empty()) ++self->rejected;
  GST_OBJECT_UNLOCK(self);
  if (reason.empty())
    GST_DEBUG_OBJECT(self, "request '%s' (%s%s, %" G_GSIZE_FORMAT " bytes)", record.id.c_str(),
                     record.op == gstmoe::RequestOp::Upsert ? "upsert, " : "",
                     record.op == gstmoe::RequestOp::Delete ? "delete" : gstmoe::modality_name(record.modality),
                     gst_buffer_get_size(buffer));
  else
    GST_INFO_OBJECT(self, "request '%s' rejected: %s", record.id.c_str(), reason.c_str());

  if (st->router)
    gst_zmq_query_reply(self, frames, envelope, reply_json(record.id, reason.empty() ? nullptr : &records.failed[0]));
  *out = buffer;
  return GST_FLOW_OK;
}

static void gst_zmq_query_finalize(GObject* object) {
  GstZmqQuery* self = GST_ZMQ_QUERY(object);
  g_free(self->endpoint);
  g_free(self->image_root);
  g_free(self->curve_secret_key_file);
  g_free(self->curve_allowed_keys);
  g_free(self->metrics_address);
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_zmq_query_class_init(GstZmqQueryClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseSrcClass* basesrc_class = GST_BASE_SRC_CLASS(klass);
  GstPushSrcClass* pushsrc_class = GST_PUSH_SRC_CLASS(klass);

  gobject_class->set_property = gst_zmq_query_set_property;
  gobject_class->get_property = gst_zmq_query_get_property;
  gobject_class->finalize = gst_zmq_query_finalize;

  g_object_class_install_property(
      gobject_class, PROP_ENDPOINT,
      g_param_spec_string("endpoint", "Endpoint",
                          "ZeroMQ endpoint to bind or connect the socket to (tcp://HOST:PORT, ipc:///PATH; bind "
                          "also takes tcp://*:PORT for all interfaces)",
                          DEFAULT_ENDPOINT, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_BIND,
      g_param_spec_boolean("bind", "Bind",
                           "Bind the endpoint (clients connect to it); FALSE: connect to a client or broker that "
                           "binds it (ZeroMQ connects in the background and retries)",
                           DEFAULT_BIND, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_SOCKET_TYPE,
      g_param_spec_enum("socket-type", "Socket type",
                        "pull: PUSH clients send requests without reply; router: REQ or DEALER clients get an "
                        "immediate reply {\"id\":...,\"status\":\"accepted\"} or {...,\"status\":\"rejected\","
                        "\"error\":...} (results always come from zmq-publish)",
                        GST_TYPE_ZMQ_QUERY_SOCKET_TYPE, DEFAULT_SOCKET_TYPE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_RECV_HWM,
      g_param_spec_int("recv-hwm", "Receive high-water mark",
                       "Requests queued per client (ZMQ_RCVHWM) before ZeroMQ stops reading from it (a PUSH "
                       "client then waits); 0: unlimited",
                       0, MAX_RECV_HWM, DEFAULT_RECV_HWM, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_MAX_MESSAGE_BYTES,
      g_param_spec_uint64("max-message-bytes", "Maximum message bytes",
                          "Largest request frame accepted, in bytes (ZMQ_MAXMSGSIZE). ZeroMQ disconnects a client "
                          "that sends a larger one and discards the message before it is read in full, so that "
                          "request gets no error document and no router reply. An image_base64 request takes 4/3 x "
                          "max-image-bytes plus a line break (escaped in JSON as \\n) per 76 characters and the JSON "
                          "around it (45917618 "
                          "bytes for the default 32 MiB, hence the default 48 MiB); start warns when this is "
                          "smaller than that. 0: unlimited",
                          0, MAX_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_MAX_IMAGE_BYTES,
      g_param_spec_uint64("max-image-bytes", "Maximum image bytes",
                          "Largest image (file or decoded image_base64) accepted; larger ones are rejected. Keep "
                          "max-message-bytes large enough for an image_base64 request of this size",
                          1, G_MAXUINT64, DEFAULT_MAX_IMAGE_BYTES, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_MAX_TEXT_BYTES,
      g_param_spec_uint("max-text-bytes", "Maximum text bytes",
                        "Longest query text accepted, in UTF-8 bytes; a longer one is rejected with an error document "
                        "(CLIP reads 77 tokens, a few hundred bytes: the rest would only cost time and be echoed back "
                        "in the answer)",
                        1, MAX_MAX_TEXT_BYTES, DEFAULT_MAX_TEXT_BYTES, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_IMAGE_ROOT,
      g_param_spec_string("image-root", "Image root",
                          "Folder whose image files \"image\" requests may name: a relative path is taken from "
                          "it, and a path or file:// uri that leads outside it (after resolving \"..\" and "
                          "symlinks) is rejected as \"image '<value>' is outside image-root\", whether or not the "
                          "file exists. NULL or empty (the default): every \"image\" request is rejected, so that "
                          "clients cannot make the service read files of its machine (image_base64 always works)",
                          DEFAULT_IMAGE_ROOT, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_NUM_REQUESTS,
      g_param_spec_int64("num-requests", "Number of requests",
                         "End the stream (EOS) after this many requests, valid or not; -1: never", -1, G_MAXINT64,
                         DEFAULT_NUM_REQUESTS, gstmoe::kPropertyMutableReady));
  gstmoe::install_curve_properties(gobject_class, PROP_CURVE_SECRET_KEY_FILE, PROP_CURVE_ALLOWED_KEYS);
  gstmoe::metrics::install_address_property(gobject_class, PROP_METRICS_ADDRESS);
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec("zmq-query-stats: received (requests, valid or not), rejected (invalid requests, "
                               "sent on as failed requests); reset at start"));

  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "ZeroMQ request source", "Source/Network",
      "Receives search requests, one JSON object per ZeroMQ message: {\"id\": \"q1\", \"text\": \"red mug\"}, "
      "{\"id\": \"q2\", \"image\": \"/path/or/file/uri.jpg\"} (the file is read here, only under image-root), "
      "{\"id\": \"q3\", \"image_base64\": \"...\"} or an image with a text (a hybrid: \"like this photo, but "
      "red\"), with an optional \"k\" (1..1024). id is a string or an integer. "
      "Each request becomes one application/x-moe-request buffer (the text, or the image file bytes; a hybrid's "
      "text is in the record) with a GstMoeBatchMeta row. Catalog updates: an \"op\": \"upsert\" request (an "
      "\"item\" with its text or image) becomes a request buffer whose row carries the item; an \"op\": "
      "\"delete\" (\"items\": catalog ids) an empty buffer whose meta carries it as a control for ann-query. "
      "An invalid request becomes an empty buffer whose meta lists it as failed (stage "
      "zmq-query, with the reason), so that it is answered by an error document downstream. With "
      "socket-type=router each client also gets an immediate accepted/rejected reply.\n"
      "Example: gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! queue ! moe-encode model=clip ! "
      "moe-route model=adapter ! moe-expert model=adapter ! ann-query index=catalog.faiss ! "
      "zmq-publish endpoint=tcp://127.0.0.1:5556",
      "gst-moe");

  basesrc_class->start = GST_DEBUG_FUNCPTR(gst_zmq_query_start);
  basesrc_class->stop = GST_DEBUG_FUNCPTR(gst_zmq_query_stop);
  basesrc_class->unlock = GST_DEBUG_FUNCPTR(gst_zmq_query_unlock);
  basesrc_class->unlock_stop = GST_DEBUG_FUNCPTR(gst_zmq_query_unlock_stop);
  basesrc_class->query = GST_DEBUG_FUNCPTR(gst_zmq_query_query);
  pushsrc_class->create = GST_DEBUG_FUNCPTR(gst_zmq_query_create);

  gst_type_mark_as_plugin_api(GST_TYPE_ZMQ_QUERY_SOCKET_TYPE, static_cast<GstPluginAPIFlags>(0));
}

static void gst_zmq_query_init(GstZmqQuery* self) {
  self->endpoint = g_strdup(DEFAULT_ENDPOINT);
  self->bind = DEFAULT_BIND;
  self->socket_type = DEFAULT_SOCKET_TYPE;
  self->recv_hwm = DEFAULT_RECV_HWM;
  self->max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES;
  self->max_image_bytes = DEFAULT_MAX_IMAGE_BYTES;
  self->max_text_bytes = DEFAULT_MAX_TEXT_BYTES;
  self->image_root = g_strdup(DEFAULT_IMAGE_ROOT);
  self->num_requests = DEFAULT_NUM_REQUESTS;
  self->metrics_address = g_strdup("");
  GstBaseSrc* src = GST_BASE_SRC(self);
  gst_base_src_set_live(src, TRUE);
  gst_base_src_set_format(src, GST_FORMAT_TIME);
  // Buffers carry their arrival (running) time.
  gst_base_src_set_do_timestamp(src, TRUE);
}
