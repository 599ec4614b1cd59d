#!/usr/bin/env bash
# Query service: JSON requests in on ZeroMQ, JSON results out on ZeroMQ.
#
#   pipelines/serve.sh [INDEX]
#
# Clients PUSH requests to tcp://127.0.0.1:5555 ({"id": "q1", "text": "red mug"} or
# {"id": "q2", "image_base64": "iVBORw0..."}, or both: {"id": "q4", "image_base64": "...", "text": "in red"})
# and SUBscribe to tcp://127.0.0.1:5556 for the
# results (docs/zmq-schema.md). QUERY_ENDPOINT / RESULT_ENDPOINT override the endpoints;
# QUERY_BIND=false / RESULT_BIND=false connect them to a broker that binds them instead (a replica
# behind moe-broker: pipelines/serve-replicas.sh, docs/replicas.md);
# NUM_REQUESTS=n makes the service stop after n requests (-1: run until interrupted).
# IMAGE_ROOT=DIR also serves {"id": "q3", "image": "photo.png"} requests naming files under DIR
# (relative to it, or absolute paths inside it); without it such requests are refused.
# CURVE_KEY=FILE CURVE_ALLOWED=DIR_OR_FILE put both sockets under CURVE: FILE is the service's
# secret certificate (server.key_secret of zmq.auth.create_certificates), DIR_OR_FILE the clients'
# public certificates (*.key) or a list of their public keys; only those clients may send requests
# or receive results (docs/zmq-schema.md#access-control-curve). Without them: plain ZeroMQ.
# URI_BASE=https://cdn.example/catalog serves each hit's uri under that base instead of the
# file:// path the index was built from (ann-query uri-base, docs/zmq-schema.md).
# METRICS_ADDRESS=127.0.0.1:9464 serves Prometheus metrics at http://127.0.0.1:9464/metrics
# (docs/metrics.md).
# CACHE_BYTES bounds moe-encode's query cache (default 64 MiB; 0 turns it off): a repeated query
# text or image skips the encoder (docs/operations.md).
# ALLOW_UPDATES=true lets clients add, replace and delete catalog items on the request socket
# ({"op": "upsert", ...}, {"op": "delete", ...}; docs/zmq-schema.md, "Live updates"): each is
# journalled next to the index before it is answered, and the index is rewritten every
# SNAPSHOT_INTERVAL updates (default 0: when the service stops). Needs an index on the CPU.
# ADAPTER=none serves the encoder alone (base CLIP: no moe-route / moe-expert), over an index
# built with ADAPTER=none too.
# DEVICE, EXPERT_DEVICE and PRECISION choose where and how the models compute (pipelines/env.sh),
# e.g. DEVICE=auto EXPERT_DEVICE=all PRECISION=fp16 on a GPU machine; PRECISION=int4 serves the
# 4-bit adapter (models/default/adapter-int4 unless ADAPTER says otherwise) with the encoder in fp32.
set -euo pipefail
. "$(dirname "$0")/env.sh"
INDEX=${1:-$INDEX}
QUERY_ENDPOINT=${QUERY_ENDPOINT:-tcp://127.0.0.1:5555}
RESULT_ENDPOINT=${RESULT_ENDPOINT:-tcp://127.0.0.1:5556}
QUERY_BIND=${QUERY_BIND:-true}
RESULT_BIND=${RESULT_BIND:-true}
NUM_REQUESTS=${NUM_REQUESTS:--1}
IMAGE_ROOT=${IMAGE_ROOT:-}
CURVE_KEY=${CURVE_KEY:-}
CURVE_ALLOWED=${CURVE_ALLOWED:-}
METRICS_ADDRESS=${METRICS_ADDRESS:-}
URI_BASE=${URI_BASE:-}
CACHE_BYTES=${CACHE_BYTES:-67108864}
ALLOW_UPDATES=${ALLOW_UPDATES:-false}
SNAPSHOT_INTERVAL=${SNAPSHOT_INTERVAL:-0}
# The same key pair and allow-list on both sockets; an element refuses to start with only one set.
curve=()
if [ -n "$CURVE_KEY" ]; then curve+=(curve-secret-key-file="$CURVE_KEY"); fi
if [ -n "$CURVE_ALLOWED" ]; then curve+=(curve-allowed-keys="$CURVE_ALLOWED"); fi

# zmq-query     PULL socket: one buffer per request (text, or image bytes), request id in the meta;
#               image-root is set only when IMAGE_ROOT is (gst-launch cannot take an empty value);
#               CURVE when CURVE_KEY and CURVE_ALLOWED are set, on this socket and zmq-publish's
# moe-encode    CLIP text/image towers; batches up to 16 requests, waits at most 5 ms for a batch;
#               on DEVICE, weights in ENCODE_PRECISION (PRECISION; fp32 when PRECISION=int4);
#               answers repeated queries from its cache
# moe-route     fuses hybrid (image + text) queries with the adapter's cross-modal gate; router:
#               top-k experts per query (unless ADAPTER=none)
# moe-expert    runs the experts on EXPERT_DEVICE (preloaded there by moe-route) in
#               EXPERT_PRECISION, L2-normalises (unless ADAPTER=none)
# ann-query     searches the index (a flat one GPU-resident when DEVICE is a GPU): one JSON result
#               (or error) document per request; applies catalog updates when ALLOW_UPDATES=true
# zmq-publish   PUB socket; never blocks on slow or absent subscribers (one that falls behind loses
#               its own messages and sees the gap in "seq"); serves /metrics when METRICS_ADDRESS is set
exec gst-launch-1.0 -e \
  zmq-query endpoint="$QUERY_ENDPOINT" bind="$QUERY_BIND" num-requests="$NUM_REQUESTS" ${IMAGE_ROOT:+image-root="$IMAGE_ROOT"} "${curve[@]}" \
  ! queue \
  ! moe-encode model="$MODEL" max-batch=16 max-latency=5000000 device="$DEVICE" precision="$ENCODE_PRECISION" \
    cache-bytes="$CACHE_BYTES" \
  "${adapter_stages[@]}" \
  ! ann-query index="$INDEX" k=10 device="$DEVICE" ${URI_BASE:+uri-base="$URI_BASE"} \
    allow-updates="$ALLOW_UPDATES" snapshot-interval="$SNAPSHOT_INTERVAL" \
  ! zmq-publish endpoint="$RESULT_ENDPOINT" bind="$RESULT_BIND" "${curve[@]}" ${METRICS_ADDRESS:+metrics-address="$METRICS_ADDRESS"}
