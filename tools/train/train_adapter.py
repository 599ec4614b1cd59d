#!/usr/bin/env python3
"""Train a MoE adapter for your own catalog on a frozen Hugging Face CLIP (run tools/train-adapter).

    tools/train-adapter --clip DIR --catalog FILE.jsonl --out DIR [--experts 8 --top-k 2
                        --steps 1500 --val-fraction 0.2 --seed 1 --threads 1]

--clip: a CLIP directory as Hugging Face ships it (config.json, model.safetensors or
pytorch_model.bin, vocab.json + merges.txt, preprocessor_config.json). --catalog: the engine's
catalog.jsonl (docs/real-models.md), every line with a caption. The items (images) are split
into train and held-out by a seeded hash; the frozen CLIP embeds the train captions and
--views image views per train item once (transformers' CLIPModel with CLIPTokenizer +
CLIPImageProcessor, the engine's tokenization and preprocessing), then the adapter is trained
on those embeddings with the project's recipe (common.fit_moe_adapter, as tools/train/adapt.py
--method moe; docs/adaptation.md). Writes into --out:

    adapter.safetensors, adapter_config.json   the adapter (moe-route / moe-expert model=OUT)
    eval.json, eval.md                         base CLIP vs CLIP + adapter on the held-out items:
                                               text -> image R@1, R@5, R@10, mAP
    held-out/catalog.jsonl, queries.jsonl      the held-out split, for build/tools/moe-eval-recall
    train.json                                 arguments, timings, loss curve
    clip/                                      only when --clip has no model.safetensors: an
                                               engine-ready copy with the weights as safetensors
"""

import argparse
import json
import os
import shutil
import sys
import time

import user_catalog

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
ENGINE_WEIGHTS = WEIGHT_FILES[:2]
# Copied beside a converted model.safetensors (the engine reads the first four; the others keep
# the copy a complete Hugging Face directory).
SMALL_FILES = ("config.json", "vocab.json", "merges.txt", "preprocessor_config.json",
               "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


class UsageError(Exception):
    pass


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="train-adapter", description=__doc__.split("\n")[0])
    ap.add_argument("--clip", required=True, help="Hugging Face CLIP directory")
    ap.add_argument("--catalog", required=True, help="catalog.jsonl: path, caption, id per line")
    ap.add_argument("--out", required=True, help="output directory (created; our files replaced)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2, help="experts per embedding")
    ap.add_argument("--intermediate", type=int, default=0,
                    help="expert width (default: the embedding size)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=256,
                    help="rows per step (at most the train items)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--identity", type=float, default=3.0,
                    help="weight of ||adapter(x) - x/|x|||^2 on the --replay-catalog rows (all "
                         "rows without one): how close the adapter stays to plain CLIP")
    ap.add_argument("--replay-catalog", default="",
                    help="optional catalog.jsonl of general images + captions whose frozen "
                         "embeddings fill --replay-frac of every batch (keeps what CLIP already "
                         "does well); none by default")
    ap.add_argument("--replay-frac", type=float, default=0.5)
    ap.add_argument("--views", type=int, default=4,
                    help="image views embedded per train item: plain, flipped, then augmented")
    ap.add_argument("--val-fraction", type=float, default=0.2,
                    help="share of the items held out for the evaluation (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--embed-batch", type=int, default=32, help="images or captions per forward")
    args = ap.parse_args(argv)
    for name in ("experts", "top_k", "steps", "batch", "views", "threads", "embed_batch"):
        if getattr(args, name) < 1:
            ap.error("--%s must be at least 1" % name.replace("_", "-"))
    if args.top_k > args.experts:
        ap.error("--top-k %d exceeds --experts %d" % (args.top_k, args.experts))
    if args.views < 2:
        ap.error("--views must be at least 2 (plain and flipped)")
    if not 0 < args.replay_frac < 1:
        ap.error("--replay-frac must be in (0, 1)")
    return args


def check_clip_dir(d):
    """The weights file the directory has; raises UsageError for anything but a CLIP directory
    train-adapter and the engine can read."""
    if not os.path.isdir(d):
        raise UsageError("--clip %s: not a directory" % d)
    cfg_path = os.path.join(d, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError("--clip %s: not a Hugging Face model directory (no config.json)" % d)
    try:
        with open(cfg_path) as fh:
            cfg = json.load(fh)
    except ValueError as e:
        raise UsageError("%s: not JSON (%s)" % (cfg_path, e))
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type != "clip":
        raise UsageError("--clip %s: config.json says model_type %r, not 'clip' (a CLIPModel "
                         "checkpoint such as openai/clip-vit-base-patch32 is needed)" % (
                             d, model_type))
    weights = [f for f in WEIGHT_FILES if os.path.isfile(os.path.join(d, f))]
    if not weights:
        raise UsageError("--clip %s: no weights (%s)" % (d, ", ".join(WEIGHT_FILES)))
    missing = [f for f in ("vocab.json", "merges.txt") if not os.path.isfile(os.path.join(d, f))]
    if missing:
        raise UsageError("--clip %s: no tokenizer (%s missing)" % (d, " and ".join(missing)))
    return weights[0]


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    try:
        weights = check_clip_dir(args.clip)
        items = user_catalog.load_catalog(args.catalog)
        train, held = user_catalog.split(items, args.val_fraction, args.seed)
        replay_items = user_catalog.load_catalog(args.replay_catalog) if args.replay_catalog \
            else []
    except (UsageError, user_catalog.CatalogError, ValueError) as e:
        print("train-adapter: %s" % e, file=sys.stderr)
        return 2
    print("train-adapter: %d items (%d captions): %d train, %d held out (seed %d)%s" % (
        len(items), sum(len(it.captions) for it in items), len(train), len(held), args.seed,
        "; %d replay items" % len(replay_items) if replay_items else ""), flush=True)

    import common  # noqa: E402 (heavy: torch + transformers, after the cheap checks)
    import evaluate  # noqa: E402
    torch = common.torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    model = common.load_clip(args.clip)
    tok = common.CLIPTokenizer.from_pretrained(args.clip)
    proc = common.CLIPImageProcessor.from_pretrained(args.clip)  # OpenAI's defaults when absent
    engine_clip = args.clip
    if weights not in ENGINE_WEIGHTS:
        engine_clip = os.path.join(args.out, "clip")
        write_engine_clip(model, args.clip, engine_clip)
        print("train-adapter: %s has %s only; wrote the engine's model.safetensors into %s" % (
            args.clip, weights, engine_clip), flush=True)
    emb = Embedder(common, model, tok, proc, args)

    rng = common.np.random.default_rng(args.seed)
    t0, c0 = time.time(), time.process_time()
    captions = CaptionIds()
    own = emb.training_set(train, captions, rng, first_item=0)
    replay = emb.training_set(replay_items, captions, rng, first_item=len(train)) \
        if replay_items else None
    embed_wall, embed_cpu = time.time() - t0, time.process_time() - c0
    n_embedded = len(train) + len(replay_items)
    print("train-adapter: embedded %d items x %d views + %d captions in %.0f s (%.2f items/s)" % (
        n_embedded, args.views, len(captions.texts), embed_wall, n_embedded / embed_wall),
        flush=True)

    hp = argparse.Namespace(**vars(args))
    hp.intermediate = args.intermediate or own[0].shape[-1]
    hp.batch = fit_batch(args.batch, len(train), len(replay_items), args.replay_frac)
    if hp.batch != args.batch:
        print("train-adapter: batch %d (the train items allow no more)" % hp.batch, flush=True)
    t1, c1 = time.time(), time.process_time()
    adapter, log = common.fit_moe_adapter(own, replay, hp, rng, args.seed, model.logit_scale,
                                          match=captions.matcher(len(train) + len(replay_items)),
                                          label="train-adapter")
    train_wall, train_cpu = time.time() - t1, time.process_time() - c1
    common.save_adapter_dir(adapter, args.out, {
        "generator": "tools/train-adapter", "base_model": engine_clip},
        fresh=False)
    print("train-adapter: %d steps in %.0f s (%.1f steps/s); adapter written to %s" % (
        hp.steps, train_wall, hp.steps / train_wall, args.out), flush=True)

    info = {"args": vars(args), "clip": os.path.abspath(args.clip),
            "engine_clip": os.path.abspath(engine_clip), "catalog": os.path.abspath(args.catalog),
            "items": {"train": len(train), "held_out": len(held), "replay": len(replay_items)},
            "batch": hp.batch, "intermediate": hp.intermediate,
            "params_trainable": common.count_params(adapter.parameters()),
            "embed_wall_s": round(embed_wall, 1), "embed_cpu_s": round(embed_cpu, 1),
            "embed_items_per_s": round(n_embedded / embed_wall, 2),
            "train_wall_s": round(train_wall, 1), "train_cpu_s": round(train_cpu, 1),
            "versions": common.versions(), "log": log}
    if held:
        report = held_out_eval(common, evaluate, emb, adapter, held, args, engine_clip)
        info["total_wall_s"] = round(time.time() - t_start, 1)
        print()
        print(report)
    else:
        print("train-adapter: --val-fraction 0, no evaluation", flush=True)
        for stale in ("eval.json", "eval.md"):  # an earlier run's, of another adapter
            if os.path.exists(os.path.join(args.out, stale)):
                os.remove(os.path.join(args.out, stale))
        shutil.rmtree(os.path.join(args.out, "held-out"), ignore_errors=True)
    common.write_json(os.path.join(args.out, "train.json"), info)
    return 0


def fit_batch(batch, n_train, n_replay, frac):
    """The largest batch <= `batch` whose own rows fit the train items (and replay rows the
    replay items): every step draws its rows without replacement."""
    while batch > 1:
        r = int(round(batch * frac)) if n_replay else 0
        if batch - r <= n_train and r <= n_replay:
            break
        batch -= 1
    return batch


class CaptionIds:
    """Caption texts as integer ids, and which items each fits (an item fits all its captions;
    items with the same caption fit each other's), for fit_moe_adapter's match matrix."""

    def __init__(self):
        self.ids, self.texts, self.pairs = {}, [], []

    def add(self, item_index, caption):
        n = self.ids.setdefault(caption, len(self.texts))
        if n == len(self.texts):
            self.texts.append(caption)
        self.pairs.append((item_index, n))
        return n

    def matcher(self, n_items):
        import torch
        fits = torch.zeros(n_items, len(self.texts), dtype=torch.bool)
        for i, c in self.pairs:
            fits[i, c] = True

        def match(caption_ids, item_indices):  # [T, I]: caption t fits item i
            return fits[torch.as_tensor(item_indices)][:, torch.as_tensor(caption_ids)].t()
        return match


class Embedder:
    """The frozen CLIP's projected (unnormalised) embeddings, as the engine computes them: captions
    tokenized by CLIPTokenizer (truncated to the model's positions; padding cannot change the
    causal text tower's output), images through the directory's CLIPImageProcessor."""

    def __init__(self, common, model, tok, proc, args):
        self.common, self.model, self.tok, self.proc = common, model, tok, proc
        self.max_len = model.config.text_config.max_position_embeddings
        self.batch, self.views = args.embed_batch, args.views
        self.caption_cache = {}  # caption -> embedding (replay items may share captions)

    def texts(self, texts):
        torch = self.common.torch
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch):
                enc = self.tok(texts[i:i + self.batch], truncation=True, max_length=self.max_len,
                               padding="longest", return_tensors="pt")
                out.append(self.model.get_text_features(input_ids=enc["input_ids"],
                                                        attention_mask=enc["attention_mask"]))
        return torch.cat(out).float()

    def images(self, paths, views, rng):
        """[N, views, D]: plain, flipped, then views - 2 augmented (common.augment) per image."""
        common, torch = self.common, self.common.torch
        out = []
        with torch.no_grad():
            for i in range(0, len(paths), self.batch):
                ims = []
                for p in paths[i:i + self.batch]:
                    try:
                        with common.Image.open(p) as im:
                            ims.append(im.convert("RGB"))
                    except (OSError, ValueError) as e:
                        raise SystemExit("train-adapter: %s: cannot read the image (%s)" % (p, e))
                px = torch.from_numpy(self.proc(images=ims, return_tensors="np")["pixel_values"])
                vs = [px, px.flip(-1)] + [common.augment(px, rng) for _ in range(views - 2)]
                out.append(torch.stack([self.model.get_image_features(pixel_values=v.float())
                                        for v in vs[:views]], 1))
        return torch.cat(out).float()

    def training_set(self, items, captions, rng, first_item):
        """fit_moe_adapter's (txt [N, K, D], caption ids [N, K], img [N, V, D], item indices [N]):
        K = the most captions an item has (an item with fewer repeats its own)."""
        np, torch = self.common.np, self.common.torch
        K = max(len(it.captions) for it in items)
        ids = np.array([[captions.add(first_item + n, it.captions[k % len(it.captions)])
                         for k in range(K)] for n, it in enumerate(items)], np.int64)
        todo = [t for t in captions.texts if t not in self.caption_cache]
        if todo:
            self.caption_cache.update(zip(todo, self.texts(todo)))
        table = torch.stack([self.caption_cache[t] for t in captions.texts])
        txt = table[torch.from_numpy(ids)]
        img = self.images([it.path for it in items], self.views, rng)
        return txt, ids, img, np.arange(first_item, first_item + len(items))


def held_out_eval(common, evaluate, emb, adapter, held, args, engine_clip):
    """Text -> image retrieval over the held-out images, each caption a query (relevant: the
    held-out items with that caption), base CLIP vs CLIP + adapter. Writes eval.json, eval.md
    and held-out/{catalog,queries}.jsonl; returns the markdown."""
    torch = common.torch
    held_dir = os.path.join(args.out, "held-out")
    queries = user_catalog.held_out_files(held, held_dir)
    t = emb.texts([q["text"] for q in queries])
    im = emb.images([it.path for it in held], 1, None)[:, 0]
    ids = [it.id for it in held]
    with torch.no_grad():
        rows = {"base CLIP": evaluate.retrieval(t, im, queries, ids, ks=(1, 5, 10)),
                "CLIP + adapter": evaluate.retrieval(adapter(t)[0], adapter(im)[0], queries, ids,
                                                     ks=(1, 5, 10))}
    lines = ["Held-out text -> image retrieval: %d queries over %d images (%s)" % (
        len(queries), len(held), os.path.basename(os.path.abspath(args.catalog))), "",
        "| model | R@1 | R@5 | R@10 | mAP |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append("| %s | %.3f | %.3f | %.3f | %.3f |" % (name, r["R@1"], r["R@5"], r["R@10"],
                                                           r["mAP"]))
    r = rows["base CLIP"]
    lines.append("| chance | %.3f | %.3f | %.3f | |" % (r["chance R@1"], r["chance R@5"],
                                                          r["chance R@10"]))
    check = ("build/tools/moe-eval-recall --model %s --adapter %s --catalog %s --queries %s" % (
        engine_clip, args.out, held_dir, os.path.join(held_dir, "queries.jsonl")))
    lines += ["", "The same through the engine's pipelines (after the README's build):", "",
              "    GST_PLUGIN_PATH_1_0=build/gst-plugins " + check]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "eval.md"), "w") as fh:
        fh.write(md)
    common.write_json(os.path.join(args.out, "eval.json"), {
        "clip": os.path.abspath(args.clip), "catalog": os.path.abspath(args.catalog),
        "seed": args.seed, "val_fraction": args.val_fraction, "held_out_items": len(held),
        "queries": len(queries), "results": rows, "engine_check": check})
    return md


def write_engine_clip(model, src, dst):
    """`src` with its weights as model.safetensors (the engine reads no pytorch_model.bin)."""
    os.makedirs(dst, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True)
    for name in SMALL_FILES:  # the originals, not save_pretrained's rewrite of config.json
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


if __name__ == "__main__":
    sys.exit(main())
