// moe-bench-gemm: single-precision GEMM GFLOP/s of the CPU matrix-multiply libraries Debian 12
// ships, at the shapes the CLIP encoders run, with a correctness check of every result
// (docs/benchmarks.md, "CPU GEMM libraries and peers").
//
// The engine's layout: C[M,N] = A[M,K] · B[N,K]ᵀ, row-major (x · Wᵀ, a Linear layer).
//
// Every library runs in a process of its own (this program runs itself again with --child), so
// two BLAS libraries never share one process (their cblas_*/sgemm_ symbols would interpose) and
// OpenBLAS reads a forced core type at load time as it does for a user. The parent runs rounds;
// in each round every (library, threads) child runs once, in a rotating order, and times every
// shape once. Figures are the medians over rounds; spread = (max - min) / median. `vs Debian`
// is the median over rounds of time(OpenBLAS as Debian ships it) / time(this), from the same
// round, so neighbours' load touches both alike.
//
// Libraries are opened with dlopen() by their Debian sonames, so the program builds with no
// BLAS at all; a library that is not installed is reported and skipped. oneDNN's C API is used
// through its header (libdnnl-dev) when meson finds it.
//
// Correctness: after the warm-up call, 16 rows of C (spread over M, all N columns) are compared
// with a double-precision reference. The error is |c - ref| / Σ_k |a_ik·b_jk| (the bound a
// correct fp32 GEMM meets with a factor of about K·2^-24); above 1e-4 the row says WRONG. bf16
// methods round the inputs to 8 significant bits, so their error is larger by design (about 5e-4
// on random data); their threshold is 2e-2.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if MOE_BENCH_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace {

const char* kUsage =
    "usage: moe-bench-gemm [options]\n"
    "  sgemm GFLOP/s of OpenBLAS, BLIS and oneDNN at CLIP shapes, each checked against a double reference.\n"
    "  --variants LIST  children to run (default: all of openblas, openblas:SkylakeX, openblas:Haswell,\n"
    "                   openblas:Zen, openblas:Prescott, openblas-repick, blis, dnnl)\n"
    "                   openblas        = libopenblas.so.0 as Debian ships it (its own CPU detection)\n"
    "                   openblas:CORE   = the same with OPENBLAS_CORETYPE=CORE for that child only\n"
    "                   openblas-repick = prototype: starts as Prescott (simulates a CPU that 0.3.21 does not\n"
    "                                     recognise), then re-picks a core itself from CPUID, no user env\n"
    "                   blis            = libblis.so.4 (Debian's alternative, pthread or openmp)\n"
    "                   dnnl            = libdnnl.so.2: dnnl_sgemm, matmul, matmul on packed weights, bf16 matmul,\n"
    "                                     and (threads > 1) matmul-packed-own-threads: one 1-thread primitive per\n"
    "                                     column block on a pool of blocking threads (no OpenMP team)\n"
    "  --threads LIST   thread counts (default 1,2)\n"
    "  --rounds N       rounds (default 5; --quick 3)\n"
    "  --shapes LIST    MxNxK,... (default: the CLIP ViT-B/32 shapes below; --quick 3 of them)\n"
    "  --min-sample-ms  one sample lasts at least this long (default 150)\n"
    "  --quick          3 rounds, 3 shapes\n"
    "  --json FILE      also write every sample as JSON\n"
    "  (--child VARIANT --threads N --shapes ... runs one child; used by the parent)\n";

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Shape {
  int64_t m, n, k;
  std::string label;
  std::string key() const { return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k); }
  double flop() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

// M×N×K of the engine's Linear calls in openai/clip-vit-base-patch32 (50 tokens per image, 16
// tokens per text; batch 32 and batch 1).
std::vector<Shape> default_shapes() {
  return {{1600, 768, 768, "vision b32 q/k/v/out"}, {1600, 3072, 768, "vision b32 fc1"},
          {1600, 768, 3072, "vision b32 fc2"},      {512, 512, 512, "text b32 q/k/v/out"},
          {512, 2048, 512, "text b32 fc1"},         {512, 512, 2048, "text b32 fc2"},
          {50, 3072, 768, "vision b1 fc1"},         {16, 2048, 512, "text b1 fc1"}};
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<Shape> parse_shapes(const std::string& spec) {
  std::vector<Shape> all = default_shapes(), out;
  for (const std::string& s : split(spec, ',')) {
    const std::vector<std::string> d = split(s, 'x');
    if (d.size() != 3) throw std::runtime_error("--shapes: MxNxK, not '" + s + "'");
    Shape sh{std::stoll(d[0]), std::stoll(d[1]), std::stoll(d[2]), ""};
    for (const Shape& a : all)
      if (a.key() == sh.key()) sh.label = a.label;
    out.push_back(sh);
  }
  return out;
}

std::string shapes_spec(const std::vector<Shape>& shapes) {
  std::string s;
  for (const Shape& sh : shapes) s += (s.empty() ? "" : ",") + sh.key();
  return s;
}

// ---- data and the reference ----------------------------------------------------------------

struct Aligned {
  float* p = nullptr;
  explicit Aligned(size_t n) {
    if (posix_memalign(reinterpret_cast<void**>(&p), 64, std::max<size_t>(n, 1) * sizeof(float)))
      throw std::runtime_error("out of memory");
  }
  ~Aligned() { free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

void fill_random(float* p, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    p[i] = static_cast<float>(static_cast<double>(s >> 11) * (2.0 / 9007199254740992.0) - 1.0);
  }
}

// Worst normalised error over 16 rows spread over M (every column).
double check_error(const Shape& s, const float* a, const float* b, const float* c) {
  double worst = 0;
  const int64_t rows = std::min<int64_t>(16, s.m);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = rows == 1 ? 0 : r * (s.m - 1) / (rows - 1);
    for (int64_t j = 0; j < s.n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t q = 0; q < s.k; ++q) {
        const double x = static_cast<double>(a[i * s.k + q]) * static_cast<double>(b[j * s.k + q]);
        ref += x;
        mag += std::fabs(x);
      }
      const double e = std::fabs(static_cast<double>(c[i * s.n + j]) - ref) / std::max(mag, 1e-30);
      if (!(e <= worst)) worst = std::isfinite(e) ? e : 1e30;  // NaN counts as wrong
    }
  }
  return worst;
}

// ---- the libraries (child side) ------------------------------------------------------------

void* open_lib(const std::vector<const char*>& names, std::string* which) {
  for (const char* n : names) {
    if (void* h = dlopen(n, RTLD_NOW | RTLD_LOCAL)) {
      *which = n;
      return h;
    }
  }
  return nullptr;
}

template <typename F>
F sym(void* h, const char* name) {
  void* p = dlsym(h, name);
  if (!p) throw std::runtime_error(std::string("symbol ") + name + " not found");
  return reinterpret_cast<F>(p);
}

// A method: sets up for one shape (may pack weights), then computes C = A·Bᵀ per call.
struct Method {
  std::string name;
  double tolerance = 1e-4;
  // Returns the call for this shape, or throws (reported as "unsupported: why").
  std::function<std::function<void()>(const Shape&, const float* a, const float* b, float* c)> prepare;
};

// cblas_sgemm(RowMajor=101, NoTrans=111, Trans=112, ...): the engine's call (kernels/cpu).
using cblas_sgemm_t = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                               int);

Method cblas_method(const std::string& name, cblas_sgemm_t f) {
  Method m{name, 1e-4, nullptr};
  m.prepare = [f](const Shape& s, const float* a, const float* b, float* c) -> std::function<void()> {
    return [=] {
      f(101, 111, 112, static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1.0f, a,
        static_cast<int>(s.k), b, static_cast<int>(s.k), 0.0f, c, static_cast<int>(s.n));
    };
  };
  return m;
}

// The shared libraries this process has mapped whose names mention a BLAS or oneDNN: proves
// that a child holds one library only.
std::string mapped_math_libs() {
  std::ifstream maps("/proc/self/maps");
  std::string line, out;
  std::vector<std::string> seen;
  while (std::getline(maps, line)) {
    const size_t slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    const std::string file = line.substr(slash + 1);
    if (file.find("blas") == std::string::npos && file.find("blis") == std::string::npos &&
        file.find("dnnl") == std::string::npos && file.find("mkl") == std::string::npos)
      continue;
    if (std::find(seen.begin(), seen.end(), file) != seen.end()) continue;
    seen.push_back(file);
    out += (out.empty() ? "" : " ") + file;
  }
  return out;
}

// The OpenBLAS core a CPU should get, from CPUID (libgcc's check includes the OS's XSAVE state):
// AVX-512 F/BW/VL/DQ -> SkylakeX kernels, AVX2 + FMA -> Haswell kernels, otherwise none.
std::string wanted_openblas_core() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return "";
}

struct Child {
  std::map<std::string, std::string> info;
  std::vector<Method> methods;
  std::function<void(int)> set_threads;
  // Facts learnt while preparing methods (oneDNN's implementation per shape), printed at the end.
  std::shared_ptr<std::map<std::string, std::string>> learnt = std::make_shared<std::map<std::string, std::string>>();
};

Child open_openblas(const std::string& variant) {
  Child ch;
  std::string so;
  void* h = open_lib({"libopenblas.so.0", "libopenblas.so"}, &so);
  if (!h) throw std::runtime_error("OpenBLAS not found (Debian: libopenblas0)");
  auto corename = sym<char* (*)()>(h, "openblas_get_corename");
  auto config = sym<char* (*)()>(h, "openblas_get_config");
  auto set_threads = sym<void (*)(int)>(h, "openblas_set_num_threads");
  ch.info["library"] = so;
  ch.info["config"] = config();
  ch.info["core"] = corename();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  ch.info["OPENBLAS_CORETYPE"] = forced ? forced : "(unset)";
  if (variant == "openblas-repick") {
    // What an engine could do at start-up without the user's help: if the library runs a core
    // weaker than the CPU's ISA allows, re-run its dispatcher with the core named, through its
    // exported gotoblas_dynamic_quit/init (0.3.21 reads OPENBLAS_CORETYPE there). The variable
    // is restored right after.
    const std::string want = wanted_openblas_core();
    const std::string now = ch.info["core"];
    const bool ok_now = (want == "SkylakeX" && (now == "SkylakeX" || now == "Cooperlake" || now == "Sapphirerapids")) ||
                        (want == "Haswell" && (now == "Haswell" || now == "Zen")) || want.empty();
    ch.info["repick_wanted"] = want.empty() ? "(none)" : want;
    if (!ok_now) {
      auto quit = sym<void (*)()>(h, "gotoblas_dynamic_quit");
      auto init = sym<void (*)()>(h, "gotoblas_dynamic_init");
      const std::string saved = forced ? forced : "";
      setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
      quit();
      init();
      if (forced)
        setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
      else
        unsetenv("OPENBLAS_CORETYPE");
    }
    ch.info["core_after_repick"] = corename();
  }
  ch.set_threads = [set_threads](int n) { set_threads(n); };
  ch.methods.push_back(cblas_method("sgemm", sym<cblas_sgemm_t>(h, "cblas_sgemm")));
  return ch;
}

Child open_blis() {
  Child ch;
  std::string so;
  void* h = open_lib({"libblis.so.4", "libblis.so"}, &so);
  if (!h) throw std::runtime_error("BLIS not found (Debian: libblis4-pthread or libblis-dev)");
  auto arch_id = sym<int (*)()>(h, "bli_arch_query_id");
  auto arch_string = sym<char* (*)(int)>(h, "bli_arch_string");
  auto version = sym<char* (*)()>(h, "bli_info_get_version_str");
  auto set_threads = sym<void (*)(int64_t)>(h, "bli_thread_set_num_threads");
  Dl_info dl{};
  void* f = dlsym(h, "cblas_sgemm");
  std::string real = so;
  if (f && dladdr(f, &dl) && dl.dli_fname) real = dl.dli_fname;
  char resolved[4096];
  if (realpath(real.c_str(), resolved)) real = resolved;
  ch.info["library"] = real;
  ch.info["version"] = version();
  ch.info["config"] = arch_string(arch_id());
  ch.set_threads = [set_threads](int n) { set_threads(n); };
  ch.methods.push_back(cblas_method("sgemm", sym<cblas_sgemm_t>(h, "cblas_sgemm")));
  return ch;
}

#if MOE_BENCH_HAVE_DNNL
// oneDNN's C API through dlsym, typed by its header.
struct Dnnl {
#define MOE_DNNL_FN(name) decltype(&::name) name = nullptr;
  MOE_DNNL_FN(dnnl_sgemm)
  MOE_DNNL_FN(dnnl_engine_create)
  MOE_DNNL_FN(dnnl_stream_create)
  MOE_DNNL_FN(dnnl_stream_wait)
  MOE_DNNL_FN(dnnl_memory_desc_init_by_tag)
  MOE_DNNL_FN(dnnl_memory_desc_init_by_strides)
  MOE_DNNL_FN(dnnl_memory_create)
  MOE_DNNL_FN(dnnl_matmul_desc_init)
  MOE_DNNL_FN(dnnl_primitive_desc_create)
  MOE_DNNL_FN(dnnl_primitive_desc_query)
  MOE_DNNL_FN(dnnl_primitive_desc_query_md)
  MOE_DNNL_FN(dnnl_reorder_primitive_desc_create)
  MOE_DNNL_FN(dnnl_primitive_create)
  MOE_DNNL_FN(dnnl_primitive_execute)
  MOE_DNNL_FN(dnnl_get_effective_cpu_isa)
  MOE_DNNL_FN(dnnl_version)
#undef MOE_DNNL_FN
  dnnl_engine_t engine = nullptr;
  dnnl_stream_t stream = nullptr;
};

void ok(dnnl_status_t st, const char* what) {
  if (st != dnnl_success) throw std::runtime_error(std::string(what) + " failed (status " + std::to_string(st) + ")");
}

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

// A matmul on f32 data: `packed` lets the primitive choose the weights' layout (reordered once,
// outside the timing, as an engine does at load); `bf16` takes bf16 weights (packed) and
// converts A to bf16 inside every call (a reorder, timed), with f32 output.
Method dnnl_matmul_method(std::shared_ptr<Dnnl> d, const std::string& name, bool packed, bool bf16,
                          std::shared_ptr<std::map<std::string, std::string>> info) {
  Method m{name, bf16 ? 2e-2 : 1e-4, nullptr};
  m.prepare = [d, packed, bf16, info, name](const Shape& s, const float* a, const float* b,
                                            float* c) -> std::function<void()> {
    dnnl_memory_desc_t a_user, b_user, c_md, a_md, b_md;
    const dnnl_dims_t a_dims = {s.m, s.k}, b_dims = {s.k, s.n}, c_dims = {s.m, s.n};
    const dnnl_dims_t b_strides = {1, s.k};  // B is stored [N,K] row-major: (k, n) at n·K + k
    ok(d->dnnl_memory_desc_init_by_tag(&a_user, 2, a_dims, dnnl_f32, dnnl_ab), "a md");
    ok(d->dnnl_memory_desc_init_by_strides(&b_user, 2, b_dims, dnnl_f32, b_strides), "b md");
    ok(d->dnnl_memory_desc_init_by_tag(&c_md, 2, c_dims, dnnl_f32, dnnl_ab), "c md");
    const dnnl_data_type_t in_t = bf16 ? dnnl_bf16 : dnnl_f32;
    ok(d->dnnl_memory_desc_init_by_tag(&a_md, 2, a_dims, in_t, dnnl_ab), "a md");
    if (packed || bf16)
      ok(d->dnnl_memory_desc_init_by_tag(&b_md, 2, b_dims, in_t, dnnl_format_tag_any), "b md");
    else
      b_md = b_user;
    dnnl_matmul_desc_t desc;
    ok(d->dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md), "matmul desc");
    dnnl_primitive_desc_t pd;
    ok(d->dnnl_primitive_desc_create(&pd, &desc, nullptr, d->engine, nullptr), "matmul primitive desc");
    const char* impl = nullptr;
    d->dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    (*info)["impl " + name + " " + s.key()] = impl ? impl : "?";
    dnnl_primitive_t prim;
    ok(d->dnnl_primitive_create(&prim, pd), "matmul primitive");
    const dnnl_memory_desc_t* b_want = d->dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);

    // Memories: A, B (user layouts), C; B packed once when the primitive wants another layout.
    dnnl_memory_t am, bm, cm, a_conv = nullptr, b_pack = nullptr;
    ok(d->dnnl_memory_create(&am, &a_user, d->engine, const_cast<float*>(a)), "a mem");
    ok(d->dnnl_memory_create(&bm, &b_user, d->engine, const_cast<float*>(b)), "b mem");
    ok(d->dnnl_memory_create(&cm, &c_md, d->engine, c), "c mem");
    dnnl_memory_t b_use = bm;
    if (packed || bf16) {
      ok(d->dnnl_memory_create(&b_pack, b_want, d->engine, DNNL_MEMORY_ALLOCATE), "packed b");
      dnnl_primitive_desc_t rpd;
      ok(d->dnnl_reorder_primitive_desc_create(&rpd, &b_user, d->engine, b_want, d->engine, nullptr), "reorder desc");
      dnnl_primitive_t r;
      ok(d->dnnl_primitive_create(&r, rpd), "reorder");
      dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, bm}, {DNNL_ARG_TO, b_pack}};
      ok(d->dnnl_primitive_execute(r, d->stream, 2, args), "pack weights");
      ok(d->dnnl_stream_wait(d->stream), "wait");
      b_use = b_pack;
    }
    dnnl_primitive_t a_reorder = nullptr;
    if (bf16) {
      ok(d->dnnl_memory_create(&a_conv, &a_md, d->engine, DNNL_MEMORY_ALLOCATE), "bf16 a");
      dnnl_primitive_desc_t rpd;
      ok(d->dnnl_reorder_primitive_desc_create(&rpd, &a_user, d->engine, &a_md, d->engine, nullptr), "a reorder desc");
      ok(d->dnnl_primitive_create(&a_reorder, rpd), "a reorder");
    }
    dnnl_memory_t a_use = bf16 ? a_conv : am;
    return [d, prim, a_reorder, am, a_use, b_use, cm] {
      if (a_reorder) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, am}, {DNNL_ARG_TO, a_use}};
        d->dnnl_primitive_execute(a_reorder, d->stream, 2, r);
      }
      dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, a_use}, {DNNL_ARG_WEIGHTS, b_use}, {DNNL_ARG_DST, cm}};
      d->dnnl_primitive_execute(prim, d->stream, 3, args);
      d->dnnl_stream_wait(d->stream);
    };  // primitives and memories live until the child exits
  };
  return m;
}

// A fixed pool of threads that block (condition variable) between jobs instead of spinning: the
// engine-owned threading an engine could give oneDNN, whose OpenMP barriers spin (libgomp's
// default wait policy) and collapse when other processes compete for the cores.
class BlockingPool {
 public:
  explicit BlockingPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { loop(i); });
    size_ = threads;
  }
  ~BlockingPool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }
  // Runs job(i) for i in [0, size()), i = 0 on the calling thread; returns when all are done.
  void run(const std::function<void(int)>& job) {
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = &job;
      pending_ = size_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    job(0);
    std::unique_lock<std::mutex> l(m_);
    done_cv_.wait(l, [&] { return pending_ == 0; });
  }

 private:
  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> l(m_);
        cv_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      (*job)(index);
      std::lock_guard<std::mutex> l(m_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  int pending_ = 0, size_ = 1;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// matmul-packed split over N into one block per pool thread; each block is a primitive of its own
// run with one OpenMP thread (no OpenMP team, no spinning barrier) on its own stream.
Method dnnl_own_threads_method(std::shared_ptr<Dnnl> d, std::shared_ptr<BlockingPool> pool, void (*omp_set)(int),
                               std::shared_ptr<std::map<std::string, std::string>> info) {
  Method m{"matmul-packed-own-threads", 1e-4, nullptr};
  m.prepare = [d, pool, omp_set, info](const Shape& s, const float* a, const float* b,
                                       float* c) -> std::function<void()> {
    struct Block {
      dnnl_primitive_t prim;
      dnnl_stream_t stream;
      dnnl_memory_t a, b, c;
    };
    auto blocks = std::make_shared<std::vector<Block>>();
    const int T = pool->size();
    const int64_t step = ((s.n + T - 1) / T + 15) / 16 * 16;
    for (int i = 0; i < T; ++i) {
      const int64_t n0 = std::min<int64_t>(s.n, i * step), nb = std::min<int64_t>(s.n, n0 + step) - n0;
      if (nb <= 0) throw std::runtime_error("more threads than column blocks");
      dnnl_memory_desc_t a_md, b_user, b_any, c_md;
      const dnnl_dims_t a_dims = {s.m, s.k}, b_dims = {s.k, nb}, c_dims = {s.m, nb};
      const dnnl_dims_t b_strides = {1, s.k}, c_strides = {s.n, 1};
      ok(d->dnnl_memory_desc_init_by_tag(&a_md, 2, a_dims, dnnl_f32, dnnl_ab), "a md");
      ok(d->dnnl_memory_desc_init_by_strides(&b_user, 2, b_dims, dnnl_f32, b_strides), "b md");
      ok(d->dnnl_memory_desc_init_by_tag(&b_any, 2, b_dims, dnnl_f32, dnnl_format_tag_any), "b md");
      ok(d->dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, dnnl_f32, c_strides), "c md");
      dnnl_matmul_desc_t desc;
      ok(d->dnnl_matmul_desc_init(&desc, &a_md, &b_any, nullptr, &c_md), "matmul desc");
      dnnl_primitive_desc_t pd;
      ok(d->dnnl_primitive_desc_create(&pd, &desc, nullptr, d->engine, nullptr), "matmul primitive desc");
      Block blk{};
      ok(d->dnnl_primitive_create(&blk.prim, pd), "matmul primitive");
      ok(d->dnnl_stream_create(&blk.stream, d->engine, dnnl_stream_default_flags), "stream");
      const dnnl_memory_desc_t* b_want = d->dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
      dnnl_memory_t b_src;
      ok(d->dnnl_memory_create(&b_src, &b_user, d->engine, const_cast<float*>(b + n0 * s.k)), "b mem");
      ok(d->dnnl_memory_create(&blk.b, b_want, d->engine, DNNL_MEMORY_ALLOCATE), "packed b");
      dnnl_primitive_desc_t rpd;
      ok(d->dnnl_reorder_primitive_desc_create(&rpd, &b_user, d->engine, b_want, d->engine, nullptr), "reorder");
      dnnl_primitive_t r;
      ok(d->dnnl_primitive_create(&r, rpd), "reorder");
      dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, b_src}, {DNNL_ARG_TO, blk.b}};
      ok(d->dnnl_primitive_execute(r, blk.stream, 2, args), "pack");
      ok(d->dnnl_stream_wait(blk.stream), "wait");
      ok(d->dnnl_memory_create(&blk.a, &a_md, d->engine, const_cast<float*>(a)), "a mem");
      ok(d->dnnl_memory_create(&blk.c, &c_md, d->engine, c + n0), "c mem");
      const char* impl = nullptr;
      d->dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
      (*info)["impl matmul-packed-own-threads " + s.key()] = impl ? impl : "?";
      blocks->push_back(blk);
    }
    auto job = std::make_shared<std::function<void(int)>>([d, blocks, omp_set](int i) {
      if (omp_set) omp_set(1);  // this thread's OpenMP team size: 1
      const Block& blk = (*blocks)[static_cast<size_t>(i)];
      dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, blk.a}, {DNNL_ARG_WEIGHTS, blk.b}, {DNNL_ARG_DST, blk.c}};
      d->dnnl_primitive_execute(blk.prim, blk.stream, 3, args);
      d->dnnl_stream_wait(blk.stream);
    });
    return [pool, job] { pool->run(*job); };
  };
  return m;
}

Child open_dnnl(int threads) {
  Child ch;
  std::string so;
  void* h = open_lib({"libdnnl.so.2", "libdnnl.so"}, &so);
  if (!h) throw std::runtime_error("oneDNN not found (Debian: libdnnl2)");
  auto d = std::make_shared<Dnnl>();
#define MOE_DNNL_LOAD(name) d->name = sym<decltype(d->name)>(h, #name);
  MOE_DNNL_LOAD(dnnl_sgemm)
  MOE_DNNL_LOAD(dnnl_engine_create)
  MOE_DNNL_LOAD(dnnl_stream_create)
  MOE_DNNL_LOAD(dnnl_stream_wait)
  MOE_DNNL_LOAD(dnnl_memory_desc_init_by_tag)
  MOE_DNNL_LOAD(dnnl_memory_desc_init_by_strides)
  MOE_DNNL_LOAD(dnnl_memory_create)
  MOE_DNNL_LOAD(dnnl_matmul_desc_init)
  MOE_DNNL_LOAD(dnnl_primitive_desc_create)
  MOE_DNNL_LOAD(dnnl_primitive_desc_query)
  MOE_DNNL_LOAD(dnnl_primitive_desc_query_md)
  MOE_DNNL_LOAD(dnnl_reorder_primitive_desc_create)
  MOE_DNNL_LOAD(dnnl_primitive_create)
  MOE_DNNL_LOAD(dnnl_primitive_execute)
  MOE_DNNL_LOAD(dnnl_get_effective_cpu_isa)
  MOE_DNNL_LOAD(dnnl_version)
#undef MOE_DNNL_LOAD
  ok(d->dnnl_engine_create(&d->engine, dnnl_cpu, 0), "engine");
  ok(d->dnnl_stream_create(&d->stream, d->engine, dnnl_stream_default_flags), "stream");
  const dnnl_version_t* v = d->dnnl_version();
  ch.info["library"] = so;
  ch.info["version"] = std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
                       " (cpu runtime " + (v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other") + ")";
  ch.info["effective_isa"] = isa_name(d->dnnl_get_effective_cpu_isa());
  // OpenMP threads: the library's own libgomp.
  auto omp_set = reinterpret_cast<void (*)(int)>(dlsym(h, "omp_set_num_threads"));
  ch.set_threads = [omp_set](int n) {
    if (omp_set) omp_set(n);
  };
  Method sg{"sgemm", 1e-4, nullptr};
  sg.prepare = [d](const Shape& s, const float* a, const float* b, float* c) -> std::function<void()> {
    return [=] { d->dnnl_sgemm('N', 'T', s.m, s.n, s.k, 1.0f, a, s.k, b, s.k, 0.0f, c, s.n); };
  };
  ch.methods.push_back(sg);
  ch.methods.push_back(dnnl_matmul_method(d, "matmul", false, false, ch.learnt));
  ch.methods.push_back(dnnl_matmul_method(d, "matmul-packed", true, false, ch.learnt));
  ch.methods.push_back(dnnl_matmul_method(d, "matmul-bf16", true, true, ch.learnt));
  if (threads > 1) {
    auto pool = std::make_shared<BlockingPool>(threads);
    // The main thread's OpenMP team size is `threads` for the other methods; the pool's job sets
    // 1 for each thread it runs on (an OpenMP setting is per thread), so restore it after a call.
    Method own = dnnl_own_threads_method(d, pool, omp_set, ch.learnt);
    auto prepare = own.prepare;
    own.prepare = [prepare, omp_set, threads](const Shape& s, const float* a, const float* b,
                                              float* c) -> std::function<void()> {
      if (omp_set) omp_set(1);  // primitives planned for one thread each
      std::function<void()> call;
      try {
        call = prepare(s, a, b, c);
      } catch (...) {
        if (omp_set) omp_set(threads);
        throw;
      }
      if (omp_set) omp_set(threads);
      return [call, omp_set, threads] {
        call();
        if (omp_set) omp_set(threads);
      };
    };
    ch.methods.push_back(own);
  }
  return ch;
}
#endif

// One child: opens its library, then per shape and method one warm-up (checked) call and one
// timed sample. Prints "info KEY\tVALUE", "result SHAPE\tMETHOD\tSECONDS\tERROR\tCALLS" and
// "unsupported SHAPE\tMETHOD\tWHY" lines.
int run_child(const std::string& variant, int threads, const std::vector<Shape>& shapes, double min_sample_s) {
  Child ch;
  if (variant == "openblas" || variant.rfind("openblas:", 0) == 0 || variant == "openblas-repick") {
    ch = open_openblas(variant);
  } else if (variant == "blis") {
    ch = open_blis();
  } else if (variant == "dnnl") {
#if MOE_BENCH_HAVE_DNNL
    ch = open_dnnl(threads);
#else
    throw std::runtime_error("built without oneDNN's header (Debian: libdnnl-dev)");
#endif
  } else {
    throw std::runtime_error("unknown variant '" + variant + "'");
  }
  ch.set_threads(threads);
  for (const Shape& s : shapes) {
    Aligned a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.n * s.k)), c(static_cast<size_t>(s.m * s.n));
    fill_random(a.p, static_cast<size_t>(s.m * s.k), 1 + static_cast<uint64_t>(s.m));
    fill_random(b.p, static_cast<size_t>(s.n * s.k), 2 + static_cast<uint64_t>(s.n * 7 + s.k));
    for (const Method& m : ch.methods) {
      std::function<void()> call;
      try {
        call = m.prepare(s, a.p, b.p, c.p);
      } catch (const std::exception& e) {
        std::printf("unsupported %s\t%s\t%s\n", s.key().c_str(), m.name.c_str(), e.what());
        continue;
      }
      std::fill(c.p, c.p + s.m * s.n, std::nanf(""));
      Clock::time_point t0 = Clock::now();
      call();
      const double one = seconds_since(t0);
      const double err = check_error(s, a.p, b.p, c.p);
      const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(min_sample_s / std::max(one, 1e-7))));
      t0 = Clock::now();
      for (int64_t i = 0; i < n; ++i) call();
      const double per_call = seconds_since(t0) / static_cast<double>(n);
      std::printf("result %s\t%s\t%.9g\t%.3g\t%lld\n", s.key().c_str(), m.name.c_str(), per_call, err,
                  static_cast<long long>(n));
      std::fflush(stdout);
    }
  }
  ch.info["mapped"] = mapped_math_libs();
  for (const auto& kv : *ch.learnt) ch.info[kv.first] = kv.second;
  for (const auto& kv : ch.info) std::printf("info %s\t%s\n", kv.first.c_str(), kv.second.c_str());
  return 0;
}

// ---- parent --------------------------------------------------------------------------------

struct ChildOut {
  std::map<std::string, std::string> info;
  std::map<std::pair<std::string, std::string>, std::pair<double, double>> results;  // (shape, method) -> s, err
  std::map<std::pair<std::string, std::string>, std::string> unsupported;
  std::string failure;
};

ChildOut spawn_child(const std::string& self, const std::string& variant, int threads, const std::string& shapes,
                     double min_sample_ms) {
  int fd[2];
  if (pipe(fd)) throw std::runtime_error("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    dup2(fd[1], 1);
    close(fd[0]);
    close(fd[1]);
    // The child's library sees the same environment as a user's program, except the thread
    // counts (set for every library so none oversubscribes) and a forced OpenBLAS core.
    const std::string t = std::to_string(threads);
    setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
    setenv("OMP_NUM_THREADS", t.c_str(), 1);
    setenv("BLIS_NUM_THREADS", t.c_str(), 1);
    unsetenv("OPENBLAS_CORETYPE");
    if (variant.rfind("openblas:", 0) == 0) setenv("OPENBLAS_CORETYPE", variant.substr(9).c_str(), 1);
    if (variant == "openblas-repick") setenv("OPENBLAS_CORETYPE", "Prescott", 1);  // simulates a misdetection
    const std::string ms = std::to_string(min_sample_ms);
    execl(self.c_str(), self.c_str(), "--child", variant.c_str(), "--threads", t.c_str(), "--shapes", shapes.c_str(),
          "--min-sample-ms", ms.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fd[1]);
  std::string text;
  char buf[4096];
  ssize_t r;
  while ((r = read(fd[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(r));
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ChildOut out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    const size_t sp = line.find(' ');
    if (sp == std::string::npos) continue;
    const std::string kind = line.substr(0, sp);
    const std::vector<std::string> f = split(line.substr(sp + 1), '\t');
    if (kind == "info" && f.size() >= 1) out.info[f[0]] = f.size() > 1 ? f[1] : "";
    if (kind == "result" && f.size() >= 4) out.results[{f[0], f[1]}] = {std::stod(f[2]), std::stod(f[3])};
    if (kind == "unsupported" && f.size() >= 3) out.unsupported[{f[0], f[1]}] = f[2];
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    out.failure = WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status)) : "killed by a signal";
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmt(double v, int sig = 3) {
  if (!std::isfinite(v)) return "–";
  if (v == 0) return "0";
  char b[64];
  const double a = std::fabs(v);
  const int decimals =
      a >= 100 ? 0 : std::max(0, sig - 1 - static_cast<int>(std::floor(std::log10(std::max(a, 1e-9)))));
  std::snprintf(b, sizeof b, "%.*f", std::min(decimals, 6), v);
  return b;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) {
      o += ' ';
      continue;
    }
    o += ch;
  }
  return o + "\"";
}

int run_parent(const std::vector<std::string>& variants, const std::vector<int>& threads, int rounds,
               const std::vector<Shape>& shapes, double min_sample_ms, const std::string& json_path) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  self[n] = '\0';
  // Children run this binary again; if it was rebuilt meanwhile, they run the new one.
  std::string self_path = self;
  const std::string deleted = " (deleted)";
  if (self_path.size() > deleted.size() &&
      self_path.compare(self_path.size() - deleted.size(), deleted.size(), deleted) == 0)
    self_path.resize(self_path.size() - deleted.size());
  const std::string spec = shapes_spec(shapes);

  // samples[(variant, method, threads, shape)] = seconds per call, one per round
  using Key = std::tuple<std::string, std::string, int, std::string>;
  std::map<Key, std::vector<double>> samples, vs_debian;
  std::map<Key, double> worst_err;
  std::map<Key, double> tolerance;
  std::map<std::string, std::map<std::string, std::string>> infos;
  std::map<std::string, std::string> failures;
  std::vector<std::pair<std::string, std::string>> rows;  // (variant, method) in first-seen order
  const Clock::time_point start = Clock::now();
  const std::string load_start = loadavg();
  for (int r = 0; r < rounds; ++r) {
    for (int t : threads) {
      std::map<std::string, ChildOut> got;
      for (size_t i = 0; i < variants.size(); ++i) {
        const std::string& v = variants[(i + static_cast<size_t>(r)) % variants.size()];  // rotate the order
        std::fprintf(stderr, "[round %d/%d, %d thread%s] %s ...\n", r + 1, rounds, t, t == 1 ? "" : "s", v.c_str());
        got[v] = spawn_child(self_path, v, t, spec, min_sample_ms);
      }
      for (const std::string& v : variants) {
        const ChildOut& c = got[v];
        if (!c.failure.empty() && c.results.empty()) {
          failures[v] = c.failure;
          continue;
        }
        if (infos[v].empty()) infos[v] = c.info;
        for (const auto& kv : c.results) {
          const std::string& shape = kv.first.first;
          const std::string& method = kv.first.second;
          if (std::find(rows.begin(), rows.end(), std::make_pair(v, method)) == rows.end())
            rows.emplace_back(v, method);
          const Key key{v, method, t, shape};
          samples[key].push_back(kv.second.first);
          worst_err[key] = std::max(worst_err[key], kv.second.second);
          tolerance[key] = method == "matmul-bf16" ? 2e-2 : 1e-4;
          auto base = got["openblas"].results.find({shape, "sgemm"});
          if (base != got["openblas"].results.end()) vs_debian[key].push_back(base->second.first / kv.second.first);
        }
        for (const auto& kv : c.unsupported)
          infos[v]["unsupported " + kv.first.second + " " + kv.first.first] = kv.second;
      }
    }
  }
  const double total = seconds_since(start);
  // Rows in the order of --variants, then the methods in the order each library declares them.
  auto method_rank = [](const std::string& m) {
    static const char* order[] = {"sgemm", "matmul", "matmul-packed", "matmul-packed-own-threads", "matmul-bf16"};
    for (int i = 0; i < 5; ++i)
      if (m == order[i]) return i;
    return 5;
  };
  auto variant_rank = [&](const std::string& v) {
    return static_cast<int>(std::find(variants.begin(), variants.end(), v) - variants.begin());
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const auto& x, const auto& y) {
    return std::make_pair(variant_rank(x.first), method_rank(x.second)) <
           std::make_pair(variant_rank(y.first), method_rank(y.second));
  });

  std::printf(
      "# moe-bench-gemm\n\nCPU: %s; %d round%s, rotating order; figures are medians over rounds; %.0f s in all; "
      "load average %s at start, %s at end.\n",
      cpu_model().c_str(), rounds, rounds == 1 ? "" : "s", total, load_start.c_str(), loadavg().c_str());
  std::printf("Layout: C[M,N] = A[M,K]·B[N,K]ᵀ row-major (the engine's Linear). GFLOP/s = 2·M·N·K / time.\n\n");
  std::printf("## What each library picked\n\n");
  for (const std::string& v : variants) {
    if (failures.count(v) && !infos.count(v)) {
      std::printf("- %s: failed (%s)\n", v.c_str(), failures[v].c_str());
      continue;
    }
    std::printf("- %s:", v.c_str());
    for (const auto& kv : infos[v]) std::printf(" %s = %s;", kv.first.c_str(), kv.second.c_str());
    std::printf("\n");
  }
  for (int t : threads) {
    std::printf("\n## %d thread%s: GFLOP/s (vs Debian's OpenBLAS in the same round)\n\n", t, t == 1 ? "" : "s");
    std::printf("| library | method |");
    for (const Shape& s : shapes)
      std::printf(" %s%s%s |", s.key().c_str(), s.label.empty() ? "" : " ", s.label.c_str());
    std::printf(" geomean vs Debian | worst spread | max error |\n|---|---|");
    for (size_t i = 0; i < shapes.size(); ++i) std::printf("---|");
    std::printf("---|---|---|\n");
    for (const auto& row : rows) {
      bool any = false;
      for (const Shape& s : shapes) any = any || samples.count(Key{row.first, row.second, t, s.key()});
      if (!any) continue;  // a method that runs at other thread counts only
      std::printf("| %s | %s |", row.first.c_str(), row.second.c_str());
      double log_sum = 0, worst_spread = 0, err = 0;
      int counted = 0;
      bool wrong = false;
      for (const Shape& s : shapes) {
        const Key key{row.first, row.second, t, s.key()};
        auto it = samples.find(key);
        if (it == samples.end()) {
          std::printf(" – |");
          continue;
        }
        const double med = median(it->second);
        const double mn = *std::min_element(it->second.begin(), it->second.end());
        const double mx = *std::max_element(it->second.begin(), it->second.end());
        worst_spread = std::max(worst_spread, (mx - mn) / med);
        err = std::max(err, worst_err[key]);
        if (!(worst_err[key] <= tolerance[key])) wrong = true;
        const double ratio = median(vs_debian[key]);
        if (ratio > 0) {
          log_sum += std::log(ratio);
          ++counted;
        }
        std::printf(" %s (%s×) |", fmt(s.flop() / med / 1e9).c_str(), fmt(ratio).c_str());
      }
      std::printf(" %s× | %s%% | %.1e%s |\n", counted ? fmt(std::exp(log_sum / counted)).c_str() : "–",
                  fmt(100 * worst_spread, 2).c_str(), err, wrong ? " WRONG" : "");
    }
  }
  std::printf(
      "\nmax error = worst |c − ref| / Σ|a·b| over 16 checked rows per shape and every round (fp32 ≈ 1e-7; "
      "WRONG above 1e-4, bf16 above 2e-2).\nspread = (max − min) / median over rounds.\n");
  for (const auto& f : failures) std::printf("failed: %s (%s)\n", f.first.c_str(), f.second.c_str());

  if (!json_path.empty()) {
    std::ofstream j(json_path);
    j << "{\n  \"program\": \"moe-bench-gemm\",\n  \"cpu\": " << json_str(cpu_model()) << ",\n  \"rounds\": " << rounds
      << ",\n  \"libraries\": {";
    bool first = true;
    for (const auto& v : infos) {
      j << (first ? "\n" : ",\n") << "    " << json_str(v.first) << ": {";
      bool f2 = true;
      for (const auto& kv : v.second) {
        j << (f2 ? "" : ", ") << json_str(kv.first) << ": " << json_str(kv.second);
        f2 = false;
      }
      j << "}";
      first = false;
    }
    j << "\n  },\n  \"results\": [";
    first = true;
    for (const auto& kv : samples) {
      const Key& k = kv.first;
      j << (first ? "\n" : ",\n") << "    {\"library\": " << json_str(std::get<0>(k))
        << ", \"method\": " << json_str(std::get<1>(k)) << ", \"threads\": " << std::get<2>(k)
        << ", \"shape\": " << json_str(std::get<3>(k)) << ", \"seconds\": [";
      for (size_t i = 0; i < kv.second.size(); ++i) j << (i ? ", " : "") << kv.second[i];
      j << "], \"vs_debian_openblas\": [";
      const auto& vd = vs_debian[k];
      for (size_t i = 0; i < vd.size(); ++i) j << (i ? ", " : "") << vd[i];
      j << "], \"max_error\": " << worst_err[k] << "}";
      first = false;
    }
    j << "\n  ]\n}\n";
    std::fprintf(stderr, "wrote %s\n", json_path.c_str());
  }
  return failures.empty() ? 0 : 1;
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (a.rfind("--", 0) != 0) throw std::runtime_error("unexpected argument '" + a + "'\n" + kUsage);
    a = a.substr(2);
    if (a == "quick") {
      opt[a] = "1";
      continue;
    }
    if (i + 1 >= argc) throw std::runtime_error("--" + a + " needs a value");
    opt[a] = argv[++i];
  }
  for (const auto& kv : opt) {
    static const char* known[] = {"quick", "variants", "threads", "rounds", "shapes", "min-sample-ms", "json", "child"};
    if (std::find_if(std::begin(known), std::end(known), [&](const char* k) { return kv.first == k; }) ==
        std::end(known))
      throw std::runtime_error("unknown option --" + kv.first + "\n" + kUsage);
  }
  const bool quick = opt.count("quick");
  std::vector<Shape> shapes;
  if (opt.count("shapes"))
    shapes = parse_shapes(opt["shapes"]);
  else if (quick)
    shapes = parse_shapes("1600x3072x768,512x2048x512,50x3072x768");
  else
    shapes = default_shapes();
  const double min_ms = opt.count("min-sample-ms") ? std::stod(opt["min-sample-ms"]) : 150.0;
  if (opt.count("child")) return run_child(opt["child"], std::stoi(opt["threads"]), shapes, min_ms / 1e3);
  std::vector<int> threads;
  for (const std::string& t : split(opt.count("threads") ? opt["threads"] : "1,2", ','))
    threads.push_back(std::stoi(t));
  std::vector<std::string> variants =
      split(opt.count("variants")
                ? opt["variants"]
                : "openblas,openblas:SkylakeX,openblas:Haswell,openblas:Zen,openblas:Prescott,openblas-repick,"
                  "blis,dnnl",
            ',');
  if (std::find(variants.begin(), variants.end(), "openblas") == variants.end())
    variants.insert(variants.begin(), "openblas");  // the baseline of every ratio
  const int rounds = opt.count("rounds") ? std::stoi(opt["rounds"]) : (quick ? 3 : 5);
  return run_parent(variants, threads, rounds, shapes, min_ms, opt.count("json") ? opt["json"] : "");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
