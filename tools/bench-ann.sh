#!/usr/bin/env bash
# The ANN benchmark of docs/benchmarks.md ("ANN at 1M vectors"), in the manner of ann-benchmarks:
# recall@10 against queries/s for Flat, HNSW (several ef) and IVF-Flat / IVF-PQ (several nprobe),
# through moe::AnnIndex (ann-query's engine), FAISS called directly on the same index file and
# hnswlib at the same M / efConstruction / ef, every library on one thread; then the plot.
#
#   tools/bench-ann.sh                    1,000,000 synthetic 512-d vectors (about 30 min of one core)
#   tools/bench-ann.sh --n N              N synthetic vectors instead (--n 20000: a minute)
#   tools/bench-ann.sh --build-dir DIR    build in DIR (default: build)
#   tools/bench-ann.sh --jobs N           meson compile -j N (default 1)
#
# Four runs of moe-bench-ann, each writing a markdown table and JSON to BUILD_DIR/bench-ann/:
#   ivf     Flat, IVF4096,Flat and IVF4096,PQ64 (at 1M; trained on 32 vectors per list), nprobe 1 to 64;
#           the flat index's queries/s, the baseline of the IVF rows, comes from the same run
#   easy    the same vectors' layout with noise 1 (a query's 10 neighbours share its cluster):
#           Flat and IVF1024,Flat (32 training vectors per list), nprobe 1 to 16
#   hnsw    HNSW8 built with efConstruction 32 by FAISS (through AnnIndex) and by hnswlib, ef 16
#           to 256 (small settings: FAISS's one-thread HNSW16 / efConstruction 40 build had not
#           finished 100,000 vectors in 50 s of CPU, so 1M would take well over 10 minutes)
#   demo    the same index types on the demo catalog's real embeddings: the index that
#           pipelines/build-index.sh builds from models/default/catalog (vectors read back from
#           the FAISS file; its last fifth are the queries)
# then tools/plot-ann.py draws ivf + hnsw to docs/ann-recall-qps.svg (matplotlib; with another
# --n, to BUILD_DIR/bench-ann/ann-recall-qps.svg). hnswlib is in the benchmark when its header
# (Debian: libhnswlib-dev, tools/install-deps.sh) was found at build time; otherwise the tables
# say "hnswlib: not built". One thread for every library, so searches and builds are timed on CPU
# time, which busy neighbours inflate less than the wall clock; the load average is still
# printed before and after.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR=build
JOBS=(-j 1)
N=1000000
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#*=}"; shift ;;
    --jobs) JOBS=(-j "$2"); shift 2 ;;
    --jobs=*) JOBS=(-j "${1#*=}"); shift ;;
    --n) N="$2"; shift 2 ;;
    --n=*) N="${1#*=}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench-ann.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac

log() { echo "[bench-ann] $*" >&2; }
load_average() { echo "load average $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc --all) cores"; }

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  meson setup "$BUILD_DIR" "$ROOT" -Dcuda=disabled --buildtype=release >&2
fi
meson compile -C "$BUILD_DIR" "${JOBS[@]}" gstmoe moe-bench-ann >&2

out="$BUILD_DIR/bench-ann"
mkdir -p "$out"
bench="$BUILD_DIR/bench/moe-bench-ann"
log "$(load_average)"

# The IVF lists: moe-bench-ann's default, the power of two nearest 4 sqrt(n) (4096 at 1M; FAISS
# advises 4 sqrt(n) to 16 sqrt(n)), trained on 32 vectors per list (FAISS advises 30 to 256).
log "ivf: $N vectors"
"$bench" --n "$N" --threads 1 --types flat,ivf-flat,ivf-pq --train-per-list 32 --pq PQ64 \
  --nprobe 1,2,4,8,16,32,64 --json "$out/ivf.json" >"$out/ivf.md"
log "easy: $N vectors"
"$bench" --n "$N" --threads 1 --noise 1 --types flat,ivf-flat --nlist 1024 --train-per-list 32 \
  --nprobe 1,2,4,8,16 --json "$out/easy.json" >"$out/easy.md"
log "hnsw: $N vectors"
"$bench" --n "$N" --threads 1 --types hnsw --hnsw-m 8 --ef-construction 32 --ef 16,32,64,128,256 \
  --json "$out/hnsw.json" >"$out/hnsw.md"

# The demo catalog's real embeddings: the shipped model and adapter over models/default/catalog.
log "demo: building the demo catalog's index"
GST_PLUGIN_PATH_1_0="$BUILD_DIR/gst-plugins" GST_REGISTRY_1_0="$out/gst-registry.bin" \
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
  "$ROOT/pipelines/build-index.sh" "$ROOT/models/default/catalog" "$out/demo-catalog.faiss" >"$out/build-index.log"
"$bench" --base "$out/demo-catalog.faiss" --threads 1 --nlist 16 --train-per-list 15 --pq PQ16x4 \
  --nprobe 1,2,4,8,16 --reps 5 --json "$out/demo.json" >"$out/demo.md"
log "$(load_average)"

# Debian's python3-matplotlib is for /usr/bin/python3, which may not be the first python3 on PATH.
python=python3
python3 -c 'import matplotlib' 2>/dev/null || [ ! -x /usr/bin/python3 ] || python=/usr/bin/python3
# Only the full-size run replaces the plot docs/benchmarks.md shows. (The runs are at noise 1.75,
# moe-bench-ann's default, unless the label says otherwise.)
plot="$out/ann-recall-qps.svg"
[ "$N" != 1000000 ] || plot="$ROOT/docs/ann-recall-qps.svg"
"$python" "$ROOT/tools/plot-ann.py" "$plot" "$out/ivf.json=noise 1.75" "$out/hnsw.json=noise 1.75" \
  "$out/easy.json=noise 1"
cat "$out/ivf.md" "$out/easy.md" "$out/hnsw.md" "$out/demo.md"
