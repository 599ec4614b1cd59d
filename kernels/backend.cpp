#include "backend.h"

#include "moe/error.h"

namespace moe::kernels {

size_t weight_type_size(WeightType type) {
  switch (type) {
    case WeightType::F32: return 4;
    case WeightType::F16: return 2;
    case WeightType::BF16: return 2;
  }
  throw Error("unknown weight type " + std::to_string(static_cast<int>(type)));
}

const char* weight_type_name(WeightType type) {
  switch (type) {
    case WeightType::F32: return "f32";
    case WeightType::F16: return "f16";
    case WeightType::BF16: return "bf16";
  }
  return "unknown";
}

}  // namespace moe::kernels
