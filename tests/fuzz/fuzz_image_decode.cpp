// Fuzz target: image file bytes (image_base64 requests, catalog images), through
// moe::decode_image (gdk-pixbuf and its installed loaders: PNG, JPEG, GIF, BMP, ICO, TIFF, PNM,
// TGA, XPM, XBM, SVG...). Only the engine's code is instrumented for coverage; the loaders run as
// installed, so this finds the engine's mistakes around them (size checks, truncation detection,
// the RGB copy), and crashes inside the loaders as crashes.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "moe/image_decode.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Criticals only: gdk-pixbuf warns about its own loaders' bugs on bad input ("Bug! loader 'pnm'
  // didn't set an error on failure"), after which decode_image refuses the image all the same.
  moe_fuzz::init_glib(G_LOG_LEVEL_CRITICAL);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moe::RgbImage image = moe::decode_image(data, size, "fuzz image");
    MOE_FUZZ_CHECK(image.width > 0 && image.height > 0);
    MOE_FUZZ_CHECK(static_cast<int64_t>(image.width) * image.height <= moe::kMaxDecodedImagePixels);
    MOE_FUZZ_CHECK(image.pixels.size() == static_cast<size_t>(image.width) * static_cast<size_t>(image.height) * 3);
  } catch (const moe::Error&) {
  }
  return 0;
}
