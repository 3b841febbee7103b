#!/bin/sh
# Run a step of `make check` in the background while another runs, then
# print its output: CI has 2 cores and a time budget, and the steps paired
# this way leave most of them idle (the Python tests and the integration
# tests mostly wait on the processes they start; the RDMA VM and the GPU
# stand-in suite each keep about one core busy).  Both run to the end; the
# exit status is the first failure's (the foreground step's first).
#   tests/beside.sh OUT 'BACKGROUND COMMAND' COMMAND [ARGS...]
# The background command runs under sh -c, its output kept in OUT.
set -u
out=$1 bg=$2
shift 2
mkdir -p "$(dirname "$out")"
sh -c "$bg" >"$out" 2>&1 &
pid=$!
"$@"
rc=$?
wait "$pid"
brc=$?
cat "$out"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$brc"
