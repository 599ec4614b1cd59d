#include "moe/quantized_weights.h"

#include <cstring>

#include "io/json_util.h"
#include "moe/error.h"

namespace moe {

namespace {

// The strings of an array member ("ignore", "targets"); absent or null: none.
std::vector<std::string> string_array(JsonObject* obj, const char* key, const std::string& what) {
  std::vector<std::string> out;
  if (!json::has_member(obj, key)) return out;
  JsonNode* node = json_object_get_member(obj, key);
  if (!JSON_NODE_HOLDS_ARRAY(node)) throw Error(what + ": field '" + key + "' is not an array");
  JsonArray* arr = json_node_get_array(node);
  for (guint i = 0; i < json_array_get_length(arr); ++i) {
    JsonNode* el = json_array_get_element(arr, i);
    if (!JSON_NODE_HOLDS_VALUE(el) || json_node_get_value_type(el) != G_TYPE_STRING)
      throw Error(what + ": field '" + key + "' holds a non-string");
    out.emplace_back(json_node_get_string(el));
  }
  return out;
}

void refuse_member(JsonObject* obj, const char* key, const std::string& what, const char* why) {
  if (json::has_member(obj, key)) throw Error(what + ": '" + key + "' is set: " + why);
}

// Code i (0..15) of a run of packed words: bits 4·(i%8) of word i/8.
inline uint32_t nibble(const int32_t* words, int64_t i) {
  return (static_cast<uint32_t>(words[i / 8]) >> (4 * (i % 8))) & 0xFu;
}

// Element i of an I64 or I32 tensor.
int64_t int_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::I64 ? t.data<int64_t>()[i] : t.data<int32_t>()[i];
}

}  // namespace

std::optional<Int4QuantConfig> Int4QuantConfig::from_hf_config(const std::string& path) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* q = json::get_object_or_null(doc.root_object(), "quantization_config", path);
  if (!q) return std::nullopt;
  const std::string what = path + " quantization_config";
  const std::string method = json::get_string_or(q, "quant_method", "", what);
  if (method != "compressed-tensors")
    throw Error(what + ": quant_method '" + method + "' is not supported (expected 'compressed-tensors')");
  const std::string format = json::get_string_or(q, "format", "", what);
  if (format != "pack-quantized")
    throw Error(what + ": format '" + format + "' is not supported (expected 'pack-quantized', W4A16)");
  Int4QuantConfig c;
  c.source = path;
  c.ignore = string_array(q, "ignore", what);
  refuse_member(q, "kv_cache_scheme", what, "a quantised KV cache has no place in an MoE layer");
  JsonObject* groups = json::get_object_or_null(q, "config_groups", what);
  if (!groups || json_object_get_size(groups) == 0) throw Error(what + ": no 'config_groups'");
  GList* names = json_object_get_members(groups);
  try {
    for (GList* it = names; it; it = it->next) {
      const char* name = static_cast<const char*>(it->data);
      const std::string gwhat = what + " config_groups." + name;
      JsonObject* group = json::get_object_or_null(groups, name, gwhat);
      if (!group) throw Error(gwhat + ": not an object");
      refuse_member(group, "input_activations", gwhat, "only weights may be quantised (W4A16)");
      refuse_member(group, "output_activations", gwhat, "only weights may be quantised (W4A16)");
      JsonObject* w = json::get_object_or_null(group, "weights", gwhat);
      if (!w) throw Error(gwhat + ": no 'weights'");
      const std::string wwhat = gwhat + ".weights";
      if (json::get_int(w, "num_bits", wwhat) != 4) throw Error(wwhat + ": num_bits must be 4");
      if (json::get_string_or(w, "type", "int", wwhat) != "int") throw Error(wwhat + ": type must be 'int'");
      if (json::get_string_or(w, "strategy", "", wwhat) != "group") throw Error(wwhat + ": strategy must be 'group'");
      if (json::get_bool_or(w, "dynamic", false, wwhat)) throw Error(wwhat + ": dynamic weights are not supported");
      const int64_t g = json::get_int(w, "group_size", wwhat);
      if (g <= 0 || g % 8 != 0 || g > (1 << 20))
        throw Error(wwhat + ": group_size " + std::to_string(g) + " is not a positive multiple of 8");
      c.group_sizes.push_back(static_cast<int>(g));
    }
  } catch (...) {
    g_list_free(names);
    throw;
  }
  g_list_free(names);
  return c;
}

void int4_group_values(uint16_t scale_bits, bool bf16, int zero, float values[16]) {
  // The package subtracts and multiplies in the scale's dtype: the product of a small integer and
  // a 16-bit float is exact in f32, so one rounding to that dtype reproduces it.
  const float scale = bf16 ? bf16_to_float(scale_bits) : half_to_float(scale_bits);
  for (int u = 0; u < 16; ++u) {
    const float exact = static_cast<float>(u - zero) * scale;
    values[u] = bf16 ? bf16_to_float(float_to_bf16(exact)) : half_to_float(float_to_half(exact));
  }
}

size_t PackedInt4Weight::nbytes() const { return packed.nbytes() + scales.nbytes() + zero_points.nbytes(); }

kernels::Q4Weight PackedInt4Weight::ref() const {
  kernels::Q4Weight w;
  w.packed = static_cast<const int32_t*>(packed.raw_data());
  w.scales = scales.raw_data();
  w.zero_points = symmetric() ? nullptr : static_cast<const int32_t*>(zero_points.raw_data());
  w.scale_type = scales.dtype() == DType::BF16 ? kernels::WeightType::BF16 : kernels::WeightType::F16;
  w.group_size = group_size;
  return w;
}

Tensor PackedInt4Weight::dequantize() const {
  Tensor out_f32 = Tensor::zeros(DType::F32, {out, in});
  float* dst = out_f32.data<float>();
  const auto* codes = static_cast<const int32_t*>(packed.raw_data());
  const auto* scale_bits = static_cast<const uint16_t*>(scales.raw_data());
  const auto* zeros = symmetric() ? nullptr : static_cast<const int32_t*>(zero_points.raw_data());
  const bool bf16 = scales.dtype() == DType::BF16;
  const int64_t groups = in / group_size;
  for (int64_t r = 0; r < out; ++r) {
    const int32_t* row = codes + r * (in / 8);
    for (int64_t g = 0; g < groups; ++g) {
      const int z = zeros ? static_cast<int>(nibble(zeros + (r / 8) * groups + g, r % 8)) : 8;
      float values[16];
      int4_group_values(scale_bits[r * groups + g], bf16, z, values);
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) dst[r * in + c] = values[nibble(row, c)];
    }
  }
  return out_f32;
}

bool is_packed_int4(const Checkpoint& weights, const std::string& module) {
  return weights.contains(module + ".weight_packed");
}

PackedInt4Weight load_packed_int4(const Checkpoint& weights, const std::string& module, const Shape& expected) {
  const std::string packed_name = module + ".weight_packed";
  const std::string file = weights.file_of(packed_name);
  const auto fail = [&](const std::string& tensor, const std::string& why) {
    throw Error(file + ": tensor '" + tensor + "': " + why);
  };
  const auto check = [&](const Tensor& t, const std::string& name, std::initializer_list<DType> dtypes,
                         const Shape& shape) {
    bool dtype_ok = false;
    for (DType d : dtypes) dtype_ok |= t.dtype() == d;
    if (!dtype_ok) fail(name, std::string("unexpected dtype ") + dtype_name(t.dtype()));
    if (t.shape() != shape)
      fail(name, "has shape " + shape_to_string(t.shape()) + ", expected " + shape_to_string(shape));
  };
  if (expected.size() != 2) throw Error("load_packed_int4: expected shape must be {out, in}");
  PackedInt4Weight w;
  w.out = expected[0];
  w.in = expected[1];

  const std::string shape_name = module + ".weight_shape";
  const Tensor shape = weights.get(shape_name);
  check(shape, shape_name, {DType::I64, DType::I32}, {2});
  if (int_at(shape, 0) != w.out || int_at(shape, 1) != w.in)
    fail(shape_name, "says [" + std::to_string(int_at(shape, 0)) + ", " + std::to_string(int_at(shape, 1)) +
                         "], expected " + shape_to_string(expected));
  if (w.in % 8 != 0) fail(packed_name, "an input size that is not a multiple of 8 is not supported");

  w.packed = weights.get(packed_name);
  check(w.packed, packed_name, {DType::I32}, {w.out, w.in / 8});

  const std::string scale_name = module + ".weight_scale";
  w.scales = weights.get(scale_name);
  if (w.scales.rank() != 2 || w.scales.dim(1) <= 0 || w.in % w.scales.dim(1) != 0)
    fail(scale_name, "has shape " + shape_to_string(w.scales.shape()) + ", expected [" + std::to_string(w.out) +
                         ", a divisor of " + std::to_string(w.in) + "]");
  const int64_t groups = w.scales.dim(1);
  w.group_size = static_cast<int>(w.in / groups);
  if (w.group_size % 8 != 0) fail(scale_name, "group size " + std::to_string(w.group_size) + " is not a multiple of 8");
  check(w.scales, scale_name, {DType::F16, DType::BF16}, {w.out, groups});

  const std::string zero_name = module + ".weight_zero_point";
  if (weights.contains(zero_name)) {
    w.zero_points = weights.get(zero_name);
    check(w.zero_points, zero_name, {DType::I32}, {(w.out + 7) / 8, groups});
  } else {
    w.zero_points = Tensor::zeros(DType::I32, {0});
  }

  const std::string g_idx_name = module + ".weight_g_idx";
  if (weights.contains(g_idx_name)) {
    const Tensor g_idx = weights.get(g_idx_name);
    check(g_idx, g_idx_name, {DType::I32, DType::I64}, {w.in});
    // All -1: never set (the package's marker for column order).
    bool unset = true, identity = true;
    for (int64_t c = 0; c < w.in; ++c) {
      unset &= int_at(g_idx, c) == -1;
      identity &= int_at(g_idx, c) == c / w.group_size;
    }
    if (!unset && !identity) fail(g_idx_name, "reorders the columns (activation ordering), which is not supported");
  }
  return w;
}

}  // namespace moe
