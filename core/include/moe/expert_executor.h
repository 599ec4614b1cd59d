// gst-moe: a MoE layer's routed experts run on one or more devices, with their weights preloaded
// asynchronously (docs/expert-cache.md, "Executor").
//
// ExpertExecutor ties the pieces of expert_store.h, expert_cache.h and expert_placement.h
// together behind two calls:
//   handle = prefetch(routing)   as soon as a batch is routed (moe-route's thread): pins the
//                                experts the batch's rows will use on each device and starts the
//                                copies of the missing ones; does not wait for copies.
//   y = run(x, routing, handle)  later, on another thread (moe-expert's): runs the batch,
//                                y = normalize(x + Σ_j w_j · expert_j(x)), exactly
//                                MoeAdapter::apply_experts; compute waits only for the copies of
//                                the experts it is about to use.
//
// The executor owns a Backend and an ExpertCache per device, and one HostExpertStore:
//  - Staging: every routed expert once, in the first device's staging memory (CUDA:
//    page-locked and portable, so every device's copy queue reads it asynchronously); 4-bit
//    experts as packed as the checkpoint stores them, so copies and slots are ~7x smaller.
//  - Caches: per device, a budget of slots that hold any expert (global ids).
//  - Placement: plan_expert_placement over the cache budgets decides which device serves each
//    expert (the roomiest device first, hot experts replicated when a load is known). When the
//    experts do not all fit in the budgets, every device serves a share of the experts in
//    proportion to its budget and its cache keeps the working set (oversubscription; no replicas).
//    rebalance(load) re-plans the replicas with a measured load (primaries stay where they are,
//    so load noise never moves an expert's only copy); since any cache can hold any expert, a new
//    placement takes effect at the next prefetch, with nothing to rebuild (the caches fill and
//    evict as batches come).
//  - A batch slot (row, j) runs on placement.choose_replica(expert, row), decided at prefetch and
//    kept in the handle, so a batch runs where its experts were pinned even if the placement
//    changed in between. The batch is uploaded once, to its home: the device with the most of
//    its slots. When other devices have slots too, home groups the slots by device (moe_permute
//    with the device as the key) and each device's block of rows travels to it and its weighted
//    expert outputs back by Backend::copy_to_peer (CUDA: cudaMemcpyPeerAsync, direct over
//    NVLink/PCIe where peer access is possible); home sums them per row, adds the residual,
//    normalises, and the result is downloaded once. Streams are ordered by events, so the host
//    waits only for that final download.
//  - Qwen2-MoE's shared expert (dense, every row) is copied to every device once and runs on
//    each batch's home, gated by sigmoid(gate · x) computed on the host, beside the routed sum.
//
// Threads: prefetch(), rebalance(), placement() and stats() may be called from any thread,
// concurrently with run(); run() calls are serialised internally (they use the backends'
// compute queues).
// Lifetime: a prefetch handle keeps every device (backend, store, cache) alive, so handles may
// outlive the executor (e.g. in a buffer that is still queued when an element stops).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/expert_cache.h"
#include "moe/expert_placement.h"
#include "moe/moe_layer.h"
#include "moe/tensor.h"

namespace moe {

struct ExpertExecutorOptions {
  // Precision of the expert weights on the devices (accumulation is always f32): f32, f16 or
  // bf16 converts the layer's experts. A layer with 4-bit experts runs them as stored, packed
  // (W4A16; precision() says Q4), whatever this says; Q4 here asks for that and is a moe::Error
  // for a layer whose experts are not 4-bit (tools/moe-quantize.py makes them).
  kernels::WeightType precision = kernels::WeightType::F32;
  // Cache budget of every device: this fraction of its free memory when the executor is built...
  double budget_fraction = 0.85;
  // ...unless budget_bytes is given: one explicit budget per device, in device order (e.g. two
  // CPU backends with different budgets in tests).
  std::vector<size_t> budget_bytes;
  // Rows routed to each expert recently (e.g. moe-route's expert-load), or empty: hot experts
  // get replicas on other devices. Its length must be the number of experts.
  std::vector<int64_t> expert_load;
  // Replication (headroom is ignored: the budget fraction already leaves room on each device).
  int max_replicas = 2;
  double hot_load_factor = 2.0;
  // With several devices: after every this many run() calls, rebalance() with the rows each
  // expert ran on during them, so hot experts get replicas as the traffic shows them. 0: never
  // (the placement stays what construction planned).
  int rebalance_interval = 256;
  // How long prefetch() may wait for batches in flight to unpin experts before it fails
  // (ExpertCacheOptions::admission_wait): back-pressure when the router runs ahead.
  std::chrono::milliseconds admission_wait{10000};
};

// One device's share: what it serves and its cache's counters.
struct ExpertDeviceStats {
  std::string device;        // "cuda:0", "cpu", ...
  std::vector<int> experts;  // experts placed on the device (global ids, ascending)
  size_t budget_bytes = 0;   // its cache budget
  int slots = 0;             // experts its cache holds at once
  size_t slot_bytes = 0;     // one expert in the executor's precision (4-bit: packed)
  CacheStats cache;
};

class ExpertExecutor {
 public:
  // The routed experts of `layer` on the devices of `devices` (parse_device_list syntax: "cpu",
  // "cuda:N", "cuda:0,cuda:1", "all"). "cpu" is one CPU backend whose copies run on a worker
  // thread (the GPU code path on host memory). Throws moe::Error naming the device and the
  // reason (no usable CUDA device and why, out of memory, a budget that holds no expert). The
  // layer is only read during construction.
  ExpertExecutor(const MoeLayer& layer, const std::string& devices, const ExpertExecutorOptions& options = {});
  // The same over backends the caller opened (devices are numbered by position; tests use
  // several CPU backends with explicit budgets).
  ExpertExecutor(const MoeLayer& layer, std::vector<std::unique_ptr<kernels::Backend>> backends,
                 const ExpertExecutorOptions& options = {});
  // Throws the error construction would give for the device list `devices` (syntax, no such
  // device, no usable CUDA device and why) without opening anything: a cheap early check.
  static void check_devices(const std::string& devices);
  // The experts of the adapter in `dir` (loaded through moe::shared_moe_adapter).
  static std::unique_ptr<ExpertExecutor> from_adapter_dir(const std::string& dir, const std::string& devices,
                                                          const ExpertExecutorOptions& options = {});
  ~ExpertExecutor();
  ExpertExecutor(const ExpertExecutor&) = delete;
  ExpertExecutor& operator=(const ExpertExecutor&) = delete;

  // Pins, on every device, the experts that `routing`'s slots will use there and starts the
  // copies of those not resident; returns an opaque handle holding the pins (dropping it unpins).
  // Does not wait for copies; may wait up to admission_wait for room (see the options). Throws
  // moe::Error when an expert id is out of range or a device's cache cannot take the batch.
  std::shared_ptr<void> prefetch(const Routing& routing);
  // True when `handle` came from this executor's prefetch() (a handle from another executor
  // must not be passed to run()).
  bool owns(const std::shared_ptr<void>& handle) const;

  // normalize(x + Σ_j w_j · expert_j(x)) for x [rows, hidden] f32 on the host. `handle`: this
  // executor's prefetch() of the same routing, or null (run() prefetches itself). When run()
  // returns or throws, the handle's pins are released (a handle serves one run). Throws
  // moe::Error for a wrong shape or routing, or when a device fails.
  Tensor run(const Tensor& x, const Routing& routing, const std::shared_ptr<void>& handle);

  // Re-plans the replicas with `expert_load` (rows routed to each expert recently, one entry per
  // expert), over the budgets and replication options of construction; every expert keeps the
  // primary device construction gave it (run() calls this every rebalance_interval batches). Returns true when the
  // placement changed; it applies from the next prefetch(). Throws moe::Error for a wrong length.
  bool rebalance(const std::vector<int64_t>& expert_load);

  // Per device, in device order.
  std::vector<ExpertDeviceStats> stats() const;
  // The placement now (a copy: rebalance() may replace it at any time).
  ExpertPlacement placement() const;
  // How many times rebalance() changed the placement.
  uint64_t placement_changes() const;
  std::vector<std::string> device_names() const;
  const MoeConfig& config() const;
  kernels::WeightType precision() const;

  struct State;  // shared with the handles

 private:
  std::shared_ptr<State> state_;
};

}  // namespace moe
