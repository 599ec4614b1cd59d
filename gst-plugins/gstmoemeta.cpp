#include "gstmoemeta.h"

#include "backend.h"

namespace gstmoe {

const char* modality_name(Modality m) { return m == Modality::Text ? "text" : "image"; }

GstCaps* tensor_caps(int width) {
  return gst_caps_new_simple(GST_MOE_TENSOR_MEDIA_TYPE, "dtype", G_TYPE_STRING, "f32", "width", G_TYPE_INT, width,
                             nullptr);
}

bool parse_tensor_caps(const GstCaps* caps, int* width) {
  if (!caps || !gst_caps_is_fixed(caps)) return false;
  const GstStructure* s = gst_caps_get_structure(caps, 0);
  if (!gst_structure_has_name(s, GST_MOE_TENSOR_MEDIA_TYPE)) return false;
  const gchar* dtype = gst_structure_get_string(s, "dtype");
  if (!dtype || g_strcmp0(dtype, "f32") != 0) return false;
  return gst_structure_get_int(s, "width", width) && *width > 0;
}

moe::kernels::WeightType weight_type(GstMoePrecision precision) {
  switch (precision) {
    case GST_MOE_PRECISION_FP16:
      return moe::kernels::WeightType::F16;
    case GST_MOE_PRECISION_BF16:
      return moe::kernels::WeightType::BF16;
    case GST_MOE_PRECISION_FP32:
      break;
  }
  return moe::kernels::WeightType::F32;
}

const char* precision_nick(GstMoePrecision precision) {
  GEnumClass* klass = static_cast<GEnumClass*>(g_type_class_ref(GST_TYPE_MOE_PRECISION));
  const GEnumValue* v = g_enum_get_value(klass, precision);
  const char* nick = v != nullptr ? v->value_nick : "unknown";  // static strings: valid after unref
  g_type_class_unref(klass);
  return nick;
}

GParamSpec* stats_param_spec(const char* blurb) {
  return g_param_spec_boxed("stats", "Statistics", blurb, GST_TYPE_STRUCTURE,
                            static_cast<GParamFlags>(G_PARAM_READABLE | G_PARAM_STATIC_STRINGS));
}

GstBuffer* bytes_buffer(std::vector<uint8_t>&& bytes) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  return gst_buffer_new_wrapped_full(GST_MEMORY_FLAG_READONLY, owned->data(), owned->size(), 0, owned->size(), owned,
                                     [](gpointer p) { delete static_cast<std::vector<uint8_t>*>(p); });
}

}  // namespace gstmoe

GType gst_moe_precision_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_PRECISION_FP32, "Weights in 32-bit float (exact)", "fp32"},
      {GST_MOE_PRECISION_FP16, "Weights in IEEE half precision, f32 accumulation", "fp16"},
      {GST_MOE_PRECISION_BF16, "Weights in bfloat16, f32 accumulation", "bf16"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoePrecision", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

GType gst_moe_batch_meta_api_get_type(void) {
  static GType type = 0;
  static const gchar* tags[] = {nullptr};  // no tags: not tied to memory, size or format
  if (g_once_init_enter(&type)) {
    GType t = gst_meta_api_type_register("GstMoeBatchMetaAPI", tags);
    g_once_init_leave(&type, t);
  }
  return type;
}

static gboolean moe_batch_meta_init(GstMeta* meta, gpointer, GstBuffer*) {
  reinterpret_cast<GstMoeBatchMeta*>(meta)->records = nullptr;
  return TRUE;
}

static void moe_batch_meta_free(GstMeta* meta, GstBuffer*) {
  auto* m = reinterpret_cast<GstMoeBatchMeta*>(meta);
  delete m->records;
  m->records = nullptr;
}

static gboolean moe_batch_meta_transform(GstBuffer* dest, GstMeta* meta, GstBuffer*, GQuark type, gpointer data) {
  auto* m = reinterpret_cast<GstMoeBatchMeta*>(meta);
  // Copies carry the records whole; a partial copy (a region of the buffer) cannot say which
  // rows it holds, so it gets none rather than wrong ones.
  if (GST_META_TRANSFORM_IS_COPY(type)) {
    auto* copy = static_cast<GstMetaTransformCopy*>(data);
    if (copy->region) return TRUE;
  }
  if (!m->records) return TRUE;
  return gst_buffer_add_moe_batch_meta(dest, *m->records) != nullptr;
}

const GstMetaInfo* gst_moe_batch_meta_get_info(void) {
  static const GstMetaInfo* info = nullptr;
  if (g_once_init_enter(&info)) {
    const GstMetaInfo* mi = gst_meta_register(GST_MOE_BATCH_META_API_TYPE, "GstMoeBatchMeta", sizeof(GstMoeBatchMeta),
                                              moe_batch_meta_init, moe_batch_meta_free, moe_batch_meta_transform);
    g_once_init_leave(&info, mi);
  }
  return info;
}

GstMoeBatchMeta* gst_buffer_add_moe_batch_meta(GstBuffer* buffer, const gstmoe::BatchRecords& records) {
  g_return_val_if_fail(gst_buffer_is_writable(buffer), nullptr);
  auto* m = reinterpret_cast<GstMoeBatchMeta*>(gst_buffer_add_meta(buffer, GST_MOE_BATCH_META_INFO, nullptr));
  m->records = new gstmoe::BatchRecords(records);
  return m;
}
