"""Read notices from Python against a real redis-server: a read batch with
notify_tag leaves the target a Notice of kind "read" (the reader's name and
incarnation, the tag, the target's blocks) once every byte arrived; a read
without it, and a failed batch, leave none; bad arguments raise."""
import asyncio
import select

import pytest

import segxfer
from conftest import BLOCK_BYTES, LAYERS, LAYOUT, READER_BLOCKS, Pair, register_kv

KV = 0b11
BLOCK_SET = LAYERS * BLOCK_BYTES * 2


class NamedPair(Pair):
    """A Pair whose reader is a named agent."""

    def __init__(self, url, reader_name):
        super().__init__(url)
        self.reader.close()
        self.reader = segxfer.Agent(reader_name, url, log_level="warn", **LAYOUT)
        self.rmem = register_kv(self.reader, READER_BLOCKS)


def test_read_notice_arrives_with_the_reader_tag_and_blocks(url):
    p = NamedPair(url, "decode-0")
    try:
        seg = p.reader.open("prefill-0")
        fd = p.target.notice_fileno()
        # Without notify_tag: no notice.
        with seg.read_blocks([1], [0]) as b:
            assert b.wait(10) and b.result().ok
        assert p.target.next_notice(0.1) is None
        remote, local = [10, 11, 12, 30], [0, 1, 2, 3]
        b = seg.read_blocks(remote, local, notify_tag=0xABCD_0000_0000_0001)
        assert b.notify and b.tag == 0xABCD_0000_0000_0001 and not b.write
        res = b.result() if b.wait(10) else None
        assert res is not None and res.ok and res.bytes == 4 * BLOCK_SET
        p.expect(remote, local)
        # COMPLETED: the target holds the notice already.
        assert select.select([fd], [], [], 0)[0] == [fd]
        n = p.target.next_notice(0)
        assert isinstance(n, segxfer.Notice)
        assert (n.kind, n.reader, n.producer) == ("read", "decode-0", "decode-0")
        assert n.incarnation == p.reader.incarnation
        assert (n.tag, n.bytes, n.transport) == (0xABCD_0000_0000_0001, res.bytes, "tcp")
        assert n.blocks == (segxfer.NoticeBlocks(0, 0, LAYERS, KV, 10, 3),
                            segxfer.NoticeBlocks(0, 0, LAYERS, KV, 30, 1))
        assert list(n.block_ids()) == remote and n.ranges == ()
        assert p.target.next_notice(0) is None
        b.close()
        seg.close()
    finally:
        p.close()


def test_read_notice_from_an_unnamed_reader_and_for_ranges(pair):
    seg = pair.reader.open("prefill-0")
    desc = seg.regions()
    k = [r for r in desc if r["slot"] == 0][0]
    buf = bytearray(BLOCK_BYTES)
    with seg.read_ranges([(buf, k["id"], 5 * BLOCK_BYTES, BLOCK_BYTES)], notify_tag=3) as b:
        assert b.wait(10) and b.result().ok
    n = pair.target.next_notice(5)
    assert (n.kind, n.producer, n.reader, n.tag) == ("read", "", "", 3)
    assert n.ranges == (segxfer.NoticeRange(k["id"], 5 * BLOCK_BYTES, BLOCK_BYTES),)
    assert n.blocks == () and n.bytes == BLOCK_BYTES
    seg.close()


def test_read_notice_none_for_a_failed_batch(url):
    p = Pair(url, name="dies-1")
    try:
        seg = p.reader.open("dies-1")
        # The reader holds the descriptor with V; the target refuses it now.
        p.target.unregister(sorted(p.target.regions)[1])
        b = seg.read_blocks([0, 1], [0, 1], notify_tag=9, timeout=5)
        assert b.wait(10) and b.result().state == "FAILED"
        assert p.target.next_notice(0.2) is None
        b.close()
        seg.close()
    finally:
        p.close()


def test_read_notice_arguments(pair):
    seg = pair.reader.open("prefill-0")
    with pytest.raises(segxfer.SegxferError, match="notify_tag"):
        seg.batch(write=True, notify_tag=1)
    with pytest.raises(segxfer.SegxferError, match="notify_tag"):
        seg.batch(tag=1)
    with pytest.raises((ValueError, OverflowError, segxfer.SegxferError)):
        seg.read_blocks([0], [0], notify_tag=-1)
    with pytest.raises((ValueError, OverflowError, segxfer.SegxferError)):
        seg.read_blocks([0], [0], notify_tag=1 << 64)
    assert not seg.batch().notify and seg.batch(notify_tag=0).notify
    seg.close()


def test_read_notice_tag_types(pair):
    """notify_tag is a 64-bit integer of any integer type; a bool (Python's,
    numpy's or a torch bool tensor), a float or a string is refused with a
    message naming notify_tag, before anything is sent."""
    import numpy as np
    import torch
    seg = pair.reader.open("prefill-0")
    for good in (0, 2**64 - 1, np.uint64(2**64 - 1), np.int32(7), torch.tensor(9)):
        with seg.batch(notify_tag=good) as b:
            assert b.notify and b.tag == int(good)
    for bad in (-1, 2**64, 1.0, float("nan"), "1", None.__class__, True, False,
                np.bool_(True), torch.tensor(True), torch.tensor(1.5), np.int8(-1),
                np.array([1, 2])):
        with pytest.raises(segxfer.SegxferError, match="notify_tag"):
            seg.batch(notify_tag=bad)
        with pytest.raises(segxfer.SegxferError, match="notify_tag"):
            seg.read_blocks([0], [0], notify_tag=bad)
    assert pair.target.next_notice(0.1) is None
    seg.close()


def test_read_notice_asyncio(url):
    p = NamedPair(url, "decode-1")
    try:
        seg = p.reader.open("prefill-0")

        async def main():
            waiter = asyncio.ensure_future(p.target.next_notice_async(timeout=10))
            res = await seg.read_blocks([4, 5], [6, 7], notify_tag=44)
            n = await waiter
            assert res.ok and n.kind == "read" and n.tag == 44
            assert list(n.block_ids()) == [4, 5] and n.bytes == res.bytes
        asyncio.run(main())
        p.expect([4, 5], [6, 7])
        seg.close()
    finally:
        p.close()
