// gst-moe compute backends behind one interface.
//
// A Backend owns a memory space (host RAM, or one CUDA device) and runs the engine's operations
// on buffers in that space, in the order they are queued (CUDA: one compute stream). A second
// queue (CUDA: a copy stream) carries asynchronous host-to-device copies, so expert weights can
// be preloaded while earlier batches compute.
//
// Contracts (shared by every backend; kernels/cpu/cpu_ops.h is the reference implementation):
// activations, biases, norms and outputs are row-major contiguous f32; weights are row-major
// [out, in] ("Linear weights") stored as f32, f16, bf16 or group-wise int4 (Q4Weight) and always
// accumulated in f32; sizes are element counts; pointers passed to operations point into this
// backend's memory unless stated.
//
// Activations against f16/bf16 weights (linear, grouped_swiglu): the CPU multiplies the f32
// activations by the widened weights, except in linear and grouped_swiglu on bf16 weights given
// to prepare_linear_weight where the CPU has AVX-512 BF16 or AMX: there it rounds x (and in
// grouped_swiglu the SwiGLU product) to bf16 as CUDA does (kernels/cpu/cpu_gemm.h). CUDA rounds
// the activations (x, and in grouped_swiglu also the SwiGLU product) to the weight's type first,
// as cuBLAS takes one input type: one more
// rounding per product, relative 2^-11 (f16) or 2^-8 (bf16), so the backends agree within about
// 1e-2 relative there, not 1e-4 (tests/backend_cases.h, test_compute.cpp). Q4 weights: the same
// bound; CUDA keeps the activations in f32 up to a few rows and beyond them dequantises the
// weight to its scale's type and rounds the activations to it. f16 ends at 65504:
// before an f16 GEMM, CUDA scales each activation row that exceeds it by a power of two that fits
// it and scales the output row back (exact), so large activations do not overflow to inf.
//
// Limits: a backend may run an operation only up to some sizes or for some weight types (CUDA:
// attention's head_dim, the router's expert count, the search's k); supports() tells beforehand.
//
// Threads: copy_from_host_async, event_complete, memory_info and supports may be called from any
// thread, concurrently with everything else; all other members from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe::kernels {

// Q4: group-wise 4-bit integers with f16/bf16 scales (W4A16; WeightRef::data points to a Q4Weight).
enum class WeightType : uint8_t { F32, F16, BF16, Q4 };
// Bytes per element; Q4 has none (half a byte plus its group's scale): moe::Error.
size_t weight_type_size(WeightType type);
const char* weight_type_name(WeightType type);

// A Linear weight [out, in] in backend memory.
struct WeightRef {
  const void* data = nullptr;
  WeightType type = WeightType::F32;
};

// A group-wise 4-bit Linear weight [out, in], in compressed-tensors' "pack-quantized" layout as
// published (docs/model-formats.md). A WeightRef of type Q4 points to one, in host memory valid
// for the call; the arrays it points to are in the backend's memory. Row r, column c:
//   q = bits 4·(c % 8) .. +3 of packed[r·in/8 + c/8], the code plus 8 (0..15);
//   z = 8 when zero_points is null (symmetric), else bits 4·(r % 8) .. +3 of
//       zero_points[(r/8)·groups + c/group_size], also plus 8;
//   w = float(q - z) · scale[r·groups + c/group_size], rounded to the scale's type (as the package
//       computes it, in that type), groups = in / group_size.
// The operations widen w to f32 exactly and accumulate in f32. in % group_size == 0 and
// group_size % 8 == 0.
struct Q4Weight {
  const int32_t* packed = nullptr;          // [out, in/8]
  const void* scales = nullptr;             // [out, groups], scale_type
  const int32_t* zero_points = nullptr;     // [ceil(out/8), groups] or null
  WeightType scale_type = WeightType::F16;  // F16 or BF16
  int32_t group_size = 0;
};

// One SwiGLU expert: w1 (gate) [inter, d], w3 (up) [inter, d], w2 (down) [d, inter].
struct ExpertWeights {
  WeightRef w1, w3, w2;
};

// Completion of asynchronous work. Backends define what is inside.
class Event {
 public:
  virtual ~Event() = default;
};

struct MemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

// The operations of a Backend, for supports().
enum class Op : uint8_t {
  Linear,
  LayerNorm,
  Gelu,
  QuickGelu,
  SiluMul,
  Add,
  Attention,
  L2NormalizeRows,
  TopkSoftmax,
  MoePermute,
  GroupedSwiglu,
  MoeUnpermute,
  InnerProductTopk,  // last: kOpCount counts up to it
};
inline constexpr int kOpCount = static_cast<int>(Op::InnerProductTopk) + 1;
// The name errors give the operation ("linear", "topk_softmax"); "unknown" outside the enum.
const char* op_name(Op op);

// One call of an operation as supports() sees it: its weight types and sizes, not its data.
// `sizes` are its size arguments in the order of its signature: linear {m, n, k}; layer_norm and
// l2_normalize_rows {rows, cols}; gelu, quick_gelu, silu_mul, add {n}; attention {rows (the sum
// of seq_lens), the longest sequence, heads, head_dim}; topk_softmax {rows, experts, top_k};
// moe_permute {rows, top_k, experts, cols}; grouped_swiglu {rows (offsets.back()), experts
// (experts.size()), d, inter}; moe_unpermute {rows, top_k, cols}; inner_product_topk {nq, nb, d, k}.
// `weight_types`: linear the weight's type; grouped_swiglu those of the experts' weights (any
// order, repeats allowed, none when no expert has rows); empty for every other operation.
struct OpDesc {
  Op op = Op::Linear;
  std::vector<WeightType> weight_types;
  std::vector<int64_t> sizes;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  virtual bool is_host_memory() const = 0;
  virtual MemoryInfo memory_info() const = 0;

  // ---- capabilities ------------------------------------------------------------------------
  // Whether this backend runs `op` with those weight types and sizes. When not, `why` (when
  // given) receives the reason as the operation's moe::Error words it ("head_dim 129 is larger
  // than the CUDA kernel's 128"), and the call throws that error unless it has nothing to compute.
  // Decided by the operation, its weight types and sizes alone, never by data or free memory:
  // cheap (no device call), the same answer every time. true promises no success: invalid
  // arguments (op_checks.h) and running out of memory still throw, as do sizes beyond CUDA's
  // 32-bit launch and cuBLAS ranges (2^31 - 1), which are not reported here. A desc whose sizes
  // or weight types do not fit its operation is a moe::Error.
  bool supports(const OpDesc& op, std::string* why = nullptr) const;

  // ---- memory ----------------------------------------------------------------------------
  // allocate() throws moe::Error naming the backend and the size when out of memory.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
  // Host memory the backend copies from asynchronously (CUDA: page-locked).
  virtual void* allocate_host_staging(size_t bytes) = 0;
  virtual void free_host_staging(void* ptr) = 0;
  // True when staging memory that `owner` allocated may be the source of this backend's
  // copy_from_host_async, as fast as its own (one copy of the experts in host memory serves
  // every device): CUDA page-locked staging is portable across the devices of a process; any
  // host memory serves a CPU backend. `owner` must outlive the copies.
  virtual bool shares_staging_with(const Backend& owner) const = 0;
  // Queued with the operations; `src` must stay valid until the next synchronize().
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  // Waits for the queued operations, then copies.
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Device-to-device copy within this backend, queued with the operations.
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  // Copies into `peer`'s memory (`peer` may be this backend; CUDA: another device of this
  // process, over NVLink/PCIe peer access where the devices allow it, else staged by the driver).
  // Ordered after the operations queued so far on both backends; operations queued later on
  // either start after the copy completed; the host does not wait (CPU: a plain memcpy). Throws
  // moe::Error when the two backends cannot exchange memory (a CPU and a CUDA backend). Like
  // the operations, called from the one thread that drives both backends.
  virtual void copy_to_peer(Backend& peer, void* dst, const void* src, size_t bytes) = 0;
  // On the copy queue, concurrently with operations; the event completes with the copy. `src`
  // must stay valid until then (and be staging memory for the copy to be truly asynchronous).
  virtual std::shared_ptr<Event> copy_from_host_async(void* dst, const void* src, size_t bytes) = 0;
  // Events are only valid with the backend that made them (another backend's event: moe::Error).
  virtual bool event_complete(const Event& event) = 0;
  // Operations queued after this call start after `event` completed (CUDA: the compute stream
  // waits, the host does not; CPU: the host blocks until the copy is done).
  virtual void wait_event(const Event& event) = 0;
  // Waits until everything queued so far on the operation queue has finished: operations,
  // copy_from_host, copy_on_device. Copies on the copy queue are awaited through their events
  // only (wait_event, then synchronize, covers both).
  virtual void synchronize() = 0;

  // ---- operations ---------------------------------------------------------------------------
  // y[m,n] = x[m,k] · w[n,k]ᵀ (+ bias[n] when bias != nullptr).
  virtual void linear(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) = 0;
  // Optional for callers, for Linear weights that stay unchanged while loaded: after
  // prepare_linear_weight, the backend may keep its own copy of w [n, k] in the layout its GEMM
  // reads fastest (CPU: packed for oneDNN's matmul) and use it in linear calls, and in
  // grouped_swiglu for an expert's w1, w3 or w2, with the same w.data, n and k. Counted: each
  // prepare is matched by one release with the same arguments, before the weight's memory is
  // freed or written. linear and grouped_swiglu compute the same without them (but for bf16
  // rounding, above). Default: nothing is kept.
  virtual void prepare_linear_weight(WeightRef, int64_t /*n*/, int64_t /*k*/) {}
  virtual void release_linear_weight(WeightRef, int64_t /*n*/, int64_t /*k*/) {}
  // Per row: (x - mean) / sqrt(var + eps) · gamma + beta (population variance). y may alias x.
  virtual void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows, int64_t cols,
                          float eps) = 0;
  // In place: exact GELU 0.5·x·(1 + erf(x/√2)).
  virtual void gelu(float* x, int64_t n) = 0;
  // In place: x · sigmoid(1.702·x).
  virtual void quick_gelu(float* x, int64_t n) = 0;
  // out = silu(gate) · up; out may alias gate or up.
  virtual void silu_mul(const float* gate, const float* up, float* out, int64_t n) = 0;
  // y += x.
  virtual void add(float* y, const float* x, int64_t n) = 0;
  // Multi-head attention over a packed batch of sequences (lengths on the host, rows back to
  // back): qkv [T, 3·heads·head_dim] holds q | k | v per row; out [T, heads·head_dim].
  // scale = head_dim^-0.5; with `causal` a row attends to rows at or before it in its sequence.
  // CUDA: head_dim ≤ 128 (moe::Error otherwise); meant for short sequences (≤ a few hundred).
  virtual void attention(const float* qkv, float* out, const std::vector<int64_t>& seq_lens, int64_t heads,
                         int64_t head_dim, bool causal) = 0;
  // In place: x / max(‖x‖₂, eps) per row. A row holding a NaN becomes all NaN (its norm is NaN,
  // which the eps clamp keeps), as torch's normalize does.
  virtual void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) = 0;

  // Router: softmax over `experts` logits per row (f32), the top_k largest (descending, ties to
  // the lower index) into ids [rows, top_k] (int32) and weights [rows, top_k], divided by their
  // sum when `renormalize`. A row whose logits are all -inf (a router that masks every expert) is
  // routed as if they were equal: ids 0..top_k-1, weights 1/experts (1/top_k renormalised).
  // Logits must not be NaN or +inf: such a row's ids and weights are unspecified (CUDA: possibly
  // an id outside [0, experts), which moe_permute then rejects). CUDA: experts ≤ 12288.
  virtual void topk_softmax(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize,
                            int32_t* ids, float* weights) = 0;
  // Groups rows per expert: counts the (row, j) slots of each expert, prefix-sums them and
  // copies row x[row] to x_sorted[slot] so that expert e's slots are rows
  // [offsets[e], offsets[e+1]) of x_sorted (within an expert, slots keep (row, j) order).
  // slot_of[row·top_k + j] receives the slot of (row, j). Returns offsets (experts + 1 entries)
  // on the host: the grouped GEMM needs the sizes (CUDA: waits for the compute stream). Id -1
  // marks an unused slot (a row routed to fewer than top_k experts): it gets no row in x_sorted
  // and slot_of -1. Any other id outside [0, experts) is a moe::Error.
  virtual std::vector<int64_t> moe_permute(const int32_t* ids, int64_t rows, int64_t top_k, int64_t experts,
                                           const float* x, int64_t cols, float* x_sorted, int32_t* slot_of) = 0;
  // For every expert e with rows: out_sorted[offsets[e]:offsets[e+1]] = w2(silu(w1 x) · w3 x) over
  // x_sorted's rows of that expert (one grouped GEMM per projection). `experts[e]` may be empty
  // (null data) for experts without rows.
  virtual void grouped_swiglu(const float* x_sorted, const std::vector<int64_t>& offsets,
                              const std::vector<ExpertWeights>& experts, int64_t d, int64_t inter,
                              float* out_sorted) = 0;
  // y[row] = Σ_j weights[row·top_k + j] · out_sorted[slot_of[row·top_k + j]] over the row's used
  // slots (slot_of -1 is skipped, whatever its weight); a row without one gets zeros (overwrites y).
  virtual void moe_unpermute(const float* out_sorted, const int32_t* slot_of, const float* weights, int64_t rows,
                             int64_t top_k, int64_t cols, float* y) = 0;

  // Exact inner-product search: for each of nq queries [nq, d] the k best of nb base vectors
  // [nb, d] (k ≤ nb), scores descending, ties to the lower index; ids [nq, k] int64, scores f32.
  // CUDA: k ≤ 1024 (moe::Error otherwise).
  virtual void inner_product_topk(const float* queries, int64_t nq, const float* base, int64_t nb, int64_t d, int64_t k,
                                  int64_t* ids, float* scores) = 0;

 protected:
  // supports() for a desc that fits its operation: "" when this backend runs it, else why not.
  // Default: "" (no limits: the CPU backend, the reference, runs every operation at every size).
  virtual std::string why_unsupported(const OpDesc& op) const;
};

struct CpuBackendOptions {
  // Run copy_from_host_async on a worker thread (a host "device" with a real copy queue), so
  // the expert cache's asynchronous paths run, and are tested, without a GPU.
  bool async_copies = false;
  // Intra-op threads (linear splits its columns over them, layer norm, the element-wise operations,
  // attention and l2_normalize_rows their rows; they block, not spin, between calls).
  // 0: the cores this process may run on (sched_getaffinity).
  int threads = 0;
};
std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& options = {});

// Number of usable CUDA devices; 0 when built without CUDA or when no driver/device is present.
// `why`, when given, receives the reason for 0 in words.
int cuda_device_count(std::string* why = nullptr);
// Whether device `device` can run this build: it exists, a context can be created on it, and the
// build has code for its compute capability (e.g. a build for sm_80/sm_90 with compute_90 PTX has
// none for sm_75). `why`, when given, receives the reason for false in words (without the device
// name). Creates the device's context; leaves the calling thread's current device as it was.
bool cuda_device_usable(int device, std::string* why = nullptr);
// A backend on CUDA device `device`. Throws moe::Error saying why when that is impossible
// (built with -Dcuda=disabled, no driver, no such device, cuda_device_usable false). The backend
// reads MOE_CUDA_SYNC once, here: when set (not "0"), every operation waits for its kernels, so
// that a kernel fault is reported by the operation, and the test, that caused it.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace moe::kernels
