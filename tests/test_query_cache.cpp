// moe::QueryCache: versioned keys, the byte bound, LRU order, refusal of entries larger than the
// bound, disabling, and the counters.
#include "moe/query_cache.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

using moe::QueryCache;

namespace {

constexpr size_t kWidth = 4;

std::vector<float> embedding(float v) { return std::vector<float>(kWidth, v); }

std::string key(int id) { return QueryCache::text_key("model", {49406, id, 49407}); }

// The bound that holds exactly `n` entries of key(...)'s size.
size_t bound_for(size_t n) { return n * QueryCache::entry_bytes(key(0).size(), kWidth); }

void insert(QueryCache& cache, int id) { cache.insert(key(id), embedding(static_cast<float>(id)).data(), kWidth); }

bool has(QueryCache& cache, int id) {
  std::vector<float> out;
  return cache.lookup(key(id), &out);
}

}  // namespace

TEST(QueryCache, HitReturnsTheStoredEmbeddingAndCounts) {
  QueryCache cache(bound_for(4));
  std::vector<float> out;
  EXPECT_FALSE(cache.lookup(key(1), &out));
  const std::vector<float> stored = {0.25f, -1.5f, 3.0f, 1e-30f};
  cache.insert(key(1), stored.data(), stored.size());
  ASSERT_TRUE(cache.lookup(key(1), &out));
  EXPECT_EQ(out, stored);
  const moe::QueryCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.insertions, 1u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, bound_for(1));
  EXPECT_EQ(s.capacity_bytes, bound_for(4));
}

TEST(QueryCache, KeysDifferByModelVersionKindAndInput) {
  const std::vector<int32_t> ids = {49406, 320, 49407};
  EXPECT_EQ(QueryCache::text_key("fp/cpu/fp32", ids), QueryCache::text_key("fp/cpu/fp32", ids));
  EXPECT_NE(QueryCache::text_key("fp/cpu/fp32", ids), QueryCache::text_key("fp/cpu/fp16", ids));
  EXPECT_NE(QueryCache::text_key("fp/cpu/fp32", ids), QueryCache::text_key("fp/cpu/fp32", {49406, 321, 49407}));

  const std::vector<uint8_t> file = {0x89, 'P', 'N', 'G', 1, 2, 3};
  const std::string image_key = QueryCache::image_file_key("fp/cpu/fp32", file.data(), file.size());
  EXPECT_EQ(image_key, QueryCache::image_file_key("fp/cpu/fp32", file.data(), file.size()));
  EXPECT_NE(image_key, QueryCache::image_file_key("other/cpu/fp32", file.data(), file.size()));
  // One changed byte, or one byte less, is another file.
  std::vector<uint8_t> changed = file;
  changed.back() = 4;
  EXPECT_NE(image_key, QueryCache::image_file_key("fp/cpu/fp32", changed.data(), changed.size()));
  EXPECT_NE(image_key, QueryCache::image_file_key("fp/cpu/fp32", file.data(), file.size() - 1));

  // A version change misses in a cache that holds the old version's entry.
  QueryCache cache(1 << 20);
  const std::vector<float> e = embedding(1);
  cache.insert(QueryCache::text_key("fp/cpu/fp32", ids), e.data(), kWidth);
  std::vector<float> out;
  EXPECT_TRUE(cache.lookup(QueryCache::text_key("fp/cpu/fp32", ids), &out));
  EXPECT_FALSE(cache.lookup(QueryCache::text_key("fp/cpu/fp16", ids), &out));
  EXPECT_FALSE(cache.lookup(image_key, &out));
}

TEST(QueryCache, EvictsTheLeastRecentlyUsedToStayWithinTheBound) {
  QueryCache cache(bound_for(3));
  insert(cache, 1);
  insert(cache, 2);
  insert(cache, 3);
  EXPECT_TRUE(has(cache, 1));  // 1 is now the most recent: 2 is the oldest
  insert(cache, 4);
  EXPECT_FALSE(has(cache, 2));
  EXPECT_TRUE(has(cache, 3));
  EXPECT_TRUE(has(cache, 1));
  EXPECT_TRUE(has(cache, 4));
  insert(cache, 5);  // oldest now: 3
  EXPECT_FALSE(has(cache, 3));
  const moe::QueryCacheStats s = cache.stats();
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.entries, 3u);
  EXPECT_EQ(s.bytes, bound_for(3));
  EXPECT_LE(s.bytes, s.capacity_bytes);
}

TEST(QueryCache, ReinsertingAKeyReplacesItsEntry) {
  QueryCache cache(bound_for(2));
  insert(cache, 1);
  const std::vector<float> other = embedding(9);
  cache.insert(key(1), other.data(), kWidth);
  std::vector<float> out;
  ASSERT_TRUE(cache.lookup(key(1), &out));
  EXPECT_EQ(out, other);
  EXPECT_EQ(cache.stats().entries, 1u);
  EXPECT_EQ(cache.stats().bytes, bound_for(1));
}

TEST(QueryCache, EntryLargerThanTheBoundIsRefusedWithoutEvictingOthers) {
  QueryCache cache(bound_for(2));
  insert(cache, 1);
  // A hostile text: a million token ids would make a key of 4 MB.
  const std::vector<int32_t> huge(1'000'000, 320);
  const std::string huge_key = QueryCache::text_key("model", huge);
  const std::vector<float> e = embedding(2);
  cache.insert(huge_key, e.data(), kWidth);
  std::vector<float> out;
  EXPECT_FALSE(cache.lookup(huge_key, &out));
  EXPECT_TRUE(has(cache, 1));
  const moe::QueryCacheStats s = cache.stats();
  EXPECT_EQ(s.refused, 1u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.bytes, bound_for(1));
}

TEST(QueryCache, SmallerCapacityEvictsAtOnceAndZeroDisables) {
  QueryCache cache(bound_for(3));
  insert(cache, 1);
  insert(cache, 2);
  insert(cache, 3);
  cache.set_capacity(bound_for(1));
  EXPECT_EQ(cache.stats().entries, 1u);
  EXPECT_EQ(cache.stats().evictions, 2u);
  EXPECT_TRUE(has(cache, 3));  // the most recent stays

  cache.set_capacity(0);
  const moe::QueryCacheStats emptied = cache.stats();
  EXPECT_EQ(emptied.entries, 0u);
  EXPECT_EQ(emptied.bytes, 0u);
  insert(cache, 4);
  EXPECT_FALSE(has(cache, 4));
  const moe::QueryCacheStats disabled = cache.stats();
  EXPECT_EQ(disabled.entries, 0u);
  EXPECT_EQ(disabled.misses, emptied.misses);  // a disabled cache counts no lookups
  EXPECT_EQ(disabled.insertions, emptied.insertions);
}
