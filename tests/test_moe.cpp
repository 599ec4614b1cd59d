// MoE block and adapter against Hugging Face MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock,
// loaded from real (tiny, sharded) checkpoints; grouped execution against the naive reference;
// the adapter's cross-modal gate against torch (tools/make_gate_fixture.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include "backend.h"
#include "io/json_util.h"
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "moe/routing_policy.h"
#include "test_util.h"

using moe::MoeLayer;
using moe::Tensor;
using moe::test::adapter_tensors_without_gate;
using moe::test::expect_error;
using moe::test::fixture_path;
using moe::test::max_abs_error;
using moe::test::StoredTensor;
using moe::test::write_adapter;
using moe::test::write_joint_adapter;
using moe::test::write_joint_config;

namespace {

constexpr double kTol = 1e-5;

void check_against_hf(const std::string& name, const std::string& dir) {
  auto io = moe::SafetensorsFile::open(fixture_path("moe_io.safetensors"));
  const std::string prefix = io.metadata().at(name + ".prefix");
  MoeLayer layer = MoeLayer::load_hf_layer(fixture_path(dir), prefix);
  const Tensor x = io.get(name + ".input");
  EXPECT_LT(max_abs_error(layer.router_logits(x), io.get(name + ".router_logits")), kTol);
  const moe::Routing r = layer.route(x);
  const Tensor ids = io.get(name + ".selected_experts");
  const Tensor w = io.get(name + ".routing_weights");
  ASSERT_EQ(r.top_k, ids.dim(1));
  for (int64_t n = 0; n < r.rows; ++n)
    for (int j = 0; j < r.top_k; ++j) {
      EXPECT_EQ(r.expert(n, j), ids.data<int32_t>()[n * r.top_k + j]) << name << " row " << n;
      EXPECT_NEAR(r.weight(n, j), w.data<float>()[n * r.top_k + j], kTol) << name << " row " << n;
    }
  EXPECT_LT(max_abs_error(layer.run_experts(x, r), io.get(name + ".output")), kTol);
  EXPECT_LT(max_abs_error(layer.run_experts_reference(x, r), io.get(name + ".output")), kTol);
}

Tensor random_rows(int64_t rows, int64_t cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Tensor t = Tensor::zeros(moe::DType::F32, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

// A tensor of `shape` holding zeros, in `dtype` ("F32" or "I32": four bytes per value).
StoredTensor zeros(const std::string& name, const std::string& dtype, const moe::Shape& shape) {
  return {name, dtype, shape, std::string(static_cast<size_t>(moe::shape_numel(shape)) * 4, '\0')};
}

// Rows with a positive mean: the joint experts' constant router rows give them large logits.
Tensor joint_rows(int64_t rows, unsigned seed) {
  Tensor x = random_rows(rows, 16, seed);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 3.0f;
  return x;
}

std::vector<int32_t> row_ids(const moe::Routing& r, int64_t row) {
  return {r.expert_ids.begin() + row * r.top_k, r.expert_ids.begin() + (row + 1) * r.top_k};
}

std::vector<float> row_weights(const moe::Routing& r, int64_t row) {
  return {r.weights.begin() + row * r.top_k, r.weights.begin() + (row + 1) * r.top_k};
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace

TEST(MoeConfig, ReadsHuggingFaceConfigs) {
  auto m = moe::MoeConfig::from_hf_config(fixture_path("mixtral_tiny/config.json"));
  EXPECT_EQ(m.routing, moe::RoutingKind::Mixtral);
  EXPECT_EQ(m.num_experts, 6);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_TRUE(m.norm_topk_prob);
  auto q = moe::MoeConfig::from_hf_config(fixture_path("qwen2_moe_tiny/config.json"));
  EXPECT_EQ(q.routing, moe::RoutingKind::Qwen2Moe);
  EXPECT_EQ(q.intermediate_size, 20);
  EXPECT_EQ(q.shared_expert_intermediate_size, 28);
  EXPECT_FALSE(q.norm_topk_prob);
}

// The experts compute SiLU: a config naming any other activation is refused, every name that
// transformers' ACT2CLS maps to SiLU accepted (the lists come from transformers itself).
TEST(MoeConfig, RefusesActivationsOtherThanSilu) {
  moe::json::Document acts = moe::json::Document::from_file(fixture_path("formats/moe_activations.json"));
  auto names = [&](const char* key) {
    std::vector<std::string> out;
    JsonArray* arr = json_object_get_array_member(acts.root_object(), key);
    for (guint i = 0; arr != nullptr && i < json_array_get_length(arr); ++i)
      out.push_back(json_array_get_string_element(arr, i));
    return out;
  };
  ASSERT_FALSE(names("silu").empty());
  ASSERT_FALSE(names("other").empty());
  moe::test::TempDir dir;
  for (const char* model : {"mixtral_tiny", "qwen2_moe_tiny"}) {
    std::ifstream in(fixture_path(std::string(model) + "/config.json"));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string key = "\"hidden_act\": \"silu\"";
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << model;
    auto with_act = [&](const std::string& act) {
      std::string edited = text;
      edited.replace(at, key.size(), "\"hidden_act\": \"" + act + "\"");
      return dir.write(std::string(model) + "-" + act + ".json", edited);
    };
    for (const std::string& act : names("silu")) EXPECT_NO_THROW(moe::MoeConfig::from_hf_config(with_act(act))) << act;
    for (const std::string& act : names("other")) {
      const std::string path = with_act(act);
      expect_error([&] { moe::MoeConfig::from_hf_config(path); }, {path, "hidden_act '" + act + "'", "not supported"});
    }
  }
}

// A Qwen2-MoE config without shared_expert_intermediate_size: transformers builds the shared expert
// at its default size, the checkpoint holds it, and the block's output includes it.
TEST(MoeLayer, Qwen2MoeWithoutSharedSizeTakesTransformersDefault) {
  const std::string dir = fixture_path("formats/qwen2_moe_no_shared_size");
  auto io = moe::SafetensorsFile::open(dir + "/io.safetensors");
  MoeLayer layer = MoeLayer::load_hf_layer(dir, io.metadata().at("prefix"));
  EXPECT_EQ(layer.config().shared_expert_intermediate_size,
            std::stoi(io.metadata().at("shared_expert_intermediate_size")));
  const Tensor x = io.get("input");
  EXPECT_LT(max_abs_error(layer.router_logits(x), io.get("router_logits")), kTol);
  EXPECT_LT(moe::test::max_rel_error(layer.run_experts(x, layer.route(x)), io.get("output")), 1e-5);
}

TEST(MoeLayer, MatchesMixtralSparseMoeBlock) { check_against_hf("mixtral", "mixtral_tiny"); }
TEST(MoeLayer, MatchesQwen2MoeSparseMoeBlock) { check_against_hf("qwen2_moe", "qwen2_moe_tiny"); }

TEST(MoeAdapter, MatchesResidualNormalisedBlock) {
  auto io = moe::SafetensorsFile::open(fixture_path("moe_io.safetensors"));
  auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny"));
  auto out = adapter.apply(io.get("mixtral.input"));
  EXPECT_LT(max_abs_error(out.embeddings, io.get("adapter.output")), kTol);
  const Tensor ids = io.get("mixtral.selected_experts");
  for (int64_t i = 0; i < ids.numel(); ++i) EXPECT_EQ(out.routing.expert_ids[i], ids.data<int32_t>()[i]);
}

TEST(MoeAdapter, FingerprintIsTheWeightsFingerprint) {
  const std::string fp = moe::MoeAdapter::load(fixture_path("adapter_tiny")).fingerprint();
  EXPECT_EQ(fp, moe::Checkpoint::open(fixture_path("adapter_tiny/adapter.safetensors")).fingerprint());
  EXPECT_EQ(moe::MoeAdapter::load(fixture_path("adapter_tiny")).fingerprint(), fp);
  // The same shapes with one weight changed: another adapter.
  moe::test::TempDir retrained;
  std::filesystem::copy_file(fixture_path("adapter_tiny/adapter_config.json"), retrained.file("adapter_config.json"));
  moe::test::copy_with_one_value_changed(fixture_path("adapter_tiny/adapter.safetensors"),
                                         retrained.file("adapter.safetensors"), "experts.0.w1.weight");
  const std::string other = moe::MoeAdapter::load(retrained.path()).fingerprint();
  EXPECT_EQ(other.size(), 16u);
  EXPECT_NE(other, fp);
}

TEST(MoeLayer, GroupedEqualsReferenceOnManyRows) {
  for (const char* dir : {"mixtral_tiny", "qwen2_moe_tiny"}) {
    const std::string prefix =
        std::string(dir) == "mixtral_tiny" ? "model.layers.1.block_sparse_moe." : "model.layers.1.mlp.";
    MoeLayer layer = MoeLayer::load_hf_layer(fixture_path(dir), prefix);
    for (int64_t rows : {0, 1, 7, 513}) {
      const Tensor x = random_rows(rows, 16, static_cast<unsigned>(rows) + 7);
      const moe::Routing r = layer.route(x);
      EXPECT_LT(max_abs_error(layer.run_experts(x, r), layer.run_experts_reference(x, r)), 1e-5)
          << dir << " rows=" << rows;
    }
  }
}

TEST(MoeLayer, SkewedRoutingLeavesExpertsUnused) {
  // Every row sent to expert 4 only (hand-made routing): the grouped path runs one GEMM.
  MoeLayer layer = MoeLayer::load_hf_layer(fixture_path("mixtral_tiny"), "model.layers.1.block_sparse_moe.");
  const Tensor x = random_rows(40, 16, 3);
  moe::Routing r;
  r.rows = 40;
  r.top_k = 2;
  for (int i = 0; i < 40; ++i) {
    r.expert_ids.insert(r.expert_ids.end(), {4, 4});
    r.weights.insert(r.weights.end(), {0.75f, 0.25f});
  }
  EXPECT_LT(max_abs_error(layer.run_experts(x, r), layer.run_experts_reference(x, r)), 1e-5);
}

// The CPU backend's grouped_swiglu on expert weights given to prepare_linear_weight (as MoeLayer
// gives them) runs oneDNN on its packed copies, OpenBLAS on the weights as they are otherwise:
// the same results within f32 rounding, at row counts 1 to 70 and sizes the packed layout pads.
// The originals are overwritten with NaN after preparing, so a projection that still read them
// would show.
TEST(MoeLayer, PreparedExpertsMatchUnpreparedOnTheCpu) {
  constexpr int64_t kD = 96, kInter = 200, kExperts = 5;
  const std::vector<int64_t> offsets = {0, 1, 4, 4, 21, 91};  // 1, 3, 0, 17 and 70 rows
  const Tensor x = random_rows(offsets.back(), kD, 11);
  for (const moe::kernels::WeightType type : {moe::kernels::WeightType::F32, moe::kernels::WeightType::F16}) {
    auto backend = moe::kernels::make_cpu_backend({});
    const size_t per_expert = 2 * kInter * kD + kD * kInter;
    Tensor w = random_rows(kExperts, static_cast<int64_t>(per_expert), 12);
    for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] *= 0.1f;
    std::vector<uint16_t> halves(static_cast<size_t>(w.numel()));
    for (size_t i = 0; i < halves.size(); ++i) halves[i] = moe::float_to_half(w.data<float>()[i]);
    const bool f32 = type == moe::kernels::WeightType::F32;
    char* base = f32 ? static_cast<char*>(w.raw_data()) : reinterpret_cast<char*>(halves.data());
    const size_t element = f32 ? sizeof(float) : sizeof(uint16_t);
    std::vector<moe::kernels::ExpertWeights> experts;
    for (int64_t e = 0; e < kExperts; ++e) {
      char* p = base + e * per_expert * element;
      experts.push_back({{p, type}, {p + kInter * kD * element, type}, {p + 2 * kInter * kD * element, type}});
    }
    const auto run = [&] {
      Tensor out = Tensor::zeros(moe::DType::F32, {offsets.back(), kD});
      backend->grouped_swiglu(x.data<float>(), offsets, experts, kD, kInter, out.data<float>());
      return out;
    };
    const Tensor unprepared = run();
    for (const moe::kernels::ExpertWeights& e : experts) {
      backend->prepare_linear_weight(e.w1, kInter, kD);
      backend->prepare_linear_weight(e.w3, kInter, kD);
      backend->prepare_linear_weight(e.w2, kD, kInter);
    }
    std::fill(halves.begin(), halves.end(), uint16_t{0x7E00});  // NaN
    std::fill(w.data<float>(), w.data<float>() + w.numel(), std::nanf(""));
    const Tensor prepared = run();
    const float* got = prepared.data<float>();
    EXPECT_TRUE(std::all_of(got, got + prepared.numel(), [](float v) { return std::isfinite(v); }))
        << (f32 ? "f32" : "f16") << ": a projection read the original weights";
    EXPECT_LT(moe::test::max_rel_error(prepared, unprepared, 1e-3), 1e-5) << (f32 ? "f32" : "f16");
    for (const moe::kernels::ExpertWeights& e : experts) {
      backend->release_linear_weight(e.w1, kInter, kD);
      backend->release_linear_weight(e.w3, kInter, kD);
      backend->release_linear_weight(e.w2, kD, kInter);
    }
  }
}

TEST(MoeLayer, RejectsBadInputs) {
  MoeLayer layer = MoeLayer::load_hf_layer(fixture_path("mixtral_tiny"), "model.layers.1.block_sparse_moe.");
  expect_error([&] { layer.route(random_rows(3, 8, 1)); }, {"router", "f32[3,8]", "expected f32[rows,16]"});
  moe::Routing r = layer.route(random_rows(2, 16, 1));
  r.expert_ids[1] = 9;
  expect_error([&] { layer.run_experts(random_rows(2, 16, 1), r); }, {"expert id 9"});
  expect_error([&] { layer.run_experts(random_rows(3, 16, 1), layer.route(random_rows(2, 16, 1))); },
               {"routing for 2 rows"});
  expect_error([] { MoeLayer::load_hf_layer(fixture_path("mixtral_tiny"), "model.layers.7.block_sparse_moe."); },
               {"model.layers.7.block_sparse_moe.gate.weight"});
  expect_error([] { MoeLayer::load_hf_layer(fixture_path("clip_tiny"), ""); },
               {"config.json", "model_type", "not a supported MoE"});
  moe::MoeConfig bad = moe::MoeConfig::from_hf_config(fixture_path("mixtral_tiny/config.json"));
  bad.top_k = 7;
  expect_error([&] { bad.validate(); }, {"top_k 7"});
  bad = moe::MoeConfig::from_hf_config(fixture_path("mixtral_tiny/config.json"));
  bad.num_experts = 5;
  expect_error(
      [&] {
        MoeLayer::load(bad, moe::Checkpoint::open(fixture_path("mixtral_tiny")), "model.layers.1.block_sparse_moe.");
      },
      {"gate.weight", "has shape [6,16]", "expected [5,16]"});
  expect_error([] { moe::MoeAdapter::load(fixture_path("mixtral_tiny")); }, {"adapter_config.json", "cannot open"});
  bad = moe::MoeConfig::from_adapter_config(fixture_path("adapter_tiny/adapter_config.json"));
  EXPECT_EQ(bad.router_temperature, 1.0);  // none in the file
  bad.router_temperature = 0.0;
  expect_error([&] { bad.validate(); }, {"router_temperature", "outside [0.001, 1000]"});
}

// The gate against the seeds' CrossModalGate in torch, at weights from balanced to saturated.
TEST(MoeAdapter, CrossModalGateMatchesTorch) {
  auto io = moe::SafetensorsFile::open(fixture_path("gate_io.safetensors"));
  const auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny_gate"));
  ASSERT_TRUE(adapter.has_cross_modal_gate());
  Tensor weights;
  const Tensor fused = adapter.fuse(io.get("image"), io.get("text"), &weights);
  EXPECT_LT(max_abs_error(weights, io.get("weights")), 1e-6);
  EXPECT_LT(moe::test::max_rel_error(fused, io.get("fused"), 1e-3), 1e-5);
  EXPECT_EQ(max_abs_error(adapter.fuse(io.get("image"), io.get("text"), nullptr), fused), 0.0);
  // The fused rows go through the same experts as adapter_tiny's: the gate changes no other weight.
  const auto plain = moe::MoeAdapter::load(fixture_path("adapter_tiny"));
  EXPECT_LT(max_abs_error(adapter.apply(fused).embeddings, plain.apply(fused).embeddings), 1e-6);
  // The gate is part of the weights: the fingerprint is the file's, not adapter_tiny's.
  EXPECT_EQ(adapter.fingerprint(),
            moe::Checkpoint::open(fixture_path("adapter_tiny_gate/adapter.safetensors")).fingerprint());
  EXPECT_NE(adapter.fingerprint(), plain.fingerprint());
}

TEST(MoeAdapter, WithoutGateFusesThePlainAverage) {
  const auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny"));
  EXPECT_FALSE(adapter.has_cross_modal_gate());
  const Tensor image = random_rows(5, 16, 21), text = random_rows(5, 16, 22);
  Tensor weights;
  const Tensor fused = adapter.fuse(image, text, &weights);
  ASSERT_EQ(weights.shape(), (moe::Shape{5, 2}));
  for (int64_t i = 0; i < weights.numel(); ++i) EXPECT_EQ(weights.data<float>()[i], 0.5f);
  Tensor average = Tensor::zeros(moe::DType::F32, {5, 16});
  for (int64_t i = 0; i < average.numel(); ++i)
    average.data<float>()[i] = 0.5f * (image.data<float>()[i] + text.data<float>()[i]);
  EXPECT_LT(max_abs_error(fused, average), 1e-6);
  // No rows: nothing to fuse.
  const Tensor none = adapter.fuse(random_rows(0, 16, 1), random_rows(0, 16, 1), &weights);
  EXPECT_EQ(none.shape(), (moe::Shape{0, 16}));
  EXPECT_EQ(weights.shape(), (moe::Shape{0, 2}));
}

TEST(MoeAdapter, FuseRejectsMismatchedInputs) {
  const auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny_gate"));
  expect_error([&] { adapter.fuse(random_rows(3, 16, 1), random_rows(2, 16, 2), nullptr); },
               {"fuse", "3 image rows and 2 text rows"});
  expect_error([&] { adapter.fuse(random_rows(2, 16, 1), random_rows(2, 8, 2), nullptr); },
               {"fuse: text", "f32[2,8]", "expected f32[rows,16]"});
  expect_error([&] { adapter.fuse(random_rows(2, 32, 1), random_rows(2, 16, 2), nullptr); },
               {"fuse: image", "f32[2,32]"});
}

// A gate must be whole and of the adapter's width; the error names the tensor and the shapes.
TEST(MoeAdapter, RejectsBadCrossModalGates) {
  moe::test::TempDir dir;
  const auto with = [&](std::vector<StoredTensor> extra) {
    std::vector<StoredTensor> tensors = adapter_tensors_without_gate();
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    return write_adapter(dir, tensors);
  };
  const StoredTensor weight = zeros("cross_modal_gate.weight", "F32", {2, 32});
  const StoredTensor bias = zeros("cross_modal_gate.bias", "F32", {2});
  EXPECT_TRUE(moe::MoeAdapter::load(with({weight, bias})).has_cross_modal_gate());
  EXPECT_FALSE(moe::MoeAdapter::load(with({})).has_cross_modal_gate());
  expect_error([&] { moe::MoeAdapter::load(with({weight})); },
               {"adapter.safetensors", "'cross_modal_gate.bias' is missing"});
  expect_error([&] { moe::MoeAdapter::load(with({bias})); },
               {"adapter.safetensors", "'cross_modal_gate.weight' is missing"});
  expect_error(
      [&] {
        moe::MoeAdapter::load(with({zeros("cross_modal_gate.weight", "F32", {2, 16}), bias}));
      },
      {"'cross_modal_gate.weight'", "shape [2,16]", "expected [2,32]"});
  expect_error(
      [&] {
        moe::MoeAdapter::load(with({zeros("cross_modal_gate.weight", "F32", {3, 32}), bias}));
      },
      {"'cross_modal_gate.weight'", "shape [3,32]", "expected [2,32]"});
  expect_error(
      [&] {
        moe::MoeAdapter::load(with({weight, zeros("cross_modal_gate.bias", "F32", {1, 2})}));
      },
      {"'cross_modal_gate.bias'", "shape [1,2]", "expected [2]"});
  expect_error(
      [&] {
        moe::MoeAdapter::load(with({zeros("cross_modal_gate.weight", "I32", {2, 32}), bias}));
      },
      {"'cross_modal_gate.weight'", "integer dtype"});
}

// The same gate on a CUDA device (its topk_softmax, moe_permute and moe_unpermute), against torch.
TEST(MoeAdapter, CrossModalGateOnCudaMatchesTorch) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto io = moe::SafetensorsFile::open(fixture_path("gate_io.safetensors"));
  moe::ComputeOptions options;
  options.device = "cuda:0";
  const auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny_gate"), options);
  Tensor weights;
  const Tensor fused = adapter.fuse(io.get("image"), io.get("text"), &weights);
  EXPECT_LT(max_abs_error(weights, io.get("weights")), 1e-6);
  EXPECT_LT(moe::test::max_rel_error(fused, io.get("fused"), 1e-3), 1e-5);
}

// Joint visual-text experts (adapter_config.json "joint_experts"): a single-modality row never
// routes to them and is routed and adapted exactly, bit for bit, as by the adapter without them;
// a fused hybrid row routes among all experts.
TEST(MoeAdapter, JointExpertsServeOnlyFusedRows) {
  moe::test::TempDir dir;
  const auto tiny = moe::MoeAdapter::load(fixture_path("adapter_tiny"));
  const auto joint = moe::MoeAdapter::load(write_joint_adapter(dir, 2));
  EXPECT_EQ(tiny.num_joint_experts(), 0);
  ASSERT_EQ(joint.num_joint_experts(), 2);
  constexpr int64_t kRows = 37;
  const Tensor x = joint_rows(kRows, 5);

  const Tensor logits = joint.layer().router_logits(x), want_logits = tiny.layer().router_logits(x);
  for (int64_t n = 0; n < kRows; ++n)
    for (int64_t e = 0; e < 8; ++e) {
      const float got = logits.data<float>()[n * 8 + e];
      if (e < 6)
        EXPECT_EQ(got, want_logits.data<float>()[n * 6 + e]) << "row " << n << " expert " << e;
      else
        EXPECT_EQ(got, -INFINITY) << "row " << n << " expert " << e;
    }
  for (int k = 1; k <= 6; ++k) {
    const moe::Routing got = joint.route(x, k), want = tiny.route(x, k);
    EXPECT_EQ(got.expert_ids, want.expert_ids) << "top_k " << k;
    EXPECT_EQ(got.weights, want.weights) << "top_k " << k;
  }
  expect_error([&] { joint.route(x, 7); }, {"top_k 7", "outside [1, 6]", "2 of the 8 experts are joint"});
  const moe::AdapterOutput single = joint.apply(x), want = tiny.apply(x);
  EXPECT_TRUE(same_bits(single.embeddings, want.embeddings));
  EXPECT_EQ(single.routing.expert_ids, want.routing.expert_ids);
  EXPECT_EQ(single.routing.weights, want.routing.weights);
  // Routing policies see -inf for the joint experts: the tiny adapter's routing, batch after batch.
  for (const double capacity : {0.0, 1.0}) {
    moe::RoutingPolicy policy;
    policy.capacity_factor = capacity;
    policy.balance = moe::LoadBalance::Bias;
    policy.balance_rate = 0.05;
    policy.balance_margin = 1.0;
    policy.temperature = 1.5;
    moe::Router with_joint(8, policy), without(6, policy);
    for (int batch = 0; batch < 3; ++batch) {
      const Tensor xb = joint_rows(kRows, 40u + static_cast<unsigned>(batch));
      const moe::Routing got = with_joint.route(joint.layer().router_logits(xb).data<float>(), kRows);
      const moe::Routing expected = without.route(tiny.layer().router_logits(xb).data<float>(), kRows);
      EXPECT_EQ(got.expert_ids, expected.expert_ids) << "capacity " << capacity << " batch " << batch;
      EXPECT_EQ(got.weights, expected.weights) << "capacity " << capacity << " batch " << batch;
    }
  }

  // Fused rows: the joint experts outrank every other one.
  const MoeLayer::FusedRows all_fused(kRows, true);
  const moe::AdapterOutput fused = joint.apply(x, all_fused);
  for (int64_t n = 0; n < kRows; ++n) EXPECT_EQ(row_ids(fused.routing, n), (std::vector<int32_t>{7, 6})) << n;
  EXPECT_GT(max_abs_error(fused.embeddings, want.embeddings), 1e-3);

  // One batch of both kinds: each row routed as its kind alone.
  MoeLayer::FusedRows mixed(kRows);
  for (int64_t n = 0; n < kRows; n += 3) mixed[static_cast<size_t>(n)] = true;
  const moe::AdapterOutput both = joint.apply(x, mixed);
  for (int64_t n = 0; n < kRows; ++n) {
    const moe::AdapterOutput& as = mixed[static_cast<size_t>(n)] ? fused : want;
    EXPECT_EQ(row_ids(both.routing, n), row_ids(as.routing, n)) << n;
    EXPECT_EQ(row_weights(both.routing, n), row_weights(as.routing, n)) << n;
    for (int64_t d = 0; d < 16; ++d)
      EXPECT_NEAR(both.embeddings.data<float>()[n * 16 + d], as.embeddings.data<float>()[n * 16 + d], 1e-6) << n;
  }
  expect_error([&] { joint.route(x, MoeLayer::FusedRows(3, true)); }, {"router", "3 fused-row flags for 37 rows"});
}

TEST(MoeConfig, RefusesBadJointExperts) {
  moe::test::TempDir dir;
  const std::string path = dir.file("adapter_config.json");
  for (const auto& [value, message] :
       std::vector<std::pair<std::string, std::string>>{{"-1", "'joint_experts' -1 outside [0, num_experts=8)"},
                                                        {"8", "'joint_experts' 8 outside [0, num_experts=8)"},
                                                        {"7", "joint_experts 7 outside [0, num_experts - top_k = 6]"},
                                                        {"\"two\"", "joint_experts"}}) {
    write_joint_config(dir, 8, value);
    expect_error([&] { moe::MoeConfig::from_adapter_config(path); }, {path, message});
  }
  write_joint_config(dir, 8, "6");
  EXPECT_EQ(moe::MoeConfig::from_adapter_config(path).joint_experts, 6);
}

// The same masking on a CUDA device (routing through its topk_softmax).
TEST(MoeAdapter, JointExpertsOnCudaServeOnlyFusedRows) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  moe::ComputeOptions options;
  options.device = "cuda:0";
  moe::test::TempDir dir;
  const auto tiny = moe::MoeAdapter::load(fixture_path("adapter_tiny"), options);
  const auto joint = moe::MoeAdapter::load(write_joint_adapter(dir, 2), options);
  const Tensor x = joint_rows(37, 6);
  const moe::AdapterOutput single = joint.apply(x), want = tiny.apply(x);
  EXPECT_TRUE(same_bits(single.embeddings, want.embeddings));
  EXPECT_EQ(single.routing.expert_ids, want.routing.expert_ids);
  EXPECT_EQ(single.routing.weights, want.routing.weights);
  const moe::Routing fused = joint.route(x, MoeLayer::FusedRows(37, true));
  for (int64_t n = 0; n < 37; ++n) EXPECT_EQ(row_ids(fused, n), (std::vector<int32_t>{7, 6})) << n;
}
