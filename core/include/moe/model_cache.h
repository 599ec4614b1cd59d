// gst-moe: process-wide sharing of loaded models.
//
// Several elements (or pipelines) in one process often name the same model directory: the
// index-build and query pipelines both load the CLIP model, moe-route and moe-expert both load
// the adapter. Models are immutable after load, so one instance can serve them all. The cache
// holds weak references: a model is freed when its last user lets go.
#pragma once

#include <memory>
#include <string>

#include "moe/clip_model.h"
#include "moe/compute.h"
#include "moe/moe_layer.h"

namespace moe {

// The model loaded from `dir` with `options`, shared with every other caller that names the same
// directory (compared after resolving symlinks and relative paths), the same device (after
// resolving "auto" and "cuda": "auto" shares with "cpu" when it means cpu) and the same precision.
// Throws moe::Error like load().
std::shared_ptr<const ClipModel> shared_clip_model(const std::string& dir, const ComputeOptions& options);
std::shared_ptr<const MoeAdapter> shared_moe_adapter(const std::string& dir, const ComputeOptions& options);

// The same on the CPU in f32.
std::shared_ptr<const ClipModel> shared_clip_model(const std::string& dir);
std::shared_ptr<const MoeAdapter> shared_moe_adapter(const std::string& dir);

}  // namespace moe
