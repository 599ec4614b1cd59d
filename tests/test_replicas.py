#!/usr/bin/python3
"""Replicas behind moe-broker, one of them killed under load: a client that retries loses nothing.

Builds a small index with pipelines/build-index.sh (the test fixtures' tiny models), starts
pipelines/serve-replicas.sh with 3 replicas on free loopback ports, and waits until all three
answer. Then it sends 60 requests through examples/client.py's LazyPirate (re-send by id after a
timeout, answers de-duplicated by id): 30 that are answered normally, then, with one replica
frozen (SIGSTOP), 30 more, of which the broker deals about a third to the frozen replica; that
replica is then killed (SIGKILL) with them, as a supervisor kills a hung process. The frozen
stretch makes the loss certain instead of a matter of timing: a replica killed while running
holds only what it has not answered yet, often nothing with these tiny models. Checks, as a
TAP stream for meson: each of the 60 ids is delivered exactly once, as a correct result document
(an image of the catalog finds itself first); the kill did cost requests (so the retry was what
saved them) and the survivors answered them; serve-replicas.sh outlives the replica and stops
everything on SIGTERM. Also: deploy/k8s/ parses and its parts agree with one another,
moe-broker refuses bad arguments, and with CURVE it serves an allowed client and no other.

    tests/test_replicas.py SOURCE_DIR MOE_BROKER [--retries N]

--retries 0 runs the same without the retry: the killed replica's requests then stay
unanswered and the test fails (docs/replicas.md, "Tests"). Needs python3-zmq and python3-yaml.
"""
import argparse
import base64
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import zmq

from tap_util import free_endpoint, plan, skip, stop_process, tap

REPLICAS = 3
REQUESTS = 60
RETRY_TIMEOUT_S = 3.0
PATIENCE_S = 120
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40), (30, 210, 210), (210, 30, 200)]


def png(width, height, rgb):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + bytes(rgb) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def check_manifests(source):
    """deploy/k8s/*.yaml parse, and the names and ports that tie them together agree."""
    try:
        import yaml
    except ImportError:
        skip("deploy/k8s parses", "python3-yaml is not installed")
        return
    docs, problems = [], []
    files = sorted(glob.glob(os.path.join(source, "deploy/k8s/*.yaml")))
    for path in files:
        try:
            with open(path) as f:
                docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            problems.append(f"{path}: {e}")
    by_kind = {}
    for name, d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= d.keys():
            problems.append(f"{name}: a document without apiVersion, kind and metadata")
            continue
        by_kind.setdefault(d["kind"], []).append(d)
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler"):
        if kind not in by_kind:
            problems.append(f"no {kind}")
    if not problems:
        deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
        service = by_kind["Service"][0]
        containers = {n: d["spec"]["template"]["spec"]["containers"][0] for n, d in deployments.items()}
        runs = {n: " ".join(c.get("command", []) + c.get("args", [])) for n, c in containers.items()}
        broker = [n for n, line in runs.items() if "moe-broker" in line]
        replicas = [n for n, line in runs.items() if "serve.sh" in line]
        if len(broker) != 1 or len(replicas) != 1:
            problems.append(f"expected one moe-broker and one serve.sh Deployment, got {broker} and {replicas}")
        else:
            labels = deployments[broker[0]]["spec"]["template"]["metadata"]["labels"]
            selector = service["spec"]["selector"]
            if any(labels.get(k) != v for k, v in selector.items()):
                problems.append(f"the Service selects {selector}, the broker's pods are {labels}")
            env = {e["name"]: e.get("value") for e in containers[replicas[0]].get("env", [])}
            if env.get("QUERY_BIND") != "false" or env.get("RESULT_BIND") != "false":
                problems.append(f"the replicas must connect (QUERY_BIND / RESULT_BIND false): {env}")
            host = service["metadata"]["name"]
            for var in ("QUERY_ENDPOINT", "RESULT_ENDPOINT"):
                if host not in (env.get(var) or ""):
                    problems.append(f"{var} {env.get(var)!r} does not name the broker's Service {host!r}")
            ports = {p["port"] for p in service["spec"]["ports"]}
            for var in ("QUERY_ENDPOINT", "RESULT_ENDPOINT"):
                port = int((env.get(var) or ":0").rsplit(":", 1)[1])
                if port not in ports:
                    problems.append(f"{var} port {port} is not a port of the Service ({sorted(ports)})")
            target = by_kind["HorizontalPodAutoscaler"][0]["spec"]["scaleTargetRef"]
            if target.get("kind") != "Deployment" or target.get("name") != replicas[0]:
                problems.append(f"the HorizontalPodAutoscaler scales {target}, not the replicas' Deployment")
    tap(bool(files) and not problems, f"deploy/k8s ({len(files)} files, {len(docs)} documents) parses and agrees",
        "\n".join(problems) or "no deploy/k8s/*.yaml")


def check_broker_arguments(broker):
    cases = [(["--help"], 0, "Usage: moe-broker"), (["--bogus"], 2, "unknown option '--bogus'"),
             (["--request-hwm", "-1"], 2, "--request-hwm takes an integer"), (["extra"], 2, "unexpected argument"),
             (["--requests", "tcp://127.0.0.1:1", "--results", "tcp://127.0.0.1:1"], 2, "the same endpoint"),
             (["--curve-allowed-keys", "/nonexistent"], 2, "CURVE needs both")]
    wrong = []
    for argv, status, fragment in cases:
        run = subprocess.run([broker] + argv, capture_output=True, text=True, timeout=30)
        if run.returncode != status or fragment not in run.stdout + run.stderr:
            wrong.append(f"{argv}: exit {run.returncode}, {(run.stdout + run.stderr).strip()[:300]!r}")
    tap(not wrong, "moe-broker: --help, and a clear error with exit 2 for bad arguments", "\n".join(wrong))


def check_broker_curve(broker, work):
    """With the CURVE options, an allowed client is served through the broker and another is not
    (the replica side stays plain: here a stand-in replica that answers every request)."""
    import threading
    import zmq.auth
    from subscriber import curve_client

    keys = os.path.join(work, "keys")
    os.makedirs(os.path.join(keys, "allowed"))
    for name in ("server", "alice", "mallory"):
        zmq.auth.create_certificates(keys, name)
    os.rename(os.path.join(keys, "alice.key"), os.path.join(keys, "allowed", "alice.key"))
    requests, results, replica_requests, replica_results = (free_endpoint() for _ in range(4))
    proc = subprocess.Popen([broker, "--requests", requests, "--results", results, "--replica-requests",
                             replica_requests, "--replica-results", replica_results, "--curve-secret-key-file",
                             os.path.join(keys, "server.key_secret"), "--curve-allowed-keys",
                             os.path.join(keys, "allowed")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ctx = zmq.Context()
    stop = threading.Event()

    def replica():
        pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        pull.connect(replica_requests)
        pub.connect(replica_results)
        while not stop.is_set():
            if pull.poll(100):
                pub.send_string(json.dumps({"id": json.loads(pull.recv())["id"]}))
        pull.close(0)
        pub.close(0)

    def answered(name):
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        for sock in (sub, push):
            curve_client(sock, os.path.join(keys, "server.key"), os.path.join(keys, f"{name}.key_secret"))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(results)
        push.connect(requests)
        got = set()
        deadline = time.monotonic() + 5
        n = 0
        while time.monotonic() < deadline and len(got) < 3:
            try:  # a refused client's PUSH has no connection to queue for: it must not block
                push.send_string(json.dumps({"id": f"{name}-{n}"}), zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                pass
            while sub.poll(100):
                got.add(json.loads(sub.recv())["id"])
        sub.close(0)
        push.close(0)
        return got

    thread = threading.Thread(target=replica)
    thread.start()
    try:
        alice, mallory = answered("alice"), answered("mallory")
    finally:
        stop.set()
        thread.join()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
        ctx.term()
    tap(len(alice) >= 3 and not mallory and proc.returncode == 0,
        "moe-broker with CURVE: an allowed client is served, another gets nothing",
        f"alice got {sorted(alice)}, mallory {sorted(mallory)}; exit {proc.returncode}\n{output}")


class Replicas:
    """pipelines/serve-replicas.sh on free loopback ports, its output in a log file."""

    def __init__(self, source, broker, index, work):
        self.requests, self.results = free_endpoint(), free_endpoint()
        env = dict(os.environ, MOE_BROKER=broker, REPLICAS=str(REPLICAS), QUERY_ENDPOINT=self.requests,
                   RESULT_ENDPOINT=self.results, REPLICA_QUERY_ENDPOINT=free_endpoint(),
                   REPLICA_RESULT_ENDPOINT=free_endpoint(),
                   MODEL=os.path.join(source, "tests/fixtures/clip_tiny_bpe"),
                   ADAPTER=os.path.join(source, "tests/fixtures/adapter_tiny"))
        self.known = {}
        self.log_path = os.path.join(work, "serve-replicas.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([os.path.join(source, "pipelines/serve-replicas.sh"), index], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                         for s in (signal.SIGINT, signal.SIGTERM)])

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def pids(self):
        """{replica number: pid, "broker": pid} as the script announced them, once all are."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = {}
            for line in self.output().splitlines():
                if line.startswith("serve-replicas: ") and ": pid " in line:
                    name, pid = line[len("serve-replicas: "):].split(": pid ")
                    found["broker" if name == "moe-broker" else int(name.split()[-1])] = int(pid.split(",")[0])
            if len(found) == REPLICAS + 1:
                self.known = found
                return found
            time.sleep(0.1)
        return {}

    def stop(self):
        """Whatever is still running, if the test ended early: the script, then its processes."""
        stop_process(self.proc, signal.SIGTERM)
        for pid in self.known.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def wait_for_every_replica(push, sub, replicas):
    """Probes until answers came from REPLICAS different streams (each replica's zmq-publish has
    its own): every replica is then connected to the broker and serving."""
    streams = set()
    deadline = time.monotonic() + 180
    n = 0
    while len(streams) < REPLICAS and time.monotonic() < deadline and replicas.proc.poll() is None:
        push.send_string(json.dumps({"id": f"probe-{n}", "text": "probe"}))
        n += 1
        while sub.poll(200):
            doc = json.loads(sub.recv())
            streams.add(doc.get("stream"))
    while sub.poll(300):  # the other probes' answers
        sub.recv()
    return streams


def kill_one_replica(source, broker, work, retries):
    """serve-replicas.sh with REPLICAS replicas, one killed under load, the client retrying."""
    from client import LazyPirate
    from subscriber import GapCheck

    catalog = os.path.join(work, "catalog")
    os.mkdir(catalog)
    images = []
    for i, rgb in enumerate(COLOURS):
        with open(os.path.join(catalog, f"item{i}.png"), "wb") as f:
            f.write(png(32, 32, rgb))
        images.append((f"item{i}", png(32, 32, rgb)))
    index = os.path.join(work, "catalog.faiss")
    env = dict(os.environ, MODEL=os.path.join(source, "tests/fixtures/clip_tiny_bpe"),
               ADAPTER=os.path.join(source, "tests/fixtures/adapter_tiny"))
    built = subprocess.run([os.path.join(source, "pipelines/build-index.sh"), catalog, index], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if not tap(built.returncode == 0, "the index builds", built.stdout[-3000:]):
        return

    ctx = zmq.Context()
    replicas = Replicas(source, broker, index, work)
    try:
        pids = replicas.pids()
        broker_pid = pids.pop("broker", None)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(replicas.results)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(replicas.requests)
        streams = wait_for_every_replica(push, sub, replicas)
        if not tap(len(pids) == REPLICAS and len(streams) == REPLICAS,
                   f"all {REPLICAS} replicas answer through the broker",
                   f"pids {pids}, answers from {len(streams)} streams\n{replicas.output()[-4000:]}"):
            return

        # Requests: texts, and the catalog's own images (each must find itself first).
        requests = {}
        for i in range(REQUESTS):
            if i % 2:
                item, data = images[i % len(images)]
                requests[f"r{i}"] = ({"image_base64": base64.b64encode(data).decode("ascii"), "k": 3}, item)
            else:
                requests[f"r{i}"] = ({"text": f"a {['red', 'green', 'blue'][i % 3]} square {i}", "k": 3}, None)
        client = LazyPirate(push, sub, retry_timeout=RETRY_TIMEOUT_S, retries=retries, gaps=GapCheck())
        delivered = {}  # id -> the documents the client delivered for it

        def collect(ids, patience):
            deadline = time.monotonic() + patience
            while any(i in client.pending for i in ids) and time.monotonic() < deadline:
                answer = client.next_answer(deadline - time.monotonic())
                if answer:
                    delivered.setdefault(answer[0], []).append(answer[1])

        ids = list(requests)
        first, second = ids[:REQUESTS // 2], ids[REQUESTS // 2:]
        for rid in first:
            client.send(rid, requests[rid][0])
        collect(first, PATIENCE_S)
        resends_before_kill = client.resends

        victim = pids[2]
        os.kill(victim, signal.SIGSTOP)
        for rid in second:
            client.send(rid, requests[rid][0])
        time.sleep(1.0)  # the broker deals the frozen replica its share
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        collect(second, PATIENCE_S)
        streams_after = {d["stream"] for rid in second for d in delivered.get(rid, [])}

        missing = [rid for rid in ids if rid not in delivered]
        twice = [rid for rid, docs in delivered.items() if len(docs) != 1]
        tap(not missing and not twice and set(delivered) == set(ids),
            f"each of the {REQUESTS} requests is answered exactly once at the client, one replica killed midway",
            f"unanswered {missing} (given up: {client.abandoned}); more than once: {twice}; "
            f"re-sent {client.resends}\n{replicas.output()[-3000:]}")

        wrong = []
        for rid, docs in delivered.items():
            doc, (request, item) = docs[0], requests[rid]
            hits = doc.get("results") or []
            if doc.get("type") != "result" or doc.get("id") != rid or len(hits) != 3:
                wrong.append(f"{rid}: {json.dumps(doc)[:300]}")
            elif item is None and doc.get("query") != request["text"]:
                wrong.append(f"{rid}: query {doc.get('query')!r}, sent {request['text']!r}")
            elif item is not None and (hits[0].get("id") != item or abs(hits[0].get("score", 0) - 1) > 1e-3):
                wrong.append(f"{rid}: image of {item} found {hits[0].get('id')} ({hits[0].get('score')}) first")
        tap(not wrong, "every answer is the right result document (3 hits; an image finds itself first)",
            "\n".join(wrong[:20]))

        tap(client.resends - resends_before_kill > 0 and len(streams_after) < REPLICAS,
            "the kill cost requests, re-sent by id and answered by the surviving replicas",
            f"re-sent {client.resends - resends_before_kill} after the kill; second half answered from "
            f"{len(streams_after)} streams")
        print(f"# re-sent {client.resends} requests, {client.duplicates} duplicate answers dropped, "
              f"last answer {time.monotonic() - killed_at:.1f} s after the kill")

        still_serving = replicas.proc.poll() is None and all(alive(p) for n, p in pids.items() if p != victim)
        tap(still_serving and f"(pid {victim}) exited" in replicas.output(),
            "serve-replicas.sh reports the dead replica and goes on with the others", replicas.output()[-3000:])

        replicas.proc.send_signal(signal.SIGTERM)
        try:
            status = replicas.proc.wait(60)
        except subprocess.TimeoutExpired:
            status = None
        left = [p for p in list(pids.values()) + [broker_pid] if alive(p)]
        tap(status == 0 and not left, "SIGTERM stops the replicas and the broker, exit status 0",
            f"status {status}, still running: {left}\n{replicas.output()[-3000:]}")
    finally:
        ctx.destroy(0)
        replicas.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("broker")
    ap.add_argument("--retries", type=int, default=3, help="the client's re-sends (0: the check that must fail)")
    args = ap.parse_args()
    source = os.path.abspath(args.source)
    sys.path.insert(0, os.path.join(source, "examples"))
    work = tempfile.mkdtemp(prefix="moe-replicas-")
    try:
        check_manifests(source)
        check_broker_arguments(args.broker)
        check_broker_curve(args.broker, work)
        kill_one_replica(source, args.broker, work, args.retries)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return plan()


if __name__ == "__main__":
    sys.exit(main())
