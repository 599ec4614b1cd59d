// The CPU backend's linear: oneDNN's matmul (JIT kernels chosen by the CPU's ISA, not by its
// model name; docs/benchmarks.md, "Recommendation for Deliver 1"), with N split into column
// blocks over the backend's ThreadPool, each block a one-thread primitive. Weights given to
// prepare() are reordered once into the blocked layout the primitive asks for; other f32 weights
// are read as they are. Where oneDNN cannot create a primitive, OpenBLAS runs instead (logged
// once); weights of other types run cpu::linear. The first prepare or f32 linear of the process
// logs what runs (the line is quoted at moe::ComputeOptions::threads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend.h"

namespace moe::kernels::cpu {

class ThreadPool;

class Gemm {
 public:
  explicit Gemm(ThreadPool& pool);  // `pool` outlives this
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[m,n] = x[m,k] · w[n,k]ᵀ (+ bias[n]). Callable from several threads at once.
  void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);
  // Backend::prepare_linear_weight / release_linear_weight: a packed copy of an f32 weight for
  // (w.data, n, k), counted (each prepare is matched by one release); no-ops for other types.
  void prepare(WeightRef w, int64_t n, int64_t k);
  void release(WeightRef w, int64_t n, int64_t k);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::kernels::cpu
