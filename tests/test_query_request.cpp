// Bounds on JSON from outside (moe::json_bounds_violation, applied by every engine parser) and
// the request parser zmq-query uses (moe::parse_query_request, moe::read_query_image_file):
// hostile inputs are refused with a reason that names the cause, never crash or cost much.
#include <gtest/gtest.h>
#include <glib/gstdio.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "moe/clip_config.h"
#include "moe/error.h"
#include "moe/json_bounds.h"
#include "moe/query_request.h"
#include "moe/tokenizer.h"
#include "test_util.h"

using moe::QueryRejected;
using moe::QueryRequest;
using moe::test::expect_error;
using moe::test::TempDir;

namespace {

QueryRequest parse(const std::string& message, moe::QueryLimits limits = {}) {
  return moe::parse_query_request(message, limits);
}

// The reason and the partial request of a refused message; fails the test if it is accepted.
QueryRejected rejection(const std::string& message, moe::QueryLimits limits = {}) {
  try {
    parse(message, limits);
  } catch (const QueryRejected& r) {
    return r;
  }
  ADD_FAILURE() << "accepted: " << message.substr(0, 200);
  return QueryRejected("", {});
}

void expect_rejected(const std::string& message, const std::string& reason_part, const std::string& id = "",
                     moe::QueryLimits limits = {}) {
  const QueryRejected r = rejection(message, limits);
  EXPECT_NE(std::string(r.what()).find(reason_part), std::string::npos) << r.what();
  EXPECT_EQ(r.request.id, id) << r.what();
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

// Runs `fn` in a child process whose stack is `stack_bytes` and whose address space is limited to
// `memory_bytes`; true if it returned normally. A crash (stack overflow) or an allocation beyond
// the limit fails it, so a test cannot pass by luck on a machine with much memory.
template <typename Fn>
bool runs_within(rlim_t stack_bytes, rlim_t memory_bytes, Fn&& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    const rlimit stack{stack_bytes, stack_bytes};
    // AddressSanitizer reserves terabytes of address space for its shadow memory: there, only
    // the stack is limited (its own checks catch an overflow of it).
    if (!kAddressSanitizer) {
      const rlimit memory{memory_bytes, memory_bytes};
      setrlimit(RLIMIT_AS, &memory);
    }
    // The main thread's stack limit is read at exec; a thread gets exactly the size asked for.
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, stack.rlim_cur);
    pthread_t thread;
    static Fn* body;
    body = &fn;
    if (pthread_create(
            &thread, &attr,
            [](void*) -> void* {
              try {
                (*body)();
              } catch (...) {
              }
              return nullptr;
            },
            nullptr) != 0)
      _exit(2);
    pthread_join(thread, nullptr);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

TEST(JsonBounds, MeasuresDepthOutsideStringsOnly) {
  const moe::JsonBounds bounds{1000, 3};
  EXPECT_EQ(moe::json_bounds_violation(R"({"a":[{"b":1}]})", bounds), "");
  EXPECT_NE(
      moe::json_bounds_violation(R"({"a":[{"b":[1]}]})", bounds).find("nested more than 3 levels deep (at byte 11)"),
      std::string::npos);
  // Brackets inside strings, escaped quotes included, do not count.
  EXPECT_EQ(moe::json_bounds_violation(R"({"a":"[[[[[\"[[[[","b":["]]]]"]})", bounds), "");
  // Closing brackets bring the depth back down.
  EXPECT_EQ(moe::json_bounds_violation("[[[]],[[]],[[]]]", bounds), "");
  EXPECT_NE(moe::json_bounds_violation(std::string(1001, ' '), bounds).find("1001 bytes (at most 1000)"),
            std::string::npos);
}

TEST(JsonBounds, RefusesIntegersBeyond64Bits) {
  const moe::JsonBounds bounds{1000, 8};
  EXPECT_EQ(moe::json_bounds_violation("[9223372036854775807,-9223372036854775808,0,-0,007]", bounds), "");
  EXPECT_NE(moe::json_bounds_violation(R"({"k": 1180591620717411303424})", bounds)
                .find("the integer 1180591620717411303424 at byte 6 does not fit in 64 bits"),
            std::string::npos);
  EXPECT_NE(moe::json_bounds_violation("[9223372036854775808]", bounds), "");
  EXPECT_NE(moe::json_bounds_violation("[-9223372036854775809]", bounds), "");
  // Fractions and exponents are doubles, whatever their digits; numbers inside strings are text.
  EXPECT_EQ(moe::json_bounds_violation("[1.5e99999999999999999999, 1180591620717411303424.0]", bounds), "");
  EXPECT_EQ(moe::json_bounds_violation(R"(["1180591620717411303424"])", bounds), "");
}

TEST(JsonBounds, CountsValues) {
  const moe::JsonBounds bounds{1000, 8, 4};
  EXPECT_EQ(moe::json_bounds_violation("[1,2,3]", bounds), "");
  EXPECT_NE(moe::json_bounds_violation("[1,2,3,4]", bounds).find("more than 4 values"), std::string::npos);
  EXPECT_EQ(moe::json_bounds_violation(R"(["a,b,c,d,e"])", bounds), "");
}

// A model file nested 100,000 deep used to overflow the parsing thread's stack.
TEST(JsonBounds, DeeplyNestedModelFileIsRefusedWithoutCrashing) {
  TempDir dir;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string config = dir.write("config.json", R"({"text_config": )" + deep + "}");
  expect_error([&] { moe::ClipConfig::from_file(config); }, {config, "nested more than 64 levels deep"});
  const std::string vocab = dir.write("vocab.json", deep);
  const std::string merges = dir.write("merges.txt", "#version: 0.2\n");
  expect_error([&] { moe::ClipTokenizer::from_files(vocab, merges); }, {vocab, "nested more than 64 levels deep"});
  // The same file with the check bypassed would crash a 256 KiB stack: the check runs first.
  EXPECT_TRUE(runs_within(256 << 10, rlim_t(4) << 30, [&] { moe::ClipConfig::from_file(config); }));
}

TEST(QueryRequest, ParsesTheThreeKinds) {
  QueryRequest t = parse(R"({"id":"q1","text":"red mug","k":5})");
  EXPECT_EQ(t.id, "q1");
  EXPECT_EQ(t.modality, moe::QueryModality::Text);
  EXPECT_EQ(t.text, "red mug");
  EXPECT_EQ(t.k, 5);
  QueryRequest i = parse(R"({"id":2,"image":"mug.jpg"})");
  EXPECT_EQ(i.id, "2");
  EXPECT_EQ(i.modality, moe::QueryModality::Image);
  EXPECT_EQ(i.image, "mug.jpg");
  EXPECT_EQ(i.k, 0);
  QueryRequest b = parse(R"({"id":"q3","image_base64":"aGVs\nbG8="})");
  EXPECT_EQ(std::string(b.image_bytes.begin(), b.image_bytes.end()), "hello");
}

// 100,000 '[' used to overflow json-glib's recursive parser in the service's streaming thread.
TEST(QueryRequest, DeepNestingIsRefusedBeforeParsing) {
  expect_rejected(std::string(100000, '['), "nested more than 32 levels deep");
  expect_rejected(R"({"id":"d","text":"x","extra":)" + std::string(50, '[') + std::string(50, ']') + "}",
                  "nested more than 32 levels deep");
  const std::string bomb = std::string(1000000, '[');
  EXPECT_TRUE(runs_within(256 << 10, rlim_t(2) << 30, [&] { parse(bomb); }));
}

TEST(QueryRequest, ManyValuesAreRefused) {
  std::string wide = R"({"id":"w","text":"x","pad":[)";
  for (int i = 0; i < 100000; ++i) wide += "0,";
  wide += "0]}";
  expect_rejected(wide, "more than 2048 values");
}

TEST(QueryRequest, TextLongerThanTheLimitIsRefused) {
  moe::QueryLimits limits;
  limits.max_text_bytes = 10;
  EXPECT_EQ(parse(R"({"id":"a","text":"0123456789"})", limits).text, "0123456789");
  expect_rejected(R"({"id":"a","text":"01234567890"})", "text is 11 bytes, more than max-text-bytes (10)", "a", limits);
  const QueryRejected big = rejection(R"({"id":"big","text":")" + std::string(10 << 20, 'a') + "\"}");
  EXPECT_NE(std::string(big.what()).find("text is 10485760 bytes, more than max-text-bytes (4096)"), std::string::npos);
  EXPECT_STREQ(big.code, moe::error_code::kTextTooLong);
  // The refused request's record, which the error document echoes, keeps the text clipped to 1 KiB.
  EXPECT_EQ(big.request.id, "big");
  EXPECT_EQ(big.request.text, std::string(moe::kMaxEchoedQueryBytes, 'a') + "...");
  const QueryRejected path = rejection(R"({"id":"p","image":")" + std::string(5000, 'p') + "\"}");
  EXPECT_NE(std::string(path.what()).find("image is 5000 bytes, longer than a path may be (4096)"), std::string::npos);
  EXPECT_STREQ(path.code, moe::error_code::kInvalidRequest);
  EXPECT_EQ(path.request.image, std::string(moe::kMaxEchoedQueryBytes, 'p') + "...");
  EXPECT_EQ(path.request.modality, moe::QueryModality::Image);
}

// Whatever check refuses a request, its answer can still show the client which query it was.
TEST(QueryRequest, RefusedRequestsEchoTheirQuery) {
  const QueryRejected bad_k = rejection(R"({"id":"k","text":"red mug","k":0})");
  EXPECT_EQ(bad_k.request.text, "red mug");
  EXPECT_EQ(bad_k.request.modality, moe::QueryModality::Text);
  const QueryRejected no_id = rejection(R"({"text":"blue cup"})");
  EXPECT_EQ(no_id.request.id, "");
  EXPECT_EQ(no_id.request.text, "blue cup");
  const QueryRejected image = rejection(R"({"id":"i","image":"mug.jpg","k":"5"})");
  EXPECT_EQ(image.request.image, "mug.jpg");
  EXPECT_EQ(image.request.modality, moe::QueryModality::Image);
  const QueryRejected text_not_string = rejection(R"({"id":"t","text":5,"image":"cup.png"})");
  EXPECT_EQ(text_not_string.request.image, "cup.png");
  // Nothing to echo: not JSON, or no query member.
  EXPECT_EQ(rejection("{\"id\":\"x\",\"text\":").request.text, "");
  const QueryRejected none = rejection(R"({"id":"x"})");
  EXPECT_EQ(none.request.text + none.request.image, "");
}

TEST(QueryRequest, RefusalsCarryTheCodeOfTheirCause) {
  EXPECT_STREQ(rejection("[1]").code, moe::error_code::kInvalidRequest);
  EXPECT_STREQ(rejection(R"({"id":"k","text":"x","k":0})").code, moe::error_code::kInvalidRequest);
  moe::QueryLimits limits;
  limits.max_text_bytes = 2;
  limits.max_image_bytes = 4;
  EXPECT_STREQ(rejection(R"({"id":"t","text":"abc"})", limits).code, moe::error_code::kTextTooLong);
  EXPECT_STREQ(rejection(R"({"id":"b","image_base64":"aGVsbG8="})", limits).code, moe::error_code::kImageTooLarge);
  EXPECT_STREQ(rejection(R"({"id":"b","image_base64":"a$=="})", limits).code, moe::error_code::kInvalidRequest);
}

TEST(QueryRequest, ClipsEchoesAtCharacterBoundaries) {
  EXPECT_EQ(moe::clip_utf8("abc", 3), "abc");
  EXPECT_EQ(moe::clip_utf8("abcd", 3), "abc...");
  // "é" is two bytes: a cut inside it moves back to its start.
  EXPECT_EQ(moe::clip_utf8("ab\xc3\xa9", 3), "ab...");
}

TEST(QueryRequest, KIsAnIntegerInRange) {
  expect_rejected(R"({"id":"k","text":"x","k":0})", "k must be an integer from 1 to 1024 (got 0)", "k");
  expect_rejected(R"({"id":"k","text":"x","k":1025})", "(got 1025)", "k");
  expect_rejected(R"({"id":"k","text":"x","k":2.5})", "(got a fractional number)", "k");
  expect_rejected(R"({"id":"k","text":"x","k":"5"})", "(got a string)", "k");
  // 2**70 used to be reported as "(got -1)": json-glib wraps it. Refused before parsing, naming it.
  expect_rejected(R"({"id":"k","text":"x","k":1180591620717411303424})",
                  "the integer 1180591620717411303424 at byte 25 does not fit in 64 bits", "k");
  // An id beyond 64 bits cannot be echoed as read: refused before it is kept.
  expect_rejected(R"({"id":18446744073709551615,"text":"x"})", "the integer 18446744073709551615 at byte 6");
}

TEST(QueryRequest, IdOfTheWrongTypeIsEchoedAsItsJson) {
  expect_rejected(R"({"id":[1,"a"],"text":"x"})", "id must be a string or an integer (got an array)", "[1,\"a\"]");
  expect_rejected(R"({"id":true,"text":"x"})", "(got a boolean)", "true");
  expect_rejected(R"({"id":null,"text":"x"})", "(got null)", "null");
  expect_rejected(R"({"id":"","text":"x"})", "id is empty");
  const std::string long_id(300, 'i');
  const QueryRejected r = rejection(R"({"id":")" + long_id + R"(","text":"x"})");
  EXPECT_NE(std::string(r.what()).find("id is 300 bytes, more than 256"), std::string::npos) << r.what();
  EXPECT_EQ(r.request.id, std::string(256, 'i') + "...");
}

TEST(QueryRequest, MalformedMessagesNameTheirCause) {
  expect_rejected("", "request is empty");
  expect_rejected("\xff\xfe{}", "not valid UTF-8 (byte offset 0)");
  expect_rejected("[1,2]", "not a JSON object");
  expect_rejected(R"({"id":"x","image":"a","image_base64":"aGVsbG8="})",
                  "request has both image and image_base64: send the image once", "x");
  expect_rejected(R"({"id":"x"})", "it has none", "x");
  expect_rejected(R"({"id":"x","text":5})", "text must be a string (got an integer)", "x");
  expect_rejected(R"({"id":"x","image_base64":"a$=="})", "unexpected character '$' at offset 1", "x");
  moe::QueryLimits limits;
  limits.max_image_bytes = 4;
  expect_rejected(R"({"id":"x","image_base64":"aGVsbG8="})", "decodes to 5 bytes, more than max-image-bytes (4)", "x",
                  limits);
}

TEST(QueryRequest, ImageFilesAreReadOnlyInsideTheRoot) {
  TempDir dir;
  const std::string root = dir.path() + "/root";
  g_mkdir(root.c_str(), 0755);
  dir.write("root/a.png", "png!");
  dir.write("secret.png", "nope");
  char* real = realpath(root.c_str(), nullptr);
  const std::string canonical = real;
  free(real);
  const std::vector<uint8_t> bytes = moe::read_query_image_file("a.png", canonical, 100);
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), "png!");
  expect_error([&] { moe::read_query_image_file("../secret.png", canonical, 100); },
               {"'../secret.png' is outside image-root"});
  expect_error([&] { moe::read_query_image_file("../missing.png", canonical, 100); }, {"is outside image-root"});
  expect_error([&] { moe::read_query_image_file("missing.png", canonical, 100); }, {"'missing.png' cannot be read"});
  expect_error([&] { moe::read_query_image_file("a.png", canonical, 3); }, {"4 bytes, more than max-image-bytes (3)"});
  expect_error([&] { moe::read_query_image_file("http://x/a.png", canonical, 100); }, {"neither a local path nor"});
  const auto code_of = [&](const std::string& image, uint64_t max_bytes) -> std::string {
    try {
      moe::read_query_image_file(image, canonical, max_bytes);
    } catch (const moe::RequestRefused& e) {
      return e.code;
    }
    return "accepted";
  };
  EXPECT_EQ(code_of("../secret.png", 100), moe::error_code::kImageUnavailable);
  EXPECT_EQ(code_of("missing.png", 100), moe::error_code::kImageUnavailable);
  EXPECT_EQ(code_of("a.png", 3), moe::error_code::kImageTooLarge);
  EXPECT_EQ(code_of("http://x/a.png", 100), moe::error_code::kInvalidRequest);
}

namespace {

TEST(QueryRequest, SearchKnobsAreReadWithinBounds) {
  const QueryRequest r = parse(R"({"id":"n","text":"x","nprobe":32,"ef_search":200})");
  EXPECT_EQ(r.nprobe, 32);
  EXPECT_EQ(r.ef_search, 200);
  EXPECT_EQ(parse(R"({"id":"n","text":"x"})").nprobe, 0);  // the service's default
  expect_rejected(R"({"id":"n","text":"x","nprobe":0})", "nprobe must be an integer from 1 to 65536 (got 0)", "n");
  expect_rejected(R"({"id":"n","text":"x","nprobe":"8"})", "nprobe must be an integer from 1 to 65536 (got a string)",
                  "n");
  expect_rejected(R"({"id":"n","text":"x","ef_search":5000})", "ef_search must be an integer from 1 to 4096 (got 5000)",
                  "n");
}

TEST(QueryRequest, FiltersAreParsed) {
  const QueryRequest r = parse(R"({"id":"f","text":"mug","filter":{"category":"mug","colour":{"in":["red","blue"]},)"
                               R"("price":{"gte":10,"lt":20.5},"in_stock":true,"size":3}})");
  const auto& c = r.filter.all_of;
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(c[0].field, "category");
  EXPECT_EQ(c[0].any_of, (std::vector<moe::AnnFieldValue>{std::string("mug")}));
  EXPECT_EQ(c[1].any_of, (std::vector<moe::AnnFieldValue>{std::string("red"), std::string("blue")}));
  EXPECT_FALSE(c[1].is_range());
  EXPECT_TRUE(c[2].is_range());
  EXPECT_EQ(c[2].gte, 10.0);
  EXPECT_EQ(c[2].lt, 20.5);
  EXPECT_FALSE(c[2].gt.has_value());
  EXPECT_EQ(c[3].any_of, (std::vector<moe::AnnFieldValue>{true}));
  EXPECT_EQ(c[4].any_of, (std::vector<moe::AnnFieldValue>{3.0}));
  EXPECT_TRUE(parse(R"({"id":"f","text":"mug"})").filter.empty());
  // An empty set matches nothing: accepted (the search answers with no hits).
  EXPECT_TRUE(parse(R"({"id":"f","text":"mug","filter":{"colour":{"in":[]}}})").filter.all_of[0].any_of.empty());
}

TEST(QueryRequest, HostileFiltersAreRefusedAsInvalidRequests) {
  const std::string head = R"({"id":"h","text":"x","filter":)";
  const auto refused = [&](const std::string& filter, const std::string& reason) {
    const QueryRejected r = rejection(head + filter + "}");
    EXPECT_NE(std::string(r.what()).find(reason), std::string::npos) << filter << ": " << r.what();
    EXPECT_STREQ(r.code, moe::error_code::kInvalidRequest) << filter;
    EXPECT_EQ(r.request.id, "h");
    EXPECT_EQ(r.request.text, "x");  // echoed
  };
  refused(R"(["category"])", "filter must be an object of field conditions (got an array)");
  refused(R"({"category":null})", "filter.category must be a string, a number or a boolean (got null)");
  refused(R"({"category":["mug"]})", "filter.category must be a string, a number or a boolean (got an array)");
  refused(R"({"price":{}})", "filter.price: an empty condition");
  refused(R"({"price":{"between":[1,2]}})", "filter.price: unknown operator 'between' (use in, gt, gte, lt, lte)");
  refused(R"({"price":{"gte":"10"}})", "filter.price.gte must be a number (got a string)");
  refused(R"({"price":{"in":[1],"lt":3}})", "\"in\" cannot be combined with a range");
  refused(R"({"colour":{"in":"red"}})", "filter.colour.in must be an array of values (got a string)");
  refused(R"({"colour":{"in":["red",{"a":1}]}})", "filter.colour.in[1] must be a string, a number or a boolean");
  refused(R"({"":"x"})", "filter has a field with an empty name");
  refused("{\"" + std::string(200, 'n') + "\":1}", "the field name is 200 bytes, more than 128");
  refused(R"({"c":")" + std::string(300, 'v') + "\"}", "filter.c is 300 bytes, more than 256");
  std::string many = "{";
  for (int i = 0; i < 17; ++i) many += (i ? ",\"f" : "\"f") + std::to_string(i) + "\":1";
  refused(many + "}", "filter has 17 fields, more than 16");
  std::string wide_set = R"({"c":{"in":[)";
  for (int i = 0; i < 300; ++i) wide_set += (i ? ",\"" : "\"") + std::to_string(i) + "\"";
  refused(wide_set + "]}}", "filter.c.in has 300 values, more than 256");
  // Nesting and sheer size are refused before parsing, as for any request.
  expect_rejected(head + std::string(40, '[') + std::string(40, ']') + "}", "nested more than 32 levels deep", "");
}

// A hybrid: an image and a text in one request ("like this photo, but red"), each within its own bound.
TEST(QueryRequest, ParsesHybridRequests) {
  const QueryRequest path = parse(R"({"id":"h1","text":"but red","image":"mug.jpg","k":3})");
  EXPECT_EQ(path.modality, moe::QueryModality::Hybrid);
  EXPECT_EQ(path.op, moe::QueryOp::Search);
  EXPECT_EQ(path.text, "but red");
  EXPECT_EQ(path.image, "mug.jpg");
  EXPECT_EQ(path.k, 3);
  const QueryRequest bytes = parse(R"({"id":"h2","image_base64":"aGVsbG8=","text":"in blue"})");
  EXPECT_EQ(bytes.modality, moe::QueryModality::Hybrid);
  EXPECT_EQ(bytes.text, "in blue");
  EXPECT_EQ(std::string(bytes.image_bytes.begin(), bytes.image_bytes.end()), "hello");
  EXPECT_TRUE(bytes.image.empty());

  moe::QueryLimits limits;
  limits.max_text_bytes = 4;
  limits.max_image_bytes = 4;
  const QueryRejected long_text = rejection(R"({"id":"h3","text":"too long","image":"mug.jpg"})", limits);
  EXPECT_STREQ(long_text.code, moe::error_code::kTextTooLong);
  // A refused hybrid echoes both of its queries.
  EXPECT_EQ(long_text.request.modality, moe::QueryModality::Hybrid);
  EXPECT_EQ(long_text.request.text, "too long");
  EXPECT_EQ(long_text.request.image, "mug.jpg");
  const QueryRejected big = rejection(R"({"id":"h4","text":"red","image_base64":"aGVsbG8="})", limits);
  EXPECT_STREQ(big.code, moe::error_code::kImageTooLarge);
  EXPECT_EQ(big.request.modality, moe::QueryModality::Hybrid);
  EXPECT_EQ(big.request.text, "red");
  expect_rejected(R"({"id":"h5","text":"red","image":")" + std::string(5000, 'p') + "\"}",
                  "image is 5000 bytes, longer than a path may be (4096)", "h5");
  expect_rejected(R"({"id":"h6","text":"red","image":"a.png","image_base64":"aGVsbG8="})",
                  "both image and image_base64", "h6");
  expect_rejected(R"({"id":"h7","text":"","image":"a.png"})", "text is empty", "h7");
  expect_rejected(R"({"id":"h8","text":"red","image":7})", "image must be a string", "h8");
  expect_rejected(R"({"id":"h9","text":["red"],"image_base64":"aGVsbG8="})", "text must be a string (got an array)",
                  "h9");
}

TEST(QueryRequest, ParsesUpserts) {
  const QueryRequest t =
      parse(R"({"id":"u1","op":"upsert","item":{"id":"sku-9","caption":"red mug","uri":"https://cdn.example/9.png",)"
            R"("fields":{"price":12.5,"tags":["a","b"],"dims":{"h":9}}},"text":"a red mug"})");
  EXPECT_EQ(t.op, moe::QueryOp::Upsert);
  EXPECT_EQ(t.modality, moe::QueryModality::Text);
  EXPECT_EQ(t.text, "a red mug");
  EXPECT_EQ(t.item.id, "sku-9");
  EXPECT_EQ(t.item.caption, "red mug");
  EXPECT_EQ(t.item.uri, "https://cdn.example/9.png");
  // The compact JSON text of the object, as the item table keeps a catalog line's fields.
  EXPECT_EQ(t.item.fields, R"({"price":12.5,"tags":["a","b"],"dims":{"h":9}})");
  const QueryRequest i =
      parse(R"({"id":2,"op":"upsert","item":{"id":"sku-10","fields":{}},"image_base64":"aGVsbG8="})");
  EXPECT_EQ(i.modality, moe::QueryModality::Image);
  EXPECT_EQ(i.item.id, "sku-10");
  EXPECT_EQ(i.item.fields, "");  // none, as in the item table
  EXPECT_EQ(i.item.caption + i.item.uri, "");
  EXPECT_EQ(std::string(i.image_bytes.begin(), i.image_bytes.end()), "hello");
  const QueryRequest path = parse(R"({"id":"u3","op":"upsert","item":{"id":"a","caption":""},"image":"a.png"})");
  EXPECT_EQ(path.image, "a.png");
  EXPECT_EQ(parse(R"({"id":"s","op":"search","text":"x"})").op, moe::QueryOp::Search);
  EXPECT_TRUE(parse(R"({"id":"s","text":"x"})").item.id.empty());
}

TEST(QueryRequest, ParsesDeletes) {
  const QueryRequest d = parse(R"({"id":"d1","op":"delete","items":["sku-9","sku-10","sku-9"]})");
  EXPECT_EQ(d.op, moe::QueryOp::Delete);
  EXPECT_EQ(d.item_ids, (std::vector<std::string>{"sku-9", "sku-10", "sku-9"}));
  EXPECT_TRUE(d.text.empty() && d.image.empty() && d.image_bytes.empty());
  std::string most = R"({"id":"d2","op":"delete","items":[)";
  for (size_t i = 0; i < moe::kMaxDeleteItems; ++i) most += (i ? ",\"" : "\"") + std::to_string(i) + "\"";
  const QueryRequest many = parse(most + "]}");
  ASSERT_EQ(many.item_ids.size(), moe::kMaxDeleteItems);
  EXPECT_EQ(many.item_ids.back(), std::to_string(moe::kMaxDeleteItems - 1));
  EXPECT_EQ(parse(R"({"id":"d3","op":"delete","items":[")" + std::string(moe::kMaxItemIdBytes, 'i') + "\"]}")
                .item_ids[0]
                .size(),
            moe::kMaxItemIdBytes);
}

// Updates from a client that gets them wrong, or means harm: each refused with its id, a reason
// naming the member, and the code of its cause.
TEST(QueryRequest, HostileUpdatesAreRefused) {
  const auto refused = [](const std::string& message, const std::string& reason,
                          const char* code = moe::error_code::kInvalidRequest) {
    const QueryRejected r = rejection(message);
    EXPECT_NE(std::string(r.what()).find(reason), std::string::npos) << message.substr(0, 200) << ": " << r.what();
    EXPECT_STREQ(r.code, code) << message.substr(0, 200);
    EXPECT_EQ(r.request.id, "u") << message.substr(0, 200);
  };
  const std::string upsert = R"({"id":"u","op":"upsert","text":"x","item":)";
  const std::string del = R"({"id":"u","op":"delete","items":)";
  refused(R"({"id":"u","op":5,"text":"x"})", "op must be a string: search, upsert or delete (got an integer)");
  refused(R"({"id":"u","op":"merge","text":"x"})", "op 'merge' is not an operation of this service",
          moe::error_code::kUnsupportedOp);
  refused(R"({"id":"u","op":"","text":"x"})", "op '' is not an operation", moe::error_code::kUnsupportedOp);
  refused(R"({"id":"u","op":"UPSERT","text":"x"})", "op 'UPSERT'", moe::error_code::kUnsupportedOp);
  // Upserts.
  refused(R"({"id":"u","op":"upsert","text":"x"})", "item is missing");
  refused(upsert + "[1]}", "item must be an object (got an array)");
  refused(upsert + "{}}", "item.id is missing");
  refused(upsert + R"({"caption":"c"}})", "item.id is missing");
  refused(upsert + R"({"id":5}})", "item.id must be a string (got an integer)");
  refused(upsert + R"({"id":""}})", "item.id is empty");
  refused(upsert + R"({"id":")" + std::string(300, 'i') + "\"}}", "item.id is 300 bytes, more than 256");
  refused(upsert + R"({"id":"a","caption":)" + "\"" + std::string(5000, 'c') + "\"}}",
          "item.caption is 5000 bytes, more than 4096");
  refused(upsert + R"({"id":"a","uri":["u"]}})", "item.uri must be a string (got an array)");
  refused(upsert + R"({"id":"a","fields":"price=3"}})", "item.fields must be an object (got a string)");
  refused(upsert + R"({"id":"a","fields":{"notes":")" + std::string(70000, 'n') + "\"}}}",
          "item.fields is 70012 bytes of JSON, more than 65536");
  refused(upsert + R"({"id":"a","price":3}})", "item.price is not a member of an item (id, caption, uri, fields)");
  refused(R"({"id":"u","op":"upsert","item":{"id":"a"}})", "request needs text, image or image_base64; it has none");
  refused(R"({"id":"u","op":"upsert","item":{"id":"a"},"text":"x","image":"a.png"})", "not both");
  refused(R"({"id":"u","op":"upsert","item":{"id":"a"},"vector":[0.1,0.2]})", "vector is not taken");
  refused(R"({"id":"u","op":"upsert","item":{"id":"a"},"text":"x","items":["a"]})", "add \"op\": \"delete\"");
  // Update members in a search: most likely a forgotten "op".
  refused(R"({"id":"u","text":"x","item":{"id":"a"}})", "item describes the item of an upsert: add \"op\": \"upsert\"");
  refused(R"({"id":"u","op":"search","text":"x","items":["a"]})", "add \"op\": \"delete\"");
  // Deletes.
  refused(R"({"id":"u","op":"delete"})", "items is missing");
  refused(R"({"id":"u","op":"delete","items":["a"],"text":"x"})", "text is not part of a delete");
  refused(R"({"id":"u","op":"delete","items":["a"],"image_base64":"aGVsbG8="})",
          "image_base64 is not part of a delete");
  refused(R"({"id":"u","op":"delete","items":["a"],"item":{"id":"a"}})", "item is not part of a delete");
  refused(del + R"("sku-9"})", "items must be an array of catalog ids (got a string)");
  refused(del + R"({"id":"a"}})", "items must be an array of catalog ids (got an object)");
  refused(del + "[]}", "items is empty");
  refused(del + R"(["a",1]})", "items[1] must be a string (got an integer)");
  refused(del + R"(["a",null]})", "items[1] must be a string (got null)");
  refused(del + R"(["a",["b"]]})", "items[1] must be a string (got an array)");
  refused(del + R"([""]})", "items[0] is empty");
  refused(del + R"([")" + std::string(300, 'i') + "\"]}", "items[0] is 300 bytes, more than 256");
  std::string too_many = del + "[";
  for (size_t i = 0; i <= moe::kMaxDeleteItems; ++i) too_many += (i ? ",\"" : "\"") + std::to_string(i) + "\"";
  refused(too_many + "]}", "items names 1025 ids, more than 1024 (send them in several deletes)",
          moe::error_code::kTooManyItems);
  // Beyond the request's depth or value bounds, refused before JSON-GLib runs (the id is not read then).
  expect_rejected(upsert + R"({"id":"a","fields":)" + std::string(40, '[') + std::string(40, ']') + "}}",
                  "nested more than 32 levels deep");
  std::string flood = R"({"id":"f","op":"delete","items":[)";
  for (int i = 0; i < 100000; ++i) flood += "\"x\",";
  const QueryRejected r = rejection(flood + "\"x\"]}");
  EXPECT_NE(std::string(r.what()).find("more than 2048 values"), std::string::npos) << r.what();
  EXPECT_STREQ(r.code, moe::error_code::kInvalidRequest);
}

}  // namespace
