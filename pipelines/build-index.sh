#!/usr/bin/env bash
# Index build: a folder of images (or a catalog.jsonl listing images and captions) -> a FAISS
# index file plus its item table (INDEX.items.jsonl).
#
#   pipelines/build-index.sh [CATALOG] [INDEX]
#
# CATALOG defaults to the shipped demo catalog, INDEX to build/catalog.faiss; MODEL and
# ADAPTER (environment) default to the shipped model in models/default; DEVICE, EXPERT_DEVICE
# and PRECISION choose where and how they compute (pipelines/env.sh). Run the README's set-up
# first so that build/gst-plugins holds the plugin.
#
# Interrupted (SIGINT, SIGTERM, SIGHUP), it stops the build, keeps an earlier INDEX as it was,
# says so and exits 130, 143 or 129; a second signal stops gst-launch at once.
set -euo pipefail
. "$(dirname "$0")/env.sh"
CATALOG=${1:-${CATALOG:-$repo/models/default/catalog}}
INDEX=${2:-$INDEX}
INDEX_TYPE=${INDEX_TYPE:-flat}
ITEMS=$INDEX.items.jsonl

# ann-query writes INDEX and ITEMS under temporary names and renames them into place once both
# are complete (AtomicFile in core/src/search/ann_index.cpp), so a new identity means a new index.
index_identity() { stat -c '%d:%i' -- "$INDEX" 2>/dev/null || true; }
index_before=$(index_identity)

gst_pid=
interrupted=  # the exit status the signal calls for
forwarded=
# Whatever the signal, gst-launch gets SIGINT: it then stops the pipeline without EOS, so
# ann-query writes nothing, and a build already writing at EOS finishes first, so INDEX and its
# items are never half replaced. SIGTERM kills it outright, maybe between the two renames: only
# a second signal sends that.
stop_build() {
  [ -n "$gst_pid" ] || return 0
  if [ -z "$forwarded" ]; then
    forwarded=1
    kill -INT "$gst_pid" 2>/dev/null || true
  else
    kill -TERM "$gst_pid" 2>/dev/null || true
  fi
}
trap 'interrupted=130; stop_build' INT
trap 'interrupted=143; stop_build' TERM
trap 'interrupted=129; stop_build' HUP

# moe-catalog-src   reads every image of the catalog, one request per image (uri + caption)
# moe-encode        CLIP image tower, 32 images per batch
# moe-route         the adapter's router picks the top-k experts of every embedding
# moe-expert        runs those experts: embedding + weighted expert outputs, L2-normalised
# ann-query         mode=build collects every embedding and writes the index at EOS
# fakesink          ann-query emits one summary document at the end (and one per failed image)
# No -e: an interrupt abandons the build (with -e, the EOS it sends would make ann-query write
# the images encoded so far over INDEX). setsid: signals reach gst-launch only through
# stop_build (Ctrl-C in a terminal would reach it twice, and the second SIGINT kills it).
# --default-signal: a background job starts with SIGINT ignored, and gst-launch handles it only
# once prerolling has begun; until then an interrupt must end it rather than be lost.
setsid env --default-signal=INT gst-launch-1.0 \
  moe-catalog-src location="$CATALOG" \
  ! moe-encode model="$MODEL" max-batch=32 device="$DEVICE" precision="$PRECISION" \
  ! moe-route model="$ADAPTER" \
  ! moe-expert model="$ADAPTER" device="$EXPERT_DEVICE" precision="$PRECISION" \
  ! ann-query mode=build index="$INDEX" index-type="$INDEX_TYPE" \
  ! fakesink &
gst_pid=$!  # setsid execs gst-launch in the same process (a background job leads no group)
[ -z "$interrupted" ] || stop_build  # a signal that came before gst_pid was known

status=0
wait "$gst_pid" || status=$?
# A trapped signal cuts `wait` short: wait on until gst-launch has stopped.
while [ -n "$interrupted" ] && kill -0 "$gst_pid" 2>/dev/null; do
  wait "$gst_pid" || true
done

# gst-launch also exits 0 when it was interrupted itself (SIGINT sent to its pid): it then wrote
# nothing, whereas a finished build always replaces INDEX.
if [ -z "$interrupted" ] && [ "$status" -eq 0 ] && [ "$(index_identity)" = "$index_before" ]; then
  interrupted=130
fi
if [ -z "$interrupted" ]; then
  exit "$status"
fi

# What a gst-launch killed while writing leaves behind (AtomicFile's names: PATH.tmp-PID-N).
rm -f -- "$INDEX.tmp-$gst_pid-"* "$ITEMS.tmp-$gst_pid-"*
index_after=$(index_identity)
if [ "$index_after" != "$index_before" ] && [ -n "$index_after" ]; then
  echo "build-index: interrupted after the build had finished: the new index at $INDEX is complete" >&2
elif [ -n "$index_before" ]; then
  echo "build-index: interrupted: the old index at $INDEX was kept" >&2
else
  echo "build-index: interrupted: no index was written" >&2
fi
exit "$interrupted"
