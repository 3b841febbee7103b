#!/bin/sh
# The RDMA suite, run where an RDMA device exists: inside the Soft-RoCE VM
# (tests/rdma/check.sh boots it with this directory as /payload) or directly on
# a host with a device.  cwd: the directory holding sx-rdma-test.
#
#   run.sh one        in-process selftest, a serve/read pair of processes, the
#                     kill/restart test, the end-to-end test with redis-server
#                     and sx-agent, the push-mode (RDMA WRITE) test (one host)
#   run.sh two-peer   the target of the two-host test (second VM), and a
#                     writable sx-agent with its redis-server for the push test
#   run.sh two-main   the reader of the two-host test, then a producer
#                     (sxctl write) into the peer's sx-agent
#   run.sh perf       sx-rdma-test bench vs ib_read_bw at 64 KiB and 1 MiB
#   run.sh nics       only the two-NIC test (part of one): rxe1 on a veth pair
#
# Exit status: 0 when every test passed.
set -u
mode=${1:-one}
dev=${RXE_DEV:-$(ibv_devices 2>/dev/null | awk 'NR > 2 && NF { print $1; exit }')}
tmp=${TMPDIR:-/tmp}/sx-rdma.$$
mkdir -p "$tmp"
fail=0

# Each step says when it began (seconds into the run): what each one costs.
t0=$(date +%s)
step() { printf '== %s  [%ss]\n' "$*" $(($(date +%s) - t0)); }

# A second Soft-RoCE device for the two-NIC test: rxe1 on one end of a veth
# pair, in a subnet of its own (so that each NIC reaches the other side's
# same NIC), MTU as the first device's netdev.  Taken away again after the
# test, so the other tests see one device.  Needs root and rdma_rxe.
NIC2_NETDEV=sxnic0 NIC2_DEV=rxe1
nic2_up() {
  mtu=$(cat "/sys/class/net/${RXE_NETDEV:-eth0}/mtu" 2>/dev/null || echo 1500)
  ip link add "$NIC2_NETDEV" type veth peer name sxnic1 &&
    ip link set "$NIC2_NETDEV" mtu "$mtu" && ip link set sxnic1 mtu "$mtu" &&
    ip addr add 192.168.78.1/24 dev "$NIC2_NETDEV" &&
    ip link set sxnic1 up && ip link set "$NIC2_NETDEV" up &&
    rdma link add "$NIC2_DEV" type rxe netdev "$NIC2_NETDEV" || return 1
  n=0
  until grep -q ACTIVE "/sys/class/infiniband/$NIC2_DEV/ports/1/state" 2>/dev/null &&
    ! grep -q '^0000:0000:0000:0000:0000:0000:0000:0000$' \
      "/sys/class/infiniband/$NIC2_DEV/ports/1/gids/1" 2>/dev/null; do
    n=$((n + 1)); [ $n -gt 100 ] && return 1; sleep 0.1
  done
}
nic2_down() {
  rdma link delete "$NIC2_DEV" 2>/dev/null
  ip link del "$NIC2_NETDEV" 2>/dev/null
  return 0
}
nics() {
  step "two NICs: one segment's regions on $dev and $NIC2_DEV (veth), reads and writes through both, $NIC2_DEV taken down"
  if nic2_up; then
    SX_NICTEST_NETDEV=$NIC2_NETDEV SX_NICTEST_DEV=$NIC2_DEV ./sx-rdma-test nictest || fail=1
    step "two NICs, staged: the target's regions in GPU memory (host-memory stand-in for the CUDA driver)"
    SX_NICTEST_NETDEV=$NIC2_NETDEV SX_NICTEST_DEV=$NIC2_DEV SX_CUDA_LIBRARY=$PWD/libfakecuda.so \
      ./sx-rdma-test nictest-gpu || fail=1
  elif [ -z "${RXE_ROLE:-}" ]; then
    # A host with its own device (check.sh runs the suite there directly):
    # the guest's setup may not be possible, and that is not a failure.
    echo "SKIP  nictest: could not make $NIC2_DEV on a veth pair here (root, rdma_rxe, veth needed)"
  else
    echo "FAIL  nictest: could not make $NIC2_DEV on a veth pair (root, rdma_rxe, veth needed)"
    fail=1
  fi
  nic2_down
}

case $mode in
one)
  step "in-process: target and reader transports over $dev loopback"
  ./sx-rdma-test selftest || fail=1
  step "in-process push mode: consumer and producer transports, each on a loop of its own"
  ./sx-rdma-test wselftest || fail=1
  nics
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
  step "push mode: RDMA WRITE batches and notices, refusals, many producers, a killed producer"
  if command -v redis-server >/dev/null 2>&1; then
    ./test_rdma_push || fail=1
    SX_CUDA_LIBRARY=$PWD/libfakecuda.so ./test_rdma_push gpu || fail=1
    step "GPU memory over staged RDMA (host-memory stand-in for the CUDA driver)"
    SX_CUDA_LIBRARY=$PWD/libfakecuda.so ./test_rdma_gpu || fail=1
    step "staged RDMA writes (push mode) of GPU memory (host-memory stand-in for the CUDA driver)"
    SX_CUDA_LIBRARY=$PWD/libfakecuda.so ./test_rdma_gpu_push || fail=1
    step "GPUDirect tiers (dma-buf, peermem, fallbacks) through a provider shim over the stand-in"
    # The sanitizer build's runtime must not insist on loading first.
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0" \
      LD_PRELOAD=$PWD/libsxibvshim.so SX_CUDA_LIBRARY=$PWD/libfakecuda.so \
      ./test_rdma_gpu gpudirect || fail=1
  else
    echo "FAIL  test_rdma_push: redis-server is not installed here"
    fail=1
  fi
  step "read notices of batches read over RDMA, a reader killed mid-stream"
  ./test_rdma_notice || fail=1
  ;;
two-peer)
  step "target for the two-host test on $dev ($(hostname 2>/dev/null))"
  mkdir -p run
  # Push: a writable pool in a store of its own on this host, for the
  # other host's producer (both end with this VM).
  if command -v redis-server >/dev/null 2>&1; then
    redis-server --port 6390 --bind 0.0.0.0 --protected-mode no --save '' --daemonize yes \
      --logfile "$tmp/redis.log"
    ./sx-agent --metadata "redis://127.0.0.1:6390?namespace=two" --name two-decode \
      --listen "$RXE_IP:7400" --rdma-devices "$dev" --writable --grant '*' --layers 2 \
      --num-blocks 64 --block-bytes 64K --fill 3 >run/push-peer.log 2>&1 &
    # The same in (stand-in) GPU memory: writes into it are staged RDMA.
    SX_CUDA_LIBRARY=$PWD/libfakecuda.so ./sx-agent \
      --metadata "redis://127.0.0.1:6390?namespace=two" --name two-gdecode \
      --listen "$RXE_IP:7401" --rdma-devices "$dev" --writable --grant '*' --layers 2 \
      --num-blocks 32 --block-bytes 256K --location cuda:0 >run/gpush-peer.log 2>&1 &
  fi
  exec ./sx-rdma-test serve --desc run/two.desc --stop run/two.stop --regions 6
  ;;
two-main)
  mkdir -p run
  # Push first: the peer's pool lives as long as its serve process, which
  # the read test below stops.
  step "push across two hosts: sxctl write into the peer's sx-agent over RDMA, read back"
  url="redis://$RXE_PEER_IP:6390?namespace=two"
  n=0
  until ./sxctl --metadata "$url" show two-decode >/dev/null 2>&1 || [ $n -ge 60 ]; do
    n=$((n + 1)); sleep 1
  done
  out=$(./sxctl --metadata "$url" write two-decode --as two-prefill --listen "$RXE_IP:0" \
    --fill 9 --blocks all --batch 16 --depth 2 --tag 70 --verify 2>&1) || fail=1
  echo "$out"
  if echo "$out" | grep -q 'via rdma' && echo "$out" | grep -q 'read back and verified every byte'; then
    echo "PASS  push across two hosts: 64 blocks written over RDMA and verified"
  else
    echo "FAIL  push across two hosts (see above; the peer's log is run/push-peer.log)"
    cat run/push-peer.log 2>/dev/null | tail -20
    fail=1
  fi
  step "staged push across two hosts: sxctl write into the peer's GPU (stand-in) pool over RDMA"
  n=0
  until ./sxctl --metadata "$url" show two-gdecode >/dev/null 2>&1 || [ $n -ge 60 ]; do
    n=$((n + 1)); sleep 1
  done
  out=$(SX_CUDA_LIBRARY=$PWD/libfakecuda.so ./sxctl --metadata "$url" write two-gdecode \
    --as two-gprefill --listen "$RXE_IP:0" --fill 11 --blocks all --batch 16 --depth 2 \
    --tag 71 --verify 2>&1) || fail=1
  echo "$out"
  # The pool's own word that the producer's stage QPs (not plain WRITEs) came.
  if echo "$out" | grep -q 'via rdma' && echo "$out" | grep -q 'read back and verified every byte' &&
    grep -q "producer 'two-gprefill' opened a stage QP" run/gpush-peer.log; then
    echo "PASS  staged push across two hosts: 32 blocks of 256 KiB into GPU memory over RDMA, verified"
  else
    echo "FAIL  staged push across two hosts (the peer's log is run/gpush-peer.log)"
    cat run/gpush-peer.log 2>/dev/null | tail -20
    fail=1
  fi
  step "reader of the two-host test on $dev"
  ./sx-rdma-test read --desc run/two.desc --stop run/two.stop --wait 90 --expect-reissue || fail=1
  ;;
nics)
  nics
  ;;
perf)
  # Same device, same VM run: ib_read_bw and segxfer alternate, round after
  # round, so that drift on a shared host hits both alike; the median ratio
  # is the figure.  ib_read_bw runs a fixed number of READs (about 4 s here):
  # its duration mode (-D) stalls on rxe at 1 MiB.  segxfer reads batches of
  # 16 MiB, 4 in flight, from a serve process.
  secs=${SX_PERF_SECONDS:-4}
  rounds=${SX_PERF_ROUNDS:-3}
  ip=${RXE_IP:-127.0.0.1}
  for size in 65536 1048576; do
    iters=$((secs * 40 * 1048576 / size))
    rm -f "$tmp/perf.desc" "$tmp/perf.stop" "$tmp/ratios"
    ./sx-rdma-test serve --desc "$tmp/perf.desc" --stop "$tmp/perf.stop" --regions 4 \
      --layers 1 --blocks $((64 * 1048576 / size)) --block-bytes "$size" 2>/dev/null &
    tpid=$!
    r=1
    while [ $r -le "$rounds" ]; do
      step "round $r: ib_read_bw -d $dev -F -s $size -n $iters"
      ib_read_bw -d "$dev" -F -s "$size" -n "$iters" >"$tmp/srv.log" 2>&1 &
      spid=$!
      sleep 1
      ib_read_bw -d "$dev" -F -s "$size" -n "$iters" "$ip" >"$tmp/cli.log" 2>&1 || fail=1
      wait "$spid" || fail=1
      base=$(awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }' "$tmp/cli.log")
      grep -A1 '#bytes' "$tmp/cli.log" || cat "$tmp/cli.log" "$tmp/srv.log"
      step "round $r: sx-rdma-test bench --size $size"
      out=$(./sx-rdma-test bench --desc "$tmp/perf.desc" --size "$size" --wait 30 \
        --batch $((16 * 1048576 / size)) --depth 4 --seconds "$secs" ${SX_PERF_ARGS:-}) || fail=1
      echo "$out"
      ours=$(echo "$out" | sed -n 's/.*, \([0-9.]*\) MiB\/s.*/\1/p')
      awk -v s="$size" -v r="$r" -v a="$ours" -v b="$base" 'BEGIN {
        if (b > 0 && a > 0) printf "round %d size=%d segxfer=%.1f MiB/s ib_read_bw=%.1f MiB/s ratio=%.2f\n", r, s, a, b, a / b;
        else printf "round %d size=%d: missing numbers\n", r, s }' | tee -a "$tmp/ratios"
      r=$((r + 1))
    done
    touch "$tmp/perf.stop"
    wait "$tpid"
    sed -n 's/.*ratio=//p' "$tmp/ratios" | sort -n | awk -v s="$size" -v n="$rounds" '
      { v[NR] = $1 } END { if (NR == 0) { print "RATIO size=" s ": no figures"; exit }
        printf "RATIO size=%d median of %d rounds: %.2f (min %.2f, max %.2f)\n", s, NR,
          v[int((NR + 1) / 2)], v[1], v[NR] }'
  done
  ;;
*)
  echo "usage: run.sh one|two-peer|two-main|perf|nics" >&2
  exit 2
  ;;
esac
rm -rf "$tmp"
[ $fail -eq 0 ] && step "RDMA suite ($mode): all passed" || step "RDMA suite ($mode): FAILED"
exit $fail
