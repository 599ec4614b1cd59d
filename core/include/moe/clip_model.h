// gst-moe: CLIP text and vision encoders, computing exactly what Hugging Face `CLIPModel`'s
// get_text_features / get_image_features compute (within 1e-4 in f32; see ComputeOptions for the
// device and the weights' precision). Every operation runs through the model's kernels::Backend;
// inputs and outputs are host tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe/clip_config.h"
#include "moe/compute.h"
#include "moe/image.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"
#include "moe/tokenizer.h"

namespace moe {

struct ClipEncodeResult {
  Tensor pooled;  // [B, hidden]: the tower's pooler output (before projection)
  Tensor embeds;  // [B, projection_dim]: projected, not normalised (as get_*_features)
};

class ClipModel {
 public:
  // Loads a Hugging Face CLIP directory: config.json, model.safetensors (or sharded), and when
  // present vocab.json + merges.txt (tokenizer) and preprocessor_config.json. The weights are
  // uploaded once, in options.precision, to the backend of options.device (default: cpu, f32,
  // where f32 checkpoint tensors are used in place from the mmap-ed file).
  static ClipModel load(const std::string& model_dir, const ComputeOptions& options = {});
  // Loads from a config and a checkpoint, without tokenizer (callers encode token ids).
  static ClipModel load(const ClipConfig& config, const Checkpoint& weights, const ComputeOptions& options = {});

  const ClipConfig& config() const;
  const std::string& model_dir() const;
  bool has_tokenizer() const;
  const ClipTokenizer& tokenizer() const;  // throws if the directory had none
  const ImagePreprocessConfig& image_preprocess() const;
  // The weights' Checkpoint::fingerprint(), taken at load: what the embeddings were made by.
  const std::string& fingerprint() const;
  // The backend it runs on ("cpu", "cuda:N") and the precision of its Linear weights.
  std::string device() const;
  kernels::WeightType precision() const;
  // Bytes of the weights it keeps in the backend's memory: device memory on CUDA; host memory on
  // the CPU, where the f32 weights of an f32 checkpoint are the mmap-ed file itself. Not counted:
  // the text tower's token and position embeddings, which stay in host memory on every backend,
  // the copies a backend keeps of prepared weights (the CPU's packed GEMM operands), and working
  // buffers.
  size_t weight_bytes() const;
  // The free and total memory of the device it runs on now (Backend::memory_info; the CPU
  // backend: the host's available and total RAM). Opens nothing: the model's own backend answers.
  kernels::MemoryInfo memory_info() const;

  // Text tower over already tokenised inputs. Each sequence is pooled at its end token (the
  // first eos_token_id, or the largest id for legacy configs with eos_token_id == 2, as
  // transformers does); tokens after it are ignored, which is exact under the causal mask.
  ClipEncodeResult encode_token_ids(const std::vector<std::vector<int32_t>>& ids) const;
  // Tokenise (max 77 tokens incl. start/end) and encode. Throws on invalid UTF-8.
  ClipEncodeResult encode_texts(const std::vector<std::string>& texts) const;

  // Vision tower over preprocessed pixels [B, channels, image_size, image_size] (f32).
  ClipEncodeResult encode_pixels(const Tensor& pixel_values) const;
  // Preprocess (as CLIPImageProcessor) and encode RGB8 images of any size.
  ClipEncodeResult encode_images(const std::vector<ImageView>& images) const;

  // Threads: every const member may be called from several threads at once; on a non-host
  // backend the calls take turns (backend_mutex), on the CPU backend they run concurrently.

  ClipModel(ClipModel&&) noexcept;
  ClipModel& operator=(ClipModel&&) noexcept;
  ~ClipModel();

 private:
  ClipModel();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
