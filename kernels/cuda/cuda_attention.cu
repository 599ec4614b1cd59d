// Multi-head attention over packed short sequences (CLIP text ≤ 77 tokens, ViT ≤ a few hundred
// patches): one warp per (row, head). The warp's query (pre-scaled) sits in shared memory; keys
// are visited in chunks of 32, one key per lane (each lane computes a full q·k), then an online
// softmax update (running max m, running sum l, rescaled accumulator) and the value rows of the
// chunk are accumulated with every lane owning head_dim/32 output dimensions. fp32 throughout.
// Sequence boundaries: the prefix sums of seq_lens, uploaded once per call; a warp finds its
// sequence by binary search.
#include "cuda_common.h"
#include "cuda_device.cuh"

namespace moe::kernels::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxHeadDim = 128;
constexpr int kDimsPerLane = kMaxHeadDim / 32;

__global__ void attention_kernel(const float* qkv, float* out, const int64_t* starts, int64_t sequences,
                                 int64_t total_rows, int heads, int head_dim, bool causal, float scale) {
  __shared__ float q_shared[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= total_rows * heads) return;  // whole warps leave; no block-wide barrier below
  const int64_t row = item / heads;
  const int head = static_cast<int>(item % heads);

  // The last sequence whose start is ≤ row (empty sequences share their start with the next).
  int64_t lo = 0, hi = sequences - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (starts[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t start = starts[lo];
  const int64_t len = starts[lo + 1] - start;
  const int64_t valid = causal ? row - start + 1 : len;

  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  const int64_t stride = 3 * width;
  const float* q = qkv + row * stride + static_cast<int64_t>(head) * head_dim;
  const float* k_base = qkv + start * stride + width + static_cast<int64_t>(head) * head_dim;
  const float* v_base = k_base + width;
  float* qs = q_shared[warp];
  for (int d = lane; d < head_dim; d += 32) qs[d] = q[d] * scale;
  __syncwarp();

  float m = -INFINITY, l = 0.0f;
  float acc[kDimsPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t j0 = 0; j0 < valid; j0 += 32) {
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j < valid) {
      const float* kr = k_base + j * stride;
      float dot = 0.0f;
      for (int d = 0; d < head_dim; ++d) dot += qs[d] * kr[d];
      s = dot;
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: key j0 is always valid
    const float correction = expf(m - m_new);   // 0 on the first chunk (m = -inf)
    const float p = j < valid ? expf(s - m_new) : 0.0f;
    l = l * correction + warp_sum(p);
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= correction;
    const int chunk = static_cast<int>(valid - j0 < 32 ? valid - j0 : 32);
    for (int t = 0; t < chunk; ++t) {
      const float pt = __shfl_sync(kFullMask, p, t);
      const float* vr = v_base + (j0 + t) * stride;
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) acc[i] += pt * vr[d];
      }
    }
    m = m_new;
  }
  float* o = out + row * width + static_cast<int64_t>(head) * head_dim;
  const float inv = 1.0f / l;
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < head_dim) o[d] = acc[i] * inv;
  }
}

}  // namespace

std::string attention_limit(int64_t head_dim) {
  if (head_dim <= kMaxHeadDim) return {};
  return "head_dim " + std::to_string(head_dim) + " is larger than the CUDA kernel's " + std::to_string(kMaxHeadDim);
}

void attention(Ctx& ctx, const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t total_rows,
               int64_t heads, int64_t head_dim, bool causal) {
  if (const std::string why = attention_limit(head_dim); !why.empty()) fail(ctx, "attention", why);
  if (total_rows == 0) return;
  if (heads > INT32_MAX) fail(ctx, "attention", "too many heads");
  const int64_t items = total_rows * heads;
  const int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > INT32_MAX) fail(ctx, "attention", "too many rows · heads");
  std::vector<int64_t> starts(seq_lens.size() + 1, 0);
  for (size_t s = 0; s < seq_lens.size(); ++s) starts[s + 1] = starts[s] + seq_lens[s];
  int64_t* dev_starts = reinterpret_cast<int64_t*>(scratch(ctx, starts.size() * sizeof(int64_t), "attention"));
  upload(ctx, "attention", dev_starts, starts.data(), starts.size() * sizeof(int64_t));
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  attention_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, ctx.stream>>>(
      qkv, out, dev_starts, static_cast<int64_t>(seq_lens.size()), total_rows, static_cast<int>(heads),
      static_cast<int>(head_dim), causal, scale);
  check_launch(ctx, "attention", "attention_kernel");
}

}  // namespace moe::kernels::cuda
