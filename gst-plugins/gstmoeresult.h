/* gst-moe: the JSON documents that leave the pipeline (ann-query output, published as is by
 * zmq-publish). docs/zmq-schema.md is the reference subscribers program against; every field
 * written here is described there.
 *
 *   result       one per answered request: the hits, routing, model identifiers, timings, cost
 *   error        one per failed request: the stage that failed it and why
 *   update       one per applied catalog update (ann-query allow-updates): what changed
 *   index-built  one per build run (ann-query mode=build), at EOS
 *
 * Every document starts with "schema" (kResultSchema), then "type"; error documents carry the
 * failure's machine-readable error.code (moe::error_code) beside its reason.
 *
 * Documents are compact (one line, no trailing newline), UTF-8. Empty strings that stand for
 * "none" (an id the client did not send, the query of an image request, the uri of a text
 * request, an absent model) are written as null. */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gstmoemeta.h"

namespace gstmoe {

// The documents' schema version ("schema"): raised only for a change that breaks a reader of the
// previous one (a field removed, renamed or retyped); added fields keep it.
constexpr int kResultSchema = 1;

// One hit of a search, resolved to its catalog item.
struct ResultHit {
  int64_t item = 0;     // row in the index
  std::string id;       // the catalog's id of the item ("" -> null)
  std::string uri;      // the item's uri, rebased by ann-query uri-base ("" -> null)
  std::string caption;  // the item's caption ("" -> null)
  std::string fields;   // the catalog line's other members, a JSON object's text ("" -> {})
  double score = 0.0;   // cosine similarity
};

// The identifiers in a result document's "model" object ("" -> null).
struct ModelIds {
  std::string encoder;  // basename of the CLIP model directory
  std::string adapter;  // basename of the MoE adapter directory
  std::string index;    // basename of the index file
};

// A request's share of what its batch cost the machine (the result document's "cost", and the
// Prometheus gstmoe_request_cost_seconds_total and gstmoe_request_expert_loaded_bytes_total): every
// stage's batch time, the host time its batch waited for expert copies and the expert bytes its
// batch had copied are split evenly over the batch's rows, so that the shares of all requests add
// up to the machine's busy time; the wait is the request's own.
struct RequestCost {
  double compute_ms = 0;    // its share of the stages' batch times (all but "queue"), less copy_ms
  double copy_ms = 0;       // its share of the host time its batch waited for expert copies
  double wait_ms = 0;       // its own time queued for a batch (the "queue" stage)
  double expert_bytes = 0;  // its share of the expert weight bytes its batch had copied to devices
};

// False, leaving `cost` as it is, when the request's batch is unknown (no moe-encode upstream).
bool request_cost(const RequestRecord& request, RequestCost* cost);

// The result document for `request`: `k` is the number of results that was asked for (hits may
// be fewer when the index is smaller). timings_ms gets "total" = arrival to `now_mono_us`
// (g_get_monotonic_time()).
std::string result_document(const RequestRecord& request, int k, const std::vector<ResultHit>& hits,
                            const ModelIds& model, int64_t now_mono_us);

// The error document for a failed request.
std::string error_document(const FailedRequest& failed);

// What a catalog update (RequestOp::Upsert or Delete) did to the index that applied it.
struct UpdateOutcome {
  int64_t row = -1;                  // upsert: the item's new row in the index
  bool replaced = false;             // upsert: an item with its id was there and is replaced
  int64_t deleted = 0;               // delete: how many of the ids named an item, now deleted
  std::vector<std::string> missing;  // delete: the ids that named no item
  int64_t items = 0;                 // live items in the index afterwards
  std::string index;                 // basename of the index file
};

// The answer to an applied update, type "update": op "upsert" with the item's id, row and replaced,
// or op "delete" with deleted and missing; then the index and its live items.
std::string update_document(const RequestRecord& request, const UpdateOutcome& outcome, int64_t now_mono_us);

// The summary ann-query mode=build sends after writing an index.
std::string index_built_document(const std::string& index_path, int64_t items, int dim, const char* index_type,
                                 int64_t failed);

// RFC 3339 UTC with microseconds ("2026-11-30T09:00:00.123456Z") for g_get_real_time() values.
std::string rfc3339_utc(int64_t wall_us);

}  // namespace gstmoe
