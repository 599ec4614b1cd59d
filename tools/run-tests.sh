#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs packages (idempotent), builds twice —
# with CUDA enabled (when the toolkit is present) and with CUDA disabled — runs every test in
# both builds, then the demo in its quick mode. Prints one summary line
# "tests: N passed, N failed, N skipped" at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

tools/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"

jobs=${MOE_BUILD_JOBS:-2}
configs=("cpu:-Dcuda=disabled")
if command -v nvcc >/dev/null 2>&1; then
  configs=("cuda:-Dcuda=enabled" "${configs[@]}")
else
  echo "run-tests: nvcc not found: building and testing the CPU-only configuration"
fi

status=0
junits=()
for cfg in "${configs[@]}"; do
  name=${cfg%%:*}
  opt=${cfg#*:}
  dir="$root/build-test-$name"
  echo "=== build '$name' ($opt) in $dir"
  if [ -f "$dir/build.ninja" ]; then
    meson configure "$dir" "$opt" >/dev/null
  else
    meson setup "$dir" "$opt" --buildtype=release
  fi
  meson compile -C "$dir" -j "$jobs"
  echo "=== tests '$name'"
  if ! meson test -C "$dir" --print-errorlogs --num-processes "$jobs"; then status=1; fi
  junits+=("$dir/meson-logs/testlog.junit.xml")
done

# The README's first command in its quick mode, on the CPU build: the demo must keep working.
echo "=== demo (tools/run-demo.sh --quick)"
if ! MOE_BUILD_DIR="build-test-cpu" tools/run-demo.sh --quick; then
  echo "run-tests: the demo failed"
  status=1
fi

# Count individual GoogleTest cases across both builds from meson's JUnit log.
python3 - "${junits[@]}" <<'PY'
import sys, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in sys.argv[1:]:
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
PY
exit $status
