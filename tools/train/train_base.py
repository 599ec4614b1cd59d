#!/usr/bin/env python3
"""Train the tiny base CLIP of the default model contrastively on the base-domain catalog.

    tools/train/train_base.py --catalog build-train/catalog --out build-train/base

Writes OUT/clip/ (the Hugging Face directory in the engine's layout, fp16 weights),
OUT/fp32.safetensors (the training-time fp32 weights, for the export check) and
OUT/train.json (configuration, parameter count, times, loss curve, fp16-vs-fp32 error,
in-domain recall).
"""

import argparse
import os
import time

import common  # first: pins the math libraries to one thread
from common import torch
import evaluate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", default="build-train/catalog")
    ap.add_argument("--out", default="build-train/base")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--splits", default="base-train",
                    help="comma-separated catalog splits to train on (e.g. base-train,base-wild)")
    ap.add_argument("--init", default=None,
                    help="start from these fp32 weights (a previous run's fp32.safetensors) "
                         "instead of a random initialisation")
    args = ap.parse_args()

    t_start = time.time()
    torch.manual_seed(args.seed)
    config = common.tiny_clip_config()
    model = common.CLIPModel(config).float()
    if args.init:
        model.load_state_dict(common.load_file(args.init))
    proc = common.image_processor(config.vision_config.image_size)
    items = [it for split in args.splits.split(",") for it in common.load_split(args.catalog, split)]
    pixels = common.load_pixels([it["abspath"] for it in items], proc)
    tokens = common.Tokens()
    sampler = common.PairSampler(items, pixels, args.seed)
    n_params = common.count_params(model.parameters())
    print("base CLIP: %d parameters, %d items (%s)%s" % (
        n_params, len(items), args.splits, ", from " + args.init if args.init else ""), flush=True)

    stats = common.train_clip(model, sampler, tokens, args.steps, args.batch, args.lr, args.warmup,
                              args.weight_decay, label="base")
    model.eval()

    # Training-time fp32 weights, then the engine-format (fp16) directory.
    os.makedirs(args.out, exist_ok=True)
    common.save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                     os.path.join(args.out, "fp32.safetensors"))
    clip_dir = common.save_clip_dir(model, os.path.join(args.out, "clip"))

    # fp16 check + in-domain retrieval (fp32 and reloaded fp16).
    reloaded = common.load_clip(clip_dir)
    q = common.read_jsonl(os.path.join(args.catalog, "queries-base.jsonl"))
    test = common.load_split(args.catalog, "base-test")
    res = {}
    embs = {}
    for name, m in (("fp32", model), ("fp16", reloaded)):
        t = common.embed_texts(m, tokens, [x["text"] for x in q])
        im = common.embed_pixels(m, common.load_pixels([it["abspath"] for it in test], proc))
        embs[name] = (t, im)
        res[name] = evaluate.retrieval(t, im, q, [it["id"] for it in test])
        print("base-test (%s): %s" % (name, evaluate.fmt(res[name])), flush=True)
    rel = max(evaluate.max_rel_err(embs["fp16"][i], embs["fp32"][i]) for i in range(2))

    common.write_json(os.path.join(args.out, "train.json"), {
        "method": "base (contrastive pre-training on %s%s)" % (
            args.splits, ", continued from " + args.init if args.init else ""),
        "args": vars(args), "versions": common.versions(),
        "params_total": n_params, "params_trainable": n_params,
        "train_wall_s": stats["wall_s"], "train_cpu_s": stats["cpu_s"],
        "total_wall_s": round(time.time() - t_start, 1),
        "fp16_vs_fp32_max_rel_err": rel, "base_test": res, "log": stats["log"]})
    print("fp16 export: max relative embedding error %.2e; total %.0fs" %
          (rel, time.time() - t_start))


if __name__ == "__main__":
    main()
