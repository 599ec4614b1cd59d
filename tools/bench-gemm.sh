#!/usr/bin/env bash
# The CPU GEMM libraries Debian 12 ships, measured on this machine: sgemm GFLOP/s of OpenBLAS (as
# shipped, and with each core type forced), BLIS and oneDNN at the CLIP encoders' shapes, 1 and 2
# threads, interleaved rounds, each result checked against a double-precision reference
# (docs/benchmarks.md, "CPU GEMM libraries and peers"). A benchmark, not a test.
#
#   tools/bench-gemm.sh                    every library, 8 shapes, 1 and 2 threads, 5 rounds (~4-6 min)
#   tools/bench-gemm.sh --quick            3 shapes, 3 rounds
#   tools/bench-gemm.sh --build-dir DIR    build in DIR (default: build)
#   tools/bench-gemm.sh --jobs N           meson compile -j N
#   other options go to moe-bench-gemm (--variants, --threads, --rounds, --shapes, --json FILE;
#   see moe-bench-gemm --help)
#
# Installs, when missing, libopenblas0-pthread, libblis4-pthread and libdnnl-dev (its header lets
# the program use oneDNN's C API). BLIS registers itself as a libblas.so.3 alternative with a
# lower priority than OpenBLAS, so what numpy, torch and FAISS load does not change.
# OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the benchmark's environment; the
# program sets OPENBLAS_CORETYPE itself for the openblas:CORE rows only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR=build
JOBS=()
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#*=}"; shift ;;
    --jobs) JOBS=(-j "$2"); shift 2 ;;
    --jobs=*) JOBS=(-j "${1#*=}"); shift ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac

log() { echo "[bench-gemm] $*" >&2; }

"$ROOT/tools/install-deps.sh" >&2
APT_PKGS=(libopenblas0-pthread libblis4-pthread libdnnl-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  log "installing ${missing[*]}"
  if ! "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=300 \
        --no-install-recommends "${missing[@]}"; then
    "${sudo_cmd[@]}" apt-get update -q -o DPkg::Lock::Timeout=300
    "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=300 \
      --no-install-recommends "${missing[@]}"
  fi
fi

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  meson setup "$BUILD_DIR" "$ROOT" -Dcuda=disabled --buildtype=release >&2
elif ! grep -q 'MOE_BENCH_HAVE_DNNL=1' "$BUILD_DIR/build.ninja"; then
  log "reconfiguring $BUILD_DIR (oneDNN's header was not there when it was configured)"
  meson setup --reconfigure "$BUILD_DIR" "$ROOT" >&2
fi
meson compile -C "$BUILD_DIR" "${JOBS[@]}" moe-bench-gemm >&2

exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$BUILD_DIR/bench/moe-bench-gemm" ${PASS[@]+"${PASS[@]}"}
