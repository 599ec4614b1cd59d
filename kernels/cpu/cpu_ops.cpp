#include "cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "moe/error.h"

namespace moe::kernels::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (m == 0) return;
  float beta = 0.0f;
  if (bias) {
    for (int64_t i = 0; i < m; ++i) std::copy(bias, bias + n, y + i * n);
    beta = 1.0f;
  }
  gemm(false, true, m, n, k, 1.0f, x, k, w, k, beta, y, n);
}

void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    double mean = 0.0;
    for (int64_t c = 0; c < cols; ++c) mean += xr[c];
    mean /= static_cast<double>(cols);
    double var = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double d = xr[c] - mean;
      var += d * d;
    }
    var /= static_cast<double>(cols);
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    const float m = static_cast<float>(mean);
    for (int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] - m) * inv * gamma[c] + beta[c];
  }
}

void gelu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
}

void quick_gelu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-1.702f * x[i]));
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void softmax_rows(float* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * cols;
    const float mx = *std::max_element(xr, xr + cols);
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      xr[c] = std::exp(xr[c] - mx);
      sum += xr[c];
    }
    const float inv = 1.0f / sum;
    for (int64_t c = 0; c < cols; ++c) xr[c] *= inv;
  }
}

void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * cols;
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
    const float norm = static_cast<float>(std::sqrt(ss));
    const float inv = 1.0f / (norm < eps ? eps : norm);  // a NaN norm stays NaN
    for (int64_t c = 0; c < cols; ++c) xr[c] *= inv;
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void attention(const float* q, const float* k, const float* v, int64_t ld, float* out, int64_t seq, int64_t heads,
               int64_t head_dim, bool causal, float* scratch) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t width = heads * head_dim;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t off = h * head_dim;
    // scores[i,j] = scale · q_i · k_j
    gemm(false, true, seq, seq, head_dim, scale, q + off, ld, k + off, ld, 0.0f, scratch, seq);
    for (int64_t i = 0; i < seq; ++i) {
      float* row = scratch + i * seq;
      const int64_t valid = causal ? i + 1 : seq;
      softmax_rows(row, 1, valid);
      std::fill(row + valid, row + seq, 0.0f);
    }
    gemm(false, false, seq, head_dim, seq, 1.0f, scratch, seq, v + off, ld, 0.0f, out + off, width);
  }
}

void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize, int32_t* ids,
                  float* weights) {
  std::vector<float> probs(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(logits + r * experts, logits + (r + 1) * experts, probs.begin());
    // All -inf: routed as equal logits (softmax of -inf - -inf would be NaN).
    if (*std::max_element(probs.begin(), probs.end()) == -INFINITY) std::fill(probs.begin(), probs.end(), 0.0f);
    softmax_rows(probs.data(), 1, experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return probs[a] != probs[b] ? probs[a] > probs[b] : a < b; });
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      ids[r * top_k + j] = order[j];
      weights[r * top_k + j] = renormalize ? probs[order[j]] / sum : probs[order[j]];
    }
  }
}

// ---- weights in f32 / f16 / bf16 -----------------------------------------------------------

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant · 2^-24, exact in f32
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  uint32_t bits;
  if (exp == 31)
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  else
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void weight_rows_to_f32(WeightRef w, int64_t cols, int64_t row0, int64_t rows, float* out) {
  const int64_t n = rows * cols;
  switch (w.type) {
    case WeightType::F32:
      std::copy_n(static_cast<const float*>(w.data) + row0 * cols, n, out);
      return;
    case WeightType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row0 * cols;
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(src[i]);
      return;
    }
    case WeightType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row0 * cols;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
      return;
    }
  }
  throw Error("cpu: unknown weight type " + std::to_string(static_cast<int>(w.type)));
}

void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (w.type == WeightType::F32) {
    linear(x, static_cast<const float*>(w.data), bias, y, m, n, k);
    return;
  }
  if (m == 0 || n == 0) return;
  if (bias)
    for (int64_t i = 0; i < m; ++i) std::copy(bias, bias + n, y + i * n);
  else
    std::fill(y, y + m * n, 0.0f);
  // Widen ~1 MiB of weight rows at a time; each block fills columns [n0, n0 + nb) of y.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(n, (int64_t{1} << 18) / std::max<int64_t>(k, 1)));
  std::vector<float> wf(static_cast<size_t>(block * k));
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t nb = std::min(block, n - n0);
    weight_rows_to_f32(w, k, n0, nb, wf.data());
    gemm(false, true, m, nb, k, 1.0f, x, k, wf.data(), k, 1.0f, y + n0, n);
  }
}

// ---- grouped MoE execution -------------------------------------------------------------------

void moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts, const float* x, int64_t cols,
                 float* x_sorted, int32_t* slot_of, int64_t* offsets) {
  const int64_t slots = rows * top_k;
  std::vector<int64_t> fill(static_cast<size_t>(experts), 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = ids[i];
    if (e == -1) continue;  // an unused slot (backend.h)
    if (e < 0 || e >= experts)
      throw Error("moe_permute: expert id " + std::to_string(e) + " at row " + std::to_string(i / top_k) +
                  " is outside [0, " + std::to_string(experts) + ")");
    ++fill[static_cast<size_t>(e)];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e) {
    offsets[e + 1] = offsets[e] + fill[static_cast<size_t>(e)];
    fill[static_cast<size_t>(e)] = offsets[e];
  }
  for (int64_t i = 0; i < slots; ++i) {
    if (ids[i] == -1) {
      slot_of[i] = -1;
      continue;
    }
    const int64_t slot = fill[static_cast<size_t>(ids[i])]++;
    slot_of[i] = static_cast<int32_t>(slot);
    std::copy_n(x + (i / top_k) * cols, cols, x_sorted + slot * cols);
  }
}

void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                    const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted) {
  int64_t most = 0;
  for (size_t e = 0; e < experts.size(); ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
  std::vector<float> gate(static_cast<size_t>(most * inter)), up(static_cast<size_t>(most * inter));
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    const float* x = x_sorted + offsets[e] * d;
    linear(x, experts[e].w1, nullptr, gate.data(), n, inter, d);
    linear(x, experts[e].w3, nullptr, up.data(), n, inter, d);
    silu_mul(gate.data(), up.data(), gate.data(), n * inter);
    linear(gate.data(), experts[e].w2, nullptr, out_sorted + offsets[e] * d, n, d, inter);
  }
}

void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows, int64_t top_k,
                   int64_t cols, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * cols;
    std::fill(yr, yr + cols, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      if (slot_of[r * top_k + j] < 0) continue;  // an unused slot
      const float w = weights[r * top_k + j];
      const float* src = out_sorted + static_cast<int64_t>(slot_of[r * top_k + j]) * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] += w * src[c];
    }
  }
}

// ---- search --------------------------------------------------------------------------------

void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                        int64_t* ids, float* scores) {
  if (nq == 0 || k == 0) return;
  struct Hit {
    float score;
    int64_t id;
  };
  // "a before b" in the result order: higher score, then lower index.
  const auto better = [](const Hit& a, const Hit& b) { return a.score != b.score ? a.score > b.score : a.id < b.id; };
  constexpr int64_t kQueryTile = 64, kBaseTile = 4096;
  std::vector<float> tile(static_cast<size_t>(kQueryTile * kBaseTile));
  std::vector<std::vector<Hit>> heaps(static_cast<size_t>(std::min(nq, kQueryTile)));
  for (int64_t q0 = 0; q0 < nq; q0 += kQueryTile) {
    const int64_t nqt = std::min(kQueryTile, nq - q0);
    for (auto& h : heaps) h.clear();
    for (int64_t b0 = 0; b0 < nb; b0 += kBaseTile) {
      const int64_t nbt = std::min(kBaseTile, nb - b0);
      gemm(false, true, nqt, nbt, d, 1.0f, queries + q0 * d, d, base + b0 * d, d, 0.0f, tile.data(), nbt);
      for (int64_t q = 0; q < nqt; ++q) {
        // A heap whose front is the worst kept hit.
        std::vector<Hit>& heap = heaps[static_cast<size_t>(q)];
        for (int64_t j = 0; j < nbt; ++j) {
          const Hit hit{tile[static_cast<size_t>(q * nbt + j)], b0 + j};
          if (static_cast<int64_t>(heap.size()) < k) {
            heap.push_back(hit);
            std::push_heap(heap.begin(), heap.end(), better);
          } else if (better(hit, heap.front())) {
            std::pop_heap(heap.begin(), heap.end(), better);
            heap.back() = hit;
            std::push_heap(heap.begin(), heap.end(), better);
          }
        }
      }
    }
    for (int64_t q = 0; q < nqt; ++q) {
      std::vector<Hit>& heap = heaps[static_cast<size_t>(q)];
      std::sort(heap.begin(), heap.end(), better);
      for (int64_t j = 0; j < k; ++j) {
        ids[(q0 + q) * k + j] = heap[static_cast<size_t>(j)].id;
        scores[(q0 + q) * k + j] = heap[static_cast<size_t>(j)].score;
      }
    }
  }
}

}  // namespace moe::kernels::cpu
