/* gst-moe: one search result, readable from C and, through GObject-Introspection (GstMoe-1.0),
 * from Python and other bound languages, without gst-moe's C++ headers.
 *
 * moe-caption attaches a GstMoeResultMeta to every text buffer it makes from a result or error
 * document (docs/zmq-schema.md): the request's id, the frame's PTS and stream time (video
 * frames), the hits best first (catalog item, id, caption, uri, score), the experts that the
 * query was routed to, and for an error document its code and reason. Strings are UTF-8 and owned
 * by the meta; what an accessor returns lives as long as the buffer holds the meta.
 *
 * Modelled on GStreamer's metas (GstVideoRegionOfInterestMeta; 1.24's analytics metas arrived
 * after Debian 12's 1.22): an API type and a GstMetaInfo, gst_buffer_add_/get_ functions, and
 * accessors instead of public fields, so the layout can grow. The meta has no tags: it survives
 * every transform, and copies of the buffer copy it.
 *
 * Threads: a meta is written only while its buffer is writable (by whoever adds it), then only
 * read; reading it from several threads at once is safe.
 *
 * Link with libgstmoe-meta-1.0 (pkg-config gstmoe-meta-1.0); in Python:
 *   gi.require_version("GstMoe", "1.0"); from gi.repository import GstMoe
 *   meta = GstMoe.buffer_get_moe_result_meta(buffer)
 */
#pragma once

#include <gst/gst.h>

G_BEGIN_DECLS

/**
 * GstMoeResultMeta:
 * @meta: the parent #GstMeta
 *
 * One search result (or the failure of one request); read it with the accessors.
 */
typedef struct _GstMoeResultMeta GstMoeResultMeta;

struct _GstMoeResultMeta {
  GstMeta meta;

  /*< private >*/
  gpointer priv;
};

GType gst_moe_result_meta_api_get_type(void);
#define GST_MOE_RESULT_META_API_TYPE (gst_moe_result_meta_api_get_type())

const GstMetaInfo* gst_moe_result_meta_get_info(void);
#define GST_MOE_RESULT_META_INFO (gst_moe_result_meta_get_info())

/**
 * gst_buffer_add_moe_result_meta:
 * @buffer: a writable #GstBuffer
 * @request_id: (nullable): the request's id
 * @pts: the video frame's PTS, or GST_CLOCK_TIME_NONE
 * @stream_time: the frame's stream time, or GST_CLOCK_TIME_NONE
 *
 * Attaches an empty result: add hits and experts next, in rank order.
 *
 * Returns: (transfer none): the new meta
 */
GstMoeResultMeta* gst_buffer_add_moe_result_meta(GstBuffer* buffer, const gchar* request_id, GstClockTime pts,
                                                 GstClockTime stream_time);

/**
 * gst_buffer_get_moe_result_meta:
 * @buffer: a #GstBuffer
 *
 * Returns: (transfer none) (nullable): the buffer's result meta, or %NULL when it has none
 */
GstMoeResultMeta* gst_buffer_get_moe_result_meta(GstBuffer* buffer);

/**
 * gst_moe_result_meta_add_hit:
 * @meta: a #GstMoeResultMeta on a writable buffer
 * @item: the hit's row in the index
 * @id: (nullable): the catalog's id of the item
 * @caption: (nullable): its caption
 * @uri: (nullable): its uri
 * @score: the cosine similarity between query and item
 *
 * Appends a hit; hits are ranked in the order they are added, best first.
 */
void gst_moe_result_meta_add_hit(GstMoeResultMeta* meta, gint64 item, const gchar* id, const gchar* caption,
                                 const gchar* uri, gdouble score);

/**
 * gst_moe_result_meta_add_expert:
 * @meta: a #GstMoeResultMeta on a writable buffer
 * @expert: the expert's index in the adapter
 * @weight: its routing weight
 *
 * Appends an expert the query was routed to, highest weight first.
 */
void gst_moe_result_meta_add_expert(GstMoeResultMeta* meta, gint expert, gdouble weight);

/**
 * gst_moe_result_meta_set_error:
 * @meta: a #GstMoeResultMeta on a writable buffer
 * @code: the error document's error.code (docs/zmq-schema.md, "Error codes")
 * @reason: what went wrong, for people
 *
 * Marks the result as the failure of its request.
 */
void gst_moe_result_meta_set_error(GstMoeResultMeta* meta, const gchar* code, const gchar* reason);

/**
 * gst_moe_result_meta_get_request_id:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: (nullable): the request's id, %NULL when the request had none
 */
const gchar* gst_moe_result_meta_get_request_id(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_pts:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: the PTS of the video frame the result is for (as it entered moe-encode), or
 * GST_CLOCK_TIME_NONE for other requests
 */
GstClockTime gst_moe_result_meta_get_pts(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_stream_time:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: the frame's stream time, or GST_CLOCK_TIME_NONE
 */
GstClockTime gst_moe_result_meta_get_stream_time(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_error_code:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: (nullable): the error code when the request failed, %NULL for a result
 */
const gchar* gst_moe_result_meta_get_error_code(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_error_reason:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: (nullable): why the request failed, %NULL for a result
 */
const gchar* gst_moe_result_meta_get_error_reason(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_n_hits:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: the number of hits (0 for an error, or an empty index)
 */
guint gst_moe_result_meta_get_n_hits(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_hit_item:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the best hit, up to get_n_hits() - 1
 *
 * Returns: the hit's row in the index; -1 for an @index out of range
 */
gint64 gst_moe_result_meta_get_hit_item(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_hit_id:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the best hit, up to get_n_hits() - 1
 *
 * Returns: (nullable): the catalog's id of the item; %NULL when it has none or @index is out of range
 */
const gchar* gst_moe_result_meta_get_hit_id(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_hit_caption:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the best hit, up to get_n_hits() - 1
 *
 * Returns: (nullable): the item's caption; %NULL when it has none or @index is out of range
 */
const gchar* gst_moe_result_meta_get_hit_caption(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_hit_uri:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the best hit, up to get_n_hits() - 1
 *
 * Returns: (nullable): the item's uri; %NULL when it has none or @index is out of range
 */
const gchar* gst_moe_result_meta_get_hit_uri(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_hit_score:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the best hit, up to get_n_hits() - 1
 *
 * Returns: the hit's cosine similarity in [-1, 1]; NAN for an @index out of range
 */
gdouble gst_moe_result_meta_get_hit_score(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_n_experts:
 * @meta: a #GstMoeResultMeta
 *
 * Returns: the number of experts the query was routed to (0 without moe-route)
 */
guint gst_moe_result_meta_get_n_experts(const GstMoeResultMeta* meta);

/**
 * gst_moe_result_meta_get_expert:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the highest weight, up to get_n_experts() - 1
 *
 * Returns: the expert's index in the adapter; -1 for an @index out of range
 */
gint gst_moe_result_meta_get_expert(const GstMoeResultMeta* meta, guint index);

/**
 * gst_moe_result_meta_get_expert_weight:
 * @meta: a #GstMoeResultMeta
 * @index: 0 for the highest weight, up to get_n_experts() - 1
 *
 * Returns: the expert's routing weight; NAN for an @index out of range
 */
gdouble gst_moe_result_meta_get_expert_weight(const GstMoeResultMeta* meta, guint index);

G_END_DECLS
