// gst-moe: CLIP image preprocessing (transformers.CLIPImageProcessor + Pillow's bicubic resize).
#include "moe/image.h"

#include <glib.h>
#include <json-glib/json-glib.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "io/json_util.h"
#include "moe/error.h"

// The filter coefficients must round exactly as in Pillow (built without FMA contraction on
// x86-64): keep the compiler from fusing multiply-adds in this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace moe {
namespace {

// Pillow's fixed-point format for 8-bit resampling: coefficients are scaled by 2^22, leaving
// 8 bits for the pixel value and 2 bits of headroom in an int32 accumulator.
constexpr int kPrecisionBits = 32 - 8 - 2;

void validate_image(const ImageView& image, const char* who) {
  if (image.data == nullptr) throw Error(std::string(who) + ": image data is null");
  if (image.width <= 0 || image.height <= 0)
    throw Error(std::string(who) + ": image size " + std::to_string(image.width) + "x" + std::to_string(image.height) +
                " is not positive");
  if (image.stride < static_cast<size_t>(image.width) * 3)
    throw Error(std::string(who) + ": row stride " + std::to_string(image.stride) +
                " bytes is smaller than width * 3 = " + std::to_string(static_cast<size_t>(image.width) * 3));
}

// Pillow's bicubic kernel (Keys, a = -0.5), written in the same operation order.
double bicubic_filter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// For the output positions [begin, begin + count) along one axis: the first input index, the
// number of taps and the fixed-point weights (Pillow's precompute_coeffs +
// normalize_coeffs_8bpc). A position's coefficients depend only on the input and output sizes,
// so computing a range of them gives the same values as computing all.
struct AxisCoeffs {
  int ksize = 0;
  std::vector<int> first;  // first input index per output position in the range
  std::vector<int> count;  // taps per output position
  std::vector<int32_t> k;  // count * ksize weights, zero past `count`
};

AxisCoeffs precompute_coeffs(int in_size, int out_size, int out_begin, int out_count) {
  constexpr double kSupport = 2.0;  // bicubic
  const double scale = static_cast<double>(in_size) / out_size;
  // Downscaling widens the kernel so every input pixel contributes (antialiasing).
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = kSupport * filterscale;
  AxisCoeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(static_cast<size_t>(out_count));
  c.count.resize(static_cast<size_t>(out_count));
  c.k.assign(static_cast<size_t>(out_count) * static_cast<size_t>(c.ksize), 0);
  std::vector<double> w(static_cast<size_t>(c.ksize));
  for (int i = 0; i < out_count; ++i) {
    const int xx = out_begin + i;
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    // (int) truncation after + 0.5 is Pillow's rounding, kept as is.
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double v = bicubic_filter((x + xmin - center + 0.5) * ss);
      w[static_cast<size_t>(x)] = v;
      ww += v;
    }
    int32_t* k = &c.k[static_cast<size_t>(i) * static_cast<size_t>(c.ksize)];
    for (int x = 0; x < xmax; ++x) {
      double v = w[static_cast<size_t>(x)];
      if (ww != 0.0) v /= ww;
      // Round half away from zero into fixed point.
      k[x] = v < 0 ? static_cast<int32_t>(-0.5 + v * (1 << kPrecisionBits))
                   : static_cast<int32_t>(0.5 + v * (1 << kPrecisionBits));
    }
    c.first[static_cast<size_t>(i)] = xmin;
    c.count[static_cast<size_t>(i)] = xmax;
  }
  return c;
}

inline uint8_t clip8(int32_t v) {
  if (v >= (1 << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return static_cast<uint8_t>(v >> kPrecisionBits);
}

// Python's floor division by 2 (HF's centre-crop offsets can be negative when padding).
int floor_half(int v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); }

// A rectangle of output pixels, inside the output image.
struct PixelRect {
  int x, y, width, height;
};

// The pixels in `rect` of Pillow's resize of `image` to out_width x out_height, packed (stride
// rect.width * 3). Each output pixel depends only on its own input window, so this equals the
// whole resize cropped to `rect`; only the rect's coefficients, and of the input only the rows its
// vertical pass reads, are touched. The pass order is Pillow's: horizontal, then vertical.
std::vector<uint8_t> resize_rect(const ImageView& image, int out_width, int out_height, const PixelRect& rect) {
  const int in_w = image.width, in_h = image.height;
  const size_t out_row = static_cast<size_t>(rect.width) * 3;
  std::vector<uint8_t> out(out_row * static_cast<size_t>(rect.height));

  // Pillow skips a pass whose dimension is unchanged (no resampling at scale 1).
  const bool need_h = out_width != in_w;
  const bool need_v = out_height != in_h;
  if (!need_h && !need_v) {
    for (int y = 0; y < rect.height; ++y)
      std::memcpy(&out[static_cast<size_t>(y) * out_row],
                  image.data + static_cast<size_t>(rect.y + y) * image.stride + static_cast<size_t>(rect.x) * 3,
                  out_row);
    return out;
  }

  // Source of the vertical pass: the horizontally resampled rows [row0, ...) of the rect's
  // columns, or the rect's columns of the input itself when only the height changes.
  const uint8_t* src = image.data + static_cast<size_t>(rect.x) * 3;
  size_t src_stride = image.stride;
  int row0 = 0;
  std::vector<uint8_t> temp;
  AxisCoeffs vc;
  if (need_v) vc = precompute_coeffs(in_h, out_height, rect.y, rect.height);

  if (need_h) {
    const AxisCoeffs hc = precompute_coeffs(in_w, out_width, rect.x, rect.width);
    // Only the input rows the vertical pass reads (Pillow's ybox_first..ybox_last: the windows
    // move forward with the output position), or the rect's own rows when the height is kept.
    int first_row = rect.y, end_row = rect.y + rect.height;
    if (need_v) {
      first_row = vc.first.front();
      end_row = vc.first.back() + vc.count.back();
    }
    const int rows = end_row - first_row;
    temp.resize(out_row * static_cast<size_t>(rows));
    for (int y = 0; y < rows; ++y) {
      const uint8_t* in = image.data + static_cast<size_t>(first_row + y) * image.stride;
      uint8_t* o = &temp[static_cast<size_t>(y) * out_row];
      for (int xx = 0; xx < rect.width; ++xx) {
        const int32_t* k = &hc.k[static_cast<size_t>(xx) * static_cast<size_t>(hc.ksize)];
        const uint8_t* p = in + static_cast<size_t>(hc.first[static_cast<size_t>(xx)]) * 3;
        const int n = hc.count[static_cast<size_t>(xx)];
        int32_t s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
        for (int x = 0; x < n; ++x) {
          s0 += p[3 * x + 0] * k[x];
          s1 += p[3 * x + 1] * k[x];
          s2 += p[3 * x + 2] * k[x];
        }
        o[3 * xx + 0] = clip8(s0);
        o[3 * xx + 1] = clip8(s1);
        o[3 * xx + 2] = clip8(s2);
      }
    }
    if (!need_v) return temp;
    src = temp.data();
    src_stride = out_row;
    row0 = first_row;
  }

  // Vertical pass, row-wise so the inner loop runs over contiguous bytes. Integer sums are
  // order-independent, so this equals Pillow's per-pixel loop.
  std::vector<int32_t> acc(out_row);
  for (int yy = 0; yy < rect.height; ++yy) {
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    const int32_t* k = &vc.k[static_cast<size_t>(yy) * static_cast<size_t>(vc.ksize)];
    const int first = vc.first[static_cast<size_t>(yy)] - row0;
    const int n = vc.count[static_cast<size_t>(yy)];
    for (int y = 0; y < n; ++y) {
      const uint8_t* row = src + static_cast<size_t>(first + y) * src_stride;
      const int32_t w = k[y];
      for (size_t i = 0; i < out_row; ++i) acc[i] += row[i] * w;
    }
    uint8_t* o = &out[static_cast<size_t>(yy) * out_row];
    for (size_t i = 0; i < out_row; ++i) o[i] = clip8(acc[i]);
  }
  return out;
}

// A size from the config: 1..kMaxPreprocessSize pixels.
int checked_size(int64_t v, const char* field, const std::string& what) {
  if (v <= 0 || v > kMaxPreprocessSize)
    throw Error(what + ": field '" + field + "' is " + std::to_string(v) + "; a size must be 1.." +
                std::to_string(kMaxPreprocessSize) + " pixels");
  return static_cast<int>(v);
}

}  // namespace

std::vector<uint8_t> resize_bicubic_rgb8(const ImageView& image, int out_width, int out_height) {
  validate_image(image, "resize_bicubic_rgb8");
  if (out_width <= 0 || out_height <= 0)
    throw Error("resize_bicubic_rgb8: output size " + std::to_string(out_width) + "x" + std::to_string(out_height) +
                " is not positive");
  return resize_rect(image, out_width, out_height, PixelRect{0, 0, out_width, out_height});
}

std::pair<int, int> resized_size(const ImagePreprocessConfig& cfg, int width, int height) {
  if (width <= 0 || height <= 0)
    throw Error("resized_size: image size " + std::to_string(width) + "x" + std::to_string(height) +
                " is not positive");
  if (!cfg.do_resize) return {width, height};
  const std::string what = "image preprocessing";
  if (cfg.resize_height > 0 && cfg.resize_width > 0)
    return {checked_size(cfg.resize_width, "resize_width", what),
            checked_size(cfg.resize_height, "resize_height", what)};
  // HF's get_resize_output_image_size: int(size * long / short), a truncated float division.
  const int s = checked_size(cfg.shortest_edge, "shortest_edge", what);
  const int short_side = std::min(width, height);
  const int long_side = std::max(width, height);
  const double new_long_f = static_cast<double>(static_cast<int64_t>(s) * long_side) / short_side;
  if (new_long_f > static_cast<double>(kMaxResizedSide))
    throw Error(what + ": a " + std::to_string(width) + "x" + std::to_string(height) + " image resized to " +
                std::to_string(s) + " pixels on its short side would be " +
                std::to_string(static_cast<int64_t>(new_long_f)) + " pixels long, beyond the limit of " +
                std::to_string(kMaxResizedSide));
  const int new_long = static_cast<int>(new_long_f);
  if (new_long <= 0)
    throw Error(what + ": a " + std::to_string(width) + "x" + std::to_string(height) +
                " image would resize to an empty image");
  return width <= height ? std::make_pair(s, new_long) : std::make_pair(new_long, s);
}

std::pair<int, int> preprocess_output_size(const ImagePreprocessConfig& cfg, int width, int height) {
  const std::string what = "image preprocessing";
  if (cfg.do_center_crop)
    return {checked_size(cfg.crop_width, "crop_width", what), checked_size(cfg.crop_height, "crop_height", what)};
  const auto [rw, rh] = resized_size(cfg, width, height);
  if (static_cast<int64_t>(rw) * rh > kMaxPreprocessOutputPixels)
    throw Error(what + ": without a centre crop the output is the whole " + std::to_string(rw) + "x" +
                std::to_string(rh) + " resized image of a " + std::to_string(width) + "x" + std::to_string(height) +
                " image, beyond the limit of " + std::to_string(kMaxPreprocessOutputPixels) + " pixels");
  return {rw, rh};
}

void preprocess_clip_image(const ImageView& image, const ImagePreprocessConfig& cfg, float* out) {
  validate_image(image, "preprocess_clip_image");
  if (out == nullptr) throw Error("preprocess_clip_image: output buffer is null");
  for (int c = 0; c < 3; ++c)
    if (cfg.do_normalize && cfg.image_std[c] == 0.0f)
      throw Error("preprocess_clip_image: image_std[" + std::to_string(c) + "] is zero");

  const auto [rw, rh] = resized_size(cfg, image.width, image.height);
  const auto [ow, oh] = preprocess_output_size(cfg, image.width, image.height);

  // Centre crop (HF: top = (h - crop_h) // 2); positions outside the resized image are the zero
  // padding HF adds when the image is smaller than the crop.
  const int top = cfg.do_center_crop ? floor_half(rh - oh) : 0;
  const int left = cfg.do_center_crop ? floor_half(rw - ow) : 0;
  // The part of the resized image the crop keeps (never empty): only it is resized.
  const int kept_x = std::max(left, 0), kept_y = std::max(top, 0);
  const PixelRect kept{kept_x, kept_y, std::min(left + ow, rw) - kept_x, std::min(top + oh, rh) - kept_y};
  std::vector<uint8_t> resized;
  ImageView src{image.data + static_cast<size_t>(kept.y) * image.stride + static_cast<size_t>(kept.x) * 3, kept.width,
                kept.height, image.stride};
  if (rw != image.width || rh != image.height) {
    resized = resize_rect(image, rw, rh, kept);
    src = ImageView{resized.data(), kept.width, kept.height, static_cast<size_t>(kept.width) * 3};
  }

  // HF rescales uint8 * factor in float64 then casts to float32, and normalises in float32.
  // The config holds a float; recover the double HF uses when the factor is 1/n (1/255).
  double factor = cfg.rescale_factor;
  if (factor > 0.0) {
    const double n = std::round(1.0 / factor);
    if (n > 0.0 && static_cast<float>(1.0 / n) == cfg.rescale_factor) factor = 1.0 / n;
  }
  float lut[3][256];
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      float x = cfg.do_rescale ? static_cast<float>(v * factor) : static_cast<float>(v);
      if (cfg.do_normalize) x = (x - cfg.image_mean[c]) / cfg.image_std[c];
      lut[c][v] = x;
    }
  }

  // Crop position (x, y) is resized pixel (x + left, y + top), i.e. src pixel (sx, sy).
  const size_t plane = static_cast<size_t>(ow) * static_cast<size_t>(oh);
  for (int y = 0; y < oh; ++y) {
    const int sy = y + top - kept.y;
    float* o0 = out + static_cast<size_t>(y) * static_cast<size_t>(ow);
    float* o1 = o0 + plane;
    float* o2 = o1 + plane;
    const bool row_in = sy >= 0 && sy < src.height;
    const uint8_t* row = row_in ? src.data + static_cast<size_t>(sy) * src.stride : nullptr;
    for (int x = 0; x < ow; ++x) {
      const int sx = x + left - kept.x;
      if (row_in && sx >= 0 && sx < src.width) {
        const uint8_t* p = row + static_cast<size_t>(sx) * 3;
        o0[x] = lut[0][p[0]];
        o1[x] = lut[1][p[1]];
        o2[x] = lut[2][p[2]];
      } else {
        o0[x] = lut[0][0];
        o1[x] = lut[1][0];
        o2[x] = lut[2][0];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// preprocessor_config.json

namespace {

// A size in pixels; HF would accept any int, we refuse absurd ones (kMaxPreprocessSize).
int size_field(JsonObject* obj, const char* key, const std::string& what) {
  return checked_size(json::get_int(obj, key, what), key, what);
}

void read_mean_std(JsonObject* root, const char* key, float (&dst)[3], const std::string& what) {
  if (!json::has_member(root, key)) return;
  JsonNode* node = json_object_get_member(root, key);
  std::vector<double> v;
  if (JSON_NODE_HOLDS_VALUE(node)) {
    v.assign(3, json::get_double_or(root, key, 0.0, what));  // HF accepts one value for all channels
  } else {
    v = json::get_double_array_or(root, key, {}, what);
  }
  if (v.size() != 3)
    throw Error(what + ": field '" + key + "' must have 3 values (RGB), got " + std::to_string(v.size()));
  for (int c = 0; c < 3; ++c) dst[c] = static_cast<float>(v[static_cast<size_t>(c)]);
}

}  // namespace

ImagePreprocessConfig ImagePreprocessConfig::from_file(const std::string& path) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* root = doc.root_object();
  const std::string& what = path;
  ImagePreprocessConfig cfg;

  if (json::has_member(root, "size")) {
    JsonNode* node = json_object_get_member(root, "size");
    if (JSON_NODE_HOLDS_OBJECT(node)) {
      JsonObject* size = json_node_get_object(node);
      const std::string swhat = path + " size";
      if (json::has_member(size, "shortest_edge")) {
        cfg.shortest_edge = size_field(size, "shortest_edge", swhat);
      } else if (json::has_member(size, "height") && json::has_member(size, "width")) {
        cfg.resize_height = size_field(size, "height", swhat);
        cfg.resize_width = size_field(size, "width", swhat);
      } else {
        throw Error(swhat + ": expected 'shortest_edge' or 'height' and 'width'");
      }
    } else {
      // A bare int means the shortest edge for CLIP (get_size_dict(default_to_square=False)).
      cfg.shortest_edge = size_field(root, "size", what);
    }
  }
  if (json::has_member(root, "crop_size")) {
    JsonNode* node = json_object_get_member(root, "crop_size");
    if (JSON_NODE_HOLDS_OBJECT(node)) {
      JsonObject* crop = json_node_get_object(node);
      const std::string cwhat = path + " crop_size";
      cfg.crop_height = size_field(crop, "height", cwhat);
      cfg.crop_width = size_field(crop, "width", cwhat);
    } else {
      cfg.crop_height = cfg.crop_width = size_field(root, "crop_size", what);
    }
  }
  cfg.do_resize = json::get_bool_or(root, "do_resize", cfg.do_resize, what);
  cfg.do_center_crop = json::get_bool_or(root, "do_center_crop", cfg.do_center_crop, what);
  cfg.do_rescale = json::get_bool_or(root, "do_rescale", cfg.do_rescale, what);
  cfg.do_normalize = json::get_bool_or(root, "do_normalize", cfg.do_normalize, what);
  cfg.rescale_factor = static_cast<float>(json::get_double_or(root, "rescale_factor", cfg.rescale_factor, what));
  read_mean_std(root, "image_mean", cfg.image_mean, what);
  read_mean_std(root, "image_std", cfg.image_std, what);
  for (int c = 0; c < 3; ++c)
    if (cfg.image_std[c] == 0.0f) throw Error(what + ": field 'image_std' has a zero value");

  const int64_t resample = json::get_int_or(root, "resample", 3, what);
  if (resample != 3)
    throw Error(what + ": field 'resample' is " + std::to_string(resample) +
                "; only 3 (bicubic, CLIP's filter) is supported");
  return cfg;
}

ImagePreprocessConfig ImagePreprocessConfig::from_directory(const std::string& model_dir) {
  const std::string path = model_dir + "/preprocessor_config.json";
  // A model directory without the file uses CLIP's standard preprocessing.
  if (!g_file_test(path.c_str(), G_FILE_TEST_EXISTS)) return ImagePreprocessConfig{};
  return from_file(path);
}

}  // namespace moe
