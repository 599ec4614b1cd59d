#!/usr/bin/env python3
"""Draws moe-bench-ann's results the way ann-benchmarks does: recall@k (x) against queries/s
(y, log scale), one line per library and index type through its search settings (ef, nprobe).

    tools/plot-ann.py OUT.svg RESULTS.json[=LABEL] [RESULTS.json[=LABEL] ...]

Each RESULTS.json is what `moe-bench-ann --json` wrote; several files (for example the IVF run
and the HNSW run of tools/bench-ann.sh) go on one plot, LABEL (when given) in front of the
legend entries of that file's lines, to tell data sets apart. Needs matplotlib (Debian:
python3-matplotlib).
"""
import json
import sys

try:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    # Text as text (not glyph outlines) keeps the file small; a fixed salt keeps its element ids,
    # and so the file, the same from one run to the next.
    matplotlib.rcParams["svg.fonttype"] = "none"
    matplotlib.rcParams["svg.hashsalt"] = "moe-bench-ann"
except ImportError:
    sys.exit("plot-ann.py: matplotlib is not installed (Debian: apt-get install python3-matplotlib)")

# One colour per data set and index type, one marker and line style per library, so that
# AnnIndex and FAISS called directly (which should coincide) stay distinguishable from each other
# and from hnswlib.
STYLES = {"AnnIndex": ("o", "-"), "FAISS": ("x", "--"), "hnswlib": ("s", ":")}


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    out, inputs = argv[1], argv[2:]
    lines = {}  # (label, index, parameters, library) -> [(recall, qps, setting)]
    meta = None
    for arg in inputs:
        path, _, label = arg.partition("=")
        with open(path) as f:
            report = json.load(f)
        meta = meta or report
        for r in report["results"]:
            key = (label, r["index"], r["parameters"], r["library"])
            lines.setdefault(key, []).append((r["recall"], r["queries_per_s"], r["setting"]))

    fig, ax = plt.subplots(figsize=(7.5, 5))
    palette = plt.get_cmap("tab10").colors
    colours = {}
    for (label, index, parameters, library), points in sorted(lines.items()):
        colour = colours.setdefault((label, index, parameters), palette[len(colours) % len(palette)])
        points.sort()
        marker, style = STYLES.get(library, (".", "-"))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, linestyle=style,
                color=colour, label=f"{label + ': ' if label else ''}{library} {parameters}", markersize=5,
                linewidth=1.2)
    # The target: recall >= 0.95 at >= 5x the flat index's queries/s (FAISS's, same run).
    flat = [r for (_, index, _, library), points in lines.items() if index == "flat" and library == "FAISS"
            for r in points]
    if flat:
        ax.axhline(5 * flat[0][1], color="grey", linewidth=0.8, linestyle="-.", label="5x flat (FAISS)")
        ax.axvline(0.95, color="grey", linewidth=0.8, linestyle="-.")
    ax.set_yscale("log")
    ax.set_xlabel(f"recall@{meta['k']}")
    ax.set_ylabel("queries/s (log)")
    ax.set_title(f"{meta['n']:,} x {meta['dim']}, {meta['threads']} thread(s), {meta['cpu']}", fontsize=9)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    # No creation date in the file, so that a rerun with the same figures changes nothing.
    fig.savefig(out, metadata={"Date": None})
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
