/* gst-moe: the ZeroMQ socket that zmq-publish and zmq-query share. */
#pragma once

#include <functional>
#include <string>
#include <zmq.hpp>

namespace gstmoe {

// A ZeroMQ socket in a context of its own, bound or connected to one endpoint.
//
// Why a private context: zmq_close() is asynchronous, so a listener may still hold its address
// for a moment after the socket is closed; only zmq_ctx_term() waits until every socket of the
// context has really let go. Terminating the context when the element stops therefore lets the
// next start rebind the same address at once (NULL->PLAYING->NULL cycles), and leaves nothing
// behind in the process. The cost is one ZeroMQ I/O thread per running element. Since inproc://
// endpoints only reach sockets of the same context, they are refused.
class ZmqSocket {
 public:
  // Opens a socket of `type` with ZMQ_LINGER 0 (closing discards what is still queued, so it
  // never waits on a peer), lets `configure` set the options that must precede bind/connect
  // (high-water marks), then binds or connects. Throws std::runtime_error with a message that
  // names the socket type, the endpoint and ZeroMQ's reason.
  ZmqSocket(zmq::socket_type type, const std::string& endpoint, bool bind,
            const std::function<void(zmq::socket_t&)>& configure);
  // Closes the socket, then terminates the context: returns once the endpoint is released,
  // after at most the socket's linger time.
  ~ZmqSocket() = default;
  ZmqSocket(const ZmqSocket&) = delete;
  ZmqSocket& operator=(const ZmqSocket&) = delete;

  zmq::socket_t& socket() { return socket_; }
  // How long closing may wait for queued messages to leave (ms; 0: discard them). False if
  // ZeroMQ refused it.
  bool set_linger(int ms) noexcept { return zmq_setsockopt(socket_.handle(), ZMQ_LINGER, &ms, sizeof ms) == 0; }

 private:
  zmq::context_t context_;  // declared first: destroyed after the socket
  zmq::socket_t socket_;
};

}  // namespace gstmoe
