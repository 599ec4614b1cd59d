// gst-moe compute backends behind one interface.
//
// A Backend owns a memory space (host RAM, or one CUDA device with its stream) and runs
// operations on buffers in that space with the contracts written in kernels/cpu/cpu_ops.h.
// The CPU backend is the reference; every CUDA operation is tested against it.
// The operation set grows as CUDA twins are written; an operation is added here only together
// with its implementation in every backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace moe::kernels {

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  virtual bool is_host_memory() const = 0;

  // Memory in this backend's space. allocate() throws moe::Error when out of memory.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Waits until every operation queued so far has finished.
  virtual void synchronize() = 0;

  // x / max(‖x‖₂, eps) per row, in place (see cpu::l2_normalize_rows).
  virtual void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();

// Number of usable CUDA devices; 0 when built without CUDA or when no driver/device is present.
// `why`, when given, receives the reason for 0 in words.
int cuda_device_count(std::string* why = nullptr);
// A backend on CUDA device `device`. Throws moe::Error saying why when that is impossible
// (built with -Dcuda=disabled, no driver, no such device).
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace moe::kernels
