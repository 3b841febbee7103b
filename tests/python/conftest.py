"""Shared fixtures: the package from this tree, a real redis-server on a free
loopback port for the session, a namespace per test, and agent pairs (the
parts that need no pytest are in harness.py).

Run with Debian's interpreter (the one python3-torch and python3-pytest
install into):  /usr/bin/python3 -m pytest tests/python
SEGXFER_BUILD names the build tree (default build/); SEGXFER_LIB overrides
the library itself.
"""
import re

import pytest

# Re-exported for the tests (from conftest import ...).
from harness import (BLOCK_BYTES, BUILD, LAYERS, LAYOUT, READER_BLOCKS, ROOT,  # noqa: F401
                     TARGET_BLOCKS, Missing, RedisServer, SxAgentProc, fill_pattern)
import segxfer  # noqa: E402  (harness put this tree's package on the path)


@pytest.fixture(scope="session")
def redis(tmp_path_factory):
    try:
        r = RedisServer(tmp_path_factory.mktemp("redis"))
    except Missing as e:
        pytest.skip(str(e))
    yield r
    r.stop()


_seq = [0]


@pytest.fixture
def url(redis, request):
    """A metadata URL with a namespace of this test's own."""
    _seq[0] += 1
    ns = ("t%d-%s" % (_seq[0], re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)))[:60]
    return "redis://127.0.0.1:%d?namespace=%s" % (redis.port, ns)


def stamp(seed, layer, b):
    """Block b of layer in pattern(..., seed): its bytes."""
    return bytes([seed & 0xFF, layer, b & 0xFF, b >> 8]) * (BLOCK_BYTES // 4)


def pattern(layers, blocks, seed):
    """A cache whose every block is recognisable: bytes of (seed, layer, block)."""
    out = bytearray(layers * blocks * BLOCK_BYTES)
    for layer in range(layers):
        for b in range(blocks):
            off = (layer * blocks + b) * BLOCK_BYTES
            out[off:off + BLOCK_BYTES] = stamp(seed, layer, b)
    return out


def block(buf, blocks, layer, b):
    off = (layer * blocks + b) * BLOCK_BYTES
    return bytes(buf[off:off + BLOCK_BYTES])


def register_kv(agent, blocks, seed=None):
    """K and V caches of LAYERS layers x blocks blocks (bytearrays)."""
    mem = []
    for slot in ("K", "V"):
        buf = pattern(LAYERS, blocks, seed + (slot == "V")) if seed is not None else \
            bytearray(LAYERS * blocks * BLOCK_BYTES)
        agent.register(buf, layers=LAYERS, slot=slot, block_bytes=BLOCK_BYTES)
        mem.append(buf)
    return mem


class Pair:
    """A published target (pattern-filled) and a reader with a smaller
    cache of the same layout, in this process."""

    def __init__(self, url, name="prefill-0", seed=7, **reader_kw):
        self.name, self.seed = name, seed
        self.target = segxfer.Agent(name, url, lease_ms=2000, log_level="warn", **LAYOUT)
        self.tmem = register_kv(self.target, TARGET_BLOCKS, seed)
        self.target.publish()
        kw = dict(LAYOUT, log_level="warn")
        kw.update(reader_kw)
        self.reader = segxfer.Agent(None, url, **kw)
        self.rmem = register_kv(self.reader, READER_BLOCKS)

    def expect(self, remote, local, slots=(0, 1), layers=range(LAYERS)):
        for s in slots:
            for layer in layers:
                for r, l in zip(remote, local):
                    assert block(self.rmem[s], READER_BLOCKS, layer, l) == \
                        block(self.tmem[s], TARGET_BLOCKS, layer, r), (s, layer, r, l)

    def close(self):
        self.reader.close()
        self.target.close()


@pytest.fixture
def pair(url):
    p = Pair(url)
    yield p
    p.close()


@pytest.fixture
def sx_agent(url):
    procs = []

    def start(name, **kw):
        try:
            p = SxAgentProc(url, name, **kw)
        except Missing as e:
            pytest.skip(str(e))
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def reader(url):
    a = segxfer.Agent(None, url, log_level="error", **LAYOUT)
    a.mem = register_kv(a, READER_BLOCKS)
    yield a
    a.close()


@pytest.fixture
def stuck(reader, sx_agent):
    """(segment, its owner): an sx-agent that is stopped (SIGSTOP) after the
    reader opened it, so batches on it hang until their deadline or a
    cancel.  target.resume() lets them finish."""
    target = sx_agent("stuck-0")
    seg = reader.open("stuck-0")
    target.pause()
    yield seg, target
    seg.close()


def cancel_while_awaited(batch):
    """Await batch in a task and cancel the task: the batch is cancelled
    with it (pytest.raises checks the task ends CancelledError)."""
    import asyncio

    async def main():
        task = asyncio.ensure_future(batch._wait_async())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())

