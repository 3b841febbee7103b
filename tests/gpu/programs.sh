#!/bin/sh
# GPU suite, the programs: sx-agent hosting its pool on a GPU, sxctl reading
# it into GPU memory (cuda_ipc, then forced tcp through staging) and into
# host memory, every byte verified; ping and show name the transport.  Push
# mode: sxctl write into a writable pool on the GPU over cuda_ipc and over
# staged tcp, read back; a producer without a grant is refused.  sx-bench
# read --location cuda:0 runs both GPU cases to the end (each ends with a
# batch checked byte for byte); so does sx-bench plan --location cuda:0
# over cuda_ipc and staged tcp.
# Usage: tests/gpu/programs.sh BUILD_DIR   (needs redis-server on PATH)
set -u
build=$1
bin=$build/bin
dir=$(mktemp -d)
. "$(dirname "$0")/../support/servers.sh"
fail() { echo "FAIL: $*"; cat "$dir"/agent.log 2>/dev/null | tail -20; exit 1; }
cleanup() {
  [ -n "${apid:-}" ] && kill "$apid" 2>/dev/null && wait "$apid" 2>/dev/null
  [ -n "${wpid:-}" ] && kill "$wpid" 2>/dev/null && wait "$wpid" 2>/dev/null
  sxt_redis_stop
  rm -rf "$dir"
}
trap cleanup EXIT
sxt_redis_start "$dir" --notify-keyspace-events Kx || fail "no redis-server"
port=$sxt_redis_port
export SX_METADATA_URL="redis://127.0.0.1:$port?namespace=gpu-programs"
"$bin/sx-agent" --name pool-gpu --layers 4 --block-bytes 64K --pool-size 256M \
  --location cuda:0 --fill 42 --listen 127.0.0.1:0 >"$dir/agent.log" 2>&1 &
apid=$!
"$bin/sxctl" ping pool-gpu --wait-ms 10000 >/dev/null 2>&1 || true
for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  grep -q "ready: serving" "$dir/agent.log" && break; sleep 0.5
done
grep -q "on cuda:0" "$dir/agent.log" || fail "sx-agent did not put its pool on cuda:0"
step() { echo "+ $*"; "$@" >"$dir/out" 2>&1; rc=$?; cat "$dir/out"; return $rc; }
step "$bin/sxctl" read pool-gpu --location cuda:0 --verify 42 --blocks random:500 ||
  fail "read into cuda:0"
grep -q "via cuda_ipc" "$dir/out" || fail "the read did not go over cuda_ipc"
step "$bin/sxctl" read pool-gpu --location cuda:0 --verify 42 --blocks random:200 \
  --transport tcp || fail "read into cuda:0 over tcp"
grep -q "via tcp" "$dir/out" || fail "forced tcp was not used"
step "$bin/sxctl" read pool-gpu --verify 42 --blocks random:100 || fail "read into host memory"
step "$bin/sxctl" ping pool-gpu || fail "ping"
grep -q "via cuda_ipc" "$dir/out" || fail "ping did not say cuda_ipc"
step "$bin/sxctl" ping pool-gpu --transport tcp || fail "ping over tcp"
grep -q "via tcp" "$dir/out" || fail "ping did not say tcp"
step "$bin/sxctl" show pool-gpu || fail "show"
grep -q "cuda_ipc://" "$dir/out" || fail "show lists no cuda_ipc endpoint"
grep -q "cuda:0" "$dir/out" || fail "show lists no cuda:0 region"
# A wrong seed must not verify.
step "$bin/sxctl" read pool-gpu --location cuda:0 --verify 43 --blocks random:10 &&
  fail "a wrong seed verified"

# Push mode into GPU memory.
"$bin/sx-agent" --name pool-gpu-w --layers 4 --block-bytes 64K --pool-size 64M \
  --location cuda:0 --writable --grant writer --listen 127.0.0.1:0 >"$dir/wagent.log" 2>&1 &
wpid=$!
for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  grep -q "ready: serving" "$dir/wagent.log" && break; sleep 0.5
done
grep -q "on cuda:0" "$dir/wagent.log" || fail "the writable sx-agent did not start on cuda:0"
step "$bin/sxctl" write pool-gpu-w --as writer --fill 7 --blocks 0-49 --verify ||
  fail "write into cuda:0"
grep -q "via cuda_ipc" "$dir/out" || fail "the write did not go over cuda_ipc"
step "$bin/sxctl" write pool-gpu-w --as writer --fill 8 --blocks 50-99 --transport tcp \
  --verify || fail "write into cuda:0 over tcp"
grep -q "via tcp" "$dir/out" || fail "the forced tcp write did not use tcp"
# An unnamed reader gets no handle of a writable allocation: it reads over tcp.
step "$bin/sxctl" read pool-gpu-w --verify 7 --blocks 0-49 || fail "read back what was written"
grep -q "via tcp" "$dir/out" || fail "an unnamed reader of a writable pool did not use tcp"
step "$bin/sxctl" read pool-gpu-w --location cuda:0 --verify 8 --blocks 50-99 ||
  fail "read back into cuda:0 what was written over tcp"
step "$bin/sxctl" write pool-gpu-w --as stranger --fill 9 --blocks 100-109 &&
  fail "a producer without a grant wrote"
grep -q "EACCESS" "$dir/out" || fail "the refused write did not say SX_EACCESS"

step "$bin/sx-bench" read --location cuda:0 --sizes 64K --batches 16 --depth 2 \
  --duration 0.4 --group-bytes 4M || fail "sx-bench read --location cuda:0"
grep -q "^cuda_ipc .* kernel .*gather kernel, 1 proc" "$dir/out" ||
  fail "sx-bench printed no cuda_ipc row copied by the kernel against the one-process gather"
grep -q "^one process .*cuMemcpyAsync/range .* range" "$dir/out" ||
  fail "sx-bench printed no per-range reference row"
grep -q "^tcp .*staged.* host tcp" "$dir/out" || fail "sx-bench printed no staged tcp row"
# The engine shape: requests of 4 blocks in each of 2 layers x K,V.
step "$bin/sx-bench" read --location cuda:0 --transport cuda_ipc --block-bytes 16K \
  --layers 2 --kv 2 --request-blocks 4 --depth 2 --rounds 2 --duration 0.4 \
  --group-bytes 4M || fail "sx-bench read --location cuda:0 (engine shape)"
grep -q "^cuda_ipc .* 16K  *16 " "$dir/out" || fail "sx-bench printed no engine-shape row"
# sx-bench plan with GPU pools: the TP=2 -> TP=1 set and the equal layouts
# over cuda_ipc and over staged tcp, in both cache orders (each case's
# first read is compared byte for byte with the sources: a difference fails
# the run).
for tr in cuda_ipc tcp; do
  for order in NHD HND; do
    step "$bin/sx-bench" plan --location cuda:0 --transport "$tr" --order "$order" --layers 2 \
      --batch 16 --rounds 1 --duration 0.2 --metadata "$SX_METADATA_URL" ||
      fail "sx-bench plan --location cuda:0 --transport $tr --order $order"
    grep -q "^TP=2 -> TP=1 plan .* $order " "$dir/out" ||
      fail "sx-bench plan printed no TP=2 row ($tr, $order)"
    grep -q "read over $tr" "$dir/out" || fail "sx-bench plan did not read over $tr"
  done
done
echo "programs: all checks passed"
