/* moe-route: picks the top-k experts of every row of a tensor batch (the MoE adapter's router)
 * and records them in the request meta; the tensor data passes through unchanged.
 *
 * Why a separate element: routing is cheap and decides which experts a batch needs, so keeping
 * it apart from moe-expert lets the routing show up in the result documents and lets expert
 * execution move elsewhere later without touching the router.
 *
 * Buffers without a request meta (raw tensors pushed by an application) get one, with ids
 * from a counter, so that every row can still be answered downstream.
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

namespace {

// C++ state of the element (GObject does not run constructors: allocated in init).
struct RouteState {
  // Properties, under the object lock; read when the element starts.
  std::string model;
  guint top_k = 0;

  // The running configuration: set by start(), cleared by stop(), under the object lock
  // because the adapter query may arrive from any thread.
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  int top_k_used = 0;

  // Streaming thread only.
  int width = 0;
  guint64 next_id = 0;  // ids for rows that arrive without a request meta

  gstmoe::adapter::Stats stats;  // expert-load: per expert, how many rows chose it
};

}  // namespace

struct _GstMoeRoute {
  GstBaseTransform parent;
  RouteState* st;
};

enum { PROP_0, PROP_MODEL, PROP_TOP_K, PROP_STATS };

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
      self->st->model = dir ? dir : "";
      break;
    }
    case PROP_TOP_K:
      self->st->top_k = g_value_get_uint(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_moe_route_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeRoute* self = GST_MOE_ROUTE(object);
  switch (prop_id) {
    case PROP_MODEL:
      GST_OBJECT_LOCK(self);
      g_value_set_string(value, self->st->model.empty() ? nullptr : self->st->model.c_str());
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_TOP_K:
      GST_OBJECT_LOCK(self);
      g_value_set_uint(value, self->st->top_k);
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, self->st->stats.to_structure("moe-route-stats", "expert-load"));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
}

static gboolean gst_moe_route_start(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->st;
  GST_OBJECT_LOCK(self);
  const std::string dir = st->model;
  const guint top_k = st->top_k;
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

  GST_OBJECT_LOCK(self);
  st->adapter = std::move(adapter);
  st->adapter_dir = dir;
  st->adapter_name = gstmoe::adapter::name_of(dir);
  st->top_k_used = top_k ? static_cast<int>(top_k) : cfg.top_k;
  GST_OBJECT_UNLOCK(self);
  st->stats.reset(cfg.num_experts);
  st->width = 0;
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts, top-k %d", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, st->top_k_used);
  return TRUE;
}

static gboolean gst_moe_route_stop(GstBaseTransform* trans) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  GST_OBJECT_LOCK(self);
  self->st->adapter.reset();  // the cache frees the adapter when its last user lets go
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_moe_route_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps*) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->st;
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *st->adapter, st->adapter_dir);
  return st->width != 0;
}

static gboolean gst_moe_route_query(GstBaseTransform* trans, GstPadDirection direction, GstQuery* query) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  if (direction == GST_PAD_SRC && gstmoe::adapter::is_route_query(query)) {
    GST_OBJECT_LOCK(self);
    std::shared_ptr<const moe::MoeAdapter> adapter = self->st->adapter;
    const std::string dir = self->st->adapter_dir;
    GST_OBJECT_UNLOCK(self);
    if (!adapter) return FALSE;  // not started: nothing to tell, and no other router to ask
    gstmoe::adapter::answer_route_query(query, dir, *adapter);
    return TRUE;
  }
  return GST_BASE_TRANSFORM_CLASS(parent_class)->query(trans, direction, query);
}

static GstFlowReturn gst_moe_route_transform_ip(GstBaseTransform* trans, GstBuffer* buf) {
  GstMoeRoute* self = GST_MOE_ROUTE(trans);
  RouteState* st = self->st;
  size_t rows = 0;
  if (!gstmoe::adapter::buffer_rows(GST_ELEMENT(self), buf, st->width, &rows)) return GST_FLOW_ERROR;

  GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  if (!meta) {
    gstmoe::BatchRecords records;
    const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
    records.rows.resize(rows);
    for (gstmoe::RequestRecord& r : records.rows) {
      r.id = std::to_string(st->next_id++);
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
    routing = st->adapter->route(x, st->top_k_used);
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
  st->stats.add_batch(rows, routing.expert_ids);
  GST_LOG_OBJECT(self, "routed %zu rows in %.3f ms", rows, ms);

  // Asked per batch, so the answer follows relinking and restarts downstream; cheap next to routing.
  if (std::shared_ptr<moe::ExpertExecutor> executor = gstmoe::adapter::query_executor(GST_BASE_TRANSFORM_SRC_PAD(trans))) {
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
  delete GST_MOE_ROUTE(object)->st;
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
                        64, 0,
                        static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      g_param_spec_boxed("stats", "Statistics",
                         "Since the element started: rows and batches routed, and expert-load (per expert, how many "
                         "rows chose it)",
                         GST_TYPE_STRUCTURE, static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS)));

  gst_element_class_set_static_metadata(
      element_class, "MoE router", "Filter/Tensor",
      "Routes every row of an embedding batch to the top-k experts of a Mixture-of-Experts adapter and writes "
      "the experts and their weights into the request meta; the embeddings pass through unchanged for moe-expert. "
      "When the moe-expert downstream runs its experts on GPU devices (or in reduced precision), moe-route starts "
      "loading each batch's experts there as soon as it has routed the batch. Example: gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! moe-encode model=models/default/clip "
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
  self->st = new RouteState();
  // In place: only the meta changes, the tensor memory is never copied.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
