// gst-moe: where the engine computes (device) and how its weights are stored (precision).
//
// ClipModel, MoeLayer and MoeAdapter run every operation through a kernels::Backend: "cpu" (the
// CPU backend), "cuda:N" (the CUDA backend on device N) or "auto" (cuda:0 when it is usable:
// present, a context can be created on it and this build has code for its compute capability
// (kernels::cuda_device_usable); else cpu). Their API stays host Tensors in and out.
//
// Threads: backends are shared per process and device. A CUDA backend runs one call at a time
// (backend.h), so every model on it holds the backend's mutex (backend_mutex) for the whole of
// each call; calls on the CPU backend are not serialised (its operations are stateless).
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "backend.h"

namespace moe {

struct ComputeOptions {
  // "cpu", "cuda:N" ("cuda" = "cuda:0"), or "auto".
  std::string device = "cpu";
  // How Linear weights are stored (f32, f16 or bf16). Activations, norms, biases, embeddings and
  // every accumulation stay f32; the MoE router and shared-expert gate stay f32 (see
  // docs/architecture.md, "Precision"). On the CPU, bf16 is the speed path where the CPU has
  // AVX-512 BF16 or AMX (weights packed as bf16, each Linear's input rounded to bf16); elsewhere,
  // and for f16, the weights are widened to f32 at load, which the first such load logs once.
  kernels::WeightType precision = kernels::WeightType::F32;
  // Intra-op threads of the CPU backend (its GEMMs and element-wise work split over them); 0: the
  // cores this process may run on (sched_getaffinity). The CPU backend is shared by the process,
  // so the count is fixed by the first open while it is held; a later open asking another count
  // is logged and keeps it. The first time the CPU backend packs or multiplies a weight, the process logs
  // (g_info, log domain "moe") which GEMM kernels run and on how many threads, e.g.
  //   cpu: linear: oneDNN 2.6.3 matmul brg:avx512_core (CPU ISA avx512_core_bf16), f32 weights
  //   prepared at load are packed for it, N split over 2 threads
  int threads = 0;
};

// "f32"/"fp32", "f16"/"fp16", "bf16" (any case). Throws moe::Error naming the value otherwise.
kernels::WeightType parse_precision(const std::string& name);

// The device `device` means now ("cpu" or "cuda:N"), without opening a backend or logging (a CUDA
// device's context is created to check that it is usable).
// `reason`, when given, receives why (e.g. "no usable CUDA device: <why>"). Throws moe::Error
// naming the device and the reason when it is malformed or names a CUDA device that is not usable.
std::string resolve_device(const std::string& device, std::string* reason = nullptr);

// The backend for `device` ("cpu", "cuda:N", "auto"), shared with every other holder of a backend
// for the same device in this process. Logs one line (GLib, log domain "moe"; g_message when
// "auto" chose, g_info otherwise) saying which backend runs and why, e.g.
//   device 'auto': no usable CUDA device: <reason>; using the CPU backend
//   device 'auto': cuda:0: <name>, compute capability 7.5: this build has no kernels for it
//     (built for sm_80 sm_90 + compute_90 PTX): <CUDA error>; using the CPU backend
// and stores the same line in `chosen_reason` when given. Throws moe::Error naming the device and
// the reason when it is unusable ("cuda:N" without a GPU, an unknown name).
std::shared_ptr<kernels::Backend> open_backend(const std::string& device, std::string* chosen_reason = nullptr);
// The same for options.device, creating a CPU backend with options.threads.
std::shared_ptr<kernels::Backend> open_backend(const ComputeOptions& options, std::string* chosen_reason = nullptr);

// The mutex every user of `backend` (returned by open_backend) holds around each call on it when
// its memory is not host memory; nullptr for host-memory backends (calls may run concurrently).
// Throws moe::Error for a non-host backend that open_backend did not return.
std::shared_ptr<std::mutex> backend_mutex(const kernels::Backend& backend);

}  // namespace moe
