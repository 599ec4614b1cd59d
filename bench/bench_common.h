// Shared helpers of the benchmark programs (bench/): argument parsing, device selection, timing
// with warm-up and repetitions, medians, random data, a markdown table and a small JSON writer.
//
// Benchmarks are not tests: they assert nothing about speed. Every figure that matters is a
// ratio against a baseline measured in the same process (machines are noisy), printed beside
// the absolute numbers it was computed from.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "moe/compute.h"
#include "moe/error.h"
#include "moe/tensor.h"
#include "moe_build_config.h"

namespace moe::bench {

// ---- command line ---------------------------------------------------------------------------

// "--key value" options and "--flag" switches. Unknown or malformed options are errors.
class Args {
 public:
  Args(int argc, char** argv, std::string usage) : usage_(std::move(usage)) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        std::printf("%s", usage_.c_str());
        std::exit(0);
      }
      if (a.rfind("--", 0) != 0) fail("unexpected argument '" + a + "'");
      a = a.substr(2);
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        values_[a.substr(0, eq)] = a.substr(eq + 1);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        values_[a] = argv[++i];
      } else {
        values_[a] = "";  // a switch
      }
    }
  }

  bool flag(const std::string& key) {
    used_.push_back(key);
    auto it = values_.find(key);
    if (it == values_.end()) return false;
    if (!it->second.empty()) fail("--" + key + " takes no value");
    return true;
  }
  std::string str(const std::string& key, const std::string& fallback) {
    used_.push_back(key);
    auto it = values_.find(key);
    return it == values_.end() ? fallback : it->second;
  }
  int64_t integer(const std::string& key, int64_t fallback) {
    const std::string s = str(key, "");
    if (s.empty()) return fallback;
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (*end != '\0') fail("--" + key + ": not an integer: '" + s + "'");
    return v;
  }
  double number(const std::string& key, double fallback) {
    const std::string s = str(key, "");
    if (s.empty()) return fallback;
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (*end != '\0') fail("--" + key + ": not a number: '" + s + "'");
    return v;
  }
  std::vector<int64_t> int_list(const std::string& key, const std::vector<int64_t>& fallback) {
    const std::string s = str(key, "");
    if (s.empty()) return fallback;
    std::vector<int64_t> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v <= 0) fail("--" + key + ": not a list of positive integers: '" + s + "'");
      out.push_back(v);
    }
    return out;
  }
  std::vector<std::string> str_list(const std::string& key, const std::string& fallback) {
    std::vector<std::string> out;
    std::stringstream ss(str(key, fallback));
    std::string item;
    while (std::getline(ss, item, ','))
      if (!item.empty()) out.push_back(item);
    return out;
  }
  // Call after reading every option: anything left over is a typo.
  void finish() {
    for (const auto& kv : values_)
      if (std::find(used_.begin(), used_.end(), kv.first) == used_.end()) fail("unknown option --" + kv.first);
  }
  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "error: %s\n\n%s", why.c_str(), usage_.c_str());
    std::exit(2);
  }

 private:
  std::string usage_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> used_;
};

// ---- devices --------------------------------------------------------------------------------

// "auto": cpu, plus cuda:0 when a CUDA device is usable. Otherwise a comma-separated list of
// "cpu" and "cuda:N". A CUDA device that is asked for but unusable is an error (not a skip).
inline std::vector<std::string> resolve_devices(const std::string& spec) {
  std::string why;
  const int cuda = kernels::cuda_device_count(&why);
  if (spec == "auto") {
    std::vector<std::string> out = {"cpu"};
    if (cuda > 0)
      out.push_back("cuda:0");
    else
      std::fprintf(stderr, "note: no CUDA device (%s): CPU only\n", why.c_str());
    return out;
  }
  std::vector<std::string> out;
  std::stringstream ss(spec);
  std::string d;
  while (std::getline(ss, d, ',')) {
    if (d == "cpu") {
      out.push_back(d);
    } else if (d.rfind("cuda:", 0) == 0) {
      const int index = std::atoi(d.c_str() + 5);
      if (index >= cuda)
        throw Error("device " + d + " asked for, but " + std::to_string(cuda) + " CUDA device(s) are usable" +
                    (why.empty() ? "" : " (" + why + ")"));
      out.push_back(d);
    } else {
      throw Error("unknown device '" + d + "' (cpu, cuda:N or auto)");
    }
  }
  return out;
}

inline std::unique_ptr<kernels::Backend> make_backend(const std::string& device, bool async_copies) {
  if (device == "cpu") {
    kernels::CpuBackendOptions opt;
    opt.async_copies = async_copies;
    return kernels::make_cpu_backend(opt);
  }
  return kernels::make_cuda_backend(std::atoi(device.c_str() + 5));
}

// Precision names are the engine's (moe::parse_precision: f32/fp32, f16/fp16, bf16).
using moe::parse_precision;

// ---- timing ---------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Sample {
  double median = 0;  // seconds per call
  double min = 0, max = 0;
  int reps = 0;       // timed samples
  int64_t inner = 1;  // calls per sample
  // (max - min) / median over the samples: how noisy this figure is.
  double spread() const { return median > 0 ? (max - min) / median : 0; }
};

inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct TimingOptions {
  int warmup = 2;              // untimed calls first (allocation, handles, caches, clocks)
  int reps = 7;                // timed samples; the median is reported
  double min_sample_s = 0.01;  // calls are grouped so that one sample lasts at least this long
  // Time on this process's CPU time instead of the wall clock: for one-thread host work on cores
  // shared with other jobs, whose share the wall clock would count (not for device work).
  bool cpu_clock = false;
};

// Seconds of CPU time this process has used (all its threads).
inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

namespace detail {
// Runs `call` n times and waits for the backend; seconds on the wall clock, or of CPU time.
inline double run_n(const std::function<void()>& call, kernels::Backend* backend, int64_t n, bool cpu_clock) {
  const Clock::time_point t0 = Clock::now();
  const double c0 = cpu_clock ? cpu_seconds() : 0;
  for (int64_t i = 0; i < n; ++i) call();
  if (backend) backend->synchronize();
  return cpu_clock ? cpu_seconds() - c0 : seconds_since(t0);
}
// Warm-up calls, then the number of calls that makes one sample last min_sample_s.
inline int64_t calibrate(const std::function<void()>& call, kernels::Backend* backend, const TimingOptions& t) {
  double one = 0;
  for (int i = 0; i < std::max(1, t.warmup); ++i) one = run_n(call, backend, 1, t.cpu_clock);
  const int64_t n = one > 0 ? static_cast<int64_t>(std::ceil(t.min_sample_s / one)) : 1;
  return std::min<int64_t>(std::max<int64_t>(1, n), 10000);
}
inline Sample summarize(const std::vector<double>& per_call, int64_t inner) {
  Sample s;
  s.inner = inner;
  s.reps = static_cast<int>(per_call.size());
  s.median = median_of(per_call);
  s.min = *std::min_element(per_call.begin(), per_call.end());
  s.max = *std::max_element(per_call.begin(), per_call.end());
  return s;
}
}  // namespace detail

// Times `call` (which queues work on `backend`); each sample ends with backend.synchronize(),
// so queued device work is inside the time. Returns seconds per call.
inline Sample time_calls(const std::function<void()>& call, kernels::Backend* backend, const TimingOptions& t) {
  const int64_t inner = detail::calibrate(call, backend, t);
  std::vector<double> per_call;
  for (int r = 0; r < std::max(1, t.reps); ++r)
    per_call.push_back(detail::run_n(call, backend, inner, t.cpu_clock) / static_cast<double>(inner));
  return detail::summarize(per_call, inner);
}

// One call without warm-up (a build, a load): its seconds on t's clock.
inline double time_once(const std::function<void()>& call, const TimingOptions& t) {
  return detail::run_n(call, nullptr, 1, t.cpu_clock);
}

// Two calls timed in alternation (a sample of A, a sample of B, repeated), so that drifting
// clocks and busy neighbours touch both alike. `ratio` is the median over repetitions of
// time(A) / time(B) from adjacent samples: the paired ratio, steadier than a ratio of medians.
struct PairedSample {
  Sample a, b;
  double ratio = 0;
};
inline PairedSample time_paired(const std::function<void()>& a, const std::function<void()>& b,
                                kernels::Backend* backend, const TimingOptions& t) {
  const int64_t na = detail::calibrate(a, backend, t), nb = detail::calibrate(b, backend, t);
  std::vector<double> ta, tb, ratios;
  for (int r = 0; r < std::max(1, t.reps); ++r) {
    const bool a_first = r % 2 == 0;  // alternate the order too
    double x = 0, y = 0;
    if (a_first) x = detail::run_n(a, backend, na, t.cpu_clock) / static_cast<double>(na);
    y = detail::run_n(b, backend, nb, t.cpu_clock) / static_cast<double>(nb);
    if (!a_first) x = detail::run_n(a, backend, na, t.cpu_clock) / static_cast<double>(na);
    ta.push_back(x);
    tb.push_back(y);
    ratios.push_back(x / y);
  }
  return {detail::summarize(ta, na), detail::summarize(tb, nb), median_of(ratios)};
}

// ---- random data ----------------------------------------------------------------------------

// xorshift64*: fast, deterministic, good enough for benchmark inputs (never zeros: zeros can
// run faster than real data and hide unwritten outputs).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {
    if (s_ == 0) s_ = 1;
  }
  uint64_t next() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return s_ * 0x2545F4914F6CDD1Dull;
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform in [-scale, scale).
  float symmetric(float scale) { return static_cast<float>((2.0 * uniform() - 1.0) * scale); }

 private:
  uint64_t s_;
};

inline void fill_uniform(float* p, size_t n, float scale, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = rng.symmetric(scale);
}

inline std::vector<float> random_floats(size_t n, float scale, uint64_t seed) {
  std::vector<float> v(n);
  fill_uniform(v.data(), n, scale, seed);
  return v;
}

// f32 values as the bytes of a Linear weight of `type`.
inline std::vector<uint8_t> to_weight_bytes(const std::vector<float>& v, kernels::WeightType type) {
  std::vector<uint8_t> out(v.size() * kernels::weight_type_size(type));
  if (type == kernels::WeightType::F32) {
    std::copy(reinterpret_cast<const uint8_t*>(v.data()), reinterpret_cast<const uint8_t*>(v.data() + v.size()),
              out.begin());
    return out;
  }
  uint16_t* h = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < v.size(); ++i)
    h[i] = type == kernels::WeightType::F16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
  return out;
}

// Memory on a backend, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer(kernels::Backend& b, size_t bytes) : b_(&b), bytes_(bytes), p_(b.allocate(std::max<size_t>(bytes, 1))) {}
  DeviceBuffer(kernels::Backend& b, const void* host, size_t bytes) : DeviceBuffer(b, bytes) {
    b_->copy_from_host(p_, host, bytes);
    b_->synchronize();
  }
  ~DeviceBuffer() {
    if (!p_) return;
    try {
      b_->deallocate(p_);
    } catch (const std::exception& e) {  // a destructor must not throw: a benchmark reports and goes on
      std::fprintf(stderr, "warning: freeing %zu bytes on %s failed: %s\n", bytes_, b_->name().c_str(), e.what());
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : b_(o.b_), bytes_(o.bytes_), p_(o.p_) { o.p_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  kernels::Backend* b_;
  size_t bytes_;
  void* p_;
};

// ---- output ---------------------------------------------------------------------------------

// Display width of UTF-8 text (code points; the tables use no wide characters).
inline size_t display_width(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// A markdown table, printed with aligned columns.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(FILE* out = stdout) const {
    std::vector<size_t> w(header_.size(), 3);
    auto widen = [&](const std::vector<std::string>& r) {
      for (size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], display_width(r[i]));
    };
    widen(header_);
    for (const auto& r : rows_) widen(r);
    auto line = [&](const std::vector<std::string>& r) {
      std::fprintf(out, "|");
      for (size_t i = 0; i < w.size(); ++i) {
        const std::string c = i < r.size() ? r[i] : "";
        std::fprintf(out, " %s%s |", c.c_str(), std::string(w[i] - display_width(c), ' ').c_str());
      }
      std::fprintf(out, "\n");
    };
    line(header_);
    std::fprintf(out, "|");
    for (size_t i = 0; i < w.size(); ++i) std::fprintf(out, "%s|", std::string(w[i] + 2, '-').c_str());
    std::fprintf(out, "\n");
    for (const auto& r : rows_) line(r);
    std::fflush(out);
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Number formatting: `sig` significant digits, plain notation for the usual ranges.
inline std::string fmt(double v, int sig = 3) {
  if (!std::isfinite(v)) return "n/a";
  char buf[64];
  const double a = std::fabs(v);
  if (a >= 1e6 || (a > 0 && a < 1e-3)) {
    std::snprintf(buf, sizeof buf, "%.*g", sig, v);
  } else {
    const int digits = a >= 1 ? static_cast<int>(std::floor(std::log10(a))) + 1 : 1;
    std::snprintf(buf, sizeof buf, "%.*f", std::max(0, sig - digits), v);
  }
  return buf;
}
inline std::string fmt_ratio(double v) { return fmt(v, 3) + "×"; }
inline std::string fmt_pct(double v) { return fmt(100.0 * v, 2) + "%"; }

// A tiny JSON value (objects keep insertion order) for --json output.
class Json {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Json() = default;
  Json(double v) : kind_(Kind::Number), num_(v) {}
  Json(int v) : Json(static_cast<double>(v)) {}
  Json(int64_t v) : Json(static_cast<double>(v)) {}
  Json(uint64_t v) : Json(static_cast<double>(v)) {}
  Json(bool v) : kind_(Kind::Bool), b_(v) {}
  Json(const char* s) : kind_(Kind::String), str_(s) {}
  Json(std::string s) : kind_(Kind::String), str_(std::move(s)) {}
  static Json array() {
    Json j;
    j.kind_ = Kind::Array;
    return j;
  }
  static Json object() {
    Json j;
    j.kind_ = Kind::Object;
    return j;
  }

  Json& push(Json v) {
    items_.push_back(std::move(v));
    return items_.back();
  }
  Json& set(const std::string& key, Json v) {
    for (auto& kv : fields_)
      if (kv.first == key) return kv.second = std::move(v);
    fields_.emplace_back(key, std::move(v));
    return fields_.back().second;
  }
  std::string dump(int indent = 0) const {
    std::string out;
    write(out, indent, 0);
    return out;
  }

 private:
  static void escape(std::string& out, const std::string& s) {
    out += '"';
    for (char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
          } else {
            out += c;
          }
      }
    }
    out += '"';
  }
  void write(std::string& out, int indent, int depth) const {
    const std::string nl = indent ? "\n" : "", pad = std::string(indent * (depth + 1), ' '),
                      pad0 = std::string(indent * depth, ' ');
    switch (kind_) {
      case Kind::Null:
        out += "null";
        break;
      case Kind::Bool:
        out += b_ ? "true" : "false";
        break;
      case Kind::Number: {
        if (!std::isfinite(num_)) {
          out += "null";
        } else {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.6g", num_);
          out += buf;
        }
        break;
      }
      case Kind::String:
        escape(out, str_);
        break;
      case Kind::Array:
        out += "[";
        for (size_t i = 0; i < items_.size(); ++i) {
          out += (i ? "," : "") + nl + pad;
          items_[i].write(out, indent, depth + 1);
        }
        out += (items_.empty() ? "" : nl + pad0) + "]";
        break;
      case Kind::Object:
        out += "{";
        for (size_t i = 0; i < fields_.size(); ++i) {
          out += (i ? "," : "") + nl + pad;
          escape(out, fields_[i].first);
          out += indent ? ": " : ":";
          fields_[i].second.write(out, indent, depth + 1);
        }
        out += (fields_.empty() ? "" : nl + pad0) + "}";
        break;
    }
  }

  Kind kind_ = Kind::Null;
  double num_ = 0;
  bool b_ = false;
  std::string str_;
  std::vector<Json> items_;
  std::vector<std::pair<std::string, Json>> fields_;
};

inline Json sample_json(const Sample& s) {
  Json j = Json::object();
  j.set("median_s", s.median);
  j.set("min_s", s.min);
  j.set("max_s", s.max);
  j.set("reps", s.reps);
  j.set("calls_per_rep", s.inner);
  return j;
}

inline std::string today() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&now));
  return buf;
}

inline std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown";
}

// What every JSON report starts with: program, date, machine, build.
inline Json report_header(const std::string& program, bool quick) {
  Json j = Json::object();
  j.set("program", program);
  j.set("date", today());
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  j.set("host", std::string(host));
  j.set("cpu", cpu_model());
  j.set("cpu_threads", static_cast<int>(std::thread::hardware_concurrency()));
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  j.set("openblas_num_threads", blas ? std::string(blas) : std::string("default"));
  j.set("cuda_build", static_cast<bool>(MOE_HAVE_CUDA));
  std::string why;
  j.set("cuda_devices", kernels::cuda_device_count(&why));
  j.set("quick", quick);
  return j;
}

inline void write_json(const std::string& path, const Json& j) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (!f) throw Error("cannot write " + path);
  f << j.dump(2) << "\n";
  if (!f) throw Error("error writing " + path);
  std::fprintf(stderr, "wrote %s\n", path.c_str());
}

// Runs a benchmark's main, turning exceptions into a message and exit code 1.
inline int guarded_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace moe::bench
