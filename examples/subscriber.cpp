// A ZeroMQ subscriber of the result stream: prints one line per result or error document.
//
//   moe-subscriber [ENDPOINT] [TOPIC] [--server-key server.key --client-key client.key_secret]
//                                          (default tcp://127.0.0.1:5556, all topics)
//
// With a topic, zmq-publish sends two frames [topic, document]; without, one frame. With
// --server-key and --client-key it connects with CURVE (the service's public certificate and this
// client's secret certificate, as zmq.auth.create_certificates writes them). Documents lost on the
// way (the subscriber fell more than send-hwm messages behind) are reported on stderr, from the
// gaps in their "seq".
#include <json-glib/json-glib.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>
#include <zmq.hpp>

// The value of the line `name = "value"` of a zcert certificate file; "" if there is none.
static std::string zcert_value(const std::string& path, const std::string& name) {
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line.compare(start, name.size(), name) != 0) continue;
    const size_t open = line.find('"', start + name.size()), close = line.rfind('"');
    if (open != std::string::npos && close > open) return line.substr(open + 1, close - open - 1);
  }
  return "";
}

// Follows "seq" per "stream" and says on stderr what was missed. The first stream is joined
// wherever it is; a later one (the service restarted) should start at seq 1.
class GapCheck {
 public:
  void check(JsonObject* doc) {
    if (!json_object_has_member(doc, "stream") || !json_object_has_member(doc, "seq")) return;
    const std::string stream = json_object_get_string_member(doc, "stream");
    const gint64 seq = json_object_get_int_member(doc, "seq");
    const auto last = last_.find(stream);
    if (last == last_.end() && !last_.empty() && seq > 1)
      std::fprintf(stderr, "missed %lld results (seq 1..%lld of the new stream %s)\n", static_cast<long long>(seq - 1),
                   static_cast<long long>(seq - 1), stream.c_str());
    else if (last != last_.end() && seq > last->second + 1)
      std::fprintf(stderr, "missed %lld results (seq %lld..%lld of stream %s)\n",
                   static_cast<long long>(seq - last->second - 1), static_cast<long long>(last->second + 1),
                   static_cast<long long>(seq - 1), stream.c_str());
    if (last == last_.end() || seq > last->second) last_[stream] = seq;
  }

 private:
  std::map<std::string, gint64> last_;
};

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  std::string server_key, client_key;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--server-key" || arg == "--client-key") && i + 1 < argc)
      (arg == "--server-key" ? server_key : client_key) = argv[++i];
    else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "unknown option %s (or it needs a value)\n", arg.c_str());
      return 2;
    } else
      positional.push_back(arg);
  }
  const std::string endpoint = positional.size() > 0 ? positional[0] : "tcp://127.0.0.1:5556";
  const std::string topic = positional.size() > 1 ? positional[1] : "";
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  if (!server_key.empty() || !client_key.empty()) {
    const std::string server_public = zcert_value(server_key, "public-key");
    const std::string client_public = zcert_value(client_key, "public-key");
    const std::string client_secret = zcert_value(client_key, "secret-key");
    if (server_public.size() != 40 || client_public.size() != 40 || client_secret.size() != 40) {
      std::fprintf(stderr,
                   "CURVE needs --server-key with the service's public-key (its .key file) and --client-key "
                   "with this client's public-key and secret-key (its .key_secret file)\n");
      return 2;
    }
    sub.set(zmq::sockopt::curve_serverkey, server_public);
    sub.set(zmq::sockopt::curve_publickey, client_public);
    sub.set(zmq::sockopt::curve_secretkey, client_secret);
  }
  sub.set(zmq::sockopt::subscribe, topic);
  sub.connect(endpoint);
  std::fprintf(stderr, "subscribed to %s\n", endpoint.c_str());
  GapCheck gaps;
  for (;;) {
    zmq::message_t msg;
    if (!sub.recv(msg)) continue;
    if (sub.get(zmq::sockopt::rcvmore)) {  // the first of two frames is the topic
      if (!sub.recv(msg)) continue;
    }
    JsonParser* parser = json_parser_new();
    GError* err = nullptr;
    if (!json_parser_load_from_data(parser, static_cast<const char*>(msg.data()), static_cast<gssize>(msg.size()),
                                    &err)) {
      std::printf("not JSON: %s\n", err->message);
      g_error_free(err);
    } else if (!JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser))) {
      std::printf("%.*s\n", static_cast<int>(msg.size()), static_cast<const char*>(msg.data()));
    } else {
      JsonObject* doc = json_node_get_object(json_parser_get_root(parser));
      gaps.check(doc);
      const char* type = json_object_get_string_member_with_default(doc, "type", "?");
      const char* id = json_object_get_string_member_with_default(doc, "id", "(none)");
      if (g_strcmp0(type, "result") == 0) {
        JsonArray* results = json_object_get_array_member(doc, "results");
        std::printf("%s:", id);
        for (guint i = 0; i < json_array_get_length(results); ++i) {
          JsonObject* r = json_array_get_object_element(results, i);
          // The catalog's id where the document has one (schema 1), else the caption.
          const char* name = json_object_get_string_member_with_default(r, "id", nullptr);
          std::printf("  %s (%.3f)", name ? name : json_object_get_string_member_with_default(r, "caption", ""),
                      json_object_get_double_member(r, "score"));
        }
        std::printf("\n");
      } else if (g_strcmp0(type, "error") == 0) {
        JsonObject* e = json_object_get_object_member(doc, "error");
        std::printf("%s: error in %s: %s [%s]\n", id, json_object_get_string_member(e, "stage"),
                    json_object_get_string_member(e, "reason"),
                    json_object_get_string_member_with_default(e, "code", "?"));
      } else {
        std::printf("%.*s\n", static_cast<int>(msg.size()), static_cast<const char*>(msg.data()));
      }
    }
    std::fflush(stdout);
    g_object_unref(parser);
  }
}
