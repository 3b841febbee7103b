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
                       transports=transports)
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
        # Another tensor-parallel size: refused (equal TP only), load errors.
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
