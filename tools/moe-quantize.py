#!/usr/bin/env python3
"""moe-quantize: write a gst-moe adapter with 4-bit experts (W4A16, compressed-tensors pack-quantized).

    .venv-int4/bin/python tools/moe-quantize.py ADAPTER_DIR OUT_DIR \\
        (--calibration EMB.safetensors | --calibration-catalog CATALOG_DIR --clip CLIP_DIR) \\
        [--calibration-composed COMPOSED.jsonl] [--method awq|rtn] [--group-size 128] [--asymmetric] [--scale-dtype f16|bf16]

ADAPTER_DIR holds adapter_config.json + adapter.safetensors (docs/model-formats.md). The router
(`gate`), the shared-expert gate and the cross-modal gate (`cross_modal_gate.*`, hybrid queries)
stay f32 and are never quantised; every expert matrix (and the shared expert's) becomes 4-bit with one scale (and zero point) per row and group of input columns.
OUT_DIR receives adapter.safetensors in compressed-tensors' pack-quantized layout and
adapter_config.json with its `quantization_config`, both written by the package (ModelCompressor).

--calibration: a safetensors file whose tensor `embeddings` [N, hidden] holds adapter inputs (the
projected, unnormalised CLIP embeddings of the catalog). Each expert sees the rows the router
sends it.
--calibration-catalog with --clip: computes those inputs itself with the reference implementation,
transformers' CLIPModel (get_image_features / get_text_features) of the CLIP directory on the
catalog's images and then its captions (catalog.jsonl: `path`, `caption`), preprocessed as the
directory's preprocessor_config.json and tokenizer say — what moe-encode feeds moe-route.
--calibration-composed (with --clip): hybrid queries (composed-queries.jsonl: `image` relative to
the file's folder, `text`; its "val" lines when it has any), fused by the adapter's cross-modal
gate as the engine fuses them. An adapter with `joint_experts` J routes only these fused rows
among all experts; every other row never reaches the last J (router logit -inf). The J joint
experts are calibrated on the fused rows, the others on the single-modality rows the router sends
them (so their 4-bit weights do not depend on the joint experts); without fused rows a joint
expert is calibrated on every row.

Methods:
* rtn: round to nearest, scales from each group's min/max (the package's calculate_qparams).
* awq: activation-aware, as AWQ (Lin et al., 2024) within what the adapter allows.
  - w2 (down): a per-input-channel scale s = mean|h|^alpha of its input h = silu(w1 x)·(w3 x),
    alpha searched on a grid for the smallest output error; w2·diag(s) is quantised and 1/s is
    folded exactly into w3's rows (silu(g)·(u/s) = h/s), so the layer computes the same function.
  - w1, w3 (gate, up): their input x is shared with the router and the other experts, so no scale
    can be folded there; AWQ's clipping search runs instead: per row, the group range is shrunk by
    the ratio (1.0 .. 0.5) that minimises that row's output error on the expert's rows.
Prints, on the calibration rows, for RTN and for the chosen method, the MoE term's relative error
||y_q - y|| / ||y|| and the mean distance between the adapted unit embeddings normalize(x + y_q)
and normalize(x + y) (routing is unchanged: the router is not quantised and sees the same input).
"""

import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import compressed_tensors
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_canonical  # noqa: E402

ALPHAS = [i / 10 for i in range(11)]
CLIP_RATIOS = [1.0 - i / 20 for i in range(11)]  # 1.0, 0.95, ..., 0.5


class Adapter(torch.nn.Module):
    """The adapter's module tree with its own tensor names (no prefix)."""

    def __init__(self, cfg, state, names):
        super().__init__()
        d, e, inter = cfg["hidden_size"], cfg["num_experts"], cfg["intermediate_size"]
        self.gate = torch.nn.Linear(d, e, bias=False)
        self.experts = torch.nn.ModuleList(self._swiglu(names, d, inter) for _ in range(e))
        shared = cfg.get("shared_expert_intermediate_size", 0)
        if shared:
            self.shared_expert = self._swiglu(("gate_proj", "up_proj", "down_proj"), d, shared)
            self.shared_expert_gate = torch.nn.Linear(d, 1, bias=False)
        self.load_state_dict(state)

    @staticmethod
    def _swiglu(names, d, inter):
        m = torch.nn.Module()
        gate, up, down = names
        setattr(m, gate, torch.nn.Linear(d, inter, bias=False))
        setattr(m, up, torch.nn.Linear(d, inter, bias=False))
        setattr(m, down, torch.nn.Linear(inter, d, bias=False))
        m.names = names
        return m


def matrices(expert):
    return [getattr(expert, n) for n in expert.names]


def swiglu(expert, x, weights=None):
    w1, w3, w2 = weights if weights is not None else [m.weight for m in matrices(expert)]
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def qparams(w, args, ratio=1.0):
    """The package's scale and zero point per row and group, of the range shrunk by `ratio`."""
    g = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
    return calculate_qparams(g.amin(dim=-1) * ratio, g.amax(dim=-1) * ratio, args)


def fake(w, scale, zero_point, args):
    return fake_quantize(w, scale, zero_point, args)


def search_clip(w, x, args):
    """Per row, the clip ratio with the smallest output error on x; returns (scale, zero_point)."""
    best_err = None
    reference = x @ w.float().t()
    for ratio in CLIP_RATIOS:
        scale, zp = qparams(w, args, ratio)
        err = ((x @ fake(w, scale, zp, args).float().t() - reference) ** 2).sum(dim=0)  # per row
        if best_err is None:
            best_err, best_scale, best_zp = err, scale.clone(), zp.clone()
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale[better] = scale[better]
            best_zp[better] = zp[better]
    return best_scale, best_zp


def awq_expert(expert, x, args, dtype):
    """Folds the searched w2 scale into w3 and w2; returns {module: (scale, zero_point)}."""
    w1, w3, w2 = [m.weight.data for m in matrices(expert)]
    xf = x.float()
    h = F.silu(xf @ w1.float().t()) * (xf @ w3.float().t())
    reference = h @ w2.float().t()
    magnitude = h.abs().mean(dim=0).clamp(min=1e-8)
    best = None
    for alpha in ALPHAS:
        s = magnitude.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1: the scaled weights keep their range
        w2s = (w2.float() * s).to(dtype)
        scale, zp = qparams(w2s, args)
        err = ((h / s) @ fake(w2s, scale, zp, args).float().t() - reference).pow(2).sum().item()
        if best is None or err < best[0]:
            best = (err, s)
    s = best[1]
    mods = matrices(expert)
    mods[2].weight.data = (w2.float() * s).to(dtype)
    mods[1].weight.data = (w3.float() / s[:, None]).to(dtype)
    out = {}
    for m in mods[:2]:
        out[m] = search_clip(m.weight.data, xf, args)
    out[mods[2]] = qparams(mods[2].weight.data, args)
    return out


def route(model, x, top_k, renormalize, joint=0, fused=None):
    """(expert ids, weights) per row; rows not marked in `fused` never reach the last `joint`."""
    logits = x @ model.gate.weight.float().t()
    if joint:
        logits[~fused, logits.shape[1] - joint:] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def layer_output(model, x, ids, weights, quantized=None):
    """Σ_k w_k · expert_k(x) (+ gated shared expert); `quantized` maps modules to fake-quantised weights."""
    def w(expert):
        return [quantized[m].float() if quantized else m.weight.float() for m in matrices(expert)]

    y = torch.zeros_like(x)
    for e, expert in enumerate(model.experts):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if len(rows):
            y[rows] += weights[rows, slot, None] * swiglu(expert, x[rows], w(expert))
    if hasattr(model, "shared_expert"):
        g = torch.sigmoid(x @ model.shared_expert_gate.weight.float().t())
        y += g * swiglu(model.shared_expert, x, w(model.shared_expert))
    return y


def quantized_modules(model):
    experts = list(model.experts) + ([model.shared_expert] if hasattr(model, "shared_expert") else [])
    return experts, [m for e in experts for m in matrices(e)]


class Clip:
    """transformers' CLIPModel of a CLIP directory: projected, unnormalised embeddings in f32."""

    def __init__(self, clip_dir):
        from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

        self.model = CLIPModel.from_pretrained(clip_dir, torch_dtype=torch.float32).eval()
        self.processor = CLIPImageProcessor.from_pretrained(clip_dir)
        self.tokenizer = CLIPTokenizer.from_pretrained(clip_dir)

    @torch.no_grad()
    def images(self, paths, chunk=64):
        from PIL import Image

        out = []
        for i in range(0, len(paths), chunk):
            images = []
            for p in paths[i:i + chunk]:
                with Image.open(p) as im:
                    images.append(im.convert("RGB"))
            pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
            out.append(self.model.get_image_features(pixel_values=pixels))
        return torch.cat(out).float()

    @torch.no_grad()
    def texts(self, texts, chunk=64):
        out = []
        for i in range(0, len(texts), chunk):
            tokens = self.tokenizer(texts[i:i + chunk], truncation=True, max_length=77, padding="max_length",
                                    return_tensors="pt")
            out.append(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                    attention_mask=tokens["attention_mask"]))
        return torch.cat(out).float()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def catalog_embeddings(catalog_dir, clip):
    """[images; captions] of a catalog."""
    items = read_jsonl(os.path.join(catalog_dir, "catalog.jsonl"))
    return torch.cat([clip.images([os.path.join(catalog_dir, it["path"]) for it in items]),
                      clip.texts([it["caption"] for it in items])])


def composed_embeddings(path, clip, carried):
    """The fused hybrid queries of a composed-queries.jsonl ("val" lines if any): w_image · image +
    w_text · text, w = softmax(W [image; text] + b) of the cross-modal gate (0.5, 0.5 without one)."""
    rows = read_jsonl(path)
    rows = [r for r in rows if r.get("split") == "val"] or rows
    folder = os.path.dirname(os.path.abspath(path))
    image = clip.images([os.path.join(folder, r["image"]) for r in rows])
    text = clip.texts([r["text"] for r in rows])
    if "cross_modal_gate.weight" in carried:
        logits = torch.cat([image, text], dim=1) @ carried["cross_modal_gate.weight"].t() + \
            carried["cross_modal_gate.bias"]
        w = torch.softmax(logits, dim=-1)
    else:
        w = torch.full((len(rows), 2), 0.5)
    return w[:, :1] * image + w[:, 1:] * text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("adapter")
    p.add_argument("out")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--calibration", help="safetensors file with `embeddings` [N, hidden]")
    inputs.add_argument("--calibration-catalog", help="catalog directory (catalog.jsonl + images); needs --clip")
    p.add_argument("--calibration-composed", help="composed-queries.jsonl: fused hybrid calibration rows; needs --clip")
    p.add_argument("--clip", help="the CLIP directory whose embeddings the adapter adapts")
    p.add_argument("--method", choices=["awq", "rtn"], default="awq")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asymmetric", action="store_true")
    p.add_argument("--scale-dtype", choices=["f16", "bf16"], default="f16")
    a = p.parse_args()
    if (a.calibration_catalog or a.calibration_composed) and not a.clip:
        p.error("--calibration-catalog and --calibration-composed need --clip")

    with open(os.path.join(a.adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(a.adapter, "adapter.safetensors"))
    # The cross-modal gate weighs image and text before the layer: not part of it, copied as is.
    carried = {k: state.pop(k).float() for k in sorted(state) if k.startswith("cross_modal_gate.")}
    names = ("w1", "w3", "w2") if "experts.0.w1.weight" in state else ("gate_proj", "up_proj", "down_proj")
    model = Adapter(cfg, {k: v.float() for k, v in state.items()}, names)
    clip = Clip(a.clip) if a.clip else None
    if a.calibration:
        x, source = load_file(a.calibration)["embeddings"].float(), a.calibration
    else:
        x, source = catalog_embeddings(a.calibration_catalog, clip), a.calibration_catalog
    if x.ndim != 2 or x.shape[1] != cfg["hidden_size"]:
        sys.exit(f"{source}: the embeddings must be [N, {cfg['hidden_size']}], not {list(x.shape)}")
    fused = torch.zeros(len(x), dtype=torch.bool)
    if a.calibration_composed:
        hybrid = composed_embeddings(a.calibration_composed, clip, carried)
        x = torch.cat([x, hybrid])
        fused = torch.cat([fused, torch.ones(len(hybrid), dtype=torch.bool)])
    joint = cfg.get("joint_experts", 0)
    dtype = torch.float16 if a.scale_dtype == "f16" else torch.bfloat16
    args = QuantizationArgs(num_bits=4, type="int", symmetric=not a.asymmetric, strategy="group",
                            group_size=a.group_size)
    renormalize = cfg.get("norm_topk_prob", cfg.get("routing", "mixtral") == "mixtral")
    ids, weights = route(model, x, cfg["top_k"], renormalize, joint, fused)
    reference = layer_output(model, x, ids, weights)

    # The expert matrices in the scale's dtype (the package computes scales in the weight's dtype);
    # the router and the shared-expert gate stay f32.
    experts, mods = quantized_modules(model)
    for m in mods:
        m.weight.data = m.weight.data.to(dtype)
    def error(params):
        """(||y_q - y|| / ||y|| of the MoE term, mean ||a_q - a|| of the adapter's unit outputs a)."""
        q = {m: fake(m.weight.data, *params[m], args) for m in mods}
        y = layer_output(model, x, ids, weights, q)
        moe = ((y - reference).norm() / reference.norm()).item()
        adapted = (F.normalize(x + y, dim=-1) - F.normalize(x + reference, dim=-1)).norm(dim=-1).mean().item()
        return moe, adapted

    rtn = {m: qparams(m.weight.data, args) for m in mods}
    rtn_err = error(rtn)  # before AWQ rescales the weights
    chosen = rtn
    if a.method == "awq":
        chosen = {}
        first_joint = len(model.experts) - joint
        for e, expert in enumerate(experts):
            if e >= len(model.experts):  # the shared expert
                rows = torch.ones(len(x), dtype=torch.bool)
            else:  # joint experts on the fused rows, the others on the single-modality rows
                rows = (ids == e).any(dim=-1) & (fused if first_joint <= e else ~fused)
            xe = x[rows] if rows.any() else x  # an expert no calibration row reaches: all rows
            chosen.update(awq_expert(expert, xe, args, dtype))

    errors = [("rtn", rtn_err)] + ([("awq", error(chosen))] if a.method == "awq" else [])
    print(f"on {len(x)} calibration rows, relative error of the MoE output / mean distance of the "
          "adapted unit embeddings: " + ", ".join(f"{n} {e[0]:.4g} / {e[1]:.4g}" for n, e in errors))

    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["re:.*gate$"],
        format="pack-quantized",
    )
    apply_quantization_config(model, qconfig)
    for m in mods:
        scale, zp = chosen[m]
        m.weight_scale.data.copy_(scale)
        m.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressed = compressor.compress(model)
    os.makedirs(a.out, exist_ok=True)
    meta = {"format": "pt", "generator": "tools/moe-quantize.py", "method": a.method,
            "compressed_tensors": compressed_tensors.__version__}
    weights_path = os.path.join(a.out, "adapter.safetensors")
    compressed.update(carried)
    save_file({k: v.contiguous() for k, v in compressed.items()}, weights_path, metadata=meta)
    st_canonical.canonicalize(weights_path)  # re-runs are byte-identical
    os.chmod(weights_path, 0o644)  # save_file leaves its temporary file's 0600
    cfg["quantization_config"] = compressor.quantization_config.model_dump()
    with open(os.path.join(a.out, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    for extra in sorted(os.listdir(a.adapter)):
        if extra not in ("adapter_config.json", "adapter.safetensors"):
            src = os.path.join(a.adapter, extra)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(a.out, extra))
    print(f"wrote {a.out}: {a.method}, group {a.group_size}, "
          f"{'asymmetric' if a.asymmetric else 'symmetric'}, {a.scale_dtype} scales")


if __name__ == "__main__":
    main()
