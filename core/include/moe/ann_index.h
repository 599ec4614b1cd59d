// gst-moe: the nearest-neighbour index that answers search requests.
//
// Why FAISS: it is the field's standard ANN library (exact and graph indexes, a stable on-disk
// format, used in production at scale); Debian ships it, and writing our own would be slower
// and untested. FAISS types stay out of this header: callers see only AnnIndex.
//
// Similarity is cosine: vectors are L2-normalised on the way in (add and search), and the index
// ranks by inner product, so a score is the cosine similarity in [-1, 1], higher is better.
//
// On disk an index is two files side by side, and a journal once live updates are journaled:
//   PATH               the FAISS index (faiss::write_index format)
//   PATH.items.jsonl   the item table, JSON Lines: a header object
//                        {"format":"gst-moe-items","version":1,"count":N,"dim":D,
//                         "index_type":"flat"|"hnsw"|"ivf","factory":"IVF256,PQ16",
//                         "provenance":{"encoder":"...","encoder_fingerprint":"...",
//                                       "adapter":"...","adapter_fingerprint":"..."}}
//                      then one object per item, in index order:
//                        {"item":i,"id":"...","uri":"...","caption":"...","fields":{...}}
//                      "provenance" is optional: tables written before it existed, or for vectors
//                      of unknown origin, have none. "fields" (the catalog line's members other
//                      than path, id and caption) is optional too: written only when there are
//                      some. "factory" (FAISS's index_factory string the index was made with) is
//                      optional as well: tables written before it existed are "Flat" or "HNSW32"
//                      indexes, which the FAISS file itself describes. Adding them kept version 1:
//                      they are optional members that older readers skip, and their absence
//                      already says "unknown" / "none", so a version number would tell a reader
//                      nothing more.
//                      A row deleted by a live update is {"item":i,"deleted":true}; a table with
//                      such rows is "version":2, which version-1 readers refuse rather than serve
//                      deleted rows. save() also seals the header to its FAISS file with
//                      "generation", "index_crc32" and "index_bytes" (see save()).
//   PATH.journal       live updates since the pair was saved (attach_journal), binary.
// The seal and the journal are described in docs/model-formats.md.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace faiss {
struct Index;
}
namespace moe::kernels {
class Backend;
}

namespace moe {

// The kinds of index searched here; which FAISS structure is named by AnnBuildOptions::index_type.
enum class AnnIndexType {
  Flat,  // faiss::IndexFlatIP: exact, linear in the index size
  Hnsw,  // faiss::IndexHNSWFlat over inner product: approximate graph, logarithmic
  Ivf,   // faiss::IndexIVF (IVFn,Flat / IVFn,PQm, optionally behind OPQ): approximate inverted lists
};

// "flat" / "hnsw" / "ivf" (the names used in the item table and by the elements).
const char* ann_index_type_name(AnnIndexType type);

struct AnnBuildOptions {
  // FAISS's own index_factory string: "Flat", "HNSW32", "IVF4096,Flat", "IVF256,PQ16",
  // "OPQ16,IVF256,PQ16", ... (HNSW with flat storage, IVF with any encoding FAISS offers, with or
  // without a pre-transform); "flat" and "hnsw" are aliases of "Flat" and "HNSW<hnsw_m>".
  std::string index_type = "Flat";
  int hnsw_m = 32;           // the "hnsw" alias: links per node (memory and recall grow with it)
  int ef_construction = 80;  // HNSW: candidate list size while building (build time vs quality)
  // Types that learn from the data (IVF's lists, PQ's codebooks, OPQ's rotation): how many of the
  // first vectors added are held back to train on. 0: 64 per IVF list (FAISS advises 30 to 256
  // per centroid). A stream shorter than this trains on all of it when train() runs.
  int64_t train_size = 0;
};

// What an index row stands for; returned with search hits.
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

// A value of a catalog field, as a filter compares it: JSON strings, numbers (integers compare as
// doubles) and booleans. Other JSON values (null, arrays, objects) match no condition.
using AnnFieldValue = std::variant<std::string, double, bool>;

// One condition on a catalog field (AnnItem::fields): the field holds one of `any_of` (equality is
// a set of one; an empty set matches nothing), or a number within the bounds set. Items without
// the field never match.
struct AnnFilterCondition {
  std::string field;
  std::vector<AnnFieldValue> any_of{};  // used when no bound is set
  std::optional<double> gt{}, gte{}, lt{}, lte{};
  bool is_range() const { return gt || gte || lt || lte; }
};

// Every condition must hold (an empty filter matches every item).
struct AnnFilter {
  std::vector<AnnFilterCondition> all_of;
  bool empty() const { return all_of.empty(); }
};

// Search-time settings of one search() call.
struct AnnSearchOptions {
  int ef_search = 64;  // HNSW: candidate list size (recall vs speed; raised to k); others ignore it
  int nprobe = 16;     // IVF: lists scanned per query (capped at the list count); others ignore it
  // Only items the filter matches are returned (null or empty: all); see search().
  const AnnFilter* filter = nullptr;
};

class AnnIndex {
 public:
  // An empty index for `dim`-wide vectors. Throws moe::Error on invalid options, naming the
  // index_type and FAISS's reason (an unknown string, a PQ size that does not divide dim, a kind
  // not listed in AnnBuildOptions).
  static AnnIndex create(int dim, const AnnBuildOptions& options);
  // Reads PATH and PATH.items.jsonl and checks that they agree (counts, and the FAISS file's
  // CRC-32 where the table records it; see save() for the recovery of an interrupted save), then
  // replays PATH.journal (attach_journal). Throws moe::Error naming the file and the reason
  // (FAISS's own message for an unreadable index, the line for a bad item, a pair that does not
  // match, a journal newer than the pair).
  // The item table's text is parsed by parse_ann_item_table (moe/catalog.h), which needs no FAISS.
  static AnnIndex load(const std::string& path);

  AnnIndex(AnnIndex&&) noexcept;
  AnnIndex& operator=(AnnIndex&&) noexcept;
  ~AnnIndex();

  // Appends n vectors (row-major n x dim) and their items (items.size() == n). An index that must
  // be trained holds the vectors back until train_size of them have come, then trains on them and
  // adds them (train() does it sooner). Throws moe::Error once a journal is attached (use upsert).
  void add(const float* vectors, int64_t n, const std::vector<AnnItem>& items);
  // Trains an untrained index on the vectors add() holds back and adds them; nothing when it is
  // trained. Throws moe::Error when there are too few to train on (fewer than the IVF lists: the
  // message suggests a list count for them) or FAISS refuses them.
  void train();
  bool is_trained() const;

  // Trains (train()) if needed, then writes PATH and PATH.items.jsonl, crash-consistently as a
  // pair: both are written and flushed to disk as PATH.new and PATH.items.jsonl.new, then renamed
  // into place (the table first); the table's header holds the pair's generation and the FAISS
  // file's CRC-32. A save cut short before the first rename leaves the old pair; one cut between
  // the renames is finished by the next load(), which takes PATH.new when PATH does not match the
  // table. Searches go on while it writes; updates wait. Throws moe::Error naming the file.
  void save(const std::string& path);

  // The best min(k, matching items) hits for each of the n queries (row-major n x dim), best
  // first; rows deleted by live updates are never among them, nor counted as matching. k must be
  // >= 1. Safe to call from several threads at once; HNSW searches of one index are serialised,
  // the others run concurrently. FAISS parallelises each batch over its OpenMP threads. Throws
  // moe::Error naming the cause (an index still holding vectors back to train).
  //
  // Approximate types may find fewer than k without a filter (HNSW returns at most ef_search; an
  // IVF search, what its nprobe lists hold). With a filter, FAISS's ID selector restricts the
  // search to the matching rows; whenever it then finds fewer than min(k, matching) hits, the
  // query is searched again exhaustively over the matching rows (IVF: every list; HNSW: its flat
  // storage), so that k hits come back whenever k items match. HNSW applies a selector only to
  // the results of its graph walk, so a filter matching few rows (at most kExactFilterRows, or
  // under 1 in 1000) goes straight to the exact search over them, and otherwise ef is raised by
  // the inverse of the matching fraction (up to kMaxFilteredEf) for that search.
  std::vector<std::vector<AnnHit>> search(const float* queries, int64_t n, int k,
                                          const AnnSearchOptions& options = {}) const;
  static constexpr int64_t kExactFilterRows = 8192;
  static constexpr int kMaxFilteredEf = 4096;

  // Live updates (ann-query allow-updates), on a built (trained) index in host memory. Items are
  // addressed by their catalog id (AnnItem::id), unique among the live items. Safe while other
  // threads search: searches share a lock that an update holds alone for the moment it changes the
  // index, so a search sees the index before or after an update, never half of one. Rows keep
  // their numbers: an update only appends rows, a deleted row (a tombstone) is never returned by
  // search() or matching() again, and item() still describes it (a hit found just before a
  // concurrent remove stays readable). Tombstones are kept by every type, saved in the item table
  // as deleted rows and read back by load(); nothing compacts them (rebuild the index for that).
  // Both throw moe::Error naming the cause: an index still training, a device-resident index
  // (place_on a device: not supported on a device-resident index), a journal write that failed
  // (the update is then not applied).
  //
  // Upserts `vector` (width floats, width == dim()) as `item`: a live row holding item.id is
  // deleted and the new row appended. Returns the new row. Throws also for a width other than
  // dim(), a non-finite component, or an empty id.
  int64_t upsert(const float* vector, int64_t width, const AnnItem& item);
  // Deletes the live rows holding these ids; returns how many rows were deleted (unknown ids are
  // skipped; an index built with repeated ids deletes every live row of one).
  int64_t remove(const std::vector<std::string>& ids);
  // The live row holding catalog id `id` (the last added, for repeated ids), or -1.
  int64_t find(const std::string& id) const;
  // Rows live (size() minus the tombstones).
  int64_t live_size() const;

  // Crash-consistent persistence of live updates (single writer per PATH). After
  // attach_journal(PATH), every upsert() and remove() that changes the index is appended to
  // PATH.journal as a checksummed record (format: docs/model-formats.md) and flushed to disk
  // (fdatasync) before it is applied and returns; add() then throws (it is not journaled). When
  // PATH does not hold this index's current state (it was not loaded from or saved to PATH, or
  // changed since without this journal), attach_journal saves it to PATH first; a torn record at
  // the journal's end (a crash mid-append: never acknowledged) is cut off. load(PATH) replays the
  // journal's complete records over the saved pair, in order (each is an upsert or delete by id,
  // so the state is the same however often one is applied). save(PATH) writes the new pair under
  // a higher generation, and only once it is durable starts an empty journal of that generation;
  // load() ignores a journal of an older generation, whose records the pair already holds. So a
  // kill at any moment leaves load(PATH) every acknowledged update and at most the one in flight.
  // Throws moe::Error naming the file and the reason.
  void attach_journal(const std::string& path);

  // The live rows whose fields `filter` matches, ascending (an empty filter: every live row).
  std::vector<int64_t> matching(const AnnFilter& filter) const;

  // Where search() runs: "cpu" (the default: FAISS), "cuda:N", or "auto" (cuda:0 when a usable
  // CUDA device exists, else FAISS on the CPU). On a CUDA device the vectors of a flat index are
  // copied to device memory once (a GPU-resident index) and every search is the exact
  // inner-product top-k there (Backend::inner_product_topk: k ≤ 1024; the hits equal FAISS's
  // flat search up to float rounding, ties to the lower item); deleted rows are fetched and
  // dropped while k + their count is at most 1024. Filtered searches, and those of an index with
  // more deleted rows, run on the CPU copy, through FAISS's selector. HNSW and IVF indexes are
  // searched by FAISS on the CPU: a CUDA device is an error for them, and "auto" chooses the CPU.
  // Returns the device chosen ("cpu" or "cuda:N"). A placed index takes no live updates.
  // Call after the last add(); add() afterwards throws. Throws moe::Error naming the device and
  // the reason (no usable CUDA device, an index that is not flat, out of device memory).
  std::string place_on(const std::string& device);
  // The same on a backend the caller opened (any backend: the tests run this path on the CPU
  // backend); `mutex` is held around each search on it (null: none, for host-memory backends).
  void place_on(std::shared_ptr<kernels::Backend> backend, std::shared_ptr<std::mutex> mutex);

  int dim() const { return dim_; }
  // Rows: items added, including any held back for training and deleted rows.
  int64_t size() const;
  AnnIndexType type() const { return type_; }
  // The index_factory string it was made with ("IVF256,PQ16"); for an index loaded from a table
  // without one, "Flat" or "HNSW<M>" as read from the FAISS file.
  const std::string& factory() const { return factory_; }
  // IVF: the number of lists (the most nprobe can usefully be); 0 for other types.
  int64_t nlist() const;
  // The item at row i (a deleted row's item: see upsert()); throws moe::Error when i is out of
  // range. The reference stays valid while the index lives (rows are never moved).
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
  AnnIndex(std::unique_ptr<faiss::Index> index, AnnIndexType type, std::string factory, int dim);
  std::vector<std::vector<AnnHit>> search_filtered(const float* unit, int64_t n, int k,
                                                   const AnnSearchOptions& options) const;
  // The unlocked halves of the public calls (the caller holds the locks they need).
  int64_t rows() const { return static_cast<int64_t>(items_.size()); }
  std::vector<int64_t> live_matching(const AnnFilter& filter) const;
  int64_t apply_upsert(const float* vector, const AnnItem& item);
  int64_t apply_remove(const std::vector<std::string>& ids);
  void train_pending();
  void save_pair(const std::string& path);
  void replay_journal(const std::string& path, uint64_t generation);

  std::unique_ptr<faiss::Index> index_;
  AnnIndexType type_;
  std::string factory_;
  int dim_;
  int64_t train_size_ = 0;      // rows to hold back before training (untrained types)
  std::vector<float> pending_;  // unit vectors held back for training, row-major
  struct FieldColumns;          // the items' fields as columns, parsed at the first filtered search
  std::unique_ptr<FieldColumns> columns_;
  std::deque<AnnItem> items_;  // a deque: item() references survive appends
  std::optional<AnnProvenance> provenance_;
  std::unique_ptr<std::mutex> search_mutex_;  // HNSW: guards hnsw.efSearch (see search())
  struct DeviceVectors;                       // the vectors in a backend's memory (place_on)
  std::unique_ptr<DeviceVectors> device_;
  struct Live;  // tombstones, the id lookup, the update locks and the journal
  std::unique_ptr<Live> live_;
};

}  // namespace moe
