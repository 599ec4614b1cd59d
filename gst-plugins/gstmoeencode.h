/* moe-encode: CLIP text and image encoder (see gstmoeencode.cpp). */
#pragma once

#include <gst/gst.h>

G_BEGIN_DECLS

#define GST_TYPE_MOE_ENCODE (gst_moe_encode_get_type())
G_DECLARE_FINAL_TYPE(GstMoeEncode, gst_moe_encode, GST, MOE_ENCODE, GstElement)

GST_ELEMENT_REGISTER_DECLARE(moe_encode);

G_END_DECLS
