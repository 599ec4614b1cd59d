// Group-wise 4-bit weights (W4A16, kernels::Q4Weight in backend.h) on CUDA. Every kernel here
// gives a code the value the contract defines: w = float(q - z) · scale, rounded to the scale's
// type and widened (the CPU's int4_group_values, core/src/io/quantized_weights.cpp). The product
// of an integer in [-15, 15] and a 16-bit float is exact in f32, so one f32 multiply and one
// round-to-nearest-even conversion give that value bit for bit.
//
// Few rows (≤ kQ4FusedMaxRows per weight): q4_fused_kernel reads each packed word once from
// global memory, decodes its 8 codes in registers and multiplies them into f32 accumulators with
// the f32 activations (plain FMA: at these row counts the work is reading and decoding the
// weight, not multiplying; an mma.sync version would round the activations to 16 bits and its
// fragment layouts could not be tested here). A block is 4 warps × 4 weight rows; the activations
// pass through shared memory 256 columns at a time (one packed word = 8 columns per lane), stored
// transposed so that a warp's 32 reads hit 32 banks; each warp sums its lanes at the end.
// More rows: q4_dequantize_kernel writes the weight in its scale's type to scratch and the
// f16/bf16 cuBLAS path runs it (activations rounded to that type, as for f16/bf16 weights).
// grouped_swiglu_q4: experts whose three weights are q4 and that have few rows run w1/w3, SwiGLU
// and w2 on the fused kernel; the others get their q4 weights dequantised and go through
// grouped_swiglu (cuda_moe.cu) in runs of consecutive experts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <tuple>

#include "cuda_common.h"
#include "cuda_device.cuh"

namespace moe::kernels::cuda {

namespace {

constexpr int kFusedWarps = 4;
constexpr int kWarpWeightRows = 4;                               // weight rows per warp
constexpr int kBlockWeightRows = kFusedWarps * kWarpWeightRows;  // 16 per block
constexpr int kTileCols = 32 * 8;                                // one packed word per lane

// One weight's product in a fused launch: y[i, r] = Σ_c x[i, c] · w[r, c] (+ bias[r]) for
// i < rows; x [rows, k] and y [rows, n] row-major (n and k shared by the launch).
struct FusedArgs {
  const int32_t* packed;
  const uint16_t* scales;
  const int32_t* zero_points;  // null: symmetric
  const float* x;
  float* y;
  const float* bias;  // null: none
  int rows;
  int group_size;
  int bf16;  // scales are bf16 (else f16)
};

// f16 or bf16 bits to f32 (exact).
__device__ __forceinline__ float widen(uint16_t bits, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16) : __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ int zero_point(const int32_t* zero_points, int64_t r, int64_t g, int64_t groups) {
  return zero_points
             ? static_cast<int>((static_cast<uint32_t>(zero_points[(r / 8) * groups + g]) >> (4 * (r % 8))) & 0xFu)
             : 8;
}

// The code's value in the scale's type, as its bits.
__device__ __forceinline__ uint16_t value_bits(uint32_t code, int zero, float scale, bool bf16) {
  const float exact = static_cast<float>(static_cast<int>(code) - zero) * scale;
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(exact)) : __half_as_ushort(__float2half_rn(exact));
}

__device__ __forceinline__ float value(uint32_t code, int zero, float scale, bool bf16) {
  return widen(value_bits(code, zero, scale, bf16), bf16);
}

// grid (ceil(n / kBlockWeightRows), problems); ROWS ≥ every problem's rows.
template <int ROWS>
__global__ void __launch_bounds__(kFusedWarps * 32) q4_fused_kernel(const FusedArgs* problems, int n, int k) {
  // Column t0 + 8·lane + j of activation row i at [i][j][lane].
  __shared__ float xs[ROWS * kTileCols];
  const FusedArgs p = problems[blockIdx.y];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kFusedWarps + warp) * kWarpWeightRows;
  const int words = k / 8;
  const int64_t groups = k / p.group_size;
  const bool bf16 = p.bf16 != 0;
  float acc[kWarpWeightRows][ROWS];
#pragma unroll
  for (int rr = 0; rr < kWarpWeightRows; ++rr)
#pragma unroll
    for (int i = 0; i < ROWS; ++i) acc[rr][i] = 0.0f;

  for (int t0 = 0; t0 < k; t0 += kTileCols) {
    __syncthreads();  // the previous tile is consumed
    for (int idx = threadIdx.x; idx < ROWS * kTileCols; idx += blockDim.x) {
      const int i = idx / kTileCols, pos = idx % kTileCols;
      const int c = t0 + (pos & 31) * 8 + (pos >> 5);
      xs[idx] = i < p.rows && c < k ? p.x[static_cast<int64_t>(i) * k + c] : 0.0f;
    }
    __syncthreads();
    const int word = t0 / 8 + lane;
    if (word >= words) continue;  // past the end of k: nothing to add (the loop stays uniform)
    const int64_t g = static_cast<int64_t>(word) * 8 / p.group_size;
    uint32_t codes[kWarpWeightRows];
    float scale[kWarpWeightRows];
    int zero[kWarpWeightRows];
#pragma unroll
    for (int rr = 0; rr < kWarpWeightRows; ++rr) {
      const int64_t r = row0 + rr;
      const bool in = r < n;  // rows past n decode to 0 · 0
      codes[rr] = in ? static_cast<uint32_t>(p.packed[r * words + word]) : 0u;
      scale[rr] = in ? widen(p.scales[r * groups + g], bf16) : 0.0f;
      zero[rr] = in ? zero_point(p.zero_points, r, g, groups) : 0;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float xv[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) xv[i] = xs[i * kTileCols + j * 32 + lane];
#pragma unroll
      for (int rr = 0; rr < kWarpWeightRows; ++rr) {
        const float v = value((codes[rr] >> (4 * j)) & 0xFu, zero[rr], scale[rr], bf16);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc[rr][i] = fmaf(v, xv[i], acc[rr][i]);
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kWarpWeightRows; ++rr) {
    const int r = row0 + rr;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const float sum = warp_sum(acc[rr][i]);
      if (lane == 0 && r < n && i < p.rows) p.y[static_cast<int64_t>(i) * n + r] = sum + (p.bias ? p.bias[r] : 0.0f);
    }
  }
}

// One thread per packed word: its 8 values in the scale's type, one 16-byte store.
__global__ void q4_dequantize_kernel(const int32_t* packed, const uint16_t* scales, const int32_t* zero_points,
                                     int group_size, bool bf16, int64_t n, int64_t k, uint4* dst) {
  const int64_t words = k / 8, groups = k / group_size, total = n * words;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / words, word = idx % words, g = word * 8 / group_size;
    const auto codes = static_cast<uint32_t>(packed[idx]);
    const float scale = widen(scales[r * groups + g], bf16);
    const int zero = zero_point(zero_points, r, g, groups);
    uint32_t half_pairs[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      half_pairs[j] = value_bits((codes >> (8 * j)) & 0xFu, zero, scale, bf16) |
                      (static_cast<uint32_t>(value_bits((codes >> (8 * j + 4)) & 0xFu, zero, scale, bf16)) << 16);
    dst[idx] = make_uint4(half_pairs[0], half_pairs[1], half_pairs[2], half_pairs[3]);
  }
}

template <int ROWS>
void launch_fused(Ctx& ctx, const char* op, dim3 grid, const FusedArgs* args, int n, int k) {
  q4_fused_kernel<ROWS><<<grid, kFusedWarps * 32, 0, ctx.stream>>>(args, n, k);
  check_launch(ctx, op, "q4_fused_kernel");
}

bool all_q4(const ExpertWeights& e) {
  return e.w1.type == WeightType::Q4 && e.w3.type == WeightType::Q4 && e.w2.type == WeightType::Q4;
}

const Q4Weight& q4_of(const WeightRef& w) { return *static_cast<const Q4Weight*>(w.data); }

}  // namespace

void check_q4(const Ctx& ctx, const char* op, const Q4Weight& w, int64_t k) {
  if (!w.packed || !w.scales) fail(ctx, op, "the q4 weight has no data");
  if (w.scale_type != WeightType::F16 && w.scale_type != WeightType::BF16)
    fail(ctx, op, "q4 scales must be f16 or bf16");
  if (w.group_size <= 0 || w.group_size % 8 != 0 || k % w.group_size != 0)
    fail(ctx, op,
         "q4 group size " + std::to_string(w.group_size) +
             " must be a positive multiple of 8 that divides k = " + std::to_string(k));
}

size_t q4_fused_arg_bytes(size_t problems) { return problems * sizeof(FusedArgs); }

void q4_fused(Ctx& ctx, const char* op, const std::vector<Q4FusedProblem>& problems, int64_t n, int64_t k,
              void* dev_args) {
  if (problems.empty() || n == 0) return;
  if (n > INT32_MAX || k > INT32_MAX) fail(ctx, op, "q4 weights beyond 2^31 - 1 rows or columns");
  if (problems.size() > 65535) fail(ctx, op, "more than 65535 q4 products in one launch");
  std::vector<FusedArgs> args;
  int64_t most = 0;
  for (const Q4FusedProblem& p : problems) {
    if (p.rows < 1 || p.rows > kQ4FusedMaxRows)
      fail(ctx, op, "q4 fused product of " + std::to_string(p.rows) + " rows");
    most = std::max(most, p.rows);
    args.push_back({p.w->packed, static_cast<const uint16_t*>(p.w->scales), p.w->zero_points, p.x, p.y, p.bias,
                    static_cast<int>(p.rows), p.w->group_size, p.w->scale_type == WeightType::BF16 ? 1 : 0});
  }
  upload(ctx, op, dev_args, args.data(), q4_fused_arg_bytes(args.size()));
  const auto* dev = static_cast<const FusedArgs*>(dev_args);
  const dim3 grid(static_cast<unsigned>((n + kBlockWeightRows - 1) / kBlockWeightRows),
                  static_cast<unsigned>(problems.size()));
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  static_assert(kQ4FusedMaxRows == 16, "one kernel per power of two up to kQ4FusedMaxRows");
  if (most <= 1)
    launch_fused<1>(ctx, op, grid, dev, ni, ki);
  else if (most <= 2)
    launch_fused<2>(ctx, op, grid, dev, ni, ki);
  else if (most <= 4)
    launch_fused<4>(ctx, op, grid, dev, ni, ki);
  else if (most <= 8)
    launch_fused<8>(ctx, op, grid, dev, ni, ki);
  else
    launch_fused<16>(ctx, op, grid, dev, ni, ki);
}

void q4_dequantize(Ctx& ctx, const char* op, const Q4Weight& w, int64_t n, int64_t k, void* dst) {
  if (n == 0 || k == 0) return;
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) fail(ctx, op, "q4 dequantisation target not 16-byte aligned");
  q4_dequantize_kernel<<<grid_for(n * (k / 8), 256), 256, 0, ctx.stream>>>(
      w.packed, static_cast<const uint16_t*>(w.scales), w.zero_points, w.group_size, w.scale_type == WeightType::BF16,
      n, k, static_cast<uint4*>(dst));
  check_launch(ctx, op, "q4_dequantize_kernel");
}

void grouped_swiglu_q4(Ctx& ctx, const float* x_sorted, const std::vector<int64_t>& offsets,
                       const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted) {
  const char* op = "grouped_swiglu";
  if (offsets.back() == 0 || d == 0) return;
  const size_t count = experts.size();
  const auto rows_of = [&](size_t e) { return offsets[e + 1] - offsets[e]; };
  for (size_t e = 0; e < count; ++e) {
    if (rows_of(e) == 0) continue;
    for (const WeightRef* w : {&experts[e].w1, &experts[e].w3})
      if (w->type == WeightType::Q4) check_q4(ctx, op, q4_of(*w), d);
    if (experts[e].w2.type == WeightType::Q4) check_q4(ctx, op, q4_of(experts[e].w2), inter);
  }
  const auto fused = [&](size_t e) {
    return rows_of(e) > 0 && rows_of(e) <= kQ4FusedMaxRows && inter > 0 && all_q4(experts[e]);
  };

  // Experts on the fused kernel: gate/up for their rows, packed one expert after another.
  std::vector<size_t> small;
  int64_t small_rows = 0;
  for (size_t e = 0; e < count; ++e)
    if (fused(e)) {
      small.push_back(e);
      small_rows += rows_of(e);
    }
  if (!small.empty()) {
    float *gate, *up;
    void *in_args, *down_args;
    const auto layout = [&](Carver& c) {
      gate = c.take<float>(static_cast<size_t>(small_rows * inter));
      up = c.take<float>(static_cast<size_t>(small_rows * inter));
      in_args = c.take<char>(q4_fused_arg_bytes(2 * small.size()));
      down_args = c.take<char>(q4_fused_arg_bytes(small.size()));
    };
    Carver measure;
    layout(measure);
    Carver carve(scratch(ctx, measure.bytes(), op));
    layout(carve);
    std::vector<Q4FusedProblem> in_problems, down_problems;
    int64_t packed_row = 0;
    for (size_t e : small) {
      const int64_t o = offsets[e], n = rows_of(e);
      const float* x = x_sorted + o * d;
      in_problems.push_back({&q4_of(experts[e].w1), x, gate + packed_row * inter, nullptr, n});
      in_problems.push_back({&q4_of(experts[e].w3), x, up + packed_row * inter, nullptr, n});
      down_problems.push_back({&q4_of(experts[e].w2), gate + packed_row * inter, out_sorted + o * d, nullptr, n});
      packed_row += n;
    }
    q4_fused(ctx, op, in_problems, inter, d, in_args);
    silu_mul(ctx, gate, up, gate, small_rows * inter);
    q4_fused(ctx, op, down_problems, d, inter, down_args);
  }

  // The other experts, in runs between fused ones, through grouped_swiglu with their q4 weights
  // dequantised (a run's weights in the q4 arena, which grouped_swiglu's scratch does not touch).
  for (size_t first = 0; first < count;) {
    if (fused(first)) {
      ++first;
      continue;
    }
    size_t end = first;
    while (end < count && !fused(end)) ++end;
    std::vector<int64_t> run_offsets;
    for (size_t e = first; e <= end; ++e) run_offsets.push_back(offsets[e] - offsets[first]);
    std::vector<ExpertWeights> run(experts.begin() + first, experts.begin() + end);
    if (run_offsets.back() > 0) {
      size_t halves = 0;
      for (size_t e = first; e < end; ++e)
        if (rows_of(e) > 0)
          for (const WeightRef* w : {&experts[e].w1, &experts[e].w3, &experts[e].w2})
            if (w->type == WeightType::Q4) halves += static_cast<size_t>(d * inter);
      auto* dequantised = reinterpret_cast<uint16_t*>(q4_arena(ctx, halves * sizeof(uint16_t), op));
      for (size_t e = first; e < end; ++e) {
        if (rows_of(e) == 0) continue;
        ExpertWeights& ew = run[e - first];
        for (auto [w, n, k] :
             {std::tuple<WeightRef*, int64_t, int64_t>{&ew.w1, inter, d}, {&ew.w3, inter, d}, {&ew.w2, d, inter}}) {
          if (w->type != WeightType::Q4) continue;
          const Q4Weight& q = q4_of(*w);
          q4_dequantize(ctx, op, q, n, k, dequantised);
          *w = {dequantised, q.scale_type};
          dequantised += n * k;
        }
      }
      grouped_swiglu(ctx, x_sorted + offsets[first] * d, run_offsets, run, d, inter, out_sorted + offsets[first] * d);
    }
    first = end;
  }
  if (ctx.sync_each_op) check(ctx, op, cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");
}

}  // namespace moe::kernels::cuda
