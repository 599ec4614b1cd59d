#include "moe/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "moe/error.h"

namespace moe {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    case DType::I64:
      return "i64";
    case DType::I32:
      return "i32";
    case DType::I8:
      return "i8";
    case DType::U8:
      return "u8";
    case DType::I4:
      return "i4";
  }
  return "?";
}

size_t dtype_storage_bytes(DType dtype, int64_t numel) {
  const size_t n = static_cast<size_t>(numel);
  switch (dtype) {
    case DType::F32:
    case DType::I32:
      return n * 4;
    case DType::I64:
      return n * 8;
    case DType::F16:
    case DType::BF16:
      return n * 2;
    case DType::I8:
    case DType::U8:
      return n;
    case DType::I4:
      return (n + 1) / 2;
  }
  return 0;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(const Shape& shape) {
  std::ostringstream ss;
  ss << '[';
  for (size_t i = 0; i < shape.size(); ++i) ss << (i ? "," : "") << shape[i];
  ss << ']';
  return ss.str();
}

std::string Placement::to_string() const { return kind == DeviceKind::Host ? "host" : "cuda:" + std::to_string(index); }

namespace {
struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
}  // namespace

Tensor Tensor::zeros(DType dtype, Shape shape) {
  for (int64_t d : shape)
    if (d < 0) throw Error("Tensor::zeros: negative dimension in " + shape_to_string(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  const size_t bytes = std::max<size_t>(64, (t.nbytes() + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw Error("Tensor::zeros: out of memory allocating " + std::to_string(bytes) + " bytes");
  std::memset(p, 0, bytes);
  std::shared_ptr<void> owner(p, AlignedFree());
  t.data_ = p;
  t.owner_ = std::move(owner);
  return t;
}

Tensor Tensor::view(DType dtype, Shape shape, void* data, std::shared_ptr<const void> owner, Placement placement) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.data_ = data;
  t.owner_ = std::move(owner);
  t.placement_ = placement;
  return t;
}

int64_t Tensor::dim(int64_t i) const {
  const int64_t r = rank();
  if (i < 0) i += r;
  if (i < 0 || i >= r) throw Error("Tensor::dim: index out of range for " + describe());
  return shape_[static_cast<size_t>(i)];
}

void Tensor::check_access(DType want) const {
  if (want != dtype_) throw Error(std::string("tensor access as ") + dtype_name(want) + " but tensor is " + describe());
  if (!is_host()) throw Error("host access to device tensor " + describe());
}

void Tensor::check_numel(size_t n) const {
  if (static_cast<int64_t>(n) != numel())
    throw Error("tensor of shape " + shape_to_string(shape_) + " cannot hold " + std::to_string(n) + " values");
}

Tensor Tensor::reshape(Shape shape) const {
  if (shape_numel(shape) != numel()) throw Error("cannot reshape " + describe() + " to " + shape_to_string(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  if (rank() < 1 || begin < 0 || end < begin || end > shape_[0])
    throw Error("slice_rows [" + std::to_string(begin) + "," + std::to_string(end) + ") out of range for " +
                describe());
  if (dtype_ == DType::I4) throw Error("slice_rows of packed int4 tensor " + describe());
  Tensor t = *this;
  const int64_t row_elems = rank() > 1 ? shape_numel(Shape(shape_.begin() + 1, shape_.end())) : 1;
  t.data_ = static_cast<char*>(data_) + dtype_storage_bytes(dtype_, begin * row_elems);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::to_f32() const {
  if (!is_host()) throw Error("to_f32 needs a host tensor, got " + describe());
  if (dtype_ == DType::F32) return *this;
  Tensor out = zeros(DType::F32, shape_);
  float* dst = out.data<float>();
  const int64_t n = numel();
  switch (dtype_) {
    case DType::F16: {
      const auto* src = static_cast<const uint16_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
      break;
    }
    case DType::BF16: {
      const auto* src = static_cast<const uint16_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
      break;
    }
    case DType::I64: {
      const auto* src = static_cast<const int64_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::I32: {
      const auto* src = static_cast<const int32_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::I8: {
      const auto* src = static_cast<const int8_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      break;
    }
    case DType::U8: {
      const auto* src = static_cast<const uint8_t*>(data_);
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      break;
    }
    case DType::I4: {
      const auto* src = static_cast<const uint8_t*>(data_);
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t byte = src[i / 2];
        const int nibble = (i % 2 == 0) ? (byte & 0xF) : (byte >> 4);
        dst[i] = static_cast<float>(nibble >= 8 ? nibble - 16 : nibble);
      }
      break;
    }
    case DType::F32:
      break;
  }
  return out;
}

Tensor Tensor::clone() const {
  if (!is_host()) throw Error("clone needs a host tensor, got " + describe());
  Tensor out = zeros(dtype_, shape_);
  if (nbytes()) std::memcpy(out.data_, data_, nbytes());
  return out;
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_to_string(shape_) + "@" + placement_.to_string();
}

// IEEE binary16 <-> binary32, exact for every half value; float->half rounds to nearest even.
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7FFFFFFF;
  if (abs >= 0x7F800000) return sign | (abs > 0x7F800000 ? 0x7E00 : 0x7C00);
  if (abs >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000) {                       // below smallest normal half: subnormal
    const uint32_t shift = 113 - (abs >> 23);
    // Below 2^-25 everything rounds to zero (and shifting by shift + 13 >= 32 would be undefined).
    if (shift > 11) return sign;
    const uint32_t mant = (abs & 0x7FFFFF) | 0x800000;
    uint32_t h = mant >> (shift + 13);
    const uint32_t rem = mant & ((1u << (shift + 13)) - 1);
    const uint32_t half = 1u << (shift + 12);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  const uint32_t rounding = 0x7FFF + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

}  // namespace moe
