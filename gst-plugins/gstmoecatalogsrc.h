/* moe-catalog-src: a folder of images or a JSONL catalog as image requests (see gstmoecatalogsrc.cpp). */
#pragma once

#include <gst/base/gstpushsrc.h>
#include <gst/gst.h>

G_BEGIN_DECLS

#define GST_TYPE_MOE_CATALOG_SRC (gst_moe_catalog_src_get_type())
G_DECLARE_FINAL_TYPE(GstMoeCatalogSrc, gst_moe_catalog_src, GST, MOE_CATALOG_SRC, GstPushSrc)

GST_ELEMENT_REGISTER_DECLARE(moe_catalog_src);

G_END_DECLS
