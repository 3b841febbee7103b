"""The Python binding against the C API, in one run (part of `make bench`).

An sx-agent holds a pool of 64 KiB blocks; the same batches of 256
scattered blocks (random remote ids, shuffled local ids) are read through
the C API (tests/python/bench_read.c, its own process) and through the
Python package (this process), in alternating rounds so both see the same
machine.  Each side makes its own reader agent per round and connects with
one untimed batch.  The target: Python reaches at least 0.95x the C
throughput (the binding adds no per-block cost).

It also reports the time each side spends outside the wait per batch
(building the batch from the ids, submitting, reading the result,
destroying): the binding's own cost, free of the network's noise.

Usage: /usr/bin/python3 tests/python/bench.py BUILD_DIR [--batches N] [--rounds R]
                                             [--target-location cuda:0]
--target-location puts the sx-agent's pool on a GPU (served over TCP through
pinned staging); both readers still read into host memory.
Writes BUILD_DIR/bench/python.txt and python.csv; appends its verdict to
BUILD_DIR/bench/summary.txt when that exists.
"""
import argparse
import array
import mmap
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BLOCK, N, POOL, TARGET = 64 * 1024, 256, 1024, 0.95


def python_run(url, name, batches):
    import segxfer
    mem = mmap.mmap(-1, N * BLOCK)   # page-aligned, as the C side's aligned_alloc
    with segxfer.Agent(None, url, log_level="warn") as agent:
        agent.register(mem, slot="K", block_bytes=BLOCK)
        with agent.open(name) as seg:
            with seg.read_blocks(*batches[0]) as b:      # connect
                b.wait()
                b.result().raise_for_state()
            total, calls = 0, 0.0
            t0 = time.monotonic()
            for remote, local in batches:
                c0 = time.monotonic()
                b = seg.read_blocks(remote, local)
                c1 = time.monotonic()
                b.wait()
                c2 = time.monotonic()
                r = b.result()
                b.close()
                calls += (c1 - c0) + (time.monotonic() - c2)
                if not r.ok:
                    r.raise_for_state()
                total += r.bytes
            return time.monotonic() - t0, total, calls


def c_run(exe, url, name, ids_file):
    out = subprocess.run([exe, url, name, ids_file], check=True, capture_output=True,
                         text=True).stdout.split()
    return float(out[0]), int(out[1]), float(out[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-location", default="cpu")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    os.environ.setdefault("SEGXFER_LIB", os.path.join(build, "lib", "libsegxfer.so"))
    os.environ.setdefault("SEGXFER_BUILD", build)
    from harness import RedisServer, SxAgentProc  # noqa: E402
    import pathlib

    exe = os.path.join(build, "tests", "python", "bench_read")
    rng = random.Random(42)
    batches = []
    for _ in range(args.batches):
        remote = rng.sample(range(POOL), N)
        local = list(range(N))
        rng.shuffle(local)
        batches.append((remote, local))
    out_dir = os.path.join(build, "bench")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        ids_file = os.path.join(d, "ids.bin")
        flat = array.array("Q", [N, args.batches, BLOCK])
        for remote, local in batches:
            flat.extend(remote)
            flat.extend(local)
        with open(ids_file, "wb") as f:
            flat.tofile(f)
        redis = RedisServer(pathlib.Path(d))
        url = "redis://127.0.0.1:%d?namespace=bench-py" % redis.port
        target = SxAgentProc(url, "bench/pool-0", blocks=POOL, block_bytes=BLOCK, layers=1,
                             extra=("--slots", "K", "--location", args.target_location))
        try:
            for rnd in range(args.rounds):
                order = ("c", "python") if rnd % 2 == 0 else ("python", "c")
                for side in order:
                    if side == "c":
                        secs, total, calls = c_run(exe, url, "bench/pool-0", ids_file)
                    else:
                        secs, total, calls = python_run(url, "bench/pool-0", batches)
                    rows.append((rnd, side, secs, total, total / secs / 1e9,
                                 secs / args.batches * 1e6, calls / args.batches * 1e6))
        finally:
            target.stop()
            redis.stop()
    gbs = {s: statistics.median(r[4] for r in rows if r[1] == s) for s in ("c", "python")}
    ratio = gbs["python"] / gbs["c"]
    verdict = "MET" if ratio >= TARGET else "MISSED"
    lines = ["python binding vs C API: %d batches of %d scattered %d KiB blocks per run, "
             "%d rounds, TCP loopback (sx-agent target, pool in %s memory)"
             % (args.batches, N, BLOCK // 1024, args.rounds, args.target_location),
             "%-6s %-7s %9s %9s %10s %18s" % ("round", "side", "seconds", "GB/s", "us/batch",
                                              "us/batch in calls")]
    for rnd, side, secs, _, g, us, cus in rows:
        lines.append("%-6d %-7s %9.3f %9.3f %10.1f %18.1f" % (rnd, side, secs, g, us, cus))
    summary = ("python/C throughput (medians): %.3f / %.3f GB/s = %.3fx (target >= %.2fx): %s"
               % (gbs["python"], gbs["c"], ratio, TARGET, verdict))
    calls = {s: statistics.median(r[6] for r in rows if r[1] == s) for s in ("c", "python")}
    lines.append("outside the wait (build, submit, result, destroy), medians: C %.1f us, "
                 "Python %.1f us per batch of %d blocks" % (calls["c"], calls["python"], N))
    lines.append(summary)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(os.path.join(out_dir, "python.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "python.csv"), "w") as f:
        f.write("round,side,seconds,bytes,gb_per_s,us_per_batch,us_per_batch_in_calls\n")
        for r in rows:
            f.write("%d,%s,%.6f,%d,%.4f,%.1f,%.1f\n" % r)
    summary_file = os.path.join(out_dir, "summary.txt")
    if os.path.exists(summary_file):
        with open(summary_file, "a") as f:
            f.write(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
