#!/usr/bin/env python3
"""Generate the cross-modal gate fixtures in tests/fixtures/ (MoeAdapter::fuse against torch).

The outputs are committed, so building and testing the project needs no Python. Regenerate them
(deterministic: a fixed torch seed) after tools/make_fixtures.py, whose adapter_tiny they extend::

    tools/setup-fixture-env.sh && .venv-fixtures/bin/python tools/make_gate_fixture.py

Outputs (overwritten on every run):

* ``adapter_tiny_gate/``       ``adapter_tiny`` plus a random gate: ``cross_modal_gate.weight``
                               [2, 2*16] and ``cross_modal_gate.bias`` [2], f32
* ``gate_io.safetensors``      ``image`` and ``text`` [rows, 16] embeddings (rows at several
                               scales, so the weights range from balanced to saturated), the
                               gate's ``weights`` [rows, 2] (image, text) and ``fused`` [rows, 16]

The expected values come from the seeds' CrossModalGate as written there: torch's Linear over the
concatenation [image; text], torch's softmax, the weighted sum.
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_canonical  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO_ROOT, "tests", "fixtures")
META = {"generator": "tools/make_gate_fixture.py", "torch": torch.__version__}


class CrossModalGate(nn.Module):
    """The seeds' gate: softmax over Linear(2D -> 2) of the concatenated embeddings."""

    def __init__(self, hidden_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size * 2, 2)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, vis_emb, txt_emb):
        weights = self.softmax(self.gate_proj(torch.cat([vis_emb, txt_emb], dim=-1)))
        return weights, weights[:, 0:1] * vis_emb + weights[:, 1:2] * txt_emb


def main():
    src = os.path.join(FIX, "adapter_tiny")
    with open(os.path.join(src, "adapter_config.json")) as fh:
        hidden = json.load(fh)["hidden_size"]
    torch.manual_seed(1818)
    gate = CrossModalGate(hidden).eval()
    with torch.no_grad():
        gate.gate_proj.weight.normal_(0.0, 0.3)
        gate.gate_proj.bias.normal_(0.0, 0.5)
        # Encoder-like rows: image and text at different norms, and a few rows scaled up so that
        # some weights saturate towards 0 or 1.
        scale = torch.tensor([1.0] * 6 + [0.1, 3.0, 8.0])[:, None]
        image = 1.3 * torch.randn(9, hidden) * scale
        text = torch.randn(9, hidden) * scale
        weights, fused = gate(image, text)

    out = st_canonical.fresh_dir(os.path.join(FIX, "adapter_tiny_gate"))
    shutil.copyfile(os.path.join(src, "adapter_config.json"), os.path.join(out, "adapter_config.json"))
    tensors = load_file(os.path.join(src, "adapter.safetensors"))
    tensors["cross_modal_gate.weight"] = gate.gate_proj.weight.detach().float()
    tensors["cross_modal_gate.bias"] = gate.gate_proj.bias.detach().float()
    st_canonical.save_st(tensors, os.path.join(out, "adapter.safetensors"),
                         {"format": "gst-moe-adapter", **META})
    io = {"image": image, "text": text, "weights": weights, "fused": fused}
    st_canonical.save_st(io, os.path.join(FIX, "gate_io.safetensors"), META)
    for name, t in io.items():
        print("gate_io.safetensors %-8s %s %s" % (name, tuple(t.shape), t.dtype))
    print("image weights per row:", [round(float(w), 4) for w in weights[:, 0]])


if __name__ == "__main__":
    main()
