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
 */
#include "gstmoeexpert.h"

#include <cstring>
#include <utility>

#include "gstmoeadapter.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_expert_debug);
#define GST_CAT_DEFAULT gst_moe_expert_debug

#define DEFAULT_DEVICE "cpu"

namespace {

// C++ state of the element (GObject does not run constructors: allocated in init).
struct ExpertState {
  // Properties, under the object lock; read when the element starts.
  std::string model;
  std::string device = DEFAULT_DEVICE;

  // The running configuration: set by start(), cleared by stop(); between the two only the
  // streaming thread uses it.
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::string adapter_dir;
  std::string adapter_name;
  int width = 0;
  std::string route_dir;  // the adapter of the moe-route upstream, when one answered

  gstmoe::adapter::Stats stats;  // expert-rows: per expert, how many rows it ran on
};

}  // namespace

struct _GstMoeExpert {
  GstBaseTransform parent;
  ExpertState* st;
};

enum { PROP_0, PROP_MODEL, PROP_DEVICE, PROP_STATS };

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
    case PROP_STATS:
      g_value_take_boxed(value, self->st->stats.to_structure("moe-expert-stats", "expert-rows"));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
}

static gboolean gst_moe_expert_start(GstBaseTransform* trans) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->st;
  GST_OBJECT_LOCK(self);
  const std::string dir = st->model;
  const std::string device = st->device;
  GST_OBJECT_UNLOCK(self);

  if (device != "cpu") {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS,
                      ("device '%s' is not available: this build runs experts on the CPU only and the CUDA expert "
                       "backend is not available yet (use device=cpu)",
                       device.c_str()),
                      (nullptr));
    return FALSE;
  }
  std::shared_ptr<const moe::MoeAdapter> adapter = gstmoe::adapter::load(GST_ELEMENT(self), dir);
  if (!adapter) return FALSE;
  const moe::MoeConfig& cfg = adapter->layer().config();

  st->adapter = std::move(adapter);
  st->adapter_dir = dir;
  st->adapter_name = gstmoe::adapter::name_of(dir);
  st->width = 0;
  st->route_dir.clear();
  st->stats.reset(cfg.num_experts);
  GST_INFO_OBJECT(self, "adapter %s: hidden_size %d, %d experts, on %s", dir.c_str(), cfg.hidden_size,
                  cfg.num_experts, device.c_str());
  return TRUE;
}

static gboolean gst_moe_expert_stop(GstBaseTransform* trans) {
  GST_MOE_EXPERT(trans)->st->adapter.reset();  // the cache frees the adapter when its last user lets go
  return TRUE;
}

static gboolean gst_moe_expert_set_caps(GstBaseTransform* trans, GstCaps* incaps, GstCaps*) {
  GstMoeExpert* self = GST_MOE_EXPERT(trans);
  ExpertState* st = self->st;
  st->width = gstmoe::adapter::caps_width(GST_ELEMENT(self), incaps, *st->adapter, st->adapter_dir);
  if (st->width == 0) return FALSE;

  // Routing from another adapter directory is fine when it addresses the same experts.
  gstmoe::adapter::RouteInfo route;
  if (!gstmoe::adapter::query_route(GST_BASE_TRANSFORM_SINK_PAD(trans), &route)) {
    GST_DEBUG_OBJECT(self, "no moe-route upstream answered: expert ids are checked per batch only");
    st->route_dir.clear();
    return TRUE;
  }
  st->route_dir = route.dir;
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
  moe::Routing routing;
  if (rows > 0 && !gst_moe_expert_routing(self, records, &routing)) return GST_FLOW_ERROR;
  records.adapter = st->adapter_name;  // the experts that made the embeddings name the adapter
  if (rows == 0) return GST_FLOW_OK;   // only failed requests: they travel on untouched

  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READWRITE)) {
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("cannot map the tensor buffer for writing"), (nullptr));
    return GST_FLOW_ERROR;
  }
  const moe::Tensor x = moe::Tensor::view(moe::DType::F32, {static_cast<int64_t>(rows), st->width}, map.data, nullptr);
  moe::Tensor y;
  const int64_t t0 = g_get_monotonic_time();
  try {
    y = st->adapter->apply_experts(x, routing);
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
  GST_LOG_OBJECT(self, "ran the experts of %zu rows in %.3f ms", rows, ms);
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
                          "Where the experts run. Only \"cpu\" is accepted: this build runs experts on the CPU only "
                          "and the CUDA expert backend is not available yet",
                          DEFAULT_DEVICE,
                          static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY)));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      g_param_spec_boxed("stats", "Statistics",
                         "Since the element started: rows and batches processed, and expert-rows (per expert, how "
                         "many rows it ran on)",
                         GST_TYPE_STRUCTURE, static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS)));

  gst_element_class_set_static_metadata(
      element_class, "MoE experts", "Filter/Tensor",
      "Runs the experts of a Mixture-of-Experts adapter that moe-route chose for every row of an embedding batch "
      "and replaces each embedding with normalize(x + sum of the weighted expert outputs). Needs moe-route "
      "upstream. Example: gst-launch-1.0 zmq-query endpoint=tcp://127.0.0.1:5555 ! moe-encode "
      "model=models/default/clip ! moe-route model=models/default/adapter ! moe-expert "
      "model=models/default/adapter ! ann-query index=catalog.faiss ! zmq-publish endpoint=tcp://127.0.0.1:5556",
      "gst-moe developers");
  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);

  trans_class->start = GST_DEBUG_FUNCPTR(gst_moe_expert_start);
  trans_class->stop = GST_DEBUG_FUNCPTR(gst_moe_expert_stop);
  trans_class->set_caps = GST_DEBUG_FUNCPTR(gst_moe_expert_set_caps);
  trans_class->transform_ip = GST_DEBUG_FUNCPTR(gst_moe_expert_transform_ip);
}

static void gst_moe_expert_init(GstMoeExpert* self) {
  self->st = new ExpertState();
  // In place: the output has the input's shape, so the adapted rows overwrite the input rows.
  gst_base_transform_set_in_place(GST_BASE_TRANSFORM(self), TRUE);
}
