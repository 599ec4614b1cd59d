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
 * The `stats` property counts, since the element started, the requests received, the result and
 * error documents sent, the requests refused for their models, the rows added to a build, the
 * batches, and the time spent searching; in a build also its progress (total, rate, eta-s).
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
 * The documents are written by gstmoeresult.h. */
#include "gstannquery.h"

#include <glib/gstdio.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
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
#define PROGRESS_CODE "index-build"

namespace {

// Failed items the build summary names (it counts all of them; their error documents list all).
constexpr size_t kMaxNamedFailures = 50;

// What one run works with: created by start() (READY->PAUSED), destroyed by stop()
// (PAUSED->READY); only the streaming thread touches it while the pads are active.
struct AnnQueryState {
  GstAnnQueryMode mode = DEFAULT_MODE;
  std::string index_path;                        // as set in `index`
  moe::AnnBuildOptions build;                    // build mode
  std::optional<moe::AnnIndex> index;            // search: loaded; build: created at the first caps
  std::string index_name;                        // basename of index_path, for the result documents
  std::shared_ptr<void> index_memory;            // search mode, flat index: its vectors in the metrics
  std::string uri_base;                          // search mode: `uri-base`, "" to serve uris as built
  std::string uri_folder;                        // search mode: the items' common uri folder, uri_base replaces it
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

  AnnQueryState() = default;
  AnnQueryState(const AnnQueryState&) = delete;
  AnnQueryState& operator=(const AnnQueryState&) = delete;
  ~AnnQueryState() {
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

  // Behind `stats`, under the object lock: reset at start, kept after stop.
  guint64 requests;        // rows and failed requests received
  guint64 results;         // result documents sent
  guint64 errors;          // error documents sent
  guint64 refused;         // requests refused because other models made them
  guint64 added;           // rows added to the index being built
  guint64 batches;         // tensor buffers received
  gdouble search_ms;       // time spent in index searches
  BuildProgress progress;  // build mode
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

static void gst_ann_query_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstAnnQuery* self = GST_ANN_QUERY(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_INDEX:
      g_free(self->index_path);
      self->index_path = g_value_dup_string(value);
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
    case PROP_STATS:
      g_value_take_boxed(
          value, gst_structure_new("ann-query-stats", "requests", G_TYPE_UINT64, self->requests, "results",
                                   G_TYPE_UINT64, self->results, "errors", G_TYPE_UINT64, self->errors, "refused",
                                   G_TYPE_UINT64, self->refused, "added", G_TYPE_UINT64, self->added, "batches",
                                   G_TYPE_UINT64, self->batches, "search-ms", G_TYPE_DOUBLE, self->search_ms, "total",
                                   G_TYPE_INT64, self->progress.total, "rate", G_TYPE_DOUBLE, self->progress.rate,
                                   "eta-s", G_TYPE_DOUBLE, self->progress.eta_s, nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

/* ---- state ----------------------------------------------------------------------------- */

// Reads the properties and loads the index (search) or checks that it can be written (build).
static gboolean gst_ann_query_start(GstAnnQuery* self) {
  auto s = std::make_unique<AnnQueryState>();
  GST_OBJECT_LOCK(self);
  self->requests = self->results = self->errors = self->refused = self->added = self->batches = 0;
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
  const std::string device = self->device;
  s->uri_base = self->uri_base ? self->uri_base : "";
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
      s->index = moe::AnnIndex::load(s->index_path);
    } catch (const moe::Error& e) {
      GST_ELEMENT_ERROR(self, RESOURCE, OPEN_READ, ("%s", e.what()),
                        ("loading the ANN index '%s'", s->index_path.c_str()));
      return FALSE;
    }
    std::string searched_on;
    try {
      searched_on = s->index->place_on(device);
    } catch (const moe::Error& e) {  // names the device and the reason
      GST_ELEMENT_ERROR(
          self, RESOURCE, SETTINGS,
          ("cannot search the ANN index '%s' on device '%s': %s", s->index_path.c_str(), device.c_str(), e.what()),
          (nullptr));
      return FALSE;
    }
    GST_INFO_OBJECT(self, "loaded %s: %" G_GINT64_FORMAT " items, dimension %d, %s (%s), searched on %s%s",
                    s->index_path.c_str(), s->index->size(), s->index->dim(), s->index->factory().c_str(),
                    moe::ann_index_type_name(s->index->type()), searched_on.c_str(),
                    searched_on == "cpu" ? " (FAISS)" : " (GPU-resident, exact; filtered requests: FAISS)");
    if (device == "auto" && searched_on == "cpu" && s->index->type() != moe::AnnIndexType::Flat)
      GST_INFO_OBJECT(self, "device auto: %s is searched by FAISS on the CPU (the GPU path is for flat indexes)",
                      s->index->factory().c_str());
    if (s->index->type() == moe::AnnIndexType::Flat)  // an HNSW graph's size is not known
      s->index_memory = gstmoe::metrics::hold_device_memory(
          "index", searched_on, static_cast<uint64_t>(s->index->size()) * s->index->dim() * sizeof(float));
    if (s->index->provenance())
      GST_INFO_OBJECT(self, "%s was built from %s", s->index_path.c_str(), s->index->provenance()->describe().c_str());
    else
      GST_INFO_OBJECT(self,
                      "%s records no provenance (written before gst-moe recorded it, or from vectors of unknown "
                      "origin): queries cannot be checked against the encoder and adapter that built it; "
                      "rebuild it to enable the check",
                      s->index_path.c_str());
    if (s->index->size() == 0)
      GST_WARNING_OBJECT(self, "index '%s' is empty: results will be empty", s->index_path.c_str());
    if (!s->uri_base.empty()) {
      s->uri_folder = s->index->uri_folder();
      if (s->uri_folder.empty())
        GST_WARNING_OBJECT(self, "uri-base '%s' is not used: the uris of '%s' share no folder", s->uri_base.c_str(),
                           s->index_path.c_str());
      else
        GST_INFO_OBJECT(self, "serving uris under %s as %s", s->uri_folder.c_str(), s->uri_base.c_str());
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
  self->state = s.release();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static void gst_ann_query_stop(GstAnnQuery* self) {
  GST_OBJECT_LOCK(self);
  AnnQueryState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
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

// Search mode: why the rows of `batch` may not be searched (empty: they may). Rows without an
// encoder fingerprint (not from moe-encode) cannot be checked and are searched, as before.
static std::string search_refusal(GstAnnQuery* self, AnnQueryState& s, const gstmoe::BatchRecords& batch) {
  const std::optional<moe::AnnProvenance>& built = s.index->provenance();
  if (batch.rows.empty() || !built) return {};  // an index without provenance was logged at start
  const moe::AnnProvenance query = provenance_of(batch);
  if (query.encoder_fingerprint.empty()) {
    if (!s.unchecked_logged)
      GST_INFO_OBJECT(self,
                      "rows without an encoder fingerprint (not encoded by moe-encode): searched without "
                      "checking them against the provenance of '%s'",
                      s.index_path.c_str());
    s.unchecked_logged = true;
    return {};
  }
  if (built->same_models(query)) return {};
  const std::string reason = "the index " + s.index_path + " was built from " + built->describe() +
                             ", but this query was encoded by " + query.describe() +
                             ": rebuild the index with this pipeline or search it with the pipeline that built it";
  if (!s.mismatch_logged)
    GST_WARNING_OBJECT(self, "refusing queries (later batches are not logged): %s", reason.c_str());
  s.mismatch_logged = true;
  return reason;
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
static double search_rows(GstAnnQuery* self, AnnQueryState& s, gstmoe::BatchRecords& batch, const float* vectors,
                          GstBuffer* in, GstBufferList* list) {
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
      auto found = s.index->search(queries.data(), static_cast<int64_t>(group.size()), k_max, options[i]);
      for (size_t t = 0; t < group.size(); ++t) hits[group[t]] = std::move(found[t]);
    }
  } catch (const moe::Error& e) {
    GST_WARNING_OBJECT(self, "search failed: %s", e.what());
    fail_rows(batch, std::string("search in '") + s.index_path + "' failed: " + e.what());
    return 0;
  }
  const double search_ms = gstmoe::elapsed_ms(start, g_get_monotonic_time());
  const gstmoe::ModelIds model{batch.encoder, batch.adapter, s.index_name};

  for (size_t i = 0; i < batch.rows.size(); ++i) {
    gstmoe::RequestRecord& row = batch.rows[i];
    row.timings_ms.emplace_back("search", search_ms);
    std::vector<gstmoe::ResultHit> results;
    const size_t n = std::min(hits[i].size(), static_cast<size_t>(ks[i]));
    for (size_t j = 0; j < n; ++j) {
      const moe::AnnItem& item = s.index->item(hits[i][j].item);
      results.push_back({hits[i][j].item, item.id, moe::rebase_uri(item.uri, s.uri_folder, s.uri_base), item.caption,
                         item.fields, hits[i][j].score});
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

/* ---- build mode ------------------------------------------------------------------------ */

// Adds every row of `batch` to the index being built (the request's text is the caption). A row
// whose id an earlier row has fails, naming both uris: an id names one item.
// Returns how many were added.
static size_t collect_rows(GstAnnQuery* self, AnnQueryState& s, gstmoe::BatchRecords& batch, const float* vectors) {
  if (batch.rows.empty()) return 0;
  std::vector<gstmoe::RequestRecord> rows;
  std::vector<moe::AnnItem> items;
  std::vector<float> unique_vectors;
  for (size_t i = 0; i < batch.rows.size(); ++i) {
    gstmoe::RequestRecord& row = batch.rows[i];
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
  const size_t requests = batch.rows.size() + batch.failed.size();

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
  double search_ms = 0;
  if (s.mode == GST_ANN_QUERY_MODE_SEARCH) {
    const std::string refusal = search_refusal(self, s, batch);
    if (!refusal.empty()) {
      refused_rows = batch.rows.size();
      fail_rows(batch, refusal, moe::error_code::kModelMismatch);
    }
    search_ms = search_rows(self, s, batch, vectors, in, list);
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
  const guint results = gst_buffer_list_length(list);  // so far only result documents
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
  if (s.mode == GST_ANN_QUERY_MODE_SEARCH && width != s.index->dim()) {
    const std::string built =
        s.index->provenance() ? " (it was built from " + s.index->provenance()->describe() + ")" : std::string();
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION,
                      ("Embedding width %d does not match the dimension %d of the index '%s'", width, s.index->dim(),
                       s.index_path.c_str()),
                      ("upstream produces %d-wide vectors; query an index built with the same encoder and adapter%s",
                       width, built.c_str()));
    return FALSE;
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
  s.width = width;
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
      g_param_spec_string("index", "Index file",
                          "FAISS index file to search (mode=search) or to write (mode=build); its item table is "
                          "INDEX.items.jsonl beside it",
                          DEFAULT_INDEX, gstmoe::kPropertyMutableReady));
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
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "ann-query-stats: requests (rows and failed requests received), results (result documents sent), errors "
          "(error documents sent: for requests that failed upstream, failed here or were refused), refused "
          "(requests refused because other models than the index's made them, or than the first rows' in a build), "
          "added (rows added to the index being built), batches (tensor buffers received), search-ms (time spent "
          "searching the index); in a build also total (items upstream announced, -1: unknown), rate (items taken "
          "per second since the start) and eta-s (seconds left at that rate, -1: unknown); reset at start"));

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
  self->progress = BuildProgress();
  self->next_id = 0;
}
