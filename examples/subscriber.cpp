// A ZeroMQ subscriber of the result stream: prints one line per result or error document.
//
//   moe-subscriber [ENDPOINT] [TOPIC]      (default tcp://127.0.0.1:5556, all topics)
//
// With a topic, zmq-publish sends two frames [topic, document]; without, one frame.
#include <json-glib/json-glib.h>

#include <cstdio>
#include <string>
#include <zmq.hpp>

int main(int argc, char** argv) {
  const std::string endpoint = argc > 1 ? argv[1] : "tcp://127.0.0.1:5556";
  const std::string topic = argc > 2 ? argv[2] : "";
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, topic);
  sub.connect(endpoint);
  std::fprintf(stderr, "subscribed to %s\n", endpoint.c_str());
  for (;;) {
    zmq::message_t msg;
    if (!sub.recv(msg)) continue;
    if (sub.get(zmq::sockopt::rcvmore)) {  // the first of two frames is the topic
      if (!sub.recv(msg)) continue;
    }
    JsonParser* parser = json_parser_new();
    GError* err = nullptr;
    if (!json_parser_load_from_data(parser, static_cast<const char*>(msg.data()), static_cast<gssize>(msg.size()), &err)) {
      std::printf("not JSON: %s\n", err->message);
      g_error_free(err);
    } else {
      JsonObject* doc = json_node_get_object(json_parser_get_root(parser));
      const char* type = json_object_get_string_member_with_default(doc, "type", "?");
      const char* id = json_object_get_string_member_with_default(doc, "id", "(none)");
      if (g_strcmp0(type, "result") == 0) {
        JsonArray* results = json_object_get_array_member(doc, "results");
        std::printf("%s:", id);
        for (guint i = 0; i < json_array_get_length(results); ++i) {
          JsonObject* r = json_array_get_object_element(results, i);
          std::printf("  %s (%.3f)", json_object_get_string_member_with_default(r, "caption", ""),
                      json_object_get_double_member(r, "score"));
        }
        std::printf("\n");
      } else if (g_strcmp0(type, "error") == 0) {
        JsonObject* e = json_object_get_object_member(doc, "error");
        std::printf("%s: error in %s: %s\n", id, json_object_get_string_member(e, "stage"),
                    json_object_get_string_member(e, "reason"));
      } else {
        std::printf("%.*s\n", static_cast<int>(msg.size()), static_cast<const char*>(msg.data()));
      }
    }
    std::fflush(stdout);
    g_object_unref(parser);
  }
}
