#!/bin/sh
# The RDMA suite, run where an RDMA device exists: inside the Soft-RoCE VM
# (tests/rdma/check.sh boots it with this directory as /payload) or directly on
# a host with a device.  cwd: the directory holding sx-rdma-test.
#
#   run.sh one        in-process selftest, a serve/read pair of processes, the
#                     kill/restart test, the end-to-end test with redis-server
#                     and sx-agent (one host)
#   run.sh two-peer   the target of the two-host test (second VM)
#   run.sh two-main   the reader of the two-host test
#   run.sh perf       sx-rdma-test bench vs ib_read_bw at 64 KiB and 1 MiB
#
# Exit status: 0 when every test passed.
set -u
mode=${1:-one}
dev=${RXE_DEV:-$(ibv_devices 2>/dev/null | awk 'NR > 2 && NF { print $1; exit }')}
tmp=${TMPDIR:-/tmp}/sx-rdma.$$
mkdir -p "$tmp"
fail=0

step() { printf '== %s\n' "$*"; }

case $mode in
one)
  step "in-process: target and reader transports over $dev loopback"
  ./sx-rdma-test selftest || fail=1
  step "two processes: serve + read"
  ./sx-rdma-test serve --desc "$tmp/pair.desc" --stop "$tmp/pair.stop" &
  spid=$!
  ./sx-rdma-test read --desc "$tmp/pair.desc" --stop "$tmp/pair.stop" --wait 30 || fail=1
  wait "$spid" || fail=1
  step "target killed during a batch, restarted, re-opened"
  ./sx-rdma-test killtest --dir "$tmp" || fail=1
  step "end to end: redis-server, sx-agent pools, readers and sxctl over RDMA"
  if command -v redis-server >/dev/null 2>&1; then
    ./test_rdma_e2e || fail=1
  else
    echo "FAIL  test_rdma_e2e: redis-server is not installed here"
    fail=1
  fi
  ;;
two-peer)
  step "target for the two-host test on $dev ($(hostname 2>/dev/null))"
  mkdir -p run
  exec ./sx-rdma-test serve --desc run/two.desc --stop run/two.stop --regions 6
  ;;
two-main)
  step "reader of the two-host test on $dev"
  mkdir -p run
  ./sx-rdma-test read --desc run/two.desc --stop run/two.stop --wait 90 --expect-reissue || fail=1
  ;;
perf)
  # Same device, same VM run, alternating so that drift hits both alike.
  secs=${SX_PERF_SECONDS:-5}
  ip=${RXE_IP:-127.0.0.1}
  for size in 65536 1048576; do
    step "ib_read_bw -d $dev -F -s $size -D $secs"
    ib_read_bw -d "$dev" -F -s "$size" -D "$secs" >"$tmp/srv.log" 2>&1 &
    spid=$!
    sleep 1
    ib_read_bw -d "$dev" -F -s "$size" -D "$secs" "$ip" >"$tmp/cli.log" 2>&1 || fail=1
    wait "$spid" || fail=1
    base=$(awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }' "$tmp/cli.log")
    grep -A1 '#bytes' "$tmp/cli.log" || cat "$tmp/cli.log" "$tmp/srv.log"
    step "sx-rdma-test bench --size $size"
    rm -f "$tmp/perf.desc" "$tmp/perf.stop"
    ./sx-rdma-test serve --desc "$tmp/perf.desc" --stop "$tmp/perf.stop" --regions 4 \
      --layers 1 --blocks $((64 * 1048576 / size)) --block-bytes "$size" &
    spid=$!
    out=$(./sx-rdma-test bench --desc "$tmp/perf.desc" --stop "$tmp/perf.stop" --size "$size" \
      --seconds "$secs" ${SX_PERF_ARGS:-}) || fail=1
    wait "$spid"
    echo "$out"
    ours=$(echo "$out" | sed -n 's/.*, \([0-9.]*\) MiB\/s.*/\1/p')
    awk -v s="$size" -v a="$ours" -v b="$base" 'BEGIN {
      if (b > 0 && a > 0) printf "RATIO size=%d segxfer=%.1f MiB/s ib_read_bw=%.1f MiB/s ratio=%.2f\n", s, a, b, a / b;
      else print "RATIO size=" s ": missing numbers" }'
  done
  ;;
*)
  echo "usage: run.sh one|two-peer|two-main|perf" >&2
  exit 2
  ;;
esac
rm -rf "$tmp"
[ $fail -eq 0 ] && step "RDMA suite ($mode): all passed" || step "RDMA suite ($mode): FAILED"
exit $fail
