#include "moe/compute.h"

#include <glib.h>

#include <algorithm>
#include <cctype>
#include <map>

#include "moe/error.h"

namespace moe {

namespace {

constexpr const char* kLogDomain = "moe";

std::string trim(const std::string& s) {
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  const auto b = std::find_if(s.begin(), s.end(), not_space);
  const auto e = std::find_if(s.rbegin(), s.rend(), not_space).base();
  return b < e ? std::string(b, e) : std::string();
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// cuda_device_count's reason, as the tail of "no usable CUDA device: <reason>".
std::string no_cuda_reason(const std::string& why) {
  const std::string prefix = "no usable CUDA device: ";
  return why.rfind(prefix, 0) == 0 ? why.substr(prefix.size()) : why;
}

struct Resolved {
  std::string name;  // "cpu" or "cuda:N"
  int cuda = -1;     // N, or -1 for the CPU
  std::string reason;
  bool automatic = false;  // "auto" chose
};

Resolved resolve(const std::string& requested) {
  const std::string d = trim(requested);
  const std::string quoted = "device '" + requested + "'";
  if (d == "cpu") return {"cpu", -1, quoted + " requested", false};
  if (d == "auto") {
    std::string why;
    const int n = kernels::cuda_device_count(&why);
    if (n == 0) return {"cpu", -1, quoted + ": no usable CUDA device: " + no_cuda_reason(why), true};
    // A device this build cannot run on (no code for its compute capability, no context) falls
    // back to the CPU like a missing driver, instead of failing at the first kernel.
    if (!kernels::cuda_device_usable(0, &why)) return {"cpu", -1, quoted + ": cuda:0: " + why, true};
    return {"cuda:0", 0, quoted + ": " + std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s") + " present", true};
  }
  int index = -1;
  if (d == "cuda") {
    index = 0;
  } else if (d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() <= 5 + 6 &&
             std::all_of(d.begin() + 5, d.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    index = std::stoi(d.substr(5));
  } else {
    throw Error(quoted + ": unknown device (expected cpu, cuda:N or auto)");
  }
  const std::string name = "cuda:" + std::to_string(index);
  std::string why;
  const int n = kernels::cuda_device_count(&why);
  const std::string which = d == name ? quoted : quoted + " (" + name + ")";
  if (n == 0) throw Error(which + ": no usable CUDA device: " + no_cuda_reason(why));
  if (index >= n)
    throw Error(which + ": no such CUDA device (" + std::to_string(n) +
                " present: cuda:0..cuda:" + std::to_string(n - 1) + ")");
  if (!kernels::cuda_device_usable(index, &why)) throw Error(which + ": " + why);
  return {name, index, quoted + " requested", false};
}

// One backend per device while anyone holds it; the mutex travels with it.
struct SharedBackend {
  std::unique_ptr<kernels::Backend> backend;
  std::shared_ptr<std::mutex> mutex;  // null for host-memory backends
  int threads = 0;                    // ComputeOptions::threads it was created with
};

std::mutex registry_mutex;
std::map<std::string, std::weak_ptr<SharedBackend>>& registry() {
  static auto* r = new std::map<std::string, std::weak_ptr<SharedBackend>>();  // never destroyed
  return *r;
}

}  // namespace

kernels::WeightType parse_precision(const std::string& name) {
  const std::string p = lower(trim(name));
  if (p == "f32" || p == "fp32") return kernels::WeightType::F32;
  if (p == "f16" || p == "fp16") return kernels::WeightType::F16;
  if (p == "bf16") return kernels::WeightType::BF16;
  throw Error("precision '" + name + "': unknown (expected fp32, fp16 or bf16)");
}

std::string resolve_device(const std::string& device, std::string* reason) {
  Resolved r = resolve(device);
  if (reason) *reason = r.reason;
  return r.name;
}

std::shared_ptr<kernels::Backend> open_backend(const std::string& device, std::string* chosen_reason) {
  ComputeOptions options;
  options.device = device;
  return open_backend(options, chosen_reason);
}

std::shared_ptr<kernels::Backend> open_backend(const ComputeOptions& options, std::string* chosen_reason) {
  const std::string& device = options.device;
  if (options.threads < 0)
    throw Error("threads " + std::to_string(options.threads) + ": must be 0 (the cores this process may use) or more");
  const Resolved r = resolve(device);
  std::shared_ptr<SharedBackend> shared;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    std::weak_ptr<SharedBackend>& slot = registry()[r.name];
    shared = slot.lock();
    if (!shared) {
      auto made = std::make_shared<SharedBackend>();
      kernels::CpuBackendOptions cpu;
      cpu.threads = options.threads;
      try {
        made->backend = r.cuda < 0 ? kernels::make_cpu_backend(cpu) : kernels::make_cuda_backend(r.cuda);
      } catch (const Error& e) {
        throw Error("device '" + device + "': " + e.what());
      }
      if (!made->backend->is_host_memory()) made->mutex = std::make_shared<std::mutex>();
      made->threads = options.threads;
      slot = made;
      shared = std::move(made);
    } else if (r.cuda < 0 && options.threads != 0 && options.threads != shared->threads) {
      const std::string kept =
          shared->threads == 0 ? "the cores this process may use" : std::to_string(shared->threads) + " threads";
      g_log(kLogDomain, G_LOG_LEVEL_MESSAGE,
            "threads %d: the CPU backend is in use with %s; it keeps them until its last user closes it",
            options.threads, kept.c_str());
    }
  }
  const std::string line =
      r.reason + "; using the " + (r.cuda < 0 ? std::string("CPU backend") : "CUDA backend on " + r.name);
  if (r.automatic)
    g_log(kLogDomain, G_LOG_LEVEL_MESSAGE, "%s", line.c_str());
  else
    g_log(kLogDomain, G_LOG_LEVEL_INFO, "%s", line.c_str());
  if (chosen_reason) *chosen_reason = line;
  kernels::Backend* raw = shared->backend.get();
  return std::shared_ptr<kernels::Backend>(std::move(shared), raw);
}

std::shared_ptr<std::mutex> backend_mutex(const kernels::Backend& backend) {
  if (backend.is_host_memory()) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const auto& entry : registry())
    if (auto shared = entry.second.lock(); shared && shared->backend.get() == &backend) return shared->mutex;
  throw Error(backend.name() + ": backend_mutex: this backend was not opened by open_backend");
}

}  // namespace moe
