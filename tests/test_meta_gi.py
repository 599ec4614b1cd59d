"""GstMoeResultMeta from Python, through GObject-Introspection (GstMoe-1.0), as an application
reads it: result and error documents go through a moe-caption pipeline into an appsink, and every
member of the meta on the text buffers that come out is checked against the documents.

Run by meson (tests/meson.build) with GI_TYPELIB_PATH and LD_LIBRARY_PATH on the build's
gst-plugins folder and the plugin on GST_PLUGIN_PATH_1_0. Exit status 0: every check passed.
"""
import json
import math
import os
import sys
import tempfile

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
gi.require_version("GstMoe", "1.0")
from gi.repository import Gst, GstApp, GstMoe  # noqa: E402  (after require_version)

MS = 1_000_000

RESULT = {
    "schema": 1, "type": "result", "id": "frame-3", "modality": "image", "query": None, "uri": None, "k": 2,
    "results": [
        {"rank": 1, "item": 4, "id": "SKU-4", "uri": None, "caption": "red mug", "score": 0.831237, "fields": {}},
        {"rank": 2, "item": 7, "id": "SKU-7", "uri": "file:///c/7.png", "caption": None, "score": 0.5, "fields": {}},
    ],
    "experts": [{"expert": 3, "weight": 0.61}, {"expert": 1, "weight": 0.39}],
    "pts_ns": 100 * MS, "stream_time_ns": 100 * MS,
}
ERROR = {
    "schema": 1, "type": "error", "id": "frame-4", "modality": "image", "query": None, "uri": None,
    "error": {"stage": "moe-encode", "code": "image_undecodable", "reason": "frame 4 unreadable"},
    "pts_ns": 133 * MS,
}

failures = []


def check(what, got, want):
    ok = math.isclose(got, want) if isinstance(want, float) else got == want
    print(("ok   " if ok else "FAIL ") + f"{what}: {got!r}" + ("" if ok else f" (want {want!r})"))
    if not ok:
        failures.append(what)


def captions(docs):
    """The (text, buffer) pairs moe-caption makes from `docs`, one document per buffer."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, doc in enumerate(docs):
            paths.append(os.path.join(tmp, f"doc{i}.json"))
            with open(paths[-1], "w", encoding="utf-8") as f:
                json.dump(doc, f)
        # multifilesrc: one file per buffer, no PTS of its own, so pts_ns times the captions.
        pipeline = Gst.parse_launch(
            f"multifilesrc location={tmp}/doc%d.json stop-index={len(docs) - 1} caps=application/json "
            "! moe-caption ! appsink name=out sync=false")
        sink = pipeline.get_by_name("out")
        pipeline.set_state(Gst.State.PLAYING)
        out = []
        while True:
            sample = sink.try_pull_sample(30 * Gst.SECOND)
            if sample is None:
                break
            buf = sample.get_buffer()
            ok, info = buf.map(Gst.MapFlags.READ)
            out.append((bytes(info.data).decode("utf-8") if ok else None, buf))
            buf.unmap(info)
        check("pipeline reached EOS", sink.is_eos(), True)
        pipeline.set_state(Gst.State.NULL)
        return out


def main():
    Gst.init(None)
    out = captions([RESULT, ERROR])
    check("captions", len(out), 2)
    if len(out) != 2:
        return 1
    (text, buf), (_, err_buf) = out
    check("caption text", text, "red mug (0.83)")
    check("caption pts", buf.pts, 100 * MS)
    check("caption duration (until the next document)", buf.duration, 33 * MS)

    meta = GstMoe.buffer_get_moe_result_meta(buf)
    check("meta present", meta is not None, True)
    check("request id", meta.get_request_id(), "frame-3")
    check("pts", meta.get_pts(), 100 * MS)
    check("stream time", meta.get_stream_time(), 100 * MS)
    check("no error", meta.get_error_code(), None)
    check("hits", meta.get_n_hits(), 2)
    for i, hit in enumerate(RESULT["results"]):
        check(f"hit {i} item", meta.get_hit_item(i), hit["item"])
        check(f"hit {i} id", meta.get_hit_id(i), hit["id"])
        check(f"hit {i} caption", meta.get_hit_caption(i), hit["caption"])
        check(f"hit {i} uri", meta.get_hit_uri(i), hit["uri"])
        check(f"hit {i} score", meta.get_hit_score(i), hit["score"])
    check("hit out of range", meta.get_hit_id(2), None)
    check("experts", meta.get_n_experts(), 2)
    for i, e in enumerate(RESULT["experts"]):
        check(f"expert {i}", meta.get_expert(i), e["expert"])
        check(f"expert {i} weight", meta.get_expert_weight(i), e["weight"])

    err = GstMoe.buffer_get_moe_result_meta(err_buf)
    check("error meta present", err is not None, True)
    check("error request id", err.get_request_id(), "frame-4")
    check("error pts", err.get_pts(), 133 * MS)
    check("error code", err.get_error_code(), "image_undecodable")
    check("error reason", err.get_error_reason(), "frame 4 unreadable")
    check("error hits", err.get_n_hits(), 0)

    check("plain buffer has no meta", GstMoe.buffer_get_moe_result_meta(Gst.Buffer.new()), None)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
