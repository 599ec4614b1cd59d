// The NCCL ExpertTransport: built only with CUDA and NCCL (meson: have_nccl).
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

void check_nccl(ncclResult_t r, const char* what, int rank) {
  if (r != ncclSuccess)
    throw Error(std::string("NCCL transport (rank ") + std::to_string(rank) + "): " + what + ": " +
                ncclGetErrorString(r));
}

void check_cuda(cudaError_t r, const char* what, int rank) {
  if (r != cudaSuccess)
    throw Error(std::string("NCCL transport (rank ") + std::to_string(rank) + "): " + what + ": " +
                cudaGetErrorString(r));
}

class NcclTransport final : public ExpertTransport {
 public:
  NcclTransport(int rank, int world_size, const NcclUniqueId& id, int device)
      : rank_(rank), world_(world_size), device_(device) {
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
    if (counts_) cudaFree(counts_);
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  void abort(const std::string& why) override {
    if (!comm_) return;
    aborted_ = why;
    cudaSetDevice(device_);
    ncclCommAbort(comm_);  // peers blocked in a collective with this rank return an error
    comm_ = nullptr;
  }

  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_counts, int per_rank) override {
    check_usable();
    const size_t n = static_cast<size_t>(world_), per = static_cast<size_t>(per_rank);
    if (per_rank < 1 || send_counts.size() != n * per)
      throw Error("NCCL transport: exchange_counts got " + std::to_string(send_counts.size()) + " counts for " +
                  std::to_string(world_) + " ranks x " + std::to_string(per_rank));
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", rank_);
    const size_t need = 2 * n * per;
    if (need > counts_capacity_) {
      if (counts_) cudaFree(counts_);
      counts_ = nullptr;
      check_cuda(cudaMalloc(reinterpret_cast<void**>(&counts_), need * sizeof(int64_t)), "cudaMalloc", rank_);
      counts_capacity_ = need;
    }
    int64_t* d_send = counts_;
    int64_t* d_recv = counts_ + n * per;
    std::vector<int64_t> recv(n * per);
    check_cuda(cudaMemcpyAsync(d_send, send_counts.data(), n * per * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync", rank_);
    check_nccl(ncclGroupStart(), "ncclGroupStart", rank_);
    for (int p = 0; p < world_; ++p) {
      check_nccl(ncclSend(d_send + p * per, per, ncclInt64, p, comm_, stream_), "ncclSend", rank_);
      check_nccl(ncclRecv(d_recv + p * per, per, ncclInt64, p, comm_, stream_), "ncclRecv", rank_);
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd", rank_);
    check_cuda(cudaMemcpyAsync(recv.data(), d_recv, n * per * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync", rank_);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", rank_);
    return recv;
  }

  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts, int64_t cols) override {
    check_usable();
    const size_t n = static_cast<size_t>(world_);
    if (send_counts.size() != n || recv_counts.size() != n || cols <= 0)
      throw Error("NCCL transport: all_to_all needs " + std::to_string(world_) + " send and receive counts and cols > 0");
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", rank_);
    int64_t so = 0, ro = 0;
    check_nccl(ncclGroupStart(), "ncclGroupStart", rank_);
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
    check_nccl(ncclGroupEnd(), "ncclGroupEnd", rank_);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", rank_);
  }

 private:
  int rank_, world_, device_;
  // Throws once abort() was called.
  void check_usable() const {
    if (!comm_)
      throw Error("NCCL transport (rank " + std::to_string(rank_) + "): aborted: " + aborted_);
  }

  ncclComm_t comm_ = nullptr;
  std::string aborted_;
  cudaStream_t stream_ = nullptr;
  int64_t* counts_ = nullptr;
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

std::unique_ptr<ExpertTransport> make_nccl_transport(int rank, int world_size, const NcclUniqueId& id, int device) {
  return std::make_unique<NcclTransport>(rank, world_size, id, device);
}

}  // namespace moe
