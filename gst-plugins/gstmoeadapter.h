/* gst-moe: what moe-route and moe-expert share.
 *
 * The router and the experts are two elements over one MoE adapter: both load it the same way,
 * check tensor widths and row counts against it, count rows per expert in their stats, and talk
 * over two custom queries: moe-expert learns which adapter routed its input (upstream), and
 * moe-route finds moe-expert's expert executor to preload each batch's experts (downstream). Each helper
 * that can fail posts the element error itself, so both elements report the same problem in
 * the same words.
 */
#pragma once

#include <gst/gst.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "gstmoemeta.h"
#include "moe/moe_layer.h"
#include "moe/routing_policy.h"

namespace moe {
class ExpertExecutor;
}

namespace gstmoe::adapter {

// The 'model' property (the adapter directory) of both elements.
GParamSpec* model_param_spec();

// The adapter in `dir` from the process-wide cache (moe::shared_moe_adapter); nullptr after
// posting an error when `dir` is empty or the adapter cannot be loaded.
std::shared_ptr<const moe::MoeAdapter> load(GstElement* element, const std::string& dir);

// The width of the tensor `caps` if it equals the adapter's hidden_size; 0 after posting a
// not-negotiated error naming both widths and the adapter directory.
int caps_width(GstElement* element, const GstCaps* caps, const moe::MoeAdapter& adapter, const std::string& dir);

// The number of rows of `width` f32 in `buffer`; false after posting an error when its size is
// not a whole number of rows.
bool buffer_rows(GstElement* element, GstBuffer* buffer, int width, size_t* rows);

// False after posting an error when the meta does not describe exactly `rows` rows.
bool check_meta_rows(GstElement* element, const GstMoeBatchMeta* meta, size_t rows);

// The last path component of an adapter directory: the adapter's name in result documents.
std::string name_of(const std::string& dir);

// A GstValueArray of `values` (guint64 or double), taken into `s` as `field`.
template <typename T>
void take_array(GstStructure* s, const char* field, const std::vector<T>& values) {
  GValue array = G_VALUE_INIT;
  gst_value_array_init(&array, static_cast<guint>(values.size()));
  for (T v : values) {
    GValue item = G_VALUE_INIT;
    if constexpr (std::is_floating_point_v<T>) {
      g_value_init(&item, G_TYPE_DOUBLE);
      g_value_set_double(&item, static_cast<double>(v));
    } else {
      g_value_init(&item, G_TYPE_UINT64);
      g_value_set_uint64(&item, static_cast<guint64>(v));
    }
    gst_value_array_append_and_take_value(&array, &item);
  }
  gst_structure_take_value(s, field, &array);
}

// The counters behind an element's 'stats' property, since the element started: rows and
// batches processed and, per expert, how many rows used it, its share of them, its rate (rows
// per second, decaying with a 10 s time constant) and the most rows it took in one batch. Locked,
// because the property is read from any thread while the streaming thread counts.
class Stats {
 public:
  void reset(int num_experts);
  // One batch of `rows` rows routed as `routing` (unused slots are not counted).
  void add_batch(size_t rows, const moe::Routing& routing);
  // Structure `name` with rows, batches and the per-expert counts as a guint64 array `per_expert`,
  // and the arrays expert-share, expert-rate (double) and expert-peak (guint64).
  GstStructure* to_structure(const char* name, const char* per_expert) const;

 private:
  mutable std::mutex lock_;
  guint64 rows_ = 0;
  guint64 batches_ = 0;
  std::vector<guint64> per_expert_;
  std::optional<moe::ExpertLoadMeter> meter_;
};

// The custom upstream query (GST_QUERY_CUSTOM, structure "moe-route-adapter") that moe-expert
// sends when its caps are set; the nearest moe-route upstream answers with its adapter, so that
// moe-expert can refuse routing made by an incompatible adapter before any buffer flows.
struct RouteInfo {
  std::string dir;
  std::string fingerprint;  // its MoeAdapter::fingerprint() (the router's weights are in it)
  int hidden_size = 0;
  int num_experts = 0;
};
bool is_route_query(GstQuery* query);
void answer_route_query(GstQuery* query, const std::string& dir, const moe::MoeAdapter& adapter);
// True and `info` filled when a moe-route upstream of `sinkpad` answered.
bool query_route(GstPad* sinkpad, RouteInfo* info);

// The custom downstream query (GST_QUERY_CUSTOM, structure "moe-expert-executor") by which
// moe-route finds the moe::ExpertExecutor of the nearest moe-expert downstream, to prefetch each
// batch's experts as soon as it has routed it. It passes queues (it is not serialized) and needs
// no process-wide registry: the answer follows the pipeline's links, and the executor travels
// as a reference, so it stays valid while moe-route uses it even if moe-expert stops meanwhile.
// moe-expert answers when its experts run on an executor, and stops the query otherwise.
bool is_executor_query(GstQuery* query);
void answer_executor_query(GstQuery* query, const std::shared_ptr<moe::ExpertExecutor>& executor);
// The executor of the moe-expert downstream of `srcpad`, or null when none answered.
std::shared_ptr<moe::ExpertExecutor> query_executor(GstPad* srcpad);

}  // namespace gstmoe::adapter
