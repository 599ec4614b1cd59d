#!/usr/bin/env python3
"""Train the adapter's cross-modal gate for hybrid (image + text) queries, and measure fusion.

    tools/train/train_gate.py --catalog build-train/catalog --runs build-train

A hybrid query is a source picture plus a modifier text ("in red", "as a large one"); the
catalog's composed-queries.jsonl pairs each with its target items (generate_catalog.py). The
query vector is adapter(fuse(image, text)) with the seeds' CrossModalGate,
w = softmax(W [image; text] + b), fuse = w_image * image + w_text * text, where image and text are
the frozen CLIP's projected embeddings as the engine's encoder gives them; the index holds
adapter(image embedding) of every item, as today.

The base CLIP stays frozen. Every variant below is trained with the multi-positive InfoNCE of the
fused query against all shifted-train items' index embeddings (the relevant ones are positives),
on the train queries with random training phrasings and a plain or flipped source view; each
variant's checkpoint (every --eval-every steps) is picked by val R@10 — when the experts change,
among those whose single-modality R@10 and mAP (below) stay within --tolerance — and test is
reported:

  image only / text only    adapter(image), adapter(text): today's single-modality queries
  average                   the gate-less fusion, w = (0.5, 0.5)
  fixed weight              w = (a, 1 - a), a tuned on val
  gate                      the 2-logit gate alone, shipped experts and router unchanged
  gate + experts            the gate and the adapter's experts and router trained jointly, with a
                            distillation penalty that keeps the adapter's output on
                            single-modality embeddings (shifted-train, base-train, base-wild
                            items and captions; with --pin-index also the index's images)
                            where the shipped adapter puts it (--rank-distill: also each
                            anchor's ranking of the index)
  concat router             the router reads [image; text] (a new [E, 2 * hidden] router
                            initialised as the shipped one on the average) instead of the fused
                            vector; experts still run on the fused vector (seeds' alternative)
  joint                     the gate plus J joint visual-text experts for fused inputs (the
                            seeds' joint expert; J from --joint-experts, picked by val with
                            --ship joint) and their router rows; the old experts and router rows
                            frozen. Only fused rows may route to them (MoeAdapter.router_logits),
                            so single-modality rows are adapted exactly as before (checked);
                            a router hinge puts a joint expert in each fused row's top k.
                            The baselines are measured through each joint adapter too: their
                            fused rows may use the joint experts as well.

Single-modality retrieval of each adapter that changes the experts is measured with
evaluate.py's path (queries.jsonl over shifted-test, queries-base.jsonl over base-test) against
the shipped adapter's. The summary compares the shipped variant with the best of image only,
text only and the fixed-weight sum through today's adapter and through the shipped one. Writes RUNS/gate/results.json and RUNS/gate/adapter/ (the adapter given by
--adapter plus the gate; its experts too with --ship gate+experts or joint, when that variant
kept a checkpoint within the single-modality bound).
"""

import argparse
import copy
import os
import time

import common  # first: pins the math libraries to one thread
from common import F, nn, np, torch
import evaluate

KS = (1, 10)


# ----------------------------------------------------------------------------- data


def load_composed(catalog_dir):
    rows = common.read_jsonl(os.path.join(catalog_dir, "composed-queries.jsonl"))
    for r in rows:
        r["abspath"] = os.path.join(catalog_dir, r["image"])
    return rows


def index_embeddings(model, proc, items):
    """Raw image embeddings of `items` (the index adapts them with the adapter being trained)."""
    return common.embed_pixels(model, common.load_pixels([it["abspath"] for it in items], proc))


def training_texts(rows, items_by_id):
    """Every training phrasing of each train query's change (the target's value)."""
    out = []
    for r in rows:
        value = items_by_id[r["relevant"][0]]["attributes"][r["attribute"]]
        out.append(common.catalog.modifier_phrasings(r["attribute"], value)[0])
    return out


def single_modality_anchors(model, tokens, proc, catalog_dir, rng, per_split=2000):
    """Raw single-modality embeddings whose adapter output the joint training must keep:
    images (plain, flipped) and training captions of shifted-train, base-train and base-wild."""
    parts = []
    for split in ("shifted-train", "base-train", "base-wild"):
        items = common.load_split(catalog_dir, split)
        if not items:
            continue
        pick = rng.permutation(len(items))[:per_split]
        items = [items[i] for i in pick]
        px = common.load_pixels([it["abspath"] for it in items], proc)
        parts += [common.embed_pixels(model, px), common.embed_pixels(model, px.flip(-1))]
        caps = [common.catalog.random_caption(it["attributes"], rng)[0] for it in items for _ in
                range(2)]
        parts.append(common.embed_texts(model, tokens, caps, engine=False))
    return torch.cat(parts)


# ---------------------------------------------------------------------------- models


class ConcatRouter(nn.Module):
    """Router on [image; text] for the fused vector's experts (the seeds' concatenation)."""

    def __init__(self, adapter):
        super().__init__()
        w = adapter.gate.weight.detach()
        self.weight = nn.Parameter(torch.cat([0.5 * w, 0.5 * w], dim=1))  # = router(average)

    def forward(self, image, text):
        return torch.cat([image, text], dim=-1) @ self.weight.t()


def with_joint_experts(base, n):
    """`base` plus `n` joint visual-text experts (the seeds' joint expert) and their router rows,
    which only fused hybrid rows can choose (MoeAdapter.router_logits); the old experts and router
    rows are kept as they are (their gradients are masked), so every other row is adapted exactly
    as by `base`."""
    E = base.num_experts
    ad = common.MoeAdapter(base.hidden, E + n, base.intermediate, base.top_k, joint_experts=n)
    with torch.no_grad():
        ad.gate.weight[:E] = base.gate.weight
        ad.gate.weight[E:] = 0
        for e in range(E):
            ad.experts[e].load_state_dict(base.experts[e].state_dict())
    for e in range(E):
        for p in ad.experts[e].parameters():
            p.requires_grad_(False)
    mask = torch.ones_like(ad.gate.weight)
    mask[:E] = 0
    ad.gate.weight.register_hook(lambda g: g * mask)
    return ad


def joint_routing_loss(adapter, fused, n_old, margin):
    """Hinge on the router logits of fused rows: a joint expert ahead of their second-best old
    one by `margin` (a joint expert outside every top-k would get no gradient)."""
    logits = fused @ adapter.gate.weight.t()
    second_old = torch.topk(logits[:, :n_old], 2, dim=-1).values[:, 1]
    best_new = logits[:, n_old:].max(dim=-1).values
    return F.relu(margin - (best_new - second_old)).mean()


@torch.no_grad()
def joint_selected(adapter, x, n_old, fused):
    """Rows of `x` whose top-k includes a joint expert."""
    return int((adapter.route(x, fused)[2] >= n_old).any(dim=-1).sum())


@torch.no_grad()
def single_modality_identity(adapter, base, rows):
    """(max |adapter(x) - base(x)|, rows whose selected experts differ) on single-modality rows:
    0 and 0 when the joint experts are masked off them as the contract says."""
    y, _, sel = adapter(rows)
    y0, _, sel0 = base(rows)
    same = (sel.sort(dim=-1).values == sel0.sort(dim=-1).values).all(dim=-1)
    return float((y - y0).abs().max()), int((~same).sum())


def adapter_on(adapter, x, router_logits=None):
    """normalize(x + MoE(x)) of fused rows `x` (joint experts allowed), with the router's logits
    replaced by `router_logits` if given."""
    if router_logits is None:
        return adapter(x, fused=True)[0]
    probs = torch.softmax(router_logits, dim=-1)
    w, sel = torch.topk(probs, adapter.top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    W1 = torch.stack([e.w1.weight for e in adapter.experts])
    W3 = torch.stack([e.w3.weight for e in adapter.experts])
    W2 = torch.stack([e.w2.weight for e in adapter.experts])
    h = F.silu(torch.einsum("bd,eid->bei", x, W1)) * torch.einsum("bd,eid->bei", x, W3)
    y = torch.einsum("bei,edi->bed", h, W2)
    comb = torch.zeros_like(probs).scatter(1, sel, w)
    return F.normalize(x + (comb.unsqueeze(-1) * y).sum(1), dim=-1)


def query_vectors(adapter, image, text, fixed=None, router=None):
    """The hybrid query: adapter(fuse(image, text)); `fixed` = w_image for a fixed-weight sum."""
    if fixed is not None:
        x = fixed * image + (1 - fixed) * text
    else:
        x = adapter.fuse(image, text)[0]
    return adapter_on(adapter, x, router(image, text) if router is not None else None)


# ---------------------------------------------------------------------------- metrics


def composed_metrics(q, bank, rows, ids):
    """R@1, R@10 and mAP@10 of queries `q` over index rows `bank` (both normalised)."""
    order = torch.argsort(q @ bank.t(), dim=1, descending=True)[:, :10].numpy()
    pos = {i: n for n, i in enumerate(ids)}
    hits = {k: [] for k in KS}
    aps = []
    for qi, r in enumerate(rows):
        rel = {pos[x] for x in r["relevant"]}
        top = [int(j) in rel for j in order[qi]]
        for k in KS:
            hits[k].append(any(top[:k]))
        prec = np.cumsum(top) / (np.arange(10) + 1)
        aps.append(float((prec * np.array(top)).sum() / min(len(rel), 10)))
    out = {"R@%d" % k: round(float(np.mean(hits[k])), 4) for k in KS}
    out["mAP@10"] = round(float(np.mean(aps)), 4)
    out["queries"] = len(rows)
    return out


def single_modality_raw(clip_dir, catalog_dir, cache):
    """evaluate.py's text queries and index items as raw CLIP embeddings (adapter applied later)."""
    out = {}
    for name, split, qfile in (("shifted", "shifted-test", "queries.jsonl"),
                               ("base", "base-test", "queries-base.jsonl")):
        items = common.load_split(catalog_dir, split)
        queries = common.read_jsonl(os.path.join(catalog_dir, qfile))
        t, im = evaluate.embed_split(clip_dir, None, [q["text"] for q in queries],
                                     [it["abspath"] for it in items], cache)
        out[name] = (t, im, queries, [it["id"] for it in items])
    return out


@torch.no_grad()
def single_modality_fast(adapter, raw):
    """single_modality's numbers from single_modality_raw's embeddings (for checkpoints)."""
    out = {}
    for name, (t, im, queries, ids) in raw.items():
        r = evaluate.retrieval(adapter(t)[0], adapter(im)[0], queries, ids)
        out[name] = {k: r[k] for k in ("R@1", "R@5", "R@10", "mAP")}
    return out


def within(single, ref, tol):
    return all(abs(single[s][k] - ref[s][k]) <= tol or single[s][k] > ref[s][k]
               for s in ref for k in ("R@10", "mAP"))


def single_modality(clip_dir, adapter_dir, catalog_dir, cache):
    """evaluate.py's numbers of one adapter directory: shifted and base text->image retrieval."""
    out = {}
    for name, split, qfile in (("shifted", "shifted-test", "queries.jsonl"),
                               ("base", "base-test", "queries-base.jsonl")):
        items = common.load_split(catalog_dir, split)
        queries = common.read_jsonl(os.path.join(catalog_dir, qfile))
        t, im = evaluate.embed_split(clip_dir, adapter_dir, [q["text"] for q in queries],
                                     [it["abspath"] for it in items], cache)
        r = evaluate.retrieval(t, im, queries, [it["id"] for it in items])
        out[name] = {k: r[k] for k in ("R@1", "R@5", "R@10", "mAP")}
    return out


# ---------------------------------------------------------------------------- training


def info_nce(q, bank, pos_mask, log_scale):
    logits = log_scale.exp() * q @ bank.t()
    m = pos_mask.float()
    return -(m / m.sum(1, keepdim=True) * F.log_softmax(logits, dim=1)).sum(1).mean()


def train_variant(name, base, data, args, train_experts=False, concat_router=False, joint=0,
                  evaluate_fn=None):
    """Trains one fusion variant on a copy of `base`; returns (adapter, router, log)."""
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if joint:
        adapter = with_joint_experts(base, joint)
        train_experts = True
    else:
        adapter = copy.deepcopy(base)
        for p in adapter.parameters():
            p.requires_grad_(train_experts)
    adapter.add_cross_modal_gate()
    router = ConcatRouter(base) if concat_router else None
    fusion = list(adapter.cross_modal_gate.parameters()) + \
        ([] if router is None else list(router.parameters()))
    log_scale = nn.Parameter(torch.tensor(float(np.log(args.scale))))
    groups = [{"params": fusion + [log_scale], "lr": args.lr}]
    if train_experts:
        groups.append({"params": [p for n, p in adapter.named_parameters()
                                  if p.requires_grad and not n.startswith("cross_modal_gate")],
                       "lr": args.expert_lr})
    opt = torch.optim.Adam(groups)
    base_lrs = [g["lr"] for g in opt.param_groups]
    src, texts_emb, text_index, pos_mask, train_bank_raw, anchors, anchors_ref = (
        data["src"], data["txt"], data["txt_index"], data["pos"], data["bank_raw"],
        data["anchors"], data["anchors_ref"])
    with torch.no_grad():
        bank_fixed = base(train_bank_raw)[0]
    n = pos_mask.shape[0]
    log, best, best_state = [], None, None
    t0 = time.time()
    for step in range(args.steps):
        scale = common.lr_at(step, args.steps, 1.0, args.warmup)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * scale
        idx = rng.choice(n, args.batch, replace=False)
        view = rng.integers(src.shape[1], size=args.batch)
        image = src[idx, view]
        choice = [text_index[i][int(rng.integers(len(text_index[i])))] for i in idx]
        text = texts_emb[choice]
        q = query_vectors(adapter, image, text, router=router)
        bank = adapter(train_bank_raw)[0] if train_experts and not joint else bank_fixed
        loss = info_nce(q, bank, pos_mask[idx], log_scale)
        total = loss
        if joint:  # single-modality rows never reach the joint experts: nothing to distill
            distill = joint_routing_loss(adapter, adapter.fuse(image, text)[0], base.num_experts,
                                         args.margin)
            total = total + args.route_weight * distill
        elif train_experts:
            a = rng.choice(anchors.shape[0], args.anchor_batch, replace=False)
            distill = (adapter(anchors[a])[0] - anchors_ref[a]).pow(2).sum(-1).mean()
            if args.pin_index or args.rank_distill:
                index_new = adapter(data["index_raw"])[0]
            if args.pin_index:
                distill = distill + (index_new - data["index_ref"]).pow(2).sum(-1).mean()
            total = total + args.distill * distill
            if args.rank_distill:  # keep each anchor's ranking of the index (listwise KL)
                ref = F.log_softmax(args.rank_scale * anchors_ref[a] @ data["index_ref"].t(), dim=1)
                new = F.log_softmax(args.rank_scale * adapter(anchors[a])[0] @ index_new.t(), dim=1)
                total = total + args.rank_distill * F.kl_div(new, ref, log_target=True,
                                                             reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        with torch.no_grad():
            log_scale.clamp_(0, np.log(100))
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            adapter.eval()
            val = evaluate_fn(adapter, router, "val")
            rec = {"step": step + 1, "loss": round(loss.item(), 4), "val": val,
                   "wall_s": round(time.time() - t0, 1)}
            ok = True
            if train_experts:
                rec["distill"] = round(distill.item(), 5)
                rec["single"] = single_modality_fast(adapter, data["single_raw"])
                ok = within(rec["single"], data["single_ref"], args.tolerance)
                rec["single_within_tolerance"] = ok
            if joint:
                single_rows = torch.cat([anchors, train_bank_raw] + [
                    torch.cat([t, im]) for t, im, _, _ in data["single_raw"].values()])
                rec["single_rows_on_new_experts"] = joint_selected(adapter, single_rows,
                                                                   base.num_experts, False)
                rec["fused_val_rows_on_new_experts"] = joint_selected(
                    adapter, adapter.fuse(*data["val_emb"])[0], base.num_experts, True)
            log.append(rec)
            print("%-16s step %5d  loss %.4f  val R@1 %.3f R@10 %.3f mAP@10 %.3f%s" % (
                name, step + 1, loss.item(), val["R@1"], val["R@10"], val["mAP@10"],
                "  distill %.2e  single shifted R@10 %.3f mAP %.3f base R@10 %.3f mAP %.3f%s" % (
                    distill.item(), rec["single"]["shifted"]["R@10"],
                    rec["single"]["shifted"]["mAP"], rec["single"]["base"]["R@10"],
                    rec["single"]["base"]["mAP"], "" if ok else " (out of bounds)")
                if train_experts else ""), flush=True)
            if joint:
                print("%-16s single-modality rows on joint experts: %d of %d; fused val rows: %d" % (
                    name, rec["single_rows_on_new_experts"], single_rows.shape[0],
                    rec["fused_val_rows_on_new_experts"]), flush=True)
            key = (val["R@10"], val["mAP@10"])
            if ok and (best is None or key > best):
                best = key
                best_state = (copy.deepcopy(adapter.state_dict()),
                              None if router is None else copy.deepcopy(router.state_dict()))
    if best_state is None:  # no checkpoint kept single-modality retrieval within bounds
        return None, None, log
    adapter.load_state_dict(best_state[0])
    if router is not None:
        router.load_state_dict(best_state[1])
    for p in adapter.parameters():
        p.requires_grad_(False)
    return adapter.eval(), router, log


# ---------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", default="build-train/catalog")
    ap.add_argument("--runs", default="build-train")
    ap.add_argument("--clip", default=None, help="CLIP directory (default RUNS/base/clip)")
    ap.add_argument("--adapter", default=None, help="adapter directory (default RUNS/moe/adapter)")
    ap.add_argument("--out", default=None, help="output directory (default RUNS/gate)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2, help="gate (and concat router) learning rate")
    ap.add_argument("--expert-lr", type=float, default=5e-4, help="experts + router learning rate")
    ap.add_argument("--scale", type=float, default=30.0, help="initial InfoNCE logit scale")
    ap.add_argument("--distill", type=float, default=1000.0,
                    help="weight of the single-modality distillation penalty (joint training)")
    ap.add_argument("--anchor-batch", type=int, default=512)
    ap.add_argument("--rank-distill", type=float, default=0.0,
                    help="joint training: weight of a listwise KL that keeps each anchor's "
                         "ranking of the index items (softmax of --rank-scale x cosine)")
    ap.add_argument("--rank-scale", type=float, default=50.0)
    ap.add_argument("--pin-index", type=int, default=1,
                    help="joint training: 1 = the distillation also keeps the index items' "
                         "(shifted-test images') embeddings where the shipped adapter puts them")
    ap.add_argument("--tolerance", type=float, default=0.005,
                    help="joint training keeps only checkpoints whose single-modality R@10 and mAP "
                         "(shifted and base) are at most this much below the shipped adapter's")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--embed-cache", default="",
                    help="file to keep the frozen CLIP embeddings in between runs")
    ap.add_argument("--variants", default="gate,concat,gate+experts,joint",
                    help="trained variants to run (gate, gate+experts, concat, concat+experts, "
                         "joint); gate always runs")
    ap.add_argument("--joint-experts", default="1,2",
                    help="joint variant: numbers of joint experts to try (comma-separated; "
                         "--ship joint picks one by val)")
    ap.add_argument("--margin", type=float, default=1.0,
                    help="joint variant: router logit margin of a joint expert over a fused "
                         "row's second-best old expert")
    ap.add_argument("--route-weight", type=float, default=1.0,
                    help="joint variant: weight of the routing hinge")
    ap.add_argument("--ship", default="joint", choices=("gate", "gate+experts", "joint"),
                    help="the variant written to OUT/adapter")
    args = ap.parse_args()
    clip_dir = args.clip or os.path.join(args.runs, "base", "clip")
    adapter_dir = args.adapter or os.path.join(args.runs, "moe", "adapter")
    out = args.out or os.path.join(args.runs, "gate")
    t_start = time.time()

    model = common.load_clip(clip_dir)
    tokens = common.Tokens(clip_dir)
    proc = common.CLIPImageProcessor.from_pretrained(clip_dir)
    # Train from the single-modality experts alone (the shipped adapter's joint experts and gate
    # are what this makes anew).
    base = common.without_joint_experts(common.load_adapter(adapter_dir))
    for p in base.parameters():
        p.requires_grad_(False)

    rows = load_composed(args.catalog)
    train_rows = [r for r in rows if r["split"] == "train"]
    held = {s: [r for r in rows if r["split"] == s] for s in ("val", "test")}
    train_items = common.load_split(args.catalog, "shifted-train")
    test_items = common.load_split(args.catalog, "shifted-test")
    by_id = {it["id"]: it for it in train_items}
    train_ids = [it["id"] for it in train_items]
    test_ids = [it["id"] for it in test_items]

    # ---- frozen embeddings (kept in --embed-cache, if given, for re-runs with other settings)
    if args.embed_cache and os.path.exists(args.embed_cache):
        c = torch.load(args.embed_cache)
        assert c["key"] == [os.path.realpath(p) for p in (clip_dir, args.catalog)], c["key"]
        src, vocab, txt_emb, bank_raw, test_bank_raw, held_emb, anchors = (
            c[k] for k in ("src", "vocab", "txt", "bank", "test_bank", "held", "anchors"))
    else:
        t0 = time.time()
        train_px = common.load_pixels([r["abspath"] for r in train_rows], proc)
        src = torch.stack([common.embed_pixels(model, train_px),
                           common.embed_pixels(model, train_px.flip(-1))], 1)  # [N, views, D]
        vocab = sorted({t for v in training_texts(train_rows, by_id) for t in v})
        txt_emb = common.embed_texts(model, tokens, vocab)  # engine tokenization (padded to 77)
        bank_raw = index_embeddings(model, proc, train_items)
        test_bank_raw = index_embeddings(model, proc, test_items)
        held_emb = {}
        for s, rs in held.items():
            im = common.embed_pixels(model, common.load_pixels([r["abspath"] for r in rs], proc))
            tx = common.embed_texts(model, tokens, [r["text"] for r in rs])
            held_emb[s] = (im, tx)
        anchors = single_modality_anchors(model, tokens, proc, args.catalog,
                                          np.random.default_rng([args.seed, 7]))
        print("embedded %d train sources (2 views), %d phrasings, %d + %d index items, %d anchors "
              "in %.0fs" % (len(train_rows), len(vocab), len(train_items), len(test_items),
                            anchors.shape[0], time.time() - t0), flush=True)
        if args.embed_cache:
            torch.save({"key": [os.path.realpath(p) for p in (clip_dir, args.catalog)],
                        "src": src, "vocab": vocab, "txt": txt_emb, "bank": bank_raw,
                        "test_bank": test_bank_raw, "held": held_emb, "anchors": anchors},
                       args.embed_cache)
    slot = {t: i for i, t in enumerate(vocab)}
    txt_index = [[slot[t] for t in v] for v in training_texts(train_rows, by_id)]
    pos = torch.zeros(len(train_rows), len(train_ids), dtype=torch.bool)
    col = {i: n for n, i in enumerate(train_ids)}
    for n, r in enumerate(train_rows):
        pos[n, [col[x] for x in r["relevant"]]] = True
    with torch.no_grad():
        anchors_ref = base(anchors)[0]
    norms = {"image": round(float(src[:, 0].norm(dim=-1).mean()), 3),
             "text": round(float(txt_emb.norm(dim=-1).mean()), 3)}
    print("mean |image| %.3f, |text| %.3f (projected, as the encoder gives them)" % (
        norms["image"], norms["text"]), flush=True)
    sm_cache = {}
    single_raw = single_modality_raw(clip_dir, args.catalog, sm_cache)
    data = {"src": src, "txt": txt_emb, "txt_index": txt_index, "pos": pos, "bank_raw": bank_raw,
            "anchors": anchors, "anchors_ref": anchors_ref, "single_raw": single_raw,
            "single_ref": single_modality_fast(base, single_raw), "val_emb": held_emb["val"],
            "index_raw": test_bank_raw}
    with torch.no_grad():
        data["index_ref"] = base(test_bank_raw)[0]

    @torch.no_grad()
    def held_out(adapter, split, fixed=None, router=None, mode="fused"):
        """(query vectors of `split`'s composed queries, the index) for one query mode."""
        im, tx = held_emb[split]
        if mode == "image":
            q = adapter(im)[0]
        elif mode == "text":
            q = adapter(tx)[0]
        elif mode == "average-normalised":
            q = adapter(0.5 * (F.normalize(im, dim=-1) + F.normalize(tx, dim=-1)), fused=True)[0]
        else:
            q = query_vectors(adapter, im, tx, fixed=fixed, router=router)
        return q, adapter(test_bank_raw)[0]

    def measure(adapter, split, **kw):
        return composed_metrics(*held_out(adapter, split, **kw), held[split], test_ids)

    def subsets(adapter, **kw):
        """test metrics per changed attribute and per phrasing (seen / held-out)."""
        q, bank = held_out(adapter, "test", **kw)
        out = {}
        for key in ("attribute", "phrasing"):
            for v in sorted({r[key] for r in held["test"]}):
                sel = [n for n, r in enumerate(held["test"]) if r[key] == v]
                out[v] = composed_metrics(q[sel], bank, [held["test"][n] for n in sel], test_ids)
        return out

    results = {}

    def record(key, label, adapter, **kw):
        results[key] = {"label": label, "val": measure(adapter, "val", **kw),
                        "test": measure(adapter, "test", **kw)}
        r = results[key]
        print("%-34s val R@10 %.3f | test R@1 %.3f R@10 %.3f mAP@10 %.3f" % (
            label, r["val"]["R@10"], r["test"]["R@1"], r["test"]["R@10"], r["test"]["mAP@10"]),
            flush=True)

    used = {}  # results key -> (adapter, router, mode, fixed) it was measured with

    def baselines(adapter, suffix="", through=""):
        """image only, text only, the plain averages and the val-tuned fixed-weight sum, every
        fused one routed as a hybrid query (joint experts allowed) through `adapter`."""
        for key, label, mode, fixed in (
                ("image", "image only", "image", None), ("text", "text only", "text", None),
                ("average", "plain average (w = 0.5, 0.5)", "fused", 0.5),
                ("average-normalised", "plain average of normalised", "average-normalised", None)):
            record(key + suffix, label + through, adapter, mode=mode, fixed=fixed)
            used[key + suffix] = (adapter, None, mode, fixed)
        grid = [round(a, 2) for a in np.arange(0.0, 1.0001, 0.05)]
        val_grid = {a: measure(adapter, "val", fixed=a) for a in grid}
        best_a = max(grid, key=lambda a: (val_grid[a]["R@10"], val_grid[a]["mAP@10"]))
        key = "fixed" + suffix
        record(key, "fixed weight (w_image = %.2f, tuned on val)%s" % (best_a, through), adapter,
               fixed=best_a)
        results[key]["w_image"] = best_a
        results[key]["val_grid"] = {str(a): val_grid[a]["R@10"] for a in grid}
        used[key] = (adapter, None, "fused", best_a)

    baselines(base)

    trained = {}
    specs = {"gate": ("learned gate (2 logits)", False, False, 0),
             "gate+experts": ("gate + experts, router trained jointly", True, False, 0),
             "concat": ("gate + concat router", False, True, 0),
             "concat+experts": ("gate + concat router + experts", True, True, 0)}
    joint_keys = []
    for j in (int(v) for v in args.joint_experts.split(",")):
        joint_keys.append("joint-%d" % j)
        specs[joint_keys[-1]] = ("gate + %d joint expert%s" % (j, "s" if j > 1 else ""), True,
                                 False, j)
    variants = ["gate"]  # the fallback
    for v in args.variants.split(","):
        variants += joint_keys if v == "joint" else [] if v == "gate" else [v]
    single_rows = torch.cat([anchors, bank_raw, test_bank_raw] + [
        torch.cat([t, im]) for t, im, _, _ in single_raw.values()])
    identity = {}
    for key in variants:
        label, experts, concat, joint = specs[key]
        ad, router, log = train_variant(
            key, base, data, args, train_experts=experts, concat_router=concat, joint=joint,
            evaluate_fn=lambda a, r, s: measure(a, s, router=r))
        if ad is None:
            print("%s: no checkpoint within the single-modality tolerance" % key)
            results[key] = {"label": label, "log": log, "within_tolerance": False}
            continue
        trained[key] = (ad, router)
        record(key, label, ad, router=router)
        used[key] = (ad, router, "fused", None)
        results[key]["log"] = log
        with torch.no_grad():
            w = ad.fuse(*held_emb["test"])[1]
        results[key]["test_mean_w_image"] = round(float(w[:, 0].mean()), 3)
        results[key]["test_w_image_range"] = [round(float(w[:, 0].min()), 3),
                                              round(float(w[:, 0].max()), 3)]
        if joint:
            err, moved = single_modality_identity(ad, base, single_rows)
            identity[key] = {"rows": single_rows.shape[0], "max_abs_diff": err,
                             "rows_with_other_experts": moved}
            print("%s: single-modality rows vs the shipped adapter: max |diff| %.3g, %d of %d "
                  "rows with other experts" % (key, err, moved, single_rows.shape[0]), flush=True)
            baselines(ad, "@" + key, ", through " + key)

    # ---- per attribute / phrasing on test
    for key, (ad, router, mode, fixed) in used.items():
        results[key]["test_subsets"] = subsets(ad, router=router, mode=mode, fixed=fixed)

    # ---- write the shipped variant; single-modality check of every adapter that changed experts
    common.fresh_dir(out)
    if args.ship == "joint":  # the number of joint experts: by val
        kept = [k for k in joint_keys if k in trained]
        args.ship = max(kept, default="joint",
                        key=lambda k: (results[k]["val"]["R@10"], results[k]["val"]["mAP@10"]))
    if args.ship not in trained:
        print("%s kept no checkpoint within bounds: shipping the gate alone" % args.ship)
        args.ship = "gate"
    ship = trained[args.ship][0]
    common.save_adapter_dir(ship, os.path.join(out, "adapter"),
                            {"base_model": "models/default/clip",
                             "generator": "tools/train/train_gate.py",
                             "cross_modal_gate": "trained on composed queries (%s)" % args.ship})
    cache = sm_cache
    single = {"shipped": single_modality(clip_dir, adapter_dir, args.catalog, cache)}
    for key in trained:
        if specs[key][1]:
            d = os.path.join(out, "candidates", key)
            common.save_adapter_dir(trained[key][0], d)
            single[key] = single_modality(clip_dir, d, args.catalog, cache)
    single["ship"] = single_modality(clip_dir, os.path.join(out, "adapter"), args.catalog, cache)
    for key, r in single.items():
        print("single-modality %-16s shifted R@10 %.3f mAP %.3f | base R@10 %.3f mAP %.3f" % (
            key, r["shifted"]["R@10"], r["shifted"]["mAP"], r["base"]["R@10"], r["base"]["mAP"]))

    # The target: the shipped fusion against the best single-modality or fixed-weight query,
    # measured through today's adapter and through the shipped one (same for the gate alone).
    suffix = "@" + args.ship if "fixed@" + args.ship in results else ""
    summary = {"ship": args.ship, "target_gain": 0.05}
    for name, suf in (("todays_adapter", ""), ("shipped_adapter", suffix)):
        for split in ("val", "test"):
            best = max(results[k + suf][split]["R@10"] for k in ("image", "text", "fixed"))
            summary["%s_best_baseline_%s_R@10" % (name, split)] = best
            summary["%s_gain_%s_R@10" % (name, split)] = round(
                results[args.ship][split]["R@10"] - best, 4)
    summary["target_met"] = all(summary["%s_gain_%s_R@10" % (n, s)] >= 0.05 - 1e-9
                                for n in ("todays_adapter", "shipped_adapter")
                                for s in ("val", "test"))
    common.write_json(os.path.join(out, "results.json"), {
        "catalog": args.catalog, "clip": clip_dir, "adapter": adapter_dir, "args": vars(args),
        "versions": common.versions(), "embedding_norms": norms, "composed": results,
        "single_modality": single, "joint_single_modality_identity": identity,
        "summary": summary, "total_wall_s": round(time.time() - t_start, 1)})
    print()
    print(markdown(results, single))
    print(summary)


def markdown(results, single):
    lines = ["| query vector | val R@10 | test R@1 | test R@10 | test mAP@10 |",
             "|---|---:|---:|---:|---:|"]
    for key, r in results.items():
        if "test" not in r:
            lines.append("| %s | no checkpoint within the single-modality bound | | | |" % r["label"])
            continue
        t = r["test"]
        lines.append("| %s | %.3f | %.3f | %.3f | %.3f |" % (r["label"], r["val"]["R@10"], t["R@1"],
                                                           t["R@10"], t["mAP@10"]))
    lines += ["", "| adapter | shifted R@10 | shifted mAP | base R@10 | base mAP |",
              "|---|---:|---:|---:|---:|"]
    for key, r in single.items():
        lines.append("| %s | %.3f | %.3f | %.3f | %.3f |" % (
            key, r["shifted"]["R@10"], r["shifted"]["mAP"], r["base"]["R@10"], r["base"]["mAP"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
