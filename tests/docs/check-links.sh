#!/bin/sh
# make check: every relative link and heading anchor in README.md and
# docs/*.md leads somewhere, and every repository path the docs name in
# backticks exists (tests/docs/check_links.py says exactly what counts).
# With "layers": the same report for tests/docs/check_layers.py (no
# transport includes another's header, no folder loop in the #include
# graph, nothing calls up into agent.c); tests/docs/check-layers.sh.
# Usage: tests/docs/check-links.sh BUILD_DIR [links|layers]
set -u
build=$1
here=$(cd "$(dirname "$0")" && pwd)
case ${2:-links} in
layers) label="docs: layers"; log=$build/test-logs/docs-layers.log
        set -- "$here/check_layers.py" "$here/../.." "$build" ;;
*)      label="docs: links and paths"; log=$build/test-logs/docs-links.log
        set -- "$here/check_links.py" "$here/../.." ;;
esac
mkdir -p "$build/test-logs"
start=$(date +%s)
if python3 "$@" >"$log" 2>&1; then
  printf '  PASS  %-28s %5ss\n' "$label" $(( $(date +%s) - start ))
  sed 's/^/        /' "$log" | tail -n 1
else
  sed 's/^/        | /' "$log"
  printf '  FAIL  %-28s %5ss\n' "$label" $(( $(date +%s) - start ))
  exit 1
fi
