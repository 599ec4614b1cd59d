// CLIP encoders against Hugging Face transformers (fixtures from tools/make_fixtures.py and
// tools/make_format_fixtures.py).
#include <gtest/gtest.h>

#include <json-glib/json-glib.h>

#include <fstream>

#include "io/json_util.h"
#include "moe/clip_model.h"
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "test_util.h"

using moe::ClipModel;
using moe::Tensor;
using moe::test::expect_error;
using moe::test::fixture_path;
using moe::test::max_rel_error;
using moe::test::real_ids;

namespace {

constexpr double kTol = 1e-4;  // relative, as the issue asks

const ClipModel& tiny() {
  static ClipModel m = ClipModel::load(fixture_path("clip_tiny"));
  return m;
}

}  // namespace

TEST(ClipConfig, ReadsHuggingFaceLayout) {
  const moe::ClipConfig& c = tiny().config();
  EXPECT_EQ(c.projection_dim, 24);
  EXPECT_EQ(c.text.hidden_size, 32);
  EXPECT_EQ(c.text.intermediate_size, 37);
  EXPECT_EQ(c.text.eos_token_id, 999);
  EXPECT_EQ(c.text.hidden_act, moe::Activation::QuickGelu);
  EXPECT_EQ(c.vision.hidden_act, moe::Activation::Gelu);
  EXPECT_EQ(c.vision.num_positions(), 17);
}

TEST(ClipText, MatchesTransformersBatched) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  auto r = tiny().encode_token_ids(real_ids(io, "text."));
  EXPECT_LT(max_rel_error(r.pooled, io.get("text.pooled")), kTol);
  EXPECT_LT(max_rel_error(r.embeds, io.get("text.text_embeds")), kTol);
}

TEST(ClipText, OneAtATimeEqualsBatchAndPaddingIsIgnored) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  const auto ids = real_ids(io, "text.");
  const Tensor ref = io.get("text.text_embeds");
  Tensor padded_ids = io.get("text.input_ids");
  for (size_t b = 0; b < ids.size(); ++b) {
    auto one = tiny().encode_token_ids({ids[b]});
    EXPECT_LT(max_rel_error(one.embeds, ref.slice_rows(b, b + 1)), kTol) << "row " << b;
    // The full 77-token row with padding after the end token: pooled at the end token.
    const int32_t* row = padded_ids.data<int32_t>() + b * 77;
    auto pad = tiny().encode_token_ids({std::vector<int32_t>(row, row + 77)});
    EXPECT_LT(max_rel_error(pad.embeds, ref.slice_rows(b, b + 1)), kTol) << "row " << b;
  }
}

TEST(ClipVision, MatchesTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  auto r = tiny().encode_pixels(io.get("vision.pixel_values"));
  EXPECT_LT(max_rel_error(r.pooled, io.get("vision.pooled")), kTol);
  EXPECT_LT(max_rel_error(r.embeds, io.get("vision.image_embeds")), kTol);
}

TEST(ClipText, RejectsBadTokenIds) {
  expect_error([] { tiny().encode_token_ids({{998, 1000, 999}}); }, {"token id 1000", "outside the vocabulary"});
  expect_error([] { tiny().encode_token_ids({{}}); }, {"no tokens"});
  expect_error([] { tiny().encode_token_ids({std::vector<int32_t>(78, 5)}); }, {"78 tokens", "77 positions"});
  expect_error([] { tiny().encode_texts({"hello"}); }, {"clip_tiny", "no tokenizer"});
}

TEST(ClipVision, RejectsWrongPixelShape) {
  Tensor px = Tensor::zeros(moe::DType::F32, {1, 3, 33, 32});
  expect_error([&] { tiny().encode_pixels(px); }, {"pixel_values", "[1,3,33,32]", "expected [B,3,32,32]"});
}

TEST(ClipModelLoad, FingerprintIsTheWeightsFingerprint) {
  const std::string fp = tiny().fingerprint();
  EXPECT_EQ(fp.size(), 16u);
  EXPECT_EQ(fp, moe::Checkpoint::open(fixture_path("clip_tiny")).fingerprint());
  EXPECT_EQ(ClipModel::load(fixture_path("clip_tiny")).fingerprint(), fp);
  moe::test::TempDir retrained;
  std::filesystem::copy_file(fixture_path("clip_tiny/config.json"), retrained.file("config.json"));
  moe::test::copy_with_one_value_changed(fixture_path("clip_tiny/model.safetensors"),
                                         retrained.file("model.safetensors"), "visual_projection.weight");
  EXPECT_NE(ClipModel::load(retrained.path()).fingerprint(), fp);
}

// Configs in older transformers' layouts (text_config_dict / vision_config_dict, alone or beside
// text_config / vision_config), each read as transformers' CLIPConfig reads it (the expected
// values are its attributes, from tools/make_format_fixtures.py).
TEST(ClipConfig, ReadsOldTowerDictsAsTransformersDoes) {
  const std::string dir = fixture_path("formats/clip_config/");
  moe::json::Document doc = moe::json::Document::from_file(dir + "expected.json");
  JsonObject* cases = doc.root_object();
  ASSERT_EQ(json_object_get_size(cases), 3u);
  for (const std::string name : {"dict_only", "both_disagree", "null_dict"}) {
    SCOPED_TRACE(name);
    JsonObject* want = moe::json::get_object_or_null(cases, name.c_str(), "expected.json");
    ASSERT_NE(want, nullptr);
    const moe::ClipConfig c = moe::ClipConfig::from_file(dir + name + ".json");
    EXPECT_EQ(c.projection_dim, moe::json::get_int(want, "projection_dim", name));
    auto check_encoder = [&](JsonObject* w, const moe::ClipEncoderConfig& e) {
      EXPECT_EQ(e.hidden_size, moe::json::get_int(w, "hidden_size", name));
      EXPECT_EQ(e.intermediate_size, moe::json::get_int(w, "intermediate_size", name));
      EXPECT_EQ(e.num_hidden_layers, moe::json::get_int(w, "num_hidden_layers", name));
      EXPECT_EQ(e.num_attention_heads, moe::json::get_int(w, "num_attention_heads", name));
      EXPECT_EQ(moe::activation_name(e.hidden_act), moe::json::get_string(w, "hidden_act", name));
      EXPECT_FLOAT_EQ(e.layer_norm_eps, static_cast<float>(moe::json::get_double_or(w, "layer_norm_eps", 0, name)));
    };
    JsonObject* text = moe::json::get_object_or_null(want, "text", name);
    ASSERT_NE(text, nullptr);
    check_encoder(text, c.text);
    EXPECT_EQ(c.text.vocab_size, moe::json::get_int(text, "vocab_size", name));
    EXPECT_EQ(c.text.max_position_embeddings, moe::json::get_int(text, "max_position_embeddings", name));
    EXPECT_EQ(c.text.bos_token_id, moe::json::get_int(text, "bos_token_id", name));
    EXPECT_EQ(c.text.eos_token_id, moe::json::get_int(text, "eos_token_id", name));
    EXPECT_EQ(c.text.pad_token_id, moe::json::get_int(text, "pad_token_id", name));
    JsonObject* vision = moe::json::get_object_or_null(want, "vision", name);
    ASSERT_NE(vision, nullptr);
    check_encoder(vision, c.vision);
    EXPECT_EQ(c.vision.image_size, moe::json::get_int(vision, "image_size", name));
    EXPECT_EQ(c.vision.patch_size, moe::json::get_int(vision, "patch_size", name));
    EXPECT_EQ(c.vision.num_channels, moe::json::get_int(vision, "num_channels", name));
  }
  // Errors name the form that was read.
  expect_error(
      [] {
        moe::ClipConfig::from_json(R"({"text_config_dict":{"hidden_act":"relu"},"vision_config":{}})", "cfg.json");
      },
      {"cfg.json text_config_dict", "'relu'"});
  expect_error([] { moe::ClipConfig::from_json(R"({"text_config":{}})", "cfg.json"); },
               {"missing 'vision_config' (or 'vision_config_dict'"});
}

TEST(ClipModelLoad, ErrorsNameFileTensorAndReason) {
  expect_error([] { ClipModel::load("/nonexistent/model"); }, {"/nonexistent/model", "no config.json"});
  // Weights from another model: the first missing tensor is named.
  const moe::ClipConfig cfg = tiny().config();
  expect_error([&] { ClipModel::load(cfg, moe::Checkpoint::open(fixture_path("adapter_tiny/adapter.safetensors"))); },
               {"adapter.safetensors", "text_model.embeddings.token_embedding.weight"});
  // A config that disagrees with the weights: the tensor, its shape and the expected one.
  moe::ClipConfig wrong = cfg;
  wrong.text.hidden_size = 16;
  wrong.text.num_attention_heads = 4;
  expect_error([&] { ClipModel::load(wrong, moe::Checkpoint::open(fixture_path("clip_tiny"))); },
               {"token_embedding.weight", "has shape [1000,32]", "expected [1000,16]"});
  expect_error(
      [] {
        moe::ClipConfig::from_json(R"({"model_type":"clip","text_config":{"hidden_act":"relu"},"vision_config":{}})",
                                   "cfg.json");
      },
      {"cfg.json text_config", "unsupported hidden_act 'relu'"});
  expect_error([] { moe::ClipConfig::from_json(R"({"model_type":"bert"})", "cfg.json"); }, {"model_type is 'bert'"});
  expect_error(
      [] {
        moe::ClipConfig::from_json(R"({"text_config":{"hidden_size":30,"num_attention_heads":8},"vision_config":{}})",
                                   "cfg.json");
      },
      {"not divisible"});
}

TEST(ClipConfig, RefusesSizesBeyondTheBounds) {
  auto config = [](const std::string& root, const std::string& text, const std::string& vision) {
    return moe::ClipConfig::from_json(
        R"({"model_type":"clip")" + root + R"(,"text_config":{)" + text + R"(},"vision_config":{)" + vision + "}}",
        "cfg.json");
  };
  // 100000 / 1 once overflowed int in num_positions() (and so named a wrong shape).
  expect_error([&] { config("", "", R"("image_size":100000,"patch_size":1)"); },
               {"cfg.json vision_config", "'image_size' is 100000", "1..4096"});
  expect_error([&] { config("", "", R"("patch_size":5000)"); }, {"vision_config", "'patch_size' is 5000", "1..4096"});
  expect_error([&] { config("", "", R"("num_channels":1000)"); }, {"vision_config", "'num_channels'", "1..64"});
  expect_error([&] { config("", R"("hidden_size":131072)", ""); },
               {"cfg.json text_config", "'hidden_size' is 131072", "1..65536"});
  expect_error([&] { config("", "", R"("intermediate_size":4294967296)"); }, {"'intermediate_size' is 4294967296"});
  expect_error([&] { config("", R"("num_hidden_layers":100000)", ""); }, {"'num_hidden_layers'", "1..1024"});
  expect_error([&] { config("", R"("vocab_size":16777216)", ""); }, {"'vocab_size'", "1..1048576"});
  expect_error([&] { config("", R"("max_position_embeddings":1000000)", ""); },
               {"'max_position_embeddings'", "1..65536"});
  expect_error([&] { config(R"(,"projection_dim":0)", "", ""); }, {"cfg.json", "'projection_dim' is 0"});
  expect_error([&] { config("", R"("eos_token_id":4294967296)", ""); }, {"'eos_token_id' is 4294967296", "int range"});
  // The largest image is accepted, its position table counted in 64 bits.
  const moe::ClipConfig big = config("", "", R"("image_size":4096,"patch_size":1)");
  EXPECT_EQ(big.vision.num_positions(), 4096 * 4096 + 1);
  moe::ClipVisionConfig in_code;  // not bounded by the reader
  in_code.image_size = 100000;
  in_code.patch_size = 1;
  EXPECT_EQ(in_code.num_positions(), int64_t{10'000'000'001});
}

// End to end from strings and raw RGB, with CLIP's real vocabulary (clip_tiny_bpe, fp16 weights).
namespace {

const ClipModel& tiny_bpe() {
  static ClipModel m = ClipModel::load(fixture_path("clip_tiny_bpe"));
  return m;
}

std::vector<std::string> fixture_texts(const moe::SafetensorsFile& io) {
  JsonParser* parser = json_parser_new();
  const std::string& texts = io.metadata().at("texts");
  EXPECT_TRUE(json_parser_load_from_data(parser, texts.data(), static_cast<gssize>(texts.size()), nullptr));
  JsonArray* arr = json_node_get_array(json_parser_get_root(parser));
  std::vector<std::string> out;
  for (guint i = 0; i < json_array_get_length(arr); ++i) out.emplace_back(json_array_get_string_element(arr, i));
  g_object_unref(parser);
  return out;
}

}  // namespace

TEST(ClipEndToEnd, TextStringsMatchTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  const auto texts = fixture_texts(io);
  ASSERT_EQ(texts.size(), 8u);
  const auto ids = real_ids(io, "text.");
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(tiny_bpe().tokenizer().encode(texts[i]), ids[i]) << texts[i];
  auto r = tiny_bpe().encode_texts(texts);
  EXPECT_LT(max_rel_error(r.embeds, io.get("text.text_embeds")), kTol);
}

TEST(ClipEndToEnd, RawImagesMatchTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  std::vector<moe::ImageView> views;
  std::vector<Tensor> keep;
  for (const char* n : {"vision.rgb0", "vision.rgb1"}) {
    keep.push_back(io.get(n));
    const Tensor& t = keep.back();
    views.push_back(
        {t.data<uint8_t>(), static_cast<int>(t.dim(1)), static_cast<int>(t.dim(0)), static_cast<size_t>(t.dim(1) * 3)});
  }
  auto r = tiny_bpe().encode_images(views);
  EXPECT_LT(max_rel_error(r.embeds, io.get("vision.image_embeds")), kTol);
  // The same through the pixel path, fed the processor's own output.
  auto p = tiny_bpe().encode_pixels(io.get("vision.pixel_values"));
  EXPECT_LT(max_rel_error(p.embeds, io.get("vision.image_embeds")), kTol);
}

TEST(ClipEndToEnd, AdapterOnTextEmbeddingsMatchesTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  auto adapter = moe::MoeAdapter::load(fixture_path("adapter_tiny"));
  auto out = adapter.apply(tiny_bpe().encode_texts(fixture_texts(io)).embeds);
  EXPECT_LT(moe::test::max_abs_error(out.embeddings, io.get("adapter.output")), 1e-4);
  const Tensor ids = io.get("adapter.selected_experts");
  for (int64_t i = 0; i < ids.numel(); ++i) EXPECT_EQ(out.routing.expert_ids[i], ids.data<int32_t>()[i]);
}
