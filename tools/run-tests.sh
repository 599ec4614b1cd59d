#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs packages (idempotent), builds twice —
# with CUDA enabled (when the toolkit is present) and with CUDA disabled — runs every test in
# both builds, then the demo in its quick mode; then the fuzz targets (built by clang: the
# committed corpus replayed, each target fuzzed briefly) and the whole suite once more under
# AddressSanitizer + UndefinedBehaviorSanitizer (docs/security.md). Prints one summary line
# "tests: N passed, N failed, N skipped" at the end (a fuzz target counts once for its replay and
# once for its fuzzing run). MOE_FUZZ_RUNS (default 10000) is each target's number of fuzzing
# executions (a fixed count with a fixed seed: the same inputs in every run, about 20 s each);
# MOE_SKIP_SANITIZERS=1 leaves out the fuzz and sanitizer builds.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

tools/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# prometheus and promtool for the metrics tests, unpacked from Debian's package, not installed
# (installing it starts a system service); without them those tests skip, saying so.
if prom_bin=$(tools/unpack-prometheus.sh); then export PATH="$prom_bin:$PATH"; fi

jobs=${MOE_BUILD_JOBS:-2}
# Where ccache is installed (meson then uses it), objects compiled in another clone of the tree
# are reused: paths are taken relative to the clone, and the debug builds' working folder is not
# part of the key.
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=true
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

if [ "${MOE_SKIP_SANITIZERS:-0}" != 1 ]; then
  # libFuzzer targets (tests/fuzz), built by clang in their own folder: every committed corpus
  # input replayed (a meson test per target), then each target fuzzed for a short time. Any
  # finding fails the run; tools/run-fuzz.sh prints how to reproduce it.
  section_start=$SECONDS
  fuzz_dir="$root/build-test-fuzz"
  echo "=== fuzz targets: build and replay the corpus ($fuzz_dir)"
  if ! tools/run-fuzz.sh --build "$fuzz_dir" --jobs "$jobs" --replay; then status=1; fi
  junits+=("$fuzz_dir/meson-logs/testlog.junit.xml")
  echo "=== fuzz targets: ${MOE_FUZZ_RUNS:-10000} executions each"
  if ! tools/run-fuzz.sh --build "$fuzz_dir" --no-build --jobs "$jobs" --runs "${MOE_FUZZ_RUNS:-10000}" \
      --junit "$fuzz_dir/fuzz-smoke.junit.xml"; then
    status=1
  fi
  junits+=("$fuzz_dir/fuzz-smoke.junit.xml")
  echo "run-tests: fuzzing took $((SECONDS - section_start)) s"

  # The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (gcc, CPU only). Every
  # report fails its test: UBSan halts, ASan exits non-zero, LeakSanitizer reports leaks at exit
  # (leaks inside third-party libraries are suppressed: tests/sanitizers/lsan.supp). Programs the
  # tests start that are not built with ASan (python3 with PyGObject, gst-plugin-scanner) load
  # the instrumented plugin, so ASan's runtime is preloaded into them: the test wrapper sets
  # LD_PRELOAD, which they inherit.
  section_start=$SECONDS
  asan_dir="$root/build-test-asan"
  # -O0 (buildtype debug): the sanitizers' reports are exact, and gcc compiles the instrumented
  # tests in a tenth of the -O2 time (the whole build: about 4 CPU-minutes instead of 20; the
  # tests run about as long, OpenBLAS doing the heavy arithmetic either way).
  asan_opts=(-Dcuda=disabled -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug)
  echo "=== build 'asan' (${asan_opts[*]}) in $asan_dir"
  if [ -f "$asan_dir/build.ninja" ]; then
    meson configure "$asan_dir" "${asan_opts[@]}" >/dev/null
  else
    meson setup "$asan_dir" "${asan_opts[@]}"
  fi
  meson compile -C "$asan_dir" -j "$jobs"
  echo "=== tests 'asan'"
  libasan=$(c++ -print-file-name=libasan.so)
  libstdcxx=$(c++ -print-file-name=libstdc++.so)
  # include_if_exists: a program named P also reads tests/sanitizers/P.asan.options (%b), which
  # turns leak checking off in the programs that are not ours.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=0:include_if_exists=$root/tests/sanitizers/%b.asan.options}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0}
  if ! meson test -C "$asan_dir" --print-errorlogs --num-processes "$jobs" --timeout-multiplier 3 \
      --wrapper "env LD_PRELOAD=$libasan:$libstdcxx"; then
    status=1
  fi
  junits+=("$asan_dir/meson-logs/testlog-env.junit.xml")  # named after the wrapper
  unset ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS
  echo "run-tests: the sanitizer build and tests took $((SECONDS - section_start)) s"
fi

# Count individual GoogleTest cases (and fuzz targets) across the builds from their JUnit logs.
python3 - "${junits[@]}" <<'PY'
import os, sys, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in sys.argv[1:]:
    if not os.path.exists(path):  # its build failed, which already failed the run
        print(f"run-tests: no test log {path}")
        failed += 1
        continue
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
