/* moe-expert: the expert half of the MoE adapter.
 *
 * Runs the experts that moe-route chose for every row of a tensor batch and replaces the
 * embeddings with the adapter's output, normalize(x + sum_k w_k * expert_k(x)), in place.
 */
#pragma once

#include <gst/base/gstbasetransform.h>
#include <gst/gst.h>

G_BEGIN_DECLS

#define GST_TYPE_MOE_EXPERT (gst_moe_expert_get_type())
G_DECLARE_FINAL_TYPE(GstMoeExpert, gst_moe_expert, GST, MOE_EXPERT, GstBaseTransform)

GST_ELEMENT_REGISTER_DECLARE(moe_expert);

G_END_DECLS
