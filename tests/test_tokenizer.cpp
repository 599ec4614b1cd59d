// CLIP tokenizer: ids must equal Hugging Face's slow CLIPTokenizer (with ftfy) on the recorded
// cases in tests/fixtures/tokenizer_cases.json, with the real vocabulary in models/clip-tokenizer.
#include <glib.h>
#include <glib/gstdio.h>
#include <gtest/gtest.h>
#include <json-glib/json-glib.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "io/json_util.h"
#include "moe/error.h"
#include "moe/tokenizer.h"
#include "moe_build_config.h"
#include "test_util.h"

using moe::test::expect_error;
using moe::test::fixture_path;

namespace {

std::string source_path(const std::string& rel) { return std::string(MOE_SOURCE_DIR) + "/" + rel; }
const std::string kModelDir = source_path("models/clip-tokenizer");

std::string ids_to_string(const std::vector<int32_t>& ids) {
  std::ostringstream ss;
  ss << "[";
  for (size_t i = 0; i < ids.size(); ++i) ss << (i ? ", " : "") << ids[i];
  ss << "]";
  return ss.str();
}

// A scratch directory removed with its files at the end of the test.
class TempDir {
 public:
  TempDir() {
    GError* err = nullptr;
    gchar* dir = g_dir_make_tmp("moe-tokenizer-XXXXXX", &err);
    if (dir == nullptr) {
      std::string msg = err ? err->message : "unknown error";
      if (err) g_error_free(err);
      throw std::runtime_error("cannot create temp dir: " + msg);
    }
    path_ = dir;
    g_free(dir);
  }
  ~TempDir() {
    for (const auto& f : files_) g_remove(f.c_str());
    g_rmdir(path_.c_str());
  }
  std::string write(const std::string& name, const std::string& content) {
    std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << content;
    files_.push_back(p);
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

class ClipTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = new moe::ClipTokenizer(moe::ClipTokenizer::from_directory(kModelDir)); }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  static moe::ClipTokenizer* tok_;
};
moe::ClipTokenizer* ClipTokenizerTest::tok_ = nullptr;

TEST_F(ClipTokenizerTest, SpecialIdsAndVocabSize) {
  EXPECT_EQ(tok_->bos_id(), 49406);
  EXPECT_EQ(tok_->eos_id(), 49407);
  EXPECT_EQ(tok_->vocab_size(), 49408u);
}

TEST_F(ClipTokenizerTest, PhotoOfACat) {
  EXPECT_EQ(tok_->encode("a photo of a cat"), (std::vector<int32_t>{49406, 320, 1125, 539, 320, 2368, 49407}));
}

TEST_F(ClipTokenizerTest, MatchesHuggingFaceOnFixtureCases) {
  const std::string path = source_path("tests/fixtures/tokenizer_cases.json");
  moe::json::Document doc = moe::json::Document::from_file(path);
  ASSERT_TRUE(JSON_NODE_HOLDS_ARRAY(doc.root())) << path << ": expected a JSON array";
  JsonArray* cases = json_node_get_array(doc.root());
  const guint n = json_array_get_length(cases);
  ASSERT_GT(n, 0u);
  int checked = 0;
  for (guint i = 0; i < n; ++i) {
    JsonObject* c = json_array_get_object_element(cases, i);
    ASSERT_NE(c, nullptr) << path << ": case " << i << " is not an object";
    const std::string text = moe::json::get_string(c, "text", path);
    JsonArray* arr = json_object_get_array_member(c, "ids");
    ASSERT_NE(arr, nullptr) << path << ": case " << i << " has no 'ids' array";
    std::vector<int32_t> want;
    for (guint j = 0; j < json_array_get_length(arr); ++j)
      want.push_back(static_cast<int32_t>(json_array_get_int_element(arr, j)));

    // ftfy.fix_text's own output: the tokenizer's text repair, checked before the ids it leads to.
    EXPECT_EQ(moe::ftfy_fix_text(text), moe::json::get_string(c, "fixed", path)) << "case " << i;
    std::vector<int32_t> got = tok_->encode(text, 77);
    EXPECT_EQ(got, want) << "case " << i << ": \"" << text << "\"\n  HF:   " << ids_to_string(want)
                         << "\n  ours: " << ids_to_string(got) << "\n  normalized: \""
                         << moe::ClipTokenizer::normalize_text(text) << "\"";
    ++checked;
  }
  std::cout << "[ INFO     ] " << checked << " cases compared\n";
}

TEST_F(ClipTokenizerTest, SpecialTokensInTextMapStraightToIds) {
  EXPECT_EQ(tok_->encode("<|startoftext|>a photo<|endoftext|>"),
            (std::vector<int32_t>{49406, 49406, 320, 1125, 49407, 49407}));
  // Upper case is not the literal token; lower-casing turns it into one for the regex.
  EXPECT_EQ(tok_->encode("<|ENDOFTEXT|>"), (std::vector<int32_t>{49406, 49407, 49407}));
}

TEST_F(ClipTokenizerTest, EmptyAndWhitespaceOnly) {
  EXPECT_EQ(tok_->encode(""), (std::vector<int32_t>{49406, 49407}));
  EXPECT_EQ(tok_->encode(" \t\n "), (std::vector<int32_t>{49406, 49407}));
}

TEST_F(ClipTokenizerTest, InvalidUtf8Throws) {
  expect_error([&] { tok_->encode(std::string("abc\xff", 4)); }, {"not valid UTF-8", "byte offset 3"});
  expect_error([&] { tok_->encode(std::string("ok \xe2\x82", 5)); }, {"not valid UTF-8", "byte offset 3"});
  // Encoded surrogates are not UTF-8 either.
  expect_error([&] { tok_->encode("\xed\xa0\x80"); }, {"not valid UTF-8", "byte offset 0"});
}

TEST_F(ClipTokenizerTest, TruncationKeepsEndToken) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "cat ";
  std::vector<int32_t> ids = tok_->encode(text);
  ASSERT_EQ(ids.size(), 77u);
  EXPECT_EQ(ids.front(), 49406);
  EXPECT_EQ(ids[75], 2368);  // "cat</w>"
  EXPECT_EQ(ids[76], 49407);

  ids = tok_->encode(text, 5);
  EXPECT_EQ(ids, (std::vector<int32_t>{49406, 2368, 2368, 2368, 49407}));
  EXPECT_EQ(tok_->encode(text, 2), (std::vector<int32_t>{49406, 49407}));
  expect_error([&] { tok_->encode(text, 1); }, {"max_length"});
}

TEST_F(ClipTokenizerTest, BatchEqualsSingle) {
  const std::vector<std::string> texts = {"a photo of a dog", "", "Ünïcödé ﬁne", "two\nlines"};
  auto batch = tok_->encode_batch(texts, 77);
  ASSERT_EQ(batch.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], tok_->encode(texts[i])) << texts[i];
}

TEST_F(ClipTokenizerTest, ConcurrentEncodeIsConsistent) {
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i)
    texts.push_back("photo number " + std::to_string(i) + " of a xylophone-" + std::to_string(i * 7919));
  std::vector<std::vector<int32_t>> expected;
  {
    // A fresh tokenizer so the threads race on an empty BPE cache.
    moe::ClipTokenizer fresh = moe::ClipTokenizer::from_directory(kModelDir);
    std::vector<std::thread> threads;
    std::vector<std::vector<std::vector<int32_t>>> results(4);
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] { results[static_cast<size_t>(t)] = fresh.encode_batch(texts); });
    for (auto& th : threads) th.join();
    for (const auto& text : texts) expected.push_back(tok_->encode(text));
    for (const auto& r : results) EXPECT_EQ(r, expected);
  }
}

// The ftfy steps, checked against what ftfy 6 returns for the same input.
TEST(FtfyFixText, CoveredFixes) {
  EXPECT_EQ(moe::ftfy_fix_text("&amp; &lt;b&gt; &eacute; &EACUTE; &#x41;&#66; &hellip;"), "& <b> é É AB …");
  EXPECT_EQ(moe::ftfy_fix_text("a < b &amp; c"), "a < b &amp; c");  // looks like HTML: left alone
  EXPECT_EQ(moe::ftfy_fix_text("x &amp;\n<p> &amp;"), "x &\n<p> &amp;");
  EXPECT_EQ(moe::ftfy_fix_text("&amp;lt;"), "<");  // fixed until nothing changes
  EXPECT_EQ(moe::ftfy_fix_text("&#59; &bogus; &#12ab;"), "&#59; &bogus; &#12ab;");
  EXPECT_EQ(moe::ftfy_fix_text("\xEF\xAC\x81ne \xEF\xAC\x82ow"), "fine flow");                // ﬁ ﬂ
  EXPECT_EQ(moe::ftfy_fix_text("\xEF\xBC\xA1\xEF\xBC\xA2\xE3\x80\x80\xEF\xBD\x98"), "AB x");  // ＡＢ　ｘ
  EXPECT_EQ(moe::ftfy_fix_text("\xE2\x80\x9Chere\xE2\x80\x99s\xE2\x80\x9D"), "\"here's\"");
  EXPECT_EQ(moe::ftfy_fix_text("\x1b[31mred\x1b[0m"), "red");
  EXPECT_EQ(moe::ftfy_fix_text("\xEF\xBB\xBF"
                               "bom\x07"),
            "bom");
  EXPECT_EQ(moe::ftfy_fix_text("a\r\nb\rc\xE2\x80\xA8"), "a\nb\nc\n");
  EXPECT_EQ(moe::ftfy_fix_text("cafe\xCC\x81"), "caf\xC3\xA9");  // NFC
  EXPECT_EQ(moe::ftfy_fix_text("\xC2\x93q\xC2\x94"), "\"q\"");   // C1 controls read as cp1252
  // Mojibake (UTF-8 read as Latin-1/Windows-1252); expected values are ftfy 6.3.1's fix_text.
  EXPECT_EQ(moe::ftfy_fix_text("caf\xC3\x83\xC2\xA9"), "caf\xC3\xA9");                  // cafÃ© -> café
  EXPECT_EQ(moe::ftfy_fix_text("caf\xC3\x83\xC6\x92\xC3\x82\xC2\xA9"), "caf\xC3\xA9");  // twice
  EXPECT_EQ(moe::ftfy_fix_text("voil\xC3\x83 le travail"), "voil\xC3\xA0 le travail");  // A0 lost as a space
  EXPECT_EQ(moe::ftfy_fix_text("\xC3\x82\xC2\xA3"
                               "5 \xC3\xA2\xE2\x80\x9A\xC2\xAC"
                               "10"),
            "\xC2\xA3"
            "5 \xE2\x82\xAC"
            "10");  // £5 €10
  EXPECT_EQ(moe::ftfy_fix_text("\xC3\x82me \xC3\x83gua na\xC3\xAFve"),
            "\xC3\x82me \xC3\x83gua na\xC3\xAFve");  // real Latin-1 letters stay
  // Bytes that happen to form UTF-8 but are not mojibake: CAFÉ’s, weiß…, 2×½ (ftfy leaves them too).
  EXPECT_EQ(moe::ftfy_fix_text("CAF\xC3\x89\xE2\x80\x99s"), "CAF\xC3\x89's");
  EXPECT_EQ(moe::ftfy_fix_text("wei\xC3\x9F\xE2\x80\xA6"), "wei\xC3\x9F\xE2\x80\xA6");
  EXPECT_EQ(moe::ftfy_fix_text("2\xC3\x97\xC2\xBD cups"), "2\xC3\x97\xC2\xBD cups");
  // Mojibake of mojibake whose middle layer holds curly quotes: repaired before they are uncurled.
  EXPECT_EQ(moe::ftfy_fix_text("\xC3\x83\xC2\xA2\xC3\xA2\xE2\x82\xAC\xC5\xA1\xC3\x82\xC2\xAC"
                               "10"),
            "\xE2\x82\xAC"
            "10");  // Ã¢â€šÂ¬10 -> €10
}

TEST(ClipTokenizerNormalize, PythonLowerAndWhitespace) {
  EXPECT_EQ(moe::ClipTokenizer::normalize_text("  A\t\tB  \n"), "a b");
  EXPECT_EQ(moe::ClipTokenizer::normalize_text("\xC4\xB0"), "i\xCC\x87");  // İ -> i + U+0307
  // Final sigma only after a cased letter and not before one.
  EXPECT_EQ(moe::ClipTokenizer::normalize_text("\xCE\x9F\xCE\xA3 \xCE\xA3"), "\xCE\xBF\xCF\x82 \xCF\x83");
}

TEST(ClipTokenizerLoad, MissingFilesNameThePath) {
  expect_error([] { moe::ClipTokenizer::from_directory("/nonexistent/clip"); }, {"/nonexistent/clip/vocab.json"});
  const std::string vocab = kModelDir + "/vocab.json";
  expect_error([&] { moe::ClipTokenizer::from_files(vocab, "/nonexistent/merges.txt"); },
               {"/nonexistent/merges.txt", "cannot open"});
}

TEST(ClipTokenizerLoad, MalformedFilesNameThePath) {
  TempDir dir;
  const std::string good_merges = dir.write("merges.txt", "#version: 0.2\na b\nab c</w>\n");
  const std::string good_vocab = dir.write(
      "vocab.json", R"({"a": 0, "b": 1, "ab": 2, "c</w>": 3, "abc</w>": 4, "<|startoftext|>": 5, "<|endoftext|>": 6})");
  moe::ClipTokenizer tiny = moe::ClipTokenizer::from_files(good_vocab, good_merges);
  EXPECT_EQ(tiny.encode("abc"), (std::vector<int32_t>{5, 4, 6}));
  EXPECT_EQ(tiny.encode("zz"), (std::vector<int32_t>{5, 6, 6, 6}));  // unknown -> <|endoftext|>

  const std::string bad_json = dir.write("bad_vocab.json", "{\"a\": 0,");
  expect_error([&] { moe::ClipTokenizer::from_files(bad_json, good_merges); }, {bad_json, "invalid JSON"});
  const std::string not_int = dir.write("str_vocab.json", R"({"a": "zero", "<|startoftext|>": 1, "<|endoftext|>": 2})");
  expect_error([&] { moe::ClipTokenizer::from_files(not_int, good_merges); }, {not_int, "'a'", "not an integer"});
  const std::string no_special = dir.write("nospecial_vocab.json", R"({"a": 0})");
  expect_error([&] { moe::ClipTokenizer::from_files(no_special, good_merges); }, {no_special, "<|startoftext|>"});

  const std::string no_header = dir.write("noheader.txt", "a b\n");
  expect_error([&] { moe::ClipTokenizer::from_files(good_vocab, no_header); }, {no_header, "#version"});
  const std::string three = dir.write("three.txt", "#version: 0.2\na b\na b c\n");
  expect_error([&] { moe::ClipTokenizer::from_files(good_vocab, three); }, {three, "line 3"});
  const std::string empty = dir.write("empty.txt", "");
  expect_error([&] { moe::ClipTokenizer::from_files(good_vocab, empty); }, {empty, "empty"});
}

}  // namespace
