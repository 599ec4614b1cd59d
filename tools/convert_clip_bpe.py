#!/usr/bin/env python3
"""Build the CLIP BPE tokenizer files in models/clip-tokenizer/.

CLIP's byte-level BPE vocabulary is distributed as ``bpe_simple_vocab_16e6.txt.gz``
(OpenAI's CLIP repository; also shipped inside the PyPI package
``open_clip_torch`` as ``open_clip/bpe_simple_vocab_16e6.txt.gz``). This script
converts it into the Hugging Face layout used by ``openai/clip-vit-base-patch32``:

* ``vocab.json``   token -> id (49408 entries, compact JSON, UTF-8)
* ``merges.txt``   ``#version: 0.2`` followed by one ``a b`` merge per line
* ``tokenizer_config.json`` / ``special_tokens_map.json`` from
  ``transformers.CLIPTokenizer.save_pretrained``

The conversion follows the construction in OpenAI's ``SimpleTokenizer``:
merges are lines ``[1 : 49152 - 256 - 2 + 1]`` of the decompressed file; the
vocabulary is the 256 byte->unicode characters (GPT-2 ``bytes_to_unicode``
order), the same 256 with ``</w>`` appended, the concatenation of each merge
pair, then ``<|startoftext|>`` and ``<|endoftext|>``; ids are list positions.

Usage (with the fixture venv, see tools/setup-fixture-env.sh)::

    .venv-fixtures/bin/python tools/convert_clip_bpe.py [--bpe PATH] [--out DIR]

Without ``--bpe`` the script runs ``pip download --no-deps open_clip_torch`` into
a temporary directory and reads the .gz from the wheel.
"""

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import zipfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "models", "clip-tokenizer")
WHEEL_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
NUM_MERGES_END = 49152 - 256 - 2 + 1  # exclusive end line index, as in CLIP
EXPECTED_VOCAB = 49408
SANITY_TEXT = "a photo of a cat"
SANITY_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]


def byte_unicode_table():
    """GPT-2 style reversible byte -> printable unicode character mapping.

    Printable Latin-1 bytes map to themselves; the remaining bytes are assigned,
    in increasing byte order, to code points 256, 257, ...
    Returns a dict {byte: char} whose insertion order is the value order used
    for the CLIP vocabulary.
    """
    keep = set(range(0x21, 0x7E + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    ordered = sorted(keep)
    table = {b: chr(b) for b in ordered}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[b] = chr(256 + extra)
            extra += 1
    assert len(table) == 256 and len(set(table.values())) == 256
    return table


def read_bpe_gz(path):
    if path.endswith(".whl") or zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            raw = zf.read(WHEEL_MEMBER)
        return gzip.decompress(raw).decode("utf-8")
    with gzip.open(path, "rb") as fh:
        return fh.read().decode("utf-8")


def fetch_bpe_from_pypi(workdir):
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
           "--no-deps", "open_clip_torch", "-d", workdir]
    print("running:", " ".join(cmd))
    subprocess.run(cmd, check=True)
    wheels = sorted(glob.glob(os.path.join(workdir, "open_clip_torch-*.whl")))
    if not wheels:
        raise SystemExit("pip download produced no open_clip_torch wheel in %s" % workdir)
    print("using wheel:", os.path.basename(wheels[-1]))
    return wheels[-1]


def build(text):
    lines = text.split("\n")
    merges = [tuple(line.split()) for line in lines[1:NUM_MERGES_END]]
    for m in merges:
        if len(m) != 2:
            raise SystemExit("malformed merge line: %r" % (m,))
    byte_chars = list(byte_unicode_table().values())
    vocab = byte_chars + [c + "</w>" for c in byte_chars]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    if len(vocab) != EXPECTED_VOCAB:
        raise SystemExit("vocab has %d entries, expected %d" % (len(vocab), EXPECTED_VOCAB))
    if len(set(vocab)) != len(vocab):
        raise SystemExit("duplicate tokens in vocabulary")
    return vocab, merges


def write(out_dir, vocab, merges):
    os.makedirs(out_dir, exist_ok=True)
    vocab_path = os.path.join(out_dir, "vocab.json")
    merges_path = os.path.join(out_dir, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8", newline="\n") as fh:
        json.dump({tok: i for i, tok in enumerate(vocab)}, fh,
                  ensure_ascii=False, separators=(",", ":"))
    with open(merges_path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("#version: 0.2\n")
        for a, b in merges:
            fh.write(a + " " + b + "\n")
    return vocab_path, merges_path


def save_hf(out_dir, vocab_path, merges_path):
    import ftfy  # noqa: F401  (CLIPTokenizer falls back to BasicTokenizer without it)
    from transformers import CLIPTokenizer

    # model_max_length 77 as in the openai/clip-* checkpoints on the hub.
    tok = CLIPTokenizer(vocab_file=vocab_path, merges_file=merges_path,
                        model_max_length=77, clean_up_tokenization_spaces=True)
    if tok.fix_text is None:
        raise SystemExit("CLIPTokenizer did not pick up ftfy")
    tok.save_pretrained(out_dir)
    # save_pretrained also rewrites vocab.json / merges.txt in its own format and
    # may add added_tokens.json; rewrite ours afterwards so the layout is fixed.
    added = os.path.join(out_dir, "added_tokens.json")
    if os.path.exists(added):
        os.remove(added)


def check_hf(out_dir):
    from transformers import CLIPTokenizer

    tok2 = CLIPTokenizer.from_pretrained(out_dir)
    if tok2.fix_text is None:
        raise SystemExit("CLIPTokenizer did not pick up ftfy")
    ids = tok2(SANITY_TEXT)["input_ids"]
    if ids != SANITY_IDS:
        raise SystemExit("sanity check failed: %r -> %r (want %r)" % (SANITY_TEXT, ids, SANITY_IDS))
    print("sanity check ok: %r -> %r" % (SANITY_TEXT, ids))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bpe", help="bpe_simple_vocab_16e6.txt.gz or an open_clip_torch wheel")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output dir (default models/clip-tokenizer)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers save/check step")
    args = ap.parse_args()

    if args.bpe:
        text = read_bpe_gz(args.bpe)
    else:
        with tempfile.TemporaryDirectory(prefix="oc-") as tmp:
            text = read_bpe_gz(fetch_bpe_from_pypi(tmp))

    vocab, merges = build(text)
    vocab_path, merges_path = write(args.out, vocab, merges)
    if not args.no_hf:
        save_hf(args.out, vocab_path, merges_path)
        # Re-write our canonical vocab/merges (save_pretrained may reformat them).
        write(args.out, vocab, merges)
        check_hf(args.out)
    print("wrote %s (%d tokens, %d merges)" % (args.out, len(vocab), len(merges)))
    for name in sorted(os.listdir(args.out)):
        p = os.path.join(args.out, name)
        print("  %-28s %10d bytes" % (name, os.path.getsize(p)))


if __name__ == "__main__":
    main()
