// gst-moe: which devices hold which experts (docs/expert-cache.md, "Placement").
//
// plan_expert_placement() is pure arithmetic over numbers the caller measured (free memory per
// device, bytes and recent load per expert), so it is tested without GPUs:
//  1. Every device offers capacity = free_bytes × (1 − headroom).
//  2. Primary copies: experts in order of load (descending; then bytes descending, then id) go
//     each to the device with the most capacity left on which it fits (ties: the device listed
//     first). Hot experts come first, so they land on the roomiest devices, and experts spread
//     over devices in proportion to their memory. With PlacementOptions::primary, the primaries
//     are given instead (re-planning replicas for a new load without moving any primary).
//  3. Replicas: an expert is hot when its load ≥ hot_load_factor × the mean load (and > 0).
//     Rounds over the hot experts (hottest first) add one replica each on the device, not yet
//     holding it, with the most capacity left where it fits, until max_replicas copies or no
//     device has room.
// Errors (moe::Error): no devices, a duplicate device, an expert of 0 bytes, too little memory
// overall (the message gives the need and the capacity), one expert that fits nowhere, or a
// given primary on an unknown device or beyond its capacity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moe/tensor.h"

namespace moe {

struct DeviceMemory {
  int index = 0;          // the device (e.g. N of cuda:N)
  size_t free_bytes = 0;  // Backend::memory_info().free_bytes
};

struct PlacementOptions {
  double headroom = 0.10;        // fraction of each device's free memory left unused
  double hot_load_factor = 2.0;  // hot: load ≥ factor × mean load over all experts
  int max_replicas = 1;          // copies of a hot expert at most (1: no replication)
  // Per expert, the device (DeviceMemory::index) of its primary copy; empty: planned (step 2).
  std::vector<int> primary;
};

class ExpertPlacement {
 public:
  struct Device {
    int index = 0;
    size_t capacity = 0;       // bytes usable after headroom
    size_t used = 0;           // bytes of the experts placed here
    std::vector<int> experts;  // ascending
  };

  ExpertPlacement() = default;
  // Normally built by plan_expert_placement(); holders[e] lists Device::index values.
  ExpertPlacement(std::vector<std::vector<int>> holders, std::vector<Device> devices)
      : holders_(std::move(holders)), devices_(std::move(devices)) {}

  int num_experts() const { return static_cast<int>(holders_.size()); }
  // Devices (DeviceMemory::index) holding `expert`: the primary first, then its replicas.
  const std::vector<int>& devices_of(int expert) const;
  const std::vector<Device>& devices() const { return devices_; }
  // The device that runs `row`'s slot of `expert`: the replicas take rows round-robin
  // (row mod replica count), so rows spread evenly and the choice needs no shared state.
  int choose_replica(int expert, int64_t row) const;
  // One line per device, for logs.
  std::string describe() const;

 private:
  std::vector<std::vector<int>> holders_;
  std::vector<Device> devices_;
};

// `expert_bytes[e]` per expert (all > 0); `expert_load[e]` rows routed to e recently, or empty /
// all zero when unknown (no replication then).
ExpertPlacement plan_expert_placement(const std::vector<DeviceMemory>& devices, const std::vector<size_t>& expert_bytes,
                                      const std::vector<int64_t>& expert_load, const PlacementOptions& options = {});

// The user-facing device list: "cpu", "cuda:N" ("cuda" = "cuda:0"), a comma-separated list of
// cuda:N, "all" (every one of `available_cuda` CUDA devices), or "auto" ("all" when there is a
// CUDA device, else "cpu"). Spaces around entries are
// ignored. Throws moe::Error naming the entry for an unknown device, a duplicate, an index out of
// range, "cpu" mixed with CUDA devices, an empty list, or "all" with no CUDA device.
std::vector<Placement> parse_device_list(const std::string& spec, int available_cuda);

}  // namespace moe
