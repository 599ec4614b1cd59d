#!/usr/bin/env bash
# Set up the Python environment used to (re)generate the reference fixtures
# under tests/fixtures/ and the CLIP tokenizer files under models/clip-tokenizer/.
#
# CI does NOT need this: the generated fixtures are committed. Run it only when
# you want to regenerate them:
#
#   tools/setup-fixture-env.sh && .venv-fixtures/bin/python tools/make_fixtures.py
#   .venv-fixtures/bin/python tools/make_format_fixtures.py   # config, image-format and entity fixtures
#   .venv-fixtures/bin/python tools/gen_html_entities.py      # core/src/text/html5_entities.inc from ftfy
#
# What it does (idempotent, safe to re-run):
#   1. apt-get installs Debian's python3-torch (1.13), python3-venv, python3-pil,
#      python3-numpy (waits and retries while dpkg is locked by another apt run).
#   2. creates the venv .venv-fixtures (repo root) with --system-site-packages on
#      /usr/bin/python3, so Debian's torch is visible inside it. torch is never
#      pip-installed.
#   3. pip installs a transformers 4.4x release that accepts torch 1.13, plus
#      ftfy and safetensors.
#   4. prints the versions in use.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-fixtures"
PY=/usr/bin/python3   # Debian's interpreter (not pyenv's python3 on PATH)

APT_PKGS=(python3-torch python3-venv python3-pil python3-numpy)
# Tried in order; the first one that installs and imports with torch 1.13 wins.
TRANSFORMERS_CANDIDATES=(4.44.2 4.43.4 4.42.4 4.41.2 4.40.2)
# Pinned: ftfy changes text normalisation between releases (tokenizer fixtures).
PIP_EXTRA=(ftfy==6.3.1 safetensors==0.8.0)

log() { echo "[setup-fixture-env] $*"; }

have_apt_pkgs() {
    local p
    for p in "${APT_PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}

apt_install() {
    if have_apt_pkgs; then
        log "apt packages already installed: ${APT_PKGS[*]}"
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    local attempt
    for attempt in $(seq 1 60); do
        # DPkg::Lock::Timeout makes apt itself wait for a lock held by another run.
        if $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=120 \
                "${APT_PKGS[@]}"; then
            return 0
        fi
        # First failure may be a stale package list.
        if [ "$attempt" -eq 1 ]; then
            $sudo apt-get update -o DPkg::Lock::Timeout=120 || true
        fi
        log "apt-get install failed (dpkg locked?), retrying in 10 s (attempt ${attempt}/60)"
        sleep 10
    done
    log "giving up on apt-get install"
    return 1
}

transformers_ok() {
    "${VENV}/bin/python" - <<'EOF' 2>/dev/null
import torch, transformers
from transformers import CLIPModel, MixtralForCausalLM, Qwen2MoeForCausalLM, CLIPTokenizer
import ftfy, safetensors
assert torch.__version__.startswith("1.13"), torch.__version__
EOF
}

apt_install

if [ ! -x "${VENV}/bin/python" ]; then
    log "creating venv ${VENV}"
    "$PY" -m venv --system-site-packages "$VENV"
fi

if transformers_ok; then
    log "venv already has a working transformers"
else
    # Make pip never replace Debian's torch: pin it to the installed version.
    TORCH_VER="$("${VENV}/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
    CONSTRAINTS="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==${TORCH_VER}" > "$CONSTRAINTS"
    ok=0
    for v in "${TRANSFORMERS_CANDIDATES[@]}"; do
        log "trying transformers==${v}"
        if "${VENV}/bin/python" -m pip install --disable-pip-version-check -q \
                -c "$CONSTRAINTS" "transformers==${v}" "${PIP_EXTRA[@]}" \
           && transformers_ok; then
            ok=1
            break
        fi
        log "transformers==${v} does not work with torch ${TORCH_VER}"
    done
    if [ "$ok" -ne 1 ]; then
        log "no compatible transformers release found"
        exit 1
    fi
fi

"${VENV}/bin/python" - <<'EOF'
import sys, numpy, PIL, torch, transformers, tokenizers, ftfy, safetensors
print("python       ", sys.version.split()[0], sys.executable)
print("torch        ", torch.__version__, torch.__file__)
print("transformers ", transformers.__version__)
print("tokenizers   ", tokenizers.__version__)
print("safetensors  ", safetensors.__version__)
print("ftfy         ", ftfy.__version__)
print("numpy        ", numpy.__version__)
print("PIL          ", PIL.__version__)
EOF
