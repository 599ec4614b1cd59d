/* The plugin 'moe': multimodal search with CLIP, a Mixture-of-Experts adapter and an ANN index.
 * Each element lives in its own file pair and registers itself here. */
#include <gst/gst.h>

#include "gstannquery.h"
#include "gstmoecaption.h"
#include "gstmoecatalogsrc.h"
#include "gstmoeencode.h"
#include "gstmoeexpert.h"
#include "gstmoeroute.h"
#include "gstzmqpublish.h"
#include "gstzmqquery.h"

static gboolean plugin_init(GstPlugin* plugin) {
  gboolean ok = FALSE;
  ok |= GST_ELEMENT_REGISTER(moe_encode, plugin);
  ok |= GST_ELEMENT_REGISTER(moe_catalog_src, plugin);
  ok |= GST_ELEMENT_REGISTER(moe_route, plugin);
  ok |= GST_ELEMENT_REGISTER(moe_expert, plugin);
  ok |= GST_ELEMENT_REGISTER(ann_query, plugin);
  ok |= GST_ELEMENT_REGISTER(moe_caption, plugin);
  ok |= GST_ELEMENT_REGISTER(zmq_publish, plugin);
  ok |= GST_ELEMENT_REGISTER(zmq_query, plugin);
  return ok;
}

GST_PLUGIN_DEFINE(GST_VERSION_MAJOR, GST_VERSION_MINOR, moe,
                  "Multimodal search: CLIP encoder, Mixture-of-Experts adapter, ANN index, ZeroMQ I/O", plugin_init,
                  VERSION, "LGPL", "gst-moe", "https://github.com/gst-moe/gst-moe")
