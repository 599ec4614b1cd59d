// gst-moe: a minimal tensor: dtype, shape, contiguous storage, placement.
//
// A Tensor never owns raw memory directly: it holds a shared owner (an mmap-ed file, a host
// allocation, a device allocation) so views into a model file cost no copy and keep the
// mapping alive for as long as any view exists.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

enum class DType : uint8_t {
  F32,
  F16,
  BF16,
  I64,
  I32,
  I8,
  U8,
  I4,  // packed signed int4, two per byte, low nibble first
};

using Shape = std::vector<int64_t>;

const char* dtype_name(DType dtype);
// Bytes needed for `numel` elements (int4 rounds up to whole bytes).
size_t dtype_storage_bytes(DType dtype, int64_t numel);
int64_t shape_numel(const Shape& shape);
std::string shape_to_string(const Shape& shape);

enum class DeviceKind : uint8_t { Host, Cuda };

struct Placement {
  DeviceKind kind = DeviceKind::Host;
  int index = 0;
  bool operator==(const Placement& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  std::string to_string() const;
};

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct DTypeOf<int8_t> {
  static constexpr DType value = DType::I8;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::U8;
};

class Tensor {
 public:
  Tensor() = default;

  // A new zero-filled host tensor (64-byte aligned).
  static Tensor zeros(DType dtype, Shape shape);
  // A view over memory kept alive by `owner`. The caller guarantees `data` holds
  // dtype_storage_bytes(dtype, numel(shape)) bytes in `placement`'s memory.
  static Tensor view(DType dtype, Shape shape, void* data, std::shared_ptr<const void> owner, Placement placement = {});
  // Copies host data into a new host tensor.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, Shape shape) {
    Tensor t = zeros(DTypeOf<T>::value, std::move(shape));
    t.check_numel(values.size());
    std::copy(values.begin(), values.end(), t.data<T>());
    return t;
  }

  bool defined() const { return data_ != nullptr || numel() == 0; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  // Negative indices count from the end.
  int64_t dim(int64_t i) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return dtype_storage_bytes(dtype_, numel()); }
  const Placement& placement() const { return placement_; }
  bool is_host() const { return placement_.kind == DeviceKind::Host; }

  void* raw_data() { return data_; }
  const void* raw_data() const { return data_; }
  // Typed access; throws if T does not match the dtype or the tensor is not on the host.
  template <typename T>
  T* data() {
    check_access(DTypeOf<T>::value);
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* data() const {
    check_access(DTypeOf<T>::value);
    return static_cast<const T*>(data_);
  }

  // Same storage, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along the first dimension, as a view.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A host f32 tensor with the same values: a view when already f32, else a converted copy.
  Tensor to_f32() const;
  // A deep host copy.
  Tensor clone() const;

  // "f16[2,3]@host" — for messages.
  std::string describe() const;

 private:
  void check_access(DType want) const;
  void check_numel(size_t n) const;

  DType dtype_ = DType::F32;
  Shape shape_;
  void* data_ = nullptr;
  std::shared_ptr<const void> owner_;
  Placement placement_;
};

// Element conversions used by to_f32 and by the kernels.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace moe
