// Elementwise kernels (grid-stride loops, fp32 math with the accurate expf/erff) and the
// row-wise normalisations (one block per row, fp32 block reductions).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.h"
#include "cuda_device.cuh"

namespace moe::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void gelu_kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}

__global__ void quick_gelu_kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    x[i] = v / (1.0f + expf(-1.702f * v));
  }
}

__global__ void silu_mul_kernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] += x[i];
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    y[i] += bias[i % n];
}

__global__ void to_f16_kernel(const float* x, __half* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2half_rn(x[i]);
}

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i]);
}

// Two passes over the row (mean, then the centred sum of squares: no cancellation), fp32.
__global__ void layer_norm_kernel(const float* x, const float* gamma, const float* beta, float* y, int64_t cols,
                                  float eps) {
  __shared__ float shared[33];
  const float* xr = x + blockIdx.x * cols;
  float* yr = y + blockIdx.x * cols;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
  const float mean = block_sum(s, shared) / static_cast<float>(cols);
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = xr[c] - mean;
    ss += d * d;
  }
  const float var = block_sum(ss, shared) / static_cast<float>(cols);
  const float inv = 1.0f / sqrtf(var + eps);
  // Each thread reads x[c] before writing y[c] of the same c: y may alias x.
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = (xr[c] - mean) * inv * gamma[c] + beta[c];
}

__global__ void l2_normalize_rows_kernel(float* x, int64_t cols, float eps) {
  __shared__ float shared[33];
  float* row = x + blockIdx.x * cols;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ss += row[c] * row[c];
  const float inv = 1.0f / fmaxf(sqrtf(block_sum(ss, shared)), eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row[c] *= inv;
}

}  // namespace

void gelu(Ctx& ctx, float* x, int64_t n) {
  if (n <= 0) return;
  gelu_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(x, n);
  check_launch(ctx, "gelu", "gelu_kernel");
}

void quick_gelu(Ctx& ctx, float* x, int64_t n) {
  if (n <= 0) return;
  quick_gelu_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(x, n);
  check_launch(ctx, "quick_gelu", "quick_gelu_kernel");
}

void silu_mul(Ctx& ctx, const float* gate, const float* up, float* out, int64_t n) {
  if (n <= 0) return;
  silu_mul_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(gate, up, out, n);
  check_launch(ctx, "silu_mul", "silu_mul_kernel");
}

void add(Ctx& ctx, float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(y, x, n);
  check_launch(ctx, "add", "add_kernel");
}

void add_bias(Ctx& ctx, float* y, const float* bias, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) return;
  add_bias_kernel<<<grid_for(m * n, kThreads), kThreads, 0, ctx.stream>>>(y, bias, m, n);
  check_launch(ctx, "linear", "add_bias_kernel");
}

void cast_from_f32(Ctx& ctx, const char* op, const float* x, void* out, WeightType type, int64_t n) {
  if (n <= 0) return;
  if (type == WeightType::F16)
    to_f16_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(x, static_cast<__half*>(out), n);
  else if (type == WeightType::BF16)
    to_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(x, static_cast<__nv_bfloat16*>(out), n);
  else
    fail(ctx, op, std::string("no cast from f32 to ") + weight_type_name(type));
  check_launch(ctx, op, type == WeightType::F16 ? "to_f16_kernel" : "to_bf16_kernel");
}

void layer_norm(Ctx& ctx, const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                float eps) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > INT32_MAX) fail(ctx, "layer_norm", "more than 2^31 rows");
  layer_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, ctx.stream>>>(x, gamma, beta, y, cols, eps);
  check_launch(ctx, "layer_norm", "layer_norm_kernel");
}

void l2_normalize_rows(Ctx& ctx, float* x, int64_t rows, int64_t cols, float eps) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > INT32_MAX) fail(ctx, "l2_normalize_rows", "more than 2^31 rows");
  l2_normalize_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, ctx.stream>>>(x, cols, eps);
  check_launch(ctx, "l2_normalize_rows", "l2_normalize_rows_kernel");
}

}  // namespace moe::kernels::cuda
