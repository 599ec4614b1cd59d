/* moe-encode: CLIP encoder. Turns requests (query texts, video frames, or request buffers
 * carrying a text or an encoded image) into batches of CLIP embeddings.
 *
 * Why batches: the engine encodes a batch with one GEMM per layer, much faster per request than
 * one call each. Batching is continuous (moe/batcher.h decides): a request that finds the encoder
 * idle is encoded at once, alone; the requests that arrive while it encodes queue, and leave
 * together (up to `max-batch`) as soon as it is done. So a lone request never waits for company
 * and batches grow with the load. Each output buffer is a rows x projection_dim f32 tensor whose
 * GstMoeBatchMeta says which request every row answers, so a batch may mix texts and images and
 * nothing downstream relies on buffer order.
 *
 * Threads: the streaming thread turns buffers into requests (converting frames, decoding images)
 * and queues them; while a whole batch is queued already it waits (backpressure), since the
 * requests would only wait here instead of upstream. A worker thread, started with the element,
 * encodes and pushes each batch the batcher lets leave, so the streaming thread keeps queueing
 * while the encoder runs. Serialized events (EOS, caps, segments...) push what is queued first,
 * from the streaming thread; push_lock keeps those pushes and the worker's in order. A failed
 * push from the worker or ahead of an event is returned by the next chain call (and posted at
 * once when fatal); a flush drops what is queued.
 *
 * The model runs on the `device` property's compute backend ("cpu", "cuda:N", or "auto": cuda:0
 * when a usable CUDA device exists, else the CPU) with its Linear weights in `precision`; elements
 * naming the same model, device and precision share one loaded model.
 *
 * A request the engine cannot encode (invalid UTF-8, an image that does not decode...) is not
 * an element error: it moves to the meta's failed list (stage "moe-encode") and travels on to
 * ann-query, which answers it with an error document. Model problems are element errors.
 *
 * The `stats` property counts, since the element started, the requests and batches, the batches
 * by size, the requests that failed here, the time spent in the engine and in the queue.
 */
#include "gstmoeencode.h"

#include <gst/video/video.h>

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
#include <utility>
#include <vector>

#include "gstmoemeta.h"
#include "moe/batcher.h"
#include "moe/compute.h"
#include "moe/error.h"
#include "moe/image_decode.h"
#include "moe/model_cache.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_encode_debug);
#define GST_CAT_DEFAULT gst_moe_encode_debug

namespace {

constexpr const char* kStage = "moe-encode";
constexpr guint kDefaultMaxBatch = 8;
constexpr guint kMaxMaxBatch = 4096;
constexpr guint64 kDefaultMaxLatency = 10 * GST_MSECOND;
constexpr guint64 kMaxMaxLatency = 3600 * GST_SECOND;
constexpr const char* kDefaultDevice = "cpu";

#define MOE_ENCODE_VIDEO_FORMATS \
  "{ RGB, RGBx, xRGB, BGR, BGRx, xBGR, RGBA, BGRA, ARGB, ABGR, I420, YV12, NV12, NV21, YUY2, UYVY, GRAY8 }"

enum class InputKind { None, Text, Video, Request };

using Clock = moe::Batcher::Clock;

// One entry of the queue: a request, already turned into what the engine takes, or one that
// failed (here on arrival, or upstream) and only travels on to be answered.
struct Pending {
  gstmoe::RequestRecord record;            // record.text is what text requests encode
  moe::RgbImage image;                     // image requests
  std::string error;                       // set when it failed: it then only travels as a failure
  std::string failed_stage = kStage;       // where it failed: here, or the upstream stage named in the meta
  GstClockTime pts = GST_CLOCK_TIME_NONE;  // its buffer's; a batch takes its first entry's
};

// The element's counters behind `stats`, beside the batcher's.
struct EncodeCounters {
  guint64 rows_failed = 0;  // requests that failed here, on arrival or in the engine
  double encode_ms = 0.0;   // time in engine calls
};

// The C++ side of the element; GObject only holds a pointer to it.
struct EncodeState {
  // Properties: model_path, device and precision under the object lock; max-batch and
  // max-latency are the batcher's limits, under `lock`.
  std::string model_path;
  std::string device = kDefaultDevice;
  GstMoePrecision precision = GST_MOE_PRECISION_FP32;

  // READY and above.
  std::shared_ptr<const moe::ClipModel> model;
  std::string encoder_name;
  std::atomic<int> width{0};  // projection_dim; read by queries from any thread

  // Streaming-thread state (serialised by the sink pad's stream lock).
  InputKind kind = InputKind::None;
  GstVideoInfo video_info;
  GstVideoConverter* converter = nullptr;  // non-RGB video -> packed RGB
  GstSegment segment;
  bool uri_queried = false;
  std::string stream_uri;
  guint64 frames = 0;    // video frames in this stream, for "frame:<n>"
  guint64 requests = 0;  // requests seen, the id of last resort

  // The queue, the policy over it and the worker, all under `lock`. `wake` tells the worker that
  // a batch may leave, and the streaming thread that the queue has room or that it must stop
  // waiting. The batcher and the counters are made anew at start (so `stats` counts from
  // there) and kept after stop.
  std::mutex lock;
  std::condition_variable wake;
  moe::Batcher batcher{{kDefaultMaxBatch, std::chrono::nanoseconds(kDefaultMaxLatency)}};
  std::deque<Pending> queue;  // the requests the batcher counts, oldest first
  EncodeCounters counters;
  bool flushing = false;  // from FLUSH_START to FLUSH_STOP, and while stopping: nothing waits for room
  bool worker_stop = false;
  std::thread worker;
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
  EncodeState* st;
};

enum { PROP_0, PROP_MODEL, PROP_MAX_BATCH, PROP_MAX_LATENCY, PROP_DEVICE, PROP_PRECISION, PROP_STATS };

static GstStaticPadTemplate sink_template = GST_STATIC_PAD_TEMPLATE(
    "sink", GST_PAD_SINK, GST_PAD_ALWAYS,
    GST_STATIC_CAPS(
        "text/x-raw, format=(string)utf8; " GST_VIDEO_CAPS_MAKE(MOE_ENCODE_VIDEO_FORMATS) "; " GST_MOE_REQUEST_CAPS));

static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_TENSOR_CAPS));

G_DEFINE_TYPE(GstMoeEncode, gst_moe_encode, GST_TYPE_ELEMENT);
GST_ELEMENT_REGISTER_DEFINE(moe_encode, "moe-encode", GST_RANK_NONE, GST_TYPE_MOE_ENCODE);

/* ----- requests ----- */

// "<seconds>" with at most microsecond precision and no trailing zeros, for "#t=" fragments.
static std::string media_seconds(GstClockTime t) {
  std::string s = std::to_string(t / GST_SECOND) + "." + std::to_string(1000000 + (t % GST_SECOND) / 1000).substr(1);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  return s;
}

// The uri of the stream feeding the sink pad, asked once per stream (empty when unknown).
static const std::string& upstream_uri(GstMoeEncode* self) {
  EncodeState* st = self->st;
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
static std::string frame_uri(GstMoeEncode* self, GstBuffer* buf, guint64 frame) {
  EncodeState* st = self->st;
  const std::string& uri = upstream_uri(self);
  GstClockTime t = GST_BUFFER_PTS(buf);
  if (GST_CLOCK_TIME_IS_VALID(t) && st->segment.format == GST_FORMAT_TIME)
    t = gst_segment_to_stream_time(&st->segment, GST_FORMAT_TIME, t);
  if (!uri.empty() && GST_CLOCK_TIME_IS_VALID(t)) return uri + "#t=" + media_seconds(t);
  return "frame:" + std::to_string(frame);
}

// A video frame as packed RGB8: copied when it is RGB already, else through GstVideoConverter.
static void frame_to_rgb(GstMoeEncode* self, GstBuffer* buf, moe::RgbImage* image, std::string* error) {
  EncodeState* st = self->st;
  GstVideoFrame in;
  if (!gst_video_frame_map(&in, &st->video_info, buf, GST_MAP_READ)) {
    *error = "video frame of " + std::to_string(gst_buffer_get_size(buf)) + " bytes does not match its caps (" +
             std::to_string(st->video_info.size) + " bytes expected)";
    return;
  }
  const int w = GST_VIDEO_INFO_WIDTH(&st->video_info), h = GST_VIDEO_INFO_HEIGHT(&st->video_info);
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

// Checks a text request here, since the engine would reject invalid UTF-8 for the whole batch.
static void set_text(Pending* p, const std::string& text) {
  const gchar* end = nullptr;
  if (g_utf8_validate_len(text.data(), text.size(), &end)) {
    p->record.text = text;
    return;
  }
  const std::string offset = std::to_string(end - text.data());
  // A NUL is valid UTF-8 but not text: typically the terminator of a C string an app pushed.
  p->error = "text request '" + p->record.id + "' " +
             (*end == '\0' ? "holds a NUL byte at offset " + offset + " (push the text without its terminator)"
                           : "is not valid UTF-8 (invalid byte at offset " + offset + ")");
  // The error document quotes the query: keep it valid UTF-8 (U+FFFD for bad bytes).
  gchar* valid = g_utf8_make_valid(text.data(), static_cast<gssize>(text.size()));
  p->record.text = valid;
  g_free(valid);
}

static void set_encoded_image(Pending* p, GstBuffer* buf) {
  std::string what = "image request '" + p->record.id + "'";
  if (!p->record.uri.empty()) what += " (" + p->record.uri + ")";
  GstMapInfo map;
  if (!gst_buffer_map(buf, &map, GST_MAP_READ)) {
    p->error = what + ": cannot map the buffer";
    return;
  }
  try {
    p->image = moe::decode_image(map.data, map.size, what);
  } catch (const std::exception& e) {  // moe::Error, or out of memory: a bad request either way
    p->error = e.what();
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

// Turns an input buffer into queue entries: the upstream failures its meta carries, then its
// request (normally one). Runs in the streaming thread.
static std::vector<Pending> collect_requests(GstMoeEncode* self, GstBuffer* buf) {
  EncodeState* st = self->st;
  const int64_t wall = g_get_real_time(), mono = g_get_monotonic_time();
  const GstMoeBatchMeta* meta = gst_buffer_get_moe_batch_meta(buf);
  const gstmoe::BatchRecords* in = meta != nullptr ? meta->records : nullptr;
  const guint64 n = st->requests++;
  std::vector<Pending> out;
  const auto add = [&out, buf](Pending&& p) {
    p.pts = GST_BUFFER_PTS(buf);
    out.push_back(std::move(p));
  };
  if (in != nullptr) {
    for (const gstmoe::FailedRequest& f : in->failed) {
      Pending p;
      p.record = f.request;
      p.error = f.reason;
      p.failed_stage = f.stage;
      add(std::move(p));
    }
  }

  if (st->kind == InputKind::Request && (in == nullptr || in->rows.size() != 1)) {
    // Only an upstream failure: not a request of its own.
    if (in != nullptr && in->rows.empty() && !in->failed.empty()) return out;
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
      add(std::move(p));
    }
    return out;
  }

  Pending p;
  if (in != nullptr && !in->rows.empty()) p.record = in->rows.front();
  complete_record(&p.record, buf, n, wall, mono);
  switch (st->kind) {
    case InputKind::Text:
      p.record.modality = gstmoe::Modality::Text;
      set_text(&p, buffer_bytes(buf));
      break;
    case InputKind::Video: {
      const guint64 frame = st->frames++;
      p.record.modality = gstmoe::Modality::Image;
      if (p.record.uri.empty()) p.record.uri = frame_uri(self, buf, frame);
      frame_to_rgb(self, buf, &p.image, &p.error);
      break;
    }
    case InputKind::Request:
      if (p.record.modality == gstmoe::Modality::Text)
        set_text(&p, buffer_bytes(buf));
      else
        set_encoded_image(&p, buf);
      break;
    case InputKind::None:  // refused by the chain function
      break;
  }
  add(std::move(p));
  return out;
}

/* ----- encoding ----- */

// Encodes a batch into one tensor buffer: texts with one encode_texts call, images with one
// encode_images call, rows in arrival order; failures go to the meta's failed list.
static GstBuffer* encode_batch(GstMoeEncode* self, std::vector<Pending>& batch) {
  EncodeState* st = self->st;
  const size_t width = static_cast<size_t>(st->width.load());
  const int64_t start = g_get_monotonic_time();

  std::vector<std::string> texts;
  std::vector<moe::ImageView> images;
  std::vector<size_t> slot(batch.size());  // index into texts or images
  for (size_t i = 0; i < batch.size(); ++i) {
    const Pending& p = batch[i];
    if (!p.error.empty()) continue;
    if (p.record.modality == gstmoe::Modality::Text) {
      slot[i] = texts.size();
      texts.push_back(p.record.text);
    } else {
      slot[i] = images.size();
      images.push_back(p.image.view());
    }
  }
  const moe::ClipModel& model = *st->model;
  const moe::BatchRows text_rows =
      moe::run_isolating_failures(texts, width, [&](const auto& v) { return model.encode_texts(v).embeds; });
  const moe::BatchRows image_rows =
      moe::run_isolating_failures(images, width, [&](const auto& v) { return model.encode_images(v).embeds; });
  const int64_t end = g_get_monotonic_time();
  const double encode_ms = gstmoe::elapsed_ms(start, end);

  gstmoe::BatchRecords records;
  records.encoder = st->encoder_name;
  records.encoder_fingerprint = model.fingerprint();
  std::vector<const float*> row_data;
  guint64 failed_here = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Pending& p = batch[i];
    const bool is_text = p.record.modality == gstmoe::Modality::Text;
    const moe::BatchRows& rows = is_text ? text_rows : image_rows;
    if (p.error.empty() && !rows.errors[slot[i]].empty())
      p.error = std::string(is_text ? "text" : "image") + " request '" + p.record.id +
                "' cannot be encoded: " + rows.errors[slot[i]];
    if (!p.error.empty()) {
      if (p.failed_stage == kStage) ++failed_here;
      records.failed.push_back({std::move(p.record), std::move(p.failed_stage), std::move(p.error)});
      continue;
    }
    p.record.timings_ms.emplace_back("queue", gstmoe::elapsed_ms(p.record.arrival_mono_us, start));
    p.record.timings_ms.emplace_back("encode", encode_ms);
    records.rows.push_back(std::move(p.record));
    row_data.push_back(rows.values.data() + slot[i] * width);
  }
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->counters.rows_failed += failed_here;
    st->counters.encode_ms += encode_ms;
  }

  GstBuffer* out;
  if (row_data.empty()) {
    out = gst_buffer_new();
  } else {
    out = gst_buffer_new_allocate(nullptr, row_data.size() * width * sizeof(float), nullptr);
    GstMapInfo map;
    gst_buffer_map(out, &map, GST_MAP_WRITE);
    for (size_t r = 0; r < row_data.size(); ++r)
      std::memcpy(map.data + r * width * sizeof(float), row_data[r], width * sizeof(float));
    gst_buffer_unmap(out, &map);
  }
  GST_BUFFER_PTS(out) = batch.front().pts;
  GST_BUFFER_DTS(out) = GST_CLOCK_TIME_NONE;
  GST_BUFFER_DURATION(out) = GST_CLOCK_TIME_NONE;
  GST_LOG_OBJECT(self, "batch: %zu rows, %zu failed, encoded in %.3f ms", records.rows.size(), records.failed.size(),
                 encode_ms);
  gst_buffer_add_moe_batch_meta(out, records);
  return out;
}

/* ----- the queue and the worker ----- */

// Takes the batch that the batcher lets leave now, encodes and pushes it, and sets `ret` to the
// push's result; false when no batch may leave. The caller holds push_lock, so batches are
// pushed in the order they were taken.
static bool push_next_batch(GstMoeEncode* self, GstFlowReturn* ret) {
  EncodeState* st = self->st;
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
  *ret = gst_pad_push(self->srcpad, encode_batch(self, batch));
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
static void defer_flow(GstMoeEncode* self, GstFlowReturn ret, bool report_now) {
  self->st->deferred_flow = ret;
  if (report_now && (ret == GST_FLOW_NOT_LINKED || ret < GST_FLOW_EOS)) GST_ELEMENT_FLOW_ERROR(self, ret);
}

// The worker: runs every batch the batcher lets leave, as soon as it may.
static void worker_loop(GstMoeEncode* self) {
  EncodeState* st = self->st;
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
      if (push_next_batch(self, &ret) && ret != GST_FLOW_OK) {
        GST_DEBUG_OBJECT(self, "push: %s", gst_flow_get_name(ret));
        defer_flow(self, ret, /*report_now=*/true);
      }
    }
    lk.lock();
  }
}

// Starts the worker with a fresh batcher and counters: `stats` counts from here.
static void start_worker(GstMoeEncode* self) {
  EncodeState* st = self->st;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->batcher = moe::Batcher(st->batcher.limits());
    st->counters = EncodeCounters();
    st->flushing = false;
    st->worker_stop = false;
  }
  st->worker = std::thread(worker_loop, self);
}

static void stop_worker(GstMoeEncode* self) {
  EncodeState* st = self->st;
  if (!st->worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->worker_stop = true;
  }
  st->wake.notify_all();
  st->worker.join();
}

// While flushing (or stopping), the streaming thread stops waiting for room in the queue.
static void set_flushing(GstMoeEncode* self, bool flushing) {
  EncodeState* st = self->st;
  {
    std::lock_guard<std::mutex> lk(st->lock);
    st->flushing = flushing;
  }
  st->wake.notify_all();
}

static void drop_pending(GstMoeEncode* self, const char* why) {
  EncodeState* st = self->st;
  std::lock_guard<std::mutex> lk(st->lock);
  if (const size_t n = st->batcher.drop()) GST_INFO_OBJECT(self, "%s: dropping %zu pending requests", why, n);
  st->queue.clear();
}

// Queues a buffer's requests for the worker, first waiting while a whole batch is queued already
// (the batcher is full: the encoder is busy, so requests would only wait here instead of
// upstream). Runs in the streaming thread.
static GstFlowReturn enqueue(GstMoeEncode* self, std::vector<Pending>&& requests) {
  EncodeState* st = self->st;
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

/* ----- pads ----- */

static GstFlowReturn gst_moe_encode_chain(GstPad*, GstObject* parent, GstBuffer* buf) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  EncodeState* st = self->st;
  const GstFlowReturn deferred = st->deferred_flow;
  if (deferred != GST_FLOW_OK) {
    gst_buffer_unref(buf);
    return deferred;
  }
  if (st->kind == InputKind::None) {  // no (valid) caps event: the buffer's meaning is unknown
    gst_buffer_unref(buf);
    // Typically filesrc, whose caps are ANY: it negotiates nothing unless a caps filter says what it reads.
    GST_ELEMENT_ERROR(self, CORE, NEGOTIATION,
                      ("Received a buffer without caps: upstream does not say whether it sends texts, video frames "
                       "or requests; filesrc and other sources of untyped bytes need a caps filter, e.g. "
                       "filesrc location=query.txt ! text/x-raw,format=utf8 ! moe-encode"),
                      (nullptr));
    return GST_FLOW_NOT_NEGOTIATED;
  }
  std::vector<Pending> requests = collect_requests(self, buf);
  gst_buffer_unref(buf);
  return enqueue(self, std::move(requests));
}

// Pushes everything queued ahead of a serialized event, in batches of at most max-batch; the
// caller holds push_lock. The first failed push is kept for the next chain call.
static void push_before_event(GstMoeEncode* self, GstEvent* event) {
  GstFlowReturn ret, first = GST_FLOW_OK;
  while (push_next_batch(self, &ret))
    if (first == GST_FLOW_OK) first = ret;
  if (first != GST_FLOW_OK) defer_flow(self, first, /*report_now=*/GST_EVENT_TYPE(event) == GST_EVENT_EOS);
}

// Sets the fixed output caps once per stream; the caller holds push_lock.
static gboolean ensure_src_caps(GstMoeEncode* self) {
  if (gst_pad_has_current_caps(self->srcpad)) return TRUE;
  GstCaps* caps = gstmoe::tensor_caps(self->st->width);
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

static gboolean set_sink_caps(GstMoeEncode* self, GstCaps* caps) {
  EncodeState* st = self->st;
  const GstStructure* s = gst_caps_get_structure(caps, 0);
  if (st->converter != nullptr) {
    gst_video_converter_free(st->converter);
    st->converter = nullptr;
  }
  if (gst_structure_has_name(s, "text/x-raw")) {
    st->kind = InputKind::Text;
  } else if (gst_structure_has_name(s, GST_MOE_REQUEST_CAPS)) {
    st->kind = InputKind::Request;
  } else {
    if (!gst_video_info_from_caps(&st->video_info, caps)) {
      gchar* str = gst_caps_to_string(caps);
      GST_ELEMENT_ERROR(self, CORE, NEGOTIATION, ("Invalid video caps from upstream: %s", str), (nullptr));
      g_free(str);
      st->kind = InputKind::None;
      return FALSE;
    }
    st->kind = InputKind::Video;
    if (GST_VIDEO_INFO_FORMAT(&st->video_info) != GST_VIDEO_FORMAT_RGB) {
      GstVideoInfo rgb;
      gst_video_info_set_format(&rgb, GST_VIDEO_FORMAT_RGB, GST_VIDEO_INFO_WIDTH(&st->video_info),
                                GST_VIDEO_INFO_HEIGHT(&st->video_info));
      // The converter refuses (NULL) to change the frame rate or the interlacing: keep both.
      GST_VIDEO_INFO_FPS_N(&rgb) = GST_VIDEO_INFO_FPS_N(&st->video_info);
      GST_VIDEO_INFO_FPS_D(&rgb) = GST_VIDEO_INFO_FPS_D(&st->video_info);
      GST_VIDEO_INFO_INTERLACE_MODE(&rgb) = GST_VIDEO_INFO_INTERLACE_MODE(&st->video_info);
      st->converter = gst_video_converter_new(&st->video_info, &rgb, nullptr);
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
  return ensure_src_caps(self);
}

static gboolean gst_moe_encode_sink_event(GstPad* pad, GstObject* parent, GstEvent* event) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  EncodeState* st = self->st;
  switch (GST_EVENT_TYPE(event)) {
    case GST_EVENT_FLUSH_START:
      // Not serialized: must not wait for a push that is blocked downstream.
      set_flushing(self, true);
      drop_pending(self, "flush");
      return gst_pad_event_default(pad, parent, event);
    case GST_EVENT_FLUSH_STOP: {
      std::lock_guard<std::mutex> push(st->push_lock);  // after any push racing the flush
      drop_pending(self, "flush");                      // what a chain call still running at FLUSH_START queued
      set_flushing(self, false);
      st->deferred_flow = GST_FLOW_OK;
      return gst_pad_event_default(pad, parent, event);
    }
    case GST_EVENT_CAPS: {
      std::lock_guard<std::mutex> push(st->push_lock);
      push_before_event(self, event);  // the next requests may be of another kind
      GstCaps* caps;
      gst_event_parse_caps(event, &caps);
      const gboolean ok = set_sink_caps(self, caps);
      gst_event_unref(event);  // the output caps are ours, not upstream's
      return ok;
    }
    case GST_EVENT_SEGMENT:
      gst_event_copy_segment(event, &st->segment);
      break;
    case GST_EVENT_STREAM_START:
      st->uri_queried = false;
      st->frames = 0;
      break;
    default:
      break;
  }
  if (!GST_EVENT_IS_SERIALIZED(event)) return gst_pad_event_default(pad, parent, event);
  // EOS, segments, tags, gaps...: whatever is pending goes out first, in order.
  std::lock_guard<std::mutex> push(st->push_lock);
  push_before_event(self, event);
  return gst_pad_event_default(pad, parent, event);
}

static gboolean gst_moe_encode_src_query(GstPad* pad, GstObject* parent, GstQuery* query) {
  GstMoeEncode* self = GST_MOE_ENCODE(parent);
  EncodeState* st = self->st;
  switch (GST_QUERY_TYPE(query)) {
    case GST_QUERY_LATENCY: {
      if (!gst_pad_peer_query(self->sinkpad, query)) return FALSE;
      gboolean live;
      GstClockTime min, max;
      gst_query_parse_latency(query, &live, &min, &max);
      guint64 wait;
      {
        std::lock_guard<std::mutex> lk(st->lock);
        wait = st->batcher.limits().max_latency.count();
      }
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
      const int width = st->width;
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

/* ----- element ----- */

static gboolean load_model(GstMoeEncode* self) {
  EncodeState* st = self->st;
  GST_OBJECT_LOCK(self);
  const std::string path = st->model_path;
  moe::ComputeOptions options;
  options.device = st->device;
  const GstMoePrecision precision = st->precision;
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
  try {
    st->model = moe::shared_clip_model(path, options);
  } catch (const std::exception& e) {  // moe::Error names the file (or the device) and the reason
    if (g_file_test(path.c_str(), G_FILE_TEST_EXISTS))
      GST_ELEMENT_ERROR(
          self, RESOURCE, SETTINGS, ("Cannot load the CLIP model: %s", e.what()),
          ("model=%s device=%s precision=%s", path.c_str(), options.device.c_str(), gstmoe::precision_nick(precision)));
    else
      GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND, ("Cannot load the CLIP model: %s", e.what()),
                        ("model directory '%s' does not exist", path.c_str()));
    return FALSE;
  }
  gchar* base = g_path_get_basename(path.c_str());
  st->encoder_name = base;
  g_free(base);
  st->width = st->model->config().projection_dim;
  GST_INFO_OBJECT(self, "loaded CLIP model %s on %s with %s weights (projection_dim %d; %s)", path.c_str(),
                  st->model->device().c_str(), gstmoe::precision_nick(precision), st->width.load(), reason.c_str());
  return TRUE;
}

static void reset_stream(EncodeState* st) {
  st->kind = InputKind::None;
  if (st->converter != nullptr) gst_video_converter_free(st->converter);
  st->converter = nullptr;
  gst_segment_init(&st->segment, GST_FORMAT_TIME);
  st->uri_queried = false;
  st->stream_uri.clear();
  st->frames = 0;
  st->requests = 0;
  st->deferred_flow = GST_FLOW_OK;
}

static GstStateChangeReturn gst_moe_encode_change_state(GstElement* element, GstStateChange transition) {
  GstMoeEncode* self = GST_MOE_ENCODE(element);
  EncodeState* st = self->st;
  switch (transition) {
    case GST_STATE_CHANGE_NULL_TO_READY:
      if (!load_model(self)) return GST_STATE_CHANGE_FAILURE;
      break;
    case GST_STATE_CHANGE_READY_TO_PAUSED:
      reset_stream(st);
      start_worker(self);
      break;
    case GST_STATE_CHANGE_PAUSED_TO_READY:
      set_flushing(self, true);  // a chain call waiting for room returns, so the pads can deactivate
      break;
    default:
      break;
  }

  const GstStateChangeReturn ret = GST_ELEMENT_CLASS(gst_moe_encode_parent_class)->change_state(element, transition);
  if (ret == GST_STATE_CHANGE_FAILURE) {
    if (transition == GST_STATE_CHANGE_READY_TO_PAUSED) stop_worker(self);
    if (transition == GST_STATE_CHANGE_PAUSED_TO_READY) set_flushing(self, false);  // still running
    return ret;
  }

  switch (transition) {
    case GST_STATE_CHANGE_PAUSED_TO_READY:
      // The pads are inactive now: no chain call runs and pushes return FLUSHING.
      stop_worker(self);
      drop_pending(self, "stop");
      reset_stream(st);
      break;
    case GST_STATE_CHANGE_READY_TO_NULL:
      st->model.reset();
      st->width = 0;
      break;
    default:
      break;
  }
  return ret;
}

static void gst_moe_encode_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  EncodeState* st = self->st;
  switch (prop_id) {
    case PROP_MODEL: {
      GST_OBJECT_LOCK(self);
      if (GST_STATE(self) != GST_STATE_NULL) {
        GST_OBJECT_UNLOCK(self);
        g_warning("moe-encode: changing 'model' is only possible in the NULL state");
        return;
      }
      const gchar* s = g_value_get_string(value);
      st->model_path = s != nullptr ? s : "";
      GST_OBJECT_UNLOCK(self);
      break;
    }
    case PROP_DEVICE:
    case PROP_PRECISION: {
      GST_OBJECT_LOCK(self);
      if (GST_STATE(self) != GST_STATE_NULL) {
        GST_OBJECT_UNLOCK(self);
        g_warning("moe-encode: changing '%s' is only possible in the NULL state", g_param_spec_get_name(pspec));
        return;
      }
      if (prop_id == PROP_DEVICE) {
        const gchar* s = g_value_get_string(value);
        st->device = s != nullptr ? s : kDefaultDevice;
      } else {
        st->precision = static_cast<GstMoePrecision>(g_value_get_enum(value));
      }
      GST_OBJECT_UNLOCK(self);
      break;
    }
    case PROP_MAX_BATCH:
    case PROP_MAX_LATENCY: {
      {
        std::lock_guard<std::mutex> lk(st->lock);
        moe::BatchLimits limits = st->batcher.limits();
        if (prop_id == PROP_MAX_BATCH)
          limits.max_batch = g_value_get_uint(value);
        else
          limits.max_latency = std::chrono::nanoseconds(g_value_get_uint64(value));
        st->batcher.set_limits(limits);  // within the ranges of the param specs
      }
      if (prop_id == PROP_MAX_BATCH)
        st->wake.notify_all();  // a larger batch leaves room for a waiting streaming thread
      else
        gst_element_post_message(GST_ELEMENT(self), gst_message_new_latency(GST_OBJECT(self)));
      break;
    }
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
}

// The `stats` structure: the batcher's counters and the encoder's.
static GstStructure* encode_stats(EncodeState* st) {
  std::lock_guard<std::mutex> lk(st->lock);
  const moe::BatcherStats& b = st->batcher.stats();
  GValue by_size = G_VALUE_INIT;
  gst_value_array_init(&by_size, static_cast<guint>(b.batches_by_size.size()));
  for (const uint64_t n : b.batches_by_size) {
    GValue v = G_VALUE_INIT;
    g_value_init(&v, G_TYPE_UINT64);
    g_value_set_uint64(&v, n);
    gst_value_array_append_and_take_value(&by_size, &v);
  }
  GstStructure* s = gst_structure_new(
      "moe-encode-stats", "requests", G_TYPE_UINT64, static_cast<guint64>(b.requests), "batches", G_TYPE_UINT64,
      static_cast<guint64>(b.batches), "rows-failed", G_TYPE_UINT64, st->counters.rows_failed, "encode-ms",
      G_TYPE_DOUBLE, st->counters.encode_ms, "queue-wait-ms", G_TYPE_DOUBLE, b.wait_ms_total, "queue-wait-max-ms",
      G_TYPE_DOUBLE, b.wait_ms_max, "late", G_TYPE_UINT64, static_cast<guint64>(b.late), nullptr);
  gst_structure_take_value(s, "batches-by-size", &by_size);
  return s;
}

static void gst_moe_encode_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  EncodeState* st = self->st;
  switch (prop_id) {
    case PROP_MODEL:
      GST_OBJECT_LOCK(self);
      g_value_set_string(value, st->model_path.empty() ? nullptr : st->model_path.c_str());
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_DEVICE:
      GST_OBJECT_LOCK(self);
      g_value_set_string(value, st->device.c_str());
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_PRECISION:
      GST_OBJECT_LOCK(self);
      g_value_set_enum(value, st->precision);
      GST_OBJECT_UNLOCK(self);
      break;
    case PROP_MAX_BATCH: {
      std::lock_guard<std::mutex> lk(st->lock);
      g_value_set_uint(value, static_cast<guint>(st->batcher.limits().max_batch));
      break;
    }
    case PROP_MAX_LATENCY: {
      std::lock_guard<std::mutex> lk(st->lock);
      g_value_set_uint64(value, static_cast<guint64>(st->batcher.limits().max_latency.count()));
      break;
    }
    case PROP_STATS:
      g_value_take_boxed(value, encode_stats(st));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
}

static void gst_moe_encode_finalize(GObject* object) {
  GstMoeEncode* self = GST_MOE_ENCODE(object);
  stop_worker(self);  // only running if the element was disposed without going to NULL
  reset_stream(self->st);
  delete self->st;
  G_OBJECT_CLASS(gst_moe_encode_parent_class)->finalize(object);
}

static void gst_moe_encode_class_init(GstMoeEncodeClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  gobject_class->set_property = gst_moe_encode_set_property;
  gobject_class->get_property = gst_moe_encode_get_property;
  gobject_class->finalize = gst_moe_encode_finalize;
  element_class->change_state = GST_DEBUG_FUNCPTR(gst_moe_encode_change_state);

  g_object_class_install_property(
      gobject_class, PROP_MODEL,
      g_param_spec_string("model", "Model",
                          "Hugging Face CLIP model directory (config.json, model.safetensors, vocab.json, merges.txt, "
                          "preprocessor_config.json); loaded when going to READY, shared with other elements naming "
                          "the same directory, device and precision; can only be changed in the NULL state",
                          nullptr, static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS)));
  g_object_class_install_property(
      gobject_class, PROP_DEVICE,
      g_param_spec_string("device", "Device",
                          "Where the model computes: 'cpu', 'cuda:N' (CUDA device N; an error when it is not usable), "
                          "or 'auto' (cuda:0 when a usable CUDA device exists, else cpu; the choice and its reason "
                          "are logged); can only be changed in the NULL state",
                          kDefaultDevice, static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS)));
  g_object_class_install_property(
      gobject_class, PROP_PRECISION,
      g_param_spec_enum("precision", "Precision",
                        "How the model's Linear weights are stored on the device: fp32 (exact), fp16 or bf16 (half "
                        "the memory; embeddings typically within 1e-3 (fp16) or 1e-2 (bf16) relative of fp32); "
                        "activations and accumulation stay f32; can only be changed in the NULL state",
                        GST_TYPE_MOE_PRECISION, GST_MOE_PRECISION_FP32,
                        static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS)));
  g_object_class_install_property(
      gobject_class, PROP_MAX_BATCH,
      g_param_spec_uint("max-batch", "Maximum batch",
                        "Most requests encoded together. A request that finds the encoder idle is encoded at once; "
                        "those that arrive while it is busy leave together, up to this many, when it is done. While "
                        "this many are queued, the streaming thread waits (backpressure)",
                        1, kMaxMaxBatch, kDefaultMaxBatch, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_MAX_LATENCY,
      g_param_spec_uint64("max-latency", "Maximum latency",
                          "How long (ns) a request may queue behind the batch being encoded: added to the pipeline "
                          "latency; requests that queued longer are counted in stats (late). It delays nothing: "
                          "batches never wait for more requests while the encoder is idle",
                          0, kMaxMaxLatency, kDefaultMaxLatency, gstmoe::kPropertyMutablePlaying));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec(
          "moe-encode-stats, since the element started: requests (queued, including those that failed before "
          "or on arrival), batches (encoded), batches-by-size (array: [i] counts batches of 2^i to 2^(i+1)-1 "
          "requests), rows-failed (requests that failed here), encode-ms (time in engine calls), queue-wait-ms "
          "and queue-wait-max-ms (from arrival to the batch leaving: total and longest), late (requests that "
          "queued longer than max-latency)"));

  gst_element_class_add_static_pad_template(element_class, &sink_template);
  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "CLIP encoder", "Filter/Converter/Text/Video",
      "Encodes query texts (one per text/x-raw buffer), video frames, or application/x-moe-request buffers (a text or "
      "an encoded image file) with a CLIP model into batches of embeddings (application/x-moe-tensor, width = the "
      "model's projection_dim). Each row's request (id, modality, uri, timings) is in the buffer's GstMoeBatchMeta; "
      "requests that cannot be encoded travel on in its failed list. Example: gst-launch-1.0 videotestsrc "
      "num-buffers=16 ! moe-encode model=models/default/clip max-batch=4 ! fakesink",
      "gst-moe developers");

  GST_DEBUG_CATEGORY_INIT(gst_moe_encode_debug, "moe-encode", 0, "CLIP encoder");
  gst_type_mark_as_plugin_api(GST_TYPE_MOE_PRECISION, static_cast<GstPluginAPIFlags>(0));
}

static void gst_moe_encode_init(GstMoeEncode* self) {
  self->st = new EncodeState();
  gst_video_info_init(&self->st->video_info);
  gst_segment_init(&self->st->segment, GST_FORMAT_TIME);

  self->sinkpad = gst_pad_new_from_static_template(&sink_template, "sink");
  gst_pad_set_chain_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_moe_encode_chain));
  gst_pad_set_event_function(self->sinkpad, GST_DEBUG_FUNCPTR(gst_moe_encode_sink_event));
  gst_element_add_pad(GST_ELEMENT(self), self->sinkpad);

  self->srcpad = gst_pad_new_from_static_template(&src_template, "src");
  gst_pad_set_query_function(self->srcpad, GST_DEBUG_FUNCPTR(gst_moe_encode_src_query));
  gst_element_add_pad(GST_ELEMENT(self), self->srcpad);
}
