#include "cpu_thread_pool.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>

namespace moe::kernels::cpu {

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { work(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run(int tasks, const std::function<void(int)>& task) {
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (tasks <= 1 || workers_.empty() || !busy.owns_lock()) {
    for (int i = 0; i < tasks; ++i) task(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = &task;
    tasks_ = tasks;
    next_ = 0;
    open_ = true;
    ++generation_;
  }
  start_cv_.notify_all();
  for (int i; (i = next_.fetch_add(1)) < tasks;) task(i);
  std::unique_lock<std::mutex> lock(mu_);
  open_ = false;  // a worker waking from now on finds nothing left; wait for those inside
  done_cv_.wait(lock, [&] { return joined_ == 0; });
}

void ThreadPool::work() {
  // An OpenMP setting is per thread: code run here (oneDNN's primitives) uses one thread, no team.
  omp_set_num_threads(1);
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* task;
    int tasks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (!open_) continue;
      ++joined_;
      task = task_;
      tasks = tasks_;
    }
    for (int i; (i = next_.fetch_add(1)) < tasks;) (*task)(i);
    std::lock_guard<std::mutex> lock(mu_);
    if (--joined_ == 0) done_cv_.notify_one();
  }
}

}  // namespace moe::kernels::cpu
