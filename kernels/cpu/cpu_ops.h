// gst-moe CPU kernels: the reference implementation of every engine operation.
//
// Contracts shared by all backends (the CUDA twins in kernels/cuda follow them exactly):
// row-major contiguous f32 buffers; a "Linear weight" is [out, in] as PyTorch stores it;
// functions never allocate unless they say so; sizes are int64_t element counts.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend.h"

namespace moe::kernels::cpu {

// y[m,n] = x[m,k] · w[n,k]^T (+ bias[n] when bias != nullptr). OpenBLAS sgemm.
void linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);

// General row-major sgemm: C = alpha · op(A) · op(B) + beta · C.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// y = (x - mean) / sqrt(var + eps) * gamma + beta per row (population variance, as PyTorch).
void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols, float eps);

// In place: exact GELU 0.5·x·(1 + erf(x/√2)) (PyTorch's default "gelu").
void gelu(float* x, int64_t n);
// In place: x · sigmoid(1.702 x) (OpenAI CLIP's "quick_gelu").
void quick_gelu(float* x, int64_t n);
// out[i] = silu(gate[i]) · up[i], silu(x) = x · sigmoid(x). out may alias gate or up.
void silu_mul(const float* gate, const float* up, float* out, int64_t n);

// In place, numerically stable softmax over each row.
void softmax_rows(float* x, int64_t rows, int64_t cols);

// In place: x / max(‖x‖₂, eps) per row (torch.nn.functional.normalize semantics: a row holding a
// NaN becomes all NaN).
void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps = 1e-12f);

// y += x (n elements).
void add_inplace(float* y, const float* x, int64_t n);

// Multi-head scaled dot-product attention over one sequence.
// q, k, v: [seq, heads·head_dim] with row stride `ld` (so one packed qkv buffer can be used);
// out: [seq, heads·head_dim] with row stride `ldo` (so a group of heads can be computed alone).
// scale = head_dim^-0.5. With `causal`, position i attends to positions ≤ i only. Heads are
// independent (a head's result does not depend on which others are computed with it). `scratch`
// holds at least seq·seq floats; one head's keys and values are copied into buffers allocated
// here.
void attention(const float* q, const float* k, const float* v, int64_t ld, float* out, int64_t ldo, int64_t seq,
               int64_t heads, int64_t head_dim, bool causal, float* scratch);

// Router: softmax over all `experts` logits of each row in fp32, then the `top_k` largest
// (descending; ties to the lower index). With `renormalize` the chosen weights are divided by
// their sum (Mixtral); without, they stay softmax probabilities (Qwen2-MoE default). A row whose
// logits are all -inf is routed as if they were equal (Backend::topk_softmax).
void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize, int32_t* ids,
                  float* weights);

// ---- weights in f32 / f16 / bf16 -----------------------------------------------------------

// Exact widening of IEEE half and bfloat16 bit patterns.
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t b);
// f32 to bfloat16 bit patterns, rounded to nearest even (as torch and oneDNN round); a NaN stays
// a (quiet) NaN, ±inf and values past bf16's largest finite round to ±inf.
void f32_to_bf16(const float* x, uint16_t* out, int64_t n);
// Rows [row0, row0 + rows) of a weight with `cols` columns, widened to f32 into out[rows, cols].
void weight_rows_to_f32(WeightRef w, int64_t cols, int64_t row0, int64_t rows, float* out);

// linear() with a weight stored as f32, f16 or bf16: f16/bf16 weights are widened to f32 in
// blocks of rows (a bounded scratch buffer, allocated here) and multiplied in f32.
void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k);

// ---- grouped MoE execution -------------------------------------------------------------------

// Counts the (row, j) slots of each expert (ids [rows, top_k] int32), prefix-sums the counts into
// offsets[experts + 1] and copies x[row] (cols wide) to x_sorted[slot]; within an expert, slots
// keep (row, j) order. slot_of[row·top_k + j] = slot. Throws moe::Error on an id outside
// [0, experts).
void moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts, const float* x, int64_t cols,
                 float* x_sorted, int32_t* slot_of, int64_t* offsets);

// y[m,n] = x[m,k] · w[n,k]^T: one projection of an expert in grouped_swiglu.
using ExpertProjection = std::function<void(const float* x, WeightRef w, float* y, int64_t m, int64_t n, int64_t k)>;

// For each expert e with offsets[e] < offsets[e+1]: out_sorted rows of e = w2(silu(w1 x)·w3 x)
// over x_sorted rows of e (x [n_e, d], w1/w3 [inter, d], w2 [d, inter]), each projection by
// `project` (null: linear above). Allocates its scratch.
void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                    const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter, float* out_sorted,
                    const ExpertProjection& project = nullptr);

// y[row] = Σ_j weights[row·top_k + j] · out_sorted[slot_of[row·top_k + j]], summed in j order.
void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows, int64_t top_k,
                   int64_t cols, float* y);

// ---- search --------------------------------------------------------------------------------

// For each query [nq, d] the k (≤ nb) best base vectors [nb, d] by inner product: scores
// descending, ties to the lower index. Scores come from tiled sgemm; allocates its scratch.
void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                        int64_t* ids, float* scores);

}  // namespace moe::kernels::cpu
