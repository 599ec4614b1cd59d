/* gst-moe: the ZeroMQ socket that zmq-publish and zmq-query share, and its CURVE access control. */
#pragma once

#include <gst/gst.h>

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <zmq.hpp>

namespace gstmoe {

// CURVE on a server socket: the socket's own secret key and the clients allowed to connect.
struct CurveServer {
  std::string secret_key;                     // Z85, 40 characters
  std::set<std::string> allowed_client_keys;  // 32-byte binary public keys, as ZAP requests carry them
};

// The CURVE settings named by the properties curve-secret-key-file and curve-allowed-keys
// (install_curve_properties); std::nullopt when both are empty: a plain socket. Throws
// std::runtime_error naming the property, the file and the cause (never a key) when only one is
// set, a file cannot be read, a key is invalid, the allow-list is empty or this libzmq has no
// CURVE.
std::optional<CurveServer> load_curve_server(const std::string& secret_key_file, const std::string& allowed_keys);

// Installs the string properties curve-secret-key-file and curve-allowed-keys (mutable in READY)
// under the given ids, so that both elements describe them alike.
void install_curve_properties(GObjectClass* klass, guint secret_key_file_id, guint allowed_keys_id);

// A ZeroMQ socket in a context of its own, bound or connected to one endpoint.
//
// Why a private context: zmq_close() is asynchronous, so a listener may still hold its address
// for a moment after the socket is closed; only zmq_ctx_term() waits until every socket of the
// context has really let go. Terminating the context when the element stops therefore lets the
// next start rebind the same address at once (NULL->PLAYING->NULL cycles), and leaves nothing
// behind in the process. The cost is one ZeroMQ I/O thread per running element. Since inproc://
// endpoints only reach sockets of the same context, they are refused.
//
// With CURVE the socket is a CURVE server, and a ZAP handler (ZeroMQ's authentication protocol,
// RFC 27) on a thread of its own answers the context's inproc://zeromq.zap.01: it admits only
// CURVE clients whose public key is allowed, so other clients fail the handshake and can neither
// send nor receive a message. It is bound before the socket binds or connects and lives until the
// context ends, because libzmq admits every CURVE client when no handler is bound.
class ZmqSocket {
 public:
  // Opens a socket of `type` with ZMQ_LINGER 0 (closing discards what is still queued, so it
  // never waits on a peer), makes it a CURVE server when `curve` is set, lets `configure` set the
  // options that must precede bind/connect (high-water marks), then binds or connects. Throws
  // std::runtime_error with a message that names the socket type, the endpoint and ZeroMQ's
  // reason.
  ZmqSocket(zmq::socket_type type, const std::string& endpoint, bool bind, const std::optional<CurveServer>& curve,
            const std::function<void(zmq::socket_t&)>& configure);
  // Closes the socket, then terminates the context, which also ends the ZAP handler: returns once
  // the endpoint is released, after at most the socket's linger time.
  ~ZmqSocket() = default;
  ZmqSocket(const ZmqSocket&) = delete;
  ZmqSocket& operator=(const ZmqSocket&) = delete;

  zmq::socket_t& socket() { return socket_; }
  // How long closing may wait for queued messages to leave (ms; 0: discard them). False if
  // ZeroMQ refused it.
  bool set_linger(int ms) noexcept { return zmq_setsockopt(socket_.handle(), ZMQ_LINGER, &ms, sizeof ms) == 0; }

 private:
  // The ZAP handler's thread. Destroyed after the socket and before the context: terminating the
  // context makes the handler's blocking receive fail with ETERM, so that the thread ends and can
  // be joined.
  struct ZapThread {
    zmq::context_t* context = nullptr;
    std::thread thread;
    ~ZapThread();
  };

  zmq::context_t context_;  // declared first: destroyed last
  ZapThread zap_;           // CURVE only
  zmq::socket_t socket_;
};

}  // namespace gstmoe
