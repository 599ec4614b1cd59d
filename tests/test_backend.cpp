// Backends behind one interface (kernels/backend.h).
// CpuBackend.*: the CPU backend against naive loops written here (double accumulation), tiny sizes.
// CudaBackend.*: every CUDA operation against the CPU backend on random inputs of realistic sizes
// (skipped, with the reason, where no GPU is present).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "backend.h"
#include "cpu_ops.h"
#include "moe/error.h"
#include "moe/tensor.h"
#include "moe_build_config.h"
#include "test_util.h"

using moe::kernels::Backend;
using moe::kernels::ExpertWeights;
using moe::kernels::WeightRef;
using moe::kernels::WeightType;
using moe::test::expect_error;

namespace {

std::vector<float> random_values(size_t n, unsigned seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// max |a - b| / max(max |ref|, floor).
double rel_error(const std::vector<float>& a, const std::vector<float>& ref, double floor = 1e-6) {
  EXPECT_EQ(a.size(), ref.size());
  double diff = 0.0, scale = floor;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - ref[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return diff / scale;
}

// ---- weights stored as f32 / f16 / bf16 -------------------------------------------------------

// A weight in host memory in one storage type, and its exact f32 value (what the reference uses).
struct HostWeight {
  WeightType type = WeightType::F32;
  std::vector<float> f32;      // storage when type == F32
  std::vector<uint16_t> bits;  // storage when f16/bf16
  std::vector<float> value;    // the stored value widened with moe::half_to_float / bf16_to_float

  const void* data() const { return type == WeightType::F32 ? static_cast<const void*>(f32.data()) : bits.data(); }
  size_t bytes() const { return type == WeightType::F32 ? f32.size() * 4 : bits.size() * 2; }
  WeightRef ref() const { return {data(), type}; }
};

HostWeight make_weight(WeightType type, int64_t rows, int64_t cols, unsigned seed, float stddev = 0.1f) {
  HostWeight w;
  w.type = type;
  const std::vector<float> v = random_values(static_cast<size_t>(rows * cols), seed, stddev);
  if (type == WeightType::F32) {
    w.f32 = v;
    w.value = v;
    return w;
  }
  w.bits.resize(v.size());
  w.value.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    w.bits[i] = type == WeightType::F16 ? moe::float_to_half(v[i]) : moe::float_to_bf16(v[i]);
    w.value[i] = type == WeightType::F16 ? moe::half_to_float(w.bits[i]) : moe::bf16_to_float(w.bits[i]);
  }
  return w;
}

// ---- naive references ----------------------------------------------------------------------

std::vector<float> naive_linear(const std::vector<float>& x, const std::vector<float>& w, const float* bias, int64_t m,
                                int64_t n, int64_t k) {
  std::vector<float> y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias ? bias[j] : 0.0;
      for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(x[i * k + c]) * w[j * k + c];
      y[i * n + j] = static_cast<float>(acc);
    }
  return y;
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// One SwiGLU expert on one row, in double.
std::vector<double> naive_expert(const float* x, const std::vector<float>& w1, const std::vector<float>& w3,
                                 const std::vector<float>& w2, int64_t d, int64_t inter) {
  std::vector<double> h(static_cast<size_t>(inter));
  for (int64_t i = 0; i < inter; ++i) {
    double g = 0.0, u = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      g += static_cast<double>(x[c]) * w1[i * d + c];
      u += static_cast<double>(x[c]) * w3[i * d + c];
    }
    h[i] = silu(g) * u;
  }
  std::vector<double> out(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) {
    double acc = 0.0;
    for (int64_t i = 0; i < inter; ++i) acc += h[i] * w2[c * inter + i];
    out[c] = acc;
  }
  return out;
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Softmax in double, stable sort by (probability desc, index asc).
Routing naive_topk_softmax(const std::vector<float>& logits, int64_t rows, int64_t experts, int64_t top_k,
                           bool renormalize) {
  Routing r;
  for (int64_t row = 0; row < rows; ++row) {
    const float* l = logits.data() + row * experts;
    const double mx = *std::max_element(l, l + experts);
    std::vector<double> p(static_cast<size_t>(experts));
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(l[e] - mx);
    for (double& v : p) v /= sum;
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double chosen = 0.0;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      r.ids.push_back(order[j]);
      r.weights.push_back(static_cast<float>(renormalize ? p[order[j]] / chosen : p[order[j]]));
    }
  }
  return r;
}

// Attention over packed sequences, per (sequence, head, row) in double.
std::vector<float> naive_attention(const std::vector<float>& qkv, const std::vector<int64_t>& lens, int64_t heads,
                                   int64_t hd, bool causal) {
  const int64_t width = heads * hd;
  int64_t total = 0;
  for (int64_t l : lens) total += l;
  std::vector<float> out(static_cast<size_t>(total * width));
  int64_t start = 0;
  for (int64_t len : lens) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i) {
        const float* q = qkv.data() + (start + i) * 3 * width + h * hd;
        const int64_t valid = causal ? i + 1 : len;
        std::vector<double> s(static_cast<size_t>(valid));
        double mx = -INFINITY;
        for (int64_t j = 0; j < valid; ++j) {
          const float* kk = qkv.data() + (start + j) * 3 * width + width + h * hd;
          double dot = 0.0;
          for (int64_t c = 0; c < hd; ++c) dot += static_cast<double>(q[c]) * kk[c];
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = 0.0;
        for (double& v : s) sum += v = std::exp(v - mx);
        for (int64_t c = 0; c < hd; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j < valid; ++j) acc += s[j] * qkv[(start + j) * 3 * width + 2 * width + h * hd + c];
          out[(start + i) * width + h * hd + c] = static_cast<float>(acc / sum);
        }
      }
    start += len;
  }
  return out;
}

// All nb scores per query in double, stable-sorted by (score desc, index asc), first k kept.
void naive_search(const std::vector<float>& q, int64_t nq, const std::vector<float>& base, int64_t nb, int64_t d,
                  int64_t k, std::vector<int64_t>& ids, std::vector<float>& scores) {
  ids.clear();
  scores.clear();
  for (int64_t i = 0; i < nq; ++i) {
    std::vector<double> s(static_cast<size_t>(nb));
    for (int64_t j = 0; j < nb; ++j) {
      double acc = 0.0;
      for (int64_t c = 0; c < d; ++c) acc += static_cast<double>(q[i * d + c]) * base[j * d + c];
      s[j] = acc;
    }
    std::vector<int64_t> order(static_cast<size_t>(nb));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    for (int64_t j = 0; j < k; ++j) {
      ids.push_back(order[j]);
      scores.push_back(static_cast<float>(s[order[j]]));
    }
  }
}

}  // namespace

// =================================================================================================
// CPU backend against naive loops
// =================================================================================================

TEST(CpuBackend, NameMemoryAndWeightTypes) {
  auto cpu = moe::kernels::make_cpu_backend();
  EXPECT_EQ(cpu->name(), "cpu");
  EXPECT_TRUE(cpu->is_host_memory());
  const moe::kernels::MemoryInfo info = cpu->memory_info();
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_EQ(moe::kernels::weight_type_size(WeightType::F32), 4u);
  EXPECT_EQ(moe::kernels::weight_type_size(WeightType::F16), 2u);
  EXPECT_EQ(moe::kernels::weight_type_size(WeightType::BF16), 2u);
  EXPECT_STREQ(moe::kernels::weight_type_name(WeightType::BF16), "bf16");
}

TEST(CpuBackend, MemoryCopies) {
  auto cpu = moe::kernels::make_cpu_backend();
  std::vector<float> src = random_values(1000, 1), back(1000);
  auto* a = static_cast<float*>(cpu->allocate(4000));
  auto* b = static_cast<float*>(cpu->allocate(4000));
  cpu->copy_from_host(a, src.data(), 4000);
  cpu->copy_on_device(b, a, 4000);
  cpu->synchronize();
  cpu->copy_to_host(back.data(), b, 4000);
  EXPECT_EQ(back, src);
  void* staging = cpu->allocate_host_staging(4000);
  auto ev = cpu->copy_from_host_async(a, staging, 0);
  EXPECT_TRUE(cpu->event_complete(*ev));  // synchronous without async_copies
  cpu->free_host_staging(staging);
  cpu->deallocate(a);
  cpu->deallocate(b);
}

TEST(CpuOps, HalfAndBfloatWideningMatchesTensorConversions) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float f = moe::kernels::cpu::f16_to_f32(bits), ref = moe::half_to_float(bits);
    if (std::isnan(ref))
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
    else
      ASSERT_EQ(std::memcmp(&f, &ref, 4), 0) << std::hex << b << " " << f << " vs " << ref;
    const float g = moe::kernels::cpu::bf16_to_f32(bits), gref = moe::bf16_to_float(bits);
    if (std::isnan(gref))
      ASSERT_TRUE(std::isnan(g)) << std::hex << b;
    else
      ASSERT_EQ(std::memcmp(&g, &gref, 4), 0) << std::hex << b;
  }
}

TEST(CpuBackend, LinearMatchesNaiveLoopForEveryWeightType) {
  auto cpu = moe::kernels::make_cpu_backend();
  // The second shape (1000 × 300) spans several widening blocks of the f16/bf16 path.
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 11}, {3, 1000, 300}, {1, 1, 1}}) {
    for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
      const std::vector<float> x = random_values(static_cast<size_t>(m * k), 2);
      const std::vector<float> bias = random_values(static_cast<size_t>(n), 3);
      const HostWeight w = make_weight(type, n, k, 4);
      for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
        std::vector<float> y(static_cast<size_t>(m * n), NAN);
        cpu->linear(x.data(), w.ref(), b, y.data(), m, n, k);
        EXPECT_LT(rel_error(y, naive_linear(x, w.value, b, m, n, k)), 1e-5)
            << moe::kernels::weight_type_name(type) << " " << m << "x" << n << "x" << k << (b ? " bias" : "");
      }
    }
  }
  float y = 1.0f;
  cpu->linear(nullptr, WeightRef{}, nullptr, &y, 0, 4, 4);  // m = 0: nothing to do, no weight needed
  EXPECT_EQ(y, 1.0f);
  expect_error([&] { cpu->linear(&y, WeightRef{}, nullptr, &y, 1, 1, 1); }, {"cpu", "linear", "no data"});
}

TEST(CpuBackend, LayerNormAndElementwiseMatchNaiveLoops) {
  auto cpu = moe::kernels::make_cpu_backend();
  const int64_t rows = 3, cols = 37;
  std::vector<float> x = random_values(rows * cols, 5, 2.0f);
  for (float& v : x) v += 5.0f;  // a large mean
  const std::vector<float> gamma = random_values(cols, 6), beta = random_values(cols, 7);
  std::vector<float> ref(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    for (int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= cols;
    for (int64_t c = 0; c < cols; ++c)
      ref[r * cols + c] = static_cast<float>((x[r * cols + c] - mean) / std::sqrt(var + 1e-5) * gamma[c] + beta[c]);
  }
  std::vector<float> y = x;
  cpu->layer_norm(y.data(), gamma.data(), beta.data(), y.data(), rows, cols, 1e-5f);  // in place
  EXPECT_LT(rel_error(y, ref), 1e-5);

  const std::vector<float> a = random_values(100, 8, 3.0f), b = random_values(100, 9, 3.0f);
  std::vector<float> g = a, qg = a, s = a, sum = a;
  cpu->gelu(g.data(), 100);
  cpu->quick_gelu(qg.data(), 100);
  cpu->silu_mul(s.data(), b.data(), s.data(), 100);  // out aliases gate
  cpu->add(sum.data(), b.data(), 100);
  for (size_t i = 0; i < a.size(); ++i) {
    const double v = a[i];
    EXPECT_NEAR(g[i], 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))), 1e-5 * (1 + std::fabs(v)));
    EXPECT_NEAR(qg[i], v / (1.0 + std::exp(-1.702 * v)), 1e-5 * (1 + std::fabs(v)));
    EXPECT_NEAR(s[i], silu(v) * b[i], 1e-5 * (1 + std::fabs(v * b[i])));
    EXPECT_EQ(sum[i], a[i] + b[i]);
  }
}

TEST(CpuBackend, L2NormalizeRows) {
  auto cpu = moe::kernels::make_cpu_backend();
  std::vector<float> x = {3, 4, 0, 0, 0, 0, 1, 1, 1};
  cpu->l2_normalize_rows(x.data(), 3, 3, 1e-12f);
  EXPECT_FLOAT_EQ(x[0], 0.6f);
  EXPECT_FLOAT_EQ(x[1], 0.8f);
  EXPECT_EQ(x[3], 0.0f);  // a zero row stays zero (eps clamp), no NaN
  EXPECT_NEAR(x[6], 1.0f / std::sqrt(3.0f), 1e-7);
}

TEST(CpuBackend, AttentionOverPackedSequencesMatchesNaiveLoop) {
  auto cpu = moe::kernels::make_cpu_backend();
  const std::vector<int64_t> lens = {3, 1, 0, 6, 4};
  const int64_t heads = 2, hd = 5, total = 14;
  const std::vector<float> qkv = random_values(static_cast<size_t>(total * 3 * heads * hd), 10);
  for (bool causal : {false, true}) {
    std::vector<float> out(static_cast<size_t>(total * heads * hd), NAN);
    cpu->attention(qkv.data(), out.data(), lens, heads, hd, causal);
    EXPECT_LT(rel_error(out, naive_attention(qkv, lens, heads, hd, causal)), 1e-5) << "causal " << causal;
  }
  float dummy = 0;
  expect_error([&] { cpu->attention(&dummy, &dummy, {1}, 0, 4, false); }, {"cpu", "attention", "positive"});
}

TEST(CpuBackend, TopkSoftmaxMatchesNaiveLoopWithTies) {
  auto cpu = moe::kernels::make_cpu_backend();
  const int64_t rows = 6, experts = 7;
  std::vector<float> logits = random_values(rows * experts, 11, 2.0f);
  // Ties: row 0 all equal, row 1 a tie for first place, row 2 a tie across the top-k boundary.
  for (int64_t e = 0; e < experts; ++e) logits[e] = 0.5f;
  logits[experts + 2] = logits[experts + 5] = 9.0f;
  logits[2 * experts + 1] = 9.0f;
  logits[2 * experts + 3] = logits[2 * experts + 6] = 8.0f;
  for (int64_t top_k : {int64_t{1}, int64_t{2}, int64_t{3}, experts})
    for (bool renorm : {false, true}) {
      std::vector<int32_t> ids(static_cast<size_t>(rows * top_k));
      std::vector<float> w(ids.size());
      cpu->topk_softmax(logits.data(), rows, experts, top_k, renorm, ids.data(), w.data());
      const Routing ref = naive_topk_softmax(logits, rows, experts, top_k, renorm);
      EXPECT_EQ(ids, ref.ids) << "top_k " << top_k;
      for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], ref.weights[i], 1e-6) << i;
    }
  int32_t id;
  float w;
  expect_error([&] { cpu->topk_softmax(logits.data(), 1, experts, experts + 1, true, &id, &w); },
               {"cpu", "topk_softmax", "top_k 8"});
}

namespace {

// permute → grouped_swiglu → unpermute on `b` against the per-row naive MoE. The experts' weight
// types cycle through `types`; expert `empty` gets no rows and no weights.
void check_moe_pipeline(Backend& b, const std::vector<WeightType>& types, double tol) {
  const int64_t rows = 9, top_k = 2, experts = 5, d = 6, inter = 4, empty = 3;
  const std::vector<float> x = random_values(rows * d, 12);
  std::vector<float> logits = random_values(rows * experts, 13, 2.0f);
  for (int64_t r = 0; r < rows; ++r) logits[r * experts + empty] = -100.0f;
  Routing routing = naive_topk_softmax(logits, rows, experts, top_k, true);
  std::vector<HostWeight> w1, w3, w2;
  std::vector<ExpertWeights> ew(experts);
  for (int64_t e = 0; e < experts; ++e) {
    const WeightType t = types[static_cast<size_t>(e) % types.size()];
    w1.push_back(make_weight(t, inter, d, 100 + e, 0.5f));
    w3.push_back(make_weight(t, inter, d, 200 + e, 0.5f));
    w2.push_back(make_weight(t, d, inter, 300 + e, 0.5f));
    if (e != empty) ew[e] = {w1.back().ref(), w3.back().ref(), w2.back().ref()};
  }
  const int64_t slots = rows * top_k;
  std::vector<float> x_sorted(static_cast<size_t>(slots * d), NAN), out_sorted(x_sorted.size(), NAN);
  std::vector<int32_t> slot_of(static_cast<size_t>(slots), -1);
  const std::vector<int64_t> offsets =
      b.moe_permute(routing.ids.data(), rows, top_k, experts, x.data(), d, x_sorted.data(), slot_of.data());

  // Offsets are the prefix sums of the counts; slots of an expert keep (row, j) order.
  ASSERT_EQ(offsets.size(), static_cast<size_t>(experts + 1));
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets[empty + 1] - offsets[empty], 0);
  EXPECT_EQ(offsets[experts], slots);
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = routing.ids[i];
    EXPECT_EQ(slot_of[i], next[e]++) << "slot of (" << i / top_k << ", " << i % top_k << ")";
    for (int64_t c = 0; c < d; ++c) EXPECT_EQ(x_sorted[slot_of[i] * d + c], x[(i / top_k) * d + c]);
  }

  b.grouped_swiglu(x_sorted.data(), offsets, ew, d, inter, out_sorted.data());
  std::vector<float> y(static_cast<size_t>(rows * d), NAN);
  b.moe_unpermute(out_sorted.data(), slot_of.data(), routing.weights.data(), rows, top_k, d, y.data());

  std::vector<float> ref(y.size(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> acc(static_cast<size_t>(d), 0.0);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = routing.ids[r * top_k + j];
      const std::vector<double> o = naive_expert(x.data() + r * d, w1[e].value, w3[e].value, w2[e].value, d, inter);
      for (int64_t c = 0; c < d; ++c) acc[c] += routing.weights[r * top_k + j] * o[c];
    }
    for (int64_t c = 0; c < d; ++c) ref[r * d + c] = static_cast<float>(acc[c]);
  }
  EXPECT_LT(rel_error(y, ref), tol);
}

}  // namespace

TEST(CpuBackend, MoePermuteSwigluUnpermuteEqualsPerRowMoe) {
  auto cpu = moe::kernels::make_cpu_backend();
  check_moe_pipeline(*cpu, {WeightType::F32}, 1e-5);
  check_moe_pipeline(*cpu, {WeightType::F16}, 1e-5);
  check_moe_pipeline(*cpu, {WeightType::BF16}, 1e-5);
  check_moe_pipeline(*cpu, {WeightType::F32, WeightType::BF16, WeightType::F16}, 1e-5);  // mixed experts
}

TEST(CpuBackend, MoeArgumentErrors) {
  auto cpu = moe::kernels::make_cpu_backend();
  const int32_t ids[2] = {0, 7};
  float x[4] = {}, xs[8];
  int32_t slot_of[2];
  expect_error([&] { cpu->moe_permute(ids, 1, 2, 4, x, 4, xs, slot_of); }, {"cpu", "moe_permute", "7", "[0, 4)"});
  std::vector<ExpertWeights> ew(2);
  expect_error([&] { cpu->grouped_swiglu(x, {0, 1}, ew, 4, 4, xs); }, {"cpu", "grouped_swiglu", "offsets"});
  expect_error([&] { cpu->grouped_swiglu(x, {0, 0, 1}, ew, 4, 4, xs); }, {"cpu", "grouped_swiglu", "expert 1 w1"});
}

TEST(CpuBackend, InnerProductTopkMatchesNaiveSearchWithTies) {
  auto cpu = moe::kernels::make_cpu_backend();
  // Small integers: every score is exact in f32, and there are many ties. nq and nb cross the
  // CPU's query (64) and base (4096) tiles.
  const int64_t nq = 70, nb = 5000, d = 4;
  std::mt19937 rng(14);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<float> q(nq * d), base(nb * d);
  for (float& v : q) v = static_cast<float>(small(rng));
  for (float& v : base) v = static_cast<float>(small(rng));
  for (int64_t k : {int64_t{1}, int64_t{10}, int64_t{100}}) {
    std::vector<int64_t> ids(static_cast<size_t>(nq * k)), ref_ids;
    std::vector<float> scores(ids.size()), ref_scores;
    cpu->inner_product_topk(q.data(), nq, base.data(), nb, d, k, ids.data(), scores.data());
    naive_search(q, nq, base, nb, d, k, ref_ids, ref_scores);
    EXPECT_EQ(ids, ref_ids) << "k " << k;
    EXPECT_EQ(scores, ref_scores) << "k " << k;
  }
  // k = nb on random floats.
  const std::vector<float> rq = random_values(3 * 8, 15), rb = random_values(20 * 8, 16);
  std::vector<int64_t> ids(60), ref_ids;
  std::vector<float> scores(60), ref_scores;
  cpu->inner_product_topk(rq.data(), 3, rb.data(), 20, 8, 20, ids.data(), scores.data());
  naive_search(rq, 3, rb, 20, 8, 20, ref_ids, ref_scores);
  EXPECT_EQ(ids, ref_ids);
  EXPECT_LT(rel_error(scores, ref_scores), 1e-6);
  expect_error([&] { cpu->inner_product_topk(rq.data(), 3, rb.data(), 20, 8, 21, ids.data(), scores.data()); },
               {"cpu", "inner_product_topk", "k = 21"});
}

TEST(CpuBackend, AsyncCopiesRunOnTheCopyQueueWhileOperationsRun) {
  auto cpu = moe::kernels::make_cpu_backend({/*async_copies=*/true});
  constexpr int kThreads = 4, kCopies = 50;
  constexpr size_t kFloats = 4096;
  // Each thread: its own staging source and destinations, many copies, waits on its events.
  std::vector<std::vector<float>> sources;
  for (int t = 0; t < kThreads; ++t) sources.push_back(random_values(kFloats, 20 + t));
  std::vector<float*> dst(kThreads * kCopies);
  for (float*& p : dst) p = static_cast<float*>(cpu->allocate(kFloats * 4));
  std::vector<std::vector<std::shared_ptr<moe::kernels::Event>>> events(kThreads);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      float* staging = static_cast<float*>(cpu->allocate_host_staging(kFloats * 4));
      std::copy(sources[t].begin(), sources[t].end(), staging);
      ++started;
      for (int c = 0; c < kCopies; ++c) {
        events[t].push_back(cpu->copy_from_host_async(dst[t * kCopies + c], staging, kFloats * 4));
        cpu->event_complete(*events[t].back());  // polled from this thread while others submit
        (void)cpu->memory_info();
      }
      // Copies complete in FIFO order: once the last one is done, all earlier ones are.
      while (!cpu->event_complete(*events[t].back())) std::this_thread::yield();
      for (const auto& e : events[t]) EXPECT_TRUE(cpu->event_complete(*e));
      cpu->free_host_staging(staging);
    });
  // Operations on the owner thread meanwhile.
  const std::vector<float> x = random_values(64 * 64, 30);
  const HostWeight w = make_weight(WeightType::F32, 64, 64, 31);
  std::vector<float> y(64 * 64);
  while (started < kThreads) std::this_thread::yield();
  for (int i = 0; i < 20; ++i) cpu->linear(x.data(), w.ref(), nullptr, y.data(), 64, 64, 64);
  EXPECT_LT(rel_error(y, naive_linear(x, w.value, nullptr, 64, 64, 64)), 1e-5);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    for (int c = 0; c < kCopies; ++c) {
      cpu->wait_event(*events[t][c]);
      ASSERT_EQ(std::memcmp(dst[t * kCopies + c], sources[t].data(), kFloats * 4), 0) << t << " " << c;
    }
  for (float* p : dst) cpu->deallocate(p);

  // wait_event blocks until the copy is done; the destructor drains pending copies.
  std::vector<float> big_src = random_values(1 << 20, 32), big_dst(big_src.size()), last(big_src.size());
  {
    auto b = moe::kernels::make_cpu_backend({true});
    std::shared_ptr<moe::kernels::Event> ev;
    for (int i = 0; i < 8; ++i) ev = b->copy_from_host_async(big_dst.data(), big_src.data(), big_src.size() * 4);
    b->wait_event(*ev);
    EXPECT_TRUE(b->event_complete(*ev));
    EXPECT_EQ(big_dst, big_src);
    for (int i = 0; i < 8; ++i) b->copy_from_host_async(last.data(), big_src.data(), big_src.size() * 4);
  }
  EXPECT_EQ(last, big_src);

  // An event of another backend is refused.
  auto other = moe::kernels::make_cpu_backend({true});
  float one = 1, into = 0;
  auto foreign = other->copy_from_host_async(&into, &one, 4);
  expect_error([&] { cpu->wait_event(*foreign); }, {"cpu", "wait_event", "another backend"});
  other->wait_event(*foreign);
  EXPECT_EQ(into, 1.0f);
}

// =================================================================================================
// CUDA backend against the CPU backend
// =================================================================================================

TEST(CudaBackend, L2NormalizeMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 7}, {1000, 512}, {33, 4099}}) {
    std::vector<float> host = random_values(static_cast<size_t>(rows * cols), static_cast<unsigned>(cols), 3.0f);
    std::vector<float> ref = host;
    moe::kernels::cpu::l2_normalize_rows(ref.data(), rows, cols);
    void* dev = gpu->allocate(host.size() * sizeof(float));
    gpu->copy_from_host(dev, host.data(), host.size() * sizeof(float));
    gpu->l2_normalize_rows(static_cast<float*>(dev), rows, cols, 1e-12f);
    gpu->copy_to_host(host.data(), dev, host.size() * sizeof(float));
    gpu->deallocate(dev);
    for (size_t i = 0; i < host.size(); ++i) ASSERT_NEAR(host[i], ref[i], 1e-6) << rows << "x" << cols << " at " << i;
  }
}

TEST(CudaBackend, UnavailableBackendSaysWhy) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(why.empty());
  try {
    moe::kernels::make_cuda_backend(0);
    ADD_FAILURE() << "make_cuda_backend succeeded without a device";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}
