#!/bin/sh
# `make check`: run every sx-bench mode briefly, so the benchmarks cannot
# rot.  Correctness only: exit status, --verify of every byte read, the
# CSV/JSON/plot files written.  No timing is judged here.
# Usage: tests/bench/smoke.sh BUILD_DIR
set -u
build=$1
bin=$build/bin/sx-bench
out=$build/test-logs/bench-smoke
mkdir -p "$out"
fail=0

run() {
  name=$1
  shift
  if "$@" >"$out/$name.txt" 2>"$out/$name.err"; then
    printf '  PASS  %-28s\n' "sx-bench $name"
  else
    printf '  FAIL  %-28s (exit %d)\n' "sx-bench $name" $?
    sed 's/^/        | /' "$out/$name.err" | tail -n 30
    fail=1
  fi
}

run codec "$bin" codec --duration 0.05 --regions 1,160 --csv "$out/codec.csv" --quiet
run codec-json "$bin" codec --duration 0.02 --regions 16 --no-strided --json --quiet
run read "$bin" read --sizes 4K,64K --batches 1,8 --conns 1,2 --duration 0.15 --verify \
  --group-bytes 4M --csv "$out/read.csv" --quiet
run write "$bin" read --op write --sizes 4K,64K --batches 1,8 --conns 1,2 --duration 0.15 \
  --group-bytes 4M --csv "$out/write.csv" --quiet
run meta "$bin" meta --duration 0.1 --conc 1,4 --ls 200 --fleet 100 --lease-ms 900 \
  --csv "$out/meta.csv" --quiet
if command -v gnuplot >/dev/null 2>&1; then
  run read-plot "$bin" read --sizes 64K --batches 4 --ids scattered --duration 0.2 --rounds 2 \
    --group-bytes 2M --plot "$out/read.png" --quiet
  [ -s "$out/read.png" ] || { echo "  FAIL  --plot wrote no PNG"; fail=1; }
fi
# The files say what the run measured.
grep -q '^codec,codec,"per-layer 80 layers x K,V",160,decode+validate' "$out/codec.csv" ||
  { echo "  FAIL  codec CSV lacks the 160-region row"; fail=1; }
grep -q '^read,read,tcp,64K,8,scattered,2,' "$out/read.csv" ||
  { echo "  FAIL  read CSV lacks a row"; fail=1; }
grep -q '^read,read,tcp write,64K,8,scattered,2,' "$out/write.csv" ||
  { echo "  FAIL  write CSV lacks a row"; fail=1; }
grep -q '"mode": "codec"' "$out/codec-json.txt" ||
  { echo "  FAIL  codec --json printed no JSON"; fail=1; }
for t in cold ls fleet; do
  grep -q "$t" "$out/meta.txt" || { echo "  FAIL  meta output lacks $t"; fail=1; }
done
[ $fail -eq 0 ] && echo "bench smoke: all passed" || echo "bench smoke: FAILED (logs in $out)"
exit $fail
