#!/usr/bin/env bash
# Builds the GPU check's binaries on a machine WITHOUT a GPU (but with nvcc and the build
# dependencies) and packs them, with the shared libraries they need, into
# .gpu-bundle/gpu-bundle.tar.gz, for tools/gpu-check.sh's prebuilt mode on a GPU machine that
# lacks the build dependencies (GStreamer, FAISS, OpenBLAS, ... : the device image may have only
# CUDA). Carry `.gpu-bundle` in the device call (it is git-ignored).
#
# Left out of the bundle, taken from the GPU machine: the C library and the dynamic loader,
# libstdc++/libgcc_s (a newer system's are compatible), the driver (libcuda) and the CUDA
# libraries (cudart, cuBLAS, NCCL: the CUDA toolkit's, or the Python wheels'). So the GPU
# machine needs the same CUDA major version (13) and a C library at least as new as this one's.
#
# Environment: GPU_BUNDLE_BUILD_DIR (default build-gpu-bundle), GPU_BUNDLE_ARCH (default 90:
# H100/H200), MOE_BUILD_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
build=${GPU_BUNDLE_BUILD_DIR:-$root/build-gpu-bundle}
arch=${GPU_BUNDLE_ARCH:-90}
jobs=${MOE_BUILD_JOBS:-$(nproc)}
# The engine's suites with GPU tests (the gst_* ones need GStreamer on the GPU machine).
. tools/gpu-suites.sh
suites=()
for s in $(discover_gpu_suites); do
  case $s in gst_*) ;; *) suites+=("$s") ;; esac
done
benches=(moe-bench-layer moe-bench-encoder moe-bench-preload moe-bench-search moe-bench-memory)

if [ -f "$build/build.ninja" ]; then
  meson configure "$build" -Dcuda=enabled -Dgpu_targets="$arch" -Dbuildtype=release
else
  meson setup "$build" -Dcuda=enabled -Dgpu_targets="$arch" --buildtype=release
fi
grep -q "MOE_HAVE_CUDA 1" "$build/moe_build_config.h" || { echo "gpu-check-bundle: configured without CUDA" >&2; exit 1; }
targets=()
for s in "${suites[@]}"; do targets+=("tests/test_$s"); done
for b in "${benches[@]}"; do targets+=("bench/$b"); done
meson compile -C "$build" -j "$jobs" "${targets[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tests" "$stage/bench" "$stage/core" "$stage/lib"
for s in "${suites[@]}"; do cp "$build/tests/test_$s" "$stage/tests/"; done
for b in "${benches[@]}"; do cp "$build/bench/$b" "$stage/bench/"; done
# The binaries find the engine through RUNPATH $ORIGIN/../core: keep that layout.
find "$build/core" -maxdepth 1 -name 'libmoe-engine.so*' ! -type d -exec cp -P {} "$stage/core/" \;

# Every other shared library they load, except those the GPU machine provides.
skip='^(libmoe-engine|linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|libutil\.so|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libnccl|libnvidia)'
for f in "$stage"/tests/* "$stage"/bench/* "$stage"/core/libmoe-engine.so.*.*; do
  ldd "$f" | awk '/=>/ && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  if [[ "$soname" =~ $skip ]]; then continue; fi
  [ -e "$stage/lib/$soname" ] || cp -L "$path" "$stage/lib/$soname"
done

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | head -1)
{
  echo "source_dir=$(grep MOE_SOURCE_DIR "$build/moe_build_config.h" | sed -E 's/.*"(.*)".*/\1/')"
  echo "commit=$commit${dirty:+ (with uncommitted changes)}"
  echo "built=$(date -u '+%Y-%m-%d %H:%M UTC') on $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
  echo "cuda=$(nvcc --version | tail -1)"
  echo "gpu_targets=$arch"
  echo "nccl=$(grep -q 'MOE_HAVE_NCCL 1' "$build/moe_build_config.h" && echo yes || echo no)"
  echo "suites=${suites[*]}"
} >"$stage/MANIFEST"

mkdir -p "$root/.gpu-bundle"
tar -czf "$root/.gpu-bundle/gpu-bundle.tar.gz" -C "$stage" .
cat "$stage/MANIFEST"
echo "libraries: $(ls "$stage/lib" | tr '\n' ' ')"
echo "wrote .gpu-bundle/gpu-bundle.tar.gz ($(du -h "$root/.gpu-bundle/gpu-bundle.tar.gz" | cut -f1))"
