#include <cstdlib>
#include <cstring>

#include "backend.h"
#include "cpu_ops.h"
#include "moe/error.h"

namespace moe::kernels {

namespace {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool is_host_memory() const override { return true; }
  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) throw Error("cpu backend: out of memory allocating " + std::to_string(bytes) + " bytes");
    return p;
  }
  void deallocate(void* ptr) override { std::free(ptr); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void synchronize() override {}
  void l2_normalize_rows(float* x, int64_t rows, int64_t cols, float eps) override {
    cpu::l2_normalize_rows(x, rows, cols, eps);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace moe::kernels
