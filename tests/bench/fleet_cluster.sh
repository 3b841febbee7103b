#!/bin/sh
# Issue 24's scale-out figure in one command, for a many-core host: how many
# simulated agents a 3-master Redis Cluster holds against one redis-server,
# both private to this run and searched in turn (one fleet size on each,
# then the next), at a 1 s lease and a p99 cold resolve of 5 ms; then the
# ratio, measured and CPU-normalised.  About 150 s.
#
#   tests/bench/fleet_cluster.sh BUILD [OUT_DIR]
#
# BUILD is a build folder (build/bin/sx-bench), or the build/ of a folder
# that tests/gpu/carry.sh made (copy this script beside it: its bin/
# (redis-server, redis-cli) and lib/ are then put on PATH and
# LD_LIBRARY_PATH).  The report, its CSV and a summary go to OUT_DIR
# (default BUILD/bench/fleet-cluster).  The exit status is 0 when the
# bench ran to the end, whether or not the target was met; the summary's
# last lines say which.
#
# Sizes scale with the CPUs: the search starts at 2,500 agents on 16 CPUs
# or more (500 below, where the generator, the readers and the four servers
# share few cores and the figure measures the machine, not the stores) and
# doubles up to 200,000; the simulated agents get half the CPUs as threads
# (at most 16).  FLEET_START, FLEET_CAP, FLEET_THREADS, FLEET_BUDGET_S
# override.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 BUILD [OUT_DIR]" >&2; exit 2; }
build=$1
out=${2:-$build/bench/fleet-cluster}
bin=$build/bin/sx-bench
root=$(cd "$(dirname "$build")" && pwd)
[ -x "$root/bin/redis-server" ] && PATH=$root/bin:$PATH
[ -d "$root/lib" ] && LD_LIBRARY_PATH=$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
[ -x "$bin" ] || { echo "$0: no $bin (build it: make $bin)" >&2; exit 2; }
for p in redis-server redis-cli; do
  command -v $p >/dev/null 2>&1 || { echo "$0: $p is not on PATH" >&2; exit 2; }
done
mkdir -p "$out"
# Every reader and fleet connection is a descriptor, and a cluster triples them.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

ncpu=$(getconf _NPROCESSORS_ONLN)
if [ "$ncpu" -ge 16 ]; then start=2500; else start=500; fi
threads=$((ncpu / 2))
[ "$threads" -gt 16 ] && threads=16
[ "$threads" -lt 2 ] && threads=2
start=${FLEET_START:-$start}
cap=${FLEET_CAP:-200000}
threads=${FLEET_THREADS:-$threads}
budget=${FLEET_BUDGET_S:-115}

{
  echo "# tests/bench/fleet_cluster.sh on $(hostname), $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
  echo "# $ncpu CPUs ($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')), load $(cut -d' ' -f1-3 /proc/loadavg)"
  rev=$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || true)
  [ -n "$rev" ] && echo "# segxfer $rev"
  echo "# sx-bench meta --fleet $start,$cap --fleet-search 3 --fleet-threads $threads --cluster 3 --lease-ms 1000 --held-p99-ms 5 --fleet-budget-s $budget"
} >"$out/summary.txt"

# The bench stops starting sizes after the budget; the timeout is for a
# bench that hangs, not a limit it is meant to reach.  Its progress (stderr)
# shows here and goes to fleet-cluster.err; the report to fleet-cluster.txt.
(
  rc=0
  timeout $((budget + 120)) "$bin" meta --ops renew --conc 1 --ls 0 --lease-ms 1000 \
    --fleet "$start,$cap" --fleet-search 3 --fleet-threads "$threads" --readers 16 \
    --reader-rate 100 --duration 3 --cluster 3 --held-p99-ms 5 --fleet-budget-s "$budget" \
    --csv "$out/fleet-cluster.csv" 2>&1 >"$out/fleet-cluster.txt" || rc=$?
  echo "$rc" >"$out/rc"
) | tee "$out/fleet-cluster.err" >&2
rc=$(cat "$out/rc")

# The summary: the held table and the cluster targets of the report.
{
  sed -n '/^Agents held:/,/^$/p' "$out/fleet-cluster.txt"
  grep -E '(agents held|agents per saturated Redis thread), [0-9]-master' "$out/fleet-cluster.txt" || true
} >>"$out/summary.txt"
cat "$out/summary.txt"
ratio=$(sed -n 's/.*agents held, [0-9]-master cluster vs one Redis, measured on [0-9]* shared CPUs *\([0-9.]*\) x.*/\1/p' \
  "$out/fleet-cluster.txt")
if [ "$rc" -ne 0 ] || [ -z "$ratio" ]; then
  echo "fleet_cluster: the bench failed (exit $rc); see $out/fleet-cluster.err:" >&2
  tail -n 20 "$out/fleet-cluster.err" >&2
  exit 1
fi
echo "RATIO measured $ratio x (target >= 2.5), $ncpu CPUs; report in $out/"
