/* moe-caption: search results as text for textoverlay.
 *
 * Reads ann-query's result documents (application/json, docs/zmq-schema.md) and makes one Pango
 * markup text buffer from each, timed by the document's video frame, so that textoverlay writes
 * the best catalog matches on the frames they were computed from. Each text buffer carries the
 * result as a GstMoeResultMeta (gstmoeresultmeta.h), readable from C and Python.
 */
#pragma once

#include <gst/base/gstbasetransform.h>
#include <gst/gst.h>

G_BEGIN_DECLS

// `errors`: what an error document becomes.
typedef enum {
  GST_MOE_CAPTION_ERRORS_SKIP,
  GST_MOE_CAPTION_ERRORS_SHOW,
} GstMoeCaptionErrors;
#define GST_TYPE_MOE_CAPTION_ERRORS (gst_moe_caption_errors_get_type())
GType gst_moe_caption_errors_get_type(void);

#define GST_TYPE_MOE_CAPTION (gst_moe_caption_get_type())
G_DECLARE_FINAL_TYPE(GstMoeCaption, gst_moe_caption, GST, MOE_CAPTION, GstBaseTransform)

GST_ELEMENT_REGISTER_DECLARE(moe_caption);

G_END_DECLS
