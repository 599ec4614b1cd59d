#!/usr/bin/python3
"""A Python application that embeds the query pipeline (the Python twin of moe-query-app).

It builds  appsrc ! moe-encode ! moe-route ! moe-expert ! ann-query ! appsink  in code, pushes
text queries, and prints each JSON result document (docs/zmq-schema.md) as ann-query emits it.

    GST_PLUGIN_PATH=build/gst-plugins examples/embed_pipeline.py \
        --model models/default/clip --adapter models/default/adapter \
        --index build/demo/catalog.faiss "red striped mug" "blue square"

Needs PyGObject with GStreamer's introspection data (Debian: python3-gi gir1.2-gstreamer-1.0
gir1.2-gst-plugins-base-1.0; tools/install-deps.sh installs them).
"""
import argparse
import json
import os
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
from gi.repository import Gst  # noqa: E402


def make(factory, **props):
    element = Gst.ElementFactory.make(factory, None)
    if element is None:
        sys.exit(f"no element '{factory}': is the moe plugin on GST_PLUGIN_PATH?")
    for name, value in props.items():
        element.set_property(name.replace("_", "-"), value)
    return element


def first_error(pipeline):
    msg = pipeline.get_bus().pop_filtered(Gst.MessageType.ERROR)
    if msg is None:
        return None
    err, debug = msg.parse_error()
    return f"{msg.src.get_name()}: {err.message}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="CLIP model directory")
    ap.add_argument("--adapter", required=True, help="MoE adapter directory")
    ap.add_argument("--index", required=True, help="index built by pipelines/build-index.sh")
    ap.add_argument("--k", type=int, default=5, help="results per query")
    ap.add_argument("queries", nargs="+", help="query texts")
    args = ap.parse_args()

    Gst.init(None)
    # Elements made one by one (not from a launch string): paths need no quoting.
    src = make("appsrc", caps=Gst.Caps.from_string("text/x-raw, format=(string)utf8"), format=Gst.Format.TIME)
    stages = [
        src,
        make("moe-encode", model=args.model, max_batch=8),
        make("moe-route", model=args.adapter),
        make("moe-expert", model=args.adapter),
        make("ann-query", index=args.index, k=args.k),
    ]
    sink = make("appsink", sync=False)
    pipeline = Gst.Pipeline.new("embedded-query")
    for element in stages + [sink]:
        pipeline.add(element)
    for a, b in zip(stages, stages[1:] + [sink]):
        if not a.link(b):
            sys.exit(f"cannot link {a.get_name()} to {b.get_name()}")
    if pipeline.set_state(Gst.State.PLAYING) == Gst.StateChangeReturn.FAILURE:
        error = first_error(pipeline) or "the pipeline did not start"
        pipeline.set_state(Gst.State.NULL)
        sys.exit(f"error: {error}")

    # The buffer offset is the request id moe-encode gives the query ("0", "1", ...). The bytes
    # go as given (os.fsencode): text that is not UTF-8 is answered with an error document.
    for i, text in enumerate(args.queries):
        buf = Gst.Buffer.new_wrapped(os.fsencode(text))
        buf.offset = i
        src.emit("push-buffer", buf)
    src.emit("end-of-stream")

    answered = 0
    while True:
        sample = sink.emit("pull-sample")
        if sample is None:  # end of stream
            break
        buf = sample.get_buffer()
        ok, info = buf.map(Gst.MapFlags.READ)
        if ok:
            doc = json.loads(bytes(info.data))
            buf.unmap(info)
            answered += 1
            if doc.get("type") == "result":
                print(f"{doc['id']}: {doc.get('query', '')!r}")
                for hit in doc["results"]:
                    print(f"  {hit['rank']}. {hit['score']:.3f}  {hit.get('id') or ''}  {hit['caption']}  {hit['uri']}")
            else:
                error = doc["error"]
                print(f"{doc['id']}: error in {error['stage']}: {error['reason']} [{error.get('code', '?')}]")
    error = first_error(pipeline)
    pipeline.set_state(Gst.State.NULL)
    if error:
        sys.exit(f"error: {error}")
    if answered != len(args.queries):
        sys.exit(f"error: {len(args.queries)} queries, {answered} answers")


if __name__ == "__main__":
    main()
