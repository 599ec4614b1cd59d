/* gst-moe: the plugin's Prometheus metrics (docs/metrics.md).
 *
 * One registry per process, which every element reports into with the calls below (cheap and
 * thread-safe: atomic counters, short locks), and which is served at http://ADDRESS/metrics while
 * an element whose `metrics-address` is set is running. Elements naming the same address share
 * one server. The figures are process-wide: two pipelines in one process add up.
 */
#pragma once

#include <gst/gst.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gstmoemeta.h"

namespace moe {
class ClipModel;
struct QueryCacheStats;
struct Routing;
struct ExpertLoad;
class ExpertExecutor;
}  // namespace moe

namespace gstmoe::metrics {

// The `metrics-address` string property (HOST:PORT; empty: no server), mutable up to READY.
void install_address_property(GObjectClass* klass, guint prop_id);

// A running /metrics server; it stops when the last element holding it lets go.
class Server;

// Starts, or joins, the server for `address` and stores it in `server` (left null when `address`
// is empty). False after posting an element error naming the address and the reason (no port,
// address in use, cannot bind).
bool serve(GstElement* element, const std::string& address, std::shared_ptr<Server>* server);

// The reports. Stage names are the meta's timing stages (queue, encode, route, expert, search)
// and "publish"; error stages are the elements' names (FailedRequest::stage).
// A result document left ann-query; its request's cost share (gstmoeresult.h) is added to the cost counters.
void count_result(const RequestRecord& request, int64_t now_mono_us);
void count_error(const FailedRequest& failed);                // an error document left ann-query
void count_indexed(size_t rows);                              // rows added to an index being built
void count_update();                                          // a catalog update applied (an update document)
void count_search(double search_ms);                          // one batch searched
void count_encoded_batch(size_t requests, double encode_ms);  // one batch taken by moe-encode
// What a moe-encode query cache did between two of its stats() readings (`after` - `before`; the
// bytes may shrink).
void count_query_cache(const moe::QueryCacheStats& before, const moe::QueryCacheStats& after);
// One batch routed by moe-route: rows per expert, and the overflows and drops between the router's
// load figures `before` and `after` the batch.
void count_routing(const moe::Routing& routing, const moe::ExpertLoad& before, const moe::ExpertLoad& after,
                   double route_ms);
// One batch run by moe-expert, with its executor (null on the plain CPU path) for the cache counters.
void count_expert_run(const std::shared_ptr<moe::ExpertExecutor>& executor, double expert_ms);
void count_publish(bool accepted, size_t bytes, double publish_ms);  // one message given to zmq-publish's socket
// The copy work an expert executor has done so far, summed over its devices: per-batch figures are
// the difference of two readings (moe-route around its prefetch, moe-expert around its run).
struct ExpertCopyTotals {
  uint64_t bytes = 0;    // CacheStats::bytes_copied
  uint64_t wait_ns = 0;  // CacheStats::exposed_wait_ns
};
ExpertCopyTotals expert_copy_totals(const moe::ExpertExecutor& executor);
// A model loaded (or taken from the process-wide cache) since `started_mono_us`: model is "encoder",
// "adapter" or "experts" (an expert executor placing the experts on its devices).
void observe_model_load(const char* model, int64_t started_mono_us);

// Memory the elements' models hold, read at each scrape (gstmoe_device_memory_bytes{device, holder},
// and the free and total memory of those devices where the model's own backend can tell:
// gstmoe_device_memory_free_bytes / _capacity_bytes{device}). Device "cpu" is host memory. Nothing
// is opened to answer: a device no model runs on has no series.
// A CLIP model (holder "encoder": its weight_bytes()) or an expert executor (holder "experts": its
// caches' slots, allocated when it is built), for as long as it lives; watching one model twice
// counts it once.
void watch_device_memory(const std::shared_ptr<const moe::ClipModel>& encoder);
void watch_device_memory(const std::shared_ptr<moe::ExpertExecutor>& experts);
// Any other holder (e.g. "index": ann-query's vectors): `bytes` on `device` until the returned
// handle is dropped.
std::shared_ptr<void> hold_device_memory(const char* holder, const std::string& device, uint64_t bytes);

}  // namespace gstmoe::metrics
