#include "gstmoemetrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gstmoeresult.h"
#include "moe/clip_model.h"
#include "moe/expert_executor.h"
#include "moe/moe_layer.h"
#include "moe/query_cache.h"
#include "moe/routing_policy.h"

GST_DEBUG_CATEGORY_STATIC(moe_metrics_debug);
#define GST_CAT_DEFAULT moe_metrics_debug

namespace gstmoe::metrics {

namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

constexpr double kSecondsPerMs = 1e-3;

void init_debug_category() {
  static const bool initialized = [] {
    GST_DEBUG_CATEGORY_INIT(moe_metrics_debug, "moe-metrics", 0, "Prometheus metrics of the gst-moe elements");
    return true;
  }();
  (void)initialized;
}

// From 0.5 ms (a routed batch) to 10 s (a large image batch on a loaded CPU).
const Histogram::BucketBoundaries& latency_buckets() {
  static const Histogram::BucketBoundaries buckets{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                   0.1,    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};
  return buckets;
}

// Powers of two up to moe-encode's largest max-batch.
const Histogram::BucketBoundaries& batch_buckets() {
  static const Histogram::BucketBoundaries buckets{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  return buckets;
}

// Model loads: from a cache hit (≈0) to a large model read from a slow disk.
const Histogram::BucketBoundaries& load_buckets() {
  static const Histogram::BucketBoundaries buckets{0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
  return buckets;
}

// The stages of RequestRecord::timings_ms and zmq-publish's: created at once so that a dashboard
// shows every stage (at zero) before its first request.
constexpr const char* kStages[] = {"queue", "encode", "route", "expert", "search", "publish"};

// The resident set of this process, read at each scrape: prometheus-cpp has no process collector.
class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily family{"gstmoe_process_resident_memory_bytes",
                                    "Resident memory of the process (host RAM, from /proc/self/statm)",
                                    prometheus::MetricType::Gauge,
                                    {}};
    unsigned long size_pages = 0, resident_pages = 0;
    FILE* statm = std::fopen("/proc/self/statm", "r");
    const bool read = statm && std::fscanf(statm, "%lu %lu", &size_pages, &resident_pages) == 2;
    if (statm) std::fclose(statm);
    if (!read) return {};  // no /proc: the metric is absent rather than wrong
    prometheus::ClientMetric metric;
    metric.gauge.value = static_cast<double>(resident_pages) * static_cast<double>(sysconf(_SC_PAGESIZE));
    family.metric.push_back(metric);
    return {family};
  }
};

// A gauge family of `name` with one sample per entry of `values` (labels, value); none when empty.
void add_gauge_family(std::vector<prometheus::MetricFamily>* families, const char* name, const char* help,
                      const std::map<prometheus::Labels, double>& values) {
  if (values.empty()) return;
  prometheus::MetricFamily family{name, help, prometheus::MetricType::Gauge, {}};
  for (const auto& [labels, value] : values) {
    prometheus::ClientMetric metric;
    for (const auto& [label, label_value] : labels) metric.label.push_back({label, label_value});
    metric.gauge.value = value;
    family.metric.push_back(std::move(metric));
  }
  families->push_back(std::move(family));
}

// The memory the watched models hold on their devices, read at each scrape through the models'
// own accessors, so that answering a scrape opens no device (a CUDA context of its own would cost
// the memory it reports).
class DeviceMemoryCollector : public prometheus::Collectable {
 public:
  void watch(const std::shared_ptr<const moe::ClipModel>& encoder) {
    std::lock_guard<std::mutex> lock(mu_);
    encoders_.insert(encoder);
  }
  void watch(const std::shared_ptr<moe::ExpertExecutor>& experts) {
    std::lock_guard<std::mutex> lock(mu_);
    executors_.insert(experts);
  }
  std::shared_ptr<void> hold(const char* holder, const std::string& device, uint64_t bytes) {
    auto held = std::make_shared<Held>(Held{holder, device, bytes});
    std::lock_guard<std::mutex> lock(mu_);
    held_.insert(held);
    return held;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    // The live models, taken under the lock and read after it: a model whose last user lets go
    // meanwhile is freed here, outside the lock.
    const auto encoders = live(encoders_);
    const auto executors = live(executors_);
    const auto held = live(held_);
    std::map<prometheus::Labels, double> bytes, free_bytes, capacity_bytes;
    for (const auto& encoder : encoders) {
      const std::string device = encoder->device();
      bytes[{{"device", device}, {"holder", "encoder"}}] += static_cast<double>(encoder->weight_bytes());
      try {
        const moe::kernels::MemoryInfo info = encoder->memory_info();
        free_bytes[{{"device", device}}] = static_cast<double>(info.free_bytes);
        capacity_bytes[{{"device", device}}] = static_cast<double>(info.total_bytes);
      } catch (const std::exception& e) {  // a device that cannot answer (after a CUDA fault) has no series
        GST_DEBUG("%s: no memory info: %s", device.c_str(), e.what());
      }
    }
    for (const auto& executor : executors)
      for (const moe::ExpertDeviceStats& d : executor->stats())
        bytes[{{"device", d.device}, {"holder", "experts"}}] +=
            static_cast<double>(d.slots) * static_cast<double>(d.slot_bytes);
    for (const auto& h : held) bytes[{{"device", h->device}, {"holder", h->holder}}] += static_cast<double>(h->bytes);

    std::vector<prometheus::MetricFamily> families;
    add_gauge_family(&families, "gstmoe_device_memory_bytes",
                     "Memory the elements' models hold on each device (device cpu: host memory), by holder: encoder "
                     "(moe-encode's CLIP weights), experts (the expert executor's cache slots), index (ann-query's "
                     "vectors)",
                     bytes);
    add_gauge_family(&families, "gstmoe_device_memory_free_bytes",
                     "Free memory of the devices the encoders run on, as their backend reports it (cpu: the host's "
                     "MemAvailable)",
                     free_bytes);
    add_gauge_family(&families, "gstmoe_device_memory_capacity_bytes",
                     "Total memory of the devices the encoders run on (cpu: the host's MemTotal)", capacity_bytes);
    return families;
  }

 private:
  struct Held {
    std::string holder;
    std::string device;
    uint64_t bytes;
  };
  template <typename T>
  using WeakSet = std::set<std::weak_ptr<T>, std::owner_less<std::weak_ptr<T>>>;

  // The members of `watched` still alive; forgets the others.
  template <typename T>
  std::vector<std::shared_ptr<T>> live(WeakSet<T>& watched) const {
    std::vector<std::shared_ptr<T>> alive;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = watched.begin(); it != watched.end();) {
      if (std::shared_ptr<T> p = it->lock()) {
        alive.push_back(std::move(p));
        ++it;
      } else {
        it = watched.erase(it);
      }
    }
    return alive;
  }

  mutable std::mutex mu_;  // guards the sets
  mutable WeakSet<const moe::ClipModel> encoders_;
  mutable WeakSet<moe::ExpertExecutor> executors_;
  mutable WeakSet<Held> held_;
};

struct PluginMetrics {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<ProcessCollector> process = std::make_shared<ProcessCollector>();
  std::shared_ptr<DeviceMemoryCollector> device_memory = std::make_shared<DeviceMemoryCollector>();

  Family<Counter>& requests =
      prometheus::BuildCounter()
          .Name("gstmoe_requests_total")
          .Help(
              "Requests answered by ann-query, by outcome: result (a result document), "
              "error (an error document), indexed (a row added to an index being built), update (a catalog "
              "update applied: an update document)")
          .Register(*registry);
  Counter& results = requests.Add({{"outcome", "result"}});
  Counter& errors = requests.Add({{"outcome", "error"}});
  Counter& indexed = requests.Add({{"outcome", "indexed"}});
  Counter& updates = requests.Add({{"outcome", "update"}});
  Family<Counter>& request_errors =
      prometheus::BuildCounter()
          .Name("gstmoe_request_errors_total")
          .Help(
              "Error documents, by the element that failed the request (stage: zmq-query, moe-encode, ann-query, "
              "...) and its error code (docs/zmq-schema.md: a closed set)")
          .Register(*registry);
  Histogram& request_duration =
      prometheus::BuildHistogram()
          .Name("gstmoe_request_duration_seconds")
          .Help("From a request's arrival (zmq-query, appsrc) to its result document leaving ann-query")
          .Register(*registry)
          .Add({}, latency_buckets());
  Family<Histogram>& stage_duration =
      prometheus::BuildHistogram()
          .Name("gstmoe_stage_duration_seconds")
          .Help(
              "Time a request spent in each stage: queue (waiting for its batch), encode, route, expert, search "
              "(its batch's time in the element), publish (zmq-publish sending its document)")
          .Register(*registry);
  Family<Counter>& busy = prometheus::BuildCounter()
                              .Name("gstmoe_stage_busy_seconds_total")
                              .Help(
                                  "Time each element spent computing batches (each batch once): encode, route, "
                                  "expert, search; divided by the elapsed time, the stage's utilisation")
                              .Register(*registry);
  Histogram& batch_requests = prometheus::BuildHistogram()
                                  .Name("gstmoe_batch_requests")
                                  .Help("Requests per batch taken by moe-encode")
                                  .Register(*registry)
                                  .Add({}, batch_buckets());
  Family<Counter>& expert_rows = prometheus::BuildCounter()
                                     .Name("gstmoe_expert_rows_total")
                                     .Help("Rows routed to each expert by moe-route (expert: 0 .. experts-1)")
                                     .Register(*registry);
  Family<Gauge>& expert_share = prometheus::BuildGauge()
                                    .Name("gstmoe_expert_load_share")
                                    .Help("Each expert's share of the rows routed since the process started (0..1)")
                                    .Register(*registry);
  Counter& overflowed = prometheus::BuildCounter()
                            .Name("gstmoe_route_overflowed_total")
                            .Help("Routing slots that found their expert at capacity (rerouted or dropped)")
                            .Register(*registry)
                            .Add({});
  Counter& dropped = prometheus::BuildCounter()
                         .Name("gstmoe_route_dropped_total")
                         .Help("Routing slots dropped at capacity (moe-route overflow=drop, or no expert with room)")
                         .Register(*registry)
                         .Add({});
  Family<Counter>& cache_hits = prometheus::BuildCounter()
                                    .Name("gstmoe_expert_cache_hits_total")
                                    .Help("Experts a batch needed that already had a slot on the device")
                                    .Register(*registry);
  Family<Counter>& cache_misses = prometheus::BuildCounter()
                                      .Name("gstmoe_expert_cache_misses_total")
                                      .Help("Experts a batch needed that had to be copied to the device")
                                      .Register(*registry);
  Family<Counter>& cache_copied = prometheus::BuildCounter()
                                      .Name("gstmoe_expert_cache_copied_bytes_total")
                                      .Help("Bytes of expert weights copied to the device (preloads and misses)")
                                      .Register(*registry);
  Family<Counter>& cache_evictions = prometheus::BuildCounter()
                                         .Name("gstmoe_expert_cache_evictions_total")
                                         .Help("Experts dropped from the device cache to make room")
                                         .Register(*registry);
  Family<Counter>& cache_wait = prometheus::BuildCounter()
                                    .Name("gstmoe_expert_cache_wait_seconds_total")
                                    .Help(
                                        "Host time spent waiting for expert copies still running (the full stall on "
                                        "the CPU backend; on CUDA the compute stream waits instead, so ~0)")
                                    .Register(*registry);
  Family<Gauge>& cache_resident = prometheus::BuildGauge()
                                      .Name("gstmoe_expert_cache_resident_bytes")
                                      .Help("Device memory held by the experts resident in the cache")
                                      .Register(*registry);
  Counter& published = prometheus::BuildCounter()
                           .Name("gstmoe_publish_messages_total")
                           .Help("Messages zmq-publish handed to its socket")
                           .Register(*registry)
                           .Add({});
  Counter& published_bytes = prometheus::BuildCounter()
                                 .Name("gstmoe_publish_bytes_total")
                                 .Help("Bytes of the messages zmq-publish handed to its socket")
                                 .Register(*registry)
                                 .Add({});
  Counter& publish_dropped =
      prometheus::BuildCounter()
          .Name("gstmoe_publish_dropped_total")
          .Help("Messages the PUB socket refused (a subscriber's full queue is not seen here: it shows as a seq gap)")
          .Register(*registry)
          .Add({});
  Family<Counter>& cost = prometheus::BuildCounter()
                              .Name("gstmoe_request_cost_seconds_total")
                              .Help(
                                  "The answered requests' shares of what their batches cost (docs/operations.md): "
                                  "compute (stage times split over each batch's rows, less "
                                  "copy), copy (host time waiting for expert copies, split likewise), wait (each "
                                  "request's own queueing time)")
                              .Register(*registry);
  Counter& cost_compute = cost.Add({{"kind", "compute"}});
  Counter& cost_copy = cost.Add({{"kind", "copy"}});
  Counter& cost_wait = cost.Add({{"kind", "wait"}});
  Counter& expert_loaded_bytes =
      prometheus::BuildCounter()
          .Name("gstmoe_request_expert_loaded_bytes_total")
          .Help("Expert weight bytes the answered requests' batches had copied to devices, split over their rows")
          .Register(*registry)
          .Add({});
  Counter& query_cache_hits = prometheus::BuildCounter()
                                  .Name("gstmoe_query_cache_hits_total")
                                  .Help("moe-encode requests whose embedding came from its query cache")
                                  .Register(*registry)
                                  .Add({});
  Counter& query_cache_misses = prometheus::BuildCounter()
                                    .Name("gstmoe_query_cache_misses_total")
                                    .Help("moe-encode requests looked up in its query cache and encoded")
                                    .Register(*registry)
                                    .Add({});
  Counter& query_cache_evictions = prometheus::BuildCounter()
                                       .Name("gstmoe_query_cache_evictions_total")
                                       .Help("Query cache entries dropped to stay within cache-bytes")
                                       .Register(*registry)
                                       .Add({});
  Gauge& query_cache_bytes = prometheus::BuildGauge()
                                 .Name("gstmoe_query_cache_bytes")
                                 .Help("Memory held by the entries of the moe-encode query caches")
                                 .Register(*registry)
                                 .Add({});
  Family<Histogram>& model_load = prometheus::BuildHistogram()
                                      .Name("gstmoe_model_load_seconds")
                                      .Help(
                                          "Model loads: encoder (moe-encode), adapter (moe-route, moe-expert), "
                                          "experts (moe-expert's executor placing them on its devices)")
                                      .Register(*registry);

  std::mutex lock;                    // guards what follows
  std::vector<double> expert_totals;  // rows per expert since the process started
  // The cache counters each live executor had at its last report, per device.
  std::map<std::weak_ptr<moe::ExpertExecutor>, std::vector<moe::CacheStats>, std::owner_less<>> cache_seen;
  std::map<std::string, std::weak_ptr<Server>> servers;  // by address

  std::vector<Histogram*> stage_histograms;  // of kStages, in order

  PluginMetrics() {
    for (const char* stage : kStages)
      stage_histograms.push_back(&stage_duration.Add({{"stage", stage}}, latency_buckets()));
    for (const char* model : {"encoder", "adapter", "experts"}) model_load.Add({{"model", model}}, load_buckets());
  }

  // The histogram of `stage`; Family::Add builds a histogram before it finds the existing one.
  Histogram& stage(const std::string& name) {
    for (size_t i = 0; i < stage_histograms.size(); ++i)
      if (name == kStages[i]) return *stage_histograms[i];
    return stage_duration.Add({{"stage", name}}, latency_buckets());
  }
};

// Created at the first report or server and never destroyed: streaming threads may still report
// while the process exits.
PluginMetrics& plugin_metrics() {
  static PluginMetrics* r = new PluginMetrics();
  return *r;
}

}  // namespace

// The /metrics endpoint: prometheus-cpp's own text exposition of the registry, over a minimal
// HTTP/1.1 server on one thread. Not prometheus-cpp's civetweb exposer: civetweb starts its
// threads with a 100 KB stack, which cannot hold the static TLS of the CUDA libraries the engine
// loads in a CUDA build (cuBLASLt alone has 92 KB), so it failed to start there. Scrapes are
// served one at a time; a request is read up to 8 KiB or 2 s (a slow client delays the next
// scrape by that much at most), and only GET /metrics (or /) is answered.
class Server {
 public:
  explicit Server(const std::string& address) {
    const size_t colon = address.rfind(':');
    std::string host = address.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (const int rc = getaddrinfo(host.c_str(), address.c_str() + colon + 1, &hints, &found); rc != 0)
      throw std::runtime_error(std::string("cannot resolve it: ") + gai_strerror(rc));
    std::string why;
    for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) {
        listen_fd_ = fd;
      } else {
        why = errno == EADDRINUSE      ? "the address is in use"
              : errno == EADDRNOTAVAIL ? "not an address of this machine"
                                       : std::strerror(errno);
        close(fd);
      }
    }
    freeaddrinfo(found);
    if (listen_fd_ < 0) throw std::runtime_error(why.empty() ? "no usable address" : why);
    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      close(listen_fd_);
      throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~Server() {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof one) < 0) {
    }  // the loop also wakes on its 1 s poll timeout
    thread_.join();
    close(listen_fd_);
    close(wake_fd_);
  }
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

 private:
  void loop() {
    for (;;) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      if (poll(fds, 2, 1000) < 0 && errno != EINTR) return;
      if (fds[1].revents != 0) return;
      if ((fds[0].revents & POLLIN) == 0) continue;
      const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      answer(conn);
      close(conn);
    }
  }

  static void answer(int conn) {
    constexpr size_t kMaxRequest = 8192;
    std::string request;
    char buf[1024];
    while (request.size() < kMaxRequest && request.find("\r\n\r\n") == std::string::npos) {
      pollfd p{conn, POLLIN, 0};
      if (poll(&p, 1, 2000) <= 0) return;
      const ssize_t n = recv(conn, buf, sizeof buf, 0);
      if (n <= 0) return;
      request.append(buf, static_cast<size_t>(n));
    }
    const bool get = request.rfind("GET ", 0) == 0;
    const std::string target = get ? request.substr(4, request.find(' ', 4) - 4) : "";
    std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", body;
    if (!get) {
      status = "405 Method Not Allowed";
      body = "only GET /metrics\n";
    } else if (target != "/metrics" && target != "/") {
      status = "404 Not Found";
      body = "the metrics are at /metrics\n";
    } else {
      std::vector<prometheus::MetricFamily> families = plugin_metrics().registry->Collect();
      for (prometheus::MetricFamily& f : plugin_metrics().process->Collect()) families.push_back(std::move(f));
      for (prometheus::MetricFamily& f : plugin_metrics().device_memory->Collect()) families.push_back(std::move(f));
      body = prometheus::TextSerializer().Serialize(families);
    }
    const std::string response = "HTTP/1.1 " + status + "\r\nContent-Type: " + type +
                                 "\r\nContent-Length: " + std::to_string(body.size()) +
                                 "\r\nConnection: close\r\n\r\n" + body;
    for (size_t sent = 0; sent < response.size();) {
      const ssize_t n = send(conn, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
};

void install_address_property(GObjectClass* klass, guint prop_id) {
  g_object_class_install_property(
      klass, prop_id,
      g_param_spec_string("metrics-address", "Metrics address",
                          "HOST:PORT on which to serve the plugin's Prometheus metrics at /metrics while the element "
                          "runs (e.g. 127.0.0.1:9464; 0.0.0.0:9464 serves every interface). Empty: no server. "
                          "Elements naming the same address share one server; the figures are the whole process's "
                          "(docs/metrics.md)",
                          "", gstmoe::kPropertyMutableReady));
}

bool serve(GstElement* element, const std::string& address, std::shared_ptr<Server>* server) {
  init_debug_category();
  server->reset();
  if (address.empty()) return true;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    GST_ELEMENT_ERROR(element, RESOURCE, SETTINGS,
                      ("metrics-address '%s' is not HOST:PORT (e.g. 127.0.0.1:9464)", address.c_str()), (nullptr));
    return false;
  }
  PluginMetrics& r = plugin_metrics();
  std::lock_guard<std::mutex> lock(r.lock);
  std::weak_ptr<Server>& shared = r.servers[address];
  *server = shared.lock();
  if (*server) return true;
  try {
    *server = std::make_shared<Server>(address);
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(element, RESOURCE, OPEN_READ_WRITE,
                      ("Cannot serve metrics on metrics-address '%s': %s", address.c_str(), e.what()), (nullptr));
    return false;
  }
  shared = *server;
  GST_INFO_OBJECT(element, "serving Prometheus metrics at http://%s/metrics", address.c_str());
  return true;
}

void count_result(const RequestRecord& request, int64_t now_mono_us) {
  PluginMetrics& r = plugin_metrics();
  r.results.Increment();
  for (const auto& [stage, ms] : request.timings_ms) r.stage(stage).Observe(ms * kSecondsPerMs);
  if (request.arrival_mono_us != 0)
    r.request_duration.Observe(elapsed_ms(request.arrival_mono_us, now_mono_us) * kSecondsPerMs);
  RequestCost cost;
  if (!request_cost(request, &cost)) return;
  r.cost_compute.Increment(cost.compute_ms * kSecondsPerMs);
  r.cost_copy.Increment(cost.copy_ms * kSecondsPerMs);
  r.cost_wait.Increment(cost.wait_ms * kSecondsPerMs);
  r.expert_loaded_bytes.Increment(cost.expert_bytes);
}

void count_error(const FailedRequest& failed) {
  PluginMetrics& r = plugin_metrics();
  r.errors.Increment();
  r.request_errors.Add({{"stage", failed.stage}, {"code", failed.code}}).Increment();
}

void count_indexed(size_t rows) { plugin_metrics().indexed.Increment(static_cast<double>(rows)); }

void count_update() { plugin_metrics().updates.Increment(); }

void count_search(double search_ms) {
  plugin_metrics().busy.Add({{"stage", "search"}}).Increment(search_ms * kSecondsPerMs);
}

void count_encoded_batch(size_t requests, double encode_ms) {
  PluginMetrics& r = plugin_metrics();
  r.batch_requests.Observe(static_cast<double>(requests));
  r.busy.Add({{"stage", "encode"}}).Increment(encode_ms * kSecondsPerMs);
}

void count_query_cache(const moe::QueryCacheStats& before, const moe::QueryCacheStats& after) {
  PluginMetrics& r = plugin_metrics();
  r.query_cache_hits.Increment(static_cast<double>(after.hits - before.hits));
  r.query_cache_misses.Increment(static_cast<double>(after.misses - before.misses));
  r.query_cache_evictions.Increment(static_cast<double>(after.evictions - before.evictions));
  r.query_cache_bytes.Increment(static_cast<double>(after.bytes) - static_cast<double>(before.bytes));
}

void count_routing(const moe::Routing& routing, const moe::ExpertLoad& before, const moe::ExpertLoad& after,
                   double route_ms) {
  PluginMetrics& r = plugin_metrics();
  r.busy.Add({{"stage", "route"}}).Increment(route_ms * kSecondsPerMs);
  int64_t overflowed = 0;
  for (size_t e = 0; e < after.overflowed.size(); ++e)
    overflowed += after.overflowed[e] - (e < before.overflowed.size() ? before.overflowed[e] : 0);
  r.overflowed.Increment(static_cast<double>(overflowed));
  r.dropped.Increment(static_cast<double>(after.dropped - before.dropped));

  std::vector<double> rows;
  for (const int32_t e : routing.expert_ids) {
    if (e == moe::Routing::kUnusedSlot) continue;
    if (static_cast<size_t>(e) >= rows.size()) rows.resize(static_cast<size_t>(e) + 1, 0.0);
    rows[static_cast<size_t>(e)] += 1.0;
  }
  std::lock_guard<std::mutex> lock(r.lock);
  if (r.expert_totals.size() < rows.size()) r.expert_totals.resize(rows.size(), 0.0);
  double total = 0;
  for (size_t e = 0; e < r.expert_totals.size(); ++e) {
    if (e < rows.size() && rows[e] > 0) {
      r.expert_rows.Add({{"expert", std::to_string(e)}}).Increment(rows[e]);
      r.expert_totals[e] += rows[e];
    }
    total += r.expert_totals[e];
  }
  if (total == 0) return;
  for (size_t e = 0; e < r.expert_totals.size(); ++e)
    r.expert_share.Add({{"expert", std::to_string(e)}}).Set(r.expert_totals[e] / total);
}

void count_expert_run(const std::shared_ptr<moe::ExpertExecutor>& executor, double expert_ms) {
  PluginMetrics& r = plugin_metrics();
  r.busy.Add({{"stage", "expert"}}).Increment(expert_ms * kSecondsPerMs);
  if (!executor) return;
  const std::vector<moe::ExpertDeviceStats> devices = executor->stats();
  std::lock_guard<std::mutex> lock(r.lock);
  for (auto it = r.cache_seen.begin(); it != r.cache_seen.end();)  // executors of stopped elements
    it = it->first.expired() ? r.cache_seen.erase(it) : std::next(it);
  std::vector<moe::CacheStats>& seen = r.cache_seen[executor];
  seen.resize(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    const moe::CacheStats& now = devices[i].cache;
    const moe::CacheStats& was = seen[i];
    const prometheus::Labels device{{"device", devices[i].device}};
    r.cache_hits.Add(device).Increment(static_cast<double>(now.hits - was.hits));
    r.cache_misses.Add(device).Increment(static_cast<double>(now.misses - was.misses));
    r.cache_copied.Add(device).Increment(static_cast<double>(now.bytes_copied - was.bytes_copied));
    r.cache_evictions.Add(device).Increment(static_cast<double>(now.evictions - was.evictions));
    r.cache_wait.Add(device).Increment(static_cast<double>(now.exposed_wait_ns - was.exposed_wait_ns) * 1e-9);
    r.cache_resident.Add(device).Set(static_cast<double>(now.resident) * static_cast<double>(devices[i].slot_bytes));
    seen[i] = now;
  }
}

void count_publish(bool accepted, size_t bytes, double publish_ms) {
  PluginMetrics& r = plugin_metrics();
  r.stage("publish").Observe(publish_ms * kSecondsPerMs);
  if (!accepted) {
    r.publish_dropped.Increment();
    return;
  }
  r.published.Increment();
  r.published_bytes.Increment(static_cast<double>(bytes));
}

ExpertCopyTotals expert_copy_totals(const moe::ExpertExecutor& executor) {
  ExpertCopyTotals totals;
  for (const moe::ExpertDeviceStats& d : executor.stats()) {
    totals.bytes += d.cache.bytes_copied;
    totals.wait_ns += d.cache.exposed_wait_ns;
  }
  return totals;
}

void observe_model_load(const char* model, int64_t started_mono_us) {
  const double seconds = elapsed_ms(started_mono_us, g_get_monotonic_time()) * kSecondsPerMs;
  plugin_metrics().model_load.Add({{"model", model}}, load_buckets()).Observe(seconds);
}

void watch_device_memory(const std::shared_ptr<const moe::ClipModel>& encoder) {
  plugin_metrics().device_memory->watch(encoder);
}

void watch_device_memory(const std::shared_ptr<moe::ExpertExecutor>& experts) {
  plugin_metrics().device_memory->watch(experts);
}

std::shared_ptr<void> hold_device_memory(const char* holder, const std::string& device, uint64_t bytes) {
  return plugin_metrics().device_memory->hold(holder, device, bytes);
}

}  // namespace gstmoe::metrics
