#!/usr/bin/env python3
"""Adapt the base CLIP to the shifted domain (shifted-train) with one of three methods.

    tools/train/adapt.py --method full   # all weights          -> RUNS/full/clip/
    tools/train/adapt.py --method lora   # low-rank updates     -> RUNS/lora/clip/ (merged)
    tools/train/adapt.py --method moe    # MoE adapter, frozen  -> RUNS/moe/adapter/

All three start from RUNS/base/clip/ as the engine loads it (fp16 weights widened to fp32) and
use the same contrastive loss, caption variants and shifted-train items. Each run writes
RUNS/METHOD/train.json (trainable parameters, wall and CPU time, loss curve).

The MoE adapter also replays the base domain: half of every batch are frozen embeddings of
base-train + base-wild items (same caption sampling, 4 image views), and on those rows a penalty
(weight 3) keeps the adapter's output near its normalised input. Without that, the adapter
fitted to the 1,000 shifted-train items lowered the base categories (docs/adaptation.md).
"""

import argparse
import os
import time
import zlib

import common  # first: pins the math libraries to one thread
from common import np, torch

DEFAULTS = {  # method: steps, batch, lr, warmup, weight decay
    "full": dict(steps=300, batch=128, lr=2e-4, warmup=30, weight_decay=0.1),
    "lora": dict(steps=300, batch=128, lr=2e-3, warmup=30, weight_decay=0.0),
    "moe": dict(steps=1500, batch=256, lr=2e-3, warmup=100, weight_decay=0.01),
}
# The MoE recipe before replay (the adapter shipped until then; docs/adaptation.md, "History"):
#   --steps 3000 --replay "" --identity 0


def cache_embeddings(model, tokens, items, pixels, codes, K, n_views, rng):
    """Frozen embeddings of one split: K caption variants per item (text [N, K, D] and the
    attribute codes each caption names [N, K, A]) and `n_views` image views per item (plain,
    flipped, randomly augmented as in common.augment: [N, views, D])."""
    texts, named = [], []
    for it in items:
        for _ in range(K):
            t, nm = common.catalog.random_caption(it["attributes"], rng)
            texts.append(t)
            named.append(codes.named(nm))
    named = np.stack(named).reshape(len(items), K, -1)
    txt = common.embed_texts(model, tokens, texts, engine=False).reshape(len(items), K, -1)
    views = [pixels, pixels.flip(-1)] + [common.augment(pixels, rng) for _ in range(n_views - 2)]
    img = torch.stack([common.embed_pixels(model, v) for v in views], 1)
    item_codes = np.stack([codes.full(it["attributes"]) for it in items])
    return txt, named, img, item_codes


def replay_embeddings(model, tokens, proc, codes, args, seed):
    """The --replay splits' frozen embeddings, concatenated (each split with its own generator,
    so the shifted-train data do not depend on --replay). With --replay-cache they are stored
    once per (base model, catalog, split and its position in --replay, variants, views, seed) and
    reused by later runs: the position is part of the key because it seeds the split's generator."""
    parts = []
    for n, split in enumerate(s for s in args.replay.split(",") if s):
        path = None
        if args.replay_cache:
            catalog = zlib.crc32(os.path.realpath(args.catalog).encode())
            path = os.path.join(args.replay_cache, "%s-p%d-c%08x-k%d-v%d-s%d.pt" % (
                split, n, catalog, args.variants, args.views, seed))
        key = os.path.realpath(os.path.join(args.runs, "base", "clip"))
        if path and os.path.exists(path):
            c = torch.load(path)
            assert c["base"] == key, (path, c["base"], key)
            for k, v in c["vocab"].items():  # same attribute codes as this run's
                for val, code in v.items():
                    assert codes.code(k, val) == code, (k, val)
            parts.append((c["txt"], c["named"], c["img"], c["item_codes"]))
            continue
        items = common.load_split(args.catalog, split)
        pixels = common.load_pixels([it["abspath"] for it in items], proc)
        rng = np.random.default_rng([seed, 1 + n, len(items)])
        part = cache_embeddings(model, tokens, items, pixels, codes, args.variants, args.views, rng)
        parts.append(part)
        if path:
            os.makedirs(args.replay_cache, exist_ok=True)
            torch.save({"base": key, "vocab": codes.vocab, "txt": part[0], "named": part[1],
                        "img": part[2], "item_codes": part[3]}, path)
    if not parts:
        return None
    return (torch.cat([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]), np.concatenate([p[3] for p in parts]))


def train_moe(model, items, pixels, tokens, proc, args, seed):
    """Frozen CLIP: embed once (K caption variants and `views` image views per item: plain,
    flipped, randomly augmented as in common.augment), then train the adapter on the cached
    projected embeddings, shared by both modalities (common.fit_moe_adapter, which
    tools/train-adapter shares).

    With --replay, a share (--replay-frac) of every batch comes from other splits' frozen
    embeddings (the base domain), so the contrastive loss also rewards keeping the base
    categories; --identity adds a penalty ||adapter(x) - x/|x|||^2 on those replay rows."""
    t0, c0 = time.time(), time.process_time()
    rng = np.random.default_rng(seed)
    codes = common.AttrCodes()
    K = args.variants
    txt, named, img, item_codes = cache_embeddings(model, tokens, items, pixels, codes, K,
                                                   args.views, rng)
    replay = replay_embeddings(model, tokens, proc, codes, args, seed)
    embed_wall, embed_cpu = time.time() - t0, time.process_time() - c0
    print("moe: cached %d text and %d image embeddings in %.0fs (|text| %.2f, |image| %.2f)" % (
        txt.shape[0] * K, img.shape[0] * img.shape[1], embed_wall, txt.norm(dim=-1).mean(),
        img.norm(dim=-1).mean()), flush=True)
    adapter, log = common.fit_moe_adapter((txt, named, img, item_codes), replay, args, rng, seed,
                                          model.logit_scale)
    stats = {"wall_s": round(time.time() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
             "embed_cache_wall_s": round(embed_wall, 1), "embed_cache_cpu_s": round(embed_cpu, 1),
             "log": log}
    return adapter, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", required=True, choices=sorted(DEFAULTS))
    ap.add_argument("--catalog", default="build-train/catalog")
    ap.add_argument("--runs", default="build-train")
    ap.add_argument("--seed", type=int, default=1)
    for k in ("steps", "batch", "warmup"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    for k in ("lr", "weight_decay"):
        ap.add_argument("--" + k.replace("_", "-"), type=float, default=None)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha/rank)")
    ap.add_argument("--experts", type=int, default=8, help="MoE experts")
    ap.add_argument("--top-k", type=int, default=2, help="MoE experts per embedding")
    ap.add_argument("--intermediate", type=int, default=128, help="MoE expert width")
    ap.add_argument("--aux", type=float, default=0.01, help="MoE load-balancing loss weight")
    ap.add_argument("--variants", type=int, default=16, help="MoE cached captions per item")
    ap.add_argument("--views", type=int, default=4, help="MoE cached image views per item (>= 2)")
    ap.add_argument("--replay", default="base-train,base-wild",
                    help="MoE: comma-separated catalog splits whose frozen embeddings are mixed "
                         "into every batch (e.g. base-train,base-wild); empty = none")
    ap.add_argument("--replay-frac", type=float, default=0.5,
                    help="MoE: share of each batch drawn from the --replay splits")
    ap.add_argument("--replay-cache", default="",
                    help="MoE: directory to keep the --replay splits' frozen embeddings in")
    ap.add_argument("--identity", type=float, default=3.0,
                    help="MoE: weight of ||adapter(x) - x/|x|||^2 on the replay rows (all rows "
                         "without --replay)")
    ap.add_argument("--out", default=None, help="output directory (default RUNS/METHOD)")
    args = ap.parse_args()
    for k, v in DEFAULTS[args.method].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    t_start = time.time()
    torch.manual_seed(args.seed)
    base_dir = os.path.join(args.runs, "base", "clip")
    model = common.load_clip(base_dir)
    proc = common.CLIPImageProcessor.from_pretrained(base_dir)
    items = common.load_split(args.catalog, "shifted-train")
    pixels = common.load_pixels([it["abspath"] for it in items], proc)
    tokens = common.Tokens(base_dir)
    out_dir = args.out or os.path.join(args.runs, args.method)
    total = common.count_params(model.parameters())
    info = {"method": args.method, "args": vars(args), "versions": common.versions(),
            "base": base_dir}

    if args.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        trainable = total
        info["note"] = ("every weight is trainable; %d of them are the token embedding, of which "
                        "only the rows of caption words get gradients" %
                        model.text_model.embeddings.token_embedding.weight.numel())
        sampler = common.PairSampler(items, pixels, args.seed)
        stats = common.train_clip(model, sampler, tokens, args.steps, args.batch, args.lr,
                                  args.warmup, args.weight_decay, label="full")
        common.save_clip_dir(model, os.path.join(out_dir, "clip"))
    elif args.method == "lora":
        common.add_lora(model, args.rank, args.alpha)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        trainable = common.count_params(lora)
        info["note"] = ("rank-%d LoRA on q/k/v/out_proj, fc1, fc2 of all %d encoder layers of both "
                        "towers (+ the logit scale), merged into the weights for export" %
                        (args.rank, len(common.encoder_layers(model))))
        sampler = common.PairSampler(items, pixels, args.seed)
        stats = common.train_clip(model, sampler, tokens, args.steps, args.batch, args.lr,
                                  args.warmup, args.weight_decay, label="lora")
        with torch.no_grad():  # merged model must equal the LoRA model
            ids, mask = tokens.batch(["a small red striped mug on wood", "lamp"])
            ref_t = model.get_text_features(input_ids=ids, attention_mask=mask)
            ref_i = model.get_image_features(pixel_values=pixels[:4])
        common.merge_lora(model)
        with torch.no_grad():
            err = max(float((model.get_text_features(input_ids=ids, attention_mask=mask)
                             - ref_t).abs().max()),
                      float((model.get_image_features(pixel_values=pixels[:4]) - ref_i).abs().max()))
        info["merge_max_abs_err"] = err
        assert err < 1e-3, err
        common.save_clip_dir(model, os.path.join(out_dir, "clip"))
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        adapter, stats = train_moe(model, items, pixels, tokens, proc, args, args.seed)
        trainable = common.count_params(adapter.parameters())
        info["note"] = ("%d SwiGLU experts (width %d), top-%d Mixtral routing, one adapter shared by "
                        "text and image embeddings; CLIP frozen. train time includes caching the "
                        "frozen embeddings (embed_cache_*)" %
                        (args.experts, args.intermediate, args.top_k))
        info["embed_cache_wall_s"] = stats["embed_cache_wall_s"]
        info["embed_cache_cpu_s"] = stats["embed_cache_cpu_s"]
        common.save_adapter_dir(adapter, os.path.join(out_dir, "adapter"),
                                {"base_model": "models/default/clip"})

    info.update({"params_total_clip": total, "params_trainable": trainable,
                 "train_wall_s": stats["wall_s"], "train_cpu_s": stats["cpu_s"],
                 "total_wall_s": round(time.time() - t_start, 1), "log": stats["log"]})
    common.write_json(os.path.join(out_dir, "train.json"), info)
    print("%s: %d trainable parameters, training %.0fs wall / %.0fs CPU" % (
        args.method, trainable, stats["wall_s"], stats["cpu_s"]))


if __name__ == "__main__":
    main()
