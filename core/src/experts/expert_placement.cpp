#include "moe/expert_placement.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <set>
#include <sstream>

#include "moe/error.h"

namespace moe {

namespace {

std::string gib(size_t bytes) {
  std::ostringstream s;
  s.precision(2);
  s << std::fixed << static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return s.str();
}

std::string bytes_str(size_t bytes) { return std::to_string(bytes) + " bytes (" + gib(bytes) + ")"; }

// Index of the device with the most capacity left that can take `bytes` and does not hold
// `expert` yet; -1 when none.
int roomiest(const std::vector<ExpertPlacement::Device>& devs, const std::vector<int>& holders, size_t bytes) {
  int best = -1;
  for (int d = 0; d < static_cast<int>(devs.size()); ++d) {
    const auto& dev = devs[static_cast<size_t>(d)];
    if (std::find(holders.begin(), holders.end(), dev.index) != holders.end()) continue;
    const size_t left = dev.capacity - dev.used;
    if (bytes > left) continue;
    if (best < 0 || left > devs[static_cast<size_t>(best)].capacity - devs[static_cast<size_t>(best)].used) best = d;
  }
  return best;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace

const std::vector<int>& ExpertPlacement::devices_of(int expert) const {
  if (expert < 0 || expert >= num_experts())
    throw Error("expert placement: expert " + std::to_string(expert) + " outside [0, " + std::to_string(num_experts()) +
                ")");
  return holders_[static_cast<size_t>(expert)];
}

int ExpertPlacement::choose_replica(int expert, int64_t row) const {
  const std::vector<int>& h = devices_of(expert);
  if (row < 0) throw Error("expert placement: negative row " + std::to_string(row));
  return h[static_cast<size_t>(row % static_cast<int64_t>(h.size()))];
}

std::string ExpertPlacement::describe() const {
  std::ostringstream s;
  for (const Device& d : devices_) {
    s << "device " << d.index << ": " << d.experts.size() << " experts, " << gib(d.used) << " of " << gib(d.capacity)
      << " [";
    for (size_t i = 0; i < d.experts.size(); ++i) s << (i ? " " : "") << d.experts[i];
    s << "]\n";
  }
  return s.str();
}

ExpertPlacement plan_expert_placement(const std::vector<DeviceMemory>& devices, const std::vector<size_t>& expert_bytes,
                                      const std::vector<int64_t>& expert_load, const PlacementOptions& options) {
  const std::string who = "expert placement";
  if (devices.empty()) throw Error(who + ": no devices");
  if (expert_bytes.empty()) throw Error(who + ": no experts");
  if (!expert_load.empty() && expert_load.size() != expert_bytes.size())
    throw Error(who + ": " + std::to_string(expert_load.size()) + " load entries for " +
                std::to_string(expert_bytes.size()) + " experts");
  if (!(options.headroom >= 0.0 && options.headroom < 1.0))
    throw Error(who + ": headroom " + std::to_string(options.headroom) + " outside [0, 1)");
  if (options.max_replicas < 1) throw Error(who + ": max_replicas must be at least 1");
  const int E = static_cast<int>(expert_bytes.size());
  std::vector<int64_t> load(expert_load);
  load.resize(static_cast<size_t>(E), 0);
  for (int e = 0; e < E; ++e) {
    if (expert_bytes[static_cast<size_t>(e)] == 0) throw Error(who + ": expert " + std::to_string(e) + " has 0 bytes");
    if (load[static_cast<size_t>(e)] < 0) throw Error(who + ": expert " + std::to_string(e) + " has a negative load");
  }

  std::vector<ExpertPlacement::Device> devs;
  std::set<int> seen;
  size_t capacity = 0;
  for (const DeviceMemory& d : devices) {
    if (!seen.insert(d.index).second) throw Error(who + ": device " + std::to_string(d.index) + " is listed twice");
    ExpertPlacement::Device dev;
    dev.index = d.index;
    dev.capacity = static_cast<size_t>(static_cast<double>(d.free_bytes) * (1.0 - options.headroom));
    capacity += dev.capacity;
    devs.push_back(dev);
  }
  const size_t need = std::accumulate(expert_bytes.begin(), expert_bytes.end(), size_t{0});
  if (need > capacity) {
    std::ostringstream s;
    s << who << ": the " << E << " experts need " << bytes_str(need) << " but the " << devs.size() << " devices offer "
      << bytes_str(capacity) << " after leaving " << options.headroom * 100.0 << "% headroom (";
    for (size_t i = 0; i < devices.size(); ++i)
      s << (i ? ", " : "") << "device " << devices[i].index << ": " << gib(devices[i].free_bytes) << " free";
    s << "); add devices, lower the headroom or store the experts in a smaller precision";
    throw Error(s.str());
  }

  std::vector<int> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (load[static_cast<size_t>(a)] != load[static_cast<size_t>(b)])
      return load[static_cast<size_t>(a)] > load[static_cast<size_t>(b)];
    return expert_bytes[static_cast<size_t>(a)] > expert_bytes[static_cast<size_t>(b)];
  });

  std::vector<std::vector<int>> holders(static_cast<size_t>(E));
  auto place = [&](int e, int d) {
    devs[static_cast<size_t>(d)].used += expert_bytes[static_cast<size_t>(e)];
    devs[static_cast<size_t>(d)].experts.push_back(e);
    holders[static_cast<size_t>(e)].push_back(devs[static_cast<size_t>(d)].index);
  };
  if (!options.primary.empty()) {
    if (options.primary.size() != static_cast<size_t>(E))
      throw Error(who + ": " + std::to_string(options.primary.size()) + " primaries for " + std::to_string(E) +
                  " experts");
    for (int e = 0; e < E; ++e) {
      const int index = options.primary[static_cast<size_t>(e)];
      const auto it = std::find_if(devs.begin(), devs.end(), [&](const auto& dev) { return dev.index == index; });
      if (it == devs.end())
        throw Error(who + ": the primary of expert " + std::to_string(e) + " is device " + std::to_string(index) +
                    ", which is not listed");
      if (it->used + expert_bytes[static_cast<size_t>(e)] > it->capacity)
        throw Error(who + ": the primaries given for device " + std::to_string(index) + " exceed its " +
                    bytes_str(it->capacity));
      place(e, static_cast<int>(it - devs.begin()));
    }
  }
  for (int e : order) {
    if (!holders[static_cast<size_t>(e)].empty()) continue;  // a given primary
    const int d = roomiest(devs, holders[static_cast<size_t>(e)], expert_bytes[static_cast<size_t>(e)]);
    if (d < 0) {
      std::ostringstream s;
      s << who << ": expert " << e << " (" << bytes_str(expert_bytes[static_cast<size_t>(e)])
        << ") fits on no device after the experts placed before it (left:";
      for (const auto& dev : devs) s << " device " << dev.index << " " << gib(dev.capacity - dev.used) << ";";
      s << " " << options.headroom * 100.0 << "% headroom kept); add devices or lower the headroom";
      throw Error(s.str());
    }
    place(e, d);
  }

  if (options.max_replicas > 1) {
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    const double mean = static_cast<double>(total) / E;
    std::vector<int> hot;
    for (int e : order)  // hottest first
      if (load[static_cast<size_t>(e)] > 0 &&
          static_cast<double>(load[static_cast<size_t>(e)]) >= options.hot_load_factor * mean)
        hot.push_back(e);
    for (int round = 1; round < options.max_replicas; ++round) {
      bool added = false;
      for (int e : hot) {
        if (static_cast<int>(holders[static_cast<size_t>(e)].size()) > round) continue;
        const int d = roomiest(devs, holders[static_cast<size_t>(e)], expert_bytes[static_cast<size_t>(e)]);
        if (d < 0) continue;
        place(e, d);
        added = true;
      }
      if (!added) break;
    }
  }
  for (auto& dev : devs) std::sort(dev.experts.begin(), dev.experts.end());
  return ExpertPlacement(std::move(holders), std::move(devs));
}

std::vector<Placement> parse_device_list(const std::string& spec, int available_cuda) {
  const std::string s = trim(spec);
  const std::string range = available_cuda > 0
                                ? std::to_string(available_cuda) + " CUDA device" + (available_cuda == 1 ? "" : "s") +
                                      " available (cuda:0..cuda:" + std::to_string(available_cuda - 1) + ")"
                                : "no CUDA device available";
  if (s.empty()) throw Error("device list is empty (expected cpu, cuda:N, cuda:N,cuda:M,..., all or auto)");
  if (s == "cpu" || (s == "auto" && available_cuda <= 0)) return {Placement{DeviceKind::Host, 0}};
  if (s == "auto") return parse_device_list("all", available_cuda);
  if (s == "all") {
    if (available_cuda <= 0) throw Error("device list 'all' names every CUDA device, but there is " + range);
    std::vector<Placement> out;
    for (int i = 0; i < available_cuda; ++i) out.push_back(Placement{DeviceKind::Cuda, i});
    return out;
  }
  std::vector<Placement> out;
  size_t begin = 0;
  for (;;) {
    const size_t comma = s.find(',', begin);
    const std::string item = trim(s.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (item.empty()) throw Error("device list '" + spec + "' has an empty entry");
    if (item == "cpu" || item == "all" || item == "auto")
      throw Error("device list '" + spec + "': '" + item + "' cannot be combined with other devices");
    int index = -1;
    if (item == "cuda") {
      index = 0;
    } else if (item.rfind("cuda:", 0) == 0 && item.size() > 5 && item.size() <= 5 + 6 &&
               std::all_of(item.begin() + 5, item.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      index = std::stoi(item.substr(5));
    } else {
      throw Error("device list '" + spec + "': unknown device '" + item +
                  "' (expected cpu, cuda:N, cuda:N,cuda:M,..., all or auto)");
    }
    if (index >= available_cuda)
      throw Error("device list '" + spec + "': cuda:" + std::to_string(index) + " is out of range: " + range);
    for (const Placement& p : out)
      if (p.index == index)
        throw Error("device list '" + spec + "': cuda:" + std::to_string(index) + " is listed twice");
    out.push_back(Placement{DeviceKind::Cuda, index});
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

}  // namespace moe
