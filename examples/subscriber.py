#!/usr/bin/python3
"""Subscribe to gst-moe's result stream and print each document.

    examples/subscriber.py [ENDPOINT] [TOPIC]     (default tcp://127.0.0.1:5556)
        [--server-key server.key --client-key client.key_secret]

With --server-key and --client-key it connects with CURVE to a zmq-publish that has
curve-secret-key-file and curve-allowed-keys set: the server's public certificate, and this
client's secret certificate, as zmq.auth.create_certificates writes them. Documents lost on the
way (the subscriber fell more than send-hwm messages behind) are reported on stderr, from the gaps
in their "seq". Needs python3-zmq (Debian). See docs/zmq-schema.md for the documents.
"""
import argparse
import json
import sys

import zmq
import zmq.auth


class GapCheck:
    """Follows "seq" per "stream" and says on stderr what was missed.

    concurrent_streams: several services publish at once (replicas behind moe-broker), so a stream
    first seen midway is another replica joined, not a restart: only gaps within a stream count.
    """

    def __init__(self, concurrent_streams=False):
        self.last = {}  # stream id -> last seq seen
        self.concurrent_streams = concurrent_streams

    def check(self, doc):
        if not isinstance(doc, dict) or "stream" not in doc or not isinstance(doc.get("seq"), int):
            return  # not numbered by zmq-publish
        stream, seq = doc["stream"], doc["seq"]
        last = self.last.get(stream)
        if last is None and self.last and seq > 1 and not self.concurrent_streams:
            # A new stream (the service restarted) after one we followed: its first documents were lost.
            print(f"missed {seq - 1} results (seq 1..{seq - 1} of the new stream {stream})", file=sys.stderr)
        elif last is not None and seq > last + 1:
            print(f"missed {seq - last - 1} results (seq {last + 1}..{seq - 1} of stream {stream})", file=sys.stderr)
        if last is None or seq > last:
            self.last[stream] = seq


def curve_client(sock, server_key, client_key):
    """Makes `sock` a CURVE client of the server whose public certificate is `server_key`."""
    public, secret = zmq.auth.load_certificate(client_key)
    if secret is None:
        raise SystemExit(f"{client_key} holds no secret-key: give the client's *.key_secret file")
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.curve_serverkey = zmq.auth.load_certificate(server_key)[0]


def main():
    ap = argparse.ArgumentParser(description="Print gst-moe's result stream.")
    ap.add_argument("endpoint", nargs="?", default="tcp://127.0.0.1:5556")
    ap.add_argument("topic", nargs="?", default="")
    ap.add_argument("--server-key", help="the service's public certificate (CURVE)")
    ap.add_argument("--client-key", help="this client's secret certificate, *.key_secret (CURVE)")
    ap.add_argument("--replicas", action="store_true",
                    help="the endpoint is moe-broker's: several replicas' streams interleave")
    args = ap.parse_args()
    if bool(args.server_key) != bool(args.client_key):
        ap.error("CURVE needs both --server-key and --client-key")

    sub = zmq.Context.instance().socket(zmq.SUB)
    if args.server_key:
        curve_client(sub, args.server_key, args.client_key)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    sub.connect(args.endpoint)
    print(f"subscribed to {args.endpoint}", file=sys.stderr)
    gaps = GapCheck(concurrent_streams=args.replicas)
    while True:
        frames = sub.recv_multipart()
        doc = json.loads(frames[-1])  # [topic, document] or [document]
        gaps.check(doc)
        if not isinstance(doc, dict):
            print(json.dumps(doc))
        elif doc.get("type") == "result":
            hits = ", ".join(f'{r.get("id") or r["caption"] or r["uri"]} ({r["score"]:.3f})' for r in doc["results"])
            experts = " ".join(f'#{e["expert"]}:{e["weight"]:.2f}' for e in doc["experts"])
            print(f'{doc["id"]}: {doc["query"] or doc["uri"]} -> {hits}  [experts {experts}]')
        elif doc.get("type") == "error":
            error = doc["error"]
            print(f'{doc["id"]}: error in {error["stage"]}: {error["reason"]} [{error.get("code", "?")}]')
        else:
            print(json.dumps(doc))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
