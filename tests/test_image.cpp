// CLIP image preprocessing: compared with transformers.CLIPImageProcessor output recorded in
// tests/fixtures/preprocess.safetensors, plus unit checks of the Pillow-exact bicubic resize.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/json_util.h"
#include "moe/error.h"
#include "moe/image.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"
#include "moe_build_config.h"
#include "test_util.h"

using moe::test::expect_error;
using moe::test::fixture_path;
using moe::test::make_png;
using moe::test::png_file;

namespace {

moe::ImageView view_of(const std::vector<uint8_t>& px, int w, int h) {
  return moe::ImageView{px.data(), w, h, static_cast<size_t>(w) * 3};
}

// Caps this process's address space at what it uses now plus `headroom` bytes, so that a large
// allocation throws bad_alloc instead of succeeding. For death-test children only.
void limit_address_space(size_t headroom) {
  size_t pages = 0;
  std::ifstream("/proc/self/statm") >> pages;
  const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + headroom;
  const rlimit limit{cap, cap};
  if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(3);
}

TEST(ClipImagePreprocess, MatchesHuggingFaceFixture) {
  const moe::SafetensorsFile f = moe::SafetensorsFile::open(fixture_path("preprocess.safetensors"));
  const moe::ImagePreprocessConfig cfg;  // CLIP defaults, as used to record the fixture
  int images = 0;
  for (int i = 0;; ++i) {
    const std::string prefix = "image" + std::to_string(i);
    if (!f.contains(prefix + ".rgb")) break;
    ++images;
    const moe::Tensor rgb = f.get(prefix + ".rgb");
    ASSERT_EQ(rgb.dtype(), moe::DType::U8) << prefix;
    ASSERT_EQ(rgb.rank(), 3) << prefix;
    ASSERT_EQ(rgb.shape()[2], 3) << prefix;
    const int h = static_cast<int>(rgb.shape()[0]);
    const int w = static_cast<int>(rgb.shape()[1]);
    const moe::ImageView view{rgb.data<uint8_t>(), w, h, static_cast<size_t>(w) * 3};

    if (f.contains(prefix + ".resized_hw")) {
      const moe::Tensor hw = f.get(prefix + ".resized_hw");
      const auto [rw, rh] = moe::resized_size(cfg, w, h);
      EXPECT_EQ(rh, hw.data<int32_t>()[0]) << prefix << " resized height";
      EXPECT_EQ(rw, hw.data<int32_t>()[1]) << prefix << " resized width";
    }

    const moe::Tensor ref = f.get(prefix + ".pixel_values").to_f32();
    ASSERT_EQ(ref.shape(), (moe::Shape{3, cfg.crop_height, cfg.crop_width})) << prefix;
    std::vector<float> out(static_cast<size_t>(3 * cfg.crop_height * cfg.crop_width));
    moe::preprocess_clip_image(view, cfg, out.data());

    // Compare in the 0..1 pixel scale (|diff| * std): the reference is stored as float16.
    const size_t plane = static_cast<size_t>(cfg.crop_height) * static_cast<size_t>(cfg.crop_width);
    double max_diff = 0.0;
    size_t beyond_f16_rounding = 0;
    for (size_t k = 0; k < out.size(); ++k) {
      const int c = static_cast<int>(k / plane);
      const double r = ref.data<float>()[k];
      const double raw = std::fabs(static_cast<double>(out[k]) - r);
      max_diff = std::max(max_diff, raw * cfg.image_std[c]);
      // An exact pipeline differs from the float16 reference by at most half a float16 step.
      int e = 0;
      std::frexp(std::max(std::fabs(r), 6.2e-5), &e);  // |r| in [2^(e-1), 2^e)
      if (raw > std::ldexp(1.0, e - 1 - 11)) ++beyond_f16_rounding;
    }
    std::cout << "[ INFO     ] " << prefix << " " << w << "x" << h << ": max |diff| = " << max_diff * 255.0
              << " / 255 (pixel scale), " << beyond_f16_rounding << " values beyond float16 rounding\n";
    EXPECT_LE(max_diff, 2.0 / 255.0 + 1e-4) << prefix;
    // Pillow-exact resize: expected to be 0; allow a handful for float rounding ties.
    EXPECT_LE(beyond_f16_rounding, out.size() / 10000) << prefix;
  }
  EXPECT_GE(images, 1) << "no image<i>.rgb tensors in the fixture";
}

TEST(ResizeBicubic, IdentityReturnsSameBytes) {
  // A padded stride: the output is packed.
  const int w = 5, h = 4;
  const size_t stride = w * 3 + 7;
  std::vector<uint8_t> px(stride * h, 0xEE);
  std::vector<uint8_t> packed;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w * 3; ++x) {
      px[y * stride + x] = static_cast<uint8_t>(y * 31 + x * 7);
      packed.push_back(px[y * stride + x]);
    }
  EXPECT_EQ(moe::resize_bicubic_rgb8(moe::ImageView{px.data(), w, h, stride}, w, h), packed);
}

TEST(ResizeBicubic, UpscaleMatchesPillow) {
  // Pillow 9.4: Image.fromarray(a).resize((4, 4), Image.BICUBIC)
  const std::vector<uint8_t> a = {0, 10, 200, 255, 20, 100, 255, 30, 0, 0, 40, 50};
  const std::vector<uint8_t> want = {0,  7,   227, 40, 10,  194, 215, 16,  128, 255, 19, 94,  53, 13, 166, 84,
                                     16, 144, 171, 22, 104, 202, 25,  83,  202, 25,  43, 171, 28, 45, 84,  34,
                                     57, 53,  37,  62, 255, 31,  0,   215, 34,  0,   40, 40,  33, 0,  43,  51};
  EXPECT_EQ(moe::resize_bicubic_rgb8(view_of(a, 2, 2), 4, 4), want);

  // A constant image stays constant.
  const std::vector<uint8_t> flat(2 * 2 * 3, 100);
  const std::vector<uint8_t> up = moe::resize_bicubic_rgb8(view_of(flat, 2, 2), 4, 4);
  EXPECT_TRUE(std::all_of(up.begin(), up.end(), [](uint8_t v) { return v == 100; }));
}

TEST(ResizeBicubic, DownscaleMatchesPillow) {
  // Pillow 9.4: (np.arange(105).reshape(5, 7, 3) * 2) resized to (3, 2), BICUBIC
  std::vector<uint8_t> a(5 * 7 * 3);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 2);
  const std::vector<uint8_t> want = {40, 42, 44, 54, 56, 58, 68, 70, 72, 136, 138, 140, 150, 152, 154, 164, 166, 168};
  EXPECT_EQ(moe::resize_bicubic_rgb8(view_of(a, 7, 5), 3, 2), want);
}

TEST(ResizeBicubic, BadInputThrows) {
  const std::vector<uint8_t> px(4 * 4 * 3, 0);
  expect_error([&] { moe::resize_bicubic_rgb8(moe::ImageView{nullptr, 4, 4, 12}, 2, 2); }, {"null"});
  expect_error([&] { moe::resize_bicubic_rgb8(moe::ImageView{px.data(), 0, 4, 12}, 2, 2); }, {"not positive"});
  expect_error([&] { moe::resize_bicubic_rgb8(moe::ImageView{px.data(), 4, -1, 12}, 2, 2); }, {"not positive"});
  expect_error([&] { moe::resize_bicubic_rgb8(moe::ImageView{px.data(), 4, 4, 11}, 2, 2); }, {"stride", "11"});
  expect_error([&] { moe::resize_bicubic_rgb8(view_of(px, 4, 4), 0, 2); }, {"output size", "not positive"});
  std::vector<float> out(3 * 224 * 224);
  expect_error([&] { moe::preprocess_clip_image(moe::ImageView{nullptr, 4, 4, 12}, {}, out.data()); }, {"null"});
  expect_error([&] { moe::preprocess_clip_image(view_of(px, 4, 4), {}, nullptr); }, {"output buffer"});
}

TEST(ClipImagePreprocess, OutputSizes) {
  moe::ImagePreprocessConfig cfg;
  // HF: shortest edge to 224, the other int(224 * long / short).
  EXPECT_EQ(moe::resized_size(cfg, 320, 241), std::make_pair(297, 224));
  EXPECT_EQ(moe::resized_size(cfg, 97, 131), std::make_pair(224, 302));
  EXPECT_EQ(moe::resized_size(cfg, 224, 224), std::make_pair(224, 224));
  EXPECT_EQ(moe::preprocess_output_size(cfg, 320, 241), std::make_pair(224, 224));
  cfg.do_center_crop = false;
  EXPECT_EQ(moe::preprocess_output_size(cfg, 320, 241), std::make_pair(297, 224));
  cfg.do_resize = false;
  EXPECT_EQ(moe::preprocess_output_size(cfg, 320, 241), std::make_pair(320, 241));
}

TEST(ClipImagePreprocess, SmallImageIsZeroPaddedWhenNotResized) {
  moe::ImagePreprocessConfig cfg;
  cfg.do_resize = false;
  cfg.crop_width = 4;
  cfg.crop_height = 3;
  cfg.do_normalize = false;
  const std::vector<uint8_t> px(2 * 1 * 3, 255);  // 2x1 white
  std::vector<float> out(3 * 3 * 4, -1.0f);
  moe::preprocess_clip_image(view_of(px, 2, 1), cfg, out.data());
  // HF pads with ceil((crop - size) / 2) before: the pixels land at row 1, columns 1..2.
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 3; ++y)
      for (int x = 0; x < 4; ++x) {
        const float want = (y == 1 && (x == 1 || x == 2)) ? 1.0f : 0.0f;
        EXPECT_FLOAT_EQ(out[static_cast<size_t>((c * 3 + y) * 4 + x)], want) << c << "," << y << "," << x;
      }
}

// What preprocess_clip_image computed before it resized only the crop: the whole image resized,
// then HF's centre crop (zero padding outside), as uint8 values.
std::vector<float> resize_whole_then_crop(const moe::ImageView& image, const moe::ImagePreprocessConfig& cfg) {
  const auto [rw, rh] = moe::resized_size(cfg, image.width, image.height);
  const auto [ow, oh] = moe::preprocess_output_size(cfg, image.width, image.height);
  const std::vector<uint8_t> resized = moe::resize_bicubic_rgb8(image, rw, rh);  // identity when same size
  const int top = cfg.do_center_crop ? static_cast<int>(std::floor((rh - oh) / 2.0)) : 0;
  const int left = cfg.do_center_crop ? static_cast<int>(std::floor((rw - ow) / 2.0)) : 0;
  std::vector<float> out(static_cast<size_t>(3 * ow * oh), 0.0f);
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < oh; ++y)
      for (int x = 0; x < ow; ++x) {
        const int sy = y + top, sx = x + left;
        if (sy >= 0 && sy < rh && sx >= 0 && sx < rw)
          out[static_cast<size_t>((c * oh + y) * ow + x)] = resized[static_cast<size_t>((sy * rw + sx) * 3 + c)];
      }
  return out;
}

TEST(ClipImagePreprocess, ResizingOnlyTheCropEqualsResizingWholeThenCropping) {
  std::mt19937 rng(20240611);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::pair<int, int>> sizes;
  for (int n : {1, 2, 3, 7, 97, 500}) sizes.insert(sizes.end(), {{1, n}, {n, 1}, {2, n}, {n, 3}});
  for (int i = 0; i < 300; ++i) sizes.emplace_back(uniform(1, 64), uniform(1, 64));
  int compared = 0;
  for (const auto& [w, h] : sizes) {
    moe::ImagePreprocessConfig cfg;
    cfg.do_rescale = cfg.do_normalize = false;  // the output is then the uint8 values themselves
    cfg.shortest_edge = uniform(1, 40);         // down- and upscaling, odd and even
    cfg.crop_width = uniform(1, 40);            // crops inside and larger than the resized image
    cfg.crop_height = uniform(1, 40);
    if (uniform(0, 9) == 0) cfg.do_resize = false;
    if (uniform(0, 9) == 0) cfg.do_center_crop = false;
    if (uniform(0, 9) == 0) {  // HF's {"height", "width"} size
      cfg.resize_width = uniform(1, 40);
      cfg.resize_height = uniform(1, 40);
    }
    // A padded row stride: the unresized path reads the crop in place.
    const size_t stride = static_cast<size_t>(w) * 3 + static_cast<size_t>(uniform(0, 5));
    std::vector<uint8_t> px(stride * static_cast<size_t>(h));
    for (uint8_t& v : px) v = static_cast<uint8_t>(uniform(0, 255));
    const moe::ImageView image{px.data(), w, h, stride};

    const std::vector<float> want = resize_whole_then_crop(image, cfg);
    std::vector<float> got(want.size(), -1.0f);
    moe::preprocess_clip_image(image, cfg, got.data());
    ASSERT_EQ(got, want) << w << "x" << h << " shortest_edge " << cfg.shortest_edge << " crop " << cfg.crop_width << "x"
                         << cfg.crop_height << " do_resize " << cfg.do_resize << " do_center_crop "
                         << cfg.do_center_crop << " resize " << cfg.resize_width << "x" << cfg.resize_height;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(sizes.size()));
}

TEST(ClipImagePreprocess, ExtremeAspectRatioNeedsOnlyTheCropsMemory) {
  // 1x100000 resizes to 224x22400000: 15 GB as RGB8 when resized whole. Only the 224x224 crop
  // is computed, so it fits in 256 MB more than the process holds.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        limit_address_space(256u << 20);
        const moe::ImagePreprocessConfig cfg;
        std::vector<float> out(3 * 224 * 224);
        for (const auto& [w, h] : {std::pair{1, 100000}, std::pair{100000, 1}}) {
          std::vector<uint8_t> px(static_cast<size_t>(w) * h * 3);
          for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 7 + i / 300);
          moe::preprocess_clip_image(view_of(px, w, h), cfg, out.data());
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ClipImagePreprocess, RefusesSizesBeyondTheLimits) {
  moe::ImagePreprocessConfig cfg;
  cfg.shortest_edge = moe::kMaxPreprocessSize + 1;
  expect_error([&] { moe::resized_size(cfg, 640, 480); }, {"shortest_edge", "4097", "1..4096"});
  cfg = {};
  cfg.resize_width = 100;
  cfg.resize_height = 1 << 20;
  expect_error([&] { moe::resized_size(cfg, 640, 480); }, {"resize_height", "1048576", "1..4096"});
  cfg = {};
  cfg.crop_width = 1 << 20;
  expect_error([&] { moe::preprocess_output_size(cfg, 640, 480); }, {"crop_width", "1048576", "1..4096"});
  // The resized image's long side must fit kMaxResizedSide: 224 * 20000000 does not.
  cfg = {};
  expect_error([&] { moe::resized_size(cfg, 1, 20000000); }, {"1x20000000", "4480000000", "limit of 2147483647"});
  // Without a centre crop the whole resized image is the output.
  cfg.do_center_crop = false;
  expect_error([&] { moe::preprocess_output_size(cfg, 1, 100000); }, {"224x22400000", "1x100000", "16777216"});
  EXPECT_EQ(moe::preprocess_output_size(cfg, 100, 200), std::make_pair(224, 448));
}

// A temporary model folder whose preprocessor_config.json a test rewrites.
class ConfigDir {
 public:
  void write(const std::string& json) const { dir_.write("preprocessor_config.json", json); }
  std::string file() const { return dir_.file("preprocessor_config.json"); }
  const std::string& path() const { return dir_.path(); }

 private:
  moe::test::TempDir dir_;
};

TEST(ImagePreprocessConfig, ReadsHuggingFaceLayout) {
  ConfigDir dir;
  // Missing file: CLIP defaults.
  moe::ImagePreprocessConfig cfg = moe::ImagePreprocessConfig::from_directory(dir.path());
  EXPECT_EQ(cfg.shortest_edge, 224);
  EXPECT_EQ(cfg.crop_width, 224);

  dir.write(R"({"crop_size": {"height": 336, "width": 320}, "do_center_crop": true, "do_normalize": false,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 1], "resample": 3,
                "rescale_factor": 0.5, "size": {"shortest_edge": 336}})");
  cfg = moe::ImagePreprocessConfig::from_directory(dir.path());
  EXPECT_EQ(cfg.shortest_edge, 336);
  EXPECT_EQ(cfg.crop_height, 336);
  EXPECT_EQ(cfg.crop_width, 320);
  EXPECT_FALSE(cfg.do_normalize);
  EXPECT_FLOAT_EQ(cfg.rescale_factor, 0.5f);
  EXPECT_FLOAT_EQ(cfg.image_std[0], 0.25f);
  EXPECT_FLOAT_EQ(cfg.image_mean[2], 0.5f);

  // Old-style ints.
  dir.write(R"({"size": 288, "crop_size": 256})");
  cfg = moe::ImagePreprocessConfig::from_directory(dir.path());
  EXPECT_EQ(cfg.shortest_edge, 288);
  EXPECT_EQ(cfg.crop_height, 256);
  EXPECT_EQ(cfg.crop_width, 256);

  dir.write(R"({"size": {"height": 100, "width": 50}})");
  cfg = moe::ImagePreprocessConfig::from_directory(dir.path());
  EXPECT_EQ(moe::resized_size(cfg, 640, 480), std::make_pair(50, 100));
}

TEST(ImagePreprocessConfig, RejectsUnsupportedValues) {
  ConfigDir dir;
  dir.write(R"({"resample": 2})");
  expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "resample"});
  dir.write(R"({"image_mean": [0.5, 0.5]})");
  expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "image_mean"});
  dir.write(R"({"size": {"longest_edge": 5}})");
  expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "size"});
  dir.write(R"({"crop_size": -3})");
  expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "crop_size"});
  // Absurd sizes, in each form the file may give them: 2^20 on a square image asked for 4.4 TB.
  for (const char* json : {R"({"size": {"shortest_edge": 1048576}})", R"({"size": 1048576})",
                           R"({"size": {"height": 224, "width": 4097}})", R"({"crop_size": 100000})",
                           R"({"crop_size": {"height": 100000, "width": 224}})"}) {
    dir.write(json);
    expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "1..4096"});
  }
  dir.write(R"({"size": {"shortest_edge": 4096}, "crop_size": 4096})");  // the limit itself is accepted
  EXPECT_EQ(moe::ImagePreprocessConfig::from_directory(dir.path()).shortest_edge, 4096);
  dir.write("{not json");
  expect_error([&] { moe::ImagePreprocessConfig::from_directory(dir.path()); }, {dir.file(), "invalid JSON"});
}

}  // namespace

// ===== Image decoding (moe/image_decode.h) =====

#include "moe/image_decode.h"

namespace {

std::vector<uint8_t> pattern(int w, int h, int channels) {
  std::vector<uint8_t> px(static_cast<size_t>(w) * h * channels);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 37 + i / 5);
  return px;
}

// A baseline grayscale JPEG of w x h pixels (multiples of 8), every pixel 128: each 8x8 block is
// a DC difference of 0 and an end-of-block, coded with one-code Huffman tables. Written by hand,
// like png_file, so that a test knows where each part lies.
std::vector<uint8_t> gray_jpeg_file(int w, int h) {
  std::vector<uint8_t> jpeg = {0xFF, 0xD8};  // start of image
  auto segment = [&](uint8_t marker, std::vector<uint8_t> body) {
    const size_t length = body.size() + 2;
    jpeg.insert(jpeg.end(), {0xFF, marker, static_cast<uint8_t>(length >> 8), static_cast<uint8_t>(length)});
    jpeg.insert(jpeg.end(), body.begin(), body.end());
  };
  std::vector<uint8_t> quant(65, 1);  // table 0, 8-bit, every step 1
  quant[0] = 0;
  segment(0xDB, quant);
  segment(0xC0, {8, static_cast<uint8_t>(h >> 8), static_cast<uint8_t>(h), static_cast<uint8_t>(w >> 8),
                 static_cast<uint8_t>(w), 1, 1, 0x11, 0});  // 8-bit, one component, quant table 0
  for (uint8_t table : {0x00, 0x10}) {                      // DC table 0, AC table 0
    std::vector<uint8_t> huffman(17, 0);
    huffman[0] = table;
    huffman[1] = 1;           // one code of length 1 ("0")
    huffman.push_back(0x00);  // for DC category 0 (difference 0) / AC end-of-block
    segment(0xC4, huffman);
  }
  segment(0xDA, {1, 1, 0x00, 0, 63, 0});  // start of scan: component 1, tables 0/0
  const size_t bits = static_cast<size_t>(w / 8) * static_cast<size_t>(h / 8) * 2;  // "0" "0" per block
  jpeg.insert(jpeg.end(), bits / 8, 0x00);
  if (bits % 8 != 0) jpeg.push_back(static_cast<uint8_t>(0xFF >> (bits % 8)));  // padded with 1 bits
  jpeg.insert(jpeg.end(), {0xFF, 0xD9});                                        // end of image
  return jpeg;
}

TEST(DecodeImage, PngRoundTripGivesExactPixels) {
  // Width 5: gdk-pixbuf pads RGB rows to 16 bytes; the result must be packed.
  const int w = 5, h = 3;
  const std::vector<uint8_t> px = pattern(w, h, 3);
  const std::vector<uint8_t> png = make_png(px, w, h, 3);
  const moe::RgbImage img = moe::decode_image(png.data(), png.size(), "test.png");
  EXPECT_EQ(img.width, w);
  EXPECT_EQ(img.height, h);
  EXPECT_EQ(img.pixels, px);
  const moe::ImageView v = img.view();
  EXPECT_EQ(v.data, img.pixels.data());
  EXPECT_EQ(v.stride, static_cast<size_t>(w) * 3);
}

TEST(DecodeImage, RgbaDropsAlphaWithoutCompositing) {
  const int w = 4, h = 2;
  std::vector<uint8_t> rgba = pattern(w, h, 4);
  for (size_t i = 3; i < rgba.size(); i += 4) rgba[i] = static_cast<uint8_t>(i % 3 == 0 ? 0 : 128);  // transparent too
  const std::vector<uint8_t> png = make_png(rgba, w, h, 4);
  const moe::RgbImage img = moe::decode_image(png.data(), png.size(), "alpha.png");
  std::vector<uint8_t> want;
  for (size_t i = 0; i < rgba.size(); i += 4) want.insert(want.end(), rgba.begin() + i, rgba.begin() + i + 3);
  EXPECT_EQ(img.pixels, want);
}

TEST(DecodeImage, GrayscaleExpandsToRgb) {
  const std::string pgm = std::string("P5\n3 2\n255\n") + std::string("\x00\x10\x20\x80\xc0\xff", 6);
  const moe::RgbImage img = moe::decode_image(reinterpret_cast<const uint8_t*>(pgm.data()), pgm.size(), "gray.pgm");
  ASSERT_EQ(img.width, 3);
  ASSERT_EQ(img.height, 2);
  const uint8_t gray[] = {0x00, 0x10, 0x20, 0x80, 0xc0, 0xff};
  for (int i = 0; i < 6; ++i)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(img.pixels[static_cast<size_t>(i) * 3 + c], gray[i]) << i << "," << c;
}

TEST(DecodeImage, BadDataErrorsNameTheImage) {
  const std::vector<uint8_t> png = make_png(pattern(6, 5, 3), 6, 5, 3);
  expect_error([&] { moe::decode_image(nullptr, 0, "request 'q1'"); }, {"request 'q1'", "empty"});
  expect_error([&] { moe::decode_image(png.data(), 0, "request 'q1'"); }, {"request 'q1'", "empty"});
  const std::string junk = "this is not an image at all";
  expect_error([&] { moe::decode_image(reinterpret_cast<const uint8_t*>(junk.data()), junk.size(), "junk.bin"); },
               {"junk.bin", "unknown image format"});
  expect_error([&] { moe::decode_image(png.data(), png.size() / 2, "half.png"); }, {"half.png", "truncated"});
  std::vector<uint8_t> corrupt = png;
  corrupt[40] ^= 0xFF;  // inside IDAT: the chunk's CRC no longer matches
  expect_error([&] { moe::decode_image(corrupt.data(), corrupt.size(), "crc.png"); }, {"crc.png"});
}

TEST(DecodeImage, RefusesHugeCanvasBeforeDecoding) {
  // Headers of 20000 x 20000 (400 megapixels) and 100000 x 100000 (30 GB of RGB) followed by one
  // row of data: refused from the header (the loaders' size-prepared signal), as nothing else
  // could be decoded from so little data.
  for (const int side : {20000, 100000}) {
    const std::vector<uint8_t> png =
        png_file(side, side, 3, std::vector<uint8_t>(1 + static_cast<size_t>(side) * 3, 0));
    expect_error([&] { moe::decode_image(png.data(), png.size(), "bomb.png"); },
                 {"bomb.png", std::to_string(side) + "x" + std::to_string(side), "limit"});
  }
  // One side too long, few pixels in all.
  const int side = moe::kMaxDecodedImageSide + 1;
  const std::vector<uint8_t> wide = png_file(side, 1, 3, std::vector<uint8_t>(1 + static_cast<size_t>(side) * 3, 0));
  expect_error([&] { moe::decode_image(wide.data(), wide.size(), "wide.png"); },
               {"wide.png", std::to_string(side) + "x1", "limit of " + std::to_string(moe::kMaxDecodedImageSide)});
  // A long side within the limit decodes (preprocessing resizes only its centre crop).
  const std::vector<uint8_t> tall = make_png(pattern(1, 100000, 3), 1, 100000, 3);
  EXPECT_EQ(moe::decode_image(tall.data(), tall.size(), "tall.png").height, 100000);
}

TEST(DecodeImage, RefusesPngWithoutIend) {
  const std::vector<uint8_t> png = make_png(pattern(6, 5, 3), 6, 5, 3);
  // Every row is there, the IEND chunk (the last 12 bytes) is not.
  expect_error([&] { moe::decode_image(png.data(), png.size() - 12, "noend.png"); },
               {"noend.png", "truncated", "IEND"});
  expect_error([&] { moe::decode_image(png.data(), png.size() - 1, "cut.png"); }, {"cut.png", "IEND"});
  // Bytes after IEND are ignored, as PIL ignores them.
  std::vector<uint8_t> trailing = png;
  trailing.insert(trailing.end(), {'j', 'u', 'n', 'k'});
  EXPECT_EQ(moe::decode_image(trailing.data(), trailing.size(), "trailing.png").pixels, pattern(6, 5, 3));
}

// Found by fuzz_image_decode: a 2x2 GIF whose frame has width 0 (and lies below the canvas)
// made gdk-pixbuf's GIF loader ask for a pixbuf of width 0, a GLib critical instead of an error.
TEST(DecodeImage, RefusesGifFramesThatShowNothing) {
  gsize size = 0;
  guchar* gif = g_base64_decode("R0lGODlhAgACAIEAAP8AAAD/AAAA/////yH5BAAAAAAALAAAAAIAAAIAAAIDRDQFADs=", &size);
  expect_error([&] { moe::decode_image(gif, size, "empty-frame.gif"); },
               {"empty-frame.gif", "GIF frame 1 (0x2 at 0,512) shows nothing of the 2x2 canvas"});
  g_free(gif);
  // The same frame behind bytes that are no block: the loader skips them, and so does the check.
  gif = g_base64_decode(
      "R0lGODlhAgACAIEAAP8AAAABAGAgAAEAMP8AAAD/////IfkEAAAAAAAsAAAAAgAAAgAAAgADCAJbAAAAO5Y5kQAAADBJREFUeANENQUAOw==",
      &size);
  expect_error([&] { moe::decode_image(gif, size, "skipped.gif"); }, {"skipped.gif", "GIF frame 1 (0x2 at 0,512)"});
  g_free(gif);
  // Frames beyond the canvas (found by fuzz_image_decode): with disposal "restore to previous",
  // and with that disposal read from stale bytes behind empty control blocks.
  gif = g_base64_decode("R0lGODlhAgACAIEAAP8AAAD/AAAA/////yH5BAwAAAAALAAAAAADAAIAAAIDRDQFADs=", &size);
  expect_error([&] { moe::decode_image(gif, size, "restore.gif"); },
               {"restore.gif", "GIF frame 1 (3x2 at 0,0) reaches beyond the 2x2 canvas"});
  g_free(gif);
  gif = g_base64_decode(
      "R0lGODlhAgBDAIEAAP8AaQAAAEAA//8h+QAAAAAAAGF+NAAAAMz/OGH3OQAADwD//wD//yH5AAAAAABAAP//IfkAAAAAAgBh9zkAAP//////////"
      "//////////////////////////////////////////8AD///AP//IfkAaW1hZ2UveP8A//8AAAAAAAAA/yH5AAAAAABAAP//"
      "IfkAAAAAAABhfjQAAADM/zhh9zkAAA8A//8A//8h+QAAAAAAQAD//yH5AAAAAAIAYfc5AAAAD///AP//IfkAaW1hZ2UveP8A//8h+QBpbWH/"
      "IfkAAAAAAGFnZIoKYAAAACwAAAAAAoxgAgAABQA7",
      &size);
  expect_error([&] { moe::decode_image(gif, size, "stale.gif"); }, {"stale.gif", "reaches beyond the 2x67 canvas"});
  g_free(gif);
  // A frame only the loader finds (it reads sub-blocks after an empty control block): its GLib
  // critical becomes the error (found by fuzz_image_decode).
  gif = g_base64_decode(
      "R0lGODlhAgBDAIEAAP8AaZaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaW"
      "lpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWAAAAQAD//"
      "yH5AAAAAAAAYX4yAAAAzP84Yfc5AAAPAP//AP//IfkAAAAAAEAA//8h+QAAAAACAGH3OQAA/////////////////////////////////////////"
      "////////////wAP//8A//8h+QBpbWFnZS94/wD//wAAAAAAAAD/IfkAAAAAAEAA//8h+QAAAAAAAGF+NAAAAMz/OGH3OQAADwD//wD//"
      "yH5AAAAAABAAP//IflYWFhYWFhh9zkAAAAP//8A//8h+QBpbWFnZS94/wD//yH5AGltYf8h+QAAAAAAYWdkigpgAAAALAAAAAACjGACAAAFADs=",
      &size);
  expect_error([&] { moe::decode_image(gif, size, "hidden.gif"); },
               {"hidden.gif", "malformed image data (the image decoder reported: gdk_pixbuf_copy_area"});
  g_free(gif);
}

TEST(DecodeImage, RefusesTruncatedJpeg) {
  const std::vector<uint8_t> jpeg = gray_jpeg_file(256, 64);  // 256 blocks: a 64-byte scan
  const moe::RgbImage whole = moe::decode_image(jpeg.data(), jpeg.size(), "gray.jpg");
  ASSERT_EQ(whole.width, 256);
  ASSERT_EQ(whole.height, 64);
  EXPECT_TRUE(std::all_of(whole.pixels.begin(), whole.pixels.end(), [](uint8_t v) { return v == 128; }));
  // Without the end-of-image marker, cut inside the scan, cut before the scan.
  const size_t scan = jpeg.size() - 2 - 64;
  for (const size_t size : {jpeg.size() - 2, scan + 32, scan - 4, size_t{20}})
    expect_error([&] { moe::decode_image(jpeg.data(), size, "cut.jpg"); }, {"cut.jpg", "truncated"});
}

// Files written by PIL (PPM, PGM above the PNM loader's 4 KB reads, lossless and lossy WebP),
// PNM of maxval below 255 and a 16-bit RGB PNG: the pixels must be PIL's convert("RGB") of each
// (tools/make_format_fixtures.py).
TEST(DecodeImage, FormatsMatchPillow) {
  const std::string dir = fixture_path("formats/images/");
  auto expected = moe::SafetensorsFile::open(dir + "expected.safetensors");
  const std::vector<std::string> names = expected.names();
  for (const char* name : {"rgb64.ppm", "gray64.pgm", "gray-maxval100.pgm", "rgb-maxval31.ppm", "ascii-maxval7.ppm",
                           "lossless.webp", "lossy.webp", "rgb16.png"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  for (const std::string& name : names) {
    const moe::Tensor want = expected.get(name);
    ASSERT_EQ(want.dtype(), moe::DType::U8) << name;
    const moe::RgbImage img = moe::decode_image_file(dir + name);
    ASSERT_EQ(img.height, want.dim(0)) << name;
    ASSERT_EQ(img.width, want.dim(1)) << name;
    const std::vector<uint8_t> want_pixels(want.data<uint8_t>(), want.data<uint8_t>() + want.numel());
    EXPECT_EQ(img.pixels, want_pixels) << name;
  }
  // The PNM check still sees a file cut short, inside the first 4 KB and after it.
  const std::vector<uint8_t> ppm = moe::read_image_file(dir + "rgb64.ppm");
  for (const size_t size : {size_t{3000}, ppm.size() - 100})
    expect_error([&] { moe::decode_image(ppm.data(), size, "cut.ppm"); }, {"cut.ppm", "truncated", "rows missing"});
  // And so does the WebP check (the loader itself decodes what there is).
  for (const char* name : {"lossless.webp", "lossy.webp"}) {
    const std::vector<uint8_t> webp = moe::read_image_file(dir + name);
    for (const size_t size : {webp.size() / 2, webp.size() - 1})
      expect_error([&] { moe::decode_image(webp.data(), size, name); }, {name, "truncated", "RIFF header"});
  }
}

// More than 8 bits per sample where PIL's 8-bit result needs bits that gdk-pixbuf drops: 16-bit
// grayscale PNG, TIFF and PGM (PIL clips each sample to 0..255) and PNM of maxval 256..65535 (PIL
// rounds each full sample).
TEST(DecodeImage, RefusesSamplesWiderThan8BitsThatPilReadsOtherwise) {
  const std::string dir = fixture_path("formats/images/");
  auto expected = moe::SafetensorsFile::open(dir + "expected.safetensors");
  moe::json::Document refused(expected.metadata().at("refused"), "refused");
  JsonArray* files = json_node_get_array(refused.root());
  ASSERT_EQ(json_array_get_length(files), 4u);
  for (guint i = 0; i < json_array_get_length(files); ++i) {
    const std::string name = json_array_get_string_element(files, i);
    const std::string file = dir + name;
    expect_error([&] { moe::decode_image_file(file); },
                 {file, name == "gray16.png" || name == "gray16.tif" ? "16-bit grayscale" : "maxval",
                  "convert the image to 8 bits per sample"});
  }
}

TEST(DecodeImage, FilesAreReadAndMissingOnesNamed) {
  const std::vector<uint8_t> px = pattern(3, 4, 3);
  const std::vector<uint8_t> png = make_png(px, 3, 4, 3);
  moe::test::TempDir dir;
  const std::string file = dir.write("image.png", png);
  EXPECT_EQ(moe::read_image_file(file), png);
  EXPECT_EQ(moe::decode_image_file(file).pixels, px);
  const std::string missing = dir.file("nope.png");
  expect_error([&] { moe::decode_image_file(missing); }, {"image file '" + missing + "'", "No such file"});
  expect_error([&] { moe::read_image_file(dir.path()); }, {dir.path(), "cannot be read"});
}

}  // namespace
