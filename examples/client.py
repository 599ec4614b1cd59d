#!/usr/bin/python3
"""Send queries to a running gst-moe service and print the results as they come back.

    examples/client.py "red striped mug" "small blue shoe" --image photo.png
        [--requests tcp://127.0.0.1:5555] [--results tcp://127.0.0.1:5556] [--k 5]
        [--retry-timeout 5] [--retries 3] [--timeout 30]
        [--server-key server.key --client-key client.key_secret]
    examples/client.py "in red" --image mug.png --image shoe.png      (hybrid: image + text)

Requests are PUSHed to the service's zmq-query (or to moe-broker in front of replicas,
docs/replicas.md); results are read from its zmq-publish stream and matched to the requests by
id (docs/zmq-schema.md). Each text is one request and each image another; with one text and
images, each image goes with that text in one hybrid request ("like this photo, but red"). Image
files are sent as image_base64, so they need not be on the service's machine nor under its
image-root. A request unanswered after --retry-timeout seconds is sent again with the same id, up
to --retries times, and a second answer to an id is ignored (the ZeroMQ guide's "Lazy Pirate"
retry over PUSH/SUB: it covers what a replica, a restart or a dropped connection lost). With
--server-key and --client-key both sockets connect with CURVE (the service's public certificate
and this client's secret certificate, as zmq.auth.create_certificates writes them). Results lost
on the way show as gaps in "seq", reported on stderr. Needs python3-zmq (Debian).
"""
import argparse
import base64
import json
import math
import sys
import time
import uuid

import zmq

from subscriber import GapCheck, curve_client


class LazyPirate:
    """Requests PUSHed, answers read from a SUB socket and matched by id, each request re-sent
    with its own id until answered: the guide's Lazy Pirate (chapter 4) over PUSH/SUB.

    The guide's client waits on a REQ socket, and after a timeout closes it, reopens it and sends
    again. PUSH and SUB need none of that (they reconnect by themselves and never get stuck in a
    state), so here each request has its own timer: sent again with the same id when no answer
    came within `retry_timeout` seconds, given up after `retries` re-sends. Ids make the retry
    safe: a request answered twice (its first answer was only late) is delivered once, the
    later copies counted in `duplicates` and dropped. The service answers every request it
    receives (docs/zmq-schema.md, "Guarantees"); what a retry covers is what never reached an
    answer: requests queued for, or held by, a replica that died, and answers dropped on the way.
    """

    def __init__(self, push, sub, retry_timeout=5.0, retries=3, gaps=None):
        self.push, self.sub = push, sub
        self.retry_timeout, self.retries = retry_timeout, retries
        self.gaps = gaps if gaps is not None else GapCheck(concurrent_streams=True)
        self.pending = {}  # id -> [message, times sent, when to re-send (time.monotonic())]
        self.next_due = math.inf  # no later than the earliest re-send time of `pending`
        self.answered = set()  # ids whose answer was delivered: later answers are duplicates
        self.abandoned = []  # ids given up, unanswered after 1 + retries sends
        self.resends = 0
        self.duplicates = 0

    def send(self, rid, request):
        """Sends `request` (a dict without "id") under the id `rid` (a string: answers carry it
        back as one)."""
        message = json.dumps({"id": rid, **request})
        self.push.send_string(message)
        due = time.monotonic() + self.retry_timeout
        self.pending[rid] = [message, 1, due]
        self.next_due = min(self.next_due, due)

    def _resend_overdue(self, now):
        if now < self.next_due:
            return
        for rid, entry in list(self.pending.items()):
            message, sends, due = entry
            if now < due:
                continue
            if sends > self.retries:
                del self.pending[rid]
                self.abandoned.append(rid)
                continue
            try:
                # Never blocks: with no service to take it (its queue full), the next round tries.
                self.push.send_string(message, zmq.NOBLOCK)
                entry[1] += 1
                self.resends += 1
            except zmq.Again:
                pass
            entry[2] = now + self.retry_timeout
        self.next_due = min((entry[2] for entry in self.pending.values()), default=math.inf)

    def next_answer(self, timeout):
        """The next answer to a pending request, as (id, document); None when no request is
        pending (all answered or given up) or none was answered within `timeout` seconds.
        Re-sends overdue requests meanwhile; skips other clients' answers and duplicates."""
        end = time.monotonic() + timeout
        while self.pending:
            now = time.monotonic()
            self._resend_overdue(now)
            if not self.pending or now >= end:
                return None
            wake = min(end, self.next_due)
            if not self.sub.poll(max(1, int((wake - now) * 1000))):
                continue
            doc = json.loads(self.sub.recv_multipart()[-1])  # [topic, document] or [document]
            self.gaps.check(doc)
            rid = doc.get("id") if isinstance(doc, dict) else None
            if rid in self.pending:
                del self.pending[rid]
                self.answered.add(rid)
                return rid, doc
            if rid in self.answered:
                self.duplicates += 1
        return None


def requests_from(args, session):
    """{id: (request without id, what to print for it)} for the texts and images asked for."""
    def image_base64(path):
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode("ascii")

    if args.image and args.texts:  # hybrid: the one text modifies each image
        text = args.texts[0]
        return {f"{session}-h{i}": ({"text": text, "image_base64": image_base64(path)}, f'{path} + "{text}"')
                for i, path in enumerate(args.image)}
    out = {f"{session}-t{i}": ({"text": text}, text) for i, text in enumerate(args.texts)}
    out.update({f"{session}-i{i}": ({"image_base64": image_base64(path)}, path) for i, path in enumerate(args.image)})
    return out


def print_answer(doc, label):
    print(f'\n{doc["id"]}: {label}')
    if doc["type"] == "error":
        error = doc["error"]
        print(f'  error in {error["stage"]}: {error["reason"]} [{error.get("code", "?")}]')
        return
    for r in doc["results"]:
        extra = " ".join(f"{k}={v}" for k, v in r.get("fields", {}).items())  # the catalog line's own
        print(f'  {r["rank"]:2d}. {r["score"]:.3f}  {r.get("id") or ""}  {r["caption"] or r["uri"]}  {extra}'.rstrip())
    fusion = doc.get("fusion")  # hybrid requests: how the image and the text were weighed
    if fusion:
        print(f'  fusion: image {fusion["image"]:.2f}, text {fusion["text"]:.2f} ({fusion["method"]})')
    if doc["experts"]:  # empty when the service runs without an adapter (ADAPTER=none)
        print("  experts: " + ", ".join(f'#{e["expert"]} ({e["weight"]:.2f})' for e in doc["experts"]))
    cost = doc.get("cost")  # null without moe-encode; absent from services older than it
    line = f'  {doc["timings_ms"]["total"]:.1f} ms'
    if cost:
        line += f' (compute {cost["compute_ms"]:.2f} ms, copy {cost["copy_ms"]:.2f} ms, wait {cost["wait_ms"]:.2f} ms'
        line += f', batch of {cost["batch_rows"]})'
    print(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("texts", nargs="*", help="text queries; with --image, one text that modifies each image")
    ap.add_argument("--image", action="append", default=[], help="image file to query with")
    ap.add_argument("--requests", default="tcp://127.0.0.1:5555")
    ap.add_argument("--results", default="tcp://127.0.0.1:5556")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for all results")
    ap.add_argument("--retry-timeout", type=float, default=5.0,
                    help="seconds without an answer after which a request is sent again, same id")
    ap.add_argument("--retries", type=int, default=3, help="re-sends of a request before giving it up (0: none)")
    ap.add_argument("--server-key", help="the service's public certificate (CURVE)")
    ap.add_argument("--client-key", help="this client's secret certificate, *.key_secret (CURVE)")
    args = ap.parse_args()
    if bool(args.server_key) != bool(args.client_key):
        ap.error("CURVE needs both --server-key and --client-key")
    if args.image and len(args.texts) > 1:
        ap.error(f"with --image, give at most one text: it is sent with each image as one hybrid request "
                 f"(image + modifying text), so {len(args.texts)} texts would be ambiguous")
    if args.retry_timeout <= 0:
        ap.error(f"--retry-timeout must be more than 0 seconds (got {args.retry_timeout})")
    if args.retries < 0:
        ap.error(f"--retries must be 0 or more (got {args.retries})")

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

    client = LazyPirate(push, sub, args.retry_timeout, args.retries)  # a missed result is re-sent
    labels = {}
    for rid, (request, label) in requests_from(args, uuid.uuid4().hex[:8]).items():
        client.send(rid, {"k": args.k, **request})
        labels[rid] = label
    deadline = time.monotonic() + args.timeout
    while client.pending and time.monotonic() < deadline:
        answer = client.next_answer(deadline - time.monotonic())
        if answer:
            print_answer(answer[1], labels[answer[0]])
    if client.resends:
        print(f"\nre-sent {client.resends} requests unanswered after {args.retry_timeout}s "
              f"({client.duplicates} late answers ignored)", file=sys.stderr)
    unanswered = client.abandoned + list(client.pending)
    if unanswered:
        print(f"\nno answer for: {', '.join(unanswered)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
