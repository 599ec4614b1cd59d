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
#include "compute_util.h"
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

TEST(CpuBackend, CopyToPeerBetweenHostBackends) {
  auto a = moe::kernels::make_cpu_backend(), b = moe::kernels::make_cpu_backend();
  const std::vector<float> src = random_values(1000, 2);
  std::vector<float> back(1000);
  auto* pa = static_cast<float*>(a->allocate(4000));
  auto* pb = static_cast<float*>(b->allocate(4000));
  a->copy_from_host(pa, src.data(), 4000);
  a->copy_to_peer(*b, pb, pa, 4000);
  b->copy_to_host(back.data(), pb, 4000);
  EXPECT_EQ(back, src);
  a->copy_to_peer(*a, pa + 500, pb, 2000);  // to itself: like copy_on_device
  a->copy_to_host(back.data(), pa, 4000);
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + 500, back.begin() + 500));
  a->deallocate(pa);
  b->deallocate(pb);
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
  std::vector<float> x = {3, 4, 0, 0, 0, 0, 1, 1, 1, 1, NAN, 2, 1, INFINITY, 2};
  cpu->l2_normalize_rows(x.data(), 5, 3, 1e-12f);
  EXPECT_FLOAT_EQ(x[0], 0.6f);
  EXPECT_FLOAT_EQ(x[1], 0.8f);
  EXPECT_EQ(x[3], 0.0f);  // a zero row stays zero (eps clamp), no NaN
  EXPECT_NEAR(x[6], 1.0f / std::sqrt(3.0f), 1e-7);
  // A NaN makes its whole row NaN (the eps clamp keeps a NaN norm), as torch's normalize.
  for (int c = 9; c < 12; ++c) EXPECT_TRUE(std::isnan(x[c])) << c;
  // An inf: finite values become 0, the inf NaN (inf / inf).
  EXPECT_EQ(x[12], 0.0f);
  EXPECT_TRUE(std::isnan(x[13]));
  EXPECT_EQ(x[14], 0.0f);
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

TEST(CpuBackend, TopkSoftmaxRoutesAnAllMinusInfRowAsEqualLogits) {
  auto cpu = moe::kernels::make_cpu_backend();
  const int64_t experts = 5, top_k = 2;
  // Row 0: every expert masked; row 1: all but experts 3 and 1.
  const std::vector<float> logits = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                                     -INFINITY, 0.5f,      -INFINITY, 2.0f,      -INFINITY};
  for (bool renorm : {false, true}) {
    std::vector<int32_t> ids(4);
    std::vector<float> w(4);
    cpu->topk_softmax(logits.data(), 2, experts, top_k, renorm, ids.data(), w.data());
    EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 3, 1}));
    const float equal = renorm ? 0.5f : 1.0f / experts;
    EXPECT_EQ(w[0], equal);
    EXPECT_EQ(w[1], equal);
    const Routing ref = naive_topk_softmax({logits.begin() + experts, logits.end()}, 1, experts, top_k, renorm);
    EXPECT_NEAR(w[2], ref.weights[0], 1e-6);
    EXPECT_NEAR(w[3], ref.weights[1], 1e-6);
    // The ids are valid for the next step.
    const std::vector<float> x(2 * 3, 1.0f);
    std::vector<float> xs(4 * 3);
    std::vector<int32_t> slot_of(4);
    EXPECT_EQ(cpu->moe_permute(ids.data(), 2, top_k, experts, x.data(), 3, xs.data(), slot_of.data()),
              (std::vector<int64_t>{0, 1, 3, 3, 4, 4}));
  }
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
  // Staging is allocated by the owner thread (only the async copy, event_complete and
  // memory_info may be called from other threads).
  std::vector<float*> staging(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    staging[t] = static_cast<float*>(cpu->allocate_host_staging(kFloats * 4));
    std::copy(sources[t].begin(), sources[t].end(), staging[t]);
  }
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      ++started;
      for (int c = 0; c < kCopies; ++c) {
        events[t].push_back(cpu->copy_from_host_async(dst[t * kCopies + c], staging[t], kFloats * 4));
        cpu->event_complete(*events[t].back());  // polled from this thread while others submit
        (void)cpu->memory_info();
      }
      // Copies complete in FIFO order: once the last one is done, all earlier ones are.
      while (!cpu->event_complete(*events[t].back())) std::this_thread::yield();
      for (const auto& e : events[t]) EXPECT_TRUE(cpu->event_complete(*e));
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
  for (float* p : staging) cpu->free_host_staging(p);

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

// Tolerances (max |gpu - cpu| / max |cpu|), as backend.h's contract states: f32 paths 1e-4. With
// f16/bf16 weights the GPU rounds the activations (x, and the SwiGLU product in grouped_swiglu) to
// the weight's type before the tensor-core GEMM (cuBLAS needs one input type) while the CPU keeps
// them in f32: 1e-2 (bf16 keeps 8 significant bits, about 4e-3 per value). Activations beyond
// f16's 65504 are scaled per row into its range first: the same 1e-2, and never inf.
namespace {

constexpr double kF32Tol = 1e-4;
constexpr double kHalfTol = 1e-2;

double tolerance(WeightType t) { return t == WeightType::F32 ? kF32Tol : kHalfTol; }

// A buffer in a backend's memory; uploads synchronise so the host source may go away.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& b, size_t n) : b_(b), n_(n), p_(static_cast<T*>(b.allocate(std::max<size_t>(n, 1) * sizeof(T)))) {}
  DeviceBuffer(Backend& b, const std::vector<T>& host) : DeviceBuffer(b, host.size()) {
    b_.copy_from_host(p_, host.data(), n_ * sizeof(T));
    b_.synchronize();
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { moe::detail::deallocate_noexcept(b_, p_); }
  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> v(n_);
    b_.copy_to_host(v.data(), p_, n_ * sizeof(T));
    return v;
  }

 private:
  Backend& b_;
  size_t n_;
  T* p_;
};

// A weight's bytes in a backend's memory.
struct DeviceWeight {
  DeviceWeight(Backend& b, const HostWeight& w)
      : bytes(b, std::vector<uint8_t>(static_cast<const uint8_t*>(w.data()),
                                      static_cast<const uint8_t*>(w.data()) + w.bytes())),
        type(w.type) {}
  WeightRef ref() const { return {bytes.get(), type}; }
  DeviceBuffer<uint8_t> bytes;
  WeightType type;
};

std::vector<int64_t> random_lengths(size_t count, int64_t max_len, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, max_len);
  std::vector<int64_t> lens(count);
  for (int64_t& l : lens) l = len(rng);
  lens[0] = max_len;
  return lens;
}

}  // namespace

TEST(CudaBackend, MemoryCopiesAndEvents) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  EXPECT_EQ(gpu->name(), "cuda:0");
  EXPECT_FALSE(gpu->is_host_memory());
  const moe::kernels::MemoryInfo info = gpu->memory_info();
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);

  const std::vector<float> src = random_values(1 << 16, 40);
  DeviceBuffer<float> a(*gpu, src), b(*gpu, src.size());
  gpu->copy_on_device(b.get(), a.get(), src.size() * 4);
  EXPECT_EQ(b.host(), src);

  // Asynchronous copies from several threads into separate buffers while operations run on the
  // compute stream; each thread waits for its own events.
  constexpr int kThreads = 4, kCopies = 16;
  constexpr size_t kFloats = 1 << 18;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dst;
  for (int i = 0; i < kThreads * kCopies; ++i) dst.push_back(std::make_unique<DeviceBuffer<float>>(*gpu, kFloats));
  std::vector<std::vector<float>> sources;
  for (int t = 0; t < kThreads; ++t) sources.push_back(random_values(kFloats, 41 + t));
  std::vector<std::vector<std::shared_ptr<moe::kernels::Event>>> events(kThreads);
  std::vector<float*> staging(kThreads);  // allocated by the owner thread
  for (int t = 0; t < kThreads; ++t) {
    staging[t] = static_cast<float*>(gpu->allocate_host_staging(kFloats * 4));
    std::copy(sources[t].begin(), sources[t].end(), staging[t]);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCopies; ++c) {
        events[t].push_back(gpu->copy_from_host_async(dst[t * kCopies + c]->get(), staging[t], kFloats * 4));
        (void)gpu->memory_info();
      }
      while (!gpu->event_complete(*events[t].back())) std::this_thread::yield();
      for (const auto& e : events[t]) EXPECT_TRUE(gpu->event_complete(*e));
    });
  const std::vector<float> ones(kFloats, 1.0f);
  DeviceBuffer<float> acc(*gpu, ones), inc(*gpu, ones);
  for (int i = 0; i < 100; ++i) gpu->add(acc.get(), inc.get(), kFloats);
  for (auto& th : threads) th.join();
  EXPECT_EQ(acc.host(), std::vector<float>(kFloats, 101.0f));
  for (int t = 0; t < kThreads; ++t)
    for (int c = 0; c < kCopies; ++c) ASSERT_EQ(dst[t * kCopies + c]->host(), sources[t]) << t << " " << c;
  for (float* p : staging) gpu->free_host_staging(p);

  // wait_event orders the compute stream after the copy: add the freshly copied data.
  float* twos = static_cast<float*>(gpu->allocate_host_staging(kFloats * 4));
  std::fill(twos, twos + kFloats, 2.0f);
  DeviceBuffer<float> fresh(*gpu, kFloats), sum(*gpu, ones);
  auto ev = gpu->copy_from_host_async(fresh.get(), twos, kFloats * 4);
  gpu->wait_event(*ev);
  gpu->add(sum.get(), fresh.get(), kFloats);
  EXPECT_EQ(sum.host(), std::vector<float>(kFloats, 3.0f));
  EXPECT_TRUE(gpu->event_complete(*ev));
  gpu->free_host_staging(twos);

  auto cpu = moe::kernels::make_cpu_backend();
  float x = 0, y = 1;
  auto foreign = cpu->copy_from_host_async(&x, &y, 4);
  expect_error([&] { gpu->wait_event(*foreign); }, {"cuda:0", "wait_event", "another backend"});
  expect_error([&] { gpu->allocate(size_t{1} << 50); }, {"cuda:0", "allocate", "out of device memory"});
  gpu->synchronize();  // the failed allocation left no error behind
}

// Two backends (cuda:0 and cuda:1, or two on cuda:0 with their own streams): a copy sees the work
// queued before it on the source, and work queued after it on the destination sees the copy.
TEST(CudaBackend, CopyToPeerIsOrderedWithBothQueues) {
  std::string why;
  const int n = moe::kernels::cuda_device_count(&why);
  if (n == 0) GTEST_SKIP() << why;
  auto a = moe::kernels::make_cuda_backend(0), b = moe::kernels::make_cuda_backend(n > 1 ? 1 : 0);
  const size_t count = size_t{1} << 22;  // 16 MiB: long enough for a missing fence to show
  const std::vector<float> x = random_values(count, 60), y = random_values(count, 61);
  DeviceBuffer<float> xa(*a, x), ya(*a, y), on_b(*b, count), back(*a, count);
  a->add(xa.get(), ya.get(), static_cast<int64_t>(count));  // queued on a before the copy
  a->copy_to_peer(*b, on_b.get(), xa.get(), count * 4);
  b->l2_normalize_rows(on_b.get(), 1024, static_cast<int64_t>(count / 1024), 1e-12f);  // after the copy, on b
  b->copy_to_peer(*a, back.get(), on_b.get(), count * 4);
  std::vector<float> want(x);
  moe::kernels::cpu::add_inplace(want.data(), y.data(), static_cast<int64_t>(count));
  moe::kernels::cpu::l2_normalize_rows(want.data(), 1024, static_cast<int64_t>(count / 1024));
  EXPECT_LT(rel_error(back.host(), want), kF32Tol);

  auto cpu = moe::kernels::make_cpu_backend();
  std::vector<float> host(16);
  expect_error([&] { a->copy_to_peer(*cpu, host.data(), xa.get(), 64); }, {"cuda:0", "copy_to_peer", "cpu"});
  expect_error([&] { cpu->copy_to_peer(*a, xa.get(), host.data(), 64); }, {"copy_to_peer", "cuda:0", "host memory"});
}

TEST(CudaBackend, LinearMatchesCpuForEveryWeightType) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 768, 768}, {308, 2304, 768}, {1000, 512, 768},
                         {7, 33, 5}}) {
    const std::vector<float> x = random_values(static_cast<size_t>(m * k), 50);
    const std::vector<float> bias = random_values(static_cast<size_t>(n), 51);
    DeviceBuffer<float> dx(*gpu, x), dbias(*gpu, bias), dy(*gpu, static_cast<size_t>(m * n));
    for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
      const HostWeight w = make_weight(type, n, k, 52, 0.05f);
      DeviceWeight dw(*gpu, w);
      for (bool with_bias : {false, true}) {
        std::vector<float> ref(static_cast<size_t>(m * n));
        cpu->linear(x.data(), w.ref(), with_bias ? bias.data() : nullptr, ref.data(), m, n, k);
        gpu->linear(dx.get(), dw.ref(), with_bias ? dbias.get() : nullptr, dy.get(), m, n, k);
        EXPECT_LT(rel_error(dy.host(), ref), tolerance(type))
            << moe::kernels::weight_type_name(type) << " " << m << "x" << n << "x" << k << (with_bias ? " bias" : "");
      }
    }
  }
}

TEST(CudaBackend, F16LinearScalesActivationsBeyondItsRange) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  const int64_t m = 6, n = 300, k = 512;
  // Rows of growing magnitude: 1 (no scaling), then up to 1e30 (far beyond 65504), and a row
  // with an inf, which stays inf/NaN as in f32.
  std::vector<float> x = random_values(static_cast<size_t>(m * k), 53);
  const float row_scale[m] = {1.0f, 3e4f, 1e5f, 1e9f, 1e30f, 1.0f};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) x[r * k + c] *= row_scale[r];
  x[5 * k + 7] = INFINITY;
  const std::vector<float> bias = random_values(static_cast<size_t>(n), 54);
  const HostWeight w = make_weight(WeightType::F16, n, k, 55, 0.05f);
  DeviceBuffer<float> dx(*gpu, x), dbias(*gpu, bias), dy(*gpu, static_cast<size_t>(m * n));
  DeviceWeight dw(*gpu, w);
  std::vector<float> ref(static_cast<size_t>(m * n));
  cpu->linear(x.data(), w.ref(), bias.data(), ref.data(), m, n, k);
  gpu->linear(dx.get(), dw.ref(), dbias.get(), dy.get(), m, n, k);
  const std::vector<float> got = dy.host();
  for (int64_t r = 0; r < m; ++r) {
    const std::vector<float> got_row(got.begin() + r * n, got.begin() + (r + 1) * n);
    const std::vector<float> ref_row(ref.begin() + r * n, ref.begin() + (r + 1) * n);
    if (r == 5) {
      for (int64_t j = 0; j < n; ++j)
        EXPECT_EQ(std::isfinite(got_row[j]), std::isfinite(ref_row[j])) << "row with an inf, column " << j;
      continue;
    }
    EXPECT_TRUE(std::all_of(got_row.begin(), got_row.end(), [](float v) { return std::isfinite(v); })) << "row " << r;
    EXPECT_LT(rel_error(got_row, ref_row), kHalfTol) << "row " << r << " (activations ~" << row_scale[r] << ")";
  }
}

TEST(CudaBackend, LayerNormAndElementwiseMatchCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 512}, {77, 768}, {1000, 768}, {3, 1000}}) {
    std::vector<float> x = random_values(static_cast<size_t>(rows * cols), 60, 2.0f);
    for (float& v : x) v += 3.0f;
    const std::vector<float> gamma = random_values(cols, 61), beta = random_values(cols, 62);
    std::vector<float> ref(x.size());
    cpu->layer_norm(x.data(), gamma.data(), beta.data(), ref.data(), rows, cols, 1e-5f);
    DeviceBuffer<float> dx(*gpu, x), dg(*gpu, gamma), db(*gpu, beta);
    gpu->layer_norm(dx.get(), dg.get(), db.get(), dx.get(), rows, cols, 1e-5f);  // in place
    EXPECT_LT(rel_error(dx.host(), ref), kF32Tol) << rows << "x" << cols;
  }
  const size_t n = 1000 * 3072 + 5;
  const std::vector<float> a = random_values(n, 63, 3.0f), b = random_values(n, 64, 3.0f);
  DeviceBuffer<float> da(*gpu, a), db(*gpu, b);
  const auto run = [&](auto&& gpu_op, auto&& cpu_op, const char* what) {
    DeviceBuffer<float> d(*gpu, a);
    std::vector<float> ref = a;
    gpu_op(d.get());
    cpu_op(ref.data());
    EXPECT_LT(rel_error(d.host(), ref), 1e-5) << what;
  };
  const auto N = static_cast<int64_t>(n);
  run([&](float* p) { gpu->gelu(p, N); }, [&](float* p) { cpu->gelu(p, N); }, "gelu");
  run([&](float* p) { gpu->quick_gelu(p, N); }, [&](float* p) { cpu->quick_gelu(p, N); }, "quick_gelu");
  run([&](float* p) { gpu->silu_mul(p, db.get(), p, N); }, [&](float* p) { cpu->silu_mul(p, b.data(), p, N); },
      "silu_mul");
  run([&](float* p) { gpu->silu_mul(da.get(), p, p, N); }, [&](float* p) { cpu->silu_mul(a.data(), p, p, N); },
      "silu_mul (out aliases up)");
  run([&](float* p) { gpu->add(p, db.get(), N); }, [&](float* p) { cpu->add(p, b.data(), N); }, "add");
}

TEST(CudaBackend, L2NormalizeMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 7}, {1000, 512}, {33, 4099}}) {
    std::vector<float> host = random_values(static_cast<size_t>(rows * cols), static_cast<unsigned>(cols), 3.0f);
    std::vector<float> ref = host;
    moe::kernels::cpu::l2_normalize_rows(ref.data(), rows, cols);
    DeviceBuffer<float> dev(*gpu, host);
    gpu->l2_normalize_rows(dev.get(), rows, cols, 1e-12f);
    host = dev.host();
    for (size_t i = 0; i < host.size(); ++i) ASSERT_NEAR(host[i], ref[i], 1e-6) << rows << "x" << cols << " at " << i;
  }
  // A row with a NaN (all NaN, not values scaled by 1/eps), one with an inf, a zero row.
  const std::vector<float> special = {1, NAN, 2, 3, 1, INFINITY, 2, 3, 0, 0, 0, 0, 3, 4, 0, 0};
  std::vector<float> ref = special;
  moe::kernels::cpu::l2_normalize_rows(ref.data(), 4, 4);
  DeviceBuffer<float> dev(*gpu, special);
  gpu->l2_normalize_rows(dev.get(), 4, 4, 1e-12f);
  const std::vector<float> got = dev.host();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(std::isnan(got[i]), std::isnan(ref[i])) << "special rows at " << i << ": " << got[i] << " vs " << ref[i];
    if (!std::isnan(ref[i])) {
      EXPECT_NEAR(got[i], ref[i], 1e-6) << "special rows at " << i;
    }
  }
}

TEST(CudaBackend, AttentionMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  struct Case {
    std::vector<int64_t> lens;
    int64_t heads, head_dim;
    bool causal;
    const char* what;
  };
  const std::vector<Case> cases = {
      {random_lengths(64, 77, 70), 8, 64, true, "text: 64 prompts ≤ 77 tokens, causal"},
      {random_lengths(3, 77, 71), 12, 64, true, "text: 3 prompts, 12 heads"},
      {std::vector<int64_t>(16, 50), 12, 64, false, "ViT-B/32: 16 images × 50 patches"},
      {std::vector<int64_t>(4, 197), 12, 64, false, "ViT-B/16: 4 images × 197 patches"},
      {{197, 0, 50, 1}, 4, 128, false, "head_dim 128, an empty and a one-row sequence"},
      {{77, 5}, 3, 80, true, "head_dim 80 (not a multiple of 32)"},
      {{9}, 2, 1, false, "head_dim 1"},
      {std::vector<int64_t>(300, 3), 2, 32, true, "300 sequences: their offsets span two upload chunks"},
  };
  for (const Case& c : cases) {
    int64_t total = 0;
    for (int64_t l : c.lens) total += l;
    const int64_t width = c.heads * c.head_dim;
    const std::vector<float> qkv = random_values(static_cast<size_t>(total * 3 * width), 72);
    std::vector<float> ref(static_cast<size_t>(total * width));
    cpu->attention(qkv.data(), ref.data(), c.lens, c.heads, c.head_dim, c.causal);
    DeviceBuffer<float> dqkv(*gpu, qkv), dout(*gpu, ref.size());
    gpu->attention(dqkv.get(), dout.get(), c.lens, c.heads, c.head_dim, c.causal);
    EXPECT_LT(rel_error(dout.host(), ref), kF32Tol) << c.what;
  }
  DeviceBuffer<float> dummy(*gpu, 3 * 129);
  expect_error([&] { gpu->attention(dummy.get(), dummy.get(), {1}, 1, 129, false); },
               {"cuda:0", "attention", "head_dim 129"});
}

TEST(CudaBackend, TopkSoftmaxMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  struct Case {
    int64_t rows, experts, top_k;
    bool renormalize;
  };
  for (const Case& c : {Case{1, 8, 2, true}, Case{1000, 8, 2, true}, Case{1000, 60, 4, false}, Case{333, 64, 8, true},
                        Case{100, 256, 8, false}, Case{10, 7, 7, true}, Case{50, 3000, 3, true}}) {
    std::vector<float> logits = random_values(static_cast<size_t>(c.rows * c.experts), 80, 2.0f);
    // Ties: the first row all equal, the last row with its first half repeated in the second.
    // With 3 rows or more, the middle row all -inf (routed as equal logits by both backends).
    std::fill(logits.begin(), logits.begin() + c.experts, 0.25f);
    float* last = logits.data() + (c.rows - 1) * c.experts;
    if (c.rows > 1)
      for (int64_t e = c.experts / 2; e < c.experts; ++e) last[e] = last[e - c.experts / 2];
    if (c.rows > 2) std::fill_n(logits.data() + (c.rows / 2) * c.experts, c.experts, -INFINITY);
    std::vector<int32_t> ids(static_cast<size_t>(c.rows * c.top_k));
    std::vector<float> w(ids.size());
    cpu->topk_softmax(logits.data(), c.rows, c.experts, c.top_k, c.renormalize, ids.data(), w.data());
    DeviceBuffer<float> dl(*gpu, logits), dw(*gpu, w.size());
    DeviceBuffer<int32_t> di(*gpu, ids.size());
    gpu->topk_softmax(dl.get(), c.rows, c.experts, c.top_k, c.renormalize, di.get(), dw.get());
    EXPECT_EQ(di.host(), ids) << c.rows << " rows, " << c.experts << " experts, top " << c.top_k;
    const std::vector<float> gw = dw.host();
    double err = 0;
    for (size_t i = 0; i < w.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(gw[i]) - w[i]));
    EXPECT_LT(err, 1e-6) << c.rows << " rows, " << c.experts << " experts";
  }
}

namespace {

struct MoeCase {
  int64_t rows, d, inter, experts, top_k;
  bool renormalize;
  std::vector<WeightType> types;  // cycled over the experts
  float x_stddev = 1.0f;          // 1e5: beyond f16's range (65504)
};

void check_cuda_moe(Backend& gpu, Backend& cpu, const MoeCase& c) {
  const std::string what = std::to_string(c.rows) + " rows, d " + std::to_string(c.d) + ", " +
                           std::to_string(c.experts) + " experts top-" + std::to_string(c.top_k) + ", " +
                           moe::kernels::weight_type_name(c.types[0]) + (c.types.size() > 1 ? " (mixed)" : "");
  const int64_t slots = c.rows * c.top_k, empty = c.experts - 1;
  const std::vector<float> x = random_values(static_cast<size_t>(c.rows * c.d), 90, c.x_stddev);
  std::vector<float> logits = random_values(static_cast<size_t>(c.rows * c.experts), 91, 2.0f);
  for (int64_t r = 0; r < c.rows; ++r) logits[r * c.experts + empty] = -100.0f;  // never chosen
  std::vector<int32_t> ids(static_cast<size_t>(slots));
  std::vector<float> weights(ids.size());
  cpu.topk_softmax(logits.data(), c.rows, c.experts, c.top_k, c.renormalize, ids.data(), weights.data());

  std::vector<HostWeight> hw;
  std::vector<std::unique_ptr<DeviceWeight>> dw;
  std::vector<ExpertWeights> cpu_experts(c.experts), gpu_experts(c.experts);
  for (int64_t e = 0; e < c.experts; ++e) {
    if (e == empty) continue;  // no rows, no weights
    const WeightType t = c.types[static_cast<size_t>(e) % c.types.size()];
    for (int p = 0; p < 3; ++p) {
      const bool down = p == 2;
      hw.push_back(make_weight(t, down ? c.d : c.inter, down ? c.inter : c.d, static_cast<unsigned>(1000 + 3 * e + p),
                               0.05f));
      dw.push_back(std::make_unique<DeviceWeight>(gpu, hw.back()));
    }
    const size_t i = hw.size() - 3;
    cpu_experts[e] = {hw[i].ref(), hw[i + 1].ref(), hw[i + 2].ref()};
    gpu_experts[e] = {dw[i]->ref(), dw[i + 1]->ref(), dw[i + 2]->ref()};
  }

  // CPU reference.
  std::vector<float> xs(static_cast<size_t>(slots * c.d)), os(xs.size()), y(static_cast<size_t>(c.rows * c.d));
  std::vector<int32_t> slot_of(ids.size());
  const std::vector<int64_t> offsets =
      cpu.moe_permute(ids.data(), c.rows, c.top_k, c.experts, x.data(), c.d, xs.data(), slot_of.data());
  cpu.grouped_swiglu(xs.data(), offsets, cpu_experts, c.d, c.inter, os.data());
  cpu.moe_unpermute(os.data(), slot_of.data(), weights.data(), c.rows, c.top_k, c.d, y.data());

  // GPU: each stage on the GPU's own previous output, and unpermute once more on the CPU's.
  DeviceBuffer<float> dx(gpu, x), dxs(gpu, xs.size()), dos(gpu, os.size()), dy(gpu, y.size());
  DeviceBuffer<int32_t> dids(gpu, ids), dslot(gpu, slot_of.size());
  DeviceBuffer<float> dweights(gpu, weights);
  const std::vector<int64_t> goffsets =
      gpu.moe_permute(dids.get(), c.rows, c.top_k, c.experts, dx.get(), c.d, dxs.get(), dslot.get());
  EXPECT_EQ(goffsets, offsets) << what;
  EXPECT_EQ(dslot.host(), slot_of) << what;
  EXPECT_EQ(dxs.host(), xs) << what;
  gpu.grouped_swiglu(dxs.get(), goffsets, gpu_experts, c.d, c.inter, dos.get());
  const double tol = c.types.size() > 1 ? kHalfTol : tolerance(c.types[0]);
  const std::vector<float> gos = dos.host();
  EXPECT_TRUE(std::all_of(gos.begin(), gos.end(), [](float v) { return std::isfinite(v); })) << what;
  EXPECT_LT(rel_error(gos, os), tol) << what;
  gpu.moe_unpermute(dos.get(), dslot.get(), dweights.get(), c.rows, c.top_k, c.d, dy.get());
  EXPECT_LT(rel_error(dy.host(), y), tol) << what;
  DeviceBuffer<float> cpu_os(gpu, os);
  gpu.moe_unpermute(cpu_os.get(), dslot.get(), dweights.get(), c.rows, c.top_k, c.d, dy.get());
  EXPECT_LT(rel_error(dy.host(), y), 1e-6) << what << " (unpermute alone)";
}

}  // namespace

TEST(CudaBackend, MoePermuteSwigluUnpermuteMatchCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  const std::vector<WeightType> f32 = {WeightType::F32}, f16 = {WeightType::F16}, bf16 = {WeightType::BF16};
  check_cuda_moe(*gpu, *cpu, {1, 512, 1024, 8, 2, true, f32});
  check_cuda_moe(*gpu, *cpu, {1000, 768, 1024, 8, 2, true, f32});
  check_cuda_moe(*gpu, *cpu, {300, 512, 1024, 8, 2, true, f16});
  check_cuda_moe(*gpu, *cpu, {300, 768, 512, 8, 2, true, bf16});
  check_cuda_moe(*gpu, *cpu, {100, 512, 256, 60, 4, false, f32});  // Qwen2-MoE-like routing
  check_cuda_moe(*gpu, *cpu, {50, 512, 256, 8, 2, true, {WeightType::F32, WeightType::F16, WeightType::BF16}});
  // Activations and SwiGLU products far beyond f16's 65504: scaled into range per row, not inf.
  check_cuda_moe(*gpu, *cpu, {64, 512, 256, 8, 2, true, f16, 1e5f});
  check_cuda_moe(*gpu, *cpu, {64, 512, 256, 8, 2, true, {WeightType::F16, WeightType::F32, WeightType::BF16}, 1e5f});

  const std::vector<int32_t> ids = {0, 1, 2, 9};
  DeviceBuffer<int32_t> dids(*gpu, ids);
  DeviceBuffer<float> x(*gpu, 2 * 4), xs(*gpu, 4 * 4);
  DeviceBuffer<int32_t> slot_of(*gpu, 4);
  expect_error([&] { gpu->moe_permute(dids.get(), 2, 2, 4, x.get(), 4, xs.get(), slot_of.get()); },
               {"cuda:0", "moe_permute", "expert id 9 at row 1", "[0, 4)"});
  // The backend is still usable after the error.
  gpu->moe_permute(dids.get(), 1, 2, 4, x.get(), 4, xs.get(), slot_of.get());
  EXPECT_EQ(slot_of.host()[0], 0);
}

namespace {

// GPU vs CPU search. Exact data (small integers): ids and scores equal. Random data: scores
// within kF32Tol; where ids differ, the two candidates' exact scores are within kF32Tol too.
void check_cuda_search(Backend& gpu, Backend& cpu, int64_t nq, int64_t nb, int64_t d, int64_t k, bool exact) {
  const std::string what = std::to_string(nq) + " queries, " + std::to_string(nb) + " base, d " + std::to_string(d) +
                           ", k " + std::to_string(k) + (exact ? " (integers)" : "");
  std::vector<float> q, base;
  if (exact) {
    std::mt19937 rng(100);
    std::uniform_int_distribution<int> small(-2, 2);
    q.resize(static_cast<size_t>(nq * d));
    base.resize(static_cast<size_t>(nb * d));
    for (float& v : q) v = static_cast<float>(small(rng));
    for (float& v : base) v = static_cast<float>(small(rng));
  } else {
    q = random_values(static_cast<size_t>(nq * d), 101);
    base = random_values(static_cast<size_t>(nb * d), 102);
  }
  std::vector<int64_t> ids(static_cast<size_t>(nq * k));
  std::vector<float> scores(ids.size());
  cpu.inner_product_topk(q.data(), nq, base.data(), nb, d, k, ids.data(), scores.data());
  DeviceBuffer<float> dq(gpu, q), db(gpu, base), ds(gpu, scores.size());
  DeviceBuffer<int64_t> di(gpu, ids.size());
  gpu.inner_product_topk(dq.get(), nq, db.get(), nb, d, k, di.get(), ds.get());
  const std::vector<int64_t> gids = di.host();
  const std::vector<float> gscores = ds.host();
  if (exact) {
    EXPECT_EQ(gids, ids) << what;
    EXPECT_EQ(gscores, scores) << what;
    return;
  }
  EXPECT_LT(rel_error(gscores, scores), kF32Tol) << what;
  double scale = 1e-6;
  for (float s : scores) scale = std::max(scale, std::fabs(static_cast<double>(s)));
  int differing = 0;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t a = gids[i * k + j], b = ids[i * k + j];
      if (a == b) continue;
      ++differing;
      ASSERT_GE(a, 0);
      ASSERT_LT(a, nb);
      double sa = 0, sb = 0;
      for (int64_t c = 0; c < d; ++c) {
        sa += static_cast<double>(q[i * d + c]) * base[a * d + c];
        sb += static_cast<double>(q[i * d + c]) * base[b * d + c];
      }
      EXPECT_LT(std::fabs(sa - sb) / scale, kF32Tol) << what << ": query " << i << " rank " << j << " ids " << a
                                                      << " vs " << b;
    }
  EXPECT_LE(differing, 2 + nq * k / 100) << what << ": too many near-ties";
}

}  // namespace

TEST(CudaBackend, InnerProductTopkMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  auto cpu = moe::kernels::make_cpu_backend();
  check_cuda_search(*gpu, *cpu, 1, 10000, 512, 10, false);
  check_cuda_search(*gpu, *cpu, 1000, 20000, 512, 10, false);  // crosses the GPU's 16384-vector tiles
  check_cuda_search(*gpu, *cpu, 100, 20000, 768, 1024, false);
  check_cuda_search(*gpu, *cpu, 3, 20, 8, 20, false);              // k = nb
  check_cuda_search(*gpu, *cpu, 1500, 40000, 8, 10, true);         // ties; crosses the 1024-query tile
  check_cuda_search(*gpu, *cpu, 20, 40000, 4, 1024, true);         // ties across tiles, largest k
  DeviceBuffer<float> q(*gpu, 8), b(*gpu, 2000 * 8), s(*gpu, 1025);
  DeviceBuffer<int64_t> i(*gpu, 1025);
  expect_error([&] { gpu->inner_product_topk(q.get(), 1, b.get(), 2000, 8, 1025, i.get(), s.get()); },
               {"cuda:0", "inner_product_topk", "k = 1025"});
}

TEST(CudaBackend, DeviceUsableFindsThisBuildsCode) {
  std::string why;
  const int n = moe::kernels::cuda_device_count(&why);
  if (n == 0) GTEST_SKIP() << why;
  EXPECT_TRUE(moe::kernels::cuda_device_usable(0, &why)) << why;  // the build has code for this GPU
  EXPECT_FALSE(moe::kernels::cuda_device_usable(n, &why));
  EXPECT_NE(why.find("no such device"), std::string::npos) << why;
  expect_error([n] { moe::kernels::make_cuda_backend(n); }, {"cuda:" + std::to_string(n), "no such device"});
}

TEST(CudaBackend, UnavailableBackendSaysWhy) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(why.empty());
  std::string usable_why;
  EXPECT_FALSE(moe::kernels::cuda_device_usable(0, &usable_why));
  EXPECT_EQ(usable_why, why);
  try {
    moe::kernels::make_cuda_backend(0);
    ADD_FAILURE() << "make_cuda_backend succeeded without a device";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}
