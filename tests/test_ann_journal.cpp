// moe::AnnIndex's journal of live updates: replay over the saved pair, torn tails, generations,
// saves interrupted between their renames, and a child process killed at random moments.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moe/ann_index.h"
#include "moe/error.h"
#include "test_util.h"

namespace {

using moe::AnnBuildOptions;
using moe::AnnIndex;
using moe::AnnItem;
using moe::test::expect_error;
using moe::test::random_unit_vectors;
using moe::test::read_text;
using moe::test::TempDir;
using moe::test::write_text;

constexpr int kDim = 8;
constexpr int kBase = 50;      // items item-0 .. item-49 before any update
constexpr int kUniverse = 80;  // the ids updates touch: item-0 .. item-79
constexpr size_t kJournalHeader = 24;

AnnItem item_for(const std::string& id, const std::string& caption) {
  return {id, "file:///catalog/" + id + ".png", caption, ""};
}

AnnIndex base_index(const std::string& factory) {
  AnnBuildOptions opts;
  opts.index_type = factory;
  AnnIndex index = AnnIndex::create(kDim, opts);
  const auto vectors = random_unit_vectors(kBase, kDim, 7);
  std::vector<AnnItem> items;
  for (int i = 0; i < kBase; ++i) items.push_back(item_for("item-" + std::to_string(i), "base"));
  index.add(vectors.data(), kBase, items);
  return index;
}

// Operation i of every test's stream: an upsert (its caption names it, and so its vector) or, one
// time in four, a remove; of one of kUniverse ids.
struct Op {
  bool remove;
  std::string id;
  std::vector<float> vector;
  std::string caption;
};

Op op_number(int64_t i) {
  std::mt19937 rng(static_cast<unsigned>(1000 + i));
  Op op;
  op.id = "item-" + std::to_string(rng() % kUniverse);
  op.remove = rng() % 4 == 0;
  if (!op.remove) {
    op.vector = random_unit_vectors(1, kDim, static_cast<unsigned>(5000 + i));
    op.caption = "op-" + std::to_string(i);
  }
  return op;
}

void apply(AnnIndex& index, const Op& op) {
  if (op.remove)
    index.remove({op.id});
  else
    index.upsert(op.vector.data(), kDim, item_for(op.id, op.caption));
}

// The live items after the first `ops` operations: id -> its vector and caption.
struct Expected {
  std::vector<float> vector;
  std::string caption;
};
std::map<std::string, Expected> reference(int64_t ops) {
  std::map<std::string, Expected> out;
  const auto vectors = random_unit_vectors(kBase, kDim, 7);
  for (int i = 0; i < kBase; ++i)
    out["item-" + std::to_string(i)] = {
        std::vector<float>(vectors.begin() + i * kDim, vectors.begin() + (i + 1) * kDim), "base"};
  for (int64_t i = 0; i < ops; ++i) {
    Op op = op_number(i);
    if (op.remove)
      out.erase(op.id);
    else
      out[op.id] = {std::move(op.vector), op.caption};
  }
  return out;
}

// What an index holds of the universe: id -> caption of its live row.
std::map<std::string, std::string> live_captions(const AnnIndex& index) {
  std::map<std::string, std::string> out;
  for (int i = 0; i < kUniverse; ++i) {
    const std::string id = "item-" + std::to_string(i);
    const int64_t row = index.find(id);
    if (row >= 0) out[id] = index.item(row).caption;
  }
  return out;
}

std::map<std::string, std::string> captions_of(const std::map<std::string, Expected>& state) {
  std::map<std::string, std::string> out;
  for (const auto& [id, e] : state) out[id] = e.caption;
  return out;
}

// `index` holds exactly `state`: the same live ids and captions, and each id's vector finds its row.
void expect_state(const AnnIndex& index, const std::map<std::string, Expected>& state) {
  EXPECT_EQ(live_captions(index), captions_of(state));
  EXPECT_EQ(index.live_size(), static_cast<int64_t>(state.size()));
  moe::AnnSearchOptions options;
  options.ef_search = 256;
  for (const auto& [id, e] : state) {
    const auto hits = index.search(e.vector.data(), 1, 1, options);
    ASSERT_EQ(hits[0].size(), 1u) << id;
    EXPECT_EQ(hits[0][0].item, index.find(id)) << id;
    EXPECT_NEAR(hits[0][0].score, 1.0f, 1e-4) << id;
  }
}

class AnnJournal : public ::testing::TestWithParam<const char*> {
 protected:
  TempDir dir_;
  std::string path_ = dir_.file("catalog.faiss");
  std::string journal_ = path_ + ".journal";
};

TEST_P(AnnJournal, LoadReplaysTheUpdatesOverTheSavedPair) {
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  index.attach_journal(path_);
  for (int64_t i = 0; i < 40; ++i) apply(index, op_number(i));
  EXPECT_GT(std::filesystem::file_size(journal_), kJournalHeader);
  const AnnIndex loaded = AnnIndex::load(path_);
  expect_state(loaded, reference(40));
  EXPECT_EQ(loaded.size(), index.size());  // every row, tombstones included, as they were numbered

  // A save folds the journal into the pair and starts an empty one; updates go on after it.
  index.save(path_);
  EXPECT_EQ(std::filesystem::file_size(journal_), kJournalHeader);
  for (int64_t i = 40; i < 60; ++i) apply(index, op_number(i));
  expect_state(AnnIndex::load(path_), reference(60));
  expect_error([&] { index.add(reference(0).at("item-1").vector.data(), 1, {item_for("x", "")}); },
               {"add() after attach_journal", "upsert"});
}

TEST_P(AnnJournal, AttachingToAPathWithoutThisStateSavesFirst) {
  AnnIndex index = base_index(GetParam());
  index.train();
  index.attach_journal(path_);  // never saved: the pair is written first
  for (int64_t i = 0; i < 10; ++i) apply(index, op_number(i));
  expect_state(AnnIndex::load(path_), reference(10));

  // Updated while no journal was attached: attaching saves again, so nothing is lost.
  AnnIndex loaded = AnnIndex::load(path_);
  for (int64_t i = 10; i < 20; ++i) apply(loaded, op_number(i));
  loaded.attach_journal(path_);
  expect_state(AnnIndex::load(path_), reference(20));
}

// A record cut short or damaged at the journal's end was never acknowledged: load() ignores it,
// and attach_journal cuts it off so that the next records follow the last good one.
TEST_P(AnnJournal, ATornTailIsIgnoredAndCutOff) {
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  index.attach_journal(path_);
  for (int64_t i = 0; i < 20; ++i) apply(index, op_number(i));
  const auto before_last = std::filesystem::file_size(journal_);
  const auto vector = random_unit_vectors(1, kDim, 99);
  index.upsert(vector.data(), kDim, item_for("item-3", "last"));
  const std::string full = read_text(journal_);
  ASSERT_GT(full.size(), before_last + 8);

  for (size_t cut : {before_last + 1, before_last + 4, before_last + 9, (before_last + full.size()) / 2,
                     static_cast<size_t>(full.size() - 1)}) {
    write_text(journal_, full.substr(0, cut));
    expect_state(AnnIndex::load(path_), reference(20));
  }
  for (size_t at : {before_last + 2, before_last + 12, static_cast<size_t>(full.size() - 2)}) {
    std::string flipped = full;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    write_text(journal_, flipped);
    expect_state(AnnIndex::load(path_), reference(20));
  }

  write_text(journal_, full.substr(0, (before_last + full.size()) / 2));
  AnnIndex resumed = AnnIndex::load(path_);
  resumed.attach_journal(path_);
  EXPECT_EQ(std::filesystem::file_size(journal_), before_last);
  for (int64_t i = 20; i < 25; ++i) apply(resumed, op_number(i));
  expect_state(AnnIndex::load(path_), reference(25));
}

// save() gives the pair a higher generation; a journal of an older one (its records already in the
// pair) is ignored rather than applied again, and one newer than the pair is refused.
TEST_P(AnnJournal, GenerationsSeparateSaves) {
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  const std::string first_index = read_text(path_), first_items = read_text(path_ + ".items.jsonl");
  EXPECT_NE(first_items.find("\"generation\":1,"), std::string::npos);
  index.attach_journal(path_);
  for (int64_t i = 0; i < 30; ++i) apply(index, op_number(i));
  const std::string stale = read_text(journal_);
  index.save(path_);
  EXPECT_NE(read_text(path_ + ".items.jsonl").find("\"generation\":2,"), std::string::npos);

  // A kill after the new pair was in place but before its journal was started.
  write_text(journal_, stale);
  const AnnIndex loaded = AnnIndex::load(path_);
  expect_state(loaded, reference(30));
  EXPECT_EQ(loaded.size(), index.size());  // not re-applied: no extra rows
  index.attach_journal(path_);             // the stale journal is replaced by the pair's own
  EXPECT_EQ(std::filesystem::file_size(journal_), kJournalHeader);

  // The first pair put back under the second generation's journal.
  for (int64_t i = 30; i < 35; ++i) apply(index, op_number(i));
  write_text(path_, first_index);
  write_text(path_ + ".items.jsonl", first_items);
  expect_error([&] { AnnIndex::load(path_); }, {journal_, "generation 2", "generation 1", "older than its journal"});
}

// save() renames the table, then the index: a kill between the two leaves the new table, the old
// index and the new one as PATH.new, which load() puts in place; without it the pair is refused.
TEST_P(AnnJournal, ASaveCutBetweenItsRenamesIsFinishedByLoad) {
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  const std::string old_index = read_text(path_);
  for (int64_t i = 0; i < 30; ++i) apply(index, op_number(i));
  index.save(path_);

  std::filesystem::rename(path_, path_ + ".new");
  write_text(path_, old_index);
  const AnnIndex recovered = AnnIndex::load(path_);
  expect_state(recovered, reference(30));
  EXPECT_EQ(recovered.size(), index.size());
  EXPECT_FALSE(std::filesystem::exists(path_ + ".new"));
  expect_state(AnnIndex::load(path_), reference(30));

  write_text(path_, old_index);
  expect_error([&] { AnnIndex::load(path_); }, {path_, "is not the index its item table", "different saves"});

  // Killed before the first rename: the old pair (and its journal) stand; PATH.new is not taken.
  write_text(path_ + ".new", old_index);
  index.save(path_);
  write_text(path_ + ".new", old_index);
  expect_state(AnnIndex::load(path_), reference(30));
}

// CRC-32 by its definition, a bit at a time (the engine computes it eight bytes a step).
uint32_t crc32_bitwise(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (unsigned char byte : bytes) {
    c ^= byte;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

TEST_P(AnnJournal, TheSealIsTheFaissFilesCrc32) {
  ASSERT_EQ(crc32_bitwise("123456789"), 0xCBF43926u);  // the published check value of CRC-32
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  const std::string faiss_file = read_text(path_);
  const std::string header = read_text(path_ + ".items.jsonl").substr(0, 400);
  EXPECT_NE(header.find("\"index_crc32\":" + std::to_string(crc32_bitwise(faiss_file)) + ","), std::string::npos)
      << header;
  EXPECT_NE(header.find("\"index_bytes\":" + std::to_string(faiss_file.size())), std::string::npos) << header;
}

TEST_P(AnnJournal, AJournalThatIsNotOneIsNamed) {
  AnnIndex index = base_index(GetParam());
  index.save(path_);
  write_text(journal_, "not a journal at all, but long enough");
  expect_error([&] { AnnIndex::load(path_); }, {journal_, "bad magic"});
  expect_error([&] { index.attach_journal(path_); }, {journal_, "bad magic"});
  write_text(journal_, "MOEJRNL1");
  expect_error([&] { AnnIndex::load(path_); }, {journal_, "shorter than a journal header"});
}

// A child process loads the index, attaches its journal and runs the operation stream with a save
// every 7th operation, reporting each finished one through a pipe; it is killed at a random
// moment. load() must then give the state after every acknowledged operation, and at most the one
// in flight. Each round continues from what the last one recovered.
//
// The child is this test program run again (fork, then exec), so that it starts with no OpenMP
// thread pool: a forked copy of the parent's pool hangs at FAISS's first parallel region. It finds
// its orders in kChildVariable ("PATH\nFIRST\nFD") and runs them before main().
constexpr const char* kChildVariable = "MOE_TEST_ANN_JOURNAL_CHILD";

[[noreturn]] void run_child(const std::string& path, int64_t first, int ack) {
  try {
    AnnIndex index = AnnIndex::load(path);
    index.attach_journal(path);
    for (int64_t i = first;; ++i) {
      apply(index, op_number(i));
      if (i % 7 == 6) index.save(path);
      const int64_t done = i + 1;
      if (write(ack, &done, sizeof done) != static_cast<ssize_t>(sizeof done)) _exit(3);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crash-test child: %s\n", e.what());
    _exit(2);
  }
}

const bool kIsChild = [] {
  const char* orders = std::getenv(kChildVariable);
  if (orders == nullptr) return false;
  std::istringstream in(orders);
  std::string path;
  int64_t first = 0;
  int fd = -1;
  if (!std::getline(in, path) || !(in >> first >> fd)) _exit(4);
  run_child(path, first, fd);
}();

// The next acknowledgement, or false at the end of the pipe or after timeout_ms.
bool read_ack(int fd, int64_t* value, int timeout_ms) {
  char bytes[sizeof(int64_t)];
  size_t got = 0;
  while (got < sizeof bytes) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return false;
    const ssize_t n = read(fd, bytes + got, sizeof bytes - got);
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  std::memcpy(value, bytes, sizeof bytes);
  return true;
}

TEST_P(AnnJournal, AKilledWriterLosesNoAcknowledgedUpdate) {
  base_index(GetParam()).save(path_);
  std::mt19937 rng(1234);
  int64_t recovered = 0;
  for (int round = 0; round < 10; ++round) {
    SCOPED_TRACE("round " + std::to_string(round) + " from operation " + std::to_string(recovered));
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      const std::string orders = path_ + "\n" + std::to_string(recovered) + "\n" + std::to_string(fds[1]);
      setenv(kChildVariable, orders.c_str(), 1);
      execl("/proc/self/exe", "/proc/self/exe", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    // Wait for 1 to 40 acknowledgements, then a moment more (up to 3 ms, a save's time).
    const int64_t wait_for = 1 + static_cast<int64_t>(rng() % 40);
    int64_t acked = recovered, value = 0;
    for (int64_t seen = 0; seen < wait_for && read_ack(fds[0], &value, 30000); ++seen) acked = value;
    usleep(static_cast<useconds_t>(rng() % 3000));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    while (read_ack(fds[0], &value, 1000)) acked = value;
    close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child exited by itself with status " << WEXITSTATUS(status);
    ASSERT_GT(acked, recovered) << "the child acknowledged nothing";

    const AnnIndex loaded = AnnIndex::load(path_);
    const auto state = live_captions(loaded);
    if (state == captions_of(reference(acked))) {
      recovered = acked;
    } else if (state == captions_of(reference(acked + 1))) {
      recovered = acked + 1;  // the operation in flight had reached the journal
    } else {
      FAIL() << "the loaded index is not the state after the " << acked << " acknowledged operations (nor one more)";
    }
    expect_state(loaded, reference(recovered));
  }
}

INSTANTIATE_TEST_SUITE_P(Types, AnnJournal, ::testing::Values("Flat", "HNSW32", "IVF4,Flat"), [](const auto& info) {
  std::string name = info.param;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
});

}  // namespace
