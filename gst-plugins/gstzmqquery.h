/* zmq-query: a live source of search requests received as JSON messages on a ZeroMQ socket. */
#pragma once

#include <gst/base/gstpushsrc.h>
#include <gst/gst.h>

G_BEGIN_DECLS

// How clients reach zmq-query.
typedef enum {
  GST_ZMQ_QUERY_SOCKET_PULL,    // PUSH clients, fire and forget
  GST_ZMQ_QUERY_SOCKET_ROUTER,  // REQ or DEALER clients, each request acknowledged
} GstZmqQuerySocketType;

GType gst_zmq_query_socket_type_get_type(void);
#define GST_TYPE_ZMQ_QUERY_SOCKET_TYPE (gst_zmq_query_socket_type_get_type())

#define GST_TYPE_ZMQ_QUERY (gst_zmq_query_get_type())
G_DECLARE_FINAL_TYPE(GstZmqQuery, gst_zmq_query, GST, ZMQ_QUERY, GstPushSrc)

GST_ELEMENT_REGISTER_DECLARE(zmq_query);

G_END_DECLS
