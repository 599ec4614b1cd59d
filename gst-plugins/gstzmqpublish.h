/* zmq-publish: publishes every buffer (a JSON result document) as one ZeroMQ PUB message. */
#pragma once

#include <gst/base/gstbasesink.h>
#include <gst/gst.h>

G_BEGIN_DECLS

#define GST_TYPE_ZMQ_PUBLISH (gst_zmq_publish_get_type())
G_DECLARE_FINAL_TYPE(GstZmqPublish, gst_zmq_publish, GST, ZMQ_PUBLISH, GstBaseSink)

GST_ELEMENT_REGISTER_DECLARE(zmq_publish);

G_END_DECLS
