// The CPU backend's intra-op threads: a fixed pool whose workers block on a condition variable
// between jobs. OpenMP teams (libgomp's default wait policy) spin at their barriers, and collapse
// by 10-20x when other processes hold the cores (docs/benchmarks.md, "CPU GEMM libraries and
// peers"); blocking workers give the cores back instead.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::kernels::cpu {

// The cores this process may run on (sched_getaffinity), at least 1.
int usable_cores();

class ThreadPool {
 public:
  // `threads` ≥ 1 counts the calling thread: threads - 1 workers are started.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Runs task(i) for every i in [0, tasks) and returns when all are done. The calling thread and
  // the workers take the next i in turn, so a worker that the OS has not yet scheduled (its core
  // held by another process) leaves its share to the others instead of holding the call up.
  // Callable from any thread: while another caller's job holds the workers, this one runs every
  // task itself instead of waiting. A task must not throw.
  void run(int tasks, const std::function<void(int)>& task);

 private:
  void work();

  const int threads_;
  std::mutex busy_;  // held by the caller whose job the workers run
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int)>* task_ = nullptr;
  int tasks_ = 0;
  std::atomic<int> next_{0};  // the next task to take
  int joined_ = 0;            // workers inside the current job
  bool open_ = false;         // workers may still join the current job
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;  // last: start after the members they use
};

}  // namespace moe::kernels::cpu
