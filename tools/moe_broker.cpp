// moe-broker: N gst-moe query services (replicas) behind the endpoints of one (docs/replicas.md).
//
//   moe-broker [--requests EP] [--results EP] [--replica-requests EP] [--replica-results EP]
//              [--request-hwm N] [--result-hwm N] [--max-message-bytes N]
//              [--curve-secret-key-file FILE --curve-allowed-keys DIR_OR_FILE]
//
// Two of ZeroMQ's own devices, each a zmq_proxy_steerable on a thread of its own:
//
//   clients ─PUSH─► PULL --requests ═► PUSH --replica-requests ─► PULL zmq-query bind=false   (×N)
//   clients ◄─SUB── XPUB --results  ◄═ XSUB --replica-results  ◄─ PUB  zmq-publish bind=false (×N)
//
// Requests are dealt round-robin to the replicas connected now; every replica's results reach
// every subscriber, whose subscriptions travel the other way to every replica. The broker binds
// all four endpoints, so replicas come and go (and scale) without its knowing them. It keeps no
// state of its own: what a killed replica held is lost, and clients re-send by id (the "Lazy
// Pirate" retry of examples/client.py); docs/replicas.md says what is lost where.
//
// With --curve-secret-key-file and --curve-allowed-keys the two client-facing sockets require
// CURVE, exactly as zmq-query and zmq-publish do with the properties of the same names
// (docs/zmq-schema.md#access-control-curve); the replica-facing sockets stay plain: keep them on
// loopback or a private network.
#include <getopt.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "gstmoezmq.h"

namespace {

constexpr const char* kProgram = "moe-broker";
// As zmq-query's recv-hwm and zmq-publish's send-hwm.
constexpr int kDefaultHwm = 1000;
constexpr int kMaxHwm = 10000000;
// As zmq-query's max-message-bytes: fits an image_base64 request of its default max-image-bytes.
constexpr int64_t kDefaultMaxMessageBytes = int64_t{48} * 1024 * 1024;

constexpr const char* kUsage =
    "Usage: moe-broker [OPTION]...\n"
    "Serves N gst-moe query services (replicas) as one: clients PUSH requests and SUBscribe to\n"
    "results on the client endpoints as they would with one pipelines/serve.sh; replicas run\n"
    "serve.sh with QUERY_BIND=false RESULT_BIND=false, connected to the replica endpoints\n"
    "(pipelines/serve-replicas.sh does both; docs/replicas.md).\n"
    "\n"
    "  --requests EP             clients' requests, PULL, bound (default tcp://127.0.0.1:5555)\n"
    "  --results EP              clients' results, XPUB, bound (default tcp://127.0.0.1:5556)\n"
    "  --replica-requests EP     replicas' zmq-query connect here, PUSH, bound\n"
    "                            (default tcp://127.0.0.1:5557)\n"
    "  --replica-results EP      replicas' zmq-publish connect here, XSUB, bound\n"
    "                            (default tcp://127.0.0.1:5558)\n"
    "  --request-hwm N           requests queued per client and per replica (0..10000000, 0: no\n"
    "                            limit; default 1000); a full replica queue takes no more, a\n"
    "                            full client queue stops reading that client\n"
    "  --result-hwm N            results queued per replica and per subscriber (default 1000); a\n"
    "                            subscriber that falls that far behind loses results (a gap in seq)\n"
    "  --max-message-bytes N     largest request frame (ZMQ_MAXMSGSIZE; 0: no limit; default\n"
    "                            50331648, as zmq-query): a client sending more is disconnected\n"
    "  --curve-secret-key-file FILE\n"
    "  --curve-allowed-keys DIR_OR_FILE\n"
    "                            CURVE on the two client endpoints, as zmq-query and zmq-publish\n"
    "                            take them (both or neither; docs/zmq-schema.md)\n"
    "  -h, --help                this text\n"
    "\n"
    "Endpoints are tcp://HOST:PORT (tcp://*:PORT: every interface) or ipc:///PATH. Runs until\n"
    "SIGINT or SIGTERM; exits 0 then, 1 when a socket fails, 2 on a bad argument.\n";

struct Options {
  std::string requests = "tcp://127.0.0.1:5555";
  std::string results = "tcp://127.0.0.1:5556";
  std::string replica_requests = "tcp://127.0.0.1:5557";
  std::string replica_results = "tcp://127.0.0.1:5558";
  int request_hwm = kDefaultHwm;
  int result_hwm = kDefaultHwm;
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  std::string curve_secret_key_file;
  std::string curve_allowed_keys;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", kProgram, message.c_str(), kProgram);
  std::exit(2);
}

// The whole of `text` as an integer in [low, high], or a usage error naming the option.
int64_t parse_integer(const char* option, const char* text, int64_t low, int64_t high) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || errno == ERANGE || value < low || value > high)
    usage_error(std::string("--") + option + " takes an integer from " + std::to_string(low) + " to " +
                std::to_string(high) + " (got '" + text + "')");
  return value;
}

Options parse_options(int argc, char** argv) {
  enum {
    kRequests = 1000,
    kResults,
    kReplicaRequests,
    kReplicaResults,
    kRequestHwm,
    kResultHwm,
    kMaxMessageBytes,
    kCurveSecretKeyFile,
    kCurveAllowedKeys
  };
  static const option long_options[] = {{"requests", required_argument, nullptr, kRequests},
                                        {"results", required_argument, nullptr, kResults},
                                        {"replica-requests", required_argument, nullptr, kReplicaRequests},
                                        {"replica-results", required_argument, nullptr, kReplicaResults},
                                        {"request-hwm", required_argument, nullptr, kRequestHwm},
                                        {"result-hwm", required_argument, nullptr, kResultHwm},
                                        {"max-message-bytes", required_argument, nullptr, kMaxMessageBytes},
                                        {"curve-secret-key-file", required_argument, nullptr, kCurveSecretKeyFile},
                                        {"curve-allowed-keys", required_argument, nullptr, kCurveAllowedKeys},
                                        {"help", no_argument, nullptr, 'h'},
                                        {nullptr, 0, nullptr, 0}};
  Options o;
  opterr = 0;  // our own messages, with the usage hint
  int c;
  while ((c = getopt_long(argc, argv, ":h", long_options, nullptr)) != -1) {
    switch (c) {
      case 'h':
        std::fputs(kUsage, stdout);
        std::exit(0);
      case kRequests:
        o.requests = optarg;
        break;
      case kResults:
        o.results = optarg;
        break;
      case kReplicaRequests:
        o.replica_requests = optarg;
        break;
      case kReplicaResults:
        o.replica_results = optarg;
        break;
      case kRequestHwm:
        o.request_hwm = static_cast<int>(parse_integer("request-hwm", optarg, 0, kMaxHwm));
        break;
      case kResultHwm:
        o.result_hwm = static_cast<int>(parse_integer("result-hwm", optarg, 0, kMaxHwm));
        break;
      case kMaxMessageBytes:
        o.max_message_bytes = parse_integer("max-message-bytes", optarg, 0, std::numeric_limits<int64_t>::max());
        break;
      case kCurveSecretKeyFile:
        o.curve_secret_key_file = optarg;
        break;
      case kCurveAllowedKeys:
        o.curve_allowed_keys = optarg;
        break;
      case ':':
        usage_error(std::string("option '") + argv[optind - 1] + "' needs a value");
      default:  // '?': optopt is the unknown short option, 0 for a long one
        usage_error(std::string("unknown option '") +
                    (optopt ? std::string("-") + static_cast<char>(optopt) : std::string(argv[optind - 1])) + "'");
    }
  }
  if (optind < argc) usage_error(std::string("unexpected argument '") + argv[optind] + "' (options only)");
  const std::string* endpoints[] = {&o.requests, &o.results, &o.replica_requests, &o.replica_results};
  for (const std::string* a : endpoints)
    for (const std::string* b : endpoints)
      if (a < b && *a == *b) usage_error("two sockets cannot bind the same endpoint '" + *a + "'");
  return o;
}

// One device: zmq_proxy_steerable between two sockets until TERMINATE arrives on its control
// socket (an inproc PAIR of the broker's own context). Runs on a thread of its own; a device that
// fails records why and wakes the main thread with SIGUSR1.
class Device {
 public:
  Device(const char* name, zmq::context_t& control_context, zmq::socket_t& frontend, zmq::socket_t& backend)
      : name_(name), command_(control_context, zmq::socket_type::pair) {
    const std::string endpoint = std::string("inproc://moe-broker-") + name;
    zmq::socket_t control(control_context, zmq::socket_type::pair);
    control.bind(endpoint);
    command_.connect(endpoint);
    thread_ = std::thread([this, &frontend, &backend, control = std::move(control)]() mutable {
      if (zmq_proxy_steerable(frontend.handle(), backend.handle(), nullptr, control.handle()) != 0) {
        error_ = zmq_strerror(zmq_errno());
        failed_.store(true, std::memory_order_release);
        kill(getpid(), SIGUSR1);
      }
    });
  }
  ~Device() { stop(); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // Ends the proxy (after the message it is forwarding) and joins its thread.
  void stop() {
    if (!thread_.joinable()) return;
    command_.send(zmq::str_buffer("TERMINATE"), zmq::send_flags::none);  // queued unread if it failed
    thread_.join();
  }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // ZeroMQ's reason for the failure; only once failed().
  const std::string& error() const { return error_; }
  const char* name() const { return name_; }

 private:
  const char* name_;
  zmq::socket_t command_;
  std::string error_;  // written by the thread before it sets failed_
  std::atomic<bool> failed_{false};
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_options(argc, argv);

  // Every thread started from here on inherits the mask, so the signals are left pending for
  // sigwait below rather than delivered to a proxy thread. The dispositions are reset first: an
  // ignored signal is discarded without becoming pending, and a shell starts its background
  // commands with SIGINT ignored.
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::optional<gstmoe::CurveServer> curve;
  try {
    curve = gstmoe::load_curve_server(o.curve_secret_key_file, o.curve_allowed_keys);
  } catch (const std::exception& e) {
    usage_error(e.what());
  }
  // A bound socket, or exit 1 with ZeroMQ's reason and the option that named the endpoint.
  const auto open = [](const char* option, zmq::socket_type type, const std::string& endpoint,
                       const std::optional<gstmoe::CurveServer>& server,
                       const std::function<void(zmq::socket_t&)>& configure) {
    try {
      return std::make_unique<gstmoe::ZmqSocket>(type, endpoint, true, server, configure);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: --%s: %s\n", kProgram, option, e.what());
      std::exit(1);
    }
  };
  const auto requests = open("requests", zmq::socket_type::pull, o.requests, curve, [&o](zmq::socket_t& s) {
    s.set(zmq::sockopt::rcvhwm, o.request_hwm);
    s.set(zmq::sockopt::maxmsgsize, o.max_message_bytes == 0 ? -1 : o.max_message_bytes);
  });
  // ZMQ_IMMEDIATE: a request is queued only for a replica whose connection is complete, never for
  // one that is still (or again) connecting. On a bound socket libzmq makes a replica's queue only
  // once its handshake is done and drops it (with what it holds) when the replica disconnects; the
  // option makes that explicit.
  const auto replica_requests =
      open("replica-requests", zmq::socket_type::push, o.replica_requests, std::nullopt, [&o](zmq::socket_t& s) {
        s.set(zmq::sockopt::sndhwm, o.request_hwm);
        s.set(zmq::sockopt::immediate, true);
      });
  const auto replica_results = open("replica-results", zmq::socket_type::xsub, o.replica_results, std::nullopt,
                                    [&o](zmq::socket_t& s) { s.set(zmq::sockopt::rcvhwm, o.result_hwm); });
  // Lossy, as zmq-publish: a subscriber whose queue is full loses documents alone (no
  // ZMQ_XPUB_NODROP, which would hold every subscriber back for the slowest).
  const auto results = open("results", zmq::socket_type::xpub, o.results, curve,
                            [&o](zmq::socket_t& s) { s.set(zmq::sockopt::sndhwm, o.result_hwm); });

  zmq::context_t control_context;
  int status = 0;
  {
    Device request_device("requests", control_context, requests->socket(), replica_requests->socket());
    Device result_device("results", control_context, results->socket(), replica_results->socket());
    std::printf("%s: requests %s -> replicas %s; results replicas %s -> %s%s\n", kProgram, o.requests.c_str(),
                o.replica_requests.c_str(), o.replica_results.c_str(), o.results.c_str(),
                curve ? " (client endpoints under CURVE)" : "");
    std::fflush(stdout);

    int signal_number = 0;
    for (;;) {
      if (sigwait(&signals, &signal_number) != 0) continue;
      if (signal_number != SIGUSR1 || request_device.failed() || result_device.failed()) break;
    }
    for (const Device* d : {&request_device, &result_device})
      if (d->failed()) {
        std::fprintf(stderr, "%s: the %s proxy failed: %s\n", kProgram, d->name(), d->error().c_str());
        status = 1;
      }
    if (status == 0) std::printf("%s: %s: stopping\n", kProgram, signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  }
  // The sockets close with ZMQ_LINGER 0 (gstmoe::ZmqSocket): what is still queued is dropped, as
  // a killed broker would drop it; clients re-send by id.
  return status;
}
