// Fuzz target: preprocessor_config.json, through ImagePreprocessConfig::from_file (on an in-memory
// file); an accepted config then sizes the preprocessing of a few image sizes, as moe-encode does
// for every image it receives.
#include <cstddef>
#include <cstdint>
#include <utility>

#include "fuzz_util.h"
#include "moe/image.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe_fuzz::MemFile file("preprocessor_config.json");
  const std::string& path = file.write(data, size);
  try {
    const moe::ImagePreprocessConfig cfg = moe::ImagePreprocessConfig::from_file(path);
    const std::pair<int, int> sizes[] = {{1, 1}, {640, 480}, {3, 4000}, {1 << 14, 1 << 14}};
    for (const auto& [w, h] : sizes) {
      try {
        const auto [rw, rh] = moe::resized_size(cfg, w, h);
        const auto [ow, oh] = moe::preprocess_output_size(cfg, w, h);
        MOE_FUZZ_CHECK(rw > 0 && rh > 0 && ow > 0 && oh > 0);
      } catch (const moe::Error&) {
      }
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
