#!/bin/sh
# make check-rdma: the RDMA suite (tests/rdma/run.sh) on a real device.
#   - directly, when ibv_devices lists a device on this host;
#   - otherwise inside Soft-RoCE VMs (tests/rdma/run-in-rxe-vm.sh): one VM
#     (loopback, two processes, kill/restart), then two VMs as two hosts;
#   - skipped, with a plain message, only when the VM cannot start here
#     (not root, or QEMU and the kernel cannot be installed).
# Usage: tests/rdma/check.sh BUILD_DIR [perf]
# Knobs: SX_RDMA_VM_TIMEOUT (seconds per VM run, default 600),
#        SX_RDMA_TWO_VMS=0 to skip the two-VM run,
#        SX_PERF_ROUNDS, SX_PERF_SECONDS, SX_PERF_ARGS for perf (see run.sh).
set -u
build=$1
what=${2:-check}
here=$(cd "$(dirname "$0")" && pwd)
payload=$(cd "$build/rdma-tests" && pwd) || { echo "check-rdma: $build/rdma-tests missing" >&2; exit 1; }
vm=$here/run-in-rxe-vm.sh
logs=$build/test-logs
mkdir -p "$logs"

if [ "$what" = perf ]; then
  mode=perf
else
  mode=one
fi

if command -v ibv_devices >/dev/null 2>&1 && ibv_devices 2>/dev/null | awk 'NR > 2 && NF' | grep -q .; then
  dev=$(ibv_devices | awk 'NR > 2 && NF { print $1; exit }')
  echo "check-rdma: RDMA device $dev on this host: running the suite directly"
  cd "$payload" && exec ./run.sh "$mode"
fi

if [ "$(id -u)" != 0 ]; then
  echo "check-rdma: SKIP: no RDMA device on this host, and the Soft-RoCE VM needs root (apt-get, QEMU)"
  exit 0
fi

# One VM run; a VM that never became ready means it cannot start here.
vm_run() {  # vm_run NAME ARGS...   (env already set)
  name=$1; shift
  log=$logs/rdma-$name.log
  start=$(date +%s)
  RXE_VM_TIMEOUT=${SX_RDMA_VM_TIMEOUT:-600} "$vm" "$payload" "$@" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  if [ $rc -eq 125 ] && ! grep -q 'main guest ready' "$log"; then
    echo "check-rdma: SKIP: the Soft-RoCE VM could not start here; its log ($log) ends with:"
    tail -n 15 "$log" | sed 's/^/  | /'
    exit 0
  fi
  grep -E '^(PASS|FAIL|RATIO|round|==)|\[peer\] (PASS|FAIL|==)|^\[ *(OK|FAILED|PASSED|ERROR|LINE) *\]|segxfer-read|^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+' "$log" | sed 's/^/  /'
  if [ $rc -ne 0 ]; then
    echo "check-rdma: $name FAILED (exit $rc, ${secs}s); full log: $log"
    tail -n 60 "$log" | sed 's/^/  | /'
    return 1
  fi
  echo "check-rdma: $name passed (${secs}s)"
  return 0
}

if [ "$mode" = perf ]; then
  # One vCPU-heavy VM with RoCE MTU 4096, as CI would run it.
  # The guest does not inherit this environment: pass the knobs along.
  RXE_VM_MTU=${RXE_VM_MTU:-9000} vm_run perf "SX_PERF_ROUNDS=${SX_PERF_ROUNDS:-3} \
SX_PERF_SECONDS=${SX_PERF_SECONDS:-4} SX_PERF_ARGS='${SX_PERF_ARGS:-}' ./run.sh perf"
  exit $?
fi

fail=0
# The end-to-end test needs redis-server in the guest.
redis=$(command -v redis-server 2>/dev/null || true)
# RoCE MTU 4096 (eth MTU 9000): ~1.5x faster under emulation.
RXE_VM_EXTRA_FILES="$redis ${RXE_VM_EXTRA_FILES:-}" RXE_VM_MTU=${RXE_VM_MTU:-9000} \
  vm_run one-vm ./run.sh one || fail=1
if [ "${SX_RDMA_TWO_VMS:-1}" != 0 ]; then
  # Two hosts over the default 1500-byte link (RoCE MTU 1024), 1 vCPU each.
  two_vms() {
    rm -rf "$payload/run"
    mkdir -p "$payload/run"
    RXE_VM_EXTRA_FILES="$redis ${RXE_VM_EXTRA_FILES:-}" \
      RXE_VM_PEER_CMD='./run.sh two-peer' vm_run two-vms ./run.sh two-main
    r=$?
    rm -rf "$payload/run"
    return $r
  }
  if ! two_vms; then
    # The emulated NIC between the VMs sometimes stops sending for a minute
    # (a guest kernel's "NETDEV WATCHDOG: transmit queue 0 timed out", seen
    # 2 times in 5 runs on 2026-11-26, the same builds passing otherwise):
    # below rxe and segxfer, so that failure alone gets one more run.
    if grep -q 'NETDEV WATCHDOG' "$logs/rdma-two-vms.log"; then
      mv "$logs/rdma-two-vms.log" "$logs/rdma-two-vms-stalled-nic.log"
      echo "check-rdma: two-vms: the virtual NIC between the VMs stalled" \
           "($logs/rdma-two-vms-stalled-nic.log); running it once more"
      two_vms || fail=1
    else
      fail=1
    fi
  fi
fi
if [ "${SX_RDMA_TWO_VMS:-1}" = 0 ]; then
  echo "check-rdma: two-vms skipped (SX_RDMA_TWO_VMS=0; a sanitizer build's make test" \
       "sets it, the plain build runs it)"
fi
[ $fail -eq 0 ] && echo "check-rdma: all passed" || echo "check-rdma: FAILED"
exit $fail
