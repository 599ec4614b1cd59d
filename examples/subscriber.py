#!/usr/bin/python3
"""Subscribe to gst-moe's result stream and print each document.

    examples/subscriber.py [ENDPOINT] [TOPIC]     (default tcp://127.0.0.1:5556)

Needs python3-zmq (Debian). See docs/zmq-schema.md for the documents.
"""
import json
import sys

import zmq

endpoint = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5556"
topic = sys.argv[2] if len(sys.argv) > 2 else ""

sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt_string(zmq.SUBSCRIBE, topic)
sub.connect(endpoint)
print(f"subscribed to {endpoint}", file=sys.stderr)
while True:
    frames = sub.recv_multipart()
    doc = json.loads(frames[-1])  # [topic, document] or [document]
    if doc.get("type") == "result":
        hits = ", ".join(f'{r["caption"] or r["uri"]} ({r["score"]:.3f})' for r in doc["results"])
        experts = " ".join(f'#{e["expert"]}:{e["weight"]:.2f}' for e in doc["experts"])
        print(f'{doc["id"]}: {doc["query"] or doc["uri"]} -> {hits}  [experts {experts}]')
    elif doc.get("type") == "error":
        print(f'{doc["id"]}: error in {doc["error"]["stage"]}: {doc["error"]["reason"]}')
    else:
        print(json.dumps(doc))
    sys.stdout.flush()
