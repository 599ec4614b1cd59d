#include "moe/clip_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "cpu_ops.h"
#include "moe/error.h"

namespace moe {

namespace cpu = kernels::cpu;

namespace {

bool file_exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

struct EncoderLayer {
  Tensor ln1_w, ln1_b, ln2_w, ln2_b;
  Tensor qkv_w, qkv_b;  // q, k, v projections stacked: [3H, H], [3H]
  Tensor out_w, out_b;
  Tensor fc1_w, fc1_b, fc2_w, fc2_b;
};

// Pre-LN transformer encoder shared by both towers.
struct Encoder {
  ClipEncoderConfig cfg;
  std::vector<EncoderLayer> layers;

  void load(const Checkpoint& ckpt, const std::string& prefix, const ClipEncoderConfig& c) {
    cfg = c;
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = prefix + "encoder.layers." + std::to_string(l) + ".";
      EncoderLayer L;
      L.ln1_w = ckpt.get_f32(p + "layer_norm1.weight", {H});
      L.ln1_b = ckpt.get_f32(p + "layer_norm1.bias", {H});
      L.ln2_w = ckpt.get_f32(p + "layer_norm2.weight", {H});
      L.ln2_b = ckpt.get_f32(p + "layer_norm2.bias", {H});
      L.qkv_w = Tensor::zeros(DType::F32, {3 * H, H});
      L.qkv_b = Tensor::zeros(DType::F32, {3 * H});
      const char* names[3] = {"q_proj", "k_proj", "v_proj"};
      for (int j = 0; j < 3; ++j) {
        Tensor w = ckpt.get_f32(p + "self_attn." + names[j] + ".weight", {H, H});
        Tensor b = ckpt.get_f32(p + "self_attn." + names[j] + ".bias", {H});
        std::memcpy(L.qkv_w.data<float>() + j * H * H, w.data<float>(), H * H * sizeof(float));
        std::memcpy(L.qkv_b.data<float>() + j * H, b.data<float>(), H * sizeof(float));
      }
      L.out_w = ckpt.get_f32(p + "self_attn.out_proj.weight", {H, H});
      L.out_b = ckpt.get_f32(p + "self_attn.out_proj.bias", {H});
      L.fc1_w = ckpt.get_f32(p + "mlp.fc1.weight", {I, H});
      L.fc1_b = ckpt.get_f32(p + "mlp.fc1.bias", {I});
      L.fc2_w = ckpt.get_f32(p + "mlp.fc2.weight", {H, I});
      L.fc2_b = ckpt.get_f32(p + "mlp.fc2.bias", {H});
      layers.push_back(std::move(L));
    }
  }

  // x: [T, H] rows of several sequences packed back to back; seq_lens sums to T.
  void forward(float* x, const std::vector<int64_t>& seq_lens, bool causal) const {
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
    int64_t T = 0, max_len = 0;
    for (int64_t n : seq_lens) {
      T += n;
      max_len = std::max(max_len, n);
    }
    Tensor h = Tensor::zeros(DType::F32, {T, H});
    Tensor qkv = Tensor::zeros(DType::F32, {T, 3 * H});
    Tensor attn = Tensor::zeros(DType::F32, {T, H});
    Tensor ff = Tensor::zeros(DType::F32, {T, I});
    Tensor scores = Tensor::zeros(DType::F32, {max_len, max_len});
    float* hp = h.data<float>();
    float* qp = qkv.data<float>();
    float* ap = attn.data<float>();
    float* fp = ff.data<float>();
    for (const EncoderLayer& L : layers) {
      cpu::layer_norm(x, L.ln1_w.data<float>(), L.ln1_b.data<float>(), hp, T, H, cfg.layer_norm_eps);
      cpu::linear(hp, L.qkv_w.data<float>(), L.qkv_b.data<float>(), qp, T, 3 * H, H);
      int64_t row = 0;
      for (int64_t n : seq_lens) {
        const float* base = qp + row * 3 * H;
        cpu::attention(base, base + H, base + 2 * H, 3 * H, ap + row * H, n,
                       cfg.num_attention_heads, cfg.head_dim(), causal, scores.data<float>());
        row += n;
      }
      cpu::linear(ap, L.out_w.data<float>(), L.out_b.data<float>(), hp, T, H, H);
      cpu::add_inplace(x, hp, T * H);
      cpu::layer_norm(x, L.ln2_w.data<float>(), L.ln2_b.data<float>(), hp, T, H, cfg.layer_norm_eps);
      cpu::linear(hp, L.fc1_w.data<float>(), L.fc1_b.data<float>(), fp, T, I, H);
      if (cfg.hidden_act == Activation::QuickGelu) cpu::quick_gelu(fp, T * I);
      else cpu::gelu(fp, T * I);
      cpu::linear(fp, L.fc2_w.data<float>(), L.fc2_b.data<float>(), hp, T, H, I);
      cpu::add_inplace(x, hp, T * H);
    }
  }
};

}  // namespace

struct ClipModel::Impl {
  ClipConfig cfg;
  std::string dir;
  std::optional<ClipTokenizer> tokenizer;
  ImagePreprocessConfig preprocess;

  // Text tower
  Tensor token_embedding, text_position_embedding, final_ln_w, final_ln_b, text_projection;
  Encoder text_encoder;
  // Vision tower
  Tensor class_embedding, patch_weight /* [H, C*p*p] */, vision_position_embedding;
  Tensor pre_ln_w, pre_ln_b, post_ln_w, post_ln_b, visual_projection;
  Encoder vision_encoder;

  void load_weights(const Checkpoint& ck) {
    const ClipTextConfig& t = cfg.text;
    const ClipVisionConfig& v = cfg.vision;
    const int64_t P = cfg.projection_dim;
    token_embedding = ck.get_f32("text_model.embeddings.token_embedding.weight", {t.vocab_size, t.hidden_size});
    text_position_embedding = ck.get_f32("text_model.embeddings.position_embedding.weight",
                                         {t.max_position_embeddings, t.hidden_size});
    text_encoder.load(ck, "text_model.", t);
    final_ln_w = ck.get_f32("text_model.final_layer_norm.weight", {t.hidden_size});
    final_ln_b = ck.get_f32("text_model.final_layer_norm.bias", {t.hidden_size});
    text_projection = ck.get_f32("text_projection.weight", {P, t.hidden_size});

    const int64_t pp = static_cast<int64_t>(v.num_channels) * v.patch_size * v.patch_size;
    class_embedding = ck.get_f32("vision_model.embeddings.class_embedding", {v.hidden_size});
    patch_weight = ck.get_f32("vision_model.embeddings.patch_embedding.weight",
                              {v.hidden_size, v.num_channels, v.patch_size, v.patch_size})
                       .reshape({v.hidden_size, pp});
    vision_position_embedding = ck.get_f32("vision_model.embeddings.position_embedding.weight",
                                           {v.num_positions(), v.hidden_size});
    pre_ln_w = ck.get_f32("vision_model.pre_layrnorm.weight", {v.hidden_size});
    pre_ln_b = ck.get_f32("vision_model.pre_layrnorm.bias", {v.hidden_size});
    vision_encoder.load(ck, "vision_model.", v);
    post_ln_w = ck.get_f32("vision_model.post_layernorm.weight", {v.hidden_size});
    post_ln_b = ck.get_f32("vision_model.post_layernorm.bias", {v.hidden_size});
    visual_projection = ck.get_f32("visual_projection.weight", {P, v.hidden_size});
  }

  // Index of the pooled (end) token, as transformers' CLIPTextTransformer picks it.
  int64_t pool_position(const std::vector<int32_t>& ids) const {
    if (cfg.text.eos_token_id == 2)  // legacy configs: the end token has the largest id
      return std::max_element(ids.begin(), ids.end()) - ids.begin();
    auto it = std::find(ids.begin(), ids.end(), cfg.text.eos_token_id);
    return it == ids.end() ? 0 : it - ids.begin();
  }
};

ClipModel::ClipModel() : impl_(std::make_unique<Impl>()) {}
ClipModel::ClipModel(ClipModel&&) noexcept = default;
ClipModel& ClipModel::operator=(ClipModel&&) noexcept = default;
ClipModel::~ClipModel() = default;

ClipModel ClipModel::load(const ClipConfig& config, const Checkpoint& weights) {
  ClipModel m;
  m.impl_->cfg = config;
  m.impl_->load_weights(weights);
  return m;
}

ClipModel ClipModel::load(const std::string& model_dir) {
  const std::string cfg_path = model_dir + "/config.json";
  if (!file_exists(cfg_path)) throw Error(model_dir + ": not a CLIP model directory (no config.json)");
  ClipModel m = load(ClipConfig::from_file(cfg_path), Checkpoint::open(model_dir));
  m.impl_->dir = model_dir;
  if (file_exists(model_dir + "/vocab.json") || file_exists(model_dir + "/merges.txt"))
    m.impl_->tokenizer.emplace(ClipTokenizer::from_directory(model_dir));
  m.impl_->preprocess = ImagePreprocessConfig::from_directory(model_dir);
  return m;
}

const ClipConfig& ClipModel::config() const { return impl_->cfg; }
const std::string& ClipModel::model_dir() const { return impl_->dir; }
bool ClipModel::has_tokenizer() const { return impl_->tokenizer.has_value(); }
const ClipTokenizer& ClipModel::tokenizer() const {
  if (!impl_->tokenizer)
    throw Error((impl_->dir.empty() ? std::string("CLIP model") : impl_->dir) +
                ": no tokenizer (vocab.json and merges.txt are missing)");
  return *impl_->tokenizer;
}
const ImagePreprocessConfig& ClipModel::image_preprocess() const { return impl_->preprocess; }

ClipEncodeResult ClipModel::encode_token_ids(const std::vector<std::vector<int32_t>>& ids) const {
  const Impl& m = *impl_;
  const ClipTextConfig& t = m.cfg.text;
  const int64_t H = t.hidden_size;
  const int64_t B = static_cast<int64_t>(ids.size());
  std::vector<int64_t> lens(ids.size());
  int64_t T = 0;
  for (size_t b = 0; b < ids.size(); ++b) {
    if (ids[b].empty()) throw Error("text input " + std::to_string(b) + ": no tokens");
    if (static_cast<int64_t>(ids[b].size()) > t.max_position_embeddings)
      throw Error("text input " + std::to_string(b) + ": " + std::to_string(ids[b].size()) +
                  " tokens exceed the model's " + std::to_string(t.max_position_embeddings) + " positions");
    for (int32_t id : ids[b])
      if (id < 0 || id >= t.vocab_size)
        throw Error("text input " + std::to_string(b) + ": token id " + std::to_string(id) +
                    " outside the vocabulary [0, " + std::to_string(t.vocab_size) + ")");
    lens[b] = m.pool_position(ids[b]) + 1;
    T += lens[b];
  }
  Tensor x = Tensor::zeros(DType::F32, {T, H});
  float* xp = x.data<float>();
  const float* tok = m.token_embedding.data<float>();
  const float* pos = m.text_position_embedding.data<float>();
  int64_t row = 0;
  for (size_t b = 0; b < ids.size(); ++b) {
    for (int64_t i = 0; i < lens[b]; ++i, ++row) {
      float* dst = xp + row * H;
      const float* e = tok + static_cast<int64_t>(ids[b][i]) * H;
      const float* p = pos + i * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = e[c] + p[c];
    }
  }
  m.text_encoder.forward(xp, lens, /*causal=*/true);

  ClipEncodeResult r;
  r.pooled = Tensor::zeros(DType::F32, {B, H});
  row = 0;
  for (int64_t b = 0; b < B; ++b) {
    row += lens[b];
    cpu::layer_norm(xp + (row - 1) * H, m.final_ln_w.data<float>(), m.final_ln_b.data<float>(),
                    r.pooled.data<float>() + b * H, 1, H, t.layer_norm_eps);
  }
  r.embeds = Tensor::zeros(DType::F32, {B, m.cfg.projection_dim});
  cpu::linear(r.pooled.data<float>(), m.text_projection.data<float>(), nullptr, r.embeds.data<float>(),
              B, m.cfg.projection_dim, H);
  return r;
}

ClipEncodeResult ClipModel::encode_texts(const std::vector<std::string>& texts) const {
  const ClipTokenizer& tok = tokenizer();
  std::vector<std::vector<int32_t>> ids;
  ids.reserve(texts.size());
  for (const std::string& s : texts)
    ids.push_back(tok.encode(s, static_cast<size_t>(impl_->cfg.text.max_position_embeddings)));
  return encode_token_ids(ids);
}

ClipEncodeResult ClipModel::encode_pixels(const Tensor& pixel_values) const {
  const Impl& m = *impl_;
  const ClipVisionConfig& v = m.cfg.vision;
  const Shape want_tail = {v.num_channels, v.image_size, v.image_size};
  if (pixel_values.rank() != 4 || Shape(pixel_values.shape().begin() + 1, pixel_values.shape().end()) != want_tail)
    throw Error("pixel_values: shape " + shape_to_string(pixel_values.shape()) + ", expected [B," +
                std::to_string(v.num_channels) + "," + std::to_string(v.image_size) + "," +
                std::to_string(v.image_size) + "]");
  const Tensor px = pixel_values.to_f32();
  const int64_t B = px.dim(0), H = v.hidden_size, C = v.num_channels, S = v.image_size,
                p = v.patch_size, g = v.grid(), np = g * g, seq = np + 1, pp = C * p * p;

  // im2col: one row of (channel, ky, kx) per patch, so the convolution is a single GEMM.
  Tensor patches = Tensor::zeros(DType::F32, {B * np, pp});
  const float* src = px.data<float>();
  float* pd = patches.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t gy = 0; gy < g; ++gy)
      for (int64_t gx = 0; gx < g; ++gx) {
        float* dst = pd + ((b * g + gy) * g + gx) * pp;
        for (int64_t c = 0; c < C; ++c)
          for (int64_t ky = 0; ky < p; ++ky) {
            const float* line = src + ((b * C + c) * S + gy * p + ky) * S + gx * p;
            std::memcpy(dst + (c * p + ky) * p, line, p * sizeof(float));
          }
      }
  Tensor patch_emb = Tensor::zeros(DType::F32, {B * np, H});
  cpu::linear(pd, m.patch_weight.data<float>(), nullptr, patch_emb.data<float>(), B * np, H, pp);

  Tensor x = Tensor::zeros(DType::F32, {B * seq, H});
  float* xp = x.data<float>();
  const float* pos = m.vision_position_embedding.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    float* base = xp + b * seq * H;
    for (int64_t c = 0; c < H; ++c) base[c] = m.class_embedding.data<float>()[c] + pos[c];
    for (int64_t i = 0; i < np; ++i) {
      const float* e = patch_emb.data<float>() + (b * np + i) * H;
      float* dst = base + (i + 1) * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = e[c] + pos[(i + 1) * H + c];
    }
  }
  cpu::layer_norm(xp, m.pre_ln_w.data<float>(), m.pre_ln_b.data<float>(), xp, B * seq, H, v.layer_norm_eps);
  m.vision_encoder.forward(xp, std::vector<int64_t>(static_cast<size_t>(B), seq), /*causal=*/false);

  ClipEncodeResult r;
  r.pooled = Tensor::zeros(DType::F32, {B, H});
  for (int64_t b = 0; b < B; ++b)
    cpu::layer_norm(xp + b * seq * H, m.post_ln_w.data<float>(), m.post_ln_b.data<float>(),
                    r.pooled.data<float>() + b * H, 1, H, v.layer_norm_eps);
  r.embeds = Tensor::zeros(DType::F32, {B, m.cfg.projection_dim});
  cpu::linear(r.pooled.data<float>(), m.visual_projection.data<float>(), nullptr, r.embeds.data<float>(),
              B, m.cfg.projection_dim, H);
  return r;
}

ClipEncodeResult ClipModel::encode_images(const std::vector<ImageView>& images) const {
  const ClipVisionConfig& v = impl_->cfg.vision;
  const int64_t per = static_cast<int64_t>(v.num_channels) * v.image_size * v.image_size;
  if (v.num_channels != 3)
    throw Error("encode_images: the model expects " + std::to_string(v.num_channels) + " channels, images are RGB");
  Tensor px = Tensor::zeros(DType::F32, {static_cast<int64_t>(images.size()), v.num_channels, v.image_size, v.image_size});
  const ImagePreprocessConfig& pre = impl_->preprocess;
  for (size_t i = 0; i < images.size(); ++i) {
    const auto [w, h] = preprocess_output_size(pre, images[i].width, images[i].height);
    if (w != v.image_size || h != v.image_size)
      throw Error("image " + std::to_string(i) + ": preprocessing (" + impl_->dir +
                  "/preprocessor_config.json) gives " + std::to_string(w) + "x" + std::to_string(h) +
                  " pixels but the model's image_size is " + std::to_string(v.image_size));
    preprocess_clip_image(images[i], pre, px.data<float>() + static_cast<int64_t>(i) * per);
  }
  return encode_pixels(px);
}

}  // namespace moe
