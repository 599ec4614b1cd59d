#include "gstmoezmq.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>
#include <zmq_addon.hpp>

#include "gstmoemeta.h"

GST_DEBUG_CATEGORY_STATIC(moe_zmq_debug);
#define GST_CAT_DEFAULT moe_zmq_debug

namespace gstmoe {

namespace {

constexpr const char* kSecretKeyFileProperty = "curve-secret-key-file";
constexpr const char* kAllowedKeysProperty = "curve-allowed-keys";
// Where libzmq sends the authentication requests of every socket of a context (RFC 27).
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
// Z85 text of a 32-byte CURVE key.
constexpr size_t kZ85KeyLength = 40;
constexpr size_t kBinaryKeyLength = 32;
// Key files are small; a larger file (or a device) is a mistake, not something to read whole.
constexpr off_t kMaxKeyFileBytes = 16 * 1024 * 1024;

void init_debug_category() {
  static const bool initialized = [] {
    GST_DEBUG_CATEGORY_INIT(moe_zmq_debug, "moe-zmq", 0,
                            "ZeroMQ access control (CURVE, ZAP) of zmq-query and zmq-publish");
    return true;
  }();
  (void)initialized;
}

// Why a CURVE setting cannot be used; the caller adds the property and the path.
struct KeyError {
  std::string cause;
};

std::string trim(const std::string& s) {
  const size_t first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find('\n', start), text.size());
    lines.push_back(trim(text.substr(start, end - start)));
    start = end + 1;
  }
  return lines;
}

// The 32 bytes of a Z85 key; nullopt unless `z85` is 40 characters of the Z85 alphabet.
std::optional<std::string> decode_z85_key(const std::string& z85) {
  if (z85.size() != kZ85KeyLength) return std::nullopt;
  uint8_t key[kBinaryKeyLength];
  if (!zmq_z85_decode(key, z85.c_str())) return std::nullopt;
  return std::string(reinterpret_cast<const char*>(key), sizeof key);
}

// The whole of a regular key file.
std::string read_key_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) throw KeyError{std::string("cannot be read: ") + strerror(errno)};
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) throw KeyError{std::string("cannot be read: ") + strerror(errno)};
  if (!S_ISREG(st.st_mode)) throw KeyError{"is not a regular file"};
  if (st.st_size > kMaxKeyFileBytes) throw KeyError{"is larger than 16 MiB: not a key file"};
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = read(fd, &text[got], text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw KeyError{std::string("cannot be read: ") + strerror(errno)};
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

// The value of a zcert line `name = "value"` (as zmq.auth and czmq write certificates; quotes
// optional), outside '#' comment lines; nullopt if there is none.
std::optional<std::string> zcert_value(const std::string& text, const std::string& name) {
  for (const std::string& line : lines_of(text)) {
    if (line.empty() || line[0] == '#' || line.compare(0, name.size(), name) != 0) continue;
    const std::string rest = trim(line.substr(name.size()));
    if (rest.empty() || rest[0] != '=') continue;
    std::string value = trim(rest.substr(1));
    if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front())
      value = value.substr(1, value.size() - 2);
    return value;
  }
  return std::nullopt;
}

// Whether `line` (trimmed) holds a key: its first word is a Z85 key, and what follows, if
// anything, is a '#' comment. (Z85 has '#' too, but never as a key's first character: that would
// stand for a first 4-byte group of more than 2^32.)
bool key_line(const std::string& line, std::string* key) {
  const size_t end = std::min(line.find_first_of(" \t"), line.size());
  const std::string word = line.substr(0, end);
  const std::string rest = trim(line.substr(end));
  if (!decode_z85_key(word) || !(rest.empty() || rest[0] == '#')) return false;
  *key = word;
  return true;
}

std::string load_secret_key(const std::string& path) {
  const std::string text = read_key_file(path);
  const std::optional<std::string> secret = zcert_value(text, "secret-key");
  const std::optional<std::string> recorded_public = zcert_value(text, "public-key");
  std::string secret_z85;
  if (secret) {
    if (!decode_z85_key(*secret))
      throw KeyError{"its secret-key is not a Z85 CURVE key (40 characters of the Z85 alphabet)"};
    secret_z85 = *secret;
  } else if (recorded_public) {
    throw KeyError{"it holds only a public key (a zcert *.key file): give the server's *.key_secret file"};
  } else {
    // A bare key: the only line that is not a comment.
    std::vector<std::string> keys;
    for (const std::string& line : lines_of(text)) {
      std::string key;
      if (key_line(line, &key))
        keys.push_back(key);
      else if (!line.empty() && line[0] != '#')
        throw KeyError{
            "it is neither a zcert secret certificate (secret-key = \"...\") nor a bare 40-character Z85 "
            "secret key"};
    }
    if (keys.size() != 1)
      throw KeyError{keys.empty() ? "it holds no key: expected a zcert secret certificate (secret-key = \"...\") or a "
                                    "bare 40-character Z85 secret key"
                                  : "it holds more than one key"};
    secret_z85 = keys[0];
  }
  if (recorded_public) {
    char derived[kZ85KeyLength + 1];
    if (zmq_curve_public(derived, secret_z85.c_str()) != 0)
      throw KeyError{std::string("cannot derive its public key: ") + zmq_strerror(zmq_errno())};
    if (*recorded_public != derived) throw KeyError{"its public-key is not the public key of its secret-key"};
  }
  return secret_z85;
}

// A client's public key (32 bytes) from a zcert *.key file.
std::string load_public_certificate(const std::string& path) {
  const std::optional<std::string> key = zcert_value(read_key_file(path), "public-key");
  if (!key) throw KeyError{"has no public-key = \"...\" line"};
  std::optional<std::string> binary = decode_z85_key(*key);
  if (!binary) throw KeyError{"its public-key is not a Z85 CURVE key (40 characters of the Z85 alphabet)"};
  return *binary;
}

std::set<std::string> load_allowed_keys(const std::string& path) {
  std::set<std::string> keys;
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    std::vector<std::filesystem::path> certificates;
    std::filesystem::directory_iterator entry(path, error);
    for (; !error && entry != std::filesystem::directory_iterator(); entry.increment(error))
      if (entry->path().extension() == ".key") certificates.push_back(entry->path());
    if (error) throw KeyError{"cannot be listed: " + error.message()};
    std::sort(certificates.begin(), certificates.end());
    for (const std::filesystem::path& certificate : certificates) {
      try {
        keys.insert(load_public_certificate(certificate.string()));
      } catch (const KeyError& e) {
        throw KeyError{"'" + certificate.filename().string() + "' " + e.cause};
      }
    }
    if (keys.empty()) throw KeyError{"holds no zcert public certificate (*.key file with public-key = \"...\")"};
    return keys;
  }
  int number = 0;
  for (const std::string& line : lines_of(read_key_file(path))) {
    ++number;
    std::string key;
    if (key_line(line, &key))
      keys.insert(*decode_z85_key(key));
    else if (!line.empty() && line[0] != '#')
      throw KeyError{"line " + std::to_string(number) +
                     " is not a Z85 CURVE public key (40 characters of the Z85 alphabet, then nothing or a # comment)"};
  }
  if (keys.empty()) throw KeyError{"lists no key (one Z85 public key per line)"};
  return keys;
}

// Answers ZAP requests until the context terminates: status 200 for a CURVE client whose key is
// allowed, 400 for any other. Requests (RFC 27): version, request id, domain, address, routing
// id, mechanism, then the credentials (for CURVE: the client's 32-byte public key).
void serve_zap(zmq::socket_t handler, const std::set<std::string>& allowed, const std::string& endpoint) {
  for (;;) {
    std::vector<zmq::message_t> request;
    try {
      if (!zmq::recv_multipart(handler, std::back_inserter(request))) continue;
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      return;  // ETERM: the socket is closed and its context ends
    }
    const bool well_formed = request.size() >= 6 && request[0].to_string_view() == "1.0";
    const std::string mechanism = well_formed ? request[5].to_string() : "?";
    const bool admitted =
        well_formed && mechanism == "CURVE" && request.size() == 7 && allowed.count(request[6].to_string()) > 0;
    if (!admitted)
      GST_INFO("%s: refused a client from %s: %s", endpoint.c_str(), well_formed ? request[3].to_string().c_str() : "?",
               mechanism == "CURVE" ? "its public key is not in curve-allowed-keys" : "it does not use CURVE");
    const std::string request_id = request.size() >= 2 ? request[1].to_string() : "";
    const std::vector<zmq::const_buffer> reply = {
        zmq::str_buffer("1.0"),
        zmq::buffer(request_id),
        admitted ? zmq::str_buffer("200") : zmq::str_buffer("400"),
        admitted ? zmq::str_buffer("OK") : zmq::str_buffer("client not allowed"),
        zmq::str_buffer(""),
        zmq::str_buffer("")};
    for (;;) {
      try {
        zmq::send_multipart(handler, reply);
        break;
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) return;
      }
    }
  }
}

const char* socket_type_name(zmq::socket_type type) {
  switch (type) {
    case zmq::socket_type::pub:
      return "PUB";
    case zmq::socket_type::pull:
      return "PULL";
    case zmq::socket_type::router:
      return "ROUTER";
    case zmq::socket_type::push:
      return "PUSH";
    case zmq::socket_type::xpub:
      return "XPUB";
    case zmq::socket_type::xsub:
      return "XSUB";
    default:
      return "ZeroMQ";
  }
}

}  // namespace

std::optional<CurveServer> load_curve_server(const std::string& secret_key_file, const std::string& allowed_keys) {
  if (secret_key_file.empty() && allowed_keys.empty()) return std::nullopt;
  if (secret_key_file.empty() || allowed_keys.empty()) {
    const char* set = secret_key_file.empty() ? kAllowedKeysProperty : kSecretKeyFileProperty;
    const char* unset = secret_key_file.empty() ? kSecretKeyFileProperty : kAllowedKeysProperty;
    throw std::runtime_error(std::string(set) + " is set but " + unset +
                             " is not: CURVE needs both (the socket's secret key and the client keys it allows)");
  }
  if (!zmq_has("curve")) {
    int major = 0, minor = 0, patch = 0;
    zmq_version(&major, &minor, &patch);
    throw std::runtime_error(std::string(kSecretKeyFileProperty) + " is set, but this libzmq (" +
                             std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch) +
                             ") was built without CURVE (zmq_has(\"curve\") is false): install one built with "
                             "libsodium, as Debian's libzmq5 is");
  }
  CurveServer curve;
  const auto load = [](const char* property, const std::string& path, const auto& loader, auto& into) {
    try {
      into = loader(path);
    } catch (const KeyError& e) {
      throw std::runtime_error(std::string(property) + " '" + path + "' cannot be used: " + e.cause);
    }
  };
  load(kSecretKeyFileProperty, secret_key_file, load_secret_key, curve.secret_key);
  load(kAllowedKeysProperty, allowed_keys, load_allowed_keys, curve.allowed_client_keys);
  return curve;
}

void install_curve_properties(GObjectClass* klass, guint secret_key_file_id, guint allowed_keys_id) {
  const GParamFlags rw_ready = kPropertyMutableReady;
  g_object_class_install_property(
      klass, secret_key_file_id,
      g_param_spec_string(kSecretKeyFileProperty, "CURVE secret key file",
                          "With curve-allowed-keys: make the socket a CURVE server (encrypted, and only clients "
                          "whose public key is allowed may connect; others, CURVE or not, fail the handshake). "
                          "This file holds the socket's key pair: a zcert secret certificate (the NAME.key_secret "
                          "file of python3 -c 'import zmq.auth; zmq.auth.create_certificates(DIR, \"NAME\")', "
                          "with secret-key = \"...\") or just the 40-character Z85 secret key. Clients need the "
                          "public key (NAME.key). NULL (the default, with curve-allowed-keys NULL): plain ZeroMQ, "
                          "anyone who reaches the endpoint is served",
                          nullptr, rw_ready));
  g_object_class_install_property(
      klass, allowed_keys_id,
      g_param_spec_string(kAllowedKeysProperty, "CURVE allowed client keys",
                          "With curve-secret-key-file: the client public keys allowed to connect. A folder of zcert "
                          "public certificates (the *.key files zmq.auth.create_certificates writes; other files "
                          "are ignored), or a file with one Z85 public key per line (then nothing or a # comment; "
                          "other lines starting with # are comments). Read at start",
                          nullptr, rw_ready));
}

ZmqSocket::ZapThread::~ZapThread() {
  if (!thread.joinable()) return;
  context->close();  // the handler's receive fails with ETERM: it closes its socket and returns
  thread.join();
}

ZmqSocket::ZmqSocket(zmq::socket_type type, const std::string& endpoint, bool bind,
                     const std::optional<CurveServer>& curve, const std::function<void(zmq::socket_t&)>& configure)
    : socket_(context_, type) {
  const std::string what = std::string("cannot ") + (bind ? "bind" : "connect") + " ZeroMQ " + socket_type_name(type) +
                           " socket to '" + endpoint + "': ";
  if (endpoint.rfind("inproc://", 0) == 0)
    throw std::runtime_error(what +
                             "inproc:// endpoints are private to the element's own ZeroMQ context and "
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
    if (curve) {
      init_debug_category();
      zmq::socket_t handler(context_, zmq::socket_type::rep);
      handler.set(zmq::sockopt::linger, 0);
      handler.bind(kZapEndpoint);
      zap_.context = &context_;
      zap_.thread = std::thread(serve_zap, std::move(handler), curve->allowed_client_keys, endpoint);
      socket_.set(zmq::sockopt::curve_server, true);
      socket_.set(zmq::sockopt::curve_secretkey, curve->secret_key);
    }
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
