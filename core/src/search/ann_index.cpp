#include "moe/ann_index.h"

#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/impl/FaissException.h>
#include <faiss/index_io.h>
#include <faiss/utils/distances.h>
#include <fcntl.h>
#include <json-glib/json-glib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
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

// A file written under a temporary name beside `path` and renamed onto it by commit(); if it
// is never committed, the temporary file is removed and `path` is untouched.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)) {
    static std::atomic<unsigned> counter{0};
    tmp_ = path_ + ".tmp-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    const int fd = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
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
    if (!committed_) ::unlink(tmp_.c_str());
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

 private:
  std::string path_, tmp_;
  FILE* stream_ = nullptr;
  bool committed_ = false;
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

}  // namespace

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

AnnIndex::AnnIndex(std::unique_ptr<faiss::Index> index, AnnIndexType type, int dim)
    : index_(std::move(index)), type_(type), dim_(dim), search_mutex_(std::make_unique<std::mutex>()) {}
AnnIndex::AnnIndex(AnnIndex&&) noexcept = default;
AnnIndex& AnnIndex::operator=(AnnIndex&&) noexcept = default;
AnnIndex::~AnnIndex() = default;

AnnIndex AnnIndex::create(int dim, const AnnBuildOptions& options) {
  if (dim < 1) throw Error("ANN index: dimension must be >= 1, got " + std::to_string(dim));
  try {
    if (options.type == AnnIndexType::Flat)
      return AnnIndex(std::make_unique<faiss::IndexFlatIP>(dim), AnnIndexType::Flat, dim);
    if (options.hnsw_m < 2) throw Error("ANN index: HNSW M must be >= 2, got " + std::to_string(options.hnsw_m));
    if (options.ef_construction < 1)
      throw Error("ANN index: HNSW efConstruction must be >= 1, got " + std::to_string(options.ef_construction));
    auto hnsw = std::make_unique<faiss::IndexHNSWFlat>(dim, options.hnsw_m, faiss::METRIC_INNER_PRODUCT);
    hnsw->hnsw.efConstruction = options.ef_construction;
    return AnnIndex(std::move(hnsw), AnnIndexType::Hnsw, dim);
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot create a " + std::string(ann_index_type_name(options.type)) +
                " index of dimension " + std::to_string(dim) + ": " + faiss_reason(e));
  }
}

int64_t AnnIndex::size() const { return index_->ntotal; }

const AnnItem& AnnIndex::item(int64_t i) const {
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
  const std::string* first = nullptr;
  size_t common = 0;
  for (const AnnItem& item : items_) {
    if (item.uri.empty()) continue;
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
  provenance_ = std::move(provenance);
}

void AnnIndex::add(const float* vectors, int64_t n, const std::vector<AnnItem>& items) {
  if (n < 0 || static_cast<int64_t>(items.size()) != n)
    throw Error("ANN index: add of " + std::to_string(n) + " vectors with " + std::to_string(items.size()) +
                " items (they must match)");
  if (n == 0) return;
  if (device_)
    throw Error("ANN index: add after place_on(" + device_->backend->name() +
                "): add every vector first, then place the index");
  const std::vector<float> unit = normalized_copy(vectors, n, dim_);
  try {
    index_->add(n, unit.data());
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot add " + std::to_string(n) + " vectors: " + faiss_reason(e));
  }
  items_.insert(items_.end(), items.begin(), items.end());
}

std::vector<std::vector<AnnHit>> AnnIndex::search(const float* queries, int64_t n, int k, int ef_search) const {
  if (k < 1) throw Error("ANN search: k must be >= 1, got " + std::to_string(k));
  if (ef_search < 1) throw Error("ANN search: ef_search must be >= 1, got " + std::to_string(ef_search));
  if (n < 0) throw Error("ANN search: negative query count " + std::to_string(n));
  std::vector<std::vector<AnnHit>> out(static_cast<size_t>(n));
  if (n == 0 || size() == 0) return out;

  const int64_t kk = std::min<int64_t>(k, size());
  const std::vector<float> unit = normalized_copy(queries, n, dim_);
  std::vector<float> scores(static_cast<size_t>(n * kk));
  std::vector<faiss::Index::idx_t> labels(static_cast<size_t>(n * kk));
  static_assert(sizeof(faiss::Index::idx_t) == sizeof(int64_t), "FAISS ids are the backend's int64 ids");
  try {
    if (device_) {
      const auto held = detail::lock_if(device_->mutex);
      kernels::Backend& b = *device_->backend;
      DeviceBuffer q(b, unit.size() * sizeof(float)), ids(b, labels.size() * sizeof(int64_t)),
          best(b, scores.size() * sizeof(float));
      b.copy_from_host(q.as<float>(), unit.data(), unit.size() * sizeof(float));
      b.inner_product_topk(q.as<float>(), n, static_cast<const float*>(device_->base), size(), dim_, kk,
                           ids.as<int64_t>(), best.as<float>());
      b.copy_to_host(labels.data(), ids.as<int64_t>(), labels.size() * sizeof(int64_t));
      b.copy_to_host(scores.data(), best.as<float>(), scores.size() * sizeof(float));
    } else if (type_ == AnnIndexType::Flat && n < faiss::distance_compute_blas_threshold) {
      // Below this many queries FAISS scans without BLAS, reading the whole index once per query;
      // the engine's exact search (tiled sgemm + heaps, same hits) reads it once per call, and is
      // several times faster there (docs/benchmarks.md, moe-bench-search).
      kernels::cpu::inner_product_topk(unit.data(), n, static_cast<const faiss::IndexFlat*>(index_.get())->get_xb(),
                                       size(), dim_, kk, labels.data(), scores.data());
    } else if (type_ == AnnIndexType::Hnsw) {
      // FAISS 1.7.3 accepts faiss::SearchParametersHNSW but its HNSW search ignores the efSearch
      // in it (tests/test_ann_index.cpp checks), so ef is set on the index, under a mutex around
      // setting and searching; batching loses little to the lock. HNSW returns at most ef hits.
      // (FAISS also bumps faiss::hnsw_stats unsynchronised; nothing reads it.)
      auto* hnsw = static_cast<faiss::IndexHNSW*>(index_.get());
      std::lock_guard<std::mutex> lock(*search_mutex_);
      hnsw->hnsw.efSearch = static_cast<int>(std::max<int64_t>(ef_search, kk));
      hnsw->search(n, unit.data(), kk, scores.data(), labels.data());
    } else {
      index_->search(n, unit.data(), kk, scores.data(), labels.data());
    }
  } catch (const faiss::FaissException& e) {
    throw Error("ANN search: " + faiss_reason(e));
  }
  for (int64_t q = 0; q < n; ++q) {
    auto& hits = out[static_cast<size_t>(q)];
    hits.reserve(static_cast<size_t>(kk));
    for (int64_t j = 0; j < kk; ++j) {
      const auto label = labels[static_cast<size_t>(q * kk + j)];
      if (label >= 0) hits.push_back({label, scores[static_cast<size_t>(q * kk + j)]});  // -1: HNSW found fewer
    }
  }
  return out;
}

std::string AnnIndex::place_on(const std::string& device) {
  std::string resolved = resolve_device(device);  // throws naming the device and the reason
  // HNSW is searched by FAISS whatever the device: "auto" means the best there is, which is that.
  if (type_ == AnnIndexType::Hnsw && device == "auto") resolved = "cpu";
  if (resolved == "cpu") {
    device_.reset();
    return resolved;
  }
  std::shared_ptr<kernels::Backend> backend = open_backend(resolved);
  place_on(backend, backend_mutex(*backend));
  return resolved;
}

void AnnIndex::place_on(std::shared_ptr<kernels::Backend> backend, std::shared_ptr<std::mutex> mutex) {
  if (type_ != AnnIndexType::Flat)
    throw Error("ANN index: " + backend->name() + " searches flat indexes only; this one is HNSW, which FAISS " +
                "searches on the CPU (device cpu)");
  auto vectors = std::make_unique<DeviceVectors>();
  vectors->backend = std::move(backend);
  vectors->mutex = std::move(mutex);
  const size_t bytes = static_cast<size_t>(size()) * static_cast<size_t>(dim_) * sizeof(float);
  {
    const auto held = detail::lock_if(vectors->mutex);
    kernels::Backend& b = *vectors->backend;
    vectors->base = b.allocate(std::max<size_t>(bytes, 64));  // throws naming the backend and the size
    // The flat index holds the unit vectors that add() gave it, row-major.
    b.copy_from_host(vectors->base, static_cast<const faiss::IndexFlat*>(index_.get())->get_xb(), bytes);
    b.synchronize();
  }
  device_ = std::move(vectors);
}

void AnnIndex::save(const std::string& path) const {
  AtomicFile index_file(path);
  AtomicFile items_file(items_path_for(path));
  try {
    faiss::write_index(index_.get(), index_file.stream());
  } catch (const faiss::FaissException& e) {
    throw Error("'" + path + "' cannot be written: " + faiss_reason(e));
  }
  index_file.finish();

  LineWriter writer;
  JsonBuilder* b = json_builder_new();
  json_builder_begin_object(b);
  add_string(b, "format", kAnnItemsFormat);
  add_int(b, "version", kAnnItemsVersion);
  add_int(b, "count", static_cast<int64_t>(items_.size()));
  add_int(b, "dim", dim_);
  add_string(b, "index_type", ann_index_type_name(type_));
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
  // Items first: a crash between the renames leaves a pair whose counts disagree, which load()
  // rejects, rather than a new index silently described by old items.
  items_file.commit();
  index_file.commit();
}

AnnIndex AnnIndex::load(const std::string& path) {
  std::unique_ptr<faiss::Index> index;
  try {
    index.reset(faiss::read_index(path.c_str()));
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index '" + path + "' cannot be read: " + faiss_reason(e));
  } catch (const std::exception& e) {  // corrupt sizes surface as std::bad_alloc / length_error
    throw Error("ANN index '" + path + "' cannot be read: corrupt file (" + e.what() + ")");
  }

  AnnIndexType type;
  if (dynamic_cast<faiss::IndexHNSWFlat*>(index.get()))
    type = AnnIndexType::Hnsw;
  else if (dynamic_cast<faiss::IndexFlatIP*>(index.get()))
    type = AnnIndexType::Flat;
  else
    throw Error("ANN index '" + path + "': unsupported FAISS index type (expected IndexFlatIP or IndexHNSWFlat)");
  if (index->metric_type != faiss::METRIC_INNER_PRODUCT)
    throw Error("ANN index '" + path + "': metric is not inner product (cosine search needs it)");
  const int dim = index->d;
  const int64_t count = index->ntotal;
  AnnIndex out(std::move(index), type, dim);

  const std::string items_path = items_path_for(path);
  std::ifstream in(items_path, std::ios::binary);
  if (!in) throw Error("ANN item table '" + items_path + "' cannot be read: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error("ANN item table '" + items_path + "': read error");
  // The parsing lives in catalog.cpp, apart from FAISS, so that it can be fuzzed alone.
  AnnItemTable table = parse_ann_item_table(text.str(), items_path, path, count, dim, type);
  out.items_ = std::move(table.items);
  out.provenance_ = std::move(table.provenance);
  return out;
}

}  // namespace moe
