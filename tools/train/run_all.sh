#!/usr/bin/env bash
# Reproduce models/default/ and the Python-side adaptation comparison (docs/adaptation.md).
# Developers only; needs the fixture venv (tools/setup-fixture-env.sh). About 30 minutes of one
# CPU core in all; every step runs niced and single-threaded.
#
#   tools/train/run_all.sh            # everything under build-train/, then models/default/
#
# Steps (each can be re-run alone, see docs/adaptation.md):
#   1. tools/catalog/generate_catalog.py   procedural catalog   -> build-train/catalog/
#   2. tools/train/train_base.py           tiny CLIP, studio    -> build-train/base-studio/
#      tools/train/train_base.py --init    + photographic base  -> build-train/base/clip/
#   3. tools/train/adapt.py --method full  full fine-tuning     -> build-train/full/clip/
#      tools/train/adapt.py --method lora  LoRA, merged         -> build-train/lora/clip/
#      tools/train/adapt.py --method moe   MoE adapter          -> build-train/moe/adapter/
#   4. tools/train/evaluate.py             recall table         -> build-train/results.json
#   5. tools/train/train_gate.py           cross-modal gate     -> build-train/gate/adapter/
#                                          + fusion table       -> build-train/gate/results.json
#   6. tools/train/export_default.py       install + checks     -> models/default/
set -euo pipefail
cd "$(dirname "$0")/../.."

PY="${PY:-.venv-fixtures/bin/python}"
RUNS="${RUNS:-build-train}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
run() { echo "+ $*" >&2; nice -n 10 "$PY" "$@"; }

run tools/catalog/generate_catalog.py --out "$RUNS/catalog" --seed 2024
run tools/train/train_base.py --catalog "$RUNS/catalog" --out "$RUNS/base-studio"
run tools/train/train_base.py --catalog "$RUNS/catalog" --out "$RUNS/base" \
  --splits base-train,base-wild --init "$RUNS/base-studio/fp32.safetensors" \
  --steps 600 --warmup 50 --lr 5e-4
for method in full lora moe; do
  run tools/train/adapt.py --method "$method" --catalog "$RUNS/catalog" --runs "$RUNS"
done
run tools/train/evaluate.py --catalog "$RUNS/catalog" --runs "$RUNS"
run tools/train/train_gate.py --catalog "$RUNS/catalog" --runs "$RUNS"
run tools/train/export_default.py --catalog "$RUNS/catalog" --runs "$RUNS"
