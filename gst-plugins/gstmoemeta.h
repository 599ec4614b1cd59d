/* gst-moe: what flows between the elements.
 *
 * Caps (see docs/elements.md):
 *   application/x-moe-request                 one request per buffer: the query text (UTF-8) or
 *                                             the encoded image file bytes; the meta has 1 row
 *   application/x-moe-tensor, dtype=f32,      one batch: rows x width f32, row-major; the meta
 *     width=[1,65536]                         has one record per row, in row order
 *   application/json                          one result document per buffer (ann-query)
 *
 * GstMoeBatchMeta carries, for every row, the request record (id, modality, query text or
 * uri, arrival time, routing, stage timings) plus the requests that failed upstream, so that
 * every request that entered is answered exactly once, and nothing relies on buffer order.
 * The meta has no tags: it survives every transform.
 */
#pragma once

#include <gst/gst.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe/ann_index.h"
#include "moe/query_request.h"

#define GST_MOE_REQUEST_CAPS "application/x-moe-request"
#define GST_MOE_TENSOR_MEDIA_TYPE "application/x-moe-tensor"
#define GST_MOE_TENSOR_CAPS GST_MOE_TENSOR_MEDIA_TYPE ", dtype=(string)f32, width=(int)[1,65536]"
#define GST_MOE_JSON_CAPS "application/json"
// Tensors from outside gst-moe, without a GstMoeBatchMeta: ours, or NNStreamer's (see
// parse_open_tensor_caps for what of theirs is taken; the rest is refused at caps time, naming why).
#define GST_MOE_NNS_TENSORS_MEDIA_TYPE "other/tensors"
#define GST_MOE_NNS_TENSOR_MEDIA_TYPE "other/tensor"
#define GST_MOE_OPEN_TENSOR_CAPS \
  GST_MOE_TENSOR_CAPS "; " GST_MOE_NNS_TENSORS_MEDIA_TYPE "; " GST_MOE_NNS_TENSOR_MEDIA_TYPE

namespace gstmoe {

// Tensor: a plain vector, no meta (ann-query). Hybrid: an image and a text in one request ("like this
// photo, but red"): the buffer holds the image bytes, the record the text.
enum class Modality { Text, Image, Tensor, Hybrid };

// What a request asks: a search (queries), or a change to the catalog (docs/zmq-schema.md,
// "Live updates"; ann-query refuses them unless its allow-updates is set).
enum class RequestOp { Search, Upsert, Delete };

// How a hybrid request's image and text embeddings were fused into its query vector.
struct Fusion {
  float image = 0;     // weight of the image embedding
  float text = 0;      // weight of the text embedding
  std::string method;  // "gate" (the adapter's learned cross-modal gate) or "average" (no gate)
};
const char* modality_name(Modality m);

// One request, from the moment it enters the pipeline to its result document.
struct RequestRecord {
  std::string id;  // from the client, an upstream meta, the buffer offset or a counter
  Modality modality = Modality::Text;
  std::string text;                   // the query text (text requests) or the caption (catalog images)
  std::string uri;                    // the image's uri (image requests)
  std::string fields;                 // catalog images: the catalog line's other members, a JSON object's text
  int64_t arrival_wall_us = 0;        // g_get_real_time() when it entered (for reports)
  int64_t arrival_mono_us = 0;        // g_get_monotonic_time() when it entered (for timings)
  int k = 0;                          // results wanted; 0: ann-query's k
  int nprobe = 0;                     // IVF lists to scan; 0: ann-query's nprobe
  int ef_search = 0;                  // HNSW candidate list size; 0: ann-query's ef-search
  moe::AnnFilter filter;              // only catalog items whose fields match (empty: all)
  std::vector<int32_t> experts;       // after moe-route: chosen experts, best first
  std::vector<float> expert_weights;  // their weights
  std::vector<std::pair<std::string, double>> timings_ms;  // stage -> milliseconds, in order
  // Video frames: the frame's own PTS and its stream time (set by moe-encode; a batch buffer
  // carries only its first row's PTS). GST_CLOCK_TIME_NONE for other requests.
  GstClockTime pts = GST_CLOCK_TIME_NONE;
  GstClockTime stream_time = GST_CLOCK_TIME_NONE;
  // What its batch cost besides the stage times, for its share (docs/zmq-schema.md, "cost"):
  // the rows of the batch moe-encode made (0: no moe-encode upstream), the host time moe-expert
  // waited for the batch's expert copies, and the expert bytes the batch had copied to devices.
  size_t batch_rows = 0;
  double batch_copy_wait_ms = 0;
  uint64_t batch_expert_bytes = 0;
  // Hybrid requests: the text's embedding (moe-encode; the tensor row is the image's) until the
  // two are fused into the row (moe-route, or ann-query when no moe-route ran), then `fusion`.
  std::vector<float> text_embedding;
  std::optional<Fusion> fusion;
  // Catalog updates: an Upsert's row is the new item's vector and `item` describes it; a Delete has
  // no row (it travels in BatchRecords::controls) and names the catalog ids in `item_ids`.
  RequestOp op = RequestOp::Search;
  moe::AnnItem item;
  std::vector<std::string> item_ids;
};

// A request that could not be processed; it travels to the result stream as an error record.
struct FailedRequest {
  RequestRecord request;
  std::string stage;                              // element that failed it: "zmq-query", "moe-encode", ...
  std::string reason;                             // human-readable, names the thing and the reason
  const char* code = moe::error_code::kInternal;  // machine-readable, set where it failed
};

struct BatchRecords {
  std::vector<RequestRecord> rows;      // rows[i] describes tensor row i
  std::vector<FailedRequest> failed;    // answered with an error record by ann-query
  std::vector<RequestRecord> controls;  // requests without a row (catalog deletions), for ann-query
  std::string encoder;                  // model identifiers, for the result documents
  std::string adapter;
  // What made the vectors, for ann-query's provenance check: moe-encode's and moe-expert's
  // fingerprint() of their models (16 hex digits; moe-expert appends "+<router's>" when the
  // moe-route that chose its experts has other weights; how it routed is not part of it). Empty
  // adapter_fingerprint: no moe-expert changed the rows (moe-route names its adapter in `adapter`
  // but leaves the vectors as they are).
  std::string encoder_fingerprint;
  std::string adapter_fingerprint;
  // The fingerprint() of the adapter whose router routed the rows (set by moe-route per batch; empty:
  // no moe-route). During a hot swap moe-expert runs the experts of the adapter it holds with this
  // fingerprint, so a batch keeps the adapter it was routed with (docs/architecture.md, "Hot swap").
  std::string router_fingerprint;
  // moe-route's moe::ExpertExecutor::prefetch() of this batch, for the moe-expert downstream
  // (null when its experts run on the CPU path): holds the batch's pinned experts on the devices.
  // Copies of the meta share it; moe-expert drops it when it has run the batch, which unpins them.
  std::shared_ptr<void> expert_prefetch;
};

}  // namespace gstmoe

G_BEGIN_DECLS

typedef struct _GstMoeBatchMeta GstMoeBatchMeta;

struct _GstMoeBatchMeta {
  GstMeta meta;
  gstmoe::BatchRecords* records;  // owned
};

GType gst_moe_batch_meta_api_get_type(void);
#define GST_MOE_BATCH_META_API_TYPE (gst_moe_batch_meta_api_get_type())
const GstMetaInfo* gst_moe_batch_meta_get_info(void);
#define GST_MOE_BATCH_META_INFO (gst_moe_batch_meta_get_info())

// Attaches a meta holding a copy of `records` (buffer must be writable).
GstMoeBatchMeta* gst_buffer_add_moe_batch_meta(GstBuffer* buffer, const gstmoe::BatchRecords& records);
#define gst_buffer_get_moe_batch_meta(b) ((GstMoeBatchMeta*)gst_buffer_get_meta((b), GST_MOE_BATCH_META_API_TYPE))

// How an element's model stores its Linear weights (the `precision` property of the elements that
// load a model on a compute device). Activations and accumulation stay f32.
typedef enum {
  GST_MOE_PRECISION_FP32 = 0,
  GST_MOE_PRECISION_FP16 = 1,
  GST_MOE_PRECISION_BF16 = 2,
  GST_MOE_PRECISION_INT4 = 3,  // 4-bit experts as stored (moe-expert only: GST_TYPE_MOE_EXPERT_PRECISION)
} GstMoePrecision;

// fp32, fp16, bf16: what moe-encode offers.
GType gst_moe_precision_get_type(void);
#define GST_TYPE_MOE_PRECISION (gst_moe_precision_get_type())
// The same values and int4 (moe-expert: a 4-bit adapter's experts run packed, as stored).
GType gst_moe_expert_precision_get_type(void);
#define GST_TYPE_MOE_EXPERT_PRECISION (gst_moe_expert_precision_get_type())

G_END_DECLS

namespace moe::kernels {
enum class WeightType : uint8_t;  // backend.h
}

namespace gstmoe {

// The tensor caps for `width` f32 columns.
GstCaps* tensor_caps(int width);
// Reads width from tensor caps; false if the caps are not fixed x-moe-tensor f32 caps.
bool parse_tensor_caps(const GstCaps* caps, int* width);
// Reads the row width from fixed GST_MOE_OPEN_TENSOR_CAPS: x-moe-tensor, or NNStreamer's caps for
// one static float32 tensor (other/tensors: format=static or none, num_tensors=1, types=float32,
// dimensions; other/tensor: type=float32, dimension), whose first (innermost) dimension is the
// width and whose others count rows. False, with `why` naming the caps field, for anything else;
// dimension strings are bounded: at most 16 of them, width up to 65536, up to 1048576 rows.
bool parse_open_tensor_caps(const GstCaps* caps, int* width, std::string* why);

// A read-only buffer that takes `bytes` without copying them (request payloads: image files).
GstBuffer* bytes_buffer(std::vector<uint8_t>&& bytes);

// The engine's weight type for a GstMoePrecision, and the property's nick for messages.
moe::kernels::WeightType weight_type(GstMoePrecision precision);
const char* precision_nick(GstMoePrecision precision);

// Milliseconds between two g_get_monotonic_time() readings.
inline double elapsed_ms(int64_t from_us, int64_t to_us) { return static_cast<double>(to_us - from_us) / 1000.0; }

// The flags of the elements' read-write properties: changeable up to READY (read when the element
// starts) or in every state (read as the data flows). docs/architecture.md, "Element skeleton".
inline constexpr GParamFlags kPropertyMutableReady =
    static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_READY);
inline constexpr GParamFlags kPropertyMutablePlaying =
    static_cast<GParamFlags>(G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS | GST_PARAM_MUTABLE_PLAYING);

// The read-only `stats` property (a GstStructure) of an element with counters; `blurb` is a string
// literal naming the structure and its fields.
GParamSpec* stats_param_spec(const char* blurb);

}  // namespace gstmoe
