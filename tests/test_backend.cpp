// Backends behind one interface (kernels/backend.h).
// OpCases: every case of the table in tests/backend_cases.h on every backend (the CPU against
// naive loops, CUDA against the CPU; CUDA skipped, with the reason, where no GPU is present).
// CpuBackend.* / CudaBackend.*: what is not one operation: names, memory, copies, events, peers,
// devices, the capability query.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <ostream>
#include <thread>
#include <vector>

#include "backend.h"
#include "backend_cases.h"
#include "cpu_ops.h"
#include "moe/error.h"
#include "moe/tensor.h"
#include "test_util.h"

using namespace backend_cases;
using moe::kernels::Op;
using moe::test::expect_error;

// =================================================================================================
// Every operation case on every backend
// =================================================================================================

namespace {

// The backends every case runs on (one CUDA device is enough for one operation).
const char* const kBackends[] = {"cpu", "cuda:0"};

struct CaseOnBackend {
  std::string backend;
  const OpCase* op_case;
};

void PrintTo(const CaseOnBackend& p, std::ostream* os) { *os << p.backend << " " << p.op_case->name(); }

std::vector<CaseOnBackend> every_case_on_every_backend() {
  std::vector<CaseOnBackend> all;
  for (const char* backend : kBackends)
    for (const auto& c : op_cases()) all.push_back({backend, c.get()});
  return all;
}

class OpCases : public ::testing::TestWithParam<CaseOnBackend> {
 protected:
  // A backend opened once for the suite, or why there is none here.
  struct Opened {
    std::unique_ptr<Backend> backend;
    std::string why_none;
  };
  static std::map<std::string, Opened>& opened() {
    static std::map<std::string, Opened> backends;
    return backends;
  }
  static const Opened& open(const std::string& name) {
    auto it = opened().find(name);
    if (it != opened().end()) return it->second;
    Opened b;
    if (name == "cpu")
      b.backend = moe::kernels::make_cpu_backend();
    else if (moe::kernels::cuda_device_count(&b.why_none) > 0)
      b.backend = moe::kernels::make_cuda_backend(0);
    return opened().emplace(name, std::move(b)).first->second;
  }
  static void TearDownTestSuite() { opened().clear(); }
};

}  // namespace

// Skipped when the backend is absent, or when it does not support one of the case's operations
// (after checking that the call throws the reason supports() gave, as backend.h promises).
TEST_P(OpCases, MatchReference) {
  const CaseOnBackend& param = GetParam();
  const Opened& tested = open(param.backend);
  if (!tested.backend) GTEST_SKIP() << param.backend << ": " << tested.why_none;
  Backend& b = *tested.backend;
  Backend& cpu = *open("cpu").backend;
  for (const OpDesc& op : param.op_case->ops()) {
    std::string why;
    if (b.supports(op, &why)) continue;
    const char* name = moe::kernels::op_name(op.op);
    ASSERT_NE(&b, &cpu) << "the CPU backend, the reference, does not support " << name << ": " << why;
    expect_refused([&] { param.op_case->call(b); }, {b.name() + ": " + name + ": " + why});
    GTEST_SKIP() << b.name() << " does not support " << name << ": " << why;
  }
  param.op_case->check(b, cpu);
}

INSTANTIATE_TEST_SUITE_P(EveryBackend, OpCases, ::testing::ValuesIn(every_case_on_every_backend()),
                         [](const ::testing::TestParamInfo<CaseOnBackend>& info) {
                           std::string backend = info.param.backend;
                           backend.erase(std::remove(backend.begin(), backend.end(), ':'), backend.end());
                           return backend + "_" + info.param.op_case->name();
                         });

// New operations must come with rows.
TEST(OpCaseTable, CoversEveryOperation) {
  for (int i = 0; i < moe::kernels::kOpCount; ++i) {
    const auto op = static_cast<Op>(i);
    const bool covered = std::any_of(op_cases().begin(), op_cases().end(), [op](const auto& c) {
      const std::vector<OpDesc> ops = c->ops();
      return std::any_of(ops.begin(), ops.end(), [op](const OpDesc& d) { return d.op == op; });
    });
    EXPECT_TRUE(covered) << moe::kernels::op_name(op) << " has no row in op_cases()";
  }
}

// =================================================================================================
// CPU backend: what is not one operation
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

// linear on the CPU backend runs oneDNN with its columns split over the backend's threads, on the
// weight as given or on the copy prepare_linear_weight packed; every thread count, M, column
// split and bias must give the product (naive double loops), also from several threads at once.
TEST(CpuBackend, LinearOnPreparedWeightsAtEveryThreadCount) {
  const auto check = [](moe::kernels::Backend& cpu, const std::vector<float>& x, const std::vector<float>& w,
                        const float* bias, int64_t m, int64_t n, int64_t k) {
    std::vector<float> y(static_cast<size_t>(m * n), NAN);
    cpu.linear(x.data(), {w.data(), WeightType::F32}, bias, y.data(), m, n, k);
    double worst = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double sum = bias ? bias[j] : 0.0, scale = 1.0;
        for (int64_t t = 0; t < k; ++t) {
          sum += static_cast<double>(x[i * k + t]) * w[j * k + t];
          scale += std::fabs(static_cast<double>(x[i * k + t]) * w[j * k + t]);
        }
        worst = std::max(worst, std::fabs(y[i * n + j] - sum) / scale);
      }
    return worst;
  };
  for (int threads : {1, 2, 3}) {
    auto cpu = moe::kernels::make_cpu_backend({false, threads});
    for (int64_t n : {1, 65, 1000})
      for (int64_t k : {7, 300}) {
        const std::vector<float> w = random_values(n * k, 1), bias = random_values(n, 2);
        for (bool prepared : {false, true}) {
          if (prepared) cpu->prepare_linear_weight({w.data(), WeightType::F32}, n, k);
          for (int64_t m : {1, 50, 131}) {
            const std::vector<float> x = random_values(m * k, 3);
            EXPECT_LT(check(*cpu, x, w, nullptr, m, n, k), 1e-6) << threads << " threads " << m << "x" << n << "x" << k;
            EXPECT_LT(check(*cpu, x, w, bias.data(), m, n, k), 1e-6) << "with bias";
          }
        }
        cpu->release_linear_weight({w.data(), WeightType::F32}, n, k);
      }
    // Concurrent calls on one prepared weight: one gets the pool, the others compute alone.
    const int64_t m = 50, n = 256, k = 256;
    const std::vector<float> w = random_values(n * k, 4), x = random_values(m * k, 5);
    cpu->prepare_linear_weight({w.data(), WeightType::F32}, n, k);
    std::vector<double> worst(4);
    std::vector<std::thread> callers;
    for (size_t t = 0; t < worst.size(); ++t)
      callers.emplace_back([&, t] {
        for (int r = 0; r < 3; ++r) worst[t] = std::max(worst[t], check(*cpu, x, w, nullptr, m, n, k));
      });
    for (std::thread& c : callers) c.join();
    for (double e : worst) EXPECT_LT(e, 1e-6) << threads << " threads, concurrent";
    cpu->release_linear_weight({w.data(), WeightType::F32}, n, k);
  }
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

// f32 -> f16 rounds to nearest even down to the smallest subnormal and to zero below it (no
// shift past 31 bits on the way: UBSan checks it in CI), and every half survives the round trip.
TEST(CpuOps, FloatToHalfRoundsToNearestEvenDownToZero) {
  EXPECT_EQ(moe::float_to_half(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(moe::float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // half of it: ties to even
  EXPECT_EQ(moe::float_to_half(std::ldexp(1.5f, -25)), 0x0001);  // above half of it
  EXPECT_EQ(moe::float_to_half(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(moe::float_to_half(1e-30f), 0x0000);
  EXPECT_EQ(moe::float_to_half(-1e-30f), 0x8000);
  EXPECT_EQ(moe::float_to_half(1e-40f), 0x0000);  // an f32 subnormal
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    if (!std::isnan(moe::half_to_float(bits))) {
      ASSERT_EQ(moe::float_to_half(moe::half_to_float(bits)), bits) << b;
    }
  }
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
  EXPECT_LT(max_error(y, naive_linear(x, w.value, nullptr, 64, 64, 64, sampled_rows(64))), 1e-5);
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

TEST(CpuBackend, SupportsEveryWellFormedCallAndRefusesMalformedOnes) {
  auto cpu = moe::kernels::make_cpu_backend();
  std::string why = "untouched";
  EXPECT_TRUE(cpu->supports({Op::Attention, {}, {10, 5, 2, 4096}}, &why));  // no limits on the CPU
  EXPECT_TRUE(cpu->supports({Op::GroupedSwiglu, {WeightType::BF16, WeightType::F32}, {8, 4, 16, 32}}, &why));
  EXPECT_EQ(why, "untouched");
  expect_error(
      [&] {
        cpu->supports({Op::Linear, {WeightType::F32}, {1, 2}});
      },
      {"cpu: supports: linear: 2 sizes, want 3 (m, n, k)"});
  expect_error([&] { cpu->supports({Op::Linear, {}, {1, 2, 3}}); }, {"cpu: supports: linear: 0 weight types, want 1"});
  expect_error(
      [&] {
        cpu->supports({Op::Gelu, {WeightType::F16}, {4}});
      },
      {"cpu: supports: gelu: 1 weight types, want none"});
  expect_error(
      [&] {
        cpu->supports({Op::Linear, {static_cast<WeightType>(9)}, {1, 2, 3}});
      },
      {"cpu: supports: linear: unknown weight type 9"});
  const auto beyond = static_cast<Op>(moe::kernels::kOpCount);
  expect_error([&] { cpu->supports({beyond, {}, {}}); }, {"cpu: supports: unknown operation 13"});
  EXPECT_STREQ(moe::kernels::op_name(Op::InnerProductTopk), "inner_product_topk");
  EXPECT_STREQ(moe::kernels::op_name(beyond), "unknown");
}
// =================================================================================================
// CUDA backend: what is not one operation
// =================================================================================================

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
  EXPECT_LT(max_error(back.host(), want), tolerance(Against::Cpu));

  auto cpu = moe::kernels::make_cpu_backend();
  std::vector<float> host(16);
  expect_error([&] { a->copy_to_peer(*cpu, host.data(), xa.get(), 64); }, {"cuda:0", "copy_to_peer", "cpu"});
  expect_error([&] { cpu->copy_to_peer(*a, xa.get(), host.data(), 64); }, {"copy_to_peer", "cuda:0", "host memory"});
}

TEST(CudaBackend, SupportsReportsTheKernelLimits) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) GTEST_SKIP() << why;
  auto gpu = moe::kernels::make_cuda_backend(0);
  EXPECT_TRUE(gpu->supports({Op::Attention, {}, {10, 5, 2, 128}}));
  EXPECT_FALSE(gpu->supports({Op::Attention, {}, {10, 5, 2, 129}}, &why));
  EXPECT_EQ(why, "head_dim 129 is larger than the CUDA kernel's 128");
  EXPECT_TRUE(gpu->supports({Op::TopkSoftmax, {}, {4, 12288, 2}}));
  EXPECT_FALSE(gpu->supports({Op::TopkSoftmax, {}, {4, 12289, 2}}, &why));
  EXPECT_EQ(why, "12289 experts: more than the kernel's 12288");
  EXPECT_TRUE(gpu->supports({Op::InnerProductTopk, {}, {1, 5000, 8, 1024}}));
  EXPECT_FALSE(gpu->supports({Op::InnerProductTopk, {}, {1, 5000, 8, 1025}}, &why));
  EXPECT_EQ(why, "k = 1025 is larger than the CUDA kernel's 1024");
  EXPECT_TRUE(gpu->supports({Op::Linear, {WeightType::BF16}, {4096, 4096, 4096}}));
  // q4 at every size and next to other types (its group size is the weight's, checked by the call).
  EXPECT_TRUE(gpu->supports({Op::Linear, {WeightType::Q4}, {1, 4096, 4096}}));
  EXPECT_TRUE(gpu->supports({Op::Linear, {WeightType::Q4}, {4096, 4096, 4096}}));
  EXPECT_TRUE(gpu->supports({Op::GroupedSwiglu, {WeightType::Q4, WeightType::F16}, {64, 8, 512, 2048}}));
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
