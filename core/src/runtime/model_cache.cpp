#include "moe/model_cache.h"

#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

namespace moe {

namespace {

std::string canonical(const std::string& dir) {
  char buf[PATH_MAX];
  return realpath(dir.c_str(), buf) ? std::string(buf) : dir;  // load() reports a missing dir
}

using Key = std::tuple<std::string, std::string, kernels::WeightType>;  // dir, device, precision

template <typename Model, typename Loader>
std::shared_ptr<const Model> shared_load(const std::string& dir, const ComputeOptions& options, Loader load) {
  static std::mutex mutex;
  static std::map<Key, std::weak_ptr<const Model>> cache;
  // The device as it resolves now (throws for an unusable one, naming it and the reason).
  const Key key{canonical(dir), resolve_device(options.device), options.precision};
  // Loading under the lock makes a second caller wait for the first load instead of loading
  // the same files twice.
  std::lock_guard<std::mutex> lock(mutex);
  if (auto existing = cache[key].lock()) return existing;
  auto model = std::make_shared<const Model>(load(dir, options));
  cache[key] = model;
  return model;
}

}  // namespace

std::shared_ptr<const ClipModel> shared_clip_model(const std::string& dir, const ComputeOptions& options) {
  return shared_load<ClipModel>(dir, options,
                                [](const std::string& d, const ComputeOptions& o) { return ClipModel::load(d, o); });
}

std::shared_ptr<const MoeAdapter> shared_moe_adapter(const std::string& dir, const ComputeOptions& options) {
  return shared_load<MoeAdapter>(dir, options,
                                 [](const std::string& d, const ComputeOptions& o) { return MoeAdapter::load(d, o); });
}

std::shared_ptr<const ClipModel> shared_clip_model(const std::string& dir) { return shared_clip_model(dir, {}); }
std::shared_ptr<const MoeAdapter> shared_moe_adapter(const std::string& dir) { return shared_moe_adapter(dir, {}); }

}  // namespace moe
