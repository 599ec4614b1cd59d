#include "moe/ann_index.h"

#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/IndexIVFFastScan.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/IndexPreTransform.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/HNSW.h>
#include <faiss/impl/IDSelector.h>
#include <faiss/impl/io.h>
#include <faiss/index_factory.h>
#include <faiss/index_io.h>
#include <faiss/utils/distances.h>
#include <fcntl.h>
#include <json-glib/json-glib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "backend.h"
#include "runtime/compute_util.h"
#include "cpu_ops.h"
#include "runtime/device_buffer.h"
#include "moe/catalog.h"
#include "moe/compute.h"
#include "moe/error.h"

namespace moe {

namespace {

std::string items_path_for(const std::string& path) { return path + ".items.jsonl"; }
std::string journal_path_for(const std::string& path) { return path + ".journal"; }
// Where save() writes a file before renaming it onto `path` (load() finishes an interrupted save
// from PATH.new, so the name is fixed).
std::string next_path_for(const std::string& path) { return path + ".new"; }

// FAISS messages read "Error in <function> at <file>:<line>: Error: '<cond>' failed: <reason>";
// users need only the reason.
std::string faiss_reason(const std::exception& e) {
  std::string msg = e.what();
  if (msg.rfind("Error in ", 0) == 0) {
    const size_t at = msg.find(" at ");
    const size_t colon = at == std::string::npos ? at : msg.find(": ", at);
    if (colon != std::string::npos) msg.erase(0, colon + 2);
  }
  if (msg.rfind("Error: '", 0) == 0) {
    const size_t failed = msg.find("' failed: ");
    if (failed != std::string::npos) msg.erase(0, failed + 10);
  }
  // FAISS reports a short read with a stale errno ("read error in F: 0 != 1 (No such file...)").
  if (msg.find("read error") != std::string::npos) return "truncated or corrupt file (FAISS: " + msg + ")";
  return msg;
}

std::vector<float> normalized_copy(const float* x, int64_t n, int dim) {
  std::vector<float> out(x, x + n * dim);
  faiss::fvec_renorm_L2(static_cast<size_t>(dim), static_cast<size_t>(n), out.data());
  return out;
}

// A file written as next_path_for(path) and renamed onto `path` by commit(); if it is never
// committed (nor kept), the temporary file is removed and `path` is untouched.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(next_path_for(path_)) {
    const int fd = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) throw Error("'" + path_ + "' cannot be written: " + std::strerror(errno));
    stream_ = fdopen(fd, "wb");
    if (!stream_) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp_.c_str());
      throw Error("'" + path_ + "' cannot be written: " + std::strerror(err));
    }
  }
  ~AtomicFile() {
    if (stream_) std::fclose(stream_);
    if (!committed_ && !kept_) ::unlink(tmp_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  FILE* stream() const { return stream_; }
  const std::string& path() const { return path_; }

  // Flushes to disk and closes; the rename is commit(), so that two files can be renamed together.
  void finish() {
    bool ok = std::fflush(stream_) == 0 && !std::ferror(stream_) && fsync(fileno(stream_)) == 0;
    int err = ok ? 0 : errno;
    if (std::fclose(stream_) != 0 && ok) {
      ok = false;
      err = errno;
    }
    stream_ = nullptr;
    if (!ok) throw Error("'" + path_ + "' cannot be written: " + std::strerror(err));
  }
  void commit() {
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw Error("'" + path_ + "' cannot be written: " + std::strerror(errno));
    committed_ = true;
  }
  // Leaves the finished temporary file even if commit() fails (load() may need it).
  void keep() { kept_ = true; }

 private:
  std::string path_, tmp_;
  FILE* stream_ = nullptr;
  bool committed_ = false, kept_ = false;
};

// Flushes the directory holding `path` to disk, so that files created or renamed in it stay so.
void fsync_dir(const std::string& path) {
  gchar* dir = g_path_get_dirname(path.c_str());
  const int fd = ::open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int err = fd < 0 || fsync(fd) != 0 ? errno : 0;
  if (fd >= 0) ::close(fd);
  const std::string name = dir;
  g_free(dir);
  if (err != 0) throw Error("folder '" + name + "' cannot be flushed to disk: " + std::strerror(err));
}

// CRC-32 as zlib and PNG compute it (reflected polynomial 0xEDB88320): the journal's record
// checksum and the pair's seal. Eight bytes a step ("slicing-by-8": 8 tables of 256), as the seal
// covers whole index files (gigabytes at a million vectors).
class Crc32 {
 public:
  void update(const void* data, size_t size) {
    using Tables = std::array<std::array<uint32_t, 256>, 8>;
    static const Tables t = [] {
      Tables out{};
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        out[0][i] = c;
      }
      for (uint32_t i = 0; i < 256; ++i)
        for (size_t k = 1; k < 8; ++k) out[k][i] = (out[k - 1][i] >> 8) ^ out[0][out[k - 1][i] & 0xff];
      return out;
    }();
    const auto* p = static_cast<const uint8_t*>(data);
    uint32_t c = ~crc_;
    for (; size >= 8; size -= 8, p += 8) {
      const uint32_t lo = c ^ (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                               static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
      c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    }
    for (; size > 0; --size, ++p) c = t[0][(c ^ *p) & 0xff] ^ (c >> 8);
    crc_ = ~c;
  }
  uint32_t value() const { return crc_; }

 private:
  uint32_t crc_ = 0;
};

// FAISS's writer and reader over a FILE*, summing what passes (the pair's seal; no second pass).
struct SealingWriter : faiss::IOWriter {
  FILE* file;
  Crc32 crc;
  uint64_t bytes = 0;
  explicit SealingWriter(FILE* f) : file(f) {}
  size_t operator()(const void* ptr, size_t size, size_t nitems) override {
    if (size == 0 || nitems == 0) return nitems;  // FAISS writes empty arrays from null pointers
    const size_t done = std::fwrite(ptr, size, nitems, file);
    crc.update(ptr, size * done);
    bytes += size * done;
    return done;
  }
};
struct SealingReader : faiss::IOReader {
  FILE* file;
  Crc32 crc;
  uint64_t bytes = 0;
  explicit SealingReader(FILE* f) : file(f) {}
  size_t operator()(void* ptr, size_t size, size_t nitems) override {
    if (size == 0 || nitems == 0) return nitems;  // and reads them into null pointers
    const size_t done = std::fread(ptr, size, nitems, file);
    crc.update(ptr, size * done);
    bytes += size * done;
    return done;
  }
};

// One compact JSON object per call, for the item table.
class LineWriter {
 public:
  LineWriter() : gen_(json_generator_new()) {}
  ~LineWriter() { g_object_unref(gen_); }
  LineWriter(const LineWriter&) = delete;
  LineWriter& operator=(const LineWriter&) = delete;

  std::string line(JsonBuilder* builder) {
    JsonNode* root = json_builder_get_root(builder);
    json_generator_set_root(gen_, root);
    gchar* text = json_generator_to_data(gen_, nullptr);
    std::string out(text);
    out += '\n';
    g_free(text);
    json_node_unref(root);
    return out;
  }

 private:
  JsonGenerator* gen_;
};

void add_string(JsonBuilder* b, const char* key, const std::string& value) {
  json_builder_set_member_name(b, key);
  json_builder_add_string_value(b, value.c_str());
}

void add_int(JsonBuilder* b, const char* key, int64_t value) {
  json_builder_set_member_name(b, key);
  json_builder_add_int_value(b, value);
}

void write_all(AtomicFile& file, const std::string& text) {
  if (std::fwrite(text.data(), 1, text.size(), file.stream()) != text.size())
    throw Error("'" + file.path() + "' cannot be written: " + std::strerror(errno));
}

using Label = faiss::Index::idx_t;

// The most hits an unfiltered flat search fetches to drop tombstones from (k + tombstones); more
// tombstones go through the selector. The device kernel's k limit (Backend::inner_product_topk).
constexpr int64_t kMaxOverfetch = 1024;

// The inverted-file index inside `index` (itself, or behind a pre-transform such as OPQ); null
// for other kinds. An IndexIDMap is not looked through: it throws on every search parameter.
const faiss::IndexIVF* ivf_of(const faiss::Index* index) {
  if (const auto* pre = dynamic_cast<const faiss::IndexPreTransform*>(index))
    return dynamic_cast<const faiss::IndexIVF*>(pre->index);
  return dynamic_cast<const faiss::IndexIVF*>(index);
}

// The kind of a FAISS index this engine searches, or none. HNSW must store its vectors flat: a
// filtered search falls back to an exact one over that storage. FAISS 1.7.3's fast-scan IVF
// indexes ("PQ16x4fs") throw on any search parameters, so neither nprobe nor a filter could
// reach them.
std::optional<AnnIndexType> kind_of(const faiss::Index* index) {
  if (dynamic_cast<const faiss::IndexHNSWFlat*>(index)) return AnnIndexType::Hnsw;
  if (dynamic_cast<const faiss::IndexFlat*>(index)) return AnnIndexType::Flat;
  const faiss::IndexIVF* ivf = ivf_of(index);
  if (ivf && !dynamic_cast<const faiss::IndexIVFFastScan*>(ivf)) return AnnIndexType::Ivf;
  return std::nullopt;
}

// FAISS's index_factory string of a loaded index whose item table names none (written before
// the engine knew other kinds): "Flat" or "HNSW<M>" ("IVF<lists>" labels a table edited by hand).
std::string factory_of(const faiss::Index* index, AnnIndexType type) {
  if (type == AnnIndexType::Ivf) return "IVF" + std::to_string(ivf_of(index)->nlist);
  if (type == AnnIndexType::Hnsw)
    return "HNSW" + std::to_string(static_cast<const faiss::IndexHNSW*>(index)->hnsw.nb_neighbors(1));
  return "Flat";
}

// An IVF search with `nprobe` lists (capped at the list count) and an optional selector; a
// pre-transform (OPQ) is applied here, so that the IVF parameters reach the IVF index itself.
void search_ivf(const faiss::Index* index, const float* x, int64_t n, int64_t k, int nprobe,
                const faiss::IDSelector* sel, float* scores, Label* labels) {
  const faiss::IndexIVF* ivf = ivf_of(index);
  faiss::SearchParametersIVF params;
  params.nprobe = std::min(static_cast<size_t>(nprobe), ivf->nlist);
  params.sel = const_cast<faiss::IDSelector*>(sel);  // FAISS 1.7.3 declares it non-const; it only reads it
  std::unique_ptr<const float[]> transformed;
  if (const auto* pre = dynamic_cast<const faiss::IndexPreTransform*>(index)) {
    const float* xt = pre->apply_chain(n, x);
    if (xt != x) transformed.reset(xt);
    x = xt;
  }
  ivf->search(n, x, k, scores, labels, &params);
}

// The hits of n queries from FAISS's k columns of labels and scores (-1: fewer found).
std::vector<std::vector<AnnHit>> collect_hits(const std::vector<Label>& labels, const std::vector<float>& scores,
                                              int64_t n, int64_t k) {
  std::vector<std::vector<AnnHit>> out(static_cast<size_t>(n));
  for (int64_t q = 0; q < n; ++q) {
    auto& hits = out[static_cast<size_t>(q)];
    hits.reserve(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      const auto label = labels[static_cast<size_t>(q * k + j)];
      if (label >= 0) hits.push_back({label, scores[static_cast<size_t>(q * k + j)]});
    }
  }
  return out;
}

// A catalog field's value as filters compare it: none (absent, null, an array or an object), a
// string, a number or a boolean.
using FieldValue = std::variant<std::monostate, std::string, double, bool>;

bool holds(const AnnFilterCondition& condition, const FieldValue& value) {
  if (condition.is_range()) {
    const double* x = std::get_if<double>(&value);
    return x != nullptr && (!condition.gt || *x > *condition.gt) && (!condition.gte || *x >= *condition.gte) &&
           (!condition.lt || *x < *condition.lt) && (!condition.lte || *x <= *condition.lte);
  }
  for (const AnnFieldValue& wanted : condition.any_of) {
    const bool equal = std::visit(
        [&](const auto& w) {
          using T = std::decay_t<decltype(w)>;
          const T* v = std::get_if<T>(&value);
          return v != nullptr && *v == w;
        },
        wanted);
    if (equal) return true;
  }
  return false;
}

// The journal (format: docs/model-formats.md). A header, then one record per update: its payload's
// length, the payload, and the CRC-32 of both; integers and floats little-endian.
constexpr char kJournalMagic[8] = {'M', 'O', 'E', 'J', 'R', 'N', 'L', '1'};
constexpr size_t kJournalHeaderBytes = 24;  // magic, generation u64, dim u32, CRC-32 of those
enum JournalOp : uint8_t { kJournalUpsert = 1, kJournalRemove = 2 };

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_string(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint32_t crc32_of(const std::string& bytes) {
  Crc32 crc;
  crc.update(bytes.data(), bytes.size());
  return crc.value();
}

std::string journal_header(uint64_t generation, int dim) {
  std::string out(kJournalMagic, sizeof kJournalMagic);
  put_u64(out, generation);
  put_u32(out, static_cast<uint32_t>(dim));
  put_u32(out, crc32_of(out));
  return out;
}

// A record around `payload`.
std::string journal_record(const std::string& payload) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(payload.size()));
  out += payload;
  put_u32(out, crc32_of(out));
  return out;
}

// An update read back from a record.
struct JournalEntry {
  JournalOp op;
  std::vector<float> vector;     // upsert: dim floats, as upsert() was given them
  AnnItem item;                  // upsert
  std::vector<std::string> ids;  // remove
};

// Reads a journal file: its header, then its records while they are complete and their
// checksums hold. A short or corrupt record ends them: one cut off by a crash is the last, as
// each record is flushed to disk before the next is written.
class JournalReader {
 public:
  // Throws moe::Error naming the file when it cannot be read or its header is not a journal's.
  explicit JournalReader(std::string path) : path_(std::move(path)) {
    file_ = std::fopen(path_.c_str(), "rb");
    if (!file_) throw Error("ANN journal '" + path_ + "' cannot be read: " + std::strerror(errno));
    struct stat st {};
    if (fstat(fileno(file_), &st) != 0) fail(std::strerror(errno));
    size_ = static_cast<uint64_t>(st.st_size);
    char header[kJournalHeaderBytes];
    if (size_ < kJournalHeaderBytes || std::fread(header, 1, sizeof header, file_) != sizeof header)
      fail("shorter than a journal header");
    if (std::memcmp(header, kJournalMagic, sizeof kJournalMagic) != 0) fail("not a gst-moe journal (bad magic)");
    if (crc32_of(std::string(header, 20)) != get_u32(header + 20)) fail("the header's checksum does not match");
    generation_ = get_u64(header + 8);
    dim_ = static_cast<int>(get_u32(header + 16));
    end_ = kJournalHeaderBytes;
  }
  ~JournalReader() { std::fclose(file_); }
  JournalReader(const JournalReader&) = delete;
  JournalReader& operator=(const JournalReader&) = delete;

  uint64_t generation() const { return generation_; }
  int dim() const { return dim_; }
  // Where the records read so far end: the journal's valid length once next() returned false.
  uint64_t end() const { return end_; }

  // The next record's update; false at the end of the complete, checksummed records. Throws
  // moe::Error for a checksummed record that does not decode (a journal of another format).
  bool next(JournalEntry* entry) {
    char length_bytes[4];
    if (size_ - end_ < 8 || std::fread(length_bytes, 1, 4, file_) != 4) return false;
    const uint64_t length = get_u32(length_bytes);
    if (length == 0 || length > size_ - end_ - 8) return false;
    std::string record(length_bytes, 4);
    record.resize(4 + length + 4);
    if (std::fread(&record[4], 1, length + 4, file_) != length + 4) return false;
    if (crc32_of(record.substr(0, 4 + length)) != get_u32(&record[4 + length])) return false;
    decode(std::string_view(record).substr(4, length), entry);
    end_ += 4 + length + 4;
    return true;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw Error("ANN journal '" + path_ + "': " + why); }

  void decode(std::string_view p, JournalEntry* entry) const {
    const std::string at = "the record at byte " + std::to_string(end_);
    auto take = [&](size_t n) {
      if (p.size() < n) fail(at + " is shorter than its contents");
      std::string_view out = p.substr(0, n);
      p.remove_prefix(n);
      return out;
    };
    auto take_string = [&] {
      const uint32_t n = get_u32(take(4).data());
      return std::string(take(n));
    };
    const auto op = static_cast<uint8_t>(take(1)[0]);
    *entry = JournalEntry{};
    if (op == kJournalUpsert) {
      entry->op = kJournalUpsert;
      const std::string_view floats = take(static_cast<size_t>(dim_) * 4);
      entry->vector.resize(static_cast<size_t>(dim_));
      for (int i = 0; i < dim_; ++i) {
        const uint32_t bits = get_u32(floats.data() + 4 * i);
        std::memcpy(&entry->vector[static_cast<size_t>(i)], &bits, 4);
      }
      entry->item.id = take_string();
      entry->item.uri = take_string();
      entry->item.caption = take_string();
      entry->item.fields = take_string();
      if (entry->item.id.empty()) fail(at + " upserts an item without an id");
    } else if (op == kJournalRemove) {
      entry->op = kJournalRemove;
      const uint32_t n = get_u32(take(4).data());
      if (n > p.size() / 4) fail(at + " names more ids than it holds");
      for (uint32_t i = 0; i < n; ++i) entry->ids.push_back(take_string());
    } else {
      fail(at + " has unknown operation " + std::to_string(op));
    }
    if (!p.empty()) fail(at + " is longer than its contents");
  }

  std::string path_;
  FILE* file_ = nullptr;
  uint64_t size_ = 0, end_ = 0, generation_ = 0;
  int dim_ = 0;
};

// The generation of the journal at `journal_path`; 0 when there is none or it is unreadable.
uint64_t journal_generation_at(const std::string& journal_path) {
  if (::access(journal_path.c_str(), F_OK) != 0) return 0;
  try {
    return JournalReader(journal_path).generation();
  } catch (const Error&) {
    return 0;
  }
}

// The generation of the pair whose item table is `items_path`; 0 when none or unreadable.
uint64_t pair_generation_at(const std::string& items_path) {
  std::ifstream in(items_path, std::ios::binary);
  std::string header;
  if (!in || !std::getline(in, header)) return 0;
  try {
    return parse_ann_pair_seal(header, items_path).generation;
  } catch (const Error&) {
    return 0;
  }
}

// A FAISS file read through the seal: the index, and the CRC-32 and size of the whole file.
struct SealedIndex {
  std::unique_ptr<faiss::Index> index;
  uint32_t crc32 = 0;
  uint64_t bytes = 0;
};

SealedIndex read_sealed_index(const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) throw Error("ANN index '" + path + "' cannot be read: " + std::strerror(errno));
  SealingReader reader(file);
  SealedIndex out;
  try {
    out.index.reset(faiss::read_index(&reader));
    char rest[4096];  // bytes after FAISS's own are part of the file the seal covers
    while (reader(rest, 1, sizeof rest) > 0) {
    }
  } catch (const faiss::FaissException& e) {
    std::fclose(file);
    throw Error("ANN index '" + path + "' cannot be read: " + faiss_reason(e));
  } catch (const std::exception& e) {  // corrupt sizes surface as std::bad_alloc / length_error
    std::fclose(file);
    throw Error("ANN index '" + path + "' cannot be read: corrupt file (" + e.what() + ")");
  }
  const bool read_error = std::ferror(file) != 0;
  std::fclose(file);
  if (read_error) throw Error("ANN index '" + path + "' cannot be read: read error");
  out.crc32 = reader.crc.value();
  out.bytes = reader.bytes;
  return out;
}

std::string hex32(uint32_t v) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

// An open journal, appended to by updates.
struct AnnIndexJournal {
  int fd = -1;
  std::string path;        // PATH.journal
  std::string index_path;  // PATH
  uint64_t generation = 0;
  uint64_t end = 0;  // the valid length: where the next record goes

  AnnIndexJournal() = default;
  AnnIndexJournal(const AnnIndexJournal&) = delete;
  AnnIndexJournal& operator=(const AnnIndexJournal&) = delete;
  ~AnnIndexJournal() {
    if (fd >= 0) ::close(fd);
  }

  [[noreturn]] void fail(const std::string& doing, int err) const {
    throw Error("ANN journal '" + path + "': cannot " + doing + ": " + std::strerror(err));
  }

  // Writes `record` at the end and flushes it to disk; on failure the journal is cut back.
  void append(const std::string& record) {
    size_t done = 0;
    while (done < record.size()) {
      const ssize_t n = pwrite(fd, record.data() + done, record.size() - done, static_cast<off_t>(end + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : ENOSPC;
        cut(end);
        fail("append a record", err);
      }
      done += static_cast<size_t>(n);
    }
    if (fdatasync(fd) != 0) {
      const int err = errno;
      cut(end);
      fail("flush a record to disk", err);
    }
    end += record.size();
  }

  // Cuts the journal back to `length` bytes, after a failed append or apply, so that no replay
  // applies an update that was refused (best effort: the error being reported is the first one).
  void cut(uint64_t length) {
    if (ftruncate(fd, static_cast<off_t>(length)) == 0) fdatasync(fd);
    end = length;
  }
};

// Opens the journal of the pair at `index_path` (of `generation`, vectors of `dim`) for appending:
// its complete records are kept and a torn tail is cut off; a journal of an older generation
// (whose records the pair holds) or none is replaced by an empty one.
std::unique_ptr<AnnIndexJournal> open_journal(const std::string& index_path, uint64_t generation, int dim) {
  auto journal = std::make_unique<AnnIndexJournal>();
  journal->path = journal_path_for(index_path);
  journal->index_path = index_path;
  journal->generation = generation;
  bool fresh = ::access(journal->path.c_str(), F_OK) != 0;
  if (!fresh) {
    JournalReader reader(journal->path);
    if (reader.generation() > generation)
      throw Error("ANN journal '" + journal->path + "' is of generation " + std::to_string(reader.generation()) +
                  ", newer than the pair '" + index_path + "' (" + std::to_string(generation) +
                  "): it belongs to a later save; refusing to overwrite it");
    if (reader.generation() == generation && reader.dim() != dim)
      throw Error("ANN journal '" + journal->path + "' holds " + std::to_string(reader.dim()) +
                  "-wide vectors but the index '" + index_path + "' " + std::to_string(dim));
    fresh = reader.generation() < generation;
    if (!fresh) {
      JournalEntry entry;
      while (reader.next(&entry)) {
      }
      journal->end = reader.end();
    }
  }
  if (fresh) {
    // Written whole under another name, so that no reader ever sees half a header.
    AtomicFile file(journal->path);
    const std::string header = journal_header(generation, dim);
    write_all(file, header);
    file.finish();
    file.commit();
    fsync_dir(journal->path);
    journal->end = header.size();
  }
  journal->fd = ::open(journal->path.c_str(), O_WRONLY | O_CLOEXEC);
  if (journal->fd < 0) journal->fail("open it", errno);
  struct stat st {};
  if (fstat(journal->fd, &st) != 0) journal->fail("read its size", errno);
  if (static_cast<uint64_t>(st.st_size) > journal->end) {
    if (ftruncate(journal->fd, static_cast<off_t>(journal->end)) != 0) journal->fail("cut off its torn tail", errno);
    if (fdatasync(journal->fd) != 0) journal->fail("flush it to disk", errno);
  }
  return journal;
}

}  // namespace

// The items' fields by name, one value per row: what filters scan.
struct AnnIndex::FieldColumns {
  std::once_flag parsed;
  bool ready = false;  // parse() ran: upserts append to the columns
  std::unordered_map<std::string, std::vector<FieldValue>> columns;

  void parse(const std::deque<AnnItem>& items) {
    for (size_t i = 0; i < items.size(); ++i) add_item(items[i], i, items.size());
    ready = true;
  }

  // A row appended by an upsert: every column grows by one.
  void append(const AnnItem& item, size_t rows) {
    for (auto& column : columns) column.second.resize(rows);
    add_item(item, rows - 1, rows);
  }

  void add_item(const AnnItem& item, size_t row, size_t rows) {
    if (item.fields.empty()) return;
    // The text is a JSON object: checked by the item table's bounded parser (depth included),
    // or made by parse_catalog_line from one.
    JsonNode* root = json_from_string(item.fields.c_str(), nullptr);
    if (root == nullptr) return;
    if (JSON_NODE_HOLDS_OBJECT(root)) add_members(json_node_get_object(root), "", row, rows);
    json_node_unref(root);
  }

  // The members of `obj` as columns named `prefix` + name; a nested object's members as
  // "name.member" (catalog lines such as {"attributes": {"category": "mug"}} are filtered by
  // "attributes.category"). Arrays and nulls are not filterable.
  void add_members(JsonObject* obj, const std::string& prefix, size_t row, size_t rows) {
    JsonObjectIter iter;
    const gchar* name;
    JsonNode* node;
    json_object_iter_init(&iter, obj);
    while (json_object_iter_next(&iter, &name, &node)) {
      if (JSON_NODE_HOLDS_OBJECT(node)) {
        add_members(json_node_get_object(node), prefix + name + ".", row, rows);
        continue;
      }
      if (!JSON_NODE_HOLDS_VALUE(node)) continue;
      FieldValue value;
      const GType type = json_node_get_value_type(node);
      if (type == G_TYPE_STRING)
        value = std::string(json_node_get_string(node));
      else if (type == G_TYPE_BOOLEAN)
        value = static_cast<bool>(json_node_get_boolean(node));
      else if (type == G_TYPE_INT64 || type == G_TYPE_DOUBLE)
        value = json_node_get_double(node);
      else
        continue;
      auto& column = columns[prefix + name];
      if (column.empty()) column.resize(rows);
      column[row] = std::move(value);
    }
  }
};

// What live updates add to an index: the tombstones, the rows of each id, the locks, the journal.
struct AnnIndex::Live {
  // Searches hold it shared; an update holds it alone while it changes the index and the items.
  mutable std::shared_mutex rw;
  // One update, save, attach or placement at a time; held around the journal write too.
  std::mutex update;
  std::vector<uint8_t> bits;  // a bit per row, set while it is live (FAISS's IDSelectorBitmap layout)
  int64_t deleted = 0;
  // The live rows of each id, made at the first call that needs them (read-only services never do).
  struct IdRows {
    std::once_flag built;
    std::unordered_multimap<std::string, int64_t> rows;
  };
  std::unique_ptr<IdRows> ids = std::make_unique<IdRows>();
  std::unique_ptr<AnnIndexJournal> journal;
  // The path whose pair (and journal) load() would turn into this state, and that pair's
  // generation; "" when none does.
  std::string durable_path;
  uint64_t durable_generation = 0;

  bool is_live(int64_t row) const { return (bits[static_cast<size_t>(row >> 3)] >> (row & 7)) & 1; }
  void append_rows(int64_t rows_before, int64_t n) {
    bits.resize(static_cast<size_t>((rows_before + n + 7) / 8));
    for (int64_t row = rows_before; row < rows_before + n; ++row)
      bits[static_cast<size_t>(row >> 3)] |= static_cast<uint8_t>(1u << (row & 7));
  }
  IdRows& id_rows(const std::deque<AnnItem>& items) {
    IdRows& table = *ids;
    std::call_once(table.built, [&] {
      for (size_t i = 0; i < items.size(); ++i)
        if (!items[i].id.empty() && is_live(static_cast<int64_t>(i)))
          table.rows.emplace(items[i].id, static_cast<int64_t>(i));
    });
    return table;
  }
  // Tombstones the live rows of `id` (id_rows() built); returns how many.
  int64_t delete_id(const std::string& id) {
    const auto range = ids->rows.equal_range(id);
    int64_t n = 0;
    for (auto it = range.first; it != range.second; ++it, ++n)
      bits[static_cast<size_t>(it->second >> 3)] &= static_cast<uint8_t>(~(1u << (it->second & 7)));
    ids->rows.erase(range.first, range.second);
    deleted += n;
    return n;
  }
  // After an update: only the journal's pair, if any, still loads into the new state.
  void changed() {
    durable_path = journal ? journal->index_path : std::string();
    durable_generation = journal ? journal->generation : 0;
  }
};

// The unit vectors of a flat index in a backend's memory, and what searching them needs.
struct AnnIndex::DeviceVectors {
  std::shared_ptr<kernels::Backend> backend;
  std::shared_ptr<std::mutex> mutex;  // null for host-memory backends
  void* base = nullptr;               // size() x dim f32

  ~DeviceVectors() {
    if (!base) return;
    const auto held = detail::lock_if(mutex);
    detail::deallocate_noexcept(*backend, base);  // a sticky device error must not throw here
  }
};

bool AnnProvenance::same_models(const AnnProvenance& other) const {
  return encoder_fingerprint == other.encoder_fingerprint && adapter_fingerprint == other.adapter_fingerprint;
}

std::string AnnProvenance::describe() const {
  std::string out =
      encoder_fingerprint.empty() ? "an unknown encoder" : "encoder '" + encoder + "' (fp " + encoder_fingerprint + ")";
  if (adapter_fingerprint.empty()) return out + " without an adapter";
  return out + " and adapter '" + adapter + "' (fp " + adapter_fingerprint + ")";
}

AnnIndex::AnnIndex(std::unique_ptr<faiss::Index> index, AnnIndexType type, std::string factory, int dim)
    : index_(std::move(index)),
      type_(type),
      factory_(std::move(factory)),
      dim_(dim),
      columns_(std::make_unique<FieldColumns>()),
      search_mutex_(std::make_unique<std::mutex>()),
      live_(std::make_unique<Live>()) {}
AnnIndex::AnnIndex(AnnIndex&&) noexcept = default;
AnnIndex& AnnIndex::operator=(AnnIndex&&) noexcept = default;
AnnIndex::~AnnIndex() = default;

AnnIndex AnnIndex::create(int dim, const AnnBuildOptions& options) {
  if (dim < 1) throw Error("ANN index: dimension must be >= 1, got " + std::to_string(dim));
  std::string factory = options.index_type;
  if (factory == "flat") {
    factory = "Flat";
  } else if (factory == "hnsw") {
    if (options.hnsw_m < 2) throw Error("ANN index: HNSW M must be >= 2, got " + std::to_string(options.hnsw_m));
    factory = "HNSW" + std::to_string(options.hnsw_m);
  }
  if (options.ef_construction < 1)
    throw Error("ANN index: HNSW efConstruction must be >= 1, got " + std::to_string(options.ef_construction));
  if (options.train_size < 0)
    throw Error("ANN index: train size must be >= 0, got " + std::to_string(options.train_size));
  std::unique_ptr<faiss::Index> index;
  try {
    index.reset(faiss::index_factory(dim, factory.c_str(), faiss::METRIC_INNER_PRODUCT));
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot create index type '" + factory + "' of dimension " + std::to_string(dim) + ": " +
                faiss_reason(e));
  }
  const std::optional<AnnIndexType> kind = kind_of(index.get());
  if (!kind)
    throw Error("ANN index: index type '" + factory +
                "' is not searched here; use Flat, HNSW<M> (flat storage) or IVF<lists>,<encoding> (Flat, PQ<m>, "
                "SQ8, ...; not the fast-scan 'fs' codes, which take no search parameters in FAISS 1.7.3), "
                "optionally after a transform such as OPQ<m>");
  if (*kind == AnnIndexType::Hnsw)
    static_cast<faiss::IndexHNSW*>(index.get())->hnsw.efConstruction = options.ef_construction;
  // index_factory turns on polysemous training for 8-bit PQ codes: a simulated annealing of the
  // codes for Hamming-distance filtering, which searches here never use (polysemous_ht stays 0),
  // and which took 100 s of a 2-second build of 5,000 vectors (moe-bench-ann).
  if (auto* ivfpq = dynamic_cast<faiss::IndexIVFPQ*>(const_cast<faiss::IndexIVF*>(ivf_of(index.get()))))
    ivfpq->do_polysemous_training = false;
  AnnIndex out(std::move(index), *kind, factory, dim);
  const int64_t lists = out.nlist();
  out.train_size_ = options.train_size > 0 ? options.train_size : std::max<int64_t>(1, 64 * lists);
  if (out.train_size_ < lists)
    throw Error("ANN index: train size " + std::to_string(out.train_size_) + " is less than the " +
                std::to_string(lists) + " lists of '" + factory + "' (k-means needs a vector per list at least)");
  return out;
}

int64_t AnnIndex::nlist() const {
  const faiss::IndexIVF* ivf = ivf_of(index_.get());
  return ivf ? static_cast<int64_t>(ivf->nlist) : 0;
}

bool AnnIndex::is_trained() const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  return index_->is_trained;
}

int64_t AnnIndex::size() const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  return rows();
}

int64_t AnnIndex::live_size() const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  return rows() - live_->deleted;
}

int64_t AnnIndex::find(const std::string& id) const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  const auto range = live_->id_rows(items_).rows.equal_range(id);
  int64_t row = -1;
  for (auto it = range.first; it != range.second; ++it) row = std::max(row, it->second);
  return row;
}

const AnnItem& AnnIndex::item(int64_t i) const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  if (i < 0 || i >= static_cast<int64_t>(items_.size()))
    throw Error("ANN index: item " + std::to_string(i) + " out of range (index has " + std::to_string(items_.size()) +
                " items)");
  return items_[static_cast<size_t>(i)];
}

std::string rebase_uri(const std::string& uri, const std::string& folder, const std::string& base) {
  if (base.empty() || folder.empty() || uri.compare(0, folder.size(), folder) != 0) return uri;
  return base + (base.back() == '/' ? "" : "/") + uri.substr(folder.size());
}

std::string AnnIndex::uri_folder() const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  const std::string* first = nullptr;
  size_t common = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    const AnnItem& item = items_[i];
    if (item.uri.empty() || !live_->is_live(static_cast<int64_t>(i))) continue;
    if (!first) {
      first = &item.uri;
      common = item.uri.size();
      continue;
    }
    common = std::min(common, item.uri.size());
    common = static_cast<size_t>(
        std::mismatch(first->begin(), first->begin() + static_cast<std::ptrdiff_t>(common), item.uri.begin()).first -
        first->begin());
  }
  if (!first) return std::string();
  const size_t slash = first->rfind('/', common == 0 ? 0 : common - 1);
  return slash == std::string::npos ? std::string() : first->substr(0, slash + 1);
}

void AnnIndex::set_provenance(AnnProvenance provenance) {
  // A provenance that cannot be checked is no provenance: the encoder fingerprint is required.
  check_ann_provenance(provenance, "ANN index provenance");
  std::lock_guard<std::mutex> updating(live_->update);
  provenance_ = std::move(provenance);
}

void AnnIndex::add(const float* vectors, int64_t n, const std::vector<AnnItem>& items) {
  if (n < 0 || static_cast<int64_t>(items.size()) != n)
    throw Error("ANN index: add of " + std::to_string(n) + " vectors with " + std::to_string(items.size()) +
                " items (they must match)");
  if (n == 0) return;
  std::lock_guard<std::mutex> updating(live_->update);
  if (device_)
    throw Error("ANN index: add after place_on(" + device_->backend->name() +
                "): add every vector first, then place the index");
  if (live_->journal)
    throw Error("ANN index: add() after attach_journal('" + live_->journal->index_path +
                "'): bulk adds are not journaled; use upsert()");
  const std::vector<float> unit = normalized_copy(vectors, n, dim_);
  std::unique_lock<std::shared_mutex> writing(live_->rw);
  const int64_t before = rows();
  if (!index_->is_trained) {
    const size_t held = pending_.size();
    pending_.insert(pending_.end(), unit.begin(), unit.end());
    items_.insert(items_.end(), items.begin(), items.end());
    if (static_cast<int64_t>(pending_.size() / static_cast<size_t>(dim_)) >= train_size_) {
      try {
        train_pending();
      } catch (const Error&) {  // these rows are not added: the index stays as it was
        pending_.resize(held);
        items_.resize(items_.size() - items.size());
        throw;
      }
    }
  } else {
    try {
      index_->add(n, unit.data());
    } catch (const faiss::FaissException& e) {
      throw Error("ANN index: cannot add " + std::to_string(n) + " vectors: " + faiss_reason(e));
    }
    items_.insert(items_.end(), items.begin(), items.end());
  }
  live_->append_rows(before, n);
  columns_ = std::make_unique<FieldColumns>();  // parsed again at the next filtered search
  live_->ids = std::make_unique<Live::IdRows>();
  live_->changed();
}

void AnnIndex::train() {
  std::lock_guard<std::mutex> updating(live_->update);
  std::unique_lock<std::shared_mutex> writing(live_->rw);
  train_pending();
}

void AnnIndex::train_pending() {
  if (index_->is_trained) return;
  const int64_t n = static_cast<int64_t>(pending_.size() / static_cast<size_t>(dim_));
  const int64_t lists = nlist();
  if (n < lists) {
    // FAISS's k-means needs a vector per list; it advises 39 at least (it warns below that).
    int64_t fit = 1;
    while (fit * 2 * 39 <= n) fit *= 2;
    throw Error("ANN index: '" + factory_ + "' has " + std::to_string(lists) + " lists but the build has only " +
                std::to_string(n) + " vectors to train them on (k-means needs one per list, FAISS advises 30 to " +
                "256): " + (n < 39 ? std::string("use Flat for so few") : "use IVF" + std::to_string(fit) + " lists"));
  }
  try {
    index_->train(n, pending_.data());
    index_->add(n, pending_.data());
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot train '" + factory_ + "' on " + std::to_string(n) + " vectors: " + faiss_reason(e));
  }
  pending_ = std::vector<float>();
}

std::vector<int64_t> AnnIndex::matching(const AnnFilter& filter) const {
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  return live_matching(filter);
}

std::vector<int64_t> AnnIndex::live_matching(const AnnFilter& filter) const {
  std::vector<int64_t> rows;
  const Live& live = *live_;
  if (filter.empty()) {
    rows.reserve(static_cast<size_t>(this->rows() - live.deleted));
    for (int64_t i = 0; i < this->rows(); ++i)
      if (live.is_live(i)) rows.push_back(i);
    return rows;
  }
  FieldColumns& fields = *columns_;
  std::call_once(fields.parsed, [&] { fields.parse(items_); });
  bool first = true;
  for (const AnnFilterCondition& condition : filter.all_of) {
    const auto column = fields.columns.find(condition.field);
    if (column == fields.columns.end()) return {};  // no item has the field
    const std::vector<FieldValue>& values = column->second;
    if (first) {
      for (size_t i = 0; i < values.size(); ++i)
        if (holds(condition, values[i]) && live.is_live(static_cast<int64_t>(i)))
          rows.push_back(static_cast<int64_t>(i));
      first = false;
    } else {
      rows.erase(std::remove_if(rows.begin(), rows.end(),
                                [&](int64_t i) { return !holds(condition, values[static_cast<size_t>(i)]); }),
                 rows.end());
    }
    if (rows.empty()) break;
  }
  return rows;
}

std::vector<std::vector<AnnHit>> AnnIndex::search(const float* queries, int64_t n, int k,
                                                  const AnnSearchOptions& options) const {
  if (k < 1) throw Error("ANN search: k must be >= 1, got " + std::to_string(k));
  if (options.ef_search < 1)
    throw Error("ANN search: ef_search must be >= 1, got " + std::to_string(options.ef_search));
  if (options.nprobe < 1) throw Error("ANN search: nprobe must be >= 1, got " + std::to_string(options.nprobe));
  if (n < 0) throw Error("ANN search: negative query count " + std::to_string(n));
  std::shared_lock<std::shared_mutex> reading(live_->rw);
  if (n == 0 || rows() == 0) return std::vector<std::vector<AnnHit>>(static_cast<size_t>(n));
  if (!index_->is_trained)
    throw Error("ANN search: '" + factory_ + "' is not trained yet (it holds " + std::to_string(rows()) +
                " vectors back to train on): train() or save() it first");

  const std::vector<float> unit = normalized_copy(queries, n, dim_);
  // Tombstones are skipped the way a filter's non-matching rows are, except in a flat index with
  // few of them: there the exact search fetches k + tombstones hits and drops the tombstones,
  // keeping the BLAS and device paths (FAISS's flat search with a selector scans without BLAS:
  // a 64-query batch over 100,000 x 512 took 8.2 s instead of 0.3 s).
  const int64_t deleted = live_->deleted;
  const bool overfetch = deleted > 0 && type_ == AnnIndexType::Flat && k + deleted <= kMaxOverfetch;
  try {
    if ((options.filter && !options.filter->empty()) || (deleted > 0 && !overfetch))
      return search_filtered(unit.data(), n, k, options);
  } catch (const faiss::FaissException& e) {
    throw Error("ANN search: " + faiss_reason(e));
  }
  const int64_t kk = std::min<int64_t>(k + (overfetch ? deleted : 0), rows());
  std::vector<float> scores(static_cast<size_t>(n * kk));
  std::vector<Label> labels(static_cast<size_t>(n * kk));
  static_assert(sizeof(Label) == sizeof(int64_t), "FAISS ids are the backend's int64 ids");
  try {
    if (device_) {
      const auto held = detail::lock_if(device_->mutex);
      kernels::Backend& b = *device_->backend;
      DeviceBuffer q(b, unit.size() * sizeof(float)), ids(b, labels.size() * sizeof(int64_t)),
          best(b, scores.size() * sizeof(float));
      b.copy_from_host(q.as<float>(), unit.data(), unit.size() * sizeof(float));
      b.inner_product_topk(q.as<float>(), n, static_cast<const float*>(device_->base), rows(), dim_, kk,
                           ids.as<int64_t>(), best.as<float>());
      b.copy_to_host(labels.data(), ids.as<int64_t>(), labels.size() * sizeof(int64_t));
      b.copy_to_host(scores.data(), best.as<float>(), scores.size() * sizeof(float));
    } else if (type_ == AnnIndexType::Flat && n < faiss::distance_compute_blas_threshold) {
      // Below this many queries FAISS scans without BLAS, reading the whole index once per query;
      // the engine's exact search (tiled sgemm + heaps, same hits) reads it once per call, and is
      // several times faster there (docs/benchmarks.md, moe-bench-search).
      kernels::cpu::inner_product_topk(unit.data(), n, static_cast<const faiss::IndexFlat*>(index_.get())->get_xb(),
                                       rows(), dim_, kk, labels.data(), scores.data());
    } else if (type_ == AnnIndexType::Hnsw) {
      // FAISS 1.7.3 accepts faiss::SearchParametersHNSW but its HNSW search ignores the efSearch
      // in it (tests/test_ann_index.cpp checks), so ef is set on the index, under a mutex around
      // setting and searching; batching loses little to the lock. HNSW returns at most ef hits.
      // (FAISS also bumps faiss::hnsw_stats unsynchronised; nothing reads it.)
      auto* hnsw = static_cast<faiss::IndexHNSW*>(index_.get());
      std::lock_guard<std::mutex> lock(*search_mutex_);
      hnsw->hnsw.efSearch = static_cast<int>(std::max<int64_t>(options.ef_search, kk));
      hnsw->search(n, unit.data(), kk, scores.data(), labels.data());
    } else if (type_ == AnnIndexType::Ivf) {
      search_ivf(index_.get(), unit.data(), n, kk, options.nprobe, nullptr, scores.data(), labels.data());
    } else {
      index_->search(n, unit.data(), kk, scores.data(), labels.data());
    }
  } catch (const faiss::FaissException& e) {
    throw Error("ANN search: " + faiss_reason(e));
  }
  std::vector<std::vector<AnnHit>> hits = collect_hits(labels, scores, n, kk);
  if (overfetch) {
    for (auto& list : hits) {
      list.erase(std::remove_if(list.begin(), list.end(), [&](const AnnHit& hit) { return !live_->is_live(hit.item); }),
                 list.end());
      if (static_cast<int64_t>(list.size()) > k) list.resize(static_cast<size_t>(k));
    }
  }
  return hits;
}

std::vector<std::vector<AnnHit>> AnnIndex::search_filtered(const float* unit, int64_t n, int k,
                                                           const AnnSearchOptions& options) const {
  // The rows searched: the live ones the filter matches, or all live ones (a bitmap kept by updates).
  std::vector<uint8_t> bitmap;
  const uint8_t* selected = live_->bits.data();
  int64_t matches = rows() - live_->deleted;
  if (options.filter && !options.filter->empty()) {
    const std::vector<int64_t> rows = live_matching(*options.filter);
    bitmap.resize(static_cast<size_t>((this->rows() + 7) / 8));
    for (int64_t row : rows) bitmap[static_cast<size_t>(row >> 3)] |= static_cast<uint8_t>(1u << (row & 7));
    selected = bitmap.data();
    matches = static_cast<int64_t>(rows.size());
  }
  if (matches == 0) return std::vector<std::vector<AnnHit>>(static_cast<size_t>(n));
  const int64_t kk = std::min<int64_t>(k, matches);
  faiss::IDSelectorBitmap selector(static_cast<size_t>((rows() + 7) / 8), selected);
  std::vector<float> scores(static_cast<size_t>(n * kk));
  std::vector<Label> labels(static_cast<size_t>(n * kk));

  // The exact top-kk of m queries over the matching rows: FAISS's flat search with the selector,
  // over the index itself (flat) or over HNSW's flat storage.
  const faiss::Index* flat =
      type_ == AnnIndexType::Hnsw ? static_cast<const faiss::IndexHNSW*>(index_.get())->storage : index_.get();
  auto exact = [&](const float* x, int64_t m, float* d, Label* l) {
    faiss::SearchParameters params;
    params.sel = &selector;
    flat->search(m, x, kk, d, l, &params);
  };
  const bool few = matches <= kExactFilterRows || matches * 1000 < rows();
  if (type_ == AnnIndexType::Flat || (type_ == AnnIndexType::Hnsw && few)) {
    exact(unit, n, scores.data(), labels.data());
  } else if (type_ == AnnIndexType::Ivf) {
    search_ivf(index_.get(), unit, n, kk, options.nprobe, &selector, scores.data(), labels.data());
  } else {
    // HNSW applies the selector to the nodes its walk reaches: ef grows as the matching share
    // shrinks, so that about as many matching candidates are met as an unfiltered search meets.
    const int64_t base_ef = std::max<int64_t>(options.ef_search, kk);
    const int ef =
        static_cast<int>(std::max<int64_t>(base_ef, std::min<int64_t>(kMaxFilteredEf, base_ef * rows() / matches)));
    auto* hnsw = static_cast<faiss::IndexHNSW*>(index_.get());
    faiss::SearchParametersHNSW params;
    params.sel = &selector;
    params.efSearch = ef;
    std::lock_guard<std::mutex> lock(*search_mutex_);
    hnsw->hnsw.efSearch = ef;
    hnsw->search(n, unit, kk, scores.data(), labels.data(), &params);
  }
  // A query that found fewer than kk of the matching rows is searched again over all of them.
  for (int64_t q = 0; q < n; ++q) {
    float* d = scores.data() + q * kk;
    Label* l = labels.data() + q * kk;
    if (std::count_if(l, l + kk, [](Label label) { return label >= 0; }) == kk) continue;
    if (type_ == AnnIndexType::Ivf)
      search_ivf(index_.get(), unit + q * dim_, 1, kk, static_cast<int>(nlist()), &selector, d, l);
    else
      exact(unit + q * dim_, 1, d, l);
  }
  return collect_hits(labels, scores, n, kk);
}

std::string AnnIndex::place_on(const std::string& device) {
  std::string resolved = resolve_device(device);  // throws naming the device and the reason
  // HNSW and IVF are searched by FAISS whatever the device: "auto" means the best there is, which is that.
  if (type_ != AnnIndexType::Flat && device == "auto") resolved = "cpu";
  if (resolved == "cpu") {
    std::lock_guard<std::mutex> updating(live_->update);
    std::unique_lock<std::shared_mutex> writing(live_->rw);
    device_.reset();
    return resolved;
  }
  std::shared_ptr<kernels::Backend> backend = open_backend(resolved);
  place_on(backend, backend_mutex(*backend));
  return resolved;
}

void AnnIndex::place_on(std::shared_ptr<kernels::Backend> backend, std::shared_ptr<std::mutex> mutex) {
  if (type_ != AnnIndexType::Flat)
    throw Error("ANN index: " + backend->name() + " searches flat indexes only; this one is " + factory_ +
                ", which FAISS searches on the CPU (device cpu)");
  std::lock_guard<std::mutex> updating(live_->update);
  auto vectors = std::make_unique<DeviceVectors>();
  vectors->backend = std::move(backend);
  vectors->mutex = std::move(mutex);
  const size_t bytes = static_cast<size_t>(rows()) * static_cast<size_t>(dim_) * sizeof(float);
  {
    const auto held = detail::lock_if(vectors->mutex);
    kernels::Backend& b = *vectors->backend;
    vectors->base = b.allocate(std::max<size_t>(bytes, 64));  // throws naming the backend and the size
    // The flat index holds the unit vectors that add() gave it, row-major.
    b.copy_from_host(vectors->base, static_cast<const faiss::IndexFlat*>(index_.get())->get_xb(), bytes);
    b.synchronize();
  }
  std::unique_lock<std::shared_mutex> writing(live_->rw);
  device_ = std::move(vectors);
}

void AnnIndex::save(const std::string& path) {
  std::lock_guard<std::mutex> updating(live_->update);
  if (!index_->is_trained) {
    std::unique_lock<std::shared_mutex> writing(live_->rw);
    train_pending();
  }
  std::shared_lock<std::shared_mutex> reading(live_->rw);  // searches go on; updates wait for `updating`
  save_pair(path);
}

void AnnIndex::save_pair(const std::string& path) {
  const std::string items_path = items_path_for(path);
  const std::string journal_path = journal_path_for(path);
  // Above every generation at PATH, so that the journal there (whose records the new pair holds)
  // is older than the pair once it is renamed into place.
  const uint64_t generation = std::max(pair_generation_at(items_path), journal_generation_at(journal_path)) + 1;
  AtomicFile index_file(path);
  AtomicFile items_file(items_path);
  SealingWriter sealed(index_file.stream());
  try {
    faiss::write_index(index_.get(), &sealed);
  } catch (const faiss::FaissException& e) {
    throw Error("'" + path + "' cannot be written: " + faiss_reason(e));
  }
  index_file.finish();

  LineWriter writer;
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  add_string(b, "format", kAnnItemsFormat);
  // Version 1 readers would take deleted rows for live ones; a table without any stays readable to them.
  add_int(b, "version", live_->deleted > 0 ? 2 : 1);
  add_int(b, "count", static_cast<int64_t>(items_.size()));
  add_int(b, "dim", dim_);
  add_string(b, "index_type", ann_index_type_name(type_));
  add_string(b, "factory", factory_);
  add_int(b, "generation", static_cast<int64_t>(generation));
  add_int(b, "index_crc32", sealed.crc.value());
  add_int(b, "index_bytes", static_cast<int64_t>(sealed.bytes));
  if (provenance_) {
    json_builder_set_member_name(b, "provenance");
    json_builder_begin_object(b);
    add_string(b, "encoder", provenance_->encoder);
    add_string(b, "encoder_fingerprint", provenance_->encoder_fingerprint);
    add_string(b, "adapter", provenance_->adapter);
    add_string(b, "adapter_fingerprint", provenance_->adapter_fingerprint);
    json_builder_end_object(b);
  }
  json_builder_end_object(b);
  try {
    write_all(items_file, writer.line(b));
    for (size_t i = 0; i < items_.size(); ++i) {
      json_builder_reset(b);
      json_builder_begin_object(b);
      add_int(b, "item", static_cast<int64_t>(i));
      if (!live_->is_live(static_cast<int64_t>(i))) {
        json_builder_set_member_name(b, "deleted");
        json_builder_add_boolean_value(b, TRUE);
        json_builder_end_object(b);
        write_all(items_file, writer.line(b));
        continue;
      }
      add_string(b, "id", items_[i].id);
      add_string(b, "uri", items_[i].uri);
      add_string(b, "caption", items_[i].caption);
      if (!items_[i].fields.empty()) {
        JsonNode* fields = json_from_string(items_[i].fields.c_str(), nullptr);
        if (!fields || !JSON_NODE_HOLDS_OBJECT(fields)) {
          if (fields) json_node_unref(fields);
          throw Error("'" + items_file.path() + "': the fields of item " + std::to_string(i) +
                      " are not a JSON object's text");
        }
        json_builder_set_member_name(b, "fields");
        json_builder_add_value(b, fields);
      }
      json_builder_end_object(b);
      write_all(items_file, writer.line(b));
    }
  } catch (...) {
    g_object_unref(b);
    throw;
  }
  g_object_unref(b);
  items_file.finish();
  // Both complete on disk under their .new names; then the table, then the index. A kill before
  // the first rename leaves the old pair (and its journal); between the renames, a table whose
  // seal the old index does not match and PATH.new that does, which load() renames into place.
  fsync_dir(path);
  items_file.commit();
  // From here load() reads the new pair (from PATH.new while PATH is not its index), so the
  // journal moves on to it even if the second rename fails.
  index_file.keep();
  std::exception_ptr rename_error;
  try {
    index_file.commit();
    fsync_dir(path);
  } catch (const Error&) {
    rename_error = std::current_exception();
  }
  live_->durable_path = path;
  live_->durable_generation = generation;
  // The old journal is stale now (an older generation: load() ignores it); replace or drop it.
  if (live_->journal && live_->journal->index_path == path) {
    live_->journal.reset();
    live_->journal = open_journal(path, generation, dim_);
  } else if (::unlink(journal_path.c_str()) == 0) {
    fsync_dir(path);
  }
  if (rename_error) std::rethrow_exception(rename_error);
}

AnnIndex AnnIndex::load(const std::string& path) {
  // The table first: its seal says which FAISS file belongs to it.
  const std::string items_path = items_path_for(path);
  std::ifstream in(items_path, std::ios::binary);
  if (!in) throw Error("ANN item table '" + items_path + "' cannot be read: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error("ANN item table '" + items_path + "': read error");
  const AnnPairSeal seal = parse_ann_pair_seal(text.str(), items_path);

  SealedIndex sealed = read_sealed_index(path);
  auto matches = [&](const SealedIndex& s) { return s.crc32 == *seal.index_crc32 && s.bytes == seal.index_bytes; };
  if (seal.index_crc32 && !matches(sealed)) {
    // A save killed between its renames: the table is new, the index old, PATH.new the new index.
    const std::string next = next_path_for(path);
    std::optional<SealedIndex> finished;
    if (::access(next.c_str(), F_OK) == 0) {
      try {
        finished = read_sealed_index(next);
      } catch (const Error&) {
      }
    }
    if (!finished || !matches(*finished))
      throw Error("ANN index '" + path + "' (" + std::to_string(sealed.bytes) + " bytes, CRC-32 " +
                  hex32(sealed.crc32) + ") is not the index its item table '" + items_path + "' was saved with (" +
                  std::to_string(seal.index_bytes) + " bytes, CRC-32 " + hex32(*seal.index_crc32) + "), and no '" +
                  next + "' is: the two files come from different saves");
    sealed = std::move(*finished);
    // Finish the save; were the rename refused (a read-only folder), this load still has the pair.
    if (std::rename(next.c_str(), path.c_str()) == 0) fsync_dir(path);
  }
  std::unique_ptr<faiss::Index> index = std::move(sealed.index);

  const std::optional<AnnIndexType> type = kind_of(index.get());
  if (!type)
    throw Error("ANN index '" + path +
                "': unsupported FAISS index type (expected a flat, HNSW-flat or IVF index, as index_factory makes "
                "them)");
  const faiss::IndexIVF* ivf = ivf_of(index.get());
  if (index->metric_type != faiss::METRIC_INNER_PRODUCT || (ivf && ivf->metric_type != faiss::METRIC_INNER_PRODUCT))
    throw Error("ANN index '" + path + "': metric is not inner product (cosine search needs it)");
  if (!index->is_trained) throw Error("ANN index '" + path + "': the index is not trained");
  const int dim = index->d;
  const int64_t count = index->ntotal;
  std::string factory = factory_of(index.get(), *type);
  AnnIndex out(std::move(index), *type, factory, dim);

  // The parsing lives in catalog.cpp, apart from FAISS, so that it can be fuzzed alone.
  AnnItemTable table = parse_ann_item_table(text.str(), items_path, path, count, dim, *type);
  if (!table.factory.empty()) out.factory_ = std::move(table.factory);
  out.items_.assign(std::make_move_iterator(table.items.begin()), std::make_move_iterator(table.items.end()));
  out.provenance_ = std::move(table.provenance);
  Live& live = *out.live_;
  live.append_rows(0, count);
  for (int64_t row : table.deleted)
    live.bits[static_cast<size_t>(row >> 3)] &= static_cast<uint8_t>(~(1u << (row & 7)));
  live.deleted = static_cast<int64_t>(table.deleted.size());
  out.replay_journal(path, seal.generation);
  live.durable_path = path;
  live.durable_generation = seal.generation;
  return out;
}

void AnnIndex::replay_journal(const std::string& path, uint64_t generation) {
  const std::string journal_path = journal_path_for(path);
  if (::access(journal_path.c_str(), F_OK) != 0) return;
  JournalReader reader(journal_path);
  if (reader.generation() < generation) return;  // a save's leftover: the pair holds its records
  if (reader.generation() > generation)
    throw Error("ANN journal '" + journal_path + "' continues generation " + std::to_string(reader.generation()) +
                " but the pair '" + path + "' is generation " + std::to_string(generation) +
                ": the pair is older than its journal (restored from a copy?)");
  if (reader.dim() != dim_)
    throw Error("ANN journal '" + journal_path + "' holds " + std::to_string(reader.dim()) +
                "-wide vectors but the index '" + path + "' " + std::to_string(dim_));
  JournalEntry entry;
  while (reader.next(&entry)) {
    if (entry.op == kJournalUpsert)
      apply_upsert(entry.vector.data(), entry.item);
    else
      apply_remove(entry.ids);
  }
}

namespace {

// Why an index takes no live updates now ("" when it does).
std::string live_update_refusal(const faiss::Index& index, const std::string& factory, const std::string& device,
                                int64_t held) {
  if (!index.is_trained)
    return "'" + factory + "' is not trained yet (it holds " + std::to_string(held) +
           " vectors back to train on): train() or save() it first";
  if (!device.empty())
    return "not supported on a device-resident index (placed on " + device + "); keep it on the CPU (device cpu)";
  return "";
}

}  // namespace

int64_t AnnIndex::upsert(const float* vector, int64_t width, const AnnItem& item) {
  std::lock_guard<std::mutex> updating(live_->update);
  if (item.id.empty()) throw Error("ANN index: upsert of an item without an id (live updates address items by id)");
  const std::string what = "ANN index: upsert of '" + item.id + "'";
  if (width != dim_)
    throw Error(what + ": a vector of " + std::to_string(width) + " floats, but the index holds " +
                std::to_string(dim_) + "-wide vectors");
  if (vector == nullptr) throw Error(what + ": no vector");
  for (int64_t i = 0; i < width; ++i)
    if (!std::isfinite(vector[i])) throw Error(what + ": component " + std::to_string(i) + " is not finite");
  const std::string refusal = live_update_refusal(*index_, factory_, device_ ? device_->backend->name() : "", rows());
  if (!refusal.empty()) throw Error(what + ": " + refusal);
  if (!live_->journal) return apply_upsert(vector, item);
  std::string payload(1, static_cast<char>(kJournalUpsert));
  for (int i = 0; i < dim_; ++i) {
    uint32_t bits;
    std::memcpy(&bits, vector + i, 4);
    put_u32(payload, bits);
  }
  for (const std::string* s : {&item.id, &item.uri, &item.caption, &item.fields}) put_string(payload, *s);
  const uint64_t end = live_->journal->end;
  live_->journal->append(journal_record(payload));
  try {
    return apply_upsert(vector, item);
  } catch (...) {  // not applied: neither may a replay apply it
    live_->journal->cut(end);
    throw;
  }
}

int64_t AnnIndex::remove(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> updating(live_->update);
  const std::string refusal = live_update_refusal(*index_, factory_, device_ ? device_->backend->name() : "", rows());
  if (!refusal.empty()) throw Error("ANN index: remove: " + refusal);
  // The ids with live rows (no other update runs: reading under the shared lock suffices).
  std::vector<std::string> present;
  {
    std::shared_lock<std::shared_mutex> reading(live_->rw);
    const Live::IdRows& table = live_->id_rows(items_);
    for (const std::string& id : ids)
      if (table.rows.count(id) > 0 && std::find(present.begin(), present.end(), id) == present.end())
        present.push_back(id);
  }
  if (present.empty()) return 0;
  if (!live_->journal) return apply_remove(present);
  std::string payload(1, static_cast<char>(kJournalRemove));
  put_u32(payload, static_cast<uint32_t>(present.size()));
  for (const std::string& id : present) put_string(payload, id);
  const uint64_t end = live_->journal->end;
  live_->journal->append(journal_record(payload));
  try {
    return apply_remove(present);
  } catch (...) {
    live_->journal->cut(end);
    throw;
  }
}

int64_t AnnIndex::apply_upsert(const float* vector, const AnnItem& item) {
  const std::vector<float> unit = normalized_copy(vector, 1, dim_);
  std::unique_lock<std::shared_mutex> writing(live_->rw);
  Live& live = *live_;
  live.id_rows(items_);
  const int64_t row = rows();
  try {
    index_->add(1, unit.data());  // FAISS numbers it ntotal, which is row: every row is in the index
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot add '" + item.id + "': " + faiss_reason(e));
  }
  items_.push_back(item);
  live.append_rows(row, 1);
  if (columns_->ready) columns_->append(items_.back(), items_.size());
  live.delete_id(item.id);
  live.ids->rows.emplace(item.id, row);
  live.changed();
  return row;
}

int64_t AnnIndex::apply_remove(const std::vector<std::string>& ids) {
  std::unique_lock<std::shared_mutex> writing(live_->rw);
  Live& live = *live_;
  live.id_rows(items_);
  int64_t removed = 0;
  for (const std::string& id : ids) removed += live.delete_id(id);
  if (removed > 0) live.changed();
  return removed;
}

void AnnIndex::attach_journal(const std::string& path) {
  std::lock_guard<std::mutex> updating(live_->update);
  const std::string refusal = live_update_refusal(*index_, factory_, device_ ? device_->backend->name() : "", rows());
  if (!refusal.empty()) throw Error("ANN journal '" + journal_path_for(path) + "': " + refusal);
  live_->journal.reset();
  if (live_->durable_path != path) {
    std::shared_lock<std::shared_mutex> reading(live_->rw);
    save_pair(path);
  }
  live_->journal = open_journal(path, live_->durable_generation, dim_);
}

}  // namespace moe
