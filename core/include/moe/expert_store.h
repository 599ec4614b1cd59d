// gst-moe: a MoE layer's routed experts in host memory, packed for copying to a device.
//
// Every expert is one contiguous blob, so loading an expert onto a device is a single
// asynchronous copy into a cache slot (ExpertCache):
//  - f32, f16, bf16:  w1 | w3 | w2  (each [out, in] row-major, in the store's precision);
//  - Q4 (4-bit experts, W4A16): per matrix, in the order w1, w3, w2, its packed codes, scales and
//    zero points (asymmetric only) exactly as the checkpoint stores them (moe/quantized_weights.h,
//    kernels::Q4Weight): the bytes the kernels read, ~7x fewer than f32, never widened.
// The blobs live in the backend's staging memory (CUDA: page-locked), which is what makes
// Backend::copy_from_host_async truly asynchronous. Each array starts at a multiple of
// kMatrixAlignment bytes inside the blob (zero padding), and all experts share one layout, so
// the same offsets apply to any slot holding any expert.
//
// Threads: immutable after construction; every const member may be called from any thread.
// Lifetime: the backend must outlive the store; the store must outlive every copy from it
// (ExpertCache waits for its copies before it is destroyed, so: store outlives cache).
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "backend.h"
#include "moe/moe_layer.h"
#include "moe/quantized_weights.h"
#include "moe/tensor.h"

namespace moe {

class HostExpertStore {
 public:
  static constexpr size_t kMatrixAlignment = 256;

  // `matrix(e, which)` returns expert e's matrix (any float dtype: f32, f16 or bf16; shape
  // [intermediate, hidden] for w1/w3, [hidden, intermediate] for w2); it is converted to `type`
  // (f32, f16 or bf16). Throws moe::Error naming the expert and matrix when a shape or dtype is
  // wrong.
  using MatrixSource = std::function<Tensor(int expert, ExpertMatrix which)>;
  HostExpertStore(kernels::Backend& backend, kernels::WeightType type, int num_experts, int64_t hidden,
                  int64_t intermediate, const MatrixSource& matrix);
  // 4-bit experts (weight_type() Q4): `packed(e, which)` returns expert e's matrix as the
  // checkpoint packs it, copied byte for byte. Every matrix must have the shape above, and the
  // group size, scale dtype and symmetry of the same matrix of expert 0 (one layout for all
  // slots); moe::Error otherwise.
  using PackedSource = std::function<const PackedInt4Weight&(int expert, ExpertMatrix which)>;
  HostExpertStore(kernels::Backend& backend, int num_experts, int64_t hidden, int64_t intermediate,
                  const PackedSource& packed);
  // The routed experts of `layer` (its shared expert, if any, is not part of the store). A layer
  // with 4-bit experts (precision() Q4) is staged as stored, packed, whatever `type` says; other
  // layers in `type`, which must then be f32, f16 or bf16.
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

  // Bytes of one expert's blob for these sizes in f32, f16 or bf16: what max_expert_bytes() of
  // such a store is, known before the store is built (e.g. to plan placement in slots).
  static size_t blob_bytes(kernels::WeightType type, int64_t hidden, int64_t intermediate);

  // Bytes of expert e's blob (the same for every expert: one cache slot).
  size_t expert_bytes(int e) const;
  // Largest expert_bytes over all experts: the slot size a cache needs.
  size_t max_expert_bytes() const { return blob_bytes_; }
  // Expert e's blob in staging memory.
  const void* expert_data(int e) const;
  // Byte offsets of w1, w3, w2 inside a blob (Q4: of the matrix's packed codes, its first array).
  size_t matrix_offset(ExpertMatrix which) const;

  // The three weights of the expert held by `slot` (a copy of some expert_data(e), in any
  // memory): pointers into the slot, typed with the store's precision. For 4-bit experts each
  // WeightRef points to a kernels::Q4Weight describing the arrays in the slot: `q4` receives the
  // three descriptors (w1, w3, w2) and must stay in place while the WeightRefs are used (required
  // then, ignored otherwise).
  kernels::ExpertWeights weights_at(const void* slot, std::array<kernels::Q4Weight, 3>* q4 = nullptr) const;
  // Expert e's weights in the staging blob itself; usable directly by a backend whose memory is
  // host memory (Backend::is_host_memory()). 4-bit descriptors are kept by the store.
  kernels::ExpertWeights host_weights(int e) const;

 private:
  // Where one array of a Q4 matrix sits in a blob: offset and bytes (0 bytes: absent).
  struct Q4Array {
    size_t offset = 0, bytes = 0;
  };
  struct Q4Matrix {
    Q4Array packed, scales, zero_points;
    kernels::WeightType scale_type = kernels::WeightType::F16;
    int32_t group_size = 0;
  };

  void check_expert(int e, const char* what) const;
  void release();
  void allocate(size_t total);

  kernels::Backend* backend_ = nullptr;
  kernels::WeightType type_ = kernels::WeightType::F32;
  int num_experts_ = 0;
  int64_t hidden_ = 0, intermediate_ = 0;
  size_t offsets_[3] = {0, 0, 0};
  size_t blob_bytes_ = 0;          // one expert, padded to kMatrixAlignment
  unsigned char* data_ = nullptr;  // num_experts_ blobs back to back
  // Q4 only: the layout of each matrix (w1, w3, w2), what every slot's descriptors share, and the
  // staging blobs' descriptors (host_weights).
  Q4Matrix q4_layout_[3];
  std::vector<std::array<kernels::Q4Weight, 3>> host_q4_;
};

}  // namespace moe
