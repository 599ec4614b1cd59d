#include "gstmoemeta.h"

#include <cstring>

#include "backend.h"
#include "moe/query_request.h"

namespace gstmoe {

const char* modality_name(Modality m) {
  switch (m) {
    case Modality::Image:
      return "image";
    case Modality::Tensor:
      return "tensor";
    case Modality::Hybrid:
      return "hybrid";
    case Modality::Text:
      break;
  }
  return "text";
}

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

// Bounds on NNStreamer's dimension strings, which come from outside: NNS_TENSOR_RANK_LIMIT
// dimensions, the width of GST_MOE_TENSOR_CAPS, and rows enough for any batch.
constexpr size_t kMaxTensorRank = 16;
constexpr guint64 kMaxTensorWidth = 65536;
constexpr guint64 kMaxTensorRows = guint64{1} << 20;
constexpr size_t kMaxEchoedCapsBytes = 64;

// NNStreamer's "W:R:..." (innermost first) in `field`: the width, after checking every dimension
// and that the rows they make stay bounded. False with `why` naming the field otherwise.
static bool parse_nns_dimension(const char* field, const gchar* text, int* width, std::string* why) {
  const std::string shown = moe::clip_utf8(text, kMaxEchoedCapsBytes);
  const std::string where = std::string("caps field '") + field + "' (\"" + shown + "\")";
  if (std::strchr(text, ',') != nullptr) {
    *why = where + " describes more than one tensor: only one is taken";
    return false;
  }
  gchar** dims = g_strsplit(text, ":", static_cast<gint>(kMaxTensorRank) + 1);
  const guint rank = g_strv_length(dims);
  guint64 rows = 1;
  bool ok = rank >= 1 && rank <= kMaxTensorRank;
  if (!ok) *why = where + " must list 1 to " + std::to_string(kMaxTensorRank) + " dimensions";
  for (guint i = 0; ok && i < rank; ++i) {
    const guint64 max = i == 0 ? kMaxTensorWidth : kMaxTensorRows;
    guint64 d = 0;
    ok = g_ascii_string_to_unsigned(dims[i], 10, 1, max, &d, nullptr);
    if (!ok) {
      *why = where + ": dimension " + std::to_string(i + 1) + " must be a whole number from 1 to " +
             std::to_string(max) + (i == 0 ? " (the vector width)" : "");
    } else if (i == 0) {
      *width = static_cast<int>(d);
    } else if (rows > kMaxTensorRows / d) {
      ok = false;
      *why = where + ": more than " + std::to_string(kMaxTensorRows) + " rows per buffer";
    } else {
      rows *= d;
    }
  }
  g_strfreev(dims);
  return ok;
}

bool parse_open_tensor_caps(const GstCaps* caps, int* width, std::string* why) {
  if (parse_tensor_caps(caps, width)) return true;
  gchar* text = caps ? gst_caps_to_string(caps) : g_strdup("none");
  const std::string shown = moe::clip_utf8(text, 4 * kMaxEchoedCapsBytes);
  g_free(text);
  if (!caps || !gst_caps_is_fixed(caps)) {
    *why = "caps " + shown + " are not fixed";
    return false;
  }
  const GstStructure* s = gst_caps_get_structure(caps, 0);
  if (gst_structure_has_name(s, GST_MOE_TENSOR_MEDIA_TYPE)) {
    *why = "caps fields 'dtype' (f32) and 'width' (1 to 65536) are required, in " + shown;
    return false;
  }
  const bool tensors = gst_structure_has_name(s, GST_MOE_NNS_TENSORS_MEDIA_TYPE);
  if (!tensors && !gst_structure_has_name(s, GST_MOE_NNS_TENSOR_MEDIA_TYPE)) {
    *why = "caps " + shown + " are neither " GST_MOE_TENSOR_MEDIA_TYPE " nor NNStreamer's " +
           GST_MOE_NNS_TENSORS_MEDIA_TYPE " or " GST_MOE_NNS_TENSOR_MEDIA_TYPE;
    return false;
  }
  const char* type_field = tensors ? "types" : "type";
  const char* dim_field = tensors ? "dimensions" : "dimension";
  if (tensors) {
    const gchar* format = gst_structure_get_string(s, "format");
    if (format != nullptr && g_strcmp0(format, "static") != 0) {
      *why = "caps field 'format' is \"" + moe::clip_utf8(format, kMaxEchoedCapsBytes) +
             "\": only static tensors are taken (flexible and sparse ones carry a header per buffer)";
      return false;
    }
    int num_tensors = 0;
    if (!gst_structure_get_int(s, "num_tensors", &num_tensors) || num_tensors != 1) {
      *why = "caps field 'num_tensors' must be 1 (one tensor of vectors per buffer), in " + shown;
      return false;
    }
  }
  const gchar* type = gst_structure_get_string(s, type_field);
  if (g_strcmp0(type, "float32") != 0) {
    *why = std::string("caps field '") + type_field + "' is " +
           (type ? "\"" + moe::clip_utf8(type, kMaxEchoedCapsBytes) + "\"" : std::string("missing")) +
           ": only float32 vectors are taken (convert them first, e.g. tensor_transform mode=typecast "
           "option=float32)";
    return false;
  }
  int rank1 = 0;  // gst-launch reads an unquoted "dimension=16" as an integer
  if (gst_structure_get_int(s, dim_field, &rank1))
    return parse_nns_dimension(dim_field, std::to_string(rank1).c_str(), width, why);
  const gchar* dims = gst_structure_get_string(s, dim_field);
  if (dims == nullptr) {
    *why = std::string("caps field '") + dim_field + "' is missing (or not a string) in " + shown;
    return false;
  }
  return parse_nns_dimension(dim_field, dims, width, why);
}

moe::kernels::WeightType weight_type(GstMoePrecision precision) {
  switch (precision) {
    case GST_MOE_PRECISION_FP16:
      return moe::kernels::WeightType::F16;
    case GST_MOE_PRECISION_BF16:
      return moe::kernels::WeightType::BF16;
    case GST_MOE_PRECISION_INT4:
      return moe::kernels::WeightType::Q4;
    case GST_MOE_PRECISION_FP32:
      break;
  }
  return moe::kernels::WeightType::F32;
}

const char* precision_nick(GstMoePrecision precision) {
  GEnumClass* klass = static_cast<GEnumClass*>(g_type_class_ref(GST_TYPE_MOE_EXPERT_PRECISION));  // every value
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

GType gst_moe_expert_precision_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_MOE_PRECISION_FP32, "Weights in 32-bit float (exact)", "fp32"},
      {GST_MOE_PRECISION_FP16, "Weights in IEEE half precision, f32 accumulation", "fp16"},
      {GST_MOE_PRECISION_BF16, "Weights in bfloat16, f32 accumulation", "bf16"},
      {GST_MOE_PRECISION_INT4, "A 4-bit adapter's experts as stored (W4A16: packed, f32 accumulation)", "int4"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstMoeExpertPrecision", values);
    g_once_init_leave(&type, t);
  }
  return type;
}
