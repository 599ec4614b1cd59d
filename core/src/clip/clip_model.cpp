#include "moe/clip_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "runtime/compute_util.h"
#include "moe/error.h"

namespace moe {

using detail::Call;
using detail::f32_ptr;
using detail::ModelBackend;
using detail::weight_ref;

namespace {

bool file_exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// A Linear weight from the checkpoint as stored when that is the model's precision (a bf16
// checkpoint loaded in bf16 stays a view of the mmap-ed file, never widened and rounded back),
// else as f32; the shape is checked either way.
Tensor linear_source(const Checkpoint& ckpt, const std::string& name, const Shape& shape, const ModelBackend& be) {
  const Tensor t = ckpt.get(name);
  if (t.dtype() == detail::dtype_of(be.precision) && t.shape() == shape) return t;
  return ckpt.get_f32(name, shape);
}

// One encoder layer's parameters in backend memory: Linear weights in the model's precision,
// norms and biases in f32.
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

  void load(const Checkpoint& ckpt, const std::string& prefix, const ClipEncoderConfig& c, const ModelBackend& be) {
    cfg = c;
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = prefix + "encoder.layers." + std::to_string(l) + ".";
      EncoderLayer L;
      L.ln1_w = be.f32(ckpt.get_f32(p + "layer_norm1.weight", {H}));
      L.ln1_b = be.f32(ckpt.get_f32(p + "layer_norm1.bias", {H}));
      L.ln2_w = be.f32(ckpt.get_f32(p + "layer_norm2.weight", {H}));
      L.ln2_b = be.f32(ckpt.get_f32(p + "layer_norm2.bias", {H}));
      const char* names[3] = {"q_proj", "k_proj", "v_proj"};
      Tensor w[3];
      for (int j = 0; j < 3; ++j) w[j] = linear_source(ckpt, p + "self_attn." + names[j] + ".weight", {H, H}, be);
      // Stacked in the checkpoint's type when all three are in the model's precision.
      const DType stacked = w[0].dtype() == w[1].dtype() && w[1].dtype() == w[2].dtype() ? w[0].dtype() : DType::F32;
      Tensor qkv_w = Tensor::zeros(stacked, {3 * H, H});
      Tensor qkv_b = Tensor::zeros(DType::F32, {3 * H});
      for (int j = 0; j < 3; ++j) {
        const Tensor part = stacked == w[j].dtype() ? w[j] : w[j].to_f32();
        std::memcpy(static_cast<char*>(qkv_w.raw_data()) + j * part.nbytes(), part.raw_data(), part.nbytes());
        Tensor b = ckpt.get_f32(p + "self_attn." + names[j] + ".bias", {H});
        std::memcpy(qkv_b.data<float>() + j * H, b.data<float>(), H * sizeof(float));
      }
      L.qkv_w = be.linear_weight(qkv_w);
      L.qkv_b = be.f32(qkv_b);
      L.out_w = be.linear_weight(linear_source(ckpt, p + "self_attn.out_proj.weight", {H, H}, be));
      L.out_b = be.f32(ckpt.get_f32(p + "self_attn.out_proj.bias", {H}));
      L.fc1_w = be.linear_weight(linear_source(ckpt, p + "mlp.fc1.weight", {I, H}, be));
      L.fc1_b = be.f32(ckpt.get_f32(p + "mlp.fc1.bias", {I}));
      L.fc2_w = be.linear_weight(linear_source(ckpt, p + "mlp.fc2.weight", {H, I}, be));
      L.fc2_b = be.f32(ckpt.get_f32(p + "mlp.fc2.bias", {H}));
      layers.push_back(std::move(L));
    }
  }

  size_t weight_bytes() const {
    size_t bytes = 0;
    for (const EncoderLayer& L : layers)
      for (const Tensor* t : {&L.ln1_w, &L.ln1_b, &L.ln2_w, &L.ln2_b, &L.qkv_w, &L.qkv_b, &L.out_w, &L.out_b, &L.fc1_w,
                              &L.fc1_b, &L.fc2_w, &L.fc2_b})
        bytes += t->nbytes();
    return bytes;
  }

  // x: [T, H] rows of several sequences packed back to back in backend memory; seq_lens sums to T.
  void forward(Call& call, float* x, const std::vector<int64_t>& seq_lens, bool causal) const {
    kernels::Backend& b = call.backend();
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
    int64_t T = 0;
    for (int64_t n : seq_lens) T += n;
    float* h = call.ws().f32(T * H);
    float* qkv = call.ws().f32(T * 3 * H);
    float* attn = call.ws().f32(T * H);
    float* ff = call.ws().f32(T * I);
    const float eps = cfg.layer_norm_eps;
    for (const EncoderLayer& L : layers) {
      b.layer_norm(x, f32_ptr(L.ln1_w), f32_ptr(L.ln1_b), h, T, H, eps);
      b.linear(h, weight_ref(L.qkv_w), f32_ptr(L.qkv_b), qkv, T, 3 * H, H);
      b.attention(qkv, attn, seq_lens, cfg.num_attention_heads, cfg.head_dim(), causal);
      b.linear(attn, weight_ref(L.out_w), f32_ptr(L.out_b), h, T, H, H);
      b.add(x, h, T * H);
      b.layer_norm(x, f32_ptr(L.ln2_w), f32_ptr(L.ln2_b), h, T, H, eps);
      b.linear(h, weight_ref(L.fc1_w), f32_ptr(L.fc1_b), ff, T, I, H);
      if (cfg.hidden_act == Activation::QuickGelu)
        b.quick_gelu(ff, T * I);
      else
        b.gelu(ff, T * I);
      b.linear(ff, weight_ref(L.fc2_w), f32_ptr(L.fc2_b), h, T, H, I);
      b.add(x, h, T * H);
    }
  }
};

}  // namespace

struct ClipModel::Impl {
  ClipConfig cfg;
  std::string dir;
  std::string fingerprint;
  std::optional<ClipTokenizer> tokenizer;
  ImagePreprocessConfig preprocess;
  ModelBackend be;
  mutable std::unique_ptr<detail::Workspace> workspace;  // non-host backends: under be.mutex

  // Text tower. The embeddings are gathered on the host (host f32), everything else is in
  // backend memory.
  Tensor token_embedding, text_position_embedding;
  Tensor final_ln_w, final_ln_b, text_projection;
  Encoder text_encoder;
  // Vision tower
  Tensor patch_weight /* [H, C*p*p] */, vision_embedding /* [seq, H]: positions, class token in row 0 */;
  Tensor pre_ln_w, pre_ln_b, post_ln_w, post_ln_b, visual_projection;
  Encoder vision_encoder;
  size_t weight_bytes = 0;  // of the tensors above in backend memory (all but the text tower's embeddings)

  void load_weights(const Checkpoint& ck) {
    const ClipTextConfig& t = cfg.text;
    const ClipVisionConfig& v = cfg.vision;
    const int64_t P = cfg.projection_dim;
    token_embedding = ck.get_f32("text_model.embeddings.token_embedding.weight", {t.vocab_size, t.hidden_size});
    text_position_embedding =
        ck.get_f32("text_model.embeddings.position_embedding.weight", {t.max_position_embeddings, t.hidden_size});
    text_encoder.load(ck, "text_model.", t, be);
    final_ln_w = be.f32(ck.get_f32("text_model.final_layer_norm.weight", {t.hidden_size}));
    final_ln_b = be.f32(ck.get_f32("text_model.final_layer_norm.bias", {t.hidden_size}));
    text_projection = be.linear_weight(linear_source(ck, "text_projection.weight", {P, t.hidden_size}, be));

    const int64_t H = v.hidden_size, pp = static_cast<int64_t>(v.num_channels) * v.patch_size * v.patch_size;
    const Tensor class_embedding = ck.get_f32("vision_model.embeddings.class_embedding", {H});
    patch_weight = be.linear_weight(linear_source(ck, "vision_model.embeddings.patch_embedding.weight",
                                                  {H, v.num_channels, v.patch_size, v.patch_size}, be)
                                        .reshape({H, pp}));
    const Tensor pos = ck.get_f32("vision_model.embeddings.position_embedding.weight", {v.num_positions(), H});
    // What every image's rows start from: the position embeddings, plus the class embedding on
    // the class token's row (the patch embeddings are added per image).
    Tensor start = pos.clone();
    for (int64_t c = 0; c < H; ++c) start.data<float>()[c] = class_embedding.data<float>()[c] + pos.data<float>()[c];
    vision_embedding = be.f32(start);
    pre_ln_w = be.f32(ck.get_f32("vision_model.pre_layrnorm.weight", {H}));
    pre_ln_b = be.f32(ck.get_f32("vision_model.pre_layrnorm.bias", {H}));
    vision_encoder.load(ck, "vision_model.", v, be);
    post_ln_w = be.f32(ck.get_f32("vision_model.post_layernorm.weight", {H}));
    post_ln_b = be.f32(ck.get_f32("vision_model.post_layernorm.bias", {H}));
    visual_projection = be.linear_weight(linear_source(ck, "visual_projection.weight", {P, H}, be));

    weight_bytes = text_encoder.weight_bytes() + vision_encoder.weight_bytes();
    for (const Tensor* t : {&final_ln_w, &final_ln_b, &text_projection, &patch_weight, &vision_embedding, &pre_ln_w,
                            &pre_ln_b, &post_ln_w, &post_ln_b, &visual_projection})
      weight_bytes += t->nbytes();
  }

  // Index of the pooled (end) token, as transformers' CLIPTextTransformer picks it.
  int64_t pool_position(const std::vector<int32_t>& ids) const {
    if (cfg.text.eos_token_id == 2)  // legacy configs: the end token has the largest id
      return std::max_element(ids.begin(), ids.end()) - ids.begin();
    auto it = std::find(ids.begin(), ids.end(), cfg.text.eos_token_id);
    return it == ids.end() ? 0 : it - ids.begin();
  }

  // Final layer norm over the given rows of x (backend memory) and the projection; both back
  // on the host.
  ClipEncodeResult pool_and_project(Call& call, const float* x, const std::vector<int64_t>& rows, int64_t H,
                                    const Tensor& ln_w, const Tensor& ln_b, float eps, const Tensor& proj) const {
    kernels::Backend& b = call.backend();
    const int64_t B = static_cast<int64_t>(rows.size()), P = cfg.projection_dim;
    float* pooled = call.ws().f32(B * H);
    for (int64_t i = 0; i < B; ++i)
      b.copy_on_device(pooled + i * H, x + rows[static_cast<size_t>(i)] * H, static_cast<size_t>(H) * sizeof(float));
    b.layer_norm(pooled, f32_ptr(ln_w), f32_ptr(ln_b), pooled, B, H, eps);
    float* embeds = call.ws().f32(B * P);
    b.linear(pooled, weight_ref(proj), nullptr, embeds, B, P, H);
    ClipEncodeResult r;
    r.pooled = call.to_host(pooled, {B, H});
    r.embeds = call.to_host(embeds, {B, P});
    return r;
  }
};

ClipModel::ClipModel() : impl_(std::make_unique<Impl>()) {}
ClipModel::ClipModel(ClipModel&&) noexcept = default;
ClipModel& ClipModel::operator=(ClipModel&&) noexcept = default;
ClipModel::~ClipModel() = default;

ClipModel ClipModel::load(const ClipConfig& config, const Checkpoint& weights, const ComputeOptions& options) {
  ClipModel m;
  m.impl_->cfg = config;
  m.impl_->be = ModelBackend::open(options);
  m.impl_->load_weights(weights);
  m.impl_->fingerprint = weights.fingerprint();
  return m;
}

ClipModel ClipModel::load(const std::string& model_dir, const ComputeOptions& options) {
  const std::string cfg_path = model_dir + "/config.json";
  if (!file_exists(cfg_path)) throw Error(model_dir + ": not a CLIP model directory (no config.json)");
  ClipModel m = load(ClipConfig::from_file(cfg_path), Checkpoint::open(model_dir), options);
  m.impl_->dir = model_dir;
  if (file_exists(model_dir + "/vocab.json") || file_exists(model_dir + "/merges.txt"))
    m.impl_->tokenizer.emplace(ClipTokenizer::from_directory(model_dir));
  m.impl_->preprocess = ImagePreprocessConfig::from_directory(model_dir);
  return m;
}

const ClipConfig& ClipModel::config() const { return impl_->cfg; }
const std::string& ClipModel::model_dir() const { return impl_->dir; }
const std::string& ClipModel::fingerprint() const { return impl_->fingerprint; }
bool ClipModel::has_tokenizer() const { return impl_->tokenizer.has_value(); }
const ClipTokenizer& ClipModel::tokenizer() const {
  if (!impl_->tokenizer)
    throw Error((impl_->dir.empty() ? std::string("CLIP model") : impl_->dir) +
                ": no tokenizer (vocab.json and merges.txt are missing)");
  return *impl_->tokenizer;
}
const ImagePreprocessConfig& ClipModel::image_preprocess() const { return impl_->preprocess; }
std::string ClipModel::device() const { return impl_->be.backend->name(); }
kernels::WeightType ClipModel::precision() const { return impl_->be.precision; }
size_t ClipModel::weight_bytes() const { return impl_->weight_bytes; }
kernels::MemoryInfo ClipModel::memory_info() const { return impl_->be.backend->memory_info(); }

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
  if (B == 0) return {Tensor::zeros(DType::F32, {0, H}), Tensor::zeros(DType::F32, {0, m.cfg.projection_dim})};

  // Token + position embeddings, gathered on the host (before taking the backend: declared
  // before `call`, the buffer outlives the call's queued copies).
  std::vector<float> gathered(static_cast<size_t>(T * H));
  float* staged = gathered.data();
  const float* tok = m.token_embedding.data<float>();
  const float* pos = m.text_position_embedding.data<float>();
  int64_t row = 0;
  std::vector<int64_t> pooled_rows(ids.size());
  for (size_t b = 0; b < ids.size(); ++b) {
    for (int64_t i = 0; i < lens[b]; ++i, ++row) {
      float* dst = staged + row * H;
      const float* e = tok + static_cast<int64_t>(ids[b][i]) * H;
      const float* p = pos + i * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = e[c] + p[c];
    }
    pooled_rows[b] = row - 1;  // the end token: the sequence's last row
  }
  Call call(m.be, m.workspace);
  float* x = call.device(staged, T * H);
  m.text_encoder.forward(call, x, lens, /*causal=*/true);
  return m.pool_and_project(call, x, pooled_rows, H, m.final_ln_w, m.final_ln_b, t.layer_norm_eps, m.text_projection);
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
  const int64_t B = px.dim(0), H = v.hidden_size, C = v.num_channels, S = v.image_size, p = v.patch_size, g = v.grid(),
                np = g * g, seq = np + 1, pp = C * p * p;

  if (B == 0) return {Tensor::zeros(DType::F32, {0, H}), Tensor::zeros(DType::F32, {0, m.cfg.projection_dim})};

  // im2col on the host, before taking the backend: one row of (channel, ky, kx) per patch, so the
  // convolution is a single GEMM.
  std::vector<float> im2col(static_cast<size_t>(B * np * pp));
  float* pd = im2col.data();
  const float* src = px.data<float>();
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
  Call call(m.be, m.workspace);
  kernels::Backend& be = call.backend();
  const float* patches = call.device(pd, B * np * pp);
  float* patch_emb = call.ws().f32(B * np * H);
  be.linear(patches, weight_ref(m.patch_weight), nullptr, patch_emb, B * np, H, pp);

  // Each image: position embeddings (class embedding included in row 0) + its patch embeddings.
  float* x = call.ws().f32(B * seq * H);
  for (int64_t b = 0; b < B; ++b) {
    be.copy_on_device(x + b * seq * H, f32_ptr(m.vision_embedding), static_cast<size_t>(seq * H) * sizeof(float));
    be.add(x + (b * seq + 1) * H, patch_emb + b * np * H, np * H);
  }
  be.layer_norm(x, f32_ptr(m.pre_ln_w), f32_ptr(m.pre_ln_b), x, B * seq, H, v.layer_norm_eps);
  m.vision_encoder.forward(call, x, std::vector<int64_t>(static_cast<size_t>(B), seq), /*causal=*/false);

  std::vector<int64_t> class_rows(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) class_rows[static_cast<size_t>(b)] = b * seq;
  return m.pool_and_project(call, x, class_rows, H, m.post_ln_w, m.post_ln_b, v.layer_norm_eps, m.visual_projection);
}

ClipEncodeResult ClipModel::encode_images(const std::vector<ImageView>& images) const {
  const ClipVisionConfig& v = impl_->cfg.vision;
  const int64_t per = static_cast<int64_t>(v.num_channels) * v.image_size * v.image_size;
  if (v.num_channels != 3)
    throw Error("encode_images: the model expects " + std::to_string(v.num_channels) + " channels, images are RGB");
  Tensor px =
      Tensor::zeros(DType::F32, {static_cast<int64_t>(images.size()), v.num_channels, v.image_size, v.image_size});
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
