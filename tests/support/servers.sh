# Sourced by shell tests: loopback ports, and a redis-server of the test's
# own, that no other test running beside it can take.
#
# sxt_free_port: a port the kernel gave out just now and nobody listens on
# (bound, then closed: whoever binds next gets it, so check that the
# server on it is yours).
#
# sxt_redis_start DIR [redis-server options...]: starts one with its files in
# DIR, logging to DIR/redis.log; sets sxt_redis_port and sxt_redis_pid, or
# returns 1 saying why.  The port comes from the kernel (bound, then closed),
# so another server may take it before redis-server binds it: tests run
# beside each other.  So the server counts as up only once the process on
# the port answers with this pid (INFO server), and a start that lost the
# race tries another port.
# sxt_redis_stop: stops it (idempotent).
sxt_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $((20000 + $(od -An -N2 -tu2 /dev/urandom) % 12000))
}

sxt_redis_start() {
  _dir=$1
  shift
  sxt_redis_pid=
  for _try in 1 2 3 4 5; do
    sxt_redis_port=$(sxt_free_port)
    redis-server --port "$sxt_redis_port" --bind 127.0.0.1 --save '' --appendonly no \
      --dir "$_dir" "$@" >"$_dir/redis.log" 2>&1 &
    sxt_redis_pid=$!
    for _ in $(seq 1 50); do
      kill -0 "$sxt_redis_pid" 2>/dev/null || break
      if redis-cli -p "$sxt_redis_port" info server 2>/dev/null |
          grep -q "^process_id:$sxt_redis_pid.$"; then
        return 0
      fi
      sleep 0.1
    done
    kill "$sxt_redis_pid" 2>/dev/null
    wait "$sxt_redis_pid" 2>/dev/null
  done
  sxt_redis_pid=
  echo "redis-server did not start on a free port in 5 tries; its log:" >&2
  tail -n 5 "$_dir/redis.log" >&2
  return 1
}

sxt_redis_stop() {
  [ -n "${sxt_redis_pid:-}" ] || return 0
  kill "$sxt_redis_pid" 2>/dev/null
  wait "$sxt_redis_pid" 2>/dev/null
  sxt_redis_pid=
}
