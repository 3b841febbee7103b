#!/usr/bin/env bash
# A small multi-host segxfer cluster on one machine, built from network
# namespaces: every "host" has its own network stack and IP address, joined
# through a Linux bridge that lives in a namespace of its own (nothing is
# added to this machine's own network).
#
#   meta1   10.0.0.10 redis master (deploy/redis/redis.conf)   10.0.0.21 sentinel 1
#   meta2   10.0.0.11 redis replica (deploy/redis/replica.conf) 10.0.0.22 sentinel 2
#   meta3                                                        10.0.0.23 sentinel 3
#           10.0.0.51..53 etcd members 1..3 (deploy/etcd/*.env), with SXLC_ETCD=1
#   node1   10.0.0.31 sx-agent prefill-0/tp0  (data :7400, metrics :9464);
#                     with SXLC_ETCD=1 also etcd-pool/tp0 published through etcd
#                     (data :7401, metrics :9465)
#   node2   10.0.0.32 sx-agent prefill-1/tp0  (data :7400, metrics :9464)
#   client  10.0.0.41 sxctl, curl
#
# The Redis and Sentinel files of deploy/redis/ (and the etcd files of
# deploy/etcd/) run as they are; only paths and the *-PASSWORD placeholders
# (random per cluster) are filled in.  Agents
# use the ACL user sx-agent-prod through the sentinels, sxctl the read-only
# sx-reader-prod; both give the sentinels their password (sentinel_password).
#
# Usage: deploy/local-cluster.sh COMMAND
#   up       build the cluster and leave it running
#   demo     up, then: sxctl ls, a cross-host read by segment name verified
#            byte for byte, ping, a metrics scrape, a Sentinel failover the
#            agents follow, an agent killed and its lease running out; then
#            down (also on failure and on Ctrl-C)
#   status   namespaces, processes and `sxctl ls`
#   exec HOST CMD...   run CMD on HOST with SX_METADATA_URL set: the
#            read-only user's URL, or SXLC_USER=admin (sxctl rm), agent, or
#            etcd (the etcd cluster, with SXLC_ETCD=1)
#   down     stop everything and remove the namespaces; safe to repeat, and
#            it removes the leftovers of a run that died
#
# Needs root, iproute2, redis-server, redis-sentinel, redis-tools, curl and
# the programs (make).  Settings (environment):
#   SXLC_PREFIX    namespace name prefix (default sxlc)
#   SXLC_NET       first three octets of the cluster network (default 10.0.0,
#                  as in deploy/redis; it exists only inside the namespaces)
#   SXLC_BIN       where sx-agent and sxctl are (default: build/bin of this
#                  repository, else $PATH)
#   SXLC_DIR       state: configs, logs, secrets (default /tmp/segxfer-PREFIX)
#   SXLC_DELAY     one-way delay per host link via tc netem, e.g. 200us
#   SXLC_LEASE_MS  the agents' lease (default 3000)
#   SXLC_ETCD      1: also run the three-member etcd cluster of deploy/etcd
#                  (needs etcd-server and etcd-client)
#   SXLC_STORE     sentinel (default): the Redis master, replica and sentinels
#                  above; cluster: instead a Redis Cluster of deploy/redis-cluster,
#                  3 masters and 3 replicas, two nodes per meta host (ports
#                  7001 and 7002 on 10.0.0.10, .11 and .23, each master's
#                  replica on another host), agents and sxctl on
#                  redis+cluster:// URLs, and the demo's failover a
#                  CLUSTER FAILOVER instead of Sentinel's
#   SXLC_FAIL_AFTER  net|store|agents: fail on purpose after that step (tests
#                  use it to check that a failed `up` removes everything)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
PREFIX=${SXLC_PREFIX:-sxlc}
NET=${SXLC_NET:-10.0.0}
DIR=${SXLC_DIR:-/tmp/segxfer-$PREFIX}
LEASE_MS=${SXLC_LEASE_MS:-3000}
DELAY=${SXLC_DELAY:-}
FAIL_AFTER=${SXLC_FAIL_AFTER:-}
ETCD=${SXLC_ETCD:-0}
STORE=${SXLC_STORE:-sentinel}
case $STORE in sentinel | cluster) ;; *) echo "local-cluster: SXLC_STORE is sentinel or cluster" >&2; exit 2 ;; esac
HOSTS="meta1 meta2 meta3 node1 node2 client"
MASTER=sx-meta

if [ -n "${SXLC_BIN:-}" ]; then
  BIN=$(cd "$SXLC_BIN" && pwd)
elif [ -x "$repo/build/bin/sx-agent" ]; then
  BIN="$repo/build/bin"
else
  BIN=$(dirname "$(command -v sx-agent 2>/dev/null || echo /usr/local/bin/sx-agent)")
fi

say() { printf '%s\n' "$*"; }
die() { printf 'local-cluster: %s\n' "$*" >&2; exit 1; }
if [ -t 1 ]; then
  step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
  step() { printf '\n== %s\n' "$*"; }
fi

ns() { printf '%s-%s' "$PREFIX" "$1"; }
# Addresses of each host (the first one is its main address).
addrs() {
  case $1 in
    meta1) echo "$NET.10 $NET.21 $NET.51" ;;
    meta2) echo "$NET.11 $NET.22 $NET.52" ;;
    meta3) echo "$NET.23 $NET.53" ;;
    node1) echo "$NET.31" ;;
    node2) echo "$NET.32" ;;
    client) echo "$NET.41" ;;
  esac
}
on() { local h=$1; shift; ip netns exec "$(ns "$h")" "$@"; }

# ------------------------------------------------------------------ teardown

ours() { # our namespaces that exist now
  local want n
  for n in sw $HOSTS; do
    want=$(ns "$n")
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$want" && echo "$want"
  done
  return 0
}

# Signal every process inside the given namespaces and wait up to $2 s for
# them to go.  Processes in our namespaces can only be ours.
stop_in() {
  local sig=$1 secs=$2 n pids left
  shift 2
  for n in "$@"; do
    pids=$(ip netns pids "$n" 2>/dev/null || true)
    [ -n "$pids" ] && kill "-$sig" $pids 2>/dev/null
  done
  for _ in $(seq $((secs * 10))); do
    left=""
    for n in "$@"; do left="$left$(ip netns pids "$n" 2>/dev/null || true)"; done
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  return 1
}

teardown() {
  set +e
  local all agents meta n
  all=$(ours)
  if [ -n "$all" ]; then
    # Agents first, with SIGTERM: they unpublish while the store still runs.
    agents=""
    meta=""
    for n in $all; do
      case $n in
        *-node1 | *-node2 | *-client) agents="$agents $n" ;;
        *) meta="$meta $n" ;;
      esac
    done
    [ -n "$agents" ] && { stop_in TERM 10 $agents || stop_in KILL 5 $agents; }
    [ -n "$meta" ] && { stop_in TERM 5 $meta || stop_in KILL 5 $meta; }
    for n in $all; do ip netns del "$n" 2>/dev/null; done
  fi
  rm -rf "$DIR"
  set -e
}

# ------------------------------------------------------------------ helpers

need() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null || die "ip (iproute2) is not installed"
  local p
  for p in redis-server redis-sentinel redis-cli curl; do
    command -v $p >/dev/null || die "$p is not installed (make deps installs it)"
  done
  for p in sx-agent sxctl; do
    [ -x "$BIN/$p" ] || die "$BIN/$p is not built (run make, or set SXLC_BIN)"
  done
  if [ "$ETCD" = 1 ]; then
    for p in etcd etcdctl; do
      command -v $p >/dev/null || die "$p is not installed (SXLC_ETCD=1; make deps installs it)"
    done
  fi
}

# wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds.
wait_for() {
  local secs=$1 what=$2 i
  shift 2
  for i in $(seq $((secs * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  die "$what did not happen within $secs s (logs: $DIR/logs)"
}

# start HOST NAME CMD...: run CMD in the background on HOST, log to NAME.log.
start() {
  local h=$1 name=$2
  shift 2
  # fd 3 (the saved stderr) stays behind: a server holding it would keep
  # the caller's pipe open after this script ends.
  ip netns exec "$(ns "$h")" "$@" >>"$DIR/logs/$name.log" 2>&1 3>&- &
  echo "$! $name $h" >>"$DIR/pids"
}

rand() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }

load_secrets() {
  [ -f "$DIR/secrets" ] || die "no cluster is up under prefix $PREFIX ($DIR/secrets is missing)"
  # shellcheck disable=SC1091
  . "$DIR/secrets"
  local s="$NET.21:26379,$NET.22:26379,$NET.23:26379/$MASTER?namespace=prod&sentinel_password=$SENTINEL_CLIENT_PW"
  local scheme=redis+sentinel
  if [ "$STORE" = cluster ]; then
    s="$NET.10:7001,$NET.11:7001,$NET.23:7001?namespace=prod"
    scheme=redis+cluster
  fi
  AGENT_URL="$scheme://sx-agent-prod:$AGENT_PW@$s"
  READER_URL="$scheme://sx-reader-prod:$READER_PW@$s"
  ADMIN_URL="$scheme://sx-admin-prod:$ADMIN_PW@$s"
  ETCD_URL="etcd://$NET.51:2379,$NET.52:2379,$NET.53:2379?namespace=prod"
}

# redis-cli as the admin user; the password travels in REDISCLI_AUTH, not
# on a command line other users could read.
rcli() {
  local h=$1
  shift
  REDISCLI_AUTH=$ADMIN_PW on "$h" redis-cli --user sx-admin-prod --no-auth-warning "$@"
}
# redis-cli to a sentinel, with the sentinels' own password (requirepass).
scli() {
  local h=$1
  shift
  REDISCLI_AUTH=$SENTINEL_CLIENT_PW on "$h" redis-cli --no-auth-warning "$@"
}
# Conditions to wait for (functions, so that no password is ever on a
# command line).
role_connected() { rcli "$1" -h "$2" role | grep -qx connected; }
answers_ping() { rcli "$1" -h "$2" ping | grep -qx PONG; }
quorum() { scli meta1 -h "$NET.21" -p 26379 sentinel ckquorum "$MASTER" | grep -q '^OK 3 usable'; }
master_is() { [ "$(master_addr)" = "$1" ]; }
reconnected() {
  http_get "http://$(addrs "$1"):9464/metrics" | grep -q '^segxfer_store_reconnects_total [1-9]'
}
not_found() { local rc=0; sxctl show "$1" >/dev/null 2>&1 || rc=$?; [ $rc -eq 1 ]; }
sxctl() { SX_METADATA_URL=$READER_URL on client "$BIN/sxctl" "$@"; }
http_get() { on client curl -fsS --max-time 5 "$1"; }
maybe_fail() { [ "$FAIL_AFTER" != "$1" ] || die "failing after '$1' on purpose (SXLC_FAIL_AFTER)"; }

# ------------------------------------------------------------------ up

net_up() {
  local sw h a
  sw=$(ns sw)
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for h in $HOSTS; do
    ip netns add "$(ns "$h")"
    ip -n "$(ns "$h")" link set lo up
    # One veth pair per host: "$h" on the switch's bridge, eth0 on the host.
    ip -n "$sw" link add "$h" type veth peer name eth0 netns "$(ns "$h")"
    ip -n "$sw" link set "$h" master br0 up
    for a in $(addrs "$h"); do
      ip -n "$(ns "$h")" addr add "$a/24" dev eth0
    done
    ip -n "$(ns "$h")" link set eth0 up
    if [ -n "$DELAY" ]; then
      on "$h" tc qdisc add dev eth0 root netem delay "$DELAY"
    fi
  done
  # Every host reaches every other one through the bridge (checked with
  # ping where iputils is installed; the store's replication checks it too).
  if command -v ping >/dev/null; then
    wait_for 10 "client reaching meta1" on client ping -c1 -W1 "$NET.10"
  fi
}

# The deploy/redis files with paths, passwords and the network filled in.
render() {
  sed -e "s#/etc/redis/users.acl#$2/users.acl#" \
      -e "s#/etc/redis/redis.conf#$2/redis.conf#" \
      -e "s/AGENT-PASSWORD/$AGENT_PW/g; s/READER-PASSWORD/$READER_PW/g" \
      -e "s/ADMIN-PASSWORD/$ADMIN_PW/g; s/REPLICA-PASSWORD/$REPLICA_PW/g" \
      -e "s/SENTINEL-PASSWORD/$SENTINEL_PW/g" \
      -e "s/SENTINEL-CLIENT-PASSWORD/$SENTINEL_CLIENT_PW/g" \
      -e "s/10\.0\.0\./$NET./g" "$1"
}

store_up() {
  local src="$repo/deploy/redis" h d i
  for h in meta1 meta2 meta3; do mkdir -p "$DIR/$h"; done
  for h in meta1 meta2; do
    d="$DIR/$h"
    render "$src/users.acl" "$d" >"$d/users.acl"
    render "$src/redis.conf" "$d" >"$d/redis.conf"
    # Where this copy keeps its files; the log goes to stdout (our log file).
    printf 'dir %s\nlogfile ""\n' "$d" >>"$d/redis.conf"
  done
  render "$src/replica.conf" "$DIR/meta2" >"$DIR/meta2/replica.conf"
  start meta1 redis-master redis-server "$DIR/meta1/redis.conf"
  wait_for 15 "the redis master answering" answers_ping meta1 "$NET.10"
  start meta2 redis-replica redis-server "$DIR/meta2/replica.conf"
  # ROLE on a synchronised replica: slave, master ip, port, "connected".
  wait_for 20 "the replica synchronising" role_connected meta2 "$NET.11"
  for i in 1 2 3; do
    h=meta$i
    render "$src/sentinel-$i.conf" "$DIR/$h" >"$DIR/$h/sentinel.conf"
    printf 'dir %s\nlogfile ""\n' "$DIR/$h" >>"$DIR/$h/sentinel.conf"
    start "$h" "sentinel-$i" redis-sentinel "$DIR/$h/sentinel.conf"
  done
  wait_for 30 "three sentinels agreeing on $MASTER" quorum
}

# Redis Cluster (SXLC_STORE=cluster): nodes HOST:PORT, masters first, so
# that redis-cli puts each replica on another host than its master.
CLUSTER_NODES() {
  echo "meta1:$NET.10:7001 meta2:$NET.11:7001 meta3:$NET.23:7001" \
    "meta1:$NET.10:7002 meta2:$NET.11:7002 meta3:$NET.23:7002"
}
# redis-cli as the cluster's admin user (deploy/redis-cluster/users.acl).
ccli() {
  local h=$1
  shift
  REDISCLI_AUTH=$CLUSTER_PW on "$h" redis-cli --user sx-cluster-admin --no-auth-warning "$@"
}
cluster_ok() { ccli meta1 -h "$NET.10" -p 7001 cluster info | grep -q '^cluster_state:ok'; }
cluster_answers() { ccli "$1" -h "$2" -p "$3" ping | grep -qx PONG; }
# node_role_is ROLE HOST ADDR PORT: ROLE's first line is ROLE (master, slave).
node_role_is() { [ "$(ccli "$2" -h "$3" -p "$4" role | head -n1)" = "$1" ]; }

cluster_up() {
  local src="$repo/deploy/redis-cluster" n h a p d addrs=""
  for n in $(CLUSTER_NODES); do
    h=${n%%:*}
    a=${n#*:}
    p=${a#*:}
    a=${a%:*}
    d="$DIR/$h/redis-$p"
    mkdir -p "$d"
    sed -e "s#^bind BIND#bind $a#; s#^port PORT#port $p#; s#DIR#$d#g" \
        -e "s/REPLICA-PASSWORD/$REPLICA_PW/g" -e 's#^logfile .*#logfile ""#' \
        "$src/node.conf" >"$d/redis.conf"
    sed -e "s/AGENT-PASSWORD/$AGENT_PW/; s/READER-PASSWORD/$READER_PW/" \
        -e "s/ADMIN-PASSWORD/$ADMIN_PW/; s/REPLICA-PASSWORD/$REPLICA_PW/" \
        -e "s/CLUSTER-PASSWORD/$CLUSTER_PW/" "$src/users.acl" >"$d/users.acl"
    start "$h" "redis-$h-$p" redis-server "$d/redis.conf"
    addrs="$addrs $a:$p"
  done
  for n in $(CLUSTER_NODES); do
    a=${n#*:}
    wait_for 15 "redis node $a answering" cluster_answers "${n%%:*}" "${a%:*}" "${a#*:}"
  done
  # shellcheck disable=SC2086
  ccli meta1 --cluster create $addrs --cluster-replicas 1 --cluster-yes \
    >>"$DIR/logs/cluster-create.log" 2>&1 || die "redis-cli --cluster create failed"
  wait_for 30 "the cluster being ok" cluster_ok
}

ETCD_ENDPOINTS() { echo "http://$NET.51:2379,http://$NET.52:2379,http://$NET.53:2379"; }
etcd_healthy() {
  ETCDCTL_API=3 on client etcdctl --endpoints="$(ETCD_ENDPOINTS)" endpoint health
}

# The three members of deploy/etcd, one per meta host.
etcd_up() {
  local i h
  for i in 1 2 3; do
    h=meta$i
    mkdir -p "$DIR/$h/etcd"
    sed -e "s#/var/lib/etcd/segxfer#$DIR/$h/etcd#" -e "s/10\.0\.0\./$NET./g" \
      "$repo/deploy/etcd/etcd-$i.env" >"$DIR/$h/etcd.env"
    # The same variables Debian's etcd.service reads from /etc/default/etcd.
    start "$h" "etcd-$i" sh -c "set -a; . '$DIR/$h/etcd.env'; exec etcd"
  done
  wait_for 30 "the etcd cluster being healthy" etcd_healthy
}

agents_up() {
  local i h
  for i in 0 1; do
    h=node$((i + 1))
    SX_METADATA_URL=$AGENT_URL start "$h" "sx-agent-$h" "$BIN/sx-agent" \
      --name "prefill-$i/tp0" --listen "$(addrs "$h"):7400" \
      --metrics-listen "$(addrs "$h"):9464" --layers 8 --block-bytes 64K \
      --pool-size 64M --fingerprint lc-llama/v1 --dtype bf16 --tag NHD \
      --fill $((42 + i)) --lease-ms "$LEASE_MS" --label role=prefill --label "host=$h"
  done
  for h in node1 node2; do
    wait_for 30 "sx-agent on $h being ready" http_get "http://$(addrs "$h"):9464/ready"
  done
  if [ "$ETCD" = 1 ]; then
    # A third pool, on node1, published through the etcd cluster instead.
    SX_METADATA_URL=$ETCD_URL start node1 sx-agent-etcd "$BIN/sx-agent" \
      --name etcd-pool/tp0 --listen "$NET.31:7401" --metrics-listen "$NET.31:9465" \
      --layers 4 --block-bytes 64K --pool-size 16M --fingerprint lc-llama/v1 \
      --fill 44 --lease-ms "$LEASE_MS" --label store=etcd
    wait_for 30 "the etcd-backed sx-agent being ready" http_get "http://$NET.31:9465/ready"
  fi
}

up() {
  need
  if [ -n "$(ours)" ]; then
    die "a cluster with prefix $PREFIX is up already (deploy/local-cluster.sh down removes it)"
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR/logs"
  chmod 700 "$DIR"
  {
    echo "AGENT_PW=$(rand)"
    echo "READER_PW=$(rand)"
    echo "ADMIN_PW=$(rand)"
    echo "REPLICA_PW=$(rand)"
    echo "SENTINEL_PW=$(rand)"
    echo "SENTINEL_CLIENT_PW=$(rand)"
    echo "CLUSTER_PW=$(rand)"
  } >"$DIR/secrets"
  chmod 600 "$DIR/secrets"
  load_secrets
  say "network: namespaces $(ns sw) (bridge) and $(for h in $HOSTS; do printf '%s ' "$(ns "$h")"; done)"
  net_up
  maybe_fail net
  if [ "$STORE" = cluster ]; then
    say "store: Redis Cluster, masters $NET.10:7001, $NET.11:7001, $NET.23:7001, replicas on :7002 (deploy/redis-cluster configs)"
    cluster_up
  else
    say "store: redis master $NET.10, replica $NET.11, sentinels $NET.21-23 (deploy/redis configs)"
    store_up
  fi
  if [ "$ETCD" = 1 ]; then
    say "etcd: members $NET.51-53 (deploy/etcd configs)"
    etcd_up
  fi
  maybe_fail store
  say "agents: prefill-0/tp0 on $NET.31, prefill-1/tp0 on $NET.32"
  agents_up
  maybe_fail agents
  say "cluster $PREFIX is up: deploy/local-cluster.sh exec client sxctl ls"
}

# ------------------------------------------------------------------ demo

topology() {
  local h
  for h in $HOSTS; do
    printf '  %-7s %s\n' "$h" "$(ip -n "$(ns "$h")" -br -4 addr show dev eth0 | awk '{$1=$2=""; print}')"
  done
}

master_addr() { scli meta1 -h "$NET.21" -p 26379 sentinel get-master-addr-by-name "$MASTER" | head -n1; }

# After a failover: node1's reconnects and republishes, the listing, and a
# verified read.
after_failover() {
  local m reconnects republishes
  m=$(http_get "http://$NET.31:9464/metrics")
  reconnects=$(echo "$m" | awk '/^segxfer_store_reconnects_total /{print $2}')
  republishes=$(echo "$m" | awk '/^segxfer_republishes_total /{print $2}')
  say "node1: store reconnects $reconnects, republishes $republishes, still published"
  sxctl ls
  sxctl read prefill-0/tp0 --blocks random:100 --verify 42
}

sentinel_failover_demo() {
  local h
  step "6. Sentinel failover: the replica on meta2 becomes master; the agents follow"
  say "master before: $(master_addr)"
  scli meta1 -h "$NET.21" -p 26379 sentinel failover "$MASTER"
  wait_for 60 "the sentinels naming $NET.11 master" master_is "$NET.11"
  say "master after:  $(master_addr)"
  for h in node1 node2; do
    wait_for 30 "sx-agent on $h reconnecting to the new master" reconnected "$h"
    wait_for 30 "sx-agent on $h being ready again" http_get "http://$(addrs "$h"):9464/ready"
  done
  # The old master rejoins as a replica of the new one (it authenticates
  # with masteruser/masterauth from redis.conf).
  wait_for 60 "the old master resynchronising as a replica" role_connected meta1 "$NET.10"
  say "old master $NET.10: now a replica of $NET.11"
  # 0 republishes: the agent moved on +switch-master and renewed on the new
  # master before its lease ran out there.
  after_failover
}

# The address (ip:port) of a replica of meta1's master, as that master
# sees it; fails while it knows none.
meta1_replica() {
  local rep
  rep=$(ccli meta1 -h "$NET.10" -p 7001 cluster replicas \
          "$(ccli meta1 -h "$NET.10" -p 7001 cluster myid)" | awk '{print $2; exit}')
  [ -n "$rep" ] && echo "${rep%@*}"
}

# replica_known_to_masters IP:PORT: each master's CLUSTER NODES lists it as
# a replica.
replica_known_to_masters() {
  local n h a
  for n in $(CLUSTER_NODES); do
    h=${n%%:*}
    a=${n#*:}
    case $a in *:7001) ;; *) continue ;; esac
    ccli "$h" -h "${a%:*}" -p "${a#*:}" cluster nodes |
      awk -v r="$1" '{ split($2, x, "@") } x[1] == r && $3 ~ /slave/ { ok = 1 } END { exit !ok }' ||
      return 1
  done
}

# failover_to HOST IP:PORT: CLUSTER FAILOVER on that replica until it is a
# master.  A manual failover that loses its vote times out after 5 s on the
# server and is not retried there, so it is asked again (3 tries).
failover_to() {
  local h=$1 rep=$2 try i
  for try in 1 2 3; do
    ccli "$h" -h "${rep%:*}" -p "${rep#*:}" cluster failover
    for i in $(seq 100); do
      node_role_is master "$h" "${rep%:*}" "${rep#*:}" && return 0
      sleep 0.1
    done
    say "the failover to $rep did not happen within 10 s (try $try of 3)"
  done
  die "$rep being a master did not happen after 3 tries (logs: $DIR/logs)"
}

# The replica of the master on meta1 takes over (CLUSTER FAILOVER, as an
# operator does for maintenance); the agents follow the slot map.
cluster_failover_demo() {
  local h rep
  step "6. Redis Cluster failover: the replica of meta1's master takes over; the agents follow"
  # A cluster just created is "ok" before every node learned, by gossip,
  # which nodes replicate it: the master may list its replica as a master
  # for a moment.
  wait_for 30 "a replica of $NET.10:7001 known to it" meta1_replica
  ccli meta1 -h "$NET.10" -p 7001 cluster nodes | awk '{print "  " $2, $3}'
  rep=$(meta1_replica) || die "no replica of $NET.10:7001"
  say "replica $rep takes over from $NET.10:7001"
  h=meta2
  case $rep in "$NET.23":*) h=meta3 ;; "$NET.10":*) h=meta1 ;; esac
  # The other masters vote on the failover, and one that still takes the
  # replica for a master denies its vote ("it is a master node"): wait until
  # every master knows it as a replica.
  wait_for 30 "every master knowing $rep as a replica" replica_known_to_masters "$rep"
  failover_to "$h" "$rep"
  wait_for 30 "$NET.10:7001 being a replica" node_role_is slave meta1 "$NET.10" 7001
  wait_for 30 "the cluster being ok again" cluster_ok
  ccli meta1 -h "$NET.10" -p 7001 cluster nodes | awk '{print "  " $2, $3}'
  for h in node1 node2; do
    wait_for 30 "sx-agent on $h being ready" http_get "http://$(addrs "$h"):9464/ready"
  done
  after_failover
}

demo() {
  local t0 t1 reconnects
  t0=$(date +%s.%N)
  step "1. up: six hosts on one bridge, Redis with Sentinel, two sx-agents"
  up
  topology

  if [ "$ETCD" = 1 ]; then
    say "etcd (deploy/etcd), seen from client:"
    ETCDCTL_API=3 on client etcdctl --endpoints="$(ETCD_ENDPOINTS)" endpoint status -w table
    ETCDCTL_API=3 on client etcdctl --endpoints="$(ETCD_ENDPOINTS)" endpoint health
  fi

  step "2. sxctl ls on client ($NET.41), as the read-only ACL user"
  sxctl ls
  if [ "$ETCD" = 1 ]; then
    say "and through etcd: etcd-pool/tp0, read by name and verified"
    SX_METADATA_URL=$ETCD_URL on client "$BIN/sxctl" ls
    SX_METADATA_URL=$ETCD_URL on client "$BIN/sxctl" read etcd-pool/tp0 --blocks all --verify 44
  fi

  step "3. client reads prefill-0/tp0 from node1 by name and verifies every byte"
  sxctl read prefill-0/tp0 --blocks random:200 --batch 32 --verify 42 \
    --fingerprint lc-llama/v1 --dtype bf16 --tag NHD
  sxctl read prefill-1/tp0 --blocks 0-63 --verify 43

  step "4. sxctl ping: round trips from client to node2"
  sxctl ping prefill-1/tp0 --count 3

  step "5. node1's metrics, scraped from client"
  http_get "http://$NET.31:9464/metrics" |
    grep -E '^segxfer_(ready|served_bytes_total\{transport="tcp"\}|served_reads_total\{transport="tcp"\}|lease_renewals_total|store_up) '
  http_get "http://$NET.31:9464/ready"

  if [ "$STORE" = cluster ]; then
    cluster_failover_demo
  else
    sentinel_failover_demo
  fi

  step "7. node2's agent is killed (SIGKILL): its segment disappears when the lease ($LEASE_MS ms) runs out"
  local pids
  pids=$(ip netns pids "$(ns node2)")
  kill -KILL $pids
  t1=$(date +%s.%N)
  wait_for 30 "prefill-1/tp0 expiring" not_found prefill-1/tp0
  awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "prefill-1/tp0 gone %.1f s after the kill\n", b - a }'
  sxctl ls

  step "8. down: agents unpublish, servers stop, namespaces go"
  teardown
  [ -z "$(ours)" ] || die "namespaces left after down: $(ours)"
  say "removed every namespace and process of $PREFIX"
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "\nlocal cluster demo finished in %.1f s\n", b - a }'
}

status() {
  local n
  [ -n "$(ours)" ] || { say "no cluster with prefix $PREFIX"; return 0; }
  for n in $(ours); do
    printf '%-16s %s\n' "$n" "$(ip netns pids "$n" | while read -r p; do
      printf '%s(%s) ' "$(cat "/proc/$p/comm" 2>/dev/null)" "$p"; done)"
  done
  load_secrets
  sxctl ls
}

on_failure() {
  local rc=$?
  trap - EXIT INT TERM
  # A signal may land while a wait_for condition runs with its output sent
  # to /dev/null, and this trap inherits that: write to the saved stderr.
  if [ $rc -ne 0 ] && [ -d "$DIR/logs" ]; then
    for f in "$DIR"/logs/*.log; do
      [ -s "$f" ] || continue
      printf -- '--- %s (last lines)\n' "$(basename "$f")" >&3
      tail -n 15 "$f" >&3
    done
  fi
  teardown
  [ $rc -ne 0 ] && printf 'local-cluster: failed (exit %d); everything it started is removed\n' "$rc" >&3
  exit $rc
}

exec 3>&2

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  up)
    # Torn down if it fails half way; left running when it succeeds.
    trap on_failure EXIT
    trap 'exit 130' INT TERM
    up
    trap - EXIT INT TERM
    ;;
  demo)
    trap on_failure EXIT
    trap 'exit 130' INT TERM
    demo
    ;;
  down)
    [ "$(id -u)" = 0 ] || die "needs root"
    teardown
    say "cluster $PREFIX: down"
    ;;
  status)
    status
    ;;
  exec)
    [ $# -ge 2 ] || die "usage: deploy/local-cluster.sh exec HOST CMD..."
    h=$1
    shift
    case " $HOSTS " in *" $h "*) ;; *) die "no host '$h' (hosts: $HOSTS)" ;; esac
    load_secrets
    case ${SXLC_USER:-reader} in
      reader) url=$READER_URL ;;
      admin) url=$ADMIN_URL ;;
      agent) url=$AGENT_URL ;;
      etcd) url=$ETCD_URL ;;
      *) die "SXLC_USER: reader, admin, agent or etcd" ;;
    esac
    SX_METADATA_URL=$url PATH="$BIN:$PATH" on "$h" "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [ -z "$cmd" ] || [ "$cmd" = help ] || [ "$cmd" = -h ] || [ "$cmd" = --help ] || exit 2
    ;;
esac
