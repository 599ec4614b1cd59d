#include "runtime/compute_util.h"

#include <glib.h>

#include <atomic>
#include <cstring>

#include "moe/error.h"

namespace moe::detail {

DType dtype_of(kernels::WeightType type) {
  switch (type) {
    case kernels::WeightType::F32:
      return DType::F32;
    case kernels::WeightType::F16:
      return DType::F16;
    case kernels::WeightType::BF16:
      return DType::BF16;
    case kernels::WeightType::Q4:
      throw Error("q4 is not a precision weights are converted to: 4-bit experts come packed from the checkpoint");
  }
  throw Error("unknown weight type " + std::to_string(static_cast<int>(type)));
}

ModelBackend ModelBackend::open(const ComputeOptions& options) {
  ModelBackend m;
  m.backend = open_backend(options);
  m.mutex = backend_mutex(*m.backend);
  m.precision = options.precision;
  const std::string name = m.backend->name();
  if (!m.backend->is_host_memory() && name.rfind("cuda:", 0) == 0)
    m.placement = Placement{DeviceKind::Cuda, std::stoi(name.substr(5))};
  return m;
}

bool try_release(const std::string& what, const std::function<void()>& release) noexcept {
  static std::atomic<bool> logged{false};
  std::string why;
  try {
    release();
    return true;
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "unknown exception";
  }
  // The first failure names the cause; later ones repeat the same sticky error.
  if (!logged.exchange(true))
    g_log("moe", G_LOG_LEVEL_MESSAGE, "%s failed: %s (leaked; later release failures are not logged)", what.c_str(),
          why.c_str());
  return false;
}

void deallocate_noexcept(kernels::Backend& backend, void* ptr) noexcept {
  try_release(backend.name() + ": freeing device memory", [&] { backend.deallocate(ptr); });
}

void free_host_staging_noexcept(kernels::Backend& backend, void* ptr) noexcept {
  try_release(backend.name() + ": freeing staging memory", [&] { backend.free_host_staging(ptr); });
}

Tensor ModelBackend::to_backend(const Tensor& host, DType type) const {
  if (!host.is_host() || (host.dtype() != DType::F32 && host.dtype() != DType::F16 && host.dtype() != DType::BF16))
    throw Error("to_backend: " + host.describe() + " is not a host float tensor");
  if (type != DType::F32 && type != DType::F16 && type != DType::BF16)
    throw Error(std::string("to_backend: unsupported type ") + dtype_name(type));
  if (backend->is_host_memory() && host.dtype() == type) return host;
  if (host.dtype() == type) return upload(host.raw_data(), type, host.shape());

  const int64_t n = host.numel();
  const Tensor f32 = host.to_f32();
  const float* v = f32.data<float>();
  if (type == DType::F32) return upload(v, type, host.shape());
  std::vector<uint16_t> half(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) half[i] = type == DType::F16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
  return upload(half.data(), type, host.shape());
}

Tensor ModelBackend::copy_as_is(const Tensor& host) const {
  if (!host.is_host()) throw Error("copy_as_is: " + host.describe() + " is not in host memory");
  if (backend->is_host_memory()) return host;
  return upload(host.raw_data(), host.dtype(), host.shape());
}

Tensor ModelBackend::upload(const void* src, DType type, const Shape& shape) const {
  kernels::Backend& b = *backend;
  const size_t bytes = dtype_storage_bytes(type, shape_numel(shape));
  std::unique_lock<std::mutex> lock;
  if (mutex) lock = std::unique_lock<std::mutex>(*mutex);
  void* dst = b.allocate(bytes);
  try {
    b.copy_from_host(dst, src, bytes);
    b.synchronize();  // `src` may go out of scope after the return
  } catch (...) {
    deallocate_noexcept(b, dst);
    throw;
  }
  if (lock.owns_lock()) lock.unlock();
  std::shared_ptr<void> owner(dst, [keep = backend, guard = mutex](void* p) {
    std::unique_lock<std::mutex> held;
    if (guard) held = std::unique_lock<std::mutex>(*guard);
    deallocate_noexcept(*keep, p);
  });
  return Tensor::view(type, shape, dst, std::move(owner), b.is_host_memory() ? Placement{} : placement);
}

Tensor ModelBackend::linear_weight(const Tensor& host) const {
  const Tensor t = weight(host);
  if (t.rank() != 2) throw Error("linear_weight: " + t.describe() + " is not [out, in]");
  const kernels::WeightRef w = weight_ref(t);
  const int64_t n = t.dim(0), k = t.dim(1);
  {
    auto lock = lock_if(mutex);
    backend->prepare_linear_weight(w, n, k);
  }
  std::shared_ptr<const void> prepared(new Tensor(t), [keep = backend, guard = mutex, w, n, k](const void* p) {
    try_release(keep->name() + ": releasing a prepared weight", [&] {
      auto held = lock_if(guard);
      keep->release_linear_weight(w, n, k);
    });
    delete static_cast<const Tensor*>(p);
  });
  return Tensor::view(t.dtype(), t.shape(), const_cast<void*>(t.raw_data()), std::move(prepared), t.placement());
}

void add_scaled_swiglu(kernels::Backend& b, const float* x, int64_t N, int64_t D, int64_t S,
                       const kernels::ExpertWeights& w, const int32_t* identity, const float* scale, float* scratch,
                       float* y) {
  float* gate = scratch;
  float* up = gate + N * S;
  float* out = up + N * S;
  float* scaled = out + N * D;
  b.linear(x, w.w1, nullptr, gate, N, S, D);
  b.linear(x, w.w3, nullptr, up, N, S, D);
  b.silu_mul(gate, up, gate, N * S);
  b.linear(gate, w.w2, nullptr, out, N, D, S);
  // The per-row scaling is a top-1 moe_unpermute with identity slots.
  b.moe_unpermute(out, identity, scale, N, 1, D, scaled);
  b.add(y, scaled, N * D);
}

kernels::WeightRef weight_ref(const Tensor& t) {
  kernels::WeightRef w;
  w.data = t.raw_data();
  switch (t.dtype()) {
    case DType::F32:
      w.type = kernels::WeightType::F32;
      break;
    case DType::F16:
      w.type = kernels::WeightType::F16;
      break;
    case DType::BF16:
      w.type = kernels::WeightType::BF16;
      break;
    default:
      throw Error("weight_ref: " + t.describe() + " is not a float weight");
  }
  return w;
}

Workspace::~Workspace() {
  const auto held = lock_if(guard_);
  for (const Block& b : blocks_) deallocate_noexcept(*backend_, b.ptr);
}

void* Workspace::bytes(size_t n) {
  if (next_ < blocks_.size()) {
    Block& b = blocks_[next_];
    if (b.size < n) {
      // Freeing waits for work queued on the block (CUDA: cudaFree synchronises the device).
      void* old = b.ptr;
      b.ptr = nullptr;
      b.size = 0;
      backend_->deallocate(old);
      b.ptr = backend_->allocate(n);
      b.size = n;
    }
    ++next_;
    return b.ptr;
  }
  void* p = backend_->allocate(n);
  blocks_.push_back({p, n});
  ++next_;
  return p;
}

Call::Call(const ModelBackend& model, std::unique_ptr<Workspace>& cached)
    : backend_(model.backend.get()), host_(model.backend->is_host_memory()) {
  lock_ = lock_if(model.mutex);
  if (host_ || !model.mutex) {
    local_.emplace(*backend_);
    ws_ = &*local_;
  } else {
    if (!cached) cached = std::make_unique<Workspace>(*backend_, model.mutex);
    ws_ = cached.get();
    ws_->reset();
  }
}

Call::~Call() {
  if (host_) return;
  // An exception may have left copies from the staging buffers queued.
  try_release(backend_->name() + ": waiting for the call's queued work", [this] { backend_->synchronize(); });
}

float* Call::host_f32(int64_t n) { return host_f32_.emplace_back(static_cast<size_t>(n)).data(); }
int32_t* Call::host_i32(int64_t n) { return host_i32_.emplace_back(static_cast<size_t>(n)).data(); }

float* Call::device(float* staged, int64_t n) {
  if (host_) return staged;
  float* d = ws_->f32(n);
  backend_->copy_from_host(d, staged, static_cast<size_t>(n) * sizeof(float));
  return d;
}

int32_t* Call::device(int32_t* staged, int64_t n) {
  if (host_) return staged;
  int32_t* d = ws_->i32(n);
  backend_->copy_from_host(d, staged, static_cast<size_t>(n) * sizeof(int32_t));
  return d;
}

const float* Call::input(const float* host, int64_t n) {
  if (host_) return host;
  float* d = ws_->f32(n);
  backend_->copy_from_host(d, host, static_cast<size_t>(n) * sizeof(float));
  return d;
}

const int32_t* Call::input(const int32_t* host, int64_t n) {
  if (host_) return host;
  int32_t* d = ws_->i32(n);
  backend_->copy_from_host(d, host, static_cast<size_t>(n) * sizeof(int32_t));
  return d;
}

Tensor Call::to_host(const float* data, Shape shape) {
  Tensor t = Tensor::zeros(DType::F32, std::move(shape));
  backend_->copy_to_host(t.raw_data(), data, t.nbytes());
  return t;
}

}  // namespace moe::detail
