// gst-moe: safetensors reader (single files and Hugging Face sharded checkpoints).
//
// The file is mmap-ed and every tensor is a zero-copy view into the mapping. The header is
// validated completely before any tensor is handed out: no key repeated, no NUL in a string,
// dtype known, shape non-negative, byte range inside the data section, byte count equal to
// numel * element size, and the tensors covering the data section exactly (no gap, no overlap),
// as the format's reference implementation requires. Every error names the file, the tensor and
// the reason.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "moe/tensor.h"

namespace moe {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Largest header accepted (the format's reference implementation uses the same bound).
  static constexpr uint64_t kMaxHeaderBytes = 100u * 1024u * 1024u;

  static SafetensorsFile open(const std::string& path);
  // Parses an in-memory image. `owner` keeps `data` alive; `name` is used in error messages.
  // This is the fuzzing entry point: it must reject, never crash on, any byte string.
  static SafetensorsFile parse(const uint8_t* data, size_t size, std::shared_ptr<const void> owner, std::string name);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;
  // The tensor's bytes as stored, info(name).end - begin of them (no alignment copy, unlike get).
  const uint8_t* bytes(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<const void> owner_;
  const uint8_t* data_section_ = nullptr;
  std::map<std::string, std::string> metadata_;
  std::unordered_map<std::string, TensorInfo> index_;
};

// A model's weights: one safetensors file, or the shards listed by a
// `model.safetensors.index.json` (Hugging Face layout). Shards are opened on first use.
class Checkpoint {
 public:
  // `path` may be a .safetensors file, an index .json file, or a directory holding
  // model.safetensors or model.safetensors.index.json.
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  // The file that holds `name` (for messages).
  std::string file_of(const std::string& name) const;
  Tensor get(const std::string& name) const;
  // The tensor as host f32, after checking its shape; the error names file, tensor, both shapes.
  Tensor get_f32(const std::string& name, const Shape& expected) const;

  // What the weights are, as 16 hex digits (a 64-bit FNV-1a hash), so that vectors made by a
  // model can be matched to it later (an ANN index records the models that built it). Hashed,
  // tensor by tensor in name order: the name, dtype, shape and a sample of the bytes (all of a
  // tensor up to kFingerprintSampleBytes, else that many bytes in three slices at its start,
  // middle and end), so a large model is not read in full. It depends on the weights only: not
  // on the path, the shard layout, the byte offsets or the __metadata__. A retrained model differs
  // in every sample; an edit confined to bytes outside the samples is not seen. Opens every shard.
  static constexpr size_t kFingerprintSampleBytes = 12 * 1024;
  std::string fingerprint() const;

 private:
  struct Shard;
  // The opened shard holding `name`; throws naming the tensor when it is in neither map nor shard.
  const SafetensorsFile& shard_of(const std::string& name) const;

  std::string path_;
  std::vector<std::shared_ptr<Shard>> shards_;
  std::unordered_map<std::string, size_t> weight_map_;  // tensor -> shard
};

}  // namespace moe
