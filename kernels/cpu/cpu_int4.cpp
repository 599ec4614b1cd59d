#include "cpu_int4.h"

// GCC 12's avx512fintrin.h builds results from deliberately undefined vectors (_mm512_undefined_*),
// which -Wuninitialized reports at every inlined use; the vector helpers here have internal
// linkage, so -Wpsabi's note on passing AVX vectors in a file compiled without -mavx does not apply.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu_gemm.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "moe/error.h"
#include "moe/quantized_weights.h"
#include "moe/tensor.h"

namespace moe::kernels::cpu {

namespace {

// One Q4 weight [n, k] seen as bytes (little-endian words): byte t of a row holds the codes of
// columns 2t (low nibble) and 2t + 1 (high nibble).
struct Layout {
  const uint8_t* codes;
  const uint16_t* scales;
  const int32_t* zeros;
  bool bf16;
  int64_t n, k, group, groups;

  const uint8_t* row(int64_t r) const { return codes + r * (k / 2); }
  uint16_t scale_bits(int64_t r, int64_t g) const { return scales[r * groups + g]; }
  int zero(int64_t r, int64_t g) const {
    return zeros ? static_cast<int>((static_cast<uint32_t>(zeros[(r / 8) * groups + g]) >> (4 * (r % 8))) & 0xFu) : 8;
  }
};

Layout layout_of(const Q4Weight& w, int64_t n, int64_t k, const char* op) {
  const std::string what = std::string("cpu: ") + op + ": ";
  if (!w.packed || !w.scales) throw Error(what + "the q4 weight has no data");
  if (w.scale_type != WeightType::F16 && w.scale_type != WeightType::BF16)
    throw Error(what + "q4 scales must be f16 or bf16");
  if (w.group_size <= 0 || w.group_size % 8 != 0 || k % w.group_size != 0)
    throw Error(what + "q4 group size " + std::to_string(w.group_size) +
                " must be a positive multiple of 8 that divides k = " + std::to_string(k));
  return {reinterpret_cast<const uint8_t*>(w.packed),
          static_cast<const uint16_t*>(w.scales),
          w.zero_points,
          w.scale_type == WeightType::BF16,
          n,
          k,
          w.group_size,
          k / w.group_size};
}

// The vector paths step through a group 32 (AVX-512) or 16 (AVX2) columns at a time.
Int4Isa usable_isa(Int4Isa isa, const Layout& L) {
  if (isa > int4_best_isa())
    throw Error(std::string("cpu: int4: this CPU cannot run the ") + int4_isa_name(isa) + " kernels");
  if (isa == Int4Isa::Avx512 && L.group % 32 != 0) isa = Int4Isa::Avx2;
  if (isa == Int4Isa::Avx2 && L.group % 16 != 0) isa = Int4Isa::Scalar;
  return isa;
}

// ---- plain C++ -------------------------------------------------------------------------------

void dequantize_rows_scalar(const Layout& L, int64_t r0, int64_t r1, float* dst) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* codes = L.row(r);
    float* out = dst + (r - r0) * L.k;
    for (int64_t g = 0; g < L.groups; ++g) {
      float lut[16];
      int4_group_values(L.scale_bits(r, g), L.bf16, L.zero(r, g), lut);
      for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; ++t) {
        out[2 * t] = lut[codes[t] & 0xF];
        out[2 * t + 1] = lut[codes[t] >> 4];
      }
    }
  }
}

// sums[i] = Σ_c x_i[c] · w[r, c] for the `rows` rows of xs (each k values: the even columns, then
// the odd ones).
void dot_rows_scalar(const Layout& L, int64_t r, const float* xs, int64_t rows, float* sums) {
  const uint8_t* codes = L.row(r);
  const int64_t half = L.k / 2;
  std::fill(sums, sums + rows, 0.0f);
  for (int64_t g = 0; g < L.groups; ++g) {
    float lut[16];
    int4_group_values(L.scale_bits(r, g), L.bf16, L.zero(r, g), lut);
    for (int64_t i = 0; i < rows; ++i) {
      const float* x = xs + i * L.k;
      float acc = 0.0f;
      for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; ++t)
        acc += lut[codes[t] & 0xF] * x[t] + lut[codes[t] >> 4] * x[half + t];
      sums[i] += acc;
    }
  }
}

// ---- AVX2 + FMA + F16C: 16 columns (8 bytes) a step, the 16 values in two registers ------------

// The scale widened in registers (the vector paths run F16C): no call inside the group loop.
__attribute__((target("avx2,fma,f16c"))) inline float scale_f16c(const Layout& L, int64_t r, int64_t g) {
  const uint16_t bits = L.scale_bits(r, g);
  if (!L.bf16) return _cvtsh_ss(bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

struct Lut8x2 {
  __m256 low, high;  // values of codes 0..7 and 8..15
};

__attribute__((target("avx2,fma,f16c"))) inline __m256 round_to_scale_type_avx2(__m256 p, bool bf16) {
  if (!bf16) return _mm256_cvtph_ps(_mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // float_to_bf16's round-to-nearest-even (the values are finite).
  __m256i b = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 values_avx2(__m256i codes, __m256i zero, __m256 scale,
                                                                   bool bf16) {
  return round_to_scale_type_avx2(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(codes, zero)), scale), bf16);
}

__attribute__((target("avx2,fma,f16c"))) inline Lut8x2 lut_avx2(const Layout& L, int64_t r, int64_t g) {
  const __m256 scale = _mm256_set1_ps(scale_f16c(L, r, g));
  const __m256i zero = _mm256_set1_epi32(L.zero(r, g));
  const __m256i codes_low = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i codes_high = _mm256_add_epi32(codes_low, _mm256_set1_epi32(8));
  return {values_avx2(codes_low, zero, scale, L.bf16), values_avx2(codes_high, zero, scale, L.bf16)};
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 lookup_avx2(const Lut8x2& lut, __m256i codes) {
  // Bit 3 of the code, moved to the sign bit, picks the high half.
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut.low, codes), _mm256_permutevar8x32_ps(lut.high, codes),
                          _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

// The codes of columns 2t..2t+15: even columns' values in `even`, odd columns' in `odd`.
__attribute__((target("avx2,fma,f16c"))) inline void decode16_avx2(const uint8_t* bytes, const Lut8x2& lut,
                                                                   __m256& even, __m256& odd) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  even = lookup_avx2(lut, _mm256_and_si256(v, _mm256_set1_epi32(0xF)));
  odd = lookup_avx2(lut, _mm256_srli_epi32(v, 4));
}

__attribute__((target("avx2,fma,f16c"))) void dequantize_rows_avx2(const Layout& L, int64_t r0, int64_t r1,
                                                                   float* dst) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* codes = L.row(r);
    float* out = dst + (r - r0) * L.k;
    for (int64_t g = 0; g < L.groups; ++g) {
      const Lut8x2 lut = lut_avx2(L, r, g);
      for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; t += 8) {
        __m256 even, odd;
        decode16_avx2(codes + t, lut, even, odd);
        const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
        _mm256_storeu_ps(out + 2 * t, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(out + 2 * t + 8, _mm256_permute2f128_ps(a, b, 0x31));
      }
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MB>
__attribute__((target("avx2,fma,f16c"))) void dot_rows_avx2(const Layout& L, int64_t r, const float* xs, float* sums) {
  const uint8_t* codes = L.row(r);
  const int64_t half = L.k / 2;
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < L.groups; ++g) {
    const Lut8x2 lut = lut_avx2(L, r, g);
    for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; t += 8) {
      __m256 even, odd;
      decode16_avx2(codes + t, lut, even, odd);
      for (int i = 0; i < MB; ++i) {
        const float* x = xs + i * L.k;
        acc[i] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + t), acc[i]);
        acc[i] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + half + t), acc[i]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) sums[i] = hsum_avx2(acc[i]);
}

// ---- AVX-512F: 32 columns (16 bytes) a step, the 16 values in one register ---------------------

__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 lut_avx512(const Layout& L, int64_t r, int64_t g) {
  const __m512i codes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(codes, _mm512_set1_epi32(L.zero(r, g)))),
                                 _mm512_set1_ps(scale_f16c(L, r, g)));
  if (!L.bf16) return _mm512_cvtph_ps(_mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m512i b = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) inline void decode32_avx512(const uint8_t* bytes, __m512 lut,
                                                                             __m512& even, __m512& odd) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  even = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)), lut);
  odd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
}

__attribute__((target("avx512f,avx2,fma,f16c"))) void dequantize_rows_avx512(const Layout& L, int64_t r0, int64_t r1,
                                                                             float* dst) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* codes = L.row(r);
    float* out = dst + (r - r0) * L.k;
    for (int64_t g = 0; g < L.groups; ++g) {
      const __m512 lut = lut_avx512(L, r, g);
      for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; t += 16) {
        __m512 even, odd;
        decode32_avx512(codes + t, lut, even, odd);
        _mm512_storeu_ps(out + 2 * t, _mm512_permutex2var_ps(even, first, odd));
        _mm512_storeu_ps(out + 2 * t + 16, _mm512_permutex2var_ps(even, second, odd));
      }
    }
  }
}

template <int MB>
__attribute__((target("avx512f,avx2,fma,f16c"))) void dot_rows_avx512(const Layout& L, int64_t r, const float* xs,
                                                                      float* sums) {
  const uint8_t* codes = L.row(r);
  const int64_t half = L.k / 2;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < L.groups; ++g) {
    const __m512 lut = lut_avx512(L, r, g);
    for (int64_t t = g * L.group / 2; t < (g + 1) * L.group / 2; t += 16) {
      __m512 even, odd;
      decode32_avx512(codes + t, lut, even, odd);
      for (int i = 0; i < MB; ++i) {
        const float* x = xs + i * L.k;
        acc[i] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x + t), acc[i]);
        acc[i] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + half + t), acc[i]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}

// ---- dispatch ----------------------------------------------------------------------------------

void dequantize_rows(Int4Isa isa, const Layout& L, int64_t r0, int64_t r1, float* dst) {
  switch (isa) {
    case Int4Isa::Avx512:
      return dequantize_rows_avx512(L, r0, r1, dst);
    case Int4Isa::Avx2:
      return dequantize_rows_avx2(L, r0, r1, dst);
    case Int4Isa::Scalar:
      return dequantize_rows_scalar(L, r0, r1, dst);
  }
}

// Rows of x per decoded weight row: as many accumulators as leave registers for the decoding.
constexpr int kAvx512Rows = 16, kAvx2Rows = 4;
using DotRows = void (*)(const Layout&, int64_t, const float*, float*);
constexpr DotRows kDotAvx512[kAvx512Rows + 1] = {nullptr,
                                                 dot_rows_avx512<1>,
                                                 dot_rows_avx512<2>,
                                                 dot_rows_avx512<3>,
                                                 dot_rows_avx512<4>,
                                                 dot_rows_avx512<5>,
                                                 dot_rows_avx512<6>,
                                                 dot_rows_avx512<7>,
                                                 dot_rows_avx512<8>,
                                                 dot_rows_avx512<9>,
                                                 dot_rows_avx512<10>,
                                                 dot_rows_avx512<11>,
                                                 dot_rows_avx512<12>,
                                                 dot_rows_avx512<13>,
                                                 dot_rows_avx512<14>,
                                                 dot_rows_avx512<15>,
                                                 dot_rows_avx512<16>};
constexpr DotRows kDotAvx2[kAvx2Rows + 1] = {nullptr, dot_rows_avx2<1>, dot_rows_avx2<2>, dot_rows_avx2<3>,
                                             dot_rows_avx2<4>};

// The direct path: x split into even and odd columns once, then every weight row decoded once
// per block of x rows (the row's codes stay in L1 across the blocks).
void linear_direct(Int4Isa isa, const Layout& L, const float* x, float* y, int64_t m) {
  const int64_t k = L.k, half = k / 2;
  std::vector<float> xs(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t t = 0; t < half; ++t) {
      xs[i * k + t] = x[i * k + 2 * t];
      xs[i * k + half + t] = x[i * k + 2 * t + 1];
    }
  const int64_t block = isa == Int4Isa::Avx512 ? kAvx512Rows : isa == Int4Isa::Avx2 ? kAvx2Rows : m;
  float sums[kAvx512Rows > kAvx2Rows ? kAvx512Rows : kAvx2Rows];
  std::vector<float> scalar_sums(isa == Int4Isa::Scalar ? static_cast<size_t>(m) : 0);
  for (int64_t r = 0; r < L.n; ++r) {
    for (int64_t i0 = 0; i0 < m; i0 += block) {
      const int64_t rows = std::min(block, m - i0);
      const float* xi = xs.data() + i0 * k;
      float* out = sums;
      switch (isa) {
        case Int4Isa::Avx512:
          kDotAvx512[rows](L, r, xi, sums);
          break;
        case Int4Isa::Avx2:
          kDotAvx2[rows](L, r, xi, sums);
          break;
        case Int4Isa::Scalar:
          dot_rows_scalar(L, r, xi, rows, scalar_sums.data());
          out = scalar_sums.data();
          break;
      }
      for (int64_t i = 0; i < rows; ++i) y[(i0 + i) * L.n + r] = out[i];
    }
  }
}

// Large batches: blocks of weight rows dequantised to f32, then the f32 GEMM. 1 MiB blocks (an L2
// on Zen 4): smaller ones make the GEMM repack x once per block (256 KiB measured 5-15 % slower at
// 64 rows, k 4096); larger ones leave L2 for no measured gain.
void linear_dequantized(Int4Isa isa, const Layout& L, const float* x, float* y, int64_t m) {
  const int64_t block = std::max<int64_t>(8, std::min<int64_t>(L.n, (1024 * 1024 / 4) / L.k));
  std::vector<float> w(static_cast<size_t>(block * L.k));
  for (int64_t r0 = 0; r0 < L.n; r0 += block) {
    const int64_t rows = std::min(block, L.n - r0);
    dequantize_rows(isa, L, r0, r0 + rows, w.data());
    gemm(false, true, m, rows, L.k, 1.0f, x, L.k, w.data(), L.k, 0.0f, y + r0, L.n);
  }
}

// linear_dequantized on the backend's GEMM and pool: each block of weight rows is dequantised by
// every thread of the pool (a share of the rows each), then multiplied by the oneDNN GEMM into a
// [m, rows] block that is copied into y's columns. Blocks of 1 MiB of f32 as above, but at least
// 256 rows: every GEMM call repacks x, so narrow blocks (64 rows at k 4096) cost a repack per 64
// outputs. Measured at d 1024, batch 256 (moe-bench-int4, one thread, against its f32 oneDNN
// column): 0.88x with 1 MiB blocks, 1.01x with 256 rows, 0.72x dequantising the whole weight.
void linear_dequantized_pooled(Int4Isa isa, const Layout& L, const float* x, const float* bias, float* y, int64_t m,
                               Gemm& gemm, ThreadPool& pool) {
  const int64_t block = std::min<int64_t>(L.n, std::max<int64_t>(256, (1024 * 1024 / 4) / L.k));
  std::vector<float> w(static_cast<size_t>(block * L.k));
  std::vector<float> out(block < L.n ? static_cast<size_t>(m * block) : 0);
  for (int64_t r0 = 0; r0 < L.n; r0 += block) {
    const int64_t rows = std::min(block, L.n - r0);
    const int tasks = static_cast<int>(std::min<int64_t>(pool.threads(), rows));
    pool.run(tasks, [&](int t) {
      const int64_t a = r0 + rows * t / tasks, b = r0 + rows * (t + 1) / tasks;
      dequantize_rows(isa, L, a, b, w.data() + (a - r0) * L.k);
    });
    const float* block_bias = bias ? bias + r0 : nullptr;
    if (rows == L.n) {  // one block: straight into y
      gemm.linear(x, {w.data(), WeightType::F32}, block_bias, y, m, rows, L.k);
      continue;
    }
    gemm.linear(x, {w.data(), WeightType::F32}, block_bias, out.data(), m, rows, L.k);
    for (int64_t i = 0; i < m; ++i) std::copy_n(out.data() + i * rows, rows, y + i * L.n + r0);
  }
}

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

Int4Isa detect_isa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  if (avx2 && __builtin_cpu_supports("avx512f")) return Int4Isa::Avx512;
  if (avx2) return Int4Isa::Avx2;
  return Int4Isa::Scalar;
}

}  // namespace

Int4Isa int4_best_isa() {
  static const Int4Isa best = detect_isa();
  return best;
}

const char* int4_isa_name(Int4Isa isa) {
  switch (isa) {
    case Int4Isa::Avx512:
      return "avx512";
    case Int4Isa::Avx2:
      return "avx2";
    case Int4Isa::Scalar:
      return "scalar";
  }
  return "unknown";
}

void dequantize_q4(const Q4Weight& w, int64_t n, int64_t k, float* dst, Int4Isa isa) {
  const Layout L = layout_of(w, n, k, "dequantize_q4");
  dequantize_rows(usable_isa(isa, L), L, 0, n, dst);
}

void linear_q4(const float* x, const Q4Weight& w, const float* bias, float* y, int64_t m, int64_t n, int64_t k,
               Int4Isa isa) {
  if (m < 0 || n < 0 || k < 0) throw Error("cpu: linear: negative size");
  if (m == 0 || n == 0) return;
  const Layout L = layout_of(w, n, k, "linear");
  isa = usable_isa(isa, L);
  if (m <= kInt4DirectMaxRows)
    linear_direct(isa, L, x, y, m);
  else
    linear_dequantized(isa, L, x, y, m);
  if (bias)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
}

void linear_q4(const float* x, const Q4Weight& w, const float* bias, float* y, int64_t m, int64_t n, int64_t k,
               Gemm& gemm, ThreadPool& pool, Int4Isa isa) {
  if (m <= kInt4DirectMaxRows) return linear_q4(x, w, bias, y, m, n, k, isa);
  if (n < 0 || k < 0) throw Error("cpu: linear: negative size");
  if (n == 0) return;
  const Layout L = layout_of(w, n, k, "linear");
  linear_dequantized_pooled(usable_isa(isa, L), L, x, bias, y, m, gemm, pool);
}

}  // namespace moe::kernels::cpu
