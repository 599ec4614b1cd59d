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
#include <string>
#include <vector>

#include "gstmoemeta.h"
#include "moe/moe_layer.h"

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

// The counters behind an element's 'stats' property, since the element started: rows and
// batches processed and, per expert, how many rows used it. Locked, because the property is
// read from any thread while the streaming thread counts.
class Stats {
 public:
  void reset(int num_experts);
  // One batch of `rows` rows whose routing chose `expert_ids` (rows x top-k).
  void add_batch(size_t rows, const std::vector<int32_t>& expert_ids);
  // Structure `name` with rows, batches and the per-expert counts as a guint64 array `per_expert`.
  GstStructure* to_structure(const char* name, const char* per_expert) const;

 private:
  mutable std::mutex lock_;
  guint64 rows_ = 0;
  guint64 batches_ = 0;
  std::vector<guint64> per_expert_;
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
