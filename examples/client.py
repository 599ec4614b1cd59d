#!/usr/bin/python3
"""Send queries to a running gst-moe service and print the results as they come back.

    examples/client.py "red striped mug" "small blue shoe" --image photo.png
        [--requests tcp://127.0.0.1:5555] [--results tcp://127.0.0.1:5556] [--k 5]
        [--server-key server.key --client-key client.key_secret]

Requests are PUSHed to the service's zmq-query; results are read from its zmq-publish stream
and matched to the requests by id (docs/zmq-schema.md). Image files are sent as image_base64, so
they need not be on the service's machine nor under its image-root. With --server-key and
--client-key both sockets connect with CURVE (the service's public certificate and this client's
secret certificate, as zmq.auth.create_certificates writes them). Results lost on the way show as
gaps in "seq", reported on stderr. Needs python3-zmq (Debian).
"""
import argparse
import base64
import json
import sys
import time
import uuid

import zmq

from subscriber import GapCheck, curve_client


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("texts", nargs="*", help="text queries")
    ap.add_argument("--image", action="append", default=[], help="image file to query with")
    ap.add_argument("--requests", default="tcp://127.0.0.1:5555")
    ap.add_argument("--results", default="tcp://127.0.0.1:5556")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for all results")
    ap.add_argument("--server-key", help="the service's public certificate (CURVE)")
    ap.add_argument("--client-key", help="this client's secret certificate, *.key_secret (CURVE)")
    args = ap.parse_args()
    if bool(args.server_key) != bool(args.client_key):
        ap.error("CURVE needs both --server-key and --client-key")

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    push = ctx.socket(zmq.PUSH)
    if args.server_key:
        curve_client(sub, args.server_key, args.client_key)
        curve_client(push, args.server_key, args.client_key)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(args.results)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(args.requests)
    time.sleep(0.3)  # let the subscription reach the publisher before results flow

    session = uuid.uuid4().hex[:8]
    pending = {}
    for i, text in enumerate(args.texts):
        pending[f"{session}-t{i}"] = {"text": text}
    shown = {}
    for i, path in enumerate(args.image):
        with open(path, "rb") as f:
            pending[f"{session}-i{i}"] = {"image_base64": base64.b64encode(f.read()).decode("ascii")}
        shown[f"{session}-i{i}"] = path
    for rid, body in pending.items():
        push.send_string(json.dumps({"id": rid, "k": args.k, **body}))

    deadline = time.time() + args.timeout
    gaps = GapCheck()  # a missed result may be one of ours: it then stays pending
    while pending and time.time() < deadline:
        if not sub.poll(200):
            continue
        doc = json.loads(sub.recv_multipart()[-1])
        gaps.check(doc)
        req = pending.pop(doc.get("id"), None)
        if req is None:
            continue  # someone else's result
        print(f'\n{doc["id"]}: {req.get("text") or shown[doc["id"]]}')
        if doc["type"] == "error":
            error = doc["error"]
            print(f'  error in {error["stage"]}: {error["reason"]} [{error.get("code", "?")}]')
            continue
        for r in doc["results"]:
            extra = " ".join(f"{k}={v}" for k, v in r.get("fields", {}).items())  # the catalog line's own
            print(f'  {r["rank"]:2d}. {r["score"]:.3f}  {r.get("id") or ""}  {r["caption"] or r["uri"]}  {extra}'.rstrip())
        if doc["experts"]:  # empty when the service runs without an adapter (ADAPTER=none)
            print("  experts: " + ", ".join(f'#{e["expert"]} ({e["weight"]:.2f})' for e in doc["experts"]))
        cost = doc.get("cost")  # null without moe-encode; absent from services older than it
        line = f'  {doc["timings_ms"]["total"]:.1f} ms'
        if cost:
            line += f' (compute {cost["compute_ms"]:.2f} ms, copy {cost["copy_ms"]:.2f} ms, wait {cost["wait_ms"]:.2f} ms'
            line += f', batch of {cost["batch_rows"]})'
        print(line)
    if pending:
        print(f"\nno answer within {args.timeout}s for: {', '.join(pending)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
