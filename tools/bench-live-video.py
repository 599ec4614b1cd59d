#!/usr/bin/python3
"""Live video into moe-encode: frames made, frames into moe-encode (the rest the leaky queue
dropped), frames encoded, dropped late (QoS) or skipped (interval), and how far each output batch
lags behind its first frame's capture, early and late in the run (a backlog shows as a growing lag).
The sink syncs to the clock and sends QoS events, as video sinks do (fakesink does neither by default).
Usage: tools/bench-live-video.py SECONDS CAPS [MOE-ENCODE PROPERTIES...], with the plugin on
GST_PLUGIN_PATH_1_0 (docs/benchmarks.md, "Live video into moe-encode")."""
import statistics
import sys
import time

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402

Gst.init(None)
seconds, caps, props = float(sys.argv[1]), sys.argv[2], " ".join(sys.argv[3:])
pipeline = Gst.parse_launch(
    f"videotestsrc is-live=true pattern=ball ! {caps} ! queue name=q leaky=downstream max-size-buffers=2 "
    f"! moe-encode name=enc {props} ! fakesink name=sink sync=true qos=true")  # as video sinks
counts = {"made": 0, "in": 0}
lags = []  # (seconds since start, lag in ms)


def counter(key):
    def probe(pad, info):
        counts[key] += 1
        return Gst.PadProbeReturn.OK
    return probe


def on_output(pad, info):
    now = pipeline.get_clock().get_time() - pipeline.get_base_time()
    lags.append((now / 1e9, (now - info.get_buffer().pts) / 1e6))
    return Gst.PadProbeReturn.OK


pipeline.get_by_name("q").get_static_pad("sink").add_probe(Gst.PadProbeType.BUFFER, counter("made"))
pipeline.get_by_name("enc").get_static_pad("sink").add_probe(Gst.PadProbeType.BUFFER, counter("in"))
pipeline.get_by_name("enc").get_static_pad("src").add_probe(Gst.PadProbeType.BUFFER, on_output)
pipeline.set_state(Gst.State.PLAYING)
time.sleep(seconds)
stats = pipeline.get_by_name("enc").get_property("stats")
pipeline.set_state(Gst.State.NULL)


def lag(lo, hi):
    window = [ms for t, ms in lags if lo <= t < hi]
    return "median %.0f ms, max %.0f ms" % (statistics.median(window), max(window)) if window else "no output"


print(f"{caps} {props}: {seconds:.0f} s")
print(f"  frames made {counts['made']}, into moe-encode {counts['in']} "
      f"(queue dropped {counts['made'] - counts['in']}), encoded {stats.get_uint64('requests')[1]}, "
      f"late (QoS) {stats.get_uint64('frames-late')[1]}, skipped (interval) {stats.get_uint64('frames-skipped')[1]}, "
      f"batches {stats.get_uint64('batches')[1]}, encode {stats.get_double('encode-ms')[1]:.0f} ms")
print(f"  lag of output behind capture: first 5 s {lag(0, 5)}; last 5 s {lag(seconds - 5, seconds)}")
