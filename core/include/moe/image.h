// gst-moe: CLIP image preprocessing, bit-compatible with transformers.CLIPImageProcessor.
//
// HF resizes with Pillow (Image.resize(..., BICUBIC) on the uint8 image), centre-crops, then
// rescales and normalises in float. resize_bicubic_rgb8 reproduces Pillow's 8-bit resampler
// exactly (same fixed-point coefficients and rounding), so the only differences left are float
// rounding in the last step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace moe {

// Packed RGB8 pixels: `height` rows of `width` * 3 bytes, each row starting `stride` bytes after
// the previous one (stride >= width * 3).
struct ImageView {
  const uint8_t* data;
  int width;
  int height;
  size_t stride;
};

// Preprocessing's size limits; each refusal names the limit and the sizes involved.
//
// Every size of the config (shortest_edge, the height/width of `size`, crop_size): CLIP uses 224
// or 336, and 4096 leaves room for any vision encoder while refusing a value that would ask for an
// absurd allocation (shortest_edge = 2^20 on a square image is 4.4 TB).
constexpr int kMaxPreprocessSize = 4096;
// The pixels preprocess_clip_image writes: the crop, or the whole resized image without a crop.
constexpr int64_t kMaxPreprocessOutputPixels = int64_t{kMaxPreprocessSize} * kMaxPreprocessSize;
// Each side of the resized image. The resize is evaluated only inside the centre crop, so an
// extreme aspect ratio (1x100000 resizes to 224x22400000) costs what a square image costs; the
// bound keeps pixel positions in int.
constexpr int64_t kMaxResizedSide = std::numeric_limits<int>::max();

struct ImagePreprocessConfig {
  int shortest_edge = 224;
  // When both are > 0 the image is resized to exactly this size instead (HF `size` given as
  // {"height", "width"}).
  int resize_height = 0;
  int resize_width = 0;
  int crop_height = 224;
  int crop_width = 224;
  bool do_resize = true, do_center_crop = true, do_rescale = true, do_normalize = true;
  float rescale_factor = 1.0f / 255.0f;
  float image_mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
  float image_std[3] = {0.26862954f, 0.26130258f, 0.27577711f};

  // Reads preprocessor_config.json (HF layout: size {"shortest_edge"}, {"height","width"} or an
  // int; crop_size {"height","width"} or an int; do_*; rescale_factor; image_mean; image_std;
  // resample must be 3 = bicubic). A missing file gives the defaults above.
  static ImagePreprocessConfig from_directory(const std::string& model_dir);
  static ImagePreprocessConfig from_file(const std::string& preprocessor_config_json_path);
};

// Size (width, height) the resize step produces for a width x height input (HF's
// get_resize_output_image_size); the input size itself when do_resize is false. Throws moe::Error
// for a config size outside 1..kMaxPreprocessSize or a side beyond kMaxResizedSide.
std::pair<int, int> resized_size(const ImagePreprocessConfig& cfg, int width, int height);

// Size (width, height) of preprocess_clip_image's output: the crop size when do_center_crop,
// else resized_size(). Throws moe::Error beyond kMaxPreprocessOutputPixels.
std::pair<int, int> preprocess_output_size(const ImagePreprocessConfig& cfg, int width, int height);

// Resize (Pillow-exact bicubic), centre-crop (zero-padding an image smaller than the crop, as HF
// does), rescale, normalise; writes CHW float [3, out_h, out_w] into `out`, which must hold
// 3 * out_w * out_h floats (out_w/out_h from preprocess_output_size: crop_width x crop_height
// with the default config). Only the resized pixels inside the crop are computed (the same
// values as resizing whole, then cropping), so memory and time follow the crop, not the image's
// aspect ratio. Throws moe::Error on invalid input or config.
void preprocess_clip_image(const ImageView& image, const ImagePreprocessConfig& cfg, float* out);

// Pillow's Image.resize((out_width, out_height), Image.BICUBIC) on an RGB8 image, bit-exact with
// Pillow's 8-bit path. Returns packed RGB8 (stride out_width * 3).
std::vector<uint8_t> resize_bicubic_rgb8(const ImageView& image, int out_width, int out_height);

}  // namespace moe
