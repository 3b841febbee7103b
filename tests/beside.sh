#!/bin/sh
# The RDMA suite (tests/rdma/check.sh) in the background while another step
# of `make check` runs, then its output: the Soft-RoCE VM keeps both cores
# busy for minutes, and the Python tests beside it mostly wait on the
# processes they start, so running them together saves most of the shorter
# one's time (CI has 2 cores and a time budget).  Both run to the end; the
# exit status is the first failure's.
#   tests/rdma/alongside.sh BUILD_DIR COMMAND [ARGS...]
set -u
build=$1
shift
mkdir -p "$build/test-logs"
out=$build/test-logs/check-rdma.out
"$(dirname "$0")/check.sh" "$build" >"$out" 2>&1 &
rdma=$!
"$@"
rc=$?
wait "$rdma"
rrc=$?
cat "$out"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$rrc"
