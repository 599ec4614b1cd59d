// gst-moe: CLIP model configuration, read from a Hugging Face `config.json` (CLIPModel layout).
#pragma once

#include <cstdint>
#include <string>

namespace moe {

// Upper bounds on config.json's sizes, each refused beyond with an error naming the field and the
// bound. Far above any CLIP (ViT-bigG/14: width 1664, MLP 8192, 48 layers, image 224, patch 14;
// text: 49408 tokens, 77 positions), and low enough that every product of them (tensor shapes,
// the (image_size / patch_size)^2 position table) stays far inside int64.
constexpr int kMaxClipWidth = 1 << 16;      // hidden_size, intermediate_size, num_attention_heads, projection_dim
constexpr int kMaxClipLayers = 1024;        // num_hidden_layers
constexpr int kMaxClipVocabSize = 1 << 20;  // vocab_size
constexpr int kMaxClipPositions = 1 << 16;  // max_position_embeddings
constexpr int kMaxClipImageSize = 4096;     // image_size, patch_size (as preprocessing's kMaxPreprocessSize)
constexpr int kMaxClipChannels = 64;        // num_channels

enum class Activation { QuickGelu, Gelu };

// Parses a Hugging Face `hidden_act` value; throws moe::Error naming `what` for others.
Activation parse_activation(const std::string& name, const std::string& what);
const char* activation_name(Activation act);

// Fields shared by both towers. Defaults are those of transformers' CLIP config classes, so
// a config.json that omits a field means what it means to transformers.
struct ClipEncoderConfig {
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  Activation hidden_act = Activation::QuickGelu;
  float layer_norm_eps = 1e-5f;
  int head_dim() const { return hidden_size / num_attention_heads; }
};

struct ClipTextConfig : ClipEncoderConfig {
  int vocab_size = 49408;
  int max_position_embeddings = 77;
  int bos_token_id = 49406;
  int eos_token_id = 49407;
  int pad_token_id = 1;
};

struct ClipVisionConfig : ClipEncoderConfig {
  int image_size = 224;
  int patch_size = 32;
  int num_channels = 3;
  int grid() const { return image_size / patch_size; }
  // In 64 bits: a config built in code is not bounded by the reader's limits.
  int64_t num_positions() const { return int64_t{grid()} * grid() + 1; }
};

struct ClipConfig {
  ClipTextConfig text;
  ClipVisionConfig vision;
  int projection_dim = 512;
  std::string source;  // the file it came from, for messages

  // Each tower is read from `text_config_dict` / `vision_config_dict` (older transformers' form)
  // when present and not null, else from `text_config` / `vision_config`, as CLIPConfig does.
  static ClipConfig from_file(const std::string& config_json_path);
  // `what` names the origin in error messages.
  static ClipConfig from_json(const std::string& json_text, const std::string& what);
};

}  // namespace moe
