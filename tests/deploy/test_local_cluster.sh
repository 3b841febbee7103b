#!/bin/sh
# deploy/local-cluster.sh, end to end, under a prefix of its own:
#   1. `demo` passes (cross-host verified reads, metrics, Sentinel failover,
#      lease expiry) and leaves no namespace or process behind, and so does
#      `demo` with SXLC_STORE=cluster (a Redis Cluster, CLUSTER FAILOVER);
#   2. an `up` that fails half way (SXLC_FAIL_AFTER=store) removes everything;
#   3. an `up` stopped with SIGTERM half way removes everything;
#   4. `down` removes leftovers (a namespace with a process in it) and can be
#      repeated.
# Skips, saying why, when not root or when network namespaces cannot be made.
# Usage: tests/deploy/test_local_cluster.sh BUILD_DIR
set -u
build=$1
here=$(cd "$(dirname "$0")/../.." && pwd)
script="$here/deploy/local-cluster.sh"
logs="$build/test-logs"
mkdir -p "$logs"
log="$logs/local-cluster.log"
: >"$log"

if [ "$(id -u)" != 0 ]; then
  echo "  SKIP  local cluster: needs root for network namespaces"
  exit 0
fi
for p in ip redis-server redis-sentinel redis-cli curl; do
  command -v $p >/dev/null || { echo "  SKIP  local cluster: $p is not installed"; exit 0; }
done
prefix="sxt$$"
probe="$prefix-probe"
if ! ip netns add "$probe" 2>>"$log"; then
  echo "  SKIP  local cluster: cannot create a network namespace here"
  exit 0
fi
ip netns del "$probe"

export SXLC_PREFIX="$prefix" SXLC_BIN="$build/bin" SXLC_DIR="/tmp/segxfer-$prefix"
cleanup() { "$script" down >/dev/null 2>&1; }
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
  echo "  FAIL  local cluster: $*"
  sed 's/^/        | /' "$log" | tail -n 60
  exit 1
}

# Nothing of ours left: namespaces, processes in them, the state directory.
nothing_left() {
  left=$(ip netns list | awk '{print $1}' | grep "^$prefix-" || true)
  [ -z "$left" ] || fail "$1: namespaces left: $left"
  [ ! -e "$SXLC_DIR" ] || fail "$1: $SXLC_DIR left"
}

start=$(date +%s)

# 1. The demo, with the etcd cluster of deploy/etcd when etcd is installed.
echo "### demo" >>"$log"
etcd=0
command -v etcd >/dev/null && command -v etcdctl >/dev/null && etcd=1
SXLC_ETCD=$etcd timeout -k 10 300 "$script" demo >>"$log" 2>&1 || fail "demo exited $?"
if [ $etcd = 1 ]; then
  n=$(grep -c "is healthy: successfully committed proposal" "$log")
  [ "$n" = 3 ] || fail "demo: $n of 3 etcd members healthy"
  grep -q "verified every byte: 16.0 MiB against the pattern of seed 44" "$log" ||
    fail "demo: the etcd-backed pool was not read and verified"
fi
for want in "verified every byte: 200.0 MiB" "verified every byte: 64.0 MiB" \
            "verified every byte: 100.0 MiB" "master after:  10.0.0.11" \
            "now a replica of 10.0.0.11" "prefill-1/tp0 gone" \
            "removed every namespace and process" "segxfer_served_bytes_total"; do
  grep -q "$want" "$log" || fail "demo: no '$want' in its output"
done
nothing_left "after demo"

# 1b. The demo on a Redis Cluster (deploy/redis-cluster) instead of Sentinel.
echo "### demo, SXLC_STORE=cluster" >>"$log"
mark=$(wc -l <"$log")
SXLC_STORE=cluster timeout -k 10 300 "$script" demo >>"$log" 2>&1 ||
  fail "cluster demo exited $?"
tail -n +"$mark" "$log" >"$log.cluster"
for want in "store: Redis Cluster" "verified every byte: 200.0 MiB" \
            "takes over from 10.0.0.10:7001" \
            "10.0.0.10:7001@17001 myself,slave" "verified every byte: 100.0 MiB" \
            "prefill-1/tp0 gone" "removed every namespace and process"; do
  grep -q "$want" "$log.cluster" || fail "cluster demo: no '$want' in its output"
done
rm -f "$log.cluster"
nothing_left "after the cluster demo"

# 2. A failed up removes what it made.
echo "### up failing after the store" >>"$log"
SXLC_FAIL_AFTER=store timeout -k 10 120 "$script" up >>"$log" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "up with SXLC_FAIL_AFTER=store exited $rc, not 1"
grep -q "everything it started is removed" "$log" || fail "failed up: no teardown message"
nothing_left "after a failed up"

# 3. SIGTERM while the store starts: everything goes.
echo "### up stopped by SIGTERM" >>"$log"
"$script" up >>"$log" 2>&1 &
pid=$!
i=0
while [ -z "$(ip netns pids "$prefix-meta1" 2>/dev/null)" ] && [ $i -lt 300 ]; do
  sleep 0.1
  i=$((i + 1))
done
[ $i -lt 300 ] || fail "SIGTERM case: the redis master never started"
kill -TERM $pid
i=0
while kill -0 $pid 2>/dev/null && [ $i -lt 600 ]; do
  sleep 0.1
  i=$((i + 1))
done
kill -0 $pid 2>/dev/null && fail "SIGTERM case: up did not stop within 60 s"
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "SIGTERM case: up exited $rc, not 130"
nothing_left "after SIGTERM"

# 4. down removes leftovers of a run that died, and may be repeated.
echo "### down with leftovers" >>"$log"
ip netns add "$prefix-node1"
ip netns exec "$prefix-node1" sleep 300 &
sleeper=$!
mkdir -p "$SXLC_DIR"
"$script" down >>"$log" 2>&1 || fail "down exited $?"
"$script" down >>"$log" 2>&1 || fail "a second down exited $?"
# Killed means gone or a zombie waiting for us to reap it.
if [ -d /proc/$sleeper ] && ! grep -q ') Z ' /proc/$sleeper/stat 2>/dev/null; then
  kill -KILL $sleeper
  fail "down left a process running in $prefix-node1"
fi
wait $sleeper 2>/dev/null
grep -q "failed (exit 130); everything it started is removed" "$log" ||
  fail "SIGTERM case: no teardown message"
nothing_left "after down"

secs=$(( $(date +%s) - start ))
demo_s=$(sed -n 's/^local cluster demo finished in \(.*\) s$/\1/p' "$log")
printf '  PASS  %-28s %6ss (demo %s s%s; teardown on failure, SIGTERM, leftovers)\n' \
  "local cluster" "$secs" "$demo_s" "$([ $etcd = 1 ] && echo ', with etcd')"
