"""The LMDeploy-shaped migration backend, driven the way LMDeploy's CacheEngine
drives a backend (messages with LMDeploy's field names, an assignment built
like CacheEngine.migrate builds it), between a prefill and a decode backend:
the decode side finds the prefill engine by the segment name in its endpoint
info, checks the layout, and pulls blocks into other block ids."""
import asyncio
import enum
import json
from types import SimpleNamespace as NS

import pytest
import torch

import segxfer
from segxfer.lmdeploy_backend import SegxferMigrationBackend, store_without_secrets

LAYERS, UNIT = 4, 2 * 8 * 16 * 2   # K and V of 8 heads x 16 dims in fp16, per block


class MigrationProtocol(enum.Enum):
    TCP = enum.auto()
    RDMA = enum.auto()


def init_request(local, remote, blocks, remote_blocks, rank=0):
    return NS(local_engine_id=local, remote_engine_id=remote, protocol=MigrationProtocol.TCP,
              rank=rank, local_engine_config=NS(num_gpu_blocks=blocks, block_size=16),
              remote_engine_config=NS(num_gpu_blocks=remote_blocks, block_size=16))


class Engine:
    """One side: a [layers, blocks, UNIT bytes] cache, as LMDeploy's
    full_gpu_cache, and the backend calls CacheEngine.p2p_initialize makes."""

    def __init__(self, url, me, peer, blocks, peer_blocks, unit=UNIT, device="cpu", **kw):
        self.blocks, self.unit = blocks, unit
        self.cache = torch.randint(0, 255, (LAYERS, blocks, unit), dtype=torch.uint8).to(device)
        opts = dict(num_layers=LAYERS, dtype="fp16", tag="lmdeploy", log_level="warn")
        opts.update(kw)
        self.backend = SegxferMigrationBackend(url, **opts)
        self.backend.p2p_initialize(init_request(me, peer, blocks, peer_blocks))
        t = self.cache
        self.backend.register_memory_region(NS(
            protocol=MigrationProtocol.TCP, remote_engine_id=peer, mr_key=0,
            addr=t.data_ptr(), offset=t.storage_offset(), length=t.numel() * t.element_size()))
        # What CacheEngine.p2p_initialize returns to the proxy.
        self.endpoint = NS(protocol=MigrationProtocol.TCP, endpoint_info=json.dumps(
            self.backend.endpoint_info(peer, MigrationProtocol.TCP)))


def assignment(remote_engine_id, block_pairs, local_blocks, remote_blocks, unit=UNIT):
    """CacheEngine.migrate's assignment: block_id = (remote, local)."""
    batch = [NS(mr_key=0, target_offset=r * unit + layer * remote_blocks * unit,
                source_offset=l * unit + layer * local_blocks * unit, length=unit)
             for layer in range(LAYERS) for r, l in block_pairs]
    return NS(protocol=MigrationProtocol.TCP, remote_engine_id=remote_engine_id, batch=batch)


@pytest.fixture
def engines(url):
    prefill = Engine(url, "http://10.0.0.1:23333", "http://10.0.0.2:23334", 32, 16)
    decode = Engine(url, "http://10.0.0.2:23334", "http://10.0.0.1:23333", 16, 32)
    yield prefill, decode
    decode.backend.close()
    prefill.backend.close()


def test_lmdeploy_endpoint_info_is_a_name_not_an_address(engines):
    prefill, _ = engines
    info = json.loads(prefill.endpoint.endpoint_info)
    assert info["segment"] == "lmdeploy/http://10.0.0.1:23333/rank0"
    assert info["namespace"].startswith("t") and info["store"].startswith("redis://127.0.0.1")
    assert info["mr_keys"] == [0] and len(info["incarnation"]) == 32
    assert set(info) == {"segment", "store", "namespace", "incarnation", "mr_keys"}
    # Registered block by block: [layers, blocks, UNIT].
    regions = prefill.backend.agent.descriptor()["regions"]
    assert [(r["group"], r["layer_count"], r["num_blocks"], r["block_bytes"])
            for r in regions] == [(0, LAYERS, 32, UNIT)]


def test_lmdeploy_store_without_secrets():
    assert store_without_secrets("redis://u:pw@h1:6379/2?namespace=prod&timeout_ms=5") == \
        ("redis://h1:6379/2", "prod")
    assert store_without_secrets("redis+sentinel://a:b@s1:1,s2:2/mm") == \
        ("redis+sentinel://s1:1,s2:2/mm", "default")


def test_lmdeploy_connect_and_migrate_into_other_block_ids(engines):
    prefill, decode = engines
    decode.backend.p2p_connect("http://10.0.0.1:23333", prefill.endpoint)
    # CacheEngine.migrate takes the peer's layer stride from the link.
    link = decode.backend.links["http://10.0.0.1:23333"]
    assert link.remote_engine_config.num_gpu_blocks == 32
    assert link.local_engine_config.num_gpu_blocks == 16 and link.rank == 0
    pairs = [(7, 0), (3, 5), (20, 6), (21, 7), (31, 15)]
    batch = decode.backend.p2p_migrate(assignment("http://10.0.0.1:23333", pairs, 16, 32))
    res = batch.result()
    assert res.ok and res.bytes == LAYERS * len(pairs) * UNIT
    # 20,21 -> 6,7 merged, on every layer: fewer ranges than tasks.
    assert res.n_entries == LAYERS * len(pairs) and res.n_ranges < res.n_entries
    for r, l in pairs:
        assert torch.equal(decode.cache[:, l], prefill.cache[:, r])
    untouched = [b for b in range(16) if b not in {l for _, l in pairs}]
    assert not torch.equal(decode.cache[:, untouched], prefill.cache[:, untouched])


def test_lmdeploy_migrate_async_op_is_awaited_on_the_loop(engines):
    prefill, decode = engines
    decode.backend.p2p_connect("http://10.0.0.1:23333", prefill.endpoint)

    async def main():
        a1 = assignment("http://10.0.0.1:23333", [(1, 1), (2, 2)], 16, 32)
        a2 = assignment("http://10.0.0.1:23333", [(9, 9)], 16, 32)
        b1 = decode.backend.p2p_migrate(a1, async_op=True)
        b2 = decode.backend.p2p_migrate(a2, async_op=True)
        r = await asyncio.gather(b1, b2)
        # The synchronous form is awaitable too (LMDeploy awaits it).
        r.append(await decode.backend.p2p_migrate(
            assignment("http://10.0.0.1:23333", [(4, 3)], 16, 32)))
        return r

    assert all(r.ok for r in asyncio.run(main()))
    for r, l in ((1, 1), (2, 2), (9, 9), (4, 3)):
        assert torch.equal(decode.cache[:, l], prefill.cache[:, r])


def test_lmdeploy_connect_refuses_another_layout(url):
    prefill = Engine(url, "p-engine", "d-engine", 32, 16)
    # Half the heads: another block size, refused before any byte moves.
    decode = Engine(url, "d-engine", "p-engine", 16, 32, unit=UNIT // 2)
    other = Engine(url, "d2-engine", "p-engine", 16, 32, dtype="bf16")
    try:
        with pytest.raises(segxfer.IncompatibleLayout) as e:
            decode.backend.p2p_connect("p-engine", prefill.endpoint)
        assert e.value.kind == "block_bytes"
        assert (e.value.local, e.value.remote) == (str(UNIT // 2), str(UNIT))
        with pytest.raises(segxfer.IncompatibleLayout) as e:
            other.backend.p2p_connect("p-engine", prefill.endpoint)
        assert (e.value.field, e.value.local, e.value.remote) == ("dtype", "bf16", "fp16")
        with pytest.raises(segxfer.SX_EINVAL, match="not connected"):
            decode.backend.p2p_migrate(assignment("p-engine", [(0, 0)], 16, 32))
        assert prefill.backend.agent.status()["served_reads"] == 0
    finally:
        for e in (other, decode, prefill):
            e.backend.close()


def test_lmdeploy_bad_assignments(engines):
    prefill, decode = engines
    peer = "http://10.0.0.1:23333"
    decode.backend.p2p_connect(peer, prefill.endpoint)
    b = decode.backend
    for tasks, err, match in (
            ([NS(mr_key=0, target_offset=0, source_offset=16 * UNIT * LAYERS, length=UNIT)],
             segxfer.SX_EBOUNDS, "outside the"),
            ([NS(mr_key=0, target_offset=32 * UNIT * LAYERS, source_offset=0, length=UNIT)],
             segxfer.SX_EBOUNDS, "outside"),
            ([NS(mr_key=1, target_offset=0, source_offset=0, length=UNIT)],
             segxfer.SX_EINVAL, "mr_key 1"),
            ([NS(mr_key="x", target_offset=0, source_offset=0, length=UNIT)],
             segxfer.SX_EINVAL, "not an integer"),
            ([NS(mr_key=0, target_offset=-1, source_offset=0, length=UNIT)],
             segxfer.SX_EINVAL, "target_offset"),
            ([NS(mr_key=0, target_offset=0, source_offset=0, length=0)],
             segxfer.SX_EBOUNDS, "length")):
        with pytest.raises(err, match=match):
            b.p2p_migrate(NS(remote_engine_id=peer, batch=tasks))
    with pytest.raises(segxfer.SX_EINVAL, match="other memory"):
        b.register_memory_region(NS(remote_engine_id=peer, mr_key=0, addr=1, offset=0,
                                    length=UNIT))
    # The same region again (LMDeploy registers it per link): a no-op.
    t = decode.cache
    b.register_memory_region(NS(remote_engine_id=peer, mr_key=0, addr=t.data_ptr(),
                                offset=0, length=t.numel()))
    b.p2p_drop_connect(peer)
    with pytest.raises(segxfer.SX_EINVAL, match="not connected"):
        b.p2p_migrate(assignment(peer, [(0, 0)], 16, 32))


def test_lmdeploy_assignment_numbers_of_any_integer_kind(engines):
    """Offsets an engine computed with numpy (or torch) are taken as ints;
    values outside 0 .. 2**64-1, bools and a missing batch are SX_EINVAL
    naming the field, never an OverflowError or a TypeError."""
    import numpy
    prefill, decode = engines
    peer = "http://10.0.0.1:23333"
    decode.backend.p2p_connect(peer, prefill.endpoint)
    b = decode.backend
    task = NS(mr_key=numpy.int64(0), target_offset=numpy.int64(5 * UNIT),
              source_offset=torch.tensor(2 * UNIT), length=numpy.uint32(UNIT))
    b.p2p_migrate(NS(remote_engine_id=peer, batch=[task]))
    assert torch.equal(decode.cache[0, 2], prefill.cache[0, 5])
    for field, value in (("target_offset", 2**64), ("source_offset", 2**64),
                         ("length", 2**70), ("source_offset", True), ("length", 1.5)):
        t = NS(mr_key=0, target_offset=0, source_offset=0, length=UNIT)
        setattr(t, field, value)
        with pytest.raises(segxfer.SX_EINVAL, match=field):
            b.p2p_migrate(NS(remote_engine_id=peer, batch=[t]))
    for batch in (None, 5, "tasks"):
        with pytest.raises(segxfer.SX_EINVAL, match="batch"):
            b.p2p_migrate(NS(remote_engine_id=peer, batch=batch))


def test_lmdeploy_bad_settings_and_endpoint_info(engines, url, monkeypatch):
    """A layer count that is not a positive integer (argument or
    SEGXFER_NUM_LAYERS), and endpoint info that is not what endpoint_info()
    returns, are SX_EINVAL naming them, not ValueError, KeyError or
    AttributeError from inside the backend."""
    for bad in ("abc", "-2", "0", "2.5"):
        monkeypatch.setenv("SEGXFER_NUM_LAYERS", bad)
        with pytest.raises(segxfer.SX_EINVAL, match="SEGXFER_NUM_LAYERS"):
            SegxferMigrationBackend(url)
    monkeypatch.delenv("SEGXFER_NUM_LAYERS")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(segxfer.SX_EINVAL, match="num_layers"):
            SegxferMigrationBackend(url, num_layers=bad)
    assert SegxferMigrationBackend(url, num_layers="4").num_layers == 4
    _, decode = engines
    peer = "http://10.0.0.1:23333"
    for info, match in (("{bad", "not JSON"), ("{}", "no segment name"), ("[]", "no segment"),
                        (json.dumps({"segment": 5}), "no segment")):
        with pytest.raises(segxfer.SX_EINVAL, match=match):
            decode.backend.p2p_connect(peer, NS(endpoint_info=info))


def test_lmdeploy_restarted_peer_is_stale(url):
    prefill = Engine(url, "p-engine", "d-engine", 32, 16)
    decode = Engine(url, "d-engine", "p-engine", 16, 32)
    try:
        old = prefill.endpoint
        prefill.backend.close()
        prefill = Engine(url, "p-engine", "d-engine", 32, 16)  # a new incarnation
        with pytest.raises(segxfer.SX_ESTALE, match="restarted"):
            decode.backend.p2p_connect("p-engine", old)
        decode.backend.p2p_connect("p-engine", prefill.endpoint)
    finally:
        decode.backend.close()
        prefill.backend.close()


def test_nvlink_and_cuda_ipc_choices_keep_the_tcp_control_connection():
    """cuda_ipc hands its IPC handles over TCP's control connection: an
    engine that publishes with cuda_ipc alone would be refused at publish
    (found on an H100: "cuda_ipc needs tcp as well"; the NVLINK case of
    test_lmdeploy_engine.py and the cuda_ipc case of test_vllm_connector.py
    run it on a GPU)."""
    from segxfer.agent import serving_transports
    proto = enum.Enum("MigrationProtocol", "TCP RDMA NVLINK")
    pick = SegxferMigrationBackend._transports_for
    assert pick(proto.NVLINK) == "cuda_ipc,tcp"
    assert pick(proto.TCP) == "tcp" and pick(proto.RDMA) == "auto"
    assert serving_transports("cuda_ipc") == "cuda_ipc,tcp"
    assert serving_transports(["cuda_ipc"]) == ["cuda_ipc", "tcp"]
    assert serving_transports("tcp,cuda_ipc") == "tcp,cuda_ipc"
    assert serving_transports("rdma") == "rdma"
    assert serving_transports("auto") == "auto" and serving_transports(None) is None
