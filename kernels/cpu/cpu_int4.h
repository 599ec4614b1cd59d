// gst-moe CPU kernels for group-wise 4-bit weights (W4A16; kernels::Q4Weight, backend.h).
//
// Small batches read the packed codes directly: per group, the 16 values its codes stand for are
// computed once (scale · (q - z), rounded to the scale's type as the format defines them) into
// registers, each code is looked up there and multiplied into f32 accumulators, several input
// rows per decoded weight. Large batches dequantise blocks of weight rows to f32 and run the
// f32 GEMM: the CPU backend's (oneDNN, its thread pool also dequantising) when one is given, else
// OpenBLAS on the calling thread. Both give the same weights bit for bit as
// PackedInt4Weight::dequantize (moe/quantized_weights.h), so they differ from
// x · dequantised(w)ᵀ only in summation order. The instruction set is chosen once per process
// from the CPU (AVX-512F; AVX2 + FMA + F16C; else plain C++); without a pool every function runs
// on the calling thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace moe::kernels::cpu {

class Gemm;        // cpu_gemm.h
class ThreadPool;  // cpu_thread_pool.h

enum class Int4Isa : uint8_t { Scalar, Avx2, Avx512 };
// The best this CPU runs, and its name ("avx512", "avx2", "scalar").
Int4Isa int4_best_isa();
const char* int4_isa_name(Int4Isa isa);

// Batches of at most this many rows take the direct path; more dequantise and run the f32 GEMM.
// Measured on AVX-512 (Zen 4, one thread, [2048, 512] weights, group 128): the direct path is
// 1.5-3× faster up to 8 rows, even at 12, 1.1× slower at 16 and 1.5-3× slower from 24 rows on.
inline constexpr int64_t kInt4DirectMaxRows = 12;

// dst[n, k] = the weight's values in f32 (row-major, in order).
void dequantize_q4(const Q4Weight& w, int64_t n, int64_t k, float* dst, Int4Isa isa = int4_best_isa());

// y[m,n] = x[m,k] · w[n,k]ᵀ (+ bias[n] when bias != nullptr); k % w.group_size == 0,
// w.group_size % 8 == 0. Allocates its scratch (a copy of x, or a block of dequantised rows).
void linear_q4(const float* x, const Q4Weight& w, const float* bias, float* y, int64_t m, int64_t n, int64_t k,
               Int4Isa isa = int4_best_isa());
// The same for the CPU backend: beyond kInt4DirectMaxRows rows, blocks of weight rows are
// dequantised on `pool`'s threads and multiplied by `gemm` (which runs on `pool` too), so large
// batches cost the f32 GEMM plus the dequantisation, not OpenBLAS's repacking on one thread.
void linear_q4(const float* x, const Q4Weight& w, const float* bias, float* y, int64_t m, int64_t n, int64_t k,
               Gemm& gemm, ThreadPool& pool, Int4Isa isa = int4_best_isa());

}  // namespace moe::kernels::cpu
