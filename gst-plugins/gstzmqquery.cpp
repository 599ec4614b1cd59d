/* zmq-query: the request entrance of a gst-moe service.
 *
 * Clients send one JSON request per ZeroMQ message ({"id": "q1", "text": "red mug"},
 * {"id": "q2", "image": "/photos/mug.jpg"}, {"id": "q3", "image_base64": "iVBORw0..."}, optional
 * "k"). Each message becomes one application/x-moe-request buffer: the query text or the image
 * file bytes, with a GstMoeBatchMeta row describing the request. A request that cannot be served
 * is not an element error: it becomes an empty buffer whose meta carries it as a failed request,
 * so that it is answered with an error document at the end of the pipeline like every other
 * request. With a ROUTER socket each client also gets an immediate accepted/rejected reply.
 *
 * The service reads image files only under image-root, so that a client cannot make it read any
 * file of the machine or learn which files exist outside that folder; and ZeroMQ itself drops
 * messages larger than max-message-bytes, so that a huge message is never received in full.
 */
#include "gstzmqquery.h"

#include <glib/gstdio.h>
#include <json-glib/json-glib.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "gstmoemeta.h"
#include "gstmoezmq.h"
#include "moe/error.h"
#include "moe/image_decode.h"

GST_DEBUG_CATEGORY_STATIC(gst_zmq_query_debug);
#define GST_CAT_DEFAULT gst_zmq_query_debug

struct _GstZmqQuery {
  GstPushSrc parent;

  // Properties (object lock). Socket settings take effect at the next start.
  gchar* endpoint;
  gboolean bind;
  GstZmqQuerySocketType socket_type;
  gint recv_hwm;
  guint64 max_message_bytes;
  guint64 max_image_bytes;
  gchar* image_root;
  gint64 num_requests;

  // Streaming state: used by start/stop and the streaming thread (create) only.
  gstmoe::ZmqSocket* zmq;
  gboolean router;   // socket-type at start
  gchar* root_path;  // image-root at start, canonical (realpath); nullptr: image paths are refused
  gint flushing;     // atomic: set by unlock() to interrupt create()

  // Statistics (object lock), reset at start.
  guint64 received;
  guint64 rejected;
};

enum {
  PROP_0,
  PROP_ENDPOINT,
  PROP_BIND,
  PROP_SOCKET_TYPE,
  PROP_RECV_HWM,
  PROP_MAX_MESSAGE_BYTES,
  PROP_MAX_IMAGE_BYTES,
  PROP_IMAGE_ROOT,
  PROP_NUM_REQUESTS,
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
#define DEFAULT_IMAGE_ROOT nullptr
#define DEFAULT_NUM_REQUESTS (-1)
#define MIN_K 1
#define MAX_K 1024
// create() waits for messages in slices this long, so that unlock() is noticed promptly.
static constexpr std::chrono::milliseconds kPollInterval{100};
// After the last of num-requests requests, how long stopping may wait for its reply to leave.
static constexpr int kReplyDrainMs = 1000;
static const char* const kStage = "zmq-query";

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
G_DEFINE_TYPE(GstZmqQuery, gst_zmq_query, GST_TYPE_PUSH_SRC);
GST_ELEMENT_REGISTER_DEFINE(zmq_query, "zmq-query", GST_RANK_NONE, GST_TYPE_ZMQ_QUERY);

// ---------------------------------------------------------------------------------------------
// Request parsing

namespace {

// Why a request cannot be served: names the field and the problem.
struct Rejection {
  std::string reason;
};

[[noreturn]] void reject(std::string reason) { throw Rejection{std::move(reason)}; }

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The size of the largest image_base64 request for an image of `image_bytes` bytes: 4 characters
// per 3 bytes, a line break after every 76 characters (as base64(1) writes them) that JSON
// escapes as the two characters \n, and 1 KiB for the rest of the JSON (id, k, member names).
// Saturates at G_MAXUINT64.
constexpr guint64 base64_request_bytes(guint64 image_bytes) {
  const guint64 groups = image_bytes / 3 + (image_bytes % 3 ? 1 : 0);
  if (groups > (G_MAXUINT64 - 1024) / 5) return G_MAXUINT64;
  const guint64 chars = 4 * groups;
  return chars + 2 * ((chars + 75) / 76) + 1024;
}
static_assert(base64_request_bytes(DEFAULT_MAX_IMAGE_BYTES) == 45917618 &&
                  DEFAULT_MAX_MESSAGE_BYTES >= base64_request_bytes(DEFAULT_MAX_IMAGE_BYTES),
              "the defaults of max-message-bytes, max-image-bytes and their blurbs agree");

// True if the canonical `path` is `root` (canonical) or lies under it.
bool is_within(const std::string& path, const std::string& root) {
  return path.compare(0, root.size(), root) == 0 &&
         (path.size() == root.size() || root.back() == '/' || path[root.size()] == '/');
}

// The canonical path of the file `path` names (the "image" value `image` as a local path),
// refused unless it lies inside `root` (canonical). Relative paths are taken from the root, and
// resolving ".." and symlinks before the check means neither can lead out of it. A path that
// leads out is refused with one reason whether or not its target exists, so that clients learn
// nothing about files outside the root.
std::string confine_to_root(const std::string& image, const std::string& path, const std::string& root) {
  const std::string outside = "image " + quote(image) + " is outside image-root";
  const std::string full = g_path_is_absolute(path.c_str()) ? path : root + G_DIR_SEPARATOR_S + path;
  if (char* real = realpath(full.c_str(), nullptr)) {
    const std::string resolved = real;
    free(real);
    if (!is_within(resolved, root)) reject(outside);
    return resolved;
  }
  const int error = errno;
  // It does not resolve (a missing file or folder, a broken symlink, no permission): its nearest
  // ancestor that exists (a symlink counts as existing) tells whether the failure happened inside
  // the root. That ancestor must resolve inside the root for the real reason to be given; one that
  // does not resolve is a broken symlink whose target is unknown, so it counts as outside.
  std::string existing = full;
  GStatBuf st;
  while (g_lstat(existing.c_str(), &st) != 0) {
    gchar* parent = g_path_get_dirname(existing.c_str());
    existing = parent;
    g_free(parent);
  }
  char* real = realpath(existing.c_str(), nullptr);
  const bool inside = real && is_within(real, root);
  free(real);
  if (!inside) reject(outside);
  reject("image " + quote(image) + " cannot be read: " + g_strerror(error));
}

// The bytes of the image file at `path` (confine_to_root's result for the "image" value `image`),
// refused unless it is a regular file of 1..max_bytes bytes inside `root`. The file is opened
// once and everything else goes through that descriptor: what was opened is checked to lie inside
// the root (its /proc/self/fd link), so a path component swapped for a symlink after
// confine_to_root cannot lead out, and O_NONBLOCK keeps a FIFO swapped in from blocking the
// streaming thread. Reasons quote the client's value, never the resolved path (which would tell
// where the root is).
GstBuffer* read_image_file(const std::string& image, const std::string& path, const std::string& root,
                           guint64 max_bytes) {
  const std::string what = "image " + quote(image);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) reject(what + " cannot be read: " + g_strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  char* opened = realpath(link.c_str(), nullptr);
  const bool inside = opened && is_within(opened, root);
  free(opened);
  if (!inside) reject(what + " is outside image-root");
  struct stat st;
  if (fstat(fd, &st) != 0) reject(what + " cannot be read: " + g_strerror(errno));
  if (!S_ISREG(st.st_mode)) reject(what + " is not a regular file");
  auto check_size = [&](guint64 size) {
    if (size == 0) reject(what + " is empty");
    if (size > max_bytes)
      reject(what + " is " + std::to_string(size) + " bytes, more than max-image-bytes (" +
             std::to_string(max_bytes) + ")");
  };
  check_size(static_cast<guint64>(st.st_size));
  // Read to the end, but never past max_bytes + 1 (the file may grow while it is read).
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size) + 1);
  size_t got = 0;
  for (;;) {
    if (got == bytes.size()) {
      if (bytes.size() > max_bytes) break;
      bytes.resize(std::min<size_t>(bytes.size() * 2, static_cast<size_t>(max_bytes) + 1));
    }
    const ssize_t n = read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) reject(what + " cannot be read: " + g_strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  check_size(bytes.size());
  return gstmoe::bytes_buffer(std::move(bytes));
}

// The local path an "image" value names: a path, or a file:// uri.
std::string image_path(const std::string& image) {
  if (image.find("://") == std::string::npos) return image;
  if (image.rfind("file://", 0) != 0) reject("image " + quote(image) + " is neither a local path nor a file:// uri");
  GError* error = nullptr;
  gchar* path = g_filename_from_uri(image.c_str(), nullptr, &error);
  if (!path) {
    const std::string reason = "image " + quote(image) + " is not a valid file:// uri: " + error->message;
    g_error_free(error);
    reject(reason);
  }
  std::string result = path;
  g_free(path);
  return result;
}

// Decodes base64 (standard alphabet, '=' padding; whitespace such as the line breaks of
// base64(1) output is ignored). g_base64_decode skips invalid characters silently, so the text
// is checked first.
GstBuffer* decode_base64_image(const std::string& text, guint64 max_bytes) {
  const std::string what = "image_base64 is not valid base64: ";
  std::string compact;
  compact.reserve(text.size());
  size_t padding = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (g_ascii_isspace(c)) continue;
    if (c == '=') {
      ++padding;
    } else if (g_ascii_isalnum(c) || c == '+' || c == '/') {
      if (padding > 0) reject(what + "'=' padding before the end (offset " + std::to_string(i) + ")");
    } else {
      reject(what + "unexpected character " + quote(std::string(1, c)) + " at offset " + std::to_string(i));
    }
    compact.push_back(c);
  }
  if (compact.empty()) reject("image_base64 is empty");
  if (compact.size() % 4 != 0 || padding > 2)
    reject(what + "its length without whitespace (" + std::to_string(compact.size()) +
           ") is not a multiple of 4 or it has more than two '=' at the end");
  const guint64 decoded = compact.size() / 4 * 3 - padding;
  if (decoded > max_bytes)
    reject("image_base64 decodes to " + std::to_string(decoded) + " bytes, more than max-image-bytes (" +
           std::to_string(max_bytes) + ")");
  gsize size = 0;
  guchar* data = g_base64_decode(compact.c_str(), &size);
  return gst_buffer_new_wrapped(data, size);
}

// The string value of member `name`, rejected unless it is a non-empty string.
std::string string_member(JsonObject* object, const char* name, const char* expected) {
  JsonNode* node = json_object_get_member(object, name);
  if (!JSON_NODE_HOLDS_VALUE(node) || json_node_get_value_type(node) != G_TYPE_STRING)
    reject(std::string(name) + " must be " + expected);
  std::string value = json_node_get_string(node);
  if (value.empty()) reject(std::string(name) + " is empty");
  return value;
}

// Parses one request message into `record` (filled as far as parsing got, so that a rejection
// can still report the id and modality) and returns its payload. `image_root` is the canonical
// image-root, nullptr if none. Throws Rejection.
GstBuffer* parse_request(const zmq::message_t& message, guint64 max_image_bytes, const char* image_root,
                         gstmoe::RequestRecord& record) {
  const char* data = message.data<char>();
  const gssize size = static_cast<gssize>(message.size());
  if (size == 0) reject("request is empty");
  const gchar* bad = nullptr;
  if (!g_utf8_validate(data, size, &bad))
    reject("request is not valid UTF-8 (byte offset " + std::to_string(bad - data) + ")");

  std::unique_ptr<JsonParser, decltype(&g_object_unref)> parser(json_parser_new(), g_object_unref);
  GError* error = nullptr;
  if (!json_parser_load_from_data(parser.get(), data, size, &error)) {
    const std::string reason = std::string("request is not valid JSON: ") + error->message;
    g_error_free(error);
    reject(reason);
  }
  JsonNode* root = json_parser_get_root(parser.get());
  if (!root || !JSON_NODE_HOLDS_OBJECT(root)) reject("request is not a JSON object");
  JsonObject* object = json_node_get_object(root);

  JsonNode* id = json_object_get_member(object, "id");
  if (!id) reject("id is missing");
  if (JSON_NODE_HOLDS_VALUE(id) && json_node_get_value_type(id) == G_TYPE_INT64)
    record.id = std::to_string(json_node_get_int(id));
  else
    record.id = string_member(object, "id", "a string or an integer");

  static const char* const kSources[] = {"text", "image", "image_base64"};
  std::string present;
  int count = 0;
  for (const char* field : kSources) {
    if (!json_object_has_member(object, field)) continue;
    present += (count ? " and " : "") + std::string(field);
    if (count++ == 0) record.modality = g_str_equal(field, "text") ? gstmoe::Modality::Text : gstmoe::Modality::Image;
  }
  if (count != 1) reject("request needs exactly one of text, image, image_base64; it has " + (count ? present : "none"));

  if (JsonNode* k = json_object_get_member(object, "k")) {
    const bool integer = JSON_NODE_HOLDS_VALUE(k) && json_node_get_value_type(k) == G_TYPE_INT64;
    if (!integer || json_node_get_int(k) < MIN_K || json_node_get_int(k) > MAX_K)
      reject("k must be an integer from " + std::to_string(MIN_K) + " to " + std::to_string(MAX_K) +
             (integer ? " (got " + std::to_string(json_node_get_int(k)) + ")" : ""));
    record.k = static_cast<int>(json_node_get_int(k));
  }

  if (json_object_has_member(object, "text")) {
    record.text = string_member(object, "text", "a string");
    return gst_buffer_new_memdup(record.text.data(), record.text.size());
  }
  if (json_object_has_member(object, "image")) {
    record.uri = string_member(object, "image", "a string (a path or a file:// uri)");
    if (!image_root)
      reject("image paths are not served: zmq-query has no image-root (the operator sets image-root=DIR to serve "
             "the image files under DIR); send the image itself as image_base64");
    return read_image_file(record.uri, confine_to_root(record.uri, image_path(record.uri), image_root), image_root,
                           max_image_bytes);
  }
  GstBuffer* payload = decode_base64_image(string_member(object, "image_base64", "a string"), max_image_bytes);
  record.uri = "base64:" + std::to_string(gst_buffer_get_size(payload)) + " bytes";
  return payload;
}

// The reply a ROUTER client gets: {"id": ..., "status": "accepted"} or
// {"id": ..., "status": "rejected", "error": "..."}; id is null when the request had none.
std::string reply_json(const std::string& id, const std::string* error) {
  JsonBuilder* builder = json_builder_new();
  json_builder_begin_object(builder);
  json_builder_set_member_name(builder, "id");
  if (id.empty())
    json_builder_add_null_value(builder);
  else
    json_builder_add_string_value(builder, id.c_str());
  json_builder_set_member_name(builder, "status");
  json_builder_add_string_value(builder, error ? "rejected" : "accepted");
  if (error) {
    json_builder_set_member_name(builder, "error");
    json_builder_add_string_value(builder, error->c_str());
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
    case PROP_IMAGE_ROOT:
      g_free(self->image_root);
      self->image_root = g_value_dup_string(value);
      break;
    case PROP_NUM_REQUESTS:
      self->num_requests = g_value_get_int64(value);
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
    case PROP_IMAGE_ROOT:
      g_value_set_string(value, self->image_root);
      break;
    case PROP_NUM_REQUESTS:
      g_value_set_int64(value, self->num_requests);
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
  self->router = self->socket_type == GST_ZMQ_QUERY_SOCKET_ROUTER;
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
  if (max_message != 0 && max_message < base64_request_bytes(max_image))
    GST_ELEMENT_WARNING(self, RESOURCE, SETTINGS,
                        ("max-message-bytes (%" G_GUINT64_FORMAT ") is smaller than the largest image_base64 "
                         "request that max-image-bytes (%" G_GUINT64_FORMAT ") allows (%" G_GUINT64_FORMAT
                         " bytes): ZeroMQ drops larger messages unanswered",
                         max_message, max_image, base64_request_bytes(max_image)),
                        (nullptr));

  // ZeroMQ's "no limit" is -1.
  const int64_t max_msgsize = max_message == 0 ? -1 : static_cast<int64_t>(max_message);
  try {
    self->zmq = new gstmoe::ZmqSocket(self->router ? zmq::socket_type::router : zmq::socket_type::pull, endpoint,
                                      bind, [hwm, max_msgsize](zmq::socket_t& s) {
                                        s.set(zmq::sockopt::rcvhwm, hwm);
                                        s.set(zmq::sockopt::maxmsgsize, max_msgsize);
                                      });
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, OPEN_READ, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  if (!root_path.empty()) self->root_path = g_strdup(root_path.c_str());
  GST_INFO_OBJECT(self, "%s %s (%s), image-root %s", bind ? "bound to" : "connected to", endpoint.c_str(),
                  self->router ? "router" : "pull", self->root_path ? self->root_path : "none");
  return TRUE;
}

static gboolean gst_zmq_query_stop(GstBaseSrc* src) {
  GstZmqQuery* self = GST_ZMQ_QUERY(src);
  delete self->zmq;
  self->zmq = nullptr;
  g_clear_pointer(&self->root_path, g_free);
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
  zmq::socket_t& socket = self->zmq->socket();
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
    if (!zmq::send_multipart(self->zmq->socket(), parts, zmq::send_flags::dontwait))
      GST_WARNING_OBJECT(self, "could not send the reply %s: client queue full", body.c_str());
  } catch (const zmq::error_t& e) {
    GST_WARNING_OBJECT(self, "could not send the reply %s: %s", body.c_str(), e.what());
  }
}

static GstFlowReturn gst_zmq_query_create(GstPushSrc* src, GstBuffer** out) {
  GstZmqQuery* self = GST_ZMQ_QUERY(src);
  GST_OBJECT_LOCK(self);
  const bool done = self->num_requests >= 0 && self->received >= static_cast<guint64>(self->num_requests);
  const guint64 max_image_bytes = self->max_image_bytes;
  GST_OBJECT_UNLOCK(self);
  if (done) {
    GST_INFO_OBJECT(self, "num-requests requests received: end of stream");
    // The last reply was just queued: let stopping give it a moment to reach its client.
    if (self->router) self->zmq->set_linger(kReplyDrainMs);
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
  if (self->router) envelope = frames.size() >= 3 && frames[1].size() == 0 ? 2 : 1;

  gstmoe::BatchRecords records;
  GstBuffer* buffer = nullptr;
  std::string reason;
  try {
    if (frames.size() != envelope + 1)
      reject("request has " + std::to_string(frames.size() - envelope) +
             " frames; expected one frame holding the JSON request");
    buffer = parse_request(frames[envelope], max_image_bytes, self->root_path, record);
    records.rows.push_back(record);
  } catch (const Rejection& r) {
    reason = r.reason;
    buffer = gst_buffer_new();
    records.failed.push_back(gstmoe::FailedRequest{record, kStage, reason});
  }
  gst_buffer_add_moe_batch_meta(buffer, records);

  GST_OBJECT_LOCK(self);
  ++self->received;
  if (!reason.empty()) ++self->rejected;
  GST_OBJECT_UNLOCK(self);
  if (reason.empty())
    GST_DEBUG_OBJECT(self, "request '%s' (%s, %" G_GSIZE_FORMAT " bytes)", record.id.c_str(),
                     gstmoe::modality_name(record.modality), gst_buffer_get_size(buffer));
  else
    GST_INFO_OBJECT(self, "request '%s' rejected: %s", record.id.c_str(), reason.c_str());

  if (self->router) gst_zmq_query_reply(self, frames, envelope, reply_json(record.id, reason.empty() ? nullptr : &reason));
  *out = buffer;
  return GST_FLOW_OK;
}

static void gst_zmq_query_finalize(GObject* object) {
  g_free(GST_ZMQ_QUERY(object)->endpoint);
  g_free(GST_ZMQ_QUERY(object)->image_root);
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_zmq_query_class_init(GstZmqQueryClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseSrcClass* basesrc_class = GST_BASE_SRC_CLASS(klass);
  GstPushSrcClass* pushsrc_class = GST_PUSH_SRC_CLASS(klass);

  GST_DEBUG_CATEGORY_INIT(gst_zmq_query_debug, "zmq-query", 0, "ZeroMQ request source");

  gobject_class->set_property = gst_zmq_query_set_property;
  gobject_class->get_property = gst_zmq_query_get_property;
  gobject_class->finalize = gst_zmq_query_finalize;

  const GParamFlags rw_ready =
      static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY);
  const GParamFlags rw_playing =
      static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_PLAYING);
  g_object_class_install_property(
      gobject_class, PROP_ENDPOINT,
      g_param_spec_string("endpoint", "Endpoint",
                          "ZeroMQ endpoint to bind or connect the socket to (tcp://HOST:PORT, ipc:///PATH; bind "
                          "also takes tcp://*:PORT for all interfaces)",
                          DEFAULT_ENDPOINT, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_BIND,
      g_param_spec_boolean("bind", "Bind",
                           "Bind the endpoint (clients connect to it); FALSE: connect to a client or broker that "
                           "binds it (ZeroMQ connects in the background and retries)",
                           DEFAULT_BIND, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_SOCKET_TYPE,
      g_param_spec_enum("socket-type", "Socket type",
                        "pull: PUSH clients send requests without reply; router: REQ or DEALER clients get an "
                        "immediate reply {\"id\":...,\"status\":\"accepted\"} or {...,\"status\":\"rejected\","
                        "\"error\":...} (results always come from zmq-publish)",
                        GST_TYPE_ZMQ_QUERY_SOCKET_TYPE, DEFAULT_SOCKET_TYPE, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_RECV_HWM,
      g_param_spec_int("recv-hwm", "Receive high-water mark",
                       "Requests queued per client (ZMQ_RCVHWM) before ZeroMQ stops reading from it (a PUSH "
                       "client then waits); 0: unlimited",
                       0, MAX_RECV_HWM, DEFAULT_RECV_HWM, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_MAX_MESSAGE_BYTES,
      g_param_spec_uint64("max-message-bytes", "Maximum message bytes",
                          "Largest request frame accepted, in bytes (ZMQ_MAXMSGSIZE). ZeroMQ disconnects a client "
                          "that sends a larger one and discards the message before it is read in full, so that "
                          "request gets no error document and no router reply. An image_base64 request takes 4/3 x "
                          "max-image-bytes plus a line break (escaped in JSON as \\n) per 76 characters and the JSON around it (45917618 "
                          "bytes for the default 32 MiB, hence the default 48 MiB); start warns when this is "
                          "smaller than that. 0: unlimited",
                          0, MAX_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_MAX_IMAGE_BYTES,
      g_param_spec_uint64("max-image-bytes", "Maximum image bytes",
                          "Largest image (file or decoded image_base64) accepted; larger ones are rejected. Keep "
                          "max-message-bytes large enough for an image_base64 request of this size", 1,
                          G_MAXUINT64, DEFAULT_MAX_IMAGE_BYTES, rw_playing));
  g_object_class_install_property(
      gobject_class, PROP_IMAGE_ROOT,
      g_param_spec_string("image-root", "Image root",
                          "Folder whose image files \"image\" requests may name: a relative path is taken from "
                          "it, and a path or file:// uri that leads outside it (after resolving \"..\" and "
                          "symlinks) is rejected as \"image '<value>' is outside image-root\", whether or not the "
                          "file exists. NULL or empty (the default): every \"image\" request is rejected, so that "
                          "clients cannot make the service read files of its machine (image_base64 always works)",
                          DEFAULT_IMAGE_ROOT, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_NUM_REQUESTS,
      g_param_spec_int64("num-requests", "Number of requests",
                         "End the stream (EOS) after this many requests, valid or not; -1: never", -1, G_MAXINT64,
                         DEFAULT_NUM_REQUESTS, rw_ready));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      g_param_spec_boxed("stats", "Statistics",
                         "zmq-query-stats: received (requests, valid or not), rejected (invalid requests, sent on "
                         "as failed requests); reset at start",
                         GST_TYPE_STRUCTURE, static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS)));

  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "ZeroMQ request source", "Source/Network",
      "Receives search requests, one JSON object per ZeroMQ message: {\"id\": \"q1\", \"text\": \"red mug\"}, "
      "{\"id\": \"q2\", \"image\": \"/path/or/file/uri.jpg\"} (the file is read here, only under image-root) or "
      "{\"id\": \"q3\", \"image_base64\": \"...\"}, with an optional \"k\" (1..1024). id is a string or an integer. "
      "Each request becomes one application/x-moe-request buffer (the text, or the image file bytes) with a "
      "GstMoeBatchMeta row. An invalid request becomes an empty buffer whose meta lists it as failed (stage "
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
  self->image_root = g_strdup(DEFAULT_IMAGE_ROOT);
  self->num_requests = DEFAULT_NUM_REQUESTS;
  GstBaseSrc* src = GST_BASE_SRC(self);
  gst_base_src_set_live(src, TRUE);
  gst_base_src_set_format(src, GST_FORMAT_TIME);
  // Buffers carry their arrival (running) time.
  gst_base_src_set_do_timestamp(src, TRUE);
}
