// Argument checks shared by every backend, so that each one rejects the same calls with the
// same message: "<backend>: <operation>: <reason>".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/error.h"

namespace moe::kernels::checks {

[[noreturn]] inline void fail(const std::string& backend, const char* op, const std::string& why) {
  throw Error(backend + ": " + op + ": " + why);
}

inline void non_negative(const std::string& backend, const char* op, std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes)
    if (s < 0) fail(backend, op, "negative size " + std::to_string(s));
}

inline void weight(const std::string& backend, const char* op, const WeightRef& w, const char* what) {
  if (!w.data) fail(backend, op, std::string(what) + " has no data");
  if (w.type != WeightType::F32 && w.type != WeightType::F16 && w.type != WeightType::BF16 && w.type != WeightType::Q4)
    fail(backend, op, std::string(what) + " has an unknown weight type");
}

inline void linear(const std::string& backend, const WeightRef& w, int64_t m, int64_t n, int64_t k) {
  non_negative(backend, "linear", {m, n, k});
  if (m > 0 && n > 0) weight(backend, "linear", w, "the weight");
}

// Returns the total number of rows.
inline int64_t attention(const std::string& backend, const std::vector<int64_t>& seq_lens, int64_t heads,
                         int64_t head_dim) {
  if (heads <= 0 || head_dim <= 0)
    fail(backend, "attention",
         "heads (" + std::to_string(heads) + ") and head_dim (" + std::to_string(head_dim) + ") must be positive");
  int64_t total = 0;
  for (int64_t len : seq_lens) {
    if (len < 0) fail(backend, "attention", "negative sequence length " + std::to_string(len));
    total += len;
  }
  return total;
}

inline void topk_softmax(const std::string& backend, int64_t rows, int64_t experts, int64_t top_k) {
  non_negative(backend, "topk_softmax", {rows});
  if (experts <= 0 || top_k <= 0 || top_k > experts)
    fail(backend, "topk_softmax",
         "top_k " + std::to_string(top_k) + " must be in [1, experts = " + std::to_string(experts) + "]");
}

inline void moe_permute(const std::string& backend, int64_t rows, int64_t top_k, int64_t experts, int64_t cols) {
  non_negative(backend, "moe_permute", {rows, cols});
  if (top_k <= 0 || experts <= 0)
    fail(backend, "moe_permute",
         "top_k (" + std::to_string(top_k) + ") and experts (" + std::to_string(experts) + ") must be positive");
  if (rows * top_k > INT32_MAX) fail(backend, "moe_permute", "more than 2^31 slots");
}

// Returns the total number of sorted rows.
inline int64_t grouped_swiglu(const std::string& backend, const std::vector<int64_t>& offsets,
                              const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter) {
  const char* op = "grouped_swiglu";
  non_negative(backend, op, {d, inter});
  if (offsets.size() != experts.size() + 1)
    fail(backend, op,
         std::to_string(offsets.size()) + " offsets for " + std::to_string(experts.size()) +
             " experts (want experts + 1)");
  if (offsets[0] != 0) fail(backend, op, "offsets[0] is " + std::to_string(offsets[0]) + ", not 0");
  for (size_t e = 0; e < experts.size(); ++e) {
    if (offsets[e + 1] < offsets[e]) fail(backend, op, "offsets decrease at expert " + std::to_string(e));
    if (offsets[e + 1] > offsets[e] && d > 0 && inter > 0) {
      const std::string name = "expert " + std::to_string(e);
      weight(backend, op, experts[e].w1, (name + " w1").c_str());
      weight(backend, op, experts[e].w3, (name + " w3").c_str());
      weight(backend, op, experts[e].w2, (name + " w2").c_str());
    }
  }
  return offsets.back();
}

inline void moe_unpermute(const std::string& backend, int64_t rows, int64_t top_k, int64_t cols) {
  non_negative(backend, "moe_unpermute", {rows, top_k, cols});
}

inline void inner_product_topk(const std::string& backend, int64_t nq, int64_t nb, int64_t d, int64_t k) {
  non_negative(backend, "inner_product_topk", {nq, nb, d, k});
  if (k > nb)
    fail(backend, "inner_product_topk",
         "k = " + std::to_string(k) + " is larger than the base (" + std::to_string(nb) + " vectors)");
}

}  // namespace moe::kernels::checks
