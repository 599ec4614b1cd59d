"""Shared pieces of the gst-moe training tools (tools/train/*.py).

Import this module before torch: it pins every math library to one thread (the tools run on
shared developer machines; see docs/adaptation.md).
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from st_canonical import canonicalize as canonical_safetensors, fresh_dir  # noqa: E402,F401

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import transformers  # noqa: E402
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "models", "clip-tokenizer")
TOKENIZER_FILES = ["vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "catalog"))
import generate_catalog as catalog  # noqa: E402

ATTRS = catalog.ATTRIBUTE_ORDER  # size colour pattern category background
EOS = 49407
TRAIN_TEXT_LEN = 32  # captions are < 20 tokens; the causal text tower ignores padding after eos


# ------------------------------------------------------------------------ model


def eager_kwargs():
    try:
        CLIPConfig(attn_implementation="eager")
        return {"attn_implementation": "eager"}
    except TypeError:
        return {}


def tiny_clip_config(image_size=64):
    """The default model's architecture: a small ViT/16 image tower and a 4-layer text tower."""
    text_cfg = dict(vocab_size=49408, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
                    bos_token_id=49406, eos_token_id=EOS, pad_token_id=1, projection_dim=128)
    vision_cfg = dict(image_size=image_size, patch_size=16, hidden_size=128, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, hidden_act="quick_gelu",
                      num_channels=3, projection_dim=128)
    return CLIPConfig(text_config=text_cfg, vision_config=vision_cfg, projection_dim=128,
                      **eager_kwargs())


def load_clip(model_dir):
    """A CLIP directory as the engine sees it: the saved (fp16) weights widened to fp32."""
    return CLIPModel.from_pretrained(model_dir, torch_dtype=torch.float32, **eager_kwargs()).eval()


def count_params(params):
    return int(sum(p.numel() for p in params))


# ------------------------------------------------------------------------- data


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_split(catalog_dir, split):
    d = os.path.join(catalog_dir, split)
    items = read_jsonl(os.path.join(d, "catalog.jsonl"))
    for it in items:
        it["abspath"] = os.path.join(d, it["path"])
    return items


def image_processor(image_size=64):
    return CLIPImageProcessor(size={"shortest_edge": image_size},
                              crop_size={"height": image_size, "width": image_size})


def load_pixels(paths, processor, chunk=256):
    """CLIPImageProcessor pixel values [N, 3, S, S] (fp32) of image files."""
    out = []
    for i in range(0, len(paths), chunk):
        ims = []
        for p in paths[i:i + chunk]:
            with Image.open(p) as im:
                ims.append(im.convert("RGB"))
        out.append(torch.from_numpy(processor(images=ims, return_tensors="np")["pixel_values"]))
    return torch.cat(out).float()


class Tokens:
    """CLIP's slow tokenizer with a cache; pads with eos like CLIPTokenizer does."""

    def __init__(self, tokenizer_dir=TOKENIZER_DIR):
        self.tok = CLIPTokenizer.from_pretrained(tokenizer_dir)
        self.cache = {}

    def ids(self, text):
        ids = self.cache.get(text)
        if ids is None:
            ids = self.tok(text, truncation=True, max_length=77)["input_ids"]
            self.cache[text] = ids
        return ids

    def batch(self, texts, length=TRAIN_TEXT_LEN):
        ids = torch.full((len(texts), length), EOS, dtype=torch.long)
        mask = torch.zeros((len(texts), length), dtype=torch.long)
        for i, t in enumerate(texts):
            x = self.ids(t)[:length]
            if x[-1] != EOS:
                x[-1] = EOS
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1
        return ids, mask

    def engine_batch(self, texts):
        """As the engine tokenizes: truncation and padding to 77."""
        enc = self.tok(texts, truncation=True, max_length=77, padding="max_length",
                       return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]


class AttrCodes:
    """Attributes as integer codes, for the caption/image match matrix."""

    def __init__(self):
        self.vocab = {k: {} for k in ATTRS}

    def code(self, k, v):
        return self.vocab[k].setdefault(v, len(self.vocab[k]))

    def full(self, attrs):
        return np.array([self.code(k, attrs[k]) for k in ATTRS], np.int64)

    def named(self, named):
        """codes, with -1 where the caption does not name the attribute."""
        return np.array([self.code(k, named[k]) if k in named else -1 for k in ATTRS], np.int64)


def match_matrix(caption_codes, item_codes):
    """[T, I] bool: caption t describes item i (every attribute it names matches)."""
    c = caption_codes[:, None, :]
    return torch.from_numpy(np.all((c < 0) | (c == item_codes[None, :, :]), axis=2))


def contrastive_loss(txt, img, logit_scale, match):
    """CLIP's symmetric cross-entropy over the batch similarity matrix.

    `match[t, i]` marks every image a caption describes (a partial caption such as "red mug"
    can fit several images of a batch); the targets are spread uniformly over those, so such
    images are not pushed away as negatives. With unique captions this is exactly CLIP's loss.
    """
    txt = F.normalize(txt, dim=-1)
    img = F.normalize(img, dim=-1)
    logits = logit_scale.exp() * txt @ img.t()
    m = match.float()
    t2i = -(m / m.sum(1, keepdim=True) * F.log_softmax(logits, dim=1)).sum(1).mean()
    i2t = -(m / m.sum(0, keepdim=True) * F.log_softmax(logits, dim=0)).sum(0).mean()
    return 0.5 * (t2i + i2t)


def augment(px, rng):
    """Random flip + small affine jitter (rotation +-15 deg, scale 0.9-1.1, shift +-6 px at 64 px)
    with edge replication. Captions never name position or orientation, so labels stay valid."""
    n = px.shape[0]
    ang = np.deg2rad(rng.uniform(-15, 15, n))
    sc = rng.uniform(0.9, 1.1, n)
    flip = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    tx, ty = rng.uniform(-0.2, 0.2, (2, n))
    theta = np.zeros((n, 2, 3))
    theta[:, 0, 0] = flip * np.cos(ang) / sc
    theta[:, 0, 1] = -np.sin(ang) / sc
    theta[:, 1, 0] = flip * np.sin(ang) / sc
    theta[:, 1, 1] = np.cos(ang) / sc
    theta[:, 0, 2], theta[:, 1, 2] = tx, ty
    grid = F.affine_grid(torch.from_numpy(theta).float(), list(px.shape), align_corners=False)
    return F.grid_sample(px, grid, mode="bilinear", padding_mode="border", align_corners=False)


class PairSampler:
    """Random (caption variant, augmented image) batches of one catalog split."""

    def __init__(self, items, pixels, seed):
        self.items, self.pixels = items, pixels
        self.rng = np.random.default_rng(seed)
        self.codes = AttrCodes()
        self.item_codes = np.stack([self.codes.full(it["attributes"]) for it in items])
        self.perm, self.pos = self.rng.permutation(len(items)), 0

    def indices(self, n):
        out = []
        while len(out) < n:
            if self.pos == len(self.perm):
                self.perm, self.pos = self.rng.permutation(len(self.items)), 0
            take = min(n - len(out), len(self.perm) - self.pos)
            out.extend(self.perm[self.pos:self.pos + take])
            self.pos += take
        return np.array(out)

    def batch(self, n):
        idx = self.indices(n)
        texts, named = [], []
        for i in idx:
            t, nm = catalog.random_caption(self.items[i]["attributes"], self.rng)
            texts.append(t)
            named.append(self.codes.named(nm))
        px = augment(self.pixels[torch.from_numpy(idx)], self.rng)
        match = match_matrix(np.stack(named), self.item_codes[idx])
        return texts, px, match


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def param_groups(named_params, weight_decay):
    decay, no_decay = [], []
    for n, p in named_params:
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "token_embedding" in n or "position_embedding" in n or "logit_scale" in n:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def train_clip(model, sampler, tokens, steps, batch, lr, warmup, weight_decay, log_every=50,
               params=None, label=""):
    """Contrastive training of `model` (a CLIPModel, possibly with LoRA layers)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if params is None \
        else params
    opt = torch.optim.AdamW(param_groups(named, weight_decay), lr=lr, betas=(0.9, 0.98), eps=1e-6)
    model.train()
    log = []
    t0, c0 = time.time(), time.process_time()
    run = 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        texts, px, match = sampler.batch(batch)
        ids, mask = tokens.batch(texts)
        txt = model.get_text_features(input_ids=ids, attention_mask=mask)
        img = model.get_image_features(pixel_values=px)
        loss = contrastive_loss(txt, img, model.logit_scale, match)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        run = loss.item() if step == 0 else 0.95 * run + 0.05 * loss.item()
        if (step + 1) % log_every == 0 or step == steps - 1:
            rec = {"step": step + 1, "loss": round(run, 4), "lr": opt.param_groups[0]["lr"],
                   "logit_scale": round(model.logit_scale.exp().item(), 2),
                   "wall_s": round(time.time() - t0, 1)}
            log.append(rec)
            print("%s step %5d  loss %.4f  scale %.1f  %.0fs" % (label, step + 1, run,
                                                                  rec["logit_scale"], rec["wall_s"]),
                  flush=True)
    model.eval()
    return {"wall_s": round(time.time() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
            "log": log}


# ------------------------------------------------------------------------ LoRA


class LoRALinear(nn.Module):
    """y = W x + b + (alpha / r) * B A x, with A [r, in], B [out, r] (B starts at zero)."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.rank, self.scale = rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def merged(self):
        with torch.no_grad():
            self.base.weight += self.scale * (self.lora_B @ self.lora_A)
        return self.base


LORA_TARGETS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2")]


def encoder_layers(model):
    return list(model.text_model.encoder.layers) + list(model.vision_model.encoder.layers)


def add_lora(model, rank, alpha):
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in encoder_layers(model):
        for parent, name in LORA_TARGETS:
            mod = getattr(layer, parent)
            setattr(mod, name, LoRALinear(getattr(mod, name), rank, alpha))
    model.logit_scale.requires_grad_(True)


def merge_lora(model):
    for layer in encoder_layers(model):
        for parent, name in LORA_TARGETS:
            mod = getattr(layer, parent)
            lin = getattr(mod, name)
            if isinstance(lin, LoRALinear):
                setattr(mod, name, lin.merged())
    for p in model.parameters():
        p.requires_grad_(True)


# ------------------------------------------------------------------- MoE adapter


class Expert(nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.w1 = nn.Linear(d, i, bias=False)  # gate projection
        self.w2 = nn.Linear(i, d, bias=False)  # down projection
        self.w3 = nn.Linear(d, i, bias=False)  # up projection


class MoeAdapter(nn.Module):
    """The engine's adapter: normalize(x + sum_k w_k * expert_k(x)), Mixtral routing.

    Parameter names are those of adapter.safetensors (gate.weight, experts.{e}.w{1,2,3}.weight).
    """

    def __init__(self, hidden, num_experts, intermediate, top_k, joint_experts=0):
        super().__init__()
        self.hidden, self.num_experts, self.intermediate, self.top_k = \
            hidden, num_experts, intermediate, top_k
        self.joint_experts = joint_experts  # the last ones: see router_logits
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(num_experts))
        for e in self.experts:
            for lin in (e.w1, e.w3):
                nn.init.normal_(lin.weight, std=hidden ** -0.5)
            nn.init.zeros_(e.w2.weight)  # starts as the identity (then normalize)
        nn.init.normal_(self.gate.weight, std=0.02)
        self.cross_modal_gate = None  # see add_cross_modal_gate

    def add_cross_modal_gate(self):
        """The seeds' CrossModalGate for hybrid queries: Linear(2 * hidden -> 2) on [image; text],
        stored as cross_modal_gate.{weight,bias}. Starts at zero: the plain average."""
        self.cross_modal_gate = nn.Linear(2 * self.hidden, 2)
        nn.init.zeros_(self.cross_modal_gate.weight)
        nn.init.zeros_(self.cross_modal_gate.bias)
        return self.cross_modal_gate

    def fuse(self, image, text):
        """(w_image * image + w_text * text, w [rows, 2]), w = softmax(W [image; text] + b): the
        adapter's input for a hybrid query (image, text: the encoder's projected embeddings).
        Without a gate, w = (0.5, 0.5)."""
        if self.cross_modal_gate is None:
            w = torch.full((image.shape[0], 2), 0.5)
        else:
            w = torch.softmax(self.cross_modal_gate(torch.cat([image, text], dim=-1)), dim=-1)
        return w[:, :1] * image + w[:, 1:] * text, w

    def router_logits(self, x, fused=False):
        """The router's logits. The last `joint_experts` experts are joint visual-text experts:
        rows that are not fused hybrid queries (`fused` False, or False in a per-row bool tensor)
        get -inf for them, so they route exactly as the adapter without those experts does."""
        logits = self.gate(x).float()
        if not self.joint_experts:
            return logits
        single = ~torch.as_tensor(fused, dtype=torch.bool).expand(x.shape[0])
        blocked = torch.zeros_like(logits, dtype=torch.bool)
        blocked[single, self.num_experts - self.joint_experts:] = True
        return logits.masked_fill(blocked, float("-inf"))

    def route(self, x, fused=False):
        probs = torch.softmax(self.router_logits(x, fused), dim=-1)
        w, sel = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return probs, w, sel

    def forward(self, x, fused=False):
        """(adapted rows, router probabilities, selected experts); `fused`: see router_logits."""
        probs, w, sel = self.route(x, fused)
        W1 = torch.stack([e.w1.weight for e in self.experts])  # [E, I, D]
        W3 = torch.stack([e.w3.weight for e in self.experts])
        W2 = torch.stack([e.w2.weight for e in self.experts])  # [E, D, I]
        h = F.silu(torch.einsum("bd,eid->bei", x, W1)) * torch.einsum("bd,eid->bei", x, W3)
        y = torch.einsum("bei,edi->bed", h, W2)  # every expert (small), then combine top-k
        comb = torch.zeros_like(probs).scatter(1, sel, w)
        moe = (comb.unsqueeze(-1) * y).sum(1)
        return F.normalize(x + moe, dim=-1), probs, sel

    def aux_loss(self, probs, sel):
        """Switch/Mixtral load-balancing loss: E * sum_e (share of routed slots) * (mean prob)."""
        counts = torch.zeros(self.num_experts).index_add_(
            0, sel.reshape(-1), torch.ones(sel.numel()))
        return self.num_experts * (counts / sel.numel() * probs.mean(0)).sum()

    def config(self):
        return {"format": "gst-moe-adapter", "version": 1, "hidden_size": self.hidden,
                "num_experts": self.num_experts, "top_k": self.top_k,
                "intermediate_size": self.intermediate, "routing": "mixtral",
                "norm_topk_prob": True, "shared_expert_intermediate_size": 0,
                **({"joint_experts": self.joint_experts} if self.joint_experts else {})}


def fit_moe_adapter(own, replay, hp, rng, seed, logit_scale, match=match_matrix, label="moe"):
    """Trains a MoeAdapter on frozen, cached embeddings (the project's MoE recipe).

    `own` and `replay` (None for no replay) are (txt [N, K, D], txt_keys [N, K, ...],
    img [N, V, D], img_keys [N, ...]): K caption embeddings and V image views per item, and the
    keys `match(txt_keys, img_keys)` turns into the batch's [T, I] caption-fits-image matrix.
    Each batch (hp.batch rows) takes a share hp.replay_frac from `replay`; on those rows (all rows
    without replay) a penalty hp.identity * ||adapter(x) - x/|x|||^2 keeps the adapter near the
    identity. Contrastive loss (common.contrastive_loss) with a learnable temperature starting at
    `logit_scale` (not exported) + hp.aux * the load-balancing loss; AdamW, warm-up + cosine.
    hp: experts, intermediate, top_k, steps, batch, lr, warmup, weight_decay, aux, identity,
    replay_frac. Returns (adapter in eval mode, log records every 100 steps)."""
    txt, named, img, item_codes = own
    K = txt.shape[1]
    n_replay = 0
    if replay is not None:
        n_replay = int(round(hp.batch * hp.replay_frac))
        print("%s: replay %d items, %d of every %d batch rows" % (
            label, replay[0].shape[0], n_replay, hp.batch), flush=True)

    torch.manual_seed(seed)
    D = txt.shape[-1]
    adapter = MoeAdapter(D, hp.experts, hp.intermediate, hp.top_k)
    log_scale = nn.Parameter(logit_scale.detach().clone())
    params = list(adapter.named_parameters()) + [("logit_scale", log_scale)]
    opt = torch.optim.AdamW(param_groups(params, hp.weight_decay), lr=hp.lr, betas=(0.9, 0.98),
                            eps=1e-6)
    log, run = [], 0.0
    t1 = time.time()
    for step in range(hp.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, hp.steps, hp.lr, hp.warmup)
        n_own = hp.batch - n_replay
        idx = rng.choice(txt.shape[0], n_own, replace=False)
        v = rng.integers(K, size=n_own)
        f = rng.integers(img.shape[1], size=n_own)
        x_t = txt[idx, v]
        x_i = img[idx, f]
        t_codes, i_codes = named[idx, v], item_codes[idx]
        if n_replay:
            r_txt, r_named, r_img, r_codes = replay
            ridx = rng.choice(r_txt.shape[0], n_replay, replace=False)
            rv = rng.integers(r_txt.shape[1], size=n_replay)
            rf = rng.integers(r_img.shape[1], size=n_replay)
            x_t = torch.cat([x_t, r_txt[ridx, rv]])
            x_i = torch.cat([x_i, r_img[ridx, rf]])
            t_codes = np.concatenate([t_codes, r_named[ridx, rv]])
            i_codes = np.concatenate([i_codes, r_codes[ridx]])
        y_t, p_t, s_t = adapter(x_t)
        y_i, p_i, s_i = adapter(x_i)
        # y_* are already normalised: the adapter output is what the engine indexes.
        loss = contrastive_loss(y_t, y_i, log_scale, match(t_codes, i_codes))
        aux = 0.5 * (adapter.aux_loss(p_t, s_t) + adapter.aux_loss(p_i, s_i))
        total = loss + hp.aux * aux
        if hp.identity > 0:  # keep the replay rows (all rows without replay) where they were
            rows = slice(n_own, None) if n_replay else slice(None)
            ident = 0.5 * ((y_t[rows] - F.normalize(x_t[rows], dim=-1)).pow(2).sum(-1).mean()
                           + (y_i[rows] - F.normalize(x_i[rows], dim=-1)).pow(2).sum(-1).mean())
            total = total + hp.identity * ident
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        with torch.no_grad():
            log_scale.clamp_(0, np.log(100))
        run = loss.item() if step == 0 else 0.95 * run + 0.05 * loss.item()
        if (step + 1) % 100 == 0 or step == hp.steps - 1:
            usage_t = np.bincount(s_t.reshape(-1).numpy(), minlength=hp.experts) / s_t.numel()
            usage_i = np.bincount(s_i.reshape(-1).numpy(), minlength=hp.experts) / s_i.numel()
            rec = {"step": step + 1, "loss": round(run, 4), "aux": round(aux.item(), 4),
                   "logit_scale": round(log_scale.exp().item(), 2),
                   "usage_text": [round(float(u), 3) for u in usage_t],
                   "usage_image": [round(float(u), 3) for u in usage_i],
                   "wall_s": round(time.time() - t1, 1)}
            log.append(rec)
            if (step + 1) % 500 == 0 or step == hp.steps - 1:
                print("%s step %5d  loss %.4f  aux %.3f  usage text %s image %s" % (
                    label, step + 1, run, aux.item(), np.round(usage_t, 2), np.round(usage_i, 2)),
                    flush=True)
    adapter.eval()
    return adapter, log


def load_adapter(adapter_dir):
    with open(os.path.join(adapter_dir, "adapter_config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["format"] == "gst-moe-adapter" and cfg["routing"] == "mixtral", cfg
    m = MoeAdapter(cfg["hidden_size"], cfg["num_experts"], cfg["intermediate_size"], cfg["top_k"],
                   cfg.get("joint_experts", 0))
    sd = {k: v.float() for k, v in load_file(os.path.join(adapter_dir, "adapter.safetensors")).items()}
    if "cross_modal_gate.weight" in sd:
        m.add_cross_modal_gate()
    m.load_state_dict(sd)
    return m.eval()


def without_joint_experts(adapter):
    """The single-modality adapter inside `adapter`: its first num_experts - joint_experts experts
    and router rows (what every non-hybrid row uses), without the cross-modal gate."""
    keep = adapter.num_experts - adapter.joint_experts
    m = MoeAdapter(adapter.hidden, keep, adapter.intermediate, adapter.top_k)
    sd = {k: v for k, v in adapter.state_dict().items() if not k.startswith("cross_modal_gate.")}
    sd["gate.weight"] = sd["gate.weight"][:keep]
    sd = {k: v for k, v in sd.items() if not k.startswith("experts.") or int(k.split(".")[1]) < keep}
    m.load_state_dict(sd)
    return m.eval()


# ------------------------------------------------------------------------ export


def save_clip_dir(model, out_dir, dtype=torch.float16, image_size=64):
    """A complete Hugging Face CLIP directory in the engine's layout.

    config.json with every key, model.safetensors (`dtype`), preprocessor_config.json and
    relative symlinks to the four models/clip-tokenizer/ files.
    """
    import copy
    fresh_dir(out_dir)
    m = copy.deepcopy(model).to(dtype).eval()
    m.config.torch_dtype = dtype
    m.save_pretrained(out_dir, safe_serialization=True)
    m.config.to_json_file(os.path.join(out_dir, "config.json"), use_diff=False)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    canonical_safetensors(os.path.join(out_dir, "model.safetensors"))
    image_processor(image_size).save_pretrained(out_dir)
    rel = os.path.relpath(TOKENIZER_DIR, os.path.abspath(out_dir))
    for name in TOKENIZER_FILES:
        os.symlink(os.path.join(rel, name), os.path.join(out_dir, name))
    return out_dir


def save_adapter_dir(adapter, out_dir, metadata=None, fresh=True):
    """adapter.safetensors + adapter_config.json in `out_dir` (emptied first unless `fresh` is
    False: then only those two files are replaced)."""
    if fresh:
        fresh_dir(out_dir)
    else:
        os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.detach().float().contiguous() for k, v in adapter.state_dict().items()}
    path = os.path.join(out_dir, "adapter.safetensors")
    meta = {"format": "gst-moe-adapter", "generator": "tools/train/adapt.py"}
    meta.update(metadata or {})
    save_file(sd, path, metadata=meta)
    canonical_safetensors(path)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as fh:
        json.dump(adapter.config(), fh, indent=2)
        fh.write("\n")
    return out_dir


# ------------------------------------------------------------------- embeddings


@torch.no_grad()
def embed_texts(model, tokens, texts, engine=True, chunk=256):
    out = []
    for i in range(0, len(texts), chunk):
        part = texts[i:i + chunk]
        ids, mask = tokens.engine_batch(part) if engine else tokens.batch(part)
        out.append(model.get_text_features(input_ids=ids, attention_mask=mask))
    return torch.cat(out).float()


@torch.no_grad()
def embed_pixels(model, pixels, chunk=256):
    return torch.cat([model.get_image_features(pixel_values=pixels[i:i + chunk])
                      for i in range(0, len(pixels), chunk)]).float()


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


def versions():
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__}
