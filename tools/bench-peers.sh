#!/usr/bin/env bash
# gst-moe's CLIP encoders against PyTorch (transformers) and ONNX Runtime on the CPU, on one
# synthetic ViT-B/32 checkpoint, interleaved; prints one table of items/s and ratios
# (docs/benchmarks.md, "CPU GEMM libraries and peers"). A benchmark, not a test: CI never runs it.
#
#   tools/bench-peers.sh                     batch 1 and 32, 1 and 2 threads, both towers, 3 rounds
#   tools/bench-peers.sh --quick             batch 1 and 8, 2 rounds (a smoke run)
#   tools/bench-peers.sh --build-dir DIR     build and work in DIR (default: build)
#   tools/bench-peers.sh --jobs N            meson compile -j N (default: meson's)
#   other options go to tools/bench_peers.py (--threads, --batches, --towers, --rounds,
#   --text-tokens, --min-sample-s, --precision fp32|bf16|fp16 (gst-moe's weights; the peers stay
#   fp32), --json FILE; see tools/bench_peers.py --help)
#
# What it does, idempotently (a second run only times):
#   1. installs the Debian packages the build needs (tools/install-deps.sh) and those of the
#      Python side: python3-torch (Debian's torch 1.13), python3-venv, python3-numpy;
#   2. builds moe-bench-peer-worker with meson in the build folder (configured with
#      -Dcuda=disabled if it does not exist yet);
#   3. makes a venv DIR/bench-peers/venv with --system-site-packages (Debian's torch and numpy are
#      used as they are, never pip-installed) and pip-installs transformers (the releases the
#      fixture set-up accepts) and onnxruntime into it, with torch and numpy pinned to Debian's;
#   4. runs tools/bench_peers.py, which writes the checkpoint and the ONNX export once into
#      DIR/bench-peers/ and times the three sides.
# OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the benchmark's environment: every
# side runs its libraries as they detect this machine themselves.
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
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac
WORK="$BUILD_DIR/bench-peers"
VENV="$WORK/venv"
PY=/usr/bin/python3   # Debian's interpreter, whose site-packages hold Debian's torch

log() { echo "[bench-peers] $*" >&2; }

# 1. Debian packages
"$ROOT/tools/install-deps.sh" >&2
APT_PKGS=(python3-torch python3-venv python3-numpy)
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

# 2. the engine's worker
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  meson setup "$BUILD_DIR" "$ROOT" -Dcuda=disabled --buildtype=release >&2
fi
meson compile -C "$BUILD_DIR" "${JOBS[@]}" moe-bench-peer-worker >&2
WORKER="$BUILD_DIR/bench/moe-bench-peer-worker"

# 3. the Python side
TRANSFORMERS_CANDIDATES=(4.44.2 4.43.4 4.42.4 4.41.2 4.40.2)   # as tools/setup-fixture-env.sh
ORT_CANDIDATES=(1.32.0 1.31.1 1.22.1 "")                       # "" = the newest that installs
py_ok() {
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
import numpy, torch, transformers, onnxruntime
from transformers import CLIPModel
assert "CPUExecutionProvider" in onnxruntime.get_available_providers()
EOF
}
mkdir -p "$WORK"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv --system-site-packages "$VENV"
fi
if py_ok; then
  log "venv ready: $VENV"
else
  CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$CONSTRAINTS"' EXIT
  "$VENV/bin/python" -c 'import torch, numpy
print("torch==" + torch.__version__.split("+")[0]); print("numpy==" + numpy.__version__)' > "$CONSTRAINTS"
  ok=0
  for tv in "${TRANSFORMERS_CANDIDATES[@]}"; do
    for ov in "${ORT_CANDIDATES[@]}"; do
      ort="onnxruntime${ov:+==$ov}"
      log "trying transformers==$tv $ort"
      if "$VENV/bin/python" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" \
            "transformers==$tv" "$ort" >&2 && py_ok; then
        ok=1
        break 2
      fi
    done
  done
  [ "$ok" -eq 1 ] || { log "no working transformers + onnxruntime found for Debian's torch"; exit 1; }
fi

# 4. the benchmark
for v in OPENBLAS_CORETYPE OPENBLAS_L2_SIZE; do
  [ -n "${!v:-}" ] && log "note: $v=${!v} is set here; the benchmark runs without it"
done
exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$VENV/bin/python" "$ROOT/tools/bench_peers.py" \
  --engine-worker "$WORKER" --work "$WORK" ${PASS[@]+"${PASS[@]}"}
