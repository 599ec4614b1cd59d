// INT4 (W4A16) experts: compressed-tensors "pack-quantized" checkpoints written by the package
// itself (tools/make_int4_fixtures.py), their dequantisation against the package's bit for bit,
// and the CPU kernels (every instruction set this CPU runs) against the dequantised f32 weights.
#include <gtest/gtest.h>

#include <cmath>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_int4.h"
#include "cpu_ops.h"
#include "moe/expert_cache.h"
#include "moe/expert_executor.h"
#include "moe/expert_store.h"
#include "moe/moe_layer.h"
#include "moe/quantized_weights.h"
#include "test_util.h"

namespace {

using moe::Checkpoint;
using moe::DType;
using moe::Int4QuantConfig;
using moe::PackedInt4Weight;
using moe::SafetensorsFile;
using moe::Tensor;
using moe::kernels::ExpertWeights;
using moe::kernels::Q4Weight;
using moe::kernels::WeightRef;
using moe::kernels::WeightType;
using moe::kernels::cpu::Int4Isa;
using moe::test::expect_error;
using moe::test::fixture_path;

struct Case {
  const char* dir;
  const char* prefix;
  const char* projections[3];  // w1 (gate), w3 (up), w2 (down) names
  int group_size;
  bool symmetric;
  DType scale_dtype;
};
const Case kCases[] = {
    {"int4/mixtral_sym_g32", "model.layers.0.block_sparse_moe.", {"w1", "w3", "w2"}, 32, true, DType::F16},
    {"int4/qwen2_moe_asym_g64", "model.layers.0.mlp.", {"gate_proj", "up_proj", "down_proj"}, 64, false, DType::BF16},
};
constexpr int64_t kExperts = 4, kHidden = 64, kInter = 128;

std::vector<Int4Isa> isas() {
  std::vector<Int4Isa> out = {Int4Isa::Scalar};
  if (moe::kernels::cpu::int4_best_isa() >= Int4Isa::Avx2) out.push_back(Int4Isa::Avx2);
  if (moe::kernels::cpu::int4_best_isa() >= Int4Isa::Avx512) out.push_back(Int4Isa::Avx512);
  return out;
}

// "<prefix>experts.3.w1.weight" -> "<prefix>experts.3.w1"
std::string module_of(const std::string& weight_name) { return weight_name.substr(0, weight_name.size() - 7); }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == DType::F32 && b.dtype() == DType::F32 &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// y = x · wᵀ in double over the dequantised weight; also Σ |x|·|w| per output, the scale of f32's
// rounding error in any summation order.
void reference_linear(const std::vector<float>& x, const Tensor& w, int64_t m, std::vector<double>& y,
                      std::vector<double>& magnitude) {
  const int64_t n = w.dim(0), k = w.dim(1);
  y.assign(static_cast<size_t>(m * n), 0.0);
  magnitude.assign(y.size(), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < k; ++c) {
        const double p = static_cast<double>(x[i * k + c]) * w.data<float>()[j * k + c];
        y[i * n + j] += p;
        magnitude[i * n + j] += std::fabs(p);
      }
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// A random Q4 weight [n, k] held in vectors (for group sizes and shapes the fixtures lack).
struct RandomQ4 {
  std::vector<int32_t> packed, zeros;
  std::vector<uint16_t> scales;
  Q4Weight ref;
  RandomQ4(int64_t n, int64_t k, int group, bool symmetric, bool bf16, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<uint32_t> bits;
    std::uniform_real_distribution<float> scale(1e-3f, 0.1f);
    packed.resize(static_cast<size_t>(n * k / 8));
    for (int32_t& p : packed) p = static_cast<int32_t>(bits(rng));
    const int64_t groups = k / group;
    scales.resize(static_cast<size_t>(n * groups));
    for (uint16_t& s : scales) s = bf16 ? moe::float_to_bf16(scale(rng)) : moe::float_to_half(scale(rng));
    if (!symmetric) {
      zeros.resize(static_cast<size_t>((n + 7) / 8 * groups));
      for (int32_t& z : zeros) z = static_cast<int32_t>(bits(rng));
    }
    ref.packed = packed.data();
    ref.scales = scales.data();
    ref.zero_points = symmetric ? nullptr : zeros.data();
    ref.scale_type = bf16 ? WeightType::BF16 : WeightType::F16;
    ref.group_size = group;
  }
  // The same weight through the loader's type (host views over these vectors).
  PackedInt4Weight as_packed(int64_t n, int64_t k) {
    PackedInt4Weight w;
    w.out = n;
    w.in = k;
    w.group_size = ref.group_size;
    w.packed = Tensor::view(DType::I32, {n, k / 8}, packed.data(), nullptr);
    w.scales = Tensor::view(ref.scale_type == WeightType::BF16 ? DType::BF16 : DType::F16, {n, k / ref.group_size},
                            scales.data(), nullptr);
    w.zero_points = ref.zero_points ? Tensor::view(DType::I32, {(n + 7) / 8, k / ref.group_size}, zeros.data(), nullptr)
                                    : Tensor::zeros(DType::I32, {0});
    return w;
  }
};

TEST(Int4Format, ReadsTheQuantizationConfigTheCompressorWrote) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const auto cfg = Int4QuantConfig::from_hf_config(fixture_path(std::string(c.dir) + "/config.json"));
    ASSERT_TRUE(cfg.has_value());
    EXPECT_EQ(cfg->group_sizes, std::vector<int>{c.group_size});
    EXPECT_EQ(cfg->ignore, std::vector<std::string>{"re:.*gate$"});
  }
  // The unquantised fixtures have no quantization_config.
  EXPECT_FALSE(Int4QuantConfig::from_hf_config(fixture_path("mixtral_tiny/config.json")).has_value());
}

TEST(Int4Format, RefusesOtherSchemes) {
  moe::test::TempDir dir;
  const auto config = [&](const std::string& q) {
    return dir.write("config.json", "{\"model_type\": \"mixtral\", \"quantization_config\": " + q + "}");
  };
  const std::string weights4 =
      "\"weights\": {\"num_bits\": 4, \"type\": \"int\", \"strategy\": \"group\", \"group_size\": 128}";
  expect_error([&] { Int4QuantConfig::from_hf_config(config("{\"quant_method\": \"gptq\"}")); },
               {"config.json quantization_config", "quant_method 'gptq'"});
  expect_error(
      [&] {
        Int4QuantConfig::from_hf_config(
            config("{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\"}"));
      },
      {"format 'float-quantized'", "pack-quantized"});
  expect_error(
      [&] {
        Int4QuantConfig::from_hf_config(config(
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"pack-quantized\", \"config_groups\": {\"g\": {" +
            weights4 + ", \"input_activations\": {\"num_bits\": 8}}}}"));
      },
      {"config_groups.g", "'input_activations' is set", "W4A16"});
  expect_error(
      [&] {
        Int4QuantConfig::from_hf_config(config(
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"pack-quantized\", \"config_groups\": {\"g\": "
            "{\"weights\": {\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"group\", \"group_size\": 128}}}}"));
      },
      {"config_groups.g.weights", "num_bits must be 4"});
  expect_error(
      [&] {
        Int4QuantConfig::from_hf_config(config(
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"pack-quantized\", \"config_groups\": {\"g\": "
            "{\"weights\": {\"num_bits\": 4, \"type\": \"int\", \"strategy\": \"group\", \"group_size\": 12}}}}"));
      },
      {"group_size 12 is not a positive multiple of 8"});
}

// The expected weights are the package's own dequantize() of the same tensors (in the scale's
// dtype); ours, widened to f32, must have the same bits.
TEST(Int4Format, DequantisesBitForBitAsThePackage) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const Checkpoint weights = Checkpoint::open(fixture_path(c.dir));
    const SafetensorsFile expected = SafetensorsFile::open(fixture_path(std::string(c.dir) + "/expected.safetensors"));
    ASSERT_FALSE(expected.names().empty());
    for (const std::string& name : expected.names()) {
      SCOPED_TRACE(name);
      const Tensor want = expected.get(name);
      ASSERT_EQ(want.dtype(), c.scale_dtype);
      ASSERT_TRUE(moe::is_packed_int4(weights, module_of(name)));
      const PackedInt4Weight w = moe::load_packed_int4(weights, module_of(name), want.shape());
      EXPECT_EQ(w.group_size, c.group_size);
      EXPECT_EQ(w.symmetric(), c.symmetric);
      EXPECT_EQ(w.scales.dtype(), c.scale_dtype);
      // Views into the file, as published.
      EXPECT_EQ(w.packed.raw_data(), weights.get(name.substr(0, name.size() - 7) + ".weight_packed").raw_data());
      const Tensor got = w.dequantize();
      EXPECT_TRUE(same_bits(got, want.to_f32())) << "max |diff| " << moe::test::max_abs_error(got, want);
      for (Int4Isa isa : isas()) {
        SCOPED_TRACE(moe::kernels::cpu::int4_isa_name(isa));
        Tensor kernel = Tensor::zeros(DType::F32, want.shape());
        moe::kernels::cpu::dequantize_q4(w.ref(), w.out, w.in, kernel.data<float>(), isa);
        EXPECT_TRUE(same_bits(kernel, got));
      }
    }
    // Unquantised tensors are not packed: the router and the shared-expert gate.
    EXPECT_FALSE(moe::is_packed_int4(weights, std::string(c.prefix) + "gate"));
  }
}

TEST(Int4Format, LoaderErrorsNameTheTensor) {
  const Checkpoint weights = Checkpoint::open(fixture_path("int4/mixtral_sym_g32"));
  const std::string module = "model.layers.0.block_sparse_moe.experts.1.w2";
  expect_error(
      [&] {
        moe::load_packed_int4(weights, module, {kInter, kHidden});
      },
      {"model.safetensors", module + ".weight_shape", "says [64, 128], expected [128,64]"});
  expect_error(
      [&] {
        moe::load_packed_int4(weights, "model.layers.0.block_sparse_moe.experts.9.w2", {64, 128});
      },
      {"experts.9.w2.weight_packed"});
}

// The kernels' dequantisation over group sizes the fixtures lack (8 and 16: the scalar and AVX2
// fallbacks inside a wider instruction set; 128) and both scale types, against the loader's.
TEST(Int4Kernels, DequantiseMatchesTheLoaderForEveryGroupSize) {
  unsigned seed = 1;
  for (int group : {8, 16, 32, 64, 128})
    for (bool symmetric : {true, false})
      for (bool bf16 : {false, true}) {
        SCOPED_TRACE("group " + std::to_string(group) + (symmetric ? " sym" : " asym") + (bf16 ? " bf16" : " f16"));
        const int64_t n = 13, k = 256;
        RandomQ4 q(n, k, group, symmetric, bf16, seed++);
        const Tensor want = q.as_packed(n, k).dequantize();
        for (Int4Isa isa : isas()) {
          SCOPED_TRACE(moe::kernels::cpu::int4_isa_name(isa));
          Tensor got = Tensor::zeros(DType::F32, {n, k});
          moe::kernels::cpu::dequantize_q4(q.ref, n, k, got.data<float>(), isa);
          EXPECT_TRUE(same_bits(got, want));
        }
      }
}

// linear_q4 on both paths (direct for m ≤ kInt4DirectMaxRows, dequantise + GEMM above), every
// instruction set, odd row counts (partial register blocks), with and without bias.
TEST(Int4Kernels, LinearMatchesTheDequantisedWeights) {
  const int64_t direct = moe::kernels::cpu::kInt4DirectMaxRows;
  unsigned seed = 100;
  for (int group : {16, 32, 128})
    for (bool symmetric : {true, false}) {
      const int64_t n = 24, k = 256;
      RandomQ4 q(n, k, group, symmetric, !symmetric, seed++);
      const Tensor w = q.as_packed(n, k).dequantize();
      const std::vector<float> bias = random_floats(static_cast<size_t>(n), seed++);
      for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{9}, direct, direct + 1, int64_t{70}}) {
        const std::vector<float> x = random_floats(static_cast<size_t>(m * k), seed++);
        std::vector<double> ref, magnitude;
        reference_linear(x, w, m, ref, magnitude);
        for (Int4Isa isa : isas())
          for (bool with_bias : {false, true}) {
            SCOPED_TRACE("group " + std::to_string(group) + " m " + std::to_string(m) + " " +
                         moe::kernels::cpu::int4_isa_name(isa) + (with_bias ? " bias" : ""));
            std::vector<float> y(static_cast<size_t>(m * n), NAN);
            moe::kernels::cpu::linear_q4(x.data(), q.ref, with_bias ? bias.data() : nullptr, y.data(), m, n, k, isa);
            for (int64_t i = 0; i < m * n; ++i) {
              const double want = ref[i] + (with_bias ? bias[i % n] : 0.0);
              ASSERT_NEAR(y[i], want, 1e-5 * (magnitude[i] + 1.0)) << "at " << i;
            }
          }
      }
    }
}

// The CPU backend's linear past the direct limit: blocks of rows dequantised on its pool (two
// threads here) and multiplied by its oneDNN GEMM; several blocks, the last one partial.
TEST(Int4Kernels, BackendLinearDequantisesOnItsPoolBlockByBlock) {
  const int64_t m = moe::kernels::cpu::kInt4DirectMaxRows + 8, n = 1100, k = 256;  // blocks of 1024 rows
  RandomQ4 q(n, k, 32, false, true, 41);
  const Tensor w = q.as_packed(n, k).dequantize();
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 42), bias = random_floats(n, 43);
  std::vector<double> ref, magnitude;
  reference_linear(x, w, m, ref, magnitude);
  moe::kernels::CpuBackendOptions options;
  options.threads = 2;
  const auto backend = moe::kernels::make_cpu_backend(options);
  std::vector<float> y(static_cast<size_t>(m * n), NAN);
  backend->linear(x.data(), {&q.ref, WeightType::Q4}, bias.data(), y.data(), m, n, k);
  for (int64_t i = 0; i < m * n; ++i)
    ASSERT_NEAR(y[i], ref[i] + bias[i % n], 1e-5 * (magnitude[i] + 1.0)) << "at " << i;
}

// The grouped SwiGLU over the package's experts equals the f32 reference kernel over their
// dequantised weights (the backend's grouped_swiglu contract), an expert without rows included.
TEST(Int4Kernels, GroupedSwigluMatchesTheF32ReferenceOnThePackagesExperts) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const Checkpoint weights = Checkpoint::open(fixture_path(c.dir));
    std::vector<PackedInt4Weight> packed;
    std::vector<Tensor> dense;
    for (int64_t e = 0; e < kExperts; ++e)
      for (int j = 0; j < 3; ++j) {
        const std::string module = std::string(c.prefix) + "experts." + std::to_string(e) + "." + c.projections[j];
        packed.push_back(
            moe::load_packed_int4(weights, module, j < 2 ? moe::Shape{kInter, kHidden} : moe::Shape{kHidden, kInter}));
        dense.push_back(packed.back().dequantize());
      }
    std::vector<Q4Weight> refs;
    for (const PackedInt4Weight& p : packed) refs.push_back(p.ref());
    const std::vector<int64_t> offsets = {0, 5, 5, 6, 40};  // expert 1 has no rows; 34 > the direct limit
    std::vector<ExpertWeights> q4(kExperts), f32(kExperts);
    for (int64_t e = 0; e < kExperts; ++e) {
      if (e == 1) continue;
      q4[e] = {{&refs[e * 3], WeightType::Q4}, {&refs[e * 3 + 1], WeightType::Q4}, {&refs[e * 3 + 2], WeightType::Q4}};
      f32[e] = {{dense[e * 3].raw_data(), WeightType::F32},
                {dense[e * 3 + 1].raw_data(), WeightType::F32},
                {dense[e * 3 + 2].raw_data(), WeightType::F32}};
    }
    const std::vector<float> x = random_floats(static_cast<size_t>(offsets.back() * kHidden), 7);
    std::vector<float> want(x.size());
    moe::kernels::cpu::grouped_swiglu(x.data(), offsets, f32, kHidden, kInter, want.data());
    double scale = 0.0;
    for (float v : want) scale = std::max(scale, static_cast<double>(std::fabs(v)));
    // The CPU backend's grouped_swiglu reads the Q4 experts through linear (cpu_int4.h).
    const auto backend = moe::kernels::make_cpu_backend();
    std::vector<float> got(x.size(), NAN);
    backend->grouped_swiglu(x.data(), offsets, q4, kHidden, kInter, got.data());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * scale) << "at " << i;
    // Experts may mix weight types (a dense matrix among 4-bit ones).
    std::vector<ExpertWeights> mixed = q4;
    mixed[2].w3 = f32[2].w3;
    std::fill(got.begin(), got.end(), NAN);
    backend->grouped_swiglu(x.data(), offsets, mixed, kHidden, kInter, got.data());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * scale) << "mixed, at " << i;
  }
}

TEST(Int4Kernels, RefusesGroupSizesThatDoNotDivideTheRow) {
  RandomQ4 q(4, 96, 64, true, false, 3);
  std::vector<float> x(96), y(4);
  expect_error([&] { moe::kernels::cpu::linear_q4(x.data(), q.ref, nullptr, y.data(), 1, 4, 96); },
               {"cpu: linear", "group size 64", "divides k = 96"});
}

}  // namespace

// ---- the engine's MoE layer on the package's checkpoints (needs Q4 in the CPU backend) --------

namespace {

// A layer loaded from a pack-quantized checkpoint runs the 4-bit experts on the CPU backend and
// matches the per-row reference over the dequantised weights (expert_weight); experts stay packed.
TEST(Int4Layer, LoadsPackedExpertsByPrefixAndMatchesTheReference) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const moe::MoeLayer layer = moe::MoeLayer::load_hf_layer(fixture_path(c.dir), c.prefix);
    const Checkpoint weights = Checkpoint::open(fixture_path(c.dir));
    const std::string module = std::string(c.prefix) + "experts.2." + c.projections[0];
    EXPECT_TRUE(same_bits(layer.expert_weight(2, moe::ExpertMatrix::W1),
                          moe::load_packed_int4(weights, module, {kInter, kHidden}).dequantize()));
    const std::vector<float> xv = random_floats(static_cast<size_t>(37 * kHidden), 11);
    const Tensor x = Tensor::from_vector(xv, {37, kHidden});
    const moe::Routing routing = layer.route(x);
    const Tensor got = layer.run_experts(x, routing), want = layer.run_experts_reference(x, routing);
    EXPECT_LT(moe::test::max_rel_error(got, want), 1e-5);
  }
}

// The layer reports its experts as 4-bit and counts their packed bytes (codes, scales, zero
// points) as the checkpoint holds them, whatever precision the options asked for.
TEST(Int4Layer, ReportsQ4AndThePackedExpertBytes) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    moe::ComputeOptions options;
    options.precision = WeightType::F16;
    const moe::MoeLayer layer = moe::MoeLayer::load_hf_layer(fixture_path(c.dir), c.prefix, options);
    EXPECT_EQ(layer.precision(), WeightType::Q4);
    const Checkpoint weights = Checkpoint::open(fixture_path(c.dir));
    size_t packed_bytes = 0;
    for (int64_t e = 0; e < kExperts; ++e)
      for (int m = 0; m < 3; ++m) {
        const std::string module = std::string(c.prefix) + "experts." + std::to_string(e) + "." + c.projections[m];
        const moe::Shape shape = m == 2 ? moe::Shape{kHidden, kInter} : moe::Shape{kInter, kHidden};
        const PackedInt4Weight w = moe::load_packed_int4(weights, module, shape);
        packed_bytes += static_cast<size_t>(w.packed.nbytes() + w.scales.nbytes() + w.zero_points.nbytes());
      }
    EXPECT_EQ(layer.expert_bytes(), packed_bytes);
    // 4 bits per weight plus a 16-bit scale (and a 4-bit zero point) per group: under 0.2× of f32.
    EXPECT_LT(layer.expert_bytes(), 3 * kExperts * kHidden * kInter * sizeof(float) / 5);
  }
}

// The shipped 4-bit adapter (tools/moe-quantize.py) loads as one: Q4 experts, f32 router, and
// about 7× fewer expert bytes than the f32 adapter it was made from.
TEST(Int4Layer, ShippedInt4AdapterHoldsASeventhOfTheF32ExpertBytes) {
  const std::string root = moe::test::source_path("models/default/");
  const moe::MoeAdapter f32 = moe::MoeAdapter::load(root + "adapter");
  const moe::MoeAdapter int4 = moe::MoeAdapter::load(root + "adapter-int4");
  EXPECT_EQ(f32.layer().precision(), WeightType::F32);
  EXPECT_EQ(int4.layer().precision(), WeightType::Q4);
  const moe::MoeConfig& cfg = f32.layer().config();
  EXPECT_EQ(f32.layer().expert_bytes(),
            3 * static_cast<size_t>(cfg.num_experts * cfg.hidden_size * cfg.intermediate_size) * sizeof(float));
  const double ratio =
      static_cast<double>(f32.layer().expert_bytes()) / static_cast<double>(int4.layer().expert_bytes());
  EXPECT_GT(ratio, 6.5);
  EXPECT_LT(ratio, 8.0);
  // Same routing: the router is not quantised.
  const std::vector<float> xv = random_floats(static_cast<size_t>(64 * cfg.hidden_size), 5);
  const Tensor x = Tensor::from_vector(xv, {64, cfg.hidden_size});
  EXPECT_EQ(int4.route(x).expert_ids, f32.route(x).expert_ids);
}

// ---- 4-bit experts staged packed: store, cache, executor --------------------------------------

std::unique_ptr<moe::kernels::Backend> async_cpu() { return moe::kernels::make_cpu_backend({/*async_copies=*/true}); }

size_t padded(size_t bytes) {
  const size_t a = moe::HostExpertStore::kMatrixAlignment;
  return (bytes + a - 1) / a * a;
}

// The store copies the checkpoint's packed codes, scales and zero points byte for byte (no
// widening), and the descriptors of a blob point at them with the checkpoint's group size and
// scale type.
TEST(Int4Store, StagesThePackedBytesAsTheCheckpointHoldsThem) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const moe::MoeLayer layer = moe::MoeLayer::load_hf_layer(fixture_path(c.dir), c.prefix);
    auto backend = moe::kernels::make_cpu_backend();
    const moe::HostExpertStore store = moe::HostExpertStore::from_layer(*backend, layer, WeightType::F16);
    EXPECT_EQ(store.weight_type(), WeightType::Q4);
    size_t blob = 0;
    for (int e = 0; e < kExperts; ++e) {
      const ExpertWeights w = store.host_weights(e);
      const WeightRef refs[3] = {w.w1, w.w3, w.w2};
      for (int m = 0; m < 3; ++m) {
        const auto which = static_cast<moe::ExpertMatrix>(m);
        const PackedInt4Weight& p = layer.packed_expert_weight(e, which);
        ASSERT_EQ(refs[m].type, WeightType::Q4);
        const auto* q = static_cast<const Q4Weight*>(refs[m].data);
        const auto* base = static_cast<const unsigned char*>(store.expert_data(e));
        EXPECT_EQ(static_cast<const void*>(q->packed), base + store.matrix_offset(which));
        EXPECT_EQ(std::memcmp(q->packed, p.packed.raw_data(), p.packed.nbytes()), 0);
        EXPECT_EQ(std::memcmp(q->scales, p.scales.raw_data(), p.scales.nbytes()), 0);
        EXPECT_EQ(q->zero_points == nullptr, c.symmetric);
        if (!c.symmetric) {
          EXPECT_EQ(std::memcmp(q->zero_points, p.zero_points.raw_data(), p.zero_points.nbytes()), 0);
        }
        EXPECT_EQ(q->group_size, c.group_size);
        EXPECT_EQ(q->scale_type, c.scale_dtype == DType::BF16 ? WeightType::BF16 : WeightType::F16);
        if (e == 0) blob += padded(p.packed.nbytes()) + padded(p.scales.nbytes()) + padded(p.zero_points.nbytes());
      }
    }
    EXPECT_EQ(store.max_expert_bytes(), blob);
    // A slot's descriptors need somewhere to live; without it the store says so.
    expect_error([&] { store.weights_at(store.expert_data(0)); }, {"4-bit", "descriptors"});
  }
}

TEST(Int4Store, RefusesExpertsWhoseLayoutsDiffer) {
  auto backend = moe::kernels::make_cpu_backend();
  RandomQ4 g32(16, 64, 32, true, false, 1), g64(16, 64, 64, true, false, 2), down(64, 16, 8, true, false, 3);
  const PackedInt4Weight a = g32.as_packed(16, 64), b = g64.as_packed(16, 64), w2 = down.as_packed(64, 16);
  expect_error(
      [&] {
        moe::HostExpertStore(*backend, 2, 64, 16, [&](int e, moe::ExpertMatrix which) -> const PackedInt4Weight& {
          if (which == moe::ExpertMatrix::W2) return w2;
          return e == 1 && which == moe::ExpertMatrix::W3 ? b : a;
        });
      },
      {"expert 1 w3", "groups of 64", "expert 0's layout", "groups of 32"});
  expect_error([&] { moe::HostExpertStore(*backend, WeightType::Q4, 2, 64, 16, nullptr); }, {"4-bit", "packed"});
}

// A 4-bit layer through the expert executor on the CPU backend gives the bits of the layer's own
// CPU path (MoeAdapter::apply_experts): the same kernel reads the same packed bytes (with a
// shared expert, within f32 rounding, as for f32 experts: test_expert_executor). On one device
// with room for half the experts (small batches: evictions) and split over two devices (peer
// copies). The options' f16 does not widen them: they run as stored.
TEST(Int4Executor, EqualsTheLayersCpuPathBitForBit) {
  struct Setup {
    std::vector<size_t> slots;  // per device
    int64_t rows;
    int top_k;
  };
  const Setup setups[] = {{{2}, 2, 1}, {{3, 3}, 29, 2}};
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const moe::MoeAdapter adapter(moe::MoeLayer::load_hf_layer(fixture_path(c.dir), c.prefix));
    auto probe = moe::kernels::make_cpu_backend();
    const size_t slot = moe::HostExpertStore::from_layer(*probe, adapter.layer(), WeightType::Q4).max_expert_bytes();
    // Qwen2-MoE's shared expert (kept dequantised by the layer) takes its f32 bytes off each budget.
    const moe::MoeConfig& cfg = adapter.layer().config();
    const size_t shared =
        cfg.shared_expert_intermediate_size > 0
            ? moe::HostExpertStore::blob_bytes(WeightType::F32, cfg.hidden_size, cfg.shared_expert_intermediate_size)
            : 0;
    for (const Setup& setup : setups) {
      SCOPED_TRACE(std::to_string(setup.slots.size()) + " devices");
      std::vector<std::unique_ptr<moe::kernels::Backend>> backends;
      moe::ExpertExecutorOptions options;
      options.precision = WeightType::F16;
      options.admission_wait = std::chrono::milliseconds(60000);
      for (size_t slots : setup.slots) {
        backends.push_back(async_cpu());
        options.budget_bytes.push_back(shared + slots * slot);
      }
      moe::ExpertExecutor executor(adapter.layer(), std::move(backends), options);
      EXPECT_EQ(executor.precision(), WeightType::Q4);
      for (unsigned b = 0; b < 8; ++b) {
        const std::vector<float> xv = random_floats(static_cast<size_t>(setup.rows * kHidden), 300 + b);
        const Tensor x = Tensor::from_vector(xv, {setup.rows, kHidden});
        const moe::Routing r = adapter.route(x, setup.top_k);
        const Tensor got = executor.run(x, r, executor.prefetch(r)), want = adapter.apply_experts(x, r);
        if (shared == 0) {
          EXPECT_TRUE(same_bits(got, want)) << "batch " << b;
        } else {  // the executor gates the shared expert on the host: another summation order there
          EXPECT_LT(moe::test::max_abs_error(got, want), 1e-5) << "batch " << b;
        }
      }
      uint64_t evictions = 0;
      for (const moe::ExpertDeviceStats& s : executor.stats()) {
        SCOPED_TRACE(s.device);
        EXPECT_EQ(s.slot_bytes, slot);
        EXPECT_EQ(s.cache.bytes_copied, s.cache.misses * slot);
        EXPECT_EQ(s.cache.resident_bytes, s.cache.resident * slot);
        EXPECT_GT(s.cache.resident, 0u);
        evictions += s.cache.evictions;
      }
      if (setup.slots.size() == 1) {
        EXPECT_GT(evictions, 0u);
      }
    }
  }
}

// The shipped 4-bit adapter through the executor (ExpertExecutor::from_adapter_dir, as moe-expert
// builds it) equals the same adapter on the plain CPU path; the cache holds the packed bytes.
TEST(Int4Executor, ShippedAdapterFromItsDirectoryEqualsThePlainCpuPath) {
  const std::string dir = moe::test::source_path("models/default/adapter-int4");
  const moe::MoeAdapter plain = moe::MoeAdapter::load(dir);
  const auto executor = moe::ExpertExecutor::from_adapter_dir(dir, "cpu");
  const moe::MoeConfig& cfg = plain.layer().config();
  for (unsigned b = 0; b < 3; ++b) {
    const std::vector<float> xv = random_floats(static_cast<size_t>(50 * cfg.hidden_size), 400 + b);
    const Tensor x = Tensor::from_vector(xv, {50, cfg.hidden_size});
    const moe::Routing r = plain.route(x);
    EXPECT_TRUE(same_bits(executor->run(x, r, executor->prefetch(r)), plain.apply_experts(x, r))) << "batch " << b;
  }
  const moe::ExpertDeviceStats s = executor->stats().at(0);
  // Every array of the shipped adapter is a multiple of the alignment: slots are the packed bytes.
  EXPECT_EQ(s.slot_bytes * static_cast<size_t>(cfg.num_experts), plain.layer().expert_bytes());
  EXPECT_EQ(s.cache.resident_bytes, s.cache.resident * s.slot_bytes);
  EXPECT_EQ(s.cache.bytes_copied, s.cache.misses * s.slot_bytes);
}

// A budget that holds one f32 expert of the shipped adapter holds seven of its 4-bit twin's.
TEST(Int4Executor, ABudgetHoldsSevenTimesAsManyFourBitExperts) {
  const std::string root = moe::test::source_path("models/default/");
  const moe::MoeAdapter f32 = moe::MoeAdapter::load(root + "adapter");
  const moe::MoeAdapter int4 = moe::MoeAdapter::load(root + "adapter-int4");
  auto backend = async_cpu();
  const moe::HostExpertStore f32_store = moe::HostExpertStore::from_layer(*backend, f32.layer(), WeightType::F32);
  const moe::HostExpertStore int4_store = moe::HostExpertStore::from_layer(*backend, int4.layer(), WeightType::F32);
  moe::ExpertCacheOptions budget;
  budget.budget_bytes = f32_store.max_expert_bytes();
  moe::ExpertCache f32_cache(*backend, f32_store, budget), int4_cache(*backend, int4_store, budget);
  EXPECT_EQ(f32_cache.num_slots(), 1);
  EXPECT_EQ(int4_cache.num_slots(), 7);
  // Seven experts resident at once, their packed bytes copied as staged; acquire() describes them.
  {
    const std::shared_ptr<moe::BatchLease> lease = int4_cache.prefetch({0, 1, 2, 3, 4, 5, 6});
    for (int32_t e = 0; e < 7; ++e) {
      const ExpertWeights w = lease->acquire(e);
      const auto* packed = reinterpret_cast<const unsigned char*>(static_cast<const Q4Weight*>(w.w1.data)->packed);
      EXPECT_EQ(std::memcmp(packed - int4_store.matrix_offset(moe::ExpertMatrix::W1), int4_store.expert_data(e),
                            int4_store.max_expert_bytes()),
                0)
          << "expert " << e;
    }
    const moe::CacheStats stats = int4_cache.stats();
    EXPECT_EQ(stats.resident_bytes, 7 * int4_store.max_expert_bytes());
    EXPECT_EQ(stats.bytes_copied, stats.resident_bytes);
    EXPECT_LE(stats.resident_bytes, budget.budget_bytes);
  }
  // The executor plans its placement over the same packed slots.
  std::vector<std::unique_ptr<moe::kernels::Backend>> one;
  one.push_back(async_cpu());
  moe::ExpertExecutorOptions options;
  options.budget_bytes = {budget.budget_bytes};
  const moe::ExpertExecutor executor(int4.layer(), std::move(one), options);
  EXPECT_EQ(executor.stats().at(0).slots, 7);
}

// int4 asks for 4-bit experts as stored: a layer of f32 experts is refused, naming it and how to
// make a 4-bit one.
TEST(Int4Executor, RefusesInt4ForExpertsThatAreNotFourBit) {
  const std::string dir = moe::test::source_path("models/default/adapter");
  moe::ExpertExecutorOptions options;
  options.precision = WeightType::Q4;
  expect_error([&] { moe::ExpertExecutor::from_adapter_dir(dir, "cpu", options); },
               {"adapter/adapter_config.json", "f32", "tools/moe-quantize.py"});
}

TEST(Int4ExecutorOnCuda, EqualsTheLayersCpuPath) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.dir);
    const moe::MoeAdapter adapter(moe::MoeLayer::load_hf_layer(fixture_path(c.dir), c.prefix));
    moe::ExpertExecutor executor(adapter.layer(), "cuda:0");
    for (unsigned b = 0; b < 3; ++b) {
      const std::vector<float> xv = random_floats(static_cast<size_t>(41 * kHidden), 500 + b);
      const Tensor x = Tensor::from_vector(xv, {41, kHidden});
      const moe::Routing r = adapter.route(x);
      // Beyond a few rows CUDA rounds the activations to the scales' type (backend.h): ~1e-2 relative.
      EXPECT_LT(moe::test::max_abs_error(executor.run(x, r, executor.prefetch(r)), adapter.apply_experts(x, r)), 1e-2)
          << "batch " << b;
    }
  }
}

}  // namespace
