/**
 * SECTION:element-ann-query
 * @title: ann-query
 * @see_also: moe-expert, moe-catalog-src, zmq-publish
 *
 * ann-query answers embedded requests from a FAISS index, or builds that index.
 *
 * With mode=search (the default) it loads the index named by `index` (and its item table,
 * INDEX.items.jsonl) when it starts, searches every row of each tensor batch in one call (on the
 * CPU with FAISS, or GPU-resident with `device`) and sends one application/json result document
 * per request with its k nearest catalog items (cosine similarity; `k`, or the request's own
 * "k"; each hit with the item's catalog id and fields, its uri served under `uri-base` when set). A
 * request that failed upstream gets an error document, and so does a request encoded by another
 * encoder or adapter than the ones the index records (their fingerprints). The search-time knobs
 * `nprobe` (IVF lists scanned) and `ef-search` (HNSW candidates) may change while PLAYING, and a
 * request may set its own ("nprobe", "ef_search") and carry a "filter" on the catalog fields: only
 * matching items are returned, k of them whenever k match (docs/zmq-schema.md).
 *
 * With mode=build it adds every row to a new index (the request's id, uri, text and catalog fields
 * become the item; a row whose id is already in the index gets a duplicate_id error document
 * naming both uris instead), of `index-type` (FAISS's index_factory string: "Flat", "HNSW32",
 * "IVF4096,Flat", "IVF256,PQ16", "OPQ16,IVF256,PQ16"; "flat" and "hnsw" are aliases of "Flat" and
 * "HNSW<hnsw-m>"), and at end of stream writes INDEX and
 * INDEX.items.jsonl, recording the encoder and adapter of its rows, then sends the error documents
 * of the build's failed requests and one index-built document. Rows from other models than the
 * first rows' stop the build. Types that learn from the data (IVF, PQ, OPQ) train on the first
 * `train-size` rows (default 64 per IVF list, as FAISS advises 30 to 256; fewer when the stream is
 * shorter); a build with fewer rows than lists fails at end of stream, naming a list count that
 * fits, rather than silently writing another index than the one asked for. docs/zmq-schema.md
 * describes the documents.
 *
 * A build reports its progress on the bus: every `progress-items` requests a GST_MESSAGE_PROGRESS
 * with code "index-build" (start, then continue), and at end of stream a last one (complete, or
 * error when nothing is written) whose text names each failed item and its reason; gst-launch-1.0
 * prints them. Their structures carry done, added, failed, total (the items upstream announces as
 * its duration in GST_FORMAT_DEFAULT, as moe-catalog-src does; -1 unknown), rate (items/s),
 * eta-s (-1 unknown), elapsed-s and, with a total, percent.
 *
 * Vectors from elsewhere (NNStreamer, an ONNX model, an application's appsrc) are searched too:
 * a buffer without gst-moe's request meta is rows of float32 vectors, each a request of its own
 * (modality "tensor", id "0", "1", ... counted over the element's life, the buffer's PTS as its
 * pts_ns). Besides application/x-moe-tensor (dtype=f32, width=W), the sink takes NNStreamer's
 * other/tensors (format=static, num_tensors=1, types=float32, dimensions=W:R, innermost first: R
 * rows of W) and other/tensor (type=float32, dimension=W:R). Other types, formats, several
 * tensors, or a dimension string that is not W[:R...] within bounds (W up to 65536) are refused
 * at caps time with an error naming the caps field, and so is a width other than the index's.
 *
 * Hybrid requests (an image with a text) normally reach ann-query fused by moe-route; one that
 * arrives unfused (no adapter in the pipeline, e.g. ADAPTER=none) is searched as the plain average
 * of its two embeddings, each normalised, and its result document says so ("fusion", method
 * "average").
 *
 * Live updates: with `allow-updates` the element applies catalog upserts (rows whose vector is the
 * new item's) and deletes to the index it searches, journals each beside it (INDEX.journal, on
 * disk before the answer) and answers each with an "update" document; `snapshot-interval` writes
 * the index anew every so many updates (and at stop), which empties the journal. Without it every
 * update is answered with an "updates_disabled" error document.
 *
 * Hot swap: setting `index` while searching loads the new index in the background; the old one
 * keeps answering the rows of its models until rows of the new one's come (docs/architecture.md,
 * "Hot swap", for the order in which to swap the index and the adapter).
 *
 * The `stats` property counts, since the element started, the requests received, the result and
 * error documents sent, the requests refused for their models, the rows added to a build, the
 * batches, the time spent searching, the updates applied and refused, and the swaps (with the
 * index in use); in a build also its progress (total, rate, eta-s).
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 moe-catalog-src location=models/default/catalog \
 *     ! moe-encode model=models/default/clip max-batch=32 \
 *     ! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter \
 *     ! ann-query mode=build index=build/demo/catalog.faiss ! fakesink
 * ]| Builds the demo catalog's index.
 * |[
 * gst-launch-1.0 zmq-query ! queue ! moe-encode model=models/default/clip \
 *     ! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter \
 *     ! ann-query index=build/demo/catalog.faiss k=5 ! zmq-publish
 * ]| Answers ZeroMQ requests with their 5 nearest catalog items.
 * |[
 * echo -n "red striped mug" > /tmp/query.txt
 * gst-launch-1.0 filesrc location=/tmp/query.txt ! text/x-raw,format=utf8 \
 *     ! moe-encode model=models/default/clip ! moe-route model=models/default/adapter \
 *     ! moe-expert model=models/default/adapter ! filesink location=/tmp/queries.f32
 * gst-launch-1.0 filesrc location=/tmp/queries.f32 blocksize=512 \
 *     ! 'other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)128:1' \
 *     ! ann-query index=build/demo/catalog.faiss k=3 ! filesink location=/dev/stdout
 * ]| Writes a query's 128-wide float32 vector to a file, then searches the file's vectors (any
 * producer's: numpy's tofile(), NNStreamer's tensor_sink, ...) as NNStreamer would send them,
 * without gst-moe's meta: one result document per vector, modality "tensor".
 */

/* Each output buffer carries a GstMoeBatchMeta with exactly the request it answers (one row, or
 * one failed entry), so downstream elements can route per request. An input buffer without a meta
 * gets its request records made here (plain_batch); the meta is an optimisation that carries ids,
 * routing and timings from upstream, not a requirement. The index-built summary is
 * not a request and carries no meta.
 *
 * Provenance: vectors are comparable only when the same encoder and adapter made them, and the
 * width alone cannot tell (two CLIPs of one width, an adapter or none). A build records the
 * models of its first rows (the meta's fingerprints) in the item table and stops with an error
 * on rows from other models. A search answers every request whose models differ from those the
 * index records with an error document; an index without provenance is searched unchecked.
 *
 * Threads: the streaming thread searches and applies updates; a swap's index loads on a thread of
 * its own (IndexLoader) and joins the indexes held under serving_mutex, which the streaming thread
 * holds for each batch, so a batch is answered by one set of indexes. moe::AnnIndex's own locks
 * let its searches and updates overlap; here they take turns on the streaming thread anyway.
 *
 * The documents are written by gstmoeresult.h. */
#include "gstannquery.h"

#include <glib/gstdio.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gstmoemeta.h"
#include "gstmoemetrics.h"
#include "gstmoeresult.h"
#include "moe/ann_index.h"
#include "moe/error.h"

GST_DEBUG_CATEGORY_STATIC(gst_ann_query_debug);
#define GST_CAT_DEFAULT gst_ann_query_debug

#define STAGE_NAME "ann-query"

enum {
  PROP_0,
  PROP_INDEX,
  PROP_K,
  PROP_MODE,
  PROP_INDEX_TYPE,
  PROP_HNSW_M,
  PROP_EF_CONSTRUCTION,
  PROP_EF_SEARCH,
  PROP_NPROBE,
  PROP_TRAIN_SIZE,
  PROP_DEVICE,
  PROP_URI_BASE,
  PROP_PROGRESS_ITEMS,
  PROP_ALLOW_UPDATES,
  PROP_SNAPSHOT_INTERVAL,
  PROP_STATS,
};

#define DEFAULT_INDEX nullptr
#define DEFAULT_K 10
#define MAX_K 1024  // also the most a request's own "k" may ask for
#define DEFAULT_MODE GST_ANN_QUERY_MODE_SEARCH
#define DEFAULT_INDEX_TYPE "flat"
#define DEFAULT_HNSW_M 32
#define DEFAULT_EF_CONSTRUCTION 80
#define DEFAULT_EF_SEARCH 64
#define DEFAULT_NPROBE 16
#define DEFAULT_TRAIN_SIZE 0
#define DEFAULT_DEVICE "cpu"
#define DEFAULT_PROGRESS_ITEMS 32
#define DEFAULT_ALLOW_UPDATES FALSE
#define DEFAULT_SNAPSHOT_INTERVAL 0
#define PROGRESS_CODE "index-build"
#define INDEX_MESSAGE "ann-query-index"  // element message: an index loaded by a swap, or retired

namespace {

// Failed items the build summary names (it counts all of them; their error documents list all).
constexpr size_t kMaxNamedFailures = 50;

// An index that answers searches, with what serving it needs.
struct ServedIndex {
  explicit ServedIndex(moe::AnnIndex loaded) : index(std::move(loaded)) {}
  moe::AnnIndex index;
  std::string path;              // as set in `index`
  std::string name;              // its basename, for the result documents
  std::shared_ptr<void> memory;  // a flat index: its vectors in the metrics
  std::string uri_folder;        // the items' common uri folder, which uri-base replaces
  bool journaled = false;        // allow-updates: updates are journaled beside `path`
  uint64_t unsaved = 0;          // updates applied since the index was last written
};

// What loading an index for searching needs, fixed at start.
struct ServeSettings {
  std::string device;    // `device`
  std::string uri_base;  // `uri-base`, "" to serve uris as built
  bool allow_updates = false;
};

// Why an index could not be loaded for searching.
struct LoadFailure {
  bool device = false;  // it loaded, but cannot be searched on the device
  std::string message;  // names the file or the device, and the reason
};

// Runs the latest requested load on a thread of its own, one at a time: a request made while one
// runs waits for it, and replaces any earlier request still waiting.
class IndexLoader {
 public:
  explicit IndexLoader(std::function<void(const std::string&)> load)
      : load_(std::move(load)), thread_([this] { run(); }) {}
  IndexLoader(const IndexLoader&) = delete;
  IndexLoader& operator=(const IndexLoader&) = delete;
  // Waits for a load under way (FAISS cannot cancel one); drops a request not started.
  ~IndexLoader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void request(const std::string& path) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      requested_ = path;
    }
    wake_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      std::string path;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || requested_.has_value(); });
        if (stopping_) return;
        path = std::move(*requested_);
        requested_.reset();
      }
      load_(path);
    }
  }

  std::function<void(const std::string&)> load_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::optional<std::string> requested_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// What one run works with: created by start() (READY->PAUSED), destroyed by stop()
// (PAUSED->READY); only the streaming thread touches it while the pads are active, except
// `serving` and `width` in search mode, which a swap's loader thread adopts into under
// `serving_mutex`.
struct AnnQueryState {
  GstAnnQueryMode mode = DEFAULT_MODE;
  std::string index_path;              // as set in `index` at start
  moe::AnnBuildOptions build;          // build mode
  std::optional<moe::AnnIndex> index;  // build mode: created at the first caps
  std::string index_name;              // basename of index_path, for the result documents
  ServeSettings serve;                 // search mode
  // Search mode: the indexes answering, oldest first: the one in use and, after a swap until rows
  // of the new one's models come, the previous one (for rows of its models). Never empty.
  std::mutex serving_mutex;
  std::vector<std::unique_ptr<ServedIndex>> serving;
  int width = 0;                                 // negotiated tensor width; 0 before caps
  int64_t build_failed = 0;                      // build mode: error documents sent
  std::optional<moe::AnnProvenance> built_from;  // build mode: the models of the first rows
  bool build_refused = false;                    // build mode: rows from other models came; not written
  bool mismatch_logged = false;                  // search mode: the first refused batch was logged
  bool unchecked_logged = false;                 // search mode: the first batch of unknown origin was logged
  // Build mode: id -> uri of the items added, to refuse a second item with one of their ids.
  std::unordered_map<std::string, std::string> built_uris;
  // Build mode: progress. Error documents wait for EOS (see finish_build).
  int64_t build_start_us = 0;  // monotonic, when the element started
  int64_t total = -1;          // requests upstream announced (duration in items), -1: unknown
  bool total_queried = false;  // asked upstream once, at the first buffer
  guint progress_items = DEFAULT_PROGRESS_ITEMS;
  uint64_t done = 0;                       // requests taken: rows added or failed
  uint64_t progress_posted = 0;            // `done` at the last progress message
  std::vector<std::string> failure_lines;  // "<file>: <reason> [<code>]", the first kMaxNamedFailures
  GstBufferList* held_errors = gst_buffer_list_new();
  // The caps last refused (their error is posted): upstream retries a refused sticky caps event
  // before each buffer and event, and one error says it all.
  GstCaps* refused_caps = nullptr;
  // Search mode: loads the index of a swap (`index` set while running); made at the first one.
  std::unique_ptr<IndexLoader> loader;

  AnnQueryState() = default;
  AnnQueryState(const AnnQueryState&) = delete;
  AnnQueryState& operator=(const AnnQueryState&) = delete;
  ~AnnQueryState() {
    loader.reset();  // before `serving`, which its thread adopts into
    gst_buffer_list_unref(held_errors);
    gst_caps_replace(&refused_caps, nullptr);
  }
};

// Where an index build stands, for its progress messages and `stats`.
struct BuildProgress {
  uint64_t done = 0, added = 0, failed = 0;
  int64_t total = -1;    // -1: unknown
  double elapsed_s = 0;  // since the element started
  double rate = 0;       // requests per second so far
  double eta_s = -1;     // -1: unknown (no total, or nothing done yet)
};

}  // namespace

struct _GstAnnQuery {
  GstElement parent;
  GstPad* sinkpad;
  GstPad* srcpad;

  // Properties, under the object lock. The ones marked MUTABLE_READY are read at READY->PAUSED,
  // k, ef-search and nprobe at every batch.
  gchar* index_path;
  guint k;
  GstAnnQueryMode mode;
  gchar* index_type;
  guint hnsw_m;
  guint ef_construction;
  guint ef_search;
  guint nprobe;
  guint train_size;
  gchar* device;
  gchar* uri_base;
  guint progress_items;
  gboolean allow_updates;
  guint snapshot_interval;

  // Behind `stats`, under the object lock: reset at start, kept after stop.
  guint64 requests;         // rows and failed requests received
  guint64 results;          // result documents sent
  guint64 errors;           // error documents sent
  guint64 refused;          // requests refused because other models made them
  guint64 added;            // rows added to the index being built
  guint64 batches;          // tensor buffers received
  gdouble search_ms;        // time spent in index searches
  guint64 updates;          // catalog updates applied
  guint64 updates_refused;  // catalog updates answered with an error document
  guint64 swaps;            // indexes swapped in while running
  guint64 swap_failures;    // swaps whose index could not be loaded (the one in use stays)
  gchar* serving_index;     // the index in use (the newest loaded)
  gchar* previous_index;    // after a swap, the one kept for rows of its models; nullptr when none
  BuildProgress progress;   // build mode
  // The id of the next row that arrives without a request meta, counted over the element's life
  // (streaming thread only), so ids stay unique across restarts.
  guint64 next_id;

  // Between start() and stop(), nullptr otherwise (see AnnQueryState).
  AnnQueryState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_OPEN_TENSOR_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_JSON_CAPS));

GType gst_ann_query_mode_get_type(void) {
  static GType type = 0;
  static const GEnumValue values[] = {
      {GST_ANN_QUERY_MODE_SEARCH, "Answer each request with its nearest catalog items", "search"},
      {GST_ANN_QUERY_MODE_BUILD, "Add every row to a new index, written at EOS", "build"},
      {0, nullptr, nullptr},
  };
  if (g_once_init_enter(&type)) {
    GType t = g_enum_register_static("GstAnnQueryMode", values);
    g_once_init_leave(&type, t);
  }
  return type;
}

#define gst_ann_query_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstAnnQuery, gst_ann_query, GST_TYPE_ELEMENT,
                        GST_DEBUG_CATEGORY_INIT(gst_ann_query_debug, "ann-query", 0, "ANN search and index build"));
GST_ELEMENT_REGISTER_DEFINE(ann_query, "ann-query", GST_RANK_NONE, GST_TYPE_ANN_QUERY)

/* ---- properties ------------------------------------------------------------------------ */

static void swap_in(GstAnnQuery* self, AnnQueryState& s, const std::string& path);

// `index` set while a search runs: loads it in the background (swap_in). Object lock held.
static void request_swap(GstAnnQuery* self, const gchar* path) {
  AnnQueryState* s = self->state;
  if (!s || s->mode != GST_ANN_QUERY_MODE_SEARCH || !path || !*path) return;
  if (!s->loader) s->loader = std::make_unique<IndexLoader>([self, s](const std::string& p) { swap_in(self, *s, p); });
  s->loader->request(path);
}

static void gst_ann_query_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstAnnQuery* self = GST_ANN_QUERY(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_INDEX:
      g_free(self->index_path);
      self->index_path = g_value_dup_string(value);
      request_swap(self, self->index_path);
      break;
    case PROP_K:
      self->k = g_value_get_uint(value);
      break;
    case PROP_MODE:
      self->mode = static_cast<GstAnnQueryMode>(g_value_get_enum(value));
      break;
    case PROP_INDEX_TYPE: {
      const gchar* type = g_value_get_string(value);
      g_free(self->index_type);
      self->index_type = g_strdup(type ? type : DEFAULT_INDEX_TYPE);
      break;
    }
    case PROP_HNSW_M:
      self->hnsw_m = g_value_get_uint(value);
      break;
    case PROP_EF_CONSTRUCTION:
      self->ef_construction = g_value_get_uint(value);
      break;
    case PROP_EF_SEARCH:
      self->ef_search = g_value_get_uint(value);
      break;
    case PROP_NPROBE:
      self->nprobe = g_value_get_uint(value);
      break;
    case PROP_TRAIN_SIZE:
      self->train_size = g_value_get_uint(value);
      break;
    case PROP_DEVICE: {
      const gchar* device = g_value_get_string(value);
      g_free(self->device);
      self->device = g_strdup(device ? device : DEFAULT_DEVICE);
      break;
    }
    case PROP_URI_BASE:
      g_free(self->uri_base);
      self->uri_base = g_value_dup_string(value);
      break;
    case PROP_PROGRESS_ITEMS:
      self->progress_items = g_value_get_uint(value);
      break;
    case PROP_ALLOW_UPDATES:
      self->allow_updates = g_value_get_boolean(value);
      break;
    case PROP_SNAPSHOT_INTERVAL:
      self->snapshot_interval = g_value_get_uint(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

static void gst_ann_query_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstAnnQuery* self = GST_ANN_QUERY(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_INDEX:
      g_value_set_string(value, self->index_path);
      break;
    case PROP_K:
      g_value_set_uint(value, self->k);
      break;
    case PROP_MODE:
      g_value_set_enum(value, self->mode);
      break;
    case PROP_INDEX_TYPE:
      g_value_set_string(value, self->index_type);
      break;
    case PROP_HNSW_M:
      g_value_set_uint(value, self->hnsw_m);
      break;
    case PROP_EF_CONSTRUCTION:
      g_value_set_uint(value, self->ef_construction);
      break;
    case PROP_EF_SEARCH:
      g_value_set_uint(value, self->ef_search);
      break;
    case PROP_NPROBE:
      g_value_set_uint(value, self->nprobe);
      break;
    case PROP_TRAIN_SIZE:
      g_value_set_uint(value, self->train_size);
      break;
    case PROP_DEVICE:
      g_value_set_string(value, self->device);
      break;
    case PROP_URI_BASE:
      g_value_set_string(value, self->uri_base);
      break;
    case PROP_PROGRESS_ITEMS:
      g_value_set_uint(value, self->progress_items);
      break;
    case PROP_ALLOW_UPDATES:
      g_value_set_boolean(value, self->allow_updates);
      break;
    case PROP_SNAPSHOT_INTERVAL:
      g_value_set_uint(value, self->snapshot_interval);
      break;
    case PROP_STATS:
      g_value_take_boxed(
          value, gst_structure_new(
                     "ann-query-stats", "requests", G_TYPE_UINT64, self->requests, "results", G_TYPE_UINT64,
                     self->results, "errors", G_TYPE_UINT64, self->errors, "refused", G_TYPE_UINT64, self->refused,
                     "added", G_TYPE_UINT64, self->added, "batches", G_TYPE_UINT64, self->batches, "search-ms",
                     G_TYPE_DOUBLE, self->search_ms, "updates", G_TYPE_UINT64, self->updates, "updates-refused",
                     G_TYPE_UINT64, self->updates_refused, "swaps", G_TYPE_UINT64, self->swaps, "swap-failures",
                     G_TYPE_UINT64, self->swap_failures, "index", G_TYPE_STRING, self->serving_index, "previous-index",
                     G_TYPE_STRING, self->previous_index, "total", G_TYPE_INT64, self->progress.total, "rate",
                     G_TYPE_DOUBLE, self->progress.rate, "eta-s", G_TYPE_DOUBLE, self->progress.eta_s, nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

/* ---- state ----------------------------------------------------------------------------- */

// Loads the index at `path` for searching: places it on the device, finds the folder uri-base
// replaces and, when updates are allowed, attaches its journal (PATH.journal). Throws LoadFailure.
static std::unique_ptr<ServedIndex> load_served(GstAnnQuery* self, const ServeSettings& settings,
                                                const std::string& path) {
  std::unique_ptr<ServedIndex> served;
  try {
    served = std::make_unique<ServedIndex>(moe::AnnIndex::load(path));
  } catch (const moe::Error& e) {
    throw LoadFailure{false, e.what()};
  }
  moe::AnnIndex& index = served->index;
  served->path = path;
  gchar* base = g_path_get_basename(path.c_str());
  served->name = base;
  g_free(base);
  std::string searched_on;
  try {
    searched_on = index.place_on(settings.device);
  } catch (const moe::Error& e) {  // names the device and the reason
    throw LoadFailure{true,
                      "cannot search the ANN index '" + path + "' on device '" + settings.device + "': " + e.what()};
  }
  if (settings.allow_updates && searched_on != "cpu")  // the engine updates host-memory indexes only
    throw LoadFailure{true, "allow-updates needs the ANN index '" + path + "' in host memory, but device '" +
                                settings.device + "' placed it on " + searched_on + ": use device=cpu to update it"};
  if (settings.allow_updates) {
    try {
      index.attach_journal(path);
      served->journaled = true;
    } catch (const moe::Error& e) {
      throw LoadFailure{false, "cannot journal updates of '" + path + "': " + e.what()};
    }
  }
  GST_INFO_OBJECT(self, "loaded %s: %" G_GINT64_FORMAT " items, dimension %d, %s (%s), searched on %s%s%s",
                  path.c_str(), index.live_size(), index.dim(), index.factory().c_str(),
                  moe::ann_index_type_name(index.type()), searched_on.c_str(),
                  searched_on == "cpu" ? " (FAISS)" : " (GPU-resident, exact; filtered requests: FAISS)",
                  served->journaled ? ", updates journaled" : "");
  if (settings.device == "auto" && searched_on == "cpu" && index.type() != moe::AnnIndexType::Flat)
    GST_INFO_OBJECT(self, "device auto: %s is searched by FAISS on the CPU (the GPU path is for flat indexes)",
                    index.factory().c_str());
  if (index.type() == moe::AnnIndexType::Flat)  // an HNSW graph's size is not known
    served->memory = gstmoe::metrics::hold_device_memory(
        "index", searched_on, static_cast<uint64_t>(index.size()) * index.dim() * sizeof(float));
  if (index.provenance())
    GST_INFO_OBJECT(self, "%s was built from %s", path.c_str(), index.provenance()->describe().c_str());
  else
    GST_INFO_OBJECT(self,
                    "%s records no provenance (written before gst-moe recorded it, or from vectors of unknown "
                    "origin): queries cannot be checked against the encoder and adapter that built it; "
                    "rebuild it to enable the check",
                    path.c_str());
  if (index.live_size() == 0) GST_WARNING_OBJECT(self, "index '%s' is empty: results will be empty", path.c_str());
  if (!settings.uri_base.empty()) {
    served->uri_folder = index.uri_folder();
    if (served->uri_folder.empty())
      GST_WARNING_OBJECT(self, "uri-base '%s' is not used: the uris of '%s' share no folder", settings.uri_base.c_str(),
                         path.c_str());
    else
      GST_INFO_OBJECT(self, "serving uris under %s as %s", served->uri_folder.c_str(), settings.uri_base.c_str());
  }
  return served;
}

// Writes `served` and its item table, which empties its journal (snapshot-interval, and at stop).
static void save_served(GstAnnQuery* self, ServedIndex& served) {
  try {
    served.index.save(served.path);
    served.unsaved = 0;
    GST_INFO_OBJECT(self, "wrote %s with its updates (%" G_GINT64_FORMAT " items)", served.path.c_str(),
                    served.index.live_size());
  } catch (const moe::Error& e) {  // the journal still holds the updates
    GST_ELEMENT_WARNING(self, RESOURCE, WRITE, ("%s", e.what()),
                        ("saving '%s' with its updates; they stay in its journal", served.path.c_str()));
  }
}

// Reads the properties and loads the index (search) or checks that it can be written (build).
static gboolean gst_ann_query_start(GstAnnQuery* self) {
  auto s = std::make_unique<AnnQueryState>();
  GST_OBJECT_LOCK(self);
  self->requests = self->results = self->errors = self->refused = self->added = self->batches = 0;
  self->updates = self->updates_refused = self->swaps = self->swap_failures = 0;
  self->search_ms = 0;
  self->progress = BuildProgress();
  s->mode = self->mode;
  s->progress_items = self->progress_items;
  s->build_start_us = g_get_monotonic_time();
  s->index_path = self->index_path ? self->index_path : "";
  s->build.index_type = self->index_type;
  s->build.train_size = self->train_size;
  s->build.hnsw_m = static_cast<int>(self->hnsw_m);
  s->build.ef_construction = static_cast<int>(self->ef_construction);
  s->serve.device = self->device;
  s->serve.uri_base = self->uri_base ? self->uri_base : "";
  s->serve.allow_updates = self->allow_updates;
  GST_OBJECT_UNLOCK(self);

  if (s->index_path.empty()) {
    GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND, ("No index file set"),
                      ("set the 'index' property to the FAISS file to %s",
                       s->mode == GST_ANN_QUERY_MODE_SEARCH ? "search" : "write"));
    return FALSE;
  }
  gchar* base = g_path_get_basename(s->index_path.c_str());
  s->index_name = base;
  g_free(base);

  if (s->mode == GST_ANN_QUERY_MODE_SEARCH) {
    try {
      s->serving.push_back(load_served(self, s->serve, s->index_path));
    } catch (const LoadFailure& f) {
      if (f.device)
        GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("%s", f.message.c_str()), (nullptr));
      else
        GST_ELEMENT_ERROR(self, RESOURCE, OPEN_READ, ("%s", f.message.c_str()),
                          ("loading the ANN index '%s'", s->index_path.c_str()));
      return FALSE;
    }
  } else {
    // Fail now rather than at EOS, after the whole catalog was encoded.
    gchar* dir = g_path_get_dirname(s->index_path.c_str());
    const bool writable = g_file_test(dir, G_FILE_TEST_IS_DIR) && g_access(dir, W_OK) == 0;
    if (!writable)
      GST_ELEMENT_ERROR(self, RESOURCE, OPEN_WRITE,
                        ("Cannot write the ANN index '%s': directory '%s' does not exist or is not writable",
                         s->index_path.c_str(), dir),
                        (nullptr));
    g_free(dir);
    if (!writable) return FALSE;
  }
  GST_OBJECT_LOCK(self);
  g_free(self->serving_index);
  self->serving_index = g_strdup(s->mode == GST_ANN_QUERY_MODE_SEARCH ? s->index_path.c_str() : nullptr);
  g_clear_pointer(&self->previous_index, g_free);
  self->state = s.release();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

// Drops the running state; a searched index with updates not yet written is saved, so that a
// clean stop leaves the pair whole and its journal empty.
static void gst_ann_query_stop(GstAnnQuery* self) {
  GST_OBJECT_LOCK(self);
  AnnQueryState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  if (!state) return;
  state->loader.reset();
  for (const std::unique_ptr<ServedIndex>& served : state->serving)
    if (served->journaled && served->unsaved > 0) save_served(self, *served);
  delete state;
}

static GstStateChangeReturn gst_ann_query_change_state(GstElement* element, GstStateChange transition) {
  GstAnnQuery* self = GST_ANN_QUERY(element);
  if (transition == GST_STATE_CHANGE_READY_TO_PAUSED && !gst_ann_query_start(self)) return GST_STATE_CHANGE_FAILURE;

  const GstStateChangeReturn ret = GST_ELEMENT_CLASS(parent_class)->change_state(element, transition);
  if (ret == GST_STATE_CHANGE_FAILURE) {
    if (transition == GST_STATE_CHANGE_READY_TO_PAUSED) gst_ann_query_stop(self);
    return ret;
  }
  if (transition == GST_STATE_CHANGE_PAUSED_TO_READY) gst_ann_query_stop(self);  // pads are inactive now
  return ret;
}

/* ---- output ---------------------------------------------------------------------------- */

// One application/json buffer holding `doc`, stamped like the input buffer it answers, or with
// the PTS of the request's own frame (`request`, when set: a batch buffer has its first frame's).
static GstBuffer* json_buffer(const std::string& doc, GstBuffer* in, const gstmoe::RequestRecord* request = nullptr) {
  GstBuffer* out = gst_buffer_new_memdup(doc.data(), doc.size());
  if (in) {
    GST_BUFFER_PTS(out) = GST_BUFFER_PTS(in);
    GST_BUFFER_DTS(out) = GST_BUFFER_DTS(in);
  }
  if (request && GST_CLOCK_TIME_IS_VALID(request->pts)) {
    GST_BUFFER_PTS(out) = request->pts;
    GST_BUFFER_DTS(out) = GST_CLOCK_TIME_NONE;
  }
  return out;
}

// A meta for one request of `batch`: the batch's model identifiers, no rows yet.
static gstmoe::BatchRecords models_of(const gstmoe::BatchRecords& batch) {
  gstmoe::BatchRecords single;
  single.encoder = batch.encoder;
  single.adapter = batch.adapter;
  single.encoder_fingerprint = batch.encoder_fingerprint;
  single.adapter_fingerprint = batch.adapter_fingerprint;
  return single;
}

// Adds a buffer with the error document of `failed` and a meta holding just that entry.
static void add_error_buffer(GstBufferList* list, gstmoe::FailedRequest failed, const gstmoe::BatchRecords& batch,
                             GstBuffer* in) {
  GstBuffer* out = json_buffer(gstmoe::error_document(failed), in, &failed.request);
  gstmoe::metrics::count_error(failed);
  gstmoe::BatchRecords single = models_of(batch);
  single.failed.push_back(std::move(failed));
  gst_buffer_add_moe_batch_meta(out, single);
  gst_buffer_list_add(list, out);
}

// Moves every row of `batch` to its failed list with `reason` and `code`.
static void fail_rows(gstmoe::BatchRecords& batch, const std::string& reason,
                      const char* code = moe::error_code::kInternal) {
  for (gstmoe::RequestRecord& row : batch.rows) batch.failed.push_back({std::move(row), STAGE_NAME, reason, code});
  batch.rows.clear();
}

/* ---- provenance ------------------------------------------------------------------------ */

// The models that made the rows of `batch`. moe-route names its adapter too (for routing
// messages), but only moe-expert changes the vectors and sets the fingerprint, so the adapter
// counts only with its fingerprint.
static moe::AnnProvenance provenance_of(const gstmoe::BatchRecords& batch) {
  const bool adapted = !batch.adapter_fingerprint.empty();
  return {batch.encoder, batch.encoder_fingerprint, adapted ? batch.adapter : "", batch.adapter_fingerprint};
}

// Search mode: the held index that answers the rows of `batch` (serving_mutex held): the newest
// whose provenance their models match (an index without provenance, and rows without an encoder
// fingerprint, which are not from moe-encode, match any). Null when none does, with `refusal`
// naming the newest index's models and theirs. Batches without rows get the newest.
static ServedIndex* index_for(GstAnnQuery* self, AnnQueryState& s, const gstmoe::BatchRecords& batch,
                              std::string* refusal) {
  ServedIndex& newest = *s.serving.back();
  if (batch.rows.empty()) return &newest;
  const moe::AnnProvenance query = provenance_of(batch);
  if (query.encoder_fingerprint.empty()) {
    if (!s.unchecked_logged && newest.index.provenance())
      GST_INFO_OBJECT(self,
                      "rows without an encoder fingerprint (not encoded by moe-encode): searched without "
                      "checking them against the provenance of '%s'",
                      newest.path.c_str());
    s.unchecked_logged = true;
    return &newest;
  }
  for (auto it = s.serving.rbegin(); it != s.serving.rend(); ++it) {
    const std::optional<moe::AnnProvenance>& built = (*it)->index.provenance();
    if (!built || built->same_models(query)) return it->get();
  }
  *refusal = "the index " + newest.path + " was built from " + newest.index.provenance()->describe() +
             ", but this query was encoded by " + query.describe() +
             ": rebuild the index with this pipeline or search it with the pipeline that built it";
  if (!s.mismatch_logged)
    GST_WARNING_OBJECT(self, "refusing queries (later batches are not logged): %s", refusal->c_str());
  s.mismatch_logged = true;
  return nullptr;
}

// Build mode: why the rows of `batch` may not join the index (empty: they may). The first rows
// fix the models; rows from others would put incomparable vectors in one index.
static std::string build_refusal(AnnQueryState& s, const gstmoe::BatchRecords& batch) {
  if (batch.rows.empty()) return {};
  const moe::AnnProvenance rows = provenance_of(batch);
  if (!s.built_from) s.built_from = rows;
  if (s.built_from->same_models(rows)) return {};
  return "rows from other models while building " + s.index_path + ": the rows added so far were encoded by " +
         s.built_from->describe() + ", but request '" + batch.rows.front().id + "' was encoded by " + rows.describe() +
         ": one index holds the vectors of one encoder and adapter";
}

/* ---- search mode ----------------------------------------------------------------------- */

// Searches every row of `batch` in one call and adds one result buffer per row to `list`.
// Returns the time the search took (ms; 0 when there was none, or it failed).
static double search_rows(GstAnnQuery* self, AnnQueryState& s, ServedIndex& served, gstmoe::BatchRecords& batch,
                          const float* vectors, GstBuffer* in, GstBufferList* list) {
  if (batch.rows.empty()) return 0;
  GST_OBJECT_LOCK(self);
  const int default_k = static_cast<int>(self->k);
  const int ef_search = static_cast<int>(self->ef_search);
  const int nprobe = static_cast<int>(self->nprobe);
  GST_OBJECT_UNLOCK(self);

  const size_t n = batch.rows.size();
  std::vector<int> ks(n);
  std::vector<moe::AnnSearchOptions> options(n);
  for (size_t i = 0; i < n; ++i) {
    const gstmoe::RequestRecord& row = batch.rows[i];
    ks[i] = row.k > 0 ? std::min(row.k, MAX_K) : default_k;
    options[i].ef_search = row.ef_search > 0 ? row.ef_search : ef_search;
    options[i].nprobe = row.nprobe > 0 ? row.nprobe : nprobe;
    options[i].filter = row.filter.empty() ? nullptr : &row.filter;
  }

  const int64_t start = g_get_monotonic_time();
  std::vector<std::vector<moe::AnnHit>> hits(n);
  try {
    // Rows without a filter and with the same knobs are searched in one call (FAISS batches them);
    // a filtered row is searched alone, with its own selector.
    std::vector<bool> searched(n, false);
    for (size_t i = 0; i < n; ++i) {
      if (searched[i]) continue;
      std::vector<size_t> group{i};
      for (size_t j = i + 1; j < n && !options[i].filter; ++j)
        if (!searched[j] && !options[j].filter && options[j].nprobe == options[i].nprobe &&
            options[j].ef_search == options[i].ef_search)
          group.push_back(j);
      int k_max = 0;
      std::vector<float> queries;
      queries.reserve(group.size() * static_cast<size_t>(s.width));
      for (size_t g : group) {
        searched[g] = true;
        k_max = std::max(k_max, ks[g]);
        queries.insert(queries.end(), vectors + g * static_cast<size_t>(s.width),
                       vectors + (g + 1) * static_cast<size_t>(s.width));
      }
      auto found = served.index.search(queries.data(), static_cast<int64_t>(group.size()), k_max, options[i]);
      for (size_t t = 0; t < group.size(); ++t) hits[group[t]] = std::move(found[t]);
    }
  } catch (const moe::Error& e) {
    GST_WARNING_OBJECT(self, "search failed: %s", e.what());
    fail_rows(batch, std::string("search in '") + served.path + "' failed: " + e.what());
    return 0;
  }
  const double search_ms = gstmoe::elapsed_ms(start, g_get_monotonic_time());
  const gstmoe::ModelIds model{batch.encoder, batch.adapter, served.name};

  for (size_t i = 0; i < batch.rows.size(); ++i) {
    gstmoe::RequestRecord& row = batch.rows[i];
    row.timings_ms.emplace_back("search", search_ms);
    std::vector<gstmoe::ResultHit> results;
    const size_t n = std::min(hits[i].size(), static_cast<size_t>(ks[i]));
    for (size_t j = 0; j < n; ++j) {
      const moe::AnnItem& item = served.index.item(hits[i][j].item);
      results.push_back({hits[i][j].item, item.id, moe::rebase_uri(item.uri, served.uri_folder, s.serve.uri_base),
                         item.caption, item.fields, hits[i][j].score});
    }
    const int64_t now = g_get_monotonic_time();
    GstBuffer* out = json_buffer(gstmoe::result_document(row, ks[i], results, model, now), in, &row);
    gstmoe::metrics::count_result(row, now);
    gstmoe::BatchRecords single = models_of(batch);
    single.rows.push_back(std::move(row));
    gst_buffer_add_moe_batch_meta(out, single);
    gst_buffer_list_add(list, out);
  }
  batch.rows.clear();
  return search_ms;
}

/* ---- hybrid rows and live updates ------------------------------------------------------- */

// A hybrid request's row that no moe-route fused (its text embedding still beside it: no adapter
// ran, e.g. ADAPTER=none) is searched as the plain average of its image and text embeddings, each
// L2-normalised first (CLIP's towers give embeddings of different norms, and the larger would
// outweigh the other), then normalised. Writes `width` floats to `out`.
static void average_fusion(const float* image, const float* text, int width, float* out) {
  auto inverse_norm = [width](const float* v) {
    double sum = 0;
    for (int i = 0; i < width; ++i) sum += static_cast<double>(v[i]) * v[i];
    return sum > 0 ? 1.0 / std::sqrt(sum) : 0.0;
  };
  const double image_scale = inverse_norm(image), text_scale = inverse_norm(text);
  for (int i = 0; i < width; ++i) out[i] = static_cast<float>(0.5 * (image[i] * image_scale + text[i] * text_scale));
  const double scale = inverse_norm(out);
  for (int i = 0; i < width; ++i) out[i] = static_cast<float>(out[i] * scale);
}

// Search mode, before the search: fuses the hybrid rows that arrive unfused (average_fusion,
// fusion method "average"; a text embedding of another width than the rows fails its request),
// and moves the upsert rows and their vectors to `upserts` and `upsert_vectors`. Returns the
// vectors of the rows left in batch.rows: `vectors` when nothing changed, else kept's.
static const float* prepare_rows(const AnnQueryState& s, gstmoe::BatchRecords& batch, const float* vectors,
                                 std::vector<float>* kept, std::vector<gstmoe::RequestRecord>* upserts,
                                 std::vector<float>* upsert_vectors) {
  auto unfused = [](const gstmoe::RequestRecord& r) {
    return r.modality == gstmoe::Modality::Hybrid && !r.text_embedding.empty();
  };
  if (std::none_of(batch.rows.begin(), batch.rows.end(),
                   [&](const gstmoe::RequestRecord& r) { return r.op != gstmoe::RequestOp::Search || unfused(r); }))
    return vectors;
  const size_t width = static_cast<size_t>(s.width);
  std::vector<gstmoe::RequestRecord> rows;
  for (size_t i = 0; i < batch.rows.size(); ++i) {
    gstmoe::RequestRecord& row = batch.rows[i];
    std::vector<float>& to = row.op == gstmoe::RequestOp::Upsert ? *upsert_vectors : *kept;
    const float* vector = vectors + i * width;
    if (unfused(row)) {
      if (row.text_embedding.size() != width) {
        const std::string reason = "hybrid request: its text embedding has " +
                                   std::to_string(row.text_embedding.size()) + " values, its image embedding " +
                                   std::to_string(width);
        batch.failed.push_back({std::move(row), STAGE_NAME, reason, moe::error_code::kInternal});
        continue;
      }
      to.resize(to.size() + width);
      average_fusion(vector, row.text_embedding.data(), s.width, to.data() + to.size() - width);
      row.text_embedding.clear();
      row.fusion = gstmoe::Fusion{0.5f, 0.5f, "average"};
    } else {
      to.insert(to.end(), vector, vector + width);
    }
    if (row.op == gstmoe::RequestOp::Upsert)
      upserts->push_back(std::move(row));
    else
      rows.push_back(std::move(row));
  }
  batch.rows = std::move(rows);
  return kept->data();
}

// After an update applied to `served`: counts it and, every snapshot-interval updates, writes the
// index (which empties its journal).
static void note_update(GstAnnQuery* self, ServedIndex& served) {
  if (!served.journaled) return;
  GST_OBJECT_LOCK(self);
  const guint interval = self->snapshot_interval;
  GST_OBJECT_UNLOCK(self);
  ++served.unsaved;
  if (interval > 0 && served.unsaved >= interval) save_served(self, served);
}

// Adds a buffer with the update document of `request` and a meta holding just it.
static void add_update_buffer(GstBufferList* list, gstmoe::RequestRecord request, const gstmoe::UpdateOutcome& outcome,
                              const gstmoe::BatchRecords& batch, GstBuffer* in) {
  GstBuffer* out = json_buffer(gstmoe::update_document(request, outcome, g_get_monotonic_time()), in, &request);
  gstmoe::BatchRecords single = models_of(batch);
  if (request.op == gstmoe::RequestOp::Upsert)
    single.rows.push_back(std::move(request));
  else
    single.controls.push_back(std::move(request));
  gst_buffer_add_moe_batch_meta(out, single);
  gst_buffer_list_add(list, out);
  gstmoe::metrics::count_update();
}

// Without allow-updates: moves `updates` to batch.failed, refused as updates_disabled.
static void refuse_updates(gstmoe::BatchRecords& batch, std::vector<gstmoe::RequestRecord>& updates) {
  const std::string reason =
      "catalog updates are disabled: this service takes searches only (ann-query allow-updates=true accepts "
      "upserts and deletes)";
  for (gstmoe::RequestRecord& r : updates)
    batch.failed.push_back({std::move(r), STAGE_NAME, reason, moe::error_code::kUpdatesDisabled});
  updates.clear();
}

// Applies each upsert row to `served`, the index its models match (serving_mutex held), and adds
// its update document to `list` (or, failed, moves it to batch.failed). Returns how many applied.
static uint64_t apply_upserts(GstAnnQuery* self, AnnQueryState& s, ServedIndex* served, gstmoe::BatchRecords& batch,
                              std::vector<gstmoe::RequestRecord>& upserts, const std::vector<float>& upsert_vectors,
                              GstBuffer* in, GstBufferList* list) {
  if (!s.serve.allow_updates) {
    refuse_updates(batch, upserts);
    return 0;
  }
  uint64_t applied = 0;
  for (size_t i = 0; i < upserts.size(); ++i) {
    gstmoe::RequestRecord& row = upserts[i];
    const int64_t start = g_get_monotonic_time();
    gstmoe::UpdateOutcome outcome;
    try {
      outcome.replaced = served->index.find(row.item.id) >= 0;
      outcome.row = served->index.upsert(upsert_vectors.data() + i * static_cast<size_t>(s.width), s.width, row.item);
    } catch (const moe::Error& e) {
      const std::string reason = "upsert of '" + row.item.id + "' into '" + served->path + "' failed: " + e.what();
      batch.failed.push_back({std::move(row), STAGE_NAME, reason, moe::error_code::kInternal});
      continue;
    }
    note_update(self, *served);
    outcome.items = served->index.live_size();
    outcome.index = served->name;
    row.timings_ms.emplace_back("update", gstmoe::elapsed_ms(start, g_get_monotonic_time()));
    add_update_buffer(list, std::move(row), outcome, batch, in);
    ++applied;
  }
  upserts.clear();
  return applied;
}

// Applies each deletion of batch.controls to every index held (serving_mutex held), so that no
// index answering serves a deleted item, and adds its update document to `list` (or, failed, moves
// it to batch.failed). Returns how many applied.
static uint64_t apply_deletes(GstAnnQuery* self, AnnQueryState& s, gstmoe::BatchRecords& batch, GstBuffer* in,
                              GstBufferList* list) {
  if (!s.serve.allow_updates) {
    refuse_updates(batch, batch.controls);
    return 0;
  }
  uint64_t applied = 0;
  ServedIndex& newest = *s.serving.back();
  for (gstmoe::RequestRecord& control : batch.controls) {
    if (control.op != gstmoe::RequestOp::Delete) {
      batch.failed.push_back({std::move(control), STAGE_NAME, "a request without a vector that is no deletion",
                              moe::error_code::kInternal});
      continue;
    }
    const int64_t start = g_get_monotonic_time();
    gstmoe::UpdateOutcome outcome;
    std::vector<std::string> ids;  // each once, in the request's order
    std::set<std::string> seen;
    for (const std::string& id : control.item_ids)
      if (seen.insert(id).second) ids.push_back(id);
    try {
      for (const std::string& id : ids) {
        const bool present = std::any_of(s.serving.begin(), s.serving.end(),
                                         [&](const std::unique_ptr<ServedIndex>& h) { return h->index.find(id) >= 0; });
        if (present)
          ++outcome.deleted;
        else
          outcome.missing.push_back(id);
      }
      for (const std::unique_ptr<ServedIndex>& held : s.serving)
        if (held->index.remove(ids) > 0) note_update(self, *held);
    } catch (const moe::Error& e) {
      const std::string reason = "delete from '" + newest.path + "' failed: " + e.what();
      batch.failed.push_back({std::move(control), STAGE_NAME, reason, moe::error_code::kInternal});
      continue;
    }
    outcome.items = newest.index.live_size();
    outcome.index = newest.name;
    control.timings_ms.emplace_back("update", gstmoe::elapsed_ms(start, g_get_monotonic_time()));
    add_update_buffer(list, std::move(control), outcome, batch, in);
    ++applied;
  }
  batch.controls.clear();
  return applied;
}

/* ---- hot swap -------------------------------------------------------------------------- */

// Posts an INDEX_MESSAGE element message: `event` "loaded" (a swap's index now answers the rows
// of its models; `previous` still answers the rows of its own) or "retired" (dropped).
static void post_index_message(GstAnnQuery* self, const char* event, const std::string& index, int64_t items,
                               const std::string& previous) {
  GstStructure* st = gst_structure_new(INDEX_MESSAGE, "event", G_TYPE_STRING, event, "index", G_TYPE_STRING,
                                       index.c_str(), "items", G_TYPE_INT64, items, "previous", G_TYPE_STRING,
                                       previous.empty() ? nullptr : previous.c_str(), nullptr);
  gst_element_post_message(GST_ELEMENT(self), gst_message_new_element(GST_OBJECT(self), st));
}

// The loader thread of a swap: loads `path` while the held indexes keep answering, then adds it
// as the newest (between two batches, under serving_mutex). Two are held at most: a third drops
// the oldest. A failure posts a warning and changes nothing. The stats and the messages change under
// serving_mutex too, so that they follow the order of the swaps and retirements.
static void swap_in(GstAnnQuery* self, AnnQueryState& s, const std::string& path) {
  std::unique_ptr<ServedIndex> fresh, dropped;
  std::string failure;
  try {
    fresh = load_served(self, s.serve, path);
  } catch (const LoadFailure& f) {
    failure = f.message;
  }
  if (fresh) {
    std::lock_guard<std::mutex> lock(s.serving_mutex);
    if (s.width != 0 && fresh->index.dim() != s.width) {
      failure = "the index '" + path + "' holds " + std::to_string(fresh->index.dim()) +
                "-wide vectors, but the stream's are " + std::to_string(s.width) + "-wide";
    } else {
      if (s.serving.size() > 1) {
        dropped = std::move(s.serving.front());
        s.serving.erase(s.serving.begin());
      }
      const std::string previous = s.serving.back()->path;
      const int64_t items = fresh->index.live_size();
      s.serving.push_back(std::move(fresh));
      GST_OBJECT_LOCK(self);
      self->swaps += 1;
      g_free(self->serving_index);
      self->serving_index = g_strdup(path.c_str());
      g_free(self->previous_index);
      self->previous_index = g_strdup(previous.c_str());
      GST_OBJECT_UNLOCK(self);
      GST_INFO_OBJECT(self, "swapped in %s; %s answers the rows of its models until rows of the new one's come",
                      path.c_str(), previous.c_str());
      if (dropped) post_index_message(self, "retired", dropped->path, dropped->index.live_size(), "");
      post_index_message(self, "loaded", path, items, previous);
      return;
    }
  }
  GST_OBJECT_LOCK(self);
  self->swap_failures += 1;
  const std::string in_use = self->serving_index ? self->serving_index : "";
  if (g_strcmp0(self->index_path, path.c_str()) == 0) {  // `index` reads the one in use again
    g_free(self->index_path);
    self->index_path = g_strdup(in_use.c_str());
  }
  GST_OBJECT_UNLOCK(self);
  GST_ELEMENT_WARNING(self, RESOURCE, OPEN_READ, ("Index swap failed: %s", failure.c_str()),
                      ("still answering from '%s'", in_use.c_str()));
}

// The previous index's rows have stopped coming (a batch was answered from the newest): says so
// (serving_mutex held; the caller drops it).
static void note_retired(GstAnnQuery* self, const ServedIndex& retired) {
  GST_OBJECT_LOCK(self);
  g_clear_pointer(&self->previous_index, g_free);
  GST_OBJECT_UNLOCK(self);
  GST_INFO_OBJECT(self, "retired %s: rows of the newest index's models have come", retired.path.c_str());
  post_index_message(self, "retired", retired.path, retired.index.live_size(), "");
}

/* ---- build mode ------------------------------------------------------------------------ */

constexpr const char* kBuildTakesNoUpdates =
    "ann-query mode=build adds catalog rows: updates go to a searching ann-query with allow-updates=true";

// Adds every row of `batch` to the index being built (the request's text is the caption). A row
// whose id an earlier row has fails, naming both uris: an id names one item; so do updates.
// Returns how many were added.
static size_t collect_rows(GstAnnQuery* self, AnnQueryState& s, gstmoe::BatchRecords& batch, const float* vectors) {
  for (gstmoe::RequestRecord& r : batch.controls)
    batch.failed.push_back({std::move(r), STAGE_NAME, kBuildTakesNoUpdates, moe::error_code::kUpdatesDisabled});
  batch.controls.clear();
  if (batch.rows.empty()) return 0;
  std::vector<gstmoe::RequestRecord> rows;
  std::vector<moe::AnnItem> items;
  std::vector<float> unique_vectors;
  for (size_t i = 0; i < batch.rows.size(); ++i) {
    gstmoe::RequestRecord& row = batch.rows[i];
    if (row.op != gstmoe::RequestOp::Search) {
      batch.failed.push_back({std::move(row), STAGE_NAME, kBuildTakesNoUpdates, moe::error_code::kUpdatesDisabled});
      continue;
    }
    const auto [first, added] = s.built_uris.emplace(row.id, row.uri);
    if (!added) {
      const std::string reason = "duplicate id '" + row.id + "': " + row.uri + " has the id of " + first->second +
                                 ", already in the index; give one of them its own \"id\" in the catalog";
      batch.failed.push_back({std::move(row), STAGE_NAME, reason, moe::error_code::kDuplicateId});
      continue;
    }
    items.push_back({row.id, row.uri, row.text, row.fields});
    unique_vectors.insert(unique_vectors.end(), vectors + i * static_cast<size_t>(s.width),
                          vectors + (i + 1) * static_cast<size_t>(s.width));
    rows.push_back(std::move(row));
  }
  batch.rows = std::move(rows);
  try {
    s.index->add(unique_vectors.data(), static_cast<int64_t>(items.size()), items);
    batch.rows.clear();
    return items.size();
  } catch (const moe::Error& e) {
    GST_WARNING_OBJECT(self, "add failed: %s", e.what());
    fail_rows(batch, std::string("adding to the index '") + s.index_path + "' failed: " + e.what());
    return 0;
  }
}

/* ---- build progress ------------------------------------------------------------------- */

// Where the build stands now; also what `stats` shows.
static BuildProgress build_progress(GstAnnQuery* self, const AnnQueryState& s) {
  BuildProgress p;
  p.added = s.index ? static_cast<uint64_t>(s.index->size()) : 0;
  p.failed = static_cast<uint64_t>(s.build_failed);
  p.done = p.added + p.failed;
  p.total = s.total;
  p.elapsed_s = static_cast<double>(g_get_monotonic_time() - s.build_start_us) / G_USEC_PER_SEC;
  p.rate = p.elapsed_s > 0 ? static_cast<double>(p.done) / p.elapsed_s : 0;
  if (p.total >= 0 && p.rate > 0)
    p.eta_s = static_cast<double>(std::max<int64_t>(0, p.total - static_cast<int64_t>(p.done))) / p.rate;
  GST_OBJECT_LOCK(self);
  self->progress = p;
  GST_OBJECT_UNLOCK(self);
  return p;
}

// Posts a GST_MESSAGE_PROGRESS with code "index-build", `text` for people (gst-launch prints it)
// and the figures for programs: done, added, failed, total, rate, eta-s, elapsed-s (and percent,
// when the total is known).
static void post_progress(GstAnnQuery* self, GstProgressType type, const BuildProgress& p, const std::string& text) {
  GstMessage* msg = gst_message_new_progress(GST_OBJECT(self), type, PROGRESS_CODE, text.c_str());
  GstStructure* st = gst_message_writable_structure(msg);
  gst_structure_set(st, "done", G_TYPE_UINT64, p.done, "added", G_TYPE_UINT64, p.added, "failed", G_TYPE_UINT64,
                    p.failed, "total", G_TYPE_INT64, p.total, "rate", G_TYPE_DOUBLE, p.rate, "eta-s", G_TYPE_DOUBLE,
                    p.eta_s, "elapsed-s", G_TYPE_DOUBLE, p.elapsed_s, nullptr);
  if (p.total > 0)
    gst_structure_set(st, "percent", G_TYPE_INT,
                      static_cast<int>(std::min<uint64_t>(100, p.done * 100 / static_cast<uint64_t>(p.total))),
                      nullptr);
  gst_element_post_message(GST_ELEMENT(self), msg);
}

// "32 of 90 items (35%), 1 failed, 12.5 items/s, about 5 s left"; without a total, "32 items, ...".
static std::string progress_text(const BuildProgress& p) {
  gchar* text;
  if (p.total > 0) {
    const std::string eta = p.eta_s < 0   ? std::string()
                            : p.eta_s < 1 ? std::string(", under a second left")
                                          : ", about " + std::to_string(std::llround(p.eta_s)) + " s left";
    text = g_strdup_printf("%" G_GUINT64_FORMAT " of %" G_GINT64_FORMAT " items (%d%%), %" G_GUINT64_FORMAT
                           " failed, %.1f items/s%s",
                           p.done, p.total, static_cast<int>(std::min<uint64_t>(100, p.done * 100 / p.total)), p.failed,
                           p.rate, eta.c_str());
  } else {
    text = g_strdup_printf("%" G_GUINT64_FORMAT " items, %" G_GUINT64_FORMAT " failed, %.1f items/s", p.done, p.failed,
                           p.rate);
  }
  std::string out = text;
  g_free(text);
  return out;
}

// After each batch: the total (asked upstream once; moe-catalog-src answers it) and, every
// `progress-items` requests, a progress message.
static void report_progress(GstAnnQuery* self, AnnQueryState& s) {
  if (!s.total_queried) {
    s.total_queried = true;
    gint64 items = -1;
    if (gst_pad_peer_query_duration(self->sinkpad, GST_FORMAT_DEFAULT, &items) && items >= 0) s.total = items;
  }
  const BuildProgress p = build_progress(self, s);
  if (s.progress_items == 0 || p.done < s.progress_posted + s.progress_items) return;
  post_progress(self, s.progress_posted == 0 ? GST_PROGRESS_TYPE_START : GST_PROGRESS_TYPE_CONTINUE, p,
                progress_text(p));
  s.progress_posted = p.done;
}

// Keeps a line naming a failed item for the summary: its file (or uri, or id) and the reason.
static void note_failure(AnnQueryState& s, const gstmoe::FailedRequest& f) {
  if (s.failure_lines.size() >= kMaxNamedFailures) return;
  std::string what;
  gchar* file = g_str_has_prefix(f.request.uri.c_str(), "file://")
                    ? g_filename_from_uri(f.request.uri.c_str(), nullptr, nullptr)
                    : nullptr;
  if (file != nullptr)
    what = file;
  else if (!f.request.uri.empty())
    what = f.request.uri;
  else
    what = "request '" + f.request.id + "'";
  g_free(file);
  s.failure_lines.push_back(what + ": " + f.reason + " [" + (f.code != nullptr ? f.code : "") + "]");
}

// The summary of a finished (or failed) build: `head`, then each failed item on a line of its own.
static std::string build_summary(const AnnQueryState& s, const BuildProgress& p, const std::string& head) {
  std::string text = head;
  if (p.failed == 0) return text;
  text += "; " + std::to_string(p.failed) + " failed:";
  for (const std::string& line : s.failure_lines) text += "\n  " + line;
  if (p.failed > s.failure_lines.size())
    text += "\n  ... and " + std::to_string(p.failed - s.failure_lines.size()) + " more (each has its error document)";
  return text;
}

// Sends the error documents held back during the build.
static void send_held_errors(GstAnnQuery* self, AnnQueryState& s) {
  GstBufferList* held = s.held_errors;
  s.held_errors = gst_buffer_list_new();
  if (gst_buffer_list_length(held) == 0) {
    gst_buffer_list_unref(held);
    return;
  }
  const GstFlowReturn ret = gst_pad_push_list(self->srcpad, held);
  if (ret != GST_FLOW_OK) GST_DEBUG_OBJECT(self, "error documents not delivered: %s", gst_flow_get_name(ret));
}

// At EOS: writes the index, posts the summary (a progress message), sends the error documents
// held back and then the index-built document. FALSE (with an element error) on failure.
//
// Why the error documents wait: the first buffer a sink receives prerolls it, and gst-launch does
// not set a prerolled pipeline PLAYING while an operation reports progress, so a build sending an
// early error document to fakesink would stall in PAUSED. Sent after the summary, they cannot.
static gboolean finish_build(GstAnnQuery* self, AnnQueryState& s) {
  if (s.build_refused) {  // the element error is posted: an index of mixed models is worse than none
    GST_DEBUG_OBJECT(self, "not writing '%s': it was given rows from other models", s.index_path.c_str());
    return FALSE;
  }
  const BuildProgress p = build_progress(self, s);
  if (!s.index || s.index->size() == 0) {
    post_progress(self, GST_PROGRESS_TYPE_ERROR, p,
                  build_summary(s, p, "nothing indexed: " + s.index_path + " is not written"));
    send_held_errors(self, s);
    GST_ELEMENT_ERROR(self, STREAM, FAILED,
                      ("no items to index: the stream ended before any row reached ann-query (%" G_GINT64_FORMAT
                       " failed requests); '%s' is not written",
                       s.build_failed, s.index_path.c_str()),
                      (nullptr));
    return FALSE;
  }
  if (s.built_from && !s.built_from->encoder_fingerprint.empty())
    s.index->set_provenance(*s.built_from);
  else
    GST_INFO_OBJECT(self,
                    "the rows carry no encoder fingerprint (not encoded by moe-encode): '%s' records no "
                    "provenance and searches of it are not checked",
                    s.index_path.c_str());
  try {
    s.index->save(s.index_path);
  } catch (const moe::Error& e) {
    post_progress(self, GST_PROGRESS_TYPE_ERROR, p, build_summary(s, p, std::string("not written: ") + e.what()));
    send_held_errors(self, s);
    GST_ELEMENT_ERROR(self, RESOURCE, WRITE, ("%s", e.what()), ("writing the ANN index '%s'", s.index_path.c_str()));
    return FALSE;
  }
  GST_INFO_OBJECT(self, "wrote %" G_GINT64_FORMAT " items of dimension %d to %s", s.index->size(), s.index->dim(),
                  s.index_path.c_str());
  gchar* head =
      g_strdup_printf("indexed %" G_GUINT64_FORMAT " of %" G_GUINT64_FORMAT " items into %s in %.1f s (%.1f items/s)",
                      p.added, p.done, s.index_path.c_str(), p.elapsed_s, p.rate);
  post_progress(self, GST_PROGRESS_TYPE_COMPLETE, p, build_summary(s, p, head));
  g_free(head);
  send_held_errors(self, s);
  const std::string doc = gstmoe::index_built_document(s.index_path, s.index->size(), s.index->dim(),
                                                       moe::ann_index_type_name(s.index->type()), s.build_failed);
  const GstFlowReturn ret = gst_pad_push(self->srcpad, json_buffer(doc, nullptr));
  if (ret != GST_FLOW_OK) GST_DEBUG_OBJECT(self, "index-built summary not delivered: %s", gst_flow_get_name(ret));
  return TRUE;
}

/* ---- pads ------------------------------------------------------------------------------ */

// The requests of a buffer of plain vectors (no request meta): one per row of s.width floats, of
// modality tensor, with the next ids and the buffer's PTS. False after posting an error when the
// buffer is not a whole number of rows.
static bool plain_batch(GstAnnQuery* self, const AnnQueryState& s, GstBuffer* in, gstmoe::BatchRecords* batch) {
  const gsize size = gst_buffer_get_size(in);
  const gsize row_bytes = static_cast<gsize>(s.width) * sizeof(float);
  if (size % row_bytes != 0) {
    GST_ELEMENT_ERROR(self, STREAM, FORMAT,
                      ("Tensor buffer of %" G_GSIZE_FORMAT " bytes is not a whole number of %d-wide float32 vectors "
                       "(%" G_GSIZE_FORMAT " bytes each)",
                       size, s.width, row_bytes),
                      (nullptr));
    return false;
  }
  const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
  batch->rows.resize(size / row_bytes);
  for (gstmoe::RequestRecord& r : batch->rows) {
    r.id = std::to_string(self->next_id++);
    r.modality = gstmoe::Modality::Tensor;
    r.arrival_wall_us = wall;
    r.arrival_mono_us = mono;
    r.pts = GST_BUFFER_PTS(in);
  }
  return true;
}

static GstFlowReturn gst_ann_query_chain(GstPad*, GstObject* parent, GstBuffer* in) {
  GstAnnQuery* self = GST_ANN_QUERY(parent);
  AnnQueryState& s = *self->state;
  if (s.width == 0) {
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, (nullptr), ("received a buffer before the tensor caps"));
    gst_buffer_unref(in);
    return GST_FLOW_NOT_NEGOTIATED;
  }
  // A meta without records (a partial copy of a buffer) tells nothing either.
  const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(in);
  gstmoe::BatchRecords batch;
  if (meta && meta->records) {
    batch = *meta->records;
  } else if (!plain_batch(self, s, in, &batch)) {
    gst_buffer_unref(in);
    return GST_FLOW_ERROR;
  }
  const size_t requests = batch.rows.size() + batch.failed.size() + batch.controls.size();

  GstMapInfo map;
  if (!gst_buffer_map(in, &map, GST_MAP_READ)) {
    GST_ELEMENT_ERROR(self, RESOURCE, READ, (nullptr), ("cannot map the input buffer"));
    gst_buffer_unref(in);
    return GST_FLOW_ERROR;
  }
  const size_t expected = batch.rows.size() * static_cast<size_t>(s.width) * sizeof(float);
  if (map.size != expected) {
    // Which bytes belong to which request is unknowable: answer every request with an error.
    const std::string reason = "tensor buffer holds " + std::to_string(map.size) + " bytes but its meta lists " +
                               std::to_string(batch.rows.size()) + " rows of width " + std::to_string(s.width);
    GST_ELEMENT_WARNING(self, STREAM, FORMAT, ("Malformed tensor buffer"), ("%s", reason.c_str()));
    fail_rows(batch, reason);
  }
  const float* vectors = reinterpret_cast<const float*>(map.data);

  GstBufferList* list = gst_buffer_list_new();
  bool refused = false;  // build mode: this batch's rows came from other models
  size_t refused_rows = 0, added = 0;
  uint64_t updates = 0;
  double search_ms = 0;
  if (s.mode == GST_ANN_QUERY_MODE_SEARCH) {
    std::unique_ptr<ServedIndex> retired;  // dropped after the lock: freeing a large index takes a while
    {
      std::lock_guard<std::mutex> lock(s.serving_mutex);
      std::string refusal;
      ServedIndex* served = index_for(self, s, batch, &refusal);
      if (!served) {
        refused_rows = batch.rows.size();
        fail_rows(batch, refusal, moe::error_code::kModelMismatch);
      } else if (!batch.rows.empty() && s.serving.size() > 1 && served == s.serving.back().get()) {
        retired = std::move(s.serving.front());
        s.serving.erase(s.serving.begin());
        note_retired(self, *retired);
      }
      std::vector<float> kept, upsert_vectors;
      std::vector<gstmoe::RequestRecord> upserts;
      const float* searched = prepare_rows(s, batch, vectors, &kept, &upserts, &upsert_vectors);
      // In arrival order as far as a batch tells it: its rows (upserts first), then its deletions,
      // which came after them (moe-encode starts a new buffer for rows after a deletion).
      updates = apply_upserts(self, s, served, batch, upserts, upsert_vectors, in, list);
      if (served) search_ms = search_rows(self, s, *served, batch, searched, in, list);
      updates += apply_deletes(self, s, batch, in, list);
    }
  } else {
    const std::string refusal = build_refusal(s, batch);
    if (!refusal.empty()) {
      // The build stops (and writes nothing at EOS); the refused requests still get their error documents.
      GST_ELEMENT_ERROR(self, STREAM, FAILED, ("%s", refusal.c_str()),
                        ("'%s' is not written: build it from one pipeline", s.index_path.c_str()));
      refused_rows = batch.rows.size();
      fail_rows(batch, refusal);
      refused = s.build_refused = true;
    }
    added = collect_rows(self, s, batch, vectors);
    s.build_failed += static_cast<int64_t>(batch.failed.size());
    for (const gstmoe::FailedRequest& f : batch.failed) note_failure(s, f);
  }
  const guint results = gst_buffer_list_length(list) - static_cast<guint>(updates);  // so far no error documents
  const auto updates_refused =
      static_cast<guint64>(std::count_if(batch.failed.begin(), batch.failed.end(), [](const gstmoe::FailedRequest& f) {
        return f.request.op != gstmoe::RequestOp::Search;
      }));
  // A build holds its error documents back until EOS (finish_build says why), unless it stops here.
  const bool hold_errors = s.mode == GST_ANN_QUERY_MODE_BUILD && !refused;
  if (refused) send_held_errors(self, s);
  for (gstmoe::FailedRequest& f : batch.failed)
    add_error_buffer(hold_errors ? s.held_errors : list, std::move(f), batch, in);
  gst_buffer_unmap(in, &map);
  gst_buffer_unref(in);

  GST_OBJECT_LOCK(self);
  self->requests += requests;
  self->results += results;
  self->errors += batch.failed.size();
  self->refused += refused_rows;
  self->added += added;
  self->batches += 1;
  self->search_ms += search_ms;
  self->updates += updates;
  self->updates_refused += updates_refused;
  GST_OBJECT_UNLOCK(self);
  gstmoe::metrics::count_search(search_ms);
  gstmoe::metrics::count_indexed(added);
  if (s.mode == GST_ANN_QUERY_MODE_BUILD && !refused) report_progress(self, s);

  GstFlowReturn ret = GST_FLOW_OK;
  if (gst_buffer_list_length(list) == 0)
    gst_buffer_list_unref(list);
  else
    ret = gst_pad_push_list(self->srcpad, list);
  return refused ? GST_FLOW_ERROR : ret;
}

// Accepts the upstream tensor width (it must match a loaded index, and may not change in the
// middle of a build) and announces application/json downstream.
static gboolean handle_caps(GstAnnQuery* self, AnnQueryState& s, GstCaps* caps) {
  int width = 0;
  std::string why;
  if (!gstmoe::parse_open_tensor_caps(caps, &width, &why)) {
    // The caps are not echoed: a hostile dimension string could be long (`why` quotes it clipped).
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Unsupported input caps: %s", why.c_str()),
                      ("ann-query takes " GST_MOE_TENSOR_MEDIA_TYPE " (dtype=f32) or one static float32 NNStreamer "
                       "tensor (" GST_MOE_NNS_TENSORS_MEDIA_TYPE " or " GST_MOE_NNS_TENSOR_MEDIA_TYPE ")"));
    return FALSE;
  }
  if (s.mode == GST_ANN_QUERY_MODE_SEARCH) {
    std::lock_guard<std::mutex> lock(s.serving_mutex);
    const ServedIndex& served = *s.serving.back();
    if (width != served.index.dim()) {
      const std::optional<moe::AnnProvenance>& provenance = served.index.provenance();
      const std::string built = provenance ? " (it was built from " + provenance->describe() + ")" : std::string();
      GST_ELEMENT_ERROR(self, CORE, NEGOTIATION,
                        ("Embedding width %d does not match the dimension %d of the index '%s'", width,
                         served.index.dim(), served.path.c_str()),
                        ("upstream produces %d-wide vectors; query an index built with the same encoder and adapter%s",
                         width, built.c_str()));
      return FALSE;
    }
    s.width = width;  // read by a swap's loader
  }
  if (s.mode == GST_ANN_QUERY_MODE_BUILD && s.index && width != s.index->dim()) {
    if (s.index->size() > 0) {
      GST_ELEMENT_ERROR(
          self, CORE, NEGOTIATION,
          ("Embedding width changed from %d to %d while building '%s'", s.index->dim(), width, s.index_path.c_str()),
          ("one index holds vectors of one width"));
      return FALSE;
    }
    s.index.reset();
  }
  if (s.mode == GST_ANN_QUERY_MODE_BUILD && !s.index) {
    try {
      s.index = moe::AnnIndex::create(width, s.build);
    } catch (const moe::Error& e) {
      GST_ELEMENT_ERROR(self, LIBRARY, INIT, ("%s", e.what()), ("creating the index for '%s'", s.index_path.c_str()));
      return FALSE;
    }
  }
  if (s.mode == GST_ANN_QUERY_MODE_BUILD) s.width = width;
  if (gst_pad_has_current_caps(self->srcpad)) return TRUE;
  GstCaps* json_caps = gst_caps_new_empty_simple(GST_MOE_JSON_CAPS);
  const gboolean ok = gst_pad_push_event(self->srcpad, gst_event_new_caps(json_caps));
  gst_caps_unref(json_caps);
  return ok;
}

static gboolean gst_ann_query_sink_event(GstPad* pad, GstObject* parent, GstEvent* event) {
  GstAnnQuery* self = GST_ANN_QUERY(parent);
  AnnQueryState* s = self->state;
  if (!s) return gst_pad_event_default(pad, parent, event);
  switch (GST_EVENT_TYPE(event)) {
    case GST_EVENT_CAPS: {
      GstCaps* caps = nullptr;
      gst_event_parse_caps(event, &caps);
      const bool retried = s->refused_caps && gst_caps_is_equal(caps, s->refused_caps);
      const gboolean ok = !retried && handle_caps(self, *s, caps);
      if (!ok) gst_caps_replace(&s->refused_caps, caps);
      gst_event_unref(event);
      return ok;
    }
    case GST_EVENT_FLUSH_STOP:
      // Nothing is held in search mode. A build keeps what it has added: a flush (a seek, a
      // restart of the source) does not mean the catalog rows seen so far are invalid.
      if (s->mode == GST_ANN_QUERY_MODE_BUILD && s->index && s->index->size() > 0)
        GST_WARNING_OBJECT(self, "flush while building: keeping the %" G_GINT64_FORMAT " rows already added",
                           s->index->size());
      return gst_pad_event_default(pad, parent, event);
    case GST_EVENT_EOS:
      if (s->mode == GST_ANN_QUERY_MODE_BUILD && !finish_build(self, *s)) {
        gst_event_unref(event);
        return FALSE;
      }
      return gst_pad_event_default(pad, parent, event);
    default:
      return gst_pad_event_default(pad, parent, event);
  }
}

/* ---- GObject --------------------------------------------------------------------------- */

static void gst_ann_query_finalize(GObject* object) {
  GstAnnQuery* self = GST_ANN_QUERY(object);
  g_free(self->index_path);
  g_free(self->index_type);
  g_free(self->device);
  g_free(self->uri_base);
  gst_ann_query_stop(self);
  g_free(self->serving_index);
  g_free(self->previous_index);
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_ann_query_class_init(GstAnnQueryClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  gobject_class->set_property = gst_ann_query_set_property;
  gobject_class->get_property = gst_ann_query_get_property;
  gobject_class->finalize = gst_ann_query_finalize;
  element_class->change_state = GST_DEBUG_FUNCPTR(gst_ann_query_change_state);

  g_object_class_install_property(
      gobject_class, PROP_INDEX,
      g_param_spec_string(
          "index", "Index file",
          "FAISS index file to search (mode=search) or to write (mode=build); its item table is INDEX.items.jsonl "
          "beside it. Set while searching, it is a hot swap: the new index loads in the background while the one in "
          "use keeps answering; then each batch is answered from the newest of the two whose provenance matches its "
          "models (the new one when both do), and the old one is dropped when a batch is answered from the new one "
          "(or at the next swap). A full swap of models, with none answered from a mismatched pair: 1) ann-query "
          "index=NEW, 2) moe-expert model=NEW, 3) moe-route model=NEW. A failed load posts a warning and changes "
          "nothing; the bus gets an element message \"" INDEX_MESSAGE "\" (event loaded or retired, index, items, "
          "previous)",
          DEFAULT_INDEX, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_K,
      g_param_spec_uint("k", "Results",
                        "Results per request, for requests that do not ask for their own number (\"k\")", 1, MAX_K,
                        DEFAULT_K, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_MODE,
      g_param_spec_enum("mode", "Mode", "Search the index, or build it from the incoming rows", GST_TYPE_ANN_QUERY_MODE,
                        DEFAULT_MODE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_INDEX_TYPE,
      g_param_spec_string("index-type", "Index type",
                          "Index to build (mode=build; a searched index has its own type), as FAISS's index_factory "
                          "string over inner product: \"Flat\" (exact), \"HNSW32\" (graph, M=32), \"IVF4096,Flat\" "
                          "(inverted lists), \"IVF256,PQ16\" (lists of 16-byte codes), \"OPQ16,IVF256,PQ16\" (the "
                          "same after a learned rotation), ...; \"flat\" and \"hnsw\" are aliases of \"Flat\" and "
                          "\"HNSW<hnsw-m>\". IVF, PQ and OPQ train on the first train-size rows. A string FAISS "
                          "refuses, or a type not listed here, fails the build at the first caps, saying why",
                          DEFAULT_INDEX_TYPE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_HNSW_M,
      g_param_spec_uint("hnsw-m", "HNSW M",
                        "Links per node of an HNSW index built with index-type=hnsw (a factory string names its own, "
                        "HNSW32): more links, better recall, more memory",
                        4, 128, DEFAULT_HNSW_M, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_EF_CONSTRUCTION,
      g_param_spec_uint("ef-construction", "HNSW efConstruction",
                        "Candidate list size while building an HNSW index: larger builds a better graph, slower", 8,
                        1024, DEFAULT_EF_CONSTRUCTION, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_EF_SEARCH,
      g_param_spec_uint("ef-search", "HNSW efSearch",
                        "Candidate list size when searching an HNSW index (raised to k when smaller): larger finds "
                        "more true neighbours, slower; ignored by other types. A request's own \"ef_search\" "
                        "(1..4096) overrides it for that request",
                        1, 4096, DEFAULT_EF_SEARCH, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_NPROBE,
      g_param_spec_uint("nprobe", "IVF nprobe",
                        "Inverted lists scanned per query of an IVF index (capped at its list count, where the "
                        "search is exhaustive): larger finds more true neighbours, slower; ignored by other types. "
                        "A request's own \"nprobe\" (1..65536) overrides it for that request",
                        1, 65536, DEFAULT_NPROBE, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_TRAIN_SIZE,
      g_param_spec_uint("train-size", "Training sample",
                        "mode=build, index types that learn from the data (IVF, PQ, OPQ): how many of the first "
                        "rows they train on (the rest are added after training). 0: 64 per IVF list (FAISS advises "
                        "30 to 256 per list); a shorter stream trains on all of it. At least the number of lists",
                        0, G_MAXUINT, DEFAULT_TRAIN_SIZE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_DEVICE,
      g_param_spec_string("device", "Device",
                          "Where searches run (mode=search): \"cpu\" (FAISS), \"cuda:N\" (a flat index is copied "
                          "to the GPU once and every search is an exact inner-product top-k there, k up to 1024, "
                          "filtered requests are searched by FAISS on the CPU; an HNSW or IVF index fails the start) "
                          "or \"auto\" (cuda:0 for a flat index when a usable CUDA "
                          "device exists, else FAISS on the CPU). A device that cannot be used fails the start, "
                          "saying why",
                          DEFAULT_DEVICE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_URI_BASE,
      g_param_spec_string("uri-base", "URI base",
                          "Where clients fetch the catalog items (mode=search): each hit's uri is served with the "
                          "folder all the index's item uris share (file:///home/me/catalog/) replaced by this "
                          "(https://cdn.example/catalog/), keeping the rest of the path. NULL or empty (the "
                          "default): uris as the index was built with them",
                          nullptr, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_PROGRESS_ITEMS,
      g_param_spec_uint("progress-items", "Progress interval",
                        "mode=build: post a progress message (GST_MESSAGE_PROGRESS, code \"index-build\": its text "
                        "for people, and the fields done, added, failed, total (-1: unknown), rate (items/s), eta-s "
                        "(-1: unknown), elapsed-s) each time this many more requests were taken; 0: only the final "
                        "summary, which is posted at end of stream in any case (type complete, or error when nothing "
                        "is written) and names each failed item with its reason",
                        0, G_MAXUINT, DEFAULT_PROGRESS_ITEMS, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_ALLOW_UPDATES,
      g_param_spec_boolean(
          "allow-updates", "Allow updates",
          "mode=search: apply catalog updates (upsert and delete requests, docs/zmq-schema.md \"Live updates\") to "
          "the index while searching, each answered by an update document, and journal them beside the index "
          "(INDEX.journal, flushed before the answer) so that they survive a crash; an upsert made by other models "
          "than the index's is refused like a query. The index must be searched on the CPU (a device-resident "
          "one fails the start). FALSE (the default): every update is answered by an error document with code "
          "\"updates_disabled\"",
          DEFAULT_ALLOW_UPDATES, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_SNAPSHOT_INTERVAL,
      g_param_spec_uint("snapshot-interval", "Snapshot interval",
                        "With allow-updates: write the index and its item table anew (which empties the journal) "
                        "after this many updates; the write runs between two batches, which wait for it. 0 (the "
                        "default): only when the element stops; until then the journal holds the updates",
                        0, G_MAXUINT, DEFAULT_SNAPSHOT_INTERVAL, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "ann-query-stats: requests (rows and failed requests received), results (result documents sent), errors "
          "(error documents sent: for requests that failed upstream, failed here or were refused), refused "
          "(requests refused because other models than the index's made them, or than the first rows' in a build), "
          "added (rows added to the index being built), batches (tensor buffers received), search-ms (time spent "
          "searching the index), updates (catalog updates applied), updates-refused (updates answered with an "
          "error document), swaps (indexes swapped in while running), swap-failures (swaps whose index did not "
          "load), index (the index in use: the newest), previous-index (after a swap, the one still answering the "
          "rows of its models; NULL when none); in a build also total (items upstream announced, -1: unknown), rate "
          "(items taken per second since the start) and eta-s (seconds left at that rate, -1: unknown); reset at "
          "start"));

  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "ANN query", "Filter/Analyzer",
      "Answers each embedded request (one row of a tensor batch) with the k nearest catalog items of a FAISS index "
      "(cosine similarity): one JSON result document per request, one error document per request that failed "
      "upstream, and one error document per request whose encoder or adapter differs from the ones that built the "
      "index (their fingerprints, recorded in INDEX.items.jsonl). With mode=build it instead adds every row (the "
      "request's id, uri and text become the item) to a new index, writes INDEX and INDEX.items.jsonl with the "
      "encoder and adapter of its rows at end of stream and sends one index-built document; rows from other models "
      "than the first rows' stop the build. Plain float32 vectors without gst-moe's request meta (NNStreamer's "
      "other/tensors or other/tensor, float32, dimensions=W:R) are searched too, one request per row.\n"
      "Build: gst-launch-1.0 moe-catalog-src location=photos/ ! moe-encode model=clip/ ! moe-route model=adapter/ "
      "! moe-expert model=adapter/ ! ann-query mode=build index=catalog.faiss ! fakesink\n"
      "Search: gst-launch-1.0 zmq-query ! moe-encode model=clip/ ! moe-route model=adapter/ ! "
      "moe-expert model=adapter/ ! ann-query index=catalog.faiss k=5 ! zmq-publish\n"
      "Vectors (128-wide float32, back to back in a file): gst-launch-1.0 filesrc location=queries.f32 blocksize=512 ! "
      "'other/tensors,format=static,num_tensors=1,types=float32,dimensions=(string)128:1' ! "
      "ann-query index=catalog.faiss k=3 ! filesink location=results.json",
      "gst-moe developers");

  gst_type_mark_as_plugin_api(GST_TYPE_ANN_QUERY_MODE, static_cast<GstPluginAPIFlags>(0));
}

static void gst_ann_query_init(GstAnnQuery* self) {
  self->sinkpad = gst_pad_new_from_static_template(&sink_template, "sink");
  gst_pad_set_chain_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_ann_query_chain));
  gst_pad_set_event_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_ann_query_sink_event));
  gst_element_add_pad(GST_ELEMENT(self), self->sinkpad);

  self->srcpad = gst_pad_new_from_static_template(&src_template, "src");
  gst_pad_use_fixed_caps(self->srcpad);
  gst_element_add_pad(GST_ELEMENT(self), self->srcpad);

  self->index_path = g_strdup(DEFAULT_INDEX);
  self->k = DEFAULT_K;
  self->mode = DEFAULT_MODE;
  self->index_type = g_strdup(DEFAULT_INDEX_TYPE);
  self->hnsw_m = DEFAULT_HNSW_M;
  self->ef_construction = DEFAULT_EF_CONSTRUCTION;
  self->ef_search = DEFAULT_EF_SEARCH;
  self->nprobe = DEFAULT_NPROBE;
  self->train_size = DEFAULT_TRAIN_SIZE;
  self->device = g_strdup(DEFAULT_DEVICE);
  self->progress_items = DEFAULT_PROGRESS_ITEMS;
  self->allow_updates = DEFAULT_ALLOW_UPDATES;
  self->snapshot_interval = DEFAULT_SNAPSHOT_INTERVAL;
  self->progress = BuildProgress();
  self->next_id = 0;
}
