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

// row_scale (rows of `cols`) may be null: then no scaling.
__global__ void silu_mul_kernel(const float* gate, const float* up, const float* row_scale, int64_t cols, float* out,
                                int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float s = row_scale ? row_scale[i / cols] : 1.0f;
    const float g = gate[i] * s;
    out[i] = g / (1.0f + expf(-g)) * (up[i] * s);
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] += x[i];
}

// row_scale and bias may be null.
__global__ void scale_rows_add_bias_kernel(float* y, const float* row_scale, const float* bias, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    float v = y[i];
    if (row_scale) v *= row_scale[i / n];
    if (bias) v += bias[i % n];
    y[i] = v;
  }
}

__global__ void to_f16_kernel(const float* x, __half* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2half_rn(x[i]);
}

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i]);
}

__device__ __forceinline__ void store(float* out, int64_t i, float v) { out[i] = v; }
__device__ __forceinline__ void store(__half* out, int64_t i, float v) { out[i] = __float2half_rn(v); }

// One block per row: s = the largest power of two ≤ 1 with max |x| · s ≤ 65504 (the largest finite
// f16); 1 for a row holding inf or NaN, which stays inf/NaN as it would in f32. out = x · s (exact:
// a power of two), unscale = 1/s. out may alias x (every thread reads its elements before the
// block's reduction completes, and writes only its own).
template <typename Out>
__global__ void fit_rows_to_f16_kernel(const float* x, int64_t cols, Out* out, float* unscale) {
  __shared__ float shared[33];
  const float* xr = x + blockIdx.x * cols;
  float m = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(xr[c]));
  m = block_max(m, shared);
  float s = 1.0f;
  if (isfinite(m))
    while (m * s > 65504.0f) s *= 0.5f;
  Out* outr = out + blockIdx.x * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store(outr, c, xr[c] * s);
  if (threadIdx.x == 0) unscale[blockIdx.x] = 1.0f / s;
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
  const float norm = sqrtf(block_sum(ss, shared));
  // Not fmaxf, which drops a NaN norm: a row holding a NaN becomes all NaN, as on the CPU.
  const float inv = 1.0f / (norm < eps ? eps : norm);
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
  silu_mul_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(gate, up, nullptr, 1, out, n);
  check_launch(ctx, "silu_mul", "silu_mul_kernel");
}

void silu_mul_scaled_rows(Ctx& ctx, const char* op, const float* gate, const float* up, const float* row_scale,
                          int64_t rows, int64_t cols, float* out) {
  if (rows <= 0 || cols <= 0) return;
  silu_mul_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, ctx.stream>>>(gate, up, row_scale, cols, out,
                                                                                rows * cols);
  check_launch(ctx, op, "silu_mul_kernel");
}

void add(Ctx& ctx, float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream>>>(y, x, n);
  check_launch(ctx, "add", "add_kernel");
}

void scale_rows_add_bias(Ctx& ctx, const char* op, float* y, const float* row_scale, const float* bias, int64_t m,
                         int64_t n) {
  if (m <= 0 || n <= 0 || (!row_scale && !bias)) return;
  scale_rows_add_bias_kernel<<<grid_for(m * n, kThreads), kThreads, 0, ctx.stream>>>(y, row_scale, bias, m, n);
  check_launch(ctx, op, "scale_rows_add_bias_kernel");
}

void fit_rows_to_f16(Ctx& ctx, const char* op, const float* x, int64_t rows, int64_t cols, void* out, WeightType type,
                     float* unscale) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > INT32_MAX) fail(ctx, op, "more than 2^31 rows");
  const auto blocks = static_cast<unsigned>(rows);
  if (type == WeightType::F16)
    fit_rows_to_f16_kernel<<<blocks, kThreads, 0, ctx.stream>>>(x, cols, static_cast<__half*>(out), unscale);
  else if (type == WeightType::F32)
    fit_rows_to_f16_kernel<<<blocks, kThreads, 0, ctx.stream>>>(x, cols, static_cast<float*>(out), unscale);
  else
    fail(ctx, op, std::string("fit_rows_to_f16 writes f32 or f16, not ") + weight_type_name(type));
  check_launch(ctx, op, "fit_rows_to_f16_kernel");
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
