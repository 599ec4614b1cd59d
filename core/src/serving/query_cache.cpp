#include "moe/query_cache.h"

#include <glib.h>

#include <iterator>
#include <list>
#include <mutex>
#include <string_view>
#include <unordered_map>

namespace moe {

namespace {

// Keys start with the kind of input and the model version, NUL-terminated: a version never holds a
// NUL, so no text key can equal an image key or a key of another version.
std::string key_prefix(char kind, const std::string& model_version) {
  std::string key(1, kind);
  key += model_version;
  key += '\0';
  return key;
}

void append_bytes(std::string* key, const void* data, size_t size) {
  key->append(static_cast<const char*>(data), size);
}

}  // namespace

struct QueryCache::Impl {
  struct Entry {
    std::string key;
    std::vector<float> embedding;
    size_t bytes;
  };

  mutable std::mutex lock;  // guards everything below
  size_t capacity;
  std::list<Entry> lru;  // most recently used first
  // Views of the keys in `lru`, whose nodes never move.
  std::unordered_map<std::string_view, std::list<Entry>::iterator> index;
  QueryCacheStats stats;

  void erase(std::list<Entry>::iterator it) {
    stats.bytes -= it->bytes;
    index.erase(it->key);
    lru.erase(it);
  }

  void evict_to(size_t bound) {
    while (stats.bytes > bound) {
      erase(std::prev(lru.end()));
      ++stats.evictions;
    }
  }
};

QueryCache::QueryCache(size_t capacity_bytes) : impl_(std::make_unique<Impl>()) { impl_->capacity = capacity_bytes; }

QueryCache::~QueryCache() = default;

std::string QueryCache::text_key(const std::string& model_version, const std::vector<int32_t>& token_ids) {
  std::string key = key_prefix('t', model_version);
  append_bytes(&key, token_ids.data(), token_ids.size() * sizeof(int32_t));
  return key;
}

std::string QueryCache::image_file_key(const std::string& model_version, const uint8_t* data, size_t size) {
  guint8 digest[32];
  gsize digest_len = sizeof digest;
  GChecksum* sha = g_checksum_new(G_CHECKSUM_SHA256);
  g_checksum_update(sha, data, static_cast<gssize>(size));
  g_checksum_get_digest(sha, digest, &digest_len);
  g_checksum_free(sha);
  std::string key = key_prefix('i', model_version);
  append_bytes(&key, digest, digest_len);
  return key;
}

size_t QueryCache::entry_bytes(size_t key_bytes, size_t width) {
  return key_bytes + width * sizeof(float) + kEntryOverheadBytes;
}

bool QueryCache::lookup(const std::string& key, std::vector<float>* embedding) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.lock);
  if (m.capacity == 0) return false;
  const auto found = m.index.find(key);
  if (found == m.index.end()) {
    ++m.stats.misses;
    return false;
  }
  m.lru.splice(m.lru.begin(), m.lru, found->second);
  *embedding = found->second->embedding;
  ++m.stats.hits;
  return true;
}

void QueryCache::insert(const std::string& key, const float* embedding, size_t width) {
  Impl& m = *impl_;
  const size_t bytes = entry_bytes(key.size(), width);
  std::lock_guard<std::mutex> lk(m.lock);
  if (m.capacity == 0) return;
  if (bytes > m.capacity) {
    ++m.stats.refused;
    return;
  }
  if (const auto found = m.index.find(key); found != m.index.end()) m.erase(found->second);
  m.lru.push_front({key, std::vector<float>(embedding, embedding + width), bytes});
  m.index.emplace(m.lru.front().key, m.lru.begin());
  m.stats.bytes += bytes;
  ++m.stats.insertions;
  m.evict_to(m.capacity);
}

void QueryCache::set_capacity(size_t capacity_bytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.lock);
  m.capacity = capacity_bytes;
  m.evict_to(capacity_bytes);
}

QueryCacheStats QueryCache::stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.lock);
  QueryCacheStats s = m.stats;
  s.entries = m.lru.size();
  s.capacity_bytes = m.capacity;
  return s;
}

}  // namespace moe
