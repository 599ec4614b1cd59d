"""Byte-stable safetensors files, so regenerated fixtures and models show no spurious git diffs.

safetensors writes ``__metadata__`` in hash-map order; ``canonicalize(path)`` rewrites the JSON
header with ``__metadata__`` first (sorted keys) and tensors in data-offset order, space-padded
to a multiple of 8 bytes. The data section is unchanged. ``save_st`` writes torch tensors that
way, and ``fresh_dir`` empties a fixture folder: the fixture scripts in tools/ share both.
"""

import json
import os
import shutil


def fresh_dir(path):
    if os.path.islink(path):
        os.remove(path)  # a link to a folder: replace the link, never empty its target
    elif os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def save_st(tensors, path, metadata):
    """safetensors.save_file + a canonical header: re-runs are byte-identical."""
    from safetensors.torch import save_file  # only the scripts that write tensors need torch
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    canonicalize(path)


def canonicalize(path):
    with open(path, "rb") as fh:
        blob = fh.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", None)
    ordered = {}
    if meta:
        ordered["__metadata__"] = {k: meta[k] for k in sorted(meta)}
    for k in sorted(header, key=lambda k: (header[k]["data_offsets"][0], k)):
        ordered[k] = header[k]
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text + blob[8 + n:])
