#!/bin/sh
# docs/store.md's TLS setup, for real: Redis 7 listening only on its
# tls-port with a certificate from a throwaway CA (openssl), and the stunnel
# client configuration the docs show (verifyChain, checkHost) in front of
# it.  An sx-agent publishes and sxctl lists and shows through the tunnel;
# the plain-text port is closed; a tunnel that expects another host name
# refuses the server, and sxctl says it cannot use the store.  Skips, saying
# why, when redis-server, stunnel or openssl is missing, or when this
# redis-server was built without TLS.
# Usage: tests/deploy/test_redis_tls.sh BUILD_DIR
set -u
build=$(cd "$1" && pwd)
logs="$build/test-logs"
mkdir -p "$logs"
log="$logs/redis-tls.log"
: >"$log"
for p in redis-server redis-cli stunnel4 openssl python3; do
  command -v $p >/dev/null || { echo "  SKIP  redis TLS: $p is not installed"; exit 0; }
done
dir=$(mktemp -d "${TMPDIR:-/tmp}/sxt-tls-XXXXXX")
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null; done
  for p in $pids; do wait "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "  FAIL  redis TLS: $*"
  sed 's/^/        /' "$log" | tail -30
  exit 1
}
. "$(dirname "$0")/../support/servers.sh"  # sxt_free_port

# A CA, and a server certificate for redis.test (and 127.0.0.1) signed by it.
cd "$dir" || exit 1
{
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=sxt test CA" \
    -keyout ca.key -out ca.pem &&
  openssl req -newkey rsa:2048 -nodes -subj "/CN=redis.test" -keyout redis.key \
    -out redis.csr &&
  printf 'subjectAltName=DNS:redis.test,IP:127.0.0.1\n' >san.ext &&
  openssl x509 -req -in redis.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
    -extfile san.ext -out redis.pem
} >>"$log" 2>&1 || fail "openssl could not make the test CA"

tls=$(sxt_free_port)
redis-server --port 0 --tls-port "$tls" --bind 127.0.0.1 --tls-cert-file redis.pem \
  --tls-key-file redis.key --tls-ca-cert-file ca.pem --tls-auth-clients no \
  --requirepass tls-secret --save '' --appendonly no --dir "$dir" \
  --notify-keyspace-events Kx >>"$log" 2>&1 &
pids="$pids $!"
ok=0
for _ in $(seq 100); do
  if REDISCLI_AUTH=tls-secret redis-cli --tls --cacert ca.pem -p "$tls" ping 2>>"$log" |
     grep -qx PONG; then ok=1; break; fi
  if grep -q "not built with TLS\|Unrecognized option\|Bad directive" "$log"; then
    echo "  SKIP  redis TLS: this redis-server has no TLS (tls-port)"
    exit 0
  fi
  sleep 0.1
done
[ $ok = 1 ] || fail "redis-server with tls-port did not answer over TLS"

# tunnel NAME CHECKHOST: the docs' client configuration, on a free port
# (into $port).  Not in a command substitution: its subshell would keep the
# stunnel's pid from the cleanup, which would leave it running.
tunnel() {
  port=$(sxt_free_port)
  cat >"$1.conf" <<EOC
foreground = yes
pid =
[redis]
client = yes
accept = 127.0.0.1:$port
connect = 127.0.0.1:$tls
CAfile = $dir/ca.pem
verifyChain = yes
checkHost = $2
EOC
  stunnel4 "$1.conf" >>"$log" 2>&1 &
  pids="$pids $!"
  for _ in $(seq 50); do
    python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 1)" \
      2>/dev/null && break
    sleep 0.1
  done
}
tunnel good redis.test
good=$port
tunnel bad other.test
bad=$port
url="redis://:tls-secret@127.0.0.1:$good?namespace=tls&connect_timeout_ms=3000"

"$build/bin/sx-agent" --name tls-pool --metadata "$url" --listen 127.0.0.1:0 \
  --num-blocks 8 --lease-ms 3000 >>"$log" 2>&1 &
pids="$pids $!"
ok=0
for _ in $(seq 100); do
  if "$build/bin/sxctl" --metadata "$url" show tls-pool >>"$log" 2>&1; then ok=1; break; fi
  sleep 0.1
done
[ $ok = 1 ] || fail "sx-agent's segment is not seen through the tunnel"
"$build/bin/sxctl" --metadata "$url" ls 2>>"$log" | grep -q '^tls-pool ' ||
  fail "sxctl ls through the tunnel does not list tls-pool"
# The server speaks TLS only: plain text gets nothing.
if REDISCLI_AUTH=tls-secret redis-cli -p "$tls" ping 2>/dev/null | grep -qx PONG; then
  fail "the tls-port answered plain text"
fi
# A tunnel checking another host name refuses the server's certificate.
rc=0
"$build/bin/sxctl" --metadata "redis://:tls-secret@127.0.0.1:$bad?namespace=tls&connect_timeout_ms=2000" \
  ls >>"$log" 2>"$dir/err" || rc=$?
[ $rc != 0 ] || fail "a tunnel with a wrong checkHost let sxctl through"
grep -q "cannot use the metadata store" "$dir/err" || fail "no clear error through a refused tunnel"
grep -q "Subject checks failed" "$log" ||
  fail "stunnel did not log the failed certificate check"
echo "  PASS  redis TLS (tls-port + the docs' stunnel client: agent and sxctl; wrong host refused)"
