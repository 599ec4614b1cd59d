#!/usr/bin/env bash
# The main job, from a fresh clone: installs packages (idempotent), builds the plugin, indexes the
# shipped demo catalog with the index-build pipeline, starts the query service pipeline, sends a
# handful of text queries and one image query over ZeroMQ, prints each query's top results with
# its latency and the experts used, and writes a self-contained HTML page with thumbnails that
# also names the encoder, the adapter (its experts and routing, from its adapter_config.json) and
# the index.
#
#   tools/run-demo.sh [--quick] [QUERY...]
#
# QUERY arguments replace the default text queries. --quick (used by CI) sends fewer queries.
# Environment: MOE_BUILD_DIR (default build), MODEL / ADAPTER / CATALOG (default: the shipped
# model in models/default), QUERY_ENDPOINT / RESULT_ENDPOINT (default tcp://127.0.0.1:5555/5556),
# IMAGE_ROOT (default CATALOG: the folder image queries may name, zmq-query's image-root).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

quick=0
queries=()
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    *) queries+=("$a") ;;
  esac
done
if [ ${#queries[@]} -eq 0 ]; then
  queries=("pink mug" "yellow hat" "red shirt" "blue striped bag" "green lamp" "white chair outdoors")
  [ $quick -eq 1 ] && queries=("pink mug" "yellow hat")
fi

build=${MOE_BUILD_DIR:-build}
MODEL=${MODEL:-$repo/models/default/clip}
ADAPTER=${ADAPTER:-$repo/models/default/adapter}
CATALOG=${CATALOG:-$repo/models/default/catalog}
export QUERY_ENDPOINT=${QUERY_ENDPOINT:-tcp://127.0.0.1:5555}
export RESULT_ENDPOINT=${RESULT_ENDPOINT:-tcp://127.0.0.1:5556}
# The image query names a catalog photo by its path: the service reads files under this folder only.
export IMAGE_ROOT=${IMAGE_ROOT:-$CATALOG}
out="$repo/$build/demo"

tools/install-deps.sh
# The demo runs on the CPU; a CPU-only build keeps the first run to a couple of minutes
# (configure the build folder with -Dcuda=enabled yourself for the CUDA kernels).
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release -Dcuda=disabled -Dtests=disabled >/dev/null
fi
echo "== building the plugin and the demo client ($build)"
meson compile -C "$build" -j "${MOE_BUILD_JOBS:-2}" gstmoe moe-search-demo >/dev/null
export GST_PLUGIN_PATH_1_0="$repo/$build/gst-plugins"
export GST_REGISTRY_1_0="$repo/$build/gst-registry.bin"
export MODEL ADAPTER

mkdir -p "$out"
echo "== indexing $CATALOG (pipelines/build-index.sh)"
pipelines/build-index.sh "$CATALOG" "$out/catalog.faiss" > "$out/build-index.log" 2>&1 ||
  { cat "$out/build-index.log"; exit 1; }
echo "   $(grep -c '' "$out/catalog.faiss.items.jsonl" | awk '{print $1 - 1}') images indexed -> $out/catalog.faiss"

echo "== starting the query service (pipelines/serve.sh) on $QUERY_ENDPOINT -> $RESULT_ENDPOINT"
pipelines/serve.sh "$out/catalog.faiss" > "$out/serve.log" 2>&1 &
service=$!
trap 'kill $service 2>/dev/null; wait $service 2>/dev/null || true' EXIT

args=(--requests "$QUERY_ENDPOINT" --results "$RESULT_ENDPOINT" --k 5 --html "$out/search-demo.html"
      --adapter "$ADAPTER" --index "$out/catalog.faiss")
for q in "${queries[@]}"; do args+=(--text "$q"); done
# One image query: a catalog photo, which should find itself and its look-alikes.
args+=(--image "$CATALOG/$(ls "$CATALOG" | grep -m1 -E '\.png$')")
if ! "$build/examples/moe-search-demo" "${args[@]}"; then
  echo "-- service log:"; cat "$out/serve.log"
  exit 1
fi
# The page shows each query's latency and what served it (CI runs this script: a page that lost
# them fails here).
for shown in 'latency [0-9.]* ms (' '<td>Adapter</td><td>[^<]* experts, top-' '<td>Index</td><td>catalog.faiss ([0-9]* items'; do
  grep -q "$shown" "$out/search-demo.html" || { echo "run-demo: the page lacks /$shown/" >&2; exit 1; }
done
echo "Open $out/search-demo.html in a browser to see the results with pictures."
