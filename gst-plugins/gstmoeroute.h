/* moe-route: the router half of the MoE adapter.
 *
 * Reads a batch of embeddings (application/x-moe-tensor), asks the adapter's router which
 * experts each row should use, and writes the chosen experts and their weights into the rows of
 * the request meta. The tensor data passes through unchanged: moe-expert, downstream, runs the
 * experts. Routing and expert execution are separate elements so they can run in different
 * places (threads, later devices) and so the routing is visible in the result documents.
 *
 * This header also holds what moe-route and moe-expert share: adapter loading, the width and
 * row checks, and the upstream query by which moe-expert learns which adapter routed its input.
 */
#pragma once

#include <gst/base/gstbasetransform.h>
#include <gst/gst.h>

#include <memory>
#include <string>
#include <vector>

#include "gstmoemeta.h"
#include "moe/moe_layer.h"

G_BEGIN_DECLS

#define GST_TYPE_MOE_ROUTE (gst_moe_route_get_type())
G_DECLARE_FINAL_TYPE(GstMoeRoute, gst_moe_route, GST, MOE_ROUTE, GstBaseTransform)

GST_ELEMENT_REGISTER_DECLARE(moe_route);

G_END_DECLS

// Helpers shared by moe-route and moe-expert. Each one that can fail posts the element error
// itself, so both elements report the same problem in the same words.
namespace gstmoe::adapter {

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

// Sets `field` of `s` to a GstValueArray of guint64 (per-expert counters in the stats).
void set_uint64_array(GstStructure* s, const char* field, const std::vector<guint64>& values);

// The custom upstream query (GST_QUERY_CUSTOM, structure "moe-route-adapter") that moe-expert
// sends when its caps are set; the nearest moe-route upstream answers with its adapter, so that
// moe-expert can refuse routing made by an incompatible adapter before any buffer flows.
struct RouteInfo {
  std::string dir;
  int hidden_size = 0;
  int num_experts = 0;
};
bool is_route_query(GstQuery* query);
void answer_route_query(GstQuery* query, const std::string& dir, const moe::MoeConfig& config);
// True and `info` filled when a moe-route upstream of `sinkpad` answered.
bool query_route(GstPad* sinkpad, RouteInfo* info);

}  // namespace gstmoe::adapter
