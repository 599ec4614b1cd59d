/**
 * SECTION:element-moe-route
 * @title: moe-route
 * @see_also: moe-expert, moe-encode, ann-query
 *
 * moe-route is the router of a Mixture-of-Experts adapter: for every row of an embedding batch
 * (application/x-moe-tensor) it picks the adapter's top-k experts and writes them, best first,
 * with their weights into the row's request meta (GstMoeBatchMeta). The embeddings pass through
 * unchanged; moe-expert, downstream, runs the chosen experts. A buffer without a request meta
 * (raw tensors pushed by an application) gets one, with ids from a counter. Besides
 * application/x-moe-tensor, the sink takes NNStreamer's float32 tensors as ann-query does
 * (other/tensors, format=static, num_tensors=1, types=float32, dimensions=W:R; or other/tensor,
 * type=float32, dimension=W:R) and sends them on as application/x-moe-tensor, width=W, so
 * moe-expert and ann-query follow; other types, formats and dimension strings are refused at caps
 * time naming the field.
 *
 * When the moe-expert downstream runs its experts on GPU devices (or in reduced precision),
 * moe-route starts loading each batch's experts there as soon as it has routed the batch.
 *
 * Hybrid requests (an image and a text) arrive with the image's embedding as their row and the
 * text's in their record: moe-route fuses the two with the adapter's cross-modal gate (the plain
 * average for an adapter without one), writes the fused vector into the row and the weights into
 * the record, and routes it among all the adapter's experts; other rows never route to its
 * joint visual-text experts (adapter_config.json "joint_experts", docs/routing.md).
 *
 * Setting `model` while playing swaps the adapter without stopping (docs/architecture.md, "Hot
 * swap"): the new one loads in the background while the old one routes, and the first batch
 * after it is ready is routed by it (the routing policy's state, such as the balancing bias,
 * starts afresh for its experts). Swap moe-expert's first: it runs each batch with the experts of
 * the adapter that routed it.
 *
 * Routing policies (docs/routing.md): `routing=top-p` gives each row the smallest set of experts
 * whose probability reaches `top-p`, between `min-k` and `max-k` (rows may then use different
 * numbers of experts); `capacity-factor` caps the rows each expert takes per batch, the most
 * probable rows first, and sends the rest to their next expert with room or drops them
 * (`overflow`); `temperature` divides the router logits before the softmax;
 * `balance=bias` steers selection away from overloaded experts with a per-expert bias moved by
 * `balance-rate` after every batch (the weights stay the router's probabilities); `explore` gives
 * a row's last expert, with that probability, to the least-used expert (deterministic for a
 * `seed`). The defaults are the adapter's own top-k routing, computed on its device. The policy
 * state (bias, exploration stream, load counters) survives a flush and restarts with a new stream.
 *
 * The `stats` property counts the rows and batches routed since the element started, how many
 * rows chose each expert (expert-load), each expert's share of them (expert-share), its rate
 * (expert-rate: rows per second, decaying with a 10 s time constant) and the most rows it took
 * in one batch (expert-peak); and since the stream started, the balancing bias per
 * expert (expert-bias), the rows explored per expert (expert-explored), the rows that found each
 * expert full (expert-overflowed), the slots dropped at capacity (dropped), the mean experts per
 * row (experts-per-row) and the coefficient of variation of the expert load (load-cv); the
 * adapter's fingerprint and the swaps made since the start. The per-expert figures start again
 * with each swap.
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 zmq-query ! queue ! moe-encode model=models/default/clip \
 *     ! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter \
 *     ! ann-query index=build/demo/catalog.faiss ! zmq-publish
 * ]| The search service: requests from ZeroMQ, results on a ZeroMQ PUB socket.
 * |[
 * gst-launch-1.0 filesrc location=query.txt ! text/x-raw,format=utf8 \
 *     ! moe-encode model=models/default/clip ! moe-route model=models/default/adapter \
 *     ! moe-expert model=models/default/adapter ! ann-query index=build/demo/catalog.faiss \
 *     ! filesink location=/dev/stdout
 * ]| One query from a file, its result document (with the experts each row used) on stdout.
 */

/* Why a separate element: routing is cheap and decides which experts a batch needs, so keeping
 * it apart from moe-expert lets the routing show up in the result documents and lets expert
 * execution move elsewhere later without touching the router.
 *
 * Preload: when the moe-expert downstream runs its experts on an expert executor (GPU devices,
 * or reduced precision), moe-route asks for that executor (a custom downstream query, see
 * gstmoeadapter.h) and calls its prefetch() as soon as a batch is routed, on this streaming
 * thread: the copies of the batch's experts start while earlier batches still compute. The
 * returned handle travels in the meta (BatchRecords::expert_prefetch) to moe-expert.
 *
 * Hot swap: gstmoe::adapter::HotSwap loads the new adapter and builds its Router on a thread of
 * its own; the streaming thread takes it at the start of a batch, so every batch is routed by one
 * adapter, and says which in the meta (BatchRecords::router_fingerprint): that is how the
 * moe-expert downstream picks the matching experts while it holds both, and which executor it
 * answers the preload query with. Requests already routed keep their routing.
 */
#include "gstmoeroute.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "gstmoeadapter.h"
#include "gstmoemetrics.h"
#include "moe/error.h"
#include "moe/expert_executor.h"
#include "moe/routing_policy.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_route_debug);
#define GST_CAT_DEFAULT gst_moe_route_debug

enum {
  PROP_0,
  PROP_MODEL,
  PROP_TOP_K,
  PROP_ROUTING,
  PROP_TOP_P,
  PROP_MIN_K,
  PROP_MAX_K,
  PROP_CAPACITY_FACTOR,
  PROP_OVERFLOW,
  PROP_TEMPERATURE,
  PROP_BALANCE,
  PROP_BALANCE_RATE,
  PROP_BALANCE_MARGIN,
  PROP_EXPLORE,
  PROP_SEED,
  PROP_STATS
};

#define DEFAULT_TOP_K 0  // the adapter's top_k
#define MAX_TOP_K 64
#define DEFAULT_ROUTING GST_MOE_ROUTE_ROUTING_TOP_K
#define DEFAULT_TOP_P 0.5
#define DEFAULT_MIN_K 1
#define DEFAULT_MAX_K 4
#define DEFAULT_CAPACITY_FACTOR 0.0
#define MAX_CAPACITY_FACTOR 64.0
#define DEFAULT_OVERFLOW GST_MOE_ROUTE_OVERFLOW_REROUTE
#define DEFAULT_TEMPERATURE 0.0  // the adapter's router_temperature (1 when it has none)
#define MIN_TEMPERATURE 0.0
#define MAX_TEMPERATURE 1e3
#define DEFAULT_BALANCE GST_MOE_ROUTE_BALANCE_NONE
#define DEFAULT_BALANCE_RATE 1e-3
#define DEFAULT_BALANCE_MARGIN 0.05
#define DEFAULT_EXPLORE 0.0
#define DEFAULT_SEED 0

namespace {

// The routing properties as start() read them; each adapter gets its Router from them.
struct RouterSettings {
  moe::RoutingPolicy policy;  // top_k and temperature: from the two below and the adapter
  guint top_k = 0;            // 0: the adapter's
  double temperature = 0.0;   // 0: the adapter's router_temperature
};

// The routing policy of `settings` for the experts of `adapter` (in `dir`); throws moe::Error
// naming the setting and the adapter when it does not fit them.
std::unique_ptr<moe::Router> make_router(const RouterSettings& settings, const moe::MoeAdapter& adapter,
                                         const std::string& dir) {
  const moe::MoeConfig& cfg = adapter.layer().config();
  // Single-modality rows never use the joint experts, so top-k must fit the others.
  const int routable = cfg.num_experts - cfg.joint_experts;
  if (settings.top_k > static_cast<guint>(routable))
    throw moe::Error("top-k=" + std::to_string(settings.top_k) + " exceeds the " + std::to_string(routable) +
                     " experts of the MoE adapter '" + dir + "'" +
                     (cfg.joint_experts == 0
                          ? std::string()
                          : " that every request may use (" + std::to_string(cfg.joint_experts) + " of its " +
                                std::to_string(cfg.num_experts) + " are joint visual-text experts)"));
  moe::RoutingPolicy policy = settings.policy;
  policy.top_k = settings.top_k ? static_cast<int>(settings.top_k) : cfg.top_k;
  policy.renormalize = cfg.routing == moe::RoutingKind::Mixtral || cfg.norm_topk_prob;
  policy.temperature = settings.temperature > 0.0 ? settings.temperature : cfg.router_temperature;
  try {
    return std::make_unique<moe::Router>(cfg.num_experts, policy);
  } catch (const moe::Error& e) {
    throw moe::Error(std::string(e.what()) + " (MoE adapter '" + dir + "')");
  }
}

// What one run works with: created by start(), destroyed by stop().
struct RouteState {
  // The adapter in use; replaced at a batch boundary by a hot swap (streaming thread, under the
  // object lock: the route query reads them from other threads).
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  // Negotiated tensor width; 0 before caps. Atomic: a hot swap's loading thread checks against it.
  std::atomic<int> width{0};
  // The adapter's policy and its state (its top_k: the property, or the adapter's for 0); plain
  // top-k routing runs on the adapter's device and is only counted.
  std::unique_ptr<moe::Router> router;
  // The caps last refused (their error is posted): upstream retries a refused sticky caps event
  // before each buffer and event, and one error says it all.
  GstCaps* refused_caps = nullptr;

  RouteState() = default;
  RouteState(const RouteState&) = delete;
  RouteState& operator=(const RouteState&) = delete;
  ~RouteState() { gst_caps_replace(&refused_caps, nullptr); }
};

}  // namespace

struct _GstMoeRoute {
  GstBaseTransform parent;

  // `model`, with its own lock: read when the element starts, swapped while it runs.
  gstmoe::adapter::HotSwap* swap;
  // The other properties, under the object lock; read when the element starts.
  guint top_k;
  GstMoeRouteRouting routing;
  gdouble top_p;
  guint min_k;
  guint max_k;
  gdouble capacity_factor;
  GstMoeRouteOverflow overflow;
  gdouble temperature;
  GstMoeRouteBalance balance;
  gdouble balance_rate;
  gdouble balance_margin;
  gdouble explore;
  guint64 seed;

  // Behind `stats`: reset at start, kept after stop (its own lock).
  gstmoe::adapter::Stats* stats;
  // The router's figures after its last batch, under the object lock (the streaming thread
  // writes them, `stats` reads them).
  std::vector<double>* expert_bias;
  std::vector<guint64>* expert_explored;
  std::vector<guint64>* expert_overflowed;
  guint64 dropped;
  gdouble experts_per_row;
  gdouble load_cv;
  // Ids for rows that arrive without a request meta, counted over the element's life (streaming
  // thread only).
  guint64 next_id;

  // Between start() and stop(), nullptr otherwise. The streaming thread uses it without a lock;
  // the route query, which may come from any thread, reads it under the object lock.
  RouteState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_OPEN_TENSOR_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));

#define gst_moe_route_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeRoute, gst_moe_route, GST_TYPE_BASE_TRANSFORM,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_route_debug, "moe-route", 0, "MoE adapter router"));
GST_ELEMENT_REGISTER_DEFINE(moe_route, "moe-route", GST_RANK_NONE, GST_TYPE_MOE_ROUTE);

GType gst_moe_route_routing_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_ROUTE_ROUTING_TOP_K, "The top-k most probable experts for every row", "top-k"},
      {GST_MOE_ROUTE_ROUTING_TOP_P,
       "The fewest most probable experts whose probability reaches top-p, min-k..max-k per row", "top-p"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoeRouteRouting", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

GType gst_moe_route_overflow_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_ROUTE_OVERFLOW_REROUTE, "To the row's next most probable expert with room (else dropped)", "reroute"},
      {GST_MOE_ROUTE_OVERFLOW_DROP, "Dropped; the row's other experts' weights renormalised", "drop"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoeRouteOverflow", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

GType gst_moe_route_balance_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_ROUTE_BALANCE_NONE, "Route by the router's probabilities alone", "none"},
      {GST_MOE_ROUTE_BALANCE_BIAS, "Per-expert selection bias moved towards equal load after every batch (DeepSeek-V3)",
       "bias"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoeRouteBalance", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

static void gst_moe_route_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL:
      self->swap->set_model(g_value_get_string(value));
      break;
    case PROP_TOP_K:
      self->top_k = g_value_get_uint(value);
      break;
    case PROP_ROUTING:
      self->routing = static_cast<GstMoeRouteRouting>(g_value_get_enum(value));
      break;
    case PROP_TOP_P:
      self->top_p = g_value_get_double(value);
      break;
    case PROP_MIN_K:
      self->min_k = g_value_get_uint(value);
      break;
    case PROP_MAX_K:
      self->max_k = g_value_get_uint(value);
      break;
    case PROP_CAPACITY_FACTOR:
      self->capacity_factor = g_value_get_double(value);
      break;
    case PROP_OVERFLOW:
      self->overflow = static_cast<GstMoeRouteOverflow>(g_value_get_enum(value));
      break;
    case PROP_TEMPERATURE:
      self->temperature = g_value_get_double(value);
      break;
    case PROP_BALANCE:
      self->balance = static_cast<GstMoeRouteBalance>(g_value_get_enum(value));
      break;
    case PROP_BALANCE_RATE:
      self->balance_rate = g_value_get_double(value);
      break;
    case PROP_BALANCE_MARGIN:
      self->balance_margin = g_value_get_double(value);
      break;
    case PROP_EXPLORE:
      self->explore = g_value_get_double(value);
      break;
    case PROP_SEED:
      self->seed = g_value_get_uint64(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_moe_route_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL:
      g_value_take_string(value, self->swap->dup_model());
      break;
    case PROP_TOP_K:
      g_value_set_uint(value, self->top_k);
      break;
    case PROP_ROUTING:
      g_value_set_enum(value, self->routing);
      break;
    case PROP_TOP_P:
      g_value_set_double(value, self->top_p);
      break;
    case PROP_MIN_K:
      g_value_set_uint(value, self->min_k);
      break;
    case PROP_MAX_K:
      g_value_set_uint(value, self->max_k);
      break;
    case PROP_CAPACITY_FACTOR:
      g_value_set_double(value, self->capacity_factor);
      break;
    case PROP_OVERFLOW:
      g_value_set_enum(value, self->overflow);
      break;
    case PROP_TEMPERATURE:
      g_value_set_double(value, self->temperature);
      break;
    case PROP_BALANCE:
      g_value_set_enum(value, self->balance);
      break;
    case PROP_BALANCE_RATE:
      g_value_set_double(value, self->balance_rate);
      break;
    case PROP_BALANCE_MARGIN:
      g_value_set_double(value, self->balance_margin);
      break;
    case PROP_EXPLORE:
      g_value_set_double(value, self->explore);
      break;
    case PROP_SEED:
      g_value_set_uint64(value, self->seed);
      break;
    case PROP_STATS: {
      GstStructure* s = self->stats->to_structure("moe-route-stats", "expert-load");
      gstmoe::adapter::take_array(s, "expert-bias", *self->expert_bias);
      gstmoe::adapter::take_array(s, "expert-explored", *self->expert_explored);
      gstmoe::adapter::take_array(s, "expert-overflowed", *self->expert_overflowed);
      gst_structure_set(s, "load-cv", G_TYPE_DOUBLE, self->load_cv, "experts-per-row", G_TYPE_DOUBLE,
                        self->experts_per_row, "dropped", G_TYPE_UINT64, self->dropped, "fingerprint", G_TYPE_STRING,
                        self->state ? self->state->adapter->fingerprint().c_str() : "", "swaps", G_TYPE_UINT64,
                        self->swap->swaps(), nullptr);
      g_value_take_boxed(value, s);
      break;
    }
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

// The router's figures behind `stats` for a fresh Router over `num_experts`; object lock held.
static void gst_moe_route_clear_figures(GstMoeRoute* self, int num_experts) {
  self->expert_bias->assign(static_cast<size_t>(num_experts), 0.0);
  self->expert_explored->assign(static_cast<size_t>(num_experts), 0);
  self->expert_overflowed->assign(static_cast<size_t>(num_experts), 0);
  self->dropped = 0;
  self->experts_per_row = 0.0;
  self->load_cv = 0.0;
}

static gboolean gst_moe_route_start(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  const std::string dir = self->swap->model();
  RouterSettings settings;
  GST_OBJECT_LOCK(self);
  settings.top_k = self->top_k;
  moe::RoutingPolicy& policy = settings.policy;
  policy.selection =
      self->routing == GST_MOE_ROUTE_ROUTING_TOP_P ? moe::ExpertSelection::TopP : moe::ExpertSelection::TopK;
  policy.top_p = self->top_p;
  policy.min_k = static_cast<int>(self->min_k);
  policy.max_k = static_cast<int>(self->max_k);
  policy.capacity_factor = self->capacity_factor;
  policy.overflow =
      self->overflow == GST_MOE_ROUTE_OVERFLOW_DROP ? moe::CapacityOverflow::Drop : moe::CapacityOverflow::Reroute;
  settings.temperature = self->temperature;
  policy.balance = self->balance == GST_MOE_ROUTE_BALANCE_BIAS ? moe::LoadBalance::Bias : moe::LoadBalance::None;
  policy.balance_rate = self->balance_rate;
  policy.balance_margin = self->balance_margin;
  policy.explore = self->explore;
  policy.seed = self->seed;
  GST_OBJECT_UNLOCK(self);

  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  const moe::MoeConfig& cfg = adapter->layer().config();
  auto* state = new RouteState();
  try {
    state->router = make_router(settings, *adapter, dir);
  } catch (const moe::Error& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("%s", e.what()), (nullptr));
    delete state;
    return FALSE;
  }
  state->adapter = std::move(adapter);
  state->adapter_dir = dir;
  state->adapter_name = gstmoe::adapter::name_of(dir);
  const moe::RoutingPolicy& used = state->router->policy();
  self->stats->reset(cfg.num_experts);
  GST_INFO_OBJECT(self,
                  "adapter %s: hidden_size %d, %d experts, %s, capacity-factor %g, temperature %g, balance %s, "
                  "explore %g",
                  dir.c_str(), cfg.hidden_size, cfg.num_experts,
                  (used.selection == moe::ExpertSelection::TopP
                       ? "top-p " + std::to_string(used.top_p) + " (" + std::to_string(used.min_k) + ".." +
                             std::to_string(used.max_k) + " experts)"
                       : "top-k " + std::to_string(used.top_k))
                      .c_str(),
                  used.capacity_factor, used.temperature, used.balance == moe::LoadBalance::Bias ? "bias" : "none",
                  used.explore);
  GST_OBJECT_LOCK(self);
  self->state = state;
  gst_moe_route_clear_figures(self, cfg.num_experts);
  GST_OBJECT_UNLOCK(self);
  // A hot swap checks the new adapter against the rows and builds its Router on its loading thread.
  self->swap->start(dir, [state, settings](gstmoe::adapter::LoadedAdapter& loaded) {
    const std::string refusal = gstmoe::adapter::width_refusal(*loaded.adapter, state->width.load());
    if (!refusal.empty()) throw moe::Error(refusal);
    loaded.router = make_router(settings, *loaded.adapter, loaded.dir);
  });
  return TRUE;
}

static gboolean gst_moe_route_stop(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  self->swap->stop();  // before the state goes: a load in progress reads its width
  GST_OBJECT_LOCK(self);
  RouteState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;  // the cache frees the adapter when its last user lets go
  return TRUE;
}

// At a batch boundary (streaming thread): switches to the adapter a hot swap has loaded, if any.
static void gst_moe_route_take_swap(GstMoeRoute* self, RouteState* st) {
  std::unique_ptr<gstmoe::adapter::LoadedAdapter> loaded = self->swap->take();
  if (!loaded || loaded->adapter == st->adapter) return;
  // The caps may have come after the loading thread looked at the width.
  const std::string refusal = gstmoe::adapter::width_refusal(*loaded->adapter, st->width.load());
  if (!refusal.empty()) {
    self->swap->refuse(*loaded, st->adapter_dir, refusal);
    return;
  }
  const std::shared_ptr<const moe::MoeAdapter> before = st->adapter;
  const std::string before_dir = st->adapter_dir;
  const int num_experts = loaded->adapter->layer().config().num_experts;
  GST_OBJECT_LOCK(self);
  st->adapter = loaded->adapter;
  st->adapter_dir = loaded->dir;
  st->adapter_name = gstmoe::adapter::name_of(loaded->dir);
  st->router = std::move(loaded->router);
  gst_moe_route_clear_figures(self, num_experts);
  GST_OBJECT_UNLOCK(self);
  self->stats->restart_experts(num_experts);
  self->swap->switched(before_dir, *before, st->adapter_dir, *st->adapter);
}

// NNStreamer's tensors go out as ours, of the same width (any width when their caps do not say
// one that parses: set_caps then refuses them, naming the field); ours pass as they are. Upstream,
// our caps may come from either.
static GstCaps* gst_moe_route_transform_caps(GstBaseTransform*, GstPadDirection direction, GstCaps* caps,
                                             GstCaps* filter) {
  GstCaps* out = gst_caps_new_empty();
  for (guint i = 0; i < gst_caps_get_size(caps); ++i) {
    const GstStructure* st = gst_caps_get_structure(caps, i);
    if (gst_structure_has_name(st, GST_MOE_TENSOR_MEDIA_TYPE)) {
      out = gst_caps_merge_structure(out, gst_structure_copy(st));
      if (direction == GST_PAD_SRC)
        out = gst_caps_merge(out,
                             gst_caps_from_string(GST_MOE_NNS_TENSORS_MEDIA_TYPE "; " GST_MOE_NNS_TENSOR_MEDIA_TYPE));
      continue;
    }
    if (direction != GST_PAD_SINK) continue;
    GstCaps* one = gst_caps_new_full(gst_structure_copy(st), nullptr);
    int width = 0;
    std::string why;
    out = gst_caps_merge(out, gstmoe::parse_open_tensor_caps(one, &width, &why)
                                  ? gstmoe::tensor_caps(width)
                                  : gst_caps_from_string(GST_MOE_TENSOR_CAPS));
    gst_caps_unref(one);
  }
  if (filter) {
    GstCaps* filtered = gst_caps_intersect_full(filter, out, GST_CAPS_INTERSECT_FIRST);
    gst_caps_unref(out);
    out = filtered;
  }
  return out;
}

static gboolean gst_moe_route_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps* outcaps) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->state;
  if (st->refused_caps && gst_caps_is_equal(incaps, st->refused_caps)) return FALSE;
  int width = 0;
  std::string why;
  if (!gstmoe::parse_open_tensor_caps(incaps, &width, &why)) {
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Unsupported input caps: %s", why.c_str()), (nullptr));
  } else {
    // The output caps say the width of NNStreamer's input too (transform_caps).
    st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), outcaps, *st->adapter, st->adapter_dir);
    if (st->width != 0) return TRUE;
  }
  gst_caps_replace(&st->refused_caps, incaps);
  return FALSE;
}

static gboolean gst_moe_route_query(GstBaseTransform* trans, GstPadDirection direction, GstQuery* query) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  if (direction == GST_PAD_SRC && gstmoe::adapter::is_route_query(query)) {
    GST_OBJECT_LOCK(self);
    std::shared_ptr<const moe::MoeAdapter> adapter = self->state ? self->state->adapter : nullptr;
    const std::string dir = self->state ? self->state->adapter_dir : "";
    GST_OBJECT_UNLOCK(self);
    if (!adapter) return FALSE;  // not started: nothing to tell, and no other router to ask
    gstmoe::adapter::answer_route_query(query, dir, *adapter);
    return TRUE;
  }
  return GST_BASE_TRANSFORM_CLASS(parent_class)->query(trans, direction, query);
}

static gboolean gst_moe_route_sink_event(GstBaseTransform* trans, GstEvent* event) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  // A new stream starts the policy afresh (bias, exploration stream, load); a flush does not.
  if (GST_EVENT_TYPE(event) == GST_EVENT_STREAM_START && self->state) self->state->router->reset();
  return GST_BASE_TRANSFORM_CLASS(parent_class)->sink_event(trans, event);
}

static GstFlowReturn gst_moe_route_transform_ip(GstBaseTransform* trans, GstBuffer* buf) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->state;
  gst_moe_route_take_swap(self, st);
  size_t rows = 0;
  if (!gstmoe::adapter::buffer_rows(GST_ELEMENT(self), buf, st->width, &rows)) return GST_FLOW_ERROR;

  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  if (!meta) {
    gstmoe::BatchRecords records;
    const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
    records.rows.resize(rows);
    for (gstmoe::RequestRecord& r : records.rows) {
      r.id = std::to_string(self->next_id++);
      r.modality = gstmoe::Modality::Tensor;
      r.arrival_wall_us = wall;
      r.arrival_mono_us = mono;
      r.pts = GST_BUFFER_PTS(buf);
    }
    meta = gst_buffer_add_moe_batch_meta(buf, records);
  } else if (!gstmoe::adapter::check_meta_rows(GST_ELEMENT(self), meta, rows)) {
    return GST_FLOW_ERROR;
  }
  gstmoe::BatchRecords& records = *meta->records;
  records.adapter = st->adapter_name;
  records.router_fingerprint = st->adapter->fingerprint();
  if (rows == 0) return GST_FLOW_OK;  // only failed requests: they travel on untouched

  // Hybrid rows are rewritten with their fused vector; other batches are only read.
  const bool hybrid = std::any_of(records.rows.begin(), records.rows.end(), [](const gstmoe::RequestRecord& r) {
    return r.modality == gstmoe::Modality::Hybrid && !r.fusion;
  });
  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, hybrid ? GST_MAP_READWRITE : GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, ("cannot map the tensor buffer"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const int width = st->width;
  const int64_t t0 = g_get_monotonic_time();
  if (hybrid && !gstmoe::adapter::fuse_hybrid_rows(GST_ELEMENT(self), *st->adapter, reinterpret_cast<float*>(map.data),
                                                   width, records)) {
    gst_buffer_unmap(buf, &map);
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x = moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), width}, map.data, nullptr);
  // Only fused hybrid rows may route to the adapter's joint visual-text experts.
  moe::MoeLayer::FusedRows fused(rows);
  for (size_t i = 0; i < rows; ++i)
    fused[i] = records.rows[i].modality == gstmoe::Modality::Hybrid && records.rows[i].fusion.has_value();
  moe::Routing routing;
  moe::Router& router = *st->router;
  const moe::ExpertLoad load_before = router.load();
  try {
    if (router.policy().is_plain_top_k()) {
      routing = st->adapter->route(x, router.policy().top_k, fused);
      router.count(routing);
    } else {
      const moe::Tensor logits = st->adapter->layer().router_logits(x, fused);
      routing = router.route(logits.data<float>(), static_cast<int64_t>(rows));
    }
  } catch (const std::exception& e) {
    gst_buffer_unmap(buf, &map);
    GST_ELEMENT_ERROR(self, LIBRARY, FAILED, ("routing %zu rows failed: %s", rows, e.what()), (nullptr));
    return GST_FLOW_ERROR;
  }
  const double ms = gstmoe::elapsed_ms(t0, g_get_monotonic_time());
  gst_buffer_unmap(buf, &map);

  for (size_t i = 0; i < rows; ++i) {
    gstmoe::RequestRecord& r = records.rows[i];
    const auto begin = static_cast<size_t>(i) * static_cast<size_t>(routing.top_k);
    r.experts.assign(routing.expert_ids.begin() + begin, routing.expert_ids.begin() + begin + routing.top_k);
    r.expert_weights.assign(routing.weights.begin() + begin, routing.weights.begin() + begin + routing.top_k);
    r.timings_ms.emplace_back("route", ms);
  }
  self->stats->add_batch(rows, routing);
  gstmoe::metrics::count_routing(routing, load_before, router.load(), ms);
  GST_OBJECT_LOCK(self);
  self->expert_bias->assign(router.bias().begin(), router.bias().end());
  const moe::ExpertLoad& load = router.load();
  self->expert_explored->assign(load.explored.begin(), load.explored.end());
  self->expert_overflowed->assign(load.overflowed.begin(), load.overflowed.end());
  self->dropped = static_cast<guint64>(load.dropped);
  self->experts_per_row =
      load.rows ? static_cast<double>(std::accumulate(load.slots.begin(), load.slots.end(), int64_t{0})) / load.rows
                : 0.0;
  self->load_cv = load.coefficient_of_variation();
  GST_OBJECT_UNLOCK(self);
  GST_LOG_OBJECT(self, "routed %zu rows in %.3f ms", rows, ms);

  // Asked per batch, so the answer follows relinking and restarts downstream; cheap next to routing.
  if (std::shared_ptr<moe::ExpertExecutor> executor =
          gstmoe::adapter::query_executor(GST_BASE_TRANSFORM_SRC_PAD(trans), records.router_fingerprint)) {
    try {
      const gstmoe::metrics::ExpertCopyTotals before = gstmoe::metrics::expert_copy_totals(*executor);
      records.expert_prefetch = executor->prefetch(routing);  // may wait while moe-expert catches up
      // The copies this batch's misses started (moe-expert's runs of prefetched batches copy nothing).
      const uint64_t copied = gstmoe::metrics::expert_copy_totals(*executor).bytes - before.bytes;
      for (gstmoe::RequestRecord& r : records.rows) r.batch_expert_bytes += copied;
    } catch (const std::exception& e) {
      // Not fatal here: moe-expert loads the experts itself and reports when that fails too.
      GST_WARNING_OBJECT(self, "cannot preload the experts of %zu rows: %s", rows, e.what());
    }
  }
  return GST_FLOW_OK;
}

static void gst_moe_route_finalize(GObject* object) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  delete self->swap;
  delete self->stats;
  delete self->expert_bias;
  delete self->expert_explored;
  delete self->expert_overflowed;
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_route_class_init(GstMoeRouteClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseTransformClass* trans_class = GST_BASE_TRANSFORM_CLASS(klass);

  gobject_class->set_property = gst_moe_route_set_property;
  gobject_class->get_property = gst_moe_route_get_property;
  gobject_class->finalize = gst_moe_route_finalize;

  g_object_class_install_property(gobject_class, PROP_MODEL,
                                  gstmoe::adapter::model_param_spec(
                                      "the first batch after it is ready is routed by it (message moe-adapter-swap)"));
  g_object_class_install_property(
      gobject_class, PROP_TOP_K,
      g_param_spec_uint("top-k", "Experts per row",
                        "Experts chosen for every row (0: the adapter's top_k; at most the adapter's num_experts)", 0,
                        MAX_TOP_K, DEFAULT_TOP_K, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_ROUTING,
      g_param_spec_enum("routing", "Experts per row",
                        "top-k: top-k experts for every row; top-p: per row, the fewest most probable experts whose "
                        "probability reaches top-p, within min-k..max-k (dynamic k)",
                        GST_TYPE_MOE_ROUTE_ROUTING, DEFAULT_ROUTING, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_TOP_P,
      g_param_spec_double("top-p", "Probability to reach",
                          "routing=top-p: the router probability a row's experts must reach together", 1e-6, 1.0,
                          DEFAULT_TOP_P, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_MIN_K,
      g_param_spec_uint("min-k", "Fewest experts per row", "routing=top-p: at least this many experts per row", 1,
                        MAX_TOP_K, DEFAULT_MIN_K, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_MAX_K,
      g_param_spec_uint("max-k", "Most experts per row",
                        "routing=top-p: at most this many experts per row (at most the adapter's num_experts)", 1,
                        MAX_TOP_K, DEFAULT_MAX_K, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_CAPACITY_FACTOR,
      g_param_spec_double("capacity-factor", "Expert capacity factor",
                          "Each expert takes at most ceil(factor x rows x mean experts per row / experts) rows of a "
                          "batch, the rows with the highest probability for it first; 0: no limit",
                          0.0, MAX_CAPACITY_FACTOR, DEFAULT_CAPACITY_FACTOR, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_OVERFLOW,
      g_param_spec_enum("overflow", "Capacity overflow",
                        "capacity-factor: where a row's slot goes when its expert is full", GST_TYPE_MOE_ROUTE_OVERFLOW,
                        DEFAULT_OVERFLOW, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_TEMPERATURE,
      g_param_spec_double("temperature", "Softmax temperature",
                          "Router logits are divided by it before the softmax: above 1 spreads the weights, below 1 "
                          "sharpens them (0: the adapter's router_temperature, fitted by moe-calibrate-temperature; "
                          "1 when it has none)",
                          MIN_TEMPERATURE, MAX_TEMPERATURE, DEFAULT_TEMPERATURE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_BALANCE,
      g_param_spec_enum("balance", "Load balancing",
                        "How the router evens out the experts' load: a per-expert bias on selection only, moved by "
                        "balance-rate after every batch towards equal load (the weights stay the router's)",
                        GST_TYPE_MOE_ROUTE_BALANCE, DEFAULT_BALANCE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_BALANCE_RATE,
      g_param_spec_double("balance-rate", "Balancing step",
                          "balance=bias: how far each expert's bias moves after a batch (in probability units)", 0.0,
                          1.0, DEFAULT_BALANCE_RATE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_BALANCE_MARGIN,
      g_param_spec_double("balance-margin", "Balancing margin",
                          "balance=bias: the bias reorders only the experts whose probability is within this of the "
                          "row's k-th most probable, so no row is steered to an expert the router rates far lower "
                          "(1: no limit, DeepSeek-V3's rule; docs/routing.md measures both)",
                          0.0, 1.0, DEFAULT_BALANCE_MARGIN, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_EXPLORE,
      g_param_spec_double("explore", "Exploration probability",
                          "Probability that a row's last expert is replaced by the least-used expert it does not use "
                          "(its weight is its true probability), so that new experts get traffic; 0: off",
                          0.0, 1.0, DEFAULT_EXPLORE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_SEED,
      g_param_spec_uint64("seed", "Exploration seed",
                          "Seed of the exploration's random stream: the same requests route the same way", 0,
                          G_MAXUINT64, DEFAULT_SEED, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec("Since the element started: rows and batches routed, expert-load (per expert, how many "
                               "rows chose it), expert-share, expert-rate (rows/s, 10 s time constant), expert-peak "
                               "(most rows in one batch), expert-bias (balance=bias: each expert's selection bias), "
                               "expert-explored (rows given to each expert by exploration), expert-overflowed (rows "
                               "that found each expert full), dropped (slots dropped at capacity), experts-per-row "
                               "(mean) and load-cv (standard deviation / mean of the expert load); the last five "
                               "since the stream started; fingerprint (of the adapter in use) and swaps (adapters "
                               "swapped in while running). Per-expert figures start again at each swap"));

  gst_element_class_set_static_metadata(
      element_class, "MoE router", "Filter/Tensor",
      "Routes every row of an embedding batch to the top-k experts of a Mixture-of-Experts adapter and writes "
      "the experts and their weights into the request meta; the embeddings pass through unchanged for moe-expert. "
      "When the moe-expert downstream runs its experts on GPU devices (or in reduced precision), moe-route starts "
      "loading each batch's experts there as soon as it has routed the batch. Example: gst-launch-1.0 zmq-query "
      "endpoint=tcp://127.0.0.1:5555 ! moe-encode model=models/default/clip "
      "! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter "
      "! ann-query index=catalog.faiss ! zmq-publish endpoint=tcp://127.0.0.1:5556",
      "gst-moe developers");
  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);

  trans_class->start = GST_DEBUG_FUNCPTR(gst_moe_route_start);
  trans_class->stop = GST_DEBUG_FUNCPTR(gst_moe_route_stop);
  trans_class->transform_caps = GST_DEBUG_FUNCPTR(gst_moe_route_transform_caps);
  trans_class->set_caps = GST_DEBUG_FUNCPTR(gst_moe_route_set_caps);
  trans_class->query = GST_DEBUG_FUNCPTR(gst_moe_route_query);
  trans_class->transform_ip = GST_DEBUG_FUNCPTR(gst_moe_route_transform_ip);
  trans_class->sink_event = GST_DEBUG_FUNCPTR(gst_moe_route_sink_event);

  gst_type_mark_as_plugin_api(GST_TYPE_MOE_ROUTE_ROUTING, static_cast<GstPluginAPIFlags>(0));
  gst_type_mark_as_plugin_api(GST_TYPE_MOE_ROUTE_OVERFLOW, static_cast<GstPluginAPIFlags>(0));
  gst_type_mark_as_plugin_api(GST_TYPE_MOE_ROUTE_BALANCE, static_cast<GstPluginAPIFlags>(0));
}

static void gst_moe_route_init(GstMoeRoute* self) {
  self->swap = new gstmoe::adapter::HotSwap(GST_ELEMENT(self));
  self->top_k = DEFAULT_TOP_K;
  self->routing = DEFAULT_ROUTING;
  self->top_p = DEFAULT_TOP_P;
  self->min_k = DEFAULT_MIN_K;
  self->max_k = DEFAULT_MAX_K;
  self->capacity_factor = DEFAULT_CAPACITY_FACTOR;
  self->overflow = DEFAULT_OVERFLOW;
  self->temperature = DEFAULT_TEMPERATURE;
  self->balance = DEFAULT_BALANCE;
  self->balance_rate = DEFAULT_BALANCE_RATE;
  self->balance_margin = DEFAULT_BALANCE_MARGIN;
  self->explore = DEFAULT_EXPLORE;
  self->seed = DEFAULT_SEED;
  self->stats = new gstmoe::adapter::Stats();
  self->expert_bias = new std::vector<double>();
  self->expert_explored = new std::vector<guint64>();
  self->expert_overflowed = new std::vector<guint64>();
  self->dropped = 0;
  self->experts_per_row = 0.0;
  self->load_cv = 0.0;
  // In place: only the meta changes, the tensor memory is never copied.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
