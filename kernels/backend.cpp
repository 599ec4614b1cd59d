#include "backend.h"

#include <iterator>

#include "moe/error.h"

namespace moe::kernels {

size_t weight_type_size(WeightType type) {
  switch (type) {
    case WeightType::F32:
      return 4;
    case WeightType::F16:
      return 2;
    case WeightType::BF16:
      return 2;
    case WeightType::Q4:
      throw Error("weight type q4 has no size per element (4 bits plus its group's scale)");
  }
  throw Error("unknown weight type " + std::to_string(static_cast<int>(type)));
}

const char* weight_type_name(WeightType type) {
  switch (type) {
    case WeightType::F32:
      return "f32";
    case WeightType::F16:
      return "f16";
    case WeightType::BF16:
      return "bf16";
    case WeightType::Q4:
      return "q4";
  }
  return "unknown";
}

namespace {

// What an OpDesc holds for each operation (backend.h lists the sizes).
struct OpShape {
  const char* name;
  const char* sizes;  // their names, in OpDesc order
  size_t size_count;
  enum { kNoWeights, kOneWeight, kAnyWeights } weights;
};

// Indexed by Op.
constexpr OpShape kOpShapes[] = {
    {"linear", "m, n, k", 3, OpShape::kOneWeight},
    {"layer_norm", "rows, cols", 2, OpShape::kNoWeights},
    {"gelu", "n", 1, OpShape::kNoWeights},
    {"quick_gelu", "n", 1, OpShape::kNoWeights},
    {"silu_mul", "n", 1, OpShape::kNoWeights},
    {"add", "n", 1, OpShape::kNoWeights},
    {"attention", "rows, longest sequence, heads, head_dim", 4, OpShape::kNoWeights},
    {"l2_normalize_rows", "rows, cols", 2, OpShape::kNoWeights},
    {"topk_softmax", "rows, experts, top_k", 3, OpShape::kNoWeights},
    {"moe_permute", "rows, top_k, experts, cols", 4, OpShape::kNoWeights},
    {"grouped_swiglu", "rows, experts, d, inter", 4, OpShape::kAnyWeights},
    {"moe_unpermute", "rows, top_k, cols", 3, OpShape::kNoWeights},
    {"inner_product_topk", "nq, nb, d, k", 4, OpShape::kNoWeights},
};
static_assert(std::size(kOpShapes) == kOpCount, "one OpShape per Op");

const OpShape* shape_of(Op op) {
  const auto i = static_cast<size_t>(op);
  return i < std::size(kOpShapes) ? &kOpShapes[i] : nullptr;
}

bool known(WeightType type) {
  switch (type) {
    case WeightType::F32:
    case WeightType::F16:
    case WeightType::BF16:
    case WeightType::Q4:
      return true;
  }
  return false;
}

}  // namespace

const char* op_name(Op op) {
  const OpShape* shape = shape_of(op);
  return shape ? shape->name : "unknown";
}

bool Backend::supports(const OpDesc& op, std::string* why) const {
  const OpShape* shape = shape_of(op.op);
  if (!shape) throw Error(name() + ": supports: unknown operation " + std::to_string(static_cast<int>(op.op)));
  const std::string what = name() + ": supports: " + shape->name + ": ";
  if (op.sizes.size() != shape->size_count)
    throw Error(what + std::to_string(op.sizes.size()) + " sizes, want " + std::to_string(shape->size_count) + " (" +
                shape->sizes + ")");
  const size_t types = op.weight_types.size();
  if ((shape->weights == OpShape::kNoWeights && types != 0) || (shape->weights == OpShape::kOneWeight && types != 1))
    throw Error(what + std::to_string(types) + " weight types, want " +
                (shape->weights == OpShape::kOneWeight ? "1" : "none"));
  for (WeightType type : op.weight_types)
    if (!known(type)) throw Error(what + "unknown weight type " + std::to_string(static_cast<int>(type)));
  std::string reason = why_unsupported(op);
  if (reason.empty()) return true;
  if (why) *why = std::move(reason);
  return false;
}

std::string Backend::why_unsupported(const OpDesc&) const { return {}; }

}  // namespace moe::kernels
