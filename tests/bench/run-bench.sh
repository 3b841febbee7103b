#!/bin/sh
# `make bench`: the representative benchmark set, about 5 minutes on a
# 2-core machine.  Every figure comes with a baseline measured in the same
# run, and the issue's targets are judged on their ratios.  Writes into
# BUILD/bench/: one table (.txt), CSV and, where the mode draws one, a PNG
# per part, and summary.txt with the machine and every target's verdict.
# Usage: tests/bench/run-bench.sh BUILD_DIR [SECONDS_PER_CASE]
set -u
build=$1
d=${2:-1}
bin=$(cd "$build/bin" && pwd)/sx-bench
out=$build/bench
# A fresh directory: nothing of an earlier run is mistaken for this one's.
rm -rf "$out"
mkdir -p "$out"
fail=0
start=$(date +%s)

step() { printf '\n== %s\n' "$*"; }

# One part: its table on the terminal and in NAME.txt, CSV (and plot).
part() {
  name=$1
  shift
  step "sx-bench $* ($name)"
  if "$bin" "$@" --csv "$out/$name.csv" >"$out/$name.txt"; then
    cat "$out/$name.txt"
  else
    cat "$out/$name.txt"
    echo "make bench: sx-bench $1 failed"
    fail=1
  fi
}

{
  echo "machine: $(nproc) CPUs, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1), $(uname -sr)"
  echo "memory:  $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
  echo "load:    $(cut -d' ' -f1-3 /proc/loadavg) at start (other work shares this machine)"
  echo "date:    $(date -u '+%Y-%m-%d %H:%M UTC')"
} >"$out/machine.txt"
cat "$out/machine.txt"

part codec codec --duration "$d"
# The fleet: up to 100,000 simulated agents renewing leases while 64 readers
# resolve (the cache forced to miss), 100 resolves/s each.
part meta meta --duration "$d" --conc 1,4,16,64 --ls 1000,10000,100000 \
  --fleet 1000,10000,100000 --readers 64 --plot "$out/meta.png"
# The whole matrix once (the table and the plot), then the targets' cases
# (64K and 1M blocks, batches of 64 scattered ids) in alternating rounds
# against the stream, which keeps their ratios steady on a busy machine.
part read-tcp read --duration "$d" --sizes 4K,16K,64K,256K,1M,4M --batches 1,16,64,256,1024 \
  --ids both --conns 4 --plot "$out/read-tcp.png"
td=$(awk -v d="$d" 'BEGIN { print 3 * d }')
part read-targets read --duration "$td" --rounds 3 --sizes 64K,1M --batches 64 --ids scattered \
  --conns 1,2,4,8 --plot "$out/read-targets.png"
# Read plans (issue 23): a TP=2 prefill into one reader, against equal
# layouts on the same bytes; HND (head slices, the target) and NHD (a piece
# per token and rank).
part plan plan --duration "$d" --rounds 3 --order HND
part plan-nhd plan --duration "$d" --rounds 3 --order NHD
# Push mode: write batches against the raw stream the other way round.
part write-targets read --op write --duration "$td" --rounds 3 --sizes 64K,1M --batches 64 \
  --ids scattered --conns 1,4 --plot "$out/write-targets.png"

# RDMA: on a device when there is one, else inside the Soft-RoCE VM.
if [ -x tests/rdma/run-in-rxe-vm.sh ]; then
  step "RDMA: sx-bench read --transport rdma against ib_read_bw on the same device"
  if tests/bench/rdma-bench.sh "$build" "$d" "$out"; then
    cat "$out/read-rdma.txt" "$out/read-rdma-write.txt"
  else
    echo "make bench: the RDMA part failed (log: $out/read-rdma.log)"
    fail=1
  fi
else
  echo "RDMA part: not run (this tree has no RDMA transport and Soft-RoCE harness yet)" |
    tee "$out/read-rdma.txt"
fi

{
  cat "$out/machine.txt"
  echo "load:    $(cut -d' ' -f1-3 /proc/loadavg) at the end"
  echo "took:    $(($(date +%s) - start)) s"
  echo
  echo "Targets (issues 6 and 16), judged on ratios from this run (read: the alternating rounds"
  echo "of read-targets and read-rdma; read-tcp's own lines are single windows):"
  for f in codec meta read-targets read-rdma write-targets read-rdma-write plan plan-nhd; do
    [ -f "$out/$f.txt" ] && sed -n '/^Targets/,$p' "$out/$f.txt" | grep -v '^Targets' |
      sed "s/^/[$f] /"
  done
} >"$out/summary.txt"
step "summary ($out/summary.txt)"
cat "$out/summary.txt"
echo
echo "files: $(cd "$out" && ls | tr '\n' ' ')"
exit $fail
