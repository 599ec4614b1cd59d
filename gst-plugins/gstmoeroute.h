/* moe-route: the router half of the MoE adapter.
 *
 * Reads a batch of embeddings (application/x-moe-tensor), asks the adapter's router which
 * experts each row should use, and writes the chosen experts and their weights into the rows of
 * the request meta. The tensor data passes through unchanged: moe-expert, downstream, runs the
 * experts. Routing and expert execution are separate elements so they can run in different
 * places (threads, devices: moe-route preloads the experts moe-expert will run) and so the
 * routing is visible in the result documents.
 * What the two share lives in gstmoeadapter.h.
 */
#pragma once

#include <gst/base/gstbasetransform.h>
#include <gst/gst.h>

G_BEGIN_DECLS

// `routing`: how many experts each row gets (moe/routing_policy.h).
typedef enum {
  GST_MOE_ROUTE_ROUTING_TOP_K,
  GST_MOE_ROUTE_ROUTING_TOP_P,
} GstMoeRouteRouting;
#define GST_TYPE_MOE_ROUTE_ROUTING (gst_moe_route_routing_get_type())
GType gst_moe_route_routing_get_type(void);

// `overflow`: what happens to a slot whose expert is full (capacity-factor).
typedef enum {
  GST_MOE_ROUTE_OVERFLOW_REROUTE,
  GST_MOE_ROUTE_OVERFLOW_DROP,
} GstMoeRouteOverflow;
#define GST_TYPE_MOE_ROUTE_OVERFLOW (gst_moe_route_overflow_get_type())
GType gst_moe_route_overflow_get_type(void);

// `balance`: how the router evens out the experts' load (moe/routing_policy.h).
typedef enum {
  GST_MOE_ROUTE_BALANCE_NONE,
  GST_MOE_ROUTE_BALANCE_BIAS,
} GstMoeRouteBalance;
#define GST_TYPE_MOE_ROUTE_BALANCE (gst_moe_route_balance_get_type())
GType gst_moe_route_balance_get_type(void);

#define GST_TYPE_MOE_ROUTE (gst_moe_route_get_type())
G_DECLARE_FINAL_TYPE(GstMoeRoute, gst_moe_route, GST, MOE_ROUTE, GstBaseTransform)

GST_ELEMENT_REGISTER_DECLARE(moe_route);

G_END_DECLS
