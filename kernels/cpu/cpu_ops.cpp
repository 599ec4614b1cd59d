#include "cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cpu_int4.h"
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

// ---- vector kernels --------------------------------------------------------------------------
//
// The element-wise, layer_norm, softmax and attention loops are plain C++ written for the
// compiler's vectoriser: selects instead of branches, no dependence between iterations, sums in
// explicit lanes. MOE_CPU_CLONES builds each of those functions three times, for x86-64-v4
// (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline x86-64 (SSE2), and the dynamic loader picks
// one by the CPU's features (GNU ifunc), so one build runs on any x86-64 and uses the widest
// vectors the machine has. The kernels library builds with -fno-trapping-math (kernels/meson.build):
// without it GCC keeps float selects as branches, and so scalar, below AVX-512. Nothing here reads
// the floating-point exception flags. GCC only: clang 14 accepts these clones in a namespace but
// builds one function, with AVX-512 instructions, that would fault on a CPU without them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define MOE_CPU_CLONED 1
#else
#define MOE_CPU_CLONES
#define MOE_CPU_CLONED 0
#endif

namespace {

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// e^x for vector loops: n = round(x / ln 2) by the 1.5·2^23 shift, r = x - n·ln 2 (ln 2 in two
// parts), e^r from Cephes' expf polynomial, times 2^n built in the exponent bits. Measured over
// every float in [-87.33, 88.37]: at most 8.5e-8 relative error (1.4 ulp), with and without FMA.
// Below -87.34 (where e^x is subnormal) it returns 0, above 88.376 +inf (e^x overflows at
// 88.723), NaN stays NaN.
inline float exp_f32(float x) {
  constexpr float kHi = 88.3762626647949f, kLo = -87.3365447504f, kRound = 12582912.0f;
  const bool over = x > kHi, under = x < kLo;
  x = over ? kHi : x;
  x = under ? kLo : x;
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const uint32_t two_to_n = (to_bits(shifted) - to_bits(kRound) + 127u) << 23;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const float y = p * from_bits(under ? 0u : two_to_n);
  return over ? INFINITY : y;
}

// erfc(|z|) by Abramowitz & Stegun 7.1.26 (|error| ≤ 1.5e-7) with exp_f32: measured at most
// 6.6e-7 absolute error in f32.
inline float erfc_abs(float z) {
  const float a = std::fabs(z);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return p * t * exp_f32(-a * a);
}

// Sums in this many lanes (one AVX-512 register) and then pairwise: vectorised, and accurate.
constexpr int64_t kLanes = 16;

inline float sum_lanes(float* lanes) {
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// Σ (x[c] - shift) over c < n.
inline float shifted_sum(const float* x, int64_t n, float shift) {
  float lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[c + l] - shift;
  for (int64_t l = 0; c + l < n; ++l) lanes[l] += x[c + l] - shift;
  return sum_lanes(lanes);
}

inline float sum_of_squares_about(const float* x, int64_t n, float center) {
  float lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += (x[c + l] - center) * (x[c + l] - center);
  for (int64_t l = 0; c + l < n; ++l) lanes[l] += (x[c + l] - center) * (x[c + l] - center);
  return sum_lanes(lanes);
}

inline float max_of(const float* x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -INFINITY);
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = x[c + l] > lanes[l] ? x[c + l] : lanes[l];
  for (int64_t l = 0; c + l < n; ++l) lanes[l] = x[c + l] > lanes[l] ? x[c + l] : lanes[l];
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lanes[l] = lanes[l + width] > lanes[l] ? lanes[l + width] : lanes[l];
  return lanes[0];
}

inline void softmax_row(float* x, int64_t n) {
  const float mx = max_of(x, n);
  for (int64_t c = 0; c < n; ++c) x[c] = exp_f32(x[c] - mx);
  const float inv = 1.0f / shifted_sum(x, n, 0.0f);
  for (int64_t c = 0; c < n; ++c) x[c] *= inv;
}

}  // namespace

// Corrected two-pass: mean m in f32, then d = x - m is exact for values near m (Sterbenz), and
// Σd/cols corrects m's rounding (Chan, Golub & LeVeque), so rows whose mean is large against their
// spread keep the accuracy of a double accumulation.
MOE_CPU_CLONES void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
                               int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    const float n = static_cast<float>(cols);
    const float m = shifted_sum(xr, cols, 0.0f) / n;
    const float correction = shifted_sum(xr, cols, m) / n;
    const float var = std::max(sum_of_squares_about(xr, cols, m) / n - correction * correction, 0.0f);
    const float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t c = 0; c < cols; ++c) yr[c] = ((xr[c] - m) - correction) * inv * gamma[c] + beta[c];
  }
}

// 0.5·x·(1 + erf(z)), z = x/√2, with 1 + erf(z) = erfc(-z): erfc(|z|) for z < 0, 2 - erfc(|z|)
// otherwise (no cancellation where 1 + erf(z) is small). Measured: at most 2.2e-7·(1 + |gelu(x)|).
MOE_CPU_CLONES void gelu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float z = x[i] * 0.70710678118654752f;
    const float e = erfc_abs(z);
    x[i] = 0.5f * x[i] * (z < 0.0f ? e : 2.0f - e);
  }
}

MOE_CPU_CLONES void quick_gelu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + exp_f32(-1.702f * x[i]));
}

MOE_CPU_CLONES void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
}

MOE_CPU_CLONES void softmax_rows(float* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) softmax_row(x + r * cols, cols);
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

MOE_CPU_CLONES void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Attention's inner products run on blocks of kBlockRows query rows × kLanes keys or value
// columns, summed in GCC vectors of kFloats floats that stay in registers: 8 floats (AVX2 and
// AVX-512 clones; 8 independent sums keep two FMA units busy) or 4 (SSE). The vectoriser does
// not keep such blocks in registers by itself, and GCC vectors wider than the clone's registers
// go through memory.
namespace {

constexpr int64_t kBlockRows = 4;
template <int64_t kFloats>
struct Vec;
template <>
struct Vec<4> {
  typedef float type __attribute__((vector_size(16)));
};
template <>
struct Vec<8> {
  typedef float type __attribute__((vector_size(32)));
};

// 8 where the CPU has AVX2 and FMA (the x86-64-v3 and v4 clones run there), else 4.
inline bool eight_float_vectors() {
#if MOE_CPU_CLONED
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#elif defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// One head at a time: its keys transposed ([head_dim, keys], so scores run along the keys) and its
// values copied ([seq, dims]), both padded with zeros to whole multiples of kLanes; then per block
// of query rows: scores, softmax, the weighted sum of the values. Only a block of rows of scores
// is live (scratch rows of seq floats). Inlined into each clone of attention().
template <int64_t kFloats>
__attribute__((always_inline)) inline void attention_in(const float* q, const float* k, const float* v, int64_t ld,
                                                        float* out, int64_t ldo, int64_t seq, int64_t heads,
                                                        int64_t head_dim, bool causal, float* scratch) {
  typedef typename Vec<kFloats>::type V;
  constexpr int64_t kParts = kLanes / kFloats;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t keys = round_up(seq, kLanes), dims = round_up(head_dim, kLanes);
  std::vector<float> keys_t(static_cast<size_t>(head_dim * keys), 0.0f), values(static_cast<size_t>(seq * dims), 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t off = h * head_dim;
    for (int64_t j = 0; j < seq; ++j) std::copy_n(v + j * ld + off, head_dim, values.data() + j * dims);
    for (int64_t j0 = 0; j0 < seq; j0 += kLanes)  // in tiles of kLanes keys: whole cache lines written
      for (int64_t c = 0; c < head_dim; ++c)
        for (int64_t j = j0; j < std::min(j0 + kLanes, seq); ++j)
          keys_t[static_cast<size_t>(c * keys + j)] = k[j * ld + off + c];
    for (int64_t i0 = 0; i0 < seq; i0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, seq - i0);
      const int64_t reach = causal ? i0 + rows : seq;  // keys any row of the block attends to
      // Rows past the sequence's end repeat its last row; their results are not stored.
      const float* query[kBlockRows];
      float* score[kBlockRows];  // scratch row r: the scores of query i0 + r
      for (int64_t r = 0; r < kBlockRows; ++r) {
        query[r] = q + std::min(i0 + r, seq - 1) * ld + off;
        score[r] = scratch + std::min(r, rows - 1) * seq;
      }
      for (int64_t j0 = 0; j0 < reach; j0 += kLanes) {
        V acc[kBlockRows][kParts] = {};
        for (int64_t c = 0; c < head_dim; ++c) {
          for (int64_t p = 0; p < kParts; ++p) {
            V kc;  // one load per vector: a wider copy goes through the stack
            std::memcpy(&kc, keys_t.data() + c * keys + j0 + p * kFloats, sizeof kc);
            for (int64_t r = 0; r < kBlockRows; ++r) acc[r][p] += query[r][c] * kc;
          }
        }
        float sums[kBlockRows][kLanes];  // copied out once: indexing acc by l would keep it in memory
        std::memcpy(sums, acc, sizeof sums);
        const int64_t n = std::min(kLanes, seq - j0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t l = 0; l < n; ++l) score[r][j0 + l] = sums[r][l] * scale;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t valid = causal ? i0 + r + 1 : seq;
        softmax_row(score[r], valid);
        std::fill(score[r] + valid, score[r] + reach, 0.0f);
      }
      for (int64_t c0 = 0; c0 < head_dim; c0 += kLanes) {
        V acc[kBlockRows][kParts] = {};
        for (int64_t j = 0; j < reach; ++j) {
          for (int64_t p = 0; p < kParts; ++p) {
            V vj;
            std::memcpy(&vj, values.data() + j * dims + c0 + p * kFloats, sizeof vj);
            for (int64_t r = 0; r < kBlockRows; ++r) acc[r][p] += score[r][j] * vj;
          }
        }
        float sums[kBlockRows][kLanes];
        std::memcpy(sums, acc, sizeof sums);
        const int64_t n = std::min(kLanes, head_dim - c0);
        for (int64_t r = 0; r < rows; ++r) std::copy_n(sums[r], n, out + (i0 + r) * ldo + off + c0);
      }
    }
  }
}

}  // namespace

MOE_CPU_CLONES void attention(const float* q, const float* k, const float* v, int64_t ld, float* out, int64_t ldo,
                              int64_t seq, int64_t heads, int64_t head_dim, bool causal, float* scratch) {
  if (eight_float_vectors())
    attention_in<8>(q, k, v, ld, out, ldo, seq, heads, head_dim, causal, scratch);
  else
    attention_in<4>(q, k, v, ld, out, ldo, seq, heads, head_dim, causal, scratch);
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

MOE_CPU_CLONES void f32_to_bf16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = to_bits(x[i]);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (b >> 16) | 0x40u;
    out[i] = static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
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
    case WeightType::Q4:
      throw Error("cpu: q4 weights are read by linear_q4 (cpu_int4.h), not widened row by row");
  }
  throw Error("cpu: unknown weight type " + std::to_string(static_cast<int>(w.type)));
}

void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (w.type == WeightType::F32) {
    linear(x, static_cast<const float*>(w.data), bias, y, m, n, k);
    return;
  }
  if (w.type == WeightType::Q4) {
    linear_q4(x, *static_cast<const Q4Weight*>(w.data), bias, y, m, n, k);
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
                    const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted,
                    const ExpertProjection& project) {
  const ExpertProjection by_linear = [](const float* x, WeightRef w, float* y, int64_t m, int64_t n, int64_t k) {
    linear(x, w, nullptr, y, m, n, k);
  };
  const ExpertProjection& proj = project ? project : by_linear;
  int64_t most = 0;
  for (size_t e = 0; e < experts.size(); ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
  std::vector<float> gate(static_cast<size_t>(most * inter)), up(static_cast<size_t>(most * inter));
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    const float* x = x_sorted + offsets[e] * d;
    proj(x, experts[e].w1, gate.data(), n, inter, d);
    proj(x, experts[e].w3, up.data(), n, inter, d);
    silu_mul(gate.data(), up.data(), gate.data(), n * inter);
    proj(gate.data(), experts[e].w2, out_sorted + offsets[e] * d, n, d, inter);
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
