#include "moe/moe_layer.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "runtime/compute_util.h"
#include "io/json_util.h"
#include "moe/error.h"
#include "moe/quantized_weights.h"

namespace moe {

using detail::Call;
using detail::f32_ptr;
using detail::ModelBackend;
using detail::weight_ref;

namespace {

int positive(JsonObject* obj, const char* key, const std::string& what) {
  const int64_t v = json::get_int(obj, key, what);
  if (v <= 0 || v > (1 << 24)) throw Error(what + ": '" + key + "' must be a positive integer");
  return static_cast<int>(v);
}

struct Expert {
  Tensor w1, w3, w2;  // gate [I,D], up [I,D], down [D,I]
};

// An expert's matrices as stored in a pack-quantized checkpoint (moe/quantized_weights.h).
struct PackedExpert {
  PackedInt4Weight w1, w3, w2;
};

// `module`'s weight as host f32, and its packed form when the checkpoint stores it packed.
Tensor expert_matrix(const Checkpoint& ck, const std::string& module, const Shape& shape,
                     std::vector<PackedInt4Weight>& packed) {
  if (!is_packed_int4(ck, module)) return ck.get_f32(module + ".weight", shape);
  packed.push_back(load_packed_int4(ck, module, shape));
  return packed.back().dequantize();
}

}  // namespace

MoeConfig MoeConfig::from_adapter_config(const std::string& path) {
  json::Document doc = json::Document::from_file(path);
  JsonObject* o = doc.root_object();
  const std::string fmt = json::get_string_or(o, "format", "", path);
  if (fmt != "gst-moe-adapter") throw Error(path + ": 'format' is '" + fmt + "', expected 'gst-moe-adapter'");
  const int64_t version = json::get_int(o, "version", path);
  if (version != 1) throw Error(path + ": unsupported adapter version " + std::to_string(version));
  MoeConfig c;
  c.source = path;
  c.hidden_size = positive(o, "hidden_size", path);
  c.num_experts = positive(o, "num_experts", path);
  c.top_k = positive(o, "top_k", path);
  c.intermediate_size = positive(o, "intermediate_size", path);
  const std::string routing = json::get_string_or(o, "routing", "mixtral", path);
  if (routing == "mixtral")
    c.routing = RoutingKind::Mixtral;
  else if (routing == "qwen2_moe")
    c.routing = RoutingKind::Qwen2Moe;
  else
    throw Error(path + ": unknown routing '" + routing + "' (expected mixtral or qwen2_moe)");
  c.norm_topk_prob = json::get_bool_or(o, "norm_topk_prob", c.routing == RoutingKind::Mixtral, path);
  c.shared_expert_intermediate_size = static_cast<int>(json::get_int_or(o, "shared_expert_intermediate_size", 0, path));
  c.router_temperature = json::get_double_or(o, "router_temperature", 1.0, path);
  const int64_t joint = json::get_int_or(o, "joint_experts", 0, path);
  if (joint < 0 || joint >= c.num_experts)
    throw Error(path + ": 'joint_experts' " + std::to_string(joint) +
                " outside [0, num_experts=" + std::to_string(c.num_experts) + ")");
  c.joint_experts = static_cast<int>(joint);
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
  // The experts compute SwiGLU; transformers applies ACT2FN[hidden_act] (default "silu", and
  // "swish" is the same SiLU there), so any other activation would give other numbers.
  const std::string act = json::get_string_or(o, "hidden_act", "silu", path);
  if (act != "silu" && act != "swish")
    throw Error(path + ": hidden_act '" + act + "' is not supported (the experts compute SiLU: 'silu' or 'swish')");
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
    // Absent: transformers' Qwen2MoeConfig default, whose shared expert the checkpoint then holds.
    c.shared_expert_intermediate_size =
        static_cast<int>(json::get_int_or(o, "shared_expert_intermediate_size", 5632, path));
  }
  c.validate();
  return c;
}

void MoeConfig::validate() const {
  const std::string& w = source.empty() ? std::string("MoE config") : source;
  if (hidden_size <= 0 || num_experts <= 0 || intermediate_size <= 0)
    throw Error(w + ": hidden_size, num_experts and intermediate_size must be positive");
  if (top_k <= 0 || top_k > num_experts)
    throw Error(w + ": top_k " + std::to_string(top_k) + " must be in [1, num_experts=" + std::to_string(num_experts) +
                "]");
  if (shared_expert_intermediate_size < 0) throw Error(w + ": shared_expert_intermediate_size must not be negative");
  if (shared_expert_intermediate_size > 0 && routing != RoutingKind::Qwen2Moe)
    throw Error(w + ": a shared expert needs qwen2_moe routing");
  if (joint_experts < 0 || joint_experts > num_experts - top_k)
    throw Error(w + ": joint_experts " + std::to_string(joint_experts) + " outside [0, num_experts - top_k = " +
                std::to_string(num_experts - top_k) + "] (a single-modality row routes to top_k of the others)");
  if (!(router_temperature >= 1e-3 && router_temperature <= 1e3))
    throw Error(w + ": router_temperature " + std::to_string(router_temperature) + " outside [0.001, 1000]");
}

struct MoeLayer::Impl {
  MoeConfig cfg;
  ModelBackend be;
  mutable std::unique_ptr<detail::Workspace> workspace;  // non-host backends: under be.mutex

  // Host f32 weights, as in the checkpoint (views into the mmap-ed file for f32 checkpoints):
  // expert_weight() and the reference.
  Tensor gate;  // [E, D]
  std::vector<Expert> experts;
  bool has_shared = false;
  Expert shared;
  Tensor shared_gate;  // [1, D]

  // In backend memory (the host tensors themselves on the CPU backend in f32): the router and
  // the shared-expert gate in f32, the experts in the layer's precision, given to
  // prepare_linear_weight (the CPU backend's linear and grouped_swiglu run oneDNN on a packed copy).
  Tensor dev_gate, dev_shared_gate;
  Expert dev_shared;
  std::vector<Expert> dev_experts;  // keeps the memory behind expert_refs
  std::vector<kernels::ExpertWeights> expert_refs;
  // 4-bit experts (all or none): the checkpoint's packed tensors (host views), their copies in
  // backend memory (non-host backends only) and their descriptors, which expert_refs point to
  // (sized once: the addresses stay put).
  std::vector<PackedExpert> packed_experts;
  std::vector<Tensor> dev_packed;
  std::vector<kernels::Q4Weight> q4_refs;

  void upload() {
    dev_gate = be.f32(gate);
    if (!packed_experts.empty()) {
      // The CPU backend reads the packed bytes in place; others get a copy of the three arrays.
      std::string why;
      if (!be.backend->supports({kernels::Op::GroupedSwiglu,
                                 {kernels::WeightType::Q4},
                                 {1, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size}},
                                &why))
        throw Error(cfg.source + ": 4-bit experts on " + be.backend->name() + ": " + why);
      q4_refs.reserve(3 * packed_experts.size());
      for (const PackedExpert& p : packed_experts) {
        for (const PackedInt4Weight* w : {&p.w1, &p.w3, &p.w2}) q4_refs.push_back(q4_on_backend(*w));
        const kernels::Q4Weight* q = &q4_refs[q4_refs.size() - 3];
        expert_refs.push_back(
            {{q, kernels::WeightType::Q4}, {q + 1, kernels::WeightType::Q4}, {q + 2, kernels::WeightType::Q4}});
      }
    } else {
      for (const Expert& e : experts) {
        Expert d{be.linear_weight(e.w1), be.linear_weight(e.w3), be.linear_weight(e.w2)};
        expert_refs.push_back({weight_ref(d.w1), weight_ref(d.w3), weight_ref(d.w2)});
        dev_experts.push_back(std::move(d));
      }
    }
    if (has_shared) {
      dev_shared = {be.linear_weight(shared.w1), be.linear_weight(shared.w3), be.linear_weight(shared.w2)};
      dev_shared_gate = be.f32(shared_gate);
    }
  }

  // `w`'s descriptor over arrays in backend memory.
  kernels::Q4Weight q4_on_backend(const PackedInt4Weight& w) {
    kernels::Q4Weight q = w.ref();
    if (be.backend->is_host_memory()) return q;
    dev_packed.push_back(be.copy_as_is(w.packed));
    q.packed = static_cast<const int32_t*>(dev_packed.back().raw_data());
    dev_packed.push_back(be.copy_as_is(w.scales));
    q.scales = dev_packed.back().raw_data();
    if (!w.symmetric()) {
      dev_packed.push_back(be.copy_as_is(w.zero_points));
      q.zero_points = static_cast<const int32_t*>(dev_packed.back().raw_data());
    }
    return q;
  }

  // Router logits [N, E] in backend memory for x [N, D] (backend memory), masked by `fused`
  // (FusedRows). A masked row's logits come from a linear over the first E - J router rows alone
  // (a GEMM with another number of outputs need not round the same), so they are the very numbers
  // a layer without the joint experts computes; topk_softmax then gives those rows the same ids
  // and weights (exp(-inf) adds exact zeros to the softmax sum). The rows are merged on the host:
  // N · E floats.
  float* logits_on(Call& call, const float* x, int64_t N, const FusedRows& fused) const {
    kernels::Backend& b = call.backend();
    const int64_t D = cfg.hidden_size, E = cfg.num_experts, S = E - cfg.joint_experts;
    const int64_t n_fused = std::count(fused.begin(), fused.end(), true);
    float* logits = call.ws().f32(N * E);
    if (cfg.joint_experts == 0 || n_fused == N) {
      b.linear(x, weight_ref(dev_gate), nullptr, logits, N, E, D);
      return logits;
    }
    float* single = call.ws().f32(N * S);
    b.linear(x, weight_ref(dev_gate), nullptr, single, N, S, D);  // the gate's first S rows
    float* merged = call.host_f32(N * E);
    if (n_fused > 0) {
      b.linear(x, weight_ref(dev_gate), nullptr, logits, N, E, D);
      call.to_host(merged, logits, static_cast<size_t>(N * E) * sizeof(float));
    }
    float* host_single = call.host_f32(N * S);
    call.to_host(host_single, single, static_cast<size_t>(N * S) * sizeof(float));
    for (int64_t n = 0; n < N; ++n) {
      if (n_fused > 0 && fused[static_cast<size_t>(n)]) continue;
      float* row = merged + n * E;
      std::copy(host_single + n * S, host_single + (n + 1) * S, row);
      std::fill(row + S, row + E, -INFINITY);
    }
    return call.device(merged, N * E);
  }

  // Router on the backend: x [N, D] -> ids, weights [N, top_k] (backend memory).
  void route_on(Call& call, const float* x, int64_t N, int top_k, const FusedRows& fused, int32_t* ids,
                float* weights) const {
    const float* logits = logits_on(call, x, N, fused);
    call.backend().topk_softmax(logits, N, cfg.num_experts, top_k, cfg.norm_topk_prob, ids, weights);
  }

  // y [N, D] = Σ_j weights[n, j] · expert_{ids[n, j]}(x[n]) (+ sigmoid(shared_gate · x[n]) ·
  // shared_expert(x[n])), everything in backend memory. ids are valid (checked by the caller).
  void experts_on(Call& call, const float* x, int64_t N, int K, const int32_t* ids, const float* weights,
                  float* y) const {
    kernels::Backend& b = call.backend();
    detail::Workspace& ws = call.ws();
    const int64_t D = cfg.hidden_size, I = cfg.intermediate_size, E = cfg.num_experts, slots = N * K;
    float* x_sorted = ws.f32(slots * D);
    int32_t* slot_of = ws.i32(slots);
    const std::vector<int64_t> offsets = b.moe_permute(ids, N, K, E, x, D, x_sorted, slot_of);
    float* out_sorted = ws.f32(slots * D);
    b.grouped_swiglu(x_sorted, offsets, expert_refs, D, I, out_sorted);
    b.moe_unpermute(out_sorted, slot_of, weights, N, K, D, y);
    if (!has_shared) return;

    // Shared expert, gated per row by sigmoid(shared_gate · x). The gate's N logits come back to
    // the host for the sigmoid.
    const int64_t S = cfg.shared_expert_intermediate_size;
    float* g = ws.f32(N);
    b.linear(x, weight_ref(dev_shared_gate), nullptr, g, N, 1, D);
    float* scale = call.host_f32(N);
    call.to_host(scale, g, static_cast<size_t>(N) * sizeof(float));
    for (int64_t n = 0; n < N; ++n) scale[n] = 1.0f / (1.0f + std::exp(-scale[n]));
    int32_t* identity = call.host_i32(N);
    for (int64_t n = 0; n < N; ++n) identity[n] = static_cast<int32_t>(n);
    detail::add_scaled_swiglu(b, x, N, D, S,
                              {weight_ref(dev_shared.w1), weight_ref(dev_shared.w3), weight_ref(dev_shared.w2)},
                              call.device(identity, N), call.device(scale, N), ws.f32(N * (2 * S + 2 * D)), y);
  }

  // The routing's ids and weights in backend memory.
  std::pair<const int32_t*, const float*> routing_on(Call& call, const Routing& r) const {
    const int64_t n = r.rows * r.top_k;
    return {call.input(r.expert_ids.data(), n), call.input(r.weights.data(), n)};
  }
};

MoeLayer::MoeLayer() : impl_(std::make_unique<Impl>()) {}
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;
MoeLayer::~MoeLayer() = default;

const MoeConfig& MoeLayer::config() const { return impl_->cfg; }
std::string MoeLayer::device() const { return impl_->be.backend->name(); }
kernels::WeightType MoeLayer::precision() const {
  return impl_->packed_experts.empty() ? impl_->be.precision : kernels::WeightType::Q4;
}

size_t MoeLayer::expert_bytes() const {
  if (impl_->packed_experts.empty())
    return 3 * static_cast<size_t>(impl_->cfg.num_experts) * static_cast<size_t>(impl_->cfg.hidden_size) *
           static_cast<size_t>(impl_->cfg.intermediate_size) * kernels::weight_type_size(impl_->be.precision);
  size_t bytes = 0;
  for (const PackedExpert& p : impl_->packed_experts) bytes += p.w1.nbytes() + p.w3.nbytes() + p.w2.nbytes();
  return bytes;
}

const Tensor& MoeLayer::shared_expert_weight(ExpertMatrix which) const {
  if (!impl_->has_shared)
    throw Error("shared_expert_weight: the MoE layer from '" + impl_->cfg.source + "' has no shared expert");
  switch (which) {
    case ExpertMatrix::W1:
      return impl_->shared.w1;
    case ExpertMatrix::W3:
      return impl_->shared.w3;
    case ExpertMatrix::W2:
      return impl_->shared.w2;
  }
  throw Error("shared_expert_weight: unknown matrix");
}

const Tensor& MoeLayer::shared_expert_gate() const {
  if (!impl_->has_shared)
    throw Error("shared_expert_gate: the MoE layer from '" + impl_->cfg.source + "' has no shared expert");
  return impl_->shared_gate;
}

const Tensor& MoeLayer::expert_weight(int e, ExpertMatrix which) const {
  if (e < 0 || e >= impl_->cfg.num_experts)
    throw Error("expert_weight: expert " + std::to_string(e) + " outside [0, " +
                std::to_string(impl_->cfg.num_experts) + ")");
  const Expert& ex = impl_->experts[static_cast<size_t>(e)];
  switch (which) {
    case ExpertMatrix::W1:
      return ex.w1;
    case ExpertMatrix::W3:
      return ex.w3;
    case ExpertMatrix::W2:
      return ex.w2;
  }
  throw Error("expert_weight: unknown matrix " + std::to_string(static_cast<int>(which)));
}

const PackedInt4Weight& MoeLayer::packed_expert_weight(int e, ExpertMatrix which) const {
  if (impl_->packed_experts.empty())
    throw Error("packed_expert_weight: the experts of the MoE layer from '" + impl_->cfg.source + "' are not 4-bit");
  if (e < 0 || e >= impl_->cfg.num_experts)
    throw Error("packed_expert_weight: expert " + std::to_string(e) + " outside [0, " +
                std::to_string(impl_->cfg.num_experts) + ")");
  const PackedExpert& p = impl_->packed_experts[static_cast<size_t>(e)];
  switch (which) {
    case ExpertMatrix::W1:
      return p.w1;
    case ExpertMatrix::W3:
      return p.w3;
    case ExpertMatrix::W2:
      return p.w2;
  }
  throw Error("packed_expert_weight: unknown matrix " + std::to_string(static_cast<int>(which)));
}

MoeLayer MoeLayer::load(const MoeConfig& config, const Checkpoint& ck, const std::string& prefix,
                        const ComputeOptions& options) {
  config.validate();
  MoeLayer layer;
  Impl& m = *layer.impl_;
  m.cfg = config;
  m.be = ModelBackend::open(options);
  const int64_t D = config.hidden_size, I = config.intermediate_size, E = config.num_experts;
  m.gate = ck.get_f32(prefix + "gate.weight", {E, D});
  const auto stored = [&](const std::string& module) {
    return ck.contains(module + ".weight") || is_packed_int4(ck, module);
  };
  const bool mixtral_names = stored(prefix + "experts.0.w1");
  const bool qwen_names = stored(prefix + "experts.0.gate_proj");
  if (!mixtral_names && !qwen_names)
    throw Error(ck.path() + ": no expert weights under prefix '" + prefix +
                "' (looked for experts.0.w1.weight and experts.0.gate_proj.weight)");
  const char* n1 = mixtral_names ? "w1" : "gate_proj";
  const char* n3 = mixtral_names ? "w3" : "up_proj";
  const char* n2 = mixtral_names ? "w2" : "down_proj";
  std::vector<PackedInt4Weight> packed;
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = prefix + "experts." + std::to_string(e) + ".";
    Expert ex;
    ex.w1 = expert_matrix(ck, p + n1, {I, D}, packed);
    ex.w3 = expert_matrix(ck, p + n3, {I, D}, packed);
    ex.w2 = expert_matrix(ck, p + n2, {D, I}, packed);
    m.experts.push_back(std::move(ex));
  }
  if (!packed.empty() && packed.size() != static_cast<size_t>(3 * E))
    throw Error(ck.path() + ": under '" + prefix + "' some expert matrices are 4-bit and others are not");
  for (size_t i = 0; i < packed.size(); i += 3)
    m.packed_experts.push_back({std::move(packed[i]), std::move(packed[i + 1]), std::move(packed[i + 2])});
  if (stored(prefix + "experts." + std::to_string(E) + "." + n1))
    throw Error(ck.path() + ": checkpoint has more experts under '" + prefix +
                "' than num_experts=" + std::to_string(E));
  if (config.shared_expert_intermediate_size > 0) {
    const int64_t S = config.shared_expert_intermediate_size;
    m.has_shared = true;
    // A 4-bit shared expert runs dequantised (f32 host weights, in the layer's precision): it is
    // one expert of the layer's, computed for every row.
    std::vector<PackedInt4Weight> shared_packed;
    m.shared.w1 = expert_matrix(ck, prefix + "shared_expert.gate_proj", {S, D}, shared_packed);
    m.shared.w3 = expert_matrix(ck, prefix + "shared_expert.up_proj", {S, D}, shared_packed);
    m.shared.w2 = expert_matrix(ck, prefix + "shared_expert.down_proj", {D, S}, shared_packed);
    m.shared_gate = ck.get_f32(prefix + "shared_expert_gate.weight", {1, D});
  }
  m.upload();
  return layer;
}

MoeLayer MoeLayer::load_hf_layer(const std::string& checkpoint_dir, const std::string& prefix,
                                 const ComputeOptions& options) {
  const MoeConfig cfg = MoeConfig::from_hf_config(checkpoint_dir + "/config.json");
  // Refuses quantisation schemes other than W4A16 pack-quantized before any tensor is read.
  Int4QuantConfig::from_hf_config(checkpoint_dir + "/config.json");
  return load(cfg, Checkpoint::open(checkpoint_dir), prefix, options);
}

void MoeLayer::check_input(const Tensor& x, const char* what) const {
  if (x.rank() != 2 || x.dim(1) != impl_->cfg.hidden_size || x.dtype() != DType::F32 || !x.is_host())
    throw Error(std::string(what) + ": input " + x.describe() + ", expected f32[rows," +
                std::to_string(impl_->cfg.hidden_size) + "]@host");
}

void MoeLayer::check_routing(const Tensor& x, const Routing& r) const {
  const MoeConfig& c = impl_->cfg;
  if (r.rows != x.dim(0) || r.top_k <= 0 || r.expert_ids.size() != static_cast<size_t>(r.rows * r.top_k) ||
      r.weights.size() != r.expert_ids.size())
    throw Error("run_experts: routing for " + std::to_string(r.rows) + " rows x top_k " + std::to_string(r.top_k) +
                " does not match input " + x.describe());
  for (int32_t id : r.expert_ids)
    if (id != Routing::kUnusedSlot && (id < 0 || id >= c.num_experts))
      throw Error("run_experts: expert id " + std::to_string(id) + " outside [0, " + std::to_string(c.num_experts) +
                  ")");
}

void MoeLayer::check_fused(const Tensor& x, const FusedRows& fused, const char* what) const {
  if (!fused.empty() && static_cast<int64_t>(fused.size()) != x.dim(0))
    throw Error(std::string(what) + ": " + std::to_string(fused.size()) + " fused-row flags for " +
                std::to_string(x.dim(0)) + " rows");
}

Tensor MoeLayer::router_logits(const Tensor& x, const FusedRows& fused) const {
  check_input(x, "router");
  check_fused(x, fused, "router");
  const Impl& m = *impl_;
  const int64_t N = x.dim(0), E = m.cfg.num_experts;
  if (N == 0) return Tensor::zeros(DType::F32, {0, E});
  Call call(m.be, m.workspace);
  return call.to_host(m.logits_on(call, call.input(x.data<float>(), x.numel()), N, fused), {N, E});
}

Routing MoeLayer::route(const Tensor& x, const FusedRows& fused) const { return route(x, impl_->cfg.top_k, fused); }

Routing MoeLayer::route(const Tensor& x, int top_k, const FusedRows& fused) const {
  check_input(x, "router");
  check_fused(x, fused, "router");
  const Impl& m = *impl_;
  const bool all_fused = !fused.empty() && std::count(fused.begin(), fused.end(), true) == x.dim(0);
  const int routable = all_fused ? m.cfg.num_experts : m.cfg.num_experts - m.cfg.joint_experts;
  if (top_k < 1 || top_k > routable)
    throw Error("route: top_k " + std::to_string(top_k) + " outside [1, " +
                (routable == m.cfg.num_experts
                     ? "num_experts=" + std::to_string(routable) + "]"
                     : std::to_string(routable) + "] (" + std::to_string(m.cfg.joint_experts) + " of the " +
                           std::to_string(m.cfg.num_experts) +
                           " experts are joint: single-modality rows do not use them)"));
  Routing r;
  r.rows = x.dim(0);
  r.top_k = top_k;
  r.expert_ids.resize(static_cast<size_t>(r.rows * top_k));
  r.weights.resize(r.expert_ids.size());
  if (r.rows == 0) return r;
  Call call(m.be, m.workspace);
  int32_t* ids = call.ws().i32(r.rows * top_k);
  float* weights = call.ws().f32(r.rows * top_k);
  m.route_on(call, call.input(x.data<float>(), x.numel()), r.rows, top_k, fused, ids, weights);
  call.to_host(r.expert_ids.data(), ids, r.expert_ids.size() * sizeof(int32_t));
  call.to_host(r.weights.data(), weights, r.weights.size() * sizeof(float));
  return r;
}

Tensor MoeLayer::run_experts(const Tensor& x, const Routing& r) const {
  check_input(x, "run_experts");
  check_routing(x, r);
  const Impl& m = *impl_;
  const int64_t N = r.rows, D = m.cfg.hidden_size;
  if (N == 0) return Tensor::zeros(DType::F32, {0, D});
  Call call(m.be, m.workspace);
  const auto [ids, weights] = m.routing_on(call, r);
  float* y = call.ws().f32(N * D);
  m.experts_on(call, call.input(x.data<float>(), x.numel()), N, r.top_k, ids, weights, y);
  return call.to_host(y, {N, D});
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
      if (r.expert(n, j) == Routing::kUnusedSlot) continue;
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

// The gate's Linear(2·D -> 2) split into its image and text column halves, so that [image; text]
// is never concatenated: logits = W_image · image + W_text · text + b. In backend memory, f32.
struct MoeAdapter::CrossModalGate {
  Tensor image_weight, text_weight;  // [2, D]
  Tensor bias;                       // [2]
};

namespace {

constexpr const char* kGateWeight = "cross_modal_gate.weight";
constexpr const char* kGateBias = "cross_modal_gate.bias";

}  // namespace

MoeAdapter::MoeAdapter(MoeLayer layer, std::string fingerprint)
    : layer_(std::move(layer)), fingerprint_(std::move(fingerprint)) {}
MoeAdapter::MoeAdapter(MoeAdapter&&) noexcept = default;
MoeAdapter& MoeAdapter::operator=(MoeAdapter&&) noexcept = default;
MoeAdapter::~MoeAdapter() = default;

MoeAdapter MoeAdapter::load(const std::string& dir, const ComputeOptions& options) {
  const MoeConfig cfg = MoeConfig::from_adapter_config(dir + "/adapter_config.json");
  // Refuses quantisation schemes other than W4A16 pack-quantized (tools/moe-quantize.py).
  Int4QuantConfig::from_hf_config(dir + "/adapter_config.json");
  const Checkpoint weights = Checkpoint::open(dir + "/adapter.safetensors");
  MoeAdapter adapter(MoeLayer::load(cfg, weights, "", options), weights.fingerprint());
  const bool has_weight = weights.contains(kGateWeight), has_bias = weights.contains(kGateBias);
  if (has_weight != has_bias)
    throw Error(weights.path() + ": tensor '" + (has_weight ? kGateBias : kGateWeight) +
                "' is missing: a cross-modal gate needs both '" + kGateWeight + "' and '" + kGateBias + "'");
  if (has_weight) {
    const int64_t D = cfg.hidden_size;
    const Tensor w = weights.get_f32(kGateWeight, {2, 2 * D});
    auto gate = std::make_unique<CrossModalGate>();
    Tensor half[2] = {Tensor::zeros(DType::F32, {2, D}), Tensor::zeros(DType::F32, {2, D})};
    for (int64_t logit = 0; logit < 2; ++logit)
      for (int h = 0; h < 2; ++h)
        std::memcpy(half[h].data<float>() + logit * D, w.data<float>() + (logit * 2 + h) * D,
                    static_cast<size_t>(D) * sizeof(float));
    const ModelBackend& be = adapter.layer_.impl_->be;
    gate->image_weight = be.f32(half[0]);
    gate->text_weight = be.f32(half[1]);
    gate->bias = be.f32(weights.get_f32(kGateBias, {2}));
    adapter.gate_ = std::move(gate);
  }
  return adapter;
}

Tensor MoeAdapter::apply_experts(const Tensor& x, const Routing& routing) const {
  layer_.check_input(x, "run_experts");
  layer_.check_routing(x, routing);
  const MoeLayer::Impl& m = *layer_.impl_;
  const int64_t N = routing.rows, D = m.cfg.hidden_size;
  if (N == 0) return Tensor::zeros(DType::F32, {0, D});
  Call call(m.be, m.workspace);
  kernels::Backend& b = call.backend();
  const float* dx = call.input(x.data<float>(), x.numel());
  const auto [ids, weights] = m.routing_on(call, routing);
  float* y = call.ws().f32(N * D);
  m.experts_on(call, dx, N, routing.top_k, ids, weights, y);
  b.add(y, dx, N * D);
  b.l2_normalize_rows(y, N, D, 1e-12f);
  return call.to_host(y, {N, D});
}

AdapterOutput MoeAdapter::apply(const Tensor& x, const MoeLayer::FusedRows& fused) const {
  layer_.check_input(x, "router");
  layer_.check_fused(x, fused, "router");
  const MoeLayer::Impl& m = *layer_.impl_;
  const int64_t N = x.dim(0), D = m.cfg.hidden_size;
  const int K = m.cfg.top_k;
  AdapterOutput out;
  out.routing.rows = N;
  out.routing.top_k = K;
  out.routing.expert_ids.resize(static_cast<size_t>(N * K));
  out.routing.weights.resize(out.routing.expert_ids.size());
  if (N == 0) {
    out.embeddings = Tensor::zeros(DType::F32, {0, D});
    return out;
  }
  Call call(m.be, m.workspace);
  kernels::Backend& b = call.backend();
  const float* dx = call.input(x.data<float>(), x.numel());
  int32_t* ids = call.ws().i32(N * K);
  float* weights = call.ws().f32(N * K);
  m.route_on(call, dx, N, K, fused, ids, weights);
  call.to_host(out.routing.expert_ids.data(), ids, out.routing.expert_ids.size() * sizeof(int32_t));
  call.to_host(out.routing.weights.data(), weights, out.routing.weights.size() * sizeof(float));
  float* y = call.ws().f32(N * D);
  m.experts_on(call, dx, N, K, ids, weights, y);
  b.add(y, dx, N * D);
  b.l2_normalize_rows(y, N, D, 1e-12f);
  out.embeddings = call.to_host(y, {N, D});
  return out;
}

Tensor MoeAdapter::fuse(const Tensor& image, const Tensor& text, Tensor* weights) const {
  layer_.check_input(image, "fuse: image");
  layer_.check_input(text, "fuse: text");
  if (image.dim(0) != text.dim(0))
    throw Error("fuse: " + std::to_string(image.dim(0)) + " image rows and " + std::to_string(text.dim(0)) +
                " text rows; each request needs both");
  const MoeLayer::Impl& m = *layer_.impl_;
  const int64_t N = image.dim(0), D = m.cfg.hidden_size;
  if (weights != nullptr) *weights = Tensor::zeros(DType::F32, {N, 2});
  if (N == 0) return Tensor::zeros(DType::F32, {0, D});
  Call call(m.be, m.workspace);
  kernels::Backend& b = call.backend();
  const float* dimage = call.input(image.data<float>(), image.numel());
  const float* dtext = call.input(text.data<float>(), text.numel());
  float* logits;
  if (gate_ != nullptr) {
    logits = call.ws().f32(N * 2);
    b.linear(dimage, weight_ref(gate_->image_weight), f32_ptr(gate_->bias), logits, N, 2, D);
    float* text_logits = call.ws().f32(N * 2);
    b.linear(dtext, weight_ref(gate_->text_weight), nullptr, text_logits, N, 2, D);
    b.add(logits, text_logits, N * 2);
  } else {
    float* zeros = call.host_f32(N * 2);  // equal logits: softmax gives exactly (0.5, 0.5)
    std::fill(zeros, zeros + N * 2, 0.0f);
    logits = call.device(zeros, N * 2);
  }
  // The gate is a router over two "experts" that every row takes both of, the image row and the
  // text row, so the MoE operations compute it: topk_softmax with top_k 2 gives each row's softmax
  // (as ids, best first, and their weights); moe_permute groups the slots per id, which puts
  // expert 0's slots (one per row, in row order) at rows [0, N) and expert 1's at [N, N·2) of
  // `inputs`, filling both with image rows; the text rows then replace the second half, and
  // moe_unpermute sums each row's two inputs with their weights.
  int32_t* ids = call.ws().i32(N * 2);
  float* gate_weights = call.ws().f32(N * 2);
  b.topk_softmax(logits, N, 2, 2, false, ids, gate_weights);
  float* inputs = call.ws().f32(N * 2 * D);
  int32_t* slot_of = call.ws().i32(N * 2);
  b.moe_permute(ids, N, 2, 2, dimage, D, inputs, slot_of);
  b.copy_on_device(inputs + N * D, dtext, static_cast<size_t>(N * D) * sizeof(float));
  float* fused = call.ws().f32(N * D);
  b.moe_unpermute(inputs, slot_of, gate_weights, N, 2, D, fused);
  if (weights != nullptr) {
    std::vector<int32_t> host_ids(static_cast<size_t>(N * 2));
    std::vector<float> host_weights(host_ids.size());
    call.to_host(host_ids.data(), ids, host_ids.size() * sizeof(int32_t));
    call.to_host(host_weights.data(), gate_weights, host_weights.size() * sizeof(float));
    for (size_t slot = 0; slot < host_ids.size(); ++slot)
      weights->data<float>()[(slot / 2) * 2 + static_cast<size_t>(host_ids[slot])] = host_weights[slot];
  }
  return call.to_host(fused, {N, D});
}

}  // namespace moe
