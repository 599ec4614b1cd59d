#!/usr/bin/env python3
"""Generate the INT4 (W4A16) expert fixtures in tests/fixtures/int4/ with compressed-tensors itself.

The quantisation parameters (compressed_tensors.quantization.utils.calculate_qparams), the
quantisation and packing (ModelCompressor with the "pack-quantized" format), the config.json
`quantization_config` (ModelCompressor.update_config) and the expected dequantised weights
(the package's unpack_from_int32 + dequantize) all come from the package; this script only makes
random weights, takes their per-group min/max (the role of llmcompressor's min-max observer) and
writes files. The outputs are committed, so building and testing needs no Python.

compressed-tensors needs torch >= 2.1 at import (float8 dtypes, torch.compile) whatever the
release, so Debian's torch 1.13 cannot run it: the venv takes torch from PyPI::

    python3 -m venv /work/venv-int4
    /work/venv-int4/bin/pip install torch==2.4.1 compressed-tensors==0.10.2 transformers==4.44.2
    /work/venv-int4/bin/python tools/make_int4_fixtures.py

Outputs (overwritten on every run; deterministic: fixed seeds, canonical safetensors headers):

* ``mixtral_sym_g32/``    tiny Mixtral layer 0 (4 experts, hidden 64, intermediate 128, top-2):
                          config.json (MixtralConfig + quantization_config), model.safetensors with
                          symmetric group-32 experts, f16 scales, router f16 (not quantised)
* ``qwen2_moe_asym_g64/`` tiny Qwen2-MoE layer 0 (4 experts, hidden 64, moe_intermediate 128,
                          shared expert 64): asymmetric group-64 experts and shared expert, bf16
                          scales, packed zero points; router and shared_expert_gate bf16
* ``*/expected.safetensors`` the package's dequantisation of the experts named in its
                          __metadata__["experts"] (the scale's dtype, as the package returns it)
"""

import json
import os
import sys

import torch
import compressed_tensors
import safetensors
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.quantized_compressors.pack_quantized import unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_canonical  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "int4")

META = {
    "generator": "tools/make_int4_fixtures.py",
    "compressed_tensors": compressed_tensors.__version__,
    "torch": torch.__version__,
}

HIDDEN, INTER, EXPERTS, TOP_K, SHARED_INTER = 64, 128, 4, 2, 64


class SwiGlu(torch.nn.Module):
    def __init__(self, names, d, inter):
        super().__init__()
        gate, up, down = names
        setattr(self, gate, torch.nn.Linear(d, inter, bias=False))
        setattr(self, up, torch.nn.Linear(d, inter, bias=False))
        setattr(self, down, torch.nn.Linear(inter, d, bias=False))


class MoeBlock(torch.nn.Module):
    """The module tree of one Mixtral / Qwen2-MoE sparse block (names only: never run)."""

    def __init__(self, names, shared_inter):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(SwiGlu(names, HIDDEN, INTER) for _ in range(EXPERTS))
        if shared_inter:
            self.shared_expert = SwiGlu(names, HIDDEN, shared_inter)
            self.shared_expert_gate = torch.nn.Linear(HIDDEN, 1, bias=False)


class Layer(torch.nn.Module):
    def __init__(self, block_name, block):
        super().__init__()
        self.add_module(block_name, block)


class Model(torch.nn.Module):
    def __init__(self, block_name, block):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer(block_name, block)])


def set_group_qparams(model, args):
    """Per-group min/max of each quantised weight -> the package's scale and zero point."""
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.data
        groups = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
        scale, zero_point = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero_point)


def package_dequantize(state, name, args):
    """The package's dequantisation of a packed weight, in the scale's dtype as it returns it."""
    shape = torch.Size(state[name + ".weight_shape"].tolist())
    q = unpack_from_int32(state[name + ".weight_packed"], args.num_bits, shape)
    scale = state[name + ".weight_scale"]
    zero_point = None
    if not args.symmetric:
        zero_point = unpack_from_int32(state[name + ".weight_zero_point"], args.num_bits,
                                       torch.Size((shape[0], scale.shape[1])), packed_dim=0)
    return dequantize(q, scale, zero_point, args)


def make_case(dirname, hf_config, block_name, names, shared_inter, args, dtype, seed, check_experts):
    torch.manual_seed(seed)
    model = Model(block_name, MoeBlock(names, shared_inter))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    model = model.to(dtype)
    # The router and the shared-expert gate stay unquantised (module names end in "gate").
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["re:.*gate$"],
        format="pack-quantized",
    )
    apply_quantization_config(model, qconfig)
    set_group_qparams(model, args)
    compressor = ModelCompressor(quantization_config=qconfig)
    state = compressor.compress(model)

    out = st_canonical.fresh_dir(os.path.join(OUT, dirname))
    hf_config.to_json_file(os.path.join(out, "config.json"))
    compressor.update_config(out)
    st_canonical.save_st(state, os.path.join(out, "model.safetensors"), dict(META, format="pt"))

    prefix = f"model.layers.0.{block_name}."
    expected = {}
    for e in check_experts:
        for proj in names:
            name = f"{prefix}experts.{e}.{proj}"
            expected[name + ".weight"] = package_dequantize(state, name, args)
    if shared_inter:
        for proj in names:
            name = f"{prefix}shared_expert.{proj}"
            expected[name + ".weight"] = package_dequantize(state, name, args)
    st_canonical.save_st(expected, os.path.join(out, "expected.safetensors"),
            dict(META, experts=json.dumps(list(check_experts)), prefix=prefix))
    return out


def main():
    from transformers import MixtralConfig, Qwen2MoeConfig

    os.makedirs(OUT, exist_ok=True)
    outs = []
    outs.append(make_case(
        "mixtral_sym_g32",
        MixtralConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                      num_experts_per_tok=TOP_K, torch_dtype="float16"),
        "block_sparse_moe", ("w1", "w3", "w2"), 0,
        QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
        torch.float16, seed=4101, check_experts=(3,)))
    outs.append(make_case(
        "qwen2_moe_asym_g64",
        Qwen2MoeConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
                       shared_expert_intermediate_size=SHARED_INTER, norm_topk_prob=False,
                       torch_dtype="bfloat16"),
        "mlp", ("gate_proj", "up_proj", "down_proj"), SHARED_INTER,
        QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64),
        torch.bfloat16, seed=4102, check_experts=(2,)))

    total = 0
    for out in outs:
        for fname in sorted(os.listdir(out)):
            path = os.path.join(out, fname)
            total += os.path.getsize(path)
            print(f"{os.path.relpath(path, REPO_ROOT)}: {os.path.getsize(path)} bytes")
            if fname.endswith(".safetensors"):
                with safetensors.safe_open(path, "pt") as f:
                    for k in f.keys():
                        t = f.get_tensor(k)
                        print(f"  {k} {t.dtype} {list(t.shape)}")
    print(f"total {total} bytes; compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
