"""The package on GPU memory: CUDA tensors registered with the location of
their device, raw device addresses located by the library
(sx_mem_location), reads between CUDA and host memory over staged TCP and
over cuda_ipc (from an sx-agent holding its pool on the GPU, checked against
its fill pattern), the LMDeploy backend on CUDA caches, and push-mode
writes into and out of GPU memory.

Without a CUDA device (torch.cuda.is_available() False, as on the CI
machine) every test but the first skips and says so; the GPU machine runs
them (docs/python.md, "GPU").  The first checks the test's oracle, the
Python copy of sx-agent's fill pattern, against a real sx-agent on the CPU.
"""
import pytest
import torch

import segxfer
from conftest import (BLOCK_BYTES, LAYERS, LAYOUT, READER_BLOCKS, TARGET_BLOCKS,
                      fill_pattern)

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="no CUDA device here "
                               "(torch.cuda.is_available() is False)")
DEV = "cuda:0"
SEED = 0x5EED


def caches(blocks, device, seed=None):
    """K and V caches [LAYERS, blocks, BLOCK_BYTES] of uint8 on device:
    zeros, or random bytes from seed (made on the CPU, then moved)."""
    if seed is None:
        return [torch.zeros(LAYERS, blocks, BLOCK_BYTES, dtype=torch.uint8, device=device)
                for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (LAYERS, blocks, BLOCK_BYTES), generator=g,
                          dtype=torch.uint8).to(device) for _ in range(2)]


def register(agent, kv, **kw):
    for slot, t in zip(("K", "V"), kv):
        agent.register_blocks(t, slot, **kw)


def expect_fill(seg, kv, remote, local):
    """kv's blocks local[i] hold the sx-agent's fill of its blocks remote[i]."""
    regions = {r["slot"]: r for r in seg.regions()}
    for s, t in enumerate(kv):
        r = regions[s]
        got = t.cpu()
        for layer in range(LAYERS):
            for re, lo in zip(remote, local):
                off = layer * r["layer_stride"] + re * r["block_stride"]
                want = fill_pattern(SEED, r["id"], off, BLOCK_BYTES)
                assert bytes(got[layer, lo].numpy().tobytes()) == want, (s, layer, re, lo)


def test_gpu_fill_pattern_oracle_matches_sx_agent(reader, sx_agent):
    sx_agent("pool-0", fill=SEED)
    with reader.open("pool-0") as seg:
        with seg.read_blocks([3, 30], [0, 9]) as b:
            assert b.wait(10) and b.result().ok
        kv = [torch.frombuffer(m, dtype=torch.uint8).view(LAYERS, READER_BLOCKS, BLOCK_BYTES)
              for m in reader.mem]
        expect_fill(seg, kv, [3, 30], [0, 9])
        with pytest.raises(AssertionError):
            expect_fill(seg, kv, [4], [0])      # another block's fill differs


@needs_gpu
def test_gpu_locations_of_tensors_and_raw_addresses(url):
    t = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    assert segxfer.pointer_location(t.data_ptr(), t.numel()) == DEV
    assert segxfer.pointer_location(t[4096:].data_ptr(), 4096) == DEV
    pinned = torch.empty(8192, dtype=torch.uint8).pin_memory()
    assert segxfer.pointer_location(pinned.data_ptr(), 8192) == "cpu"
    with pytest.raises(segxfer.SX_EBOUNDS, match="not inside one allocation"):
        segxfer.pointer_location(t.data_ptr(), 1 << 40)
    with segxfer.Agent("loc-0", url, log_level="warn", **LAYOUT) as a:
        r1 = a.register_blocks(t.view(4, 64, 4096), "K")       # the tensor's device
        r2 = a.register(addr=pinned.data_ptr(), length=8192, block_bytes=4096, group=1)
        r3 = a.register(addr=t.data_ptr() + (1 << 19), length=1 << 19, group=2,
                        block_bytes=4096)                      # a raw device address
        assert (r1.location, r2.location, r3.location) == (DEV, "cpu", DEV)
        with pytest.raises(segxfer.SX_EINVAL, match="memory of cuda:0|not device memory"):
            a.register(addr=pinned.data_ptr(), length=8192, block_bytes=4096, group=3,
                       location=DEV)
        a.publish()
        assert [r["location"] for r in a.descriptor()["regions"]] == [DEV, "cpu", DEV]


@needs_gpu
@pytest.mark.parametrize("target_dev, reader_dev", [(DEV, DEV), (DEV, "cpu"), ("cpu", DEV)])
def test_gpu_staged_tcp_reads(url, target_dev, reader_dev):
    src, dst = caches(TARGET_BLOCKS, target_dev, seed=3), caches(READER_BLOCKS, reader_dev)
    with segxfer.Agent("gpu-t", url, transports="tcp", log_level="warn", **LAYOUT) as t, \
            segxfer.Agent(None, url, transports="tcp", log_level="warn", **LAYOUT) as r:
        register(t, src)
        t.publish()
        register(r, dst)
        remote, local = [3, 17, 18, 31], [0, 5, 6, 15]
        with r.open("gpu-t") as seg:
            assert seg.transport == "tcp"
            # Block ids may be a CUDA tensor too (copied to the host once).
            with seg.read_blocks(torch.tensor(remote, device=DEV), local) as b:
                assert b.wait(10)
                assert b.result().ok, b.result()
                assert b.result().bytes == len(remote) * 2 * LAYERS * BLOCK_BYTES
        for s in range(2):
            for re, lo in zip(remote, local):
                assert torch.equal(dst[s][:, lo].cpu(), src[s][:, re].cpu()), (s, re, lo)
        assert not dst[0][:, 1].any()


@needs_gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp"])
def test_gpu_reads_from_an_sx_agent_pool_on_the_gpu(url, sx_agent, transport):
    sx_agent("gpu-pool", fill=SEED, extra=("--location", DEV))
    dst = caches(READER_BLOCKS, DEV)
    with segxfer.Agent(None, url, transports=transport, log_level="warn", **LAYOUT) as r:
        register(r, dst)
        with r.open("gpu-pool") as seg:
            assert seg.transport == transport
            assert {x["location"] for x in seg.regions()} == {DEV}
            remote, local = [0, 7, 8, 9, 31], [15, 2, 3, 4, 0]

            async def pull():
                return await seg.read_blocks(remote, local, timeout=10)
            import asyncio
            res = asyncio.run(pull())
            assert res.ok and res.transport == transport
            expect_fill(seg, dst, remote, local)
            assert not dst[1][:, 1].any()


@needs_gpu
def test_gpu_lmdeploy_backend_on_cuda_caches(url):
    from test_lmdeploy_backend import LAYERS as LM_LAYERS, Engine, assignment
    prefill = Engine(url, "p-gpu", "d-gpu", 32, 16, device=DEV)
    decode = Engine(url, "d-gpu", "p-gpu", 16, 32, device=DEV)
    try:
        # LMDeploy hands over raw data_ptr() values: the library located them.
        regions = prefill.backend.agent.descriptor()["regions"]
        assert [r["location"] for r in regions] == [DEV]
        decode.backend.p2p_connect("p-gpu", prefill.endpoint)
        pairs = [(7, 0), (20, 6), (21, 7), (31, 15)]
        res = decode.backend.p2p_migrate(assignment("p-gpu", pairs, 16, 32)).result()
        assert res.ok and res.bytes == LM_LAYERS * len(pairs) * decode.unit
        for r, l in pairs:
            assert torch.equal(decode.cache[:, l], prefill.cache[:, r])
    finally:
        decode.backend.close()
        prefill.backend.close()


@needs_gpu
@pytest.mark.parametrize("producer_dev, consumer_dev", [(DEV, DEV), ("cpu", DEV), (DEV, "cpu")])
def test_gpu_push_writes(url, producer_dev, consumer_dev):
    src, dst = caches(TARGET_BLOCKS, producer_dev, seed=5), caches(READER_BLOCKS, consumer_dev)
    with segxfer.Agent("gpu-c", url, transports="tcp", log_level="warn", **LAYOUT) as c, \
            segxfer.Agent("gpu-p", url, transports="tcp", log_level="warn", **LAYOUT) as p:
        register(c, dst, writable=True)
        c.publish()
        c.grant_write("gpu-p")
        register(p, src)
        p.publish()
        with p.open("gpu-c") as seg:
            with seg.write_blocks([4, 5, 30], [1, 2, 9], tag=99, timeout=10) as b:
                assert b.wait(15)
                res = b.result()
            if res.error_name == "SX_ENOTSUP":
                pytest.skip("the library refuses this write: " + res.message)
            assert res.ok, res
        n = c.next_notice(5)
        assert n is not None and n.tag == 99 and list(n.block_ids()) == [1, 2, 9]
        for s in range(2):
            for lo, re in zip([4, 5, 30], [1, 2, 9]):
                assert torch.equal(dst[s][:, re].cpu(), src[s][:, lo].cpu()), (s, lo, re)
