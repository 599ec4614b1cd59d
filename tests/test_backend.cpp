// Backends behind one interface: the CPU backend is the reference; every CUDA op is compared
// with it on random inputs (skipped, with the reason, where no GPU is present).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend.h"
#include "cpu_ops.h"
#include "moe/error.h"
#include "moe_build_config.h"

namespace {

std::vector<float> random_values(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

}  // namespace

TEST(CpuBackend, L2NormalizeRows) {
  auto cpu = moe::kernels::make_cpu_backend();
  std::vector<float> x = {3, 4, 0, 0, 0, 0, 1, 1, 1};
  cpu->l2_normalize_rows(x.data(), 3, 3, 1e-12f);
  EXPECT_FLOAT_EQ(x[0], 0.6f);
  EXPECT_FLOAT_EQ(x[1], 0.8f);
  EXPECT_EQ(x[3], 0.0f);  // a zero row stays zero (eps clamp), no NaN
  EXPECT_NEAR(x[6], 1.0f / std::sqrt(3.0f), 1e-7);
}

TEST(CpuOps, TopkSoftmaxTiesGoToLowerIndex) {
  const float logits[4] = {1, 2, 2, 0};
  int32_t ids[2];
  float w[2];
  moe::kernels::cpu::topk_softmax(logits, 1, 4, 2, true, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_FLOAT_EQ(w[0] + w[1], 1.0f);
}

TEST(CudaBackend, L2NormalizeMatchesCpu) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 7}, {1000, 512}, {33, 4099}}) {
    std::vector<float> host = random_values(static_cast<size_t>(rows * cols), static_cast<unsigned>(cols));
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
