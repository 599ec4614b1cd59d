#include "cpu_gemm.h"

#include <cblas.h>
#include <glib.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "cpu_thread_pool.h"

namespace moe::kernels::cpu {

namespace {

constexpr const char* kLogDomain = "moe";
// Matmul primitives kept (one per M, column-block width, K, bias and weight type and layout);
// the least recently used goes beyond this. CLIP at batches 1..256 uses a few dozen.
constexpr size_t kMaxMatmuls = 512;
// Column blocks per call: at least this many multiply-adds each (below, waking a thread costs
// more than it saves), and up to kBlocksPerThread per thread, so that when a worker's core is
// held by another process the others take its share (ThreadPool::run).
constexpr int64_t kMinBlockWork = int64_t{1} << 20;
constexpr int64_t kBlocksPerThread = 3;
// A bf16 matmul's input is rounded to bf16 on the pool in parts of at least this many elements.
constexpr int64_t kMinConvertElements = int64_t{1} << 16;
// The M at which prepare() asks the primitive for its weight layout. oneDNN 2.6 asks the same one
// for every M (brgemm: BA16a64b, gemm:jit: plain); an M whose primitive would want another
// cannot be created on it and runs on the plain weight instead.
constexpr int64_t kLayoutProbeM = 64;

// The process's oneDNN CPU engine, never destroyed (threads exiting later destroy their streams);
// null when oneDNN cannot make one.
dnnl_engine_t engine() {
  static const dnnl_engine_t made = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, dnnl_cpu, 0) == dnnl_success ? e : nullptr;
  }();
  return made;
}

// oneDNN sizes its work by the calling thread's OpenMP team size, when a primitive is created and
// when it runs: 1 here, so that no OpenMP team starts (the ThreadPool's workers set 1 for good).
class OneOmpThread {
 public:
  OneOmpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOmpThread() { omp_set_num_threads(saved_); }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  const int saved_;
};

// A stream and a scratchpad per thread that runs primitives: streams are not shared between
// threads, and primitives take the caller's scratchpad (dnnl_scratchpad_mode_user), so one
// primitive may run on several threads at once. `block_out` holds a column block's output.
struct ThreadState {
  dnnl_stream_t stream = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  std::vector<float> block_out;
  ~ThreadState() {
    if (stream) dnnl_stream_destroy(stream);
    std::free(scratch);
  }
  void* scratchpad(size_t bytes) {
    if (bytes > scratch_bytes) {
      std::free(scratch);
      scratch_bytes = (bytes + 4095) / 4096 * 4096;
      scratch = std::aligned_alloc(64, scratch_bytes);
      if (!scratch) scratch_bytes = 0;
    }
    return scratch;
  }
};
ThreadState& thread_state() {
  thread_local ThreadState state;
  if (!state.stream) dnnl_stream_create(&state.stream, engine(), dnnl_stream_default_flags);
  return state;
}

struct Memory {
  dnnl_memory_t handle = nullptr;
  Memory(const dnnl_memory_desc_t& md, const void* data) {
    if (dnnl_memory_create(&handle, &md, engine(), const_cast<void*>(data)) != dnnl_success) handle = nullptr;
  }
  ~Memory() {
    if (handle) dnnl_memory_destroy(handle);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;
};

dnnl_memory_desc_t plain_md(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                            dnnl_data_type_t type = dnnl_f32) {
  dnnl_memory_desc_t md;
  const dnnl_dims_t dims = {rows, cols}, strides = {row_stride, col_stride};
  dnnl_memory_desc_init_by_strides(&md, 2, dims, type, strides);
  return md;
}

// Whether bf16 matmuls run natively: oneDNN's ISA (the CPU's, capped by ONEDNN_MAX_CPU_ISA) has
// AVX-512 BF16 or AMX. Below it oneDNN emulates bf16 products, slower than f32.
bool bf16_isa() {
  return engine() && (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
}

// A weight w[n,k] as matmul's B [k, n], in some layout, and how to address a block of its columns.
// Its data type (f32 or bf16) is also the type of the matmul's source (the activations).
struct Layout {
  dnnl_memory_desc_t md;  // the whole [k, n]
  const void* data = nullptr;
  int64_t block = 1;  // columns per block of the layout (BA16a64b: 64; plain: 1)

  // The weight [n,k] row-major as it is: B with strides {1, k}.
  static Layout plain(const void* w, int64_t n, int64_t k, dnnl_data_type_t type) {
    return {plain_md(k, n, 1, k, type), w, 1};
  }
  bool bf16() const { return md.data_type == dnnl_bf16; }
  // Columns [n0, n0 + nb) of B, n0 a multiple of `block`: the same strides and blocks, so every
  // element keeps its address.
  dnnl_memory_desc_t columns_md(int64_t nb) const {
    dnnl_memory_desc_t sub = md;
    sub.dims[1] = nb;
    sub.padded_dims[1] = (nb + block - 1) / block * block;
    return sub;
  }
  const void* columns_at(int64_t n0) const {
    const int64_t element = bf16() ? 2 : 4;
    return static_cast<const char*>(data) + n0 / block * md.format_desc.blocking.strides[1] * element;
  }
  // Column blocks are split at multiples of this (a cache-friendly width for plain weights).
  int64_t grain() const { return block > 1 ? block : 64; }
};

// A weight reordered into the layout the matmul asks for, owned here.
struct Packed {
  Layout layout;
  void* memory = nullptr;
  int refs = 0;
  ~Packed() { std::free(memory); }
};

struct Matmul {
  dnnl_primitive_t primitive = nullptr;  // null: oneDNN could not create it (status)
  dnnl_status_t status = dnnl_success;
  dnnl_memory_desc_t a_md, weights_md, bias_md, c_md, scratch_md;
  std::string impl;
  uint64_t used = 0;  // LRU tick
  ~Matmul() {
    if (primitive) dnnl_primitive_destroy(primitive);
  }
};

const char* isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

std::string openblas_core() {
  const char* core = openblas_get_corename();
  return std::string("OpenBLAS ") + (core ? core : "?");
}

// One column block of a call: columns [n0, n0 + nb).
struct ColumnBlock {
  int64_t n0, nb;
  std::shared_ptr<const Matmul> matmul;
};

// y[:, n0:n0+nb] by OpenBLAS on the weight as given, f16/bf16 rows widened (the path of a failed
// primitive).
void blas_columns(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k, int64_t n0,
                  int64_t nb) {
  std::vector<float> widened;
  if (w.type != WeightType::F32) {
    widened.resize(static_cast<size_t>(nb * k));
    weight_rows_to_f32(w, k, n0, nb, widened.data());
  }
  const float* wb = widened.empty() ? static_cast<const float*>(w.data) + n0 * k : widened.data();
  if (bias)
    for (int64_t i = 0; i < m; ++i) std::copy(bias + n0, bias + n0 + nb, y + i * n + n0);
  gemm(false, true, m, nb, k, 1.0f, x, k, wb, k, bias ? 1.0f : 0.0f, y + n0, n);
}

}  // namespace

struct Gemm::Impl {
  explicit Impl(ThreadPool& pool) : pool(pool) {}

  ThreadPool& pool;
  std::mutex mu;  // guards matmuls, tick and prepared
  std::map<std::vector<int64_t>, std::shared_ptr<Matmul>> matmuls;
  uint64_t tick = 0;
  std::map<std::tuple<const void*, int64_t, int64_t>, std::shared_ptr<Packed>> prepared;
  std::atomic<bool> fallback_logged{false};

  // What runs linear here, for the log line.
  std::string describe();
  // Once per process, at the first prepare or f32 linear: what runs linear.
  void log_kernels() {
    static std::once_flag once;
    std::call_once(once, [this] {
      g_log(kLogDomain, engine() ? G_LOG_LEVEL_INFO : G_LOG_LEVEL_MESSAGE, "cpu: linear: %s", describe().c_str());
    });
  }

  // Once per process: why OpenBLAS ran instead of oneDNN.
  void log_fallback(const std::string& why) {
    if (!fallback_logged.exchange(true))
      g_log(kLogDomain, G_LOG_LEVEL_MESSAGE, "cpu: linear: %s; running %s instead (later cases are not logged)",
            why.c_str(), openblas_core().c_str());
  }

  // Once per process and type, at the first prepare of an f16 or bf16 weight: how it is multiplied.
  // Said as a message (not info) where it is not the speed path the precision asks for.
  void log_half_weights(WeightType type, bool as_bf16) {
    static std::once_flag f16_once, bf16_once;
    std::call_once(type == WeightType::F16 ? f16_once : bf16_once, [&] {
      const std::string isa = isa_name(dnnl_get_effective_cpu_isa());
      if (as_bf16) {
        const OneOmpThread one_thread;
        Layout layout;
        std::string kernels = "?";
        if (asked_layout(768, 768, dnnl_bf16, &layout)) {
          std::shared_ptr<const Matmul> mm = matmul(kLayoutProbeM, 768, 768, true, layout.columns_md(768));
          if (mm->primitive) kernels = mm->impl;
        }
        g_log(kLogDomain, G_LOG_LEVEL_INFO,
              "cpu: linear: bf16 weights prepared at load are packed as bf16 for oneDNN matmul %s (CPU ISA %s); "
              "activations are rounded to bf16 before each product, sums are f32",
              kernels.c_str(), isa.c_str());
      } else if (type == WeightType::BF16) {
        g_log(kLogDomain, G_LOG_LEVEL_MESSAGE,
              "cpu: linear: precision bf16: this CPU has neither AVX-512 BF16 nor AMX (oneDNN CPU ISA %s), so bf16 "
              "weights are widened to f32 at load and multiplied in f32",
              isa.c_str());
      } else {
        g_log(kLogDomain, G_LOG_LEVEL_MESSAGE,
              "cpu: linear: precision f16: the CPU backend has no f16 GEMM, so f16 weights are widened to f32 at load "
              "and multiplied in f32 (bf16 is the CPU's half-size precision, on CPUs with AVX-512 BF16 or AMX)");
      }
    });
  }

  static std::shared_ptr<Matmul> create(int64_t m, int64_t k, int64_t nb, bool bias,
                                        const dnnl_memory_desc_t& weights_md) {
    auto mm = std::make_shared<Matmul>();
    mm->a_md = plain_md(m, k, k, 1, weights_md.data_type);  // the source has the weight's type
    mm->weights_md = weights_md;
    mm->bias_md = plain_md(1, nb, nb, 1);
    mm->c_md = plain_md(m, nb, nb, 1);
    dnnl_matmul_desc_t desc;
    mm->status = dnnl_matmul_desc_init(&desc, &mm->a_md, &mm->weights_md, bias ? &mm->bias_md : nullptr, &mm->c_md);
    if (mm->status != dnnl_success) return mm;
    dnnl_primitive_attr_t attr;
    if ((mm->status = dnnl_primitive_attr_create(&attr)) != dnnl_success) return mm;
    dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    dnnl_primitive_desc_t pd;
    mm->status = dnnl_primitive_desc_create(&pd, &desc, attr, engine(), nullptr);
    dnnl_primitive_attr_destroy(attr);
    if (mm->status != dnnl_success) return mm;
    const char* impl = nullptr;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    mm->impl = impl ? impl : "?";
    mm->scratch_md = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    // oneDNN's reference kernels accept any layout, at a fraction of OpenBLAS's speed.
    if (mm->impl.rfind("ref", 0) == 0)
      mm->status = dnnl_unimplemented;
    else
      mm->status = dnnl_primitive_create(&mm->primitive, pd);
    dnnl_primitive_desc_destroy(pd);
    return mm;
  }

  std::shared_ptr<const Matmul> matmul(int64_t m, int64_t k, int64_t nb, bool bias,
                                       const dnnl_memory_desc_t& weights_md) {
    const auto& b = weights_md.format_desc.blocking;
    std::vector<int64_t> key = {weights_md.data_type,
                                m,
                                k,
                                nb,
                                bias,
                                weights_md.padded_dims[0],
                                weights_md.padded_dims[1],
                                b.strides[0],
                                b.strides[1],
                                b.inner_nblks};
    for (int i = 0; i < b.inner_nblks; ++i) key.insert(key.end(), {b.inner_blks[i], b.inner_idxs[i]});
    {
      std::lock_guard<std::mutex> lock(mu);
      if (auto it = matmuls.find(key); it != matmuls.end()) {
        it->second->used = ++tick;
        return it->second;
      }
    }
    std::shared_ptr<Matmul> made = create(m, k, nb, bias, weights_md);  // JIT: outside the lock
    std::lock_guard<std::mutex> lock(mu);
    const auto it = matmuls.emplace(std::move(key), made).first;
    it->second->used = ++tick;
    if (matmuls.size() > kMaxMatmuls) {
      auto oldest = std::min_element(matmuls.begin(), matmuls.end(),
                                     [](const auto& a, const auto& b) { return a.second->used < b.second->used; });
      matmuls.erase(oldest);  // a call still running it holds its own reference
    }
    return it->second;
  }

  // The column blocks of one call, with their primitives; empty when
  // oneDNN cannot create one of them (`why` says which).
  std::vector<ColumnBlock> plan(const Layout& layout, int64_t m, int64_t n, int64_t k, bool bias, std::string* why) {
    const int64_t grain = layout.grain();
    const int64_t grains = (n + grain - 1) / grain;
    const int64_t tasks = pool.threads() == 1
                              ? 1
                              : std::clamp<int64_t>(m * n * k / kMinBlockWork, 1,
                                                    std::min<int64_t>(grains, kBlocksPerThread * pool.threads()));
    std::vector<ColumnBlock> blocks;
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n0 = grains * t / tasks * grain, n1 = std::min(n, grains * (t + 1) / tasks * grain);
      std::shared_ptr<const Matmul> mm = matmul(m, k, n1 - n0, bias, layout.columns_md(n1 - n0));
      if (!mm->primitive) {
        *why = "oneDNN could not create a matmul for " + std::to_string(m) + "x" + std::to_string(n1 - n0) + "x" +
               std::to_string(k) + " (status " + std::to_string(mm->status) +
               (mm->impl.empty() ? "" : ", " + mm->impl) + ")";
        return {};
      }
      blocks.push_back({n0, n1 - n0, std::move(mm)});
    }
    return blocks;
  }

  // `x`: the activations in the layout's type. A block narrower than y computes into the thread's
  // block_out and is copied into y's columns: oneDNN 2.6's brgemm matmul declines an output with a
  // row stride other than its width (only the reference kernel takes one).
  static bool execute(const ColumnBlock& blk, const Layout& layout, const void* x, const float* bias, float* y,
                      int64_t m, int64_t n) {
    const Matmul& mm = *blk.matmul;
    ThreadState& ts = thread_state();
    const size_t scratch_bytes = dnnl_memory_desc_get_size(&mm.scratch_md);
    void* scratch = scratch_bytes ? ts.scratchpad(scratch_bytes) : nullptr;
    if (!ts.stream || (scratch_bytes && !scratch)) return false;
    const bool whole = blk.nb == n;
    if (!whole) ts.block_out.resize(static_cast<size_t>(m * blk.nb));
    float* out = whole ? y : ts.block_out.data();
    Memory a(mm.a_md, x), w(mm.weights_md, layout.columns_at(blk.n0)), c(mm.c_md, out);
    std::optional<Memory> b, s;
    std::vector<dnnl_exec_arg_t> args = {
        {DNNL_ARG_SRC, a.handle}, {DNNL_ARG_WEIGHTS, w.handle}, {DNNL_ARG_DST, c.handle}};
    if (bias) args.push_back({DNNL_ARG_BIAS, b.emplace(mm.bias_md, bias + blk.n0).handle});
    if (scratch_bytes) args.push_back({DNNL_ARG_SCRATCHPAD, s.emplace(mm.scratch_md, scratch).handle});
    for (const dnnl_exec_arg_t& arg : args)
      if (!arg.memory) return false;
    if (dnnl_primitive_execute(mm.primitive, ts.stream, static_cast<int>(args.size()), args.data()) != dnnl_success ||
        dnnl_stream_wait(ts.stream) != dnnl_success)
      return false;
    if (!whole)
      for (int64_t i = 0; i < m; ++i) std::copy_n(out + i * blk.nb, blk.nb, y + i * n + blk.n0);
    return true;
  }

  // False (and `why`) when a primitive could not be created; nothing is computed then. `layout`
  // holds `w` (maybe packed, maybe as bf16); a bf16 layout multiplies x rounded to bf16.
  bool run(const Layout& layout, const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
           int64_t k, std::string* why) {
    const std::vector<ColumnBlock> blocks = plan(layout, m, n, k, bias != nullptr, why);
    if (blocks.empty()) return false;
    thread_local std::vector<uint16_t> x_bf16;  // this call's, read by the pool's threads
    const void* src = x;
    if (layout.bf16()) {
      x_bf16.resize(static_cast<size_t>(m * k));
      uint16_t* to = x_bf16.data();
      // Rows split over the pool like the blocks (rounding is per element: any split gives the same).
      const int64_t parts = std::clamp<int64_t>(m * k / kMinConvertElements, 1, std::min<int64_t>(m, pool.threads()));
      pool.run(static_cast<int>(parts), [&](int t) {
        const int64_t r0 = m * t / parts, r1 = m * (t + 1) / parts;
        f32_to_bf16(x + r0 * k, to + r0 * k, (r1 - r0) * k);
      });
      src = to;
    }
    std::atomic<bool> failed{false};
    pool.run(static_cast<int>(blocks.size()), [&](int i) {
      const ColumnBlock& blk = blocks[static_cast<size_t>(i)];
      if (!execute(blk, layout, src, bias, y, m, n)) {
        failed = true;
        blas_columns(x, w, bias, y, m, n, k, blk.n0, blk.nb);
      }
    });
    if (failed) log_fallback("a oneDNN matmul failed to run");
    return true;
  }

  std::shared_ptr<const Packed> find_prepared(const void* data, int64_t n, int64_t k) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = prepared.find({data, n, k});
    return it == prepared.end() ? nullptr : it->second;
  }

  // run() on w's packed copy; false when w is not prepared or (`why`) no primitive runs this M.
  bool run_prepared(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k,
                    std::string* why) {
    const std::shared_ptr<const Packed> packed = find_prepared(w.data, n, k);
    return packed && run(packed->layout, x, w, bias, y, m, n, k, why);
  }

  // The layout the matmul asks for its weight B [k, n] of `type` (kLayoutProbeM rows of the same
  // type, f32 out), if it is addressable by column blocks (a blocked or plain layout) and the
  // matmul is not oneDNN's reference kernel.
  static bool asked_layout(int64_t n, int64_t k, dnnl_data_type_t type, Layout* layout) {
    dnnl_memory_desc_t a = plain_md(kLayoutProbeM, k, k, 1, type), c = plain_md(kLayoutProbeM, n, n, 1), any;
    const dnnl_dims_t b_dims = {k, n};
    if (dnnl_memory_desc_init_by_tag(&any, 2, b_dims, type, dnnl_format_tag_any) != dnnl_success) return false;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t pd;
    if (dnnl_matmul_desc_init(&desc, &a, &any, nullptr, &c) != dnnl_success ||
        dnnl_primitive_desc_create(&pd, &desc, nullptr, engine(), nullptr) != dnnl_success)
      return false;
    layout->md = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    const char* impl = nullptr;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    dnnl_primitive_desc_destroy(pd);
    if (!impl || std::string(impl).rfind("ref", 0) == 0) return false;
    const dnnl_memory_desc_t& md = layout->md;
    if (md.format_kind != dnnl_blocked || md.offset0 != 0) return false;
    layout->block = 1;
    for (int i = 0; i < md.format_desc.blocking.inner_nblks; ++i)
      if (md.format_desc.blocking.inner_idxs[i] == 1) layout->block *= md.format_desc.blocking.inner_blks[i];
    return true;
  }

  // The weight reordered into the layout the matmul asks for, as `type` (column blocks reordered on
  // the pool's threads; f16/bf16 rows widened first when `type` is f32); null when oneDNN cannot
  // do it (linear then reads the weight as it is).
  std::shared_ptr<Packed> pack(WeightRef w, int64_t n, int64_t k, dnnl_data_type_t type) {
    auto packed = std::make_shared<Packed>();
    if (!asked_layout(n, k, type, &packed->layout)) return nullptr;
    const dnnl_memory_desc_t& md = packed->layout.md;
    const size_t bytes = (dnnl_memory_desc_get_size(&md) + 63) / 64 * 64;
    packed->memory = std::aligned_alloc(64, bytes);
    if (!packed->memory) return nullptr;
    std::memset(packed->memory, 0, bytes);  // the layout's padding multiplies as zeros
    packed->layout.data = packed->memory;

    const bool widen = type == dnnl_f32 && w.type != WeightType::F32;
    const Layout source = Layout::plain(w.data, n, k, widen ? dnnl_f32 : type);  // read when not widened
    const Layout& target = packed->layout;
    const int64_t grain = target.grain(), grains = (n + grain - 1) / grain;
    const int tasks = static_cast<int>(std::min<int64_t>(pool.threads(), grains));
    std::atomic<bool> failed{false};
    pool.run(tasks, [&](int t) {
      const int64_t n0 = grains * t / tasks * grain, nb = std::min(n, grains * (t + 1) / tasks * grain) - n0;
      const dnnl_memory_desc_t to_md = target.columns_md(nb);
      std::vector<float> widened;
      if (widen) {
        widened.resize(static_cast<size_t>(nb * k));
        weight_rows_to_f32(w, k, n0, nb, widened.data());
      }
      const dnnl_memory_desc_t from_md = widen ? plain_md(k, nb, 1, k) : source.columns_md(nb);
      const void* from_data = widen ? widened.data() : source.columns_at(n0);
      dnnl_primitive_desc_t rpd;
      dnnl_primitive_t reorder = nullptr;
      ThreadState& ts = thread_state();
      bool ok = ts.stream &&
                dnnl_reorder_primitive_desc_create(&rpd, &from_md, engine(), &to_md, engine(), nullptr) == dnnl_success;
      if (ok) {
        ok = dnnl_primitive_create(&reorder, rpd) == dnnl_success;
        dnnl_primitive_desc_destroy(rpd);
      }
      if (ok) {
        Memory from(from_md, from_data), to(to_md, target.columns_at(n0));
        dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from.handle}, {DNNL_ARG_TO, to.handle}};
        ok = from.handle && to.handle && dnnl_primitive_execute(reorder, ts.stream, 2, args) == dnnl_success &&
             dnnl_stream_wait(ts.stream) == dnnl_success;
      }
      if (reorder) dnnl_primitive_destroy(reorder);
      if (!ok) failed = true;
    });
    return failed ? nullptr : packed;
  }
};

Gemm::Gemm(ThreadPool& pool) : impl_(std::make_unique<Impl>(pool)) {}
Gemm::~Gemm() = default;

bool bf16_native() { return bf16_isa(); }

void Gemm::linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (w.type == WeightType::Q4 || m == 0 || n == 0 || k == 0) {
    cpu::linear(x, w, bias, y, m, n, k);
    return;
  }
  impl_->log_kernels();
  if (!engine()) {
    cpu::linear(x, w, bias, y, m, n, k);
    return;
  }
  const OneOmpThread one_thread;
  std::string why;
  if (impl_->run_prepared(x, w, bias, y, m, n, k, &why)) return;
  if (w.type != WeightType::F32) {  // not prepared (or no primitive for this M): widened per call
    if (!why.empty()) impl_->log_fallback(why);
    cpu::linear(x, w, bias, y, m, n, k);
    return;
  }
  if (impl_->run(Layout::plain(w.data, n, k, dnnl_f32), x, w, bias, y, m, n, k, &why)) return;
  impl_->log_fallback(why);
  blas_columns(x, w, bias, y, m, n, k, 0, n);
}

bool Gemm::linear_prepared(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (w.type == WeightType::Q4 || m == 0 || n == 0 || k == 0 || !engine()) return false;
  const OneOmpThread one_thread;
  std::string why;
  if (impl_->run_prepared(x, w, bias, y, m, n, k, &why)) return true;
  if (!why.empty()) impl_->log_fallback(why);
  return false;
}

void Gemm::prepare(WeightRef w, int64_t n, int64_t k) {
  if (w.type == WeightType::Q4 || n == 0 || k == 0) return;
  impl_->log_kernels();
  if (!engine()) return;
  const bool as_bf16 = w.type == WeightType::BF16 && bf16_isa();
  if (w.type != WeightType::F32) impl_->log_half_weights(w.type, as_bf16);
  const std::tuple<const void*, int64_t, int64_t> key{w.data, n, k};
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (auto it = impl_->prepared.find(key); it != impl_->prepared.end()) {
      ++it->second->refs;
      return;
    }
  }
  const OneOmpThread one_thread;
  std::shared_ptr<Packed> packed = impl_->pack(w, n, k, as_bf16 ? dnnl_bf16 : dnnl_f32);
  if (!packed) return;  // linear reads the weight as it is
  std::lock_guard<std::mutex> lock(impl_->mu);
  ++impl_->prepared.emplace(key, std::move(packed)).first->second->refs;
}

void Gemm::release(WeightRef w, int64_t n, int64_t k) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->prepared.find({w.data, n, k});
  if (it != impl_->prepared.end() && --it->second->refs == 0) impl_->prepared.erase(it);
}

std::string Gemm::Impl::describe() {
  const std::string threads = std::to_string(pool.threads()) + " thread" + (pool.threads() == 1 ? "" : "s");
  if (!engine()) return openblas_core() + " sgemm (oneDNN could not create a CPU engine), " + threads;
  const dnnl_version_t* v = dnnl_version();
  // The kernels a ViT-B/32 layer's 768x768 projection runs, on packed weights.
  const OneOmpThread one_thread;
  std::string kernels = "?";
  Layout layout;
  if (asked_layout(768, 768, dnnl_f32, &layout)) {
    std::shared_ptr<const Matmul> mm = matmul(kLayoutProbeM, 768, 768, true, layout.columns_md(768));
    if (mm->primitive) kernels = mm->impl;
  }
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " matmul " + kernels + " (CPU ISA " + isa_name(dnnl_get_effective_cpu_isa()) +
         "), f32 weights prepared at load are packed for it, N split over " + threads;
}

}  // namespace moe::kernels::cpu
