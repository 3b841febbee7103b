#!/bin/sh
# make check: every relative link and heading anchor in README.md and
# docs/*.md leads somewhere, and every repository path the docs name in
# backticks exists (tests/docs/check_links.py says exactly what counts).
# Usage: tests/docs/check-links.sh BUILD_DIR
set -u
build=$1
here=$(cd "$(dirname "$0")" && pwd)
log=$build/test-logs/docs-links.log
mkdir -p "$build/test-logs"
start=$(date +%s)
if python3 "$here/check_links.py" "$here/../.." >"$log" 2>&1; then
  printf '  PASS  %-28s %5ss\n' "docs: links and paths" $(( $(date +%s) - start ))
  sed 's/^/        /' "$log" | tail -n 1
else
  sed 's/^/        | /' "$log"
  printf '  FAIL  %-28s %5ss\n' "docs: links and paths" $(( $(date +%s) - start ))
  exit 1
fi
