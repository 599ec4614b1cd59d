// zmq-publish and zmq-query against real ZeroMQ peers on loopback endpoints (ipc:// in a
// temporary directory, or tcp://127.0.0.1 on a port the kernel picked).
//
// Delivery waits are bounded (receive timeouts of several seconds) so that a broken element fails
// the test instead of hanging it; nothing asserts how fast anything is. Also the `cost` object of
// the result documents these elements carry (gstmoeresult.h).
#include <gst/app/gstappsink.h>
#include <gst/check/gstharness.h>
#include <gst/gst.h>
#include <gtest/gtest.h>
#include <json-glib/json-glib.h>

#include <glib/gstdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "gstmoeencode.h"
#include "gstmoemeta.h"
#include "gstmoeresult.h"
#include "gstmoezmq.h"
#include "gstzmqpublish.h"
#include "gstzmqquery.h"
#include "test_util.h"

namespace {

// How long a test waits for a message that must arrive.
constexpr int kReceiveTimeoutMs = 10000;

class ZmqTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    gst_init(nullptr, nullptr);
    GST_ELEMENT_REGISTER(zmq_publish, nullptr);
    GST_ELEMENT_REGISTER(zmq_query, nullptr);
    GST_ELEMENT_REGISTER(moe_encode, nullptr);  // hybrid requests and updates through the encoder
    if (GstElementFactory* f = gst_element_factory_find("appsink"))
      gst_object_unref(f);
    else
      gst_element_register(nullptr, "appsink", GST_RANK_NONE, GST_TYPE_APP_SINK);
  }

  void SetUp() override {
    GError* error = nullptr;
    gchar* dir = g_dir_make_tmp("gst-zmq-XXXXXX", &error);
    ASSERT_NE(dir, nullptr) << error->message;
    dir_ = dir;
    g_free(dir);
  }

  void TearDown() override { remove_tree(dir_); }

  static void remove_tree(const std::string& path) {
    if (GDir* d = g_dir_open(path.c_str(), 0, nullptr)) {
      while (const gchar* name = g_dir_read_name(d)) {
        const std::string child = path + "/" + name;
        // A symlink to a folder is removed, not followed.
        if (g_file_test(child.c_str(), G_FILE_TEST_IS_DIR) && !g_file_test(child.c_str(), G_FILE_TEST_IS_SYMLINK))
          remove_tree(child);
        else
          g_remove(child.c_str());
      }
      g_dir_close(d);
    }
    g_rmdir(path.c_str());
  }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string ipc(const std::string& name) const { return "ipc://" + path(name); }

  std::string write_file(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    EXPECT_TRUE(g_file_set_contents(p.c_str(), bytes.data(), static_cast<gssize>(bytes.size()), nullptr));
    return p;
  }

  // A loopback tcp endpoint that nothing listens on: the kernel picks a free port for a probe
  // socket, which lets it go. The probe has a context of its own because only terminating the
  // context waits until the port is really released (zmq_close is asynchronous).
  static std::string free_tcp_endpoint() {
    zmq::context_t probe_ctx;
    zmq::socket_t probe(probe_ctx, zmq::socket_type::pull);
    probe.set(zmq::sockopt::linger, 0);
    probe.bind("tcp://127.0.0.1:*");
    const std::string endpoint = probe.get(zmq::sockopt::last_endpoint);
    probe.close();
    probe_ctx.close();
    return endpoint;
  }

  zmq::socket_t subscriber(const std::string& endpoint, const std::string& prefix, int rcvhwm = 1000) {
    zmq::socket_t sub(ctx_, zmq::socket_type::sub);
    sub.set(zmq::sockopt::linger, 0);
    sub.set(zmq::sockopt::rcvhwm, rcvhwm);
    sub.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
    sub.set(zmq::sockopt::subscribe, prefix);
    sub.connect(endpoint);
    return sub;
  }

  // A subscriber that binds a loopback tcp port itself, for a publisher that connects.
  zmq::socket_t bound_subscriber(const std::string& prefix, std::string* endpoint) {
    zmq::socket_t sub(ctx_, zmq::socket_type::sub);
    sub.set(zmq::sockopt::linger, 0);
    sub.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
    sub.set(zmq::sockopt::subscribe, prefix);
    sub.bind("tcp://127.0.0.1:*");
    *endpoint = sub.get(zmq::sockopt::last_endpoint);
    return sub;
  }

  std::string dir_;
  zmq::context_t ctx_;
};

std::string to_string(const zmq::message_t& m) { return std::string(m.data<char>(), m.size()); }

guint64 stat(GstElement* element, const char* field) {
  GstStructure* s = nullptr;
  g_object_get(element, "stats", &s, nullptr);
  guint64 value = G_MAXUINT64;
  EXPECT_TRUE(s && gst_structure_get_uint64(s, field, &value)) << field;
  if (s) gst_structure_free(s);
  return value;
}

std::string stat_string(GstElement* element, const char* field) {
  GstStructure* s = nullptr;
  g_object_get(element, "stats", &s, nullptr);
  const gchar* value = s ? gst_structure_get_string(s, field) : nullptr;
  EXPECT_NE(value, nullptr) << field;
  std::string result = value ? value : "";
  if (s) gst_structure_free(s);
  return result;
}

// The message of the first error (or warning) on `bus`, "" if none.
std::string bus_message(GstBus* bus, GstMessageType type = GST_MESSAGE_ERROR) {
  GstMessage* msg = gst_bus_pop_filtered(bus, type);
  if (!msg) return "";
  GError* error = nullptr;
  if (type == GST_MESSAGE_WARNING)
    gst_message_parse_warning(msg, &error, nullptr);
  else
    gst_message_parse_error(msg, &error, nullptr);
  std::string text = error->message;
  g_error_free(error);
  gst_message_unref(msg);
  return text;
}

// ---------------------------------------------------------------------------------------------
// zmq-publish

GstHarness* publish_harness(GstElement* element) {
  GstHarness* h = gst_harness_new_with_element(element, "sink", nullptr);  // plays it
  gst_object_unref(element);
  gst_harness_set_src_caps_str(h, "application/json");
  return h;
}

GstElement* make_publish(const std::string& endpoint, const std::string& topic = "", gboolean bind = TRUE) {
  GstElement* e = gst_element_factory_make("zmq-publish", nullptr);
  g_object_set(e, "endpoint", endpoint.c_str(), "topic", topic.c_str(), "bind", bind, nullptr);
  return e;
}

GstFlowReturn push(GstHarness* h, const std::string& payload) {
  return gst_harness_push(h, gst_buffer_new_memdup(payload.data(), payload.size()));
}

// The payload of the next message, checking the topic frame when `topic` is set; "" on timeout.
std::string receive_payload(zmq::socket_t& sub, const std::string& topic) {
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(sub, std::back_inserter(frames))) return "";
  EXPECT_EQ(frames.size(), topic.empty() ? 1u : 2u);
  if (!topic.empty()) {
    EXPECT_EQ(to_string(frames.front()), topic);
  }
  return to_string(frames.back());
}

// Works around ZeroMQ's slow joiner: until the subscription has reached the publisher, its
// messages go nowhere. Publishes numbered warm-up messages until `sub` receives one, then
// consumes up to the last one sent. Returns how many were published.
guint64 warm_up(GstHarness* h, zmq::socket_t& sub, const std::string& topic) {
  for (int i = 0; i < 500; ++i) {
    const std::string mark = "warm-up " + std::to_string(i);
    EXPECT_EQ(push(h, mark), GST_FLOW_OK);
    zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(20)) == 0) continue;
    for (std::string got; got != mark;) {
      got = receive_payload(sub, topic);
      if (got.empty()) {
        ADD_FAILURE() << "warm-up message '" << mark << "' never arrived";
        break;
      }
    }
    return static_cast<guint64>(i) + 1;
  }
  ADD_FAILURE() << "the subscription never reached the publisher";
  return 500;
}

struct PublishCase {
  const char* name;
  const char* topic;
  bool element_binds;  // false: the subscriber binds a tcp port and the element connects
};

void PrintTo(const PublishCase& c, std::ostream* os) { *os << c.name; }

class PublishDelivery : public ZmqTest, public ::testing::WithParamInterface<PublishCase> {};

TEST_P(PublishDelivery, SubscriberReceivesEachBufferAsOneMessage) {
  const PublishCase& c = GetParam();
  std::string endpoint = ipc("results.ipc");
  zmq::socket_t sub = c.element_binds ? subscriber(endpoint, c.topic) : bound_subscriber(c.topic, &endpoint);
  GstHarness* h = publish_harness(make_publish(endpoint, c.topic, c.element_binds));
  const guint64 warm = warm_up(h, sub, c.topic);
  guint64 warm_bytes = 0;
  for (guint64 i = 0; i < warm; ++i) warm_bytes += ("warm-up " + std::to_string(i)).size();

  // JSON object documents get "seq" and "stream" as their first members; other payloads (the
  // warm-up messages too) go out as they are and take no number.
  const std::string stream = stat_string(h->element, "stream");
  ASSERT_EQ(stream.size(), 16u);
  EXPECT_EQ(stream.find_first_not_of("0123456789abcdef"), std::string::npos) << stream;
  const auto numbered = [&stream](int seq) {
    return "\"seq\":" + std::to_string(seq) + ",\"stream\":\"" + stream + "\"";
  };
  const std::vector<std::pair<std::string, std::string>> docs = {
      {R"({"type":"result","id":"q1","results":[]})",
       "{" + numbered(1) + R"(,"type":"result","id":"q1","results":[]})"},
      {std::string(100000, 'x'), std::string(100000, 'x')},
      {R"({"type":"error","id":"q2","error":{"stage":"zmq-query"}})",
       "{" + numbered(2) + R"(,"type":"error","id":"q2","error":{"stage":"zmq-query"}})"},
      {"[1,2]", "[1,2]"},
      {"{}", "{" + numbered(3) + "}"},
      {" \n{ \"type\":\"index-built\"}", " \n{" + numbered(4) + ", \"type\":\"index-built\"}"}};
  guint64 bytes = 0;
  for (const auto& [pushed, sent] : docs) {
    EXPECT_EQ(push(h, pushed), GST_FLOW_OK);
    bytes += sent.size();
  }
  for (const auto& [pushed, sent] : docs) EXPECT_EQ(receive_payload(sub, c.topic), sent);

  EXPECT_EQ(stat(h->element, "sent"), warm + docs.size());
  EXPECT_EQ(stat(h->element, "bytes"), warm_bytes + bytes);
  EXPECT_EQ(stat(h->element, "seq"), 4u);
  EXPECT_EQ(stat_string(h->element, "stream"), stream);
  gst_harness_teardown(h);
}

INSTANTIATE_TEST_SUITE_P(Modes, PublishDelivery,
                         ::testing::Values(PublishCase{"BindNoTopic", "", true},
                                           PublishCase{"ConnectWithTopic", "results", false}),
                         [](const ::testing::TestParamInfo<PublishCase>& i) { return std::string(i.param.name); });

TEST_F(ZmqTest, PublishDefaults) {
  GstElement* e = gst_element_factory_make("zmq-publish", nullptr);
  gchar *endpoint = nullptr, *topic = nullptr;
  gboolean bind = FALSE, sync = TRUE;
  gchar *curve_key = nullptr, *curve_allowed = nullptr;
  gint hwm = 0;
  g_object_get(e, "endpoint", &endpoint, "topic", &topic, "bind", &bind, "send-hwm", &hwm, "sync", &sync,
               "curve-secret-key-file", &curve_key, "curve-allowed-keys", &curve_allowed, nullptr);
  EXPECT_STREQ(endpoint, "tcp://127.0.0.1:5556");
  EXPECT_STREQ(topic, "");
  EXPECT_TRUE(bind);
  EXPECT_EQ(hwm, 1000);
  EXPECT_FALSE(sync);             // a result stream never waits on the clock
  EXPECT_EQ(curve_key, nullptr);  // plain ZeroMQ unless the operator sets up CURVE
  EXPECT_EQ(curve_allowed, nullptr);
  EXPECT_EQ(stat(e, "sent"), 0u);
  EXPECT_EQ(stat(e, "seq"), 0u);
  EXPECT_EQ(stat_string(e, "stream"), "");
  g_free(endpoint);
  g_free(topic);
  gst_object_unref(e);
}

// The sequence number of a numbered document, as zmq-publish puts it first; 0 for another payload.
guint64 seq_of(const std::string& payload) {
  const std::string head = "{\"seq\":";
  return payload.compare(0, head.size(), head) == 0 ? std::stoull(payload.substr(head.size())) : 0;
}

// A subscriber that stops reading loses its own messages, and only those: every other subscriber
// still gets each one, and the pipeline goes on. (With ZMQ_XPUB_NODROP libzmq refused every
// message for all subscribers as soon as one subscriber's queue was full.)
TEST_F(ZmqTest, StalledSubscriberLosesOnlyItsOwnMessages) {
  const std::string endpoint = ipc("stalled.ipc");
  const std::string topic = "results";
  zmq::socket_t stalled = subscriber(endpoint, topic, /*rcvhwm=*/1);
  zmq::socket_t healthy = subscriber(endpoint, topic);
  GstElement* e = make_publish(endpoint, topic);
  g_object_set(e, "send-hwm", 10, nullptr);
  GstHarness* h = publish_harness(e);
  const guint64 warm = warm_up(h, stalled, topic) + warm_up(h, healthy, topic);
  const std::string stream = stat_string(h->element, "stream");

  // From here on the stalled subscriber reads nothing: after a few hundred KiB its queue and the
  // socket buffers are full. Each document is pushed once the healthy subscriber has the one
  // before, so that its own queue never fills: if it misses one, the stalled one made it.
  const int n = 2000;
  const std::string pad(16 * 1024, 'p');
  const auto members = [&pad](guint64 seq) {
    return "\"id\":\"q" + std::to_string(seq) + "\",\"pad\":\"" + pad + "\"}";
  };
  const auto published = [&](guint64 seq) {
    return "{\"seq\":" + std::to_string(seq) + ",\"stream\":\"" + stream + "\"," + members(seq);
  };
  for (int seq = 1; seq <= n; ++seq) {
    ASSERT_EQ(push(h, "{" + members(seq)), GST_FLOW_OK) << "document " << seq;
    ASSERT_EQ(receive_payload(healthy, topic), published(seq))
        << "document " << seq << " did not reach the subscriber that keeps up";
  }
  EXPECT_EQ(stat(h->element, "sent"), warm + n);
  EXPECT_EQ(stat(h->element, "seq"), static_cast<guint64>(n));

  // The stalled subscriber did lose documents, and its sequence numbers show the gap: what it
  // still gets is whole ([topic, document], never a stray half) and in order.
  stalled.set(zmq::sockopt::rcvtimeo, 1000);  // only ends the draining loop
  guint64 received = 0, last = 0;
  for (std::string got; !(got = receive_payload(stalled, topic)).empty();) {
    const guint64 seq = seq_of(got);
    if (seq == 0) continue;  // a warm-up message
    EXPECT_GT(seq, last);
    EXPECT_EQ(got, published(seq));
    last = seq;
    ++received;
  }
  EXPECT_LT(received, static_cast<guint64>(n));
  gst_harness_teardown(h);
}

TEST_F(ZmqTest, VanishedSubscriberDoesNotDisturbThePipeline) {
  const std::string endpoint = ipc("vanish.ipc");
  GstHarness* h = publish_harness(make_publish(endpoint));
  guint64 pushed = 0;
  {
    zmq::socket_t first = subscriber(endpoint, "");
    pushed += warm_up(h, first, "");
    for (int i = 0; i < 10; ++i, ++pushed) ASSERT_EQ(push(h, "doc " + std::to_string(i)), GST_FLOW_OK);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(receive_payload(first, ""), "doc " + std::to_string(i));
    first.close();  // mid-stream, with messages still queued for it
  }
  for (int i = 0; i < 200; ++i, ++pushed) ASSERT_EQ(push(h, std::string(4096, 'v')), GST_FLOW_OK);

  // A newcomer is served as usual.
  zmq::socket_t second = subscriber(endpoint, "");
  pushed += warm_up(h, second, "");
  ASSERT_EQ(push(h, "after"), GST_FLOW_OK);
  ++pushed;
  EXPECT_EQ(receive_payload(second, ""), "after");
  EXPECT_EQ(stat(h->element, "sent"), pushed);
  gst_harness_teardown(h);
}

// After EOS, stopping waits (up to drain-timeout) for queued messages to leave, so a stream that
// ends does not lose its last results.
TEST_F(ZmqTest, PublishDrainsQueuedMessagesAfterEos) {
  const std::string endpoint = ipc("drain.ipc");
  zmq::socket_t sub = subscriber(endpoint, "", /*rcvhwm=*/1);
  GstElement* e = make_publish(endpoint);
  g_object_set(e, "send-hwm", 0, "drain-timeout", 60000u, nullptr);
  GstHarness* h = publish_harness(e);
  warm_up(h, sub, "");

  // The subscriber is not reading yet: most of these wait in the publisher's queue.
  const int n = 200;
  for (int i = 0; i < n; ++i) ASSERT_EQ(push(h, std::to_string(i) + std::string(64 * 1024, 'd')), GST_FLOW_OK);

  std::thread stopper([h] {
    gst_harness_push_event(h, gst_event_new_eos());
    gst_element_set_state(h->element, GST_STATE_NULL);  // returns once the queue is delivered
  });
  int received = 0;
  for (; received < n; ++received) {
    const std::string got = receive_payload(sub, "");
    if (got.empty()) break;
    EXPECT_EQ(got.substr(0, std::to_string(received).size()), std::to_string(received));
  }
  stopper.join();
  EXPECT_EQ(received, n);
  gst_harness_teardown(h);
}

// Stops the harnessed sink and starts it again, with the stream's sticky events sent anew (the sink
// pad dropped them when it was deactivated).
void restart(GstHarness* h) {
  ASSERT_EQ(gst_element_set_state(h->element, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
  gst_harness_play(h);
  gst_harness_push_event(h, gst_event_new_stream_start("restarted"));
  gst_harness_set_src_caps_str(h, "application/json");
}

// Every start is a new stream: seq counts from 1 again, under a new stream id, so that a subscriber
// tells a restart from a gap.
TEST_F(ZmqTest, PublishNumbersEachStartAsANewStream) {
  const std::string endpoint = ipc("restart.ipc");
  zmq::socket_t sub = subscriber(endpoint, "");
  GstHarness* h = publish_harness(make_publish(endpoint));
  std::vector<std::string> streams;
  for (int start = 0; start < 2; ++start) {
    SCOPED_TRACE("start " + std::to_string(start));
    if (start > 0) restart(h);
    warm_up(h, sub, "");
    const std::string stream = stat_string(h->element, "stream");
    for (int seq = 1; seq <= 2; ++seq) {
      ASSERT_EQ(push(h, "{}"), GST_FLOW_OK);
      EXPECT_EQ(receive_payload(sub, ""), "{\"seq\":" + std::to_string(seq) + ",\"stream\":\"" + stream + "\"}");
    }
    streams.push_back(stream);
  }
  EXPECT_NE(streams[0], streams[1]);
  gst_harness_teardown(h);
}

// ---------------------------------------------------------------------------------------------
// CURVE helpers

struct CurveKeys {
  std::string public_key, secret_key;  // Z85
};

CurveKeys curve_keys() {
  char public_key[41], secret_key[41];
  EXPECT_EQ(zmq_curve_keypair(public_key, secret_key), 0);
  return {public_key, secret_key};
}

// A certificate as zmq.auth.create_certificates writes it: NAME.key (public) or NAME.key_secret.
std::string zcert(const CurveKeys& keys, bool with_secret) {
  std::string text = std::string("#   ZeroMQ CURVE ") +
                     (with_secret ? "**Secret** Certificate" : "Public Certificate") +
                     "\n\nmetadata\ncurve\n    public-key = \"" + keys.public_key + "\"\n";
  if (with_secret) text += "    secret-key = \"" + keys.secret_key + "\"\n";
  return text;
}

void set_curve(GstElement* e, const std::string& secret_key_file, const std::string& allowed_keys) {
  g_object_set(e, "curve-secret-key-file", secret_key_file.empty() ? nullptr : secret_key_file.c_str(),
               "curve-allowed-keys", allowed_keys.empty() ? nullptr : allowed_keys.c_str(), nullptr);
}

// A client socket, not connected yet; a CURVE client of the server whose public key is
// `server_key` when `keys` is given, else a plain one.
zmq::socket_t client_socket(zmq::context_t& ctx, zmq::socket_type type, const std::string& server_key = "",
                            const CurveKeys* keys = nullptr) {
  zmq::socket_t s(ctx, type);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
  if (keys) {
    s.set(zmq::sockopt::curve_serverkey, server_key);
    s.set(zmq::sockopt::curve_publickey, keys->public_key);
    s.set(zmq::sockopt::curve_secretkey, keys->secret_key);
  }
  return s;
}

struct Handshake {
  uint16_t event;  // ZMQ_EVENT_HANDSHAKE_SUCCEEDED or ZMQ_EVENT_HANDSHAKE_FAILED_*; 0: none came
  uint32_t value;  // for FAILED_AUTH the ZAP status code, for FAILED_PROTOCOL the ZMQ_PROTOCOL_ERROR_*
  bool operator==(const Handshake& o) const { return event == o.event && value == o.value; }
};

std::ostream& operator<<(std::ostream& os, const Handshake& h) {
  return os << "event 0x" << std::hex << h.event << std::dec << " value " << h.value;
}

// Connects `socket` to `endpoint`, queues `message` (if any) for it at once, and returns the
// outcome of its first handshake, as the socket's monitor reports it. (A refused connection is
// given up, with what was queued for it.)
Handshake connect_and_handshake(zmq::context_t& ctx, zmq::socket_t& socket, const std::string& endpoint,
                                const std::string& message = "") {
  static int monitors = 0;
  const std::string monitor_endpoint = "inproc://handshake-monitor-" + std::to_string(monitors++);
  EXPECT_EQ(zmq_socket_monitor(socket.handle(), monitor_endpoint.c_str(),
                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL),
            0);
  zmq::socket_t monitor(ctx, zmq::socket_type::pair);
  monitor.set(zmq::sockopt::linger, 0);
  monitor.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
  monitor.connect(monitor_endpoint);
  socket.connect(endpoint);
  if (!message.empty()) {
    EXPECT_TRUE(socket.send(zmq::buffer(message), zmq::send_flags::dontwait));
  }
  Handshake outcome{0, 0};
  std::vector<zmq::message_t> event;  // [event id (16 bits) + value (32 bits), endpoint]
  if (zmq::recv_multipart(monitor, std::back_inserter(event)) && event[0].size() >= 6) {
    memcpy(&outcome.event, event[0].data(), sizeof outcome.event);
    memcpy(&outcome.value, event[0].data<char>() + sizeof outcome.event, sizeof outcome.value);
  }
  // A refused client retries, and a monitor that nobody reads would end up holding its I/O thread.
  zmq_socket_monitor(socket.handle(), nullptr, 0);
  return outcome;
}

const Handshake kAdmitted{ZMQ_EVENT_HANDSHAKE_SUCCEEDED, 0};
const Handshake kKeyRefused{ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, 400};  // ZAP status 400 from the handler

// A client without CURVE fails on the mechanism: it reports that, or only that the server hung up
// on it, depending on which side read the other's greeting first.
bool failed_without_curve(const Handshake& h) {
  return h == Handshake{ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL, ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH} ||
         h.event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
}

// ---------------------------------------------------------------------------------------------
// Start failures (both elements)

struct StartCase {
  const char* element;
  const char* expected_type;
};

void PrintTo(const StartCase& c, std::ostream* os) { *os << c.element; }

class StartFailure : public ZmqTest, public ::testing::WithParamInterface<StartCase> {
 protected:
  // Starts the element on `endpoint`, after `configure`; returns the error message posted ("" if it
  // started).
  std::string start_error(
      const std::string& endpoint, gboolean bind = TRUE,
      const std::function<void(GstElement*)>& configure = [](GstElement*) {}) {
    GstElement* e = gst_element_factory_make(GetParam().element, nullptr);
    g_object_set(e, "endpoint", endpoint.c_str(), "bind", bind, nullptr);
    configure(e);
    GstBus* bus = gst_bus_new();
    gst_element_set_bus(e, bus);
    const GstStateChangeReturn ret = gst_element_set_state(e, GST_STATE_PAUSED);
    std::string error = bus_message(bus);
    EXPECT_EQ(ret == GST_STATE_CHANGE_FAILURE, !error.empty()) << error;
    gst_element_set_state(e, GST_STATE_NULL);
    gst_element_set_bus(e, nullptr);
    gst_object_unref(bus);
    gst_object_unref(e);
    return error;
  }
};

TEST_P(StartFailure, EndpointInUseFailsNamingTheEndpoint) {
  zmq::socket_t holder(ctx_, zmq::socket_type::pull);
  holder.set(zmq::sockopt::linger, 0);
  holder.bind("tcp://127.0.0.1:*");
  const std::string endpoint = holder.get(zmq::sockopt::last_endpoint);

  const std::string error = start_error(endpoint);
  EXPECT_NE(error.find("'" + endpoint + "'"), std::string::npos) << error;
  EXPECT_NE(error.find("bind"), std::string::npos) << error;
  EXPECT_NE(error.find(GetParam().expected_type), std::string::npos) << error;
  EXPECT_NE(error.find(zmq_strerror(EADDRINUSE)), std::string::npos) << error;
}

TEST_P(StartFailure, MalformedEndpointFailsWithAHint) {
  for (bool bind : {true, false}) {
    const std::string error = start_error("localhost:5555", bind);
    EXPECT_NE(error.find("'localhost:5555'"), std::string::npos) << error;
    EXPECT_NE(error.find("tcp://127.0.0.1:5556"), std::string::npos) << error;  // what endpoints look like
  }
}

TEST_P(StartFailure, TcpPortOutOfRangeIsRefused) {
  for (bool bind : {true, false}) {
    const std::string error = start_error("tcp://127.0.0.1:99999", bind);  // libzmq would use 34463
    EXPECT_NE(error.find("'tcp://127.0.0.1:99999'"), std::string::npos) << error;
    EXPECT_NE(error.find("out of range"), std::string::npos) << error;
  }
}

TEST_P(StartFailure, InprocEndpointIsRefused) {
  const std::string error = start_error("inproc://results");
  EXPECT_NE(error.find("inproc://"), std::string::npos) << error;
  EXPECT_NE(error.find("ipc://"), std::string::npos) << error;
}

TEST_P(StartFailure, FreeEndpointStarts) { EXPECT_EQ(start_error(ipc("free.ipc")), ""); }

// CURVE settings are read at start: an incomplete or broken one stops the element with an error
// that names the property, the file and the cause, and never a key.
TEST_P(StartFailure, CurveSettingsAreCheckedAtStart) {
  const CurveKeys server = curve_keys(), client = curve_keys();
  const std::string secret = write_file("server.key_secret", zcert(server, true));
  const std::string allowed = write_file("clients.txt", client.public_key + "\n");
  ASSERT_EQ(g_mkdir(path("empty").c_str(), 0700), 0);
  ASSERT_EQ(g_mkdir(path("broken").c_str(), 0700), 0);
  write_file("broken/alice.key", "metadata\ncurve\n");
  const std::string public_only = write_file("server.key", zcert(server, false));
  const std::string mismatched =
      write_file("mismatched.key_secret", zcert({client.public_key, server.secret_key}, true));
  const std::string short_secret =
      write_file("short.key_secret", "curve\n    secret-key = \"" + server.secret_key.substr(1) + "\"\n");
  const std::string garbage = write_file("garbage", "hello world\n");
  const std::string comments = write_file("comments.txt", "# nobody yet\n\n");
  const std::string typo =
      write_file("typo.txt", client.public_key + "\n" + client.public_key.substr(0, 39) + "~\n");  // '~' is not Z85

  const auto cannot = [](const char* property, const std::string& file, const std::string& cause) {
    return std::string(property) + " '" + file + "' cannot be used: " + cause;
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {secret, "",
       "curve-secret-key-file is set but curve-allowed-keys is not: CURVE needs both (the socket's secret key and "
       "the client keys it allows)"},
      {"", allowed,
       "curve-allowed-keys is set but curve-secret-key-file is not: CURVE needs both (the socket's secret key and "
       "the client keys it allows)"},
      {path("missing"), allowed,
       cannot("curve-secret-key-file", path("missing"), "cannot be read: No such file or directory")},
      {dir_, allowed, cannot("curve-secret-key-file", dir_, "is not a regular file")},
      {garbage, allowed,
       cannot("curve-secret-key-file", garbage,
              "it is neither a zcert secret certificate (secret-key = \"...\") nor a bare 40-character Z85 "
              "secret key")},
      {short_secret, allowed,
       cannot("curve-secret-key-file", short_secret,
              "its secret-key is not a Z85 CURVE key (40 characters of the Z85 alphabet)")},
      {public_only, allowed,
       cannot("curve-secret-key-file", public_only,
              "it holds only a public key (a zcert *.key file): give the server's *.key_secret file")},
      {mismatched, allowed,
       cannot("curve-secret-key-file", mismatched, "its public-key is not the public key of its secret-key")},
      {secret, path("missing"),
       cannot("curve-allowed-keys", path("missing"), "cannot be read: No such file or directory")},
      {secret, path("empty"),
       cannot("curve-allowed-keys", path("empty"),
              "holds no zcert public certificate (*.key file with public-key = \"...\")")},
      {secret, path("broken"),
       cannot("curve-allowed-keys", path("broken"), "'alice.key' has no public-key = \"...\" line")},
      {secret, comments, cannot("curve-allowed-keys", comments, "lists no key (one Z85 public key per line)")},
      {secret, typo,
       cannot("curve-allowed-keys", typo,
              "line 2 is not a Z85 CURVE public key (40 characters of the Z85 alphabet, then nothing or a # comment)")},
  };
  for (const auto& [secret_key_file, allowed_keys, expected] : cases) {
    const std::string error =
        start_error(ipc("curve.ipc"), TRUE, [&](GstElement* e) { set_curve(e, secret_key_file, allowed_keys); });
    EXPECT_EQ(error, expected);
    for (const std::string& key : {server.secret_key, server.public_key, client.secret_key, client.public_key})
      EXPECT_EQ(error.find(key.substr(2)), std::string::npos) << "a key in: " << error;
  }
  EXPECT_EQ(start_error(ipc("curve.ipc"), TRUE, [&](GstElement* e) { set_curve(e, secret, allowed); }), "");

  // A bind that fails once the ZAP handler runs still ends it: the start fails, nothing hangs.
  zmq::socket_t holder(ctx_, zmq::socket_type::pull);
  holder.set(zmq::sockopt::linger, 0);
  holder.bind("tcp://127.0.0.1:*");
  const std::string error =
      start_error(holder.get(zmq::sockopt::last_endpoint), TRUE, [&](GstElement* e) { set_curve(e, secret, allowed); });
  EXPECT_NE(error.find(zmq_strerror(EADDRINUSE)), std::string::npos) << error;
}

INSTANTIATE_TEST_SUITE_P(Elements, StartFailure,
                         ::testing::Values(StartCase{"zmq-publish", "PUB"}, StartCase{"zmq-query", "PULL"}),
                         [](const ::testing::TestParamInfo<StartCase>& i) {
                           return std::string(i.param.element == std::string("zmq-publish") ? "Publish" : "Query");
                         });

// ---------------------------------------------------------------------------------------------
// zmq-query

GstHarness* query_harness(GstElement* element) {
  GstHarness* h = gst_harness_new_with_element(element, nullptr, "src");
  gst_object_unref(element);
  gst_harness_play(h);  // a source is not started by the harness itself
  return h;
}

GstElement* make_query(const std::string& endpoint, gint64 num_requests = -1) {
  GstElement* e = gst_element_factory_make("zmq-query", nullptr);
  g_object_set(e, "endpoint", endpoint.c_str(), "num-requests", num_requests, nullptr);
  return e;
}

zmq::socket_t client(zmq::context_t& ctx, zmq::socket_type type, const std::string& endpoint) {
  zmq::socket_t s(ctx, type);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
  s.connect(endpoint);
  return s;
}

std::string payload_of(GstBuffer* buf) {
  GstMapInfo map;
  EXPECT_TRUE(gst_buffer_map(buf, &map, GST_MAP_READ));
  std::string s(reinterpret_cast<const char*>(map.data), map.size);
  gst_buffer_unmap(buf, &map);
  return s;
}

const gstmoe::BatchRecords& records_of(GstBuffer* buf) {
  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  static const gstmoe::BatchRecords none;
  EXPECT_TRUE(meta && meta->records) << "no GstMoeBatchMeta";
  return meta && meta->records ? *meta->records : none;
}

// What one request must come out as.
struct Expect {
  std::string id;
  gstmoe::Modality modality;
  std::string payload;      // accepted requests
  std::string uri;          // image requests, as far as known
  int k = 0;                // accepted requests
  std::string reason_part;  // rejected requests: a fragment of the reason; "" for accepted ones
  std::string code{};       // rejected requests: their error.code; "" not checked
  std::string echo{};       // rejected text requests: the query text their answer echoes
};

void expect_request(GstBuffer* buf, const Expect& x) {
  ASSERT_NE(buf, nullptr) << "no buffer for request '" << x.id << "'";
  SCOPED_TRACE("request '" + x.id + "' " + x.reason_part);
  EXPECT_TRUE(GST_BUFFER_PTS_IS_VALID(buf));
  const gstmoe::BatchRecords& r = records_of(buf);
  const gstmoe::RequestRecord* rec = nullptr;
  if (x.reason_part.empty()) {
    ASSERT_EQ(r.rows.size(), 1u);
    EXPECT_TRUE(r.failed.empty());
    rec = &r.rows[0];
    EXPECT_EQ(payload_of(buf), x.payload);
    EXPECT_EQ(rec->k, x.k);
    if (x.modality == gstmoe::Modality::Text) {
      EXPECT_EQ(rec->text, x.payload);
    }
  } else {
    ASSERT_EQ(r.failed.size(), 1u);
    EXPECT_TRUE(r.rows.empty());
    EXPECT_EQ(gst_buffer_get_size(buf), 0u);
    EXPECT_EQ(r.failed[0].stage, "zmq-query");
    EXPECT_NE(r.failed[0].reason.find(x.reason_part), std::string::npos) << r.failed[0].reason;
    if (!x.code.empty()) {
      EXPECT_EQ(r.failed[0].code, x.code);
    }
    rec = &r.failed[0].request;
    if (x.modality == gstmoe::Modality::Text) {
      EXPECT_EQ(rec->text, x.echo);
    }
  }
  EXPECT_EQ(rec->id, x.id);
  EXPECT_EQ(rec->modality, x.modality);
  EXPECT_EQ(rec->uri, x.uri);
  EXPECT_GT(rec->arrival_wall_us, 0);
  EXPECT_GT(rec->arrival_mono_us, 0);
}

// Runs until EOS; true if it came.
bool wait_eos(GstHarness* h) {
  while (GstEvent* ev = gst_harness_pull_event(h)) {
    const bool eos = GST_EVENT_TYPE(ev) == GST_EVENT_EOS;
    gst_event_unref(ev);
    if (eos) return true;
  }
  return false;
}

TEST_F(ZmqTest, QueryDefaults) {
  GstElement* e = gst_element_factory_make("zmq-query", nullptr);
  gchar *endpoint = nullptr, *root = nullptr;
  gint type = -1, hwm = 0;
  guint64 max_image = 0, max_message = 0;
  gint64 num = 0;
  gboolean live = FALSE;
  g_object_get(e, "endpoint", &endpoint, "socket-type", &type, "recv-hwm", &hwm, "max-image-bytes", &max_image,
               "max-message-bytes", &max_message, "image-root", &root, "num-requests", &num, "do-timestamp", &live,
               nullptr);
  EXPECT_STREQ(endpoint, "tcp://127.0.0.1:5555");
  EXPECT_EQ(type, GST_ZMQ_QUERY_SOCKET_PULL);
  EXPECT_EQ(hwm, 1000);
  EXPECT_EQ(max_image, 32u * 1024 * 1024);
  EXPECT_EQ(max_message, 48u * 1024 * 1024);
  EXPECT_EQ(root, nullptr);  // image paths are refused until the operator names a folder
  EXPECT_EQ(num, -1);
  EXPECT_TRUE(live);
  EXPECT_TRUE(gst_base_src_is_live(GST_BASE_SRC(e)));
  GEnumClass* cls = static_cast<GEnumClass*>(g_type_class_ref(GST_TYPE_ZMQ_QUERY_SOCKET_TYPE));
  EXPECT_EQ(g_enum_get_value_by_nick(cls, "router")->value, GST_ZMQ_QUERY_SOCKET_ROUTER);
  g_type_class_unref(cls);
  g_free(endpoint);
  g_free(root);
  gst_object_unref(e);
}

TEST_F(ZmqTest, QueryPullTurnsEachMessageIntoOneRequestBuffer) {
  std::string image;
  for (int i = 0; i < 300; ++i) image.push_back(static_cast<char>(i * 7));
  const std::string image_path = write_file("photo.png", image.substr(0, 200));
  const std::string big_path = write_file("big.png", std::string(2000, 'b'));
  const std::string missing = path("nope.jpg");
  gchar* uri = g_filename_to_uri(image_path.c_str(), nullptr, nullptr);
  const std::string image_uri = uri;
  g_free(uri);
  gchar* b64 = g_base64_encode(reinterpret_cast<const guchar*>(image.data()), image.size());
  std::string b64_wrapped = b64;  // line breaks, as base64(1) writes them
  g_free(b64);
  b64_wrapped.insert(76, "\n").insert(153, "\n");
  gchar* big_b64 = g_base64_encode(reinterpret_cast<const guchar*>(std::string(2000, 'b').data()), 2000);
  const std::string big_b64_s = big_b64;
  g_free(big_b64);

  using gstmoe::Modality;
  struct Case {
    std::vector<std::string> frames;
    Expect expect;
  };
  auto json_str = [](const std::string& s) {
    gchar* e = g_strescape(s.c_str(), nullptr);
    std::string r = std::string("\"") + e + "\"";
    g_free(e);
    return r;
  };
  const std::vector<Case> cases = {
      {{R"({"id":"t1","text":"red striped mug","k":5})"}, {"t1", Modality::Text, "red striped mug", "", 5, ""}},
      {{R"({"id":"i2","image":)" + json_str(image_path) + "}"},
       {"i2", Modality::Image, image.substr(0, 200), image_path, 0, ""}},
      {{R"({"id":3,"image":)" + json_str(image_uri) + R"(,"k":1024})"},
       {"3", Modality::Image, image.substr(0, 200), image_uri, 1024, ""}},
      {{R"({"id":"b4","image_base64":)" + json_str(b64_wrapped) + "}"},
       {"b4", Modality::Image, image, "base64:300 bytes", 0, ""}},
      {{"this is not json"}, {"", Modality::Text, "", "", 0, "not valid JSON", "invalid_request"}},
      {{"\xff\xfe{}"}, {"", Modality::Text, "", "", 0, "UTF-8"}},
      {{"[1, 2]"}, {"", Modality::Text, "", "", 0, "not a JSON object"}},
      {{R"({"text":"no id"})"}, {"", Modality::Text, "", "", 0, "id is missing", "invalid_request", "no id"}},
      {{R"({"id":1.5,"text":"x"})"}, {"1.5", Modality::Text, "", "", 0, "id must be a string or an integer", "", "x"}},
      {{R"({"id":"none"})"}, {"none", Modality::Text, "", "", 0, "it has none"}},
      {{R"({"id":"both","text":"x","image":"/p.png","image_base64":"aGVsbG8="})"},
       {"both", Modality::Hybrid, "", "/p.png", 0, "both image and image_base64", "invalid_request"}},
      {{R"({"id":"missing","image":)" + json_str(missing) + "}"},
       {"missing", Modality::Image, "", missing, 0, "image '" + missing + "' cannot be read: No such file or directory",
        "image_unavailable"}},
      {{R"({"id":"dir","image":)" + json_str(dir_) + "}"}, {"dir", Modality::Image, "", dir_, 0, "not a regular file"}},
      {{R"({"id":"web","image":"http://example.com/a.png"})"},
       {"web", Modality::Image, "", "http://example.com/a.png", 0, "neither a local path nor a file:// uri",
        "invalid_request"}},
      {{R"({"id":"bigfile","image":)" + json_str(big_path) + "}"},
       {"bigfile", Modality::Image, "", big_path, 0, "is 2000 bytes, more than max-image-bytes (1000)",
        "image_too_large"}},
      {{R"({"id":"b64bad","image_base64":"abc$def="})"},
       {"b64bad", Modality::Image, "", "", 0, "image_base64 is not valid base64: unexpected character '$'"}},
      {{R"({"id":"b64len","image_base64":"abcde"})"}, {"b64len", Modality::Image, "", "", 0, "multiple of 4"}},
      {{R"({"id":"b64big","image_base64":")" + big_b64_s + "\"}"},
       {"b64big", Modality::Image, "", "", 0, "decodes to 2000 bytes, more than max-image-bytes (1000)",
        "image_too_large"}},
      {{R"({"id":"k0","text":"red mug","k":0})"},
       {"k0", Modality::Text, "", "", 0, "k must be an integer from 1 to 1024 (got 0)", "invalid_request", "red mug"}},
      {{R"({"id":"kstr","text":"x","k":"5"})"},
       {"kstr", Modality::Text, "", "", 0, "k must be an integer from 1 to 1024", "", "x"}},
      {{R"({"id":"empty","text":""})"}, {"empty", Modality::Text, "", "", 0, "text is empty"}},
      {{R"({"id":"f1","text":"x"})", "second frame"},
       {"", Modality::Text, "", "", 0, "request has 2 frames", "invalid_request"}},
      {{R"({"id":"last","text":"still served after all that"})"},
       {"last", Modality::Text, "still served after all that", "", 0, ""}},
  };

  const std::string endpoint = ipc("query.ipc");
  GstElement* e = make_query(endpoint, static_cast<gint64>(cases.size()));
  g_object_set(e, "max-image-bytes", G_GUINT64_CONSTANT(1000), "image-root", dir_.c_str(), nullptr);
  GstHarness* h = query_harness(e);
  zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
  for (const Case& c : cases) {
    std::vector<zmq::const_buffer> parts;
    for (const std::string& f : c.frames) parts.push_back(zmq::buffer(f));
    ASSERT_TRUE(zmq::send_multipart(push, parts));
  }

  guint64 rejected = 0;
  for (const Case& c : cases) {
    GstBuffer* buf = gst_harness_pull(h);
    expect_request(buf, c.expect);
    if (buf) gst_buffer_unref(buf);
    rejected += c.expect.reason_part.empty() ? 0 : 1;
  }
  EXPECT_TRUE(wait_eos(h)) << "num-requests reached, but no EOS";
  GstCaps* caps = gst_pad_get_current_caps(h->sinkpad);
  ASSERT_NE(caps, nullptr);
  GstCaps* expected_caps = gst_caps_from_string(GST_MOE_REQUEST_CAPS);
  EXPECT_TRUE(gst_caps_is_equal(caps, expected_caps));
  gst_caps_unref(expected_caps);
  gst_caps_unref(caps);
  EXPECT_EQ(stat(h->element, "received"), cases.size());
  EXPECT_EQ(stat(h->element, "rejected"), rejected);
  gst_harness_teardown(h);
}

TEST_F(ZmqTest, QueryConnectsToABoundClient) {
  zmq::socket_t push(ctx_, zmq::socket_type::push);
  push.set(zmq::sockopt::linger, 0);
  push.bind("tcp://127.0.0.1:*");
  const std::string endpoint = push.get(zmq::sockopt::last_endpoint);
  GstElement* e = make_query(endpoint, 1);
  g_object_set(e, "bind", FALSE, nullptr);
  GstHarness* h = query_harness(e);
  ASSERT_TRUE(push.send(zmq::str_buffer(R"({"id":"c1","text":"blue shoe"})")));
  GstBuffer* buf = gst_harness_pull(h);
  expect_request(buf, {"c1", gstmoe::Modality::Text, "blue shoe", "", 0, ""});
  if (buf) gst_buffer_unref(buf);
  EXPECT_TRUE(wait_eos(h));
  gst_harness_teardown(h);
}

TEST_F(ZmqTest, QueryAnswersLatencyAsLiveWithoutDelay) {
  GstHarness* h = query_harness(make_query(ipc("latency.ipc")));
  GstQuery* q = gst_query_new_latency();
  ASSERT_TRUE(gst_pad_peer_query(h->sinkpad, q));
  gboolean live = FALSE;
  GstClockTime min = 1, max = 0;
  gst_query_parse_latency(q, &live, &min, &max);
  EXPECT_TRUE(live);
  EXPECT_EQ(min, 0u);
  EXPECT_EQ(max, GST_CLOCK_TIME_NONE);
  gst_query_unref(q);
  gst_harness_teardown(h);  // also checks that stop interrupts a create() waiting for a message
}

// The reply a ROUTER client gets, as (id or "null", status, error).
std::tuple<std::string, std::string, std::string> parse_reply(const std::string& text) {
  JsonParser* parser = json_parser_new();
  EXPECT_TRUE(json_parser_load_from_data(parser, text.data(), static_cast<gssize>(text.size()), nullptr)) << text;
  JsonObject* o = json_node_get_object(json_parser_get_root(parser));
  JsonNode* id = json_object_get_member(o, "id");
  std::tuple<std::string, std::string, std::string> r{
      JSON_NODE_HOLDS_NULL(id) ? "null" : json_node_get_string(id), json_object_get_string_member(o, "status"),
      json_object_has_member(o, "error") ? json_object_get_string_member(o, "error") : ""};
  g_object_unref(parser);
  return r;
}

TEST_F(ZmqTest, QueryRouterAcknowledgesDealerAndReqClients) {
  const std::string endpoint = ipc("router.ipc");
  GstElement* e = make_query(endpoint, 4);
  g_object_set(e, "socket-type", GST_ZMQ_QUERY_SOCKET_ROUTER, nullptr);
  GstHarness* h = query_harness(e);
  zmq::socket_t dealer = client(ctx_, zmq::socket_type::dealer, endpoint);
  zmq::socket_t req = client(ctx_, zmq::socket_type::req, endpoint);

  zmq::message_t reply;
  ASSERT_TRUE(dealer.send(zmq::str_buffer(R"({"id":"d1","text":"red mug"})")));
  ASSERT_TRUE(dealer.recv(reply));
  EXPECT_FALSE(reply.more());  // DEALER: no envelope comes back
  EXPECT_EQ(parse_reply(to_string(reply)), std::make_tuple(std::string("d1"), std::string("accepted"), std::string()));

  // No image-root (the default): image paths are refused, telling the operator what to set.
  ASSERT_TRUE(req.send(zmq::str_buffer(R"({"id":"r1","image":"/no/such/file.png"})")));
  ASSERT_TRUE(req.recv(reply));
  auto [id, status, error] = parse_reply(to_string(reply));
  EXPECT_EQ(id, "r1");
  EXPECT_EQ(status, "rejected");
  EXPECT_NE(to_string(reply).find(R"("code":"image_unavailable")"), std::string::npos) << to_string(reply);
  EXPECT_NE(error.find("no image-root (the operator sets image-root=DIR"), std::string::npos) << error;

  ASSERT_TRUE(req.send(zmq::str_buffer("not json")));  // REQ needs the reply before its next request
  ASSERT_TRUE(req.recv(reply));
  EXPECT_EQ(std::get<0>(parse_reply(to_string(reply))), "null");

  ASSERT_TRUE(req.send(zmq::str_buffer(R"({"id":7,"text":"last"})")));
  ASSERT_TRUE(req.recv(reply));
  EXPECT_EQ(parse_reply(to_string(reply)), std::make_tuple(std::string("7"), std::string("accepted"), std::string()));

  const std::vector<Expect> expected = {{"d1", gstmoe::Modality::Text, "red mug", "", 0, ""},
                                        {"r1", gstmoe::Modality::Image, "", "/no/such/file.png", 0, "no image-root"},
                                        {"", gstmoe::Modality::Text, "", "", 0, "not valid JSON"},
                                        {"7", gstmoe::Modality::Text, "last", "", 0, ""}};
  for (const Expect& x : expected) {
    GstBuffer* buf = gst_harness_pull(h);
    expect_request(buf, x);
    if (buf) gst_buffer_unref(buf);
  }
  EXPECT_TRUE(wait_eos(h));
  EXPECT_EQ(stat(h->element, "rejected"), 2u);
  gst_harness_teardown(h);
}

// ---------------------------------------------------------------------------------------------
// image-root: which files "image" requests may name.

std::string file_uri(const std::string& path) {
  gchar* uri = g_filename_to_uri(path.c_str(), nullptr, nullptr);
  std::string r = uri;
  g_free(uri);
  return r;
}

TEST_F(ZmqTest, QueryImageRootConfinesImagePaths) {
  const std::string root = path("root");
  ASSERT_EQ(g_mkdir_with_parents((root + "/sub").c_str(), 0700), 0);
  write_file("root/a.png", "image a");
  write_file("root/sub/b.png", "image b");
  const std::string secret = write_file("secret.png", "secret");
  const std::string nope = path("nope.png");                      // outside the root and missing
  ASSERT_EQ(symlink("sub/b.png", (root + "/inner").c_str()), 0);  // stays inside
  ASSERT_EQ(symlink(secret.c_str(), (root + "/escape").c_str()), 0);
  ASSERT_EQ(symlink(dir_.c_str(), (root + "/escape-dir").c_str()), 0);
  ASSERT_EQ(symlink(nope.c_str(), (root + "/dangling").c_str()), 0);
  ASSERT_EQ(mkfifo((root + "/fifo.png").c_str(), 0600), 0);  // opening it must not block
  write_file("root/empty.png", "");

  struct Case {
    std::string id, image;
    std::string payload;  // accepted
    std::string reason;   // rejected: the whole reason
  };
  auto outside = [](const std::string& image) { return "image '" + image + "' is outside image-root"; };
  std::vector<Case> cases = {
      {"relative", "a.png", "image a", ""},
      {"relative-sub", "sub/b.png", "image b", ""},
      {"absolute", root + "/sub/b.png", "image b", ""},
      {"uri", file_uri(root + "/a.png"), "image a", ""},
      {"dotdot-inside", "sub/../a.png", "image a", ""},
      {"link-inside", "inner", "image b", ""},
      {"missing-inside", "missing.png", "", "image 'missing.png' cannot be read: No such file or directory"},
      {"fifo-inside", "fifo.png", "", "image 'fifo.png' is not a regular file"},
      {"empty-inside", "empty.png", "", "image 'empty.png' is empty"},  // the client's value, not the path
  };
  // Each escape, to a file that exists and to one that does not: the same reason, so a client
  // cannot probe the machine's files.
  for (const auto& [id, image] : std::vector<std::pair<std::string, std::string>>{
           {"dotdot-existing", "../secret.png"},
           {"dotdot-missing", "../nope.png"},
           {"deep-dotdot-existing", "sub/../../secret.png"},
           {"absolute-existing", secret},
           {"absolute-missing", nope},
           {"uri-existing", file_uri(secret)},
           {"uri-missing", file_uri(nope)},
           {"symlink-existing", "escape"},
           {"symlink-missing", "dangling"},
           {"symlink-dir-existing", "escape-dir/secret.png"},
           {"symlink-dir-missing", "escape-dir/nope.png"},
       })
    cases.push_back({id, image, "", outside(image)});

  const std::string endpoint = ipc("root.ipc");
  GstElement* e = make_query(endpoint, static_cast<gint64>(cases.size()));
  g_object_set(e, "image-root", root.c_str(), nullptr);
  GstHarness* h = query_harness(e);
  zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
  for (const Case& c : cases) {
    JsonBuilder* b = json_builder_new();
    json_builder_begin_object(b);
    json_builder_set_member_name(b, "id");
    json_builder_add_string_value(b, c.id.c_str());
    json_builder_set_member_name(b, "image");
    json_builder_add_string_value(b, c.image.c_str());
    json_builder_end_object(b);
    JsonNode* node = json_builder_get_root(b);
    gchar* text = json_to_string(node, FALSE);
    ASSERT_TRUE(push.send(zmq::buffer(std::string(text))));
    g_free(text);
    json_node_unref(node);
    g_object_unref(b);
  }

  guint64 rejected = 0;
  for (const Case& c : cases) {
    GstBuffer* buf = gst_harness_pull(h);
    expect_request(buf, {c.id, gstmoe::Modality::Image, c.payload, c.image, 0, c.reason});
    if (buf && !c.reason.empty() && records_of(buf).failed.size() == 1) {
      EXPECT_EQ(records_of(buf).failed[0].reason, c.reason);  // nothing more than that
    }
    if (buf) gst_buffer_unref(buf);
    rejected += c.reason.empty() ? 0 : 1;
  }
  EXPECT_TRUE(wait_eos(h));
  EXPECT_EQ(stat(h->element, "rejected"), rejected);
  gst_harness_teardown(h);
}

TEST_F(ZmqTest, QueryWithoutImageRootRefusesImagePathsButTakesImageBase64) {
  const std::string photo = write_file("photo.png", "photo bytes");
  const std::string endpoint = ipc("noroot.ipc");
  GstElement* e = make_query(endpoint, 3);
  g_object_set(e, "image-root", "", nullptr);  // empty means none, as NULL does
  GstHarness* h = query_harness(e);
  zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
  gchar* b64 = g_base64_encode(reinterpret_cast<const guchar*>("photo bytes"), 11);
  for (const std::string& request :
       {R"({"id":"path","image":")" + photo + "\"}", R"({"id":"uri","image":")" + file_uri(photo) + "\"}",
        R"({"id":"b64","image_base64":")" + std::string(b64) + "\"}"})
    ASSERT_TRUE(push.send(zmq::buffer(request)));
  g_free(b64);

  const std::string reason =
      "image paths are not served: zmq-query has no image-root (the operator sets image-root=DIR to serve the image "
      "files under DIR); send the image itself as image_base64";
  const std::vector<Expect> expected = {
      {"path", gstmoe::Modality::Image, "", photo, 0, reason, "image_unavailable"},
      {"uri", gstmoe::Modality::Image, "", file_uri(photo), 0, reason, "image_unavailable"},
      {"b64", gstmoe::Modality::Image, "photo bytes", "base64:11 bytes", 0, ""}};
  for (const Expect& x : expected) {
    GstBuffer* buf = gst_harness_pull(h);
    expect_request(buf, x);
    if (buf) gst_buffer_unref(buf);
  }
  EXPECT_TRUE(wait_eos(h));
  gst_harness_teardown(h);
}

// ---------------------------------------------------------------------------------------------
// Hybrid requests (an image and a text) and catalog updates (docs/zmq-schema.md, "Live updates").

std::string base64(const std::string& bytes) {
  gchar* b64 = g_base64_encode(reinterpret_cast<const guchar*>(bytes.data()), bytes.size());
  std::string r = b64;
  g_free(b64);
  return r;
}

TEST_F(ZmqTest, QueryTakesHybridRequestsAndCatalogUpdates) {
  write_file("photo.png", "photo bytes");
  std::string too_many = R"({"id":"many","op":"delete","items":[)";
  for (int i = 0; i < 1025; ++i) too_many += (i ? ",\"" : "\"") + std::to_string(i) + "\"";
  too_many += "]}";
  const std::vector<std::string> messages = {
      R"({"id":"h1","text":"but red","image_base64":")" + base64("photo bytes") + "\"}",
      R"({"id":"h2","image":"photo.png","text":"in blue","k":3})",
      R"({"id":"h3","image":"../outside.png","text":"in green"})",
      R"({"id":"u1","op":"upsert","item":{"id":"sku-9","caption":"red mug","uri":"https://cdn.example/9.png",)"
      R"("fields":{"price":12.5}},"text":"a red mug"})",
      R"({"id":"u2","op":"upsert","item":{"id":"sku-10"},"image":"photo.png"})",
      R"({"id":"d1","op":"delete","items":["sku-9","sku-10"]})",
      R"({"id":"bad-op","op":"merge","text":"x"})",
      too_many,
      R"({"id":"u3","op":"upsert","item":{"id":"sku-11"},"text":"x","image":"photo.png"})",
      R"({"id":"d2","op":"delete","items":["sku-9",7]})",
  };
  const std::string endpoint = ipc("updates.ipc");
  GstElement* e = make_query(endpoint, static_cast<gint64>(messages.size()));
  g_object_set(e, "image-root", dir_.c_str(), nullptr);
  GstHarness* h = query_harness(e);
  zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
  for (const std::string& m : messages) ASSERT_TRUE(push.send(zmq::buffer(m)));
  std::vector<GstBuffer*> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    GstBuffer* buf = gst_harness_pull(h);
    ASSERT_NE(buf, nullptr);
    out.push_back(buf);
  }
  const auto row = [&](size_t i) -> const gstmoe::RequestRecord& {
    const gstmoe::BatchRecords& r = records_of(out[i]);
    EXPECT_EQ(r.rows.size(), 1u) << i;
    EXPECT_TRUE(r.failed.empty() && r.controls.empty()) << i;
    static const gstmoe::RequestRecord none;
    return r.rows.empty() ? none : r.rows[0];
  };
  const auto failure = [&](size_t i, const std::string& reason, const std::string& code) -> gstmoe::RequestRecord {
    const gstmoe::BatchRecords& r = records_of(out[i]);
    EXPECT_TRUE(r.rows.empty() && r.controls.empty()) << i;
    EXPECT_EQ(gst_buffer_get_size(out[i]), 0u) << i;
    if (r.failed.size() != 1) {
      ADD_FAILURE() << "no failed request in buffer " << i;
      return {};
    }
    EXPECT_NE(r.failed[0].reason.find(reason), std::string::npos) << r.failed[0].reason;
    EXPECT_EQ(r.failed[0].code, code) << r.failed[0].reason;
    EXPECT_EQ(r.failed[0].stage, "zmq-query");
    return r.failed[0].request;
  };

  // Hybrids: the image bytes in the buffer, the text in the record; "image" under image-root only.
  const gstmoe::RequestRecord& h1 = row(0);
  EXPECT_EQ(h1.id, "h1");
  EXPECT_EQ(h1.modality, gstmoe::Modality::Hybrid);
  EXPECT_EQ(h1.op, gstmoe::RequestOp::Search);
  EXPECT_EQ(h1.text, "but red");
  EXPECT_EQ(h1.uri, "base64:11 bytes");
  EXPECT_EQ(payload_of(out[0]), "photo bytes");
  const gstmoe::RequestRecord& h2 = row(1);
  EXPECT_EQ(h2.modality, gstmoe::Modality::Hybrid);
  EXPECT_EQ(h2.text, "in blue");
  EXPECT_EQ(h2.uri, "photo.png");
  EXPECT_EQ(h2.k, 3);
  EXPECT_EQ(payload_of(out[1]), "photo bytes");
  const gstmoe::RequestRecord h3 = failure(2, "image '../outside.png' is outside image-root", "image_unavailable");
  EXPECT_EQ(h3.id, "h3");
  EXPECT_EQ(h3.modality, gstmoe::Modality::Hybrid);
  EXPECT_EQ(h3.text, "in green");
  EXPECT_EQ(h3.uri, "../outside.png");

  // Upserts: a request buffer like a query's, whose record carries the item.
  const gstmoe::RequestRecord& u1 = row(3);
  EXPECT_EQ(u1.op, gstmoe::RequestOp::Upsert);
  EXPECT_EQ(u1.modality, gstmoe::Modality::Text);
  EXPECT_EQ(payload_of(out[3]), "a red mug");
  EXPECT_EQ(u1.item.id, "sku-9");
  EXPECT_EQ(u1.item.caption, "red mug");
  EXPECT_EQ(u1.item.uri, "https://cdn.example/9.png");
  EXPECT_EQ(u1.item.fields, R"({"price":12.5})");
  const gstmoe::RequestRecord& u2 = row(4);
  EXPECT_EQ(u2.op, gstmoe::RequestOp::Upsert);
  EXPECT_EQ(u2.modality, gstmoe::Modality::Image);
  EXPECT_EQ(u2.item.id, "sku-10");
  EXPECT_EQ(payload_of(out[4]), "photo bytes");

  // A delete: an empty buffer whose meta carries it as a control, not as a row.
  const gstmoe::BatchRecords& d1 = records_of(out[5]);
  EXPECT_EQ(gst_buffer_get_size(out[5]), 0u);
  EXPECT_TRUE(d1.rows.empty() && d1.failed.empty());
  ASSERT_EQ(d1.controls.size(), 1u);
  EXPECT_EQ(d1.controls[0].id, "d1");
  EXPECT_EQ(d1.controls[0].op, gstmoe::RequestOp::Delete);
  EXPECT_EQ(d1.controls[0].item_ids, (std::vector<std::string>{"sku-9", "sku-10"}));
  EXPECT_GT(d1.controls[0].arrival_mono_us, 0);

  // Refused updates are answered like refused queries, with their own codes.
  EXPECT_EQ(failure(6, "op 'merge' is not an operation", "unsupported_op").id, "bad-op");
  EXPECT_EQ(failure(7, "items names 1025 ids, more than 1024", "too_many_items").id, "many");
  EXPECT_EQ(failure(8, "not both", "invalid_request").id, "u3");
  EXPECT_EQ(failure(9, "items[1] must be a string (got an integer)", "invalid_request").id, "d2");
  for (GstBuffer* buf : out) gst_buffer_unref(buf);
  EXPECT_TRUE(wait_eos(h));
  EXPECT_EQ(stat(h->element, "received"), messages.size());
  EXPECT_EQ(stat(h->element, "rejected"), 5u);
  gst_harness_teardown(h);
}

// zmq-query ! moe-encode, as in the service: a hybrid request's row is the image's embedding and
// its text_embedding the text's, each equal to what the same image and text get alone; an upsert
// is encoded like a query and keeps its item; a delete passes through once, as a control.
TEST_F(ZmqTest, HybridRequestsAndUpdatesThroughMoeEncode) {
  const int w = 12, h_px = 10;
  std::vector<uint8_t> px(static_cast<size_t>(w) * h_px * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 37 + 11);
  const std::vector<uint8_t> png = moe::test::make_png(px, w, h_px, 3);
  const std::string png_b64 = base64(std::string(png.begin(), png.end()));
  const std::vector<std::string> messages = {
      R"({"id":"img","image_base64":")" + png_b64 + "\"}",
      R"({"id":"txt","text":"but red"})",
      R"({"id":"hyb","image_base64":")" + png_b64 + R"(","text":"but red"})",
      R"({"id":"ups","op":"upsert","item":{"id":"sku-9","fields":{"colour":"red"}},"text":"but red"})",
      R"({"id":"del","op":"delete","items":["sku-1"]})",
  };
  const std::string endpoint = ipc("encode.ipc");
  // No query cache: each embedding comes from the encoder, not from an earlier request's.
  GError* error = nullptr;
  GstElement* pipeline =
      gst_parse_launch(("zmq-query endpoint=\"" + endpoint + "\" num-requests=" + std::to_string(messages.size()) +
                        " ! moe-encode name=enc model=\"" + moe::test::fixture_path("clip_tiny_bpe") +
                        "\" cache-bytes=0 ! appsink name=out sync=false")
                           .c_str(),
                       &error);
  ASSERT_NE(pipeline, nullptr) << error->message;
  ASSERT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
  for (const std::string& m : messages) ASSERT_TRUE(push.send(zmq::buffer(m)));

  GstElement* sink = gst_bin_get_by_name(GST_BIN(pipeline), "out");
  std::map<std::string, std::pair<gstmoe::RequestRecord, std::vector<float>>> rows;
  std::vector<gstmoe::RequestRecord> controls;
  size_t failed = 0;
  while (GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(sink), 30 * GST_SECOND)) {
    GstBuffer* buf = gst_sample_get_buffer(sample);
    const gstmoe::BatchRecords& r = records_of(buf);
    const std::string bytes = payload_of(buf);
    const size_t width = r.rows.empty() ? 0 : bytes.size() / sizeof(float) / r.rows.size();
    for (size_t i = 0; i < r.rows.size(); ++i) {
      std::vector<float> embedding(width);
      std::memcpy(embedding.data(), bytes.data() + i * width * sizeof(float), width * sizeof(float));
      rows[r.rows[i].id] = {r.rows[i], embedding};
    }
    controls.insert(controls.end(), r.controls.begin(), r.controls.end());
    failed += r.failed.size();
    gst_sample_unref(sample);
  }
  EXPECT_TRUE(gst_app_sink_is_eos(GST_APP_SINK(sink)));
  gst_object_unref(sink);
  GstElement* enc = gst_bin_get_by_name(GST_BIN(pipeline), "enc");
  GstStructure* stats = nullptr;
  g_object_get(enc, "stats", &stats, nullptr);
  gst_object_unref(enc);
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(pipeline);

  EXPECT_EQ(failed, 0u);
  ASSERT_EQ(rows.size(), 4u);
  ASSERT_EQ(controls.size(), 1u) << "the delete passes once";
  EXPECT_EQ(controls[0].id, "del");
  EXPECT_EQ(controls[0].item_ids, std::vector<std::string>{"sku-1"});
  const auto& [hyb, hyb_row] = rows["hyb"];
  const std::vector<float>& image_row = rows["img"].second;
  const std::vector<float>& text_row = rows["txt"].second;
  ASSERT_EQ(hyb.modality, gstmoe::Modality::Hybrid);
  ASSERT_FALSE(image_row.empty());
  ASSERT_EQ(hyb_row.size(), image_row.size());
  ASSERT_EQ(hyb.text_embedding.size(), text_row.size());
  for (size_t c = 0; c < image_row.size(); ++c) {
    EXPECT_NEAR(hyb_row[c], image_row[c], 1e-5) << c;
    EXPECT_NEAR(hyb.text_embedding[c], text_row[c], 1e-5) << c;
  }
  EXPECT_GT(std::fabs(image_row[0] - text_row[0]) + std::fabs(image_row[1] - text_row[1]), 1e-4)
      << "the image and the text embed apart";
  EXPECT_TRUE(rows["img"].first.text_embedding.empty());
  const auto& [ups, ups_row] = rows["ups"];
  EXPECT_EQ(ups.op, gstmoe::RequestOp::Upsert);
  EXPECT_EQ(ups.item.id, "sku-9");
  EXPECT_EQ(ups.item.fields, R"({"colour":"red"})");
  for (size_t c = 0; c < text_row.size(); ++c) EXPECT_NEAR(ups_row[c], text_row[c], 1e-5) << c;
  ASSERT_NE(stats, nullptr);
  guint64 hybrid_rows = 0;
  EXPECT_TRUE(gst_structure_get_uint64(stats, "rows-hybrid", &hybrid_rows));
  EXPECT_EQ(hybrid_rows, 1u);
  gst_structure_free(stats);
}

// Starts `e` (to PAUSED) and stops it again; returns the message of the first error or warning
// (`type`) it posted, "" if none.
std::string start_message(GstElement* e, GstMessageType type) {
  GstBus* bus = gst_bus_new();
  gst_element_set_bus(e, bus);
  const GstStateChangeReturn ret = gst_element_set_state(e, GST_STATE_PAUSED);
  const std::string message = bus_message(bus, type);
  if (type == GST_MESSAGE_ERROR) {
    EXPECT_EQ(ret == GST_STATE_CHANGE_FAILURE, !message.empty()) << message;
  } else {
    EXPECT_NE(ret, GST_STATE_CHANGE_FAILURE);
  }
  gst_element_set_state(e, GST_STATE_NULL);
  gst_element_set_bus(e, nullptr);
  gst_object_unref(bus);
  return message;
}

TEST_F(ZmqTest, QueryImageRootMustBeAnExistingFolder) {
  const std::string file = write_file("file.png", "x");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {path("no-such-folder"), "image-root '" + path("no-such-folder") + "' cannot be used: No such file or directory"},
      {file, "image-root '" + file + "' cannot be used: not a folder"},
      {dir_, ""}};
  for (const auto& [root, error] : cases) {
    GstElement* e = make_query(ipc("root-check.ipc"));
    g_object_set(e, "image-root", root.c_str(), nullptr);
    EXPECT_EQ(start_message(e, GST_MESSAGE_ERROR), error);
    gst_object_unref(e);
  }
}

// ---------------------------------------------------------------------------------------------
// max-message-bytes: ZeroMQ's limit on what a client may send.

// A text request of exactly `size` bytes; `text` receives its text.
std::string request_of_size(const std::string& id, size_t size, std::string* text) {
  const std::string head = R"({"id":")" + id + R"(","text":")", tail = "\"}";
  *text = std::string(size - head.size() - tail.size(), 't');
  return head + *text + tail;
}

TEST_F(ZmqTest, QueryOversizedMessageIsDroppedByZeroMQ) {
  const std::string endpoint = ipc("limit.ipc");
  GstElement* e = make_query(endpoint, 1);
  g_object_set(e, "max-message-bytes", G_GUINT64_CONSTANT(1000), nullptr);
  GstHarness* h = query_harness(e);

  // A valid request one byte over the limit: only ZeroMQ's limit keeps it out. The service hangs
  // up on its sender, which the sender's socket monitor reports.
  zmq::socket_t big = client(ctx_, zmq::socket_type::push, endpoint);
  ASSERT_EQ(zmq_socket_monitor(big.handle(), "inproc://big-monitor", ZMQ_EVENT_DISCONNECTED), 0);
  zmq::socket_t monitor(ctx_, zmq::socket_type::pair);
  monitor.set(zmq::sockopt::linger, 0);
  monitor.set(zmq::sockopt::rcvtimeo, kReceiveTimeoutMs);
  monitor.connect("inproc://big-monitor");
  std::string text;
  ASSERT_TRUE(big.send(zmq::buffer(request_of_size("too-big", 1001, &text))));
  std::vector<zmq::message_t> event;  // [event id (16 bits) + value (32 bits), endpoint]
  ASSERT_TRUE(zmq::recv_multipart(monitor, std::back_inserter(event))) << "the oversized sender was not disconnected";
  uint16_t id = 0;
  ASSERT_GE(event[0].size(), sizeof id);
  memcpy(&id, event[0].data(), sizeof id);
  EXPECT_EQ(id, ZMQ_EVENT_DISCONNECTED);

  // Another client's request of exactly the limit is the first (and, with num-requests=1, only)
  // request the element sees.
  zmq::socket_t fits = client(ctx_, zmq::socket_type::push, endpoint);
  ASSERT_TRUE(fits.send(zmq::buffer(request_of_size("fits", 1000, &text))));
  GstBuffer* buf = gst_harness_pull(h);
  expect_request(buf, {"fits", gstmoe::Modality::Text, text, "", 0, ""});
  if (buf) gst_buffer_unref(buf);
  EXPECT_TRUE(wait_eos(h));
  EXPECT_EQ(stat(h->element, "received"), 1u);
  zmq_socket_monitor(big.handle(), nullptr, 0);
  gst_harness_teardown(h);
}

// An image_base64 request of max-image-bytes must fit in max-message-bytes, else ZeroMQ would
// drop it unanswered: start warns. 1000 image bytes make 1336 base64 characters, 18 line breaks
// (each \n in JSON: 2 characters) and up to 1 KiB of JSON: 2396 bytes.
TEST_F(ZmqTest, QueryWarnsWhenMaxMessageBytesCannotHoldAMaxImage) {
  const std::vector<std::pair<guint64, std::string>> cases = {
      {2395,
       "max-message-bytes (2395) is smaller than the largest image_base64 request that max-image-bytes (1000) "
       "allows (2396 bytes): ZeroMQ drops larger messages unanswered"},
      {2396, ""},
      {0, ""}};  // unlimited
  for (const auto& [max_message, warning] : cases) {
    GstElement* e = make_query(ipc("warn.ipc"));
    g_object_set(e, "max-image-bytes", G_GUINT64_CONSTANT(1000), "max-message-bytes", max_message, nullptr);
    EXPECT_EQ(start_message(e, GST_MESSAGE_WARNING), warning) << max_message;
    gst_object_unref(e);
  }
  GstElement* e = make_query(ipc("warn.ipc"));  // the defaults agree
  EXPECT_EQ(start_message(e, GST_MESSAGE_WARNING), "");
  gst_object_unref(e);
}

// ---------------------------------------------------------------------------------------------
// State cycles: each start binds the same tcp endpoint again, and works.

TEST_F(ZmqTest, QueryRebindsTheSameEndpointOnEveryStart) {
  const std::string endpoint = free_tcp_endpoint();
  GstHarness* h = query_harness(make_query(endpoint));
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    if (cycle > 0) gst_harness_play(h);
    zmq::socket_t push = client(ctx_, zmq::socket_type::push, endpoint);
    const std::string id = "cycle" + std::to_string(cycle);
    ASSERT_TRUE(push.send(zmq::buffer(R"({"id":")" + id + R"(","text":"x"})")));
    GstBuffer* buf = gst_harness_pull(h);
    expect_request(buf, {id, gstmoe::Modality::Text, "x", "", 0, ""});
    if (buf) gst_buffer_unref(buf);
    EXPECT_EQ(stat(h->element, "received"), 1u);  // reset at every start
    ASSERT_EQ(gst_element_set_state(h->element, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS);
  }
  gst_harness_teardown(h);
}

TEST_F(ZmqTest, PublishRebindsTheSameEndpointOnEveryStart) {
  const std::string endpoint = free_tcp_endpoint();
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    GstHarness* h = publish_harness(make_publish(endpoint));
    zmq::socket_t sub = subscriber(endpoint, "");
    warm_up(h, sub, "");
    ASSERT_EQ(push(h, "cycle " + std::to_string(cycle)), GST_FLOW_OK);
    EXPECT_EQ(receive_payload(sub, ""), "cycle " + std::to_string(cycle));
    gst_harness_teardown(h);
  }

  // The same element, cycled.
  GstElement* e = make_publish(endpoint);
  for (int cycle = 0; cycle < 3; ++cycle) {
    ASSERT_NE(gst_element_set_state(e, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE) << "cycle " << cycle;
    ASSERT_EQ(gst_element_set_state(e, GST_STATE_NULL), GST_STATE_CHANGE_SUCCESS) << "cycle " << cycle;
  }
  gst_object_unref(e);
}

// ---------------------------------------------------------------------------------------------
// CURVE: who may send requests and receive results.

std::string binary_key(const std::string& z85) {
  uint8_t key[32];
  EXPECT_NE(zmq_z85_decode(key, z85.c_str()), nullptr) << z85;
  return std::string(reinterpret_cast<const char*>(key), sizeof key);
}

// Key files as zmq.auth writes them, or as people write them by hand.
TEST_F(ZmqTest, CurveKeyFilesInTheFormatsZmqAuthWrites) {
  // As python3 -c 'import zmq.auth; zmq.auth.create_certificates(DIR, NAME)' (pyzmq 24) wrote them.
  const std::string server_secret =
      write_file("server.key_secret", R"zcert(#   ****  Generated on 2026-12-01 14:38:15.700422 by pyzmq  ****
#   ZeroMQ CURVE **Secret** Certificate
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

metadata
curve
    public-key = "B6{2woH<V>&5=h.lr3N(9(2ntL/=[3.iOJbeJ=Jv"
    secret-key = "gB!V{^lyoZkRTq[XtN7a8g3yw-U09Z^3@&bj?-nM"
)zcert");
  ASSERT_EQ(g_mkdir(path("clients").c_str(), 0700), 0);
  write_file("clients/client.key", R"zcert(#   ****  Generated on 2026-12-01 14:46:35.598136 by pyzmq  ****
#   ZeroMQ CURVE Public Certificate
#   Exchange securely, or use a secure mechanism to verify the contents
#   of this file after exchange. Store public certificates in your home
#   directory, in the .curve subdirectory.

metadata
curve
    public-key = "cL<me}z.a>VN$jja8mMzrl^>P)VZEYRsXN%6Z8Fv"
)zcert");
  // create_certificates writes the secret one beside it; only *.key files are read.
  write_file("clients/client.key_secret", "not read");
  write_file("clients/README", "not read");

  std::optional<gstmoe::CurveServer> curve = gstmoe::load_curve_server(server_secret, path("clients"));
  ASSERT_TRUE(curve);
  EXPECT_EQ(curve->secret_key, "gB!V{^lyoZkRTq[XtN7a8g3yw-U09Z^3@&bj?-nM");
  EXPECT_EQ(curve->allowed_client_keys, std::set<std::string>{binary_key("cL<me}z.a>VN$jja8mMzrl^>P)VZEYRsXN%6Z8Fv")});

  // A bare secret key, and a list of public keys with comments.
  const CurveKeys alice = curve_keys(), bob = curve_keys(), commented = curve_keys();
  const std::string bare = write_file("bare.secret", "# the service's key\n" + alice.secret_key + "\n");
  const std::string list = write_file("clients.txt", "# who may connect\n" + alice.public_key + "   # alice\n\n" +
                                                         bob.public_key + "\n#" + commented.public_key + "\n");
  curve = gstmoe::load_curve_server(bare, list);
  ASSERT_TRUE(curve);
  EXPECT_EQ(curve->secret_key, alice.secret_key);
  EXPECT_EQ(curve->allowed_client_keys,
            (std::set<std::string>{binary_key(alice.public_key), binary_key(bob.public_key)}));

  EXPECT_FALSE(gstmoe::load_curve_server("", ""));  // no CURVE: a plain socket
}

// Only a CURVE client whose public key is allowed gets a request in; the others never complete
// the handshake, so what they send stays with them.
TEST_F(ZmqTest, CurveQueryTakesRequestsFromAllowedClientsOnly) {
  const CurveKeys server = curve_keys(), alice = curve_keys(), mallory = curve_keys();
  const std::string secret = write_file("server.key_secret", zcert(server, true));
  ASSERT_EQ(g_mkdir(path("clients").c_str(), 0700), 0);
  write_file("clients/alice.key", zcert(alice, false));
  const std::string endpoint = ipc("curve-query.ipc");
  GstElement* e = make_query(endpoint, 1);
  set_curve(e, secret, path("clients"));
  GstHarness* h = query_harness(e);

  // The refused clients send first.
  zmq::socket_t unlisted = client_socket(ctx_, zmq::socket_type::push, server.public_key, &mallory);
  EXPECT_EQ(connect_and_handshake(ctx_, unlisted, endpoint, R"({"id":"unlisted","text":"x"})"), kKeyRefused);
  zmq::socket_t plain = client_socket(ctx_, zmq::socket_type::push);
  const Handshake plain_handshake = connect_and_handshake(ctx_, plain, endpoint, R"({"id":"plain","text":"x"})");
  EXPECT_TRUE(failed_without_curve(plain_handshake)) << plain_handshake;

  zmq::socket_t listed = client_socket(ctx_, zmq::socket_type::push, server.public_key, &alice);
  EXPECT_EQ(connect_and_handshake(ctx_, listed, endpoint), kAdmitted);
  ASSERT_TRUE(listed.send(zmq::str_buffer(R"({"id":"alice","text":"red mug"})")));
  GstBuffer* buf = gst_harness_pull(h);  // the first and, with num-requests=1, only request
  expect_request(buf, {"alice", gstmoe::Modality::Text, "red mug", "", 0, ""});
  if (buf) gst_buffer_unref(buf);
  EXPECT_TRUE(wait_eos(h));
  EXPECT_EQ(stat(h->element, "received"), 1u);
  gst_harness_teardown(h);
}

// Only a CURVE subscriber whose public key is allowed receives results, through restarts of the
// element (each start runs its own ZAP handler).
TEST_F(ZmqTest, CurvePublishServesAllowedSubscribersOnly) {
  const CurveKeys server = curve_keys(), alice = curve_keys(), mallory = curve_keys();
  const std::string secret = write_file("server.secret", server.secret_key + "\n");  // a bare key
  const std::string allowed = write_file("clients.txt", alice.public_key + "  # alice\n");
  const std::string endpoint = free_tcp_endpoint();
  GstElement* e = make_publish(endpoint);
  set_curve(e, secret, allowed);
  GstHarness* h = publish_harness(e);

  zmq::socket_t unlisted = client_socket(ctx_, zmq::socket_type::sub, server.public_key, &mallory);
  unlisted.set(zmq::sockopt::subscribe, "");
  EXPECT_EQ(connect_and_handshake(ctx_, unlisted, endpoint), kKeyRefused);
  zmq::socket_t plain = client_socket(ctx_, zmq::socket_type::sub);
  plain.set(zmq::sockopt::subscribe, "");
  const Handshake plain_handshake = connect_and_handshake(ctx_, plain, endpoint);
  EXPECT_TRUE(failed_without_curve(plain_handshake)) << plain_handshake;
  zmq::socket_t listed = client_socket(ctx_, zmq::socket_type::sub, server.public_key, &alice);
  listed.set(zmq::sockopt::subscribe, "");
  EXPECT_EQ(connect_and_handshake(ctx_, listed, endpoint), kAdmitted);

  for (int start = 0; start < 2; ++start) {
    SCOPED_TRACE("start " + std::to_string(start));
    if (start > 0) restart(h);  // the listed subscriber reconnects by itself
    warm_up(h, listed, "");
    ASSERT_EQ(push(h, "{}"), GST_FLOW_OK);
    EXPECT_EQ(receive_payload(listed, ""), "{\"seq\":1,\"stream\":\"" + stat_string(h->element, "stream") + "\"}");
  }
  zmq::message_t message;
  EXPECT_FALSE(unlisted.recv(message, zmq::recv_flags::dontwait));
  EXPECT_FALSE(plain.recv(message, zmq::recv_flags::dontwait));
  gst_harness_teardown(h);
}

}  // namespace

// The result document's cost: the batch's stage times, copy wait and expert bytes split evenly over
// its rows, compute without the copy wait, the queue time the request's own; null without a batch.
TEST(ResultDocument, CostSharesTheBatchEvenly) {
  gstmoe::RequestRecord r;
  r.id = "q1";
  r.text = "red mug";
  r.arrival_mono_us = 1000;
  r.timings_ms = {{"queue", 0.5}, {"encode", 8.0}, {"route", 0.4}, {"expert", 2.0}, {"search", 1.6}};
  r.batch_rows = 4;
  r.batch_copy_wait_ms = 1.2;
  r.batch_expert_bytes = 1002;
  gstmoe::RequestCost cost;
  ASSERT_TRUE(gstmoe::request_cost(r, &cost));
  EXPECT_DOUBLE_EQ(cost.compute_ms, 12.0 / 4 - 0.3);
  EXPECT_DOUBLE_EQ(cost.copy_ms, 0.3);
  EXPECT_DOUBLE_EQ(cost.wait_ms, 0.5);
  EXPECT_DOUBLE_EQ(cost.expert_bytes, 250.5);

  const std::string doc = gstmoe::result_document(r, 1, {}, {}, 2000);
  JsonNode* root = json_from_string(doc.c_str(), nullptr);
  ASSERT_NE(root, nullptr) << doc;
  JsonObject* c = json_object_get_object_member(json_node_get_object(root), "cost");
  ASSERT_NE(c, nullptr) << doc;
  EXPECT_DOUBLE_EQ(json_object_get_double_member(c, "compute_ms"), 2.7) << doc;
  EXPECT_DOUBLE_EQ(json_object_get_double_member(c, "copy_ms"), 0.3);
  EXPECT_DOUBLE_EQ(json_object_get_double_member(c, "wait_ms"), 0.5);
  EXPECT_EQ(json_object_get_int_member(c, "expert_bytes_loaded"), 251) << "rounded";
  EXPECT_EQ(json_object_get_int_member(c, "batch_rows"), 4);
  json_node_unref(root);

  r.batch_rows = 0;  // no moe-encode upstream: no batch to share
  EXPECT_FALSE(gstmoe::request_cost(r, &cost));
  root = json_from_string(gstmoe::result_document(r, 1, {}, {}, 2000).c_str(), nullptr);
  JsonObject* o = json_node_get_object(root);
  EXPECT_TRUE(json_object_has_member(o, "cost"));
  EXPECT_TRUE(json_object_get_null_member(o, "cost"));
  json_node_unref(root);
}
