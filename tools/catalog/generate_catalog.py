#!/usr/bin/env python3
"""Procedural product catalog for training and evaluating the default gst-moe model.

Deterministic from --seed (numpy + Pillow only). Renders small RGB product pictures
(shirts, mugs, shoes, bags, hats, bottles, lamps, chairs) with a colour, a pattern, a size and
a background, in two domains:

* ``base``    -- "studio" style: clean flat white or grey backdrop, soft shadow, upright and
                 centred objects, 6 categories (shirt mug shoe bag hat bottle).
* ``shifted`` -- "photographic" style: white / grey / wooden / outdoor backgrounds, vignetting,
                 a warm or cool lighting tint, exposure changes, rotation, off-centre objects,
                 lens blur and sensor noise, and 2 categories unseen in base (lamp, chair).

Splits (folder per split, each with ``catalog.jsonl`` and the PNGs next to it):

    base-train, base-test            base domain
    shifted-train                    shifted domain, for adaptation
    shifted-test                     shifted domain, held-out items (the search index)
    base-wild                        the 6 base categories in the shifted domain's photographic
                                     style (backgrounds, tints, rotation, blur, noise); no lamp or
                                     chair. Extra pre-training data for the base CLIP.

plus ``queries.jsonl`` (natural text queries over shifted-test), ``queries-base.jsonl``
(over base-test) and ``composed-queries.jsonl`` (hybrid image + text queries, see below). A text
query is relevant to every item whose attributes match every attribute the query names.
``catalog.jsonl`` lines::

    {"id": "st00012", "path": "st00012.png", "caption": "a small red striped mug on a wooden table",
     "attributes": {"category": "mug", "colour": "red", "pattern": "striped", "size": "small",
                    "background": "wooden", "domain": "shifted"}}

``queries.jsonl`` lines: {"id", "text", "attributes" (the ones the query names), "relevant": [ids]}.

Composed queries (issue 18): a source picture plus a modifier text ("in red", "as a large one",
"on a wooden table") that changes exactly one attribute; the target is the source's attributes
with that one changed. Each query has a freshly rendered photographic source picture (in
``composed/``, never an index item) made from its target item with one attribute swapped:

    train      targets in shifted-train (relevant ids there), train phrasings only
    val, test  targets in shifted-test (one query per item, split at random), relevant = every
               shifted-test item with the target's five attributes; half of them use phrasings
               never used in training (``"phrasing": "held-out"``)

``composed-queries.jsonl`` lines::

    {"id": "cv000", "image": "composed/cv000.png", "text": "in red", "relevant": ["st00012"],
     "split": "val", "attribute": "colour", "phrasing": "seen"}

Usage::

    python3 tools/catalog/generate_catalog.py --out build-train/catalog --seed 2024
"""

import argparse
import json
import os
import shutil
import time

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

BASE_CATEGORIES = ["shirt", "mug", "shoe", "bag", "hat", "bottle"]
NEW_CATEGORIES = ["lamp", "chair"]
CATEGORIES = BASE_CATEGORIES + NEW_CATEGORIES
COLOURS = {
    "red": (200, 30, 35), "blue": (35, 70, 205), "green": (40, 150, 55),
    "yellow": (240, 210, 40), "black": (28, 28, 30), "white": (246, 246, 244),
    "orange": (245, 130, 20), "purple": (125, 45, 170), "pink": (245, 135, 185),
    "grey": (128, 128, 128),
}
PATTERNS = ["plain", "striped", "dotted", "checked"]
SIZES = ["small", "large"]
BASE_BACKGROUNDS = ["white", "grey"]
SHIFTED_BACKGROUNDS = ["white", "grey", "wooden", "outdoor"]
ATTRIBUTE_ORDER = ["size", "colour", "pattern", "category", "background"]

SPLITS = {  # name: (id prefix, domain, default count)
    "base-train": ("bt", "base", 3000),
    "base-test": ("bv", "base", 300),
    "shifted-train": ("sa", "shifted", 1000),
    "shifted-test": ("st", "shifted", 300),
    # Added after the four above (split numbers, hence their pictures, are unchanged): the base
    # categories in the photographic style, for pre-training the base CLIP on a broader domain.
    "base-wild": ("bw", "base-wild", 2000),
}
PHOTO_DOMAINS = ("shifted", "base-wild")  # rendered in the photographic style

# Object aspect ratio (width / height) of each silhouette's bounding box.
ASPECT = {"shirt": 1.0, "mug": 1.1, "shoe": 1.7, "bag": 1.0, "hat": 1.5, "bottle": 0.45,
          "lamp": 0.75, "chair": 0.75}

SS = 4  # supersampling factor for anti-aliased shapes


# ------------------------------------------------------------------------- captions

BG_PHRASES = {
    "white": ["on a white background", "on white"],
    "grey": ["on a grey background", "on grey"],
    "wooden": ["on a wooden table", "on wood"],
    "outdoor": ["outdoors", "outside"],
}


def canonical_caption(attrs):
    """'a small red striped mug on a white background' ('plain' is named too)."""
    return "a %s %s %s %s %s" % (attrs["size"], attrs["colour"], attrs["pattern"],
                                 attrs["category"], BG_PHRASES[attrs["background"]][0])


def phrase(named, rng, prefix_choices=("", "a ", "a photo of a ")):
    """Text naming exactly the attributes in `named` (a dict), in natural order.

    The noun is the category, or 'item'/'product' when the category is not named.
    """
    words = [named[k] for k in ("size", "colour", "pattern") if k in named]
    noun = named.get("category") or ["item", "product"][int(rng.integers(2))]
    text = " ".join(words + [noun])
    prefix = prefix_choices[int(rng.integers(len(prefix_choices)))]
    text = prefix + text
    if "background" in named:
        opts = BG_PHRASES[named["background"]]
        text += " " + opts[int(rng.integers(len(opts)))]
    return text


def random_caption(attrs, rng):
    """A training caption variant: (text, the attributes it names).

    A random subset of the attributes with random phrasing, or (15 %) the canonical caption.
    """
    if rng.random() < 0.15:
        return canonical_caption(attrs), {k: attrs[k] for k in ATTRIBUTE_ORDER}
    keep_p = {"category": 0.9, "colour": 0.85, "pattern": 0.6, "size": 0.5, "background": 0.5}
    named = {k: attrs[k] for k in ATTRIBUTE_ORDER if rng.random() < keep_p[k]}
    if not named:
        named = {"category": attrs["category"]}
    return phrase(named, rng), named


# ------------------------------------------------------------------------- drawing


def _pts(box, rel):
    x0, y0, w, h = box
    return [(x0 + u * w, y0 + v * h) for u, v in rel]


def _rect(box, u0, v0, u1, v1):
    x0, y0, w, h = box
    return [x0 + u0 * w, y0 + v0 * h, x0 + u1 * w, y0 + v1 * h]


def draw_silhouette(draw, det, cat, box):
    """Fill the object mask (draw, 255) and dark detail lines (det, 255)."""
    x0, y0, w, h = box
    lw = max(2, int(0.025 * max(w, h)))
    if cat == "shirt":
        draw.polygon(_pts(box, [(0.36, 0.04), (0.5, 0.15), (0.64, 0.04), (0.96, 0.24), (0.86, 0.46),
                                (0.76, 0.4), (0.76, 0.97), (0.24, 0.97), (0.24, 0.4), (0.14, 0.46),
                                (0.04, 0.24)]), fill=255)
        det.line(_pts(box, [(0.36, 0.04), (0.5, 0.15), (0.64, 0.04)]), fill=255, width=lw)
    elif cat == "mug":
        draw.ellipse(_rect(box, 0.56, 0.28, 0.98, 0.78), fill=255)
        draw.ellipse(_rect(box, 0.66, 0.39, 0.89, 0.67), fill=0)
        draw.rounded_rectangle(_rect(box, 0.04, 0.1, 0.74, 0.97), radius=int(0.08 * w), fill=255)
        det.ellipse(_rect(box, 0.04, 0.06, 0.74, 0.16), outline=255, width=lw)
    elif cat == "shoe":
        draw.polygon(_pts(box, [(0.02, 0.96), (0.02, 0.62), (0.12, 0.52), (0.36, 0.48), (0.46, 0.12),
                                (0.7, 0.06), (0.73, 0.42), (0.9, 0.56), (0.98, 0.72), (0.98, 0.96)]),
                     fill=255)
        det.line(_pts(box, [(0.02, 0.84), (0.98, 0.84)]), fill=255, width=lw)
        det.line(_pts(box, [(0.5, 0.3), (0.62, 0.5)]), fill=255, width=lw)
    elif cat == "bag":
        draw.ellipse(_rect(box, 0.24, 0.02, 0.76, 0.7), fill=255)
        draw.ellipse(_rect(box, 0.32, 0.1, 0.68, 0.62), fill=0)
        draw.polygon(_pts(box, [(0.1, 0.38), (0.9, 0.38), (0.99, 0.98), (0.01, 0.98)]), fill=255)
        det.line(_pts(box, [(0.08, 0.5), (0.92, 0.5)]), fill=255, width=lw)
    elif cat == "hat":
        draw.ellipse(_rect(box, 0.0, 0.62, 1.0, 0.98), fill=255)
        draw.pieslice(_rect(box, 0.2, 0.05, 0.8, 0.95), 180, 360, fill=255)
        draw.rectangle(_rect(box, 0.2, 0.49, 0.8, 0.8), fill=255)
        det.line(_pts(box, [(0.2, 0.66), (0.8, 0.66)]), fill=255, width=2 * lw)
    elif cat == "bottle":
        draw.rounded_rectangle(_rect(box, 0.08, 0.36, 0.92, 0.99), radius=int(0.12 * w), fill=255)
        draw.polygon(_pts(box, [(0.08, 0.44), (0.34, 0.2), (0.66, 0.2), (0.92, 0.44)]), fill=255)
        draw.rectangle(_rect(box, 0.34, 0.06, 0.66, 0.24), fill=255)
        draw.rectangle(_rect(box, 0.3, 0.0, 0.7, 0.09), fill=255)
        det.rectangle(_rect(box, 0.3, 0.0, 0.7, 0.09), fill=255)
    elif cat == "lamp":
        draw.polygon(_pts(box, [(0.28, 0.02), (0.72, 0.02), (0.97, 0.42), (0.03, 0.42)]), fill=255)
        draw.rectangle(_rect(box, 0.45, 0.42, 0.55, 0.9), fill=255)
        draw.ellipse(_rect(box, 0.18, 0.84, 0.82, 0.99), fill=255)
        det.line(_pts(box, [(0.03, 0.42), (0.97, 0.42)]), fill=255, width=lw)
    elif cat == "chair":
        draw.rectangle(_rect(box, 0.14, 0.0, 0.86, 0.46), fill=255)
        draw.rectangle(_rect(box, 0.05, 0.46, 0.95, 0.6), fill=255)
        for u0, u1, v1 in [(0.06, 0.16, 1.0), (0.84, 0.94, 1.0), (0.26, 0.33, 0.9), (0.67, 0.74, 0.9)]:
            draw.rectangle(_rect(box, u0, 0.6, u1, v1), fill=255)
        det.line(_pts(box, [(0.05, 0.6), (0.95, 0.6)]), fill=255, width=lw)
    else:
        raise ValueError(cat)


def luminance(c):
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]


def pattern_field(pattern, box, R, rng):
    """[R, R] float in [0, 1]: 1 where the secondary tone shows (object box coordinates)."""
    x0, y0, w, h = box
    yy, xx = np.mgrid[0:R, 0:R].astype(np.float32)
    size = max(w, h)
    if pattern == "plain":
        return np.zeros((R, R), np.float32)
    if pattern == "striped":
        period = size / rng.uniform(5.0, 7.0)
        coord = (yy - y0) if rng.random() < 0.6 else (xx - x0)
        return ((coord / period) % 1.0 < 0.42).astype(np.float32)
    if pattern == "dotted":
        period = size / rng.uniform(5.0, 6.5)
        ox, oy = rng.uniform(0, period, 2)
        fx = ((xx - x0 + ox) / period) % 1.0 - 0.5
        fy = ((yy - y0 + oy) / period) % 1.0 - 0.5
        return (fx * fx + fy * fy < 0.27 ** 2).astype(np.float32)
    if pattern == "checked":
        period = size / rng.uniform(4.0, 5.5)
        a = np.floor((xx - x0) / period) + np.floor((yy - y0) / period)
        return (a % 2 == 1).astype(np.float32)
    raise ValueError(pattern)


def studio_background(name, R, rng):
    if name == "white":
        c = np.array([248, 248, 246], np.float32) + rng.normal(0, 2, 3)
    else:
        c = np.array([186, 186, 188], np.float32) + rng.normal(0, 1.5, 3)
    return np.broadcast_to(c, (R, R, 3)).copy()


def photo_background(name, R, rng):
    yy, xx = np.mgrid[0:R, 0:R].astype(np.float32) / R
    if name in ("white", "grey"):
        base = np.array([238, 238, 235] if name == "white" else [150, 151, 154], np.float32)
        base = base + rng.normal(0, 2, 3)
        ang = rng.uniform(0, 2 * np.pi)
        grad = 1.0 + 0.08 * ((xx - 0.5) * np.cos(ang) + (yy - 0.5) * np.sin(ang))
        img = base[None, None, :] * grad[..., None]
    elif name == "wooden":
        base = np.array([150, 100, 58], np.float32) * rng.uniform(0.8, 1.15) + rng.normal(0, 6, 3)
        f = rng.uniform(10, 18)
        ph = rng.uniform(0, 2 * np.pi, 2)
        wob = 0.25 * np.sin(xx * rng.uniform(2, 5) + ph[0])
        grain = 0.5 + 0.5 * np.sin(2 * np.pi * (yy * f + wob) + ph[1])
        img = base[None, None, :] * (0.78 + 0.3 * grain[..., None])
        nplank = int(rng.integers(2, 4))
        for k in range(1, nplank + 1):  # dark seams between planks
            y = (k / (nplank + 1) + rng.uniform(-0.05, 0.05)) * R
            img[max(0, int(y) - 2):int(y) + 2] *= 0.6
    elif name == "outdoor":
        horizon = rng.uniform(0.55, 0.75)
        sky_top = np.array([95, 150, 225], np.float32) + rng.normal(0, 10, 3)
        sky_bot = np.array([200, 225, 245], np.float32) + rng.normal(0, 6, 3)
        grass = np.array([70, 135, 55], np.float32) + rng.normal(0, 10, 3)
        t = np.clip(yy / horizon, 0, 1)[..., None]
        img = sky_top * (1 - t) + sky_bot * t
        ground = yy > horizon + 0.02 * np.sin(xx * 9 + rng.uniform(0, 6))
        tex = 0.85 + 0.3 * rng.random((R // 8, R // 8)).repeat(8, 0).repeat(8, 1)
        img[ground] = (grass[None, :] * tex[ground][:, None])
    else:
        raise ValueError(name)
    return img.astype(np.float32)


def render(attrs, rng, out_px):
    """uint8 [out_px, out_px, 3] picture of one catalog item."""
    R = out_px * SS
    shifted = attrs["domain"] in PHOTO_DOMAINS
    cat = attrs["category"]

    # ---- object box
    if attrs["size"] == "small":
        s = rng.uniform(0.42, 0.55)
    else:
        s = rng.uniform(0.8, 0.92)
    a = ASPECT[cat]
    w, h = (s * R, s * R / a) if a >= 1 else (s * R * a, s * R)
    jitter = 0.35 if shifted else 0.12
    cx = R / 2 + rng.uniform(-1, 1) * jitter * (R - w) / 2
    cy = R / 2 + rng.uniform(-1, 1) * jitter * (R - h) / 2
    box = (cx - w / 2, cy - h / 2, w, h)

    # ---- mask + details
    mask_im = Image.new("L", (R, R), 0)
    det_im = Image.new("L", (R, R), 0)
    draw_silhouette(ImageDraw.Draw(mask_im), ImageDraw.Draw(det_im), cat, box)

    # ---- colours
    c1 = np.array(COLOURS[attrs["colour"]], np.float32) + rng.normal(0, 7, 3)
    neutral = np.array([40, 40, 40] if luminance(c1) > 150 else [235, 235, 235], np.float32)
    mix = 0.55 if attrs["pattern"] == "checked" else 0.85
    c2 = (1 - mix) * c1 + mix * neutral
    pat = pattern_field(attrs["pattern"], box, R, rng)[..., None]
    obj = c1 * (1 - pat) + c2 * pat
    # simple light falloff across the object
    yy, xx = np.mgrid[0:R, 0:R].astype(np.float32)
    shade = 1.05 - 0.18 * (((xx - box[0]) / w + (yy - box[1]) / h) / 2)
    obj = obj * np.clip(shade, 0.8, 1.06)[..., None]
    outline_c = c1 * 0.45 if luminance(c1) > 60 else c1 + 70
    mask = np.asarray(mask_im, np.float32) / 255.0
    soft = np.asarray(mask_im.filter(ImageFilter.GaussianBlur(2.5)), np.float32) / 255.0
    edge = (soft > 0.1).astype(np.float32) - (soft > 0.9).astype(np.float32)  # outline band
    det = np.asarray(det_im, np.float32) / 255.0
    line = np.clip(np.maximum(edge, det), 0, 1)[..., None]
    obj = obj * (1 - line) + outline_c * line
    alpha = np.clip(np.maximum(mask, edge), 0, 1)

    # ---- rotation (shifted domain): rotate object layer and its alpha together
    if shifted:
        ang = rng.uniform(-15, 15)
        layer = np.concatenate([obj, alpha[..., None] * 255], axis=2)
        layer_im = Image.fromarray(np.clip(layer, 0, 255).astype(np.uint8), "RGBA")
        layer_im = layer_im.rotate(ang, resample=Image.BICUBIC, center=(cx, cy))
        layer = np.asarray(layer_im, np.float32)
        obj, alpha = layer[..., :3], layer[..., 3] / 255.0

    # ---- background + shadow
    bg = photo_background(attrs["background"], R, rng) if shifted else \
        studio_background(attrs["background"], R, rng)
    sh = Image.fromarray((alpha * 255).astype(np.uint8), "L")
    off = (int(R * rng.uniform(0.01, 0.04)), int(R * rng.uniform(0.02, 0.05))) if shifted else \
        (0, int(R * 0.02))
    sh = sh.transform(sh.size, Image.AFFINE, (1, 0, -off[0], 0, 1, -off[1]))
    sh = np.asarray(sh.filter(ImageFilter.GaussianBlur(R * 0.03)), np.float32) / 255.0
    bg = bg * (1 - (0.35 if shifted else 0.18) * sh[..., None])
    img = bg * (1 - alpha[..., None]) + obj * alpha[..., None]

    # ---- downsample (anti-aliasing)
    im = Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")
    im = im.resize((out_px, out_px), Image.BOX)

    if shifted:  # photographic look: blur, tint, exposure, vignette, sensor noise
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.7)))
        x = np.asarray(im, np.float32)
        tone = rng.integers(3)
        if tone == 0:
            tint = np.array([1.1, 1.0, 0.82])
        elif tone == 1:
            tint = np.array([0.88, 0.97, 1.12])
        else:
            tint = np.array([1.0, 1.0, 1.0])
        tint = tint * (1 + rng.normal(0, 0.03, 3)) * rng.uniform(0.9, 1.08)
        yy, xx = np.mgrid[0:out_px, 0:out_px].astype(np.float32) / (out_px - 1)
        vig = 1 - rng.uniform(0.1, 0.3) * ((xx - 0.5) ** 2 + (yy - 0.5) ** 2) * 2
        x = x * tint[None, None, :] * vig[..., None]
        x = x + rng.normal(0, rng.uniform(2.0, 4.0), x.shape)
        im = Image.fromarray(np.clip(np.rint(x), 0, 255).astype(np.uint8), "RGB")
    return np.asarray(im)


# ------------------------------------------------------------------------- catalog


def sample_attributes(domain, rng):
    cats = CATEGORIES if domain == "shifted" else BASE_CATEGORIES
    bgs = BASE_BACKGROUNDS if domain == "base" else SHIFTED_BACKGROUNDS
    colours = list(COLOURS)
    return {
        "category": cats[int(rng.integers(len(cats)))],
        "colour": colours[int(rng.integers(len(colours)))],
        "pattern": PATTERNS[int(rng.integers(len(PATTERNS)))],
        "size": SIZES[int(rng.integers(len(SIZES)))],
        "background": bgs[int(rng.integers(len(bgs)))],
        "domain": domain,
    }


def make_split(out_dir, split, count, seed, px):
    prefix, domain, _ = SPLITS[split]
    split_dir = os.path.join(out_dir, split)
    if os.path.isdir(split_dir):
        shutil.rmtree(split_dir)
    os.makedirs(split_dir)
    split_no = list(SPLITS).index(split)
    items = []
    for i in range(count):
        rng = np.random.default_rng([seed, split_no, i])
        attrs = sample_attributes(domain, rng)
        rgb = render(attrs, rng, px)
        item_id = "%s%05d" % (prefix, i)
        path = item_id + ".png"
        Image.fromarray(rgb, "RGB").save(os.path.join(split_dir, path), optimize=True)
        items.append({"id": item_id, "path": path, "caption": canonical_caption(attrs),
                      "attributes": attrs})
    with open(os.path.join(split_dir, "catalog.jsonl"), "w") as fh:
        for it in items:
            fh.write(json.dumps(it) + "\n")
    return items


QUERY_SCHEMAS = [  # attributes a query names (the category always)
    ("colour", "category"), ("colour", "category"), ("colour", "pattern", "category"),
    ("colour", "pattern", "category"), ("size", "colour", "category"),
    ("colour", "category", "background"), ("size", "colour", "category", "background"),
    ("pattern", "category"), ("category", "background"), ("size", "pattern", "category"),
    ("colour", "pattern", "category", "background"),
]


def make_queries(items, seed, count, max_relevant, prefix):
    """Natural queries over `items`; relevant = every item matching all named attributes."""
    rng = np.random.default_rng([seed, 99, len(items)])
    seen, queries = set(), []
    if not items:
        return queries
    tries = 0
    while len(queries) < count and tries < 100 * count:
        tries += 1
        src = items[int(rng.integers(len(items)))]["attributes"]
        schema = QUERY_SCHEMAS[int(rng.integers(len(QUERY_SCHEMAS)))]
        named = {k: src[k] for k in schema}
        key = tuple(sorted(named.items()))
        if key in seen:
            continue
        rel = [it["id"] for it in items if all(it["attributes"][k] == v for k, v in named.items())]
        if len(rel) > max_relevant:
            continue
        seen.add(key)
        text = phrase(named, rng, prefix_choices=("",))
        queries.append({"id": "%s%03d" % (prefix, len(queries)), "text": text,
                        "attributes": {k: named[k] for k in ATTRIBUTE_ORDER if k in named},
                        "relevant": rel})
    return queries


# Modifier templates per attribute: (phrasings used in training, phrasings kept for val/test).
# {v} is the target's value; the held-out ones change only the words around it (the tiny text
# tower only knows the catalog's caption words, so a new value word would be noise, not phrasing).
PATTERN_ALT = {"striped": "with stripes", "dotted": "with dots", "checked": "with checks",
               "plain": "without a pattern"}
MODIFIERS = {
    "colour": (["in {v}", "but {v}", "make it {v}"], ["{v} instead", "the same in {v}"]),
    "size": (["as a {v} one", "a {v} one", "but {v}"], ["{v} instead", "the same but {v}"]),
    "pattern": (["{v}", "but {v}", "{alt}"], ["make it {v}", "the same but {v}"]),
    "category": (["as a {v}", "but a {v}", "make it a {v}"], ["a {v} instead", "the same as a {v}"]),
    "background": (["{bg0}", "but {bg0}", "{bg1}"], ["the same {bg1}", "put it {bg0}"]),
}
COMPOSED_SPLITS = {"train": ("ca", 100), "val": ("cv", 101), "test": ("cx", 102)}  # prefix, seed no


def attribute_values(attribute):
    return {"category": CATEGORIES, "colour": list(COLOURS), "pattern": PATTERNS, "size": SIZES,
            "background": SHIFTED_BACKGROUNDS}[attribute]


def modifier_phrasings(attribute, value):
    """(training phrasings, held-out phrasings) of the change to `value` of `attribute`."""
    bg = BG_PHRASES.get(value, ["", ""])
    return tuple([t.format(v=value, alt=PATTERN_ALT.get(value, ""), bg0=bg[0], bg1=bg[1])
                  for t in pool] for pool in MODIFIERS[attribute])


def modifier_text(attribute, value, rng, held_out_share):
    """(text, 'seen' | 'held-out') naming `value` of `attribute` as a change."""
    seen, held = modifier_phrasings(attribute, value)
    held_out = rng.random() < held_out_share
    pool = held if held_out else seen
    return pool[int(rng.integers(len(pool)))], ("held-out" if held_out else "seen")


def make_composed(out_dir, targets_by_split, seed, px, relevant_pool):
    """Composed queries: per (split, target item) a fresh source picture with one attribute of
    the target swapped, and the modifier text naming the target's value. `targets_by_split`:
    {split: [target items]}; `relevant_pool`: {split: items whose full attributes decide
    relevance}. Returns the query rows (image paths relative to `out_dir`)."""
    img_dir = os.path.join(out_dir, "composed")
    if os.path.isdir(img_dir):
        shutil.rmtree(img_dir)
    os.makedirs(img_dir)
    rows = []
    for split, targets in targets_by_split.items():
        prefix, split_no = COMPOSED_SPLITS[split]
        pool = relevant_pool[split]
        for i, target in enumerate(targets):
            rng = np.random.default_rng([seed, split_no, i])
            attribute = ATTRIBUTE_ORDER[int(rng.integers(len(ATTRIBUTE_ORDER)))]
            tattrs = target["attributes"]
            others = [v for v in attribute_values(attribute) if v != tattrs[attribute]]
            source = dict(tattrs, domain="shifted")
            source[attribute] = others[int(rng.integers(len(others)))]
            rgb = render(source, rng, px)
            qid = "%s%05d" % (prefix, i) if split == "train" else "%s%03d" % (prefix, i)
            path = "composed/%s.png" % qid
            Image.fromarray(rgb, "RGB").save(os.path.join(out_dir, path), optimize=True)
            text, phrasing = modifier_text(attribute, tattrs[attribute], rng,
                                           0.0 if split == "train" else 0.5)
            rel = [it["id"] for it in pool
                   if all(it["attributes"][k] == tattrs[k] for k in ATTRIBUTE_ORDER)]
            rows.append({"id": qid, "image": path, "text": text, "relevant": rel, "split": split,
                         "attribute": attribute, "phrasing": phrasing})
    return rows


def composed_targets(splits, seed, per_train_item, n_val):
    """Targets: every shifted-train item `per_train_item` times (train); the shifted-test items
    in a seeded random order, the first `n_val` for val and the rest for test."""
    train = splits["shifted-train"] * per_train_item
    test_items = splits["shifted-test"]
    order = np.random.default_rng([seed, 103]).permutation(len(test_items))
    held = [test_items[j] for j in order]
    return {"train": train, "val": held[:n_val], "test": held[n_val:]}


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="build-train/catalog")
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    for split, (_, _, n) in SPLITS.items():
        ap.add_argument("--" + split, type=int, default=n, metavar="N", help="items (%d)" % n)
    ap.add_argument("--queries", type=int, default=120)
    ap.add_argument("--composed-per-item", type=int, default=3,
                    help="composed training queries per shifted-train item (3)")
    ap.add_argument("--composed-val", type=int, default=100,
                    help="shifted-test items whose composed query is in val (100); the rest: test")
    args = ap.parse_args()

    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    splits = {}
    for split in SPLITS:
        splits[split] = make_split(args.out, split, getattr(args, split.replace("-", "_")),
                                   args.seed, args.size)
        print("%-14s %5d items  (%.1fs)" % (split, len(splits[split]), time.time() - t0))
    q = make_queries(splits["shifted-test"], args.seed, args.queries, 25, "q")
    write_jsonl(os.path.join(args.out, "queries.jsonl"), q)
    qb = make_queries(splits["base-test"], args.seed, args.queries, 25, "b")
    write_jsonl(os.path.join(args.out, "queries-base.jsonl"), qb)
    composed = make_composed(
        args.out, composed_targets(splits, args.seed, args.composed_per_item, args.composed_val),
        args.seed, args.size, {"train": splits["shifted-train"], "val": splits["shifted-test"],
                               "test": splits["shifted-test"]})
    write_jsonl(os.path.join(args.out, "composed-queries.jsonl"), composed)
    n_composed = {k: sum(r["split"] == k for r in composed) for k in COMPOSED_SPLITS}
    print("composed queries: %s; %.1fs" % (n_composed, time.time() - t0))
    manifest = {"generator": "tools/catalog/generate_catalog.py", "seed": args.seed,
                "image_size": args.size, "counts": {k: len(v) for k, v in splits.items()},
                "queries": len(q), "queries_base": len(qb), "composed_queries": n_composed,
                "categories": CATEGORIES,
                "base_categories": BASE_CATEGORIES, "new_categories": NEW_CATEGORIES,
                "colours": list(COLOURS), "patterns": PATTERNS, "sizes": SIZES,
                "backgrounds": SHIFTED_BACKGROUNDS}
    with open(os.path.join(args.out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    rels = [len(x["relevant"]) for x in q] or [0]
    print("queries: %d over shifted-test (relevant per query: min %d, median %d, max %d), "
          "%d over base-test; %.1fs" % (len(q), min(rels), int(np.median(rels)), max(rels), len(qb),
                                         time.time() - t0))


if __name__ == "__main__":
    main()
