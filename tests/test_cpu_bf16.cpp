// bf16 Linear weights on the CPU backend. Where the CPU multiplies bf16 natively (AVX-512 BF16 or
// AMX: kernels::cpu::bf16_native()), prepared bf16 weights are packed as bf16 and each linear
// rounds its f32 input to bf16, summing in f32; elsewhere they are widened to f32 at load and the
// math is f32. Either way the choice is logged once. meson runs this suite twice: as the CPU is,
// and with oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI), so a machine with
// AVX-512 BF16 tests both paths.
#include <glib.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "cpu_gemm.h"
#include "moe/clip_model.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"
#include "test_util.h"

using moe::kernels::WeightType;

namespace {

// Every "moe" log line of the process, from before main (the lines are logged once per process).
struct LogLines {
  std::mutex mu;
  std::vector<std::string> lines;
  LogLines() {
    g_log_set_handler(
        "moe", static_cast<GLogLevelFlags>(G_LOG_LEVEL_MASK | G_LOG_FLAG_FATAL | G_LOG_FLAG_RECURSION),
        [](const gchar* domain, GLogLevelFlags level, const gchar* message, gpointer self) {
          auto* log = static_cast<LogLines*>(self);
          {
            std::lock_guard<std::mutex> lock(log->mu);
            log->lines.emplace_back(message);
          }
          g_log_default_handler(domain, level, message, nullptr);
        },
        this);
  }
  int count(const std::string& fragment) {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int>(std::count_if(lines.begin(), lines.end(),
                                          [&](const std::string& l) { return l.find(fragment) != std::string::npos; }));
  }
};
LogLines& log_lines() {
  static LogLines log;
  return log;
}
const bool kLogInstalled = (log_lines(), true);

constexpr const char* kPackedBf16Line = "bf16 weights prepared at load are packed as bf16";
constexpr const char* kWidenedBf16Line = "precision bf16: this CPU has neither AVX-512 BF16 nor AMX";
constexpr const char* kWidenedF16Line = "precision f16: the CPU backend has no f16 GEMM";

std::vector<float> random_values(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = moe::float_to_bf16(v[i]);
  return out;
}
std::vector<uint16_t> to_f16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = moe::float_to_half(v[i]);
  return out;
}
std::vector<float> bf16_values(const std::vector<uint16_t>& b) {
  std::vector<float> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = moe::bf16_to_float(b[i]);
  return out;
}
std::vector<float> f16_values(const std::vector<uint16_t>& h) {
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = moe::half_to_float(h[i]);
  return out;
}

// Worst |y - ref| / (|bias| + Σ|x·w|) over y = x[m,k] · w[n,k]ᵀ + bias, in double.
double worst_error(const std::vector<float>& y, const std::vector<float>& x, const std::vector<float>& w,
                   const std::vector<float>& bias, int64_t m, int64_t n, int64_t k) {
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = bias[j], scale = std::fabs(bias[j]) + 1e-30;
      for (int64_t t = 0; t < k; ++t) {
        const double p = static_cast<double>(x[i * k + t]) * w[j * k + t];
        sum += p;
        scale += std::fabs(p);
      }
      worst = std::max(worst, std::fabs(y[i * n + j] - sum) / scale);
    }
  return worst;
}

// Rounding x to bf16 (8 significant bits, nearest even) moves each product by at most 2^-8 of
// itself; f32 sums add far less at these k.
constexpr double kBf16InputBound = 1.01 / 256;
constexpr double kF32Bound = 1e-6;  // as test_backend's f32 linear

}  // namespace

// Prepared bf16 weights against the product in double: on the rounded x where bf16 is native
// (and within 2^-9 of the f32 x's product), else exactly the f32 product of the widened weights.
// Every thread count, M, column split and bias; unprepared weights stay widened per call.
TEST(CpuBf16, PreparedLinearMultipliesInBf16WhereNative) {
  const bool native = moe::kernels::cpu::bf16_native();
  std::printf("bf16 native: %s\n", native ? "yes" : "no");
  for (int threads : {1, 2, 3}) {
    auto cpu = moe::kernels::make_cpu_backend({false, threads});
    for (int64_t n : {1, 37, 130, 768})
      for (int64_t k : {5, 37, 768}) {
        const std::vector<uint16_t> wb = to_bf16(random_values(n * k, 1));
        const std::vector<float> w = bf16_values(wb), bias = random_values(n, 2);
        const moe::kernels::WeightRef ref{wb.data(), WeightType::BF16};
        for (bool prepared : {false, true}) {
          if (prepared) cpu->prepare_linear_weight(ref, n, k);
          for (int64_t m : {1, 50, 200}) {  // 200 x 768: the input is rounded in parts
            SCOPED_TRACE(std::to_string(threads) + " threads, " + (prepared ? "prepared " : "") + std::to_string(m) +
                         "x" + std::to_string(n) + "x" + std::to_string(k));
            const std::vector<float> x = random_values(m * k, 3);
            std::vector<float> y(static_cast<size_t>(m * n), NAN);
            cpu->linear(x.data(), ref, bias.data(), y.data(), m, n, k);
            const double exact = worst_error(y, x, w, bias, m, n, k);
            if (prepared && native) {
              EXPECT_LT(worst_error(y, bf16_values(to_bf16(x)), w, bias, m, n, k), kF32Bound);
              EXPECT_LT(exact, kBf16InputBound);
              if (k > 5) {
                EXPECT_GT(exact, kF32Bound) << "x was not rounded to bf16";
              }
            } else {
              EXPECT_LT(exact, kF32Bound);
            }
          }
        }
        cpu->release_linear_weight(ref, n, k);
      }
  }
  // Every call ran on the packed weight: no column block fell back (narrow blocks compute into a
  // buffer of their own width, which oneDNN's brgemm takes).
  EXPECT_EQ(log_lines().count("oneDNN could not create a matmul"), 0);
  EXPECT_EQ(log_lines().count(kPackedBf16Line), native ? 1 : 0);
  EXPECT_EQ(log_lines().count(kWidenedBf16Line), native ? 0 : 1);
}

// f16 has no GEMM on the CPU: prepared f16 weights are widened to f32 once (the f32 product of the
// widened weights), and that is said once.
TEST(CpuBf16, PreparedF16WeightsAreWidenedToF32) {
  auto cpu = moe::kernels::make_cpu_backend({false, 2});
  for (int64_t n : {37, 768}) {
    const int64_t k = 300;
    const std::vector<uint16_t> wh = to_f16(random_values(n * k, 4));
    const std::vector<float> w = f16_values(wh), bias = random_values(n, 5);
    const moe::kernels::WeightRef ref{wh.data(), WeightType::F16};
    cpu->prepare_linear_weight(ref, n, k);
    for (int64_t m : {1, 64}) {
      const std::vector<float> x = random_values(m * k, 6);
      std::vector<float> y(static_cast<size_t>(m * n), NAN);
      cpu->linear(x.data(), ref, bias.data(), y.data(), m, n, k);
      EXPECT_LT(worst_error(y, x, w, bias, m, n, k), kF32Bound) << m << "x" << n << "x" << k;
    }
    cpu->release_linear_weight(ref, n, k);
  }
  EXPECT_EQ(log_lines().count(kWidenedF16Line), 1);
}

// The CLIP towers with precision bf16 against transformers in f32 (tests/fixtures, made by
// tools/make_fixtures.py). Max |a - b| / max |ref| (test_util.h): weights rounded to bf16 (2^-8
// relative at most) on every path, plus the inputs of every Linear where bf16 is native; over the towers'
// layers the errors add up to about 1e-2 on these fixtures. The bound is test_compute's kClipBF16
// (the for embeddings), so both bf16 paths are held to the one CUDA's bf16 is.
TEST(CpuBf16, ClipTowersMatchTransformersWithinTheBf16Bound) {
  constexpr double kClipBf16 = 2e-2;
  for (const char* dir : {"clip_tiny", "clip_tiny_bpe"}) {
    SCOPED_TRACE(dir);
    auto io = moe::SafetensorsFile::open(moe::test::fixture_path(std::string(dir) + "_io.safetensors"));
    moe::ComputeOptions options;
    options.precision = WeightType::BF16;
    const moe::ClipModel m = moe::ClipModel::load(moe::test::fixture_path(dir), options);
    EXPECT_EQ(m.precision(), WeightType::BF16);
    const auto t = m.encode_token_ids(moe::test::real_ids(io, "text."));
    const auto v = m.encode_pixels(io.get("vision.pixel_values"));
    const double errs[] = {moe::test::max_rel_error(t.embeds, io.get("text.text_embeds")),
                           moe::test::max_rel_error(v.embeds, io.get("vision.image_embeds"))};
    std::printf("%s bf16 (%s): text embeds %.3g, vision embeds %.3g\n", dir,
                moe::kernels::cpu::bf16_native() ? "native" : "widened", errs[0], errs[1]);
    for (double e : errs) {
      EXPECT_LT(e, kClipBf16);
      EXPECT_GT(e, 0.0) << "the weights were not rounded";
    }
  }
}

// A bf16 checkpoint loaded in bf16 is used as stored (its Linear weights are not widened and
// rounded back): the same embeddings as the f32 checkpoint rounded to bf16 at load.
TEST(CpuBf16, Bf16CheckpointGivesTheRoundedF32Results) {
  const std::string dir = moe::test::fixture_path("clip_tiny");
  const moe::Checkpoint f32 = moe::Checkpoint::open(dir);
  moe::test::TempDir tmp;
  std::filesystem::copy_file(dir + "/config.json", tmp.file("config.json"));
  // The Linear weights as BF16, the rest (norms, biases, embeddings: f32 in any precision) as is.
  const auto is_linear = [](const std::string& name) {
    for (const char* end : {"_proj.weight", "fc1.weight", "fc2.weight", "projection.weight", "patch_embedding.weight"})
      if (name.size() >= std::strlen(end) && name.compare(name.size() - std::strlen(end), std::string::npos, end) == 0)
        return true;
    return false;
  };
  std::string header = "{", data;
  int linear = 0;
  for (const std::string& name : f32.names()) {
    const moe::Tensor t = f32.get(name);
    ASSERT_EQ(t.dtype(), moe::DType::F32) << name;
    std::string bytes(static_cast<const char*>(t.raw_data()), t.nbytes()), dtype = "F32";
    if (is_linear(name)) {
      const std::vector<uint16_t> b = to_bf16(std::vector<float>(t.data<float>(), t.data<float>() + t.numel()));
      bytes.assign(reinterpret_cast<const char*>(b.data()), b.size() * 2);
      dtype = "BF16";
      ++linear;
    }
    std::string shape;
    for (int64_t d : t.shape()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" + dtype +
              "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + bytes.size()) + "]}";
    data += bytes;
  }
  const moe::ClipConfig c = moe::ClipConfig::from_file(dir + "/config.json");
  ASSERT_EQ(linear, 6 * (c.text.num_hidden_layers + c.vision.num_hidden_layers) + 3);  // per layer q k v out fc1 fc2
  header += "}";
  while (header.size() % 8) header += ' ';
  std::string file(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  tmp.write("model.safetensors", file + header + data);

  moe::ComputeOptions options;
  options.precision = WeightType::BF16;
  const moe::ClipModel from_f32 = moe::ClipModel::load(dir, options);
  const moe::ClipModel from_bf16 = moe::ClipModel::load(tmp.path(), options);
  auto io = moe::SafetensorsFile::open(moe::test::fixture_path("clip_tiny_io.safetensors"));
  const auto ids = moe::test::real_ids(io, "text.");
  const moe::Tensor pixels = io.get("vision.pixel_values");
  EXPECT_EQ(moe::test::max_abs_error(from_bf16.encode_token_ids(ids).embeds, from_f32.encode_token_ids(ids).embeds),
            0.0);
  EXPECT_EQ(moe::test::max_abs_error(from_bf16.encode_pixels(pixels).embeds, from_f32.encode_pixels(pixels).embeds),
            0.0);
}
