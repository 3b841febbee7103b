#!/usr/bin/env bash
# A Redis Cluster of 3 masters and 3 replicas for segxfer, on one machine
# (for a try-out, a test, or as the template of a real deployment: each
# node's files are node.conf and users.acl of this directory, filled in).
#
# Usage: deploy/redis-cluster/cluster.sh COMMAND
#   up      render the files, start six redis-server, join them with
#           redis-cli --cluster create --cluster-replicas 1, wait until the
#           cluster is ok, and print the URLs (agent, reader, admin)
#   urls    print the URLs of the cluster that is up
#   status  redis-cli --cluster check
#   down    stop the nodes and remove the state directory (safe to repeat)
#
# Settings (environment):
#   SXRC_DIR    state: configs, data, logs, secrets (default /tmp/segxfer-rcluster)
#   SXRC_HOST   address the nodes listen on and announce (default 127.0.0.1)
#   SXRC_PORT   first port; the nodes take PORT..PORT+5, and each also
#               PORT+10000 for the cluster bus (default 7101)
#
# Passwords are random per cluster, kept in $SXRC_DIR/secrets (mode 600);
# redis-cli gets them through REDISCLI_AUTH, never on a command line.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
DIR=${SXRC_DIR:-/tmp/segxfer-rcluster}
HOST=${SXRC_HOST:-127.0.0.1}
PORT=${SXRC_PORT:-7101}
NODES=6

die() { printf 'redis-cluster: %s\n' "$*" >&2; exit 1; }
rand() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }
ports() { local i; for i in $(seq 0 $((NODES - 1))); do echo $((PORT + i)); done; }
acli() { REDISCLI_AUTH=$ADMIN_PW redis-cli --user sx-cluster-admin --no-auth-warning "$@"; }

load_secrets() {
  [ -f "$DIR/secrets" ] || die "no cluster is up in $DIR"
  # shellcheck disable=SC1091
  . "$DIR/secrets"
}

urls() {
  load_secrets
  local seeds p
  seeds=""
  for p in $(ports); do seeds="$seeds${seeds:+,}$HOST:$p"; done
  echo "agent:  redis+cluster://sx-agent-prod:$AGENT_PW@$seeds?namespace=prod"
  echo "reader: redis+cluster://sx-reader-prod:$READER_PW@$seeds?namespace=prod"
  echo "admin:  redis+cluster://sx-admin-prod:$SXADMIN_PW@$seeds?namespace=prod"
}

down() {
  local p pid
  for p in $(ports); do
    if [ -f "$DIR/$p/pid" ]; then
      pid=$(cat "$DIR/$p/pid")
      kill "$pid" 2>/dev/null || true
    fi
  done
  for p in $(ports); do
    if [ -f "$DIR/$p/pid" ]; then
      pid=$(cat "$DIR/$p/pid")
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$DIR"
}

up() {
  local p i ok
  for p in redis-server redis-cli; do
    command -v $p >/dev/null || die "$p is not installed (make deps installs it)"
  done
  [ ! -e "$DIR" ] || die "$DIR exists: a cluster is up (run down first)"
  [ "$PORT" -le 55530 ] || die "SXRC_PORT must be at most 55530 (the bus is port + 10000)"
  mkdir -p "$DIR"
  chmod 700 "$DIR"
  umask 077
  cat >"$DIR/secrets" <<EOS
AGENT_PW=$(rand)
READER_PW=$(rand)
SXADMIN_PW=$(rand)
REPLICA_PW=$(rand)
ADMIN_PW=$(rand)
EOS
  load_secrets
  # Whatever stops `up` half way (a failure, die, Ctrl-C) removes it all.
  trap 'down' EXIT
  trap 'exit 1' INT TERM
  for p in $(ports); do
    mkdir -p "$DIR/$p"
    sed -e "s#^bind BIND#bind $HOST#; s#^port PORT#port $p#; s#DIR#$DIR/$p#g" \
        -e "s/REPLICA-PASSWORD/$REPLICA_PW/g" "$here/node.conf" >"$DIR/$p/redis.conf"
    sed -e "s/AGENT-PASSWORD/$AGENT_PW/; s/READER-PASSWORD/$READER_PW/" \
        -e "s/ADMIN-PASSWORD/$SXADMIN_PW/; s/REPLICA-PASSWORD/$REPLICA_PW/" \
        -e "s/CLUSTER-PASSWORD/$ADMIN_PW/" "$here/users.acl" >"$DIR/$p/users.acl"
    redis-server "$DIR/$p/redis.conf" >/dev/null 2>&1 3>&- &
    echo $! >"$DIR/$p/pid"
  done
  for p in $(ports); do
    ok=0
    for _ in $(seq 100); do
      if acli -h "$HOST" -p "$p" ping 2>/dev/null | grep -qx PONG; then ok=1; break; fi
      sleep 0.1
    done
    [ $ok = 1 ] || die "node $HOST:$p did not start (log: $DIR/$p/redis.log)"
  done
  local addrs=()
  for p in $(ports); do addrs+=("$HOST:$p"); done
  acli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$DIR/create.log" 2>&1 ||
    die "redis-cli --cluster create failed (see $DIR/create.log)"
  for i in $(seq 300); do
    ok=1
    for p in $(ports); do
      acli -h "$HOST" -p "$p" cluster info | grep -q '^cluster_state:ok' || ok=0
    done
    [ $ok = 1 ] && break
    sleep 0.1
  done
  [ $ok = 1 ] || die "the cluster did not become ok within 30 s"
  trap - EXIT INT TERM
  echo "cluster up in $DIR ($HOST:$PORT..$((PORT + NODES - 1)))"
  urls
}

case ${1:-} in
  up) up ;;
  down) down ;;
  urls) urls ;;
  status) load_secrets; acli --cluster check "$HOST:$PORT" ;;
  *) die "usage: $0 up|urls|status|down" ;;
esac
