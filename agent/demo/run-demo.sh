#!/usr/bin/env bash
# The `make run` demo: a redis-server on a free loopback port, one sx-agent
# holding a filled KV pool as a segment, and a reader (`sxctl read`) that
# opens it by name, checks the layout, reads a few hundred random blocks in
# batches and verifies every byte; then `sxctl ls` and `sxctl ping`.
# Everything it starts is stopped on exit, failure or Ctrl-C.
#
# Usage: agent/demo/run-demo.sh BUILD_DIR
set -euo pipefail

build=${1:-build}
bin="$build/bin"
for p in sx-agent sxctl; do
  [ -x "$bin/$p" ] || { echo "run-demo: $bin/$p is not built (run make)" >&2; exit 2; }
done
command -v redis-server >/dev/null ||
  { echo "run-demo: redis-server is not installed (make deps installs it)" >&2; exit 2; }

work=$(mktemp -d /tmp/segxfer-demo.XXXXXX)
redis_pid=
agent_pid=
cleanup() {
  set +e
  [ -n "$agent_pid" ] && kill -TERM "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null
  [ -n "$redis_pid" ] && kill -TERM "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo; echo "run-demo: interrupted"; exit 130' INT TERM

if [ -t 1 ]; then
  step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
  step() { printf '\n== %s\n' "$*"; }
fi
t_start=$(date +%s.%N)

step "1. redis-server on a free loopback port"
for attempt in $(seq 20); do
  port=$((20000 + RANDOM % 40000))
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --notify-keyspace-events Kx --dir "$work" --logfile "$work/redis.log" &
  redis_pid=$!
  for _ in $(seq 50); do
    # Ours answers with our pid: a PONG from another server that already held
    # the port (ours then failed to bind and exited) does not count.
    if redis-cli -p "$port" info server 2>/dev/null | grep -q "^process_id:$redis_pid"; then
      break 2
    fi
    kill -0 "$redis_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=
done
[ -n "$redis_pid" ] || { echo "run-demo: could not start redis-server" >&2; exit 1; }
export SX_METADATA_URL="redis://127.0.0.1:$port?namespace=demo"
echo "redis-server pid $redis_pid, SX_METADATA_URL=$SX_METADATA_URL"

name=demo/pool-0
step "2. sx-agent: a 256 MiB KV pool (8 layers x K,V x 64 KiB blocks) filled with pattern 42"
echo "\$ sx-agent --name $name --listen 127.0.0.1:0 --layers 8 --block-bytes 64K \\"
echo "           --pool-size 256M --fingerprint demo-llama/v1 --dtype bf16 --tag NHD --fill 42"
"$bin/sx-agent" --name "$name" --listen 127.0.0.1:0 --layers 8 --block-bytes 64K \
  --pool-size 256M --fingerprint demo-llama/v1 --dtype bf16 --tag NHD --fill 42 \
  --label role=demo --lease-ms 5000 2>"$work/agent.log" &
agent_pid=$!
for _ in $(seq 300); do
  grep -q "ready:" "$work/agent.log" && break
  kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log"; exit 1; }
  sleep 0.1
done
grep -q "ready:" "$work/agent.log" || { cat "$work/agent.log"; echo "run-demo: sx-agent not ready" >&2; exit 1; }
sed 's/^/  agent | /' "$work/agent.log"

step "3. sxctl ls: what the store holds"
"$bin/sxctl" ls

step "4. the second agent, a reader (sxctl read runs one in its own process), opens $name by name, checks the layout, reads 400 random blocks in batches and verifies every byte"
echo "\$ sxctl read $name --blocks random:400 --batch 50 --depth 2 --verify 42 --fingerprint demo-llama/v1 --dtype bf16 --tag NHD"
"$bin/sxctl" read "$name" --blocks random:400 --batch 50 --depth 2 --verify 42 \
  --fingerprint demo-llama/v1 --dtype bf16 --tag NHD

step "5. a reader that expects another layout is refused before anything is read"
echo "\$ sxctl read $name --blocks random:10 --fingerprint demo-llama/v1 --dtype fp8_e4m3"
set +e
"$bin/sxctl" read "$name" --blocks random:10 --fingerprint demo-llama/v1 --dtype fp8_e4m3
rc=$?
set -e
echo "(exit status $rc: incompatible)"
[ "$rc" = 1 ] || { echo "run-demo: the incompatible read should exit 1" >&2; exit 1; }

step "6. sxctl ping: round trips to the segment's owner"
"$bin/sxctl" ping "$name" --count 3

step "7. SIGTERM: the agent unpublishes at once"
kill -TERM "$agent_pid"
wait "$agent_pid"
agent_pid=
tail -n 3 "$work/agent.log" | sed 's/^/  agent | /'
"$bin/sxctl" ls

t_end=$(date +%s.%N)
awk -v a="$t_start" -v b="$t_end" 'BEGIN { printf "\ndemo finished in %.1f s\n", b - a }'
