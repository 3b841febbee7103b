#!/usr/bin/env python3
"""How fast the kernel's TCP receive copy is into a small buffer (stays in
cache) and into a large one (does not), on loopback, one connection: the
effect behind sx-bench read's raw-stream baseline at 1 MiB blocks and many
bytes in flight (docs/benchmarks.md, issue 21 item 6; sx-bench read
--stream-bytes).  A thread sends 1 MiB chunks of a 64 MiB buffer; this one
receives them round a ring of each size in turn, 2 s each, ROUNDS times.

Usage: tests/bench/cold_dst.py [ROUNDS] [MiB,...]   (default 3, 16,256,1024)
"""
import socket
import sys
import threading
import time

MIB = 1 << 20


def serve(listener):
    conn, _ = listener.accept()
    src = memoryview(bytearray(64 * MIB))
    try:
        while True:
            for off in range(0, 64 * MIB, MIB):
                conn.sendall(src[off:off + MIB])
    except OSError:
        pass  # the receiver closed: done


def rate(ring_mib, secs=2.0):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    s = socket.create_connection(listener.getsockname())
    ring = bytearray(ring_mib * MIB)
    for i in range(0, len(ring), 4096):
        ring[i] = 1  # populated, as an engine's KV cache is
    view = memoryview(ring)
    off = got = 0
    t0 = time.time()
    while time.time() - t0 < secs:
        n = s.recv_into(view[off:off + MIB], MIB)
        if n == 0:
            raise SystemExit("cold_dst.py: the sender closed")
        got += n
        off += n
        if len(ring) - off < MIB:
            off = 0
    dt = time.time() - t0
    s.close()
    listener.close()
    return got / dt / 1e9


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 256, 1024]
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"loopback TCP, one connection, 1 MiB recv_into() round a ring; load {load}")
    for r in range(rounds):
        print("round %d: " % (r + 1) + "   ".join("%5d MiB %.2f GB/s" % (m, rate(m)) for m in sizes),
              flush=True)


if __name__ == "__main__":
    main()
