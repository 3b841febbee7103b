"""Cancel, deadlines, closing in every order and from other threads, and
leaks: after close no fd and no thread is left behind."""
import asyncio
import gc
import os
import signal
import time
import threading

import pytest

import segxfer
from conftest import LAYOUT, READER_BLOCKS, Pair, cancel_while_awaited, register_kv


def fds():
    return sorted(int(x) for x in os.listdir("/proc/self/fd"))


def threads():
    return len(os.listdir("/proc/self/task"))


def start_readers(n, reads, errors):
    """n threads running reads(i); any exception (wrong bytes included) is
    kept in errors, so a thread cannot die unnoticed."""
    def run(i):
        try:
            reads(i)
        except BaseException as e:
            errors.append(repr(e))
    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    return ths


def join_readers(ths):
    for t in ths:
        t.join(15)
    assert not any(t.is_alive() for t in ths), "a reading thread hung"


def test_lifecycle_cancel_a_running_batch(stuck):
    seg, _ = stuck
    b = seg.read_blocks([1, 2, 3], [1, 2, 3], timeout=30)
    assert not b.done() and not b.wait(0.1)
    with pytest.raises(segxfer.SX_EBUSY, match="not ended"):
        b.result()
    b.cancel()
    assert b.wait(5) and b.done()
    res = b.result()
    assert res.state == "CANCELLED" and res.error_name == "SX_ECANCELED"
    with pytest.raises(segxfer.SX_ECANCELED):
        res.raise_for_state()
    b.cancel()   # after the end: a no-op
    b.close()


def test_lifecycle_deadline_ends_the_batch(stuck):
    seg, _ = stuck
    b = seg.read_blocks([1], [1], timeout=0.2)
    assert b.wait(5)
    assert b.result().state == "TIMEOUT" and b.result().error_name == "SX_ETIMEDOUT"
    b.close()


def test_lifecycle_close_while_another_thread_waits(stuck):
    seg, target = stuck
    b = seg.read_blocks([4], [4], timeout=30)
    got = []
    t = threading.Thread(target=lambda: got.append(b.wait()))
    t.start()
    while not b._h._users:          # the waiter is inside sx_batch_wait
        pass
    b.close()                        # cancels, lets the waiter out, destroys
    t.join(5)
    assert not t.is_alive() and got == [True]
    assert b.result().state == "CANCELLED"


def test_lifecycle_agent_close_ends_everything_below_it(stuck, reader):
    seg, _ = stuck
    running = seg.read_blocks([5], [5], timeout=30)
    fresh = seg.batch()
    reader.close()       # batches, then the segment, then the agent
    assert running.result().state == "CANCELLED"
    for call in (fresh.submit, seg.check, lambda: reader.open("x")):
        with pytest.raises(segxfer.SX_EINVAL, match="closed"):
            call()


@pytest.mark.parametrize("closing", ["segment", "target", "reader"])
def test_lifecycle_close_under_reading_threads(url, closing):
    """Four threads read on one segment, each into blocks of its own,
    while another thread closes the segment, the target agent or the
    reader agent under them: no thread hangs or crashes, every read that
    completed holds the target's bytes, and every other one ends with a
    segxfer error or a batch state, never another exception."""
    p = Pair(url, name="race-0")
    seg = p.reader.open("race-0")
    stop, seen, lock, errors = threading.Event(), {}, threading.Lock(), []

    def reads(i):
        local = list(range(4 * i, 4 * i + 4))
        k = 0
        while not stop.is_set():
            remote = [(7 * k + 3 * j + i) % 32 for j in range(4)]
            k += 1
            try:
                b = seg.read_blocks(remote, local, timeout=5.0)
                b.wait()
                state = b.result().state
                if state == "COMPLETED":
                    p.expect(remote, local)
                b.close()
            except segxfer.SegxferError as e:
                state = type(e).__name__
            with lock:
                seen[state] = seen.get(state, 0) + 1

    ths = start_readers(4, reads, errors)
    time.sleep(0.2)
    {"segment": seg, "target": p.target, "reader": p.reader}[closing].close()
    time.sleep(0.1)
    stop.set()
    join_readers(ths)
    seg.close()
    p.close()
    assert errors == []
    assert seen.get("COMPLETED", 0) > 0, seen
    assert set(seen) <= {"COMPLETED", "FAILED", "CANCELLED", "SX_EINVAL", "SX_EDISCONN",
                         "SX_ECANCELED"}, seen


def test_lifecycle_reads_while_the_owner_restarts(url):
    """Four threads open the name, read and close, while its owner restarts
    again and again: each life a new agent (new incarnation, new port, new
    bytes), published for 20-150 ms, then closed.  A read that completes
    holds the bytes of exactly the life whose descriptor its segment
    opened, never another's (the incarnation fences it); every other read
    or open ends with a segxfer error; nothing hangs."""
    from conftest import LAYERS, TARGET_BLOCKS, block, stamp
    reader = segxfer.Agent(None, url, log_level="error", **LAYOUT)
    rmem = register_kv(reader, READER_BLOCKS)
    seeds, lock, errors, seen = {}, threading.Lock(), [], {}
    stop = threading.Event()

    def count(what):
        with lock:
            seen[what] = seen.get(what, 0) + 1

    def reads(i):
        local, k = list(range(4 * i, 4 * i + 4)), 0
        while not stop.is_set():
            try:
                seg = reader.open("owner", timeout=0.5)
            except segxfer.SegxferError as e:
                count("open " + type(e).__name__)
                time.sleep(0.005)
                continue
            with seg:
                with lock:
                    seed = seeds[seg.descriptor()["incarnation"]]
                for _ in range(3):
                    remote = [(5 * k + 3 * j + i) % TARGET_BLOCKS for j in range(4)]
                    k += 1
                    try:
                        b = seg.read_blocks(remote, local, timeout=5.0)
                        assert b.wait(10), "a batch did not end within 10 s"
                        b.result().raise_for_state()
                    except segxfer.SegxferError as e:
                        count(type(e).__name__)
                        break
                    for si in range(2):  # K, V (register_kv: seed, seed + 1)
                        for layer in range(LAYERS):
                            for rb, lb in zip(remote, local):
                                assert block(rmem[si], READER_BLOCKS, layer, lb) == \
                                    stamp(seed + si, layer, rb), \
                                    "block %d of layer %d: not the bytes of the opened life" % \
                                    (rb, layer)
                    count("COMPLETED")

    ths = start_readers(4, reads, errors)
    lives, end = 0, time.monotonic() + 3.0
    while time.monotonic() < end:
        lives += 1
        owner = segxfer.Agent("owner", url, lease_ms=2000, log_level="error", **LAYOUT)
        seed = (17 * lives) % 200
        register_kv(owner, TARGET_BLOCKS, seed)
        with lock:
            seeds[owner.incarnation] = seed
        owner.publish()
        time.sleep(0.02 + 0.13 * (lives % 4) / 3)
        owner.close()
    stop.set()
    join_readers(ths)
    reader.close()
    assert errors == []
    assert lives >= 5 and seen.get("COMPLETED", 0) > 0, (lives, seen)
    assert set(seen) <= {"COMPLETED", "SX_EDISCONN", "SX_EUNREACH", "SX_ENOENT", "SX_ESTALE",
                         "open SX_ENOENT", "open SX_ETIMEDOUT"}, seen


def test_lifecycle_objects_dropped_in_any_order(url):
    p = Pair(url, name="gc-0")
    seg = p.reader.open("gc-0")
    b = seg.read_blocks([1], [1])
    # Drop the parents first: children keep them alive, nothing is freed early.
    reader = p.reader
    del p.reader, seg
    gc.collect()
    assert b.wait(5) and b.result().ok
    del b
    gc.collect()
    assert reader._h.children == set()
    reader.close()
    p.target.close()


def _round(url, n):
    """Everything the package makes, closed or dropped again."""
    p = Pair(url, name="leak-%d" % n)
    with p.reader.open(p.name) as seg:
        seg.check()
        seg.read_blocks([1, 2], [1, 2]).wait()          # dropped, not closed

        async def main():
            bs = [seg.read_blocks([i], [i]) for i in range(4)]
            await asyncio.gather(*bs)
            for x in bs:
                x.close()
        asyncio.run(main())
        with seg.batch() as b:
            b.fileno()
    # A cancelled batch on a stuck peer.
    p.close()
    gc.collect()


def test_lifecycle_no_fd_or_thread_left_after_close(url, sx_agent):
    _round(url, 0)             # warm-up: one-time threads and caches
    fd0, th0 = fds(), threads()
    for n in range(1, 4):
        _round(url, n)
    target = sx_agent("stuck-leak")
    with segxfer.Agent(None, url, log_level="error", **LAYOUT) as r:
        register_kv(r, READER_BLOCKS)
        seg = r.open("stuck-leak")
        target.pause()
        cancel_while_awaited(seg.read_blocks([1], [1], timeout=30))
    target.stop()
    gc.collect()
    assert fds() == fd0
    assert threads() == th0


def test_lifecycle_fork_child_refuses_the_parents_agent(pair):
    """A forked child (multiprocessing's fork, a DataLoader worker) inherits
    the agent but not its thread: using it raises at once instead of waiting
    forever for that thread, and the child's exit (atexit, collection)
    leaves the parent's agent, segment and batches alone."""
    seg = pair.reader.open(pair.name)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report each call's outcome, then exit as Python does
        os.close(rfd)
        out = []
        for call in (pair.target.status, lambda: pair.reader.open(pair.name),
                     lambda: seg.read_blocks([1], [1]), lambda: pair.target.incarnation):
            try:
                call()
                out.append("returned")
            except segxfer.SX_EINVAL as e:
                out.append("EINVAL" if "fork()" in str(e) else str(e))
            except BaseException as e:  # noqa: B902  (anything else is a failure)
                out.append(repr(e))
        seg.close()
        segxfer.agent._close_live_agents()   # what the child's atexit runs
        os.write(wfd, ",".join(out).encode())
        os._exit(0)
    os.close(wfd)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung using the parent's agent")
        time.sleep(0.05)
    with os.fdopen(rfd, "rb") as f:
        assert f.read().decode() == "EINVAL,EINVAL,EINVAL,EINVAL"
    # The parent's objects work on: still published, still readable.
    assert pair.target.status()["state"] == "PUBLISHED"
    b = seg.read_blocks([1, 2], [3, 4])
    assert b.wait(10) and b.result().ok
    pair.expect([1, 2], [3, 4])
    seg.close()


def test_lifecycle_child_made_while_its_parent_closes():
    """A child handle is made inside its parent's `with` block (the C call
    that creates it, then the Handle).  A close() of the parent that starts
    meanwhile waits for that block, then closes the new child before the
    parent: the C library frees children with their parent, so a child
    left open would later be used or destroyed after the parent's free."""
    from segxfer._handle import Handle
    destroyed = []
    parent = Handle(1, lambda p: destroyed.append(("parent", p)), "the parent")
    inside, go = threading.Event(), threading.Event()

    def make_child():
        with parent:
            inside.set()
            go.wait(10)
            Handle(2, lambda p: destroyed.append(("child", p)), "the child", parent)

    maker = threading.Thread(target=make_child)
    maker.start()
    assert inside.wait(10)
    closer = threading.Thread(target=parent.close)
    closer.start()
    deadline = time.monotonic() + 10
    while not parent.closed:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(segxfer.SX_EINVAL, match="the parent is closed"):
        with parent:
            pass
    assert destroyed == []  # the close waits for the block inside
    go.set()
    maker.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert destroyed == [("child", 2), ("parent", 1)]
    assert not parent.children
