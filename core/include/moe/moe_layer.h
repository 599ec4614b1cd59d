// gst-moe: the sparse Mixture-of-Experts block and the residual MoE adapter built on it.
//
// Routing follows Mixtral (softmax over all experts in fp32, top-k, renormalise) or Qwen2-MoE
// (no renormalisation unless norm_topk_prob; optional shared expert gated by
// sigmoid(shared_expert_gate(x))). Experts are SwiGLU: w2(silu(w1 x) * w3 x).
// Execution runs through the layer's kernels::Backend (ComputeOptions): router linear +
// topk_softmax, then moe_permute + grouped_swiglu + moe_unpermute (rows grouped per expert, one
// GEMM chain per active expert, weighted sum back per row); a naive per-row reference on the
// host f32 weights exists for tests. Inputs and outputs are host tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe/compute.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"

namespace moe {

enum class RoutingKind { Mixtral, Qwen2Moe };
struct PackedInt4Weight;  // moe/quantized_weights.h

struct MoeConfig {
  int hidden_size = 0;
  int num_experts = 0;
  int top_k = 0;
  int intermediate_size = 0;
  RoutingKind routing = RoutingKind::Mixtral;
  bool norm_topk_prob = true;
  int shared_expert_intermediate_size = 0;  // 0: no shared expert
  // The router's calibrated softmax temperature (adapter_config.json "router_temperature", fitted
  // by moe-calibrate-temperature; 1: none). Routing policies use it; MoeLayer::route does not.
  double router_temperature = 1.0;
  // The last joint_experts experts (ids num_experts - joint_experts .. num_experts - 1) are joint
  // visual-text experts (adapter_config.json "joint_experts"; 0: none): only rows that are fused
  // hybrid queries route to them (MoeLayer::route). In [0, num_experts - top_k].
  int joint_experts = 0;
  std::string source;  // file it came from, for messages

  // The project's adapter format (adapter_config.json; see docs/model-formats.md).
  static MoeConfig from_adapter_config(const std::string& path);
  // A Hugging Face Mixtral (model_type "mixtral") or Qwen2-MoE ("qwen2_moe") config.json.
  static MoeConfig from_hf_config(const std::string& path);
  void validate() const;
};

// Per-row routing decisions: rows × top_k expert ids and weights, best first. A row routed to
// fewer experts (routing policies: top-p, capacity) ends with unused slots: expert -1, weight 0.
struct Routing {
  int64_t rows = 0;
  int top_k = 0;
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
  int32_t expert(int64_t row, int j) const { return expert_ids[static_cast<size_t>(row * top_k + j)]; }
  float weight(int64_t row, int j) const { return weights[static_cast<size_t>(row * top_k + j)]; }
  static constexpr int32_t kUnusedSlot = -1;
};

// The three matrices of a SwiGLU expert, in the order HostExpertStore packs them:
// w1 (gate) [intermediate, hidden], w3 (up) [intermediate, hidden], w2 (down) [hidden, intermediate].
enum class ExpertMatrix : int { W1 = 0, W3 = 1, W2 = 2 };

class MoeLayer {
 public:
  // Loads the block whose tensors start with `prefix` (e.g. "model.layers.1.block_sparse_moe."
  // in a Mixtral checkpoint, "model.layers.1.mlp." in Qwen2-MoE, "" in an adapter file).
  // Mixtral (w1/w2/w3) and Qwen2-MoE (gate_proj/up_proj/down_proj) expert names are accepted.
  // Expert weights are uploaded once, in options.precision, to the backend of options.device,
  // and prepared for its GEMM (Backend::prepare_linear_weight; the CPU backend keeps a packed
  // copy, the experts' bytes again, f16 widened to f32); the router (and the shared-expert gate)
  // stay f32. Default: cpu, f32, weights used in place (read once, to pack them).
  static MoeLayer load(const MoeConfig& config, const Checkpoint& weights, const std::string& prefix,
                       const ComputeOptions& options = {});
  // One MoE layer out of a Hugging Face Mixtral/Qwen2-MoE checkpoint directory.
  static MoeLayer load_hf_layer(const std::string& checkpoint_dir, const std::string& prefix,
                                const ComputeOptions& options = {});

  const MoeConfig& config() const;
  // The backend it runs on ("cpu", "cuda:N") and the precision of its routed expert weights
  // (Q4 for 4-bit experts, whatever options.precision said).
  std::string device() const;
  kernels::WeightType precision() const;
  // Bytes of the routed experts' weights as the layer computes with them: 4-bit experts' packed
  // codes, scales and zero points, else num_experts · 3 matrices in precision().
  size_t expert_bytes() const;

  // Which rows of x are fused hybrid queries (MoeAdapter::fuse): one flag per row, or empty for
  // none. Every other row is single-modality and never routes to a joint expert
  // (MoeConfig::joint_experts): its logits for them are -inf, and it routes exactly (same ids,
  // same weights, bit for bit) as in a layer made of the first num_experts - joint_experts
  // experts and router rows. Fused rows route among all experts. No effect without joint experts.
  using FusedRows = std::vector<bool>;

  // Router logits [rows, num_experts] for x [rows, hidden] (f32); -inf where masked (FusedRows).
  Tensor router_logits(const Tensor& x, const FusedRows& fused = {}) const;
  Routing route(const Tensor& x, const FusedRows& fused = {}) const;
  // Routing with another number of experts per row than the config's top_k: 1..num_experts, and
  // at most num_experts - joint_experts when some row is single-modality.
  Routing route(const Tensor& x, int top_k, const FusedRows& fused = {}) const;
  // Σ_k w_k · expert_k(x) (+ gated shared expert): the block's output, [rows, hidden].
  Tensor run_experts(const Tensor& x, const Routing& routing) const;
  // Reference: the same sum computed row by row with plain loops in double over the host f32
  // weights (no backend, no grouping, no BLAS), whatever the layer's device and precision.
  Tensor run_experts_reference(const Tensor& x, const Routing& routing) const;

  // Read access to routed expert `e`'s weights (host f32, [out, in] row-major, as in the
  // checkpoint whatever the layer's precision), e.g. to pack them for a device
  // (HostExpertStore). Throws moe::Error when e is outside [0, num_experts).
  const Tensor& expert_weight(int e, ExpertMatrix which) const;
  // A layer with 4-bit experts (precision() Q4): routed expert e's matrix as the checkpoint packs
  // it (views into the mmap-ed file), e.g. to stage the packed bytes (HostExpertStore). Throws
  // moe::Error for other layers and when e is outside [0, num_experts).
  const PackedInt4Weight& packed_expert_weight(int e, ExpertMatrix which) const;
  // The same for the shared expert (Qwen2-MoE; [shared_expert_intermediate_size, hidden] for
  // w1/w3, the transpose for w2) and its gate [1, hidden]. Throw moe::Error without one.
  const Tensor& shared_expert_weight(ExpertMatrix which) const;
  const Tensor& shared_expert_gate() const;

  // Threads: every const member may be called from several threads at once; on a non-host
  // backend the calls take turns (backend_mutex), on the CPU backend they run concurrently.

  MoeLayer(MoeLayer&&) noexcept;
  MoeLayer& operator=(MoeLayer&&) noexcept;
  ~MoeLayer();

 private:
  MoeLayer();
  void check_input(const Tensor& x, const char* what) const;
  void check_routing(const Tensor& x, const Routing& routing) const;
  void check_fused(const Tensor& x, const FusedRows& fused, const char* what) const;
  friend class MoeAdapter;  // runs routing and experts in one call on the backend
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct AdapterOutput {
  Tensor embeddings;  // [rows, hidden], L2-normalised
  Routing routing;
};

// The lightweight adapter on a frozen encoder: y = normalize(x + MoE(x)).
class MoeAdapter {
 public:
  // A directory with adapter_config.json and adapter.safetensors.
  static MoeAdapter load(const std::string& dir, const ComputeOptions& options = {});
  // `fingerprint`: the Checkpoint::fingerprint() of the layer's weights (empty: unknown).
  explicit MoeAdapter(MoeLayer layer, std::string fingerprint = {});

  const MoeLayer& layer() const { return layer_; }
  // What the adapted embeddings were made by; load() takes it from adapter.safetensors.
  const std::string& fingerprint() const { return fingerprint_; }
  // The joint visual-text experts among the last ones (MoeConfig::joint_experts).
  int num_joint_experts() const { return layer_.config().joint_experts; }
  // `fused`: MoeLayer::FusedRows (empty: every row single-modality, joint experts masked).
  Routing route(const Tensor& x, const MoeLayer::FusedRows& fused = {}) const { return layer_.route(x, fused); }
  Routing route(const Tensor& x, int top_k, const MoeLayer::FusedRows& fused = {}) const {
    return layer_.route(x, top_k, fused);
  }
  // normalize(x + run_experts(x, routing)), all on the layer's backend.
  Tensor apply_experts(const Tensor& x, const Routing& routing) const;
  // route + apply_experts in one call on the backend (x uploaded once).
  AdapterOutput apply(const Tensor& x, const MoeLayer::FusedRows& fused = {}) const;

  // The cross-modal gate for hybrid (image + text) queries, after the seeds' CrossModalGate:
  // per row, w = softmax(W [image; text] + b) over two logits, and the fused vector
  // w_image · image + w_text · text is the adapter's input (route, apply). Stored in
  // adapter.safetensors as "cross_modal_gate.weight" [2, 2 · hidden] (columns: the image half,
  // then the text half) and "cross_modal_gate.bias" [2] (logit 0: image, 1: text), floating point
  // (f32 as tools/train writes it; f16/bf16 widened); load() refuses one without the other, other
  // shapes and integer dtypes, naming the tensor. Adapters without them load as before (same
  // weights, same fingerprint) and have none.
  bool has_cross_modal_gate() const { return gate_ != nullptr; }
  // `image` and `text`: f32 [rows, hidden] host embeddings of the same requests, as the encoder
  // gives them (projected, not normalised), row n of one paired with row n of the other.
  // Returns the fused [rows, hidden] and sets `weights` to [rows, 2] (w_image, w_text) when not
  // null. Without a gate: w = (0.5, 0.5), the plain average. On the layer's backend. Throws
  // moe::Error for other shapes or dtypes, or row counts that differ.
  Tensor fuse(const Tensor& image, const Tensor& text, Tensor* weights) const;

  // Threads: as MoeLayer.

  MoeAdapter(MoeAdapter&&) noexcept;
  MoeAdapter& operator=(MoeAdapter&&) noexcept;
  ~MoeAdapter();

 private:
  struct CrossModalGate;
  MoeLayer layer_;
  std::string fingerprint_;
  std::unique_ptr<const CrossModalGate> gate_;  // null: none
};

}  // namespace moe
