// The CPU backend splits layer norm, the element-wise operations, attention and
// l2_normalize_rows over its thread pool (the one linear runs on). Every row, element and
// (sequence, head) pair is computed alone, so a backend with several threads must give exactly
// the results of a one-thread backend (whose results test_backend checks against references).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend.h"

namespace {

std::vector<float> random_values(int64_t n, unsigned seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(CpuPool, SplitOperationsGiveTheOneThreadResults) {
  auto one = moe::kernels::make_cpu_backend({false, 1});
  for (int threads : {2, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    auto many = moe::kernels::make_cpu_backend({false, threads});
    // Sizes above the split threshold, with tails that are not whole vectors.
    const int64_t rows = 301, cols = 768, n = 1'000'037;
    {
      const std::vector<float> x = random_values(rows * cols, 1), gamma = random_values(cols, 2),
                               beta = random_values(cols, 3);
      std::vector<float> a(x.size()), b(x.size());
      one->layer_norm(x.data(), gamma.data(), beta.data(), a.data(), rows, cols, 1e-5f);
      many->layer_norm(x.data(), gamma.data(), beta.data(), b.data(), rows, cols, 1e-5f);
      EXPECT_TRUE(same_bits(a, b)) << "layer_norm";
      one->l2_normalize_rows(a.data(), rows, cols, 1e-12f);
      many->l2_normalize_rows(b.data(), rows, cols, 1e-12f);
      EXPECT_TRUE(same_bits(a, b)) << "l2_normalize_rows";
    }
    {
      const std::vector<float> x = random_values(n, 4), up = random_values(n, 5);
      std::vector<float> a = x, b = x;
      one->gelu(a.data(), n);
      many->gelu(b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << "gelu";
      a = x, b = x;
      one->quick_gelu(a.data(), n);
      many->quick_gelu(b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << "quick_gelu";
      one->silu_mul(x.data(), up.data(), a.data(), n);
      many->silu_mul(x.data(), up.data(), b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << "silu_mul";
      a = x, b = x;
      one->add(a.data(), up.data(), n);
      many->add(b.data(), up.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << "add";
    }
    for (bool causal : {false, true}) {
      const std::vector<int64_t> seq_lens = {50, 7, 0, 77, 1};
      const int64_t heads = 12, head_dim = 64, width = heads * head_dim, total = 135;
      const std::vector<float> qkv = random_values(total * 3 * width, 6, 1.0f);
      std::vector<float> a(static_cast<size_t>(total * width), NAN), b = a;
      one->attention(qkv.data(), a.data(), seq_lens, heads, head_dim, causal);
      many->attention(qkv.data(), b.data(), seq_lens, heads, head_dim, causal);
      EXPECT_TRUE(same_bits(a, b)) << "attention, causal " << causal;
      for (float v : b) ASSERT_FALSE(std::isnan(v)) << "an output row was not written";
    }
  }
}
