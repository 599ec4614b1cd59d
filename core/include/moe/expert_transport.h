// gst-moe: expert parallelism across processes (docs/expert-cache.md, "Transport").
//
// ExpertTransport is the collective a group of ranks needs to run a MoE layer whose experts are
// spread over them: an exchange of row counts, then an all-to-all of rows. Two implementations:
//  - in-process (make_in_process_transports): N transports for N threads of one process, sharing
//    memory and synchronised by a barrier; host buffers. Used by the CPU tests.
//  - NCCL (make_nccl_transport, built with CUDA only): ncclSend/ncclRecv pairs inside
//    ncclGroupStart/End on device buffers of one CUDA device per rank, then a polled wait
//    (cudaStreamQuery and ncclCommGetAsyncError); the communicator comes from an NcclUniqueId
//    that rank 0 creates and the caller distributes (MPI, a file, a socket).
//
// ExpertParallelMoe runs the routed experts of a layer over such a group: every rank owns a
// subset of the experts; a rank's rows are sent, once per (row, expert) slot, to the owner of the
// expert, run there with the backend's grouped operations and sent back, then combined with the
// routing weights.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "moe/moe_layer.h"

namespace moe {

// How a rank waits for a collective to complete. It polls, so that a peer that failed, hung or
// aborted cannot block it for ever (NCCL: ncclCommAbort on one rank does not wake the peers
// blocked in a collective with it), and gives up after `timeout`: the rank then aborts the group
// and throws. The timeout also covers the time peers spend before they reach the collective, so
// it must exceed the longest batch a peer may be computing.
struct CollectiveWait {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::chrono::microseconds poll_interval{100};
};

// Calls `poll` until it returns true (the collective completed), sleeping wait.poll_interval
// between calls. What `poll` throws (a failure the collective reported) propagates; when
// wait.timeout passes first, throws moe::Error "<what>: not complete after <timeout> ms ...".
void wait_for_collective(const CollectiveWait& wait, const std::string& what, const std::function<bool()>& poll);

// Collectives: every rank of the group calls them in the same order and waits for them as
// CollectiveWait says. A rank whose collective fails or times out aborts the group, and so does a
// rank that calls abort() after failing between collectives: the other ranks' pending and later
// calls then throw (in-process: at once; NCCL: the aborted communicator stops this rank's
// transport, and the peers' waits time out, then abort theirs).
class ExpertTransport {
 public:
  virtual ~ExpertTransport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // send_counts holds world_size() groups of `per_rank` counts, group p for rank p. Returns the
  // counts every rank sent to this one: group p is what rank p sent here. Host vectors.
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts, int per_rank = 1) = 0;

  // `send` holds rows of `cols` f32 grouped by destination rank in rank order (send_counts[p]
  // rows for rank p); `recv` receives rows grouped by source rank (recv_counts[p] rows from
  // rank p), as exchange_counts() reported. Buffers are in the transport's memory (host for the
  // in-process transport, the rank's device for NCCL); both must hold their rows. Returns when
  // `recv` is complete and `send` may be reused.
  virtual void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                          const std::vector<int64_t>& recv_counts, int64_t cols) = 0;

  // Breaks the group: every later collective on any rank throws moe::Error naming `why`.
  virtual void abort(const std::string& why) = 0;
};

// N transports that talk to each other through shared memory; transport i has rank i and is used
// by one thread. Throws moe::Error for N < 1.
std::vector<std::unique_ptr<ExpertTransport>> make_in_process_transports(int world_size,
                                                                         const CollectiveWait& wait = {});

// NCCL's ncclUniqueId as plain bytes, so callers need no NCCL header to pass it around.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};
// Rank 0 calls this once and hands the id to every rank.
NcclUniqueId nccl_unique_id();
// Joins the group on CUDA device `device` (ncclCommInitRank; blocks until every rank joined).
// Throws moe::Error saying why when built without CUDA or when NCCL fails. A healthy
// communicator is destroyed with the transport; one that saw an error is aborted instead
// (ncclCommDestroy can hang after a failure).
std::unique_ptr<ExpertTransport> make_nccl_transport(int rank, int world_size, const NcclUniqueId& id, int device,
                                                     const CollectiveWait& wait = {});

// The routed experts of one MoE layer over a transport group.
class ExpertParallelMoe {
 public:
  // Expert e is owned by rank owner[e] (owner.size() == num_experts, every rank in
  // [0, world_size)). `backend` holds this rank's buffers and runs its experts; its memory must
  // be the transport's (host for in-process, the NCCL device for NCCL).
  ExpertParallelMoe(ExpertTransport& transport, kernels::Backend& backend, const MoeConfig& config,
                    std::vector<int> owner);

  // Owners for `world_size` ranks in contiguous blocks of experts (the first ranks take one more
  // when num_experts is not a multiple).
  static std::vector<int> block_owners(int num_experts, int world_size);

  // Weights of an expert this rank owns, in backend memory; called only for owned experts that
  // received rows in this call (e.g. HostExpertStore::host_weights on a host backend, or a
  // BatchLease::acquire of an ExpertCache).
  using LocalWeights = std::function<kernels::ExpertWeights(int32_t expert)>;

  // Collective; when it throws on one rank it aborts the transport, so the others throw too.
  // y[rows, hidden] = Σ_j routing.weight(row, j) · expert_{routing.expert(row, j)}(x[row])
  // for this rank's rows x[rows, hidden] (rows = routing.rows, may be 0); x and y in backend
  // memory, routing on the host. The shared expert (Qwen2-MoE) is dense and not part of it.
  void forward(const float* x, const moe::Routing& routing, const LocalWeights& weights, float* y);

  // forward() for host tensors (copies in and out of the backend).
  Tensor forward_host(const Tensor& x, const moe::Routing& routing, const LocalWeights& weights);

  const std::vector<int>& owner() const { return owner_; }
  // Experts this rank owns, ascending.
  const std::vector<int32_t>& local_experts() const { return local_; }

 private:
  void forward_impl(const float* x, const moe::Routing& routing, const LocalWeights& weights, float* y);

  ExpertTransport& transport_;
  kernels::Backend& backend_;
  MoeConfig config_;
  std::vector<int> owner_;
  std::vector<int32_t> local_;      // owned experts
  std::vector<int32_t> key_of_;     // expert -> position in (owner, expert) order
  std::vector<int64_t> first_key_;  // rank -> its first key (world_size + 1 entries)
  int max_local_ = 0;               // most experts any rank owns
};

}  // namespace moe
