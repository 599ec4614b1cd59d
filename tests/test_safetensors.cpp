// Safetensors reader: valid files, every corner case of a bad header, sharded checkpoints, and
// a deterministic mutation fuzz loop (parse must reject, never crash).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "test_util.h"

using moe::DType;
using moe::SafetensorsFile;
using moe::test::expect_error;
using moe::test::fixture_path;
using moe::test::TempDir;

namespace {

std::string make_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

SafetensorsFile parse(const std::string& bytes, const std::string& name = "mem.safetensors") {
  auto owner = std::make_shared<std::string>(bytes);
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(owner->data()), owner->size(), owner, name);
}

std::string floats(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

}  // namespace

TEST(Safetensors, ParsesValidFile) {
  const std::string data = floats({1, 2, 3, 4}) + std::string("\x00\x3c\x00\x40", 4);  // f16 1.0, 2.0
  const std::string hdr = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"F16","shape":[2],"data_offsets":[16,20]}})";
  auto f = parse(make_file(hdr, data));
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  moe::Tensor a = f.get("a");
  EXPECT_EQ(a.dtype(), DType::F32);
  EXPECT_EQ(a.shape(), (moe::Shape{2, 2}));
  EXPECT_FLOAT_EQ(a.data<float>()[3], 4.0f);
  moe::Tensor b = f.get("b").to_f32();
  EXPECT_FLOAT_EQ(b.data<float>()[0], 1.0f);
  EXPECT_FLOAT_EQ(b.data<float>()[1], 2.0f);
  expect_error([&] { f.get("c"); }, {"mem.safetensors", "'c'"});
}

TEST(Safetensors, ScalarAndEmptyTensors) {
  const std::string hdr =
      R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]}})";
  auto f = parse(make_file(hdr, floats({7})));
  EXPECT_FLOAT_EQ(f.get("s").data<float>()[0], 7.0f);
  EXPECT_EQ(f.get("e").numel(), 0);
}

TEST(Safetensors, MisalignedDataIsCopied) {
  // A 3-byte header padding leaves the data section misaligned for f32.
  const std::string hdr = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} )";
  ASSERT_NE(hdr.size() % 4, 0u);
  auto f = parse(make_file(hdr, floats({5, 6})));
  moe::Tensor a = f.get("a");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.raw_data()) % 4, 0u);
  EXPECT_FLOAT_EQ(a.data<float>()[1], 6.0f);
}

TEST(Safetensors, RejectsTruncatedFile) {
  expect_error([] { parse("abc"); }, {"mem.safetensors", "truncated"});
  const std::string hdr = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string bytes = make_file(hdr, floats({1}));
  expect_error([&] { parse(bytes.substr(0, 20)); }, {"truncated", "header length"});
  // Header intact, data cut short.
  expect_error([&] { parse(bytes.substr(0, bytes.size() - 2)); }, {"'a'", "past the data section"});
}

TEST(Safetensors, RejectsOversizedHeader) {
  std::string bytes(16, '\0');
  const uint64_t n = 200ull * 1024 * 1024;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  expect_error([&] { parse(bytes); }, {"exceeds"});
}

TEST(Safetensors, RejectsOutOfRangeOffsets) {
  expect_error(
      [] {
        parse(make_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", floats({1, 2})));
      },
      {"'a'", "past the data section"});
  expect_error(
      [] {
        parse(make_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", floats({1, 2})));
      },
      {"'a'", "begin 8 > end 4"});
  expect_error([] { parse(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", floats({1}))); },
               {"'a'", "non-negative"});
  expect_error([] { parse(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", floats({1}))); },
               {"'a'", "2 entries"});
}

TEST(Safetensors, RejectsOverlappingTensors) {
  const std::string hdr =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  expect_error([&] { parse(make_file(hdr, floats({1, 2, 3}))); }, {"'a'", "'b'", "overlap"});
}

TEST(Safetensors, RejectsOverlapHiddenByAnEmptyTensor) {
  // Sorted by offset, the empty 'e' sits between 'a' and 'b', which share bytes 4..8.
  const std::string hdr =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  expect_error([&] { parse(make_file(hdr, floats({1, 2, 3}))); }, {"'a' (bytes 0..8)", "'b' (bytes 4..12)", "overlap"});
  // An empty tensor inside another one's bytes, as the reference implementation refuses too.
  expect_error(
      [] {
        parse(make_file(
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
            floats({1, 2})));
      },
      {"empty tensor 'e'", "byte 4", "inside tensor 'a'"});
  // Between tensors, before the first and after the last, an empty tensor is fine.
  const auto f = parse(make_file(
      R"({"e0":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("e1":{"dtype":"I8","shape":[0,2],"data_offsets":[4,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
      R"("e2":{"dtype":"F16","shape":[0],"data_offsets":[8,8]}})",
      floats({1, 2})));
  EXPECT_EQ(f.names().size(), 5u);
}

TEST(Safetensors, RejectsGapsInTheDataSection) {
  const std::string a = R"("a":{"dtype":"F32","shape":[1],"data_offsets":)";
  const std::string b = R"("b":{"dtype":"F32","shape":[1],"data_offsets":)";
  // Between two tensors, before the first, after the last.
  expect_error(
      [&] {
        parse(make_file("{" + a + "[0,4]}," + b + "[8,12]}}", floats({1, 2, 3})));
      },
      {"mem.safetensors", "bytes 4..8", "belong to no tensor", "before tensor 'b' (bytes 8..12)"});
  expect_error([&] { parse(make_file("{" + a + "[4,8]}}", floats({1, 2}))); }, {"bytes 0..4", "before tensor 'a'"});
  expect_error(
      [&] {
        parse(make_file("{" + a + "[0,4]}}", floats({1, 2})));
      },
      {"bytes 4..8", "end of the data section"});
  expect_error([] { parse(make_file(R"({"__metadata__":{"k":"v"}})", "xy")); },
               {"bytes 0..2", "end of the data section"});
  EXPECT_TRUE(parse(make_file(R"({"__metadata__":{"k":"v"}})", "")).names().empty());
}

TEST(Safetensors, RejectsRepeatedKeys) {
  const std::string entry = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  // JSON-GLib would keep the last 'a'; the first would be lost without a word.
  expect_error([&] { parse(make_file(R"({"a":)" + entry + R"(,"a":)" + entry + "}", floats({1}))); },
               {"mem.safetensors", "key 'a' appears more than once in the header"});
  expect_error(
      [] { parse(make_file(R"({"a":{"dtype":"F16","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", floats({1}))); },
      {"key 'dtype' appears more than once in 'a'"});
  expect_error([&] { parse(make_file(R"({"__metadata__":{"k":"1","k":"2"},"a":)" + entry + "}", floats({1}))); },
               {"key 'k' appears more than once in '__metadata__'"});
  expect_error([&] { parse(make_file(R"({"__metadata__":{},"a":)" + entry + R"(,"__metadata__":{}})", floats({1}))); },
               {"key '__metadata__' appears more than once in the header"});
}

TEST(Safetensors, RejectsNulInStrings) {
  // JSON-GLib would cut the name at the NUL and load tensor 'a'.
  expect_error(
      [] { parse(make_file(R"({"a\u0000b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", floats({1}))); },
      {"mem.safetensors", R"("a\u0000b")", "NUL"});
  expect_error(
      [] { parse(make_file(R"({"a":{"dtype":"F32\u0000x","shape":[1],"data_offsets":[0,4]}})", floats({1}))); },
      {R"("F32\u0000x")", "NUL"});
  // An escaped backslash followed by "u0000" is no NUL, and an escaped quote does not end the name.
  const auto f = parse(make_file(R"({"a\\u0000\"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", floats({1})));
  EXPECT_EQ(f.names(), std::vector<std::string>{"a\\u0000\"b"});
}

TEST(Safetensors, RejectsUnknownDtype) {
  expect_error([] { parse(make_file(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "x")); },
               {"'a'", "unsupported dtype 'F8_E4M3'"});
  expect_error([] { parse(make_file(R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", "x")); },
               {"'a'", "dtype"});
}

TEST(Safetensors, RejectsShapeSizeMismatch) {
  expect_error(
      [] {
        parse(make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", floats({1, 2})));
      },
      {"'a'", "needs 12 bytes", "span 8"});
  expect_error([] { parse(make_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", floats({1}))); },
               {"'a'", "negative dimension"});
  expect_error([] { parse(make_file(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", floats({1}))); },
               {"'a'", "not an integer"});
  expect_error(
      [] {
        parse(make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
                        floats({1})));
      },
      {"'a'", "too large"});
}

TEST(Safetensors, RejectsMalformedHeader) {
  expect_error([] { parse(make_file("{not json", "")); }, {"mem.safetensors", "invalid JSON"});
  expect_error([] { parse(make_file("[1,2]", "")); }, {"not a JSON object"});
  expect_error([] { parse(make_file(std::string("{\"\xff\":1}"), "")); }, {"UTF-8"});
  expect_error([] { parse(make_file(R"({"__metadata__":{"k":1}})", "")); }, {"__metadata__", "'k'"});
  expect_error([] { parse(make_file(R"({"a":[1]})", "")); }, {"'a'", "not an object"});
}

TEST(Safetensors, FuzzedBytesNeverCrash) {
  const std::string hdr = R"({"__metadata__":{"f":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]}})";
  const std::string good = make_file(hdr, floats({1, 2, 3, 4}) + "abcd");
  std::mt19937 rng(1234);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string m = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % m.size();
      switch (rng() % 3) {
        case 0:
          m[pos] = static_cast<char>(rng() & 0xFF);
          break;
        case 1:
          m.erase(pos, 1 + rng() % 3);
          break;
        default:
          m.insert(pos, 1, "0123456789[]{},:\"-"[rng() % 18]);
          break;
      }
      if (m.empty()) m = "x";
    }
    try {
      auto f = parse(m);
      for (const auto& n : f.names()) {
        moe::Tensor t = f.get(n);
        volatile float sink = t.to_f32().numel() ? t.to_f32().data<float>()[0] : 0.0f;
        (void)sink;
      }
      ++accepted;
    } catch (const moe::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_EQ(accepted + rejected, 3000);
}

TEST(Safetensors, OpenErrorsNameTheFile) {
  expect_error([] { SafetensorsFile::open("/nonexistent/x.safetensors"); },
               {"/nonexistent/x.safetensors", "cannot open"});
  expect_error([] { SafetensorsFile::open(fixture_path("")); }, {"not a regular file"});
}

TEST(Checkpoint, ReadsShardedHuggingFaceCheckpoint) {
  auto ck = moe::Checkpoint::open(fixture_path("mixtral_tiny"));
  ASSERT_TRUE(ck.contains("model.layers.1.block_sparse_moe.gate.weight"));
  const std::string file = ck.file_of("model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_NE(file.find("of-0000"), std::string::npos) << file;
  moe::Tensor g = ck.get("model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(g.shape(), (moe::Shape{6, 16}));
  // Every listed tensor resolves in its shard.
  for (const auto& n : ck.names()) EXPECT_NO_THROW(ck.get(n)) << n;
  expect_error(
      [&] {
        ck.get_f32("model.layers.1.block_sparse_moe.gate.weight", {16, 6});
      },
      {"gate.weight", "has shape [6,16]", "expected [16,6]"});
}

TEST(Checkpoint, ReportsMissingShardAndBadIndex) {
  const std::string dir = ::testing::TempDir() + "/moe_ckpt_missing";
  ASSERT_EQ(0, system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()));
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"w":"model-00001-of-00002.safetensors"}})";
  auto ck = moe::Checkpoint::open(dir);
  expect_error([&] { ck.get("w"); }, {"model-00001-of-00002.safetensors", "cannot open"});
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map":{"w":"../etc/passwd"}})";
  expect_error([&] { moe::Checkpoint::open(dir); }, {"outside the checkpoint"});
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"metadata":{}})";
  expect_error([&] { moe::Checkpoint::open(dir); }, {"index.json", "weight_map"});
  expect_error([] { moe::Checkpoint::open(::testing::TempDir()); }, {"no model.safetensors"});
}

// ---- fingerprints ----------------------------------------------------------------------------

namespace {

std::string fingerprint_of(const std::string& path) { return moe::Checkpoint::open(path).fingerprint(); }

// A file with one F32 tensor "big" of `n` floats 0, 1, 2, ... (data section in the given order
// of "big" and a 1-float tensor "small"; `metadata` is a JSON object text or empty).
std::string big_tensor_file(size_t n, bool big_first, const std::string& metadata, size_t changed = SIZE_MAX) {
  std::string big(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float v = i == changed ? -1.0f : static_cast<float>(i);
    std::memcpy(&big[i * 4], &v, 4);
  }
  const std::string small = floats({42});
  const std::string nb = std::to_string(big.size());
  const std::string big_entry = R"("big":{"dtype":"F32","shape":[)" + std::to_string(n) + R"(],"data_offsets":[)";
  const std::string small_entry = R"("small":{"dtype":"F32","shape":[1],"data_offsets":[)";
  const std::string meta = metadata.empty() ? "" : R"("__metadata__":)" + metadata + ",";
  if (big_first)
    return make_file(
        "{" + meta + big_entry + "0," + nb + "]}," + small_entry + nb + "," + std::to_string(big.size() + 4) + "]}}",
        big + small);
  return make_file("{" + meta + small_entry + "0,4]}," + big_entry + "4," + std::to_string(big.size() + 4) + "]}}",
                   small + big);
}

}  // namespace

TEST(Fingerprint, StableAcrossLoadsAndIndependentOfThePath) {
  const std::string path = fixture_path("adapter_tiny/adapter.safetensors");
  const std::string fp = fingerprint_of(path);
  ASSERT_EQ(fp.size(), 16u) << fp;
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos) << fp;
  EXPECT_EQ(fingerprint_of(path), fp);
  EXPECT_EQ(fingerprint_of(fixture_path("adapter_tiny") + "/../adapter_tiny/adapter.safetensors"), fp);

  TempDir dir;
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(fingerprint_of(dir.write("renamed.safetensors", bytes)), fp);
  // A directory holding model.safetensors is the same checkpoint.
  dir.write("model.safetensors", bytes);
  EXPECT_EQ(fingerprint_of(dir.path()), fp);
}

TEST(Fingerprint, ChangesWhenOneValueChanges) {
  const std::string path = fixture_path("adapter_tiny/adapter.safetensors");
  const std::string fp = fingerprint_of(path);
  TempDir dir;
  for (const std::string name : {"gate.weight", "experts.5.w2.weight"}) {
    const std::string copy = dir.file(name + ".safetensors");
    moe::test::copy_with_one_value_changed(path, copy, name);
    EXPECT_NE(fingerprint_of(copy), fp) << name;
  }
  // Models differ from each other.
  EXPECT_NE(fingerprint_of(fixture_path("clip_tiny")), fp);
  EXPECT_NE(fingerprint_of(fixture_path("clip_tiny")), fingerprint_of(fixture_path("clip_tiny_bpe")));
}

TEST(Fingerprint, WeightsOnlyNotLayoutOrMetadata) {
  TempDir dir;
  const size_t n = 1000;
  const std::string fp = fingerprint_of(dir.write("a.safetensors", big_tensor_file(n, true, "")));
  EXPECT_EQ(fingerprint_of(dir.write("b.safetensors", big_tensor_file(n, false, R"({"format":"pt"})"))), fp);
  EXPECT_NE(fingerprint_of(dir.write("c.safetensors", big_tensor_file(n, true, "", n - 1))), fp);
}

TEST(Fingerprint, LargeTensorsAreSampledAtStartMiddleAndEnd) {
  constexpr size_t kSampleFloats = moe::Checkpoint::kFingerprintSampleBytes / 4;
  const size_t n = 64 * 1024;  // 256 KiB: sampled
  const size_t slice = kSampleFloats / 3;
  TempDir dir;
  const std::string fp = fingerprint_of(dir.write("base.safetensors", big_tensor_file(n, true, "")));
  const size_t middle = (n - slice) / 2 + slice / 2;
  for (size_t changed : {size_t{0}, slice - 1, middle, n - slice, n - 1})
    EXPECT_NE(fingerprint_of(dir.write("x.safetensors", big_tensor_file(n, true, "", changed))), fp) << changed;
  // Between the samples a change goes unseen: the price of not reading a large model in full.
  EXPECT_EQ(fingerprint_of(dir.write("y.safetensors", big_tensor_file(n, true, "", slice + 10))), fp);
}

TEST(Fingerprint, ShardedCheckpointCoversEveryShard) {
  const std::string fp = fingerprint_of(fixture_path("mixtral_tiny"));
  ASSERT_EQ(fp.size(), 16u);
  EXPECT_EQ(fingerprint_of(fixture_path("mixtral_tiny/model.safetensors.index.json")), fp);
  // Changing a tensor in the last shard changes it.
  TempDir dir;
  const moe::Checkpoint ck = moe::Checkpoint::open(fixture_path("mixtral_tiny"));
  std::string last_tensor;
  for (const std::string& name : ck.names())
    if (ck.file_of(name).find("00004-of-00004") != std::string::npos) last_tensor = name;
  ASSERT_FALSE(last_tensor.empty());
  for (int i = 1; i <= 4; ++i) {
    const std::string shard = "model-0000" + std::to_string(i) + "-of-00004.safetensors";
    if (i == 4)
      moe::test::copy_with_one_value_changed(fixture_path("mixtral_tiny/" + shard), dir.file(shard), last_tensor);
    else
      std::filesystem::copy_file(fixture_path("mixtral_tiny/" + shard), dir.file(shard));
  }
  std::filesystem::copy_file(fixture_path("mixtral_tiny/model.safetensors.index.json"),
                             dir.file("model.safetensors.index.json"));
  EXPECT_NE(fingerprint_of(dir.path()), fp);
}
