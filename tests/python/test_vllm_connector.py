"""segxfer.vllm.SegxferConnector called as vLLM calls a V1 KV connector,
between a prefill engine (a spawned process) and a decode engine (this
process); the call order is read from vLLM's source, see vllm_engine.py.

The connector implements KVConnectorBase_V1 as vLLM defines it
(vllm/distributed/kv_transfer/kv_connector/v1/base.py at commit
13f4ad0f55b08ca1d37d1459f50ce950feaeb547) and follows its NIXL connector's
request life cycle (v1/nixl_connector.py at commit
002a1057e9ae674d7bdc9c4be95bc29d65d2e808).  vLLM is not installed here, so
the base class is segxfer's stand-in with the same methods.

On a CUDA machine the main test also runs on cuda:0 caches over cuda_ipc and
staged TCP; here those cases skip.
"""
import os
import signal
import time

import pytest
import torch

from segxfer import _vllm_base, vllm as sxvllm
import vllm_engine as ve
from engine_proc import EngineProcess

CUDA = torch.cuda.is_available()
PREFILL_BLOCKS, DECODE_BLOCKS = 32, 24
NUM_TOKENS = 5 * ve.BLOCK_SIZE - 3          # five blocks, the last one partly filled


class Prefill(EngineProcess):
    """The prefill engine in a spawned process (the proxy's end of its pipe)."""

    def __init__(self, device="cpu", **extra):
        super().__init__(ve.prefill_main, PREFILL_BLOCKS, device, extra)


@pytest.fixture
def store(url, monkeypatch):
    monkeypatch.setenv("SX_METADATA_URL", url)
    return url


def load(decode, req_id, params, local, seconds=20):
    """The decode engine's side of a remote prefill, as vLLM's scheduler
    and workers call it: matched tokens, allocation, then steps until the
    request is reported received (asynchronous loads) or for one step (in
    the step).  Returns (steps, invalid block ids)."""
    req = ve.Request(req_id, NUM_TOKENS, dict(params))
    n, is_async = decode.scheduler.get_num_new_matched_tokens(req, 0)
    assert n == NUM_TOKENS
    decode.scheduler.update_state_after_alloc(req, ve.KVCacheBlocks(local), n)
    assert req.kv_transfer_params["do_remote_prefill"] is False   # one transfer per request
    # Asked again (the scheduler may): no second load.
    assert decode.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    invalid = set()
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        _, recving, bad = decode.step()
        steps += 1
        invalid |= bad
        if not is_async or req_id in recving:
            assert is_async or not recving   # in-step loads are not "received" later
            return steps, invalid
        time.sleep(0.01)
    raise AssertionError("request %s was never reported received" % req_id)


@pytest.mark.parametrize("device,transports", [
    ("cpu", "tcp"),
    pytest.param("cuda:0", "cuda_ipc", marks=pytest.mark.skipif(not CUDA, reason="no CUDA")),
    pytest.param("cuda:0", "tcp", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))])
def test_vllm_decode_reads_prefill_and_prefill_frees_after_the_read_notice(store, device,
                                                                           transports):
    prefill = Prefill(device, transports=transports)
    decode = ve.Engine("decode-engine", "kv_consumer", DECODE_BLOCKS, device,
                       transports=transports, open_timeout=1)
    try:
        # The prefill finishes a request; request_finished keeps its blocks
        # and says where they are: a segment name and block ids, no address.
        pblocks = [5, 9, 10, 11, 20]
        delay, params = prefill.call("prefill", "req-1", NUM_TOKENS, pblocks, 1)
        assert delay is True
        assert params == dict(do_remote_prefill=True, do_remote_decode=False,
                              remote_block_ids=pblocks, remote_engine_id="prefill-engine",
                              remote_request_id="req-1",
                              remote_segment="vllm/prefill-engine", tp_size=1)
        # Held while nobody read them: steps report nothing sent.
        for _ in range(5):
            assert prefill.call("step") == (set(), set(), set())
            time.sleep(0.05)
        # The decode loads asynchronously, between scheduler steps.
        local = [0, 3, 4, 7, 15]
        steps, invalid = load(decode, "dec-1", params, local)
        assert invalid == set()
        want = prefill.call("blocks", pblocks)
        assert want.abs().sum() > 0
        assert torch.equal(decode.blocks(local), want)                 # bitwise
        others = [b for b in range(DECODE_BLOCKS) if b not in local]
        assert not decode.blocks(others).any()
        # The read notice arrived before the batch completed: the very next
        # prefill step frees the request's blocks.
        assert prefill.call("steps_until_sent", "req-1", 10) == {"req-1"}
        seg = decode.worker.connector_worker._segments["vllm/prefill-engine/tp0"]
        assert seg.transport == transports
        # Parameters claiming a tp size the prefill does not run (its rank 1
        # is never published): the set does not open, load errors.
        assert load(decode, "dec-tp", dict(params, tp_size=2), [1, 2, 6, 8, 9])[1] == \
            {1, 2, 6, 8, 9}
        assert not decode.blocks([1, 2, 6, 8, 9]).any()

        # In-step loads (load_async False): each layer awaited by
        # wait_for_layer_load; the prefill frees after notices of every layer.
        sync = ve.Engine("decode-sync", "kv_consumer", DECODE_BLOCKS, device,
                         transports=transports, load_async=False)
        try:
            delay, params = prefill.call("prefill", "req-2", NUM_TOKENS, [1, 2, 3, 4, 30], 2)
            steps, invalid = load(sync, "dec-2", params, [10, 11, 12, 13, 14])
            assert steps == 1 and invalid == set()
            assert torch.equal(sync.blocks([10, 11, 12, 13, 14]),
                               prefill.call("blocks", [1, 2, 3, 4, 30]))
            assert prefill.call("steps_until_sent", "req-2", 10) == {"req-2"}
        finally:
            sync.close()
    finally:
        decode.close()
        prefill.stop()


def test_vllm_incompatible_decode_reads_nothing_and_expired_blocks_go(store):
    """vLLM's compatibility hash is the fingerprint: a decode of another
    model is refused by check() before any read, its blocks are load errors,
    and the prefill keeps its blocks until abort_request_timeout."""
    prefill = Prefill(abort_request_timeout=2)
    other = ve.Engine("decode-other", "kv_consumer", DECODE_BLOCKS, model="another-model")
    try:
        delay, params = prefill.call("prefill", "req-x", NUM_TOKENS, [1, 2, 3, 4, 5], 3)
        _, invalid = load(other, "dec-x", params, [0, 1, 2, 3, 4])
        assert invalid == {0, 1, 2, 3, 4}
        assert not other.blocks(range(DECODE_BLOCKS)).any()
        assert prefill.call("served_reads") == 0
        # No notice: the blocks stay until the timeout, then go.
        assert prefill.call("step")[0] == set()
        assert prefill.call("steps_until_sent", "req-x", 10) == {"req-x"}
    finally:
        other.close()
        prefill.stop()


def test_vllm_killed_prefill_gives_load_errors_not_a_hang(store):
    # A lease that outlives the test: the dead prefill's name stays held.
    prefill = Prefill(lease_ms=120000)
    decode = ve.Engine("decode-engine", "kv_consumer", DECODE_BLOCKS, transfer_timeout=5,
                       open_timeout=2)
    try:
        # One load while the prefill lives: the decode holds its segment
        # open, so the next load fails on the data path, in the batch.
        delay, params = prefill.call("prefill", "req-a", NUM_TOKENS, [1, 2, 3, 4, 5], 5)
        assert load(decode, "dec-a", params, [20, 21, 22, 23, 16])[1] == set()
        delay, params = prefill.call("prefill", "req-k", NUM_TOKENS, [6, 7, 8, 9, 10], 4)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.join(10)
        start = time.monotonic()
        _, invalid = load(decode, "dec-k", params, [2, 3, 5, 8, 13], seconds=15)
        assert invalid == {2, 3, 5, 8, 13}
        assert time.monotonic() - start < 10
        # Reported once: later steps have nothing for it.
        assert decode.step() == (set(), set(), set())
        # The prefill restarts under the same engine id (a new incarnation)
        # before its old lease lapsed: refused, unless it takes the name
        # over; the decode then opens it anew and reads from it.
        prefill = Prefill()
        with pytest.raises(AssertionError, match="SX_EHELD.*wait for the old lease"):
            prefill.call("step")
        prefill.stop()
        prefill = Prefill(takeover=True)
        delay, params = prefill.call("prefill", "req-b", NUM_TOKENS, [11, 12, 13, 14, 15], 6)
        assert load(decode, "dec-b", params, [2, 3, 5, 8, 13])[1] == set()
        assert torch.equal(decode.blocks([2, 3, 5, 8, 13]),
                           prefill.call("blocks", [11, 12, 13, 14, 15]))
    finally:
        decode.close()
        prefill.stop()


def test_vllm_connector_shape():
    """Loadable as vLLM loads it; the stand-in base has vLLM's methods; the
    scheduler side needs no agent; a bad configuration is refused."""
    cfg = ve.vllm_config("e", "kv_both")
    cls = ve.connector_class(cfg.kv_transfer_config)
    assert cls is sxvllm.SegxferConnector
    assert issubclass(cls, _vllm_base.KVConnectorBase_V1)
    base = _vllm_base.KVConnectorBase_V1
    assert [m for m in _vllm_base.VLLM_METHODS if not hasattr(base, m)] == []
    for m in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
              "request_finished", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
              "save_kv_layer", "wait_for_save", "get_finished",
              "get_block_ids_with_load_errors", "shutdown"):
        assert getattr(cls, m) is not getattr(base, m), m
    sched = cls(cfg, _vllm_base.KVConnectorRole.SCHEDULER)
    assert sched.connector_worker is None and sched.role == _vllm_base.KVConnectorRole.SCHEDULER
    # The compatibility hash covers the model: another model, another hash.
    assert sxvllm.compat_hash(cfg) == sxvllm.compat_hash(ve.vllm_config("f", "kv_both"))
    assert sxvllm.compat_hash(cfg) != sxvllm.compat_hash(ve.vllm_config("e", "kv_both",
                                                                        model="other"))
    assert sxvllm.notify_tag("req-1") == sxvllm.notify_tag("req-1") != sxvllm.notify_tag("r")
    # The decode's tp size rides in the tag's low byte; the rest is the request's.
    assert sxvllm.notify_tag("req-1", 4) == sxvllm.notify_tag("req-1") + 3
    with pytest.raises(ValueError):
        sxvllm.notify_tag("req-1", 256)
    # Which prefill ranks a decode rank reads, and how many decode ranks
    # read one prefill rank (NIXL's consumers_per_producer).
    assert sxvllm.source_ranks(1, 2, 2) == [1]
    assert sxvllm.source_ranks(1, 2, 4) == [2, 3]           # fan-in: heads side by side
    assert sxvllm.source_ranks(3, 4, 2) == [1]              # fan-out: a head slice
    with pytest.raises(sxvllm.SegxferError, match="one must divide the other"):
        sxvllm.source_ranks(0, 2, 3)                        # no ratio: refused, as NIXL
    assert [sxvllm.readers_per_rank(d, p) for d, p in ((1, 2), (2, 2), (4, 2), (8, 1))] == \
        [1, 1, 2, 8]
    bad = ve.vllm_config("e", "kv_both")
    bad.kv_transfer_config = None
    with pytest.raises(ValueError, match="kv_transfer_config"):
        cls(bad, _vllm_base.KVConnectorRole.SCHEDULER)
    nourl = ve.vllm_config("e", "kv_both")
    env = os.environ.pop("SX_METADATA_URL", None)
    try:
        with pytest.raises(ValueError, match="metadata URL"):
            cls(nourl, _vllm_base.KVConnectorRole.WORKER)
    finally:
        if env is not None:
            os.environ["SX_METADATA_URL"] = env
    # Requests without transfer parameters are none of the connector's business.
    req = ve.Request("plain", 10, None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.request_finished(req, [1, 2]) == (False, None)
    # kv_transfer_params come with the client's request: bad ones are
    # refused (the KV is computed locally), never an exception in the
    # scheduler or a request waiting forever.
    good = dict(do_remote_prefill=True, remote_block_ids=[1, 2], remote_engine_id="p",
                remote_request_id="r", remote_segment="vllm/p", tp_size=1)
    for key, value in (("remote_block_ids", 7), ("remote_block_ids", [1, -2]),
                       ("remote_block_ids", ["1"]), ("remote_block_ids", [True]),
                       ("remote_segment", ""), ("remote_segment", None),
                       ("remote_segment", "x" * 300), ("tp_size", 0), ("tp_size", "1"),
                       ("remote_request_id", [1]), ("remote_segment", KeyError),
                       ("remote_block_ids", [])):
        params = dict(good)
        if value is KeyError:
            del params[key]
        else:
            params[key] = value
        req = ve.Request("bad", 20, params)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False), (key, value)
        sched.update_state_after_alloc(req, ve.KVCacheBlocks([1, 2]), 0)
        assert sched.build_connector_meta(None).reqs_to_recv == {}
    req = ve.Request("good", 20, dict(good))
    assert sched.get_num_new_matched_tokens(req, 0) == (20, True)
    sched.update_state_after_alloc(req, ve.KVCacheBlocks([3, 4]), 20)
    meta = sched.build_connector_meta(None).reqs_to_recv["good"]
    assert (meta.local_block_ids, meta.remote_block_ids, meta.remote_segment) == \
        ([3, 4], [1, 2], "vllm/p")
    # A prefill request aborted (not length-capped) frees at once.
    req = ve.Request("ab", 10, {"do_remote_decode": True})
    req.status = ve.RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [1]) == (False, None)
    assert "ab" in sched.build_connector_meta(None).reqs_not_processed


def prefill_ranks(tp_size, **extra):
    return [Prefill(tp_rank=r, tp_size=tp_size, **extra) for r in range(tp_size)]


def prefill_on_all(ranks, req_id, blocks, seed):
    """Every rank runs the request (vLLM's scheduler drives all workers);
    their kv_transfer_params are the same."""
    outs = [p.call("prefill", req_id, NUM_TOKENS, blocks, seed) for p in ranks]
    assert all(o == outs[0] for o in outs)
    delay, params = outs[0]
    assert delay is True and params["tp_size"] == len(ranks)
    return params


def not_sent(ranks, req_id, steps=3):
    for _ in range(steps):
        for p in ranks:
            assert req_id not in p.call("step")[0]
        time.sleep(0.02)


def test_vllm_prefill_tp2_into_decode_tp1(store):
    """Prefill TP=2 (two processes, one KV head each) -> decode TP=1: the
    decode opens both ranks as a set and reads each request through its
    plan; its blocks equal bitwise what a TP=1 prefill writes (all heads);
    each prefill rank frees only on its own read notice."""
    ranks = prefill_ranks(2)
    decode = ve.Engine("decode-engine", "kv_consumer", DECODE_BLOCKS)
    sync = ve.Engine("decode-sync", "kv_consumer", DECODE_BLOCKS, load_async=False)
    try:
        pblocks = [5, 9, 10, 11, 20]
        params = prefill_on_all(ranks, "req-h", pblocks, 7)
        # Each rank holds its head of the request: together, all of it.
        parts = [p.call("blocks", pblocks) for p in ranks]
        want = ve.full_blocks(len(pblocks), 7)
        assert torch.equal(torch.cat(parts, dim=4), want)
        not_sent(ranks, "req-h")
        local = [0, 3, 4, 7, 15]
        _, invalid = load(decode, "dec-h", params, local)
        assert invalid == set()
        assert torch.equal(decode.blocks(local), want)                 # bitwise
        assert not decode.blocks([b for b in range(DECODE_BLOCKS) if b not in local]).any()
        for p in ranks:
            assert p.call("steps_until_sent", "req-h", 10) == {"req-h"}
        s = decode.worker.connector_worker._sets[("vllm/prefill-engine", 2)]
        assert "reads head 1 (all it holds) of each block of vllm/prefill-engine/tp1" \
            in s.group.plan() and s.group.plan_info()["used"] == 2
        # In the step (load_async False): one set read, the first layer waits.
        params = prefill_on_all(ranks, "req-s", [1, 2, 3, 4, 30], 8)
        steps, invalid = load(sync, "dec-s", params, [10, 11, 12, 13, 14])
        assert steps == 1 and invalid == set()
        assert torch.equal(sync.blocks([10, 11, 12, 13, 14]), ve.full_blocks(5, 8))
        for p in ranks:
            assert p.call("steps_until_sent", "req-s", 10) == {"req-s"}
    finally:
        sync.close()
        decode.close()
        for p in ranks:
            p.stop()


def test_vllm_prefill_tp1_into_decode_tp2(store, caplog):
    """Prefill TP=1 -> decode TP=2 (two ranks, one KV head each): each
    decode rank reads its head slice of the prefill's blocks; the prefill
    frees only after both ranks' read notices (decode tp // prefill tp)."""
    prefill = Prefill()
    dec = [ve.Engine("decode-engine", "kv_consumer", DECODE_BLOCKS, tp_rank=r, tp_size=2)
           for r in range(2)]
    try:
        pblocks = [2, 4, 6, 8, 31]
        delay, params = prefill.call("prefill", "req-f", NUM_TOKENS, pblocks, 9)
        assert params["tp_size"] == 1
        want = ve.full_blocks(len(pblocks), 9)
        assert torch.equal(prefill.call("blocks", pblocks), want)
        local = [1, 5, 9, 13, 17]
        assert load(dec[0], "dec-f", params, local)[1] == set()
        assert torch.equal(dec[0].blocks(local), want[..., 0:1, :])
        # One of two readers: the prefill keeps the blocks.
        not_sent([prefill], "req-f", 5)
        assert load(dec[1], "dec-f", params, local)[1] == set()
        assert torch.equal(dec[1].blocks(local), want[..., 1:2, :])
        assert prefill.call("steps_until_sent", "req-f", 10) == {"req-f"}
        # What a TP-equal run gives: both halves together are the blocks.
        assert torch.equal(torch.cat([d.blocks(local) for d in dec], dim=4), want)
        # A request whose head slices would need a notice of more than 1024
        # ranges (NHD: one per token, layer and K/V; 9 blocks here): read
        # without a notice, the KV still arrives; the prefill keeps its
        # blocks (until its abort_request_timeout).
        pblocks, local = list(range(10, 20)), list(range(10, 20))
        delay, params = prefill.call("prefill", "req-l", NUM_TOKENS, pblocks, 10)
        for d in dec:
            assert load(d, "dec-l", params, local)[1] == set()
        assert torch.equal(torch.cat([d.blocks(local) for d in dec], dim=4),
                           ve.full_blocks(len(pblocks), 10))
        not_sent([prefill], "req-l", 5)
        assert "a read notice would list too many ranges for 10 blocks" in caplog.text
    finally:
        for d in dec:
            d.close()
        prefill.stop()


def test_vllm_killed_prefill_rank_gives_load_errors_for_its_blocks(store):
    """Prefill TP=2 -> decode TP=1 with prefill rank 1 killed: every local
    block was waiting for its head from rank 1, so all are load errors,
    reported within the transfer timeout; rank 0's read completed, and its
    notice frees its blocks."""
    ranks = prefill_ranks(2, lease_ms=120000)
    decode = ve.Engine("decode-engine", "kv_consumer", DECODE_BLOCKS, transfer_timeout=5,
                       open_timeout=2)
    try:
        params = prefill_on_all(ranks, "req-a", [1, 2, 3, 4, 5], 5)
        assert load(decode, "dec-a", params, [20, 21, 22, 23, 16])[1] == set()
        params = prefill_on_all(ranks, "req-k", [6, 7, 8, 9, 10], 4)
        os.kill(ranks[1].proc.pid, signal.SIGKILL)
        ranks[1].proc.join(10)
        start = time.monotonic()
        _, invalid = load(decode, "dec-k", params, [2, 3, 5, 8, 13], seconds=15)
        assert invalid == {2, 3, 5, 8, 13}
        assert time.monotonic() - start < 10
        assert decode.step() == (set(), set(), set())
        assert ranks[0].call("steps_until_sent", "req-k", 10) == {"req-k"}
    finally:
        decode.close()
        for p in ranks:
            p.stop()
