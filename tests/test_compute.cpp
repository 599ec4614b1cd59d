// Device selection (cpu | cuda:N | auto), weight precision (f32 | f16 | bf16), releases that fail
// in destructors, and the engine (ClipModel, MoeLayer, MoeAdapter) on every backend and precision
// against the same fixtures as test_clip / test_moe. GPU tests skip, with the reason, when no
// CUDA device is usable.
#include <gtest/gtest.h>

#include <glib.h>

#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/compute_util.h"
#include "runtime/device_buffer.h"
#include "moe/clip_model.h"
#include "moe/compute.h"
#include "moe/error.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"
#include "moe/model_cache.h"
#include "moe/moe_layer.h"
#include "random_moe.h"
#include "test_util.h"

using moe::ClipModel;
using moe::ComputeOptions;
using moe::MoeAdapter;
using moe::MoeLayer;
using moe::Tensor;
using moe::kernels::WeightType;
using moe::test::expect_error;
using moe::test::fixture_path;
using moe::test::max_abs_error;
using moe::test::max_rel_error;
using moe::test::real_ids;

namespace {

// Tolerances (max |a - b| / max |ref|, test_util.h) of the engine with f16 / bf16 Linear weights
// against the f32 references (transformers), on the tiny fixtures. f16 keeps 11 significant bits,
// bf16 8: weights are off by up to 2^-11 and 2^-8 relative, and the errors add up over the layers.
constexpr double kClipF32 = 1e-4;  // as test_clip
constexpr double kClipF16 = 5e-3;
constexpr double kClipBF16 = 2e-2;  // the bound for embeddings
constexpr double kMoeF16 = 2e-3;    // MoE block / adapter outputs
constexpr double kMoeBF16 = 1e-2;
// CUDA against the CPU backend at the same precision: f32 as the backend tests; with f16/bf16
// weights CUDA also rounds the activations (each Linear's input, and the experts' SwiGLU product)
// to the weight type before each GEMM (cuBLAS takes one input type; backend.h's contract), so the
// two differ by about one more rounding per Linear (less for bf16 CLIP on CPUs with AVX-512 BF16
// or AMX, where the CPU rounds a prepared Linear's input to bf16 too). Rows beyond f16's 65504 are
// scaled into its range first (exactly), so f16 keeps the same bound there.
constexpr double kCudaF32 = 1e-4;
constexpr double kCudaF16 = 1e-2;
constexpr double kCudaBF16 = 4e-2;

ComputeOptions options(const std::string& device, WeightType precision) {
  ComputeOptions o;
  o.device = device;
  o.precision = precision;
  return o;
}

// Messages logged in the "moe" domain while it lives.
class LogCapture {
 public:
  LogCapture() {
    id_ = g_log_set_handler("moe", static_cast<GLogLevelFlags>(G_LOG_LEVEL_MASK), &LogCapture::handler, this);
  }
  ~LogCapture() { g_log_remove_handler("moe", id_); }
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  static void handler(const gchar*, GLogLevelFlags, const gchar* message, gpointer self) {
    static_cast<LogCapture*>(self)->lines_.emplace_back(message);
  }
  guint id_ = 0;
  std::vector<std::string> lines_;
};

bool have_cuda(std::string* why) { return moe::kernels::cuda_device_count(why) > 0; }

}  // namespace

// ---- device selection ---------------------------------------------------------------------------

TEST(ComputeOptions, DefaultsAreCpuF32) {
  const ComputeOptions o;
  EXPECT_EQ(o.device, "cpu");
  EXPECT_EQ(o.precision, WeightType::F32);
  EXPECT_EQ(moe::parse_precision("fp16"), WeightType::F16);
  EXPECT_EQ(moe::parse_precision("F32"), WeightType::F32);
  EXPECT_EQ(moe::parse_precision("bf16"), WeightType::BF16);
  expect_error([] { moe::parse_precision("int8"); }, {"precision 'int8'", "fp32, fp16 or bf16"});
}

TEST(OpenBackend, CpuIsSharedAndUnlocked) {
  LogCapture log;
  std::string reason;
  auto a = moe::open_backend("cpu", &reason);
  auto b = moe::open_backend("cpu");
  EXPECT_EQ(a.get(), b.get());  // one per device per process
  EXPECT_EQ(a->name(), "cpu");
  EXPECT_EQ(reason, "device 'cpu' requested; using the CPU backend");
  ASSERT_EQ(log.lines().size(), 2u);
  EXPECT_EQ(log.lines()[0], reason);
  EXPECT_EQ(moe::backend_mutex(*a), nullptr);  // CPU calls run concurrently
}

TEST(OpenBackend, AutoResolvesAndSaysWhy) {
  LogCapture log;
  std::string reason;
  auto backend = moe::open_backend("auto", &reason);
  std::string why;
  if (!have_cuda(&why)) {
    EXPECT_EQ(backend->name(), "cpu");
    EXPECT_NE(reason.find("device 'auto': no usable CUDA device: "), std::string::npos) << reason;
    EXPECT_NE(reason.find("; using the CPU backend"), std::string::npos) << reason;
    EXPECT_EQ(reason.find("no usable CUDA device: no usable"), std::string::npos) << reason;  // said once
    EXPECT_EQ(moe::resolve_device("auto"), "cpu");
  } else {
    EXPECT_EQ(backend->name(), "cuda:0");
    EXPECT_NE(reason.find("using the CUDA backend on cuda:0"), std::string::npos) << reason;
    EXPECT_NE(moe::backend_mutex(*backend), nullptr);
  }
  ASSERT_EQ(log.lines().size(), 1u);
  EXPECT_EQ(log.lines()[0], reason);
}

TEST(OpenBackend, CudaWithoutDeviceNamesDeviceAndReason) {
  std::string why;
  if (have_cuda(&why)) GTEST_SKIP() << "a CUDA device is present";
  // The reason as cuda_device_count gives it (e.g. "gst-moe was built without CUDA ..."), said once.
  const std::string prefix = "no usable CUDA device: ";
  const std::string reason = why.rfind(prefix, 0) == 0 ? why.substr(prefix.size()) : why;
  expect_error([] { moe::open_backend("cuda:0"); }, {"device 'cuda:0'", "no usable CUDA device: " + reason});
  expect_error([] { moe::open_backend("cuda"); }, {"cuda:0", "no usable CUDA device"});
  expect_error([] { ClipModel::load(fixture_path("clip_tiny"), options("cuda:0", WeightType::F16)); },
               {"cuda:0", "no usable CUDA device"});
  expect_error([] { MoeAdapter::load(fixture_path("adapter_tiny"), options("cuda:1", WeightType::F32)); },
               {"cuda:1", "no usable CUDA device"});
  expect_error([] { moe::shared_clip_model(fixture_path("clip_tiny"), options("cuda:0", WeightType::F32)); },
               {"cuda:0", "no usable CUDA device"});
}

TEST(OpenBackend, RejectsUnknownDevices) {
  for (const char* d : {"gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", ""})
    expect_error([d] { moe::open_backend(d); }, {"device '" + std::string(d) + "'", "expected cpu, cuda:N or auto"});
  std::string why;
  const int n = moe::kernels::cuda_device_count(&why);
  if (n > 0) expect_error([n] { moe::open_backend("cuda:" + std::to_string(n)); }, {"no such CUDA device"});
}

TEST(OpenBackend, AutoChecksTheDeviceCanRunThisBuild) {
  std::string why;
  if (!have_cuda(&why)) {
    // Without a device cuda_device_usable gives cuda_device_count's reason, and auto uses the CPU.
    std::string usable_why;
    EXPECT_FALSE(moe::kernels::cuda_device_usable(0, &usable_why));
    EXPECT_EQ(usable_why, why);
    EXPECT_EQ(moe::resolve_device("auto"), "cpu");
    return;
  }
  // On a GPU machine the check decides between cuda:0 and the CPU, and says why.
  std::string reason;
  const bool usable = moe::kernels::cuda_device_usable(0, &why);
  EXPECT_EQ(moe::resolve_device("auto", &reason), usable ? "cuda:0" : "cpu") << reason;
  if (!usable) {
    EXPECT_NE(reason.find("device 'auto': cuda:0: " + why), std::string::npos) << reason;
  }
  EXPECT_TRUE(usable) << "this build cannot run on cuda:0: " << why;  // the GPU check's machine must run it
}

// ---- releases that fail in destructors ---------------------------------------------------------

namespace {

// The CPU backend (asynchronous copies) whose releases throw, as a CUDA backend's do after a fault
// (the sticky error comes back from cudaFree, cudaFreeHost and cudaEventQuery), once `broken`.
class BrokenReleases final : public moe::kernels::Backend {
 public:
  bool broken = false;
  int deallocations = 0;  // attempts while broken

  // What the failed releases leaked goes back here, so that LeakSanitizer sees only real leaks.
  ~BrokenReleases() override {
    // Copies into leaked slots may still be running: the copy queue is FIFO, so once one more
    // copy is done they all are.
    char from = 0, to = 0;
    cpu_->wait_event(*cpu_->copy_from_host_async(&to, &from, 1));
    for (void* ptr : live_) cpu_->deallocate(ptr);
    for (void* ptr : live_staging_) cpu_->free_host_staging(ptr);
  }

  std::string name() const override { return "fake"; }
  bool is_host_memory() const override { return true; }
  moe::kernels::MemoryInfo memory_info() const override { return cpu_->memory_info(); }
  void* allocate(size_t bytes) override { return *live_.insert(cpu_->allocate(bytes)).first; }
  void deallocate(void* ptr) override {
    if (broken) {
      ++deallocations;
      throw moe::Error("fake: deallocate: cudaFree: cudaErrorIllegalAddress (sticky)");
    }
    live_.erase(ptr);
    cpu_->deallocate(ptr);
  }
  void* allocate_host_staging(size_t bytes) override {
    return *live_staging_.insert(cpu_->allocate_host_staging(bytes)).first;
  }
  void free_host_staging(void* ptr) override {
    if (broken) throw moe::Error("fake: free_host_staging: cudaFreeHost: cudaErrorIllegalAddress (sticky)");
    live_staging_.erase(ptr);
    cpu_->free_host_staging(ptr);
  }
  bool shares_staging_with(const Backend& owner) const override { return cpu_->shares_staging_with(owner); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { cpu_->copy_from_host(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { cpu_->copy_to_host(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, size_t bytes) override { cpu_->copy_on_device(dst, src, bytes); }
  void copy_to_peer(Backend& peer, void* dst, const void* src, size_t bytes) override {
    cpu_->copy_to_peer(peer, dst, src, bytes);
  }
  std::shared_ptr<moe::kernels::Event> copy_from_host_async(void* dst, const void* src, size_t bytes) override {
    return cpu_->copy_from_host_async(dst, src, bytes);
  }
  bool event_complete(const moe::kernels::Event& event) override {
    if (broken) throw moe::Error("fake: event_complete: cudaEventQuery: cudaErrorIllegalAddress (sticky)");
    return cpu_->event_complete(event);
  }
  void wait_event(const moe::kernels::Event& event) override { cpu_->wait_event(event); }
  void synchronize() override { cpu_->synchronize(); }
  void linear(const float* x, moe::kernels::WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k) override {
    cpu_->linear(x, w, bias, y, m, n, k);
  }
  void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                  float eps) override {
    cpu_->layer_norm(x, gamma, beta, y, rows, cols, eps);
  }
  void gelu(float* x, int64_t n) override { cpu_->gelu(x, n); }
  void quick_gelu(float* x, int64_t n) override { cpu_->quick_gelu(x, n); }
  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    cpu_->silu_mul(gate, up, out, n);
  }
  void add(float* y, const float* x, int64_t n) override { cpu_->add(y, x, n); }
  void attention(const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t heads, int64_t head_dim,
                 bool causal) override {
    cpu_->attention(qkv, out, seq_lens, heads, head_dim, causal);
  }
  void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) override {
    cpu_->l2_normalize_rows(x, rows, cols, eps);
  }
  void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize, int32_t* ids,
                    float* weights) override {
    cpu_->topk_softmax(logits, rows, experts, top_k, renormalize, ids, weights);
  }
  std::vector<int64_t> moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts, const float* x,
                                   int64_t cols, float* x_sorted, int32_t* slot_of) override {
    return cpu_->moe_permute(ids, rows, top_k, experts, x, cols, x_sorted, slot_of);
  }
  void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                      const std::vector<moe::kernels::ExpertWeights>& experts, int64_t d, int64_t inter,
                      float* out_sorted) override {
    cpu_->grouped_swiglu(x_sorted, offsets, experts, d, inter, out_sorted);
  }
  void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows, int64_t top_k,
                     int64_t cols, float* y) override {
    cpu_->moe_unpermute(out_sorted, slot_of, weights, rows, top_k, cols, y);
  }
  void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                          int64_t* ids, float* scores) override {
    cpu_->inner_product_topk(queries, nq, base, nb, d, k, ids, scores);
  }

 private:
  std::unique_ptr<Backend> cpu_ = moe::kernels::make_cpu_backend({/*async_copies=*/true});
  std::set<void*> live_, live_staging_;
};

}  // namespace

// After a GPU fault every release fails: the destructors must not throw (std::terminate would
// lose the fault's message and the test report). The first failure of the process is logged;
// this is the only test of this binary that makes releases fail, so it sees that first one.
TEST(ReleaseFailures, DestructorsLogTheFirstAndLeakInsteadOfThrowing) {
  const MoeLayer layer = moe::test::random_moe_layer(4, 8, 8, 2, 3);
  BrokenReleases backend;
  LogCapture log;
  {
    moe::DeviceBuffer buffer(backend, 256);
    moe::detail::Workspace workspace(backend);
    workspace.f32(16);
    auto store =
        std::make_unique<moe::HostExpertStore>(moe::HostExpertStore::from_layer(backend, layer, WeightType::F32));
    auto cache = std::make_unique<moe::ExpertCache>(backend, *store);
    cache->prefetch({0, 1, 2})->release();  // slot copies whose completion nobody observed yet
    backend.broken = true;
    cache.reset();  // waiting for the copies fails: the slots are leaked, not freed under a copy
    EXPECT_EQ(backend.deallocations, 0);
    store.reset();
  }  // the workspace's block and the buffer: two more failed frees
  EXPECT_EQ(backend.deallocations, 2);
  ASSERT_EQ(log.lines().size(), 1u);
  EXPECT_EQ(log.lines()[0],
            "fake: expert cache: waiting for slot copies failed: fake: event_complete: cudaEventQuery: "
            "cudaErrorIllegalAddress (sticky) (leaked; later release failures are not logged)");
  EXPECT_TRUE(moe::detail::try_release("anything", [] {}));
  EXPECT_FALSE(moe::detail::try_release("anything", [] { throw 42; }));
  EXPECT_EQ(log.lines().size(), 1u);
}

// ---- the engine in f16 / bf16 on the CPU backend --------------------------------------------------

namespace {

struct Precision {
  WeightType type;
  double clip, moe;
};
const Precision kPrecisions[] = {{WeightType::F16, kClipF16, kMoeF16}, {WeightType::BF16, kClipBF16, kMoeBF16}};

}  // namespace

TEST(CpuPrecision, ClipMatchesTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  const auto ids = real_ids(io, "text.");
  for (const Precision& p : kPrecisions) {
    const std::string name = moe::kernels::weight_type_name(p.type);
    const ClipModel m = ClipModel::load(fixture_path("clip_tiny"), options("cpu", p.type));
    EXPECT_EQ(m.device(), "cpu");
    EXPECT_EQ(m.precision(), p.type);
    const auto t = m.encode_token_ids(ids);
    const auto v = m.encode_pixels(io.get("vision.pixel_values"));
    const double errs[] = {
        max_rel_error(t.pooled, io.get("text.pooled")), max_rel_error(t.embeds, io.get("text.text_embeds")),
        max_rel_error(v.pooled, io.get("vision.pooled")), max_rel_error(v.embeds, io.get("vision.image_embeds"))};
    std::printf("clip_tiny %s: text pooled %.3g embeds %.3g, vision pooled %.3g embeds %.3g\n", name.c_str(), errs[0],
                errs[1], errs[2], errs[3]);
    for (double e : errs) EXPECT_LT(e, p.clip) << name;
    EXPECT_GT(errs[1], 0.0) << name << ": the weights were not rounded";
  }
}

TEST(CpuPrecision, F16CheckpointLosesNothingInF16) {
  // clip_tiny_bpe's weights are stored in f16: f16 storage is exact, so f16 gives the f32 results.
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  const ClipModel m = ClipModel::load(fixture_path("clip_tiny_bpe"), options("cpu", WeightType::F16));
  EXPECT_LT(max_rel_error(m.encode_token_ids(real_ids(io, "text.")).embeds, io.get("text.text_embeds")), kClipF32);
  EXPECT_LT(max_rel_error(m.encode_pixels(io.get("vision.pixel_values")).embeds, io.get("vision.image_embeds")),
            kClipF32);
}

TEST(CpuPrecision, MoeBlocksMatchTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("moe_io.safetensors"));
  for (const auto& [name, dir] : {std::pair<std::string, std::string>{"mixtral", "mixtral_tiny"},
                                  std::pair<std::string, std::string>{"qwen2_moe", "qwen2_moe_tiny"}})
    for (const Precision& p : kPrecisions) {
      const std::string what = name + " " + moe::kernels::weight_type_name(p.type);
      const MoeLayer layer =
          MoeLayer::load_hf_layer(fixture_path(dir), io.metadata().at(name + ".prefix"), options("cpu", p.type));
      EXPECT_EQ(layer.precision(), p.type);
      const Tensor x = io.get(name + ".input");
      // The router stays f32: logits as in f32.
      EXPECT_LT(max_abs_error(layer.router_logits(x), io.get(name + ".router_logits")), 1e-5) << what;
      // The experts' output with the reference routing (compare outputs, not ids).
      moe::Routing r;
      const Tensor ids = io.get(name + ".selected_experts"), w = io.get(name + ".routing_weights");
      r.rows = ids.dim(0);
      r.top_k = static_cast<int>(ids.dim(1));
      r.expert_ids.assign(ids.data<int32_t>(), ids.data<int32_t>() + ids.numel());
      r.weights.assign(w.data<float>(), w.data<float>() + w.numel());
      const double err = max_rel_error(layer.run_experts(x, r), io.get(name + ".output"));
      std::printf("%s: output %.3g\n", what.c_str(), err);
      EXPECT_LT(err, p.moe) << what;
      EXPECT_GT(err, 0.0) << what << ": the weights were not rounded";
      // The reference runs on the host f32 weights whatever the precision.
      EXPECT_LT(max_abs_error(layer.run_experts_reference(x, r), io.get(name + ".output")), 1e-5) << what;
      // expert_weight stays the checkpoint's f32.
      EXPECT_EQ(layer.expert_weight(0, moe::ExpertMatrix::W1).dtype(), moe::DType::F32);
    }
}

TEST(CpuPrecision, AdapterMatchesTransformers) {
  auto io = moe::SafetensorsFile::open(fixture_path("moe_io.safetensors"));
  for (const Precision& p : kPrecisions) {
    const std::string name = moe::kernels::weight_type_name(p.type);
    const MoeAdapter adapter = MoeAdapter::load(fixture_path("adapter_tiny"), options("cpu", p.type));
    const Tensor x = io.get("mixtral.input");
    const auto out = adapter.apply(x);
    const double err = max_rel_error(out.embeddings, io.get("adapter.output"));
    std::printf("adapter %s: output %.3g\n", name.c_str(), err);
    EXPECT_LT(err, p.moe) << name;
    // Same routing as in f32 (the router is f32 and the input the same), and apply == route + apply_experts.
    const Tensor ids = io.get("mixtral.selected_experts");
    for (int64_t i = 0; i < ids.numel(); ++i) EXPECT_EQ(out.routing.expert_ids[i], ids.data<int32_t>()[i]) << name;
    EXPECT_EQ(max_abs_error(adapter.apply_experts(x, adapter.route(x)), out.embeddings), 0.0) << name;
  }
}

TEST(CpuPrecision, ClipThenAdapterInBf16) {
  // The whole chain in bf16: the adapter's input already carries the encoder's rounding, so only
  // outputs are compared (an id may differ where two experts' logits are closer than the error).
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  const auto o = options("cpu", WeightType::BF16);
  const ClipModel clip = ClipModel::load(fixture_path("clip_tiny_bpe"), o);
  const MoeAdapter adapter = MoeAdapter::load(fixture_path("adapter_tiny"), o);
  const auto out = adapter.apply(clip.encode_token_ids(real_ids(io, "text.")).embeds);
  const double err = max_abs_error(out.embeddings, io.get("adapter.output"));  // unit rows
  std::printf("clip_tiny_bpe + adapter bf16: output %.3g\n", err);
  EXPECT_LT(err, kClipBF16);
}

TEST(CpuPrecision, EmptyBatches) {
  const ClipModel m = ClipModel::load(fixture_path("clip_tiny"), options("cpu", WeightType::F16));
  EXPECT_EQ(m.encode_token_ids({}).embeds.shape(), (moe::Shape{0, 24}));
  EXPECT_EQ(m.encode_pixels(Tensor::zeros(moe::DType::F32, {0, 3, 32, 32})).embeds.shape(), (moe::Shape{0, 24}));
  const MoeAdapter a = MoeAdapter::load(fixture_path("adapter_tiny"), options("cpu", WeightType::BF16));
  const auto out = a.apply(Tensor::zeros(moe::DType::F32, {0, 16}));
  EXPECT_EQ(out.embeddings.shape(), (moe::Shape{0, 16}));
  EXPECT_EQ(out.routing.rows, 0);
}

TEST(CpuBackendThreads, ConcurrentCallsAgree) {
  // The CPU backend is not serialised: calls from several threads run at once and agree.
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  const auto ids = real_ids(io, "text.");
  const ClipModel m = ClipModel::load(fixture_path("clip_tiny"), options("cpu", WeightType::F16));
  const Tensor want = m.encode_token_ids(ids).embeds;
  std::vector<double> errs(4, -1);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < errs.size(); ++i)
    threads.emplace_back([&, i] {
      double worst = 0;
      for (int k = 0; k < 20; ++k) worst = std::max(worst, max_abs_error(m.encode_token_ids(ids).embeds, want));
      errs[i] = worst;
    });
  for (auto& t : threads) t.join();
  for (double e : errs) EXPECT_EQ(e, 0.0);
}

TEST(ModelCache, KeyedByDirDeviceAndPrecision) {
  const std::string dir = fixture_path("clip_tiny");
  auto f32 = moe::shared_clip_model(dir);
  auto cpu = moe::shared_clip_model(dir, options("cpu", WeightType::F32));
  auto f16 = moe::shared_clip_model(dir, options("cpu", WeightType::F16));
  EXPECT_EQ(f32.get(), cpu.get());
  EXPECT_NE(f32.get(), f16.get());
  EXPECT_EQ(f16.get(), moe::shared_clip_model(dir + "/.", options("cpu", WeightType::F16)).get());
  std::string why;
  if (!have_cuda(&why)) {
    EXPECT_EQ(moe::shared_clip_model(dir, options("auto", WeightType::F32)).get(), f32.get());
  }
  auto a = moe::shared_moe_adapter(fixture_path("adapter_tiny"), options("cpu", WeightType::BF16));
  EXPECT_EQ(a->layer().precision(), WeightType::BF16);
  EXPECT_NE(a.get(), moe::shared_moe_adapter(fixture_path("adapter_tiny")).get());
}

// ---- CUDA against the CPU backend -------------------------------------------------------------------

namespace {

struct GpuCase {
  WeightType type;
  double tol;
};
const GpuCase kGpuCases[] = {{WeightType::F32, kCudaF32}, {WeightType::F16, kCudaF16}, {WeightType::BF16, kCudaBF16}};

}  // namespace

TEST(CudaEngine, ClipMatchesCpu) {
  std::string why;
  if (!have_cuda(&why)) GTEST_SKIP() << why;
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  auto bpe = moe::SafetensorsFile::open(fixture_path("clip_tiny_bpe_io.safetensors"));
  const auto ids = real_ids(io, "text.");
  const Tensor px = io.get("vision.pixel_values");
  for (const GpuCase& c : kGpuCases) {
    const std::string name = moe::kernels::weight_type_name(c.type);
    const ClipModel cpu = ClipModel::load(fixture_path("clip_tiny"), options("cpu", c.type));
    const ClipModel gpu = ClipModel::load(fixture_path("clip_tiny"), options("cuda:0", c.type));
    EXPECT_EQ(gpu.device(), "cuda:0");
    const auto tc = cpu.encode_token_ids(ids), tg = gpu.encode_token_ids(ids);
    const auto vc = cpu.encode_pixels(px), vg = gpu.encode_pixels(px);
    const double errs[] = {max_rel_error(tg.pooled, tc.pooled), max_rel_error(tg.embeds, tc.embeds),
                           max_rel_error(vg.pooled, vc.pooled), max_rel_error(vg.embeds, vc.embeds)};
    std::printf("clip_tiny cuda:0 vs cpu %s: %.3g %.3g %.3g %.3g\n", name.c_str(), errs[0], errs[1], errs[2], errs[3]);
    for (double e : errs) EXPECT_LT(e, c.tol) << name;
    // End to end from strings and raw RGB on the GPU (clip_tiny_bpe: CLIP's vocabulary).
    const ClipModel gbpe = ClipModel::load(fixture_path("clip_tiny_bpe"), options("cuda:0", c.type));
    const ClipModel cbpe = ClipModel::load(fixture_path("clip_tiny_bpe"), options("cpu", c.type));
    const auto bids = real_ids(bpe, "text.");
    EXPECT_LT(max_rel_error(gbpe.encode_token_ids(bids).embeds, cbpe.encode_token_ids(bids).embeds), c.tol) << name;
  }
  // f32 on the GPU also meets transformers' numbers at test_clip's tolerance.
  const ClipModel gpu = ClipModel::load(fixture_path("clip_tiny"), options("cuda:0", WeightType::F32));
  EXPECT_LT(max_rel_error(gpu.encode_token_ids(ids).embeds, io.get("text.text_embeds")), kClipF32);
  EXPECT_LT(max_rel_error(gpu.encode_pixels(px).embeds, io.get("vision.image_embeds")), kClipF32);
}

TEST(CudaEngine, MoeMatchesCpu) {
  std::string why;
  if (!have_cuda(&why)) GTEST_SKIP() << why;
  auto io = moe::SafetensorsFile::open(fixture_path("moe_io.safetensors"));
  for (const GpuCase& c : kGpuCases) {
    const std::string name = moe::kernels::weight_type_name(c.type);
    // The adapter: routing from the f32 router on the same input, so the ids agree.
    const MoeAdapter cpu = MoeAdapter::load(fixture_path("adapter_tiny"), options("cpu", c.type));
    const MoeAdapter gpu = MoeAdapter::load(fixture_path("adapter_tiny"), options("cuda:0", c.type));
    const Tensor x = io.get("mixtral.input");
    const auto oc = cpu.apply(x), og = gpu.apply(x);
    const double err = max_rel_error(og.embeddings, oc.embeddings);
    std::printf("adapter cuda:0 vs cpu %s: %.3g\n", name.c_str(), err);
    EXPECT_LT(err, c.tol) << name;
    EXPECT_EQ(og.routing.expert_ids, oc.routing.expert_ids) << name;
    for (size_t i = 0; i < og.routing.weights.size(); ++i)
      EXPECT_NEAR(og.routing.weights[i], oc.routing.weights[i], 1e-5) << name;
    // Both HF blocks (Qwen2-MoE: shared expert and its gate), with the same routing on both sides.
    for (const auto& [block, dir] : {std::pair<std::string, std::string>{"mixtral", "mixtral_tiny"},
                                     std::pair<std::string, std::string>{"qwen2_moe", "qwen2_moe_tiny"}}) {
      const std::string prefix = io.metadata().at(block + ".prefix");
      const MoeLayer lc = MoeLayer::load_hf_layer(fixture_path(dir), prefix, options("cpu", c.type));
      const MoeLayer lg = MoeLayer::load_hf_layer(fixture_path(dir), prefix, options("cuda:0", c.type));
      const Tensor bx = io.get(block + ".input");
      const moe::Routing r = lc.route(bx);
      EXPECT_LT(max_rel_error(lg.router_logits(bx), lc.router_logits(bx)), kCudaF32) << block << " " << name;
      EXPECT_LT(max_rel_error(lg.run_experts(bx, r), lc.run_experts(bx, r)), c.tol) << block << " " << name;
      // Many rows, every expert busy.
      const Tensor many = moe::test::random_tensor(513, 16, 11);
      const moe::Routing rm = lc.route(many);
      EXPECT_LT(max_rel_error(lg.run_experts(many, rm), lc.run_experts(many, rm)), c.tol) << block << " " << name;
    }
  }
}

TEST(CudaEngine, ModelsOnOneDeviceShareItsBackendAcrossThreads) {
  std::string why;
  if (!have_cuda(&why)) GTEST_SKIP() << why;
  // Two models on cuda:0 used from two threads at once: their calls take turns on the shared
  // backend (backend_mutex) and give the single-threaded results.
  auto io = moe::SafetensorsFile::open(fixture_path("clip_tiny_io.safetensors"));
  const auto ids = real_ids(io, "text.");
  const auto o = options("cuda:0", WeightType::F16);
  const ClipModel clip = ClipModel::load(fixture_path("clip_tiny"), o);
  const MoeAdapter adapter = MoeAdapter::load(fixture_path("adapter_tiny"), o);
  const Tensor x = moe::test::random_tensor(64, 16, 5);
  const Tensor want_clip = clip.encode_token_ids(ids).embeds;
  const Tensor want_adapter = adapter.apply(x).embeddings;
  double e1 = -1, e2 = -1;
  std::thread t1([&] {
    double worst = 0;
    for (int k = 0; k < 50; ++k) worst = std::max(worst, max_abs_error(clip.encode_token_ids(ids).embeds, want_clip));
    e1 = worst;
  });
  std::thread t2([&] {
    double worst = 0;
    for (int k = 0; k < 50; ++k) worst = std::max(worst, max_abs_error(adapter.apply(x).embeddings, want_adapter));
    e2 = worst;
  });
  t1.join();
  t2.join();
  EXPECT_EQ(e1, 0.0);
  EXPECT_EQ(e2, 0.0);
}
