#!/bin/sh
# Host TCP at 1 MiB blocks with and without the data-mover threads
# (issue 21 item 6; docs/data-plane.md#tcp): the same sx-bench read, with
# SX_TCP_THREADS=0 (everything on each agent's loop thread) and with
# SX_TCP_THREADS=N, alternating, RUNS times each.  The environment reaches
# both processes (the reader and the `sx-bench target` it spawns).  Each
# sx-bench run measures its own raw-stream baseline (a thread per
# connection on each side), so every VS BASELINE figure is against the
# same run.  Meant for a quiet many-core host (on 2 cores the threads have
# no spare core to run on: the agents' default there is none).
#
# With threads on, they engage only while two connections or more of a
# side are busy (SX_TCP_THREAD_CONNS, default 2; docs/data-plane.md): the
# setting "all" sets it to 1, so that every large payload goes to them
# (as main did before 27 Nov), for an A/B in one build.
#
# Usage: tests/bench/tcp_threads.sh BUILD_DIR
#   THREADS=N  threads when on (default 4: the default on >= 16 CPUs)
#   RUNS=N     runs of each setting (default 2)
#   SETS=".."  the settings, in order (default "off on"; also "all")
# Output: BUILD_DIR/bench/tcp-threads/SET-K.{txt,csv}, and a summary
# on stdout: one line per run and case (GB/s, VS BASELINE, p99/p50), then
# the medians per setting and case.  About 40 s per run.
set -u
build=${1:?usage: tests/bench/tcp_threads.sh BUILD_DIR}
bin=$build/bin/sx-bench
threads=${THREADS:-4}
runs=${RUNS:-2}
sets=${SETS:-off on}
out=$build/bench/tcp-threads
[ -x "$bin" ] || { echo "tcp_threads.sh: $bin not built (make)" >&2; exit 2; }
mkdir -p "$out"
rm -f "$out"/*.txt "$out"/*.csv

echo "host TCP, 1 MiB blocks, settings: $sets (off: SX_TCP_THREADS=0; on: SX_TCP_THREADS=$threads;"
echo "all: SX_TCP_THREADS=$threads SX_TCP_THREAD_CONNS=1)"
echo "machine: $(nproc) CPUs, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
if git -C "$(dirname "$0")" rev-parse --short HEAD >/dev/null 2>&1; then
  echo "commit: $(git -C "$(dirname "$0")" rev-parse --short HEAD)"
fi
fail=0
k=1
while [ "$k" -le "$runs" ]; do
  for mode in $sets; do
    n=0 engage=2
    [ "$mode" = off ] || n=$threads
    [ "$mode" = all ] && engage=1
    if ! SX_TCP_THREADS=$n SX_TCP_THREAD_CONNS=$engage "$bin" read --duration 1 --rounds 3 --sizes 1M --batches 64,128 \
        --ids scattered --conns 1,4 --max-batch-bytes 128M --target-batch 128 \
        --csv "$out/$mode-$k.csv" >"$out/$mode-$k.txt" 2>&1; then
      echo "tcp_threads.sh: sx-bench read failed ($mode, run $k); see $out/$mode-$k.txt" >&2
      tail -n 20 "$out/$mode-$k.txt" >&2
      fail=1
    elif ! grep -q "TCP data-mover threads per agent: $n " "$out/$mode-$k.txt"; then
      echo "tcp_threads.sh: run $k ($mode) did not run with $n threads per agent:" >&2
      grep "data-mover" "$out/$mode-$k.txt" >&2
      fail=1
    fi
  done
  k=$((k + 1))
done
[ "$fail" = 0 ] || exit 1

# One line per run and case, then the medians per setting and case.
for f in "$out"/*-*.csv; do
  name=$(basename "$f" .csv)
  awk -F, -v run="$name" 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["table"] == "read" && $col["transport"] == "tcp" {
      p = $col["p50_ms"] > 0 ? $col["p99_ms"] / $col["p50_ms"] : 0
      printf "%-6s %-5s batch %-4s conns %-2s %7.3f GB/s  raw %7.3f GB/s  %5.2fx  p99/p50 %4.2f\n",
        run, substr(run, 1, index(run, "-") - 1), $col["batch"], $col["conns"], $col["gb_s"],
        $col["baseline_gb_s"], $col["ratio"], p }' "$f"
done | LC_ALL=C sort -k4,4n -k6,6n -k2,2 -k1,1 >"$out/summary.txt"
echo
echo "RUN    SET   CASE                   SEGXFER          RAW STREAM        VS RAW  TAIL"
cat "$out/summary.txt"
echo
echo "Medians of VS RAW per case and setting:"
awk -v sets="$sets" '{ key = "batch " $4 ", conns " $6; v[key, $2, ++n[key, $2]] = $(NF - 2) + 0; keys[key] = 1 }
  function med(key, set,   m, i, j, t, a) {
    m = n[key, set]
    for (i = 1; i <= m; i++) a[i] = v[key, set, i]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return m == 0 ? 0 : (m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2)
  }
  END { ns = split(sets, set, " ")
    for (k in keys) {
      printf "  %-20s", k
      for (i = 1; i <= ns; i++) printf "  %s %5.2fx", set[i], med(k, set[i])
      printf "   (target >= 0.9x)\n"
    } }' \
  "$out/summary.txt" | sort
echo
echo "Full tables: $out/SET-K.txt"
