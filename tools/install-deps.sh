#!/usr/bin/env bash
# Installs the Debian 12 packages gst-moe needs to build, test and run. Idempotent: when every
# package is already installed it does nothing (no apt-get update, no network).
set -euo pipefail

packages=(
  # build
  meson ninja-build pkg-config g++ python3
  # engine
  libglib2.0-dev libjson-glib-dev libopenblas-dev libdnnl-dev libfaiss-dev liblapack-dev libgdk-pixbuf-2.0-dev
  # the image decoder's WebP loader (gdk-pixbuf itself has none)
  webp-pixbuf-loader
  # GStreamer plugin and ZeroMQ
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev gstreamer1.0-tools gstreamer1.0-plugins-base
  gstreamer1.0-plugins-good libzmq3-dev cppzmq-dev
  # textoverlay, which writes moe-caption's text on video (pipelines/caption-video.sh)
  gstreamer1.0-x
  # GstMoe-1.0.gir/.typelib: GstMoeResultMeta for Python (g-ir-scanner, g-ir-compiler)
  gobject-introspection libgirepository1.0-dev
  # the elements' Prometheus metrics (the client library: registry and text format)
  prometheus-cpp-dev
  # tests and examples
  libgtest-dev python3-zmq python3-yaml python3-gi gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0
  # fuzzing (tools/run-fuzz.sh): clang 14 with its sanitizer and libFuzzer runtimes (the clang
  # package gives the clang/clang++ names; FuzzedDataProvider.h comes with libclang-common-14-dev)
  clang clang-14 libclang-rt-14-dev libomp-dev
  # the format check (tools/check-format.sh)
  clang-format-14
  # the AddressSanitizer + UndefinedBehaviorSanitizer build (gcc's runtimes)
  libasan8 libubsan1
  # moe-bench-ann's hnswlib rows (header-only; the benchmark builds without it). Its plot
  # (tools/plot-ann.py) needs python3-matplotlib, which the tests do not: not installed here.
  libhnswlib-dev
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The CUDA toolkit is optional: the CPU build always works. Report what the build will find.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: CUDA toolkit found ($(PATH=/usr/local/cuda/bin:$PATH nvcc --version | tail -1))"
else
  echo "install-deps: no CUDA toolkit (nvcc) found: only the CPU backend will be built"
fi
