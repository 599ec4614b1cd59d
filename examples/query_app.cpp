// An application that embeds the query pipeline: it builds the pipeline in code, feeds text
// queries through appsrc and reads the JSON result documents from appsink.
//
//   moe-query-app --model DIR --adapter DIR --index FILE [--k N] QUERY...
//
// The request id of each query is its buffer offset (0, 1, ...), which moe-encode picks up.
#include <gst/app/gstappsink.h>
#include <gst/app/gstappsrc.h>
#include <gst/gst.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Prints the pipeline's first error message, if any; returns whether there was one.
bool report_error(GstElement* pipeline) {
  GstMessage* msg = gst_bus_pop_filtered(GST_ELEMENT_BUS(pipeline), GST_MESSAGE_ERROR);
  if (!msg) return false;
  GError* err = nullptr;
  gst_message_parse_error(msg, &err, nullptr);
  std::fprintf(stderr, "error: %s\n", err->message);
  g_error_free(err);
  gst_message_unref(msg);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  gst_init(&argc, &argv);
  std::string model, adapter, index;
  int k = 5;
  std::vector<std::string> queries;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--model" || a == "--adapter" || a == "--index" || a == "--k") && i + 1 < argc) {
      const char* v = argv[++i];
      if (a == "--model")
        model = v;
      else if (a == "--adapter")
        adapter = v;
      else if (a == "--index")
        index = v;
      else
        k = std::atoi(v);
    } else {
      queries.push_back(a);
    }
  }
  if (model.empty() || adapter.empty() || index.empty() || queries.empty()) {
    std::fprintf(stderr, "usage: %s --model DIR --adapter DIR --index FILE [--k N] QUERY...\n", argv[0]);
    return 2;
  }

  // Elements are created one by one (not from a launch string) so that paths with spaces or
  // quotes need no escaping.
  GstElement* pipeline = gst_pipeline_new("query-app");
  GstElement* src = gst_element_factory_make("appsrc", "queries");
  GstElement* encode = gst_element_factory_make("moe-encode", nullptr);
  GstElement* route = gst_element_factory_make("moe-route", nullptr);
  GstElement* expert = gst_element_factory_make("moe-expert", nullptr);
  GstElement* ann = gst_element_factory_make("ann-query", nullptr);
  GstElement* sink = gst_element_factory_make("appsink", "results");
  if (!src || !encode || !route || !expert || !ann || !sink) {
    std::fprintf(stderr, "missing elements: is the moe plugin on GST_PLUGIN_PATH?\n");
    return 1;
  }
  g_object_set(encode, "model", model.c_str(), "max-batch", 8u, nullptr);
  g_object_set(route, "model", adapter.c_str(), nullptr);
  g_object_set(expert, "model", adapter.c_str(), nullptr);
  g_object_set(ann, "index", index.c_str(), "k", static_cast<guint>(k), nullptr);
  GstCaps* caps = gst_caps_from_string("text/x-raw, format=(string)utf8");
  g_object_set(src, "caps", caps, "format", GST_FORMAT_TIME, nullptr);
  gst_caps_unref(caps);
  g_object_set(sink, "sync", FALSE, nullptr);
  gst_bin_add_many(GST_BIN(pipeline), src, encode, route, expert, ann, sink, nullptr);
  if (!gst_element_link_many(src, encode, route, expert, ann, sink, nullptr)) {
    std::fprintf(stderr, "could not link the pipeline\n");
    return 1;
  }
  if (gst_element_set_state(pipeline, GST_STATE_PLAYING) == GST_STATE_CHANGE_FAILURE) {
    report_error(pipeline);
    return 1;
  }

  for (size_t i = 0; i < queries.size(); ++i) {
    GstBuffer* buf = gst_buffer_new_memdup(queries[i].data(), queries[i].size());
    GST_BUFFER_OFFSET(buf) = i;
    gst_app_src_push_buffer(GST_APP_SRC(src), buf);  // takes ownership
  }
  gst_app_src_end_of_stream(GST_APP_SRC(src));

  for (;;) {
    GstSample* sample = gst_app_sink_pull_sample(GST_APP_SINK(sink));
    if (!sample) break;  // EOS
    GstBuffer* buf = gst_sample_get_buffer(sample);
    GstMapInfo map;
    if (gst_buffer_map(buf, &map, GST_MAP_READ)) {
      std::printf("%.*s\n", static_cast<int>(map.size), reinterpret_cast<const char*>(map.data));
      gst_buffer_unmap(buf, &map);
    }
    gst_sample_unref(sample);
  }
  const int status = report_error(pipeline) ? 1 : 0;
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(pipeline);
  return status;
}
