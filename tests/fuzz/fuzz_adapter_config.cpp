// Fuzz target: an adapter's adapter_config.json, through MoeConfig::from_adapter_config (what
// MoeAdapter::load reads), and the same bytes as a Hugging Face Mixtral / Qwen2-MoE config.json
// through MoeConfig::from_hf_config (what MoeLayer::load_hf_layer reads), and its
// quantization_config through Int4QuantConfig::from_hf_config (both loaders read it). An accepted
// config must pass its own validation; an accepted quantisation has valid group sizes.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "moe/moe_layer.h"
#include "moe/quantized_weights.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

namespace {

void check(const moe::MoeConfig& c) {
  MOE_FUZZ_CHECK(c.hidden_size > 0 && c.num_experts > 0 && c.intermediate_size > 0);
  MOE_FUZZ_CHECK(c.top_k >= 1 && c.top_k <= c.num_experts);
  MOE_FUZZ_CHECK(c.shared_expert_intermediate_size >= 0);
  try {
    c.validate();
  } catch (const moe::Error&) {
    MOE_FUZZ_CHECK(!"validate() refuses a config its loader accepted");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe_fuzz::MemFile file("adapter_config.json");
  const std::string& path = file.write(data, size);
  try {
    check(moe::MoeConfig::from_adapter_config(path));
  } catch (const moe::Error&) {
  }
  try {
    check(moe::MoeConfig::from_hf_config(path));
  } catch (const moe::Error&) {
  }
  try {
    if (const auto q = moe::Int4QuantConfig::from_hf_config(path))
      for (int g : q->group_sizes) MOE_FUZZ_CHECK(g > 0 && g % 8 == 0);
  } catch (const moe::Error&) {
  }
  return 0;
}
