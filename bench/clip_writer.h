// A synthetic Hugging Face CLIP model directory with random weights: config.json and
// model.safetensors with the tensor names transformers' CLIPModel uses (so the same directory
// loads in transformers too). For benchmarks: timings need real shapes, not trained values.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.h"

namespace moe::bench {

struct ClipShape {
  int64_t text_hidden = 512, text_inter = 2048, text_layers = 12, text_heads = 8;
  int64_t vocab = 49408, max_positions = 77;
  int64_t vision_hidden = 768, vision_inter = 3072, vision_layers = 12, vision_heads = 12;
  int64_t image_size = 224, patch_size = 32, channels = 3;
  int64_t projection_dim = 512;

  // openai/clip-vit-base-patch32's shapes.
  static ClipShape vit_b32() { return {}; }
};

namespace detail {

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  enum Init { Normalish, Ones, Small, Scalar } init;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

inline void plan_encoder(std::vector<PlannedTensor>& t, const std::string& prefix, int64_t H, int64_t I,
                         int64_t layers) {
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = prefix + "encoder.layers." + std::to_string(l) + ".";
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"}) {
      t.push_back({p + "self_attn." + proj + ".weight", {H, H}, PlannedTensor::Normalish});
      t.push_back({p + "self_attn." + proj + ".bias", {H}, PlannedTensor::Small});
    }
    t.push_back({p + "layer_norm1.weight", {H}, PlannedTensor::Ones});
    t.push_back({p + "layer_norm1.bias", {H}, PlannedTensor::Small});
    t.push_back({p + "mlp.fc1.weight", {I, H}, PlannedTensor::Normalish});
    t.push_back({p + "mlp.fc1.bias", {I}, PlannedTensor::Small});
    t.push_back({p + "mlp.fc2.weight", {H, I}, PlannedTensor::Normalish});
    t.push_back({p + "mlp.fc2.bias", {H}, PlannedTensor::Small});
    t.push_back({p + "layer_norm2.weight", {H}, PlannedTensor::Ones});
    t.push_back({p + "layer_norm2.bias", {H}, PlannedTensor::Small});
  }
}

// Writes `t` as f32 tensors with random values (by their Init) to the safetensors file `path`.
inline void write_planned_safetensors(const std::string& path, const std::vector<PlannedTensor>& t, uint64_t seed) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t offset = 0;
  for (const PlannedTensor& p : t) {
    const uint64_t bytes = static_cast<uint64_t>(p.numel()) * 4;
    header += ",\"" + p.name + "\":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < p.shape.size(); ++i) header += (i ? "," : "") + std::to_string(p.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8) header += ' ';

  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error("cannot write " + path);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  Rng rng(seed);
  std::vector<float> buf;
  for (const PlannedTensor& p : t) {
    buf.resize(static_cast<size_t>(p.numel()));
    for (float& v : buf) {
      switch (p.init) {
        case PlannedTensor::Normalish:
          v = rng.symmetric(0.035f);
          break;  // sd ≈ 0.02 (transformers' init)
        case PlannedTensor::Ones:
          v = 1.0f + rng.symmetric(0.01f);
          break;
        case PlannedTensor::Small:
          v = rng.symmetric(0.01f);
          break;
        case PlannedTensor::Scalar:
          v = 2.6592f;
          break;  // log(1/0.07), CLIP's initial logit scale
      }
    }
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 4));
  }
  if (!f) throw Error("error writing " + path);
}

}  // namespace detail

// Writes `dir`/config.json and `dir`/model.safetensors (f32). The directory must exist.
inline void write_random_clip(const std::string& dir, const ClipShape& s, uint64_t seed) {
  using detail::PlannedTensor;
  std::vector<PlannedTensor> t;
  t.push_back({"text_model.embeddings.token_embedding.weight", {s.vocab, s.text_hidden}, PlannedTensor::Normalish});
  t.push_back(
      {"text_model.embeddings.position_embedding.weight", {s.max_positions, s.text_hidden}, PlannedTensor::Normalish});
  detail::plan_encoder(t, "text_model.", s.text_hidden, s.text_inter, s.text_layers);
  t.push_back({"text_model.final_layer_norm.weight", {s.text_hidden}, PlannedTensor::Ones});
  t.push_back({"text_model.final_layer_norm.bias", {s.text_hidden}, PlannedTensor::Small});
  const int64_t grid = s.image_size / s.patch_size;
  t.push_back({"vision_model.embeddings.class_embedding", {s.vision_hidden}, PlannedTensor::Normalish});
  t.push_back({"vision_model.embeddings.patch_embedding.weight",
               {s.vision_hidden, s.channels, s.patch_size, s.patch_size},
               PlannedTensor::Normalish});
  t.push_back({"vision_model.embeddings.position_embedding.weight",
               {grid * grid + 1, s.vision_hidden},
               PlannedTensor::Normalish});
  t.push_back({"vision_model.pre_layrnorm.weight", {s.vision_hidden}, PlannedTensor::Ones});
  t.push_back({"vision_model.pre_layrnorm.bias", {s.vision_hidden}, PlannedTensor::Small});
  detail::plan_encoder(t, "vision_model.", s.vision_hidden, s.vision_inter, s.vision_layers);
  t.push_back({"vision_model.post_layernorm.weight", {s.vision_hidden}, PlannedTensor::Ones});
  t.push_back({"vision_model.post_layernorm.bias", {s.vision_hidden}, PlannedTensor::Small});
  t.push_back({"visual_projection.weight", {s.projection_dim, s.vision_hidden}, PlannedTensor::Normalish});
  t.push_back({"text_projection.weight", {s.projection_dim, s.text_hidden}, PlannedTensor::Normalish});
  t.push_back({"logit_scale", {}, PlannedTensor::Scalar});

  detail::write_planned_safetensors(dir + "/model.safetensors", t, seed);

  std::ofstream c(dir + "/config.json");
  c << "{\n"
    << "  \"architectures\": [\"CLIPModel\"],\n"
    << "  \"model_type\": \"clip\",\n"
    << "  \"projection_dim\": " << s.projection_dim << ",\n"
    << "  \"logit_scale_init_value\": 2.6592,\n"
    << "  \"text_config\": {\n"
    << "    \"model_type\": \"clip_text_model\",\n"
    << "    \"hidden_size\": " << s.text_hidden << ",\n"
    << "    \"intermediate_size\": " << s.text_inter << ",\n"
    << "    \"num_hidden_layers\": " << s.text_layers << ",\n"
    << "    \"num_attention_heads\": " << s.text_heads << ",\n"
    << "    \"max_position_embeddings\": " << s.max_positions << ",\n"
    << "    \"vocab_size\": " << s.vocab << ",\n"
    << "    \"hidden_act\": \"quick_gelu\",\n"
    << "    \"layer_norm_eps\": 1e-05,\n"
    << "    \"bos_token_id\": 49406,\n"
    << "    \"eos_token_id\": 49407,\n"
    << "    \"pad_token_id\": 1,\n"
    << "    \"projection_dim\": " << s.projection_dim << "\n"
    << "  },\n"
    << "  \"vision_config\": {\n"
    << "    \"model_type\": \"clip_vision_model\",\n"
    << "    \"hidden_size\": " << s.vision_hidden << ",\n"
    << "    \"intermediate_size\": " << s.vision_inter << ",\n"
    << "    \"num_hidden_layers\": " << s.vision_layers << ",\n"
    << "    \"num_attention_heads\": " << s.vision_heads << ",\n"
    << "    \"image_size\": " << s.image_size << ",\n"
    << "    \"patch_size\": " << s.patch_size << ",\n"
    << "    \"num_channels\": " << s.channels << ",\n"
    << "    \"hidden_act\": \"quick_gelu\",\n"
    << "    \"layer_norm_eps\": 1e-05,\n"
    << "    \"projection_dim\": " << s.projection_dim << "\n"
    << "  }\n"
    << "}\n";
  if (!c) throw Error("error writing " + dir + "/config.json");
}

// A synthetic MoE adapter directory (docs/model-formats.md: adapter_config.json +
// adapter.safetensors) with random weights, for a CLIP of projection width `hidden`.
inline void write_random_adapter(const std::string& dir, int64_t hidden, int64_t experts, int64_t top_k, int64_t inter,
                                 uint64_t seed) {
  using detail::PlannedTensor;
  std::vector<PlannedTensor> t = {{"gate.weight", {experts, hidden}, PlannedTensor::Normalish}};
  for (int64_t e = 0; e < experts; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    t.push_back({p + "w1.weight", {inter, hidden}, PlannedTensor::Normalish});
    t.push_back({p + "w2.weight", {hidden, inter}, PlannedTensor::Normalish});
    t.push_back({p + "w3.weight", {inter, hidden}, PlannedTensor::Normalish});
  }
  detail::write_planned_safetensors(dir + "/adapter.safetensors", t, seed);
  std::ofstream c(dir + "/adapter_config.json");
  c << "{\"format\": \"gst-moe-adapter\", \"version\": 1, \"hidden_size\": " << hidden
    << ", \"num_experts\": " << experts << ", \"top_k\": " << top_k << ", \"intermediate_size\": " << inter
    << ", \"routing\": \"mixtral\", \"norm_topk_prob\": true, \"shared_expert_intermediate_size\": 0}\n";
  if (!c) throw Error("cannot write " + dir + "/adapter_config.json");
}

}  // namespace moe::bench
