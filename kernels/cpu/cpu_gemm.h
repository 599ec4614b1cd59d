// The CPU backend's linear: oneDNN's matmul (JIT kernels chosen by the CPU's ISA, not by its
// model name; docs/benchmarks.md, "Recommendation for Deliver 1"), with N split into column
// blocks over the backend's ThreadPool, each block a one-thread primitive. Weights given to
// prepare() are reordered once into the blocked layout the primitive asks for; other f32 weights
// are read as they are. Where oneDNN cannot create a primitive, OpenBLAS runs instead (logged
// once). The first prepare or linear of the process logs what runs (the line is quoted at
// moe::ComputeOptions::threads).
//
// f16/bf16 weights: prepared bf16 weights are packed as bf16 where the CPU multiplies bf16
// natively (bf16_native()): each linear rounds x to bf16 (nearest even) and the matmul sums the
// products in f32, so the result differs from f32 math on the same weights by x's rounding,
// at most 2^-8 relative per product (docs/architecture.md, "Precision"). Other prepared f16/bf16
// weights are widened to f32 and packed as f32 (exactly the f32 math on the rounded weights).
// Each of those choices is logged once per process, at its first prepare (g_message where it is
// not the bf16 speed path). Unprepared f16/bf16 weights run cpu::linear (widened per call), as do
// Q4 weights.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend.h"

namespace moe::kernels::cpu {

class ThreadPool;

// Whether bf16 weights are multiplied as bf16 here: oneDNN's effective ISA (this CPU's, capped by
// oneDNN's ONEDNN_MAX_CPU_ISA) has AVX-512 BF16 or AMX; without them oneDNN would emulate bf16
// products, slower than f32.
bool bf16_native();

class Gemm {
 public:
  explicit Gemm(ThreadPool& pool);  // `pool` outlives this
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[m,n] = x[m,k] · w[n,k]ᵀ (+ bias[n]). Callable from several threads at once.
  void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);
  // linear() on the packed copy of a weight given to prepare(): false, with nothing computed,
  // when (w.data, n, k) is not prepared (or oneDNN cannot run this M on it; logged once).
  bool linear_prepared(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);
  // Backend::prepare_linear_weight / release_linear_weight: a packed copy of an f32, f16 or bf16
  // weight for (w.data, n, k), counted (each prepare is matched by one release); no-ops for Q4.
  void prepare(WeightRef w, int64_t n, int64_t k);
  void release(WeightRef w, int64_t n, int64_t k);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::kernels::cpu
