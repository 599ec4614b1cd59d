#include "moe/expert_transport.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "runtime/device_buffer.h"
#include "moe/error.h"
#include "moe_build_config.h"

namespace moe {

void wait_for_collective(const CollectiveWait& wait, const std::string& what, const std::function<bool()>& poll) {
  const auto deadline = std::chrono::steady_clock::now() + wait.timeout;
  while (!poll()) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw Error(what + ": not complete after " + std::to_string(wait.timeout.count()) +
                  " ms (a peer rank failed, hung, aborted, or is still busy)");
    std::this_thread::sleep_for(wait.poll_interval);
  }
}

// ---- in-process transport ----------------------------------------------------------------------

namespace {

// What N threads share: published buffers and an abortable barrier.
struct InProcessGroup {
  InProcessGroup(int n, const CollectiveWait& wait)
      : n(n),
        wait(wait),
        counts(static_cast<size_t>(n)),
        send(static_cast<size_t>(n)),
        send_counts(static_cast<size_t>(n)),
        cols(static_cast<size_t>(n)) {}

  const int n;
  const CollectiveWait wait;
  std::mutex mu;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  std::string why;

  // Published by each rank between barriers.
  std::vector<std::vector<int64_t>> counts;
  std::vector<const float*> send;
  std::vector<std::vector<int64_t>> send_counts;
  std::vector<int64_t> cols;

  void check_broken() const {
    if (broken) throw Error("in-process transport: the group failed: " + why);
  }

  // Waits, as `wait` says, for every rank to arrive; throws once the group is broken.
  void barrier(int rank) {
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu);
      check_broken();
      gen = generation;
      if (++arrived == n) {
        arrived = 0;
        ++generation;
        return;
      }
    }
    wait_for_collective(wait, "in-process transport (rank " + std::to_string(rank) + "): barrier", [&] {
      std::lock_guard<std::mutex> lock(mu);
      check_broken();
      return generation != gen;
    });
  }

  void abort(int rank, const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu);
    if (!broken) {
      broken = true;
      why = "rank " + std::to_string(rank) + ": " + msg;
    }
  }
};

class InProcessTransport final : public ExpertTransport {
 public:
  InProcessTransport(std::shared_ptr<InProcessGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->n; }

  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts, int per_rank) override {
    return guarded([&] {
      InProcessGroup& g = *group_;
      const size_t per = static_cast<size_t>(per_rank), n = static_cast<size_t>(g.n);
      if (per_rank < 1 || send_counts.size() != n * per)
        throw Error("exchange_counts: " + std::to_string(send_counts.size()) + " counts for " + std::to_string(g.n) +
                    " ranks x " + std::to_string(per_rank));
      g.counts[static_cast<size_t>(rank_)] = send_counts;
      g.barrier(rank_);
      std::vector<int64_t> recv(n * per);
      for (size_t p = 0; p < n; ++p) {
        const std::vector<int64_t>& c = g.counts[p];
        if (c.size() != n * per)
          throw Error("exchange_counts: rank " + std::to_string(p) + " sent " + std::to_string(c.size()) +
                      " counts, this rank expects " + std::to_string(n * per));
        std::copy(c.begin() + static_cast<std::ptrdiff_t>(rank_ * per),
                  c.begin() + static_cast<std::ptrdiff_t>((rank_ + 1) * per),
                  recv.begin() + static_cast<std::ptrdiff_t>(p * per));
      }
      g.barrier(rank_);  // every rank has read before anyone publishes again
      return recv;
    });
  }

  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts, int64_t cols) override {
    guarded([&] {
      InProcessGroup& g = *group_;
      const size_t n = static_cast<size_t>(g.n), r = static_cast<size_t>(rank_);
      if (send_counts.size() != n || recv_counts.size() != n || cols <= 0)
        throw Error("all_to_all: needs " + std::to_string(g.n) + " send and receive counts and cols > 0");
      g.send[r] = send;
      g.send_counts[r] = send_counts;
      g.cols[r] = cols;
      g.barrier(rank_);
      int64_t dst = 0;
      for (size_t p = 0; p < n; ++p) {
        const std::vector<int64_t>& sc = g.send_counts[p];
        if (g.cols[p] != cols)
          throw Error("all_to_all: rank " + std::to_string(p) + " sends rows of " + std::to_string(g.cols[p]) +
                      " columns, this rank expects " + std::to_string(cols));
        if (sc[r] != recv_counts[p])
          throw Error("all_to_all: rank " + std::to_string(p) + " sends " + std::to_string(sc[r]) +
                      " rows here, this rank expects " + std::to_string(recv_counts[p]));
        const int64_t src = std::accumulate(sc.begin(), sc.begin() + static_cast<std::ptrdiff_t>(r), int64_t{0});
        if (sc[r] > 0)
          std::memcpy(recv + dst * cols, g.send[p] + src * cols, static_cast<size_t>(sc[r] * cols) * sizeof(float));
        dst += sc[r];
      }
      g.barrier(rank_);  // senders' buffers stay untouched until everyone copied
      return 0;
    });
  }

  void abort(const std::string& why) override { group_->abort(rank_, why); }

 private:
  // Runs one collective; a failure breaks the group so that the other ranks fail instead of
  // waiting at a barrier forever.
  template <typename Fn>
  auto guarded(Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const std::exception& e) {
      group_->abort(rank_, e.what());
      throw;
    }
  }

  std::shared_ptr<InProcessGroup> group_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<ExpertTransport>> make_in_process_transports(int world_size, const CollectiveWait& wait) {
  if (world_size < 1) throw Error("in-process transport: world size " + std::to_string(world_size) + " < 1");
  auto group = std::make_shared<InProcessGroup>(world_size, wait);
  std::vector<std::unique_ptr<ExpertTransport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<InProcessTransport>(group, r));
  return out;
}

#if !MOE_HAVE_NCCL
NcclUniqueId nccl_unique_id() {
  throw Error("NCCL transport: gst-moe was built without CUDA/NCCL (-Dcuda=disabled, or nccl.h/libnccl not found)");
}

std::unique_ptr<ExpertTransport> make_nccl_transport(int rank, int, const NcclUniqueId&, int device,
                                                     const CollectiveWait&) {
  throw Error("NCCL transport (rank " + std::to_string(rank) + ", cuda:" + std::to_string(device) +
              "): gst-moe was built without CUDA/NCCL (-Dcuda=disabled, or nccl.h/libnccl not found)");
}
#endif

// ---- expert parallelism ------------------------------------------------------------------------

std::vector<int> ExpertParallelMoe::block_owners(int num_experts, int world_size) {
  if (num_experts < 1 || world_size < 1)
    throw Error("block_owners: " + std::to_string(num_experts) + " experts over " + std::to_string(world_size) +
                " ranks");
  std::vector<int> owner(static_cast<size_t>(num_experts));
  const int base = num_experts / world_size, extra = num_experts % world_size;
  int e = 0;
  for (int r = 0; r < world_size; ++r)
    for (int i = 0; i < base + (r < extra ? 1 : 0); ++i) owner[static_cast<size_t>(e++)] = r;
  return owner;
}

ExpertParallelMoe::ExpertParallelMoe(ExpertTransport& transport, kernels::Backend& backend, const MoeConfig& config,
                                     std::vector<int> owner)
    : transport_(transport), backend_(backend), config_(config), owner_(std::move(owner)) {
  config_.validate();
  const int W = transport.world_size(), E = config_.num_experts;
  if (static_cast<int>(owner_.size()) != E)
    throw Error("ExpertParallelMoe: " + std::to_string(owner_.size()) + " owners for " + std::to_string(E) +
                " experts");
  std::vector<int> per_rank(static_cast<size_t>(W), 0);
  for (int e = 0; e < E; ++e) {
    const int o = owner_[static_cast<size_t>(e)];
    if (o < 0 || o >= W)
      throw Error("ExpertParallelMoe: expert " + std::to_string(e) + " owned by rank " + std::to_string(o) +
                  " outside [0, " + std::to_string(W) + ")");
    ++per_rank[static_cast<size_t>(o)];
    if (o == transport.rank()) local_.push_back(e);
  }
  // Keys: experts in (owner, id) order, so grouping slots by key groups them by owning rank.
  first_key_.assign(static_cast<size_t>(W) + 1, 0);
  for (int r = 0; r < W; ++r)
    first_key_[static_cast<size_t>(r) + 1] = first_key_[static_cast<size_t>(r)] + per_rank[static_cast<size_t>(r)];
  std::vector<int64_t> next(first_key_.begin(), first_key_.end() - 1);
  key_of_.resize(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e)
    key_of_[static_cast<size_t>(e)] = static_cast<int32_t>(next[static_cast<size_t>(owner_[static_cast<size_t>(e)])]++);
  max_local_ = std::max(1, *std::max_element(per_rank.begin(), per_rank.end()));
}

void ExpertParallelMoe::forward(const float* x, const moe::Routing& routing, const LocalWeights& weights, float* y) {
  try {
    forward_impl(x, routing, weights, y);
  } catch (const std::exception& e) {
    // The other ranks may be waiting in a collective for this one: make them fail too.
    transport_.abort(e.what());
    throw;
  }
}

void ExpertParallelMoe::forward_impl(const float* x, const moe::Routing& routing, const LocalWeights& weights,
                                     float* y) {
  const int W = transport_.world_size(), E = config_.num_experts, L = static_cast<int>(local_.size());
  const int64_t N = routing.rows, K = routing.top_k, D = config_.hidden_size, I = config_.intermediate_size;
  const size_t ML = static_cast<size_t>(max_local_);
  if (N < 0 || K <= 0 || routing.expert_ids.size() != static_cast<size_t>(N * K) ||
      routing.weights.size() != routing.expert_ids.size())
    throw Error("ExpertParallelMoe: routing for " + std::to_string(N) + " rows x top_k " + std::to_string(K) + " has " +
                std::to_string(routing.expert_ids.size()) + " ids and " + std::to_string(routing.weights.size()) +
                " weights");
  kernels::Backend& b = backend_;
  const int64_t S = N * K;  // this rank's (row, expert) slots

  // 1. Group this rank's slots by owner (key order) and count them per (rank, local expert).
  std::vector<int32_t> keys(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t e = routing.expert_ids[static_cast<size_t>(s)];
    if (e == Routing::kUnusedSlot) {  // no owner: moe_permute skips it, the combine too
      keys[static_cast<size_t>(s)] = Routing::kUnusedSlot;
      continue;
    }
    if (e < 0 || e >= E)
      throw Error("ExpertParallelMoe: expert id " + std::to_string(e) + " outside [0, " + std::to_string(E) + ")");
    keys[static_cast<size_t>(s)] = key_of_[static_cast<size_t>(e)];
  }
  DeviceBuffer d_keys(b, static_cast<size_t>(S) * sizeof(int32_t));
  DeviceBuffer d_sorted(b, static_cast<size_t>(S * D) * sizeof(float));
  DeviceBuffer d_slot_of(b, static_cast<size_t>(S) * sizeof(int32_t));
  DeviceBuffer d_weights(b, static_cast<size_t>(S) * sizeof(float));
  std::vector<int64_t> offsets(static_cast<size_t>(E) + 1, 0);
  if (S > 0) {
    b.copy_from_host(d_keys.as<int32_t>(), keys.data(), keys.size() * sizeof(int32_t));
    b.copy_from_host(d_weights.as<float>(), routing.weights.data(), routing.weights.size() * sizeof(float));
    offsets = b.moe_permute(d_keys.as<int32_t>(), N, K, E, x, D, d_sorted.as<float>(), d_slot_of.as<int32_t>());
  }
  std::vector<int64_t> send_counts(static_cast<size_t>(W) * ML, 0), send_rows(static_cast<size_t>(W), 0);
  for (int r = 0; r < W; ++r)
    for (int64_t k = first_key_[static_cast<size_t>(r)]; k < first_key_[static_cast<size_t>(r) + 1]; ++k) {
      const int64_t c = offsets[static_cast<size_t>(k) + 1] - offsets[static_cast<size_t>(k)];
      send_counts[static_cast<size_t>(r) * ML + static_cast<size_t>(k - first_key_[static_cast<size_t>(r)])] = c;
      send_rows[static_cast<size_t>(r)] += c;
    }

  // 2. Dispatch: counts, then rows.
  const std::vector<int64_t> recv_counts = transport_.exchange_counts(send_counts, max_local_);
  std::vector<int64_t> recv_rows(static_cast<size_t>(W), 0);
  for (int p = 0; p < W; ++p)
    for (size_t l = 0; l < ML; ++l) recv_rows[static_cast<size_t>(p)] += recv_counts[static_cast<size_t>(p) * ML + l];
  const int64_t R = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  DeviceBuffer d_recv(b, static_cast<size_t>(R * D) * sizeof(float));
  b.synchronize();  // the transport reads `d_sorted` outside the backend's queue
  transport_.all_to_all(d_sorted.as<float>(), send_rows, d_recv.as<float>(), recv_rows, D);

  // 3. Run the local experts: regroup the received rows (source-major) per local expert.
  DeviceBuffer d_result(b, static_cast<size_t>(R * D) * sizeof(float));
  std::vector<int32_t> lid;
  std::vector<float> ones;
  DeviceBuffer d_lid(b, static_cast<size_t>(R) * sizeof(int32_t));
  DeviceBuffer d_ones(b, static_cast<size_t>(R) * sizeof(float));
  DeviceBuffer d_local(b, static_cast<size_t>(R * D) * sizeof(float));
  DeviceBuffer d_local_slot(b, static_cast<size_t>(R) * sizeof(int32_t));
  DeviceBuffer d_local_out(b, static_cast<size_t>(R * D) * sizeof(float));
  if (R > 0) {
    if (L == 0)
      throw Error("ExpertParallelMoe: rank " + std::to_string(transport_.rank()) + " owns no experts but was sent " +
                  std::to_string(R) + " rows");
    lid.reserve(static_cast<size_t>(R));
    for (int p = 0; p < W; ++p)
      for (size_t l = 0; l < ML; ++l) {
        const int64_t c = recv_counts[static_cast<size_t>(p) * ML + l];
        if (c > 0 && static_cast<int>(l) >= L)
          throw Error("ExpertParallelMoe: rank " + std::to_string(p) + " sent rows for local expert " +
                      std::to_string(l) + " but rank " + std::to_string(transport_.rank()) + " owns " +
                      std::to_string(L));
        lid.insert(lid.end(), static_cast<size_t>(c), static_cast<int32_t>(l));
      }
    ones.assign(static_cast<size_t>(R), 1.0f);
    b.copy_from_host(d_lid.as<int32_t>(), lid.data(), lid.size() * sizeof(int32_t));
    b.copy_from_host(d_ones.as<float>(), ones.data(), ones.size() * sizeof(float));
    const std::vector<int64_t> loff = b.moe_permute(d_lid.as<int32_t>(), R, 1, L, d_recv.as<float>(), D,
                                                    d_local.as<float>(), d_local_slot.as<int32_t>());
    std::vector<kernels::ExpertWeights> ew(static_cast<size_t>(L));
    for (int l = 0; l < L; ++l)
      if (loff[static_cast<size_t>(l) + 1] > loff[static_cast<size_t>(l)])
        ew[static_cast<size_t>(l)] = weights(local_[static_cast<size_t>(l)]);
    b.grouped_swiglu(d_local.as<float>(), loff, ew, D, I, d_local_out.as<float>());
    // Back into arrival order (weight 1 per row: an exact gather).
    b.moe_unpermute(d_local_out.as<float>(), d_local_slot.as<int32_t>(), d_ones.as<float>(), R, 1, D,
                    d_result.as<float>());
  }

  // 4. Combine: results return in the order the rows were sent (this rank's key order).
  b.synchronize();
  transport_.all_to_all(d_result.as<float>(), recv_rows, d_sorted.as<float>(), send_rows, D);
  if (S > 0) b.moe_unpermute(d_sorted.as<float>(), d_slot_of.as<int32_t>(), d_weights.as<float>(), N, K, D, y);
  b.synchronize();  // host vectors copied from above must outlive the queued copies
}

Tensor ExpertParallelMoe::forward_host(const Tensor& x, const moe::Routing& routing, const LocalWeights& weights) {
  const int64_t D = config_.hidden_size;
  if (x.rank() != 2 || x.dim(1) != D || x.dtype() != DType::F32 || !x.is_host() || x.dim(0) != routing.rows)
    throw Error("ExpertParallelMoe: input " + x.describe() + ", expected f32[" + std::to_string(routing.rows) + "," +
                std::to_string(D) + "]@host");
  const int64_t N = x.dim(0);
  Tensor y = Tensor::zeros(DType::F32, {N, D});
  DeviceBuffer d_x(backend_, x.nbytes()), d_y(backend_, y.nbytes());
  if (N > 0) backend_.copy_from_host(d_x.as<float>(), x.data<float>(), x.nbytes());
  forward(d_x.as<float>(), routing, weights, d_y.as<float>());
  if (N > 0) backend_.copy_to_host(y.data<float>(), d_y.as<float>(), y.nbytes());
  return y;
}

}  // namespace moe
