#!/usr/bin/python3
"""The query service as shipped (pipelines/serve.sh) against a hostile client, on loopback.

Builds a small index with pipelines/build-index.sh, starts pipelines/serve.sh, and sends what
an attacker would: deep nesting, a huge text, huge and wrong-typed fields, multi-frame, empty and
non-UTF-8 messages, an aspect-ratio bomb, a decompression-bomb header, a truncated JPEG, path
traversal; meanwhile one subscriber never reads. Then it checks, as a TAP stream for meson:
every request is answered exactly once on a healthy subscriber, with no gap in the stream; the
service is still alive and answering; its peak RSS stayed under the bound. A second run without
image-root checks that image paths are refused there. Needs python3-zmq.

    tests/hostile_client.py SOURCE_DIR      (GST_PLUGIN_PATH_1_0 names the built plugin)
"""
import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import zmq

from tap_util import free_port, plan, skip, stop_process, tap

# The service must stay under this peak RSS whatever the requests (the bound: the
# 1x100,000 PNG alone once took 1.4 GB).
PEAK_RSS_BOUND_MB = 300
# Enough results to overflow the stalled subscriber's queue many times over (zmq-publish's
# send-hwm is 1000; the stalled socket's own buffers are made tiny).
FILLERS = 2500
PATIENCE_S = 120


def png(width, height, rows=None, declared=None):
    """An RGB8 PNG; `declared` overrides the header's size (a decompression-bomb header)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    w, h = declared or (width, height)
    raw = rows if rows is not None else b"".join(b"\0" + bytes([40, 120, 200]) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def reason(doc):
    """The reason of an error document ("" for a result)."""
    error = doc.get("error") or {}
    return error.get("reason", "") if isinstance(error, dict) else str(error)


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Service:
    """pipelines/serve.sh on two free loopback ports, its output in a log file."""

    def __init__(self, source, index, work, image_root):
        self.requests = f"tcp://127.0.0.1:{free_port()}"
        self.results = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, QUERY_ENDPOINT=self.requests, RESULT_ENDPOINT=self.results)
        if image_root:
            env["IMAGE_ROOT"] = image_root
        self.log_path = os.path.join(work, f"serve-{free_port()}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([os.path.join(source, "pipelines/serve.sh"), index], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self):
        stop_process(self.proc, patience_s=20)
        self.log.close()


class Subscriber:
    """A healthy subscriber: reads everything, keeps each document, checks seq for gaps."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.docs = []

    def read(self, timeout_ms):
        if not self.sock.poll(timeout_ms):
            return None
        doc = json.loads(self.sock.recv())
        self.docs.append(doc)
        return doc

    def gaps(self):
        seqs = [d["seq"] for d in self.docs if "seq" in d]
        return [(a, b) for a, b in zip(seqs, seqs[1:]) if b != a + 1]


def connect_and_probe(ctx, service, stalled=False):
    """A PUSH socket and a healthy subscriber (plus, if asked, one that never reads, connected
    first), once a probe request has come back: before that, PUB drops results."""
    sockets = []
    if stalled:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(service.results)
        sockets.append(s)
    sub = Subscriber(ctx, service.results)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(service.requests)
    deadline = time.monotonic() + 180  # model loading, slower under sanitizers
    n = 0
    while time.monotonic() < deadline and service.proc.poll() is None:
        push.send_string(json.dumps({"id": f"probe-{n}", "text": "probe"}))
        n += 1
        doc = sub.read(500)
        if doc is not None:
            # Drain the other probes' answers, then start from a clean slate.
            while sub.read(300) is not None:
                pass
            sub.docs.clear()
            return push, sub, sockets
    return None, None, sockets


def collect(sub, expected_ids, expected_null, service):
    """Reads until every expected id and every id-less answer arrived, or patience runs out."""
    deadline = time.monotonic() + PATIENCE_S
    seen_ids = {}
    nulls = 0
    while time.monotonic() < deadline and (len(seen_ids) < len(expected_ids) or nulls < expected_null):
        doc = sub.read(1000)
        if doc is None:
            if service.proc.poll() is not None:
                break
            continue
        if doc.get("id") is None:
            nulls += 1
        else:
            seen_ids[doc["id"]] = seen_ids.get(doc["id"], 0) + 1
    # Anything late would be a duplicate.
    while sub.read(500) is not None:
        doc = sub.docs[-1]
        if doc.get("id") is None:
            nulls += 1
        else:
            seen_ids[doc["id"]] = seen_ids.get(doc["id"], 0) + 1
    return seen_ids, nulls


def main():
    source = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    work = tempfile.mkdtemp(prefix="moe-hostile-")
    ctx = zmq.Context()
    services = []
    try:
        catalog = os.path.join(work, "catalog")
        os.mkdir(catalog)
        for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]):
            rows = b"".join(b"\0" + bytes(colour) * 32 for _ in range(32))
            with open(os.path.join(catalog, f"item{i}.png"), "wb") as f:
                f.write(png(32, 32, rows))
        index = os.path.join(work, "catalog.faiss")
        built = subprocess.run([os.path.join(source, "pipelines/build-index.sh"), catalog, index],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        if built.returncode != 0:
            tap(False, "the index builds", built.stdout[-3000:])
            return

        # Hostile files, served from image-root (which holds only the catalog and these).
        aspect_bomb = png(1, 100000)
        with open(os.path.join(catalog, "aspect.png"), "wb") as f:
            f.write(aspect_bomb)
        bomb_header = png(4, 4, declared=(100000, 100000))
        jpeg_path = os.path.join(work, "photo.jpg")
        subprocess.run(["gst-launch-1.0", "-q", "videotestsrc", "num-buffers=1", "!", "video/x-raw,width=64,height=64",
                        "!", "jpegenc", "!", "filesink", f"location={jpeg_path}"], check=True, timeout=120)
        with open(jpeg_path, "rb") as f:
            jpeg = f.read()
        truncated_jpeg = jpeg[: len(jpeg) // 2]
        with open(os.path.join(catalog, "truncated.jpg"), "wb") as f:
            f.write(truncated_jpeg)
        b64 = lambda data: base64.b64encode(data).decode("ascii")

        service = Service(source, index, work, catalog)
        services.append(service)
        push, sub, stalled = connect_and_probe(ctx, service, stalled=True)
        tap(push is not None, "the service answers a first request", service.output())
        if push is None:
            return

        # (message frames, id the answer carries or None, expected "type", fragment of the error)
        cases = [
            ([b"[" * 100000], None, "error", "nested more than"),
            ([json.dumps({"id": "deep-member", "text": "x"}).encode()[:-1] + b',"p":' + b"[" * 5000 + b"]" * 5000 + b"}"],
             None, "error", "nested more than"),
            ([json.dumps({"id": "huge-text", "text": "a" * (10 << 20)}).encode()], "huge-text", "error", "max-text-bytes"),
            ([b'{"id":"huge-k","text":"x","k":1180591620717411303424}'], "huge-k", "error", "does not fit in 64 bits"),
            ([json.dumps({"id": "k-zero", "text": "x", "k": 0}).encode()], "k-zero", "error", "(got 0)"),
            ([json.dumps({"id": "k-string", "text": "x", "k": "5"}).encode()], "k-string", "error", "(got a string)"),
            ([json.dumps({"id": [1, 2], "text": "x"}).encode()], "[1,2]", "error", "id must be a string or an integer"),
            ([json.dumps({"id": "text-number", "text": 5}).encode()], "text-number", "error", "text must be a string"),
            ([json.dumps({"id": "b64-number", "image_base64": 5}).encode()], "b64-number", "error", "must be a string"),
            ([b'{"id":"mf","text":"x"}', b"second frame"], None, "error", "2 frames"),
            ([b""], None, "error", "request is empty"),
            ([b'{"id":"nu","text":"\xff\xfe"}'], None, "error", "not valid UTF-8"),
            ([json.dumps({"id": "aspect-b64", "image_base64": b64(aspect_bomb)}).encode()], "aspect-b64", None, ""),
            ([json.dumps({"id": "aspect-file", "image": "aspect.png"}).encode()], "aspect-file", None, ""),
            ([json.dumps({"id": "bomb-header", "image_base64": b64(bomb_header)}).encode()], "bomb-header", "error", ""),
            ([json.dumps({"id": "jpeg-b64", "image_base64": b64(truncated_jpeg)}).encode()], "jpeg-b64", "error", ""),
            ([json.dumps({"id": "jpeg-file", "image": "truncated.jpg"}).encode()], "jpeg-file", "error", ""),
            ([json.dumps({"id": "dotdot", "image": "../photo.jpg"}).encode()], "dotdot", "error", "outside image-root"),
            ([json.dumps({"id": "absolute", "image": "/etc/passwd"}).encode()], "absolute", "error", "outside image-root"),
            ([json.dumps({"id": "uri", "image": "file:///etc/passwd"}).encode()], "uri", "error", "outside image-root"),
            ([json.dumps({"id": "good-file", "image": "item0.png"}).encode()], "good-file", "result", ""),
        ]
        for frames, _, _, _ in cases:
            push.send_multipart(frames)
        for i in range(FILLERS):
            push.send_string(json.dumps({"id": f"filler-{i}", "text": f"filler {i % 7}", "k": 3}))
        push.send_string(json.dumps({"id": "last", "text": "plain red square"}))

        expected = {c[1]: c for c in cases if c[1] is not None}
        expected.update({f"filler-{i}": None for i in range(FILLERS)})
        expected["last"] = None
        expected_null = sum(1 for c in cases if c[1] is None)
        seen, nulls = collect(sub, expected, expected_null, service)

        missing = sorted(set(expected) - set(seen))
        tap(not missing, f"every one of {len(expected)} requests with an id is answered",
            f"missing {len(missing)}: {missing[:20]}\n{service.output()}")
        twice = sorted(i for i, n in seen.items() if n != 1)
        tap(not twice and not (set(seen) - set(expected)), "each exactly once, no answer to an unknown id",
            f"more than once: {twice[:20]}; unknown: {sorted(set(seen) - set(expected))[:20]}")
        tap(nulls == expected_null, f"the {expected_null} requests without a readable id get one answer each",
            f"got {nulls}")
        by_id = {d.get("id"): d for d in sub.docs}
        wrong = []
        for rid, (_, _, kind, fragment) in ((k, v) for k, v in expected.items() if v is not None):
            doc = by_id.get(rid)
            if doc is None:
                continue
            if kind and doc.get("type") != kind:
                wrong.append(f"{rid}: {doc.get('type')} {reason(doc)}")
            elif fragment and fragment not in reason(doc):
                wrong.append(f"{rid}: error {reason(doc)!r} lacks {fragment!r}")
        null_errors = [reason(d) for d in sub.docs if d.get("id") is None]
        for frames, rid, _, fragment in cases:
            if rid is None and not any(fragment in e for e in null_errors):
                wrong.append(f"no id-less error mentions {fragment!r}: {null_errors}")
        tap(not wrong, "each hostile request gets the answer that names its cause", "\n".join(wrong))
        echoes = [len(json.dumps(d)) for d in sub.docs]
        tap(max(echoes) < 8192, "no answer echoes an oversized request", f"largest answer {max(echoes)} bytes")
        huge = (by_id.get("huge-text") or {}).get("query") or ""
        tap(huge.startswith("aaa") and len(huge.encode()) <= 1024 + 3,
            "a refused text is echoed, clipped to 1 KiB", f"query {huge[:80]!r}... ({len(huge)} characters)")
        codes = {"invalid_request", "text_too_long", "image_too_large", "image_unavailable", "image_undecodable",
                 "model_mismatch", "duplicate_id", "internal"}
        uncoded = [d for d in sub.docs if d.get("schema") != 1 or
                   (d.get("type") == "error" and (d.get("error") or {}).get("code") not in codes)]
        tap(not uncoded, "every answer has schema 1, every error a documented code",
            json.dumps(uncoded[:5])[:2000])
        expected_codes = {"huge-text": "text_too_long", "k-zero": "invalid_request", "dotdot": "image_unavailable",
                          "jpeg-b64": "image_undecodable", "jpeg-file": "image_undecodable"}
        got_codes = {rid: ((by_id.get(rid) or {}).get("error") or {}).get("code") for rid in expected_codes}
        tap(got_codes == expected_codes, "codes name the cause, where the request failed",
            f"expected {expected_codes}, got {got_codes}")
        gaps = sub.gaps()
        has_seq = any("seq" in d for d in sub.docs)
        tap(has_seq and not gaps, "the healthy subscriber's stream has no gap (seq), next to one that never reads",
            f"seq present: {has_seq}; gaps: {gaps[:10]}")

        alive = service.proc.poll() is None
        tap(alive, "the service is alive after all of it", service.output())
        if alive:
            push.send_string(json.dumps({"id": "after", "text": "plain blue square"}))
            after, _ = collect(sub, {"after": None}, 0, service)
            tap(after.get("after") == 1, "and still answers a new request")
            peak = peak_rss_mb(service.proc.pid)
            sanitized = "libasan" in os.environ.get("LD_PRELOAD", "")
            if sanitized:
                skip(f"peak RSS {peak:.0f} MB", "AddressSanitizer's shadow memory")
            else:
                tap(peak < PEAK_RSS_BOUND_MB, f"peak RSS {peak:.0f} MB < {PEAK_RSS_BOUND_MB} MB")
        for s in stalled:
            s.close(0)
        push.close(0)
        sub.sock.close(0)
        service.stop()

        # Without image-root, every image path is refused, inside the catalog or not.
        bare = Service(source, index, work, None)
        services.append(bare)
        push, sub, _ = connect_and_probe(ctx, bare)
        if push is None:
            tap(False, "the service without image-root answers", bare.output())
            return
        for rid, image in [("inside", "item0.png"), ("dotdot", "../photo.jpg"), ("absolute", "/etc/passwd")]:
            push.send_string(json.dumps({"id": rid, "image": image}))
        seen, _ = collect(sub, {"inside": 0, "dotdot": 0, "absolute": 0}, 0, bare)
        refused = [d for d in sub.docs if d.get("type") == "error" and "no image-root" in reason(d)]
        tap(len(refused) == 3 and all(n == 1 for n in seen.values()),
            "without image-root, image paths are refused once each", json.dumps(sub.docs)[:2000])
        push.close(0)
        sub.sock.close(0)
    finally:
        for s in services:
            s.stop()
        # Sockets left open by a failed check must not make the context wait for ever.
        ctx.destroy(linger=0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        status = plan()
    sys.exit(status)
