#!/bin/sh
# The RDMA part of `make bench`: sx-bench read --transport rdma against
# perftest's ib_read_bw on the same device, in the same run.  On a host with
# an RDMA device it runs there; otherwise inside the Soft-RoCE VM
# (tests/rdma/run-in-rxe-vm.sh, rxe0 under QEMU), with redis-server, the
# target and the reader all in the guest.  The guest has no gnuplot: the
# plot script it writes is drawn here.
# Usage: tests/bench/rdma-bench.sh BUILD_DIR SECONDS_PER_CASE OUT_DIR
# Writes OUT_DIR/read-rdma.{txt,csv,png} and read-rdma.log (the VM console);
# then the same for push-mode writes against ib_write_bw: read-rdma-write.*.
set -u
build=$1
d=$2
out=$(cd "$3" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
payload=$(cd "$build/rdma-tests" && pwd) || { echo "rdma-bench: $build/rdma-tests missing"; exit 1; }
vm=$here/tests/rdma/run-in-rxe-vm.sh
# Small pools and batches of at most 16 MiB: the guest has 1 GiB, and rxe
# under emulation moves tens of MB/s, so a window of 3 s holds several
# batches even at 1 MiB blocks.
# Each case in 2 windows, each after an ib_read_bw run of its own, with as
# many QPs (4, the agent's default, judged; and 1).
rd=$(awk -v d="$d" 'BEGIN { x = 4 * d; print (x < 4 ? 4 : x) }')
args="read --transport rdma --sizes 64K,1M --batches 16,64 --ids scattered --conns 4,1 \
  --group-bytes 16M --max-batch-bytes 16M --duration $rd --rounds 2 --quiet \
  --csv read-rdma.csv --plot read-rdma.png"
wargs="read --op write --transport rdma --sizes 64K,1M --batches 16,64 --ids scattered --conns 4 \
  --group-bytes 16M --max-batch-bytes 16M --duration $rd --rounds 2 --quiet \
  --csv read-rdma-write.csv --plot read-rdma-write.png"

rm -f "$payload/read-rdma.csv" "$payload/read-rdma.png.gp" "$payload/read-rdma.txt" \
  "$payload/read-rdma-write.csv" "$payload/read-rdma-write.png.gp" "$payload/read-rdma-write.txt"
if command -v ibv_devices >/dev/null 2>&1 && ibv_devices 2>/dev/null | awk 'NR > 2 && NF' | grep -q .; then
  echo "rdma-bench: an RDMA device on this host: running here" >"$out/read-rdma.log"
  # shellcheck disable=SC2086
  (cd "$payload" && ./sx-bench $args >read-rdma.txt 2>>"$out/read-rdma.log" &&
    ./sx-bench $wargs >read-rdma-write.txt 2>>"$out/read-rdma.log")
  rc=$?
elif [ "$(id -u)" = 0 ] && [ -x "$vm" ]; then
  redis=$(command -v redis-server 2>/dev/null || true)
  RXE_VM_EXTRA_FILES="$redis" RXE_VM_MTU=9000 RXE_VM_TIMEOUT=${SX_RDMA_VM_TIMEOUT:-900} \
    RXE_VM_QUIET=1 "$vm" "$payload" "./sx-bench $args --rdma-ip \$RXE_IP >read-rdma.txt && \
./sx-bench $wargs --rdma-ip \$RXE_IP >read-rdma-write.txt" >"$out/read-rdma.log" 2>&1
  rc=$?
else
  echo "RDMA part: not run (no RDMA device, and the Soft-RoCE VM needs root)" | tee "$out/read-rdma.txt"
  exit 0
fi
for f in read-rdma read-rdma-write; do
  [ -f "$payload/$f.txt" ] && cp "$payload/$f.txt" "$out/$f.txt"
  [ -f "$payload/$f.csv" ] && cp "$payload/$f.csv" "$out/$f.csv"
  if [ -f "$payload/$f.png.gp" ] && command -v gnuplot >/dev/null 2>&1; then
    (cd "$payload" && gnuplot "$f.png.gp") && mv "$payload/$f.png" "$out/$f.png"
    mv "$payload/$f.png.gp" "$out/$f.png.gp"
  fi
done
if [ $rc -ne 0 ]; then
  tail -n 30 "$out/read-rdma.log"
  exit 1
fi
exit 0
