#!/usr/bin/env python3
"""Python-side retrieval evaluation of the base model and the three adaptation methods.

    tools/train/evaluate.py --catalog build-train/catalog --runs build-train

Everything is loaded from the saved engine-format directories (fp16 weights widened to fp32,
CLIPTokenizer padding to 77, CLIPImageProcessor from each directory's preprocessor_config.json,
PNG files from disk), so the numbers are what the engine should reproduce.

Text queries rank the shifted-test images by the inner product of L2-normalised embeddings
(with the MoE adapter: the adapter output, already normalised, for both modalities).

* R@k   share of queries with at least one relevant item in the top k (CLIP's usual
        retrieval recall, generalised to several relevant items)
* mAP   mean average precision over the whole ranking
* chance  R@k of a random ranking, from each query's number of relevant items

Writes RUNS/results.json and prints a markdown table.
"""

import argparse
import json
import os
from math import comb

import common  # first: pins the math libraries to one thread
from common import F, np, torch

METHODS = [  # (key, label, clip dir, adapter dir) relative to --runs
    ("zero-shot", "base model, zero-shot", "base/clip", None),
    ("full", "full fine-tuning", "full/clip", None),
    ("lora", "LoRA (merged)", "lora/clip", None),
    ("moe", "MoE adapter (frozen CLIP)", "base/clip", "moe/adapter"),
]


def max_rel_err(a, b):
    """max over rows of ||a - b|| / ||b||."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def retrieval(text_emb, image_emb, queries, item_ids, ks=(1, 5, 10)):
    t = F.normalize(text_emb.float(), dim=-1)
    im = F.normalize(image_emb.float(), dim=-1)
    order = torch.argsort(t @ im.t(), dim=1, descending=True).numpy()
    pos = {i: n for n, i in enumerate(item_ids)}
    n = len(item_ids)
    hits = {k: [] for k in ks}
    chance = {k: [] for k in ks}
    aps = []
    for qi, q in enumerate(queries):
        rel = np.zeros(n, bool)
        rel[[pos[r] for r in q["relevant"]]] = True
        ranked = rel[order[qi]]
        for k in ks:
            hits[k].append(bool(ranked[:k].any()))
            chance[k].append(1 - comb(n - rel.sum(), k) / comb(n, k))
        where = np.flatnonzero(ranked)
        aps.append(float(np.mean((np.arange(len(where)) + 1) / (where + 1))))
    out = {"R@%d" % k: round(float(np.mean(hits[k])), 4) for k in ks}
    out["mAP"] = round(float(np.mean(aps)), 4)
    out.update({"chance R@%d" % k: round(float(np.mean(chance[k])), 4) for k in ks})
    out["queries"] = len(queries)
    return out


def fmt(r):
    return "R@1 %.3f  R@5 %.3f  R@10 %.3f  mAP %.3f" % (r["R@1"], r["R@5"], r["R@10"], r["mAP"])


def embed_split(clip_dir, adapter_dir, texts, image_paths, cache):
    """Text and image embeddings of one model (+ adapter), through the saved files."""
    key = clip_dir
    if key not in cache:
        model = common.load_clip(clip_dir)
        tokens = common.Tokens(clip_dir)  # the directory's tokenizer symlinks
        proc = common.CLIPImageProcessor.from_pretrained(clip_dir)
        cache[key] = (model, tokens, proc)
    model, tokens, proc = cache[key]
    t = common.embed_texts(model, tokens, texts)
    im = common.embed_pixels(model, common.load_pixels(image_paths, proc))
    if adapter_dir:
        ad = common.load_adapter(adapter_dir)
        with torch.no_grad():
            t, im = ad(t)[0], ad(im)[0]
    return t, im


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", default="build-train/catalog")
    ap.add_argument("--runs", default="build-train")
    ap.add_argument("--out", default=None, help="results JSON (default RUNS/results.json)")
    ap.add_argument("--methods", default=",".join(m[0] for m in METHODS),
                    help="comma-separated subset to (re)evaluate; the others are kept from --out")
    args = ap.parse_args()
    out = args.out or os.path.join(args.runs, "results.json")
    wanted = args.methods.split(",")

    sets = {}
    for name, split, qfile in (("shifted", "shifted-test", "queries.jsonl"),
                               ("base", "base-test", "queries-base.jsonl")):
        items = common.load_split(args.catalog, split)
        queries = common.read_jsonl(os.path.join(args.catalog, qfile))
        sets[name] = (items, queries)
    new_cats = set(common.catalog.NEW_CATEGORIES)

    previous = {}
    if os.path.exists(out) and len(wanted) < len(METHODS):
        with open(out) as fh:
            previous = json.load(fh)["results"]
    results = {}
    cache = {}
    for key, label, clip_rel, ad_rel in METHODS:
        if key not in wanted:
            if key in previous:
                results[key] = previous[key]
            continue
        clip_dir = os.path.join(args.runs, clip_rel)
        ad_dir = os.path.join(args.runs, ad_rel) if ad_rel else None
        if not os.path.isdir(clip_dir) or (ad_dir and not os.path.isdir(ad_dir)):
            print("skip %s (not trained)" % key)
            continue
        row = {"label": label, "clip": clip_rel, "adapter": ad_rel}
        for name, (items, queries) in sets.items():
            t, im = embed_split(clip_dir, ad_dir, [q["text"] for q in queries],
                                [it["abspath"] for it in items], cache)
            ids = [it["id"] for it in items]
            row[name] = retrieval(t, im, queries, ids)
            if name == "shifted":
                for sub, keep in (("shifted_new_categories", True), ("shifted_seen_categories", False)):
                    qs = [(i, q) for i, q in enumerate(queries)
                          if (q["attributes"]["category"] in new_cats) == keep]
                    row[sub] = retrieval(t[[i for i, _ in qs]], im, [q for _, q in qs], ids)
        info_dir = os.path.join(args.runs, {"zero-shot": "base"}.get(key, key))
        info_path = os.path.join(info_dir, "train.json")
        if os.path.exists(info_path):
            with open(info_path) as fh:
                info = json.load(fh)
            row.update({k: info[k] for k in ("params_trainable", "train_wall_s", "train_cpu_s")
                        if k in info})
        results[key] = row
        print("%-28s shifted: %s | base: %s" % (label, fmt(row["shifted"]), fmt(row["base"])),
              flush=True)

    common.write_json(out, {"catalog": args.catalog, "versions": common.versions(),
                            "results": results})
    print()
    print(markdown(results))


def markdown(results):
    lines = ["| method | trainable params | train time (1 core) | R@1 | R@5 | R@10 | mAP "
             "| R@10 new cats | R@10 seen cats | base-test R@10 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in results.items():
        s = r["shifted"]
        params = "%s" % format(r["params_trainable"], ",") if key != "zero-shot" else "—"
        tm = "%.0f s" % r["train_cpu_s"] if key != "zero-shot" and "train_cpu_s" in r else "—"
        lines.append("| %s | %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            r["label"], params, tm, s["R@1"], s["R@5"], s["R@10"], s["mAP"],
            r["shifted_new_categories"]["R@10"], r["shifted_seen_categories"]["R@10"],
            r["base"]["R@10"]))
    any_r = next(iter(results.values()))["shifted"]
    lines.append("| chance | | | %.3f | %.3f | %.3f | | | | |" % (
        any_r["chance R@1"], any_r["chance R@5"], any_r["chance R@10"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
