// Exact inner-product top-k. Scores come in tiles (≤ 1024 queries × ≤ 16384 base vectors) from
// cublasGemmEx (fp32, COMPUTE_32F). After each tile, one block per query merges the tile with
// that query's running top-k (kept in the output arrays):
//   1. radix select (4 passes of 8 bits on an order-preserving u32 key of the score, shared
//      histograms) finds the key T of the k-th best candidate and how many candidates equal to
//      T are needed;
//   2. a stable compaction (block scans, candidates in index order) keeps every candidate above
//      T and the first needed ones equal to T — the running list holds lower indices than the
//      tile and is itself sorted by (score desc, index asc), so "first" is "lowest index";
//   3. a bitonic sort in shared memory orders the k winners by (score desc, index asc).
// k ≤ 1024 (the shared-memory sort).
#include <algorithm>
#include <climits>

#include "cuda_common.h"
#include "cuda_device.cuh"

namespace moe::kernels::cuda {

namespace {

constexpr int kSelectThreads = 512;
constexpr int64_t kBaseTile = 16384;
constexpr int64_t kQueryTile = 1024;

// Larger score ⇒ larger key; -0 and +0 share a key (they compare equal as floats).
__device__ __forceinline__ uint32_t score_key(float s) {
  if (s == 0.0f) s = 0.0f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_score(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// "a goes before b": higher key, then lower id.
__device__ __forceinline__ bool before(uint32_t ka, int64_t ia, uint32_t kb, int64_t ib) {
  return ka != kb ? ka > kb : ia < ib;
}

// Candidates of query blockIdx.x: first the running list (running entries), then the tile.
__global__ void select_topk_kernel(const float* tile, int64_t tile_len, int64_t tile_first_id, int64_t running,
                                   int64_t k, int64_t* ids, float* scores) {
  __shared__ int hist[256];
  __shared__ int scan_shared[33];
  __shared__ uint32_t prefix_shared;
  __shared__ int remaining_shared;
  __shared__ uint32_t sel_key[kMaxSearchK];
  __shared__ int64_t sel_id[kMaxSearchK];

  const int64_t q = blockIdx.x;
  const float* tile_row = tile + q * tile_len;
  int64_t* run_ids = ids + q * k;
  float* run_scores = scores + q * k;
  const int64_t n = running + tile_len;
  const int need = static_cast<int>(n < k ? n : k);
  const auto key_at = [&](int64_t i) { return score_key(i < running ? run_scores[i] : tile_row[i - running]); };

  // 1. Radix select, most significant byte first.
  uint32_t prefix = 0, mask = 0;
  int remaining = need;  // how many of the candidates matching `prefix` still have to be taken
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t key = key_at(i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, digit = 255;
      for (; digit > 0; --digit) {
        if (above + hist[digit] >= remaining) break;
        above += hist[digit];
      }
      prefix_shared = prefix | (static_cast<uint32_t>(digit) << shift);
      remaining_shared = remaining - above;
    }
    __syncthreads();
    prefix = prefix_shared;
    remaining = remaining_shared;
    mask |= 0xffu << shift;
  }
  const uint32_t threshold = prefix;
  const int greater = need - remaining;  // candidates strictly above the threshold

  // 2. Stable compaction: all keys > threshold, then the first `remaining` keys == threshold.
  int gt_seen = 0, eq_seen = 0;
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    uint32_t key = 0;
    bool gt = false, eq = false;
    if (i < n) {
      key = key_at(i);
      gt = key > threshold;
      eq = key == threshold;
    }
    // Two counters in one scan: greater-than in the low 16 bits, equal in the high 16 bits.
    int total;
    const int packed = block_exclusive_scan((gt ? 1 : 0) | (eq ? 1 << 16 : 0), scan_shared, &total);
    const int gt_rank = gt_seen + (packed & 0xffff), eq_rank = eq_seen + (packed >> 16);
    int pos = -1;
    if (gt) pos = gt_rank;
    if (eq && eq_rank < remaining) pos = greater + eq_rank;
    if (pos >= 0) {
      sel_key[pos] = key;
      sel_id[pos] = i < running ? run_ids[i] : tile_first_id + (i - running);
    }
    gt_seen += total & 0xffff;
    eq_seen += total >> 16;
  }
  // 3. Bitonic sort of the `need` winners, padded to a power of two with entries that sort last.
  int size = 1;
  while (size < need) size <<= 1;
  for (int i = need + threadIdx.x; i < size; i += blockDim.x) {
    sel_key[i] = 0;
    sel_id[i] = INT64_MAX;
  }
  __syncthreads();  // every read of the running list is done: it may be overwritten below
  for (int block = 2; block <= size; block <<= 1)
    for (int stride = block >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const bool first_half = (i & block) == 0;  // this run sorts "before" first
        const bool swap = first_half ? before(sel_key[j], sel_id[j], sel_key[i], sel_id[i])
                                     : before(sel_key[i], sel_id[i], sel_key[j], sel_id[j]);
        if (swap) {
          const uint32_t tk = sel_key[i];
          sel_key[i] = sel_key[j];
          sel_key[j] = tk;
          const int64_t ti = sel_id[i];
          sel_id[i] = sel_id[j];
          sel_id[j] = ti;
        }
      }
      __syncthreads();
    }
  for (int i = threadIdx.x; i < need; i += blockDim.x) {
    run_ids[i] = sel_id[i];
    run_scores[i] = key_score(sel_key[i]);
  }
}

}  // namespace

std::string inner_product_topk_limit(int64_t k) {
  if (k <= kMaxSearchK) return {};
  return "k = " + std::to_string(k) + " is larger than the CUDA kernel's " + std::to_string(kMaxSearchK);
}

void inner_product_topk(Ctx& ctx, const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                        int64_t* ids, float* scores) {
  const char* op = "inner_product_topk";
  if (const std::string why = inner_product_topk_limit(k); !why.empty()) fail(ctx, op, why);
  if (nq == 0 || k == 0) return;
  if (d > INT32_MAX) fail(ctx, op, "d beyond cuBLAS's int range");
  const int64_t base_tile = std::min(nb, kBaseTile);
  const int64_t query_tile = std::min(nq, kQueryTile);
  float* tile = reinterpret_cast<float*>(scratch(ctx, static_cast<size_t>(base_tile * query_tile) * sizeof(float), op));
  const float alpha = 1.0f, beta = 0.0f;
  for (int64_t q0 = 0; q0 < nq; q0 += query_tile) {
    const int64_t nqt = std::min(query_tile, nq - q0);
    for (int64_t b0 = 0; b0 < nb; b0 += base_tile) {
      const int64_t nbt = std::min(base_tile, nb - b0);
      // tile[q, j] = queries[q0 + q] · base[b0 + j]: column-major tileᵀ (nbt × nqt).
      if (d == 0) {
        check(ctx, op, cudaMemsetAsync(tile, 0, static_cast<size_t>(nqt * nbt) * sizeof(float), ctx.stream),
              "cudaMemsetAsync");
      } else {
        check(ctx, op,
              cublasGemmEx(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nbt), static_cast<int>(nqt),
                           static_cast<int>(d), &alpha, base + b0 * d, CUDA_R_32F, static_cast<int>(d),
                           queries + q0 * d, CUDA_R_32F, static_cast<int>(d), &beta, tile, CUDA_R_32F,
                           static_cast<int>(nbt), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
      }
      select_topk_kernel<<<static_cast<unsigned>(nqt), kSelectThreads, 0, ctx.stream>>>(
          tile, nbt, b0, std::min(k, b0), k, ids + q0 * k, scores + q0 * k);
      check_launch(ctx, op, "select_topk_kernel");
    }
  }
}

}  // namespace moe::kernels::cuda
