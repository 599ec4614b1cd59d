# Sourced by the pipeline scripts: finds the freshly built plugin and the default model.
# Override any variable from the environment.
repo=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
if [ -z "${GST_PLUGIN_PATH_1_0:-}" ] && [ -d "$repo/build/gst-plugins" ]; then
  export GST_PLUGIN_PATH_1_0="$repo/build/gst-plugins"
fi
MODEL=${MODEL:-$repo/models/default/clip}
ADAPTER=${ADAPTER:-$repo/models/default/adapter}
INDEX=${INDEX:-$repo/build/catalog.faiss}
