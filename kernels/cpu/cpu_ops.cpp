#include "cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace moe::kernels::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

void linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k) {
  if (m == 0) return;
  float beta = 0.0f;
  if (bias) {
    for (int64_t i = 0; i < m; ++i) std::copy(bias, bias + n, y + i * n);
    beta = 1.0f;
  }
  gemm(false, true, m, n, k, 1.0f, x, k, w, k, beta, y, n);
}

void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
                int64_t cols, float eps) {
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
    const float inv = 1.0f / std::max(static_cast<float>(std::sqrt(ss)), eps);
    for (int64_t c = 0; c < cols; ++c) xr[c] *= inv;
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void attention(const float* q, const float* k, const float* v, int64_t ld, float* out, int64_t seq,
               int64_t heads, int64_t head_dim, bool causal, float* scratch) {
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

void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k,
                  bool renormalize, int32_t* ids, float* weights) {
  std::vector<float> probs(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(logits + r * experts, logits + (r + 1) * experts, probs.begin());
    softmax_rows(probs.data(), 1, experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return probs[a] != probs[b] ? probs[a] > probs[b] : a < b;
    });
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      ids[r * top_k + j] = order[j];
      weights[r * top_k + j] = renormalize ? probs[order[j]] / sum : probs[order[j]];
    }
  }
}

}  // namespace moe::kernels::cpu
