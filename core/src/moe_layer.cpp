#include "moe/moe_layer.h"

#include <sys/stat.h>

#include <cmath>
#include <cstring>

#include "cpu_ops.h"
#include "json_util.h"
#include "moe/error.h"

namespace moe {

namespace cpu = kernels::cpu;

namespace {

int positive(JsonObject* obj, const char* key, const std::string& what) {
  const int64_t v = json::get_int(obj, key, what);
  if (v <= 0 || v > (1 << 24)) throw Error(what + ": '" + key + "' must be a positive integer");
  return static_cast<int>(v);
}

struct Expert {
  Tensor w1, w3, w2;  // gate [I,D], up [I,D], down [D,I]
};

// SwiGLU FFN over `rows` contiguous rows: out = w2(silu(w1 x) * w3 x). Scratch is [rows, I] x2.
void swiglu(const Expert& e, const float* x, int64_t rows, int64_t D, int64_t I, float* gate,
            float* up, float* out) {
  cpu::linear(x, e.w1.data<float>(), nullptr, gate, rows, I, D);
  cpu::linear(x, e.w3.data<float>(), nullptr, up, rows, I, D);
  cpu::silu_mul(gate, up, gate, rows * I);
  cpu::linear(gate, e.w2.data<float>(), nullptr, out, rows, D, I);
}

}  // namespace

MoeConfig MoeConfig::from_adapter_config(const std::string& path) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* o = doc.root_object();
  const std::string fmt = json::get_string_or(o, "format", "", path);
  if (fmt != "gst-moe-adapter")
    throw Error(path + ": 'format' is '" + fmt + "', expected 'gst-moe-adapter'");
  const int64_t version = json::get_int(o, "version", path);
  if (version != 1) throw Error(path + ": unsupported adapter version " + std::to_string(version));
  MoeConfig c;
  c.source = path;
  c.hidden_size = positive(o, "hidden_size", path);
  c.num_experts = positive(o, "num_experts", path);
  c.top_k = positive(o, "top_k", path);
  c.intermediate_size = positive(o, "intermediate_size", path);
  const std::string routing = json::get_string_or(o, "routing", "mixtral", path);
  if (routing == "mixtral") c.routing = RoutingKind::Mixtral;
  else if (routing == "qwen2_moe") c.routing = RoutingKind::Qwen2Moe;
  else throw Error(path + ": unknown routing '" + routing + "' (expected mixtral or qwen2_moe)");
  c.norm_topk_prob = json::get_bool_or(o, "norm_topk_prob", c.routing == RoutingKind::Mixtral, path);
  c.shared_expert_intermediate_size =
      static_cast<int>(json::get_int_or(o, "shared_expert_intermediate_size", 0, path));
  c.validate();
  return c;
}

MoeConfig MoeConfig::from_hf_config(const std::string& path) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* o = doc.root_object();
  const std::string mt = json::get_string_or(o, "model_type", "", path);
  if (mt != "mixtral" && mt != "qwen2_moe")
    throw Error(path + ": model_type '" + mt + "' is not a supported MoE (mixtral, qwen2_moe)");
  MoeConfig c;
  c.source = path;
  c.hidden_size = positive(o, "hidden_size", path);
  c.top_k = positive(o, "num_experts_per_tok", path);
  if (mt == "mixtral") {
    c.routing = RoutingKind::Mixtral;
    c.num_experts = positive(o, "num_local_experts", path);
    c.intermediate_size = positive(o, "intermediate_size", path);
    c.norm_topk_prob = true;
  } else {
    c.routing = RoutingKind::Qwen2Moe;
    c.num_experts = positive(o, "num_experts", path);
    c.intermediate_size = positive(o, "moe_intermediate_size", path);
    c.norm_topk_prob = json::get_bool_or(o, "norm_topk_prob", false, path);
    c.shared_expert_intermediate_size =
        static_cast<int>(json::get_int_or(o, "shared_expert_intermediate_size", 0, path));
  }
  c.validate();
  return c;
}

void MoeConfig::validate() const {
  const std::string& w = source.empty() ? std::string("MoE config") : source;
  if (hidden_size <= 0 || num_experts <= 0 || intermediate_size <= 0)
    throw Error(w + ": hidden_size, num_experts and intermediate_size must be positive");
  if (top_k <= 0 || top_k > num_experts)
    throw Error(w + ": top_k " + std::to_string(top_k) + " must be in [1, num_experts=" +
                std::to_string(num_experts) + "]");
  if (shared_expert_intermediate_size < 0)
    throw Error(w + ": shared_expert_intermediate_size must not be negative");
  if (shared_expert_intermediate_size > 0 && routing != RoutingKind::Qwen2Moe)
    throw Error(w + ": a shared expert needs qwen2_moe routing");
}

struct MoeLayer::Impl {
  MoeConfig cfg;
  Tensor gate;  // [E, D]
  std::vector<Expert> experts;
  bool has_shared = false;
  Expert shared;
  Tensor shared_gate;  // [1, D]
};

MoeLayer::MoeLayer() : impl_(std::make_unique<Impl>()) {}
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;
MoeLayer::~MoeLayer() = default;

const MoeConfig& MoeLayer::config() const { return impl_->cfg; }

const Tensor& MoeLayer::expert_weight(int e, ExpertMatrix which) const {
  if (e < 0 || e >= impl_->cfg.num_experts)
    throw Error("expert_weight: expert " + std::to_string(e) + " outside [0, " +
                std::to_string(impl_->cfg.num_experts) + ")");
  const Expert& ex = impl_->experts[static_cast<size_t>(e)];
  switch (which) {
    case ExpertMatrix::W1: return ex.w1;
    case ExpertMatrix::W3: return ex.w3;
    case ExpertMatrix::W2: return ex.w2;
  }
  throw Error("expert_weight: unknown matrix " + std::to_string(static_cast<int>(which)));
}

MoeLayer MoeLayer::load(const MoeConfig& config, const Checkpoint& ck, const std::string& prefix) {
  config.validate();
  MoeLayer layer;
  Impl& m = *layer.impl_;
  m.cfg = config;
  const int64_t D = config.hidden_size, I = config.intermediate_size, E = config.num_experts;
  m.gate = ck.get_f32(prefix + "gate.weight", {E, D});
  const bool mixtral_names = ck.contains(prefix + "experts.0.w1.weight");
  const bool qwen_names = ck.contains(prefix + "experts.0.gate_proj.weight");
  if (!mixtral_names && !qwen_names)
    throw Error(ck.path() + ": no expert weights under prefix '" + prefix +
                "' (looked for experts.0.w1.weight and experts.0.gate_proj.weight)");
  const char* n1 = mixtral_names ? "w1" : "gate_proj";
  const char* n3 = mixtral_names ? "w3" : "up_proj";
  const char* n2 = mixtral_names ? "w2" : "down_proj";
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = prefix + "experts." + std::to_string(e) + ".";
    Expert ex;
    ex.w1 = ck.get_f32(p + n1 + ".weight", {I, D});
    ex.w3 = ck.get_f32(p + n3 + ".weight", {I, D});
    ex.w2 = ck.get_f32(p + n2 + ".weight", {D, I});
    m.experts.push_back(std::move(ex));
  }
  if (ck.contains(prefix + "experts." + std::to_string(E) + "." + n1 + ".weight"))
    throw Error(ck.path() + ": checkpoint has more experts under '" + prefix + "' than num_experts=" +
                std::to_string(E));
  if (config.shared_expert_intermediate_size > 0) {
    const int64_t S = config.shared_expert_intermediate_size;
    m.has_shared = true;
    m.shared.w1 = ck.get_f32(prefix + "shared_expert.gate_proj.weight", {S, D});
    m.shared.w3 = ck.get_f32(prefix + "shared_expert.up_proj.weight", {S, D});
    m.shared.w2 = ck.get_f32(prefix + "shared_expert.down_proj.weight", {D, S});
    m.shared_gate = ck.get_f32(prefix + "shared_expert_gate.weight", {1, D});
  }
  return layer;
}

MoeLayer MoeLayer::load_hf_layer(const std::string& checkpoint_dir, const std::string& prefix) {
  const MoeConfig cfg = MoeConfig::from_hf_config(checkpoint_dir + "/config.json");
  return load(cfg, Checkpoint::open(checkpoint_dir), prefix);
}

void MoeLayer::check_input(const Tensor& x, const char* what) const {
  if (x.rank() != 2 || x.dim(1) != impl_->cfg.hidden_size || x.dtype() != DType::F32 || !x.is_host())
    throw Error(std::string(what) + ": input " + x.describe() + ", expected f32[rows," +
                std::to_string(impl_->cfg.hidden_size) + "]@host");
}

void MoeLayer::check_routing(const Tensor& x, const Routing& r) const {
  const MoeConfig& c = impl_->cfg;
  if (r.rows != x.dim(0) || r.top_k <= 0 ||
      r.expert_ids.size() != static_cast<size_t>(r.rows * r.top_k) || r.weights.size() != r.expert_ids.size())
    throw Error("run_experts: routing for " + std::to_string(r.rows) + " rows x top_k " +
                std::to_string(r.top_k) + " does not match input " + x.describe());
  for (int32_t id : r.expert_ids)
    if (id < 0 || id >= c.num_experts)
      throw Error("run_experts: expert id " + std::to_string(id) + " outside [0, " +
                  std::to_string(c.num_experts) + ")");
}

Tensor MoeLayer::router_logits(const Tensor& x) const {
  check_input(x, "router");
  const MoeConfig& c = impl_->cfg;
  Tensor logits = Tensor::zeros(DType::F32, {x.dim(0), c.num_experts});
  cpu::linear(x.data<float>(), impl_->gate.data<float>(), nullptr, logits.data<float>(), x.dim(0),
              c.num_experts, c.hidden_size);
  return logits;
}

Routing MoeLayer::route(const Tensor& x) const { return route(x, impl_->cfg.top_k); }

Routing MoeLayer::route(const Tensor& x, int top_k) const {
  const MoeConfig& c = impl_->cfg;
  if (top_k < 1 || top_k > c.num_experts)
    throw Error("route: top_k " + std::to_string(top_k) + " outside [1, num_experts=" +
                std::to_string(c.num_experts) + "]");
  Tensor logits = router_logits(x);
  Routing r;
  r.rows = x.dim(0);
  r.top_k = top_k;
  r.expert_ids.resize(static_cast<size_t>(r.rows * top_k));
  r.weights.resize(r.expert_ids.size());
  cpu::topk_softmax(logits.data<float>(), r.rows, c.num_experts, top_k, c.norm_topk_prob,
                    r.expert_ids.data(), r.weights.data());
  return r;
}

Tensor MoeLayer::run_experts(const Tensor& x, const Routing& r) const {
  check_input(x, "run_experts");
  check_routing(x, r);
  const MoeConfig& c = impl_->cfg;
  const int64_t D = c.hidden_size, I = c.intermediate_size, E = c.num_experts, K = r.top_k;
  const int64_t N = r.rows, slots = N * K;
  const float* xp = x.data<float>();
  Tensor y = Tensor::zeros(DType::F32, {N, D});
  float* yp = y.data<float>();

  // Count and prefix-sum per expert, then permute (row, weight) slots into expert order.
  std::vector<int64_t> offsets(static_cast<size_t>(E + 1), 0);
  for (int32_t id : r.expert_ids) ++offsets[static_cast<size_t>(id) + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  std::vector<int64_t> slot_row(static_cast<size_t>(slots));
  std::vector<float> slot_weight(static_cast<size_t>(slots));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = fill[r.expert(n, static_cast<int>(j))]++;
      slot_row[s] = n;
      slot_weight[s] = r.weight(n, static_cast<int>(j));
    }
  Tensor gathered = Tensor::zeros(DType::F32, {slots, D});
  float* gp = gathered.data<float>();
  for (int64_t s = 0; s < slots; ++s) std::memcpy(gp + s * D, xp + slot_row[s] * D, D * sizeof(float));

  int64_t max_count = 0;
  for (int64_t e = 0; e < E; ++e) max_count = std::max(max_count, offsets[e + 1] - offsets[e]);
  Tensor gate = Tensor::zeros(DType::F32, {max_count, I});
  Tensor up = Tensor::zeros(DType::F32, {max_count, I});
  Tensor out = Tensor::zeros(DType::F32, {max_count, D});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
    if (count == 0) continue;
    swiglu(impl_->experts[e], gp + begin * D, count, D, I, gate.data<float>(), up.data<float>(),
           out.data<float>());
    const float* op = out.data<float>();
    for (int64_t i = 0; i < count; ++i) {
      const float w = slot_weight[begin + i];
      float* dst = yp + slot_row[begin + i] * D;
      for (int64_t d = 0; d < D; ++d) dst[d] += w * op[i * D + d];
    }
  }

  if (impl_->has_shared) {
    const int64_t S = c.shared_expert_intermediate_size;
    Tensor sg = Tensor::zeros(DType::F32, {N, S});
    Tensor su = Tensor::zeros(DType::F32, {N, S});
    Tensor so = Tensor::zeros(DType::F32, {N, D});
    swiglu(impl_->shared, xp, N, D, S, sg.data<float>(), su.data<float>(), so.data<float>());
    Tensor g = Tensor::zeros(DType::F32, {N, 1});
    cpu::linear(xp, impl_->shared_gate.data<float>(), nullptr, g.data<float>(), N, 1, D);
    for (int64_t n = 0; n < N; ++n) {
      const float s = 1.0f / (1.0f + std::exp(-g.data<float>()[n]));
      for (int64_t d = 0; d < D; ++d) yp[n * D + d] += s * so.data<float>()[n * D + d];
    }
  }
  return y;
}

Tensor MoeLayer::run_experts_reference(const Tensor& x, const Routing& r) const {
  check_input(x, "run_experts_reference");
  check_routing(x, r);
  const MoeConfig& c = impl_->cfg;
  const int64_t D = c.hidden_size, N = r.rows;
  Tensor y = Tensor::zeros(DType::F32, {N, D});
  auto expert_row = [D](const Expert& e, const float* xr, int64_t I, std::vector<double>& out) {
    std::vector<double> h(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t d = 0; d < D; ++d) {
        g += static_cast<double>(e.w1.data<float>()[i * D + d]) * xr[d];
        u += static_cast<double>(e.w3.data<float>()[i * D + d]) * xr[d];
      }
      h[i] = g / (1.0 + std::exp(-g)) * u;
    }
    out.assign(static_cast<size_t>(D), 0.0);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < I; ++i) out[d] += static_cast<double>(e.w2.data<float>()[d * I + i]) * h[i];
  };
  std::vector<double> eo;
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x.data<float>() + n * D;
    std::vector<double> acc(static_cast<size_t>(D), 0.0);
    for (int j = 0; j < r.top_k; ++j) {
      expert_row(impl_->experts[r.expert(n, j)], xr, c.intermediate_size, eo);
      for (int64_t d = 0; d < D; ++d) acc[d] += r.weight(n, j) * eo[d];
    }
    if (impl_->has_shared) {
      expert_row(impl_->shared, xr, c.shared_expert_intermediate_size, eo);
      double g = 0;
      for (int64_t d = 0; d < D; ++d) g += static_cast<double>(impl_->shared_gate.data<float>()[d]) * xr[d];
      const double s = 1.0 / (1.0 + std::exp(-g));
      for (int64_t d = 0; d < D; ++d) acc[d] += s * eo[d];
    }
    for (int64_t d = 0; d < D; ++d) y.data<float>()[n * D + d] = static_cast<float>(acc[d]);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------

MoeAdapter::MoeAdapter(MoeLayer layer) : layer_(std::move(layer)) {}

MoeAdapter MoeAdapter::load(const std::string& dir) {
  const MoeConfig cfg = MoeConfig::from_adapter_config(dir + "/adapter_config.json");
  return MoeAdapter(MoeLayer::load(cfg, Checkpoint::open(dir + "/adapter.safetensors"), ""));
}

Tensor MoeAdapter::apply_experts(const Tensor& x, const Routing& routing) const {
  Tensor y = layer_.run_experts(x, routing);
  cpu::add_inplace(y.data<float>(), x.data<float>(), y.numel());
  cpu::l2_normalize_rows(y.data<float>(), y.dim(0), y.dim(1));
  return y;
}

AdapterOutput MoeAdapter::apply(const Tensor& x) const {
  AdapterOutput out;
  out.routing = layer_.route(x);
  out.embeddings = apply_experts(x, out.routing);
  return out;
}

}  // namespace moe
