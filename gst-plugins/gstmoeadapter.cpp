#include "gstmoeadapter.h"

#include "gstmoemeta.h"
#include "moe/expert_executor.h"
#include "moe/model_cache.h"

namespace gstmoe::adapter {

static const char* const kRouteQuery = "moe-route-adapter";
static const char* const kExecutorQuery = "moe-expert-executor";

// A boxed reference to an executor, so a query structure can carry (and copy) it safely.
using ExecutorRef = std::shared_ptr<moe::ExpertExecutor>;

static GType executor_ref_get_type() {
  static const GType type = g_boxed_type_register_static(
      "GstMoeExpertExecutorRef", [](gpointer p) -> gpointer { return new ExecutorRef(*static_cast<ExecutorRef*>(p)); },
      [](gpointer p) { delete static_cast<ExecutorRef*>(p); });
  return type;
}

GParamSpec* model_param_spec() {
  return g_param_spec_string("model", "Adapter directory",
                             "MoE adapter directory (adapter_config.json + adapter.safetensors); loaded when the "
                             "element starts, shared with every element that names the same directory",
                             nullptr, gstmoe::kPropertyMutableReady);
}

std::shared_ptr<const moe::MoeAdapter> load(GstElement* element, const std::string& dir) {
  if (dir.empty()) {
    GST_ELEMENT_ERROR(element, RESOURCE, NOT_FOUND,
                      ("no MoE adapter: set the 'model' property to an adapter directory "
                       "(adapter_config.json + adapter.safetensors)"),
                      (nullptr));
    return nullptr;
  }
  try {
    return moe::shared_moe_adapter(dir);
  } catch (const std::exception& e) {  // moe::Error names the file and the reason
    GST_ELEMENT_ERROR(element, RESOURCE, OPEN_READ, ("cannot load the MoE adapter '%s': %s", dir.c_str(), e.what()),
                      (nullptr));
    return nullptr;
  }
}

int caps_width(GstElement* element, const GstCaps* caps, const moe::MoeAdapter& adapter, const std::string& dir) {
  int width = 0;
  if (!parse_tensor_caps(caps, &width)) {
    gchar* str = gst_caps_to_string(caps);
    GST_ELEMENT_ERROR(element, CORE, NEGOTIATION, ("caps %s are not fixed %s caps", str, GST_MOE_TENSOR_MEDIA_TYPE),
                      (nullptr));
    g_free(str);
    return 0;
  }
  const int hidden = adapter.layer().config().hidden_size;
  if (width != hidden) {
    GST_ELEMENT_ERROR(element, CORE, NEGOTIATION,
                      ("input tensors have width %d but the MoE adapter '%s' has hidden_size %d: "
                       "the encoder's embedding size must match the adapter",
                       width, dir.c_str(), hidden),
                      (nullptr));
    return 0;
  }
  return width;
}

bool buffer_rows(GstElement* element, GstBuffer* buffer, int width, size_t* rows) {
  const gsize size = gst_buffer_get_size(buffer);
  const gsize row_bytes = static_cast<gsize>(width) * sizeof(float);
  if (size % row_bytes != 0) {
    GST_ELEMENT_ERROR(element, STREAM, FORMAT,
                      ("tensor buffer of %" G_GSIZE_FORMAT " bytes is not a whole number of rows of width %d "
                       "(%" G_GSIZE_FORMAT " bytes each)",
                       size, width, row_bytes),
                      (nullptr));
    return false;
  }
  *rows = size / row_bytes;
  return true;
}

bool check_meta_rows(GstElement* element, const GstMoeBatchMeta* meta, size_t rows) {
  const size_t described = meta->records->rows.size();
  if (described != rows) {
    GST_ELEMENT_ERROR(element, STREAM, FORMAT,
                      ("the tensor buffer holds %zu rows but its request meta describes %zu", rows, described),
                      (nullptr));
    return false;
  }
  return true;
}

std::string name_of(const std::string& dir) {
  gchar* base = g_path_get_basename(dir.c_str());  // ignores trailing slashes
  std::string name(base);
  g_free(base);
  return name;
}

void Stats::reset(int num_experts) {
  std::lock_guard<std::mutex> lock(lock_);
  rows_ = batches_ = 0;
  per_expert_.assign(static_cast<size_t>(num_experts), 0);
  meter_.emplace(num_experts, 10.0);
}

static double seconds_now() { return static_cast<double>(g_get_monotonic_time()) / 1e6; }

void Stats::add_batch(size_t rows, const moe::Routing& routing) {
  std::lock_guard<std::mutex> lock(lock_);
  rows_ += rows;
  batches_ += 1;
  for (int32_t e : routing.expert_ids)
    if (e != moe::Routing::kUnusedSlot) ++per_expert_[static_cast<size_t>(e)];
  if (meter_) meter_->add(routing, seconds_now());
}

GstStructure* Stats::to_structure(const char* name, const char* per_expert) const {
  std::lock_guard<std::mutex> lock(lock_);
  GstStructure* s = gst_structure_new(name, "rows", G_TYPE_UINT64, rows_, "batches", G_TYPE_UINT64, batches_, nullptr);
  take_array(s, per_expert, per_expert_);
  take_array(s, "expert-share", meter_ ? meter_->shares() : std::vector<double>());
  take_array(s, "expert-rate", meter_ ? meter_->rates(seconds_now()) : std::vector<double>());
  take_array(s, "expert-peak", meter_ ? meter_->peak() : std::vector<int64_t>());
  return s;
}

bool is_route_query(GstQuery* query) {
  if (GST_QUERY_TYPE(query) != GST_QUERY_CUSTOM) return false;
  const GstStructure* s = gst_query_get_structure(query);
  return s && gst_structure_has_name(s, kRouteQuery);
}

void answer_route_query(GstQuery* query, const std::string& dir, const moe::MoeAdapter& adapter) {
  const moe::MoeConfig& config = adapter.layer().config();
  gst_structure_set(gst_query_writable_structure(query), "path", G_TYPE_STRING, dir.c_str(), "fingerprint",
                    G_TYPE_STRING, adapter.fingerprint().c_str(), "hidden-size", G_TYPE_INT, config.hidden_size,
                    "num-experts", G_TYPE_INT, config.num_experts, nullptr);
}

bool query_route(GstPad* sinkpad, RouteInfo* info) {
  GstQuery* query = gst_query_new_custom(GST_QUERY_CUSTOM, gst_structure_new_empty(kRouteQuery));
  bool answered = gst_pad_peer_query(sinkpad, query);
  if (answered) {
    const GstStructure* s = gst_query_get_structure(query);
    const gchar* path = gst_structure_get_string(s, "path");
    answered = path && gst_structure_get_int(s, "hidden-size", &info->hidden_size) &&
               gst_structure_get_int(s, "num-experts", &info->num_experts);
    if (answered) {
      info->dir = path;
      const gchar* fingerprint = gst_structure_get_string(s, "fingerprint");
      info->fingerprint = fingerprint ? fingerprint : "";
    }
  }
  gst_query_unref(query);
  return answered;
}

bool is_executor_query(GstQuery* query) {
  if (GST_QUERY_TYPE(query) != GST_QUERY_CUSTOM) return false;
  const GstStructure* s = gst_query_get_structure(query);
  return s && gst_structure_has_name(s, kExecutorQuery);
}

void answer_executor_query(GstQuery* query, const std::shared_ptr<moe::ExpertExecutor>& executor) {
  ExecutorRef ref(executor);
  gst_structure_set(gst_query_writable_structure(query), "executor", executor_ref_get_type(), &ref, nullptr);
}

std::shared_ptr<moe::ExpertExecutor> query_executor(GstPad* srcpad) {
  GstQuery* query = gst_query_new_custom(GST_QUERY_CUSTOM, gst_structure_new_empty(kExecutorQuery));
  std::shared_ptr<moe::ExpertExecutor> executor;
  if (gst_pad_peer_query(srcpad, query)) {
    const GValue* v = gst_structure_get_value(gst_query_get_structure(query), "executor");
    if (v && G_VALUE_HOLDS(v, executor_ref_get_type()))
      executor = *static_cast<const ExecutorRef*>(g_value_get_boxed(v));
  }
  gst_query_unref(query);
  return executor;
}

}  // namespace gstmoe::adapter
