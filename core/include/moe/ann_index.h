// gst-moe: the nearest-neighbour index that answers search requests.
//
// Why FAISS: it is the field's standard ANN library (exact and graph indexes, a stable on-disk
// format, used in production at scale); Debian ships it, and writing our own would be slower
// and untested. FAISS types stay out of this header: callers see only AnnIndex.
//
// Similarity is cosine: vectors are L2-normalised on the way in (add and search), and the index
// ranks by inner product, so a score is the cosine similarity in [-1, 1], higher is better.
//
// On disk an index is two files side by side:
//   PATH               the FAISS index (faiss::write_index format)
//   PATH.items.jsonl   the item table, JSON Lines: a header object
//                        {"format":"gst-moe-items","version":1,"count":N,"dim":D,"index_type":"flat"|"hnsw",
//                         "provenance":{"encoder":"...","encoder_fingerprint":"...",
//                                       "adapter":"...","adapter_fingerprint":"..."}}
//                      then one object per item, in index order:
//                        {"item":i,"id":"...","uri":"...","caption":"...","fields":{...}}
//                      "provenance" is optional: tables written before it existed, or for vectors
//                      of unknown origin, have none. "fields" (the catalog line's members other
//                      than path, id and caption) is optional too: written only when there are
//                      some. Adding them kept version 1: they are optional members that older
//                      readers skip, and their absence already says "unknown" / "none", so a
//                      version number would tell a reader nothing more.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace faiss {
struct Index;
}
namespace moe::kernels {
class Backend;
}

namespace moe {

enum class AnnIndexType {
  Flat,  // faiss::IndexFlatIP: exact, linear in the index size
  Hnsw,  // faiss::IndexHNSWFlat over inner product: approximate, logarithmic
};

// "flat" / "hnsw" (the names used in the item table and by the elements).
const char* ann_index_type_name(AnnIndexType type);

struct AnnBuildOptions {
  AnnIndexType type = AnnIndexType::Flat;
  int hnsw_m = 32;           // HNSW: links per node (memory and recall grow with it)
  int ef_construction = 80;  // HNSW: candidate list size while building (build time vs quality)
};

// What an index row stands for; returned with search hits.
struct AnnItem {
  std::string id;        // the catalog's identifier
  std::string uri;       // where the item lives (an image file uri)
  std::string caption;   // its text
  std::string fields{};  // the catalog line's other members: a JSON object's compact text, "" for none
};

// `uri` with `folder` (a prefix of it ending in '/', as AnnIndex::uri_folder gives) replaced by
// `base` (a '/' is put between them when `base` does not end in one); `uri` unchanged when it does
// not start with `folder`, or `folder` or `base` is empty.
std::string rebase_uri(const std::string& uri, const std::string& folder, const std::string& base);

// What made an index's vectors, so that queries from other models can be refused: the encoder
// and adapter names (directory basenames, for messages) and fingerprints (ClipModel and
// MoeAdapter::fingerprint()). Empty adapter fields: the vectors went through no adapter.
struct AnnProvenance {
  std::string encoder;
  std::string encoder_fingerprint;
  std::string adapter;
  std::string adapter_fingerprint;

  // The same models made both: the fingerprints agree (the names only label them, so a renamed
  // copy of a model matches and a retrained one in the same directory does not).
  bool same_models(const AnnProvenance& other) const;
  // "encoder 'clip' (fp 0123456789abcdef) and adapter 'adapter' (fp fedcba9876543210)", or
  // "encoder 'clip' (fp 0123456789abcdef) without an adapter"; "an unknown encoder" without
  // an encoder fingerprint.
  std::string describe() const;
};

struct AnnHit {
  int64_t item;  // row in the index, 0-based; item(hit.item) describes it
  float score;   // cosine similarity
};

class AnnIndex {
 public:
  // An empty index for `dim`-wide vectors. Throws moe::Error on invalid options.
  static AnnIndex create(int dim, const AnnBuildOptions& options);
  // Reads PATH and PATH.items.jsonl and checks that they agree. Throws moe::Error naming the
  // file and the reason (FAISS's own message for an unreadable index, the line for a bad item).
  // The item table's text is parsed by parse_ann_item_table (moe/catalog.h), which needs no FAISS.
  static AnnIndex load(const std::string& path);

  AnnIndex(AnnIndex&&) noexcept;
  AnnIndex& operator=(AnnIndex&&) noexcept;
  ~AnnIndex();

  // Appends n vectors (row-major n x dim) and their items (items.size() == n). Not safe to
  // call while another thread searches: build first, then search.
  void add(const float* vectors, int64_t n, const std::vector<AnnItem>& items);

  // Writes PATH and PATH.items.jsonl. Each goes to a temporary file in the same directory that
  // is renamed into place only once complete, so a failed write never leaves half a file (and
  // load() rejects a pair whose counts disagree). Throws moe::Error naming the file.
  void save(const std::string& path) const;

  // The best min(k, size()) hits for each of the n queries (row-major n x dim), best first (an
  // HNSW search may find fewer). k must be >= 1. ef_search is HNSW's candidate list size (recall
  // vs speed; ignored by flat indexes). Safe to call from several threads at once; HNSW searches
  // of one index are serialised, flat ones run concurrently. FAISS parallelises each batch over
  // its OpenMP threads. Throws moe::Error naming the cause.
  std::vector<std::vector<AnnHit>> search(const float* queries, int64_t n, int k, int ef_search = 64) const;

  // Where search() runs: "cpu" (the default: FAISS), "cuda:N", or "auto" (cuda:0 when a usable
  // CUDA device exists, else FAISS on the CPU). On a CUDA device the vectors of a flat index are
  // copied to device memory once (a GPU-resident index) and every search is the exact
  // inner-product top-k there (Backend::inner_product_topk: k ≤ 1024; the hits equal FAISS's
  // flat search up to float rounding, ties to the lower item). HNSW indexes are searched by
  // FAISS: a CUDA device is an error for them. Returns the device chosen ("cpu" or "cuda:N").
  // Call after the last add(); add() afterwards throws. Throws moe::Error naming the device and
  // the reason (no usable CUDA device, an HNSW index, out of device memory).
  std::string place_on(const std::string& device);
  // The same on a backend the caller opened (any backend: the tests run this path on the CPU
  // backend); `mutex` is held around each search on it (null: none, for host-memory backends).
  void place_on(std::shared_ptr<kernels::Backend> backend, std::shared_ptr<std::mutex> mutex);

  int dim() const { return dim_; }
  int64_t size() const;
  AnnIndexType type() const { return type_; }
  // The item at row i; throws moe::Error when i is out of range.
  const AnnItem& item(int64_t i) const;
  // The longest folder ("file:///srv/catalog/", up to and including a '/') that holds every item's
  // uri (items without one are skipped): what rebase_uri replaces. "" when the uris share none.
  std::string uri_folder() const;

  // Where the vectors came from: set before save(), read back by load(); none for an index
  // whose item table has no provenance. set_provenance throws moe::Error when the encoder
  // fingerprint is empty (a provenance that cannot be checked is no provenance).
  void set_provenance(AnnProvenance provenance);
  const std::optional<AnnProvenance>& provenance() const { return provenance_; }

 private:
  AnnIndex(std::unique_ptr<faiss::Index> index, AnnIndexType type, int dim);

  std::unique_ptr<faiss::Index> index_;
  AnnIndexType type_;
  int dim_;
  std::vector<AnnItem> items_;
  std::optional<AnnProvenance> provenance_;
  std::unique_ptr<std::mutex> search_mutex_;  // HNSW: guards hnsw.efSearch (see search())
  struct DeviceVectors;                       // the vectors in a backend's memory (place_on)
  std::unique_ptr<DeviceVectors> device_;
};

}  // namespace moe
