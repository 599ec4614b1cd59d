// MoE routing and grouped expert execution.
//
// topk_softmax: one warp per row. The row's softmax (fp32: max, Σexp, ×1/Σ as the CPU does; a
//   row of -inf as equal logits) goes to shared memory; then top_k passes of a warp argmax (ties
//   to the lower index), the winner masked with -inf after each pass. Renormalisation divides by
//   the chosen weights' sum, accumulated in selection order.
// moe_permute: (1) count slots per expert with atomics (order-independent, so deterministic),
//   mark unused slots (id -1) with slot_of -1 and note the first invalid id; (2) one block scans the counts into
//   offsets; (3) one block per expert walks the slots in (row, j) order and ranks its matches with a block scan (a
//   stable counting sort: no atomics decide an order), writing slot_of and the source row of every slot; (4) one block
//   per slot gathers its row. The offsets (and the invalid-id flag) come back to the host with one copy.
// grouped_swiglu: cublasGemmGroupedBatchedEx, one group per active expert: w1 and w3 in one call,
//   silu_mul, then w2 (per weight type present; f16/bf16 cast the activations first, scaled per
//   row into f16's range where a stage has an f16 weight).
// moe_unpermute: one block per row sums its used weighted slots in j order (no atomics).
#include <algorithm>
#include <climits>

#include "cuda_common.h"
#include "cuda_device.cuh"

namespace moe::kernels::cuda {

namespace {

constexpr int kTopkWarps = 4;
// One row of f32 logits per warp in shared memory, within the 48 KiB a block gets by default.
constexpr int64_t kMaxTopkExperts = 48 * 1024 / sizeof(float);

__global__ void topk_softmax_kernel(const float* logits, int64_t rows, int experts, int top_k, bool renormalize,
                                    int32_t* ids, float* weights) {
  extern __shared__ float probs_shared[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (row >= rows) return;  // whole warps leave; only warp-level synchronisation below
  float* p = probs_shared + static_cast<int64_t>(warp) * experts;
  const float* l = logits + row * experts;
  float mx = -INFINITY;
  for (int e = lane; e < experts; e += 32) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  // All -inf: routed as equal logits, every exp(0) = 1 (exp(-inf - -inf) would be NaN).
  const bool all_minus_inf = mx == -INFINITY;
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    const float v = all_minus_inf ? 1.0f : expf(l[e] - mx);
    p[e] = v;
    sum += v;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int e = lane; e < experts; e += 32) p[e] *= inv;
  __syncwarp();
  float chosen = 0.0f;
  int32_t* row_ids = ids + row * top_k;
  float* row_w = weights + row * top_k;
  for (int j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int best_id = INT_MAX;
    for (int e = lane; e < experts; e += 32)
      if (p[e] > best) {  // ascending e: the first of equal values stays
        best = p[e];
        best_id = e;
      }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, best, offset);
      const int oi = __shfl_xor_sync(kFullMask, best_id, offset);
      if (ov > best || (ov == best && oi < best_id)) {
        best = ov;
        best_id = oi;
      }
    }
    chosen += best;
    if (lane == 0) {
      row_ids[j] = best_id;
      row_w[j] = best;
    }
    // best_id stays INT_MAX only when no entry compares > -inf (NaN logits): no slot to mask,
    // and the id is then rejected by moe_permute instead of writing past the shared row.
    if (best_id < experts && lane == (best_id & 31)) p[best_id] = -INFINITY;
    __syncwarp();
  }
  if (renormalize && lane == 0)
    for (int j = 0; j < top_k; ++j) row_w[j] = row_w[j] / chosen;
}

// counts[e] += 1 per slot of e; slot_of -1 for an unused slot (id -1); *first_bad = the lowest
// slot index with an invalid id.
__global__ void count_experts_kernel(const int32_t* ids, int64_t slots, int experts, int* counts, int32_t* slot_of,
                                     unsigned* first_bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < slots; i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t e = ids[i];
    if (e == -1)
      slot_of[i] = -1;
    else if (e < 0 || e >= experts)
      atomicMin(first_bad, static_cast<unsigned>(i));
    else
      atomicAdd(&counts[e], 1);
  }
}

// One block: offsets[0..experts] = exclusive prefix sums of counts.
__global__ void offsets_kernel(const int* counts, int experts, int* offsets) {
  __shared__ int shared[33];
  int carry = 0;
  for (int base = 0; base < experts; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int c = e < experts ? counts[e] : 0;
    int total;
    const int before = block_exclusive_scan(c, shared, &total);
    if (e < experts) offsets[e] = carry + before;
    carry += total;
  }
  if (threadIdx.x == 0) offsets[experts] = carry;
}

// Block e: the slots of expert e in (row, j) order get offsets[e], offsets[e] + 1, ...
__global__ void rank_slots_kernel(const int32_t* ids, int64_t slots, int top_k, const int* offsets, int32_t* slot_of,
                                  int32_t* source_row) {
  __shared__ int shared[33];
  const int e = blockIdx.x;
  int next = offsets[e];
  for (int64_t base = 0; base < slots; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool match = i < slots && ids[i] == e;
    int total;
    const int rank = block_exclusive_scan(match ? 1 : 0, shared, &total);
    if (match) {
      const int slot = next + rank;
      slot_of[i] = slot;
      source_row[slot] = static_cast<int32_t>(i / top_k);
    }
    next += total;
  }
}

__global__ void gather_rows_kernel(const float* x, const int32_t* source_row, int64_t cols, float* x_sorted) {
  const int64_t slot = blockIdx.x;
  const float* src = x + static_cast<int64_t>(source_row[slot]) * cols;
  float* dst = x_sorted + slot * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

__global__ void unpermute_kernel(const float* out_sorted, const int32_t* slot_of, const float* weights, int top_k,
                                 int64_t cols, float* y) {
  const int64_t row = blockIdx.x;
  const int32_t* slots = slot_of + row * top_k;
  const float* w = weights + row * top_k;
  float* yr = y + row * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j)
      if (slots[j] >= 0) acc += w[j] * out_sorted[static_cast<int64_t>(slots[j]) * cols + c];
    yr[c] = acc;
  }
}

}  // namespace

std::string topk_softmax_limit(int64_t experts) {
  if (experts <= kMaxTopkExperts) return {};
  return std::to_string(experts) + " experts: more than the kernel's " + std::to_string(kMaxTopkExperts);
}

void topk_softmax(Ctx& ctx, const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize,
                  int32_t* ids, float* weights) {
  if (rows == 0) return;
  if (const std::string why = topk_softmax_limit(experts); !why.empty()) fail(ctx, "topk_softmax", why);
  const size_t row_bytes = static_cast<size_t>(experts) * sizeof(float);
  const int warps = static_cast<int>(std::max<size_t>(1, std::min<size_t>(kTopkWarps, (32 * 1024) / row_bytes)));
  const int64_t blocks = (rows + warps - 1) / warps;
  if (blocks > INT32_MAX) fail(ctx, "topk_softmax", "too many rows");
  topk_softmax_kernel<<<static_cast<unsigned>(blocks), warps * 32, warps * row_bytes, ctx.stream>>>(
      logits, rows, static_cast<int>(experts), static_cast<int>(top_k), renormalize, ids, weights);
  check_launch(ctx, "topk_softmax", "topk_softmax_kernel");
}

std::vector<int64_t> moe_permute(Ctx& ctx, const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts,
                                 const float* x, int64_t cols, float* x_sorted, int32_t* slot_of) {
  const char* op = "moe_permute";
  if (experts > INT32_MAX - 2) fail(ctx, op, "too many experts");
  const int64_t slots = rows * top_k;
  // Layout: [counts (experts) | first_bad] and [offsets (experts + 1) | first_bad copy] in one
  // int buffer `meta` (copied back at once), then the source row of every slot.
  const auto layout = [&](Carver& c, int** meta, int32_t** source_row) {
    *meta = c.take<int>(2 * static_cast<size_t>(experts) + 3);
    *source_row = c.take<int32_t>(static_cast<size_t>(std::max<int64_t>(slots, 1)));
  };
  int* meta;
  int32_t* source_row;
  Carver measure;
  layout(measure, &meta, &source_row);
  Carver carve(scratch(ctx, measure.bytes(), op));
  layout(carve, &meta, &source_row);
  int* counts = meta;
  unsigned* first_bad = reinterpret_cast<unsigned*>(meta + experts);
  int* offsets = meta + experts + 1;  // experts + 1 entries, then a copy of first_bad

  check(ctx, op, cudaMemsetAsync(counts, 0, static_cast<size_t>(experts) * sizeof(int), ctx.stream), "cudaMemsetAsync");
  check(ctx, op, cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned), ctx.stream), "cudaMemsetAsync");
  if (slots > 0) {
    count_experts_kernel<<<grid_for(slots, 256), 256, 0, ctx.stream>>>(ids, slots, static_cast<int>(experts), counts,
                                                                       slot_of, first_bad);
    check_launch(ctx, op, "count_experts_kernel");
  }
  offsets_kernel<<<1, 1024, 0, ctx.stream>>>(counts, static_cast<int>(experts), offsets);
  check_launch(ctx, op, "offsets_kernel");
  check(ctx, op,
        cudaMemcpyAsync(offsets + experts + 1, first_bad, sizeof(unsigned), cudaMemcpyDeviceToDevice, ctx.stream),
        "cudaMemcpyAsync");
  // Ranking writes only slots of valid ids (bounded by the offsets), so it may run before the
  // ids are known to be valid; gathering reads source_row of every slot, so it waits.
  if (slots > 0) {
    rank_slots_kernel<<<static_cast<unsigned>(experts), 256, 0, ctx.stream>>>(ids, slots, static_cast<int>(top_k),
                                                                              offsets, slot_of, source_row);
    check_launch(ctx, op, "rank_slots_kernel");
  }
  std::vector<int> host(static_cast<size_t>(experts) + 2);
  check(ctx, op, cudaMemcpyAsync(host.data(), offsets, host.size() * sizeof(int), cudaMemcpyDeviceToHost, ctx.stream),
        "cudaMemcpyAsync(offsets to host)");
  check(ctx, op, cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");
  const auto bad = static_cast<unsigned>(host[static_cast<size_t>(experts) + 1]);
  if (bad != UINT_MAX) {
    int32_t id = 0;
    check(ctx, op, cudaMemcpy(&id, ids + bad, sizeof id, cudaMemcpyDeviceToHost), "cudaMemcpy(invalid id)");
    fail(ctx, op,
         "expert id " + std::to_string(id) + " at row " + std::to_string(bad / top_k) + " is outside [0, " +
             std::to_string(experts) + ")");
  }
  const int64_t sorted = host[static_cast<size_t>(experts)];
  if (sorted > 0 && cols > 0) {
    gather_rows_kernel<<<static_cast<unsigned>(sorted), 128, 0, ctx.stream>>>(x, source_row, cols, x_sorted);
    check_launch(ctx, op, "gather_rows_kernel");
  }
  return std::vector<int64_t>(host.begin(), host.begin() + experts + 1);
}

void grouped_swiglu(Ctx& ctx, const float* x_sorted, const std::vector<int64_t>& offsets,
                    const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted) {
  const char* op = "grouped_swiglu";
  const int64_t total = offsets.back();
  if (total == 0 || d == 0) return;
  if (inter == 0) {  // w2 · (nothing) = 0, as on the CPU
    check(ctx, op, cudaMemsetAsync(out_sorted, 0, static_cast<size_t>(total * d) * sizeof(float), ctx.stream),
          "cudaMemsetAsync");
    return;
  }
  std::vector<size_t> active;
  bool in_type[3] = {false, false, false}, down_type[3] = {false, false, false};
  for (size_t e = 0; e < experts.size(); ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    active.push_back(e);
    in_type[static_cast<int>(experts[e].w1.type)] = true;
    in_type[static_cast<int>(experts[e].w3.type)] = true;
    down_type[static_cast<int>(experts[e].w2.type)] = true;
  }
  const WeightType kHalfTypes[2] = {WeightType::F16, WeightType::BF16};
  // A stage (w1/w3, then w2) with an f16 weight feeds every one of its GEMMs the activations
  // scaled per row to fit f16's range (fit_rows_to_f16; exact for f32/bf16 too), so that one
  // factor per row scales all its outputs back: in the SwiGLU product, then in out_sorted.
  const bool fit_in = in_type[static_cast<int>(WeightType::F16)];
  const bool fit_down = down_type[static_cast<int>(WeightType::F16)];
  // Scratch: gate and up [total, inter] f32, the scaled inputs [total, d] and the per-row factors
  // where a stage needs them, the activations rounded to each half type that occurs, and room for
  // the device pointer arrays of the largest grouped call (w1 + w3).
  float *gate, *up, *x_fit, *in_unscale, *down_unscale;
  void* x_half[3] = {nullptr, nullptr, nullptr};
  void* h_half[3] = {nullptr, nullptr, nullptr};
  void** ptrs;
  const auto layout = [&](Carver& c) {
    gate = c.take<float>(static_cast<size_t>(total * inter));
    up = c.take<float>(static_cast<size_t>(total * inter));
    x_fit = fit_in ? c.take<float>(static_cast<size_t>(total * d)) : nullptr;
    in_unscale = fit_in ? c.take<float>(static_cast<size_t>(total)) : nullptr;
    down_unscale = fit_down ? c.take<float>(static_cast<size_t>(total)) : nullptr;
    for (WeightType t : kHalfTypes) {
      const int i = static_cast<int>(t);
      x_half[i] = in_type[i] ? c.take<uint16_t>(static_cast<size_t>(total * d)) : nullptr;
      h_half[i] = down_type[i] ? c.take<uint16_t>(static_cast<size_t>(total * inter)) : nullptr;
    }
    ptrs = c.take<void*>(6 * active.size());
  };
  Carver measure;
  layout(measure);
  Carver carve(scratch(ctx, measure.bytes(), op));
  layout(carve);

  const float* x_in = x_sorted;
  if (fit_in) {
    fit_rows_to_f16(ctx, op, x_sorted, total, d, x_fit, WeightType::F32, in_unscale);
    x_in = x_fit;
  }
  for (WeightType t : kHalfTypes)
    if (in_type[static_cast<int>(t)]) cast_from_f32(ctx, op, x_in, x_half[static_cast<int>(t)], t, total * d);
  const auto rows_of = [&](WeightType t, const float* f32, void* const* half, int64_t row, int64_t width) {
    return t == WeightType::F32
               ? static_cast<const void*>(f32 + row * width)
               : static_cast<const void*>(static_cast<const uint16_t*>(half[static_cast<int>(t)]) + row * width);
  };
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    std::vector<GemmProblem> problems;
    for (size_t e : active) {
      const int64_t o = offsets[e], n = offsets[e + 1] - o;
      const void* b = rows_of(t, x_in, x_half, o, d);
      if (experts[e].w1.type == t)
        problems.push_back({experts[e].w1.data, b, gate + o * inter, n, inter, d, d, d, inter});
      if (experts[e].w3.type == t)
        problems.push_back({experts[e].w3.data, b, up + o * inter, n, inter, d, d, d, inter});
    }
    grouped_gemm(ctx, op, t, problems, ptrs);
  }
  silu_mul_scaled_rows(ctx, op, gate, up, in_unscale, total, inter, gate);  // in_unscale null: no scaling
  if (fit_down) fit_rows_to_f16(ctx, op, gate, total, inter, gate, WeightType::F32, down_unscale);
  for (WeightType t : kHalfTypes)
    if (down_type[static_cast<int>(t)]) cast_from_f32(ctx, op, gate, h_half[static_cast<int>(t)], t, total * inter);
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    std::vector<GemmProblem> problems;
    for (size_t e : active) {
      const int64_t o = offsets[e], n = offsets[e + 1] - o;
      if (experts[e].w2.type == t)
        problems.push_back(
            {experts[e].w2.data, rows_of(t, gate, h_half, o, inter), out_sorted + o * d, n, d, inter, inter, inter, d});
    }
    grouped_gemm(ctx, op, t, problems, ptrs);
  }
  scale_rows_add_bias(ctx, op, out_sorted, down_unscale, nullptr, total, d);  // down_unscale null: nothing to do
  if (ctx.sync_each_op) check(ctx, op, cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");
}

void moe_unpermute(Ctx& ctx, const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows,
                   int64_t top_k, int64_t cols, float* y) {
  if (rows == 0 || cols == 0) return;
  if (rows > INT32_MAX) fail(ctx, "moe_unpermute", "more than 2^31 rows");
  unpermute_kernel<<<static_cast<unsigned>(rows), 128, 0, ctx.stream>>>(out_sorted, slot_of, weights,
                                                                        static_cast<int>(top_k), cols, y);
  check_launch(ctx, "moe_unpermute", "unpermute_kernel");
}

}  // namespace moe::kernels::cuda
