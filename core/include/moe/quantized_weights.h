// gst-moe: group-wise 4-bit Linear weights (W4A16) as compressed-tensors writes them.
//
// The "pack-quantized" format of compressed-tensors (what llmcompressor writes and vLLM serves;
// docs/model-formats.md): a quantised Linear `<module>` is stored as
//   <module>.weight_packed      I32 [out, in/8]   eight 4-bit codes per word, column c in bits 4·(c%8)
//   <module>.weight_scale       F16|BF16 [out, in/group_size]
//   <module>.weight_zero_point  I32 [ceil(out/8), in/group_size], packed along the rows (asymmetric only)
//   <module>.weight_shape       I64|I32 [2] = {out, in}
// with codes and zero points stored plus 8 (0..15), and config.json's `quantization_config` saying
// which scheme made them. The tensors are used as published: views into the mmap-ed file, no
// conversion; kernels::Q4Weight describes the same layout to the backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"

namespace moe {

// A config.json `quantization_config` of W4A16 pack-quantized weights.
struct Int4QuantConfig {
  std::vector<int> group_sizes;     // one per config group (all 4-bit int, "group" strategy)
  std::vector<std::string> ignore;  // module names and "re:" patterns left unquantised, as written
  std::string source;               // the config.json, for messages

  // nullopt when config.json has no `quantization_config`. Throws moe::Error, naming the file and
  // the field, for any other scheme: quant_method other than "compressed-tensors", a format other
  // than "pack-quantized", weights not 4-bit "int" in "group" strategy, dynamic weights,
  // quantised activations (W4A8 and the like), or a group size that is not a positive multiple of 8.
  static std::optional<Int4QuantConfig> from_hf_config(const std::string& path);
};

// One Linear weight [out, in] as the package packed it (views into the checkpoint).
struct PackedInt4Weight {
  Tensor packed;       // I32 [out, in/8]
  Tensor scales;       // F16 or BF16 [out, in/group_size]
  Tensor zero_points;  // I32 [ceil(out/8), in/group_size]; empty (numel 0) when symmetric
  int64_t out = 0, in = 0;
  int group_size = 0;

  bool symmetric() const { return zero_points.numel() == 0; }
  // Bytes of the packed codes, scales and zero points.
  size_t nbytes() const;
  // The layout for a backend, over these tensors' memory (host views here: upload the three
  // arrays for another backend and point a copy of the descriptor at them).
  kernels::Q4Weight ref() const;
  // Host f32 [out, in]: w = float(q - z) · scale rounded to the scale's dtype, then widened —
  // bit for bit what the package's dequantize() returns (in the scale's dtype).
  Tensor dequantize() const;
};

// The 16 values the codes 0..15 of one group stand for: float(code - zero) · scale, rounded to
// the scale's type (bf16 when `bf16`, else f16) as the package computes it, widened to f32.
// `scale_bits` is the scale as stored, `zero` the zero point as stored (8 when symmetric). The
// reference for the kernels' vector versions (kernels/cpu/cpu_int4.h).
void int4_group_values(uint16_t scale_bits, bool bf16, int zero, float values[16]);

// Whether `module` ("model.layers.0.block_sparse_moe.experts.3.w1", no ".weight") is stored
// packed, i.e. the checkpoint holds "<module>.weight_packed".
bool is_packed_int4(const Checkpoint& weights, const std::string& module);

// Reads `module`'s packed weight and checks it against `expected` = {out, in}: dtypes and shapes
// of the four tensors, weight_shape's values, in a multiple of 8 and of the group size, the group
// size a multiple of 8. A weight_g_idx (activation reordering) is accepted only when it is the
// identity order (group of column c = c / group_size) or unset (all -1). Errors name the file and
// the tensor.
PackedInt4Weight load_packed_int4(const Checkpoint& weights, const std::string& module, const Shape& expected);

}  // namespace moe
