# Sourced by the pipeline scripts: finds the freshly built plugin and the default model.
# Override any variable from the environment.
repo=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
if [ -z "${GST_PLUGIN_PATH_1_0:-}" ] && [ -d "$repo/build/gst-plugins" ]; then
  export GST_PLUGIN_PATH_1_0="$repo/build/gst-plugins"
fi
MODEL=${MODEL:-$repo/models/default/clip}
ADAPTER=${ADAPTER:-$repo/models/default/adapter}
INDEX=${INDEX:-$repo/build/catalog.faiss}
# Where the models compute. DEVICE (moe-encode, ann-query): cpu | cuda:N | auto (cuda:0 when a
# usable GPU exists, else cpu). EXPERT_DEVICE (moe-expert): cpu | cuda:N | cuda:0,cuda:1,... |
# all | auto (every GPU, else cpu), by default DEVICE. PRECISION of the encoder's and experts'
# weights: fp32 | fp16 | bf16. The defaults compute on the CPU in fp32, as the tests do.
# ADAPTER=$repo/models/default/adapter-int4 (4-bit experts) runs with those defaults: the CPU
# reads its packed weights; moe-expert refuses it on CUDA devices or in fp16/bf16.
# ann-query searches a flat index on DEVICE; an HNSW index is searched by FAISS on the CPU, so
# with an HNSW index use DEVICE=auto (falls back) rather than cuda:N (refused at start).
DEVICE=${DEVICE:-cpu}
EXPERT_DEVICE=${EXPERT_DEVICE:-$DEVICE}
PRECISION=${PRECISION:-fp32}
