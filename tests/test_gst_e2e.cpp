// End to end, as users run it: the index-build pipeline script builds an index from generated
// images and records the models that made it (and, interrupted, keeps the index it would have
// replaced); the serving pipeline answers text and image queries over loopback ZeroMQ; the
// embedding application and the serving script work as written; queries from other models than
// the index's get error documents; the index is swapped under load; live updates over ZeroMQ.
#include <fcntl.h>
#include <gdk-pixbuf/gdk-pixbuf.h>
#include <gst/app/gstappsink.h>
#include <gst/app/gstappsrc.h>
#include <gst/gst.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <json-glib/json-glib.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "gstmoeresultmeta.h"
#include "moe/ann_index.h"
#include "moe/moe_layer.h"
#include "moe/safetensors.h"
#include "moe_build_config.h"
#include "test_util.h"

namespace {

const std::string kSource = MOE_SOURCE_DIR;
const std::string kModel = kSource + "/tests/fixtures/clip_tiny_bpe";
const std::string kAdapter = kSource + "/tests/fixtures/adapter_tiny";
constexpr int kItems = 12;
// Generous liveness bound for a response on a loaded 2-core CI machine (not a speed check).
constexpr auto kPatience = std::chrono::seconds(120);

struct Catalog {
  std::string dir, index;
  std::vector<std::string> paths, captions;
};

// Images that differ in colour and layout, with a catalog.jsonl giving their captions.
const Catalog& catalog() {
  static Catalog c = [] {
    Catalog cat;
    gchar* tmp = g_dir_make_tmp("moe-e2e-XXXXXX", nullptr);
    cat.dir = tmp;
    g_free(tmp);
    const char* colours[] = {"red", "green", "blue", "yellow", "cyan", "magenta"};
    const guint8 rgb[][3] = {{220, 30, 30},  {30, 200, 40},  {30, 40, 220},
                             {230, 220, 30}, {30, 210, 210}, {210, 30, 200}};
    std::ofstream jsonl(cat.dir + "/catalog.jsonl");
    for (int i = 0; i < kItems; ++i) {
      const int w = 40 + 7 * i, h = 30 + 5 * (i % 4);
      GdkPixbuf* pb = gdk_pixbuf_new(GDK_COLORSPACE_RGB, FALSE, 8, w, h);
      guint8* px = gdk_pixbuf_get_pixels(pb);
      const int stride = gdk_pixbuf_get_rowstride(pb);
      const guint8* c = rgb[i % 6];
      for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
          const bool stripe = (i >= 6) && ((x / 5) % 2 == 0);
          guint8* p = px + y * stride + x * 3;
          for (int ch = 0; ch < 3; ++ch) p[ch] = stripe ? 255 : static_cast<guint8>(c[ch] * (0.6 + 0.4 * y / h));
        }
      const std::string name = "item" + std::to_string(i) + ".png";
      const std::string path = cat.dir + "/" + name;
      EXPECT_TRUE(gdk_pixbuf_save(pb, path.c_str(), "png", nullptr, nullptr));
      g_object_unref(pb);
      const std::string caption = std::string(i >= 6 ? "striped " : "plain ") + colours[i % 6] + " square";
      jsonl << R"({"path": ")" << name << R"(", "id": "item)" << i << R"(", "caption": ")" << caption << "\"}\n";
      cat.paths.push_back(path);
      cat.captions.push_back(caption);
    }
    cat.index = cat.dir + "/catalog.faiss";
    return cat;
  }();
  return c;
}

int run(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env, std::string* output) {
  std::vector<gchar*> args;
  for (const auto& a : argv) args.push_back(const_cast<gchar*>(a.c_str()));
  args.push_back(nullptr);
  gchar** env = g_get_environ();
  for (const auto& kv : extra_env) {
    const auto eq = kv.find('=');
    env = g_environ_setenv(env, kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), TRUE);
  }
  gchar* out = nullptr;
  gchar* err = nullptr;
  gint status = -1;
  GError* error = nullptr;
  const gboolean ok =
      g_spawn_sync(nullptr, args.data(), env, G_SPAWN_DEFAULT, nullptr, nullptr, &out, &err, &status, &error);
  g_strfreev(env);
  if (!ok) {
    *output = error->message;
    g_error_free(error);
    return -1;
  }
  *output = std::string(out ? out : "") + std::string(err ? err : "");
  g_free(out);
  g_free(err);
  return g_spawn_check_wait_status(status, nullptr) ? 0 : (WIFEXITED(status) ? WEXITSTATUS(status) : 128);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::set<std::string> folder_names(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

// A script started in the background, its stdout and stderr read together as they come.
class RunningScript {
 public:
  RunningScript(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
    std::vector<const gchar*> args;
    for (const auto& a : argv) args.push_back(a.c_str());
    args.push_back(nullptr);
    gchar** env = g_get_environ();
    for (const auto& kv : extra_env) {
      const auto eq = kv.find('=');
      env = g_environ_setenv(env, kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), TRUE);
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
      output_ = std::string("pipe: ") + g_strerror(errno);
      g_strfreev(env);
      return;
    }
    GError* error = nullptr;
    // The signals at their defaults: bash cannot trap one that it was started with ignored.
    const GSpawnChildSetupFunc default_signals = [](gpointer) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
    };
    if (!g_spawn_async_with_pipes_and_fds(nullptr, args.data(), env, G_SPAWN_DO_NOT_REAP_CHILD, default_signals,
                                          nullptr, -1, fds[1], fds[1], nullptr, nullptr, 0, &pid_, nullptr, nullptr,
                                          nullptr, &error)) {
      output_ = error->message;
      g_error_free(error);
      pid_ = 0;
    }
    g_strfreev(env);
    close(fds[1]);
    fd_ = fds[0];
  }
  ~RunningScript() {
    if (pid_ > 0) {  // a test that failed half-way
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) close(fd_);
  }
  RunningScript(const RunningScript&) = delete;
  RunningScript& operator=(const RunningScript&) = delete;

  bool started() const { return pid_ > 0; }
  const std::string& output() const { return output_; }
  void signal_it(int sig) const { kill(pid_, sig); }

  // Reads until the output holds `text` (true), or until its end or kPatience (false).
  bool read_until(const std::string& text) {
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    while (output_.find(text) == std::string::npos) {
      if (!read_some(deadline)) return false;
    }
    return true;
  }
  // Reads the output to its end and returns the script's wait status (-1: still running after
  // kPatience).
  int finish() {
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    while (read_some(deadline)) {
    }
    int status = -1;
    if (pid_ > 0 && waitpid(pid_, &status, fd_ < 0 ? 0 : WNOHANG) == pid_) pid_ = 0;
    return pid_ == 0 ? status : -1;
  }

 private:
  // Appends what the pipe has; false at its end (the pipe is then closed) or at `deadline`.
  bool read_some(std::chrono::steady_clock::time_point deadline) {
    if (fd_ < 0) return false;
    using std::chrono::milliseconds;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) return true;
    if (ready <= 0) return false;
    char chunk[4096];
    const ssize_t n = read(fd_, chunk, sizeof chunk);
    if (n > 0) {
      output_.append(chunk, static_cast<size_t>(n));
      return true;
    }
    if (n < 0 && errno == EINTR) return true;
    close(fd_);
    fd_ = -1;
    return false;
  }

  GPid pid_ = 0;
  int fd_ = -1;
  std::string output_;
};

struct Doc {
  JsonParser* parser = nullptr;
  JsonObject* obj = nullptr;
  Doc() = default;
  explicit Doc(const std::string& text) : parser(json_parser_new()) {
    if (json_parser_load_from_data(parser, text.data(), static_cast<gssize>(text.size()), nullptr) &&
        JSON_NODE_HOLDS_OBJECT(json_parser_get_root(parser)))
      obj = json_node_get_object(json_parser_get_root(parser));
  }
  Doc(Doc&& o) noexcept : parser(o.parser), obj(o.obj) {
    o.parser = nullptr;
    o.obj = nullptr;
  }
  ~Doc() {
    if (parser) g_object_unref(parser);
  }
  std::string str(const char* key) const {
    JsonNode* n = obj ? json_object_get_member(obj, key) : nullptr;
    return n && JSON_NODE_HOLDS_VALUE(n) ? json_node_get_string(n) : "";
  }
  bool is_null(const char* key) const {
    JsonNode* n = obj ? json_object_get_member(obj, key) : nullptr;
    return n && JSON_NODE_HOLDS_NULL(n);
  }
};

// A client of the service: PUSH requests, SUB results, matched by id.
class Client {
 public:
  Client(const std::string& requests, const std::string& results)
      : push_(ctx_, zmq::socket_type::push), sub_(ctx_, zmq::socket_type::sub) {
    sub_.set(zmq::sockopt::subscribe, "");
    sub_.connect(results);
    push_.set(zmq::sockopt::linger, 5000);  // requests sent just before closing still go out
    push_.connect(requests);
  }
  void send(const std::string& json) {
    push_.send(zmq::buffer(json), zmq::send_flags::none);
    ++sent_;
  }
  int sent() const { return sent_; }
  // Waits for documents until every id in `ids` (and `anonymous` id-less ones) has arrived.
  std::vector<Doc> collect(std::set<std::string> ids, int anonymous = 0) {
    std::vector<Doc> docs;
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    while ((!ids.empty() || anonymous > 0) && std::chrono::steady_clock::now() < deadline) {
      zmq::pollitem_t item{sub_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(200));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      zmq::message_t msg;
      if (!sub_.recv(msg, zmq::recv_flags::none)) continue;
      Doc d(msg.to_string());
      if (!d.obj) continue;
      if (d.is_null("id"))
        --anonymous;
      else
        ids.erase(d.str("id"));
      docs.push_back(std::move(d));
    }
    return docs;
  }
  // PUB/SUB joins asynchronously: repeat a probe request until its answer arrives.
  bool wait_until_connected() {
    for (int attempt = 0; attempt < 60; ++attempt) {
      const std::string id = "probe-" + std::to_string(attempt);
      send(R"({"id": ")" + id + R"(", "text": "probe"})");
      zmq::pollitem_t item{sub_.handle(), 0, ZMQ_POLLIN, 0};
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (std::chrono::steady_clock::now() < until) {
        zmq::poll(&item, 1, std::chrono::milliseconds(100));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        zmq::message_t msg;
        if (sub_.recv(msg, zmq::recv_flags::none)) return true;
      }
    }
    return false;
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t push_, sub_;
  int sent_ = 0;
};

// Runs the text queries through `appsrc ! moe-encode ! MIDDLE ! ann-query index=INDEX ! appsink`
// (MIDDLE may be empty) and returns every document; request ids are the buffer offsets 0, 1, ...
std::vector<Doc> query_through(const std::string& middle, const std::string& index,
                               const std::vector<std::string>& texts) {
  const std::string desc = "appsrc name=src caps=text/x-raw,format=utf8 format=bytes ! moe-encode model=\"" + kModel +
                           "\" max-batch=8 ! " + (middle.empty() ? "" : middle + " ! ") + "ann-query index=\"" + index +
                           "\" k=3 ! appsink name=sink sync=false";
  GError* err = nullptr;
  GstElement* pipeline = gst_parse_launch(desc.c_str(), &err);
  EXPECT_NE(pipeline, nullptr) << (err ? err->message : "");
  g_clear_error(&err);
  std::vector<Doc> docs;
  if (!pipeline) return docs;
  GstElement* src = gst_bin_get_by_name(GST_BIN(pipeline), "src");
  GstElement* sink = gst_bin_get_by_name(GST_BIN(pipeline), "sink");
  EXPECT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  for (size_t i = 0; i < texts.size(); ++i) {
    GstBuffer* buf = gst_buffer_new_memdup(texts[i].data(), texts[i].size());
    GST_BUFFER_OFFSET(buf) = i;
    EXPECT_EQ(gst_app_src_push_buffer(GST_APP_SRC(src), buf), GST_FLOW_OK);
  }
  gst_app_src_end_of_stream(GST_APP_SRC(src));
  const GstClockTime patience = std::chrono::duration_cast<std::chrono::nanoseconds>(kPatience).count();
  while (GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(sink), patience)) {
    GstMapInfo map;
    GstBuffer* buf = gst_sample_get_buffer(sample);
    if (gst_buffer_map(buf, &map, GST_MAP_READ)) {
      docs.emplace_back(std::string(reinterpret_cast<const char*>(map.data), map.size));
      gst_buffer_unmap(buf, &map);
    }
    gst_sample_unref(sample);
  }
  EXPECT_TRUE(gst_app_sink_is_eos(GST_APP_SINK(sink))) << "the pipeline did not reach EOS";
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(src);
  gst_object_unref(sink);
  gst_object_unref(pipeline);
  return docs;
}

// A loopback TCP endpoint on a port the kernel reports free now (bound to port 0, then closed),
// taken just before the service binds it: ports derived from the pid could meet the ephemeral
// ports of other tests' connections (ASan runs made that happen).
std::string endpoint() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  if (fd >= 0) close(fd);
  EXPECT_NE(port, 0) << "no free loopback port";
  return "tcp://127.0.0.1:" + std::to_string(port);
}

// For a gst-launch whose exit LeakSanitizer cannot check (the sanitizer run only): its tracer
// crashes (SIGSEGV in StopTheWorld) at the exit of the 4-bit service, and pango's fontconfig
// caches behind textoverlay leak by design. Address and UB checks stay on; the elements' own
// leaks are checked in-process by the harness suites and by this test's own process.
std::vector<std::string> without_leak_check(std::vector<std::string> env) {
  if (const char* asan = g_getenv("ASAN_OPTIONS"))
    env.push_back(std::string("ASAN_OPTIONS=") + asan + ":detect_leaks=0");
  return env;
}

class E2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    gst_init(nullptr, nullptr);
    ASSERT_NE(gst_element_factory_find("moe-encode"), nullptr)
        << "the moe plugin is not on GST_PLUGIN_PATH_1_0 (" << (g_getenv("GST_PLUGIN_PATH_1_0") ?: "unset") << ")";
    // The index-build pipeline exactly as shipped.
    std::string out;
    const int rc = run({kSource + "/pipelines/build-index.sh", catalog().dir, catalog().index},
                       {"MODEL=" + kModel, "ADAPTER=" + kAdapter}, &out);
    ASSERT_EQ(rc, 0) << out;
  }
};

}  // namespace

TEST_F(E2E, BuildPipelineWritesIndexAndItems) {
  std::ifstream items(catalog().index + ".items.jsonl");
  ASSERT_TRUE(items.good());
  std::string line;
  int lines = 0;
  while (std::getline(items, line)) ++lines;
  EXPECT_EQ(lines, kItems + 1);  // header + one line per image
}

// An interrupted build exits with the signal's status, says what became of the index, keeps an
// earlier one byte for byte, and leaves no partial files beside it.
TEST_F(E2E, InterruptedBuildKeepsTheOldIndex) {
  // Far more items than can be indexed before the signal lands (the e2e images, over and over),
  // so that the build is still running: gst-launch prints PREROLLING when the source has started,
  // and the pipeline prerolls only at EOS, once the whole catalog is indexed.
  moe::test::TempDir catalog_dir;
  {
    std::ofstream jsonl(catalog_dir.file("catalog.jsonl"));
    for (int i = 0; i < 50000; ++i)
      jsonl << R"({"path": ")" << catalog().paths[i % kItems] << R"(", "id": "copy)" << i << "\"}\n";
  }
  struct Case {
    int signal, exit_status;
    bool old_index;
    const char* message;
  };
  const Case cases[] = {{SIGINT, 130, true, "the old index at "}, {SIGTERM, 143, false, "no index was written"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.signal == SIGINT ? "SIGINT" : "SIGTERM");
    moe::test::TempDir out;
    const std::string index = out.file("index.faiss"), items = index + ".items.jsonl";
    if (c.old_index) {
      std::filesystem::copy_file(catalog().index, index);
      std::filesystem::copy_file(catalog().index + ".items.jsonl", items);
    }
    const std::string index_before = file_bytes(index), items_before = file_bytes(items);
    const std::set<std::string> names_before = folder_names(out.path());

    RunningScript build({kSource + "/pipelines/build-index.sh", catalog_dir.path(), index},
                        {"MODEL=" + kModel, "ADAPTER=" + kAdapter});
    ASSERT_TRUE(build.started()) << build.output();
    ASSERT_TRUE(build.read_until("Pipeline is PREROLLING")) << build.output();
    build.signal_it(c.signal);
    const int status = build.finish();
    const std::string& output = build.output();
    ASSERT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << output;
    EXPECT_EQ(WEXITSTATUS(status), c.exit_status) << output;
    const std::string message =
        std::string("build-index: interrupted: ") + c.message + (c.old_index ? index + " was kept" : "");
    EXPECT_NE(output.find(message), std::string::npos) << output;
    EXPECT_TRUE(file_bytes(index) == index_before) << index << " changed";  // not EXPECT_EQ: binary dumps
    EXPECT_TRUE(file_bytes(items) == items_before) << items << " changed";
    EXPECT_EQ(folder_names(out.path()), names_before) << "partial files left beside the index";
  }
}

// A build over a folder with bad images, a text file and a subfolder prints its progress, says
// what it skipped, names each failed image with its reason and exits 2; ALLOW_FAILURES=1 accepts
// the index without them, RECURSIVE=1 takes the subfolder too.
TEST_F(E2E, BuildScriptShowsProgressSkipsAndFailures) {
  moe::test::TempDir dir;
  for (int i = 0; i < 4; ++i)
    std::filesystem::copy_file(catalog().paths[i], dir.file("good" + std::to_string(i) + ".png"));
  dir.write("broken.png", "not a png at all");
  dir.write("truncated.jpg", file_bytes(catalog().paths[4]).substr(0, 20));
  dir.write("notes.txt", "a text file");
  std::filesystem::create_directory(dir.file("sub"));
  std::filesystem::copy_file(catalog().paths[5], dir.file("sub/inner.png"));
  moe::test::TempDir out;
  const std::string index = out.file("index.faiss");
  const auto indexed = [&] {
    std::ifstream items(index + ".items.jsonl");
    int lines = 0;
    for (std::string line; std::getline(items, line);) ++lines;
    return lines - 1;  // the header
  };

  std::string output;
  const std::vector<std::string> env = {"MODEL=" + kModel, "ADAPTER=" + kAdapter, "PROGRESS_ITEMS=2"};
  EXPECT_EQ(run({kSource + "/pipelines/build-index.sh", dir.path(), index}, env, &output), 2) << output;
  for (const std::string& said :
       {std::string("Progress: (index-build) "), std::string(" of 6 items ("),
        std::string("notes.txt (not an image file"), std::string("sub/ (a subfolder: set recursive=true"),
        std::string("indexed 4 of 6 items into " + index), dir.file("broken.png") + ": ",
        dir.file("truncated.jpg") + ": ", std::string("failed images: 2")})
    EXPECT_NE(output.find(said), std::string::npos) << "missing: " << said << "\n" << output;
  EXPECT_EQ(indexed(), 4);

  std::vector<std::string> tolerant = env;
  tolerant.push_back("ALLOW_FAILURES=1");
  tolerant.push_back("RECURSIVE=1");
  EXPECT_EQ(run({kSource + "/pipelines/build-index.sh", dir.path(), index}, tolerant, &output), 0) << output;
  EXPECT_NE(output.find("indexed 5 images into " + index + "; 2 failed"), std::string::npos) << output;
  EXPECT_EQ(output.find("sub/ (a subfolder"), std::string::npos) << output;
  EXPECT_EQ(indexed(), 5);
}

TEST_F(E2E, ServingPipelineAnswersEveryRequestOnce) {
  const std::string req = endpoint(), res = endpoint();
  const std::string desc =
      "zmq-query endpoint=" + req + " image-root=\"" + catalog().dir + "\" ! queue ! moe-encode model=\"" + kModel +
      "\" max-batch=4 max-latency=2000000 ! moe-route model=\"" + kAdapter + "\" ! moe-expert model=\"" + kAdapter +
      "\" ! ann-query index=\"" + catalog().index + "\" k=5 ! zmq-publish endpoint=" + res;
  GError* err = nullptr;
  GstElement* pipeline = gst_parse_launch(desc.c_str(), &err);
  ASSERT_NE(pipeline, nullptr) << (err ? err->message : "");
  ASSERT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);

  Client client(req, res);
  ASSERT_TRUE(client.wait_until_connected()) << "no answer to probe requests";

  std::set<std::string> ids;
  for (int i = 0; i < 10; ++i) {
    const std::string id = "text-" + std::to_string(i);
    client.send(R"({"id": ")" + id + R"(", "text": ")" + catalog().captions[i % kItems] + "\"}");
    ids.insert(id);
  }
  for (int i = 0; i < kItems; i += 3) {
    const std::string id = "image-" + std::to_string(i);
    client.send(R"({"id": ")" + id + R"(", "image": ")" + catalog().paths[i] + "\"}");
    ids.insert(id);
  }
  gchar* contents = nullptr;
  gsize len = 0;
  ASSERT_TRUE(g_file_get_contents(catalog().paths[5].c_str(), &contents, &len, nullptr));
  gchar* b64 = g_base64_encode(reinterpret_cast<const guchar*>(contents), len);
  client.send(std::string(R"({"id": 77, "k": 2, "image_base64": ")") + b64 + "\"}");
  g_free(b64);
  g_free(contents);
  ids.insert("77");
  client.send(R"({"id": "missing-file", "image": "/nonexistent/photo.png"})");
  client.send("this is not json");
  client.send(std::string("{\"id\": \"x\", \"text\": \"\xff\xfe\"}"));  // not UTF-8: no id can be trusted
  ids.insert("missing-file");

  std::vector<Doc> docs = client.collect(ids, /*anonymous=*/2);
  std::map<std::string, int> seen;
  for (const Doc& d : docs) seen[d.is_null("id") ? "(null)" : d.str("id")]++;
  for (const auto& id : ids) EXPECT_EQ(seen[id], 1) << "id " << id;
  EXPECT_EQ(seen["(null)"], 2) << "the requests that were not JSON / not UTF-8";

  for (const Doc& d : docs) {
    const std::string id = d.is_null("id") ? "" : d.str("id");
    if (id.rfind("probe", 0) == 0) continue;
    if (id == "missing-file" || id.empty()) {
      EXPECT_EQ(d.str("type"), "error") << id;
      JsonObject* e = json_object_get_object_member(d.obj, "error");
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(std::string(json_object_get_string_member(e, "stage")), "zmq-query");
      if (!id.empty()) {
        EXPECT_EQ(std::string(json_object_get_string_member(e, "reason")),
                  "image '/nonexistent/photo.png' is outside image-root");
      }
      continue;
    }
    ASSERT_EQ(d.str("type"), "result") << id;
    JsonArray* results = json_object_get_array_member(d.obj, "results");
    const guint expected = id == "77" ? 2 : 5;
    ASSERT_EQ(json_array_get_length(results), expected) << id;
    double previous = 2.0;
    for (guint r = 0; r < json_array_get_length(results); ++r) {
      JsonObject* hit = json_array_get_object_element(results, r);
      const double score = json_object_get_double_member(hit, "score");
      EXPECT_LE(score, previous + 1e-6) << id;
      previous = score;
      EXPECT_NE(std::string(json_object_get_string_member(hit, "caption")).find("square"), std::string::npos);
    }
    EXPECT_GT(json_array_get_length(json_object_get_array_member(d.obj, "experts")), 0u);
    EXPECT_TRUE(json_object_has_member(d.obj, "timings_ms"));
    // Its share of its batch (docs/zmq-schema.md, "cost"); experts on the CPU path copy nothing.
    JsonObject* cost = json_object_get_object_member(d.obj, "cost");
    ASSERT_NE(cost, nullptr) << id;
    const gint64 batch_rows = json_object_get_int_member(cost, "batch_rows");
    EXPECT_GE(batch_rows, 1) << id;
    EXPECT_LE(batch_rows, 4) << id << ": max-batch";
    EXPECT_GT(json_object_get_double_member(cost, "compute_ms"), 0.0) << id;
    EXPECT_EQ(json_object_get_double_member(cost, "copy_ms"), 0.0) << id;
    EXPECT_EQ(json_object_get_int_member(cost, "expert_bytes_loaded"), 0) << id;
    EXPECT_EQ(json_object_get_double_member(cost, "wait_ms"),
              json_object_get_double_member(json_object_get_object_member(d.obj, "timings_ms"), "queue"))
        << id;
    // An image of the catalog finds itself first: the same pixels give the same embedding.
    if (id.rfind("image-", 0) == 0 || id == "77") {
      const int item = id == "77" ? 5 : std::stoi(id.substr(6));
      JsonObject* top = json_array_get_object_element(results, 0);
      EXPECT_EQ(std::string(json_object_get_string_member(top, "caption")), catalog().captions[item]) << id;
      EXPECT_NEAR(json_object_get_double_member(top, "score"), 1.0, 1e-3) << id;
    }
  }
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(pipeline);
}

TEST_F(E2E, ServeScriptWorksAsWritten) {
  // The service stops after NUM_REQUESTS requests. Probes (as many as the subscription takes to
  // join) count too, so the client tops up with fillers to exactly that number at the end.
  constexpr int kRequests = 100;
  const std::string req = endpoint(), res = endpoint();
  std::string out;
  int rc = -1;
  std::thread service([&] {
    rc = run({kSource + "/pipelines/serve.sh", catalog().index},
             {"MODEL=" + kModel, "ADAPTER=" + kAdapter, "QUERY_ENDPOINT=" + req, "RESULT_ENDPOINT=" + res,
              "NUM_REQUESTS=" + std::to_string(kRequests), "IMAGE_ROOT=" + catalog().dir},
             &out);
  });
  {
    Client client(req, res);
    const bool connected = client.wait_until_connected();
    if (connected) {
      client.send(R"({"id": "s1", "text": "plain red square"})");
      client.send(R"({"id": "s2", "image": "item0.png"})");  // relative to IMAGE_ROOT
      auto docs = client.collect({"s1", "s2"});
      EXPECT_EQ(docs.size(), 2u);
      for (const Doc& d : docs) EXPECT_EQ(d.str("type"), "result") << d.str("id");
    }
    EXPECT_TRUE(connected) << out;
    EXPECT_LE(client.sent(), kRequests);
    while (client.sent() < kRequests) client.send(R"({"id": "filler", "text": "filler"})");
  }
  service.join();
  EXPECT_EQ(rc, 0) << out;
}

// The shipped 4-bit adapter through the scripts as documented: build-index.sh with
// ADAPTER=models/default/adapter-int4 (the other settings at their defaults: it runs as stored)
// indexes the demo catalog; serve.sh with PRECISION=int4 (which picks that adapter) serves it.
TEST_F(E2E, ServeScriptRunsTheShippedInt4Adapter) {
  constexpr int kRequests = 40;
  const std::string model = kSource + "/models/default/clip", adapter = kSource + "/models/default/adapter-int4",
                    demo = kSource + "/models/default/catalog";
  moe::test::TempDir tmp;
  const std::string index = tmp.file("int4.faiss");
  std::string out;
  ASSERT_EQ(run({kSource + "/pipelines/build-index.sh", demo, index}, {"MODEL=" + model, "ADAPTER=" + adapter}, &out),
            0)
      << out;
  const std::string req = endpoint(), res = endpoint();
  int rc = -1;
  std::thread service([&] {
    rc = run({kSource + "/pipelines/serve.sh", index},
             without_leak_check({"MODEL=" + model, "PRECISION=int4", "QUERY_ENDPOINT=" + req, "RESULT_ENDPOINT=" + res,
                                 "NUM_REQUESTS=" + std::to_string(kRequests), "IMAGE_ROOT=" + demo}),
             &out);
  });
  {
    Client client(req, res);
    const bool connected = client.wait_until_connected();
    if (connected) {
      client.send(R"({"id": "q1", "text": "a large pink dotted mug"})");
      client.send(R"({"id": "q2", "image": "st00000.png"})");
      const std::vector<Doc> docs = client.collect({"q1", "q2"});
      EXPECT_EQ(docs.size(), 2u);
      for (const Doc& d : docs) {
        EXPECT_EQ(d.str("type"), "result") << d.str("id");  // no ASSERT: the service thread must be joined
        if (d.str("type") == "result") {
          EXPECT_GT(json_array_get_length(json_object_get_array_member(d.obj, "results")), 0u) << d.str("id");
        }
      }
    }
    EXPECT_TRUE(connected) << out;
    EXPECT_LE(client.sent(), kRequests);
    while (client.sent() < kRequests) client.send(R"({"id": "filler", "text": "filler"})");
  }
  service.join();
  EXPECT_EQ(rc, 0) << out;
}

// moe-expert's stats show how many bytes the experts take: the 4-bit adapter's packed ones.
TEST_F(E2E, ExpertStatsShowTheExpertBytes) {
  guint64 bytes[2] = {0, 0};
  const std::string adapters[2] = {kSource + "/models/default/adapter", kSource + "/models/default/adapter-int4"};
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(adapters[i]);
    GstElement* expert = gst_element_factory_make("moe-expert", nullptr);
    ASSERT_NE(expert, nullptr);
    g_object_set(expert, "model", adapters[i].c_str(), nullptr);
    EXPECT_EQ(gst_element_set_state(expert, GST_STATE_PAUSED), GST_STATE_CHANGE_SUCCESS);
    GstStructure* stats = nullptr;
    g_object_get(expert, "stats", &stats, nullptr);
    ASSERT_NE(stats, nullptr);
    EXPECT_TRUE(gst_structure_get_uint64(stats, "expert-bytes", &bytes[i]));
    gst_structure_free(stats);
    gst_element_set_state(expert, GST_STATE_NULL);
    gst_object_unref(expert);
    EXPECT_EQ(bytes[i], moe::MoeAdapter::load(adapters[i]).layer().expert_bytes());
  }
  EXPECT_GT(bytes[0], 6 * bytes[1]);  // f32 against 4 bits + a 16-bit scale per 32 weights
}

TEST_F(E2E, EmbeddingApplicationPrintsResults) {
  std::string out;
  const int rc = run({MOE_QUERY_APP, "--model", kModel, "--adapter", kAdapter, "--index", catalog().index, "--k", "3",
                      "plain red square", "striped blue square"},
                     {}, &out);
  ASSERT_EQ(rc, 0) << out;
  int results = 0;
  for (size_t pos = 0; (pos = out.find("\"type\":\"result\"", pos)) != std::string::npos; ++pos) ++results;
  EXPECT_EQ(results, 2) << out;
}

// The Python twin (PyGObject; Debian's python3-gi): answers, and an error document for a query
// that is not UTF-8.
TEST_F(E2E, PythonApplicationPrintsResultsAndErrors) {
  std::string out;
  const int rc =
      run({"/usr/bin/python3", kSource + "/examples/embed_pipeline.py", "--model", kModel, "--adapter", kAdapter,
           "--index", catalog().index, "--k", "3", "plain red square", "striped blue square", "bad \xff text"},
          {}, &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("0: 'plain red square'\n  1. "), std::string::npos) << out;
  EXPECT_NE(out.find("1: 'striped blue square'\n  1. "), std::string::npos) << out;
  EXPECT_NE(out.find("  3. "), std::string::npos) << out;
  EXPECT_NE(out.find("2: error in moe-encode: text request '2' is not valid UTF-8"), std::string::npos) << out;
}

// pipelines/caption-video.sh as documented, headless: the test pattern's frames leave textoverlay
// with the best catalog match written on them (textoverlay logs each text it renders on a frame;
// frames the search skipped while it started have none).
TEST_F(E2E, CaptionVideoScriptWritesTheBestMatchOnFrames) {
  constexpr int kFrames = 30;
  std::string out;
  const int rc =
      run({kSource + "/pipelines/caption-video.sh"},
          without_leak_check({"MODEL=" + kModel, "ADAPTER=" + kAdapter, "INDEX=" + catalog().index, "SINK=fakesink",
                              "NUM_BUFFERS=" + std::to_string(kFrames), "GST_DEBUG=basetextoverlay:5"}),
          &out);
  ASSERT_EQ(rc, 0) << out;
  const std::string marker = "Rendering text '";
  int captioned = 0;
  for (size_t pos = 0; (pos = out.find(marker, pos)) != std::string::npos; ++pos) {
    const size_t begin = pos + marker.size(), end = out.find("'\n", begin);
    ASSERT_NE(end, std::string::npos);
    const std::string text = out.substr(begin, end - begin);  // "plain red square (0.93)"
    const size_t score = text.rfind(" (");
    ASSERT_NE(score, std::string::npos) << text;
    const std::vector<std::string>& captions = catalog().captions;
    EXPECT_NE(std::find(captions.begin(), captions.end(), text.substr(0, score)), captions.end()) << text;
    double value = 0;
    EXPECT_EQ(sscanf(text.c_str() + score, " (%lf)", &value), 1) << text;
    EXPECT_LE(std::fabs(value), 1.0) << text;
    ++captioned;
  }
  EXPECT_GE(captioned, 1) << out;
  EXPECT_LE(captioned, kFrames);
}

// Each frame's result comes back on a caption with the frame's own PTS (frames batched together
// keep theirs), lasting until the next frame's, with the result as a GstMoeResultMeta.
TEST_F(E2E, CaptionsKeepTheirFramesPtsAndCarryTheResult) {
  constexpr int kFrames = 8;
  constexpr GstClockTime kFrameDuration = GST_SECOND / 25;
  const std::string desc =
      "videotestsrc num-buffers=" + std::to_string(kFrames) + " ! video/x-raw,framerate=25/1 ! moe-encode model=\"" +
      kModel + "\" max-batch=4 ! moe-route model=\"" + kAdapter + "\" ! moe-expert model=\"" + kAdapter +
      "\" ! ann-query index=\"" + catalog().index + "\" k=2 ! moe-caption hits=2 ! appsink name=sink sync=false";
  GError* err = nullptr;
  GstElement* pipeline = gst_parse_launch(desc.c_str(), &err);
  ASSERT_NE(pipeline, nullptr) << (err ? err->message : "");
  GstElement* sink = gst_bin_get_by_name(GST_BIN(pipeline), "sink");
  ASSERT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  const std::vector<std::string>& captions = catalog().captions;
  const GstClockTime patience = std::chrono::duration_cast<std::chrono::nanoseconds>(kPatience).count();
  int frame = 0;
  while (GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(sink), patience)) {
    GstBuffer* buf = gst_sample_get_buffer(sample);
    EXPECT_EQ(GST_BUFFER_PTS(buf), frame * kFrameDuration);
    EXPECT_EQ(GST_BUFFER_DURATION(buf), kFrameDuration);
    const GstMoeResultMeta* meta = gst_buffer_get_moe_result_meta(buf);
    EXPECT_NE(meta, nullptr);
    if (meta) {
      EXPECT_EQ(gst_moe_result_meta_get_pts(meta), GST_BUFFER_PTS(buf));
      EXPECT_EQ(gst_moe_result_meta_get_n_hits(meta), 2u);
      const gchar* best = gst_moe_result_meta_get_hit_caption(meta, 0);
      EXPECT_NE(std::find(captions.begin(), captions.end(), best ? best : ""), captions.end());
      EXPECT_GT(gst_moe_result_meta_get_n_experts(meta), 0u);
      EXPECT_EQ(gst_moe_result_meta_get_error_code(meta), nullptr);
    }
    gst_sample_unref(sample);
    ++frame;
  }
  EXPECT_EQ(frame, kFrames);
  EXPECT_TRUE(gst_app_sink_is_eos(GST_APP_SINK(sink)));
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(sink);
  gst_object_unref(pipeline);
}

TEST_F(E2E, IndexRecordsTheModelsThatBuiltIt) {
  const moe::AnnIndex index = moe::AnnIndex::load(catalog().index);
  ASSERT_TRUE(index.provenance().has_value());
  EXPECT_EQ(index.provenance()->encoder, "clip_tiny_bpe");
  EXPECT_EQ(index.provenance()->encoder_fingerprint, moe::Checkpoint::open(kModel).fingerprint());
  EXPECT_EQ(index.provenance()->adapter, "adapter_tiny");
  EXPECT_EQ(index.provenance()->adapter_fingerprint,
            moe::Checkpoint::open(kAdapter + "/adapter.safetensors").fingerprint());
}

TEST_F(E2E, QueriesFromOtherModelsGetErrorDocuments) {
  const std::vector<std::string> texts = {"plain red square", "striped blue square", "plain green square"};
  const std::string route_expert = "moe-route model=\"" + kAdapter + "\" ! moe-expert model=\"" + kAdapter + "\"";
  // The pipeline that built the index: results.
  {
    const std::vector<Doc> docs = query_through(route_expert, catalog().index, texts);
    ASSERT_EQ(docs.size(), texts.size());
    for (const Doc& d : docs) EXPECT_EQ(d.str("type"), "result") << d.str("id");
  }
  // A retrained adapter of the same shapes (same directory name, other weights), no adapter, and
  // routing without moe-expert: each request gets an error document with its id naming both sides.
  moe::test::TempDir retrained_root;
  const std::string retrained = retrained_root.file("adapter_tiny");
  ASSERT_TRUE(std::filesystem::create_directory(retrained));
  std::filesystem::copy_file(kAdapter + "/adapter_config.json", retrained + "/adapter_config.json");
  moe::test::copy_with_one_value_changed(kAdapter + "/adapter.safetensors", retrained + "/adapter.safetensors",
                                         "experts.0.w1.weight");
  const std::string built_from = "was built from encoder 'clip_tiny_bpe' (fp " +
                                 moe::Checkpoint::open(kModel).fingerprint() + ") and adapter 'adapter_tiny' (fp " +
                                 moe::Checkpoint::open(kAdapter + "/adapter.safetensors").fingerprint() + ")";
  const std::string retrained_fp = moe::Checkpoint::open(retrained + "/adapter.safetensors").fingerprint();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"moe-route model=\"" + retrained + "\" ! moe-expert model=\"" + retrained + "\"",
       "and adapter 'adapter_tiny' (fp " + retrained_fp + "): rebuild the index"},
      {"", "without an adapter: rebuild the index"},
      {"moe-route model=\"" + kAdapter + "\"", "without an adapter: rebuild the index"},
  };
  for (const auto& [middle, query_side] : cases) {
    SCOPED_TRACE(middle.empty() ? "no adapter" : middle);
    const std::vector<Doc> docs = query_through(middle, catalog().index, texts);
    ASSERT_EQ(docs.size(), texts.size());
    std::set<std::string> ids;
    for (const Doc& d : docs) {
      ASSERT_EQ(d.str("type"), "error") << d.str("id");
      ids.insert(d.str("id"));
      JsonObject* e = json_object_get_object_member(d.obj, "error");
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(std::string(json_object_get_string_member(e, "stage")), "ann-query");
      const std::string reason = json_object_get_string_member(e, "reason");
      EXPECT_NE(reason.find(catalog().index), std::string::npos) << reason;
      EXPECT_NE(reason.find(built_from), std::string::npos) << reason;
      EXPECT_NE(reason.find("but this query was encoded by encoder 'clip_tiny_bpe'"), std::string::npos) << reason;
      EXPECT_NE(reason.find(query_side), std::string::npos) << reason;
    }
    EXPECT_EQ(ids, (std::set<std::string>{"0", "1", "2"}));
  }
}

// Text requests stream through appsrc ! moe-encode ! moe-route ! moe-expert ! ann-query while the
// index is swapped for one of other items built by the same pipeline: every request is answered
// exactly once, from the old index up to the switch and from the new one after it.
TEST_F(E2E, IndexSwapUnderLoadAnswersEveryRequestOnceOldThenNew) {
  moe::test::TempDir other;
  {
    std::ofstream jsonl(other.file("catalog.jsonl"));
    for (int i = 0; i < kItems / 2; ++i) {
      std::filesystem::copy_file(catalog().paths[i], other.file("alt" + std::to_string(i) + ".png"));
      jsonl << R"({"path": "alt)" << i << R"(.png", "id": "alt)" << i << R"(", "caption": ")" << catalog().captions[i]
            << "\"}\n";
    }
  }
  const std::string new_index = other.file("alt.faiss");
  std::string out;
  ASSERT_EQ(run({kSource + "/pipelines/build-index.sh", other.file("catalog.jsonl"), new_index},
                {"MODEL=" + kModel, "ADAPTER=" + kAdapter}, &out),
            0)
      << out;

  const std::string desc = "appsrc name=src caps=text/x-raw,format=utf8 format=bytes ! moe-encode model=\"" + kModel +
                           "\" max-batch=4 ! moe-route model=\"" + kAdapter + "\" ! moe-expert model=\"" + kAdapter +
                           "\" ! ann-query name=ann index=\"" + catalog().index +
                           "\" k=1 ! appsink name=sink sync=false";
  GError* err = nullptr;
  GstElement* pipeline = gst_parse_launch(desc.c_str(), &err);
  ASSERT_NE(pipeline, nullptr) << (err ? err->message : "");
  GstElement* src = gst_bin_get_by_name(GST_BIN(pipeline), "src");
  GstElement* sink = gst_bin_get_by_name(GST_BIN(pipeline), "sink");
  GstElement* ann = gst_bin_get_by_name(GST_BIN(pipeline), "ann");
  GstBus* bus = gst_element_get_bus(pipeline);
  ASSERT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  const std::vector<std::string> texts = {"plain red square", "striped blue square", "plain green square"};
  int pushed = 0;
  auto push = [&](int n) {
    for (int i = 0; i < n; ++i, ++pushed) {
      const std::string& text = texts[pushed % texts.size()];
      GstBuffer* buf = gst_buffer_new_memdup(text.data(), text.size());
      GST_BUFFER_OFFSET(buf) = pushed;
      EXPECT_EQ(gst_app_src_push_buffer(GST_APP_SRC(src), buf), GST_FLOW_OK);
    }
  };
  const GstClockTime patience = std::chrono::duration_cast<std::chrono::nanoseconds>(kPatience).count();
  std::vector<GstSample*> samples;
  push(24);
  samples.push_back(gst_app_sink_try_pull_sample(GST_APP_SINK(sink), patience));  // answered before the swap
  ASSERT_NE(samples.back(), nullptr);
  g_object_set(ann, "index", new_index.c_str(), nullptr);  // requests keep coming while it loads
  push(8);
  bool loaded = false;
  while (!loaded) {
    GstMessage* msg = gst_bus_timed_pop_filtered(
        bus, patience, static_cast<GstMessageType>(GST_MESSAGE_ELEMENT | GST_MESSAGE_WARNING | GST_MESSAGE_ERROR));
    ASSERT_NE(msg, nullptr) << "the new index was not loaded";
    const GstStructure* st = gst_message_get_structure(msg);
    ASSERT_EQ(GST_MESSAGE_TYPE(msg), GST_MESSAGE_ELEMENT) << gst_structure_to_string(st);
    loaded = gst_structure_has_name(st, "ann-query-index") &&
             g_strcmp0(gst_structure_get_string(st, "event"), "loaded") == 0;
    gst_message_unref(msg);
  }
  push(24);
  gst_app_src_end_of_stream(GST_APP_SRC(src));

  std::map<std::string, int> answered;
  int from_old = 0, from_new = 0;
  int64_t last_id = -1;
  while (GstSample* sample = gst_app_sink_try_pull_sample(GST_APP_SINK(sink), patience)) samples.push_back(sample);
  for (GstSample* sample : samples) {
    GstMapInfo map;
    GstBuffer* buf = gst_sample_get_buffer(sample);
    std::string text;
    if (gst_buffer_map(buf, &map, GST_MAP_READ)) {
      text.assign(reinterpret_cast<const char*>(map.data), map.size);
      gst_buffer_unmap(buf, &map);
    }
    gst_sample_unref(sample);
    const Doc doc(text);
    EXPECT_EQ(doc.str("type"), "result") << text;
    if (doc.str("type") != "result") continue;
    const std::string id = doc.str("id");
    answered[id] += 1;
    EXPECT_GT(std::stoll(id), last_id) << "answers come in request order";
    last_id = std::stoll(id);
    JsonArray* results = json_object_get_array_member(doc.obj, "results");
    EXPECT_EQ(json_array_get_length(results), 1u) << text;
    if (json_array_get_length(results) == 0) continue;
    const std::string top = json_object_get_string_member(json_array_get_object_element(results, 0), "id");
    const std::string index = json_object_get_string_member(json_object_get_object_member(doc.obj, "model"), "index");
    if (index == "alt.faiss") {
      EXPECT_EQ(top.rfind("alt", 0), 0u) << top;
      ++from_new;
    } else {
      EXPECT_EQ(index, "catalog.faiss");
      EXPECT_EQ(top.rfind("item", 0), 0u) << top;
      EXPECT_EQ(from_new, 0) << "request " << id << " answered from the old index after the switch";
      ++from_old;
    }
  }
  EXPECT_TRUE(gst_app_sink_is_eos(GST_APP_SINK(sink)));
  EXPECT_EQ(answered.size(), static_cast<size_t>(pushed));
  for (const auto& [id, times] : answered) EXPECT_EQ(times, 1) << id;
  EXPECT_GE(from_old, 1);
  EXPECT_GE(from_new, 24);
  GstStructure* stats = nullptr;
  g_object_get(ann, "stats", &stats, nullptr);
  EXPECT_STREQ(gst_structure_get_string(stats, "index"), new_index.c_str());
  gst_structure_free(stats);
  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(bus);
  gst_object_unref(ann);
  gst_object_unref(src);
  gst_object_unref(sink);
  gst_object_unref(pipeline);
}

// Live updates through ZeroMQ: an upsert is embedded by the service's models and found by the same
// query, a delete removes it, each answered by an update document; the index on disk has them.
TEST_F(E2E, LiveUpdatesOverZeroMqChangeWhatQueriesFind) {
  moe::test::TempDir copy;
  const std::string index = copy.file("catalog.faiss");
  std::filesystem::copy_file(catalog().index, index);
  std::filesystem::copy_file(catalog().index + ".items.jsonl", index + ".items.jsonl");
  const std::string req = endpoint(), res = endpoint();
  const std::string desc = "zmq-query endpoint=" + req + " ! queue ! moe-encode model=\"" + kModel +
                           "\" max-batch=4 max-latency=2000000 ! moe-route model=\"" + kAdapter +
                           "\" ! moe-expert model=\"" + kAdapter + "\" ! ann-query index=\"" + index +
                           "\" k=1 allow-updates=true ! zmq-publish endpoint=" + res;
  GError* err = nullptr;
  GstElement* pipeline = gst_parse_launch(desc.c_str(), &err);
  ASSERT_NE(pipeline, nullptr) << (err ? err->message : "");
  ASSERT_NE(gst_element_set_state(pipeline, GST_STATE_PLAYING), GST_STATE_CHANGE_FAILURE);
  Client client(req, res);
  ASSERT_TRUE(client.wait_until_connected()) << "no answer to probe requests";
  // One request at a time, its answer awaited: the document with its id.
  auto ask = [&](const std::string& id, const std::string& json) {
    client.send(json);
    for (Doc& d : client.collect({id}))
      if (d.str("id") == id) return std::move(d);
    ADD_FAILURE() << "no answer to " << id;
    return Doc();
  };
  auto top_hit = [](const Doc& d) {
    JsonArray* results = d.obj ? json_object_get_array_member(d.obj, "results") : nullptr;
    return results && json_array_get_length(results) > 0
               ? std::string(json_object_get_string_member(json_array_get_object_element(results, 0), "id"))
               : std::string();
  };
  const std::string query = R"("text": "a new teal mug")";

  Doc upsert =
      ask("u1", R"({"id": "u1", "op": "upsert", "item": {"id": "sku-teal", "caption": "teal mug"}, )" + query + "}");
  ASSERT_EQ(upsert.str("type"), "update");
  EXPECT_EQ(upsert.str("op"), "upsert");
  EXPECT_EQ(upsert.str("item"), "sku-teal");
  EXPECT_EQ(json_object_get_int_member(upsert.obj, "row"), kItems);
  EXPECT_FALSE(json_object_get_boolean_member(upsert.obj, "replaced"));
  EXPECT_EQ(json_object_get_int_member(upsert.obj, "items"), kItems + 1);
  EXPECT_EQ(top_hit(ask("s1", R"({"id": "s1", )" + query + "}")), "sku-teal");

  Doc del = ask("d1", R"({"id": "d1", "op": "delete", "items": ["sku-teal", "nope"]})");
  ASSERT_EQ(del.str("type"), "update");
  EXPECT_EQ(json_object_get_int_member(del.obj, "deleted"), 1);
  JsonArray* missing = json_object_get_array_member(del.obj, "missing");
  ASSERT_EQ(json_array_get_length(missing), 1u);
  EXPECT_STREQ(json_array_get_string_element(missing, 0), "nope");
  const std::string after = top_hit(ask("s2", R"({"id": "s2", )" + query + "}"));
  EXPECT_EQ(after.rfind("item", 0), 0u) << after;

  gst_element_set_state(pipeline, GST_STATE_NULL);
  gst_object_unref(pipeline);
  const moe::AnnIndex saved = moe::AnnIndex::load(index);
  EXPECT_EQ(saved.find("sku-teal"), -1);
  EXPECT_EQ(saved.size(), kItems + 1);  // the deleted row stays, as a tombstone
  EXPECT_EQ(saved.live_size(), kItems);
}
