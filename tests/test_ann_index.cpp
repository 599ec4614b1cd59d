// moe::AnnIndex: exact search against a brute-force reference, HNSW recall, the on-disk format
// and its validation.
#include <glib.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "moe/ann_index.h"
#include "moe/catalog.h"
#include "moe/error.h"
#include "test_util.h"

namespace {

using moe::AnnBuildOptions;
using moe::AnnHit;
using moe::AnnIndex;
using moe::AnnIndexType;
using moe::AnnItem;
using moe::test::expect_error;
using moe::test::random_unit_vectors;
using moe::test::read_text;
using moe::test::TempDir;
using moe::test::write_text;

std::vector<AnnItem> numbered_items(int64_t n) {
  std::vector<AnnItem> items;
  for (int64_t i = 0; i < n; ++i)
    items.push_back(
        {"id-" + std::to_string(i), "file:///catalog/" + std::to_string(i) + ".png", "caption " + std::to_string(i)});
  return items;
}

// The exact top-k by inner product, best first.
std::vector<std::vector<AnnHit>> brute_force(const std::vector<float>& base, const std::vector<float>& queries, int dim,
                                             int k) {
  const int64_t nb = static_cast<int64_t>(base.size()) / dim, nq = static_cast<int64_t>(queries.size()) / dim;
  std::vector<std::vector<AnnHit>> out;
  for (int64_t q = 0; q < nq; ++q) {
    std::vector<AnnHit> all;
    for (int64_t i = 0; i < nb; ++i) {
      double dot = 0;
      for (int j = 0; j < dim; ++j) dot += static_cast<double>(queries[q * dim + j]) * base[i * dim + j];
      all.push_back({i, static_cast<float>(dot)});
    }
    std::sort(all.begin(), all.end(), [](const AnnHit& a, const AnnHit& b) { return a.score > b.score; });
    all.resize(std::min<size_t>(all.size(), static_cast<size_t>(k)));
    out.push_back(all);
  }
  return out;
}

moe::AnnSearchOptions ef(int ef_search) {
  moe::AnnSearchOptions options;
  options.ef_search = ef_search;
  return options;
}

void expect_same_results(const std::vector<std::vector<AnnHit>>& a, const std::vector<std::vector<AnnHit>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t q = 0; q < a.size(); ++q) {
    ASSERT_EQ(a[q].size(), b[q].size()) << "query " << q;
    for (size_t j = 0; j < a[q].size(); ++j) {
      EXPECT_EQ(a[q][j].item, b[q][j].item) << "query " << q << " rank " << j;
      EXPECT_NEAR(a[q][j].score, b[q][j].score, 1e-6) << "query " << q << " rank " << j;
    }
  }
}

TEST(AnnIndex, FlatMatchesBruteForce) {
  const int dim = 24, k = 10;
  const auto base = random_unit_vectors(500, dim, 1);
  const auto queries = random_unit_vectors(20, dim, 2);
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), 500, numbered_items(500));
  EXPECT_EQ(index.size(), 500);
  EXPECT_EQ(index.dim(), dim);
  EXPECT_EQ(index.type(), AnnIndexType::Flat);

  const auto want = brute_force(base, queries, dim, k);
  // Fewer than 20 queries per call run the engine's own exact search, 20 and more FAISS's.
  for (int64_t n : {1, 7, 19, 20}) {
    SCOPED_TRACE(std::to_string(n) + " queries");
    const auto got = index.search(queries.data(), n, k);
    ASSERT_EQ(got.size(), static_cast<size_t>(n));
    for (size_t q = 0; q < got.size(); ++q) {
      ASSERT_EQ(got[q].size(), static_cast<size_t>(k));
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(got[q][j].item, want[q][j].item) << "query " << q << " rank " << j;
        EXPECT_NEAR(got[q][j].score, want[q][j].score, 1e-5) << "query " << q << " rank " << j;
      }
    }
  }
}

TEST(AnnIndex, ScoresAreCosineWhateverTheInputLength) {
  const int dim = 8;
  auto base = random_unit_vectors(30, dim, 3);
  const auto query = random_unit_vectors(1, dim, 4);
  const auto want = brute_force(base, query, dim, 5);
  for (float& x : base) x *= 7.5f;  // stored and queried vectors are normalised by the index
  std::vector<float> scaled_query(query);
  for (float& x : scaled_query) x *= 0.01f;
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), 30, numbered_items(30));
  const auto got = index.search(scaled_query.data(), 1, 5);
  ASSERT_EQ(got[0].size(), 5u);
  for (int j = 0; j < 5; ++j) {
    EXPECT_EQ(got[0][j].item, want[0][j].item);
    EXPECT_NEAR(got[0][j].score, want[0][j].score, 1e-5);
  }
}

// Fraction of the exact top-k that `got` found.
double recall(const std::vector<std::vector<AnnHit>>& got, const std::vector<std::vector<AnnHit>>& want) {
  size_t found = 0, total = 0;
  for (size_t q = 0; q < want.size(); ++q) {
    std::set<int64_t> truth;
    for (const AnnHit& h : want[q]) truth.insert(h.item);
    for (const AnnHit& h : got[q]) found += truth.count(h.item);
    total += want[q].size();
  }
  return static_cast<double>(found) / static_cast<double>(total);
}

class AnnIndexHnsw : public ::testing::Test {
 protected:
  static constexpr int kDim = 32, kCount = 2000, kQueries = 100, kK = 10;

  AnnIndexHnsw() : index_(AnnIndex::create(kDim, hnsw_options())) {
    index_.add(base_.data(), kCount, numbered_items(kCount));
  }
  static AnnBuildOptions hnsw_options() {
    AnnBuildOptions opts;
    opts.index_type = "hnsw";
    return opts;
  }

  const std::vector<float> base_ = random_unit_vectors(kCount, kDim, 5);
  const std::vector<float> queries_ = random_unit_vectors(kQueries, kDim, 6);
  const std::vector<std::vector<AnnHit>> truth_ = brute_force(base_, queries_, kDim, kK);
  AnnIndex index_;
};

TEST_F(AnnIndexHnsw, RecallAt10) {
  EXPECT_EQ(index_.type(), AnnIndexType::Hnsw);
  const auto got = index_.search(queries_.data(), kQueries, kK, ef(128));
  for (const auto& hits : got) {
    ASSERT_EQ(hits.size(), static_cast<size_t>(kK));
    for (size_t j = 1; j < hits.size(); ++j) EXPECT_GE(hits[j - 1].score, hits[j].score);
  }
  EXPECT_GE(recall(got, truth_), 0.95);
}

TEST_F(AnnIndexHnsw, EfSearchTakesEffect) {
  // Random 32-d data is hard for a graph: a candidate list of k misses neighbours that 128 finds.
  EXPECT_LT(recall(index_.search(queries_.data(), kQueries, kK, ef(1)), truth_),
            recall(index_.search(queries_.data(), kQueries, kK, ef(128)), truth_));
}

TEST_F(AnnIndexHnsw, ConcurrentSearchesWithDifferentEf) {
  const auto low = index_.search(queries_.data(), kQueries, kK, ef(1));
  const auto high = index_.search(queries_.data(), kQueries, kK, ef(128));
  std::vector<std::vector<std::vector<AnnHit>>> results(8);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep) results[t] = index_.search(queries_.data(), kQueries, kK, ef(t % 2 ? 128 : 1));
    });
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < results.size(); ++t) expect_same_results(results[t], t % 2 ? high : low);
}

TEST(AnnIndex, KLargerThanSizeReturnsEveryItem) {
  const int dim = 4;
  const auto base = random_unit_vectors(3, dim, 7);
  for (const char* type : {"flat", "hnsw"}) {
    AnnBuildOptions opts;
    opts.index_type = type;
    AnnIndex index = AnnIndex::create(dim, opts);
    index.add(base.data(), 3, numbered_items(3));
    const auto got = index.search(base.data(), 2, 50);
    ASSERT_EQ(got.size(), 2u);
    for (const auto& hits : got) EXPECT_EQ(hits.size(), 3u) << type;
    EXPECT_EQ(got[0][0].item, 0);
    EXPECT_EQ(got[1][0].item, 1);
  }
}

TEST(AnnIndex, EmptyIndexReturnsEmptyLists) {
  const auto queries = random_unit_vectors(3, 6, 8);
  for (const char* type : {"Flat", "HNSW16", "IVF2,Flat"}) {
    AnnBuildOptions opts;
    opts.index_type = type;
    AnnIndex index = AnnIndex::create(6, opts);
    const auto got = index.search(queries.data(), 3, 10);
    ASSERT_EQ(got.size(), 3u);
    for (const auto& hits : got) EXPECT_TRUE(hits.empty());
  }
}

TEST(AnnIndex, InvalidArguments) {
  expect_error([] { AnnIndex::create(0, {}); }, {"dimension", "0"});
  AnnBuildOptions bad_m;
  bad_m.index_type = "hnsw";
  bad_m.hnsw_m = 1;
  expect_error([&] { AnnIndex::create(8, bad_m); }, {"M", "1"});
  AnnIndex index = AnnIndex::create(4, {});
  const auto v = random_unit_vectors(2, 4, 9);
  expect_error([&] { index.add(v.data(), 2, numbered_items(1)); }, {"2 vectors", "1 items"});
  expect_error([&] { index.search(v.data(), 1, 0); }, {"k", "0"});
  expect_error([&] { index.item(0); }, {"item 0", "out of range"});
}

// Every kind of index, by FAISS's factory strings (PQ codes of 4 bits: 16 centroids per
// sub-quantizer train on the 120 vectors, where 8 bits would need 256, as OPQ does: OPQ is
// saved and loaded by AnnIndexFilterSearch, on more vectors).
struct IndexKind {
  const char* factory;
  AnnIndexType type;
};

class AnnIndexFiles : public ::testing::TestWithParam<IndexKind> {
 protected:
  static constexpr int kDim = 16;
  static constexpr int kCount = 120;

  AnnBuildOptions options() const {
    AnnBuildOptions opts;
    opts.index_type = GetParam().factory;
    return opts;
  }
  AnnIndex build() const {
    AnnIndex index = AnnIndex::create(kDim, options());
    auto items = numbered_items(kCount);
    items[0].caption = "tasse rayée rouge — 赤い縞模様のマグ ☕";
    items[1].id = "";
    items[1].caption = "line\nbreak \"quoted\" \\ tab\t";
    index.add(base_.data(), kCount, items);
    return index;
  }

  const std::vector<float> base_ = random_unit_vectors(kCount, kDim, 10);
  const std::vector<float> queries_ = random_unit_vectors(15, kDim, 11);
  TempDir dir_;
};

TEST_P(AnnIndexFiles, SaveLoadRoundTrip) {
  AnnIndex index = build();
  const std::string path = dir_.file("catalog.faiss");
  index.save(path);
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::exists(path + ".items.jsonl"));
  // Only the two files remain: the temporary files were renamed into place.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_.path()), std::filesystem::directory_iterator()), 2);

  const AnnIndex loaded = AnnIndex::load(path);
  EXPECT_EQ(loaded.type(), GetParam().type);
  EXPECT_EQ(loaded.factory(), GetParam().factory);
  EXPECT_EQ(loaded.dim(), kDim);
  EXPECT_EQ(loaded.size(), kCount);
  for (int64_t i = 0; i < kCount; ++i) {
    EXPECT_EQ(loaded.item(i).id, index.item(i).id);
    EXPECT_EQ(loaded.item(i).uri, index.item(i).uri);
    EXPECT_EQ(loaded.item(i).caption, index.item(i).caption);
  }
  EXPECT_EQ(loaded.item(0).caption, "tasse rayée rouge — 赤い縞模様のマグ ☕");
  EXPECT_EQ(loaded.item(1).caption, "line\nbreak \"quoted\" \\ tab\t");
  expect_same_results(loaded.search(queries_.data(), 15, 7), index.search(queries_.data(), 15, 7));

  const std::string header = read_text(path + ".items.jsonl").substr(0, read_text(path + ".items.jsonl").find('\n'));
  EXPECT_NE(header.find("\"format\":\"gst-moe-items\""), std::string::npos) << header;
  EXPECT_NE(header.find("\"count\":120"), std::string::npos) << header;
  EXPECT_NE(header.find(std::string("\"index_type\":\"") + moe::ann_index_type_name(GetParam().type) +
                        "\",\"factory\":\"" + GetParam().factory + "\""),
            std::string::npos)
      << header;
}

TEST_P(AnnIndexFiles, ProvenanceRoundTrip) {
  const std::string path = dir_.file("catalog.faiss");
  AnnIndex index = build();
  EXPECT_FALSE(index.provenance().has_value());
  index.set_provenance({"clip", "0123456789abcdef", "adapter", "fedcba9876543210"});
  index.save(path);
  const AnnIndex loaded = AnnIndex::load(path);
  ASSERT_TRUE(loaded.provenance().has_value());
  EXPECT_EQ(loaded.provenance()->encoder, "clip");
  EXPECT_EQ(loaded.provenance()->encoder_fingerprint, "0123456789abcdef");
  EXPECT_EQ(loaded.provenance()->adapter, "adapter");
  EXPECT_EQ(loaded.provenance()->adapter_fingerprint, "fedcba9876543210");
  EXPECT_EQ(loaded.size(), kCount);

  // Without an adapter: empty adapter fields, kept empty.
  index.set_provenance({"clip", "0123456789abcdef", "", ""});
  index.save(path);
  ASSERT_TRUE(AnnIndex::load(path).provenance().has_value());
  EXPECT_TRUE(AnnIndex::load(path).provenance()->adapter.empty());
  EXPECT_TRUE(AnnIndex::load(path).provenance()->adapter_fingerprint.empty());
  EXPECT_EQ(AnnIndex::load(path).provenance()->describe(), "encoder 'clip' (fp 0123456789abcdef) without an adapter");

  expect_error([&] { index.set_provenance({"clip", "", "", ""}); }, {"no encoder fingerprint", "clip"});
}

TEST_P(AnnIndexFiles, HeaderWithoutProvenanceStillLoads) {
  const std::string path = dir_.file("catalog.faiss");
  build().save(path);
  const std::string items = read_text(path + ".items.jsonl");
  // The header as written before provenance and factory existed: exactly these members.
  const std::string old_header = std::string(R"({"format":"gst-moe-items","version":1,"count":120,"dim":)") +
                                 std::to_string(kDim) + R"(,"index_type":")" +
                                 moe::ann_index_type_name(GetParam().type) + "\"";
  const std::string written =
      old_header + ",\"factory\":\"" + GetParam().factory + "\",\"generation\":1,\"index_crc32\":";
  EXPECT_EQ(items.substr(0, written.size()), written);
  write_text(path + ".items.jsonl", old_header + "}" + items.substr(items.find('\n')));
  const AnnIndex loaded = AnnIndex::load(path);
  EXPECT_FALSE(loaded.provenance().has_value());
  EXPECT_EQ(loaded.size(), kCount);
  // Such tables are flat or HNSW indexes, which the FAISS file describes.
  if (GetParam().type != AnnIndexType::Ivf) {
    EXPECT_EQ(loaded.factory(), GetParam().factory);
  }
}

TEST_P(AnnIndexFiles, MalformedProvenanceIsNamed) {
  const std::string path = dir_.file("catalog.faiss");
  const std::string items_path = path + ".items.jsonl";
  AnnIndex index = build();
  index.set_provenance({"clip", "0123456789abcdef", "adapter", "fedcba9876543210"});
  index.save(path);
  const std::string good = read_text(items_path);

  std::string no_fp = good;
  no_fp.replace(no_fp.find("\"0123456789abcdef\""), 18, "\"\"");
  write_text(items_path, no_fp);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "line 1", "provenance", "no encoder fingerprint"});

  std::string missing = good;
  missing.replace(missing.find("\"adapter_fingerprint\""), 21, "\"other\"");
  write_text(items_path, missing);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "provenance", "adapter_fingerprint"});

  std::string not_object = good;
  const size_t at = not_object.find("\"provenance\":") + 13;
  not_object.replace(at, not_object.find('}', at) + 1 - at, "\"clip\"");
  write_text(items_path, not_object);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "'provenance' is not an object"});
}

// A catalog line's own members beyond path, id and caption reach the item table and come back.
TEST_P(AnnIndexFiles, CatalogFieldsRoundTripAndTablesWithoutThemLoad) {
  const std::string path = dir_.file("catalog.faiss");
  const std::string items_path = path + ".items.jsonl";
  AnnIndex index = AnnIndex::create(kDim, options());
  auto items = numbered_items(kCount);
  items[2].fields = R"({"price":12.5,"sku":"A-1","tags":["red","mug"],"stock":{"eu":3}})";
  index.add(base_.data(), kCount, items);
  index.save(path);
  const std::string table = read_text(items_path);
  // Written only where there are fields.
  EXPECT_NE(table.find(R"("caption":"caption 2","fields":{"price":12.5,"sku":"A-1")"), std::string::npos) << table;
  EXPECT_EQ(table.find("\"fields\""), table.rfind("\"fields\""));

  const AnnIndex loaded = AnnIndex::load(path);
  EXPECT_EQ(loaded.item(2).fields, items[2].fields);
  EXPECT_EQ(loaded.item(3).fields, "");

  // A table written before fields existed (no member anywhere) loads, every item without fields.
  std::string old = table;
  const size_t at = old.find(",\"fields\":");
  old.erase(at, old.find('\n', at) - 1 - at);
  write_text(items_path, old);
  EXPECT_EQ(AnnIndex::load(path).item(2).fields, "");

  std::string not_object = table;
  not_object.replace(not_object.find("{\"price\""),
                     std::string(R"({"price":12.5,"sku":"A-1","tags":["red","mug"],"stock":{"eu":3}})").size(), "5");
  write_text(items_path, not_object);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "line 4", "'fields' is not an object"});

  AnnIndex broken = AnnIndex::create(kDim, options());
  items[2].fields = "[1]";
  broken.add(base_.data(), kCount, items);
  expect_error([&] { broken.save(dir_.file("broken.faiss")); }, {"fields of item 2", "not a JSON object"});
}

TEST(Catalog, LinesKeepTheirOtherMembersAsFields) {
  const moe::CatalogEntry sku = moe::parse_catalog_line(
      R"({"path":"mug.png","id":"SKU-001","price":12.5,"caption":"red mug","stock":{"eu":3},"tags":["a"]})", "/cat",
      "catalog line 1");
  EXPECT_EQ(sku.error, "");
  EXPECT_EQ(sku.id, "SKU-001");
  EXPECT_EQ(sku.path, "/cat/mug.png");
  EXPECT_EQ(sku.caption, "red mug");
  EXPECT_EQ(sku.fields, R"({"price":12.5,"stock":{"eu":3},"tags":["a"]})");
  const moe::CatalogEntry plain = moe::parse_catalog_line(R"({"path":"cup.png"})", "/cat", "catalog line 2");
  EXPECT_EQ(plain.id, "cup");
  EXPECT_EQ(plain.fields, "");
}

TEST(AnnIndex, UrisAreRebasedFromTheFolderTheyShare) {
  AnnIndex index = AnnIndex::create(4, {});
  const std::vector<float> vectors = random_unit_vectors(4, 4, 3);
  index.add(vectors.data(), 4,
            {{"a", "file:///home/me/cat/a.png", ""},
             {"b", "file:///home/me/cat/sub/b%20c.png", ""},
             {"c", "", ""},
             {"d", "file:///home/me/cat/d.png", ""}});
  const std::string folder = index.uri_folder();
  EXPECT_EQ(folder, "file:///home/me/cat/");
  EXPECT_EQ(moe::rebase_uri(index.item(1).uri, folder, "https://cdn.example/c"), "https://cdn.example/c/sub/b%20c.png");
  EXPECT_EQ(moe::rebase_uri(index.item(0).uri, folder, "https://cdn.example/c/"), "https://cdn.example/c/a.png");
  EXPECT_EQ(moe::rebase_uri(index.item(0).uri, folder, ""), index.item(0).uri);
  EXPECT_EQ(moe::rebase_uri("file:///elsewhere/x.png", folder, "https://cdn.example/c"), "file:///elsewhere/x.png");
  EXPECT_EQ(moe::rebase_uri("file:///x.png", "", "https://cdn.example/c"), "file:///x.png");

  // A shared prefix that ends inside a name is cut back to its folder; no uris, no folder.
  AnnIndex siblings = AnnIndex::create(4, {});
  siblings.add(vectors.data(), 2, {{"a", "file:///srv/cat1/a.png", ""}, {"b", "file:///srv/cat2/b.png", ""}});
  EXPECT_EQ(siblings.uri_folder(), "file:///srv/");
  AnnIndex single = AnnIndex::create(4, {});
  single.add(vectors.data(), 1, {{"a", "file:///srv/cat/a.png", ""}});
  EXPECT_EQ(single.uri_folder(), "file:///srv/cat/");
  AnnIndex none = AnnIndex::create(4, {});
  none.add(vectors.data(), 1, {{"a", "", ""}});
  EXPECT_EQ(none.uri_folder(), "");
}

TEST(AnnProvenance, ComparesFingerprintsNotNames) {
  const moe::AnnProvenance built{"clip", "1111111111111111", "adapter", "2222222222222222"};
  EXPECT_TRUE(built.same_models({"clip-copy", "1111111111111111", "renamed", "2222222222222222"}));
  EXPECT_FALSE(built.same_models({"clip", "1111111111111111", "adapter", "3333333333333333"}));
  EXPECT_FALSE(built.same_models({"clip", "4444444444444444", "adapter", "2222222222222222"}));
  EXPECT_FALSE(built.same_models({"clip", "1111111111111111", "", ""}));
  EXPECT_EQ(built.describe(), "encoder 'clip' (fp 1111111111111111) and adapter 'adapter' (fp 2222222222222222)");
  EXPECT_EQ(moe::AnnProvenance{}.describe(), "an unknown encoder without an adapter");
}

TEST_P(AnnIndexFiles, CorruptOrTruncatedIndexIsNamed) {
  const std::string path = dir_.file("catalog.faiss");
  build().save(path);
  const std::string good = read_text(path);

  write_text(path, good.substr(0, good.size() / 2));
  expect_error([&] { AnnIndex::load(path); }, {path, "cannot be read"});

  std::string corrupt = good;
  for (size_t i = 0; i < 4; ++i) corrupt[i] = static_cast<char>(0xA5);  // the index type tag
  write_text(path, corrupt);
  expect_error([&] { AnnIndex::load(path); }, {path, "cannot be read"});

  expect_error([&] { AnnIndex::load(dir_.file("missing.faiss")); }, {dir_.file("missing.faiss"), "cannot be read"});
}

TEST_P(AnnIndexFiles, ItemTableMustAgreeWithIndex) {
  const std::string path = dir_.file("catalog.faiss");
  const std::string items_path = path + ".items.jsonl";
  build().save(path);
  const std::string good = read_text(items_path);

  // One item line missing.
  const size_t last = good.rfind('\n', good.size() - 2);
  write_text(items_path, good.substr(0, last + 1));
  expect_error([&] { AnnIndex::load(path); }, {items_path, "119 items", "120"});

  // Header count disagreeing with the index.
  std::string wrong_count = good;
  wrong_count.replace(wrong_count.find("\"count\":120"), 11, "\"count\":121");
  write_text(items_path, wrong_count);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "line 1", "count 121", "120"});

  // A malformed item line is named by its number (line 1 is the header, item 2 is line 4).
  std::string malformed = good;
  const size_t line4 = [&] {
    size_t pos = 0;
    for (int i = 0; i < 3; ++i) pos = malformed.find('\n', pos) + 1;
    return pos;
  }();
  malformed.insert(line4, "{not json");
  write_text(items_path, malformed);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "line 4", "invalid JSON"});

  std::filesystem::remove(items_path);
  expect_error([&] { AnnIndex::load(path); }, {items_path, "cannot be read"});
}

TEST_P(AnnIndexFiles, FailedSaveLeavesNoHalfIndex) {
  const std::string path = dir_.file("catalog.faiss");
  // The item table cannot be put in place (a directory holds its name) after the index was
  // written to its temporary file: neither file may appear, no temporary file may remain.
  std::filesystem::create_directory(path + ".items.jsonl");
  expect_error([&] { build().save(path); }, {path + ".items.jsonl", "cannot be written"});
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_.path()), std::filesystem::directory_iterator()), 1);

  expect_error([&] { build().save(dir_.file("no-such-dir/catalog.faiss")); },
               {dir_.file("no-such-dir/catalog.faiss"), "cannot be written"});
}

INSTANTIATE_TEST_SUITE_P(Types, AnnIndexFiles,
                         ::testing::Values(IndexKind{"Flat", AnnIndexType::Flat},
                                           IndexKind{"HNSW32", AnnIndexType::Hnsw},
                                           IndexKind{"IVF4,Flat", AnnIndexType::Ivf},
                                           IndexKind{"IVF4,PQ4x4", AnnIndexType::Ivf},
                                           IndexKind{"PCA8,IVF4,PQ4x4", AnnIndexType::Ivf}),
                         [](const auto& info) {
                           std::string name = info.param.factory;
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

// ---- index_factory types, training, search-time knobs ---------------------------------------------

TEST(AnnIndexFactory, TheIssuesStringsAndTheAliasesBuild) {
  struct Case {
    const char* factory;
    AnnIndexType type;
    int64_t nlist;
  };
  for (const Case& c : {Case{"IVF4096,Flat", AnnIndexType::Ivf, 4096}, Case{"IVF256,PQ16", AnnIndexType::Ivf, 256},
                        Case{"OPQ16,IVF256,PQ16", AnnIndexType::Ivf, 256}, Case{"HNSW32", AnnIndexType::Hnsw, 0},
                        Case{"Flat", AnnIndexType::Flat, 0}, Case{"flat", AnnIndexType::Flat, 0},
                        Case{"hnsw", AnnIndexType::Hnsw, 0}}) {
    AnnBuildOptions opts;
    opts.index_type = c.factory;
    const AnnIndex index = AnnIndex::create(512, opts);
    EXPECT_EQ(index.type(), c.type) << c.factory;
    EXPECT_EQ(index.nlist(), c.nlist) << c.factory;
    EXPECT_EQ(index.is_trained(), c.type != AnnIndexType::Ivf) << c.factory;
  }
  AnnBuildOptions opts;
  opts.index_type = "hnsw";
  opts.hnsw_m = 12;
  EXPECT_EQ(AnnIndex::create(8, opts).factory(), "HNSW12");
  opts.index_type = "flat";
  EXPECT_EQ(AnnIndex::create(8, opts).factory(), "Flat");

  opts.index_type = "Bogus7";
  expect_error([&] { AnnIndex::create(16, opts); }, {"'Bogus7'", "cannot create"});
  opts.index_type = "IVF4,PQ5";  // 5 sub-quantizers do not divide 16
  expect_error([&] { AnnIndex::create(16, opts); }, {"'IVF4,PQ5'", "dimension 16"});
  opts.index_type = "PQ4";  // rejects selectors, so filters could not run on it
  expect_error([&] { AnnIndex::create(16, opts); }, {"'PQ4'", "not searched here"});
  opts.index_type = "IVF4,PQ4x4fs";  // FAISS 1.7.3 throws on search parameters for fast-scan codes
  expect_error([&] { AnnIndex::create(16, opts); }, {"'IVF4,PQ4x4fs'", "not searched here", "fast-scan"});
  opts.index_type = "IVF64,Flat";
  opts.train_size = 10;
  expect_error([&] { AnnIndex::create(16, opts); }, {"train size 10", "64 lists"});
}

// Vectors around a few centres, as catalogs of a few kinds of things are; unit length.
std::vector<float> clustered_vectors(int64_t n, int dim, int clusters, unsigned seed) {
  const auto centres = random_unit_vectors(clusters, dim, seed);
  const auto noise = random_unit_vectors(n, dim, seed + 1);
  std::vector<float> out(static_cast<size_t>(n * dim));
  for (int64_t i = 0; i < n; ++i) {
    double norm = 0;
    for (int j = 0; j < dim; ++j) {
      const float x = centres[(i % clusters) * dim + j] + 0.5f * noise[i * dim + j];
      out[i * dim + j] = x;
      norm += double(x) * x;
    }
    for (int j = 0; j < dim; ++j) out[i * dim + j] = static_cast<float>(out[i * dim + j] / std::sqrt(norm));
  }
  return out;
}

TEST(AnnIndexFactory, IvfTrainsOnTheFirstTrainSizeVectors) {
  const int dim = 16;
  const auto base = clustered_vectors(600, dim, 8, 21);
  AnnBuildOptions opts;
  opts.index_type = "IVF8,Flat";
  AnnIndex index = AnnIndex::create(dim, opts);  // default: 64 per list, 512 vectors
  index.add(base.data(), 500, numbered_items(500));
  EXPECT_FALSE(index.is_trained());
  EXPECT_EQ(index.size(), 500);
  expect_error([&] { index.search(base.data(), 1, 5); }, {"IVF8,Flat", "not trained", "500"});
  index.add(base.data() + 500 * dim, 100, numbered_items(100));
  EXPECT_TRUE(index.is_trained());
  EXPECT_EQ(index.size(), 600);
  EXPECT_EQ(index.search(base.data() + 550 * dim, 1, 1)[0][0].item, 550);

  // A stream shorter than the sample trains on all of it when saved.
  TempDir dir;
  AnnIndex small = AnnIndex::create(dim, opts);
  small.add(base.data(), 100, numbered_items(100));
  small.save(dir.file("small.faiss"));
  EXPECT_TRUE(small.is_trained());
  EXPECT_EQ(AnnIndex::load(dir.file("small.faiss")).search(base.data() + 7 * dim, 1, 1)[0][0].item, 7);

  // Fewer vectors than lists: refused, naming a list count that fits.
  opts.index_type = "IVF256,Flat";
  AnnIndex too_few = AnnIndex::create(dim, opts);
  too_few.add(base.data(), 100, numbered_items(100));
  expect_error([&] { too_few.save(dir.file("few.faiss")); }, {"256 lists", "only 100 vectors", "IVF2 lists"});
  EXPECT_FALSE(std::filesystem::exists(dir.file("few.faiss")));
}

TEST(AnnIndexFactory, NprobeTakesEffectAndAllListsAreExact) {
  const int dim = 16, n = 3000, k = 10;
  const auto base = clustered_vectors(n, dim, 32, 31);
  const auto queries = random_unit_vectors(50, dim, 32);
  for (const char* factory : {"IVF32,Flat", "OPQ4,IVF32,Flat"}) {
    AnnBuildOptions opts;
    opts.index_type = factory;
    AnnIndex index = AnnIndex::create(dim, opts);
    index.add(base.data(), n, numbered_items(n));
    index.train();
    const auto truth = brute_force(base, queries, dim, k);
    moe::AnnSearchOptions one, all;
    one.nprobe = 1;
    all.nprobe = 32;
    const double low = recall(index.search(queries.data(), 50, k, one), truth);
    const auto exact = index.search(queries.data(), 50, k, all);
    EXPECT_LT(low, 0.9) << factory;
    EXPECT_GE(recall(exact, truth), 0.999) << factory;
    all.nprobe = 100000;  // capped at the list count
    expect_same_results(index.search(queries.data(), 50, k, all), exact);
    moe::AnnSearchOptions zero;
    zero.nprobe = 0;
    expect_error([&] { index.search(queries.data(), 1, k, zero); }, {"nprobe", "0"});
  }
}

// ---- metadata filters -------------------------------------------------------------------------------

const char* const kCategories[] = {"mug", "plate", "bowl"};
const char* const kColours[] = {"red", "blue", "green", "white", "black"};

// Items with fields: category (i % 3), colour (i % 5), price (i % 50, an integer), in_stock (even i);
// every 7th item has no fields.
std::string fields_of_row(int64_t i) {
  if (i % 7 == 6) return "";
  return std::string(R"({"category":")") + kCategories[i % 3] + R"(","colour":")" + kColours[i % 5] + R"(","price":)" +
         std::to_string(i % 50) + R"(,"in_stock":)" + (i % 2 ? "false" : "true") + "}";
}

std::vector<AnnItem> fielded_items(int64_t n) {
  auto items = numbered_items(n);
  for (int64_t i = 0; i < n; ++i) items[i].fields = fields_of_row(i);
  return items;
}

// The rows fielded_items gives fields that the filter in `name` matches.
bool reference_match(const std::string& name, int64_t i) {
  if (i % 7 == 6) return false;
  const std::string category = kCategories[i % 3], colour = kColours[i % 5];
  const int64_t price = i % 50;
  if (name == "mug") return category == "mug";
  if (name == "red-or-blue") return colour == "red" || colour == "blue";
  if (name == "price-10-20") return price >= 10 && price < 20;
  if (name == "cheap-red-mug") return category == "mug" && colour == "red" && price <= 3 && i % 2 == 0;
  if (name == "broad") return category != "bowl";
  return false;
}

moe::AnnFilter filter_named(const std::string& name) {
  using moe::AnnFilterCondition;
  moe::AnnFilter f;
  if (name == "mug") f.all_of.push_back({"category", {std::string("mug")}});
  if (name == "red-or-blue") f.all_of.push_back({"colour", {std::string("red"), std::string("blue")}});
  if (name == "price-10-20") {
    AnnFilterCondition c{"price", {}};
    c.gte = 10;
    c.lt = 20;
    f.all_of.push_back(c);
  }
  if (name == "cheap-red-mug") {
    AnnFilterCondition price{"price", {}};
    price.lte = 3;
    f.all_of = {{"category", {std::string("mug")}}, {"colour", {std::string("red")}}, price, {"in_stock", {true}}};
  }
  if (name == "broad") f.all_of.push_back({"category", {std::string("mug"), std::string("plate")}});
  if (name == "none") f.all_of.push_back({"category", {std::string("teapot")}});
  if (name == "no-such-field") f.all_of.push_back({"weight", {1.0}});
  return f;
}

// Nested objects of a catalog line (the demo catalog's "attributes") are filtered by dotted names;
// an object itself, an array or a name without its prefix match nothing.
TEST(AnnIndexFilter, NestedFieldsAreFilteredByDottedNames) {
  AnnIndex index = AnnIndex::create(4, {});
  const auto base = random_unit_vectors(4, 4, 41);
  auto items = numbered_items(4);
  items[0].fields = R"({"attributes":{"category":"mug","size":{"cm":12}},"tags":["a"]})";
  items[1].fields = R"({"attributes":{"category":"shoe"}})";
  items[2].fields = R"({"category":"mug"})";
  index.add(base.data(), 4, items);
  moe::AnnFilter mug;
  mug.all_of.push_back({"attributes.category", {std::string("mug")}});
  EXPECT_EQ(index.matching(mug), (std::vector<int64_t>{0}));
  moe::AnnFilter deep;
  deep.all_of.push_back({"attributes.size.cm", {12.0}});
  EXPECT_EQ(index.matching(deep), (std::vector<int64_t>{0}));
  moe::AnnFilter plain;
  plain.all_of.push_back({"category", {std::string("mug")}});
  EXPECT_EQ(index.matching(plain), (std::vector<int64_t>{2}));
  moe::AnnFilter object;
  object.all_of.push_back({"attributes", {std::string("mug")}});
  EXPECT_TRUE(index.matching(object).empty());
}

// The exact top-k among the rows the filter matches.
std::vector<std::vector<AnnHit>> filtered_brute_force(const std::vector<float>& base, const std::vector<float>& queries,
                                                      int dim, int k, const std::string& filter) {
  std::vector<float> subset;
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < static_cast<int64_t>(base.size()) / dim; ++i)
    if (reference_match(filter, i)) {
      rows.push_back(i);
      subset.insert(subset.end(), base.begin() + i * dim, base.begin() + (i + 1) * dim);
    }
  auto out = brute_force(subset, queries, dim, k);
  for (auto& hits : out)
    for (AnnHit& hit : hits) hit.item = rows[static_cast<size_t>(hit.item)];
  return out;
}

TEST(AnnIndexFilter, MatchingRowsFollowTheFields) {
  AnnIndex index = AnnIndex::create(4, {});
  const auto base = random_unit_vectors(300, 4, 40);
  index.add(base.data(), 300, fielded_items(300));
  for (const char* name : {"mug", "red-or-blue", "price-10-20", "cheap-red-mug", "broad", "none", "no-such-field"}) {
    std::vector<int64_t> want;
    for (int64_t i = 0; i < 300; ++i)
      if (reference_match(name, i)) want.push_back(i);
    EXPECT_EQ(index.matching(filter_named(name)), want) << name;
  }
  // A number matches an integer field's value; a string "1" does not; a range skips strings.
  moe::AnnFilter number;
  number.all_of.push_back({"price", {12.0}});
  EXPECT_EQ(index.matching(number), (std::vector<int64_t>{12, 112, 162, 212, 262}));  // 62 has no fields
  moe::AnnFilter text;
  text.all_of.push_back({"price", {std::string("12")}});
  EXPECT_TRUE(index.matching(text).empty());
  moe::AnnFilterCondition colour_range{"colour", {}};
  colour_range.gte = 0;
  EXPECT_TRUE(index.matching({{colour_range}}).empty());
  EXPECT_EQ(index.matching({}).size(), 300u);
}

struct FilterCase {
  const char* factory;
  int64_t count;
};

class AnnIndexFilterSearch : public ::testing::TestWithParam<FilterCase> {};

// Filtered searches equal the exact top-k over the matching items: flat, IVF scanning every list,
// and HNSW (exact over few matches; for broad ones, through its selector, at high recall).
TEST_P(AnnIndexFilterSearch, EqualsBruteForceOverTheMatchingItems) {
  const int dim = 16, k = 10;
  const int64_t n = GetParam().count;
  const auto base = clustered_vectors(n, dim, 16, 50);
  const auto queries = random_unit_vectors(20, dim, 51);
  AnnBuildOptions opts;
  opts.index_type = GetParam().factory;
  AnnIndex built = AnnIndex::create(dim, opts);
  built.add(base.data(), n, fielded_items(n));
  // Searched as loaded: the fields come back from the item table.
  TempDir dir;
  built.save(dir.file("catalog.faiss"));
  const AnnIndex index = AnnIndex::load(dir.file("catalog.faiss"));
  EXPECT_EQ(index.factory(), GetParam().factory);
  const bool ivf = index.type() == AnnIndexType::Ivf;
  for (const char* name : {"mug", "red-or-blue", "price-10-20", "cheap-red-mug", "broad"}) {
    const moe::AnnFilter filter = filter_named(name);
    moe::AnnSearchOptions options;
    options.filter = &filter;
    options.nprobe = ivf ? static_cast<int>(index.nlist()) : 1;
    options.ef_search = 128;
    const auto got = index.search(queries.data(), 20, k, options);
    const auto want = filtered_brute_force(base, queries, dim, k, name);
    // PQ ranks by its codes, HNSW walks its graph when many items match: both approximate.
    const bool approximate = std::string(GetParam().factory).find("PQ") != std::string::npos ||
                             (index.type() == AnnIndexType::Hnsw && index.matching(filter).size() > 8192);
    if (!approximate) {
      expect_same_results(got, want);
      continue;
    }
    for (size_t q = 0; q < got.size(); ++q) {
      ASSERT_EQ(got[q].size(), static_cast<size_t>(k)) << name;
      for (const AnnHit& hit : got[q]) EXPECT_TRUE(reference_match(name, hit.item)) << name << " item " << hit.item;
    }
    if (index.type() == AnnIndexType::Hnsw) {
      EXPECT_GE(recall(got, want), 0.9) << name;
    }
  }
  // A filter that nothing matches: no hits, not an error.
  for (const char* name : {"none", "no-such-field"}) {
    const moe::AnnFilter filter = filter_named(name);
    moe::AnnSearchOptions options;
    options.filter = &filter;
    for (const auto& hits : index.search(queries.data(), 20, k, options)) EXPECT_TRUE(hits.empty()) << name;
  }
  // A tight filter still gives k hits when k items match, however few lists are scanned.
  const moe::AnnFilter tight = filter_named("cheap-red-mug");
  moe::AnnSearchOptions narrow;
  narrow.filter = &tight;
  narrow.nprobe = 1;
  narrow.ef_search = 1;
  const auto got = index.search(queries.data(), 20, k, narrow);
  for (const auto& hits : got) {
    ASSERT_EQ(hits.size(), static_cast<size_t>(k));
    for (const AnnHit& hit : hits) EXPECT_TRUE(reference_match("cheap-red-mug", hit.item));
  }
}

INSTANTIATE_TEST_SUITE_P(Types, AnnIndexFilterSearch,
                         ::testing::Values(FilterCase{"Flat", 3000}, FilterCase{"IVF16,Flat", 3000},
                                           FilterCase{"OPQ4,IVF16,PQ4x4", 3000}, FilterCase{"HNSW32", 3000},
                                           FilterCase{"HNSW16", 15000}),
                         [](const auto& info) {
                           std::string name = std::string(info.param.factory) + "_" + std::to_string(info.param.count);
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

// ---- live updates: upsert / remove / find ----------------------------------------------------------

// What an index should hold after live updates: every row's vector, and which rows are live.
struct LiveReference {
  int dim;
  std::vector<float> vectors;  // row-major, every row ever added
  std::vector<AnnItem> items;
  std::vector<bool> live;

  // The exact top-k among the live rows `filter` ("" for none) matches.
  std::vector<std::vector<AnnHit>> search(const std::vector<float>& queries, int k, const std::string& filter) const {
    std::vector<float> subset;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < static_cast<int64_t>(live.size()); ++i)
      if (live[i] && (filter.empty() || reference_match(filter, i))) {
        rows.push_back(i);
        subset.insert(subset.end(), vectors.begin() + i * dim, vectors.begin() + (i + 1) * dim);
      }
    auto out = brute_force(subset, queries, dim, k);
    for (auto& hits : out)
      for (AnnHit& hit : hits) hit.item = rows[static_cast<size_t>(hit.item)];
    return out;
  }
  int64_t find(const std::string& id) const {
    for (int64_t i = static_cast<int64_t>(items.size()) - 1; i >= 0; --i)
      if (live[i] && items[i].id == id) return i;
    return -1;
  }
};

class AnnIndexLiveUpdates : public ::testing::TestWithParam<const char*> {};

// Upserts (new ids and replacements) and removes on a built index, then every search (with and
// without filters) against the exact search over the live rows, before and after a save/load.
TEST_P(AnnIndexLiveUpdates, EqualBruteForceOverTheLiveRows) {
  const int dim = 16, k = 10;
  const int64_t n = 1500;
  LiveReference ref{dim, clustered_vectors(n, dim, 16, 60), fielded_items(n), std::vector<bool>(n, true)};
  AnnBuildOptions opts;
  opts.index_type = GetParam();
  AnnIndex index = AnnIndex::create(dim, opts);
  index.add(ref.vectors.data(), n, ref.items);
  index.train();

  std::mt19937 rng(61);
  int next_id = static_cast<int>(n);
  for (int op = 0; op < 400; ++op) {
    const int kind = static_cast<int>(rng() % 4);
    if (kind < 3) {
      // An upsert: a replacement of a live id half the time, else a new id. Its fields follow the
      // new row's number, so that reference_match describes it.
      const int64_t row = static_cast<int64_t>(ref.items.size());
      std::string id = "id-" + std::to_string(next_id++);
      if (kind == 0) {
        const int64_t victim = static_cast<int64_t>(rng() % static_cast<uint32_t>(row));
        if (ref.live[victim]) id = ref.items[victim].id;
      }
      const auto v = random_unit_vectors(1, dim, 1000 + op);
      AnnItem item{id, "file:///catalog/new-" + std::to_string(row) + ".png", "upsert " + std::to_string(op),
                   fields_of_row(row)};
      const int64_t old = ref.find(id);
      ASSERT_EQ(index.upsert(v.data(), dim, item), row);
      if (old >= 0) ref.live[old] = false;
      ref.vectors.insert(ref.vectors.end(), v.begin(), v.end());
      ref.items.push_back(item);
      ref.live.push_back(true);
    } else {
      // A remove of one to three ids, one of them unknown.
      std::vector<std::string> ids{"no-such-id"};
      int64_t expected = 0;
      for (int j = 0, m = 1 + static_cast<int>(rng() % 3); j < m; ++j) {
        const int64_t row = static_cast<int64_t>(rng() % ref.items.size());
        const std::string& id = ref.items[row].id;
        if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
        ids.push_back(id);
        const int64_t live_row = ref.find(id);
        if (live_row >= 0) {
          ref.live[live_row] = false;
          ++expected;
        }
      }
      ASSERT_EQ(index.remove(ids), expected);
    }
  }
  const int64_t live = std::count(ref.live.begin(), ref.live.end(), true);
  ASSERT_LT(live, static_cast<int64_t>(ref.live.size()));

  const auto queries = random_unit_vectors(20, dim, 62);
  const bool exact = std::string(GetParam()).find("PQ") == std::string::npos &&
                     std::string(GetParam()).find("HNSW") == std::string::npos;
  auto check = [&](const AnnIndex& idx, const std::string& when) {
    SCOPED_TRACE(when);
    EXPECT_EQ(idx.size(), static_cast<int64_t>(ref.items.size()));
    EXPECT_EQ(idx.live_size(), live);
    for (int64_t i = 0; i < static_cast<int64_t>(ref.items.size()); i += 7) {
      EXPECT_EQ(idx.find(ref.items[i].id), ref.find(ref.items[i].id)) << ref.items[i].id;
      if (ref.live[i]) {
        EXPECT_EQ(idx.item(i).caption, ref.items[i].caption);
      }
    }
    EXPECT_EQ(idx.find("no-such-id"), -1);
    EXPECT_EQ(idx.matching({}).size(), static_cast<size_t>(live));
    for (const char* name : {"", "mug", "red-or-blue", "cheap-red-mug", "broad"}) {
      const moe::AnnFilter filter = filter_named(name);
      moe::AnnSearchOptions options;
      options.filter = &filter;
      options.nprobe = static_cast<int>(std::max<int64_t>(1, idx.nlist()));
      options.ef_search = 128;
      const auto got = idx.search(queries.data(), 20, k, options);
      const auto want = ref.search(queries, k, name);
      if (exact) {
        expect_same_results(got, want);
        continue;
      }
      for (size_t q = 0; q < got.size(); ++q) {
        ASSERT_EQ(got[q].size(), want[q].size()) << name;  // k hits whenever k live rows match
        for (const AnnHit& hit : got[q]) {
          EXPECT_TRUE(ref.live[hit.item]) << name << " returned deleted row " << hit.item;
          if (*name) {
            EXPECT_TRUE(reference_match(name, hit.item)) << name << " row " << hit.item;
          }
        }
      }
      if (idx.type() == AnnIndexType::Hnsw) {
        EXPECT_GE(recall(got, want), 0.9) << name;
      }
    }
  };
  check(index, "live");
  TempDir dir;
  index.save(dir.file("catalog.faiss"));
  EXPECT_NE(read_text(dir.file("catalog.faiss.items.jsonl")).find("\"version\":2"), std::string::npos);
  check(AnnIndex::load(dir.file("catalog.faiss")), "loaded");
}

INSTANTIATE_TEST_SUITE_P(Types, AnnIndexLiveUpdates,
                         ::testing::Values("Flat", "HNSW32", "IVF16,Flat", "IVF16,PQ4x4", "OPQ4,IVF16,PQ4x4"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

TEST(AnnIndexLiveUpdates, BoundsAreNamed) {
  const int dim = 8;
  const auto base = random_unit_vectors(64, dim, 70);
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), 64, numbered_items(64));
  const std::vector<float> wide(dim + 1, 0.5f);
  expect_error(
      [&] {
        index.upsert(wide.data(), dim + 1, AnnItem{"x", "", ""});
      },
      {"upsert of 'x'", "9 floats", "8-wide"});
  expect_error([&] { index.upsert(base.data(), dim, AnnItem{"", "", ""}); }, {"without an id"});
  std::vector<float> nan(base.begin(), base.begin() + dim);
  nan[3] = std::nanf("");
  expect_error(
      [&] {
        index.upsert(nan.data(), dim, AnnItem{"x", "", ""});
      },
      {"upsert of 'x'", "component 3", "not finite"});
  EXPECT_EQ(index.live_size(), 64);  // nothing refused was applied

  AnnBuildOptions ivf;
  ivf.index_type = "IVF4,Flat";
  AnnIndex untrained = AnnIndex::create(dim, ivf);
  untrained.add(base.data(), 10, numbered_items(10));
  expect_error(
      [&] {
        untrained.upsert(base.data(), dim, AnnItem{"x", "", ""});
      },
      {"upsert of 'x'", "IVF4,Flat", "not trained"});
  expect_error([&] { untrained.remove({"id-1"}); }, {"remove", "not trained"});

  index.place_on(moe::kernels::make_cpu_backend(), nullptr);
  expect_error(
      [&] {
        index.upsert(base.data(), dim, AnnItem{"x", "", ""});
      },
      {"not supported on a device-resident index", "cpu"});
  expect_error([&] { index.remove({"id-1"}); }, {"not supported on a device-resident index"});
}

// A deleted row's item stays readable (a hit found just before the remove is described), and an
// index placed on a backend after deletions searches the live rows only: with few tombstones the
// exact search fetches k + tombstones hits, with more (k + tombstones > 1024) it goes through
// FAISS's selector on the CPU copy; both equal the exact search over the live rows.
TEST(AnnIndexLiveUpdates, DeletedRowsKeepTheirItemsAndStaySkippedOnABackend) {
  const int dim = 8, n = 1500;
  const auto base = random_unit_vectors(n, dim, 71);
  // Rows 5 and 7's own vectors (their tombstones would rank first), then random ones.
  std::vector<float> queries(base.begin() + 5 * dim, base.begin() + 6 * dim);
  queries.insert(queries.end(), base.begin() + 7 * dim, base.begin() + 8 * dim);
  const auto random_queries = random_unit_vectors(3, dim, 76);
  queries.insert(queries.end(), random_queries.begin(), random_queries.end());
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), n, numbered_items(n));
  EXPECT_EQ(index.remove({"id-5", "id-5", "id-7"}), 2);
  EXPECT_EQ(index.remove({"id-5"}), 0);
  EXPECT_EQ(index.item(5).id, "id-5");
  EXPECT_EQ(index.find("id-5"), -1);
  index.place_on(moe::kernels::make_cpu_backend(), nullptr);
  std::vector<bool> live(n, true);
  live[5] = live[7] = false;
  auto expect_live_search = [&](int k) {
    std::vector<float> kept;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i)
      if (live[i]) {
        rows.push_back(i);
        kept.insert(kept.end(), base.begin() + i * dim, base.begin() + (i + 1) * dim);
      }
    auto want = brute_force(kept, queries, dim, k);
    for (auto& hits : want)
      for (AnnHit& hit : hits) hit.item = rows[static_cast<size_t>(hit.item)];
    const auto got = index.search(queries.data(), 5, k);
    for (size_t q = 0; q < got.size(); ++q) {
      ASSERT_EQ(got[q].size(), want[q].size());
      for (size_t j = 0; j < got[q].size(); ++j) {
        EXPECT_EQ(got[q][j].item, want[q][j].item) << "query " << q << " rank " << j;
        EXPECT_NEAR(got[q][j].score, want[q][j].score, 1e-5);
      }
    }
  };
  expect_live_search(100);
  std::vector<std::string> many;
  for (int64_t i = 0; i < n; i += 3) {
    many.push_back("id-" + std::to_string(i));
    live[i] = false;
  }
  EXPECT_EQ(index.place_on("cpu"), "cpu");  // updates need the index in host memory
  EXPECT_EQ(index.remove(many), 500);
  index.place_on(moe::kernels::make_cpu_backend(), nullptr);
  expect_live_search(600);  // 600 + 502 tombstones: through the selector
  expect_live_search(20);
}

// Searches from other threads while rows are upserted and removed: none fails, and none returns a
// row whose remove had returned before the search began.
TEST(AnnIndexLiveUpdates, SearchesDuringUpdatesNeverSeeDeletedRows) {
  for (const char* factory : {"Flat", "HNSW16"}) {
    SCOPED_TRACE(factory);
    // At least min_updates updates, and more until the searchers have run min_searches searches.
    const int dim = 16, n = 2000, min_updates = 600, min_searches = 200, max_updates = 20000;
    const auto base = clustered_vectors(n, dim, 8, 72);
    AnnBuildOptions opts;
    opts.index_type = factory;
    AnnIndex index = AnnIndex::create(dim, opts);
    index.add(base.data(), n, fielded_items(n));
    std::vector<std::atomic<bool>> gone(static_cast<size_t>(n + max_updates));
    std::atomic<bool> done{false};
    std::atomic<int> violations{0}, failures{0}, searches{0};
    auto searcher = [&](unsigned seed) {
      const auto queries = random_unit_vectors(4, dim, seed);
      const moe::AnnFilter mug = filter_named("mug");
      while (!done.load()) {
        std::vector<bool> gone_before(gone.size());
        for (size_t i = 0; i < gone.size(); ++i) gone_before[i] = gone[i].load();
        moe::AnnSearchOptions options;
        if (searches.fetch_add(1) % 2) options.filter = &mug;
        try {
          for (const auto& hits : index.search(queries.data(), 4, 20, options))
            for (const AnnHit& hit : hits) {
              if (gone_before[static_cast<size_t>(hit.item)]) ++violations;
              index.item(hit.item);
            }
        } catch (const std::exception&) {
          ++failures;
        }
      }
    };
    std::thread a(searcher, 73), b(searcher, 74);
    std::mt19937 rng(75);
    for (int u = 0; u < max_updates && (u < min_updates || searches.load() < min_searches); ++u) {
      const std::string id = "id-" + std::to_string(rng() % n);
      const int64_t old = index.find(id);
      if (u % 2) {
        const auto v = random_unit_vectors(1, dim, 2000 + u);
        index.upsert(v.data(), dim, {id, "", "", fields_of_row(index.size())});
      } else {
        index.remove({id});
      }
      if (old >= 0) gone[static_cast<size_t>(old)] = true;
    }
    done = true;
    a.join();
    b.join();
    EXPECT_GE(searches.load(), min_searches);
    EXPECT_EQ(violations.load(), 0);
    EXPECT_EQ(failures.load(), 0);
  }
}

// ---- search through a compute backend (GPU-resident flat indexes) --------------------------------

// The hits of `index` for `queries` equal FAISS's flat search on the same vectors.
void expect_same_hits(const AnnIndex& placed, const std::vector<std::vector<AnnHit>>& faiss_hits,
                      const std::vector<float>& queries, int k) {
  const auto got = placed.search(queries.data(), static_cast<int64_t>(faiss_hits.size()), k);
  ASSERT_EQ(got.size(), faiss_hits.size());
  for (size_t q = 0; q < got.size(); ++q) {
    ASSERT_EQ(got[q].size(), faiss_hits[q].size());
    for (size_t j = 0; j < got[q].size(); ++j) {
      EXPECT_EQ(got[q][j].item, faiss_hits[q][j].item) << "query " << q << " rank " << j;
      EXPECT_NEAR(got[q][j].score, faiss_hits[q][j].score, 1e-5) << "query " << q << " rank " << j;
    }
  }
}

TEST(AnnIndex, BackendSearchEqualsFaissFlat) {
  const int dim = 32;
  const auto base = random_unit_vectors(700, dim, 11);
  const auto queries = random_unit_vectors(37, dim, 12);
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), 700, numbered_items(700));
  const auto faiss_hits = index.search(queries.data(), 37, 10);
  const auto faiss_all = index.search(queries.data(), 37, 800);  // k above the size: every item

  index.place_on(moe::kernels::make_cpu_backend(), nullptr);
  expect_same_hits(index, faiss_hits, queries, 10);
  expect_same_hits(index, faiss_all, queries, 800);
  EXPECT_TRUE(index.search(queries.data(), 0, 5).empty());
  expect_error([&] { index.add(base.data(), 1, numbered_items(1)); }, {"add after place_on(cpu)"});
  EXPECT_EQ(index.place_on("cpu"), "cpu");  // back to FAISS
  expect_same_hits(index, faiss_hits, queries, 10);

  AnnBuildOptions hnsw;
  hnsw.index_type = "hnsw";
  AnnIndex graph = AnnIndex::create(dim, hnsw);
  graph.add(base.data(), 50, numbered_items(50));
  expect_error([&] { graph.place_on(moe::kernels::make_cpu_backend(), nullptr); }, {"flat indexes only", "HNSW"});
  EXPECT_EQ(graph.place_on("auto"), "cpu");  // HNSW: FAISS is the best there is
  expect_error([&] { index.place_on("gpu"); }, {"gpu"});
}

TEST(AnnIndexOnCuda, GpuResidentFlatSearchEqualsFaiss) {
  std::string why;
  if (moe::kernels::cuda_device_count(&why) == 0) {
    AnnIndex index = AnnIndex::create(8, {});
    expect_error([&] { index.place_on("cuda:0"); }, {"cuda:0"});
    GTEST_SKIP() << why;
  }
  const int dim = 512;
  const auto base = random_unit_vectors(20000, dim, 13);
  const auto queries = random_unit_vectors(64, dim, 14);
  AnnIndex index = AnnIndex::create(dim, {});
  index.add(base.data(), 20000, numbered_items(20000));
  const auto faiss_hits = index.search(queries.data(), 64, 100);
  EXPECT_EQ(index.place_on("cuda:0"), "cuda:0");
  expect_same_hits(index, faiss_hits, queries, 100);
  EXPECT_EQ(index.place_on("auto"), "cuda:0");
}

}  // namespace
