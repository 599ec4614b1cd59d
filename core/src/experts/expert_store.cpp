#include "moe/expert_store.h"

#include <cstring>
#include <string>
#include <utility>

#include "runtime/compute_util.h"
#include "moe/error.h"

namespace moe {

namespace {

using kernels::WeightType;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

const char* matrix_name(ExpertMatrix which) {
  switch (which) {
    case ExpertMatrix::W1:
      return "w1";
    case ExpertMatrix::W3:
      return "w3";
    case ExpertMatrix::W2:
      return "w2";
  }
  return "?";
}

// Writes `src` (host f32, `n` values) into `dst` in `type`.
void convert_into(const float* src, int64_t n, WeightType type, unsigned char* dst) {
  switch (type) {
    case WeightType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case WeightType::F16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = float_to_half(src[i]);
        std::memcpy(dst + i * 2, &h, 2);
      }
      return;
    case WeightType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = float_to_bf16(src[i]);
        std::memcpy(dst + i * 2, &b, 2);
      }
      return;
    case WeightType::Q4:
      throw Error("HostExpertStore: stages f32, f16 or bf16 experts, not 4-bit ones");
  }
  throw Error("HostExpertStore: unknown weight type");
}

}  // namespace

HostExpertStore::HostExpertStore(kernels::Backend& backend, WeightType type, int num_experts, int64_t hidden,
                                 int64_t intermediate, const MatrixSource& matrix)
    : backend_(&backend), type_(type), num_experts_(num_experts), hidden_(hidden), intermediate_(intermediate) {
  if (num_experts <= 0 || hidden <= 0 || intermediate <= 0)
    throw Error("HostExpertStore: num_experts (" + std::to_string(num_experts) + "), hidden (" +
                std::to_string(hidden) + ") and intermediate (" + std::to_string(intermediate) + ") must be positive");
  blob_bytes_ = blob_bytes(type, hidden, intermediate);
  const size_t stride = blob_bytes_ / 3;
  offsets_[0] = 0;
  offsets_[1] = stride;
  offsets_[2] = 2 * stride;
  const size_t total = blob_bytes_ * static_cast<size_t>(num_experts);
  data_ = static_cast<unsigned char*>(backend.allocate_host_staging(total));
  if (!data_)
    throw Error("HostExpertStore: " + backend.name() + " returned no staging memory for " + std::to_string(total) +
                " bytes");
  try {
    std::memset(data_, 0, total);  // the alignment padding stays zero
    for (int e = 0; e < num_experts; ++e) {
      for (ExpertMatrix which : {ExpertMatrix::W1, ExpertMatrix::W3, ExpertMatrix::W2}) {
        const Shape want = which == ExpertMatrix::W2 ? Shape{hidden, intermediate} : Shape{intermediate, hidden};
        const Tensor t = matrix(e, which);
        const DType dt = t.dtype();
        if (!t.defined() || !t.is_host() || (dt != DType::F32 && dt != DType::F16 && dt != DType::BF16) ||
            t.shape() != want)
          throw Error("HostExpertStore: expert " + std::to_string(e) + " " + matrix_name(which) + " is " +
                      t.describe() + ", expected a float tensor " + shape_to_string(want) + "@host");
        const Tensor f = t.to_f32();
        convert_into(f.data<float>(), f.numel(), type,
                     data_ + blob_bytes_ * static_cast<size_t>(e) + offsets_[static_cast<int>(which)]);
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

size_t HostExpertStore::blob_bytes(WeightType type, int64_t hidden, int64_t intermediate) {
  const size_t matrix_bytes =
      static_cast<size_t>(hidden) * static_cast<size_t>(intermediate) * kernels::weight_type_size(type);
  return 3 * round_up(matrix_bytes, kMatrixAlignment);  // w1 | w3 | w2, each padded
}

HostExpertStore HostExpertStore::from_layer(kernels::Backend& backend, const MoeLayer& layer, WeightType type) {
  const MoeConfig& c = layer.config();
  // Staging the packed bytes would need a 4-bit grouped kernel on every device the executor
  // serves; widening them instead would silently give up the 4-bit memory saving.
  if (layer.precision() == WeightType::Q4)
    throw Error("the experts of '" + c.source +
                "' are 4-bit (W4A16 pack-quantized): the expert executor stages f32, f16 or bf16 experts only; "
                "run them on the CPU in place (MoeLayer on the CPU backend; moe-expert device=cpu precision=fp32)");
  return HostExpertStore(backend, type, c.num_experts, c.hidden_size, c.intermediate_size,
                         [&layer](int e, ExpertMatrix which) { return layer.expert_weight(e, which); });
}

HostExpertStore::HostExpertStore(HostExpertStore&& o) noexcept { *this = std::move(o); }

HostExpertStore& HostExpertStore::operator=(HostExpertStore&& o) noexcept {
  if (this != &o) {
    release();
    backend_ = o.backend_;
    type_ = o.type_;
    num_experts_ = o.num_experts_;
    hidden_ = o.hidden_;
    intermediate_ = o.intermediate_;
    std::memcpy(offsets_, o.offsets_, sizeof offsets_);
    blob_bytes_ = o.blob_bytes_;
    data_ = std::exchange(o.data_, nullptr);
    o.num_experts_ = 0;
  }
  return *this;
}

HostExpertStore::~HostExpertStore() { release(); }

void HostExpertStore::release() {
  if (data_) detail::free_host_staging_noexcept(*backend_, data_);
  data_ = nullptr;
}

void HostExpertStore::check_expert(int e, const char* what) const {
  if (e < 0 || e >= num_experts_)
    throw Error(std::string("HostExpertStore::") + what + ": expert " + std::to_string(e) + " outside [0, " +
                std::to_string(num_experts_) + ")");
}

size_t HostExpertStore::expert_bytes(int e) const {
  check_expert(e, "expert_bytes");
  return blob_bytes_;
}

const void* HostExpertStore::expert_data(int e) const {
  check_expert(e, "expert_data");
  return data_ + blob_bytes_ * static_cast<size_t>(e);
}

size_t HostExpertStore::matrix_offset(ExpertMatrix which) const { return offsets_[static_cast<int>(which)]; }

kernels::ExpertWeights HostExpertStore::weights_at(const void* slot) const {
  if (!slot) throw Error("HostExpertStore::weights_at: null slot");
  const auto* base = static_cast<const unsigned char*>(slot);
  kernels::ExpertWeights w;
  w.w1 = {base + offsets_[0], type_};
  w.w3 = {base + offsets_[1], type_};
  w.w2 = {base + offsets_[2], type_};
  return w;
}

}  // namespace moe
