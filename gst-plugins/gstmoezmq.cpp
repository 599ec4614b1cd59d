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
  // libzmq keeps only the low 16 bits of a tcp port: tcp://127.0.0.1:99999 would bind 34463.
  if (endpoint.rfind("tcp://", 0) == 0) {
    const std::string port = endpoint.substr(endpoint.rfind(':') + 1);
    if (!port.empty() && port.size() <= 18 && port.find_first_not_of("0123456789") == std::string::npos &&
        std::stoll(port) > 65535)
      throw std::runtime_error(what + "port " + port + " is out of range (0..65535)");
  }
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
