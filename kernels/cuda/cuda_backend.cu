// CUDA backend. Every kernel here has its CPU twin in kernels/cpu/cpu_ops.cpp; tests/test_cuda.cpp
// compares the two on random inputs.
#include <cuda_runtime.h>

#include <string>

#include "backend.h"
#include "moe/error.h"

namespace moe::kernels {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(std::string("cuda: ") + what + ": " + cudaGetErrorString(err));
}

// One block per row: a block-wide sum of squares, then a scale. Rows are embeddings
// (hundreds to a few thousand wide), so one block per row keeps every SM busy for batch >= #SMs.
constexpr int kL2Threads = 256;

__global__ void l2_normalize_rows_kernel(float* x, int64_t cols, float eps) {
  __shared__ float partial[kL2Threads / 32];
  float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ss += row[c] * row[c];
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, offset);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  __shared__ float inv;
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kL2Threads / 32; ++w) total += partial[w];
    inv = 1.0f / fmaxf(sqrtf(total), eps);
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row[c] *= inv;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamDestroy(stream_);
  }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  bool is_host_memory() const override { return false; }
  void* allocate(size_t bytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    void* p = nullptr;
    check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    return p;
  }
  void deallocate(void* ptr) override {
    cudaSetDevice(device_);
    cudaFree(ptr);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copy to device");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host");
    synchronize();
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  // Not yet on CUDA (the next commits implement them); each says so.
  [[noreturn]] void todo(const char* op) const { throw Error(name() + ": " + op + " is not implemented yet"); }
  MemoryInfo memory_info() const override { todo("memory_info"); }
  void* allocate_host_staging(size_t) override { todo("allocate_host_staging"); }
  void free_host_staging(void*) override { todo("free_host_staging"); }
  void copy_on_device(void*, const void*, size_t) override { todo("copy_on_device"); }
  std::shared_ptr<Event> copy_from_host_async(void*, const void*, size_t) override { todo("copy_from_host_async"); }
  bool event_complete(const Event&) override { todo("event_complete"); }
  void wait_event(const Event&) override { todo("wait_event"); }
  void linear(const float*, WeightRef, const float*, float*, int64_t, int64_t, int64_t) override { todo("linear"); }
  void layer_norm(const float*, const float*, const float*, float*, int64_t, int64_t, float) override {
    todo("layer_norm");
  }
  void gelu(float*, int64_t) override { todo("gelu"); }
  void quick_gelu(float*, int64_t) override { todo("quick_gelu"); }
  void silu_mul(const float*, const float*, float*, int64_t) override { todo("silu_mul"); }
  void add(float*, const float*, int64_t) override { todo("add"); }
  void attention(const float*, float*, const std::vector<int64_t>&, int64_t, int64_t, bool) override {
    todo("attention");
  }
  void topk_softmax(const float*, int64_t, int64_t, int64_t, bool, int32_t*, float*) override { todo("topk_softmax"); }
  std::vector<int64_t> moe_permute(const int32_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                                   int32_t*) override {
    todo("moe_permute");
  }
  void grouped_swiglu(const float*, const std::vector<int64_t>&, const std::vector<ExpertWeights>&, int64_t, int64_t,
                      float*) override {
    todo("grouped_swiglu");
  }
  void moe_unpermute(const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, float*) override {
    todo("moe_unpermute");
  }
  void inner_product_topk(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t*, float*) override {
    todo("inner_product_topk");
  }
  void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) override {
    if (rows == 0) return;
    check(cudaSetDevice(device_), "cudaSetDevice");
    l2_normalize_rows_kernel<<<static_cast<unsigned>(rows), kL2Threads, 0, stream_>>>(x, cols, eps);
    check(cudaGetLastError(), "l2_normalize_rows launch");
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    return 0;
  }
  if (n == 0 && why) *why = "the CUDA driver reports no device";
  return n;
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  std::string why;
  const int n = cuda_device_count(&why);
  if (n == 0) throw Error("cuda:" + std::to_string(device) + ": " + why);
  if (device < 0 || device >= n)
    throw Error("cuda:" + std::to_string(device) + ": no such device (" + std::to_string(n) +
                " present)");
  return std::make_unique<CudaBackend>(device);
}

}  // namespace moe::kernels
