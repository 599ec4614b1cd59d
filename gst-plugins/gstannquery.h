/* ann-query: answers embedded requests from a FAISS index (mode=search), or builds that index
 * from a catalog stream (mode=build). A thin adapter over moe::AnnIndex. */
#pragma once

#include <gst/gst.h>

G_BEGIN_DECLS

typedef enum {
  GST_ANN_QUERY_MODE_SEARCH,  // answer every row with a result document
  GST_ANN_QUERY_MODE_BUILD,   // collect every row, write the index at EOS
} GstAnnQueryMode;

GType gst_ann_query_mode_get_type(void);
#define GST_TYPE_ANN_QUERY_MODE (gst_ann_query_mode_get_type())

#define GST_TYPE_ANN_QUERY (gst_ann_query_get_type())
G_DECLARE_FINAL_TYPE(GstAnnQuery, gst_ann_query, GST, ANN_QUERY, GstElement)

GST_ELEMENT_REGISTER_DECLARE(ann_query)

G_END_DECLS
