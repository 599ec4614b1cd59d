#!/usr/bin/env bash
# Video in, video out: plays a video with its best catalog match written on each frame.
#
#   pipelines/caption-video.sh [VIDEO]
#
# VIDEO: a video file decodebin reads (default: videotestsrc's test pattern, NUM_BUFFERS frames,
# -1 for ever). INDEX: the catalog index to search, made by build-index.sh with the same MODEL and
# ADAPTER (pipelines/env.sh: MODEL, ADAPTER, DEVICE, EXPERT_DEVICE, PRECISION).
# HITS=n writes the n best matches, one line each; FORMAT is moe-caption's line template
# (default "{caption} ({score:.2f})"); MIN_SCORE hides matches scoring lower.
# SINK=fakesink runs headless (the tests do); the default autovideosink opens a window. SINK may
# carry properties: SINK="fakesink sync=true" runs headless at the video's own pace.
set -euo pipefail
. "$(dirname "$0")/env.sh"
VIDEO=${1:-${VIDEO:-}}
NUM_BUFFERS=${NUM_BUFFERS:-300}
HITS=${HITS:-1}
FORMAT=${FORMAT:-"{caption} ({score:.2f})"}
MIN_SCORE=${MIN_SCORE:--1}
SINK=${SINK:-autovideosink}
if [ -n "$VIDEO" ]; then
  source=(filesrc location="$VIDEO" ! decodebin)
else
  source=(videotestsrc num-buffers="$NUM_BUFFERS")
fi

# tee           every frame goes both to the screen and to the search
# queue         (screen branch) absorbs the search's latency: textoverlay waits for each frame's
#               caption, which comes one search later
# textoverlay   writes moe-caption's text on the frames it is timed for (top left, shaded)
# queue leaky   (search branch) keeps only the newest frames while the search is busy, so the
#               video never waits for frames the search has no time for; each caption then lasts
#               until the next searched frame
# moe-encode    embeds each frame (max-batch=1: a frame is searched as soon as it arrives)
# moe-route, moe-expert  the adapter (unless ADAPTER=none)
# ann-query     the HITS nearest catalog items; the document keeps the frame's PTS
# moe-caption   one Pango markup caption per document, timed by its frame
# shellcheck disable=SC2086  # $SINK: an element and its properties, split into gst-launch words
exec gst-launch-1.0 -e \
  "${source[@]}" ! videoconvert ! tee name=t \
  t. ! queue ! textoverlay name=overlay valignment=top halignment=left shaded-background=true font-desc="Sans 14" \
  ! videoconvert ! $SINK \
  t. ! queue leaky=downstream max-size-buffers=2 ! videoconvert \
  ! moe-encode model="$MODEL" max-batch=1 device="$DEVICE" precision="$ENCODE_PRECISION" \
  "${adapter_stages[@]}" \
  ! ann-query index="$INDEX" k="$HITS" device="$DEVICE" \
  ! moe-caption hits="$HITS" format="$FORMAT" min-score="$MIN_SCORE" \
  ! overlay.text_sink
