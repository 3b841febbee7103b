"""Push mode, the consumer's side: write grants and completion notices
(include/segxfer/push.h, docs/push.md).

A consumer registers regions writable (Agent.register(..., writable=True)),
grants producers (Agent.grant_write), and learns from a Notice that a
producer's write batch has landed: every byte it lists is in the consumer's
memory.  Notices are taken from the agent's queue with Agent.next_notice
(waiting, GIL released), Agent.notices (what is queued now), or
`await Agent.next_notice_async()`, which watches the queue's eventfd
(Agent.notice_fileno) with the running loop's add_reader: no thread waits.

The library's notice callback (sx_agent_notice_cb) is not wrapped: it runs
on the agent's data-plane thread, where a Python function would take the
GIL on every notice; the fd serves event loops instead.
"""
import array
import asyncio
import collections
import ctypes
import os
import time

from . import _lib
from .errors import check, code, error, invalid

_lib_ = _lib.lib
_ETIMEDOUT = code("SX_ETIMEDOUT")

NoticeBlocks = collections.namedtuple(
    "NoticeBlocks", "group layer_first layer_count slots block count")
NoticeBlocks.__doc__ = ("Blocks block..block+count-1 of the consumer's pool, in every "
                        "layer of [layer_first, +layer_count) and slot of the slots mask")
NoticeRange = collections.namedtuple("NoticeRange", "region offset length")
NoticeRange.__doc__ = "Bytes offset..+length of the consumer's region (by id)"


class Notice:
    """One completed batch, in this agent's own terms.

    kind         "write": a producer's write batch landed here (push);
                 "read": a reader's read batch with notify_tag completed
                 (pull): its blocks may be reused
    producer     write: the producer's segment name, as the data plane
                 authenticated it (never the producer's own claim);
                 read: the reader's name as it stated it ("" if unnamed)
    reader       the same name for a read notice, None for a write notice
    incarnation  that agent's incarnation (hex, as Agent.incarnation)
    tag          the producer's tag, or the reader's notify_tag
    bytes        bytes the batch wrote (or read)
    transport    "tcp", "rdma", "cuda_ipc"
    blocks       tuple of NoticeBlocks runs (group, layer_first,
                 layer_count, slots, block, count)
    ranges       tuple of NoticeRange (region, offset, length)
    """

    __slots__ = ("kind", "producer", "incarnation", "tag", "bytes", "transport", "blocks",
                 "ranges")

    def __init__(self, n):
        self.kind = _lib.NOTICE_KINDS.get(n.kind, str(n.kind))
        self.producer = _lib.text(n.producer)
        self.incarnation = bytes(n.incarnation).hex()
        self.tag, self.bytes = n.tag, n.bytes
        self.transport = _lib.TRANSPORT_NAMES.get(n.transport, str(n.transport))
        self.blocks = tuple(NoticeBlocks(b.group, b.layer_first, b.layer_count, b.slots,
                                         b.block, b.count)
                            for b in (n.blocks[i] for i in range(n.n_blocks)))
        self.ranges = tuple(NoticeRange(r.region, r.offset, r.length)
                            for r in (n.ranges[i] for i in range(n.n_ranges)))

    @property
    def reader(self):
        return self.producer if self.kind == "read" else None

    def block_ids(self, group=None):
        """The consumer's block ids the notice covers (in group, or in every
        group), each once, in the order written: an array.array("Q") to
        mark a request's blocks arrived.  Built from the runs in C
        (array.extend(range)), not one Python step per block."""
        ids = array.array("Q")
        for b in self.blocks:
            if group is None or b.group == group:
                ids.extend(range(b.block, b.block + b.count))
        if len(self.blocks) > 1:  # runs of other layers or slots repeat ids
            ids = array.array("Q", dict.fromkeys(ids))
        return ids

    def __repr__(self):
        return ("Notice(kind=%s, producer=%r, tag=%d, bytes=%d, transport=%s, blocks=%d runs, "
                "ranges=%d)" % (self.kind, self.producer, self.tag, self.bytes, self.transport,
                                len(self.blocks), len(self.ranges)))


def incarnation_bytes(incarnation):
    """None, 16 bytes, or their 32 hex digits (Agent.incarnation) as a
    ctypes buffer for the library, or None."""
    if incarnation is None:
        return None
    if isinstance(incarnation, str):
        try:
            raw = bytes.fromhex(incarnation)
        except ValueError:
            raw = b""
    elif isinstance(incarnation, (bytes, bytearray)):
        raw = bytes(incarnation)
    else:
        raise TypeError("incarnation must be hex text, bytes or None (got %s)"
                        % type(incarnation).__name__)
    if len(raw) != _lib.INCARNATION_LEN:
        raise invalid("incarnation must be %d bytes (%d hex digits), got %r"
                      % (_lib.INCARNATION_LEN, 2 * _lib.INCARNATION_LEN, incarnation))
    return (ctypes.c_uint8 * _lib.INCARNATION_LEN).from_buffer_copy(raw)


def grant(handle, fn, producer, incarnation, what):
    """sx_agent_grant_write / sx_agent_revoke_write."""
    if producer is not None and not isinstance(producer, str):
        raise TypeError("producer must be a segment name (str) or None")
    if producer is None and incarnation is not None:
        raise invalid("%s: an incarnation names one life of a producer: give its name too"
                      % what)
    inc = incarnation_bytes(incarnation)
    from .agent import _bytes
    name = _bytes(producer, "producer")
    with handle as ptr:
        check(fn(ptr, name, inc), "%s %s" % (what, producer or "(the namespace)"))


def _take(ptr, timeout_ms):
    """The next notice within timeout_ms (0: do not wait), or None."""
    out = ctypes.POINTER(_lib.Notice)()
    rc = _lib_.sx_agent_notice_next(ptr, timeout_ms, ctypes.byref(out))
    if rc == _ETIMEDOUT:
        return None
    check(rc, "notice")
    try:
        return Notice(out.contents)
    finally:
        _lib_.sx_notice_free(out)


def _closed():
    return error(code("SX_ESHUTDOWN"), "the agent was closed")


def next_notice(handle, timeout):
    """Agent.next_notice: waits in slices of 200 ms (Ctrl-C works, and a
    close() from another thread gets in) with the GIL released."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with handle as ptr:
        while not handle.closed:
            left = 200 if deadline is None else \
                max(0, min(200, int((deadline - time.monotonic()) * 1000)))
            n = _take(ptr, left)
            if n is not None or (deadline is not None and time.monotonic() >= deadline):
                return n
    raise _closed()


def drain(handle):
    """Agent.notices: every notice queued now, oldest first, without waiting."""
    out = []
    with handle as ptr:
        while True:
            n = _take(ptr, 0)
            if n is None:
                return out
            out.append(n)


async def next_notice_async(agent, timeout):
    """Agent.next_notice_async: the queue's eventfd is readable while
    notices wait (the library resets it when the queue empties), so the
    loop watches a duplicate of it (valid even if the agent closes) and
    takes a notice without waiting each time it fires."""
    handle = agent._h
    with handle as ptr:
        n = _take(ptr, 0)
        if n is not None or timeout == 0:
            return n
        fd = os.dup(check(_lib_.sx_agent_notice_fd(ptr), "notice fd"))
    loop = asyncio.get_running_loop()
    fut = None

    def wake():
        if fut is not None and not fut.done():
            fut.set_result(None)
    waiter = (loop, wake)
    agent._notice_waiters.add(waiter)
    timer = loop.call_later(timeout, wake) if timeout is not None else None
    deadline = None if timeout is None else loop.time() + timeout
    try:
        while True:
            fut = loop.create_future()
            loop.add_reader(fd, wake)
            try:
                await fut
            finally:
                loop.remove_reader(fd)
            if handle.closed:
                raise _closed()
            with handle as ptr:
                n = _take(ptr, 0)
            if n is not None or (deadline is not None and loop.time() >= deadline):
                return n
    finally:
        if timer is not None:
            timer.cancel()
        agent._notice_waiters.discard(waiter)
        os.close(fd)
