#include "moe/expert_executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <utility>

#include "runtime/compute_util.h"
#include "cpu_ops.h"
#include "runtime/device_buffer.h"
#include "moe/error.h"
#include "moe/expert_store.h"
#include "moe/model_cache.h"

namespace moe {

// What the executor and its prefetch handles share: destroyed when the last of them is gone.
struct ExpertExecutor::State {
  struct Device {
    std::string name;
    size_t budget = 0;
    kernels::Backend* backend = nullptr;  // one of `backends`
    std::unique_ptr<ExpertCache> cache;
    // Qwen2-MoE's shared expert, resident on every device (each may be a batch's home).
    std::optional<DeviceBuffer> shared_blob;
    kernels::ExpertWeights shared;
  };

  MoeConfig config;
  kernels::WeightType precision = kernels::WeightType::F32;
  size_t slot_bytes = 0;
  // What rebalance() plans over: each device's share of memory, and the options (with the
  // primaries of the first placement).
  std::vector<DeviceMemory> placement_memory;
  PlacementOptions placement_options;
  // Destroyed in reverse order: the caches (they wait for their copies), the store, the backends.
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  std::unique_ptr<HostExpertStore> store;  // every routed expert, staged by backends[0]
  std::vector<float> shared_gate;          // Qwen2-MoE: the shared expert's gate [hidden], f32 on the host
  std::vector<Device> devices;

  mutable std::mutex placement_mu;  // guards placement and placement_changes
  std::shared_ptr<const ExpertPlacement> placement;
  uint64_t placement_changes = 0;
  std::mutex run_mu;  // one run() at a time: it drives the backends' compute queues
  // Load since the last automatic rebalance (under run_mu).
  int rebalance_interval = 0;
  int batches_in_window = 0;
  std::vector<int64_t> window_load;

  std::shared_ptr<const ExpertPlacement> current_placement() const {
    std::lock_guard<std::mutex> lock(placement_mu);
    return placement;
  }
};

namespace {

using State = ExpertExecutor::State;

// The opaque prefetch handle: where each slot of one batch runs, and its pins per device.
struct Prefetch {
  std::shared_ptr<State> state;                     // keeps the devices alive; identifies the owner
  std::vector<int32_t> device_of;                   // per slot (row · top_k + j)
  std::vector<std::shared_ptr<BatchLease>> leases;  // per device; null where the batch has no slot
  // (Members go in reverse order: the leases unpin before the state may go.)
};
// Handles are made with this deleter, so std::get_deleter tells a Prefetch from any other pointer.
struct PrefetchDeleter {
  void operator()(void* p) const { delete static_cast<Prefetch*>(p); }
};

Prefetch* as_prefetch(const std::shared_ptr<void>& handle) {
  return handle && std::get_deleter<PrefetchDeleter>(handle) ? static_cast<Prefetch*>(handle.get()) : nullptr;
}

void check_routing(const State& st, const Routing& r) {
  const int E = st.config.num_experts;
  if (r.rows < 0 || r.top_k < 1 || r.top_k > E || r.expert_ids.size() != static_cast<size_t>(r.rows * r.top_k) ||
      r.weights.size() != r.expert_ids.size())
    throw Error("expert executor: routing for " + std::to_string(r.rows) + " rows x top_k " + std::to_string(r.top_k) +
                " has " + std::to_string(r.expert_ids.size()) + " ids and " + std::to_string(r.weights.size()) +
                " weights (top_k must be 1.." + std::to_string(E) + ")");
  for (size_t s = 0; s < r.expert_ids.size(); ++s)
    if (r.expert_ids[s] != Routing::kUnusedSlot && (r.expert_ids[s] < 0 || r.expert_ids[s] >= E))
      throw Error("expert executor: row " + std::to_string(s / static_cast<size_t>(r.top_k)) + " is routed to expert " +
                  std::to_string(r.expert_ids[s]) + " outside [0, " + std::to_string(E) + ")");
}

std::shared_ptr<void> prefetch_on(const std::shared_ptr<State>& st, const Routing& routing) {
  check_routing(*st, routing);
  const std::shared_ptr<const ExpertPlacement> placement = st->current_placement();
  std::unique_ptr<Prefetch> p(new Prefetch{st, {}, {}});
  p->device_of.reserve(routing.expert_ids.size());
  std::vector<std::vector<int32_t>> experts(st->devices.size());
  for (int64_t row = 0; row < routing.rows; ++row)
    for (int j = 0; j < routing.top_k; ++j) {
      const int e = routing.expert(row, j);
      if (e == Routing::kUnusedSlot) {
        p->device_of.push_back(-1);  // no device: moe_permute skips it
        continue;
      }
      const int d = placement->choose_replica(e, row);
      p->device_of.push_back(d);
      experts[static_cast<size_t>(d)].push_back(e);
    }
  p->leases.resize(st->devices.size());
  for (size_t d = 0; d < st->devices.size(); ++d)
    if (!experts[d].empty())
      p->leases[d] =
          st->devices[d].cache->prefetch(experts[d]);  // throws naming the device; earlier leases unpin with p
  return std::shared_ptr<void>(p.release(), PrefetchDeleter{});
}

// A new buffer of `bytes` in `b`'s memory, kept in `into` (freed with it), as floats.
float* add_buffer(std::vector<DeviceBuffer>& into, kernels::Backend& b, size_t bytes) {
  into.emplace_back(b, bytes);
  return into.back().as<float>();
}

// One device's part of a batch: its slots' input rows in, the routing-weighted sum of their
// experts' outputs out (per input row), all in that device's memory.
struct DeviceWork {
  size_t device = 0;
  int64_t rows = 0;              // input rows on the device
  int64_t k = 0;                 // slots per input row: top_k when the device runs the whole batch, else 1
  std::vector<int32_t> ids;      // expert per slot
  std::vector<float> weights;    // routing weight per slot
  std::vector<int64_t> offsets;  // per expert, from moe_permute
  const float* x = nullptr;      // input rows
  float* y = nullptr;            // output rows
  int32_t* ids_dev = nullptr;    // ids and weights on the device
  float* weights_dev = nullptr;
  float* x_sorted = nullptr;  // rows grouped per expert
  int32_t* slot_of = nullptr;
  float* out_sorted = nullptr;  // their experts' outputs
  std::vector<DeviceBuffer> buf;
  float* alloc(kernels::Backend& b, int64_t floats) {
    return add_buffer(buf, b, static_cast<size_t>(floats) * sizeof(float));
  }
};

// The buffers of one run(): declared before the work is queued and freed after every device has
// finished, also when run() throws.
struct Batch {
  std::vector<DeviceBuffer> home;   // on the home device
  std::vector<DeviceWork> work;     // per device with slots
  std::vector<float> ones;          // per slot: unit weights for summing the weighted slots
  std::vector<float> shared_scale;  // per row: the shared expert's gate, sigmoid(gate · x)
  std::vector<int32_t> identity;    // per row: its own index
  float* alloc_home(kernels::Backend& b, size_t bytes) { return add_buffer(home, b, bytes); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

namespace {

std::shared_ptr<State> build_state(const MoeLayer& layer, std::vector<std::unique_ptr<kernels::Backend>> backends,
                                   const ExpertExecutorOptions& options) {
  auto st = std::make_shared<State>();
  st->config = layer.config();
  const MoeConfig& cfg = st->config;
  // 4-bit experts run as stored (packed), whatever the options say: widening them would give up
  // their memory saving; other experts cannot be made 4-bit here.
  const bool four_bit = layer.precision() == kernels::WeightType::Q4;
  if (options.precision == kernels::WeightType::Q4 && !four_bit)
    throw Error("expert executor: int4 runs 4-bit experts as stored, and the experts of '" + cfg.source + "' are " +
                kernels::weight_type_name(layer.precision()) +
                ": quantise the adapter first (tools/moe-quantize.py, docs/model-formats.md)");
  st->precision = four_bit ? kernels::WeightType::Q4 : options.precision;
  // Qwen2-MoE's shared expert: in the experts' precision, f32 next to 4-bit experts (the layer
  // keeps a 4-bit shared expert dequantised: it runs for every row, as in MoeLayer).
  const kernels::WeightType shared_precision = four_bit ? kernels::WeightType::F32 : st->precision;
  if (backends.empty()) throw Error("expert executor: no devices");
  const size_t n = backends.size();
  for (const auto& b : backends)
    if (b && backends[0] && b->is_host_memory() != backends[0]->is_host_memory())
      throw Error("expert executor: " + backends[0]->name() + " and " + b->name() +
                  " cannot exchange rows (host and device memory): use CPU backends only or CUDA devices only");
  const int E = cfg.num_experts;
  if (options.rebalance_interval < 0)
    throw Error("expert executor: rebalance interval " + std::to_string(options.rebalance_interval) + " < 0");
  st->rebalance_interval = options.rebalance_interval;
  st->window_load.assign(static_cast<size_t>(E), 0);

  // Device names: the backends' own, numbered when several share one (e.g. two CPU backends).
  st->devices.resize(n);
  for (size_t d = 0; d < n; ++d) {
    if (!backends[d]) throw Error("expert executor: device " + std::to_string(d) + " has no backend");
    const std::string name = backends[d]->name();
    const bool shared_name =
        std::count_if(backends.begin(), backends.end(), [&](const auto& b) { return b && b->name() == name; }) > 1;
    st->devices[d].name = shared_name ? name + "#" + std::to_string(d) : name;
    st->devices[d].backend = backends[d].get();
  }
  st->backends = std::move(backends);
  for (const State::Device& dev : st->devices) {
    std::string why;
    if (!dev.backend->supports(
            {kernels::Op::GroupedSwiglu, {st->precision}, {1, E, cfg.hidden_size, cfg.intermediate_size}}, &why))
      throw Error("expert executor on " + dev.name + ": " + kernels::weight_type_name(st->precision) +
                  " experts: " + why);
  }

  // One staging copy of the experts (4-bit ones packed): its blob is the slot of every cache.
  st->store = std::make_unique<HostExpertStore>(HostExpertStore::from_layer(*st->backends[0], layer, st->precision));
  st->slot_bytes = st->store->max_expert_bytes();
  const size_t slot = st->slot_bytes;

  // Budgets, in whole slots.
  if (!options.budget_bytes.empty() && options.budget_bytes.size() != n)
    throw Error("expert executor: " + std::to_string(options.budget_bytes.size()) + " cache budgets for " +
                std::to_string(n) + " devices");
  if (options.budget_bytes.empty() && !(options.budget_fraction > 0.0 && options.budget_fraction <= 1.0))
    throw Error("expert executor: cache budget fraction " + std::to_string(options.budget_fraction) +
                " outside (0, 1]");
  if (!options.expert_load.empty() && options.expert_load.size() != static_cast<size_t>(E))
    throw Error("expert executor: " + std::to_string(options.expert_load.size()) + " expert loads for " +
                std::to_string(E) + " experts");
  std::vector<size_t> slots(n);
  size_t total_slots = 0;
  for (size_t d = 0; d < n; ++d) {
    State::Device& dev = st->devices[d];
    if (!options.budget_bytes.empty()) {
      dev.budget = options.budget_bytes[d];
    } else {
      const size_t free_bytes = dev.backend->memory_info().free_bytes;
      dev.budget = static_cast<size_t>(static_cast<double>(free_bytes) * options.budget_fraction);
    }
    if (cfg.shared_expert_intermediate_size > 0) {  // the shared expert's copy comes out of the budget
      const size_t shared_bytes =
          HostExpertStore::blob_bytes(shared_precision, cfg.hidden_size, cfg.shared_expert_intermediate_size);
      dev.budget -= std::min(dev.budget, shared_bytes);
    }
    slots[d] = dev.budget / slot;
    if (slots[d] == 0)
      throw Error("expert executor on " + dev.name + ": the cache budget of " + std::to_string(dev.budget) +
                  " bytes holds no expert (one expert takes " + std::to_string(slot) + " bytes in " +
                  kernels::weight_type_name(st->precision) + "); raise the budget or use a smaller precision");
    total_slots += slots[d];
  }

  // Placement over the budgets. When the experts do not all fit, every device serves a share in
  // proportion to its budget (plus one slot of slack, so the greedy plan always places every
  // expert) and its cache keeps the working set; replicas would only crowd such caches.
  PlacementOptions& po = st->placement_options;
  po.headroom = 0.0;  // the budget fraction already leaves room
  po.hot_load_factor = options.hot_load_factor;
  po.max_replicas = options.max_replicas;
  const bool oversubscribed = static_cast<size_t>(E) > total_slots;
  if (oversubscribed) po.max_replicas = 1;
  st->placement_memory.resize(n);
  for (size_t d = 0; d < n; ++d) {
    st->placement_memory[d].index = static_cast<int>(d);
    const size_t share =
        oversubscribed ? (slots[d] * static_cast<size_t>(E) + total_slots - 1) / total_slots + 1 : slots[d];
    st->placement_memory[d].free_bytes = share * slot;
  }
  st->placement = std::make_shared<const ExpertPlacement>(plan_expert_placement(
      st->placement_memory, std::vector<size_t>(static_cast<size_t>(E), slot), options.expert_load, po));
  // Rebalancing keeps these primaries and re-plans only the replicas: a shift in load then never
  // moves an expert's only copy, so caches do not churn on noise.
  for (int e = 0; e < E; ++e) po.primary.push_back(st->placement->devices_of(e)[0]);

  // A cache per device.
  ExpertCacheOptions co;
  co.admission_wait = options.admission_wait;
  for (State::Device& dev : st->devices) {
    co.budget_bytes = dev.budget;
    dev.cache = std::make_unique<ExpertCache>(*dev.backend, *st->store, co);  // throws if it cannot share staging
  }
  if (cfg.shared_expert_intermediate_size > 0) {  // packed like one expert, copied once, staging freed
    const HostExpertStore shared(*st->backends[0], shared_precision, 1, cfg.hidden_size,
                                 cfg.shared_expert_intermediate_size,
                                 [&](int, ExpertMatrix which) { return layer.shared_expert_weight(which); });
    const Tensor& gate = layer.shared_expert_gate();
    st->shared_gate.assign(gate.data<float>(), gate.data<float>() + cfg.hidden_size);
    const size_t bytes = shared.expert_bytes(0);
    for (State::Device& dev : st->devices) {
      dev.shared_blob.emplace(*dev.backend, bytes);
      dev.backend->copy_from_host(dev.shared_blob->as<void>(), shared.expert_data(0), bytes);
      dev.backend->synchronize();
      dev.shared = shared.weights_at(dev.shared_blob->as<void>());
    }
  }
  return st;
}

// The devices of `spec` on this machine; throws naming the spec and the reason.
std::vector<Placement> usable_devices(const std::string& spec) {
  std::string why;
  const int available = kernels::cuda_device_count(&why);
  try {
    return parse_device_list(spec, available);
  } catch (const Error& e) {
    if (available == 0 && (spec.find("cuda") != std::string::npos || spec.find("all") != std::string::npos))
      throw Error("device '" + spec + "': no usable CUDA device: " + why);
    throw Error("device '" + spec + "': " + e.what());
  }
}

std::vector<std::unique_ptr<kernels::Backend>> open_backends(const std::string& spec) {
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  for (const Placement& p : usable_devices(spec)) {
    if (p.kind == DeviceKind::Host) {
      kernels::CpuBackendOptions o;
      o.async_copies = true;  // a real copy queue: prefetch overlaps compute as on a GPU
      backends.push_back(kernels::make_cpu_backend(o));
    } else {
      backends.push_back(kernels::make_cuda_backend(p.index));  // throws naming cuda:N and why
    }
  }
  return backends;
}

}  // namespace

void ExpertExecutor::check_devices(const std::string& devices) { usable_devices(devices); }

ExpertExecutor::ExpertExecutor(const MoeLayer& layer, const std::string& devices, const ExpertExecutorOptions& options)
    : ExpertExecutor(layer, open_backends(devices), options) {}

ExpertExecutor::ExpertExecutor(const MoeLayer& layer, std::vector<std::unique_ptr<kernels::Backend>> backends,
                               const ExpertExecutorOptions& options)
    : state_(build_state(layer, std::move(backends), options)) {}

std::unique_ptr<ExpertExecutor> ExpertExecutor::from_adapter_dir(const std::string& dir, const std::string& devices,
                                                                 const ExpertExecutorOptions& options) {
  const std::shared_ptr<const MoeAdapter> adapter = shared_moe_adapter(dir);
  return std::make_unique<ExpertExecutor>(adapter->layer(), devices, options);
}

ExpertExecutor::~ExpertExecutor() = default;

std::shared_ptr<void> ExpertExecutor::prefetch(const Routing& routing) { return prefetch_on(state_, routing); }

bool ExpertExecutor::owns(const std::shared_ptr<void>& handle) const {
  const Prefetch* p = as_prefetch(handle);
  return p && p->state == state_;
}

Tensor ExpertExecutor::run(const Tensor& x, const Routing& routing, const std::shared_ptr<void>& handle) {
  State& st = *state_;
  const int64_t D = st.config.hidden_size, I = st.config.intermediate_size;
  if (x.rank() != 2 || x.dim(1) != D || x.dtype() != DType::F32 || !x.is_host() || x.dim(0) != routing.rows)
    throw Error("expert executor: input " + x.describe() + ", expected f32[" + std::to_string(routing.rows) + "," +
                std::to_string(D) + "]@host");
  if (handle && !owns(handle)) throw Error("expert executor: the prefetch handle comes from another executor");
  check_routing(st, routing);
  std::lock_guard<std::mutex> run_lock(st.run_mu);

  // Pins of this batch: the router's, or our own. Released on every way out (below).
  std::shared_ptr<void> own = handle ? handle : prefetch_on(state_, routing);
  Prefetch& pins = *as_prefetch(own);
  auto release = [&] {
    for (auto& lease : pins.leases)
      if (lease) lease->release();
  };

  const int64_t N = routing.rows, K = routing.top_k;
  const size_t fbytes = sizeof(float), ibytes = sizeof(int32_t);
  if (pins.device_of.size() != static_cast<size_t>(N * K)) {
    release();
    throw Error("expert executor: the prefetch handle was made for " + std::to_string(pins.device_of.size()) +
                " slots, the batch has " + std::to_string(N * K) + " (it was made for another routing)");
  }
  std::vector<std::vector<int64_t>> slots(st.devices.size());  // per device, its used slots in order
  size_t used = 0;
  for (size_t s = 0; s < pins.device_of.size(); ++s)
    if (pins.device_of[s] >= 0) {
      slots[static_cast<size_t>(pins.device_of[s])].push_back(static_cast<int64_t>(s));
      ++used;
    }
  // Home: the device with the most slots. The batch goes there once; the slots of other devices
  // travel to them and back by peer copies; residual and normalisation run there too.
  size_t home = 0;
  for (size_t d = 1; d < slots.size(); ++d)
    if (slots[d].size() > slots[home].size()) home = d;
  const bool split = slots[home].size() != used;
  kernels::Backend& hb = *st.devices[home].backend;

  Tensor y = Tensor::zeros(DType::F32, {N, D});
  Batch batch;
  batch.work.reserve(st.devices.size());
  try {
    float* x_home = batch.alloc_home(hb, static_cast<size_t>(N * D) * fbytes);
    float* y_home = batch.alloc_home(hb, static_cast<size_t>(N * D) * fbytes);
    hb.copy_from_host(x_home, x.data<float>(), static_cast<size_t>(N * D) * fbytes);
    // 1. Split: group the batch's slots by device on home (moe_permute with the device as the
    //    "expert"), so that each device's rows are one contiguous block to copy.
    float *x_by_device = nullptr, *out_by_device = nullptr;
    int32_t* slot_of_device = nullptr;
    std::vector<int64_t> device_offsets;
    if (split) {
      const std::vector<int32_t>& device_of = pins.device_of;  // the "expert" of each slot here
      auto* device_ids = reinterpret_cast<int32_t*>(batch.alloc_home(hb, device_of.size() * ibytes));
      x_by_device = batch.alloc_home(hb, static_cast<size_t>(N * K * D) * fbytes);
      out_by_device = batch.alloc_home(hb, static_cast<size_t>(N * K * D) * fbytes);
      slot_of_device = reinterpret_cast<int32_t*>(batch.alloc_home(hb, device_of.size() * ibytes));
      hb.copy_from_host(device_ids, device_of.data(), device_of.size() * ibytes);
      device_offsets =
          hb.moe_permute(device_ids, N, K, static_cast<int64_t>(slots.size()), x_home, D, x_by_device, slot_of_device);
    }
    // 2. Each device with slots gets its rows and groups them per expert (moe_permute
    //    returns the offsets on the host, so it waits for that device's queue).
    for (size_t d = 0; d < st.devices.size(); ++d) {
      if (slots[d].empty()) continue;
      State::Device& dev = st.devices[d];
      const BatchLease* lease = pins.leases[d].get();
      if (lease && lease->released())
        throw Error("expert executor: the prefetch handle was already used by a run (a handle serves one run)");
      for (int64_t s : slots[d]) {
        const int32_t e = routing.expert_ids[static_cast<size_t>(s)];
        if (!lease || !std::binary_search(lease->experts().begin(), lease->experts().end(), e))
          throw Error("expert executor: the prefetch handle does not pin expert " + std::to_string(e) + " on " +
                      dev.name + " (it was made for another routing)");
      }
      kernels::Backend& b = *dev.backend;
      batch.work.emplace_back();
      DeviceWork& w = batch.work.back();
      w.device = d;
      w.k = split ? 1 : K;
      w.rows = split ? static_cast<int64_t>(slots[d].size()) : N;
      if (split) {
        for (int64_t s : slots[d]) {  // slot order: the order moe_permute keeps within a device
          w.ids.push_back(routing.expert_ids[static_cast<size_t>(s)]);
          w.weights.push_back(routing.weights[static_cast<size_t>(s)]);
        }
      } else {  // the whole batch, unused slots included (moe_permute skips them)
        w.ids = routing.expert_ids;
        w.weights = routing.weights;
      }
      const int64_t S = w.rows * w.k;
      if (!split) {
        w.x = x_home;
        w.y = y_home;
      } else if (d == home) {
        w.x = x_by_device + device_offsets[d] * D;
        w.y = out_by_device + device_offsets[d] * D;
      } else {
        float* x_in = w.alloc(b, w.rows * D);
        hb.copy_to_peer(b, x_in, x_by_device + device_offsets[d] * D, static_cast<size_t>(w.rows * D) * fbytes);
        w.x = x_in;
        w.y = w.alloc(b, w.rows * D);
      }
      w.ids_dev = reinterpret_cast<int32_t*>(w.alloc(b, S));  // int32 and f32 have the same size
      w.weights_dev = w.alloc(b, S);
      w.x_sorted = w.alloc(b, S * D);
      w.slot_of = reinterpret_cast<int32_t*>(w.alloc(b, S));
      w.out_sorted = w.alloc(b, S * D);
      b.copy_from_host(w.ids_dev, w.ids.data(), w.ids.size() * ibytes);
      b.copy_from_host(w.weights_dev, w.weights.data(), w.weights.size() * fbytes);
      w.offsets = b.moe_permute(w.ids_dev, w.rows, w.k, st.config.num_experts, w.x, D, w.x_sorted, w.slot_of);
    }
    // 3. Queue the experts on every device (each waits only for the copies of its own experts),
    //    then the ways back to home: a copy back fences home's queue after that device's work, so
    //    queuing one before home's own experts would make the devices compute one after another.
    for (DeviceWork& w : batch.work) {
      State::Device& dev = st.devices[w.device];
      std::vector<kernels::ExpertWeights> experts(static_cast<size_t>(st.config.num_experts));
      for (size_t e = 0; e < experts.size(); ++e)
        if (w.offsets[e + 1] > w.offsets[e]) experts[e] = pins.leases[w.device]->acquire(static_cast<int32_t>(e));
      dev.backend->grouped_swiglu(w.x_sorted, w.offsets, experts, D, I, w.out_sorted);
      dev.backend->moe_unpermute(w.out_sorted, w.slot_of, w.weights_dev, w.rows, w.k, D, w.y);
    }
    for (DeviceWork& w : batch.work)
      if (split && w.device != home)
        st.devices[w.device].backend->copy_to_peer(hb, out_by_device + device_offsets[w.device] * D, w.y,
                                                   static_cast<size_t>(w.rows * D) * fbytes);
    // 4. On home: sum the (already weighted) slots of every row, add the residual, normalise.
    if (used == 0)  // every row dropped all its experts: no work wrote y_home (y is still zeros)
      hb.copy_from_host(y_home, y.data<float>(), static_cast<size_t>(N * D) * fbytes);
    if (split) {
      batch.ones.assign(static_cast<size_t>(N * K), 1.0f);
      float* unit = batch.alloc_home(hb, batch.ones.size() * fbytes);
      hb.copy_from_host(unit, batch.ones.data(), batch.ones.size() * fbytes);
      hb.moe_unpermute(out_by_device, slot_of_device, unit, N, K, D, y_home);
    }
    if (st.config.shared_expert_intermediate_size > 0 &&
        N > 0) {  // Qwen2-MoE: + sigmoid(gate · x) · shared(x), on home
      const int64_t S = st.config.shared_expert_intermediate_size;
      batch.shared_scale.resize(static_cast<size_t>(N));
      kernels::cpu::linear(x.data<float>(), {st.shared_gate.data(), kernels::WeightType::F32}, nullptr,
                           batch.shared_scale.data(), N, 1, D);
      for (float& g : batch.shared_scale) g = 1.0f / (1.0f + std::exp(-g));
      batch.identity.resize(static_cast<size_t>(N));
      std::iota(batch.identity.begin(), batch.identity.end(), 0);
      float* scale = batch.alloc_home(hb, static_cast<size_t>(N) * fbytes);
      auto* identity = reinterpret_cast<int32_t*>(batch.alloc_home(hb, static_cast<size_t>(N) * ibytes));
      hb.copy_from_host(scale, batch.shared_scale.data(), static_cast<size_t>(N) * fbytes);
      hb.copy_from_host(identity, batch.identity.data(), static_cast<size_t>(N) * ibytes);
      detail::add_scaled_swiglu(hb, x_home, N, D, S, st.devices[home].shared, identity, scale,
                                batch.alloc_home(hb, static_cast<size_t>(N * (2 * S + 2 * D)) * fbytes), y_home);
    }
    hb.add(y_home, x_home, N * D);
    hb.l2_normalize_rows(y_home, N, D, 1e-12f);
    // Waits for home, which waited (through the peer copies) for every other device.
    hb.copy_to_host(y.data<float>(), y_home, static_cast<size_t>(N * D) * fbytes);
  } catch (...) {
    // Work still queued may read the pinned slots and the batch's buffers: let it finish first.
    for (State::Device& dev : st.devices)
      detail::try_release(dev.name + ": waiting for queued work after a failed batch",
                          [&] { dev.backend->synchronize(); });
    release();
    throw;
  }
  release();
  if (st.rebalance_interval > 0 && st.devices.size() > 1) {
    for (int32_t e : routing.expert_ids)
      if (e != Routing::kUnusedSlot) ++st.window_load[static_cast<size_t>(e)];
    if (++st.batches_in_window >= st.rebalance_interval) {
      rebalance(st.window_load);
      st.window_load.assign(st.window_load.size(), 0);
      st.batches_in_window = 0;
    }
  }
  return y;
}

bool ExpertExecutor::rebalance(const std::vector<int64_t>& expert_load) {
  State& st = *state_;
  if (expert_load.size() != static_cast<size_t>(st.config.num_experts))
    throw Error("expert executor: rebalance with " + std::to_string(expert_load.size()) + " expert loads for " +
                std::to_string(st.config.num_experts) + " experts");
  auto next = std::make_shared<const ExpertPlacement>(plan_expert_placement(
      st.placement_memory, std::vector<size_t>(expert_load.size(), st.slot_bytes), expert_load, st.placement_options));
  std::lock_guard<std::mutex> lock(st.placement_mu);
  bool same = true;
  for (int e = 0; e < st.config.num_experts && same; ++e) same = next->devices_of(e) == st.placement->devices_of(e);
  if (same) return false;
  st.placement = std::move(next);
  ++st.placement_changes;
  return true;
}

std::vector<ExpertDeviceStats> ExpertExecutor::stats() const {
  const std::shared_ptr<const ExpertPlacement> placement = state_->current_placement();
  std::vector<ExpertDeviceStats> out;
  for (size_t d = 0; d < state_->devices.size(); ++d) {
    const State::Device& dev = state_->devices[d];
    ExpertDeviceStats s;
    s.device = dev.name;
    s.experts = placement->devices()[d].experts;
    s.budget_bytes = dev.budget;
    s.slot_bytes = state_->slot_bytes;
    s.slots = dev.cache->num_slots();
    s.cache = dev.cache->stats();
    out.push_back(std::move(s));
  }
  return out;
}

ExpertPlacement ExpertExecutor::placement() const { return *state_->current_placement(); }

uint64_t ExpertExecutor::placement_changes() const {
  std::lock_guard<std::mutex> lock(state_->placement_mu);
  return state_->placement_changes;
}

std::vector<std::string> ExpertExecutor::device_names() const {
  std::vector<std::string> names;
  for (const State::Device& dev : state_->devices) names.push_back(dev.name);
  return names;
}

const MoeConfig& ExpertExecutor::config() const { return state_->config; }
kernels::WeightType ExpertExecutor::precision() const { return state_->precision; }

}  // namespace moe
