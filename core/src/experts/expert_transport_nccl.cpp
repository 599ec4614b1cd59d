// The NCCL ExpertTransport: built only with CUDA and NCCL (meson: have_nccl).
//
// Every collective is: enqueue inside one NCCL group on the transport's stream, then a polled wait
// (cudaStreamQuery for completion, ncclCommGetAsyncError for failures, CollectiveWait's timeout
// for a peer that never comes). Any failure aborts the communicator: a blocking wait after a
// peer's abort would never return, and ncclCommDestroy can hang after a failure.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <numeric>
#include <string>

#include "moe/error.h"
#include "moe/expert_transport.h"

namespace moe {

namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes), "ncclUniqueId size changed");

std::string prefix(int rank) { return "NCCL transport (rank " + std::to_string(rank) + "): "; }

void check_nccl(ncclResult_t r, const char* what, int rank) {
  if (r != ncclSuccess) throw Error(prefix(rank) + what + ": " + ncclGetErrorString(r));
}

void check_cuda(cudaError_t r, const char* what, int rank) {
  if (r != cudaSuccess) throw Error(prefix(rank) + what + ": " + cudaGetErrorString(r));
}

// ncclGroupStart ... ncclGroupEnd, closed on every exit: a call inside that throws must not leave
// the group open (it would swallow this thread's later NCCL calls).
class NcclGroup {
 public:
  explicit NcclGroup(int rank) : rank_(rank) { check_nccl(ncclGroupStart(), "ncclGroupStart", rank); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();  // unwinding: the caller aborts the communicator next
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    check_nccl(ncclGroupEnd(), "ncclGroupEnd", rank_);
  }

 private:
  int rank_;
  bool open_ = true;
};

class NcclTransport final : public ExpertTransport {
 public:
  NcclTransport(int rank, int world_size, const NcclUniqueId& id, int device, const CollectiveWait& wait)
      : rank_(rank), world_(world_size), device_(device), wait_(wait) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw Error("NCCL transport: rank " + std::to_string(rank) + " outside [0, " + std::to_string(world_size) + ")");
    check_cuda(cudaSetDevice(device), "cudaSetDevice", rank);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", rank);
    ncclUniqueId uid;
    std::memcpy(&uid, id.bytes.data(), sizeof uid);
    const ncclResult_t r = ncclCommInitRank(&comm_, world_size, uid, rank);
    if (r != ncclSuccess) {
      cudaStreamDestroy(stream_);
      check_nccl(r, "ncclCommInitRank", rank);
    }
  }

  ~NcclTransport() override {
    cudaSetDevice(device_);
    if (comm_) ncclCommDestroy(comm_);  // healthy: every error path aborted and cleared it
    if (counts_) cudaFree(counts_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  void abort(const std::string& why) override {
    if (!comm_) return;
    aborted_ = why;
    cudaSetDevice(device_);
    // The peers blocked in a collective with this rank are not woken: their waits time out.
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts, int per_rank) override {
    check_usable();
    const size_t n = static_cast<size_t>(world_), per = static_cast<size_t>(per_rank);
    if (per_rank < 1 || send_counts.size() != n * per)
      throw Error("NCCL transport: exchange_counts got " + std::to_string(send_counts.size()) + " counts for " +
                  std::to_string(world_) + " ranks x " + std::to_string(per_rank));
    std::vector<int64_t> recv(n * per);
    collective("exchange_counts", [&] {
      const size_t need = 2 * n * per;
      if (need > counts_capacity_) {
        if (counts_) check_cuda(cudaFree(counts_), "cudaFree", rank_);
        counts_ = nullptr;
        counts_capacity_ = 0;
        check_cuda(cudaMalloc(reinterpret_cast<void**>(&counts_), need * sizeof(int64_t)), "cudaMalloc", rank_);
        counts_capacity_ = need;
      }
      // The stream is idle (the previous collective was awaited): this copy does not block on it.
      check_cuda(
          cudaMemcpyAsync(counts_, send_counts.data(), n * per * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync", rank_);
      NcclGroup group(rank_);
      for (int p = 0; p < world_; ++p) {
        check_nccl(ncclSend(counts_ + p * per, per, ncclInt64, p, comm_, stream_), "ncclSend", rank_);
        check_nccl(ncclRecv(counts_ + (n + p) * per, per, ncclInt64, p, comm_, stream_), "ncclRecv", rank_);
      }
      group.end();
    });
    // After the wait, on the idle stream: the copy back cannot block on a collective that never
    // completes.
    or_abort([&] {
      check_cuda(
          cudaMemcpyAsync(recv.data(), counts_ + n * per, n * per * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync", rank_);
      check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", rank_);
    });
    return recv;
  }

  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts, int64_t cols) override {
    check_usable();
    const size_t n = static_cast<size_t>(world_);
    if (send_counts.size() != n || recv_counts.size() != n || cols <= 0)
      throw Error("NCCL transport: all_to_all needs " + std::to_string(world_) +
                  " send and receive counts and cols > 0");
    collective("all_to_all", [&] {
      int64_t so = 0, ro = 0;
      NcclGroup group(rank_);
      for (int p = 0; p < world_; ++p) {
        const int64_t sc = send_counts[static_cast<size_t>(p)], rc = recv_counts[static_cast<size_t>(p)];
        if (sc > 0)
          check_nccl(ncclSend(send + so * cols, static_cast<size_t>(sc * cols), ncclFloat32, p, comm_, stream_),
                     "ncclSend", rank_);
        if (rc > 0)
          check_nccl(ncclRecv(recv + ro * cols, static_cast<size_t>(rc * cols), ncclFloat32, p, comm_, stream_),
                     "ncclRecv", rank_);
        so += sc;
        ro += rc;
      }
      group.end();
    });
  }

 private:
  // Throws once abort() was called.
  void check_usable() const {
    if (!comm_) throw Error(prefix(rank_) + "aborted: " + aborted_);
  }

  // Runs `fn`; on any failure aborts the communicator (the transport is unusable from then on)
  // and rethrows.
  template <typename Fn>
  void or_abort(Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      abort(e.what());
      throw;
    }
  }

  // Enqueues one collective on the stream and waits for it, or_abort.
  template <typename Enqueue>
  void collective(const char* what, Enqueue&& enqueue) {
    or_abort([&] {
      check_cuda(cudaSetDevice(device_), "cudaSetDevice", rank_);
      enqueue();
      wait_for_collective(wait_, prefix(rank_) + what, [this] { return complete(); });
    });
  }

  // Whether the stream's work is done; throws on an asynchronous NCCL error or a CUDA error.
  bool complete() {
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", rank_);
    if (async != ncclSuccess && async != ncclInProgress) check_nccl(async, "asynchronous error", rank_);
    const cudaError_t state = cudaStreamQuery(stream_);
    if (state == cudaErrorNotReady) {
      // Not an error, but the runtime may keep it as the thread's last error, which the CUDA
      // backend's next launch check (same thread) would report.
      if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
      return false;
    }
    check_cuda(state, "cudaStreamQuery", rank_);
    return true;
  }

  int rank_, world_, device_;
  CollectiveWait wait_;
  ncclComm_t comm_ = nullptr;
  std::string aborted_;
  cudaStream_t stream_ = nullptr;
  int64_t* counts_ = nullptr;  // [send | recv] counts on the device
  size_t counts_capacity_ = 0;
};

}  // namespace

NcclUniqueId nccl_unique_id() {
  ncclUniqueId uid;
  check_nccl(ncclGetUniqueId(&uid), "ncclGetUniqueId", 0);
  NcclUniqueId id;
  std::memcpy(id.bytes.data(), &uid, sizeof uid);
  return id;
}

std::unique_ptr<ExpertTransport> make_nccl_transport(int rank, int world_size, const NcclUniqueId& id, int device,
                                                     const CollectiveWait& wait) {
  return std::make_unique<NcclTransport>(rank, world_size, id, device, wait);
}

}  // namespace moe
