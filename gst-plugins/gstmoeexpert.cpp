/* moe-expert: runs the experts moe-route chose and writes the adapted, L2-normalised
 * embeddings: exactly moe::MoeAdapter::apply_experts(x, routing), with the routing read back
 * from the request meta (rows[i].experts / expert_weights).
 *
 * Why the routing travels in the meta rather than being recomputed: the router and the experts
 * are separate elements (see moe-route), and the result documents report the routing that was
 * actually used. moe-expert therefore refuses rows without routing, and routing made by an
 * adapter whose experts do not match its own: it asks the moe-route upstream for its adapter
 * when the caps arrive, and checks every expert id of every batch.
 *
 * The embeddings are replaced in place (same shape); the tensor data is rewritten, the meta
 * gains the "expert" timing.
 *
 * Where the experts run ('device', 'precision'): device=cpu with fp32 weights is the engine's CPU
 * path (MoeAdapter::apply_experts). Every other setting - CUDA devices, or reduced precision on
 * the CPU - runs on a moe::ExpertExecutor: per device a cache of experts in 'cache-budget' of its
 * free memory, filled asynchronously. The device list is checked when the element starts, but
 * the executor is built when it is first needed (moe-route's executor query, or the caps):
 * elements start from the sink up, so only then have the encoders upstream loaded their
 * weights, and the budget is taken from the memory they left free. The moe-route upstream
 * finds the executor through a custom query and prefetches each batch's experts on its own
 * streaming thread as soon as it has routed the batch; the handle arrives in the meta, this
 * element's streaming thread computes with it and drops it, which unpins the batch's experts.
 * A batch without a handle (no moe-route, or its prefetch failed) is prefetched here.
 */
#include "gstmoeexpert.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <utility>

#include "gstmoeadapter.h"
#include "moe/compute.h"
#include "moe/expert_executor.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_expert_debug);
#define GST_CAT_DEFAULT gst_moe_expert_debug

#define DEFAULT_DEVICE "cpu"
#define DEFAULT_PRECISION GST_MOE_PRECISION_FP32
#define DEFAULT_CACHE_BUDGET 0.85
#define DEFAULT_REBALANCE_INTERVAL 256

namespace {

// C++ state of the element (GObject does not run constructors: allocated in init).
struct ExpertState {
  // Properties, under the object lock; read when the element starts.
  std::string model;
  std::string device = DEFAULT_DEVICE;
  GstMoePrecision precision = DEFAULT_PRECISION;
  double cache_budget = DEFAULT_CACHE_BUDGET;
  guint rebalance_interval = DEFAULT_REBALANCE_INTERVAL;

  // The executor (null on the CPU path, and until first needed): cleared by stop(), under the
  // object lock because the executor query and the 'stats' property read it from other threads.
  std::shared_ptr<moe::ExpertExecutor> executor;
  // What building it needs, set by start() and cleared by stop() under build_mu, which also
  // serialises the build (moe-route's thread and this element's may both ask first).
  // executor_device is empty on the CPU path and after stop().
  std::mutex build_mu;
  std::string executor_device;
  moe::ExpertExecutorOptions executor_options;
  std::shared_ptr<const moe::MoeAdapter> executor_adapter;
  bool executor_failed = false;  // its error was posted; not tried again until the next start

  // The running configuration: set by start(), cleared by stop(); between the two only the
  // streaming thread uses it.
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  int width = 0;
  std::string route_dir;  // the adapter of the moe-route upstream, when one answered
  // What made the rows, for the meta's adapter_fingerprint: this adapter's fingerprint, followed
  // by "+<router's>" when a moe-route with other weights chose the experts (both shape the rows).
  std::string rows_fingerprint;

  gstmoe::adapter::Stats stats;  // expert-rows: per expert, how many rows it ran on
  std::atomic<guint64> batches_prefetched{0};  // arrived with moe-route's prefetch of this executor
};

// One structure per device of the executor: what it serves and its cache counters.
GValue device_stats(const moe::ExpertExecutor& executor) {
  GValue array = G_VALUE_INIT;
  gst_value_array_init(&array, 0);
  for (const moe::ExpertDeviceStats& d : executor.stats()) {
    const moe::CacheStats& c = d.cache;
    GstStructure* s = gst_structure_new(
        "moe-expert-device", "device", G_TYPE_STRING, d.device.c_str(), "experts", G_TYPE_UINT,
        static_cast<guint>(d.experts.size()), "slots", G_TYPE_INT, d.slots, "budget-bytes", G_TYPE_UINT64,
        static_cast<guint64>(d.budget_bytes), "hits", G_TYPE_UINT64, static_cast<guint64>(c.hits), "misses",
        G_TYPE_UINT64, static_cast<guint64>(c.misses), "bytes-copied", G_TYPE_UINT64,
        static_cast<guint64>(c.bytes_copied), "evictions", G_TYPE_UINT64, static_cast<guint64>(c.evictions),
        "copies-hidden", G_TYPE_UINT64, static_cast<guint64>(c.copies_hidden), "copies-exposed", G_TYPE_UINT64,
        static_cast<guint64>(c.copies_exposed), "exposed-wait-ms", G_TYPE_DOUBLE,
        static_cast<double>(c.exposed_wait_ns) / 1e6, "resident", G_TYPE_UINT64, static_cast<guint64>(c.resident),
        "pinned", G_TYPE_UINT64, static_cast<guint64>(c.pinned), nullptr);
    GValue item = G_VALUE_INIT;
    g_value_init(&item, GST_TYPE_STRUCTURE);
    g_value_take_boxed(&item, s);
    gst_value_array_append_and_take_value(&array, &item);
  }
  return array;
}

}  // namespace

struct _GstMoeExpert {
  GstBaseTransform parent;
  ExpertState* st;
};

enum { PROP_0, PROP_MODEL, PROP_DEVICE, PROP_PRECISION, PROP_CACHE_BUDGET, PROP_REBALANCE_INTERVAL, PROP_STATS };

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));

#define gst_moe_expert_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeExpert, gst_moe_expert, GST_TYPE_BASE_TRANSFORM,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_expert_debug, "moe-expert", 0, "MoE adapter experts"));
GST_ELEMENT_REGISTER_DEFINE(moe_expert, "moe-expert", GST_RANK_NONE, GST_TYPE_MOE_EXPERT);

static void gst_moe_expert_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeExpert* self = GST_MOE_EXPERT(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL: {
      const gchar* dir = g_value_get_string(value);
      self->st->model = dir ? dir : "";
      break;
    }
    case PROP_DEVICE: {
      const gchar* device = g_value_get_string(value);
      self->st->device = device ? device : DEFAULT_DEVICE;
      break;
    }
    case PROP_PRECISION:
      self->st->precision = static_cast<GstMoePrecision>(g_value_get_enum(value));
      break;
    case PROP_CACHE_BUDGET:
      self->st->cache_budget = g_value_get_double(value);
      break;
    case PROP_REBALANCE_INTERVAL:
      self->st->rebalance_interval = g_value_get_uint(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_moe_expert_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeExpert* self = GST_MOE_EXPERT(object);
  switch (prop_id) {
    case PROP_MODEL:
      GST_OBJECT_LOCK(self);
      g_value_set_string(value, self->st->model.empty() ? nullptr : self->st->model.c_str());
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_DEVICE:
      GST_OBJECT_LOCK(self);
      g_value_set_string(value, self->st->device.c_str());
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_PRECISION:
      GST_OBJECT_LOCK(self);
      g_value_set_enum(value, self->st->precision);
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_CACHE_BUDGET:
      GST_OBJECT_LOCK(self);
      g_value_set_double(value, self->st->cache_budget);
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_REBALANCE_INTERVAL:
      GST_OBJECT_LOCK(self);
      g_value_set_uint(value, self->st->rebalance_interval);
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_STATS: {
      GstStructure* s = self->st->stats.to_structure("moe-expert-stats", "expert-rows");
      gst_structure_set(s, "batches-prefetched", G_TYPE_UINT64, self->st->batches_prefetched.load(), nullptr);
      GST_OBJECT_LOCK(self);
      std::shared_ptr<moe::ExpertExecutor> executor = self->st->executor;
      GST_OBJECT_UNLOCK(self);
      GValue devices = G_VALUE_INIT;
      gst_structure_set(s, "placement-changes", G_TYPE_UINT64, executor ? executor->placement_changes() : guint64{0},
                        nullptr);
      if (executor) {
        devices = device_stats(*executor);
      } else {
        gst_value_array_init(&devices, 0);
      }
      gst_structure_take_value(s, "devices", &devices);
      g_value_take_boxed(value, s);
      break;
    }
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
}

// `e` is the moe::Error of the device check or of building the executor: it names the device
// and the reason.
static void post_executor_error(GstMoeExpert* self, const std::string& adapter, const std::exception& e) {
  GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("cannot run the experts of the MoE adapter '%s': %s", adapter.c_str(),
                                               e.what()),
                    (nullptr));
}

static gboolean gst_moe_expert_start(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->st;
  GST_OBJECT_LOCK(self);
  const std::string dir = st->model;
  std::string device = st->device;
  const GstMoePrecision precision = st->precision;
  const double cache_budget = st->cache_budget;
  const guint rebalance_interval = st->rebalance_interval;
  GST_OBJECT_UNLOCK(self);
  if (device == "auto") {  // every CUDA device, else the CPU (the plain CPU path when fp32)
    std::string reason;
    if (moe::resolve_device("auto", &reason) == "cpu") {
      GST_INFO_OBJECT(self, "device 'auto': %s; the experts run on the CPU", reason.c_str());
      device = "cpu";
    }
  }

  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  const moe::MoeConfig& cfg = adapter->layer().config();

  if (device != "cpu" || precision != GST_MOE_PRECISION_FP32) {  // else: the engine's CPU path
    try {
      moe::ExpertExecutor::check_devices(device);
    } catch (const std::exception& e) {
      post_executor_error(self, dir, e);
      return FALSE;
    }
    std::lock_guard<std::mutex> lock(st->build_mu);
    st->executor_device = device;
    st->executor_options = moe::ExpertExecutorOptions();
    st->executor_options.precision = gstmoe::weight_type(precision);
    st->executor_options.budget_fraction = cache_budget;
    st->executor_options.rebalance_interval = static_cast<int>(rebalance_interval);
    st->executor_adapter = adapter;
    st->executor_failed = false;
  }

  st->adapter = std::move(adapter);
  st->adapter_dir = dir;
  st->adapter_name = gstmoe::adapter::name_of(dir);
  st->width = 0;
  st->rows_fingerprint = st->adapter->fingerprint();
  st->route_dir.clear();
  st->stats.reset(cfg.num_experts);
  st->batches_prefetched = 0;
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts, on %s", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, device.c_str());
  return TRUE;
}

static gboolean gst_moe_expert_stop(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  {
    std::lock_guard<std::mutex> lock(self->st->build_mu);  // no build after this
    self->st->executor_device.clear();
    self->st->executor_adapter.reset();
  }
  self->st->adapter.reset();  // the cache frees the adapter when its last user lets go
  GST_OBJECT_LOCK(self);
  // Buffers still in flight keep what their prefetch handles need; the rest goes now.
  self->st->executor.reset();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

// Builds the executor the first time it is needed after a start (see the top comment); false
// after posting an error, or once one was posted.
static bool gst_moe_expert_build_executor(GstMoeExpert* self) {
  ExpertState* st = self->st;
  std::lock_guard<std::mutex> lock(st->build_mu);
  if (st->executor_failed) return false;
  GST_OBJECT_LOCK(self);
  const bool needed = !st->executor_device.empty() && !st->executor;
  GST_OBJECT_UNLOCK(self);
  if (!needed) return true;
  std::shared_ptr<moe::ExpertExecutor> executor;
  try {
    executor = std::make_shared<moe::ExpertExecutor>(st->executor_adapter->layer(), st->executor_device,
                                                     st->executor_options);
  } catch (const std::exception& e) {
    post_executor_error(self, st->executor_adapter->layer().config().source, e);
    st->executor_failed = true;
    return false;
  }
  for (const moe::ExpertDeviceStats& d : executor->stats())
    GST_INFO_OBJECT(self, "%s: %zu experts, cache of %d slots (%zu bytes)", d.device.c_str(), d.experts.size(),
                    d.slots, d.budget_bytes);
  GST_OBJECT_LOCK(self);
  st->executor = std::move(executor);
  GST_OBJECT_UNLOCK(self);
  return true;
}

static gboolean gst_moe_expert_query(GstBaseTransform* trans, GstPadDirection direction, GstQuery* query) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  if (direction == GST_PAD_SINK && gstmoe::adapter::is_executor_query(query)) {
    if (!gst_moe_expert_build_executor(self)) return FALSE;
    GST_OBJECT_LOCK(self);
    std::shared_ptr<moe::ExpertExecutor> executor = self->st->executor;
    GST_OBJECT_UNLOCK(self);
    // The batches' meta is read here: a moe-expert further downstream must not be asked.
    if (!executor) return FALSE;
    gstmoe::adapter::answer_executor_query(query, executor);
    return TRUE;
  }
  return GST_BASE_TRANSFORM_CLASS(parent_class)->query(trans, direction, query);
}

static gboolean gst_moe_expert_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps*) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->st;
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *st->adapter, st->adapter_dir);
  if (st->width == 0) return FALSE;
  if (!gst_moe_expert_build_executor(self)) return FALSE;

  // Routing from another adapter directory is fine when it addresses the same experts.
  gstmoe::adapter::RouteInfo route;
  st->rows_fingerprint = st->adapter->fingerprint();
  if (!gstmoe::adapter::query_route(GST_BASE_TRANSFORM_SINK_PAD(trans), &route)) {
    GST_DEBUG_OBJECT(self, "no moe-route upstream answered: expert ids are checked per batch only");
    st->route_dir.clear();
    return TRUE;
  }
  st->route_dir = route.dir;
  if (!route.fingerprint.empty() && route.fingerprint != st->rows_fingerprint)
    st->rows_fingerprint += "+" + route.fingerprint;
  const moe::MoeConfig& cfg = st->adapter->layer().config();
  if (route.hidden_size != cfg.hidden_size || route.num_experts != cfg.num_experts) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                      ("moe-route uses the MoE adapter '%s' (hidden_size %d, %d experts) but moe-expert uses '%s' "
                       "(hidden_size %d, %d experts): the routing of one adapter can drive the experts of another "
                       "only when both match",
                       route.dir.c_str(), route.hidden_size, route.num_experts, st->adapter_dir.c_str(),
                       cfg.hidden_size, cfg.num_experts),
                      (nullptr));
    return FALSE;
  }
  if (route.dir != st->adapter_dir)
    GST_INFO_OBJECT(self, "routing from adapter %s drives the experts of %s (same hidden_size and experts)",
                    route.dir.c_str(), st->adapter_dir.c_str());
  return TRUE;
}

// The routing the meta rows carry, as the engine's Routing; false after posting an error.
static bool gst_moe_expert_routing(GstMoeExpert* self, const gstmoe::BatchRecords& records, moe::Routing* routing) {
  ExpertState* st = self->st;
  const int num_experts = st->adapter->layer().config().num_experts;
  const size_t top_k = records.rows.front().experts.size();
  routing->rows = static_cast<int64_t>(records.rows.size());
  routing->top_k = static_cast<int>(top_k);
  routing->expert_ids.reserve(records.rows.size() * top_k);
  routing->weights.reserve(records.rows.size() * top_k);
  for (size_t i = 0; i < records.rows.size(); ++i) {
    const gstmoe::RequestRecord& r = records.rows[i];
    if (r.experts.empty()) {
      GST_ELEMENT_ERROR(self, CORE, FAILED, ("no routing in the meta of row %zu: place moe-route before moe-expert", i),
                        (nullptr));
      return false;
    }
    if (r.expert_weights.size() != r.experts.size()) {
      GST_ELEMENT_ERROR(self, STREAM, FORMAT,
                        ("row %zu of the meta names %zu experts but %zu expert weights", i, r.experts.size(),
                         r.expert_weights.size()),
                        (nullptr));
      return false;
    }
    if (r.experts.size() != top_k) {
      GST_ELEMENT_ERROR(self, STREAM, FORMAT,
                        ("row %zu was routed to %zu experts but row 0 to %zu: one batch needs one top-k", i,
                         r.experts.size(), top_k),
                        (nullptr));
      return false;
    }
    for (int32_t e : r.experts) {
      if (e < 0 || e >= num_experts) {
        const std::string source = !st->route_dir.empty()      ? "the MoE adapter '" + st->route_dir + "' of moe-route"
                                   : !records.adapter.empty() ? "an adapter named '" + records.adapter + "'"
                                                              : "an unknown router";
        GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                          ("row %zu (request '%s') is routed to expert %d, but the MoE adapter '%s' of moe-expert has "
                           "experts 0..%d only; the routing came from %s",
                           i, r.id.c_str(), e, st->adapter_dir.c_str(), num_experts - 1, source.c_str()),
                          (nullptr));
        return false;
      }
    }
    routing->expert_ids.insert(routing->expert_ids.end(), r.experts.begin(), r.experts.end());
    routing->weights.insert(routing->weights.end(), r.expert_weights.begin(), r.expert_weights.end());
  }
  return true;
}

static GstFlowReturn gst_moe_expert_transform_ip(GstBaseTransform* trans, GstBuffer* buf) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->st;
  size_t rows = 0;
  if (!gstmoe::adapter::buffer_rows(GST_ELEMENT(self), buf, st->width, &rows)) return GST_FLOW_ERROR;

  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  if (!meta) {
    if (rows == 0) return GST_FLOW_OK;  // nothing to run, nothing to answer
    GST_ELEMENT_ERROR(self, CORE, FAILED,
                      ("no routing for the %zu rows of a buffer without request meta: place moe-route before "
                       "moe-expert",
                       rows),
                      (nullptr));
    return GST_FLOW_ERROR;
  }
  if (!gstmoe::adapter::check_meta_rows(GST_ELEMENT(self), meta, rows)) return GST_FLOW_ERROR;
  gstmoe::BatchRecords& records = *meta->records;
  // The batch ends here whatever happens: its pins go when the last holder of the handle does.
  const std::shared_ptr<void> prefetch = std::move(records.expert_prefetch);
  moe::Routing routing;
  if (rows > 0 && !gst_moe_expert_routing(self, records, &routing)) return GST_FLOW_ERROR;
  records.adapter = st->adapter_name;  // the experts that made the embeddings name the adapter
  records.adapter_fingerprint = st->rows_fingerprint;
  // Routing to another number of experts (moe-route top-k) makes other vectors from the same weights.
  if (rows > 0 && routing.top_k != st->adapter->layer().config().top_k)
    records.adapter_fingerprint += "/top" + std::to_string(routing.top_k);
  if (rows == 0) return GST_FLOW_OK;   // only failed requests: they travel on untouched
  GST_OBJECT_LOCK(self);
  const std::shared_ptr<moe::ExpertExecutor> executor = st->executor;
  GST_OBJECT_UNLOCK(self);
  const bool prefetched = executor && executor->owns(prefetch);  // else run() prefetches itself

  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READWRITE)) {
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("cannot map the tensor buffer for writing"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x = moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), st->width}, map.data, nullptr);
  moe::Tensor y;
  const int64_t t0 = g_get_monotonic_time();
  try {
    y = executor ? executor->run(x, routing, prefetched ? prefetch : nullptr) : st->adapter->apply_experts(x, routing);
  } catch (const std::exception& e) {
    gst_buffer_unmap(buf, &map);
    GST_ELEMENT_ERROR(self, LIBRARY, FAILED, ("running the experts on %zu rows failed: %s", rows, e.what()),
                      (nullptr));
    return GST_FLOW_ERROR;
  }
  const double ms = gstmoe::elapsed_ms(t0, g_get_monotonic_time());
  std::memcpy(map.data, y.raw_data(), y.nbytes());
  gst_buffer_unmap(buf, &map);

  for (gstmoe::RequestRecord& r : records.rows) r.timings_ms.emplace_back("expert", ms);
  st->stats.add_batch(rows, routing.expert_ids);
  if (prefetched) ++st->batches_prefetched;
  GST_LOG_OBJECT(self, "ran the experts of %zu rows in %.3f ms%s", rows, ms, prefetched ? " (preloaded)" : "");
  return GST_FLOW_OK;
}

static void gst_moe_expert_finalize(GObject* object) {
  delete GST_MOE_EXPERT(object)->st;
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_expert_class_init(GstMoeExpertClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseTransformClass* trans_class = GST_BASE_TRANSFORM_CLASS(klass);

  gobject_class->set_property = gst_moe_expert_set_property;
  gobject_class->get_property = gst_moe_expert_get_property;
  gobject_class->finalize = gst_moe_expert_finalize;

  g_object_class_install_property(gobject_class, PROP_MODEL, gstmoe::adapter::model_param_spec());
  g_object_class_install_property(
      gobject_class, PROP_DEVICE,
      g_param_spec_string("device", "Device",
                          "Where the experts run: \"cpu\", \"cuda:N\", a list \"cuda:0,cuda:1\" (experts placed over "
                          "the devices by free memory and, after rebalance-interval batches, by load; rows sent to a device "
                          "holding their expert) or \"all\" "
                          "(every CUDA device), or \"auto\" (every CUDA device when there is one, else cpu; the "
                          "choice and its reason are logged). A device that cannot be used fails the start, saying "
                          "why; other "
                          "failures to set the experts up there (e.g. out of memory) stop the pipeline at its first "
                          "caps, saying why",
                          DEFAULT_DEVICE,
                          static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_PRECISION,
      g_param_spec_enum("precision", "Precision",
                        "Precision of the expert weights on the device (accumulation is always fp32). On device=cpu, "
                        "fp16/bf16 run through the same expert executor as a GPU (weights rounded, copied into a "
                        "cache of host memory); fp32 is the plain CPU path",
                        GST_TYPE_MOE_PRECISION, DEFAULT_PRECISION,
                        static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_CACHE_BUDGET,
      g_param_spec_double("cache-budget", "Expert cache budget",
                          "Fraction of each device's free memory that holds experts, measured when the first "
                          "batch's caps arrive (after the encoders upstream loaded their weights); when the experts do "
                          "not fit, the least recently used are evicted and loaded again when routed to. Not used "
                          "by the plain CPU path (device=cpu precision=fp32)",
                          0.05, 1.0, DEFAULT_CACHE_BUDGET,
                          static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_REBALANCE_INTERVAL,
      g_param_spec_uint("rebalance-interval", "Rebalance interval",
                        "With several devices: every this many batches, place the experts again by the rows each "
                        "ran on during those batches, so that hot experts get replicas on other devices and their "
                        "rows are shared (see placement-changes in stats). 0: the placement made at start, by free "
                        "memory only, stays",
                        0, G_MAXINT, DEFAULT_REBALANCE_INTERVAL,
                        static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      g_param_spec_boxed("stats", "Statistics",
                         "Since the element started: rows and batches processed, expert-rows (per expert, how many "
                         "rows it ran on), batches-prefetched (batches whose experts moe-route preloaded), "
                         "placement-changes (how often rebalance-interval moved experts), and "
                         "devices: per device of the expert executor (none on the plain CPU path) the experts it "
                         "serves, its cache slots and budget-bytes, and the cache counters hits, misses, "
                         "bytes-copied, evictions, copies-hidden (copies finished before the experts were needed), "
                         "copies-exposed (compute had to wait), exposed-wait-ms (host time spent waiting for "
                         "copies), resident and pinned",
                         GST_TYPE_STRUCTURE, static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS)));

  gst_element_class_set_static_metadata(
      element_class, "MoE experts", "Filter/Tensor",
      "Runs the experts of a Mixture-of-Experts adapter that moe-route chose for every row of an embedding batch "
      "and replaces each embedding with normalize(x + sum of the weighted expert outputs). Needs moe-route "
      "upstream; on GPU devices moe-route preloads each batch's experts as soon as it has routed it. Example: "
      "gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! moe-encode "
      "model=models/default/clip ! moe-route model=models/default/adapter ! queue ! moe-expert "
      "model=models/default/adapter device=cuda:0 precision=fp16 ! ann-query index=catalog.faiss "
      "! zmq-publish endpoint=tcp://127.0.0.1:5556",
      "gst-moe developers");
  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_type_mark_as_plugin_api(GST_TYPE_MOE_PRECISION, static_cast<GstPluginAPIFlags>(0));

  trans_class->start = GST_DEBUG_FUNCPTR(gst_moe_expert_start);
  trans_class->stop = GST_DEBUG_FUNCPTR(gst_moe_expert_stop);
  trans_class->set_caps = GST_DEBUG_FUNCPTR(gst_moe_expert_set_caps);
  trans_class->query = GST_DEBUG_FUNCPTR(gst_moe_expert_query);
  trans_class->transform_ip = GST_DEBUG_FUNCPTR(gst_moe_expert_transform_ip);
}

static void gst_moe_expert_init(GstMoeExpert* self) {
  self->st = new ExpertState();
  // In place: the output has the input's shape, so the adapted rows overwrite the input rows.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
