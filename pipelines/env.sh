# Sourced by the pipeline scripts: finds the freshly built plugin and the default model.
# Override any variable from the environment.
repo=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
if [ -z "${GST_PLUGIN_PATH_1_0:-}" ] && [ -d "$repo/build/gst-plugins" ]; then
  export GST_PLUGIN_PATH_1_0="$repo/build/gst-plugins"
fi
# Where the models compute. DEVICE (moe-encode, ann-query): cpu | cuda:N | auto (cuda:0 when a
# usable GPU exists, else cpu). EXPERT_DEVICE (moe-expert): cpu | cuda:N | cuda:0,cuda:1,... |
# all | auto (every GPU, else cpu), by default DEVICE. PRECISION of the encoder's and experts'
# weights: fp32 | fp16 | bf16 | int4. The defaults compute on the CPU in fp32, as the tests do.
# int4 is the experts' alone: the 4-bit adapter (ADAPTER defaults to models/default/adapter-int4,
# made by tools/moe-quantize.py) runs packed, as stored, on EXPERT_DEVICE, and the encoder in fp32.
# A 4-bit ADAPTER with another PRECISION runs as stored too (moe-expert logs it).
# ENCODE_PRECISION / EXPERT_PRECISION set one side alone, e.g. ENCODE_PRECISION=bf16 (a CPU
# speed path with AVX-512 BF16 or AMX) with the experts in fp32.
PRECISION=${PRECISION:-fp32}
if [ "$PRECISION" = int4 ]; then
  ADAPTER=${ADAPTER:-$repo/models/default/adapter-int4}
  ENCODE_PRECISION=${ENCODE_PRECISION:-fp32}
else
  ENCODE_PRECISION=${ENCODE_PRECISION:-$PRECISION}
fi
EXPERT_PRECISION=${EXPERT_PRECISION:-$PRECISION}
MODEL=${MODEL:-$repo/models/default/clip}
# ADAPTER=none: the encoder's embeddings are searched as they are (base CLIP, no moe-route and
# moe-expert), e.g. to compare an adapter with the model it adapts; build the index the same way.
ADAPTER=${ADAPTER:-$repo/models/default/adapter}
# The index: in the source tree's build/ folder; for the installed scripts (share/gst-moe) in the
# user's cache folder.
if [ -f "$repo/meson.build" ]; then
  INDEX=${INDEX:-$repo/build/catalog.faiss}
else
  INDEX=${INDEX:-${XDG_CACHE_HOME:-$HOME/.cache}/gst-moe/catalog.faiss}
fi
# ann-query searches a flat index on DEVICE; an HNSW index is searched by FAISS on the CPU, so
# with an HNSW index use DEVICE=auto (falls back) rather than cuda:N (refused at start).
DEVICE=${DEVICE:-cpu}
EXPERT_DEVICE=${EXPERT_DEVICE:-$DEVICE}
# The adapter's stages (gst-launch words), empty for ADAPTER=none.
adapter_stages=()
if [ "$ADAPTER" != none ]; then
  adapter_stages=(! moe-route model="$ADAPTER"
    ! moe-expert model="$ADAPTER" device="$EXPERT_DEVICE" precision="$EXPERT_PRECISION")
fi
