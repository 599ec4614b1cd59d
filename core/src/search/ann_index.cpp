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
#include <faiss/index_factory.h>
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

using Label = faiss::Index::idx_t;

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

}  // namespace

// The items' fields by name, one value per row: what filters scan.
struct AnnIndex::FieldColumns {
  std::once_flag parsed;
  std::unordered_map<std::string, std::vector<FieldValue>> columns;

  void parse(const std::vector<AnnItem>& items) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].fields.empty()) continue;
      // The text is a JSON object: checked by the item table's bounded parser (depth included),
      // or made by parse_catalog_line from one.
      JsonNode* root = json_from_string(items[i].fields.c_str(), nullptr);
      if (root == nullptr) continue;
      if (JSON_NODE_HOLDS_OBJECT(root)) add_members(json_node_get_object(root), "", i, items.size());
      json_node_unref(root);
    }
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
      search_mutex_(std::make_unique<std::mutex>()) {}
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

bool AnnIndex::is_trained() const { return index_->is_trained; }

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
  columns_ = std::make_unique<FieldColumns>();  // parsed again at the next filtered search
  if (!index_->is_trained) {
    const size_t held = pending_.size();
    pending_.insert(pending_.end(), unit.begin(), unit.end());
    items_.insert(items_.end(), items.begin(), items.end());
    if (static_cast<int64_t>(pending_.size() / static_cast<size_t>(dim_)) < train_size_) return;
    try {
      train();
    } catch (const Error&) {  // these rows are not added: the index stays as it was
      pending_.resize(held);
      items_.resize(items_.size() - items.size());
      throw;
    }
    return;
  }
  try {
    index_->add(n, unit.data());
  } catch (const faiss::FaissException& e) {
    throw Error("ANN index: cannot add " + std::to_string(n) + " vectors: " + faiss_reason(e));
  }
  items_.insert(items_.end(), items.begin(), items.end());
}

void AnnIndex::train() {
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
  std::vector<int64_t> rows;
  if (filter.empty()) {
    rows.resize(items_.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(i);
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
        if (holds(condition, values[i])) rows.push_back(static_cast<int64_t>(i));
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
  if (n == 0 || size() == 0) return std::vector<std::vector<AnnHit>>(static_cast<size_t>(n));
  if (!is_trained())
    throw Error("ANN search: '" + factory_ + "' is not trained yet (it holds " + std::to_string(size()) +
                " vectors back to train on): train() or save() it first");

  const std::vector<float> unit = normalized_copy(queries, n, dim_);
  try {
    if (options.filter && !options.filter->empty()) return search_filtered(unit.data(), n, k, options);
  } catch (const faiss::FaissException& e) {
    throw Error("ANN search: " + faiss_reason(e));
  }
  const int64_t kk = std::min<int64_t>(k, size());
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
  return collect_hits(labels, scores, n, kk);
}

std::vector<std::vector<AnnHit>> AnnIndex::search_filtered(const float* unit, int64_t n, int k,
                                                           const AnnSearchOptions& options) const {
  const std::vector<int64_t> rows = matching(*options.filter);
  if (rows.empty()) return std::vector<std::vector<AnnHit>>(static_cast<size_t>(n));
  const int64_t kk = std::min<int64_t>(k, static_cast<int64_t>(rows.size()));
  std::vector<uint8_t> bitmap(static_cast<size_t>((size() + 7) / 8));
  for (int64_t row : rows) bitmap[static_cast<size_t>(row >> 3)] |= static_cast<uint8_t>(1u << (row & 7));
  faiss::IDSelectorBitmap selector(bitmap.size(), bitmap.data());
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
  const bool few =
      static_cast<int64_t>(rows.size()) <= kExactFilterRows || static_cast<int64_t>(rows.size()) * 1000 < size();
  if (type_ == AnnIndexType::Flat || (type_ == AnnIndexType::Hnsw && few)) {
    exact(unit, n, scores.data(), labels.data());
  } else if (type_ == AnnIndexType::Ivf) {
    search_ivf(index_.get(), unit, n, kk, options.nprobe, &selector, scores.data(), labels.data());
  } else {
    // HNSW applies the selector to the nodes its walk reaches: ef grows as the matching share
    // shrinks, so that about as many matching candidates are met as an unfiltered search meets.
    const int64_t base_ef = std::max<int64_t>(options.ef_search, kk);
    const int ef = static_cast<int>(std::max<int64_t>(
        base_ef, std::min<int64_t>(kMaxFilteredEf, base_ef * size() / static_cast<int64_t>(rows.size()))));
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

void AnnIndex::save(const std::string& path) {
  train();
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
  add_string(b, "factory", factory_);
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

  const std::string items_path = items_path_for(path);
  std::ifstream in(items_path, std::ios::binary);
  if (!in) throw Error("ANN item table '" + items_path + "' cannot be read: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error("ANN item table '" + items_path + "': read error");
  // The parsing lives in catalog.cpp, apart from FAISS, so that it can be fuzzed alone.
  AnnItemTable table = parse_ann_item_table(text.str(), items_path, path, count, dim, *type);
  if (!table.factory.empty()) out.factory_ = std::move(table.factory);
  out.items_ = std::move(table.items);
  out.provenance_ = std::move(table.provenance);
  return out;
}

}  // namespace moe
