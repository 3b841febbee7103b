"""Push mode from Python against a real redis-server: write batches land byte
for byte in a consumer's memory, each with a notice matched to its bytes and
tag; refused writes raise the exception named after their code, with the
reason, and land nothing; grants, revocation, the notice fd, asyncio, and
no fd or thread left after close."""
import asyncio
import gc
import select

import pytest

import segxfer
from conftest import (BLOCK_BYTES, LAYERS, LAYOUT, READER_BLOCKS, TARGET_BLOCKS, block,
                      pattern)
from test_lifecycle import fds, threads

KV = 0b11
BLOCK_SET = LAYERS * BLOCK_BYTES * 2  # one block id, every layer, K and V


class Push:
    """A consumer with writable K/V pools (zeroed) and a producer with
    pattern-filled ones, both named and published, in this process."""

    def __init__(self, url, producer="prefill-0", consumer="decode-0", seed=7):
        self.consumer = segxfer.Agent(consumer, url, lease_ms=2000, log_level="error",
                                      **LAYOUT)
        self.cmem = self.register(self.consumer, READER_BLOCKS, None, writable=True)
        self.consumer.publish()
        self.producers = []
        self.pmem = {}
        self.add_producer(url, producer, seed)
        self.producer = self.producers[0]
        self.seg = self.producer.open(consumer)

    @staticmethod
    def register(agent, blocks, seed, writable=False):
        mem = []
        for slot in ("K", "V"):
            buf = pattern(LAYERS, blocks, seed + (slot == "V")) if seed is not None \
                else bytearray(LAYERS * blocks * BLOCK_BYTES)
            agent.register(buf, layers=LAYERS, slot=slot, block_bytes=BLOCK_BYTES,
                           writable=writable)
            mem.append(buf)
        return mem

    def add_producer(self, url, name, seed):
        p = segxfer.Agent(name, url, lease_ms=2000, log_level="error", **LAYOUT)
        self.pmem[name] = self.register(p, TARGET_BLOCKS, seed)
        p.publish()
        self.producers.append(p)
        return p

    def landed(self, name, local, remote):
        """The consumer's blocks remote[i] hold the producer's local[i]."""
        for s in (0, 1):
            for layer in range(LAYERS):
                for lo, re in zip(local, remote):
                    assert block(self.cmem[s], READER_BLOCKS, layer, re) == \
                        block(self.pmem[name][s], TARGET_BLOCKS, layer, lo), (s, layer, lo, re)

    def untouched(self):
        assert not any(self.cmem[0]) and not any(self.cmem[1])

    def close(self):
        self.seg.close()
        for p in self.producers:
            p.close()
        self.consumer.close()


@pytest.fixture
def push(url):
    p = Push(url)
    yield p
    p.close()


def test_push_write_blocks_land_byte_exact_with_their_notice(push):
    push.consumer.grant_write("prefill-0")
    local, remote = [3, 9, 10], [1, 2, 3]
    b = push.seg.write_blocks(local, remote, tag=0x1234_5678_9abc_def0)
    assert b.write and b.tag == 0x1234_5678_9abc_def0
    assert b.wait(10)
    res = b.result().raise_for_state()
    assert res.bytes == 3 * BLOCK_SET and res.transport == "tcp"
    push.landed("prefill-0", local, remote)
    # Nothing else was written.
    for s in (0, 1):
        for layer in range(LAYERS):
            for other in set(range(READER_BLOCKS)) - set(remote):
                assert not any(block(push.cmem[s], READER_BLOCKS, layer, other))
    n = push.consumer.next_notice(5)
    assert isinstance(n, segxfer.Notice)
    assert (n.producer, n.incarnation) == ("prefill-0", push.producer.incarnation)
    assert (n.tag, n.bytes, n.transport) == (0x1234_5678_9abc_def0, res.bytes, "tcp")
    # Destinations 1, 2, 3 are consecutive: one run, in the consumer's terms.
    assert n.blocks == (segxfer.NoticeBlocks(0, 0, LAYERS, KV, 1, 3),)
    assert n.ranges == ()
    assert list(n.block_ids()) == remote and list(n.block_ids(group=1)) == []
    assert push.consumer.next_notice(0) is None
    b.close()


def test_push_write_ranges_and_per_slot_runs(push):
    push.consumer.grant_write(None)      # the whole namespace
    k_id = next(r.id for r in push.consumer.regions.values() if r.slot == 0)
    src = bytearray(range(256)) * 20     # 5120 bytes
    with push.seg.write_ranges([(src, k_id, 100, None)], tag=7) as b:
        assert b.wait(10) and b.result().ok
    assert push.cmem[0][100:100 + len(src)] == src
    assert not any(push.cmem[0][:100]) and not any(push.cmem[0][100 + len(src):])
    n = push.consumer.next_notice(5)
    assert n.tag == 7 and n.bytes == len(src) and n.blocks == ()
    assert n.ranges == (segxfer.NoticeRange(k_id, 100, len(src)),)
    # K and V of the same blocks added separately, and layer by layer: the
    # notice lists each run, block_ids() each block once.
    with push.seg.batch(write=True, tag=8) as b:
        # add_block_ids serves both directions: on a write batch, name them.
        b.add_block_ids(local_ids=[0, 1], remote_ids=[5, 6], slots="K")
        b.add_block_ids(local_ids=[0, 1], remote_ids=[5, 6], slots="V")
        b.add_block_writes(2, 7, layers=range(1, 2))
        assert b.submit().wait(10)
        assert b.result().ok, b.result()
    n = push.consumer.next_notice(5)
    assert n.tag == 8 and len(n.blocks) == 3
    assert list(n.block_ids()) == [5, 6, 7]
    push.landed("prefill-0", [0, 1], [5, 6])
    assert block(push.cmem[0], READER_BLOCKS, 1, 7) == \
        block(push.pmem["prefill-0"][0], TARGET_BLOCKS, 1, 2)
    assert not any(block(push.cmem[0], READER_BLOCKS, 0, 7))


def _refused(push, err, match, tag):
    """A write of blocks 4, 5 -> 4, 5 fails with err (class and message),
    lands nothing and delivers no notice."""
    b = push.seg.write_blocks([4, 5], [4, 5], tag=tag)
    with pytest.raises(err, match=match) as e:
        asyncio.run(_await(b))
    assert e.value.result.state == "FAILED" and e.value.name == err.__name__
    push.untouched()
    assert push.consumer.next_notice(0.05) is None
    b.close()


async def _await(b):
    return await b


def test_push_refused_writes_raise_their_code_and_land_nothing(push):
    # No grant.
    _refused(push, segxfer.SX_EACCESS, "no write grant", 1)
    # A grant for another life of the producer's name.
    push.consumer.grant_write("prefill-0", "09" * 16)
    _refused(push, segxfer.SX_EACCESS, "no write grant", 2)
    # Granted (its incarnation, as bytes): lands, with its notice.
    push.consumer.grant_write("prefill-0", bytes.fromhex(push.producer.incarnation))
    with push.seg.write_blocks([4], [4], tag=3) as b:
        asyncio.run(_await(b))
    push.landed("prefill-0", [4], [4])
    assert push.consumer.next_notice(5).tag == 3
    # Revoked (every grant of the name): refused on the same connections.
    push.consumer.revoke_write("prefill-0")
    push.cmem[0][:] = bytes(len(push.cmem[0]))
    push.cmem[1][:] = bytes(len(push.cmem[1]))
    _refused(push, segxfer.SX_EACCESS, "refused a write of region", 4)
    # Reading from that consumer still works.
    with push.seg.read_blocks([0], [0]) as b:
        assert b.wait(10) and b.result().ok
    # Granted again: the same connections take writes again.
    push.consumer.grant_write("prefill-0")
    with push.seg.write_blocks([8], [9], tag=5) as b:
        assert b.wait(10) and b.result().ok
    assert push.consumer.next_notice(5).tag == 5


def test_push_planning_refusals(url, push):
    push.consumer.grant_write(None)
    # A region that is not writable: refused when added, before any byte.
    ro = bytearray(2 * BLOCK_BYTES)
    push.consumer.register(ro, group=1, block_bytes=BLOCK_BYTES)
    push.consumer.publish()
    push.producer.register(bytearray(b"\x55" * 2 * BLOCK_BYTES), group=1,
                           block_bytes=BLOCK_BYTES)
    with push.producer.open("decode-0") as seg:
        with pytest.raises(segxfer.SX_EDENIED, match="write"):
            seg.write_blocks([0], [0], group=1)
        with pytest.raises(segxfer.SX_EBOUNDS, match="outside"):
            seg.write_blocks([0], [READER_BLOCKS])
        with pytest.raises(segxfer.SX_EBOUNDS, match="outside"):
            seg.write_blocks([TARGET_BLOCKS], [0])
        with pytest.raises(segxfer.SX_EINCOMPAT, match="3 local blocks but 2 remote"):
            seg.write_blocks([1, 2, 3], [1, 2])
        with seg.batch(write=True) as b:
            with pytest.raises(segxfer.SX_EINVAL):
                b.add_blocks(0, 0)             # a read entry on a write batch
            with pytest.raises(segxfer.SX_EINVAL):
                b.add_ranges([(bytearray(16), 0, 0, 16)])
        with seg.batch() as b:
            with pytest.raises(segxfer.SX_EINVAL):
                b.add_block_writes(0, 0)       # and the other way round
        with pytest.raises(segxfer.SX_EINVAL, match="write batch"):
            seg.batch(tag=9)
        with pytest.raises(segxfer.SX_EINVAL, match="tag"):
            seg.write_blocks([0], [0], tag=-1)
    assert not any(ro)
    push.untouched()
    assert push.consumer.next_notice(0) is None
    # A reader-only agent cannot write: consumers authorize producers by
    # their published segment.
    with segxfer.Agent(None, url, log_level="error", **LAYOUT) as anon:
        Push.register(anon, TARGET_BLOCKS, 3)
        with anon.open("decode-0") as seg:
            with pytest.raises(segxfer.SX_EINVAL, match="named agent"):
                seg.write_blocks([0], [0])
    for bad in ("xyz", "00" * 15, b"short"):
        with pytest.raises(segxfer.SX_EINVAL, match="incarnation"):
            push.consumer.grant_write("prefill-0", bad)
    with pytest.raises(segxfer.SX_EINVAL, match="give its name"):
        push.consumer.revoke_write(None, push.producer.incarnation)
    with pytest.raises(TypeError):
        push.consumer.grant_write(42)


def test_push_many_producers_every_notice_matched(url, push):
    names = ["prefill-0", "prefill-1", "prefill-2"]
    push.consumer.grant_write(None)
    for i, name in enumerate(names[1:], 1):
        push.add_producer(url, name, seed=20 + i)
    segs = [p.open("decode-0") for p in push.producers]
    plan = {}  # tag -> (producer, local ids, remote ids)
    batches = []
    for i, (name, seg) in enumerate(zip(names, segs)):
        local, remote = [i, 10 + i, 20 + i], [5 * i, 5 * i + 1, 5 * i + 3]
        plan[100 + i] = (name, local, remote)
        batches.append(seg.write_blocks(local, remote, tag=100 + i))

    async def all_of():
        return await asyncio.gather(*batches)
    for res in asyncio.run(all_of()):
        assert res.ok and res.bytes == 3 * BLOCK_SET
    got = {}
    while len(got) < len(names):
        n = push.consumer.next_notice(5)
        assert n is not None, "a notice is missing"
        got[n.tag] = n
    for tag, (name, local, remote) in plan.items():
        n = got[tag]
        producer = push.producers[names.index(name)]
        assert (n.producer, n.incarnation) == (name, producer.incarnation)
        assert n.bytes == 3 * BLOCK_SET and sorted(n.block_ids()) == remote
        push.landed(name, local, remote)
    assert push.consumer.notices() == []
    for b in batches:
        b.close()
    for s in segs:
        s.close()


def test_push_notice_fd_is_readable_while_notices_wait(push):
    push.consumer.grant_write("prefill-0")
    fd = push.consumer.notice_fileno()
    assert fd == push.consumer.notice_fileno()

    def readable():
        return select.select([fd], [], [], 0)[0] == [fd]
    assert not readable()
    for tag in (1, 2):
        with push.seg.write_blocks([tag], [tag], tag=tag) as b:
            assert b.wait(10) and b.result().ok
    assert readable()
    assert [n.tag for n in push.consumer.notices()] == [1, 2]
    assert not readable() and push.consumer.notices() == []


def test_push_asyncio_awaits_notices_with_the_loop_free(push):
    push.consumer.grant_write("prefill-0")
    before = threads()

    async def main():
        ticks = 0
        waiter = asyncio.ensure_future(push.consumer.next_notice_async(timeout=10))
        await asyncio.sleep(0.1)
        assert not waiter.done() and threads() == before   # no thread waits
        while not waiter.done() and ticks < 3:
            ticks += 1
            await asyncio.sleep(0.01)                      # the loop runs
        res = await push.seg.write_blocks([2, 3], [12, 13], tag=77)
        n = await waiter
        assert ticks == 3 and res.ok
        assert n.tag == 77 and list(n.block_ids()) == [12, 13] and n.bytes == res.bytes
        # Nothing comes: None after the timeout; 0 does not wait.
        assert await push.consumer.next_notice_async(timeout=0.1) is None
        assert await push.consumer.next_notice_async(timeout=0) is None
    asyncio.run(main())
    push.landed("prefill-0", [2, 3], [12, 13])


def test_push_close_wakes_waiters(url):
    a = segxfer.Agent("decode-9", url, log_level="error", **LAYOUT)

    async def main():
        waiter = asyncio.ensure_future(a.next_notice_async())
        await asyncio.sleep(0.05)
        a.close()
        with pytest.raises(segxfer.SX_ESHUTDOWN):
            await waiter
    asyncio.run(main())
    b = segxfer.Agent("decode-8", url, log_level="error", **LAYOUT)
    import threading
    got = []

    def wait():
        try:
            b.next_notice()
        except segxfer.SegxferError as e:
            got.append(e)
    t = threading.Thread(target=wait)
    t.start()
    while not b._h._users:               # the waiter is inside the library
        pass
    b.close()
    t.join(5)
    assert not t.is_alive() and isinstance(got[0], segxfer.SX_ESHUTDOWN)


def test_push_leaves_no_fd_or_thread(url):
    gc.collect()
    fd0, th0 = fds(), threads()
    p = Push(url)
    p.consumer.grant_write("prefill-0")
    p.consumer.notice_fileno()

    async def main():
        waiter = asyncio.ensure_future(p.consumer.next_notice_async(5))
        await p.seg.write_blocks([1], [1], tag=1)
        return await waiter
    assert asyncio.run(main()).tag == 1
    with p.seg.write_ranges([(bytearray(64), 0, 0, None)], tag=2) as b:
        b.wait(10)
    assert p.consumer.next_notice(5).tag == 2
    p.close()
    p = None
    gc.collect()
    assert fds() == fd0 and threads() == th0
