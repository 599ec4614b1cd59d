#!/usr/bin/env python3
"""Generate the reference fixtures in tests/fixtures/ that the C++ tests compare against.

The outputs are committed, so building and testing the project needs no Python.
Regenerate them (deterministic: fixed torch/numpy seeds) with::

    tools/setup-fixture-env.sh && .venv-fixtures/bin/python tools/make_fixtures.py

The CLIP tokenizer cases need models/clip-tokenizer/ (see tools/convert_clip_bpe.py;
this script runs it first if the folder is missing).

Outputs (all overwritten on every run):

* ``clip_tiny/``               tiny random ``transformers.CLIPModel``: config.json,
                               model.safetensors (fp32), preprocessor_config.json
* ``clip_tiny_io.safetensors`` text/vision inputs and the model's outputs
* ``clip_tiny_bpe/``           tiny random ``CLIPModel`` with CLIP's real 49408-token vocabulary:
                               config.json, model.safetensors (fp16), preprocessor_config.json
                               (32 px), and relative symlinks to models/clip-tokenizer/ files
* ``clip_tiny_bpe_io.safetensors`` query strings (in __metadata__["texts"]), their token ids,
                               text/image embeddings, 2 source images + pixel values, and
                               ``adapter_tiny`` applied to the text embeddings
* ``preprocess.safetensors``   ``CLIPImageProcessor`` reference on 4 synthetic images
                               (rgb, resized size, fp16 pixel values)
* ``mixtral_tiny/``            tiny random ``MixtralForCausalLM``, sharded safetensors
* ``qwen2_moe_tiny/``          tiny random ``Qwen2MoeForCausalLM``, sharded safetensors
* ``adapter_tiny/``            the Mixtral layer-1 MoE block in gst-moe adapter format
* ``moe_io.safetensors``       MoE block inputs, outputs, router logits and routing
* ``tokenizer_cases.json``     CLIPTokenizer (slow, with ftfy) ids and ftfy.fix_text for awkward strings

Every tensor name, shape and dtype is printed in the summary at the end. Files in other tools'
layouts (image formats, older CLIP configs, a Qwen2-MoE config relying on defaults) come from the
sibling tools/make_format_fixtures.py (tests/fixtures/formats/).
"""

import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import safetensors
import transformers
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_canonical  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO_ROOT, "tests", "fixtures")
TOKENIZER_DIR = os.path.join(REPO_ROOT, "models", "clip-tokenizer")

BASE_META = {
    "generator": "tools/make_fixtures.py",
    "transformers": transformers.__version__,
    "torch": torch.__version__,
}


def eager_kwargs(config_cls):
    """attn_implementation="eager" where this transformers version knows it."""
    try:
        config_cls(attn_implementation="eager")
        return {"attn_implementation": "eager"}
    except TypeError:
        return {}


def reinit_(model, std, norm_types):
    """Large random weights so that implementation errors show up clearly.

    Linear / Embedding / Conv weights ~ N(0, std); norm weights 1 + 0.1*N(0,1);
    all biases 0.1*N(0,1); any other parameter (e.g. CLIP class_embedding) N(0,1).
    """
    done = set()
    with torch.no_grad():
        for mod in model.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in done:
                    continue
                done.add(id(p))
                if pname == "bias":
                    p.copy_(0.1 * torch.randn_like(p))
                elif isinstance(mod, norm_types) and pname == "weight":
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv2d)):
                    p.copy_(std * torch.randn_like(p))
                elif pname == "logit_scale":
                    pass  # keep HF's log(1/0.07)
                else:
                    p.copy_(torch.randn_like(p))


# --------------------------------------------------------------------------- CLIP


def make_clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(1234)
    text_cfg = dict(vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
                    bos_token_id=998, eos_token_id=999, pad_token_id=1, projection_dim=24)
    vision_cfg = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu", num_channels=3,
                      projection_dim=24)
    config = CLIPConfig(text_config=text_cfg, vision_config=vision_cfg, projection_dim=24,
                        **eager_kwargs(CLIPConfig))
    config.torch_dtype = torch.float32
    model = CLIPModel(config).float().eval()
    reinit_(model, 0.2, (torch.nn.LayerNorm,))

    out_dir = st_canonical.fresh_dir(os.path.join(FIX, "clip_tiny"))
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained writes only non-default keys; write them all (like the
    # openai/clip-* configs on the hub) so that C++ readers need no HF defaults.
    config.to_json_file(os.path.join(out_dir, "config.json"), use_diff=False)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)

    # Text inputs: [bos] + random ids + [eos], padded with pad id after the eos.
    lengths = [2, 3, 10, 30, 76, 77]
    ids = torch.full((len(lengths), 77), 1, dtype=torch.long)
    mask = torch.zeros((len(lengths), 77), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 0] = 998
        ids[i, 1:n - 1] = torch.randint(2, 998, (n - 2,))
        ids[i, n - 1] = 999
        mask[i, :n] = 1
    pixels = torch.randn(3, 3, 32, 32)

    with torch.no_grad():
        text_embeds = model.get_text_features(input_ids=ids, attention_mask=mask)
        text_pooled = model.text_model(input_ids=ids, attention_mask=mask).pooler_output
        # Padding must not matter (causal mask; pooling at the first eos).
        text_pooled_nomask = model.text_model(input_ids=ids).pooler_output
        assert torch.allclose(text_pooled, text_pooled_nomask, atol=1e-5)
        image_embeds = model.get_image_features(pixel_values=pixels)
        vision_pooled = model.vision_model(pixel_values=pixels).pooler_output

    tensors = {
        "text.input_ids": ids.to(torch.int32),
        "text.lengths": torch.tensor(lengths, dtype=torch.int32),
        "text.text_embeds": text_embeds.float(),
        "text.pooled": text_pooled.float(),
        "vision.pixel_values": pixels.float(),
        "vision.image_embeds": image_embeds.float(),
        "vision.pooled": vision_pooled.float(),
    }
    st_canonical.save_st(tensors, os.path.join(FIX, "clip_tiny_io.safetensors"), dict(BASE_META))
    return model


# --------------------------------------------------------------------- preprocess


def synth_image(rng, w, h):
    """Smooth gradients + hard-edged shapes + mild noise, uint8 [H, W, 3]."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    u, v = x / max(w - 1, 1), y / max(h - 1, 1)
    img = np.empty((h, w, 3), np.float64)
    ph = rng.uniform(0, 2 * np.pi, size=3)
    img[..., 0] = 40 + 170 * u + 20 * np.sin(6.0 * v + ph[0])
    img[..., 1] = 60 + 140 * v + 25 * np.cos(5.0 * u + 3.0 * v + ph[1])
    img[..., 2] = 128 + 100 * np.sin(3.0 * (u + v) + ph[2])
    for _ in range(4):  # rectangles
        x0, x1 = np.sort(rng.integers(0, w, 2))
        y0, y1 = np.sort(rng.integers(0, h, 2))
        img[y0:y1 + 1, x0:x1 + 1] = rng.integers(0, 256, 3)
    for _ in range(3):  # discs
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.08, 0.3) * min(w, h)
        img[(x - cx) ** 2 + (y - cy) ** 2 <= r * r] = rng.integers(0, 256, 3)
    # thin diagonal line (1-pixel detail)
    t = np.linspace(0, 1, 4 * max(w, h))
    img[(t * (h - 1)).astype(int), (t * (w - 1)).astype(int)] = [255, 255, 255]
    img += rng.normal(0, 4.0, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def preprocess_images():
    """The 4 synthetic uint8 [H, W, 3] images of preprocess.safetensors (deterministic)."""
    rng = np.random.default_rng(20240607)
    sizes = [(97, 131), (320, 241), (500, 90), (40, 61)]  # (W, H)
    return [synth_image(rng, w, h) for (w, h) in sizes]


def make_preprocess():
    from transformers import CLIPImageProcessor

    proc = CLIPImageProcessor()
    proc.save_pretrained(os.path.join(FIX, "clip_tiny"))

    tensors = {}
    for i, rgb in enumerate(preprocess_images()):
        pil = Image.fromarray(rgb, "RGB")
        pv = proc(images=pil, return_tensors="np")["pixel_values"][0]
        assert pv.shape == (3, 224, 224), pv.shape

        # Intermediate: PIL bicubic resize (uint8) + centre crop, as the processor does.
        arr = np.asarray(pil)
        resized = proc.resize(arr, size=proc.size, resample=proc.resample)
        cropped = proc.center_crop(resized, size=proc.crop_size)
        assert cropped.dtype == np.uint8 and cropped.shape == (224, 224, 3)
        manual = (cropped.astype(np.float32) * np.float32(proc.rescale_factor)
                  - np.array(proc.image_mean, np.float32)) / np.array(proc.image_std, np.float32)
        err = np.abs(manual.transpose(2, 0, 1) - pv).max()
        assert err < 1e-5, err

        tensors["image%d.rgb" % i] = torch.from_numpy(rgb.copy())
        tensors["image%d.resized_hw" % i] = torch.tensor(resized.shape[:2], dtype=torch.int32)
        tensors["image%d.pixel_values" % i] = torch.from_numpy(pv.astype(np.float16))
    meta = dict(BASE_META)
    meta["processor"] = json.dumps(proc.to_dict(), sort_keys=True)
    st_canonical.save_st(tensors, os.path.join(FIX, "preprocess.safetensors"), meta)


# ---------------------------------------------------------------------------- MoE


def save_sharded(model, out_dir):
    st_canonical.fresh_dir(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="20KB")
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    assert os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")), "not sharded"


def route(logits, k, renorm):
    probs = torch.softmax(logits.float(), dim=-1)
    w, sel = torch.topk(probs, k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    # Gap between the k-th and (k+1)-th probability: must not be a near-tie.
    srt = probs.sort(dim=-1, descending=True).values
    gap = (srt[:, k - 1] - srt[:, k]).min().item()
    return w, sel, gap


def draw_input(block, k, seed):
    """randn [37, 16] with no near-ties in top-k routing (deterministic retry)."""
    for attempt in range(100):
        torch.manual_seed(seed + attempt)
        x = torch.randn(37, 16)
        with torch.no_grad():
            logits = block.gate(x)
        if route(logits, k, False)[2] > 1e-3:
            return x
    raise RuntimeError("could not draw a tie-free input")


def make_moe():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm

    tensors = {}
    meta = dict(BASE_META)

    # ---- Mixtral
    torch.manual_seed(42)
    mcfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=6,
                         num_experts_per_tok=2, router_jitter_noise=0.0, **eager_kwargs(MixtralConfig))
    mcfg.torch_dtype = torch.float32
    mixtral = MixtralForCausalLM(mcfg).float().eval()
    reinit_(mixtral, 0.3, (MixtralRMSNorm,))
    save_sharded(mixtral, os.path.join(FIX, "mixtral_tiny"))

    block = mixtral.model.layers[1].block_sparse_moe
    x = draw_input(block, 2, 100)
    with torch.no_grad():
        out, logits = block(x.view(1, 37, 16))
        out = out.view(37, 16)
        w, sel, gap = route(logits, 2, True)
        # independent recomputation of the block from the routing
        ref = torch.zeros_like(x)
        for t in range(37):
            for j in range(2):
                e = block.experts[int(sel[t, j])]
                h = F.silu(e.w1(x[t])) * e.w3(x[t])
                ref[t] += w[t, j] * e.w2(h)
        assert torch.allclose(ref, out, atol=1e-5), (ref - out).abs().max()
        adapter_out = F.normalize(x + out, dim=-1)
    tensors.update({
        "mixtral.input": x, "mixtral.output": out, "mixtral.router_logits": logits,
        "mixtral.selected_experts": sel.to(torch.int32), "mixtral.routing_weights": w,
        "adapter.output": adapter_out,
    })
    meta["mixtral.prefix"] = "model.layers.1.block_sparse_moe."
    meta["mixtral.min_topk_gap"] = "%.6f" % gap

    # adapter in the project's own format
    adir = st_canonical.fresh_dir(os.path.join(FIX, "adapter_tiny"))
    sd = {k: v.detach().float().contiguous() for k, v in block.state_dict().items()}
    st_canonical.save_st(sd, os.path.join(adir, "adapter.safetensors"),
            {"format": "gst-moe-adapter", "generator": "tools/make_fixtures.py"})
    with open(os.path.join(adir, "adapter_config.json"), "w") as fh:
        json.dump({"format": "gst-moe-adapter", "version": 1, "hidden_size": 16, "num_experts": 6,
                   "top_k": 2, "intermediate_size": 24, "routing": "mixtral", "norm_topk_prob": True,
                   "shared_expert_intermediate_size": 0}, fh, indent=2)
        fh.write("\n")

    # ---- Qwen2-MoE
    torch.manual_seed(43)
    qcfg = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=20,
                          shared_expert_intermediate_size=28, num_experts=6, num_experts_per_tok=3,
                          norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, decoder_sparse_step=1, mlp_only_layers=[],
                          **eager_kwargs(Qwen2MoeConfig))
    qcfg.torch_dtype = torch.float32
    qwen = Qwen2MoeForCausalLM(qcfg).float().eval()
    reinit_(qwen, 0.3, (Qwen2MoeRMSNorm,))
    save_sharded(qwen, os.path.join(FIX, "qwen2_moe_tiny"))

    qblock = qwen.model.layers[1].mlp
    assert type(qblock).__name__ == "Qwen2MoeSparseMoeBlock", type(qblock)
    qx = draw_input(qblock, 3, 200)
    with torch.no_grad():
        qout, qlogits = qblock(qx.view(1, 37, 16))
        qout = qout.view(37, 16)
        qw, qsel, qgap = route(qlogits, 3, False)
        ref = torch.zeros_like(qx)
        for t in range(37):
            for j in range(3):
                e = qblock.experts[int(qsel[t, j])]
                ref[t] += qw[t, j] * e.down_proj(F.silu(e.gate_proj(qx[t])) * e.up_proj(qx[t]))
            s = qblock.shared_expert
            ref[t] += torch.sigmoid(qblock.shared_expert_gate(qx[t])) * \
                s.down_proj(F.silu(s.gate_proj(qx[t])) * s.up_proj(qx[t]))
        assert torch.allclose(ref, qout, atol=1e-5), (ref - qout).abs().max()
    tensors.update({
        "qwen2_moe.input": qx, "qwen2_moe.output": qout, "qwen2_moe.router_logits": qlogits,
        "qwen2_moe.selected_experts": qsel.to(torch.int32), "qwen2_moe.routing_weights": qw,
    })
    meta["qwen2_moe.prefix"] = "model.layers.1.mlp."
    meta["qwen2_moe.min_topk_gap"] = "%.6f" % qgap

    st_canonical.save_st({k: v.detach() for k, v in tensors.items()}, os.path.join(FIX, "moe_io.safetensors"), meta)


# ---------------------------------------------------------------------- tokenizer

TOKENIZER_TEXTS = [
    "a photo of a cat",
    "A Photo Of A CAT",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "café crème brûlée",                      # precomposed accents
    "cafe\u0301 cre\u0300me",                   # decomposed (NFD) accents
    "Straße ßSS",                              # German sharp s
    "İstanbul ıi",                             # Turkish dotted / dotless i
    "Καλημέρα κόσμε",                          # Greek
    "Привет, мир!",                            # Cyrillic
    "猫の写真 一只猫",                          # CJK
    "صورة قطة",                                # Arabic
    "🐱🐶 cat emoji 😀",                       # emoji
    "👩\u200d👩\u200d👧\u200d👦 family",       # ZWJ sequence
    "👍🏽 👋🏿",                                  # skin tones
    "!!!???",
    "wait... what",
    "well--maybe -- not",
    "12345 3.14 1,000,000",
    "don't it's we'll they've I'm",
    "I'M DON'T WE'LL",
    "don\u2019t it\u2019s",                    # right single quotation mark
    "don`t it´s",                              # other apostrophe-ish characters
    "\u201ccurly quotes\u201d and \u2018single\u2019",
    "&amp; &lt;b&gt;bold&lt;/b&gt; &quot;q&quot; &#39;",
    "<b>&amp;</b> &amp;lt;",                   # literal tags stop ftfy's html unescape; double escape
    "tabs\tand\nnewlines\r\nand   multiple    spaces",
    "   leading and trailing spaces   ",
    "",
    " ",
    "ＡＢＣ ｆｕｌｌｗｉｄｔｈ １２３",          # fullwidth
    "ﬁnal ﬂow",                                # ligatures
    "https://example.com/path?q=cat&lang=en#top",
    "john.doe@example.org",
    "#caturday #CLIP_2024",
    "before <|endoftext|> after",
    "<|startoftext|>hello",
    "mixed English, Русский, 中文, and العربية text",
    "naïve coöperate résumé",
    "mojibake: cafÃ© â€œquotedâ€\x9d",
    "Ã©tÃ© Ã  la plage",                        # whole line mojibake (été à la plage)
    "twice: cafÃƒÂ©",                           # mojibake of mojibake
    "Â£5 and â‚¬10",                             # £ and € through Windows-1252
    "Latin-1 as such: Âme, Ãgua, ÃŽle? naïve",  # real Latin-1 letters: not mojibake
    "zero\u200bwidth space and non\u00a0breaking",
    "x" * 300,
    " ".join("word%d" % i for i in range(100)),   # > 77 tokens: truncation
    "The pixelated photograph of an extraordinarily unphotogenic hippopotamus.",
    # HTML5-only entity names (not in HTML 4), some decoding to two code points
    "&check; done, &half; cup, &lpar;aside&rpar; &Tab;tab &NewLine;line",
    "&Jscr;ohn &HilbertSpace;ancock &checkmark; &fjlig;ord &NotEqualTilde; &bne; &models;",
    # ftfy's all-caps spellings, names it refuses, and names too long for its pattern
    "P&EACUTE;REZ BUNDESSTRA&SZLIG;E &ntilde; &Ntilde; &NTILDE; &nTILDE; &LT; &AMP;",
    "&CounterClockwiseContourIntegral; &DoubleLongLeftRightArrow; &lt &copy &Tab &bogus;",
]


def ensure_tokenizer():
    if not os.path.exists(os.path.join(TOKENIZER_DIR, "vocab.json")):
        subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "convert_clip_bpe.py")],
                       check=True)


def make_tokenizer_cases():
    import ftfy
    from transformers import CLIPTokenizer

    ensure_tokenizer()
    tok = CLIPTokenizer.from_pretrained(TOKENIZER_DIR)
    assert tok.fix_text is not None, "ftfy not used by CLIPTokenizer"
    cases = []
    for text in TOKENIZER_TEXTS:
        ids = tok(text, truncation=True, max_length=77)["input_ids"]
        fixed = ftfy.fix_text(text)
        cases.append({"text": text, "ids": ids, "ftfy_changed": fixed != text, "fixed": fixed})
    assert cases[0]["ids"] == [49406, 320, 1125, 539, 320, 2368, 49407], cases[0]["ids"]
    with open(os.path.join(FIX, "tokenizer_cases.json"), "w", encoding="utf-8") as fh:
        fh.write("[\n")
        fh.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        fh.write("\n]\n")
    return cases


# ------------------------------------------------------------- CLIP with real BPE

BPE_TEXTS = [
    "a photo of a cat",
    "Red striped MUG!!",
    "small blue shoe on white",
    "café crème",
    "🙂 emoji query",
    "",
    ("a very long product description that keeps going " * 12).strip(),  # > 77 tokens
    "numbers 1234 and 3.14",
]
BPE_TOKENIZER_FILES = ["vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]


def load_adapter_block():
    """The adapter_tiny MoE block, loaded back from tests/fixtures/adapter_tiny/."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    adir = os.path.join(FIX, "adapter_tiny")
    with open(os.path.join(adir, "adapter_config.json")) as fh:
        acfg = json.load(fh)
    assert acfg["routing"] == "mixtral" and acfg["shared_expert_intermediate_size"] == 0, acfg
    cfg = MixtralConfig(hidden_size=acfg["hidden_size"], intermediate_size=acfg["intermediate_size"],
                        num_local_experts=acfg["num_experts"], num_experts_per_tok=acfg["top_k"],
                        router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(cfg).float().eval()
    block.load_state_dict(load_file(os.path.join(adir, "adapter.safetensors")), strict=True)
    return block, acfg


def make_clip_bpe():
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    ensure_tokenizer()
    torch.manual_seed(4321)
    # pad/bos/eos: openai/clip-* configs have pad 1 but the legacy bos 0 / eos 2 (which makes
    # transformers pool at argmax(input_ids)); use the real ids 49406/49407 so that the
    # "first eos position" pooling path is taken.
    text_cfg = dict(vocab_size=49408, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
                    bos_token_id=49406, eos_token_id=49407, pad_token_id=1, projection_dim=16)
    vision_cfg = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, hidden_act="gelu", num_channels=3,
                      projection_dim=16)
    config = CLIPConfig(text_config=text_cfg, vision_config=vision_cfg, projection_dim=16,
                        **eager_kwargs(CLIPConfig))
    model = CLIPModel(config).float().eval()
    reinit_(model, 0.2, (torch.nn.LayerNorm,))
    model = model.half()
    model.config.torch_dtype = torch.float16

    out_dir = st_canonical.fresh_dir(os.path.join(FIX, "clip_tiny_bpe"))
    model.save_pretrained(out_dir, safe_serialization=True)
    model.config.to_json_file(os.path.join(out_dir, "config.json"), use_diff=False)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc.save_pretrained(out_dir)
    rel_tok = os.path.relpath(TOKENIZER_DIR, out_dir)
    for name in BPE_TOKENIZER_FILES:
        os.symlink(os.path.join(rel_tok, name), os.path.join(out_dir, name))

    # Reference model: the saved fp16 weights, upcast to f32 (what the C++ engine sees).
    ref = CLIPModel.from_pretrained(out_dir, torch_dtype=torch.float32,
                                    **eager_kwargs(CLIPConfig)).eval()
    ref_sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert ref_sd[k].dtype == torch.float32 and torch.equal(ref_sd[k], v.float()), k
    assert ref.text_model.eos_token_id == 49407

    # Everything through the model directory itself (tokenizer via the symlinks).
    tok = CLIPTokenizer.from_pretrained(out_dir)
    assert tok.fix_text is not None, "ftfy not used by CLIPTokenizer"
    assert tok.pad_token_id == 49407 and tok.bos_token_id == 49406 and tok.eos_token_id == 49407
    enc = tok(BPE_TEXTS, truncation=True, max_length=77, padding="max_length", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids.shape == (len(BPE_TEXTS), 77)
    lengths = mask.sum(dim=1)
    assert lengths.max().item() == 77 and lengths.min().item() == 2, lengths
    assert tok("a photo of a cat")["input_ids"] == [49406, 320, 1125, 539, 320, 2368, 49407]
    first_eos = (ids == 49407).int().argmax(dim=-1)
    assert torch.equal(first_eos, lengths - 1)
    # The tokenizer pads with eos (49407), so the legacy argmax pooling picks the same position.
    assert torch.equal(ids.to(torch.int).argmax(dim=-1), first_eos)

    proc2 = CLIPImageProcessor.from_pretrained(out_dir)
    rgbs = preprocess_images()[:2]
    pils = [Image.fromarray(r, "RGB") for r in rgbs]
    pixels = torch.from_numpy(proc(images=pils, return_tensors="np")["pixel_values"]).float()
    assert pixels.shape == (2, 3, 32, 32), pixels.shape
    assert np.array_equal(proc2(images=pils, return_tensors="np")["pixel_values"], pixels.numpy())

    with torch.no_grad():
        text_embeds = ref.get_text_features(input_ids=ids, attention_mask=mask).float()
        nomask = ref.get_text_features(input_ids=ids).float()
        assert torch.allclose(text_embeds, nomask, atol=1e-5)
        image_embeds = ref.get_image_features(pixel_values=pixels).float()

    # adapter_tiny applied to the text embeddings.
    block, acfg = load_adapter_block()
    assert acfg["hidden_size"] == text_embeds.shape[1]
    k = acfg["top_k"]
    with torch.no_grad():
        x = text_embeds
        out, logits = block(x.view(1, len(BPE_TEXTS), -1))
        out = out.view(len(BPE_TEXTS), -1)
        w, sel, gap = route(logits, k, acfg["norm_topk_prob"])
        chk = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                e = block.experts[int(sel[t, j])]
                chk[t] += w[t, j] * e.w2(F.silu(e.w1(x[t])) * e.w3(x[t]))
        assert torch.allclose(chk, out, atol=1e-5), (chk - out).abs().max()
        adapter_out = F.normalize(x + out, dim=-1)
    assert gap > 1e-3, "near-tie in adapter routing: %g" % gap

    tensors = {
        "text.input_ids": ids.to(torch.int32),
        "text.lengths": lengths.to(torch.int32),
        "text.text_embeds": text_embeds,
        "vision.rgb0": torch.from_numpy(rgbs[0].copy()),
        "vision.rgb1": torch.from_numpy(rgbs[1].copy()),
        "vision.pixel_values": pixels,
        "vision.image_embeds": image_embeds,
        "adapter.output": adapter_out,
        "adapter.selected_experts": sel.to(torch.int32),
        "adapter.routing_weights": w,
    }
    meta = dict(BASE_META)
    meta["texts"] = json.dumps(BPE_TEXTS, ensure_ascii=False)
    meta["adapter.min_topk_gap"] = "%.6f" % gap
    meta["processor"] = json.dumps(proc.to_dict(), sort_keys=True)
    st_canonical.save_st(tensors, os.path.join(FIX, "clip_tiny_bpe_io.safetensors"), meta)


# ------------------------------------------------------------------------ summary


def summary():
    import ftfy
    print("versions: torch %s, transformers %s, safetensors %s, ftfy %s, numpy %s, PIL %s"
          % (torch.__version__, transformers.__version__, safetensors.__version__, ftfy.__version__,
             np.__version__, Image.__version__))
    total = 0
    for root, _, files in sorted(os.walk(FIX)):
        for f in sorted(files):
            p = os.path.join(root, f)
            if os.path.islink(p):  # symlinks are stored as links, not counted
                print("  %-55s -> %s" % (os.path.relpath(p, FIX), os.readlink(p)))
                continue
            sz = os.path.getsize(p)
            total += sz
            print("  %-55s %9d" % (os.path.relpath(p, FIX), sz))
    print("  %-55s %9d" % ("TOTAL", total))
    for name in ("clip_tiny_io.safetensors", "clip_tiny_bpe_io.safetensors", "preprocess.safetensors",
                 "moe_io.safetensors"):
        print(name)
        t = load_file(os.path.join(FIX, name))
        for k in sorted(t):
            print("    %-32s %-14s %s" % (k, str(t[k].dtype).replace("torch.", ""), list(t[k].shape)))
    if total > 4_500_000:
        print("WARNING: fixtures exceed 4.5 MB")


def main():
    torch.set_grad_enabled(False)
    os.makedirs(FIX, exist_ok=True)
    make_clip()
    make_preprocess()
    make_moe()
    make_tokenizer_cases()
    make_clip_bpe()  # needs adapter_tiny/ (make_moe) and models/clip-tokenizer/
    summary()


if __name__ == "__main__":
    main()
