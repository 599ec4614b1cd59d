// Engine-internal helpers for models that compute through a kernels::Backend: the backend a
// model runs on, weights in backend memory, and one call's working buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/compute.h"
#include "moe/tensor.h"

namespace moe::detail {

DType dtype_of(kernels::WeightType type);

// Destructors release backend resources (memory, staging, waits on copies) through these. After a
// CUDA fault every later CUDA call returns the same sticky error, and at process exit the runtime
// may be gone: a release that throws out of a destructor calls std::terminate, which hides the
// error being reported and loses the test report. Instead the first failure in the process is
// logged (a GLib message in the "moe" domain: not a warning, which test harnesses make fatal) and
// the resource is leaked. try_release returns whether `release` completed.
bool try_release(const std::string& what, const std::function<void()>& release) noexcept;
void deallocate_noexcept(kernels::Backend& backend, void* ptr) noexcept;
void free_host_staging_noexcept(kernels::Backend& backend, void* ptr) noexcept;

// A lock on `mutex` (a backend's, from backend_mutex), or no lock when it is null (host-memory
// backends need none).
inline std::unique_lock<std::mutex> lock_if(const std::shared_ptr<std::mutex>& mutex) {
  return mutex ? std::unique_lock<std::mutex>(*mutex) : std::unique_lock<std::mutex>();
}

// The backend a model runs on, with the mutex its calls hold (null for host-memory backends).
struct ModelBackend {
  std::shared_ptr<kernels::Backend> backend;
  std::shared_ptr<std::mutex> mutex;
  Placement placement;  // where tensors in backend memory live
  kernels::WeightType precision = kernels::WeightType::F32;

  static ModelBackend open(const ComputeOptions& options);

  // `host` (a host f32, f16 or bf16 tensor) as a tensor of `type` in backend memory: `host` itself
  // when the backend's memory is host memory and the type matches (zero-copy: e.g. a view into
  // an mmap-ed checkpoint), else a converted copy, uploaded and owned by the returned tensor.
  // Uploading and freeing hold the backend's mutex (other models may be computing on it).
  Tensor to_backend(const Tensor& host, DType type) const;
  // A Linear weight in the model's precision; vectors (norms, biases) and f32-only weights in f32.
  Tensor weight(const Tensor& host) const { return to_backend(host, dtype_of(precision)); }
  // weight(host) for a Linear weight [out, in] that stays unchanged while loaded and that only
  // linear (or grouped_swiglu, as an expert's w1, w3 or w2) reads: prepared for the backend's
  // GEMM (Backend::prepare_linear_weight; CPU: packed once for oneDNN) until the returned tensor
  // is released.
  Tensor linear_weight(const Tensor& host) const;
  Tensor f32(const Tensor& host) const { return to_backend(host, DType::F32); }
  // `host` (any dtype) byte for byte in backend memory: `host` itself on host-memory backends,
  // else an uploaded copy owned by the returned tensor (e.g. 4-bit packed codes and their scales).
  Tensor copy_as_is(const Tensor& host) const;

 private:
  // A copy of `src` (`shape` values of `type`, host memory) uploaded to the backend.
  Tensor upload(const void* src, DType type, const Shape& shape) const;
};

// A tensor in backend memory (from ModelBackend::to_backend) as the operations take it.
kernels::WeightRef weight_ref(const Tensor& t);
inline const float* f32_ptr(const Tensor& t) { return static_cast<const float*>(t.raw_data()); }

// Buffers in backend memory for the calls of one model. Blocks are handed out in order and reused
// by the next call (after reset()), growing when a call needs more; freed with the workspace
// (under `guard`, the backend's mutex, when given: the model's last user may be any thread).
class Workspace {
 public:
  explicit Workspace(kernels::Backend& backend, std::shared_ptr<std::mutex> guard = nullptr)
      : backend_(&backend), guard_(std::move(guard)) {}
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();

  void reset() { next_ = 0; }
  void* bytes(size_t n);
  float* f32(int64_t n) { return static_cast<float*>(bytes(static_cast<size_t>(n) * sizeof(float))); }
  int32_t* i32(int64_t n) { return static_cast<int32_t*>(bytes(static_cast<size_t>(n) * sizeof(int32_t))); }

 private:
  struct Block {
    void* ptr;
    size_t size;
  };
  kernels::Backend* backend_;
  std::shared_ptr<std::mutex> guard_;
  std::vector<Block> blocks_;
  size_t next_ = 0;
};

// y[N, D] += scale[n] · w2(silu(w1 x) · w3 x) for every row n of x [N, D]: one SwiGLU expert
// (intermediate size S) on every row, its output scaled per row (Qwen2-MoE's gated shared
// expert). `identity` [N] holds 0..N-1 and `scale` [N], both in backend memory; `scratch` holds at
// least N · (2·S + 2·D) floats of backend memory.
void add_scaled_swiglu(kernels::Backend& b, const float* x, int64_t N, int64_t D, int64_t S,
                       const kernels::ExpertWeights& w, const int32_t* identity, const float* scale, float* scratch,
                       float* y);

// One call of a model on its backend: holds the backend's mutex (non-host backends) for its whole
// life, provides working buffers (the model's cached workspace under the mutex; a fresh one per
// call on host backends, so concurrent calls share nothing) and host staging buffers that live
// until the call's queued work is done.
class Call {
 public:
  // `cached` is the model's workspace for non-host backends (created on first use).
  Call(const ModelBackend& model, std::unique_ptr<Workspace>& cached);
  ~Call();  // waits for queued work (non-host backends) before the staging buffers go
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  kernels::Backend& backend() { return *backend_; }
  bool host_memory() const { return host_; }
  Workspace& ws() { return *ws_; }

  // Host buffers owned by the call, to fill and then hand to device().
  float* host_f32(int64_t n);
  int32_t* host_i32(int64_t n);
  // A staged buffer (host_f32/host_i32) in backend memory: the buffer itself on host backends,
  // else a workspace copy.
  float* device(float* staged, int64_t n);
  int32_t* device(int32_t* staged, int64_t n);
  // Read-only host input in backend memory: the input itself on host backends, else a copy.
  const float* input(const float* host, int64_t n);
  const int32_t* input(const int32_t* host, int64_t n);
  // Backend memory to a new host tensor of `shape` (f32).
  Tensor to_host(const float* data, Shape shape);
  void to_host(void* dst, const void* src, size_t bytes) { backend_->copy_to_host(dst, src, bytes); }

 private:
  std::unique_lock<std::mutex> lock_;
  kernels::Backend* backend_;
  bool host_;
  std::optional<Workspace> local_;
  Workspace* ws_;
  std::deque<std::vector<float>> host_f32_;
  std::deque<std::vector<int32_t>> host_i32_;
};

}  // namespace moe::detail
