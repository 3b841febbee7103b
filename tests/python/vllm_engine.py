"""A vLLM engine reduced to how it drives a V1 KV connector, for
test_vllm_connector.py (vLLM itself cannot be installed here).

Read from vLLM's source (github.com/vllm-project/vllm):
- vllm/distributed/kv_transfer/kv_connector/factory.py
  (KVConnectorFactory.get_connector_class: a connector not registered by
  name is importlib.import_module(kv_connector_module_path) then
  getattr(module, kv_connector); it is built as cls(vllm_config, role[,
  kv_cache_config]), once per role);
- vllm/v1/worker/kv_connector_model_runner_mixin.py, _get_kv_connector_output:
  each step the worker calls bind_connector_metadata, start_load_kv, (the
  forward: wait_for_layer_load per attention layer), wait_for_save,
  get_finished(finished_req_ids), get_block_ids_with_load_errors,
  get_kv_connector_stats, get_kv_connector_kv_cache_events,
  clear_connector_metadata;
- the scheduler's side as tests/v1/kv_connector/unit/
  test_remote_prefill_lifecycle.py and test_remote_decode_lifecycle.py walk
  it (commit 00a1bcb0b182449d102666f0ace6fda282d60df9): for a new request
  get_num_new_matched_tokens, then update_state_after_alloc with the
  allocated blocks, then build_connector_meta at the end of schedule();
  request_finished when a request ends, before its blocks are freed;
  update_connector_output with the workers' output.

The stand-ins below carry the attributes those calls use: VllmConfig
(kv_transfer_config, model_config, cache_config, parallel_config),
KVTransferConfig.get_from_extra_config, Request (request_id,
prompt_token_ids, kv_transfer_params, status), KVCacheBlocks
(get_block_ids, get_unhashed_block_ids).  Each layer's cache is
FlashAttention's [2, num_blocks, block_size, num_kv_heads, head_size].
"""
import enum
import importlib
import time
import traceback

import torch

from engine_proc import serve

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 16, 2, 8
DTYPE = torch.float16


class KVTransferConfig:
    def __init__(self, engine_id, kv_role, extra):
        self.kv_connector = "SegxferConnector"
        self.kv_connector_module_path = "segxfer.vllm"
        self.engine_id, self.kv_role = engine_id, kv_role
        self.kv_connector_extra_config = dict(extra)

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)


class ModelConfig:
    def __init__(self, model):
        self.model, self.dtype = model, DTYPE

    def get_total_num_kv_heads(self):
        return HEADS

    def get_head_size(self):
        return HEAD_DIM

    def get_total_num_hidden_layers(self):
        return LAYERS


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def vllm_config(engine_id, kv_role, model="test-model/v1", tp_size=1, **extra):
    """The worker's tp rank comes as extra config tp_rank: without vLLM
    there is no tensor-parallel group to ask (segxfer.vllm._tp)."""
    return _Config(kv_transfer_config=KVTransferConfig(engine_id, kv_role, extra),
                   model_config=ModelConfig(model),
                   cache_config=_Config(block_size=BLOCK_SIZE, cache_dtype="auto"),
                   parallel_config=_Config(tensor_parallel_size=tp_size, data_parallel_rank=0))


class RequestStatus(enum.Enum):
    """The names of vllm.v1.request.RequestStatus the connector compares."""
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


class Request:
    def __init__(self, request_id, num_tokens, kv_transfer_params):
        self.request_id = request_id
        self.prompt_token_ids = list(range(num_tokens))
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING


class KVCacheBlocks:
    """The allocated blocks of one request; none prefix-cached."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.ids)


def connector_class(kv_transfer_config):
    """KVConnectorFactory.get_connector_class for a connector vLLM does not
    register by name."""
    module = importlib.import_module(kv_transfer_config.kv_connector_module_path)
    return getattr(module, kv_transfer_config.kv_connector)


def prefill_data(num_blocks, seed, shape):
    """What a prefill's forward pass writes into num_blocks blocks of one
    layer: K and V of every KV head (shape: a block's [tokens, heads,
    head_dim]), the same at any tp size; each rank keeps its heads."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, num_blocks) + tuple(shape), generator=g).to(DTYPE)


def full_blocks(num_blocks, seed):
    """Engine.blocks of a TP=1 engine after prefill(..., seed): every KV
    head of num_blocks blocks, in every layer."""
    return torch.stack([prefill_data(num_blocks, seed * 1000 + i, (BLOCK_SIZE, HEADS, HEAD_DIM))
                        for i in range(LAYERS)])


class Engine:
    """One engine's rank tp_rank of tp_size: its scheduler-side and
    worker-side connector and its share of the KV heads, as vLLM's
    tensor-parallel workers hold them (HEADS // tp_size each)."""

    def __init__(self, engine_id, kv_role, num_blocks, device="cpu", tp_rank=0, tp_size=1,
                 **extra):
        from segxfer._vllm_base import KVConnectorRole
        cfg = vllm_config(engine_id, kv_role, tp_size=tp_size, tp_rank=tp_rank, **extra)
        self.heads = HEADS // tp_size
        self.head_first = tp_rank * self.heads
        cls = connector_class(cfg.kv_transfer_config)
        kv_cache_config = _Config(num_blocks=num_blocks)
        self.scheduler = cls(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = cls(cfg, KVConnectorRole.WORKER, kv_cache_config)
        self.kv_caches = {
            "model.layers.%d.self_attn.attn" % i:
            torch.zeros(2, num_blocks, BLOCK_SIZE, self.heads, HEAD_DIM, dtype=DTYPE,
                        device=device)
            for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv_caches)

    def step(self, finished_req_ids=()):
        """The end of schedule() and one model-runner step around a forward
        pass: (finished sending, finished receiving, invalid block ids)."""
        meta = self.scheduler.build_connector_meta(_Config(finished_req_ids=set()))
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(_Config())                 # the forward context
        for name in self.kv_caches:                # attention layers, in order
            w.wait_for_layer_load(name)
        w.wait_for_save()
        sending, recving = w.get_finished(set(finished_req_ids))
        invalid = w.get_block_ids_with_load_errors()
        w.get_kv_connector_stats()
        w.get_kv_connector_kv_cache_events()
        w.clear_connector_metadata()
        out = (set(sending or ()), set(recving or ()), set(invalid))
        self.scheduler.update_connector_output(_Config(finished_sending=out[0],
                                                       finished_recving=out[1],
                                                       invalid_block_ids=out[2]))
        return out

    def blocks(self, ids):
        """The K and V bytes of blocks ids in every layer, on the CPU."""
        return torch.stack([c[:, list(ids)].cpu() for c in self.kv_caches.values()])

    def prefill(self, req_id, num_tokens, block_ids, seed):
        """A prefill request with do_remote_decode and max_tokens 1: it is
        scheduled (matched tokens, allocation), computed (its blocks filled,
        as the forward pass writes them), and finishes length-capped; the
        next schedule() hands the workers reqs_to_send."""
        req = Request(req_id, num_tokens, {"do_remote_decode": True})
        assert self.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        self.scheduler.update_state_after_alloc(req, KVCacheBlocks(block_ids), 0)
        req.status = RequestStatus.RUNNING
        meta = self.scheduler.build_connector_meta(_Config(finished_req_ids=set()))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(_Config())
        # A generator per layer: every rank draws every head of it.
        for i, cache in enumerate(self.kv_caches.values()):
            data = prefill_data(len(block_ids), seed * 1000 + i, (BLOCK_SIZE, HEADS, HEAD_DIM))
            cache[:, block_ids] = data[..., self.head_first:self.head_first + self.heads,
                                       :].to(cache.device)
        self.worker.wait_for_save()
        self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return self.scheduler.request_finished(req, list(block_ids))

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()


def prefill_main(conn, num_blocks, device, extra):
    """A prefill engine process serving the test's requests on conn."""
    try:
        engine = Engine("prefill-engine", "kv_producer", num_blocks, device, **extra)
    except Exception:  # noqa: BLE001  (the first request reports it)
        failed = traceback.format_exc()
        conn.recv()
        conn.send(("error", failed))
        return

    def steps_until_sent(req_id, seconds):
        """Steps until req_id is reported sent (the set) or seconds pass (None)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sending, _, _ = engine.step()
            if req_id in sending:
                return sending
            time.sleep(0.01)
        return None

    serve(conn, {
        "prefill": engine.prefill, "step": engine.step, "steps_until_sent": steps_until_sent,
        "blocks": engine.blocks,
        "served_reads": lambda: engine.worker.connector_worker.agent.status()["served_reads"],
    }, engine.close)
