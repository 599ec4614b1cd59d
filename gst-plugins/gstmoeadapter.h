/* gst-moe: what moe-route and moe-expert share.
 *
 * The router and the experts are two elements over one MoE adapter: both load it the same way,
 * swap it for another while playing (HotSwap), check tensor widths and row counts against it,
 * count rows per expert in their stats, and talk over two custom queries: moe-expert learns
 * which adapter routed its input (upstream), and moe-route finds moe-expert's expert executor to
 * preload each batch's experts (downstream). Each helper that can fail posts the element error
 * itself, so both elements report the same problem in the same words.
 */
#pragma once

#include <gst/gst.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "gstmoemeta.h"
#include "moe/moe_layer.h"
#include "moe/routing_policy.h"

namespace moe {
class ExpertExecutor;
}

namespace gstmoe::adapter {

// The 'model' property (the adapter directory) of both elements; `swap` says, for the blurb, when
// the element switches to a model set while it runs.
GParamSpec* model_param_spec(const char* swap);

// The adapter in `dir` from the process-wide cache (moe::shared_moe_adapter); nullptr after
// posting an error when `dir` is empty or the adapter cannot be loaded.
std::shared_ptr<const moe::MoeAdapter> load(GstElement* element, const std::string& dir);

// The width of the tensor `caps` if it equals the adapter's hidden_size; 0 after posting a
// not-negotiated error naming both widths and the adapter directory.
int caps_width(GstElement* element, const GstCaps* caps, const moe::MoeAdapter& adapter, const std::string& dir);

// Why `adapter` cannot take rows of `width` f32 (0: not negotiated yet, so anything goes); empty
// when it can. For a hot swap, whose caps are already set.
std::string width_refusal(const moe::MoeAdapter& adapter, int width);

// The number of rows of `width` f32 in `buffer`; false after posting an error when its size is
// not a whole number of rows.
bool buffer_rows(GstElement* element, GstBuffer* buffer, int width, size_t* rows);

// False after posting an error when the meta does not describe exactly `rows` rows.
bool check_meta_rows(GstElement* element, const GstMoeBatchMeta* meta, size_t rows);

// The last path component of an adapter directory: the adapter's name in result documents.
std::string name_of(const std::string& dir);

// Hybrid requests (Modality::Hybrid): fuses the image embedding in each hybrid row of `rows`
// ([records.rows.size(), width] f32, rewritten in place) with the text embedding its record
// carries, in one adapter.fuse() call for all of them; sets each one's `fusion` (the weights, and
// "gate" or "average" by has_cross_modal_gate()) and clears its text_embedding. Other rows are
// left as they are. False after posting an error when a hybrid record's text embedding is not
// `width` floats, or the fusion fails.
bool fuse_hybrid_rows(GstElement* element, const moe::MoeAdapter& adapter, float* rows, int width,
                      BatchRecords& records);

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
  // The per-expert figures start again for another adapter (a hot swap); rows and batches go on.
  void restart_experts(int num_experts);
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
// The query names the fingerprint of the adapter that routed the batch: during a hot swap
// moe-expert holds several adapters, each with its executor, and answers with the one that will
// run that batch.
bool is_executor_query(GstQuery* query);
std::string executor_query_fingerprint(GstQuery* query);
void answer_executor_query(GstQuery* query, const std::shared_ptr<moe::ExpertExecutor>& executor);
// The executor of the moe-expert downstream of `srcpad` for batches routed by the adapter with
// `router_fingerprint`, or null when none answered.
std::shared_ptr<moe::ExpertExecutor> query_executor(GstPad* srcpad, const std::string& router_fingerprint);

// A new adapter, loaded and made ready in the background while the element keeps running the
// one in use.
struct LoadedAdapter {
  std::string dir;
  std::shared_ptr<const moe::MoeAdapter> adapter;
  std::unique_ptr<moe::Router> router;            // moe-route's routing policy for its experts
  std::shared_ptr<moe::ExpertExecutor> executor;  // moe-expert's, when its experts run on one
};

// The 'model' property of a running element: setting it loads that adapter on a thread of its
// own while the streaming thread keeps using the one in use, and hands the result over at a batch
// boundary (docs/architecture.md, "Hot swap"). Bus messages (element messages, from the element):
//   moe-adapter-loaded   model, fingerprint: the new adapter is ready; the element switches to it
//                        at the batch boundary its blurb names
//   moe-adapter-swap     model, fingerprint, previous-model, previous-fingerprint, swaps: the
//                        element ran its first batch with the new adapter
// A load that fails, or an adapter that cannot replace the one in use (`prepare` throws), posts a
// warning naming both, the element keeps the adapter in use, and 'model' reads it again
// (notify::model). Of several settings made during one load, the last one is loaded next.
// Threads: every member may be called from any thread; the element owns this for its whole life.
class HotSwap {
 public:
  // Checks a loaded adapter against the running element and completes it (the element's router
  // or executor); throws std::exception whose message says why it cannot serve.
  using Prepare = std::function<void(LoadedAdapter&)>;

  explicit HotSwap(GstElement* element) : element_(element) {}
  ~HotSwap();
  HotSwap(const HotSwap&) = delete;
  HotSwap& operator=(const HotSwap&) = delete;

  // The property: stored; while started, a directory other than the one in use is loaded.
  void set_model(const gchar* dir);
  gchar* dup_model() const;
  std::string model() const;

  // start(): the element runs the adapter of `in_use` and prepares the next ones with `prepare`;
  // swaps count from 0. stop(): waits for a load in progress and drops what was not taken.
  void start(const std::string& in_use, Prepare prepare);
  void stop();

  // The adapter loaded for the latest setting, once (null when none is ready); the caller
  // switches to it at its next batch boundary, or refuses it with refuse().
  std::unique_ptr<LoadedAdapter> take();
  // A taken adapter found unfit after all: the warning, and 'model' reads `in_use` again.
  void refuse(const LoadedAdapter& loaded, const std::string& in_use, const std::string& why);
  // The element ran its first batch on `now` after `before`: counts it and posts moe-adapter-swap.
  void switched(const std::string& before_dir, const moe::MoeAdapter& before, const std::string& now_dir,
                const moe::MoeAdapter& now);
  guint64 swaps() const;

 private:
  void load_loop();
  void fall_back(const std::string& dir, const std::string& why);  // lock_ not held

  GstElement* element_;
  mutable std::mutex lock_;
  std::string model_;                  // the property
  std::string in_use_;                 // the adapter the element runs or has loaded to run: 'model' after a failure
  Prepare prepare_;                    // set while started
  uint64_t wanted_ = 0, handled_ = 0;  // settings made while started, and loaded (or failed) so far
  std::unique_ptr<LoadedAdapter> ready_;
  guint64 swaps_ = 0;
  bool loading_ = false;  // the thread is running
  std::thread thread_;
};

}  // namespace gstmoe::adapter
