// Shared helpers for the GoogleTest suites: fixture paths, error measures, temporary folders
// and test data (random unit vectors, PNG files).
#pragma once

#include <glib.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"
#include "moe_build_config.h"

namespace moe::test {

inline std::string source_path(const std::string& rel) { return std::string(MOE_SOURCE_DIR) + "/" + rel; }
inline std::string fixture_path(const std::string& rel) { return source_path("tests/fixtures/" + rel); }

// max |a - b| / max(max |b|, floor): one relative error for a whole tensor, robust to entries
// near zero. Shapes must match.
inline double max_rel_error(const Tensor& a, const Tensor& b, double floor = 1e-6) {
  EXPECT_EQ(a.shape(), b.shape()) << a.describe() << " vs " << b.describe();
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor fa = a.to_f32(), fb = b.to_f32();
  double diff = 0.0, ref = floor;
  for (int64_t i = 0; i < fa.numel(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(fa.data<float>()[i]) - fb.data<float>()[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(fb.data<float>()[i])));
  }
  return diff / ref;
}

// The token ids of a fixture's `<prefix>input_ids` rows, each cut to its `<prefix>lengths`
// entry (the fixtures pad to 77 after the end token).
inline std::vector<std::vector<int32_t>> real_ids(const SafetensorsFile& io, const std::string& prefix) {
  Tensor ids = io.get(prefix + "input_ids");
  Tensor lens = io.get(prefix + "lengths");
  std::vector<std::vector<int32_t>> out;
  for (int64_t b = 0; b < ids.dim(0); ++b) {
    const int32_t* row = ids.data<int32_t>() + b * ids.dim(1);
    out.emplace_back(row, row + lens.data<int32_t>()[b]);
  }
  return out;
}

inline double max_abs_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape()) << a.describe() << " vs " << b.describe();
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor fa = a.to_f32(), fb = b.to_f32();
  double diff = 0.0;
  for (int64_t i = 0; i < fa.numel(); ++i)
    diff = std::max(diff, std::fabs(static_cast<double>(fa.data<float>()[i]) - fb.data<float>()[i]));
  return diff;
}

// Asserts that calling `fn` throws moe::Error whose message contains every listed fragment.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments)
      EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
  }
}

// The whole content of the file at `path` ("" when it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Replaces the file at `path` with `text`.
inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A temporary folder, removed with everything in it at the end of the test.
class TempDir {
 public:
  TempDir() {
    gchar* dir = g_dir_make_tmp("moe-test-XXXXXX", nullptr);
    if (dir == nullptr) throw std::runtime_error("cannot create a temporary folder");
    path_ = dir;
    g_free(dir);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // Writes file(name) and returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = file(name);
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    return write(name, std::string(bytes.begin(), bytes.end()));
  }

 private:
  std::string path_;
};

// Writes a copy of the safetensors file `from` to `to` with the lowest byte of tensor `name`'s
// first element flipped: the same names and shapes, weights that differ (a "retrained" model).
inline void copy_with_one_value_changed(const std::string& from, const std::string& to, const std::string& name) {
  std::ifstream in(from, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 8u) << from;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  const size_t at = 8 + header_len + SafetensorsFile::open(from).info(name).begin;
  ASSERT_LT(at, bytes.size()) << name;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x01);
  std::ofstream(to, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// n x dim Gaussian vectors, each scaled to unit length; the same for the same seed.
inline std::vector<float> random_unit_vectors(int64_t n, int dim, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(static_cast<size_t>(n * dim));
  for (int64_t i = 0; i < n; ++i) {
    double norm = 0;
    for (int j = 0; j < dim; ++j) {
      const float x = dist(rng);
      v[i * dim + j] = x;
      norm += static_cast<double>(x) * x;
    }
    for (int j = 0; j < dim; ++j) v[i * dim + j] = static_cast<float>(v[i * dim + j] / std::sqrt(norm));
  }
  return v;
}

// A PNG file: IHDR for a w x h 8-bit RGB (channels 3) or RGBA (4) image, then `rows` (filter
// byte + pixels per row) in stored (uncompressed) deflate blocks. Written by hand so that the
// image decoder is not checked against its own library, and so that a header may promise more
// rows than follow.
inline std::vector<uint8_t> png_file(int w, int h, int channels, const std::vector<uint8_t>& rows) {
  auto be32 = [](std::vector<uint8_t>& v, uint32_t x) {
    for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
  };
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  auto chunk = [&](const char* type, const std::vector<uint8_t>& data) {
    be32(png, static_cast<uint32_t>(data.size()));
    std::vector<uint8_t> body(type, type + 4);
    body.insert(body.end(), data.begin(), data.end());
    uint32_t crc = 0xFFFFFFFFu;
    for (uint8_t b : body) {
      crc ^= b;
      for (int k = 0; k < 8; ++k) crc = (crc & 1) ? 0xEDB88320u ^ (crc >> 1) : crc >> 1;
    }
    png.insert(png.end(), body.begin(), body.end());
    be32(png, ~crc);
  };
  std::vector<uint8_t> ihdr;
  be32(ihdr, static_cast<uint32_t>(w));
  be32(ihdr, static_cast<uint32_t>(h));
  ihdr.insert(ihdr.end(), {8, static_cast<uint8_t>(channels == 4 ? 6 : 2), 0, 0, 0});
  chunk("IHDR", ihdr);
  std::vector<uint8_t> z = {0x78, 0x01};
  for (size_t at = 0;;) {
    const size_t n = std::min<size_t>(65535, rows.size() - at);
    const bool last = at + n == rows.size();
    z.insert(z.end(), {static_cast<uint8_t>(last), static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                       static_cast<uint8_t>(~n), static_cast<uint8_t>(~n >> 8)});
    z.insert(z.end(), rows.begin() + static_cast<std::ptrdiff_t>(at),
             rows.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    if (last) break;
  }
  uint32_t a = 1, b = 0;
  for (uint8_t v : rows) {
    a = (a + v) % 65521;
    b = (b + a) % 65521;
  }
  be32(z, (b << 16) | a);
  chunk("IDAT", z);
  chunk("IEND", {});
  return png;
}

// The PNG file of packed RGB8 (channels 3) or RGBA8 (4) pixels.
inline std::vector<uint8_t> make_png(const std::vector<uint8_t>& px, int w, int h, int channels) {
  std::vector<uint8_t> rows;
  const size_t row = static_cast<size_t>(w) * channels;
  for (int y = 0; y < h; ++y) {
    rows.push_back(0);  // filter: none
    rows.insert(rows.end(), px.begin() + static_cast<std::ptrdiff_t>(y * row),
                px.begin() + static_cast<std::ptrdiff_t>((y + 1) * row));
  }
  return png_file(w, h, channels, rows);
}

// ---- adapters written by tests: adapter_tiny's tensors, changed ----

// One tensor of a safetensors file being written: dtype as the format spells it ("F32", "I32"),
// and its bytes.
struct StoredTensor {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
};

// adapter_tiny_gate's tensors without its cross-modal gate: adapter_tiny's (all f32).
inline std::vector<StoredTensor> adapter_tensors_without_gate() {
  auto file = SafetensorsFile::open(fixture_path("adapter_tiny_gate/adapter.safetensors"));
  std::vector<StoredTensor> out;
  for (const std::string& name : file.names()) {
    if (name.rfind("cross_modal_gate.", 0) == 0) continue;
    const TensorInfo& info = file.info(name);
    EXPECT_EQ(info.dtype, DType::F32) << name;
    const auto* p = reinterpret_cast<const char*>(file.bytes(name));
    out.push_back({name, "F32", info.shape, std::string(p, p + (info.end - info.begin))});
  }
  return out;
}

// An adapter directory in `dir` with adapter_tiny's config and `tensors` in adapter.safetensors.
inline std::string write_adapter(const TempDir& dir, const std::vector<StoredTensor>& tensors) {
  std::filesystem::copy_file(fixture_path("adapter_tiny/adapter_config.json"), dir.file("adapter_config.json"),
                             std::filesystem::copy_options::overwrite_existing);
  std::ostringstream header;
  std::string data;
  header << "{";
  for (const StoredTensor& t : tensors) {
    header << (&t == &tensors.front() ? "" : ",") << "\"" << t.name << "\":{\"dtype\":\"" << t.dtype
           << "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header << (i ? "," : "") << t.shape[i];
    header << "],\"data_offsets\":[" << data.size() << "," << data.size() + t.bytes.size() << "]}";
    data += t.bytes;
  }
  header << "}";
  std::string text = header.str();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  dir.write("adapter.safetensors", bytes + text + data);
  return dir.path();
}

// adapter_tiny's config with `num_experts` experts and "joint_experts": `joint` (JSON text).
inline void write_joint_config(const TempDir& dir, int num_experts, const std::string& joint) {
  dir.write("adapter_config.json",
            "{\"format\": \"gst-moe-adapter\", \"version\": 1, \"hidden_size\": 16, \"num_experts\": " +
                std::to_string(num_experts) +
                ", \"top_k\": 2, \"intermediate_size\": 24, \"routing\": \"mixtral\", \"norm_topk_prob\": true, "
                "\"joint_experts\": " +
                joint + "}");
}

// adapter_tiny with `joint` joint visual-text experts appended: copies of its first experts with
// w2 doubled (other outputs), and router rows of constant 4 + j, so that on rows of positive mean they
// would outrank every other expert if nothing masked them.
inline std::string write_joint_adapter(const TempDir& dir, int joint) {
  constexpr int kExperts = 6;
  std::vector<StoredTensor> tensors = adapter_tensors_without_gate();
  std::vector<StoredTensor> added;
  for (StoredTensor& t : tensors) {
    if (t.name == "gate.weight") {
      std::vector<float> rows(static_cast<size_t>(joint * 16));
      for (size_t i = 0; i < rows.size(); ++i) rows[i] = 4.0f + static_cast<float>(i / 16);
      t.bytes.append(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(float));
      t.shape[0] += joint;
      continue;
    }
    for (int j = 0; j < joint; ++j) {
      const std::string from = "experts." + std::to_string(j) + ".";
      if (t.name.rfind(from, 0) != 0) continue;
      StoredTensor copy = t;
      copy.name = "experts." + std::to_string(kExperts + j) + "." + t.name.substr(from.size());
      if (copy.name.find(".w2.") != std::string::npos) {
        std::vector<float> w(copy.bytes.size() / sizeof(float));
        std::memcpy(w.data(), copy.bytes.data(), copy.bytes.size());
        for (float& v : w) v *= 2.0f;
        std::memcpy(copy.bytes.data(), w.data(), copy.bytes.size());
      }
      added.push_back(std::move(copy));
    }
  }
  tensors.insert(tensors.end(), added.begin(), added.end());
  write_adapter(dir, tensors);
  write_joint_config(dir, kExperts + joint, std::to_string(joint));
  return dir.path();
}

}  // namespace moe::test
