#!/usr/bin/env bash
# Unpacks Debian's `prometheus` package (prometheus and promtool) into DIR (default
# .cache/prometheus) without installing it, for the metrics tests (tests/test_gst_metrics.cpp):
# installing the package would enable and start a system Prometheus on 0.0.0.0:9090 wherever
# systemd runs. Prints the folder holding the two programs (add it to PATH). Idempotent; both
# programs need only libc. Exit 1 (the tests then skip, saying why) when the package cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.cache/prometheus}
if [ ! -x "$dir/usr/bin/prometheus" ] || [ ! -x "$dir/usr/bin/promtool" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); then
    echo "unpack-prometheus: apt-get download prometheus failed (no package lists? run apt-get update)" >&2
    exit 1
  fi
  mkdir -p "$dir"
  dpkg-deb -x "$tmp"/prometheus_*.deb "$dir"
fi
echo "$(cd "$dir/usr/bin" && pwd)"
