#include "moe/expert_store.h"

#include <algorithm>
#include <cstring>
#include <iterator>
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
      break;  // refused by the constructor
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
  if (type == WeightType::Q4)
    throw Error("HostExpertStore: 4-bit experts are staged from their packed weights, not converted from floats");
  blob_bytes_ = blob_bytes(type, hidden, intermediate);
  const size_t stride = blob_bytes_ / 3;
  offsets_[0] = 0;
  offsets_[1] = stride;
  offsets_[2] = 2 * stride;
  allocate(blob_bytes_ * static_cast<size_t>(num_experts));
  try {
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

HostExpertStore::HostExpertStore(kernels::Backend& backend, int num_experts, int64_t hidden, int64_t intermediate,
                                 const PackedSource& packed)
    : backend_(&backend),
      type_(WeightType::Q4),
      num_experts_(num_experts),
      hidden_(hidden),
      intermediate_(intermediate) {
  if (num_experts <= 0 || hidden <= 0 || intermediate <= 0)
    throw Error("HostExpertStore: num_experts (" + std::to_string(num_experts) + "), hidden (" +
                std::to_string(hidden) + ") and intermediate (" + std::to_string(intermediate) + ") must be positive");
  // Expert 0 sets the layout; every other matrix must match it (below).
  size_t at = 0;
  auto place = [&at](size_t bytes) {
    const Q4Array a{bytes ? at : 0, bytes};
    at += round_up(bytes, kMatrixAlignment);
    return a;
  };
  for (ExpertMatrix which : {ExpertMatrix::W1, ExpertMatrix::W3, ExpertMatrix::W2}) {
    const PackedInt4Weight& w = packed(0, which);
    Q4Matrix& m = q4_layout_[static_cast<int>(which)];
    offsets_[static_cast<int>(which)] = at;
    m.packed = place(w.packed.nbytes());
    m.scales = place(w.scales.nbytes());
    m.zero_points = place(w.zero_points.nbytes());
    m.group_size = w.group_size;
    m.scale_type = w.scales.dtype() == DType::BF16 ? WeightType::BF16 : WeightType::F16;
  }
  blob_bytes_ = at;
  allocate(blob_bytes_ * static_cast<size_t>(num_experts));
  try {
    for (int e = 0; e < num_experts; ++e) {
      unsigned char* blob = data_ + blob_bytes_ * static_cast<size_t>(e);
      for (ExpertMatrix which : {ExpertMatrix::W1, ExpertMatrix::W3, ExpertMatrix::W2}) {
        const PackedInt4Weight& w = packed(e, which);
        const Q4Matrix& m = q4_layout_[static_cast<int>(which)];
        const Shape want = which == ExpertMatrix::W2 ? Shape{hidden, intermediate} : Shape{intermediate, hidden};
        const Shape got{w.out, w.in};
        const WeightType scale_type = w.scales.dtype() == DType::BF16 ? WeightType::BF16 : WeightType::F16;
        if (got != want || w.group_size != m.group_size || scale_type != m.scale_type ||
            w.packed.nbytes() != m.packed.bytes || w.scales.nbytes() != m.scales.bytes ||
            w.zero_points.nbytes() != m.zero_points.bytes)
          throw Error("HostExpertStore: 4-bit expert " + std::to_string(e) + " " + matrix_name(which) + " is " +
                      shape_to_string(got) + " in groups of " + std::to_string(w.group_size) + " with " +
                      kernels::weight_type_name(scale_type) + " scales" + (w.symmetric() ? "" : " and zero points") +
                      "; every expert must match expert 0's layout: " + shape_to_string(want) + " in groups of " +
                      std::to_string(m.group_size) + " with " + kernels::weight_type_name(m.scale_type) + " scales" +
                      (m.zero_points.bytes ? " and zero points" : ""));
        std::memcpy(blob + m.packed.offset, w.packed.raw_data(), m.packed.bytes);
        std::memcpy(blob + m.scales.offset, w.scales.raw_data(), m.scales.bytes);
        if (m.zero_points.bytes)
          std::memcpy(blob + m.zero_points.offset, w.zero_points.raw_data(), m.zero_points.bytes);
      }
    }
    host_q4_.resize(static_cast<size_t>(num_experts));
    for (int e = 0; e < num_experts; ++e) weights_at(expert_data(e), &host_q4_[static_cast<size_t>(e)]);
  } catch (...) {
    release();
    throw;
  }
}

void HostExpertStore::allocate(size_t total) {
  data_ = static_cast<unsigned char*>(backend_->allocate_host_staging(total));
  if (!data_)
    throw Error("HostExpertStore: " + backend_->name() + " returned no staging memory for " + std::to_string(total) +
                " bytes");
  std::memset(data_, 0, total);  // the alignment padding stays zero
}

size_t HostExpertStore::blob_bytes(WeightType type, int64_t hidden, int64_t intermediate) {
  const size_t matrix_bytes =
      static_cast<size_t>(hidden) * static_cast<size_t>(intermediate) * kernels::weight_type_size(type);
  return 3 * round_up(matrix_bytes, kMatrixAlignment);  // w1 | w3 | w2, each padded
}

HostExpertStore HostExpertStore::from_layer(kernels::Backend& backend, const MoeLayer& layer, WeightType type) {
  const MoeConfig& c = layer.config();
  if (layer.precision() == WeightType::Q4)
    return HostExpertStore(backend, c.num_experts, c.hidden_size, c.intermediate_size,
                           [&layer](int e, ExpertMatrix which) -> const PackedInt4Weight& {
                             return layer.packed_expert_weight(e, which);
                           });
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
    std::copy(std::begin(o.q4_layout_), std::end(o.q4_layout_), std::begin(q4_layout_));
    host_q4_ = std::move(o.host_q4_);  // the descriptors stay where they are: they point into data_
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

kernels::ExpertWeights HostExpertStore::weights_at(const void* slot, std::array<kernels::Q4Weight, 3>* q4) const {
  if (!slot) throw Error("HostExpertStore::weights_at: null slot");
  const auto* base = static_cast<const unsigned char*>(slot);
  kernels::ExpertWeights w;
  if (type_ != WeightType::Q4) {
    w.w1 = {base + offsets_[0], type_};
    w.w3 = {base + offsets_[1], type_};
    w.w2 = {base + offsets_[2], type_};
    return w;
  }
  if (!q4) throw Error("HostExpertStore::weights_at: 4-bit experts need room for their three descriptors");
  for (int i = 0; i < 3; ++i) {
    const Q4Matrix& m = q4_layout_[i];
    kernels::Q4Weight& d = (*q4)[static_cast<size_t>(i)];
    d.packed = reinterpret_cast<const int32_t*>(base + m.packed.offset);
    d.scales = base + m.scales.offset;
    d.zero_points = m.zero_points.bytes ? reinterpret_cast<const int32_t*>(base + m.zero_points.offset) : nullptr;
    d.scale_type = m.scale_type;
    d.group_size = m.group_size;
  }
  w.w1 = {&(*q4)[0], WeightType::Q4};
  w.w3 = {&(*q4)[1], WeightType::Q4};
  w.w2 = {&(*q4)[2], WeightType::Q4};
  return w;
}

kernels::ExpertWeights HostExpertStore::host_weights(int e) const {
  if (type_ != WeightType::Q4) return weights_at(expert_data(e));
  check_expert(e, "host_weights");
  const std::array<kernels::Q4Weight, 3>& q = host_q4_[static_cast<size_t>(e)];
  return {{&q[0], WeightType::Q4}, {&q[1], WeightType::Q4}, {&q[2], WeightType::Q4}};
}

}  // namespace moe
