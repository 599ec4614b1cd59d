#!/usr/bin/env bash
# Checks (or with --fix, applies) the tree's C/C++/CUDA formatting: .clang-format, with Debian 12's
# clang-format-14 (another version formats some constructs differently). Exit 1 names the files.
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=clang-format-14
# 77: "skipped" for meson test (tests/meson.build), with the reason.
command -v "$fmt" >/dev/null || { echo "check-format: skipped: $fmt not found (apt-get install clang-format-14)"; exit 77; }
git rev-parse --git-dir >/dev/null 2>&1 || { echo "check-format: skipped: not a git checkout"; exit 77; }
mapfile -t files < <(git ls-files '*.c' '*.cc' '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  "$fmt" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check-format: ${#bad[@]} file(s) differ from .clang-format (tools/check-format.sh --fix rewrites them):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
