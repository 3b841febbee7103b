"""segxfer on a real Redis Cluster (redis+cluster://, 3 masters and 3
replicas started here): sx-agent pools publish through it, a Python reader
takes the URL from SX_METADATA_URL, resolves every pool (their keys on
every master), checks the layouts and reads blocks; unpublished and killed
pools disappear from it."""
import time

import pytest

from conftest import LAYERS, LAYOUT, READER_BLOCKS, register_kv
from harness import Missing, RedisCluster, SxAgentProc, fill_pattern
import segxfer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    except Missing as e:
        pytest.skip(str(e))
    yield c
    c.stop()


def expect_fill(seg, mem, seed, remote, local):
    regions = {r["slot"]: r for r in seg.regions()}
    for s, buf in enumerate(mem):
        r = regions[s]
        for layer in range(LAYERS):
            for re, lo in zip(remote, local):
                off = layer * r["layer_stride"] + re * r["block_stride"]
                got = bytes(buf[(layer * READER_BLOCKS + lo) * 4096:
                                (layer * READER_BLOCKS + lo + 1) * 4096])
                assert got == fill_pattern(seed, r["id"], off, 4096), (s, layer, re)


def test_cluster_sx_agents_and_python_reader(cluster, monkeypatch):
    url = cluster.url("py")
    try:
        pools = [SxAgentProc(url, "pool-%d" % i, fill=40 + i) for i in range(6)]
    except Missing as e:
        pytest.skip(str(e))
    try:
        monkeypatch.setenv("SX_METADATA_URL", url)
        reader = segxfer.Agent(None, log_level="warn", **LAYOUT)
        mem = register_kv(reader, READER_BLOCKS)
        for i in range(6):
            with reader.open("pool-%d" % i) as seg:
                seg.check()
                with seg.read_blocks([1, 7, 30], [0, 5, 15]) as b:
                    assert b.wait(10) and b.result().ok
                expect_fill(seg, mem, 40 + i, [1, 7, 30], [0, 5, 15])
        # A pool that stops cleanly is gone at once; one that is killed,
        # within its lease (2 s).
        pools[0].stop()
        pools[1].proc.kill()
        pools[1].proc.wait()
        deadline = time.monotonic() + 10
        gone = set()
        while time.monotonic() < deadline and gone != {0, 1}:
            for i in (0, 1):
                try:
                    reader.open("pool-%d" % i, timeout=2).close()
                except segxfer.SegxferError as e:
                    assert e.name in ("SX_ENOENT", "SX_EGONE", "SX_ESTALE"), e
                    gone.add(i)
            time.sleep(0.2)
        assert gone == {0, 1}
        # The others are untouched.
        with reader.open("pool-5") as seg:
            with seg.read_blocks([2], [1]) as b:
                assert b.wait(10) and b.result().ok
            expect_fill(seg, mem, 45, [2], [1])
        reader.close()
    finally:
        for p in pools:
            p.stop()
