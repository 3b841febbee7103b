"""Bad input from Python is refused with a clear exception, never a crash:
wrong dtypes, non-contiguous memory, negative, out-of-range and huge ids or
counts, mismatched arrays, wrong types, used-after-close objects.  Nothing of
a refused call reaches the batch."""
import array

import numpy
import pytest
import torch

import segxfer
from conftest import LAYERS, TARGET_BLOCKS


@pytest.fixture
def seg(pair):
    s = pair.reader.open(pair.name)
    yield s
    s.close()


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([1.0, 2.0]), "integer tensor"),
    (torch.tensor([True, False]), "integer tensor"),
    (numpy.array([1.5]), "integer array"),
    (array.array("d", [1.0]), "integers"),
    ([1, "2"], "integers"),
    ([1, 2.0], "integers"),
    # array.array("q", [True]) is [1]: flags must not pass as ids.
    ([True, False], "True of type bool"),
    ((0, numpy.bool_(True)), "of type bool"),
    (b"\x01\x02", "sequence of integers"),
    ("12", "sequence of integers"),
    (torch.tensor([[1, 2]]), "one-dimensional"),
    (numpy.zeros((2, 2), dtype=numpy.int64), "one-dimensional"),
    # A dict was read as its keys, a set in its own order.
    ({1: 5, 2: 6}, "not a dict"),
    ({3, 1, 2}, "not a set"),
    (frozenset([1]), "not a frozenset"),
    ({1: 5}.keys(), "in order"),
    # A meta tensor has no values: .cpu() raised NotImplementedError.
    (torch.empty(3, dtype=torch.int64, device="meta"), "meta device"),
])
def test_bad_input_ids_of_the_wrong_kind(seg, ids, match):
    with pytest.raises(segxfer.SX_EINVAL, match=match):
        seg.read_blocks(ids, ids)


@pytest.mark.parametrize("ids", [
    [0, -1], array.array("q", [3, -2]), numpy.array([-5], dtype=numpy.int64),
    torch.tensor([1, -7]), torch.tensor([-1], dtype=torch.int8),
])
def test_bad_input_negative_ids(seg, ids):
    with pytest.raises(segxfer.SX_EINVAL, match="negative"):
        seg.read_blocks(ids, [1] * len(ids))
    with pytest.raises(segxfer.SX_EINVAL, match="negative"):
        seg.read_blocks([1] * len(ids), ids)


def test_bad_input_ids_out_of_range(seg):
    for remote, local in (([TARGET_BLOCKS], [0]), ([0], [16]), ([2**63], [0]),
                          ([2**64 - 1], [0]), ([0, 1, 2**40], [0, 1, 2])):
        with pytest.raises(segxfer.SX_EBOUNDS, match="outside"):
            seg.read_blocks(remote, local)
    with pytest.raises(segxfer.SX_EINVAL, match="2\\*\\*64"):
        seg.read_blocks([2**64], [0])
    # A count mismatch is a planning error of the library's, as in C.
    with pytest.raises(segxfer.SX_EINCOMPAT, match="1 local blocks but 2 remote blocks"):
        seg.read_blocks([1, 2], [1])


def test_bad_input_huge_counts_and_layers(seg):
    with seg.batch() as b:
        with pytest.raises(segxfer.SX_EBOUNDS):
            b.add_blocks(0, 0, count=2**63)
        with pytest.raises(segxfer.SX_EINVAL, match="count"):
            b.add_blocks(0, 0, count=2**64)
        with pytest.raises(segxfer.SX_EINVAL, match="count"):
            b.add_blocks(0, 0, count=-1)
        with pytest.raises(segxfer.SX_EINVAL):
            b.add_blocks(0, 0, count=0)
        with pytest.raises(segxfer.SX_EOVERFLOW):
            b.add_blocks(0, 0, layers=(2**32 - 1, 5))
        with pytest.raises(segxfer.SX_ENOREGION):
            b.add_blocks(0, 0, layers=(LAYERS, 1))
        with pytest.raises(segxfer.SX_EINVAL, match="layers"):
            b.add_blocks(0, 0, layers=range(0, 4, 2))
        with pytest.raises(segxfer.SX_EINVAL, match="layers"):
            b.add_blocks(0, 0, layers="all")
        with pytest.raises(segxfer.SX_EINVAL, match="slot"):
            b.add_blocks(0, 0, slots="Q")
        with pytest.raises(segxfer.SX_EINVAL, match="slot"):
            b.add_blocks(0, 0, slots=64)
        with pytest.raises(segxfer.SX_EINVAL, match="group"):
            b.add_blocks(0, 0, group=-1)
        with pytest.raises(segxfer.SX_EINVAL, match="no region of group 9"):
            b.add_blocks(0, 0, group=9)
        # None of the refused calls added anything.
        b.add_blocks(3, 3)
        b.submit().wait()
        assert b.result().ok and b.result().n_entries == 1
    # Two million ids from a tensor: one call, refused as a whole (the
    # last id is out of range).
    ids = torch.arange(2_000_000) % TARGET_BLOCKS
    ids[-1] = TARGET_BLOCKS
    with pytest.raises(segxfer.SX_EBOUNDS):
        seg.read_blocks(ids, ids % 16)


def test_bad_input_ranges(seg):
    region = seg.regions()[0]["id"]
    buf = bytearray(4096)
    for ranges, err, match in (
            ([(buf, region, 0, 8192)], segxfer.SX_EINVAL, "more than the 4096 bytes"),
            ([(buf, 999, 0, None)], segxfer.SX_ENOREGION, "region 999"),
            ([(buf, region, 2**62, None)], segxfer.SX_EBOUNDS, "outside"),
            ([(buf, region, -1, None)], segxfer.SX_EINVAL, "offset"),
            ([(0x1000, region, 0, None)], segxfer.SX_EINVAL, "needs a length"),
            ([(buf, region, 0)], segxfer.SX_EINVAL, "expected"),
            ([(bytes(16), region, 0, None)], segxfer.SX_EINVAL, "read-only"),
            ([("text", region, 0, None)], TypeError, "cannot register")):
        with pytest.raises(err, match=match):
            seg.read_ranges(ranges)


def test_bad_input_register(pair):
    a = pair.reader
    t = torch.zeros(4, 8, 64)
    with pytest.raises(segxfer.SX_EINVAL, match="not contiguous"):
        a.register_blocks(t.transpose(0, 1), "K", group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="not C-contiguous"):
        a.register(numpy.zeros((8, 8))[:, ::2], block_bytes=64, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="read-only"):
        a.register(b"x" * 4096, block_bytes=4096, group=1)
    with pytest.raises(TypeError, match="cannot register"):
        a.register(object(), block_bytes=4096, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="addr= and length="):
        a.register(block_bytes=4096, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="NULL addr"):
        a.register(addr=0, length=4096, block_bytes=4096, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="more than"):
        a.register(bytearray(4096), length=8192, block_bytes=4096, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="shaped"):
        a.register_blocks(torch.zeros(4), "K", group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="empty"):
        a.register_blocks(torch.zeros(0, 4, 4), "K", group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="block_bytes"):
        a.register(bytearray(4096), block_bytes=0, group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="slot"):
        a.register(bytearray(4096), block_bytes=4096, slot="W", group=1)
    with pytest.raises(segxfer.SX_EINVAL, match="cpu or cuda"):
        a.register_blocks(torch.zeros(2, 2, 4, device="meta"), "K", group=1)
    # The library's own checks: a layer stride that does not hold a layer.
    with pytest.raises(segxfer.SX_EBOUNDS):
        a.register(bytearray(4096), layers=2, layer_stride=4096, block_bytes=4096,
                   group=1)
    with pytest.raises(segxfer.SX_ESTRIDE):
        a.register(bytearray(8192), block_bytes=4096, block_stride=2048, group=1)
    # A bytearray registered is pinned: it cannot be resized under the agent.
    buf = bytearray(8192)
    a.register(buf, block_bytes=4096, group=3)
    with pytest.raises(BufferError):
        buf.extend(b"x")


def test_bad_input_agent_parameters(url):
    for kw, match in ((dict(transports="carrier-pigeon"), "unknown transport"),
                      (dict(transports=[]), "no transport"),
                      (dict(dtype="x" * 40), "dtype must be at most 31"),
                      (dict(tag="a\0b"), "NULs"),
                      (dict(lease_ms=-5), "lease_ms"),
                      (dict(lease_ms=10), "lease_ms"),
                      (dict(log_level="loud"), "log_level"),
                      (dict(labels={"k" * 100: "v"}), "label key")):
        with pytest.raises(segxfer.SX_EINVAL, match=match):
            segxfer.Agent(None, url, **kw)
    with pytest.raises(TypeError):
        segxfer.Agent(b"name", url)
    with pytest.raises(segxfer.SX_EINVAL, match="timeout"):
        segxfer.Agent(None, url, log_level="error").open("x", timeout=-1)


def test_bad_input_agent_repr_after_a_failed_init(url):
    # repr (a traceback, a debugger) of an agent whose __init__ raised part
    # way raised AttributeError: it had no name or handle yet.
    a = segxfer.Agent.__new__(segxfer.Agent)
    assert repr(a) == "Agent(None, not created)"
    with pytest.raises(segxfer.SX_EINVAL, match="advertise"):
        a.__init__("p", url, advertise="a b")
    assert repr(a) == "Agent(None, not created)"
    with pytest.raises(segxfer.SX_EINVAL, match="log_level"):
        a.__init__("p", url, log_level="loud")
    assert repr(a) == "Agent(None, not created)"
    b = segxfer.Agent(None, url, log_level="error")
    assert repr(b) == "Agent(None, open)"
    b.close()
    assert repr(b) == "Agent(None, closed)"


def test_bad_input_wait_and_result_before_submit(seg):
    b = seg.batch()
    with pytest.raises(segxfer.SX_EINVAL, match="never submitted"):
        b.wait()
    with pytest.raises(segxfer.SX_EBUSY, match="never submitted"):
        b.result()
    with pytest.raises(segxfer.SX_EINVAL, match="timeout"):
        seg.batch(timeout="soon")
    b.submit().wait()
    with pytest.raises(segxfer.SX_EINVAL, match="already submitted"):
        b.submit()
    with pytest.raises(segxfer.SX_EINVAL, match="already submitted"):
        b.add_blocks(0, 0)
    b.close()


def test_bad_input_text_with_nul_or_not_utf8(pair, url):
    """The library takes NUL-terminated text: a NUL inside a name would cut
    it there (publish, open or grant another name than the one given)."""
    for kw in (dict(name="prefill-0\0evil"), dict(metadata_url=url + "\0x"),
               dict(name="p", namespace="ns\0x"), dict(name="p", listen="127.0.0.1:0\0x"),
               dict(name="p", advertise="127.0.0.1\0x"), dict(name="\udc80")):
        kw.setdefault("metadata_url", url)
        with pytest.raises(segxfer.SX_EINVAL, match="NUL|UTF-8"):
            segxfer.Agent(log_level="error", **kw)
    with pytest.raises(segxfer.SX_EINVAL, match="name must not contain NULs"):
        pair.reader.open(pair.name + "\0junk")
    for producer in ("prefill-0\0junk", "\udc80"):
        for call in (pair.target.grant_write, pair.target.revoke_write):
            with pytest.raises(segxfer.SX_EINVAL, match="producer"):
                call(producer)
    with pytest.raises(segxfer.SX_EINVAL, match="location must not contain NULs"):
        pair.reader.register(bytearray(4096), block_bytes=4096, group=5,
                             location="cpu\0junk")


def test_bad_input_read_only_arrays(seg, pair):
    """An array flagged read-only (np.frombuffer of bytes) is refused as
    registered memory and as a read destination, as read-only buffers are:
    reading into it would overwrite an immutable bytes object."""
    src = b"\x5a" * 4096
    ro = numpy.frombuffer(src, dtype=numpy.uint8)
    with pytest.raises(segxfer.SX_EINVAL, match="read-only"):
        pair.reader.register(ro, block_bytes=4096, group=5)
    region = seg.regions()[0]["id"]
    with pytest.raises(segxfer.SX_EINVAL, match="read-only"):
        seg.read_ranges([(ro, region, 0, None)])
    frozen = numpy.zeros(4096, dtype=numpy.uint8)
    frozen.flags.writeable = False
    with pytest.raises(segxfer.SX_EINVAL, match="read-only"):
        seg.read_ranges([(frozen, region, 0, None)])
    assert src == b"\x5a" * 4096 and not frozen.any()
    # A writable array is taken as before.
    buf = numpy.zeros(4096, dtype=numpy.uint8)
    b = seg.read_ranges([(buf, region, 0, None)])
    assert b.wait(10) and b.result().ok and buf.any()


def test_bad_input_infinite_timeouts(seg, pair):
    """float('inf') (or nan) as a timeout is SX_EINVAL naming the timeout,
    not an OverflowError from the conversion to milliseconds; None is the
    way to wait without a limit."""
    inf, nan = float("inf"), float("nan")
    b = seg.read_blocks([1], [1])
    for call in (lambda t: b.wait(t), lambda t: seg.ping(t), lambda t: seg.batch(t),
                 lambda t: pair.reader.open(pair.name, t), lambda t: pair.target.next_notice(t),
                 lambda t: seg.read_blocks([1], [1], timeout=t)):
        for t in (inf, -inf, nan):
            with pytest.raises(segxfer.SX_EINVAL, match="timeout must be a finite number"):
                call(t)
    assert b.wait(None) and b.result().ok
    b.close()


def test_bad_input_rdma_gid_index(url):
    """rdma_gid_index is a C int: a value ctypes would wrap (2**32 becomes 0,
    a real GID index) or a non-integer is refused."""
    for gid in (2**32, 2**40, -2, "1", 1.0, True):
        with pytest.raises(segxfer.SX_EINVAL, match="rdma_gid_index"):
            segxfer.Agent(None, url, rdma_gid_index=gid, log_level="error")
    segxfer.Agent(None, url, rdma_gid_index=numpy.int64(-1), log_level="error").close()


def test_bad_input_tcp_threads(url):
    """tcp_threads is a C int32 in -1..64 and tcp_thread_bytes at most
    64 MiB: other values are refused, with the field named."""
    for n in (65, -2, 2**32, "2", 2.0):
        with pytest.raises(segxfer.SX_EINVAL, match="tcp_threads"):
            segxfer.Agent(None, url, tcp_threads=n, log_level="error")
    with pytest.raises(segxfer.SX_EINVAL, match="tcp_thread_bytes"):
        segxfer.Agent(None, url, tcp_thread_bytes=(64 << 20) + 1, log_level="error")
    segxfer.Agent(None, url, tcp_threads=numpy.int64(2), tcp_thread_bytes=4096,
                  log_level="error").close()
