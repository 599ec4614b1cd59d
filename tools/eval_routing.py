#!/usr/bin/python3
"""Routing policies measured through the real pipelines (docs/routing.md).

Runs moe-eval-recall (tools/eval_recall.cpp) on the shipped model under each routing policy of
moe-route, on two query streams:
  held-out  the model's held-out queries (models/default/queries.jsonl), once each;
  skewed    a longer stream in which SKEW of the queries come from two categories (the rest
            from all others), drawn with a fixed seed: the traffic that overloads some experts.
and writes one table (Markdown, to stdout and OUT/routing.md), the raw results (OUT/routing.json)
and plots (OUT/load-cv.png, OUT/expert-load.png).

    tools/eval-routing.sh [--build-dir build] [--out build/eval-routing] [--stream 1200] [--skew 0.8]
"""
import argparse
import collections
import json
import os
import random
import subprocess
import sys

# (label, moe-route properties). The index is always built with the adapter's own routing.
POLICIES = [
    ("top-2 (adapter)", ""),
    ("temperature 0.5", "temperature=0.5"),
    ("temperature 2", "temperature=2"),
    ("bias, rate 0.002", "balance=bias balance-rate=0.002"),
    ("bias, rate 0.01", "balance=bias balance-rate=0.01"),
    ("bias, rate 0.02", "balance=bias balance-rate=0.02"),
    ("bias, rate 0.03", "balance=bias balance-rate=0.03"),
    ("bias, rate 0.05", "balance=bias balance-rate=0.05"),
    ("bias 0.02, no margin", "balance=bias balance-rate=0.02 balance-margin=1"),
    ("bias 0.05, no margin", "balance=bias balance-rate=0.05 balance-margin=1"),
    ("explore 0.05", "explore=0.05 seed=1"),
    ("explore 0.2", "explore=0.2 seed=1"),
    ("top-p 0.5", "routing=top-p top-p=0.5 min-k=1 max-k=4"),
    ("top-p 0.6", "routing=top-p top-p=0.6 min-k=1 max-k=4"),
    ("top-p 0.7", "routing=top-p top-p=0.7 min-k=1 max-k=4"),
    ("top-p 0.8", "routing=top-p top-p=0.8 min-k=1 max-k=4"),
    ("capacity 1.25, reroute", "capacity-factor=1.25 overflow=reroute"),
    ("capacity 1.25, drop", "capacity-factor=1.25 overflow=drop"),
    ("capacity 1.25 + bias 0.05", "capacity-factor=1.25 balance=bias balance-rate=0.05"),
]


def skewed_stream(queries, n, skew, seed):
    """n queries: a share `skew` drawn from the two most common categories, the rest from the others."""
    by_category = collections.defaultdict(list)
    for q in queries:
        by_category[q.get("attributes", {}).get("category", "")].append(q)
    hot = sorted(by_category, key=lambda c: (-len(by_category[c]), c))[:2]
    hot_queries = [q for c in hot for q in by_category[c]]
    cold_queries = [q for c in by_category if c not in hot for q in by_category[c]]
    rng = random.Random(seed)
    stream = [rng.choice(hot_queries) if rng.random() < skew else rng.choice(cold_queries) for _ in range(n)]
    return hot, stream


def run(tool, model, args, queries_file, props):
    cmd = [tool, "--model", os.path.join(model, "clip"), "--adapter", os.path.join(model, "adapter"), "--catalog",
           os.path.join(model, "catalog"), "--queries", queries_file, "--route-props", props, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def plots(results, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in POLICIES]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    xs = range(len(labels))
    for i, stream in enumerate(["held-out", "skewed"]):
        ax.bar([x + (i - 0.5) * width for x in xs], [results[stream][l]["load_cv"] for l in labels], width,
               label=stream)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("expert load: coefficient of variation")
    ax.set_title("Expert load balance by routing policy (lower is more even)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "load-cv.png"), dpi=100)

    fig, ax = plt.subplots(figsize=(9, 4))
    chosen = [l for l in labels if l in ("top-2 (adapter)", "bias, rate 0.01", "bias, rate 0.05", "explore 0.2")]
    experts = len(results["skewed"][labels[0]]["expert_load"])
    width = 0.8 / len(chosen)
    for i, l in enumerate(chosen):
        load = results["skewed"][l]["expert_load"]
        total = sum(load) or 1
        ax.bar([e + (i - (len(chosen) - 1) / 2) * width for e in range(experts)], [v / total for v in load], width,
               label=l)
    ax.axhline(1.0 / experts, color="grey", linestyle="--", linewidth=1, label="even load")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of routed slots")
    ax.set_title("Skewed stream: each expert's share of the load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "expert-load.png"), dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default="build")
    parser.add_argument("--model", default="models/default")
    parser.add_argument("--out", default=None)
    parser.add_argument("--stream", type=int, default=1200, help="queries in the skewed stream")
    parser.add_argument("--skew", type=float, default=0.8, help="share of the skewed stream from two categories")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    out_dir = args.out or os.path.join(args.build_dir, "eval-routing")
    os.makedirs(out_dir, exist_ok=True)
    tool = os.path.join(args.build_dir, "tools", "moe-eval-recall")

    with open(os.path.join(args.model, "queries.jsonl")) as f:
        queries = [json.loads(line) for line in f if line.strip()]
    hot, stream = skewed_stream(queries, args.stream, args.skew, args.seed)
    skewed_file = os.path.join(out_dir, "skewed-queries.jsonl")
    with open(skewed_file, "w") as f:
        for q in stream:
            f.write(json.dumps(q) + "\n")

    streams = {"held-out": os.path.join(args.model, "queries.jsonl"), "skewed": skewed_file}
    results = {s: {} for s in streams}
    for label, props in POLICIES:
        for s, path in streams.items():
            results[s][label] = run(tool, args.model, args, path, props)
            print(f"  {s:9} {label:18} {json.dumps(results[s][label])}", file=sys.stderr)

    base = results["skewed"][POLICIES[0][0]]
    lines = [
        f"Held-out: {len(queries)} queries; skewed: {len(stream)} queries, {args.skew:.0%} from "
        f"'{hot[0]}' and '{hot[1]}' (seed {args.seed}). R@10 and mAP on each stream's own queries; load-cv = "
        "standard deviation / mean of the experts' routed slots; MoE = route + expert stage per request.",
        "",
        "| policy (moe-route) | held-out R@10 | held-out mAP | skewed R@10 | skewed mAP | experts/row held-out | "
        "load-cv held-out | load-cv skewed | × skewed load-cv vs top-2 | MoE p50 / p99 (ms, skewed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, props in POLICIES:
        h, k = results["held-out"][label], results["skewed"][label]
        ratio = base["load_cv"] / k["load_cv"] if k["load_cv"] else float("inf")
        lines.append(
            f"| {label} (`{props or 'defaults'}`) | {h['R@10']:.3f} | {h['mAP']:.3f} | {k['R@10']:.3f} | "
            f"{k['mAP']:.3f} | {h['experts_per_row']:.2f} | {h['load_cv']:.3f} | {k['load_cv']:.3f} | "
            f"{ratio:.2f} | {k['moe_ms_p50']:.3f} / {k['moe_ms_p99']:.3f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(out_dir, "routing.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "routing.json"), "w") as f:
        json.dump(results, f, indent=1)
    plots(results, out_dir)
    print(f"\n{out_dir}/routing.md, routing.json, load-cv.png, expert-load.png", file=sys.stderr)


if __name__ == "__main__":
    main()
