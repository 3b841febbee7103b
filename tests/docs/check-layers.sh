#!/bin/sh
# make check: layers never call back up (tests/docs/check_layers.py says
# exactly what counts): no transport includes another's header, the
# connection module below them includes none, no folder loop in the
# #include graph, and no object of the core or a transport needs a symbol
# of agent.c.  Usage: tests/docs/check-layers.sh BUILD_DIR
set -u
build=$1
here=$(cd "$(dirname "$0")" && pwd)
log=$build/test-logs/docs-layers.log
mkdir -p "$build/test-logs"
start=$(date +%s)
if python3 "$here/check_layers.py" "$here/../.." "$build" >"$log" 2>&1; then
  printf '  PASS  %-28s %5ss\n' "docs: layers" $(( $(date +%s) - start ))
  sed 's/^/        /' "$log" | tail -n 1
else
  sed 's/^/        | /' "$log"
  printf '  FAIL  %-28s %5ss\n' "docs: layers" $(( $(date +%s) - start ))
  exit 1
fi
