/* GstMoeResultMeta: the C API of gstmoeresultmeta.h over a C++ record.
 *
 * Why a library of its own (libgstmoe-meta-1.0): GObject-Introspection reads a shared library's
 * symbols, and a plugin module is no such library; the plugin links this one, so that an
 * application, its bindings and the plugin register the meta's types once, in one place. */
#include "gstmoeresultmeta.h"

#include <cmath>
#include <vector>

namespace {

struct Hit {
  gint64 item = 0;
  gchar* id = nullptr;  // nullptr: none
  gchar* caption = nullptr;
  gchar* uri = nullptr;
  gdouble score = 0.0;
};

struct Expert {
  gint expert = 0;
  gdouble weight = 0.0;
};

// What the meta holds. Strings are g_strdup'ed so that accessors can return them as C strings
// whose nullness means "none".
struct Result {
  gchar* request_id = nullptr;
  GstClockTime pts = GST_CLOCK_TIME_NONE;
  GstClockTime stream_time = GST_CLOCK_TIME_NONE;
  gchar* error_code = nullptr;
  gchar* error_reason = nullptr;
  std::vector<Hit> hits;
  std::vector<Expert> experts;

  Result() = default;
  Result(const Result& o)
      : request_id(g_strdup(o.request_id)),
        pts(o.pts),
        stream_time(o.stream_time),
        error_code(g_strdup(o.error_code)),
        error_reason(g_strdup(o.error_reason)),
        experts(o.experts) {
    hits.reserve(o.hits.size());
    for (const Hit& h : o.hits) hits.push_back({h.item, g_strdup(h.id), g_strdup(h.caption), g_strdup(h.uri), h.score});
  }
  Result& operator=(const Result&) = delete;
  ~Result() {
    g_free(request_id);
    g_free(error_code);
    g_free(error_reason);
    for (Hit& h : hits) {
      g_free(h.id);
      g_free(h.caption);
      g_free(h.uri);
    }
  }
};

Result* result_of(const GstMoeResultMeta* meta) { return static_cast<Result*>(meta->priv); }

const Hit* hit_at(const GstMoeResultMeta* meta, guint index) {
  const std::vector<Hit>& hits = result_of(meta)->hits;
  return index < hits.size() ? &hits[index] : nullptr;
}

const Expert* expert_at(const GstMoeResultMeta* meta, guint index) {
  const std::vector<Expert>& experts = result_of(meta)->experts;
  return index < experts.size() ? &experts[index] : nullptr;
}

gboolean result_meta_init(GstMeta* meta, gpointer, GstBuffer*) {
  reinterpret_cast<GstMoeResultMeta*>(meta)->priv = new Result();
  return TRUE;
}

void result_meta_free(GstMeta* meta, GstBuffer*) {
  GstMoeResultMeta* m = reinterpret_cast<GstMoeResultMeta*>(meta);
  delete result_of(m);
  m->priv = nullptr;
}

gboolean result_meta_transform(GstBuffer* dest, GstMeta* meta, GstBuffer*, GQuark type, gpointer) {
  if (!GST_META_TRANSFORM_IS_COPY(type)) return FALSE;  // any other transform: the result stays behind
  const GstMoeResultMeta* src = reinterpret_cast<GstMoeResultMeta*>(meta);
  GstMoeResultMeta* copy =
      reinterpret_cast<GstMoeResultMeta*>(gst_buffer_add_meta(dest, GST_MOE_RESULT_META_INFO, nullptr));
  if (!copy) return FALSE;
  delete result_of(copy);
  copy->priv = new Result(*result_of(src));
  return TRUE;
}

}  // namespace

GType gst_moe_result_meta_api_get_type(void) {
  static GType type = 0;
  static const gchar* tags[] = {nullptr};
  if (g_once_init_enter(&type)) {
    GType t = gst_meta_api_type_register("GstMoeResultMetaAPI", tags);
    g_once_init_leave(&type, t);
  }
  return type;
}

const GstMetaInfo* gst_moe_result_meta_get_info(void) {
  static const GstMetaInfo* info = nullptr;
  if (g_once_init_enter(&info)) {
    const GstMetaInfo* i = gst_meta_register(GST_MOE_RESULT_META_API_TYPE, "GstMoeResultMeta", sizeof(GstMoeResultMeta),
                                             result_meta_init, result_meta_free, result_meta_transform);
    g_once_init_leave(&info, i);
  }
  return info;
}

GstMoeResultMeta* gst_buffer_add_moe_result_meta(GstBuffer* buffer, const gchar* request_id, GstClockTime pts,
                                                 GstClockTime stream_time) {
  g_return_val_if_fail(GST_IS_BUFFER(buffer) && gst_buffer_is_writable(buffer), nullptr);
  GstMoeResultMeta* meta =
      reinterpret_cast<GstMoeResultMeta*>(gst_buffer_add_meta(buffer, GST_MOE_RESULT_META_INFO, nullptr));
  Result* r = result_of(meta);
  r->request_id = g_strdup(request_id);
  r->pts = pts;
  r->stream_time = stream_time;
  return meta;
}

GstMoeResultMeta* gst_buffer_get_moe_result_meta(GstBuffer* buffer) {
  g_return_val_if_fail(GST_IS_BUFFER(buffer), nullptr);
  return reinterpret_cast<GstMoeResultMeta*>(gst_buffer_get_meta(buffer, GST_MOE_RESULT_META_API_TYPE));
}

void gst_moe_result_meta_add_hit(GstMoeResultMeta* meta, gint64 item, const gchar* id, const gchar* caption,
                                 const gchar* uri, gdouble score) {
  g_return_if_fail(meta != nullptr);
  result_of(meta)->hits.push_back({item, g_strdup(id), g_strdup(caption), g_strdup(uri), score});
}

void gst_moe_result_meta_add_expert(GstMoeResultMeta* meta, gint expert, gdouble weight) {
  g_return_if_fail(meta != nullptr);
  result_of(meta)->experts.push_back({expert, weight});
}

void gst_moe_result_meta_set_error(GstMoeResultMeta* meta, const gchar* code, const gchar* reason) {
  g_return_if_fail(meta != nullptr && code != nullptr && reason != nullptr);
  Result* r = result_of(meta);
  g_free(r->error_code);
  g_free(r->error_reason);
  r->error_code = g_strdup(code);
  r->error_reason = g_strdup(reason);
}

const gchar* gst_moe_result_meta_get_request_id(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  return result_of(meta)->request_id;
}

GstClockTime gst_moe_result_meta_get_pts(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, GST_CLOCK_TIME_NONE);
  return result_of(meta)->pts;
}

GstClockTime gst_moe_result_meta_get_stream_time(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, GST_CLOCK_TIME_NONE);
  return result_of(meta)->stream_time;
}

const gchar* gst_moe_result_meta_get_error_code(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  return result_of(meta)->error_code;
}

const gchar* gst_moe_result_meta_get_error_reason(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  return result_of(meta)->error_reason;
}

guint gst_moe_result_meta_get_n_hits(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, 0);
  return static_cast<guint>(result_of(meta)->hits.size());
}

gint64 gst_moe_result_meta_get_hit_item(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, -1);
  const Hit* h = hit_at(meta, index);
  return h ? h->item : -1;
}

const gchar* gst_moe_result_meta_get_hit_id(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  const Hit* h = hit_at(meta, index);
  return h ? h->id : nullptr;
}

const gchar* gst_moe_result_meta_get_hit_caption(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  const Hit* h = hit_at(meta, index);
  return h ? h->caption : nullptr;
}

const gchar* gst_moe_result_meta_get_hit_uri(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, nullptr);
  const Hit* h = hit_at(meta, index);
  return h ? h->uri : nullptr;
}

gdouble gst_moe_result_meta_get_hit_score(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, NAN);
  const Hit* h = hit_at(meta, index);
  return h ? h->score : NAN;
}

guint gst_moe_result_meta_get_n_experts(const GstMoeResultMeta* meta) {
  g_return_val_if_fail(meta != nullptr, 0);
  return static_cast<guint>(result_of(meta)->experts.size());
}

gint gst_moe_result_meta_get_expert(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, -1);
  const Expert* e = expert_at(meta, index);
  return e ? e->expert : -1;
}

gdouble gst_moe_result_meta_get_expert_weight(const GstMoeResultMeta* meta, guint index) {
  g_return_val_if_fail(meta != nullptr, NAN);
  const Expert* e = expert_at(meta, index);
  return e ? e->weight : NAN;
}
