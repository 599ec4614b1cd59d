#!/usr/bin/env bash
# Set up the Python environment that regenerates the INT4 fixtures in tests/fixtures/int4/ with
# compressed-tensors (tools/make_int4_fixtures.py). CI does NOT need it: the fixtures are committed.
#
#   tools/setup-int4-fixture-env.sh && .venv-int4/bin/python tools/make_int4_fixtures.py
#
# compressed-tensors imports float8 dtypes and torch.compile in every release, so it needs
# torch >= 2.1: Debian's python3-torch (1.13) cannot run it, and this venv takes torch from PyPI
# (about 3 GB with its CUDA libraries; the fixtures are computed on the CPU). Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-int4"
PY=/usr/bin/python3
# Pinned: the versions that made the committed fixtures (their __metadata__ records them).
PIP_PKGS=(torch==2.4.1 compressed-tensors==0.10.2 transformers==4.44.2 safetensors==0.8.0 numpy==1.26.4 pillow==9.4.0)

log() { echo "[setup-int4-fixture-env] $*"; }

if ! "$PY" -m venv --help >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=120 python3-venv
fi
if [ ! -x "${VENV}/bin/python" ]; then
    log "creating venv ${VENV}"
    "$PY" -m venv "$VENV"
fi
if ! "${VENV}/bin/python" -c 'import torch, compressed_tensors, transformers, safetensors, PIL' 2>/dev/null; then
    log "installing ${PIP_PKGS[*]}"
    "${VENV}/bin/python" -m pip install --disable-pip-version-check -q "${PIP_PKGS[@]}"
fi
"${VENV}/bin/python" -c 'import torch, compressed_tensors, transformers; print("torch", torch.__version__, "compressed-tensors", compressed_tensors.__version__, "transformers", transformers.__version__)'
