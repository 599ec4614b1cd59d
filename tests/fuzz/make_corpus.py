#!/usr/bin/env python3
"""Writes the seed corpora (tests/fuzz/corpus/<target>/) and dictionaries (tests/fuzz/dict/) of
the libFuzzer targets: a few small inputs per target in the real formats, valid ones and edge
cases, each a few KB at most. Deterministic; the outputs are committed, so CI does not run this.

    tests/fuzz/make_corpus.py            # rewrite every corpus and dictionary

Real-format sources from the tree: the tiny test models' config files, the first lines of the
demo catalog, the head of CLIP's vocab.json/merges.txt. Images are written byte by byte (PNG,
BMP, GIF, PNM, TGA, XPM, XBM, SVG); JPEG, TIFF and ICO come from gdk-pixbuf itself (through
ctypes) when its library is installed, else those seeds are left as they are.
"""
import base64
import ctypes
import ctypes.util
import json
import os
import shutil
import struct
import sys
import tempfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
CORPUS = os.path.join(HERE, "corpus")
DICTS = os.path.join(HERE, "dict")

JSON_TOKENS = ["{", "}", "[", "]", ":", ",", '"', "\\", "\\u0000", "\\ud83d", "true", "false", "null", "-1", "0",
               "1e308", "-0.0", "9223372036854775807", "9223372036854775808", "1.5"]


def write_target(target, seeds, keys=()):
    """seeds: {name: bytes|str}; keys: member names and values for the target's dictionary."""
    out = os.path.join(CORPUS, target)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for name, data in seeds.items():
        if isinstance(data, str):
            data = data.encode("utf-8")
        assert len(data) <= 8192, (target, name, len(data))
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    if keys is not None:
        os.makedirs(DICTS, exist_ok=True)
        with open(os.path.join(DICTS, target + ".dict"), "w") as f:
            f.write("# libFuzzer dictionary for %s (written by make_corpus.py)\n" % target)
            entries = [dict_entry(t) for t in JSON_TOKENS]
            for k in keys:
                entries.append(dict_entry(k))
                if k.isprintable() and k.strip():
                    entries.append(dict_entry('"%s"' % k))  # as a JSON member name or string
            for e in dict.fromkeys(entries):
                f.write(e + "\n")


def dict_entry(token):
    r"""A libFuzzer dictionary line: the token in double quotes, with \\, \" and \xNN escapes."""
    out = []
    for b in token.encode("utf-8"):
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append("\\x%02X" % b)
    return '"' + "".join(out) + '"'


def compact(obj):
    return json.dumps(obj, separators=(",", ":"))


# ----- images, byte by byte -----

def png(width, height, color_type, rows, palette=None, bit_depth=8):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + r for r in rows)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0))
    if palette:
        out += chunk(b"PLTE", palette)
    return out + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def rgb_rows(w, h, channels):
    return [bytes(((x * 40 + y * 7 + c * 90) & 0xFF) for x in range(w) for c in range(channels)) for y in range(h)]


def bmp24(w, h):
    row = (w * 3 + 3) & ~3
    pixels = b"".join(bytes(((x * 50 + y * 30 + c * 80) & 0xFF) for x in range(w) for c in range(3)).ljust(row, b"\0")
                      for y in range(h))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(pixels), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    return header + info + pixels


def tga(w, h):
    header = struct.pack("<BBBHHBHHHHBB", 0, 0, 2, 0, 0, 0, 0, 0, w, h, 24, 0x20)
    return header + bytes(((i * 37) & 0xFF) for i in range(w * h * 3))


# A 2x2 GIF89a: 4-colour palette, LZW data for the pixels 0 1 / 2 3.
GIF = (b"GIF89a\x02\x00\x02\x00\x81\x00\x00"
       b"\xff\x00\x00\x00\xff\x00\x00\x00\xff\xff\xff\xff"
       b"\x21\xf9\x04\x00\x00\x00\x00\x00"
       b"\x2c\x00\x00\x00\x00\x02\x00\x02\x00\x00"
       b"\x02\x03\x44\x34\x05\x00\x3b")


def gdk_pixbuf_images():
    """JPEG, TIFF, ICO and WebP written by gdk-pixbuf; {} when its library is not there."""
    name = ctypes.util.find_library("gdk_pixbuf-2.0")
    if not name:
        return {}
    lib = ctypes.CDLL(name)
    lib.gdk_pixbuf_new.restype = ctypes.c_void_p
    lib.gdk_pixbuf_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gdk_pixbuf_get_pixels.restype = ctypes.c_void_p
    lib.gdk_pixbuf_get_pixels.argtypes = [ctypes.c_void_p]
    lib.gdk_pixbuf_get_rowstride.argtypes = [ctypes.c_void_p]
    lib.gdk_pixbuf_savev.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                     ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
    lib.g_object_unref.argtypes = [ctypes.c_void_p]
    out = {}
    for fmt, w, h, alpha, opts, fname in [("jpeg", 8, 8, 0, {"quality": "60"}, "rgb-8x8.jpg"),
                                          ("jpeg", 17, 5, 0, {"quality": "90"}, "rgb-17x5.jpg"),
                                          ("tiff", 3, 2, 0, {}, "rgb-3x2.tiff"),
                                          ("ico", 16, 16, 1, {}, "rgba-16x16.ico"),
                                          ("webp", 5, 4, 0, {"quality": "70"}, "rgb-5x4.webp")]:
        pb = lib.gdk_pixbuf_new(0, alpha, 8, w, h)
        stride = lib.gdk_pixbuf_get_rowstride(pb)
        channels = 4 if alpha else 3
        data = b"".join(bytes(((x * 31 + y * 17 + c * 70) & 0xFF) for x in range(w) for c in range(channels))
                        .ljust(stride, b"\0") for y in range(h))
        ctypes.memmove(lib.gdk_pixbuf_get_pixels(pb), data, min(len(data), stride * (h - 1) + w * channels))
        keys = (ctypes.c_char_p * (len(opts) + 1))(*[k.encode() for k in opts], None)
        vals = (ctypes.c_char_p * (len(opts) + 1))(*[v.encode() for v in opts.values()], None)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, fname)
            if lib.gdk_pixbuf_savev(pb, path.encode(), fmt.encode(), keys, vals, None):
                with open(path, "rb") as f:
                    out[fname] = f.read()
        lib.g_object_unref(pb)
    return out


def image_seeds():
    small = png(4, 3, 2, rgb_rows(4, 3, 3))
    seeds = {
        "rgb-4x3.png": small,
        "rgba-2x2.png": png(2, 2, 6, rgb_rows(2, 2, 4)),
        "gray-3x3.png": png(3, 3, 0, rgb_rows(3, 3, 1)),
        "palette-2x2.png": png(2, 2, 3, [b"\x00\x01", b"\x02\x00"], palette=b"\xff\x00\x00\x00\xff\x00\x00\x00\xff"),
        "gray16-2x1.png": png(2, 1, 0, [b"\x12\x34\xab\xcd"], bit_depth=16),
        "truncated.png": small[: len(small) - 20],
        # declares 20000 x 20000 pixels (over the decoder's limit) in a few bytes
        "huge-canvas.png": png(20000, 20000, 2, [])[:33] + small[33:],
        "rgb-3x2.bmp": bmp24(3, 2),
        "rgb-2x2.gif": GIF,
        # a frame 0 pixels wide: gdk-pixbuf's GIF loader logged a critical for it (a fuzz finding,
        # now refused by decode_image before the loader sees it)
        "zero-width-frame.gif": GIF[:34] + b"\x00\x00\x00\x02\x00\x00\x02\x00" + GIF[42:],
        # a frame one pixel wider than the canvas, disposed by "restore to previous": gdk-pixbuf's
        # GIF loader copies an area outside the canvas back (a GLib critical; a fuzz finding)
        "restore-previous-oversized-frame.gif": GIF[:25] + b"\x21\xf9\x04\x0c\x00\x00\x00\x00" +
        b"\x2c\x00\x00\x00\x00\x03\x00\x02\x00\x00" + GIF[43:],
        # frames beyond the canvas whose disposal the loader reads from stale bytes behind empty
        # graphic control blocks (found by fuzz_image_decode)
        "stale-disposal-oversized-frame.gif": bytes.fromhex(
            "47494638396102004300810000ff00690000004000ffff21f9000000000000617e34000000ccff3861f73900000f00ff"
            "ff00ffff21f900000000004000ffff21f900000000020061f7390000ffffffffffffffffffffffffffffffffffffffff"
            "ffffffffffffffffffffffffffffffffffffffff000fffff00ffff21f900696d6167652f78ff00ffff00000000000000"
            "ff21f900000000004000ffff21f9000000000000617e34000000ccff3861f73900000f00ffff00ffff21f90000000000"
            "4000ffff21f900000000020061f7390000000fffff00ffff21f900696d6167652f78ff00ffff21f900696d61ff21f900"
            "000000006167648a0a600000002c00000000028c6002000005003b"),
        # a frame that only the GIF loader finds (it reads on after an empty control block), and
        # whose copy-back makes it log a critical (found by fuzz_image_decode)
        "decoder-critical-behind-empty-control-blocks.gif": bytes.fromhex(
            "47494638396102004300810000ff00699696969696969696969696969696969696969696969696969696969696969696"
            "969696969696969696969696969696969696969696969696969696969696969696969696969696969696969696969696"
            "9696969696969696969696969696969696969696969696969696969696969696969696969696969696960000004000ff"
            "ff21f9000000000000617e32000000ccff3861f73900000f00ffff00ffff21f900000000004000ffff21f90000000002"
            "0061f7390000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff000f"
            "ffff00ffff21f900696d6167652f78ff00ffff00000000000000ff21f900000000004000ffff21f9000000000000617e"
            "34000000ccff3861f73900000f00ffff00ffff21f900000000004000ffff21f958585858585861f7390000000fffff00"
            "ffff21f900696d6167652f78ff00ffff21f900696d61ff21f900000000006167648a0a600000002c00000000028c6002"
            "000005003b"),
        # the same frame behind stray bytes, which the GIF loader skips while looking for a block
        "stray-bytes-zero-width-frame.gif": bytes.fromhex(
            "47494638396102000200810000ff000000ff000000ff010000de06fc00020000002c0000000200000200000203443405003b"),
        "rgb-2x2.ppm": b"P6\n2 2\n255\n" + bytes(range(12)),
        "rgb-2x1-ascii.ppm": b"P3\n2 1\n255\n255 0 0 0 255 0\n",
        "gray-2x2.pgm": b"P5\n2 2\n255\n\x00\x40\x80\xff",
        # maxval below 255 (rescaled as PIL does) and above it (refused), with header comments
        "gray-2x2-maxval100.pgm": b"P5\n# c\n2 2 #c\n100\n\x00\x32\x64\xff",
        "rgb-1x1-maxval1000.ppm": b"P6 1 1 1000\n\x00\x01\x03\xe8\x02\x00",
        # over the size limit: the PNM loader, asked for a 0x0 result, fails without saying why
        "huge-width.pbm": b"P4\n2442454\n35\n\x00\x00\x00\x00",
        "rgb-3x2.tga": tga(3, 2),
        "icon.xpm": b'/* XPM */\nstatic char * x[] = {\n"2 2 2 1",\n"a c #FF0000",\n"b c #0000FF",\n"ab",\n"ba"};\n',
        "mask.xbm": b"#define m_width 8\n#define m_height 2\nstatic unsigned char m_bits[] = { 0x0f, 0xf0 };\n",
        "circle.svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><circle cx="2" cy="2" r="2" '
                      b'fill="red"/></svg>\n',
        "not-an-image.txt": b"hello, this is not an image\n",
    }
    generated = gdk_pixbuf_images()
    old = os.path.join(CORPUS, "fuzz_image_decode")
    for fname in ("rgb-8x8.jpg", "rgb-17x5.jpg", "rgb-3x2.tiff", "rgba-16x16.ico", "rgb-5x4.webp"):
        if fname in generated:
            seeds[fname] = generated[fname]
        elif os.path.exists(os.path.join(old, fname)):  # keep the committed one
            with open(os.path.join(old, fname), "rb") as f:
                seeds[fname] = f.read()
    if "rgb-8x8.jpg" in seeds:
        seeds["truncated.jpg"] = seeds["rgb-8x8.jpg"][:-40]
    if "rgb-5x4.webp" in seeds:
        seeds["truncated.webp"] = seeds["rgb-5x4.webp"][:-10]
    return seeds


# ----- safetensors -----

def safetensors(tensors, metadata=None, pad=True, header_override=None):
    """tensors: [(name, dtype, shape, bytes)], laid out back to back."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    text = header_override if header_override is not None else compact(header)
    if pad:
        text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def safetensors_seeds():
    f32 = struct.pack("<6f", 1, -2, 0.5, 3.25, -0.0, 1e-3)
    return {
        "f32-2x3.safetensors": safetensors([("w", "F32", [2, 3], f32)], {"format": "pt"}),
        "dtypes.safetensors": safetensors([
            ("a.f16", "F16", [4], struct.pack("<4e", 1, -1, 0.5, 65504)),
            ("b.bf16", "BF16", [2, 2], b"\x80\x3f\x00\x40\x00\xc0\x80\x7f"),
            ("c.i64", "I64", [1], struct.pack("<q", -5)),
            ("d.i32", "I32", [2], struct.pack("<2i", 7, -7)),
            ("e.i8", "I8", [3], b"\x01\xff\x7f"),
            ("f.u8", "U8", [5], b"\x00\x01\x02\x03\xff"),
        ]),
        "empty-header.safetensors": safetensors([]),
        "zero-size.safetensors": safetensors([("empty", "F32", [0, 4], b""), ("scalar", "F32", [], struct.pack("<f", 2))]),
        "misaligned.safetensors": safetensors([("w", "F32", [2], struct.pack("<2f", 1, 2))], pad=False),
        "overlap.safetensors": struct.pack("<Q", 104) + compact({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).ljust(104).encode() + b"\0" * 12,
        "bad-length.safetensors": struct.pack("<Q", 1 << 40) + b"{}",
        "truncated.safetensors": safetensors([("w", "F32", [2, 3], f32)])[:-5],
    }


# ----- JSON configs -----

def clip_config_seeds():
    with open(os.path.join(ROOT, "tests/fixtures/clip_tiny/config.json")) as f:
        real = json.load(f)
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
            "layer_norm_eps", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "image_size", "patch_size", "num_channels")
    slim = {"model_type": "clip", "projection_dim": real["projection_dim"],
            "text_config": {k: v for k, v in real["text_config"].items() if k in keep},
            "vision_config": {k: v for k, v in real["vision_config"].items() if k in keep}}
    gelu = json.loads(compact(slim))
    gelu["text_config"]["hidden_act"] = "gelu"
    gelu["vision_config"]["layer_norm_eps"] = 1e-6
    return {
        "clip-tiny.json": json.dumps(slim, indent=2),
        "gelu.json": compact(gelu),
        "defaults.json": '{"text_config": {}, "vision_config": {}}',
        "float-ints.json": '{"projection_dim": 24.0, "text_config": {"hidden_size": 32.0, "num_attention_heads": 4}, '
                           '"vision_config": {"image_size": 30, "patch_size": 7}}',
        "no-vision.json": '{"model_type": "clip", "text_config": {"hidden_size": 8, "num_attention_heads": 2}}',
        "legacy-dicts.json": '{"text_config_dict": {"hidden_size": 16, "num_attention_heads": 2}, "text_config": '
                             '{"hidden_size": 8}, "vision_config_dict": null, "vision_config": {"image_size": 32}}',
        "wrong-type.json": '{"model_type": "siglip", "text_config": {}, "vision_config": {}}',
        "huge.json": '{"text_config": {"hidden_size": 9223372036854775807, "layer_norm_eps": 1e309}, '
                     '"vision_config": {"num_attention_heads": -1}}',
    }, list(keep) + ["model_type", "projection_dim", "text_config", "vision_config", "text_config_dict",
                         "vision_config_dict", "clip", "quick_gelu", "gelu"]


def preprocessor_seeds():
    with open(os.path.join(ROOT, "models/default/clip/preprocessor_config.json")) as f:
        real = f.read()
    keys = ["size", "shortest_edge", "height", "width", "crop_size", "do_resize", "do_center_crop", "do_rescale",
            "do_normalize", "rescale_factor", "image_mean", "image_std", "resample"]
    return {
        "default-clip.json": real,
        "int-sizes.json": '{"size": 224, "crop_size": 224, "resample": 3}',
        "height-width.json": '{"size": {"height": 32, "width": 48}, "crop_size": {"height": 16, "width": 16}, '
                             '"do_center_crop": false}',
        "one-mean.json": '{"image_mean": 0.5, "image_std": [0.5, 0.5, 0.5], "rescale_factor": 0.00392156862745098}',
        "no-resize.json": '{"do_resize": false, "do_rescale": false, "do_normalize": false}',
        "zero-std.json": '{"image_std": [0.5, 0, 0.5]}',
        "bilinear.json": '{"resample": 2}',
        "huge-size.json": '{"size": {"shortest_edge": 1048576}, "crop_size": 1048576}',
        "empty.json": "{}",
    }, keys


def adapter_seeds():
    with open(os.path.join(ROOT, "tests/fixtures/adapter_tiny/adapter_config.json")) as f:
        real = f.read()
    keys = ["format", "gst-moe-adapter", "version", "hidden_size", "num_experts", "top_k", "intermediate_size",
            "routing", "mixtral", "qwen2_moe", "norm_topk_prob", "shared_expert_intermediate_size", "model_type",
            "num_experts_per_tok", "num_local_experts", "moe_intermediate_size"]
    return {
        "adapter-tiny.json": real,
        "qwen2-shared.json": compact({"format": "gst-moe-adapter", "version": 1, "hidden_size": 16, "num_experts": 4,
                                      "top_k": 2, "intermediate_size": 8, "routing": "qwen2_moe",
                                      "norm_topk_prob": False, "shared_expert_intermediate_size": 12}),
        "hf-mixtral.json": compact({"model_type": "mixtral", "hidden_size": 32, "num_local_experts": 8,
                                    "num_experts_per_tok": 2, "intermediate_size": 64}),
        "hf-qwen2-moe.json": compact({"model_type": "qwen2_moe", "hidden_size": 32, "num_experts": 6,
                                      "num_experts_per_tok": 4, "moe_intermediate_size": 16, "norm_topk_prob": True,
                                      "shared_expert_intermediate_size": 40}),
        "topk-too-big.json": compact({"format": "gst-moe-adapter", "version": 1, "hidden_size": 4, "num_experts": 2,
                                      "top_k": 3, "intermediate_size": 4}),
        "version-2.json": '{"format": "gst-moe-adapter", "version": 2}',
        "shared-mixtral.json": compact({"format": "gst-moe-adapter", "version": 1, "hidden_size": 4, "num_experts": 2,
                                        "top_k": 1, "intermediate_size": 4, "shared_expert_intermediate_size": 4}),
    }, keys


# ----- tokenizer -----

def tokenizer_file_seeds():
    with open(os.path.join(ROOT, "models/clip-tokenizer/vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(ROOT, "models/clip-tokenizer/merges.txt"), encoding="utf-8") as f:
        merge_lines = f.read().split("\n")
    n = 24
    # CLIP's layout: 256 byte symbols, the same with "</w>", then one token per merge, then the
    # two special tokens. A small real vocabulary keeps the byte symbols of "a".."z" and the first merges.
    by_id = {v: k for k, v in vocab.items()}
    letters = [k for k in vocab if len(k) == 1 and k.isalpha() and k.islower() and vocab[k] < 256]
    small = {k: vocab[k] for k in letters}
    small.update({k + "</w>": vocab[k + "</w>"] for k in letters})
    small.update({by_id[512 + i]: 512 + i for i in range(n)})
    small["<|startoftext|>"] = vocab["<|startoftext|>"]
    small["<|endoftext|>"] = vocab["<|endoftext|>"]
    merges = "\n".join(merge_lines[: n + 1]) + "\n"
    tiny_vocab = compact({"<|startoftext|>": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "ab</w>": 4, "b</w>": 5})
    return {
        "clip-head.bin": (compact(small) + "\0" + merges).encode("utf-8"),
        "tiny.bin": (tiny_vocab + "\0#version: 0.2\na b</w>\n").encode(),
        "no-merges.bin": (tiny_vocab + "\0#version: 0.2\n").encode(),
        "no-special.bin": b'{"a": 0, "b": 1}\0#version: 0.2\na b\n',
        "bad-merge.bin": (tiny_vocab + "\0#version: 0.2\na b c\n").encode(),
        "no-version.bin": (tiny_vocab + "\0a b\n").encode(),
        "negative-id.bin": b'{"<|startoftext|>": 0, "<|endoftext|>": -1}\0#version: 0.2\n',
        "vocab-only.bin": tiny_vocab.encode(),
    }, ["<|startoftext|>", "<|endoftext|>", "</w>", "#version: 0.2", "\x00", "\n"]


def tokenizer_text_seeds():
    return {
        "plain.txt": "a photo of a red striped mug",
        "specials.txt": "<|startoftext|>Hello <|endoftext|>world<|endoft",
        "html.txt": "fish &amp; chips &lt;3 &eacute;t&eacute; &#233; &#x1F600; &nbsp;",
        "html-after-lt.txt": "<b>bold</b> &amp; not unescaped",
        "html5.txt": "&check; &fjlig; &NotEqualTilde; &EACUTE; &SZLIG; &nTILDE; &Tab;&NewLine; &zwnj;",
        "mojibake.txt": "cafÃ© crÃ¨me â€œquotedâ€\x9d naÃ¯ve",
        "ligatures.txt": "\ufb01sh \ufb02ower \ufb00 \ufb03",
        "fullwidth.txt": "\uff21\uff22\uff23\uff11\uff12\uff13 \uff76\uff80\uff76\uff85",
        "quotes.txt": "\u2018single\u2019 \u201cdouble\u201d \u2014 dash\u2026",
        "controls.txt": "\ufeffBOM \x1b[31mred\x1b[0m \u0085next\u200bzero\u00ad soft\r\nline",
        "c1.txt": "\u0080\u0093smart\u0094 \u0099",
        "combining.txt": "e\u0301 A\u030a \u0041\u0308\u0304",
        "scripts.txt": "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
                       "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \U0001f600\U0001f44d\U0001f3fd",
        "contractions.txt": "it's we've they're I'M don't 's 't",
        "digits.txt": "1234567890 3.14159 -42 1e10 0x1f",
        "long-word.txt": "supercalifragilisticexpialidocious" * 6,
        "whitespace.txt": " \t\n\u00a0\u3000  spaced   out \n",
        "nul.txt": b"before\x00after",
        "invalid-utf8.txt": b"ok \xff\xfe bad \xc3",
        "surrogate.txt": b"\xed\xa0\x80 lone surrogate",
        "empty.txt": b"",
    }


# ----- JSON Lines tables -----

def item_table_seeds():
    def table(header, items, count, dim, hnsw=False, trailing="\n"):
        text = "\n".join([compact(header)] + [compact(i) for i in items]) + trailing
        return text.encode() + bytes([1 if hnsw else 0, dim - 1, count])

    prov = {"encoder": "clip", "encoder_fingerprint": "0123456789abcdef", "adapter": "adapter",
            "adapter_fingerprint": "fedcba9876543210"}
    head = {"format": "gst-moe-items", "version": 1, "count": 3, "dim": 8, "index_type": "flat", "provenance": prov}
    items = [{"item": i, "id": "st%05d" % i, "uri": "file:///catalog/st%05d.png" % i, "caption": "a red mug %d" % i}
             for i in range(3)]
    no_prov = dict(head, count=2, dim=16, index_type="hnsw")
    del no_prov["provenance"]
    keys = ["format", "gst-moe-items", "version", "count", "dim", "index_type", "flat", "hnsw", "provenance",
            "encoder", "encoder_fingerprint", "adapter", "adapter_fingerprint", "item", "id", "uri", "caption",
            "fields"]
    return {
        "flat-3.bin": table(head, items, 3, 8),
        "hnsw-2-no-provenance.bin": table(no_prov, items[:2], 2, 16, hnsw=True, trailing=""),
        "empty-index.bin": table(dict(head, count=0), [], 0, 8),
        "minimal-items.bin": table(dict(head, count=2), [{"item": 0}, {"item": 1, "id": "x"}], 2, 8),
        "out-of-order.bin": table(head, [items[1], items[0], items[2]], 3, 8),
        "too-many.bin": table(dict(head, count=1), items[:2], 1, 8),
        "count-mismatch.bin": table(head, items, 2, 8),
        "no-fingerprint.bin": table(dict(head, provenance=dict(prov, encoder_fingerprint="")), items, 3, 8),
        "blank-line.bin": table(dict(head, count=1), [], 1, 8, trailing="\n\n"),
        # catalog fields kept per item (an object), and one that is not an object (refused)
        "fields.bin": table(head, [dict(items[0], fields={"price": 12.5, "tags": ["a", "b"]}), items[1],
                                   dict(items[2], fields={})], 3, 8),
        "fields-not-object.bin": table(dict(head, count=1), [dict(items[0], fields=[1, 2])], 1, 8),
        "empty.bin": bytes([0, 0, 0]),
    }, keys


def catalog_seeds():
    with open(os.path.join(ROOT, "models/default/catalog/catalog.jsonl")) as f:
        real = "".join(f.readline() for _ in range(3))
    return {
        "demo-catalog.jsonl": real,
        "ids-and-paths.jsonl": '{"path": "a.png", "caption": "a red square", "id": "A"}\n'
                               '{"path": "b.png", "caption": "blue"}\n\n'
                               '{"path": "/abs/c.png", "id": 42}\n'
                               '{"path": "../up/d.png", "id": "", "caption": ""}\n',
        "malformed.jsonl": '{not json\n[1, 2]\n{"caption": "no path", "id": "np"}\n{"path": ""}\n'
                           '{"path": 3}\n{"path": "x.png", "id": 1.5}\n{"path": "x.png", "caption": ["c"]}\n',
        "unicode.jsonl": '{"path": "caf\\u00e9/\\u65e5\\u672c.png", "caption": "\\ud83d\\ude00", "id": "\\u0000x"}\n',
        "crlf.jsonl": '{"path": "a.png"}\r\n \t\r\n{"path": "dir/.hidden", "caption": null}\r\n',
        "deep.jsonl": '{"path": "a.png", "attributes": ' + "[" * 70 + "]" * 70 + "}\n",
        # the line's other members travel as the item's fields
        "fields.jsonl": '{"path": "a.png", "id": "SKU-001", "price": 12.5, "stock": true, "tags": ["red"]}\n'
                        '{"path": "b.png", "category": {"name": "mug", "level": 2}, "price": null}\n',
    }, ["path", "caption", "id", "attributes", ".png", "/", "../", "\n", "\r"]


def query_seeds():
    with open(os.path.join(CORPUS, "fuzz_image_decode", "rgb-4x3.png"), "rb") as f:
        tiny_png = base64.b64encode(f.read()).decode()
    wrapped = "\n".join(tiny_png[i:i + 76] for i in range(0, len(tiny_png), 76))
    return {
        "text.json": '{"id": "q1", "text": "red striped mug"}',
        "image-path.json": '{"id": 2, "image": "mugs/mug.jpg", "k": 5}',
        "image-uri.json": '{"id": "q3", "image": "file:///srv/images/a%20b.png"}',
        "image-base64.json": compact({"id": "q4", "image_base64": tiny_png, "k": 1024}),
        "image-base64-wrapped.json": json.dumps({"id": "q5", "image_base64": wrapped}),
        "extra-members.json": '{"id": "q6", "text": "lamp", "client": {"name": "demo", "v": [1, 2]}, "k": 1}',
        "unicode.json": '{"id": "caf\\u00e9 \\ud83d\\ude00", "text": "gr\\u00fcne Lampe \\u65e5\\u672c"}',
        "two-sources.json": '{"id": "q7", "text": "a", "image": "b.png"}',
        "bad-id.json": '{"id": [1, {"x": 2}], "text": "x"}',
        "empty-id.json": '{"id": "", "text": "x"}',
        "no-id.json": '{"text": "no id"}',
        "k-range.json": '{"id": "q8", "text": "t", "k": 0}',
        "k-float.json": '{"id": "q9", "text": "t", "k": 2.5}',
        "bad-base64.json": '{"id": "q10", "image_base64": "ab=c"}',
        "not-object.json": "[1, 2]",
        "deep.json": '{"id": "d", "text": "t", "x": ' + "[" * 40 + "]" * 40 + "}",
        "long-id.json": compact({"id": "i" * 300, "text": "t"}),
        "invalid.json": '{"id": "q", "text": "unterminated',
        "knobs.json": '{"id": "q11", "text": "mug", "nprobe": 32, "ef_search": 128}',
        "filter.json": ('{"id": "q12", "text": "mug", "filter": {"category": "mug", "colour": {"in": ["red", "blue"]}, '
                        '"price": {"gte": 10, "lt": 20.5}, "in_stock": true}}'),
        "filter-bad.json": '{"id": "q13", "text": "mug", "filter": {"price": {"between": [1, 2]}, "c": null}}',
        "hybrid.json": compact({"id": "q14", "text": "in red", "image_base64": tiny_png}),
        "upsert.json": ('{"id": "u1", "op": "upsert", "item": {"id": "sku-9", "caption": "a red mug", '
                        '"uri": "file:///srv/sku-9.png", "fields": {"price": 12.5, "tags": ["a"]}}, "text": "red mug"}'),
        "delete.json": '{"id": "d1", "op": "delete", "items": ["sku-9", "sku-10"]}',
        "op-bad.json": '{"id": "d2", "op": "truncate", "items": [1]}',
    }, ["id", "text", "image", "image_base64", "k", "file://", "1024", "\n", "=", "nprobe", "ef_search", "filter",
        "in", "gt", "gte", "lt", "lte", "op", "search", "upsert", "delete", "item", "items", "caption", "uri",
        "fields", "vector"]


def main():
    write_target("fuzz_image_decode", image_seeds(), keys=None)
    write_target("fuzz_safetensors", safetensors_seeds(),
                 keys=["__metadata__", "dtype", "shape", "data_offsets", "F32", "F16", "BF16", "I64", "I32", "I8",
                       "U8", "format", "pt"])
    for target, fn in [("fuzz_clip_config", clip_config_seeds), ("fuzz_preprocessor_config", preprocessor_seeds),
                       ("fuzz_adapter_config", adapter_seeds), ("fuzz_tokenizer_files", tokenizer_file_seeds),
                       ("fuzz_ann_item_table", item_table_seeds), ("fuzz_catalog_line", catalog_seeds),
                       ("fuzz_query_request", query_seeds)]:
        seeds, keys = fn()
        write_target(target, seeds, keys)
    write_target("fuzz_tokenizer_text", tokenizer_text_seeds(), keys=None)
    for target in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, target))
        size = sum(os.path.getsize(os.path.join(CORPUS, target, f)) for f in files)
        print("%-28s %3d seeds, %6d bytes" % (target, len(files), size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
