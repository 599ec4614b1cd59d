#!/usr/bin/env bash
# Routing policies measured through the real pipelines on the shipped model (docs/routing.md):
# installs what it needs (the build's packages, python3-matplotlib for the plots), builds
# moe-eval-recall and the plugin, then runs tools/eval_routing.py. A few minutes on 2 cores.
#
#   tools/eval-routing.sh [--build-dir DIR] [--out DIR] [--stream N] [--skew S] [--seed N]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
tools/install-deps.sh
if ! /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=300 \
    python3-matplotlib
fi
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release
ninja -C "$build" tools/moe-eval-recall gst-plugins/libgstmoe.so
# The freshly built plugin, in a registry of its own; one thread each (the figures compare policies).
export GST_PLUGIN_PATH_1_0="$PWD/$build/gst-plugins" GST_REGISTRY_1_0="$PWD/$build/eval-routing-registry.bin"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
exec /usr/bin/python3 tools/eval_routing.py --build-dir "$build" "${args[@]}"
