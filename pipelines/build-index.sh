#!/usr/bin/env bash
# Index build: a folder of images (or one image, or a catalog.jsonl listing images and captions)
# -> a FAISS index file plus its item table (INDEX.items.jsonl).
#
#   pipelines/build-index.sh [CATALOG] [INDEX]
#
# CATALOG defaults to the shipped demo catalog, INDEX to build/catalog.faiss; MODEL and
# ADAPTER (environment) default to the shipped model in models/default; DEVICE, EXPERT_DEVICE
# and PRECISION choose where and how they compute (pipelines/env.sh). Run the README's set-up
# first so that build/gst-plugins holds the plugin.
#
# While it runs it prints a progress line every PROGRESS_ITEMS images (default 32: done, total,
# failures, rate, time left), a warning naming what a folder holds besides images (other files;
# subfolders, unless RECURSIVE=1 indexes them too), and at the end a summary naming each image
# that could not be indexed and why. Images that fail are left out of the index, which is still
# written; the script then exits 2, unless ALLOW_FAILURES=1 (exit 0 with the images it could read).
#
# Interrupted (SIGINT, SIGTERM, SIGHUP), it stops the build, keeps an earlier INDEX as it was,
# says so and exits 130, 143 or 129; a second signal stops gst-launch at once.
set -euo pipefail
. "$(dirname "$0")/env.sh"
CATALOG=${1:-${CATALOG:-$repo/models/default/catalog}}
INDEX=${2:-$INDEX}
INDEX_TYPE=${INDEX_TYPE:-flat}
RECURSIVE=${RECURSIVE:-0}
ALLOW_FAILURES=${ALLOW_FAILURES:-0}
PROGRESS_ITEMS=${PROGRESS_ITEMS:-32}
ITEMS=$INDEX.items.jsonl
case $INDEX in */*) [ -d "${INDEX%/*}" ] || mkdir -p -- "${INDEX%/*}" ;; esac
recursive=false
[ "$RECURSIVE" = 1 ] && recursive=true
# ann-query's documents (one error document per failed image, then the index-built summary),
# read back for the number of failures; outside INDEX's folder, removed on exit.
docs=$(mktemp "${TMPDIR:-/tmp}/build-index.XXXXXX")
trap 'rm -f -- "$docs"' EXIT

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

# moe-catalog-src   reads every image of the catalog, one request per image (uri + caption); warns
#                   about the files of a folder it skips
# moe-encode        CLIP image tower, 32 images per batch (no query cache: every item is new)
# moe-route         the adapter's router picks the top-k experts of every embedding (unless
#                   ADAPTER=none: base CLIP's embeddings are indexed as they are)
# moe-expert        runs those experts: embedding + weighted expert outputs, L2-normalised
# ann-query         mode=build collects every embedding and writes the index at EOS; posts the
#                   progress lines and the final summary (gst-launch prints them)
# filesink          ann-query's documents at EOS: one per failed image, then the index-built one
# No -e: an interrupt abandons the build (with -e, the EOS it sends would make ann-query write
# the images encoded so far over INDEX). setsid: signals reach gst-launch only through
# stop_build (Ctrl-C in a terminal would reach it twice, and the second SIGINT kills it).
# --default-signal: a background job starts with SIGINT ignored, and gst-launch handles it only
# once prerolling has begun; until then an interrupt must end it rather than be lost.
setsid env --default-signal=INT gst-launch-1.0 \
  moe-catalog-src location="$CATALOG" recursive=$recursive \
  ! moe-encode model="$MODEL" max-batch=32 device="$DEVICE" precision="$ENCODE_PRECISION" cache-bytes=0 \
  "${adapter_stages[@]}" \
  ! ann-query mode=build index="$INDEX" index-type="$INDEX_TYPE" progress-items="$PROGRESS_ITEMS" \
  ! filesink location="$docs" &
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
  [ "$status" -eq 0 ] || exit "$status"
  # The index-built document is the last one; a quote inside a JSON string is escaped, so the
  # pattern matches only its own members.
  # Shell builtins only: the sanitizer run preloads ASan into every program this script starts.
  summary= items= failed=0
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in *'"type":"index-built"'*) summary=${line##*'"type":"index-built"'} ;; esac
  done < "$docs"
  [[ $summary =~ \"items\":([0-9]+) ]] && items=${BASH_REMATCH[1]}
  [[ $summary =~ \"failed\":([0-9]+) ]] && failed=${BASH_REMATCH[1]}
  if [ "$failed" -eq 0 ]; then
    echo "build-index: indexed ${items:-?} images into $INDEX"
    exit 0
  fi
  if [ "$ALLOW_FAILURES" = 1 ]; then
    echo "build-index: indexed ${items:-?} images into $INDEX; $failed failed (named above; ALLOW_FAILURES=1)"
    exit 0
  fi
  echo "build-index: failed images: $failed (named above); $INDEX was written with the other ${items:-?}." \
    "Fix or remove them, or set ALLOW_FAILURES=1 to accept the index without them" >&2
  exit 2
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
