// gst-moe: a bounded cache of query embeddings (moe-encode's cache-bytes; docs/operations.md,
// "The query cache").
//
// A key says exactly what the encoder would see, and with what: a model version (the caller's
// string: the weights' fingerprint, the device and the precision, so that any change of model or
// setting misses) and either a text's token ids (the tokenizer's output after its normalisation
// and truncation: two texts that tokenise alike embed alike) or an image file's bytes (their
// SHA-256: the same file decodes to the same pixels). Equal keys therefore give bit-identical
// embeddings, and a hit may stand for an encoder call (and an image's decoding).
//
// The cache holds at most capacity_bytes, counted as each entry's key, embedding and a fixed
// bookkeeping overhead; inserting past the bound evicts the least recently used entries (lookups
// and inserts both make an entry the most recent), and an entry larger than the whole bound is
// refused rather than emptying the cache. Capacity 0 disables it: lookups miss without counting.
//
// Threads: every member may be called from any thread (one internal lock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

// Since the cache was made (counters), or now (gauges).
struct QueryCacheStats {
  uint64_t hits = 0;        // lookups that found their key
  uint64_t misses = 0;      // lookups that did not (none are counted while the cache is disabled)
  uint64_t insertions = 0;  // entries added
  uint64_t evictions = 0;   // entries dropped to stay within the bound (inserts and smaller capacities)
  uint64_t refused = 0;     // inserts of an entry larger than the whole bound
  // Gauges:
  uint64_t entries = 0;
  uint64_t bytes = 0;  // held by the entries (entry_bytes of each)
  uint64_t capacity_bytes = 0;
};

class QueryCache {
 public:
  // Bookkeeping counted per entry besides its key and embedding (list and hash-map nodes, the
  // string and vector headers): an estimate, so that many tiny entries cannot exceed the bound.
  static constexpr size_t kEntryOverheadBytes = 128;

  explicit QueryCache(size_t capacity_bytes);
  ~QueryCache();
  QueryCache(const QueryCache&) = delete;
  QueryCache& operator=(const QueryCache&) = delete;

  // The key of a text, from the ids the model's tokenizer made of it.
  static std::string text_key(const std::string& model_version, const std::vector<int32_t>& token_ids);
  // The key of an encoded image file (PNG, JPEG...).
  static std::string image_file_key(const std::string& model_version, const uint8_t* data, size_t size);
  // What an entry with a key of `key_bytes` and an embedding of `width` floats counts for.
  static size_t entry_bytes(size_t key_bytes, size_t width);

  // On a hit, copies the embedding into `embedding` (resized) and makes the entry the most recent.
  bool lookup(const std::string& key, std::vector<float>* embedding);
  // Adds (or replaces) the entry, then evicts the least recently used ones until the bound holds.
  // Does nothing while the cache is disabled; an entry larger than the bound is refused.
  void insert(const std::string& key, const float* embedding, size_t width);
  // A new bound: evicts down to it at once (0 empties and disables the cache).
  void set_capacity(size_t capacity_bytes);
  QueryCacheStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
