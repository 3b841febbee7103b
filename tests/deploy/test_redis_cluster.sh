#!/bin/sh
# deploy/redis-cluster/cluster.sh end to end, on free loopback ports: `up`
# builds the 3+3 cluster with the ACL users of users.acl; an sx-agent
# publishes with the agent user; sxctl with the read-only user lists and
# shows it, and is refused `rm`; the admin user removes it; `down` leaves no
# node running and no state behind.  Skips, saying why, when redis-server
# or redis-cli is missing.
# Usage: tests/deploy/test_redis_cluster.sh BUILD_DIR
set -u
build=$1
here=$(cd "$(dirname "$0")/../.." && pwd)
script="$here/deploy/redis-cluster/cluster.sh"
logs="$build/test-logs"
mkdir -p "$logs"
log="$logs/redis-cluster.log"
: >"$log"
for p in redis-server redis-cli; do
  command -v $p >/dev/null || { echo "  SKIP  deploy/redis-cluster: $p is not installed"; exit 0; }
done
export SXRC_DIR="${TMPDIR:-/tmp}/sxt-rcluster-$$"
# Six free ports in a row whose bus ports (+10000) are free too.
SXRC_PORT=$(python3 - <<'PY'
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False
while True:
    b = random.randrange(20000, 30000)
    if all(free(b + i) and free(b + 10000 + i) for i in range(6)):
        print(b)
        break
PY
)
export SXRC_PORT
agent_pid=""
fail() {
  echo "  FAIL  deploy/redis-cluster: $*"
  sed 's/^/        /' "$log" | tail -30
  [ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null
  "$script" down >>"$log" 2>&1
  exit 1
}
"$script" up >>"$log" 2>&1 || fail "up failed"
urls=$("$script" urls) || fail "urls failed"
agent=$(echo "$urls" | sed -n 's/^agent: *//p')
reader=$(echo "$urls" | sed -n 's/^reader: *//p')
admin=$(echo "$urls" | sed -n 's/^admin: *//p')
"$build/bin/sx-agent" --name pool-0 --metadata "$agent" --listen 127.0.0.1:0 --num-blocks 8 \
  --lease-ms 3000 >>"$log" 2>&1 &
agent_pid=$!
ok=0
for _ in $(seq 100); do
  if "$build/bin/sxctl" --metadata "$reader" show pool-0 >>"$log" 2>&1; then ok=1; break; fi
  sleep 0.1
done
[ $ok = 1 ] || fail "the reader does not see the agent's segment"
"$build/bin/sxctl" --metadata "$reader" ls >"$SXRC_DIR/ls" 2>>"$log" || fail "ls as the reader"
grep -q '^pool-0 ' "$SXRC_DIR/ls" || fail "ls does not list pool-0"
rc=0
"$build/bin/sxctl" --metadata "$reader" rm pool-0 --force >>"$log" 2>"$SXRC_DIR/err" || rc=$?
if [ $rc != 2 ] || ! grep -q NOPERM "$SXRC_DIR/err"; then
  fail "the read-only user could rm (rc $rc)"
fi
"$build/bin/sxctl" --metadata "$admin" rm pool-0 --force >>"$log" 2>&1 || fail "rm as the admin"
kill "$agent_pid" 2>/dev/null
wait "$agent_pid" 2>/dev/null
agent_pid=""
"$script" down >>"$log" 2>&1 || fail "down failed"
[ ! -e "$SXRC_DIR" ] || fail "down left $SXRC_DIR"
for i in 0 1 2 3 4 5; do
  redis-cli -p $((SXRC_PORT + i)) ping 2>&1 | grep -q 'Connection refused' ||
    fail "node $i still runs"
done
echo "  PASS  deploy/redis-cluster (cluster.sh up/down, ACL users: agent, reader, admin)"
