// gst-moe (engine-internal): a buffer in a backend's memory, freed on scope exit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

#include "backend.h"
#include "runtime/compute_util.h"

namespace moe {

class DeviceBuffer {
 public:
  // At least 64 bytes, so that an empty buffer is still a valid pointer for the backend.
  DeviceBuffer(kernels::Backend& b, size_t bytes) : b_(&b), p_(b.allocate(std::max<size_t>(bytes, 64))) {}
  ~DeviceBuffer() {
    if (p_) detail::deallocate_noexcept(*b_, p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : b_(o.b_), p_(std::exchange(o.p_, nullptr)) {}
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() {
    return static_cast<T*>(p_);
  }

 private:
  kernels::Backend* b_;
  void* p_;
};

}  // namespace moe
