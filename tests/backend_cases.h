// The backend case table: one list of operation cases that tests/test_backend.cpp runs on every
// backend (the model is ggml's test-backend-ops).
//
// A case is a small object: it builds its inputs from a seed, names its parameters (its gtest
// name), lists the operations it calls with their sizes and weight types (what
// Backend::supports() is asked), runs them on a backend and checks what came back:
// - on the CPU backend, against naive loops in double precision written here (on large outputs,
//   on 64 rows spread over the output, which keeps the loops fast);
// - on any other backend, against the CPU backend's result, within backend.h's tolerances.
// A backend that does not support a case reports it skipped, with its reason. A new operation,
// weight type or corner case is a row in op_cases(), not a copy of a test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "runtime/compute_util.h"
#include "moe/error.h"
#include "moe/quantized_weights.h"
#include "moe/tensor.h"

namespace backend_cases {

using moe::kernels::Backend;
using moe::kernels::ExpertWeights;
using moe::kernels::Op;
using moe::kernels::OpDesc;
using moe::kernels::WeightRef;
using moe::kernels::WeightType;

// ---- inputs ----------------------------------------------------------------------------------

inline std::vector<float> random_values(int64_t n, unsigned seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(rng);
  return v;
}

// Integers in [-2, 2]: inner products are exact in f32, and many tie.
inline std::vector<float> small_integers(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(small(rng));
  return v;
}

// How the table's q4 weights are made: group size, the scales' type, zero points or symmetric.
struct Q4Format {
  int32_t group_size = 32;
  WeightType scale_type = WeightType::F16;
  bool zero_points = false;
};

inline std::string q4_format_name(const Q4Format& f) {
  return "g" + std::to_string(f.group_size) + "_" + moe::kernels::weight_type_name(f.scale_type) +
         (f.zero_points ? "_asym" : "_sym");
}

// A weight in host memory in one storage type, and its exact f32 value (what the naive loops use).
struct HostWeight {
  WeightType type = WeightType::F32;
  std::vector<float> f32;      // storage when type == F32
  std::vector<uint16_t> bits;  // storage when f16/bf16; q4: the scales
  std::vector<float> value;    // the stored value widened with moe::half_to_float / bf16_to_float
  // q4 (Q4Weight's layout): the packed codes, the zero points (empty when symmetric), the format.
  std::vector<int32_t> packed, zero_points;
  Q4Format q4;

  // The elements of an f32/f16/bf16 weight (a q4 weight is three arrays: DeviceWeight).
  const void* data() const { return type == WeightType::F32 ? static_cast<const void*>(f32.data()) : bits.data(); }
  size_t bytes() const { return type == WeightType::F32 ? f32.size() * 4 : bits.size() * 2; }
  WeightRef ref() const { return {data(), type}; }
};

// A q4 weight [rows, cols] with values of about `stddev`: random codes, positive scales of
// stddev / 4.6 (symmetric codes minus 8 spread about 4.6) times [0.5, 1.5), random zero points;
// values as the contract defines them (moe::int4_group_values, the CPU's reference).
inline HostWeight make_q4_weight(const Q4Format& format, int64_t rows, int64_t cols, unsigned seed, float stddev) {
  HostWeight w;
  w.type = WeightType::Q4;
  w.q4 = format;
  const int64_t groups = cols / format.group_size;
  const bool bf16 = format.scale_type == WeightType::BF16;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> nibble(0, 15);
  std::uniform_real_distribution<float> spread(0.5f, 1.5f);
  w.packed.assign(static_cast<size_t>(rows * cols / 8), 0);
  for (int32_t& word : w.packed) {
    uint32_t bits = 0;
    for (int j = 0; j < 8; ++j) bits |= nibble(rng) << (4 * j);
    word = static_cast<int32_t>(bits);
  }
  w.bits.resize(static_cast<size_t>(rows * groups));
  for (uint16_t& s : w.bits) {
    const float scale = stddev / 4.6f * spread(rng);
    s = bf16 ? moe::float_to_bf16(scale) : moe::float_to_half(scale);
  }
  if (format.zero_points) {
    w.zero_points.assign(static_cast<size_t>((rows + 7) / 8 * groups), 0);
    for (int32_t& word : w.zero_points) {
      uint32_t bits = 0;
      for (int j = 0; j < 8; ++j) bits |= nibble(rng) << (4 * j);
      word = static_cast<int32_t>(bits);
    }
  }
  w.value.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int zero =
          format.zero_points
              ? static_cast<int>((static_cast<uint32_t>(w.zero_points[(r / 8) * groups + g]) >> (4 * (r % 8))) & 0xFu)
              : 8;
      float values[16];
      moe::int4_group_values(w.bits[r * groups + g], bf16, zero, values);
      for (int64_t c = g * format.group_size; c < (g + 1) * format.group_size; ++c) {
        const uint32_t code = (static_cast<uint32_t>(w.packed[(r * cols + c) / 8]) >> (4 * (c % 8))) & 0xFu;
        w.value[r * cols + c] = values[code];
      }
    }
  return w;
}

// `q4` is the format when type is Q4.
inline HostWeight make_weight(WeightType type, int64_t rows, int64_t cols, unsigned seed, float stddev = 0.1f,
                              const Q4Format& q4 = {}) {
  if (type == WeightType::Q4) return make_q4_weight(q4, rows, cols, seed, stddev);
  HostWeight w;
  w.type = type;
  const std::vector<float> v = random_values(rows * cols, seed, stddev);
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

// ---- buffers in a backend's memory -----------------------------------------------------------

// n elements in a backend's memory, followed by a guard of kGuard elements that must keep the
// bytes it was filled with (0xff: NaN as f32, -1 as an integer), so that a write past the end
// shows. A buffer made without data is filled the same way, so an output left unwritten shows
// too. Uploads synchronise, so the host source may go away.
template <typename T>
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 64;

  DeviceBuffer(Backend& b, size_t n) : DeviceBuffer(b, nullptr, n) {}
  DeviceBuffer(Backend& b, const std::vector<T>& host) : DeviceBuffer(b, host.data(), host.size()) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { moe::detail::deallocate_noexcept(b_, p_); }

  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> v(n_ + kGuard);
    b_.copy_to_host(v.data(), p_, v.size() * sizeof(T));
    const auto* guard = reinterpret_cast<const unsigned char*>(v.data() + n_);
    EXPECT_TRUE(std::all_of(guard, guard + kGuard * sizeof(T), [](unsigned char c) { return c == 0xff; }))
        << b_.name() << ": something wrote past the end of a buffer of " << n_ << " elements";
    v.resize(n_);
    return v;
  }

 private:
  DeviceBuffer(Backend& b, const T* host, size_t n)
      : b_(b), n_(n), p_(static_cast<T*>(b.allocate((n + kGuard) * sizeof(T)))) {
    std::vector<unsigned char> image((n + kGuard) * sizeof(T), 0xff);
    if (host) std::memcpy(image.data(), host, n * sizeof(T));
    b_.copy_from_host(p_, image.data(), image.size());
    b_.synchronize();
  }

  Backend& b_;
  size_t n_;
  T* p_;
};

// A weight's arrays in a backend's memory; a q4 weight's Q4Weight (host memory, as backend.h
// has it) points at them.
struct DeviceWeight {
  DeviceWeight(Backend& b, const HostWeight& w) : bytes(b, storage_of(w)), type(w.type) {
    if (type != WeightType::Q4) return;
    scales = std::make_unique<DeviceBuffer<uint16_t>>(b, w.bits);
    if (!w.zero_points.empty()) zero_points = std::make_unique<DeviceBuffer<int32_t>>(b, w.zero_points);
    q4.packed = reinterpret_cast<const int32_t*>(bytes.get());
    q4.scales = scales->get();
    q4.zero_points = zero_points ? zero_points->get() : nullptr;
    q4.scale_type = w.q4.scale_type;
    q4.group_size = w.q4.group_size;
  }
  DeviceWeight(const DeviceWeight&) = delete;
  DeviceWeight& operator=(const DeviceWeight&) = delete;
  WeightRef ref() const { return type == WeightType::Q4 ? WeightRef{&q4, type} : WeightRef{bytes.get(), type}; }

  DeviceBuffer<uint8_t> bytes;  // the elements, or a q4 weight's packed codes
  WeightType type;
  std::unique_ptr<DeviceBuffer<uint16_t>> scales;      // q4
  std::unique_ptr<DeviceBuffer<int32_t>> zero_points;  // q4 with zero points
  moe::kernels::Q4Weight q4;

 private:
  static std::vector<uint8_t> storage_of(const HostWeight& w) {
    const auto* p = w.type == WeightType::Q4 ? reinterpret_cast<const uint8_t*>(w.packed.data())
                                             : static_cast<const uint8_t*>(w.data());
    return {p, p + (w.type == WeightType::Q4 ? w.packed.size() * sizeof(int32_t) : w.bytes())};
  }
};

// ---- comparisons -----------------------------------------------------------------------------

// What a backend's result is checked against.
enum class Against {
  Naive,  // the naive loops below (the CPU backend)
  Cpu,    // the CPU backend's result (every other backend)
};

// Relative tolerance (max_error, Relative) of a result computed in f32 with weights of `types`.
// Against the naive loops: 1e-5. Against the CPU, as backend.h's contract states: 1e-4 on f32
// paths. With f16/bf16 weights CUDA rounds the activations (x, and the SwiGLU product in
// grouped_swiglu) to the weight's type before the tensor-core GEMM (cuBLAS takes one input type)
// while the CPU keeps them in f32: 1e-2 (bf16 keeps 8 significant bits, about 4e-3 per value).
// Activations beyond f16's 65504 are scaled per row into its range first: the same 1e-2, and
// never inf. q4 weights: the same 1e-2. Both backends decode the same values bit for bit; CUDA's
// fused kernel (up to 16 rows) keeps the activations in f32 (summation order only, ~1e-6), its
// larger batches dequantise to the scales' type and round the activations as for f16/bf16.
inline double tolerance(Against against, const std::vector<WeightType>& types = {}) {
  if (against == Against::Naive) return 1e-5;
  const bool all_f32 = std::all_of(types.begin(), types.end(), [](WeightType t) { return t == WeightType::F32; });
  return all_f32 ? 1e-4 : 1e-2;
}

enum class Measure {
  Relative,    // max |got - want| / max(max |want|, 1e-6): one scale per output, robust near 0
  PerElement,  // max |got - want| / (1 + |want|)
  Absolute,    // max |got - want|
};

// The largest difference between two outputs. A non-finite `want` must be matched exactly (NaN by
// NaN, an infinity by the same one), and `got` must be finite where `want` is: otherwise the
// error is infinite.
inline double max_error(const std::vector<float>& got, const std::vector<float>& want,
                        Measure measure = Measure::Relative) {
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0, scale = 1e-6;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    if (!std::isfinite(w)) {
      if (std::isnan(w) ? !std::isnan(g) : g != w) return INFINITY;
      continue;
    }
    if (!std::isfinite(g)) return INFINITY;
    const double d = std::fabs(g - w);
    diff = std::max(diff, measure == Measure::PerElement ? d / (1.0 + std::fabs(w)) : d);
    scale = std::max(scale, std::fabs(w));
  }
  return measure == Measure::Relative ? diff / scale : diff;
}

// The rows the naive loops compute: all of them up to 64, else 64 spread evenly from the first
// to the last (the CPU's tiles and blocks are smaller than the spacing).
inline std::vector<int64_t> sampled_rows(int64_t rows) {
  constexpr int64_t kSamples = 64;
  std::vector<int64_t> picked(static_cast<size_t>(std::min(rows, kSamples)));
  if (rows <= kSamples)
    std::iota(picked.begin(), picked.end(), 0);
  else
    for (int64_t i = 0; i < kSamples; ++i) picked[i] = i * (rows - 1) / (kSamples - 1);
  return picked;
}

// The rows a comparison covers: the sampled ones against the naive loops, all against the CPU.
inline std::vector<int64_t> compared_rows(Against against, int64_t rows) {
  if (against == Against::Naive) return sampled_rows(rows);
  std::vector<int64_t> all(static_cast<size_t>(rows));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// Rows `rows` of a [*, cols] array.
template <typename T>
std::vector<T> pick_rows(const std::vector<T>& values, int64_t cols, const std::vector<int64_t>& rows) {
  std::vector<T> out;
  out.reserve(rows.size() * static_cast<size_t>(cols));
  for (int64_t r : rows) out.insert(out.end(), values.begin() + r * cols, values.begin() + (r + 1) * cols);
  return out;
}

// Asserts that `call` throws moe::Error whose message holds every fragment.
inline void expect_refused(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    const std::string message = e.what();
    for (const std::string& f : fragments)
      EXPECT_NE(message.find(f), std::string::npos) << "message: " << message << "\nmissing: " << f;
  }
}

// ---- naive references (double precision) ----------------------------------------------------

// Rows `rows` of x[m,k] · w[n,k]ᵀ (+ bias); the other rows stay 0.
inline std::vector<float> naive_linear(const std::vector<float>& x, const std::vector<float>& w, const float* bias,
                                       int64_t m, int64_t n, int64_t k, const std::vector<int64_t>& rows) {
  std::vector<float> y(static_cast<size_t>(m * n));
  for (int64_t i : rows)
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias ? bias[j] : 0.0;
      for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(x[i * k + c]) * w[j * k + c];
      y[i * n + j] = static_cast<float>(acc);
    }
  return y;
}

inline double naive_silu(double g) { return g / (1.0 + std::exp(-g)); }

// One SwiGLU expert on one row.
inline std::vector<double> naive_expert(const float* x, const std::vector<float>& w1, const std::vector<float>& w3,
                                        const std::vector<float>& w2, int64_t d, int64_t inter) {
  std::vector<double> h(static_cast<size_t>(inter));
  for (int64_t i = 0; i < inter; ++i) {
    double g = 0.0, u = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      g += static_cast<double>(x[c]) * w1[i * d + c];
      u += static_cast<double>(x[c]) * w3[i * d + c];
    }
    h[i] = naive_silu(g) * u;
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

// Softmax per row (a row of -inf: equal probabilities), stable sort by probability descending.
inline Routing naive_topk_softmax(const std::vector<float>& logits, int64_t rows, int64_t experts, int64_t top_k,
                                  bool renormalize) {
  Routing r;
  for (int64_t row = 0; row < rows; ++row) {
    const float* l = logits.data() + row * experts;
    const double mx = *std::max_element(l, l + experts);
    std::vector<double> p(static_cast<size_t>(experts));
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = mx == -INFINITY ? 1.0 : std::exp(l[e] - mx);
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

// Attention over packed sequences, per (sequence, head, row).
inline std::vector<float> naive_attention(const std::vector<float>& qkv, const std::vector<int64_t>& lens,
                                          int64_t heads, int64_t hd, bool causal) {
  const int64_t width = heads * hd;
  const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
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

// ---- cases -----------------------------------------------------------------------------------

class OpCase {
 public:
  virtual ~OpCase() = default;
  // Letters, digits and '_' (a gtest name): the operation, then the parameters.
  virtual std::string name() const = 0;
  // The operations the case calls, as Backend::supports() is asked about them.
  virtual std::vector<OpDesc> ops() const = 0;
  // Runs the case on `b` and checks the result: against the naive loops when `b` is `cpu`,
  // else against `cpu`'s result.
  virtual void check(Backend& b, Backend& cpu) const = 0;
  // Only makes the calls (on a backend that does not support them, they must throw).
  virtual void call(Backend& b) const = 0;
};

// A case whose inputs and result are plain structs. check() builds the inputs once, runs them on
// the backend, and hands compare() what came back with the naive result or the CPU backend's.
template <typename Inputs, typename Result>
class TypedCase : public OpCase {
 public:
  void check(Backend& b, Backend& cpu) const final {
    const Inputs in = inputs();
    const Result got = run(b, in);
    if (&b == &cpu)
      compare(in, got, naive(in), Against::Naive);
    else
      compare(in, got, run(cpu, in), Against::Cpu);
  }
  void call(Backend& b) const final { run(b, inputs()); }

 protected:
  virtual Inputs inputs() const = 0;  // from the case's seed
  virtual Result run(Backend& b, const Inputs& in) const = 0;
  virtual Result naive(const Inputs& in) const = 0;
  virtual void compare(const Inputs& in, const Result& got, const Result& want, Against against) const = 0;
};

inline std::string dims(std::initializer_list<int64_t> sizes) {
  std::string s;
  for (int64_t v : sizes) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

inline std::string type_names(const std::vector<WeightType>& types) {
  std::string s;
  for (WeightType t : types) s += (s.empty() ? "" : "_") + std::string(moe::kernels::weight_type_name(t));
  return s;
}

// ---- linear

struct LinearInputs {
  std::vector<float> x, bias;
  HostWeight w;
};

class LinearCase : public TypedCase<LinearInputs, std::vector<float>> {
 public:
  // m = 0 passes no weight: with nothing to compute, none is needed. `q4`: the format of a Q4 weight.
  LinearCase(int64_t m, int64_t n, int64_t k, WeightType type, bool bias, unsigned seed, Q4Format q4 = {})
      : m_(m), n_(n), k_(k), type_(type), bias_(bias), seed_(seed), q4_(q4) {}
  std::string name() const override {
    const std::string format = type_ == WeightType::Q4 ? "_" + q4_format_name(q4_) : "";
    return "linear_" + type_names({type_}) + format + "_" + dims({m_, n_, k_}) + (bias_ ? "_bias" : "") +
           (m_ == 0 ? "_without_weight" : "");
  }
  std::vector<OpDesc> ops() const override { return {{Op::Linear, {type_}, {m_, n_, k_}}}; }

 protected:
  LinearInputs inputs() const override {
    return {random_values(m_ * k_, seed_), random_values(n_, seed_ + 1),
            make_weight(type_, n_, k_, seed_ + 2, 0.05f, q4_)};
  }
  std::vector<float> run(Backend& b, const LinearInputs& in) const override {
    DeviceBuffer<float> x(b, in.x), bias(b, in.bias), y(b, static_cast<size_t>(m_ * n_));
    const auto w = m_ > 0 ? std::make_unique<DeviceWeight>(b, in.w) : nullptr;
    b.linear(x.get(), w ? w->ref() : WeightRef{}, bias_ ? bias.get() : nullptr, y.get(), m_, n_, k_);
    return y.host();
  }
  std::vector<float> naive(const LinearInputs& in) const override {
    return naive_linear(in.x, in.w.value, bias_ ? in.bias.data() : nullptr, m_, n_, k_, sampled_rows(m_));
  }
  void compare(const LinearInputs&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    const std::vector<int64_t> rows = compared_rows(against, m_);
    EXPECT_LT(max_error(pick_rows(got, n_, rows), pick_rows(want, n_, rows)), tolerance(against, {type_}));
  }

  int64_t m_, n_, k_;
  WeightType type_;
  bool bias_;
  unsigned seed_;
  Q4Format q4_;
};

// f16 weights with activation rows far beyond f16's 65504 (CUDA scales them into its range).
class LinearBeyondF16Range : public LinearCase {
 public:
  explicit LinearBeyondF16Range(unsigned seed) : LinearCase(6, 300, 512, WeightType::F16, true, seed) {}
  std::string name() const override { return "linear_f16_activations_beyond_f16_range"; }

 protected:
  // Rows of growing magnitude: 1 (no scaling), up to 1e30; the last row holds an inf, which
  // stays inf or NaN as in f32.
  LinearInputs inputs() const override {
    LinearInputs in = LinearCase::inputs();
    for (int64_t r = 0; r < m_; ++r)
      for (int64_t c = 0; c < k_; ++c) in.x[r * k_ + c] *= kRowScale[r];
    in.x[(m_ - 1) * k_ + 7] = INFINITY;
    return in;
  }
  void compare(const LinearInputs&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    for (int64_t r = 0; r < m_; ++r) {
      const std::vector<float> got_row = pick_rows(got, n_, {r}), want_row = pick_rows(want, n_, {r});
      if (std::all_of(want_row.begin(), want_row.end(), [](float v) { return std::isfinite(v); })) {
        EXPECT_LT(max_error(got_row, want_row), tolerance(against, {type_}))
            << "row " << r << " (activations ~" << kRowScale[r] << ")";
        continue;
      }
      for (int64_t j = 0; j < n_; ++j)
        EXPECT_EQ(std::isfinite(got_row[j]), std::isfinite(want_row[j])) << "row with an inf, column " << j;
    }
  }

 private:
  static constexpr float kRowScale[6] = {1.0f, 3e4f, 1e5f, 1e9f, 1e30f, 1.0f};
};

// ---- layer_norm (in place)

struct LayerNormInputs {
  std::vector<float> x, gamma, beta;
};

class LayerNormCase : public TypedCase<LayerNormInputs, std::vector<float>> {
 public:
  // Rows of N(mean, 2²): a mean away from 0, as in a residual stream; far away (1000) it takes
  // f32 sums that do not lose the spread to the mean's rounding.
  LayerNormCase(int64_t rows, int64_t cols, unsigned seed, float mean = 4.0f)
      : rows_(rows), cols_(cols), seed_(seed), mean_(mean) {}
  std::string name() const override {
    const std::string mean = mean_ != 4.0f ? "_mean" + std::to_string(static_cast<int>(mean_)) : "";
    return "layer_norm_" + dims({rows_, cols_}) + mean;
  }
  std::vector<OpDesc> ops() const override { return {{Op::LayerNorm, {}, {rows_, cols_}}}; }

 protected:
  static constexpr float kEps = 1e-5f;
  LayerNormInputs inputs() const override {
    std::vector<float> x = random_values(rows_ * cols_, seed_, 2.0f);
    for (float& v : x) v += mean_;
    return {x, random_values(cols_, seed_ + 1), random_values(cols_, seed_ + 2)};
  }
  std::vector<float> run(Backend& b, const LayerNormInputs& in) const override {
    DeviceBuffer<float> x(b, in.x), gamma(b, in.gamma), beta(b, in.beta);
    b.layer_norm(x.get(), gamma.get(), beta.get(), x.get(), rows_, cols_, kEps);
    return x.host();
  }
  std::vector<float> naive(const LayerNormInputs& in) const override {
    std::vector<float> y(in.x.size());
    for (int64_t r = 0; r < rows_; ++r) {
      const float* x = in.x.data() + r * cols_;
      double mean = 0, var = 0;
      for (int64_t c = 0; c < cols_; ++c) mean += x[c];
      mean /= cols_;
      for (int64_t c = 0; c < cols_; ++c) var += (x[c] - mean) * (x[c] - mean);
      var /= cols_;
      for (int64_t c = 0; c < cols_; ++c)
        y[r * cols_ + c] = static_cast<float>((x[c] - mean) / std::sqrt(var + kEps) * in.gamma[c] + in.beta[c]);
    }
    return y;
  }
  void compare(const LayerNormInputs&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    EXPECT_LT(max_error(got, want), tolerance(against));
  }

 private:
  int64_t rows_, cols_;
  unsigned seed_;
  float mean_;
};

// ---- gelu, quick_gelu, silu_mul, add

enum class Elementwise { Gelu, QuickGelu, SiluMulIntoGate, SiluMulIntoUp, Add };

struct ElementwiseInputs {
  std::vector<float> a, b;  // x / gate / y, and up / the addend
};

class ElementwiseCase : public TypedCase<ElementwiseInputs, std::vector<float>> {
 public:
  ElementwiseCase(Elementwise op, int64_t n, unsigned seed) : op_(op), n_(n), seed_(seed) {}
  std::string name() const override {
    const char* names[] = {"gelu", "quick_gelu", "silu_mul_into_gate", "silu_mul_into_up", "add"};
    return names[static_cast<int>(op_)] + ("_" + std::to_string(n_));
  }
  std::vector<OpDesc> ops() const override {
    const Op ops[] = {Op::Gelu, Op::QuickGelu, Op::SiluMul, Op::SiluMul, Op::Add};
    return {{ops[static_cast<int>(op_)], {}, {n_}}};
  }

 protected:
  ElementwiseInputs inputs() const override {
    return {random_values(n_, seed_, 3.0f), random_values(n_, seed_ + 1, 3.0f)};
  }
  // In place: the result is in a, or in b for silu_mul into up.
  std::vector<float> run(Backend& b, const ElementwiseInputs& in) const override {
    DeviceBuffer<float> x(b, in.a), y(b, in.b);
    switch (op_) {
      case Elementwise::Gelu:
        b.gelu(x.get(), n_);
        break;
      case Elementwise::QuickGelu:
        b.quick_gelu(x.get(), n_);
        break;
      case Elementwise::SiluMulIntoGate:
        b.silu_mul(x.get(), y.get(), x.get(), n_);
        break;
      case Elementwise::SiluMulIntoUp:
        b.silu_mul(x.get(), y.get(), y.get(), n_);
        return y.host();
      case Elementwise::Add:
        b.add(x.get(), y.get(), n_);
        break;
    }
    return x.host();
  }
  std::vector<float> naive(const ElementwiseInputs& in) const override {
    std::vector<float> out(in.a.size());
    for (size_t i = 0; i < out.size(); ++i) {
      const double a = in.a[i], b = in.b[i];
      switch (op_) {
        case Elementwise::Gelu:
          out[i] = static_cast<float>(0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0))));
          break;
        case Elementwise::QuickGelu:
          out[i] = static_cast<float>(a / (1.0 + std::exp(-1.702 * a)));
          break;
        case Elementwise::SiluMulIntoGate:
        case Elementwise::SiluMulIntoUp:
          out[i] = static_cast<float>(naive_silu(a) * b);
          break;
        case Elementwise::Add:
          out[i] = in.a[i] + in.b[i];
          break;  // y += x is one f32 addition
      }
    }
    return out;
  }
  void compare(const ElementwiseInputs&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    if (against == Against::Naive)
      EXPECT_LE(max_error(got, want, Measure::PerElement), op_ == Elementwise::Add ? 0.0 : 1e-5);
    else
      EXPECT_LT(max_error(got, want), 1e-5);
  }

 private:
  Elementwise op_;
  int64_t n_;
  unsigned seed_;
};

// ---- l2_normalize_rows (in place)

class L2NormalizeCase : public TypedCase<std::vector<float>, std::vector<float>> {
 public:
  L2NormalizeCase(int64_t rows, int64_t cols, unsigned seed) : rows_(rows), cols_(cols), seed_(seed) {}
  // Given rows (zero, NaN and inf rows).
  L2NormalizeCase(std::string label, int64_t rows, int64_t cols, std::vector<float> values)
      : rows_(rows), cols_(cols), label_(std::move(label)), values_(std::move(values)) {}
  std::string name() const override {
    return "l2_normalize_rows_" + (label_.empty() ? "" : label_ + "_") + dims({rows_, cols_});
  }
  std::vector<OpDesc> ops() const override { return {{Op::L2NormalizeRows, {}, {rows_, cols_}}}; }

 protected:
  static constexpr float kEps = 1e-12f;
  std::vector<float> inputs() const override {
    return values_.empty() ? random_values(rows_ * cols_, seed_, 3.0f) : values_;
  }
  std::vector<float> run(Backend& b, const std::vector<float>& in) const override {
    DeviceBuffer<float> x(b, in);
    b.l2_normalize_rows(x.get(), rows_, cols_, kEps);
    return x.host();
  }
  // x / max(‖x‖, eps): a NaN norm stays NaN (the row becomes NaN); an inf one makes finite values
  // 0 and the inf NaN.
  std::vector<float> naive(const std::vector<float>& in) const override {
    std::vector<float> y(in.size());
    for (int64_t r = 0; r < rows_; ++r) {
      double ss = 0.0;
      for (int64_t c = 0; c < cols_; ++c) ss += static_cast<double>(in[r * cols_ + c]) * in[r * cols_ + c];
      const double norm = std::sqrt(ss);
      const double inv = 1.0 / (norm < kEps ? kEps : norm);
      for (int64_t c = 0; c < cols_; ++c) y[r * cols_ + c] = static_cast<float>(in[r * cols_ + c] * inv);
    }
    return y;
  }
  // Against the naive loops: about 2 ulps of an entry below 1 (the CPU rounds the norm, its
  // inverse and the product in f32).
  void compare(const std::vector<float>&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    EXPECT_LE(max_error(got, want, Measure::Absolute), against == Against::Naive ? 2e-7 : 1e-6);
  }

 private:
  int64_t rows_, cols_;
  unsigned seed_ = 0;
  std::string label_;
  std::vector<float> values_;
};

// ---- attention

class AttentionCase : public TypedCase<std::vector<float>, std::vector<float>> {
 public:
  AttentionCase(std::string label, std::vector<int64_t> lens, int64_t heads, int64_t head_dim, bool causal,
                unsigned seed)
      : label_(std::move(label)),
        lens_(std::move(lens)),
        heads_(heads),
        head_dim_(head_dim),
        causal_(causal),
        seed_(seed) {}
  std::string name() const override {
    return "attention_" + label_ + "_h" + std::to_string(heads_) + "_d" + std::to_string(head_dim_) +
           (causal_ ? "_causal" : "");
  }
  std::vector<OpDesc> ops() const override {
    const int64_t longest = lens_.empty() ? 0 : *std::max_element(lens_.begin(), lens_.end());
    return {{Op::Attention, {}, {rows(), longest, heads_, head_dim_}}};
  }

 protected:
  int64_t rows() const { return std::accumulate(lens_.begin(), lens_.end(), int64_t{0}); }
  std::vector<float> inputs() const override { return random_values(rows() * 3 * heads_ * head_dim_, seed_); }
  std::vector<float> run(Backend& b, const std::vector<float>& qkv) const override {
    DeviceBuffer<float> in(b, qkv), out(b, static_cast<size_t>(rows() * heads_ * head_dim_));
    b.attention(in.get(), out.get(), lens_, heads_, head_dim_, causal_);
    return out.host();
  }
  std::vector<float> naive(const std::vector<float>& qkv) const override {
    return naive_attention(qkv, lens_, heads_, head_dim_, causal_);
  }
  void compare(const std::vector<float>&, const std::vector<float>& got, const std::vector<float>& want,
               Against against) const override {
    EXPECT_LT(max_error(got, want), tolerance(against));
  }

 private:
  std::string label_;
  std::vector<int64_t> lens_;
  int64_t heads_, head_dim_;
  bool causal_;
  unsigned seed_;
};

// Sequence lengths in [1, max_len], the first max_len.
inline std::vector<int64_t> random_lengths(size_t count, int64_t max_len, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, max_len);
  std::vector<int64_t> lens(count);
  for (int64_t& l : lens) l = len(rng);
  lens[0] = max_len;
  return lens;
}

// ---- topk_softmax

class TopkSoftmaxCase : public TypedCase<std::vector<float>, Routing> {
 public:
  TopkSoftmaxCase(std::string label, int64_t rows, int64_t experts, int64_t top_k, bool renormalize,
                  std::function<std::vector<float>()> logits)
      : label_(std::move(label)),
        rows_(rows),
        experts_(experts),
        top_k_(top_k),
        renormalize_(renormalize),
        logits_(std::move(logits)) {}
  std::string name() const override {
    return "topk_softmax_" + label_ + "_" + dims({rows_, experts_}) + "_top" + std::to_string(top_k_) +
           (renormalize_ ? "_renormalized" : "");
  }
  std::vector<OpDesc> ops() const override { return {{Op::TopkSoftmax, {}, {rows_, experts_, top_k_}}}; }

 protected:
  std::vector<float> inputs() const override { return logits_(); }
  Routing run(Backend& b, const std::vector<float>& logits) const override {
    DeviceBuffer<float> l(b, logits), weights(b, static_cast<size_t>(rows_ * top_k_));
    DeviceBuffer<int32_t> ids(b, static_cast<size_t>(rows_ * top_k_));
    b.topk_softmax(l.get(), rows_, experts_, top_k_, renormalize_, ids.get(), weights.get());
    return {ids.host(), weights.host()};
  }
  Routing naive(const std::vector<float>& logits) const override {
    return naive_topk_softmax(logits, rows_, experts_, top_k_, renormalize_);
  }
  void compare(const std::vector<float>&, const Routing& got, const Routing& want, Against) const override {
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_LE(max_error(got.weights, want.weights, Measure::Absolute), 1e-6);
  }

 private:
  std::string label_;
  int64_t rows_, experts_, top_k_;
  bool renormalize_;
  std::function<std::vector<float>()> logits_;
};

// Random logits with ties: the first row all equal, the last with its first half repeated in the
// second; with 3 rows or more the middle row all -inf (routed as equal logits).
inline std::vector<float> logits_with_ties(int64_t rows, int64_t experts, unsigned seed) {
  std::vector<float> logits = random_values(rows * experts, seed, 2.0f);
  std::fill(logits.begin(), logits.begin() + experts, 0.25f);
  float* last = logits.data() + (rows - 1) * experts;
  if (rows > 1)
    for (int64_t e = experts / 2; e < experts; ++e) last[e] = last[e - experts / 2];
  if (rows > 2) std::fill_n(logits.data() + (rows / 2) * experts, experts, -INFINITY);
  return logits;
}

// ---- moe_permute → grouped_swiglu → moe_unpermute

struct MoeShape {
  int64_t rows, d, inter, experts, top_k;
  bool renormalize;
  std::vector<WeightType> types;  // cycled over the experts
  int64_t empty_expert;           // routed no rows, given no weights
  float weight_stddev;
  float x_stddev;  // 1e5: beyond f16's range (65504)
  // > 0: every unused_stride-th slot, and every slot of row 0, is unused (id -1, weight 0), as
  // routing policies leave them (dynamic k, capacity).
  int64_t unused_stride = 0;
  Q4Format q4 = {};  // of the Q4 experts' weights
};

struct MoeInputs {
  std::vector<float> x;
  Routing routing;
  std::vector<HostWeight> w1, w3, w2;  // per expert (empty for the empty expert)
};

struct MoeResult {
  std::vector<int64_t> offsets;
  std::vector<int32_t> slot_of;
  std::vector<float> x_sorted, out_sorted, y;
};

// The three MoE operations in a row, each on the backend's own previous output, against the
// per-row MoE y[r] = Σ_j weight · expert(x[r]).
class MoeCase : public TypedCase<MoeInputs, MoeResult> {
 public:
  MoeCase(MoeShape shape, unsigned seed) : s_(std::move(shape)), seed_(seed) {}
  std::string name() const override {
    std::string n = "moe_" + dims({s_.rows, s_.d}) + "_inter" + std::to_string(s_.inter) + "_top" +
                    std::to_string(s_.top_k) + "_of" + std::to_string(s_.experts) + "_" + type_names(s_.types);
    if (!s_.renormalize) n += "_unnormalized";
    if (s_.x_stddev != 1.0f) n += "_x" + std::to_string(static_cast<int64_t>(s_.x_stddev));
    if (s_.unused_stride > 0) n += "_unused" + std::to_string(s_.unused_stride);
    if (std::find(s_.types.begin(), s_.types.end(), WeightType::Q4) != s_.types.end()) n += "_" + q4_format_name(s_.q4);
    return n;
  }
  std::vector<OpDesc> ops() const override {
    std::vector<WeightType> types;
    for (int64_t e = 0; e < s_.experts; ++e)
      if (e != s_.empty_expert) types.push_back(type_of(e));
    return {{Op::MoePermute, {}, {s_.rows, s_.top_k, s_.experts, s_.d}},
            {Op::GroupedSwiglu, types, {s_.rows * s_.top_k, s_.experts, s_.d, s_.inter}},
            {Op::MoeUnpermute, {}, {s_.rows, s_.top_k, s_.d}}};
  }

 protected:
  WeightType type_of(int64_t expert) const { return s_.types[static_cast<size_t>(expert) % s_.types.size()]; }

  MoeInputs inputs() const override {
    MoeInputs in;
    in.x = random_values(s_.rows * s_.d, seed_, s_.x_stddev);
    std::vector<float> logits = random_values(s_.rows * s_.experts, seed_ + 1, 2.0f);
    for (int64_t r = 0; r < s_.rows; ++r) logits[r * s_.experts + s_.empty_expert] = -100.0f;  // never chosen
    in.routing = naive_topk_softmax(logits, s_.rows, s_.experts, s_.top_k, s_.renormalize);
    for (int64_t i = 0; s_.unused_stride > 0 && i < s_.rows * s_.top_k; ++i)
      if (i < s_.top_k || i % s_.unused_stride == s_.unused_stride - 1) {
        in.routing.ids[i] = -1;
        in.routing.weights[i] = 0.0f;
      }
    in.w1.resize(s_.experts);
    in.w3.resize(s_.experts);
    in.w2.resize(s_.experts);
    for (int64_t e = 0; e < s_.experts; ++e) {
      if (e == s_.empty_expert) continue;
      const auto seed = static_cast<unsigned>(seed_ + 10 + 3 * e);
      in.w1[e] = make_weight(type_of(e), s_.inter, s_.d, seed, s_.weight_stddev, s_.q4);
      in.w3[e] = make_weight(type_of(e), s_.inter, s_.d, seed + 1, s_.weight_stddev, s_.q4);
      in.w2[e] = make_weight(type_of(e), s_.d, s_.inter, seed + 2, s_.weight_stddev, s_.q4);
    }
    return in;
  }

  MoeResult run(Backend& b, const MoeInputs& in) const override {
    const auto slots = static_cast<size_t>(s_.rows * s_.top_k);
    std::vector<std::unique_ptr<DeviceWeight>> weights;
    std::vector<ExpertWeights> experts(s_.experts);
    for (int64_t e = 0; e < s_.experts; ++e) {
      if (e == s_.empty_expert) continue;
      for (const HostWeight* w : {&in.w1[e], &in.w3[e], &in.w2[e]})
        weights.push_back(std::make_unique<DeviceWeight>(b, *w));
      const size_t i = weights.size() - 3;
      experts[e] = {weights[i]->ref(), weights[i + 1]->ref(), weights[i + 2]->ref()};
    }
    DeviceBuffer<float> x(b, in.x), routing_weights(b, in.routing.weights), x_sorted(b, slots * s_.d),
        out_sorted(b, slots * s_.d), y(b, static_cast<size_t>(s_.rows * s_.d));
    DeviceBuffer<int32_t> ids(b, in.routing.ids), slot_of(b, slots);
    MoeResult r;
    r.offsets = b.moe_permute(ids.get(), s_.rows, s_.top_k, s_.experts, x.get(), s_.d, x_sorted.get(), slot_of.get());
    b.grouped_swiglu(x_sorted.get(), r.offsets, experts, s_.d, s_.inter, out_sorted.get());
    b.moe_unpermute(out_sorted.get(), slot_of.get(), routing_weights.get(), s_.rows, s_.top_k, s_.d, y.get());
    r.slot_of = slot_of.host();
    r.x_sorted = x_sorted.host();
    r.out_sorted = out_sorted.host();
    r.y = y.host();
    return r;
  }

  // The permutation in full: expert by expert, slots in (row, j) order. The experts' outputs on
  // the sampled rows only.
  MoeResult naive(const MoeInputs& in) const override {
    const int64_t slots = s_.rows * s_.top_k;
    MoeResult r;
    r.offsets.assign(static_cast<size_t>(s_.experts + 1), 0);
    r.slot_of.assign(static_cast<size_t>(slots), -1);
    r.x_sorted.assign(static_cast<size_t>(slots * s_.d), 0.0f);
    int64_t next = 0;
    for (int64_t e = 0; e < s_.experts; ++e) {
      for (int64_t i = 0; i < slots; ++i) {
        if (in.routing.ids[i] != e) continue;
        r.slot_of[i] = static_cast<int32_t>(next);
        std::copy_n(in.x.begin() + (i / s_.top_k) * s_.d, s_.d, r.x_sorted.begin() + next * s_.d);
        ++next;
      }
      r.offsets[e + 1] = next;
    }
    r.out_sorted.assign(r.x_sorted.size(), 0.0f);
    r.y.assign(static_cast<size_t>(s_.rows * s_.d), 0.0f);
    for (int64_t row : sampled_rows(s_.rows)) {
      std::vector<double> acc(static_cast<size_t>(s_.d), 0.0);
      for (int64_t j = 0; j < s_.top_k; ++j) {
        const int64_t i = row * s_.top_k + j, e = in.routing.ids[i];
        if (e < 0) continue;  // unused
        const std::vector<double> o =
            naive_expert(in.x.data() + row * s_.d, in.w1[e].value, in.w3[e].value, in.w2[e].value, s_.d, s_.inter);
        for (int64_t c = 0; c < s_.d; ++c) {
          r.out_sorted[r.slot_of[i] * s_.d + c] = static_cast<float>(o[c]);
          acc[c] += in.routing.weights[i] * o[c];
        }
      }
      for (int64_t c = 0; c < s_.d; ++c) r.y[row * s_.d + c] = static_cast<float>(acc[c]);
    }
    return r;
  }

  void compare(const MoeInputs&, const MoeResult& got, const MoeResult& want, Against against) const override {
    EXPECT_EQ(got.offsets, want.offsets);
    EXPECT_EQ(got.slot_of, want.slot_of);
    const auto sorted = static_cast<size_t>(want.offsets.back() * s_.d);  // beyond: unused slots, never written
    EXPECT_TRUE(std::equal(want.x_sorted.begin(), want.x_sorted.begin() + sorted, got.x_sorted.begin()));
    const std::vector<int64_t> rows = compared_rows(against, s_.rows);
    std::vector<int64_t> slots;  // those of the compared rows
    for (int64_t row : rows)
      for (int64_t j = 0; j < s_.top_k; ++j)
        if (want.slot_of[row * s_.top_k + j] >= 0) slots.push_back(want.slot_of[row * s_.top_k + j]);
    std::sort(slots.begin(), slots.end());
    const double tol = tolerance(against, s_.types);
    EXPECT_LT(max_error(pick_rows(got.out_sorted, s_.d, slots), pick_rows(want.out_sorted, s_.d, slots)), tol)
        << "grouped_swiglu";
    EXPECT_LT(max_error(pick_rows(got.y, s_.d, rows), pick_rows(want.y, s_.d, rows)), tol) << "moe_unpermute";
  }

 private:
  MoeShape s_;
  unsigned seed_;
};

// ---- moe_unpermute alone

struct UnpermuteInputs {
  std::vector<float> out_sorted, weights;
  std::vector<int32_t> slot_of;
};

class MoeUnpermuteCase : public TypedCase<UnpermuteInputs, std::vector<float>> {
 public:
  MoeUnpermuteCase(int64_t rows, int64_t top_k, int64_t cols, unsigned seed)
      : rows_(rows), top_k_(top_k), cols_(cols), seed_(seed) {}
  std::string name() const override { return "moe_unpermute_" + dims({rows_, top_k_, cols_}); }
  std::vector<OpDesc> ops() const override { return {{Op::MoeUnpermute, {}, {rows_, top_k_, cols_}}}; }

 protected:
  UnpermuteInputs inputs() const override {
    const int64_t slots = rows_ * top_k_;
    UnpermuteInputs in{random_values(slots * cols_, seed_), random_values(slots, seed_ + 1, 0.5f),
                       std::vector<int32_t>(static_cast<size_t>(slots))};
    std::iota(in.slot_of.begin(), in.slot_of.end(), 0);
    std::shuffle(in.slot_of.begin(), in.slot_of.end(), std::mt19937(seed_ + 2));
    return in;
  }
  std::vector<float> run(Backend& b, const UnpermuteInputs& in) const override {
    DeviceBuffer<float> out_sorted(b, in.out_sorted), weights(b, in.weights), y(b, static_cast<size_t>(rows_ * cols_));
    DeviceBuffer<int32_t> slot_of(b, in.slot_of);
    b.moe_unpermute(out_sorted.get(), slot_of.get(), weights.get(), rows_, top_k_, cols_, y.get());
    return y.host();
  }
  std::vector<float> naive(const UnpermuteInputs& in) const override {
    std::vector<float> y(static_cast<size_t>(rows_ * cols_));
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < top_k_; ++j)
          acc +=
              static_cast<double>(in.weights[r * top_k_ + j]) * in.out_sorted[in.slot_of[r * top_k_ + j] * cols_ + c];
        y[r * cols_ + c] = static_cast<float>(acc);
      }
    return y;
  }
  void compare(const UnpermuteInputs&, const std::vector<float>& got, const std::vector<float>& want,
               Against) const override {
    EXPECT_LT(max_error(got, want), 1e-6);
  }

 private:
  int64_t rows_, top_k_, cols_;
  unsigned seed_;
};

// ---- inner_product_topk

struct SearchInputs {
  std::vector<float> queries, base;
};

struct SearchResult {
  std::vector<int64_t> ids;
  std::vector<float> scores;
};

// Integer data (`integers`): ids and scores exactly equal. Random data: scores within 1e-6 of the
// naive loops' (f32 dot products of up to 768 terms), within tolerance() of the CPU's; where ids
// differ, the two candidates' exact scores are that close too (near-ties), and there are few.
class InnerProductTopkCase : public TypedCase<SearchInputs, SearchResult> {
 public:
  InnerProductTopkCase(int64_t nq, int64_t nb, int64_t d, int64_t k, bool integers, unsigned seed)
      : nq_(nq), nb_(nb), d_(d), k_(k), integers_(integers), seed_(seed) {}
  std::string name() const override {
    return "inner_product_topk_" + dims({nq_, nb_, d_}) + "_k" + std::to_string(k_) + (integers_ ? "_integers" : "");
  }
  std::vector<OpDesc> ops() const override { return {{Op::InnerProductTopk, {}, {nq_, nb_, d_, k_}}}; }

 protected:
  SearchInputs inputs() const override {
    const auto values = [this](int64_t n, unsigned seed) {
      return integers_ ? small_integers(n, seed) : random_values(n, seed);
    };
    return {values(nq_ * d_, seed_), values(nb_ * d_, seed_ + 1)};
  }
  SearchResult run(Backend& b, const SearchInputs& in) const override {
    DeviceBuffer<float> q(b, in.queries), base(b, in.base), scores(b, static_cast<size_t>(nq_ * k_));
    DeviceBuffer<int64_t> ids(b, static_cast<size_t>(nq_ * k_));
    b.inner_product_topk(q.get(), nq_, base.get(), nb_, d_, k_, ids.get(), scores.get());
    return {ids.host(), scores.host()};
  }
  // Every score of a sampled query, stable-sorted by (score desc, index asc), the first k kept.
  SearchResult naive(const SearchInputs& in) const override {
    const auto n = static_cast<size_t>(nq_ * k_);
    SearchResult r{std::vector<int64_t>(n), std::vector<float>(n)};
    for (int64_t i : sampled_rows(nq_)) {
      std::vector<double> s(static_cast<size_t>(nb_));
      for (int64_t j = 0; j < nb_; ++j) s[j] = exact_score(in, i, j);
      std::vector<int64_t> order(static_cast<size_t>(nb_));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
      for (int64_t j = 0; j < k_; ++j) {
        r.ids[i * k_ + j] = order[j];
        r.scores[i * k_ + j] = static_cast<float>(s[order[j]]);
      }
    }
    return r;
  }
  void compare(const SearchInputs& in, const SearchResult& got, const SearchResult& want,
               Against against) const override {
    const std::vector<int64_t> queries = compared_rows(against, nq_);
    const std::vector<int64_t> got_ids = pick_rows(got.ids, k_, queries), want_ids = pick_rows(want.ids, k_, queries);
    const std::vector<float> got_scores = pick_rows(got.scores, k_, queries);
    const std::vector<float> want_scores = pick_rows(want.scores, k_, queries);
    if (integers_) {
      EXPECT_EQ(got_ids, want_ids);
      EXPECT_EQ(got_scores, want_scores);
      return;
    }
    const double tol = against == Against::Naive ? 1e-6 : tolerance(against);
    EXPECT_LT(max_error(got_scores, want_scores), tol);
    double scale = 1e-6;
    for (float s : want_scores) scale = std::max(scale, std::fabs(static_cast<double>(s)));
    int64_t differing = 0;
    for (size_t qi = 0; qi < queries.size(); ++qi)
      for (int64_t j = 0; j < k_; ++j) {
        const int64_t a = got_ids[qi * k_ + j], b = want_ids[qi * k_ + j];
        if (a == b) continue;
        ++differing;
        ASSERT_GE(a, 0);
        ASSERT_LT(a, nb_);
        EXPECT_LT(std::fabs(exact_score(in, queries[qi], a) - exact_score(in, queries[qi], b)) / scale, tol)
            << "query " << queries[qi] << " rank " << j << " ids " << a << " vs " << b;
      }
    EXPECT_LE(differing, 2 + static_cast<int64_t>(queries.size()) * k_ / 100) << "too many near-ties";
  }

 private:
  double exact_score(const SearchInputs& in, int64_t query, int64_t vector) const {
    double acc = 0.0;
    for (int64_t c = 0; c < d_; ++c) acc += static_cast<double>(in.queries[query * d_ + c]) * in.base[vector * d_ + c];
    return acc;
  }

  int64_t nq_, nb_, d_, k_;
  bool integers_;
  unsigned seed_;
};

// ---- calls every backend refuses

// A call that every backend must refuse with the same moe::Error, "<backend>: <operation>:
// <reason>" (op_checks.h), holding every fragment of `reason`; then `after`, when given, checks
// that the backend still works.
class RejectedCall : public OpCase {
 public:
  RejectedCall(std::string label, OpDesc op, std::vector<std::string> reason, std::function<void(Backend&)> call,
               std::function<void(Backend&)> after = {})
      : label_(std::move(label)),
        op_(std::move(op)),
        reason_(std::move(reason)),
        call_(std::move(call)),
        after_(std::move(after)) {}
  std::string name() const override { return std::string(moe::kernels::op_name(op_.op)) + "_rejects_" + label_; }
  std::vector<OpDesc> ops() const override { return {op_}; }
  void check(Backend& b, Backend&) const override {
    std::vector<std::string> fragments = {b.name() + ": " + moe::kernels::op_name(op_.op) + ": "};
    fragments.insert(fragments.end(), reason_.begin(), reason_.end());
    expect_refused([&] { call_(b); }, fragments);
    if (after_) after_(b);
  }
  void call(Backend& b) const override { call_(b); }

 private:
  std::string label_;
  OpDesc op_;
  std::vector<std::string> reason_;
  std::function<void(Backend&)> call_, after_;
};

// ---- the table -------------------------------------------------------------------------------

inline const std::vector<std::unique_ptr<OpCase>>& op_cases() {
  static const std::vector<std::unique_ptr<OpCase>> table = [] {
    std::vector<std::unique_ptr<OpCase>> t;
    const auto add = [&t](auto c) { t.push_back(std::make_unique<decltype(c)>(std::move(c))); };
    const WeightType f32 = WeightType::F32, f16 = WeightType::F16, bf16 = WeightType::BF16;

    // linear, every weight type, with and without bias: small shapes; 3x1000x300 spans several
    // widening blocks of the CPU's f16/bf16 path; then CLIP's projections and MLPs.
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 11},
                           {3, 1000, 300},
                           {1, 1, 1},
                           {7, 33, 5},
                           {1, 768, 768},
                           {308, 2304, 768},
                           {1000, 512, 768}})
      for (WeightType type : {f32, f16, bf16})
        for (bool bias : {false, true}) add(LinearCase(m, n, k, type, bias, 50));
    add(LinearCase(0, 4, 4, f32, false, 50));
    add(LinearBeyondF16Range(53));
    // q4 (W4A16): both group sizes and scale types, symmetric and with zero points; row counts on
    // both sides of CUDA's fused kernel's limit (16 rows, kQ4FusedMaxRows in cuda_common.h) and of
    // the CPU's direct path (12); k = 384 and 96 end in part of CUDA's 256-column tile, n = 33,
    // 65 and 300 in part of its 16-row block.
    const WeightType q4 = WeightType::Q4;
    const Q4Format g32_f16{32, f16, false}, g32_bf16_asym{32, bf16, true}, g128_f16_asym{128, f16, true},
        g128_bf16{128, bf16, false};
    for (const Q4Format& format : {g32_f16, g32_bf16_asym, g128_f16_asym, g128_bf16})
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 33, 256},
                             {12, 300, 384},
                             {16, 300, 384},
                             {17, 65, 512},
                             {64, 1000, 768}})
        add(LinearCase(m, n, k, q4, m % 2 == 1, 40, format));
    for (const Q4Format& format : {g32_f16, g32_bf16_asym}) add(LinearCase(3, 5, 96, q4, true, 41, format));
    add(RejectedCall("a_q4_group_size_not_a_multiple_of_8", {Op::Linear, {q4}, {1, 8, 64}},
                     {"q4 group size 12 must be a positive multiple of 8 that divides k = 64"}, [](Backend& b) {
                       HostWeight w = make_q4_weight({32, WeightType::F16, false}, 8, 64, 42, 0.1f);
                       w.q4.group_size = 12;
                       const DeviceWeight on_b(b, w);
                       DeviceBuffer<float> x(b, 64), y(b, 8);
                       b.linear(x.get(), on_b.ref(), nullptr, y.get(), 1, 8, 64);
                     }));
    add(RejectedCall("a_weight_without_data", {Op::Linear, {f32}, {1, 1, 1}}, {"no data"}, [](Backend& b) {
      DeviceBuffer<float> x(b, 1), y(b, 1);
      b.linear(x.get(), WeightRef{}, nullptr, y.get(), 1, 1, 1);
    }));

    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3, 37}, {1, 512}, {77, 768}, {1000, 768}, {3, 1000}})
      add(LayerNormCase(rows, cols, 60));
    add(LayerNormCase(1000, 768, 61, 1000.0f));

    for (int64_t n : {int64_t{100}, int64_t{1000 * 3072 + 5}})
      for (Elementwise op : {Elementwise::Gelu, Elementwise::QuickGelu, Elementwise::SiluMulIntoGate,
                             Elementwise::SiluMulIntoUp, Elementwise::Add})
        add(ElementwiseCase(op, n, 63));

    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 7}, {1000, 512}, {33, 4099}})
      add(L2NormalizeCase(rows, cols, static_cast<unsigned>(cols)));
    // A zero row stays zero (the eps clamp); a NaN makes its row NaN (torch's normalize); an inf
    // makes the finite values 0 and itself NaN (inf / inf).
    add(L2NormalizeCase("zero_nan_inf_rows", 5, 3, {3, 4, 0, 0, 0, 0, 1, 1, 1, 1, NAN, 2, 1, INFINITY, 2}));
    add(L2NormalizeCase("nan_inf_zero_rows", 4, 4, {1, NAN, 2, 3, 1, INFINITY, 2, 3, 0, 0, 0, 0, 3, 4, 0, 0}));

    for (bool causal : {false, true})
      add(AttentionCase("packed_with_an_empty_sequence", {3, 1, 0, 6, 4}, 2, 5, causal, 10));
    add(AttentionCase("text_64_prompts", random_lengths(64, 77, 70), 8, 64, true, 72));
    add(AttentionCase("text_3_prompts", random_lengths(3, 77, 71), 12, 64, true, 72));
    add(AttentionCase("vit_b32_16_images", std::vector<int64_t>(16, 50), 12, 64, false, 72));
    add(AttentionCase("vit_b16_4_images", std::vector<int64_t>(4, 197), 12, 64, false, 72));
    add(AttentionCase("an_empty_and_a_one_row_sequence", {197, 0, 50, 1}, 4, 128, false, 72));
    add(AttentionCase("head_dim_not_a_multiple_of_32", {77, 5}, 3, 80, true, 72));
    add(AttentionCase("head_dim_1", {9}, 2, 1, false, 72));
    add(AttentionCase("300_sequences_offsets_in_two_upload_chunks", std::vector<int64_t>(300, 3), 2, 32, true, 72));
    add(AttentionCase("head_dim_beyond_cuda", {3, 2}, 2, 129, false, 73));
    add(RejectedCall("no_heads", {Op::Attention, {}, {1, 1, 0, 4}}, {"positive"}, [](Backend& b) {
      DeviceBuffer<float> qkv(b, 12), out(b, 4);
      b.attention(qkv.get(), out.get(), {1}, 0, 4, false);
    }));

    // Ties: row 0 all equal, row 1 a tie for first place, row 2 a tie across the top-k boundary.
    const auto tie_rows = [] {
      std::vector<float> logits = random_values(6 * 7, 11, 2.0f);
      std::fill_n(logits.begin(), 7, 0.5f);
      logits[7 + 2] = logits[7 + 5] = 9.0f;
      logits[14 + 1] = 9.0f;
      logits[14 + 3] = logits[14 + 6] = 8.0f;
      return logits;
    };
    for (int64_t top_k : {1, 2, 3, 7})
      for (bool renormalize : {false, true}) add(TopkSoftmaxCase("ties", 6, 7, top_k, renormalize, tie_rows));
    // Row 0: every expert masked (routed as equal logits: ids 0, 1); row 1: all but experts 3 and 1.
    const auto masked_rows = [] {
      return std::vector<float>{-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                                -INFINITY, 0.5f,      -INFINITY, 2.0f,      -INFINITY};
    };
    for (bool renormalize : {false, true}) add(TopkSoftmaxCase("masked_experts", 2, 5, 2, renormalize, masked_rows));
    struct Router {
      int64_t rows, experts, top_k;
      bool renormalize;
    };
    for (const Router& r :
         {Router{1, 8, 2, true}, Router{1000, 8, 2, true}, Router{1000, 60, 4, false}, Router{333, 64, 8, true},
          Router{100, 256, 8, false}, Router{10, 7, 7, true}, Router{50, 3000, 3, true}})
      add(TopkSoftmaxCase("random_with_ties", r.rows, r.experts, r.top_k, r.renormalize,
                          [r] { return logits_with_ties(r.rows, r.experts, 80); }));
    add(TopkSoftmaxCase("experts_beyond_cuda", 4, 12289, 2, true, [] { return logits_with_ties(4, 12289, 81); }));
    add(RejectedCall("top_k_beyond_experts", {Op::TopkSoftmax, {}, {1, 7, 8}}, {"top_k 8"}, [](Backend& b) {
      DeviceBuffer<float> logits(b, 7), weights(b, 8);
      DeviceBuffer<int32_t> ids(b, 8);
      b.topk_softmax(logits.get(), 1, 7, 8, true, ids.get(), weights.get());
    }));

    // rows, d, inter, experts, top_k, renormalize, types, empty expert, weight stddev, x stddev
    for (const std::vector<WeightType>& types : {std::vector<WeightType>{f32}, {f16}, {bf16}, {f32, bf16, f16}})
      add(MoeCase({9, 6, 4, 5, 2, true, types, 3, 0.5f, 1.0f}, 12));
    add(MoeCase({1, 512, 1024, 8, 2, true, {f32}, 7, 0.05f, 1.0f}, 90));
    add(MoeCase({1000, 768, 1024, 8, 2, true, {f32}, 7, 0.05f, 1.0f}, 90));
    add(MoeCase({300, 512, 1024, 8, 2, true, {f16}, 7, 0.05f, 1.0f}, 90));
    add(MoeCase({300, 768, 512, 8, 2, true, {bf16}, 7, 0.05f, 1.0f}, 90));
    add(MoeCase({100, 512, 256, 60, 4, false, {f32}, 59, 0.05f, 1.0f}, 90));  // Qwen2-MoE-like routing
    add(MoeCase({50, 512, 256, 8, 2, true, {f32, f16, bf16}, 7, 0.05f, 1.0f}, 90));
    add(MoeCase({50, 512, 256, 8, 3, true, {f32, f16}, 7, 0.05f, 1.0f, 4}, 90));  // rows with fewer experts
    // Activations and SwiGLU products far beyond f16's 65504.
    add(MoeCase({64, 512, 256, 8, 2, true, {f16}, 7, 0.05f, 1e5f}, 90));
    add(MoeCase({64, 512, 256, 8, 2, true, {f16, f32, bf16}, 7, 0.05f, 1e5f}, 90));
    // q4 experts: few rows each (CUDA's fused kernel), many (dequantised for cuBLAS), both in one
    // call next to f16 and f32 experts (CUDA runs those in runs between the fused ones), rows
    // with unused slots, activations beyond f16's range.
    add(MoeCase({9, 64, 32, 5, 2, true, {q4}, 3, 0.5f, 1.0f, 0, g32_f16}, 12));
    add(MoeCase({9, 64, 32, 5, 2, true, {q4}, 3, 0.5f, 1.0f, 0, g32_bf16_asym}, 12));
    add(MoeCase({300, 256, 128, 8, 2, true, {q4}, 7, 0.05f, 1.0f, 0, g128_f16_asym}, 90));
    add(MoeCase({300, 256, 512, 8, 2, true, {q4}, 7, 0.05f, 1.0f, 0, g128_bf16}, 90));
    add(MoeCase({50, 256, 128, 8, 2, true, {q4, f16, q4, f32}, 7, 0.05f, 1.0f, 0, g32_bf16_asym}, 90));
    add(MoeCase({50, 256, 128, 8, 3, true, {q4}, 7, 0.05f, 1.0f, 4, g32_f16}, 90));
    add(MoeCase({64, 256, 256, 8, 2, true, {q4, f16}, 7, 0.05f, 1e5f, 0, g128_f16_asym}, 90));
    for (auto [rows, top_k, cols] : {std::tuple<int64_t, int64_t, int64_t>{9, 2, 6},
                                     {1, 2, 512},
                                     {1000, 2, 768},
                                     {300, 2, 512},
                                     {300, 2, 768},
                                     {100, 4, 512},
                                     {50, 2, 512},
                                     {64, 2, 512}})
      add(MoeUnpermuteCase(rows, top_k, cols, 95));
    add(RejectedCall(
        "an_expert_id_out_of_range", {Op::MoePermute, {}, {2, 2, 4, 4}}, {"expert id 9 at row 1", "[0, 4)"},
        [](Backend& b) {
          DeviceBuffer<int32_t> ids(b, std::vector<int32_t>{0, 1, 2, 9}), slot_of(b, 4);
          DeviceBuffer<float> x(b, 8), x_sorted(b, 16);
          b.moe_permute(ids.get(), 2, 2, 4, x.get(), 4, x_sorted.get(), slot_of.get());
        },
        [](Backend& b) {  // still usable
          DeviceBuffer<int32_t> ids(b, std::vector<int32_t>{0, 1}), slot_of(b, 2);
          DeviceBuffer<float> x(b, 4), x_sorted(b, 8);
          EXPECT_EQ(b.moe_permute(ids.get(), 1, 2, 4, x.get(), 4, x_sorted.get(), slot_of.get()),
                    (std::vector<int64_t>{0, 1, 2, 2, 2}));
          EXPECT_EQ(slot_of.host(), (std::vector<int32_t>{0, 1}));
        }));
    add(RejectedCall("offsets_not_one_per_expert_plus_one", {Op::GroupedSwiglu, {}, {1, 2, 4, 4}}, {"offsets"},
                     [](Backend& b) {
                       DeviceBuffer<float> x(b, 4), out(b, 4);
                       b.grouped_swiglu(x.get(), {0, 1}, std::vector<ExpertWeights>(2), 4, 4, out.get());
                     }));
    add(RejectedCall("an_expert_with_rows_but_no_weights", {Op::GroupedSwiglu, {}, {1, 2, 4, 4}}, {"expert 1 w1"},
                     [](Backend& b) {
                       DeviceBuffer<float> x(b, 4), out(b, 4);
                       b.grouped_swiglu(x.get(), {0, 0, 1}, std::vector<ExpertWeights>(2), 4, 4, out.get());
                     }));

    // Integers: exact scores and many ties; nq and nb cross the CPU's query (64) and base (4096)
    // tiles and CUDA's (1024 queries, 16384 base vectors).
    for (int64_t k : {1, 10, 100}) add(InnerProductTopkCase(70, 5000, 4, k, true, 14));
    add(InnerProductTopkCase(1500, 40000, 8, 10, true, 100));
    add(InnerProductTopkCase(20, 40000, 4, 1024, true, 100));  // CUDA's largest k
    add(InnerProductTopkCase(3, 20, 8, 20, false, 15));        // k = nb
    add(InnerProductTopkCase(1, 10000, 512, 10, false, 101));
    add(InnerProductTopkCase(1000, 20000, 512, 10, false, 101));
    add(InnerProductTopkCase(100, 20000, 768, 1024, false, 101));
    add(InnerProductTopkCase(1, 2000, 8, 1025, false, 101));  // beyond CUDA's k
    add(RejectedCall("k_beyond_the_base", {Op::InnerProductTopk, {}, {1, 20, 8, 21}}, {"k = 21"}, [](Backend& b) {
      DeviceBuffer<float> q(b, 8), base(b, 160), scores(b, 21);
      DeviceBuffer<int64_t> ids(b, 21);
      b.inner_product_topk(q.get(), 1, base.get(), 20, 8, 21, ids.get(), scores.get());
    }));
    return t;
  }();
  return table;
}

}  // namespace backend_cases
