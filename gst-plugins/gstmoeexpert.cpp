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
 * Setting `model` while playing swaps the adapter without stopping (docs/architecture.md, "Hot
 * swap"): the new one loads in the background (message moe-adapter-loaded), then moe-expert holds
 * both and runs every batch with the experts of the adapter whose router routed it, so requests
 * already routed finish with the adapter they started with; once a batch ran on the new adapter,
 * the old one goes (message moe-adapter-swap). Swap moe-expert first, then moe-route.
 *
 * The `stats` property counts the rows and batches since the element started, the rows each
 * expert ran on, the batches moe-route preloaded, and each device's cache counters; expert-bytes
 * is the size of the adapter's expert weights (a 4-bit adapter's are ~7× smaller than f32), and
 * each device's slot-bytes and resident-bytes what its cache holds; fingerprint names the adapter
 * in use, adapters how many it holds (2 during a swap), swaps how many it swapped in.
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
 *
 * Hot swap: the executor is per adapter. During a swap each held adapter has its own (the new one
 * built on the loading thread), moe-route's query names the fingerprint of the adapter that
 * routed the batch and gets the executor that will run it, and a handle from another executor
 * (a batch that crossed the switch) is ignored: run() then prefetches itself. The meta's
 * router_fingerprint, set by moe-route per batch, picks the adapter; rows from a router this
 * element does not hold run on the newest adapter and say so in their fingerprint ("+<router's>").
 */
#include "gstmoeexpert.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "gstmoeadapter.h"
#include "gstmoemetrics.h"
#include "moe/compute.h"
#include "moe/error.h"
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

// The expert executor of one adapter, built the first time it is needed (see the top comment) by
// whichever thread asks first: moe-route's (the executor query) or this element's (the caps); a
// hot swap's is built on its loading thread.
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

// One adapter whose experts this element runs: the one `model` names and, during a hot swap, the
// ones before it, which still run the batches their own routers routed.
struct ExpertRun {
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string dir;
  std::string name;
  std::shared_ptr<LazyExecutor> executor;  // nullptr on the plain CPU path
};

// Where and how the experts run, as start() read the properties: the same for every adapter.
struct ExpertSettings {
  std::string device;  // "auto" resolved
  GstMoePrecision precision = GST_MOE_PRECISION_FP32;
  double cache_budget = 0.0;
  guint rebalance_interval = 0;
};

// What one run works with: created by start(), destroyed by stop().
struct ExpertState {
  // Under the object lock (moe-route's executor query reads them on its thread): the adapters held,
  // the newest (the one `model` names) last, and the one that ran the last batch (null before).
  // A batch runs on the newest one whose fingerprint is its router's, else on the newest; once a
  // batch ran on the newest, the others go (the pipeline is FIFO: no batch routed by them follows).
  std::vector<std::shared_ptr<ExpertRun>> runs;
  std::shared_ptr<ExpertRun> in_use;
  std::atomic<int> width{0};  // negotiated tensor width; 0 before caps (a swap's thread reads it)
  // The moe-route upstream when the caps came, when one answered (for messages).
  std::string route_dir;
  std::string route_fingerprint;
};

// The run for batches routed by the adapter with `router_fingerprint`; object lock held.
std::shared_ptr<ExpertRun> run_for(const ExpertState& st, const std::string& router_fingerprint) {
  for (auto it = st.runs.rbegin(); it != st.runs.rend(); ++it)
    if ((*it)->adapter->fingerprint() == router_fingerprint) return *it;
  return st.runs.back();
}

// What made the rows that `run` ran for a batch routed by `router_fingerprint`, for the meta's
// adapter_fingerprint: its adapter's fingerprint, followed by "+<router's>" when a router with other
// weights chose the experts (both shape the rows).
std::string rows_fingerprint(const ExpertRun& run, const std::string& router_fingerprint) {
  const std::string& own = run.adapter->fingerprint();
  return router_fingerprint.empty() || router_fingerprint == own ? own : own + "+" + router_fingerprint;
}

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

  // `model`, with its own lock: read when the element starts, swapped while it runs.
  gstmoe::adapter::HotSwap* swap;
  // The other properties, under the object lock; read when the element starts.
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
    case PROP_MODEL:
      self->swap->set_model(g_value_get_string(value));
      break;
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
  const ExpertState* st = self->state;
  const ExpertRun* run = !st ? nullptr : st->in_use ? st->in_use.get() : st->runs.back().get();
  gst_structure_set(s, "batches-prefetched", G_TYPE_UINT64, self->batches_prefetched, "expert-bytes", G_TYPE_UINT64,
                    run ? static_cast<guint64>(run->adapter->layer().expert_bytes()) : guint64{0}, "fingerprint",
                    G_TYPE_STRING, run ? run->adapter->fingerprint().c_str() : "", "adapters", G_TYPE_UINT,
                    st ? static_cast<guint>(st->runs.size()) : 0u, "swaps", G_TYPE_UINT64, self->swap->swaps(),
                    nullptr);
  const std::shared_ptr<moe::ExpertExecutor> executor = run && run->executor ? run->executor->built : nullptr;
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
      g_value_take_string(value, self->swap->dup_model());
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

// How the experts of `adapter` (in `dir`) run with `settings`: in `*runs_in` the precision (a
// 4-bit adapter's experts run as stored, whatever precision says: widening them would give up
// their saving), and the expert executor's options, or nothing for the engine's CPU path (device=cpu
// in fp32, and 4-bit experts, which it reads packed). Throws moe::Error for precision=int4 with an
// adapter that is not 4-bit.
static std::optional<moe::ExpertExecutorOptions> executor_options(const ExpertSettings& settings,
                                                                  const moe::MoeAdapter& adapter,
                                                                  const std::string& dir, GstMoePrecision* runs_in) {
  const bool four_bit = adapter.layer().precision() == moe::kernels::WeightType::Q4;
  if (settings.precision == GST_MOE_PRECISION_INT4 && !four_bit)
    throw moe::Error("precision=int4 runs a 4-bit adapter's experts as stored, and the experts of the MoE adapter '" +
                     dir + "' are " + moe::kernels::weight_type_name(adapter.layer().precision()) +
                     ": make a 4-bit adapter with tools/moe-quantize.py (docs/model-formats.md), or choose fp32, "
                     "fp16 or bf16");
  *runs_in = four_bit ? GST_MOE_PRECISION_INT4 : settings.precision;
  if (settings.device == "cpu" && (*runs_in == GST_MOE_PRECISION_FP32 || *runs_in == GST_MOE_PRECISION_INT4))
    return std::nullopt;
  moe::ExpertExecutorOptions options;
  options.precision = gstmoe::weight_type(*runs_in);
  options.budget_fraction = settings.cache_budget;
  options.rebalance_interval = static_cast<int>(settings.rebalance_interval);
  return options;
}

// Builds the executor of `executor` the first time it is needed (see the top comment); false
// after posting an error, or once one was posted.
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

// Closes the executor of a run that is dropped (stop, or the end of a swap). Buffers still in
// flight keep what their prefetch handles need; the rest goes now.
static void gst_moe_expert_close_executor(GstMoeExpert* self, LazyExecutor& executor) {
  std::lock_guard<std::mutex> lock(executor.build_mu);  // waits for a build in progress
  executor.closed = true;
  executor.adapter.reset();
  GST_OBJECT_LOCK(self);
  executor.built.reset();
  GST_OBJECT_UNLOCK(self);
}

// Takes the adapter a hot swap has loaded, if any, as the newest run (object lock not held: a
// refusal posts a warning). From the streaming thread and from moe-route's executor query.
static void gst_moe_expert_take_swap(GstMoeExpert* self) {
  std::unique_ptr<gstmoe::adapter::LoadedAdapter> loaded = self->swap->take();
  if (!loaded) return;
  std::string refusal, newest;
  GST_OBJECT_LOCK(self);
  if (ExpertState* st = self->state) {
    newest = st->runs.back()->dir;
    // The caps may have come after the loading thread looked at the width.
    refusal = gstmoe::adapter::width_refusal(*loaded->adapter, st->width.load());
    if (refusal.empty() && loaded->adapter != st->runs.back()->adapter) {
      auto run = std::make_shared<ExpertRun>();
      run->adapter = loaded->adapter;
      run->dir = loaded->dir;
      run->name = gstmoe::adapter::name_of(loaded->dir);
      if (loaded->executor) {  // built on the loading thread
        run->executor = std::make_shared<LazyExecutor>();
        run->executor->built = loaded->executor;
      }
      st->runs.push_back(std::move(run));
    }
  }
  GST_OBJECT_UNLOCK(self);
  if (!refusal.empty()) self->swap->refuse(*loaded, newest, refusal);
}

static gboolean gst_moe_expert_start(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  const std::string dir = self->swap->model();
  ExpertSettings settings;
  GST_OBJECT_LOCK(self);
  settings.device = self->device;
  settings.precision = self->precision;
  settings.cache_budget = self->cache_budget;
  settings.rebalance_interval = self->rebalance_interval;
  GST_OBJECT_UNLOCK(self);
  if (settings.device == "auto") {  // every CUDA device, else the CPU (the plain CPU path in fp32 or int4)
    std::string reason;
    if (moe::resolve_device("auto", &reason) == "cpu") {
      GST_INFO_OBJECT(self, "device 'auto': %s; the experts run on the CPU", reason.c_str());
      settings.device = "cpu";
    }
  }

  const int64_t load_start = g_get_monotonic_time();
  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  gstmoe::metrics::observe_model_load("adapter", load_start);
  const moe::MoeConfig& cfg = adapter->layer().config();
  GstMoePrecision runs_in = settings.precision;
  std::optional<moe::ExpertExecutorOptions> options;
  try {
    options = executor_options(settings, *adapter, dir, &runs_in);
  } catch (const moe::Error& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("%s", e.what()), (nullptr));
    return FALSE;
  }
  if (runs_in != settings.precision)
    GST_INFO_OBJECT(self, "the MoE adapter '%s' holds 4-bit experts: they run as stored (int4), not in %s", dir.c_str(),
                    gstmoe::precision_nick(settings.precision));

  auto run = std::make_shared<ExpertRun>();
  if (options) {
    try {
      moe::ExpertExecutor::check_devices(settings.device);
    } catch (const std::exception& e) {
      post_executor_error(self, dir, e);
      return FALSE;
    }
    run->executor = std::make_shared<LazyExecutor>();
    run->executor->device = settings.device;
    run->executor->options = *options;
    run->executor->adapter = adapter;
  }
  run->adapter = std::move(adapter);
  run->dir = dir;
  run->name = gstmoe::adapter::name_of(dir);
  auto* state = new ExpertState();
  state->runs.push_back(std::move(run));
  self->stats->reset(cfg.num_experts);
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts in %s, on %s", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, gstmoe::precision_nick(runs_in), settings.device.c_str());
  GST_OBJECT_LOCK(self);
  self->batches_prefetched = 0;
  self->state = state;
  GST_OBJECT_UNLOCK(self);
  // A hot swap checks the new adapter and, when its experts run on an executor, builds that on its
  // loading thread (the encoders are loaded by then): the switch costs the streaming thread nothing.
  self->swap->start(dir, [self, state, settings](gstmoe::adapter::LoadedAdapter& loaded) {
    const std::string refusal = gstmoe::adapter::width_refusal(*loaded.adapter, state->width.load());
    if (!refusal.empty()) throw moe::Error(refusal);
    GstMoePrecision precision = settings.precision;
    const std::optional<moe::ExpertExecutorOptions> options =
        executor_options(settings, *loaded.adapter, loaded.dir, &precision);
    if (!options) return;
    const int64_t build_start = g_get_monotonic_time();
    loaded.executor = std::make_shared<moe::ExpertExecutor>(loaded.adapter->layer(), settings.device, *options);
    gstmoe::metrics::observe_model_load("experts", build_start);
    gstmoe::metrics::watch_device_memory(loaded.executor);
    GST_INFO_OBJECT(self, "the experts of %s are ready on %s", loaded.dir.c_str(), settings.device.c_str());
  });
  return TRUE;
}

static gboolean gst_moe_expert_stop(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  self->swap->stop();  // before the state goes: a load in progress reads its width
  GST_OBJECT_LOCK(self);
  ExpertState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  if (!state) return TRUE;
  for (const std::shared_ptr<ExpertRun>& run : state->runs)
    if (run->executor) gst_moe_expert_close_executor(self, *run->executor);
  delete state;  // the cache frees the adapters when their last users let go
  return TRUE;
}

static gboolean gst_moe_expert_query(GstBaseTransform* trans, GstPadDirection direction, GstQuery* query) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  if (direction == GST_PAD_SINK && gstmoe::adapter::is_executor_query(query)) {
    // A swap loaded since the last batch serves the batch moe-route asks about if it routed it.
    gst_moe_expert_take_swap(self);
    GST_OBJECT_LOCK(self);
    const std::shared_ptr<LazyExecutor> lazy =
        self->state ? run_for(*self->state, gstmoe::adapter::executor_query_fingerprint(query))->executor : nullptr;
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
  GST_OBJECT_LOCK(self);
  const std::shared_ptr<ExpertRun> newest = st->runs.back();
  GST_OBJECT_UNLOCK(self);
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *newest->adapter, newest->dir);
  if (st->width == 0) return FALSE;
  if (newest->executor && !gst_moe_expert_build_executor(self, *newest->executor)) return FALSE;

  // Routing from another adapter directory is fine when it addresses the same experts.
  gstmoe::adapter::RouteInfo route;
  if (!gstmoe::adapter::query_route(GST_BASE_TRANSFORM_SINK_PAD(trans), &route)) {
    GST_DEBUG_OBJECT(self, "no moe-route upstream answered: expert ids are checked per batch only");
    st->route_dir.clear();
    st->route_fingerprint.clear();
    return TRUE;
  }
  st->route_dir = route.dir;
  st->route_fingerprint = route.fingerprint;
  const moe::MoeConfig& cfg = newest->adapter->layer().config();
  if (route.hidden_size != cfg.hidden_size || route.num_experts != cfg.num_experts) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                      ("moe-route uses the MoE adapter '%s' (hidden_size %d, %d experts) but moe-expert uses '%s' "
                       "(hidden_size %d, %d experts): the routing of one adapter can drive the experts of another "
                       "only when both match",
                       route.dir.c_str(), route.hidden_size, route.num_experts, newest->dir.c_str(), cfg.hidden_size,
                       cfg.num_experts),
                      (nullptr));
    return FALSE;
  }
  if (route.dir != newest->dir)
    GST_INFO_OBJECT(self, "routing from adapter %s drives the experts of %s (same hidden_size and experts)",
                    route.dir.c_str(), newest->dir.c_str());
  return TRUE;
}

// The routing the meta rows carry, as the engine's Routing for the experts of `run`; false after
// posting an error.
static bool gst_moe_expert_routing(GstMoeExpert* self, const ExpertRun& run, const gstmoe::BatchRecords& records,
                                   moe::Routing* routing) {
  const ExpertState* st = self->state;
  const int num_experts = run.adapter->layer().config().num_experts;
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
        const bool from_route = !st->route_dir.empty() && records.router_fingerprint == st->route_fingerprint;
        const std::string source = from_route                 ? "the MoE adapter '" + st->route_dir + "' of moe-route"
                                   : !records.adapter.empty() ? "an adapter named '" + records.adapter + "'"
                                                              : "an unknown router";
        GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                          ("row %zu (request '%s') is routed to expert %d, but the MoE adapter '%s' of moe-expert has "
                           "experts 0..%d only; the routing came from %s",
                           i, r.id.c_str(), e, run.dir.c_str(), num_experts - 1, source.c_str()),
                          (nullptr));
        return false;
      }
    }
    routing->expert_ids.insert(routing->expert_ids.end(), r.experts.begin(), r.experts.end());
    routing->weights.insert(routing->weights.end(), r.expert_weights.begin(), r.expert_weights.end());
  }
  return true;
}

// `run` ran a batch: when it is another adapter than the last batch's, counts the swap; when it is
// the newest, drops the older ones (no batch routed by them follows: the pipeline is FIFO).
static void gst_moe_expert_ran(GstMoeExpert* self, ExpertState* st, const std::shared_ptr<ExpertRun>& run) {
  std::vector<std::shared_ptr<ExpertRun>> retired;
  GST_OBJECT_LOCK(self);
  const std::shared_ptr<ExpertRun> before = std::exchange(st->in_use, run);
  if (run == st->runs.back()) {
    retired.assign(st->runs.begin(), st->runs.end() - 1);
    st->runs.erase(st->runs.begin(), st->runs.end() - 1);
  }
  GST_OBJECT_UNLOCK(self);
  for (const std::shared_ptr<ExpertRun>& old : retired) {
    if (old->executor) gst_moe_expert_close_executor(self, *old->executor);
    GST_INFO_OBJECT(self, "dropped the MoE adapter %s", old->dir.c_str());
  }
  if (before && before != run) self->swap->switched(before->dir, *before->adapter, run->dir, *run->adapter);
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
  gst_moe_expert_take_swap(self);
  GST_OBJECT_LOCK(self);
  const std::shared_ptr<ExpertRun> run = run_for(*st, records.router_fingerprint);
  GST_OBJECT_UNLOCK(self);
  moe::Routing routing;
  if (rows > 0 && !gst_moe_expert_routing(self, *run, records, &routing)) return GST_FLOW_ERROR;
  records.adapter = run->name;  // the experts that made the embeddings name the adapter
  // The weights name the embedding space; how rows were routed (top-k, routing policies) is a
  // serving choice within it, so an index built with one routing answers queries routed another way.
  records.adapter_fingerprint = rows_fingerprint(*run, records.router_fingerprint);
  if (rows == 0) return GST_FLOW_OK;  // only failed requests: they travel on untouched
  std::shared_ptr<moe::ExpertExecutor> runs_on;
  if (run->executor) {
    if (!gst_moe_expert_build_executor(self, *run->executor)) return GST_FLOW_ERROR;
    GST_OBJECT_LOCK(self);
    runs_on = run->executor->built;
    GST_OBJECT_UNLOCK(self);
  }
  const bool prefetched = runs_on && runs_on->owns(prefetch);  // else run() prefetches itself

  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READWRITE)) {
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("cannot map the tensor buffer for writing"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x =
      moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), st->width.load()}, map.data, nullptr);
  moe::Tensor y;
  const gstmoe::metrics::ExpertCopyTotals copies_before =
      runs_on ? gstmoe::metrics::expert_copy_totals(*runs_on) : gstmoe::metrics::ExpertCopyTotals{};
  const int64_t t0 = g_get_monotonic_time();
  try {
    y = runs_on ? runs_on->run(x, routing, prefetched ? prefetch : nullptr) : run->adapter->apply_experts(x, routing);
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
      runs_on ? gstmoe::metrics::expert_copy_totals(*runs_on) : gstmoe::metrics::ExpertCopyTotals{};
  for (gstmoe::RequestRecord& r : records.rows) {
    r.timings_ms.emplace_back("expert", ms);
    r.batch_copy_wait_ms += static_cast<double>(copies.wait_ns - copies_before.wait_ns) / 1e6;
    if (!prefetched) r.batch_expert_bytes += copies.bytes - copies_before.bytes;
  }
  if (run != st->in_use && st->in_use) self->stats->restart_experts(run->adapter->layer().config().num_experts);
  self->stats->add_batch(rows, routing);
  gstmoe::metrics::count_expert_run(runs_on, ms);
  gst_moe_expert_ran(self, st, run);
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
  delete self->swap;
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

  g_object_class_install_property(
      gobject_class, PROP_MODEL,
      gstmoe::adapter::model_param_spec(
          "batches routed by the old adapter's router still run on its experts, the others on the new one's, and "
          "the old one goes after the first batch the new one ran (message moe-adapter-swap). Set it before "
          "moe-route's. On GPUs the new experts' cache is sized from the memory the old one leaves free"));
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
          "(the bytes of the experts it holds now) and pinned; fingerprint (the adapter in use), adapters (how many it "
          "holds: 2 during a hot swap) and swaps (adapters swapped in while running). Per-expert figures start again "
          "at each swap"));

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
  self->swap = new gstmoe::adapter::HotSwap(GST_ELEMENT(self));
  self->device = g_strdup(DEFAULT_DEVICE);
  self->precision = DEFAULT_PRECISION;
  self->cache_budget = DEFAULT_CACHE_BUDGET;
  self->rebalance_interval = DEFAULT_REBALANCE_INTERVAL;
  self->stats = new gstmoe::adapter::Stats();
  // In place: the output has the input's shape, so the adapted rows overwrite the input rows.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
