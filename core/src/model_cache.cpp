#include "moe/model_cache.h"

#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>

namespace moe {

namespace {

std::string canonical(const std::string& dir) {
  char buf[PATH_MAX];
  return realpath(dir.c_str(), buf) ? std::string(buf) : dir;  // load() reports a missing dir
}

template <typename Model, typename Loader>
std::shared_ptr<const Model> shared_load(const std::string& dir, Loader load) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<const Model>> cache;
  const std::string key = canonical(dir);
  // Loading under the lock makes a second caller wait for the first load instead of loading
  // the same files twice.
  std::lock_guard<std::mutex> lock(mutex);
  if (auto existing = cache[key].lock()) return existing;
  auto model = std::make_shared<const Model>(load(dir));
  cache[key] = model;
  return model;
}

}  // namespace

std::shared_ptr<const ClipModel> shared_clip_model(const std::string& dir) {
  return shared_load<ClipModel>(dir, [](const std::string& d) { return ClipModel::load(d); });
}

std::shared_ptr<const MoeAdapter> shared_moe_adapter(const std::string& dir) {
  return shared_load<MoeAdapter>(dir, [](const std::string& d) { return MoeAdapter::load(d); });
}

}  // namespace moe
