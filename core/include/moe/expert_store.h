// gst-moe: a MoE layer's routed experts in host memory, packed for copying to a device.
//
// Every expert is one contiguous blob  w1 | w3 | w2  (each [out, in] row-major, in the store's
// precision), so loading an expert onto a device is a single asynchronous copy into a cache slot
// (ExpertCache). The blobs live in the backend's staging memory (CUDA: page-locked), which is
// what makes Backend::copy_from_host_async truly asynchronous. Each matrix starts at a multiple
// of kMatrixAlignment bytes inside the blob (zero padding; none for the usual sizes), and all
// experts share one layout, so the same offsets apply to any slot holding any expert.
//
// Threads: immutable after construction; every const member may be called from any thread.
// Lifetime: the backend must outlive the store; the store must outlive every copy from it
// (ExpertCache waits for its copies before it is destroyed, so: store outlives cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "backend.h"
#include "moe/moe_layer.h"
#include "moe/tensor.h"

namespace moe {

class HostExpertStore {
 public:
  static constexpr size_t kMatrixAlignment = 256;

  // `matrix(e, which)` returns expert e's matrix (any float dtype: f32, f16 or bf16; shape
  // [intermediate, hidden] for w1/w3, [hidden, intermediate] for w2); it is converted to `type`.
  // Throws moe::Error naming the expert and matrix when a shape or dtype is wrong.
  using MatrixSource = std::function<Tensor(int expert, ExpertMatrix which)>;
  HostExpertStore(kernels::Backend& backend, kernels::WeightType type, int num_experts, int64_t hidden,
                  int64_t intermediate, const MatrixSource& matrix);
  // The routed experts of `layer` (its shared expert, if any, is not part of the store). Throws
  // moe::Error, saying why, for a layer with 4-bit experts (precision() Q4): they are not staged.
  static HostExpertStore from_layer(kernels::Backend& backend, const MoeLayer& layer, kernels::WeightType type);

  HostExpertStore(HostExpertStore&& other) noexcept;
  HostExpertStore& operator=(HostExpertStore&& other) noexcept;
  HostExpertStore(const HostExpertStore&) = delete;
  HostExpertStore& operator=(const HostExpertStore&) = delete;
  ~HostExpertStore();

  int num_experts() const { return num_experts_; }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  kernels::WeightType weight_type() const { return type_; }
  kernels::Backend& backend() const { return *backend_; }

  // Bytes of one expert's blob for these sizes: what max_expert_bytes() of such a store is, known
  // before the store is built (e.g. to plan placement in slots).
  static size_t blob_bytes(kernels::WeightType type, int64_t hidden, int64_t intermediate);

  // Bytes of expert e's blob (the same for every expert: one cache slot).
  size_t expert_bytes(int e) const;
  // Largest expert_bytes over all experts: the slot size a cache needs.
  size_t max_expert_bytes() const { return blob_bytes_; }
  // Expert e's blob in staging memory.
  const void* expert_data(int e) const;
  // Byte offsets of w1, w3, w2 inside a blob.
  size_t matrix_offset(ExpertMatrix which) const;

  // The three weights of the expert held by `slot` (a copy of some expert_data(e), in any
  // memory): pointers into the slot, typed with the store's precision.
  kernels::ExpertWeights weights_at(const void* slot) const;
  // Expert e's weights in the staging blob itself; usable directly by a backend whose memory is
  // host memory (Backend::is_host_memory()).
  kernels::ExpertWeights host_weights(int e) const { return weights_at(expert_data(e)); }

 private:
  void check_expert(int e, const char* what) const;
  void release();

  kernels::Backend* backend_ = nullptr;
  kernels::WeightType type_ = kernels::WeightType::F32;
  int num_experts_ = 0;
  int64_t hidden_ = 0, intermediate_ = 0;
  size_t offsets_[3] = {0, 0, 0};
  size_t blob_bytes_ = 0;          // one expert, padded to kMatrixAlignment
  unsigned char* data_ = nullptr;  // num_experts_ blobs back to back
};

}  // namespace moe
