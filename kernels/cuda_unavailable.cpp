// Built only with -Dcuda=disabled (or when nvcc/cuBLAS are missing): the CUDA entry points
// report why there is no CUDA backend instead of failing to link.
#include "backend.h"
#include "moe/error.h"

namespace moe::kernels {

int cuda_device_count(std::string* why) {
  if (why) *why = "gst-moe was built without CUDA (-Dcuda=disabled, or nvcc/cuBLAS not found)";
  return 0;
}

bool cuda_device_usable(int, std::string* why) { return cuda_device_count(why) > 0; }

std::unique_ptr<Backend> make_cuda_backend(int device) {
  throw Error("cuda:" + std::to_string(device) +
              ": gst-moe was built without CUDA (-Dcuda=disabled, or nvcc/cuBLAS not found)");
}

}  // namespace moe::kernels
