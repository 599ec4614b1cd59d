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
set -euo pipefail
. "$(dirname "$0")/env.sh"
CATALOG=${1:-${CATALOG:-$repo/models/default/catalog}}
INDEX=${2:-$INDEX}
INDEX_TYPE=${INDEX_TYPE:-flat}

# moe-catalog-src   reads every image of the catalog, one request per image (uri + caption)
# moe-encode        CLIP image tower, 32 images per batch
# moe-route         the adapter's router picks the top-k experts of every embedding
# moe-expert        runs those experts: embedding + weighted expert outputs, L2-normalised
# ann-query         mode=build collects every embedding and writes the index at EOS
# fakesink          ann-query emits one summary document at the end (and one per failed image)
# No -e: Ctrl-C abandons the build and leaves an earlier INDEX as it was (with -e, the EOS it
# sends would make ann-query write the images encoded so far over it).
exec gst-launch-1.0 \
  moe-catalog-src location="$CATALOG" \
  ! moe-encode model="$MODEL" max-batch=32 device="$DEVICE" precision="$PRECISION" \
  ! moe-route model="$ADAPTER" \
  ! moe-expert model="$ADAPTER" device="$EXPERT_DEVICE" precision="$PRECISION" \
  ! ann-query mode=build index="$INDEX" index-type="$INDEX_TYPE" \
  ! fakesink
