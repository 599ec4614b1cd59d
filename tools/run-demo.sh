#!/usr/bin/env bash
# The main job, from a fresh clone: installs packages (idempotent), builds, and runs the demo:
# encode text queries and an image with the default model, apply the MoE adapter, print the
# embeddings, the routing and the similarities. Extra arguments go to moe-encode-demo.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=release
fi
meson compile -C build -j "${MOE_BUILD_JOBS:-2}" >/dev/null
exec build/examples/moe-encode-demo "$@"
