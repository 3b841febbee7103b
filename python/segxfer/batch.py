"""Batches: block and range reads from one segment, or writes into it (push
mode, write=True), run as one unit.

A Batch is built (add_block_ids, and add_blocks / add_ranges for reads or
add_block_writes / add_range_writes for writes), submitted once, and ends
exactly once: COMPLETED, FAILED, TIMEOUT or CANCELLED.  A write batch ends
COMPLETED only once every byte is in the consumer's memory and the consumer
accepted its notice, which carries the batch's tag.  Wait for it
with wait(timeout), poll done(), read result(), or `await batch` in asyncio:
the batch's eventfd (fileno()) is watched by the running loop's add_reader,
so no thread waits per batch.  `await batch` returns the result when the
batch completed and raises its error otherwise.
"""
import array
import asyncio
import ctypes
import functools
import numbers
import operator
import os

from . import _lib
from ._handle import Handle, Owned
from .errors import code, check, error, invalid
from .memory import ids_of, memory_of

_lib_ = _lib.lib
_ETIMEDOUT, _EBUSY = code("SX_ETIMEDOUT"), code("SX_EBUSY")
_STATE_ERRORS = {"TIMEOUT": _ETIMEDOUT, "CANCELLED": code("SX_ECANCELED")}


class BatchResult:
    """What an ended batch did.

    state        "COMPLETED", "FAILED", "TIMEOUT" or "CANCELLED"
    error        the first error (negative SX_E* code; 0 when COMPLETED)
    error_name   its name ("SX_EDISCONN"), "" when COMPLETED
    message      what failed, where
    bytes        bytes that arrived
    n_entries, n_ranges   entries added; ranges posted after merging
    failed       the failed entries' numbers (tuple)
    failed_blocks  for entries added as block ids: the (remote, local) id
                 pairs of failed entries, so a caller can retry exactly those
    transport    "tcp", "rdma", "cuda_ipc"
    post_ns, transfer_ns   submit -> all posted; submit -> end
    """

    __slots__ = ("state", "error", "error_name", "message", "bytes", "n_entries",
                 "n_ranges", "failed", "failed_blocks", "transport", "post_ns",
                 "transfer_ns")

    def __init__(self, r, failed_blocks):
        self.state = _lib.BATCH_STATES.get(r.state, str(r.state))
        self.error = r.error
        self.error_name = _lib.text(_lib_.sx_err_name(r.error)) if r.error else ""
        self.message = _lib.text(r.message)
        self.bytes = r.bytes
        self.n_entries, self.n_ranges = r.n_entries, r.n_ranges
        self.failed = tuple(r.failed[i] for i in range(r.n_failed)) if r.failed else ()
        self.failed_blocks = failed_blocks(self.failed) if self.failed else ()
        self.transport = _lib.TRANSPORT_NAMES.get(r.transport, str(r.transport))
        self.post_ns, self.transfer_ns = r.post_ns, r.transfer_ns

    @property
    def ok(self):
        return self.state == "COMPLETED"

    def exception(self):
        """The exception for a batch that did not complete, or None."""
        if self.ok:
            return None
        err = self.error or _STATE_ERRORS.get(self.state, code("SX_EINVAL"))
        exc = error(err, "batch %s: %s" % (self.state, self.message or "no message"))
        exc.result = self
        return exc

    def raise_for_state(self):
        """Raise exception() if the batch did not complete; return self."""
        exc = self.exception()
        if exc is not None:
            raise exc
        return self

    def __repr__(self):
        return ("BatchResult(state=%s, error=%s, bytes=%d, entries=%d, ranges=%d, "
                "failed=%d, transport=%s, message=%r)"
                % (self.state, self.error_name or 0, self.bytes, self.n_entries,
                   self.n_ranges, len(self.failed), self.transport, self.message))


def _slots_mask(slots, where):
    mask = 0
    for s in slots:
        if isinstance(s, str):
            s = {"K": _lib.SLOT_K, "V": _lib.SLOT_V, "INDEX": _lib.SLOT_INDEX,
                 "STATE": _lib.SLOT_STATE}.get(s.upper(), s)
        n = s if isinstance(s, str) else _index(s)
        if not isinstance(n, int) or not 0 <= n < _lib.MAX_SLOTS:
            raise invalid("%s: slot %r is not a slot name or a number below %d"
                          % (where, s, _lib.MAX_SLOTS))
        mask |= 1 << n
    return mask


def _is_bool_array(v):
    """A numpy or torch scalar or array whose element type is bool."""
    dt = getattr(v, "dtype", None)
    return dt is not None and (getattr(dt, "kind", None) == "b" or str(dt) == "torch.bool")


def _index(v):
    """v as a Python int if it is an integer (int, numpy integer, integer
    torch scalar: anything with __index__), else None.  bool is not a
    number here, nor is numpy's bool or a torch bool tensor (both have
    __index__, so an id list's True would silently read block 1)."""
    if isinstance(v, bool) or _is_bool_array(v):
        return None
    if isinstance(v, int):
        return int(v)
    try:
        return operator.index(v)
    except TypeError:
        return None


def _u32(v, what):
    i = _index(v)
    if i is None or not 0 <= i < 2**32:
        raise invalid("%s must be an integer in 0 .. 2**32-1 (got %r)" % (what, v))
    return i


def _u64(v, what):
    i = _index(v)
    if i is None or not 0 <= i < 2**64:
        raise invalid("%s must be an integer in 0 .. 2**64-1 (got %r)" % (what, v))
    return i


class _State:
    """What a batch and its handle share: the cached result (kept past
    destroy for a coroutine still awaiting), whether it was submitted, and
    what was added (to name failed blocks)."""

    __slots__ = ("result", "submitted", "adds")

    def __init__(self):
        self.result = None
        self.submitted = False
        self.adds = []  # ("ids", (remote, local, n)) | ("one", (r, l, c)) | ("n", n)

    def failed_blocks(self, failed):
        """(remote, local) id pairs of failed entries added as block ids:
        replays the run merging of sx_batch_add_block_ids (only on failure)."""
        want = set(failed)
        out = []
        entry = 0
        for kind, data in self.adds:
            if kind == "n":
                entry += data
                continue
            if kind == "one":
                r, l, c = data
                if entry in want:
                    out.extend((r + k, l + k) for k in range(c))
                entry += 1
                continue
            rkeep, lkeep, n = data
            rs, ls = _as_list(rkeep, n), _as_list(lkeep, n)
            for i in range(n):
                if i and (rs[i] != rs[i - 1] + 1 or ls[i] != ls[i - 1] + 1):
                    entry += 1
                if entry in want:
                    out.append((rs[i], ls[i]))
            if n:
                entry += 1
        return tuple(out)


def _destroy(s, ptr):
    """Destroy a batch; an ended or cancelled batch's result stays in s."""
    if s.submitted and s.result is None:
        _lib_.sx_batch_cancel(ptr)
        _lib_.sx_batch_wait(ptr, -1)
        r = _lib.new_struct(_lib.BatchResult)
        if _lib_.sx_batch_result_get(ptr, r) == 0:
            s.result = BatchResult(r, s.failed_blocks)
    _lib_.sx_batch_destroy(ptr)


class Batch(Owned):
    """Reads from one segment into this agent's memory, or (write=True)
    writes from this agent's memory into it with a 64-bit tag the
    consumer's notice carries.  A read batch with notify_tag (a 64-bit
    integer) sends the target a read notice carrying it once every byte
    arrived, and ends COMPLETED only after the target accepted it (a failed,
    timed-out or cancelled batch sends none).  Made by Segment.batch() (empty) or
    Segment.read_blocks()/read_ranges()/write_blocks()/write_ranges()
    (submitted).  close() destroys it (a running batch is cancelled and
    waited for first); so do leaving a `with` block and collection."""

    def __init__(self, segment, timeout=30.0, write=False, tag=0, notify_tag=None):
        self.segment = segment
        self.write = bool(write)
        self.tag = _u64(tag, "tag")
        if tag and not write:
            raise invalid("a tag belongs to a write batch (write=True); a read batch's "
                          "notice takes notify_tag")
        if notify_tag is not None:
            if write:
                raise invalid("notify_tag is for read batches; a write batch's notice "
                              "carries tag")
            self.tag = _u64(notify_tag, "notify_tag")
        self.notify = notify_tag is not None
        p = _params(None if timeout is None else _timeout_ms(timeout, "timeout"), write,
                    self.tag, self.notify)
        out = ctypes.c_void_p()
        # The handle's destroy must not reference the Batch (it would keep
        # it alive from the segment's handle): what both need is in _State.
        self._s = s = _State()
        with segment._h as ptr:  # made and adopted before a close can start
            check(_lib_.sx_batch_create(ptr, p, ctypes.byref(out)))
            self._h = Handle(out.value, functools.partial(_destroy, s), "the batch",
                             segment._h, stop=_lib_.sx_batch_cancel)

    # ------------------------------------------------------------ building

    def add_block_ids(self, remote_ids, local_ids, group=0, layers=None, slots=None):
        """For each i: block remote_ids[i] of the segment -> block local_ids[i]
        of this agent (a write batch: local_ids[i] -> remote_ids[i]), in
        every layer of `layers` and slot of `slots`.  Ids
        are a list, range, array.array, numpy array or torch tensor of
        integers; layers a range or (first, count) (default: every layer
        this agent registered in the group); slots a slot, slot name or a
        list of them (default: every slot registered in the group)."""
        group = _u32(group, "group")
        first, count, mask = self.segment.agent._shape(group, layers, slots)
        raddr, n, rkeep = ids_of(remote_ids, "remote_ids")
        laddr, ln, lkeep = ids_of(local_ids, "local_ids")
        ids = _lib.new_struct(_lib.BlockIds)
        ids.group, ids.layer_first, ids.layer_count, ids.slots = group, first, count, mask
        # Counts that differ are the library's to refuse (SX_EINCOMPAT, both
        # counts in the message), as for C callers.
        ids.local, ids.n_local, ids.remote, ids.n_remote = laddr, ln, raddr, n
        with self._h as ptr:  # a close() from another thread waits for the call
            check(_lib_.sx_batch_add_block_ids(ptr, ids))
        self._s.adds.append(("ids", (rkeep, lkeep, n)))
        return self

    def add_blocks(self, remote_block, local_block, count=1, group=0, layers=None,
                   slots=None):
        """count consecutive blocks from remote_block -> local_block: one entry."""
        group = _u32(group, "group")
        first, lcount, mask = self.segment.agent._shape(group, layers, slots)
        remote_block, local_block = _u64(remote_block, "remote_block"), \
            _u64(local_block, "local_block")
        count = _u64(count, "count")
        e = _lib.BlockRead(group=group, layer_first=first, layer_count=lcount, slots=mask,
                           remote_block=remote_block, local_block=local_block, count=count)
        with self._h as ptr:  # a close() from another thread waits for the call
            check(_lib_.sx_batch_add_blocks(ptr, ctypes.byref(e), 1))
        self._s.adds.append(("one", (remote_block, local_block, count)))
        return self

    def add_block_writes(self, local_block, remote_block, count=1, group=0, layers=None,
                         slots=None):
        """Write batches: count consecutive blocks of this agent from
        local_block -> the consumer's remote_block: one entry."""
        group = _u32(group, "group")
        first, lcount, mask = self.segment.agent._shape(group, layers, slots)
        local_block, remote_block = _u64(local_block, "local_block"), \
            _u64(remote_block, "remote_block")
        count = _u64(count, "count")
        e = _lib.BlockWrite(group=group, layer_first=first, layer_count=lcount, slots=mask,
                            local_block=local_block, remote_block=remote_block, count=count)
        with self._h as ptr:  # a close() from another thread waits for the call
            check(_lib_.sx_batch_add_block_writes(ptr, ctypes.byref(e), 1))
        self._s.adds.append(("one", (remote_block, local_block, count)))
        return self

    def add_ranges(self, ranges):
        """Raw byte ranges to read: each (local, remote_region, offset,
        length), where local is an address (int) or an object memory_of()
        accepts (its first `length` bytes; length None: all of it).  The
        objects are kept alive until the batch is destroyed."""
        self._add_packed_ranges(*_pack_ranges(ranges))
        return self

    def add_range_writes(self, ranges):
        """Write batches: raw byte ranges (local, remote_region, offset,
        length) as in add_ranges, from local to the consumer's region."""
        self._add_packed_ranges(*_pack_ranges(ranges), add=_lib_.sx_batch_add_range_writes)
        return self

    def _add_packed_ranges(self, packed, n, keep=(), add=_lib_.sx_batch_add_ranges):
        """n sx_range_read (or, add=sx_batch_add_range_writes, sx_range_write)
        entries packed as 4 uint64 each (little-endian: the region id in the
        low half of the second word, its padding 0)."""
        addr, _ = packed.buffer_info()
        with self._h as ptr:  # a close() from another thread waits for the call
            check(add(ptr, addr, n))
        self._h.keep.extend(keep)
        self._s.adds.append(("n", n))

    def submit(self):
        """Start the batch; returns self.  Never waits."""
        with self._h as ptr:  # a close() from another thread waits for the call
            check(_lib_.sx_batch_submit(ptr))
        self._s.submitted = True
        return self

    # ------------------------------------------------------------ waiting

    def done(self):
        """True once the batch has ended."""
        if self._s.result is not None:
            return True
        with self._h as ptr:  # a close() from another thread waits for the call
            return _lib_.sx_batch_poll(ptr) == 0

    def wait(self, timeout=None):
        """Wait until the batch ends or timeout seconds pass (None: no
        limit).  True if it ended.  Releases the GIL while waiting."""
        if self._s.result is not None:
            return True
        if not self._s.submitted:
            raise invalid("wait: the batch was never submitted")
        limit = None if timeout is None else _timeout_ms(timeout, "timeout")
        with self._h as ptr:
            # Slices of 200 ms keep Ctrl-C working and let close() from
            # another thread proceed.
            while not self._h.closed:
                step = 200 if limit is None else min(limit, 200)
                rc = _lib_.sx_batch_wait(ptr, step)
                if rc == 0:
                    return True
                if rc != _ETIMEDOUT:  # still running
                    check(rc, "wait")
                if limit is not None:
                    limit -= step
                    if limit <= 0:
                        return False
        return self._s.result is not None

    def fileno(self):
        """The batch's eventfd: readable once the batch has ended.  Owned by
        the batch (do not read or close it); valid until close()."""
        with self._h as ptr:  # a close() from another thread waits for the call
            return check(_lib_.sx_batch_fd(ptr), "fileno")

    def result(self):
        """The BatchResult of an ended batch; SX_EBUSY while it runs."""
        if self._s.result is not None:
            return self._s.result
        r = _lib.new_struct(_lib.BatchResult)
        with self._h as ptr:  # a close() from another thread waits for the call
            rc = _lib_.sx_batch_result_get(ptr, r)
        if rc == _EBUSY:  # without a message of its own
            raise error(rc, "the batch has not ended yet" if self._s.submitted
                        else "the batch was never submitted")
        check(rc, "result")
        self._s.result = BatchResult(r, self._s.failed_blocks)
        return self._s.result

    def cancel(self):
        """Ask a running batch to stop; it ends CANCELLED (or with the state
        it reached first).  Returns at once."""
        with self._h as ptr:  # a close() from another thread waits for the call
            check(_lib_.sx_batch_cancel(ptr), "cancel")

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self):
        if not self.done():
            if not self._s.submitted:
                raise invalid("await: the batch was never submitted")
            loop = asyncio.get_running_loop()
            # A duplicate of the eventfd: the loop watches it even if the
            # batch is closed (and its own fd number reused) while we wait.
            fd = os.dup(self.fileno())
            fut = loop.create_future()
            loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            except asyncio.CancelledError:
                if not self._h.closed:
                    self.cancel()
                raise
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        return self.result().raise_for_state()



def _pack_ranges(ranges):
    """(packed, n, keep): ranges as n sx_range_read/sx_range_write entries."""
    ranges = list(ranges)
    packed = array.array("Q", bytes(32 * len(ranges)))
    keep = []
    for i, entry in enumerate(ranges):
        try:
            local, region, offset, length = entry
        except (TypeError, ValueError):
            raise invalid("range %d: expected (local, remote_region, offset, length)"
                          % i) from None
        if length is not None:
            length = _u64(length, "range %d: length" % i)
        if isinstance(local, numbers.Integral) and not isinstance(local, bool):
            addr = _u64(local, "range %d: local" % i)   # an address (numpy's too)
            if length is None:
                raise invalid("range %d: a raw address needs a length" % i)
        else:
            addr, nbytes, _, k = memory_of(local)
            keep.append(k)
            if length is None:
                length = nbytes
            elif length > nbytes:
                raise invalid("range %d: length %r is more than the %d bytes of the "
                              "local buffer" % (i, length, nbytes))
        packed[4 * i] = addr
        packed[4 * i + 1] = _u32(region, "range %d: remote_region" % i)
        packed[4 * i + 2] = _u64(offset, "range %d: offset" % i)
        packed[4 * i + 3] = _u64(length, "range %d: length" % i)
    return packed, len(ranges), keep


def _as_list(keep, n):
    if isinstance(keep, array.array):
        return keep.tolist()
    if hasattr(keep, "tolist"):
        return keep.tolist()
    return [keep[i] for i in range(n)]


_PARAMS = {}


def _params(timeout_ms, write=False, tag=0, notify=False):
    """Batch parameters (the library copies them at create): made once per
    read deadline, not once per batch; a write batch's and a notifying read
    batch's carry their own tag."""
    p = None if write or notify else _PARAMS.get(timeout_ms)
    if p is None:
        p = _lib.new_struct(_lib.BatchParams)
        _lib_.sx_batch_params_init(p)
        if timeout_ms is not None:
            p.timeout_ms = timeout_ms
        if write:
            p.flags, p.tag = _lib.BATCH_WRITE, tag
        elif notify:
            p.flags, p.tag = _lib.BATCH_NOTIFY, tag
        elif len(_PARAMS) < 64:
            _PARAMS[timeout_ms] = p
    return p


def _timeout_ms(seconds, what):
    try:
        ms = int(round(float(seconds) * 1000))
    except (TypeError, ValueError, OverflowError):  # OverflowError: infinity
        raise invalid("%s must be a finite number of seconds (got %r)"
                      % (what, seconds)) from None
    if not 0 <= ms < 2**31:
        raise invalid("%s must be between 0 and 2**31 ms (got %r s)" % (what, seconds))
    return ms
