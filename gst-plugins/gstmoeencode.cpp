/**
 * SECTION:element-moe-encode
 * @title: moe-encode
 * @see_also: moe-route, zmq-query, moe-catalog-src, ann-query
 *
 * moe-encode embeds search requests with a CLIP model. Query texts (one per text/x-raw buffer),
 * image files (image/jpeg, image/png, WebP, GIF, BMP, TIFF, PNM: a file per buffer, or one file
 * read by filesrc), video frames, or application/x-moe-request buffers (a text or an encoded image
 * file, as zmq-query and moe-catalog-src send them) go in; batches of embeddings come out
 * (application/x-moe-tensor, width = the model's projection_dim), with each row's request (id,
 * modality, uri, timings) in the buffer's GstMoeBatchMeta. A request that cannot be encoded
 * (invalid UTF-8, an image that does not decode) is not an element error: it travels on in the
 * meta's failed list, and ann-query answers it with an error document.
 *
 * A hybrid request (an image and a text: "like this photo, but red"; its buffer holds the image,
 * its record the text) has both encoded in its batch: its row is the image's embedding and its
 * record's text_embedding the text's, for moe-route (or ann-query) to fuse. Catalog upserts are
 * encoded like queries (their record keeps the item); row-less requests (catalog deletes, the
 * meta's controls) pass through in their place in the queue: a batch's output buffer carries its
 * rows, then the controls that came after them, so a row that came after a control leaves in the
 * next buffer, and a batch of controls alone leaves as an empty buffer.
 *
 * Batching is continuous: a request that finds the encoder idle is encoded at once, alone; the
 * requests that arrive while it is busy leave together, up to `max-batch`, as soon as it is done.
 * A lone request never waits for company, and batches grow with the load. `max-latency` holds
 * nothing back: it is the queueing wait the element adds to the pipeline latency.
 *
 * The model is loaded when the element goes to READY, on `device` (cpu, cuda:N, or auto: cuda:0
 * when a usable CUDA device exists) with its Linear weights in `precision`; elements naming the
 * same model, device and precision share it. These three can only be changed in the NULL state.
 *
 * Image files are decoded by the engine's decoder, so they embed as transformers embeds the same
 * files; video frames that are not RGB are converted (and scaled down to the model's input in the
 * same pass), within a tolerance of that (docs/video.md). For live video, `interval` encodes
 * every Nth frame, and QoS events from downstream make late frames drop before conversion, as in
 * GstBaseTransform filters.
 *
 * A query cache of `cache-bytes` (least recently used entries go first; 0 disables it) keeps the
 * embeddings of recent requests: a text that tokenises like an earlier one, or an image request
 * with the same file bytes, gets the earlier embedding, bit for bit, without an encoder call (the
 * two halves of a hybrid are looked up each under its own key, so one may hit and the other not), as
 * long as the model, device and precision are the same (they are part of every key). Video frames
 * are not cached. Hits still travel in their batch, so moe-route routes them again: routing is
 * cheap, and this way the cache never needs to know the router's settings.
 *
 * The `stats` property counts, since the element started: the requests and the batches, the
 * batches by size, the requests that failed here, the hybrid requests encoded, the time spent in
 * the encoder, the time the
 * requests spent queued (total and longest), the requests that queued longer than
 * max-latency, and the query cache's hits, misses, evictions and refusals; it also gives what the
 * cache holds now.
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 videotestsrc num-buffers=16 ! moe-encode model=models/default/clip max-batch=4 \
 *     ! fakesink
 * ]| Embeds 16 test video frames.
 * |[
 * gst-launch-1.0 moe-catalog-src location=models/default/catalog \
 *     ! moe-encode model=models/default/clip max-batch=32 ! fakesink
 * ]| Embeds the images of the demo catalog, in batches of up to 32 while the encoder is busy.
 * |[
 * gst-launch-1.0 filesrc location=photo.jpg ! moe-encode model=models/default/clip ! fakesink
 * ]| Embeds one photo, decoded as transformers decodes it.
 * |[
 * gst-launch-1.0 videotestsrc is-live=true ! video/x-raw,format=I420,width=1280,height=720 \
 *     ! queue leaky=downstream max-size-buffers=2 ! moe-encode max-batch=1 interval=3 ! fakesink
 * ]| Embeds every third frame of live video, dropping what it cannot keep up with.
 * |[
 * printf 'red striped mug' | gst-launch-1.0 fdsrc ! text/x-raw,format=utf8 \
 *     ! moe-encode model=models/default/clip ! fakesink dump=true
 * ]| Embeds one query text read from standard input and dumps the embedding's bytes.
 */

/* Why batches: the engine encodes a batch with one GEMM per layer, much faster per request than
 * one call each. When a batch may leave is the engine's policy (moe/batcher.h); every output
 * buffer says in its meta which request each row answers, so a batch may mix texts and images
 * and nothing downstream relies on buffer order, except for controls: a catalog delete must not
 * overtake an upsert sent before it, nor follow one sent after it (ann-query applies a buffer's
 * upsert rows, then its controls).
 *
 * max-batch counts requests, and a hybrid is one: it adds one input to each tower's call, so
 * neither call ever takes more than max-batch inputs (as a batch of texts or images alone). A
 * batch of hybrids costs both towers' time, up to twice a single-modality batch's; counting it
 * twice would instead halve the batch for the rows that need both towers, without bounding either
 * call any better.
 *
 * Threads: the streaming thread turns buffers into requests (converting frames, decoding images)
 * and queues them; while a whole batch is queued already it waits (backpressure), since the
 * requests would only wait here instead of upstream. A worker thread (one per run) encodes and
 * pushes each batch the batcher lets leave, so the streaming thread keeps queueing while the
 * encoder runs. Serialized events (EOS, caps, segments...) push what is queued first,
 * from the streaming thread; push_lock keeps those pushes and the worker's in order. A failed
 * push from the worker or ahead of an event is returned by the next chain call (and posted at
 * once when fatal); a flush drops what is queued.
 *
 * Why the cache keys on token ids: they are the text as the encoder sees it, after the
 * tokenizer's normalisation (ftfy fixes, whitespace collapsed, lower case) and its truncation to
 * the model's context, so every text that must embed alike does, and nothing else can (a key of
 * normalised text would need the tokenizer's special-token splitting to be exact). Tokenising is
 * cheap next to the encoder. Image requests key on a SHA-256 of their file, so a hit is not even
 * decoded. Video frames are not cached: live frames are practically never bit-identical, and
 * hashing each (37 ms for a 1080p frame with GLib's SHA-256 here) would cost more than it could
 * save. A key's size is bounded (the model's context, 77 ids for CLIP), so a huge text costs the
 * cache no more than a short one. Requests are looked up on arrival, by the streaming thread, and
 * stored once encoded, by the worker: a request that arrives while its twin is still queued or
 * being encoded misses too.
 *
 * Lifetimes: the model is loaded at NULL->READY (open) and kept until READY->NULL (close), so it
 * outlives runs, beside the counters; the query cache lives as long as the element; the queue,
 * the worker and the stream's state are the running state (EncodeState), made by start
 * (READY->PAUSED) and deleted by stop (PAUSED->READY). Locks, outermost first: push_lock, the
 * object lock (properties, counters, the two pointers), EncodeState::lock (queue and batcher);
 * the query cache's own lock is taken under any of them and takes none.
 */
#include "gstmoeencode.h"

#include <gst/base/gsttypefindhelper.h>
#include <gst/video/video.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "gstmoemeta.h"
#include "gstmoemetrics.h"
#include "moe/batcher.h"
#include "moe/compute.h"
#include "moe/error.h"
#include "moe/image_decode.h"
#include "moe/model_cache.h"
#include "moe/query_cache.h"
#include "moe_build_config.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_encode_debug);
#define GST_CAT_DEFAULT gst_moe_encode_debug

enum {
  PROP_0,
  PROP_MODEL,
  PROP_DEVICE,
  PROP_PRECISION,
  PROP_THREADS,
  PROP_MAX_BATCH,
  PROP_MAX_LATENCY,
  PROP_CACHE_BYTES,
  PROP_INTERVAL,
  PROP_QOS,
  PROP_STATS
};

// The shipped model where `meson install` puts it, so an installed moe-encode runs without model=.
#define DEFAULT_MODEL MOE_DATA_DIR "/models/default/clip"
#define DEFAULT_DEVICE "cpu"
#define DEFAULT_PRECISION GST_MOE_PRECISION_FP32
#define DEFAULT_THREADS 0  // the cores this process may use
#define MAX_THREADS 1024
#define DEFAULT_MAX_BATCH 8
#define MIN_MAX_BATCH 1
#define MAX_MAX_BATCH 4096
#define DEFAULT_MAX_LATENCY (10 * GST_MSECOND)
#define MAX_MAX_LATENCY (3600 * GST_SECOND)
// ~25,000 queries of a 512-wide model (2 KiB of embedding, ~0.4 KiB of key and bookkeeping each).
#define DEFAULT_CACHE_BYTES (G_GUINT64_CONSTANT(64) << 20)
#define DEFAULT_INTERVAL 1
#define DEFAULT_QOS TRUE
// The largest image file a byte stream (filesrc) may hold: beyond any photo whose pixels
// decode_image accepts, and a bound on what a stream without an end can make the element hold.
#define MAX_IMAGE_FILE_BYTES (G_GUINT64_CONSTANT(512) << 20)

#define MOE_ENCODE_VIDEO_FORMATS \
  "{ RGB, RGBx, xRGB, BGR, BGRx, xBGR, RGBA, BGRA, ARGB, ABGR, I420, YV12, NV12, NV21, YUY2, UYVY, GRAY8 }"
// Encoded image files, decoded by the engine's decoder (moe/image_decode.h), as typefind names them.
#define MOE_ENCODE_IMAGE_CAPS                                                                      \
  "image/jpeg; image/png; image/gif; image/bmp; image/tiff; image/webp; image/x-portable-pixmap; " \
  "image/x-portable-graymap; image/x-portable-bitmap; image/x-portable-anymap"

namespace {

constexpr const char* kStage = "moe-encode";

enum class InputKind { None, Text, Video, Image, Request };

using Clock = moe::Batcher::Clock;

// The loaded model, from open() to close().
struct EncodeModel {
  std::shared_ptr<const moe::ClipModel> clip;
  std::string name;  // the directory's basename: the encoder the meta names
  int width = 0;     // projection_dim
  // What the query cache's keys name: the weights' fingerprint, the device and the precision.
  std::string cache_version;
};

// One entry of the queue: a request, already turned into what the engine takes, or one that
// failed (here on arrival, or upstream) and only travels on to be answered.
// A hybrid request is both: its text goes to the text tower, its image to the image tower.
struct Pending {
  gstmoe::RequestRecord record;       // record.text is what text and hybrid requests encode
  std::vector<int32_t> token_ids;     // text and hybrid requests: the text as the encoder takes it
  moe::RgbImage image;                // image and hybrid requests: the image, unless the query cache had it
  std::vector<float> text_cached;     // the text's embedding, when the query cache had it
  std::vector<float> image_cached;    // the image's embedding, when the query cache had it
  std::string text_cache_key;         // a miss: where the text's embedding goes in the query cache
  std::string image_cache_key;        // a miss: where the image's embedding goes in the query cache
  bool control = false;               // a request without a row (a catalog delete): it only travels on
  std::string error;                  // set when it failed: it then only travels as a failure
  std::string failed_stage = kStage;  // where it failed: here, or the upstream stage named in the meta
  const char* error_code = moe::error_code::kInternal;  // its error document's code
  GstClockTime pts = GST_CLOCK_TIME_NONE;               // its buffer's; a batch takes its first entry's
};

// What one run works with: created by start() from the loaded model and the batch limits,
// deleted by stop().
struct EncodeState {
  EncodeState(const EncodeModel& loaded, moe::QueryCache* query_cache, const moe::BatchLimits& limits)
      : model(loaded.clip),
        encoder_name(loaded.name),
        width(static_cast<size_t>(loaded.width)),
        cache_version(loaded.cache_version),
        cache(query_cache),
        batcher(limits) {
    gst_video_info_init(&video_info);
    gst_segment_init(&segment, GST_FORMAT_TIME);
  }
  ~EncodeState() {
    if (converter != nullptr) gst_video_converter_free(converter);
    if (image_file != nullptr) gst_buffer_unref(image_file);
    if (segment_before_caps != nullptr) gst_event_unref(segment_before_caps);
  }
  EncodeState(const EncodeState&) = delete;
  EncodeState& operator=(const EncodeState&) = delete;

  const std::shared_ptr<const moe::ClipModel> model;
  const std::string encoder_name;
  const size_t width;
  const std::string cache_version;
  moe::QueryCache* const cache;  // the element's, which outlives the run

  // The stream, streaming thread only (serialised by the sink pad's stream lock).
  InputKind kind = InputKind::None;
  GstVideoInfo video_info;
  GstVideoConverter* converter = nullptr;  // non-RGB video -> packed RGB, scaled down in the same pass
  int rgb_width = 0, rgb_height = 0;       // the frames' size as packed RGB (the converter's output)
  // Image files: whether upstream sends the stream as one file (a byte stream whose size it knows,
  // as filesrc does) or one file per buffer, asked at the stream's first buffer; the file so far.
  bool image_framing_known = false;
  guint64 image_file_size = 0;  // > 0: the stream is one file of this many bytes
  GstBuffer* image_file = nullptr;
  bool image_file_refused = false;  // larger than MAX_IMAGE_FILE_BYTES: answered, its bytes dropped
  // A segment that came before any caps (filesrc): sent on once the first buffer's type is known,
  // since downstream must see the caps first.
  GstEvent* segment_before_caps = nullptr;
  GstSegment segment;
  bool uri_queried = false;
  std::string stream_uri;
  guint64 frames = 0;    // video frames in this stream, for "frame:<n>"
  guint64 requests = 0;  // requests seen, the id of last resort

  // The queue, the policy over it and the worker, under `lock`. `wake` tells the worker that a
  // batch may leave, and the streaming thread that the queue has room or that it must stop
  // waiting. set_property gives the batcher new limits (holding the object lock, then `lock`).
  std::mutex lock;
  std::condition_variable wake;
  moe::Batcher batcher;
  std::deque<Pending> queue;  // the requests the batcher counts, oldest first
  bool flushing = false;      // from FLUSH_START to FLUSH_STOP, and while stopping: nothing waits for room
  bool worker_stop = false;
  std::thread worker;  // started by start(), joined by stop()
  // Held from taking a batch until it is pushed, and while forwarding serialized events, so that
  // the worker and the streaming thread never reorder output.
  std::mutex push_lock;
  // A failed push whose result could not be returned upstream at once (the worker's, or one
  // ahead of an event); the next chain call returns it.
  std::atomic<GstFlowReturn> deferred_flow{GST_FLOW_OK};
};

}  // namespace

struct _GstMoeEncode {
  GstElement parent;
  GstPad* sinkpad;
  GstPad* srcpad;

  // Properties, under the object lock. model, device, precision and threads are read by open() and refused
  // in other states than NULL; max-batch and max-latency go to the running batcher at once.
  gchar* model;  // nullptr: unset
  gchar* device;
  GstMoePrecision precision;
  guint threads;
  guint max_batch;
  guint64 max_latency;
  guint64 cache_bytes;
  guint interval;
  gboolean qos;

  // The last QoS event's, under the object lock (GstBaseTransform's rule): frames whose running
  // time is not after qos_earliest are late. Reset at start and by flushes.
  gdouble qos_proportion;
  GstClockTime qos_earliest;

  // Behind `stats`, under the object lock: reset at start, kept after stop. While a run lasts the
  // batcher's counters are its own (EncodeState::batcher); stop keeps its last ones here.
  moe::BatcherStats* batcher_stats;
  guint64 rows_failed;       // requests that failed here, on arrival or in the engine
  guint64 rows_hybrid;       // hybrid requests encoded (an image and a text each)
  guint64 frames_processed;  // frames (video, or image files one per buffer) that became requests
  guint64 frames_skipped;    // frames between two that `interval` keeps
  guint64 frames_late;       // frames dropped by QoS
  gdouble encode_ms;         // time in engine calls

  // The query cache, from init to finalize: its entries outlive runs and model changes (their keys
  // name the model version, so a new model misses). It has its own lock. Under the object lock:
  // its counters at start (`stats` counts from there) and at their last report to the metrics.
  moe::QueryCache* query_cache;
  moe::QueryCacheStats* cache_at_start;
  moe::QueryCacheStats* cache_reported;

  // Between open() and close(), nullptr otherwise; under the object lock (read by caps queries).
  EncodeModel* loaded;

  // Between start() and stop(), nullptr otherwise. The streaming thread uses it without a lock;
  // the worker holds its own pointer; property calls, `stats` and FLUSH_START (from any thread)
  // use it under the object lock.
  EncodeState* state;
};

static GstStaticPadTemplate sink_template =
    GST_STATIC_PAD_TEMPLATE("sink", GST_PAD_SINK, GST_PAD_ALWAYS,
                            GST_STATIC_CAPS("text/x-raw, format=(string)utf8; " GST_VIDEO_CAPS_MAKE(
                                MOE_ENCODE_VIDEO_FORMATS) "; " MOE_ENCODE_IMAGE_CAPS "; " GST_MOE_REQUEST_CAPS));
static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));

#define gst_moe_encode_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeEncode, gst_moe_encode, GST_TYPE_ELEMENT,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_encode_debug, "moe-encode", 0, "CLIP encoder"));
GST_ELEMENT_REGISTER_DEFINE(moe_encode, "moe-encode", GST_RANK_NONE, GST_TYPE_MOE_ENCODE);

static void worker_loop(GstMoeEncode* self, EncodeState* st);
static gboolean set_sink_caps(GstMoeEncode* self, EncodeState* st, GstCaps* caps);
static void drop_pending(GstMoeEncode* self, EncodeState* st, const char* why);

/* ----- properties ----- */

// The batcher's limits from the properties; the caller holds the object lock.
static moe::BatchLimits batch_limits(GstMoeEncode* self) {
  return {self->max_batch, std::chrono::nanoseconds(self->max_latency)};
}

// Gives a running batcher the current limits; the caller holds the object lock.
static void update_batch_limits(GstMoeEncode* self) {
  EncodeState* st = self->state;
  if (st == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->batcher.set_limits(batch_limits(self));  // within the ranges of the param specs
  }
  st->wake.notify_all();  // a larger batch leaves room for a waiting streaming thread
}

// Reports what the query cache did since the last report to the metrics; the caller holds the object lock.
static void report_query_cache(GstMoeEncode* self) {
  const moe::QueryCacheStats now = self->query_cache->stats();
  gstmoe::metrics::count_query_cache(*self->cache_reported, now);
  *self->cache_reported = now;
}

static void gst_moe_encode_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  bool refused = false;
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL:
    case PROP_DEVICE:
    case PROP_PRECISION:
    case PROP_THREADS:
      // GStreamer does not enforce the flags: without this, the property would name another
      // model than the one loaded until the element goes back to NULL.
      if (GST_STATE(self) != GST_STATE_NULL) {
        refused = true;
      } else if (prop_id == PROP_MODEL) {
        const gchar* dir = g_value_get_string(value);
        g_free(self->model);
        self->model = dir && *dir ? g_strdup(dir) : nullptr;
      } else if (prop_id == PROP_DEVICE) {
        const gchar* device = g_value_get_string(value);
        g_free(self->device);
        self->device = g_strdup(device ? device : DEFAULT_DEVICE);
      } else if (prop_id == PROP_THREADS) {
        self->threads = g_value_get_uint(value);
      } else {
        self->precision = static_cast<GstMoePrecision>(g_value_get_enum(value));
      }
      break;
    case PROP_MAX_BATCH:
      self->max_batch = g_value_get_uint(value);
      update_batch_limits(self);
      break;
    case PROP_MAX_LATENCY:
      self->max_latency = g_value_get_uint64(value);
      update_batch_limits(self);
      break;
    case PROP_CACHE_BYTES:
      self->cache_bytes = g_value_get_uint64(value);
      self->query_cache->set_capacity(self->cache_bytes);  // the running worker's next lookup sees it
      report_query_cache(self);                            // the evictions
      break;
    case PROP_INTERVAL:
      self->interval = g_value_get_uint(value);
      break;
    case PROP_QOS:
      self->qos = g_value_get_boolean(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
  if (refused) g_warning("moe-encode: changing '%s' is only possible in the NULL state", g_param_spec_get_name(pspec));
  // Posting takes the object lock: after releasing it.
  if (prop_id == PROP_MAX_LATENCY)
    gst_element_post_message(GST_ELEMENT(self), gst_message_new_latency(GST_OBJECT(self)));
}

// The `stats` structure: the batcher's counters and the encoder's; the caller holds the object lock.
static GstStructure* encode_stats(GstMoeEncode* self) {
  moe::BatcherStats b;
  if (EncodeState* st = self->state) {
    std::lock_guard<std::mutex> lk(st->lock);
    b = st->batcher.stats();
  } else {
    b = *self->batcher_stats;
  }
  GValue by_size = G_VALUE_INIT;
  gst_value_array_init(&by_size, static_cast<guint>(b.batches_by_size.size()));
  for (const uint64_t n : b.batches_by_size) {
    GValue v = G_VALUE_INIT;
    g_value_init(&v, G_TYPE_UINT64);
    g_value_set_uint64(&v, n);
    gst_value_array_append_and_take_value(&by_size, &v);
  }
  const moe::QueryCacheStats c = self->query_cache->stats();
  const moe::QueryCacheStats& c0 = *self->cache_at_start;
  GstStructure* s = gst_structure_new(
      "moe-encode-stats", "requests", G_TYPE_UINT64, static_cast<guint64>(b.requests), "batches", G_TYPE_UINT64,
      static_cast<guint64>(b.batches), "rows-failed", G_TYPE_UINT64, self->rows_failed, "rows-hybrid", G_TYPE_UINT64,
      self->rows_hybrid, "encode-ms", G_TYPE_DOUBLE, self->encode_ms, "queue-wait-ms", G_TYPE_DOUBLE, b.wait_ms_total,
      "queue-wait-max-ms", G_TYPE_DOUBLE, b.wait_ms_max, "late", G_TYPE_UINT64, static_cast<guint64>(b.late),
      "cache-hits", G_TYPE_UINT64, static_cast<guint64>(c.hits - c0.hits), "cache-misses", G_TYPE_UINT64,
      static_cast<guint64>(c.misses - c0.misses), "cache-evictions", G_TYPE_UINT64,
      static_cast<guint64>(c.evictions - c0.evictions), "cache-refused", G_TYPE_UINT64,
      static_cast<guint64>(c.refused - c0.refused), "cache-entries", G_TYPE_UINT64, static_cast<guint64>(c.entries),
      "cache-held-bytes", G_TYPE_UINT64, static_cast<guint64>(c.bytes), "frames-skipped", G_TYPE_UINT64,
      self->frames_skipped, "frames-late", G_TYPE_UINT64, self->frames_late, nullptr);
  gst_structure_take_value(s, "batches-by-size", &by_size);
  return s;
}

static void gst_moe_encode_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_MODEL:
      g_value_set_string(value, self->model);
      break;
    case PROP_DEVICE:
      g_value_set_string(value, self->device);
      break;
    case PROP_PRECISION:
      g_value_set_enum(value, self->precision);
      break;
    case PROP_THREADS:
      g_value_set_uint(value, self->threads);
      break;
    case PROP_MAX_BATCH:
      g_value_set_uint(value, self->max_batch);
      break;
    case PROP_MAX_LATENCY:
      g_value_set_uint64(value, self->max_latency);
      break;
    case PROP_CACHE_BYTES:
      g_value_set_uint64(value, self->cache_bytes);
      break;
    case PROP_INTERVAL:
      g_value_set_uint(value, self->interval);
      break;
    case PROP_QOS:
      g_value_set_boolean(value, self->qos);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, encode_stats(self));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

/* ----- open/close, start/stop ----- */

// NULL->READY: loads the model (or shares the one loaded for the same directory, device and
// precision). A missing directory and a bad setting are different errors, both naming the path.
static gboolean gst_moe_encode_open(GstMoeEncode* self) {
  GST_OBJECT_LOCK(self);
  const std::string path = self->model ? self->model : "";
  moe::ComputeOptions options;
  options.device = self->device;
  options.threads = static_cast<int>(self->threads);
  const GstMoePrecision precision = self->precision;
  GST_OBJECT_UNLOCK(self);
  options.precision = gstmoe::weight_type(precision);
  if (path.empty()) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("No CLIP model set: set the 'model' property to a model directory"),
                      (nullptr));
    return FALSE;
  }
  // The device first, so that an unusable one is reported as such (moe::Error names the device
  // and the reason, e.g. no usable CUDA device and why).
  std::string reason;
  try {
    moe::resolve_device(options.device, &reason);
  } catch (const std::exception& e) {
    GST_ELEMENT_ERROR(self, RESOURCE, SETTINGS, ("Cannot run the CLIP model: %s", e.what()),
                      ("device=%s model=%s", options.device.c_str(), path.c_str()));
    return FALSE;
  }
  auto loaded = std::make_unique<EncodeModel>();
  const int64_t load_start = g_get_monotonic_time();
  try {
    loaded->clip = moe::shared_clip_model(path, options);
  } catch (const std::exception& e) {  // moe::Error names the file (or the device) and the reason
    if (g_file_test(path.c_str(), G_FILE_TEST_EXISTS))
      GST_ELEMENT_ERROR(
          self, RESOURCE, SETTINGS, ("Cannot load the CLIP model: %s", e.what()),
          ("model=%s device=%s precision=%s", path.c_str(), options.device.c_str(), gstmoe::precision_nick(precision)));
    else if (path == DEFAULT_MODEL)
      GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND,
                        ("No CLIP model: 'model' is not set and the default, the shipped model of an installed "
                         "gst-moe (%s), is not there: set 'model' to a CLIP directory, or install gst-moe "
                         "(meson install)",
                         path.c_str()),
                        ("%s", e.what()));
    else
      GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND, ("Cannot load the CLIP model: %s", e.what()),
                        ("model directory '%s' does not exist", path.c_str()));
    return FALSE;
  }
  gstmoe::metrics::observe_model_load("encoder", load_start);
  gstmoe::metrics::watch_device_memory(loaded->clip);
  gchar* base = g_path_get_basename(path.c_str());
  loaded->name = base;
  g_free(base);
  loaded->width = loaded->clip->config().projection_dim;
  loaded->cache_version =
      loaded->clip->fingerprint() + "/" + loaded->clip->device() + "/" + gstmoe::precision_nick(precision);
  GST_INFO_OBJECT(self, "loaded CLIP model %s on %s with %s weights (projection_dim %d; %s)", path.c_str(),
                  loaded->clip->device().c_str(), gstmoe::precision_nick(precision), loaded->width, reason.c_str());
  GST_OBJECT_LOCK(self);
  self->loaded = loaded.release();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

// READY->NULL.
static void gst_moe_encode_close(GstMoeEncode* self) {
  GST_OBJECT_LOCK(self);
  EncodeModel* loaded = self->loaded;
  self->loaded = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete loaded;  // the cache frees the model when its last user lets go
}

// READY->PAUSED, before the pads activate: a new running state and its worker; `stats` counts
// from here.
static void gst_moe_encode_start(GstMoeEncode* self) {
  GST_OBJECT_LOCK(self);
  auto* st = new EncodeState(*self->loaded, self->query_cache, batch_limits(self));
  *self->batcher_stats = moe::BatcherStats();
  *self->cache_at_start = self->query_cache->stats();
  self->rows_failed = self->rows_hybrid = 0;
  self->encode_ms = 0.0;
  self->frames_processed = self->frames_skipped = self->frames_late = 0;
  self->qos_proportion = 1.0;
  self->qos_earliest = GST_CLOCK_TIME_NONE;
  self->state = st;
  GST_OBJECT_UNLOCK(self);
  st->worker = std::thread(worker_loop, self, st);
}

// PAUSED->READY, once the pads are inactive (no chain call runs, pushes return FLUSHING); also
// when READY->PAUSED fails after start().
static void gst_moe_encode_stop(GstMoeEncode* self) {
  // Only state changes (serialised) and finalize write the pointer: read here without the lock.
  EncodeState* st = self->state;
  if (st == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->worker_stop = true;
  }
  st->wake.notify_all();
  if (st->worker.joinable()) st->worker.join();
  drop_pending(self, st, "stop");
  GST_OBJECT_LOCK(self);
  *self->batcher_stats = st->batcher.stats();  // `stats` keeps the run's counts
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete st;
}

// Forgets the last QoS event (after a flush, the old running times mean nothing).
static void reset_qos(GstMoeEncode* self) {
  GST_OBJECT_LOCK(self);
  self->qos_proportion = 1.0;
  self->qos_earliest = GST_CLOCK_TIME_NONE;
  GST_OBJECT_UNLOCK(self);
}

// While flushing (or stopping), the streaming thread stops waiting for room in the queue.
static void set_flushing(EncodeState* st, bool flushing) {
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->flushing = flushing;
  }
  st->wake.notify_all();
}

static GstStateChangeReturn gst_moe_encode_change_state(GstElement* element, GstStateChange transition) {
  GstMoeEncode* self = GST_MOE_ENCODE(element);
  switch (transition) {
    case GST_STATE_CHANGE_NULL_TO_READY:
      if (!gst_moe_encode_open(self)) return GST_STATE_CHANGE_FAILURE;
      break;
    case GST_STATE_CHANGE_READY_TO_PAUSED:
      gst_moe_encode_start(self);
      break;
    case GST_STATE_CHANGE_PAUSED_TO_READY:
      set_flushing(self->state, true);  // a chain call waiting for room returns, so the pads can deactivate
      break;
    default:
      break;
  }

  const GstStateChangeReturn ret = GST_ELEMENT_CLASS(parent_class)->change_state(element, transition);
  if (ret == GST_STATE_CHANGE_FAILURE) {
    if (transition == GST_STATE_CHANGE_NULL_TO_READY) gst_moe_encode_close(self);
    if (transition == GST_STATE_CHANGE_READY_TO_PAUSED) gst_moe_encode_stop(self);
    if (transition == GST_STATE_CHANGE_PAUSED_TO_READY) set_flushing(self->state, false);  // still running
    return ret;
  }

  switch (transition) {
    case GST_STATE_CHANGE_PAUSED_TO_READY:
      gst_moe_encode_stop(self);
      break;
    case GST_STATE_CHANGE_READY_TO_NULL:
      gst_moe_encode_close(self);
      break;
    default:
      break;
  }
  return ret;
}

/* ----- requests ----- */

// "<seconds>" with at most microsecond precision and no trailing zeros, for "#t=" fragments.
static std::string media_seconds(GstClockTime t) {
  std::string s = std::to_string(t / GST_SECOND) + "." + std::to_string(1000000 + (t % GST_SECOND) / 1000).substr(1);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  return s;
}

// The uri of the stream feeding the sink pad, asked once per stream (empty when unknown).
static const std::string& upstream_uri(GstMoeEncode* self, EncodeState* st) {
  if (!st->uri_queried) {
    st->uri_queried = true;
    GstQuery* query = gst_query_new_uri();
    gchar* uri = nullptr;
    if (gst_pad_peer_query(self->sinkpad, query)) gst_query_parse_uri(query, &uri);
    st->stream_uri = uri != nullptr ? uri : "";
    GST_DEBUG_OBJECT(self, "upstream uri: %s", uri != nullptr ? uri : "(none)");
    g_free(uri);
    gst_query_unref(query);
  }
  return st->stream_uri;
}

// The uri of a video frame without one in its meta: the stream's uri at the frame's time
// (a media fragment), else its position in the stream.
static std::string frame_uri(GstMoeEncode* self, EncodeState* st, GstBuffer* buf, guint64 frame) {
  const std::string& uri = upstream_uri(self, st);
  GstClockTime t = GST_BUFFER_PTS(buf);
  if (GST_CLOCK_TIME_IS_VALID(t) && st->segment.format == GST_FORMAT_TIME)
    t = gst_segment_to_stream_time(&st->segment, GST_FORMAT_TIME, t);
  if (!uri.empty() && GST_CLOCK_TIME_IS_VALID(t)) return uri + "#t=" + media_seconds(t);
  return "frame:" + std::to_string(frame);
}

// A video frame as packed RGB8: copied when it is RGB already, else through the converter.
static void frame_to_rgb(EncodeState* st, GstBuffer* buf, moe::RgbImage* image, std::string* error) {
  GstVideoFrame in;
  if (!gst_video_frame_map(&in, &st->video_info, buf, GST_MAP_READ)) {
    *error = "video frame of " + std::to_string(gst_buffer_get_size(buf)) + " bytes does not match its caps (" +
             std::to_string(st->video_info.size) + " bytes expected)";
    return;
  }
  const int w = st->rgb_width, h = st->rgb_height;
  const size_t row = static_cast<size_t>(w) * 3;
  image->width = w;
  image->height = h;
  image->pixels.resize(row * static_cast<size_t>(h));
  if (st->converter == nullptr) {
    const auto* src = static_cast<const uint8_t*>(GST_VIDEO_FRAME_PLANE_DATA(&in, 0));
    const size_t stride = static_cast<size_t>(GST_VIDEO_FRAME_PLANE_STRIDE(&in, 0));
    for (int y = 0; y < h; ++y) std::memcpy(image->pixels.data() + y * row, src + y * stride, row);
  } else {
    // Convert straight into the image's memory, described as an RGB frame with a packed stride.
    GstVideoInfo out_info;
    gst_video_info_set_format(&out_info, GST_VIDEO_FORMAT_RGB, w, h);
    out_info.stride[0] = static_cast<gint>(row);
    out_info.size = image->pixels.size();
    GstBuffer* out_buf = gst_buffer_new_wrapped_full(static_cast<GstMemoryFlags>(0), image->pixels.data(),
                                                     image->pixels.size(), 0, image->pixels.size(), nullptr, nullptr);
    GstVideoFrame out;
    gst_video_frame_map(&out, &out_info, out_buf, GST_MAP_WRITE);
    gst_video_converter_frame(st->converter, &in, &out);
    gst_video_frame_unmap(&out);
    gst_buffer_unref(out_buf);
  }
  gst_video_frame_unmap(&in);
}

// The payload of a text or request buffer as a string.
static std::string buffer_bytes(GstBuffer* buf) {
  std::string bytes(gst_buffer_get_size(buf), '\0');
  gst_buffer_extract(buf, 0, bytes.data(), bytes.size());
  return bytes;
}

// Looks one tower's input up in the query cache: a hit carries its embedding from here on (into
// `cached`), a miss the key its embedding will be stored under (into `cache_key`).
static void look_up(EncodeState* st, std::string key, std::vector<float>* cached, std::string* cache_key) {
  if (!st->cache->lookup(key, cached)) *cache_key = std::move(key);
}

// "text request 'q1'", "hybrid request 'q2'": how messages name a request.
static std::string request_name(const gstmoe::RequestRecord& r) {
  return std::string(gstmoe::modality_name(r.modality)) + " request '" + r.id + "'";
}

static bool caching(EncodeState* st) { return st->cache->stats().capacity_bytes > 0; }

// Checks the text of a text or hybrid request here, since the engine would reject invalid UTF-8 for
// the whole batch, and tokenises it here rather than in encode_texts, so that its ids key the query
// cache.
static void set_text(EncodeState* st, Pending* p, const std::string& text) {
  const gchar* end = nullptr;
  if (g_utf8_validate_len(text.data(), text.size(), &end)) {
    p->record.text = text;
    const moe::ClipModel& model = *st->model;
    try {  // as encode_texts does
      p->token_ids = model.tokenizer().encode(text, static_cast<size_t>(model.config().text.max_position_embeddings));
    } catch (const std::exception& e) {  // no tokenizer in the model directory
      p->error = request_name(p->record) + " cannot be encoded: " + e.what();
      return;
    }
    if (caching(st))
      look_up(st, moe::QueryCache::text_key(st->cache_version, p->token_ids), &p->text_cached, &p->text_cache_key);
    return;
  }
  const std::string offset = std::to_string(end - text.data());
  // A NUL is valid UTF-8 but not text: typically the terminator of a C string an app pushed.
  p->error = request_name(p->record) + " " +
             (*end == '\0' ? "holds a NUL byte at offset " + offset + " (push the text without its terminator)"
                           : "is not valid UTF-8 (invalid byte at offset " + offset + ")");
  p->error_code = moe::error_code::kInvalidRequest;
  // The error document quotes the query: keep it valid UTF-8 (U+FFFD for bad bytes).
  gchar* valid = g_utf8_make_valid(text.data(), static_cast<gssize>(text.size()));
  p->record.text = valid;
  g_free(valid);
}

// Decodes the image of an image or hybrid request, unless the query cache has the embedding of the
// same file bytes.
static void set_encoded_image(EncodeState* st, Pending* p, GstBuffer* buf) {
  std::string what = request_name(p->record);
  if (!p->record.uri.empty()) what += " (" + p->record.uri + ")";
  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READ)) {
    p->error = what + ": cannot map the buffer";
    return;
  }
  if (caching(st))
    look_up(st, moe::QueryCache::image_file_key(st->cache_version, map.data, map.size), &p->image_cached,
            &p->image_cache_key);
  if (!p->image_cached.empty()) {
    gst_buffer_unmap(buf, &map);
    return;
  }
  try {
    p->image = moe::decode_image(map.data, map.size, what);
  } catch (const std::exception& e) {  // moe::Error, or out of memory: a bad request either way
    p->error = e.what();
    p->error_code = moe::error_code::kImageUndecodable;
  }
  gst_buffer_unmap(buf, &map);
}

// Fills what an upstream meta may leave unset: the id (buffer offset, else the request count)
// and the arrival times.
static void complete_record(gstmoe::RequestRecord* r, GstBuffer* buf, guint64 n, int64_t wall, int64_t mono) {
  if (r->id.empty()) r->id = std::to_string(GST_BUFFER_OFFSET_IS_VALID(buf) ? GST_BUFFER_OFFSET(buf) : n);
  if (r->arrival_wall_us == 0) r->arrival_wall_us = wall;
  if (r->arrival_mono_us == 0) r->arrival_mono_us = mono;
}

// The queue entries of an input buffer's own request (normally one; none when the buffer only
// carries upstream failures or controls). Runs in the streaming thread.
static void add_request(GstMoeEncode* self, EncodeState* st, GstBuffer* buf, const gstmoe::BatchRecords* in,
                        std::vector<Pending>* out) {
  const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
  const guint64 n = st->requests++;
  if (st->kind == InputKind::Request && (in == nullptr || in->rows.size() != 1)) {
    // Only upstream failures or controls: not a request of its own.
    if (in != nullptr && in->rows.empty() && (!in->failed.empty() || !in->controls.empty())) return;
    // A malformed request buffer: every request it names is answered with an error.
    const std::vector<gstmoe::RequestRecord> rows =
        in != nullptr && !in->rows.empty() ? in->rows : std::vector<gstmoe::RequestRecord>(1);
    for (const gstmoe::RequestRecord& row : rows) {
      Pending p;
      p.record = row;
      complete_record(&p.record, buf, n, wall, mono);
      p.error =
          "request '" + p.record.id + "': its buffer carries " +
          (in == nullptr ? std::string("no GstMoeBatchMeta") : std::to_string(in->rows.size()) + " request rows") +
          ", expected exactly one request per buffer";
      out->push_back(std::move(p));
    }
    return;
  }

  Pending p;
  if (in != nullptr && !in->rows.empty()) p.record = in->rows.front();
  complete_record(&p.record, buf, n, wall, mono);
  switch (st->kind) {
    case InputKind::Text:
      p.record.modality = gstmoe::Modality::Text;
      set_text(st, &p, buffer_bytes(buf));
      break;
    case InputKind::Video:
    case InputKind::Image: {
      const guint64 frame = st->frames++;
      p.record.modality = gstmoe::Modality::Image;
      // A stream that is one file (filesrc) is named by its uri, a frame by its time in the stream.
      if (p.record.uri.empty())
        p.record.uri = st->image_file_size > 0 && !upstream_uri(self, st).empty() ? upstream_uri(self, st)
                                                                                  : frame_uri(self, st, buf, frame);
      // Each frame keeps its own time: the batch buffer carries only its first frame's PTS.
      p.record.pts = GST_BUFFER_PTS(buf);
      if (GST_CLOCK_TIME_IS_VALID(p.record.pts) && st->segment.format == GST_FORMAT_TIME)
        p.record.stream_time = gst_segment_to_stream_time(&st->segment, GST_FORMAT_TIME, p.record.pts);
      if (st->kind == InputKind::Video)
        frame_to_rgb(st, buf, &p.image, &p.error);
      else
        set_encoded_image(st, &p, buf);
      break;
    }
    case InputKind::Request:
      switch (p.record.modality) {
        case gstmoe::Modality::Text:
          set_text(st, &p, buffer_bytes(buf));
          break;
        case gstmoe::Modality::Hybrid: {  // the buffer holds the image, the record the text
          const std::string text = p.record.text;
          if (text.empty()) {
            p.error = request_name(p.record) + " has no text: a hybrid request carries its text in its record";
            p.error_code = moe::error_code::kInvalidRequest;
            break;
          }
          set_text(st, &p, text);
          if (p.error.empty()) set_encoded_image(st, &p, buf);
          break;
        }
        case gstmoe::Modality::Image:
        case gstmoe::Modality::Tensor:  // not a request's: the bytes are taken as an image file
          set_encoded_image(st, &p, buf);
          break;
      }
      break;
    case InputKind::None:  // refused by the chain function
      break;
  }
  out->push_back(std::move(p));
}

// Turns an input buffer into queue entries: the upstream failures its meta carries, its request,
// then its controls (row-less requests, such as catalog deletes, which keep their place in the
// queue so that they leave after the rows that came before them). Runs in the streaming thread.
static std::vector<Pending> collect_requests(GstMoeEncode* self, EncodeState* st, GstBuffer* buf) {
  const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  const gstmoe::BatchRecords* in = meta != nullptr ? meta->records : nullptr;
  std::vector<Pending> out;
  if (in != nullptr) {
    for (const gstmoe::FailedRequest& f : in->failed) {
      Pending p;
      p.record = f.request;
      p.error = f.reason;
      p.failed_stage = f.stage;
      p.error_code = f.code;
      out.push_back(std::move(p));
    }
  }
  add_request(self, st, buf, in, &out);
  if (in != nullptr) {
    for (const gstmoe::RequestRecord& control : in->controls) {
      Pending p;
      p.record = control;
      p.control = true;
      out.push_back(std::move(p));
    }
  }
  for (Pending& p : out) p.pts = GST_BUFFER_PTS(buf);
  return out;
}

/* ----- encoding ----- */

static bool uses_text(gstmoe::Modality m) { return m == gstmoe::Modality::Text || m == gstmoe::Modality::Hybrid; }
static bool uses_image(gstmoe::Modality m) { return m != gstmoe::Modality::Text; }

// One output buffer of a batch: rows, with their records, and the controls that follow them.
struct OutputBuffer {
  gstmoe::BatchRecords records;
  std::vector<const float*> rows;  // each row's embedding (width floats), in records.rows order
  GstClockTime pts = GST_CLOCK_TIME_NONE;
};

// Encodes a batch into tensor buffers: the texts the query cache did not hold (of text and hybrid
// requests) with one encode_token_ids call, such images (of image and hybrid requests) with one
// encode_images call, rows in arrival order; a hybrid request's row is its image's embedding, its
// text's goes in its record. Failures go to the meta's failed list, the misses' embeddings to the
// query cache. Controls keep their place: a buffer's controls come after its rows, so a row that
// arrived after a control starts another buffer (a batch without controls is one buffer).
static std::vector<GstBuffer*> encode_batch(GstMoeEncode* self, EncodeState* st, std::vector<Pending>& batch) {
  const size_t width = st->width;
  const int64_t start = g_get_monotonic_time();
  const moe::ClipModel& model = *st->model;

  std::vector<std::vector<int32_t>> token_ids;
  std::vector<moe::ImageView> images;
  // Index into token_ids or images; unused for hits and for the tower a request does not use.
  std::vector<size_t> text_slot(batch.size()), image_slot(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    Pending& p = batch[i];
    if (!p.error.empty() || p.control) continue;
    if (uses_text(p.record.modality) && p.text_cached.empty()) {
      text_slot[i] = token_ids.size();
      token_ids.push_back(std::move(p.token_ids));
    }
    if (uses_image(p.record.modality) && p.image_cached.empty()) {
      image_slot[i] = images.size();
      images.push_back(p.image.view());
    }
  }
  const moe::BatchRows text_rows =
      moe::run_isolating_failures(token_ids, width, [&](const auto& v) { return model.encode_token_ids(v).embeds; });
  const moe::BatchRows image_rows =
      moe::run_isolating_failures(images, width, [&](const auto& v) { return model.encode_images(v).embeds; });
  const int64_t end = g_get_monotonic_time();
  const double encode_ms = gstmoe::elapsed_ms(start, end);
  gstmoe::metrics::count_encoded_batch(batch.size(), encode_ms);

  std::vector<OutputBuffer> out(1);
  out.back().pts = batch.front().pts;
  size_t rows_total = 0;
  guint64 failed_here = 0, hybrid = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Pending& p = batch[i];
    if (p.control) {
      out.back().records.controls.push_back(std::move(p.record));
      continue;
    }
    const gstmoe::Modality modality = p.record.modality;
    // One tower's embedding of the request: the query cache's, or the encoder's; null when the
    // encoder failed on it (the reason then goes to p.error).
    const auto embedding = [&](const std::vector<float>& cached, const moe::BatchRows& rows, size_t slot,
                               const char* tower) -> const float* {
      if (!cached.empty()) return cached.data();
      if (rows.errors[slot].empty()) return rows.values.data() + slot * width;
      p.error = request_name(p.record) + " cannot be encoded: " +
                (modality == gstmoe::Modality::Hybrid ? std::string("its ") + tower + ": " : std::string()) +
                rows.errors[slot];
      return nullptr;
    };
    const float* text = nullptr;
    const float* image = nullptr;
    if (p.error.empty() && uses_text(modality)) text = embedding(p.text_cached, text_rows, text_slot[i], "text");
    if (p.error.empty() && uses_image(modality)) image = embedding(p.image_cached, image_rows, image_slot[i], "image");
    if (!p.error.empty()) {
      if (p.failed_stage == kStage) ++failed_here;
      out.back().records.failed.push_back(
          {std::move(p.record), std::move(p.failed_stage), std::move(p.error), p.error_code});
      continue;
    }
    if (!p.text_cache_key.empty()) st->cache->insert(p.text_cache_key, text, width);
    if (!p.image_cache_key.empty()) st->cache->insert(p.image_cache_key, image, width);
    if (modality == gstmoe::Modality::Hybrid) {
      p.record.text_embedding.assign(text, text + width);
      ++hybrid;
    }
    // A hit leaves with its batch, after the encoder: its latency includes the batch's encoding.
    p.record.timings_ms.emplace_back("queue", gstmoe::elapsed_ms(p.record.arrival_mono_us, start));
    p.record.timings_ms.emplace_back("encode", encode_ms);
    if (!out.back().records.controls.empty()) {
      out.emplace_back();
      out.back().pts = p.pts;
    }
    out.back().records.rows.push_back(std::move(p.record));
    out.back().rows.push_back(modality == gstmoe::Modality::Text ? text : image);
    ++rows_total;
  }
  GST_OBJECT_LOCK(self);
  self->rows_failed += failed_here;
  self->rows_hybrid += hybrid;
  self->encode_ms += encode_ms;
  report_query_cache(self);
  GST_OBJECT_UNLOCK(self);

  std::vector<GstBuffer*> buffers;
  for (OutputBuffer& o : out) {
    gstmoe::BatchRecords& records = o.records;
    records.encoder = st->encoder_name;
    records.encoder_fingerprint = model.fingerprint();
    // The rows encoded together, whichever buffer they leave in: their cost shares the batch's time.
    for (gstmoe::RequestRecord& r : records.rows) r.batch_rows = rows_total;
    GstBuffer* buf;
    if (o.rows.empty()) {
      buf = gst_buffer_new();
    } else {
      buf = gst_buffer_new_allocate(nullptr, o.rows.size() * width * sizeof(float), nullptr);
      GstMapInfo map;
      gst_buffer_map(buf, &map, GST_MAP_WRITE);
      for (size_t r = 0; r < o.rows.size(); ++r)
        std::memcpy(map.data + r * width * sizeof(float), o.rows[r], width * sizeof(float));
      gst_buffer_unmap(buf, &map);
    }
    GST_BUFFER_PTS(buf) = o.pts;
    GST_BUFFER_DTS(buf) = GST_CLOCK_TIME_NONE;
    GST_BUFFER_DURATION(buf) = GST_CLOCK_TIME_NONE;
    gst_buffer_add_moe_batch_meta(buf, records);
    buffers.push_back(buf);
  }
  GST_LOG_OBJECT(self,
                 "batch: %zu rows (%" G_GUINT64_FORMAT " hybrid), %zu entries, in %zu buffers, encoded in %.3f ms",
                 rows_total, hybrid, batch.size(), buffers.size(), encode_ms);
  return buffers;
}

/* ----- the queue and the worker ----- */

// Takes the batch that the batcher lets leave now, encodes and pushes it, and sets `ret` to the
// push's result; false when no batch may leave. The caller holds push_lock, so batches are
// pushed in the order they were taken.
static bool push_next_batch(GstMoeEncode* self, EncodeState* st, GstFlowReturn* ret) {
  std::vector<Pending> batch;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    const size_t n = st->batcher.take(Clock::now());
    if (n == 0) return false;
    const auto taken = st->queue.begin() + static_cast<std::ptrdiff_t>(n);
    batch.assign(std::make_move_iterator(st->queue.begin()), std::make_move_iterator(taken));
    st->queue.erase(st->queue.begin(), taken);
  }
  st->wake.notify_all();  // room for the streaming thread, which queues on while this batch runs
  // In order; after a failed push the rest would fail too (flushing, not linked...): dropped.
  *ret = GST_FLOW_OK;
  for (GstBuffer* buf : encode_batch(self, st, batch)) {
    if (*ret == GST_FLOW_OK)
      *ret = gst_pad_push(self->srcpad, buf);
    else
      gst_buffer_unref(buf);
  }
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->batcher.finished();
  }
  st->wake.notify_all();  // what queued meanwhile may leave now
  return true;
}

// Keeps the result of a push that no chain call made (the worker's, or one ahead of an event) for
// the next chain call to return upstream. With `report_now`, a fatal result is also posted at
// once, as queue does: the next chain call may never come (after EOS, or a live source that
// receives no more requests).
static void defer_flow(GstMoeEncode* self, EncodeState* st, GstFlowReturn ret, bool report_now) {
  st->deferred_flow = ret;
  if (report_now && (ret == GST_FLOW_NOT_LINKED || ret < GST_FLOW_EOS)) GST_ELEMENT_FLOW_ERROR(self, ret);
}

// The worker: runs every batch the batcher lets leave, as soon as it may.
static void worker_loop(GstMoeEncode* self, EncodeState* st) {
  std::unique_lock<std::mutex> lk(st->lock);
  while (!st->worker_stop) {
    if (!st->batcher.ready()) {
      st->wake.wait(lk);
      continue;
    }
    lk.unlock();
    {
      std::lock_guard<std::mutex> push(st->push_lock);
      GstFlowReturn ret;
      if (push_next_batch(self, st, &ret) && ret != GST_FLOW_OK) {
        GST_DEBUG_OBJECT(self, "push: %s", gst_flow_get_name(ret));
        defer_flow(self, st, ret, /*report_now=*/true);
      }
    }
    lk.lock();
  }
}

static void drop_pending(GstMoeEncode* self, EncodeState* st, const char* why) {
  std::lock_guard<std::mutex> lk(st->lock);
  if (const size_t n = st->batcher.drop()) GST_INFO_OBJECT(self, "%s: dropping %zu pending requests", why, n);
  st->queue.clear();
}

// Queues a buffer's requests for the worker, first waiting while a whole batch is queued already
// (the batcher is full: the encoder is busy, so requests would only wait here instead of
// upstream). Runs in the streaming thread.
static GstFlowReturn enqueue(EncodeState* st, std::vector<Pending>&& requests) {
  {
    std::unique_lock<std::mutex> lk(st->lock);
    st->wake.wait(lk, [st] { return !st->batcher.full() || st->flushing; });
    if (st->flushing) return GST_FLOW_FLUSHING;
    st->batcher.arrived(Clock::now(), requests.size());
    for (Pending& p : requests) st->queue.push_back(std::move(p));
  }
  st->wake.notify_all();
  return GST_FLOW_OK;
}

/* ----- frames and image files ----- */

// Whether a frame is dropped before it is converted: left out by `interval`, or late by the last
// QoS event (GstBaseTransform's rule: its running time is not after the event's timestamp +
// jitter), which is counted and posted as a QoS message. Runs in the streaming thread.
static bool drop_frame(GstMoeEncode* self, EncodeState* st, GstBuffer* buf) {
  GST_OBJECT_LOCK(self);
  if (st->frames % self->interval != 0) {
    ++self->frames_skipped;
    GST_OBJECT_UNLOCK(self);
    return true;
  }
  const GstClockTime earliest = self->qos_earliest, pts = GST_BUFFER_PTS(buf);
  const gdouble proportion = self->qos_proportion;
  GstClockTime running = GST_CLOCK_TIME_NONE;
  if (self->qos && GST_CLOCK_TIME_IS_VALID(earliest) && GST_CLOCK_TIME_IS_VALID(pts) &&
      st->segment.format == GST_FORMAT_TIME)
    running = gst_segment_to_running_time(&st->segment, GST_FORMAT_TIME, pts);
  if (!GST_CLOCK_TIME_IS_VALID(running) || running > earliest) {
    ++self->frames_processed;
    GST_OBJECT_UNLOCK(self);
    return false;
  }
  const guint64 processed = self->frames_processed, late = ++self->frames_late;
  GST_OBJECT_UNLOCK(self);
  GST_LOG_OBJECT(self, "dropping late frame %" GST_TIME_FORMAT, GST_TIME_ARGS(pts));
  GstMessage* msg = gst_message_new_qos(GST_OBJECT(self), FALSE, running,
                                        gst_segment_to_stream_time(&st->segment, GST_FORMAT_TIME, pts), pts,
                                        GST_BUFFER_DURATION(buf));
  gst_message_set_qos_values(msg, GST_CLOCK_DIFF(running, earliest), proportion, 1000000);
  gst_message_set_qos_stats(msg, GST_FORMAT_BUFFERS, processed, late);
  gst_element_post_message(GST_ELEMENT(self), msg);
  return true;
}

// Recognises an image file from the first buffer of a stream without caps (filesrc) and takes
// it as that image's caps; false when the bytes are not an image file the engine decodes.
static bool typefind_image(GstMoeEncode* self, EncodeState* st, GstBuffer* buf) {
  static GstStaticCaps image_caps = GST_STATIC_CAPS(MOE_ENCODE_IMAGE_CAPS);
  GstCaps* found = gst_type_find_helper_for_buffer(GST_OBJECT(self), buf, nullptr);
  if (found == nullptr) return false;
  GstCaps* accepted = gst_static_caps_get(&image_caps);
  bool ok = gst_caps_can_intersect(found, accepted);
  gst_caps_unref(accepted);
  if (ok) {
    GST_INFO_OBJECT(self, "no caps: the bytes are %" GST_PTR_FORMAT, found);
    std::lock_guard<std::mutex> push(st->push_lock);
    ok = set_sink_caps(self, st, found);
    if (ok && st->segment_before_caps != nullptr) gst_pad_push_event(self->srcpad, st->segment_before_caps);
    st->segment_before_caps = nullptr;
  }
  gst_caps_unref(found);
  return ok;
}

// Whether the stream is one image file or one file per buffer. A byte stream whose size upstream
// knows (filesrc, also behind typefind, reads one file in blocks of 4 KiB) is one file; anything
// else (multifilesrc, parsers, cameras, appsrc) sends whole files, one per buffer, as jpegdec and
// pngdec take them when their input is parsed.
static void set_image_framing(GstMoeEncode* self, EncodeState* st) {
  st->image_framing_known = true;
  st->image_file_size = 0;
  gint64 size = -1;
  if (st->segment.format == GST_FORMAT_BYTES && gst_pad_peer_query_duration(self->sinkpad, GST_FORMAT_BYTES, &size) &&
      size > 0)
    st->image_file_size = static_cast<guint64>(size);
  GST_DEBUG_OBJECT(self, "image stream: %s",
                   st->image_file_size > 0 ? "one file (a byte stream of known size)" : "one file per buffer");
}

// Adds a block of a byte stream to the image file it holds; returns the file once its size is
// reached, else nullptr.
static GstBuffer* add_to_image_file(EncodeState* st, GstBuffer* block) {
  st->image_file = st->image_file != nullptr ? gst_buffer_append(st->image_file, block) : block;
  if (gst_buffer_get_size(st->image_file) < st->image_file_size) return nullptr;
  GstBuffer* file = st->image_file;
  st->image_file = nullptr;
  return file;
}

// A byte stream too large to hold: its first block becomes the request, failed with the reason;
// the other blocks are dropped.
static GstFlowReturn refuse_image_file(GstMoeEncode* self, EncodeState* st, GstBuffer* block) {
  if (st->image_file_refused) {
    gst_buffer_unref(block);
    return GST_FLOW_OK;
  }
  st->image_file_refused = true;
  std::vector<Pending> requests = collect_requests(self, st, block);
  gst_buffer_unref(block);
  // Its own request: the last entry before the controls its meta may carry.
  Pending& p = *std::find_if(requests.rbegin(), requests.rend(), [](const Pending& e) { return !e.control; });
  p.error = "image request '" + p.record.id + "' (" + p.record.uri + "): image file of " +
            std::to_string(st->image_file_size) + " bytes exceeds the limit of " +
            std::to_string(MAX_IMAGE_FILE_BYTES) + " bytes";
  p.error_code = moe::error_code::kImageUndecodable;
  p.image = moe::RgbImage();
  return enqueue(st, std::move(requests));
}

/* ----- pads ----- */

static GstFlowReturn gst_moe_encode_chain(GstPad*, GstObject* parent, GstBuffer* buf) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  EncodeState* st = self->state;
  const GstFlowReturn deferred = st->deferred_flow;
  if (deferred != GST_FLOW_OK) {
    gst_buffer_unref(buf);
    return deferred;
  }
  // No (valid) caps event, typically from filesrc, whose caps are ANY: an image file is recognised
  // by its bytes, anything else needs a caps filter.
  if (st->kind == InputKind::None && !typefind_image(self, st, buf)) {
    gst_buffer_unref(buf);
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION,
                      ("Received a buffer without caps that is not an image file: upstream does not say whether it "
                       "sends texts, video frames or requests; filesrc and other sources of untyped bytes need a "
                       "caps filter, e.g. filesrc location=query.txt ! text/x-raw,format=utf8 ! moe-encode"),
                      (nullptr));
    return GST_FLOW_NOT_NEGOTIATED;
  }
  if (st->kind == InputKind::Image && !st->image_framing_known) set_image_framing(self, st);
  if (st->kind == InputKind::Image && st->image_file_size > MAX_IMAGE_FILE_BYTES)
    return refuse_image_file(self, st, buf);
  if (st->kind == InputKind::Image && st->image_file_size > 0) {
    buf = add_to_image_file(st, buf);
    if (buf == nullptr) return GST_FLOW_OK;  // more of the file to come
  } else if ((st->kind == InputKind::Video || st->kind == InputKind::Image) && drop_frame(self, st, buf)) {
    ++st->frames;
    gst_buffer_unref(buf);
    return GST_FLOW_OK;
  }
  std::vector<Pending> requests = collect_requests(self, st, buf);
  gst_buffer_unref(buf);
  return enqueue(st, std::move(requests));
}

// Queues the image file a byte stream ended with before its size was reached (it fails to decode
// as truncated). Runs in the streaming thread, before the event that ends the stream.
static GstFlowReturn queue_unfinished_image_file(GstMoeEncode* self, EncodeState* st) {
  if (st->image_file == nullptr) return GST_FLOW_OK;
  GstBuffer* file = st->image_file;
  st->image_file = nullptr;
  std::vector<Pending> requests = collect_requests(self, st, file);
  gst_buffer_unref(file);
  return enqueue(st, std::move(requests));
}

// Pushes everything queued ahead of a serialized event, in batches of at most max-batch; the
// caller holds push_lock. The first failed push is kept for the next chain call.
static void push_before_event(GstMoeEncode* self, EncodeState* st, GstEvent* event) {
  GstFlowReturn ret, first = GST_FLOW_OK;
  while (push_next_batch(self, st, &ret))
    if (first == GST_FLOW_OK) first = ret;
  if (first != GST_FLOW_OK) defer_flow(self, st, first, /*report_now=*/GST_EVENT_TYPE(event) == GST_EVENT_EOS);
}

// Sets the fixed output caps once per stream; the caller holds push_lock.
static gboolean ensure_src_caps(GstMoeEncode* self, EncodeState* st) {
  if (gst_pad_has_current_caps(self->srcpad)) return TRUE;
  GstCaps* caps = gstmoe::tensor_caps(static_cast<int>(st->width));
  const gboolean ok = gst_pad_set_caps(self->srcpad, caps);
  if (!ok) {
    GstCaps* peer = gst_pad_peer_query_caps(self->srcpad, nullptr);
    gchar* ours = gst_caps_to_string(caps);
    gchar* theirs = gst_caps_to_string(peer);
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Downstream does not accept the embeddings caps %s", ours),
                      ("downstream accepts %s", theirs));
    g_free(ours);
    g_free(theirs);
    gst_caps_unref(peer);
  }
  gst_caps_unref(caps);
  return ok;
}

// The size a w x h frame is converted to: the preprocessing's resize size (the shortest side to
// shortest_edge, as CLIPImageProcessor resizes) when that is smaller, else the frame's own size.
static std::pair<int, int> converted_size(const EncodeState* st, int w, int h) {
  try {
    const std::pair<int, int> resized = moe::resized_size(st->model->image_preprocess(), w, h);
    if (resized.first <= w && resized.second <= h) return resized;
  } catch (const moe::Error&) {  // a size the preprocessing refuses: each frame fails with the reason
  }
  return {w, h};
}

// Converts non-RGB video to packed RGB and, where the model would shrink the frame anyway, scales
// it to the model's resize size in the same pass, so a 1080p frame is never converted whole. The
// scaling is videoscale's default (bilinear, 2 taps): measured here, a full antialiasing kernel
// (Catmull-Rom, as Pillow's bicubic) cost more than converting the whole frame and resizing it
// exactly, while 2 taps take 2-3 times less; the embeddings stay within the tolerance that
// docs/video.md states (these frames were never exact: the colour conversion is not PIL's).
static GstVideoConverter* new_rgb_converter(const GstVideoInfo& in, int out_width, int out_height) {
  GstVideoInfo rgb;
  gst_video_info_set_format(&rgb, GST_VIDEO_FORMAT_RGB, out_width, out_height);
  // The converter refuses (NULL) to change the frame rate or the interlacing: keep both.
  GST_VIDEO_INFO_FPS_N(&rgb) = GST_VIDEO_INFO_FPS_N(&in);
  GST_VIDEO_INFO_FPS_D(&rgb) = GST_VIDEO_INFO_FPS_D(&in);
  GST_VIDEO_INFO_INTERLACE_MODE(&rgb) = GST_VIDEO_INFO_INTERLACE_MODE(&in);
  GstStructure* config =
      gst_structure_new("GstVideoConverter", GST_VIDEO_CONVERTER_OPT_RESAMPLER_METHOD, GST_TYPE_VIDEO_RESAMPLER_METHOD,
                        GST_VIDEO_RESAMPLER_METHOD_LINEAR, GST_VIDEO_RESAMPLER_OPT_MAX_TAPS, G_TYPE_INT, 2, nullptr);
  return gst_video_converter_new(const_cast<GstVideoInfo*>(&in), &rgb, config);  // takes the config
}

static gboolean set_sink_caps(GstMoeEncode* self, EncodeState* st, GstCaps* caps) {
  const GstStructure* s = gst_caps_get_structure(caps, 0);
  if (st->converter != nullptr) {
    gst_video_converter_free(st->converter);
    st->converter = nullptr;
  }
  gst_clear_buffer(&st->image_file);
  st->image_framing_known = st->image_file_refused = false;
  if (gst_structure_has_name(s, "text/x-raw")) {
    st->kind = InputKind::Text;
  } else if (gst_structure_has_name(s, GST_MOE_REQUEST_CAPS)) {
    st->kind = InputKind::Request;
  } else if (g_str_has_prefix(gst_structure_get_name(s), "image/")) {
    st->kind = InputKind::Image;
  } else {
    if (!gst_video_info_from_caps(&st->video_info, caps)) {
      gchar* str = gst_caps_to_string(caps);
      GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Invalid video caps from upstream: %s", str), (nullptr));
      g_free(str);
      st->kind = InputKind::None;
      return FALSE;
    }
    st->kind = InputKind::Video;
    st->rgb_width = GST_VIDEO_INFO_WIDTH(&st->video_info);
    st->rgb_height = GST_VIDEO_INFO_HEIGHT(&st->video_info);
    // RGB frames are copied as they are: the engine's Pillow-exact resize then gives the reference's pixels.
    if (GST_VIDEO_INFO_FORMAT(&st->video_info) != GST_VIDEO_FORMAT_RGB) {
      std::tie(st->rgb_width, st->rgb_height) = converted_size(st, st->rgb_width, st->rgb_height);
      GST_DEBUG_OBJECT(self, "converting %dx%d frames to %dx%d RGB", GST_VIDEO_INFO_WIDTH(&st->video_info),
                       GST_VIDEO_INFO_HEIGHT(&st->video_info), st->rgb_width, st->rgb_height);
      st->converter = new_rgb_converter(st->video_info, st->rgb_width, st->rgb_height);
      if (st->converter == nullptr) {  // else its frames would be read as RGB
        gchar* str = gst_caps_to_string(caps);
        GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Cannot convert video %s to RGB", str), (nullptr));
        g_free(str);
        st->kind = InputKind::None;
        return FALSE;
      }
    }
  }
  GST_DEBUG_OBJECT(self, "sink caps %" GST_PTR_FORMAT, caps);
  return ensure_src_caps(self, st);
}

static gboolean gst_moe_encode_sink_event(GstPad* pad, GstObject* parent, GstEvent* event) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  EncodeState* st = self->state;
  switch (GST_EVENT_TYPE(event)) {
    case GST_EVENT_FLUSH_START:
      // Not serialized: must not wait for a push that is blocked downstream. It may come from any
      // thread, even while the element stops: the object lock keeps the running state alive.
      GST_OBJECT_LOCK(self);
      if (EncodeState* running = self->state) {
        set_flushing(running, true);
        drop_pending(self, running, "flush");
      }
      GST_OBJECT_UNLOCK(self);
      return gst_pad_event_default(pad, parent, event);
    case GST_EVENT_FLUSH_STOP: {
      std::lock_guard<std::mutex> push(st->push_lock);  // after any push racing the flush
      drop_pending(self, st, "flush");                  // what a chain call still running at FLUSH_START queued
      set_flushing(st, false);
      st->deferred_flow = GST_FLOW_OK;
      gst_clear_buffer(&st->image_file);
      reset_qos(self);
      return gst_pad_event_default(pad, parent, event);
    }
    case GST_EVENT_CAPS: {
      std::lock_guard<std::mutex> push(st->push_lock);
      push_before_event(self, st, event);  // the next requests may be of another kind
      GstCaps* caps;
      gst_event_parse_caps(event, &caps);
      const gboolean ok = set_sink_caps(self, st, caps);
      gst_event_unref(event);  // the output caps are ours, not upstream's
      return ok;
    }
    case GST_EVENT_SEGMENT:  // also after a seek: an image file being read starts over
      gst_event_copy_segment(event, &st->segment);
      gst_clear_buffer(&st->image_file);
      st->image_framing_known = st->image_file_refused = false;
      if (st->kind == InputKind::None) {
        gst_event_replace(&st->segment_before_caps, event);
        gst_event_unref(event);
        return TRUE;
      }
      break;
    case GST_EVENT_STREAM_START:
      st->uri_queried = false;
      st->frames = 0;
      break;
    case GST_EVENT_EOS:
      // A file cut short is still answered (as truncated); the queue may be full, so not under push_lock.
      if (queue_unfinished_image_file(self, st) == GST_FLOW_FLUSHING) {
        gst_event_unref(event);
        return FALSE;
      }
      break;
    default:
      break;
  }
  if (!GST_EVENT_IS_SERIALIZED(event)) return gst_pad_event_default(pad, parent, event);
  // EOS, segments, tags, gaps...: whatever is pending goes out first, in order.
  std::lock_guard<std::mutex> push(st->push_lock);
  push_before_event(self, st, event);
  return gst_pad_event_default(pad, parent, event);
}

// QoS events from downstream: kept for drop_frame (GstBaseTransform's rule), then sent upstream.
static gboolean gst_moe_encode_src_event(GstPad* pad, GstObject* parent, GstEvent* event) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  if (GST_EVENT_TYPE(event) == GST_EVENT_QOS) {
    gdouble proportion;
    GstClockTimeDiff diff;
    GstClockTime timestamp;
    gst_event_parse_qos(event, nullptr, &proportion, &diff, &timestamp);
    GST_OBJECT_LOCK(self);
    self->qos_proportion = proportion;
    self->qos_earliest = GST_CLOCK_TIME_IS_VALID(timestamp) ? timestamp + diff : GST_CLOCK_TIME_NONE;
    GST_OBJECT_UNLOCK(self);
    GST_LOG_OBJECT(self, "QoS: proportion %g, diff %" G_GINT64_FORMAT ", timestamp %" GST_TIME_FORMAT, proportion, diff,
                   GST_TIME_ARGS(timestamp));
  }
  return gst_pad_event_default(pad, parent, event);
}

static gboolean gst_moe_encode_src_query(GstPad* pad, GstObject* parent, GstQuery* query) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  switch (GST_QUERY_TYPE(query)) {
    case GST_QUERY_LATENCY: {
      if (!gst_pad_peer_query(self->sinkpad, query)) return FALSE;
      gboolean live;
      GstClockTime min, max;
      gst_query_parse_latency(query, &live, &min, &max);
      GST_OBJECT_LOCK(self);
      const guint64 wait = self->max_latency;
      GST_OBJECT_UNLOCK(self);
      // The declared wait: a request may queue behind a running batch (moe/batcher.h, rule 4).
      min += wait;
      if (GST_CLOCK_TIME_IS_VALID(max)) max += wait;
      gst_query_set_latency(query, live, min, max);
      GST_DEBUG_OBJECT(self, "latency: min %" GST_TIME_FORMAT " max %" GST_TIME_FORMAT, GST_TIME_ARGS(min),
                       GST_TIME_ARGS(max));
      return TRUE;
    }
    case GST_QUERY_CAPS: {
      // Fixed to the model's projection_dim once it is loaded.
      GST_OBJECT_LOCK(self);
      const int width = self->loaded ? self->loaded->width : 0;
      GST_OBJECT_UNLOCK(self);
      GstCaps* caps = width > 0 ? gstmoe::tensor_caps(width) : gst_pad_get_pad_template_caps(pad);
      GstCaps* filter;
      gst_query_parse_caps(query, &filter);
      if (filter != nullptr) {
        GstCaps* both = gst_caps_intersect_full(filter, caps, GST_CAPS_INTERSECT_FIRST);
        gst_caps_unref(caps);
        caps = both;
      }
      gst_query_set_caps_result(query, caps);
      gst_caps_unref(caps);
      return TRUE;
    }
    default:
      return gst_pad_query_default(pad, parent, query);
  }
}

/* ----- GObject ----- */

static void gst_moe_encode_finalize(GObject* object) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  gst_moe_encode_stop(self);  // only running if the element was disposed without going to NULL
  gst_moe_encode_close(self);
  g_free(self->model);
  g_free(self->device);
  delete self->batcher_stats;
  // Its entries leave the metrics' bytes with it.
  moe::QueryCacheStats gone = *self->cache_reported;
  gone.bytes = 0;
  gstmoe::metrics::count_query_cache(*self->cache_reported, gone);
  delete self->query_cache;
  delete self->cache_at_start;
  delete self->cache_reported;
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_encode_class_init(GstMoeEncodeClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  gobject_class->set_property = gst_moe_encode_set_property;
  gobject_class->get_property = gst_moe_encode_get_property;
  gobject_class->finalize = gst_moe_encode_finalize;
  element_class->change_state = GST_DEBUG_FUNCPTR(gst_moe_encode_change_state);

  // model, device and precision have no MUTABLE flag: only the NULL state may change them (set
  // in another state, they are refused with a warning).
  const auto rw_null = static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS);
  g_object_class_install_property(
      gobject_class, PROP_MODEL,
      g_param_spec_string("model", "Model",
                          "Hugging Face CLIP model directory (config.json, model.safetensors, vocab.json, merges.txt, "
                          "preprocessor_config.json); loaded when going to READY, shared with other elements naming "
                          "the same directory, device and precision; can only be changed in the NULL state; the "
                          "default is the shipped model as installed",
                          DEFAULT_MODEL, rw_null));
  g_object_class_install_property(
      gobject_class, PROP_DEVICE,
      g_param_spec_string("device", "Device",
                          "Where the model computes: 'cpu', 'cuda:N' (CUDA device N; an error when it is not usable), "
                          "or 'auto' (cuda:0 when a usable CUDA device exists, else cpu; the choice and its reason "
                          "are logged); can only be changed in the NULL state",
                          DEFAULT_DEVICE, rw_null));
  g_object_class_install_property(
      gobject_class, PROP_PRECISION,
      g_param_spec_enum("precision", "Precision",
                        "How the model's Linear weights are stored on the device: fp32 (exact), fp16 or bf16 (half "
                        "the memory; embeddings typically within 1e-3 (fp16) or 1e-2 (bf16) relative of fp32); "
                        "activations and accumulation stay f32; can only be changed in the NULL state",
                        GST_TYPE_MOE_PRECISION, DEFAULT_PRECISION, rw_null));
  g_object_class_install_property(
      gobject_class, PROP_THREADS,
      g_param_spec_uint("threads", "CPU threads",
                        "Threads the CPU backend splits each matrix product over (0: the cores this process may "
                        "use). The CPU backend is shared by the whole process: the first element to load a model "
                        "on it sets the count, later different counts are logged and ignored; can only be changed "
                        "in the NULL state",
                        0, MAX_THREADS, DEFAULT_THREADS, rw_null));
  g_object_class_install_property(
      gobject_class, PROP_MAX_BATCH,
      g_param_spec_uint("max-batch", "Maximum batch",
                        "Most requests encoded together. A request that finds the encoder idle is encoded at once; "
                        "those that arrive while it is busy leave together, up to this many, when it is done. While "
                        "this many are queued, the streaming thread waits (backpressure). A hybrid request (image "
                        "and text) counts once: it takes one input of each tower, so neither tower's call exceeds "
                        "this many inputs",
                        MIN_MAX_BATCH, MAX_MAX_BATCH, DEFAULT_MAX_BATCH, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_MAX_LATENCY,
      g_param_spec_uint64("max-latency", "Maximum latency",
                          "How long (ns) a request may queue behind the batch being encoded: added to the pipeline "
                          "latency; requests that queued longer are counted in stats (late). It delays nothing: "
                          "batches never wait for more requests while the encoder is idle",
                          0, MAX_MAX_LATENCY, DEFAULT_MAX_LATENCY, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_CACHE_BYTES,
      g_param_spec_uint64("cache-bytes", "Query cache bytes",
                          "Memory for the query-embedding cache (embeddings, keys and bookkeeping): a text that "
                          "tokenises like an earlier one, or an image request with the same file bytes, encoded by "
                          "the same model, device and precision, takes the earlier embedding (bit-identical) instead "
                          "of an encoder call (video frames are not cached); least recently used entries go first. "
                          "0: no cache. A smaller value evicts at once; the entries outlive state changes",
                          0, G_MAXUINT64, DEFAULT_CACHE_BYTES, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_INTERVAL,
      g_param_spec_uint("interval", "Interval",
                        "Encode every Nth frame of a video stream (or of an image stream with one file per buffer) "
                        "and drop the others: 1 encodes every frame, 3 frames 0, 3, 6... of the stream; dropped "
                        "frames are counted in stats (frames-skipped). Texts and requests are never skipped",
                        1, G_MAXUINT, DEFAULT_INTERVAL, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_QOS,
      g_param_spec_boolean("qos", "QoS",
                           "Drop the frames that downstream's QoS events say are late (their running time is not "
                           "after the last event's timestamp + jitter) before converting them, as GstBaseTransform "
                           "filters do; each is counted in stats (frames-late) and posted as a QoS message",
                           DEFAULT_QOS, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "moe-encode-stats, since the element started: requests (queued, including those that failed before "
          "or on arrival and row-less controls such as catalog deletes), batches (encoded), batches-by-size (array: "
          "[i] counts batches of 2^i to 2^(i+1)-1 "
          "requests), rows-failed (requests that failed here), rows-hybrid (hybrid requests encoded: an image and "
          "a text each), encode-ms (time in engine calls), queue-wait-ms "
          "and queue-wait-max-ms (from arrival to the batch leaving: total and longest), late (requests that "
          "queued longer than max-latency), cache-hits, cache-misses, cache-evictions and cache-refused (query cache "
          "lookups that found an embedding, lookups that did not, entries dropped to stay within cache-bytes, "
          "entries larger than cache-bytes), cache-entries and cache-held-bytes (what the cache holds now), "
          "frames-skipped (frames left out by interval) and frames-late (frames dropped by QoS)"));

  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "CLIP encoder", "Filter/Converter/Text/Video",
      "Encodes query texts (one per text/x-raw buffer), image files (JPEG, PNG, WebP, GIF, BMP, TIFF, PNM), video "
      "frames, or application/x-moe-request buffers (a text, an encoded image file, or a hybrid's image with its text "
      "in the record) with a CLIP model into batches of embeddings (application/x-moe-tensor, width = the "
      "model's projection_dim). Each row's request (id, modality, uri, timings; a hybrid's text embedding) is in the "
      "buffer's GstMoeBatchMeta; requests that cannot be encoded travel on in its failed list, row-less requests "
      "(catalog deletes) in its controls, after the rows that came before them. Example: gst-launch-1.0 videotestsrc "
      "num-buffers=16 ! moe-encode model=models/default/clip max-batch=4 ! fakesink",
      "gst-moe developers");

  gst_type_mark_as_plugin_api(GST_TYPE_MOE_PRECISION, static_cast<GstPluginAPIFlags>(0));
}

static void gst_moe_encode_init(GstMoeEncode* self) {
  self->sinkpad = gst_pad_new_from_static_template(&sink_template, "sink");
  gst_pad_set_chain_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_moe_encode_chain));
  gst_pad_set_event_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_moe_encode_sink_event));
  gst_element_add_pad(GST_ELEMENT(self), self->sinkpad);

  self->srcpad = gst_pad_new_from_static_template(&src_template, "src");
  gst_pad_set_query_function(self->srcpad, GST_DEBUG_FUNCPTR(gst_moe_encode_src_query));
  gst_pad_set_event_function(self->srcpad, GST_DEBUG_FUNCPTR(gst_moe_encode_src_event));
  gst_element_add_pad(GST_ELEMENT(self), self->srcpad);

  self->model = g_strdup(DEFAULT_MODEL);
  self->device = g_strdup(DEFAULT_DEVICE);
  self->precision = DEFAULT_PRECISION;
  self->threads = DEFAULT_THREADS;
  self->max_batch = DEFAULT_MAX_BATCH;
  self->max_latency = DEFAULT_MAX_LATENCY;
  self->cache_bytes = DEFAULT_CACHE_BYTES;
  self->interval = DEFAULT_INTERVAL;
  self->qos = DEFAULT_QOS;
  self->qos_proportion = 1.0;
  self->qos_earliest = GST_CLOCK_TIME_NONE;
  self->frames_processed = self->frames_skipped = self->frames_late = 0;
  self->batcher_stats = new moe::BatcherStats();
  self->rows_failed = self->rows_hybrid = 0;
  self->encode_ms = 0.0;
  self->query_cache = new moe::QueryCache(DEFAULT_CACHE_BYTES);
  self->cache_at_start = new moe::QueryCacheStats();
  self->cache_reported = new moe::QueryCacheStats();
  self->loaded = nullptr;
  self->state = nullptr;
}
