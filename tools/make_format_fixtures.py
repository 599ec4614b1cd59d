#!/usr/bin/env python3
"""Generate tests/fixtures/formats/: files as other tools write them, read by the references.

A sibling of tools/make_fixtures.py (same environment, same rules: committed outputs, fixed seeds)
for the input formats the engine must read as the reference implementations do::

    tools/setup-fixture-env.sh && .venv-fixtures/bin/python tools/make_format_fixtures.py

Outputs (overwritten on every run):

* ``images/``                     image files and ``expected.safetensors``: for each file the engine
                                  decodes, ``<file name>`` -> uint8 [H, W, 3], PIL's ``convert("RGB")``
                                  of it (what CLIPImageProcessor starts from); ``__metadata__["refused"]``
                                  names the files whose PIL result it cannot reproduce (more than 8
                                  bits per sample)
* ``clip_config/``                CLIPModel configs in older transformers' layouts
                                  (``text_config_dict`` / ``vision_config_dict``) and
                                  ``expected.json``: the values transformers' CLIPConfig reads
* ``qwen2_moe_no_shared_size/``   a tiny Qwen2MoeForCausalLM saved by transformers with the default
                                  shared expert, config.json without ``shared_expert_intermediate_size``
                                  (fp16 weights), and ``io.safetensors``: the MoE block's input and output
                                  from the model transformers loads from that directory
* ``moe_activations.json``        transformers' ACT2CLS names that are SiLU, and all the others
"""

import json
import os
import struct
import sys
import zlib

import numpy as np
import torch
from PIL import Image, features

import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_canonical  # noqa: E402
from make_fixtures import eager_kwargs, reinit_, synth_image  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "formats")
META = {"generator": "tools/make_format_fixtures.py", "transformers": transformers.__version__,
        "torch": torch.__version__, "PIL": Image.__version__}


# ------------------------------------------------------------------------------ images


def png_bytes(width, height, bit_depth, colour_type, samples):
    """A PNG of big-endian `samples` [H, W, C] (filter 0 rows), for layouts PIL cannot write."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"".join(b"\0" + row.tobytes() for row in samples)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def make_images():
    assert features.check("webp"), "this Pillow has no WebP support"
    out = st_canonical.fresh_dir(os.path.join(OUT, "images"))
    rng = np.random.default_rng(20261201)
    rgb = synth_image(rng, 64, 64)
    gray = synth_image(rng, 64, 64)[..., 1]
    files = {}
    # Binary PPM / PGM of 12 KB / 4 KB + header: above the loader's 4 KB read size.
    Image.fromarray(rgb, "RGB").save(os.path.join(out, "rgb64.ppm"))
    Image.fromarray(gray, "L").save(os.path.join(out, "gray64.pgm"))
    files["rgb64.ppm"] = files["gray64.pgm"] = None
    # WebP: lossless, and lossy (YUV 4:2:0, so the decoder's upsampling matters).
    Image.fromarray(rgb[:40, :48], "RGB").save(os.path.join(out, "lossless.webp"), lossless=True)
    Image.fromarray(rgb[8:48, 4:52], "RGB").save(os.path.join(out, "lossy.webp"), quality=80, method=4)
    # 16-bit PNGs: RGB (PIL keeps each sample's high byte) and grayscale (PIL: mode I, clipped).
    rgb16 = rng.integers(0, 65536, (6, 7, 3), dtype=np.uint16).astype(">u2")
    with open(os.path.join(out, "rgb16.png"), "wb") as fh:
        fh.write(png_bytes(7, 6, 16, 2, rgb16))
    gray16 = rng.integers(0, 65536, (6, 7, 1), dtype=np.uint16).astype(">u2")
    gray16[0, :4, 0] = [0, 255, 256, 65535]
    with open(os.path.join(out, "gray16.png"), "wb") as fh:
        fh.write(png_bytes(7, 6, 16, 0, gray16))
    Image.fromarray(gray16[..., 0].astype(np.uint16)).save(os.path.join(out, "gray16.tif"))
    # PNM with maxval other than 255 (PIL writes none: written here). PIL rescales each sample to
    # round(v / maxval * 255); a binary file's samples above maxval become 255.
    samples = np.arange(0, 128, dtype=np.uint8).reshape(8, 16)
    with open(os.path.join(out, "gray-maxval100.pgm"), "wb") as fh:
        fh.write(b"P5\n# 0..127 against maxval 100\n16 8\n100\n" + samples.tobytes())
    with open(os.path.join(out, "rgb-maxval31.ppm"), "wb") as fh:
        fh.write(b"P6 4 8 31\n" + (samples[:, :12] % 32).tobytes())
    with open(os.path.join(out, "ascii-maxval7.ppm"), "wb") as fh:
        fh.write(b"P3\n#comment\n8 1 #another\n7\n" + " ".join(str(v % 8) for v in range(24)).encode() + b"\n")
    with open(os.path.join(out, "gray16.pgm"), "wb") as fh:
        fh.write(b"P5\n7 6\n65535\n" + gray16.tobytes())
    with open(os.path.join(out, "rgb-maxval1000.ppm"), "wb") as fh:
        fh.write(b"P6\n3 2\n1000\n" + (np.arange(18, dtype=np.uint16) * 55).astype(">u2").tobytes())

    # The engine refuses these (more than 8 bits per sample, which gdk-pixbuf does not keep):
    # 16-bit grayscale, which PIL opens as mode I and clips to 0..255, and a PNM of maxval 1000.
    refused = ["gray16.pgm", "gray16.png", "gray16.tif", "rgb-maxval1000.ppm"]
    expected = {}
    for name in sorted(os.listdir(out)):
        with Image.open(os.path.join(out, name)) as im:
            mode = im.mode
            pixels = np.asarray(im.convert("RGB"))
        if name.startswith("gray16."):
            assert mode in ("I", "I;16"), (name, mode)
            # the samples below 256 keep their value, all others become 255
            assert np.array_equal(pixels[..., 0], np.minimum(gray16[..., 0].astype(np.int64), 255)), name
        if name not in refused:
            expected[name] = torch.from_numpy(pixels.copy())
    assert expected["gray-maxval100.pgm"][0, 1, 0] == 3 and expected["gray-maxval100.pgm"][7, 15, 0] == 255
    assert np.array_equal(expected["rgb16.png"].numpy(), (rgb16.astype(np.uint16) >> 8).astype(np.uint8))
    assert np.array_equal(expected["rgb64.ppm"].numpy(), rgb)
    assert np.array_equal(expected["lossless.webp"].numpy(), rgb[:40, :48])
    meta = dict(META)
    meta["refused"] = json.dumps(refused)
    st_canonical.save_st(expected, os.path.join(out, "expected.safetensors"), meta)


# ------------------------------------------------------------------------- CLIP config

# Each case: the config.json's top-level text/vision parts. Sizes differ between the two forms
# where both are present, so that the test sees which one transformers keeps.
CLIP_CASES = {
    # Only the old form (transformers < 4.2x wrote these).
    "dict_only": {
        "text_config_dict": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                             "num_attention_heads": 4, "eos_token_id": 2, "vocab_size": 1000},
        "vision_config_dict": {"hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 3,
                               "image_size": 64, "patch_size": 16, "hidden_act": "gelu"},
    },
    # Both forms, disagreeing; fields only in `text_config` (eos_token_id, layer_norm_eps) take
    # the class default, not their value there.
    "both_disagree": {
        "text_config_dict": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4},
        "text_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2,
                        "eos_token_id": 2, "layer_norm_eps": 1e-6, "max_position_embeddings": 40},
        "vision_config_dict": {"hidden_size": 48, "num_attention_heads": 3},
        "vision_config": {"hidden_size": 96, "num_attention_heads": 6, "image_size": 64, "patch_size": 8},
    },
    # A null `_dict` (as many hub configs have) means the other form.
    "null_dict": {
        "text_config_dict": None,
        "text_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2},
        "vision_config_dict": None,
        "vision_config": {"hidden_size": 96, "num_attention_heads": 6, "image_size": 64, "patch_size": 8},
    },
}
TEXT_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
               "layer_norm_eps", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
               "pad_token_id"]
VISION_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
                 "layer_norm_eps", "image_size", "patch_size", "num_channels"]


def make_clip_configs():
    from transformers import CLIPConfig

    out = st_canonical.fresh_dir(os.path.join(OUT, "clip_config"))
    expected = {}
    for name, parts in CLIP_CASES.items():
        doc = {"model_type": "clip", "projection_dim": 24}
        doc.update(parts)
        path = os.path.join(out, name + ".json")
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        cfg = CLIPConfig.from_pretrained(path)
        expected[name] = {
            "projection_dim": cfg.projection_dim,
            "text": {f: getattr(cfg.text_config, f) for f in TEXT_FIELDS},
            "vision": {f: getattr(cfg.vision_config, f) for f in VISION_FIELDS},
        }
    assert expected["both_disagree"]["text"]["hidden_size"] == 64
    assert expected["both_disagree"]["text"]["eos_token_id"] != 2
    with open(os.path.join(out, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=2, sort_keys=True)
        fh.write("\n")


# --------------------------------------------------------------------------------- MoE


def make_qwen2_moe_no_shared_size():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm

    torch.manual_seed(44)
    # shared_expert_intermediate_size left at the class default; hidden 4 keeps that expert small.
    cfg = Qwen2MoeConfig(vocab_size=16, hidden_size=4, intermediate_size=8, moe_intermediate_size=6,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, decoder_sparse_step=1, mlp_only_layers=[],
                         **eager_kwargs(Qwen2MoeConfig))
    default_size = Qwen2MoeConfig().shared_expert_intermediate_size
    assert cfg.shared_expert_intermediate_size == default_size
    model = Qwen2MoeForCausalLM(cfg).float().eval()
    reinit_(model, 0.3, (Qwen2MoeRMSNorm,))
    model = model.half()
    model.config.torch_dtype = torch.float16

    out = st_canonical.fresh_dir(os.path.join(OUT, "qwen2_moe_no_shared_size"))
    model.save_pretrained(out, safe_serialization=True)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as fh:
        doc = json.load(fh)
    del doc["shared_expert_intermediate_size"]
    with open(cfg_path, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")

    # The reference: what transformers loads from this directory, upcast to f32 as the engine reads it.
    ref = Qwen2MoeForCausalLM.from_pretrained(out, torch_dtype=torch.float32, **eager_kwargs(Qwen2MoeConfig)).eval()
    assert ref.config.shared_expert_intermediate_size == default_size
    block = ref.model.layers[0].mlp
    assert type(block).__name__ == "Qwen2MoeSparseMoeBlock", type(block)
    assert block.shared_expert.gate_proj.weight.shape == (default_size, 4)
    x = torch.randn(9, 4)
    with torch.no_grad():
        y, logits = block(x.view(1, 9, 4))
        no_shared = y.view(9, 4) - torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    y = y.view(9, 4)
    assert (y - no_shared).abs().max() > 1e-2, "the shared expert must matter"
    st_canonical.save_st({"input": x, "output": y, "router_logits": logits.float()}, os.path.join(out, "io.safetensors"),
            dict(META, prefix="model.layers.0.mlp.", shared_expert_intermediate_size=str(default_size)))


def make_moe_activations():
    from transformers.activations import ACT2CLS

    def is_silu(name):
        entry = ACT2CLS[name]
        cls = entry[0] if isinstance(entry, tuple) else entry
        return cls is torch.nn.SiLU

    doc = {"silu": sorted(n for n in ACT2CLS if is_silu(n)), "other": sorted(n for n in ACT2CLS if not is_silu(n))}
    assert "silu" in doc["silu"] and "gelu" in doc["other"], doc
    with open(os.path.join(OUT, "moe_activations.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")


def main():
    torch.set_grad_enabled(False)
    os.makedirs(OUT, exist_ok=True)
    make_images()
    make_clip_configs()
    make_qwen2_moe_no_shared_size()
    make_moe_activations()
    total = 0
    for root, _, files in sorted(os.walk(OUT)):
        for f in sorted(files):
            size = os.path.getsize(os.path.join(root, f))
            total += size
            print("  %-55s %9d" % (os.path.relpath(os.path.join(root, f), OUT), size))
    print("  %-55s %9d" % ("TOTAL", total))


if __name__ == "__main__":
    main()
