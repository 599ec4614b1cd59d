// CUDA backend: one device, a compute stream (every operation, copy_from_host, copy_to_host,
// copy_on_device, in order) and a copy stream (copy_from_host_async, one cudaEvent per copy).
// Kernels live in the other files of this folder by topic; every one has its CPU twin in
// kernels/cpu/cpu_ops.cpp (q4 weights: cpu_int4.cpp), and the case table of tests/backend_cases.h
// compares the two.
// Every CUDA and cuBLAS call is checked; errors are moe::Error "cuda:N: <operation>: <call>: <reason>".
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>
#include <string>

#include "backend.h"
#include "cuda_common.h"
#include "moe/error.h"
#include "op_checks.h"

namespace moe::kernels {

namespace cuda {

void fail(const Ctx& ctx, const char* op, const std::string& why) { throw Error(ctx.name + ": " + op + ": " + why); }

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "unknown cuBLAS status";
}

void check(const Ctx& ctx, const char* op, cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // a non-sticky error must not be reported again by the next launch check
    fail(ctx, op, std::string(call) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

void check(const Ctx& ctx, const char* op, cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(ctx, op, std::string(call) + ": " + cublas_status_name(status) + " (" + std::to_string(status) + ")");
}

void check_launch(const Ctx& ctx, const char* op, const char* kernel) {
  check(ctx, op, cudaGetLastError(), (std::string("launching ") + kernel).c_str());
  if (ctx.sync_each_op) check(ctx, op, cudaStreamSynchronize(ctx.stream), (std::string("running ") + kernel).c_str());
}

namespace {

constexpr size_t kUploadChunkBytes = 2048;  // well within the 4 KiB of kernel parameters
struct UploadChunk {
  unsigned char bytes[kUploadChunkBytes];
};

__global__ void upload_kernel(UploadChunk chunk, unsigned char* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = chunk.bytes[i];
}

}  // namespace

void upload(Ctx& ctx, const char* op, void* dst, const void* src, size_t bytes) {
  for (size_t done = 0; done < bytes; done += kUploadChunkBytes) {
    const size_t n = std::min(kUploadChunkBytes, bytes - done);
    UploadChunk chunk;
    std::memcpy(chunk.bytes, static_cast<const unsigned char*>(src) + done, n);
    upload_kernel<<<1, 256, 0, ctx.stream>>>(chunk, static_cast<unsigned char*>(dst) + done, static_cast<int>(n));
    check_launch(ctx, op, "upload_kernel");
  }
}

namespace {

// `buffer` (of `size` bytes) grown to at least `bytes`, at least 1 MiB.
char* grow(Ctx& ctx, void*& buffer, size_t& size, size_t bytes, const char* op, const char* what) {
  if (bytes > size) {
    // Work queued earlier may still use the old buffer.
    check(ctx, op, cudaStreamSynchronize(ctx.stream),
          (std::string("cudaStreamSynchronize(before growing ") + what + ")").c_str());
    if (buffer) check(ctx, op, cudaFree(buffer), (std::string("cudaFree(") + what + ")").c_str());
    buffer = nullptr;
    size = 0;
    const size_t want = std::max(bytes, size_t{1} << 20);
    check(ctx, op, cudaMalloc(&buffer, want),
          ("cudaMalloc(" + std::to_string(want) + " bytes of " + what + ")").c_str());
    size = want;
  }
  return static_cast<char*>(buffer);
}

}  // namespace

char* scratch(Ctx& ctx, size_t bytes, const char* op) {
  return grow(ctx, ctx.scratch, ctx.scratch_bytes, bytes, op, "scratch");
}

char* q4_arena(Ctx& ctx, size_t bytes, const char* op) {
  return grow(ctx, ctx.q4_arena, ctx.q4_arena_bytes, bytes, op, "the q4 arena");
}

}  // namespace cuda

namespace {

using cuda::check;

// Makes `device` the calling thread's current device for the scope, then restores the previous
// one: destructors and probes run on any thread and must not change its device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    result_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;  // nothing to restore
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t result() const { return result_; }

 private:
  int previous_ = -1;
  cudaError_t result_ = cudaSuccess;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(const void* owner, int device, cudaEvent_t event) : owner(owner), device(device), event(event) {}
  ~CudaEvent() override {
    const ScopedDevice on(device);
    cudaEventDestroy(event);  // fine while pending: resources are released once it completes
  }
  const void* owner;
  int device;
  cudaEvent_t event;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) {
    ctx_.device = device;
    ctx_.name = "cuda:" + std::to_string(device);
    const char* sync = std::getenv("MOE_CUDA_SYNC");
    ctx_.sync_each_op = sync && *sync && std::string(sync) != "0";
    try {
      check(ctx_, "init", cudaSetDevice(device), "cudaSetDevice");
      check(ctx_, "init", cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking), "cudaStreamCreate(compute)");
      check(ctx_, "init", cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate(copy)");
      check(ctx_, "init", cublasCreate(&ctx_.blas), "cublasCreate");
      check(ctx_, "init", cublasSetStream(ctx_.blas, ctx_.stream), "cublasSetStream");
      // fp32 stays fp32: no TF32 or other reduced-precision shortcuts.
      check(ctx_, "init", cublasSetMathMode(ctx_.blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaBackend() override {
    const ScopedDevice on(ctx_.device);
    // Drain both queues before the buffers they may use go away.
    if (ctx_.stream) cudaStreamSynchronize(ctx_.stream);
    if (copy_stream_) cudaStreamSynchronize(copy_stream_);
    release();
  }

  std::string name() const override { return ctx_.name; }
  bool is_host_memory() const override { return false; }
  MemoryInfo memory_info() const override {
    on_device("memory_info");
    MemoryInfo info;
    check(ctx_, "memory_info", cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
    return info;
  }

  // ---- memory ----
  void* allocate(size_t bytes) override {
    on_device("allocate");
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error(ctx_.name + ": allocate: out of device memory allocating " + std::to_string(bytes) +
                  " bytes (cudaMalloc: " + cudaGetErrorString(err) + ")");
    }
    return p;
  }
  void deallocate(void* ptr) override {
    if (!ptr) return;
    on_device("deallocate");
    check(ctx_, "deallocate", cudaFree(ptr), "cudaFree");
  }
  void* allocate_host_staging(size_t bytes) override {
    on_device("allocate_host_staging");
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error(ctx_.name + ": allocate_host_staging: cannot allocate " + std::to_string(bytes) +
                  " bytes of page-locked host memory (cudaHostAlloc: " + cudaGetErrorString(err) + ")");
    }
    return p;
  }
  void free_host_staging(void* ptr) override {
    if (!ptr) return;
    check(ctx_, "free_host_staging", cudaFreeHost(ptr), "cudaFreeHost");
  }
  // Staging is allocated with cudaHostAllocPortable: page-locked for every device's context.
  bool shares_staging_with(const Backend& owner) const override {
    return dynamic_cast<const CudaBackend*>(&owner) != nullptr;
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    on_device("copy_from_host");
    check(ctx_, "copy_from_host", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream),
          "cudaMemcpyAsync");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    on_device("copy_to_host");
    if (bytes)
      check(ctx_, "copy_to_host", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream),
            "cudaMemcpyAsync");
    check(ctx_, "copy_to_host", cudaStreamSynchronize(ctx_.stream), "cudaStreamSynchronize");
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    on_device("copy_on_device");
    check(ctx_, "copy_on_device", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_.stream),
          "cudaMemcpyAsync");
  }
  void copy_to_peer(Backend& peer, void* dst, const void* src, size_t bytes) override {
    const char* op = "copy_to_peer";
    auto* to = dynamic_cast<CudaBackend*>(&peer);
    if (!to) throw Error(ctx_.name + ": " + op + ": " + peer.name() + " is not a CUDA device (copy through the host)");
    if (!bytes) return;
    if (to == this) return copy_on_device(dst, src, bytes);
    enable_peer_access(to->ctx_.device);
    // peer's queue -> our queue: the copy must not overwrite what peer's earlier work still reads.
    fence(*to, *this, op);
    on_device(op);
    check(ctx_, op, cudaMemcpyPeerAsync(dst, to->ctx_.device, src, ctx_.device, bytes, ctx_.stream),
          "cudaMemcpyPeerAsync");
    // our queue -> peer's queue: peer's later work reads the copied rows.
    fence(*this, *to, op);
  }
  std::shared_ptr<Event> copy_from_host_async(void* dst, const void* src, size_t bytes) override {
    const char* op = "copy_from_host_async";
    on_device(op);
    cudaEvent_t event = nullptr;
    check(ctx_, op, cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    auto result = std::make_shared<CudaEvent>(this, ctx_.device, event);  // owns the event from here
    // One thread at a time between the copy and its record, so the event marks exactly this copy.
    std::lock_guard<std::mutex> lock(copy_mu_);
    if (bytes)
      check(ctx_, op, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy_stream_), "cudaMemcpyAsync");
    check(ctx_, op, cudaEventRecord(event, copy_stream_), "cudaEventRecord");
    return result;
  }
  bool event_complete(const Event& event) override {
    const cudaEvent_t e = own(event, "event_complete");
    on_device("event_complete");
    const cudaError_t err = cudaEventQuery(e);
    if (err == cudaErrorNotReady) {
      if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
      return false;
    }
    check(ctx_, "event_complete", err, "cudaEventQuery");
    return true;
  }
  void wait_event(const Event& event) override {
    const cudaEvent_t e = own(event, "wait_event");
    on_device("wait_event");
    check(ctx_, "wait_event", cudaStreamWaitEvent(ctx_.stream, e, 0), "cudaStreamWaitEvent");
  }
  void synchronize() override {
    on_device("synchronize");
    check(ctx_, "synchronize", cudaStreamSynchronize(ctx_.stream), "cudaStreamSynchronize");
  }

  // ---- operations ----
  void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) override {
    checks::linear(ctx_.name, w, m, n, k);
    on_device("linear");
    cuda::linear(ctx_, x, w, bias, y, m, n, k);
  }
  void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                  float eps) override {
    checks::non_negative(ctx_.name, "layer_norm", {rows, cols});
    on_device("layer_norm");
    cuda::layer_norm(ctx_, x, gamma, beta, y, rows, cols, eps);
  }
  void gelu(float* x, int64_t n) override {
    on_device("gelu");
    cuda::gelu(ctx_, x, n);
  }
  void quick_gelu(float* x, int64_t n) override {
    on_device("quick_gelu");
    cuda::quick_gelu(ctx_, x, n);
  }
  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    on_device("silu_mul");
    cuda::silu_mul(ctx_, gate, up, out, n);
  }
  void add(float* y, const float* x, int64_t n) override {
    on_device("add");
    cuda::add(ctx_, y, x, n);
  }
  void attention(const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t heads, int64_t head_dim,
                 bool causal) override {
    const int64_t total = checks::attention(ctx_.name, seq_lens, heads, head_dim);
    on_device("attention");
    cuda::attention(ctx_, qkv, out, seq_lens, total, heads, head_dim, causal);
  }
  void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) override {
    on_device("l2_normalize_rows");
    cuda::l2_normalize_rows(ctx_, x, rows, cols, eps);
  }
  void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize, int32_t* ids,
                    float* weights) override {
    checks::topk_softmax(ctx_.name, rows, experts, top_k);
    on_device("topk_softmax");
    cuda::topk_softmax(ctx_, logits, rows, experts, top_k, renormalize, ids, weights);
  }
  std::vector<int64_t> moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts, const float* x,
                                   int64_t cols, float* x_sorted, int32_t* slot_of) override {
    checks::moe_permute(ctx_.name, rows, top_k, experts, cols);
    on_device("moe_permute");
    return cuda::moe_permute(ctx_, ids, rows, top_k, experts, x, cols, x_sorted, slot_of);
  }
  void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                      const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted) override {
    checks::grouped_swiglu(ctx_.name, offsets, experts, d, inter);
    bool q4 = false;
    for (size_t e = 0; e < experts.size(); ++e)
      if (offsets[e + 1] > offsets[e])
        for (const WeightRef* w : {&experts[e].w1, &experts[e].w3, &experts[e].w2}) q4 |= w->type == WeightType::Q4;
    on_device("grouped_swiglu");
    if (q4)
      cuda::grouped_swiglu_q4(ctx_, x_sorted, offsets, experts, d, inter, out_sorted);
    else
      cuda::grouped_swiglu(ctx_, x_sorted, offsets, experts, d, inter, out_sorted);
  }
  void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows, int64_t top_k,
                     int64_t cols, float* y) override {
    checks::moe_unpermute(ctx_.name, rows, top_k, cols);
    on_device("moe_unpermute");
    cuda::moe_unpermute(ctx_, out_sorted, slot_of, weights, rows, top_k, cols, y);
  }
  void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                          int64_t* ids, float* scores) override {
    checks::inner_product_topk(ctx_.name, nq, nb, d, k);
    on_device("inner_product_topk");
    cuda::inner_product_topk(ctx_, queries, nq, base, nb, d, k, ids, scores);
  }

 protected:
  // The kernels' size limits. q4 weights have none: their group size belongs to the weight, not
  // to the call, and the calls check it against the contract as the CPU's do.
  std::string why_unsupported(const OpDesc& op) const override {
    switch (op.op) {
      case Op::Attention:
        return cuda::attention_limit(op.sizes[3]);
      case Op::TopkSoftmax:
        return cuda::topk_softmax_limit(op.sizes[1]);
      case Op::InnerProductTopk:
        return cuda::inner_product_topk_limit(op.sizes[3]);
      case Op::Linear:
      case Op::LayerNorm:
      case Op::Gelu:
      case Op::QuickGelu:
      case Op::SiluMul:
      case Op::Add:
      case Op::L2NormalizeRows:
      case Op::MoePermute:
      case Op::GroupedSwiglu:
      case Op::MoeUnpermute:
        return {};
    }
    return {};
  }

 private:
  // The runtime's current device is per host thread: set it on every entry.
  void on_device(const char* op) const { check(ctx_, op, cudaSetDevice(ctx_.device), "cudaSetDevice"); }
  // Work queued on `to`'s compute stream from now on starts after everything queued so far on
  // `from`'s (across devices too: an event may be waited on by another device's stream).
  static void fence(const CudaBackend& from, const CudaBackend& to, const char* op) {
    if (from.ctx_.stream == to.ctx_.stream) return;
    from.on_device(op);
    cudaEvent_t event = nullptr;
    check(from.ctx_, op, cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate(fence)");
    cudaError_t err = cudaEventRecord(event, from.ctx_.stream);
    if (err == cudaSuccess) {
      to.on_device(op);
      err = cudaStreamWaitEvent(to.ctx_.stream, event, 0);
    }
    from.on_device(op);
    cudaEventDestroy(event);  // fine while pending: released once it completes
    check(from.ctx_, op, err, "cudaEventRecord/cudaStreamWaitEvent(fence)");
  }
  // Direct peer-to-peer transfers where the hardware allows (NVLink, PCIe P2P); without it
  // cudaMemcpyPeerAsync still works, staged through host memory by the driver. Enabled once per
  // device pair for the process (the runtime keeps it per context).
  void enable_peer_access(int peer_device) const {
    if (peer_device == ctx_.device) return;
    static std::mutex mu;
    static std::set<std::pair<int, int>> tried;
    std::lock_guard<std::mutex> lock(mu);
    if (!tried.insert({ctx_.device, peer_device}).second) return;
    int can = 0;
    check(ctx_, "copy_to_peer", cudaDeviceCanAccessPeer(&can, ctx_.device, peer_device), "cudaDeviceCanAccessPeer");
    if (!can) return;
    on_device("copy_to_peer");
    // Already enabled, or refused (e.g. too many peers): either way the copies still work, direct
    // or staged by the driver, so no error here.
    if (cudaDeviceEnablePeerAccess(peer_device, 0) != cudaSuccess) cudaGetLastError();
  }
  cudaEvent_t own(const Event& event, const char* op) const {
    const auto* e = dynamic_cast<const CudaEvent*>(&event);
    if (!e || e->owner != this) throw Error(ctx_.name + ": " + op + ": the event belongs to another backend");
    return e->event;
  }
  void release() {
    if (ctx_.scratch) cudaFree(ctx_.scratch);
    if (ctx_.q4_arena) cudaFree(ctx_.q4_arena);
    if (ctx_.blas) cublasDestroy(ctx_.blas);
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    if (ctx_.stream) cudaStreamDestroy(ctx_.stream);
    ctx_.scratch = nullptr;
    ctx_.q4_arena = nullptr;
    ctx_.blas = nullptr;
    copy_stream_ = nullptr;
    ctx_.stream = nullptr;
  }

  cuda::Ctx ctx_;
  cudaStream_t copy_stream_ = nullptr;
  std::mutex copy_mu_;
};

}  // namespace

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    return 0;
  }
  if (n == 0 && why) *why = "the CUDA driver reports no device";
  return n;
}

bool cuda_device_usable(int device, std::string* why) {
  const auto no = [why](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  std::string reason;
  const int n = cuda_device_count(&reason);
  if (n == 0) return no(reason);
  if (device < 0 || device >= n) return no("no such device (" + std::to_string(n) + " present)");
  const auto cuda_error = [](cudaError_t err) {
    cudaGetLastError();  // a non-sticky error must not surface in a later check
    return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
  };
  cudaDeviceProp prop{};
  if (const cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess)
    return no("cudaGetDeviceProperties: " + cuda_error(err));
  const std::string what =
      std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." + std::to_string(prop.minor);
  const ScopedDevice on(device);
  if (on.result() != cudaSuccess) return no(what + ": cudaSetDevice: " + cuda_error(on.result()));
  // Creates the device's context and looks up this build's code for its compute capability (one
  // kernel stands for all: they are built with the same targets).
  cudaFuncAttributes attributes{};
  if (const cudaError_t err = cudaFuncGetAttributes(&attributes, cuda::upload_kernel); err != cudaSuccess) {
    if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ||
        err == cudaErrorUnsupportedPtxVersion)
      return no(what + ": this build has no kernels for it (built for " MOE_GPU_TARGETS "): " + cuda_error(err));
    return no(what + ": cannot create a context or load the kernels: " + cuda_error(err));
  }
  return true;
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  std::string why;
  if (!cuda_device_usable(device, &why)) throw Error("cuda:" + std::to_string(device) + ": " + why);
  return std::make_unique<CudaBackend>(device);
}

}  // namespace moe::kernels
