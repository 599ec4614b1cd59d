// Encodes text queries and images with a CLIP model directory, runs the MoE adapter on the
// embeddings, and prints the embeddings, the routing and the text-image similarities.
// It uses the engine library directly, as a C++ application would.
//
//   moe-encode-demo [--model DIR] [--adapter DIR] [--text STR]... [--image FILE.ppm]...
//
// Without --image it encodes one generated test image (a colour gradient with a square).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "moe/clip_model.h"
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "moe_build_config.h"

namespace {

struct RgbImage {
  std::string name;
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;
};

// Binary PPM (P6, maxval 255): the one image format that needs no decoder library.
RgbImage read_ppm(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw moe::Error(path + ": cannot open");
  std::string magic;
  int maxval = 0;
  RgbImage img;
  in >> magic;
  auto skip_comments = [&] {
    in >> std::ws;
    while (in.peek() == '#') {
      std::string line;
      std::getline(in, line);
      in >> std::ws;
    }
  };
  skip_comments();
  in >> img.width;
  skip_comments();
  in >> img.height;
  skip_comments();
  in >> maxval;
  in.get();
  if (magic != "P6" || img.width <= 0 || img.height <= 0 || maxval != 255)
    throw moe::Error(path + ": not a binary 8-bit PPM (P6, maxval 255)");
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
  in.read(reinterpret_cast<char*>(img.pixels.data()), static_cast<std::streamsize>(img.pixels.size()));
  if (!in) throw moe::Error(path + ": truncated pixel data");
  img.name = path;
  return img;
}

RgbImage generated_image() {
  RgbImage img;
  img.name = "generated 160x120 gradient with a red square";
  img.width = 160;
  img.height = 120;
  img.pixels.resize(160 * 120 * 3);
  for (int y = 0; y < 120; ++y)
    for (int x = 0; x < 160; ++x) {
      uint8_t* p = &img.pixels[(y * 160 + x) * 3];
      const bool square = x > 50 && x < 110 && y > 30 && y < 90;
      p[0] = square ? 220 : static_cast<uint8_t>(x * 255 / 159);
      p[1] = square ? 30 : static_cast<uint8_t>(y * 255 / 119);
      p[2] = square ? 40 : 128;
    }
  return img;
}

void print_row(const char* label, const float* v, int64_t n) {
  double norm = 0;
  for (int64_t i = 0; i < n; ++i) norm += static_cast<double>(v[i]) * v[i];
  std::printf("  %-9s [", label);
  for (int64_t i = 0; i < std::min<int64_t>(n, 6); ++i) std::printf("%s%+.4f", i ? ", " : "", v[i]);
  std::printf("%s]  (dim %lld, norm %.4f)\n", n > 6 ? ", ..." : "", static_cast<long long>(n), std::sqrt(norm));
}

void print_routing(const moe::Routing& r, int64_t row) {
  std::printf("  experts  ");
  for (int j = 0; j < r.top_k; ++j) std::printf("%s#%d (%.3f)", j ? ", " : "", r.expert(row, j), r.weight(row, j));
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/clip_tiny_bpe";
  std::string adapter_dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/adapter_tiny";
  std::vector<std::string> texts, image_paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model")
      model_dir = value();
    else if (a == "--adapter")
      adapter_dir = value();
    else if (a == "--text")
      texts.push_back(value());
    else if (a == "--image")
      image_paths.push_back(value());
    else {
      std::fprintf(stderr, "usage: %s [--model DIR] [--adapter DIR] [--text STR]... [--image FILE.ppm]...\n", argv[0]);
      return 2;
    }
  }
  if (texts.empty()) texts = {"a photo of a cat", "red striped mug"};
  try {
    const moe::ClipModel clip = moe::ClipModel::load(model_dir);
    const moe::MoeAdapter adapter = moe::MoeAdapter::load(adapter_dir);
    std::printf("model   %s (text %d-d x %d layers, vision %d-d x %d layers, projection %d)\n", model_dir.c_str(),
                clip.config().text.hidden_size, clip.config().text.num_hidden_layers, clip.config().vision.hidden_size,
                clip.config().vision.num_hidden_layers, clip.config().projection_dim);
    std::printf("adapter %s (%d experts, top-%d)\n\n", adapter_dir.c_str(), adapter.layer().config().num_experts,
                adapter.layer().config().top_k);

    std::vector<RgbImage> images;
    for (const auto& p : image_paths) images.push_back(read_ppm(p));
    if (images.empty()) images.push_back(generated_image());
    std::vector<moe::ImageView> views;
    for (const auto& im : images)
      views.push_back({im.pixels.data(), im.width, im.height, static_cast<size_t>(im.width) * 3});

    const moe::ClipEncodeResult text = clip.encode_texts(texts);
    const moe::ClipEncodeResult vision = clip.encode_images(views);
    const moe::AdapterOutput text_out = adapter.apply(text.embeds);
    const moe::AdapterOutput image_out = adapter.apply(vision.embeds);
    const int64_t D = text_out.embeddings.dim(1);

    for (size_t i = 0; i < texts.size(); ++i) {
      std::printf("text \"%s\"\n  tokens   ", texts[i].c_str());
      for (int32_t id : clip.tokenizer().encode(texts[i])) std::printf("%d ", id);
      std::printf("\n");
      print_row("clip", text.embeds.data<float>() + i * D, D);
      print_row("adapted", text_out.embeddings.data<float>() + i * D, D);
      print_routing(text_out.routing, static_cast<int64_t>(i));
    }
    for (size_t i = 0; i < images.size(); ++i) {
      std::printf("image %s\n", images[i].name.c_str());
      print_row("clip", vision.embeds.data<float>() + i * D, D);
      print_row("adapted", image_out.embeddings.data<float>() + i * D, D);
      print_routing(image_out.routing, static_cast<int64_t>(i));
    }
    std::printf("\ncosine similarity (adapted embeddings), text x image:\n");
    for (size_t t = 0; t < texts.size(); ++t)
      for (size_t m = 0; m < images.size(); ++m) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += text_out.embeddings.data<float>()[t * D + d] * image_out.embeddings.data<float>()[m * D + d];
        std::printf("  \"%s\" x image %zu: %+.4f\n", texts[t].c_str(), m, dot);
      }
  } catch (const moe::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
