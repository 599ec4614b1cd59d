// Fuzz target: a CLIP model's config.json (Hugging Face CLIPModel layout), through
// ClipConfig::from_json, the parser ClipConfig::from_file and ClipModel::load use. An accepted
// config must describe encoders the engine can size.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "moe/clip_config.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const moe::ClipConfig cfg = moe::ClipConfig::from_json(text, "config.json");
    for (const moe::ClipEncoderConfig* e : {static_cast<const moe::ClipEncoderConfig*>(&cfg.text),
                                            static_cast<const moe::ClipEncoderConfig*>(&cfg.vision)}) {
      MOE_FUZZ_CHECK(e->hidden_size > 0 && e->num_attention_heads > 0 && e->intermediate_size > 0);
      MOE_FUZZ_CHECK(e->hidden_size % e->num_attention_heads == 0 && e->head_dim() > 0);
      MOE_FUZZ_CHECK(e->layer_norm_eps > 0.0f);
    }
    MOE_FUZZ_CHECK(cfg.vision.patch_size > 0 && cfg.vision.image_size % cfg.vision.patch_size == 0);
    MOE_FUZZ_CHECK(cfg.vision.grid() > 0 && cfg.projection_dim > 0);
  } catch (const moe::Error&) {
  }
  return 0;
}
