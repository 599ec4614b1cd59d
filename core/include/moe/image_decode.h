// gst-moe: decoding image files (PNG, JPEG, GIF, BMP, TIFF, PNM... whatever gdk-pixbuf's
// installed loaders read) into the packed RGB8 pixels the CLIP preprocessing takes.
//
// Requests carry images as encoded file bytes, so the pipeline needs one decoder that gives the
// same pixels as the reference Python side (PIL's Image.open(...).convert("RGB")): grayscale and
// palette images are expanded to RGB, an alpha channel is dropped without compositing, EXIF
// orientation is not applied. gdk-pixbuf stays an implementation detail of the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/image.h"

namespace moe {

// The largest image decode_image accepts. A bigger one is refused from its header, before its
// pixels are allocated (a 500-byte file can declare a 100000x100000 canvas). In pixels:
constexpr int64_t kMaxDecodedImagePixels = 100'000'000;
// and on either side: far beyond any camera or scanner, and small enough that every decoded image
// resizes within kMaxResizedSide whatever the config's shortest_edge (up to kMaxPreprocessSize).
constexpr int kMaxDecodedImageSide = static_cast<int>(kMaxResizedSide / kMaxPreprocessSize);

// A decoded image: `height` rows of `width` * 3 bytes, no padding.
struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;  // packed RGB8
  ImageView view() const { return ImageView{pixels.data(), width, height, static_cast<size_t>(width) * 3}; }
};

// Decodes an image file held in memory. `what` names the image in error messages (a file
// name, a uri, "request 'q3'"); every failure (empty data, unknown format, truncated or corrupt
// data, a PNG without its IEND chunk, a JPEG without its end-of-image marker, a size beyond
// kMaxDecodedImageSide or kMaxDecodedImagePixels) throws moe::Error "<what>: <reason>".
RgbImage decode_image(const uint8_t* data, size_t size, const std::string& what);

// Reads a whole file; throws moe::Error "image file '<path>' cannot be read: <reason>".
std::vector<uint8_t> read_image_file(const std::string& path);

// read_image_file + decode_image, errors naming "image file '<path>'".
RgbImage decode_image_file(const std::string& path);

}  // namespace moe
