// Shared helpers for the GoogleTest suites: fixture paths and error measures.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "moe/safetensors.h"
#include "moe/tensor.h"
#include "moe_build_config.h"

namespace moe::test {

inline std::string source_path(const std::string& rel) { return std::string(MOE_SOURCE_DIR) + "/" + rel; }
inline std::string fixture_path(const std::string& rel) { return source_path("tests/fixtures/" + rel); }

// max |a - b| / max(max |b|, floor): one relative error for a whole tensor, robust to entries
// near zero. Shapes must match.
inline double max_rel_error(const Tensor& a, const Tensor& b, double floor = 1e-6) {
  EXPECT_EQ(a.shape(), b.shape()) << a.describe() << " vs " << b.describe();
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor fa = a.to_f32(), fb = b.to_f32();
  double diff = 0.0, ref = floor;
  for (int64_t i = 0; i < fa.numel(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(fa.data<float>()[i]) - fb.data<float>()[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(fb.data<float>()[i])));
  }
  return diff / ref;
}

inline double max_abs_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape()) << a.describe() << " vs " << b.describe();
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor fa = a.to_f32(), fb = b.to_f32();
  double diff = 0.0;
  for (int64_t i = 0; i < fa.numel(); ++i)
    diff = std::max(diff, std::fabs(static_cast<double>(fa.data<float>()[i]) - fb.data<float>()[i]));
  return diff;
}

// Asserts that calling `fn` throws moe::Error whose message contains every listed fragment.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
  }
}

}  // namespace moe::test
