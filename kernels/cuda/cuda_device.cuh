// Internal to the CUDA backend: warp and block reductions shared by the kernels.
#pragma once

#include <cuda_runtime.h>

namespace moe::kernels::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 33 floats; consecutive calls may reuse it.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < warps ? shared[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) shared[32] = t;
  }
  __syncthreads();
  return shared[32];
}

// Maximum over the block, as block_sum.
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();  // a previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < warps ? shared[lane] : -INFINITY;
    t = warp_max(t);
    if (lane == 0) shared[32] = t;
  }
  __syncthreads();
  return shared[32];
}

// Exclusive prefix sum of `v` over the block in thread order; *total receives the block's sum.
// `shared` holds 33 ints; consecutive calls may reuse it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* shared, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncthreads();
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? shared[lane] : 0;
    int winc = w;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(kFullMask, winc, offset);
      if (lane >= offset) winc += other;
    }
    if (lane < warps) shared[lane] = winc - w;  // exclusive prefix of the warp totals
    if (lane == warps - 1) shared[32] = winc;
  }
  __syncthreads();
  *total = shared[32];
  return shared[warp] + inclusive - v;
}

}  // namespace moe::kernels::cuda
