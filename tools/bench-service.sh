#!/usr/bin/env bash
# The query service against the engine: starts pipelines/serve.sh on loopback over a small index
# and runs moe-bench-service, which drives the service with 1, 8 and 32 queries in flight and,
# beside each, calls the engine directly on the same model, adapter and index with as many texts
# per call (docs/benchmarks.md, "Service against the engine"). A benchmark, not a test.
#
#   tools/bench-service.sh                   3 rounds of 10 s per load after 2 s of warm-up (~4 min)
#   tools/bench-service.sh --vit-b32         on a ViT-B/32-sized model instead of the shipped 64-px one:
#                                            a synthetic CLIP ViT-B/32 (random weights, CLIP's tokenizer)
#                                            and a synthetic adapter for it (512 wide, 8 experts of
#                                            width 2048, top-2), written once to
#                                            BUILD_DIR/bench-service/vit-b32/ (moe-bench-service
#                                            --write-vit-b32); MODEL and ADAPTER still override them
#   tools/bench-service.sh --build-dir DIR   build in DIR (default: build)
#   tools/bench-service.sh --jobs N          meson compile -j N (default 1)
#   other options go to moe-bench-service (--inflight, --rounds, --seconds, --warmup, --k, --queries,
#   --json FILE; see moe-bench-service --help)
#
# Environment: MODEL and ADAPTER (default: the shipped model), CATALOG (default
# models/default/catalog), INDEX (default: built once per MODEL, ADAPTER and CATALOG with
# pipelines/build-index.sh into BUILD_DIR/bench-service/), OPENBLAS_NUM_THREADS and
# OMP_NUM_THREADS (default 1, for the service and the direct engine alike). The service listens
# on two free loopback ports and logs to BUILD_DIR/bench-service/serve.log. The load average is
# printed before and after: on a shared machine, rerun when it is high.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR=build
JOBS=(-j 1)
VIT_B32=0
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#*=}"; shift ;;
    --jobs) JOBS=(-j "$2"); shift 2 ;;
    --jobs=*) JOBS=(-j "${1#*=}"); shift ;;
    --vit-b32) VIT_B32=1; shift ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac

log() { echo "[bench-service] $*" >&2; }
load_average() { echo "load average $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc --all) cores"; }

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  meson setup "$BUILD_DIR" "$ROOT" -Dcuda=disabled --buildtype=release >&2
fi
meson compile -C "$BUILD_DIR" "${JOBS[@]}" gstmoe moe-bench-service >&2

out="$BUILD_DIR/bench-service"
mkdir -p "$out"
export GST_PLUGIN_PATH_1_0="$BUILD_DIR/gst-plugins"
export GST_REGISTRY_1_0="$out/gst-registry.bin"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$VIT_B32" = 1 ]; then
  vit="$out/vit-b32"
  if [ ! -f "$vit/.complete" ]; then
    log "writing a synthetic CLIP ViT-B/32 and adapter to $vit"
    rm -rf "$vit"
    "$BUILD_DIR/bench/moe-bench-service" --write-vit-b32 "$vit"
    cp "$ROOT"/models/clip-tokenizer/* "$vit/clip/"
    touch "$vit/.complete"
  fi
  MODEL="${MODEL:-$vit/clip}" ADAPTER="${ADAPTER:-$vit/adapter}"
fi
export MODEL="${MODEL:-$ROOT/models/default/clip}" ADAPTER="${ADAPTER:-$ROOT/models/default/adapter}"
CATALOG="${CATALOG:-$ROOT/models/default/catalog}"
# An index serves only the models that built it: one per model, adapter and catalog.
models_key=$(printf '%s\n' "$MODEL" "$ADAPTER" "$CATALOG" | md5sum | cut -c1-8)
INDEX="${INDEX:-$out/catalog-$models_key.faiss}"

if [ ! -f "$INDEX" ]; then
  log "indexing $CATALOG into $INDEX (pipelines/build-index.sh)"
  "$ROOT/pipelines/build-index.sh" "$CATALOG" "$INDEX" > "$out/build-index.log" 2>&1 ||
    { cat "$out/build-index.log" >&2; exit 1; }
fi

# Two free loopback ports, so that a demo or another run on the default ports is left alone.
read -r query_port result_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
requests="tcp://127.0.0.1:$query_port"
results="tcp://127.0.0.1:$result_port"

log "starting the service (pipelines/serve.sh) on $requests -> $results"
# CACHE_BYTES=0: the demo's queries repeat, and the direct side encodes every one of them.
CACHE_BYTES=0 QUERY_ENDPOINT="$requests" RESULT_ENDPOINT="$results" "$ROOT/pipelines/serve.sh" "$INDEX" > "$out/serve.log" 2>&1 &
service=$!
trap 'kill -INT "$service" 2>/dev/null; wait "$service" 2>/dev/null || true' EXIT

echo "before: $(load_average); OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS"
if ! "$BUILD_DIR/bench/moe-bench-service" --requests "$requests" --results "$results" --model "$MODEL" \
     --adapter "$ADAPTER" --index "$INDEX" "${PASS[@]}"; then
  echo "-- service log ($out/serve.log):"
  tail -n 20 "$out/serve.log"
  exit 1
fi
echo "after: $(load_average)"
