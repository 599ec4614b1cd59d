#!/usr/bin/env python3
"""Install the trained base CLIP + MoE adapter + demo catalog as models/default/, and check it.

    tools/train/export_default.py --catalog build-train/catalog --runs build-train

models/default/
    clip/            RUNS/base/clip (config.json, fp16 model.safetensors, preprocessor_config.json,
                     relative symlinks to ../../clip-tokenizer/*)
    adapter/         RUNS/gate/adapter: RUNS/moe/adapter plus the cross-modal gate (and, when
                     train_gate.py ran with --ship joint, its joint visual-text experts:
                     adapter_config.json "joint_experts"; adapter.safetensors)
    catalog/         the shifted-test images + catalog.jsonl
    queries.jsonl    held-out text queries over catalog/ with their relevant ids
    composed/, composed-queries.jsonl   the held-out (val + test) hybrid queries over catalog/:
                     source pictures + modifier texts (generate_catalog.py)
    python_reference.json   Python-side retrieval metrics and each query's top-10 ids (text
                     queries; "hybrid": the composed queries through the gate)

    tools/train/export_default.py --hybrid-only   # only adapter/ (gate), composed*, "hybrid"

Checks (printed and written to RUNS/export_check.json; any failure aborts):
* models/default/clip loaded back with transformers from the fp16 files vs the training-time
  fp32 model (RUNS/base/fp32.safetensors): max relative error of text and image embeddings;
* the adapter recomputed in plain numpy from adapter.safetensors vs the torch module, and the
  gate's fusion likewise on composed queries;
* retrieval through the installed files equals RUNS/results.json's MoE row.
"""

import argparse
import json
import os
import shutil

import common  # first: pins the math libraries to one thread
from common import np, torch
import evaluate
import train_gate

DEFAULT = os.path.join(common.REPO_ROOT, "models", "default")
ABOUT = ("Python-side (transformers) retrieval of models/default/queries.jsonl over "
         "models/default/catalog, written by tools/train/export_default.py; 'moe' = clip + "
         "adapter, 'zero-shot' = clip only. top10: [id, cosine similarity]. 'hybrid': "
         "models/default/composed-queries.jsonl, query = adapter(fuse(image, text)) with the "
         "adapter's cross-modal gate (weights: [image, text]), metrics R@1, R@10, mAP@10.")


def copy_clip(src, dst):
    common.fresh_dir(dst)
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    rel = os.path.relpath(common.TOKENIZER_DIR, os.path.abspath(dst))
    for name in common.TOKENIZER_FILES:
        os.symlink(os.path.join(rel, name), os.path.join(dst, name))


def numpy_adapter(adapter_dir, x, fused=False):
    """The adapter in plain numpy from the files (independent of the torch module). Rows that are
    not fused hybrid queries (`fused` False) never route to the config's last `joint_experts`."""
    from safetensors.numpy import load_file
    with open(os.path.join(adapter_dir, "adapter_config.json")) as fh:
        cfg = json.load(fh)
    w = {k: v.astype(np.float64) for k, v in
         load_file(os.path.join(adapter_dir, "adapter.safetensors")).items()}
    x = x.astype(np.float64)
    logits = x @ w["gate.weight"].T
    joint = cfg.get("joint_experts", 0)
    if joint and not fused:
        logits[:, cfg["num_experts"] - joint:] = -np.inf
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    k = cfg["top_k"]
    sel = np.argsort(-p, axis=1, kind="stable")[:, :k]
    out = np.empty_like(x)
    gaps = []
    for t in range(x.shape[0]):
        wt = p[t, sel[t]]
        if cfg["norm_topk_prob"]:
            wt = wt / wt.sum()
        y = x[t].copy()
        for j, e in enumerate(sel[t]):
            a = w["experts.%d.w1.weight" % e] @ x[t]
            b = w["experts.%d.w3.weight" % e] @ x[t]
            h = a / (1 + np.exp(-a)) * b
            y += wt[j] * (w["experts.%d.w2.weight" % e] @ h)
        out[t] = y / np.linalg.norm(y)
        srt = np.sort(p[t])[::-1]
        gaps.append(srt[k - 1] - srt[k])
    return out, sel, float(min(gaps))


def numpy_fuse(adapter_dir, image, text):
    """The cross-modal gate in plain numpy from the file: (fused rows, weights [rows, 2])."""
    from safetensors.numpy import load_file
    w = load_file(os.path.join(adapter_dir, "adapter.safetensors"))
    x = np.concatenate([image, text], axis=1).astype(np.float64)
    logits = x @ w["cross_modal_gate.weight"].astype(np.float64).T + w["cross_modal_gate.bias"]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return p[:, :1] * image + p[:, 1:] * text, p


def install_hybrid(args, out, check):
    """adapter/ with the gate, the held-out composed queries, and their Python reference."""
    ad_dir = os.path.join(out, "adapter")
    common.fresh_dir(ad_dir)
    for name in ("adapter_config.json", "adapter.safetensors"):
        shutil.copyfile(os.path.join(args.runs, "gate", "adapter", name), os.path.join(ad_dir, name))
    rows = [r for r in common.read_jsonl(os.path.join(args.catalog, "composed-queries.jsonl"))
            if r["split"] != "train"]
    common.fresh_dir(os.path.join(out, "composed"))
    for r in rows:
        shutil.copyfile(os.path.join(args.catalog, r["image"]), os.path.join(out, r["image"]))
    with open(os.path.join(out, "composed-queries.jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")

    clip_dir = os.path.join(out, "clip")
    model = common.load_clip(clip_dir)
    tokens = common.Tokens(clip_dir)
    proc = common.CLIPImageProcessor.from_pretrained(clip_dir)
    items = common.load_split(out, "catalog")
    ids = [it["id"] for it in items]
    rows = train_gate.load_composed(out)
    image = common.embed_pixels(model, common.load_pixels([r["abspath"] for r in rows], proc))
    text = common.embed_texts(model, tokens, [r["text"] for r in rows])
    bank_raw = common.embed_pixels(model, common.load_pixels([it["abspath"] for it in items], proc))
    adapter = common.load_adapter(ad_dir)
    with torch.no_grad():
        fused, w = adapter.fuse(image, text)
        q, bank = adapter(fused, fused=True)[0], adapter(bank_raw)[0]
    npy_fused, npy_w = numpy_fuse(ad_dir, image.numpy(), text.numpy())
    npy_q = numpy_adapter(ad_dir, npy_fused[:32], fused=True)[0]
    npy_bank = numpy_adapter(ad_dir, bank_raw[:32].numpy())[0]  # joint experts masked off
    check["gate_numpy_max_abs_err"] = float(max(np.abs(npy_w - w.numpy()).max(),
                                                np.abs(npy_q - q[:32].numpy()).max(),
                                                np.abs(npy_bank - bank[:32].numpy()).max()))
    print("gate: numpy vs torch max abs error %.2e (weights, adapted fused and index rows)" %
          check["gate_numpy_max_abs_err"])
    assert check["gate_numpy_max_abs_err"] < 1e-5, check
    sims = q @ bank.t()
    top = torch.topk(sims, 10, dim=1)
    metrics = {s: train_gate.composed_metrics(q[[n for n, r in enumerate(rows) if r["split"] == s]],
                                              bank, [r for r in rows if r["split"] == s], ids)
               for s in ("val", "test")}
    for s, m in metrics.items():
        print("hybrid %-4s R@1 %.3f  R@10 %.3f  mAP@10 %.3f" % (s, m["R@1"], m["R@10"], m["mAP@10"]))
    return {"metrics": metrics, "queries": {
        r["id"]: {"weights": [round(float(v), 4) for v in w[n]],
                  "top10": [[ids[j], round(float(v), 4)] for v, j in zip(top.values[n], top.indices[n])]}
        for n, r in enumerate(rows)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", default="build-train/catalog")
    ap.add_argument("--runs", default="build-train")
    ap.add_argument("--out", default=DEFAULT)
    ap.add_argument("--hybrid-only", action="store_true",
                    help="only install adapter/ from RUNS/gate (the CLIP, the adapter's experts and "
                         "the catalog unchanged), composed*, and python_reference.json's 'hybrid'")
    args = ap.parse_args()
    out = args.out
    if args.hybrid_only:
        check = {}
        hybrid = install_hybrid(args, out, check)
        ref_path = os.path.join(out, "python_reference.json")
        with open(ref_path) as fh:
            ref = json.load(fh)
        ref["hybrid"] = hybrid
        ref["about"] = ABOUT
        common.write_json(ref_path, ref)
        common.write_json(os.path.join(args.runs, "export_check_hybrid.json"), check)
        return

    # ---- install
    os.makedirs(out, exist_ok=True)
    copy_clip(os.path.join(args.runs, "base", "clip"), os.path.join(out, "clip"))
    ad_dir = os.path.join(out, "adapter")
    cat_dir = common.fresh_dir(os.path.join(out, "catalog"))
    items = common.load_split(args.catalog, "shifted-test")
    for it in items:
        shutil.copyfile(it["abspath"], os.path.join(cat_dir, it["path"]))
    with open(os.path.join(cat_dir, "catalog.jsonl"), "w") as fh:
        for it in items:
            fh.write(json.dumps({k: it[k] for k in ("id", "path", "caption", "attributes")}) + "\n")
    shutil.copyfile(os.path.join(args.catalog, "queries.jsonl"), os.path.join(out, "queries.jsonl"))
    check = {}
    hybrid = install_hybrid(args, out, check)

    # ---- check 1: fp16 files, loaded back by transformers, vs the training-time fp32 model
    clip_dir = os.path.join(out, "clip")
    shipped = common.load_clip(clip_dir)
    train_time = common.CLIPModel(common.CLIPConfig.from_pretrained(clip_dir)).float().eval()
    train_time.load_state_dict(common.load_file(os.path.join(args.runs, "base", "fp32.safetensors")))
    tokens = common.Tokens(clip_dir)
    proc = common.CLIPImageProcessor.from_pretrained(clip_dir)
    queries = common.read_jsonl(os.path.join(out, "queries.jsonl"))
    shipped_items = common.load_split(out, "catalog")
    texts = [q["text"] for q in queries]
    pixels = common.load_pixels([it["abspath"] for it in shipped_items], proc)
    t16, i16 = common.embed_texts(shipped, tokens, texts), common.embed_pixels(shipped, pixels)
    t32, i32 = common.embed_texts(train_time, tokens, texts), common.embed_pixels(train_time, pixels)
    check.update({"fp16_text_max_rel_err": evaluate.max_rel_err(t16, t32),
                  "fp16_image_max_rel_err": evaluate.max_rel_err(i16, i32)})
    ids = [it["id"] for it in shipped_items]
    check["retrieval_fp32_training_model"] = evaluate.retrieval(t32, i32, queries, ids)
    check["retrieval_fp16_shipped"] = evaluate.retrieval(t16, i16, queries, ids)
    print("fp16 export vs training-time fp32: max relative error text %.2e, image %.2e" %
          (check["fp16_text_max_rel_err"], check["fp16_image_max_rel_err"]))
    assert max(check["fp16_text_max_rel_err"], check["fp16_image_max_rel_err"]) < 5e-3, check

    # ---- check 2: the adapter in plain numpy vs the torch module
    adapter = common.load_adapter(ad_dir)
    x = torch.cat([t16[:16], i16[:16]])
    with torch.no_grad():
        ref, _, ref_sel = adapter(x)
    npy, sel, gap = numpy_adapter(ad_dir, x.numpy())
    check["adapter_numpy_max_abs_err"] = float(np.abs(npy - ref.numpy()).max())
    check["adapter_numpy_same_experts"] = bool(np.array_equal(np.sort(sel, 1),
                                                              np.sort(ref_sel.numpy(), 1)))
    check["adapter_min_topk_gap"] = gap
    print("adapter: numpy vs torch max abs error %.2e, same experts %s (min top-k gap %.3g)" % (
        check["adapter_numpy_max_abs_err"], check["adapter_numpy_same_experts"], gap))
    assert check["adapter_numpy_max_abs_err"] < 1e-5 and check["adapter_numpy_same_experts"], check

    # ---- check 3 + reference: retrieval through the installed files
    with torch.no_grad():
        ta, ia = adapter(t16)[0], adapter(i16)[0]
    ref_rows = {}
    for key, (t, im) in (("zero-shot", (t16, i16)), ("moe", (ta, ia))):
        m = evaluate.retrieval(t, im, queries, ids)
        sims = torch.nn.functional.normalize(t, dim=-1) @ torch.nn.functional.normalize(im, dim=-1).t()
        top = torch.topk(sims, 10, dim=1)
        ref_rows[key] = {"metrics": m, "top10": {
            q["id"]: [[ids[j], round(float(s), 4)] for s, j in zip(top.values[n], top.indices[n])]
            for n, q in enumerate(queries)}}
        print("%-9s %s" % (key, evaluate.fmt(m)))
    expected = {}  # zero-shot from evaluate.py; the installed adapter from train_gate.py
    for key, path, pick in (("zero-shot", "results.json", lambda r: r["results"]["zero-shot"]),
                            ("moe", os.path.join("gate", "results.json"),
                             lambda r: r["single_modality"]["ship"])):
        if os.path.exists(os.path.join(args.runs, path)):
            with open(os.path.join(args.runs, path)) as fh:
                expected[key] = pick(json.load(fh))["shifted"]
    for key, a in expected.items():
        b = ref_rows[key]["metrics"]
        same = all(abs(a[k] - b[k]) < 1e-6 for k in ("R@1", "R@5", "R@10", "mAP"))
        check["same_as_results_json_" + key] = same
        assert same, (key, a, b)
    common.write_json(os.path.join(out, "python_reference.json"), {
        "about": ABOUT, "versions": common.versions(), **ref_rows, "hybrid": hybrid})
    common.write_json(os.path.join(args.runs, "export_check.json"), check)

    sizes = {}
    for root, _, files in os.walk(out):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                top_level = os.path.relpath(p, out).split(os.sep)[0]
                sizes[top_level] = sizes.get(top_level, 0) + os.path.getsize(p)
    for k in sorted(sizes):
        print("  %-24s %8.2f MB" % (k, sizes[k] / 1e6))
    print("  %-24s %8.2f MB" % ("total", sum(sizes.values()) / 1e6))


if __name__ == "__main__":
    main()
