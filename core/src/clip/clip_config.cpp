#include "moe/clip_config.h"

#include <limits>

#include "io/json_util.h"
#include "moe/error.h"

namespace moe {

Activation parse_activation(const std::string& name, const std::string& what) {
  if (name == "quick_gelu") return Activation::QuickGelu;
  if (name == "gelu") return Activation::Gelu;
  throw Error(what + ": unsupported hidden_act '" + name + "' (supported: quick_gelu, gelu)");
}

const char* activation_name(Activation act) { return act == Activation::QuickGelu ? "quick_gelu" : "gelu"; }

namespace {

// A size or count: 1..max (the kMaxClip* bounds).
int bounded_int(JsonObject* obj, const char* key, int fallback, int max, const std::string& what) {
  const int64_t v = json::get_int_or(obj, key, fallback, what);
  if (v <= 0 || v > max)
    throw Error(what + ": '" + key + "' is " + std::to_string(v) + ", outside 1.." + std::to_string(max));
  return static_cast<int>(v);
}

// A token id: any int (legacy configs use small ids such as 0 and 2), but not one that would wrap.
int token_id(JsonObject* obj, const char* key, int fallback, const std::string& what) {
  const int64_t v = json::get_int_or(obj, key, fallback, what);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    throw Error(what + ": '" + key + "' is " + std::to_string(v) + ", outside the int range");
  return static_cast<int>(v);
}

void read_encoder(JsonObject* obj, ClipEncoderConfig& cfg, const std::string& what) {
  cfg.hidden_size = bounded_int(obj, "hidden_size", cfg.hidden_size, kMaxClipWidth, what);
  cfg.intermediate_size = bounded_int(obj, "intermediate_size", cfg.intermediate_size, kMaxClipWidth, what);
  cfg.num_hidden_layers = bounded_int(obj, "num_hidden_layers", cfg.num_hidden_layers, kMaxClipLayers, what);
  cfg.num_attention_heads = bounded_int(obj, "num_attention_heads", cfg.num_attention_heads, kMaxClipWidth, what);
  cfg.hidden_act =
      parse_activation(json::get_string_or(obj, "hidden_act", activation_name(cfg.hidden_act), what), what);
  cfg.layer_norm_eps = static_cast<float>(json::get_double_or(obj, "layer_norm_eps", cfg.layer_norm_eps, what));
  if (cfg.hidden_size % cfg.num_attention_heads != 0)
    throw Error(what + ": hidden_size " + std::to_string(cfg.hidden_size) +
                " is not divisible by num_attention_heads " + std::to_string(cfg.num_attention_heads));
  if (!(cfg.layer_norm_eps > 0.0f)) throw Error(what + ": layer_norm_eps must be positive");
}

// A tower's settings: `<key>_dict` (the form older transformers wrote) when present, else `<key>`.
// transformers' CLIPConfig builds the tower from `<key>_dict` alone when it is there (every field
// it omits takes the class default, whatever `<key>` says), so the other object is not read.
JsonObject* tower_config(JsonObject* root, const std::string& key, std::string& used_key, const std::string& src) {
  used_key = key + "_dict";
  if (JsonObject* legacy = json::get_object_or_null(root, used_key.c_str(), src)) return legacy;
  used_key = key;
  JsonObject* current = json::get_object_or_null(root, key.c_str(), src);
  if (!current) throw Error(src + ": missing '" + key + "' (or '" + key + "_dict'; not a CLIPModel config.json?)");
  return current;
}

ClipConfig config_from_document(const json::Document& doc) {
  const std::string& src = doc.what();
  JsonObject* root = doc.root_object();
  ClipConfig cfg;
  cfg.source = src;
  // transformers' own defaults (CLIPTextConfig / CLIPVisionConfig / CLIPConfig).
  cfg.text.hidden_size = 512;
  cfg.text.intermediate_size = 2048;
  cfg.text.num_hidden_layers = 12;
  cfg.text.num_attention_heads = 8;
  cfg.vision.hidden_size = 768;
  cfg.vision.intermediate_size = 3072;
  cfg.vision.num_hidden_layers = 12;
  cfg.vision.num_attention_heads = 12;

  const std::string mt = json::get_string_or(root, "model_type", "clip", src);
  if (mt != "clip")
    throw Error(src + ": model_type is '" + mt + "', expected 'clip' (a Hugging Face CLIPModel config)");
  cfg.projection_dim = bounded_int(root, "projection_dim", cfg.projection_dim, kMaxClipWidth, src);

  std::string text_key;
  JsonObject* text = tower_config(root, "text_config", text_key, src);
  const std::string tw = src + " " + text_key;
  read_encoder(text, cfg.text, tw);
  cfg.text.vocab_size = bounded_int(text, "vocab_size", cfg.text.vocab_size, kMaxClipVocabSize, tw);
  cfg.text.max_position_embeddings =
      bounded_int(text, "max_position_embeddings", cfg.text.max_position_embeddings, kMaxClipPositions, tw);
  cfg.text.bos_token_id = token_id(text, "bos_token_id", cfg.text.bos_token_id, tw);
  cfg.text.eos_token_id = token_id(text, "eos_token_id", cfg.text.eos_token_id, tw);
  cfg.text.pad_token_id = token_id(text, "pad_token_id", cfg.text.pad_token_id, tw);

  std::string vision_key;
  JsonObject* vision = tower_config(root, "vision_config", vision_key, src);
  const std::string vw = src + " " + vision_key;
  read_encoder(vision, cfg.vision, vw);
  cfg.vision.image_size = bounded_int(vision, "image_size", cfg.vision.image_size, kMaxClipImageSize, vw);
  cfg.vision.patch_size = bounded_int(vision, "patch_size", cfg.vision.patch_size, kMaxClipImageSize, vw);
  cfg.vision.num_channels = bounded_int(vision, "num_channels", cfg.vision.num_channels, kMaxClipChannels, vw);
  if (cfg.vision.image_size % cfg.vision.patch_size != 0)
    throw Error(vw + ": image_size " + std::to_string(cfg.vision.image_size) + " is not a multiple of patch_size " +
                std::to_string(cfg.vision.patch_size));
  return cfg;
}

}  // namespace

ClipConfig ClipConfig::from_file(const std::string& path) {
  return config_from_document(json::Document::from_file(path));
}

ClipConfig ClipConfig::from_json(const std::string& json_text, const std::string& what) {
  return config_from_document(json::Document(json_text, what));
}

}  // namespace moe
