// GEMMs through cuBLAS, always with CUBLAS_COMPUTE_32F (fp32 accumulation, no TF32) and f32
// output. Row-major y[m,n] = x[m,k] · w[n,k]ᵀ is column-major yᵀ = op_T(w) · xᵀ: cuBLAS sees
// A = w (k × n, lda k, transposed), B = x (k × m, ldb k), C = y (n × m, ldc n).
// f16/bf16 weights: the activations are rounded to the weight's type in scratch (cuBLAS needs
// A and B of one type), products are accumulated in fp32. f16 activations are first scaled per
// row by a power of two where they exceed f16's range (fit_rows_to_f16), and the output rows
// scaled back.
// q4 weights (cuda_int4.cu): up to kQ4FusedMaxRows rows run the fused kernel on the f32
// activations; more are dequantised to their scale's type in scratch and run as f16/bf16 weights.
#include <cublas_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda_common.h"

namespace moe::kernels::cuda {

namespace {

cudaDataType_t data_type(WeightType type) {
  switch (type) {
    case WeightType::F32:
      return CUDA_R_32F;
    case WeightType::F16:
      return CUDA_R_16F;
    case WeightType::BF16:
      return CUDA_R_16BF;
    case WeightType::Q4:
      break;  // never a GEMM's type: dequantised to its scale's type first
  }
  return CUDA_R_32F;
}

void check_int(const Ctx& ctx, const char* op, int64_t v, const char* what) {
  if (v > INT32_MAX) fail(ctx, op, std::string(what) + " = " + std::to_string(v) + " is beyond cuBLAS's int range");
}

// One problem with cublasGemmEx (host pointers).
void gemm_one(Ctx& ctx, const char* op, WeightType type, const GemmProblem& p) {
  const float alpha = 1.0f, beta = 0.0f;
  const cudaDataType_t t = data_type(type);
  check(
      ctx, op,
      cublasGemmEx(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p.cols), static_cast<int>(p.rows),
                   static_cast<int>(p.inner), &alpha, p.a, t, static_cast<int>(p.lda), p.b, t, static_cast<int>(p.ldb),
                   &beta, p.c, CUDA_R_32F, static_cast<int>(p.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace

void linear(Ctx& ctx, const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  if (m == 0 || n == 0) return;
  float* unscale = nullptr;  // f16 weights: per row, what the GEMM's output is scaled back by
  for (auto [v, what] : {std::pair<int64_t, const char*>{m, "m"}, {n, "n"}, {k, "k"}})
    check_int(ctx, "linear", v, what);
  const Q4Weight* q4 = w.type == WeightType::Q4 ? static_cast<const Q4Weight*>(w.data) : nullptr;
  if (q4) {
    check_q4(ctx, "linear", *q4, k);
    if (m <= kQ4FusedMaxRows) {
      q4_fused(ctx, "linear", {{q4, x, y, bias, m}}, n, k, scratch(ctx, q4_fused_arg_bytes(1), "linear"));
      if (ctx.sync_each_op) check(ctx, "linear", cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");
      return;
    }
  }
  const WeightType type = q4 ? q4->scale_type : w.type;  // the GEMM's
  if (k == 0) {
    check(ctx, "linear", cudaMemsetAsync(y, 0, static_cast<size_t>(m * n) * sizeof(float), ctx.stream),
          "cudaMemsetAsync");
  } else {
    const void* a = w.data;
    const void* b = x;
    if (type != WeightType::F32) {
      // Scratch: x in the weight's type, then (f16) the rows' unscale factors, then (q4) the
      // dequantised weight.
      void *xc, *wc;
      const auto layout = [&](Carver& c) {
        xc = c.take<uint16_t>(static_cast<size_t>(m * k));
        unscale = type == WeightType::F16 ? c.take<float>(static_cast<size_t>(m)) : nullptr;
        wc = q4 ? c.take<uint16_t>(static_cast<size_t>(n * k)) : nullptr;
      };
      Carver measure;
      layout(measure);
      Carver carve(scratch(ctx, measure.bytes(), "linear"));
      layout(carve);
      if (type == WeightType::F16)
        fit_rows_to_f16(ctx, "linear", x, m, k, xc, WeightType::F16, unscale);
      else
        cast_from_f32(ctx, "linear", x, xc, type, m * k);
      b = xc;
      if (q4) {
        q4_dequantize(ctx, "linear", *q4, n, k, wc);
        a = wc;
      }
    }
    gemm_one(ctx, "linear", type, GemmProblem{a, b, y, m, n, k, k, k, n});
  }
  scale_rows_add_bias(ctx, "linear", y, unscale, bias, m, n);
  if (ctx.sync_each_op) check(ctx, "linear", cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");
}

void grouped_gemm(Ctx& ctx, const char* op, WeightType type, const std::vector<GemmProblem>& problems,
                  void** dev_ptrs) {
  if (problems.empty()) return;
  for (const GemmProblem& p : problems) {
    check_int(ctx, op, p.rows, "rows");
    check_int(ctx, op, p.cols, "cols");
    check_int(ctx, op, p.inner, "inner");
    check_int(ctx, op, std::max({p.lda, p.ldb, p.ldc}), "leading dimension");
  }
  const bool half = type != WeightType::F32;
  // The grouped call reads its matrix pointers from device memory, so cuBLAS cannot check their
  // alignment and may pick vectorised kernels; rows at odd offsets (d or inter not a multiple of
  // 4 floats / 8 halves) go through cublasGemmEx, which sees the pointers.
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool all_aligned = std::all_of(problems.begin(), problems.end(), [&](const GemmProblem& p) {
    return aligned(p.a) && aligned(p.b) && aligned(p.c);
  });
#if CUBLAS_VER_MAJOR > 12 || (CUBLAS_VER_MAJOR == 12 && CUBLAS_VER_MINOR >= 5)
  if (all_aligned && (!half || ctx.grouped_half_f32_out != 0)) {
    // Every problem is a group of one (experts have different row counts). Host arrays for the
    // shapes and scalars; device arrays for the matrix pointers.
    const size_t g = problems.size();
    std::vector<cublasOperation_t> ta(g, CUBLAS_OP_T), tb(g, CUBLAS_OP_N);
    std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), group_size(g, 1);
    std::vector<float> alpha(g, 1.0f), beta(g, 0.0f);
    std::vector<void*> ptrs(3 * g);
    for (size_t i = 0; i < g; ++i) {
      const GemmProblem& p = problems[i];
      m[i] = static_cast<int>(p.cols);
      n[i] = static_cast<int>(p.rows);
      k[i] = static_cast<int>(p.inner);
      lda[i] = static_cast<int>(p.lda);
      ldb[i] = static_cast<int>(p.ldb);
      ldc[i] = static_cast<int>(p.ldc);
      ptrs[i] = const_cast<void*>(p.a);
      ptrs[g + i] = const_cast<void*>(p.b);
      ptrs[2 * g + i] = p.c;
    }
    upload(ctx, op, dev_ptrs, ptrs.data(), ptrs.size() * sizeof(void*));
    const cudaDataType_t t = data_type(type);
    const cublasStatus_t status =
        cublasGemmGroupedBatchedEx(ctx.blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), dev_ptrs,
                                   t, lda.data(), dev_ptrs + g, t, ldb.data(), beta.data(), dev_ptrs + 2 * g,
                                   CUDA_R_32F, ldc.data(), static_cast<int>(g), group_size.data(), CUBLAS_COMPUTE_32F);
    // The type table of cublasGemmGroupedBatchedEx may not list f16/bf16 inputs with f32
    // output; then (once per backend) fall back to one cublasGemmEx per problem.
    if (half && ctx.grouped_half_f32_out == -1 &&
        (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
      ctx.grouped_half_f32_out = 0;
    } else {
      check(ctx, op, status, "cublasGemmGroupedBatchedEx");
      if (half) ctx.grouped_half_f32_out = 1;
      return;
    }
  }
#else
  (void)dev_ptrs;
  (void)half;
  (void)all_aligned;
#endif
  for (const GemmProblem& p : problems) gemm_one(ctx, op, type, p);
}

}  // namespace moe::kernels::cuda
