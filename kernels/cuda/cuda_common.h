// Internal to the CUDA backend: the per-backend context every launcher receives, error checks
// that name the backend, the operation and the failing call, small uploads, and the scratch arena.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/error.h"

namespace moe::kernels::cuda {

struct Ctx {
  std::string name;  // "cuda:N"
  int device = 0;
  cudaStream_t stream = nullptr;  // the compute stream: every operation runs here, in order
  cublasHandle_t blas = nullptr;  // bound to `stream`
  // Scratch: one device buffer reused by every operation (stream order makes reuse safe).
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  // MOE_CUDA_SYNC=1: synchronise after every operation so a failing kernel is named exactly.
  bool sync_each_op = false;
  // Whether cublasGemmGroupedBatchedEx accepts f16/bf16 inputs with f32 output (-1: not tried).
  int grouped_half_f32_out = -1;
  // The q4 arena: q4 weights dequantised for cuBLAS, kept apart from `scratch` because the
  // operations they feed carve scratch themselves (grouped_swiglu_q4).
  void* q4_arena = nullptr;
  size_t q4_arena_bytes = 0;
};

[[noreturn]] void fail(const Ctx& ctx, const char* op, const std::string& why);
const char* cublas_status_name(cublasStatus_t status);
void check(const Ctx& ctx, const char* op, cudaError_t err, const char* call);
void check(const Ctx& ctx, const char* op, cublasStatus_t status, const char* call);
// After a kernel launch: the launch error, and with sync_each_op the execution error.
void check_launch(const Ctx& ctx, const char* op, const char* kernel);

// Copies `bytes` of host memory to `dst` on the compute stream. The bytes travel as kernel
// arguments (2 KiB per launch), so the host neither waits for the stream, as a copy from pageable
// memory may, nor has to keep a page-locked source alive until the copy ran. For small arrays
// (GEMM pointer arrays, sequence offsets).
void upload(Ctx& ctx, const char* op, void* dst, const void* src, size_t bytes);

// A device buffer of at least `bytes` (256-byte aligned), valid until the next call. Growing it
// waits for the compute stream first, so work still using the old buffer is finished.
char* scratch(Ctx& ctx, size_t bytes, const char* op);
// The same for the q4 arena.
char* q4_arena(Ctx& ctx, size_t bytes, const char* op);

// Lays out several arrays in one scratch buffer: call take() once with base == nullptr to
// measure (bytes()), then again over the real buffer with the same sequence.
class Carver {
 public:
  explicit Carver(char* base = nullptr) : base_(base) {}
  template <typename T>
  T* take(size_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return p;
  }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// Grid size for a grid-stride loop over n elements.
inline unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// ---- kernel limits ------------------------------------------------------------------------
// Why a kernel cannot run these sizes, or "" when it can: the launchers throw the reason and the
// backend's supports() reports it, so the two always agree. Defined next to their kernels.
std::string attention_limit(int64_t head_dim);    // cuda_attention.cu
std::string topk_softmax_limit(int64_t experts);  // cuda_moe.cu
std::string inner_product_topk_limit(int64_t k);  // cuda_search.cu

// ---- launchers, by topic (each file's header comment describes its kernels) ----------------

// cuda_elementwise.cu
void gelu(Ctx& ctx, float* x, int64_t n);
void quick_gelu(Ctx& ctx, float* x, int64_t n);
void silu_mul(Ctx& ctx, const float* gate, const float* up, float* out, int64_t n);
// out = silu(gate · s) · (up · s) with s = row_scale[row] over rows of `cols`; out may alias gate or up.
void silu_mul_scaled_rows(Ctx& ctx, const char* op, const float* gate, const float* up, const float* row_scale,
                          int64_t rows, int64_t cols, float* out);
void add(Ctx& ctx, float* y, const float* x, int64_t n);
// y[r, c] = y[r, c] · row_scale[r] + bias[c] over y [m, n]; either may be null (then skipped).
void scale_rows_add_bias(Ctx& ctx, const char* op, float* y, const float* row_scale, const float* bias, int64_t m,
                         int64_t n);
// out[i] = x[i] rounded to `type` (F16 or BF16), round to nearest even. `op` names the caller.
void cast_from_f32(Ctx& ctx, const char* op, const float* x, void* out, WeightType type, int64_t n);
// Activations for an f16 GEMM, whose inputs end at 65504: each row of x [rows, cols] times the
// largest power of two s ≤ 1 that brings it within that range (s = 1 for most rows, and for rows
// holding inf/NaN), into `out` as `type` (F32, may alias x; or F16); unscale[row] = 1/s, by which
// the GEMM's output rows are scaled back (exactly: powers of two).
void fit_rows_to_f16(Ctx& ctx, const char* op, const float* x, int64_t rows, int64_t cols, void* out, WeightType type,
                     float* unscale);
void layer_norm(Ctx& ctx, const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                float eps);
void l2_normalize_rows(Ctx& ctx, float* x, int64_t rows, int64_t cols, float eps);

// cuda_attention.cu
void attention(Ctx& ctx, const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t total_rows,
               int64_t heads, int64_t head_dim, bool causal);

// cuda_gemm.cu
// y[m,n] = x[m,k] · w[n,k]ᵀ (+ bias).
void linear(Ctx& ctx, const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);
// One problem of a grouped GEMM in row-major terms: c[rows, cols] = b[rows, inner] · a[cols, inner]ᵀ
// with leading dimensions lda, ldb, ldc; a is the weight (f32/f16/bf16), b the activation in the
// weight's type, c f32.
struct GemmProblem {
  const void* a;
  const void* b;
  float* c;
  int64_t rows, cols, inner, lda, ldb, ldc;
};
// All `problems` share the weight type `type`. dev_ptrs: device memory for 3 · problems.size()
// pointers (filled here, on the stream).
void grouped_gemm(Ctx& ctx, const char* op, WeightType type, const std::vector<GemmProblem>& problems, void** dev_ptrs);

// cuda_moe.cu
void topk_softmax(Ctx& ctx, const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize,
                  int32_t* ids, float* weights);
std::vector<int64_t> moe_permute(Ctx& ctx, const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts,
                                 const float* x, int64_t cols, float* x_sorted, int32_t* slot_of);
void grouped_swiglu(Ctx& ctx, const float* x_sorted, const std::vector<int64_t>& offsets,
                    const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted);
void moe_unpermute(Ctx& ctx, const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows,
                   int64_t top_k, int64_t cols, float* y);

// cuda_int4.cu (kernels::Q4Weight: the struct on the host, its arrays on this device)
// Products with at most this many activation rows run the fused dequantise-multiply kernel; more
// dequantise the weight to its scale's type and run cuBLAS. Provisional, not measured: the fused
// kernel's FMA work grows with the rows while the other path pays a fixed 16-bit write and read
// of the weight; the crossover is for the first GPU run to measure (docs/benchmarks.md).
constexpr int64_t kQ4FusedMaxRows = 16;
// Throws, as the CPU does, unless `w` is a q4 weight of k columns the contract allows.
void check_q4(const Ctx& ctx, const char* op, const Q4Weight& w, int64_t k);
// One product of a fused launch: y[i, r] = Σ_c x[i, c] · w[r, c] (+ bias[r] when not null) for
// i < rows (1..kQ4FusedMaxRows); x [rows, k] and y [rows, n] row-major.
struct Q4FusedProblem {
  const Q4Weight* w;
  const float* x;
  float* y;
  const float* bias;
  int64_t rows;
};
// Device bytes q4_fused needs for `problems` products' arguments.
size_t q4_fused_arg_bytes(size_t problems);
// Every problem has the same n (weight rows) and k; activations stay f32. dev_args: device
// memory of q4_fused_arg_bytes(problems.size()) (filled here, on the stream).
void q4_fused(Ctx& ctx, const char* op, const std::vector<Q4FusedProblem>& problems, int64_t n, int64_t k,
              void* dev_args);
// dst [n, k] (16-byte aligned) = w's values in w.scale_type.
void q4_dequantize(Ctx& ctx, const char* op, const Q4Weight& w, int64_t n, int64_t k, void* dst);
// grouped_swiglu for experts of which some weights are q4 (any mix of types).
void grouped_swiglu_q4(Ctx& ctx, const float* x_sorted, const std::vector<int64_t>& offsets,
                       const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted);

// cuda_search.cu
void inner_product_topk(Ctx& ctx, const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                        int64_t* ids, float* scores);
constexpr int64_t kMaxSearchK = 1024;

}  // namespace moe::kernels::cuda
