#include "gstmoeadapter.h"

#include <cstring>
#include <stdexcept>
#include <utility>

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

GParamSpec* model_param_spec(const char* swap) {
  gchar* blurb = g_strconcat(
      "MoE adapter directory (adapter_config.json + adapter.safetensors); loaded when the element starts, shared "
      "with every element that names the same directory. Set while running, another directory is loaded in the "
      "background (message moe-adapter-loaded) while the adapter in use keeps serving; ",
      swap,
      ". If it cannot be loaded or cannot replace the adapter in use, a warning says why, the adapter in use stays "
      "and this property reads it again",
      nullptr);
  // Param specs live as long as their class: the blurb is interned for good.
  const gchar* interned = g_intern_string(blurb);
  g_free(blurb);
  return g_param_spec_string("model", "Adapter directory", interned, nullptr, gstmoe::kPropertyMutablePlaying);
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

std::string width_refusal(const moe::MoeAdapter& adapter, int width) {
  const int hidden = adapter.layer().config().hidden_size;
  if (width == 0 || hidden == width) return {};
  return "its hidden_size is " + std::to_string(hidden) + " but the rows have width " + std::to_string(width);
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

bool fuse_hybrid_rows(GstElement* element, const moe::MoeAdapter& adapter, float* rows, int width,
                      BatchRecords& records) {
  std::vector<size_t> hybrid;
  for (size_t i = 0; i < records.rows.size(); ++i) {
    const RequestRecord& r = records.rows[i];
    if (r.modality != Modality::Hybrid || r.fusion) continue;
    if (r.text_embedding.size() != static_cast<size_t>(width)) {
      GST_ELEMENT_ERROR(element, STREAM, FORMAT,
                        ("row %zu (hybrid request '%s') carries a text embedding of %zu values, but the rows have %d",
                         i, r.id.c_str(), r.text_embedding.size(), width),
                        (nullptr));
      return false;
    }
    hybrid.push_back(i);
  }
  if (hybrid.empty()) return true;
  const auto n = static_cast<int64_t>(hybrid.size());
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  moe::Tensor image = moe::Tensor::zeros(moe::DType::F32, {n, width});
  moe::Tensor text = moe::Tensor::zeros(moe::DType::F32, {n, width});
  for (size_t j = 0; j < hybrid.size(); ++j) {
    std::memcpy(image.data<float>() + j * static_cast<size_t>(width), rows + hybrid[j] * static_cast<size_t>(width),
                row_bytes);
    std::memcpy(text.data<float>() + j * static_cast<size_t>(width), records.rows[hybrid[j]].text_embedding.data(),
                row_bytes);
  }
  moe::Tensor fused, weights;
  try {
    fused = adapter.fuse(image, text, &weights);
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(element, LIBRARY, FAILED,
                      ("fusing the image and text of %zu hybrid requests failed: %s", hybrid.size(), e.what()),
                      (nullptr));
    return false;
  }
  const char* method = adapter.has_cross_modal_gate() ? "gate" : "average";
  for (size_t j = 0; j < hybrid.size(); ++j) {
    std::memcpy(rows + hybrid[j] * static_cast<size_t>(width), fused.data<float>() + j * static_cast<size_t>(width),
                row_bytes);
    RequestRecord& r = records.rows[hybrid[j]];
    r.fusion = Fusion{weights.data<float>()[2 * j], weights.data<float>()[2 * j + 1], method};
    std::vector<float>().swap(r.text_embedding);  // fused: its memory goes with it
  }
  return true;
}

void Stats::reset(int num_experts) {
  std::lock_guard<std::mutex> lock(lock_);
  rows_ = batches_ = 0;
  per_expert_.assign(static_cast<size_t>(num_experts), 0);
  meter_.emplace(num_experts, 10.0);
}

void Stats::restart_experts(int num_experts) {
  std::lock_guard<std::mutex> lock(lock_);
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

std::string executor_query_fingerprint(GstQuery* query) {
  const gchar* fingerprint = gst_structure_get_string(gst_query_get_structure(query), "fingerprint");
  return fingerprint ? fingerprint : "";
}

void answer_executor_query(GstQuery* query, const std::shared_ptr<moe::ExpertExecutor>& executor) {
  ExecutorRef ref(executor);
  gst_structure_set(gst_query_writable_structure(query), "executor", executor_ref_get_type(), &ref, nullptr);
}

std::shared_ptr<moe::ExpertExecutor> query_executor(GstPad* srcpad, const std::string& router_fingerprint) {
  GstQuery* query = gst_query_new_custom(
      GST_QUERY_CUSTOM,
      gst_structure_new(kExecutorQuery, "fingerprint", G_TYPE_STRING, router_fingerprint.c_str(), nullptr));
  std::shared_ptr<moe::ExpertExecutor> executor;
  if (gst_pad_peer_query(srcpad, query)) {
    const GValue* v = gst_structure_get_value(gst_query_get_structure(query), "executor");
    if (v && G_VALUE_HOLDS(v, executor_ref_get_type()))
      executor = *static_cast<const ExecutorRef*>(g_value_get_boxed(v));
  }
  gst_query_unref(query);
  return executor;
}

HotSwap::~HotSwap() {
  if (thread_.joinable()) thread_.join();
}

void HotSwap::set_model(const gchar* dir) {
  std::lock_guard<std::mutex> lock(lock_);
  model_ = dir ? dir : "";
  if (!prepare_) return;                                 // not started: read by the next start
  if (model_ == in_use_ && wanted_ == handled_) return;  // nothing to load
  ++wanted_;
  if (loading_) return;                    // the running thread loads the newest setting next
  if (thread_.joinable()) thread_.join();  // finished: it cleared loading_ as its last step
  loading_ = true;
  thread_ = std::thread(&HotSwap::load_loop, this);
}

gchar* HotSwap::dup_model() const {
  std::lock_guard<std::mutex> lock(lock_);
  return model_.empty() ? nullptr : g_strdup(model_.c_str());
}

std::string HotSwap::model() const {
  std::lock_guard<std::mutex> lock(lock_);
  return model_;
}

void HotSwap::start(const std::string& in_use, Prepare prepare) {
  std::lock_guard<std::mutex> lock(lock_);
  in_use_ = in_use;
  prepare_ = std::move(prepare);
  wanted_ = handled_ = 0;
  swaps_ = 0;
}

void HotSwap::stop() {
  {
    std::lock_guard<std::mutex> lock(lock_);
    prepare_ = nullptr;  // a load in progress is dropped when it ends
    ready_.reset();
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(lock_);
  ready_.reset();
}

std::unique_ptr<LoadedAdapter> HotSwap::take() {
  std::lock_guard<std::mutex> lock(lock_);
  return std::move(ready_);
}

void HotSwap::load_loop() {
  std::unique_lock<std::mutex> lock(lock_);
  while (prepare_ && handled_ != wanted_) {
    const uint64_t setting = wanted_;
    auto loaded = std::make_unique<LoadedAdapter>();
    loaded->dir = model_;
    const Prepare prepare = prepare_;
    lock.unlock();
    std::string why;
    try {
      if (loaded->dir.empty()) throw std::runtime_error("no adapter directory given");
      loaded->adapter = moe::shared_moe_adapter(loaded->dir);
      prepare(*loaded);
    } catch (const std::exception& e) {  // moe::Error names the file and the reason
      why = e.what();
    }
    lock.lock();
    handled_ = setting;
    if (!prepare_ || setting != wanted_) continue;  // stopped, or set again meanwhile: load that
    if (!why.empty()) {
      const std::string dir = loaded->dir;
      lock.unlock();
      fall_back(dir, why);
      lock.lock();
      continue;
    }
    // Announced before it is handed over, so that moe-adapter-loaded comes before moe-adapter-swap.
    const std::string dir = loaded->dir, fingerprint = loaded->adapter->fingerprint();
    lock.unlock();
    GST_INFO_OBJECT(element_, "MoE adapter %s (fingerprint %s) loaded in the background", dir.c_str(),
                    fingerprint.c_str());
    gst_element_post_message(
        element_,
        gst_message_new_element(GST_OBJECT(element_),
                                gst_structure_new("moe-adapter-loaded", "model", G_TYPE_STRING, dir.c_str(),
                                                  "fingerprint", G_TYPE_STRING, fingerprint.c_str(), nullptr)));
    lock.lock();
    if (!prepare_ || setting != wanted_) continue;
    in_use_ = dir;
    ready_ = std::move(loaded);  // replaces one not taken yet: the newest setting wins
  }
  loading_ = false;
}

void HotSwap::fall_back(const std::string& dir, const std::string& why) {
  std::string in_use;
  {
    std::lock_guard<std::mutex> lock(lock_);
    in_use = in_use_;
    if (wanted_ == handled_) model_ = in_use_;  // unless set again meanwhile
  }
  GST_ELEMENT_WARNING(
      element_, RESOURCE, OPEN_READ,
      ("cannot swap to the MoE adapter '%s': %s; still serving '%s'", dir.c_str(), why.c_str(), in_use.c_str()),
      (nullptr));
  g_object_notify(G_OBJECT(element_), "model");
}

void HotSwap::refuse(const LoadedAdapter& loaded, const std::string& in_use, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(lock_);
    in_use_ = in_use;
  }
  fall_back(loaded.dir, why);
}

void HotSwap::switched(const std::string& before_dir, const moe::MoeAdapter& before, const std::string& now_dir,
                       const moe::MoeAdapter& now) {
  guint64 swaps = 0;
  {
    std::lock_guard<std::mutex> lock(lock_);
    swaps = ++swaps_;
  }
  GST_INFO_OBJECT(element_, "switched from the MoE adapter %s (%s) to %s (%s)", before_dir.c_str(),
                  before.fingerprint().c_str(), now_dir.c_str(), now.fingerprint().c_str());
  gst_element_post_message(
      element_, gst_message_new_element(
                    GST_OBJECT(element_),
                    gst_structure_new("moe-adapter-swap", "model", G_TYPE_STRING, now_dir.c_str(), "fingerprint",
                                      G_TYPE_STRING, now.fingerprint().c_str(), "previous-model", G_TYPE_STRING,
                                      before_dir.c_str(), "previous-fingerprint", G_TYPE_STRING,
                                      before.fingerprint().c_str(), "swaps", G_TYPE_UINT64, swaps, nullptr)));
}

guint64 HotSwap::swaps() const {
  std::lock_guard<std::mutex> lock(lock_);
  return swaps_;
}

}  // namespace gstmoe::adapter
