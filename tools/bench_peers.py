#!/usr/bin/env python3
"""gst-moe's CLIP encoders against PyTorch (transformers) and ONNX Runtime on the CPU.

Run it through tools/bench-peers.sh, which builds the engine's worker and sets up the Python
environment (docs/benchmarks.md, "CPU GEMM libraries and peers"). What it does:

1. writes one synthetic CLIP ViT-B/32 checkpoint (openai/clip-vit-base-patch32's shapes, random
   weights) as a Hugging Face directory: config.json + model.safetensors written by the engine's
   bench/clip_writer.h (through moe-bench-peer-worker --write-model), CLIP's tokenizer files from
   models/clip-tokenizer/ and a preprocessor_config.json. It is written once and reused.
2. exports the text and vision towers to ONNX once, with torch.onnx.export of transformers'
   CLIPModel.get_text_features / get_image_features, as a user would (dynamic batch).
3. starts, per thread count, one worker per side: the engine (moe-bench-peer-worker), PyTorch
   (CLIPModel under torch.inference_mode) and ONNX Runtime (CPUExecutionProvider, default graph
   optimisations, intra-op threads = the thread count). Every side gets the same inputs: random
   pixels [B, 3, 224, 224] and random token ids [B, 16] (start, 14 tokens, end).
4. checks that the three sides compute the same embeddings (relative to PyTorch: within 1e-3, or
   within 2e-2 with --precision bf16/fp16, the engine's Linear weights then in that precision
   while the peers stay fp32; the bound is tests/test_cpu_bf16.cpp's for bf16), then times
   them in interleaved rounds: in each round every (tower, batch, threads) configuration runs one
   sample on every side, in a rotating order. A sample is N calls (N chosen at warm-up so that a
   sample lasts at least --min-sample-s).
5. prints one table: items/s per side (median over rounds) and the ratios gst-moe/peer, each the
   median over rounds of the paired ratio time(peer) / time(gst-moe) from the same round (above 1×
   gst-moe is faster), with the spread (max - min) / median of the noisiest side.

Only the towers are timed (the engine's encode_pixels / encode_token_ids; PyTorch's
get_*_features on tensors; ONNX Runtime's session.run on arrays): no tokenising or decoding.

Threads: each worker process gets OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS and
BLIS_NUM_THREADS set to its thread count (the engine's and Debian torch's GEMMs thread through
their BLAS), plus torch.set_num_threads / ORT's intra_op_num_threads. OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE are removed from every worker's environment, so each side runs its libraries as
they detect the machine by themselves.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("gst-moe", "pytorch", "onnxruntime")
TEXT_VOCAB_PLAIN = 49406  # ids below CLIP's start (49406) and end (49407) tokens
BOS, EOS = 49406, 49407


def log(msg):
    print(f"[bench-peers] {msg}", file=sys.stderr, flush=True)


# ---- workers (PyTorch and ONNX Runtime), speaking moe-bench-peer-worker's protocol ------------

def worker_main(kind, model_dir, onnx_dir, threads):
    import numpy as np

    inputs = {}
    if kind == "torch":
        import torch
        from transformers import CLIPModel

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        model, info = CLIPModel.from_pretrained(model_dir, torch_dtype=torch.float32, output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
            raise SystemExit(f"checkpoint does not match CLIPModel: {info}")
        model.eval()

        def encode(inp):
            with torch.inference_mode():
                if inp[0] == "images":
                    return model.get_image_features(pixel_values=inp[1])
                return model.get_text_features(input_ids=inp[1])

        def make_input(kind_, arr):
            return (kind_, torch.from_numpy(arr))

        def to_numpy(out):
            return out.numpy()

        def describe():
            return f"torch {torch.__version__} threads {torch.get_num_threads()}; {blas_core()}"
    else:
        import onnxruntime as ort

        sessions = {}

        def session(tower):
            if tower not in sessions:
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                so.inter_op_num_threads = 1
                so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                sessions[tower] = ort.InferenceSession(os.path.join(onnx_dir, f"{tower}.onnx"), so,
                                                       providers=["CPUExecutionProvider"])
            return sessions[tower]

        session("text")
        session("vision")

        def encode(inp):
            if inp[0] == "images":
                return session("vision").run(None, {"pixel_values": inp[1]})[0]
            return session("text").run(None, {"input_ids": inp[1]})[0]

        def make_input(kind_, arr):
            return (kind_, arr.astype(np.int64) if kind_ == "texts" else arr)

        def to_numpy(out):
            return out

        def describe():
            return f"onnxruntime {ort.__version__} {ort.get_device()} intra-op threads {threads}"

    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd = words[0]
        if cmd == "quit":
            break
        try:
            if cmd == "load":
                name, kind_, path, b = words[1], words[2], words[3], int(words[4])
                if kind_ == "images":
                    arr = np.fromfile(path, dtype=np.float32).reshape(b, 3, 224, 224)
                else:
                    arr = np.fromfile(path, dtype=np.int32).reshape(b, int(words[5]))
                inputs[name] = make_input(kind_, arr)
                reply = "ok"
            elif cmd == "run":
                inp, n = inputs[words[1]], max(1, int(words[2]))
                t0 = time.perf_counter()
                for _ in range(n):
                    encode(inp)
                reply = f"ok {time.perf_counter() - t0:.9g}"
            elif cmd == "dump":
                out = np.ascontiguousarray(to_numpy(encode(inputs[words[1]])), dtype=np.float32)
                out.tofile(words[2])
                reply = f"ok {out.shape[0]} {out.shape[1]}"
            elif cmd == "info":
                reply = "ok " + describe()
            else:
                reply = f"error unknown request {cmd}"
        except Exception as e:  # reported to the driver, which stops
            reply = "error " + repr(e).replace("\n", " ")
        print(reply, flush=True)


def blas_core():
    """The OpenBLAS core that this process's OpenBLAS picked, if one is loaded."""
    import ctypes

    with open("/proc/self/maps") as f:
        libs = sorted({ln.split()[-1] for ln in f if "blas" in ln.split()[-1]})
    for lib in libs:
        try:
            h = ctypes.CDLL(lib)
            h.openblas_get_corename.restype = ctypes.c_char_p
            return f"BLAS {os.path.basename(lib)} core {h.openblas_get_corename().decode()}"
        except (OSError, AttributeError):
            continue
    return "BLAS " + (" ".join(os.path.basename(x) for x in libs) or "(none mapped)")


# ---- model and inputs -------------------------------------------------------------------------

PREPROCESSOR = {
    "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 224},
}


def write_model(worker_bin, model_dir):
    stamp = os.path.join(model_dir, ".complete")
    if os.path.exists(stamp):
        log(f"checkpoint already written: {model_dir}")
        return
    shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.time()
    subprocess.run([worker_bin, "--write-model", model_dir], check=True)
    tok = os.path.join(ROOT, "models", "clip-tokenizer")
    for f in sorted(os.listdir(tok)):
        shutil.copy(os.path.join(tok, f), model_dir)
    with open(os.path.join(model_dir, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f, indent=2)
    open(stamp, "w").close()
    log(f"wrote the synthetic ViT-B/32 checkpoint to {model_dir} in {time.time() - t0:.1f} s")


def export_onnx(model_dir, onnx_dir, opset):
    """torch.onnx.export of both towers, as a user would; skipped when already done."""
    import torch
    import transformers
    from transformers import CLIPModel

    stamp = os.path.join(onnx_dir, ".complete")
    want = f"torch {torch.__version__} transformers {transformers.__version__} opset {opset}"
    if os.path.exists(stamp) and open(stamp).read() == want:
        log(f"ONNX export already done: {onnx_dir} ({want})")
        return
    os.makedirs(onnx_dir, exist_ok=True)
    model = CLIPModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    class Text(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m.get_text_features(input_ids=input_ids)

    class Vision(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            return self.m.get_image_features(pixel_values=pixel_values)

    ids = torch.randint(0, TEXT_VOCAB_PLAIN, (2, 16), dtype=torch.int64)
    ids[:, 0], ids[:, -1] = BOS, EOS
    t0 = time.time()
    with torch.no_grad():
        torch.onnx.export(Text(model), (ids,), os.path.join(onnx_dir, "text.onnx"), input_names=["input_ids"],
                          output_names=["text_embeds"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "text_embeds": {0: "batch"}},
                          opset_version=opset, do_constant_folding=True)
        torch.onnx.export(Vision(model), (torch.randn(2, 3, 224, 224),), os.path.join(onnx_dir, "vision.onnx"),
                          input_names=["pixel_values"], output_names=["image_embeds"],
                          dynamic_axes={"pixel_values": {0: "batch"}, "image_embeds": {0: "batch"}},
                          opset_version=opset, do_constant_folding=True)
    with open(stamp, "w") as f:
        f.write(want)
    log(f"exported text.onnx and vision.onnx to {onnx_dir} in {time.time() - t0:.1f} s ({want})")


def flop_per_item(model_dir, tower, tokens):
    """Multiply-adds × 2 of one image or text through the tower (GEMMs, attention, patch embedding)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    c = cfg["vision_config" if tower == "vision" else "text_config"]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    if tower == "vision":
        grid = c["image_size"] // c["patch_size"]
        tokens = grid * grid + 1
        extra = grid * grid * 3 * c["patch_size"] ** 2 * h  # patch embedding
    else:
        extra = 0
    per_layer = tokens * (4 * h * h + 2 * h * i) + 2 * tokens * tokens * h
    return 2.0 * (n * per_layer + extra + h * cfg["projection_dim"])


def write_inputs(work, towers, batches, tokens):
    import numpy as np

    rng = np.random.default_rng(1234)
    out = {}
    os.makedirs(os.path.join(work, "inputs"), exist_ok=True)
    for tower in towers:
        for b in batches:
            path = os.path.join(work, "inputs", f"{tower}-b{b}.bin")
            if tower == "vision":
                rng.uniform(-2.0, 2.0, size=(b, 3, 224, 224)).astype(np.float32).tofile(path)
                out[(tower, b)] = f"images {path} {b}"
            else:
                ids = rng.integers(0, TEXT_VOCAB_PLAIN, size=(b, tokens), dtype=np.int32)
                ids[:, 0], ids[:, -1] = BOS, EOS
                ids.tofile(path)
                out[(tower, b)] = f"texts {path} {b} {tokens}"
    return out


# ---- the driver ---------------------------------------------------------------------------------

class Worker:
    def __init__(self, side, threads, cmd, log_path):
        env = dict(os.environ)
        for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
            env.pop(k, None)
        for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
            env[k] = str(threads)
        env["PYTHONUNBUFFERED"] = "1"
        self.side, self.threads = side, threads
        self.err = open(log_path, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  bufsize=1, env=env)
        self.log_path = log_path

    def wait_ready(self):
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"{self.side} worker ({self.threads} threads) did not start: {line.strip()!r}; "
                             f"see {self.log_path}")

    def ask(self, request):
        self.p.stdin.write(request + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        if not line.startswith("ok"):
            raise SystemExit(f"{self.side} worker ({self.threads} threads): {request!r} -> {line!r}; "
                             f"see {self.log_path}")
        return line[2:].strip()

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
        self.err.close()


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for ln in f:
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def fmt(v):
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["torch", "ort"], help=argparse.SUPPRESS)
    ap.add_argument("--export-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--onnx-dir", help=argparse.SUPPRESS)
    ap.add_argument("--engine-worker", help="moe-bench-peer-worker binary")
    ap.add_argument("--work", help="folder for the checkpoint, the ONNX files, inputs and logs")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,32; --quick 1,8)")
    ap.add_argument("--towers", default="text,vision", help="text,vision (default both)")
    ap.add_argument("--text-tokens", type=int, default=16, help="tokens per text incl. start and end (default 16)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --quick 2)")
    ap.add_argument("--min-sample-s", type=float, default=None,
                    help="a sample lasts at least this long (default 0.5; --quick 0.2)")
    ap.add_argument("--opset", type=int, default=14, help="ONNX opset of the export (default 14)")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 2 rounds: about a minute of timing")
    ap.add_argument("--json", help="also write every sample as JSON to this file")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="gst-moe's Linear weights (ComputeOptions::precision; default fp32); the peers run fp32")
    a = ap.parse_args()

    if a.worker:
        worker_main(a.worker, a.model, a.onnx_dir, int(a.threads))
        return
    if a.export_only:
        export_onnx(a.model, a.onnx_dir, a.opset)
        return
    if not a.engine_worker or not a.work:
        ap.error("--engine-worker and --work are needed (tools/bench-peers.sh passes them)")

    threads = [int(x) for x in a.threads.split(",")]
    batches = [int(x) for x in (a.batches or ("1,8" if a.quick else "1,32")).split(",")]
    towers = [x for x in a.towers.split(",") if x]
    rounds = a.rounds or (2 if a.quick else 3)
    min_sample = a.min_sample_s or (0.2 if a.quick else 0.5)
    work = os.path.abspath(a.work)
    model_dir, onnx_dir = os.path.join(work, "model"), os.path.join(work, "onnx")
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    t_start = time.time()
    load_start = loadavg()

    write_model(a.engine_worker, model_dir)
    # The export runs in a process of its own, so this one never holds torch's memory.
    subprocess.run([sys.executable, os.path.abspath(__file__), "--export-only", "--model", model_dir,
                    "--onnx-dir", onnx_dir, "--opset", str(a.opset)], check=True)
    inputs = write_inputs(work, towers, batches, a.text_tokens)

    me = [sys.executable, os.path.abspath(__file__)]
    workers = {}
    for t in threads:
        cmds = {
            "gst-moe": [a.engine_worker, "--model", model_dir, "--threads", str(t), "--precision", a.precision],
            "pytorch": me + ["--worker", "torch", "--model", model_dir, "--threads", str(t)],
            "onnxruntime": me + ["--worker", "ort", "--model", model_dir, "--onnx-dir", onnx_dir, "--threads", str(t)],
        }
        for side in SIDES:
            workers[(side, t)] = Worker(side, t, cmds[side], os.path.join(work, "logs", f"{side}-{t}t.log"))
    log("loading the model in every worker ...")
    for w in workers.values():
        w.wait_ready()
    infos = {k: w.ask("info") for k, w in workers.items()}
    for (tower, b), spec in inputs.items():
        for w in workers.values():
            w.ask(f"load {tower}-b{b} {spec}")

    # Same embeddings on every side (relative to PyTorch), from the 1-thread workers.
    import numpy as np

    bound = {"gst-moe": 1e-3 if a.precision == "fp32" else 2e-2, "onnxruntime": 1e-3}

    check = {}
    t0 = threads[0]
    for tower in towers:
        b = batches[-1] if tower == "text" else batches[0]
        outs = {}
        for side in SIDES:
            path = os.path.join(work, "inputs", f"out-{side}-{tower}.bin")
            workers[(side, t0)].ask(f"dump {tower}-b{b} {path}")
            outs[side] = np.fromfile(path, dtype=np.float32).reshape(b, -1)
        ref = outs["pytorch"]
        scale = float(np.abs(ref).max())
        check[tower] = {s: float(np.abs(outs[s] - ref).max()) / scale for s in ("gst-moe", "onnxruntime")}
        for s, err in check[tower].items():
            if not err < bound[s]:
                raise SystemExit(f"{tower}: {s} differs from PyTorch by {err:.2e} (relative): not timing wrong results")

    # Warm-up and calibration: N calls per sample.
    configs = [(tower, b, t) for t in threads for tower in towers for b in batches]
    calls = {}
    for tower, b, t in configs:
        for side in SIDES:
            w = workers[(side, t)]
            one = float(w.ask(f"run {tower}-b{b} 1"))  # warm-up; timed again unless it is already long
            if one < 2 * min_sample:
                one = float(w.ask(f"run {tower}-b{b} 1"))
            calls[(side, tower, b, t)] = max(1, int(np.ceil(min_sample / max(one, 1e-6))))
        log(f"warm-up {tower} batch {b}, {t} thread(s): calls per sample "
            + ", ".join(f"{s} {calls[(s, tower, b, t)]}" for s in SIDES))

    samples = {}  # (side, tower, b, t) -> [seconds per call]
    t_timing = time.time()
    for r in range(rounds):
        for i, (tower, b, t) in enumerate(configs):
            k = (r + i) % len(SIDES)
            for side in SIDES[k:] + SIDES[:k]:  # rotating order
                n = calls[(side, tower, b, t)]
                secs = float(workers[(side, t)].ask(f"run {tower}-b{b} {n}"))
                samples.setdefault((side, tower, b, t), []).append(secs / n)
        log(f"round {r + 1}/{rounds} done ({time.time() - t_timing:.0f} s), load average {loadavg()}")
    for w in workers.values():
        w.close()
    load_end = loadavg()

    # The table.
    print(f"# gst-moe ({a.precision} weights) vs PyTorch vs ONNX Runtime (fp32): CLIP ViT-B/32 shapes, "
          "random weights\n")
    print(f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} CPUs; load average {load_start} at start, "
          f"{load_end} at end; {rounds} interleaved rounds, medians; text {a.text_tokens} tokens.")
    for t in threads:
        print(f"- {t} thread(s): gst-moe [{infos[('gst-moe', t)]}]; {infos[('pytorch', t)]}; "
              f"{infos[('onnxruntime', t)]}")
    print("- embeddings vs PyTorch (max |diff| / max |PyTorch|): "
          + "; ".join(f"{tw}: " + ", ".join(f"{s} {e:.1e}" for s, e in check[tw].items()) for tw in towers))
    print()
    print("| tower | batch | threads | gst-moe items/s | PyTorch items/s | ONNX Runtime items/s "
          "| gst-moe/PyTorch | gst-moe/ORT | gst-moe GFLOP/s | spread |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    flops = {tower: flop_per_item(model_dir, tower, a.text_tokens) for tower in towers}
    for tower in towers:
        for b in batches:
            for t in threads:
                med = {s: statistics.median(samples[(s, tower, b, t)]) for s in SIDES}
                ratio = {s: statistics.median([p / e for p, e in zip(samples[(s, tower, b, t)],
                                                                     samples[("gst-moe", tower, b, t)])])
                         for s in ("pytorch", "onnxruntime")}
                spread = max((max(v) - min(v)) / statistics.median(v)
                             for v in (samples[(s, tower, b, t)] for s in SIDES))
                print(f"| {tower} | {b} | {t} | {fmt(b / med['gst-moe'])} | {fmt(b / med['pytorch'])} | "
                      f"{fmt(b / med['onnxruntime'])} | {ratio['pytorch']:.2f}× | {ratio['onnxruntime']:.2f}× | "
                      f"{fmt(b / med['gst-moe'] * flops[tower] / 1e9)} | {100 * spread:.0f}% |")
                results.append({"tower": tower, "batch": b, "threads": t,
                                "seconds_per_call": {s: samples[(s, tower, b, t)] for s in SIDES},
                                "items_per_s": {s: b / med[s] for s in SIDES},
                                "ratio_vs": ratio, "spread": spread})
    print("\nitems/s = batch ÷ median time of one call; gst-moe/peer = median over rounds of "
          "time(peer) ÷ time(gst-moe) in the same round (above 1× gst-moe is faster); spread = (max − min) ÷ median "
          "over rounds, noisiest side; GFLOP/s = items/s × GFLOP per item ("
          + ", ".join(f"{'image' if tw == 'vision' else 'text'} {flops[tw] / 1e9:.2f}" for tw in towers)
          + f"; GEMMs, attention, patch embedding). Total {time.time() - t_start:.0f} s ({time.time() - t_timing:.0f} s timed rounds).")
    report = {"date": str(datetime.date.today()), "cpu": cpu_model(), "precision": a.precision, "load_start": load_start,
              "load_end": load_end, "rounds": rounds, "text_tokens": a.text_tokens, "workers": {
                  f"{s} {t}t": v for (s, t), v in infos.items()}, "check_vs_pytorch": check, "results": results}
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
