#include "gstmoezmq.h"

#include <cerrno>
#include <stdexcept>

namespace gstmoe {

static const char* socket_type_name(zmq::socket_type type) {
  switch (type) {
    case zmq::socket_type::pub: return "PUB";
    case zmq::socket_type::pull: return "PULL";
    case zmq::socket_type::router: return "ROUTER";
    default: return "ZeroMQ";
  }
}

ZmqSocket::ZmqSocket(zmq::socket_type type, const std::string& endpoint, bool bind,
                     const std::function<void(zmq::socket_t&)>& configure)
    : socket_(context_, type) {
  const std::string what = std::string("cannot ") + (bind ? "bind" : "connect") + " ZeroMQ " +
                           socket_type_name(type) + " socket to '" + endpoint + "': ";
  if (endpoint.rfind("inproc://", 0) == 0)
    throw std::runtime_error(what + "inproc:// endpoints are private to the element's own ZeroMQ context and "
                                    "cannot be reached; use tcp:// or ipc://");
  try {
    socket_.set(zmq::sockopt::linger, 0);
    configure(socket_);
    if (bind)
      socket_.bind(endpoint);
    else
      socket_.connect(endpoint);
  } catch (const zmq::error_t& e) {
    const bool malformed = e.num() == EINVAL || e.num() == EPROTONOSUPPORT;
    throw std::runtime_error(what + e.what() +
                             (malformed ? " (endpoints look like tcp://127.0.0.1:5556 or ipc:///tmp/moe.sock)" : ""));
  }
}

}  // namespace gstmoe
