/**
 * SECTION:element-moe-expert
 * @title: moe-expert
 * @see_also: moe-route, ann-query
 *
 * moe-expert runs the experts of a Mixture-of-Experts adapter that moe-route chose for every row
 * of an embedding batch and replaces each embedding, in place, with the adapter's output
 * normalize(x + sum of the weighted expert outputs): exactly moe::MoeAdapter::apply_experts(x,
 * routing), with the routing read back from the request meta. It needs moe-route upstream, and
 * refuses routing made by an adapter whose experts do not match its own.
 *
 * `device` and `precision` say where the experts run: device=cpu with fp32 weights (or a 4-bit
 * adapter's int4) is the engine's CPU path; CUDA devices, or fp16/bf16 on the CPU, run an expert
 * executor that keeps a cache of experts in `cache-budget` of each device's free memory, spreads
 * the experts over several devices and, every `rebalance-interval` batches, places them again by
 * load. There moe-route preloads each batch's experts as soon as it has routed the batch.
 *
 * The `stats` property counts the rows and batches since the element started, the rows each
 * expert ran on, the batches moe-route preloaded, and each device's cache counters; expert-bytes
 * is the size of the adapter's expert weights (a 4-bit adapter's are ~7× smaller than f32), and
 * each device's slot-bytes and resident-bytes what its cache holds.
 *
 * precision=int4 runs a 4-bit adapter (models/default/adapter-int4, made by tools/moe-quantize.py;
 * docs/model-formats.md) as stored: its packed codes and scales are what the CPU path reads and
 * what the expert executor copies to a device and keeps in its cache (~7× more experts per
 * budget than f32). An adapter that is not 4-bit is refused with precision=int4. A 4-bit adapter
 * with fp32, fp16 or bf16 also runs as stored (no widening), which the log says once at start.
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 zmq-query ! queue ! moe-encode model=models/default/clip \
 *     ! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter \
 *     ! ann-query index=build/demo/catalog.faiss ! zmq-publish
 * ]| The search service, with the experts on the CPU.
 * |[
 * gst-launch-1.0 zmq-query ! queue ! moe-encode model=models/default/clip \
 *     ! moe-route model=models/default/adapter-int4 \
 *     ! moe-expert model=models/default/adapter-int4 precision=int4 \
 *     ! ann-query index=build/demo/catalog.faiss ! zmq-publish
 * ]| The 4-bit adapter's experts, packed, on the CPU (EXPERT_DEVICE=cuda:0 runs them on a GPU).
 * |[
 * gst-launch-1.0 zmq-query ! queue ! moe-encode model=models/default/clip device=auto \
 *     ! moe-route model=models/default/adapter ! queue \
 *     ! moe-expert model=models/default/adapter device=all precision=fp16 \
 *     ! ann-query index=build/demo/catalog.faiss ! zmq-publish
 * ]| The experts in fp16, spread over every CUDA device; the queue lets moe-route preload the
 * next batch's experts while moe-expert computes.
 */

/* Why the routing travels in the meta rather than being recomputed: the router and the experts
 * are separate elements (see moe-route), and the result documents report the routing that was
 * actually used. moe-expert therefore refuses rows without routing, and routing made by an
 * adapter whose experts do not match its own: it asks the moe-route upstream for its adapter
 * when the caps arrive, and checks every expert id of every batch.
 *
 * The embeddings are replaced in place (same shape); the tensor data is rewritten, the meta
 * gains the "expert" timing.
 *
 * The expert executor (every setting but device=cpu with fp32, or with a 4-bit adapter): the
 * device list is checked when the element starts, but the executor is built when it is first
 * needed (moe-route's executor query, or the caps): elements start from the sink up, so only then
 * have the encoders upstream loaded their weights, and the budget is taken from the memory they
 * left free. The moe-route upstream finds the executor through a custom query and prefetches each
 * batch's experts on its own streaming thread as soon as it has routed the batch; the handle
 * arrives in the meta, this element's streaming thread computes with it and drops it, which
 * unpins the batch's experts. A batch without a handle (no moe-route, or its prefetch failed) is
 * prefetched here.
 */
#include "gstmoeexpert.h"

#include <cstring>
#include <mutex>
#include <utility>

#include "gstmoeadapter.h"
#include "gstmoemetrics.h"
#include "moe/compute.h"
#include "moe/expert_executor.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_expert_debug);
#define GST_CAT_DEFAULT gst_moe_expert_debug

enum {
  PROP_0,
  PROP_MODEL,
  PROP_DEVICE,
  PROP_PRECISION,
  PROP_CACHE_BUDGET,
  PROP_REBALANCE_INTERVAL,
  PROP_STATS,
};

#define DEFAULT_DEVICE "cpu"
#define DEFAULT_PRECISION GST_MOE_PRECISION_FP32
#define DEFAULT_CACHE_BUDGET 0.85
#define MIN_CACHE_BUDGET 0.05
#define DEFAULT_REBALANCE_INTERVAL 256
#define MAX_REBALANCE_INTERVAL G_MAXINT  // ExpertExecutorOptions::rebalance_interval is an int

namespace {

// The expert executor of one run, built the first time it is needed (see the top comment) by
// whichever thread asks first: moe-route's (the executor query) or this element's (the caps).
// Shared by the running state and the queries in flight, so that stop() can drop the state while
// a query from moe-route's thread still holds this.
struct LazyExecutor {
  // What building it needs; `adapter` is dropped by stop().
  std::string device;
  moe::ExpertExecutorOptions options;
  std::shared_ptr<const moe::MoeAdapter> adapter;

  std::mutex build_mu;  // serialises the build and stop()'s close; guards the fields below
  bool closed = false;  // stop() ran: nothing is built any more
  bool failed = false;  // its error was posted: not tried again
  // The executor once built, until stop(); written under build_mu and the element's object
  // lock, read under either (queries and `stats` read it from other threads).
  std::shared_ptr<moe::ExpertExecutor> built;
};

// What one run works with: created by start(), destroyed by stop().
struct ExpertState {
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  std::shared_ptr<LazyExecutor> executor;  // nullptr on the plain CPU path
  int width = 0;                           // negotiated tensor width; 0 before caps
  std::string route_dir;                   // the adapter of the moe-route upstream, when one answered
  // What made the rows, for the meta's adapter_fingerprint: this adapter's fingerprint, followed
  // by "+<router's>" when a moe-route with other weights chose the experts (both shape the rows).
  std::string rows_fingerprint;
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
        "pinned", G_TYPE_UINT64, static_cast<guint64>(c.pinned), "slot-bytes", G_TYPE_UINT64,
        static_cast<guint64>(d.slot_bytes), "resident-bytes", G_TYPE_UINT64, static_cast<guint64>(c.resident_bytes),
        nullptr);
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

  // Properties, under the object lock; read when the element starts.
  gchar* model;  // nullptr: unset
  gchar* device;
  GstMoePrecision precision;  // any value of GST_TYPE_MOE_EXPERT_PRECISION
  gdouble cache_budget;
  guint rebalance_interval;

  // Behind `stats`: reset at start, kept after stop. `stats` has its own lock; batches_prefetched
  // (batches that arrived with moe-route's prefetch of the executor) is under the object lock.
  gstmoe::adapter::Stats* stats;
  guint64 batches_prefetched;

  // Between start() and stop(), nullptr otherwise. The streaming thread uses it without a lock;
  // the executor query and `stats`, which may come from any thread, read it under the object lock.
  ExpertState* state;
};

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
      g_free(self->model);
      self->model = dir && *dir ? g_strdup(dir) : nullptr;
      break;
    }
    case PROP_DEVICE: {
      const gchar* device = g_value_get_string(value);
      g_free(self->device);
      self->device = g_strdup(device ? device : DEFAULT_DEVICE);
      break;
    }
    case PROP_PRECISION:
      self->precision = static_cast<GstMoePrecision>(g_value_get_enum(value));
      break;
    case PROP_CACHE_BUDGET:
      self->cache_budget = g_value_get_double(value);
      break;
    case PROP_REBALANCE_INTERVAL:
      self->rebalance_interval = g_value_get_uint(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

// The `stats` structure; called with the object lock held.
static GstStructure* gst_moe_expert_stats(GstMoeExpert* self) {
  GstStructure* s = self->stats->to_structure("moe-expert-stats", "expert-rows");
  gst_structure_set(s, "batches-prefetched", G_TYPE_UINT64, self->batches_prefetched, "expert-bytes", G_TYPE_UINT64,
                    self->state ? static_cast<guint64>(self->state->adapter->layer().expert_bytes()) : guint64{0},
                    nullptr);
  const std::shared_ptr<moe::ExpertExecutor> executor =
      self->state && self->state->executor ? self->state->executor->built : nullptr;
  gst_structure_set(s, "placement-changes", G_TYPE_UINT64, executor ? executor->placement_changes() : guint64{0},
                    nullptr);
  GValue devices = G_VALUE_INIT;
  if (executor) {
    devices = device_stats(*executor);
  } else {
    gst_value_array_init(&devices, 0);
  }
  gst_structure_take_value(s, "devices", &devices);
  return s;
}

static void gst_moe_expert_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeExpert* self = GST_MOE_EXPERT(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL:
      g_value_set_string(value, self->model);
      break;
    case PROP_DEVICE:
      g_value_set_string(value, self->device);
      break;
    case PROP_PRECISION:
      g_value_set_enum(value, self->precision);
      break;
    case PROP_CACHE_BUDGET:
      g_value_set_double(value, self->cache_budget);
      break;
    case PROP_REBALANCE_INTERVAL:
      g_value_set_uint(value, self->rebalance_interval);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, gst_moe_expert_stats(self));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

// `e` is the moe::Error of the device check or of building the executor: it names the device
// and the reason.
static void post_executor_error(GstMoeExpert* self, const std::string& adapter, const std::exception& e) {
  GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                    ("cannot run the experts of the MoE adapter '%s': %s", adapter.c_str(), e.what()), (nullptr));
}

static gboolean gst_moe_expert_start(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  GST_OBJECT_LOCK(self);
  const std::string dir = self->model ? self->model : "";
  std::string device = self->device;
  const GstMoePrecision precision = self->precision;
  const double cache_budget = self->cache_budget;
  const guint rebalance_interval = self->rebalance_interval;
  GST_OBJECT_UNLOCK(self);
  if (device == "auto") {  // every CUDA device, else the CPU (the plain CPU path in fp32 or int4)
    std::string reason;
    if (moe::resolve_device("auto", &reason) == "cpu") {
      GST_INFO_OBJECT(self, "device 'auto': %s; the experts run on the CPU", reason.c_str());
      device = "cpu";
    }
  }

  const int64_t load_start = g_get_monotonic_time();
  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  gstmoe::metrics::observe_model_load("adapter", load_start);
  const moe::MoeConfig& cfg = adapter->layer().config();
  // 4-bit experts run as stored, whatever precision says (widening them would give up their
  // saving); int4 asks for exactly that and so refuses other adapters.
  const bool four_bit = adapter->layer().precision() == moe::kernels::WeightType::Q4;
  if (precision == GST_MOE_PRECISION_INT4 && !four_bit) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                      ("precision=int4 runs a 4-bit adapter's experts as stored, and the experts of the MoE adapter "
                       "'%s' are %s: make a 4-bit adapter with tools/moe-quantize.py (docs/model-formats.md), or "
                       "choose fp32, fp16 or bf16",
                       dir.c_str(), moe::kernels::weight_type_name(adapter->layer().precision())),
                      (nullptr));
    return FALSE;
  }
  if (four_bit && precision != GST_MOE_PRECISION_INT4)
    GST_INFO_OBJECT(self, "the MoE adapter '%s' holds 4-bit experts: they run as stored (int4), not in %s", dir.c_str(),
                    gstmoe::precision_nick(precision));
  const GstMoePrecision runs_in = four_bit ? GST_MOE_PRECISION_INT4 : precision;

  std::shared_ptr<LazyExecutor> executor;
  // The engine's CPU path on device=cpu in fp32, and for 4-bit experts (it reads them packed).
  if (device != "cpu" || (runs_in != GST_MOE_PRECISION_FP32 && runs_in != GST_MOE_PRECISION_INT4)) {
    try {
      moe::ExpertExecutor::check_devices(device);
    } catch (const std::exception& e) {
      post_executor_error(self, dir, e);
      return FALSE;
    }
    executor = std::make_shared<LazyExecutor>();
    executor->device = device;
    executor->options.precision = gstmoe::weight_type(runs_in);
    executor->options.budget_fraction = cache_budget;
    executor->options.rebalance_interval = static_cast<int>(rebalance_interval);
    executor->adapter = adapter;
  }

  auto* state = new ExpertState();
  state->adapter = std::move(adapter);
  state->adapter_dir = dir;
  state->adapter_name = gstmoe::adapter::name_of(dir);
  state->executor = std::move(executor);
  state->rows_fingerprint = state->adapter->fingerprint();
  self->stats->reset(cfg.num_experts);
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts in %s, on %s", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, gstmoe::precision_nick(runs_in), device.c_str());
  GST_OBJECT_LOCK(self);
  self->batches_prefetched = 0;
  self->state = state;
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_moe_expert_stop(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  GST_OBJECT_LOCK(self);
  ExpertState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  if (!state) return TRUE;
  if (LazyExecutor* executor = state->executor.get()) {
    std::lock_guard<std::mutex> lock(executor->build_mu);  // waits for a build in progress
    executor->closed = true;
    executor->adapter.reset();
    // Buffers still in flight keep what their prefetch handles need; the rest goes now.
    GST_OBJECT_LOCK(self);
    executor->built.reset();
    GST_OBJECT_UNLOCK(self);
  }
  delete state;  // the cache frees the adapter when its last user lets go
  return TRUE;
}

// Builds the run's executor the first time it is needed (see the top comment); false after
// posting an error, or once one was posted.
static bool gst_moe_expert_build_executor(GstMoeExpert* self, LazyExecutor& executor) {
  std::lock_guard<std::mutex> lock(executor.build_mu);
  if (executor.failed) return false;
  if (executor.closed || executor.built) return true;
  std::shared_ptr<moe::ExpertExecutor> built;
  const int64_t build_start = g_get_monotonic_time();
  try {
    built = std::make_shared<moe::ExpertExecutor>(executor.adapter->layer(), executor.device, executor.options);
  } catch (const std::exception& e) {
    post_executor_error(self, executor.adapter->layer().config().source, e);
    executor.failed = true;
    return false;
  }
  gstmoe::metrics::observe_model_load("experts", build_start);
  gstmoe::metrics::watch_device_memory(built);
  for (const moe::ExpertDeviceStats& d : built->stats())
    GST_INFO_OBJECT(self, "%s: %zu experts, cache of %d slots (%zu bytes)", d.device.c_str(), d.experts.size(), d.slots,
                    d.budget_bytes);
  GST_OBJECT_LOCK(self);
  executor.built = std::move(built);
  GST_OBJECT_UNLOCK(self);
  return true;
}

static gboolean gst_moe_expert_query(GstBaseTransform* trans, GstPadDirection direction, GstQuery* query) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  if (direction == GST_PAD_SINK && gstmoe::adapter::is_executor_query(query)) {
    GST_OBJECT_LOCK(self);
    const std::shared_ptr<LazyExecutor> lazy = self->state ? self->state->executor : nullptr;
    GST_OBJECT_UNLOCK(self);
    // The batches' meta is read here: a moe-expert further downstream must not be asked.
    if (!lazy || !gst_moe_expert_build_executor(self, *lazy)) return FALSE;
    GST_OBJECT_LOCK(self);
    const std::shared_ptr<moe::ExpertExecutor> executor = lazy->built;
    GST_OBJECT_UNLOCK(self);
    if (!executor) return FALSE;  // stopped meanwhile
    gstmoe::adapter::answer_executor_query(query, executor);
    return TRUE;
  }
  return GST_BASE_TRANSFORM_CLASS(parent_class)->query(trans, direction, query);
}

static gboolean gst_moe_expert_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps*) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->state;
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *st->adapter, st->adapter_dir);
  if (st->width == 0) return FALSE;
  if (st->executor && !gst_moe_expert_build_executor(self, *st->executor)) return FALSE;

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
  const ExpertState* st = self->state;
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
      GST_ELEMENT_ERROR(
          self, STREAM, FORMAT,
          ("row %zu was routed to %zu experts but row 0 to %zu: one batch needs one top-k", i, r.experts.size(), top_k),
          (nullptr));
      return false;
    }
    for (int32_t e : r.experts) {
      if (e != moe::Routing::kUnusedSlot && (e < 0 || e >= num_experts)) {
        const std::string source = !st->route_dir.empty()     ? "the MoE adapter '" + st->route_dir + "' of moe-route"
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
  ExpertState* st = self->state;
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
  // The weights name the embedding space; how rows were routed (top-k, routing policies) is a
  // serving choice within it, so an index built with one routing answers queries routed another way.
  records.adapter_fingerprint = st->rows_fingerprint;
  if (rows == 0) return GST_FLOW_OK;  // only failed requests: they travel on untouched
  GST_OBJECT_LOCK(self);
  const std::shared_ptr<moe::ExpertExecutor> executor = st->executor ? st->executor->built : nullptr;
  GST_OBJECT_UNLOCK(self);
  const bool prefetched = executor && executor->owns(prefetch);  // else run() prefetches itself

  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READWRITE)) {
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("cannot map the tensor buffer for writing"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x = moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), st->width}, map.data, nullptr);
  moe::Tensor y;
  const gstmoe::metrics::ExpertCopyTotals copies_before =
      executor ? gstmoe::metrics::expert_copy_totals(*executor) : gstmoe::metrics::ExpertCopyTotals{};
  const int64_t t0 = g_get_monotonic_time();
  try {
    y = executor ? executor->run(x, routing, prefetched ? prefetch : nullptr) : st->adapter->apply_experts(x, routing);
  } catch (const std::exception& e) {
    gst_buffer_unmap(buf, &map);
    GST_ELEMENT_ERROR(self, LIBRARY, FAILED, ("running the experts on %zu rows failed: %s", rows, e.what()), (nullptr));
    return GST_FLOW_ERROR;
  }
  const double ms = gstmoe::elapsed_ms(t0, g_get_monotonic_time());
  std::memcpy(map.data, y.raw_data(), y.nbytes());
  gst_buffer_unmap(buf, &map);

  // The batch's copy figures for the requests' cost (gstmoeresult.h): the host waits of this run, and
  // the copies of a batch that was not prefetched upstream, which run() started itself.
  const gstmoe::metrics::ExpertCopyTotals copies =
      executor ? gstmoe::metrics::expert_copy_totals(*executor) : gstmoe::metrics::ExpertCopyTotals{};
  for (gstmoe::RequestRecord& r : records.rows) {
    r.timings_ms.emplace_back("expert", ms);
    r.batch_copy_wait_ms += static_cast<double>(copies.wait_ns - copies_before.wait_ns) / 1e6;
    if (!prefetched) r.batch_expert_bytes += copies.bytes - copies_before.bytes;
  }
  self->stats->add_batch(rows, routing);
  gstmoe::metrics::count_expert_run(executor, ms);
  if (prefetched) {
    GST_OBJECT_LOCK(self);
    ++self->batches_prefetched;
    GST_OBJECT_UNLOCK(self);
  }
  GST_LOG_OBJECT(self, "ran the experts of %zu rows in %.3f ms%s", rows, ms, prefetched ? " (preloaded)" : "");
  return GST_FLOW_OK;
}

static void gst_moe_expert_finalize(GObject* object) {
  GstMoeExpert* self = GST_MOE_EXPERT(object);
  g_free(self->model);
  g_free(self->device);
  delete self->stats;
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
      g_param_spec_string(
          "device", "Device",
          "Where the experts run: \"cpu\", \"cuda:N\", a list \"cuda:0,cuda:1\" (experts placed over "
          "the devices by free memory and, after rebalance-interval batches, by load; rows sent to a device "
          "holding their expert) or \"all\" "
          "(every CUDA device), or \"auto\" (every CUDA device when there is one, else cpu; the "
          "choice and its reason are logged). A device that cannot be used fails the start, saying "
          "why; other "
          "failures to set the experts up there (e.g. out of memory) stop the pipeline at its first "
          "caps, saying why",
          DEFAULT_DEVICE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_PRECISION,
      g_param_spec_enum("precision", "Precision",
                        "Precision of the expert weights on the device (accumulation is always fp32). On device=cpu, "
                        "fp16/bf16 run through the same expert executor as a GPU (weights rounded, copied into a "
                        "cache of host memory); fp32 is the plain CPU path. int4 runs a 4-bit adapter's experts "
                        "as stored, packed (the plain CPU path on device=cpu; on GPUs copied and cached packed, "
                        "~7x more experts per cache budget) and refuses an adapter that is not 4-bit "
                        "(tools/moe-quantize.py makes one). A 4-bit adapter always runs as stored: with fp32, fp16 "
                        "or bf16 too, as the log says at start",
                        GST_TYPE_MOE_EXPERT_PRECISION, DEFAULT_PRECISION, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_CACHE_BUDGET,
      g_param_spec_double("cache-budget", "Expert cache budget",
                          "Fraction of each device's free memory that holds experts, measured when the first "
                          "batch's caps arrive (after the encoders upstream loaded their weights); when the experts do "
                          "not fit, the least recently used are evicted and loaded again when routed to. Not used "
                          "by the plain CPU path (device=cpu with fp32 or a 4-bit adapter)",
                          MIN_CACHE_BUDGET, 1.0, DEFAULT_CACHE_BUDGET, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_REBALANCE_INTERVAL,
      g_param_spec_uint("rebalance-interval", "Rebalance interval",
                        "With several devices: every this many batches, place the experts again by the rows each "
                        "ran on during those batches, so that hot experts get replicas on other devices and their "
                        "rows are shared (see placement-changes in stats). 0: the placement made at start, by free "
                        "memory only, stays",
                        0, MAX_REBALANCE_INTERVAL, DEFAULT_REBALANCE_INTERVAL, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "Since the element started: rows and batches processed, expert-rows (per expert, how many rows it ran on), "
          "expert-share, expert-rate (rows/s, 10 s time constant), expert-peak (most rows in one batch), "
          "batches-prefetched (batches whose experts moe-route preloaded), expert-bytes (the adapter's routed expert "
          "weights as loaded: packed codes, scales and zero points for 4-bit experts; 0 when stopped), "
          "placement-changes (how often "
          "rebalance-interval moved experts), and devices: per device of the expert executor (none on the plain CPU "
          "path) the experts it serves, its cache slots, slot-bytes (one expert as cached: packed for 4-bit "
          "experts) and budget-bytes, and the cache counters hits, misses, "
          "bytes-copied, evictions, copies-hidden (copies finished before the experts were needed), copies-exposed "
          "(compute had to wait), exposed-wait-ms (host time spent waiting for copies), resident, resident-bytes "
          "(the bytes of the experts it holds now) and pinned"));

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
  gst_type_mark_as_plugin_api(GST_TYPE_MOE_EXPERT_PRECISION, static_cast<GstPluginAPIFlags>(0));

  trans_class->start = GST_DEBUG_FUNCPTR(gst_moe_expert_start);
  trans_class->stop = GST_DEBUG_FUNCPTR(gst_moe_expert_stop);
  trans_class->set_caps = GST_DEBUG_FUNCPTR(gst_moe_expert_set_caps);
  trans_class->query = GST_DEBUG_FUNCPTR(gst_moe_expert_query);
  trans_class->transform_ip = GST_DEBUG_FUNCPTR(gst_moe_expert_transform_ip);
}

static void gst_moe_expert_init(GstMoeExpert* self) {
  self->model = nullptr;
  self->device = g_strdup(DEFAULT_DEVICE);
  self->precision = DEFAULT_PRECISION;
  self->cache_budget = DEFAULT_CACHE_BUDGET;
  self->rebalance_interval = DEFAULT_REBALANCE_INTERVAL;
  self->stats = new gstmoe::adapter::Stats();
  // In place: the output has the input's shape, so the adapted rows overwrite the input rows.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
