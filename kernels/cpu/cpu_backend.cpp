// The CPU backend: host memory, operations run synchronously over the reference functions in
// cpu_ops on the backend's thread pool (linear, and grouped_swiglu on prepared weights, run
// cpu_gemm (oneDNN) there; layer norm, the element-wise operations, attention and
// l2_normalize_rows split their rows over it; the rest runs on the calling thread). It runs every
// operation at every size and weight type, so it keeps Backend::why_unsupported's default
// (supports() is true for every well-formed desc). With CpuBackendOptions::async_copies,
// copy_from_host_async runs on a worker thread (a FIFO copy queue), so code written for a GPU's
// copy stream runs, and is tested, on a machine without one.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "backend.h"
#include "cpu_gemm.h"
#include "cpu_int4.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "moe/error.h"
#include "op_checks.h"

namespace moe::kernels {

namespace {

// FIFO of host copies run by one worker thread. Copy number s (1, 2, ...) is done once
// completed_ >= s, because copies finish in submission order.
class CopyQueue {
 public:
  CopyQueue() : worker_([this] { run(); }) {}
  ~CopyQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_one();
    worker_.join();  // the worker drains the queue first
  }
  uint64_t submit(void* dst, const void* src, size_t bytes) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seq = ++submitted_;
      jobs_.push_back({dst, src, bytes, seq});
    }
    work_cv_.notify_one();
    return seq;
  }
  bool done(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_ >= seq;
  }
  void wait(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return completed_ >= seq; });
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
    uint64_t seq;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      const Job job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      std::memcpy(job.dst, job.src, job.bytes);
      lock.lock();
      completed_ = job.seq;
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> jobs_;
  uint64_t submitted_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members it uses exist
};

class CpuEvent final : public Event {
 public:
  CpuEvent(const void* owner, uint64_t seq) : owner(owner), seq(seq) {}
  const void* owner;
  uint64_t seq;  // 0: completed when created (synchronous copy)
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options)
      : pool_(options.threads > 0 ? options.threads : cpu::usable_cores()), gemm_(pool_) {
    if (options.async_copies) copies_ = std::make_unique<CopyQueue>();
  }
  ~CpuBackend() override { copies_.reset(); }  // drains the copy queue

  std::string name() const override { return "cpu"; }
  bool is_host_memory() const override { return true; }

  MemoryInfo memory_info() const override {
    MemoryInfo info;
    // MemAvailable (what can be allocated without swapping) when the kernel reports it.
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    size_t kib = 0;
    std::string unit;
    while (meminfo >> key >> kib >> unit) {
      if (key == "MemTotal:") info.total_bytes = kib * 1024;
      if (key == "MemAvailable:") info.free_bytes = kib * 1024;
    }
    if (info.total_bytes == 0) {
      const long page = sysconf(_SC_PAGESIZE);
      info.total_bytes = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(page);
      info.free_bytes = static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(page);
    }
    return info;
  }

  // ---- memory ----
  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) throw Error("cpu: out of memory allocating " + std::to_string(bytes) + " bytes");
    return p;
  }
  void deallocate(void* ptr) override { std::free(ptr); }
  void* allocate_host_staging(size_t bytes) override { return allocate(bytes); }
  void free_host_staging(void* ptr) override { std::free(ptr); }
  bool shares_staging_with(const Backend&) const override { return true; }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  // Operations run synchronously here, so the copy is ordered with both backends' work already.
  void copy_to_peer(Backend& peer, void* dst, const void* src, size_t bytes) override {
    if (!peer.is_host_memory())
      throw Error("cpu: copy_to_peer: " + peer.name() + " is not host memory (copy through the host instead)");
    copy(dst, src, bytes);
  }
  std::shared_ptr<Event> copy_from_host_async(void* dst, const void* src, size_t bytes) override {
    if (!copies_) {
      copy(dst, src, bytes);
      return std::make_shared<CpuEvent>(this, 0);
    }
    return std::make_shared<CpuEvent>(this, copies_->submit(dst, src, bytes));
  }
  bool event_complete(const Event& event) override {
    const uint64_t seq = own(event, "event_complete").seq;
    return seq == 0 || copies_->done(seq);
  }
  void wait_event(const Event& event) override {
    const uint64_t seq = own(event, "wait_event").seq;
    if (seq != 0) copies_->wait(seq);
  }
  void synchronize() override {}

  // ---- operations ----
  void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) override {
    checks::linear(name(), w, m, n, k);
    if (m == 0 || n == 0) return;
    if (w.type == WeightType::Q4) {  // large batches dequantise and multiply on the pool (cpu_int4.h)
      cpu::linear_q4(x, *static_cast<const Q4Weight*>(w.data), bias, y, m, n, k, gemm_, pool_);
      return;
    }
    gemm_.linear(x, w, bias, y, m, n, k);
  }
  void prepare_linear_weight(WeightRef w, int64_t n, int64_t k) override {
    checks::linear(name(), w, 1, n, k);
    gemm_.prepare(w, n, k);
  }
  void release_linear_weight(WeightRef w, int64_t n, int64_t k) override { gemm_.release(w, n, k); }
  // Element-wise operations, layer norm, attention and l2_normalize_rows split their rows (or
  // elements, or (sequence, head) pairs) over the pool that linear runs on: each part gives the
  // results the whole would (every row and head is computed alone).
  void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                  float eps) override {
    checks::non_negative(name(), "layer_norm", {rows, cols});
    split(rows, cols, 1, [&](int64_t r0, int64_t r1) {
      cpu::layer_norm(x + r0 * cols, gamma, beta, y + r0 * cols, r1 - r0, cols, eps);
    });
  }
  void gelu(float* x, int64_t n) override {
    split(n, 1, kElementAlign, [&](int64_t i0, int64_t i1) { cpu::gelu(x + i0, i1 - i0); });
  }
  void quick_gelu(float* x, int64_t n) override {
    split(n, 1, kElementAlign, [&](int64_t i0, int64_t i1) { cpu::quick_gelu(x + i0, i1 - i0); });
  }
  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override {
    split(n, 1, kElementAlign, [&](int64_t i0, int64_t i1) { cpu::silu_mul(gate + i0, up + i0, out + i0, i1 - i0); });
  }
  void add(float* y, const float* x, int64_t n) override {
    split(n, 1, kElementAlign, [&](int64_t i0, int64_t i1) { cpu::add_inplace(y + i0, x + i0, i1 - i0); });
  }
  void attention(const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t heads, int64_t head_dim,
                 bool causal) override {
    checks::attention(name(), seq_lens, heads, head_dim);
    const int64_t width = heads * head_dim;
    // (sequence, head) pairs, each with its work (scores and weighted sums: len² · head_dim).
    std::vector<int64_t> first_row, units;
    int64_t row = 0, work = 0;
    for (int64_t len : seq_lens) {
      if (len > 0) {
        first_row.push_back(row);
        units.push_back(len);
        work += len * len * head_dim * heads;
      }
      row += len;
    }
    const int64_t pairs = static_cast<int64_t>(units.size()) * heads;
    split(pairs, std::max<int64_t>(1, work / std::max<int64_t>(pairs, 1)), 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> scratch;
      for (int64_t p = p0; p < p1; ++p) {
        const size_t s = static_cast<size_t>(p / heads);
        const int64_t h = p % heads, len = units[s];
        scratch.resize(static_cast<size_t>(len * len));
        const float* q = qkv + first_row[s] * 3 * width + h * head_dim;
        cpu::attention(q, q + width, q + 2 * width, 3 * width, out + first_row[s] * width + h * head_dim, width, len, 1,
                       head_dim, causal, scratch.data());
      }
    });
  }
  void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) override {
    split(rows, cols, 1, [&](int64_t r0, int64_t r1) { cpu::l2_normalize_rows(x + r0 * cols, r1 - r0, cols, eps); });
  }
  void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize, int32_t* ids,
                    float* weights) override {
    checks::topk_softmax(name(), rows, experts, top_k);
    cpu::topk_softmax(logits, rows, experts, top_k, renormalize, ids, weights);
  }
  std::vector<int64_t> moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts, const float* x,
                                   int64_t cols, float* x_sorted, int32_t* slot_of) override {
    checks::moe_permute(name(), rows, top_k, experts, cols);
    std::vector<int64_t> offsets(static_cast<size_t>(experts + 1));
    try {
      cpu::moe_permute(ids, rows, top_k, experts, x, cols, x_sorted, slot_of, offsets.data());
    } catch (const Error& e) {
      throw Error(name() + ": " + e.what());
    }
    return offsets;
  }
  void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                      const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted) override {
    checks::grouped_swiglu(name(), offsets, experts, d, inter);
    if (d == 0) return;
    if (inter == 0) {  // w2 · (empty) = 0
      std::fill(out_sorted, out_sorted + offsets.back() * d, 0.0f);
      return;
    }
    // 4-bit weights dequantise and multiply on the pool (cpu_int4.h). Weights given to
    // prepare_linear_weight run linear's oneDNN matmul on their packed copy; others run OpenBLAS
    // on the weight as it is (e.g. an expert executor's staged copies, which change).
    cpu::grouped_swiglu(x_sorted, offsets, experts, d, inter, out_sorted,
                        [this](const float* x, WeightRef w, float* y, int64_t m, int64_t n, int64_t k) {
                          if (w.type == WeightType::Q4)
                            cpu::linear_q4(x, *static_cast<const Q4Weight*>(w.data), nullptr, y, m, n, k, gemm_, pool_);
                          else if (!gemm_.linear_prepared(x, w, nullptr, y, m, n, k))
                            cpu::linear(x, w, nullptr, y, m, n, k);
                        });
  }
  void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows, int64_t top_k,
                     int64_t cols, float* y) override {
    checks::moe_unpermute(name(), rows, top_k, cols);
    cpu::moe_unpermute(out_sorted, slot_of, weights, rows, top_k, cols, y);
  }
  void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                          int64_t* ids, float* scores) override {
    checks::inner_product_topk(name(), nq, nb, d, k);
    cpu::inner_product_topk(queries, nq, base, nb, d, k, ids, scores);
  }

 private:
  static void copy(void* dst, const void* src, size_t bytes) {
    if (bytes) std::memmove(dst, src, bytes);
  }
  // f(i0, i1) over parts of [0, n) on the pool, `cost` the work of one item: parts of at least
  // kMinSplitWork (below, waking a thread costs more than it saves), up to kSplitsPerThread per
  // thread (a worker whose core is taken leaves its share to the others, as in linear). Element
  // ranges (`align` kElementAlign) start at multiples of whole vectors, so every element takes the
  // same code path (vector body or tail) as without the split.
  template <typename F>
  void split(int64_t n, int64_t cost, int64_t align, F&& f) {
    if (n <= 0) return;
    const int64_t units = (n + align - 1) / align;
    const int64_t parts =
        std::clamp<int64_t>(n * cost / kMinSplitWork, 1, std::min<int64_t>(units, kSplitsPerThread * pool_.threads()));
    if (parts == 1) {
      f(0, n);
      return;
    }
    pool_.run(static_cast<int>(parts),
              [&](int t) { f(std::min(n, units * t / parts * align), std::min(n, units * (t + 1) / parts * align)); });
  }
  static constexpr int64_t kElementAlign = 64;
  static constexpr int64_t kMinSplitWork = int64_t{1} << 16;
  static constexpr int64_t kSplitsPerThread = 3;

  const CpuEvent& own(const Event& event, const char* op) const {
    const auto* e = dynamic_cast<const CpuEvent*>(&event);
    if (!e || e->owner != this) throw Error("cpu: " + std::string(op) + ": the event belongs to another backend");
    return *e;
  }

  cpu::ThreadPool pool_;
  cpu::Gemm gemm_;  // after pool_, which it runs on
  std::unique_ptr<CopyQueue> copies_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace moe::kernels
