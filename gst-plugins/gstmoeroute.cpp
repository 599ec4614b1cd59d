/**
 * SECTION:element-moe-route
 * @title: moe-route
 * @see_also: moe-expert, moe-encode, ann-query
 *
 * moe-route is the router of a Mixture-of-Experts adapter: for every row of an embedding batch
 * (application/x-moe-tensor) it picks the adapter's top-k experts and writes them, best first,
 * with their weights into the row's request meta (GstMoeBatchMeta). The embeddings pass through
 * unchanged; moe-expert, downstream, runs the chosen experts. A buffer without a request meta
 * (raw tensors pushed by an application) gets one, with ids from a counter.
 *
 * When the moe-expert downstream runs its experts on GPU devices (or in reduced precision),
 * moe-route starts loading each batch's experts there as soon as it has routed the batch.
 *
 * The `stats` property counts the rows and batches routed since the element started, and how
 * many rows chose each expert (expert-load).
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
 */
#include "gstmoeroute.h"

#include <utility>

#include "gstmoeadapter.h"
#include "moe/expert_executor.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_route_debug);
#define GST_CAT_DEFAULT gst_moe_route_debug

enum { PROP_0, PROP_MODEL, PROP_TOP_K, PROP_STATS };

#define DEFAULT_TOP_K 0  // the adapter's top_k
#define MAX_TOP_K 64

namespace {

// What one run works with: created by start(), destroyed by stop().
struct RouteState {
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  int top_k = 0;  // the property, or the adapter's top_k for 0
  int width = 0;  // negotiated tensor width; 0 before caps
};

}  // namespace

struct _GstMoeRoute {
  GstBaseTransform parent;

  // Properties, under the object lock; read when the element starts.
  gchar* model;  // nullptr: unset
  guint top_k;

  // Behind `stats`: reset at start, kept after stop (its own lock).
  gstmoe::adapter::Stats* stats;
  // Ids for rows that arrive without a request meta, counted over the element's life (streaming
  // thread only).
  guint64 next_id;

  // Between start() and stop(), nullptr otherwise. The streaming thread uses it without a lock;
  // the route query, which may come from any thread, reads it under the object lock.
  RouteState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));

#define gst_moe_route_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeRoute, gst_moe_route, GST_TYPE_BASE_TRANSFORM,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_route_debug, "moe-route", 0, "MoE adapter router"));
GST_ELEMENT_REGISTER_DEFINE(moe_route, "moe-route", GST_RANK_NONE, GST_TYPE_MOE_ROUTE);

static void gst_moe_route_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL: {
      const gchar* dir = g_value_get_string(value);
      g_free(self->model);
      self->model = dir && *dir ? g_strdup(dir) : nullptr;
      break;
    }
    case PROP_TOP_K:
      self->top_k = g_value_get_uint(value);
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
      g_value_set_string(value, self->model);
      break;
    case PROP_TOP_K:
      g_value_set_uint(value, self->top_k);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, self->stats->to_structure("moe-route-stats", "expert-load"));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static gboolean gst_moe_route_start(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  GST_OBJECT_LOCK(self);
  const std::string dir = self->model ? self->model : "";
  const guint top_k = self->top_k;
  GST_OBJECT_UNLOCK(self);

  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  const moe::MoeConfig& cfg = adapter->layer().config();
  if (top_k > static_cast<guint>(cfg.num_experts)) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                      ("top-k=%u exceeds the %d experts of the MoE adapter '%s'", top_k, cfg.num_experts, dir.c_str()),
                      (nullptr));
    return FALSE;
  }

  auto* state = new RouteState();
  state->adapter = std::move(adapter);
  state->adapter_dir = dir;
  state->adapter_name = gstmoe::adapter::name_of(dir);
  state->top_k = top_k ? static_cast<int>(top_k) : cfg.top_k;
  self->stats->reset(cfg.num_experts);
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts, top-k %d", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, state->top_k);
  GST_OBJECT_LOCK(self);
  self->state = state;
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_moe_route_stop(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  GST_OBJECT_LOCK(self);
  RouteState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;  // the cache frees the adapter when its last user lets go
  return TRUE;
}

static gboolean gst_moe_route_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps*) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->state;
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *st->adapter, st->adapter_dir);
  return st->width != 0;
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

static GstFlowReturn gst_moe_route_transform_ip(GstBaseTransform* trans, GstBuffer* buf) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->state;
  size_t rows = 0;
  if (!gstmoe::adapter::buffer_rows(GST_ELEMENT(self), buf, st->width, &rows)) return GST_FLOW_ERROR;

  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  if (!meta) {
    gstmoe::BatchRecords records;
    const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
    records.rows.resize(rows);
    for (gstmoe::RequestRecord& r : records.rows) {
      r.id = std::to_string(self->next_id++);
      r.arrival_wall_us = wall;
      r.arrival_mono_us = mono;
    }
    meta = gst_buffer_add_moe_batch_meta(buf, records);
  } else if (!gstmoe::adapter::check_meta_rows(GST_ELEMENT(self), meta, rows)) {
    return GST_FLOW_ERROR;
  }
  gstmoe::BatchRecords& records = *meta->records;
  records.adapter = st->adapter_name;
  if (rows == 0) return GST_FLOW_OK;  // only failed requests: they travel on untouched

  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, ("cannot map the tensor buffer for reading"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x = moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), st->width}, map.data, nullptr);
  moe::Routing routing;
  const int64_t t0 = g_get_monotonic_time();
  try {
    routing = st->adapter->route(x, st->top_k);
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
  self->stats->add_batch(rows, routing.expert_ids);
  GST_LOG_OBJECT(self, "routed %zu rows in %.3f ms", rows, ms);

  // Asked per batch, so the answer follows relinking and restarts downstream; cheap next to routing.
  if (std::shared_ptr<moe::ExpertExecutor> executor =
          gstmoe::adapter::query_executor(GST_BASE_TRANSFORM_SRC_PAD(trans))) {
    try {
      records.expert_prefetch = executor->prefetch(routing);  // may wait while moe-expert catches up
    } catch (const std::exception& e) {
      // Not fatal here: moe-expert loads the experts itself and reports when that fails too.
      GST_WARNING_OBJECT(self, "cannot preload the experts of %zu rows: %s", rows, e.what());
    }
  }
  return GST_FLOW_OK;
}

static void gst_moe_route_finalize(GObject* object) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  g_free(self->model);
  delete self->stats;
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_route_class_init(GstMoeRouteClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseTransformClass* trans_class = GST_BASE_TRANSFORM_CLASS(klass);

  gobject_class->set_property = gst_moe_route_set_property;
  gobject_class->get_property = gst_moe_route_get_property;
  gobject_class->finalize = gst_moe_route_finalize;

  g_object_class_install_property(gobject_class, PROP_MODEL, gstmoe::adapter::model_param_spec());
  g_object_class_install_property(
      gobject_class, PROP_TOP_K,
      g_param_spec_uint("top-k", "Experts per row",
                        "Experts chosen for every row (0: the adapter's top_k; at most the adapter's num_experts)", 0,
                        MAX_TOP_K, DEFAULT_TOP_K, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "Since the element started: rows and batches routed, and expert-load (per expert, how many rows chose it)"));

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
  trans_class->set_caps = GST_DEBUG_FUNCPTR(gst_moe_route_set_caps);
  trans_class->query = GST_DEBUG_FUNCPTR(gst_moe_route_query);
  trans_class->transform_ip = GST_DEBUG_FUNCPTR(gst_moe_route_transform_ip);
}

static void gst_moe_route_init(GstMoeRoute* self) {
  self->model = nullptr;
  self->top_k = DEFAULT_TOP_K;
  self->stats = new gstmoe::adapter::Stats();
  // In place: only the meta changes, the tensor memory is never copied.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
