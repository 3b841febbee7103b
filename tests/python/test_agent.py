"""The package end to end in one process over loopback TCP and a real
redis-server: register, publish, open by name, check, read blocks and ranges,
results, descriptors, context managers."""
import array
import ctypes
import time

import numpy
import pytest
import torch

import segxfer
from conftest import (BLOCK_BYTES, LAYERS, LAYOUT, READER_BLOCKS, TARGET_BLOCKS, Pair,
                      block, register_kv)


def test_agent_read_blocks_from_every_kind_of_id_array(pair):
    remote, local = [5, 17, 3, 30, 31], [0, 9, 15, 1, 2]
    with pair.reader.open(pair.name) as seg:
        assert seg.transport == "tcp"
        seg.check()
        for ids in (lambda x: x, lambda x: array.array("i", x),
                    lambda x: numpy.array(x, dtype=numpy.int32),
                    lambda x: numpy.array(x, dtype=numpy.uint64),
                    lambda x: torch.tensor(x), lambda x: torch.tensor(x, dtype=torch.int32),
                    lambda x: range(x[0], x[0] + 1)):
            for buf in pair.rmem:
                buf[:] = bytes(len(buf))
            r_ids, l_ids = ids(remote), ids(local)
            with seg.read_blocks(r_ids, l_ids) as b:
                assert b.wait(10)
                res = b.result()
            assert res.ok and res.state == "COMPLETED" and res.error == 0
            n = len(r_ids)
            assert res.bytes == n * 2 * LAYERS * BLOCK_BYTES
            assert res.transport == "tcp" and res.failed == ()
            pair.expect(remote[:n], local[:n])
        # 30, 31 -> 1, 2 was one run: four entries for five ids.
        with seg.read_blocks(remote, local) as b:
            b.wait()
            assert b.result().n_entries == 4


def test_agent_layer_and_slot_subsets(pair):
    with pair.reader.open(pair.name) as seg:
        with seg.read_blocks([4, 6], [3, 8], layers=range(1, 3), slots="V") as b:
            b.wait()
            assert b.result().bytes == 2 * 2 * BLOCK_BYTES
        pair.expect([4, 6], [3, 8], slots=(1,), layers=(1, 2))
        assert block(pair.rmem[0], READER_BLOCKS, 1, 3) == bytes(BLOCK_BYTES)
        assert block(pair.rmem[1], READER_BLOCKS, 0, 3) == bytes(BLOCK_BYTES)
        with seg.batch() as b:
            b.add_blocks(10, 0, count=3, slots=["K"], layers=(0, 1))
            b.add_block_ids([1], [5], slots=[0, 1])
            b.submit().wait()
            res = b.result()
            assert res.ok and res.n_entries == 2
        pair.expect([10, 11, 12], [0, 1, 2], slots=(0,), layers=(0,))
        pair.expect([1], [5])


def test_agent_read_ranges_into_buffers_and_addresses(pair):
    with pair.reader.open(pair.name) as seg:
        regions = {(r["group"], r["slot"]): r for r in seg.regions()}
        k, v = regions[(0, 0)], regions[(0, 1)]
        assert k["num_blocks"] == TARGET_BLOCKS and k["block_bytes"] == BLOCK_BYTES
        dst = bytearray(3 * BLOCK_BYTES)
        raw = (ctypes.c_char * BLOCK_BYTES)()
        t = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
        with seg.read_ranges([(dst, k["id"], 2 * BLOCK_BYTES, None),
                              (ctypes.addressof(raw), v["id"], 0, BLOCK_BYTES),
                              (t, v["id"], (TARGET_BLOCKS + 1) * BLOCK_BYTES, None)]) as b:
            b.wait()
            res = b.result()
            assert res.ok and res.n_entries == 3
        assert bytes(dst) == bytes(pair.tmem[0][2 * BLOCK_BYTES:5 * BLOCK_BYTES])
        assert bytes(raw) == block(pair.tmem[1], TARGET_BLOCKS, 0, 0)
        assert bytes(t.numpy()) == block(pair.tmem[1], TARGET_BLOCKS, 1, 1)


def test_agent_descriptor_status_and_metrics(pair):
    d = pair.target.descriptor()
    assert d["name"] == pair.name
    assert d["layout"]["dtype"] == "bf16" and d["layout"]["tag"] == "NHD"
    assert len(d["regions"]) == 2 and d["token"] == "<redacted>"
    st = pair.target.status()
    assert st["state"] == "PUBLISHED" and st["generation"] == 1 and st["store_up"]
    assert len(pair.target.incarnation) == 32
    assert pair.target.incarnation != pair.reader.incarnation
    with pair.reader.open(pair.name) as seg:
        assert seg.descriptor()["incarnation"] == pair.target.incarnation
        rtt, via = seg.ping()
        assert rtt > 0 and via == "tcp"
        seg.read_blocks([0], [0]).wait()
    assert pair.target.status()["served_reads"] > 0
    assert "segxfer_" in pair.target.metrics_text()


def test_agent_register_tensor_layouts(url):
    cache = torch.zeros(4, 10, 8, 2, 16, dtype=torch.bfloat16)  # [layers, blocks, ...]
    with segxfer.Agent("tensor-0", url, log_level="warn", dtype=segxfer.dtype_name(
            cache.dtype)) as a:
        r = a.register_blocks(cache, "K", group=2)
        assert (r.layer_count, r.num_blocks, r.block_bytes) == (4, 10, 8 * 2 * 16 * 2)
        assert r.layer_stride == 10 * r.block_bytes and r.location == "cpu"
        a.publish()
        d = a.descriptor()
        assert d["layout"]["dtype"] == "bf16"
        assert d["regions"][0]["group"] == 2 and d["regions"][0]["location"] == "cpu"
        a.unregister(r)
        assert a.descriptor()["regions"] == []
        n = numpy.zeros((2, 4096), dtype=numpy.uint8)
        r2 = a.register(n, layers=2, slot="V", block_bytes=1024)
        assert (r2.num_blocks, r2.layer_stride) == (4, 4096)
        # A raw address: its location comes from the CUDA driver, which
        # does not know host memory (or is absent): "cpu".
        raw = (ctypes.c_char * 8192)()
        r3 = a.register(addr=ctypes.addressof(raw), length=8192, group=4, block_bytes=4096)
        assert r3.location == "cpu" and r3.num_blocks == 2
        assert segxfer.pointer_location(ctypes.addressof(raw), 8192) == "cpu"

        # The CUDA array interface names no device either: the library
        # asks the driver (here it has none, or does not know the memory).
        class Cai:
            def __init__(self, buf):
                self.buf = buf
                self.__cuda_array_interface__ = {
                    "data": (ctypes.addressof(buf), False), "shape": (8192,),
                    "typestr": "|u1", "strides": None, "version": 3}
        r4 = a.register(Cai(raw), group=5, block_bytes=4096)
        assert (r4.location, r4.num_blocks) == ("cpu", 2)


def test_agent_check_reports_the_structured_mismatch(url):
    p = Pair(url, name="mm-0", dtype="fp16")
    try:
        with p.reader.open("mm-0") as seg:
            with pytest.raises(segxfer.IncompatibleLayout) as e:
                seg.check()
            x = e.value
            assert (x.kind, x.field, x.local, x.remote) == ("dtype", "dtype", "fp16", "bf16")
            assert "dtype" in x.message and x.code == segxfer.SX_EINCOMPAT.code
    finally:
        p.close()
    # Same segment-wide layout, another block size for one key.
    with segxfer.Agent("mm-1", url, log_level="warn", **LAYOUT) as t, \
            segxfer.Agent(None, url, log_level="warn", **LAYOUT) as r:
        register_kv(t, 4, seed=1)
        t.publish()
        r.register(bytearray(LAYERS * 4 * BLOCK_BYTES), layers=LAYERS, slot="K",
                   block_bytes=BLOCK_BYTES)
        r.register(bytearray(LAYERS * 4 * 2048), layers=LAYERS, slot="V", block_bytes=2048)
        with r.open("mm-1") as seg:
            with pytest.raises(segxfer.IncompatibleLayout) as e:
                seg.check()
            x = e.value
            assert (x.kind, x.field, x.group, x.layer, x.slot) == \
                ("block_bytes", "block_bytes", 0, 0, 1)
            assert (x.local, x.remote) == ("2048", "4096")
            # A read that skips the check is refused at planning time too.
            with pytest.raises(segxfer.SX_EINCOMPAT):
                seg.read_blocks([0], [0])
            seg.read_blocks([0], [0], slots="K").wait()


def test_agent_context_managers_unpublish_and_close(url):
    with segxfer.Agent(None, url, log_level="warn", **LAYOUT) as reader:
        register_kv(reader, 4)
        with segxfer.Agent("ctx-0", url, log_level="warn", **LAYOUT) as t:
            register_kv(t, 4, seed=3)
            t.publish()
            seg = reader.open("ctx-0")
            b = seg.batch()
        assert t.closed
        # Gone from the store at once, not after the lease (5 s): an agent
        # with nothing cached finds nothing.
        with segxfer.Agent(None, url, log_level="warn", **LAYOUT) as fresh:
            with pytest.raises(segxfer.SX_ENOENT):
                fresh.open("ctx-0", timeout=0.1)
        # The reader cached the descriptor; the store's delete event drops
        # it, asynchronously (a loaded machine delays it), so allow a second.
        deadline = time.monotonic() + 1.0
        while True:
            try:
                reader.open("ctx-0", timeout=0.1).close()
            except segxfer.SX_ENOENT:
                break
            assert time.monotonic() < deadline, "the reader still sees ctx-0 after 1 s"
            time.sleep(0.01)
        seg.close()
        # Closed objects refuse to be used instead of touching freed memory.
        with pytest.raises(segxfer.SX_EINVAL, match="closed"):
            b.submit()
        with pytest.raises(segxfer.SX_EINVAL, match="closed"):
            seg.read_blocks([0], [0])
        with pytest.raises(segxfer.SX_EINVAL, match="closed"):
            t.publish()
        seg2 = None
    with pytest.raises(segxfer.SX_EINVAL, match="closed"):
        reader.open("ctx-0")
    assert seg2 is None
    # Closing twice is fine.
    reader.close()
    t.close()


def test_agent_unpublish_and_republish(pair):
    pair.target.unpublish()
    assert pair.target.status()["state"] == "UNPUBLISHED"
    with pytest.raises(segxfer.SX_ENOENT):
        pair.reader.open(pair.name, timeout=0.1)
    pair.target.publish()
    with pair.reader.open(pair.name, timeout=1) as seg:
        assert seg.descriptor()["generation"] == 2


def test_agent_failed_batch_names_the_failed_blocks(url):
    p = Pair(url, name="dies-0")
    try:
        seg = p.reader.open("dies-0")
        p.target.close()
        remote, local = [1, 2, 3, 9], [0, 1, 2, 5]
        b = seg.read_blocks(remote, local, timeout=5)
        assert b.wait(10)
        res = b.result()
        assert res.state == "FAILED" and not res.ok
        assert res.error_name in ("SX_EUNREACH", "SX_EDISCONN", "SX_EIO")
        assert res.message
        assert res.failed == (0, 1)
        assert sorted(res.failed_blocks) == sorted(zip(remote, local))
        with pytest.raises(segxfer.SegxferError) as e:
            res.raise_for_state()
        assert e.value.result is res and e.value.name == res.error_name
        b.close()
        seg.close()
    finally:
        p.close()


def test_agent_numpy_and_torch_integer_scalars(pair):
    """Engines hold block numbers, counts and groups as numpy integers or
    0-d torch tensors (an element of a block table): every integer argument
    takes them as it takes ints, and a numpy integer address is an address
    (not an array whose own 8 bytes would be read into).  bool is not a
    number."""
    i64, i32, u8 = numpy.int64, numpy.int32, numpy.uint8
    with pair.reader.open(pair.name) as seg:
        with seg.batch() as b:
            b.add_blocks(i64(1), torch.tensor(2), count=u8(2), group=i32(0),
                         layers=(i64(0), torch.tensor(LAYERS)), slots=[i64(0), "V"])
            b.add_blocks(numpy.uint64(9), i64(9), slots=i64(1))
            b.submit().wait(10)
            assert b.result().ok and b.result().n_entries == 2
        pair.expect([1, 2], [2, 3])
        pair.expect([9], [9], slots=(1,))
        k = {(r["group"], r["slot"]): r for r in seg.regions()}[(0, 0)]
        raw = (ctypes.c_char * BLOCK_BYTES)()
        with seg.read_ranges([(numpy.uint64(ctypes.addressof(raw)), i32(k["id"]),
                               i64(3 * BLOCK_BYTES), i64(BLOCK_BYTES))]) as b:
            assert b.wait(10) and b.result().ok
        assert bytes(raw) == block(pair.tmem[0], TARGET_BLOCKS, 0, 3)
        with seg.batch() as b:
            for kw in (dict(remote_block=True), dict(slots=True), dict(count=numpy.float64(1)),
                       dict(group=True)):
                args = dict(remote_block=0, local_block=0)
                args.update(kw)
                with pytest.raises(segxfer.SX_EINVAL):
                    b.add_blocks(**args)
    r = pair.reader.register(bytearray(4 * BLOCK_BYTES), block_bytes=i64(BLOCK_BYTES),
                             group=i32(6), layers=torch.tensor(1), slot=i64(1),
                             num_blocks=u8(4))
    assert (r.group, r.slot, r.num_blocks, r.block_bytes) == (6, 1, 4, BLOCK_BYTES)
    assert type(r.group) is int and type(r.num_blocks) is int
